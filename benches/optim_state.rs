//! Throughput of the optimizer-state checkpoint paths on thread ranks, beside this host's
//! memcpy bandwidth for the same byte count, measured in the same run.
//!
//! The model: 64 FSDP units `layers.{i}` of `weight` [1024, 1526] and `bias` [1024]
//! (100,073,472 parameters) plus a small unmanaged `head.weight`, wrapped with
//! `use_orig_params=False`. Adam state per parameter: `step` (0-dim f32), `exp_avg` and
//! `exp_avg_sq` (f32, parameter-shaped), plus one param group.
//!
//! Benchmarks, each at world sizes 2 and 8:
//! - `consolidate`: every rank calls `full_optim_state_dict(local, params, rank0_only=true)`.
//! - `shard`: every rank calls `shard_full_optim_state_dict(&full, params)` on a shared dict.
//! - `scatter`: `scatter_full_optim_state_dict`, only rank 0 holds the full dict.
//!
//! **Bytes moved** is the same for every op and world size: the tensor bytes of the full
//! dict ([`OptimStateDict::tensor_bytes`], ≈ 800 MB), i.e. the state a checkpoint holds.
//! Ops that copy it several times (one all-gather per rank) or not at all (views) still count
//! it once. The `memcpy` baseline copies that many bytes between two preallocated, already
//! touched buffers with `copy_from_slice` on one thread; `memcpy_fresh` copies into a new
//! allocation each time (first-touch page faults included), as a collective's output buffer is.
//!
//! Outputs are dropped at the end of each iteration, so from the second iteration on their
//! buffers come from the crate's buffer cache (`fsdp::tensor::set_buffer_cache_limit`), as in a
//! job that checkpoints repeatedly; `memcpy_fresh` shows what the first iteration pays.
//!
//! Ranks are threads that live across iterations (one [`Cluster`] per world size, commands
//! over channels), so thread start-up is not timed; a timed iteration runs from sending the
//! command to the last rank reporting done, and includes dropping each rank's result.
//!
//! After the criterion reports, a summary prints GB/s (10^9 bytes per second; criterion
//! prints GiB/s) and the ratio to memcpy, computed from the very samples criterion timed
//! (median time per iteration over all calls, warm-up included), then two linearity checks
//! (reported, not asserted): the 100M model against one with half the parameters and half
//! the units, and a many-small-parameters model against one with twice the units.
//!
//! Run: `cargo bench --bench optim_state`.

mod common;
use common::{deep_copy, full_adam_state};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use fsdp::collectives::ThreadGroup;
use fsdp::{DType, Fsdp, ModelDesc, OptimStateDict, WrapPolicy};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Units of the 100M model.
const UNITS: usize = 64;
/// `weight` is [`OUT`, `IN`], `bias` is [`OUT`].
const OUT: usize = 1024;
const IN: usize = 1526;
const WORLD_SIZES: [usize; 2] = [2, 8];

/// A synthetic model: `units` units `layers.{i}` of a `weight` [out, inp] and a `bias` [out],
/// then an unmanaged `head.weight` [16].
#[derive(Debug, Clone, Copy)]
struct Synthetic {
    units: usize,
    out: usize,
    inp: usize,
}

impl Synthetic {
    fn model(self) -> (ModelDesc, WrapPolicy) {
        let mut m = ModelDesc::new();
        let mut units = Vec::with_capacity(self.units);
        for i in 0..self.units {
            m = m
                .param(
                    &format!("layers.{i}.weight"),
                    &[self.out, self.inp],
                    DType::F32,
                )
                .param(&format!("layers.{i}.bias"), &[self.out], DType::F32);
            units.push(format!("layers.{i}"));
        }
        m = m.param("head.weight", &[16], DType::F32);
        (m, WrapPolicy::units(&units))
    }

    fn numel(self) -> usize {
        self.units * (self.out * self.inp + self.out) + 16
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Consolidate,
    Shard,
    Scatter,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Consolidate => "consolidate",
            Op::Shard => "shard",
            Op::Scatter => "scatter",
        }
    }
}

/// `world_size` rank threads that live across iterations; each holds its `Fsdp`, its local
/// (flattened, sharded) Adam state and the shared full dict, and runs ops on command.
struct Cluster {
    world_size: usize,
    commands: Vec<mpsc::Sender<(Op, u64)>>,
    done: mpsc::Receiver<()>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Cluster {
    fn new(spec: Synthetic, full: Arc<OptimStateDict>, world_size: usize) -> Self {
        let (model, policy) = spec.model();
        let (model, policy) = (Arc::new(model), Arc::new(policy));
        let (done_tx, done) = mpsc::channel();
        let mut commands = Vec::new();
        let mut threads = Vec::new();
        for pg in ThreadGroup::new(world_size) {
            let (tx, rx) = mpsc::channel::<(Op, u64)>();
            commands.push(tx);
            let (model, policy, full, done_tx) =
                (model.clone(), policy.clone(), full.clone(), done_tx.clone());
            let rank = fsdp::collectives::ProcessGroup::rank(&pg);
            let t = thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).expect("Fsdp::new");
                    let params = fsdp.optim_params();
                    let local = deep_copy(
                        &fsdp
                            .shard_full_optim_state_dict(&full, &params)
                            .expect("initial shard"),
                    );
                    done_tx.send(()).expect("main thread alive");
                    while let Ok((op, iters)) = rx.recv() {
                        for _ in 0..iters {
                            match op {
                                Op::Consolidate => {
                                    let out = fsdp
                                        .full_optim_state_dict(&local, &params, true)
                                        .unwrap_or_else(|e| {
                                            panic!("rank {rank}: consolidate: {e}")
                                        });
                                    assert_eq!(out.is_some(), rank == 0);
                                    black_box(out);
                                }
                                Op::Shard => {
                                    let out = fsdp
                                        .shard_full_optim_state_dict(&full, &params)
                                        .unwrap_or_else(|e| panic!("rank {rank}: shard: {e}"));
                                    black_box(out);
                                }
                                Op::Scatter => {
                                    let out = fsdp
                                        .scatter_full_optim_state_dict(
                                            (rank == 0).then_some(&*full),
                                            &params,
                                        )
                                        .unwrap_or_else(|e| panic!("rank {rank}: scatter: {e}"));
                                    black_box(out);
                                }
                            }
                        }
                        done_tx.send(()).expect("main thread alive");
                    }
                })
                .expect("spawning a rank thread");
            threads.push(t);
        }
        for _ in 0..world_size {
            done.recv()
                .expect("a rank failed while building its local state");
        }
        Cluster {
            world_size,
            commands,
            done,
            threads,
        }
    }

    /// Wall time for every rank to run `op` `iters` times.
    fn run(&self, op: Op, iters: u64) -> Duration {
        let start = Instant::now();
        for c in &self.commands {
            c.send((op, iters)).expect("rank thread alive");
        }
        for _ in 0..self.world_size {
            self.done
                .recv()
                .expect("a rank failed (see its panic message above)");
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

/// Seconds per iteration of every timed call, by label, for the summary.
static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());
/// Tensor bytes of the full 100M dict.
static FULL_BYTES: Mutex<usize> = Mutex::new(0);

fn record(label: &str, elapsed: Duration, iters: u64) {
    let per_iter = elapsed.as_secs_f64() / iters.max(1) as f64;
    SAMPLES
        .lock()
        .unwrap()
        .entry(label.to_string())
        .or_default()
        .push(per_iter);
}

fn median(label: &str) -> Option<f64> {
    let mut v = SAMPLES.lock().unwrap().get(label)?.clone();
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn peak_rss_gib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN);
    kib / (1024.0 * 1024.0)
}

fn configure(g: &mut BenchmarkGroup<'_, WallTime>, bytes: usize) {
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Bytes(bytes as u64));
}

fn bench_cluster(
    g: &mut BenchmarkGroup<'_, WallTime>,
    cluster: &Cluster,
    ops: &[Op],
    suffix: &str,
) {
    for &op in ops {
        let label = format!("{}{suffix}/{}", op.name(), cluster.world_size);
        g.bench_function(
            BenchmarkId::new(format!("{}{suffix}", op.name()), cluster.world_size),
            |b| {
                b.iter_custom(|iters| {
                    let d = cluster.run(op, iters);
                    record(&label, d, iters);
                    d
                })
            },
        );
        println!("peak RSS after {label}: {:.2} GiB", peak_rss_gib());
    }
}

fn optim_state(c: &mut Criterion) {
    let spec = Synthetic {
        units: UNITS,
        out: OUT,
        inp: IN,
    };
    let t = Instant::now();
    let (model, _) = spec.model();
    let full = Arc::new(full_adam_state(&model));
    let bytes = full.tensor_bytes();
    *FULL_BYTES.lock().unwrap() = bytes;
    println!(
        "model: {} parameters in {UNITS} units; full Adam dict {bytes} tensor bytes ({:.1} MB), built in {:.2?}",
        spec.numel(),
        bytes as f64 / 1e6,
        t.elapsed()
    );

    let mut g = c.benchmark_group("optim_state_100M");
    configure(&mut g, bytes);
    {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        dst.copy_from_slice(&src); // fault the pages in before timing
        g.bench_function("memcpy", |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    dst.copy_from_slice(black_box(&src));
                    black_box(&mut dst);
                }
                let d = start.elapsed();
                record("memcpy", d, iters);
                d
            })
        });
        g.bench_function("memcpy_fresh", |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(black_box(&src).to_vec());
                }
                let d = start.elapsed();
                record("memcpy_fresh", d, iters);
                d
            })
        });
        // Two threads each copying half: the host's aggregate bandwidth, for context only
        // (every repetition recorded; the summary takes the median).
        for _ in 0..5 {
            let half = bytes / 2;
            let (d0, d1) = dst.split_at_mut(half);
            let start = Instant::now();
            thread::scope(|s| {
                s.spawn(|| d0.copy_from_slice(&src[..half]));
                s.spawn(|| d1.copy_from_slice(&src[half..]));
            });
            record("memcpy_2threads", start.elapsed(), 1);
        }
    }
    for ws in WORLD_SIZES {
        let t = Instant::now();
        let cluster = Cluster::new(spec, full.clone(), ws);
        println!(
            "world size {ws}: rank threads up with local state in {:.2?}",
            t.elapsed()
        );
        bench_cluster(
            &mut g,
            &cluster,
            &[Op::Consolidate, Op::Shard, Op::Scatter],
            "",
        );
        drop(cluster);
    }
    g.finish();
    drop(full);

    // Linearity: half the parameters and half the units.
    let half = Synthetic {
        units: UNITS / 2,
        ..spec
    };
    let (model, _) = half.model();
    let full = Arc::new(full_adam_state(&model));
    let mut g = c.benchmark_group("optim_state_50M");
    configure(&mut g, full.tensor_bytes());
    let cluster = Cluster::new(half, full.clone(), 2);
    bench_cluster(&mut g, &cluster, &[Op::Consolidate, Op::Shard], "_half");
    g.finish();
}

/// Wall time of the fastest of `reps` runs of `op` on `cluster`.
fn best_of(cluster: &Cluster, op: Op, reps: usize) -> f64 {
    (0..reps)
        .map(|_| cluster.run(op, 1).as_secs_f64())
        .fold(f64::INFINITY, f64::min)
}

fn summary(_c: &mut Criterion) {
    let bytes = *FULL_BYTES.lock().unwrap();
    let gbs = |secs: f64| bytes as f64 / secs / 1e9;
    println!();
    println!(
        "=== optim_state summary: {bytes} bytes moved per op (tensor bytes of the full dict) ==="
    );
    let Some(memcpy) = median("memcpy") else {
        println!("(memcpy baseline was filtered out; no summary)");
        return;
    };
    println!(
        "{:<26} {:>10} {:>10} {:>12}",
        "op", "ms/iter", "GB/s", "vs memcpy"
    );
    let row = |label: &str| {
        if let Some(s) = median(label) {
            println!(
                "{label:<26} {:>10.1} {:>10.2} {:>11.2}x",
                s * 1e3,
                gbs(s),
                memcpy / s
            );
        }
    };
    for label in ["memcpy", "memcpy_fresh", "memcpy_2threads"] {
        row(label);
    }
    for op in [Op::Consolidate, Op::Shard, Op::Scatter] {
        for ws in WORLD_SIZES {
            row(&format!("{}/{ws}", op.name()));
        }
    }
    println!(
        "(target: >= 0.50x memcpy; 'vs memcpy' = memcpy time / op time for the same byte count)"
    );
    for op in [Op::Consolidate, Op::Shard] {
        if let (Some(f), Some(h)) = (
            median(&format!("{}/2", op.name())),
            median(&format!("{}_half/2", op.name())),
        ) {
            println!(
                "linearity {}/2: 100M/64 units {:.1} ms, 50M/32 units {:.1} ms, ratio {:.2} (linear = 2.00)",
                op.name(),
                f * 1e3,
                h * 1e3,
                f / h
            );
        }
    }

    // Per-parameter and per-unit overhead: tiny tensors, so fixed costs dominate. World size
    // 1 has no collective (pure bookkeeping); world size 2 adds one rendezvous per tensor state
    // per unit.
    const SMALL: [usize; 2] = [2048, 4096];
    println!(
        "linearity in units/params ({} -> {} units of [16,16]+[16], best of 3; linear = 2.00):",
        SMALL[0], SMALL[1]
    );
    let layout_time = |units: usize| {
        let (model, policy) = Synthetic {
            units,
            out: 16,
            inp: 16,
        }
        .model();
        let t = Instant::now();
        black_box(fsdp::flat_param::ModelLayout::new(&model, &policy, 2).expect("layout"));
        t.elapsed().as_secs_f64()
    };
    let l: Vec<f64> = SMALL
        .iter()
        .map(|&u| (0..3).map(|_| layout_time(u)).fold(f64::INFINITY, f64::min))
        .collect();
    println!(
        "  {:<30} {:>8.2} ms -> {:>8.2} ms, ratio {:.2}",
        "ModelLayout::new (Fsdp::new)",
        l[0] * 1e3,
        l[1] * 1e3,
        l[1] / l[0]
    );
    for ws in [1, 2] {
        let times: Vec<[f64; 3]> = SMALL
            .iter()
            .map(|&units| {
                let spec = Synthetic {
                    units,
                    out: 16,
                    inp: 16,
                };
                let full = Arc::new(full_adam_state(&spec.model().0));
                let cluster = Cluster::new(spec, full, ws);
                [Op::Consolidate, Op::Shard, Op::Scatter].map(|op| best_of(&cluster, op, 3))
            })
            .collect();
        for (i, op) in [Op::Consolidate, Op::Shard, Op::Scatter].iter().enumerate() {
            let (a, b) = (times[0][i], times[1][i]);
            println!(
                "  {:<30} {:>8.2} ms -> {:>8.2} ms, ratio {:.2}",
                format!("{} ws={ws}", op.name()),
                a * 1e3,
                b * 1e3,
                b / a
            );
        }
    }
    println!("peak RSS: {:.2} GiB", peak_rss_gib());
}

criterion_group!(benches, optim_state, summary);
criterion_main!(benches);
