//! A pickle virtual machine for the streams `torch.save` writes (protocol 2, plus the
//! protocol 3–5 opcodes Python's pickler emits for the same values).
//!
//! It resolves only a fixed set of globals (`collections.OrderedDict`,
//! `torch._utils._rebuild_tensor_v2`, `torch.*Storage`, …) and never executes anything, like
//! `torch.load(weights_only=True)`. Containers live in an arena and are referenced by index,
//! so shared references and even cycles are represented faithfully, nothing is dropped
//! recursively, and the final conversion to [`PyObj`] bounds depth and size. Every read,
//! index and size is checked: malformed input gives an [`Error`], never a panic.

mod subclass;

use super::pyobj::PyObj;
use crate::error::{Error, Result};
use crate::optim_state::ShardedTensor;
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;
use std::rc::Rc;
use subclass::{Class, ShardedView};

/// Deepest nesting of containers accepted in the result.
pub(crate) const MAX_DEPTH: usize = 200;

/// Where the VM gets storages from: the archive's `data/<key>` entries.
pub(crate) trait Storages {
    /// Checks that storage `key` can hold `numel` elements of `dtype` (its entry exists and
    /// has that size) without reading it.
    fn check(&mut self, key: &str, dtype: DType, numel: usize) -> Result<()>;
    /// Reads storage `key` (already checked) as a flat tensor.
    fn read(&mut self, key: &str, dtype: DType, numel: usize) -> Result<HostTensor>;
}

/// How tensors are produced.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mode {
    /// Every tensor is read; copies of non-contiguous tensors (transposed, expanded) may
    /// allocate at most the stream's storage bytes plus this many bytes in total.
    Full { max_expansion_bytes: u64 },
    /// Only tensors of at most one element are read; every other tensor is an empty
    /// placeholder of its dtype whose real shape [`Unpickled::shapes`] records.
    Headers,
}

/// The result of [`unpickle`].
pub(crate) struct Unpickled {
    /// The object.
    pub obj: PyObj,
    /// In [`Mode::Headers`]: the real shape of each placeholder, by its storage identity.
    pub shapes: HashMap<usize, Vec<usize>>,
    /// In [`Mode::Headers`]: the storage key of each placeholder whose tensor is the whole
    /// of its storage, contiguous and of the storage's own dtype (its bytes are the storage
    /// entry's, so it can be streamed from the archive).
    pub whole: HashMap<usize, String>,
}

/// The callables and classes a stream may name.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensorV3,
    /// `torch.storage.UntypedStorage`: bytes whose dtype `_rebuild_tensor_v3` gives.
    UntypedStorage,
    /// A dtype object such as `torch.uint16`.
    Dtype(DType),
    /// An allow-listed metadata class (see [`subclass`]).
    Class(Class),
    /// `torch._tensor._rebuild_from_type_v2`, for `ShardedTensor` and `DTensor` only.
    RebuildFromTypeV2,
    /// `torch._utils._rebuild_wrapper_subclass`, only as `_rebuild_from_type_v2`'s function.
    RebuildWrapperSubclass,
    /// `getattr`, only for `ShardedTensor.ProcessGroupState`.
    Getattr,
    RebuildParameter,
    Storage(DType),
    CodecsEncode,
    Bytes,
    TorchSize,
}

/// A value on the VM's stack or in its memo.
#[derive(Debug, Clone)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    BigInt(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tensor(Rc<View>),
    /// A container in the arena.
    Obj(usize),
    Global(Global),
    /// A storage record: key, dtype (`None` for an untyped storage), number of elements
    /// (bytes when untyped).
    Storage(Rc<str>, Option<DType>, usize),
    /// A `ShardedTensor` or `DTensor`: local shard and global metadata.
    Sharded(Rc<ShardedView>),
}

/// A tensor as the stream describes it: a strided view of a storage, checked to lie inside
/// it, and materialized only when the result is built (where its path in the object is
/// known).
#[derive(Debug)]
struct View {
    key: Rc<str>,
    dtype: DType,
    offset: usize,
    size: Vec<usize>,
    stride: Vec<usize>,
    numel: usize,
}

impl View {
    /// Whether the view's elements lie one after another in row-major order.
    fn is_contiguous(&self) -> bool {
        self.size
            .iter()
            .zip(&self.stride)
            .zip(contiguous_strides(&self.size))
            .all(|((&d, &s), c)| d == 1 || s == c)
    }
}

/// A tensor's place in the result, rendered only for error messages.
enum Path<'p> {
    Root,
    Key(&'p Path<'p>, &'p V),
    Index(&'p Path<'p>, usize),
    Attr(&'p Path<'p>, &'p str),
}

impl Path<'_> {
    fn render(&self) -> String {
        let seg = |parent: &Path<'_>, s: String| match parent {
            Path::Root => s,
            p => format!("{}/{s}", p.render()),
        };
        match self {
            Path::Root => "<root>".into(),
            Path::Key(p, V::Str(k)) => seg(p, k.to_string()),
            Path::Key(p, V::Int(i)) => seg(p, i.to_string()),
            Path::Key(p, _) => seg(p, "<key>".into()),
            Path::Index(p, i) => seg(p, i.to_string()),
            Path::Attr(p, a) => seg(p, format!(".{a}")),
        }
    }
}

/// The storages read so far and the tensors built from them, while the result is built.
struct Tensors<'l> {
    mode: Mode,
    store: &'l mut dyn Storages,
    /// Storages read, by key and the dtype read as (an untyped storage may be viewed as
    /// several).
    loaded: HashMap<(Rc<str>, DType), HostTensor>,
    /// Tensors built, by the identity of their [`View`] (a view reached twice is one tensor).
    built: HashMap<*const View, HostTensor>,
    /// Bytes of every storage the stream declares (each checked against its entry).
    storage_bytes: u64,
    /// Bytes allocated so far by copies of non-contiguous tensors.
    copied: u64,
    /// Real shapes of placeholders ([`Mode::Headers`]).
    shapes: HashMap<usize, Vec<usize>>,
    /// Storage keys of the placeholders that are their whole storage ([`Unpickled::whole`]).
    whole: HashMap<usize, String>,
}

/// Hashable identity of a dict key, for Python's replace-on-equal-key semantics.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    None,
    Int(i64),
    Float(u64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
}

#[derive(Debug, Default)]
struct DictObj {
    items: Vec<(V, V)>,
    index: HashMap<Key, usize>,
}

impl DictObj {
    fn insert(&mut self, k: V, v: V) {
        let key = match &k {
            V::None => Some(Key::None),
            V::Bool(b) => Some(Key::Int(i64::from(*b))),
            V::Int(i) => Some(Key::Int(*i)),
            V::Float(x) => Some(Key::Float(x.to_bits())),
            V::Str(s) => Some(Key::Str(s.clone())),
            V::Bytes(b) => Some(Key::Bytes(b.clone())),
            _ => None,
        };
        match key {
            Some(key) => match self.index.get(&key) {
                Some(&i) => self.items[i].1 = v,
                None => {
                    self.index.insert(key, self.items.len());
                    self.items.push((k, v));
                }
            },
            None => self.items.push((k, v)),
        }
    }
}

#[derive(Debug)]
enum Obj {
    Tuple(Vec<V>),
    /// A `torch.Size`: its dimensions, checked to be non-negative ints.
    Size(Vec<i64>),
    List(Vec<V>),
    Dict(DictObj),
    OrderedDict(DictObj, Vec<(String, V)>),
    /// An instance of an allow-listed metadata class: the attributes `BUILD` set, kept as
    /// data (constructor arguments are not needed by anything read from them).
    Record {
        class: Class,
        attrs: Vec<(String, V)>,
    },
}

fn opcode_name(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "UNKNOWN",
    }
}

/// Contiguous (row-major) strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// Runs the stream `data` and returns the object it builds.
pub(crate) fn unpickle(
    file: &str,
    data: &[u8],
    store: &mut dyn Storages,
    mode: Mode,
) -> Result<Unpickled> {
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
        storages: HashMap::new(),
        tensors: std::cell::RefCell::new(Tensors {
            mode,
            store,
            loaded: HashMap::new(),
            built: HashMap::new(),
            storage_bytes: 0,
            copied: 0,
            shapes: HashMap::new(),
            whole: HashMap::new(),
        }),
    };
    let result = vm.run()?;
    // A legitimate stream has at most one node per opcode, so a result that expands shared
    // references to far more nodes than that is an attack (or a cycle).
    let mut budget = data.len().saturating_mul(16).saturating_add(1 << 16);
    let obj = vm.to_pyobj(&result, &Path::Root, 0, &mut budget)?;
    let shapes = std::mem::take(&mut vm.tensors.borrow_mut().shapes);
    let whole = std::mem::take(&mut vm.tensors.borrow_mut().whole);
    Ok(Unpickled { obj, shapes, whole })
}

struct Vm<'a, 'l> {
    file: &'a str,
    data: &'a [u8],
    pos: usize,
    op_pos: usize,
    op: u8,
    stack: Vec<V>,
    marks: Vec<usize>,
    memo: HashMap<u32, V>,
    arena: Vec<Obj>,
    /// Storages declared so far: key → (dtype, elements), as in [`V::Storage`].
    storages: HashMap<Rc<str>, (Option<DType>, usize)>,
    tensors: std::cell::RefCell<Tensors<'l>>,
}

impl Vm<'_, '_> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Pickle {
            file: self.file.to_string(),
            offset: self.op_pos,
            opcode: opcode_name(self.op).to_string(),
            reason: reason.into(),
        }
    }

    fn storage_err(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::TensorStorage {
            file: self.file.to_string(),
            storage: key.to_string(),
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let left = self.data.len() - self.pos;
        if n > left {
            return Err(self.err(format!(
                "truncated: needs {n} bytes, {left} left in data.pkl"
            )));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn take_arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn take_len(&mut self, width: usize) -> Result<usize> {
        let n = match width {
            1 => u64::from(self.take_arr::<1>()?[0]),
            4 => u64::from(u32::from_le_bytes(self.take_arr()?)),
            _ => u64::from_le_bytes(self.take_arr()?),
        };
        usize::try_from(n).map_err(|_| self.err(format!("length {n} too large")))
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

    fn utf8(&mut self, n: usize) -> Result<V> {
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(V::Str(Rc::from(s))),
            Err(e) => Err(self.err(format!("string is not valid UTF-8: {e}"))),
        }
    }

    fn bytes(&mut self, n: usize) -> Result<V> {
        Ok(V::Bytes(Rc::from(self.take(n)?)))
    }

    fn mark_base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn push(&mut self, v: V) {
        self.stack.push(v);
    }

    fn pop(&mut self) -> Result<V> {
        if self.stack.len() <= self.mark_base() {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked non-empty"))
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<V>> {
        if self.stack.len() < self.mark_base() + n {
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
        if self.stack.len() <= self.mark_base() {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.last().expect("checked non-empty"))
    }

    fn alloc(&mut self, o: Obj) -> V {
        self.arena.push(o);
        V::Obj(self.arena.len() - 1)
    }

    fn put(&mut self, idx: u32) -> Result<()> {
        let v = self.top()?.clone();
        self.memo.insert(idx, v);
        Ok(())
    }

    fn get(&mut self, idx: u32) -> Result<()> {
        match self.memo.get(&idx) {
            Some(v) => {
                let v = v.clone();
                self.push(v);
                Ok(())
            }
            None => Err(self.err(format!("memo index {idx} was never stored"))),
        }
    }

    /// The arena index of the container on top of the stack.
    fn top_obj(&self) -> Result<usize> {
        match self.top()? {
            V::Obj(i) => Ok(*i),
            other => Err(self.err(format!(
                "expected a container on the stack, found {}",
                self.kind(other)
            ))),
        }
    }

    fn kind(&self, v: &V) -> String {
        match v {
            V::None => "None".into(),
            V::Bool(_) => "bool".into(),
            V::Int(_) | V::BigInt(_) => "int".into(),
            V::Float(_) => "float".into(),
            V::Str(_) => "str".into(),
            V::Bytes(_) => "bytes".into(),
            V::Tensor(_) => "Tensor".into(),
            V::Obj(i) => match self.arena.get(*i) {
                Some(Obj::Tuple(_)) => "tuple".into(),
                Some(Obj::Size(_)) => "torch.Size".into(),
                Some(Obj::List(_)) => "list".into(),
                Some(Obj::Dict(_)) => "dict".into(),
                Some(Obj::OrderedDict(..)) => "collections.OrderedDict".into(),
                Some(Obj::Record { class, .. }) => format!("{class:?}"),
                None => "?".into(),
            },
            V::Global(g) => format!("global {g:?}"),
            V::Storage(k, ..) => format!("storage {k:?}"),
            V::Sharded(_) => "sharded tensor".into(),
        }
    }

    fn append(&mut self, items: Vec<V>) -> Result<()> {
        let i = self.top_obj()?;
        match &mut self.arena[i] {
            Obj::List(l) => {
                l.extend(items);
                Ok(())
            }
            _ => Err(self.err(format!("APPEND(S) to a {}", self.kind(&V::Obj(i))))),
        }
    }

    fn set_items(&mut self, items: Vec<V>) -> Result<()> {
        if items.len() % 2 != 0 {
            return Err(self.err("odd number of items for SETITEMS"));
        }
        let i = self.top_obj()?;
        match &mut self.arena[i] {
            Obj::Dict(d) | Obj::OrderedDict(d, _) => {
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.insert(k, v);
                }
                Ok(())
            }
            _ => Err(self.err(format!("SETITEM(S) on a {}", self.kind(&V::Obj(i))))),
        }
    }

    fn run(&mut self) -> Result<V> {
        loop {
            self.op_pos = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                self.op = 0;
                return Err(self.err("truncated: the stream ends without STOP"));
            };
            self.op = op;
            self.pos += 1;
            if op == b'.' {
                return self.pop();
            }
            let known = self.stack_op(op)?
                || self.literal_op(op)?
                || self.container_op(op)?
                || self.memo_op(op)?
                || self.object_op(op)?;
            if !known {
                return Err(Error::UnsupportedPickleOpcode {
                    file: self.file.to_string(),
                    opcode: op,
                    name: opcode_name(op).to_string(),
                    offset: self.op_pos,
                });
            }
        }
    }

    /// Protocol, framing and stack-manipulation opcodes (marks, pop, dup). `false` when `op` is not one of them.
    fn stack_op(&mut self, op: u8) -> Result<bool> {
        match op {
            0x80 => {
                let p = self.take_arr::<1>()?[0];
                if p > 5 {
                    return Err(self.err(format!("unsupported pickle protocol {p}")));
                }
            }
            0x95 => {
                self.take_arr::<8>()?;
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                if self.stack.len() > self.mark_base() {
                    self.stack.pop();
                } else if self.marks.pop().is_none() {
                    return Err(self.err("stack underflow"));
                }
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?.clone();
                self.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Opcodes that push a literal: None, bools, ints, floats, strings, bytes. `false` when `op` is not one of them.
    fn literal_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b'N' => self.push(V::None),
            0x88 => self.push(V::Bool(true)),
            0x89 => self.push(V::Bool(false)),
            b'J' => {
                let v = i32::from_le_bytes(self.take_arr()?);
                self.push(V::Int(i64::from(v)));
            }
            b'K' => {
                let v = self.take_arr::<1>()?[0];
                self.push(V::Int(i64::from(v)));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.take_arr()?);
                self.push(V::Int(i64::from(v)));
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.take_len(1)?
                } else {
                    let n = i32::from_le_bytes(self.take_arr()?);
                    usize::try_from(n).map_err(|_| self.err("negative LONG4 length"))?
                };
                let b = self.take(n)?;
                let v = decode_long(b);
                self.push(v);
            }
            b'G' => {
                let v = f64::from_be_bytes(self.take_arr()?);
                self.push(V::Float(v));
            }
            b'X' => {
                let n = self.take_len(4)?;
                let v = self.utf8(n)?;
                self.push(v);
            }
            0x8c => {
                let n = self.take_len(1)?;
                let v = self.utf8(n)?;
                self.push(v);
            }
            0x8d => {
                let n = self.take_len(8)?;
                let v = self.utf8(n)?;
                self.push(v);
            }
            b'B' | b'C' | 0x8e => {
                let n = match op {
                    b'B' => self.take_len(4)?,
                    b'C' => self.take_len(1)?,
                    _ => self.take_len(8)?,
                };
                let v = self.bytes(n)?;
                self.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Opcodes that build or fill tuples, lists and dicts. `false` when `op` is not one of them.
    fn container_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b')' => {
                let v = self.alloc(Obj::Tuple(Vec::new()));
                self.push(v);
            }
            b't' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::Tuple(items));
                self.push(v);
            }
            0x85..=0x87 => {
                let items = self.pop_n(usize::from(op - 0x84))?;
                let v = self.alloc(Obj::Tuple(items));
                self.push(v);
            }
            b']' => {
                let v = self.alloc(Obj::List(Vec::new()));
                self.push(v);
            }
            b'l' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::List(items));
                self.push(v);
            }
            b'}' => {
                let v = self.alloc(Obj::Dict(DictObj::default()));
                self.push(v);
            }
            b'd' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::Dict(DictObj::default()));
                self.push(v);
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
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Memo opcodes: store the top of the stack, or push a stored value. `false` when `op` is not one of them.
    fn memo_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b'q' => {
                let i = self.take_arr::<1>()?[0];
                self.put(u32::from(i))?;
            }
            b'r' => {
                let i = u32::from_le_bytes(self.take_arr()?);
                self.put(i)?;
            }
            0x94 => {
                let i = u32::try_from(self.memo.len()).map_err(|_| self.err("memo too large"))?;
                self.put(i)?;
            }
            b'h' => {
                let i = self.take_arr::<1>()?[0];
                self.get(u32::from(i))?;
            }
            b'j' => {
                let i = u32::from_le_bytes(self.take_arr()?);
                self.get(i)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Globals (resolved against the allow-list), `REDUCE`, `NEWOBJ`, `BUILD` and persistent ids. `false` when `op` is not one of them.
    fn object_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                let g = self.resolve(&module, &name)?;
                self.push(V::Global(g));
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (V::Str(module), V::Str(name)) = (module, name) else {
                    return Err(self.err("STACK_GLOBAL needs two strings"));
                };
                let g = self.resolve(&module, &name)?;
                self.push(V::Global(g));
            }
            b'R' => {
                let args = self.pop()?;
                let f = self.pop()?;
                let v = self.reduce(f, args)?;
                self.push(v);
            }
            0x81 => {
                let args = self.pop()?;
                let cls = self.pop()?;
                let v = match (&cls, self.tuple_items(&args)) {
                    (V::Global(Global::OrderedDict), Some([])) => {
                        self.alloc(Obj::OrderedDict(DictObj::default(), Vec::new()))
                    }
                    (V::Global(Global::Class(class)), Some(_))
                        if !matches!(class, Class::ShardedTensor | Class::DTensor) =>
                    {
                        let class = *class;
                        self.alloc(Obj::Record {
                            class,
                            attrs: Vec::new(),
                        })
                    }
                    _ => {
                        return Err(
                            self.err(format!("NEWOBJ of {} is not supported", self.kind(&cls)))
                        )
                    }
                };
                self.push(v);
            }
            b'b' => {
                let state = self.pop()?;
                self.build(state)?;
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = self.persistent_load(pid)?;
                self.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn resolve(&self, module: &str, name: &str) -> Result<Global> {
        if module == "torch" {
            if let Some(d) = DType::from_storage_class(name) {
                return Ok(Global::Storage(d));
            }
            if let Some(d) = DType::from_torch_attr(name) {
                return Ok(Global::Dtype(d));
            }
        }
        let g = match (module, name) {
            ("collections", "OrderedDict") => Global::OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
            ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildTensorV3,
            ("torch.storage", "UntypedStorage") => Global::UntypedStorage,
            ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
            ("torch", "Size") => Global::TorchSize,
            ("_codecs", "encode") => Global::CodecsEncode,
            ("builtins" | "__builtin__", "bytes") => Global::Bytes,
            ("torch._tensor", "_rebuild_from_type_v2") => Global::RebuildFromTypeV2,
            ("torch._utils", "_rebuild_wrapper_subclass") => Global::RebuildWrapperSubclass,
            ("builtins" | "__builtin__", "getattr") => Global::Getattr,
            _ if Class::resolve(module, name).is_some() => {
                Global::Class(Class::resolve(module, name).expect("checked"))
            }
            _ => {
                return Err(Error::UnsupportedPickleGlobal {
                    file: self.file.to_string(),
                    module: module.to_string(),
                    name: name.to_string(),
                    offset: self.op_pos,
                })
            }
        };
        Ok(g)
    }

    fn tuple_items(&self, v: &V) -> Option<&[V]> {
        match v {
            V::Obj(i) => match self.arena.get(*i) {
                Some(Obj::Tuple(items)) => Some(items),
                _ => None,
            },
            _ => None,
        }
    }

    fn int_arg(&self, v: &V, what: &str) -> Result<usize> {
        match v {
            V::Int(i) => usize::try_from(*i)
                .map_err(|_| self.err(format!("{what} must be a non-negative int, found {i}"))),
            other => Err(self.err(format!("{what} must be an int, found {}", self.kind(other)))),
        }
    }

    fn int_tuple(&self, v: &V, what: &str) -> Result<Vec<usize>> {
        if let V::Obj(i) = v {
            if let Some(Obj::Size(dims)) = self.arena.get(*i) {
                return Ok(dims.iter().map(|&d| d as usize).collect());
            }
        }
        let Some(items) = self.tuple_items(v) else {
            return Err(self.err(format!("{what} must be a tuple, found {}", self.kind(v))));
        };
        items.iter().map(|x| self.int_arg(x, what)).collect()
    }

    fn reduce(&mut self, f: V, args: V) -> Result<V> {
        let Some(a) = self.tuple_items(&args) else {
            return Err(self.err(format!(
                "REDUCE arguments must be a tuple, found {}",
                self.kind(&args)
            )));
        };
        let a = a.to_vec();
        let g = match f {
            V::Global(g) => g,
            other => return Err(self.err(format!("REDUCE of a {}", self.kind(&other)))),
        };
        match g {
            Global::OrderedDict if a.is_empty() => {
                Ok(self.alloc(Obj::OrderedDict(DictObj::default(), Vec::new())))
            }
            Global::OrderedDict => Err(self.err("collections.OrderedDict with arguments")),
            Global::TorchSize => match a.as_slice() {
                [t] if self.tuple_items(t).is_some() => {
                    let items = self.int_tuple(t, "torch.Size")?;
                    let items = items.into_iter().map(|x| x as i64).collect();
                    Ok(self.alloc(Obj::Size(items)))
                }
                _ => Err(self.err("torch.Size needs one tuple argument")),
            },
            Global::Bytes if a.is_empty() => Ok(V::Bytes(Rc::from(&[][..]))),
            Global::Bytes => Err(self.err("bytes() with arguments")),
            Global::CodecsEncode => match a.as_slice() {
                [V::Str(s), V::Str(enc)] if &**enc == "latin1" || &**enc == "latin-1" => {
                    let mut out = Vec::with_capacity(s.len());
                    for c in s.chars() {
                        let b = u8::try_from(u32::from(c))
                            .map_err(|_| self.err("_codecs.encode: character outside latin1"))?;
                        out.push(b);
                    }
                    Ok(V::Bytes(Rc::from(out)))
                }
                _ => Err(self.err("_codecs.encode needs (str, 'latin1')")),
            },
            Global::RebuildParameter => match a.as_slice() {
                [t @ V::Tensor(_), V::Bool(_), _] => Ok(t.clone()),
                _ => Err(self
                    .err("torch._utils._rebuild_parameter needs (tensor, requires_grad, hooks)")),
            },
            Global::RebuildTensorV2 => self.rebuild_tensor(&a, false),
            Global::RebuildTensorV3 => self.rebuild_tensor(&a, true),
            Global::Storage(d) => Err(self.err(format!("calling torch storage class ({d})"))),
            Global::UntypedStorage => Err(self.err("calling torch.storage.UntypedStorage")),
            Global::Class(class @ (Class::Device | Class::Layout | Class::MemoryFormat)) => {
                Ok(self.alloc(Obj::Record {
                    class,
                    attrs: Vec::new(),
                }))
            }
            Global::Class(class) => Err(self.err(format!("calling {class:?}"))),
            Global::Getattr => match a.as_slice() {
                [V::Global(Global::Class(Class::ShardedTensor)), V::Str(n)]
                    if &**n == "ProcessGroupState" =>
                {
                    Ok(V::Global(Global::Class(Class::ProcessGroupState)))
                }
                _ => Err(self.err("getattr is only allowed for ShardedTensor.ProcessGroupState")),
            },
            Global::RebuildWrapperSubclass => {
                Err(self.err("_rebuild_wrapper_subclass outside _rebuild_from_type_v2"))
            }
            Global::RebuildFromTypeV2 => match a.as_slice() {
                [V::Global(Global::RebuildWrapperSubclass), V::Global(Global::Class(class @ (Class::ShardedTensor | Class::DTensor))), args, state] =>
                {
                    let Some(args) = self.tuple_items(args).map(<[V]>::to_vec) else {
                        return Err(self.err("_rebuild_from_type_v2: args must be a tuple"));
                    };
                    self.rebuild_subclass(*class, &args, state)
                }
                _ => Err(self.err(
                    "_rebuild_from_type_v2 is only allowed for _rebuild_wrapper_subclass of a ShardedTensor or DTensor",
                )),
            },
            Global::Dtype(d) => Err(self.err(format!("calling {d}"))),
        }
    }

    /// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])`
    /// of a typed storage, or `_rebuild_tensor_v3(..., hooks, dtype[, metadata])` of an
    /// untyped one.
    fn rebuild_tensor(&mut self, a: &[V], v3: bool) -> Result<V> {
        let (name, nargs) = if v3 {
            ("_rebuild_tensor_v3", 7)
        } else {
            ("_rebuild_tensor_v2", 6)
        };
        if a.len() != nargs && a.len() != nargs + 1 {
            return Err(self.err(format!(
                "torch._utils.{name} takes {nargs} or {} arguments, got {}",
                nargs + 1,
                a.len()
            )));
        }
        let (key, dtype, snumel) = match (&a[0], a.get(6).filter(|_| v3)) {
            (V::Storage(key, Some(dtype), n), None) => (key, *dtype, *n),
            (V::Storage(key, None, bytes), Some(V::Global(Global::Dtype(d)))) => {
                if bytes % d.size() != 0 {
                    return Err(self.storage_err(
                        key,
                        format!("{bytes} bytes are not a whole number of {d} elements"),
                    ));
                }
                (key, *d, bytes / d.size())
            }
            (V::Storage(..), Some(other)) => {
                return Err(self.err(format!(
                    "{name}: the dtype argument must be a supported torch dtype, found {}",
                    self.kind(other)
                )))
            }
            (other, _) => {
                return Err(self.err(format!(
                    "{name}: first argument must be a {} storage, found {}",
                    if v3 { "untyped" } else { "typed" },
                    self.kind(other)
                )))
            }
        };
        let offset = self.int_arg(&a[1], "storage_offset")?;
        let size = self.int_tuple(&a[2], "size")?;
        let stride = self.int_tuple(&a[3], "stride")?;
        if !matches!(a[4], V::Bool(_)) {
            return Err(self.err("_rebuild_tensor_v2: requires_grad must be a bool"));
        }
        match &a[5] {
            V::Obj(i)
                if matches!(
                    self.arena.get(*i),
                    Some(Obj::OrderedDict(..) | Obj::Dict(_))
                ) => {}
            other => {
                return Err(self.err(format!(
                    "_rebuild_tensor_v2: backward_hooks must be an OrderedDict, found {}",
                    self.kind(other)
                )))
            }
        }
        if let Some(meta) = a.get(nargs) {
            let empty = match meta {
                V::None => true,
                V::Obj(i) => {
                    matches!(self.arena.get(*i), Some(Obj::Dict(d)) | Some(Obj::OrderedDict(d, _)) if d.items.is_empty())
                }
                _ => false,
            };
            if !empty {
                return Err(self.err("_rebuild_tensor_v2: tensor metadata is not supported"));
            }
        }
        if size.len() != stride.len() {
            return Err(self.err(format!(
                "_rebuild_tensor_v2: size {size:?} and stride {stride:?} differ in length"
            )));
        }
        let numel = self.check_view(key, snumel, offset, &size, &stride)?;
        Ok(V::Tensor(Rc::new(View {
            key: key.clone(),
            dtype,
            offset,
            size,
            stride,
            numel,
        })))
    }

    /// Checks that the view `storage[offset]` with `size` and `stride` lies inside the
    /// storage of `snumel` elements; returns its number of elements.
    fn check_view(
        &self,
        key: &str,
        snumel: usize,
        offset: usize,
        size: &[usize],
        stride: &[usize],
    ) -> Result<usize> {
        if offset > snumel {
            return Err(self.storage_err(
                key,
                format!("storage offset {offset} beyond its {snumel} elements"),
            ));
        }
        if size.contains(&0) {
            return Ok(0);
        }
        let too_big = || self.storage_err(key, format!("tensor size {size:?} overflows"));
        let numel = size
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(too_big)?;
        // Largest element index the view touches.
        let mut last = offset;
        for (&d, &s) in size.iter().zip(stride) {
            last = (d - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(too_big)?;
        }
        if last >= snumel {
            return Err(self.storage_err(
                key,
                format!(
                    "tensor of size {size:?}, stride {stride:?} at offset {offset} reaches element {last}, but the storage has {snumel}"
                ),
            ));
        }
        Ok(numel)
    }

    /// Whether `view` is the whole of its storage: contiguous from element 0 to the end, in
    /// the storage's own dtype (an untyped storage counts in bytes).
    fn is_whole_storage(&self, view: &View) -> bool {
        let Some(&(dtype, numel)) = self.storages.get(&view.key) else {
            return false;
        };
        let storage_bytes = numel * dtype.unwrap_or(DType::U8).size();
        view.is_contiguous()
            && view.offset == 0
            && dtype.is_none_or(|d| d == view.dtype)
            && view.numel * view.dtype.size() == storage_bytes
    }

    /// The tensor `view` describes, at `path` in the result: in [`Mode::Headers`] a
    /// placeholder unless it has at most one element; else a zero-copy view of its storage
    /// when contiguous, and a contiguous copy (within the expansion budget) when not.
    fn materialize(&self, view: &Rc<View>, path: &Path<'_>) -> Result<HostTensor> {
        let mut guard = self.tensors.borrow_mut();
        let ts = &mut *guard;
        if let Some(t) = ts.built.get(&Rc::as_ptr(view)) {
            return Ok(t.clone());
        }
        let t = match ts.mode {
            Mode::Headers if view.numel > 1 => {
                let p = HostTensor::zeros(view.dtype, &[0]);
                ts.shapes.insert(p.storage_id(), view.size.clone());
                if self.is_whole_storage(view) {
                    ts.whole.insert(p.storage_id(), view.key.to_string());
                }
                p
            }
            _ if view.numel == 0 => HostTensor::zeros(view.dtype, &view.size),
            mode => {
                let slot = (view.key.clone(), view.dtype);
                let storage = match ts.loaded.get(&slot) {
                    Some(s) => s.clone(),
                    None => {
                        let (dtype, numel) = self.storages[&view.key];
                        let bytes = numel * dtype.unwrap_or(DType::U8).size();
                        let s = ts
                            .store
                            .read(&view.key, view.dtype, bytes / view.dtype.size())?;
                        ts.loaded.insert(slot, s.clone());
                        s
                    }
                };
                if view.is_contiguous() {
                    storage
                        .narrow_flat(view.offset, view.numel)?
                        .reshape(&view.size)?
                } else {
                    let nbytes = (view.numel as u64).saturating_mul(view.dtype.size() as u64);
                    let max = match mode {
                        Mode::Full {
                            max_expansion_bytes,
                        } => max_expansion_bytes,
                        Mode::Headers => 0,
                    };
                    let copied = ts.copied.saturating_add(nbytes);
                    if copied > ts.storage_bytes.saturating_add(max) {
                        return Err(Error::TensorExpansion {
                            file: self.file.to_string(),
                            tensor: path.render(),
                            size: view.size.clone().into(),
                            stride: view.stride.clone().into(),
                            copied,
                            storage_bytes: ts.storage_bytes,
                            max_expansion_bytes: max,
                        });
                    }
                    ts.copied = copied;
                    strided_copy(&storage, view)?
                }
            }
        };
        ts.built.insert(Rc::as_ptr(view), t.clone());
        Ok(t)
    }

    fn build(&mut self, state: V) -> Result<()> {
        let i = self.top_obj()?;
        if matches!(state, V::None) {
            return Ok(());
        }
        if let Obj::Record { .. } = &self.arena[i] {
            return self.build_record(i, state);
        }
        let attrs: Vec<(String, V)> = match &state {
            V::Obj(j) => match self.arena.get(*j) {
                Some(Obj::Dict(d)) => {
                    let mut out = Vec::new();
                    for (k, v) in &d.items {
                        let V::Str(k) = k else {
                            return Err(self.err("BUILD state keys must be strings"));
                        };
                        out.push((k.to_string(), v.clone()));
                    }
                    out
                }
                _ => return Err(self.err(format!("BUILD with a {} state", self.kind(&state)))),
            },
            _ => return Err(self.err(format!("BUILD with a {} state", self.kind(&state)))),
        };
        let kind = self.kind(&V::Obj(i));
        match &mut self.arena[i] {
            Obj::OrderedDict(_, existing) => {
                for (k, v) in attrs {
                    match existing.iter_mut().find(|(n, _)| *n == k) {
                        Some(slot) => slot.1 = v,
                        None => existing.push((k, v)),
                    }
                }
                Ok(())
            }
            _ => Err(self.err(format!("BUILD on a {kind}"))),
        }
    }

    fn persistent_load(&mut self, pid: V) -> Result<V> {
        let items = match self.tuple_items(&pid) {
            Some(items) => items.to_vec(),
            None => {
                return Err(self.err(format!(
                    "persistent id must be a tuple, found {}",
                    self.kind(&pid)
                )))
            }
        };
        let [V::Str(tag), V::Global(class), V::Str(key), V::Str(_location), numel] =
            items.as_slice()
        else {
            return Err(self
                .err("persistent id must be ('storage', torch.<T>Storage, key, location, numel)"));
        };
        let dtype = match class {
            Global::Storage(d) => Some(*d),
            Global::UntypedStorage => None,
            other => {
                return Err(self.err(format!(
                    "persistent id names {other:?}, not a storage class"
                )))
            }
        };
        let dtype = &dtype;
        if &**tag != "storage" {
            return Err(self.err(format!("persistent id tag {tag:?} is not 'storage'")));
        }
        let numel = self.int_arg(numel, "storage numel")?;
        if let Some(&(d, n)) = self.storages.get(key) {
            if d != *dtype {
                let name = |d: Option<DType>| d.map_or("untyped".to_string(), |d| d.to_string());
                return Err(self.storage_err(
                    key,
                    format!("viewed as both {} and {}", name(d), name(*dtype)),
                ));
            }
            if n != numel {
                return Err(
                    self.storage_err(key, format!("declared with {n} and {numel} elements"))
                );
            }
            return Ok(V::Storage(key.clone(), *dtype, numel));
        }
        let mut ts = self.tensors.borrow_mut();
        let unit = dtype.unwrap_or(DType::U8);
        ts.store.check(key, unit, numel)?;
        ts.storage_bytes = ts
            .storage_bytes
            .saturating_add((numel as u64).saturating_mul(unit.size() as u64));
        drop(ts);
        self.storages.insert(key.clone(), (*dtype, numel));
        Ok(V::Storage(key.clone(), *dtype, numel))
    }

    fn to_pyobj(&self, v: &V, path: &Path<'_>, depth: usize, budget: &mut usize) -> Result<PyObj> {
        if depth > MAX_DEPTH {
            return Err(self.err(format!(
                "containers nested deeper than {MAX_DEPTH} levels (or a cyclic reference)"
            )));
        }
        if *budget == 0 {
            return Err(
                self.err("the object graph expands to too many objects (shared references)")
            );
        }
        *budget -= 1;
        Ok(match v {
            V::None => PyObj::None,
            V::Bool(b) => PyObj::Bool(*b),
            V::Int(i) => PyObj::Int(*i),
            V::BigInt(b) => PyObj::BigInt(b.to_vec()),
            V::Float(x) => PyObj::Float(*x),
            V::Str(s) => PyObj::Str(s.to_string()),
            V::Bytes(b) => PyObj::Bytes(b.to_vec()),
            V::Tensor(view) => PyObj::Tensor(self.materialize(view, path)?),
            V::Sharded(s) => PyObj::Sharded(ShardedTensor {
                global_shape: s.global_shape.clone(),
                offsets: s.offsets.clone(),
                local: match &s.local {
                    Some(V::Tensor(view)) => Some(self.materialize(view, path)?),
                    _ => None,
                },
            }),
            V::Global(_) | V::Storage(..) => {
                return Err(self.err(format!(
                    "a bare {} in the result is not supported",
                    self.kind(v)
                )))
            }
            V::Obj(i) => {
                let seq = |items: &[V], budget: &mut usize| -> Result<Vec<PyObj>> {
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, x)| self.to_pyobj(x, &Path::Index(path, i), depth + 1, budget))
                        .collect()
                };
                let pairs = |d: &DictObj, budget: &mut usize| -> Result<Vec<(PyObj, PyObj)>> {
                    d.items
                        .iter()
                        .map(|(k, v)| {
                            Ok((
                                self.to_pyobj(k, path, depth + 1, budget)?,
                                self.to_pyobj(v, &Path::Key(path, k), depth + 1, budget)?,
                            ))
                        })
                        .collect()
                };
                match &self.arena[*i] {
                    Obj::Tuple(items) => PyObj::Tuple(seq(items, budget)?),
                    Obj::Size(dims) => PyObj::Size(dims.clone()),
                    Obj::Record { class, .. } => {
                        return Err(
                            self.err(format!("a bare {class:?} in the result is not supported"))
                        )
                    }
                    Obj::List(items) => PyObj::List(seq(items, budget)?),
                    Obj::Dict(d) => PyObj::Dict(pairs(d, budget)?),
                    Obj::OrderedDict(d, attrs) => PyObj::OrderedDict {
                        items: pairs(d, budget)?,
                        attrs: attrs
                            .iter()
                            .map(|(k, v)| {
                                let at = Path::Attr(path, k);
                                Ok((k.clone(), self.to_pyobj(v, &at, depth + 1, budget)?))
                            })
                            .collect::<Result<_>>()?,
                    },
                }
            }
        })
    }
}

/// A contiguous copy of the non-contiguous `view` of `storage` (already checked to lie
/// inside it).
fn strided_copy(storage: &HostTensor, view: &View) -> Result<HostTensor> {
    let esize = view.dtype.size();
    let src = storage.as_bytes();
    let size = &view.size;
    HostTensor::filled_by(view.dtype, size, |out: &mut [u8]| {
        let mut idx = vec![0usize; size.len()];
        let mut at = view.offset;
        for chunk in out.chunks_exact_mut(esize) {
            chunk.copy_from_slice(&src[at * esize..(at + 1) * esize]);
            // Odometer increment; `at` stays within the checked view.
            for d in (0..size.len()).rev() {
                idx[d] += 1;
                if idx[d] < size[d] {
                    at += view.stride[d];
                    break;
                }
                at -= (size[d] - 1) * view.stride[d];
                idx[d] = 0;
            }
        }
        Ok::<(), Error>(())
    })
}

/// Decodes a little-endian two's-complement integer (pickle `LONG1`/`LONG4` payload).
fn decode_long(b: &[u8]) -> V {
    if b.is_empty() {
        return V::Int(0);
    }
    let neg = b[b.len() - 1] & 0x80 != 0;
    let fill = if neg { 0xff } else { 0 };
    // Drop redundant sign bytes, then fit into i64 if possible.
    let mut n = b.len();
    while n > 1 && b[n - 1] == fill && (b[n - 2] & 0x80 != 0) == neg {
        n -= 1;
    }
    if n <= 8 {
        let mut a = [fill; 8];
        a[..n].copy_from_slice(&b[..n]);
        V::Int(i64::from_le_bytes(a))
    } else {
        V::BigInt(Rc::from(&b[..n]))
    }
}
