//! `torch.load(weights_only=True)` for the `data.pkl` stream of a `torch.save` archive: the
//! [`crate::io::pickle`] machine with `torch.load`'s allow-list ([`ALLOWED`]) and the objects
//! it builds (tensors, storages, `OrderedDict`, `torch.Size`, the distributed tensor
//! subclasses).
//!
//! It resolves only a fixed set of globals (`collections.OrderedDict`,
//! `torch._utils._rebuild_tensor_v2`, `torch.*Storage`, …) and never executes anything. The
//! final conversion to [`PyObj`] bounds depth and size, since shared references (the memo)
//! let a small stream name one object many times.

mod deepspeed;
mod rich;
mod subclass;
mod tensor;

use super::pyobj::PyObj;
use super::pyobj::QDType;
use crate::error::{Error, Result};
use crate::io::pickle::{Dict, Format, Globals, Machine, Node, Value, TORCH_LAYOUTS};
use crate::optim_state::ShardedTensor;
use crate::tensor::{DType, HostTensor};
use rich::RichView;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use subclass::{Class, ShardedView};
use tensor::{Tensors, View};

pub(crate) use deepspeed::Allow;
pub(crate) use tensor::{contiguous_strides, strided_runs, PlaceholderView};

/// Deepest nesting of containers accepted in the result.
pub(crate) const MAX_DEPTH: usize = 200;

/// Where the machine gets storages from: the archive's `data/<key>` entries.
pub(crate) trait Storages {
    /// Checks that storage `key` can hold `numel` elements of `dtype` (its entry exists and
    /// has that size) without reading it.
    fn check(&mut self, key: &str, dtype: DType, numel: usize) -> Result<()>;
    /// Reads storage `key` (already checked) as a flat tensor.
    fn read(&mut self, key: &str, dtype: DType, numel: usize) -> Result<HostTensor>;
    /// Whether the stream is a legacy file's, whose persistent ids carry a sixth item
    /// (`view_metadata`).
    fn legacy(&self) -> bool {
        false
    }
    /// Called when the stream has run, with the bytes it took, before any storage is read.
    fn stream_ended(&mut self, _consumed: usize) -> Result<()> {
        Ok(())
    }
}

/// Storages of a stream that declares none.
struct NoStorages;

impl Storages for NoStorages {
    fn check(&mut self, key: &str, _: DType, _: usize) -> Result<()> {
        Err(Error::Unsupported(format!(
            "a storage ({key:?}) where none may be"
        )))
    }
    fn read(&mut self, key: &str, _: DType, _: usize) -> Result<HostTensor> {
        Err(Error::Unsupported(format!(
            "a storage ({key:?}) where none may be"
        )))
    }
}

/// Runs a pickle that holds plain values (no storage) at the start of `data`; returns the
/// object and the bytes the stream took (the legacy format's header pickles).
pub(crate) fn plain(file: &str, data: &[u8]) -> Result<(PyObj, usize)> {
    let u = unpickle(file, data, &mut NoStorages, Mode::Headers, Allow::TorchLoad)?;
    Ok((u.obj, u.consumed))
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
    /// In [`Mode::Headers`]: where each placeholder lies in its storage.
    pub views: HashMap<usize, PlaceholderView>,
    /// In [`Mode::Headers`]: the smallest `max_expansion_bytes` with which [`Mode::Full`]
    /// would read the stream (0 when it copies no more than the storages' bytes); a larger
    /// one is refused there with [`Error::TensorExpansion`].
    pub expansion_needed: u64,
    /// The bytes of `data` the stream took, up to and with its `STOP`.
    pub consumed: usize,
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
    RebuildParameterWithState,
    /// `torch._utils._rebuild_tensor`, the first version (no `requires_grad`).
    RebuildTensorV1,
    RebuildSparse,
    RebuildQTensor,
    RebuildMeta,
    /// `torch.Tensor`, only as `_rebuild_from_type_v2`'s type.
    TensorClass,
    /// `torch.nn.parameter.Parameter`, only for `NEWOBJ` (`Parameter(data, requires_grad)`).
    ParameterClass,
    Storage(DType),
    /// A quantized typed storage (`torch.QInt8Storage`).
    QStorage(QDType),
    /// A quantization scheme such as `torch.per_tensor_affine`, by its attribute name.
    QScheme(&'static str),
    /// An allow-listed dtype the crate holds no tensors of (`torch.uint4`), by its
    /// attribute name: readable as a value.
    OtherDtype(&'static str),
    CodecsEncode,
    Bytes,
    TorchSize,
    Complex,
    Set,
    ByteArray,
    Counter,
    /// A global `torch.load(weights_only=True)` allows that the crate refuses when it is
    /// used, with the reason (no use in checkpoints).
    Refused(&'static str, &'static str),
}

/// Dtypes `torch.load(weights_only=True)` allows as values besides the crate's own
/// ([`DType`]): the quantized, bit and shell dtypes.
const OTHER_DTYPES: &[&str] = &[
    "complex32",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "float8_e5m2fnuz",
    "float8_e4m3fnuz",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
];

/// The globals `torch.load(weights_only=True)` allows that the crate refuses, and why.
const REFUSED: &[(&str, &str, &str)] = &[
    (
        "torch._utils",
        "_rebuild_nested_tensor",
        "nested tensors have no place in a state dict",
    ),
    (
        "torch._utils",
        "_rebuild_device_tensor_from_numpy",
        "it rebuilds a tensor of a device without storage (XLA, MTIA) from a NumPy array",
    ),
    (
        "torch._utils",
        "_rebuild_device_tensor_from_cpu_tensor",
        "it rebuilds a tensor of a device without storage (XLA, MTIA); move the tensors to the CPU before saving",
    ),
    (
        "torch",
        "QUInt4x2Storage",
        "packed 4-bit quantized tensors (torch.quint4x2) are not read",
    ),
    (
        "torch",
        "QUInt2x4Storage",
        "packed 2-bit quantized tensors (torch.quint2x4) are not read",
    ),
];

/// `torch.load(weights_only=True)`'s allow-list.
static ALLOWED: Globals<Global> = Globals { resolve };

/// The global `module.name`, if `torch.load(weights_only=True)` allows it here.
fn resolve(module: &str, name: &str) -> Option<Global> {
    if let Some(&(_, n, why)) = REFUSED.iter().find(|(m, n, _)| *m == module && *n == name) {
        return Some(Global::Refused(n, why));
    }
    if module == "torch" {
        if let Some(d) = DType::from_storage_class(name) {
            return Some(Global::Storage(d));
        }
        if let Some(d) = DType::from_torch_attr(name) {
            return Some(Global::Dtype(d));
        }
        if let Some(q) = QDType::ALL.into_iter().find(|q| q.storage_class() == name) {
            return Some(Global::QStorage(q));
        }
        if let Some(q) = rich::QSCHEMES.iter().find(|q| **q == name) {
            return Some(Global::QScheme(q));
        }
        if let Some(d) = OTHER_DTYPES.iter().find(|d| **d == name) {
            return Some(Global::OtherDtype(d));
        }
    }
    Some(match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildTensorV3,
        ("torch.storage", "UntypedStorage") => Global::UntypedStorage,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
        ("torch._utils", "_rebuild_tensor") => Global::RebuildTensorV1,
        ("torch._utils", "_rebuild_sparse_tensor") => Global::RebuildSparse,
        ("torch._utils", "_rebuild_qtensor") => Global::RebuildQTensor,
        ("torch._utils", "_rebuild_meta_tensor_no_storage") => Global::RebuildMeta,
        ("torch", "Tensor") => Global::TensorClass,
        ("torch.nn.parameter", "Parameter") => Global::ParameterClass,
        ("builtins" | "__builtin__", "complex") => Global::Complex,
        ("builtins" | "__builtin__", "set") => Global::Set,
        ("builtins" | "__builtin__", "bytearray") => Global::ByteArray,
        ("collections", "Counter") => Global::Counter,
        ("torch", "Size") => Global::TorchSize,
        ("_codecs", "encode") => Global::CodecsEncode,
        ("builtins" | "__builtin__", "bytes") => Global::Bytes,
        ("torch._tensor", "_rebuild_from_type_v2") => Global::RebuildFromTypeV2,
        ("torch._utils", "_rebuild_wrapper_subclass") => Global::RebuildWrapperSubclass,
        ("builtins" | "__builtin__", "getattr") => Global::Getattr,
        _ => Global::Class(Class::resolve(module, name)?),
    })
}

/// A value on the machine's stack or in its memo.
type V = Value<Global, Ext>;
/// The machine reading `data.pkl`.
type Vm<'a, 'l> = Machine<'a, TorchLoad<'l>>;

/// The stack values only `data.pkl` holds.
#[derive(Debug, Clone)]
enum Ext {
    /// A tensor, checked to lie inside its storage, built when the result is.
    Tensor(Rc<View>),
    /// A storage record: key, dtype (`None` for an untyped storage), number of elements
    /// (bytes when untyped).
    Storage(Rc<str>, Option<DType>, usize),
    /// A `ShardedTensor` or `DTensor`: local shard and global metadata.
    Sharded(Rc<ShardedView>),
    /// A tensor with more than dense values ([`RichView`]).
    Rich(Rc<RichView>),
    /// `complex(real, imag)`.
    Complex(f64, f64),
    /// `torch.device(type, index)`.
    Device(Rc<str>, Option<i64>),
    /// A layout from `torch.serialization._get_layout(name)`, by its name.
    Const(Rc<str>),
    /// `bytearray`.
    ByteArray(Rc<[u8]>),
}

/// The arena nodes only `data.pkl` holds.
#[derive(Debug)]
enum Object {
    /// A `torch.Size`: its dimensions, checked to be non-negative ints.
    Size(Vec<i64>),
    /// A `collections.OrderedDict`, with the attributes `BUILD` set on it.
    OrderedDict(Dict<Global, Ext>, Vec<(String, V)>),
    /// `set(items)`.
    Set(Vec<V>),
    /// `collections.Counter(dict)`.
    Counter(Dict<Global, Ext>),
    /// An instance of an allow-listed metadata class: the attributes `BUILD` set, kept as
    /// data (constructor arguments are not needed by anything read from them).
    Record {
        class: Class,
        attrs: Vec<(String, V)>,
    },
}

/// The state of a `data.pkl` run: the storages it declares and the tensors built from them.
struct TorchLoad<'l> {
    /// Storages declared so far: key → (dtype, elements), as in [`Ext::Storage`].
    storages: HashMap<Rc<str>, (Option<DType>, usize)>,
    /// The storages declared quantized, with their quantized dtype (their elements are
    /// that dtype's integers).
    quantized: HashMap<Rc<str>, QDType>,
    tensors: RefCell<Tensors<'l>>,
}

impl<'l> Format for TorchLoad<'l> {
    type Global = Global;
    type Ext = Ext;
    type Node = Object;

    fn reduce(m: &mut Machine<'_, Self>, f: Global, args: Vec<V>) -> Result<V> {
        m.call(f, &args)
    }

    fn newobj(m: &mut Machine<'_, Self>, cls: Global, args: Vec<V>) -> Result<V> {
        let node = match (cls, args.as_slice()) {
            (Global::ParameterClass, [data]) => {
                return m.rebuild_parameter(&[data.clone(), V::Bool(true), V::None], false)
            }
            (Global::ParameterClass, [data, rg]) => {
                return m.rebuild_parameter(&[data.clone(), rg.clone(), V::None], false)
            }
            (Global::OrderedDict, []) => Object::OrderedDict(Dict::default(), Vec::new()),
            (Global::Class(class), _)
                if !matches!(class, Class::ShardedTensor | Class::DTensor) =>
            {
                Object::Record {
                    class,
                    attrs: Vec::new(),
                }
            }
            _ => {
                return Err(m.err(format!(
                    "NEWOBJ of {} is not supported",
                    m.kind(&V::Global(cls))
                )))
            }
        };
        Ok(m.alloc(Node::Ext(node)))
    }

    fn build(m: &mut Machine<'_, Self>, state: V) -> Result<()> {
        m.set_state(state)
    }

    fn persistent_load(m: &mut Machine<'_, Self>) -> Result<V> {
        let pid = m.pop()?;
        m.storage_record(pid)
    }

    fn ext_dict(node: &mut Object) -> Option<&mut Dict<Global, Ext>> {
        match node {
            Object::OrderedDict(d, _) | Object::Counter(d) => Some(d),
            _ => None,
        }
    }

    /// The opcodes `torch._weights_only_unpickler.Unpickler.load` executes: those of protocol
    /// 2 that `torch.save` writes (a file written with `pickle_protocol=3` or higher holding
    /// bytes, or with 4's framing, is refused as PyTorch refuses it).
    fn knows_opcode(op: u8) -> bool {
        use crate::io::pickle::op::*;
        matches!(
            op,
            GLOBAL
                | NEWOBJ
                | REDUCE
                | BUILD
                | APPEND
                | APPENDS
                | SETITEM
                | SETITEMS
                | MARK
                | TUPLE
                | TUPLE1
                | TUPLE2
                | TUPLE3
                | NONE
                | NEWFALSE
                | NEWTRUE
                | EMPTY_TUPLE
                | EMPTY_LIST
                | EMPTY_DICT
                | EMPTY_SET
                | BININT
                | BININT1
                | BININT2
                | BINFLOAT
                | BINUNICODE
                | SHORT_BINSTRING
                | BINPERSID
                | BINGET
                | LONG_BINGET
                | BINPUT
                | LONG_BINPUT
                | LONG1
                | PROTO
                | STOP
        )
    }

    fn ext_kind(x: &Ext) -> String {
        match x {
            Ext::Tensor(_) => "Tensor".into(),
            Ext::Storage(k, ..) => format!("storage {k:?}"),
            Ext::Sharded(_) => "sharded tensor".into(),
            Ext::Rich(r) => match &r.value {
                rich::ValueView::Dense(_) => "Tensor".into(),
                _ => "sparse, quantized or meta tensor".into(),
            },
            Ext::Complex(..) => "complex".into(),
            Ext::Device(..) => "torch.device".into(),
            Ext::Const(name) => name.to_string(),
            Ext::ByteArray(_) => "bytearray".into(),
        }
    }

    fn node_kind(n: &Object) -> String {
        match n {
            Object::Size(_) => "torch.Size".into(),
            Object::OrderedDict(..) => "collections.OrderedDict".into(),
            Object::Set(_) => "set".into(),
            Object::Counter(_) => "collections.Counter".into(),
            Object::Record { class, .. } => format!("{class:?}"),
        }
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

/// Runs the stream `data` and returns the object it builds.
pub(crate) fn unpickle(
    file: &str,
    data: &[u8],
    store: &mut dyn Storages,
    mode: Mode,
    allow: Allow,
) -> Result<Unpickled> {
    let state = TorchLoad {
        storages: HashMap::new(),
        quantized: HashMap::new(),
        tensors: RefCell::new(Tensors::new(mode, store)),
    };
    let mut vm = Machine::new(file, data, allow.globals(), state);
    let result = vm.run()?;
    let consumed = vm.consumed();
    vm.state.tensors.get_mut().store().stream_ended(consumed)?;
    // A legitimate stream has at most one node per opcode, so a result that expands shared
    // references to far more nodes than that is an attack (or a cycle).
    let mut budget = data.len().saturating_mul(16).saturating_add(1 << 16);
    let obj = vm.to_pyobj(&result, &Path::Root, 0, &mut budget)?;
    let tensors = vm.state.tensors.get_mut();
    let shapes = std::mem::take(&mut tensors.shapes);
    let whole = std::mem::take(&mut tensors.whole);
    let views = std::mem::take(&mut tensors.views);
    let expansion_needed = tensors.expansion_needed;
    Ok(Unpickled {
        obj,
        shapes,
        whole,
        views,
        expansion_needed,
        consumed,
    })
}

impl Vm<'_, '_> {
    fn storage_err(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::TensorStorage {
            file: self.file().to_string(),
            storage: key.to_string(),
            reason: reason.into(),
        }
    }

    /// The node `v` refers to, if it is one of `data.pkl`'s own.
    fn object(&self, v: &V) -> Option<&Object> {
        match self.node(v) {
            Some(Node::Ext(o)) => Some(o),
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
        if let Some(Object::Size(dims)) = self.object(v) {
            return Ok(dims.iter().map(|&d| d as usize).collect());
        }
        let Some(items) = self.tuple_items(v) else {
            return Err(self.err(format!("{what} must be a tuple, found {}", self.kind(v))));
        };
        items.iter().map(|x| self.int_arg(x, what)).collect()
    }

    /// `REDUCE`: calls the allow-listed `g` with `a`.
    fn call(&mut self, g: Global, a: &[V]) -> Result<V> {
        match g {
            Global::OrderedDict if a.is_empty() => Ok(self.alloc(Node::Ext(
                Object::OrderedDict(Dict::default(), Vec::new()),
            ))),
            Global::OrderedDict => Err(self.err("collections.OrderedDict with arguments")),
            Global::TorchSize => match a {
                [t] if self.tuple_items(t).is_some() => {
                    let items = self.int_tuple(t, "torch.Size")?;
                    let items = items.into_iter().map(|x| x as i64).collect();
                    Ok(self.alloc(Node::Ext(Object::Size(items))))
                }
                _ => Err(self.err("torch.Size needs one tuple argument")),
            },
            Global::Bytes if a.is_empty() => Ok(V::Bytes(Rc::from(&[][..]))),
            Global::Bytes => Err(self.err("bytes() with arguments")),
            Global::CodecsEncode => self.codecs_encode(a),
            Global::RebuildParameter => self.rebuild_parameter(a, false),
            Global::RebuildParameterWithState => self.rebuild_parameter(a, true),
            Global::RebuildTensorV1 => self.rebuild_tensor_v1(a),
            Global::RebuildTensorV2 | Global::RebuildTensorV3 => {
                let (view, requires_grad) =
                    self.rebuild_tensor(a, g == Global::RebuildTensorV3)?;
                Ok(Self::dense(view, requires_grad))
            }
            Global::RebuildSparse => self.rebuild_sparse(a),
            Global::RebuildQTensor => self.rebuild_qtensor(a),
            Global::RebuildMeta => self.rebuild_meta(a),
            Global::Complex => self.complex(a),
            Global::Set | Global::ByteArray | Global::Counter => self.builtin(g, a),
            Global::Refused(name, why) => Err(Error::Unsupported(format!(
                "`{}` calls {name}, which torch.load(weights_only=True) allows but this crate does not read: {why}",
                self.file()
            ))),
            Global::TensorClass => Err(self.err("calling torch.Tensor")),
            Global::ParameterClass => Err(self.err("calling torch.nn.Parameter")),
            Global::QStorage(q) => Err(self.err(format!("calling torch.{}", q.storage_class()))),
            Global::QScheme(q) => Err(self.err(format!("calling torch.{q}"))),
            Global::OtherDtype(d) => Err(self.err(format!("calling torch.{d}"))),
            Global::Storage(d) => Err(self.err(format!("calling torch storage class ({d})"))),
            Global::UntypedStorage => Err(self.err("calling torch.storage.UntypedStorage")),
            Global::Class(Class::Device) => self.device(a),
            Global::Class(Class::Layout) => match a {
                [V::Str(name)] if TORCH_LAYOUTS.contains(&&**name) => Ok(V::Ext(Ext::Const(name.clone()))),
                _ => Err(self.err("torch.serialization._get_layout needs the name of a torch layout")),
            },
            Global::Class(class @ Class::MemoryFormat) => {
                Ok(self.alloc(Node::Ext(Object::Record {
                    class,
                    attrs: Vec::new(),
                })))
            }
            Global::Class(Class::ZeroStageEnum) => self.zero_stage(a),
            Global::Class(class) => Err(self.err(format!("calling {class:?}"))),
            Global::Getattr => match a {
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
            Global::RebuildFromTypeV2 => match a {
                [V::Global(
                    f @ (Global::RebuildTensorV1
                    | Global::RebuildTensorV2
                    | Global::RebuildTensorV3
                    | Global::RebuildSparse
                    | Global::RebuildQTensor
                    | Global::RebuildMeta),
                ), V::Global(Global::TensorClass), args, state] => {
                    let Some(args) = self.tuple_items(args).map(<[V]>::to_vec) else {
                        return Err(self.err("_rebuild_from_type_v2: args must be a tuple"));
                    };
                    let built = self.call(*f, &args)?;
                    self.with_state(&built, state)
                }
                [V::Global(Global::RebuildWrapperSubclass), V::Global(Global::Class(class @ (Class::ShardedTensor | Class::DTensor))), args, state] =>
                {
                    let Some(args) = self.tuple_items(args).map(<[V]>::to_vec) else {
                        return Err(self.err("_rebuild_from_type_v2: args must be a tuple"));
                    };
                    self.rebuild_subclass(*class, &args, state)
                }
                _ => Err(self.err(
                    "_rebuild_from_type_v2 is only allowed for a torch.Tensor rebuilt by a tensor rebuild function, or for _rebuild_wrapper_subclass of a ShardedTensor or DTensor",
                )),
            },
            Global::Dtype(d) => Err(self.err(format!("calling {d}"))),
        }
    }

    /// `_codecs.encode(s, 'latin1')`: how protocol 2 pickles `bytes`.
    fn codecs_encode(&self, a: &[V]) -> Result<V> {
        match a {
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
        }
    }

    /// `BUILD`: sets the attributes of a record or an `OrderedDict`.
    fn set_state(&mut self, state: V) -> Result<()> {
        let i = self.top_obj()?;
        if matches!(state, V::None) {
            return Ok(());
        }
        if let Some(Object::Record { .. }) = self.object(&V::Obj(i)) {
            return self.build_record(i, state);
        }
        let attrs: Vec<(String, V)> = match self.node(&state) {
            Some(Node::Dict(d)) => {
                let mut out = Vec::new();
                for (k, v) in d.items() {
                    let V::Str(k) = k else {
                        return Err(self.err("BUILD state keys must be strings"));
                    };
                    out.push((k.to_string(), v.clone()));
                }
                out
            }
            _ => return Err(self.err(format!("BUILD with a {} state", self.kind(&state)))),
        };
        let kind = self.kind(&V::Obj(i));
        match self.node_mut(i) {
            Some(Node::Ext(Object::OrderedDict(_, existing))) => {
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

    /// `BINPERSID`: a storage record `('storage', torch.<T>Storage, key, location, numel)`,
    /// checked against the archive's entry the first time its key is seen.
    fn storage_record(&mut self, pid: V) -> Result<V> {
        let items = match self.tuple_items(&pid) {
            Some(items) => items.to_vec(),
            None => {
                return Err(self.err(format!(
                    "persistent id must be a tuple, found {}",
                    self.kind(&pid)
                )))
            }
        };
        let legacy = self.state.tensors.get_mut().store().legacy();
        let (items, view) = match items.split_at_checked(5) {
            Some((id, [view])) if legacy => (id, Some(view)),
            _ => (items.as_slice(), None),
        };
        let [V::Str(tag), V::Global(class), V::Str(key), V::Str(_location), numel] = items else {
            return Err(self.err(if legacy {
                "persistent id must be ('storage', torch.<T>Storage, key, location, numel, view_metadata)"
            } else {
                "persistent id must be ('storage', torch.<T>Storage, key, location, numel)"
            }));
        };
        if legacy && !matches!(view, Some(V::None)) {
            return Err(self.storage_err(
                key,
                "a legacy storage view (view_metadata), which PyTorch has not written since it stopped saving views",
            ));
        }
        let quantized = match class {
            Global::QStorage(q) => Some(*q),
            _ => None,
        };
        let dtype = match class {
            Global::Storage(d) => Some(*d),
            Global::QStorage(q) => Some(q.int_dtype()),
            Global::UntypedStorage => None,
            other => {
                return Err(self.err(format!(
                    "persistent id names {other:?}, not a storage class"
                )))
            }
        };
        if &**tag != "storage" {
            return Err(self.err(format!("persistent id tag {tag:?} is not 'storage'")));
        }
        let numel = self.int_arg(numel, "storage numel")?;
        if let Some(&(d, n)) = self.state.storages.get(key) {
            if d != dtype || self.state.quantized.get(key).copied() != quantized {
                let name = |d: Option<DType>| d.map_or("untyped".to_string(), |d| d.to_string());
                return Err(self.storage_err(
                    key,
                    format!("viewed as both {} and {}", name(d), name(dtype)),
                ));
            }
            if n != numel {
                return Err(
                    self.storage_err(key, format!("declared with {n} and {numel} elements"))
                );
            }
            return Ok(V::Ext(Ext::Storage(key.clone(), dtype, numel)));
        }
        self.state
            .tensors
            .get_mut()
            .declare(key, dtype.unwrap_or(DType::U8), numel)?;
        self.state.storages.insert(key.clone(), (dtype, numel));
        if let Some(q) = quantized {
            self.state.quantized.insert(key.clone(), q);
        }
        Ok(V::Ext(Ext::Storage(key.clone(), dtype, numel)))
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
            V::Ext(Ext::Tensor(view)) => PyObj::Tensor(self.materialize(view, path)?),
            V::Ext(Ext::Sharded(s)) => PyObj::Sharded(Box::new(ShardedTensor {
                global_shape: s.global_shape.clone(),
                offsets: s.offsets.clone(),
                local: match &s.local {
                    Some(V::Ext(Ext::Tensor(view))) => Some(self.materialize(view, path)?),
                    _ => None,
                },
            })),
            V::Ext(Ext::Rich(r)) => self.rich_to_pyobj(r, path, depth, budget)?,
            V::Ext(Ext::Complex(re, im)) => PyObj::Complex(*re, *im),
            V::Ext(Ext::Device(kind, index)) => PyObj::Device(kind.to_string(), *index),
            V::Ext(Ext::Const(name)) => PyObj::TorchConst(name.to_string()),
            V::Ext(Ext::ByteArray(b)) => PyObj::ByteArray(b.to_vec()),
            V::Global(Global::Dtype(d)) => PyObj::TorchConst(d.torch_name().into()),
            V::Global(Global::OtherDtype(d) | Global::QScheme(d)) => {
                PyObj::TorchConst(format!("torch.{d}"))
            }
            V::Global(_) | V::Ext(Ext::Storage(..)) => {
                return Err(self.err(format!(
                    "a bare {} in the result is not supported",
                    self.kind(v)
                )))
            }
            V::Obj(_) => self.node_to_pyobj(v, path, depth, budget)?,
        })
    }

    /// [`Vm::to_pyobj`] of a node of the arena.
    fn node_to_pyobj(
        &self,
        v: &V,
        path: &Path<'_>,
        depth: usize,
        budget: &mut usize,
    ) -> Result<PyObj> {
        let seq = |items: &[V], budget: &mut usize| -> Result<Vec<PyObj>> {
            items
                .iter()
                .enumerate()
                .map(|(i, x)| self.to_pyobj(x, &Path::Index(path, i), depth + 1, budget))
                .collect()
        };
        let pairs = |d: &Dict<Global, Ext>, budget: &mut usize| -> Result<Vec<(PyObj, PyObj)>> {
            d.items()
                .iter()
                .map(|(k, v)| {
                    Ok((
                        self.to_pyobj(k, path, depth + 1, budget)?,
                        self.to_pyobj(v, &Path::Key(path, k), depth + 1, budget)?,
                    ))
                })
                .collect()
        };
        Ok(match self.node(v) {
            Some(Node::Tuple(items)) => PyObj::Tuple(seq(items, budget)?),
            Some(Node::List(items)) => PyObj::List(seq(items, budget)?),
            Some(Node::Dict(d)) => PyObj::Dict(pairs(d, budget)?),
            Some(Node::Ext(Object::Size(dims))) => PyObj::Size(dims.clone()),
            Some(Node::Ext(Object::Set(items))) => PyObj::Set(seq(items, budget)?),
            Some(Node::Ext(Object::Counter(d))) => PyObj::Counter(pairs(d, budget)?),
            Some(Node::Ext(Object::OrderedDict(d, attrs))) => PyObj::OrderedDict {
                items: pairs(d, budget)?,
                attrs: attrs
                    .iter()
                    .map(|(k, v)| {
                        let at = Path::Attr(path, k);
                        Ok((k.clone(), self.to_pyobj(v, &at, depth + 1, budget)?))
                    })
                    .collect::<Result<_>>()?,
            },
            Some(Node::Ext(Object::Record { class, attrs }))
                if deepspeed::is_attribute_record(*class) =>
            {
                PyObj::Dict(
                    attrs
                        .iter()
                        .map(|(k, v)| {
                            let at = Path::Attr(path, k);
                            Ok((
                                PyObj::Str(k.clone()),
                                self.to_pyobj(v, &at, depth + 1, budget)?,
                            ))
                        })
                        .collect::<Result<_>>()?,
                )
            }
            Some(Node::Ext(Object::Record { class, .. })) => {
                return Err(self.err(format!("a bare {class:?} in the result is not supported")))
            }
            None => return Err(self.err("a reference to no object")),
        })
    }
}
