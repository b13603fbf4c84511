//! Throughput and peak memory of the sharded optimizer checkpoint (`fsdp::checkpoint`),
//! beside this machine's raw sequential file bandwidth for the same byte count, measured in
//! the same run.
//!
//! The model: 64 FSDP units `layers.{i}` of `weight` [1024, 4096] and `bias` [1024]
//! (268,500,992 parameters), `use_orig_params=False`. Adam state per parameter: `step`
//! (0-dim f32), `exp_avg` and `exp_avg_sq` (f32, parameter-shaped): 2,148,007,936 tensor
//! bytes (2.0 GiB) in the checkpoint. Every rank's local state is
//! `shard_full_optim_state_dict` of one full dict.
//!
//! Operations, each repeated `CKPT_BENCH_REPS` times (default 3); the table shows the median
//! and, in parentheses, the best wall time:
//! - `save`: 4 thread ranks call `Fsdp::save_optim_checkpoint`, timed from a barrier before to
//!   a barrier after (the call returns on every rank once rank 0 has committed: data files,
//!   manifest and commit marker synced, directory renamed into place). The previous
//!   checkpoint is removed before each repetition, untimed, so each one is a fresh save.
//! - `load`: 3 thread ranks under another wrapping (even layers as units, the odd ones in the
//!   root unit) call `Fsdp::load_optim_checkpoint` with verification on, barrier to barrier.
//! - `reshard`: `checkpoint::reshard` of the world-size-4 checkpoint to world size 2 (same
//!   policy), in a fresh child process (this binary re-executed with `--child`); the result
//!   is checked with `checkpoint::verify`.
//! - `consolidate`: `checkpoint::consolidate_to_safetensors` of the world-size-4 checkpoint,
//!   in a fresh child process.
//! - `consolidate-pt`: `checkpoint::consolidate_to_torch` (a `torch.save` file), the same way.
//!
//! Throughput is the checkpoint's tensor bytes (`Manifest::tensor_bytes`) over the wall time.
//! Baselines, on a file of exactly that many bytes in the same directory, std::fs only:
//! `raw write` (1 MiB `write_all` calls from one reused buffer, then `sync_all`), `raw read`
//! (1 MiB `read` calls into one reused buffer) and `raw copy` (read one file and write another
//! in 1 MiB chunks, then `sync_all`). `save` is compared with raw write, `load` with raw read,
//! and `reshard` and `consolidate` (which read and write every byte) with raw copy. Each run
//! of an operation directly follows one run of its baseline, so drift in the shared disk's
//! speed hits both alike.
//!
//! Reads are cold for the crate and the baselines alike: before every timed read, the files
//! to be read (all synced, so clean) are evicted from the page cache with
//! `posix_fadvise(POSIX_FADV_DONTNEED)`, and the bench prints how many of their pages were
//! still resident afterwards (`mincore`). Nothing touches `/proc/sys/vm/drop_caches`: the
//! machine is shared.
//!
//! Peak memory: each child reads `VmHWM` from `/proc/self/status` before it starts working
//! (the binary's fixed overhead) and at the end, and prints both, with its CPU time and the
//! bytes it read (`rchar` of `/proc/self/io`: 1.00x the tensor bytes means every stored block
//! was read once). The target compares the end figure (the whole process, overhead included)
//! with twice the largest flat parameter's state (`exp_avg` + `exp_avg_sq` of one unit,
//! 32 MiB) plus 64 MiB. The buffer cache of `fsdp::tensor` is disabled in this process and in the
//! children (`set_buffer_cache_limit(0)`), so dropped tensors go back to the OS and every load
//! pays its first touch of fresh memory, as a job starting up does.
//!
//! Files live under `target/ckpt-bench/` (about 6.5 GB at most) and are removed at the end.
//!
//! Run: `cargo bench --bench checkpoint`.

mod common;
use common::full_adam_state;

use fsdp::checkpoint::{self, LoadOptions, SaveOptions};
use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::flat_param::ModelLayout;
use fsdp::{DType, Fsdp, ModelDesc, OptimStateDict, WrapPolicy};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Instant;

const UNITS: usize = 64;
const OUT: usize = 1024;
const IN: usize = 4096;
const SAVE_WS: usize = 4;
const LOAD_WS: usize = 3;
const RESHARD_WS: usize = 2;
/// Chunk of the raw baselines.
const CHUNK: usize = 1 << 20;
const MIB: f64 = 1024.0 * 1024.0;

fn model() -> ModelDesc {
    let mut m = ModelDesc::new();
    for i in 0..UNITS {
        m = m
            .param(&format!("layers.{i}.weight"), &[OUT, IN], DType::F32)
            .param(&format!("layers.{i}.bias"), &[OUT], DType::F32);
    }
    m
}

/// The saving wrapping: one unit per layer.
fn save_policy() -> WrapPolicy {
    let units: Vec<String> = (0..UNITS).map(|i| format!("layers.{i}")).collect();
    WrapPolicy::units(&units)
}

/// The loading wrapping: even layers are units, the odd ones go to the root unit.
fn load_policy() -> WrapPolicy {
    let mut units: Vec<String> = (0..UNITS)
        .step_by(2)
        .map(|i| format!("layers.{i}"))
        .collect();
    units.push(String::new());
    WrapPolicy::units(&units)
}

// ---------------------------------------------------------------------------------------------
// Page cache and memory figures (Linux).

/// Evicts `path`'s pages from the page cache (a file, or every file in a directory). The
/// pages must be clean (synced) to go.
fn evict(path: &Path) {
    if path.is_dir() {
        for e in std::fs::read_dir(path).expect("listing a checkpoint directory") {
            evict(&e.expect("a directory entry").path());
        }
        return;
    }
    let f = File::open(path).expect("opening a file to evict");
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; advice only.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "posix_fadvise on {}", path.display());
    }
    drop(f);
}

/// (resident, total) pages of `path` (a file, or every file in a directory) in the page cache.
fn resident_pages(path: &Path) -> (usize, usize) {
    if path.is_dir() {
        return std::fs::read_dir(path)
            .expect("listing a directory")
            .map(|e| resident_pages(&e.expect("a directory entry").path()))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let f = File::open(path).expect("opening a file");
        let len = f.metadata().expect("stat").len() as usize;
        if len == 0 {
            return (0, 0);
        }
        // SAFETY: plain sysconf query.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let pages = len.div_ceil(page);
        // SAFETY: a read-only shared mapping of an open file, unmapped below; mincore only
        // writes `pages` bytes into `vec`.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED, "mmap {}", path.display());
            let mut vec = vec![0u8; pages];
            let rc = libc::mincore(p, len, vec.as_mut_ptr());
            libc::munmap(p, len);
            assert_eq!(rc, 0, "mincore {}", path.display());
            (vec.iter().filter(|&&b| b & 1 != 0).count(), pages)
        }
    }
    #[cfg(not(target_os = "linux"))]
    (0, 0)
}

/// Evicts `path` and prints what stayed resident (once per label, to keep the output short).
fn evict_checked(path: &Path, label: &str, report: bool) {
    evict(path);
    if report {
        let (res, total) = resident_pages(path);
        println!(
            "  [{label}] page cache after POSIX_FADV_DONTNEED: {res} of {total} pages resident ({:.2}%)",
            100.0 * res as f64 / total.max(1) as f64
        );
    }
}

/// `VmHWM` (peak resident set) of this process, in KiB.
fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Raw baselines.

fn raw_write(path: &Path, bytes: u64) -> f64 {
    let mut buf = vec![0u8; CHUNK];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let _ = std::fs::remove_file(path);
    let start = Instant::now();
    let mut f = File::create(path).expect("creating the raw file");
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        f.write_all(&buf[..n]).expect("writing the raw file");
        left -= n as u64;
    }
    f.sync_all().expect("syncing the raw file");
    drop(f);
    start.elapsed().as_secs_f64()
}

fn raw_read(path: &Path) -> f64 {
    let mut buf = vec![0u8; CHUNK];
    let start = Instant::now();
    let mut f = File::open(path).expect("opening the raw file");
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).expect("reading the raw file");
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    std::hint::black_box(&buf);
    let secs = start.elapsed().as_secs_f64();
    assert!(total > 0);
    secs
}

fn raw_copy(src: &Path, dst: &Path) -> f64 {
    let mut buf = vec![0u8; CHUNK];
    let _ = std::fs::remove_file(dst);
    let start = Instant::now();
    let mut r = File::open(src).expect("opening the raw file");
    let mut w = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dst)
        .expect("creating the copy");
    loop {
        let n = r.read(&mut buf).expect("reading the raw file");
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n]).expect("writing the copy");
    }
    w.sync_all().expect("syncing the copy");
    drop(w);
    start.elapsed().as_secs_f64()
}

// ---------------------------------------------------------------------------------------------
// The child: one offline operation in a fresh process, with its peak memory.

/// A field of `/proc/self/io` (`rchar`: bytes this process got from `read` calls, page cache
/// hits included).
fn proc_io(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// User + system CPU seconds of this process so far.
fn cpu_secs() -> f64 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getrusage fills the struct it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
        let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
        t(ru.ru_utime) + t(ru.ru_stime)
    }
    #[cfg(not(target_os = "linux"))]
    0.0
}

/// `--child reshard SRC DST WS` or `--child consolidate SRC OUT`: prints one line
/// `CHILD <secs> <bytes> <hwm_start_kib> <hwm_end_kib> <bytes read> <cpu secs>`.
fn child(args: &[String]) {
    fsdp::tensor::set_buffer_cache_limit(0);
    let src = PathBuf::from(&args[1]);
    evict(&src);
    let hwm_start = vm_hwm_kib();
    let (rchar, cpu) = (proc_io("rchar"), cpu_secs());
    let start = Instant::now();
    let bytes = match args[0].as_str() {
        "reshard" => {
            let ws: usize = args[3].parse().expect("a world size");
            checkpoint::reshard(&src, Path::new(&args[2]), ws, None, |_| {})
                .expect("offline reshard")
        }
        "consolidate" => checkpoint::consolidate_to_safetensors(&src, Path::new(&args[2]), |_| {})
            .expect("streaming consolidation"),
        "consolidate-pt" => checkpoint::consolidate_to_torch(&src, Path::new(&args[2]), |_| {})
            .expect("streaming consolidation to torch.save"),
        other => panic!("unknown child mode {other}"),
    };
    let secs = start.elapsed().as_secs_f64();
    let hwm_end = vm_hwm_kib();
    println!(
        "CHILD {secs} {bytes} {hwm_start} {hwm_end} {} {}",
        proc_io("rchar") - rchar,
        cpu_secs() - cpu
    );
}

struct ChildRun {
    secs: f64,
    bytes: u64,
    hwm_start_kib: u64,
    hwm_end_kib: u64,
    read_bytes: u64,
    cpu_secs: f64,
}

fn run_child(args: &[&str]) -> ChildRun {
    let exe = std::env::current_exe().expect("the bench binary's path");
    let out = Command::new(exe)
        .arg("--child")
        .args(args)
        .output()
        .expect("running a child");
    assert!(
        out.status.success(),
        "child {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("CHILD "))
        .unwrap_or_else(|| panic!("child {args:?} printed no result: {text}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    ChildRun {
        secs: f[0].parse().expect("seconds"),
        bytes: f[1].parse().expect("bytes"),
        hwm_start_kib: f[2].parse().expect("KiB"),
        hwm_end_kib: f[3].parse().expect("KiB"),
        read_bytes: f[4].parse().expect("bytes"),
        cpu_secs: f[5].parse().expect("seconds"),
    }
}

// ---------------------------------------------------------------------------------------------
// Figures.

#[derive(Default, Clone)]
struct Timing(Vec<f64>);

impl Timing {
    fn push(&mut self, s: f64) {
        self.0.push(s);
    }
    fn median(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    fn best(&self) -> f64 {
        self.0.iter().copied().fold(f64::INFINITY, f64::min)
    }
    fn list(&self) -> String {
        self.0
            .iter()
            .map(|s| format!("{s:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1..]);
        return;
    }
    fsdp::tensor::set_buffer_cache_limit(0);
    let reps: usize = std::env::var("CKPT_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/ckpt-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("creating target/ckpt-bench");
    let ckpt4 = root.join("ckpt-ws4");
    let ckpt2 = root.join("ckpt-ws2");
    let full_out = root.join("full.safetensors");

    let model = model();
    let policy = save_policy();
    let layout = ModelLayout::new(&model, &policy, SAVE_WS).expect("layout");
    // exp_avg + exp_avg_sq (f32) of the largest flat parameter.
    let largest_state: u64 = layout
        .flat_params
        .iter()
        .map(|f| f.unpadded_numel as u64 * 2 * 4)
        .max()
        .expect("flat parameters");
    let mem_target = 2 * largest_state + (64 << 20);
    println!(
        "model: {} parameters in {UNITS} units of [{OUT}, {IN}] + [{OUT}]; largest flat parameter's Adam state {largest_state} bytes ({:.1} MiB); {reps} repetitions per op",
        model.numel(),
        largest_state as f64 / MIB
    );
    println!(
        "load average at start: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // Raw baselines use a file of the checkpoint's byte count in the same directory; they are
    // interleaved with the operations (one baseline run right before each run of the
    // operation compared with it), so drift in the shared disk's speed hits both alike.
    let raw = root.join("raw.bin");
    let raw2 = root.join("raw-copy.bin");
    // The checkpoint's tensor bytes: the model's Adam state without the 0-dim `step`s.
    let bytes = (model.numel() * 2 * 4) as u64;

    // --- Save at world size 4, each run after a raw write.
    let t = Instant::now();
    let full = Mutex::new(Some(Arc::new(full_adam_state(&model))));
    let full_bytes = full.lock().unwrap().as_ref().unwrap().tensor_bytes();
    println!(
        "full dict: {full_bytes} tensor bytes ({:.2} GiB), built in {:.1?}",
        full_bytes as f64 / (MIB * 1024.0),
        t.elapsed()
    );
    let (save, rw) = ThreadGroup::run(SAVE_WS, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let rank = pg.rank();
        let fsdp = Fsdp::new(&model, &policy, pg.clone()).expect("Fsdp::new");
        let params = fsdp.optim_params();
        let local = {
            let full = full.lock().unwrap().clone().expect("the full dict");
            fsdp.shard_full_optim_state_dict(&full, &params)
                .expect("shard_full_optim_state_dict")
        };
        pg.barrier().expect("barrier");
        if rank == 0 {
            // Whatever the local shards do not share is freed here.
            full.lock().unwrap().take();
            println!(
                "world size {SAVE_WS}: local state built; peak RSS so far {:.2} GiB",
                vm_hwm_kib() as f64 / MIB
            );
        }
        let (mut save, mut rw) = (Timing::default(), Timing::default());
        for _ in 0..reps {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&ckpt4);
                rw.push(raw_write(&raw, bytes));
            }
            pg.barrier().expect("barrier");
            let start = Instant::now();
            fsdp.save_optim_checkpoint(&local, &params, &ckpt4, &SaveOptions::default())
                .expect("save_optim_checkpoint");
            pg.barrier().expect("barrier");
            save.push(start.elapsed().as_secs_f64());
        }
        (rank == 0).then_some((save, rw))
    })
    .swap_remove(0)
    .expect("rank 0 timed its saves");
    let manifest = checkpoint::read_manifest(&ckpt4).expect("the saved manifest");
    assert_eq!(manifest.tensor_bytes(), bytes);
    println!(
        "checkpoint: {bytes} tensor bytes in {SAVE_WS} files (+ manifest {} bytes)",
        std::fs::metadata(ckpt4.join(checkpoint::MANIFEST))
            .map(|m| m.len())
            .unwrap_or(0)
    );
    println!("save (s): {}; raw write (s): {}", save.list(), rw.list());

    // --- Load at world size 3 under another wrapping, verification on; each after a raw read.
    let lpolicy = load_policy();
    let (mut load, mut rr) = (Timing::default(), Timing::default());
    let mut cpu = Vec::new();
    for i in 0..reps {
        evict_checked(&raw, "raw read", i == 0);
        let c0 = cpu_secs();
        rr.push(raw_read(&raw));
        let c1 = cpu_secs();
        evict_checked(&ckpt4, "load", i == 0);
        let c2 = cpu_secs();
        let out = ThreadGroup::run(LOAD_WS, |pg| {
            let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
            let fsdp = Fsdp::new(&model, &lpolicy, pg.clone()).expect("Fsdp::new");
            let params = fsdp.optim_params();
            pg.barrier().expect("barrier");
            let start = Instant::now();
            let osd: OptimStateDict = fsdp
                .load_optim_checkpoint(&ckpt4, &params, &LoadOptions { verify: true })
                .expect("load_optim_checkpoint");
            pg.barrier().expect("barrier");
            let secs = start.elapsed().as_secs_f64();
            (secs, osd.tensor_bytes())
        });
        // Shards are padded to the world size: at least the checkpoint's bytes come back.
        let loaded: usize = out.iter().map(|o| o.1).sum();
        assert!(loaded >= bytes as usize, "loaded {loaded} < {bytes}");
        load.push(out[0].0);
        cpu.push((cpu_secs() - c2, c1 - c0));
    }
    println!("load (s): {}; raw read (s): {}", load.list(), rr.list());
    // CPU time barely depends on what else the machine runs: it shows how much of a load's
    // wall time is work rather than waiting, next to the baseline's.
    for (l, r) in &cpu {
        println!("  load CPU {l:.2} s (process, all threads); raw read CPU {r:.2} s");
    }

    // --- Offline reshard to world size 2 and streaming consolidation, in child processes
    // (which evict the source checkpoint first); each after a raw copy.
    let offline = |op: &str, out: &Path| {
        let (mut t, mut rc, mut runs) = (Timing::default(), Timing::default(), Vec::new());
        for i in 0..reps {
            evict_checked(&raw, "raw copy", i == 0);
            rc.push(raw_copy(&raw, &raw2));
            let _ = std::fs::remove_file(&raw2);
            let _ = std::fs::remove_dir_all(out);
            let _ = std::fs::remove_file(out);
            if i == 0 {
                evict_checked(&ckpt4, op, true);
            }
            let (src, dst) = (
                ckpt4.to_str().expect("utf-8 path"),
                out.to_str().expect("utf-8 path"),
            );
            let ws = RESHARD_WS.to_string();
            let mut args = vec![op, src, dst];
            if op == "reshard" {
                args.push(&ws);
            }
            let r = run_child(&args);
            assert_eq!(r.bytes, bytes);
            t.push(r.secs);
            runs.push(r);
        }
        println!("{op} (s): {}; raw copy (s): {}", t.list(), rc.list());
        for r in &runs {
            println!(
                "  {op} child: {:.2} s wall, {:.2} s CPU, {} bytes read ({:.2}x the tensor bytes), VmHWM {} -> {} KiB",
                r.secs,
                r.cpu_secs,
                r.read_bytes,
                r.read_bytes as f64 / bytes as f64,
                r.hwm_start_kib,
                r.hwm_end_kib
            );
        }
        let hwm: Vec<(u64, u64)> = runs
            .iter()
            .map(|r| (r.hwm_start_kib, r.hwm_end_kib))
            .collect();
        (t, rc, hwm)
    };
    let (reshard, rc_reshard, reshard_hwm) = offline("reshard", &ckpt2);
    checkpoint::verify(&ckpt2).expect("the resharded checkpoint verifies");
    let _ = std::fs::remove_dir_all(&ckpt2);
    let (consolidate, rc_consolidate, consolidate_hwm) = offline("consolidate", &full_out);
    let _ = std::fs::remove_file(&full_out);
    let full_pt = root.join("full.pt");
    let (consolidate_pt, rc_consolidate_pt, consolidate_pt_hwm) =
        offline("consolidate-pt", &full_pt);
    let _ = std::fs::remove_file(&full_pt);
    let _ = std::fs::remove_file(&raw);
    println!(
        "load average at end: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // --- Summary.
    println!();
    println!(
        "=== checkpoint summary: {bytes} tensor bytes ({:.2} GiB) per op; GB = 10^9 bytes; median of {reps} (best in parentheses) ===",
        bytes as f64 / (MIB * 1024.0)
    );
    println!(
        "{:<14} {:>13} {:>15} {:>15} {:>10} {:>11} {:>15} {:>7}",
        "op", "bytes", "seconds", "GB/s", "raw", "raw GB/s", "ratio", "target"
    );
    let row = |op: &str, t: &Timing, raw_name: &str, r: &Timing| {
        let (m, b) = (t.median(), t.best());
        let (rm, rb) = (r.median(), r.best());
        let ratio = gbs(bytes, m) / gbs(bytes, rm);
        let ratio_best = gbs(bytes, b) / gbs(bytes, rb);
        println!(
            "{op:<14} {bytes:>13} {:>6.2} ({:>5.2}) {:>6.3} ({:>5.3}) {raw_name:>10} {:>5.3} ({:.3}) {:>6.2} ({:>5.2}) {:>7}",
            m,
            b,
            gbs(bytes, m),
            gbs(bytes, b),
            gbs(bytes, rm),
            gbs(bytes, rb),
            ratio,
            ratio_best,
            if ratio >= 0.5 { "met" } else { "MISSED" }
        );
    };
    row("save", &save, "write", &rw);
    row("load", &load, "read", &rr);
    row("reshard", &reshard, "copy", &rc_reshard);
    row("consolidate", &consolidate, "copy", &rc_consolidate);
    row(
        "consolidate-pt",
        &consolidate_pt,
        "copy",
        &rc_consolidate_pt,
    );
    for (name, r) in [
        ("raw write", &rw),
        ("raw read", &rr),
        ("raw copy 1", &rc_reshard),
        ("raw copy 2", &rc_consolidate),
        ("raw copy 3", &rc_consolidate_pt),
    ] {
        println!(
            "{name:<14} {bytes:>13} {:>6.2} ({:>5.2}) {:>6.3} ({:>5.3})",
            r.median(),
            r.best(),
            gbs(bytes, r.median()),
            gbs(bytes, r.best())
        );
    }
    println!("(ratio = op GB/s / raw GB/s, medians (bests); target: ratio >= 0.50)");
    println!();
    println!(
        "peak resident memory (VmHWM of a fresh child process; largest flat parameter's state {:.1} MiB; target <= 2x that + 64 MiB = {:.1} MiB):",
        largest_state as f64 / MIB,
        mem_target as f64 / MIB
    );
    println!(
        "{:<14} {:>16} {:>16} {:>16} {:>7}",
        "op", "at start MiB", "peak MiB", "peak-start MiB", "target"
    );
    for (op, hwm) in [
        ("reshard", &reshard_hwm),
        ("consolidate", &consolidate_hwm),
        ("consolidate-pt", &consolidate_pt_hwm),
    ] {
        let start = hwm.iter().map(|h| h.0).max().unwrap_or(0);
        let end = hwm.iter().map(|h| h.1).max().unwrap_or(0);
        println!(
            "{op:<14} {:>16.1} {:>16.1} {:>16.1} {:>7}",
            start as f64 / 1024.0,
            end as f64 / 1024.0,
            end.saturating_sub(start) as f64 / 1024.0,
            if end * 1024 <= mem_target {
                "met"
            } else {
                "MISSED"
            }
        );
    }
    println!("(max over the repetitions; the target is checked against the whole peak)");

    let _ = std::fs::remove_dir_all(&root);
}
