//! Consolidating each rank's local optimizer state into a full or sharded name-keyed dict
//! (`_optim_state_dict`): agree on keys, all-gather flat shards, unflatten per parameter.

use super::keys::{LocalParam, OptimStateKey, Resolved};
use super::plan::{check_digests, layout_digest, KeyInfo, PlanMsg, StateInfo};
use super::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, ShardedTensor, Value};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, LookupSite, Result};
use crate::flat_param::{
    shard_from_members, unflatten_full, FlatParamLayout, ModelLayout, Ownership,
};
use crate::tensor::{DType, HostTensor, Tensor};
use indexmap::IndexMap;
use std::collections::{BTreeSet, HashMap};

/// How the consolidated dict is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsolidateOptions {
    /// `true`: each rank keeps only its dim-0 chunk of every tensor (`SHARDED_STATE_DICT`).
    pub shard_state: bool,
    /// Whether this rank returns the dict (others still take part and return `None`).
    pub to_save: bool,
    /// Only rank 0 of the group can return the dict (`rank0_only`), so tensors are gathered
    /// to it alone instead of all-gathered. The same on every rank.
    pub rank0_only: bool,
}

impl ConsolidateOptions {
    /// The rank tensors are gathered to, or `None` for an all-gather.
    fn gather_root(&self) -> Option<usize> {
        (self.rank0_only && !self.shard_state).then_some(0)
    }
}

/// Converts this rank's local optimizer state dict into the full (or sharded) dict keyed by
/// parameter names. Collective over `pg`, the shard group of `layout`.
///
/// Phases: every rank plans locally and the plans are exchanged (a rank's own error fails
/// every rank); the tensors move per flat parameter (or per original parameter with
/// use_orig_params); the returning rank adds user-defined state and the param groups.
pub(crate) fn consolidate<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    osd: &OptimStateDict<T>,
    params: &OptimParams,
    opts: ConsolidateOptions,
) -> Result<Option<OptimStateDict<T>>> {
    let (local, plans) = exchange_plans(op, layout, pg, osd, params, opts)?;
    let by_skey: HashMap<&OptimStateKey, &LocalParam> =
        local.iter().map(|l| (&l.skey, l)).collect();
    let out = if layout.use_orig_params() {
        consolidate_orig_params(layout, pg, osd, &by_skey, &plans, opts)?
    } else {
        consolidate_flat_params(op, layout, pg, osd, &by_skey, &plans, opts)?
    };
    if !opts.to_save {
        return Ok(None);
    }
    let mut state = out;
    pass_user_state(layout, &local, osd, &mut state);
    let param_groups = named_param_groups(
        "consolidating the optimizer state dict",
        &local,
        osd.param_groups.as_deref(),
    )?;
    Ok(Some(OptimStateDict {
        state,
        param_groups,
    }))
}

/// This rank's parameters and every rank's plan. A rank whose own input is invalid sends its
/// error instead of a plan, so that every rank fails with the lowest failing rank's error
/// instead of hanging; every rank then checks that the layouts agree.
fn exchange_plans<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    osd: &OptimStateDict<T>,
    params: &OptimParams,
    opts: ConsolidateOptions,
) -> Result<(Vec<LocalParam>, Vec<PlanMsg>)> {
    let local = layout.local_params(params);
    let local_plan = local.as_ref().map_err(Clone::clone).and_then(|l| {
        if opts
            .gather_root()
            .is_some_and(|root| opts.to_save && root != pg.rank())
        {
            return Err(Error::InvalidCollective {
                op: op.into(),
                rank: pg.rank(),
                reason: "with rank0_only only rank 0 of the group can return the dict".into(),
            });
        }
        local_plan(op, layout, osd, l, pg.rank())
    });
    // A rank whose own input is invalid makes every rank fail with its error.
    let plans: Vec<PlanMsg> = pg.all_gather_agreed(local_plan)?;
    let local = local?;
    check_digests(op, &plans.iter().map(|p| p.digest).collect::<Vec<_>>())?;
    Ok((local, plans))
}

/// use_orig_params=False: every flat parameter's state gathered and cut per member, in rank
/// 0's key order; unmanaged state as this rank holds it.
fn consolidate_flat_params<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    osd: &OptimStateDict<T>,
    by_skey: &HashMap<&OptimStateKey, &LocalParam>,
    plans: &[PlanMsg],
    opts: ConsolidateOptions,
) -> Result<IndexMap<ParamKey, ParamState<T>>> {
    let mut out: IndexMap<ParamKey, ParamState<T>> = IndexMap::new();
    for k in &agree_flat_keys(op, layout, plans)? {
        // agree_flat_keys checked that every rank holds state for rank 0's keys.
        let missing = || Error::MissingStateOnRanks {
            missing: vec![(pg.rank(), vec![k.key.names.clone()])],
        };
        let l = by_skey.get(&k.key).ok_or_else(missing)?;
        let st = osd.state.get(&l.key).ok_or_else(missing)?;
        match l.resolved {
            Resolved::Flat(f) => {
                let fl = &layout.flat_params[f];
                let per_member = unflatten_flat_state(fl, pg, st, opts.gather_root())?;
                if opts.to_save {
                    for (m, s) in fl.members.iter().zip(per_member) {
                        out.insert(ParamKey::Name(m.fqn.clone()), maybe_shard(s, opts, pg)?);
                    }
                }
            }
            Resolved::Orig { .. } => {
                if opts.to_save {
                    out.insert(ParamKey::Name(k.key.names[0].clone()), st.clone());
                }
            }
        }
    }
    Ok(out)
}

/// use_orig_params=True: unmanaged keys in sorted order as this rank holds them, then each
/// flat parameter's original parameters rebuilt from every rank's views.
fn consolidate_orig_params<T: Tensor>(
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    osd: &OptimStateDict<T>,
    by_skey: &HashMap<&OptimStateKey, &LocalParam>,
    plans: &[PlanMsg],
    opts: ConsolidateOptions,
) -> Result<IndexMap<ParamKey, ParamState<T>>> {
    let mut out: IndexMap<ParamKey, ParamState<T>> = IndexMap::new();
    let keys: BTreeSet<&OptimStateKey> = plans
        .iter()
        .flat_map(|p| p.keys.iter().map(|k| &k.key))
        .collect();
    let infos: Vec<HashMap<&OptimStateKey, &KeyInfo>> = plans
        .iter()
        .map(|p| p.keys.iter().map(|k| (&k.key, k)).collect())
        .collect();
    let local_state = |k: &OptimStateKey| by_skey.get(k).and_then(|l| osd.state.get(&l.key));
    let mut groups: IndexMap<usize, Vec<&OptimStateKey>> = IndexMap::new();
    for k in keys {
        if !k.managed {
            if let (true, Some(st)) = (opts.to_save, local_state(k)) {
                out.insert(ParamKey::Name(k.names[0].clone()), st.clone());
            }
            continue;
        }
        groups
            .entry(flat_of_key(layout, k)?.index)
            .or_default()
            .push(k);
    }
    for (f, ks) in groups {
        let fl = &layout.flat_params[f];
        let local_states: Vec<Option<&ParamState<T>>> = ks.iter().map(|k| local_state(k)).collect();
        let gathered =
            gather_orig_param_states(fl, pg, &ks, &local_states, &infos, opts.gather_root())?;
        if opts.to_save {
            for (k, s) in ks.iter().zip(gathered) {
                out.insert(
                    ParamKey::Name(k.names[0].clone()),
                    maybe_shard(s, opts, pg)?,
                );
            }
        }
    }
    Ok(out)
}

/// User-defined state: keys that no optimizer parameter owns pass through to `out`.
fn pass_user_state<T: Tensor>(
    layout: &ModelLayout,
    local: &[LocalParam],
    osd: &OptimStateDict<T>,
    out: &mut IndexMap<ParamKey, ParamState<T>>,
) {
    let flat_fqns: BTreeSet<String> = layout
        .flat_params
        .iter()
        .map(FlatParamLayout::fqn)
        .collect();
    let owned: BTreeSet<&ParamKey> = local.iter().map(|l| &l.key).collect();
    for (k, v) in &osd.state {
        let skip = out.contains_key(k)
            || owned.contains(k)
            || k.as_name().is_some_and(|n| flat_fqns.contains(n));
        if !skip {
            out.insert(k.clone(), v.clone());
        }
    }
}

/// The param groups with each optimizer key replaced by the names of the parameters it
/// stands for; `context` names the operation in the error for a key no parameter holds.
pub(crate) fn named_param_groups<T: Tensor>(
    context: &str,
    local: &[LocalParam],
    groups: Option<&[ParamGroup<T>]>,
) -> Result<Option<Vec<ParamGroup<T>>>> {
    let Some(groups) = groups else {
        return Ok(None);
    };
    let by_key: HashMap<&ParamKey, &LocalParam> = local.iter().map(|l| (&l.key, l)).collect();
    let mut res = Vec::with_capacity(groups.len());
    for (gi, g) in groups.iter().enumerate() {
        let mut names = Vec::new();
        for p in &g.params {
            let l = by_key.get(p).ok_or_else(|| Error::InvalidParamGroups {
                context: context.into(),
                group: Some(gi),
                reason: format!(
                    "lists the key {p}, which the optimizer's param groups do not hold"
                ),
            })?;
            names.extend(l.skey.names.iter().map(|n| ParamKey::Name(n.clone())));
        }
        res.push(ParamGroup {
            options: g.options.clone(),
            params: names,
        });
    }
    Ok(Some(res))
}

fn local_plan<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    osd: &OptimStateDict<T>,
    local: &[LocalParam],
    rank: usize,
) -> Result<PlanMsg> {
    let mut keys = Vec::new();
    for l in local {
        if let Some(st) = osd.state.get(&l.key) {
            if let Some((n, v)) = st.iter().find(|(_, v)| matches!(v, Value::Sharded(_))) {
                return Err(Error::WrongStateKind {
                    context: format!("rank {rank}: local optimizer state"),
                    param: l.key.to_string(),
                    state: n.clone(),
                    expected: "a plain tensor".into(),
                    found: v.kind(),
                });
            }
            keys.push(KeyInfo::of(&l.skey, st)?);
        }
    }
    Ok(PlanMsg {
        digest: layout_digest(op, layout)?,
        keys,
    })
}

/// use_orig_params=False: rank 0's keys in rank 0's order; every rank must hold them all, and
/// the tensor states of every flat parameter must have the same names, shapes and dtypes.
fn agree_flat_keys<'a>(
    op: &str,
    layout: &ModelLayout,
    plans: &'a [PlanMsg],
) -> Result<Vec<&'a KeyInfo>> {
    let r0 = &plans[0].keys;
    let mut missing = Vec::new();
    let mut per_rank: Vec<HashMap<&OptimStateKey, &KeyInfo>> = Vec::new();
    for (r, p) in plans.iter().enumerate() {
        let have: HashMap<&OptimStateKey, &KeyInfo> = p.keys.iter().map(|k| (&k.key, k)).collect();
        let lacks: Vec<Vec<String>> = r0
            .iter()
            .filter(|k| !have.contains_key(&k.key))
            .map(|k| k.key.names.clone())
            .collect();
        if !lacks.is_empty() {
            missing.push((r, lacks));
        }
        per_rank.push(have);
    }
    if !missing.is_empty() {
        return Err(Error::MissingStateOnRanks { missing });
    }
    for k in r0.iter().filter(|k| k.key.managed) {
        let f = flat_of_key(layout, &k.key)?;
        let c = f.shard_numel();
        let tensors = |ki: &KeyInfo| -> Vec<(String, StateInfo)> {
            ki.states
                .iter()
                .filter(|(_, s)| matches!(s, StateInfo::Tensor { .. }))
                .cloned()
                .collect()
        };
        let reference = tensors(k);
        for (name, s) in &reference {
            if let StateInfo::Tensor { shape, .. } = s {
                if shape != &vec![c] {
                    return Err(Error::ShapeMismatch {
                        context: format!(
                            "state `{name}` of the flat parameter of unit `{}` on rank 0 (a local shard has {c} elements)",
                            f.unit
                        ),
                        expected: vec![c],
                        found: shape.clone(),
                    });
                }
            }
        }
        let differ: Vec<usize> = (1..plans.len())
            .filter(|&r| tensors(per_rank[r][&k.key]) != reference)
            .collect();
        if !differ.is_empty() {
            return Err(Error::PlanMismatch {
                op: op.into(),
                reference: 0,
                ranks: differ.clone(),
                detail: format!(
                    "tensor states of the flat parameter of unit `{}` differ: rank 0 has {:?}, rank {} has {:?}",
                    f.unit,
                    reference,
                    differ[0],
                    tensors(per_rank[differ[0]][&k.key])
                ),
            });
        }
    }
    Ok(r0.iter().collect())
}

fn flat_of_key<'a>(layout: &'a ModelLayout, key: &OptimStateKey) -> Result<&'a FlatParamLayout> {
    let idx = layout
        .param_index(&key.names[0])
        .ok_or_else(|| Error::UnknownParameter {
            name: key.names[0].clone(),
            site: LookupSite::OtherRanksOptimizer,
        })?;
    match layout.ownership[idx] {
        Ownership::Flat { flat, .. } => Ok(&layout.flat_params[flat]),
        Ownership::Unmanaged => Err(Error::WrongOptimParam {
            param: format!("`{}`", key.names[0]),
            reason: "it is not managed by FSDP".into(),
        }),
    }
}

/// Gathers `local` (this rank's `c` elements) into the `c * world_size` buffer: on every
/// rank (`root` `None`, an all-gather) or on `root` alone (the others get `None`).
fn gather_shard<T: Tensor>(
    pg: &dyn ProcessGroup,
    local: &T,
    padded_numel: usize,
    root: Option<usize>,
) -> Result<Option<T>> {
    let host = local.to_host()?;
    let send = host.as_bytes();
    // The collective writes every byte of the receive buffer (or fails, dropping it).
    let full = match root {
        None => HostTensor::filled_by(host.dtype(), &[padded_numel], |recv| {
            pg.all_gather_into(send, recv)
        })?,
        Some(root) if root == pg.rank() => {
            HostTensor::filled_by(host.dtype(), &[padded_numel], |recv| {
                pg.gather_into(send, Some(recv), root)
            })?
        }
        Some(root) => {
            pg.gather_into(send, None, root)?;
            return Ok(None);
        }
    };
    T::from_host(full).map(Some)
}

/// use_orig_params=False: gathers one flat parameter's state and splits it per member, in
/// PyTorch's order (sorted tensor states, sorted 0-dim states, sorted plain values).
fn unflatten_flat_state<T: Tensor>(
    fl: &FlatParamLayout,
    pg: &dyn ProcessGroup,
    st: &ParamState<T>,
    root: Option<usize>,
) -> Result<Vec<ParamState<T>>> {
    let mut names: Vec<&String> = st.keys().collect();
    names.sort();
    let mut per_member: Vec<ParamState<T>> = vec![ParamState::new(); fl.members.len()];
    for name in names.iter().filter(|n| st[n.as_str()].is_pos_dim_tensor()) {
        let Value::Tensor(local) = &st[name.as_str()] else {
            unreachable!("checked pos-dim")
        };
        let full = if fl.sharded {
            gather_shard(pg, local, fl.padded_numel(), root)?
        } else {
            Some(local.clone())
        };
        // Ranks that gather nothing return nothing either.
        let Some(full) = full else { continue };
        for (m, view) in unflatten_full(fl, &full)?.into_iter().enumerate() {
            per_member[m].insert((*name).clone(), Value::Tensor(view));
        }
    }
    for pass in [true, false] {
        for name in names.iter().filter(|n| {
            let v = &st[n.as_str()];
            !v.is_pos_dim_tensor() && v.is_zero_dim_tensor() == pass
        }) {
            for s in per_member.iter_mut() {
                s.insert((*name).clone(), st[name.as_str()].clone());
            }
        }
    }
    Ok(per_member)
}

/// use_orig_params=True: rebuilds each original parameter's full state from every rank's
/// views (`_gather_all_orig_param_state`), for the keys `keys` of flat parameter `fl`.
///
/// Phases: map keys to members and check that every trainable member has state; per key,
/// agree on the tensor states' names and dtype and on the scalar states (from the exchanged
/// plans, identically on every rank); check every rank's view sizes; then gather each
/// tensor state and cut it per member.
fn gather_orig_param_states<T: Tensor>(
    fl: &FlatParamLayout,
    pg: &dyn ProcessGroup,
    keys: &[&OptimStateKey],
    local: &[Option<&ParamState<T>>],
    infos: &[HashMap<&OptimStateKey, &KeyInfo>],
    root: Option<usize>,
) -> Result<Vec<ParamState<T>>> {
    let member_of = members_with_state(fl, keys)?;
    if !fl.sharded {
        return Ok(local
            .iter()
            .map(|s| s.cloned().unwrap_or_default())
            .collect());
    }
    let world = pg.world_size();
    let mut outputs: Vec<ParamState<T>> = vec![ParamState::new(); keys.len()];
    let mut tensor_names: Vec<String> = Vec::new();
    let mut dtype: Option<(DType, String)> = None;
    for (ki, k) in keys.iter().enumerate() {
        let rank_infos: Vec<Option<&KeyInfo>> =
            (0..world).map(|r| infos[r].get(k).copied()).collect();
        let names = tensor_state_names(fl, k, &rank_infos, &mut dtype)?;
        let empty = ranks_without_elements(&names, &rank_infos);
        for n in names {
            if !tensor_names.contains(n) {
                tensor_names.push(n.clone());
            }
        }
        for (n, v) in agreed_scalars(k, &rank_infos, &empty)? {
            outputs[ki].insert(n, v.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?);
        }
    }
    let Some((dtype, _)) = dtype else {
        return Ok(outputs);
    };
    precheck_orig_views(fl, keys, &member_of, &tensor_names, infos)?;
    for name in &tensor_names {
        gather_orig_tensor_state(fl, pg, name, dtype, local, &member_of, root, &mut outputs)?;
    }
    Ok(outputs)
}

/// The member index of each key, after checking that every trainable member has state
/// somewhere once its flat parameter has any.
fn members_with_state(fl: &FlatParamLayout, keys: &[&OptimStateKey]) -> Result<Vec<usize>> {
    let member_of: Vec<usize> = keys
        .iter()
        .map(|k| {
            fl.member_index(&k.names[0]).ok_or_else(|| {
                Error::Internal(format!(
                    "key `{}` is not a member of flat parameter `{}`",
                    k.names[0], fl.unit
                ))
            })
        })
        .collect::<Result<_>>()?;
    for (mi, m) in fl.members.iter().enumerate() {
        if m.requires_grad && !member_of.contains(&mi) {
            return Err(Error::MissingParamState {
                param: m.fqn.clone(),
                unit: fl.unit.clone(),
            });
        }
    }
    Ok(member_of)
}

/// The names of key `k`'s tensor states on any rank, checking that every tensor state of the
/// flat parameter has one dtype (`dtype` carries the first one seen across keys).
fn tensor_state_names<'a>(
    fl: &FlatParamLayout,
    k: &OptimStateKey,
    rank_infos: &[Option<&'a KeyInfo>],
    dtype: &mut Option<(DType, String)>,
) -> Result<BTreeSet<&'a String>> {
    let mut names: BTreeSet<&String> = BTreeSet::new();
    for (r, info) in rank_infos
        .iter()
        .enumerate()
        .filter_map(|(r, i)| i.map(|i| (r, i)))
    {
        for (n, s) in &info.states {
            if let StateInfo::Tensor { dtype: d, .. } = s {
                names.insert(n);
                let label = format!("{d} (`{n}` of {} on rank {r})", k.names[0]);
                match &dtype {
                    Some((x, first)) if x != d => {
                        return Err(Error::TensorStateDtypeMismatch {
                            state: n.clone(),
                            params: fl.fqns(),
                            dtypes: vec![first.clone(), label],
                        });
                    }
                    Some(_) => {}
                    None => *dtype = Some((*d, label)),
                }
            }
        }
    }
    Ok(names)
}

/// The ranks that hold no element of the parameter (every tensor state empty or absent):
/// their scalars do not count.
fn ranks_without_elements(
    names: &BTreeSet<&String>,
    rank_infos: &[Option<&KeyInfo>],
) -> BTreeSet<usize> {
    (0..rank_infos.len())
        .filter(|&r| {
            !names.is_empty()
                && names.iter().all(|n| {
                    rank_infos[r]
                        .and_then(|i| i.get(n))
                        .map_or(0, StateInfo::numel)
                        == 0
                })
        })
        .collect()
}

/// Key `k`'s scalar states (plain values first, then 0-dim tensors, each sorted by name),
/// taken from the ranks that hold elements of the parameter; they must agree.
fn agreed_scalars(
    k: &OptimStateKey,
    rank_infos: &[Option<&KeyInfo>],
    empty: &BTreeSet<usize>,
) -> Result<Vec<(String, Value<HostTensor>)>> {
    let mut scalars: Vec<(String, Value<HostTensor>, usize)> = Vec::new();
    for r in (0..rank_infos.len()).filter(|r| !empty.contains(r)) {
        let Some(info) = rank_infos[r] else { continue };
        let mut plain: Vec<(&String, &Value<HostTensor>)> = Vec::new();
        let mut zero: Vec<(&String, &Value<HostTensor>)> = Vec::new();
        for (n, s) in &info.states {
            if let StateInfo::Scalar(v) = s {
                if matches!(v, Value::Tensor(_)) {
                    zero.push((n, v))
                } else {
                    plain.push((n, v))
                }
            }
        }
        plain.sort_by(|a, b| a.0.cmp(b.0));
        zero.sort_by(|a, b| a.0.cmp(b.0));
        for (n, v) in plain.into_iter().chain(zero) {
            match scalars.iter().find(|(sn, _, _)| sn == n) {
                Some((_, prev, pr)) if !prev.same_scalar(v) => {
                    return Err(Error::ScalarStateMismatch {
                        state: n.clone(),
                        params: vec![
                            format!("{} on rank {pr}", k.names[0]),
                            format!("{} on rank {r}", k.names[0]),
                        ],
                        values: vec![prev.render(), v.render()],
                    });
                }
                Some(_) => {}
                None => scalars.push((n.clone(), v.clone(), r)),
            }
        }
    }
    Ok(scalars.into_iter().map(|(n, v, _)| (n, v)).collect())
}

/// Gathers tensor state `name` of flat parameter `fl` from every rank's views and stores each
/// member's full tensor in `outputs` (on the ranks that receive it).
#[allow(clippy::too_many_arguments)]
fn gather_orig_tensor_state<T: Tensor>(
    fl: &FlatParamLayout,
    pg: &dyn ProcessGroup,
    name: &str,
    dtype: DType,
    local: &[Option<&ParamState<T>>],
    member_of: &[usize],
    root: Option<usize>,
    outputs: &mut [ParamState<T>],
) -> Result<()> {
    let rank = pg.rank();
    let shard = fl.shard(rank);
    // This rank's padded shard of the flat state: members' local views (their sizes were
    // checked by `precheck_orig_views`), zeros for padding and frozen members without state.
    let views: Vec<Option<&T>> = local
        .iter()
        .map(|st| st.and_then(|st| st.get(name)).and_then(Value::as_tensor))
        .collect();
    let local_shard = shard_from_members(fl, rank, dtype, |m| {
        let ki = member_of.iter().position(|&x| x == m)?;
        views[ki].map(|t| (t, shard.params[m].intra_param_start_idx))
    })?;
    let Some(full) = gather_shard(pg, &local_shard, fl.padded_numel(), root)? else {
        return Ok(());
    };
    let views = unflatten_full(fl, &full)?;
    for (ki, &m) in member_of.iter().enumerate() {
        outputs[ki].insert(name.to_string(), Value::Tensor(views[m].clone()));
    }
    Ok(())
}

/// Checks, from the exchanged plans and identically on every rank, that each rank's view of
/// each parameter has exactly its shard's elements for every tensor state, before any
/// tensor moves.
fn precheck_orig_views(
    fl: &FlatParamLayout,
    keys: &[&OptimStateKey],
    member_of: &[usize],
    tensor_names: &[String],
    infos: &[HashMap<&OptimStateKey, &KeyInfo>],
) -> Result<()> {
    for (r, rank_info) in infos.iter().enumerate() {
        let shard = fl.shard(r);
        for (ki, k) in keys.iter().enumerate() {
            let want = shard.params[member_of[ki]].numel_in_shard;
            let info = rank_info.get(k);
            for name in tensor_names {
                match info.and_then(|i| i.get(name)) {
                    Some(StateInfo::Tensor { shape, .. }) if shape.iter().product::<usize>() != want => {
                        return Err(Error::ShapeMismatch {
                            context: format!(
                                "state `{name}` of parameter `{}` on rank {r} (its shard holds {want} elements)",
                                k.names[0]
                            ),
                            expected: vec![want],
                            found: shape.clone(),
                        })
                    }
                    None if want > 0 && info.is_some() => {
                        return Err(Error::MissingState {
                            context: format!("rank {r}"),
                            param: format!("parameter `{}` ({want} elements there)", k.names[0]),
                            state: name.clone(),
                        })
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

fn maybe_shard<T: Tensor>(
    s: ParamState<T>,
    opts: ConsolidateOptions,
    pg: &dyn ProcessGroup,
) -> Result<ParamState<T>> {
    if !opts.shard_state {
        return Ok(s);
    }
    s.into_iter()
        .map(|(n, v)| {
            let v = match v {
                Value::Tensor(t) if t.dim() > 0 => {
                    Value::Sharded(chunk_dim0(&t, pg.rank(), pg.world_size())?)
                }
                other => other,
            };
            Ok((n, v))
        })
        .collect()
}

/// Rank `rank`'s `torch.chunk(world_size, dim=0)` piece of `t` with its global shape and offset.
pub fn chunk_dim0<T: Tensor>(t: &T, rank: usize, world_size: usize) -> Result<ShardedTensor<T>> {
    let shape = t.shape();
    let rows = shape[0];
    let row_numel: usize = shape[1..].iter().product();
    let c = rows.div_ceil(world_size.max(1));
    let mut offsets = vec![0; shape.len()];
    let (start, end) = if c == 0 {
        (0, if rank == 0 { 0 } else { 1 })
    } else {
        (c * rank, (c * (rank + 1)).min(rows))
    };
    let local = if start < end || (rows == 0 && rank == 0) {
        offsets[0] = start;
        let mut lshape = shape.clone();
        lshape[0] = end - start;
        Some(
            t.narrow_flat(start * row_numel, (end - start) * row_numel)?
                .reshape(&lshape)?,
        )
    } else {
        offsets[0] = rows;
        None
    };
    Ok(ShardedTensor {
        global_shape: shape,
        offsets,
        local,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::ThreadGroup;
    use crate::model::{ModelDesc, WrapPolicy};
    use crate::optim_state::flatten_optim_state_dict;
    use std::time::Duration;

    /// `consolidate` with rank-0-only gathering but a non-zero rank asking to return the
    /// dict: that rank would get no tensors, so every rank refuses before anything moves.
    #[test]
    fn rank0_only_consolidation_that_asks_rank_1_to_save() {
        let model = ModelDesc::new()
            .param("unit.a", &[2, 3], DType::F32)
            .param("unit.b", &[3], DType::F32)
            .param("head.w", &[2], DType::F32);
        let policy = WrapPolicy::units(&["unit"]);
        let mut full = OptimStateDict::default();
        for p in &model.params {
            let mut st = ParamState::new();
            st.insert(
                "exp_avg".into(),
                Value::Tensor(HostTensor::zeros(DType::F32, &p.shape)),
            );
            st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
            full.state.insert(ParamKey::Name(p.name.clone()), st);
        }
        let errs = ThreadGroup::run_with_timeout(2, Duration::from_secs(60), |pg| {
            let layout = ModelLayout::new(&model, &policy, 2).unwrap();
            let params = OptimParams::of_model(&layout);
            let local = flatten_optim_state_dict(&layout, pg.rank(), &full, &params).unwrap();
            let opts = ConsolidateOptions {
                shard_state: false,
                to_save: true, // on every rank, but only rank 0 receives with rank0_only
                rank0_only: true,
            };
            consolidate("test", &layout, &pg, &local, &params, opts).unwrap_err()
        });
        for err in errs {
            assert!(
                matches!(&err, Error::InvalidCollective { op, rank: 1, .. } if op == "test"),
                "{err:?}"
            );
            assert!(err.to_string().contains("rank0_only"), "{err}");
        }
    }
}
