//! Offline conversion for FSDP2 (`fully_shard`, `"fsdp_version": 2` in `DESC.json`): what
//! [`super::consolidate_local_dicts`], [`super::shard_full_dict`] and
//! [`super::check_local_dicts`] run for such a policy.
//!
//! A rank's local dict is its `optim.state_dict()` with every `DTensor` replaced by its
//! `to_local()` shard: keyed by parameter id (position in the param groups), each trained,
//! FSDP-managed parameter's positive-dim states holding that rank's dim-0 rows
//! ([`crate::param_layout`]), 0-dim states (`step`) and unmanaged parameters' states whole.
//!
//! * Consolidation gives what `get_optimizer_state_dict(model, optim,
//!   options=StateDictOptions(full_state_dict=True))` returns: rank 0's dict with ids
//!   replaced by FQNs (a tied parameter's first name), sharded states replaced by the rows of
//!   every rank in rank order, everything else (`step`, hyper-parameters) rank 0's.
//! * Sharding gives what each rank's `optim.state_dict()` holds after
//!   `set_optimizer_state_dict(model, optim, FULL, options=StateDictOptions(full_state_dict=True))`
//!   on a fresh model and optimizer: state for every trained parameter in param-group order
//!   (then any other parameter the full dict has state for, in its order), each sharded state
//!   cut to the rank's rows (a rank without rows gets a `[0, ...]` tensor), the full dict's
//!   hyper-parameters with tuples turned into lists (as PyTorch's flatten/unflatten of the
//!   dict does), and `params` as ids.

use super::{DescFile, MAX_SUGGESTED_WORLD_SIZE};
use crate::error::{Error, LookupSite, Result};
use crate::model::ModelDesc;
use crate::optim_state::ParamState;
use crate::optim_state::{OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, Value};
use crate::param_layout::{ParamLayout, ShardedParam};
use crate::tensor::HostTensor;
use indexmap::IndexMap;
use std::collections::{HashMap, HashSet};

/// What one rank's optimizer holds: per param group, each parameter's index in
/// [`ModelDesc::params`], and the key its state has in the rank's local dict.
struct RankParams {
    /// Param groups, each a list of parameter indices.
    groups: Vec<Vec<usize>>,
    /// Local-dict key → parameter index.
    by_key: IndexMap<ParamKey, usize>,
    /// Parameter index → local-dict key (its first key if listed twice).
    key_of: HashMap<usize, ParamKey>,
}

impl RankParams {
    /// Resolves `params` (names, tied aliases included) against `model`.
    fn new(model: &ModelDesc, params: &OptimParams) -> Result<Self> {
        let index: HashMap<String, usize> = model.names_with_aliases().into_iter().collect();
        let mut groups = Vec::with_capacity(params.groups.len());
        let mut by_key = IndexMap::new();
        let mut key_of = HashMap::new();
        let mut position = 0;
        for g in &params.groups {
            let mut group = Vec::with_capacity(g.len());
            for p in g {
                let OptimParam::Param(name) = p else {
                    return Err(Error::WrongOptimParam {
                        param: p.to_string(),
                        reason: "with fsdp_version 2 (fully_shard) there are no flat \
                                 parameters: list the original parameters (`{\"Param\": name}`)"
                            .into(),
                    });
                };
                let &i = index.get(name).ok_or_else(|| Error::UnknownParameter {
                    name: name.clone(),
                    site: LookupSite::DescriptionParamGroups,
                })?;
                let key = if params.named {
                    ParamKey::Name(name.clone())
                } else {
                    ParamKey::Id(position)
                };
                position += 1;
                by_key.insert(key.clone(), i);
                key_of.entry(i).or_insert(key);
                group.push(i);
            }
            groups.push(group);
        }
        Ok(RankParams {
            groups,
            by_key,
            key_of,
        })
    }
}

/// The layout at `world_size` and what the optimizers of `ranks` hold (index = rank).
fn plan_ranks(
    spec: &DescFile,
    world_size: usize,
    ranks: std::ops::Range<usize>,
) -> Result<(ParamLayout, Vec<RankParams>)> {
    let layout = ParamLayout::new(&spec.model, &spec.policy, world_size)?;
    let view = spec.layout(world_size)?;
    let ranks = ranks
        .map(|r| RankParams::new(&spec.model, &spec.optim_params_for(&view, r)?))
        .collect::<Result<_>>()?;
    Ok((layout, ranks))
}

/// The layout at `world_size` and what every rank's optimizer holds.
fn plan(spec: &DescFile, world_size: usize) -> Result<(ParamLayout, Vec<RankParams>)> {
    plan_ranks(spec, world_size, 0..world_size)
}

/// The state of `p` sharded on dim 0: a positive-dim tensor state of a sharded parameter
/// (`DTensor` in PyTorch). Everything else (`step`, unmanaged parameters) is plain.
fn is_sharded_state(p: &ShardedParam, v: &Value) -> bool {
    p.is_sharded() && matches!(v, Value::Tensor(t) if t.dim() > 0)
}

/// How `p` is described in messages.
fn describe(key: &ParamKey, p: &ShardedParam) -> String {
    format!("parameter `{}` (key {key})", p.name)
}

/// Checks every rank's local dict (index = rank) against the FSDP2 layout at `locals.len()`
/// ranks: keys the rank's optimizer has, the same keys and state names on every rank, param
/// groups of the optimizer's sizes, sharded states of the rank's rows
/// ([`Error::WorldSizeMismatch`] naming the world sizes rank 0's file fits), unsharded
/// states of the parameter's shape, tensor states of the parameter's dtype.
pub(super) fn check_local_dicts(spec: &DescFile, locals: &[OptimStateDict]) -> Result<()> {
    let (layout, ranks) = plan(spec, locals.len())?;
    for (rank, osd) in locals.iter().enumerate() {
        check_keys(rank, osd, &ranks[rank], &locals[0])?;
        check_groups(
            &format!("rank {rank}'s optimizer state dict"),
            osd,
            &ranks[rank],
        )?;
    }
    if let Some(detail) =
        (0..locals.len()).find_map(|r| rows_misfit(&layout, r, &locals[r], &ranks[r]))
    {
        return Err(world_size_error(spec, locals, detail));
    }
    for (rank, osd) in locals.iter().enumerate() {
        check_shapes_and_dtypes(&layout, rank, osd, &ranks[rank])?;
    }
    Ok(())
}

/// Every key of `osd` is a parameter of the rank's optimizer, and rank `rank` has the keys
/// and state names rank 0 has (`first`).
fn check_keys(
    rank: usize,
    osd: &OptimStateDict,
    params: &RankParams,
    first: &OptimStateDict,
) -> Result<()> {
    let op = "consolidate-torch (fsdp_version 2)";
    let bad = |reason: String| Error::InvalidArgument {
        op: op.into(),
        rank,
        reason,
    };
    if let Some(k) = osd.state.keys().find(|k| !params.by_key.contains_key(*k)) {
        return Err(bad(format!(
            "its optimizer state has the key {k}, which is not a parameter of the optimizer's \
             {} param group(s) in the model description ({} parameters)",
            params.groups.len(),
            params.by_key.len()
        )));
    }
    for (k, st0) in &first.state {
        let Some(st) = osd.state.get(k) else {
            return Err(bad(format!(
                "it has no state for key {k}, which rank 0 has"
            )));
        };
        if let Some(n) = st0.keys().find(|n| !st.contains_key(*n)) {
            return Err(bad(format!(
                "its state of key {k} has no `{n}`, which rank 0's has"
            )));
        }
    }
    if let Some(k) = osd.state.keys().find(|k| !first.state.contains_key(*k)) {
        return Err(bad(format!(
            "it has state for key {k}, which rank 0 has not"
        )));
    }
    Ok(())
}

/// `osd`'s param groups (if any) have the sizes of the optimizer's.
fn check_groups(context: &str, osd: &OptimStateDict, params: &RankParams) -> Result<()> {
    let Some(groups) = &osd.param_groups else {
        return Ok(());
    };
    if groups.len() != params.groups.len() {
        return Err(Error::ParamGroupsMismatch {
            context: context.into(),
            group: None,
            expected: params.groups.len(),
            found: groups.len(),
        });
    }
    for (g, (have, want)) in groups.iter().zip(&params.groups).enumerate() {
        if have.params.len() != want.len() {
            return Err(Error::ParamGroupsMismatch {
                context: context.into(),
                group: Some(g),
                expected: want.len(),
                found: have.params.len(),
            });
        }
    }
    Ok(())
}

/// The first sharded state of rank `rank` whose shape is not the rank's rows at
/// `layout.world_size`, described; `None` if all fit.
fn rows_misfit(
    layout: &ParamLayout,
    rank: usize,
    osd: &OptimStateDict,
    params: &RankParams,
) -> Option<String> {
    for (key, st) in &osd.state {
        let p = &layout.params[*params.by_key.get(key)?];
        for (name, v) in st {
            let Value::Tensor(t) = v else { continue };
            if !is_sharded_state(p, v) {
                continue;
            }
            let want = p.local_shape(rank);
            if t.shape() != want.as_slice() {
                let rows = p.rows(rank);
                return Some(format!(
                    "rank {rank}'s state `{name}` of {} has shape {:?} where world size {} gives \
                     rank {rank} rows {}..{} of {:?}, shape {want:?}",
                    describe(key, p),
                    t.shape(),
                    layout.world_size,
                    rows.start,
                    rows.end,
                    p.shape
                ));
            }
        }
    }
    None
}

/// [`Error::WorldSizeMismatch`] with `detail` and the world sizes rank 0's file fits.
fn world_size_error(spec: &DescFile, locals: &[OptimStateDict], detail: String) -> Error {
    let fits: Vec<usize> = (1..=MAX_SUGGESTED_WORLD_SIZE)
        .filter(|&ws| ws != locals.len())
        .filter(|&ws| {
            plan_ranks(spec, ws, 0..1).is_ok_and(|(layout, ranks)| {
                rows_misfit(&layout, 0, &locals[0], &ranks[0]).is_none()
            })
        })
        .take(8)
        .collect();
    let hint = if fits.is_empty() {
        format!(
            "; no world size up to {MAX_SUGGESTED_WORLD_SIZE} fits rank 0's file: were the \
             files saved with another model description or wrapping policy?"
        )
    } else {
        format!("; rank 0's file fits world size(s) {fits:?}: pass one file per rank of that run")
    };
    Error::WorldSizeMismatch {
        files: locals.len(),
        detail: format!("{detail}{hint}"),
    }
}

/// Unsharded positive-dim states have the parameter's shape; every positive-dim tensor state
/// has the parameter's dtype; no state is a `ShardedTensor`/`DTensor` (files must hold
/// `to_local()` shards).
fn check_shapes_and_dtypes(
    layout: &ParamLayout,
    rank: usize,
    osd: &OptimStateDict,
    params: &RankParams,
) -> Result<()> {
    for (key, st) in &osd.state {
        let p = &layout.params[params.by_key[key]];
        for (name, v) in st {
            let context = || format!("rank {rank}'s state `{name}` of {}", describe(key, p));
            let t = match v {
                Value::Tensor(t) if t.dim() > 0 => t,
                Value::Sharded(_) => {
                    return Err(Error::WrongStateKind {
                        context: format!("rank {rank}'s local optimizer state dict"),
                        param: describe(key, p),
                        state: name.clone(),
                        expected: "a plain tensor (the DTensor's `to_local()` shard)".into(),
                        found: v.kind(),
                    })
                }
                _ => continue,
            };
            if !is_sharded_state(p, v) && t.shape() != p.shape.as_slice() {
                return Err(Error::ShapeMismatch {
                    context: format!("{} (unsharded: the parameter's shape)", context()),
                    expected: p.shape.clone(),
                    found: t.shape().to_vec(),
                });
            }
            super::check_dtype(t.dtype(), p.dtype, context)?;
        }
    }
    Ok(())
}

/// The full dict `get_optimizer_state_dict(..., full_state_dict=True)` returns for a job
/// whose ranks saved `locals` (index = rank).
pub(super) fn consolidate(spec: &DescFile, locals: &[OptimStateDict]) -> Result<OptimStateDict> {
    check_local_dicts(spec, locals)?;
    let (layout, ranks) = plan(spec, locals.len())?;
    let mut state = IndexMap::with_capacity(locals[0].state.len());
    for (key, st0) in &locals[0].state {
        let p = &layout.params[ranks[0].by_key[key]];
        let mut out = ParamState::with_capacity(st0.len());
        for (name, v) in st0 {
            let value = if is_sharded_state(p, v) {
                let rows: Vec<HostTensor> = locals
                    .iter()
                    .enumerate()
                    .map(|(rank, osd)| match &osd.state[key][name] {
                        Value::Tensor(t) if t.dim() > 0 => Ok(t.clone()),
                        other => Err(Error::ShardedMismatch {
                            rank,
                            key: key.to_string(),
                            state: name.clone(),
                            reason: format!(
                                "rank 0 holds rows of a positive-dim tensor, this rank a {}",
                                other.kind()
                            ),
                        }),
                    })
                    .collect::<Result<_>>()?;
                Value::Tensor(HostTensor::cat_flat(&rows)?.reshape(&p.shape)?)
            } else {
                v.clone()
            };
            out.insert(name.clone(), value);
        }
        state.insert(ParamKey::Name(p.name.clone()), out);
    }
    let param_groups = locals[0].param_groups.as_ref().map(|groups| {
        groups
            .iter()
            .zip(&ranks[0].groups)
            .map(|(g, members)| ParamGroup {
                options: g.options.clone(),
                params: members
                    .iter()
                    .map(|&i| ParamKey::Name(layout.params[i].name.clone()))
                    .collect(),
            })
            .collect()
    });
    Ok(OptimStateDict {
        state,
        param_groups,
    })
}

/// Every rank's local dict after loading `full` at `world_size` ranks (index = rank).
pub(super) fn shard(
    spec: &DescFile,
    full: &OptimStateDict,
    world_size: usize,
    tuples_as_lists: bool,
) -> Result<Vec<OptimStateDict>> {
    let (layout, ranks) = plan(spec, world_size)?;
    let by_name = full_state_params(&spec.model, full)?;
    check_full_groups(&spec.model, full, &ranks[0])?;
    check_full_states(&layout, full, &by_name)?;
    ranks
        .iter()
        .enumerate()
        .map(|(rank, params)| {
            shard_for_rank(&layout, full, &by_name, params, rank, tuples_as_lists)
        })
        .collect()
}

/// The parameter index of every key of the full dict's state (FQNs, tied aliases allowed).
fn full_state_params(model: &ModelDesc, full: &OptimStateDict) -> Result<Vec<usize>> {
    let index: HashMap<String, usize> = model.names_with_aliases().into_iter().collect();
    full.state
        .keys()
        .map(|k| match k {
            ParamKey::Name(n) => index
                .get(n)
                .copied()
                .ok_or_else(|| Error::UnknownParameter {
                    name: n.clone(),
                    site: LookupSite::FullOptimState,
                }),
            ParamKey::Id(_) => Err(Error::WrongKeyType {
                dict: "a full optimizer state dict".into(),
                expected: "parameter names".into(),
                key: k.to_string(),
                hint: "; pass the output of get_optimizer_state_dict(..., \
                       full_state_dict=True) or of consolidate-torch"
                    .into(),
            }),
        })
        .collect()
}

/// The full dict has param groups of the optimizer's sizes, each naming the same parameters
/// as the optimizer's group (in any order).
fn check_full_groups(model: &ModelDesc, full: &OptimStateDict, params: &RankParams) -> Result<()> {
    let context = "the full optimizer state dict";
    if full.param_groups.is_none() {
        return Err(Error::InvalidParamGroups {
            context: context.into(),
            group: None,
            reason: "it has no `param_groups`".into(),
        });
    }
    check_groups(context, full, params)?;
    let index: HashMap<String, usize> = model.names_with_aliases().into_iter().collect();
    for (g, (have, want)) in full
        .param_groups
        .iter()
        .flatten()
        .zip(&params.groups)
        .enumerate()
    {
        let want: HashSet<usize> = want.iter().copied().collect();
        for k in &have.params {
            let found = k.as_name().and_then(|n| index.get(n));
            if !found.is_some_and(|i| want.contains(i)) {
                return Err(Error::InvalidParamGroups {
                    context: context.into(),
                    group: Some(g),
                    reason: format!(
                        "it lists {k}, which is not a parameter of the model description's \
                         optimizer group {g}"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Every sharded state of the full dict has the parameter's shape and dtype.
fn check_full_states(layout: &ParamLayout, full: &OptimStateDict, by_name: &[usize]) -> Result<()> {
    for ((key, st), &i) in full.state.iter().zip(by_name) {
        let p = &layout.params[i];
        for (name, v) in st {
            let context = || format!("the full dict's state `{name}` of {}", describe(key, p));
            let t = match v {
                Value::Tensor(t) if t.dim() > 0 => t,
                Value::Sharded(_) => {
                    return Err(Error::WrongStateKind {
                        context: "the full optimizer state dict".into(),
                        param: describe(key, p),
                        state: name.clone(),
                        expected: "a full tensor".into(),
                        found: v.kind(),
                    })
                }
                _ => continue,
            };
            if t.shape() != p.shape.as_slice() {
                return Err(Error::ShapeMismatch {
                    context: context(),
                    expected: p.shape.clone(),
                    found: t.shape().to_vec(),
                });
            }
            super::check_dtype(t.dtype(), p.dtype, context)?;
        }
    }
    Ok(())
}

/// Rank `rank`'s local dict: state in the order `set_optimizer_state_dict` leaves it, param
/// groups from the full dict with the rank's keys (tuples made lists with `tuples_as_lists`).
fn shard_for_rank(
    layout: &ParamLayout,
    full: &OptimStateDict,
    by_name: &[usize],
    params: &RankParams,
    rank: usize,
    tuples_as_lists: bool,
) -> Result<OptimStateDict> {
    let full_of: HashMap<usize, &ParamState> =
        by_name.iter().copied().zip(full.state.values()).collect();
    // Trained parameters in param-group order (PyTorch initializes their state first), then
    // any other parameter the full dict has state for, in the full dict's order.
    let mut order: Vec<usize> = Vec::new();
    let mut seen = HashSet::new();
    for &i in params.groups.iter().flatten() {
        if layout.params[i].requires_grad && seen.insert(i) {
            if !full_of.contains_key(&i) && !full.state.is_empty() {
                return Err(Error::MissingState {
                    context: "the full optimizer state dict".into(),
                    param: format!("trained parameter `{}`", layout.params[i].name),
                    state: String::new(),
                });
            }
            order.push(i);
        }
    }
    order.extend(by_name.iter().copied().filter(|&i| seen.insert(i)));
    let mut state = IndexMap::with_capacity(order.len());
    for i in order {
        let (Some(st), Some(key)) = (full_of.get(&i), params.key_of.get(&i)) else {
            continue;
        };
        state.insert(key.clone(), local_state(&layout.params[i], st, rank)?);
    }
    let param_groups = full.param_groups.as_ref().map(|groups| {
        groups
            .iter()
            .zip(&params.groups)
            .map(|(g, members)| ParamGroup {
                options: g
                    .options
                    .iter()
                    .map(|(k, v)| {
                        let v = if tuples_as_lists {
                            tuples_to_lists(v)
                        } else {
                            v.clone()
                        };
                        (k.clone(), v)
                    })
                    .collect(),
                params: members.iter().map(|i| params.key_of[i].clone()).collect(),
            })
            .collect()
    });
    Ok(OptimStateDict {
        state,
        param_groups,
    })
}

/// One parameter's state on `rank`: sharded states cut to the rank's rows (copied, so the
/// saved file holds only them), the rest whole.
fn local_state(p: &ShardedParam, st: &ParamState, rank: usize) -> Result<ParamState> {
    st.iter()
        .map(|(name, v)| {
            let value = match v {
                Value::Tensor(t) if is_sharded_state(p, v) => {
                    let rows = p.rows(rank);
                    let row = p.row_numel();
                    let piece = t.narrow_flat(rows.start * row, rows.len() * row)?;
                    Value::Tensor(HostTensor::from_bytes(
                        t.dtype(),
                        &p.local_shape(rank),
                        piece.as_bytes(),
                    )?)
                }
                other => other.clone(),
            };
            Ok((name.clone(), value))
        })
        .collect()
}

/// `v` with every tuple (at any depth) a list: what PyTorch's flattening and unflattening of
/// the loaded dict leaves of a hyper-parameter such as `betas`.
fn tuples_to_lists(v: &Value) -> Value {
    match v {
        Value::Tuple(items) | Value::List(items) => {
            Value::List(items.iter().map(tuples_to_lists).collect())
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{consolidate_local_dicts, shard_full_dict};
    use super::*;
    use crate::model::WrapPolicy;
    use crate::tensor::DType;

    /// `a` (5 rows) under `fully_shard`, a frozen weight, and a 0-dim `extra.scale` in an
    /// ignored module (replicated, as PyTorch's `ignored_params` keep it).
    fn spec(named: bool) -> DescFile {
        let model = ModelDesc::new()
            .param("a.weight", &[5, 2], DType::F32)
            .frozen_param("a.norm", &[5], DType::F32)
            .param("extra.scale", &[], DType::F32);
        let mut spec = DescFile::new(
            model,
            WrapPolicy::fully_shard(&["a", ""]).with_ignored(&["extra"]),
        );
        let mut params = OptimParams::single(
            ["a.weight", "a.norm", "extra.scale"]
                .map(|n| OptimParam::Param(n.into()))
                .to_vec(),
        );
        params.named = named;
        spec.optim_params = Some(params);
        spec
    }

    fn full() -> OptimStateDict {
        let mut full = OptimStateDict::default();
        let counting = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
            HostTensor::from_slice(&v, shape).unwrap()
        };
        for (name, shape) in [("a.weight", vec![5, 2]), ("extra.scale", vec![])] {
            let mut st = ParamState::new();
            st.insert("step".into(), Value::Tensor(HostTensor::scalar(2.0f32)));
            st.insert("exp_avg".into(), Value::Tensor(counting(&shape)));
            full.state.insert(ParamKey::Name(name.into()), st);
        }
        let mut options = IndexMap::new();
        options.insert("lr".into(), Value::Float(0.1));
        full.param_groups = Some(vec![ParamGroup {
            options,
            params: ["a.weight", "a.norm", "extra.scale"]
                .map(|n| ParamKey::Name(n.into()))
                .to_vec(),
        }]);
        full
    }

    #[test]
    fn a_state_of_another_dtype_than_the_description_is_named_in_local_and_full_dicts() {
        let as_f64 = |osd: &mut OptimStateDict| {
            let st = osd
                .state
                .get_mut(&ParamKey::Name("a.weight".into()))
                .unwrap();
            let Some(Value::Tensor(t)) = st.get("exp_avg") else {
                panic!("exp_avg")
            };
            let v: Vec<f64> = vec![0.0; t.numel()];
            let wide = HostTensor::from_slice(&v, t.shape()).unwrap();
            st.insert("exp_avg".into(), Value::Tensor(wide));
        };
        let mut ranks = shard_full_dict(&spec(true), &full(), 2).unwrap();
        as_f64(&mut ranks[1]);
        let mut wide_full = full();
        as_f64(&mut wide_full);
        for err in [
            consolidate_local_dicts(&spec(true), &ranks).unwrap_err(),
            shard_full_dict(&spec(true), &wide_full, 2).unwrap_err(),
        ] {
            assert!(
                matches!(&err, Error::DtypeMismatch { context, expected, found }
                    if context.contains("a.weight") && context.contains("exp_avg")
                        && expected == "torch.float32" && found == "torch.float64"),
                "{err:?}"
            );
        }
    }

    #[test]
    fn ignored_scalar_stays_whole_frozen_has_no_state_and_a_named_optimizer_keys_by_fqn() {
        let ranks = shard_full_dict(&spec(true), &full(), 3).unwrap();
        // 5 rows on 3 ranks: 2, 2, 1.
        let rows: Vec<Vec<usize>> = ranks
            .iter()
            .map(
                |osd| match &osd.state[&ParamKey::Name("a.weight".into())]["exp_avg"] {
                    Value::Tensor(t) => t.shape().to_vec(),
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert_eq!(rows, [vec![2, 2], vec![2, 2], vec![1, 2]]);
        for osd in &ranks {
            assert_eq!(osd.state.len(), 2, "the frozen a.norm has no state");
            let scale = &osd.state[&ParamKey::Name("extra.scale".into())]["exp_avg"];
            assert!(scale.same_scalar(&full().state[1]["exp_avg"]));
        }
        assert_eq!(
            consolidate_local_dicts(&spec(true), &ranks).unwrap(),
            full()
        );
    }

    #[test]
    fn flat_parameters_in_the_optimizer_are_refused_with_fsdp2() {
        let mut s = spec(false);
        s.optim_params = Some(OptimParams::single(vec![OptimParam::Flat("a".into())]));
        let e = shard_full_dict(&s, &full(), 2).unwrap_err();
        assert!(matches!(e, Error::WrongOptimParam { .. }), "{e}");
    }

    #[test]
    fn a_rank_with_a_scalar_where_rank_0_has_rows_is_refused_naming_it() {
        let mut ranks = shard_full_dict(&spec(false), &full(), 2).unwrap();
        ranks[1].state[0].insert("exp_avg".into(), Value::Tensor(HostTensor::scalar(1.0f32)));
        let e = consolidate_local_dicts(&spec(false), &ranks).unwrap_err();
        assert!(
            matches!(&e, Error::ShardedMismatch { rank: 1, state, .. } if state == "exp_avg"),
            "{e}"
        );
    }

    #[test]
    fn an_unmanaged_state_of_another_shape_is_refused() {
        let mut ranks = shard_full_dict(&spec(false), &full(), 2).unwrap();
        ranks[1].state[1].insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::zeros(DType::F32, &[1])),
        );
        let e = consolidate_local_dicts(&spec(false), &ranks).unwrap_err();
        assert!(
            matches!(&e, Error::ShapeMismatch { context, .. } if context.contains("rank 1")
                && context.contains("extra.scale")),
            "{e}"
        );
    }
}
