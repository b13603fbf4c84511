//! Element-wise reductions of reduce-scatter and all-reduce: pure functions over byte buffers,
//! shared by every backend so that all of them give the same bits.

use crate::tensor::DType;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How [`super::ProcessGroup::reduce_scatter_into`] and [`super::ProcessGroup::all_reduce`]
/// combine the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Sum over ranks, added in rank order.
    Sum,
    /// The sum divided by the world size (integers: truncated toward zero), as `ReduceOp.AVG`
    /// and `ncclAvg`.
    Avg,
    /// Element-wise maximum; a NaN on any rank gives NaN, as `torch.maximum`.
    Max,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// Checks that `op` is defined for `dtype` (`bool` supports only [`ReduceOp::Max`], a logical
/// or) and that `len` bytes hold whole elements.
pub fn check_reduction(dtype: DType, op: ReduceOp, len: usize) -> Result<(), String> {
    if matches!(dtype, DType::F8E4M3FN | DType::F8E5M2) {
        return Err(format!("reductions are not defined for {dtype}"));
    }
    if matches!(dtype, DType::C64 | DType::C128) && op == ReduceOp::Max {
        return Err(format!("reduction `{op}` is not defined for {dtype}"));
    }
    if dtype == DType::Bool && op != ReduceOp::Max {
        return Err(format!(
            "reduction `{op}` is not defined for {dtype}; use max"
        ));
    }
    if len % dtype.size() != 0 {
        return Err(format!(
            "{len} bytes is not a whole number of {dtype} elements ({} bytes each)",
            dtype.size()
        ));
    }
    Ok(())
}

/// Reduces `parts` (one per rank, in rank order, each `out.len()` bytes of `dtype` values)
/// into `out`, where `world_size` is the divisor of [`ReduceOp::Avg`].
///
/// Values are combined in rank order: floats in `f32` for `f16`/`bf16` (rounded once at the
/// end) and in their own precision otherwise, integers with wrapping. So every backend that
/// calls this gives identical bits for identical inputs.
///
/// Fails, writing nothing, when the arguments fail [`check_reduction`] or a part's length
/// differs from `out.len()`.
pub fn reduce_parts(
    dtype: DType,
    op: ReduceOp,
    parts: &[&[u8]],
    out: &mut [u8],
) -> Result<(), String> {
    check_reduction(dtype, op, out.len())?;
    if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != out.len()) {
        return Err(format!(
            "rank {r} contributes {} bytes, expected {}",
            p.len(),
            out.len()
        ));
    }
    let n = parts.len();
    match dtype {
        DType::F32 => reduce::<f32, f32>(op, parts, out, n, |a| a, |a| a),
        DType::F64 => reduce::<f64, f64>(op, parts, out, n, |a| a, |a| a),
        DType::F16 => reduce::<f16, f32>(op, parts, out, n, f16::to_f32, f16::from_f32),
        DType::BF16 => reduce::<bf16, f32>(op, parts, out, n, bf16::to_f32, bf16::from_f32),
        DType::I64 => reduce::<i64, i64>(op, parts, out, n, |a| a, |a| a),
        DType::I32 => reduce::<i32, i32>(op, parts, out, n, |a| a, |a| a),
        DType::U8 => reduce::<u8, u8>(op, parts, out, n, |a| a, |a| a),
        // Max of 0/1 bytes is a logical or.
        DType::Bool => reduce::<u8, u8>(op, parts, out, n, |a| a, |a| a),
        DType::I8 => reduce::<i8, i8>(op, parts, out, n, |a| a, |a| a),
        DType::I16 => reduce::<i16, i16>(op, parts, out, n, |a| a, |a| a),
        DType::U16 => reduce::<u16, u16>(op, parts, out, n, |a| a, |a| a),
        DType::U32 => reduce::<u32, u32>(op, parts, out, n, |a| a, |a| a),
        DType::U64 => reduce::<u64, u64>(op, parts, out, n, |a| a, |a| a),
        // Sums and means of complex numbers are those of their parts.
        DType::C64 => reduce::<f32, f32>(op, parts, out, n, |a| a, |a| a),
        DType::C128 => reduce::<f64, f64>(op, parts, out, n, |a| a, |a| a),
        DType::F8E4M3FN | DType::F8E5M2 => unreachable!("refused by check_reduction"),
    }
    Ok(())
}

/// Arithmetic of the accumulator type.
trait Acc: Copy {
    fn add(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn div(self, n: usize) -> Self;
}

macro_rules! float_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn max(self, other: Self) -> Self {
                if self.is_nan() || other.is_nan() {
                    <$t>::NAN
                } else if other > self {
                    other
                } else {
                    self
                }
            }
            fn div(self, n: usize) -> Self {
                self / n as $t
            }
        }
    )*};
}

macro_rules! int_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn max(self, other: Self) -> Self {
                Ord::max(self, other)
            }
            fn div(self, n: usize) -> Self {
                // Ranks fit every integer type the crate reduces except u8 beyond 255 ranks;
                // saturating there keeps the result defined (the quotient is then 0 or 1).
                self.wrapping_div(<$t>::try_from(n).unwrap_or(<$t>::MAX))
            }
        }
    )*};
}

float_acc!(f32, f64);
int_acc!(i64, i32, i16, i8, u64, u32, u16, u8);

fn reduce<E: bytemuck::Pod, A: Acc>(
    op: ReduceOp,
    parts: &[&[u8]],
    out: &mut [u8],
    world_size: usize,
    widen: impl Fn(E) -> A,
    narrow: impl Fn(A) -> E,
) {
    let size = std::mem::size_of::<E>();
    let read = |bytes: &[u8], i: usize| -> E {
        bytemuck::pod_read_unaligned(&bytes[i * size..(i + 1) * size])
    };
    let Some((first, rest)) = parts.split_first() else {
        return;
    };
    for (i, slot) in out.chunks_exact_mut(size).enumerate() {
        let mut acc = widen(read(first, i));
        for part in rest {
            let v = widen(read(part, i));
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => acc.add(v),
                ReduceOp::Max => acc.max(v),
            };
        }
        if op == ReduceOp::Avg {
            acc = acc.div(world_size);
        }
        slot.copy_from_slice(bytemuck::bytes_of(&narrow(acc)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn run<T: bytemuck::Pod>(dtype: DType, op: ReduceOp, parts: &[Vec<T>]) -> Vec<T> {
        let parts: Vec<Vec<u8>> = parts.iter().map(|p| bytes(p)).collect();
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        let mut out = vec![0u8; refs[0].len()];
        reduce_parts(dtype, op, &refs, &mut out).unwrap();
        bytemuck::pod_collect_to_vec(&out)
    }

    #[test]
    fn f32_sum_adds_in_rank_order() {
        // (1e8 + 1) - 1e8 loses the 1 in f32; any other order would keep it.
        let out = run(
            DType::F32,
            ReduceOp::Sum,
            &[vec![1e8f32, 2.0], vec![1.0, 3.0], vec![-1e8, 4.0]],
        );
        assert_eq!(out, [0.0, 9.0]);
    }

    #[test]
    fn avg_divides_by_world_size_and_ints_truncate() {
        assert_eq!(
            run(DType::F64, ReduceOp::Avg, &[vec![1.0f64], vec![2.0]]),
            [1.5]
        );
        assert_eq!(
            run(DType::I64, ReduceOp::Avg, &[vec![7i64], vec![-2], vec![0]]),
            [1]
        );
        assert_eq!(
            run(DType::I32, ReduceOp::Avg, &[vec![-7i32], vec![0]]),
            [-3]
        );
    }

    #[test]
    fn max_propagates_nan() {
        let out = run(
            DType::F32,
            ReduceOp::Max,
            &[vec![1.0f32, f32::NAN, -3.0], vec![2.0, 0.0, -4.0]],
        );
        assert_eq!(out[0], 2.0);
        assert!(out[1].is_nan());
        assert_eq!(out[2], -3.0);
    }

    #[test]
    fn half_types_accumulate_in_f32_and_round_once() {
        // 2048 + 1 + 1 in f16 step by step stays 2048 (spacing 2 there); in f32 it is 2050.
        let h = |x: f32| f16::from_f32(x);
        let out = run(
            DType::F16,
            ReduceOp::Sum,
            &[vec![h(2048.0)], vec![h(1.0)], vec![h(1.0)]],
        );
        assert_eq!(out, [h(2050.0)]);
        let b = |x: f32| bf16::from_f32(x);
        let out = run(DType::BF16, ReduceOp::Avg, &[vec![b(1.0)], vec![b(2.0)]]);
        assert_eq!(out, [b(1.5)]);
    }

    #[test]
    fn bool_supports_only_max_which_is_or() {
        assert!(check_reduction(DType::Bool, ReduceOp::Sum, 4).is_err());
        assert_eq!(
            run(
                DType::Bool,
                ReduceOp::Max,
                &[vec![0u8, 1, 0], vec![0u8, 0, 1]]
            ),
            [0, 1, 1]
        );
    }

    #[test]
    fn parts_of_the_wrong_length_are_rejected_before_writing() {
        let mut out = vec![7u8; 8];
        let err = reduce_parts(DType::F32, ReduceOp::Sum, &[&[0; 8], &[0; 4]], &mut out);
        assert!(err.unwrap_err().contains("rank 1 contributes 4 bytes"));
        assert_eq!(out, [7; 8]);
    }

    #[test]
    fn partial_elements_are_rejected() {
        let err = check_reduction(DType::F64, ReduceOp::Sum, 12).unwrap_err();
        assert!(err.contains("12 bytes"), "{err}");
    }

    #[test]
    // Heap buffers are at least 8-aligned, so `[1..]` is surely misaligned for f64.
    #[allow(clippy::useless_vec)]
    fn unaligned_buffers_reduce_correctly() {
        let a = bytes(&[1.5f64, 2.5]);
        let b = bytes(&[0.5f64, 0.5]);
        let mut sa = vec![0u8; 17];
        sa[1..].copy_from_slice(&a);
        let mut sb = vec![0u8; 17];
        sb[1..].copy_from_slice(&b);
        let mut out = vec![0u8; 17];
        reduce_parts(
            DType::F64,
            ReduceOp::Sum,
            &[&sa[1..], &sb[1..]],
            &mut out[1..],
        )
        .unwrap();
        assert_eq!(
            bytemuck::pod_collect_to_vec::<u8, f64>(&out[1..]),
            [2.0, 3.0]
        );
    }
}
