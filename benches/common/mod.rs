//! Synthetic optimizer state shared by the benches.
#![allow(dead_code)] // each bench uses a different subset

use fsdp::collectives::ProcessGroup;
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimParams, OptimStateDict, ParamGroup, ParamKey,
    ParamState, Value,
};
use indexmap::IndexMap;
use std::sync::{Arc, Mutex};

/// A parameter-shaped f32 tensor with cheap deterministic values.
pub fn filled(shape: &[usize], seed: f32) -> HostTensor {
    let mut t = HostTensor::zeros(DType::F32, shape);
    for (k, x) in t.as_mut_slice::<f32>().expect("f32").iter_mut().enumerate() {
        *x = seed + (k % 4096) as f32 * 1e-4;
    }
    t
}

/// The state of [`full_adam_state`] for the parameters `range` of `model` only (the same
/// values), without param groups: a part of the full dict, for building large states piece by
/// piece.
pub fn adam_state_of(model: &ModelDesc, range: std::ops::Range<usize>) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for i in range {
        let p = &model.params[i];
        let mut st = ParamState::new();
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(1.0f32)));
        st.insert("exp_avg".into(), Value::Tensor(filled(&p.shape, i as f32)));
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(filled(&p.shape, 0.5 + i as f32)),
        );
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    sd
}

/// Bytes free for an unprivileged user on the file system holding `path` (0 when unknown).
pub fn free_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs fills the struct it is given from a NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    st.f_bavail as u64 * st.f_frsize as u64
}

/// The full (unflattened, name-keyed) Adam state dict of `model`, as after one step.
pub fn full_adam_state(model: &ModelDesc) -> OptimStateDict {
    let mut sd = adam_state_of(model, 0..model.params.len());
    sd.param_groups = adam_param_groups(model);
    sd
}

/// The param groups of [`full_adam_state`]: one group of every parameter with Adam's options.
pub fn adam_param_groups(model: &ModelDesc) -> Option<Vec<ParamGroup>> {
    let options: IndexMap<String, Value> = [
        ("lr", Value::Float(1e-3)),
        (
            "betas",
            Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
        ),
        ("eps", Value::Float(1e-8)),
        ("weight_decay", Value::Float(0.0)),
        ("amsgrad", Value::Bool(false)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let params = model
        .params
        .iter()
        .map(|p| ParamKey::Name(p.name.clone()))
        .collect();
    Some(vec![ParamGroup { options, params }])
}

/// A copy that owns its storage, as an optimizer's own state does (shard results are views
/// into the full dict).
pub fn deep_copy(osd: &OptimStateDict) -> OptimStateDict {
    osd.try_map(|t: &HostTensor| HostTensor::from_bytes(t.dtype(), t.shape(), t.as_bytes()))
        .expect("copying a host tensor")
}

/// A field of `/proc/self/status` (`VmRSS:`, `VmHWM:`) in bytes; 0 when unreadable.
pub fn status_bytes(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k * 1024)
        .unwrap_or(0)
}

/// Resets this process's VmHWM to its current RSS (Linux `clear_refs` 5); whether it worked.
pub fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The 1-, 5- and 15-minute load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Chunk of the raw file baselines.
const RAW_CHUNK: usize = 1 << 20;

/// Evicts `path`'s pages from the page cache (a file, or every file in a directory), so the
/// next read comes from the disk. The pages must be clean (synced) to go.
pub fn evict(path: &std::path::Path) {
    if path.is_dir() {
        for e in std::fs::read_dir(path).expect("listing a directory to evict") {
            evict(&e.expect("a directory entry").path());
        }
        return;
    }
    let f = std::fs::File::open(path).expect("opening a file to evict");
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; advice only.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "posix_fadvise on {}", path.display());
    }
    drop(f);
}

/// Seconds to write `bytes` to a new file `path` in 1 MiB writes from one reused buffer, then
/// fsync it: the machine's raw durable write of that many bytes.
pub fn raw_write(path: &std::path::Path, bytes: u64) -> f64 {
    use std::io::Write;
    let mut buf = vec![0u8; RAW_CHUNK];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let _ = std::fs::remove_file(path);
    let start = std::time::Instant::now();
    let mut f = std::fs::File::create(path).expect("creating the raw file");
    let mut left = bytes;
    while left > 0 {
        let n = left.min(RAW_CHUNK as u64) as usize;
        f.write_all(&buf[..n]).expect("writing the raw file");
        left -= n as u64;
    }
    f.sync_all().expect("syncing the raw file");
    drop(f);
    start.elapsed().as_secs_f64()
}

/// Seconds to read all of `path` in 1 MiB reads into one reused buffer (evict it first for a
/// read from the disk).
pub fn raw_read(path: &std::path::Path) -> f64 {
    use std::io::Read;
    let mut buf = vec![0u8; RAW_CHUNK];
    let start = std::time::Instant::now();
    let mut f = std::fs::File::open(path).expect("opening the raw file");
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
    assert!(total > 0, "{} is empty", path.display());
    secs
}

/// Bytes of the file `p`, or of the files directly in the directory `p`; 0 when unreadable.
pub fn disk_bytes(p: &std::path::Path) -> u64 {
    if p.is_dir() {
        return std::fs::read_dir(p)
            .map(|rd| rd.flatten().map(|e| disk_bytes(&e.path())).sum())
            .unwrap_or(0);
    }
    std::fs::metadata(p).map_or(0, |m| m.len())
}

/// The Python with PyTorch 2.13 the side-by-side benches run: `FSDP_PYTHON`, else `.venv`'s.
/// Exits with a hint when it is missing (`bench` names the caller).
pub fn venv_python(bench: &str) -> std::path::PathBuf {
    let p = std::env::var_os("FSDP_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python")
        });
    if !p.exists() {
        eprintln!(
            "{bench}: no Python at {} — run scripts/setup-venv.sh (creates .venv with torch \
             2.13) or set FSDP_PYTHON to a Python with torch==2.13.0",
            p.display()
        );
        std::process::exit(2);
    }
    p
}

/// This rank's `shard_full_optim_state_dict` of the full dict in `full`, which rank 0 then
/// takes out (once every rank has its shard), so that only what the shards share with it stays
/// in memory. Collective over `pg`.
pub fn shard_and_release(
    fsdp: &Fsdp,
    pg: &dyn ProcessGroup,
    full: &Mutex<Option<Arc<OptimStateDict>>>,
    params: &OptimParams,
) -> OptimStateDict {
    let local = {
        let full = full.lock().unwrap().clone().expect("the full dict");
        fsdp.shard_full_optim_state_dict(&full, params)
            .expect("shard_full_optim_state_dict")
    };
    pg.barrier().expect("barrier");
    if pg.rank() == 0 {
        full.lock().unwrap().take();
    }
    local
}

/// Runs this bench's executable again with `env_var` set to `spec` (one measurement in a
/// fresh process) and returns the fields of the line it prints after `CHILD `. A child that
/// prints none fails the bench, naming `what` and the child's status and stderr.
pub fn child_fields(env_var: &str, spec: &str, what: &str) -> Vec<String> {
    let out = std::process::Command::new(std::env::current_exe().expect("this bench"))
        .env(env_var, spec)
        .output()
        .expect("running the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CHILD "))
        .unwrap_or_else(|| {
            panic!(
                "child {what} failed: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    line.split_whitespace().map(str::to_string).collect()
}

/// Runs the Python side of a side-by-side bench (`script`, relative to the crate root) with
/// `py` and returns its standard output; a failing run fails the bench.
pub fn python_run(script: &str, py: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(py)
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
        .args(args)
        .output()
        .expect("running python");
    assert!(
        out.status.success(),
        "python {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A timed run of [`python_run`]: (seconds, peak RSS) from its last line, a JSON object with
/// `seconds` and `peak_rss`.
pub fn python_timed(script: &str, py: &std::path::Path, args: &[&str]) -> (f64, u64) {
    let out = python_run(script, py, args);
    let v: serde_json::Value =
        serde_json::from_str(out.lines().last().unwrap_or("")).expect("json line");
    (
        v["seconds"].as_f64().unwrap(),
        v["peak_rss"].as_u64().unwrap(),
    )
}

/// A path as a string argument.
pub fn s(p: &std::path::Path) -> String {
    p.display().to_string()
}

/// Bytes as decimal gigabytes, two decimals.
pub fn gb(b: u64) -> String {
    format!("{:.2}", b as f64 / 1e9)
}

/// Bytes as decimal megabytes, no decimals.
/// The timed runs of one operation in a side-by-side bench: seconds and peak RSS of each, and
/// the CPU seconds of those that report them.
#[derive(Default)]
pub struct Runs {
    pub secs: Vec<f64>,
    pub peaks: Vec<u64>,
    pub cpu: Vec<f64>,
}

impl Runs {
    pub fn push(&mut self, (secs, peak): (f64, u64)) {
        self.secs.push(secs);
        self.peaks.push(peak);
    }
    pub fn median_secs(&self) -> f64 {
        let mut v = self.secs.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    pub fn peak(&self) -> u64 {
        self.peaks.iter().copied().max().unwrap_or(0)
    }
    pub fn peak_mb(&self) -> String {
        mb(self.peak())
    }
}

pub fn mb(b: u64) -> String {
    format!("{:.0}", b as f64 / 1e6)
}
