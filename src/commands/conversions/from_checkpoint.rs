//! The crate's sharded checkpoint consolidated into one file, or converted to DCP: the full
//! dict `full_optim_state_dict` returned when it was saved, streamed one verified checksum
//! block at a time, so memory stays bounded whatever the model size.

use super::coordinate::{write_dcp, write_planned_file, write_torch_save};
use crate::checkpoint::stream::{
    prepare_dcp_output, prepare_output, write_share, SafetensorsPlan, Skeleton, Streamed,
};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::DcpWriteOptions;
use std::path::Path;

/// Writes the full dict of the checkpoint in `src` — what `full_optim_state_dict` returned
/// when it was saved — to `dst` as a `.safetensors` file in the crate's mapping
/// ([`crate::io::safetensors`]), streaming: memory stays at two checksum blocks (8 MiB) plus
/// the dict's structure, whatever the model size. Every block read is verified.
///
/// Run by the processes of `pg` (see [the module](super)): each writes the data of its share
/// of the tensors (about `1 / pg.world_size()` of the bytes, reading only the blocks it
/// needs) at their planned offsets, and process 0 writes the header. `progress` gets this
/// process's tensor bytes written so far; the return value is the tensor bytes written by all
/// of them.
pub fn checkpoint_to_safetensors(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    pg.on_root(|| prepare_output(src, dst))?;
    let sk = pg.agree(Skeleton::new(src))?;
    let plan = pg.agree(SafetensorsPlan::new(&sk))?;
    let me = (pg.rank(), pg.world_size());
    let written = write_planned_file(
        dst,
        plan.file_len(),
        pg,
        |file, tmp| write_share(src, (file, dst, tmp), &sk, &plan, me, progress),
        |file, tmp, _| plan.write_header(file, dst, tmp),
    )?;
    Ok(written.iter().sum())
}

/// [`checkpoint_to_safetensors`] to a `torch.save` file instead: `torch.load(dst)` gives what
/// `FSDP.full_optim_state_dict` returned when the checkpoint was saved, byte for byte the file
/// `torch_save::save_optim_state_dict(&checkpoint::load_full(src)?, dst)` writes, but streamed
/// one checksum block at a time. Every block read is verified.
///
/// Run by the processes of `pg` (see [the module](super)): each streams about
/// `1 / pg.world_size()` of the states' bytes into their planned places in the file, and
/// process 0 writes the rest of the archive. `progress` gets this process's tensor bytes
/// written so far; the return value is the tensor bytes written by all of them.
pub fn checkpoint_to_torch_save(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    pg.on_root(|| prepare_output(src, dst))?;
    let sk = pg.agree(Skeleton::new(src))?;
    let mut lazy = Streamed::new(src, dst, &sk, progress);
    write_torch_save(&sk.obj, dst, &mut lazy, pg)
}

/// Writes the full dict of the checkpoint in `src` as the DCP directory `dst`: what
/// [`super::torch_save_to_dcp`] makes of the file [`checkpoint_to_torch_save`] writes
/// (`dcp.load` into `{"state": …, "param_groups": …}` gives `full_optim_state_dict`'s dict),
/// streamed one checksum block at a time with bounded memory. Every block read is verified.
///
/// Run by the processes of `pg` (see [the module](super)): each writes about
/// `1 / pg.world_size()` of the tensors' bytes into the one data file, reading only the
/// blocks it needs, and process 0 writes `.metadata`. `progress` gets this process's tensor
/// bytes; the return value is the tensor bytes of the whole directory.
pub fn checkpoint_to_dcp(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    checkpoint_to_dcp_with(src, dst, pg, &DcpWriteOptions::default(), progress)
}

/// [`checkpoint_to_dcp`] with the writer's options: [`Compression::Zstd`] stores every item
/// as a zstd frame, as `FileSystemWriter(_extensions=[ZStandard()])` does (written by
/// process 0 alone, still streamed one checksum block at a time).
///
/// [`Compression::Zstd`]: crate::io::dcp::Compression::Zstd
pub fn checkpoint_to_dcp_with(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    opts: &DcpWriteOptions,
    progress: impl FnMut(u64),
) -> Result<u64> {
    pg.on_root(|| prepare_dcp_output(src, dst))?;
    let sk = pg.agree(Skeleton::new(src))?;
    let mut lazy = Streamed::new(src, dst, &sk, progress);
    write_dcp(&sk.obj, dst, &mut lazy, pg, opts)
}
