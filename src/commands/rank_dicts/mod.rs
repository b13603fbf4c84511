//! Per-rank optimizer state dicts transformed in one process, without a distributed job:
//! consolidation of every rank's local dict into the full dict, and sharding of a full dict
//! into every rank's local dict. What the commands `consolidate-torch`, `consolidate-sharded`
//! and `shard-torch` ([`crate::commands`]) run.
//!
//! * [`consolidate_local_dicts`] runs the crate's own [`Fsdp::full_optim_state_dict`] over
//!   in-process thread ranks ([`ThreadGroup`]), one thread per rank file, so the result is
//!   what rank 0 of a live job gets (rank-0-only gathering).
//! * [`shard_full_dict`] needs no communication: each rank's dict is the pure
//!   [`flatten_optim_state_dict`] for that rank, as [`Fsdp::shard_full_optim_state_dict`]
//!   computes it.
//!
//! Both check the input against the layout first, so that per-rank files saved at another
//! world size give [`Error::WorldSizeMismatch`] naming the world sizes that would fit.
//!
//! With an FSDP2 policy (`fsdp_version` 2, `fully_shard`) all three entry points work on
//! per-parameter dim-0 shards instead, as PyTorch's `get_optimizer_state_dict` /
//! `set_optimizer_state_dict` with `full_state_dict=True` see them (private module `fsdp2`).
//!
//! ```
//! use fsdp::commands::rank_dicts::DescFile;
//! use fsdp::commands::rank_dicts::{consolidate_local_dicts, shard_full_dict};
//! use fsdp::{DType, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, Value, WrapPolicy};
//!
//! let model = ModelDesc::new()
//!     .param("a.weight", &[3, 2], DType::F32)
//!     .param("b.weight", &[5], DType::F32);
//! let spec = DescFile::new(model.clone(), WrapPolicy::units(&["a", ""]));
//! let mut full = OptimStateDict::default();
//! for p in &model.params {
//!     let mut st = ParamState::new();
//!     st.insert("exp_avg".into(), Value::Tensor(HostTensor::zeros(DType::F32, &p.shape)));
//!     st.insert("step".into(), Value::Tensor(HostTensor::scalar(1.0f32)));
//!     full.state.insert(ParamKey::Name(p.name.clone()), st);
//! }
//! full.param_groups = None;
//! let ranks = shard_full_dict(&spec, &full, 3).unwrap();
//! assert_eq!(ranks.len(), 3);
//! let back = consolidate_local_dicts(&spec, &ranks).unwrap();
//! assert_eq!(back, full);
//! ```

use crate::collectives::{ProcessGroup, ThreadGroup};
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::fsdp1::Fsdp;
use crate::model::{ModelDesc, WrapPolicy};
use crate::optim_state::keys::Resolved;
use crate::optim_state::{flatten_optim_state_dict, OptimParams, OptimStateDict, Value};
use crate::param_layout::ParamLayout;
use crate::tensor::HostTensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

mod fsdp2;

/// A model description, its wrapping policy and, optionally, what each rank's optimizer holds:
/// the `DESC.json` file of `fsdp-ckpt consolidate-torch` and `shard-torch`.
///
/// ```json
/// {
///   "model": {
///     "params": [
///       {"name": "embed.weight", "shape": [10, 4], "dtype": "f32"},
///       {"name": "layers.0.weight", "shape": [4, 4], "dtype": "f32", "requires_grad": false}
///     ],
///     "tied": {"head.weight": "embed.weight"}
///   },
///   "policy": {"units": ["layers.0", ""], "use_orig_params": false,
///              "ignored_modules": [], "sharding_strategy": "FULL_SHARD"},
///   "optim_params": {"groups": [[{"Flat": "layers.0"}, {"Flat": ""}]], "named": false}
/// }
/// ```
///
/// `optim_params` (all ranks) and `optim_params_per_rank` (one entry per rank, overriding it)
/// are optional; without them each rank's optimizer holds `model.parameters()` of the wrapped
/// model in one group ([`crate::Fsdp::optim_params`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescFile {
    /// The model's parameters.
    pub model: ModelDesc,
    /// How it is wrapped.
    pub policy: WrapPolicy,
    /// The optimizer's param groups on every rank; default: `model.parameters()`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optim_params: Option<OptimParams>,
    /// The optimizer's param groups per rank (index = rank), overriding `optim_params`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optim_params_per_rank: Option<Vec<OptimParams>>,
}

impl DescFile {
    /// A spec with the default optimizer parameters.
    pub fn new(model: ModelDesc, policy: WrapPolicy) -> Self {
        DescFile {
            model,
            policy,
            optim_params: None,
            optim_params_per_rank: None,
        }
    }

    /// Parses the JSON form.
    pub fn from_json(text: &str, file: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::Serialization {
            what: format!("model spec `{file}`"),
            reason: e.to_string(),
        })
    }

    /// Reads the JSON file at `path`.
    pub fn from_json_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        // A regular file of bounded size: a FIFO or `/dev/zero` is an error, not a hang.
        let bytes = crate::storage::read_small_file(path)?;
        let text = String::from_utf8(bytes).map_err(|e| Error::Serialization {
            what: format!("model spec `{name}`"),
            reason: e.to_string(),
        })?;
        Self::from_json(&text, &name)
    }

    /// The JSON form, pretty-printed.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a model spec always serializes")
    }
}

/// Largest world size [`Error::WorldSizeMismatch`] messages search for a fitting one.
const MAX_SUGGESTED_WORLD_SIZE: usize = 1024;

/// How long a thread rank waits for its peers in [`consolidate_local_dicts`]: all ranks are in
/// this process, so only a bug could make one wait; large states take long to copy.
const RANK_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

impl DescFile {
    /// The layout at `world_size` (hybrid strategies are not supported offline).
    ///
    /// For an FSDP2 policy (`fsdp_version` 2), which has no flat parameters, it checks the
    /// per-parameter layout ([`ParamLayout::new`]) and returns the model as the optimizer
    /// sees it under `fully_shard`: every parameter under its own name, none flattened (the
    /// model without FSDP1 units), so that [`OptimParams::of_model`] lists
    /// `model.parameters()`.
    pub fn layout(&self, world_size: usize) -> Result<ModelLayout> {
        if self.policy.is_fsdp2() {
            ParamLayout::new(&self.model, &self.policy, world_size)?;
            return ModelLayout::new(&self.model, &WrapPolicy::default(), world_size);
        }
        if self.policy.sharding_strategy.is_hybrid() {
            return Err(Error::Unsupported(
                "offline conversion of HYBRID_SHARD checkpoints (consolidate each shard group's files separately with FULL_SHARD)".into(),
            ));
        }
        ModelLayout::new(&self.model, &self.policy, world_size)
    }

    /// What rank `rank`'s optimizer holds: `optim_params_per_rank[rank]`, else
    /// `optim_params`, else `model.parameters()` of the wrapped model ([`Fsdp::optim_params`]).
    pub fn optim_params_for(&self, layout: &ModelLayout, rank: usize) -> Result<OptimParams> {
        if let Some(per) = &self.optim_params_per_rank {
            return per
                .get(rank)
                .cloned()
                .ok_or_else(|| {
                    Error::InvalidModel(format!(
                        "`optim_params_per_rank` of the model spec has {} entries, but world size {} needs one per rank (rank {rank} has none)",
                        per.len(),
                        layout.world_size
                    ))
                });
        }
        Ok(self
            .optim_params
            .clone()
            .unwrap_or_else(|| OptimParams::of_model(layout)))
    }
}

/// The first positive-dim tensor state of `osd` whose element count does not fit rank
/// `rank`'s part of `layout`, described; `None` if all fit (or `params` does not resolve,
/// which consolidation then reports precisely).
fn shape_misfit(
    layout: &ModelLayout,
    rank: usize,
    osd: &OptimStateDict,
    params: &OptimParams,
) -> Option<String> {
    let local = layout.local_params(params).ok()?;
    for l in &local {
        let Some(state) = osd.state.get(&l.key) else {
            continue;
        };
        let (expected, what) = match l.resolved {
            Resolved::Flat(f) => {
                let fp = &layout.flat_params[f];
                let unit = if fp.unit.is_empty() {
                    "the root unit".to_string()
                } else {
                    format!("unit `{}`", fp.unit)
                };
                (fp.shard_numel(), format!("the flat parameter of {unit}"))
            }
            Resolved::Orig {
                param,
                owner: Some((f, m)),
            } => (
                layout.flat_params[f].shard(rank).params[m].numel_in_shard,
                format!("parameter `{}`", layout.state_fqn(param)),
            ),
            Resolved::Orig { owner: None, .. } => continue,
        };
        for (name, v) in state {
            if let Value::Tensor(t) = v {
                if t.dim() > 0 && t.numel() != expected {
                    return Some(format!(
                        "rank {rank}'s state `{name}` of {what} (key {}) has {} elements where world size {} gives {expected}",
                        l.key,
                        t.numel(),
                        layout.world_size
                    ));
                }
            }
        }
    }
    None
}

/// Checks every rank's local dict against the layout at `locals.len()` ranks.
fn check_world_size(
    spec: &DescFile,
    layout: &ModelLayout,
    locals: &[OptimStateDict],
) -> Result<()> {
    let misfit = |layout: &ModelLayout| -> Result<Option<String>> {
        for (rank, osd) in locals.iter().enumerate() {
            let params = spec.optim_params_for(layout, rank)?;
            if let Some(m) = shape_misfit(layout, rank, osd, &params) {
                return Ok(Some(m));
            }
        }
        Ok(None)
    };
    let Some(detail) = misfit(layout)? else {
        return Ok(());
    };
    // Which world sizes would every rank-0 tensor fit? (rank 0 only: the files given are not
    // all the ranks of another world size.)
    let fits: Vec<usize> = (1..=MAX_SUGGESTED_WORLD_SIZE)
        .filter(|&ws| ws != layout.world_size)
        .filter(|&ws| {
            spec.layout(ws).is_ok_and(|l| {
                spec.optim_params_for(&l, 0)
                    .is_ok_and(|p| shape_misfit(&l, 0, &locals[0], &p).is_none())
            })
        })
        .take(8)
        .collect();
    let hint = if fits.is_empty() {
        format!(
            "; no world size up to {MAX_SUGGESTED_WORLD_SIZE} fits rank 0's file: were the files saved with another model description or wrapping policy?"
        )
    } else {
        format!("; rank 0's file fits world size(s) {fits:?}: pass one file per rank of that run")
    };
    Err(Error::WorldSizeMismatch {
        files: locals.len(),
        detail: format!("{detail}{hint}"),
    })
}

/// Checks every tensor state of rank `rank`'s local dict against the model description: an
/// unmanaged (or ignored) parameter's state is the parameter's full tensor, so its shape must
/// be the parameter's; every positive-dim tensor state has the parameter's (or flat
/// parameter's) dtype. Flat sizes are checked by [`check_world_size`].
fn check_state_shapes(
    layout: &ModelLayout,
    rank: usize,
    osd: &OptimStateDict,
    params: &OptimParams,
) -> Result<()> {
    for l in &layout.local_params(params)? {
        let Some(state) = osd.state.get(&l.key) else {
            continue;
        };
        let (dtype, full_shape, what) = match l.resolved {
            Resolved::Flat(f) => {
                let fp = &layout.flat_params[f];
                (
                    fp.dtype,
                    None,
                    format!("the flat parameter of unit `{}`", fp.unit),
                )
            }
            Resolved::Orig { param, owner } => {
                let p = &layout.model.params[param];
                let shape = owner.is_none().then_some(&p.shape);
                (p.dtype, shape, format!("parameter `{}`", p.name))
            }
        };
        for (name, v) in state {
            let Value::Tensor(t) = v else { continue };
            if t.dim() == 0 {
                continue;
            }
            let context = || format!("rank {rank}'s state `{name}` of {what} (key {})", l.key);
            if let Some(shape) = full_shape {
                if t.shape() != shape.as_slice() {
                    return Err(Error::ShapeMismatch {
                        context: format!("{} (unsharded: the parameter's shape)", context()),
                        expected: shape.clone(),
                        found: t.shape().to_vec(),
                    });
                }
            }
            check_dtype(t.dtype(), dtype, context)?;
        }
    }
    Ok(())
}

/// Checks every rank's local dict (index = rank) against the model description before
/// consolidation: flat sizes against the layout at `locals.len()` ranks
/// ([`Error::WorldSizeMismatch`] naming the world sizes that would fit), and every tensor
/// state's dtype, and the shape of unmanaged and ignored parameters' state, against the
/// description ([`Error::ShapeMismatch`], [`Error::DtypeMismatch`]). For an FSDP2 policy,
/// every sharded state must hold the rank's dim-0 rows, and every rank the keys rank 0 has.
pub fn check_local_dicts(spec: &DescFile, locals: &[OptimStateDict]) -> Result<()> {
    if locals.is_empty() {
        return Err(Error::WorldSizeMismatch {
            files: 0,
            detail: "at least one rank's optimizer state dict is needed".into(),
        });
    }
    if spec.policy.is_fsdp2() {
        return fsdp2::check_local_dicts(spec, locals);
    }
    let layout = spec.layout(locals.len())?;
    check_world_size(spec, &layout, locals)?;
    for (rank, osd) in locals.iter().enumerate() {
        check_state_shapes(&layout, rank, osd, &spec.optim_params_for(&layout, rank)?)?;
    }
    Ok(())
}

/// `FSDP.full_optim_state_dict` of a job whose ranks saved `locals` (index = rank): the full,
/// name-keyed dict rank 0 would get. Runs one thread rank per dict. For an FSDP2 policy:
/// what `get_optimizer_state_dict(model, optim, full_state_dict=True)` returns, assembled
/// from the ranks' `to_local()` shards (pure, no thread ranks).
pub fn consolidate_local_dicts(
    spec: &DescFile,
    locals: &[OptimStateDict],
) -> Result<OptimStateDict> {
    if locals.is_empty() {
        return Err(Error::WorldSizeMismatch {
            files: 0,
            detail: "at least one rank's optimizer state dict is needed".into(),
        });
    }
    if spec.policy.is_fsdp2() {
        return fsdp2::consolidate(spec, locals);
    }
    let ws = locals.len();
    let layout = spec.layout(ws)?;
    check_local_dicts(spec, locals)?;
    let params: Vec<OptimParams> = (0..ws)
        .map(|r| spec.optim_params_for(&layout, r))
        .collect::<Result<_>>()?;
    let mut results = ThreadGroup::run_with_timeout(ws, RANK_TIMEOUT, |pg| {
        let rank = pg.rank();
        let fsdp = Fsdp::new(&spec.model, &spec.policy, Arc::new(pg))?;
        fsdp.full_optim_state_dict(&locals[rank], &params[rank], true)
    });
    let rank0 = results.swap_remove(0)?;
    Ok(rank0.expect("rank 0 returns the full dict with rank0_only"))
}

/// `FSDP.shard_full_optim_state_dict` on every rank of a `world_size`-rank job: each rank's
/// flattened, sharded dict for its optimizer (index = rank). Pure: no communication. For an
/// FSDP2 policy: each rank's `optim.state_dict()` (DTensors as `to_local()`) as the rank
/// holds it after `dcp.load` + `set_state_dict` of a sharded checkpoint: the param groups'
/// values as the full dict has them (`betas` a tuple), so that sharding the consolidation of
/// a run's rank files at the same world size gives those files back. See
/// [`shard_full_dict_with`] for the form `set_optimizer_state_dict(full_state_dict=True)`
/// leaves.
pub fn shard_full_dict(
    spec: &DescFile,
    full: &OptimStateDict,
    world_size: usize,
) -> Result<Vec<OptimStateDict>> {
    shard_full_dict_with(spec, full, world_size, &ShardOptions::default())
}

/// Options of [`shard_full_dict_with`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardOptions {
    /// FSDP2 only: every tuple in the param groups (`betas`) becomes a list, as PyTorch's
    /// `set_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))` leaves
    /// them (it flattens and unflattens the dict). Off by default.
    pub tuples_as_lists: bool,
}

impl ShardOptions {
    /// These options with [`ShardOptions::tuples_as_lists`] set to `on`.
    pub fn with_tuples_as_lists(mut self, on: bool) -> Self {
        self.tuples_as_lists = on;
        self
    }
}

/// [`shard_full_dict`] with options.
pub fn shard_full_dict_with(
    spec: &DescFile,
    full: &OptimStateDict,
    world_size: usize,
    opts: &ShardOptions,
) -> Result<Vec<OptimStateDict>> {
    if spec.policy.is_fsdp2() {
        return fsdp2::shard(spec, full, world_size, opts.tuples_as_lists);
    }
    let layout = spec.layout(world_size)?;
    (0..world_size)
        .map(|rank| {
            let params = spec.optim_params_for(&layout, rank)?;
            flatten_optim_state_dict(&layout, rank, full, &params)
        })
        .collect()
}

/// The full optimizer state dict from every rank's SHARDED one (one dict per rank, in rank
/// order): FSDP1's `FSDP.optim_state_dict` under `StateDictType.SHARDED_STATE_DICT`
/// (`ShardedTensor` states) or FSDP2's `optim.state_dict()` (`DTensor` states), each read
/// with [`crate::io::torch_save::load_optim_state_dict`]. Every sharded state becomes the
/// full tensor its ranks' local shards tile, placed at their offsets; every other value,
/// the key order and the param groups are rank 0's. For FSDP1 that is the dict
/// `FSDP.optim_state_dict` gives under `FULL_STATE_DICT`; for FSDP2 `optim.state_dict()`
/// with each `DTensor` replaced by its `full_tensor()`.
///
/// Errors ([`Error::ShardedMismatch`], naming the rank, key and state): a rank without a
/// key or state the others have, differing global shapes or dtypes, shards that overlap
/// (other than identical replicas) or leave part of a tensor uncovered.
pub fn consolidate_sharded(ranks: &[OptimStateDict]) -> Result<OptimStateDict> {
    let Some(first) = ranks.first() else {
        return Err(Error::InvalidArgument {
            op: "consolidate_sharded".into(),
            rank: 0,
            reason: "no rank's dict was given".into(),
        });
    };
    for (r, d) in ranks.iter().enumerate() {
        if let Some(k) = first.state.keys().find(|k| !d.state.contains_key(*k)) {
            return Err(sharded_err(r, &k.to_string(), "", "the key is missing"));
        }
        if let Some(k) = d.state.keys().find(|k| !first.state.contains_key(*k)) {
            return Err(sharded_err(r, &k.to_string(), "", "rank 0 has no such key"));
        }
    }
    let mut full = OptimStateDict {
        state: Default::default(),
        param_groups: first.param_groups.clone(),
    };
    for (key, st) in &first.state {
        let mut out = crate::optim_state::ParamState::new();
        for (name, v) in st {
            let value = match v {
                Value::Sharded(_) => {
                    let mut pieces = Vec::with_capacity(ranks.len());
                    for (r, d) in ranks.iter().enumerate() {
                        match d.state[key].get(name) {
                            Some(Value::Sharded(s)) => pieces.push(s),
                            other => {
                                let found = other.map_or("nothing".into(), Value::kind);
                                return Err(sharded_err(
                                    r,
                                    &key.to_string(),
                                    name,
                                    &format!("expected a sharded tensor, found {found}"),
                                ));
                            }
                        }
                    }
                    Value::Tensor(
                        assemble(&pieces)
                            .map_err(|(r, why)| sharded_err(r, &key.to_string(), name, &why))?,
                    )
                }
                other => other.clone(),
            };
            out.insert(name.clone(), value);
        }
        full.state.insert(key.clone(), out);
    }
    Ok(full)
}

fn sharded_err(rank: usize, key: &str, state: &str, reason: &str) -> Error {
    Error::ShardedMismatch {
        rank,
        key: key.to_string(),
        state: state.to_string(),
        reason: reason.to_string(),
    }
}

/// The tensor the ranks' `pieces` tile; errors name the rank at fault.
fn assemble(
    pieces: &[&crate::optim_state::ShardedTensor],
) -> std::result::Result<HostTensor, (usize, String)> {
    let global = pieces[0].global_shape.clone();
    let numel: usize = global.iter().product();
    let mut dtype = None;
    // Distinct (offsets, shape) pieces with elements, and who holds them.
    let mut placed: Vec<(usize, &[usize], &HostTensor)> = Vec::new();
    for (r, p) in pieces.iter().enumerate() {
        if p.global_shape != global {
            return Err((
                r,
                format!("global shape {:?}, rank 0 has {global:?}", p.global_shape),
            ));
        }
        let Some(t) = p.local.as_ref().filter(|t| t.numel() > 0) else {
            continue;
        };
        if *dtype.get_or_insert(t.dtype()) != t.dtype() {
            return Err((
                r,
                format!(
                    "local shard of {}, other ranks' of {}",
                    t.dtype(),
                    dtype.unwrap_or(t.dtype())
                ),
            ));
        }
        let ends = p.offsets.len() == global.len()
            && t.dim() == global.len()
            && (0..global.len()).all(|d| p.offsets[d] + t.shape()[d] <= global[d]);
        if !ends {
            return Err((
                r,
                format!(
                    "a shard {:?} at {:?} outside {global:?}",
                    t.shape(),
                    p.offsets
                ),
            ));
        }
        let same = |(_, o, u): &(usize, &[usize], &HostTensor)| {
            *o == p.offsets.as_slice() && u.shape() == t.shape()
        };
        if placed.iter().any(same) {
            continue; // a replica of a piece already placed
        }
        if let Some((q, ..)) = placed.iter().find(|(_, o, u)| {
            (0..global.len())
                .all(|d| o[d] < p.offsets[d] + t.shape()[d] && p.offsets[d] < o[d] + u.shape()[d])
        }) {
            return Err((
                r,
                format!("its shard at {:?} overlaps rank {q}'s", p.offsets),
            ));
        }
        placed.push((r, &p.offsets, t));
    }
    let covered: usize = placed.iter().map(|(_, _, t)| t.numel()).sum();
    if covered != numel {
        return Err((
            0,
            format!("the shards cover {covered} of the {numel} elements of {global:?}"),
        ));
    }
    let Some(dtype) = dtype else {
        return Err((
            0,
            format!("no rank holds data of the {global:?} tensor (its dtype is unknown)"),
        ));
    };
    let mut out = HostTensor::zeros(dtype, &global);
    for (_, offsets, t) in placed {
        copy_block(&mut out, &global, offsets, t);
    }
    Ok(out)
}

/// Copies `piece` into `out` (contiguous, of shape `global`) at `offsets`, one innermost row
/// at a time.
fn copy_block(out: &mut HostTensor, global: &[usize], offsets: &[usize], piece: &HostTensor) {
    let es = piece.dtype().size();
    let shape = piece.shape();
    let mut strides = vec![1usize; global.len()];
    for d in (0..global.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * global[d + 1];
    }
    let row = shape.last().copied().unwrap_or(1) * es;
    let rows = if shape.is_empty() {
        1
    } else {
        piece.numel() / shape[shape.len() - 1]
    };
    let src = piece.as_bytes();
    let dst = out.bytes_mut();
    let mut idx = vec![0usize; shape.len().saturating_sub(1)];
    for i in 0..rows {
        let mut at = offsets.last().copied().unwrap_or(0);
        for (d, &x) in idx.iter().enumerate() {
            at += (offsets[d] + x) * strides[d];
        }
        dst[at * es..at * es + row].copy_from_slice(&src[i * row..(i + 1) * row]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The rank number a per-rank file's name carries, if any: `rank` followed by digits
/// (`rank0.pt`, `optim_rank_1.pt`, `Rank-2.bin`) in the file name or, failing that, in its
/// folder's name (`rank3/optim.pt`); else digits ending the file stem after `-` or `_`
/// (`optim-2.pt`, `shard_04.pt`).
pub(crate) fn rank_in_file_name(path: &Path) -> Option<usize> {
    let after_rank = |s: &str| {
        let lower = s.to_ascii_lowercase();
        lower.match_indices("rank").find_map(|(i, _)| {
            let rest = lower[i + 4..].trim_start_matches(['_', '-']);
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
    };
    let stem = path.file_stem()?.to_str()?;
    if let Some(r) = after_rank(stem) {
        return Some(r);
    }
    if let Some(r) = path
        .parent()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .and_then(after_rank)
    {
        return Some(r);
    }
    let digits: String = stem
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let before = stem[..stem.len() - digits.len()].chars().last();
    matches!(before, Some('-' | '_'))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Checks that `files` (one per rank, in rank order) are distinct files in an order their
/// names do not contradict: no path given twice, no two files with the same bytes (a copied
/// rank file), and when every name carries a rank number (`rank_in_file_name`) and the
/// numbers differ, they count up from 0 or 1 in the order given.
pub fn check_rank_files(files: &[PathBuf]) -> Result<()> {
    let bad = |position: usize, reason: String| Error::RankFiles {
        file: files[position].display().to_string(),
        position,
        reason,
    };
    // Same path (after resolving symbolic links and `..`).
    let mut seen: HashMap<PathBuf, usize> = HashMap::new();
    for (i, f) in files.iter().enumerate() {
        let key = f.canonicalize().unwrap_or_else(|_| f.clone());
        if let Some(&j) = seen.get(&key) {
            return Err(bad(
                i,
                format!("it is the same file as rank {j}'s `{}`", files[j].display()),
            ));
        }
        seen.insert(key, i);
    }
    check_rank_order(files).map_err(|(i, r)| bad(i, r))?;
    if let Some((i, j)) = same_bytes(files)? {
        return Err(bad(
            i,
            format!(
                "it has the same bytes as rank {j}'s `{}` (a copied rank file?)",
                files[j].display()
            ),
        ));
    }
    Ok(())
}

/// The first file whose name's rank number contradicts its position, with the reason.
fn check_rank_order(files: &[PathBuf]) -> std::result::Result<(), (usize, String)> {
    let numbers: Option<Vec<usize>> = files.iter().map(|f| rank_in_file_name(f)).collect();
    let Some(numbers) = numbers else {
        return Ok(()); // some names carry no rank: nothing to contradict
    };
    if files.len() < 2 || numbers.iter().all(|&n| n == numbers[0]) {
        return Ok(()); // one file, or a number common to all (a step, not a rank)
    }
    let base = if numbers.contains(&0) { 0 } else { 1 };
    match numbers.iter().enumerate().find(|&(i, &n)| n != base + i) {
        None => Ok(()),
        Some((i, &n)) => Err((
            i,
            format!(
                "its name says rank {n}{}; give the files in rank order",
                if base == 1 { " (numbered from 1)" } else { "" }
            ),
        )),
    }
}

/// The first pair (later, earlier) of files with identical bytes: files of equal length are
/// checksummed, and equal checksums confirmed byte by byte.
fn same_bytes(files: &[PathBuf]) -> Result<Option<(usize, usize)>> {
    let mut lens = Vec::with_capacity(files.len());
    for f in files {
        lens.push(crate::storage::regular_len(f).map_err(|e| e.at("reading", f))?);
    }
    let mut crcs: HashMap<usize, u32> = HashMap::new();
    for i in 0..files.len() {
        for j in 0..i {
            if lens[i] != lens[j] {
                continue;
            }
            for k in [i, j] {
                if let std::collections::hash_map::Entry::Vacant(e) = crcs.entry(k) {
                    e.insert(file_crc(&files[k])?);
                }
            }
            if crcs[&i] == crcs[&j] && equal_files(&files[i], &files[j])? {
                return Ok(Some((i, j)));
            }
        }
    }
    Ok(None)
}

fn open_input(p: &Path) -> Result<std::fs::File> {
    crate::storage::open_regular(p).map_err(|e| e.at("reading", p))
}

fn read_chunk(f: &mut std::fs::File, buf: &mut [u8], p: &Path) -> Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("reading", p)(e)),
        }
    }
    Ok(n)
}

fn file_crc(p: &Path) -> Result<u32> {
    let mut f = open_input(p)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut crc = 0;
    loop {
        let n = read_chunk(&mut f, &mut buf, p)?;
        if n == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
    }
}

fn equal_files(a: &Path, b: &Path) -> Result<bool> {
    let (mut fa, mut fb) = (open_input(a)?, open_input(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let (na, nb) = (
            read_chunk(&mut fa, &mut ba, a)?,
            read_chunk(&mut fb, &mut bb, b)?,
        );
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

/// A state tensor of dtype `found` where the model description says `expected`: an error
/// naming where (`context`).
fn check_dtype(
    found: crate::tensor::DType,
    expected: crate::tensor::DType,
    context: impl FnOnce() -> String,
) -> Result<()> {
    if found == expected {
        return Ok(());
    }
    Err(Error::DtypeMismatch {
        context: format!("{} (the model description's dtype)", context()),
        expected: expected.to_string(),
        found: found.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_numbers_are_read_from_the_usual_names() {
        let r = |p: &str| rank_in_file_name(Path::new(p));
        assert_eq!(r("rank0.pt"), Some(0));
        assert_eq!(r("optim_rank_1.pt"), Some(1));
        assert_eq!(r("out/Rank-12.bin"), Some(12));
        assert_eq!(r("optim-2.pt"), Some(2));
        assert_eq!(r("shard_04.pt"), Some(4));
        assert_eq!(r("rank3/optim.pt"), Some(3));
        assert_eq!(r("optim.pt"), None);
        assert_eq!(r("optim2.pt"), None);
    }

    #[test]
    fn an_order_that_contradicts_the_names_is_refused() {
        let p = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        assert!(check_rank_order(&p(&["rank0.pt", "rank1.pt", "rank2.pt"])).is_ok());
        assert!(check_rank_order(&p(&["r-1.pt", "r-2.pt"])).is_ok());
        assert!(check_rank_order(&p(&["a/step-100.pt", "b/step-100.pt"])).is_ok());
        assert!(check_rank_order(&p(&["x.pt", "rank0.pt"])).is_ok());
        assert_eq!(
            check_rank_order(&p(&["rank1.pt", "rank0.pt", "rank2.pt"]))
                .unwrap_err()
                .0,
            0
        );
        assert_eq!(
            check_rank_order(&p(&["rank0.pt", "rank2.pt", "rank1.pt"]))
                .unwrap_err()
                .0,
            1
        );
    }
}
