//! The cost per tensor of reading a Hugging Face model directory, side by side with Python's
//! `safetensors` in one run (issue 39, item 7).
//!
//! `benches/hf_tensors_side_by_side.py make` writes `model.safetensors` files holding N
//! zero-element float32 tensors (`w.<i>`, shape [0]) for N = 600k and 1.2M (headers of 36 and
//! 72 MB, under the 100 MB limit of safetensors readers). Then, for each, each run a fresh
//! process:
//! - Python: `safe_open` + listing the keys (what transformers starts with);
//! - fsdp inspect: `fsdp::io::hf::summary` of the directory, printed as `fsdp-ckpt inspect`
//!   prints it (into a sink);
//! - fsdp convert --to dcp: `fsdp::commands::conversions::hf_to_dcp` (what `fsdp-ckpt convert HF_DIR OUT --to
//!   dcp` does), the DCP directory written and synced.
//!
//! Targets: at 1.2M tensors each fsdp operation takes at most 2x Python's time, with a peak
//! RSS of at most 4x the header + 100 MB; from 600k to 1.2M tensors, time and peak RSS grow
//! at most 2.3x. Peak RSS is each process's own high-water mark (VmHWM for the crate,
//! ru_maxrss for Python, the interpreter included). Files live under `target/hf-tensors-bench`
//! and are removed at the end (about 250 MB).
//!
//! `cargo bench --bench hf_tensors [-- --reps R --small N --large N]`

mod common;
use common::{loadavg, mb, python_run, python_timed, s, status_bytes, venv_python, Runs};
use fsdp::collectives::Solo;
use std::path::Path;
use std::time::Instant;

/// The Python side of this bench.
const SCRIPT: &str = "benches/hf_tensors_side_by_side.py";

const CHILD_ENV: &str = "FSDP_HF_TENSORS_BENCH_CHILD";

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: usize| -> usize {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let reps = arg("--reps", 3).max(1);
    let sizes = [arg("--small", 600_000), arg("--large", 1_200_000)];
    let py = venv_python("hf_tensors bench");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/hf-tensors-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench directory");
    println!(
        "hf_tensors bench: {} cores, load average {}; {reps} runs each",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    );
    let mut results = Vec::new();
    for n in sizes {
        let dir = root.join(format!("hf{n}"));
        let made = python_run(SCRIPT, &py, &["make", &s(&dir), &n.to_string()]);
        let made: serde_json::Value =
            serde_json::from_str(made.lines().last().unwrap_or("")).expect("make's json line");
        let header = made["header_bytes"].as_u64().expect("header_bytes");
        let (mut python, mut inspect, mut import) =
            (Runs::default(), Runs::default(), Runs::default());
        let out = root.join("dcp");
        for _ in 0..reps {
            python.push(python_timed(SCRIPT, &py, &["keys", &s(&dir)]));
            inspect.push(crate_child("inspect", &dir, &out));
            let _ = std::fs::remove_dir_all(&out);
            import.push(crate_child("import", &dir, &out));
            let _ = std::fs::remove_dir_all(&out);
        }
        results.push((n, header, python, inspect, import));
    }
    let baseline = python_timed(SCRIPT, &py, &["baseline"]).1;
    println!();
    println!(
        "{:>9} {:>10} {:<26} {:>9} {:>12} {:>12}",
        "tensors", "header MB", "operation (median)", "seconds", "peak RSS MB", "x Python"
    );
    for (n, header, python, inspect, import) in &results {
        for (name, r) in [
            ("Python safe_open + keys", python),
            ("fsdp inspect", inspect),
            ("fsdp convert --to dcp", import),
        ] {
            println!(
                "{n:>9} {:>10} {name:<26} {:>9.2} {:>12} {:>12.2}",
                mb(*header),
                r.median_secs(),
                r.peak_mb(),
                r.median_secs() / python.median_secs()
            );
        }
    }
    println!(
        "(Python's peaks include {} MB of interpreter and imports)",
        mb(baseline)
    );
    println!();
    let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
    let (small, large) = (&results[0], &results[1]);
    for (name, pick) in [
        (
            "inspect",
            (|r: &(usize, u64, Runs, Runs, Runs)| &r.3) as fn(&_) -> &Runs,
        ),
        ("convert --to dcp", |r| &r.4),
    ] {
        let (s, l) = (pick(small), pick(large));
        let ratio = l.median_secs() / large.2.median_secs();
        let cap = 4 * large.1 + 100_000_000;
        let (dt, dm) = (
            l.median_secs() / s.median_secs(),
            l.peak() as f64 / s.peak() as f64,
        );
        println!(
            "{name}: {ratio:.2}x Python's time at {} tensors (target <= 2x): {}; peak RSS {} MB against 4 x header + 100 MB = {} MB: {}; doubling the tensors: time x{dt:.2}, RSS x{dm:.2} (target <= 2.3): {}",
            large.0,
            verdict(ratio <= 2.0),
            l.peak_mb(),
            mb(cap),
            verdict(l.peak() <= cap),
            verdict(dt <= 2.3 && dm <= 2.3),
        );
    }
    for (n, _, python, inspect, import) in &results {
        println!(
            "runs (s) at {n}: Python {:?}; inspect {:?}; convert --to dcp {:?}",
            python.secs, inspect.secs, import.secs
        );
    }
    println!("load average after: {}", loadavg());
    let _ = std::fs::remove_dir_all(&root);
}

/// Child mode: one operation by the crate, then `CHILD seconds peak_rss`.
fn child(spec: &str) {
    let mut parts = spec.splitn(3, '\n');
    let (op, input, output) = (
        parts.next().unwrap(),
        Path::new(parts.next().unwrap()),
        Path::new(parts.next().unwrap()),
    );
    let start = Instant::now();
    match op {
        "inspect" => {
            use std::io::Write;
            let summary = fsdp::io::hf::summary(input).expect("inspecting the directory");
            let mut sink = std::io::BufWriter::new(std::io::sink());
            writeln!(sink, "{summary}").expect("printing");
        }
        _ => {
            let opts = fsdp::commands::conversions::HfImportOptions::default();
            fsdp::commands::conversions::hf_to_dcp(input, output, &opts, &Solo).expect("importing");
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!("CHILD {secs} {}", status_bytes("VmHWM:"));
}

fn crate_child(op: &str, input: &Path, output: &Path) -> (f64, u64) {
    let spec = format!("{op}\n{}\n{}", input.display(), output.display());
    let f = common::child_fields(CHILD_ENV, &spec, op);
    (f[0].parse().unwrap(), f[1].parse().unwrap())
}
