//! FlatParameter layout (layer 3): which parameters go into each flat parameter, in what
//! order, with which alignment and world-size padding, and how it is chunked across ranks.
//! Pure arithmetic: no tensors, no communication.

mod layout;
mod shard;
mod views;

pub use layout::ShardPiece;
pub(crate) use layout::FLAT_PARAM;
pub use layout::{
    aligned_numel, FlatParamLayout, FlatParamMember, ModelLayout, Ownership, ParamSlot,
};
pub use shard::{Shard, ShardParamInfo};
pub(crate) use views::shard_from_members;
pub use views::{flatten_padded, unflatten_full};
