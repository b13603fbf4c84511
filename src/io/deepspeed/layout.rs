//! Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks' flat tensors: pure
//! arithmetic from the parameters' element counts and the world size, no I/O, so that every
//! offset, padding and straddle is tested on its own.
//!
//! * ZeRO-1/2 ([`FlatGroup`]): a group's parameters back to back (each followed by its
//!   `param_alignment_paddings` zeros), the whole padded to a multiple of `2 * world_size`
//!   and cut into `world_size` equal partitions; a parameter may straddle ranks.
//! * ZeRO-3 ([`PartitionedGroup`]): every parameter partitioned on its own into
//!   `ceil(numel / world_size)` elements per rank, at the same offset on every rank; the
//!   last ranks' padding is never read.
//!
//! Offsets are in elements. See `tests/golden/deepspeed/FORMAT.md`, sections 4 and 5.

/// A run of one parameter's elements on one rank: elements `start..start + len` of that
/// rank's flat tensor, which are the parameter's elements `at..at + len` (flattened).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The rank holding it.
    pub rank: usize,
    /// First element in the rank's flat tensor.
    pub start: usize,
    /// Elements.
    pub len: usize,
    /// First element of the parameter (flattened) it holds.
    pub at: usize,
}

/// One ZeRO-1/2 param group (also `BF16_Optimizer`'s): its flat buffer and its partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatGroup {
    world_size: usize,
    numels: Vec<usize>,
    /// Offset of each parameter in the flat buffer.
    offsets: Vec<usize>,
    /// Parameters and their alignment paddings: `padded_group_numel`.
    padded: usize,
    /// Elements per rank: `ceil(padded / (2 * ws)) * 2`.
    partition: usize,
}

impl FlatGroup {
    /// The group of parameters of `numels` elements, each followed by `paddings` zeros
    /// (`param_alignment_paddings`, all 0 unless `parameter_alignment` is on; shorter than
    /// `numels` means 0 for the rest), partitioned over `world_size` ranks. `None` when
    /// there is no such layout: a world size of 0, more paddings than parameters, or sizes
    /// that overflow.
    pub fn new(numels: &[usize], paddings: &[usize], world_size: usize) -> Option<Self> {
        if world_size == 0 || paddings.len() > numels.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(numels.len());
        let mut at = 0usize;
        for (i, &n) in numels.iter().enumerate() {
            offsets.push(at);
            let pad = paddings.get(i).copied().unwrap_or(0);
            at = at.checked_add(n)?.checked_add(pad)?;
        }
        let align = world_size.checked_mul(2)?;
        let aligned = at.div_ceil(align).checked_mul(align)?;
        Some(FlatGroup {
            world_size,
            numels: numels.to_vec(),
            offsets,
            padded: at,
            partition: aligned / world_size,
        })
    }

    /// `padded_group_numel`: parameters and alignment paddings.
    pub fn padded_numel(&self) -> usize {
        self.padded
    }

    /// The flat buffer's length, padded to a multiple of `2 * world_size`.
    #[cfg(test)]
    pub fn aligned_numel(&self) -> usize {
        self.partition * self.world_size
    }

    /// Elements per rank (`Pn`): the Adam state's length on every rank.
    pub fn partition_numel(&self) -> usize {
        self.partition
    }

    /// Offset of parameter `i` in the flat buffer.
    #[cfg(test)]
    pub fn offset(&self, i: usize) -> usize {
        self.offsets[i]
    }

    /// `group_paddings[g]` of `rank`: the alignment padding at the end of its partition,
    /// `clamp((rank + 1) * Pn - padded_group_numel, 0, Pn)`.
    pub fn group_padding(&self, rank: usize) -> usize {
        ((rank + 1) * self.partition)
            .saturating_sub(self.padded)
            .min(self.partition)
    }

    /// The length of `single_partition_of_fp32_groups[g]` on `rank` as the ZeRO optimizer
    /// saves it: the partition without its end padding (`BF16_Optimizer` keeps `Pn`).
    pub fn cut_partition_numel(&self, rank: usize) -> usize {
        self.partition - self.group_padding(rank)
    }

    /// The pieces of parameter `i`, in rank order: rank `r` holds the flat elements
    /// `[max(offset, r * Pn), min(offset + numel, (r + 1) * Pn))`.
    pub fn pieces(&self, i: usize) -> Vec<Piece> {
        let (offset, numel) = (self.offsets[i], self.numels[i]);
        let end = offset + numel;
        let p = self.partition;
        if numel == 0 || p == 0 {
            return Vec::new();
        }
        (offset / p..=(end - 1) / p)
            .map(|rank| {
                let lo = offset.max(rank * p);
                let hi = end.min((rank + 1) * p);
                Piece {
                    rank,
                    start: lo - rank * p,
                    len: hi - lo,
                    at: lo - offset,
                }
            })
            .collect()
    }

    /// The elements of `rank`'s partition the parameters need (the end of the last piece
    /// on it; 0 when it holds none).
    pub fn needed(&self, rank: usize) -> usize {
        let p = self.partition;
        let used_end = self
            .offsets
            .iter()
            .zip(&self.numels)
            .filter(|(_, &n)| n > 0)
            .map(|(&o, &n)| o + n)
            .max()
            .unwrap_or(0);
        used_end.saturating_sub(rank * p).min(p)
    }

    /// `param_slice_mappings[g]` of `rank` as DeepSpeed writes it: for each parameter with
    /// elements in the partition, in flat order, its index, `numel` and `start` (in the
    /// partition).
    pub fn slice_mappings(&self, rank: usize) -> Vec<(usize, usize, usize)> {
        (0..self.numels.len())
            .filter_map(|i| {
                self.pieces(i)
                    .into_iter()
                    .find(|piece| piece.rank == rank)
                    .map(|piece| (i, piece.len, piece.start))
            })
            .collect()
    }
}

/// One ZeRO-3 sub-group: each parameter partitioned on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionedGroup {
    world_size: usize,
    numels: Vec<usize>,
    /// Elements per rank of each parameter: `ceil(numel / ws)`.
    per_rank: Vec<usize>,
    /// Offset of each parameter in every rank's flat tensor.
    offsets: Vec<usize>,
}

impl PartitionedGroup {
    /// The sub-group of parameters of `numels` elements over `world_size` ranks; `None` for
    /// a world size of 0 or sizes that overflow.
    pub fn new(numels: &[usize], world_size: usize) -> Option<Self> {
        if world_size == 0 {
            return None;
        }
        let per_rank: Vec<usize> = numels.iter().map(|n| n.div_ceil(world_size)).collect();
        let mut offsets = Vec::with_capacity(numels.len());
        let mut at = 0usize;
        for &pn in &per_rank {
            offsets.push(at);
            at = at.checked_add(pn)?;
        }
        // Every rank's element range of every parameter must be computable.
        for (&n, &pn) in numels.iter().zip(&per_rank) {
            pn.checked_mul(world_size)?;
            n.checked_add(pn)?;
        }
        Some(PartitionedGroup {
            world_size,
            numels: numels.to_vec(),
            per_rank,
            offsets,
        })
    }

    /// Elements of every rank's flat tensor: the sum of `ceil(numel / ws)`.
    pub fn partition_numel(&self) -> usize {
        self.per_rank.iter().sum()
    }

    /// Offset of parameter `i` in every rank's flat tensor.
    #[cfg(test)]
    pub fn offset(&self, i: usize) -> usize {
        self.offsets[i]
    }

    /// Elements per rank of parameter `i`.
    #[cfg(test)]
    pub fn per_rank(&self, i: usize) -> usize {
        self.per_rank[i]
    }

    /// The pieces of parameter `i`, in rank order: rank `r` holds its elements
    /// `[r * pn, min((r + 1) * pn, numel))` at the parameter's offset; a rank whose share is
    /// all padding holds no piece.
    pub fn pieces(&self, i: usize) -> Vec<Piece> {
        let (numel, pn, offset) = (self.numels[i], self.per_rank[i], self.offsets[i]);
        (0..self.world_size)
            .filter_map(|rank| {
                let lo = rank * pn;
                let hi = ((rank + 1) * pn).min(numel);
                (lo < hi).then(|| Piece {
                    rank,
                    start: offset,
                    len: hi - lo,
                    at: lo,
                })
            })
            .collect()
    }

    /// The elements of `rank`'s flat tensor the parameters need (padding is not needed).
    pub fn needed(&self, rank: usize) -> usize {
        (0..self.numels.len())
            .flat_map(|i| self.pieces(i))
            .filter(|p| p.rank == rank)
            .map(|p| p.start + p.len)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rank: usize, start: usize, len: usize, at: usize) -> Piece {
        Piece {
            rank,
            start,
            len,
            at,
        }
    }

    /// The fixtures' groups at world size 2 (`case.json` `layout` of zero2_fp32).
    #[test]
    fn zero2_fixture_groups_at_world_size_2() {
        // emb.weight 444, fc1.weight 276, head.weight 115.
        let g0 = FlatGroup::new(&[444, 276, 115], &[0, 0, 0], 2).unwrap();
        assert_eq!(
            (g0.padded_numel(), g0.aligned_numel(), g0.partition_numel()),
            (835, 836, 418)
        );
        assert_eq!([g0.offset(0), g0.offset(1), g0.offset(2)], [0, 444, 720]);
        // emb.weight straddles: rank 0 holds 0..418, rank 1 the other 26.
        assert_eq!(g0.pieces(0), [piece(0, 0, 418, 0), piece(1, 0, 26, 418)]);
        assert_eq!(g0.pieces(1), [piece(1, 26, 276, 0)]);
        assert_eq!(g0.pieces(2), [piece(1, 302, 115, 0)]);
        assert_eq!([g0.group_padding(0), g0.group_padding(1)], [0, 1]);
        assert_eq!(
            [g0.cut_partition_numel(0), g0.cut_partition_numel(1)],
            [418, 417]
        );
        assert_eq!([g0.needed(0), g0.needed(1)], [418, 417]);
        assert_eq!(g0.slice_mappings(0), [(0, 418, 0)]);
        assert_eq!(
            g0.slice_mappings(1),
            [(0, 26, 0), (1, 276, 26), (2, 115, 302)]
        );

        // fc1.bias, norm.weight, norm.bias 23 each, shift 3, logit_scale 1.
        let g1 = FlatGroup::new(&[23, 23, 23, 3, 1], &[], 2).unwrap();
        assert_eq!(
            (g1.padded_numel(), g1.aligned_numel(), g1.partition_numel()),
            (73, 76, 38)
        );
        assert_eq!(g1.pieces(1), [piece(0, 23, 15, 0), piece(1, 0, 8, 15)]);
        assert_eq!(g1.pieces(4), [piece(1, 34, 1, 0)]);
        assert_eq!([g1.group_padding(0), g1.group_padding(1)], [0, 3]);
        assert_eq!(
            g1.slice_mappings(1),
            [(1, 8, 0), (2, 23, 8), (3, 3, 31), (4, 1, 34)]
        );
    }

    #[test]
    fn a_parameter_can_span_three_ranks_and_a_rank_can_be_all_padding() {
        // 10 elements at ws 4: aligned to 16, Pn 4; rank 3 holds padding only.
        let g = FlatGroup::new(&[1, 9], &[], 4).unwrap();
        assert_eq!((g.aligned_numel(), g.partition_numel()), (16, 4));
        assert_eq!(
            g.pieces(1),
            [piece(0, 1, 3, 0), piece(1, 0, 4, 3), piece(2, 0, 2, 7)]
        );
        assert_eq!(
            (0..4).map(|r| g.group_padding(r)).collect::<Vec<_>>(),
            [0, 0, 2, 4]
        );
        assert_eq!(g.cut_partition_numel(3), 0);
        assert_eq!(
            (0..4).map(|r| g.needed(r)).collect::<Vec<_>>(),
            [4, 4, 2, 0]
        );
        // The pieces of every parameter tile it exactly once, in order.
        for i in 0..2 {
            let mut at = 0;
            for p in g.pieces(i) {
                assert_eq!(p.at, at);
                at += p.len;
            }
            assert_eq!(at, [1, 9][i]);
        }
    }

    #[test]
    fn alignment_paddings_move_the_following_parameters() {
        // parameter_alignment: 3 elements then 1 zero, 5 elements.
        let g = FlatGroup::new(&[3, 5], &[1, 0], 1).unwrap();
        assert_eq!(
            (g.offset(1), g.padded_numel(), g.aligned_numel()),
            (4, 9, 10)
        );
        assert_eq!(g.pieces(1), [piece(0, 4, 5, 0)]);
        assert_eq!(g.group_padding(0), 1);
        assert!(FlatGroup::new(&[3], &[1, 2], 1).is_none());
    }

    #[test]
    fn empty_parameters_and_world_size_one() {
        let g = FlatGroup::new(&[0, 4], &[], 1).unwrap();
        assert!(g.pieces(0).is_empty());
        assert_eq!(g.pieces(1), [piece(0, 0, 4, 0)]);
        assert_eq!(g.partition_numel(), 4);
        assert!(FlatGroup::new(&[1], &[], 0).is_none());
        assert!(FlatGroup::new(&[usize::MAX, 1], &[], 1).is_none());
        assert!(PartitionedGroup::new(&[1], 0).is_none());
    }

    /// The fixtures' ZeRO-3 sub-groups at world size 2 (FORMAT.md section 5).
    #[test]
    fn zero3_fixture_groups_at_world_size_2() {
        let g0 = PartitionedGroup::new(&[444, 276, 115], 2).unwrap();
        assert_eq!(g0.partition_numel(), 418);
        assert_eq!([g0.offset(0), g0.offset(1), g0.offset(2)], [0, 222, 360]);
        assert_eq!(g0.pieces(0), [piece(0, 0, 222, 0), piece(1, 0, 222, 222)]);
        // head.weight: rank 1 holds 57 elements and 1 padding, never read.
        assert_eq!(g0.pieces(2), [piece(0, 360, 58, 0), piece(1, 360, 57, 58)]);
        assert_eq!([g0.needed(0), g0.needed(1)], [418, 417]);

        let g1 = PartitionedGroup::new(&[23, 23, 23, 3, 1], 2).unwrap();
        assert_eq!(g1.partition_numel(), 39);
        assert_eq!(
            (0..5).map(|i| g1.offset(i)).collect::<Vec<_>>(),
            [0, 12, 24, 36, 38]
        );
        assert_eq!(g1.pieces(3), [piece(0, 36, 2, 0), piece(1, 36, 1, 2)]);
        // logit_scale: rank 1's share is padding only.
        assert_eq!(g1.pieces(4), [piece(0, 38, 1, 0)]);
        assert_eq!(g1.needed(1), 37);
    }

    #[test]
    fn zero3_pieces_tile_every_parameter() {
        for ws in 1..6 {
            let numels = [0, 1, 5, 7, 12, 13];
            let g = PartitionedGroup::new(&numels, ws).unwrap();
            for (i, &n) in numels.iter().enumerate() {
                let mut at = 0;
                for p in g.pieces(i) {
                    assert_eq!((p.at, p.start), (at, g.offset(i)), "ws {ws} param {i}");
                    assert!(p.len <= g.per_rank(i));
                    at += p.len;
                }
                assert_eq!(at, n, "ws {ws} param {i}");
            }
        }
    }
}
