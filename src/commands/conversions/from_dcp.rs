//! A DCP directory consolidated into one file: what `dcp_to_torch_save` writes, or the same
//! dict as `.safetensors`.

use super::coordinate::{write_dcp, write_planned_file, write_torch_save};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::{DcpCheckpoint, DcpWriteOptions, Placeholders, SafetensorsPlan, Streamed};
use std::path::Path;

/// Writes the DCP checkpoint in `src` to `dst` as the `torch.save` file
/// `torch.distributed.checkpoint.format_utils.dcp_to_torch_save(src, dst)` writes: the same
/// nested dict (keys in metadata order, string keys, lists, non-tensor values) with the same
/// tensors bit for bit. Chunks that are runs of the row-major flattening (dim-0 shards, the
/// partial-row boxes of flat-parameter shards) go out as they are read, 1 MiB at a time; other
/// grids hold one assembled tensor at a time. Every chunk's
/// range and tiling is checked before the output is created.
///
/// Run by the processes of `pg` (see [the module](super)), each streams about
/// `1 / pg.world_size()` of the tensors' bytes into their planned places in the file.
/// `progress` gets this process's tensor bytes written so far; the return value is the tensor
/// bytes written by all of them.
pub fn dcp_to_torch_save(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = pg.agree(DcpCheckpoint::open(src))?;
    torch_save_of(ckpt, dst, pg, progress)
}

/// [`dcp_to_torch_save`] of an opened checkpoint (narrowed to some keys, for one).
pub(super) fn torch_save_of(
    ckpt: DcpCheckpoint,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = ckpt.dropping_behind();
    let placeholders = pg.agree(Placeholders::new(&ckpt))?;
    let mut lazy = Streamed::new(&ckpt, &placeholders, progress);
    write_torch_save(&placeholders.obj, dst, &mut lazy, pg)
}

/// [`dcp_to_torch_save`] to a `.safetensors` file in the crate's mapping
/// ([`crate::io::safetensors`]): the nested dict's structure in `__metadata__`, the tensors
/// by their path, streamed as [`dcp_to_torch_save`] streams them, after every chunk was
/// checked.
///
/// Run by the processes of `pg` (see [the module](super)), each streams about
/// `1 / pg.world_size()` of the tensors' bytes at their planned offsets, and process 0 writes
/// the header. `progress` gets this process's tensor bytes; the return value is the tensor
/// bytes written by all of them.
pub fn dcp_to_safetensors(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = pg.agree(DcpCheckpoint::open(src))?;
    safetensors_of(ckpt, dst, pg, progress)
}

/// [`dcp_to_safetensors`] of an opened checkpoint (narrowed to some keys, for one).
pub(super) fn safetensors_of(
    ckpt: DcpCheckpoint,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = ckpt.dropping_behind();
    let plan = pg.agree(SafetensorsPlan::new(&ckpt))?;
    let me = (pg.rank(), pg.world_size());
    let written = write_planned_file(
        dst,
        plan.file_len(),
        pg,
        |file, tmp| plan.write_share(&ckpt, (file, dst, tmp), me, progress),
        |file, tmp, _| plan.write_header(file, dst, tmp),
    )?;
    Ok(written.iter().sum())
}

/// Writes the DCP checkpoint in `src`, of any form [`DcpCheckpoint::open`] reads (per-rank
/// metadata, Hugging Face storage, or `.metadata`), as a DCP directory `dst` with one global
/// `.metadata`: the nested dict [`dcp_to_torch_save`] writes, saved as
/// [`crate::io::dcp::save_dcp`] saves it (what `torch_save_to_dcp` of that file writes), its
/// tensors streamed one at a time. `dst` may not overlap `src`.
///
/// Run by the processes of `pg` (see [the module](super)): each streams its share of the
/// tensors into the one data file, and process 0 writes `.metadata` and installs the
/// directory. Returns the tensor bytes written.
pub fn dcp_to_dcp(src: &Path, dst: &Path, pg: &dyn ProcessGroup) -> Result<u64> {
    dcp_to_dcp_with(src, dst, pg, &DcpWriteOptions::default())
}

/// [`dcp_to_dcp`] with the writer's options ([`DcpWriteOptions`]: zstd compression, written
/// by process 0 alone).
pub fn dcp_to_dcp_with(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    opts: &DcpWriteOptions,
) -> Result<u64> {
    pg.agree(crate::storage::check_not_overlapping(dst, &[src]))?;
    let ckpt = pg.agree(DcpCheckpoint::open(src))?.dropping_behind();
    let placeholders = pg.agree(Placeholders::new(&ckpt))?;
    let mut lazy = Streamed::new(&ckpt, &placeholders, |_| {});
    write_dcp(&placeholders.obj, dst, &mut lazy, pg, opts)
}
