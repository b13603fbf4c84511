//! The element-wise float arithmetic of FSDP2's gradient path, with PyTorch's CPU rounding:
//! fp16 and bf16 compute in f32 (their `opmath` type) and round once; a Python float scalar
//! becomes an f32 for f32, fp16 and bf16 tensors and stays an f64 for f64 ones.

use crate::error::{Error, Result};
use crate::tensor::DType;
use half::{bf16, f16};

/// The float dtypes gradients are reduced in.
pub(super) fn check_float(dtype: DType, what: &str) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Ok(());
    }
    Err(Error::DtypeMismatch {
        context: what.to_string(),
        expected: "float32, float64, float16 or bfloat16".into(),
        found: dtype.to_string(),
    })
}

/// Reads element `i` of a little-endian buffer of `dtype` (a float dtype) as f64, exactly.
pub(super) fn read(bytes: &[u8], dtype: DType, i: usize) -> f64 {
    let at = |n: usize| &bytes[i * n..(i + 1) * n];
    match dtype {
        DType::F32 => f32::from_le_bytes(at(4).try_into().unwrap()) as f64,
        DType::F64 => f64::from_le_bytes(at(8).try_into().unwrap()),
        DType::F16 => f16::from_le_bytes(at(2).try_into().unwrap()).to_f64(),
        DType::BF16 => bf16::from_le_bytes(at(2).try_into().unwrap()).to_f64(),
        other => unreachable!("{other} is refused by check_float"),
    }
}

/// Writes `v` rounded to nearest-even into element `i` of a buffer of `dtype`. Rounding from
/// f64 once equals rounding the (exactly representable) f32 value once.
pub(super) fn write(bytes: &mut [u8], dtype: DType, i: usize, v: f64) {
    let mut put = |b: &[u8]| bytes[i * b.len()..(i + 1) * b.len()].copy_from_slice(b);
    match dtype {
        DType::F32 => put(&(v as f32).to_le_bytes()),
        DType::F64 => put(&v.to_le_bytes()),
        DType::F16 => put(&f16::from_f64(v).to_le_bytes()),
        DType::BF16 => put(&bf16::from_f64(v).to_le_bytes()),
        other => unreachable!("{other} is refused by check_float"),
    }
}

/// Applies `op` to every element in the dtype's compute precision: f64 for f64, f32 for the
/// others (fp16 and bf16 round once at the end).
fn map_in_place(
    bytes: &mut [u8],
    dtype: DType,
    op32: impl Fn(f32) -> f32,
    op64: impl Fn(f64) -> f64,
) {
    let n = bytes.len() / dtype.size();
    for i in 0..n {
        let x = read(bytes, dtype, i);
        let y = if dtype == DType::F64 {
            op64(x)
        } else {
            op32(x as f32) as f64
        };
        write(bytes, dtype, i, y);
    }
}

/// `_div_if_needed(tensor, factor)`: divides every element by `factor` unless it is `None` or
/// 1 (`tensor.div_(factor)`, true division with the scalar in the compute precision).
pub fn div_if_needed(bytes: &mut [u8], dtype: DType, factor: Option<f64>) -> Result<()> {
    check_float(dtype, "div_if_needed")?;
    if let Some(f) = factor.filter(|&f| f != 1.0) {
        map_in_place(bytes, dtype, |x| x / f as f32, |x| x / f);
    }
    Ok(())
}

/// Multiplies every element by `scale` (`tensor.mul_(scale)`): the local half of
/// `PREMUL_SUM(scale)`, whose sum the process group then computes.
pub(super) fn scale(bytes: &mut [u8], dtype: DType, scale: f64) {
    map_in_place(bytes, dtype, |x| x * scale as f32, |x| x * scale);
}

/// Converts a buffer of `from` elements to `to` (`tensor.to(to)`: exact widening, rounding to
/// nearest-even when narrowing). Both must be float dtypes.
pub fn cast(bytes: &[u8], from: DType, to: DType) -> Result<Vec<u8>> {
    check_float(from, "cast")?;
    check_float(to, "cast")?;
    if from == to {
        return Ok(bytes.to_vec());
    }
    let n = bytes.len() / from.size();
    let mut out = vec![0u8; n * to.size()];
    for i in 0..n {
        write(&mut out, to, i, read(bytes, from, i));
    }
    Ok(out)
}
