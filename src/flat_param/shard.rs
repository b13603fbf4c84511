//! Chunking a flat parameter across ranks and the per-parameter shard info, as
//! `FlatParamHandle._get_shard` and `_get_shard_metadata` compute them.

use serde::{Deserialize, Serialize};

/// Where one original parameter lies in one rank's shard (`_ShardParamInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardParamInfo {
    /// Whether any element of the parameter is in this shard.
    pub in_shard: bool,
    /// Offset of the parameter's first element in the shard (0 when not in the shard).
    pub offset_in_shard: usize,
    /// Number of the parameter's elements in the shard.
    pub numel_in_shard: usize,
    /// First element of the parameter (flattened) held by the shard.
    pub intra_param_start_idx: usize,
    /// Last element of the parameter (flattened) held by the shard, inclusive.
    pub intra_param_end_idx: usize,
}

impl ShardParamInfo {
    /// The info of a parameter with no element in the shard.
    pub const NOT_IN_SHARD: ShardParamInfo = ShardParamInfo {
        in_shard: false,
        offset_in_shard: 0,
        numel_in_shard: 0,
        intra_param_start_idx: 0,
        intra_param_end_idx: 0,
    };

    /// The parameter's element range held by the shard, `[start, end)`.
    pub fn intra_range(&self) -> std::ops::Range<usize> {
        if self.in_shard {
            self.intra_param_start_idx..self.intra_param_end_idx + 1
        } else {
            0..0
        }
    }
}

/// One rank's shard of a flat parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// The rank within the shard group.
    pub rank: usize,
    /// First unsharded element owned (`c * rank`, clipped).
    pub start: usize,
    /// Number of real (unpadded) elements owned.
    pub numel: usize,
    /// Zeros appended on the right so every shard has the same size.
    pub numel_padded: usize,
    /// Per original parameter (no padding entries), where it lies in this shard.
    pub params: Vec<ShardParamInfo>,
}

impl Shard {
    /// Total shard size including right padding (the sharded flat parameter's numel).
    pub fn padded_numel(&self) -> usize {
        self.numel + self.numel_padded
    }
}

/// Chunk size `ceil(n / world_size)` used by `torch.chunk`.
pub(crate) fn chunk_size(n: usize, world_size: usize) -> usize {
    n.div_ceil(world_size.max(1))
}

/// `(start, numel, numel_padded)` of rank `rank`'s chunk of `n` elements, as
/// `FlatParamHandle._get_shard` cuts it: chunk `c = ceil(n / world_size)`, rank `r` owns
/// `[c·r, c·(r+1))` clipped to `n`, right-padded with zeros to `c`.
pub(crate) fn chunk_bounds(n: usize, rank: usize, world_size: usize) -> (usize, usize, usize) {
    let c = chunk_size(n, world_size);
    let start = (c * rank).min(n);
    let end = (c * (rank + 1)).min(n);
    (start, end - start, c - (end - start))
}

/// Shard info of every parameter for the unsharded interval `[start, start + numel)`, given the
/// parameters' `[begin, end]` (inclusive) offsets in the unsharded flat parameter.
pub(crate) fn shard_param_infos(
    offsets: &[(usize, usize)],
    start: usize,
    numel: usize,
) -> Vec<ShardParamInfo> {
    offsets
        .iter()
        .map(|&(pb, pe)| {
            // A parameter with no elements never intersects a shard.
            if numel == 0 || pe < pb {
                return ShardParamInfo::NOT_IN_SHARD;
            }
            let end = start + numel - 1;
            if !(start <= pe && end >= pb) {
                return ShardParamInfo::NOT_IN_SHARD;
            }
            let (intra_start, offset) = if start <= pb {
                (0, pb - start)
            } else {
                (start - pb, 0)
            };
            let intra_end = pe.min(end) - pb;
            ShardParamInfo {
                in_shard: true,
                offset_in_shard: offset,
                numel_in_shard: intra_end - intra_start + 1,
                intra_param_start_idx: intra_start,
                intra_param_end_idx: intra_end,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_ranks_can_be_all_padding() {
        // N=5, ws=4: chunks [0,2) [2,4) [4,5) and an empty fourth chunk.
        assert_eq!(chunk_bounds(5, 0, 4), (0, 2, 0));
        assert_eq!(chunk_bounds(5, 2, 4), (4, 1, 1));
        assert_eq!(chunk_bounds(5, 3, 4), (5, 0, 2));
        // N=6, ws=4: c=2, rank 3 is all padding too.
        assert_eq!(chunk_bounds(6, 3, 4), (6, 0, 2));
    }

    #[test]
    fn shard_info_matches_pytorch_definition() {
        // Two params of 3 and 4 elements, ws=2: c=4; rank 0 holds p0[0..3] and p1[0..1].
        let offsets = [(0, 2), (3, 6)];
        let r0 = shard_param_infos(&offsets, 0, 4);
        assert_eq!(r0[0].intra_range(), 0..3);
        assert_eq!((r0[1].offset_in_shard, r0[1].intra_range()), (3, 0..1));
        let r1 = shard_param_infos(&offsets, 4, 3);
        assert!(!r1[0].in_shard);
        assert_eq!((r1[1].offset_in_shard, r1[1].intra_range()), (0, 1..4));
    }
}
