//! Optimizer state (layer 4): the state-dict model and its transforms — flatten, unflatten,
//! consolidate, shard and rekey — with PyTorch's validation.

mod dict;

pub use dict::{OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, ShardedTensor, Value};
