//! Argument checks every backend makes before a collective, in one place so that the thread,
//! MPI and NCCL groups accept exactly the same calls and word a refusal the same way. Each
//! returns the reason as a `String`; the backend still joins the collective and then fails
//! every rank with [`crate::Error::InvalidCollective`] naming the rank at fault.

use super::{check_reduction, ReduceOp};
use crate::tensor::DType;

/// Outcome of a local argument check: `Err` holds the reason.
pub(crate) type Check = std::result::Result<(), String>;

/// `root` names a rank of a group of `world_size`.
pub(crate) fn root(root: usize, world_size: usize) -> Check {
    if root < world_size {
        Ok(())
    } else {
        Err(format!(
            "root {root} is out of range for world size {world_size}"
        ))
    }
}

/// An all-gather's `recv` holds one `send` per rank.
pub(crate) fn gathered(send: usize, recv: usize, world_size: usize) -> Check {
    match send.checked_mul(world_size) {
        Some(total) if total == recv => Ok(()),
        _ => Err(format!(
            "recv has {recv} bytes, expected send length {send} x world size {world_size}"
        )),
    }
}

/// A gather's root passed a `recv` holding one `send` per rank (other ranks pass `None`, and
/// `is_root` false skips the check for them).
pub(crate) fn gather_root(send: usize, recv: Option<usize>, is_root: bool, ws: usize) -> Check {
    if !is_root {
        return Ok(());
    }
    match recv {
        Some(recv) => gathered(send, recv, ws).map_err(|e| format!("root {e}")),
        None => Err("the root rank must pass a receive buffer".into()),
    }
}

/// A scatter's root passed one part per rank.
pub(crate) fn scatter_root(parts: Option<usize>, is_root: bool, world_size: usize) -> Check {
    match (is_root, parts) {
        (false, _) => Ok(()),
        (true, Some(n)) if n == world_size => Ok(()),
        (true, Some(n)) => Err(format!(
            "root passed {n} parts, expected one per rank ({world_size})"
        )),
        (true, None) => Err("the root rank must pass the parts to send".into()),
    }
}

/// With every rank's receive length (`recv_lens[r]`) and the root's part lengths: each rank
/// receives exactly its part. Checked once the root's parts are known to every rank; the
/// reason, a [`crate::Error::CollectiveMismatch`] detail, names every rank that differs.
pub(crate) fn scatter_lengths(root: usize, recv_lens: &[usize], part_lens: &[usize]) -> Check {
    let wrong: Vec<String> = recv_lens
        .iter()
        .zip(part_lens)
        .enumerate()
        .filter(|(_, (recv, part))| recv != part)
        .map(|(rank, (recv, part))| {
            format!("rank {rank} receives {recv} bytes but root {root} sends it {part}")
        })
        .collect();
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(format!("scatter_into(root={root}): {}", wrong.join("; ")))
    }
}

/// A reduce-scatter's `send` holds one `recv`-sized chunk per rank, of whole `dtype`
/// elements that `op` can combine.
pub(crate) fn reduce_scattered(
    send: usize,
    recv: usize,
    dtype: DType,
    op: ReduceOp,
    world_size: usize,
) -> Check {
    check_reduction(dtype, op, recv)?;
    match recv.checked_mul(world_size) {
        Some(total) if total == send => Ok(()),
        _ => Err(format!(
            "send has {send} bytes, expected recv length {recv} x world size {world_size}"
        )),
    }
}

/// A sub-group's ranks: at least one, each in range, none twice.
pub(crate) fn subgroup(ranks: &[usize], world_size: usize) -> Check {
    if ranks.is_empty() {
        return Err("the sub-group has no ranks".into());
    }
    if let Some(r) = ranks.iter().find(|&&r| r >= world_size) {
        return Err(format!(
            "rank {r} of sub-group {ranks:?} is out of range for world size {world_size}"
        ));
    }
    for (i, r) in ranks.iter().enumerate() {
        if ranks[..i].contains(r) {
            return Err(format!("rank {r} appears twice in sub-group {ranks:?}"));
        }
    }
    Ok(())
}

/// FNV-1a over a sub-group's ranks, in order: ranks compare this digest (the MPI and NCCL
/// backends exchange it instead of the lists), so ranks passing different lists (or orders)
/// disagree.
pub(crate) fn subgroup_digest(ranks: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in ranks {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_check_accepts_the_right_shape_and_names_what_is_wrong() {
        assert!(root(2, 3).is_ok());
        assert_eq!(
            root(3, 3).unwrap_err(),
            "root 3 is out of range for world size 3"
        );

        assert!(gathered(4, 12, 3).is_ok());
        assert_eq!(
            gathered(4, 11, 3).unwrap_err(),
            "recv has 11 bytes, expected send length 4 x world size 3"
        );
        assert!(
            gathered(usize::MAX, 0, 2).is_err(),
            "overflow is a mismatch"
        );

        assert!(gather_root(4, None, false, 3).is_ok());
        assert!(gather_root(4, Some(12), true, 3).is_ok());
        assert_eq!(
            gather_root(4, Some(8), true, 3).unwrap_err(),
            "root recv has 8 bytes, expected send length 4 x world size 3"
        );
        assert!(gather_root(4, None, true, 3)
            .unwrap_err()
            .contains("must pass a receive buffer"));

        assert!(scatter_root(None, false, 3).is_ok());
        assert!(scatter_root(Some(3), true, 3).is_ok());
        assert!(scatter_root(Some(2), true, 3)
            .unwrap_err()
            .contains("root passed 2 parts"));
        assert!(scatter_root(None, true, 3)
            .unwrap_err()
            .contains("must pass the parts"));

        assert!(scatter_lengths(1, &[3, 0, 5], &[3, 0, 5]).is_ok());
        assert_eq!(
            scatter_lengths(1, &[3, 1, 5, 2], &[3, 0, 5, 4]).unwrap_err(),
            "scatter_into(root=1): rank 1 receives 1 bytes but root 1 sends it 0; \
             rank 3 receives 2 bytes but root 1 sends it 4"
        );

        assert!(reduce_scattered(24, 8, DType::F32, ReduceOp::Sum, 3).is_ok());
        assert_eq!(
            reduce_scattered(20, 8, DType::F32, ReduceOp::Sum, 3).unwrap_err(),
            "send has 20 bytes, expected recv length 8 x world size 3"
        );
        assert!(reduce_scattered(18, 6, DType::F32, ReduceOp::Sum, 3)
            .unwrap_err()
            .contains("not a whole number of torch.float32"));
        assert!(reduce_scattered(3, 1, DType::Bool, ReduceOp::Sum, 3).is_err());

        assert!(subgroup(&[1, 0], 2).is_ok());
        assert!(subgroup(&[], 2).unwrap_err().contains("no ranks"));
        assert!(subgroup(&[0, 2], 2).unwrap_err().contains("out of range"));
        assert!(subgroup(&[1, 1], 2).unwrap_err().contains("twice"));
    }

    #[test]
    fn subgroup_digests_depend_on_the_ranks_and_their_order() {
        assert_eq!(subgroup_digest(&[0, 1]), subgroup_digest(&[0, 1]));
        assert_ne!(subgroup_digest(&[0, 1]), subgroup_digest(&[1, 0]));
        assert_ne!(subgroup_digest(&[0, 1]), subgroup_digest(&[0, 2]));
    }
}
