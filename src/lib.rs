#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod checkpoint;
pub mod collectives;
pub mod convert;
pub mod error;
pub mod flat_param;
pub mod fully_shard;
pub mod io;
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub mod libtorch;
pub mod model;
pub mod offline;
pub mod optim;
pub mod optim_state;
pub mod param_layout;
pub mod param_shards;
pub mod placement;
pub mod state_dict;
pub mod tensor;

mod fsdp1;
mod fsdp2;

pub use optim_state::OptimStateKeyType;

pub use error::{Error, LookupSite, Result};
pub use fsdp1::*;
pub use fsdp2::FullyShardedModel;
pub use model::{FsdpVersion, ModelDesc, ParamDesc, ShardingStrategy, WrapPolicy};
pub use offline::DescFile;
pub use optim_state::{
    OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value,
};
pub use state_dict::{OptimStateDictApi, StateDictOptions};
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use tensor::TchTensor;
pub use tensor::{DType, HostTensor, Tensor};
