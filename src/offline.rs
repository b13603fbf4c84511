//! Offline conversion of saved per-rank optimizer state: consolidation of every rank's local
//! dict into the full dict, and sharding of a full dict into every rank's local dict, in one
//! process, without a distributed job. What `fsdp-ckpt consolidate-torch` and `shard-torch`
//! run.
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
//! ```
//! use fsdp::offline::ModelSpec;
//! use fsdp::offline::{consolidate_local_dicts, shard_full_dict};
//! use fsdp::{DType, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, Value, WrapPolicy};
//!
//! let model = ModelDesc::new()
//!     .param("a.weight", &[3, 2], DType::F32)
//!     .param("b.weight", &[5], DType::F32);
//! let spec = ModelSpec::new(model.clone(), WrapPolicy::units(&["a", ""]));
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
use crate::fsdp::Fsdp;
use crate::model::{ModelDesc, WrapPolicy};
use crate::optim_state::keys::Resolved;
use crate::optim_state::{flatten_optim_state_dict, OptimParams, OptimStateDict, Value};
use crate::tensor::HostTensor;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

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
pub struct ModelSpec {
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

impl ModelSpec {
    /// A spec with the default optimizer parameters.
    pub fn new(model: ModelDesc, policy: WrapPolicy) -> Self {
        ModelSpec {
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
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            op: "reading".into(),
            path: name.clone(),
            source: e.into(),
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

impl ModelSpec {
    /// The layout at `world_size` (hybrid strategies are not supported offline).
    pub fn layout(&self, world_size: usize) -> Result<ModelLayout> {
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
                .ok_or_else(|| Error::WorldSizeMismatch {
                    files: layout.world_size,
                    detail: format!(
                        "`optim_params_per_rank` of the model spec has {} entries",
                        per.len()
                    ),
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
    spec: &ModelSpec,
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

/// `FSDP.full_optim_state_dict` of a job whose ranks saved `locals` (index = rank): the full,
/// name-keyed dict rank 0 would get. Runs one thread rank per dict.
pub fn consolidate_local_dicts(
    spec: &ModelSpec,
    locals: &[OptimStateDict],
) -> Result<OptimStateDict> {
    if locals.is_empty() {
        return Err(Error::WorldSizeMismatch {
            files: 0,
            detail: "at least one rank's optimizer state dict is needed".into(),
        });
    }
    let ws = locals.len();
    let layout = spec.layout(ws)?;
    check_world_size(spec, &layout, locals)?;
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
/// flattened, sharded dict for its optimizer (index = rank). Pure: no communication.
pub fn shard_full_dict(
    spec: &ModelSpec,
    full: &OptimStateDict,
    world_size: usize,
) -> Result<Vec<OptimStateDict>> {
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
