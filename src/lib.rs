#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod checkpoint;
pub mod collectives;
pub mod commands;
mod error;
pub mod flat_param;
pub mod fully_shard;
pub mod io;
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub mod libtorch;
pub mod model;
pub mod optim;
pub mod optim_state;
pub mod param_layout;
pub mod param_shards;
pub(crate) mod placement;
pub mod state_dict;
pub mod storage;
pub mod tensor;

mod fsdp1;
mod fsdp2;

// The items a user needs, by name, grouped by task. Everything else is reached through the
// public modules above (the formats, checkpoints, conversions and collectives) or is private.

// Errors: one enum for every layer.
pub use error::{Error, IoError, LookupSite, Result, StoredCopy};

// Tensors: the host tensor, the dtype table and the backend trait (libtorch with `tch`).
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use tensor::TchTensor;
pub use tensor::{DType, HostTensor, Tensor};

// The model and its wrapping: what `DESC.json` holds.
pub use commands::rank_dicts::DescFile;
pub use model::{FsdpVersion, ModelDesc, ParamDesc, ShardingStrategy, WrapPolicy};

// Optimizer state dicts, as `optim.state_dict()` and PyTorch FSDP's functions shape them.
pub use optim_state::{
    OptimParam, OptimParams, OptimStateDict, OptimStateKeyType, ParamGroup, ParamKey, ParamState,
    Value,
};

// The two façades, side by side: FSDP1 (flat parameters) with PyTorch's state-dict-type
// settings, and FSDP2 (`fully_shard`); and the state-dict API both implement.
pub use fsdp1::{
    Fsdp, FullStateDictConfig, OptimStateDictConfig, ShardedStateDictConfig, StateDictSettings,
    StateDictType,
};
pub use fsdp2::FullyShardedModel;
pub use state_dict::{OptimStateDictApi, StateDictOptions};
