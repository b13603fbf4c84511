//! Side by side with PyTorch: the same synthetic model's Adam state through real PyTorch 2.13
//! FSDP (CPU, gloo, two processes; `benches/pytorch_side_by_side.py`) and through this crate,
//! with its two ranks as threads of one process and, built with `mpi`, as two MPI processes,
//! in one run.
//!
//! Run: `cargo bench --bench side_by_side` (needs `.venv/bin/python` with torch 2.13, from
//! `scripts/setup-venv.sh`, or a Python named by `FSDP_PYTHON`); `cargo bench --features mpi
//! --bench side_by_side` adds the MPI column (needs Open MPI's `mpirun`; without the feature
//! the column says it was not built). `SBS_LAYERS=16,64` picks the
//! sizes, `SBS_REPS=5` the repetitions, `SBS_SAVE_REPS=9` those of saving and of the raw
//! write+fsync baseline (writes vary most on a shared disk).
//!
//! **Model.** `layers` = L units `layers.{i}` of an `nn.Linear(1526, 1024)`: `weight`
//! [1024, 1526] and `bias` [1024], one FSDP unit per layer, `use_orig_params=False`, world size
//! 2. L = 16 gives 25,018,368 parameters, L = 64 gives 100,073,472. Adam state after one step:
//! per flat parameter `exp_avg`, `exp_avg_sq` (the flat shard, f32) and `step` (0-dim f32),
//! plus one param group. PyTorch steps a real `torch.optim.Adam` once on deterministic
//! gradients; the crate shards a full dict of that structure
//! (`shard_full_optim_state_dict`) and deep-copies it into each rank's own buffers.
//!
//! **Operations** (the same four on both sides):
//! - `consolidate`: `full_optim_state_dict(rank0_only=True)` on every rank;
//! - `sharded_load`: `optim_state_dict_to_load` under `SHARDED_STATE_DICT` /
//!   `StateDictType::Sharded`, of this rank's `optim_state_dict` output under the same type
//!   (made untimed);
//! - `shard_full`: `shard_full_optim_state_dict` of the full dict on every rank (PyTorch: each
//!   process holds its copy; crate: the threads share one);
//! - `save`: rank 0 writes the full dict: `torch.save` + `os.fsync` for PyTorch,
//!   `fsdp::io::torch_save::save_optim_state_dict` (temp file, `sync_all`, rename, directory
//!   sync) for the crate.
//!
//! **Time**: wall clock on the main thread from releasing the ranks to the last rank reporting
//! done (PyTorch: rank 0 between two barriers). Both sides run each op `SBS_REPS` times in a
//! row (saving `SBS_SAVE_REPS` times, each to a new file: the previous one is removed
//! untimed) and the table shows the **median**; the crate's rank threads live across repetitions
//! (from the second one on, output buffers come from the crate's buffer cache). The crate's
//! "cold" column is one call in a fresh child process (page faults of fresh memory included).
//!
//! **Peak RSS**: PyTorch: per process, `/proc/self/clear_refs` ← "5" (resets VmHWM) before each
//! repetition, VmHWM after it; the table sums the two processes' maxima. Crate: each op runs
//! once in a fresh child process of this binary (both thread ranks in it), which builds its
//! inputs, returns cached buffers to the system, resets VmHWM the same way, runs the op and
//! reads VmHWM. "Δ" columns are the peak minus VmRSS just before the op (the op's own cost);
//! the absolute figure includes what the process holds (PyTorch: libtorch, the model's flat
//! shards and the optimizer; crate: each rank's optimizer state and the op's input).
//!
//! **Baselines** for the same byte count, measured in this run: `memcpy` between two warm
//! buffers (one thread) for the full dict's tensor bytes, and `write+fsync`: `std::fs::File`
//! `write_all` of a warm buffer the size of the crate's saved file into a new file, then
//! `sync_all`, alternating with the crate's saves so that both meet the same disk (median).
//!
//! **Targets** (issue 3): consolidation and SHARDED load ≥ 10× faster than PyTorch,
//! shard-from-full ≥ 3×, saving at ≥ 0.5× the raw write+fsync bandwidth (crate save time vs
//! raw write time, same byte count within 0.01%), and peak memory below PyTorch's on every
//! step. The table judges the absolute peak and, separately, Δ; Δ is not comparable one to one
//! (PyTorch's allocator reuses memory already resident from earlier work, so its Δ can be
//! smaller than the output it creates; the crate's Δ for consolidation and SHARDED load is its
//! output).
//!
//! **MPI column** (feature `mpi`; `side_by_side/mpi.rs`): the same four ops with the crate's two
//! ranks as two processes, `mpirun --allow-run-as-root --oversubscribe -np 2` on this binary
//! (one launch per op, `MpiProcessGroup`), running the thread column's own per-rank functions
//! (`prepare_rank`, `run_op`, over `Arc<dyn ProcessGroup>`). Each process holds what one
//! PyTorch process holds: its rank's state and, for `shard_full`, its own full dict. Time: on
//! rank 0 from a barrier before each call to a barrier after it; the median of the same
//! repetitions; "cold" is the first call in the fresh processes. Peak RSS: VmHWM after the
//! cold call (reset through `clear_refs` just before it), per process; the table shows the max
//! and the sum and judges the max against PyTorch's largest process. A counting wrapper around
//! the `MpiProcessGroup` gives rank 0's collectives per call (calls, send + receive bytes,
//! seconds inside them; the rest of the wall time is copies and planning), and a baseline
//! gathers the full dict's bytes to rank 0 with bare `gather_into` calls (one call, and as many
//! as consolidation makes). The launches pass `--mca mpi_yield_when_idle 1` (`SBS_MPI_YIELD`
//! overrides it): ranks that spin while waiting steal the shared cores from each other.
//!
//! Files go to `target/side_by_side/`.
//!
//! Measured (`cargo bench --bench side_by_side`, 2-core VM, 1-min load average 1.6–1.8; medians;
//! peak RSS: PyTorch's two processes summed / the crate's one process):
//!
//! | params | op | PyTorch | crate | speed-up | target | peak RSS PyTorch / crate |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | 25.0M | consolidate | 0.193 s | 0.012 s | 16.7× | ≥ 10×: met | 2.33 / 0.40 GB |
//! | 25.0M | sharded_load | 0.207 s | 0.017 s | 12.1× | ≥ 10×: met | 2.65 / 0.80 GB |
//! | 25.0M | shard_full | 0.084 s | 0.005 s | 15.3× | ≥ 3×: met | 3.13 / 0.40 GB |
//! | 25.0M | save | 0.139 s | 0.119 s | 1.2× | 0.87× raw (≥ 0.5×): met | 2.92 / 0.40 GB |
//! | 100.1M | consolidate | 0.586 s | 0.045 s | 13.1× | ≥ 10×: met | 4.58 / 1.61 GB |
//! | 100.1M | sharded_load | 0.786 s | 0.074 s | 10.7× | ≥ 10×: met | 5.08 / 3.21 GB |
//! | 100.1M | shard_full | 0.381 s | 0.021 s | 17.8× | ≥ 3×: met | 6.87 / 1.61 GB |
//! | 100.1M | save | 0.523 s | 0.440 s | 1.2× | 0.86× raw (≥ 0.5×): met | 6.47 / 1.61 GB |
//!
//! Raw write+fsync in that run: 1.92 GB/s (25M), 2.11 GB/s (100M); memcpy 16.6 / 19.8 GB/s.
//! First calls, saving under load, and Δ: see README.md, "Side-by-side with PyTorch".

mod common;
#[path = "side_by_side/mpi.rs"]
mod mpi_column;
use common::{deep_copy, filled, reset_hwm, status_bytes, venv_python};

use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamGroup, ParamKey, ParamState,
    StateDictType, Value, WrapPolicy,
};
use indexmap::IndexMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

const OUT: usize = 1024;
const IN: usize = 1526;
const WORLD: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Consolidate,
    ShardedLoad,
    ShardFull,
    Save,
}

const OPS: [Op; 4] = [Op::Consolidate, Op::ShardedLoad, Op::ShardFull, Op::Save];

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Consolidate => "consolidate",
            Op::ShardedLoad => "sharded_load",
            Op::ShardFull => "shard_full",
            Op::Save => "save",
        }
    }
    fn parse(s: &str) -> Op {
        *OPS.iter()
            .find(|o| o.name() == s)
            .unwrap_or_else(|| panic!("unknown op {s}"))
    }
}

fn model(layers: usize) -> (ModelDesc, WrapPolicy) {
    let mut m = ModelDesc::new();
    let mut units = Vec::new();
    for i in 0..layers {
        m = m
            .param(&format!("layers.{i}.weight"), &[OUT, IN], DType::F32)
            .param(&format!("layers.{i}.bias"), &[OUT], DType::F32);
        units.push(format!("layers.{i}"));
    }
    (m, WrapPolicy::units(&units))
}

/// The full Adam state dict after one step, with `torch.optim.Adam`'s param group.
fn full_adam_state(model: &ModelDesc) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let mut st = ParamState::new();
        st.insert("exp_avg".into(), Value::Tensor(filled(&p.shape, i as f32)));
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(filled(&p.shape, 0.5 + i as f32)),
        );
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(1.0f32)));
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    let options: IndexMap<String, Value> = [
        ("lr", Value::Float(1e-3)),
        (
            "betas",
            Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
        ),
        ("eps", Value::Float(1e-8)),
        ("weight_decay", Value::Float(0.0)),
        ("amsgrad", Value::Bool(false)),
        ("maximize", Value::Bool(false)),
        ("foreach", Value::None),
        ("capturable", Value::Bool(false)),
        ("differentiable", Value::Bool(false)),
        ("fused", Value::None),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let params = model
        .params
        .iter()
        .map(|p| ParamKey::Name(p.name.clone()))
        .collect();
    sd.param_groups = Some(vec![ParamGroup { options, params }]);
    sd
}

/// What the ranks hold for the op being measured.
struct Inputs {
    /// Shared full dict (for `shard_full`).
    full: Option<Arc<OptimStateDict>>,
    /// Where rank 0 saves.
    save_path: PathBuf,
}

/// Rank threads that live across repetitions. Each holds its `Fsdp` (state-dict type
/// `Sharded`), its local optimizer state, and the inputs its ops need.
struct Cluster {
    commands: Vec<mpsc::Sender<Op>>,
    done: mpsc::Receiver<()>,
    threads: Vec<thread::JoinHandle<()>>,
}

/// Per-rank state prepared before an op, as a child or the timing cluster needs it.
struct RankState {
    fsdp: Fsdp,
    params: fsdp::optim_state::OptimParams,
    local: OptimStateDict,
    sharded: Option<OptimStateDict>,
    full0: Option<OptimStateDict>,
}

/// Prepares one rank over any process group: the thread column's rank threads and the MPI
/// column's processes run this same function, and then the same [`run_op`].
fn prepare_rank(
    pg: Arc<dyn ProcessGroup>,
    model: &ModelDesc,
    policy: &WrapPolicy,
    full: &OptimStateDict,
    ops: &[Op],
) -> RankState {
    let mut fsdp = Fsdp::new(model, policy, pg).expect("Fsdp::new");
    let params = fsdp.optim_params();
    let local = deep_copy(
        &fsdp
            .shard_full_optim_state_dict(full, &params)
            .expect("initial shard"),
    );
    fsdp.set_state_dict_type(StateDictType::Sharded, None)
        .expect("set_state_dict_type");
    let sharded = ops.contains(&Op::ShardedLoad).then(|| {
        fsdp.optim_state_dict(&local, &params)
            .expect("optim_state_dict (sharded)")
            .expect("a sharded dict on every rank")
    });
    let full0 = if ops.contains(&Op::Save) {
        fsdp.full_optim_state_dict(&local, &params, true)
            .expect("consolidating for save")
    } else {
        None
    };
    RankState {
        fsdp,
        params,
        local,
        sharded,
        full0,
    }
}

/// One rank's part of `op` (the body both columns time).
fn run_op(st: &RankState, op: Op, inputs: &Inputs) {
    let rank = st.fsdp.rank();
    match op {
        Op::Consolidate => {
            let out = st
                .fsdp
                .full_optim_state_dict(&st.local, &st.params, true)
                .unwrap_or_else(|e| panic!("rank {rank}: consolidate: {e}"));
            assert_eq!(out.is_some(), rank == 0);
            black_box(out);
        }
        Op::ShardedLoad => {
            let out = st
                .fsdp
                .optim_state_dict_to_load(st.sharded.as_ref(), &st.params)
                .unwrap_or_else(|e| panic!("rank {rank}: sharded load: {e}"));
            black_box(out);
        }
        Op::ShardFull => {
            let full = inputs.full.as_ref().expect("full dict held");
            let out = st
                .fsdp
                .shard_full_optim_state_dict(full, &st.params)
                .unwrap_or_else(|e| panic!("rank {rank}: shard: {e}"));
            black_box(out);
        }
        Op::Save => {
            if let Some(full) = &st.full0 {
                fsdp::io::torch_save::save_optim_state_dict(full, &inputs.save_path)
                    .unwrap_or_else(|e| panic!("rank 0: save: {e}"));
            }
        }
    }
}

impl Cluster {
    fn new(layers: usize, full: Arc<OptimStateDict>, save_path: PathBuf) -> Self {
        let (model, policy) = model(layers);
        let (model, policy) = (Arc::new(model), Arc::new(policy));
        let (done_tx, done) = mpsc::channel();
        let mut commands = Vec::new();
        let mut threads = Vec::new();
        for pg in ThreadGroup::new(WORLD) {
            let (tx, rx) = mpsc::channel::<Op>();
            commands.push(tx);
            let (model, policy, full, done_tx, save_path) = (
                model.clone(),
                policy.clone(),
                full.clone(),
                done_tx.clone(),
                save_path.clone(),
            );
            threads.push(thread::spawn(move || {
                let st = prepare_rank(Arc::new(pg), &model, &policy, &full, &OPS);
                let inputs = Inputs {
                    full: Some(full),
                    save_path,
                };
                done_tx.send(()).expect("main alive");
                while let Ok(op) = rx.recv() {
                    run_op(&st, op, &inputs);
                    done_tx.send(()).expect("main alive");
                }
            }));
        }
        for _ in 0..WORLD {
            done.recv().expect("a rank failed while preparing");
        }
        Cluster {
            commands,
            done,
            threads,
        }
    }

    fn run(&self, op: Op) -> Duration {
        let start = Instant::now();
        for c in &self.commands {
            c.send(op).expect("rank alive");
        }
        for _ in 0..WORLD {
            self.done.recv().expect("a rank failed (see above)");
        }
        start.elapsed()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.commands.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Child mode: build the inputs for one op, reset VmHWM, run it once on both ranks, print
/// `seconds rss_before peak hwm_reset_ok`.
fn child(op: Op, layers: usize, save_path: PathBuf) {
    let (model, policy) = model(layers);
    let full = Arc::new(full_adam_state(&model));
    let pgs = ThreadGroup::new(WORLD);
    let (ready_tx, ready) = mpsc::channel();
    let (go_txs, go_rxs): (Vec<_>, Vec<_>) = (0..WORLD).map(|_| mpsc::channel::<()>()).unzip();
    let keep_full = op == Op::ShardFull;
    let handles: Vec<_> = pgs
        .into_iter()
        .zip(go_rxs)
        .map(|(pg, go)| {
            let (model, policy, full, ready_tx, save_path) = (
                model.clone(),
                policy.clone(),
                full.clone(),
                ready_tx.clone(),
                save_path.clone(),
            );
            thread::spawn(move || {
                let st = prepare_rank(Arc::new(pg), &model, &policy, &full, &[op]);
                let inputs = Inputs {
                    full: keep_full.then_some(full),
                    save_path,
                };
                ready_tx.send(()).unwrap();
                go.recv().unwrap();
                run_op(&st, op, &inputs);
                ready_tx.send(()).unwrap();
                drop(st);
            })
        })
        .collect();
    for _ in 0..WORLD {
        ready.recv().expect("rank prepared");
    }
    drop(full); // the ranks keep their copy only for shard_full
    fsdp::tensor::release_cached_buffers();
    let ok = reset_hwm();
    let before = status_bytes("VmRSS:");
    let start = Instant::now();
    for g in &go_txs {
        g.send(()).unwrap();
    }
    for _ in 0..WORLD {
        ready.recv().expect("rank ran the op");
    }
    let secs = start.elapsed().as_secs_f64();
    let peak = status_bytes("VmHWM:");
    for h in handles {
        h.join().unwrap();
    }
    println!("CHILD {secs} {before} {peak} {ok}");
}

struct ChildResult {
    secs: f64,
    before: u64,
    peak: u64,
    reset_ok: bool,
}

fn run_child(op: Op, layers: usize, save_path: &Path) -> ChildResult {
    let spec = format!("{},{layers},{}", op.name(), save_path.display());
    let f = common::child_fields("FSDP_SBS_CHILD", &spec, &format!("for {}", op.name()));
    ChildResult {
        secs: f[0].parse().unwrap(),
        before: f[1].parse().unwrap(),
        peak: f[2].parse().unwrap(),
        reset_ok: f[3] == "true",
    }
}

/// Median of PyTorch's repetitions of one op (`p` = its entry in the Python side's JSON).
fn py_median(p: &serde_json::Value) -> f64 {
    median(
        p["times"]
            .as_array()
            .expect("PyTorch's times")
            .iter()
            .map(|x| x.as_f64().expect("a time"))
            .collect(),
    )
}

/// PyTorch's per-rank figure `key` (bytes) of one op.
fn py_per_rank(p: &serde_json::Value, key: &str) -> Vec<u64> {
    p[key]
        .as_array()
        .expect("PyTorch's per-rank figures")
        .iter()
        .map(|x| x.as_u64().expect("bytes"))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn gb(b: u64) -> String {
    format!("{:.2}", b as f64 / 1e9)
}

/// Seconds to write `bytes` to a new file at `path` with `std::fs` and `sync_all` it.
fn raw_write(path: &Path, bytes: &[u8]) -> f64 {
    let _ = std::fs::remove_file(path);
    let s = Instant::now();
    let mut f = std::fs::File::create(path).expect("raw file");
    std::io::Write::write_all(&mut f, bytes).expect("raw write");
    f.sync_all().expect("raw fsync");
    s.elapsed().as_secs_f64()
}

fn mb(b: u64) -> String {
    format!("{:.1}", b as f64 / 1e6)
}

fn main() {
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or(target)
        .join("side_by_side");
    if let Ok(spec) = std::env::var(mpi_column::WORKER_ENV) {
        mpi_column::worker(&spec);
        return;
    }
    if let Ok(spec) = std::env::var("FSDP_SBS_CHILD") {
        let mut it = spec.splitn(3, ',');
        let op = Op::parse(it.next().unwrap());
        let layers = it.next().unwrap().parse().unwrap();
        child(op, layers, PathBuf::from(it.next().unwrap()));
        return;
    }
    let py = venv_python("side_by_side");
    std::fs::create_dir_all(&dir).expect("creating the bench directory");
    let layer_counts: Vec<usize> = std::env::var("SBS_LAYERS")
        .unwrap_or_else(|_| "16,64".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("SBS_LAYERS: comma-separated layer counts")
        })
        .collect();
    let reps: usize = std::env::var("SBS_REPS")
        .ok()
        .map(|s| s.parse().expect("SBS_REPS"))
        .unwrap_or(5);
    // Writes vary most on a shared disk: more repetitions for saving (and its raw baseline).
    let save_reps: usize = std::env::var("SBS_SAVE_REPS")
        .ok()
        .map(|s| s.parse().expect("SBS_SAVE_REPS"))
        .unwrap_or(9);
    println!(
        "side_by_side: world size {WORLD}, {reps} repetitions per op (median shown), load average at start {}",
        loadavg()
    );
    let mut summaries = Vec::new();
    for &layers in &layer_counts {
        let (m, _) = model(layers);
        let numel: usize = m
            .params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum();

        // PyTorch.
        let load_py = loadavg();
        let t = Instant::now();
        let out = Command::new(&py)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/pytorch_side_by_side.py"))
            .args(["--layers", &layers.to_string(), "--reps", &reps.to_string()])
            .args(["--save-reps", &save_reps.to_string()])
            .arg("--dir")
            .arg(&dir)
            .output()
            .expect("running Python");
        if !out.status.success() {
            eprintln!(
                "side_by_side: the PyTorch run failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            std::process::exit(1);
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .expect("JSON from Python");
        let pyres: serde_json::Value = serde_json::from_str(line).expect("Python's JSON");
        println!(
            "\n[{layers} layers, {numel} params] PyTorch {} run took {:.1?} (load before: {load_py}); clear_refs reset ok: {}",
            pyres["torch"],
            t.elapsed(),
            pyres["clear_refs_ok"]
        );
        assert_eq!(
            pyres["params"].as_u64(),
            Some(numel as u64),
            "same model size"
        );

        // The crate, warm, repeated.
        let load_rs = loadavg();
        let full = Arc::new(full_adam_state(&m));
        let bytes = full.tensor_bytes();
        let save_path = dir.join(format!("crate_full_optim_{layers}.pt"));
        let cluster = Cluster::new(layers, full.clone(), save_path.clone());
        let mut crate_med = Vec::new();
        // The raw write+fsync baseline alternates with the crate's saves, so both see the
        // same writeback conditions.
        let raw_path = dir.join(format!("raw_write_{layers}.bin"));
        let mut raw_src: Vec<u8> = Vec::new();
        let mut raw_times = Vec::new();
        for op in OPS {
            let n = if op == Op::Save { save_reps } else { reps };
            let times: Vec<f64> = (0..n)
                .map(|_| {
                    if op == Op::Save && !raw_src.is_empty() {
                        raw_times.push(raw_write(&raw_path, &raw_src));
                    }
                    if op == Op::Save {
                        // Every save (and raw write, and torch.save) makes a new file.
                        let _ = std::fs::remove_file(&save_path);
                    }
                    let t = cluster.run(op).as_secs_f64();
                    if op == Op::Save && raw_src.is_empty() {
                        // The first save gives the file size; its time counts like the others.
                        let n = std::fs::metadata(&save_path).expect("saved file").len();
                        raw_src = vec![1u8; n as usize];
                    }
                    t
                })
                .collect();
            println!(
                "crate {:<13} repetitions (s): {}",
                op.name(),
                times
                    .iter()
                    .map(|t| format!("{t:.4}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            crate_med.push(median(times));
        }
        drop(cluster);
        drop(full);
        fsdp::tensor::release_cached_buffers();
        let file_bytes = std::fs::metadata(&save_path).expect("saved file").len() as usize;

        // Raw baselines.
        raw_times.push(raw_write(&raw_path, &raw_src));
        let _ = std::fs::remove_file(&raw_path);
        drop(raw_src);
        println!(
            "raw write+fsync repetitions (s): {}",
            raw_times
                .iter()
                .map(|t| format!("{t:.4}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        dst.copy_from_slice(&src[..bytes]);
        let memcpy = median(
            (0..reps)
                .map(|_| {
                    let s = Instant::now();
                    dst.copy_from_slice(black_box(&src[..bytes]));
                    black_box(&mut dst);
                    s.elapsed().as_secs_f64()
                })
                .collect(),
        );
        drop(dst);
        let write = median(raw_times);
        drop(src);
        let _ = std::fs::remove_file(&raw_path);

        // The crate, one cold call per op in a fresh process, for peak RSS.
        let children: Vec<ChildResult> = OPS
            .iter()
            .map(|&op| {
                let _ = std::fs::remove_file(&save_path);
                run_child(op, layers, &save_path)
            })
            .collect();
        let _ = std::fs::remove_file(&save_path);

        // The crate's ranks as MPI processes (one mpirun launch per op).
        let load_mpi = loadavg();
        let mpi_save = dir.join(format!("mpi_full_optim_{layers}.pt"));
        let mpi = mpi_column::column(layers, reps, save_reps, &mpi_save);
        let load_mpi = format!("{load_mpi} before, {} after", loadavg());

        println!(
            "crate measured at load {load_rs}; full dict: {bytes} tensor bytes; crate file {file_bytes} B, PyTorch file {} B",
            pyres["save_file_bytes"]
        );
        println!(
            "memcpy {:.1} ms ({:.2} GB/s); write+fsync {:.1} ms ({:.2} GB/s); PyTorch peaks: clear_refs; crate peaks: fresh child, clear_refs reset ok: {}",
            memcpy * 1e3,
            bytes as f64 / memcpy / 1e9,
            write * 1e3,
            file_bytes as f64 / write / 1e9,
            children.iter().all(|c| c.reset_ok)
        );
        println!(
            "{:<13} {:>9} {:>9} {:>9} {:>8} | {:>9} {:>9} {:>9} {:>9} | targets",
            "op",
            "torch s",
            "crate s",
            "cold s",
            "speedup",
            "torch GB",
            "crate GB",
            "torch ΔMB",
            "crate ΔMB",
        );
        let mut rows = Vec::new();
        let mut py_reps = Vec::new();
        for (i, op) in OPS.iter().enumerate() {
            let p = &pyres["ops"][op.name()];
            py_reps.push(format!(
                "pytorch {:<13} repetitions (s): {}; per rank: peak {}, Δ {}, RSS before {}",
                op.name(),
                p["times"],
                p["peak_rss"],
                p["peak_delta"],
                p["rss_before"]
            ));
            let py_t = py_median(p);
            let sum = |k: &str| -> u64 { py_per_rank(p, k).iter().sum() };
            let (py_peak, py_delta) = (sum("peak_rss"), sum("peak_delta"));
            let c = &children[i];
            let rs_t = crate_med[i];
            let speedup = py_t / rs_t;
            let rs_delta = c.peak.saturating_sub(c.before);
            let (time_target, time_ok) = match op {
                Op::Consolidate | Op::ShardedLoad => ("≥10×".to_string(), speedup >= 10.0),
                Op::ShardFull => ("≥3×".to_string(), speedup >= 3.0),
                Op::Save => {
                    let ratio = write / rs_t; // crate save bandwidth / raw write+fsync bandwidth
                    (
                        format!("{:.2}× raw write+fsync (≥0.5×)", ratio),
                        ratio >= 0.5,
                    )
                }
            };
            let yes = |b: bool| if b { "met" } else { "MISSED" };
            let verdict = format!(
                "time {time_target}: {}; peak: {}; Δ: {}",
                yes(time_ok),
                yes(c.peak < py_peak),
                yes(rs_delta < py_delta)
            );
            println!(
                "{:<13} {:>9.3} {:>9.3} {:>9.3} {:>7.1}× | {:>9} {:>9} {:>9} {:>9} | {verdict}",
                op.name(),
                py_t,
                rs_t,
                c.secs,
                speedup,
                gb(py_peak),
                gb(c.peak),
                gb(py_delta),
                gb(rs_delta),
            );
            rows.push(format!(
                "| {} | {} | {:.3} s | {:.3} s | {:.1}× | {} GB / {} MB | {} GB / {} MB | {verdict} |",
                numel,
                op.name(),
                py_t,
                rs_t,
                speedup,
                gb(py_peak),
                mb(py_delta),
                gb(c.peak),
                mb(rs_delta)
            ));
        }
        for r in py_reps {
            println!("{r}");
        }
        let mpi_rows = mpi_column::print_table(&mpi, &pyres, &crate_med, numel, &load_mpi);
        summaries.push((
            layers,
            rows,
            mpi_rows,
            bytes as f64 / memcpy / 1e9,
            file_bytes as f64 / write / 1e9,
        ));
    }
    println!("\nMarkdown (params | op | PyTorch | crate | speed-up | PyTorch peak / Δ | crate peak / Δ | targets):");
    for (layers, rows, _, m, w) in &summaries {
        println!("<!-- {layers} layers: memcpy {m:.2} GB/s, write+fsync {w:.2} GB/s -->");
        for r in rows {
            println!("{r}");
        }
    }
    println!("\nMarkdown, MPI column ({}):", mpi_column::MARKDOWN_HEADER);
    for (_, _, mpi_rows, _, _) in &summaries {
        for r in mpi_rows {
            println!("{r}");
        }
    }
    println!("load average at end {}", loadavg());
}
