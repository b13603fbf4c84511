//! The pickle machine: it reads the opcodes of a stream, keeps the stack, marks and memo,
//! builds literals and containers, resolves globals against the allow-list it is given, and
//! hands what differs between formats (calling a global, `NEWOBJ`, `BUILD`, persistent ids,
//! which dict keys are allowed) to the [`Format`] it runs for. Nothing is ever executed.
//!
//! Containers live in an arena and are referenced by index, so shared references and cycles
//! cost nothing, nothing is dropped recursively, and memory stays proportional to the
//! stream. Every read, index and size is checked: malformed input gives an [`Error`], never a
//! panic.

use super::long::{self, Long};
use super::op;
use super::value::{Dict, Node, Value};
use super::Globals;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fmt::Debug;
use std::rc::Rc;

/// A value of format `F`'s machine.
pub(crate) type Val<F> = Value<<F as Format>::Global, <F as Format>::Ext>;
/// A node of format `F`'s arena.
pub(crate) type NodeOf<F> = Node<<F as Format>::Global, <F as Format>::Ext, <F as Format>::Node>;
/// A dict of format `F`'s arena.
pub(crate) type DictOf<F> = Dict<<F as Format>::Global, <F as Format>::Ext>;

/// What a format adds to the machine: the values it builds and how the object opcodes build
/// them. The implementing type is the format's own state while a stream runs.
pub(crate) trait Format: Sized {
    /// The globals its allow-list resolves to.
    type Global: Clone + Debug;
    /// Stack values only it builds.
    type Ext: Clone + Debug;
    /// Arena nodes only it builds.
    type Node: Debug;

    /// `REDUCE`: calls `f` with `args`.
    fn reduce(
        m: &mut Machine<'_, Self>,
        f: Self::Global,
        args: Vec<Val<Self>>,
    ) -> Result<Val<Self>>;
    /// `NEWOBJ`: `cls.__new__(cls, *args)`.
    fn newobj(
        m: &mut Machine<'_, Self>,
        cls: Self::Global,
        args: Vec<Val<Self>>,
    ) -> Result<Val<Self>>;
    /// `BUILD`: sets `state` on the object on top of the stack.
    fn build(m: &mut Machine<'_, Self>, state: Val<Self>) -> Result<()>;
    /// `BINPERSID`: pops a persistent id and returns the object it names. Unsupported
    /// unless the format has persistent ids (Python's `pickle.load` refuses the opcode before
    /// it looks at the stack).
    fn persistent_load(m: &mut Machine<'_, Self>) -> Result<Val<Self>> {
        Err(m.unsupported_opcode())
    }
    /// Refuses a dict key the format's Python could not use (an unhashable one).
    fn check_key(m: &Machine<'_, Self>, key: &Val<Self>) -> Result<()> {
        let _ = (m, key);
        Ok(())
    }
    /// `SETITEM(S)` of one pair: Python's semantics by default.
    fn set_item(dict: &mut DictOf<Self>, key: Val<Self>, value: Val<Self>) {
        dict.insert(key, value);
    }
    /// The dict inside one of its nodes (an `OrderedDict`), which `SETITEM(S)` fills.
    fn ext_dict(node: &mut Self::Node) -> Option<&mut DictOf<Self>> {
        let _ = node;
        None
    }
    /// Whether the format's reader executes opcode `op` at all (`torch.load(weights_only=True)`
    /// knows only protocol 2's; `pickle.load` every one). An opcode it does not is refused
    /// before it runs.
    fn knows_opcode(_op: u8) -> bool {
        true
    }
    /// What a value of its own is, for messages.
    fn ext_kind(x: &Self::Ext) -> String;
    /// What a node of its own is, for messages.
    fn node_kind(n: &Self::Node) -> String;
}

/// A pickle machine running one stream for format `F`.
pub(crate) struct Machine<'a, F: Format> {
    file: &'a str,
    data: &'a [u8],
    pos: usize,
    /// Offset and byte of the opcode being executed.
    op_pos: usize,
    op: u8,
    stack: Vec<Val<F>>,
    /// Stack heights at each open `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Val<F>>,
    arena: Vec<NodeOf<F>>,
    globals: &'a Globals<F::Global>,
    /// The format's state.
    pub(crate) state: F,
}

/// How every error of a stream that ends too early begins.
const TRUNCATED: &str = "truncated";

/// Whether `e` is a stream's error for ending too early (more bytes might complete it).
pub(crate) fn truncated(e: &Error) -> bool {
    matches!(e, Error::Pickle { reason, .. } if reason.starts_with(TRUNCATED))
}

impl<'a, F: Format> Machine<'a, F> {
    /// A machine for the stream `data` (`file` names it in errors) that resolves only what
    /// `globals` allows.
    pub(crate) fn new(
        file: &'a str,
        data: &'a [u8],
        globals: &'a Globals<F::Global>,
        state: F,
    ) -> Self {
        Machine {
            file,
            data,
            pos: 0,
            op_pos: 0,
            op: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            arena: Vec::new(),
            globals,
            state,
        }
    }

    /// Runs the stream to its `STOP` and returns the object on top of the stack.
    pub(crate) fn run(&mut self) -> Result<Val<F>> {
        loop {
            self.op_pos = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                self.op = 0;
                return Err(self.err(format!("{TRUNCATED}: the stream ends without STOP")));
            };
            self.op = op;
            self.pos += 1;
            if !F::knows_opcode(op) {
                return Err(self.unsupported_opcode());
            }
            if op == op::STOP {
                return self.pop();
            }
            let known = self.stack_op(op)?
                || self.literal_op(op)?
                || self.container_op(op)?
                || self.memo_op(op)?
                || self.object_op(op)?;
            if !known {
                return Err(self.unsupported_opcode());
            }
        }
    }

    /// The bytes of the stream read so far (after [`Machine::run`]: up to and with its
    /// `STOP`).
    pub(crate) fn consumed(&self) -> usize {
        self.pos
    }

    /// The arena, once the stream has run.
    pub(crate) fn into_arena(self) -> Vec<NodeOf<F>> {
        self.arena
    }

    /// The name of the stream, for errors.
    pub(crate) fn file(&self) -> &'a str {
        self.file
    }

    /// A malformed-pickle error at the current opcode.
    pub(crate) fn err(&self, reason: impl Into<String>) -> Error {
        Error::Pickle {
            file: self.file.to_string(),
            offset: self.op_pos,
            opcode: op::name(self.op).to_string(),
            reason: reason.into(),
        }
    }

    /// The current opcode, refused as one this reader does not implement.
    pub(crate) fn unsupported_opcode(&self) -> Error {
        Error::UnsupportedPickleOpcode {
            file: self.file.to_string(),
            opcode: self.op,
            name: op::name(self.op).to_string(),
            offset: self.op_pos,
        }
    }

    /// Adds `n` to the arena.
    pub(crate) fn alloc(&mut self, n: NodeOf<F>) -> Val<F> {
        self.arena.push(n);
        Value::Obj(self.arena.len() - 1)
    }

    /// The node `v` refers to, if it is one.
    pub(crate) fn node(&self, v: &Val<F>) -> Option<&NodeOf<F>> {
        match v {
            Value::Obj(i) => self.arena.get(*i),
            _ => None,
        }
    }

    /// Node `i` of the arena.
    pub(crate) fn node_mut(&mut self, i: usize) -> Option<&mut NodeOf<F>> {
        self.arena.get_mut(i)
    }

    /// The items of `v` if it is a tuple.
    pub(crate) fn tuple_items(&self, v: &Val<F>) -> Option<&[Val<F>]> {
        match self.node(v) {
            Some(Node::Tuple(items)) => Some(items),
            _ => None,
        }
    }

    /// The arena index of the container on top of the stack.
    pub(crate) fn top_obj(&self) -> Result<usize> {
        match self.top()? {
            Value::Obj(i) => Ok(*i),
            other => Err(self.err(format!(
                "expected a container on the stack, found {}",
                self.kind(other)
            ))),
        }
    }

    /// What `v` is, for messages.
    pub(crate) fn kind(&self, v: &Val<F>) -> String {
        match v {
            Value::None => "None".into(),
            Value::Bool(_) => "bool".into(),
            Value::Int(_) | Value::BigInt(_) => "int".into(),
            Value::Float(_) => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Global(g) => format!("global {g:?}"),
            Value::Ext(x) => F::ext_kind(x),
            Value::Obj(i) => match self.arena.get(*i) {
                Some(Node::Tuple(_)) => "tuple".into(),
                Some(Node::List(_)) => "list".into(),
                Some(Node::Dict(_)) => "dict".into(),
                Some(Node::Ext(n)) => F::node_kind(n),
                None => "?".into(),
            },
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let data = self.data;
        let left = data.len() - self.pos;
        if n > left {
            return Err(self.err(format!("{TRUNCATED}: needs {n} bytes, {left} left")));
        }
        let s = &data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn take_arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// A little-endian unsigned length of `width` bytes (1, 4 or 8).
    fn take_len(&mut self, width: usize) -> Result<usize> {
        let n = match width {
            1 => u64::from(self.take_arr::<1>()?[0]),
            4 => u64::from(u32::from_le_bytes(self.take_arr()?)),
            _ => u64::from_le_bytes(self.take_arr()?),
        };
        usize::try_from(n).map_err(|_| self.err(format!("length {n} too large")))
    }

    /// A `\n`-terminated line (a `GLOBAL` argument).
    fn line(&mut self) -> Result<String> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.err(format!("{TRUNCATED}: unterminated line")));
        };
        let s = std::str::from_utf8(&rest[..n])
            .map_err(|_| self.err("global name is not UTF-8"))?
            .to_string();
        self.pos += n + 1;
        Ok(s)
    }

    /// A string of `n` UTF-8 bytes.
    fn utf8(&mut self, n: usize) -> Result<Val<F>> {
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(Value::Str(Rc::from(s))),
            Err(e) => Err(self.err(format!("string is not valid UTF-8: {e}"))),
        }
    }

    fn mark_base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn push(&mut self, v: Val<F>) {
        self.stack.push(v);
    }

    /// Pops the top of the stack (above the last mark).
    pub(crate) fn pop(&mut self) -> Result<Val<F>> {
        if self.stack.len() > self.mark_base() {
            if let Some(v) = self.stack.pop() {
                return Ok(v);
            }
        }
        Err(self.err("stack underflow"))
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Val<F>>> {
        if self.stack.len() < self.mark_base() + n {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.split_off(self.stack.len() - n))
    }

    fn pop_mark(&mut self) -> Result<Vec<Val<F>>> {
        let Some(m) = self.marks.pop() else {
            return Err(self.err("no MARK on the stack"));
        };
        Ok(self.stack.split_off(m.min(self.stack.len())))
    }

    fn top(&self) -> Result<&Val<F>> {
        self.stack
            .last()
            .filter(|_| self.stack.len() > self.mark_base())
            .ok_or_else(|| self.err("stack underflow"))
    }

    /// Protocol, framing and stack-manipulation opcodes (marks, pop, dup). `false` when `op`
    /// is not one of them.
    fn stack_op(&mut self, op: u8) -> Result<bool> {
        match op {
            op::PROTO => {
                let p = self.take_arr::<1>()?[0];
                if p > 5 {
                    return Err(self.err(format!("unsupported pickle protocol {p}")));
                }
            }
            op::FRAME => {
                // Python reads the whole frame up front, so one longer than what is left of
                // the stream is an error ("pickle data was truncated").
                let n = u64::from_le_bytes(self.take_arr()?);
                let left = (self.data.len() - self.pos) as u64;
                if n > left {
                    return Err(self.err(format!(
                        "a frame of {n} bytes runs past the end of the pickle ({left} bytes left)"
                    )));
                }
            }
            op::MARK => self.marks.push(self.stack.len()),
            // As Python's: with nothing above the last mark, POP drops the mark.
            op::POP => {
                if self.stack.len() > self.mark_base() {
                    self.stack.pop();
                } else if self.marks.pop().is_none() {
                    return Err(self.err("stack underflow"));
                }
            }
            op::POP_MARK => {
                self.pop_mark()?;
            }
            op::DUP => {
                let v = self.top()?.clone();
                self.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Opcodes that push a literal: None, bools, ints, floats, strings, bytes. `false` when
    /// `op` is not one of them.
    fn literal_op(&mut self, op: u8) -> Result<bool> {
        let v = match op {
            op::NONE => Value::None,
            op::NEWTRUE => Value::Bool(true),
            op::NEWFALSE => Value::Bool(false),
            op::BININT => Value::Int(i64::from(i32::from_le_bytes(self.take_arr()?))),
            op::BININT1 => Value::Int(i64::from(self.take_arr::<1>()?[0])),
            op::BININT2 => Value::Int(i64::from(u16::from_le_bytes(self.take_arr()?))),
            op::LONG1 | op::LONG4 => {
                let n = if op == op::LONG1 {
                    self.take_len(1)?
                } else {
                    let n = i32::from_le_bytes(self.take_arr()?);
                    usize::try_from(n).map_err(|_| self.err("negative LONG4 length"))?
                };
                match long::decode(self.take(n)?) {
                    Long::Small(i) => Value::Int(i),
                    Long::Big(b) => Value::BigInt(Rc::from(b)),
                }
            }
            op::BINFLOAT => Value::Float(f64::from_be_bytes(self.take_arr()?)),
            op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8 => {
                let n = self.take_len(Self::width(op))?;
                self.utf8(n)?
            }
            op::SHORT_BINBYTES | op::BINBYTES | op::BINBYTES8 => {
                let n = self.take_len(Self::width(op))?;
                Value::Bytes(Rc::from(self.take(n)?))
            }
            _ => return Ok(false),
        };
        self.push(v);
        Ok(true)
    }

    /// Bytes of the length argument of a string or bytes opcode.
    fn width(op: u8) -> usize {
        match op {
            op::SHORT_BINUNICODE | op::SHORT_BINBYTES => 1,
            op::BINUNICODE | op::BINBYTES => 4,
            _ => 8,
        }
    }

    /// Opcodes that build or fill tuples, lists and dicts. `false` when `op` is not one of
    /// them.
    fn container_op(&mut self, op: u8) -> Result<bool> {
        match op {
            op::EMPTY_TUPLE => self.push_node(Node::Tuple(Vec::new())),
            op::TUPLE => {
                let items = self.pop_mark()?;
                self.push_node(Node::Tuple(items));
            }
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let items = self.pop_n(usize::from(op - op::TUPLE1) + 1)?;
                self.push_node(Node::Tuple(items));
            }
            op::EMPTY_LIST => self.push_node(Node::List(Vec::new())),
            op::LIST => {
                let items = self.pop_mark()?;
                self.push_node(Node::List(items));
            }
            op::EMPTY_DICT => self.push_node(Node::Dict(Dict::default())),
            op::DICT => {
                let items = self.pop_mark()?;
                self.push_node(Node::Dict(Dict::default()));
                self.set_items(items)?;
            }
            op::APPEND => {
                let v = self.pop()?;
                self.append(vec![v])?;
            }
            op::APPENDS => {
                let items = self.pop_mark()?;
                self.append(items)?;
            }
            op::SETITEM => {
                let kv = self.pop_n(2)?;
                self.set_items(kv)?;
            }
            op::SETITEMS => {
                let items = self.pop_mark()?;
                self.set_items(items)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn push_node(&mut self, n: NodeOf<F>) {
        let v = self.alloc(n);
        self.push(v);
    }

    fn append(&mut self, items: Vec<Val<F>>) -> Result<()> {
        let i = self.top_obj()?;
        let kind = self.kind(&Value::Obj(i));
        match self.arena.get_mut(i) {
            Some(Node::List(l)) => {
                l.extend(items);
                Ok(())
            }
            _ => Err(self.err(format!("APPEND(S) to a {kind}"))),
        }
    }

    /// Sets `items` (key, value, key, value, …) on the dict on top of the stack.
    fn set_items(&mut self, items: Vec<Val<F>>) -> Result<()> {
        if items.len() % 2 != 0 {
            return Err(self.err("odd number of items for SETITEMS"));
        }
        let i = self.top_obj()?;
        // Python hashes each key as it is set: one the format's Python cannot hash fails.
        for k in items.iter().step_by(2) {
            F::check_key(self, k)?;
        }
        let kind = self.kind(&Value::Obj(i));
        let dict = match self.arena.get_mut(i) {
            Some(Node::Dict(d)) => Some(d),
            Some(Node::Ext(n)) => F::ext_dict(n),
            _ => None,
        };
        let Some(dict) = dict else {
            return Err(self.err(format!("SETITEM(S) on a {kind}")));
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            F::set_item(dict, k, v);
        }
        Ok(())
    }

    /// Memo opcodes: store the top of the stack, or push a stored value. `false` when `op`
    /// is not one of them.
    fn memo_op(&mut self, op: u8) -> Result<bool> {
        match op {
            op::BINPUT | op::LONG_BINPUT | op::MEMOIZE => {
                let i = match op {
                    op::BINPUT => u32::from(self.take_arr::<1>()?[0]),
                    op::LONG_BINPUT => u32::from_le_bytes(self.take_arr()?),
                    _ => u32::try_from(self.memo.len()).map_err(|_| self.err("memo too large"))?,
                };
                let v = self.top()?.clone();
                self.memo.insert(i, v);
            }
            op::BINGET | op::LONG_BINGET => {
                let i = match op {
                    op::BINGET => u32::from(self.take_arr::<1>()?[0]),
                    _ => u32::from_le_bytes(self.take_arr()?),
                };
                let v = self.memo.get(&i).cloned();
                let v = v.ok_or_else(|| self.err(format!("memo index {i} was never stored")))?;
                self.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Globals (resolved against the allow-list), `REDUCE`, `NEWOBJ`, `BUILD` and persistent
    /// ids. `false` when `op` is not one of them.
    fn object_op(&mut self, op: u8) -> Result<bool> {
        match op {
            op::GLOBAL => {
                let module = self.line()?;
                let name = self.line()?;
                let g = self.resolve(&module, &name)?;
                self.push(Value::Global(g));
            }
            op::STACK_GLOBAL => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Value::Str(module), Value::Str(name)) = (module, name) else {
                    return Err(self.err("STACK_GLOBAL needs two strings"));
                };
                let g = self.resolve(&module, &name)?;
                self.push(Value::Global(g));
            }
            op::REDUCE | op::NEWOBJ => {
                let args = self.pop()?;
                let callee = self.pop()?;
                let what = op::name(op);
                let Some(args) = self.tuple_items(&args).map(<[_]>::to_vec) else {
                    return Err(self.err(format!(
                        "{what} arguments must be a tuple, found {}",
                        self.kind(&args)
                    )));
                };
                let Value::Global(g) = callee else {
                    return Err(self.err(format!("{what} of a {}", self.kind(&callee))));
                };
                let v = match op {
                    op::REDUCE => F::reduce(self, g, args)?,
                    _ => F::newobj(self, g, args)?,
                };
                self.push(v);
            }
            op::BUILD => {
                let state = self.pop()?;
                F::build(self, state)?;
            }
            op::BINPERSID => {
                let v = F::persistent_load(self)?;
                self.push(v);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The global `module.name`, if the allow-list has it.
    fn resolve(&self, module: &str, name: &str) -> Result<F::Global> {
        self.globals
            .resolve(module, name)
            .ok_or_else(|| Error::UnsupportedPickleGlobal {
                file: self.file.to_string(),
                module: module.to_string(),
                name: name.to_string(),
                offset: self.op_pos,
            })
    }
}
