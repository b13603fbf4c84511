//! A restricted pickle machine for DCP's `.metadata` file.
//!
//! `.metadata` is `pickle.dump(Metadata(...))`: dataclass instances (`NEWOBJ` + `BUILD`),
//! `torch.Size`, dtypes, the layout and memory-format encodings, and the `pathlib` path of
//! `storage_meta.checkpoint_id`. Exactly those globals resolve; any other one (`os.system`,
//! `builtins.eval`, …) is refused with [`Error::UnsupportedPickleGlobal`] before anything is
//! built, and nothing is ever executed. Objects live in an arena addressed by index, so memory
//! stays proportional to the stream's length.

use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::tensor::OTHER_TORCH_DTYPES;
use std::collections::HashMap;
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

/// A value on the stack or in the memo.
#[derive(Debug, Clone)]
pub(crate) enum V {
    None,
    /// A bool (its value is never needed).
    Bool,
    Int(i64),
    /// An int outside 64 bits (never meaningful in DCP metadata; kept to report it).
    BigInt,
    /// A float (its value is never needed).
    Float,
    Str(Rc<str>),
    /// A bytes object (its content is never needed).
    Bytes,
    Global(Global),
    /// A node of the arena.
    Obj(usize),
}

/// A container or instance.
#[derive(Debug)]
pub(crate) enum Node {
    Tuple(Vec<V>),
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    /// An instance of a DCP class with its `BUILD` state (or its `REDUCE` argument, for the
    /// memory-format enum).
    Instance(Class, Option<V>),
}

/// The result of unpickling: the root value and the arena it refers to.
pub(crate) struct Pickled {
    pub root: V,
    pub arena: Vec<Node>,
}

/// Deepest tuple nesting a dict key may have (a deeper one is refused as unhashable; Python
/// would recurse that deep to hash it).
const MAX_HASH_DEPTH: usize = 64;

/// The names `torch.serialization._get_layout` knows: `str()` of each `torch.layout` of
/// PyTorch 2.13. Any other name is a `KeyError` there.
const LAYOUTS: &[&str] = &[
    "torch.strided",
    "torch.sparse_coo",
    "torch.sparse_csr",
    "torch.sparse_csc",
    "torch.sparse_bsr",
    "torch.sparse_bsc",
    "torch._mkldnn",
    "torch.jagged",
];

/// The global `module.name`, if it is one `.metadata` may use.
pub(crate) fn resolve(module: &str, name: &str) -> Option<Global> {
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
    let mut vm = Vm {
        file,
        data,
        pos: 0,
        op_pos: 0,
        op: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        arena: Vec::new(),
    };
    let root = vm.run()?;
    Ok(Pickled {
        root,
        arena: vm.arena,
    })
}

struct Vm<'a> {
    file: &'a str,
    data: &'a [u8],
    pos: usize,
    op_pos: usize,
    op: u8,
    stack: Vec<V>,
    marks: Vec<usize>,
    memo: HashMap<u32, V>,
    arena: Vec<Node>,
}

impl Vm<'_> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Pickle {
            file: self.file.to_string(),
            offset: self.op_pos,
            opcode: format!("0x{:02x}", self.op),
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let left = self.data.len() - self.pos;
        if n > left {
            return Err(self.err(format!("truncated: needs {n} bytes, {left} left")));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len_of(&mut self, width: usize) -> Result<usize> {
        let n = match width {
            1 => u64::from(self.arr::<1>()?[0]),
            4 => u64::from(u32::from_le_bytes(self.arr()?)),
            _ => u64::from_le_bytes(self.arr()?),
        };
        usize::try_from(n).map_err(|_| self.err(format!("length {n} too large")))
    }

    fn str_of(&mut self, n: usize) -> Result<V> {
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(V::Str(Rc::from(s))),
            Err(e) => Err(self.err(format!("string is not valid UTF-8: {e}"))),
        }
    }

    fn line(&mut self) -> Result<String> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.err("truncated: unterminated line"));
        };
        let s = std::str::from_utf8(&rest[..n])
            .map_err(|_| self.err("global name is not UTF-8"))?
            .to_string();
        self.pos += n + 1;
        Ok(s)
    }

    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<V> {
        if self.stack.len() <= self.base() {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked non-empty"))
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<V>> {
        if self.stack.len() < self.base() + n {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.split_off(self.stack.len() - n))
    }

    fn pop_mark(&mut self) -> Result<Vec<V>> {
        let Some(m) = self.marks.pop() else {
            return Err(self.err("no MARK on the stack"));
        };
        Ok(self.stack.split_off(m.min(self.stack.len())))
    }

    fn top(&self) -> Result<&V> {
        if self.stack.len() <= self.base() {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.last().expect("checked non-empty"))
    }

    fn alloc(&mut self, n: Node) -> V {
        self.arena.push(n);
        V::Obj(self.arena.len() - 1)
    }

    fn top_node(&mut self) -> Result<&mut Node> {
        let V::Obj(i) = *self.top()? else {
            return Err(self.err("expected a container on the stack"));
        };
        Ok(&mut self.arena[i])
    }

    fn global(&self, module: &str, name: &str) -> Result<V> {
        match resolve(module, name) {
            Some(g) => Ok(V::Global(g)),
            None => Err(Error::UnsupportedPickleGlobal {
                file: self.file.to_string(),
                module: module.to_string(),
                name: name.to_string(),
                offset: self.op_pos,
            }),
        }
    }

    fn run(&mut self) -> Result<V> {
        loop {
            self.op_pos = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(self.err("truncated: the stream ends without STOP"));
            };
            self.op = op;
            self.pos += 1;
            if op == b'.' {
                return self.pop();
            }
            if !self.scalar_op(op)? && !self.container_op(op)? && !self.object_op(op)? {
                return Err(Error::UnsupportedPickleOpcode {
                    file: self.file.to_string(),
                    opcode: op,
                    name: "unsupported in DCP metadata".into(),
                    offset: self.op_pos,
                });
            }
        }
    }

    /// Framing, stack and scalar opcodes; false if `op` is none of them.
    fn scalar_op(&mut self, op: u8) -> Result<bool> {
        let v = match op {
            0x80 => {
                let p = self.arr::<1>()?[0];
                if p > 5 {
                    return Err(self.err(format!("unsupported pickle protocol {p}")));
                }
                return Ok(true);
            }
            0x95 => {
                // FRAME: Python reads the whole frame up front, so one longer than what is
                // left of the stream is an error ("pickle data was truncated").
                let n = u64::from_le_bytes(self.arr()?);
                let left = (self.data.len() - self.pos) as u64;
                if n > left {
                    return Err(self.err(format!(
                        "a frame of {n} bytes runs past the end of the pickle ({left} bytes left)"
                    )));
                }
                return Ok(true);
            }
            b'(' => {
                self.marks.push(self.stack.len());
                return Ok(true);
            }
            b'0' => {
                self.pop()?;
                return Ok(true);
            }
            b'1' => {
                self.pop_mark()?;
                return Ok(true);
            }
            b'2' => self.top()?.clone(),
            b'N' => V::None,
            0x88 | 0x89 => V::Bool,
            b'J' => V::Int(i64::from(i32::from_le_bytes(self.arr()?))),
            b'K' => V::Int(i64::from(self.arr::<1>()?[0])),
            b'M' => V::Int(i64::from(u16::from_le_bytes(self.arr()?))),
            0x8a => {
                let n = self.len_of(1)?;
                decode_long(self.take(n)?)
            }
            b'G' => {
                self.arr::<8>()?;
                V::Float
            }
            b'X' => {
                let n = self.len_of(4)?;
                self.str_of(n)?
            }
            0x8c => {
                let n = self.len_of(1)?;
                self.str_of(n)?
            }
            0x8d => {
                let n = self.len_of(8)?;
                self.str_of(n)?
            }
            b'B' | b'C' | 0x8e => {
                let n = match op {
                    b'B' => self.len_of(4)?,
                    b'C' => self.len_of(1)?,
                    _ => self.len_of(8)?,
                };
                self.take(n)?;
                V::Bytes
            }
            _ => return Ok(false),
        };
        self.stack.push(v);
        Ok(true)
    }

    /// Tuple, list, dict and memo opcodes; false if `op` is none of them.
    fn container_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b')' => self.push_node(Node::Tuple(Vec::new())),
            b't' => {
                let items = self.pop_mark()?;
                self.push_node(Node::Tuple(items));
            }
            0x85..=0x87 => {
                let items = self.pop_n(usize::from(op - 0x84))?;
                self.push_node(Node::Tuple(items));
            }
            b']' => self.push_node(Node::List(Vec::new())),
            b'l' => {
                let items = self.pop_mark()?;
                self.push_node(Node::List(items));
            }
            b'}' => self.push_node(Node::Dict(Vec::new())),
            b'd' => {
                let items = self.pop_mark()?;
                self.push_node(Node::Dict(Vec::new()));
                self.set_items(items)?;
            }
            b'a' => {
                let v = self.pop()?;
                self.append(vec![v])?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.append(items)?;
            }
            b's' => {
                let kv = self.pop_n(2)?;
                self.set_items(kv)?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                self.set_items(items)?;
            }
            b'q' | b'r' | 0x94 => {
                let i = match op {
                    b'q' => u32::from(self.arr::<1>()?[0]),
                    b'r' => u32::from_le_bytes(self.arr()?),
                    _ => u32::try_from(self.memo.len()).map_err(|_| self.err("memo too large"))?,
                };
                let v = self.top()?.clone();
                self.memo.insert(i, v);
            }
            b'h' | b'j' => {
                let i = match op {
                    b'h' => u32::from(self.arr::<1>()?[0]),
                    _ => u32::from_le_bytes(self.arr()?),
                };
                let v = self.memo.get(&i).cloned();
                let v = v.ok_or_else(|| self.err(format!("memo index {i} was never stored")))?;
                self.stack.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn push_node(&mut self, n: Node) {
        let v = self.alloc(n);
        self.stack.push(v);
    }

    fn append(&mut self, items: Vec<V>) -> Result<()> {
        match self.top_node()? {
            Node::List(l) => {
                l.extend(items);
                Ok(())
            }
            _ => Err(self.err("APPEND(S) to something other than a list")),
        }
    }

    /// Whether Python can hash `v`: not a list or dict, not an instance of DCP's dataclasses
    /// (their generated `__eq__` removes `__hash__`) except the frozen `MetadataIndex` and the
    /// memory-format enum, and a tuple only of such values.
    fn hashable(&self, v: &V, depth: usize) -> bool {
        let V::Obj(i) = v else { return true };
        match self.arena.get(*i) {
            Some(Node::List(_) | Node::Dict(_)) => false,
            Some(Node::Instance(c, _)) => {
                matches!(c, Class::MetadataIndex | Class::MemFormatEncoding)
            }
            Some(Node::Tuple(items)) => {
                depth < MAX_HASH_DEPTH && items.iter().all(|x| self.hashable(x, depth + 1))
            }
            None => false,
        }
    }

    fn set_items(&mut self, items: Vec<V>) -> Result<()> {
        if items.len() % 2 != 0 {
            return Err(self.err("odd number of items for SETITEMS"));
        }
        // Python hashes each key as it is set: an unhashable one fails the load.
        if items.iter().step_by(2).any(|k| !self.hashable(k, 0)) {
            return Err(self.err(
                "a dict key is a list, a dict or a DCP dataclass instance (unhashable in Python)",
            ));
        }
        match self.top_node()? {
            Node::Dict(d) => {
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
                Ok(())
            }
            _ => Err(self.err("SETITEM(S) on something other than a dict")),
        }
    }

    /// Globals, `REDUCE`, `NEWOBJ` and `BUILD`; false if `op` is none of them.
    fn object_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                let g = self.global(&module, &name)?;
                self.stack.push(g);
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (V::Str(module), V::Str(name)) = (module, name) else {
                    return Err(self.err("STACK_GLOBAL needs two strings"));
                };
                let g = self.global(&module, &name)?;
                self.stack.push(g);
            }
            b'R' => {
                let args = self.pop()?;
                let f = self.pop()?;
                let v = self.reduce(f, args)?;
                self.stack.push(v);
            }
            0x81 => {
                let args = self.pop()?;
                let cls = self.pop()?;
                match (cls, self.tuple(&args)) {
                    (V::Global(Global::Class(c)), Some([])) if c != Class::MemFormatEncoding => {
                        self.push_node(Node::Instance(c, None))
                    }
                    _ => return Err(self.err("NEWOBJ of something other than a DCP dataclass")),
                }
            }
            b'b' => {
                let state = self.pop()?;
                match self.top_node()? {
                    Node::Instance(_, s) => *s = Some(state),
                    _ => return Err(self.err("BUILD on something other than a DCP dataclass")),
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn tuple(&self, v: &V) -> Option<&[V]> {
        match v {
            V::Obj(i) => match self.arena.get(*i) {
                Some(Node::Tuple(items)) => Some(items),
                _ => None,
            },
            _ => None,
        }
    }

    fn reduce(&mut self, f: V, args: V) -> Result<V> {
        let Some(a) = self.tuple(&args).map(<[V]>::to_vec) else {
            return Err(self.err("REDUCE arguments must be a tuple"));
        };
        match (f, a.as_slice()) {
            // Python's `torch.Size` takes negative ints too; where a size is used, it must
            // not be negative.
            (V::Global(Global::Size), [t]) => {
                let dims = self
                    .tuple(t)
                    .filter(|d| d.iter().all(|x| matches!(x, V::Int(_))))
                    .ok_or_else(|| self.err("torch.Size needs one tuple of ints"))?
                    .to_vec();
                Ok(self.alloc(Node::Tuple(dims)))
            }
            (V::Global(Global::GetLayout), [V::Str(s)]) if LAYOUTS.contains(&&**s) => {
                Ok(V::Str(s.clone()))
            }
            (V::Global(Global::GetLayout), [V::Str(s)]) => Err(self.err(format!(
                "`{}` is not a torch layout",
                crate::error::shown(s)
            ))),
            (V::Global(Global::Path), parts) => {
                let mut s = String::new();
                for p in parts {
                    let V::Str(p) = p else {
                        return Err(self.err("a pathlib path needs string parts"));
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
            (V::Global(Global::Class(Class::MemFormatEncoding)), [v @ V::Int(0..=2)]) => {
                Ok(self.alloc(Node::Instance(Class::MemFormatEncoding, Some(v.clone()))))
            }
            _ => Err(self.err("REDUCE of a global that takes no such arguments")),
        }
    }
}

/// Decodes a little-endian two's-complement `LONG1` payload.
fn decode_long(b: &[u8]) -> V {
    if b.len() > 8 {
        let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
            0xff
        } else {
            0
        };
        if b[8..].iter().any(|&x| x != fill) || (b[7] & 0x80 != 0) != (fill == 0xff) {
            return V::BigInt;
        }
    }
    let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
        0xff
    } else {
        0
    };
    let mut a = [fill; 8];
    let n = b.len().min(8);
    a[..n].copy_from_slice(&b[..n]);
    V::Int(i64::from_le_bytes(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `{KEY: 1}` as protocol-2 opcodes, with `key` the opcodes that push the key.
    fn dict_with_key(key: &[u8]) -> Vec<u8> {
        let mut p = vec![0x80, 2, b'}', b'('];
        p.extend_from_slice(key);
        p.extend_from_slice(&[b'K', 1, b'u', b'.']);
        p
    }

    #[test]
    fn a_dict_key_python_cannot_hash_is_refused_and_a_tuple_of_ints_is_not() {
        // `[]`, `{}`, `([],)` (TUPLE1 of an empty list) as keys: a TypeError in Python.
        for (what, key) in [
            ("list", vec![b']']),
            ("dict", vec![b'}']),
            ("tuple of a list", vec![b']', 0x85]),
        ] {
            let e = unpickle("m", &dict_with_key(&key)).err();
            assert!(
                e.is_some_and(|e| e.to_string().contains("unhashable")),
                "a {what} key"
            );
        }
        // `(7,)`.
        assert!(unpickle("m", &dict_with_key(&[b'K', 7, 0x85])).is_ok());
    }
}
