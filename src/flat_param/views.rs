//! Flatten and unflatten any tensor with a flat parameter's layout (`flatten_tensors`,
//! `_get_unflat_views`), generic over the tensor backend.

use super::{FlatParamLayout, ShardPiece};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Concatenates one tensor per member (any shape with the member's element count) into the
/// unsharded flat tensor, inserting zeros where the layout has padding.
pub(crate) fn flatten_full<T: Tensor>(layout: &FlatParamLayout, per_member: &[T]) -> Result<T> {
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

/// `flatten_full` right-padded with zeros to [`FlatParamLayout::padded_numel`]: the
/// unsharded buffer that all-gathering every rank's shard fills, and that a reduce-scatter
/// (`reduce_scatter_tensor`) of per-member gradients reads, rank `r`'s shard being elements
/// `[r * c, (r + 1) * c)` with `c = shard_numel()`.
///
/// Alignment padding (`use_orig_params=True`) and the right padding are zeros, so gradients
/// reduce-scattered from this buffer are zero in every padding element. Errors as
/// `flatten_full`.
pub fn flatten_padded<T: Tensor>(layout: &FlatParamLayout, per_member: &[T]) -> Result<T> {
    let flat = flatten_full(layout, per_member)?;
    let pad = layout.padded_numel().saturating_sub(flat.numel());
    if pad == 0 {
        return Ok(flat);
    }
    let zeros = T::zeros(flat.dtype(), &[pad])?;
    T::cat_flat(&[flat, zeros])
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

/// Rank `rank`'s padded shard of a flat tensor, assembled from per-member tensors without
/// materializing the unsharded flat tensor (one copy, none when the shard is one piece).
///
/// `member(m)` gives member `m`'s flattened values and the member element its first value
/// stands for (0 for a whole member, `intra_param_start_idx` for a rank's view); `None` is
/// zeros. Padding is zeros of `dtype`.
pub(crate) fn shard_from_members<'a, T: Tensor>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat_param::ModelLayout;
    use crate::model::{ModelDesc, WrapPolicy};
    use crate::tensor::HostTensor;

    /// Per-member tensors with distinct nonzero values (member `m`, element `i`: `m*100+i+1`).
    fn members(fl: &FlatParamLayout) -> Vec<HostTensor> {
        fl.members
            .iter()
            .enumerate()
            .map(|(m, mem)| {
                let v: Vec<f32> = (0..mem.numel).map(|i| (m * 100 + i + 1) as f32).collect();
                HostTensor::from_slice(&v, &mem.shape).unwrap()
            })
            .collect()
    }

    fn model() -> ModelDesc {
        ModelDesc::new()
            .param("a.w", &[3, 3], DType::F32)
            .param("a.b", &[3], DType::F32)
            .param("c.w", &[5], DType::F32)
    }

    #[test]
    fn flatten_padded_chunks_are_the_shards_and_unflatten_back() {
        for orig in [false, true] {
            for ws in [1, 2, 3, 4, 7, 20] {
                let policy = WrapPolicy::units(&[""]).with_orig_params(orig);
                let layout = ModelLayout::new(&model(), &policy, ws).unwrap();
                let fl = &layout.flat_params[0];
                let per_member = members(fl);
                let padded = flatten_padded(fl, &per_member).unwrap();
                assert_eq!(padded.shape(), [fl.padded_numel()], "orig {orig} ws {ws}");
                assert_eq!(padded.numel(), fl.shard_numel() * ws);
                let c = fl.shard_numel();
                for r in 0..ws {
                    let chunk = padded.narrow_flat(r * c, c).unwrap();
                    let shard =
                        shard_from_members(fl, r, DType::F32, |m| Some((&per_member[m], 0)))
                            .unwrap();
                    assert!(chunk.bit_eq(&shard), "orig {orig} ws {ws} rank {r}");
                }
                // Everything outside the members is zero padding.
                let total: f64 = padded.to_f64_vec().iter().sum();
                let want: f64 = per_member.iter().flat_map(|t| t.to_f64_vec()).sum();
                assert_eq!(total, want);
                for (back, orig_t) in unflatten_full(fl, &padded).unwrap().iter().zip(&per_member) {
                    assert!(back.bit_eq(orig_t));
                }
            }
        }
    }

    #[test]
    fn flatten_padded_rejects_wrong_members() {
        let layout = ModelLayout::new(&model(), &WrapPolicy::units(&[""]), 4).unwrap();
        let fl = &layout.flat_params[0];
        let per_member = members(fl);
        assert!(matches!(
            flatten_padded(fl, &per_member[..2]),
            Err(Error::Flatten { .. })
        ));
        let mut wrong = per_member.clone();
        wrong[1] = HostTensor::zeros(DType::F32, &[4]);
        assert!(matches!(
            flatten_padded(fl, &wrong),
            Err(Error::ShapeMismatch { .. })
        ));
        wrong[1] = HostTensor::zeros(DType::F64, &[3]);
        assert!(matches!(
            flatten_padded(fl, &wrong),
            Err(Error::DtypeMismatch { .. })
        ));
    }
}
