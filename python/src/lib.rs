//! `fsdp_ckpt._native`: the `fsdp-ckpt` tool's operations ([`fsdp::commands`]) for Python.
//!
//! Each function takes paths, runs the same code as the command line with the GIL released,
//! and returns its report as a JSON string that `fsdp_ckpt/__init__.py` turns into a dict.
//! A crate error becomes `fsdp_ckpt.Error` (message, variant name and typed fields); the
//! optional progress callback is called with the GIL held, `(phase, done, total)`.

use fsdp::collectives::Solo;
use fsdp::commands::{self, Progress, Unit};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often, at most, the progress callback hears of one phase's advance.
const CALLBACK_INTERVAL: Duration = Duration::from_millis(100);

/// The Python-side exception for a crate error: `fsdp_ckpt.Error(message, kind, detail)`.
fn to_py_err(py: Python<'_>, e: fsdp::Error) -> PyErr {
    // `Error` serializes as `{"Variant": {fields}}` (or `"Variant"`): the variant name is the
    // exception's `kind`, its fields (JSON) its `detail`.
    let (kind, detail) = match serde_json::to_value(&e) {
        Ok(serde_json::Value::Object(m)) if m.len() == 1 => {
            let (k, v) = m.into_iter().next().expect("one entry");
            (k, v.to_string())
        }
        Ok(serde_json::Value::String(k)) => (k, "null".to_string()),
        _ => ("Error".to_string(), "null".to_string()),
    };
    let built = py
        .import("fsdp_ckpt._errors")
        .and_then(|m| m.getattr("_from_native"))
        .and_then(|f| f.call1((e.to_string(), kind, detail)));
    match built {
        Ok(exc) => PyErr::from_value(exc),
        Err(import_failed) => import_failed,
    }
}

/// A report as JSON text.
fn to_json<T: serde::Serialize>(value: &T) -> PyResult<String> {
    serde_json::to_string(value)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("report: {e}")))
}

/// Forwards an operation's progress to a Python callable `(phase, done, total)`, at most
/// every [`CALLBACK_INTERVAL`] within a phase (always at its start and end). An exception
/// the callback raises is reported as unraisable (`sys.unraisablehook`) and does not stop
/// the operation, which may be half-way through writing its output.
struct Callback {
    cb: Option<Py<PyAny>>,
    state: Mutex<Phase>,
}

#[derive(Default)]
struct Phase {
    what: String,
    total: Option<u64>,
    done: u64,
    last_call: Option<Instant>,
}

impl Callback {
    fn new(cb: Option<Py<PyAny>>) -> Self {
        Callback {
            cb,
            state: Mutex::new(Phase::default()),
        }
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn call(&self, what: &str, done: u64, total: Option<u64>) {
        let Some(cb) = &self.cb else { return };
        Python::attach(|py| {
            if let Err(e) = cb.call1(py, (what, done, total)) {
                e.write_unraisable(py, Some(cb.bind(py)));
            }
        });
    }
}

impl Progress for Callback {
    fn start(&self, what: &str, total: Option<(u64, Unit)>) {
        let total = total.map(|(n, _)| n);
        *self.phase() = Phase {
            what: what.to_string(),
            total,
            done: 0,
            last_call: Some(Instant::now()),
        };
        self.call(what, 0, total);
    }

    fn update(&self, done: u64) {
        let due = {
            let mut p = self.phase();
            p.done = done;
            let due = p.last_call.is_none_or(|t| t.elapsed() >= CALLBACK_INTERVAL);
            if due {
                p.last_call = Some(Instant::now());
            }
            due.then(|| (p.what.clone(), p.total))
        };
        if let Some((what, total)) = due {
            self.call(&what, done, total);
        }
    }

    fn finish(&self) {
        let (what, done, total) = {
            let p = self.phase();
            (p.what.clone(), p.total.unwrap_or(p.done), p.total)
        };
        self.call(&what, done, total);
    }

    fn note(&self, message: &str) {
        // Notes (e.g. a dead run's temporary removed) go where the tool prints them.
        eprintln!("note: {message}");
    }
}

/// Runs `op` with the GIL released and converts its outcome.
fn run<T: serde::Serialize + Send>(
    py: Python<'_>,
    progress: Option<Py<PyAny>>,
    op: impl FnOnce(&Callback) -> fsdp::Result<T> + Send,
) -> PyResult<String> {
    let cb = Callback::new(progress);
    let out = py.detach(|| op(&cb));
    match out {
        Ok(v) => to_json(&v),
        Err(e) => Err(to_py_err(py, e)),
    }
}

#[pyfunction]
fn inspect(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let found = py.detach(|| commands::inspect(&path, &commands::Silent).and_then(|i| i.to_json()));
    match found {
        Ok(v) => to_json(&v),
        Err(e) => Err(to_py_err(py, e)),
    }
}

#[pyfunction]
#[pyo3(signature = (path, progress=None))]
fn verify(py: Python<'_>, path: PathBuf, progress: Option<Py<PyAny>>) -> PyResult<String> {
    run(py, progress, |p| commands::verify(&path, p))
}

#[pyfunction]
#[pyo3(signature = (input, output, to=None, model=None, world_size=None, max_expansion_bytes=None, progress=None, max_shard_size=None, dtype=None, prefix=None, rename=Vec::new(), rename_map=None, tie=Vec::new(), config=None))]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
fn convert(
    py: Python<'_>,
    input: PathBuf,
    output: PathBuf,
    to: Option<String>,
    model: Option<PathBuf>,
    world_size: Option<usize>,
    max_expansion_bytes: Option<u64>,
    progress: Option<Py<PyAny>>,
    max_shard_size: Option<String>,
    dtype: Option<String>,
    prefix: Option<String>,
    rename: Vec<String>,
    rename_map: Option<PathBuf>,
    tie: Vec<String>,
    config: Option<PathBuf>,
) -> PyResult<String> {
    let mut opts = commands::ConvertOptions {
        to,
        model,
        world_size,
        hf: commands::HfOptions {
            max_shard_size,
            dtype,
            prefix,
            rename,
            rename_map,
            tie,
            config,
        },
        ..Default::default()
    };
    if let Some(n) = max_expansion_bytes {
        opts.max_expansion_bytes = n;
    }
    run(py, progress, |p| {
        commands::convert(&input, &output, &opts, &Solo, p)
    })
}

#[pyfunction]
#[pyo3(signature = (input, output, progress=None, optim=false))]
fn consolidate(
    py: Python<'_>,
    input: PathBuf,
    output: PathBuf,
    progress: Option<Py<PyAny>>,
    optim: bool,
) -> PyResult<String> {
    let opts = commands::ConsolidateOptions { optim };
    run(py, progress, |p| {
        commands::consolidate_with(&input, &output, &opts, &Solo, p)
    })
}

#[pyfunction]
#[pyo3(signature = (input, output, world_size, policy=None, progress=None))]
fn reshard(
    py: Python<'_>,
    input: PathBuf,
    output: PathBuf,
    world_size: usize,
    policy: Option<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<String> {
    run(py, progress, |p| {
        commands::reshard(&input, &output, world_size, policy.as_deref(), &Solo, p)
    })
}

#[pyfunction]
#[pyo3(signature = (model, ranks, output, named_optimizer=false, progress=None))]
fn consolidate_torch(
    py: Python<'_>,
    model: PathBuf,
    ranks: Vec<PathBuf>,
    output: PathBuf,
    named_optimizer: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<String> {
    let opts = commands::TorchOptions {
        named_optimizer,
        ..Default::default()
    };
    run(py, progress, |p| {
        commands::consolidate_torch(&model, &ranks, &output, &opts, p)
    })
}

#[pyfunction]
#[pyo3(signature = (ranks, output, progress=None))]
fn consolidate_sharded(
    py: Python<'_>,
    ranks: Vec<PathBuf>,
    output: PathBuf,
    progress: Option<Py<PyAny>>,
) -> PyResult<String> {
    run(py, progress, |p| {
        commands::consolidate_sharded(&ranks, &output, p)
    })
}

#[pyfunction]
#[pyo3(signature = (model, full, world_size, output, named_optimizer=false, ext="pt".to_string(), progress=None, tuples_as_lists=false))]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
fn shard_torch(
    py: Python<'_>,
    model: PathBuf,
    full: PathBuf,
    world_size: usize,
    output: PathBuf,
    named_optimizer: bool,
    ext: String,
    progress: Option<Py<PyAny>>,
    tuples_as_lists: bool,
) -> PyResult<String> {
    let opts = commands::TorchOptions {
        named_optimizer,
        tuples_as_lists,
    };
    run(py, progress, |p| {
        commands::shard_torch(&model, &full, world_size, &output, &ext, &opts, p)
    })
}

/// The `fsdp-ckpt` command line: `args[0]` is the program name; returns the exit status.
#[pyfunction]
fn main(py: Python<'_>, args: Vec<String>) -> u8 {
    py.detach(|| fsdp_ckpt::main_with_args(args))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(consolidate, m)?)?;
    m.add_function(wrap_pyfunction!(reshard, m)?)?;
    m.add_function(wrap_pyfunction!(consolidate_torch, m)?)?;
    m.add_function(wrap_pyfunction!(consolidate_sharded, m)?)?;
    m.add_function(wrap_pyfunction!(shard_torch, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    Ok(())
}
