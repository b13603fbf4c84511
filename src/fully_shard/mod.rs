//! FSDP2's collectives (layer 4): the all-gather that unshards a `fully_shard` group's
//! parameters and the reduce-scatter that shards its gradients, over any
//! [`ProcessGroup`](crate::collectives::ProcessGroup) (threads, MPI, NCCL).
//!
//! They follow `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`:
//! - [`foreach_all_gather`] copies every rank's padded shards into one flat input (copy-in),
//!   all-gathers it, and [`foreach_all_gather_copy_out`] cuts the output back into unsharded
//!   parameters. Parameters of different dtypes travel together as bytes, as PyTorch's
//!   `uint8` all-gather does.
//! - [`foreach_reduce`] chunk-concatenates the unsharded gradients into the reduce dtype
//!   (zero padding, copy-in), pre-divides, reduce-scatters, post-divides, casts to the
//!   parameter dtype and views out each rank's sharded gradients.
//! - [`gradient_divide_factors`] is `_get_gradient_divide_factors`; a custom factor
//!   ([`ReduceOptions::divide_factor`]) is `set_reduce_scatter_divide_factor`.
//!
//! Which rows each rank holds is [`crate::param_layout`]'s pure arithmetic; this module only
//! moves bytes.

mod all_gather;
mod divide;
mod elementwise;
mod reduce;

pub use all_gather::{
    all_gather_copy_in, foreach_all_gather, foreach_all_gather_copy_out, AllGatherResult,
};
pub use divide::{gradient_divide_factors, DivideFactors, GradReduceOp};
pub use elementwise::{cast, div_if_needed};
pub use reduce::{foreach_reduce, reduce_scatter_copy_in, ReduceOptions};
