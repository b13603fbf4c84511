//! Offline checkpoint work at real scale, up to a billion parameters, beside PyTorch 2.13 in
//! the same run (issue 16, part 2).
//!
//! The model: `units` FSDP units `layers.{i}` of `weight` [1024, 4096] + `bias` [1024]
//! (4,195,328 parameters each), `use_orig_params=False`, Adam state after one step: 8 bytes of
//! state per parameter (`exp_avg`, `exp_avg_sq`, f32) plus a `step` per parameter. The default
//! sizes are 6, 24, 96 and 239 units: 25.2M, 100.7M, 402.8M and 1,002.7M parameters, 0.20 to
//! 8.02 GB of Adam state.
//!
//! Per size, a child process (this binary re-run with `--child`) saves the state of two thread
//! ranks twice: as the crate's sharded checkpoint (`Fsdp::save_optim_checkpoint`) and as a DCP
//! directory (`Fsdp::save_dcp`, one `__{rank}_0.distcp` per rank, what PyTorch's
//! `get_state_dict` + `dcp.save` of an FSDP1 model write). Then, each in a fresh process with
//! its input evicted from the page cache first (a cold call: the job that consolidates once):
//! - `consolidate .pt`: `checkpoint::consolidate_to_torch` (`fsdp-ckpt consolidate CKPT
//!   OUT.pt`), streaming;
//! - `consolidate .safetensors`: `checkpoint::consolidate_to_safetensors`;
//! - `reshard 2 -> 3`: `checkpoint::reshard` (its output is verified afterwards, untimed);
//! - `convert to DCP`: `checkpoint::convert_to_dcp` (`fsdp-ckpt convert CKPT OUT --to dcp`),
//!   streaming;
//! - `DCP consolidate`: `io::dcp::consolidate_to_torch` of the DCP directory (`fsdp-ckpt
//!   consolidate DCP_DIR OUT.pt`);
//! - `DCP to checkpoint for 3 ranks`: `checkpoint::dcp_to_checkpoint` of the DCP directory
//!   (`fsdp-ckpt convert DCP_DIR OUT --to fsdp --world-size 3`; verified afterwards, untimed);
//! - PyTorch `dcp_to_torch_save` of the same DCP directory, then an fsync of its output (the
//!   crate's outputs are durable before they appear), `benches/dcp_side_by_side.py`. At 100M
//!   parameters and below PyTorch also checks that both consolidated files are equal
//!   (structure, key order, bits); above, holding both in memory would not fit;
//! - PyTorch FSDP1 (two gloo processes, `benches/pytorch_side_by_side.py --ops
//!   consolidate_save`): `full_optim_state_dict(rank0_only=True)` of the live model, then
//!   `torch.save` + fsync on rank 0. PyTorch has no offline consolidation of FSDP1's flat
//!   shards; this is how its users get one file, and it starts from memory where the crate
//!   reads its input from disk. Its setup (building the model, one Adam step) is untimed.
//!
//! A PyTorch job that fails (out of memory: the kernel kills it) is reported with its exit
//! status and not run at larger sizes. Baselines, right before each size's operations: a raw
//! 1 MiB write + fsync and a cold raw read of the Adam state's byte count (no operation that
//! reads and durably writes every byte can beat `max(read, write)`).
//!
//! Peak RSS is each process's high-water mark (`VmHWM` for the crate's children, the sum of
//! both ranks' for PyTorch FSDP1, `ru_maxrss` for `dcp_to_torch_save`), interpreter and
//! libraries included.
//!
//! Files live under `target/scale-bench/` and are removed as each operation ends and at the
//! end: at 1B parameters at most about 33 GB at once (checkpoint 8 GB, DCP directory 8 GB,
//! two outputs of 8 GB, or the raw baseline file). The bench needs about 17 GB of memory at 1B
//! (the state is built in memory once to be saved) and runs for about 10 minutes at the
//! default sizes on the 2-core VM.
//!
//! With `SCALE_BENCH_TOOL` naming an `fsdp-ckpt` built with `mpi` (`scripts/bench.sh` builds one
//! and sets it when `mpirun` exists), the tool's `reshard`, `consolidate CKPT OUT.safetensors`,
//! `consolidate CKPT OUT.pt`, `convert CKPT OUT --to dcp`, `consolidate DCP_DIR OUT.pt` and
//! `convert DCP_DIR OUT --to fsdp` also run as MPI jobs of 1, 2 and 4 processes (`SCALE_BENCH_NP`), timed from outside,
//! `mpirun` included (issue 16, part 6).
//!
//! Run: `cargo bench --bench scale` (`SCALE_BENCH_UNITS=6,24` for other sizes; needs `.venv`).

mod common;
use common::{
    adam_param_groups, adam_state_of, deep_copy, disk_bytes, evict, free_bytes, loadavg, raw_read,
    raw_write, status_bytes, venv_python,
};
use fsdp::collectives::Solo;
use fsdp::commands::conversions;

use fsdp::checkpoint::{self, SaveOptions};
use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::{DType, Fsdp, ModelDesc, OptimStateDict, WrapPolicy};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

/// World size of the saved state (PyTorch's FSDP1 run uses the same).
const WS: usize = 2;
const RESHARD_WS: usize = 3;
const OUT: usize = 1024;
const IN: usize = 4096;
const DEFAULT_UNITS: &str = "6,24,96,239,478";
/// Units whose full state one step of the input build holds at once.
const MAKE_BATCH: usize = 16;
/// The bound issue 27 sets on DCP -> checkpoint's peak RSS: twice the largest tensor plus
/// 64 MiB.
const DCP_TO_FSDP_BOUND: u64 = 2 * (OUT * IN * 4) as u64 + (64 << 20);
/// Sizes (parameters) up to which PyTorch also checks the two DCP consolidations equal.
const CHECK_EQUAL_UP_TO: usize = 150_000_000;

fn model(units: usize) -> ModelDesc {
    let mut m = ModelDesc::new();
    for i in 0..units {
        m = m
            .param(&format!("layers.{i}.weight"), &[OUT, IN], DType::F32)
            .param(&format!("layers.{i}.bias"), &[OUT], DType::F32);
    }
    m
}

fn policy(units: usize) -> WrapPolicy {
    let units: Vec<String> = (0..units).map(|i| format!("layers.{i}")).collect();
    WrapPolicy::units(&units)
}

// ---------------------------------------------------------------------------------------------
// Children: one job per fresh process.

/// `--child make UNITS CKPT DCP`: saves the state at world size [`WS`] as both inputs.
/// `--child OP SRC DST`: one cold call of a crate operation. Each prints `CHILD <seconds>
/// <cpu seconds> <peak RSS bytes>`.
fn child(args: &[String]) {
    let (op, a, b) = (args[0].as_str(), Path::new(&args[1]), Path::new(&args[2]));
    if op != "make" {
        evict(a);
    }
    let cpu = cpu_secs();
    let start = Instant::now();
    match op {
        "make" => make(
            args[1].parse().expect("a unit count"),
            Some(b).filter(|p| !p.as_os_str().is_empty()),
            Some(Path::new(&args[3])).filter(|p| !p.as_os_str().is_empty()),
        ),
        "dcp-to-fsdp" => {
            let units: usize = args[3].parse().expect("a unit count");
            let layout =
                fsdp::flat_param::ModelLayout::new(&model(units), &policy(units), RESHARD_WS)
                    .expect("layout");
            conversions::dcp_to_checkpoint(a, b, &layout, &Solo).expect("dcp_to_checkpoint");
        }
        _ => run_op(op, a, b),
    }
    println!(
        "CHILD {} {} {}",
        start.elapsed().as_secs_f64(),
        cpu_secs() - cpu,
        status_bytes("VmHWM:")
    );
}

fn run_op(op: &str, src: &Path, dst: &Path) {
    match op {
        "consolidate-pt" => conversions::checkpoint_to_torch_save(src, dst, &Solo, |_| {})
            .map(drop)
            .expect("consolidate_to_torch"),
        "consolidate-st" => conversions::checkpoint_to_safetensors(src, dst, &Solo, |_| {})
            .map(drop)
            .expect("consolidate_to_safetensors"),
        "reshard" => checkpoint::reshard(src, dst, RESHARD_WS, None, &Solo, |_| {})
            .map(drop)
            .expect("reshard"),
        "convert-dcp" => conversions::checkpoint_to_dcp(src, dst, &Solo, |_| {})
            .map(drop)
            .expect("convert_to_dcp"),
        "dcp-consolidate" => conversions::dcp_to_torch_save(src, dst, &Solo, |_| {})
            .map(drop)
            .expect("DCP consolidate_to_torch"),
        other => panic!("unknown child op {other}"),
    }
}

/// Builds the Adam state of `units` units on [`WS`] thread ranks and saves it as the crate's
/// checkpoint `ckpt` and/or the DCP directory `dcp`. Each rank shards the full dict
/// [`MAKE_BATCH`] units at a time and keeps its own copy of its shard, so memory holds the
/// ranks' shards (the state's size) and one batch, not the full dict besides.
fn make(units: usize, ckpt: Option<&Path>, dcp: Option<&Path>) {
    fsdp::tensor::set_buffer_cache_limit(0);
    let (model, policy) = (model(units), policy(units));
    ThreadGroup::run(WS, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let fsdp = Fsdp::new(&model, &policy, pg.clone()).expect("Fsdp::new");
        let params = fsdp.optim_params();
        let shard = |part: &OptimStateDict| {
            deep_copy(
                &fsdp
                    .shard_full_optim_state_dict(part, &params)
                    .expect("shard_full_optim_state_dict"),
            )
        };
        let groups = OptimStateDict {
            state: Default::default(),
            param_groups: adam_param_groups(&model),
        };
        let mut local = shard(&groups);
        for first in (0..units).step_by(MAKE_BATCH) {
            // Unit `u` is parameters 2u (weight) and 2u + 1 (bias).
            let last = (first + MAKE_BATCH).min(units);
            let part = adam_state_of(&model, 2 * first..2 * last);
            local.state.extend(shard(&part).state);
        }
        if let Some(ckpt) = ckpt {
            fsdp.save_optim_checkpoint(&local, &params, ckpt, &SaveOptions::default())
                .expect("save_optim_checkpoint");
        }
        if let Some(dcp) = dcp {
            fsdp.save_dcp(&local, &params, None, dcp).expect("save_dcp");
        }
    });
}

/// User + system CPU seconds of this process so far.
fn cpu_secs() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// What a timed job gave: seconds and peak RSS, or why it failed.
enum Outcome {
    Ran { secs: f64, cpu: f64, peak: u64 },
    Failed(String),
    NotRun(String),
}

fn crate_child(args: &[&str]) -> Outcome {
    let out = Command::new(std::env::current_exe().expect("this bench"))
        .arg("--child")
        .args(args)
        .output()
        .expect("running a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix("CHILD ")) {
        Some(line) => {
            let f: Vec<f64> = line
                .split_whitespace()
                .map(|v| v.parse().expect("a number"))
                .collect();
            Outcome::Ran {
                secs: f[0],
                cpu: f[1],
                peak: f[2] as u64,
            }
        }
        None => panic!(
            "child {args:?} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Runs a PyTorch script; its last stdout line is JSON, read by `parse`.
fn python_job(
    py: &Path,
    script: &str,
    args: &[&str],
    parse: fn(&serde_json::Value) -> Outcome,
) -> Outcome {
    let out = Command::new(py)
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("benches")
                .join(script),
        )
        .args(args)
        .output()
        .expect("running python");
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Outcome::Failed(format!("{} ({last})", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{script} printed no JSON ({e}): {text}"));
    parse(&v)
}

// ---------------------------------------------------------------------------------------------
// One size.

struct Row {
    units: usize,
    params: usize,
    bytes: u64,
    raw_write: f64,
    raw_read: f64,
    /// Seconds spent building and saving the inputs (once or twice, see [`Disk`]).
    make_secs: f64,
    disk: Disk,
    /// The most bytes under the bench directory at once, sampled before each removal.
    disk_peak: u64,
    ops: Vec<(String, Outcome)>,
}

/// How a size's inputs share the disk: both saved at once (checkpoint, DCP directory, an
/// output of each and the crate's DCP consolidation kept for PyTorch's equality check: about
/// 4× the state), or one after the other, each with one output at a time (about 2×).
#[derive(Clone, Copy, PartialEq)]
enum Disk {
    Together,
    Apart,
}

/// The disk plan of a size of `bytes` of state with `free` bytes free, or `None` when input
/// and output do not fit together.
fn disk_plan(bytes: u64, free: u64) -> Option<Disk> {
    // Files carry headers and archives; 5 % covers them, 2 GB keeps the disk usable.
    let need = |n: f64| (bytes as f64 * n * 1.05) as u64 + (2 << 30);
    if free >= need(4.0) {
        Some(Disk::Together)
    } else if free >= need(2.0) {
        Some(Disk::Apart)
    } else {
        None
    }
}

/// The operations on the checkpoint, then those on the DCP directory: (child op, label).
const CKPT_OPS: [(&str, &str); 4] = [
    ("consolidate-pt", "consolidate .pt"),
    ("consolidate-st", "consolidate .safetensors"),
    ("reshard", "reshard 2 -> 3"),
    ("convert-dcp", "convert to DCP"),
];
const DCP_OPS: [(&str, &str); 2] = [
    ("dcp-consolidate", "DCP consolidate (.pt)"),
    ("dcp-to-fsdp", "DCP to checkpoint for 3 ranks"),
];

/// One size's run in progress.
struct SizeRun<'a> {
    root: &'a Path,
    units: usize,
    row: Row,
}

impl SizeRun<'_> {
    /// Saves the inputs named (an empty path for the other) and records the time.
    fn make(&mut self, ckpt: &Path, dcp: &Path) {
        let Outcome::Ran { secs, peak, .. } =
            crate_child(&["make", &self.units.to_string(), &s(ckpt), &s(dcp)])
        else {
            unreachable!("crate_child panics on failure");
        };
        println!(
            "  inputs saved in {secs:.1} s (peak RSS {:.2} GB): checkpoint {:.2} GB, DCP {:.2} GB",
            peak as f64 / 1e9,
            disk_bytes(ckpt) as f64 / 1e9,
            disk_bytes(dcp) as f64 / 1e9
        );
        self.row.make_secs += secs;
    }

    /// Runs the crate's operations `ops` on `src`, each output removed after it.
    fn crate_ops(&mut self, ops: &[(&str, &str)], src: &Path, keep_dcp_pt: bool) {
        let root = self.root;
        for &(op, label) in ops {
            let dst = match op {
                "dcp-consolidate" => root.join("dcp.pt"),
                "dcp-to-fsdp" => root.join("from-dcp"),
                "reshard" => root.join("ckpt3"),
                "convert-dcp" => root.join("converted"),
                "consolidate-st" => root.join("full.safetensors"),
                _ => root.join("full.pt"),
            };
            let o = crate_child(&[op, &s(src), &s(&dst), &self.units.to_string()]);
            report(label, self.row.bytes, &o);
            if op == "reshard" || op == "dcp-to-fsdp" {
                checkpoint::verify(&dst).expect("the written checkpoint verifies");
            }
            if op == "dcp-to-fsdp" {
                if let Outcome::Ran { peak, .. } = o {
                    println!(
                        "    peak RSS {:.1} MB against the bound of 2 x the largest tensor + 64 MiB = {:.1} MB: {}",
                        peak as f64 / 1e6,
                        DCP_TO_FSDP_BOUND as f64 / 1e6,
                        if peak <= DCP_TO_FSDP_BOUND { "within" } else { "OVER" }
                    );
                }
            }
            self.row.disk_peak = self.row.disk_peak.max(disk_bytes(root));
            if !(op == "dcp-consolidate" && keep_dcp_pt) {
                remove(&dst);
            }
            self.row.ops.push((label.to_string(), o));
        }
    }

    /// The same operations by `fsdp-ckpt` under `mpirun`, when there is such a tool.
    fn tool_ops(&mut self, ops: &[(&str, &str)], src: &Path) {
        let Some((tool, nps)) = mpi_tool() else {
            return;
        };
        let root = self.root;
        // The model description `convert --to fsdp` takes.
        let desc = root.join("desc.json");
        let text = fsdp::commands::rank_dicts::DescFile::new(model(self.units), policy(self.units))
            .to_json();
        std::fs::write(&desc, text).expect("writing desc.json");
        let to_fsdp = ["--to", "fsdp", "--model", &s(&desc), "--world-size", "3"].map(String::from);
        for &np in &nps {
            for &(op, label) in ops {
                let (dst, args): (PathBuf, &[&str]) = match op {
                    "reshard" => (root.join("ckpt3"), &["--world-size", "3"]),
                    "consolidate-st" => (root.join("full.safetensors"), &[]),
                    "consolidate-pt" => (root.join("full.pt"), &[]),
                    "convert-dcp" => (root.join("converted"), &["--to", "dcp"]),
                    "dcp-consolidate" => (root.join("dcp-np.pt"), &[]),
                    _ => (root.join("from-dcp"), &[]),
                };
                let what = match op {
                    "reshard" => "reshard",
                    "convert-dcp" | "dcp-to-fsdp" => "convert",
                    _ => "consolidate",
                };
                let mut argv = vec![what.to_string(), s(src), s(&dst)];
                argv.extend(args.iter().map(|a| a.to_string()));
                if op == "dcp-to-fsdp" {
                    argv.extend(to_fsdp.iter().cloned());
                }
                let o = tool_job(&tool, np, &argv, src);
                let label = format!("fsdp-ckpt {label}, mpirun -np {np}");
                report(&label, self.row.bytes, &o);
                self.row.disk_peak = self.row.disk_peak.max(disk_bytes(root));
                remove(&dst);
                self.row.ops.push((label, o));
            }
        }
    }
}

fn run_size(
    root: &Path,
    py: &Path,
    units: usize,
    disk: Disk,
    torch_failed: &mut [Option<usize>; 2],
) -> Row {
    let model = model(units);
    let params = model.numel();
    let bytes = (params * 2 * 4) as u64;
    let (ckpt, dcp) = (root.join("ckpt"), root.join("dcp"));
    println!(
        "\n== {units} units, {params} parameters, {:.2} GB of Adam state; load average {}; {}",
        bytes as f64 / 1e9,
        loadavg(),
        match disk {
            Disk::Together => "checkpoint and DCP directory saved together",
            Disk::Apart => "checkpoint and DCP directory saved one after the other (disk)",
        }
    );
    let mut run = SizeRun {
        root,
        units,
        row: Row {
            units,
            params,
            bytes,
            raw_write: 0.0,
            raw_read: 0.0,
            make_secs: 0.0,
            disk,
            disk_peak: 0,
            ops: Vec::new(),
        },
    };
    let none = PathBuf::new();
    match disk {
        Disk::Together => run.make(&ckpt, &dcp),
        Disk::Apart => run.make(&ckpt, &none),
    }

    let raw = root.join("raw.bin");
    let rw = raw_write(&raw, bytes);
    evict(&raw);
    let rr = raw_read(&raw);
    run.row.disk_peak = disk_bytes(root);
    let _ = std::fs::remove_file(&raw);
    println!("  raw write+fsync {rw:.2} s, raw read (cold) {rr:.2} s");
    (run.row.raw_write, run.row.raw_read) = (rw, rr);

    // The checkpoint's operations, then the DCP directory's (saved now when apart).
    let check_equal = params <= CHECK_EQUAL_UP_TO;
    run.crate_ops(&CKPT_OPS, &ckpt, false);
    if disk == Disk::Apart {
        run.tool_ops(&CKPT_OPS, &ckpt);
        remove(&ckpt);
        run.make(&none, &dcp);
    }
    run.crate_ops(&DCP_OPS, &dcp, check_equal);
    if disk == Disk::Together {
        run.tool_ops(&CKPT_OPS, &ckpt);
    }
    run.tool_ops(&DCP_OPS, &dcp);
    let mut row = run.row;
    let dcp_pt = root.join("dcp.pt");

    // PyTorch: dcp_to_torch_save of the same directory.
    let theirs = root.join("theirs.pt");
    let o = torch_job(&mut torch_failed[0], params, || {
        evict(&dcp);
        python_job(
            py,
            "dcp_side_by_side.py",
            &["to_torch_synced", &s(&dcp), &s(&theirs)],
            |v| Outcome::Ran {
                secs: v["seconds"].as_f64().expect("seconds"),
                cpu: f64::NAN,
                peak: v["peak_rss"].as_u64().expect("peak_rss"),
            },
        )
    });
    report("PyTorch dcp_to_torch_save + fsync", bytes, &o);
    if matches!(o, Outcome::Ran { .. }) && check_equal {
        let same = Command::new(py)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/dcp_side_by_side.py"))
            .args(["same", &s(&dcp_pt), &s(&theirs)])
            .output()
            .expect("running python");
        assert!(
            same.status.success(),
            "the crate's and PyTorch's DCP consolidations differ: {}",
            String::from_utf8_lossy(&same.stderr)
        );
        println!("  PyTorch: both DCP consolidations are equal (structure, key order, bits)");
    }
    row.ops
        .push(("PyTorch dcp_to_torch_save + fsync".into(), o));
    row.disk_peak = row.disk_peak.max(disk_bytes(root));
    remove(&theirs);
    remove(&dcp_pt);
    remove(&dcp);

    // PyTorch FSDP1: consolidate the live sharded state and save it.
    let o = torch_job(&mut torch_failed[1], params, || {
        python_job(
            py,
            "pytorch_side_by_side.py",
            &[
                "--layers",
                &units.to_string(),
                "--out",
                &OUT.to_string(),
                "--inp",
                &IN.to_string(),
                "--reps",
                "1",
                "--ops",
                "consolidate_save",
                "--dir",
                &s(root),
            ],
            |v| {
                let op = &v["ops"]["consolidate_save"];
                Outcome::Ran {
                    secs: op["times"][0].as_f64().expect("seconds"),
                    cpu: f64::NAN,
                    peak: op["peak_rss"]
                        .as_array()
                        .expect("per-rank peaks")
                        .iter()
                        .map(|p| p.as_u64().expect("bytes"))
                        .sum(),
                }
            },
        )
    });
    report(
        "PyTorch FSDP1 full_optim_state_dict + torch.save + fsync",
        bytes,
        &o,
    );
    row.ops
        .push(("PyTorch FSDP1 full_optim_state_dict + save".into(), o));
    remove(&ckpt);
    row
}

/// The `fsdp-ckpt` executable built with `mpi` (`SCALE_BENCH_TOOL`, which `scripts/bench.sh`
/// sets) and the process counts to run it with (`SCALE_BENCH_NP`, default 1,2,4), when it
/// and `mpirun` exist.
fn mpi_tool() -> Option<(PathBuf, Vec<usize>)> {
    let tool = PathBuf::from(std::env::var_os("SCALE_BENCH_TOOL")?);
    let has_mpirun = Command::new("mpirun").arg("--version").output().is_ok();
    if !tool.exists() || !has_mpirun {
        return None;
    }
    let nps = std::env::var("SCALE_BENCH_NP")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .map(|n| n.trim().parse().expect("SCALE_BENCH_NP: process counts"))
        .collect();
    Some((tool, nps))
}

/// `mpirun -np NP fsdp-ckpt ARGS` on the input `src` (evicted first), wall clock from outside
/// (mpirun's start and end included); its peak memory is not measured.
fn tool_job(tool: &Path, np: usize, args: &[String], src: &Path) -> Outcome {
    evict(src);
    let start = Instant::now();
    let out = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(["--mca", "mpi_yield_when_idle", "1"])
        .arg(tool)
        .args(args)
        .output()
        .expect("running mpirun");
    let secs = start.elapsed().as_secs_f64();
    if !out.status.success() {
        return Outcome::Failed(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Outcome::Ran {
        secs,
        cpu: f64::NAN,
        peak: 0,
    }
}

/// Runs a PyTorch job unless it already failed at a smaller size (`failed_at`, which a failure
/// here sets).
fn torch_job(
    failed_at: &mut Option<usize>,
    params: usize,
    job: impl FnOnce() -> Outcome,
) -> Outcome {
    if let Some(at) = *failed_at {
        return Outcome::NotRun(format!("failed at {:.1}M parameters", at as f64 / 1e6));
    }
    let o = job();
    if matches!(o, Outcome::Failed(_)) {
        *failed_at = Some(params);
    }
    o
}

fn report(label: &str, bytes: u64, o: &Outcome) {
    match o {
        Outcome::Ran { secs, cpu, peak } => println!(
            "  {label}: {secs:.2} s, {:.2} GB/s,{} peak RSS {}",
            bytes as f64 / secs / 1e9,
            if cpu.is_nan() {
                String::new()
            } else {
                format!(" CPU {cpu:.2} s,")
            },
            if *peak == 0 {
                "not measured".to_string()
            } else {
                format!("{:.0} MB", *peak as f64 / 1e6)
            }
        ),
        Outcome::Failed(why) => println!("  {label}: FAILED: {why}"),
        Outcome::NotRun(why) => println!("  {label}: not run ({why})"),
    }
}

fn remove(p: &Path) {
    let _ = std::fs::remove_dir_all(p);
    let _ = std::fs::remove_file(p);
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

// ---------------------------------------------------------------------------------------------
// Summary.

fn summary(rows: &[Row]) {
    println!("\n## Summary (seconds; GB/s of Adam state; peak RSS MB)\n");
    println!("| params | Adam GB | raw write+fsync s | raw read s | operation | seconds | GB/s | vs max(read, write) | peak RSS MB |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        let floor = r.raw_write.max(r.raw_read);
        for (label, o) in &r.ops {
            let cells = match o {
                Outcome::Ran { secs, peak, .. } => format!(
                    "{secs:.2} | {:.2} | {:.2} | {}",
                    r.bytes as f64 / secs / 1e9,
                    floor / secs,
                    if *peak == 0 {
                        "—".to_string()
                    } else {
                        format!("{:.0}", *peak as f64 / 1e6)
                    }
                ),
                Outcome::Failed(why) => format!("failed: {why} | | | "),
                Outcome::NotRun(why) => format!("not run: {why} | | | "),
            };
            println!(
                "| {:.1}M | {:.2} | {:.2} | {:.2} | {label} | {cells} |",
                r.params as f64 / 1e6,
                r.bytes as f64 / 1e9,
                r.raw_write,
                r.raw_read
            );
        }
    }
    println!("\n## Linearity: seconds per GB of Adam state, each size against the largest\n");
    let last = rows.last().expect("a size");
    for (label, last_o) in &last.ops {
        let per_gb: Vec<String> = rows
            .iter()
            .map(
                |r| match r.ops.iter().find(|(l, _)| l == label).map(|(_, o)| o) {
                    Some(Outcome::Ran { secs, .. }) => {
                        let mine = secs / (r.bytes as f64 / 1e9);
                        match last_o {
                            Outcome::Ran { secs: l, .. } => format!(
                                "{:.1}M: {mine:.2} s/GB ({:.2}x)",
                                r.params as f64 / 1e6,
                                mine / (l / (last.bytes as f64 / 1e9))
                            ),
                            _ => format!("{:.1}M: {mine:.2} s/GB", r.params as f64 / 1e6),
                        }
                    }
                    _ => format!("{:.1}M: -", r.params as f64 / 1e6),
                },
            )
            .collect();
        println!("* {label}: {}", per_gb.join("; "));
    }
    println!("\n## DCP to checkpoint against reshard (target: at most 1.3x) and its peak RSS\n");
    for r in rows {
        let of = |label: &str| {
            r.ops.iter().find_map(|(l, o)| match o {
                Outcome::Ran { secs, peak, .. } if l == label => Some((*secs, *peak)),
                _ => None,
            })
        };
        if let (Some((d, peak)), Some((re, _))) =
            (of("DCP to checkpoint for 3 ranks"), of("reshard 2 -> 3"))
        {
            println!(
                "* {:.1}M: {d:.2} s against {re:.2} s, {:.2}x; peak RSS {:.1} MB (bound {:.1} MB)",
                r.params as f64 / 1e6,
                d / re,
                peak as f64 / 1e6,
                DCP_TO_FSDP_BOUND as f64 / 1e6
            );
        }
    }
    let made: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{} units: built and saved in {:.1} s{}, at most {:.1} GB on disk",
                r.units,
                r.make_secs,
                if r.disk == Disk::Apart {
                    " (checkpoint and DCP directory one after the other)"
                } else {
                    ""
                },
                r.disk_peak as f64 / 1e9
            )
        })
        .collect();
    println!("\n(inputs, untimed above; disk: {})", made.join("; "));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1..]);
        return;
    }
    let units: Vec<usize> = std::env::var("SCALE_BENCH_UNITS")
        .unwrap_or_else(|_| DEFAULT_UNITS.into())
        .split(',')
        .map(|u| u.trim().parse().expect("SCALE_BENCH_UNITS: unit counts"))
        .collect();
    let py = venv_python("scale bench");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/scale-bench");
    remove(&root);
    std::fs::create_dir_all(&root).expect("creating target/scale-bench");
    println!(
        "scale bench: {} cores, load average {}; units {units:?} of [{OUT}, {IN}] + [{OUT}], world size {WS}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    );
    let mut torch_failed = [None, None];
    let mut rows: Vec<Row> = Vec::new();
    for &u in &units {
        let bytes = model(u).numel() as u64 * 8;
        let free = free_bytes(&root);
        let Some(disk) = disk_plan(bytes, free) else {
            println!(
                "\n== stopping before {u} units ({:.2} GB of Adam state): an input and an output need about {:.1} GB, {:.1} GB are free under {}",
                bytes as f64 / 1e9,
                bytes as f64 * 2.1 / 1e9 + 2.1,
                free as f64 / 1e9,
                root.display()
            );
            break;
        };
        rows.push(run_size(&root, &py, u, disk, &mut torch_failed));
    }
    println!("\nload average at end: {}", loadavg());
    if rows.is_empty() {
        return;
    }
    summary(&rows);
    remove(&root);
}
