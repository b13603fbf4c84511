//! `foreach_all_gather` and `foreach_all_gather_copy_out`: unsharding one `fully_shard` group.

use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::param_layout::ShardedParam;
use crate::tensor::HostTensor;

/// The all-gather's output and how to cut it (`AllGatherResult`): every rank's flat input, in
/// rank order, and the byte length of each parameter's padded shard within one input.
#[derive(Debug, Clone)]
pub struct AllGatherResult {
    /// `world_size` inputs of `input_len` bytes each, concatenated.
    pub output: Vec<u8>,
    /// Bytes of one rank's input (the sum of `split_bytes`).
    pub input_len: usize,
    /// Bytes of each parameter's padded shard, in group order (`inp_split_sizes`).
    pub split_bytes: Vec<usize>,
    /// The rank that gathered it.
    pub rank: usize,
}

/// Copy-in (`all_gather_copy_in`): this rank's flat all-gather input, every parameter's local
/// shard followed by zero rows up to the padded shard size, in group order. Parameters of
/// different dtypes are laid end to end as bytes.
pub fn all_gather_copy_in(
    params: &[&ShardedParam],
    shards: &[HostTensor],
    rank: usize,
) -> Result<Vec<u8>> {
    check_shards(params, shards, rank)?;
    let total: usize = params.iter().map(|p| padded_bytes(p)).sum();
    let mut input = vec![0u8; total];
    let mut at = 0;
    for (p, shard) in params.iter().zip(shards) {
        input[at..at + shard.nbytes()].copy_from_slice(shard.as_bytes());
        at += padded_bytes(p);
    }
    Ok(input)
}

/// `foreach_all_gather`: copies this rank's shards in and all-gathers them across `pg`. Every
/// rank passes its local shard of every parameter of the group (shape
/// [`ShardedParam::local_shape`]). Ranks agree on their inputs first, so a bad shard on one
/// rank fails every rank with that rank's error instead of hanging its peers.
pub fn foreach_all_gather(
    pg: &dyn ProcessGroup,
    params: &[&ShardedParam],
    shards: &[HostTensor],
) -> Result<AllGatherResult> {
    let input = pg.agree(
        check_group(pg, params).and_then(|()| all_gather_copy_in(params, shards, pg.rank())),
    )?;
    let mut output = vec![0u8; input.len() * pg.world_size()];
    pg.all_gather_into(&input, &mut output)?;
    Ok(AllGatherResult {
        input_len: input.len(),
        output,
        split_bytes: params.iter().map(|p| padded_bytes(p)).collect(),
        rank: pg.rank(),
    })
}

/// `foreach_all_gather_copy_out`: the unsharded parameters, in group order. Parameter `i`'s
/// padded shards from every rank, end to end, hold its rows in order (whole chunks first, the
/// padding after the last real row), so the parameter is their first `numel` elements.
pub fn foreach_all_gather_copy_out(
    result: &AllGatherResult,
    params: &[&ShardedParam],
) -> Result<Vec<HostTensor>> {
    let ws = params.first().map_or(1, |p| p.world_size);
    check_result(result, params, ws)?;
    let mut offset = 0;
    let mut out = Vec::with_capacity(params.len());
    for (p, &split) in params.iter().zip(&result.split_bytes) {
        let mut gathered = Vec::with_capacity(split * ws);
        for r in 0..ws {
            let at = r * result.input_len + offset;
            gathered.extend_from_slice(&result.output[at..at + split]);
        }
        let nbytes = p.shape.iter().product::<usize>() * p.dtype.size();
        out.push(HostTensor::from_bytes(
            p.dtype,
            &p.shape,
            &gathered[..nbytes],
        )?);
        offset += split;
    }
    Ok(out)
}

fn padded_bytes(p: &ShardedParam) -> usize {
    p.padded_numel() * p.dtype.size()
}

/// The group is sharded over exactly `pg`'s ranks.
pub(super) fn check_group(pg: &dyn ProcessGroup, params: &[&ShardedParam]) -> Result<()> {
    let invalid = |reason: String| Error::InvalidArgument {
        op: "fully_shard collective".into(),
        rank: pg.rank(),
        reason,
    };
    for p in params {
        if !p.is_sharded() {
            return Err(invalid(format!("parameter `{}` is not sharded", p.name)));
        }
        if p.world_size != pg.world_size() {
            return Err(invalid(format!(
                "parameter `{}` is laid out for {} ranks, the process group has {}",
                p.name,
                p.world_size,
                pg.world_size()
            )));
        }
    }
    Ok(())
}

/// One local shard per parameter, of its dtype and local shape.
fn check_shards(params: &[&ShardedParam], shards: &[HostTensor], rank: usize) -> Result<()> {
    if params.len() != shards.len() {
        return Err(Error::InvalidArgument {
            op: "foreach_all_gather".into(),
            rank,
            reason: format!("{} shards for {} parameters", shards.len(), params.len()),
        });
    }
    for (p, s) in params.iter().zip(shards) {
        let context = format!("the local shard of `{}` on rank {rank}", p.name);
        if s.dtype() != p.dtype {
            return Err(Error::DtypeMismatch {
                context,
                expected: p.dtype.to_string(),
                found: s.dtype().to_string(),
            });
        }
        let expected = p.local_shape(rank);
        if s.shape() != expected.as_slice() {
            return Err(Error::ShapeMismatch {
                context,
                expected,
                found: s.shape().to_vec(),
            });
        }
    }
    Ok(())
}

/// The result was gathered for these parameters.
fn check_result(result: &AllGatherResult, params: &[&ShardedParam], ws: usize) -> Result<()> {
    let splits: Vec<usize> = params.iter().map(|p| padded_bytes(p)).collect();
    let fits = splits == result.split_bytes
        && splits.iter().sum::<usize>() == result.input_len
        && result.output.len() == result.input_len * ws;
    if fits {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op: "foreach_all_gather_copy_out".into(),
        rank: result.rank,
        reason: format!(
            "the all-gather result ({} bytes, splits {:?}) was not gathered for these {} \
             parameters at {ws} ranks (splits {splits:?})",
            result.output.len(),
            result.split_bytes,
            params.len()
        ),
    })
}
