//! In-process thread backend: one rank per thread, ranks meet in shared memory (see
//! [`ThreadGroup`] for the protocol).

use super::call::{Call, Members};
use super::failure::FailureKind;
use super::{args, check_reduction, reduce_parts, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// An in-process group whose ranks are threads: constructors and a runner.
///
/// [`ThreadGroup::new`] hands out one [`ThreadProcessGroup`] per rank; move each into the thread
/// that plays that rank, or let [`ThreadGroup::run`] spawn the threads.
///
/// ```
/// use fsdp::collectives::{ProcessGroup, ThreadGroup};
///
/// let gathered = ThreadGroup::run(3, |pg| {
///     let mut recv = vec![0u8; 3];
///     pg.all_gather_into(&[pg.rank() as u8], &mut recv)?;
///     Ok::<_, fsdp::Error>(recv)
/// });
/// for recv in gathered {
///     assert_eq!(recv?, [0, 1, 2]);
/// }
/// # Ok::<(), fsdp::Error>(())
/// ```
///
/// # Protocol
///
/// Every collective call is one *round* of a rendezvous guarded by a mutex and a condition
/// variable. Rounds are numbered (the generation); a rank's n-th call belongs to round n.
///
/// 1. **Arrive.** The rank publishes an op descriptor (name, sizes, root, sub-group ranks) and a
///    raw pointer + length to the bytes it sends, then waits until every rank has arrived. The
///    last rank to arrive compares all descriptors: if they agree the round moves to the copy
///    phase, otherwise the group fails with [`Error::CollectiveMismatch`].
/// 2. **Copy.** Outside the lock, each rank copies what it receives straight from the peers'
///    send buffers into its own output (one `memcpy` per received byte, no staging buffer).
/// 3. **Depart.** Each rank waits until every rank has finished copying; the last one clears
///    the round and opens the next generation. So no rank returns — and frees or reuses its send
///    buffer — while a peer may still read it. This wait has no timeout and cannot hang: once
///    all ranks have arrived, each of them is inside the call and finishes its copy (a panic
///    during the copy still registers the rank as finished before unwinding continues).
///
/// # Failures
///
/// The timeout of the group bounds the wait for peers to *arrive*
/// ([`Error::CollectiveTimeout`], naming the ranks that never came). A dropped handle —
/// including one dropped while its thread unwinds from a panic — marks its rank as gone and
/// wakes every waiter, which fails with [`Error::PeerDied`] at once. Invalid arguments on one
/// rank ([`Error::InvalidCollective`]) also fail its peers in that round. After any failure the
/// group is *poisoned*: every later call on any rank fails immediately with an error of the
/// same kind instead of waiting. Sub-groups are separate rendezvous domains with their own
/// failure state.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// Timeout used by [`ThreadGroup::new`] and [`ThreadGroup::run`].
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Creates a group of `world_size` ranks with [`ThreadGroup::DEFAULT_TIMEOUT`]; the handle
    /// of rank `i` is at index `i`. World size 0 gives no handles.
    // `ThreadGroup` only names the group; what `new` creates is the ranks' handles.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize) -> Vec<ThreadProcessGroup> {
        Self::with_timeout(world_size, Self::DEFAULT_TIMEOUT)
    }

    /// Creates a group of `world_size` ranks in which a collective fails with
    /// [`Error::CollectiveTimeout`] when peers have not arrived within `timeout`.
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Vec<ThreadProcessGroup> {
        let domain = Domain::new(world_size, timeout);
        (0..world_size)
            .map(|rank| ThreadProcessGroup::from_domain(Arc::clone(&domain), rank))
            .collect()
    }

    /// Runs `f` once per rank, each on its own scoped thread named `rank-<i>` with that rank's
    /// handle, and returns the results in rank order. World size 1 runs `f` on the calling
    /// thread; world size 0 returns an empty vector.
    ///
    /// # Panics
    ///
    /// If `f` panics on some rank, that rank's handle is dropped while unwinding (its peers get
    /// [`Error::PeerDied`]); after every thread has finished, the panic of the lowest panicking
    /// rank is resumed on the caller. Also panics if a thread cannot be spawned.
    pub fn run<F, R>(world_size: usize, f: F) -> Vec<R>
    where
        F: Fn(ThreadProcessGroup) -> R + Send + Sync,
        R: Send,
    {
        Self::run_with_timeout(world_size, Self::DEFAULT_TIMEOUT, f)
    }

    /// [`ThreadGroup::run`] on a group created with [`ThreadGroup::with_timeout`].
    ///
    /// # Panics
    ///
    /// As [`ThreadGroup::run`].
    pub fn run_with_timeout<F, R>(world_size: usize, timeout: Duration, f: F) -> Vec<R>
    where
        F: Fn(ThreadProcessGroup) -> R + Send + Sync,
        R: Send,
    {
        let handles = Self::with_timeout(world_size, timeout);
        if world_size <= 1 {
            return handles.into_iter().map(&f).collect();
        }
        let f = &f;
        let joined: Vec<thread::Result<R>> = thread::scope(|scope| {
            let threads: Vec<_> = handles
                .into_iter()
                .map(|pg| {
                    thread::Builder::new()
                        .name(format!("rank-{}", pg.rank))
                        .spawn_scoped(scope, move || f(pg))
                        .expect("failed to spawn a rank thread")
                })
                .collect();
            threads.into_iter().map(|t| t.join()).collect()
        });
        let mut results = Vec::with_capacity(world_size);
        let mut first_panic = None;
        for outcome in joined {
            match outcome {
                Ok(r) => results.push(r),
                Err(payload) => {
                    first_panic.get_or_insert(payload);
                }
            }
        }
        if let Some(payload) = first_panic {
            std::panic::resume_unwind(payload);
        }
        results
    }
}

/// One rank's handle on an in-process group (see [`ThreadGroup`]).
///
/// Dropping the handle makes the rank leave the group: peers waiting for it, or calling a
/// collective later, fail with [`Error::PeerDied`]. A handle must be used by one thread at a
/// time; a collective started while another is in flight on the same handle fails with
/// [`Error::InvalidCollective`].
pub struct ThreadProcessGroup {
    domain: Arc<Domain>,
    rank: usize,
    /// Number of collectives this rank has entered: the generation of its next round.
    calls: AtomicU64,
    /// Set while a collective runs on this handle.
    busy: AtomicBool,
}

impl ThreadProcessGroup {
    fn from_domain(domain: Arc<Domain>, rank: usize) -> Self {
        Self {
            domain,
            rank,
            calls: AtomicU64::new(0),
            busy: AtomicBool::new(false),
        }
    }

    /// How long a collective waits for peers to arrive before failing.
    pub fn timeout(&self) -> Duration {
        self.domain.timeout
    }

    /// Runs one collective round (protocol in [`ThreadGroup`]'s docs): checks the local
    /// argument check `valid` and the group's health, publishes `op` and `send`, waits for every
    /// rank, runs `copy` with the published buffers of all ranks, and waits until all ranks
    /// have copied.
    fn collective<T>(
        &self,
        op: Call,
        publish: Publish,
        valid: std::result::Result<(), String>,
        copy: impl FnOnce(&Round) -> T,
    ) -> Result<T> {
        let name = op.name();
        let rank = self.rank;
        let _busy = BusyGuard::acquire(&self.busy).ok_or_else(|| Error::InvalidCollective {
            op: name.into(),
            rank,
            reason: "another collective is in flight on this handle; use it from one thread".into(),
        })?;
        let seq = self.calls.fetch_add(1, Ordering::Relaxed);
        let domain = &*self.domain;
        let mut st = domain.lock();
        domain.check_entry(&mut st, seq, name, rank, valid)?;
        debug_assert!(seq == st.gen && !st.copying && st.slots[rank].is_none());
        // Phase 1: arrive, and wait for every peer to arrive.
        domain.arrive(&mut st, seq, rank, Slot { op, publish });
        let st = domain.await_arrivals(st, seq, name, rank)?;

        // Phase 2: copy from the peers' buffers outside the lock.
        let round = Round {
            published: st
                .slots
                .iter()
                .map(|s| s.as_ref().map(|s| s.publish.clone()).unwrap_or_default())
                .collect(),
            subgroup: st.subgroup.clone(),
        };
        drop(st);
        // Created before copying, so that even a panic in `copy` waits for the peers' copies.
        let depart = DepartGuard { domain, gen: seq };
        let out = copy(&round);
        // Phase 3: wait until every rank has copied (in the guard's `drop`).
        drop(depart);
        Ok(out)
    }
}

impl fmt::Debug for ThreadProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.domain.world_size)
            .field("timeout", &self.domain.timeout)
            .finish()
    }
}

impl Drop for ThreadProcessGroup {
    fn drop(&mut self) {
        let mut st = self.domain.lock();
        st.alive[self.rank] = false;
        self.domain.changed.notify_all();
    }
}

impl ProcessGroup for ThreadProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.domain.world_size
    }

    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let (n, ws) = (send.len(), self.world_size());
        let valid = args::gathered(n, recv.len(), ws);
        self.collective(
            Call::AllGatherInto { len: n },
            Publish::send(send),
            valid,
            |round| {
                if n > 0 {
                    for (peer, chunk) in recv.chunks_exact_mut(n).enumerate() {
                        chunk.copy_from_slice(round.send_of(peer));
                    }
                }
            },
        )
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let op = Call::Broadcast {
            root,
            len: buf.len(),
        };
        let valid = self.check_root(root);
        if self.rank == root {
            self.collective(op, Publish::send(buf), valid, |_| ())
        } else {
            // All lengths agree (checked at arrival), so the copy cannot fail.
            self.collective(op, Publish::default(), valid, |round| {
                buf.copy_from_slice(round.send_of(root))
            })
        }
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.collective(
            Call::AllGatherBytes { len: send.len() },
            Publish::send(send),
            Ok(()),
            |round| {
                (0..self.world_size())
                    .map(|peer| round.send_of(peer).to_vec())
                    .collect()
            },
        )
    }

    /// Non-root ranks should pass `None`; bytes they pass anyway are ignored.
    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> Result<Vec<u8>> {
        let mut valid = self.check_root(root);
        if self.rank == root && send.is_none() {
            valid = Err("the root rank must pass the bytes to send".into());
        }
        let send = if self.rank == root {
            send.unwrap_or_default()
        } else {
            &[]
        };
        let op = Call::BroadcastBytes {
            root,
            len: send.len(),
        };
        self.collective(op, Publish::send(send), valid, |round| {
            round.send_of(root).to_vec()
        })
    }

    /// Every rank writes its own bytes into the root's buffer, so the copies run in parallel.
    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()> {
        let (n, ws) = (send.len(), self.world_size());
        let op = Call::GatherInto { root, len: n };
        let is_root = self.rank == root;
        let valid = self.check_root(root).and(args::gather_root(
            n,
            recv.as_deref().map(<[u8]>::len),
            is_root,
            ws,
        ));
        let mut publish = Publish::send(send);
        if let (true, Ok(()), Some(recv)) = (is_root, &valid, recv) {
            publish.recv = RawMut::new(recv);
        }
        let rank = self.rank;
        self.collective(op, publish, valid, |round| {
            // SAFETY: each rank takes only its own range `rank * n..+n` of the root's buffer,
            // so the ranges of the round are disjoint, and the slice dies in this statement.
            unsafe { round.recv_range_of(root, rank * n, n) }.copy_from_slice(send);
        })
    }

    /// The ranks share the copying: the root's parts, laid end to end, are cut into one equal
    /// byte range per rank, and each rank copies its range into the receivers' buffers. So the
    /// root, which often keeps its own part in place and receives nothing, copies as much as
    /// any peer, and a large part is copied by every rank at once.
    fn scatter_into(&self, send: Option<&[&[u8]]>, recv: &mut [u8], root: usize) -> Result<()> {
        let ws = self.world_size();
        let op = Call::ScatterInto {
            root,
            recv_len: recv.len(),
        };
        let is_root = self.rank == root;
        let valid =
            self.check_root(root)
                .and(args::scatter_root(send.map(<[&[u8]]>::len), is_root, ws));
        let mut publish = Publish {
            recv_len: recv.len(),
            recv: RawMut::new(recv),
            ..Publish::default()
        };
        if let (true, Ok(()), Some(parts)) = (is_root, &valid, send) {
            publish.parts = parts.iter().map(|p| RawBytes::new(p)).collect();
        }
        let rank = self.rank;
        // Part lengths were matched against every receive buffer at arrival.
        self.collective(op, publish, valid, |round| {
            let lens: Vec<usize> = (0..ws).map(|q| round.part_of(root, q).len()).collect();
            let (lo, hi) = share_of(lens.iter().sum(), ws, rank);
            let mut start = 0;
            for (q, len) in lens.into_iter().enumerate() {
                let (a, b) = (lo.max(start), hi.min(start + len));
                if a < b {
                    let (from, n) = (a - start, b - a);
                    // SAFETY: the ranks' shares `lo..hi` are disjoint, so so are the ranges
                    // they write, and each slice dies in this statement.
                    unsafe { round.recv_range_of(q, from, n) }
                        .copy_from_slice(&round.part_of(root, q)[from..from + n]);
                }
                start += len;
            }
        })
    }

    /// Each rank reads its chunk straight out of every peer's send buffer: no staging copy.
    fn reduce_scatter_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, ws) = (recv.len(), self.world_size());
        let valid = args::reduce_scattered(send.len(), n, dtype, op, ws);
        let desc = Call::ReduceScatterInto { len: n, dtype, op };
        let rank = self.rank;
        self.collective(desc, Publish::send(send), valid, |round| {
            let parts: Vec<&[u8]> = (0..ws)
                .map(|peer| &round.send_of(peer)[rank * n..][..n])
                .collect();
            reduce_parts(dtype, op, &parts, recv)
        })?
        .map_err(|reason| Error::InvalidCollective {
            op: "reduce_scatter_into".into(),
            rank,
            reason,
        })
    }

    /// Each rank reduces the whole buffer straight out of every peer's buffer, in rank order,
    /// into a buffer of its own; arguments are checked and compared like every collective's.
    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (n, ws) = (buf.len(), self.world_size());
        let valid = check_reduction(dtype, op, n);
        let call = Call::AllReduce { len: n, dtype, op };
        let rank = self.rank;
        let reduced = self.collective(call, Publish::send(buf), valid, |round| {
            let parts: Vec<&[u8]> = (0..ws).map(|peer| round.send_of(peer)).collect();
            let mut out = vec![0u8; n];
            reduce_parts(dtype, op, &parts, &mut out).map(|()| out)
        })?;
        let reduced = reduced.map_err(|reason| Error::InvalidCollective {
            op: "all_reduce".into(),
            rank,
            reason,
        })?;
        buf.copy_from_slice(&reduced);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.collective(Call::Barrier, Publish::default(), Ok(()), |_| ())
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let valid = args::subgroup(ranks, self.world_size());
        let position = ranks.iter().position(|&r| r == self.rank);
        self.collective(
            Call::NewSubgroup(Members::of(ranks)),
            Publish::default(),
            valid,
            |round| {
                let domain = round.subgroup.clone()?;
                let group: Arc<dyn ProcessGroup> =
                    Arc::new(ThreadProcessGroup::from_domain(domain, position?));
                Some(group)
            },
        )
    }

    fn backend(&self) -> &'static str {
        "threads"
    }
}

impl ThreadProcessGroup {
    fn check_root(&self, root: usize) -> args::Check {
        args::root(root, self.world_size())
    }
}

/// Rank `rank`'s byte range `[lo, hi)` of `total` bytes copied by `ws` ranks together:
/// consecutive equal shares (the last ones shorter or empty).
fn share_of(total: usize, ws: usize, rank: usize) -> (usize, usize) {
    let share = total.div_ceil(ws.max(1));
    ((rank * share).min(total), ((rank + 1) * share).min(total))
}

/// A send buffer published by a rank for the current round.
#[derive(Clone, Copy)]
struct RawBytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: `RawBytes` is a plain address that moves between threads inside the rendezvous
// state; it is only dereferenced by `Round::send_of`, whose safety argument is given there.
unsafe impl Send for RawBytes {}

impl RawBytes {
    const EMPTY: RawBytes = RawBytes {
        ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
        len: 0,
    };

    fn new(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }
}

impl Default for RawBytes {
    fn default() -> Self {
        RawBytes::EMPTY
    }
}

/// A receive buffer that peers write into (the root's buffer of `gather_into`, every
/// receiver's of `scatter_into`).
#[derive(Clone, Copy)]
struct RawMut {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: as for `RawBytes`; dereferenced only by `Round::recv_of`.
unsafe impl Send for RawMut {}

impl Default for RawMut {
    fn default() -> Self {
        RawMut {
            ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 0,
        }
    }
}

impl RawMut {
    fn new(bytes: &mut [u8]) -> Self {
        Self {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        }
    }
}

/// What a rank publishes for a round: the bytes it sends, a buffer peers write into, the
/// per-rank parts it scatters, and the length of the buffer it receives into.
#[derive(Clone, Default)]
struct Publish {
    send: RawBytes,
    recv: RawMut,
    parts: Vec<RawBytes>,
    recv_len: usize,
}

impl Publish {
    fn send(bytes: &[u8]) -> Self {
        Publish {
            send: RawBytes::new(bytes),
            ..Publish::default()
        }
    }
}

/// Every rank's published buffers, as seen by one rank during the copy phase of a round.
struct Round {
    published: Vec<Publish>,
    subgroup: Option<Arc<Domain>>,
}

impl Round {
    /// Part `rank` of what `root` scatters in this round; lifetime argument as for
    /// [`Round::send_of`].
    fn part_of(&self, root: usize, rank: usize) -> &[u8] {
        let RawBytes { ptr, len } = self.published[root].parts[rank];
        // SAFETY: as in `send_of`: the root's `&[&[u8]]` parts stay borrowed until it departs.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// Bytes `[start, start + len)` of the buffer `root` receives into in this round
    /// (`gather_into`, `scatter_into`).
    ///
    /// # Safety
    ///
    /// No other rank of the round, and no other call of this rank, may hold a range that
    /// overlaps this one while the returned slice lives: the slice is a `&mut` into a buffer
    /// every rank of the round can reach.
    ///
    /// # Panics
    ///
    /// If the range is outside the buffer (the arrival checks make that impossible).
    #[allow(clippy::mut_from_ref)]
    unsafe fn recv_range_of(&self, root: usize, start: usize, len: usize) -> &mut [u8] {
        let RawMut { ptr, len: total } = self.published[root].recv;
        assert!(start.checked_add(len).is_some_and(|end| end <= total));
        // SAFETY: `ptr`/`total` come from the `&mut [u8]` the root passed to the collective it
        // is still blocked in (it departs only after every rank has copied), and the root does
        // not touch that borrow until then except through this pointer. The range is inside the
        // buffer (asserted) and disjoint from every other live range (this function's contract).
        unsafe { std::slice::from_raw_parts_mut(ptr.add(start), len) }
    }

    /// The bytes `peer` sends in this round. The slice cannot outlive `self`, and a `Round`
    /// exists only between the arrival of all ranks and this rank's departure.
    fn send_of(&self, peer: usize) -> &[u8] {
        let RawBytes { ptr, len } = self.published[peer].send;
        // SAFETY: `ptr`/`len` come from a `&[u8]` that `peer` passed to the collective it is
        // still blocked in: the round reached its copy phase, so every rank arrived, and no rank
        // departs (returns, ending that borrow) before all ranks — this one included, see
        // `DepartGuard` — have finished copying. A shared borrow cannot be written meanwhile, and
        // Rust's aliasing rules keep it disjoint from the `&mut` output this rank writes into.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

/// The shared rendezvous state of one group (or sub-group).
struct Domain {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl Domain {
    fn new(world_size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Domain {
            world_size,
            timeout,
            state: Mutex::new(State {
                gen: 0,
                copying: false,
                slots: (0..world_size).map(|_| None).collect(),
                arrived: 0,
                departed: 0,
                alive: vec![true; world_size],
                failure: None,
                subgroup: None,
            }),
            changed: Condvar::new(),
        })
    }

    /// Locks the state. No code panics while holding the lock, so a poisoned mutex (which
    /// would only come from a bug) is entered anyway rather than turned into a panic.
    /// Whether rank `rank` may start round `seq` of `op`: its own argument check passed (else
    /// the round is poisoned, so the peers fail too), the group has not failed and no peer
    /// has died.
    fn check_entry(
        &self,
        st: &mut State,
        seq: u64,
        op: &'static str,
        rank: usize,
        valid: std::result::Result<(), String>,
    ) -> Result<()> {
        if let Err(reason) = valid {
            // The peers cannot complete this round without us: fail them too.
            let kind = FailureKind::Invalid {
                op,
                rank,
                reason: reason.clone(),
            };
            self.poison(st, seq, kind);
            return Err(Error::InvalidCollective {
                op: op.into(),
                rank,
                reason,
            });
        }
        if let Some(failure) = &st.failure {
            return Err(failure.error(op, rank, seq == failure.gen));
        }
        if let Some(peer) = st.dead_peer() {
            return Err(self
                .poison(st, seq, FailureKind::PeerDied { peer })
                .error(op, rank, true));
        }
        Ok(())
    }

    /// Publishes rank `rank`'s slot; the last rank to arrive checks that every rank called
    /// the same collective and opens the copy phase (or poisons the round).
    fn arrive(&self, st: &mut State, seq: u64, rank: usize, slot: Slot) {
        st.slots[rank] = Some(slot);
        st.arrived += 1;
        if st.arrived == self.world_size {
            match st.agreement() {
                Ok(op) => {
                    if let Call::NewSubgroup(members) = op {
                        st.subgroup = Some(Domain::new(members.len, self.timeout));
                    }
                    st.copying = true;
                    self.changed.notify_all();
                }
                Err(detail) => {
                    self.poison(st, seq, FailureKind::Mismatch { detail });
                }
            }
        }
    }

    /// Waits until the copy phase opens; on a failure, a dead peer or the timeout, withdraws
    /// rank `rank`'s slot (the round can never complete) and returns the error.
    fn await_arrivals<'d>(
        &'d self,
        mut st: MutexGuard<'d, State>,
        seq: u64,
        op: &'static str,
        rank: usize,
    ) -> Result<MutexGuard<'d, State>> {
        let start = Instant::now();
        let deadline = start.checked_add(self.timeout);
        while !st.copying {
            let error = if let Some(failure) = &st.failure {
                failure.error(op, rank, true)
            } else if let Some(peer) = st.dead_peer() {
                self.poison(&mut st, seq, FailureKind::PeerDied { peer })
                    .error(op, rank, true)
            } else {
                let now = Instant::now();
                match deadline {
                    Some(deadline) if now >= deadline => {
                        let missing = (0..self.world_size)
                            .filter(|&p| st.slots[p].is_none())
                            .collect();
                        let kind = FailureKind::Timeout {
                            op,
                            waited: now - start,
                            missing,
                        };
                        self.poison(&mut st, seq, kind).error(op, rank, true)
                    }
                    Some(deadline) => {
                        st = self
                            .changed
                            .wait_timeout(st, deadline - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                        continue;
                    }
                    None => {
                        st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                        continue;
                    }
                }
            };
            // Withdraw: the round can never complete, and our send buffer is about to go away.
            st.slots[rank] = None;
            st.arrived -= 1;
            return Err(error);
        }
        Ok(st)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the group's first failure (later ones keep it), wakes all waiters, and returns
    /// the recorded failure.
    fn poison<'s>(&self, st: &'s mut State, gen: u64, kind: FailureKind) -> &'s Failure {
        self.changed.notify_all();
        st.failure.get_or_insert(Failure { gen, kind })
    }
}

struct State {
    /// Number of the round being assembled or copied.
    gen: u64,
    /// All ranks arrived and agreed; they are copying.
    copying: bool,
    /// What each rank published for the current round (`None`: not arrived).
    slots: Vec<Option<Slot>>,
    arrived: usize,
    departed: usize,
    /// `false` once a rank's handle is dropped.
    alive: Vec<bool>,
    /// The first failure; once set, every call fails.
    failure: Option<Failure>,
    /// The sub-group created by the current `new_subgroup` round.
    subgroup: Option<Arc<Domain>>,
}

impl State {
    fn dead_peer(&self) -> Option<usize> {
        self.alive.iter().position(|alive| !alive)
    }

    /// With every rank arrived: the op they agree on, or what differs from rank 0.
    fn agreement(&self) -> std::result::Result<&Call, String> {
        let ops: Vec<&Call> = self.slots.iter().flatten().map(|slot| &slot.op).collect();
        let first = ops[0];
        let differences: Vec<String> = ops
            .iter()
            .enumerate()
            .filter(|(_, op)| !op.same_call(first))
            .map(|(rank, op)| format!("rank {rank} called {op} while rank 0 called {first}"))
            .collect();
        if !differences.is_empty() {
            return Err(differences.join("; "));
        }
        if let Call::ScatterInto { root, .. } = first {
            let slots: Vec<&Slot> = self.slots.iter().flatten().collect();
            let recv_lens: Vec<usize> = slots.iter().map(|s| s.publish.recv_len).collect();
            let part_lens: Vec<usize> = slots[*root].publish.parts.iter().map(|p| p.len).collect();
            args::scatter_lengths(*root, &recv_lens, &part_lens)?;
        }
        Ok(first)
    }
}

struct Slot {
    op: Call,
    publish: Publish,
}

/// Why a group stopped working, and in which round.
struct Failure {
    gen: u64,
    kind: FailureKind,
}

impl Failure {
    /// The error `rank` gets for calling `op` (see [`FailureKind::error`]).
    fn error(&self, op: &str, rank: usize, same_round: bool) -> Error {
        self.kind.error(op, rank, same_round)
    }
}

/// Marks a handle busy for the duration of one collective.
struct BusyGuard<'a>(&'a AtomicBool);

impl<'a> BusyGuard<'a> {
    fn acquire(flag: &'a AtomicBool) -> Option<Self> {
        (!flag.swap(true, Ordering::Acquire)).then_some(BusyGuard(flag))
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Departure from a round in its copy phase: on drop (normal or unwinding), registers this
/// rank as done copying and waits until all ranks are; the last one opens the next round.
struct DepartGuard<'a> {
    domain: &'a Domain,
    gen: u64,
}

impl Drop for DepartGuard<'_> {
    fn drop(&mut self) {
        let domain = self.domain;
        let mut st = domain.lock();
        st.departed += 1;
        if st.departed == domain.world_size {
            st.gen += 1;
            st.copying = false;
            st.arrived = 0;
            st.departed = 0;
            st.slots.iter_mut().for_each(|slot| *slot = None);
            st.subgroup = None;
            domain.changed.notify_all();
        } else {
            // No timeout: every rank is past arrival and inside this call, so each one departs.
            while st.gen == self.gen {
                st = domain.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::ProcessGroupExt;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        assert_send_sync::<ThreadProcessGroup>();
    }

    #[test]
    fn world_size_one_runs_every_collective_on_the_calling_thread() {
        let pg = ThreadGroup::new(1).pop().unwrap();
        assert_eq!(
            (pg.rank(), pg.world_size(), pg.backend()),
            (0, 1, "threads")
        );

        let mut recv = [0u8; 3];
        pg.all_gather_into(&[7, 8, 9], &mut recv).unwrap();
        assert_eq!(recv, [7, 8, 9]);

        let mut buf = [1u8, 2];
        pg.broadcast(&mut buf, 0).unwrap();
        assert_eq!(buf, [1, 2]);

        assert_eq!(pg.all_gather_bytes(b"abc").unwrap(), vec![b"abc".to_vec()]);
        assert_eq!(pg.broadcast_bytes(Some(b"xy"), 0).unwrap(), b"xy");
        pg.barrier().unwrap();
        assert_eq!(
            pg.all_gather_object(&("a".to_string(), 1u32)).unwrap(),
            vec![("a".to_string(), 1u32)]
        );

        let sub = pg.new_subgroup(&[0]).unwrap().expect("rank 0 is a member");
        assert_eq!((sub.rank(), sub.world_size()), (0, 1));
        sub.barrier().unwrap();
    }

    #[test]
    fn world_size_zero_has_no_ranks() {
        assert!(ThreadGroup::new(0).is_empty());
        assert!(ThreadGroup::run(0, |pg| pg.rank()).is_empty());
    }

    #[test]
    fn run_returns_results_in_rank_order() {
        assert_eq!(ThreadGroup::run(4, |pg| pg.rank() * 10), [0, 10, 20, 30]);
    }

    #[test]
    fn wrong_recv_length_is_invalid_not_a_panic() {
        let pg = ThreadGroup::new(1).pop().unwrap();
        let err = pg.all_gather_into(&[1, 2], &mut [0u8; 3]).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidCollective { op, rank: 0, .. } if op == "all_gather_into"),
            "{err}"
        );
        assert!(err.to_string().contains("recv has 3 bytes"), "{err}");
    }

    #[test]
    fn root_out_of_range_is_invalid_not_a_panic() {
        let pg = ThreadGroup::new(1).pop().unwrap();
        let err = pg.broadcast(&mut [0u8; 2], 1).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidCollective { op, .. } if op == "broadcast"),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("root 1 is out of range for world size 1"),
            "{err}"
        );

        let pg = ThreadGroup::new(1).pop().unwrap();
        let err = pg.broadcast_bytes(None, 5).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidCollective { op, .. } if op == "broadcast_bytes"),
            "{err}"
        );
    }

    #[test]
    fn root_without_bytes_is_invalid() {
        let pg = ThreadGroup::new(1).pop().unwrap();
        let err = pg.broadcast_bytes(None, 0).unwrap_err();
        assert!(
            err.to_string().contains("root rank must pass the bytes"),
            "{err}"
        );
    }

    #[test]
    fn subgroup_ranks_must_be_non_empty_in_range_and_unique() {
        for (ranks, expected) in [
            (&[][..], "no ranks"),
            (
                &[0, 3][..],
                "rank 3 of sub-group [0, 3] is out of range for world size 2",
            ),
            (&[1, 1][..], "rank 1 appears twice"),
        ] {
            let errors = ThreadGroup::run(2, |pg| pg.new_subgroup(ranks).map(|g| g.is_some()));
            for (rank, result) in errors.into_iter().enumerate() {
                let err = result.unwrap_err();
                assert!(
                    matches!(&err, Error::InvalidCollective { op, .. } if op == "new_subgroup"),
                    "{err}"
                );
                assert!(err.to_string().contains(expected), "rank {rank}: {err}");
            }
        }
    }

    #[test]
    fn op_descriptors_print_name_sizes_and_root() {
        assert_eq!(
            Call::AllGatherInto { len: 8 }.to_string(),
            "all_gather_into(8 bytes)"
        );
        assert_eq!(
            Call::Broadcast { root: 0, len: 16 }.to_string(),
            "broadcast(root=0, 16 bytes)"
        );
        assert_eq!(
            Call::BroadcastBytes { root: 2, len: 5 }.to_string(),
            "broadcast_bytes(root=2)"
        );
        assert_eq!(
            Call::NewSubgroup(Members::of(&[0, 2])).to_string(),
            "new_subgroup(ranks=[0, 2])"
        );
        assert_eq!(Call::Barrier.to_string(), "barrier");
    }

    #[test]
    fn a_handle_in_use_refuses_a_second_collective() {
        let pg = ThreadGroup::new(1).pop().unwrap();
        let _busy = BusyGuard::acquire(&pg.busy).unwrap();
        let err = pg.barrier().unwrap_err();
        assert!(
            err.to_string()
                .contains("another collective is in flight on this handle"),
            "{err}"
        );
    }

    #[test]
    fn debug_shows_rank_world_size_and_timeout() {
        let pg = ThreadGroup::with_timeout(2, Duration::from_millis(200)).swap_remove(1);
        let shown = format!("{pg:?}");
        assert!(
            shown.contains("rank: 1") && shown.contains("world_size: 2") && shown.contains("200ms"),
            "{shown}"
        );
        assert_eq!(pg.timeout(), Duration::from_millis(200));
    }

    #[test]
    fn an_unbounded_timeout_does_not_overflow() {
        let pg = ThreadGroup::with_timeout(1, Duration::MAX).pop().unwrap();
        pg.barrier().unwrap();
    }
}
