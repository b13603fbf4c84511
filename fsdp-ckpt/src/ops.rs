//! The tool's operations as library calls, one per command: each takes paths and options,
//! reports its phases through a [`Progress`], and returns what it did as a serializable
//! value.
//!
//! The command line prints these values and draws the progress as bars; the Python package
//! (`python/`) returns them as dicts and forwards the progress to a callback. Both run the
//! same code, so a file the CLI writes and one `fsdp_ckpt.consolidate(...)` writes are the
//! same file.

use crate::shard_dir::{shard_torch_marker, SHARD_TORCH, SHARD_TORCH_MARKER};
use fsdp::checkpoint;
use fsdp::collectives::{ProcessGroup, ProcessGroupExt};
use fsdp::convert;
use fsdp::io::dcp;
use fsdp::io::inspect::Summary;
use fsdp::io::torch_save::{optim_from_pyobj, optim_to_pyobj};
use fsdp::io::{self, FileFormat};
use fsdp::offline::{
    check_local_dicts, check_rank_files, consolidate_local_dicts, recognize, shard_full_dict_with,
    DescFile, Input, ShardOptions,
};
use fsdp::storage::{self, DirKind};
use fsdp::{Error, OptimStateDict, Result};
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

/// What `inspect` found.
#[derive(Debug, Clone, PartialEq)]
pub enum Inspection {
    /// A torch.save or safetensors file.
    File {
        /// The file.
        file: PathBuf,
        /// Its format.
        format: FileFormat,
        /// What it holds.
        summary: Summary,
    },
    /// The crate's sharded checkpoint directory (from its manifest).
    Checkpoint(checkpoint::CheckpointSummary),
    /// A PyTorch DCP directory (from its `.metadata`).
    Dcp(dcp::DcpSummary),
    /// A Hugging Face model directory (from its index and headers).
    HfModel(io::hf::HfSummary),
    /// A DeepSpeed ZeRO or universal checkpoint (from its pickles).
    DeepSpeed(io::deepspeed::Summary),
}

impl Inspection {
    /// The machine-readable form (`inspect --json`).
    pub fn to_json(&self) -> Result<serde_json::Value> {
        let ser = |e: serde_json::Error| Error::Serialization {
            what: "inspect summary".into(),
            reason: e.to_string(),
        };
        match self {
            Inspection::File {
                file,
                format,
                summary,
            } => {
                let mut v = serde_json::to_value(summary).map_err(ser)?;
                if let Some(m) = v.as_object_mut() {
                    m.insert("file".into(), file.display().to_string().into());
                    m.insert("format".into(), format.name().into());
                }
                Ok(v)
            }
            Inspection::Checkpoint(s) => serde_json::to_value(s).map_err(ser),
            Inspection::Dcp(s) => serde_json::to_value(s).map_err(ser),
            Inspection::HfModel(s) => serde_json::to_value(s).map_err(ser),
            Inspection::DeepSpeed(s) => serde_json::to_value(s).map_err(ser),
        }
    }
}

impl std::fmt::Display for Inspection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Inspection::File {
                file,
                format,
                summary,
            } => {
                writeln!(f, "file: {} ({})", file.display(), format.name())?;
                writeln!(f, "{summary}")
            }
            Inspection::Checkpoint(s) => writeln!(f, "{s}"),
            Inspection::Dcp(s) => write!(f, "{s}"),
            Inspection::HfModel(s) => write!(f, "{s}"),
            Inspection::DeepSpeed(s) => write!(f, "{s}"),
        }
    }
}

/// What `verify` checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "format", rename_all = "lowercase")]
pub enum Verified {
    /// The crate's checkpoint: every checksum block was read and matched.
    Checkpoint {
        /// The directory.
        input: PathBuf,
        /// Bytes of tensor state verified.
        tensor_bytes: u64,
    },
    /// A DCP directory: every byte range, chunk header and the tiling of every tensor.
    Dcp {
        /// The directory.
        input: PathBuf,
        /// What was read.
        #[serde(flatten)]
        report: dcp::VerifyReport,
    },
}

impl std::fmt::Display for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verified::Checkpoint {
                input,
                tensor_bytes,
            } => write!(
                f,
                "{}: OK ({tensor_bytes} bytes of tensor state verified)",
                input.display()
            ),
            Verified::Dcp { input, report: r } => write!(
                f,
                "{}: OK ({} tensors in {} chunks, {} objects, {} bytes read)",
                input.display(),
                r.tensors,
                r.chunks,
                r.objects,
                r.bytes_read
            ),
        }
    }
}

/// Options of [`convert()`] beyond its two paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertOptions {
    /// `None`: file to file, formats by extension. `Some("dcp")`: a DCP directory (from a
    /// torch.save or safetensors file, or from the crate's checkpoint directory).
    /// `Some("fsdp")`: the crate's checkpoint from a DCP directory (needs `model` and
    /// `world_size`).
    pub to: Option<String>,
    /// With `to = "fsdp"`: the DESC.json describing the model and its wrapping.
    pub model: Option<PathBuf>,
    /// With `to = "fsdp"`: the number of ranks of the checkpoint to write.
    pub world_size: Option<usize>,
    /// Bytes that copies of non-contiguous tensors of a torch.save input may allocate beyond
    /// the file's storage bytes.
    pub max_expansion_bytes: u64,
    /// With `to = "dcp"`: how the DCP directory stores its items (`--compress zstd`);
    /// `None` stores them plain.
    pub compression: Option<io::dcp::Compression>,
    /// With `to = "hf"`, or `to = "dcp"` from a Hugging Face model directory: how keys,
    /// dtypes and files map.
    pub hf: HfOptions,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            to: None,
            model: None,
            world_size: None,
            max_expansion_bytes: io::torch_save::LoadOptions::DEFAULT_MAX_EXPANSION_BYTES,
            compression: None,
            hf: HfOptions::default(),
        }
    }
}

/// The Hugging Face options of [`convert()`], as the command line gives them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HfOptions {
    /// `--max-shard-size` (`50GB`, `60KB`, `512MiB`); export only.
    pub max_shard_size: Option<String>,
    /// `--dtype bf16|f16|f32`: cast floating-point tensors.
    pub dtype: Option<String>,
    /// `--prefix P`: export the subtree P (default `model.`), or import under P (default
    /// `model.`).
    pub prefix: Option<String>,
    /// `--rename FROM=TO`, in order.
    pub rename: Vec<String>,
    /// `--rename-map FILE.json`, applied after the `--rename` rules.
    pub rename_map: Option<PathBuf>,
    /// `--tie NAME=SOURCE`: left out of the export, restored as a copy on import.
    pub tie: Vec<String>,
    /// `--config config.json`: copied into the export; its `tie_word_embeddings` ties.
    pub config: Option<PathBuf>,
}

impl HfOptions {
    /// Whether any option is given.
    fn any(&self) -> bool {
        *self != HfOptions::default()
    }

    /// The options only the export takes, by their flags, when given.
    fn export_only(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.max_shard_size.is_some() {
            v.push("--max-shard-size");
        }
        v
    }

    fn dtype(&self) -> Result<Option<fsdp::DType>> {
        self.dtype
            .as_deref()
            .map(|d| match d {
                "bf16" | "bfloat16" => Ok(fsdp::DType::BF16),
                "f16" | "fp16" | "float16" => Ok(fsdp::DType::F16),
                "f32" | "fp32" | "float32" => Ok(fsdp::DType::F32),
                other => Err(Error::Unsupported(format!(
                    "--dtype {other}: the choices are bf16, f16 and f32"
                ))),
            })
            .transpose()
    }

    fn renames(&self) -> Result<Vec<io::hf::Rename>> {
        let mut rules: Vec<io::hf::Rename> = self
            .rename
            .iter()
            .map(|r| io::hf::Rename::parse(r))
            .collect::<Result<_>>()?;
        if let Some(map) = &self.rename_map {
            rules.extend(io::hf::Rename::from_json_file(map)?);
        }
        Ok(rules)
    }

    fn ties(&self) -> Result<Vec<(String, String)>> {
        self.tie
            .iter()
            .map(|t| {
                t.split_once('=')
                    .map(|(n, k)| (n.to_string(), k.to_string()))
                    .ok_or_else(|| Error::HfTie {
                        name: t.clone(),
                        kept: String::new(),
                        reason:
                            "expected NAME=SOURCE (the tensor to leave out, `=`, the one it equals)"
                                .into(),
                    })
            })
            .collect()
    }

    fn export(&self) -> Result<convert::HfExportOptions> {
        Ok(convert::HfExportOptions {
            max_shard_size: self
                .max_shard_size
                .as_deref()
                .map(io::hf::parse_shard_size)
                .transpose()?,
            dtype: self.dtype()?,
            prefix: self.prefix.clone(),
            renames: self.renames()?,
            ties: self.ties()?,
            config: self.config.clone(),
        })
    }

    fn import(&self, compression: io::dcp::Compression) -> Result<convert::HfImportOptions> {
        if let Some(flag) = self.export_only().first() {
            return Err(Error::Unsupported(format!(
                "{flag} applies to `--to hf` (the export); importing a Hugging Face model takes --prefix, --rename, --rename-map, --dtype, --tie and --config"
            )));
        }
        Ok(convert::HfImportOptions {
            prefix: self
                .prefix
                .clone()
                .unwrap_or_else(|| io::hf::MODEL_PREFIX.into()),
            renames: self.renames()?,
            dtype: self.dtype()?,
            ties: self.ties()?,
            config: self.config.clone(),
            write: io::dcp::DcpWriteOptions::default().compression(compression),
        })
    }
}

/// Options of [`consolidate_torch`] and [`shard_torch`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TorchOptions {
    /// The optimizer is a named optimizer (state keyed by parameter names, not ids).
    pub named_optimizer: bool,
    /// `shard-torch` of an FSDP2 model: every tuple in the param groups (`betas`) becomes a
    /// list, as `set_optimizer_state_dict(full_state_dict=True)` leaves them
    /// ([`fsdp::offline::ShardOptions`]).
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
            let mut p = fsdp::OptimParams::of_model(&layout);
            p.named = true;
            spec.optim_params = Some(p);
        }
    }
    Ok(spec)
}

/// A `WrapPolicy` from JSON: the policy itself, or a DESC.json's `policy`.
fn read_policy(path: &Path) -> Result<fsdp::WrapPolicy> {
    let bytes = storage::read_small_file(path)?;
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
/// an interrupted install moved aside), saying so through `p`.
fn clean_stale(p: &dyn Progress, out: &Path, kind: Option<DirKind>) -> Result<()> {
    for c in storage::clean_stale_temporaries(out, kind)? {
        p.note(&c.to_string());
    }
    Ok(())
}

/// Reads every rank's optimizer state dict, in order, as one counted phase.
fn read_rank_files(p: &dyn Progress, ranks: &[PathBuf]) -> Result<Vec<OptimStateDict>> {
    p.start(
        "reading rank files",
        Some((ranks.len() as u64, Unit::Files)),
    );
    let mut dicts = Vec::with_capacity(ranks.len());
    for (i, r) in ranks.iter().enumerate() {
        match load_optim(r) {
            Ok(d) => dicts.push(d),
            Err(e) => {
                p.finish();
                return Err(e);
            }
        }
        p.update(i as u64 + 1);
    }
    p.finish();
    Ok(dicts)
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

/// `inspect PATH`: a summary of a state dict file (from its structure alone, never its tensor
/// data), of the crate's checkpoint directory (its manifest), of a DCP directory of any
/// form (its `.metadata`, its per-rank `__{rank}.metadata` files merged, or the
/// `DCP_SHARDING_INFO` headers of Hugging Face storage), or of a DeepSpeed checkpoint (its
/// pickles: stage, dtype, world size, tag, parameters and their states). A lone file of a
/// DeepSpeed checkpoint, recognised by its name, is read with DeepSpeed's three inert
/// globals allowed.
pub fn inspect(path: &Path, p: &dyn Progress) -> Result<Inspection> {
    let format =
        match recognize(path)? {
            i if i.is_dcp() => return Ok(Inspection::Dcp(dcp::summary(path)?)),
            i if i.is_deepspeed() => {
                let ckpt = step(p, &format!("reading {}", path.display()), || {
                    io::deepspeed::DeepSpeedCheckpoint::open(path)
                })?;
                return Ok(Inspection::DeepSpeed(ckpt.summary()));
            }
            Input::Checkpoint => {
                return Ok(Inspection::Checkpoint(
                    checkpoint::CheckpointSummary::of_dir(path)?,
                ))
            }
            Input::File(format) => format,
            Input::HfModel => return Ok(Inspection::HfModel(io::hf::summary(path)?)),
            found => return Err(wrong_input(
                "inspect",
                path,
                "a DCP directory, a checkpoint of this crate, a DeepSpeed checkpoint, a Hugging Face model directory, or a torch.save or safetensors file",
                found,
            )),
        };
    let summary = step(p, &format!("reading {}", path.display()), || {
        Ok(match format {
            FileFormat::TorchSave if fsdp::offline::deepspeed_file(path) => {
                Summary::of_headers(&io::deepspeed::load_file_headers(path)?)
            }
            FileFormat::TorchSave => Summary::of_headers(&io::torch_save::load_headers(path)?),
            FileFormat::Safetensors => Summary::of(&io::load(path)?),
        })
    })?;
    Ok(Inspection::File {
        file: path.to_path_buf(),
        format,
        summary,
    })
}

/// `verify DIR`: checks the crate's checkpoint directory (every checksum block) or a DCP
/// directory (byte ranges, chunk headers, tiling) completely.
pub fn verify(input: &Path, p: &dyn Progress) -> Result<Verified> {
    let found = expect_input(
        "verify",
        input,
        "a DCP directory or a checkpoint of this crate (inspect reads single files)",
        |i| i.is_dcp() || i == Input::Checkpoint,
    )?;
    step(p, "verifying", || {
        Ok(if found.is_dcp() {
            Verified::Dcp {
                input: input.to_path_buf(),
                report: dcp::verify(input)?,
            }
        } else {
            Verified::Checkpoint {
                input: input.to_path_buf(),
                tensor_bytes: checkpoint::verify(input)?,
            }
        })
    })
}

/// `convert IN OUT [--to dcp|fsdp]`: between torch.save and safetensors (formats by
/// extension; the dict comes back equal after a round trip), or to and from DCP directories.
pub fn convert(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    if pg.world_size() > 1 && !convert_splits(input, opts) {
        return Err(Error::Unsupported(format!(
            "convert {} {} split across processes: only --to dcp (from a file or the crate's checkpoint directory) and --to fsdp split",
            input.display(),
            output.display()
        )));
    }
    if opts.compression.is_some() && opts.to.as_deref() != Some("dcp") {
        return Err(Error::Unsupported(format!(
            "convert {} {}: --compress applies to the DCP directory `--to dcp` writes",
            input.display(),
            output.display()
        )));
    }
    if opts.hf.any() && !matches!(opts.to.as_deref(), Some("hf") | Some("dcp")) {
        return Err(Error::Unsupported(format!(
            "convert {} {}: --max-shard-size, --dtype, --prefix, --rename, --rename-map, --tie and --config apply to `--to hf` (and some to `--to dcp` of a Hugging Face model directory)",
            input.display(),
            output.display()
        )));
    }
    match opts.to.as_deref() {
        None => convert_file(input, output, opts.max_expansion_bytes, p),
        Some("fsdp") => dcp_to_fsdp(input, output, opts, pg, p),
        Some(to) if opts.model.is_some() || opts.world_size.is_some() => {
            Err(Error::Unsupported(format!(
                "convert --to {to} takes no --model or --world-size (they describe the checkpoint `--to fsdp` writes)"
            )))
        }
        Some("dcp") => to_dcp(input, output, opts, pg, p),
        Some("hf") => to_hf(input, output, &opts.hf, pg, p),
        Some(to) => Err(Error::Unsupported(format!(
            "convert --to {to}: the formats are `dcp`, `fsdp` and `hf`"
        ))),
    }
}

/// `convert IN OUT`, file to file.
fn convert_file(
    input: &Path,
    output: &Path,
    max_expansion_bytes: u64,
    p: &dyn Progress,
) -> Result<Written> {
    expect_input(
        "convert (without --to)",
        input,
        "a torch.save or safetensors file (--to dcp converts directories)",
        |i| matches!(i, Input::File(_)),
    )?;
    FileFormat::from_path(output)?;
    storage::check_file_output(output)?;
    storage::check_not_overlapping(output, &[input])?;
    let opts = io::torch_save::LoadOptions::default().max_expansion_bytes(max_expansion_bytes);
    let obj = step(p, &format!("reading {}", input.display()), || {
        io::load_with(input, &opts)
    })?;
    clean_stale(p, output, None)?;
    step(p, &format!("writing {}", output.display()), || {
        io::save(&obj, output)
    })?;
    let s = Summary::of(&obj);
    Ok(Written {
        operation: "convert",
        output: output.to_path_buf(),
        tensor_bytes: s.total_tensor_bytes as u64,
        count: Some(s.tensor_count),
        world_size: None,
        message: format!(
            "converted {} -> {}: {} tensors, {} bytes of tensor data",
            input.display(),
            output.display(),
            s.tensor_count,
            s.total_tensor_bytes
        ),
    })
}

/// `convert IN OUT_DIR --to dcp`, from a file, from the crate's checkpoint directory, from a
/// DeepSpeed checkpoint, or from a DCP directory with per-rank metadata or in Hugging Face
/// storage, by the processes of `pg`: each writes its share of the tensors into the one data
/// file ([`convert::checkpoint_to_dcp`] for the crate's checkpoint directory,
/// [`convert::deepspeed_to_dcp`] for a DeepSpeed checkpoint (model and Adam state, as
/// `get_state_dict` names them), [`convert::dcp_to_dcp`] for a DCP directory (per-rank
/// metadata or Hugging Face storage rewritten with one `.metadata`),
/// [`convert::torch_save_to_dcp`] for a file); process 0
/// writes `.metadata` and installs the directory. The output is the same for any number of
/// processes (a DCP directory's `.metadata` differs only in its random save id). With
/// `compression` (`--compress zstd`) every item is a zstd frame and process 0 writes them all.
fn to_dcp(
    input: &Path,
    output: &Path,
    convert_opts: &ConvertOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let compression = convert_opts.compression.unwrap_or_default();
    let opts = io::dcp::DcpWriteOptions::default().compression(compression);
    let found = pg.agree(to_dcp_input(input))?;
    if found != Input::HfModel && convert_opts.hf.any() {
        return Err(Error::Unsupported(format!(
            "convert {} --to dcp: --prefix, --rename, --rename-map, --dtype, --tie and --config apply to a Hugging Face model directory, and the input is {}",
            input.display(),
            found.describe()
        )));
    }
    let from_checkpoint = found == Input::Checkpoint;
    if from_checkpoint {
        pg.agree(checkpoint::read_manifest(input))?;
    }
    pg.on_root(|| clean_stale(p, output, Some(dcp::DCP_DIR)))?;
    p.start(&phase("converting", pg), None);
    let written = if from_checkpoint {
        // The full optimizer state dict of the crate's sharded checkpoint, streamed.
        convert::checkpoint_to_dcp_with(input, output, pg, &opts, |b| p.update(b))
    } else if found == Input::HfModel {
        convert_opts
            .hf
            .import(compression)
            .and_then(|o| convert::hf_to_dcp(input, output, &o, pg))
    } else if found.is_dcp() {
        convert::dcp_to_dcp_with(input, output, pg, &opts)
    } else if found.is_deepspeed() {
        convert::deepspeed_to_dcp(input, output, pg, &opts, |b| p.update(b))
    } else {
        convert::torch_save_to_dcp_with(input, output, pg, &opts)
    };
    p.finish();
    let written = written?;
    Ok(Written {
        operation: "convert",
        output: output.to_path_buf(),
        tensor_bytes: written,
        count: None,
        world_size: None,
        message: format!(
            "converted {} -> DCP directory {}{}{}: {written} bytes of tensors",
            input.display(),
            output.display(),
            if compression == io::dcp::Compression::Zstd {
                " (zstd)"
            } else {
                ""
            },
            as_a_job(pg)
        ),
    })
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

/// The input of `convert … --to dcp`: a checkpoint of this crate, a file, or a DCP directory
/// whose metadata is not one `.metadata` (per-rank files, Hugging Face storage); one with
/// `.metadata` is already what this writes.
fn to_dcp_input(input: &Path) -> Result<Input> {
    expect_input(
        "convert --to dcp",
        input,
        "a checkpoint of this crate, a torch.save or safetensors file, a Hugging Face model directory, a DeepSpeed ZeRO or universal checkpoint, or a DCP directory with per-rank metadata or in Hugging Face storage",
        to_dcp_takes,
    )
}

/// Whether `convert … --to dcp` takes `i` ([`to_dcp_input`]).
fn to_dcp_takes(i: Input) -> bool {
    i != Input::Dcp
        && (i.is_dcp()
            || i.is_deepspeed()
            || matches!(i, Input::Checkpoint | Input::File(_) | Input::HfModel))
}

/// `convert IN OUT_DIR --to hf`: the model weights of a DCP directory (any form), the
/// crate's checkpoint or a file, as the Hugging Face model directory `save_pretrained`
/// writes ([`convert::checkpoint_to_hf`]); by the processes of `pg`, each writing its share
/// of the files, process 0 the index.
fn to_hf(
    input: &Path,
    output: &Path,
    hf: &HfOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let opts = hf.export()?;
    expect_input(
        "convert --to hf",
        input,
        "a DCP directory (any form), a checkpoint of this crate saved with the model, or a torch.save or safetensors file",
        |i| i.is_dcp() || matches!(i, Input::Checkpoint | Input::File(_)),
    )?;
    pg.on_root(|| clean_stale(p, output, None))?;
    p.start(&phase("exporting", pg), None);
    let done = convert::checkpoint_to_hf(input, output, &opts, pg);
    p.finish();
    let done = done?;
    let dropped = if done.dropped.is_empty() {
        String::new()
    } else {
        let d: Vec<String> = done
            .dropped
            .iter()
            .map(|(n, k)| format!("{n} (= {k})"))
            .collect();
        format!("; left out as tied: {}", d.join(", "))
    };
    Ok(Written {
        operation: "convert",
        output: output.to_path_buf(),
        tensor_bytes: done.total_size,
        count: Some(done.tensors),
        world_size: None,
        message: format!(
            "exported {} -> Hugging Face model {}{}: {} tensors, {} parameters, {} bytes in {} file(s){}{dropped}",
            input.display(),
            output.display(),
            as_a_job(pg),
            done.tensors,
            done.total_parameters,
            done.total_size,
            done.files.len(),
            if done.indexed { " and the index" } else { "" },
        ),
    })
}

/// Whether `convert INPUT …` splits its work across the processes of a job: `--to dcp` from
/// the crate's checkpoint directory, a DCP directory or a file (a data file whose layout is
/// known before any byte is written; from a `.pt` whose tensors are views into shared
/// storages, each storage's tensors are one process's; a legacy-format `.pt`, or one
/// `torch.load` refuses to expand, is converted by process 0 alone), and `--to fsdp` (each process writes its share of the rank
/// files). File-to-file conversions run on one process.
pub fn convert_splits(input: &Path, opts: &ConvertOptions) -> bool {
    match opts.to.as_deref() {
        Some("dcp") => {
            opts.model.is_none()
                && opts.world_size.is_none()
                && recognize(input).is_ok_and(to_dcp_takes)
        }
        Some("fsdp") | Some("hf") => true,
        _ => false,
    }
}

/// `convert DCP_DIR OUT_DIR --to fsdp --model DESC.json --world-size N`: the crate's sharded
/// checkpoint of the DCP directory's optimizer state for N ranks of the described model, as
/// N live ranks loading their shards ([`fsdp::Fsdp::load_dcp`]) and saving would write it,
/// streamed up to 16 rank files per pass over the input ([`convert::dcp_to_checkpoint`]);
/// by the processes of `pg`, output rank `r` is written by process `r % N` and process 0
/// commits.
fn dcp_to_fsdp(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let layout = pg.agree(fsdp_target(input, output, opts))?;
    step(p, &phase("converting", pg), || {
        convert::dcp_to_checkpoint(input, output, &layout, pg)
    })?;
    fsdp_written(input, output, layout.world_size(), pg)
}

/// The layout `convert --to fsdp` writes for, from its options, once the input is known to
/// be a DCP directory and the output to overlap neither input.
fn fsdp_target(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
) -> Result<fsdp::flat_param::ModelLayout> {
    let usage = |what: &str| {
        Error::Unsupported(format!(
            "convert {} {} --to fsdp needs {what} (the model description and wrapping, and the number of ranks to write for)",
            input.display(),
            output.display()
        ))
    };
    let model = opts
        .model
        .as_deref()
        .ok_or_else(|| usage("--model DESC.json"))?;
    let ws = opts.world_size.ok_or_else(|| usage("--world-size N"))?;
    if ws == 0 {
        return Err(usage("a world size of at least 1"));
    }
    expect_input("convert --to fsdp", input, "a DCP directory", Input::is_dcp)?;
    let spec = DescFile::from_json_file(model)?;
    storage::check_not_overlapping(output, &[input, model])?;
    fsdp::flat_param::ModelLayout::new(&spec.model, &spec.policy, ws)
}

/// The report of `convert --to fsdp` (`processes`: the job's size when split).
fn fsdp_written(input: &Path, output: &Path, ws: usize, pg: &dyn ProcessGroup) -> Result<Written> {
    let tensor_bytes = checkpoint::read_manifest(output)?.tensor_bytes();
    let job = as_a_job(pg);
    Ok(Written {
        operation: "convert",
        output: output.to_path_buf(),
        tensor_bytes,
        count: None,
        world_size: Some(ws),
        message: format!(
            "converted DCP directory {} -> checkpoint {} for {ws} ranks{job}",
            input.display(),
            output.display()
        ),
    })
}

/// Options of [`consolidate_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsolidateOptions {
    /// `--optim`: for a DeepSpeed checkpoint, write `{"model": …, "optim": …}` (the fp32
    /// weights and Adam's state, named as `get_state_dict(full_state_dict=True)` names them)
    /// instead of the fp32 weights alone. Refused for other inputs, whose consolidation holds
    /// whatever they saved.
    pub optim: bool,
}

/// `consolidate IN OUT`: the full optimizer state dict of the crate's checkpoint directory,
/// the whole state of a DCP directory (what `dcp_to_torch_save` writes), or the fp32 weights
/// of a DeepSpeed checkpoint (what `get_fp32_state_dict_from_zero_checkpoint` returns),
/// streamed to `.safetensors` or `.pt` with bounded memory.
///
/// Run by the processes of `pg` (`&Solo` for one; under `mpirun -np N`, see
/// [`consolidate_splits`]): each writes its share of the file's byte ranges
/// ([`convert::checkpoint_to_safetensors`], [`convert::checkpoint_to_torch_save`],
/// [`convert::dcp_to_safetensors`], [`convert::dcp_to_torch_save`]) and process 0 installs
/// it. The file is the same for any number of processes; a failure on any process fails all
/// of them with the same error and leaves `out` as it was. `p` reports this process's share.
pub fn consolidate(
    input: &Path,
    out: &Path,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    consolidate_with(input, out, &ConsolidateOptions::default(), pg, p)
}

/// [`consolidate`] with options: `--optim` for a DeepSpeed checkpoint
/// ([`convert::deepspeed_to_torch_save`], [`convert::deepspeed_to_safetensors`]).
pub fn consolidate_with(
    input: &Path,
    out: &Path,
    opts: &ConsolidateOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let format = FileFormat::from_path(out)?;
    let found = pg.agree(consolidate_input(input))?;
    if opts.optim && !found.is_deepspeed() {
        return Err(Error::Unsupported(format!(
            "consolidate --optim takes a DeepSpeed checkpoint (its optimizer state is kept apart from the weights); `{}` is {}, whose consolidation already holds all it saved: drop --optim",
            input.display(),
            found.describe()
        )));
    }
    pg.on_root(|| {
        storage::check_not_overlapping(out, &[input])?;
        storage::check_file_output(out)
    })?;
    if found.is_deepspeed() {
        return consolidate_deepspeed(input, out, format, opts, pg, p);
    }
    let is_dcp = found.is_dcp();
    let total = pg.agree(if is_dcp {
        dcp::summary(input).map(|s| s.tensor_bytes)
    } else {
        checkpoint::read_manifest(input).map(|m| m.tensor_bytes())
    })?;
    pg.on_root(|| clean_stale(p, out, None))?;
    let share_total = (pg.world_size() == 1).then_some((total, Unit::Bytes));
    p.start(&phase("consolidating", pg), share_total);
    let to = |b| p.update(b);
    let written = match (is_dcp, format) {
        (true, FileFormat::Safetensors) => convert::dcp_to_safetensors(input, out, pg, to),
        (true, _) => convert::dcp_to_torch_save(input, out, pg, to),
        (false, FileFormat::Safetensors) => convert::checkpoint_to_safetensors(input, out, pg, to),
        (false, _) => convert::checkpoint_to_torch_save(input, out, pg, to),
    };
    p.finish();
    let written = written?;
    let what = if is_dcp { "DCP checkpoint " } else { "" };
    Ok(Written {
        operation: "consolidate",
        output: out.to_path_buf(),
        tensor_bytes: written,
        count: None,
        world_size: None,
        message: format!(
            "consolidated {what}{} -> {}{}: {written} bytes of {}",
            input.display(),
            out.display(),
            on_processes(pg),
            if is_dcp { "tensors" } else { "tensor state" }
        ),
    })
}

/// `consolidate DS_DIR OUT [--optim]`: the fp32 weights of a DeepSpeed checkpoint, or with
/// `--optim` the weights and Adam's state, streamed one parameter at a time.
fn consolidate_deepspeed(
    input: &Path,
    out: &Path,
    format: FileFormat,
    opts: &ConsolidateOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let ckpt = pg.agree(step(p, &format!("reading {}", input.display()), || {
        io::deepspeed::DeepSpeedCheckpoint::open(input)
    }))?;
    pg.on_root(|| clean_stale(p, out, None))?;
    let states = if opts.optim { 3 } else { 1 };
    let total = ckpt.fp32_bytes() * states;
    let share_total = (pg.world_size() == 1).then_some((total, Unit::Bytes));
    p.start(&phase("consolidating", pg), share_total);
    let what = convert::DeepSpeedOutput { optim: opts.optim };
    let to = |b| p.update(b);
    let written = match format {
        FileFormat::Safetensors => convert::deepspeed_to_safetensors(input, out, what, pg, to),
        FileFormat::TorchSave => convert::deepspeed_to_torch_save(input, out, what, pg, to),
    };
    p.finish();
    let written = written?;
    Ok(Written {
        operation: "consolidate",
        output: out.to_path_buf(),
        tensor_bytes: written,
        count: Some(ckpt.params().len()),
        world_size: Some(ckpt.world_size()),
        message: format!(
            "consolidated DeepSpeed ZeRO-{} checkpoint {} (tag {}, {} ranks) -> {}{}: {} parameters, {written} bytes of {}",
            ckpt.stage(),
            input.display(),
            ckpt.tag(),
            ckpt.world_size(),
            out.display(),
            on_processes(pg),
            ckpt.params().len(),
            if opts.optim { "weights and Adam state" } else { "fp32 weights" }
        ),
    })
}

/// How a result message names the processes of a job (nothing for one).
fn on_processes(pg: &dyn ProcessGroup) -> String {
    if pg.world_size() > 1 {
        format!(" on {} processes", pg.world_size())
    } else {
        String::new()
    }
}

/// The input of `consolidate`: a DCP directory, a checkpoint of this crate or a DeepSpeed
/// checkpoint.
fn consolidate_input(input: &Path) -> Result<Input> {
    expect_input(
        "consolidate",
        input,
        "a DCP directory, a checkpoint of this crate or a DeepSpeed checkpoint",
        |i| i.is_dcp() || i == Input::Checkpoint || i.is_deepspeed(),
    )
}

/// The input of `reshard`: a checkpoint of this crate.
fn reshard_input(input: &Path) -> Result<Input> {
    expect_input(
        "reshard",
        input,
        "a checkpoint of this crate (convert a DCP directory with --to fsdp first)",
        |i| i == Input::Checkpoint,
    )
}

/// `reshard IN OUT --world-size M [--policy P]`: the crate's checkpoint rewritten for another
/// world size and optionally another wrapping policy (a JSON `WrapPolicy`, or a DESC.json
/// whose `policy` is used), streamed with bounded memory.
///
/// Run by the processes of `pg` (`&Solo` for one; under `mpirun -np N fsdp-ckpt reshard …`
/// each writes its share of the output rank files with [`checkpoint::reshard`] and process 0
/// commits). The output is the same for any number of processes; a failure on any process
/// fails all of them with the same error and leaves `out` as it was. `p` reports this
/// process's share.
pub fn reshard(
    input: &Path,
    out: &Path,
    world_size: usize,
    policy: Option<&Path>,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    pg.agree(reshard_input(input))?;
    let policy = pg.agree(policy.map(read_policy).transpose())?;
    let saved = pg.agree(checkpoint::read_manifest(input))?;
    pg.on_root(|| {
        storage::check_dir_output(out, checkpoint::CHECKPOINT_DIR, &[input])?;
        clean_stale(p, out, Some(checkpoint::CHECKPOINT_DIR))
    })?;
    let total = saved.tensor_bytes() + saved.model_param_bytes();
    let share_total = (pg.world_size() == 1).then_some((total, Unit::Bytes));
    p.start(&phase("resharding", pg), share_total);
    let copied = checkpoint::reshard(input, out, world_size, policy.as_ref(), pg, |b| p.update(b));
    p.finish();
    let copied = copied?;
    Ok(Written {
        operation: "reshard",
        output: out.to_path_buf(),
        tensor_bytes: copied,
        count: None,
        world_size: Some(world_size),
        message: format!(
            "resharded {} -> {} for {world_size} ranks{}: {copied} bytes of tensor state",
            input.display(),
            out.display(),
            on_processes(pg)
        ),
    })
}

/// Whether `consolidate INPUT OUTPUT` splits its work across the processes of a job: from
/// the crate's checkpoint directory, a DCP directory or a DeepSpeed checkpoint to either
/// format (files whose layout is known before any byte is written), that is whenever
/// `OUTPUT`'s format is known.
pub fn consolidate_splits(out: &Path) -> bool {
    FileFormat::from_path(out).is_ok()
}

/// `consolidate-sharded RANK… -o FULL`: per-rank SHARDED dicts (FSDP1 `ShardedTensor`, FSDP2
/// `DTensor`) into the full dict.
pub fn consolidate_sharded(ranks: &[PathBuf], output: &Path, p: &dyn Progress) -> Result<Written> {
    FileFormat::from_path(output)?;
    let inputs: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    storage::check_not_overlapping(output, &inputs)?;
    storage::check_file_output(output)?;
    let dicts = read_rank_files(p, ranks)?;
    let full = fsdp::offline::consolidate_sharded(&dicts)?;
    drop(dicts);
    write_full(
        p,
        &full,
        output,
        ranks.len(),
        "consolidate_sharded",
        "sharded ranks",
    )
}

/// Writes a consolidated dict of `ranks` ranks to `output`; the report of `operation`.
fn write_full(
    p: &dyn Progress,
    full: &OptimStateDict,
    output: &Path,
    ranks: usize,
    operation: &'static str,
    what: &str,
) -> Result<Written> {
    clean_stale(p, output, None)?;
    step(p, &format!("writing {}", output.display()), || {
        save_optim(full, output)
    })?;
    Ok(Written {
        operation,
        output: output.to_path_buf(),
        tensor_bytes: full.tensor_bytes() as u64,
        count: Some(full.state.len()),
        world_size: Some(ranks),
        message: format!(
            "consolidated {ranks} {what} into {}: {} keys, {} bytes of tensor state",
            output.display(),
            full.state.len(),
            full.tensor_bytes()
        ),
    })
}

/// `consolidate-torch --model DESC RANK… -o FULL`: every rank's local `optim.state_dict()`
/// into the dict `FSDP.full_optim_state_dict` returns.
pub fn consolidate_torch(
    model: &Path,
    ranks: &[PathBuf],
    output: &Path,
    opts: &TorchOptions,
    p: &dyn Progress,
) -> Result<Written> {
    FileFormat::from_path(output)?;
    let mut inputs: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    inputs.push(model);
    storage::check_not_overlapping(output, &inputs)?;
    storage::check_file_output(output)?;
    let spec = load_spec(model, opts.named_optimizer)?;
    // Fail on a model description that does not fit this world size before reading.
    spec.layout(ranks.len())?;
    let locals = read_rank_files(p, ranks)?;
    // Sizes first (their message names the world sizes that would fit), then the files.
    check_local_dicts(&spec, &locals)?;
    check_rank_files(ranks)?;
    let full = step(p, &format!("consolidating {} ranks", ranks.len()), || {
        consolidate_local_dicts(&spec, &locals)
    })?;
    drop(locals);
    write_full(p, &full, output, ranks.len(), "consolidate_torch", "ranks")
}

/// `shard-torch --model DESC FULL --world-size N -o DIR`: the local dict each rank's optimizer
/// loads (`FSDP.shard_full_optim_state_dict`), written as `DIR/rank{r}.{ext}` (`ext`: `pt`,
/// `pth` or `safetensors`). The rank files are written into a temporary sibling of DIR with
/// a marker naming them, then installed as one directory.
pub fn shard_torch(
    model: &Path,
    full: &Path,
    ws: usize,
    out: &Path,
    ext: &str,
    opts: &TorchOptions,
    p: &dyn Progress,
) -> Result<Written> {
    if !["pt", "pth", "safetensors"].contains(&ext) {
        return Err(Error::Unsupported(format!(
            "rank file extension `{ext}` (use pt, pth or safetensors)"
        )));
    }
    let spec = load_spec(model, opts.named_optimizer)?;
    spec.layout(ws)?;
    let full_osd = step(p, &format!("reading {}", full.display()), || {
        load_optim(full)
    })?;
    let shard_opts = ShardOptions::default().with_tuples_as_lists(opts.tuples_as_lists);
    let locals = step(p, &format!("sharding for {ws} ranks"), || {
        shard_full_dict_with(&spec, &full_osd, ws, &shard_opts)
    })?;
    storage::check_dir_output(out, SHARD_TORCH, &[full, model])?;
    clean_stale(p, out, Some(SHARD_TORCH))?;
    let tmp = storage::make_tmp_dir(out)?;
    let written = write_rank_files(p, &locals, &tmp, ext)
        .and_then(|()| storage::install_dir(&tmp, out, SHARD_TORCH));
    if written.is_err() {
        storage::discard_tmp_dir(&tmp);
    }
    written?;
    Ok(Written {
        operation: "shard_torch",
        output: out.to_path_buf(),
        tensor_bytes: locals.iter().map(|l| l.tensor_bytes() as u64).sum(),
        count: Some(ws),
        world_size: Some(ws),
        message: format!(
            "wrote {ws} rank files to {}/rank{{0..{}}}.{ext}",
            out.display(),
            ws - 1
        ),
    })
}

/// Writes `rank{r}.{ext}` for every rank and the shard-torch marker into `dir`, synced.
fn write_rank_files(
    p: &dyn Progress,
    locals: &[OptimStateDict],
    dir: &Path,
    ext: &str,
) -> Result<()> {
    p.start(
        "writing rank files",
        Some((locals.len() as u64, Unit::Files)),
    );
    let mut names = Vec::with_capacity(locals.len());
    for (r, osd) in locals.iter().enumerate() {
        let name = format!("rank{r}.{ext}");
        if let Err(e) = save_optim(osd, &dir.join(&name)) {
            p.finish();
            return Err(e);
        }
        names.push(name);
        p.update(r as u64 + 1);
    }
    p.finish();
    storage::write_synced(&dir.join(SHARD_TORCH_MARKER), &shard_torch_marker(&names)?)?;
    storage::sync_dir(dir)
}
