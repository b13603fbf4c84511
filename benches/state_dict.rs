//! `get_optimizer_state_dict` / `set_optimizer_state_dict` over FSDP2, side by side with
//! PyTorch 2.13's (`benches/state_dict_side_by_side.py`: `fully_shard` on CPU, gloo, two
//! processes), in one run.
//!
//! The model: `SD_LAYERS` (default 16) linears `[1024, 1526]` + bias `[1024]`, `fully_shard`
//! on each and on the root, world size 2: 25,018,368 parameters at 16 layers, Adam state
//! `step`, `exp_avg`, `exp_avg_sq` (200 MB of tensors). The crate's two ranks are threads of
//! one process (`FullyShardedModel` over a `ThreadGroup`), each holding its rows of every
//! state, as `set_optimizer_state_dict` of the full dict leaves them (made untimed).
//!
//! Operations, each `SD_REPS` (default 5) times in a row in a fresh process per operation
//! (PyTorch: both in one job), wall clock on rank 0 from a barrier before the call to a
//! barrier after it:
//! - `get_full`: `get_optimizer_state_dict` with `full_state_dict` and `cpu_offload` (rank 0
//!   gets the dict; the crate gathers to rank 0 only);
//! - `set_broadcast`: `set_optimizer_state_dict` with `broadcast_from_rank0` (rank 0 holds the
//!   full dict, each rank receives its rows).
//!
//! The table shows the median of the calls after the first ("warm": as in a job that
//! checkpoints repeatedly, output buffers then come from the crate's buffer cache, as PyTorch's
//! come from its allocator's), and the first call of the fresh process ("cold": every output
//! page touched for the first time) beside it; the speed-up is judged on both.
//! Peak RSS: VmHWM after resetting it (`/proc/self/clear_refs` ← 5) before each repetition;
//! PyTorch's is the sum of its two processes' maxima, the crate's its one process's maximum.
//! Target (issue 13): ≥ 10× PyTorch, peak memory below PyTorch's. Baseline in the same run:
//! the full dict's bytes copied once into fresh memory (first touch included), the least
//! either operation moves.
//!
//! Run: `cargo bench --bench state_dict` (needs `.venv` with torch 2.13, or `FSDP_PYTHON`).

mod common;
use common::{full_adam_state, loadavg, reset_hwm, status_bytes, venv_python};

use fsdp::collectives::ThreadGroup;
use fsdp::{DType, ModelDesc, OptimStateDict, WrapPolicy};
use fsdp::{FullyShardedModel, OptimStateDictApi, StateDictOptions};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

const WORLD: usize = 2;
const OUT: usize = 1024;
const IN: usize = 1526;
const CHILD_ENV: &str = "FSDP_SD_BENCH_CHILD";

fn model(layers: usize) -> (ModelDesc, WrapPolicy) {
    let mut m = ModelDesc::new();
    let mut units = Vec::new();
    for i in 0..layers {
        m = m
            .param(&format!("{i}.weight"), &[OUT, IN], DType::F32)
            .param(&format!("{i}.bias"), &[OUT], DType::F32);
        units.push(i.to_string());
    }
    units.push(String::new());
    (m, WrapPolicy::fully_shard(&units))
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Child mode: `reps` calls of `op` on two thread ranks; prints each repetition's seconds
/// and the largest VmHWM and VmHWM - VmRSS before.
fn child(op: &str, layers: usize, reps: usize) {
    let (desc, policy) = model(layers);
    let full = full_adam_state(&desc);
    let results = ThreadGroup::run(WORLD, |pg| {
        let m = FullyShardedModel::new(&desc, &policy, Arc::new(pg)).expect("layout");
        let params = m.optim_params();
        let local = m
            .set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())
            .expect("local state");
        let root = m.rank() == 0;
        let (mut times, mut peak, mut delta) = (Vec::new(), 0u64, 0u64);
        for _ in 0..reps {
            let before = if root {
                reset_hwm();
                status_bytes("VmRSS:")
            } else {
                0
            };
            m.process_group().barrier().expect("barrier");
            let t = Instant::now();
            let out: OptimStateDict = match op {
                "get_full" => {
                    let opts = StateDictOptions::full().cpu_offload(true);
                    m.get_optimizer_state_dict(&local, &params, &opts)
                }
                _ => {
                    let opts = StateDictOptions::full().broadcast_from_rank0(true);
                    m.set_optimizer_state_dict(root.then_some(&full), &params, &opts)
                }
            }
            .expect("operation");
            m.process_group().barrier().expect("barrier");
            times.push(t.elapsed().as_secs_f64());
            if root {
                let hwm = status_bytes("VmHWM:");
                peak = peak.max(hwm);
                delta = delta.max(hwm.saturating_sub(before));
            }
            drop(out);
        }
        (times, peak, delta)
    });
    let (times, peak, delta) = &results[0];
    let t: Vec<String> = times.iter().map(|t| t.to_string()).collect();
    println!("CHILD {} {peak} {delta}", t.join(","));
}

struct Measured {
    times: Vec<f64>,
    peak: u64,
    delta: u64,
}

fn run_child(op: &str, layers: usize, reps: usize) -> Measured {
    let f = common::child_fields(CHILD_ENV, &format!("{op},{layers},{reps}"), op);
    Measured {
        times: f[0].split(',').map(|t| t.parse().unwrap()).collect(),
        peak: f[1].parse().unwrap(),
        delta: f[2].parse().unwrap(),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let f: Vec<&str> = spec.split(',').collect();
        child(f[0], f[1].parse().unwrap(), f[2].parse().unwrap());
        return;
    }
    let layers = env_usize("SD_LAYERS", 16);
    let reps = env_usize("SD_REPS", 5).max(2);
    println!(
        "state_dict bench: {layers} layers, {reps} reps, load average {}",
        loadavg()
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/state_dict_side_by_side.py");
    let out = Command::new(venv_python("state_dict bench"))
        .arg(script)
        .args(["--layers", &layers.to_string(), "--reps", &reps.to_string()])
        .output()
        .expect("running PyTorch (scripts/setup-venv.sh makes .venv)");
    assert!(
        out.status.success(),
        "PyTorch side failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let torch: serde_json::Value = serde_json::from_slice(
        out.stdout
            .rsplit(|&b| b == b'\n')
            .find(|l| !l.is_empty())
            .unwrap(),
    )
    .expect("PyTorch's JSON");
    let ranks = torch["ranks"].as_array().expect("ranks");
    let bytes = ranks[0]["tensor_bytes"].as_u64().unwrap_or(0);
    println!("full dict: {:.1} MB of tensors", bytes as f64 / 1e6);
    println!(
        "{:<14} {:>10} {:>10} {:>10} {:>8} {:>8} {:>12} {:>12}",
        "op", "torch s", "fsdp s", "fsdp cold", "speedup", "cold", "torch MB", "fsdp MB"
    );
    for op in ["get_full", "set_broadcast"] {
        let theirs: Vec<f64> = ranks[0][op]["times"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_f64().unwrap())
            .collect();
        let their_peak: u64 = ranks
            .iter()
            .map(|r| r[op]["peak_rss"].as_u64().unwrap())
            .sum();
        let ours = run_child(op, layers, reps);
        let warm = median(&ours.times[1..]);
        println!(
            "{op:<14} {:>10.4} {:>10.4} {:>10.4} {:>7.1}x {:>7.1}x {:>12.1} {:>12.1}",
            median(&theirs),
            warm,
            ours.times[0],
            median(&theirs) / warm,
            median(&theirs) / ours.times[0],
            their_peak as f64 / 1e6,
            ours.peak as f64 / 1e6
        );
        println!(
            "  runs (s): torch {theirs:?}; fsdp {:?}; fsdp peak delta {:.1} MB",
            ours.times,
            ours.delta as f64 / 1e6
        );
    }
    // The floor for either operation here: the full dict's bytes copied once into fresh
    // memory (first touch included), one thread, median of `reps`.
    let src = vec![1u8; bytes as usize];
    let copies: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            let mut dst: Vec<u8> = Vec::with_capacity(src.len());
            dst.extend_from_slice(&src);
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(&dst);
            secs
        })
        .collect();
    println!(
        "baseline: {:.1} MB copied into fresh memory: {:.4} s (median)",
        bytes as f64 / 1e6,
        median(&copies)
    );
    println!("load average after: {}", loadavg());
}
