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
//! only their byte ranges; [`verify`] checks everything; [`summary`] describes the directory.
//! The metadata may come from elsewhere than `.metadata` ([`Source`]): `dcp.save(...,
//! use_collectives=False)` writes one `__{rank}.metadata` per rank, each describing only its
//! own items, which [`DcpCheckpoint::open`] merges into one global view after checking that
//! they are parts of one checkpoint (ranks without gaps, keys described alike, chunks tiling
//! each tensor, replicated items stored with identical bytes); `HuggingFaceStorageWriter`
//! writes safetensors files whose headers' `DCP_SHARDING_INFO` gives each tensor's offsets
//! ([`HfForm`]: rank 0's full dict, every rank's shards, or those shards in `sharded/` beside
//! PyTorch's merged files, of which the shards are read), its chunks raw little-endian
//! elements. Everything above reads the one [`Metadata`].
//!
//! Items stored through zstd (`FileSystemWriter(_extensions=[ZStandard()])`,
//! `transform_descriptors == ["stream.zstd/1"]`) follow three rules:
//!
//! * **A declared size the stored bytes cannot hold is refused before anything is allocated
//!   or sized** ([`Error::DcpCompressedTooShort`](crate::Error::DcpCompressedTooShort)). From
//!   the zstd format (RFC 8878): a frame is a 4-byte magic number, a frame header of at least
//!   2 bytes and blocks, each a 3-byte header and its content; no block decompresses to more
//!   than 128 KiB (`Block_Maximum_Size`, which libzstd enforces), and the block that gives the
//!   most per stored byte is an RLE block (header and one byte: 4 bytes for 128 KiB). Skippable
//!   frames, further frames, checksums and longer headers only add stored bytes, so `L` stored
//!   bytes decompress to at most **131072 × ⌊(L − 6) / 4⌋** bytes (none below 10 bytes); each
//!   further zstd layer applies the bound again. A chunk of `n` bytes of data needs `n` bytes
//!   of output at least.
//! * **An item is decompressed in bounded pieces, across all its frames, straight to its
//!   destination**, never into a buffer sized from the metadata, and reading stops as soon as
//!   the output passes what the item may hold ([`ARCHIVE_ALLOWANCE`] beyond a chunk's data,
//!   [`MAX_OBJECT_BYTES`] for a value; `Error::DcpExpansion`): a trailing frame that would
//!   inflate to gigabytes is not inflated past that. A tensor chunk's archive is split as it
//!   decompresses (`read/zstd_chunk.rs`, `torch_save/inflated.rs`): the bytes before its
//!   storage's data and after it (at most [`ARCHIVE_ALLOWANCE`] together) are kept; the data
//!   goes into the chunk's tensor (a whole read, whose tensor the first rule bounds) or, for
//!   a reader that streams the chunk to its outputs, is only checksummed, then decompressed
//!   again and handed out a megabyte at a time, the bytes around it and its CRC-32 checked
//!   against the first pass. The split is believed only when the archive, read over those parts by the
//!   same checks as a whole read, is one tensor that is its whole storage and that storage's
//!   entry is exactly the data (start, size, CRC-32); any other layout (a view of a larger
//!   storage, say) is read from all its bytes as before, so what is read or refused, and
//!   every message, is what a whole read gives. A value is decompressed into a buffer that
//!   grows with the output.
//! * **The range must decompress to exactly one `torch.save` archive**: bytes that are no
//!   zstd frame, a frame the range cuts short (even one whose checksum alone is cut, which
//!   PyTorch's `zstandard` stream reader passes over), and output past the archive's end
//!   records (another frame's archive, trailing bytes) are refused, where PyTorch reads the
//!   first archive and ignores the rest, or fails. What PyTorch 2.13 with `zstandard` reads of
//!   a well-formed item reads alike: an archive split over several frames, skippable frames,
//!   empty frames.
//!
//! A directory written with `serialization_format=SAFETENSORS`, which PyTorch cannot read
//! back, is refused.
//! [`save_dcp`] writes a state dict as a DCP directory ([`save_dcp_with`]: zstd-compressed
//! too). The conversions to and from other
//! formats (`dcp_to_torch_save`, `torch_save_to_dcp`, …) are jobs, in [`crate::commands::conversions`]; this
//! module gives them the plans and the byte moving.

mod files;
mod hf_storage;
mod metadata;
mod per_rank;
mod pickler;
mod plan;
mod read;
#[cfg(test)]
mod tests;
mod unpickle;
mod write;

pub use metadata::{
    Chunk, Entry, EntryKind, Metadata, PathItem, StorageInfo, StorageKey, TensorMeta,
};
pub(crate) use pickler::{metadata_pickle, Record, StoredChunk};
pub use plan::check_tiling;
pub(crate) use plan::flat_range_boxes;
pub(crate) use plan::nest;
pub use read::{
    read_metadata, summary, verify, DataFileSummary, DcpCheckpoint, DcpSummary, EntrySummary,
    VerifyReport,
};
pub(crate) use read::{Placeholders, RangeReader, SafetensorsPlan, Streamed};

pub use hf_storage::{hf_form, HfForm, SHARDING_INFO_KEY};
#[cfg(feature = "fault-injection")]
pub use read::{zstd_chunk_reads, ZstdChunkReads};
pub use read::{ARCHIVE_ALLOWANCE, MAX_OBJECT_BYTES};
pub use write::{save_dcp, save_dcp_with, Compression, DcpWriteOptions};
pub(crate) use write::{save_dcp_compressed, PlannedDcp};

use crate::error::Result;

/// Where a DCP directory's metadata comes from ([`DcpCheckpoint::open`] reads each into the
/// same [`Metadata`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// `.metadata`, written by a collective `dcp.save`.
    Metadata,
    /// One `__{rank}.metadata` per rank (`dcp.save(..., use_collectives=False)`), merged.
    PerRank {
        /// The number of ranks (files).
        ranks: usize,
    },
    /// The safetensors headers of Hugging Face storage (`DCP_SHARDING_INFO`).
    HfStorage {
        /// Which form.
        form: HfForm,
        /// The safetensors files read.
        files: usize,
        /// The ranks that saved them (the distributed forms; `None` for rank 0's).
        ranks: Option<usize>,
    },
}

impl Source {
    /// Which source `dir` has, in precedence order: `.metadata` (any kind of entry: its reader
    /// says what is wrong with it), `__{rank}.metadata` files, Hugging Face storage
    /// ([`hf_form`]); `None` for none of them. The counts of the returned value are not yet
    /// known (zero).
    pub fn of(dir: &Path) -> Result<Option<Source>> {
        if std::fs::symlink_metadata(dir.join(".metadata")).is_ok() {
            return Ok(Some(Source::Metadata));
        }
        if per_rank::has_rank_metadata(dir)? {
            return Ok(Some(Source::PerRank { ranks: 0 }));
        }
        Ok(hf_form(dir)?.map(|form| Source::HfStorage {
            form,
            files: 0,
            ranks: None,
        }))
    }

    /// Whether chunks are stored as raw elements (Hugging Face storage) rather than
    /// `torch.save` archives.
    pub(crate) fn raw_chunks(&self) -> bool {
        matches!(self, Source::HfStorage { .. })
    }

    /// What it is, for summaries ("`.metadata`", "3 per-rank `__{rank}.metadata` files").
    pub fn describe(&self) -> String {
        match self {
            Source::Metadata => "`.metadata`".into(),
            Source::PerRank { ranks } => format!(
                "{ranks} per-rank `__{{rank}}.metadata` files (saved without collectives), merged"
            ),
            Source::HfStorage { form, files, .. } => format!(
                "{}: {DCP_SHARDING_INFO} of {files} safetensors file{}",
                form.describe(),
                if *files == 1 { "" } else { "s" },
                DCP_SHARDING_INFO = SHARDING_INFO_KEY
            ),
        }
    }
}

/// Parses the bytes of a `.metadata` file (`file` names it in errors): its records, and the
/// nested dict's paths checked and placed as PyTorch's loader places them
/// (`plan::check_paths`).
pub fn parse_metadata(file: &str, data: &[u8]) -> Result<Metadata> {
    let metadata = metadata::extract_metadata(file, data)?;
    let placed = plan::check_paths(&metadata.entries).map_err(|e| e.into_error(file))?;
    Ok(Metadata {
        entries: placed.apply(metadata.entries),
        ..metadata
    })
}
use crate::io::safetensors::FileTensors as SafetensorsTensors;
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::FileTensors as TorchSaveTensors;
pub(crate) use crate::io::torch_save::Views;
use std::path::Path;

/// What a DCP directory is for the replace rule of [`crate::storage::check_dir_output`]:
/// `.metadata` plus `__{rank}_{n}.distcp` data files and nothing else. A writer may replace
/// such a directory whole.
pub const DCP_DIR: crate::storage::DirKind = crate::storage::DirKind {
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

/// A state dict file's structure read without its tensor data, by format (the extension):
/// what `convert::torch_save_to_dcp` streams into a DCP directory.
pub(crate) enum Headers {
    TorchSave(crate::io::torch_save::Headers),
    Safetensors(crate::io::safetensors::Headers),
}

impl Headers {
    pub(crate) fn read(input: &Path) -> Result<Self> {
        Ok(match crate::io::FileFormat::from_path(input)? {
            crate::io::FileFormat::Safetensors => {
                Headers::Safetensors(crate::io::safetensors::load_headers(input)?)
            }
            _ => Headers::TorchSave(crate::io::torch_save::load_headers(input)?),
        })
    }

    /// Which stored storage placeholder `t` streams, for a `torch.save` file: equal for
    /// tensors saved as one storage.
    pub(crate) fn storage_key(&self, t: &crate::tensor::HostTensor) -> Option<&str> {
        match self {
            Headers::TorchSave(h) => h.storage_key(t),
            Headers::Safetensors(_) => None,
        }
    }

    /// The object, with placeholders for the tensors the streamer streams.
    pub(crate) fn obj(&self) -> &crate::io::torch_save::PyObj {
        match self {
            Headers::TorchSave(h) => &h.obj,
            Headers::Safetensors(h) => &h.obj,
        }
    }

    /// What streams the placeholders' bytes from `input` while `out` is written; `None` when
    /// they cannot be streamed: a legacy `torch.save` file, or one with a tensor that is not
    /// its whole storage unless `views` is [`Views::Shared`] (see
    /// `torch_save::FileTensors::open`).
    pub(crate) fn streamer<'h>(
        &'h self,
        input: &'h Path,
        out: &'h Path,
        views: Views,
    ) -> Result<Option<Box<dyn LazyTensors + 'h>>> {
        Ok(match self {
            Headers::TorchSave(h) => TorchSaveTensors::open(input, h, out, views)?
                .map(|t| Box::new(t) as Box<dyn LazyTensors>),
            Headers::Safetensors(h) => {
                Some(Box::new(SafetensorsTensors::open(input, &h.placed, out)?))
            }
        })
    }
}
