//! [`PyObj`]: the Python values a `torch.save` file of a state dict holds.

use crate::error::Result;
use crate::io::pickle::long;
use crate::optim_state::ShardedTensor;
use crate::tensor::{DType, HostTensor};

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
    /// ([`crate::commands::rank_dicts::consolidate_sharded`]) to get the full tensors. Boxed, so that
    /// every other value stays small (a state dict of a million tensors holds a million).
    Sharded(Box<ShardedTensor<HostTensor>>),
    /// A tensor that is more than its dense values: an `nn.Parameter`, a tensor with
    /// `requires_grad` or Python attributes (FSDP1's full state dict marks its tensors with
    /// `_has_been_cloned`), or a sparse, quantized or meta tensor.
    RichTensor(Box<RichTensor>),
    /// `complex`: real and imaginary parts.
    Complex(f64, f64),
    /// `set`, in the stream's order.
    Set(Vec<PyObj>),
    /// `bytearray`.
    ByteArray(Vec<u8>),
    /// `collections.Counter`, in order.
    Counter(Vec<(PyObj, PyObj)>),
    /// `torch.device(type, index)`, e.g. `("cuda", Some(0))`.
    Device(String, Option<i64>),
    /// A `torch` constant held as a value: a dtype (`torch.bfloat16`, including those the
    /// crate holds no tensors of, such as `torch.uint4`), a layout (`torch.sparse_coo`) or a
    /// quantization scheme (`torch.per_tensor_affine`), by its Python name.
    TorchConst(String),
}

/// A tensor with what `torch.load` keeps besides its values ([`PyObj::RichTensor`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RichTensor {
    /// The values.
    pub value: TensorValue,
    /// `tensor.requires_grad`.
    pub requires_grad: bool,
    /// Whether it is an `nn.Parameter` (`_rebuild_parameter`) rather than a plain tensor.
    pub parameter: bool,
    /// Python attributes set on it (`tensor.__dict__`), in order.
    pub attrs: Vec<(String, PyObj)>,
}

/// The values of a [`RichTensor`], by layout.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorValue {
    /// A dense (strided) tensor.
    Dense(HostTensor),
    /// `torch.sparse_coo`: `indices` (`int64`, `[sparse_dims, nnz]`), `values`
    /// (`[nnz, dense dims…]`), the tensor's size, and whether it was saved coalesced
    /// (`None` for files older than that flag).
    SparseCoo {
        /// `int64`, `[sparse_dims, nnz]`.
        indices: HostTensor,
        /// `[nnz, dense dims…]`.
        values: HostTensor,
        /// The size of the tensor.
        size: Vec<usize>,
        /// `tensor.is_coalesced()` as saved (`None` in files older than the flag).
        coalesced: Option<bool>,
    },
    /// A compressed sparse layout (CSR, CSC, BSR, BSC): compressed and plain indices, the
    /// values, and the tensor's size.
    SparseCompressed {
        /// Which compressed layout.
        layout: SparseLayout,
        /// `crow_indices` (CSR, BSR) or `ccol_indices` (CSC, BSC).
        compressed_indices: HostTensor,
        /// `col_indices` or `row_indices`.
        plain_indices: HostTensor,
        /// The stored values (blocks for BSR / BSC).
        values: HostTensor,
        /// The size of the tensor.
        size: Vec<usize>,
    },
    /// A quantized tensor.
    Quantized(QuantizedTensor),
    /// A tensor on the `meta` device: a dtype, size and stride, and no data.
    Meta {
        /// Its dtype.
        dtype: DType,
        /// Its size.
        size: Vec<usize>,
        /// Its stride.
        stride: Vec<usize>,
    },
}

/// The compressed sparse layouts, by PyTorch's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparseLayout {
    /// `torch.sparse_csr`
    Csr,
    /// `torch.sparse_csc`
    Csc,
    /// `torch.sparse_bsr`
    Bsr,
    /// `torch.sparse_bsc`
    Bsc,
}

impl SparseLayout {
    /// All of them.
    pub const ALL: [SparseLayout; 4] = [
        SparseLayout::Csr,
        SparseLayout::Csc,
        SparseLayout::Bsr,
        SparseLayout::Bsc,
    ];

    /// PyTorch's name, e.g. `torch.sparse_csr`.
    pub fn torch_name(self) -> &'static str {
        match self {
            SparseLayout::Csr => "torch.sparse_csr",
            SparseLayout::Csc => "torch.sparse_csc",
            SparseLayout::Bsr => "torch.sparse_bsr",
            SparseLayout::Bsc => "torch.sparse_bsc",
        }
    }
}

/// A quantized tensor: its integer values and how they map to reals.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    /// The quantized dtype.
    pub dtype: QDType,
    /// The integer values (`tensor.int_repr()`): `int8` for `qint8`, `uint8` for `quint8`,
    /// `int32` for `qint32`.
    pub int_repr: HostTensor,
    /// The quantization parameters.
    pub scheme: QScheme,
}

/// The quantized dtypes `torch.save` stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QDType {
    /// `torch.qint8`
    QInt8,
    /// `torch.quint8`
    QUInt8,
    /// `torch.qint32`
    QInt32,
}

impl QDType {
    /// All of them.
    pub const ALL: [QDType; 3] = [QDType::QInt8, QDType::QUInt8, QDType::QInt32];

    /// PyTorch's name, e.g. `torch.qint8`.
    pub fn torch_name(self) -> &'static str {
        match self {
            QDType::QInt8 => "torch.qint8",
            QDType::QUInt8 => "torch.quint8",
            QDType::QInt32 => "torch.qint32",
        }
    }

    /// The typed storage class `torch.save` pickles for it (`QInt8Storage`).
    pub fn storage_class(self) -> &'static str {
        match self {
            QDType::QInt8 => "QInt8Storage",
            QDType::QUInt8 => "QUInt8Storage",
            QDType::QInt32 => "QInt32Storage",
        }
    }

    /// The integer dtype of its values.
    pub fn int_dtype(self) -> DType {
        match self {
            QDType::QInt8 => DType::I8,
            QDType::QUInt8 => DType::U8,
            QDType::QInt32 => DType::I32,
        }
    }
}

/// Quantization parameters, as `_rebuild_qtensor` takes them.
#[derive(Debug, Clone, PartialEq)]
pub enum QScheme {
    /// `torch.per_tensor_affine`: one scale and zero point.
    PerTensorAffine {
        /// `q_scale()`.
        scale: f64,
        /// `q_zero_point()`.
        zero_point: i64,
    },
    /// `torch.per_channel_affine` (`float_qparams` false) or
    /// `torch.per_channel_affine_float_qparams` (true): a scale and zero point per index of
    /// `axis`, as tensors.
    PerChannel {
        /// Whether the scheme is `per_channel_affine_float_qparams`: the zero points are
        /// floats (their dtype decides it when PyTorch rebuilds the tensor).
        float_qparams: bool,
        /// `q_per_channel_scales()`.
        scales: HostTensor,
        /// `q_per_channel_zero_points()`.
        zero_points: HostTensor,
        /// `q_per_channel_axis()`.
        axis: i64,
    },
}

impl RichTensor {
    /// What it is, for messages: "sparse COO tensor", "quantized tensor (torch.qint8)", …
    pub fn kind(&self) -> String {
        match &self.value {
            TensorValue::Dense(_) if self.parameter => "Parameter".into(),
            TensorValue::Dense(_) => "Tensor".into(),
            TensorValue::SparseCoo { .. } => "sparse COO tensor".into(),
            TensorValue::SparseCompressed { layout, .. } => {
                format!("sparse tensor ({})", layout.torch_name())
            }
            TensorValue::Quantized(q) => format!("quantized tensor ({})", q.dtype.torch_name()),
            TensorValue::Meta { .. } => "meta tensor".into(),
        }
    }

    /// The size of the tensor it stands for.
    pub fn size(&self) -> &[usize] {
        match &self.value {
            TensorValue::Dense(t) => t.shape(),
            TensorValue::SparseCoo { size, .. } | TensorValue::SparseCompressed { size, .. } => {
                size
            }
            TensorValue::Quantized(q) => q.int_repr.shape(),
            TensorValue::Meta { size, .. } => size,
        }
    }

    /// The dtype name of its elements, as PyTorch prints it.
    pub fn dtype_name(&self) -> &'static str {
        match &self.value {
            TensorValue::Dense(t) => t.dtype().torch_name(),
            TensorValue::SparseCoo { values, .. }
            | TensorValue::SparseCompressed { values, .. } => values.dtype().torch_name(),
            TensorValue::Quantized(q) => q.dtype.torch_name(),
            TensorValue::Meta { dtype, .. } => dtype.torch_name(),
        }
    }

    /// The refusal of a format that holds only dense tensors (`format` names it) to store
    /// this one, found at `path` in the object.
    pub(crate) fn not_storable(&self, path: &str, format: &str) -> crate::error::Error {
        crate::error::Error::TensorNotStorable {
            tensor: if path.is_empty() {
                "<root>".into()
            } else {
                path.into()
            },
            shape: self.size().to_vec(),
            reason: format!(
                "it is a {}; {format} stores only dense tensors",
                self.kind()
            ),
        }
    }

    /// Its dense values, if it is dense.
    pub fn dense(&self) -> Option<&HostTensor> {
        match &self.value {
            TensorValue::Dense(t) => Some(t),
            _ => None,
        }
    }

    /// Every tensor it holds (values, indices, quantization parameters), in a fixed order.
    pub fn tensors(&self) -> Vec<&HostTensor> {
        match &self.value {
            TensorValue::Dense(t) => vec![t],
            TensorValue::SparseCoo {
                indices, values, ..
            } => vec![indices, values],
            TensorValue::SparseCompressed {
                compressed_indices,
                plain_indices,
                values,
                ..
            } => vec![compressed_indices, plain_indices, values],
            TensorValue::Quantized(q) => match &q.scheme {
                QScheme::PerTensorAffine { .. } => vec![&q.int_repr],
                QScheme::PerChannel {
                    scales,
                    zero_points,
                    ..
                } => vec![&q.int_repr, scales, zero_points],
            },
            TensorValue::Meta { .. } => vec![],
        }
    }
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
            PyObj::RichTensor(r) if r.parameter => "Parameter",
            PyObj::RichTensor(_) => "Tensor",
            PyObj::Complex(..) => "complex",
            PyObj::Set(_) => "set",
            PyObj::ByteArray(_) => "bytearray",
            PyObj::Counter(_) => "collections.Counter",
            PyObj::Device(..) => "torch.device",
            PyObj::TorchConst(_) => "torch constant",
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
            PyObj::RichTensor(r) => format!("{} {:?} ({})", r.kind(), r.size(), r.dtype_name()),
            PyObj::TorchConst(name) => name.clone(),
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

    /// The dense values of a tensor: a [`PyObj::Tensor`], or a dense [`PyObj::RichTensor`]
    /// (a Parameter, a tensor with attributes), whose extras a format of values drops.
    pub fn dense_tensor(&self) -> Option<&HostTensor> {
        match self {
            PyObj::Tensor(t) => Some(t),
            PyObj::RichTensor(r) => r.dense(),
            _ => None,
        }
    }

    /// This object as a format that holds tensor values only (DCP, this crate's checkpoint)
    /// stores it: Parameters and tensors with `requires_grad` or attributes become their
    /// plain values, as `dcp.save` stores them. A sparse, quantized or meta tensor, which
    /// such a format has no place for, is an error naming its path and kind. Borrowed when
    /// nothing changes.
    pub fn values_only(&self, format: &str) -> Result<std::borrow::Cow<'_, PyObj>> {
        use std::borrow::Cow;
        fn walk(o: &PyObj, path: &str, format: &str) -> Result<Option<PyObj>> {
            let at = |seg: &str| {
                if path.is_empty() {
                    seg.to_string()
                } else {
                    format!("{path}.{seg}")
                }
            };
            let seq = |items: &[PyObj]| -> Result<Option<Vec<PyObj>>> {
                let mut out: Option<Vec<PyObj>> = None;
                for (i, x) in items.iter().enumerate() {
                    if let Some(y) = walk(x, &at(&i.to_string()), format)? {
                        out.get_or_insert_with(|| items.to_vec())[i] = y;
                    }
                }
                Ok(out)
            };
            let pairs = |items: &[(PyObj, PyObj)]| -> Result<Option<Vec<(PyObj, PyObj)>>> {
                let mut out: Option<Vec<(PyObj, PyObj)>> = None;
                for (i, (k, v)) in items.iter().enumerate() {
                    let seg = match k {
                        PyObj::Str(s) => s.clone(),
                        other => other.describe(),
                    };
                    if let Some(y) = walk(v, &at(&seg), format)? {
                        out.get_or_insert_with(|| items.to_vec())[i].1 = y;
                    }
                }
                Ok(out)
            };
            Ok(match o {
                PyObj::RichTensor(r) => match r.dense() {
                    Some(t) => Some(PyObj::Tensor(t.clone())),
                    None => return Err(r.not_storable(path, format)),
                },
                PyObj::Tuple(v) => seq(v)?.map(PyObj::Tuple),
                PyObj::List(v) => seq(v)?.map(PyObj::List),
                PyObj::Set(v) => seq(v)?.map(PyObj::Set),
                PyObj::Dict(items) => pairs(items)?.map(PyObj::Dict),
                PyObj::Counter(items) => pairs(items)?.map(PyObj::Counter),
                PyObj::OrderedDict { items, attrs } => {
                    pairs(items)?.map(|items| PyObj::OrderedDict {
                        items,
                        attrs: attrs.clone(),
                    })
                }
                _ => None,
            })
        }
        Ok(match walk(self, "", format)? {
            Some(o) => Cow::Owned(o),
            None => Cow::Borrowed(self),
        })
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
            (PyObj::Dict(a), PyObj::Dict(b)) | (PyObj::Counter(a), PyObj::Counter(b)) => {
                pairs(a, b)
            }
            (PyObj::Set(a), PyObj::Set(b)) => seq(a, b),
            (PyObj::Complex(a, b), PyObj::Complex(c, d)) => {
                a.to_bits() == c.to_bits() && b.to_bits() == d.to_bits()
            }
            (PyObj::RichTensor(a), PyObj::RichTensor(b)) => {
                a.value == b.value
                    && a.requires_grad == b.requires_grad
                    && a.parameter == b.parameter
                    && a.attrs.len() == b.attrs.len()
                    && a.attrs
                        .iter()
                        .zip(&b.attrs)
                        .all(|((k1, v1), (k2, v2))| k1 == k2 && v1.bit_eq(v2))
            }
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
