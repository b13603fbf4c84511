//! Flattening a full (unflattened, name-keyed) optimizer state dict into one rank's local
//! dict for its optimizer (`_flatten_optim_state_dict` + `_rekey_sharded_optim_state_dict`).
//!
//! Pure: no communication. Each parameter's part for a rank is cut by
//! [`flat_param_state_for_rank`] / [`orig_param_state_for_rank`] and handed to the keying loop
//! through a [`ShardSource`], so a dict in memory and a scatter from rank 0 (whose root cuts
//! every rank's part with the same functions) run the same code.

use super::keys::{OptimStateKey, Resolved};
use super::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::error::{Error, LookupSite, Result};
use crate::flat_param::{shard_from_members, FlatParamLayout, ModelLayout};
use crate::tensor::Tensor;
use indexmap::IndexMap;
use std::collections::{BTreeSet, HashMap, HashSet};

/// Supplies one rank's flattened state of each flat parameter and original parameter, as
/// [`flatten_from_source`] asks for them (model order, every rank the same sequence).
///
/// [`DictSource`] cuts it from a full dict in memory; the scatter source receives it from the
/// rank holding the full dict, which cuts every rank's part with the same functions
/// ([`flat_param_state_for_rank`], [`orig_param_state_for_rank`]).
pub trait ShardSource<T: Tensor> {
    /// This rank's shard state of flat parameter `f`; `None` when no member has state.
    fn flat_param(&mut self, layout: &ModelLayout, f: usize) -> Result<Option<ParamState<T>>>;

    /// This rank's part of the state of original parameter `param` (`owner`: its flat
    /// parameter and member, `None` when unmanaged); `None` when this rank gets none.
    fn orig_param(
        &mut self,
        layout: &ModelLayout,
        param: usize,
        owner: Option<(usize, usize)>,
    ) -> Result<Option<ParamState<T>>>;
}

/// A full dict held in memory, cut for `rank`.
pub struct DictSource<'a, T> {
    /// The full (name-keyed) dict.
    pub full: &'a OptimStateDict<T>,
    /// The rank within the layout's shard group.
    pub rank: usize,
}

impl<T: Tensor> ShardSource<T> for DictSource<'_, T> {
    fn flat_param(&mut self, layout: &ModelLayout, f: usize) -> Result<Option<ParamState<T>>> {
        flat_param_state_for_rank(&layout.flat_params[f], self.rank, self.full)
    }

    fn orig_param(
        &mut self,
        layout: &ModelLayout,
        param: usize,
        owner: Option<(usize, usize)>,
    ) -> Result<Option<ParamState<T>>> {
        orig_param_state_for_rank(layout, param, owner, self.rank, self.full)
    }
}

/// Cuts one positive-dim tensor state of a flat parameter for a rank, from the state name and
/// each member's value (see [`flatten_flat_param_with`]).
pub(crate) type TensorStateFn<'a, T> = dyn FnMut(&str, &[Option<&Value<T>>]) -> Result<T> + 'a;

fn state_of<'a, T>(full: &'a OptimStateDict<T>, fqn: &str) -> Option<&'a ParamState<T>> {
    full.state.get(&ParamKey::Name(fqn.to_string()))
}

/// Rank `rank`'s shard state of flat parameter `fl` from the full dict `full`
/// (`_flatten_optim_state`); `None` when no member has state. Pure.
pub fn flat_param_state_for_rank<T: Tensor>(
    fl: &FlatParamLayout,
    rank: usize,
    full: &OptimStateDict<T>,
) -> Result<Option<ParamState<T>>> {
    flat_param_state_with(fl, full, &mut |sname, values| {
        flatten_tensor_state(fl, rank, sname, values)
    })
}

/// [`flat_param_state_for_rank`] with the positive-dim tensor states cut by `tensor_state`
/// (see [`flatten_flat_param_with`]).
pub(crate) fn flat_param_state_with<T: Tensor>(
    fl: &FlatParamLayout,
    full: &OptimStateDict<T>,
    tensor_state: &mut TensorStateFn<'_, T>,
) -> Result<Option<ParamState<T>>> {
    let member_states: Vec<Option<ParamState<T>>> = fl
        .members
        .iter()
        .map(|m| state_of(full, &m.fqn).cloned())
        .collect();
    if member_states.iter().all(Option::is_none) {
        return Ok(None);
    }
    let s = flatten_flat_param_with(fl, &member_states, tensor_state)?;
    if s.is_empty() {
        return Err(Error::MissingState {
            context: "flattening".into(),
            param: format!("the flat parameter of unit `{}` ({:?})", fl.unit, fl.fqns()),
            state: String::new(),
        });
    }
    Ok(Some(s))
}

/// Rank `rank`'s part of original parameter `param`'s state from the full dict `full`
/// (`_shard_orig_param_state` when managed, the whole state when not); `None` when there is
/// no state or the rank holds none of the parameter. Pure.
pub fn orig_param_state_for_rank<T: Tensor>(
    layout: &ModelLayout,
    param: usize,
    owner: Option<(usize, usize)>,
    rank: usize,
    full: &OptimStateDict<T>,
) -> Result<Option<ParamState<T>>> {
    let Some(st) = state_of(full, layout.state_fqn(param)) else {
        return Ok(None);
    };
    match owner {
        Some((f, m)) => {
            let s = shard_orig_param_state(&layout.flat_params[f], m, rank, st.clone())?;
            Ok((!s.is_empty()).then_some(s))
        }
        None => Ok(Some(st.clone())),
    }
}

/// Every name that refers to a model parameter (state FQNs, primaries and aliases).
pub(crate) fn parameter_names(layout: &ModelLayout) -> HashSet<String> {
    layout.fqn_index().into_keys().collect()
}

/// Entries of a name-keyed dict that belong to no parameter: user-defined state, passed through.
pub(crate) fn user_state<T: Tensor>(
    layout: &ModelLayout,
    full: &OptimStateDict<T>,
) -> Vec<(ParamKey, ParamState<T>)> {
    let names = parameter_names(layout);
    full.state
        .iter()
        .filter(|(k, _)| match k {
            ParamKey::Name(n) => !names.contains(n),
            ParamKey::Id(_) => true,
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// `shard_full_optim_state_dict` for one rank: flattens and shards `full` for the optimizer
/// described by `params`, keyed by this optimizer's ids (or names for a named optimizer).
pub fn flatten_optim_state_dict<T: Tensor>(
    layout: &ModelLayout,
    rank: usize,
    full: &OptimStateDict<T>,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    if let Some(k) = full.state.keys().find(|k| matches!(k, ParamKey::Id(_))) {
        return Err(Error::WrongKeyType {
            dict: "a full optimizer state dict".into(),
            expected: "parameter names".into(),
            key: k.to_string(),
            hint: "; rekey it with rekey_optim_state_dict(.., ParamName, ..) first".into(),
        });
    }
    let user = user_state(layout, full);
    flatten_from_source(
        layout,
        &mut DictSource { full, rank },
        full.param_groups.as_deref(),
        user,
        params,
    )
}

/// The flattening loop over any [`ShardSource`]: keys each parameter's state for this rank's
/// optimizer, appends the user-defined state and maps the param groups.
pub fn flatten_from_source<T: Tensor>(
    layout: &ModelLayout,
    source: &mut dyn ShardSource<T>,
    param_groups: Option<&[ParamGroup<T>]>,
    user: Vec<(ParamKey, ParamState<T>)>,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    let local = layout.local_params(params)?;
    let skey_to_key: HashMap<&OptimStateKey, &ParamKey> =
        local.iter().map(|l| (&l.skey, &l.key)).collect();
    let mut state: IndexMap<ParamKey, ParamState<T>> = IndexMap::new();
    for r in layout.model_order() {
        let skey = layout.state_key(r);
        let flat_state = match r {
            Resolved::Flat(f) => source.flat_param(layout, f)?,
            Resolved::Orig { param, owner } => source.orig_param(layout, param, owner)?,
        };
        let Some(flat_state) = flat_state else {
            continue;
        };
        // State of a parameter this rank's optimizer does not hold is dropped.
        if let Some(key) = skey_to_key.get(&skey) {
            state.insert((*key).clone(), flat_state);
        }
    }
    for (k, v) in user {
        state.insert(k, v);
    }
    let param_groups = match param_groups {
        None => None,
        Some(groups) => {
            let mut name_to_key: HashMap<&str, &ParamKey> = HashMap::new();
            for l in &local {
                for n in &l.skey.names {
                    name_to_key.insert(n, &l.key);
                }
            }
            let mut out = Vec::with_capacity(groups.len());
            for (gi, g) in groups.iter().enumerate() {
                let mut keys = BTreeSet::new();
                for p in &g.params {
                    let ParamKey::Name(n) = p else {
                        return Err(Error::WrongKeyType {
                            dict: format!("param_groups[{gi}] of a full optimizer state dict"),
                            expected: "parameter names".into(),
                            key: p.to_string(),
                            hint: String::new(),
                        });
                    };
                    let key =
                        name_to_key
                            .get(n.as_str())
                            .ok_or_else(|| Error::UnknownParameter {
                                name: n.clone(),
                                site: LookupSite::ParamGroupNotHeld { group: gi },
                            })?;
                    keys.insert((*key).clone());
                }
                out.push(ParamGroup {
                    options: g.options.clone(),
                    params: keys.into_iter().collect(),
                });
            }
            Some(out)
        }
    };
    Ok(OptimStateDict {
        state,
        param_groups,
    })
}

fn present<T>(v: Option<&Value<T>>) -> Option<&Value<T>> {
    v.filter(|v| !matches!(v, Value::None))
}

/// Flattens the unflattened states of one flat parameter's members (`_flatten_optim_state`),
/// with PyTorch's checks, the positive-dim tensor states cut by `tensor_state` (state name,
/// each member's value) after the checks every state gets.
pub(crate) fn flatten_flat_param_with<T: Tensor>(
    fl: &FlatParamLayout,
    member_states: &[Option<ParamState<T>>],
    tensor_state: &mut TensorStateFn<'_, T>,
) -> Result<ParamState<T>> {
    let names: Vec<String> = fl.fqns();
    // Same state names for every member that has state; output in the first one's order.
    let mut order: Option<Vec<&String>> = None;
    let mut name_sets = Vec::new();
    for st in member_states.iter().flatten() {
        let mut set: Vec<String> = st.keys().cloned().collect();
        set.sort();
        name_sets.push(set);
        if order.is_none() {
            order = Some(st.keys().collect());
        }
    }
    if name_sets.windows(2).any(|w| w[0] != w[1]) {
        return Err(Error::DifferingStateNames {
            params: names,
            names: name_sets,
        });
    }
    let order = order.unwrap_or_default();
    let mut out = ParamState::new();
    for sname in order {
        let values: Vec<Option<&Value<T>>> = member_states
            .iter()
            .map(|s| present(s.as_ref().and_then(|s| s.get(sname))))
            .collect();
        let non_none: Vec<&Value<T>> = values.iter().flatten().copied().collect();
        if non_none.is_empty() {
            out.insert(sname.clone(), Value::None);
            continue;
        }
        let all_pos = non_none.iter().all(|v| v.is_pos_dim_tensor());
        let all_zero = non_none.iter().all(|v| v.is_zero_dim_tensor());
        let all_plain = non_none.iter().all(|v| !v.is_tensor());
        let same_type = non_none
            .windows(2)
            .all(|w| std::mem::discriminant(w[0]) == std::mem::discriminant(w[1]));
        if !(same_type && (all_pos || all_zero || all_plain)) {
            return Err(Error::DifferingStateTypes {
                state: sname.clone(),
                params: names,
                kinds: values
                    .iter()
                    .map(|v| v.map_or("missing".into(), |v| v.kind()))
                    .collect(),
            });
        }
        let value = if all_pos {
            Value::Tensor(tensor_state(sname, &values)?)
        } else {
            if non_none.len() != values.len()
                || non_none.windows(2).any(|w| !w[0].same_scalar(w[1]))
            {
                return Err(Error::ScalarStateMismatch {
                    state: sname.clone(),
                    params: names,
                    values: values
                        .iter()
                        .map(|v| v.map_or("missing".into(), |v| v.render()))
                        .collect(),
                });
            }
            non_none[0].clone()
        };
        out.insert(sname.clone(), value);
    }
    Ok(out)
}

/// Concatenates positive-dim tensor states (zeros for members without the state) and cuts the
/// rank's padded shard without materializing the whole flat tensor.
pub(crate) fn flatten_tensor_state<T: Tensor>(
    fl: &FlatParamLayout,
    rank: usize,
    sname: &str,
    values: &[Option<&Value<T>>],
) -> Result<T> {
    flatten_tensor_parts(fl, rank, sname, values, None)
}

/// [`flatten_tensor_state`] where, with `ranges`, each positive-dim member's value is only
/// the part of its flattening the rank's shard covers: elements `ranges[m].0..` as a 1-D
/// tensor of `ranges[m].1` elements (what a reader that reads only the rank's bytes gives).
pub(crate) fn flatten_tensor_parts<T: Tensor>(
    fl: &FlatParamLayout,
    rank: usize,
    sname: &str,
    values: &[Option<&Value<T>>],
    ranges: Option<&[(usize, usize)]>,
) -> Result<T> {
    let mut tensors: Vec<Option<&T>> = Vec::with_capacity(values.len());
    let mut dtypes = BTreeSet::new();
    for v in values {
        match v {
            None => tensors.push(None),
            Some(Value::Tensor(t)) => {
                dtypes.insert(t.dtype());
                tensors.push(Some(t));
            }
            Some(other) => {
                return Err(Error::WrongStateKind {
                    context: "flattening".into(),
                    param: format!("unit `{}`", fl.unit),
                    state: sname.to_string(),
                    expected: "a tensor (gather sharded tensors before flattening)".into(),
                    found: other.kind(),
                })
            }
        }
    }
    if dtypes.len() != 1 {
        return Err(Error::TensorStateDtypeMismatch {
            state: sname.into(),
            params: fl.fqns(),
            dtypes: dtypes.iter().map(|d| d.to_string()).collect(),
        });
    }
    let dtype = *dtypes.iter().next().expect("one dtype");
    // Where each member's value starts in its flattening, and the shape it must have.
    let part = |m: usize| match ranges {
        Some(r) if !fl.members[m].shape.is_empty() => (r[m].0, vec![r[m].1]),
        _ => (0, fl.members[m].shape.clone()),
    };
    for (i, (m, t)) in fl.members.iter().zip(&tensors).enumerate() {
        match t {
            None if m.shape.is_empty() => {
                return Err(Error::ZeroDimParamWithoutState {
                    param: m.fqn.clone(),
                    state: sname.into(),
                })
            }
            Some(t) if t.shape() != part(i).1 => {
                return Err(Error::ShapeMismatch {
                    context: format!("state `{sname}` of parameter `{}`", m.fqn),
                    expected: part(i).1,
                    found: t.shape(),
                })
            }
            _ => {}
        }
    }
    shard_from_members(fl, rank, dtype, |m| tensors[m].map(|t| (t, part(m).0)))
}

/// Cuts rank `rank`'s part of one original parameter's full state (`_shard_orig_param_state`):
/// positive-dim tensors become the 1-D slice the rank's parameter view covers; an empty map
/// when the rank holds none of the parameter.
pub fn shard_orig_param_state<T: Tensor>(
    fl: &FlatParamLayout,
    member: usize,
    rank: usize,
    state: ParamState<T>,
) -> Result<ParamState<T>> {
    if state.is_empty() {
        return Ok(state);
    }
    let m = &fl.members[member];
    // Validate on every rank, holding elements or not, so that all ranks fail alike.
    for (name, v) in &state {
        match v {
            Value::Tensor(t) if t.dim() > 0 && t.shape() != m.shape => {
                return Err(Error::ShapeMismatch {
                    context: format!("state `{name}` of parameter `{}`", m.fqn),
                    expected: m.shape.clone(),
                    found: t.shape(),
                })
            }
            Value::Sharded(_) => {
                return Err(Error::WrongStateKind {
                    context: "flattening".into(),
                    param: format!("parameter `{}`", m.fqn),
                    state: name.to_string(),
                    expected: "a tensor (gather sharded tensors before flattening)".into(),
                    found: "a sharded tensor".into(),
                })
            }
            _ => {}
        }
    }
    let info = fl.shard(rank).params[member];
    if !info.in_shard {
        return Ok(ParamState::new());
    }
    let mut out = ParamState::new();
    for (name, v) in state {
        let v = match v {
            Value::Tensor(t) if t.dim() > 0 && fl.sharded => {
                Value::Tensor(t.narrow_flat(info.intra_param_start_idx, info.numel_in_shard)?)
            }
            other => other,
        };
        out.insert(name, v);
    }
    Ok(out)
}
