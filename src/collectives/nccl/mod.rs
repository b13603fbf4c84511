//! NCCL backend (feature `nccl`, Linux): one rank per CUDA device, collectives through NCCL,
//! via cudarc with libraries loaded at run time.
//!
//! - [`probe()`] checks that the CUDA driver and NCCL load before cudarc is touched (cudarc
//!   panics on a missing library); its verdict is [`Error::BackendUnavailable`].
//! - [`codes`] turns NCCL and driver status codes into [`Error::Nccl`] / [`Error::CudaDriver`].
//! - [`NcclProcessGroup`] is the [`ProcessGroup`]; [`device`] adds collectives on device
//!   buffers (`CudaSlice`).
//!
//! # Creating a group
//!
//! Every rank first does everything that can fail locally — probe the libraries, pick and open
//! its device, create a stream, and on rank 0 the `ncclUniqueId` — and only then meets the
//! others: through the TCP [`rendezvous`](super::rendezvous) ([`NcclProcessGroup::from_env`];
//! under torchrun through its agent's `TCPStore`, otherwise rank 0 listens) or over an existing group ([`NcclProcessGroup::from_process_group`], e.g. an MPI or thread
//! group). Over an existing group every rank learns every other rank's local outcome, so a
//! failure anywhere fails every rank at once, naming the rank and the reason. Over TCP a rank
//! that fails locally does not join, and the others fail with [`Error::CollectiveTimeout`]
//! naming it once the rendezvous timeout expires. After that only `ncclCommInitRank` itself can
//! fail on one rank and not the others; NCCL then reports it on that rank.
//!
//! # Host buffers
//!
//! The [`ProcessGroup`] methods take host bytes: they are copied to the device, the NCCL call
//! runs on the group's stream, the result is copied back, and the call returns when the stream
//! is done. Before each of them the ranks all-gather a 40-byte descriptor of the call (op,
//! lengths, root, whether the local arguments are valid), so ranks that call different
//! collectives or pass different lengths get [`Error::CollectiveMismatch`] or
//! [`Error::InvalidCollective`] instead of an NCCL hang.
//! [`NcclProcessGroup::set_argument_checks`] turns this off (NCCL's own behaviour: undefined).
//! NCCL itself has no timeout: a rank that never arrives blocks its peers.

pub mod codes;
pub mod device;
pub mod probe;

pub use device::NcclElement;
pub use probe::{probe, Libraries};

use self::codes::{driver_error, nccl_error};
use super::call::{Announcement, Call, Members};
use super::rendezvous::{LaunchEnv, TcpRendezvous};
use super::{args, check_reduction, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// `NCCL_SPLIT_NOCOLOR`: the color of ranks that leave a split without a communicator.
const NCCL_SPLIT_NOCOLOR: i32 = -1;
/// Size of `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// An NCCL communicator handle, owned: destroyed on drop.
struct Comm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls are not
// concurrent; `NcclProcessGroup` only touches it under its mutex.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the handle came from ncclCommInitRank / ncclCommSplit and is dropped once.
            // A failure cannot be reported from drop; the communicator is gone either way.
            unsafe {
                let _ = result::comm_destroy(self.0);
            }
        }
    }
}

/// One rank's handle on an NCCL communicator (see the [module docs](self)).
///
/// It implements [`ProcessGroup`] on host bytes and, in [`device`], collectives on
/// `CudaSlice`s. The communicator is guarded by a mutex, so the handle is `Send + Sync`;
/// collectives from two threads on one handle run one after the other.
pub struct NcclProcessGroup {
    // Field order is drop order: the communicator goes before the stream and context.
    comm: Mutex<Comm>,
    rank: usize,
    world_size: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    checks: bool,
}

impl std::fmt::Debug for NcclProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.ctx.ordinal())
            .field("argument_checks", &self.checks)
            .finish()
    }
}

/// What a rank prepared on its own before meeting the others.
struct Local {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

fn prepare(
    rank: usize,
    device: Option<&dyn Fn(usize) -> Result<usize>>,
    fixed: usize,
) -> Result<Local> {
    probe::probe()?;
    let count =
        CudaContext::device_count().map_err(|e| driver_error("cuDeviceGetCount", rank, e))?;
    let count = usize::try_from(count).unwrap_or(0);
    let ordinal = match device {
        Some(choose) => choose(count)?,
        None => fixed,
    };
    if ordinal >= count {
        return Err(probe::unavailable(format!(
            "rank {rank} asked for CUDA device {ordinal}, but {count} device(s) are visible"
        )));
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", rank, e))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| driver_error("cuStreamCreate", rank, e))?;
    Ok(Local { ctx, stream })
}

fn new_unique_id(rank: usize) -> Result<Vec<u8>> {
    let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", rank, e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn id_from_bytes(bytes: &[u8], rank: usize) -> Result<sys::ncclUniqueId> {
    if bytes.len() != UNIQUE_ID_BYTES {
        return Err(Error::CollectiveMismatch {
            rank,
            detail: format!(
                "received an NCCL unique id of {} bytes, expected {UNIQUE_ID_BYTES}",
                bytes.len()
            ),
        });
    }
    let mut internal = [0 as std::ffi::c_char; UNIQUE_ID_BYTES];
    for (dst, &src) in internal.iter_mut().zip(bytes) {
        *dst = src as std::ffi::c_char;
    }
    Ok(sys::ncclUniqueId { internal })
}

/// Encodes one rank's local outcome for the exchange over an existing group: `1` and the
/// unique id (rank 0) or nothing, or `0` and the error text.
fn encode_status(outcome: &Result<Option<Vec<u8>>>) -> Vec<u8> {
    match outcome {
        Ok(id) => {
            let mut v = vec![1u8];
            v.extend_from_slice(id.as_deref().unwrap_or_default());
            v
        }
        Err(e) => {
            let mut v = vec![0u8];
            v.extend_from_slice(e.to_string().as_bytes());
            v
        }
    }
}

/// Reads every rank's status: the unique id of rank 0, or an error naming the failed ranks.
fn decode_statuses(statuses: &[Vec<u8>], rank: usize) -> Result<Vec<u8>> {
    let failed: Vec<String> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.first() != Some(&1))
        .map(|(r, s)| {
            format!(
                "rank {r}: {}",
                String::from_utf8_lossy(s.get(1..).unwrap_or_default())
            )
        })
        .collect();
    if !failed.is_empty() {
        return Err(probe::unavailable(format!(
            "rank {rank} cannot create the NCCL group because {}",
            failed.join("; ")
        )));
    }
    Ok(statuses
        .first()
        .map(|s| s[1..].to_vec())
        .unwrap_or_default())
}

impl NcclProcessGroup {
    /// Creates the group from the launcher's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, optional `LOCAL_RANK`; see [`LaunchEnv`]) with the TCP rendezvous and its
    /// default timeout (through torchrun's agent store when `TORCHELASTIC_USE_AGENT_STORE=True`). The device is `LOCAL_RANK`, else `RANK % device_count`.
    pub fn from_env() -> Result<Self> {
        Self::from_launch_env(&LaunchEnv::from_env()?, TcpRendezvous::DEFAULT_TIMEOUT)
    }

    /// [`NcclProcessGroup::from_env`] with explicit variables and rendezvous timeout.
    pub fn from_launch_env(env: &LaunchEnv, timeout: Duration) -> Result<Self> {
        let rank = env.rank;
        let choose = |count: usize| env.device_index(count);
        let local = prepare(rank, Some(&choose), 0)?;
        let id = if rank == 0 {
            Some(new_unique_id(rank)?)
        } else {
            None
        };
        let rendezvous = TcpRendezvous::from_env(env)?.with_timeout(timeout);
        let id = rendezvous.exchange(id.as_deref())?;
        Self::init(local, rank, env.world_size, &id)
    }

    /// Creates an NCCL group with the ranks of `pg` (same ranks, same order) on CUDA device
    /// `device`, handing the unique id over `pg` — an MPI group, a thread group, any backend.
    /// Collective over `pg`: a failure on any rank fails every rank.
    pub fn from_process_group(pg: &dyn ProcessGroup, device: usize) -> Result<Self> {
        let rank = pg.rank();
        let local = prepare(rank, None, device).and_then(|local| {
            let id = if rank == 0 {
                Some(new_unique_id(rank)?)
            } else {
                None
            };
            Ok((local, id))
        });
        let status = encode_status(
            &local
                .as_ref()
                .map(|(_, id)| id.clone())
                .map_err(Clone::clone),
        );
        let statuses = pg.all_gather_bytes(&status)?;
        let (local, _) = local?;
        let id = decode_statuses(&statuses, rank)?;
        Self::init(local, rank, pg.world_size(), &id)
    }

    fn init(local: Local, rank: usize, world_size: usize, id: &[u8]) -> Result<Self> {
        let id = id_from_bytes(id, rank)?;
        let (nranks, nrank) = match (i32::try_from(world_size), i32::try_from(rank)) {
            (Ok(n), Ok(r)) => (n, r),
            _ => {
                return Err(Error::InvalidCollective {
                    op: "ncclCommInitRank".into(),
                    rank,
                    reason: format!("world size {world_size} does not fit NCCL's int"),
                })
            }
        };
        local
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", rank, e))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id came from ncclGetUniqueId on rank 0.
        unsafe { result::comm_init_rank(&mut comm, nranks, id, nrank) }
            .map_err(|e| nccl_error("ncclCommInitRank", rank, e))?;
        Ok(Self {
            comm: Mutex::new(Comm(comm)),
            rank,
            world_size,
            ctx: local.ctx,
            stream: local.stream,
            checks: true,
        })
    }

    /// The CUDA context (device) of this rank.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every collective of this group is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Turns the per-call argument agreement of the host-buffer methods on (default) or off
    /// (one all-gather fewer per call; mismatched calls are then undefined, as in NCCL).
    pub fn set_argument_checks(&mut self, on: bool) {
        self.checks = on;
    }

    /// The version of the loaded NCCL library, e.g. `22803` for 2.28.3.
    pub fn nccl_version(&self) -> Result<i32> {
        result::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", self.rank, e))
    }

    /// Locks the communicator and makes this rank's context current on the calling thread.
    fn lock(&self, op: &str) -> Result<MutexGuard<'_, Comm>> {
        let guard = self.comm.lock().map_err(|_| Error::InvalidCollective {
            op: op.into(),
            rank: self.rank,
            reason:
                "a previous collective on this handle panicked; the communicator's state is unknown"
                    .into(),
        })?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", self.rank, e))?;
        Ok(guard)
    }

    fn drv(&self, op: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
        let op = op.to_string();
        move |e| driver_error(&op, self.rank, e)
    }

    fn nccl(&self, op: &str) -> impl Fn(result::NcclError) -> Error + '_ {
        let op = op.to_string();
        move |e| nccl_error(&op, self.rank, e)
    }

    fn invalid(&self, op: &str, reason: String) -> Error {
        Error::InvalidCollective {
            op: op.into(),
            rank: self.rank,
            reason,
        }
    }

    /// The root's part lengths, checked on every rank against every rank's receive length,
    /// so that all reach the same verdict before any byte moves.
    fn scatter_lengths(
        &self,
        comm: &Comm,
        op: &str,
        send: Option<&[&[u8]]>,
        recv_len: usize,
        root: usize,
    ) -> Result<Vec<usize>> {
        let ws = self.world_size;
        let decode = |bytes: Vec<u8>| -> Vec<usize> {
            bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()) as usize)
                .collect()
        };
        let mut lens = vec![0u8; 8 * ws];
        if let (Some(parts), true) = (send, self.rank == root) {
            for (r, p) in parts.iter().enumerate() {
                lens[8 * r..8 * r + 8].copy_from_slice(&(p.len() as u64).to_le_bytes());
            }
        }
        self.broadcast_host(comm, op, &mut lens, root)?;
        let lens = decode(lens);
        let mut recv_lens = vec![0u8; 8 * ws];
        self.gather_host(comm, op, &(recv_len as u64).to_le_bytes(), &mut recv_lens)?;
        if let Err(detail) = args::scatter_lengths(root, &decode(recv_lens), &lens) {
            return Err(Error::CollectiveMismatch {
                rank: self.rank,
                detail,
            });
        }
        Ok(lens)
    }

    /// The root's side: the parts for the other ranks, uploaded as one buffer and sent in one
    /// NCCL group.
    fn scatter_send(
        &self,
        comm: &Comm,
        op: &str,
        parts: &[&[u8]],
        lens: &[usize],
        root: usize,
    ) -> Result<()> {
        let mut offsets = vec![0usize; self.world_size];
        let mut flat = Vec::new();
        for (r, p) in parts.iter().enumerate() {
            offsets[r] = flat.len();
            if r != root {
                flat.extend_from_slice(p);
            }
        }
        if flat.is_empty() {
            return Ok(());
        }
        let cu = self.stream.cu_stream() as sys::cudaStream_t;
        let d_flat = self.upload(op, &flat)?;
        let (base, _rb) = d_flat.device_ptr(&self.stream);
        result::group_start().map_err(self.nccl("ncclGroupStart"))?;
        let mut outcome = Ok(());
        for (r, &len) in lens.iter().enumerate() {
            if r == root || len == 0 {
                continue;
            }
            // SAFETY: part `r` lies at `offsets[r]..+len` inside the uploaded buffer.
            let res = unsafe {
                result::send(
                    (base + offsets[r] as u64) as _,
                    len,
                    sys::ncclDataType_t::ncclUint8,
                    r as i32,
                    comm.0,
                    cu,
                )
            };
            if let Err(e) = res {
                outcome = Err(nccl_error("ncclSend", self.rank, e));
            }
        }
        let end = result::group_end().map_err(self.nccl("ncclGroupEnd"));
        outcome?;
        end?;
        self.stream.synchronize().map_err(self.drv(op))
    }

    /// A non-root rank's side: its part, received from the root.
    fn scatter_recv(&self, comm: &Comm, op: &str, recv: &mut [u8], root: usize) -> Result<()> {
        let cu = self.stream.cu_stream() as sys::cudaStream_t;
        let mut d_recv = self.alloc(op, recv.len())?;
        {
            let (p, _rp) = d_recv.device_ptr_mut(&self.stream);
            // SAFETY: `recv.len()` bytes into a buffer of that size, from the root.
            unsafe {
                result::recv(
                    p as _,
                    recv.len(),
                    sys::ncclDataType_t::ncclUint8,
                    root as i32,
                    comm.0,
                    cu,
                )
            }
            .map_err(self.nccl("ncclRecv"))?;
        }
        self.download(op, &d_recv, recv)
    }

    /// Copies host bytes to a new device buffer (at least one byte: CUDA refuses empty
    /// allocations).
    fn upload(&self, op: &str, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        if bytes.is_empty() {
            return self.stream.alloc_zeros::<u8>(1).map_err(self.drv(op));
        }
        self.stream.clone_htod(bytes).map_err(self.drv(op))
    }

    fn alloc(&self, op: &str, len: usize) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(self.drv(op))
    }

    /// Copies the first `out.len()` bytes of `dev` to `out` and waits for the stream.
    fn download(&self, op: &str, dev: &CudaSlice<u8>, out: &mut [u8]) -> Result<()> {
        if !out.is_empty() {
            let view = dev.slice(0..out.len());
            self.stream.memcpy_dtoh(&view, out).map_err(self.drv(op))?;
        }
        self.stream.synchronize().map_err(self.drv(op))
    }

    /// NCCL all-gather of `count` bytes per rank, device to device.
    fn raw_all_gather(
        &self,
        comm: &Comm,
        op: &str,
        send: &CudaSlice<u8>,
        recv: &mut CudaSlice<u8>,
        count: usize,
    ) -> Result<()> {
        let (s, _rs) = send.device_ptr(&self.stream);
        let (r, _rr) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both buffers live on this context and hold `count` / `count * world_size`
        // bytes (checked by the callers); the stream is this group's.
        unsafe {
            result::all_gather(
                s as _,
                r as _,
                count,
                sys::ncclDataType_t::ncclUint8,
                comm.0,
                self.stream.cu_stream() as _,
            )
        }
        .map(drop)
        .map_err(self.nccl(op))
    }

    /// Host all-gather without the agreement step (the agreement itself uses it).
    fn gather_host(&self, comm: &Comm, op: &str, send: &[u8], recv: &mut [u8]) -> Result<()> {
        if send.is_empty() {
            return Ok(());
        }
        let d_send = self.upload(op, send)?;
        let mut d_recv = self.alloc(op, recv.len())?;
        self.raw_all_gather(comm, op, &d_send, &mut d_recv, send.len())?;
        self.download(op, &d_recv, recv)
    }

    /// Host broadcast without the agreement step.
    fn broadcast_host(&self, comm: &Comm, op: &str, buf: &mut [u8], root: usize) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut d_buf = self.upload(op, buf)?;
        {
            let (p, _rp) = d_buf.device_ptr_mut(&self.stream);
            // SAFETY: in-place broadcast of `buf.len()` bytes on a buffer of that size.
            unsafe {
                result::broadcast(
                    p as _,
                    p as _,
                    buf.len(),
                    sys::ncclDataType_t::ncclUint8,
                    root as i32,
                    comm.0,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(self.nccl(op))?;
        }
        self.download(op, &d_buf, buf)
    }

    /// The agreement step (see the module docs): every rank's call and argument validity,
    /// compared. Returns the local error first, then a peer's, then a mismatch.
    fn agree(&self, comm: &Comm, call: Call, local: std::result::Result<(), String>) -> Result<()> {
        let op = call.name();
        if !self.checks {
            return local.map_err(|reason| self.invalid(op, reason));
        }
        let mine = Announcement {
            call,
            valid: local.is_ok(),
            max_message: 0,
        };
        let mut all = vec![0u8; Announcement::BYTES * self.world_size];
        self.gather_host(comm, op, &mine.to_bytes(), &mut all)?;
        local.map_err(|reason| self.invalid(op, reason))?;
        let theirs: Vec<Announcement> = all
            .chunks_exact(Announcement::BYTES)
            .enumerate()
            .map(|(r, bytes)| {
                Announcement::from_bytes(bytes).ok_or_else(|| Error::CollectiveMismatch {
                    rank: self.rank,
                    detail: format!("rank {r} sent an unknown collective descriptor {bytes:?}"),
                })
            })
            .collect::<Result<_>>()?;
        if let Some(r) = theirs.iter().position(|a| !a.valid) {
            return Err(self.invalid(
                op,
                format!("rank {r} passed invalid arguments to this collective (see its error)"),
            ));
        }
        let differing: Vec<String> = theirs
            .iter()
            .enumerate()
            .filter(|(_, a)| !a.agrees_with(&mine))
            .map(|(r, a)| format!("rank {r}: {}", a.call))
            .collect();
        if !differing.is_empty() {
            return Err(Error::CollectiveMismatch {
                rank: self.rank,
                detail: format!(
                    "rank {} called {}, but {}",
                    self.rank,
                    mine.call,
                    differing.join(", ")
                ),
            });
        }
        Ok(())
    }

    fn check_root(&self, root: usize) -> args::Check {
        args::root(root, self.world_size)
    }
}

/// The NCCL datatype that reduces `dtype` (bool as bytes: only `max`, a logical or, is
/// allowed); `None` for the dtypes NCCL cannot reduce (16-bit integers, float8, complex).
fn nccl_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    Some(match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I64 => T::ncclInt64,
        DType::I32 => T::ncclInt32,
        DType::U8 | DType::Bool => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::U32 => T::ncclUint32,
        DType::U64 => T::ncclUint64,
        DType::I16 | DType::U16 | DType::F8E4M3FN | DType::F8E5M2 | DType::C64 | DType::C128 => {
            return None
        }
    })
}

/// [`check_reduction`], plus NCCL having a datatype for `dtype`.
fn nccl_reduction(dtype: DType, op: ReduceOp, len: usize) -> std::result::Result<(), String> {
    check_reduction(dtype, op, len)?;
    nccl_dtype(dtype)
        .map(|_| ())
        .ok_or_else(|| format!("NCCL cannot reduce {dtype}"))
}

/// The NCCL datatype of a reduction already checked by [`nccl_reduction`].
fn checked_nccl_dtype(dtype: DType) -> Result<sys::ncclDataType_t> {
    nccl_dtype(dtype).ok_or_else(|| Error::Unsupported(format!("NCCL reductions of {dtype}")))
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl ProcessGroup for NcclProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let comm = self.lock("all_gather_into")?;
        let valid = args::gathered(send.len(), recv.len(), self.world_size);
        self.agree(&comm, Call::AllGatherInto { len: send.len() }, valid)?;
        self.gather_host(&comm, "all_gather_into", send, recv)
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let comm = self.lock("broadcast")?;
        let call = Call::Broadcast {
            root,
            len: buf.len(),
        };
        self.agree(&comm, call, self.check_root(root))?;
        self.broadcast_host(&comm, "broadcast", buf, root)
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        let op = "all_gather_bytes";
        let comm = self.lock(op)?;
        self.agree(&comm, Call::AllGatherBytes { len: send.len() }, Ok(()))?;
        let mut lens = vec![0u8; 8 * self.world_size];
        self.gather_host(&comm, op, &(send.len() as u64).to_le_bytes(), &mut lens)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()) as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let mut padded = send.to_vec();
        padded.resize(max, 0);
        let mut all = vec![0u8; max * self.world_size];
        self.gather_host(&comm, op, &padded, &mut all)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * max..r * max + n].to_vec())
            .collect())
    }

    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> Result<Vec<u8>> {
        let op = "broadcast_bytes";
        let comm = self.lock(op)?;
        let valid = self.check_root(root).and_then(|()| {
            if self.rank == root && send.is_none() {
                Err("the root rank must pass the bytes".to_string())
            } else {
                Ok(())
            }
        });
        let call = Call::BroadcastBytes {
            root,
            len: send.map_or(0, <[u8]>::len),
        };
        self.agree(&comm, call, valid)?;
        let mut len = (send.map_or(0, <[u8]>::len) as u64).to_le_bytes();
        self.broadcast_host(&comm, op, &mut len, root)?;
        let len = u64::from_le_bytes(len) as usize;
        let mut buf = match send {
            Some(bytes) if self.rank == root => bytes.to_vec(),
            _ => vec![0u8; len],
        };
        self.broadcast_host(&comm, op, &mut buf, root)?;
        Ok(buf)
    }

    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()> {
        let op = "gather_into";
        let comm = self.lock(op)?;
        let n = send.len();
        let valid = self.check_root(root).and(args::gather_root(
            n,
            recv.as_deref().map(<[u8]>::len),
            self.rank == root,
            self.world_size,
        ));
        self.agree(&comm, Call::GatherInto { root, len: n }, valid)?;
        if n == 0 {
            return Ok(());
        }
        let d_send = self.upload(op, send)?;
        let mut d_recv = if self.rank == root {
            Some(self.alloc(op, n * self.world_size)?)
        } else {
            None
        };
        {
            let (s, _rs) = d_send.device_ptr(&self.stream);
            let recv_ptr = d_recv.as_mut().map(|d| d.device_ptr_mut(&self.stream));
            let cu = self.stream.cu_stream() as sys::cudaStream_t;
            result::group_start().map_err(self.nccl("ncclGroupStart"))?;
            let mut outcome = Ok(());
            if let Some((r, _)) = &recv_ptr {
                for peer in 0..self.world_size {
                    // SAFETY: part `peer` of the root's receive buffer, `n` bytes, in bounds.
                    let res = unsafe {
                        result::recv(
                            (*r + (peer * n) as u64) as _,
                            n,
                            sys::ncclDataType_t::ncclUint8,
                            peer as i32,
                            comm.0,
                            cu,
                        )
                    };
                    if let Err(e) = res {
                        outcome = Err(nccl_error("ncclRecv", self.rank, e));
                    }
                }
            }
            // SAFETY: `n` bytes of this rank's send buffer to the root.
            let res = unsafe {
                result::send(
                    s as _,
                    n,
                    sys::ncclDataType_t::ncclUint8,
                    root as i32,
                    comm.0,
                    cu,
                )
            };
            if let Err(e) = res {
                outcome = outcome.and(Err(nccl_error("ncclSend", self.rank, e)));
            }
            // The group must be closed whatever happened inside it.
            let end = result::group_end().map_err(self.nccl("ncclGroupEnd"));
            outcome?;
            end?;
        }
        match (recv, d_recv) {
            (Some(out), Some(dev)) if self.rank == root => self.download(op, &dev, out),
            _ => self.stream.synchronize().map_err(self.drv(op)),
        }
    }

    fn scatter_into(&self, send: Option<&[&[u8]]>, recv: &mut [u8], root: usize) -> Result<()> {
        let op = "scatter_into";
        let comm = self.lock(op)?;
        let valid = self.check_root(root).and(args::scatter_root(
            send.map(<[&[u8]]>::len),
            self.rank == root,
            self.world_size,
        ));
        let call = Call::ScatterInto {
            root,
            recv_len: recv.len(),
        };
        self.agree(&comm, call, valid)?;
        let lens = self.scatter_lengths(&comm, op, send, recv.len(), root)?;
        if self.rank == root {
            let parts = send.unwrap_or_default();
            recv.copy_from_slice(parts[root]);
            self.scatter_send(&comm, op, parts, &lens, root)
        } else if recv.is_empty() {
            Ok(())
        } else {
            self.scatter_recv(&comm, op, recv, root)
        }
    }

    /// `ncclReduceScatter` on the staged buffers. NCCL chooses its own summation order, so
    /// floating-point sums can differ from [`super::reduce_parts`]'s rank order in the last
    /// bits (as PyTorch's NCCL results differ from gloo's).
    fn reduce_scatter_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let name = "reduce_scatter_into";
        let comm = self.lock(name)?;
        let valid = args::reduce_scattered(send.len(), recv.len(), dtype, op, self.world_size)
            .and_then(|()| nccl_reduction(dtype, op, recv.len()));
        let call = Call::ReduceScatterInto {
            len: recv.len(),
            dtype,
            op,
        };
        self.agree(&comm, call, valid)?;
        if recv.is_empty() {
            return Ok(());
        }
        let d_send = self.upload(name, send)?;
        let mut d_recv = self.alloc(name, recv.len())?;
        {
            let (s, _rs) = d_send.device_ptr(&self.stream);
            let (r, _rr) = d_recv.device_ptr_mut(&self.stream);
            // SAFETY: `recv.len() / size` elements per rank; buffers sized accordingly.
            unsafe {
                result::reduce_scatter(
                    s as _,
                    r as _,
                    recv.len() / dtype.size(),
                    checked_nccl_dtype(dtype)?,
                    nccl_op(op),
                    comm.0,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(self.nccl("ncclReduceScatter"))?;
        }
        self.download(name, &d_recv, recv)
    }

    /// `ncclAllReduce` on the staged buffer (summation order as in
    /// [`NcclProcessGroup::reduce_scatter_into`]).
    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let name = "all_reduce";
        let comm = self.lock(name)?;
        let valid = nccl_reduction(dtype, op, buf.len());
        let call = Call::AllReduce {
            len: buf.len(),
            dtype,
            op,
        };
        self.agree(&comm, call, valid)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut d_buf = self.upload(name, buf)?;
        {
            let (p, _rp) = d_buf.device_ptr_mut(&self.stream);
            // SAFETY: in place, `buf.len() / size` elements.
            unsafe {
                result::all_reduce(
                    p as _,
                    p as _,
                    buf.len() / dtype.size(),
                    checked_nccl_dtype(dtype)?,
                    nccl_op(op),
                    comm.0,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(self.nccl("ncclAllReduce"))?;
        }
        self.download(name, &d_buf, buf)
    }

    fn barrier(&self) -> Result<()> {
        let comm = self.lock("barrier")?;
        // The agreement's all-gather is the barrier; without checks, gather one byte.
        if self.checks {
            self.agree(&comm, Call::Barrier, Ok(()))
        } else {
            let mut all = vec![0u8; self.world_size];
            self.gather_host(&comm, "barrier", &[1], &mut all)
        }
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let op = "new_subgroup";
        let comm = self.lock(op)?;
        let valid = args::subgroup(ranks, self.world_size);
        self.agree(&comm, Call::NewSubgroup(Members::of(ranks)), valid)?;
        let position = ranks.iter().position(|&r| r == self.rank);
        let (color, key) = match position {
            Some(p) => (0, p as i32),
            None => (NCCL_SPLIT_NOCOLOR, 0),
        };
        let mut new: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: collective split of a live communicator; `new` is a valid out-pointer; a
        // null config means the parent's.
        unsafe { sys::ncclCommSplit(comm.0, color, key, &mut new, std::ptr::null_mut()) }
            .result()
            .map_err(self.nccl("ncclCommSplit"))?;
        let Some(sub_rank) = position else {
            return Ok(None);
        };
        if new.is_null() {
            return Err(nccl_error_null(self.rank));
        }
        Ok(Some(Arc::new(NcclProcessGroup {
            comm: Mutex::new(Comm(new)),
            rank: sub_rank,
            world_size: ranks.len(),
            ctx: Arc::clone(&self.ctx),
            stream: Arc::clone(&self.stream),
            checks: self.checks,
        })))
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }
}

fn nccl_error_null(rank: usize) -> Error {
    Error::Nccl {
        op: "ncclCommSplit".into(),
        rank,
        code: "ncclSuccess".into(),
        reason: "returned no communicator for a member of the sub-group".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_maps_to_an_nccl_type_of_its_size() {
        use sys::ncclDataType_t as T;
        for d in DType::ALL {
            let Some(t) = nccl_dtype(d) else {
                assert!(matches!(
                    d,
                    DType::I16
                        | DType::U16
                        | DType::F8E4M3FN
                        | DType::F8E5M2
                        | DType::C64
                        | DType::C128
                ));
                continue;
            };
            let size = match t {
                T::ncclUint8 | T::ncclInt8 => 1,
                T::ncclFloat16 | T::ncclBfloat16 => 2,
                T::ncclFloat32 | T::ncclInt32 | T::ncclUint32 => 4,
                T::ncclFloat64 | T::ncclInt64 | T::ncclUint64 => 8,
                other => panic!("{other:?}"),
            };
            assert_eq!(size, d.size(), "{d}");
        }
        assert_eq!(nccl_op(ReduceOp::Avg), sys::ncclRedOp_t::ncclAvg);
    }

    #[test]
    fn unique_ids_must_have_128_bytes() {
        let id: Vec<u8> = (0..128u8).collect();
        let parsed = id_from_bytes(&id, 1).unwrap();
        assert_eq!(parsed.internal[127] as u8, 127);
        let err = id_from_bytes(&id[..16], 1).unwrap_err();
        assert!(
            matches!(err, Error::CollectiveMismatch { rank: 1, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn statuses_carry_the_id_or_name_every_failed_rank() {
        let id = vec![7u8; UNIQUE_ID_BYTES];
        let ok0 = encode_status(&Ok(Some(id.clone())));
        let ok = encode_status(&Ok(None));
        assert_eq!(decode_statuses(&[ok0.clone(), ok.clone()], 1).unwrap(), id);
        let bad = encode_status(&Err(probe::unavailable("no CUDA driver".into())));
        let err = decode_statuses(&[ok0, bad.clone(), ok, bad], 0).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("rank 0 cannot create the NCCL group because rank 1: backend `nccl` unavailable: no CUDA driver; rank 3: "),
            "{text}"
        );
    }
}
