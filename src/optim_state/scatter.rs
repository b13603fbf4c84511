//! Load-side communication: scattering a full dict held by one rank
//! (`scatter_full_optim_state_dict`, rank-0-only `optim_state_dict_to_load`) and gathering the
//! row chunks of a sharded dict (`flatten_sharded_optim_state_dict`).

use super::flatten::{flatten_from_source, parameter_names, FullStateSource};
use super::plan::{check_digests, layout_digest};
use super::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::tensor::{DType, HostTensor, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A state value as broadcast ahead of the tensors: tensors by shape and dtype only.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Skel {
    Tensor { shape: Vec<usize>, dtype: DType },
    Value(Value<HostTensor>),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Skeleton {
    state: Vec<(ParamKey, Vec<(String, Skel)>)>,
    param_groups: Option<Vec<ParamGroup<HostTensor>>>,
}

fn skeleton_of<T: Tensor>(full: &OptimStateDict<T>) -> Result<Skeleton> {
    if let Some(k) = full.state.keys().find(|k| matches!(k, ParamKey::Id(_))) {
        return Err(Error::InvalidStateDict(format!(
            "a full optimizer state dict is keyed by parameter names, but it has the id key {k}"
        )));
    }
    let mut state = Vec::with_capacity(full.state.len());
    for (k, st) in &full.state {
        let mut entries = Vec::with_capacity(st.len());
        for (n, v) in st {
            let s = match v {
                Value::Tensor(t) if t.dim() > 0 => Skel::Tensor {
                    shape: t.shape(),
                    dtype: t.dtype(),
                },
                Value::Sharded(_) => {
                    return Err(Error::InvalidStateDict(format!(
                        "state `{n}` of {k} is a sharded tensor; scatter takes a full dict"
                    )))
                }
                other => Skel::Value(other.try_map(&mut |t: &T| t.to_host())?),
            };
            entries.push((n.clone(), s));
        }
        state.push((k.clone(), entries));
    }
    let param_groups = full
        .param_groups
        .as_ref()
        .map(|gs| {
            gs.iter()
                .map(|g| g.try_map(&mut |t: &T| t.to_host()))
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?;
    Ok(Skeleton {
        state,
        param_groups,
    })
}

/// Receives each parameter's tensors from the root when the flattening asks for them.
struct BroadcastSource<'a, T: Tensor> {
    pg: &'a dyn ProcessGroup,
    root: usize,
    skeleton: HashMap<String, Vec<(String, Skel)>>,
    full: Option<&'a OptimStateDict<T>>,
}

impl<T: Tensor> BroadcastSource<'_, T> {
    fn receive(&self, key: &ParamKey, entries: &[(String, Skel)]) -> Result<ParamState<T>> {
        let mut out = ParamState::new();
        for (n, s) in entries {
            let v = match s {
                Skel::Value(v) => v.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?,
                Skel::Tensor { shape, dtype } => {
                    let mut buf = match self.full {
                        Some(full) if self.pg.rank() == self.root => {
                            let t = full.state[key][n.as_str()]
                                .as_tensor()
                                .expect("skeleton says tensor")
                                .to_host()?;
                            // Copy into a private buffer: broadcast writes into its argument.
                            HostTensor::from_bytes(t.dtype(), t.shape(), t.as_bytes())?
                        }
                        _ => HostTensor::zeros(*dtype, shape),
                    };
                    self.pg.broadcast(buf.bytes_mut(), self.root)?;
                    Value::Tensor(T::from_host(buf)?)
                }
            };
            out.insert(n.clone(), v);
        }
        Ok(out)
    }
}

impl<T: Tensor> FullStateSource<T> for BroadcastSource<'_, T> {
    fn fetch(&mut self, fqn: &str) -> Result<Option<ParamState<T>>> {
        let Some(entries) = self.skeleton.get(fqn) else {
            return Ok(None);
        };
        self.receive(&ParamKey::Name(fqn.to_string()), entries)
            .map(Some)
    }
}

/// Every rank receives the full dict that `root` holds, one parameter's tensors at a time, and
/// flattens and shards it for its own optimizer. Collective over `pg`; `layout_rank` is the
/// rank within the layout's shard group.
pub fn scatter_full<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    layout_rank: usize,
    pg: &dyn ProcessGroup,
    root: usize,
    full: Option<&OptimStateDict<T>>,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    // Every rank checks its optimizer's parameters before the first tensor moves, and all
    // ranks fail with the first failing rank's error.
    let mine: (u64, Option<Error>) = (
        layout_digest(op, layout)?,
        layout.local_params(params).err(),
    );
    let all: Vec<(u64, Option<Error>)> = pg.all_gather_object(&mine)?;
    if let Some(e) = all.iter().find_map(|(_, e)| e.clone()) {
        return Err(e);
    }
    check_digests(op, &all.iter().map(|(d, _)| *d).collect::<Vec<_>>())?;
    let skeleton: std::result::Result<Skeleton, Error> = if pg.rank() == root {
        match full {
            Some(f) => skeleton_of(f),
            None => Err(Error::InvalidStateDict(format!(
                "{op}: the root rank {root} must pass the full dict"
            ))),
        }
    } else {
        Ok(Skeleton {
            state: vec![],
            param_groups: None,
        })
    };
    let skeleton: std::result::Result<Skeleton, Error> =
        pg.broadcast_object(Some(&skeleton), root)?;
    let skeleton = skeleton?;
    let names = parameter_names(layout);
    let mut src = BroadcastSource {
        pg,
        root,
        skeleton: HashMap::new(),
        full,
    };
    let mut user = Vec::new();
    for (k, entries) in skeleton.state {
        match &k {
            ParamKey::Name(n) if names.contains(n) => {
                src.skeleton.insert(n.clone(), entries);
            }
            _ => user.push((k.clone(), src.receive(&k, &entries)?)),
        }
    }
    let groups: Option<Vec<ParamGroup<T>>> = skeleton
        .param_groups
        .map(|gs| {
            gs.iter()
                .map(|g| g.try_map(&mut |t: &HostTensor| T::from_host(t.clone())))
                .collect()
        })
        .transpose()?;
    flatten_from_source(
        layout,
        layout_rank,
        &mut src,
        groups.as_deref(),
        user,
        params,
    )
}

/// Digest and (key, state, global shape) of every sharded tensor, as exchanged.
type ShardedPlan = (u64, Vec<(ParamKey, String, Vec<usize>)>);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ShardedEntry {
    key: ParamKey,
    state: String,
    global_shape: Vec<usize>,
    dtype: Option<DType>,
}

/// Replaces every sharded tensor of a `SHARDED_STATE_DICT` with the whole tensor, gathered
/// from the row chunks of every rank of `pg`.
pub fn gather_sharded<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
) -> Result<OptimStateDict<T>> {
    let mut entries = Vec::new();
    for (k, st) in &sharded.state {
        for (n, v) in st {
            if let Value::Sharded(s) = v {
                entries.push(ShardedEntry {
                    key: k.clone(),
                    state: n.clone(),
                    global_shape: s.global_shape.clone(),
                    dtype: s.local.as_ref().map(|t| t.dtype()),
                });
            }
        }
    }
    let mine = (
        layout_digest(op, layout)?,
        entries
            .iter()
            .map(|e| (e.key.clone(), e.state.clone(), e.global_shape.clone()))
            .collect::<Vec<_>>(),
    );
    let all: Vec<ShardedPlan> = pg.all_gather_object(&mine)?;
    check_digests(op, &all.iter().map(|a| a.0).collect::<Vec<_>>())?;
    let differ: Vec<usize> = (1..all.len()).filter(|&r| all[r].1 != all[0].1).collect();
    if let Some(&r) = differ.first() {
        let (a, b) = (&all[0].1, &all[r].1);
        let first = (0..a.len().max(b.len()))
            .find(|&i| a.get(i) != b.get(i))
            .unwrap_or(0);
        let show = |e: Option<&(ParamKey, String, Vec<usize>)>| {
            e.map_or("nothing".to_string(), |(k, n, s)| {
                format!("state `{n}` of {k} with global shape {s:?}")
            })
        };
        return Err(Error::PlanMismatch {
            op: op.into(),
            reference: 0,
            ranks: differ,
            detail: format!(
                "the sharded dicts differ: at entry {first} rank 0 has {} but rank {r} has {}",
                show(a.get(first)),
                show(b.get(first))
            ),
        });
    }
    let mut out = sharded.clone();
    for e in &entries {
        let Value::Sharded(s) = &sharded.state[&e.key][e.state.as_str()] else {
            unreachable!("listed above")
        };
        let bytes = match &s.local {
            Some(t) => t.to_host()?.as_bytes().to_vec(),
            None => Vec::new(),
        };
        let dtypes: Vec<Option<DType>> = pg.all_gather_object(&e.dtype)?;
        let dtype = dtypes
            .iter()
            .flatten()
            .next()
            .copied()
            .unwrap_or(DType::F32);
        let parts = pg.all_gather_bytes(&bytes)?;
        let joined: Vec<u8> = parts.concat();
        let full = HostTensor::from_bytes(dtype, &e.global_shape, &joined).map_err(|_| {
            Error::ShapeMismatch {
                context: format!("gathering sharded state `{}` of {}", e.state, e.key),
                expected: e.global_shape.clone(),
                found: vec![joined.len() / dtype.size()],
            }
        })?;
        out.state[&e.key].insert(e.state.clone(), Value::Tensor(T::from_host(full)?));
    }
    Ok(out)
}
