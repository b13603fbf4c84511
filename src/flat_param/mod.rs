//! FlatParameter layout (layer 3): which parameters go into each flat parameter, in what
//! order, with which alignment and world-size padding, and how it is chunked across ranks.
//! Pure arithmetic: no tensors, no communication.

mod layout;
mod shard;
mod views;

pub use layout::{
    aligned_numel, FlatParamLayout, FlatParamMember, ModelLayout, Ownership, ParamSlot, ShardPiece,
    FLAT_PARAM,
};
pub use shard::{chunk_bounds, chunk_size, shard_param_infos, Shard, ShardParamInfo};
pub use views::{flatten_full, flatten_padded, shard_from_members, shard_of_full, unflatten_full};
