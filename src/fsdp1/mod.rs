//! FSDP1 (`FullyShardedDataParallel`, flat parameters), layer 9: the [`Fsdp`] façade beside
//! FSDP2's [`crate::FullyShardedModel`]. It owns the model description, the layout
//! ([`crate::flat_param`]) and the process group and exposes PyTorch's optimizer-state API
//! under PyTorch's names; its state-dict API is in `state_dict.rs`.

mod state_dict;

use crate::collectives::ProcessGroup;
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::model::{ModelDesc, WrapPolicy};
use crate::optim_state::consolidate::{consolidate, ConsolidateOptions};
use crate::optim_state::scatter::{gather_sharded, load_sharded, scatter_full};
use crate::optim_state::{
    flatten_optim_state_dict, rekey_optim_state_dict, OptimParams, OptimStateDict,
    OptimStateKeyType,
};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Which kind of state dict `optim_state_dict` produces (`StateDictType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum StateDictType {
    /// Unflattened, unsharded, keyed by names (`FULL_STATE_DICT`).
    #[default]
    Full,
    /// Unflattened, each tensor row-chunked across ranks (`SHARDED_STATE_DICT`).
    Sharded,
    /// The optimizer's own flat, local dict, untransformed (`LOCAL_STATE_DICT`).
    Local,
}

/// `FullStateDictConfig` (model state; kept for API parity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FullStateDictConfig {
    /// Move tensors to CPU (host tensors already are).
    pub offload_to_cpu: bool,
    /// Only rank 0 holds the result.
    pub rank0_only: bool,
}

/// `ShardedStateDictConfig` (model state; kept for API parity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ShardedStateDictConfig {
    /// Move tensors to CPU (host tensors already are).
    pub offload_to_cpu: bool,
}

/// Optimizer-state configuration for each [`StateDictType`] (`*OptimStateDictConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimStateDictConfig {
    /// `FullOptimStateDictConfig`.
    Full {
        /// Move tensors to CPU. Host tensors are on CPU already; a device backend copies.
        offload_to_cpu: bool,
        /// Save: only rank 0 returns the dict. Load: only rank 0 passes it; it is scattered.
        rank0_only: bool,
    },
    /// `ShardedOptimStateDictConfig`.
    Sharded {
        /// Move tensors to CPU.
        offload_to_cpu: bool,
    },
    /// `LocalOptimStateDictConfig`.
    Local {
        /// Move tensors to CPU.
        offload_to_cpu: bool,
    },
}

impl OptimStateDictConfig {
    /// PyTorch's default config for a state-dict type.
    pub fn default_for(t: StateDictType) -> Self {
        match t {
            StateDictType::Full => OptimStateDictConfig::Full {
                offload_to_cpu: true,
                rank0_only: false,
            },
            StateDictType::Sharded => OptimStateDictConfig::Sharded {
                offload_to_cpu: true,
            },
            StateDictType::Local => OptimStateDictConfig::Local {
                offload_to_cpu: false,
            },
        }
    }
}

/// The settings `set_state_dict_type` installs (`StateDictSettings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDictSettings {
    /// The type.
    pub state_dict_type: StateDictType,
    /// Its optimizer-state config.
    pub optim_state_dict_config: OptimStateDictConfig,
}

impl Default for StateDictSettings {
    fn default() -> Self {
        StateDictSettings {
            state_dict_type: StateDictType::Full,
            optim_state_dict_config: OptimStateDictConfig::default_for(StateDictType::Full),
        }
    }
}

/// One rank's view of an FSDP-wrapped model: its layout and process groups.
///
/// Every method that communicates is collective: all ranks of the group call it in the same
/// order. Before moving any tensor the ranks exchange a digest of the layout and their keys;
/// any disagreement is the same typed error on every rank.
pub struct Fsdp {
    layout: ModelLayout,
    /// The group flat parameters are sharded over.
    shard_pg: Arc<dyn ProcessGroup>,
    /// The whole job (equal to `shard_pg` unless hybrid sharding).
    world_pg: Arc<dyn ProcessGroup>,
    settings: StateDictSettings,
}

impl std::fmt::Debug for Fsdp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("flat_params", &self.layout.flat_params.len())
            .field("settings", &self.settings)
            .finish()
    }
}

const OPT: &str = "optim_state_dict";
const LOAD: &str = "optim_state_dict_to_load";

impl Fsdp {
    /// Wraps `model` with `policy`, sharding over every rank of `pg`.
    ///
    /// `HYBRID_SHARD` needs [`Fsdp::new_hybrid`]. World size 1 behaves as `NO_SHARD`, as in
    /// PyTorch.
    pub fn new(model: &ModelDesc, policy: &WrapPolicy, pg: Arc<dyn ProcessGroup>) -> Result<Self> {
        if policy.sharding_strategy.is_hybrid() {
            return Err(Error::ConfigMismatch {
                what: "the sharding strategy of Fsdp::new".into(),
                expected: "a strategy without shard groups (HYBRID_SHARD needs a shard group: use Fsdp::new_hybrid(model, policy, world, shard_group_size))".into(),
                found: format!("{:?}", policy.sharding_strategy),
            });
        }
        let layout = ModelLayout::new(model, policy, pg.world_size())?;
        Ok(Fsdp {
            layout,
            shard_pg: pg.clone(),
            world_pg: pg,
            settings: StateDictSettings::default(),
        })
    }

    /// `HYBRID_SHARD`: shards within consecutive groups of `shard_group_size` ranks of `world`
    /// and replicates across them. Collective over `world` (it creates the sub-groups).
    pub fn new_hybrid(
        model: &ModelDesc,
        policy: &WrapPolicy,
        world: Arc<dyn ProcessGroup>,
        shard_group_size: usize,
    ) -> Result<Self> {
        let ws = world.world_size();
        if shard_group_size == 0 || ws % shard_group_size != 0 {
            return Err(Error::ConfigMismatch {
                what: "the shard group size of Fsdp::new_hybrid".into(),
                expected: format!("a divisor of the world size {ws}"),
                found: shard_group_size.to_string(),
            });
        }
        let mut mine = None;
        for g in 0..ws / shard_group_size {
            let ranks: Vec<usize> = (g * shard_group_size..(g + 1) * shard_group_size).collect();
            if let Some(pg) = world.new_subgroup(&ranks)? {
                mine = Some(pg);
            }
        }
        let shard_pg = mine.expect("every rank belongs to one shard group");
        let layout = ModelLayout::new(model, policy, shard_group_size)?;
        Ok(Fsdp {
            layout,
            shard_pg,
            world_pg: world,
            settings: StateDictSettings::default(),
        })
    }

    /// The layout (flat parameters, padding, shards).
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// This rank within the shard group.
    pub fn rank(&self) -> usize {
        self.shard_pg.rank()
    }

    /// Size of the shard group.
    pub fn world_size(&self) -> usize {
        self.shard_pg.world_size()
    }

    /// The shard group.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.shard_pg
    }

    /// The process group of the whole job (the shard group unless hybrid sharding).
    pub fn world_process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.world_pg
    }

    /// Whether this rank writes a data file when saving a sharded checkpoint: ranks of the
    /// first shard group do (shard groups are contiguous blocks of world ranks).
    pub fn writes_checkpoint_files(&self) -> bool {
        self.world_pg.rank() < self.shard_pg.world_size()
    }

    /// The parameters of `model.parameters()` of the wrapped model, in that order, as one
    /// param group: what `torch.optim.Adam(model.parameters())` would hold.
    pub fn optim_params(&self) -> OptimParams {
        OptimParams::of_model(&self.layout)
    }

    /// `FSDP.set_state_dict_type`: selects what [`Fsdp::optim_state_dict`] returns and what
    /// [`Fsdp::optim_state_dict_to_load`] expects. `None` takes PyTorch's default config.
    pub fn set_state_dict_type(
        &mut self,
        t: StateDictType,
        config: Option<OptimStateDictConfig>,
    ) -> Result<StateDictSettings> {
        let config = config.unwrap_or_else(|| OptimStateDictConfig::default_for(t));
        let matches = matches!(
            (t, config),
            (StateDictType::Full, OptimStateDictConfig::Full { .. })
                | (StateDictType::Sharded, OptimStateDictConfig::Sharded { .. })
                | (StateDictType::Local, OptimStateDictConfig::Local { .. })
        );
        if !matches {
            return Err(Error::ConfigMismatch {
                what: "set_state_dict_type".into(),
                expected: format!("a config for {t:?}"),
                found: format!("{config:?}"),
            });
        }
        let prev = self.settings;
        self.settings = StateDictSettings {
            state_dict_type: t,
            optim_state_dict_config: config,
        };
        Ok(prev)
    }

    /// The current settings (`FSDP.get_state_dict_type`).
    pub fn state_dict_settings(&self) -> StateDictSettings {
        self.settings
    }

    /// Consolidation over the shard group; with `rank0_only` only global rank 0 returns a
    /// dict (a sharded dict is returned everywhere).
    fn consolidate<T: Tensor>(
        &self,
        op: &str,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        shard_state: bool,
        rank0_only: bool,
    ) -> Result<Option<OptimStateDict<T>>> {
        let to_save = shard_state || !rank0_only || self.world_pg.rank() == 0;
        let opts = ConsolidateOptions {
            shard_state,
            to_save,
            rank0_only,
        };
        consolidate(op, &self.layout, self.shard_pg.as_ref(), osd, params, opts)
    }

    /// Scatter of the dict global rank 0 holds over the whole job.
    fn scatter<T: Tensor>(
        &self,
        op: &str,
        full: Option<&OptimStateDict<T>>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        scatter_full(
            op,
            &self.layout,
            self.rank(),
            self.world_pg.as_ref(),
            0,
            full,
            params,
        )
    }

    fn rank0_only(&self) -> bool {
        matches!(
            self.settings.optim_state_dict_config,
            OptimStateDictConfig::Full {
                rank0_only: true,
                ..
            }
        )
    }

    /// `FSDP.full_optim_state_dict`: consolidates every rank's local optimizer state into the
    /// full dict keyed by parameter names. With `rank0_only`, ranks other than 0 return
    /// `None` (PyTorch's empty dict). Collective.
    pub fn full_optim_state_dict<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        rank0_only: bool,
    ) -> Result<Option<OptimStateDict<T>>> {
        self.consolidate("full_optim_state_dict", osd, params, false, rank0_only)
    }

    /// `FSDP.sharded_optim_state_dict`: like the full dict, but each tensor state keeps only
    /// this rank's dim-0 chunk ([`crate::optim_state::ShardedTensor`]). Collective.
    pub fn sharded_optim_state_dict<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        let out = self.consolidate("sharded_optim_state_dict", osd, params, true, false)?;
        Ok(out.expect("a sharded dict is returned on every rank"))
    }

    /// `FSDP.shard_full_optim_state_dict`: this rank's flattened, sharded dict for its
    /// optimizer, from a full dict every rank holds. Local: no communication.
    pub fn shard_full_optim_state_dict<T: Tensor>(
        &self,
        full: &OptimStateDict<T>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        flatten_optim_state_dict(&self.layout, self.rank(), full, params)
    }

    /// `FSDP.scatter_full_optim_state_dict`: rank 0 passes the full dict, the others `None`;
    /// every rank gets its flattened, sharded dict. Collective.
    pub fn scatter_full_optim_state_dict<T: Tensor>(
        &self,
        full: Option<&OptimStateDict<T>>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        self.scatter("scatter_full_optim_state_dict", full, params)
    }

    /// Saves this rank's local optimizer state into the sharded checkpoint directory `dir`
    /// ([`crate::checkpoint`]): each rank of the first shard group writes its own data
    /// file, rank 0 writes the manifest and commits. Collective over the whole job. The
    /// checkpoint loads at any world size and wrapping with [`Fsdp::load_optim_checkpoint`].
    pub fn save_optim_checkpoint<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        dir: impl AsRef<std::path::Path>,
        opts: &crate::checkpoint::SaveOptions,
    ) -> Result<()> {
        self.save(osd, params, None, dir.as_ref(), opts)
    }

    /// [`Fsdp::save_optim_checkpoint`] that also saves the model's parameters: `model` is this
    /// rank's parameter tensors aligned with the ids of [`Fsdp::optim_params`] — a flat shard
    /// per flat parameter (padding included, as [`crate::param_shards::shard_tensors`] cuts it), the
    /// local view per original parameter with `use_orig_params`, the whole tensor per
    /// unmanaged parameter; `None` entries are not saved. Load them at any world size and
    /// wrapping with [`Fsdp::load_model_params`]. Collective over the whole job.
    pub fn save_checkpoint<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        model: &[Option<T>],
        dir: impl AsRef<std::path::Path>,
        opts: &crate::checkpoint::SaveOptions,
    ) -> Result<()> {
        self.save(osd, params, Some(model), dir.as_ref(), opts)
    }

    fn save<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        model: Option<&[Option<T>]>,
        dir: &std::path::Path,
        opts: &crate::checkpoint::SaveOptions,
    ) -> Result<()> {
        crate::checkpoint::save(self.into(), osd, params, model, dir, opts)
    }

    /// This rank's parameter tensors from a checkpoint written by [`Fsdp::save_checkpoint`] at
    /// any world size and wrapping of the same model, aligned with the ids of
    /// [`Fsdp::optim_params`] as `save_checkpoint` takes them (padding zero-filled). Reads
    /// only the byte ranges of this rank's shards; no communication.
    pub fn load_model_params<T: Tensor>(
        &self,
        dir: impl AsRef<std::path::Path>,
        opts: &crate::checkpoint::LoadOptions,
    ) -> Result<Vec<Option<T>>> {
        crate::checkpoint::load_model_params(dir.as_ref(), &self.layout, self.rank(), opts)
    }

    /// This rank's optimizer state dict from the checkpoint in `dir`, saved at any world size
    /// and wrapping of the same model: what [`Fsdp::shard_full_optim_state_dict`] gives for the
    /// checkpoint's full dict. Reads only the byte ranges of this rank's shards; no
    /// communication.
    pub fn load_optim_checkpoint<T: Tensor>(
        &self,
        dir: impl AsRef<std::path::Path>,
        params: &OptimParams,
        opts: &crate::checkpoint::LoadOptions,
    ) -> Result<OptimStateDict<T>> {
        crate::checkpoint::load(dir.as_ref(), &self.layout, self.rank(), params, opts)
    }

    /// Saves this rank's local optimizer state (and, when `model` is given, its parameters,
    /// aligned as for [`Fsdp::save_checkpoint`]) as a PyTorch Distributed Checkpoint (DCP)
    /// directory: the keys `get_state_dict` + `dcp.save` write (`optim.state.<fqn>.<name>`,
    /// `optim.param_groups.<i>.<option>`, `model.<fqn>`) at the original parameters' global
    /// shapes, so that PyTorch's `dcp.load` + `set_state_dict` load it into FSDP1 or FSDP2
    /// models at any world size. Each rank writes only the elements it holds into
    /// `__{rank}_0.distcp`; rank 0 writes `.metadata` last and renames the directory into
    /// place. Collective over the whole job; every rank returns the same outcome.
    pub fn save_dcp<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        model: Option<&[Option<T>]>,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<()> {
        crate::checkpoint::save_dcp(self.into(), osd, params, model, dir.as_ref())
    }

    /// This rank's optimizer state dict from a DCP directory written by PyTorch
    /// (`get_state_dict` + `dcp.save`, FSDP1 or FSDP2, any world size) or by
    /// [`Fsdp::save_dcp`]: what [`Fsdp::shard_full_optim_state_dict`] gives for the
    /// directory's full optimizer dict. No communication.
    pub fn load_dcp<T: Tensor>(
        &self,
        dir: impl AsRef<std::path::Path>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        crate::checkpoint::load_dcp(dir.as_ref(), &self.layout, self.rank(), params)
    }

    /// `FSDP.flatten_sharded_optim_state_dict`: from this rank's part of a sharded dict (saved
    /// at this world size), this rank's flattened dict for its optimizer. Collective.
    pub fn flatten_sharded_optim_state_dict<T: Tensor>(
        &self,
        sharded: &OptimStateDict<T>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        load_sharded(
            "flatten_sharded_optim_state_dict",
            &self.layout,
            self.shard_pg.as_ref(),
            sharded,
            params,
        )
    }

    /// `FSDP.rekey_optim_state_dict` against this model: ids of `params` ↔ parameter names.
    pub fn rekey_optim_state_dict<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        key_type: OptimStateKeyType,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        rekey_optim_state_dict(osd, key_type, &self.layout, params)
    }

    /// `FSDP.optim_state_dict`: transforms the local optimizer state dict per the state-dict
    /// type: full (rank-0-only returns `None` elsewhere), sharded, or local (unchanged).
    /// Collective for full and sharded.
    pub fn optim_state_dict<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
    ) -> Result<Option<OptimStateDict<T>>> {
        match self.settings.state_dict_type {
            StateDictType::Full => self.consolidate(OPT, osd, params, false, self.rank0_only()),
            StateDictType::Sharded => self.consolidate(OPT, osd, params, true, false),
            StateDictType::Local => Ok(Some(osd.clone())),
        }
    }

    /// `FSDP.optim_state_dict_to_load`: the dict this rank's optimizer can load, from a dict
    /// made by [`Fsdp::optim_state_dict`] under the same state-dict type (possibly at another
    /// world size or wrapping, for full dicts). With full rank-0-only, only rank 0 passes the
    /// dict. Collective for full rank-0-only and sharded.
    pub fn optim_state_dict_to_load<T: Tensor>(
        &self,
        osd: Option<&OptimStateDict<T>>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        let need = |what: &str| Error::InvalidArgument {
            op: LOAD.into(),
            rank: self.world_pg.rank(),
            reason: format!("this rank must pass the {what} dict"),
        };
        match self.settings.state_dict_type {
            StateDictType::Full if self.rank0_only() => self.scatter(LOAD, osd, params),
            StateDictType::Full => flatten_optim_state_dict(
                &self.layout,
                self.rank(),
                osd.ok_or_else(|| need("full"))?,
                params,
            ),
            StateDictType::Sharded => {
                // Every rank joins the gather even when its own input is missing, so peers fail
                // with the same error instead of waiting.
                match osd {
                    Some(osd) => {
                        load_sharded(LOAD, &self.layout, self.shard_pg.as_ref(), osd, params)
                    }
                    None => {
                        let empty: OptimStateDict<T> = OptimStateDict::default();
                        gather_sharded(LOAD, &self.layout, self.shard_pg.as_ref(), &empty)?;
                        Err(need("sharded"))
                    }
                }
            }
            StateDictType::Local => osd.cloned().ok_or_else(|| need("local")),
        }
    }
}

impl<'a> From<&'a Fsdp> for crate::checkpoint::GroupContext<'a> {
    fn from(fsdp: &'a Fsdp) -> Self {
        crate::checkpoint::GroupContext {
            layout: &fsdp.layout,
            layout_rank: fsdp.rank(),
            writes_files: fsdp.writes_checkpoint_files(),
            pg: &fsdp.world_pg,
        }
    }
}
