//! The offline commands: one function per `fsdp-ckpt` subcommand, the one home of each.
//!
//! Each command recognizes its input once ([`recognize`], the one recognition table), checks
//! its options and output, plans, and runs the plan over a process group (`&Solo` for one
//! process; under `mpirun -np N`, [`consolidate_splits`] and [`convert_splits`] say which
//! commands split their work), reporting its phases through a [`Progress`] and returning what
//! it did or found as a library type ([`Written`], [`Inspection`], [`Verified`]).
//!
//! The front ends only parse arguments and print or return: the `fsdp-ckpt` command line
//! prints these values and draws the progress as bars; the Python package (`python/`)
//! returns them as dicts and forwards the progress to a callback. Both run the same code, so
//! a file the CLI writes and one `fsdp_ckpt.consolidate(...)` writes are the same file.
//!
//! # Where things are
//!
//! | file | what it holds |
//! | --- | --- |
//! | `recognize.rs` | the one recognition table: which input form a path is |
//! | `inspect.rs`, `verify.rs` | `inspect`, `verify` |
//! | `consolidate.rs` | `consolidate`, `consolidate-sharded`, `consolidate-torch` |
//! | `convert.rs` | `convert` in every direction (`--to dcp`, `hf`, `fsdp`) |
//! | `reshard.rs`, `shard_torch.rs` | `reshard`, `shard-torch` |
//! | [`conversions`] | the jobs those commands run: one per direction between formats, each run over a process group |
//! | [`rank_dicts`] | per-rank optimizer state dicts transformed in one process (`consolidate-torch`, `consolidate-sharded`, `shard-torch`) |
//!
//! Below this module, the formats ([`crate::io`]) plan each output and move the bytes of one
//! share, the crate's checkpoint ([`crate::checkpoint`]) has its own readers and writers, and
//! every file is opened, created and committed through [`crate::storage`].

mod consolidate;
pub mod conversions;
mod convert;
mod inspect;
pub mod rank_dicts;
mod recognize;
mod reshard;
mod shard_torch;
mod verify;

pub use consolidate::{
    consolidate, consolidate_sharded, consolidate_splits, consolidate_torch, consolidate_with,
    ConsolidateOptions,
};
pub use convert::{convert, convert_splits, ConvertOptions, HfOptions};
pub use inspect::{inspect, Inspection};
pub use recognize::{deepspeed_file, recognize, Input};
pub use reshard::reshard;
pub use shard_torch::shard_torch;
pub use verify::{verify, Verified};

use crate::collectives::ProcessGroup;
use crate::error::{Error, Result};
use crate::io;
use crate::io::torch_save::{optim_from_pyobj, optim_to_pyobj};
use crate::optim_state::{OptimParams, OptimStateDict};
use crate::storage::{self, DirKind};
use rank_dicts::DescFile;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What a phase's `total` counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// Bytes of tensor data.
    Bytes,
    /// Files (one per rank).
    Files,
}

/// Where an operation reports its phases. Calls come from the thread running the operation;
/// `Sync` so that a front end can run the operation on another thread (the Python package
/// releases the GIL).
pub trait Progress: Sync {
    /// A phase begins: what it does, and its size when known.
    fn start(&self, what: &str, total: Option<(u64, Unit)>);
    /// `done` of the current phase's total is done.
    fn update(&self, done: u64);
    /// The current phase ended.
    fn finish(&self);
    /// Something the user should know that is not an error (e.g. a dead run's temporary was
    /// removed).
    fn note(&self, message: &str);
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl Progress for Silent {
    fn start(&self, _: &str, _: Option<(u64, Unit)>) {}
    fn update(&self, _: u64) {}
    fn finish(&self) {}
    fn note(&self, _: &str) {}
}

/// Runs `f` as one phase of unknown size.
fn step<T>(p: &dyn Progress, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    p.start(what, None);
    let out = f();
    p.finish();
    out
}

/// What an operation that writes an output did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Written {
    /// The command: `convert`, `consolidate`, `reshard`, …
    pub operation: &'static str,
    /// The output file or directory.
    pub output: PathBuf,
    /// Bytes of tensor data written.
    pub tensor_bytes: u64,
    /// Keys (state dicts) or tensors (files) written, when the operation counts them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<usize>,
    /// The world size of the output (sharded outputs) or input (consolidations).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub world_size: Option<usize>,
    /// The line the command line prints on success.
    pub message: String,
}

/// Options of [`consolidate_torch`] and [`shard_torch`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TorchOptions {
    /// The optimizer is a named optimizer (state keyed by parameter names, not ids).
    pub named_optimizer: bool,
    /// `shard-torch` of an FSDP2 model: every tuple in the param groups (`betas`) becomes a
    /// list, as `set_optimizer_state_dict(full_state_dict=True)` leaves them
    /// ([`rank_dicts::ShardOptions`]).
    pub tuples_as_lists: bool,
}

fn load_spec(path: &Path, named: bool) -> Result<DescFile> {
    let mut spec = DescFile::from_json_file(path)?;
    if named {
        if let Some(p) = &mut spec.optim_params {
            p.named = true;
        }
        if let Some(per) = &mut spec.optim_params_per_rank {
            per.iter_mut().for_each(|p| p.named = true);
        }
        if spec.optim_params.is_none() && spec.optim_params_per_rank.is_none() {
            let layout = spec.layout(1)?;
            let mut p = OptimParams::of_model(&layout);
            p.named = true;
            spec.optim_params = Some(p);
        }
    }
    Ok(spec)
}

fn load_optim(path: &Path) -> Result<OptimStateDict> {
    optim_from_pyobj(io::load(path)?)
}

fn save_optim(osd: &OptimStateDict, path: &Path) -> Result<()> {
    io::save(&optim_to_pyobj(osd)?, path)
}

/// Removes what killed earlier runs left beside `out` (putting back a previous `kind` output
/// an interrupted install moved aside), saying so through `p`.
fn clean_stale(p: &dyn Progress, out: &Path, kind: Option<DirKind>) -> Result<()> {
    for c in storage::clean_stale_temporaries(out, kind)? {
        p.note(&c.to_string());
    }
    Ok(())
}

/// `input` recognized ([`recognize`]) as one of the forms `command` takes (`wants` says which,
/// for the message), or an error naming what it is instead.
fn expect_input(
    command: &str,
    input: &Path,
    wants: &str,
    accepts: impl Fn(Input) -> bool,
) -> Result<Input> {
    let found = recognize(input)?;
    if accepts(found) {
        return Ok(found);
    }
    Err(wrong_input(command, input, wants, found))
}

/// The refusal of `input`, recognized as `found`, by `command`, which takes `wants`.
fn wrong_input(command: &str, input: &Path, wants: &str, found: Input) -> Error {
    Error::Unsupported(format!(
        "{command} takes {wants}; `{}` is {}",
        input.display(),
        found.describe()
    ))
}

/// What a progress phase is called on the processes of `pg`: each shows its own share.
fn phase(what: &str, pg: &dyn ProcessGroup) -> String {
    if pg.world_size() > 1 {
        format!("{what} (this process's share)")
    } else {
        what.to_string()
    }
}

/// How a result message names a job of several processes (nothing for one).
fn as_a_job(pg: &dyn ProcessGroup) -> String {
    if pg.world_size() > 1 {
        format!(" as a job of {} processes", pg.world_size())
    } else {
        String::new()
    }
}

/// How a result message names the processes of a job (nothing for one).
fn on_processes(pg: &dyn ProcessGroup) -> String {
    if pg.world_size() > 1 {
        format!(" on {} processes", pg.world_size())
    } else {
        String::new()
    }
}
