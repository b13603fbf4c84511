//! Megatron-Core checkpoints in the `torch_dist` format (`dist_checkpointing.save`), read
//! without Megatron: what Megatron-LM, NeMo 2 and Megatron-Bridge save.
//!
//! # What the files hold
//!
//! (Measured with megatron-core 0.19.2 and 0.16.1 on torch 2.13; the fixtures and the full
//! account are in `tests/golden/megatron/`, `FORMAT.md`.)
//!
//! * **The directory** is a DCP directory ([`crate::io::dcp`]: `.metadata`, `__R_K.distcp`)
//!   plus `metadata.json`, `{"sharded_backend": "torch_dist", "sharded_backend_version": 1,
//!   …}`. Its `.metadata` keeps every rank's save plan (`Metadata.all_local_plans`), which
//!   the DCP reader reads past. 0.16 writes the non-tensor state to `common.pt` (and names
//!   `common_backend` in `metadata.json`); 0.19 keeps it inside the checkpoint as the bytes
//!   item `common_state/shard_0_1`. Any other `sharded_backend` (the legacy `zarr`) is
//!   refused by name.
//! * **A Megatron-LM tree** holds `latest_checkpointed_iteration.txt` (the iteration, or
//!   `release`) beside `iter_NNNNNNN/` (seven digits) or `release/`, the `torch_dist`
//!   directory; **a Megatron-Bridge / NeMo 2 tree** is the same with `latest_train_state.pt`
//!   beside it and `train_state.pt`, `run_config.yaml` inside. Either root, or the `torch_dist`
//!   directory itself, opens.
//! * **Model tensors** are the tensor keys outside `optimizer.`: transformer layers stacked
//!   along a leading dimension (`decoder.layers.self_attention.linear_qkv.weight` is `[L, …]`,
//!   each layer its own chunk, each pipeline stage writing its layers at their global index),
//!   tensor-parallel pieces as chunks of the one global tensor. `*._extra_state/shard_…`
//!   bytes items belong to the layers and are not tensors.
//! * **The optimizer layout** is Megatron's `distrib_optim_sharding_type`, told by its keys
//!   ([`OptimLayout`]).
//!
//! # What this module does
//!
//! [`MegatronCheckpoint::open`] finds the `torch_dist` directory from any of the three roots,
//! checks `metadata.json`, and opens the DCP directory; [`MegatronCheckpoint::summary`]
//! describes it from the metadata alone; [`MegatronCheckpoint::model_tensors`] is the DCP
//! directory narrowed to the model tensors, which the consolidation streams as any DCP
//! directory's (`fsdp-ckpt consolidate ROOT OUT.pt`: exactly the model-tensor keys of
//! `dcp_to_torch_save`'s output, bit for bit).

use crate::error::{Error, Result};
use crate::io::dcp::{DcpCheckpoint, Entry, EntryKind, TensorMeta};
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The file that marks a `torch_dist` directory.
pub const BACKEND_FILE: &str = "metadata.json";
/// The file of a Megatron-LM (or Bridge) tree naming its latest iteration.
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";

/// The prefix of every optimizer key.
const OPTIMIZER: &str = "optimizer.";

/// Which tree the checkpoint was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tree {
    /// The `torch_dist` directory itself.
    Directory,
    /// A Megatron-LM tree (`latest_checkpointed_iteration.txt`, `iter_NNNNNNN/`).
    MegatronLm,
    /// A Megatron-Bridge / NeMo 2 tree (the Megatron-LM files plus `latest_train_state.pt`).
    Bridge,
}

/// How the optimizer state is laid out (Megatron's `distrib_optim_sharding_type`), told by
/// the checkpoint's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimLayout {
    /// No optimizer state was saved.
    None,
    /// The plain (not distributed) optimizer: `optimizer.state.{exp_avg,exp_avg_sq}.<model
    /// key>` shaped like the model tensor, and `optimizer.state.fp32_param.<model key>` for
    /// a 16-bit model.
    Plain,
    /// `fully_reshardable`: the plain layout plus the fp32 master `optimizer.state.param.<model
    /// key>`.
    FullyReshardable,
    /// `dp_reshardable` (Megatron-LM's default): flat buckets per data-parallel group, grad
    /// buffer and dtype, `optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<j>.dtype_(…).
    /// bucket_idx_<k>.{param,exp_avg,exp_avg_sq}`.
    DpReshardable,
    /// `dp_zero_gather_scatter`: one `torch.save`d bytes item per data-parallel group
    /// (`optimizer.distributed.dp_group_idx_<i>.param_state/shard_0_1`).
    DpZeroGatherScatter,
}

impl OptimLayout {
    /// Megatron's name for it (`distrib_optim_sharding_type`, or `plain`, `none`).
    pub fn name(self) -> &'static str {
        match self {
            OptimLayout::None => "none",
            OptimLayout::Plain => "plain",
            OptimLayout::FullyReshardable => "fully_reshardable",
            OptimLayout::DpReshardable => "dp_reshardable",
            OptimLayout::DpZeroGatherScatter => "dp_zero_gather_scatter",
        }
    }

    /// The layout the keys of a checkpoint show.
    fn of_keys<'k>(keys: impl Iterator<Item = &'k str>) -> OptimLayout {
        let mut layout = OptimLayout::None;
        for k in keys {
            let Some(rest) = k.strip_prefix(OPTIMIZER) else {
                continue;
            };
            let found = if rest.starts_with("distributed.") && rest.contains(".bucket_idx_") {
                OptimLayout::DpReshardable
            } else if rest.starts_with("distributed.") && rest.contains(".param_state/") {
                OptimLayout::DpZeroGatherScatter
            } else if rest.starts_with("state.param.") {
                OptimLayout::FullyReshardable
            } else if rest.starts_with("state.") {
                OptimLayout::Plain
            } else {
                continue;
            };
            // The master copy decides between the two model-space layouts.
            if layout == OptimLayout::None || found == OptimLayout::FullyReshardable {
                layout = found;
            }
        }
        layout
    }
}

/// One model tensor of a summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelTensor {
    /// The Megatron key (`decoder.layers.mlp.linear_fc1.weight`).
    pub key: String,
    /// PyTorch's dtype name without `torch.`.
    pub dtype: String,
    /// The global shape.
    pub shape: Vec<usize>,
    /// How many chunks it was saved in.
    pub chunks: usize,
}

/// What a Megatron-Core checkpoint holds, from its metadata alone.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MegatronSummary {
    /// The path given.
    pub checkpoint: String,
    /// `megatron`.
    pub format: &'static str,
    /// The tree it was found in.
    pub tree: Tree,
    /// The `torch_dist` directory.
    pub directory: String,
    /// The iteration `latest_checkpointed_iteration.txt` names (`None` for `release` or a
    /// bare directory).
    pub iteration: Option<u64>,
    /// `sharded_backend_version` of `metadata.json`.
    pub backend_version: Option<i64>,
    /// Where the common (non-sharded) state is: `common.pt` (megatron-core up to 0.16) or the
    /// `common_state` bytes item (later versions).
    pub common_state: &'static str,
    /// The world size that saved it: the number of save plans `.metadata` keeps (one per
    /// rank), or else one more than the highest rank in the data files' names (ranks whose
    /// every tensor was a replica write no file).
    pub world_size: Option<usize>,
    /// The number of transformer layers (the leading dimension of the stacked layer tensors).
    pub layers: Option<usize>,
    /// The optimizer layout.
    pub optimizer: OptimLayout,
    /// The optimizer's per-parameter states found (`exp_avg`, `exp_avg_sq`, `param`, …).
    pub optimizer_states: Vec<String>,
    /// Every model tensor, in metadata order.
    pub model_tensors: Vec<ModelTensor>,
    /// Total bytes of the model tensors (global shapes).
    pub model_bytes: u64,
}

/// A Megatron-Core `torch_dist` checkpoint, opened.
pub struct MegatronCheckpoint {
    given: PathBuf,
    tree: Tree,
    iteration: Option<u64>,
    backend_version: Option<i64>,
    dcp: DcpCheckpoint,
}

/// Whether `dir` holds the marker of a Megatron checkpoint root:
/// `latest_checkpointed_iteration.txt`, or `metadata.json` naming a `sharded_backend`. A
/// `metadata.json` that cannot be read as one still marks a Megatron directory when a DCP
/// `.metadata` lies beside it (so that opening it says what is wrong with it); elsewhere it
/// is some other program's file, and marks nothing.
pub fn recognize_dir(dir: &Path) -> Result<bool> {
    if exists(&dir.join(LATEST_FILE)) {
        return Ok(true);
    }
    let marker = dir.join(BACKEND_FILE);
    if !exists(&marker) {
        return Ok(false);
    }
    Ok(match backend_json(&marker) {
        Ok(json) => json.contains_key("sharded_backend"),
        Err(_) => exists(&dir.join(".metadata")),
    })
}

/// The `torch_dist` directory of the checkpoint at `path` (its tree followed, its
/// `metadata.json` checked), without reading the DCP metadata.
pub fn directory_of(path: &Path) -> Result<PathBuf> {
    Ok(torch_dist_dir(path)?.2)
}

/// The tree, iteration and `torch_dist` directory of `path`, with the directory's
/// `sharded_backend_version`, once its `metadata.json` is checked.
fn torch_dist_dir(path: &Path) -> Result<(Tree, Option<u64>, PathBuf, Option<i64>)> {
    let (tree, iteration, dir) = resolve_tree(path)?;
    let backend = backend_json(&dir.join(BACKEND_FILE))?;
    let version = check_backend(&dir, &backend)?;
    Ok((tree, iteration, dir, version))
}

impl MegatronCheckpoint {
    /// Opens the checkpoint at `path`: a `torch_dist` directory, or the root of a
    /// Megatron-LM or Bridge tree (its `latest_checkpointed_iteration.txt` followed).
    pub fn open(path: &Path) -> Result<Self> {
        let (tree, iteration, dir, version) = torch_dist_dir(path)?;
        let dcp = DcpCheckpoint::open(&dir)?;
        Ok(MegatronCheckpoint {
            given: path.to_path_buf(),
            tree,
            iteration,
            backend_version: version,
            dcp,
        })
    }

    /// The `torch_dist` directory.
    pub fn directory(&self) -> &Path {
        self.dcp.dir()
    }

    /// The optimizer layout its keys show.
    pub fn optim_layout(&self) -> OptimLayout {
        OptimLayout::of_keys(self.dcp.metadata().entries.iter().map(|e| e.key.as_str()))
    }

    /// The DCP directory narrowed to the model tensors (every tensor key outside
    /// `optimizer.`): what `consolidate` writes.
    pub fn model_tensors(self) -> DcpCheckpoint {
        self.dcp.retaining(is_model_tensor)
    }

    /// The model tensors' entries, in metadata order.
    fn model_entries(&self) -> impl Iterator<Item = (&Entry, &TensorMeta)> {
        self.dcp
            .metadata()
            .entries
            .iter()
            .filter_map(|e| match &e.kind {
                EntryKind::Tensor(t) if is_model_tensor(e) => Some((e, t)),
                _ => None,
            })
    }

    /// Total bytes of the model tensors (global shapes): what `consolidate` writes.
    pub fn model_bytes(&self) -> u64 {
        self.model_entries().fold(0u64, |sum, (_, t)| {
            let elems: u64 = t.size.iter().map(|&d| d as u64).product();
            let width = t.dtype().map_or(0, |d| d.size() as u64);
            sum.saturating_add(elems.saturating_mul(width))
        })
    }

    /// A summary from the metadata alone.
    pub fn summary(&self) -> MegatronSummary {
        let md = self.dcp.metadata();
        let model_tensors: Vec<ModelTensor> = self
            .model_entries()
            .map(|(e, t)| ModelTensor {
                key: e.key.clone(),
                dtype: t.dtype.clone(),
                shape: t.size.clone(),
                chunks: t.chunks.len(),
            })
            .collect();
        let layers = model_tensors
            .iter()
            .filter(|t| t.key.starts_with("decoder.layers."))
            .filter_map(|t| t.shape.first().copied())
            .max();
        let common_state = if self.dcp.entry("common_state/shard_0_1").is_some() {
            "common_state item"
        } else {
            "common.pt"
        };
        MegatronSummary {
            checkpoint: self.given.display().to_string(),
            format: "megatron",
            tree: self.tree,
            directory: self.directory().display().to_string(),
            iteration: self.iteration,
            backend_version: self.backend_version,
            common_state,
            world_size: md.saved_plans.or_else(|| self.dcp.world_size()),
            layers,
            optimizer: self.optim_layout(),
            optimizer_states: optimizer_states(md.entries.iter().map(|e| e.key.as_str())),
            model_tensors,
            model_bytes: self.model_bytes(),
        }
    }
}

impl std::fmt::Display for MegatronSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tree = match self.tree {
            Tree::Directory => "torch_dist directory",
            Tree::MegatronLm => "Megatron-LM tree",
            Tree::Bridge => "Megatron-Bridge tree",
        };
        writeln!(f, "Megatron-Core checkpoint: {} ({tree})", self.checkpoint)?;
        if self.directory != self.checkpoint {
            writeln!(f, "torch_dist directory: {}", self.directory)?;
        }
        if let Some(i) = self.iteration {
            writeln!(f, "iteration {i}")?;
        }
        let or_unknown = |v: Option<usize>| v.map_or("?".to_string(), |v| v.to_string());
        writeln!(
            f,
            "backend torch_dist (version {}), common state in {}",
            self.backend_version
                .map_or("?".to_string(), |v| v.to_string()),
            self.common_state
        )?;
        writeln!(
            f,
            "world size {}, {} layers, {} model tensors, {} bytes",
            or_unknown(self.world_size),
            or_unknown(self.layers),
            self.model_tensors.len(),
            self.model_bytes
        )?;
        let states = if self.optimizer_states.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.optimizer_states.join(", "))
        };
        writeln!(f, "optimizer: {}{states}", self.optimizer.name())?;
        writeln!(f, "model tensors:")?;
        for t in &self.model_tensors {
            writeln!(
                f,
                "  {} torch.{} {:?} ({} chunks)",
                t.key, t.dtype, t.shape, t.chunks
            )?;
        }
        Ok(())
    }
}

/// Whether a DCP entry is a model tensor: a tensor whose key is outside `optimizer.`.
fn is_model_tensor(e: &Entry) -> bool {
    matches!(e.kind, EntryKind::Tensor(_)) && !e.key.starts_with(OPTIMIZER)
}

/// The per-parameter state names the optimizer keys show: `optimizer.state.<state>.<key>`
/// in the model-space layouts, the bucket suffix `.{param,exp_avg,exp_avg_sq}` in
/// `dp_reshardable`.
fn optimizer_states<'k>(keys: impl Iterator<Item = &'k str>) -> Vec<String> {
    let mut states = BTreeSet::new();
    for k in keys {
        let Some(rest) = k.strip_prefix(OPTIMIZER) else {
            continue;
        };
        if let Some(s) = rest.strip_prefix("state.") {
            if let Some((state, _)) = s.split_once('.') {
                states.insert(state.to_string());
            }
        } else if rest.contains(".bucket_idx_") {
            if let Some((_, state)) = rest.rsplit_once('.') {
                states.insert(state.to_string());
            }
        }
    }
    states.into_iter().collect()
}

/// Whether `p` names an entry of any kind (symbolic links not followed).
fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

/// The `torch_dist` directory of `path`, with the tree it was found in and the iteration.
fn resolve_tree(path: &Path) -> Result<(Tree, Option<u64>, PathBuf)> {
    let latest = path.join(LATEST_FILE);
    if !exists(&latest) {
        return Ok((Tree::Directory, None, path.to_path_buf()));
    }
    let text = crate::storage::read_small_file(&latest)?;
    let text = String::from_utf8_lossy(&text);
    let named = text.trim();
    let (iteration, sub) = match named {
        "release" => (None, "release".to_string()),
        n => match n.parse::<u64>() {
            Ok(i) => (Some(i), format!("iter_{i:07}")),
            Err(_) => {
                return Err(megatron(
                    path,
                    format!(
                        "`{LATEST_FILE}` holds `{}`, which is neither an iteration number nor `release`",
                        crate::error::shown(named)
                    ),
                ))
            }
        },
    };
    let dir = path.join(&sub);
    if !dir.is_dir() {
        return Err(megatron(
            path,
            format!("`{LATEST_FILE}` names `{sub}`, but there is no directory `{sub}` beside it"),
        ));
    }
    let bridge = exists(&path.join("latest_train_state.pt"));
    let tree = if bridge {
        Tree::Bridge
    } else {
        Tree::MegatronLm
    };
    Ok((tree, iteration, dir))
}

/// `metadata.json` as a JSON object.
fn backend_json(file: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let dir = file.parent().unwrap_or(file);
    if !exists(file) {
        return Err(megatron(
            dir,
            format!(
                "no `{BACKEND_FILE}`: this is not a Megatron-Core distributed checkpoint directory"
            ),
        ));
    }
    let bytes = crate::storage::read_small_file(file)?;
    match serde_json::from_slice(&bytes) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err(megatron(
            dir,
            format!("`{BACKEND_FILE}` is not a JSON object"),
        )),
        Err(e) => Err(megatron(dir, format!("`{BACKEND_FILE}` is not JSON: {e}"))),
    }
}

/// Checks `metadata.json`'s backend: `torch_dist` is read; `zarr` and any other is refused
/// by name. Returns `sharded_backend_version`.
fn check_backend(
    dir: &Path,
    backend: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<i64>> {
    match backend.get("sharded_backend").and_then(|v| v.as_str()) {
        Some("torch_dist") => Ok(backend
            .get("sharded_backend_version")
            .and_then(|v| v.as_i64())),
        Some("zarr") => Err(megatron(
            dir,
            "its `sharded_backend` is `zarr`, Megatron-Core's legacy backend, which this tool does not read: load it with Megatron-Core and save it again with the `torch_dist` backend".to_string(),
        )),
        Some(other) => Err(megatron(
            dir,
            format!(
                "its `sharded_backend` is `{}`; this tool reads `torch_dist` only",
                crate::error::shown(other)
            ),
        )),
        None => Err(megatron(
            dir,
            format!("`{BACKEND_FILE}` names no `sharded_backend` string"),
        )),
    }
}

fn megatron(dir: &Path, reason: String) -> Error {
    Error::Megatron {
        dir: dir.display().to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_optimizer_layout_is_told_by_its_keys() {
        let of = |keys: &[&str]| OptimLayout::of_keys(keys.iter().copied());
        assert_eq!(of(&["embedding.word_embeddings.weight"]), OptimLayout::None);
        assert_eq!(
            of(&["optimizer.state.exp_avg.a", "optimizer.state.exp_avg_sq.a"]),
            OptimLayout::Plain
        );
        assert_eq!(
            of(&["optimizer.state.exp_avg.a", "optimizer.state.param.a"]),
            OptimLayout::FullyReshardable
        );
        assert_eq!(
            of(&["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param"]),
            OptimLayout::DpReshardable
        );
        assert_eq!(
            of(&["optimizer.distributed.dp_group_idx_0.param_state/shard_0_1"]),
            OptimLayout::DpZeroGatherScatter
        );
    }
}
