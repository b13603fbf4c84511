//! MPI backend (feature `mpi`): one rank per process, collectives over an MPI communicator (see
//! [`MpiProcessGroup`]).

use super::call::{Announcement, Call, Members};
use super::failure::FailureKind;
use super::{args, check_reduction, reduce_parts, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::DType;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::{Count, Threading};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

const BACKEND: &str = "mpi";

/// A process group over MPI: one rank per process, started by `mpirun`.
///
/// ```no_run
/// use fsdp::collectives::{MpiProcessGroup, ProcessGroup};
/// use std::sync::Arc;
///
/// // `mpirun --allow-run-as-root --oversubscribe -np 4 ./my-trainer`
/// let pg = Arc::new(MpiProcessGroup::world()?);
/// println!("rank {} of {}", pg.rank(), pg.world_size());
/// // let fsdp = fsdp::Fsdp::new(&model, &policy, pg.clone())?;
/// # Ok::<(), fsdp::Error>(())
/// ```
///
/// # Initialization and finalization
///
/// The first [`MpiProcessGroup::world`] of a process initializes MPI (`MPI_Init_thread`,
/// requesting `MPI_THREAD_MULTIPLE`) and duplicates `MPI_COMM_WORLD`, so the crate's traffic
/// never mixes with other users of the world communicator; later calls, while a handle is
/// alive, return another handle on the same communicator (collectives through either belong
/// to one sequence). Started without `mpirun`, MPI's singleton initialization makes a world of
/// size 1.
///
/// MPI is finalized (`MPI_Finalize`) when the last handle of the process — world handles and
/// sub-groups alike — is dropped. Keep one handle alive for the whole run, ideally owned by
/// `main` so that finalization runs on the thread that initialized MPI, as the MPI standard
/// asks; a process that exits without dropping it (`std::process::exit`, a leaked handle)
/// skips `MPI_Finalize` and `mpirun` reports it. When the last handle is dropped while its
/// thread panics, `MPI_Finalize` is skipped on purpose: it waits for every process, so peers
/// blocked in a collective would hang the job; without it `mpirun` ends the job at once. MPI cannot be initialized twice in one
/// process, so [`MpiProcessGroup::world`] after finalization fails with
/// [`Error::BackendUnavailable`]. When something else initialized MPI before the first
/// `world()`, the crate uses that MPI and leaves its finalization to the initializer.
///
/// # Threads
///
/// Handles are `Send + Sync`. Each communicator is guarded by a mutex held for a whole
/// collective, so calls from several threads on one handle are serialized; they must still
/// reach it in the same order on every process, so use a handle from one thread at a time.
/// When the MPI library provides less than `MPI_THREAD_MULTIPLE` (but at least
/// `MPI_THREAD_SERIALIZED`), one process-wide lock additionally serializes every MPI call of
/// the crate, sub-groups included.
///
/// # Agreement and failures
///
/// Every collective first all-gathers a small descriptor (operation, sizes, root, sub-group
/// digest, message limit, whether the local arguments are valid), so that ranks calling
/// different collectives, or the same one with incompatible lengths, get
/// [`Error::CollectiveMismatch`] on every rank, and invalid arguments on one rank get
/// [`Error::InvalidCollective`] (naming that rank and its reason) on every rank — as with the
/// thread backend, never a hang or an MPI abort. After such a failure the communicator is
/// *poisoned*: every later call on it fails immediately with an error of the same kind.
/// Sub-groups have their own communicator and failure state.
///
/// Unlike the thread backend, there is no timeout: MPI collectives cannot be cancelled, and a
/// process that dies makes `mpirun` end the job. Errors inside the MPI library are fatal to the
/// job (`MPI_ERRORS_ARE_FATAL`); the descriptor exchange exists so that misuse never reaches
/// the library.
///
/// # Large messages
///
/// MPI counts are 32-bit. Every payload is cut into messages of at most
/// [`MpiProcessGroup::max_message_bytes`] bytes (default
/// [`MpiProcessGroup::DEFAULT_MAX_MESSAGE`], 1 GiB); gathers and scatters of more than that per
/// call run in rounds through a staging buffer of that size.
///
/// # Reductions
///
/// [`ProcessGroup::reduce_scatter_into`] and [`ProcessGroup::all_reduce`] do not use
/// `MPI_Reduce_scatter_block` / `MPI_Allreduce`, whose summation order is up to the library:
/// they move blocks with `MPI_Alltoall` and reduce each element on one rank in rank order with
/// [`super::reduce_parts`], so the bits equal the thread backend's for every dtype, f16 and
/// bf16 included.
pub struct MpiProcessGroup {
    comm: Arc<Comm>,
    rank: usize,
    world_size: usize,
    max_message: usize,
}

/// The world communicator while some handle uses it, so that `world()` can hand it out again.
static WORLD: Mutex<Option<Weak<Comm>>> = Mutex::new(None);

impl MpiProcessGroup {
    /// Largest message (in bytes) a handle sends in one MPI call unless configured otherwise.
    pub const DEFAULT_MAX_MESSAGE: usize = 1 << 30;

    /// A handle on all processes of the job (`MPI_COMM_WORLD`), initializing MPI on the first
    /// call in the process (see the type's docs for initialization, reuse and finalization).
    ///
    /// The first call is collective: every process of the job must make it.
    ///
    /// # Errors
    ///
    /// [`Error::BackendUnavailable`] if MPI was already finalized in this process, or provides
    /// less than `MPI_THREAD_SERIALIZED`.
    pub fn world() -> Result<MpiProcessGroup> {
        let mut world = lock(&WORLD);
        let comm = match world.as_ref().and_then(Weak::upgrade) {
            Some(comm) => comm,
            None => {
                let comm = Arc::new(Comm::world()?);
                *world = Some(Arc::downgrade(&comm));
                comm
            }
        };
        drop(world);
        MpiProcessGroup::on(comm, Self::DEFAULT_MAX_MESSAGE)
    }

    fn on(comm: Arc<Comm>, max_message: usize) -> Result<MpiProcessGroup> {
        let (rank, world_size) = {
            let state = comm.lock();
            let raw = state.comm()?;
            (raw.rank(), raw.size())
        };
        let (rank, world_size) = match (usize::try_from(rank), usize::try_from(world_size)) {
            (Ok(r), Ok(ws)) if r < ws => (r, ws),
            _ => {
                return Err(Error::BackendUnavailable {
                    backend: BACKEND.into(),
                    reason: format!("MPI reported rank {rank} of size {world_size}"),
                })
            }
        };
        Ok(MpiProcessGroup {
            comm,
            rank,
            world_size,
            max_message,
        })
    }

    /// The largest message this handle sends in one MPI call, in bytes.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message
    }

    /// Sets the largest message this handle sends in one MPI call (1 to `i32::MAX` bytes);
    /// larger payloads go in several messages. Every rank must use the same limit (checked by
    /// each collective: a difference is [`Error::CollectiveMismatch`]). Sub-groups created
    /// afterwards inherit it. Small limits exist to test the chunked paths.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCollective`] for 0 or more than `i32::MAX`.
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Result<Self> {
        if bytes == 0 || bytes > i32::MAX as usize {
            return Err(Error::InvalidCollective {
                op: "with_max_message_bytes".into(),
                rank: self.rank,
                reason: format!("{bytes} bytes is outside 1..={}", i32::MAX),
            });
        }
        self.max_message = bytes;
        Ok(self)
    }

    /// The threading level the MPI library provides (`MPI_Query_thread`).
    pub fn threading(&self) -> Threading {
        self.comm.runtime.threading
    }

    /// Runs one collective: exchanges descriptors, checks agreement (failing every rank alike),
    /// then runs `data` with the communicator and every rank's descriptor.
    fn collective<T>(
        &self,
        op: Call,
        valid: std::result::Result<(), String>,
        data: impl FnOnce(&SimpleCommunicator, &[Announcement]) -> Result<T>,
    ) -> Result<T> {
        let name = op.name();
        let rank = self.rank;
        let mut state = self.comm.lock();
        let _serial = self.comm.runtime.serialize();
        if let Some(failure) = &state.failure {
            return Err(failure.error(name, rank, false));
        }
        let comm = state.comm()?;
        let mine = Announcement {
            call: op.clone(),
            valid: valid.is_ok(),
            max_message: self.max_message as u64,
        };
        let all = exchange_descriptors(comm, &mine, self.world_size)?;
        if all.iter().any(|d| !d.valid) {
            // Everyone learns every invalid rank's reason, so the error is the same everywhere.
            let reason = valid.err().unwrap_or_default();
            let reasons = raw_all_gather_bytes(
                comm,
                reason.as_bytes(),
                &vec![0; self.world_size],
                self.max_message,
                true,
            )?;
            let culprit = all.iter().position(|d| !d.valid).unwrap_or(0);
            let kind = FailureKind::Invalid {
                op: all[culprit].call.name(),
                rank: culprit,
                reason: String::from_utf8_lossy(&reasons[culprit]).into_owned(),
            };
            return Err(state.poison(kind).error(name, rank, true));
        }
        if let Err(detail) = agreement(&all) {
            return Err(state
                .poison(FailureKind::Mismatch { detail })
                .error(name, rank, true));
        }
        match data(comm, &all) {
            Ok(out) => Ok(out),
            Err(Error::CollectiveMismatch { detail, .. }) => Err(state
                .poison(FailureKind::Mismatch { detail })
                .error(name, rank, true)),
            Err(e) => Err(e),
        }
    }

    fn check_root(&self, root: usize) -> args::Check {
        args::root(root, self.world_size)
    }
}

impl fmt::Debug for MpiProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("max_message", &self.max_message)
            .field("threading", &self.comm.runtime.threading)
            .finish()
    }
}

impl ProcessGroup for MpiProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let (n, ws) = (send.len(), self.world_size);
        let valid = args::gathered(n, recv.len(), ws);
        let max = self.max_message;
        self.collective(Call::AllGatherInto { len: n }, valid, |comm, _| {
            all_gather_chunked(comm, send, recv, ws, max);
            Ok(())
        })
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let op = Call::Broadcast {
            root,
            len: buf.len(),
        };
        let valid = self.check_root(root);
        let max = self.max_message;
        self.collective(op, valid, |comm, _| {
            let root = comm.process_at_rank(root as i32);
            for chunk in buf.chunks_mut(max) {
                root.broadcast_into(chunk);
            }
            Ok(())
        })
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        let max = self.max_message;
        let op = Call::AllGatherBytes { len: send.len() };
        self.collective(op, Ok(()), |comm, all| {
            let lens: Vec<usize> = all
                .iter()
                .map(|d| match d.call {
                    Call::AllGatherBytes { len } => len,
                    _ => 0,
                })
                .collect();
            raw_all_gather_bytes(comm, send, &lens, max, false)
        })
    }

    /// Non-root ranks should pass `None`; bytes they pass anyway are ignored.
    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> Result<Vec<u8>> {
        let is_root = self.rank == root;
        let send = if is_root { send } else { None };
        let mut valid = self.check_root(root);
        if is_root && send.is_none() {
            valid = Err("the root rank must pass the bytes to send".into());
        }
        let op = Call::BroadcastBytes {
            root,
            len: send.map_or(0, <[u8]>::len),
        };
        let max = self.max_message;
        self.collective(op, valid, |comm, all| {
            let len = match all[root].call {
                Call::BroadcastBytes { len, .. } => len,
                _ => 0,
            };
            let mut out = match send {
                Some(bytes) => bytes.to_vec(),
                None => try_zeroed(len, "broadcast_bytes", self.rank)?,
            };
            let root = comm.process_at_rank(root as i32);
            for chunk in out.chunks_mut(max) {
                root.broadcast_into(chunk);
            }
            Ok(out)
        })
    }

    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()> {
        let (n, ws) = (send.len(), self.world_size);
        let is_root = self.rank == root;
        let mut recv = if is_root { recv } else { None };
        let valid = self.check_root(root).and(args::gather_root(
            n,
            recv.as_deref().map(<[u8]>::len),
            is_root,
            ws,
        ));
        let max = self.max_message;
        self.collective(Call::GatherInto { root, len: n }, valid, |comm, _| {
            if n == 0 {
                return Ok(());
            }
            let root = comm.process_at_rank(root as i32);
            if n * ws <= max {
                match recv.as_deref_mut() {
                    Some(recv) => root.gather_into_root(send, recv),
                    None => root.gather_into(send),
                }
                return Ok(());
            }
            let piece = (max / ws).max(1);
            let mut staging = if is_root {
                vec![0u8; piece * ws]
            } else {
                Vec::new()
            };
            for start in (0..n).step_by(piece) {
                let k = piece.min(n - start);
                match recv.as_deref_mut() {
                    Some(recv) => {
                        root.gather_into_root(&send[start..start + k], &mut staging[..k * ws]);
                        for (r, part) in staging[..k * ws].chunks_exact(k).enumerate() {
                            recv[r * n + start..r * n + start + k].copy_from_slice(part);
                        }
                    }
                    None => root.gather_into(&send[start..start + k]),
                }
            }
            Ok(())
        })
    }

    fn scatter_into(&self, send: Option<&[&[u8]]>, recv: &mut [u8], root: usize) -> Result<()> {
        let ws = self.world_size;
        let is_root = self.rank == root;
        let send = if is_root { send } else { None };
        let valid =
            self.check_root(root)
                .and(args::scatter_root(send.map(<[&[u8]]>::len), is_root, ws));
        let op = Call::ScatterInto {
            root,
            recv_len: recv.len(),
        };
        let max = self.max_message;
        self.collective(op, valid, |comm, all| {
            // The root tells every rank the part lengths; each rank then checks every rank's
            // receive length against them, so all reach the same verdict.
            let mut lens = vec![0u64; ws];
            if let Some(parts) = send {
                for (len, part) in lens.iter_mut().zip(parts) {
                    *len = part.len() as u64;
                }
            }
            let root_process = comm.process_at_rank(root as i32);
            root_process.broadcast_into(&mut lens[..]);
            let recv_lens: Vec<usize> = all
                .iter()
                .map(|d| match d.call {
                    Call::ScatterInto { recv_len, .. } => recv_len,
                    _ => 0,
                })
                .collect();
            let lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
            if let Err(detail) = args::scatter_lengths(root, &recv_lens, &lens) {
                return Err(Error::CollectiveMismatch {
                    rank: self.rank,
                    detail,
                });
            }
            let piece = (max / ws).max(1);
            let rounds = lens.iter().map(|l| l.div_ceil(piece)).max().unwrap_or(0);
            let mut staging = Vec::new();
            for round in 0..rounds {
                let plan = RoundPlan::new(&lens, round * piece, piece);
                let mine = plan.range(self.rank);
                match send {
                    Some(parts) => {
                        staging.clear();
                        for (part, len) in parts.iter().zip(&lens) {
                            let start = (round * piece).min(*len);
                            let end = (start + piece).min(*len);
                            staging.extend_from_slice(&part[start..end]);
                        }
                        let partition = Partition::new(&staging[..], plan.counts, plan.displs);
                        let mut spare = [0u8];
                        let into = not_in_place_mut(&mut recv[mine], &mut spare);
                        root_process.scatter_varcount_into_root(&partition, into);
                    }
                    None => {
                        let mut spare = [0u8];
                        root_process
                            .scatter_varcount_into(not_in_place_mut(&mut recv[mine], &mut spare));
                    }
                }
            }
            Ok(())
        })
    }

    /// `MPI_Alltoall` moves block `r` of every rank's `send` to rank `r` (`send.len()` bytes
    /// of memory, not `world_size()` times as the provided implementation), which then reduces
    /// the blocks in rank order with [`reduce_parts`]: the same bits as every other backend
    /// (`MPI_Reduce_scatter_block` does not promise an order). Invalid arguments on one rank
    /// fail every rank.
    fn reduce_scatter_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, ws) = (recv.len(), self.world_size);
        let valid = args::reduce_scattered(send.len(), n, dtype, op, ws);
        let max = self.max_message;
        let rank = self.rank;
        let desc = Call::ReduceScatterInto { len: n, dtype, op };
        self.collective(desc, valid, |comm, _| {
            all_to_all_reduce(
                comm,
                send,
                recv,
                (ws, max, rank),
                dtype,
                op,
                "reduce_scatter_into",
            )
        })
    }

    /// A reduce-scatter over `MPI_Alltoall` of the buffer padded to `world_size()` blocks of
    /// whole elements (each rank reduces one block in rank order, as [`reduce_parts`] does),
    /// then an all-gather of the reduced blocks: twice the buffer's memory instead of
    /// `world_size()` times, and the same bits as every other backend (`MPI_Allreduce` does
    /// not promise an order). Invalid arguments on one rank fail every rank.
    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (n, ws) = (buf.len(), self.world_size);
        let valid = check_reduction(dtype, op, n);
        let elem = dtype.size().max(1);
        // Bytes per rank: whole elements, enough for every rank's share.
        let block = n.div_ceil(elem).div_ceil(ws) * elem;
        let max = self.max_message;
        let rank = self.rank;
        let desc = Call::AllReduce { len: n, dtype, op };
        self.collective(desc, valid, |comm, _| {
            let mut padded = try_zeroed(block * ws, "all_reduce", rank)?;
            padded[..n].copy_from_slice(buf);
            let mut mine = try_zeroed(block, "all_reduce", rank)?;
            all_to_all_reduce(
                comm,
                &padded,
                &mut mine,
                (ws, max, rank),
                dtype,
                op,
                "all_reduce",
            )?;
            all_gather_chunked(comm, &mine, &mut padded, ws, max);
            buf.copy_from_slice(&padded[..n]);
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        self.collective(Call::Barrier, Ok(()), |comm, _| {
            comm.barrier();
            Ok(())
        })
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let valid = args::subgroup(ranks, self.world_size);
        let position = ranks.iter().position(|&r| r == self.rank);
        let op = Call::NewSubgroup(Members::of(ranks));
        let runtime = Arc::clone(&self.comm.runtime);
        let sub = self.collective(op, valid, |comm, _| {
            let color = match position {
                Some(_) => Color::with_value(0),
                None => Color::undefined(),
            };
            let key = position.unwrap_or(0) as i32;
            Ok(comm.split_by_color_with_key(color, key))
        })?;
        let (Some(sub), Some(position)) = (sub, position) else {
            return Ok(None);
        };
        let comm = Arc::new(Comm {
            state: Mutex::new(CommState {
                comm: Some(sub),
                failure: None,
            }),
            runtime,
        });
        let group = MpiProcessGroup::on(comm, self.max_message)?;
        if group.rank != position || group.world_size != ranks.len() {
            return Err(Error::BackendUnavailable {
                backend: BACKEND.into(),
                reason: format!(
                    "MPI_Comm_split gave rank {} of {} for position {position} of sub-group {ranks:?}",
                    group.rank, group.world_size
                ),
            });
        }
        Ok(Some(Arc::new(group)))
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }
}

/// `MPI_Allgather` of `send` (the same length on every rank) into `recv`, in rounds through a
/// staging buffer when `recv` is larger than `max` bytes.
fn all_gather_chunked(
    comm: &SimpleCommunicator,
    send: &[u8],
    recv: &mut [u8],
    ws: usize,
    max: usize,
) {
    let n = send.len();
    if n == 0 {
        return;
    }
    if n * ws <= max {
        comm.all_gather_into(send, recv);
        return;
    }
    let piece = (max / ws).max(1);
    let mut staging = vec![0u8; piece * ws];
    for start in (0..n).step_by(piece) {
        let k = piece.min(n - start);
        comm.all_gather_into(&send[start..start + k], &mut staging[..k * ws]);
        for (r, part) in staging[..k * ws].chunks_exact(k).enumerate() {
            recv[r * n + start..r * n + start + k].copy_from_slice(part);
        }
    }
}

/// Moves block `r` (`recv.len()` bytes) of every rank's `send` to rank `r` (`MPI_Alltoall`, in
/// rounds of at most `max` bytes) and reduces the blocks this rank receives, in rank order,
/// into `recv`. `(ws, max, rank)` describe the group.
fn all_to_all_reduce(
    comm: &SimpleCommunicator,
    send: &[u8],
    recv: &mut [u8],
    (ws, max, rank): (usize, usize, usize),
    dtype: DType,
    op: ReduceOp,
    name: &str,
) -> Result<()> {
    let n = recv.len();
    let mut blocks = try_zeroed(send.len(), name, rank)?;
    if n > 0 && n * ws <= max {
        comm.all_to_all_into(send, &mut blocks[..]);
    } else if n > 0 {
        let piece = (max / ws).max(1);
        let mut out = Vec::with_capacity(piece * ws);
        let mut back = vec![0u8; piece * ws];
        for start in (0..n).step_by(piece) {
            let k = piece.min(n - start);
            out.clear();
            for r in 0..ws {
                out.extend_from_slice(&send[r * n + start..r * n + start + k]);
            }
            comm.all_to_all_into(&out[..], &mut back[..k * ws]);
            for (r, part) in back[..k * ws].chunks_exact(k).enumerate() {
                blocks[r * n + start..r * n + start + k].copy_from_slice(part);
            }
        }
    }
    let parts: Vec<&[u8]> = if n == 0 {
        vec![&[]; ws]
    } else {
        blocks.chunks_exact(n).collect()
    };
    reduce_parts(dtype, op, &parts, recv).map_err(|reason| Error::InvalidCollective {
        op: name.into(),
        rank,
        reason,
    })
}

/// `bytes`, or when it is empty an empty slice of `spare`. An empty Rust slice points at
/// address 1 (the dangling address of `u8`), which is Open MPI's `MPI_IN_PLACE`: a rank that
/// receives (or sends) nothing in `MPI_Scatterv` (or `MPI_Allgatherv`) would pass an in-place
/// buffer, which Open MPI refuses on non-root ranks with `MPI_ERR_ARG` and aborts the job.
fn not_in_place<'a>(bytes: &'a [u8], spare: &'a [u8; 1]) -> &'a [u8] {
    if bytes.is_empty() {
        &spare[..0]
    } else {
        bytes
    }
}

/// [`not_in_place`] for a receive buffer.
fn not_in_place_mut<'a>(bytes: &'a mut [u8], spare: &'a mut [u8; 1]) -> &'a mut [u8] {
    if bytes.is_empty() {
        &mut spare[..0]
    } else {
        bytes
    }
}

/// Counts and displacements of one round of a variable-length gather or scatter: rank `r`
/// moves bytes `[offset, offset + piece)` of its `lens[r]`, clipped.
struct RoundPlan {
    counts: Vec<Count>,
    displs: Vec<Count>,
    /// Where each rank's moved bytes start in its own buffer (the offset, clipped).
    starts: Vec<usize>,
}

impl RoundPlan {
    /// `piece * lens.len()` must fit in a `Count` (the callers take `piece = max / ws`).
    fn new(lens: &[usize], offset: usize, piece: usize) -> Self {
        let mut counts = Vec::with_capacity(lens.len());
        let mut displs = Vec::with_capacity(lens.len());
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0usize;
        for &len in lens {
            let c = len.saturating_sub(offset).min(piece);
            counts.push(c as Count);
            displs.push(at as Count);
            starts.push(offset.min(len));
            at += c;
        }
        RoundPlan {
            counts,
            displs,
            starts,
        }
    }

    /// The range of rank `r`'s own buffer this round moves (empty once `r` is done).
    fn range(&self, r: usize) -> std::ops::Range<usize> {
        self.starts[r]..self.starts[r] + self.counts[r] as usize
    }

    fn total(&self) -> usize {
        self.counts.iter().map(|&c| c as usize).sum()
    }
}

/// Variable-length all-gather of byte strings whose lengths every rank already knows, in rounds
/// of at most `max` bytes (`Allgatherv`). With `trusted_lens == false` the lengths come from the
/// descriptors; with `true` they are exchanged first (the failure path, whose reasons have no
/// descriptor).
fn raw_all_gather_bytes(
    comm: &SimpleCommunicator,
    send: &[u8],
    lens: &[usize],
    max: usize,
    exchange_lens: bool,
) -> Result<Vec<Vec<u8>>> {
    let ws = lens.len();
    let mut lens = lens.to_vec();
    if exchange_lens {
        let mut all = vec![0u64; ws];
        comm.all_gather_into(&(send.len() as u64), &mut all[..]);
        lens = all.iter().map(|&l| l as usize).collect();
    }
    let piece = (max / ws.max(1)).max(1);
    let rounds = lens.iter().map(|l| l.div_ceil(piece)).max().unwrap_or(0);
    let mut out: Vec<Vec<u8>> = lens.iter().map(|&l| Vec::with_capacity(l)).collect();
    let mut staging = Vec::new();
    for round in 0..rounds {
        let offset = round * piece;
        let plan = RoundPlan::new(&lens, offset, piece);
        staging.resize(plan.total(), 0);
        let mine = plan.range(comm.rank() as usize);
        {
            let mut partition =
                PartitionMut::new(&mut staging[..], &plan.counts[..], &plan.displs[..]);
            let spare = [0u8];
            comm.all_gather_varcount_into(not_in_place(&send[mine], &spare), &mut partition);
        }
        for (r, dst) in out.iter_mut().enumerate() {
            let d = plan.displs[r] as usize;
            dst.extend_from_slice(&staging[d..d + plan.counts[r] as usize]);
        }
    }
    Ok(out)
}

/// All-gathers each rank's descriptor.
fn exchange_descriptors(
    comm: &SimpleCommunicator,
    mine: &Announcement,
    ws: usize,
) -> Result<Vec<Announcement>> {
    let mut all = vec![0u8; Announcement::BYTES * ws];
    comm.all_gather_into(&mine.to_bytes()[..], &mut all[..]);
    all.chunks_exact(Announcement::BYTES)
        .enumerate()
        .map(|(r, bytes)| {
            Announcement::from_bytes(bytes).ok_or_else(|| Error::CollectiveMismatch {
                rank: comm.rank() as usize,
                detail: format!("rank {r} sent an unknown collective descriptor {bytes:?}"),
            })
        })
        .collect()
}

/// With every rank's descriptor: `Ok` if they agree, otherwise what differs from rank 0.
fn agreement(all: &[Announcement]) -> std::result::Result<(), String> {
    let first = &all[0];
    let differences: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, d)| !d.agrees_with(first))
        .map(|(rank, d)| {
            if d.call.same_call(&first.call) {
                format!(
                    "rank {rank} sends messages of at most {} bytes while rank 0 sends {}",
                    d.max_message, first.max_message
                )
            } else {
                format!(
                    "rank {rank} called {} while rank 0 called {}",
                    d.call, first.call
                )
            }
        })
        .collect();
    if differences.is_empty() {
        Ok(())
    } else {
        Err(differences.join("; "))
    }
}

/// A zeroed buffer of `len` bytes, or a typed error when it cannot be allocated.
fn try_zeroed(len: usize, op: &str, rank: usize) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|e| Error::InvalidCollective {
            op: op.into(),
            rank,
            reason: format!("cannot allocate {len} bytes: {e}"),
        })?;
    v.resize(len, 0);
    Ok(v)
}

/// The MPI library of this process: finalized when the last communicator using it is gone.
struct Runtime {
    /// `Some` when the crate initialized MPI: dropping it calls `MPI_Finalize`.
    universe: Option<Universe>,
    threading: Threading,
    /// Serializes every MPI call of the crate when the library is not `MPI_THREAD_MULTIPLE`.
    serial: Option<Mutex<()>>,
}

impl Runtime {
    fn serialize(&self) -> Option<MutexGuard<'_, ()>> {
        self.serial.as_ref().map(lock)
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _serial = self.serial.as_ref().map(lock);
        let universe = self.universe.take();
        if std::thread::panicking() {
            // `MPI_Finalize` waits for every process; peers still inside a collective would
            // never get there, so a panicking rank would hang the job instead of failing it.
            // Skipping it makes `mpirun` see a process that exited without finalizing and end
            // the job.
            std::mem::forget(universe);
        } else {
            // `MPI_Finalize` (when the crate initialized MPI); every communicator is freed by
            // now because each holds an `Arc` of this runtime.
            drop(universe);
        }
    }
}

/// One communicator and its failure state, shared by the handles on it.
struct Comm {
    state: Mutex<CommState>,
    /// Declared after `state`, and `Drop` frees the communicator first: `MPI_Comm_free` must
    /// precede `MPI_Finalize`.
    runtime: Arc<Runtime>,
}

// SAFETY: the MPI handles inside (`MPI_Comm`, a pointer in Open MPI) are process-global
// objects, not tied to a thread. Every MPI call through them happens with the communicator's
// mutex held (one call at a time per communicator) and, when MPI is not
// `MPI_THREAD_MULTIPLE`, with the runtime's process-wide lock held too (`MPI_THREAD_SERIALIZED`
// is required at initialization), so no two threads ever call MPI at once unless the library
// allows it.
unsafe impl Send for Comm {}
// SAFETY: as above; shared access goes through the mutexes.
unsafe impl Sync for Comm {}

impl Comm {
    fn world() -> Result<Comm> {
        if mpi::is_finalized() {
            return Err(Error::BackendUnavailable {
                backend: BACKEND.into(),
                reason: "MPI was already finalized in this process (the last MpiProcessGroup \
                         handle was dropped) and cannot be initialized again; keep a handle \
                         alive for the whole run"
                    .into(),
            });
        }
        let (universe, threading) = match mpi::initialize_with_threading(Threading::Multiple) {
            Some((universe, provided)) => (Some(universe), provided),
            None => (None, mpi::environment::threading_support()),
        };
        if threading < Threading::Serialized {
            return Err(Error::BackendUnavailable {
                backend: BACKEND.into(),
                reason: format!(
                    "the MPI library provides thread level {threading:?}; at least Serialized is needed"
                ),
            });
        }
        let runtime = Arc::new(Runtime {
            universe,
            threading,
            serial: (threading < Threading::Multiple).then(|| Mutex::new(())),
        });
        let comm = {
            let _serial = runtime.serialize();
            SimpleCommunicator::world().duplicate()
        };
        Ok(Comm {
            state: Mutex::new(CommState {
                comm: Some(comm),
                failure: None,
            }),
            runtime,
        })
    }

    /// Locks the state. No code panics while holding the lock (MPI errors abort the process),
    /// so a poisoned mutex is entered anyway rather than turned into a panic.
    fn lock(&self) -> MutexGuard<'_, CommState> {
        lock(&self.state)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let _serial = self.runtime.serialize();
        // `MPI_Comm_free`, before the runtime (and so `MPI_Finalize`) can go.
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        drop(state.comm.take());
    }
}

struct CommState {
    /// `None` only while the communicator is being freed.
    comm: Option<SimpleCommunicator>,
    /// The first failure; once set, every call fails.
    failure: Option<FailureKind>,
}

impl CommState {
    fn comm(&self) -> Result<&SimpleCommunicator> {
        self.comm.as_ref().ok_or_else(|| Error::BackendUnavailable {
            backend: BACKEND.into(),
            reason: "the communicator was freed".into(),
        })
    }

    fn poison(&mut self, kind: FailureKind) -> &FailureKind {
        self.failure.get_or_insert(kind)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        assert_send_sync::<MpiProcessGroup>();
    }

    #[test]
    fn agreement_ignores_per_rank_lengths_and_names_the_differences() {
        let d = |call, max_message| Announcement {
            call,
            valid: true,
            max_message,
        };
        let ok = [
            d(Call::AllGatherBytes { len: 1 }, 8),
            d(Call::AllGatherBytes { len: 9 }, 8),
        ];
        assert!(agreement(&ok).is_ok());
        let bad = [
            d(Call::AllGatherInto { len: 1 }, 8),
            d(Call::AllGatherInto { len: 2 }, 8),
            d(Call::Barrier, 8),
            d(Call::AllGatherInto { len: 1 }, 4),
        ];
        let detail = agreement(&bad).unwrap_err();
        assert_eq!(
            detail,
            "rank 1 called all_gather_into(2 bytes) while rank 0 called all_gather_into(1 bytes); \
             rank 2 called barrier while rank 0 called all_gather_into(1 bytes); \
             rank 3 sends messages of at most 4 bytes while rank 0 sends 8"
        );
    }

    #[test]
    fn empty_buffers_never_pass_for_mpi_in_place() {
        // Open MPI's MPI_IN_PLACE is address 1, the dangling address of an empty u8 slice.
        let (mut none, mut spare) = (Vec::<u8>::new(), [0u8]);
        assert_eq!(none.as_ptr() as usize, 1);
        let spare_at = spare.as_ptr();
        assert_eq!(not_in_place(&none, &spare).as_ptr(), spare_at);
        assert_eq!(not_in_place_mut(&mut none, &mut spare).as_ptr(), spare_at);
        let bytes = [1u8, 2];
        assert_eq!(not_in_place(&bytes, &[0]), [1, 2]);
    }

    #[test]
    fn round_plans_clip_each_rank_to_its_length() {
        let plan = RoundPlan::new(&[10, 0, 4], 3, 3);
        assert_eq!(plan.counts, [3, 0, 1]);
        assert_eq!(plan.displs, [0, 3, 3]);
        assert_eq!(plan.total(), 4);
        assert_eq!(plan.range(0), 3..6);
        assert_eq!(plan.range(1), 0..0);
        assert_eq!(plan.range(2), 3..4);
    }
}
