//! Flatten and unflatten any tensor with a flat parameter's layout (`flatten_tensors`,
//! `_get_unflat_views`), generic over the tensor backend.

use super::{FlatParamLayout, ShardPiece};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Concatenates one tensor per member (any shape with the member's element count) into the
/// unsharded flat tensor, inserting zeros where the layout has padding.
pub fn flatten_full<T: Tensor>(layout: &FlatParamLayout, per_member: &[T]) -> Result<T> {
    if per_member.len() != layout.members.len() {
        return Err(Error::Flatten {
            unit: layout.unit.clone(),
            reason: format!(
                "expected {} member tensors, got {}",
                layout.members.len(),
                per_member.len()
            ),
        });
    }
    let dtype = per_member.first().map_or(layout.dtype, Tensor::dtype);
    let mut parts = Vec::with_capacity(layout.numels_with_padding.len());
    let mut m = 0;
    for (&n, &pad) in layout
        .numels_with_padding
        .iter()
        .zip(&layout.is_padding_mask)
    {
        if pad {
            parts.push(T::zeros(dtype, &[n])?);
            continue;
        }
        let t = &per_member[m];
        if t.numel() != n {
            return Err(Error::ShapeMismatch {
                context: format!("flattening `{}`", layout.members[m].fqn),
                expected: layout.members[m].shape.clone(),
                found: t.shape(),
            });
        }
        if t.dtype() != dtype {
            return Err(Error::DtypeMismatch {
                context: format!("flattening `{}`", layout.members[m].fqn),
                expected: dtype.to_string(),
                found: t.dtype().to_string(),
            });
        }
        parts.push(t.reshape(&[n])?);
        m += 1;
    }
    T::cat_flat(&parts)
}

/// Splits an unsharded flat tensor (at least `unpadded_numel` elements; more is right padding)
/// into one view per member with the member's shape, skipping padding.
pub fn unflatten_full<T: Tensor>(layout: &FlatParamLayout, flat: &T) -> Result<Vec<T>> {
    if flat.numel() < layout.unpadded_numel {
        return Err(Error::ShapeMismatch {
            context: format!("unflattening flat parameter of unit `{}`", layout.unit),
            expected: vec![layout.unpadded_numel],
            found: flat.shape(),
        });
    }
    layout
        .members
        .iter()
        .map(|m| flat.narrow_flat(m.offset, m.numel)?.reshape(&m.shape))
        .collect()
}

/// Rank `rank`'s padded shard of an unsharded flat tensor of `unpadded_numel` elements.
pub fn shard_of_full<T: Tensor>(layout: &FlatParamLayout, flat: &T, rank: usize) -> Result<T> {
    let shard = layout.shard(rank);
    let owned = flat.narrow_flat(shard.start, shard.numel)?;
    if shard.numel_padded == 0 {
        return Ok(owned);
    }
    let pad = T::zeros(flat.dtype(), &[shard.numel_padded])?;
    T::cat_flat(&[owned, pad])
}

/// Rank `rank`'s padded shard of a flat tensor, assembled from per-member tensors without
/// materializing the unsharded flat tensor (one copy, none when the shard is one piece).
///
/// `member(m)` gives member `m`'s flattened values and the member element its first value
/// stands for (0 for a whole member, `intra_param_start_idx` for a rank's view); `None` is
/// zeros. Padding is zeros of `dtype`.
pub fn shard_from_members<'a, T: Tensor>(
    layout: &FlatParamLayout,
    rank: usize,
    dtype: DType,
    member: impl Fn(usize) -> Option<(&'a T, usize)>,
) -> Result<T> {
    let mut parts = Vec::new();
    for piece in layout.shard_pieces(rank) {
        parts.push(match piece {
            ShardPiece::Padding(len) => T::zeros(dtype, &[len])?,
            ShardPiece::Member {
                member: m,
                start,
                len,
            } => match member(m) {
                None => T::zeros(dtype, &[len])?,
                Some((t, first)) => {
                    let at = start.checked_sub(first).ok_or_else(|| Error::OutOfBounds {
                        context: format!("shard of `{}`", layout.members[m].fqn),
                        start,
                        end: start + len,
                        numel: t.numel(),
                    })?;
                    t.narrow_flat(at, len)?
                }
            },
        });
    }
    match parts.len() {
        0 => T::zeros(dtype, &[0]),
        1 => Ok(parts.pop().expect("one part")),
        _ => T::cat_flat(&parts),
    }
}
