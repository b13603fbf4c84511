//! `convert IN OUT [--to dcp|hf|fsdp]`: file to file, and to and from DCP directories, the
//! crate's checkpoint and Hugging Face model directories.

use super::conversions;
use super::{
    as_a_job, clean_stale, expect_input, phase, recognize, step, Input, Progress, Written,
};
use crate::checkpoint;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::commands::rank_dicts::DescFile;
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::io::dcp;
use crate::io::inspect::Summary;
use crate::io::{self, FileFormat};
use crate::storage;
use crate::tensor::DType;
use std::path::{Path, PathBuf};

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

    fn dtype(&self) -> Result<Option<DType>> {
        self.dtype
            .as_deref()
            .map(|d| match d {
                "bf16" | "bfloat16" => Ok(DType::BF16),
                "f16" | "fp16" | "float16" => Ok(DType::F16),
                "f32" | "fp32" | "float32" => Ok(DType::F32),
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

    fn export(&self) -> Result<conversions::HfExportOptions> {
        Ok(conversions::HfExportOptions {
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

    fn import(&self, compression: io::dcp::Compression) -> Result<conversions::HfImportOptions> {
        if let Some(flag) = self.export_only().first() {
            return Err(Error::Unsupported(format!(
                "{flag} applies to `--to hf` (the export); importing a Hugging Face model takes --prefix, --rename, --rename-map, --dtype, --tie and --config"
            )));
        }
        Ok(conversions::HfImportOptions {
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
/// file ([`conversions::checkpoint_to_dcp`] for the crate's checkpoint directory,
/// [`conversions::deepspeed_to_dcp`] for a DeepSpeed checkpoint (model and Adam state, as
/// `get_state_dict` names them), [`conversions::dcp_to_dcp`] for a DCP directory (per-rank
/// metadata or Hugging Face storage rewritten with one `.metadata`),
/// [`conversions::torch_save_to_dcp`] for a file); process 0
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
        conversions::checkpoint_to_dcp_with(input, output, pg, &opts, |b| p.update(b))
    } else if found == Input::HfModel {
        convert_opts
            .hf
            .import(compression)
            .and_then(|o| conversions::hf_to_dcp(input, output, &o, pg))
    } else if found.is_dcp() {
        conversions::dcp_to_dcp_with(input, output, pg, &opts)
    } else if found.is_deepspeed() {
        conversions::deepspeed_to_dcp(input, output, pg, &opts, |b| p.update(b))
    } else {
        conversions::torch_save_to_dcp_with(input, output, pg, &opts)
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
/// writes ([`conversions::checkpoint_to_hf`]); by the processes of `pg`, each writing its share
/// of the files, process 0 the index.
fn to_hf(
    input: &Path,
    output: &Path,
    hf: &HfOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let opts = hf.export()?;
    let found = expect_input(
        "convert --to hf",
        input,
        "a DCP directory (any form), a checkpoint of this crate saved with the model, or a torch.save or safetensors file",
        |i| i.hf_source().is_some(),
    )?;
    let from = found
        .hf_source()
        .ok_or_else(|| Error::Internal("an accepted input has no export form".into()))?;
    pg.on_root(|| clean_stale(p, output, None))?;
    p.start(&phase("exporting", pg), None);
    let done = conversions::checkpoint_to_hf(input, from, output, &opts, pg);
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
/// N live ranks loading their shards ([`crate::Fsdp::load_dcp`]) and saving would write it,
/// streamed up to 16 rank files per pass over the input ([`conversions::dcp_to_checkpoint`]);
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
        conversions::dcp_to_checkpoint(input, output, &layout, pg)
    })?;
    fsdp_written(input, output, layout.world_size(), pg)
}

/// The layout `convert --to fsdp` writes for, from its options, once the input is known to
/// be a DCP directory and the output to overlap neither input.
fn fsdp_target(input: &Path, output: &Path, opts: &ConvertOptions) -> Result<ModelLayout> {
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
    ModelLayout::new(&spec.model, &spec.policy, ws)
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
