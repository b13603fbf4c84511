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
/// The largest `manifest.json` a reader accepts (a manifest lists every piece of every
/// tensor state with a checksum per 4 MiB block: 1 GiB covers any realistic model).
pub const MANIFEST_MAX_BYTES: u64 = 1 << 30;
/// Each piece's checksums cover blocks of this many bytes, so a reader that needs part of a
/// piece verifies only the blocks it reads.
pub(crate) const CHECKSUM_BLOCK: usize = 4 << 20;

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
    /// state `param` holds the value, stored like optimizer state. Empty for an
    /// optimizer-only checkpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_params: Vec<ParamRecord>,
}

/// The state name under which [`Manifest::model_params`] records hold a parameter's value.
pub(crate) const MODEL_PARAM_STATE: &str = "param";

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
    /// CRC-32C of each 4 MiB (`CHECKSUM_BLOCK`) block of the piece's bytes (the last one
    /// shorter).
    pub crc32c: Vec<u32>,
}

/// Checksums of `bytes` block by block, as stored in [`Piece::crc32c`].
pub(crate) fn block_checksums(bytes: &[u8]) -> Vec<u32> {
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
    use crate::storage::{read_regular, ReadRegularError};
    // Regular files only, length capped: a FIFO would block and `/dev/zero` never ends.
    let commit = read_regular(&dir.join(COMMIT), 4096).map_err(|e| match e {
        ReadRegularError::Io(e) => invalid(format!(
            "no readable commit marker `{COMMIT}` ({e}): the checkpoint is missing or was never completed"
        )),
        other => invalid(format!("commit marker `{COMMIT}`: {other}")),
    })?;
    let commit = String::from_utf8_lossy(&commit).into_owned();
    let bytes = read_regular(&dir.join(MANIFEST), MANIFEST_MAX_BYTES)
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

/// Checkpoint directories as outputs: what a writer may replace
/// ([`crate::storage::check_dir_output`]).
pub const CHECKPOINT_DIR: crate::storage::DirKind = crate::storage::DirKind {
    what: "a committed checkpoint of this crate",
    entries: committed_entries,
};

/// The entries a committed checkpoint in `dir` consists of (`COMMITTED`, `manifest.json` and
/// the data files the manifest names), or why it is not one. Data files are not read.
fn committed_entries(dir: &Path) -> std::result::Result<Vec<std::ffi::OsString>, String> {
    use crate::storage::read_regular;
    let commit = read_regular(&dir.join(COMMIT), 4096).map_err(|e| format!("`{COMMIT}`: {e}"))?;
    let bytes = read_regular(&dir.join(MANIFEST), MANIFEST_MAX_BYTES)
        .map_err(|e| format!("`{MANIFEST}`: {e}"))?;
    if commit != commit_text(&bytes).as_bytes() {
        return Err(format!("`{COMMIT}` does not match `{MANIFEST}`"));
    }
    let m: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| format!("`{MANIFEST}` does not parse: {e}"))?;
    if m.format != FORMAT {
        return Err(format!("`{MANIFEST}` has format `{}`", m.format));
    }
    let mut names: Vec<std::ffi::OsString> = vec![COMMIT.into(), MANIFEST.into()];
    for f in &m.files {
        let plain = crate::storage::check_name(&f.name, crate::storage::NameForm::Plain);
        if plain.is_some() || f.name.starts_with('.') {
            return Err(format!("`{MANIFEST}` names the file `{}`", f.name));
        }
        names.push(f.name.clone().into());
    }
    Ok(names)
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
        self.check_files(dir, &invalid)?;
        self.check_against_model(&d)?;
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

    /// Every data file: a plain name, a regular file of the recorded length, a header that
    /// fits in it. The real length bounds every allocation a load makes from this manifest.
    fn check_files(&self, dir: &Path, invalid: &dyn Fn(String) -> Error) -> Result<()> {
        for (rank, f) in self.files.iter().enumerate() {
            let plain = crate::storage::check_name(&f.name, crate::storage::NameForm::Plain);
            if let Some(why) = plain.or(f.name.starts_with('.').then_some("it starts with `.`")) {
                return Err(invalid(format!(
                    "data file name `{}` is not plain: {why}",
                    crate::error::shown(&f.name)
                )));
            }
            // The real length bounds every allocation a load makes from this manifest.
            let path = dir.join(&f.name);
            let corrupt = |reason: String| Error::CheckpointCorrupt {
                file: path.display().to_string(),
                rank,
                tensor: "(file)".into(),
                reason,
            };
            let len = crate::storage::regular_len(&path).map_err(|e| match e {
                crate::storage::ReadRegularError::Io(e) => corrupt(format!("cannot open: {e}")),
                other => corrupt(other.to_string()),
            })?;
            if len != f.len {
                return Err(corrupt(format!(
                    "the file has {len} bytes, the manifest says {} (truncated or replaced)",
                    f.len
                )));
            }
            if f.header_len > f.len {
                return Err(corrupt(format!(
                    "the manifest gives a header of {} bytes for a file of {} bytes",
                    f.header_len, f.len
                )));
            }
        }
        Ok(())
    }

    /// Every record against the saved model: no parameter listed twice, none the model lacks,
    /// every tensor state shaped like its parameter (what a reshard or load relies on).
    fn check_against_model(&self, dir: &str) -> Result<()> {
        let invalid = |reason: String| Error::CheckpointInvalid {
            dir: dir.to_string(),
            reason,
        };
        let index: std::collections::HashMap<String, usize> =
            self.model.names_with_aliases().into_iter().collect();
        for (records, what) in [
            (&self.params, "params"),
            (&self.model_params, "model_params"),
        ] {
            let mut seen = std::collections::HashSet::new();
            for p in records {
                let i = *index.get(&p.name).ok_or_else(|| {
                    invalid(format!(
                        "`{what}` holds state for `{}`, which the saved model lacks",
                        p.name
                    ))
                })?;
                if !seen.insert(i) {
                    return Err(invalid(format!(
                        "`{what}` lists the parameter `{}` twice",
                        p.name
                    )));
                }
                let spec = &self.model.params[i];
                for (state, v) in &p.states {
                    if let StoredValue::Tensor { shape, .. } = v {
                        if *shape != spec.shape {
                            return Err(invalid(format!(
                                "state `{state}` of `{}` has shape {shape:?}, but the saved model gives the parameter shape {:?}",
                                p.name, spec.shape
                            )));
                        }
                    }
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
