//! Optimizer state (layer 4): the state-dict model and its transforms — flatten, unflatten,
//! consolidate, shard and rekey — with PyTorch's validation.
//!
//! `keys`, `flatten`, `unflatten` and `rekey` are pure; `consolidate` and `scatter` move
//! bytes through a [`ProcessGroup`](crate::collectives::ProcessGroup).

pub mod consolidate;
mod dict;
pub mod flatten;
pub mod keys;
pub mod plan;
pub mod rekey;
pub mod scatter;

pub use dict::{
    map_state, OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState,
    ShardedTensor, Value,
};
pub use flatten::{flatten_optim_state_dict, ShardSource};
pub use keys::OptimStateKey;
pub use rekey::{rekey_optim_state_dict, OptimStateKeyType};
