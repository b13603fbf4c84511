//! The MPI column of the side-by-side bench: the crate's two ranks as two processes under
//! `mpirun` (`MpiProcessGroup`), running the thread column's own [`prepare_rank`] and
//! [`run_op`].
//!
//! The bench launches `mpirun --allow-run-as-root --oversubscribe -np 2` on its own executable
//! once per operation, with [`WORKER_ENV`] set; each process is then one rank ([`worker`]).
//! In each launch both processes build their inputs, return cached buffers to the system,
//! reset VmHWM (`/proc/self/clear_refs` ← "5"), make one **cold** call (the first of that
//! operation in the fresh processes; its VmHWM is the peak reported, per process), then
//! `reps` warm calls. Every call is timed on rank 0 from a barrier before it to a barrier after
//! it. Over the warm calls a [`Counted`] wrapper around the `MpiProcessGroup` records, per
//! collective, the calls, the payload bytes (send plus receive buffers of this rank) and the
//! time spent inside them, so the table can tell time in MPI transfers from time in copies and
//! planning (the rest of the wall time).
// Without `mpi` only the stubs (`column`, `worker`) and the table run; the measuring half is
// still compiled, so that it stays checked.
#![cfg_attr(not(feature = "mpi"), allow(dead_code, unused_imports))]

use super::{model, prepare_rank, reset_hwm, run_op, status_bytes, Inputs, Op, RankState, WORLD};
use fsdp::collectives::{ProcessGroup, ReduceOp};
use fsdp::DType;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Environment variable that turns the bench executable into one MPI rank:
/// `op,layers,reps,save_path`.
pub const WORKER_ENV: &str = "FSDP_SBS_MPI";

/// Calls, payload bytes and seconds inside one kind of collective.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Traffic {
    pub calls: u64,
    pub bytes: u64,
    pub secs: f64,
}

/// One operation measured under `mpirun`, as rank 0 reports it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct OpResult {
    /// Warm repetitions (s), barrier to barrier on rank 0.
    pub times: Vec<f64>,
    /// The first call in the fresh processes (s).
    pub cold: f64,
    /// VmHWM after the cold call, per process (bytes).
    pub peaks: Vec<u64>,
    /// VmRSS just before the cold call, per process (bytes).
    pub befores: Vec<u64>,
    /// Whether every process could reset VmHWM.
    pub reset_ok: bool,
    /// Rank 0's collectives over all warm repetitions, by collective name.
    pub traffic: BTreeMap<String, Traffic>,
    /// Consolidation only: what MPI alone takes to gather the same bytes.
    pub gather_baseline: Option<GatherBaseline>,
}

/// `gather_into` of the full dict's tensor bytes to rank 0 (each rank sending its share from
/// a warm buffer into the root's warm buffer), barrier to barrier, median: what MPI itself
/// moves, without the crate's planning or copies.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct GatherBaseline {
    /// Bytes the root ends with.
    pub bytes: u64,
    /// Seconds in one call.
    pub one_call: f64,
    /// As many equal calls as the consolidation made `gather_into` calls.
    pub calls: u64,
    /// Seconds in that many calls.
    pub in_calls: f64,
}

impl OpResult {
    /// Rank 0's collectives per warm repetition, summed over kinds.
    pub fn traffic_per_rep(&self) -> Traffic {
        let n = self.times.len().max(1) as f64;
        let t = self
            .traffic
            .values()
            .fold(Traffic::default(), |a, t| Traffic {
                calls: a.calls + t.calls,
                bytes: a.bytes + t.bytes,
                secs: a.secs + t.secs,
            });
        Traffic {
            calls: (t.calls as f64 / n).round() as u64,
            bytes: (t.bytes as f64 / n).round() as u64,
            secs: t.secs / n,
        }
    }
}

/// What the MPI column holds for one model size.
pub enum Column {
    /// The bench was built without the `mpi` feature.
    #[cfg_attr(feature = "mpi", allow(dead_code))] // made only without the feature
    NotBuilt,
    /// Built with it, but the launch failed (no `mpirun`, or a rank failed): why.
    Failed(String),
    /// The four operations, in [`super::OPS`] order.
    Measured(Vec<OpResult>),
}

/// A [`ProcessGroup`] that forwards to `inner` and records every collective's payload bytes
/// and time, so the bench can split an operation's wall time into MPI transfers and the rest.
pub struct Counted {
    inner: Arc<dyn ProcessGroup>,
    stats: Mutex<BTreeMap<String, Traffic>>,
}

impl Counted {
    pub fn new(inner: Arc<dyn ProcessGroup>) -> Self {
        Counted {
            inner,
            stats: Mutex::new(BTreeMap::new()),
        }
    }

    /// The figures so far, leaving the counters at zero.
    pub fn take(&self) -> BTreeMap<String, Traffic> {
        std::mem::take(&mut *self.stats.lock().expect("stats lock"))
    }

    /// Runs one collective, recording it under `name` with `bytes` of payload.
    fn count<T>(&self, name: &str, bytes: usize, call: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = call();
        self.record(name, bytes, start);
        out
    }

    /// Records one call of `name` that started at `start` and moved `bytes`.
    fn record(&self, name: &str, bytes: usize, start: Instant) {
        let secs = start.elapsed().as_secs_f64();
        let mut stats = self.stats.lock().expect("stats lock");
        let t = stats.entry(name.to_string()).or_default();
        t.calls += 1;
        t.bytes += bytes as u64;
        t.secs += secs;
    }
}

impl ProcessGroup for Counted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> fsdp::Result<()> {
        let n = send.len() + recv.len();
        self.count("all_gather_into", n, || {
            self.inner.all_gather_into(send, recv)
        })
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> fsdp::Result<()> {
        let n = buf.len();
        self.count("broadcast", n, || self.inner.broadcast(buf, root))
    }

    fn all_gather_bytes(&self, send: &[u8]) -> fsdp::Result<Vec<Vec<u8>>> {
        let start = Instant::now();
        let out = self.inner.all_gather_bytes(send);
        let got: usize = out.as_ref().map_or(0, |v| v.iter().map(Vec::len).sum());
        self.record("all_gather_bytes", send.len() + got, start);
        out
    }

    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> fsdp::Result<Vec<u8>> {
        let start = Instant::now();
        let out = self.inner.broadcast_bytes(send, root);
        let n = send.map_or(0, <[u8]>::len) + out.as_ref().map_or(0, Vec::len);
        self.record("broadcast_bytes", n, start);
        out
    }

    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> fsdp::Result<()> {
        let n = send.len() + recv.as_ref().map_or(0, |r| r.len());
        self.count("gather_into", n, || {
            self.inner.gather_into(send, recv, root)
        })
    }

    fn scatter_into(
        &self,
        send: Option<&[&[u8]]>,
        recv: &mut [u8],
        root: usize,
    ) -> fsdp::Result<()> {
        let sent: usize = send.map_or(0, |s| s.iter().map(|p| p.len()).sum());
        let n = sent + recv.len();
        self.count("scatter_into", n, || {
            self.inner.scatter_into(send, recv, root)
        })
    }

    fn reduce_scatter_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> fsdp::Result<()> {
        let n = send.len() + recv.len();
        self.count("reduce_scatter_into", n, || {
            self.inner.reduce_scatter_into(send, recv, dtype, op)
        })
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> fsdp::Result<()> {
        let n = buf.len();
        self.count("all_reduce", n, || self.inner.all_reduce(buf, dtype, op))
    }

    fn barrier(&self) -> fsdp::Result<()> {
        self.count("barrier", 0, || self.inner.barrier())
    }

    fn new_subgroup(&self, ranks: &[usize]) -> fsdp::Result<Option<Arc<dyn ProcessGroup>>> {
        self.count("new_subgroup", 0, || self.inner.new_subgroup(ranks))
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}

/// Seconds of one call of `op` on every rank, on rank 0 from a barrier before to a barrier
/// after (saving first removes the previous file, untimed, as the thread column does).
fn timed(world: &dyn ProcessGroup, st: &RankState, op: Op, inputs: &Inputs) -> f64 {
    if op == Op::Save && world.rank() == 0 {
        let _ = std::fs::remove_file(&inputs.save_path);
    }
    world.barrier().expect("barrier before");
    let start = Instant::now();
    run_op(st, op, inputs);
    world.barrier().expect("barrier after");
    start.elapsed().as_secs_f64()
}

/// Median seconds (over `reps`) to gather `total` bytes to rank 0 in `calls` equal
/// `gather_into` calls (see [`GatherBaseline`]).
#[cfg(feature = "mpi")]
fn gather_baseline(world: &dyn ProcessGroup, total: usize, calls: usize, reps: usize) -> f64 {
    let ws = world.world_size();
    let per_call = total / ws / calls;
    let send = vec![1u8; per_call * calls];
    let mut recv = (world.rank() == 0).then(|| vec![0u8; send.len() * ws]);
    let times = (0..reps.max(1))
        .map(|_| {
            world.barrier().expect("barrier before");
            let start = Instant::now();
            for (i, part) in send.chunks_exact(per_call).enumerate() {
                let recv = recv
                    .as_deref_mut()
                    .map(|r| &mut r[i * per_call * ws..(i + 1) * per_call * ws]);
                world.gather_into(part, recv, 0).expect("baseline gather");
            }
            world.barrier().expect("barrier after");
            start.elapsed().as_secs_f64()
        })
        .collect();
    super::median(times)
}

/// One rank of an MPI launch (`spec` is [`WORKER_ENV`]'s value): measures one operation and,
/// on rank 0, prints `SBS_MPI <json of OpResult>`.
#[cfg(feature = "mpi")]
pub fn worker(spec: &str) {
    use fsdp::collectives::{MpiProcessGroup, ProcessGroupExt};
    let mut it = spec.splitn(4, ',');
    let mut field = || it.next().expect("FSDP_SBS_MPI: op,layers,reps,save_path");
    let op = Op::parse(field());
    let layers: usize = field().parse().expect("layers");
    let reps: usize = field().parse().expect("reps");
    let save_path = std::path::PathBuf::from(field());

    let world: Arc<dyn ProcessGroup> = Arc::new(MpiProcessGroup::world().expect("MPI world"));
    assert_eq!(world.world_size(), WORLD, "run under mpirun -np {WORLD}");
    let counted = Arc::new(Counted::new(world.clone()));
    let (model, policy) = model(layers);
    let full = super::full_adam_state(&model);
    let full_bytes = full.tensor_bytes();
    let st = prepare_rank(counted.clone(), &model, &policy, &full, &[op]);
    // Each process keeps its own full dict only for shard_full (as each PyTorch process does).
    let inputs = Inputs {
        full: (op == Op::ShardFull).then(|| Arc::new(full)),
        save_path,
    };
    fsdp::tensor::release_cached_buffers();
    let reset_ok = reset_hwm();
    let before = status_bytes("VmRSS:");
    let cold = timed(&*world, &st, op, &inputs);
    let peak = status_bytes("VmHWM:");
    counted.take();
    let times: Vec<f64> = (0..reps)
        .map(|_| timed(&*world, &st, op, &inputs))
        .collect();
    let traffic = counted.take();
    drop(st);
    drop(inputs);
    let gather_baseline = (op == Op::Consolidate).then(|| {
        let calls = traffic.get("gather_into").map_or(0, |t| t.calls) / reps.max(1) as u64;
        GatherBaseline {
            bytes: full_bytes as u64,
            one_call: gather_baseline(&*world, full_bytes, 1, reps),
            calls,
            in_calls: gather_baseline(&*world, full_bytes, calls.max(1) as usize, reps),
        }
    });
    let per_rank = world
        .all_gather_object(&(before, peak, reset_ok))
        .expect("gathering the peaks");
    if world.rank() == 0 {
        let result = OpResult {
            times,
            cold,
            peaks: per_rank.iter().map(|r| r.1).collect(),
            befores: per_rank.iter().map(|r| r.0).collect(),
            reset_ok: per_rank.iter().all(|r| r.2),
            traffic,
            gather_baseline,
        };
        println!(
            "SBS_MPI {}",
            serde_json::to_string(&result).expect("result as JSON")
        );
    }
}

/// Measures every operation of [`super::OPS`] at `layers` under `mpirun -np 2`, one launch
/// per operation.
#[cfg(feature = "mpi")]
pub fn column(layers: usize, reps: usize, save_reps: usize, save_path: &Path) -> Column {
    let mut results = Vec::new();
    for op in super::OPS {
        let n = if op == Op::Save { save_reps } else { reps };
        match launch(op, layers, n, save_path) {
            Ok(r) => results.push(r),
            Err(why) => return Column::Failed(why),
        }
    }
    let _ = std::fs::remove_file(save_path);
    Column::Measured(results)
}

#[cfg(not(feature = "mpi"))]
pub fn column(_layers: usize, _reps: usize, _save_reps: usize, _save_path: &Path) -> Column {
    Column::NotBuilt
}

/// Open MPI's `mpi_yield_when_idle` for the launches: `SBS_MPI_YIELD`, default 1. A waiting
/// rank that spins (0) takes a core from the rank it waits for whenever the cores are shared
/// (2 cores, other jobs running): on this machine under load every collective then costs
/// about a scheduler time slice, 2-4x the whole op's time with yielding.
pub fn yield_when_idle() -> String {
    std::env::var("SBS_MPI_YIELD").unwrap_or_else(|_| "1".into())
}

/// `mpirun -np 2` on this executable as a worker measuring `op`.
#[cfg(feature = "mpi")]
fn launch(op: Op, layers: usize, reps: usize, save_path: &Path) -> Result<OpResult, String> {
    use std::process::Command;
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let spec = format!("{},{layers},{reps},{}", op.name(), save_path.display());
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(WORLD.to_string())
        // mpirun ends the job itself if a rank hangs.
        .args(["--timeout", "3600"])
        // Containers usually forbid the cross-memory-attach single copy (as tests/mpi.rs).
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(["--mca", "mpi_yield_when_idle", &yield_when_idle()])
        .args(["-x", WORKER_ENV])
        .arg(&exe)
        .env(WORKER_ENV, spec)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .map_err(|e| format!("running mpirun (is Open MPI installed?): {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("SBS_MPI "));
    match line {
        Some(json) if out.status.success() => {
            serde_json::from_str(json).map_err(|e| format!("rank 0's JSON: {e}"))
        }
        _ => Err(format!(
            "mpirun for {} failed ({}): {}",
            op.name(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

#[cfg(not(feature = "mpi"))]
pub fn worker(_spec: &str) {
    eprintln!("side_by_side: {WORKER_ENV} is set, but this bench was built without `mpi`");
    std::process::exit(2);
}

/// Columns of the markdown rows [`print_table`] returns.
pub const MARKDOWN_HEADER: &str = "params | op | PyTorch | threads | MPI warm | MPI cold | \
     speed-up (PyTorch / MPI warm) | peak per process PyTorch max / MPI max (MPI sum) | \
     rank 0's collectives per call: calls, MB, s | targets";

/// Prints the MPI column beside PyTorch and the thread column (`thread_med`, in
/// [`super::OPS`] order) and returns its markdown rows.
pub fn print_table(
    col: &Column,
    pyres: &serde_json::Value,
    thread_med: &[f64],
    numel: usize,
    load: &str,
) -> Vec<String> {
    let results = match col {
        Column::NotBuilt => {
            println!(
                "MPI column: not built (needs `cargo bench --features mpi --bench side_by_side` \
                 and Open MPI)"
            );
            return vec![format!("| {numel} | all | MPI column not built |")];
        }
        Column::Failed(why) => {
            println!("MPI column: FAILED: {why}");
            return vec![format!(
                "| {numel} | all | MPI column failed (see the log) |"
            )];
        }
        Column::Measured(results) => results,
    };
    println!(
        "MPI column: the crate's {WORLD} ranks as {WORLD} processes (mpirun, MpiProcessGroup), \
         one launch per op, mpi_yield_when_idle {}, load {load}; clear_refs reset ok: {}",
        yield_when_idle(),
        results.iter().all(|r| r.reset_ok)
    );
    println!(
        "{:<13} {:>8} {:>8} {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} | {:>6} {:>9} {:>8} {:>8} | targets",
        "op", "torch s", "thread s", "mpi s", "cold s", "speedup", "torch GB", "mpi GB", "mpi sum",
        "calls", "coll MB", "coll s", "rest s",
    );
    let mut rows = Vec::new();
    for ((op, r), thread_t) in super::OPS.iter().zip(results).zip(thread_med) {
        let p = &pyres["ops"][op.name()];
        let py_t = super::py_median(p);
        let py_peak = super::py_per_rank(p, "peak_rss")
            .into_iter()
            .max()
            .unwrap_or(0);
        let warm = super::median(r.times.clone());
        let speedup = py_t / warm;
        let (peak_max, peak_sum) = (
            r.peaks.iter().copied().max().unwrap_or(0),
            r.peaks.iter().sum::<u64>(),
        );
        let t = r.traffic_per_rep();
        let time_target = match op {
            Op::Consolidate | Op::ShardedLoad => Some(("≥10×", speedup >= 10.0)),
            Op::ShardFull => Some(("≥3×", speedup >= 3.0)),
            Op::Save => None,
        };
        let yes = |b: bool| if b { "met" } else { "MISSED" };
        let verdict = format!(
            "time {}; peak per process: {}",
            time_target.map_or("(none)".to_string(), |(t, ok)| format!("{t}: {}", yes(ok))),
            yes(peak_max < py_peak)
        );
        println!(
            "{:<13} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>7.1}× | {:>8} {:>8} {:>8} | {:>6} {:>9.1} {:>8.3} {:>8.3} | {verdict}",
            op.name(),
            py_t,
            thread_t,
            warm,
            r.cold,
            speedup,
            super::gb(py_peak),
            super::gb(peak_max),
            super::gb(peak_sum),
            t.calls,
            t.bytes as f64 / 1e6,
            t.secs,
            (warm - t.secs).max(0.0),
        );
        rows.push(format!(
            "| {numel} | {} | {py_t:.3} s | {thread_t:.3} s | {warm:.3} s | {:.3} s | {speedup:.1}× | {} / {} ({}) GB | {}, {:.1} MB, {:.3} s | {verdict} |",
            op.name(),
            r.cold,
            super::gb(py_peak),
            super::gb(peak_max),
            super::gb(peak_sum),
            t.calls,
            t.bytes as f64 / 1e6,
            t.secs,
        ));
    }
    if let Some(b) = results.iter().find_map(|r| r.gather_baseline) {
        println!(
            "MPI baseline: gathering the full dict's {} tensor bytes to rank 0 with \
             gather_into (warm buffers, no crate code): one call {:.3} s ({:.2} GB/s); {} \
             equal calls (as many as consolidation makes) {:.3} s ({:.2} GB/s)",
            b.bytes,
            b.one_call,
            b.bytes as f64 / b.one_call / 1e9,
            b.calls,
            b.in_calls,
            b.bytes as f64 / b.in_calls / 1e9,
        );
    }
    println!("MPI detail (rank 0, per warm call; bytes = send + receive buffers):");
    for (op, r) in super::OPS.iter().zip(results) {
        let n = r.times.len().max(1) as f64;
        let kinds: Vec<String> = r
            .traffic
            .iter()
            .map(|(name, t)| {
                format!(
                    "{name} {:.0}× {:.1} MB {:.4} s",
                    t.calls as f64 / n,
                    t.bytes as f64 / n / 1e6,
                    t.secs / n
                )
            })
            .collect();
        println!(
            "  {:<13} repetitions (s): {}; peaks {:?} B, RSS before {:?} B; {}",
            op.name(),
            r.times
                .iter()
                .map(|t| format!("{t:.4}"))
                .collect::<Vec<_>>()
                .join(" "),
            r.peaks,
            r.befores,
            kinds.join("; ")
        );
    }
    rows
}
