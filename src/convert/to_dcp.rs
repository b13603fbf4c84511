//! A state dict file written as a DCP directory, as `torch_save_to_dcp` writes it.

use super::coordinate::write_dcp;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::{DcpWriteOptions, Headers};
use std::path::Path;

/// Writes the state dict in the `torch.save` (or `.safetensors`) file `src` as the DCP
/// directory `dst`, as `torch.distributed.checkpoint.format_utils.torch_save_to_dcp(src,
/// dst)` does (see [`crate::io::dcp::save_dcp`]). The tensors are streamed from the file
/// (memory holds one 4 MiB chunk) for a `.safetensors` file and for a `torch.save` file whose
/// every tensor is its whole storage (what `torch.save` of a state dict writes); a
/// `torch.save` file with views into shared storages is read into memory first.
///
/// Run by the processes of `pg` (see [the module](super)): when the tensors stream, each
/// process streams its share of them into the one data file, and process 0 writes
/// `.metadata` and installs the directory; a file with shared storages is converted by
/// process 0 alone. Returns the tensor bytes written.
pub fn torch_save_to_dcp(src: &Path, dst: &Path, pg: &dyn ProcessGroup) -> Result<u64> {
    torch_save_to_dcp_with(src, dst, pg, &DcpWriteOptions::default())
}

/// [`torch_save_to_dcp`] with the writer's options: [`Compression::Zstd`] stores every item
/// as a zstd frame, as `FileSystemWriter(_extensions=[ZStandard()])` does (written by
/// process 0 alone, the tensors still streamed from the file).
///
/// [`Compression::Zstd`]: crate::io::dcp::Compression::Zstd
pub fn torch_save_to_dcp_with(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    opts: &DcpWriteOptions,
) -> Result<u64> {
    let headers = pg.agree(Headers::read(src))?;
    let streamer = pg.agree(headers.streamer(src, dst))?;
    match streamer {
        Some(mut lazy) => write_dcp(headers.obj(), dst, lazy.as_mut(), pg, opts),
        None => pg.on_root(|| crate::io::dcp::save_dcp_with(&crate::io::load(src)?, dst, opts)),
    }
}
