//! The FSDP2 (`fully_shard`) rank of the example: every parameter sharded on dim 0 per rank
//! (`torch.chunk` rows, [`fsdp::param_layout`]), unsharded per `fully_shard` group by FSDP2's
//! all-gather, gradients sharded by FSDP2's reduce-scatter, Adam on the local rows, and a DCP
//! checkpoint (model and optimizer) that PyTorch's `dcp.load` + `set_state_dict` read too.

use super::{
    build_model, forward_backward, global_mean, grad_host, local_batch, optimizer_step, to_host,
    write_var, BoxResult, Gpt, Trainer, LR,
};
use fsdp::collectives::ProcessGroup;
use fsdp::fully_shard::{
    foreach_all_gather, foreach_all_gather_copy_out, foreach_reduce, ReduceOptions,
};
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_layout::ShardedParam;
use fsdp::{FullyShardedModel, HostTensor, OptimParams, OptimStateDict, WrapPolicy};
use std::path::Path;
use std::sync::Arc;
use tch::Tensor;

/// `fully_shard` while training (world size 4): each block, then the root (which takes the
/// embeddings, the final layer norm and the head).
pub fn train_policy() -> WrapPolicy {
    WrapPolicy::fully_shard(&["blocks.0", "blocks.1", ""])
}

/// `fully_shard` after resuming (world size 2), different on purpose: each attention and MLP,
/// then the root (the embeddings, the blocks' layer norms, the final layer norm, the head).
/// The PyTorch script applies `fully_shard` to these modules in this order too.
pub fn resume_policy() -> WrapPolicy {
    WrapPolicy::fully_shard(&[
        "blocks.0.attn",
        "blocks.0.mlp",
        "blocks.1.attn",
        "blocks.1.mlp",
        "",
    ])
}

/// One FSDP2 rank: its model replica (whose parameters are overwritten by the all-gathers
/// before every forward pass), its `fully_shard` layout, its local rows of every parameter and
/// Adam over those rows.
pub struct Rank2 {
    model: FullyShardedModel,
    gpt: Gpt,
    /// This rank's `VarStore` variables in model order (`model.layout().params`).
    vars: Vec<Tensor>,
    /// Every parameter, in model order, in one group (as `torch.optim.Adam(model.parameters())`).
    params: OptimParams,
    /// Per parameter (= optimizer id): this rank's rows (`DTensor.to_local()`).
    shards: Vec<HostTensor>,
    adam: Adam,
    /// Optimizer steps taken (the data position).
    step: usize,
}

impl Rank2 {
    /// Builds the model (identical initial values on every rank), applies `fully_shard` per
    /// `policy` over `pg` and keeps this rank's rows of the initial values.
    pub fn new(pg: Arc<dyn ProcessGroup>, policy: &WrapPolicy) -> BoxResult<Rank2> {
        let (gpt, desc, vars) = build_model()?;
        let model = FullyShardedModel::new(&desc, policy, pg)?;
        if let Some(p) = model.layout().params.iter().find(|p| !p.is_sharded()) {
            return Err(format!(
                "`{}` is outside every fully_shard unit: this example shards every parameter \
                 (apply fully_shard to the root too)",
                p.name
            )
            .into());
        }
        let shards = model
            .layout()
            .params
            .iter()
            .map(|p| Ok(model.local_rows(&p.name, &to_host(&vars[p.index])?)?))
            .collect::<BoxResult<Vec<_>>>()?;
        let params = model.optim_params();
        let adam = Adam::new(
            params.clone(),
            AdamConfig {
                lr: LR,
                ..Default::default()
            },
        )?;
        Ok(Rank2 {
            model,
            gpt,
            vars,
            params,
            shards,
            adam,
            step: 0,
        })
    }

    fn pg(&self) -> &dyn ProcessGroup {
        self.model.process_group().as_ref()
    }

    /// The parameters of each `fully_shard` group, in the group's order (empty groups left
    /// out: they have nothing to gather or reduce).
    fn groups(&self) -> Vec<Vec<&ShardedParam>> {
        let layout = self.model.layout();
        (0..layout.groups.len())
            .map(|g| layout.group_params(g))
            .filter(|g| !g.is_empty())
            .collect()
    }

    /// Unshards every group (`foreach_all_gather` of this rank's rows, then copy-out) and
    /// writes the unsharded parameters into the model's variables.
    fn gather_params(&self) -> BoxResult<()> {
        for group in self.groups() {
            let local: Vec<HostTensor> =
                group.iter().map(|p| self.shards[p.index].clone()).collect();
            let gathered = foreach_all_gather(self.pg(), &group, &local)?;
            let unsharded = foreach_all_gather_copy_out(&gathered, &group)?;
            for (p, value) in group.iter().zip(&unsharded) {
                write_var(&self.vars[p.index], value)?;
            }
        }
        Ok(())
    }

    /// This rank's averaged gradient rows per parameter: each group's unsharded gradients
    /// reduce-scattered by `foreach_reduce` with PyTorch's default divide factors (fp32:
    /// `_get_gradient_divide_factors` picks `ReduceOp.AVG`, no pre- or post-division).
    fn reduce_grads(&self) -> BoxResult<Vec<Option<HostTensor>>> {
        let mut grads = vec![None; self.shards.len()];
        for group in self.groups() {
            let unsharded = group
                .iter()
                .map(|p| grad_host(&self.vars[p.index]))
                .collect::<BoxResult<Vec<_>>>()?;
            let sharded = foreach_reduce(self.pg(), &group, &unsharded, &ReduceOptions::default())?;
            for (p, g) in group.iter().zip(sharded) {
                grads[p.index] = Some(g);
            }
        }
        Ok(grads)
    }
}

impl Trainer for Rank2 {
    fn step(&self) -> usize {
        self.step
    }

    fn train_step(&mut self) -> BoxResult<f64> {
        self.gather_params()?;
        let batch = local_batch(self.step, self.model.rank(), self.model.world_size());
        let loss = forward_backward(&self.gpt, &mut self.vars, &batch)?;
        let grads = self.reduce_grads()?;
        self.adam.step(&mut self.shards, &grads)?;
        self.step += 1;
        global_mean(self.pg(), loss)
    }

    /// `dcp.save({"model": ..., "optim": ...})` of `get_state_dict`: Adam's state and this
    /// rank's rows of every parameter. Collective.
    fn save(&self, dir: &Path) -> BoxResult<()> {
        self.model.save_dcp(
            &self.adam.state_dict(),
            &self.params,
            Some(&self.shards),
            dir,
        )?;
        Ok(())
    }

    /// This rank's rows of every parameter and its Adam state from a DCP directory written at
    /// any world size, and the step count (Adam's `step`).
    fn load(&mut self, dir: &Path) -> BoxResult<()> {
        self.shards = self.model.load_model_dcp(dir)?;
        let osd: OptimStateDict<HostTensor> = self.model.load_dcp(dir, &self.params)?;
        self.step = optimizer_step(&osd)?;
        self.adam.load_state_dict(&osd)?;
        Ok(())
    }
}
