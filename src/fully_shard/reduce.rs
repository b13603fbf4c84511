//! `foreach_reduce`: reduce-scattering one `fully_shard` group's unsharded gradients into each
//! rank's sharded gradients.

use super::all_gather::check_group;
use super::divide::{gradient_divide_factors, GradReduceOp};
use super::elementwise::{cast, check_float, div_if_needed, scale};
use crate::collectives::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};
use crate::param_layout::ShardedParam;
use crate::tensor::{DType, HostTensor};

/// The settings of a gradient reduction (`MixedPrecisionPolicy` and the module's setters).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReduceOptions {
    /// `MixedPrecisionPolicy.reduce_dtype`: the dtype the collective runs in; `None` is the
    /// gradients' dtype. Gradients are cast to it in the copy-in.
    pub reduce_dtype: Option<DType>,
    /// `orig_dtype`: the dtype of the sharded gradients handed back (the parameters' dtype);
    /// `None` keeps the reduce dtype.
    pub orig_dtype: Option<DType>,
    /// `set_reduce_scatter_divide_factor` / `set_gradient_divide_factor`: divide by this
    /// instead of the world size.
    pub divide_factor: Option<f64>,
    /// `set_force_sum_reduction_for_comms`: only sums in the collective, dividing before and
    /// after instead.
    pub force_sum_reduction_for_comms: bool,
}

/// `foreach_reduce` on a 1-D mesh: every rank passes the unsharded gradient of every parameter
/// of the group (global shape, one dtype for all); each gets back its sharded gradients (shape
/// [`ShardedParam::local_shape`]), in group order.
///
/// The gradients are chunk-concatenated into the reduce dtype (copy-in), divided by the
/// pre-factor, reduce-scattered with the op [`gradient_divide_factors`] picks (a
/// `PREMUL_SUM(s)` multiplies locally by `s` and sums), divided by the post-factor, cast to
/// [`ReduceOptions::orig_dtype`] and viewed out. At one rank there is no collective: the input
/// is copied, divided by a custom factor if set (after the pre-division, as PyTorch does).
/// Ranks agree on their inputs first, so one rank's bad gradient fails every rank.
pub fn foreach_reduce(
    pg: &dyn ProcessGroup,
    params: &[&ShardedParam],
    unsharded_grads: &[HostTensor],
    options: &ReduceOptions,
) -> Result<Vec<HostTensor>> {
    let ws = pg.world_size();
    let local = check_group(pg, params)
        .and_then(|()| check_options(options, pg.rank()))
        .and_then(|()| grad_dtype(params, unsharded_grads, pg.rank()))
        .and_then(|grad_dtype| {
            let reduce_dtype = options.reduce_dtype.unwrap_or(grad_dtype);
            let input = reduce_scatter_copy_in(params, unsharded_grads, reduce_dtype)?;
            Ok((reduce_dtype, input))
        });
    let (reduce_dtype, mut input) = pg.agree(local)?;
    let factors = gradient_divide_factors(
        Some(ws),
        None,
        reduce_dtype,
        options.divide_factor,
        options.force_sum_reduction_for_comms,
    );
    div_if_needed(&mut input, reduce_dtype, factors.pre)?;
    let mut output = vec![0u8; input.len() / ws];
    if ws > 1 {
        let op = match factors.reduce_scatter_op {
            GradReduceOp::Sum => ReduceOp::Sum,
            GradReduceOp::Avg => ReduceOp::Avg,
            GradReduceOp::PremulSum(s) => {
                scale(&mut input, reduce_dtype, s);
                ReduceOp::Sum
            }
        };
        pg.reduce_scatter_into(&input, &mut output, reduce_dtype, op)?;
    } else {
        output.copy_from_slice(&input);
        div_if_needed(&mut output, reduce_dtype, options.divide_factor)?;
    }
    div_if_needed(&mut output, reduce_dtype, factors.post)?;
    let out_dtype = options.orig_dtype.unwrap_or(reduce_dtype);
    let output = cast(&output, reduce_dtype, out_dtype)?;
    view_out(params, &output, out_dtype, pg.rank())
}

/// `foreach_reduce_scatter_copy_in` (`torch._chunk_cat`): the reduce-scatter input as
/// `world_size` rows, row `r` holding chunk `r` of every gradient (zero-padded to the chunk
/// size) in group order, every element cast to `reduce_dtype`.
pub fn reduce_scatter_copy_in(
    params: &[&ShardedParam],
    grads: &[HostTensor],
    reduce_dtype: DType,
) -> Result<Vec<u8>> {
    check_float(reduce_dtype, "the reduce dtype")?;
    let ws = params.first().map_or(1, |p| p.world_size);
    let esize = reduce_dtype.size();
    let row_len: usize = params.iter().map(|p| p.padded_numel() * esize).sum();
    let mut input = vec![0u8; row_len * ws];
    let mut offset = 0;
    for (p, g) in params.iter().zip(grads) {
        let wide = cast(g.as_bytes(), g.dtype(), reduce_dtype)?;
        let row_numel = p.row_numel();
        for r in 0..ws {
            let rows = p.rows(r);
            let src = &wide[rows.start * row_numel * esize..rows.end * row_numel * esize];
            let at = r * row_len + offset;
            input[at..at + src.len()].copy_from_slice(src);
        }
        offset += p.padded_numel() * esize;
    }
    Ok(input)
}

/// Each parameter's sharded gradient: its local elements at the start of its padded stretch of
/// the reduce-scatter output.
fn view_out(
    params: &[&ShardedParam],
    output: &[u8],
    dtype: DType,
    rank: usize,
) -> Result<Vec<HostTensor>> {
    let esize = dtype.size();
    let mut offset = 0;
    let mut grads = Vec::with_capacity(params.len());
    for p in params {
        let n = p.local_numel(rank) * esize;
        grads.push(HostTensor::from_bytes(
            dtype,
            &p.local_shape(rank),
            &output[offset..offset + n],
        )?);
        offset += p.padded_numel() * esize;
    }
    Ok(grads)
}

/// A usable divide factor: finite and positive.
fn check_options(options: &ReduceOptions, rank: usize) -> Result<()> {
    match options.divide_factor {
        Some(f) if !(f.is_finite() && f > 0.0) => Err(Error::InvalidArgument {
            op: "set_reduce_scatter_divide_factor".into(),
            rank,
            reason: format!("the divide factor {f} is not a finite positive number"),
        }),
        _ => Ok(()),
    }
}

/// One gradient per parameter, each of the parameter's global shape, all of one float dtype
/// (`FSDP reduce-scatter expects uniform gradient dtype`). Returns that dtype.
fn grad_dtype(params: &[&ShardedParam], grads: &[HostTensor], rank: usize) -> Result<DType> {
    let invalid = |reason: String| Error::InvalidArgument {
        op: "foreach_reduce".into(),
        rank,
        reason,
    };
    if params.len() != grads.len() || grads.is_empty() {
        return Err(invalid(format!(
            "{} gradients for {} parameters (a reduction needs at least one)",
            grads.len(),
            params.len()
        )));
    }
    let dtype = grads[0].dtype();
    check_float(dtype, "foreach_reduce's gradients")?;
    for (p, g) in params.iter().zip(grads) {
        let context = format!("the unsharded gradient of `{}` on rank {rank}", p.name);
        if g.dtype() != dtype {
            return Err(Error::DtypeMismatch {
                context: format!("{context} (FSDP reduce-scatter expects one gradient dtype)"),
                expected: dtype.to_string(),
                found: g.dtype().to_string(),
            });
        }
        if g.shape() != p.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                context,
                expected: p.shape.clone(),
                found: g.shape().to_vec(),
            });
        }
    }
    Ok(dtype)
}
