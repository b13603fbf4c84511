//! DCP's `.metadata` file: the [`crate::io::pickle`] machine with the metadata allow-list
//! ([`ALLOWED`]) and the objects `pickle.load` builds from it.
//!
//! `.metadata` is `pickle.dump(Metadata(...))`: dataclass instances (`NEWOBJ` + `BUILD`),
//! `torch.Size`, dtypes, the layout and memory-format encodings, and the `pathlib` path of
//! `storage_meta.checkpoint_id`. Exactly those globals resolve; any other one (`os.system`,
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
            (Global::Class(c), []) if c != Class::MemFormatEncoding => {
                Ok(m.alloc(Node::Ext(Instance(c, None))))
            }
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

/// Whether Python can hash `v`: not a list or dict, not an instance of DCP's dataclasses
/// (their generated `__eq__` removes `__hash__`) except the frozen `MetadataIndex` and the
/// memory-format enum, and a tuple only of such values.
fn hashable(m: &Machine<'_, DcpMetadata>, v: &V, depth: usize) -> bool {
    let V::Obj(_) = v else { return true };
    match m.node(v) {
        Some(Node::List(_) | Node::Dict(_)) => false,
        Some(Node::Ext(Instance(c, _))) => {
            matches!(c, Class::MetadataIndex | Class::MemFormatEncoding)
        }
        Some(Node::Tuple(items)) => {
            depth < MAX_HASH_DEPTH && items.iter().all(|x| hashable(m, x, depth + 1))
        }
        None => false,
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
}
