//! DeepSpeed ZeRO-3 consolidation side by side with DeepSpeed's `zero_to_fp32`, in one run
//! (issue 28, item 5: "consolidating a ZeRO-3 checkpoint of at least 1 GB against DeepSpeed's
//! `zero_to_fp32`, with time and peak RSS for both").
//!
//! DeepSpeed 0.19.8 (`benches/deepspeed_side_by_side.py`, untimed) trains a synthetic fp32
//! model for one step under ZeRO stage 3 at world size 2 (gloo on CPU, client
//! `torch.optim.Adam`) and saves it with `engine.save_checkpoint`: by default 3 blocks of
//! `up` [8192, 2048] and `down` [2048, 8192] with biases, 100.7M parameters, whose optimizer
//! files (fp32 master weights, `exp_avg`, `exp_avg_sq`) hold 1.21 GB. The checkpoint is kept
//! in `target/ds-bench/ckpt-h<H>-l<N>` and reused by later runs of the same size (making one
//! takes a minute or two); `--drop-checkpoint` removes it at the end, and a run of another
//! size removes it at the start (the directory holds one checkpoint at most).
//!
//! Then, in alternation, each run a fresh process (`--reps R`, default 3; medians):
//! - fsdp: `fsdp::commands::conversions::deepspeed_to_safetensors` (what `fsdp-ckpt consolidate DS_DIR
//!   OUT.safetensors` does), in a child process of this bench so that its VmHWM is its own;
//!   the file is synced before its rename;
//! - DeepSpeed: `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
//!   DS_DIR, OUT_DIR, safe_serialization=True)` (one `model.safetensors`), then an fsync of
//!   its files and directory, timed inside Python after its imports;
//! - a raw write + fsync of as many bytes as fsdp's output (`common::raw_write`).
//!
//! By default the checkpoint's files are read whole before each fsdp and DeepSpeed run
//! (untimed), so that every run finds them in the page cache, as a conversion right after the
//! save does: the crate drops the pages it has read from the cache (a reader that reads each
//! byte once), so without this the run after it would read from the disk. With `--cold` they
//! are evicted (`posix_fadvise(DONTNEED)`) before each run instead, so each reads from the
//! disk.
//!
//! The two outputs must hold the same tensors (names, dtypes, shapes, bytes; checked once by
//! Python's safetensors, untimed). Targets: fsdp's bandwidth at least 0.8x the raw write's,
//! and its peak RSS at most 2 x the largest parameter + 64 MiB. Peak RSS is each process's
//! own high-water mark (VmHWM for the crate, ru_maxrss for Python: the interpreter, torch and
//! DeepSpeed included; the imports' share alone is printed beside it).
//!
//! DeepSpeed lives in its own venv (`$DS_VENV`, default `/work/ds-venv`, made by
//! `scripts/setup-deepspeed-venv.sh`); without it the bench fails, saying so. Outputs go to
//! `target/ds-bench/out` and are removed at the end. Disk: the checkpoint (12 bytes per
//! parameter, when not cached) and three outputs of 4 bytes per parameter, about 2.4 GB at
//! the default size; the bench checks the free space first.
//!
//! `cargo bench --bench deepspeed [-- --hidden H --layers N --reps R --cold --drop-checkpoint]`

mod common;
use common::{
    disk_bytes, evict, free_bytes, gb, loadavg, mb, python_run, python_timed, raw_read, raw_write,
    s, status_bytes, Runs,
};
use fsdp::collectives::Solo;
use fsdp::commands::conversions::{self, DeepSpeedOutput};

use std::path::{Path, PathBuf};
use std::time::Instant;

/// The Python side of this bench.
const SCRIPT: &str = "benches/deepspeed_side_by_side.py";

const CHILD_ENV: &str = "FSDP_DS_BENCH_CHILD";

/// What the command line asks for.
struct Options {
    hidden: usize,
    layers: usize,
    reps: usize,
    cold: bool,
    drop_checkpoint: bool,
}

impl Options {
    fn parse() -> Self {
        let args: Vec<String> = std::env::args().collect();
        let arg = |name: &str, default: usize| -> usize {
            args.iter()
                .position(|a| a == name)
                .and_then(|i| args.get(i + 1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let flag = |name: &str| args.iter().any(|a| a == name);
        Options {
            hidden: arg("--hidden", 2048),
            layers: arg("--layers", 3),
            reps: arg("--reps", 3).max(1),
            cold: flag("--cold"),
            drop_checkpoint: flag("--drop-checkpoint"),
        }
    }

    /// Parameters of the model `make` builds: per block, `up` [4H, H] + [4H] and `down`
    /// [H, 4H] + [H].
    fn params(&self) -> u64 {
        let h = self.hidden as u64;
        self.layers as u64 * (8 * h * h + 5 * h)
    }
}

/// The files of the bench: the cached checkpoint and what `make` says of it, and the outputs.
struct Paths {
    root: PathBuf,
    ckpt: PathBuf,
    made: PathBuf,
    ours: PathBuf,
    theirs: PathBuf,
    raw: PathBuf,
}

impl Paths {
    fn new(o: &Options) -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ds-bench");
        let name = format!("ckpt-h{}-l{}", o.hidden, o.layers);
        let out = root.join("out");
        Paths {
            ckpt: root.join(&name),
            made: root.join(format!("{name}.json")),
            ours: out.join("fsdp.safetensors"),
            theirs: out.join("zero_to_fp32"),
            raw: out.join("raw.bin"),
            root,
        }
    }

    fn out(&self) -> PathBuf {
        self.root.join("out")
    }
}

/// What `make` reports of the model in the checkpoint.
struct Made {
    params: u64,
    /// The fp32 weights' bytes.
    total_bytes: u64,
    /// The largest parameter's bytes.
    largest: u64,
    tensors: u64,
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let o = Options::parse();
    let py = ds_python();
    let p = Paths::new(&o);
    println!(
        "deepspeed bench: {} cores, load average {}; ZeRO-3 checkpoint at world size 2 of {} x (up [{}, {h}] + [{}], down [{h}, {}] + [{h}]) f32, one Adam step; {} reads, {} reps",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg(),
        o.layers,
        4 * o.hidden,
        4 * o.hidden,
        4 * o.hidden,
        if o.cold { "cold (evicted before each run)" } else { "warm (page cache)" },
        o.reps,
        h = o.hidden,
    );
    prepare_directory(&p);
    check_disk(&o, &p);
    let made = make_checkpoint(&o, &p, &py);
    println!(
        "input: checkpoint {} GB on disk ({} GB in *_optim_states.pt); {:.1}M parameters in {} tensors, {} GB of fp32 weights, largest parameter {} MB",
        gb(disk_bytes(&p.ckpt)),
        gb(optim_bytes(&p.ckpt)),
        made.params as f64 / 1e6,
        made.tensors,
        gb(made.total_bytes),
        mb(made.largest)
    );
    let (ours, theirs, raw, out_bytes) = time_alternated(&o, &p, &py);
    let baseline = python_timed(SCRIPT, &py, &["baseline"]).1;
    println!(
        "{}",
        python_run(SCRIPT, &py, &["same", &s(&p.ours), &s(&p.theirs)]).trim_end()
    );
    report(&made, &ours, &theirs, &raw, out_bytes, baseline);
    clean_up(&o, &p);
}

/// The Python of the DeepSpeed venv, `$DS_VENV/bin/python` (`DS_VENV` defaulting to
/// `/work/ds-venv`, as `scripts/setup-deepspeed-venv.sh` has it). DeepSpeed is both the
/// checkpoint's writer and the other side of the comparison, so the bench cannot run without
/// it: a missing venv fails the run, naming the script that makes it.
fn ds_python() -> PathBuf {
    let venv = std::env::var_os("DS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/work/ds-venv"));
    let py = venv.join("bin/python");
    if !py.exists() {
        eprintln!(
            "error: deepspeed bench: no DeepSpeed venv at {} (no {}). This bench needs DeepSpeed \
             0.19.8 to write its ZeRO-3 checkpoint and to run zero_to_fp32: run \
             scripts/setup-venv.sh, then scripts/setup-deepspeed-venv.sh (or set DS_VENV to \
             the venv it made).",
            venv.display(),
            py.display()
        );
        std::process::exit(2);
    }
    py
}

/// Creates `target/ds-bench` and empties it of everything but this size's cached checkpoint
/// (other sizes' checkpoints and a failed run's outputs go).
fn prepare_directory(p: &Paths) {
    std::fs::create_dir_all(&p.root).expect("bench directory");
    for e in std::fs::read_dir(&p.root).expect("listing the bench directory") {
        let path = e.expect("a directory entry").path();
        if path == p.ckpt || path == p.made {
            continue;
        }
        if path.is_dir() {
            std::fs::remove_dir_all(&path).expect("removing an old bench directory");
        } else {
            std::fs::remove_file(&path).expect("removing an old bench file");
        }
    }
    std::fs::create_dir_all(p.out()).expect("output directory");
}

/// Fails the run, before anything is written, when the disk cannot hold the checkpoint (unless
/// cached) and the three outputs: 12 bytes per parameter (fp32 master weights and Adam's two
/// moments) and 3 x 4, with 256 MiB to spare.
fn check_disk(o: &Options, p: &Paths) {
    let cached = p.made.exists() && p.ckpt.is_dir();
    let params = o.params();
    let need = if cached { 0 } else { 12 * params } + 3 * 4 * params + (256 << 20);
    let free = free_bytes(&p.root);
    assert!(
        free >= need,
        "deepspeed bench: {} GB free under {}, {} GB needed ({}checkpoint of {:.1}M parameters and three outputs)",
        gb(free),
        p.root.display(),
        gb(need),
        if cached { "a cached " } else { "a new " },
        params as f64 / 1e6
    );
    println!(
        "disk: {} GB free, {} GB needed (checkpoint {})",
        gb(free),
        gb(need),
        if cached { "cached" } else { "to make" }
    );
}

/// The ZeRO-3 checkpoint, made by DeepSpeed under torchrun unless `make` finds it cached.
fn make_checkpoint(o: &Options, p: &Paths, py: &Path) -> Made {
    let start = Instant::now();
    let out = python_run(
        SCRIPT,
        py,
        &[
            "make",
            &s(&p.ckpt),
            &s(&p.made),
            "--hidden",
            &o.hidden.to_string(),
            "--layers",
            &o.layers.to_string(),
        ],
    );
    let v: serde_json::Value =
        serde_json::from_str(out.lines().last().unwrap_or("")).expect("make's json line");
    let field = |k: &str| v[k].as_u64().expect("make's json field");
    println!(
        "checkpoint {} ready in {:.0} s",
        p.ckpt.display(),
        start.elapsed().as_secs_f64()
    );
    Made {
        params: field("params"),
        total_bytes: field("total_bytes"),
        largest: field("largest"),
        tensors: field("tensors"),
    }
}

/// Every file under `dir`, depth first.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).expect("listing the checkpoint") {
        let path = e.expect("a directory entry").path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Bytes of the checkpoint's optimizer files (where the fp32 weights are read from).
fn optim_bytes(ckpt: &Path) -> u64 {
    files_under(ckpt)
        .iter()
        .filter(|f| s(f).ends_with("_optim_states.pt"))
        .map(|f| disk_bytes(f))
        .sum()
}

/// Puts the checkpoint where the next run is to read it from: with `cold`, out of the page
/// cache (its files are synced, so their pages go); else in it, every file read whole.
/// Returns the seconds the reads took (0 for `cold`).
fn prepare_input(cold: bool, ckpt: &Path) -> f64 {
    if cold {
        evict(ckpt);
        return 0.0;
    }
    files_under(ckpt).iter().map(|f| raw_read(f)).sum()
}

/// The three operations, alternated, `o.reps` times each; the last fsdp and DeepSpeed outputs
/// stay for the equality check. Returns their runs and the bytes of fsdp's output.
fn time_alternated(o: &Options, p: &Paths, py: &Path) -> (Runs, Runs, Runs, u64) {
    let (mut ours, mut theirs, mut raw) = (Runs::default(), Runs::default(), Runs::default());
    let mut out_bytes = 0;
    for i in 0..o.reps {
        let _ = std::fs::remove_file(&p.ours);
        let secs = prepare_input(o.cold, &p.ckpt);
        if i == 0 && !o.cold {
            println!(
                "page cache: the checkpoint read whole in {secs:.2} s before each run (untimed)"
            );
        }
        let (secs, peak, cpu) = crate_child(&p.ckpt, &p.ours);
        ours.push((secs, peak));
        ours.cpu.push(cpu);
        out_bytes = disk_bytes(&p.ours);
        let _ = std::fs::remove_dir_all(&p.theirs);
        prepare_input(o.cold, &p.ckpt);
        theirs.push(python_timed(
            SCRIPT,
            py,
            &["zero_to_fp32", &s(&p.ckpt), &s(&p.theirs)],
        ));
        raw.push((raw_write(&p.raw, out_bytes), 0));
        let _ = std::fs::remove_file(&p.raw);
    }
    println!(
        "outputs: fsdp {} bytes, zero_to_fp32 {} bytes",
        out_bytes,
        disk_bytes(&p.theirs)
    );
    (ours, theirs, raw, out_bytes)
}

/// The table, the targets and the single runs.
fn report(made: &Made, ours: &Runs, theirs: &Runs, raw: &Runs, out_bytes: u64, baseline: u64) {
    println!();
    println!(
        "{:<44} {:>8} {:>7} {:>7} {:>12}",
        "operation (median of runs)", "seconds", "GB/s", "x raw", "peak RSS MB"
    );
    let row = |name: &str, r: &Runs, peak: String| {
        let t = r.median_secs();
        println!(
            "{name:<44} {t:>8.2} {:>7.3} {:>7.2} {peak:>12}",
            out_bytes as f64 / 1e9 / t,
            raw.median_secs() / t
        );
    };
    row("fsdp deepspeed_to_safetensors", ours, ours.peak_mb());
    row(
        "DeepSpeed zero_to_fp32 (safetensors) + fsync",
        theirs,
        theirs.peak_mb(),
    );
    row("raw write + fsync (same bytes)", raw, "-".into());
    println!(
        "(GB/s: the {} MB of fsdp's output; x raw: the raw write's median time over the operation's; DeepSpeed's peak includes {} MB of interpreter and imports)",
        mb(out_bytes),
        mb(baseline)
    );
    println!();
    let verdict = |ok: bool| if ok { "MET" } else { "MISSED" };
    let bandwidth = raw.median_secs() / ours.median_secs();
    println!(
        "bandwidth: fsdp {bandwidth:.2}x the raw write + fsync (target >= 0.8x): {}; zero_to_fp32 {:.2}x",
        verdict(bandwidth >= 0.8),
        raw.median_secs() / theirs.median_secs()
    );
    let rss_cap = 2 * made.largest + 64 * 1024 * 1024;
    println!(
        "peak RSS: fsdp {} MB against 2 x largest parameter + 64 MiB = {} MB: {}; zero_to_fp32 {} MB ({} MB above its imports' {} MB)",
        ours.peak_mb(),
        mb(rss_cap),
        verdict(ours.peak() <= rss_cap),
        theirs.peak_mb(),
        mb(theirs.peak().saturating_sub(baseline)),
        mb(baseline)
    );
    println!(
        "fsdp against zero_to_fp32: {:.1}x faster, {:.1}x less peak RSS ({:.1}x less than its share above the imports)",
        theirs.median_secs() / ours.median_secs(),
        theirs.peak() as f64 / ours.peak() as f64,
        theirs.peak().saturating_sub(baseline) as f64 / ours.peak() as f64
    );
    println!(
        "runs (s): fsdp {:?} (CPU {:?}); zero_to_fp32 {:?}; raw {:?}",
        ours.secs, ours.cpu, theirs.secs, raw.secs
    );
    println!("load average after: {}", loadavg());
}

/// Removes the outputs, and the checkpoint too with `--drop-checkpoint`.
fn clean_up(o: &Options, p: &Paths) {
    let _ = std::fs::remove_dir_all(p.out());
    if o.drop_checkpoint {
        let _ = std::fs::remove_dir_all(&p.ckpt);
        let _ = std::fs::remove_file(&p.made);
        println!("removed the checkpoint {}", p.ckpt.display());
    } else {
        println!(
            "kept the checkpoint {} for the next run (--drop-checkpoint removes it)",
            p.ckpt.display()
        );
    }
}

/// Child mode: one consolidation by the crate, then `CHILD seconds peak_rss cpu_seconds`.
fn child(spec: &str) {
    let (input, output) = spec.split_once('\n').expect("child spec");
    let start = Instant::now();
    conversions::deepspeed_to_safetensors(
        Path::new(input),
        Path::new(output),
        DeepSpeedOutput::default(),
        &Solo,
        |_| {},
    )
    .expect("consolidating the DeepSpeed checkpoint");
    let secs = start.elapsed().as_secs_f64();
    println!("CHILD {secs} {} {}", status_bytes("VmHWM:"), cpu_secs());
}

/// User + system CPU seconds of this process so far.
fn cpu_secs() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return f64::NAN;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// (seconds, peak RSS, CPU seconds) of one consolidation in a fresh child process.
fn crate_child(input: &Path, output: &Path) -> (f64, u64, f64) {
    let spec = format!("{}\n{}", input.display(), output.display());
    let f = common::child_fields(CHILD_ENV, &spec, "consolidation");
    (
        f[0].parse().unwrap(),
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
    )
}
