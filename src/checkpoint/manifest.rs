//! The manifest of a sharded checkpoint: what every byte range of every rank file holds.

use crate::error::{Error, Result};
use crate::model::{ModelDesc, WrapPolicy};
use crate::optim_state::{ParamGroup, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// `format` field of every manifest.
pub const FORMAT: &str = "fsdp-sharded-optim-state";
/// Current format version; a reader refuses other versions.
pub const VERSION: u32 = 1;
/// File name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// File name of the commit marker: present only in a complete checkpoint.
pub const COMMIT: &str = "COMMITTED";
/// Each piece's checksums cover blocks of this many bytes, so a reader that needs part of a
/// piece verifies only the blocks it reads.
pub const CHECKSUM_BLOCK: usize = 4 << 20;

/// Everything about a checkpoint except the tensor bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`] of the writer.
    pub version: u32,
    /// The model the state belongs to.
    pub model: ModelDesc,
    /// The wrapping policy it was saved under.
    pub policy: WrapPolicy,
    /// Shard-group size it was saved at.
    pub world_size: usize,
    /// Whether the saving optimizer keyed its state by parameter name (a named optimizer)
    /// rather than by id.
    pub named: bool,
    /// One data file per saving rank, index = rank.
    pub files: Vec<FileRecord>,
    /// Every parameter with state, keyed by the name that keys its state in a full dict, in
    /// the order `full_optim_state_dict` returns them.
    pub params: Vec<ParamRecord>,
    /// The param groups, keyed by parameter names as in a full dict.
    pub param_groups: Option<Vec<ParamGroup<HostTensor>>>,
    /// User-defined state (keys no parameter owns), stored inline.
    pub user_state: Vec<(ParamKey, ParamState<HostTensor>)>,
    /// The model's parameter values, when the saver handed them over
    /// ([`crate::Fsdp::save_checkpoint`]): one record per parameter in model order, whose one
    /// state [`MODEL_PARAM_STATE`] holds the value, stored like optimizer state. Empty for an
    /// optimizer-only checkpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_params: Vec<ParamRecord>,
}

/// The state name under which [`Manifest::model_params`] records hold a parameter's value.
pub const MODEL_PARAM_STATE: &str = "param";

/// One rank's data file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// File name inside the checkpoint directory (`rank{r}.safetensors`).
    pub name: String,
    /// Length in bytes.
    pub len: u64,
    /// Length of the safetensors header (length prefix included); data starts here.
    pub header_len: u64,
    /// CRC-32C of the header bytes.
    pub header_crc32c: u32,
}

/// The state of one parameter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamRecord {
    /// The name keying the parameter's state.
    pub name: String,
    /// Its state values, in the saving optimizer's order.
    pub states: Vec<(String, StoredValue)>,
}

/// One state value of a parameter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StoredValue {
    /// A 0-dim tensor or a plain value, stored inline.
    Value(Value<HostTensor>),
    /// A parameter-shaped tensor, stored as pieces in the rank files.
    Tensor {
        /// Element type.
        dtype: DType,
        /// The parameter's shape.
        shape: Vec<usize>,
        /// Pieces sorted by `start`, covering the flattened tensor exactly once.
        pieces: Vec<Piece>,
    },
}

/// Elements `[start, start + len)` of a flattened tensor state, stored contiguously.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Index of the data file ([`Manifest::files`]).
    pub file: usize,
    /// First element.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
    /// Byte offset of the first element in the file.
    pub offset: u64,
    /// CRC-32C of each [`CHECKSUM_BLOCK`]-byte block of the piece's bytes (the last one
    /// shorter).
    pub crc32c: Vec<u32>,
}

/// Checksums of `bytes` block by block, as stored in [`Piece::crc32c`].
pub fn block_checksums(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(CHECKSUM_BLOCK).map(crc32c::crc32c).collect()
}

/// The commit marker's contents for a manifest: format, version and the manifest's checksum.
pub(super) fn commit_text(manifest_bytes: &[u8]) -> String {
    format!(
        "{FORMAT} {VERSION} manifest-crc32c={:08x}\n",
        crc32c::crc32c(manifest_bytes)
    )
}

/// Reads and checks the manifest of the committed checkpoint in `dir`: the commit marker must
/// exist and match the manifest's bytes, and format and version must be this crate's.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let d = dir.display().to_string();
    let invalid = |reason: String| Error::CheckpointInvalid {
        dir: d.clone(),
        reason,
    };
    let commit = std::fs::read_to_string(dir.join(COMMIT)).map_err(|e| {
        invalid(format!(
            "no readable commit marker `{COMMIT}` ({e}): the checkpoint is missing or was never completed"
        ))
    })?;
    let bytes = std::fs::read(dir.join(MANIFEST))
        .map_err(|e| invalid(format!("cannot read `{MANIFEST}`: {e}")))?;
    if commit != commit_text(&bytes) {
        return Err(invalid(format!(
            "`{MANIFEST}` does not match the commit marker (`{}`): the manifest is corrupt",
            commit.trim()
        )));
    }
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(format!("`{MANIFEST}` is not a valid manifest: {e}")))?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(invalid(format!(
            "format `{}` version {} is not `{FORMAT}` version {VERSION}",
            m.format, m.version
        )));
    }
    m.check(dir)?;
    Ok(m)
}

impl Manifest {
    /// Internal consistency: pieces inside their files, sorted, covering each tensor once,
    /// checksum counts right, the layout computable.
    pub fn check(&self, dir: &Path) -> Result<()> {
        let d = dir.display().to_string();
        let invalid = |reason: String| Error::CheckpointInvalid {
            dir: d.clone(),
            reason,
        };
        if self.files.len() != self.world_size {
            return Err(invalid(format!(
                "{} data files for world size {}",
                self.files.len(),
                self.world_size
            )));
        }
        crate::flat_param::ModelLayout::new(&self.model, &self.policy, self.world_size.max(1))
            .map_err(|e| invalid(format!("the saved model and policy are invalid: {e}")))?;
        for (rank, f) in self.files.iter().enumerate() {
            if f.name.contains('/') || f.name.contains('\\') || f.name.starts_with('.') {
                return Err(invalid(format!("data file name `{}` is not plain", f.name)));
            }
            // The real length bounds every allocation a load makes from this manifest.
            let path = dir.join(&f.name);
            let len = std::fs::metadata(&path).map(|m| m.len()).map_err(|e| {
                Error::CheckpointCorrupt {
                    file: path.display().to_string(),
                    rank,
                    tensor: "(file)".into(),
                    reason: format!("cannot open: {e}"),
                }
            })?;
            if len != f.len || f.header_len > f.len {
                return Err(Error::CheckpointCorrupt {
                    file: path.display().to_string(),
                    rank,
                    tensor: "(file)".into(),
                    reason: format!(
                        "the file has {len} bytes, the manifest says {} (truncated or replaced)",
                        f.len
                    ),
                });
            }
        }
        for p in self.params.iter().chain(&self.model_params) {
            for (state, v) in &p.states {
                let StoredValue::Tensor {
                    dtype,
                    shape,
                    pieces,
                } = v
                else {
                    continue;
                };
                let what = || format!("state `{state}` of `{}`", p.name);
                let numel = shape
                    .iter()
                    .try_fold(1usize, |a, &d| a.checked_mul(d))
                    .ok_or_else(|| invalid(format!("{}: shape {shape:?} overflows", what())))?;
                let mut next = 0usize;
                for piece in pieces {
                    if piece.start != next {
                        return Err(invalid(format!(
                            "{}: pieces do not tile the tensor (a piece starts at element {} where {next} was expected)",
                            what(),
                            piece.start
                        )));
                    }
                    next = piece
                        .start
                        .checked_add(piece.len)
                        .ok_or_else(|| invalid(format!("{}: piece overflows", what())))?;
                    let file = self.files.get(piece.file).ok_or_else(|| {
                        invalid(format!("{}: piece in unknown file {}", what(), piece.file))
                    })?;
                    let bytes = piece
                        .len
                        .checked_mul(dtype.size())
                        .and_then(|b| u64::try_from(b).ok())
                        .and_then(|b| b.checked_add(piece.offset))
                        .filter(|&end| end <= file.len)
                        .map(|end| end - piece.offset);
                    let Some(bytes) = bytes else {
                        return Err(invalid(format!(
                            "{}: piece at byte {} of `{}` runs past its end ({} bytes)",
                            what(),
                            piece.offset,
                            file.name,
                            file.len
                        )));
                    };
                    let blocks = usize::try_from(bytes)
                        .unwrap_or(usize::MAX)
                        .div_ceil(CHECKSUM_BLOCK);
                    if piece.crc32c.len() != blocks {
                        return Err(invalid(format!(
                            "{}: {} checksums for {blocks} blocks",
                            what(),
                            piece.crc32c.len()
                        )));
                    }
                }
                if next != numel {
                    return Err(invalid(format!(
                        "{}: pieces cover {next} of {numel} elements",
                        what()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Total bytes of optimizer tensor state.
    pub fn tensor_bytes(&self) -> u64 {
        record_bytes(&self.params)
    }

    /// Total bytes of model parameter values ([`Manifest::model_params`]).
    pub fn model_param_bytes(&self) -> u64 {
        record_bytes(&self.model_params)
    }
}

fn record_bytes(records: &[ParamRecord]) -> u64 {
    records
        .iter()
        .flat_map(|p| &p.states)
        .map(|(_, v)| match v {
            StoredValue::Tensor { dtype, pieces, .. } => {
                pieces.iter().map(|p| (p.len * dtype.size()) as u64).sum()
            }
            StoredValue::Value(_) => 0,
        })
        .sum()
}
