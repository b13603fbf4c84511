//! `inspect PATH`: what a file or a checkpoint directory holds, from its structure alone.

use super::{recognize, step, wrong_input, Input, Progress};
use crate::checkpoint;
use crate::error::{Error, Result};
use crate::io::dcp;
use crate::io::inspect::Summary;
use crate::io::{self, FileFormat};
use std::path::{Path, PathBuf};

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
    /// A Megatron-Core `torch_dist` checkpoint (from its metadata).
    Megatron(io::megatron::MegatronSummary),
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
            Inspection::Megatron(s) => serde_json::to_value(s).map_err(ser),
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
            Inspection::Megatron(s) => write!(f, "{s}"),
        }
    }
}

/// `inspect PATH`: a summary of a state dict file (from its structure alone, never its tensor
/// data), of the crate's checkpoint directory (its manifest), of a DCP directory of any
/// form (its `.metadata`, its per-rank `__{rank}.metadata` files merged, or the
/// `DCP_SHARDING_INFO` headers of Hugging Face storage), or of a DeepSpeed checkpoint (its
/// pickles: stage, dtype, world size, tag, parameters and their states). A lone file of a
/// DeepSpeed checkpoint, recognised by its name, is read with DeepSpeed's three inert
/// globals allowed. A Megatron-Core checkpoint is described from its metadata: tree,
/// iteration, layers, optimizer layout and every model tensor.
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
            Input::Megatron => {
                let ckpt = io::megatron::MegatronCheckpoint::open(path)?;
                return Ok(Inspection::Megatron(ckpt.summary()));
            }
            found => return Err(wrong_input(
                "inspect",
                path,
                "a DCP directory, a checkpoint of this crate, a DeepSpeed checkpoint, a Hugging Face model directory, or a torch.save or safetensors file",
                found,
            )),
        };
    let summary = step(p, &format!("reading {}", path.display()), || {
        Ok(match format {
            FileFormat::TorchSave if super::deepspeed_file(path) => {
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
