//! DCP's `.metadata` file: the [`crate::io::pickle`] machine with the metadata allow-list
//! ([`ALLOWED`]) and the objects `pickle.load` builds from it.
//!
//! `.metadata` is `pickle.dump(Metadata(...))`: dataclass instances (`NEWOBJ` + `BUILD`),
//! `torch.Size`, dtypes, the layout and memory-format encodings, and the `pathlib` path of
//! `storage_meta.checkpoint_id`. A planner may hang more of DCP's own objects on it: the
//! save plans of every rank (`SavePlan` of `WriteItem`s with their `TensorWriteData` or
//! `BytesIOWriteData`, `WriteItemType`, `FileSystemWriter`'s `_StoragePrefix`), and the
//! load-side `LoadPlan`, `ReadItem` and `LoadItemType` beside them. Megatron-Core's
//! `torch_dist` saves every rank's plan as `Metadata.all_local_plans`; PyTorch's loader reads
//! such a file and never looks at them, and neither does this reader (they are read as data
//! and dropped). Exactly those globals resolve; any other one (`os.system`,
//! `builtins.eval`, …) is refused with [`Error::UnsupportedPickleGlobal`] before anything is
//! built, and nothing is ever executed. PyTorch reads the file with Python's `pickle.load`,
//! whose dicts hash their keys: a key Python cannot hash fails the load here too.
//!
//! [`Error::UnsupportedPickleGlobal`]: crate::error::Error::UnsupportedPickleGlobal

use crate::error::Result;
use crate::io::pickle::{self, Dict, Format, Globals, Machine, Value, TORCH_LAYOUTS};
use crate::tensor::DType;
use crate::tensor::OTHER_TORCH_DTYPES;
use std::convert::Infallible;
use std::rc::Rc;

/// The DCP classes an instance may be of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    StorageInfo,
    MemFormatEncoding,
    SavePlan,
    LoadPlan,
    WriteItem,
    ReadItem,
    TensorWriteData,
    BytesIOWriteData,
    StoragePrefix,
    WriteItemType,
    LoadItemType,
}

impl Class {
    /// Whether the class is an `Enum` (built by `REDUCE` of its value, never by `NEWOBJ`).
    pub(crate) fn is_enum(self) -> bool {
        matches!(
            self,
            Class::MemFormatEncoding | Class::WriteItemType | Class::LoadItemType
        )
    }

    /// The fields a frozen dataclass hashes, in order, each with whether it has a default
    /// (a class attribute, which an instance lacking the attribute reads instead); `None`
    /// for a class whose instances Python cannot hash (a plain `@dataclass`: its generated
    /// `__eq__` removes `__hash__`).
    fn hashed_fields(self) -> Option<&'static [(&'static str, bool)]> {
        Some(match self {
            Class::MetadataIndex => &[("fqn", false), ("offset", true)],
            Class::BytesIOWriteData => &[("nbytes", false)],
            Class::TensorWriteData => &[("chunk", false), ("properties", false), ("size", false)],
            Class::WriteItem => &[
                ("index", false),
                ("type", false),
                ("bytes_io_data", true),
                ("tensor_data", true),
            ],
            Class::ReadItem => &[
                ("type", false),
                ("dest_index", false),
                ("dest_offsets", false),
                ("storage_index", false),
                ("storage_offsets", false),
                ("lengths", false),
            ],
            Class::SavePlan => &[
                ("items", false),
                ("storage_data", true),
                ("planner_data", true),
                ("usable", true),
            ],
            _ => return None,
        })
    }
}

/// The globals a `.metadata` stream may name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Global {
    Class(Class),
    Size,
    GetLayout,
    /// A `pathlib` path class (its instances are read as their string).
    Path,
    /// A `torch.<dtype>` by its name (`float32`, …).
    Dtype(&'static str),
    /// A `torch.<layout>` by its name (`strided`).
    Layout(&'static str),
}

/// A value on the stack or in the memo (a `.metadata` stream builds no values of its own).
pub(crate) type V = Value<Global, Infallible>;

/// A node of the arena: a tuple (also a `torch.Size`), list, dict or [`Instance`].
pub(crate) type Node = pickle::Node<Global, Infallible, Instance>;

/// An instance of a DCP class with its `BUILD` state (or its `REDUCE` argument, for the
/// memory-format enum).
#[derive(Debug)]
pub(crate) struct Instance(pub Class, pub Option<V>);

/// The result of unpickling: the root value and the arena it refers to.
pub(crate) struct Pickled {
    pub root: V,
    pub arena: Vec<Node>,
}

/// Deepest tuple nesting a dict key may have (a deeper one is refused as unhashable; Python
/// would recurse that deep to hash it).
const MAX_HASH_DEPTH: usize = 64;

/// The globals `.metadata` may name.
const ALLOWED: Globals<Global> = Globals { resolve };

/// The global `module.name`, if it is one `.metadata` may use.
fn resolve(module: &str, name: &str) -> Option<Global> {
    const MD: &str = "torch.distributed.checkpoint.metadata";
    const PLANNER: &str = "torch.distributed.checkpoint.planner";
    Some(match (module, name) {
        (MD, "Metadata") => Global::Class(Class::Metadata),
        (MD, "TensorStorageMetadata") => Global::Class(Class::TensorStorageMetadata),
        (MD, "BytesStorageMetadata") => Global::Class(Class::BytesStorageMetadata),
        (MD, "ChunkStorageMetadata") => Global::Class(Class::ChunkStorageMetadata),
        (MD, "TensorProperties") => Global::Class(Class::TensorProperties),
        (MD, "MetadataIndex") => Global::Class(Class::MetadataIndex),
        (MD, "StorageMeta") => Global::Class(Class::StorageMeta),
        (MD, "_MEM_FORMAT_ENCODING") => Global::Class(Class::MemFormatEncoding),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo") => {
            Global::Class(Class::StorageInfo)
        }
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix") => {
            Global::Class(Class::StoragePrefix)
        }
        (PLANNER, "SavePlan") => Global::Class(Class::SavePlan),
        (PLANNER, "LoadPlan") => Global::Class(Class::LoadPlan),
        (PLANNER, "WriteItem") => Global::Class(Class::WriteItem),
        (PLANNER, "ReadItem") => Global::Class(Class::ReadItem),
        (PLANNER, "TensorWriteData") => Global::Class(Class::TensorWriteData),
        (PLANNER, "BytesIOWriteData") => Global::Class(Class::BytesIOWriteData),
        (PLANNER, "WriteItemType") => Global::Class(Class::WriteItemType),
        (PLANNER, "LoadItemType") => Global::Class(Class::LoadItemType),
        ("torch", "Size") => Global::Size,
        ("torch.serialization", "_get_layout") => Global::GetLayout,
        ("torch", "strided") => Global::Layout("strided"),
        ("pathlib", "PosixPath" | "PurePosixPath" | "WindowsPath" | "PureWindowsPath") => {
            Global::Path
        }
        ("torch", n) => Global::Dtype(
            DType::from_torch_attr(n)
                .map(DType::torch_attr)
                .or_else(|| OTHER_TORCH_DTYPES.iter().copied().find(|d| *d == n))?,
        ),
        _ => return None,
    })
}

/// Runs the `.metadata` stream `data` (`file` names it in errors).
pub(crate) fn unpickle(file: &str, data: &[u8]) -> Result<Pickled> {
    let mut m = Machine::new(file, data, &ALLOWED, DcpMetadata);
    let root = m.run()?;
    Ok(Pickled {
        root,
        arena: m.into_arena(),
    })
}

/// The `.metadata` format of the machine.
struct DcpMetadata;

impl Format for DcpMetadata {
    type Global = Global;
    type Ext = Infallible;
    type Node = Instance;

    /// `torch.Size`, `_get_layout`, a `pathlib` path and the memory-format enum.
    fn reduce(m: &mut Machine<'_, Self>, f: Global, args: Vec<V>) -> Result<V> {
        reduce(m, f, &args)
    }

    /// `cls()` of a DCP dataclass (the memory-format enum is built by `REDUCE`).
    fn newobj(m: &mut Machine<'_, Self>, cls: Global, args: Vec<V>) -> Result<V> {
        match (cls, args.as_slice()) {
            (Global::Class(c), []) if !c.is_enum() => Ok(m.alloc(Node::Ext(Instance(c, None)))),
            _ => Err(m.err("NEWOBJ of something other than a DCP dataclass")),
        }
    }

    fn build(m: &mut Machine<'_, Self>, state: V) -> Result<()> {
        let i = m.top_obj()?;
        match m.node_mut(i) {
            Some(Node::Ext(Instance(_, s))) => {
                *s = Some(state);
                Ok(())
            }
            _ => Err(m.err("BUILD on something other than a DCP dataclass")),
        }
    }

    /// Every pair is kept: the readers of the metadata apply Python's dict semantics where
    /// they need them ([`super::metadata`], [`super::plan`]).
    fn set_item(dict: &mut Dict<Global, Infallible>, key: V, value: V) {
        dict.push(key, value);
    }

    fn check_key(m: &Machine<'_, Self>, key: &V) -> Result<()> {
        if hashable(m, key, 0) {
            return Ok(());
        }
        Err(m
            .err("a dict key is a list, a dict or a DCP dataclass instance (unhashable in Python)"))
    }

    fn ext_kind(x: &Infallible) -> String {
        match *x {}
    }

    fn node_kind(n: &Instance) -> String {
        format!("{:?}", n.0)
    }
}

/// Whether Python can hash `v`: not a list or dict; an enum member; an instance of a frozen
/// DCP dataclass (`MetadataIndex`, the planner's items and plans) whose hashed fields are
/// all there (or have a default) and hashable, as its generated `__hash__` hashes the tuple
/// of them; no instance of another DCP dataclass (their generated `__eq__` removes
/// `__hash__`); and a tuple only of such values.
fn hashable(m: &Machine<'_, DcpMetadata>, v: &V, depth: usize) -> bool {
    let V::Obj(_) = v else { return true };
    if depth >= MAX_HASH_DEPTH {
        return false;
    }
    match m.node(v) {
        Some(Node::List(_) | Node::Dict(_)) => false,
        Some(Node::Ext(Instance(c, _))) if c.is_enum() => true,
        Some(Node::Ext(Instance(c, state))) => c.hashed_fields().is_some_and(|fields| {
            fields.iter().all(|&(name, has_default)| {
                match state.as_ref().and_then(|s| attribute(m, s, name)) {
                    Some(x) => hashable(m, x, depth + 1),
                    None => has_default && state_is_a_dict_or_none(m, state.as_ref()),
                }
            })
        }),
        Some(Node::Tuple(items)) => items.iter().all(|x| hashable(m, x, depth + 1)),
        None => false,
    }
}

/// The value `BUILD` gave the attribute `name` (the last one set, as Python keeps it).
fn attribute<'m>(m: &'m Machine<'_, DcpMetadata>, state: &V, name: &str) -> Option<&'m V> {
    let Some(Node::Dict(d)) = m.node(state) else {
        return None;
    };
    d.items()
        .iter()
        .rev()
        .find(|(k, _)| matches!(k, V::Str(k) if &**k == name))
        .map(|(_, x)| x)
}

/// Whether an instance's `BUILD` state is a plain dict (or it had none), the only states
/// whose missing attributes fall back to the class defaults here; any other state reads as
/// unhashable.
fn state_is_a_dict_or_none(m: &Machine<'_, DcpMetadata>, state: Option<&V>) -> bool {
    match state {
        None => true,
        Some(s) => matches!(m.node(s), Some(Node::Dict(_))),
    }
}

/// `REDUCE` of the globals `.metadata` calls.
fn reduce(m: &mut Machine<'_, DcpMetadata>, f: Global, a: &[V]) -> Result<V> {
    match (f, a) {
        // Python's `torch.Size` takes negative ints too; where a size is used, it must
        // not be negative.
        (Global::Size, [t]) => {
            let dims = m
                .tuple_items(t)
                .filter(|d| d.iter().all(|x| matches!(x, V::Int(_))))
                .ok_or_else(|| m.err("torch.Size needs one tuple of ints"))?
                .to_vec();
            Ok(m.alloc(Node::Tuple(dims)))
        }
        (Global::GetLayout, [V::Str(s)]) if TORCH_LAYOUTS.contains(&&**s) => Ok(V::Str(s.clone())),
        (Global::GetLayout, [V::Str(s)]) => Err(m.err(format!(
            "`{}` is not a torch layout",
            crate::error::shown(s)
        ))),
        (Global::Path, parts) => {
            let mut s = String::new();
            for p in parts {
                let V::Str(p) = p else {
                    return Err(m.err("a pathlib path needs string parts"));
                };
                if !s.is_empty() && !s.ends_with('/') {
                    s.push('/');
                }
                s.push_str(p);
            }
            Ok(V::Str(Rc::from(s)))
        }
        // `_MEM_FORMAT_ENCODING(v)`: contiguous, channels-last or preserve; any other
        // value is a ValueError in Python.
        (Global::Class(Class::MemFormatEncoding), [v @ V::Int(0..=2)]) => Ok(m.alloc(Node::Ext(
            Instance(Class::MemFormatEncoding, Some(v.clone())),
        ))),
        // The planner's enums count from 1 (`auto()`): `WriteItemType` TENSOR, SHARD,
        // BYTE_IO; `LoadItemType` TENSOR, BYTE_IO.
        (Global::Class(c @ Class::WriteItemType), [v @ V::Int(1..=3)])
        | (Global::Class(c @ Class::LoadItemType), [v @ V::Int(1..=2)]) => {
            Ok(m.alloc(Node::Ext(Instance(c, Some(v.clone())))))
        }
        _ => Err(m.err("REDUCE of a global that takes no such arguments")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::pickle::op;

    /// `{KEY: 1}` as protocol-2 opcodes, with `key` the opcodes that push the key.
    fn dict_with_key(key: &[u8]) -> Vec<u8> {
        let mut p = vec![op::PROTO, 2, op::EMPTY_DICT, op::MARK];
        p.extend_from_slice(key);
        p.extend_from_slice(&[op::BININT1, 1, op::SETITEMS, op::STOP]);
        p
    }

    #[test]
    fn a_dict_key_python_cannot_hash_is_refused_and_a_tuple_of_ints_is_not() {
        // `[]`, `{}`, `([],)` (TUPLE1 of an empty list) as keys: a TypeError in Python.
        for (what, key) in [
            ("list", vec![op::EMPTY_LIST]),
            ("dict", vec![op::EMPTY_DICT]),
            ("tuple of a list", vec![op::EMPTY_LIST, op::TUPLE1]),
        ] {
            let e = unpickle("m", &dict_with_key(&key)).err();
            assert!(
                e.is_some_and(|e| e.to_string().contains("unhashable")),
                "a {what} key"
            );
        }
        // `(7,)`.
        assert!(unpickle("m", &dict_with_key(&[op::BININT1, 7, op::TUPLE1])).is_ok());
    }

    #[test]
    fn equal_dict_keys_are_all_kept_in_order() {
        // {'a': 1, 'a': 2} as SETITEMS: the readers of the metadata see both pairs.
        let p = unpickle(
            "m",
            b"\x80\x02}(X\x01\x00\x00\x00aK\x01X\x01\x00\x00\x00aK\x02u.",
        )
        .unwrap();
        let Some(Node::Dict(d)) = p.arena.first() else {
            panic!("not a dict")
        };
        assert!(matches!(d.items(), [(_, V::Int(1)), (_, V::Int(2))]));
    }

    #[test]
    fn pop_at_a_mark_long4_and_persistent_ids_are_what_pickle_load_makes_of_them() {
        // pickle.loads(b'\x80\x02(0\x8b\x01\x00\x00\x00\x05.') == 5.
        let p = unpickle("m", b"\x80\x02(0\x8b\x01\x00\x00\x00\x05.").unwrap();
        assert!(matches!(p.root, V::Int(5)));
        // "A load persistent id instruction was encountered, but no persistent_load function
        // was specified", whatever the stack holds.
        let e = unpickle("m", b"\x80\x02Q.").err();
        assert!(
            matches!(&e, Some(crate::error::Error::UnsupportedPickleOpcode { name, .. }) if name == "BINPERSID"),
            "{e:?}"
        );
    }

    /// `torch.distributed.checkpoint.planner.NAME` as a protocol-2 GLOBAL.
    fn planner(name: &str) -> Vec<u8> {
        [
            b"ctorch.distributed.checkpoint.planner\n",
            name.as_bytes(),
            b"\n",
        ]
        .concat()
    }

    /// `{KEY: 1}` where KEY is an instance of the planner's `class` whose BUILD state is the
    /// dict the opcodes `state` fill.
    fn planner_key(class: &str, state: &[u8]) -> Vec<u8> {
        let mut key = planner(class);
        key.extend_from_slice(&[op::EMPTY_TUPLE, op::NEWOBJ, op::EMPTY_DICT]);
        key.extend_from_slice(state);
        key.push(op::BUILD);
        dict_with_key(&key)
    }

    #[test]
    fn a_frozen_plan_item_is_a_dict_key_python_hashes_only_when_every_hashed_field_is() {
        // What Python 3.11 did with each (pickle.loads): `SavePlan(items=())` hashes;
        // `items=[]` is "unhashable type: 'list'"; a `WriteItem` without attributes is
        // "'WriteItem' object has no attribute 'index'" (no default to fall back on).
        let items = |v: u8| [&b"X\x05\x00\x00\x00items"[..], &[v, op::SETITEM]].concat();
        assert!(unpickle("m", &planner_key("SavePlan", &items(op::EMPTY_TUPLE))).is_ok());
        for (what, p) in [
            (
                "a list field",
                planner_key("SavePlan", &items(op::EMPTY_LIST)),
            ),
            ("a missing field", planner_key("WriteItem", &[])),
            (
                "a plain dataclass",
                planner_key("LoadPlan", &items(op::EMPTY_TUPLE)),
            ),
        ] {
            let e = unpickle("m", &p).err();
            assert!(
                e.is_some_and(|e| e.to_string().contains("unhashable")),
                "{what}"
            );
        }
    }

    #[test]
    fn the_planners_enums_take_the_values_python_gives_their_members() {
        let member = |class: &str, v: u8| {
            [
                &[op::PROTO, 2][..],
                &planner(class),
                &[op::BININT1, v, op::TUPLE1, op::REDUCE, op::STOP],
            ]
            .concat()
        };
        // WriteItemType: TENSOR, SHARD, BYTE_IO are 1, 2, 3; LoadItemType: TENSOR, BYTE_IO.
        for v in 1..=3 {
            assert!(unpickle("m", &member("WriteItemType", v)).is_ok(), "{v}");
        }
        // "4 is not a valid WriteItemType", "3 is not a valid LoadItemType" in Python.
        assert!(unpickle("m", &member("WriteItemType", 4)).is_err());
        assert!(unpickle("m", &member("LoadItemType", 3)).is_err());
        assert!(unpickle("m", &member("LoadItemType", 0)).is_err());
        // `WriteItemType()` by NEWOBJ: "Enum.__new__() missing 1 required positional
        // argument" in Python.
        let newobj = [
            &[op::PROTO, 2][..],
            &planner("WriteItemType"),
            &[op::EMPTY_TUPLE, op::NEWOBJ, op::STOP],
        ]
        .concat();
        assert!(unpickle("m", &newobj).is_err());
    }
}
