//! The state-dict API over FSDP1: what `get_optimizer_state_dict` / `set_optimizer_state_dict`
//! do for a `FullyShardedDataParallel` model, which is `FSDP.optim_state_dict` /
//! `FSDP.optim_state_dict_to_load` under `FULL_STATE_DICT` (rank 0 only with `cpu_offload`)
//! or `SHARDED_STATE_DICT`.

use super::{OptimStateDictApi, StateDictOptions};
use crate::error::Result;
use crate::fsdp::Fsdp;
use crate::optim_state::{OptimParams, OptimStateDict};
use crate::tensor::Tensor;

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
            None => Err(super::missing_dict(op, self.rank())),
        }
    }
}
