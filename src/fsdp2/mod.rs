//! FSDP2 (`fully_shard`), layer 9: the [`FullyShardedModel`] façade beside FSDP1's
//! [`crate::Fsdp`]. Its layout is [`crate::param_layout`] and its collectives are
//! [`crate::fully_shard`]; its state-dict API is in `state_dict.rs`.
//!
//! Every parameter is sharded on dim 0 by
//! [`crate::param_layout`], and so is every optimizer state tensor of a sharded parameter
//! (`exp_avg`, `exp_avg_sq`, `momentum_buffer`); 0-dim states (`step`) and the states of
//! parameters `fully_shard` does not manage are the same on every rank.
//!
//! A rank's local `optim.state_dict()` (every DTensor replaced by `to_local()`) holds, for a
//! sharded parameter, tensors of its local rows: `[rows, ...]`, `[0, ...]` on a rank the
//! chunking leaves none.

mod state_dict;

use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, LookupSite, Result};
use crate::model::{ModelDesc, WrapPolicy};
use crate::optim_state::{
    OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, ShardedTensor, Value,
};
use crate::param_layout::{chunk_size, ParamLayout, ShardedParam};
use crate::state_dict::{
    with_tied_aliases, ModelStateDict, OptimStateDictApi, StateDictApi, StateDictOptions,
};
use crate::tensor::{DType, HostTensor, Tensor};
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

const GET: &str = "get_optimizer_state_dict";
const SET: &str = "set_optimizer_state_dict";

/// One rank of a model `fully_shard` was applied to: its per-parameter layout and process
/// group, the FSDP2 counterpart of [`crate::Fsdp`].
#[derive(Clone)]
pub struct FullyShardedModel {
    layout: ParamLayout,
    /// First name or tied alias -> index in `layout.params`.
    by_name: HashMap<String, usize>,
    /// Tied alias -> first name.
    tied: BTreeMap<String, String>,
    pg: Arc<dyn ProcessGroup>,
}

impl std::fmt::Debug for FullyShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardedModel")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.layout.world_size)
            .field("params", &self.layout.params.len())
            .finish()
    }
}

impl FullyShardedModel {
    /// `fully_shard` applied to `policy.units` (in order) of `model` on the ranks of `pg`.
    /// The policy must have `fsdp_version` 2.
    pub fn new(model: &ModelDesc, policy: &WrapPolicy, pg: Arc<dyn ProcessGroup>) -> Result<Self> {
        let layout = ParamLayout::new(model, policy, pg.world_size())?;
        let mut by_name: HashMap<String, usize> = layout
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        for (alias, primary) in &model.tied {
            if let Some(&i) = by_name.get(primary) {
                by_name.insert(alias.clone(), i);
            }
        }
        Ok(FullyShardedModel {
            layout,
            by_name,
            tied: model.tied.clone(),
            pg,
        })
    }

    /// The per-parameter layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.layout.world_size
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// What an optimizer built over `model.parameters()` holds: every parameter (tied ones
    /// once, frozen ones too, which get no state), in model order, in one group.
    pub fn optim_params(&self) -> OptimParams {
        OptimParams {
            groups: vec![self
                .layout
                .params
                .iter()
                .map(|p| OptimParam::Param(p.name.clone()))
                .collect()],
            named: false,
        }
    }

    /// This rank's rows of a whole tensor of parameter `name` (a parameter or one of its
    /// state tensors): what `distribute_tensor` keeps; the whole tensor for a parameter
    /// `fully_shard` does not manage.
    pub fn local_rows<T: Tensor>(&self, name: &str, full: &T) -> Result<T> {
        let p = self.param(name, "local_rows")?;
        check_shape(p, full, &p.shape, "the whole tensor")?;
        if !p.is_sharded() {
            return Ok(full.clone());
        }
        let rows = p.rows(self.rank());
        let mut shape = p.shape.clone();
        shape[0] = rows.len();
        full.narrow_flat(rows.start * p.row_numel(), rows.len() * p.row_numel())?
            .reshape(&shape)
    }

    /// `dcp.save({"optim": get_optimizer_state_dict(model, optim)})`: this rank's local
    /// optimizer state as its part of the DCP directory `dir` (each rank writes only its
    /// rows; `.metadata` last, the directory renamed into place). Collective. PyTorch's
    /// `dcp.load` + `set_optimizer_state_dict` load it into FSDP1 or FSDP2 at any world size.
    ///
    /// `model`, when given, is this rank's parameters (as
    /// [`FullyShardedModel::get_model_state_dict`] takes them), saved beside under
    /// `model.<fqn>`, as `dcp.save({"model": ..., "optim": ...})` of `get_state_dict` does.
    pub fn save_dcp<T: Tensor>(
        &self,
        optim: &OptimStateDict<T>,
        params: &OptimParams,
        model: Option<&[T]>,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<()> {
        let sharded = self.get_optimizer_state_dict(optim, params, &StateDictOptions::default())?;
        let model = model
            .map(|m| self.get_model_state_dict(m, &StateDictOptions::default()))
            .transpose()?;
        crate::checkpoint::save_sharded_dcp(
            self.pg.as_ref(),
            &sharded,
            model.as_ref(),
            dir.as_ref(),
        )
    }

    /// This rank's parameters (as [`FullyShardedModel::get_model_state_dict`] gives them)
    /// from the `model.<fqn>` entries of a DCP directory of any FSDP generation and world size:
    /// each parameter read whole, one at a time, and cut to this rank's rows. A parameter the
    /// directory lacks is an error ([`Error::MissingState`]). Collective.
    pub fn load_model_dcp<T: Tensor>(&self, dir: impl AsRef<std::path::Path>) -> Result<Vec<T>> {
        let read = || -> Result<Vec<T>> {
            let ckpt = crate::io::dcp::DcpCheckpoint::open(dir.as_ref())?;
            self.layout
                .params
                .iter()
                .map(|p| {
                    let key = format!("model.{}", p.name);
                    if ckpt.entry(&key).is_none() {
                        return Err(Error::MissingState {
                            context: format!(
                                "loading the model from DCP directory `{}` on rank {}",
                                dir.as_ref().display(),
                                self.rank()
                            ),
                            param: format!("`{}`", p.name),
                            state: String::new(),
                        });
                    }
                    let whole = T::from_host(ckpt.read_tensor(&key)?)?;
                    self.local_rows(&p.name, &whole)
                })
                .collect()
        };
        self.pg.agree(read())
    }

    /// The local optimizer state dict (for the optimizer holding `params`) from the optimizer
    /// state of a DCP directory saved by any FSDP generation at any world size: each
    /// parameter's state is read whole, one parameter at a time, and this rank keeps its
    /// rows. Collective: every rank returns the lowest failing rank's error.
    pub fn load_dcp<T: Tensor>(
        &self,
        dir: impl AsRef<std::path::Path>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        let read = || -> Result<OptimStateDict<T>> {
            let mut state = IndexMap::new();
            let groups = crate::checkpoint::read_optim_by_param(dir.as_ref(), |fqn, st| {
                let st = crate::optim_state::map_state(&st, &mut |t: &HostTensor| {
                    T::from_host(t.clone())
                })?;
                state.insert(ParamKey::Name(fqn.to_string()), st);
                Ok(())
            })?;
            let groups = groups
                .map(|gs| {
                    gs.iter()
                        .map(|g| g.try_map(&mut |t: &HostTensor| T::from_host(t.clone())))
                        .collect::<Result<Vec<_>>>()
                })
                .transpose()?;
            self.slice_full(&OptimStateDict {
                state,
                param_groups: groups,
            })
        };
        let local = self.pg.agree(read())?;
        self.pg.agree(self.to_optimizer(local, params, true))
    }

    /// Checks one local tensor per parameter, each of this rank's shape.
    fn check_local_params<T: Tensor>(&self, local: &[T], op: &str) -> Result<()> {
        if local.len() != self.layout.params.len() {
            return Err(Error::InvalidArgument {
                op: op.into(),
                rank: self.rank(),
                reason: format!(
                    "{} local parameters given, the model has {}",
                    local.len(),
                    self.layout.params.len()
                ),
            });
        }
        for (p, t) in self.layout.params.iter().zip(local) {
            let want = if p.is_sharded() {
                p.local_shape(self.rank())
            } else {
                p.shape.clone()
            };
            check_shape(p, t, &want, "the local parameter")?;
        }
        Ok(())
    }

    fn param(&self, name: &str, op: &str) -> Result<&ShardedParam> {
        self.by_name
            .get(name)
            .map(|&i| &self.layout.params[i])
            .ok_or_else(|| Error::UnknownParameter {
                site: LookupSite::Fsdp2 {
                    op: op.to_string(),
                    rank: self.rank(),
                },
                name: name.to_string(),
            })
    }

    /// The parameter behind each optimizer id (position in the concatenated groups).
    fn params_by_id(&self, params: &OptimParams, op: &str) -> Result<Vec<&ShardedParam>> {
        params
            .groups
            .iter()
            .flatten()
            .map(|p| match p {
                OptimParam::Param(name) => self.param(name, op),
                OptimParam::Flat(_) => Err(Error::WrongOptimParam {
                    param: p.to_string(),
                    reason: "fully_shard has no flat parameters: the optimizer holds original parameters ({\"Param\": name})".into(),
                }),
            })
            .collect()
    }

    /// Whether `v`, a state of `p`, is one of its sharded tensors on this rank, checking its
    /// local shape.
    fn is_sharded_state<T: Tensor>(
        &self,
        p: &ShardedParam,
        name: &str,
        v: &Value<T>,
    ) -> Result<bool> {
        match v {
            Value::Tensor(t) if p.is_sharded() && t.dim() > 0 => {
                check_shape(
                    p,
                    t,
                    &p.local_shape(self.rank()),
                    &format!("local state `{name}`"),
                )?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

fn check_shape<T: Tensor>(p: &ShardedParam, t: &T, want: &[usize], what: &str) -> Result<()> {
    if t.shape() != want {
        return Err(Error::ShapeMismatch {
            context: format!("{what} of parameter `{}`", p.name),
            expected: want.to_vec(),
            found: t.shape(),
        });
    }
    Ok(())
}
