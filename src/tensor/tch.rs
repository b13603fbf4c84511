//! The `tch` (libtorch) backend, behind the `tch` feature: [`TchTensor`] implements
//! [`Tensor`], so every optimizer-state algorithm and the [`Fsdp`](crate::Fsdp) façade run on
//! libtorch CPU tensors; conversions to and from [`HostTensor`]; the parameters of a
//! [`VarStore`](::tch::nn::VarStore) as a [`ModelDesc`]; and [`step_tch`], which steps this
//! crate's optimizers on `tch` parameters.
//!
//! # Why a wrapper and not `impl Tensor for tch::Tensor`
//! [`Tensor`] requires `Clone + Sync` (state dicts are shared by the thread ranks of a
//! process group and cloned by the transforms). `tch::Tensor` is neither `Clone` nor `Sync`, and
//! the orphan rule forbids adding either here, so the backend is the newtype [`TchTensor`]:
//! * `Clone` is `shallow_clone`: the clone shares storage, like a Python assignment or a view.
//!   The algorithms never write through a [`Tensor`], so sharing is safe for them; a caller
//!   that writes in place into a tensor it took out of a dict ([`TchTensor::to_tch`]) changes
//!   every dict that shares it, exactly as in PyTorch.
//! * `Sync` is asserted: through `&TchTensor` only read-only libtorch calls happen (sizes,
//!   views, `cat`, copies out), which libtorch allows from several threads at once. A
//!   `TchTensor` is detached from autograd when it is made, so these calls never touch
//!   autograd metadata shared with the caller's tensor.
//!
//! # Conversions: one copy each way
//! [`TchTensor::from_host_tensor`] copies the host bytes into a new libtorch tensor
//! (`Tensor::f_from_data_size`), and [`TchTensor::to_host`] copies libtorch's bytes into a new
//! host buffer (`f_copy_data_u8`, which makes non-contiguous tensors contiguous on the way).
//! Borrowing instead (`Tensor::from_blob` over the host buffer) was rejected: a
//! [`HostTensor`]'s storage is shared copy-on-write with other host tensors and freed when the
//! last of them goes, but libtorch neither knows the buffer's lifetime nor respects the
//! copy-on-write contract — an in-place op on the `tch` side would silently change other host
//! tensors, and a `shallow_clone` could outlive the buffer. One copy keeps both sides sound
//! without `unsafe`. Inside the algorithms views stay views on either backend: `narrow_flat`
//! and `reshape` of a contiguous `TchTensor` copy nothing.
//!
//! The communicating transforms move bytes through the process group as host tensors, so a
//! `TchTensor` dict costs one extra copy per gathered or scattered tensor compared with a
//! [`HostTensor`] dict; the results are bit-identical (tested in `tests/tch_backend.rs`).
//!
//! # Linking
//! Programs that use this module link libtorch dynamically; see the README section "tch
//! backend" for the build-script lines (rpath) or `LD_LIBRARY_PATH` they need.

use super::{DType, HostTensor, Tensor};
use crate::error::{Error, Result};
use crate::model::ModelDesc;
use crate::optim::Optimizer;
use crate::optim_state::OptimStateDict;
use ::tch::{Device, Kind, TchError};
use std::fmt;

const BACKEND: &str = "tch";

fn backend_err(op: String, e: TchError) -> Error {
    Error::TensorBackend {
        backend: BACKEND.into(),
        op,
        reason: e.to_string(),
    }
}

/// The libtorch kind of a dtype; [`Error::Unsupported`] for uint16, uint32 and uint64, which
/// tch 0.26 has no kind for.
pub fn dtype_to_kind(dtype: DType) -> Result<Kind> {
    Ok(match dtype {
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::F8E4M3FN => Kind::Float8e4m3fn,
        DType::F8E5M2 => Kind::Float8e5m2,
        DType::U16 | DType::U32 | DType::U64 => {
            return Err(Error::Unsupported(format!(
                "tch tensors of {dtype}: tch 0.26 has no kind for it"
            )))
        }
    })
}

/// The dtype of a libtorch kind; [`Error::Unsupported`] for kinds outside [`DType::ALL`]
/// (complex, quantized, the `fnuz` float8 variants).
pub fn kind_to_dtype(kind: Kind) -> Result<DType> {
    Ok(match kind {
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Int64 => DType::I64,
        Kind::Int => DType::I32,
        Kind::Uint8 => DType::U8,
        Kind::Bool => DType::Bool,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Float8e4m3fn => DType::F8E4M3FN,
        Kind::Float8e5m2 => DType::F8E5M2,
        other => {
            return Err(Error::Unsupported(format!(
                "tch tensors of kind {other:?}: fsdp handles float32, float64, float16, \
                 bfloat16, float8_e4m3fn, float8_e5m2, int64, int32, int16, int8, uint8 and bool"
            )))
        }
    })
}

fn dims_i64(shape: &[usize], op: &str) -> Result<Vec<i64>> {
    shape
        .iter()
        .map(|&d| {
            i64::try_from(d).map_err(|_| Error::TensorBackend {
                backend: BACKEND.into(),
                op: format!("{op} with shape {shape:?}"),
                reason: format!("dimension {d} does not fit libtorch's i64 sizes"),
            })
        })
        .collect()
}

/// A libtorch tensor as an `fsdp` [`Tensor`] (see the [module docs](self) for why a wrapper).
///
/// Holds a detached alias of the tensor it was made from (same storage, no autograd history),
/// with its dtype and shape cached. Any device works for the conversions; the operations of
/// [`Tensor`] create CPU tensors ([`Tensor::zeros`], [`Tensor::from_host`]) and are tested on
/// CPU.
pub struct TchTensor {
    inner: ::tch::Tensor,
    dtype: DType,
    shape: Vec<usize>,
}

// SAFETY: `tch::Tensor` is `Send`; it is not `Sync` only because tch cannot promise that
// every method taking `&self` is safe to call concurrently. `TchTensor` never hands out
// `&tch::Tensor`: through `&TchTensor` only `at_shallow_clone` (an atomic reference-count
// increment), size/kind queries, view creation (`reshape`, `narrow`), `cat` and copies out
// (`at_copy_data`) run, which read the tensor and its storage and are safe to run concurrently
// in libtorch. The tensor is detached when wrapped, so no autograd metadata is shared with
// tensors outside the wrapper. Writes to the shared storage through other aliases are the
// same hazard `Send` + `shallow_clone` already have in tch.
unsafe impl Sync for TchTensor {}

impl TchTensor {
    /// Wraps a libtorch tensor: a detached alias sharing its storage.
    ///
    /// Errors: an undefined or sparse tensor, or a kind outside [`DType::ALL`]
    /// ([`Error::Unsupported`]); a libtorch failure ([`Error::TensorBackend`]).
    pub fn new(t: ::tch::Tensor) -> Result<Self> {
        if !t.defined() {
            return Err(Error::Unsupported("an undefined tch tensor".into()));
        }
        if t.is_sparse() {
            return Err(Error::Unsupported(
                "sparse tch tensors (optimizer state is dense)".into(),
            ));
        }
        let kind = t
            .f_kind()
            .map_err(|e| backend_err("TchTensor::new (kind)".into(), e))?;
        let dtype = kind_to_dtype(kind)?;
        let inner = t
            .f_detach()
            .map_err(|e| backend_err("TchTensor::new (detach)".into(), e))?;
        let shape = inner.size().into_iter().map(|d| d as usize).collect();
        Ok(TchTensor {
            inner,
            dtype,
            shape,
        })
    }

    /// Wraps a tensor that came out of a libtorch op on this wrapper (already detached).
    fn wrap(inner: ::tch::Tensor, dtype: DType, shape: Vec<usize>) -> Self {
        TchTensor {
            inner,
            dtype,
            shape,
        }
    }

    /// A new CPU libtorch tensor holding a copy of `t`'s elements (one copy).
    pub fn from_host_tensor(t: &HostTensor) -> Result<Self> {
        let dims = dims_i64(t.shape(), "TchTensor::from_host_tensor")?;
        let inner = ::tch::Tensor::f_from_data_size(t.as_bytes(), &dims, dtype_to_kind(t.dtype())?)
            .map_err(|e| {
                backend_err(
                    format!(
                        "TchTensor::from_host_tensor ({}, {:?})",
                        t.dtype(),
                        t.shape()
                    ),
                    e,
                )
            })?;
        Ok(Self::wrap(inner, t.dtype(), t.shape().to_vec()))
    }

    /// A new [`HostTensor`] holding a copy of the elements in row-major order (one copy;
    /// non-contiguous and non-CPU tensors are made contiguous on the CPU first).
    pub fn to_host_tensor(&self) -> Result<HostTensor> {
        let numel = self.numel();
        HostTensor::filled_by(self.dtype, &self.shape, |dst| {
            if numel == 0 {
                return Ok(());
            }
            self.inner.f_copy_data_u8(dst, numel).map_err(|e| {
                backend_err(
                    format!("TchTensor::to_host ({}, {:?})", self.dtype, self.shape),
                    e,
                )
            })
        })
    }

    /// A `tch::Tensor` sharing this tensor's storage (`shallow_clone`): writing into it in
    /// place changes this tensor and every clone of it.
    pub fn to_tch(&self) -> ::tch::Tensor {
        self.inner.shallow_clone()
    }

    /// The wrapped `tch::Tensor` (detached from autograd).
    pub fn into_tch(self) -> ::tch::Tensor {
        self.inner
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> Device {
        self.inner.device()
    }

    fn flat(&self, op: &str) -> Result<::tch::Tensor> {
        let n = dims_i64(&[self.numel()], op)?;
        self.inner.f_reshape(n.as_slice()).map_err(|e| {
            backend_err(
                format!("{op}: flatten ({}, {:?})", self.dtype, self.shape),
                e,
            )
        })
    }
}

impl Clone for TchTensor {
    /// A shallow clone: shares storage (see the [module docs](self)).
    fn clone(&self) -> Self {
        TchTensor {
            inner: self.inner.shallow_clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
        }
    }
}

impl fmt::Debug for TchTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TchTensor(")?;
        match self.to_host_tensor() {
            Ok(h) => write!(f, "{h:?}")?,
            Err(_) => write!(f, "dtype={}, shape={:?}", self.dtype, self.shape)?,
        }
        write!(f, ", device={:?})", self.device())
    }
}

impl PartialEq for TchTensor {
    /// Same dtype, shape and bits, like [`HostTensor`]'s equality.
    fn eq(&self, other: &Self) -> bool {
        Tensor::bit_eq(self, other)
    }
}

impl TryFrom<::tch::Tensor> for TchTensor {
    type Error = Error;
    fn try_from(t: ::tch::Tensor) -> Result<Self> {
        TchTensor::new(t)
    }
}

impl Tensor for TchTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        let dims = dims_i64(shape, "TchTensor::zeros")?;
        let inner =
            ::tch::Tensor::f_zeros(dims.as_slice(), (dtype_to_kind(dtype)?, Device::Cpu))
                .map_err(|e| backend_err(format!("TchTensor::zeros ({dtype}, {shape:?})"), e))?;
        Ok(Self::wrap(inner, dtype, shape.to_vec()))
    }

    fn from_host(t: HostTensor) -> Result<Self> {
        TchTensor::from_host_tensor(&t)
    }

    fn to_host(&self) -> Result<HostTensor> {
        self.to_host_tensor()
    }

    fn narrow_flat(&self, start: usize, len: usize) -> Result<Self> {
        let numel = self.numel();
        if start.checked_add(len).is_none_or(|end| end > numel) {
            return Err(Error::OutOfBounds {
                context: format!("narrow_flat of a {:?} tch tensor", self.shape),
                start,
                end: start.saturating_add(len),
                numel,
            });
        }
        let flat = self.flat("narrow_flat")?;
        let inner = flat
            .f_narrow(0, start as i64, len as i64)
            .map_err(|e| backend_err(format!("narrow_flat({start}, {len})"), e))?;
        Ok(Self::wrap(inner, self.dtype, vec![len]))
    }

    fn reshape(&self, shape: &[usize]) -> Result<Self> {
        let numel = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if numel != Some(self.numel()) {
            return Err(Error::ShapeMismatch {
                context: "reshape of a tch tensor".into(),
                expected: shape.to_vec(),
                found: self.shape.clone(),
            });
        }
        let dims = dims_i64(shape, "reshape")?;
        let inner = self.inner.f_reshape(dims.as_slice()).map_err(|e| {
            backend_err(
                format!("reshape {:?} -> {shape:?} ({})", self.shape, self.dtype),
                e,
            )
        })?;
        Ok(Self::wrap(inner, self.dtype, shape.to_vec()))
    }

    fn cat_flat(parts: &[Self]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(Error::InvalidStateDict("cat_flat of no tensors".into()));
        };
        let dtype = first.dtype;
        let mut flats = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for p in parts {
            // torch.cat would promote mixed dtypes; the trait demands one dtype.
            if p.dtype != dtype {
                return Err(Error::DtypeMismatch {
                    context: "cat_flat of tch tensors".into(),
                    expected: dtype.to_string(),
                    found: p.dtype.to_string(),
                });
            }
            total += p.numel();
            flats.push(p.flat("cat_flat")?);
        }
        let inner = ::tch::Tensor::f_cat(&flats, 0)
            .map_err(|e| backend_err(format!("cat_flat of {} {dtype} tensors", parts.len()), e))?;
        Ok(Self::wrap(inner, dtype, vec![total]))
    }

    fn bit_eq(&self, other: &Self) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape {
            return false;
        }
        match (self.to_host_tensor(), other.to_host_tensor()) {
            (Ok(a), Ok(b)) => a.bit_eq(&b),
            _ => false,
        }
    }
}

/// A host state dict as `tch` tensors (one copy per tensor).
pub fn state_dict_to_tch(sd: &OptimStateDict<HostTensor>) -> Result<OptimStateDict<TchTensor>> {
    sd.try_map(TchTensor::from_host_tensor)
}

/// A `tch` state dict as host tensors (one copy per tensor), e.g. for an [`Optimizer`] or for
/// [`crate::io::torch_save`].
pub fn state_dict_to_host(sd: &OptimStateDict<TchTensor>) -> Result<OptimStateDict<HostTensor>> {
    sd.try_map(TchTensor::to_host_tensor)
}

/// One optimizer step on `tch` parameters: `params[id]` and `grads[id]` as
/// [`Optimizer::step`] takes them, as libtorch tensors (`None`: no gradient).
///
/// The optimizers compute on [`HostTensor`]s (their kernels reproduce torch's CPU numerics),
/// so this copies each parameter and gradient to the host, steps, and copies every parameter
/// that had a gradient back into its `tch` tensor in place (under `no_grad`, so leaf tensors
/// that require grad, such as [`VarStore`](::tch::nn::VarStore) variables, are updated and
/// keep their identity). The optimizer validates everything before changing anything; an
/// error leaves the parameters untouched.
pub fn step_tch(
    optim: &mut dyn Optimizer,
    params: &mut [::tch::Tensor],
    grads: &[Option<::tch::Tensor>],
) -> Result<()> {
    let host = |t: &::tch::Tensor| TchTensor::new(t.shallow_clone())?.to_host_tensor();
    let mut slots = params.iter().map(host).collect::<Result<Vec<_>>>()?;
    let host_grads = grads
        .iter()
        .map(|g| g.as_ref().map(host).transpose())
        .collect::<Result<Vec<_>>>()?;
    optim.step(&mut slots, &host_grads)?;
    // Convert every update first so that a failure cannot leave some parameters written.
    let updates = slots
        .iter()
        .zip(&host_grads)
        .map(|(s, g)| {
            g.as_ref()
                .map(|_| TchTensor::from_host_tensor(s))
                .transpose()
        })
        .collect::<Result<Vec<_>>>()?;
    for (id, (p, u)) in params.iter_mut().zip(updates).enumerate() {
        if let Some(u) = u {
            ::tch::no_grad(|| p.f_copy_(&u.inner))
                .map_err(|e| backend_err(format!("step_tch: writing parameter {id} back"), e))?;
        }
    }
    Ok(())
}

/// The parameters of a [`VarStore`](::tch::nn::VarStore), as [`var_store_params`] finds them.
#[derive(Debug)]
pub struct VarStoreParams {
    /// `(primary name, tensor)` per parameter, in order; the tensors are shallow clones of the
    /// store's variables (writing into them updates the store).
    pub params: Vec<(String, ::tch::Tensor)>,
    /// Tied aliases as `(alias, primary)`: further names of a tensor listed in `params`.
    pub tied: Vec<(String, String)>,
}

/// The parameters of a [`VarStore`](::tch::nn::VarStore) in creation order, as
/// `(name, tensor)` (shallow clones), and the tied aliases (`alias → primary`).
///
/// # Order and its limits
/// `VarStore::variables()` is a `HashMap`; the only ordered record tch 0.26 keeps is
/// `variables_.trainable_variables`, the variables created trainable, in creation order. This
/// function takes that order and finds each tensor's name in `named_variables` by identity
/// (same storage, offset, sizes and strides: `is_set_to`). Consequences:
/// * Parameters are in **creation order**. That is PyTorch's `named_parameters()` order only
///   when the Rust model creates its variables in the order the Python model registers them.
///   tch's own layers do not: `nn::linear` and `nn::conv*` create `bias` before `weight`,
///   where `torch.nn.Linear`/`Conv*d` register `weight` first. Since the order decides flat
///   parameter layout, optimizer ids and key order, use [`var_store_params_in_order`] /
///   [`model_desc_from_var_store_in_order`] with the Python model's order when checkpoints are
///   exchanged with PyTorch.
/// * Variables created non-trainable (`zeros_no_train`, `add(.., false)`: tch's buffers, e.g.
///   batch-norm running statistics) are not parameters and are left out, like PyTorch buffers.
///   Variables frozen after creation (`VarStore::freeze`, `set_requires_grad(false)`) stay
///   in, with `requires_grad = false`.
/// * A tensor registered under several names (one trainable entry each) is one parameter; its
///   lexicographically first name is the primary, the others become tied aliases — tch keeps
///   no record of which name came first.
pub fn var_store_params(vs: &::tch::nn::VarStore) -> Result<VarStoreParams> {
    let vars = vs.variables_.lock().map_err(|_| Error::TensorBackend {
        backend: BACKEND.into(),
        op: "var_store_params".into(),
        reason: "the VarStore's lock is poisoned (a thread panicked while holding it)".into(),
    })?;
    let same = |a: &::tch::Tensor, b: &::tch::Tensor| {
        a.f_is_set_to(b)
            .map_err(|e| backend_err("var_store_params: tensor identity".into(), e))
    };
    // Candidate names by data pointer, checked by identity (empty tensors may share a null
    // data pointer).
    let mut by_ptr: std::collections::HashMap<usize, Vec<&String>> = Default::default();
    for (name, t) in &vars.named_variables {
        by_ptr.entry(t.data_ptr() as usize).or_default().push(name);
    }
    let mut params: Vec<(String, ::tch::Tensor)> = Vec::new();
    let mut tied = Vec::new();
    for var in &vars.trainable_variables {
        let t = &var.tensor;
        let mut dup = false;
        for (_, p) in &params {
            if same(t, p)? {
                dup = true;
                break;
            }
        }
        if dup {
            continue;
        }
        let mut names = Vec::new();
        for n in by_ptr.get(&(t.data_ptr() as usize)).into_iter().flatten() {
            if same(t, &vars.named_variables[*n])? {
                names.push((*n).clone());
            }
        }
        names.sort();
        let Some(primary) = names.first().cloned() else {
            return Err(Error::InvalidModel(
                "a trainable variable of the VarStore has no name in `named_variables`".into(),
            ));
        };
        for alias in &names[1..] {
            tied.push((alias.clone(), primary.clone()));
        }
        params.push((primary, t.shallow_clone()));
    }
    Ok(VarStoreParams { params, tied })
}

/// A [`ModelDesc`] of a [`VarStore`](::tch::nn::VarStore)'s parameters: names, shapes,
/// dtypes and `requires_grad`, in the order [`var_store_params`] documents (creation order;
/// buffers left out).
///
/// ```no_run
/// use tch::nn;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let _l1 = nn::linear(vs.root() / "layers" / 0, 4, 8, Default::default());
/// let _l2 = nn::linear(vs.root() / "layers" / 1, 8, 2, Default::default());
/// let model = fsdp::tensor::tch::model_desc_from_var_store(&vs)?;
/// // tch's `nn::linear` creates its bias first.
/// assert_eq!(model.params[0].name, "layers.0.bias");
/// # Ok::<(), fsdp::Error>(())
/// ```
pub fn model_desc_from_var_store(vs: &::tch::nn::VarStore) -> Result<ModelDesc> {
    let VarStoreParams { params, tied } = var_store_params(vs)?;
    model_desc_of(&params, &tied)
}

/// [`var_store_params`] reordered to `order`: the parameters' names in PyTorch's
/// `named_parameters()` order (e.g. `[n for n, _ in model.named_parameters()]` of the Python
/// model, or the parameter keys of a PyTorch checkpoint).
///
/// `order` must name every parameter of the store exactly once, by its primary name or a tied
/// alias; anything else is an [`Error::InvalidModel`] listing the names that are missing,
/// unknown or repeated.
pub fn var_store_params_in_order<S: AsRef<str>>(
    vs: &::tch::nn::VarStore,
    order: &[S],
) -> Result<VarStoreParams> {
    let VarStoreParams { params, tied } = var_store_params(vs)?;
    let alias_of: std::collections::HashMap<&str, &str> =
        tied.iter().map(|(a, p)| (a.as_str(), p.as_str())).collect();
    let mut slots: Vec<Option<(String, ::tch::Tensor)>> = params.into_iter().map(Some).collect();
    let index: std::collections::HashMap<String, usize> = slots
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_ref().expect("all present").0.clone(), i))
        .collect();
    let (mut out, mut unknown, mut repeated) = (Vec::new(), Vec::new(), Vec::new());
    for name in order {
        let name = name.as_ref();
        let primary = alias_of.get(name).copied().unwrap_or(name);
        match index.get(primary) {
            None => unknown.push(name.to_string()),
            Some(&i) => match slots[i].take() {
                Some(p) => out.push(p),
                None => repeated.push(name.to_string()),
            },
        }
    }
    let missing: Vec<String> = slots.into_iter().flatten().map(|(n, _)| n).collect();
    if !(missing.is_empty() && unknown.is_empty() && repeated.is_empty()) {
        return Err(Error::InvalidModel(format!(
            "the parameter order does not match the VarStore: missing {missing:?}, \
             not in the store {unknown:?}, repeated {repeated:?}"
        )));
    }
    Ok(VarStoreParams { params: out, tied })
}

/// [`model_desc_from_var_store`] with the parameters in `order` (see
/// [`var_store_params_in_order`]): the way to match a PyTorch model's `named_parameters()`.
pub fn model_desc_from_var_store_in_order<S: AsRef<str>>(
    vs: &::tch::nn::VarStore,
    order: &[S],
) -> Result<ModelDesc> {
    let VarStoreParams { params, tied } = var_store_params_in_order(vs, order)?;
    model_desc_of(&params, &tied)
}

fn model_desc_of(
    params: &[(String, ::tch::Tensor)],
    tied: &[(String, String)],
) -> Result<ModelDesc> {
    let mut model = ModelDesc::new();
    for (name, t) in params {
        let kind = t
            .f_kind()
            .map_err(|e| backend_err(format!("model_desc_from_var_store: kind of `{name}`"), e))?;
        let dtype = kind_to_dtype(kind).map_err(|e| match e {
            Error::Unsupported(msg) => Error::Unsupported(format!("parameter `{name}`: {msg}")),
            other => other,
        })?;
        let shape: Vec<usize> = t.size().into_iter().map(|d| d as usize).collect();
        model = if t.requires_grad() {
            model.param(name, &shape, dtype)
        } else {
            model.frozen_param(name, &shape, dtype)
        };
    }
    for (alias, primary) in tied {
        model = model.tie(alias, primary);
    }
    model.validate()?;
    Ok(model)
}
