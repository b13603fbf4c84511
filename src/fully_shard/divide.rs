//! `_get_gradient_divide_factors`: how a gradient reduction divides by the data-parallel size.

use crate::tensor::DType;

/// The reduction a gradient collective runs, as `_get_gradient_divide_factors` picks it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradReduceOp {
    /// `ReduceOp.SUM`.
    Sum,
    /// `ReduceOp.AVG`: the sum divided by the group size.
    Avg,
    /// `ReduceOp.PREMUL_SUM(scale)`: every rank's values multiplied by `scale`, then summed.
    PremulSum(f64),
}

/// What [`gradient_divide_factors`] returns: divide before and after the collective (by
/// [`super::div_if_needed`]), and the ops of the reduce-scatter and of HSDP's all-reduce.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DivideFactors {
    /// Divide the unsharded gradients by this before the reduce-scatter.
    pub pre: Option<f64>,
    /// Divide the sharded gradients by this after the reduction.
    pub post: Option<f64>,
    /// The reduce-scatter's op.
    pub reduce_scatter_op: GradReduceOp,
    /// The all-reduce's op (HSDP's replicate dimension).
    pub all_reduce_op: GradReduceOp,
}

/// `_get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype,
/// factor=factor, force_sum_reduction_for_comms=force_sum)`, with the groups given by their
/// sizes (`None` for no group).
///
/// For fp32 and bf16 (no overflow risk) the division rides on the collective: `AVG`, or
/// `PREMUL_SUM(1 / factor)` for a custom factor other than the reduce-scatter size. Otherwise
/// (fp16, or sums forced) the factor is split into a power-of-two pre-divisor near its square
/// root and the rest as post-divisor, so fp16 neither overflows nor underflows.
pub fn gradient_divide_factors(
    reduce_scatter_size: Option<usize>,
    all_reduce_size: Option<usize>,
    reduce_dtype: DType,
    factor: Option<f64>,
    force_sum: bool,
) -> DivideFactors {
    use GradReduceOp::{Avg, PremulSum, Sum};
    let overflow_risk = !matches!(reduce_dtype, DType::F32 | DType::BF16);
    let data_parallel_size = reduce_scatter_size.unwrap_or(1) * all_reduce_size.unwrap_or(1);
    let factors = |pre, post, rs, ar| DivideFactors {
        pre,
        post,
        reduce_scatter_op: rs,
        all_reduce_op: ar,
    };
    if !overflow_risk && !force_sum {
        return match factor {
            None if data_parallel_size == 1 => factors(None, None, Sum, Sum),
            None => factors(None, None, Avg, Avg),
            Some(f) if reduce_scatter_size.is_some_and(|n| f == n as f64) => {
                factors(None, None, Avg, Sum)
            }
            Some(f) => factors(None, None, PremulSum(1.0 / f), Sum),
        };
    }
    let factor = factor.unwrap_or(data_parallel_size as f64);
    if overflow_risk {
        let mut pre = 1.0f64;
        while factor % pre == 0.0 && factor / pre > pre {
            pre *= 2.0;
        }
        factors(Some(pre), Some(factor / pre), Sum, Sum)
    } else {
        factors(None, Some(factor), Sum, Sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp16_splits_the_world_size_into_a_power_of_two_and_the_rest() {
        // Values as PyTorch 2.13's _get_gradient_divide_factors returns them.
        for (ws, pre, post) in [
            (1, 1.0, 1.0),
            (2, 2.0, 1.0),
            (3, 2.0, 1.5),
            (8, 4.0, 2.0),
            (16, 4.0, 4.0),
            (6, 4.0, 1.5),
        ] {
            let f = gradient_divide_factors(Some(ws), None, DType::F16, None, false);
            assert_eq!((f.pre, f.post), (Some(pre), Some(post)), "world size {ws}");
            assert_eq!(f.reduce_scatter_op, GradReduceOp::Sum);
        }
    }

    #[test]
    fn fp32_and_bf16_average_in_the_collective() {
        for dtype in [DType::F32, DType::BF16] {
            let f = gradient_divide_factors(Some(4), None, dtype, None, false);
            assert_eq!(
                (f.pre, f.post, f.reduce_scatter_op),
                (None, None, GradReduceOp::Avg)
            );
            let one = gradient_divide_factors(Some(1), None, dtype, None, false);
            assert_eq!(one.reduce_scatter_op, GradReduceOp::Sum);
            let custom = gradient_divide_factors(Some(4), None, dtype, Some(8.0), false);
            assert_eq!(custom.reduce_scatter_op, GradReduceOp::PremulSum(0.125));
            let same = gradient_divide_factors(Some(4), None, dtype, Some(4.0), false);
            assert_eq!(same.reduce_scatter_op, GradReduceOp::Avg);
            let forced = gradient_divide_factors(Some(4), None, dtype, None, true);
            assert_eq!((forced.pre, forced.post), (None, Some(4.0)));
        }
    }
}
