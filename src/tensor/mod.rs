//! Tensors (layer 1): dtypes, the always-available [`HostTensor`], and the [`Tensor`] backend trait the
//! algorithms are written against; with the `tch` feature, `TchTensor` implements it over
//! libtorch tensors (module `tch`).

pub(crate) mod cast;
mod dtype;
mod host;
mod storage;
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub mod tch;

#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use self::tch::TchTensor;
pub use dtype::DType;
pub(crate) use dtype::OTHER_TORCH_DTYPES;
pub use host::HostTensor;
pub use storage::{
    buffer_cache_limit, cached_buffer_bytes, release_cached_buffers, set_buffer_cache_limit,
};

use crate::error::{Error, Result};
use std::fmt::Debug;

/// The element count of `shape`, or `None` when it overflows.
pub(crate) fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Checks that elements `start..start + len` lie in a tensor of `shape` (`what` names the
/// tensor's kind in the error), as every backend's [`Tensor::narrow_flat`] must.
pub(crate) fn check_narrow(shape: &[usize], start: usize, len: usize, what: &str) -> Result<()> {
    let numel: usize = shape.iter().product();
    if start.checked_add(len).is_none_or(|end| end > numel) {
        return Err(Error::OutOfBounds {
            context: format!("narrow_flat of a {shape:?} {what}"),
            start,
            end: start.saturating_add(len),
            numel,
        });
    }
    Ok(())
}

/// A Rust element type with a PyTorch dtype and a plain-bytes representation.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching dtype.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// The operations optimizer-state algorithms need from a tensor backend.
///
/// Every operation is on contiguous data in flattened (row-major) order. Implementations may
/// share storage between a tensor and its views, as PyTorch does.
pub trait Tensor: Clone + Debug + Send + Sync + 'static {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Shape; empty for 0-dim.
    fn shape(&self) -> Vec<usize>;
    /// Number of elements.
    fn numel(&self) -> usize {
        self.shape().iter().product()
    }
    /// Number of dimensions.
    fn dim(&self) -> usize {
        self.shape().len()
    }
    /// A tensor of zeros.
    fn zeros(dtype: DType, shape: &[usize]) -> Result<Self>;
    /// Converts from a host tensor.
    fn from_host(t: HostTensor) -> Result<Self>;
    /// Converts to a host tensor (cheap for [`HostTensor`]).
    fn to_host(&self) -> Result<HostTensor>;
    /// Elements `[start, start+len)` of the flattened tensor, as a 1-D tensor.
    fn narrow_flat(&self, start: usize, len: usize) -> Result<Self>;
    /// The same elements with another shape.
    fn reshape(&self, shape: &[usize]) -> Result<Self>;
    /// 1-D concatenation of the flattened parts (all of one dtype, at least one part).
    fn cat_flat(parts: &[Self]) -> Result<Self>;
    /// Same dtype, shape and bits.
    fn bit_eq(&self, other: &Self) -> bool;
}

impl Tensor for HostTensor {
    fn dtype(&self) -> DType {
        HostTensor::dtype(self)
    }
    fn shape(&self) -> Vec<usize> {
        HostTensor::shape(self).to_vec()
    }
    fn numel(&self) -> usize {
        HostTensor::numel(self)
    }
    fn dim(&self) -> usize {
        HostTensor::dim(self)
    }
    fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        Ok(HostTensor::zeros(dtype, shape))
    }
    fn from_host(t: HostTensor) -> Result<Self> {
        Ok(t)
    }
    fn to_host(&self) -> Result<HostTensor> {
        Ok(self.clone())
    }
    fn narrow_flat(&self, start: usize, len: usize) -> Result<Self> {
        HostTensor::narrow_flat(self, start, len)
    }
    fn reshape(&self, shape: &[usize]) -> Result<Self> {
        HostTensor::reshape(self, shape)
    }
    fn cat_flat(parts: &[Self]) -> Result<Self> {
        HostTensor::cat_flat(parts)
    }
    fn bit_eq(&self, other: &Self) -> bool {
        HostTensor::bit_eq(self, other)
    }
}
