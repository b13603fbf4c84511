//! Hugging Face export side by side with PyTorch, in one run (issue: "export a DCP checkpoint
//! of at least 1 GB of model weights to HF files").
//!
//! PyTorch 2.13 (`benches/hf_export_side_by_side.py`, untimed) builds a synthetic f32 model
//! (by default an embedding [32000, 2048], the largest tensor at 262 MB, and 4 layers of
//! qkv / o / MLP up / MLP down / norm: 1.07 GB of weights) and saves it twice: as a DCP
//! directory (`dcp.save({"model": sd}, no_dist=True)`, keys `model.*`), and as a DCP
//! directory in Hugging Face storage (`HuggingFaceStorageWriter(save_distributed=True,
//! fqn_to_index_mapping=M)`, one rank's `shard-00001-model-*` files; M puts each tensor in the
//! file huggingface_hub's split puts it in). Then, in alternation, each run a fresh process:
//! - fsdp: `fsdp::commands::conversions::checkpoint_to_hf` of the DCP directory (what `fsdp-ckpt convert
//!   DCP_DIR OUT_DIR --to hf --max-shard-size B` does), `model-0000i-of-0000N.safetensors` +
//!   `model.safetensors.index.json`, synced before its rename;
//! - PyTorch's route: `dcp_to_torch_save` to a temporary .pt, `torch.load`, the `model`
//!   subtree split by `split_torch_state_dict_into_shards` and written with
//!   `safetensors.torch.save_file` (`{"format": "pt"}`), the index as `save_pretrained`
//!   dumps it, every file fsynced;
//! - `consolidate_safetensors_files` of the Hugging Face storage directory into the same
//!   files (M), fsynced;
//! - a raw write + fsync of the bytes of fsdp's output (`common::raw_write`).
//!
//! The same `max_shard_size` (`--shard-mb`, decimal MB as huggingface_hub's "500MB") serves
//! both fsdp and PyTorch's route. fsdp's output must equal PyTorch's route (file names, index,
//! every tensor's name, dtype, shape and bytes, checked by Python's safetensors); whether the
//! files are byte-identical is reported. Targets: fsdp's bandwidth at least 0.8x the raw
//! write's, and its peak RSS at most 2 x the largest tensor + 64 MiB.
//!
//! Peak RSS is each process's own high-water mark (VmHWM for the crate, ru_maxrss for
//! PyTorch, interpreter and imports included; their share alone is printed). Files live under
//! `target/hf-bench` and are removed at the end; the run needs about 5.5 GB of disk at the
//! default size.
//!
//! `cargo bench --bench hf_export [-- --embed ROWS --hidden H --layers N --shard-mb MB --reps R]`

mod common;
use common::{
    disk_bytes, gb, loadavg, mb, python_run, python_timed, raw_write, s, status_bytes, venv_python,
    Runs,
};
use fsdp::collectives::Solo;
use fsdp::commands::conversions;

use std::path::Path;
use std::time::Instant;

/// The Python side of this bench.
const SCRIPT: &str = "benches/hf_export_side_by_side.py";

const CHILD_ENV: &str = "FSDP_HF_BENCH_CHILD";

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
    let (embed, hidden, layers) = (
        arg("--embed", 32000),
        arg("--hidden", 2048),
        arg("--layers", 4),
    );
    let (shard_mb, reps) = (arg("--shard-mb", 500), arg("--reps", 3).max(1));
    let shard_bytes = (shard_mb as u64 * 1_000_000).to_string();
    let py = venv_python("hf_export bench");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/hf-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench directory");
    let (dcp, store, mapping) = (
        root.join("dcp"),
        root.join("hf-store"),
        root.join("map.json"),
    );
    println!(
        "hf_export bench: {} cores, load average {}; model embed [{embed}, {hidden}] + {layers} layers \
         x (qkv [{}, {hidden}], o [{hidden}, {hidden}], up [{}, {hidden}], down [{hidden}, {}], norm [{hidden}]) f32; \
         max_shard_size {shard_mb} MB",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg(),
        3 * hidden,
        4 * hidden,
        4 * hidden,
    );
    let made = python_run(
        SCRIPT,
        &py,
        &[
            "make",
            &s(&dcp),
            &s(&store),
            &s(&mapping),
            "--embed",
            &embed.to_string(),
            "--hidden",
            &hidden.to_string(),
            "--layers",
            &layers.to_string(),
            "--shard-bytes",
            &shard_bytes,
        ],
    );
    let made: serde_json::Value =
        serde_json::from_str(made.lines().last().unwrap_or("")).expect("make's json line");
    let field = |k: &str| made[k].as_u64().expect("make's json field");
    let (weights, largest) = (field("total_bytes"), field("largest"));
    println!(
        "input: {} GB of weights in {} tensors (largest {} MB); DCP directory {} GB; Hugging Face storage directory {} GB; {} output files",
        gb(weights),
        field("tensors"),
        mb(largest),
        gb(disk_bytes(&dcp)),
        gb(disk_bytes(&store)),
        field("files")
    );

    let (ours_dir, theirs_dir, cons_dir) = (
        root.join("ours"),
        root.join("theirs"),
        root.join("consolidated"),
    );
    let (tmp_pt, raw_file) = (root.join("tmp.pt"), root.join("raw.bin"));
    let (mut ours, mut theirs, mut cons, mut raw) = (
        Runs::default(),
        Runs::default(),
        Runs::default(),
        Runs::default(),
    );
    let mut out_bytes = 0;
    for _ in 0..reps {
        let _ = std::fs::remove_dir_all(&ours_dir);
        ours.push(crate_child(&dcp, &ours_dir, &shard_bytes));
        out_bytes = disk_bytes(&ours_dir);
        let _ = std::fs::remove_dir_all(&theirs_dir);
        theirs.push(python_timed(
            SCRIPT,
            &py,
            &[
                "torch_route",
                &s(&dcp),
                &s(&theirs_dir),
                &s(&tmp_pt),
                "--shard-bytes",
                &shard_bytes,
            ],
        ));
        let _ = std::fs::remove_file(&tmp_pt);
        let _ = std::fs::remove_dir_all(&cons_dir);
        cons.push(python_timed(
            SCRIPT,
            &py,
            &["consolidate", &s(&store), &s(&cons_dir), &s(&mapping)],
        ));
        raw.push((raw_write(&raw_file, out_bytes), 0));
        let _ = std::fs::remove_file(&raw_file);
    }
    let baseline = python_timed(SCRIPT, &py, &["baseline"]).1;
    println!(
        "{}",
        python_run(
            SCRIPT,
            &py,
            &["same", &s(&ours_dir), &s(&theirs_dir), &s(&cons_dir)]
        )
        .trim_end()
    );

    println!();
    println!(
        "{:<40} {:>9} {:>9} {:>12}",
        "operation (median of runs)", "seconds", "MB/s", "peak RSS MB"
    );
    let row = |name: &str, r: &Runs, peak: String| {
        let t = r.median_secs();
        println!(
            "{name:<40} {t:>9.2} {:>9.0} {peak:>12}",
            out_bytes as f64 / 1e6 / t
        );
    };
    row("fsdp checkpoint_to_hf", &ours, ours.peak_mb());
    row(
        "PyTorch: dcp_to_torch_save + save_file",
        &theirs,
        theirs.peak_mb(),
    );
    row("consolidate_safetensors_files", &cons, cons.peak_mb());
    row("raw write + fsync (same bytes)", &raw, "-".into());
    println!(
        "(MB/s: the {} MB of the output directory; PyTorch's peaks include {} MB of interpreter and imports)",
        mb(out_bytes),
        mb(baseline)
    );
    println!();
    let bandwidth = raw.median_secs() / ours.median_secs();
    let rss_cap = 2 * largest + 64 * 1024 * 1024;
    let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
    println!(
        "bandwidth: fsdp {bandwidth:.2}x the raw write + fsync (target >= 0.8x): {}",
        verdict(bandwidth >= 0.8)
    );
    println!(
        "peak RSS: fsdp {} MB against 2 x largest tensor + 64 MiB = {} MB: {}",
        ours.peak_mb(),
        mb(rss_cap),
        verdict(ours.peak() <= rss_cap)
    );
    println!(
        "fsdp against PyTorch's route: {:.1}x faster, {:.1}x less peak RSS; against consolidate_safetensors_files: {:.1}x faster, {:.1}x less peak RSS",
        theirs.median_secs() / ours.median_secs(),
        theirs.peak() as f64 / ours.peak() as f64,
        cons.median_secs() / ours.median_secs(),
        cons.peak() as f64 / ours.peak() as f64,
    );
    println!(
        "runs (s): fsdp {:?}; PyTorch route {:?}; consolidate_safetensors_files {:?}; raw {:?}",
        ours.secs, theirs.secs, cons.secs, raw.secs
    );
    println!("load average after: {}", loadavg());
    let _ = std::fs::remove_dir_all(&root);
}

/// Child mode: one export by the crate, then `CHILD seconds peak_rss`.
fn child(spec: &str) {
    let mut parts = spec.splitn(3, '\n');
    let (input, output, shard) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let opts = conversions::HfExportOptions {
        max_shard_size: Some(shard.parse().expect("max_shard_size")),
        ..Default::default()
    };
    let start = Instant::now();
    conversions::checkpoint_to_hf(
        Path::new(input),
        conversions::HfSource::Dcp,
        Path::new(output),
        &opts,
        &Solo,
    )
    .expect("exporting the DCP directory");
    let secs = start.elapsed().as_secs_f64();
    println!("CHILD {secs} {}", status_bytes("VmHWM:"));
}

fn crate_child(input: &Path, output: &Path, shard_bytes: &str) -> (f64, u64) {
    let spec = format!("{}\n{}\n{shard_bytes}", input.display(), output.display());
    let f = common::child_fields(CHILD_ENV, &spec, "export");
    (f[0].parse().unwrap(), f[1].parse().unwrap())
}
