//! What `fsdp-ckpt inspect DIR` shows of a sharded checkpoint: a typed summary of its manifest.

use super::manifest::read_manifest;
use crate::error::Result;
use serde::Serialize;
use std::fmt;
use std::path::Path;

/// One data file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankFileSummary {
    /// The file name inside the checkpoint directory.
    pub name: String,
    /// Its length in bytes.
    pub bytes: u64,
}

/// A sharded checkpoint at a glance, from its manifest alone: the manifest, commit marker and
/// file lengths are checked, data checksums are not (`data_checksums_verified` is `false`;
/// [`super::verify`] reads every block).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointSummary {
    /// The checkpoint directory, as given.
    pub checkpoint: String,
    /// The format name of the manifest.
    pub format: String,
    /// The format version.
    pub version: u32,
    /// The world size it was saved at.
    pub world_size: usize,
    /// The FSDP units of its wrapping.
    pub units: Vec<String>,
    /// Whether it was saved with `use_orig_params`.
    pub use_orig_params: bool,
    /// `name` or `id`: how the saving optimizer keyed its state.
    pub key_type: String,
    /// The data files.
    pub files: Vec<RankFileSummary>,
    /// Parameters with optimizer state.
    pub params_with_state: usize,
    /// Bytes of tensor state.
    pub tensor_bytes: u64,
    /// Number of param groups.
    pub param_groups: usize,
    /// Keys of user-defined state.
    pub user_state_keys: usize,
    /// Model parameters stored beside the optimizer state.
    pub model_params: usize,
    /// Their bytes.
    pub model_param_bytes: u64,
    /// Always `false`: a summary does not read the data.
    pub data_checksums_verified: bool,
}

impl CheckpointSummary {
    /// The summary of the checkpoint in `dir` (reads its manifest; see [`super::read_manifest`]).
    pub fn of_dir(dir: &Path) -> Result<Self> {
        let m = read_manifest(dir)?;
        Ok(CheckpointSummary {
            checkpoint: dir.display().to_string(),
            format: m.format.clone(),
            version: m.version,
            world_size: m.world_size,
            units: m.policy.units.clone(),
            use_orig_params: m.policy.use_orig_params,
            key_type: if m.named { "name" } else { "id" }.into(),
            files: m
                .files
                .iter()
                .map(|f| RankFileSummary {
                    name: f.name.clone(),
                    bytes: f.len,
                })
                .collect(),
            params_with_state: m.params.len(),
            tensor_bytes: m.tensor_bytes(),
            param_groups: m.param_groups.as_ref().map_or(0, Vec::len),
            user_state_keys: m.user_state.len(),
            model_params: m.model_params.len(),
            model_param_bytes: m.model_param_bytes(),
            data_checksums_verified: false,
        })
    }
}

impl fmt::Display for CheckpointSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "checkpoint: {} ({} v{})",
            self.checkpoint, self.format, self.version
        )?;
        writeln!(
            f,
            "world size {}, units {:?}, use_orig_params {}, keys by {}",
            self.world_size, self.units, self.use_orig_params, self.key_type
        )?;
        writeln!(
            f,
            "{} parameters with state, {} bytes of tensor state in {} files, {} param groups, {} user state keys",
            self.params_with_state,
            self.tensor_bytes,
            self.files.len(),
            self.param_groups,
            self.user_state_keys
        )?;
        if self.model_params > 0 {
            writeln!(
                f,
                "model parameters: {} ({} bytes)",
                self.model_params, self.model_param_bytes
            )?;
        }
        write!(
            f,
            "data checksums: not checked (manifest, commit marker and file lengths only; run `fsdp-ckpt verify {}`)",
            self.checkpoint
        )
    }
}
