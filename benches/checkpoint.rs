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
//! Operations:
//! - `save`: 4 thread ranks call `Fsdp::save_optim_checkpoint`, timed from a barrier before to
//!   a barrier after (the call returns on every rank once rank 0 has committed: data files,
//!   manifest and commit marker synced, directory renamed into place), `CKPT_BENCH_REPS`
//!   times (default 3), each a fresh save (the previous checkpoint removed untimed).
//! - `load`: 3 thread ranks under another wrapping (even layers as units, the odd ones in the
//!   root unit) call `Fsdp::load_optim_checkpoint` with verification on, barrier to barrier.
//! - `reshard`: `checkpoint::reshard` of the world-size-4 checkpoint to world size 2.
//! - `consolidate`: `checkpoint::consolidate_to_safetensors` of the world-size-4 checkpoint.
//! - `consolidate-pt`: `checkpoint::consolidate_to_torch` (a `torch.save` file).
//!
//! - `load-no-read-ahead`, `load-unverified`: `load` with `LoadOptions::read_ahead` or
//!   `LoadOptions::verify` off, to measure each one's share (issue 16, part 3), beside
//!   whole-file reads of the same bytes (4 MiB `pread`s into fresh memory, straight or through
//!   a bounce buffer, and with `O_DIRECT`) measured before each `load` child. The three loads'
//!   repetitions are interleaved, so that drift in the disk's speed hits them alike.
//! - `load-direct`: `load` with `LoadOptions::direct_io` (`O_DIRECT` reads through an aligned
//!   bounce buffer, no read-ahead), interleaved with the other loads (issue 27, part 4).
//! - `reshard-direct`: `reshard` with direct reads (`FSDP_DIRECT_IO=1` in its child),
//!   interleaved with `reshard` when both run.
//!
//! `CKPT_BENCH_OPS=load,reshard` runs a subset of the last eight (saving always runs: the
//! others read its checkpoint). Each of them runs in `CKPT_BENCH_REPS` fresh child processes
//! (this binary re-executed with `--child`), each making `CKPT_BENCH_CALLS` calls (default 3,
//! at least 2) with the files to read evicted and the output removed before each, untimed. The
//! first call of a child is **cold** (what a job that checkpoints once an hour sees: nothing of
//! the process warmed up, every buffer faulted in fresh), the later ones **warm**; the table
//! shows the median of each and the target compares them (cold ≤ 1.5× warm for load and
//! consolidation). Each child also reports its CPU time per call, `VmHWM` before it starts
//! working (the binary's fixed overhead) and at the end, and the bytes it read per call
//! (`rchar` of `/proc/self/io`: 1.00x the tensor bytes means every stored block was read once).
//!
//! Throughput is the checkpoint's tensor bytes (`Manifest::tensor_bytes`) over the wall time.
//! Baselines, on files of exactly that many bytes in the same directory, std::fs and libc
//! only, measured right before each child (drift in the shared disk's speed hits both alike):
//! - `raw read`: 1 MiB `read` calls into one reused buffer (cold: the file evicted first);
//! - `raw write+fsync`: 1 MiB `write_all` calls from one reused buffer, then `sync_all`;
//! - four copies of one file into another, then `fsync`: 1 MiB chunks; 16 MiB chunks with
//!   write-back started as it goes (`sync_file_range`); `copy_file_range` in the kernel; a
//!   reading and a writing thread overlapped.
//!
//! `save` is judged against raw write, `load` against raw read (target ≥ 0.5; issue 16 asks
//! 0.8), and `reshard` and the consolidations, which read every byte and write it durably,
//! against both `max(raw read, raw write+fsync)` (no such operation can beat the slower of
//! the two) and the best of the four copies (what this machine can do for the same bytes):
//! target ≥ 0.7 of either.
//!
//! Reads are cold for the crate and the baselines alike: before every timed read, the files
//! to be read (all synced, so clean) are evicted from the page cache with
//! `posix_fadvise(POSIX_FADV_DONTNEED)`, and the bench prints how many of their pages were
//! still resident afterwards (`mincore`). Nothing touches `/proc/sys/vm/drop_caches`: the
//! machine is shared.
//!
//! Peak memory: the target compares each child's end `VmHWM` (the whole process, overhead
//! included) with twice the largest flat parameter's state (`exp_avg` + `exp_avg_sq` of one
//! unit, 32 MiB) plus 64 MiB. Warm calls reuse buffers from the crate's buffer cache
//! (`fsdp::tensor`), as a job that loads repeatedly would.
//!
//! Files live under `target/ckpt-bench/` (about 6.5 GB at most) and are removed at the end.
//!
//! Run: `cargo bench --bench checkpoint`.

mod common;
use common::{evict, full_adam_state, raw_read, raw_write, shard_and_release};
use fsdp::collectives::Solo;
use fsdp::commands::conversions;

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

/// A timed copy of one file into another: seconds.
type CopyFn = fn(&Path, &Path) -> f64;

/// Ways to copy one file into another (then `fsync` it): the best of them is what this machine
/// can do for an operation that reads every byte and writes it out again.
/// Whole-file reads that isolate the steps of loading at disk speed (issue 16, part 3), each
/// returning whether it ran:
/// - `pread fresh`: 4 MiB `pread`s straight into one fresh allocation of the file's size
///   (what the loader does: read into the destination tensors, first touch included);
/// - `pread via bounce`: the same reads into one reused 4 MiB buffer, each copied into the
///   fresh allocation (an intermediate buffer: the difference is what reading straight into
///   the destination saves);
/// - `O_DIRECT`: 4 MiB reads into one aligned buffer with the page cache skipped (what
///   aligned pieces read with `O_DIRECT` could reach; `false` where the filesystem refuses it).
const LOAD_STEPS: [(&str, ReadFn); 3] = [
    ("pread fresh", |p| read_into_fresh(p, false)),
    ("pread via bounce", |p| read_into_fresh(p, true)),
    ("O_DIRECT", read_direct),
];

/// A whole-file read of [`LOAD_STEPS`]: whether it ran.
type ReadFn = fn(&Path) -> bool;

/// Size of the reads of [`LOAD_STEPS`].
const STEP_READ: usize = 4 << 20;

fn read_into_fresh(path: &Path, bounce: bool) -> bool {
    use std::os::unix::fs::FileExt;
    let f = File::open(path).expect("opening the raw file");
    let len = f.metadata().expect("stat").len() as usize;
    let mut dst: Vec<u8> = vec![0; len];
    let mut buf = vec![0u8; if bounce { STEP_READ } else { 0 }];
    for (i, chunk) in dst.chunks_mut(STEP_READ).enumerate() {
        let at = (i * STEP_READ) as u64;
        if bounce {
            let b = &mut buf[..chunk.len()];
            f.read_exact_at(b, at).expect("reading the raw file");
            chunk.copy_from_slice(b);
        } else {
            f.read_exact_at(chunk, at).expect("reading the raw file");
        }
    }
    std::hint::black_box(&dst);
    true
}

fn read_direct(path: &Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let Ok(f) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    else {
        return false;
    };
    let len = f.metadata().expect("stat").len();
    let mut raw = vec![0u8; STEP_READ + 4096];
    let skip = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[skip..skip + STEP_READ];
    let mut at = 0u64;
    while at < len {
        match f.read_at(buf, at) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            Err(_) => return false,
        }
    }
    std::hint::black_box(&buf);
    true
}

/// The load variants, measured interleaved ([`load_phases`]).
const LOADS: [&str; 4] = [
    "load",
    "load-no-read-ahead",
    "load-unverified",
    "load-direct",
];

/// Whether `op` is one of the load variants (`load`, `load-no-read-ahead`,
/// `load-unverified`, `load-direct`).
fn is_load(op: &str) -> bool {
    op.starts_with("load")
}

const COPIES: [(&str, CopyFn); 4] = [
    ("copy 1MiB", |s, d| copy_chunked(s, d, CHUNK, false)),
    ("copy 16MiB+wb", |s, d| copy_chunked(s, d, 16 * CHUNK, true)),
    ("copy_file_range", copy_in_kernel),
    ("copy 2 threads", copy_two_threads),
];

fn create_copy(dst: &Path) -> File {
    let _ = std::fs::remove_file(dst);
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dst)
        .expect("creating the copy")
}

/// Hands the bytes `[*from, upto)` of `f` to write-back without waiting (the crate's
/// `Writeback` does the same every 32 MiB).
fn start_writeback(f: &File, from: &mut u64, upto: u64) {
    if upto - *from < 32 << 20 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; no memory is passed.
        unsafe {
            libc::sync_file_range(
                f.as_raw_fd(),
                *from as i64,
                (upto - *from) as i64,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
    }
    *from = upto;
}

/// Read `chunk` bytes, write them, repeat; `fsync` at the end (with `writeback`: write-back
/// started every 32 MiB on the way).
fn copy_chunked(src: &Path, dst: &Path, chunk: usize, writeback: bool) -> f64 {
    let mut buf = vec![0u8; chunk];
    let start = Instant::now();
    let mut r = File::open(src).expect("opening the raw file");
    let mut w = create_copy(dst);
    let (mut done, mut from) = (0u64, 0u64);
    loop {
        let n = r.read(&mut buf).expect("reading the raw file");
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n]).expect("writing the copy");
        done += n as u64;
        if writeback {
            start_writeback(&w, &mut from, done);
        }
    }
    w.sync_all().expect("syncing the copy");
    drop(w);
    start.elapsed().as_secs_f64()
}

/// `copy_file_range` (the kernel copies, no user-space buffer), then `fsync`.
fn copy_in_kernel(src: &Path, dst: &Path) -> f64 {
    let start = Instant::now();
    let r = File::open(src).expect("opening the raw file");
    let w = create_copy(dst);
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (mut done, mut from) = (0u64, 0u64);
        loop {
            // SAFETY: valid descriptors; null offsets use and advance the file positions.
            let n = unsafe {
                libc::copy_file_range(
                    r.as_raw_fd(),
                    std::ptr::null_mut(),
                    w.as_raw_fd(),
                    std::ptr::null_mut(),
                    64 << 20,
                    0,
                )
            };
            assert!(
                n >= 0,
                "copy_file_range: {}",
                std::io::Error::last_os_error()
            );
            if n == 0 {
                break;
            }
            done += n as u64;
            start_writeback(&w, &mut from, done);
        }
    }
    w.sync_all().expect("syncing the copy");
    drop(w);
    start.elapsed().as_secs_f64()
}

/// A reading thread and a writing thread overlapped through four 8 MiB buffers, write-back
/// started every 32 MiB, `fsync` at the end.
fn copy_two_threads(src: &Path, dst: &Path) -> f64 {
    const BUF: usize = 8 << 20;
    let start = Instant::now();
    let mut r = File::open(src).expect("opening the raw file");
    let mut w = create_copy(dst);
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(Vec<u8>, usize)>(4);
    let (free_tx, free_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    for _ in 0..4 {
        free_tx.send(vec![0u8; BUF]).expect("a free buffer");
    }
    std::thread::scope(|s| {
        s.spawn(move || {
            while let Ok(mut buf) = free_rx.recv() {
                let mut n = 0;
                while n < BUF {
                    let k = r.read(&mut buf[n..]).expect("reading the raw file");
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                let last = n < BUF;
                if full_tx.send((buf, n)).is_err() || last {
                    break;
                }
            }
        });
        let (mut done, mut from) = (0u64, 0u64);
        while let Ok((buf, n)) = full_rx.recv() {
            w.write_all(&buf[..n]).expect("writing the copy");
            done += n as u64;
            start_writeback(&w, &mut from, done);
            let _ = free_tx.send(buf);
        }
    });
    w.sync_all().expect("syncing the copy");
    drop(w);
    start.elapsed().as_secs_f64()
}

/// The baselines of one repetition of an operation that reads and writes `bytes`, on the raw
/// file `raw` (evicted before every read) and a scratch output `raw2`: raw read, raw write +
/// `fsync`, and every way of [`COPIES`].
#[derive(Default)]
struct Baselines {
    read: Timing,
    write: Timing,
    copies: Vec<Timing>,
    /// Before `load`: the reads of [`LOAD_STEPS`], by name.
    steps: Vec<(&'static str, WallCpu)>,
}

/// Wall and CPU seconds of repeated runs.
#[derive(Default, Clone)]
struct WallCpu {
    wall: Timing,
    cpu: Timing,
}

impl Baselines {
    /// The reads of [`LOAD_STEPS`] of the file `raw`, each after evicting it.
    fn load_steps(&mut self, raw: &Path) {
        if self.steps.is_empty() {
            self.steps = LOAD_STEPS
                .iter()
                .map(|(name, _)| (*name, WallCpu::default()))
                .collect();
        }
        for ((_, read), (_, runs)) in LOAD_STEPS.iter().zip(&mut self.steps) {
            evict(raw);
            let cpu = cpu_secs();
            let start = Instant::now();
            if read(raw) {
                runs.wall.push(start.elapsed().as_secs_f64());
                runs.cpu.push(cpu_secs() - cpu);
            }
        }
    }

    fn run(&mut self, raw: &Path, raw2: &Path, bytes: u64, report: bool) {
        evict_checked(raw, "raw read", report);
        self.read.push(raw_read(raw));
        self.write.push(raw_write(raw2, bytes));
        let _ = std::fs::remove_file(raw2);
        self.copies.resize(COPIES.len(), Timing::default());
        for (i, (_, copy)) in COPIES.iter().enumerate() {
            evict(raw);
            self.copies[i].push(copy(raw, raw2));
            let _ = std::fs::remove_file(raw2);
        }
    }

    /// Per repetition, the slower of raw read and raw write + `fsync`: no operation that reads
    /// every byte and writes it durably can beat it.
    fn floor(&self) -> Timing {
        Timing(
            self.read
                .0
                .iter()
                .zip(&self.write.0)
                .map(|(r, w)| r.max(*w))
                .collect(),
        )
    }

    /// Per repetition, the fastest of the copies.
    fn best_copy(&self) -> Timing {
        Timing(
            (0..self.read.0.len())
                .map(|i| {
                    self.copies
                        .iter()
                        .map(|c| c.0[i])
                        .fold(f64::INFINITY, f64::min)
                })
                .collect(),
        )
    }
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

/// One call of `op` on the checkpoint `src` (output `dst`); returns the tensor bytes it moved.
fn child_call(op: &str, src: &Path, dst: &Path) -> u64 {
    match op {
        "load" => load_once(src, &LoadOptions::default()).1,
        "load-no-read-ahead" => {
            let opts = LoadOptions::default().read_ahead(false);
            load_once(src, &opts).1
        }
        "load-unverified" => {
            let opts = LoadOptions::default().verify(false);
            load_once(src, &opts).1
        }
        "load-direct" => {
            let opts = LoadOptions::default().direct_io(true);
            load_once(src, &opts).1
        }
        // `child` set FSDP_DIRECT_IO=1 for it.
        "reshard" | "reshard-direct" => {
            checkpoint::reshard(src, dst, RESHARD_WS, None, &Solo, |_| {}).expect("offline reshard")
        }
        "consolidate" => conversions::checkpoint_to_safetensors(src, dst, &Solo, |_| {})
            .expect("streaming consolidation"),
        "consolidate-pt" => conversions::checkpoint_to_torch_save(src, dst, &Solo, |_| {})
            .expect("streaming consolidation to torch.save"),
        other => panic!("unknown child mode {other}"),
    }
}

/// `LOAD_WS` thread ranks load the checkpoint `src` under [`load_policy`] with `opts`, timed
/// barrier to barrier; returns (seconds, tensor bytes loaded). The loaded state is dropped
/// before returning (its buffers go to the crate's buffer cache).
fn load_once(src: &Path, opts: &LoadOptions) -> (f64, u64) {
    let (model, lpolicy) = (model(), load_policy());
    let out = ThreadGroup::run(LOAD_WS, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let fsdp = Fsdp::new(&model, &lpolicy, pg.clone()).expect("Fsdp::new");
        let params = fsdp.optim_params();
        pg.barrier().expect("barrier");
        let start = Instant::now();
        let osd: OptimStateDict = fsdp
            .load_optim_checkpoint(src, &params, opts)
            .expect("load_optim_checkpoint");
        pg.barrier().expect("barrier");
        let secs = start.elapsed().as_secs_f64();
        (secs, osd.tensor_bytes() as u64)
    });
    (out[0].0, out.iter().map(|o| o.1).sum())
}

/// `--child OP CALLS SRC [DST]`: `CALLS` calls of `OP` (`load`, `reshard`, `consolidate`,
/// `consolidate-pt`) in this fresh process, the source evicted and the output removed before
/// each (untimed). The first call is cold (nothing of the process warmed up), the later ones
/// warm. Prints `CALL <secs> <cpu secs>` per call, then
/// `CHILD <bytes> <hwm_start_kib> <hwm_end_kib> <bytes read per call>`.
fn child(args: &[String]) {
    let op = args[0].as_str();
    let calls: usize = args[1].parse().expect("a call count");
    let src = PathBuf::from(&args[2]);
    let dst = PathBuf::from(args.get(3).map_or("", String::as_str));
    // Reshard has no options of its own for direct reads: the variable, before any thread.
    std::env::set_var(
        "FSDP_DIRECT_IO",
        if op == "reshard-direct" { "1" } else { "0" },
    );
    let hwm_start = vm_hwm_kib();
    let rchar = proc_io("rchar");
    let mut bytes = 0;
    for _ in 0..calls {
        evict(&src);
        if !is_load(op) {
            let _ = std::fs::remove_dir_all(&dst);
            let _ = std::fs::remove_file(&dst);
        }
        let cpu = cpu_secs();
        let start = Instant::now();
        bytes = child_call(op, &src, &dst);
        let secs = start.elapsed().as_secs_f64();
        println!("CALL {secs} {}", cpu_secs() - cpu);
    }
    println!(
        "CHILD {bytes} {hwm_start} {} {}",
        vm_hwm_kib(),
        (proc_io("rchar") - rchar) / calls as u64
    );
}

struct ChildRun {
    /// (wall, CPU) seconds of each call, the cold one first.
    calls: Vec<(f64, f64)>,
    bytes: u64,
    hwm_start_kib: u64,
    hwm_end_kib: u64,
    read_bytes: u64,
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
    let fields = |prefix: &str| -> Vec<Vec<String>> {
        text.lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(|l| l.split_whitespace().map(String::from).collect())
            .collect()
    };
    let calls = fields("CALL ")
        .iter()
        .map(|f| {
            (
                f[0].parse().expect("seconds"),
                f[1].parse().expect("seconds"),
            )
        })
        .collect();
    let f = fields("CHILD ")
        .pop()
        .unwrap_or_else(|| panic!("child {args:?} printed no result: {text}"));
    ChildRun {
        calls,
        bytes: f[0].parse().expect("bytes"),
        hwm_start_kib: f[1].parse().expect("KiB"),
        hwm_end_kib: f[2].parse().expect("KiB"),
        read_bytes: f[3].parse().expect("bytes"),
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

/// Saves at world size 4, each repetition after a raw write of the same bytes; returns (save,
/// raw write) times.
fn save_phase(ckpt4: &Path, raw: &Path, bytes: u64, reps: usize) -> (Timing, Timing) {
    let (model, policy) = (model(), save_policy());
    let t = Instant::now();
    let full = Mutex::new(Some(Arc::new(full_adam_state(&model))));
    let full_bytes = full.lock().unwrap().as_ref().unwrap().tensor_bytes();
    println!(
        "full dict: {full_bytes} tensor bytes ({:.2} GiB), built in {:.1?}",
        full_bytes as f64 / (MIB * 1024.0),
        t.elapsed()
    );
    ThreadGroup::run(SAVE_WS, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let rank = pg.rank();
        let fsdp = Fsdp::new(&model, &policy, pg.clone()).expect("Fsdp::new");
        let params = fsdp.optim_params();
        let local = shard_and_release(&fsdp, pg.as_ref(), &full, &params);
        if rank == 0 {
            println!(
                "world size {SAVE_WS}: local state built; peak RSS so far {:.2} GiB",
                vm_hwm_kib() as f64 / MIB
            );
        }
        let (mut save, mut rw) = (Timing::default(), Timing::default());
        for _ in 0..reps {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(ckpt4);
                rw.push(raw_write(raw, bytes));
            }
            pg.barrier().expect("barrier");
            let start = Instant::now();
            fsdp.save_optim_checkpoint(&local, &params, ckpt4, &SaveOptions::default())
                .expect("save_optim_checkpoint");
            pg.barrier().expect("barrier");
            save.push(start.elapsed().as_secs_f64());
        }
        (rank == 0).then_some((save, rw))
    })
    .swap_remove(0)
    .expect("rank 0 timed its saves")
}

/// An operation's runs: cold calls (the first of each child), warm ones (the others), the
/// children's figures, and the baselines measured right before each child.
#[derive(Default)]
struct OpRuns {
    cold: Timing,
    warm: Timing,
    runs: Vec<ChildRun>,
    base: Baselines,
}

/// Where an operation's baselines live, and what it is compared with.
struct BenchFiles<'p> {
    raw: &'p Path,
    raw2: &'p Path,
    bytes: u64,
    reps: usize,
    calls: usize,
}

/// `reps` children of `calls` calls each of `op` on `src` (output `dst`); before each child,
/// the baselines: raw read only for the loads, all of [`Baselines`] otherwise.
fn op_phase(op: &str, src: &Path, dst: &Path, f: &BenchFiles<'_>) -> OpRuns {
    let mut o = OpRuns::default();
    for i in 0..f.reps {
        op_rep(op, src, dst, f, i, &mut o);
    }
    print_runs(op, f, &o);
    o
}

/// The load variants `ops` on `src`, their repetitions interleaved (repetition `i` of each,
/// then `i + 1`), so that drift in the shared disk's speed hits them alike.
fn load_phases(
    ops: &[&'static str],
    src: &Path,
    f: &BenchFiles<'_>,
) -> Vec<(&'static str, OpRuns)> {
    interleaved_phases(ops, src, Path::new(""), f)
}

/// The variants `ops` of one operation on `src` (output `dst`), their repetitions interleaved
/// as in [`load_phases`].
fn interleaved_phases(
    ops: &[&'static str],
    src: &Path,
    dst: &Path,
    f: &BenchFiles<'_>,
) -> Vec<(&'static str, OpRuns)> {
    let mut runs: Vec<(&str, OpRuns)> = ops.iter().map(|op| (*op, OpRuns::default())).collect();
    for i in 0..f.reps {
        for (op, o) in &mut runs {
            op_rep(op, src, dst, f, i, o);
        }
    }
    for (op, o) in &runs {
        print_runs(op, f, o);
    }
    runs
}

/// Repetition `i` of `op`: its baselines, then one child of `f.calls` calls.
fn op_rep(op: &str, src: &Path, dst: &Path, f: &BenchFiles<'_>, i: usize, o: &mut OpRuns) {
    if is_load(op) {
        evict_checked(f.raw, "raw read", i == 0);
        o.base.read.push(raw_read(f.raw));
        if op == "load" {
            o.base.load_steps(f.raw);
        }
    } else {
        o.base.run(f.raw, f.raw2, f.bytes, i == 0);
    }
    if i == 0 {
        evict_checked(src, op, true);
    }
    let calls = f.calls.to_string();
    let path = |p: &'_ Path| p.to_str().expect("utf-8 path").to_string();
    let (s, d) = (path(src), path(dst));
    let r = run_child(&[op, &calls, &s, &d]);
    // A load's shards are padded to the world size: at least the checkpoint's bytes.
    assert!(r.bytes == f.bytes || (is_load(op) && r.bytes >= f.bytes));
    o.cold.push(r.calls[0].0);
    for c in &r.calls[1..] {
        o.warm.push(c.0);
    }
    o.runs.push(r);
}

/// Prints `op`'s calls, children and baselines.
fn print_runs(op: &str, f: &BenchFiles<'_>, o: &OpRuns) {
    println!(
        "{op}: cold (s) {}; warm (s) {}",
        o.cold.list(),
        o.warm.list()
    );
    for r in &o.runs {
        let calls: Vec<String> = r
            .calls
            .iter()
            .map(|(w, c)| format!("{w:.2} s ({c:.2} s CPU)"))
            .collect();
        println!(
            "  {op} child: {}; {:.2}x the tensor bytes read per call; VmHWM {} -> {} KiB",
            calls.join(", "),
            r.read_bytes as f64 / f.bytes as f64,
            r.hwm_start_kib,
            r.hwm_end_kib
        );
    }
    let b = &o.base;
    print!("  baselines (s): raw read {}", b.read.list());
    for (name, run) in b.steps.iter() {
        print!("; {name} {}", run.wall.list());
    }
    if !b.write.0.is_empty() {
        print!("; raw write+fsync {}", b.write.list());
        for ((name, _), t) in COPIES.iter().zip(&b.copies) {
            print!("; {name} {}", t.list());
        }
    }
    println!();
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1..]);
        return;
    }
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let reps = env("CKPT_BENCH_REPS", 3).max(1);
    let calls = env("CKPT_BENCH_CALLS", 3).max(2);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/ckpt-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("creating target/ckpt-bench");
    let ckpt4 = root.join("ckpt-ws4");

    let model = model();
    let layout = ModelLayout::new(&model, &save_policy(), SAVE_WS).expect("layout");
    // exp_avg + exp_avg_sq (f32) of the largest flat parameter.
    let largest_state: u64 = layout
        .flat_params()
        .iter()
        .map(|f| f.unpadded_numel as u64 * 2 * 4)
        .max()
        .expect("flat parameters");
    println!(
        "model: {} parameters in {UNITS} units of [{OUT}, {IN}] + [{OUT}]; largest flat parameter's Adam state {largest_state} bytes ({:.1} MiB); {reps} repetitions per op, {calls} calls per child",
        model.numel(),
        largest_state as f64 / MIB
    );
    println!("load average at start: {}", load_average());

    // Raw baselines use a file of the checkpoint's byte count in the same directory.
    let raw = root.join("raw.bin");
    let raw2 = root.join("raw-copy.bin");
    // The checkpoint's tensor bytes: the model's Adam state without the 0-dim `step`s.
    let bytes = (model.numel() * 2 * 4) as u64;

    // The bench process saves without its buffer cache, so its resident memory stays at the
    // local state; the children keep the default cache, as a user's process does.
    fsdp::tensor::set_buffer_cache_limit(0);
    let (save, rw) = save_phase(&ckpt4, &raw, bytes, reps);
    let manifest = checkpoint::read_manifest(&ckpt4).expect("the saved manifest");
    assert_eq!(manifest.tensor_bytes(), bytes);
    println!(
        "checkpoint: {bytes} tensor bytes in {SAVE_WS} files (+ manifest {} bytes)",
        std::fs::metadata(ckpt4.join(checkpoint::MANIFEST))
            .map(|m| m.len())
            .unwrap_or(0)
    );
    println!("save (s): {}; raw write (s): {}", save.list(), rw.list());

    let files = BenchFiles {
        raw: &raw,
        raw2: &raw2,
        bytes,
        reps,
        calls,
    };
    // `CKPT_BENCH_OPS=load,consolidate` runs a subset (save always runs: it writes the
    // checkpoint the others read).
    let wanted = std::env::var("CKPT_BENCH_OPS").unwrap_or_default();
    let wanted = |op: &str| wanted.is_empty() || wanted.split(',').any(|w| w == op);
    let ckpt2 = root.join("ckpt-ws2");
    let full_out = root.join("full.safetensors");
    let full_pt = root.join("full.pt");
    let loads: Vec<&str> = LOADS.into_iter().filter(|op| wanted(op)).collect();
    let mut ops = load_phases(&loads, &ckpt4, &files);
    let reshards: Vec<&str> = ["reshard", "reshard-direct"]
        .into_iter()
        .filter(|op| wanted(op))
        .collect();
    if !reshards.is_empty() {
        ops.extend(interleaved_phases(&reshards, &ckpt4, &ckpt2, &files));
        checkpoint::verify(&ckpt2).expect("the resharded checkpoint verifies");
        let _ = std::fs::remove_dir_all(&ckpt2);
    }
    for (op, dst) in [("consolidate", &full_out), ("consolidate-pt", &full_pt)] {
        if wanted(op) {
            ops.push((op, op_phase(op, &ckpt4, dst, &files)));
        }
        let _ = std::fs::remove_dir_all(dst);
        let _ = std::fs::remove_file(dst);
    }
    println!("load average at end: {}", load_average());

    let ops: Vec<(&str, &OpRuns)> = ops.iter().map(|(op, o)| (*op, o)).collect();
    summary(bytes, reps, (&save, &rw), &ops);
    let offline: Vec<(&str, &OpRuns)> = ops.iter().copied().filter(|o| !is_load(o.0)).collect();
    memory_summary(largest_state, &offline);
    let _ = std::fs::remove_dir_all(&root);
}

/// `a` against `b` (GB/s over GB/s, i.e. `b`'s seconds over `a`'s).
fn ratio(a: f64, b: f64) -> f64 {
    b / a
}

fn summary(bytes: u64, reps: usize, (save, rw): (&Timing, &Timing), ops: &[(&str, &OpRuns)]) {
    println!();
    println!(
        "=== checkpoint summary: {bytes} tensor bytes ({:.2} GiB) per op; GB = 10^9 bytes; medians of {reps} repetitions ===",
        bytes as f64 / (MIB * 1024.0)
    );
    println!("cold = the first call in a fresh process; warm = later calls in the same process (each after evicting the files read)");
    println!(
        "{:<15} {:>8} {:>8} {:>9} {:>10} {:>10} {:>7}",
        "op", "cold s", "warm s", "cold/warm", "cold GB/s", "warm GB/s", "target"
    );
    for (op, o) in ops {
        let (c, w) = (o.cold.median(), o.warm.median());
        let target = match *op {
            "reshard" | "reshard-direct" | "load-no-read-ahead" | "load-unverified"
            | "load-direct" => "",
            _ if c / w <= 1.5 => "met",
            _ => "MISSED",
        };
        println!(
            "{op:<15} {c:>8.2} {w:>8.2} {:>9.2} {:>10.3} {:>10.3} {target:>7}",
            c / w,
            gbs(bytes, c),
            gbs(bytes, w)
        );
    }
    println!("(target: cold <= 1.5x warm for load and consolidation)");
    println!();
    println!(
        "{:<15} {:>8} {:>17} {:>8} {:>9} {:>16} {:>7}",
        "op", "op s", "baseline", "base s", "base GB/s", "ratio cold(warm)", "target"
    );
    let row = |op: &str, t: f64, warm: Option<f64>, name: &str, b: f64, target: f64| {
        let r = ratio(t, b);
        let rw = warm.map_or(String::new(), |w| format!("({:.2})", ratio(w, b)));
        println!(
            "{op:<15} {t:>8.2} {name:>17} {b:>8.2} {:>9.3} {:>9.2} {rw:>6} {:>7}",
            gbs(bytes, b),
            r,
            if r >= target { "met" } else { "MISSED" }
        );
    };
    row(
        "save",
        save.median(),
        None,
        "raw write+fsync",
        rw.median(),
        0.5,
    );
    for (op, o) in ops {
        let (c, w) = (o.cold.median(), Some(o.warm.median()));
        if *op == "load" {
            row(op, c, w, "raw read", o.base.read.median(), 0.5);
            continue;
        }
        if is_load(op) {
            continue;
        }
        row(op, c, w, "max(read, write)", o.base.floor().median(), 0.7);
        row(op, c, w, "best copy", o.base.best_copy().median(), 0.7);
        row(op, c, w, "copy 1MiB (old)", o.base.copies[0].median(), 0.5);
    }
    println!("(ratio = baseline seconds / op seconds: 1.0 = as fast as the baseline; targets: save and load >= 0.5, reshard and consolidation >= 0.7 against max(read, write) and best copy)");
    load_steps_summary(bytes, ops);
    direct_summary(ops);
    println!();
    println!("copies of the same bytes (median s, GB/s), before the operations:");
    for (op, o) in ops.iter().filter(|o| !is_load(o.0)) {
        let b = &o.base;
        let mut line = format!(
            "  before {op:<15} read {:.2} ({:.2}), write+fsync {:.2} ({:.2})",
            b.read.median(),
            gbs(bytes, b.read.median()),
            b.write.median(),
            gbs(bytes, b.write.median())
        );
        for ((name, _), t) in COPIES.iter().zip(&b.copies) {
            line += &format!(", {name} {:.2} ({:.2})", t.median(), gbs(bytes, t.median()));
        }
        println!("{line}");
    }
}

/// Direct reads against buffered ones, per operation measured both ways: the median cold and
/// warm seconds and how much faster the direct median is (issue 27 makes `O_DIRECT` the
/// default only at 10 % or more).
fn direct_summary(ops: &[(&str, &OpRuns)]) {
    let find = |name: &str| ops.iter().find(|o| o.0 == name).map(|o| o.1);
    let pairs: Vec<(&str, &OpRuns, &OpRuns)> = ["load", "reshard"]
        .into_iter()
        .filter_map(|op| Some((op, find(op)?, find(&format!("{op}-direct"))?)))
        .collect();
    if pairs.is_empty() {
        return;
    }
    println!();
    println!("direct (O_DIRECT) against buffered reads (medians; faster = 1 - direct / buffered):");
    for (op, b, d) in pairs {
        for (kind, tb, td) in [("cold", &b.cold, &d.cold), ("warm", &b.warm, &d.warm)] {
            let (mb, md) = (tb.median(), td.median());
            println!(
                "  {op:<8} {kind}: buffered {mb:.2} s, direct {md:.2} s, direct {:+.1} % faster",
                (1.0 - md / mb) * 100.0
            );
        }
    }
}

/// Loading step by step: each load variant against the raw read measured before its
/// children, with CPU seconds per call, then the whole-file reads of [`LOAD_STEPS`].
fn load_steps_summary(bytes: u64, ops: &[(&str, &OpRuns)]) {
    let loads: Vec<&(&str, &OpRuns)> = ops.iter().filter(|o| is_load(o.0)).collect();
    if loads.is_empty() {
        return;
    }
    println!();
    println!("loading step by step (medians; CPU = seconds of CPU per call, all threads):");
    println!(
        "{:<19} {:>7} {:>7} {:>8} {:>8} {:>10} {:>17}",
        "variant", "cold s", "warm s", "cold CPU", "warm CPU", "raw read s", "ratio cold(warm)"
    );
    for (op, o) in &loads {
        let cpu = |warm: bool| {
            let mut t = Timing::default();
            for r in &o.runs {
                for (i, c) in r.calls.iter().enumerate() {
                    if (i > 0) == warm {
                        t.push(c.1);
                    }
                }
            }
            t.median()
        };
        let (c, w, b) = (o.cold.median(), o.warm.median(), o.base.read.median());
        println!(
            "{op:<19} {c:>7.2} {w:>7.2} {:>8.2} {:>8.2} {b:>10.2} {:>10.2} ({:.2})",
            cpu(false),
            cpu(true),
            ratio(c, b),
            ratio(w, b)
        );
    }
    println!("(load-no-read-ahead - load = the read-ahead's gain, which also overlaps the checksums with the disk; load - load-unverified = what the checksums cost; load-direct = O_DIRECT reads through a bounce buffer, no read-ahead)");
    let Some((_, o)) = loads.iter().find(|o| o.0 == "load") else {
        return;
    };
    println!("whole-file reads of the same bytes, each after evicting the file (median wall s, GB/s, CPU s):");
    for (name, run) in &o.base.steps {
        if run.wall.0.is_empty() {
            println!("  {name:<17} not supported here");
            continue;
        }
        println!(
            "  {name:<17} {:.2} s ({:.2} GB/s), {:.2} s CPU",
            run.wall.median(),
            gbs(bytes, run.wall.median()),
            run.cpu.median()
        );
    }
    println!("(pread via bounce - pread fresh = what reading straight into the destination saves; O_DIRECT = reading without the page cache)");
}

fn memory_summary(largest_state: u64, ops: &[(&str, &OpRuns)]) {
    let mem_target = 2 * largest_state + (64 << 20);
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
    for (op, o) in ops {
        let start = o.runs.iter().map(|r| r.hwm_start_kib).max().unwrap_or(0);
        let end = o.runs.iter().map(|r| r.hwm_end_kib).max().unwrap_or(0);
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
}
