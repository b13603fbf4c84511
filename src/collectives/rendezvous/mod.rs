//! Out-of-band rendezvous over TCP: how the ranks of a job launched like `torchrun` find each
//! other before any collective backend exists.
//!
//! [`LaunchEnv`] reads the launcher's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `LOCAL_RANK`, and torchrun's `TORCHELASTIC_*`). [`TcpRendezvous`] then hands
//! one byte string from rank 0 to every other rank: the NCCL backend uses it for the 128-byte
//! `ncclUniqueId`, but nothing here depends on NCCL, so it is plain `std` and always compiled.
//!
//! There are two protocols, chosen by [`TcpRendezvous::from_env`]:
//! * **torchrun's agent store** (`TORCHELASTIC_USE_AGENT_STORE=True`, which torchrun sets): the
//!   elastic agent already serves a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`, so nobody
//!   may bind that port. Every rank is a client of that store
//!   ([`tcp_store`](super::tcp_store)), as `torch.distributed.init_process_group` is.
//! * **own listener** (any other launcher, e.g. the variables set by hand): rank 0 listens on
//!   `MASTER_ADDR:MASTER_PORT` itself.
//!
//! Both fail the same way: a wrong world size or a duplicate rank is an
//! [`Error::CollectiveMismatch`] on every rank that learns of it, ranks that do not come in
//! time are named in an [`Error::CollectiveTimeout`], and bytes that are not the protocol are
//! an [`Error::Rendezvous`].
//!
//! # Protocol with torchrun's agent store
//!
//! Keys live under `fsdp/rendezvous/v1/{TORCHELASTIC_RUN_ID}/attempt_{TORCHELASTIC_RESTART_COUNT}/{n}/{k}`:
//! the attempt keeps a restarted worker group from reading the previous attempt's bytes, and
//! `n` counts the rendezvous of this process (the n-th [`TcpRendezvous::from_env`] of every
//! process meet) and `k` the exchanges of one [`TcpRendezvous`]. Rank 0 sets `world_size`
//! (decimal); every other rank `r` sets `rank/{r}/world_size` (its world size) and adds 1 to
//! `rank/{r}` (a count above 1 is a duplicate `RANK`). Rank 0 waits for every `rank/{r}`,
//! checks them and sets `answer`: a status byte, then the blob (status `0`), the reason
//! (status `1`, mismatch) or the milliseconds waited and the missing ranks (status `2`,
//! timeout; `u64` then `u32`s, little-endian). The other ranks wait for `answer` (their
//! timeout plus a grace) and, on status `0`, check rank 0's `world_size` against theirs.
//!
//! # Protocol with its own listener
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`. Every other rank connects (retrying while the
//! listener is not up yet) and sends a hello: the 8-byte magic `FSDPRDV1`, then the world size
//! and its rank as little-endian `u32`. When every rank `1..world_size` has said hello, rank 0
//! answers each with status `0` and the blob (`u64` length, bytes). A hello whose world size
//! differs from rank 0's, whose rank is out of range, or whose rank already connected fails
//! the whole rendezvous: rank 0 answers every connected rank with status `1` and the reason,
//! goes on answering so every later hello until `world_size - 1` hellos have come (or the
//! timeout expires), and every rank returns [`Error::CollectiveMismatch`]. When the timeout expires first, rank
//! 0 answers the connected ranks with status `2` and the ranks that never came, and every rank
//! returns [`Error::CollectiveTimeout`] naming them. A connection that does not start with the
//! magic (a port scanner, a health check) is closed and ignored.

use super::net::{connect_once, read_until, ConnectError, ReadError};
use crate::error::{Error, Result};
use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod agent_store;

const MAGIC: &[u8; 8] = b"FSDPRDV1";
const STATUS_OK: u8 = 0;
const STATUS_MISMATCH: u8 = 1;
const STATUS_TIMEOUT: u8 = 2;
/// Largest blob or message a client accepts (bytes): a guard against reading garbage lengths.
const MAX_PAYLOAD: u64 = 1 << 20;
/// How long a client waits beyond its timeout for rank 0's timeout answer.
const GRACE: Duration = Duration::from_secs(2);
/// Pause between connection attempts and between polls of the listener.
const POLL: Duration = Duration::from_millis(20);

/// What rank 0's wait for hellos gave: the valid peers by rank, whether the deadline passed,
/// and the first problem (sent to everyone connected).
struct Hellos {
    peers: Vec<Option<TcpStream>>,
    timed_out: bool,
    first_problem: Option<String>,
}

/// The launcher variables of one rank, as `torchrun` (and `torch.distributed.launch`) set them.
///
/// | variable | meaning | required |
/// | --- | --- | --- |
/// | `RANK` | this process's global rank, `0..WORLD_SIZE` | yes |
/// | `WORLD_SIZE` | number of processes, at least 1 | yes |
/// | `MASTER_ADDR` | host name or address where rank 0 listens | yes |
/// | `MASTER_PORT` | TCP port where rank 0 listens, `1..=65535` (`0` picks a free port, only useful in one process) | yes |
/// | `LOCAL_RANK` | this process's index on its host: the CUDA device it drives | no |
/// | `TORCHELASTIC_USE_AGENT_STORE` | `True`: torchrun's agent serves a `TCPStore` at `MASTER_ADDR:MASTER_PORT` | no |
/// | `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT` | the job and its restart, naming the agent store's keys | no |
///
/// Without `LOCAL_RANK` the device is `RANK % device_count` (see [`LaunchEnv::device_index`]),
/// which is right when every host runs as many ranks as it has devices and ranks are numbered
/// host by host, as `torchrun` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// `LOCAL_RANK`, if set.
    pub local_rank: Option<usize>,
    /// torchrun's agent store, when `TORCHELASTIC_USE_AGENT_STORE=True`.
    pub agent_store: Option<AgentStore>,
}

/// torchrun's elastic agent serves a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT` for its
/// workers (`TORCHELASTIC_USE_AGENT_STORE=True`); the rendezvous then uses it (see the
/// [module docs](self)) instead of binding that port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentStore {
    /// `TORCHELASTIC_RUN_ID` (empty when unset).
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT`: how often torchrun restarted the workers (0 when unset).
    pub restart_count: u64,
}

impl AgentStore {
    /// Reads the `TORCHELASTIC_*` variables through `lookup`; `None` unless
    /// `TORCHELASTIC_USE_AGENT_STORE` is exactly `True` (PyTorch's own test).
    fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        if lookup("TORCHELASTIC_USE_AGENT_STORE").as_deref() != Some("True") {
            return Ok(None);
        }
        let restart_count = match lookup("TORCHELASTIC_RESTART_COUNT") {
            Some(v) => v.trim().parse::<u64>().map_err(|e| Error::Environment {
                variable: "TORCHELASTIC_RESTART_COUNT".into(),
                reason: format!("`{v}` is not a non-negative integer: {e}"),
            })?,
            None => 0,
        };
        Ok(Some(Self {
            run_id: lookup("TORCHELASTIC_RUN_ID").unwrap_or_default(),
            restart_count,
        }))
    }
}

impl LaunchEnv {
    /// Reads the variables from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads the variables through `lookup` (a variable's value, `None` when unset), so that
    /// callers and tests can supply them without touching the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| {
            lookup(name).ok_or_else(|| Error::Environment {
                variable: name.into(),
                reason: "not set (launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)".into(),
            })
        };
        let rank = parse_usize("RANK", &get("RANK")?)?;
        let world_size = parse_usize("WORLD_SIZE", &get("WORLD_SIZE")?)?;
        if world_size == 0 {
            return Err(Error::Environment {
                variable: "WORLD_SIZE".into(),
                reason: "is 0; a job has at least one rank".into(),
            });
        }
        if rank >= world_size {
            return Err(Error::Environment {
                variable: "RANK".into(),
                reason: format!("is {rank}, out of range for WORLD_SIZE={world_size}"),
            });
        }
        let master_addr = get("MASTER_ADDR")?.trim().to_string();
        if master_addr.is_empty() {
            return Err(Error::Environment {
                variable: "MASTER_ADDR".into(),
                reason: "is empty".into(),
            });
        }
        let port = get("MASTER_PORT")?;
        let master_port = port.trim().parse::<u16>().map_err(|e| Error::Environment {
            variable: "MASTER_PORT".into(),
            reason: format!("`{port}` is not a TCP port (0..=65535): {e}"),
        })?;
        let local_rank = match lookup("LOCAL_RANK") {
            Some(v) => Some(parse_usize("LOCAL_RANK", &v)?),
            None => None,
        };
        let agent_store = AgentStore::from_lookup(&lookup)?;
        Ok(Self {
            rank,
            world_size,
            master_addr,
            master_port,
            local_rank,
            agent_store,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with brackets around an IPv6 address.
    pub fn master(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }

    /// The CUDA device this rank drives among `device_count` visible devices: `LOCAL_RANK`
    /// when set, else `RANK % device_count`. Errors when there is no device or `LOCAL_RANK`
    /// names a device that does not exist.
    pub fn device_index(&self, device_count: usize) -> Result<usize> {
        if device_count == 0 {
            return Err(Error::BackendUnavailable {
                backend: "nccl".into(),
                reason: format!("rank {} sees no CUDA device", self.rank),
            });
        }
        match self.local_rank {
            Some(local) if local >= device_count => Err(Error::Environment {
                variable: "LOCAL_RANK".into(),
                reason: format!(
                    "is {local}, but this host has {device_count} visible CUDA device(s) \
                     (check CUDA_VISIBLE_DEVICES and --nproc-per-node)"
                ),
            }),
            Some(local) => Ok(local),
            None => Ok(self.rank % device_count),
        }
    }
}

fn parse_usize(variable: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|e| Error::Environment {
            variable: variable.into(),
            reason: format!("`{value}` is not a non-negative integer: {e}"),
        })
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// One rank's side of the TCP rendezvous (protocol in the [module docs](self)).
///
/// Rank 0 binds its listener when the value is created, so a port of 0 picks a free port that
/// [`TcpRendezvous::local_addr`] reports; the other ranks only connect in
/// [`TcpRendezvous::exchange`].
///
/// ```
/// use fsdp::collectives::rendezvous::TcpRendezvous;
/// use std::time::Duration;
///
/// let host = TcpRendezvous::new(0, 2, "127.0.0.1", 0)?.with_timeout(Duration::from_secs(10));
/// let port = host.local_addr().unwrap().port();
/// let peer = std::thread::spawn(move || {
///     TcpRendezvous::new(1, 2, "127.0.0.1", port)?.exchange(None)
/// });
/// assert_eq!(host.exchange(Some(b"unique id"))?, b"unique id");
/// assert_eq!(peer.join().unwrap()?, b"unique id");
/// # Ok::<(), fsdp::Error>(())
/// ```
#[derive(Debug)]
pub struct TcpRendezvous {
    rank: usize,
    world_size: usize,
    addr: String,
    timeout: Duration,
    mode: Mode,
}

/// Which protocol a [`TcpRendezvous`] speaks.
#[derive(Debug)]
enum Mode {
    /// Rank 0 listens itself (`None` on other ranks and at world size 1).
    Listen(Option<TcpListener>),
    /// Everyone is a client of torchrun's agent store.
    AgentStore {
        /// Key prefix of this rendezvous, below [`agent_store::KEY_ROOT`].
        namespace: String,
        /// Exchanges done so far: each gets its own keys.
        exchanges: AtomicU64,
    },
}

/// Rendezvous made through an agent store by this process, numbering their keys.
static AGENT_STORE_RENDEZVOUS: AtomicU64 = AtomicU64::new(0);

impl TcpRendezvous {
    /// How long [`TcpRendezvous::exchange`] waits for the other ranks by default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    /// Prepares rank `rank` of `world_size` for a rendezvous at `master_addr:master_port`;
    /// rank 0 binds the listening socket now.
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: u16,
    ) -> Result<Self> {
        let addr = host_port(master_addr, master_port);
        check_rank(rank, world_size)?;
        let listener = if rank == 0 && world_size > 1 {
            let listener = TcpListener::bind(&addr).map_err(|e| Error::Rendezvous {
                rank,
                addr: addr.clone(),
                reason: format!("rank 0 cannot listen there: {e} (is MASTER_PORT in use, and is MASTER_ADDR an address of this host?)"),
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|e| net_error(rank, &addr, "configuring the listener", e))?;
            Some(listener)
        } else {
            None
        };
        Ok(Self {
            rank,
            world_size,
            addr,
            timeout: Self::DEFAULT_TIMEOUT,
            mode: Mode::Listen(listener),
        })
    }

    /// Prepares rank `rank` of `world_size` for a rendezvous through the `TCPStore` at
    /// `master_addr:master_port` (torchrun's agent store), under keys prefixed by `namespace`,
    /// which every rank must pass alike and no earlier rendezvous on that store used.
    /// Connects only in [`TcpRendezvous::exchange`].
    pub fn with_agent_store(
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: u16,
        namespace: &str,
    ) -> Result<Self> {
        check_rank(rank, world_size)?;
        Ok(Self {
            rank,
            world_size,
            addr: host_port(master_addr, master_port),
            timeout: Self::DEFAULT_TIMEOUT,
            mode: Mode::AgentStore {
                namespace: namespace.into(),
                exchanges: AtomicU64::new(0),
            },
        })
    }

    /// The rendezvous the launcher variables call for: through torchrun's agent store when
    /// `TORCHELASTIC_USE_AGENT_STORE=True` ([`TcpRendezvous::with_agent_store`], keys named
    /// by the run id, the restart count and how many rendezvous this process made before),
    /// else with rank 0's own listener ([`TcpRendezvous::new`]).
    pub fn from_env(env: &LaunchEnv) -> Result<Self> {
        match &env.agent_store {
            Some(agent) => {
                let n = AGENT_STORE_RENDEZVOUS.fetch_add(1, Ordering::Relaxed);
                let namespace = format!("{}/attempt_{}/{n}", agent.run_id, agent.restart_count);
                Self::with_agent_store(
                    env.rank,
                    env.world_size,
                    &env.master_addr,
                    env.master_port,
                    &namespace,
                )
            }
            None => Self::new(env.rank, env.world_size, &env.master_addr, env.master_port),
        }
    }

    /// Whether this rendezvous goes through torchrun's agent store rather than rank 0's own
    /// listener.
    pub fn uses_agent_store(&self) -> bool {
        matches!(self.mode, Mode::AgentStore { .. })
    }

    /// Sets how long rank 0 waits for every rank to connect, and the others for rank 0.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The address rank 0 listens on (`None` on other ranks, at world size 1 and with the
    /// agent store).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &self.mode {
            Mode::Listen(listener) => listener.as_ref().and_then(|l| l.local_addr().ok()),
            Mode::AgentStore { .. } => None,
        }
    }

    /// Hands rank 0's `blob` to every rank and returns it. Rank 0 must pass `Some`; the
    /// others' argument is ignored (pass `None`). At world size 1 this returns the blob at once.
    pub fn exchange(&self, blob: Option<&[u8]>) -> Result<Vec<u8>> {
        let outcome = blob
            .map(<[u8]>::to_vec)
            .ok_or_else(|| "rank 0 passed no bytes to hand out (a bug in the caller)".to_string());
        match &self.mode {
            _ if self.rank == 0 && self.world_size == 1 => {
                outcome.map_err(|reason| self.mismatch(reason))
            }
            Mode::Listen(Some(listener)) => self.serve(listener, outcome),
            Mode::Listen(None) => self.join(),
            Mode::AgentStore {
                namespace,
                exchanges,
            } => {
                let n = exchanges.fetch_add(1, Ordering::Relaxed);
                let keys = agent_store::Keys::new(namespace, n);
                if self.rank == 0 {
                    self.serve_store(&keys, outcome)
                } else {
                    self.join_store(&keys)
                }
            }
        }
    }

    fn mismatch(&self, detail: String) -> Error {
        Error::CollectiveMismatch {
            rank: self.rank,
            detail: format!("rendezvous at {}: {detail}", self.addr),
        }
    }

    /// Rank 0: accepts the hellos, then answers everyone.
    fn serve(
        &self,
        listener: &TcpListener,
        outcome: std::result::Result<Vec<u8>, String>,
    ) -> Result<Vec<u8>> {
        let start = Instant::now();
        let hellos = self.accept_hellos(listener, start.checked_add(self.timeout))?;
        if let Some(problem) = hellos.first_problem {
            // Everyone connected has been told already.
            return Err(self.mismatch(problem));
        }
        let peers = hellos.peers;
        if hellos.timed_out && outcome.is_ok() {
            let missing: Vec<usize> = (1..self.world_size)
                .filter(|&r| peers[r].is_none())
                .collect();
            let waited = start.elapsed();
            let msg = timeout_payload(waited, &missing);
            for stream in peers.iter().flatten() {
                write_error(stream, STATUS_TIMEOUT, &msg);
            }
            return Err(Error::CollectiveTimeout {
                op: format!("rendezvous at {}", self.addr),
                rank: 0,
                waited,
                missing,
            });
        }
        self.answer(&peers, outcome)
    }

    /// Rank 0: accepts connections until `world_size - 1` hellos (valid or not) have come or
    /// the deadline passes, so that after a mismatch the ranks still arriving are told too.
    /// The first problem is sent at once to everyone connected so far, and to each later one.
    fn accept_hellos(&self, listener: &TcpListener, deadline: Option<Instant>) -> Result<Hellos> {
        let mut got = Hellos {
            peers: (0..self.world_size).map(|_| None).collect(),
            timed_out: false,
            first_problem: None,
        };
        let mut hellos = 0usize;
        while hellos + 1 < self.world_size {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                got.timed_out = true;
                break;
            }
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    std::thread::sleep(POLL);
                    continue;
                }
                Err(e) => return Err(net_error(0, &self.addr, "accepting a connection", e)),
            };
            let Some((world_size, rank)) = read_hello(&stream, deadline) else {
                continue; // not one of ours: ignore it
            };
            hellos += 1;
            match (
                self.hello_problem(world_size, rank, &got.peers),
                &got.first_problem,
            ) {
                (Some(problem), None) => {
                    // Fail at once everyone connected so far, and the offender.
                    write_error(&stream, STATUS_MISMATCH, problem.as_bytes());
                    for s in got.peers.iter().flatten() {
                        write_error(s, STATUS_MISMATCH, problem.as_bytes());
                    }
                    got.first_problem = Some(problem);
                }
                (_, Some(problem)) => write_error(&stream, STATUS_MISMATCH, problem.as_bytes()),
                (None, None) => got.peers[rank] = Some(stream),
            }
        }
        Ok(got)
    }

    /// What is wrong with a hello claiming `rank` of `world_size`, if anything.
    fn hello_problem(
        &self,
        world_size: usize,
        rank: usize,
        peers: &[Option<TcpStream>],
    ) -> Option<String> {
        if world_size != self.world_size {
            Some(format!(
                "rank {rank} was launched with world size {world_size}, rank 0 with {}",
                self.world_size
            ))
        } else if rank == 0 || rank >= self.world_size {
            Some(format!(
                "a peer claims rank {rank}, out of range 1..{} (two jobs on one MASTER_PORT?)",
                self.world_size
            ))
        } else if peers[rank].is_some() {
            Some(format!("rank {rank} connected twice (duplicate RANK)"))
        } else {
            None
        }
    }

    /// Rank 0: sends every connected peer rank 0's blob, or its problem.
    fn answer(
        &self,
        peers: &[Option<TcpStream>],
        outcome: std::result::Result<Vec<u8>, String>,
    ) -> Result<Vec<u8>> {
        match outcome {
            Ok(blob) => {
                for (rank, stream) in peers.iter().enumerate() {
                    if let Some(stream) = stream {
                        let mut reply = Vec::with_capacity(9 + blob.len());
                        reply.push(STATUS_OK);
                        reply.extend_from_slice(&(blob.len() as u64).to_le_bytes());
                        reply.extend_from_slice(&blob);
                        (&*stream).write_all(&reply).map_err(|e| {
                            net_error(0, &self.addr, &format!("answering rank {rank}"), e)
                        })?;
                    }
                }
                Ok(blob)
            }
            Err(problem) => {
                for stream in peers.iter().flatten() {
                    write_error(stream, STATUS_MISMATCH, problem.as_bytes());
                }
                Err(self.mismatch(problem))
            }
        }
    }

    /// Ranks other than 0: connect, say hello, wait for the answer.
    fn join(&self) -> Result<Vec<u8>> {
        let start = Instant::now();
        let deadline = start.checked_add(self.timeout);
        let timeout_err = |waited| Error::CollectiveTimeout {
            op: format!("rendezvous at {}", self.addr),
            rank: self.rank,
            waited,
            missing: vec![0],
        };
        let mut stream = loop {
            match connect_once(&self.addr) {
                Ok(s) => break s,
                Err(ConnectError::Resolve(reason)) => {
                    return Err(Error::Rendezvous {
                        rank: self.rank,
                        addr: self.addr.clone(),
                        reason,
                    })
                }
                Err(ConnectError::Retry) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(timeout_err(start.elapsed()));
                    }
                    std::thread::sleep(POLL);
                }
            }
        };
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(self.world_size as u32).to_le_bytes());
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        stream
            .write_all(&hello)
            .map_err(|e| net_error(self.rank, &self.addr, "sending the hello", e))?;
        // Rank 0 answers at its own deadline at the latest: wait a little longer than that.
        let answer_deadline = deadline.and_then(|d| d.checked_add(GRACE));
        let read = |stream: &mut TcpStream, buf: &mut [u8]| {
            read_until(stream, buf, answer_deadline).map_err(|e| match e {
                ReadError::TimedOut => timeout_err(start.elapsed()),
                ReadError::Io(e) => net_error(self.rank, &self.addr, "reading rank 0's answer", e),
            })
        };
        let mut status = [0u8; 1];
        read(&mut stream, &mut status)?;
        let mut len = [0u8; 8];
        read(&mut stream, &mut len)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_PAYLOAD {
            return Err(Error::Rendezvous {
                rank: self.rank,
                addr: self.addr.clone(),
                reason: format!("rank 0 announced {len} bytes, more than the {MAX_PAYLOAD} accepted: not an fsdp rendezvous"),
            });
        }
        let mut payload = vec![0u8; len as usize];
        read(&mut stream, &mut payload)?;
        self.decode_answer(status[0], payload)
    }

    /// Rank 0's answer (status and payload) as this rank's result.
    fn decode_answer(&self, status: u8, payload: Vec<u8>) -> Result<Vec<u8>> {
        match status {
            STATUS_OK => Ok(payload),
            STATUS_MISMATCH => Err(self.mismatch(String::from_utf8_lossy(&payload).into_owned())),
            STATUS_TIMEOUT if payload.len() >= 8 && payload.len() % 4 == 0 => {
                let waited = u64::from_le_bytes(payload[..8].try_into().unwrap_or_default());
                let missing = payload[8..]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
                    .collect();
                Err(Error::CollectiveTimeout {
                    op: format!("rendezvous at {}", self.addr),
                    rank: self.rank,
                    waited: Duration::from_millis(waited),
                    missing,
                })
            }
            other => Err(Error::Rendezvous {
                rank: self.rank,
                addr: self.addr.clone(),
                reason: format!("rank 0 answered with unknown status {other}"),
            }),
        }
    }
}

/// The payload of a timeout answer: milliseconds waited, then the missing ranks.
fn timeout_payload(waited: Duration, missing: &[usize]) -> Vec<u8> {
    let mut msg = (waited.as_millis().min(u64::MAX as u128) as u64)
        .to_le_bytes()
        .to_vec();
    for r in missing {
        msg.extend_from_slice(&(*r as u32).to_le_bytes());
    }
    msg
}

fn check_rank(rank: usize, world_size: usize) -> Result<()> {
    if rank >= world_size {
        return Err(Error::InvalidCollective {
            op: "rendezvous".into(),
            rank,
            reason: format!("rank {rank} is out of range for world size {world_size}"),
        });
    }
    if world_size > u32::MAX as usize {
        return Err(Error::InvalidCollective {
            op: "rendezvous".into(),
            rank,
            reason: format!("world size {world_size} does not fit the protocol's u32"),
        });
    }
    Ok(())
}

fn net_error(rank: usize, addr: &str, what: &str, e: std::io::Error) -> Error {
    Error::Rendezvous {
        rank,
        addr: addr.into(),
        reason: format!("{what}: {e}"),
    }
}

/// Reads a peer's hello: `(world size, rank)`, or `None` when the connection is not one of
/// ours (wrong magic, closed, silent for too long).
fn read_hello(stream: &TcpStream, deadline: Option<Instant>) -> Option<(usize, usize)> {
    let mut stream = stream.try_clone().ok()?;
    stream.set_nonblocking(false).ok()?;
    // A real peer sends its hello right after connecting; do not let a silent one stall us.
    let hello_deadline = Instant::now() + Duration::from_secs(5);
    let limit = deadline.map_or(hello_deadline, |d| d.min(hello_deadline));
    let mut hello = [0u8; 16];
    read_until(&mut stream, &mut hello, Some(limit)).ok()?;
    if &hello[..8] != MAGIC {
        return None;
    }
    let world_size = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
    let rank = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
    Some((world_size, rank))
}

/// Best effort: the peer may already be gone, and the caller fails anyway.
fn write_error(stream: &TcpStream, status: u8, payload: &[u8]) {
    let mut reply = vec![status];
    reply.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    reply.extend_from_slice(payload);
    let _ = (&*stream).write_all(&reply);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::thread;

    fn env(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|k| map.get(k).cloned())
    }

    const FULL: [(&str, &str); 5] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("LOCAL_RANK", "1"),
    ];

    #[test]
    fn launch_env_reads_torchrun_variables() {
        let e = env(&FULL).unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                master_addr: "node0".into(),
                master_port: 29500,
                local_rank: Some(1),
                agent_store: None,
            }
        );
        assert_eq!(e.master(), "node0:29500");
        assert_eq!(e.device_index(2).unwrap(), 1);
    }

    fn variable_of(err: Error) -> (String, String) {
        match err {
            Error::Environment { variable, reason } => (variable, reason),
            other => panic!("expected Error::Environment, got {other:?}"),
        }
    }

    #[test]
    fn each_missing_required_variable_is_named() {
        for name in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let vars: Vec<_> = FULL.iter().copied().filter(|(k, _)| *k != name).collect();
            let (variable, reason) = variable_of(env(&vars).unwrap_err());
            assert_eq!(variable, name);
            assert!(reason.contains("not set"), "{reason}");
        }
        // LOCAL_RANK is optional.
        let vars: Vec<_> = FULL
            .iter()
            .copied()
            .filter(|(k, _)| *k != "LOCAL_RANK")
            .collect();
        assert_eq!(env(&vars).unwrap().local_rank, None);
    }

    #[test]
    fn invalid_values_are_named_with_the_value() {
        let cases = [
            ("RANK", "-1", "`-1`"),
            ("WORLD_SIZE", "two", "`two`"),
            ("WORLD_SIZE", "0", "is 0"),
            ("RANK", "8", "out of range for WORLD_SIZE=8"),
            ("MASTER_PORT", "70000", "`70000`"),
            ("MASTER_ADDR", "  ", "empty"),
            ("LOCAL_RANK", "x", "`x`"),
        ];
        for (name, value, expected) in cases {
            let vars: Vec<_> = FULL
                .iter()
                .map(|&(k, v)| if k == name { (k, value) } else { (k, v) })
                .collect();
            let (variable, reason) = variable_of(env(&vars).unwrap_err());
            assert_eq!(variable, name, "{name}={value}");
            assert!(reason.contains(expected), "{name}={value}: {reason}");
        }
    }

    #[test]
    fn device_index_falls_back_to_rank_modulo_device_count() {
        let mut e = env(&FULL).unwrap();
        e.local_rank = None;
        assert_eq!(e.device_index(2).unwrap(), 1); // 3 % 2
        assert_eq!(e.device_index(8).unwrap(), 3);
        assert!(matches!(
            e.device_index(0),
            Err(Error::BackendUnavailable { .. })
        ));
        e.local_rank = Some(4);
        let (variable, reason) = variable_of(e.device_index(4).unwrap_err());
        assert_eq!(variable, "LOCAL_RANK");
        assert!(reason.contains("4 visible CUDA device"), "{reason}");
    }

    #[test]
    fn torchrun_agent_store_variables_are_read() {
        let with = |extra: &[(&'static str, &'static str)]| {
            let vars: Vec<_> = FULL.iter().chain(extra).copied().collect();
            env(&vars)
        };
        assert_eq!(with(&[]).unwrap().agent_store, None);
        let torchrun = [
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "b695c067"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ];
        assert_eq!(
            with(&torchrun).unwrap().agent_store,
            Some(AgentStore {
                run_id: "b695c067".into(),
                restart_count: 2,
            })
        );
        // PyTorch tests for exactly `True`.
        let off = [("TORCHELASTIC_USE_AGENT_STORE", "False")];
        assert_eq!(with(&off).unwrap().agent_store, None);
        let bare = [("TORCHELASTIC_USE_AGENT_STORE", "True")];
        assert_eq!(
            with(&bare).unwrap().agent_store,
            Some(AgentStore {
                run_id: String::new(),
                restart_count: 0,
            })
        );
        let bad = [
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "once"),
        ];
        let (variable, reason) = variable_of(with(&bad).unwrap_err());
        assert_eq!(variable, "TORCHELASTIC_RESTART_COUNT");
        assert!(reason.contains("`once`"), "{reason}");
    }

    #[test]
    fn under_torchrun_rank_zero_does_not_bind_the_agents_port() {
        // The agent's store holds MASTER_PORT; rank 0 binding it was "Address already in use".
        let agent = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = agent.local_addr().unwrap().port();
        let mut launch = LaunchEnv {
            rank: 0,
            world_size: 2,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            local_rank: Some(0),
            agent_store: Some(AgentStore {
                run_id: "run".into(),
                restart_count: 0,
            }),
        };
        let r = TcpRendezvous::from_env(&launch).unwrap();
        assert!(r.uses_agent_store());
        assert_eq!(r.local_addr(), None);
        launch.agent_store = None;
        let err = TcpRendezvous::from_env(&launch).unwrap_err();
        assert!(
            matches!(&err, Error::Rendezvous { reason, .. } if reason.contains("cannot listen")),
            "{err:?}"
        );
    }

    #[test]
    fn ipv6_master_addresses_get_brackets() {
        assert_eq!(host_port("::1", 5), "[::1]:5");
        assert_eq!(host_port("[::1]", 5), "[::1]:5");
        assert_eq!(host_port("10.0.0.1", 5), "10.0.0.1:5");
    }

    const SHORT: Duration = Duration::from_secs(20);

    /// Runs ranks `1..world_size` (with the given claimed ranks and world sizes) against a
    /// rank 0 on a free port; returns rank 0's result and the others' in order.
    fn run(
        world_size: usize,
        peers: &[(usize, usize)],
        blob: Option<&[u8]>,
        timeout: Duration,
    ) -> (Result<Vec<u8>>, Vec<Result<Vec<u8>>>) {
        let host = TcpRendezvous::new(0, world_size, "127.0.0.1", 0)
            .unwrap()
            .with_timeout(timeout);
        let port = host.local_addr().unwrap().port();
        thread::scope(|s| {
            let joins: Vec<_> = peers
                .iter()
                .map(|&(rank, ws)| {
                    s.spawn(move || {
                        TcpRendezvous::new(rank, ws, "127.0.0.1", port)?
                            .with_timeout(timeout)
                            .exchange(None)
                    })
                })
                .collect();
            let root = host.exchange(blob);
            (root, joins.into_iter().map(|j| j.join().unwrap()).collect())
        })
    }

    #[test]
    fn rank_zero_hands_its_blob_to_every_rank() {
        let id: Vec<u8> = (0..128u8).collect();
        let peers: Vec<_> = (1..4).map(|r| (r, 4)).collect();
        let (root, others) = run(4, &peers, Some(&id), SHORT);
        assert_eq!(root.unwrap(), id);
        for o in others {
            assert_eq!(o.unwrap(), id);
        }
    }

    #[test]
    fn peers_retry_until_rank_zero_listens() {
        let port = {
            // Find a free port, release it, and let the peer try it before rank 0 binds.
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let peer = thread::spawn(move || {
            TcpRendezvous::new(1, 2, "127.0.0.1", port)?
                .with_timeout(SHORT)
                .exchange(None)
        });
        thread::sleep(Duration::from_millis(300));
        let host = TcpRendezvous::new(0, 2, "127.0.0.1", port)
            .unwrap()
            .with_timeout(SHORT);
        assert_eq!(host.exchange(Some(b"late")).unwrap(), b"late");
        assert_eq!(peer.join().unwrap().unwrap(), b"late");
    }

    #[test]
    fn world_size_one_needs_no_network() {
        let r = TcpRendezvous::new(0, 1, "no-such-host.invalid", 1).unwrap();
        assert_eq!(r.local_addr(), None);
        assert_eq!(r.exchange(Some(b"x")).unwrap(), b"x");
        assert!(matches!(
            r.exchange(None),
            Err(Error::CollectiveMismatch { rank: 0, .. })
        ));
    }

    #[test]
    fn a_different_world_size_fails_every_rank() {
        let (root, others) = run(3, &[(1, 3), (2, 4)], Some(b"id"), SHORT);
        for r in std::iter::once(root).chain(others) {
            match r {
                Err(Error::CollectiveMismatch { detail, .. }) => {
                    assert!(detail.contains("world size 4, rank 0 with 3"), "{detail}")
                }
                other => panic!("expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_duplicate_rank_fails_every_rank() {
        let (root, others) = run(3, &[(1, 3), (1, 3)], Some(b"id"), SHORT);
        for r in std::iter::once(root).chain(others) {
            match r {
                Err(Error::CollectiveMismatch { detail, .. }) => {
                    assert!(detail.contains("rank 1 connected twice"), "{detail}")
                }
                other => panic!("expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn timeout_names_the_ranks_that_never_came() {
        let (root, others) = run(4, &[(2, 4)], Some(b"id"), Duration::from_millis(500));
        for (who, r) in std::iter::once(root).chain(others).enumerate() {
            match r {
                Err(Error::CollectiveTimeout { missing, op, .. }) => {
                    assert_eq!(missing, [1, 3], "result {who}");
                    assert!(op.starts_with("rendezvous at 127.0.0.1:"), "{op}");
                }
                other => panic!("expected a timeout, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_peer_without_rank_zero_times_out_naming_rank_zero() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let err = TcpRendezvous::new(2, 3, "127.0.0.1", port)
            .unwrap()
            .with_timeout(Duration::from_millis(200))
            .exchange(None)
            .unwrap_err();
        assert!(
            matches!(&err, Error::CollectiveTimeout { rank: 2, missing, .. } if missing == &[0]),
            "{err:?}"
        );
    }

    #[test]
    fn rank_zero_without_a_blob_fails_everyone() {
        let (root, others) = run(2, &[(1, 2)], None, SHORT);
        for r in std::iter::once(root).chain(others) {
            assert!(
                matches!(&r, Err(Error::CollectiveMismatch { detail, .. }) if detail.contains("passed no bytes")),
                "{r:?}"
            );
        }
    }

    #[test]
    fn strangers_on_the_port_are_ignored() {
        let host = TcpRendezvous::new(0, 2, "127.0.0.1", 0)
            .unwrap()
            .with_timeout(SHORT);
        let port = host.local_addr().unwrap().port();
        thread::scope(|s| {
            s.spawn(move || {
                let mut stranger = TcpStream::connect(("127.0.0.1", port)).unwrap();
                stranger.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                thread::sleep(Duration::from_millis(100));
                TcpRendezvous::new(1, 2, "127.0.0.1", port)
                    .unwrap()
                    .with_timeout(SHORT)
                    .exchange(None)
                    .unwrap()
            });
            assert_eq!(host.exchange(Some(b"ok")).unwrap(), b"ok");
        });
    }

    #[test]
    fn a_taken_port_is_a_typed_error() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let err = TcpRendezvous::new(0, 2, "127.0.0.1", port).unwrap_err();
        assert!(
            matches!(&err, Error::Rendezvous { rank: 0, reason, .. } if reason.contains("cannot listen")),
            "{err:?}"
        );
        let err = TcpRendezvous::new(2, 2, "127.0.0.1", port).unwrap_err();
        assert!(matches!(err, Error::InvalidCollective { .. }), "{err:?}");
    }
}
