//! [`PyObj`]: the Python values a `torch.save` file of a state dict holds.

use crate::io::pickle::long;
use crate::optim_state::ShardedTensor;
use crate::tensor::HostTensor;

/// A Python object as `torch.save` stores it: the containers and scalars of state dicts, and
/// tensors.
///
/// Dicts keep their insertion order, as Python's do. Equality is structural; tensors compare
/// bit for bit, floats with `==` (so a `NaN` float differs from itself; use
/// [`PyObj::bit_eq`] to compare bits).
#[derive(Debug, Clone, PartialEq)]
pub enum PyObj {
    /// `None`.
    None,
    /// `bool`.
    Bool(bool),
    /// An `int` that fits in 64 bits.
    Int(i64),
    /// An `int` outside the 64-bit range, as minimal little-endian two's-complement bytes
    /// (the payload of pickle's `LONG1`).
    BigInt(Vec<u8>),
    /// `float`.
    Float(f64),
    /// `str`.
    Str(String),
    /// `bytes`.
    Bytes(Vec<u8>),
    /// `tuple`.
    Tuple(Vec<PyObj>),
    /// `torch.Size`, a tuple of dimensions (model and optimizer states and DTensor metadata
    /// hold them); written back as a `torch.Size`, not a plain tuple.
    Size(Vec<i64>),
    /// `list`.
    List(Vec<PyObj>),
    /// `dict`, in insertion order.
    Dict(Vec<(PyObj, PyObj)>),
    /// `collections.OrderedDict`, in order, with the instance attributes set on it (a model
    /// state dict carries `_metadata` there).
    OrderedDict {
        /// The items.
        items: Vec<(PyObj, PyObj)>,
        /// Instance attributes (`obj.__dict__`), in order.
        attrs: Vec<(String, PyObj)>,
    },
    /// A `torch.Tensor` (read to host memory whatever device it was saved from).
    Tensor(HostTensor),
    /// A distributed tensor as one rank saved it: FSDP1's `ShardedTensor`
    /// (`SHARDED_STATE_DICT`) or FSDP2's `DTensor`, read as this rank's local shard, the
    /// global shape and the shard's offsets. Consolidate the ranks' files
    /// ([`crate::offline::consolidate_sharded`]) to get the full tensors.
    Sharded(ShardedTensor<HostTensor>),
}

impl PyObj {
    /// Python's type name, for messages: `int`, `dict`, `collections.OrderedDict`, `Tensor`, …
    pub fn type_name(&self) -> &'static str {
        match self {
            PyObj::None => "None",
            PyObj::Bool(_) => "bool",
            PyObj::Int(_) | PyObj::BigInt(_) => "int",
            PyObj::Float(_) => "float",
            PyObj::Str(_) => "str",
            PyObj::Bytes(_) => "bytes",
            PyObj::Tuple(_) => "tuple",
            PyObj::Size(_) => "torch.Size",
            PyObj::List(_) => "list",
            PyObj::Dict(_) => "dict",
            PyObj::OrderedDict { .. } => "collections.OrderedDict",
            PyObj::Tensor(_) => "Tensor",
            PyObj::Sharded(_) => "sharded tensor",
        }
    }

    /// A short description for messages: the type, plus the value of scalars and the shape
    /// and dtype of tensors.
    pub fn describe(&self) -> String {
        match self {
            PyObj::Int(i) => format!("int {i}"),
            PyObj::BigInt(_) => "int outside the 64-bit range".into(),
            PyObj::Float(x) => format!("float {x:?}"),
            PyObj::Bool(b) => format!("bool {}", if *b { "True" } else { "False" }),
            PyObj::Str(s) if s.len() <= 40 => format!("str {s:?}"),
            PyObj::Tensor(t) => format!("Tensor {:?} ({})", t.shape(), t.dtype()),
            other => other.type_name().into(),
        }
    }

    /// An `int` from a 128-bit value: [`PyObj::Int`] when it fits, else [`PyObj::BigInt`].
    pub fn int(v: i128) -> PyObj {
        match i64::try_from(v) {
            Ok(i) => PyObj::Int(i),
            Err(_) => PyObj::BigInt(long::encode(v)),
        }
    }

    /// The value of an `int` if it fits in 128 bits.
    pub fn as_i128(&self) -> Option<i128> {
        match self {
            PyObj::Int(i) => Some(i128::from(*i)),
            PyObj::Bool(b) => Some(i128::from(*b)),
            PyObj::BigInt(b) if b.len() <= 16 => {
                let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
                    0xff
                } else {
                    0
                };
                let mut a = [fill; 16];
                a[..b.len()].copy_from_slice(b);
                Some(i128::from_le_bytes(a))
            }
            _ => None,
        }
    }

    /// The items of a `dict` or `OrderedDict`.
    pub fn dict_items(&self) -> Option<&[(PyObj, PyObj)]> {
        match self {
            PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => Some(items),
            _ => None,
        }
    }

    /// The value under the `str` key `key` of a `dict` or `OrderedDict`.
    pub fn get(&self, key: &str) -> Option<&PyObj> {
        self.dict_items()?
            .iter()
            .find(|(k, _)| matches!(k, PyObj::Str(s) if s == key))
            .map(|(_, v)| v)
    }

    /// Structural equality where floats compare by bits (so `NaN` equals itself).
    pub fn bit_eq(&self, other: &PyObj) -> bool {
        fn pairs(a: &[(PyObj, PyObj)], b: &[(PyObj, PyObj)]) -> bool {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|((k1, v1), (k2, v2))| k1.bit_eq(k2) && v1.bit_eq(v2))
        }
        fn seq(a: &[PyObj], b: &[PyObj]) -> bool {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bit_eq(y))
        }
        match (self, other) {
            (PyObj::Float(a), PyObj::Float(b)) => a.to_bits() == b.to_bits(),
            (PyObj::Tuple(a), PyObj::Tuple(b)) | (PyObj::List(a), PyObj::List(b)) => seq(a, b),
            (PyObj::Dict(a), PyObj::Dict(b)) => pairs(a, b),
            (
                PyObj::OrderedDict { items: a, attrs: x },
                PyObj::OrderedDict { items: b, attrs: y },
            ) => {
                pairs(a, b)
                    && x.len() == y.len()
                    && x.iter()
                        .zip(y)
                        .all(|((k1, v1), (k2, v2))| k1 == k2 && v1.bit_eq(v2))
            }
            (a, b) => a == b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_ints_round_trip_through_their_long_bytes() {
        for v in [
            0i128,
            1,
            -1,
            127,
            128,
            -128,
            -129,
            1 << 63,
            -(1 << 63) - 1,
            i128::MAX,
            i128::MIN,
        ] {
            assert_eq!(PyObj::int(v).as_i128(), Some(v), "{v}");
        }
    }
}
