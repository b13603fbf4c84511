//! Collectives (layer 3): the [`ProcessGroup`] trait the façade communicates through, and its
//! backends. [`ThreadGroup`] runs one rank per thread in one process (tests, single host);
//! [`nccl::NcclProcessGroup`] (feature `nccl`, Linux) runs one rank per CUDA device over NCCL.
//! [`rendezvous`] is how separate processes find each other (`torchrun`-style variables).
//! `MpiProcessGroup` (feature `mpi`) runs one rank per process under `mpirun`.

mod args;
mod failure;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(all(feature = "nccl", target_os = "linux"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "nccl", target_os = "linux"))))]
pub mod nccl;
mod reduce;
pub mod rendezvous;
mod threads;

#[cfg(feature = "mpi")]
#[cfg_attr(docsrs, doc(cfg(feature = "mpi")))]
pub use self::mpi::MpiProcessGroup;
pub use reduce::{check_reduction, reduce_parts, ReduceOp};
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
