//! The conversions between checkpoint formats, one job over a process group per direction,
//! named after PyTorch's own where it has one (`dcp_to_torch_save`, `torch_save_to_dcp`); the
//! commands ([`crate::commands`]) recognize the input and run them:
//!
//! | from \ to | `torch.save` file | `.safetensors` file | DCP directory | the crate's checkpoint |
//! | --- | --- | --- | --- | --- |
//! | DCP directory (any form) | [`dcp_to_torch_save`] | [`dcp_to_safetensors`] | [`dcp_to_dcp`] | [`dcp_to_checkpoint`] |
//! | `torch.save` / `.safetensors` file | [`crate::io::load`], [`crate::io::save`] | [`crate::io::load`], [`crate::io::save`] | [`torch_save_to_dcp`] | |
//! | the crate's checkpoint | [`checkpoint_to_torch_save`] | [`checkpoint_to_safetensors`] | [`checkpoint_to_dcp`] | [`crate::checkpoint::reshard`] |
//! | DeepSpeed checkpoint (ZeRO 1/2/3, universal) | [`deepspeed_to_torch_save`] | [`deepspeed_to_safetensors`] | [`deepspeed_to_dcp`] | |
//! | Megatron-Core `torch_dist` (model tensors) | [`megatron_to_torch_save`] | [`megatron_to_safetensors`] | | |
//!
//! A DCP directory is read in every form [`crate::io::dcp::DcpCheckpoint::open`] reads: one
//! `.metadata`, per-rank `__{rank}.metadata` files (merged), or Hugging Face storage
//! (`DCP_SHARDING_INFO` headers); [`dcp_to_dcp`] rewrites the others with one `.metadata`.
//!
//! Each is a job run by a process group: one process passes [`Solo`](crate::collectives::Solo),
//! and the processes of an MPI job (or any [`ProcessGroup`]) each call it with the same
//! arguments to share the bytes. The output is the same for any number of processes, appears
//! whole or not at all, and a failure on any process fails every process with the error of
//! the lowest failing one.
//!
//! This module is the coordinator of PyTorch DCP's split: the formats in [`crate::io`] plan
//! each output (which bytes go where) and move the bytes of one share; the functions here run
//! the plan over the group (`coordinate.rs`).
//!
//! ```no_run
//! use fsdp::collectives::Solo;
//! # fn main() -> fsdp::Result<()> {
//! // What `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` writes.
//! let bytes = fsdp::commands::conversions::dcp_to_torch_save("step_1000".as_ref(), "full.pt".as_ref(), &Solo, |_| {})?;
//! # Ok(()) }
//! ```

mod coordinate;
mod from_checkpoint;
mod from_dcp;
mod from_deepspeed;
mod from_hf;
mod from_megatron;
mod to_dcp;
mod to_hf;

pub use crate::checkpoint::import_dcp::dcp_to_checkpoint;
pub use from_checkpoint::{
    checkpoint_to_dcp, checkpoint_to_dcp_with, checkpoint_to_safetensors, checkpoint_to_torch_save,
};
pub use from_dcp::{dcp_to_dcp, dcp_to_dcp_with, dcp_to_safetensors, dcp_to_torch_save};
pub use from_deepspeed::{
    deepspeed_to_dcp, deepspeed_to_safetensors, deepspeed_to_torch_save, DeepSpeedOutput,
};
pub use from_hf::{hf_to_dcp, HfImportOptions};
pub use from_megatron::{megatron_to_safetensors, megatron_to_torch_save};
pub use to_dcp::{torch_save_to_dcp, torch_save_to_dcp_with};
pub use to_hf::{checkpoint_to_hf, HfExportOptions, HfExported, HfSource};

#[cfg(doc)]
use crate::collectives::ProcessGroup;
