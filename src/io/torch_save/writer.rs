//! Writing [`PyObj`]s as `torch.save` archives: a protocol-2 pickler that emits what Python's
//! pickler emits for the same values, and the archive records PyTorch 2.13 writes.

use super::pyobj::{PyObj, QScheme, RichTensor, TensorValue};
use super::unpickle::{contiguous_strides, MAX_DEPTH};
use super::zip::{Positioned, ZipWriter};
use crate::error::{Error, Result};
use crate::io::pickle::{op, Emitter};
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;
use std::io::Write;

/// Python's pickler splits `APPENDS` and `SETITEMS` into batches of this many items.
const BATCH: usize = 1000;

/// Tensors of an object whose bytes are produced while the archive is written instead of
/// being held in memory: the object holds a small placeholder tensor for each, which this
/// recognizes, gives the real shape of, and streams the bytes of.
pub(crate) trait LazyTensors {
    /// The real shape of `t` when it is a placeholder (its dtype is the real one).
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>>;
    /// Which whole read of the input placeholder `t`'s bytes are cut from, when other
    /// placeholders' are cut from it too (views of one stored storage); `None` when `t` is
    /// read alone. A writer free to choose its order streams the placeholders of one group
    /// one after another, so that the input is read once for them all.
    fn read_group(&self, _t: &HostTensor) -> Option<usize> {
        None
    }
    /// Writes placeholder `t`'s bytes, in order, through `sink`.
    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()>;
    /// Called once a writer has streamed its share, before the output is committed: a
    /// source that checks what it handed out only once it has read its input through (the
    /// CRC-32 of a storage read in ranges) finishes that here, and its error fails the write.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// No lazy tensors.
pub(crate) struct Eager;

impl LazyTensors for Eager {
    fn shape_of(&self, _: &HostTensor) -> Option<Vec<usize>> {
        None
    }
    fn stream(
        &mut self,
        _: &HostTensor,
        _: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        Ok(())
    }
}

/// What a storage's bytes are.
enum StorageData<'a> {
    /// Held in memory.
    Bytes(&'a [u8]),
    /// A lazy placeholder's (the real data's length), streamed when written.
    Lazy(&'a HostTensor, u64),
}

impl StorageData<'_> {
    /// Bytes of the storage's data.
    fn len(&self) -> u64 {
        match self {
            StorageData::Bytes(b) => b.len() as u64,
            StorageData::Lazy(_, len) => *len,
        }
    }
}

/// The bytes of one storage to write, as a range of a tensor's buffer.
struct StorageOut<'a> {
    /// A tensor whose buffer holds the bytes.
    owner: &'a HostTensor,
    dtype: DType,
    /// Byte range of the buffer that is written.
    start: usize,
    end: usize,
    /// Key (`data/<key>`) once the pickler has met the storage.
    key: Option<usize>,
    /// The real shape of a lazy placeholder (whose bytes `start..end` are not in memory).
    lazy: Option<Vec<usize>>,
}

/// Which storage each tensor goes to.
///
/// Tensors that view one buffer share one storage, which covers the smallest byte range
/// holding all of them, so bytes no tensor in the object references are not written. A buffer
/// viewed with more than one dtype (which [`HostTensor`] never produces) is written once per
/// tensor instead.
struct StoragePlan<'a> {
    storages: Vec<StorageOut<'a>>,
    /// Buffer identity → storage index (shared buffers).
    by_buffer: HashMap<usize, usize>,
    /// Buffers whose tensors get one storage each.
    split: std::collections::HashSet<usize>,
    /// Keys handed out so far.
    next_key: usize,
}

impl<'a> StoragePlan<'a> {
    fn collect(obj: &'a PyObj, tensors: &mut Vec<&'a HostTensor>, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(Error::UnexpectedObject {
                path: "<object>".into(),
                expected: format!("containers nested at most {MAX_DEPTH} deep"),
                found: "deeper nesting".into(),
            });
        }
        match obj {
            PyObj::Tensor(t) => tensors.push(t),
            PyObj::Tuple(v) | PyObj::List(v) => {
                for x in v {
                    Self::collect(x, tensors, depth + 1)?;
                }
            }
            PyObj::Dict(items) => {
                for (k, v) in items {
                    Self::collect(k, tensors, depth + 1)?;
                    Self::collect(v, tensors, depth + 1)?;
                }
            }
            PyObj::OrderedDict { items, attrs } => {
                for (k, v) in items {
                    Self::collect(k, tensors, depth + 1)?;
                    Self::collect(v, tensors, depth + 1)?;
                }
                for (_, v) in attrs {
                    Self::collect(v, tensors, depth + 1)?;
                }
            }
            PyObj::Counter(items) => {
                for (k, v) in items {
                    Self::collect(k, tensors, depth + 1)?;
                    Self::collect(v, tensors, depth + 1)?;
                }
            }
            PyObj::Set(v) => {
                for x in v {
                    Self::collect(x, tensors, depth + 1)?;
                }
            }
            PyObj::RichTensor(r) => {
                tensors.extend(r.tensors());
                for (_, v) in &r.attrs {
                    Self::collect(v, tensors, depth + 1)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn new(obj: &'a PyObj, lazy: &dyn LazyTensors) -> Result<Self> {
        let mut tensors = Vec::new();
        Self::collect(obj, &mut tensors, 0)?;
        let mut plan = StoragePlan {
            storages: Vec::new(),
            by_buffer: HashMap::new(),
            split: Default::default(),
            next_key: 0,
        };
        for t in tensors {
            if let Some(shape) = lazy.shape_of(t) {
                if plan.by_buffer.contains_key(&t.storage_id()) {
                    // The same placeholder again (a tied weight): one storage for both.
                    continue;
                }
                // A storage of its own, whatever buffer the placeholder lives in.
                let numel: usize = shape.iter().product();
                plan.by_buffer.insert(t.storage_id(), plan.storages.len());
                plan.storages.push(StorageOut {
                    owner: t,
                    dtype: t.dtype(),
                    start: 0,
                    end: numel * t.dtype().size(),
                    key: None,
                    lazy: Some(shape),
                });
                continue;
            }
            let id = t.storage_id();
            let start = t.storage_byte_offset();
            let end = start + t.nbytes();
            match plan.by_buffer.get(&id) {
                Some(&i) => {
                    let s = &mut plan.storages[i];
                    if s.dtype != t.dtype() || (start.abs_diff(s.start)) % t.dtype().size() != 0 {
                        plan.split.insert(id);
                    }
                    s.start = s.start.min(start);
                    s.end = s.end.max(end);
                }
                None => {
                    plan.by_buffer.insert(id, plan.storages.len());
                    plan.storages.push(StorageOut {
                        owner: t,
                        dtype: t.dtype(),
                        start,
                        end,
                        key: None,
                        lazy: None,
                    });
                }
            }
        }
        Ok(plan)
    }

    /// The real shape of `t` when it is a lazy placeholder.
    fn lazy_shape(&self, t: &HostTensor) -> Option<Vec<usize>> {
        let i = *self.by_buffer.get(&t.storage_id())?;
        self.storages[i].lazy.clone()
    }

    /// The storage for `t`: (key, storage numel, element offset of `t` in it).
    fn place(&mut self, t: &'a HostTensor) -> (usize, usize, usize) {
        let id = t.storage_id();
        let esize = t.dtype().size();
        if self.split.contains(&id) {
            let key = self.next_key;
            self.next_key += 1;
            // One storage per tensor, appended after the planned ones.
            let start = t.storage_byte_offset();
            self.storages.push(StorageOut {
                owner: t,
                dtype: t.dtype(),
                start,
                end: start + t.nbytes(),
                key: Some(key),
                lazy: None,
            });
            return (key, t.numel(), 0);
        }
        let i = self.by_buffer[&id];
        let s = &mut self.storages[i];
        let key = match s.key {
            Some(k) => k,
            None => {
                let k = self.next_key;
                self.next_key += 1;
                s.key = Some(k);
                k
            }
        };
        let offset = (t.storage_byte_offset() - s.start) / esize;
        (key, (s.end - s.start) / esize, offset)
    }

    /// Storages to write, in key order.
    fn in_key_order(&self) -> Vec<(usize, StorageData<'a>)> {
        let mut out: Vec<(usize, StorageData<'a>)> = self
            .storages
            .iter()
            .filter_map(|s| {
                let data = match s.lazy {
                    Some(_) => StorageData::Lazy(s.owner, (s.end - s.start) as u64),
                    None => StorageData::Bytes(&s.owner.storage_bytes()[s.start..s.end]),
                };
                s.key.map(|k| (k, data))
            })
            .collect();
        out.sort_by_key(|(k, _)| *k);
        out
    }
}

/// A protocol-2 pickler: the bytes Python's pickler writes for the same values. Python
/// memoizes by identity; here equal strings and equal globals count as one object, written
/// once and then fetched from the memo.
struct Pickler<'a> {
    e: Emitter,
    strings: HashMap<&'a str, u32>,
    /// Memo index of each global written, by an id of its own.
    globals: HashMap<&'static str, u32>,
    plan: StoragePlan<'a>,
}

impl<'a> Pickler<'a> {
    fn global(&mut self, module: &'static str, name: &'static str, id: &'static str) {
        if let Some(&i) = self.globals.get(id) {
            self.e.get(i);
            return;
        }
        self.e.global(module, name);
        if let Some(i) = self.e.memoize() {
            self.globals.insert(id, i);
        }
    }

    fn str(&mut self, s: &'a str) {
        if let Some(&i) = self.strings.get(s) {
            self.e.get(i);
            return;
        }
        self.e.str(s);
        if let Some(i) = self.e.memoize() {
            self.strings.insert(s, i);
        }
    }

    /// A string Python would not meet again (memoized, never fetched).
    fn fresh_str(&mut self, s: &str) {
        self.e.str(s);
        self.e.memoize();
    }

    fn tuple_of<T>(
        &mut self,
        items: &'a [T],
        mut f: impl FnMut(&mut Self, &'a T) -> Result<()>,
    ) -> Result<()> {
        self.e.tuple_start(items.len());
        for x in items {
            f(self, x)?;
        }
        self.e.tuple_end(items.len());
        self.e.memoize();
        Ok(())
    }

    /// A tuple of sizes (a shape or strides): as [`Pickler::tuple_of`], but an empty one is
    /// not memoized.
    fn dims(&mut self, dims: &[usize]) {
        self.e.tuple_start(dims.len());
        for &d in dims {
            self.e.int(d as i64);
        }
        self.e.tuple_end(dims.len());
        if !dims.is_empty() {
            self.e.memoize();
        }
    }

    fn set_items<K, V>(
        &mut self,
        items: &'a [(K, V)],
        mut f: impl FnMut(&mut Self, &'a K, &'a V) -> Result<()>,
    ) -> Result<()> {
        for batch in items.chunks(BATCH) {
            if batch.len() > 1 {
                self.e.op(op::MARK);
            }
            for (k, v) in batch {
                f(self, k, v)?;
            }
            self.e.op(if batch.len() > 1 {
                op::SETITEMS
            } else {
                op::SETITEM
            });
        }
        Ok(())
    }

    /// An empty `collections.OrderedDict()`, memoized.
    fn ordered_dict(&mut self) {
        self.global("collections", "OrderedDict", "OrderedDict");
        self.e.op(op::EMPTY_TUPLE);
        self.e.op(op::REDUCE);
        self.e.memoize();
    }

    /// A plain tensor: `_rebuild_tensor_v2(...)` (or `_v3`), called.
    fn tensor(&mut self, t: &'a HostTensor) -> Result<()> {
        self.dense_func(t);
        self.dense_args(t, false);
        self.e.memoize();
        self.call()
    }

    /// Ends a call whose function and argument tuple are on the stack (`REDUCE`).
    fn call(&mut self) -> Result<()> {
        self.e.op(op::REDUCE);
        self.e.memoize();
        Ok(())
    }

    /// The persistent id of `t`'s storage, `('storage', torch.<class>, key, 'cpu', numel)`,
    /// loaded (`BINPERSID`), then `t`'s element offset in it, size and (contiguous) stride.
    fn storage_view(&mut self, t: &'a HostTensor, class: Option<&'static str>) {
        let (key, numel, offset) = self.plan.place(t);
        self.e.op(op::MARK);
        self.str("storage");
        match class {
            Some(class) => self.global("torch", class, class),
            None => self.global("torch.storage", "UntypedStorage", "UntypedStorage"),
        }
        self.fresh_str(&key.to_string());
        self.str("cpu");
        let units = if class.is_some() { 1 } else { t.dtype().size() };
        self.e.int((numel * units) as i64);
        self.e.op(op::TUPLE);
        self.e.memoize();
        self.e.op(op::BINPERSID);
        self.e.int(offset as i64);
        let lazy_shape = self.plan.lazy_shape(t);
        let shape = lazy_shape.as_deref().unwrap_or(t.shape());
        self.dims(shape);
        self.dims(&contiguous_strides(shape));
    }

    /// The rebuild function of a dense tensor: `_rebuild_tensor_v2` of a typed storage, or
    /// `_rebuild_tensor_v3` for the dtypes that have no typed storage class.
    fn dense_func(&mut self, t: &HostTensor) {
        match t.dtype().storage_class() {
            Some(_) => self.global("torch._utils", "_rebuild_tensor_v2", "rebuild"),
            None => self.global("torch._utils", "_rebuild_tensor_v3", "rebuild_v3"),
        }
    }

    /// The argument tuple of [`Pickler::dense_func`]'s function, not memoized:
    /// `(storage, offset, size, stride, requires_grad, OrderedDict()[, dtype])`.
    fn dense_args(&mut self, t: &'a HostTensor, requires_grad: bool) {
        let class = t.dtype().storage_class();
        self.e.op(op::MARK);
        self.storage_view(t, class);
        self.e.bool(requires_grad);
        self.ordered_dict();
        if class.is_none() {
            let d = t.dtype();
            self.global("torch", d.torch_attr(), d.torch_name());
        }
        self.e.op(op::TUPLE);
    }

    /// A [`RichTensor`] as PyTorch pickles it: a Parameter through `_rebuild_parameter`
    /// (`_with_state` when it has attributes), another tensor with attributes through
    /// `_rebuild_from_type_v2(func, torch.Tensor, args, state)`, else its own rebuild call.
    fn rich_tensor(&mut self, r: &'a RichTensor) -> Result<()> {
        let state = !r.attrs.is_empty();
        if r.parameter {
            let TensorValue::Dense(t) = &r.value else {
                return Err(Error::Unsupported(format!(
                    "writing an nn.Parameter holding a {}",
                    r.kind()
                )));
            };
            if state {
                self.global(
                    "torch._utils",
                    "_rebuild_parameter_with_state",
                    "rebuild_param_state",
                );
            } else {
                self.global("torch._utils", "_rebuild_parameter", "rebuild_param");
            }
            self.e.op(op::MARK);
            self.tensor(t)?;
            self.e.bool(r.requires_grad);
            self.ordered_dict();
            if state {
                self.attrs(&r.attrs)?;
            }
            self.e.op(op::TUPLE);
            self.e.memoize();
            return self.call();
        }
        if !state {
            self.value_func(&r.value);
            self.value_args(&r.value, r.requires_grad)?;
            return self.call();
        }
        self.global(
            "torch._tensor",
            "_rebuild_from_type_v2",
            "rebuild_from_type",
        );
        self.e.op(op::MARK);
        self.value_func(&r.value);
        self.global("torch", "Tensor", "Tensor");
        self.value_args(&r.value, r.requires_grad)?;
        self.attrs(&r.attrs)?;
        self.e.op(op::TUPLE);
        self.e.memoize();
        self.call()
    }

    /// The rebuild function of a tensor value.
    fn value_func(&mut self, v: &'a TensorValue) {
        match v {
            TensorValue::Dense(t) => self.dense_func(t),
            TensorValue::SparseCoo { .. } | TensorValue::SparseCompressed { .. } => {
                self.global("torch._utils", "_rebuild_sparse_tensor", "rebuild_sparse")
            }
            TensorValue::Quantized(_) => {
                self.global("torch._utils", "_rebuild_qtensor", "rebuild_qtensor")
            }
            TensorValue::Meta { .. } => self.global(
                "torch._utils",
                "_rebuild_meta_tensor_no_storage",
                "rebuild_meta",
            ),
        }
    }

    /// The argument tuple of [`Pickler::value_func`]'s function.
    fn value_args(&mut self, v: &'a TensorValue, requires_grad: bool) -> Result<()> {
        match v {
            TensorValue::Dense(t) => self.dense_args(t, requires_grad),
            TensorValue::SparseCoo {
                indices,
                values,
                size,
                coalesced,
            } => {
                self.layout("torch.sparse_coo");
                self.e.op(op::MARK);
                self.tensor(indices)?;
                self.tensor(values)?;
                self.size(size)?;
                if let Some(c) = coalesced {
                    self.e.bool(*c);
                }
                self.e.op(op::TUPLE);
                self.e.memoize();
                self.e.op(op::TUPLE2);
            }
            TensorValue::SparseCompressed {
                layout,
                compressed_indices,
                plain_indices,
                values,
                size,
            } => {
                self.layout(layout.torch_name());
                self.e.op(op::MARK);
                self.tensor(compressed_indices)?;
                self.tensor(plain_indices)?;
                self.tensor(values)?;
                self.size(size)?;
                self.e.op(op::TUPLE);
                self.e.memoize();
                self.e.op(op::TUPLE2);
            }
            TensorValue::Quantized(q) => {
                self.e.op(op::MARK);
                self.storage_view(&q.int_repr, Some(q.dtype.storage_class()));
                self.e.op(op::MARK);
                match &q.scheme {
                    QScheme::PerTensorAffine { scale, zero_point } => {
                        self.global("torch", "per_tensor_affine", "per_tensor_affine");
                        self.e.float(*scale);
                        self.e.int(*zero_point);
                    }
                    QScheme::PerChannel {
                        scales,
                        zero_points,
                        axis,
                        ..
                    } => {
                        // As PyTorch pickles both per-channel schemes: the zero points'
                        // dtype says which it is.
                        self.global("torch", "per_channel_affine", "per_channel_affine");
                        self.tensor(scales)?;
                        self.tensor(zero_points)?;
                        self.e.int(*axis);
                    }
                }
                self.e.op(op::TUPLE);
                self.e.memoize();
                self.e.bool(requires_grad);
                self.ordered_dict();
                self.e.op(op::TUPLE);
            }
            TensorValue::Meta {
                dtype,
                size,
                stride,
            } => {
                self.e.op(op::MARK);
                self.global("torch", dtype.torch_attr(), dtype.torch_name());
                self.dims(size);
                self.dims(stride);
                self.e.bool(requires_grad);
                self.e.op(op::TUPLE);
            }
        }
        self.e.memoize();
        Ok(())
    }

    /// `torch.serialization._get_layout(name)`, called.
    fn layout(&mut self, name: &'static str) {
        self.global("torch.serialization", "_get_layout", "get_layout");
        self.str(name);
        self.e.op(op::TUPLE1);
        self.e.memoize();
        self.e.op(op::REDUCE);
        self.e.memoize();
    }

    /// A `torch.Size`, as Python pickles it: `torch.Size((d0, d1, ...))`.
    fn size(&mut self, dims: &'a [usize]) -> Result<()> {
        self.global("torch", "Size", "Size");
        self.tuple_of(dims, |p, &d| {
            p.e.int(d as i64);
            Ok(())
        })?;
        self.e.op(op::TUPLE1);
        self.e.memoize();
        self.call()
    }

    /// An attribute dict (the `state` of a tensor or Parameter).
    fn attrs(&mut self, attrs: &'a [(String, PyObj)]) -> Result<()> {
        self.e.op(op::EMPTY_DICT);
        self.e.memoize();
        self.set_items(attrs, |p, k, v| {
            p.str(k);
            p.obj(v)
        })
    }

    /// `builtin(arg)`, e.g. `set([...])`, as protocol 2 writes a builtin with no opcode.
    fn builtin_of(
        &mut self,
        name: &'static str,
        arg: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        self.global("__builtin__", name, name);
        arg(self)?;
        self.e.op(op::TUPLE1);
        self.e.memoize();
        self.call()
    }

    /// `bytes`: protocol 2 has no bytes opcode, so Python writes
    /// `_codecs.encode(latin1_str, 'latin1')`.
    fn bytes(&mut self, b: &[u8]) {
        self.global("_codecs", "encode", "encode");
        let latin1: String = b.iter().map(|&c| char::from(c)).collect();
        self.fresh_str(&latin1);
        self.str("latin1");
        self.e.op(op::TUPLE2);
        self.e.memoize();
        self.e.op(op::REDUCE);
        self.e.memoize();
    }

    fn obj(&mut self, o: &'a PyObj) -> Result<()> {
        match o {
            PyObj::None => self.e.none(),
            PyObj::Bool(b) => self.e.bool(*b),
            PyObj::Int(i) => self.e.int(*i),
            PyObj::BigInt(b) => self.e.long(b),
            PyObj::Float(x) => self.e.float(*x),
            PyObj::Str(s) => self.str(s),
            PyObj::Bytes(b) => self.bytes(b),
            PyObj::Tuple(items) => self.tuple_of(items, |p, x| p.obj(x))?,
            PyObj::Size(dims) => {
                // As Python pickles it: torch.Size((d0, d1, ...)).
                self.global("torch", "Size", "Size");
                self.tuple_of(dims, |p, &d| {
                    p.e.int(d);
                    Ok(())
                })?;
                self.e.op(op::TUPLE1);
                self.e.memoize();
                self.e.op(op::REDUCE);
                self.e.memoize();
            }
            PyObj::List(items) => self.obj_list(items)?,
            PyObj::Dict(items) => {
                self.e.op(op::EMPTY_DICT);
                self.e.memoize();
                self.set_items(items, |p, k, v| {
                    p.obj(k)?;
                    p.obj(v)
                })?;
            }
            PyObj::OrderedDict { items, attrs } => self.ordered_dict_of(items, attrs)?,
            PyObj::Tensor(t) => self.tensor(t)?,
            PyObj::RichTensor(r) => self.rich_tensor(r)?,
            PyObj::Complex(re, im) => {
                self.global("__builtin__", "complex", "complex");
                self.e.float(*re);
                self.e.float(*im);
                self.e.op(op::TUPLE2);
                self.e.memoize();
                self.call()?;
            }
            PyObj::Set(items) => self.builtin_of("set", |p| p.obj_list(items))?,
            PyObj::ByteArray(b) => self.builtin_of("bytearray", |p| {
                p.bytes(b);
                Ok(())
            })?,
            PyObj::Counter(items) => {
                self.global("collections", "Counter", "Counter");
                self.e.op(op::EMPTY_DICT);
                self.e.memoize();
                self.set_items(items, |p, k, v| {
                    p.obj(k)?;
                    p.obj(v)
                })?;
                self.e.op(op::TUPLE1);
                self.e.memoize();
                self.call()?;
            }
            PyObj::Device(kind, index) => {
                self.global("torch", "device", "device");
                self.fresh_str(kind);
                match index {
                    Some(i) => {
                        self.e.int(*i);
                        self.e.op(op::TUPLE2);
                    }
                    None => self.e.op(op::TUPLE1),
                }
                self.e.memoize();
                self.call()?;
            }
            PyObj::TorchConst(name) => self.torch_const(name)?,
            PyObj::Sharded(s) => {
                return Err(Error::Unsupported(format!(
                    "writing a sharded tensor (local piece of {:?}) to a torch.save file; consolidate the ranks' files first (fsdp-ckpt consolidate-sharded)",
                    s.global_shape
                )))
            }
        }
        Ok(())
    }

    /// A `list`.
    fn obj_list(&mut self, items: &'a [PyObj]) -> Result<()> {
        self.e.op(op::EMPTY_LIST);
        self.e.memoize();
        for batch in items.chunks(BATCH) {
            if batch.len() > 1 {
                self.e.op(op::MARK);
            }
            for x in batch {
                self.obj(x)?;
            }
            self.e.op(if batch.len() > 1 {
                op::APPENDS
            } else {
                op::APPEND
            });
        }
        Ok(())
    }

    /// A `torch` constant: a dtype or quantization scheme as the global `torch.<name>`, a
    /// layout as `torch.serialization._get_layout(name)`.
    fn torch_const(&mut self, name: &str) -> Result<()> {
        let Some(attr) = name
            .strip_prefix("torch.")
            .filter(|a| !a.is_empty() && a.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        else {
            return Err(Error::Unsupported(format!(
                "writing the torch constant {name:?}: not a `torch.<name>`"
            )));
        };
        if attr.starts_with("sparse_") || attr == "strided" {
            self.global("torch.serialization", "_get_layout", "get_layout");
            self.fresh_str(name);
            self.e.op(op::TUPLE1);
            self.e.memoize();
            return self.call();
        }
        self.e.global("torch", attr);
        self.e.memoize();
        Ok(())
    }

    /// An `OrderedDict` with its items, and its attributes set by `BUILD`.
    fn ordered_dict_of(
        &mut self,
        items: &'a [(PyObj, PyObj)],
        attrs: &'a [(String, PyObj)],
    ) -> Result<()> {
        self.ordered_dict();
        self.set_items(items, |p, k, v| {
            p.obj(k)?;
            p.obj(v)
        })?;
        if !attrs.is_empty() {
            self.attrs(attrs)?;
            self.e.op(op::BUILD);
        }
        Ok(())
    }
}

/// Digits of the `.data/serialization_id` record: derived from the content, so that equal
/// objects give byte-identical files.
///
/// `storages` is the CRC-32 state of the storages' bytes, in key order (combined from each
/// storage's own, which its zip entry uses, so the bytes are hashed once).
fn serialization_id(pickle: &[u8], storages: crc32fast::Hasher) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64; // FNV-1a over the pickle
    for &b in pickle {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:020}{:020}", u64::from(storages.finalize()))
}

/// Writes `obj` as a `torch.save` archive named `archive` (the folder inside the zip) to `out`;
/// `file` names the destination in error messages.
pub(crate) fn write<W: Write>(obj: &PyObj, archive: &str, file: &str, out: W) -> Result<W> {
    write_with(obj, archive, file, out, &mut Eager)
}

/// [`write`] where the tensors `lazy` recognizes are placeholders whose bytes it streams while
/// the archive is written: the file is the same as for an object holding the real tensors.
pub(crate) fn write_with<W: Write>(
    obj: &PyObj,
    archive: &str,
    file: &str,
    out: W,
    lazy: &mut dyn LazyTensors,
) -> Result<W> {
    let a = Archive::new(obj, archive, file, lazy)?;
    let io = a.io_err();
    let out = a.write(ZipWriter::new(out), |z, _, data| {
        let mut one = crc32fast::Hasher::new();
        match data {
            StorageData::Bytes(bytes) => {
                one.update(bytes);
                z.data(bytes).map_err(io)?;
            }
            StorageData::Lazy(t, _) => lazy.stream(t, &mut |chunk| {
                one.update(chunk);
                z.data(chunk)
            })?,
        }
        Ok(one)
    })?;
    Ok(out)
}

/// An object ready to be written as a `torch.save` archive: its pickle and its storages in
/// key order (the order of their records).
struct Archive<'a> {
    /// The folder inside the zip.
    name: &'a str,
    /// The destination, for messages.
    file: &'a str,
    pickle: Vec<u8>,
    storages: Vec<(usize, StorageData<'a>)>,
}

impl<'a> Archive<'a> {
    fn new(obj: &'a PyObj, name: &'a str, file: &'a str, lazy: &dyn LazyTensors) -> Result<Self> {
        let plan = StoragePlan::new(obj, lazy)?;
        let mut p = Pickler {
            e: Emitter::new(2),
            strings: HashMap::new(),
            globals: HashMap::new(),
            plan,
        };
        p.obj(obj)?;
        let storages = p.plan.in_key_order();
        Ok(Archive {
            name,
            file,
            pickle: p.e.finish(),
            storages,
        })
    }

    fn io_err(&self) -> impl Fn(std::io::Error) -> Error + Copy + '_ {
        move |e: std::io::Error| Error::Io {
            op: "writing".into(),
            path: self.file.to_string(),
            source: e.into(),
        }
    }

    /// Writes the archive's records through `z`, PyTorch's order: the pickle, the format
    /// records, the storages, the version and the serialization id. `data` writes (or steps
    /// over) the data of storage `i` of [`Archive::storages`] and returns its CRC-32 state.
    fn write<W: Write>(
        &self,
        mut z: ZipWriter<W>,
        mut data: impl FnMut(&mut ZipWriter<W>, usize, &StorageData<'a>) -> Result<crc32fast::Hasher>,
    ) -> Result<W> {
        let io = self.io_err();
        let name = self.name;
        z.entry(&format!("{name}/data.pkl"), &[&self.pickle])
            .map_err(io)?;
        z.entry(&format!("{name}/.format_version"), &[b"1"])
            .map_err(io)?;
        z.entry(&format!("{name}/.storage_alignment"), &[b"64"])
            .map_err(io)?;
        z.entry(&format!("{name}/byteorder"), &[b"little"])
            .map_err(io)?;
        let mut all = crc32fast::Hasher::new();
        for (i, (key, storage)) in self.storages.iter().enumerate() {
            z.begin_entry(&format!("{name}/data/{key}")).map_err(io)?;
            let one = data(&mut z, i, storage)?;
            z.end_entry(one.clone().finalize()).map_err(io)?;
            all.combine(&one);
        }
        z.entry(&format!("{name}/version"), &[b"3\n"]).map_err(io)?;
        let id = serialization_id(&self.pickle, all);
        z.entry(&format!("{name}/.data/serialization_id"), &[id.as_bytes()])
            .map_err(io)?;
        z.finish().map_err(io)
    }
}

/// A `torch.save` archive whose layout is fixed before any byte is written: where each
/// storage's data goes and how long the file is. The processes of a job can then write the
/// lazy storages' data at once, each its own ([`PlannedArchive::span`]), and one process
/// everything else once it knows their CRC-32s ([`PlannedArchive::write_frame`]). The file is
/// byte for byte what [`write_with`] writes.
pub(crate) struct PlannedArchive<'a> {
    archive: Archive<'a>,
    /// File offset and length of each storage's data, in key order.
    spans: Vec<(u64, u64)>,
    file_len: u64,
}

impl<'a> PlannedArchive<'a> {
    /// Plans `obj` as an archive named `archive`, with `lazy`'s placeholders at their real
    /// shapes; `file` names the destination in messages.
    pub(crate) fn new(
        obj: &'a PyObj,
        archive: &'a str,
        file: &'a str,
        lazy: &dyn LazyTensors,
    ) -> Result<Self> {
        let archive = Archive::new(obj, archive, file, lazy)?;
        let io = archive.io_err();
        let mut spans = Vec::with_capacity(archive.storages.len());
        let counted = archive.write(ZipWriter::new(Positioned::nowhere()), |z, _, data| {
            spans.push((z.position(), data.len()));
            z.skip_data(data.len()).map_err(io)?;
            Ok(crc32fast::Hasher::new())
        })?;
        let file_len = counted.position();
        Ok(PlannedArchive {
            archive,
            spans,
            file_len,
        })
    }

    /// The file's length.
    pub(crate) fn file_len(&self) -> u64 {
        self.file_len
    }

    /// How many storages the archive has.
    pub(crate) fn storages(&self) -> usize {
        self.spans.len()
    }

    /// The lazy placeholder storage `i` holds the bytes of, or `None` for an in-memory
    /// storage (which [`PlannedArchive::write_frame`] writes).
    pub(crate) fn lazy(&self, i: usize) -> Option<&'a HostTensor> {
        match self.archive.storages[i].1 {
            StorageData::Lazy(t, _) => Some(t),
            StorageData::Bytes(_) => None,
        }
    }

    /// File offset and length of storage `i`'s data.
    pub(crate) fn span(&self, i: usize) -> (u64, u64) {
        self.spans[i]
    }

    /// Writes everything but the lazy storages' data into `file` (at least
    /// [`PlannedArchive::file_len`] long): the records, every entry's header and data
    /// descriptor, the in-memory storages and the central directory. `crcs` holds the CRC-32
    /// of each lazy storage's data by storage index.
    pub(crate) fn write_frame(
        &self,
        file: &std::fs::File,
        crcs: &HashMap<usize, u32>,
    ) -> Result<()> {
        let io = self.archive.io_err();
        self.archive.write(
            ZipWriter::new(Positioned::into_file(file)),
            |z, i, data| match data {
                StorageData::Bytes(bytes) => {
                    z.data(bytes).map_err(io)?;
                    let mut one = crc32fast::Hasher::new();
                    one.update(bytes);
                    Ok(one)
                }
                StorageData::Lazy(_, len) => {
                    let crc = *crcs.get(&i).ok_or_else(|| {
                        Error::Internal(format!(
                            "no CRC-32 for storage {i} of the planned archive {}",
                            self.archive.file
                        ))
                    })?;
                    z.skip_data(*len).map_err(io)?;
                    Ok(crc32fast::Hasher::new_with_initial_len(crc, *len))
                }
            },
        )?;
        Ok(())
    }
}
