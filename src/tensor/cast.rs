//! Floating-point dtype casts as PyTorch's CPU `Tensor.to(dtype)` computes them, element by
//! element on raw little-endian bytes, so that a stream of a tensor's bytes can be cast on its
//! way to a file.
//!
//! Every source value is widened exactly to `f32` (or read as `f64`) and then rounded to the
//! target with PyTorch's own scalar routines (`c10::BFloat16`'s round-to-nearest-even, and
//! `fp16_ieee_from_fp32_value`): a NaN becomes the target's canonical quiet NaN (`0x7FC0` in
//! bfloat16, sign | `0x7E00` in float16). A `float64` source is rounded to `float32` first,
//! as `c10` converts through `float`.

use super::DType;

/// Whether `Tensor.to(to)` of a `from` tensor changes its values under [`cast`]: both
/// floating point (including float8) and different. Integer, bool and complex dtypes are
/// never cast.
pub fn casts(from: DType, to: DType) -> bool {
    from != to && from.is_floating_point() && to.is_floating_point() && castable_to(to)
}

/// The dtypes [`cast`] writes.
pub(crate) fn castable_to(to: DType) -> bool {
    matches!(to, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
}

/// Casts the elements of `from` bytes (whole elements of dtype `from`) to dtype `to`,
/// appending to `out`. `casts(from, to)` must hold.
pub(crate) fn cast(from: DType, to: DType, bytes: &[u8], out: &mut Vec<u8>) {
    let n = bytes.len() / from.size();
    out.reserve(n * to.size());
    for e in bytes.chunks_exact(from.size()) {
        match to {
            DType::F64 => out.extend_from_slice(&widen_f64(from, e).to_le_bytes()),
            DType::F32 => out.extend_from_slice(&narrow_f32(from, e).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16_bits(narrow_f32(from, e)).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16_bits(narrow_f32(from, e)).to_le_bytes()),
            _ => unreachable!("castable_to excludes {to}"),
        }
    }
}

/// One element as `f64` (exact for every floating source).
fn widen_f64(from: DType, e: &[u8]) -> f64 {
    match from {
        DType::F64 => f64::from_le_bytes(e.try_into().expect("8 bytes")),
        _ => narrow_f32(from, e) as f64,
    }
}

/// One element as `f32`: exact for 16- and 8-bit sources, rounded to nearest even for
/// `float64` (C's `static_cast<float>`).
fn narrow_f32(from: DType, e: &[u8]) -> f32 {
    match from {
        DType::F32 => f32::from_le_bytes(e.try_into().expect("4 bytes")),
        DType::F64 => f64::from_le_bytes(e.try_into().expect("8 bytes")) as f32,
        DType::BF16 => f32::from_bits((u16::from_le_bytes([e[0], e[1]]) as u32) << 16),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([e[0], e[1]])).to_f32(),
        DType::F8E4M3FN => f8e4m3fn(e[0]),
        // float8_e5m2 is the high byte of a float16.
        DType::F8E5M2 => half::f16::from_bits((e[0] as u16) << 8).to_f32(),
        _ => unreachable!("casts excludes {from}"),
    }
}

/// `float8_e4m3fn`: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN at
/// `S.1111.111`.
fn f8e4m3fn(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xF) as i32;
    let man = (b & 0x7) as f32;
    if exp == 0xF && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * man / 8.0 * 2f32.powi(-6);
    }
    sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
}

/// `c10::BFloat16(float)`: round to nearest even; NaN is `0x7FC0`.
pub(crate) fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let u = x.to_bits();
    let bias = ((u >> 16) & 1) + 0x7FFF;
    (u.wrapping_add(bias) >> 16) as u16
}

/// `c10::detail::fp16_ieee_from_fp32_value`: round to nearest even, overflow to infinity;
/// NaN is sign | `0x7E00`.
pub(crate) fn f16_bits(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xFF00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7C00;
    let mantissa_bits = bits & 0x0000_0FFF;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16)
        | if shl1_w > 0xFF00_0000 {
            0x7E00
        } else {
            nonsign
        }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(from: DType, to: DType, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        cast(from, to, bytes, &mut out);
        out
    }

    #[test]
    fn bfloat16_rounds_to_nearest_even_and_nan_is_canonical() {
        // 1 + 2^-8 lies halfway between two bfloat16 values: ties go to the even one (1.0).
        assert_eq!(bf16_bits(1.0 + 2f32.powi(-8)), 0x3F80);
        // Just above halfway rounds up.
        assert_eq!(bf16_bits(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3F81);
        assert_eq!(bf16_bits(f32::from_bits(0xFFC1_2345)), 0x7FC0);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
        assert_eq!(bf16_bits(f32::MAX), 0x7F80, "rounds up to infinity");
    }

    #[test]
    fn float16_agrees_with_the_half_crate_on_every_non_nan_pattern_sampled() {
        for bits in (0u32..=u32::MAX).step_by(65_521) {
            let f = f32::from_bits(bits);
            if f.is_nan() {
                assert_eq!(f16_bits(f) & 0x7FFF, 0x7E00);
                continue;
            }
            assert_eq!(f16_bits(f), half::f16::from_f32(f).to_bits(), "{f:e}");
        }
    }

    #[test]
    fn float64_goes_through_float32_as_c10_does() {
        let x = 1.0f64 + 2f64.powi(-8) + 2f64.powi(-40);
        // Straight to bfloat16 this would round up; through float32 it is an exact tie first.
        assert_eq!(
            one(DType::F64, DType::BF16, &x.to_le_bytes()),
            0x3F80u16.to_le_bytes()
        );
    }

    #[test]
    fn float8_widens_exactly() {
        // e4m3fn 0x38 = 1.0, 0x7E = 448, 0x01 = 2^-9; e5m2 0x3C = 1.0.
        for (b, v) in [
            (0x38u8, 1.0f32),
            (0x7E, 448.0),
            (0x01, 2f32.powi(-9)),
            (0xB8, -1.0),
        ] {
            assert_eq!(narrow_f32(DType::F8E4M3FN, &[b]), v);
        }
        assert!(narrow_f32(DType::F8E4M3FN, &[0x7F]).is_nan());
        assert_eq!(narrow_f32(DType::F8E5M2, &[0x3C]), 1.0);
        assert_eq!(narrow_f32(DType::F8E5M2, &[0x7C]), f32::INFINITY);
    }

    #[test]
    fn only_floating_dtypes_are_cast() {
        assert!(casts(DType::F32, DType::BF16));
        assert!(!casts(DType::I64, DType::BF16));
        assert!(!casts(DType::Bool, DType::F32));
        assert!(!casts(DType::C64, DType::F16));
        assert!(!casts(DType::BF16, DType::BF16));
    }
}
