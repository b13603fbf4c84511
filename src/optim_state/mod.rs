//! Optimizer state (layer 4): the state-dict model and its transforms — flatten, unflatten,
//! consolidate, shard and rekey — with PyTorch's validation.
//!
//! `keys`, `flatten`, `unflatten` and `rekey` are pure; `consolidate` and `scatter` move
//! bytes through a [`crate::collectives::ProcessGroup`].

pub(crate) mod consolidate;
mod dict;
pub(crate) mod flatten;
pub(crate) mod keys;
pub(crate) mod plan;
mod rekey;
pub(crate) mod scatter;

pub use consolidate::chunk_dim0;
pub(crate) use dict::map_state;
pub use dict::{
    OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, ShardedTensor, Value,
};
pub use flatten::flatten_optim_state_dict;
pub use rekey::{rekey_optim_state_dict, OptimStateKeyType};

use crate::collectives::ProcessGroup;
use crate::error::Result;
use crate::flat_param::ModelLayout;
use crate::tensor::Tensor;

/// Replaces every sharded tensor of a `SHARDED_STATE_DICT` (this rank's row chunks, as
/// `Fsdp::sharded_optim_state_dict` returns them) with the whole tensor, gathered from every
/// rank of `pg`, the shard group of `layout`. Collective.
pub fn gather_sharded<T: Tensor>(
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
) -> Result<OptimStateDict<T>> {
    scatter::gather_sharded("gather_sharded", layout, pg, sharded)
}
