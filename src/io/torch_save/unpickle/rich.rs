//! The tensors `torch.load(weights_only=True)` rebuilds besides plain dense ones, and the
//! builtin values its allow-list admits: Parameters (`_rebuild_parameter`,
//! `_rebuild_parameter_with_state`), tensors with `requires_grad` or Python attributes
//! (`_rebuild_from_type_v2(func, torch.Tensor, args, state)`, how FSDP1's full state dict
//! pickles its `_has_been_cloned` tensors), sparse (`_rebuild_sparse_tensor`), quantized
//! (`_rebuild_qtensor`) and meta (`_rebuild_meta_tensor_no_storage`) tensors; `complex`,
//! `set`, `bytearray`, `collections.Counter` and `torch.device`.
//!
//! Each is checked as PyTorch checks it when it is built (shapes and arguments here, sparse
//! index bounds when the values are read) and kept as data: nothing runs.

use super::tensor::View;
use super::{Ext, Global, Object, Path, Vm, V};
use crate::error::Result;
use crate::io::pickle::{Dict, Node};
use crate::io::torch_save::pyobj::{
    PyObj, QDType, QScheme, QuantizedTensor, RichTensor, SparseLayout, TensorValue,
};
use crate::tensor::{DType, HostTensor};
use std::rc::Rc;

/// A [`RichTensor`] as the stream describes it, before its tensors are read.
#[derive(Debug)]
pub(super) struct RichView {
    pub value: ValueView,
    pub requires_grad: bool,
    pub parameter: bool,
    pub attrs: Vec<(String, V)>,
}

/// A [`TensorValue`] before its tensors are read.
#[derive(Debug, Clone)]
pub(super) enum ValueView {
    Dense(Rc<View>),
    SparseCoo {
        indices: Rc<View>,
        values: Rc<View>,
        size: Vec<usize>,
        coalesced: Option<bool>,
    },
    Compressed {
        layout: SparseLayout,
        compressed: Rc<View>,
        plain: Rc<View>,
        values: Rc<View>,
        size: Vec<usize>,
    },
    Quantized {
        dtype: QDType,
        view: Rc<View>,
        scheme: SchemeView,
    },
    Meta {
        dtype: DType,
        size: Vec<usize>,
        stride: Vec<usize>,
    },
}

/// A [`QScheme`] before its tensors are read.
#[derive(Debug, Clone)]
pub(super) enum SchemeView {
    PerTensor {
        scale: f64,
        zero_point: i64,
    },
    PerChannel {
        float_qparams: bool,
        scales: Rc<View>,
        zero_points: Rc<View>,
        axis: i64,
    },
}

/// The quantization schemes of the allow-list, by their `torch` attribute name.
pub(super) const QSCHEMES: [&str; 5] = [
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
];

impl Vm<'_, '_> {
    /// A plain tensor argument (not a Parameter, not sparse).
    fn dense_arg(&self, v: &V, what: &str) -> Result<Rc<View>> {
        match v {
            V::Ext(Ext::Tensor(view)) => Ok(view.clone()),
            other => Err(self.err(format!(
                "{what} must be a dense tensor, found {}",
                self.kind(other)
            ))),
        }
    }

    fn bool_arg(&self, v: &V, what: &str) -> Result<bool> {
        match v {
            V::Bool(b) => Ok(*b),
            other => Err(self.err(format!("{what} must be a bool, found {}", self.kind(other)))),
        }
    }

    fn float_arg(&self, v: &V, what: &str) -> Result<f64> {
        match v {
            V::Float(x) => Ok(*x),
            V::Int(i) => Ok(*i as f64),
            other => Err(self.err(format!(
                "{what} must be a float, found {}",
                self.kind(other)
            ))),
        }
    }

    fn signed_arg(&self, v: &V, what: &str) -> Result<i64> {
        match v {
            V::Int(i) => Ok(*i),
            other => Err(self.err(format!("{what} must be an int, found {}", self.kind(other)))),
        }
    }

    /// An attribute dict (`tensor.__dict__`): string keys, in order. A `(dict, slots)` pair
    /// is a subclass's state, which plain tensors never have.
    fn attr_state(&self, state: &V, what: &str) -> Result<Vec<(String, V)>> {
        let items = match self.node(state) {
            Some(Node::Dict(d)) => d.items(),
            Some(Node::Ext(Object::OrderedDict(d, _))) => d.items(),
            _ if matches!(state, V::None) => return Ok(Vec::new()),
            _ => {
                return Err(self.err(format!(
                    "{what}: the state must be a dict of attributes, found {}",
                    self.kind(state)
                )))
            }
        };
        items
            .iter()
            .map(|(k, v)| match k {
                V::Str(k) => Ok((k.to_string(), v.clone())),
                other => Err(self.err(format!(
                    "{what}: attribute names must be strings, found {}",
                    self.kind(other)
                ))),
            })
            .collect()
    }

    /// The tensor value `v` stands for, with its flags, as a [`RichView`] to extend.
    fn rich_of(&self, v: &V, what: &str) -> Result<RichView> {
        match v {
            V::Ext(Ext::Tensor(view)) => Ok(RichView {
                value: ValueView::Dense(view.clone()),
                requires_grad: false,
                parameter: false,
                attrs: Vec::new(),
            }),
            V::Ext(Ext::Rich(r)) => Ok(RichView {
                value: r.value.clone(),
                requires_grad: r.requires_grad,
                parameter: r.parameter,
                attrs: r.attrs.clone(),
            }),
            other => Err(self.err(format!(
                "{what} must be a tensor, found {}",
                self.kind(other)
            ))),
        }
    }

    /// A value that is a plain tensor unless it carries more.
    pub(super) fn rich(view: RichView) -> V {
        match view {
            RichView {
                value: ValueView::Dense(view),
                requires_grad: false,
                parameter: false,
                attrs,
            } if attrs.is_empty() => V::Ext(Ext::Tensor(view)),
            r => V::Ext(Ext::Rich(Rc::new(r))),
        }
    }

    /// A dense tensor `view` with its `requires_grad` (`_rebuild_tensor_v2` / `_v3`).
    pub(super) fn dense(view: Rc<View>, requires_grad: bool) -> V {
        Self::rich(RichView {
            value: ValueView::Dense(view),
            requires_grad,
            parameter: false,
            attrs: Vec::new(),
        })
    }

    /// `_rebuild_parameter(data, requires_grad, backward_hooks)` and
    /// `_rebuild_parameter_with_state(data, requires_grad, backward_hooks, state)`.
    pub(super) fn rebuild_parameter(&mut self, a: &[V], with_state: bool) -> Result<V> {
        let name = if with_state {
            "_rebuild_parameter_with_state"
        } else {
            "_rebuild_parameter"
        };
        let n = if with_state { 4 } else { 3 };
        if a.len() != n {
            return Err(self.err(format!(
                "torch._utils.{name} takes {n} arguments, got {}",
                a.len()
            )));
        }
        let data = self.dense_arg(&a[0], &format!("{name}'s data"))?;
        let requires_grad = self.bool_arg(&a[1], &format!("{name}'s requires_grad"))?;
        let attrs = match a.get(3) {
            Some(state) => self.attr_state(state, name)?,
            None => Vec::new(),
        };
        Ok(Self::rich(RichView {
            value: ValueView::Dense(data),
            requires_grad,
            parameter: true,
            attrs,
        }))
    }

    /// `_rebuild_from_type_v2(func, torch.Tensor, args, state)`: `func(*args)` (already
    /// called: `built`) with the attributes of `state` set on it.
    pub(super) fn with_state(&mut self, built: &V, state: &V) -> Result<V> {
        let mut r = self.rich_of(built, "_rebuild_from_type_v2's result")?;
        for (k, v) in self.attr_state(state, "_rebuild_from_type_v2")? {
            match r.attrs.iter_mut().find(|(n, _)| *n == k) {
                Some(slot) => slot.1 = v,
                None => r.attrs.push((k, v)),
            }
        }
        Ok(Self::rich(r))
    }

    /// `_rebuild_sparse_tensor(layout, data)`: COO `(indices, values, size[, is_coalesced])`
    /// or compressed `(compressed_indices, plain_indices, values, size)`, with the shapes
    /// PyTorch's invariant checks require.
    pub(super) fn rebuild_sparse(&mut self, a: &[V]) -> Result<V> {
        let [layout, data] = a else {
            return Err(self.err("torch._utils._rebuild_sparse_tensor takes (layout, data)"));
        };
        let layout = match layout {
            V::Ext(Ext::Const(name)) => name.clone(),
            other => {
                return Err(self.err(format!(
                    "_rebuild_sparse_tensor: the layout must be a torch layout, found {}",
                    self.kind(other)
                )))
            }
        };
        let Some(data) = self.tuple_items(data).map(<[V]>::to_vec) else {
            return Err(self.err("_rebuild_sparse_tensor: data must be a tuple"));
        };
        let value = if &*layout == "torch.sparse_coo" {
            let (indices, values, size, coalesced) = match data.as_slice() {
                [i, v, s] => (i, v, s, None),
                [i, v, s, c] => (i, v, s, Some(self.bool_arg(c, "is_coalesced")?)),
                _ => return Err(self.err("a sparse COO tensor needs (indices, values, size)")),
            };
            let indices = self.dense_arg(indices, "sparse COO indices")?;
            let values = self.dense_arg(values, "sparse COO values")?;
            let size = self.int_tuple(size, "the sparse tensor's size")?;
            self.check_coo(&indices, &values, &size)?;
            ValueView::SparseCoo {
                indices,
                values,
                size,
                coalesced,
            }
        } else {
            let Some(kind) = SparseLayout::ALL
                .into_iter()
                .find(|l| l.torch_name() == &*layout)
            else {
                return Err(self.err(format!(
                    "_rebuild_sparse_tensor: {layout} is not a sparse layout"
                )));
            };
            let [ci, pi, v, s] = data.as_slice() else {
                return Err(self.err(format!(
                    "a {layout} tensor needs (compressed_indices, plain_indices, values, size)"
                )));
            };
            let compressed = self.dense_arg(ci, "compressed indices")?;
            let plain = self.dense_arg(pi, "plain indices")?;
            let values = self.dense_arg(v, "sparse values")?;
            let size = self.int_tuple(s, "the sparse tensor's size")?;
            self.check_compressed(kind, &compressed, &plain, &values, &size)?;
            ValueView::Compressed {
                layout: kind,
                compressed,
                plain,
                values,
                size,
            }
        };
        Ok(V::Ext(Ext::Rich(Rc::new(RichView {
            value,
            requires_grad: false,
            parameter: false,
            attrs: Vec::new(),
        }))))
    }

    /// COO shapes: `indices` int64 `[sparse_dims, nnz]`, `values` `[nnz, dense dims…]`, and
    /// the dense dims are the trailing dims of `size`.
    fn check_coo(&self, indices: &View, values: &View, size: &[usize]) -> Result<()> {
        let bad = |why: String| Err(self.err(format!("sparse COO tensor of size {size:?}: {why}")));
        if indices.dtype != DType::I64 {
            return bad(format!("indices are {}, not torch.int64", indices.dtype));
        }
        let [sparse_dims, nnz] = indices.size[..] else {
            return bad(format!("indices of shape {:?} are not 2-D", indices.size));
        };
        let dense = values.size.get(1..).unwrap_or_default();
        if values.size.first() != Some(&nnz) || sparse_dims + dense.len() != size.len() {
            return bad(format!(
                "indices {:?} and values {:?} do not fit",
                indices.size, values.size
            ));
        }
        if dense != &size[sparse_dims..] {
            return bad(format!(
                "values {:?} do not end in the dense dims {:?}",
                values.size,
                &size[sparse_dims..]
            ));
        }
        Ok(())
    }

    /// Compressed shapes (no batch dims): `compressed` `[n + 1]` over the compressed dim,
    /// `plain` `[nnz]`, `values` `[nnz]` (or `[nnz, block…]` for BSR / BSC), int32 or int64
    /// indices of one dtype.
    fn check_compressed(
        &self,
        layout: SparseLayout,
        compressed: &View,
        plain: &View,
        values: &View,
        size: &[usize],
    ) -> Result<()> {
        let name = layout.torch_name();
        let bad = |why: String| Err(self.err(format!("{name} tensor of size {size:?}: {why}")));
        let [rows, cols] = size[..] else {
            return bad(
                "only 2-D compressed sparse tensors are read (no batch or dense dims)".into(),
            );
        };
        if !matches!(compressed.dtype, DType::I32 | DType::I64) || plain.dtype != compressed.dtype {
            return bad(format!(
                "indices are {} and {}, not one of torch.int32 / torch.int64",
                compressed.dtype, plain.dtype
            ));
        }
        let blocked = matches!(layout, SparseLayout::Bsr | SparseLayout::Bsc);
        let block = match (blocked, &values.size[..], &plain.size[..]) {
            (false, [nnz], [p]) if nnz == p => [1, 1],
            (true, [nnz, bh, bw], [p]) if nnz == p && *bh > 0 && *bw > 0 => [*bh, *bw],
            _ => {
                return bad(format!(
                    "plain indices {:?} and values {:?} do not fit",
                    plain.size, values.size
                ))
            }
        };
        if rows % block[0] != 0 || cols % block[1] != 0 {
            return bad(format!("blocks {block:?} do not tile it"));
        }
        let compressed_dim = match layout {
            SparseLayout::Csr | SparseLayout::Bsr => rows / block[0],
            SparseLayout::Csc | SparseLayout::Bsc => cols / block[1],
        };
        if compressed.size != [compressed_dim + 1] {
            return bad(format!(
                "compressed indices of shape {:?}, expected [{}]",
                compressed.size,
                compressed_dim + 1
            ));
        }
        Ok(())
    }

    /// `_rebuild_qtensor(storage, offset, size, stride, quantizer_params, requires_grad,
    /// backward_hooks)` of a `QInt8Storage`, `QUInt8Storage` or `QInt32Storage`.
    pub(super) fn rebuild_qtensor(&mut self, a: &[V]) -> Result<V> {
        if a.len() != 7 {
            return Err(self.err(format!(
                "torch._utils._rebuild_qtensor takes 7 arguments, got {}",
                a.len()
            )));
        }
        let key = match &a[0] {
            V::Ext(Ext::Storage(key, ..)) => key.clone(),
            other => {
                return Err(self.err(format!(
                    "_rebuild_qtensor: first argument must be a quantized storage, found {}",
                    self.kind(other)
                )))
            }
        };
        let Some(&dtype) = self.state.quantized.get(&key) else {
            return Err(self.storage_err(&key, "a plain storage used as a quantized tensor's"));
        };
        // The storage's values as their integer dtype, viewed as `_rebuild_tensor_v2` views.
        let view = self.view_of(&a[..4], "_rebuild_qtensor")?;
        let Some(params) = self.tuple_items(&a[4]).map(<[V]>::to_vec) else {
            return Err(self.err("_rebuild_qtensor: quantizer_params must be a tuple"));
        };
        let scheme = match params.as_slice() {
            [V::Global(Global::QScheme("per_tensor_affine")), scale, zp] => SchemeView::PerTensor {
                scale: self.float_arg(scale, "q_scale")?,
                zero_point: self.signed_arg(zp, "q_zero_point")?,
            },
            [V::Global(Global::QScheme(
                s @ ("per_channel_affine" | "per_channel_affine_float_qparams"),
            )), scales, zps, axis] => {
                let scales = self.dense_arg(scales, "q_per_channel_scales")?;
                let zero_points = self.dense_arg(zps, "q_per_channel_zero_points")?;
                let axis = self.signed_arg(axis, "q_per_channel_axis")?;
                let channels = usize::try_from(axis).ok().and_then(|x| view.size.get(x));
                if channels.is_none_or(|&c| scales.size != [c] || zero_points.size != [c]) {
                    return Err(self.err(format!(
                        "per-channel quantizer of axis {axis}: scales {:?} and zero points {:?} do not match size {:?}",
                        scales.size, zero_points.size, view.size
                    )));
                }
                // PyTorch pickles both schemes as `per_channel_affine`; the zero points'
                // dtype tells them apart when it rebuilds the tensor.
                SchemeView::PerChannel {
                    float_qparams: *s == "per_channel_affine_float_qparams"
                        || zero_points.dtype.is_floating_point(),
                    scales,
                    zero_points,
                    axis,
                }
            }
            [V::Global(Global::QScheme(s)), ..] => {
                // PyTorch itself raises "Can't deserialize quantized tensor with qscheme".
                return Err(self.err(format!(
                    "a quantized tensor with qscheme torch.{s}, which torch.load cannot rebuild either"
                )));
            }
            _ => return Err(self.err("_rebuild_qtensor: quantizer_params of an unknown form")),
        };
        let requires_grad = self.bool_arg(&a[5], "_rebuild_qtensor's requires_grad")?;
        Ok(V::Ext(Ext::Rich(Rc::new(RichView {
            value: ValueView::Quantized {
                dtype,
                view,
                scheme,
            },
            requires_grad,
            parameter: false,
            attrs: Vec::new(),
        }))))
    }

    /// `_rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad)`.
    pub(super) fn rebuild_meta(&mut self, a: &[V]) -> Result<V> {
        let [dtype, size, stride, rg] = a else {
            return Err(self.err(
                "torch._utils._rebuild_meta_tensor_no_storage takes (dtype, size, stride, requires_grad)",
            ));
        };
        let V::Global(Global::Dtype(dtype)) = dtype else {
            return Err(self.err(format!(
                "_rebuild_meta_tensor_no_storage: the dtype must be one the crate holds, found {}",
                self.kind(dtype)
            )));
        };
        let size = self.int_tuple(size, "the meta tensor's size")?;
        let stride = self.int_tuple(stride, "the meta tensor's stride")?;
        if size.len() != stride.len() {
            return Err(self.err(format!(
                "meta tensor: size {size:?} and stride {stride:?} differ in length"
            )));
        }
        let requires_grad = self.bool_arg(rg, "requires_grad")?;
        Ok(V::Ext(Ext::Rich(Rc::new(RichView {
            value: ValueView::Meta {
                dtype: *dtype,
                size,
                stride,
            },
            requires_grad,
            parameter: false,
            attrs: Vec::new(),
        }))))
    }

    /// `complex(real, imag)`.
    pub(super) fn complex(&self, a: &[V]) -> Result<V> {
        match a {
            [re] => Ok(V::Ext(Ext::Complex(self.float_arg(re, "complex")?, 0.0))),
            [re, im] => Ok(V::Ext(Ext::Complex(
                self.float_arg(re, "complex")?,
                self.float_arg(im, "complex")?,
            ))),
            _ => Err(self.err("complex() takes (real, imag)")),
        }
    }

    /// `set(list)`, `bytearray(bytes)` and `collections.Counter(dict)`, as protocol 2
    /// pickles them.
    pub(super) fn builtin(&mut self, g: Global, a: &[V]) -> Result<V> {
        match (g, a) {
            (Global::Set, []) => Ok(self.alloc(Node::Ext(Object::Set(Vec::new())))),
            (Global::Set, [items]) => match self.node(items) {
                Some(Node::List(x) | Node::Tuple(x)) => {
                    let x = x.clone();
                    Ok(self.alloc(Node::Ext(Object::Set(x))))
                }
                _ => Err(self.err(format!("set() of a {}", self.kind(items)))),
            },
            (Global::ByteArray, []) => Ok(V::Ext(Ext::ByteArray(Rc::from(&[][..])))),
            (Global::ByteArray, [V::Bytes(b)]) => Ok(V::Ext(Ext::ByteArray(b.clone()))),
            (Global::Counter, []) => Ok(self.alloc(Node::Ext(Object::Counter(Dict::default())))),
            (Global::Counter, [d]) => match self.node(d) {
                Some(Node::Dict(d)) => {
                    let mut counter = Dict::default();
                    for (k, v) in d.items() {
                        counter.insert(k.clone(), v.clone());
                    }
                    Ok(self.alloc(Node::Ext(Object::Counter(counter))))
                }
                _ => Err(self.err(format!("collections.Counter() of a {}", self.kind(d)))),
            },
            (g, _) => Err(self.err(format!("{g:?} with arguments of an unknown form"))),
        }
    }

    /// `torch.device(type[, index])` or `torch.device("type:index")`.
    pub(super) fn device(&self, a: &[V]) -> Result<V> {
        let (kind, index) = match a {
            [V::Str(s)] => match s.split_once(':') {
                Some((k, i)) => match i.parse::<i64>() {
                    Ok(i) => (Rc::from(k), Some(i)),
                    Err(_) => return Err(self.err(format!("torch.device({s:?}): a bad index"))),
                },
                None => (s.clone(), None),
            },
            [V::Str(s), V::Int(i)] => (s.clone(), Some(*i)),
            [V::Str(s), V::None] => (s.clone(), None),
            _ => return Err(self.err("torch.device takes (type[, index])")),
        };
        Ok(V::Ext(Ext::Device(kind, index)))
    }

    /// The [`PyObj::RichTensor`] of `r`, at `path` in the result.
    pub(super) fn rich_to_pyobj(
        &self,
        r: &RichView,
        path: &Path<'_>,
        depth: usize,
        budget: &mut usize,
    ) -> Result<PyObj> {
        let t = |v: &Rc<View>| self.materialize(v, path);
        let value = match &r.value {
            ValueView::Dense(v) => TensorValue::Dense(t(v)?),
            ValueView::SparseCoo {
                indices,
                values,
                size,
                coalesced,
            } => {
                let indices = t(indices)?;
                self.check_coo_indices(&indices, size, path)?;
                TensorValue::SparseCoo {
                    indices,
                    values: t(values)?,
                    size: size.clone(),
                    coalesced: *coalesced,
                }
            }
            ValueView::Compressed {
                layout,
                compressed,
                plain,
                values,
                size,
            } => {
                let (compressed, plain) = (t(compressed)?, t(plain)?);
                self.check_compressed_indices(*layout, &compressed, &plain, size, path)?;
                TensorValue::SparseCompressed {
                    layout: *layout,
                    compressed_indices: compressed,
                    plain_indices: plain,
                    values: t(values)?,
                    size: size.clone(),
                }
            }
            ValueView::Quantized {
                dtype,
                view,
                scheme,
            } => TensorValue::Quantized(QuantizedTensor {
                dtype: *dtype,
                int_repr: t(view)?,
                scheme: match scheme {
                    SchemeView::PerTensor { scale, zero_point } => QScheme::PerTensorAffine {
                        scale: *scale,
                        zero_point: *zero_point,
                    },
                    SchemeView::PerChannel {
                        float_qparams,
                        scales,
                        zero_points,
                        axis,
                    } => QScheme::PerChannel {
                        float_qparams: *float_qparams,
                        scales: t(scales)?,
                        zero_points: t(zero_points)?,
                        axis: *axis,
                    },
                },
            }),
            ValueView::Meta {
                dtype,
                size,
                stride,
            } => TensorValue::Meta {
                dtype: *dtype,
                size: size.clone(),
                stride: stride.clone(),
            },
        };
        let attrs = r
            .attrs
            .iter()
            .map(|(k, v)| {
                let at = Path::Attr(path, k);
                Ok((k.clone(), self.to_pyobj(v, &at, depth + 1, budget)?))
            })
            .collect::<Result<_>>()?;
        Ok(PyObj::RichTensor(Box::new(RichTensor {
            value,
            requires_grad: r.requires_grad,
            parameter: r.parameter,
            attrs,
        })))
    }

    /// Every COO index lies inside the size (PyTorch's `check_invariants` on load); skipped
    /// for placeholders, whose data is not read.
    fn check_coo_indices(
        &self,
        indices: &HostTensor,
        size: &[usize],
        path: &Path<'_>,
    ) -> Result<()> {
        let Ok(ix) = indices.as_slice::<i64>() else {
            return Ok(());
        };
        let [sparse_dims, nnz] = indices.shape()[..] else {
            return Ok(());
        };
        for d in 0..sparse_dims {
            for &i in &ix[d * nnz..(d + 1) * nnz] {
                if usize::try_from(i).map_or(true, |i| i >= size[d]) {
                    return Err(self.err(format!(
                        "`{}`: sparse COO index {i} lies outside dim {d} of size {}",
                        path.render(),
                        size[d]
                    )));
                }
            }
        }
        Ok(())
    }

    /// Compressed indices start at 0, never decrease and end at nnz, and plain indices lie
    /// inside the plain dim (PyTorch's invariant checks on load).
    fn check_compressed_indices(
        &self,
        layout: SparseLayout,
        compressed: &HostTensor,
        plain: &HostTensor,
        size: &[usize],
        path: &Path<'_>,
    ) -> Result<()> {
        let ints = |t: &HostTensor| -> Option<Vec<i64>> {
            match t.dtype() {
                DType::I64 => t.as_slice::<i64>().ok().map(<[i64]>::to_vec),
                DType::I32 => t
                    .as_slice::<i32>()
                    .ok()
                    .map(|x| x.iter().map(|&v| i64::from(v)).collect()),
                _ => None,
            }
        };
        let (Some(c), Some(p)) = (ints(compressed), ints(plain)) else {
            return Ok(()); // placeholders
        };
        if c.len() != compressed.numel() || p.len() != plain.numel() || c.is_empty() {
            return Ok(());
        }
        let plain_dim = match layout {
            SparseLayout::Csr => size[1],
            SparseLayout::Csc => size[0],
            SparseLayout::Bsr | SparseLayout::Bsc => usize::MAX,
        };
        let bad = |why: String| {
            Err(self.err(format!(
                "`{}`: {} tensor: {why}",
                path.render(),
                layout.torch_name()
            )))
        };
        if c[0] != 0 || c.windows(2).any(|w| w[0] > w[1]) || c[c.len() - 1] != p.len() as i64 {
            return bad(format!(
                "compressed indices must rise from 0 to the {} stored values",
                p.len()
            ));
        }
        if let Some(&i) = p
            .iter()
            .find(|&&i| usize::try_from(i).map_or(true, |i| i >= plain_dim))
        {
            return bad(format!("plain index {i} lies outside its dim"));
        }
        Ok(())
    }
}
