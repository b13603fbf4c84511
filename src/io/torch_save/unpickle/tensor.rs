//! Tensors of `data.pkl`: `_rebuild_tensor_v2` / `_v3` views of the archive's storages,
//! checked to lie inside them when the stream names them, and read (zero-copy when
//! contiguous, copied within the expansion budget when not) when the result is built.

use super::{Ext, Global, Mode, Node, Object, Path, Storages, Vm, V};
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;
use std::rc::Rc;

/// A tensor as the stream describes it: a strided view of a storage, checked to lie inside
/// it, and materialized only when the result is built (where its path in the object is
/// known).
#[derive(Debug)]
pub(super) struct View {
    key: Rc<str>,
    pub(super) dtype: DType,
    offset: usize,
    pub(super) size: Vec<usize>,
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

/// Contiguous (row-major) strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// The storages read so far and the tensors built from them, while the result is built.
pub(super) struct Tensors<'l> {
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
    pub(super) shapes: HashMap<usize, Vec<usize>>,
    /// Storage keys of the placeholders that are their whole storage
    /// ([`super::Unpickled::whole`]).
    pub(super) whole: HashMap<usize, String>,
    /// Where each placeholder lies in its storage ([`super::Unpickled::views`]).
    pub(super) views: HashMap<usize, PlaceholderView>,
    /// The allowance [`Mode::Full`] would need ([`super::Unpickled::expansion_needed`]).
    pub(super) expansion_needed: u64,
}

/// Where a placeholder's elements lie in the storage it views ([`Mode::Headers`]): what a
/// reader of the storage's bytes needs to produce the tensor's, in row-major order, as
/// [`Mode::Full`] materializes it (the placeholder gives the dtype, and the real shape is
/// recorded beside).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlaceholderView {
    /// The storage's key (its archive entry is `data/<key>`).
    pub(crate) key: String,
    /// The first element, in elements of the tensor's dtype from the storage's start.
    pub(crate) offset: usize,
    /// Strides, in elements of the tensor's dtype.
    pub(crate) stride: Vec<usize>,
    /// Whether the elements lie one after another in row-major order.
    pub(crate) contiguous: bool,
}

impl<'l> Tensors<'l> {
    pub(super) fn new(mode: Mode, store: &'l mut dyn Storages) -> Self {
        Tensors {
            mode,
            store,
            loaded: HashMap::new(),
            built: HashMap::new(),
            storage_bytes: 0,
            copied: 0,
            shapes: HashMap::new(),
            whole: HashMap::new(),
            views: HashMap::new(),
            expansion_needed: 0,
        }
    }

    /// Where the storages come from.
    pub(super) fn store(&mut self) -> &mut dyn Storages {
        &mut *self.store
    }

    /// Checks a newly declared storage `key` of `numel` elements of `unit` against its
    /// entry, and counts its bytes.
    pub(super) fn declare(&mut self, key: &str, unit: DType, numel: usize) -> Result<()> {
        self.store.check(key, unit, numel)?;
        self.storage_bytes = self
            .storage_bytes
            .saturating_add((numel as u64).saturating_mul(unit.size() as u64));
        Ok(())
    }
}

impl Vm<'_, '_> {
    /// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])`
    /// of a typed storage, or `_rebuild_tensor_v3(..., hooks, dtype[, metadata])` of an
    /// untyped one.
    /// Returns the view and its `requires_grad`.
    pub(super) fn rebuild_tensor(&mut self, a: &[V], v3: bool) -> Result<(Rc<View>, bool)> {
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
        let v3_dtype = a.get(6).filter(|_| v3);
        if let V::Ext(Ext::Storage(key, ..)) = &a[0] {
            if self.state.quantized.contains_key(key) {
                return Err(self.storage_err(key, format!("a quantized storage rebuilt by {name}")));
            }
        }
        let view = self.view_of_storage(name, &a[..4], v3_dtype)?;
        let requires_grad = match a[4] {
            V::Bool(b) => b,
            _ => return Err(self.err("_rebuild_tensor_v2: requires_grad must be a bool")),
        };
        let is_dict = |v: &V| {
            matches!(
                self.node(v),
                Some(Node::Dict(_) | Node::Ext(Object::OrderedDict(..)))
            )
        };
        if !is_dict(&a[5]) {
            return Err(self.err(format!(
                "_rebuild_tensor_v2: backward_hooks must be an OrderedDict, found {}",
                self.kind(&a[5])
            )));
        }
        if let Some(meta) = a.get(nargs) {
            let empty = matches!(meta, V::None)
                || matches!(
                    self.node(meta),
                    Some(Node::Dict(d) | Node::Ext(Object::OrderedDict(d, _))) if d.is_empty()
                );
            if !empty {
                return Err(self.err("_rebuild_tensor_v2: tensor metadata is not supported"));
            }
        }
        Ok((view, requires_grad))
    }

    /// `_rebuild_tensor(storage, storage_offset, size, stride)`, the first version.
    pub(super) fn rebuild_tensor_v1(&mut self, a: &[V]) -> Result<V> {
        if a.len() != 4 {
            return Err(self.err(format!(
                "torch._utils._rebuild_tensor takes 4 arguments, got {}",
                a.len()
            )));
        }
        Ok(V::Ext(Ext::Tensor(self.view_of_storage(
            "_rebuild_tensor",
            a,
            None,
        )?)))
    }

    /// The view `(storage, storage_offset, size, stride)` of `a` describes, checked to lie
    /// inside the storage (whose dtype `v3_dtype` gives when it is untyped).
    fn view_of_storage(&self, name: &str, a: &[V], v3_dtype: Option<&V>) -> Result<Rc<View>> {
        let (key, dtype, snumel) = self.storage_arg(name, &a[0], v3_dtype)?;
        let offset = self.int_arg(&a[1], "storage_offset")?;
        let size = self.int_tuple(&a[2], "size")?;
        let stride = self.int_tuple(&a[3], "stride")?;
        if size.len() != stride.len() {
            return Err(self.err(format!(
                "{name}: size {size:?} and stride {stride:?} differ in length"
            )));
        }
        let numel = self.check_view(&key, snumel, offset, &size, &stride)?;
        Ok(Rc::new(View {
            key,
            dtype,
            offset,
            size,
            stride,
            numel,
        }))
    }

    /// The view of a quantized tensor's storage (`_rebuild_qtensor`'s first four arguments),
    /// as its integer values.
    pub(super) fn view_of(&self, a: &[V], name: &str) -> Result<Rc<View>> {
        self.view_of_storage(name, a, None)
    }

    /// The storage argument of `name` (and the dtype argument of `_rebuild_tensor_v3`):
    /// the storage's key, the dtype of the tensor and the storage's length in its elements.
    fn storage_arg(
        &self,
        name: &str,
        storage: &V,
        v3_dtype: Option<&V>,
    ) -> Result<(Rc<str>, DType, usize)> {
        match (storage, v3_dtype) {
            (V::Ext(Ext::Storage(key, Some(dtype), n)), None) => Ok((key.clone(), *dtype, *n)),
            (V::Ext(Ext::Storage(key, None, bytes)), Some(V::Global(Global::Dtype(d)))) => {
                if bytes % d.size() != 0 {
                    return Err(self.storage_err(
                        key,
                        format!("{bytes} bytes are not a whole number of {d} elements"),
                    ));
                }
                Ok((key.clone(), *d, bytes / d.size()))
            }
            (V::Ext(Ext::Storage(..)), Some(other)) => Err(self.err(format!(
                "{name}: the dtype argument must be a supported torch dtype, found {}",
                self.kind(other)
            ))),
            (other, _) => Err(self.err(format!(
                "{name}: first argument must be a {} storage, found {}",
                if v3_dtype.is_some() {
                    "untyped"
                } else {
                    "typed"
                },
                self.kind(other)
            ))),
        }
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
        let Some(&(dtype, numel)) = self.state.storages.get(&view.key) else {
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
    pub(super) fn materialize(&self, view: &Rc<View>, path: &Path<'_>) -> Result<HostTensor> {
        let mut guard = self.state.tensors.borrow_mut();
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
                let contiguous = view.is_contiguous();
                if !contiguous {
                    // What `charge_copy` would count in `Mode::Full`.
                    let nbytes = (view.numel as u64).saturating_mul(view.dtype.size() as u64);
                    ts.copied = ts.copied.saturating_add(nbytes);
                    let over = ts.copied.saturating_sub(ts.storage_bytes);
                    ts.expansion_needed = ts.expansion_needed.max(over);
                }
                ts.views.insert(
                    p.storage_id(),
                    PlaceholderView {
                        key: view.key.to_string(),
                        offset: view.offset,
                        stride: view.stride.clone(),
                        contiguous,
                    },
                );
                p
            }
            _ if view.numel == 0 => HostTensor::zeros(view.dtype, &view.size),
            mode => {
                let storage = self.load_storage(ts, view)?;
                if view.is_contiguous() {
                    storage
                        .narrow_flat(view.offset, view.numel)?
                        .reshape(&view.size)?
                } else {
                    self.charge_copy(ts, mode, view, path)?;
                    strided_copy(&storage, view)?
                }
            }
        };
        ts.built.insert(Rc::as_ptr(view), t.clone());
        Ok(t)
    }

    /// The storage `view` looks into, read as its dtype (once per key and dtype).
    fn load_storage(&self, ts: &mut Tensors<'_>, view: &View) -> Result<HostTensor> {
        let slot = (view.key.clone(), view.dtype);
        if let Some(s) = ts.loaded.get(&slot) {
            return Ok(s.clone());
        }
        let Some(&(dtype, numel)) = self.state.storages.get(&view.key) else {
            return Err(self.storage_err(&view.key, "viewed but never declared"));
        };
        let bytes = numel * dtype.unwrap_or(DType::U8).size();
        let s = ts
            .store
            .read(&view.key, view.dtype, bytes / view.dtype.size())?;
        ts.loaded.insert(slot, s.clone());
        Ok(s)
    }

    /// Counts a copy of the non-contiguous `view` against the expansion budget.
    fn charge_copy(
        &self,
        ts: &mut Tensors<'_>,
        mode: Mode,
        view: &View,
        path: &Path<'_>,
    ) -> Result<()> {
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
                file: self.file().to_string(),
                tensor: path.render(),
                size: view.size.clone().into(),
                stride: view.stride.clone().into(),
                copied,
                storage_bytes: ts.storage_bytes,
                max_expansion_bytes: max,
            });
        }
        ts.copied = copied;
        Ok(())
    }
}

/// A contiguous copy of the non-contiguous `view` of `storage` (already checked to lie
/// inside it).
fn strided_copy(storage: &HostTensor, view: &View) -> Result<HostTensor> {
    let esize = view.dtype.size();
    let src = storage.as_bytes();
    HostTensor::filled_by(view.dtype, &view.size, |out: &mut [u8]| {
        let mut to = 0;
        for (first, n) in strided_runs(view.offset, &view.size, &view.stride) {
            let run = &src[first * esize..(first + n) * esize];
            out[to..to + run.len()].copy_from_slice(run);
            to += run.len();
        }
        Ok::<(), Error>(())
    })
}

/// The elements of the strided view `(offset, size, stride)` of a storage, in row-major
/// order, as runs of consecutive storage elements `(first, count)`: the innermost dimension
/// is one run when its stride is 1, else one run per element. A view with a zero in its size
/// has none. The caller has checked that the view lies inside its storage.
pub(crate) fn strided_runs<'a>(
    offset: usize,
    size: &'a [usize],
    stride: &'a [usize],
) -> impl Iterator<Item = (usize, usize)> + 'a {
    let n = size.len();
    let (outer, run) = match size.last().zip(stride.last()) {
        Some((&d, &1)) => (n - 1, d),
        _ => (n, 1),
    };
    let mut idx = vec![0usize; outer];
    let mut at = offset;
    let mut done = size.contains(&0);
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        let this = (at, run);
        // Odometer increment over the outer dimensions; `at` stays within the view.
        done = true;
        for d in (0..outer).rev() {
            idx[d] += 1;
            if idx[d] < size[d] {
                at += stride[d];
                done = false;
                break;
            }
            at -= (size[d] - 1) * stride[d];
            idx[d] = 0;
        }
        Some(this)
    })
}

#[cfg(test)]
mod tests {
    use super::strided_runs;

    #[test]
    fn strided_runs_walk_a_view_in_row_major_order() {
        let runs = |o, size: &[usize], stride: &[usize]| -> Vec<(usize, usize)> {
            strided_runs(o, size, stride).collect()
        };
        // A [2, 3] row-major view at offset 4: one run per row.
        assert_eq!(runs(4, &[2, 3], &[3, 1]), [(4, 3), (7, 3)]);
        // Its transpose: one element at a time, column by column.
        assert_eq!(
            runs(0, &[3, 2], &[1, 3]),
            [(0, 1), (3, 1), (1, 1), (4, 1), (2, 1), (5, 1)]
        );
        // Stride 0 (expanded), 0-d, and empty views.
        assert_eq!(runs(2, &[3], &[0]), [(2, 1), (2, 1), (2, 1)]);
        assert_eq!(runs(5, &[], &[]), [(5, 1)]);
        assert_eq!(runs(0, &[2, 0], &[1, 1]), []);
        assert_eq!(runs(1, &[2, 1, 2], &[4, 9, 1]), [(1, 2), (5, 2)]);
    }
}
