//! Collectives (layer 3): the [`ProcessGroup`] trait the façade communicates through, and its
//! backends. [`Solo`] is the group of one process (a solo run of any driver). [`ThreadGroup`] runs one rank per thread in one process (tests, single host);
//! `nccl::NcclProcessGroup` (feature `nccl`, Linux) runs one rank per CUDA device over NCCL.
//! [`rendezvous`] is how separate processes find each other (`torchrun`-style variables), over
//! its own listener or torchrun's agent store, a c10d `TCPStore` ([`tcp_store`]).
//! `MpiProcessGroup` (feature `mpi`) runs one rank per process under `mpirun`.

mod args;
mod call;
mod failure;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(all(feature = "nccl", target_os = "linux"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "nccl", target_os = "linux"))))]
pub mod nccl;
mod net;
mod reduce;
pub mod rendezvous;
mod solo;
pub mod tcp_store;
mod threads;

#[cfg(feature = "mpi")]
#[cfg_attr(docsrs, doc(cfg(feature = "mpi")))]
pub use self::mpi::MpiProcessGroup;
pub use reduce::{check_reduction, reduce_parts, ReduceOp};
pub use solo::Solo;
pub use threads::{ThreadGroup, ThreadProcessGroup};

use crate::error::{Error, Result};
use crate::tensor::DType;
use serde::{de::DeserializeOwned, Serialize};
use std::sync::Arc;

/// A group of ranks that run the same sequence of collective calls.
///
/// Every method is collective: all ranks of the group must call it, in the same order, with
/// compatible arguments. A backend returns an error (never hangs forever, never panics) when
/// ranks disagree, a peer leaves, or the configured timeout expires.
pub trait ProcessGroup: Send + Sync {
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Gathers every rank's `send` (all the same length) into `recv`, rank `r`'s bytes at
    /// `recv[r * send.len()..]` (`all_gather_into_tensor`). `recv.len()` must be
    /// `send.len() * world_size()`.
    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> Result<()>;

    /// Copies root's `buf` into every rank's `buf` (all the same length).
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()>;

    /// Gathers variable-length byte strings from every rank, in rank order.
    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Sends root's bytes (length decided by root) to every rank; non-root ranks pass `None`.
    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> Result<Vec<u8>>;

    /// Gathers every rank's `send` (all the same length) into the root's `recv`, rank `r`'s
    /// bytes at `recv[r * send.len()..]` (`gather`, the rank-0-only half of an all-gather).
    /// The root passes `Some` buffer of `send.len() * world_size()` bytes, the others `None`.
    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()>;

    /// Sends part `r` of the root's `send` to rank `r`, which receives it into `recv`
    /// (`scatter` with per-rank lengths: `recv.len()` on rank `r` must equal the length of the
    /// root's part `r`). The root passes `Some` slice of `world_size()` parts, the others
    /// `None`. Parts may alias one another, so a root can send one buffer to every rank.
    fn scatter_into(&self, send: Option<&[&[u8]]>, recv: &mut [u8], root: usize) -> Result<()>;

    /// Reduces chunk `r` of every rank's `send` into rank `r`'s `recv`
    /// (`reduce_scatter_tensor`): `send.len()` must be `recv.len() * world_size()`, both whole
    /// `dtype` elements. Values combine in rank order as [`reduce_parts`] defines, so every
    /// backend gives the same bits.
    ///
    /// The provided implementation all-gathers every rank's `send` (`world_size()` times its
    /// memory) and reduces locally; backends override it with a direct reduce-scatter.
    fn reduce_scatter_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let ws = self.world_size();
        let n = recv.len();
        let mut gathered = vec![0u8; send.len().saturating_mul(ws)];
        // Join the gather even with bad local arguments, so that peers never wait for us.
        self.all_gather_into(send, &mut gathered)?;
        let invalid = |reason: String| Error::InvalidCollective {
            op: "reduce_scatter_into".into(),
            rank: self.rank(),
            reason,
        };
        args::reduce_scattered(send.len(), n, dtype, op, ws).map_err(invalid)?;
        let me = self.rank();
        let parts: Vec<&[u8]> = (0..ws)
            .map(|r| &gathered[r * send.len() + me * n..][..n])
            .collect();
        reduce_parts(dtype, op, &parts, recv).map_err(invalid)
    }

    /// Reduces every rank's `buf` (all the same length, whole `dtype` elements) and leaves the
    /// result in every rank's `buf` (`all_reduce`), combined in rank order as [`reduce_parts`]
    /// defines.
    ///
    /// The provided implementation all-gathers (`world_size()` times the buffer's memory).
    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let ws = self.world_size();
        let n = buf.len();
        let mut gathered = vec![0u8; n.saturating_mul(ws)];
        self.all_gather_into(buf, &mut gathered)?;
        let parts: Vec<&[u8]> = if n == 0 {
            vec![&[]; ws]
        } else {
            gathered.chunks_exact(n).collect()
        };
        reduce_parts(dtype, op, &parts, buf).map_err(|reason| Error::InvalidCollective {
            op: "all_reduce".into(),
            rank: self.rank(),
            reason,
        })
    }

    /// Blocks until every rank has arrived.
    fn barrier(&self) -> Result<()>;

    /// Creates the sub-group of `ranks` (collective over this group: every rank calls it with
    /// the same list). Returns `None` on ranks outside the sub-group.
    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>>;

    /// Name of the backend, for messages.
    fn backend(&self) -> &'static str;
}

/// Typed object exchange on top of any [`ProcessGroup`], serialized with serde + bincode.
pub trait ProcessGroupExt: ProcessGroup {
    /// `all_gather_object`: every rank's value, in rank order.
    fn all_gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let bytes = encode(value)?;
        self.all_gather_bytes(&bytes)?
            .iter()
            .map(|b| decode(b))
            .collect()
    }

    /// `broadcast_object_list` of one object: root passes `Some`, the others `None`.
    fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T> {
        let bytes = match value {
            Some(v) if self.rank() == root => Some(encode(v)?),
            None if self.rank() == root => {
                // Join the broadcast without bytes so that the backend fails every rank at
                // once instead of leaving the peers waiting for the timeout.
                self.broadcast_bytes(None, root)?;
                return Err(Error::InvalidCollective {
                    op: "broadcast_object".into(),
                    rank: self.rank(),
                    reason: "the root rank must pass the object".into(),
                });
            }
            _ => None,
        };
        decode(&self.broadcast_bytes(bytes.as_deref(), root)?)
    }

    /// Every rank learns the first failure: all-gathers whether each rank's `local` outcome
    /// failed and returns, on every rank, the error of the lowest failing rank; when no rank
    /// failed, each keeps its own value. One small all-gather (only errors travel), so ranks
    /// that checked their inputs locally fail together instead of some waiting in the next
    /// collective for a peer that already gave up.
    fn agree<T>(&self, local: Result<T>) -> Result<T> {
        let failed: Option<Error> = local.as_ref().err().cloned();
        match self
            .all_gather_object(&failed)?
            .into_iter()
            .flatten()
            .next()
        {
            Some(first) => Err(first),
            None => local,
        }
    }

    /// [`ProcessGroupExt::all_gather_object`] of each rank's outcome: every rank's value in
    /// rank order, or, on every rank, the error of the lowest failing rank. One all-gather.
    fn all_gather_agreed<T: Serialize + DeserializeOwned>(
        &self,
        local: Result<T>,
    ) -> Result<Vec<T>> {
        self.all_gather_object(&local)?.into_iter().collect()
    }

    /// [`ProcessGroupExt::broadcast_object`] of the root's outcome: the root passes `Some`
    /// result, the others `None`; every rank gets the root's value, or the root's error.
    fn broadcast_agreed<T: Serialize + DeserializeOwned>(
        &self,
        outcome: Option<&Result<T>>,
        root: usize,
    ) -> Result<T> {
        self.broadcast_object(outcome, root)?
    }

    /// Runs `f` on rank 0 alone (the others wait) and gives every rank its value, or its
    /// error: work one process must do for all, such as preparing a shared output.
    fn on_root<T: Serialize + DeserializeOwned>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.rank() == 0 {
            self.broadcast_agreed(Some(&f()), 0)
        } else {
            self.broadcast_agreed(None, 0)
        }
    }
}

impl<P: ProcessGroup + ?Sized> ProcessGroupExt for P {}

fn codec() -> impl bincode::config::Config {
    bincode::config::standard()
}

/// Serializes a value as the collectives exchange it.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(value, codec()).map_err(|e| Error::Serialization {
        what: std::any::type_name::<T>().into(),
        reason: e.to_string(),
    })
}

/// Deserializes a value exchanged by the collectives.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let (v, used) =
        bincode::serde::decode_from_slice(bytes, codec()).map_err(|e| Error::Serialization {
            what: std::any::type_name::<T>().into(),
            reason: e.to_string(),
        })?;
    if used != bytes.len() {
        return Err(Error::Serialization {
            what: std::any::type_name::<T>().into(),
            reason: format!("{} trailing bytes", bytes.len() - used),
        });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error rank `rank` fails with in these scenarios.
    fn failure(rank: usize) -> Error {
        Error::InvalidArgument {
            op: "load".into(),
            rank,
            reason: "its input is bad".into(),
        }
    }

    /// Each rank's local outcome: an error on the ranks in `failing`, else its rank times 10.
    fn outcome(rank: usize, failing: &[usize]) -> Result<usize> {
        if failing.contains(&rank) {
            Err(failure(rank))
        } else {
            Ok(rank * 10)
        }
    }

    #[test]
    fn agree_gives_every_rank_the_error_of_the_one_failing_rank() {
        let results = ThreadGroup::run(3, |pg| pg.agree(outcome(pg.rank(), &[2])));
        for result in results {
            assert_eq!(result, Err(failure(2)));
        }
    }

    #[test]
    fn agree_gives_every_rank_the_lowest_failing_ranks_error() {
        let results = ThreadGroup::run(4, |pg| pg.agree(outcome(pg.rank(), &[3, 1])));
        for result in results {
            assert_eq!(result, Err(failure(1)));
        }
    }

    #[test]
    fn agree_without_failures_leaves_each_rank_its_own_value() {
        let results = ThreadGroup::run(3, |pg| pg.agree(outcome(pg.rank(), &[])));
        assert_eq!(results, [Ok(0), Ok(10), Ok(20)]);
    }

    #[test]
    fn agree_reports_a_failed_exchange_itself() {
        // Rank 1 leaves the group without joining: the exchange fails with PeerDied.
        let results = ThreadGroup::run(2, |pg| {
            if pg.rank() == 1 {
                drop(pg);
                return None;
            }
            Some(pg.agree(outcome(0, &[])))
        });
        assert!(
            matches!(results[0], Some(Err(Error::PeerDied { peer: 1, .. }))),
            "{:?}",
            results[0]
        );
    }

    #[test]
    fn all_gather_agreed_gives_all_values_or_the_lowest_failing_ranks_error() {
        let values = ThreadGroup::run(3, |pg| pg.all_gather_agreed(outcome(pg.rank(), &[])));
        for v in values {
            assert_eq!(v, Ok(vec![0, 10, 20]));
        }
        let errors = ThreadGroup::run(3, |pg| pg.all_gather_agreed(outcome(pg.rank(), &[2, 1])));
        for e in errors {
            assert_eq!(e, Err(failure(1)));
        }
    }

    #[test]
    fn broadcast_agreed_gives_every_rank_the_roots_value_or_its_error() {
        for failing in [&[][..], &[1]] {
            let results = ThreadGroup::run(3, |pg| {
                let root_outcome = outcome(1, failing);
                pg.broadcast_agreed((pg.rank() == 1).then_some(&root_outcome), 1)
            });
            for result in results {
                let want = if failing == [1] {
                    Err(failure(1))
                } else {
                    Ok(10)
                };
                assert_eq!(result, want, "failing {failing:?}");
            }
        }
    }

    #[test]
    fn on_root_runs_the_work_on_rank_0_alone_and_every_rank_gets_its_outcome() {
        for failing in [&[][..], &[0]] {
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let results = ThreadGroup::run(3, |pg| {
                pg.on_root(|| {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    outcome(0, failing)
                })
            });
            assert_eq!(calls.into_inner(), 1, "failing {failing:?}");
            for result in results {
                let want = if failing == [0] {
                    Err(failure(0))
                } else {
                    Ok(0)
                };
                assert_eq!(result, want, "failing {failing:?}");
            }
        }
    }
}
