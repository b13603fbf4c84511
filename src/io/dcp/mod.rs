//! PyTorch Distributed Checkpoint (DCP) directories, read without Python.
//!
//! `dcp.save(state_dict, checkpoint_id=DIR)` writes `DIR/.metadata` (a pickle of
//! `Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)`) and one
//! `__{rank}_{n}.distcp` file per writer, in which every tensor chunk and every non-tensor
//! value is a complete little `torch.save` archive at a recorded byte range. Keys are
//! flattened (`model.net.0.weight`, `optim.state.net.0.weight.exp_avg`,
//! `optim.param_groups.0.lr`); `planner_data` maps each back to its path in the nested dict.
//!
//! [`DcpCheckpoint::open`] reads `.metadata` with a restricted unpickler (only DCP's classes,
//! `torch.Size`, dtypes, layouts, the memory-format enum and `pathlib` paths resolve; nothing
//! is executed) and checks every data reference stays inside the directory. Tensors are then
//! assembled on demand from any N-D grid of chunks ([`DcpCheckpoint::read_tensor`]), reading
//! only their byte ranges; [`consolidate_to_torch`] writes the file
//! `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` writes, one tensor in memory
//! at a time; [`verify`] checks everything; [`summary`] describes the directory.
//! [`save_dcp`] writes a state dict as a DCP directory, as `torch_save_to_dcp` does.

mod metadata;
mod pickler;
mod plan;
mod read;
mod unpickle;
mod write;

pub use metadata::{
    parse_metadata, Chunk, Entry, EntryKind, Metadata, PathItem, StorageInfo, StorageKey,
    TensorMeta, MAX_METADATA_BYTES,
};
pub(crate) use pickler::{metadata_pickle, Record, StoredChunk};
pub(crate) use plan::nest;
pub use plan::{check_tiling, flat_range_boxes, place_chunk, MAX_CHUNKS_PER_TENSOR};
pub use read::{
    consolidate_to_safetensors, consolidate_to_safetensors_in_group, consolidate_to_torch,
    consolidate_to_torch_in_group, read_metadata, summary, verify, DcpCheckpoint, DcpSummary,
    EntrySummary, FileSummary, VerifyReport,
};

pub use write::save_dcp;
pub(crate) use write::{save_dcp_in_group, save_dcp_streaming};

use crate::error::Result;
use crate::io::safetensors::FileTensors as SafetensorsTensors;
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::FileTensors as TorchSaveTensors;
use std::path::Path;

/// What a DCP directory is for the replace rule of [`crate::io::output::check_dir_output`]:
/// `.metadata` plus `__{rank}_{n}.distcp` data files and nothing else. A writer may replace
/// such a directory whole.
pub const DCP_DIR: crate::io::output::DirKind = crate::io::output::DirKind {
    what: "a DCP checkpoint",
    entries: dcp_entries,
};

fn dcp_entries(dir: &Path) -> std::result::Result<Vec<std::ffi::OsString>, String> {
    if !dir.join(".metadata").is_file() {
        return Err("it has no `.metadata`".into());
    }
    let listing = std::fs::read_dir(dir).map_err(|e| format!("cannot list it: {e}"))?;
    let mut names = Vec::new();
    for e in listing {
        let name = e.map_err(|e| format!("cannot list it: {e}"))?.file_name();
        let s = name.to_string_lossy();
        let data_file = s.starts_with("__") && s.ends_with(".distcp") && !s.contains('/');
        if s == ".metadata" || data_file {
            names.push(name);
        }
    }
    Ok(names)
}

/// Writes the state dict in the `torch.save` (or `.safetensors`) file `input` as the DCP
/// directory `out`, as `torch.distributed.checkpoint.format_utils.torch_save_to_dcp(input,
/// out)` does; see [`save_dcp`]. The tensors are streamed from the file (memory holds one
/// 4 MiB chunk) for a `.safetensors` file and for a `torch.save` file whose every tensor is
/// its whole storage (what `torch.save` of a state dict writes); a `torch.save` file with
/// views into shared storages is read into memory first. Returns the tensor bytes written.
pub fn torch_save_to_dcp(input: &Path, out: &Path) -> Result<u64> {
    let headers = Headers::read(input)?;
    let streamer = headers.streamer(input, out)?;
    match streamer {
        Some(mut lazy) => save_dcp_streaming(headers.obj(), out, lazy.as_mut()),
        None => save_dcp(&crate::io::load(input)?, out),
    }
}

/// [`torch_save_to_dcp`] split across the processes of `pg`, each calling it with the same
/// paths (the same files for all, e.g. on a shared filesystem): when the tensors stream from
/// the input (see [`torch_save_to_dcp`]), each process streams its share of them into the
/// one data file and process 0 writes `.metadata` and installs the directory (the data file
/// is byte for byte the single-process one); a `torch.save` file with views into shared
/// storages is converted by process 0 alone. A failure on any process fails every process
/// with the lowest failing one's error, and `out` is left as it was. Returns the tensor bytes
/// written.
pub fn torch_save_to_dcp_in_group(
    input: &Path,
    out: &Path,
    pg: &dyn crate::collectives::ProcessGroup,
) -> Result<u64> {
    use crate::collectives::ProcessGroupExt;
    let headers = pg.agree(Headers::read(input))?;
    let streamer = pg.agree(headers.streamer(input, out))?;
    match streamer {
        Some(mut lazy) => save_dcp_in_group(headers.obj(), out, lazy.as_mut(), pg),
        None => pg.on_root(|| save_dcp(&crate::io::load(input)?, out)),
    }
}

/// A state dict file's structure read without its tensor data, by format (the extension).
enum Headers {
    TorchSave(crate::io::torch_save::Headers),
    Safetensors(crate::io::safetensors::Headers),
}

impl Headers {
    fn read(input: &Path) -> Result<Self> {
        Ok(match crate::io::FileFormat::from_path(input)? {
            crate::io::FileFormat::Safetensors => {
                Headers::Safetensors(crate::io::safetensors::load_headers(input)?)
            }
            _ => Headers::TorchSave(crate::io::torch_save::load_headers(input)?),
        })
    }

    /// The object, with placeholders for the tensors the streamer streams.
    fn obj(&self) -> &crate::io::torch_save::PyObj {
        match self {
            Headers::TorchSave(h) => &h.obj,
            Headers::Safetensors(h) => &h.obj,
        }
    }

    /// What streams the placeholders' bytes from `input` while `out` is written; `None` when
    /// they cannot be streamed (a `torch.save` tensor that is not its whole storage).
    fn streamer<'h>(
        &'h self,
        input: &'h Path,
        out: &'h Path,
    ) -> Result<Option<Box<dyn LazyTensors + 'h>>> {
        Ok(match self {
            Headers::TorchSave(h) => {
                TorchSaveTensors::open(input, h, out)?.map(|t| Box::new(t) as Box<dyn LazyTensors>)
            }
            Headers::Safetensors(h) => Some(Box::new(SafetensorsTensors::open(input, h, out)?)),
        })
    }
}
