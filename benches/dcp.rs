//! DCP side by side with PyTorch, in one run (issue: "PyTorch Distributed Checkpoint").
//!
//! PyTorch 2.13 (`benches/dcp_side_by_side.py`) writes the full state of a model with Adam
//! state (`{"model", "optim"}`, as `get_state_dict` + `torch.save` hold it; by default about
//! 100M parameters: 0.8 GB of Adam state, 1.2 GB in all) and converts it with
//! `torch_save_to_dcp`. On that same DCP directory, in alternation, each run a fresh process:
//! - consolidate: `fsdp::io::dcp::consolidate_to_torch` (what `fsdp-ckpt consolidate DCP_DIR
//!   OUT.pt` does) against `dcp_to_torch_save`, as it is and followed by an fsync of its output
//!   (the crate's output is durable before its rename; `torch.save` never syncs); both outputs
//!   must be equal (structure, key order, bits), checked by PyTorch;
//! - to DCP: `fsdp::io::dcp::torch_save_to_dcp` (`fsdp-ckpt convert IN.pt OUT_DIR --to dcp`)
//!   against `torch_save_to_dcp`, and against a raw write + fsync of the directory's bytes;
//! - to DCP from shared storages: the same, from a `.pt` of the same model whose tensors are
//!   views into three flat storages (weights, `exp_avg`, `exp_avg_sq`, as `torch.save` of FSDP1
//!   flat parameters' views keeps them) plus a tied head, each storage read whole once; its
//!   peak RSS is judged against 2 x the largest storage + 64 MiB.
//!
//! Peak RSS is each process's own high-water mark (VmHWM for the crate, ru_maxrss for
//! PyTorch, interpreter included). Files live under `target/dcp-bench` and are removed at the
//! end; the run needs about 6 GB of disk at the default size.
//!
//! `cargo bench --bench dcp [-- --embed ROWS --layers N --reps R]`

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
const SCRIPT: &str = "benches/dcp_side_by_side.py";

const CHILD_ENV: &str = "FSDP_DCP_BENCH_CHILD";

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
    let (embed, layers, reps) = (arg("--embed", 32000), arg("--layers", 16), arg("--reps", 3));
    let py = venv_python("dcp bench");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/dcp-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench directory");
    let full = root.join("full.pt");
    let dcp = root.join("dcp");
    println!(
        "dcp bench: {} cores, load average {}; model embed [{embed}, 1024] + {layers} x [1024, 4096] f32",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    );
    python_run(
        SCRIPT,
        &py,
        &[
            "make",
            &s(&full),
            "--embed",
            &embed.to_string(),
            "--layers",
            &layers.to_string(),
        ],
    );
    python_timed(SCRIPT, &py, &["to_dcp", &s(&full), &s(&dcp)]);
    let dcp_bytes = disk_bytes(&dcp);
    let largest = (embed * 1024 * 4) as u64;
    let adam = 2 * (embed * 1024 + layers * 1024 * 4096) as u64 * 4;
    println!(
        "input: {} GB .pt; DCP directory {} GB ({} GB of Adam state); largest tensor {} MB",
        gb(disk_bytes(&full)),
        gb(dcp_bytes),
        gb(adam),
        mb(largest)
    );

    let (mut ours, mut theirs, mut theirs_synced) =
        (Runs::default(), Runs::default(), Runs::default());
    let (ours_pt, theirs_pt) = (root.join("ours.pt"), root.join("theirs.pt"));
    for _ in 0..reps {
        ours.push(crate_child("consolidate", &dcp, &ours_pt));
        theirs.push(python_timed(
            SCRIPT,
            &py,
            &["to_torch", &s(&dcp), &s(&theirs_pt)],
        ));
        let _ = std::fs::remove_file(&theirs_pt);
        theirs_synced.push(python_timed(
            SCRIPT,
            &py,
            &["to_torch_synced", &s(&dcp), &s(&theirs_pt)],
        ));
    }
    python_run(SCRIPT, &py, &["same", &s(&ours_pt), &s(&theirs_pt)]);
    let _ = std::fs::remove_file(&ours_pt);
    let _ = std::fs::remove_file(&theirs_pt);

    let (mut ours_w, mut theirs_w, mut raw) = (Runs::default(), Runs::default(), Runs::default());
    let (ours_dir, theirs_dir, raw_file) = (
        root.join("ours-dcp"),
        root.join("theirs-dcp"),
        root.join("raw.bin"),
    );
    for _ in 0..reps {
        let _ = std::fs::remove_dir_all(&ours_dir);
        ours_w.push(crate_child("to_dcp", &full, &ours_dir));
        let _ = std::fs::remove_dir_all(&theirs_dir);
        theirs_w.push(python_timed(
            SCRIPT,
            &py,
            &["to_dcp", &s(&full), &s(&theirs_dir)],
        ));
        raw.push((raw_write(&raw_file, disk_bytes(&ours_dir)), 0));
        let _ = std::fs::remove_file(&raw_file);
    }

    let shared = root.join("shared.pt");
    python_run(
        SCRIPT,
        &py,
        &[
            "make_shared",
            &s(&shared),
            "--embed",
            &embed.to_string(),
            "--layers",
            &layers.to_string(),
        ],
    );
    let shared_largest = ((embed * 1024 + layers * 1024 * 4096) * 4) as u64;
    let (mut ours_s, mut theirs_s) = (Runs::default(), Runs::default());
    for _ in 0..reps {
        let _ = std::fs::remove_dir_all(&ours_dir);
        ours_s.push(crate_child("to_dcp", &shared, &ours_dir));
        let _ = std::fs::remove_dir_all(&theirs_dir);
        theirs_s.push(python_timed(
            SCRIPT,
            &py,
            &["to_dcp", &s(&shared), &s(&theirs_dir)],
        ));
    }
    let shared_bytes = disk_bytes(&ours_dir);
    println!(
        "shared-storage input: {} GB .pt, largest storage {} MB; DCP directory {} GB",
        gb(disk_bytes(&shared)),
        mb(shared_largest),
        gb(shared_bytes)
    );

    println!();
    println!(
        "{:<34} {:>9} {:>9} {:>12}",
        "operation (median of runs)", "seconds", "GB/s", "peak RSS MB"
    );
    let row = |name: &str, r: &Runs, bytes: u64| {
        let t = r.median_secs();
        println!(
            "{name:<34} {t:>9.2} {:>9.3} {:>12}",
            bytes as f64 / 1e9 / t,
            r.peak_mb()
        );
    };
    row("consolidate: fsdp", &ours, dcp_bytes);
    row("consolidate: dcp_to_torch_save", &theirs, dcp_bytes);
    row("  ... + fsync of its output", &theirs_synced, dcp_bytes);
    row("to DCP: fsdp", &ours_w, dcp_bytes);
    row("to DCP: torch_save_to_dcp", &theirs_w, dcp_bytes);
    println!(
        "{:<34} {:>9.2} {:>9.3}",
        "raw write + fsync (same bytes)",
        raw.median_secs(),
        dcp_bytes as f64 / 1e9 / raw.median_secs()
    );
    row("to DCP, shared storages: fsdp", &ours_s, shared_bytes);
    row("  ... torch_save_to_dcp", &theirs_s, shared_bytes);
    println!();
    let speedup = theirs.median_secs() / ours.median_secs();
    let speedup_synced = theirs_synced.median_secs() / ours.median_secs();
    let rss_cap = 2 * largest + 64 * 1024 * 1024;
    println!(
        "consolidate: {speedup:.1}x dcp_to_torch_save, {speedup_synced:.1}x with its output fsynced as ours is (target >= 5x); peak RSS {} MB (PyTorch {} MB) against the cap 2 x largest tensor + 64 MiB = {} MB ({})",
        ours.peak_mb(),
        theirs.peak_mb(),
        mb(rss_cap),
        if ours.peak() <= rss_cap { "within" } else { "OVER" }
    );
    println!(
        "to DCP: {:.2}x raw write + fsync (target >= 0.5x), {:.1}x torch_save_to_dcp",
        raw.median_secs() / ours_w.median_secs(),
        theirs_w.median_secs() / ours_w.median_secs()
    );
    let shared_cap = 2 * shared_largest + 64 * 1024 * 1024;
    println!(
        "to DCP from shared storages: {:.1}x torch_save_to_dcp; peak RSS {} MB (PyTorch {} MB) against the cap 2 x largest storage + 64 MiB = {} MB ({})",
        theirs_s.median_secs() / ours_s.median_secs(),
        ours_s.peak_mb(),
        theirs_s.peak_mb(),
        mb(shared_cap),
        if ours_s.peak() <= shared_cap { "within" } else { "OVER" }
    );
    println!("runs (s): fsdp consolidate {:?}; dcp_to_torch_save {:?}; fsdp to DCP {:?}; torch_save_to_dcp {:?}; raw {:?}; shared storages: fsdp to DCP {:?}, torch_save_to_dcp {:?}", ours.secs, theirs.secs, ours_w.secs, theirs_w.secs, raw.secs, ours_s.secs, theirs_s.secs);
    println!("load average after: {}", loadavg());
    let _ = std::fs::remove_dir_all(&root);
}

/// Child mode: one operation of the crate, then `CHILD seconds peak_rss`.
fn child(spec: &str) {
    let mut parts = spec.splitn(3, '\n');
    let (op, input, output) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let start = Instant::now();
    match op {
        "consolidate" => {
            conversions::dcp_to_torch_save(Path::new(input), Path::new(output), &Solo, |_| {})
                .expect("consolidating the DCP directory");
        }
        "to_dcp" => {
            conversions::torch_save_to_dcp(Path::new(input), Path::new(output), &Solo)
                .expect("writing the DCP directory");
        }
        _ => panic!("unknown child op {op}"),
    }
    let secs = start.elapsed().as_secs_f64();
    println!("CHILD {secs} {}", status_bytes("VmHWM:"));
}

fn crate_child(op: &str, input: &Path, output: &Path) -> (f64, u64) {
    let spec = format!("{op}\n{}\n{}", input.display(), output.display());
    let f = common::child_fields(CHILD_ENV, &spec, op);
    (f[0].parse().unwrap(), f[1].parse().unwrap())
}
