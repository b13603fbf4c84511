//! `fsdp-ckpt`: inspect, convert, consolidate and shard PyTorch FSDP checkpoints offline.
//!
//! A thin shell over the library: [`fsdp::commands`] holds one function per command (paths
//! and options in, a report out, progress through a trait), which the command line here
//! parses for, draws progress bars for and prints; the Python package calls the same
//! functions. Errors
//! are printed as `error: ...` with exit code 1 (2 for usage errors, as clap reports them);
//! a closed standard output (`fsdp-ckpt inspect DIR | head`) ends the command quietly with
//! [`CLOSED_PIPE_STATUS`]. Nothing is printed with `print!`-style macros, which panic when
//! the output cannot be written (clippy's `print_stdout` and `print_stderr` lints keep it so).
#![deny(clippy::print_stdout, clippy::print_stderr)]

use clap::{Parser, Subcommand};
use fsdp::collectives::Solo;
use fsdp::commands::{self, Progress, Unit};
use fsdp::io;
use fsdp::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// Inspect, convert, consolidate and shard PyTorch (FSDP) checkpoint files.
///
/// Inputs are recognised before any command reads them. Files: `.pt`/`.pth` (also `.bin`,
/// `.ckpt`) are torch.save files, zip or legacy format, holding whatever
/// torch.load(weights_only=True) reads (Parameters, tensor attributes, complex, sparse,
/// quantized and meta tensors included); `.safetensors` are single safetensors files.
/// Directories: PyTorch DCP in every form dcp.save writes (`.metadata`, zstd-compressed
/// items, per-rank `__{rank}.metadata` files, Hugging Face storage with DCP_SHARDING_INFO),
/// this crate's sharded checkpoint (`manifest.json`), and DeepSpeed ZeRO checkpoints
/// (`latest` and `*_optim_states.pt`) and universal checkpoints (`zero/`).
#[derive(Parser, Debug)]
#[command(name = "fsdp-ckpt", version)]
struct Cli {
    /// No progress bars.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

/// The Hugging Face options of `convert`.
#[derive(clap::Args, Debug, Clone)]
struct HfArgs {
    /// With `--to hf`: the most bytes of tensors per file, as `save_pretrained`'s
    /// `max_shard_size`: `KB`, `MB`, `GB`, `TB` are decimal (huggingface_hub's meaning),
    /// `KiB`, `MiB`, `GiB` binary; a larger tensor gets a file of its own. Default 50GB (for
    /// a DCP directory in Hugging Face storage: the files its shard names imply).
    #[arg(long, value_name = "SIZE")]
    max_shard_size: Option<String>,
    /// With `--to hf` or `--to dcp` of a Hugging Face model: cast floating-point tensors
    /// (round to nearest even, as `Tensor.to`); integer and bool tensors keep their dtype.
    #[arg(long, value_name = "DTYPE", value_parser = ["bf16", "f16", "f32"])]
    dtype: Option<String>,
    /// With `--to hf`: the subtree holding the model, stripped from the names (default
    /// `model.`; `''` takes every tensor outside `optim.`). With `--to dcp` of a Hugging
    /// Face model: added to every name (default `model.`).
    #[arg(long, value_name = "P")]
    prefix: Option<String>,
    /// Rename keys: a regular expression and its replacement (`$1` or `\1` for groups),
    /// applied to every match; repeatable, in order, after the prefix is stripped (export)
    /// or before it is added (import).
    #[arg(long, value_name = "FROM=TO")]
    rename: Vec<String>,
    /// Rename rules from a JSON file: `{"FROM": "TO", ...}` in order, or `[["FROM", "TO"], ...]`;
    /// applied after the `--rename` rules.
    #[arg(long, value_name = "FILE.json")]
    rename_map: Option<PathBuf>,
    /// With `--to hf`: NAME is tied to SOURCE and left out, once checked to be equal to it.
    /// With `--to dcp` of a Hugging Face model: NAME is written as a copy of SOURCE (a tied
    /// weight `save_pretrained` left out, which `dcp.load` of the model needs). Repeatable.
    #[arg(long, value_name = "NAME=SOURCE")]
    tie: Vec<String>,
    /// With `--to hf`: a `config.json` copied into the directory; when it ties the word
    /// embeddings it also ties its architecture's output embedding to its input embedding, as
    /// transformers does (`lm_head.weight=transformer.wte.weight` for GPT-2,
    /// `=model.embed_tokens.weight` for Llama; an architecture outside the table needs `--tie`)
    /// (on import: restores the output embedding from it when the directory lacks it).
    #[arg(long, value_name = "config.json")]
    config: Option<PathBuf>,
}

impl HfArgs {
    fn options(&self) -> commands::HfOptions {
        commands::HfOptions {
            max_shard_size: self.max_shard_size.clone(),
            dtype: self.dtype.clone(),
            prefix: self.prefix.clone(),
            rename: self.rename.clone(),
            rename_map: self.rename_map.clone(),
            tie: self.tie.clone(),
            config: self.config.clone(),
        }
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show what an optimizer or model state dict file holds (keys and key types, state
    /// names, dtypes, shapes, steps, param groups, total tensor bytes), what a sharded
    /// checkpoint directory of this crate holds, or what a PyTorch DCP directory holds, in
    /// any form dcp.save writes: `.metadata`; per-rank `__{rank}.metadata` files
    /// (use_collectives=False), merged; Hugging Face storage (HuggingFaceStorageWriter:
    /// safetensors files with DCP_SHARDING_INFO, rank-0, distributed or consolidated); or
    /// what a Hugging Face model directory (save_pretrained) holds.
    Inspect {
        /// The file (.pt, .pth or .safetensors) or directory.
        file: PathBuf,
        /// Machine-readable JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Convert a file between torch.save and safetensors (formats chosen by extension; a
    /// legacy torch.save input is written in the zip format; what safetensors cannot hold,
    /// such as a sparse tensor, is refused by name): the dict comes back equal after a round
    /// trip. With `--to dcp`, `--to fsdp` or `--to hf`, write a directory instead (below).
    Convert {
        /// Input file.
        input: PathBuf,
        /// Output file.
        output: PathBuf,
        /// Bytes that copies of non-contiguous (e.g. expanded) tensors of a torch.save input
        /// may allocate beyond the file's storage bytes.
        #[arg(long, value_name = "BYTES", default_value_t = io::torch_save::LoadOptions::DEFAULT_MAX_EXPANSION_BYTES)]
        max_expansion_bytes: u64,
        /// Write a directory instead: `dcp`, a PyTorch DCP directory with one `.metadata`
        /// (from a torch.save or safetensors file, from this crate's sharded checkpoint
        /// directory, from a Hugging Face model directory, from a DeepSpeed ZeRO or universal
        /// checkpoint (its weights and Adam state as get_state_dict names them, for FSDP2 to
        /// load at any world size), or from a DCP directory with per-rank metadata or in
        /// Hugging Face storage); `fsdp`, this crate's sharded
        /// checkpoint from a DCP directory of any form (needs `--model` and `--world-size`);
        /// `hf`, a Hugging Face model directory as `save_pretrained` writes it
        /// (`model.safetensors`, or `model-*-of-*.safetensors` and the index) of the model
        /// weights of a DCP directory, this crate's checkpoint or a file.
        #[arg(long, value_name = "FORMAT", value_parser = ["dcp", "fsdp", "hf"])]
        to: Option<String>,
        /// With `--to fsdp`: the model description and wrapping policy (JSON; see README).
        #[arg(long = "model", value_name = "DESC.json")]
        model: Option<PathBuf>,
        /// With `--to fsdp`: the number of ranks of the checkpoint to write.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        world_size: Option<u32>,
        /// With `--to dcp`: compress every item, as PyTorch's
        /// `FileSystemWriter(_extensions=[ZStandard()])` does (`zstd`, the only choice);
        /// `dcp.load` reads it back. Written by one process.
        #[arg(long, value_name = "ALGO", value_parser = ["zstd"])]
        compress: Option<String>,
        #[command(flatten)]
        hf: Box<HfArgs>,
    },
    /// Consolidate the local `optim.state_dict()` every rank of a PyTorch FSDP run saved into
    /// the dict `FSDP.full_optim_state_dict` returns.
    ConsolidateTorch {
        /// The model description and wrapping policy (JSON; see README).
        #[arg(long = "model", value_name = "DESC.json")]
        model: PathBuf,
        /// One file per rank, in rank order.
        #[arg(required = true, value_name = "RANK.pt")]
        ranks: Vec<PathBuf>,
        /// Output file.
        #[arg(short, long, value_name = "FULL.pt")]
        output: PathBuf,
        /// The optimizer is a named optimizer (state keyed by parameter names, not ids).
        #[arg(long)]
        named_optimizer: bool,
    },
    /// Consolidate per-rank SHARDED optimizer state dicts saved with torch.save (FSDP1
    /// `ShardedTensor` states under SHARDED_STATE_DICT, or FSDP2 `DTensor` states of
    /// `optim.state_dict()`) into the full dict.
    ConsolidateSharded {
        /// One file per rank, in rank order.
        #[arg(required = true, value_name = "RANK.pt")]
        ranks: Vec<PathBuf>,
        /// Output file.
        #[arg(short, long, value_name = "FULL.pt")]
        output: PathBuf,
    },
    /// Shard a full optimizer state dict into the local dict each rank's optimizer loads
    /// (`FSDP.shard_full_optim_state_dict`), written as DIR/rank{r}.pt.
    ShardTorch {
        /// The model description and wrapping policy (JSON; see README).
        #[arg(long = "model", value_name = "DESC.json")]
        model: PathBuf,
        /// The full optimizer state dict.
        #[arg(value_name = "FULL.pt")]
        full: PathBuf,
        /// Number of ranks.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        world_size: u32,
        /// Output directory: missing, empty, or an earlier shard-torch output (recognised by
        /// its `fsdp-shard-torch.json` marker); replaced as a whole.
        #[arg(short, long, value_name = "DIR")]
        output: PathBuf,
        /// The optimizer is a named optimizer (state keyed by parameter names, not ids).
        #[arg(long)]
        named_optimizer: bool,
        /// Extension of the rank files.
        #[arg(long, default_value = "pt", value_parser = ["pt", "pth", "safetensors"])]
        ext: String,
        /// FSDP2: write the param groups' tuples (`betas`) as lists, as
        /// `set_optimizer_state_dict(full_state_dict=True)` leaves them (default: as the full
        /// dict has them, as ranks hold them after `dcp.load` + `set_state_dict`).
        #[arg(long)]
        tuples_as_lists: bool,
    },
    /// Rewrite a sharded checkpoint directory (this crate's format) for another world size
    /// and optionally another wrapping policy, streaming with bounded memory.
    Reshard {
        /// The checkpoint directory.
        input: PathBuf,
        /// The new checkpoint directory: missing, empty, or a committed checkpoint (replaced
        /// atomically); never a directory holding the input or other files.
        output: PathBuf,
        /// New number of ranks.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        world_size: u32,
        /// New wrapping policy: a JSON `WrapPolicy`, or a DESC.json whose `policy` is used
        /// (default: the saved policy).
        #[arg(long, value_name = "POLICY.json")]
        policy: Option<PathBuf>,
    },
    /// Write the full (unflattened, name-keyed) optimizer state dict of a sharded checkpoint
    /// directory, the whole state of a PyTorch DCP directory (`.metadata`, per-rank
    /// `__{rank}.metadata` files merged and checked to agree, or Hugging Face storage with
    /// DCP_SHARDING_INFO; `sharded/` of a consolidated one), or the fp32 weights of a
    /// DeepSpeed ZeRO or universal checkpoint (what zero_to_fp32's
    /// get_fp32_state_dict_from_zero_checkpoint returns), as `.safetensors` or `torch.save`
    /// (`.pt`), streaming with bounded memory.
    Consolidate {
        /// The checkpoint, DCP or DeepSpeed directory.
        input: PathBuf,
        /// Output file (.safetensors, .pt or .pth).
        output: PathBuf,
        /// DeepSpeed inputs only: write {"model": weights, "optim": {"state", "param_groups"}}
        /// with Adam's state, named as get_state_dict(full_state_dict=True) names it.
        #[arg(long)]
        optim: bool,
    },
    /// Check a sharded checkpoint directory completely (commit marker, manifest, file
    /// lengths and headers, every checksum block), or a PyTorch DCP directory of any form
    /// (`.metadata`, per-rank `__{rank}.metadata` files, Hugging Face storage): every byte
    /// range, chunk and value, and the tiling of every tensor.
    Verify {
        /// The checkpoint or DCP directory.
        input: PathBuf,
    },
}

/// Progress drawn as bars on stderr (hidden when quiet or not a terminal); notes are printed
/// as `note: ...`.
struct Bars {
    quiet: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Bars {
    fn new(quiet: bool) -> Self {
        Bars {
            quiet,
            bar: Mutex::new(None),
        }
    }

    fn target(&self) -> ProgressDrawTarget {
        if self.quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        }
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<ProgressBar>> {
        // A panic while drawing leaves nothing half-done that matters: take the bar anyway.
        self.bar.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Progress for Bars {
    fn start(&self, what: &str, total: Option<(u64, Unit)>) {
        let template = match total {
            Some((_, Unit::Bytes)) => {
                "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({binary_bytes_per_sec})"
            }
            Some((_, Unit::Files)) => "{spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})",
            None => "{spinner} {msg} ({elapsed})",
        };
        let pb = ProgressBar::with_draw_target(total.map(|(n, _)| n), self.target());
        pb.set_style(
            ProgressStyle::with_template(template)
                .expect("valid template")
                .progress_chars("=> "),
        );
        pb.set_message(what.to_string());
        if total.is_none() {
            pb.enable_steady_tick(Duration::from_millis(120));
        }
        if let Some(old) = self.current().replace(pb) {
            old.finish_and_clear();
        }
    }

    fn update(&self, done: u64) {
        if let Some(pb) = self.current().as_ref() {
            pb.set_position(done);
        }
    }

    fn finish(&self) {
        if let Some(pb) = self.current().take() {
            pb.finish_and_clear();
        }
    }

    fn note(&self, message: &str) {
        eprint_line(&format!("note: {message}"));
    }
}

/// How messages name standard output (for a write error there).
const STDOUT: &str = "standard output";

/// The exit status after standard output was closed under the command (`… | head`): what a
/// shell reports for a process that SIGPIPE ended (128 + 13), and what `yes | head` gives.
pub const CLOSED_PIPE_STATUS: u8 = 141;

/// Writes `text` to standard output and flushes it. A write error is [`fsdp::Error::Io`]
/// naming standard output (`>/dev/full`: "No space left on device"); a closed pipe is the
/// same error with kind `BrokenPipe`, which [`report`] turns into a quiet exit.
fn print_out(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(fsdp::Error::io("writing", STDOUT))
}

/// Writes `value` as it displays to standard output through a buffer, without making the
/// whole text first (an inspection of a million tensors prints a hundred megabytes), then
/// flushes it; errors as [`print_out`]'s.
fn print_shown(value: &dyn std::fmt::Display) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    write!(out, "{value}")
        .and_then(|()| out.flush())
        .map_err(fsdp::Error::io("writing", STDOUT))
}

/// Prints `value` as pretty JSON on stdout.
fn print_json(value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| fsdp::Error::Serialization {
        what: "the JSON output".into(),
        reason: e.to_string(),
    })?;
    print_out(&format!("{text}\n"))
}

/// Whether `e` says that standard output was closed by its reader.
fn closed_pipe(e: &fsdp::Error) -> bool {
    matches!(e, fsdp::Error::Io { path, source, .. }
        if path == STDOUT && source.kind() == std::io::ErrorKind::BrokenPipe)
}

/// Runs the command and prints its error as `error: ...`; returns the exit status.
fn run(cli: Cli) -> u8 {
    let world = match launcher::world() {
        Ok(world) => world,
        Err(e) => return report(Err(e)),
    };
    match world {
        Some(world) => {
            let status = report(launcher::run_in(cli, world.as_ref()));
            // mpirun ends the whole job as soon as one process exits with a failure: every
            // process prints its error before any leaves.
            let _ = world.barrier();
            status
        }
        None => report(run_alone(cli)),
    }
}

/// The exit status of `outcome`, its error printed.
fn report(outcome: Result<()>) -> u8 {
    match outcome {
        Ok(()) => 0,
        Err(e) if closed_pipe(&e) => CLOSED_PIPE_STATUS,
        Err(e) => {
            eprint_line(&format!("error: {e}"));
            1
        }
    }
}

/// Prints `line` on stderr in one write, so that a launcher forwarding the output of many
/// processes (`mpirun --tag-output`) keeps it whole.
fn eprint_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The DCP compression `--compress` names (clap allows only `zstd`).
fn compression(compress: Option<&str>) -> Option<io::dcp::Compression> {
    compress.map(|_| io::dcp::Compression::Zstd)
}

/// Runs a command in this process alone, as without a launcher.
fn run_alone(cli: Cli) -> Result<()> {
    let p = Bars::new(cli.quiet);
    let written = match cli.command {
        Command::Inspect { file, json } => {
            let found = commands::inspect(&file, &p)?;
            return if json {
                print_json(&found.to_json()?)
            } else {
                print_shown(&found)
            };
        }
        Command::Verify { input } => {
            return print_out(&format!("{}\n", commands::verify(&input, &p)?));
        }
        Command::Convert {
            input,
            output,
            max_expansion_bytes,
            to,
            model,
            world_size,
            compress,
            hf,
        } => {
            let opts = commands::ConvertOptions {
                to,
                model,
                world_size: world_size.map(|n| n as usize),
                max_expansion_bytes,
                compression: compression(compress.as_deref()),
                hf: hf.options(),
            };
            commands::convert(&input, &output, &opts, &Solo, &p)?
        }
        Command::ConsolidateTorch {
            model,
            ranks,
            output,
            named_optimizer,
        } => {
            let opts = commands::TorchOptions {
                named_optimizer,
                ..Default::default()
            };
            commands::consolidate_torch(&model, &ranks, &output, &opts, &p)?
        }
        Command::ConsolidateSharded { ranks, output } => {
            commands::consolidate_sharded(&ranks, &output, &p)?
        }
        Command::ShardTorch {
            model,
            full,
            world_size,
            output,
            named_optimizer,
            ext,
            tuples_as_lists,
        } => {
            let opts = commands::TorchOptions {
                named_optimizer,
                tuples_as_lists,
            };
            commands::shard_torch(&model, &full, world_size as usize, &output, &ext, &opts, &p)?
        }
        Command::Reshard {
            input,
            output,
            world_size,
            policy,
        } => commands::reshard(
            &input,
            &output,
            world_size as usize,
            policy.as_deref(),
            &Solo,
            &p,
        )?,
        Command::Consolidate {
            input,
            output,
            optim,
        } => commands::consolidate_with(
            &input,
            &output,
            &commands::ConsolidateOptions { optim },
            &Solo,
            &p,
        )?,
    };
    eprint_line(&written.message);
    Ok(())
}

/// Running as an MPI job (`mpirun -np N fsdp-ckpt …`, the binary built with the `mpi`
/// feature): the launcher is detected from its environment, nothing changes on the command
/// line.
mod launcher {
    use super::*;
    use fsdp::collectives::{ProcessGroup, ProcessGroupExt};

    /// The number of processes a launcher started (Open MPI's `OMPI_COMM_WORLD_SIZE`, MPICH
    /// Hydra's `PMI_SIZE`), when this process was started by one.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn launched_size() -> Option<usize> {
        ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .and_then(|n| n.trim().parse().ok())
    }

    /// The job's process group when a launcher started more than one process and the tool
    /// was built with `mpi`; `None` runs the command in this process alone, as without a
    /// launcher (a single process under `mpirun -np 1` never initializes MPI).
    pub(super) fn world() -> Result<Option<Box<dyn ProcessGroup>>> {
        #[cfg(feature = "mpi")]
        if launched_size().is_some_and(|n| n > 1) {
            let world = fsdp::collectives::MpiProcessGroup::world()?;
            if world.world_size() > 1 {
                return Ok(Some(Box::new(world)));
            }
        }
        Ok(None)
    }

    /// Runs a command as one process of `pg`: `reshard`, `consolidate` of the crate's
    /// checkpoint, a DCP directory or a DeepSpeed checkpoint (to either format;
    /// [`commands::consolidate_splits`]), `convert … --to dcp` of the crate's checkpoint, a file, a
    /// DeepSpeed checkpoint or a DCP directory and `convert DCP_DIR … --to fsdp`
    /// ([`commands::convert_splits`]) split their work across the processes; any other
    /// command runs on process 0 alone while the others wait for its outcome. Only process 0
    /// draws progress and prints; every process returns the same error.
    pub(super) fn run_in(cli: Cli, pg: &dyn ProcessGroup) -> Result<()> {
        let root = pg.rank() == 0;
        let p = Bars::new(cli.quiet || !root);
        let written = match cli.command {
            Command::Reshard {
                input,
                output,
                world_size,
                policy,
            } => commands::reshard(
                &input,
                &output,
                world_size as usize,
                policy.as_deref(),
                pg,
                &p,
            ),
            Command::Consolidate {
                ref input,
                ref output,
                optim,
            } if commands::consolidate_splits(output) => commands::consolidate_with(
                input,
                output,
                &commands::ConsolidateOptions { optim },
                pg,
                &p,
            ),
            Command::Convert {
                ref input,
                ref output,
                max_expansion_bytes,
                ref to,
                ref model,
                world_size,
                ref compress,
                ref hf,
            } => {
                let opts = commands::ConvertOptions {
                    to: to.clone(),
                    model: model.clone(),
                    world_size: world_size.map(|n| n as usize),
                    max_expansion_bytes,
                    compression: compression(compress.as_deref()),
                    hf: hf.options(),
                };
                if !commands::convert_splits(input, &opts) {
                    return on_root_alone(cli, pg);
                }
                commands::convert(input, output, &opts, pg, &p)
            }
            _ => return on_root_alone(cli, pg),
        };
        let written = written?;
        if root {
            eprint_line(&written.message);
        }
        Ok(())
    }

    /// Runs `cli` on process 0 only; every process gets its outcome.
    fn on_root_alone(cli: Cli, pg: &dyn ProcessGroup) -> Result<()> {
        if pg.rank() == 0 {
            pg.broadcast_agreed(Some(&run_alone(cli)), 0)
        } else {
            pg.broadcast_agreed(None, 0)
        }
    }
}

/// Runs the tool on a command line (`args[0]` is the program name) and returns its exit
/// status: 0 on success, 1 on an error (printed as `error: ...`), 2 on a usage error,
/// [`CLOSED_PIPE_STATUS`] (141, quietly) when standard output was closed by its reader.
///
/// This is the whole tool: the `fsdp-ckpt` executable calls it with its own arguments, and
/// other front ends (the Python package's `fsdp-ckpt` entry point) call it with theirs.
pub fn main_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` are "errors" that print to stdout and exit 0.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    run(cli)
}

#[cfg(test)]
mod tests {
    use super::main_with_args;

    #[test]
    fn the_entry_point_returns_the_tools_exit_status() {
        assert_eq!(main_with_args(["fsdp-ckpt", "--version"]), 0);
        assert_eq!(main_with_args(["fsdp-ckpt", "no-such-command"]), 2);
        let missing = std::env::temp_dir().join("fsdp-ckpt-no-such-file.pt");
        assert_eq!(
            main_with_args([
                "fsdp-ckpt".as_ref(),
                "inspect".as_ref(),
                missing.as_os_str()
            ]),
            1
        );
    }
}
