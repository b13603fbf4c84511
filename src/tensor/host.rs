//! [`HostTensor`]: a contiguous, reference-counted CPU tensor.
//!
//! Views (`narrow_flat`, `reshape`) share storage like PyTorch views do, so splitting a gathered
//! flat buffer into per-parameter tensors copies nothing. Mutation is copy-on-write.

use super::storage::Storage;
use super::{DType, Element};
use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::sync::Arc;

/// A contiguous CPU tensor with a PyTorch dtype, a shape (empty for 0-dim) and shared storage.
#[derive(Clone)]
pub struct HostTensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Arc<Storage>,
    /// Offset of the first element in storage, in bytes.
    offset: usize,
}

fn numel_of(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl HostTensor {
    /// A tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Self {
        let nbytes = numel_of(shape) * dtype.size();
        HostTensor {
            dtype,
            shape: shape.to_vec(),
            storage: Arc::new(Storage::zeroed(nbytes)),
            offset: 0,
        }
    }

    /// A tensor whose bytes `fill` writes, all of them: the buffer it gets may be a recycled
    /// one still holding an earlier tensor's bytes (see [`super::set_buffer_cache_limit`]), so
    /// creating it costs no pass of zeros.
    pub(crate) fn filled_by<E>(
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let nbytes = numel_of(shape) * dtype.size();
        Self::with_storage(dtype, shape, Storage::for_overwrite(nbytes), fill)
    }

    /// [`HostTensor::filled_by`] for a `fill` that reads the bytes from files (a checkpoint
    /// load): a fresh buffer is mapped in small pages ([`Storage::for_reads`] says why).
    pub(crate) fn filled_by_reads<E>(
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let nbytes = numel_of(shape) * dtype.size();
        Self::with_storage(dtype, shape, Storage::for_reads(nbytes), fill)
    }

    fn with_storage<E>(
        dtype: DType,
        shape: &[usize],
        mut storage: Storage,
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        fill(storage.bytes_mut())?;
        Ok(HostTensor {
            dtype,
            shape: shape.to_vec(),
            storage: Arc::new(storage),
            offset: 0,
        })
    }

    /// A tensor from raw little-endian bytes; `bytes.len()` must match shape and dtype.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        Self::from_bytes_shaped(dtype, shape.to_vec(), bytes)
    }

    /// [`HostTensor::from_bytes`] taking its shape by value (kept, not copied: a reader of a
    /// million small tensors allocates each shape once).
    pub(crate) fn from_bytes_shaped(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<Self> {
        let expected = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if expected != Some(bytes.len()) {
            return Err(Error::ShapeMismatch {
                context: format!("HostTensor::from_bytes ({dtype}, {} bytes)", bytes.len()),
                expected: shape,
                found: vec![bytes.len() / dtype.size().max(1)],
            });
        }
        Ok(HostTensor {
            dtype,
            shape,
            storage: Arc::new(Storage::copy_of(bytes)),
            offset: 0,
        })
    }

    /// A tensor from typed values; `values.len()` must equal the shape's element count.
    pub fn from_slice<T: Element>(values: &[T], shape: &[usize]) -> Result<Self> {
        Self::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(values))
    }

    /// A 1-D tensor from typed values.
    pub fn from_vec1<T: Element>(values: &[T]) -> Self {
        Self::from_slice(values, &[values.len()]).expect("length matches by construction")
    }

    /// A 0-dim tensor holding one value, like `torch.tensor(v)`.
    pub fn scalar<T: Element>(value: T) -> Self {
        Self::from_slice(&[value], &[]).expect("one element")
    }

    /// A bool tensor (stored as one byte per element, 0 or 1).
    pub fn from_bools(values: &[bool], shape: &[usize]) -> Result<Self> {
        let bytes: Vec<u8> = values.iter().map(|&b| b as u8).collect();
        Self::from_bytes(DType::Bool, shape, &bytes)
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape; empty for a 0-dim tensor.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel_of(&self.shape)
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// The tensor's bytes (little-endian elements, row-major).
    pub fn as_bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.offset..self.offset + self.nbytes()]
    }

    /// Mutable bytes; copies the storage first if it is shared or larger than this view.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.nbytes();
        let whole = self.offset == 0 && self.storage.len() == n;
        if !whole || Arc::strong_count(&self.storage) > 1 {
            self.storage = Arc::new(Storage::copy_of(self.as_bytes()));
            self.offset = 0;
        }
        let storage = Arc::get_mut(&mut self.storage).expect("unique after copy-on-write");
        storage.bytes_mut()
    }

    /// Typed read-only view; errors if `T` is not this tensor's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_dtype::<T>("as_slice")?;
        Ok(bytemuck::cast_slice(self.as_bytes()))
    }

    /// Typed mutable view (copy-on-write); errors if `T` is not this tensor's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_dtype::<T>("as_mut_slice")?;
        Ok(bytemuck::cast_slice_mut(self.bytes_mut()))
    }

    fn check_dtype<T: Element>(&self, what: &str) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DtypeMismatch {
                context: format!("HostTensor::{what}"),
                expected: T::DTYPE.to_string(),
                found: self.dtype.to_string(),
            });
        }
        Ok(())
    }

    /// Every element converted to `f64` (bool as 0/1, complex as its real part), for display
    /// and comparisons.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let b = self.as_bytes();
        match self.dtype {
            DType::F32 => cast::<f32>(b).iter().map(|&v| v as f64).collect(),
            DType::F64 => cast::<f64>(b).to_vec(),
            DType::F16 => cast::<half::f16>(b).iter().map(|v| v.to_f64()).collect(),
            DType::BF16 => cast::<half::bf16>(b).iter().map(|v| v.to_f64()).collect(),
            DType::I64 => cast::<i64>(b).iter().map(|&v| v as f64).collect(),
            DType::I32 => cast::<i32>(b).iter().map(|&v| v as f64).collect(),
            DType::U8 | DType::Bool => b.iter().map(|&v| v as f64).collect(),
            DType::I8 => b.iter().map(|&v| v as i8 as f64).collect(),
            DType::I16 => cast::<i16>(b).iter().map(|&v| v as f64).collect(),
            DType::U16 => cast::<u16>(b).iter().map(|&v| v as f64).collect(),
            DType::U32 => cast::<u32>(b).iter().map(|&v| v as f64).collect(),
            DType::U64 => cast::<u64>(b).iter().map(|&v| v as f64).collect(),
            DType::F8E4M3FN => b.iter().map(|&v| f8e4m3fn_to_f64(v)).collect(),
            DType::C64 => cast::<f32>(b)
                .iter()
                .step_by(2)
                .map(|&v| v as f64)
                .collect(),
            DType::C128 => cast::<f64>(b).iter().step_by(2).copied().collect(),
            // e5m2 is the upper byte of an IEEE half.
            DType::F8E5M2 => b
                .iter()
                .map(|&v| half::f16::from_bits(u16::from(v) << 8).to_f64())
                .collect(),
        }
    }

    /// The value of a one-element tensor as `f64`, like `tensor.item()`.
    pub fn item(&self) -> Option<f64> {
        (self.numel() == 1).then(|| self.to_f64_vec()[0])
    }

    /// Elements `[start, start + len)` of the flattened tensor as a 1-D view (no copy).
    pub fn narrow_flat(&self, start: usize, len: usize) -> Result<Self> {
        super::check_narrow(&self.shape, start, len, "tensor")?;
        Ok(HostTensor {
            dtype: self.dtype,
            shape: vec![len],
            storage: Arc::clone(&self.storage),
            offset: self.offset + start * self.dtype.size(),
        })
    }

    /// The same elements with another shape (no copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        if super::checked_numel(shape) != Some(self.numel()) {
            return Err(Error::ShapeMismatch {
                context: "reshape".into(),
                expected: shape.to_vec(),
                found: self.shape.clone(),
            });
        }
        let mut t = self.clone();
        t.shape = shape.to_vec();
        Ok(t)
    }

    /// Flattened 1-D concatenation of tensors of one dtype (one copy).
    pub fn cat_flat(parts: &[HostTensor]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(Error::Internal("cat_flat of no tensors".into()));
        };
        let dtype = first.dtype;
        let mut total = 0;
        for p in parts {
            if p.dtype != dtype {
                return Err(Error::DtypeMismatch {
                    context: "cat_flat".into(),
                    expected: dtype.to_string(),
                    found: p.dtype.to_string(),
                });
            }
            total += p.numel();
        }
        // The parts cover every byte of the result.
        HostTensor::filled_by(dtype, &[total], |dst| {
            let mut at = 0;
            for p in parts {
                let b = p.as_bytes();
                dst[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
            Ok(())
        })
    }

    /// Same dtype, same shape and the same bytes (NaNs with equal bits compare equal).
    pub fn bit_eq(&self, other: &HostTensor) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.as_bytes() == other.as_bytes()
    }

    /// Identity of the buffer this tensor views: equal for tensors that share storage.
    pub(crate) fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.storage) as usize
    }

    /// Every byte of the buffer this tensor views (the whole storage, not just the view).
    pub(crate) fn storage_bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Offset of this view's first element in its storage, in bytes.
    pub(crate) fn storage_byte_offset(&self) -> usize {
        self.offset
    }

    /// Whether two tensors share storage (one is a view of the other's buffer).
    pub fn shares_storage_with(&self, other: &HostTensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }
}

/// The value of a `float8_e4m3fn` byte: 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no
/// infinities, NaN only for exponent and mantissa all ones.
fn f8e4m3fn_to_f64(v: u8) -> f64 {
    let sign = if v & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((v >> 3) & 0x0f);
    let man = f64::from(v & 0x07);
    if exp == 0x0f && v & 0x07 == 0x07 {
        return f64::NAN;
    }
    if exp == 0 {
        return sign * man / 8.0 * 2f64.powi(-6);
    }
    sign * (1.0 + man / 8.0) * 2f64.powi(exp - 7)
}

fn cast<T: bytemuck::Pod>(b: &[u8]) -> &[T] {
    bytemuck::cast_slice(b)
}

impl PartialEq for HostTensor {
    fn eq(&self, other: &Self) -> bool {
        self.bit_eq(other)
    }
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let vals = self.to_f64_vec();
        let shown: Vec<f64> = vals.iter().take(6).copied().collect();
        write!(f, "tensor({shown:?}")?;
        if vals.len() > 6 {
            write!(f, " … {} elements", vals.len())?;
        }
        write!(f, ", dtype={}, shape={:?})", self.dtype, self.shape)
    }
}

#[derive(Serialize, Deserialize)]
struct Wire {
    dtype: DType,
    shape: Vec<usize>,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
}

impl Serialize for HostTensor {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct WireRef<'a> {
            dtype: DType,
            shape: &'a [usize],
            #[serde(with = "serde_bytes")]
            data: &'a [u8],
        }
        WireRef {
            dtype: self.dtype,
            shape: &self.shape,
            data: self.as_bytes(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for HostTensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        HostTensor::from_bytes(w.dtype, &w.shape, &w.data).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_share_storage_and_writes_copy() {
        let t = HostTensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let v = t.narrow_flat(1, 2).unwrap();
        assert!(v.shares_storage_with(&t));
        assert_eq!(v.as_slice::<f32>().unwrap(), &[2.0, 3.0]);
        let mut w = v.clone();
        w.as_mut_slice::<f32>().unwrap()[0] = 9.0;
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(w.as_slice::<f32>().unwrap(), &[9.0, 3.0]);
    }

    #[test]
    fn out_of_range_narrow_is_an_error() {
        let t = HostTensor::zeros(DType::BF16, &[3]);
        assert!(matches!(
            t.narrow_flat(2, 2),
            Err(Error::OutOfBounds { numel: 3, .. })
        ));
        assert!(matches!(
            t.as_slice::<f32>(),
            Err(Error::DtypeMismatch { .. })
        ));
    }

    #[test]
    fn scalar_is_zero_dim() {
        let s = HostTensor::scalar(3.0f32);
        assert_eq!(s.dim(), 0);
        assert_eq!(s.numel(), 1);
        assert_eq!(s.item(), Some(3.0));
    }

    #[test]
    fn serde_round_trip_keeps_bits() {
        let t =
            HostTensor::from_slice(&[half::bf16::from_f32(1.5), half::bf16::NAN], &[2]).unwrap();
        let bytes = bincode::serde::encode_to_vec(&t, bincode::config::standard()).unwrap();
        let (back, _): (HostTensor, usize) =
            bincode::serde::decode_from_slice(&bytes, bincode::config::standard()).unwrap();
        assert!(back.bit_eq(&t));
    }
}
