//! A Megatron-Core checkpoint's model tensors consolidated into one file.

use super::from_dcp::{safetensors_of, torch_save_of};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::megatron::MegatronCheckpoint;
use std::path::Path;

/// Writes the model tensors of the Megatron-Core checkpoint at `src` (a `torch_dist`
/// directory, or a Megatron-LM or Bridge tree: [`MegatronCheckpoint::open`]) to `dst` as a
/// `torch.save` file: exactly the model-tensor entries of what `dcp_to_torch_save` writes for
/// its `torch_dist` directory (every tensor key outside `optimizer.`, in metadata order,
/// Megatron's names and global shapes: layers stacked, tensor-parallel pieces joined), bit
/// for bit; streamed as a DCP directory's consolidation is.
///
/// Run by the processes of `pg` (see [the module](super)). `progress` gets this process's
/// tensor bytes; returns the tensor bytes written by all of them.
pub fn megatron_to_torch_save(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = pg.agree(MegatronCheckpoint::open(src))?;
    torch_save_of(ckpt.model_tensors(), dst, pg, progress)
}

/// [`megatron_to_torch_save`] to a `.safetensors` file (the crate's mapping,
/// [`crate::io::safetensors`]: here one tensor per key).
pub fn megatron_to_safetensors(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = pg.agree(MegatronCheckpoint::open(src))?;
    safetensors_of(ckpt.model_tensors(), dst, pg, progress)
}
