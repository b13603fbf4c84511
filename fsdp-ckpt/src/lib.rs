//! `fsdp-ckpt`: inspect, convert, consolidate and shard PyTorch FSDP checkpoints offline.
//!
//! A thin shell over the library: [`fsdp::io`] reads and writes the files (format by
//! extension), [`fsdp::io::inspect`] summarizes them and [`fsdp::offline`] consolidates and
//! shards optimizer state. Errors are printed as `error: ...` with exit code 1 (2 for usage
//! errors, as clap reports them).

use clap::{Parser, Subcommand};
use fsdp::checkpoint;
use fsdp::io::inspect::Summary;
use fsdp::io::output::{self, DirKind};
use fsdp::io::torch_save::{optim_from_pyobj, optim_to_pyobj};
use fsdp::io::{self, FileFormat};
use fsdp::offline::DescFile;
use fsdp::offline::{
    check_local_dicts, check_rank_files, consolidate_local_dicts, shard_full_dict,
};
use fsdp::{Error, OptimStateDict, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Inspect, convert, consolidate and shard PyTorch (FSDP) checkpoint files.
///
/// Formats follow the file extension: `.pt`/`.pth` (also `.bin`, `.ckpt`) are torch.save
/// files, `.safetensors` are single safetensors files.
#[derive(Parser, Debug)]
#[command(name = "fsdp-ckpt", version)]
struct Cli {
    /// No progress bars.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show what an optimizer or model state dict file holds: keys and key types, state
    /// names, dtypes, shapes, steps, param groups, total tensor bytes.
    Inspect {
        /// The file (.pt, .pth or .safetensors).
        file: PathBuf,
        /// Machine-readable JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Convert between torch.save and safetensors (formats chosen by extension); the dict
    /// comes back equal after a round trip.
    Convert {
        /// Input file.
        input: PathBuf,
        /// Output file.
        output: PathBuf,
        /// Bytes that copies of non-contiguous (e.g. expanded) tensors of a torch.save input
        /// may allocate beyond the file's storage bytes.
        #[arg(long, value_name = "BYTES", default_value_t = io::torch_save::LoadOptions::DEFAULT_MAX_EXPANSION_BYTES)]
        max_expansion_bytes: u64,
        /// Write a directory instead: `dcp`, a PyTorch DCP directory (from a torch.save or
        /// safetensors file, or from this crate's sharded checkpoint directory); `fsdp`, this
        /// crate's sharded checkpoint from a DCP directory (needs `--model` and
        /// `--world-size`).
        #[arg(long, value_name = "FORMAT", value_parser = ["dcp", "fsdp"])]
        to: Option<String>,
        /// With `--to fsdp`: the model description and wrapping policy (JSON; see README).
        #[arg(long = "model", value_name = "DESC.json")]
        model: Option<PathBuf>,
        /// With `--to fsdp`: the number of ranks of the checkpoint to write.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        world_size: Option<u32>,
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
    /// directory as `.safetensors` or `torch.save` (`.pt`), streaming with bounded memory.
    Consolidate {
        /// The checkpoint directory.
        input: PathBuf,
        /// Output file (.safetensors, .pt or .pth).
        output: PathBuf,
    },
    /// Check a sharded checkpoint directory completely: commit marker, manifest, file
    /// lengths and headers, every checksum block.
    Verify {
        /// The checkpoint directory.
        input: PathBuf,
    },
}

/// Progress reporting on stderr (hidden when quiet or not a terminal).
struct Progress {
    quiet: bool,
}

impl Progress {
    fn target(&self) -> ProgressDrawTarget {
        if self.quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        }
    }

    fn bar(&self, len: usize, what: &str) -> ProgressBar {
        let pb = ProgressBar::with_draw_target(Some(len as u64), self.target());
        pb.set_style(
            ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})")
                .expect("valid template")
                .progress_chars("=> "),
        );
        pb.set_message(what.to_string());
        pb
    }

    fn bytes(&self, len: u64, what: &str) -> ProgressBar {
        let pb = ProgressBar::with_draw_target(Some(len), self.target());
        pb.set_style(
            ProgressStyle::with_template(
                "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({binary_bytes_per_sec})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_message(what.to_string());
        pb
    }

    fn spinner(&self, what: &str) -> ProgressBar {
        let pb = ProgressBar::with_draw_target(None, self.target());
        pb.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("valid template"),
        );
        pb.set_message(what.to_string());
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    }

    /// Runs `f` under a spinner.
    fn step<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let pb = self.spinner(what);
        let out = f();
        pb.finish_and_clear();
        out
    }
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
            let mut p = fsdp::OptimParams::of_model(&layout);
            p.named = true;
            spec.optim_params = Some(p);
        }
    }
    Ok(spec)
}

/// A `WrapPolicy` from JSON: the policy itself, or a DESC.json's `policy`.
fn read_policy(path: &Path) -> Result<fsdp::WrapPolicy> {
    let bytes = output::read_small_file(path)?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::Serialization {
            what: format!("policy file `{}`", path.display()),
            reason: e.to_string(),
        })?;
    let policy = json.get("policy").cloned().unwrap_or(json);
    serde_json::from_value(policy).map_err(|e| Error::Serialization {
        what: format!("wrapping policy in `{}`", path.display()),
        reason: e.to_string(),
    })
}

fn load_optim(path: &Path) -> Result<OptimStateDict> {
    optim_from_pyobj(io::load(path)?)
}

fn save_optim(osd: &OptimStateDict, path: &Path) -> Result<()> {
    io::save(&optim_to_pyobj(osd)?, path)
}

/// Removes what killed earlier runs left beside `out` (putting back a previous `kind` output
/// an interrupted install moved aside), saying so on stderr.
fn clean_stale(out: &Path, kind: Option<DirKind>) -> Result<()> {
    for c in output::clean_stale_temporaries(out, kind)? {
        eprintln!("note: {c}");
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    let progress = Progress { quiet: cli.quiet };
    match cli.command {
        Command::Inspect { file, json } if file.is_dir() => inspect_dir(&file, json),
        Command::Inspect { file, json } => inspect_file(&progress, &file, json),
        Command::Convert {
            input,
            output,
            max_expansion_bytes,
            ..
        } => convert(&progress, &input, &output, max_expansion_bytes),
        Command::ConsolidateTorch {
            model,
            ranks,
            output,
            named_optimizer,
        } => consolidate_torch(&progress, &model, &ranks, &output, named_optimizer),
        Command::ConsolidateSharded { ranks, output } => {
            consolidate_sharded(&progress, &ranks, &output)
        }
        Command::ShardTorch {
            model,
            full,
            world_size,
            output,
            named_optimizer,
            ext,
        } => shard_torch(
            &progress,
            &model,
            &full,
            world_size as usize,
            &output,
            named_optimizer,
            &ext,
        ),
        Command::Reshard {
            input,
            output,
            world_size,
            policy,
        } => reshard(&progress, &input, &output, world_size as usize, policy),
        Command::Consolidate { input, output } => consolidate(&progress, &input, &output),
        Command::Verify { input } => {
            let checked = progress.step("verifying", || checkpoint::verify(&input))?;
            println!(
                "{}: OK ({checked} bytes of tensor state verified)",
                input.display()
            );
            Ok(())
        }
    }
}

/// `inspect DIR`: the manifest of a sharded checkpoint (data checksums are not read).
fn inspect_dir(dir: &Path, json: bool) -> Result<()> {
    let summary = checkpoint::Summary::of_dir(dir)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).expect("JSON values print")
        );
    } else {
        println!("{summary}");
    }
    Ok(())
}

/// `inspect FILE`: a summary of a state dict file.
fn inspect_file(progress: &Progress, file: &Path, json: bool) -> Result<()> {
    let format = FileFormat::from_path(file)?;
    // A torch.save file is summarized from its structure alone, never its tensor data.
    let summary = progress.step(&format!("reading {}", file.display()), || {
        Ok(match format {
            FileFormat::TorchSave => Summary::of_headers(&io::torch_save::load_headers(file)?),
            FileFormat::Safetensors => Summary::of(&io::load(file)?),
        })
    })?;
    if json {
        let mut v = serde_json::to_value(&summary).map_err(|e| Error::Serialization {
            what: "inspect summary".into(),
            reason: e.to_string(),
        })?;
        if let Some(m) = v.as_object_mut() {
            m.insert("file".into(), file.display().to_string().into());
            m.insert("format".into(), format.name().into());
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values print")
        );
    } else {
        println!("file: {} ({})", file.display(), format.name());
        println!("{summary}");
    }
    Ok(())
}

/// `convert IN OUT [--max-expansion-bytes N]`.
fn convert(
    progress: &Progress,
    input: &Path,
    output: &Path,
    max_expansion_bytes: u64,
) -> Result<()> {
    FileFormat::from_path(output)?;
    let opts = io::torch_save::LoadOptions {
        max_expansion_bytes,
    };
    let obj = progress.step(&format!("reading {}", input.display()), || {
        io::load_with(input, &opts)
    })?;
    clean_stale(output, None)?;
    progress.step(&format!("writing {}", output.display()), || {
        io::save(&obj, output)
    })?;
    let s = Summary::of(&obj);
    eprintln!(
        "converted {} -> {}: {} tensors, {} bytes of tensor data",
        input.display(),
        output.display(),
        s.tensor_count,
        s.total_tensor_bytes
    );
    Ok(())
}

/// `consolidate-sharded RANK… -o FULL`: per-rank SHARDED dicts (FSDP1 `ShardedTensor`, FSDP2
/// `DTensor`) into the full dict.
fn consolidate_sharded(progress: &Progress, ranks: &[PathBuf], output: &Path) -> Result<()> {
    FileFormat::from_path(output)?;
    let inputs: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    output::check_not_overlapping(output, &inputs)?;
    let pb = progress.bar(ranks.len(), "reading rank files");
    let mut dicts = Vec::with_capacity(ranks.len());
    for r in ranks {
        pb.set_message(format!("reading {}", r.display()));
        dicts.push(load_optim(r)?);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let full = fsdp::offline::consolidate_sharded(&dicts)?;
    drop(dicts);
    clean_stale(output, None)?;
    progress.step(&format!("writing {}", output.display()), || {
        save_optim(&full, output)
    })?;
    eprintln!(
        "consolidated {} sharded ranks into {}: {} keys, {} bytes of tensor state",
        ranks.len(),
        output.display(),
        full.state.len(),
        full.tensor_bytes()
    );
    Ok(())
}

/// `consolidate-torch --model DESC RANK… -o FULL`.
fn consolidate_torch(
    progress: &Progress,
    model: &Path,
    ranks: &[PathBuf],
    output: &Path,
    named_optimizer: bool,
) -> Result<()> {
    FileFormat::from_path(output)?;
    let mut inputs: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    inputs.push(model);
    output::check_not_overlapping(output, &inputs)?;
    let spec = load_spec(model, named_optimizer)?;
    // Fail on a model description that does not fit this world size before reading.
    spec.layout(ranks.len())?;
    let pb = progress.bar(ranks.len(), "reading rank files");
    let mut locals = Vec::with_capacity(ranks.len());
    for r in ranks {
        pb.set_message(format!("reading {}", r.display()));
        locals.push(load_optim(r)?);
        pb.inc(1);
    }
    pb.finish_and_clear();
    // Sizes first (their message names the world sizes that would fit), then the files.
    check_local_dicts(&spec, &locals)?;
    check_rank_files(ranks)?;
    let full = progress.step(&format!("consolidating {} ranks", ranks.len()), || {
        consolidate_local_dicts(&spec, &locals)
    })?;
    drop(locals);
    clean_stale(output, None)?;
    progress.step(&format!("writing {}", output.display()), || {
        save_optim(&full, output)
    })?;
    eprintln!(
        "consolidated {} ranks into {}: {} keys, {} bytes of tensor state",
        ranks.len(),
        output.display(),
        full.state.len(),
        full.tensor_bytes()
    );
    Ok(())
}

/// `shard-torch --model DESC FULL --world-size N -o DIR`: the rank files are written into a
/// temporary sibling of DIR with a marker naming them, then installed as one directory.
fn shard_torch(
    progress: &Progress,
    model: &Path,
    full: &Path,
    ws: usize,
    out: &Path,
    named_optimizer: bool,
    ext: &str,
) -> Result<()> {
    let spec = load_spec(model, named_optimizer)?;
    spec.layout(ws)?;
    let full_osd = progress.step(&format!("reading {}", full.display()), || load_optim(full))?;
    let locals = progress.step(&format!("sharding for {ws} ranks"), || {
        shard_full_dict(&spec, &full_osd, ws)
    })?;
    output::check_dir_output(out, DirKind::SHARD_TORCH, &[full, model])?;
    clean_stale(out, Some(DirKind::SHARD_TORCH))?;
    let tmp = output::make_tmp_dir(out)?;
    let written = write_rank_files(progress, &locals, &tmp, ext)
        .and_then(|()| output::install_dir(&tmp, out, DirKind::SHARD_TORCH));
    if written.is_err() {
        output::discard_tmp_dir(&tmp);
    }
    written?;
    eprintln!(
        "wrote {ws} rank files to {}/rank{{0..{}}}.{ext}",
        out.display(),
        ws - 1
    );
    Ok(())
}

/// Writes `rank{r}.{ext}` for every rank and the shard-torch marker into `dir`, synced.
fn write_rank_files(
    progress: &Progress,
    locals: &[OptimStateDict],
    dir: &Path,
    ext: &str,
) -> Result<()> {
    let pb = progress.bar(locals.len(), "writing rank files");
    let mut names = Vec::with_capacity(locals.len());
    for (r, osd) in locals.iter().enumerate() {
        let name = format!("rank{r}.{ext}");
        save_optim(osd, &dir.join(&name))?;
        names.push(name);
        pb.inc(1);
    }
    pb.finish_and_clear();
    output::write_synced(
        &dir.join(output::SHARD_TORCH_MARKER),
        &output::shard_torch_marker(&names),
    )?;
    output::sync_dir(dir)
}

/// `reshard IN OUT --world-size M [--policy P]`.
fn reshard(
    progress: &Progress,
    input: &Path,
    out: &Path,
    world_size: usize,
    policy: Option<PathBuf>,
) -> Result<()> {
    let policy = policy.map(|p| read_policy(&p)).transpose()?;
    let saved = checkpoint::read_manifest(input)?;
    output::check_dir_output(out, checkpoint::CHECKPOINT_DIR, &[input])?;
    clean_stale(out, Some(checkpoint::CHECKPOINT_DIR))?;
    let total = saved.tensor_bytes() + saved.model_param_bytes();
    let pb = progress.bytes(total, "resharding");
    let copied = checkpoint::reshard(input, out, world_size, policy.as_ref(), |b| {
        pb.set_position(b)
    })?;
    pb.finish_and_clear();
    eprintln!(
        "resharded {} -> {} for {world_size} ranks: {copied} bytes of tensor state",
        input.display(),
        out.display()
    );
    Ok(())
}

/// `consolidate IN OUT`: streamed to `.safetensors` or `.pt`.
fn consolidate(progress: &Progress, input: &Path, out: &Path) -> Result<()> {
    let format = FileFormat::from_path(out)?;
    output::check_not_overlapping(out, &[input])?;
    let total = checkpoint::read_manifest(input)?.tensor_bytes();
    clean_stale(out, None)?;
    let pb = progress.bytes(total, "consolidating");
    let to = |b| pb.set_position(b);
    let written = if format == FileFormat::Safetensors {
        checkpoint::consolidate_to_safetensors(input, out, to)?
    } else {
        checkpoint::consolidate_to_torch(input, out, to)?
    };
    pb.finish_and_clear();
    eprintln!(
        "consolidated {} -> {}: {written} bytes of tensor state",
        input.display(),
        out.display()
    );
    Ok(())
}

/// Runs the tool on a command line (`args[0]` is the program name) and returns its exit
/// status: 0 on success, 1 on an error (printed as `error: ...`), 2 on a usage error.
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
    let result = match run_dcp(&cli) {
        Some(r) => r,
        None => run(cli),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `inspect`, `consolidate` and `verify` of a PyTorch DCP directory (one holding
/// `.metadata`); `None` when the command is not about one.
fn run_dcp(cli: &Cli) -> Option<Result<()>> {
    use fsdp::io::dcp;
    let progress = Progress { quiet: cli.quiet };
    match &cli.command {
        Command::Inspect { file, json } if dcp::is_dcp_dir(file) => Some(dcp_inspect(file, *json)),
        Command::Consolidate { input, output } if dcp::is_dcp_dir(input) => {
            Some(dcp_consolidate(input, output, &progress))
        }
        Command::Verify { input } if dcp::is_dcp_dir(input) => {
            Some(progress.step("verifying", || dcp::verify(input)).map(|r| {
                println!(
                    "{}: OK ({} tensors in {} chunks, {} objects, {} bytes read)",
                    input.display(),
                    r.tensors,
                    r.chunks,
                    r.objects,
                    r.bytes_read
                );
            }))
        }
        Command::Convert {
            input,
            output,
            to: Some(to),
            model,
            world_size,
            ..
        } => Some(match to.as_str() {
            "fsdp" => dcp_to_fsdp(input, output, model.as_deref(), *world_size, &progress),
            _ if model.is_some() || world_size.is_some() => Err(Error::Unsupported(format!(
                "convert --to {to} takes no --model or --world-size (they describe the checkpoint `--to fsdp` writes)"
            ))),
            _ => dcp_convert(input, output, to, &progress),
        }),
        _ => None,
    }
}

/// `convert DCP_DIR OUT_DIR --to fsdp --model DESC.json --world-size N`: the crate's sharded
/// checkpoint of the DCP directory's optimizer state for N ranks of the described model.
/// N threads act as the ranks: each loads its shard of the directory
/// ([`fsdp::Fsdp::load_dcp`]) and they save the checkpoint collectively, as a live job
/// would.
fn dcp_to_fsdp(
    input: &Path,
    output: &Path,
    model: Option<&Path>,
    world_size: Option<u32>,
    progress: &Progress,
) -> Result<()> {
    let usage = |what: &str| {
        Error::Unsupported(format!(
            "convert {} {} --to fsdp needs {what} (the model description and wrapping, and the number of ranks to write for)",
            input.display(),
            output.display()
        ))
    };
    let model = model.ok_or_else(|| usage("--model DESC.json"))?;
    let ws = world_size.ok_or_else(|| usage("--world-size N"))? as usize;
    if !fsdp::io::dcp::is_dcp_dir(input) {
        return Err(Error::DcpMetadata {
            file: input.join(".metadata").display().to_string(),
            reason: "no such file: the input is not a DCP directory".into(),
        });
    }
    let spec = DescFile::from_json_file(model)?;
    output::check_not_overlapping(output, &[input, model])?;
    let opts = checkpoint::SaveOptions::default();
    progress.step("converting", || {
        let results = fsdp::collectives::ThreadGroup::run(ws, |pg| {
            let f = fsdp::Fsdp::new(&spec.model, &spec.policy, std::sync::Arc::new(pg))?;
            let params = f.optim_params();
            // Every rank joins the save, so that a rank failing to load fails them all.
            let local: Result<OptimStateDict> = f.load_dcp(input, &params);
            let local =
                fsdp::collectives::ProcessGroupExt::agree(f.process_group().as_ref(), local)?;
            f.save_optim_checkpoint(&local, &params, output, &opts)
        });
        results.into_iter().collect::<Result<Vec<()>>>()
    })?;
    eprintln!(
        "converted DCP directory {} -> checkpoint {} for {ws} ranks",
        input.display(),
        output.display()
    );
    Ok(())
}

/// `convert IN OUT_DIR --to dcp|fsdp`.
fn dcp_convert(input: &Path, output: &Path, to: &str, progress: &Progress) -> Result<()> {
    use fsdp::io::dcp;
    let written = match to {
        "dcp" if input.is_dir() => progress.step("converting", || {
            // The full optimizer state dict of the crate's sharded checkpoint.
            let full = checkpoint::load_full(input, &checkpoint::LoadOptions::default())?;
            dcp::save_dcp(&optim_to_pyobj(&full)?, output)
        })?,
        "dcp" => progress.step("converting", || dcp::torch_save_to_dcp(input, output))?,
        _ => {
            return Err(Error::Unsupported(format!(
                "convert {} {} --to {to}: writing this crate's sharded checkpoint from a DCP directory is not implemented yet (it needs the model description and wrapping); use `consolidate` to a .pt file",
                input.display(),
                output.display()
            )))
        }
    };
    eprintln!(
        "converted {} -> DCP directory {}: {written} bytes of tensors",
        input.display(),
        output.display()
    );
    Ok(())
}

fn dcp_inspect(dir: &Path, json: bool) -> Result<()> {
    let s = fsdp::io::dcp::summary(dir)?;
    if json {
        let text = serde_json::to_string_pretty(&s).map_err(|e| Error::Serialization {
            what: "inspect summary".into(),
            reason: e.to_string(),
        })?;
        println!("{text}");
    } else {
        print!("{s}");
    }
    Ok(())
}

fn dcp_consolidate(input: &Path, output: &Path, progress: &Progress) -> Result<()> {
    use fsdp::io::dcp;
    let format = FileFormat::from_path(output)?;
    let total = dcp::summary(input)?.tensor_bytes;
    let pb = progress.bytes(total, "consolidating");
    let to = |b| pb.set_position(b);
    let written = if format == FileFormat::Safetensors {
        dcp::consolidate_to_safetensors(input, output, to)?
    } else {
        dcp::consolidate_to_torch(input, output, to)?
    };
    pb.finish_and_clear();
    eprintln!(
        "consolidated DCP checkpoint {} -> {}: {written} bytes of tensors",
        input.display(),
        output.display()
    );
    Ok(())
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
