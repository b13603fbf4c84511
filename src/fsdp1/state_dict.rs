//! The state-dict API over FSDP1: what `get_optimizer_state_dict` / `set_optimizer_state_dict`
//! do for a `FullyShardedDataParallel` model, which is `FSDP.optim_state_dict` /
//! `FSDP.optim_state_dict_to_load` under `FULL_STATE_DICT` (rank 0 only with `cpu_offload`)
//! or `SHARDED_STATE_DICT`; and what `get_model_state_dict` / `set_model_state_dict` do, over
//! the same paths.

use super::Fsdp;
use crate::collectives::ProcessGroupExt;
use crate::error::{Error, Result};
use crate::optim_state::keys::Resolved;
use crate::optim_state::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::state_dict::{
    missing_dict, with_tied_aliases, ModelStateDict, OptimStateDictApi, StateDictApi,
    StateDictOptions,
};
use crate::tensor::{DType, Tensor};
use indexmap::IndexMap;
use std::collections::HashMap;

impl OptimStateDictApi for Fsdp {
    fn get_optimizer_state_dict<T: Tensor>(
        &self,
        optim: &OptimStateDict<T>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<OptimStateDict<T>> {
        opts.check("get_optimizer_state_dict", self.rank())?;
        if !opts.full_state_dict {
            return self.sharded_optim_state_dict(optim, params);
        }
        let full = self.full_optim_state_dict(optim, params, opts.cpu_offload)?;
        // PyTorch's offloaded full dict is `{}` on the other ranks.
        Ok(full.unwrap_or(OptimStateDict {
            state: Default::default(),
            param_groups: None,
        }))
    }

    fn set_optimizer_state_dict<T: Tensor>(
        &self,
        osd: Option<&OptimStateDict<T>>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<OptimStateDict<T>> {
        let op = "set_optimizer_state_dict";
        opts.check(op, self.rank())?;
        if opts.full_state_dict && opts.broadcast_from_rank0 {
            let mine = if self.world_process_group().rank() == 0 {
                osd
            } else {
                None
            };
            return self.scatter_full_optim_state_dict(mine, params);
        }
        // Every rank joins the collectives below even without a dict of its own, so that
        // its peers fail with it instead of waiting.
        let empty = OptimStateDict::default();
        let result = if opts.full_state_dict {
            self.shard_full_optim_state_dict(osd.unwrap_or(&empty), params)
        } else {
            self.flatten_sharded_optim_state_dict(osd.unwrap_or(&empty), params)
        };
        match osd {
            Some(_) => result,
            None => Err(missing_dict(op, self.rank())),
        }
    }
}

/// The model state dict on an FSDP1 model: each parameter tensor of this rank (aligned with
/// the ids of [`Fsdp::optim_params`], as [`Fsdp::save_checkpoint`] takes them: a flat shard
/// per flat parameter, padding included; the local view per original parameter with
/// `use_orig_params`; the whole tensor of an unmanaged one) is a one-state optimizer entry
/// (`param`), so that the optimizer paths gather, slice, scatter and check it: the full dict
/// is `FULL_STATE_DICT`'s (whole tensors), the sharded one `SHARDED_STATE_DICT`'s (each
/// parameter's dim-0 chunk of this rank, as PyTorch's `_ext_chunk_tensor` cuts it).
impl StateDictApi for Fsdp {
    fn get_model_state_dict<T: Tensor>(
        &self,
        local: &[T],
        opts: &StateDictOptions,
    ) -> Result<ModelStateDict<T>> {
        const OP: &str = "get_model_state_dict";
        let params = self.optim_params();
        let given = if local.len() == params.len() {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                op: OP.into(),
                rank: self.rank(),
                reason: format!(
                    "{} local parameters given, the optimizer over the wrapped model holds {} (one per id of Fsdp::optim_params)",
                    local.len(),
                    params.len()
                ),
            })
        };
        let ids = self
            .world_process_group()
            .agree(given.and(self.id_params(&params)))?;
        // A parameter of which this rank holds nothing has no optimizer state either.
        let osd = OptimStateDict {
            state: local
                .iter()
                .zip(&ids)
                .enumerate()
                .filter(|(_, (_, id))| id.empty_here.is_none())
                .map(|(id, (t, _))| (ParamKey::Id(id), param_state(Value::Tensor(t.clone()))))
                .collect(),
            param_groups: Some(id_groups(&params)),
        };
        let named = self.get_optimizer_state_dict(&osd, &params, opts)?;
        let model = &self.layout().model;
        let mut by_name: HashMap<String, Value<T>> = named
            .state
            .into_iter()
            .filter_map(|(k, mut st)| Some((k.as_name()?.to_string(), st.shift_remove(PARAM)?)))
            .collect();
        let mut out = ModelStateDict::with_capacity(by_name.len());
        for p in &model.params {
            if opts.ignore_frozen_params && !p.requires_grad {
                continue;
            }
            if let Some(v) = by_name.remove(&p.name) {
                out.insert(p.name.clone(), v);
            }
        }
        Ok(with_tied_aliases(out, &model.tied))
    }

    fn set_model_state_dict<T: Tensor>(
        &self,
        sd: Option<&ModelStateDict<T>>,
        opts: &StateDictOptions,
    ) -> Result<Vec<Option<T>>> {
        const OP: &str = "set_model_state_dict";
        let params = self.optim_params();
        let ids = self.id_params(&params)?;
        // Every rank holding a dict checks it before any bytes move.
        let osd = sd
            .map(|sd| self.model_dict_as_optim(sd, &ids, opts, OP))
            .transpose();
        let osd = self.world_process_group().agree(osd)?;
        let local = self.set_optimizer_state_dict(osd.as_ref(), &params, opts)?;
        // An original parameter of which this rank holds nothing: its empty local view.
        let mut out = ids
            .iter()
            .map(|id| id.empty_here.map(|dtype| T::zeros(dtype, &[0])).transpose())
            .collect::<Result<Vec<Option<T>>>>()?;
        for (k, mut st) in local.state {
            if let (ParamKey::Id(id), Some(Value::Tensor(t))) = (k, st.shift_remove(PARAM)) {
                if id < out.len() {
                    out[id] = Some(t);
                }
            }
        }
        Ok(out)
    }
}

/// The name of the one state a model parameter becomes on the optimizer paths.
const PARAM: &str = "param";

fn param_state<T: Tensor>(v: Value<T>) -> ParamState<T> {
    [(PARAM.to_string(), v)].into_iter().collect()
}

/// Param groups without options holding the ids of `params`, group by group.
fn id_groups<T>(params: &OptimParams) -> Vec<ParamGroup<T>> {
    let mut ids = (0..).map(ParamKey::Id);
    params
        .groups
        .iter()
        .map(|g| ParamGroup {
            options: Default::default(),
            params: ids.by_ref().take(g.len()).collect(),
        })
        .collect()
}

impl Fsdp {
    /// A model dict (first names or tied aliases) as a name-keyed optimizer dict with one
    /// `param` state per parameter. With `strict` a parameter the dict lacks is an error;
    /// without, an optimizer entry some of whose parameters the dict lacks (a flat parameter
    /// missing a member) is left out, and comes back `None`.
    fn model_dict_as_optim<T: Tensor>(
        &self,
        sd: &ModelStateDict<T>,
        ids: &[IdParams],
        opts: &StateDictOptions,
        op: &str,
    ) -> Result<OptimStateDict<T>> {
        let model = &self.layout().model;
        let lookup = |name: &str| {
            sd.get(name)
                .or_else(|| model.aliases_of(name).find_map(|a| sd.get(a)))
        };
        let mut state = IndexMap::new();
        for id in ids {
            let values: Vec<_> = id.names.iter().map(|n| (n, lookup(n))).collect();
            if let Some((missing, _)) = values.iter().find(|(_, v)| v.is_none()) {
                if opts.strict {
                    return Err(Error::MissingState {
                        context: format!(
                            "{op} on rank {} (strict)",
                            self.world_process_group().rank()
                        ),
                        param: format!("`{missing}`"),
                        state: String::new(),
                    });
                }
                continue;
            }
            for (name, v) in values {
                let v = v.expect("checked above").clone();
                state.insert(ParamKey::Name(name.clone()), param_state(v));
            }
        }
        let names = model
            .params
            .iter()
            .map(|p| ParamKey::Name(p.name.clone()))
            .collect();
        Ok(OptimStateDict {
            state,
            param_groups: Some(vec![ParamGroup {
                options: Default::default(),
                params: names,
            }]),
        })
    }

    /// Each optimizer id's model parameters (a flat parameter's members, or one original
    /// parameter) and, for an original parameter of which this rank holds no element, its
    /// dtype: its local tensor is empty and the optimizer keeps no state for it.
    fn id_params(&self, params: &OptimParams) -> Result<Vec<IdParams>> {
        let layout = self.layout();
        Ok(layout
            .local_params(params)?
            .into_iter()
            .map(|lp| {
                let empty_here = match lp.resolved {
                    Resolved::Orig {
                        param,
                        owner: Some((flat, member)),
                    } if !layout.flat_params[flat].shard(self.rank()).params[member].in_shard => {
                        Some(layout.model.params[param].dtype)
                    }
                    _ => None,
                };
                IdParams {
                    names: lp.skey.names,
                    empty_here,
                }
            })
            .collect())
    }
}

/// What [`Fsdp::id_params`] says of one optimizer id.
struct IdParams {
    names: Vec<String>,
    empty_here: Option<DType>,
}
