//! [`Solo`]: the one-rank process group. A job run by one process is a group of one, so every
//! driver takes a group and a solo run passes `&Solo`: there is one function per job, not a
//! solo twin beside a group one.

use super::args::{self, Check};
use super::{check_reduction, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::sync::Arc;

/// The process group of a single process: rank 0 of 1. Collectives copy the caller's own
/// buffers and never block; arguments are checked as every backend checks them.
///
/// ```
/// use fsdp::collectives::{ProcessGroup, Solo};
/// assert_eq!((Solo.rank(), Solo.world_size()), (0, 1));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Solo {
    fn checked(op: &str, check: Check) -> Result<()> {
        check.map_err(|reason| Error::InvalidCollective {
            op: op.into(),
            rank: 0,
            reason,
        })
    }
}

impl ProcessGroup for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        Self::checked("all_gather_into", args::gathered(send.len(), recv.len(), 1))?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn broadcast(&self, _buf: &mut [u8], root: usize) -> Result<()> {
        Self::checked("broadcast", args::root(root, 1))
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![send.to_vec()])
    }

    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> Result<Vec<u8>> {
        Self::checked("broadcast_bytes", args::root(root, 1))?;
        match send {
            Some(bytes) => Ok(bytes.to_vec()),
            None => Self::checked(
                "broadcast_bytes",
                Err("the root rank must pass the bytes to send".into()),
            )
            .map(|()| Vec::new()),
        }
    }

    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()> {
        let lens = recv.as_deref().map(<[u8]>::len);
        Self::checked(
            "gather_into",
            args::root(root, 1).and(args::gather_root(send.len(), lens, true, 1)),
        )?;
        if let Some(recv) = recv {
            recv.copy_from_slice(send);
        }
        Ok(())
    }

    fn scatter_into(&self, send: Option<&[&[u8]]>, recv: &mut [u8], root: usize) -> Result<()> {
        let parts = send.map(<[&[u8]]>::len);
        Self::checked(
            "scatter_into",
            args::root(root, 1).and(args::scatter_root(parts, true, 1)),
        )?;
        let part = send.and_then(|p| p.first()).copied().unwrap_or_default();
        Self::checked(
            "scatter_into",
            args::scatter_lengths(root, &[recv.len()], &[part.len()]),
        )?;
        recv.copy_from_slice(part);
        Ok(())
    }

    fn reduce_scatter_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        Self::checked(
            "reduce_scatter_into",
            args::reduce_scattered(send.len(), recv.len(), dtype, op, 1),
        )?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        Self::checked("all_reduce", check_reduction(dtype, op, buf.len()))
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        Self::checked("new_subgroup", args::subgroup(ranks, 1))?;
        Ok(Some(Arc::new(Solo)))
    }

    fn backend(&self) -> &'static str {
        "solo"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::ProcessGroupExt;

    #[test]
    fn a_solo_group_returns_its_own_buffers_and_checks_arguments_as_every_backend() {
        let mut recv = [0u8; 3];
        Solo.all_gather_into(&[1, 2, 3], &mut recv).unwrap();
        assert_eq!(recv, [1, 2, 3]);
        let mut recv = [0u8; 2];
        Solo.scatter_into(Some(&[&[7, 8]]), &mut recv, 0).unwrap();
        assert_eq!(recv, [7, 8]);
        assert!(matches!(
            Solo.all_gather_into(&[1, 2], &mut [0u8; 3]),
            Err(Error::InvalidCollective { .. })
        ));
        assert!(matches!(
            Solo.broadcast(&mut [0u8; 1], 1),
            Err(Error::InvalidCollective { .. })
        ));
        assert!(Solo.new_subgroup(&[0, 0]).is_err());
        // The typed helpers run on it unchanged: agreement of one is the value itself.
        assert_eq!(Solo.agree(Ok::<_, Error>(5u32)).unwrap(), 5);
        assert_eq!(Solo.on_root(|| Ok(3u8)).unwrap(), 3);
    }
}
