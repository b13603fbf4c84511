//! The `tch` (libtorch) tensor backend, behind the `tch` feature: [`TchTensor`] implements
//! [`Tensor`], so every optimizer-state algorithm and the `Fsdp` façade run on libtorch CPU
//! tensors, with conversions to and from [`HostTensor`]. Integration with tch programs (whole
//! state dicts, `VarStore` descriptions, optimizer steps) is one layer up, in `crate::libtorch`.
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
use ::tch::{Device, Kind, TchError};
use std::fmt;

pub(crate) const BACKEND: &str = "tch";

pub(crate) fn backend_err(op: String, e: TchError) -> Error {
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
        DType::C64 => Kind::ComplexFloat,
        DType::C128 => Kind::ComplexDouble,
        DType::U16 | DType::U32 | DType::U64 => {
            return Err(Error::Unsupported(format!(
                "tch tensors of {dtype}: tch 0.26 has no kind for it"
            )))
        }
    })
}

/// The dtype of a libtorch kind; [`Error::Unsupported`] for kinds outside [`DType::ALL`]
/// (complex32, quantized, the `fnuz` float8 variants).
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
        Kind::ComplexFloat => DType::C64,
        Kind::ComplexDouble => DType::C128,
        other => {
            return Err(Error::Unsupported(format!(
                "tch tensors of kind {other:?}: fsdp handles float32, float64, float16, \
                 bfloat16, float8_e4m3fn, float8_e5m2, complex64, complex128, int64, int32, \
                 int16, int8, uint8 and bool"
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
        super::check_narrow(&self.shape, start, len, "tch tensor")?;
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
            return Err(Error::Internal("cat_flat of no tensors".into()));
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
