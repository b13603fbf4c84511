//! PyTorch's `torch.save` format, read and written without libtorch.
//!
//! A `torch.save` file is a zip archive `<name>/data.pkl` (a pickle stream) plus one entry
//! `<name>/data/<key>` per tensor storage, and a few small records (`version`, `byteorder`,
//! `.format_version`, `.storage_alignment`, `.data/serialization_id`). This module reads such
//! files into a [`PyObj`] tree and writes [`PyObj`] trees so that PyTorch 2.13 loads them with
//! `torch.load(path, weights_only=True)`; on top of that it converts optimizer and model state
//! dicts.
//!
//! What is read: what `torch.load(path, weights_only=True)` reads in PyTorch 2.13, in the zip
//! format and the legacy one (`_use_new_zipfile_serialization=False`): the containers and
//! scalars of state dicts (`dict`, `OrderedDict`, `list`, `tuple`, `str`, `int` of any size,
//! `float`, `complex`, `bool`, `None`, `bytes`, `bytearray`, `set`, `Counter`, `torch.Size`,
//! `torch.device`, dtypes and other torch constants) and tensors of every dtype of the
//! crate's table (complex included), whatever device they were saved from. Parameters and
//! tensors with `requires_grad` or Python attributes (FSDP1's full state dict marks its
//! tensors with `_has_been_cloned`), sparse, quantized and meta tensors are
//! [`PyObj::RichTensor`]s. FSDP1's `ShardedTensor` and FSDP2's `DTensor` (sharded optimizer
//! states) are read as [`PyObj::Sharded`]: the local shard with the global shape and its
//! offsets, through an allow-list of their inert metadata classes (no process group, nothing
//! that runs code). Like `weights_only=True`, nothing is executed and any other Python global
//! is refused with [`Error::UnsupportedPickleGlobal`]; the few allowed globals with no place
//! in a checkpoint (nested tensors, …) are refused by name ([`Error::Unsupported`]).
//! Contiguous tensors are zero-copy views of their storage, so tensors that shared a storage
//! when saved share one buffer when loaded; non-contiguous ones (a transposed tensor) are
//! copied into contiguous memory. Malformed input of any kind gives an error, never a panic.
//!
//! What is written: the same records, in PyTorch's order, uncompressed, each entry's data
//! aligned to 64 bytes; tensors viewing one buffer share one storage. [`save`] writes to a
//! temporary file beside the target, syncs it and renames it over the target, so a crash never
//! leaves a partial file under the target's name.
//!
//! ```
//! use fsdp::io::torch_save::{self, PyObj};
//! use fsdp::HostTensor;
//!
//! let obj = PyObj::Dict(vec![
//!     (PyObj::Str("step".into()), PyObj::Tensor(HostTensor::scalar(3.0f32))),
//!     (PyObj::Str("betas".into()), PyObj::Tuple(vec![PyObj::Float(0.9), PyObj::Float(0.999)])),
//! ]);
//! let bytes = torch_save::save_to_bytes(&obj).unwrap();
//! assert_eq!(torch_save::load_from_bytes(&bytes).unwrap(), obj);
//! ```

mod convert;
mod cursor;
mod inflated;
mod legacy;
mod lone_tensor;
mod pyobj;
mod ranged;
mod unpickle;
pub(crate) mod writer;
mod zip;

pub(crate) use inflated::{Hold, Inflated, Split};
pub(crate) use lone_tensor::{check_forward, LoneTensor};
pub(crate) use ranged::StorageReader;
pub(crate) use unpickle::{Allow, PlaceholderView};

pub use convert::{
    model_from_pyobj, model_to_pyobj, optim_from_pyobj, optim_to_pyobj, value_to_pyobj,
    SavedModelStateDict,
};
pub use pyobj::{PyObj, QDType, QScheme, QuantizedTensor, RichTensor, SparseLayout, TensorValue};

use crate::error::{Error, Result};
use crate::optim_state::OptimStateDict;
use crate::storage::StreamedFile;
use crate::tensor::{DType, HostTensor};
use std::fs::{File, OpenOptions};
use std::io::BufWriter;
use std::path::Path;
use std::sync::Arc;
use zip::{Extracted, FileSource, Source, ZipReader};

/// Name used for in-memory archives in error messages.
const MEMORY: &str = "<memory>";

/// How [`load_with`] reads a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadOptions {
    /// Non-contiguous tensors (transposed, expanded, overlapping views) are copied into
    /// contiguous memory; all such copies together may allocate at most the file's storage
    /// bytes plus this many bytes, else [`Error::TensorExpansion`]. A few KB of stride-0
    /// views could otherwise ask for any amount of memory. Default
    /// [`LoadOptions::DEFAULT_MAX_EXPANSION_BYTES`] (256 MiB).
    pub max_expansion_bytes: u64,
}

impl LoadOptions {
    /// The default expansion allowance: 256 MiB.
    pub const DEFAULT_MAX_EXPANSION_BYTES: u64 = 256 << 20;

    /// Sets [`LoadOptions::max_expansion_bytes`] (the struct is `#[non_exhaustive]`, so that
    /// options can be added without breaking callers).
    pub fn max_expansion_bytes(mut self, bytes: u64) -> Self {
        self.max_expansion_bytes = bytes;
        self
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            max_expansion_bytes: Self::DEFAULT_MAX_EXPANSION_BYTES,
        }
    }
}

/// The structure of a `torch.save` file without its tensor data ([`load_headers`]).
#[derive(Debug, Clone)]
pub struct Headers {
    /// The object. Tensors of more than one element are empty placeholders of the right
    /// dtype (their real shape is [`Headers::shape`]); smaller ones are read.
    pub obj: PyObj,
    shapes: std::collections::HashMap<usize, Vec<usize>>,
    /// The storage key of each placeholder that is its whole storage.
    whole: std::collections::HashMap<usize, String>,
    /// Where each placeholder lies in its storage.
    views: std::collections::HashMap<usize, unpickle::PlaceholderView>,
    /// The expansion allowance [`load`] needs for the file's non-contiguous tensors.
    expansion_needed: u64,
}

impl Headers {
    /// The archive's storage key of a placeholder that is its whole storage: equal for
    /// tensors saved as one storage (tied weights).
    pub(crate) fn storage_key(&self, t: &HostTensor) -> Option<&str> {
        self.whole.get(&t.storage_id()).map(String::as_str)
    }

    /// Where a placeholder of [`Headers::obj`] lies in its storage; `None` for a tensor
    /// that was read (at most one element).
    pub(crate) fn view(&self, t: &HostTensor) -> Option<&PlaceholderView> {
        self.views.get(&t.storage_id())
    }

    /// The real shape of a tensor of [`Headers::obj`] (or of a clone of it).
    pub fn shape<'a>(&'a self, t: &'a HostTensor) -> &'a [usize] {
        self.shapes
            .get(&t.storage_id())
            .map_or(t.shape(), Vec::as_slice)
    }
}

/// Reads the object saved in the `torch.save` file at `path`.
///
/// Tensor data is read straight from the file into its buffers; the file is not held in
/// memory as a whole.
pub fn load(path: impl AsRef<Path>) -> Result<PyObj> {
    load_with(path, &LoadOptions::default())
}

/// [`load`] with options.
pub fn load_with(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<PyObj> {
    let (name, src) = open(path.as_ref())?;
    let mode = unpickle::Mode::Full {
        max_expansion_bytes: opts.max_expansion_bytes,
    };
    Ok(read_archive(&name, src, mode, Allow::TorchLoad)?.obj)
}

/// Reads the structure of the `torch.save` file at `path`: the pickle and the storage
/// records (each checked against its entry's size), but no tensor data except that of
/// tensors of at most one element. What `fsdp-ckpt inspect` reads: its memory does not
/// depend on the tensors' sizes.
pub fn load_headers(path: impl AsRef<Path>) -> Result<Headers> {
    load_headers_with(path.as_ref(), Allow::TorchLoad)
}

/// [`load_headers`] with the allow-list `allow`: [`Allow::DeepSpeed`] only for the files of
/// a recognised DeepSpeed checkpoint ([`crate::io::deepspeed`]).
pub(crate) fn load_headers_with(path: &Path, allow: Allow) -> Result<Headers> {
    let (name, src) = open(path)?;
    let u = read_archive(&name, src, unpickle::Mode::Headers, allow)?;
    Ok(Headers {
        obj: u.obj,
        shapes: u.shapes,
        whole: u.whole,
        views: u.views,
        expansion_needed: u.expansion_needed,
    })
}

fn open(path: &Path) -> Result<(String, FileSource)> {
    let name = path.display().to_string();
    let io = |e: std::io::Error| Error::Io {
        op: "reading".into(),
        path: name.clone(),
        source: e.into(),
    };
    // A regular file only (symbolic links followed): a FIFO would block, a device never end.
    let file = crate::storage::open_regular(path).map_err(|e| e.at("reading", path))?;
    let len = file.metadata().map_err(io)?.len();
    Ok((
        name,
        FileSource {
            file: file.into(),
            start: 0,
            len,
            read_ahead: true,
        },
    ))
}

/// The archive at bytes `start..start + len` of `file`, open at `path` and shared with the
/// other archives of that file, as a source (left to the file's own read-ahead), with the
/// name messages give it.
fn shared_range(file: Arc<File>, path: &Path, start: u64, len: u64) -> (String, FileSource) {
    let name = format!("{} (bytes {start}..+{len})", path.display());
    let src = FileSource {
        file,
        start,
        len,
        read_ahead: false,
    };
    (name, src)
}

/// Reads the object of the `torch.save` archive stored at bytes `start..start + len` of the
/// file at `path` (as each chunk of a DCP data file is), reading tensor data straight into
/// the tensors: no copy of the archive is held. The caller checks that the range lies inside
/// the file; errors name the file and the range.
pub fn load_from_file_range(path: &Path, start: u64, len: u64) -> Result<PyObj> {
    let file = crate::storage::open_regular(path).map_err(|e| e.at("reading", path))?;
    load_from_shared_range(file.into(), path, start, len)
}

/// [`load_from_file_range`] through `file`, open at `path` and shared with the other archives
/// of that file (the chunks of a DCP data file, read through one open file).
pub(crate) fn load_from_shared_range(
    file: Arc<File>,
    path: &Path,
    start: u64,
    len: u64,
) -> Result<PyObj> {
    let (name, src) = shared_range(file, path, start, len);
    let mode = unpickle::Mode::Full {
        max_expansion_bytes: LoadOptions::default().max_expansion_bytes,
    };
    Ok(read_archive(&name, src, mode, Allow::TorchLoad)?.obj)
}

/// Which `torch.save` files [`FileTensors::open`] streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Views {
    /// Only files whose every placeholder is its whole storage.
    Whole,
    /// Also files with views into shared storages (tied weights, views at an offset, strided
    /// views, storages larger than their views): each such storage is read whole once per
    /// run of its views, its CRC-32 checked, and its views cut from it.
    Shared,
}

/// The placeholders of a [`Headers`] read from the `torch.save` file `path`, streamed from
/// the file when the archive is written. A placeholder that is its whole storage streams 4
/// MiB at a time ([`crate::io::stream_range`]) from its storage entry, its CRC-32 checked at
/// its end. A storage that some placeholder views only in part (a *shared* storage, with
/// [`Views::Shared`]) is read whole, its CRC-32 checked, and held while its views are
/// written, each as its elements in row-major order (what [`load`] materializes); it is
/// dropped when a placeholder of another shared storage is streamed. So memory holds one
/// shared storage, and a writer that streams the views of each storage one after another
/// ([`writer::LazyTensors::read_group`]) reads each once. The pages read are dropped from
/// the page cache.
pub(crate) struct FileTensors<'h> {
    headers: &'h Headers,
    zip: ZipReader<FileSource>,
    prefix: String,
    /// The output being written, for messages.
    out: &'h Path,
    /// The shared storages, by key, each with its index (keys in order).
    shared: std::collections::HashMap<String, usize>,
    /// The shared storage read last (its key and bytes).
    held: Option<(String, HostTensor)>,
    /// Whole reads of shared storages so far, and the most bytes held at once.
    reads: usize,
    peak_held: u64,
}

impl<'h> FileTensors<'h> {
    /// Streams `headers`' placeholders from the file `path` they were read from, writing
    /// `out`; `None` when it cannot: a legacy file, a placeholder that is not its whole
    /// storage with [`Views::Whole`], or, with [`Views::Shared`], non-contiguous views whose
    /// copies [`load`] refuses ([`Error::TensorExpansion`]: the file must fail as [`load`]
    /// fails).
    pub(crate) fn open(
        path: &Path,
        headers: &'h Headers,
        out: &'h Path,
        views: Views,
    ) -> Result<Option<Self>> {
        let partial: std::collections::BTreeSet<&str> = headers
            .views
            .iter()
            .filter(|(id, _)| !headers.whole.contains_key(id))
            .map(|(_, v)| v.key.as_str())
            .collect();
        let refused = match views {
            Views::Whole => !partial.is_empty(),
            Views::Shared => headers.expansion_needed > LoadOptions::DEFAULT_MAX_EXPANSION_BYTES,
        };
        if refused {
            return Ok(None);
        }
        let (name, mut src) = open(path)?;
        if starts_legacy(&name, &mut src)? {
            return Ok(None);
        }
        let (zip, prefix) = open_archive(&name, src)?;
        Ok(Some(FileTensors {
            headers,
            zip,
            prefix,
            out,
            shared: partial
                .into_iter()
                .enumerate()
                .map(|(i, k)| (k.to_string(), i))
                .collect(),
            held: None,
            reads: 0,
            peak_held: 0,
        }))
    }

    /// How many times a shared storage was read whole, and the most bytes of shared
    /// storages held at once.
    #[cfg(test)]
    pub(crate) fn held_stats(&self) -> (usize, u64) {
        (self.reads, self.peak_held)
    }

    /// The shared storage `key`'s bytes: the one held, or read whole now (its CRC-32
    /// checked) in place of the one held.
    fn hold(&mut self, key: &str) -> Result<&[u8]> {
        if self.held.as_ref().is_none_or(|(k, _)| k != key) {
            // Dropped first: memory holds one shared storage at a time.
            self.held = None;
            let entry = storage_entry(&self.zip, &self.prefix, key)?;
            let start = self.zip.data_start(&entry)?;
            let len = usize::try_from(entry.size).map_err(|_| {
                Error::Internal(format!("storage {key} is larger than the address space"))
            })?;
            let zip = &mut self.zip;
            let bytes = HostTensor::filled_by_reads(DType::U8, &[len], |buf| {
                zip.read_part(&entry, start, buf)?;
                zip.check_crc(&entry, start, crc32fast::hash(buf))
            })?;
            self.zip.drop_cached(start, entry.size);
            self.reads += 1;
            self.peak_held = self.peak_held.max(entry.size);
            self.held = Some((key.to_string(), bytes));
        }
        Ok(self.held.as_ref().map_or(&[][..], |(_, b)| b.as_bytes()))
    }

    /// Streams the whole storage `key` 4 MiB at a time, checking its CRC-32 at the end.
    fn stream_whole(
        &mut self,
        key: &str,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        let entry = storage_entry(&self.zip, &self.prefix, key)?;
        let start = self.zip.data_start(&entry)?;
        let mut crc = crc32fast::Hasher::new();
        let out = self.out;
        crate::io::stream_range(
            start,
            entry.size,
            |at, buf| self.zip.read_part(&entry, at, buf),
            |chunk| {
                crc.update(chunk);
                sink(chunk).map_err(Error::io("writing", out))
            },
        )?;
        self.zip.check_crc(&entry, start, crc.finalize())?;
        self.zip.drop_cached(start, entry.size);
        Ok(())
    }
}

/// Hands the elements of `view` (of `shape`, elements of `esize` bytes) of the storage
/// `bytes` to `sink` in row-major order, at most 4 MiB at a time. `None` when the view does
/// not lie inside `bytes` (the reader checked that it does).
fn stream_view(
    bytes: &[u8],
    esize: usize,
    view: &unpickle::PlaceholderView,
    shape: &[usize],
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> Option<std::io::Result<()>> {
    let chunk = super::STREAM_CHUNK as usize;
    let range = |first: usize, n: usize| bytes.get(first * esize..(first + n) * esize);
    if view.contiguous {
        let all = range(view.offset, shape.iter().product())?;
        return Some(all.chunks(chunk).try_for_each(sink));
    }
    let total = shape.iter().product::<usize>() * esize;
    let mut buf = Vec::with_capacity(chunk.min(total));
    for (first, n) in unpickle::strided_runs(view.offset, shape, &view.stride) {
        let mut run = range(first, n)?;
        while !run.is_empty() {
            let take = run.len().min(chunk - buf.len());
            buf.extend_from_slice(&run[..take]);
            run = &run[take..];
            if buf.len() == chunk {
                if let Err(e) = sink(&buf) {
                    return Some(Err(e));
                }
                buf.clear();
            }
        }
    }
    Some(if buf.is_empty() { Ok(()) } else { sink(&buf) })
}

impl writer::LazyTensors for FileTensors<'_> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        self.headers.shapes.get(&t.storage_id()).cloned()
    }

    fn read_group(&self, t: &HostTensor) -> Option<usize> {
        let view = self.headers.views.get(&t.storage_id())?;
        self.shared.get(&view.key).copied()
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        let headers = self.headers;
        let Some(view) = headers.views.get(&t.storage_id()) else {
            return Ok(());
        };
        if !self.shared.contains_key(&view.key) {
            return self.stream_whole(&view.key, sink);
        }
        let shape = headers.shape(t);
        let out = self.out;
        let bytes = self.hold(&view.key)?;
        match stream_view(bytes, t.dtype().size(), view, shape, sink) {
            Some(written) => written.map_err(Error::io("writing", out)),
            None => Err(Error::Internal(format!(
                "a view of storage {} lies outside its {} bytes",
                view.key,
                bytes.len()
            ))),
        }
    }
}

/// Reads the object saved in a `torch.save` archive held in memory.
pub fn load_from_bytes(bytes: &[u8]) -> Result<PyObj> {
    load_from_bytes_with(bytes, &LoadOptions::default())
}

/// [`load_from_bytes`] of bytes that must hold one archive and nothing else: a zip archive
/// whose central directory and end records follow one another up to the last byte
/// ([`zip::ZipReader::check_fills`]), where PyTorch's reader would also take an archive with
/// bytes after it, or another archive's end records appended. What a DCP item's
/// decompressed bytes must be. A legacy (pickle-stream) archive is read as
/// [`load_from_bytes`] reads it.
pub(crate) fn load_one_archive(bytes: &[u8]) -> Result<PyObj> {
    load_one(zip::SliceSource(bytes))
}

/// [`load_one_archive`] of the archive `src` (in memory, in parts or whole).
fn load_one<S: Source + Copy>(mut src: S) -> Result<PyObj> {
    if !starts_legacy(MEMORY, &mut src)? {
        zip::ZipReader::new(MEMORY, src)?.check_fills()?;
    }
    let mode = unpickle::Mode::Full {
        max_expansion_bytes: LoadOptions::default().max_expansion_bytes,
    };
    Ok(read_archive(MEMORY, src, mode, Allow::TorchLoad)?.obj)
}

/// [`load_from_bytes`] with options.
pub fn load_from_bytes_with(bytes: &[u8], opts: &LoadOptions) -> Result<PyObj> {
    let mode = unpickle::Mode::Full {
        max_expansion_bytes: opts.max_expansion_bytes,
    };
    Ok(read_archive(MEMORY, zip::SliceSource(bytes), mode, Allow::TorchLoad)?.obj)
}

/// Writes `obj` to `path` as `torch.save(obj, path)` would, atomically.
///
/// The archive folder inside the zip is the file's stem (`model` for `model.pt`), as PyTorch
/// names it.
pub fn save(obj: &PyObj, path: impl AsRef<Path>) -> Result<()> {
    save_streaming(obj, path.as_ref(), &mut writer::Eager)
}

/// [`save`] of an object whose tensors `lazy` recognizes are placeholders, streamed by it
/// while the file is written (see [`writer::LazyTensors`]).
pub(crate) fn save_streaming(
    obj: &PyObj,
    path: &Path,
    lazy: &mut dyn writer::LazyTensors,
) -> Result<()> {
    let archive = archive_name(path);
    let name = path.display().to_string();
    write_atomic(path, |w| {
        let w = writer::write_with(obj, &archive, &name, w, lazy)?;
        lazy.finish()?;
        Ok(w)
    })
}

/// The length of the archive named `archive` that [`save`] writes for `obj`, whose tensors
/// `lazy` recognizes count at their real size: known before any byte is written.
pub(crate) fn archive_len(
    obj: &PyObj,
    archive: &str,
    lazy: &dyn writer::LazyTensors,
) -> Result<u64> {
    Ok(writer::PlannedArchive::new(obj, archive, MEMORY, lazy)?.file_len())
}

/// Writes `obj` as the archive named `archive` into `file` from byte `offset` on (the same
/// bytes [`archive_len`] counted), `lazy` streaming its placeholders; `writeback` hands the
/// pages to the disk and drops them from the page cache as they are written. `name` names the
/// file in messages. Returns the offset after the archive.
pub(crate) fn write_archive_at(
    obj: &PyObj,
    archive: &str,
    (file, offset): (&File, u64),
    writeback: &mut crate::storage::Writeback,
    name: &str,
    lazy: &mut dyn writer::LazyTensors,
) -> Result<u64> {
    let w = zip::Positioned::streaming_into(file, offset, writeback);
    Ok(writer::write_with(obj, archive, name, w, lazy)?.position())
}

/// The archive folder inside the zip PyTorch uses for `path`: the file's stem.
pub(crate) fn archive_name(path: &Path) -> String {
    path.file_stem()
        .and_then(|s| s.to_str())
        .filter(|s| !s.is_empty())
        .unwrap_or("archive")
        .to_string()
}

/// Streams process `rank`'s share (of `world_size`) of `plan`'s lazy storages into their
/// places in `file`, the temporary `tmp` of `out`; returns (storage index, CRC-32 of its
/// data) of each. The storages' bytes are cut into `world_size` equal spans
/// ([`crate::storage::writer_of`]).
pub(crate) fn write_lazy_share(
    plan: &writer::PlannedArchive<'_>,
    lazy: &mut dyn writer::LazyTensors,
    file: &std::fs::File,
    (out, tmp): (&Path, &Path),
    (rank, world_size): (usize, usize),
) -> Result<Vec<(usize, u32)>> {
    use std::os::unix::fs::FileExt;
    let lazy_storages: Vec<usize> = (0..plan.storages())
        .filter(|&i| plan.lazy(i).is_some())
        .collect();
    let Some(&first) = lazy_storages.first() else {
        return Ok(Vec::new());
    };
    let from = plan.span(first).0;
    let data = plan.file_len() - from;
    let mut writeback = crate::storage::Writeback::new(0);
    let mut crcs = Vec::new();
    for i in lazy_storages {
        let (start, len) = plan.span(i);
        if crate::storage::writer_of(start - from, data, world_size) != rank {
            continue;
        }
        let (mut at, end) = (start, start + len);
        let mut crc = crc32fast::Hasher::new();
        let placeholder = plan.lazy(i).expect("filtered to lazy storages");
        // The sink's own failure, reported against the temporary it writes (the stream's
        // error names its input or nothing).
        let mut failed: Option<std::io::Error> = None;
        let streamed = lazy.stream(placeholder, &mut |chunk| {
            let mut put = || -> std::io::Result<()> {
                if at + chunk.len() as u64 > end {
                    return Err(std::io::Error::other(format!(
                        "storage {i} streamed more than its {len} planned bytes"
                    )));
                }
                file.write_all_at(chunk, at)?;
                writeback.wrote_at(file, at, chunk.len() as u64)
            };
            put().map_err(|e| {
                let kind = e.kind();
                failed = Some(e);
                std::io::Error::from(kind)
            })?;
            crc.update(chunk);
            at += chunk.len() as u64;
            Ok(())
        });
        if let Some(e) = failed {
            return Err(crate::storage::tmp_io_err("writing", out, tmp)(e));
        }
        streamed?;
        if at != end {
            return Err(Error::Internal(format!(
                "storage {i} of {} streamed {} of its {len} planned bytes",
                out.display(),
                at - start
            )));
        }
        crcs.push((i, crc.finalize()));
    }
    lazy.finish()?;
    Ok(crcs)
}

/// Serializes `obj` as a `torch.save` archive in memory (archive folder `archive`).
pub fn save_to_bytes(obj: &PyObj) -> Result<Vec<u8>> {
    writer::write(obj, "archive", MEMORY, Vec::new())
}

/// Reads an optimizer state dict (`torch.save(optimizer.state_dict(), path)`); see
/// [`optim_from_pyobj`] for what is accepted.
pub fn load_optim_state_dict(path: impl AsRef<Path>) -> Result<OptimStateDict> {
    optim_from_pyobj(load(path)?)
}

/// Writes an optimizer state dict so that `torch.load(path, weights_only=True)` returns what
/// `optimizer.state_dict()` would; see [`optim_to_pyobj`].
pub fn save_optim_state_dict(osd: &OptimStateDict, path: impl AsRef<Path>) -> Result<()> {
    save(&optim_to_pyobj(osd)?, path)
}

/// Reads a model state dict (`torch.save(module.state_dict(), path)`); see
/// [`model_from_pyobj`].
pub fn load_model_state_dict(path: impl AsRef<Path>) -> Result<SavedModelStateDict> {
    model_from_pyobj(load(path)?)
}

/// Writes a model state dict as the `OrderedDict` `module.state_dict()` returns.
pub fn save_model_state_dict(msd: &SavedModelStateDict, path: impl AsRef<Path>) -> Result<()> {
    save(&model_to_pyobj(msd), path)
}

fn read_archive<S: Source>(
    file: &str,
    mut src: S,
    mode: unpickle::Mode,
    allow: Allow,
) -> Result<unpickle::Unpickled> {
    if starts_legacy(file, &mut src)? {
        return legacy::read(file, src, mode, allow);
    }
    let (zip, prefix) = open_archive(file, src)?;
    Ok(read_zip(file, zip, prefix, mode, allow)?.0)
}

/// Reads the records and the pickle of an opened zip archive; gives the archive back, for a
/// caller that then reads storages from it.
fn read_zip<S: Source>(
    file: &str,
    mut zip: ZipReader<S>,
    prefix: String,
    mode: unpickle::Mode,
    allow: Allow,
) -> Result<(unpickle::Unpickled, ZipReader<S>, String)> {
    // `torch.load` reads these records when present (`_load` in torch/serialization.py):
    // extracted as PyTorch would; `version >= b"1"` takes any `.format_version`, but
    // `int(...)` of `.storage_alignment` must parse.
    zip.extract_as_pytorch(".format_version")?;
    let name = format!("{prefix}.storage_alignment");
    match zip.extract_as_pytorch(".storage_alignment")? {
        None => {}
        Some(Extracted::Data(b)) if python_int(&b) => {}
        Some(got) => return Err(record_err(file, &name, &got, "is not an integer (`int()`)")),
    }
    if let Some(order) = zip.read_entry("byteorder")? {
        if order != b"little" {
            return Err(Error::UnsupportedByteOrder {
                file: file.to_string(),
                byteorder: String::from_utf8_lossy(&order).into_owned(),
            });
        }
    }
    let pkl_name = format!("{prefix}data.pkl");
    let pkl = zip
        .read_entry("data.pkl")?
        .ok_or_else(|| Error::MissingArchiveEntry {
            file: file.to_string(),
            entry: pkl_name.clone(),
        })?;
    let mut store = ArchiveStorages { zip, prefix, file };
    let u = unpickle::unpickle(file, &pkl, &mut store, mode, allow)?;
    Ok((u, store.zip, store.prefix))
}

/// Whether `src` holds a legacy (pickle stream) file rather than a zip archive.
fn starts_legacy<S: Source>(file: &str, src: &mut S) -> Result<bool> {
    let mut head = [0u8; 2];
    if src.len() < 2 {
        return Ok(false);
    }
    src.read_at(0, &mut head)
        .map_err(Error::io("reading", Path::new(file)))?;
    Ok(legacy::is_legacy(&head))
}

/// Opens the archive `src` as PyTorch's `PyTorchStreamReader` does and `torch.load` lists it:
/// the zip container (the checks miniz makes), the archive folder (named after the first
/// entry's), every entry inside that folder (`getAllRecords`: "file in archive is not in a
/// subdirectory"), the `.data/serialization_id` record when present and the `version` record
/// (`init`). Returns the reader and the folder with its `/`.
fn open_archive<S: Source>(file: &str, src: S) -> Result<(ZipReader<S>, String)> {
    let mut zip = ZipReader::new(file, src)?;
    let prefix = zip.enter_folder()?;
    // `torch.load` passes the serialization id to Python as a str.
    let name = format!("{prefix}.data/serialization_id");
    match zip.extract_as_pytorch(".data/serialization_id")? {
        None => {}
        Some(Extracted::Data(b)) if std::str::from_utf8(&b).is_ok() => {}
        Some(got) => return Err(record_err(file, &name, &got, "is not UTF-8")),
    }
    check_version(&mut zip, &prefix)?;
    Ok((zip, prefix))
}

/// The oldest and newest `version` PyTorch 2.13 reads (`kMinSupportedFileFormatVersion`,
/// `kMaxSupportedFileFormatVersion` in caffe2/serialize/versions.h).
const MIN_FILE_FORMAT_VERSION: u64 = 1;
const MAX_FILE_FORMAT_VERSION: u64 = 0xa;

/// The `version` record (`<archive>/.data/version`, else `<archive>/version`), which
/// `PyTorchStreamReader::init` requires, parses with `std::stoull` and bounds.
fn check_version<S: Source>(zip: &mut ZipReader<S>, prefix: &str) -> Result<()> {
    let record = if zip.entry(".data/version").is_some() {
        ".data/version"
    } else {
        "version"
    };
    let name = format!("{prefix}{record}");
    let file = zip.file().to_string();
    let refuse = |reason: String| Error::TorchSaveArchive {
        file: file.clone(),
        entry: Some(name.clone()),
        offset: 0,
        reason,
    };
    let bytes = match zip.extract_as_pytorch(record)? {
        None => return Err(Error::MissingArchiveEntry { file, entry: name }),
        Some(Extracted::Data(b)) => b,
        Some(got) => return Err(record_err(&file, &name, &got, "cannot be read")),
    };
    let text = String::from_utf8_lossy(&bytes);
    let version = stoull(&bytes).ok_or_else(|| {
        refuse(format!(
            "version record {text:?} is not a number (PyTorch: Couldn't parse the version)"
        ))
    })?;
    if !(MIN_FILE_FORMAT_VERSION..=MAX_FILE_FORMAT_VERSION).contains(&version) {
        return Err(refuse(format!(
            "file format version {version} (from {text:?}); PyTorch 2.13 reads versions \
             {MIN_FILE_FORMAT_VERSION} to {MAX_FILE_FORMAT_VERSION}"
        )));
    }
    Ok(())
}

/// The refusal of the record `name` PyTorch extracted as `got`, whose content `what`.
fn record_err(file: &str, name: &str, got: &Extracted, what: &str) -> Error {
    let reason = match got {
        Extracted::Unfilled => "marked as a directory (DOS directory attribute), so PyTorch's \
                                reader (miniz) extracts none of its data and PyTorch reads a \
                                buffer it never filled"
            .to_string(),
        Extracted::Data(b) => format!(
            "record {:?} {what}, which PyTorch refuses",
            String::from_utf8_lossy(b)
        ),
    };
    Error::TorchSaveArchive {
        file: file.to_string(),
        entry: Some(name.to_string()),
        offset: 0,
        reason,
    }
}

/// Whether Python's `int(b)` (base 10) parses `b`: ASCII white space around, an optional
/// sign, decimal digits with single underscores between them.
fn python_int(b: &[u8]) -> bool {
    let space = |c: &u8| matches!(c, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r');
    let from = b.iter().position(|c| !space(c)).unwrap_or(b.len());
    let to = b.iter().rposition(|c| !space(c)).map_or(from, |i| i + 1);
    let t = &b[from..to];
    let t = t.strip_prefix(b"-").or(t.strip_prefix(b"+")).unwrap_or(t);
    !t.is_empty()
        && t.split(|&c| c == b'_')
            .all(|g| !g.is_empty() && g.iter().all(u8::is_ascii_digit))
}

/// C++'s `std::stoull(s)` (base 10, through `strtoull`): leading white space, an optional sign,
/// at least one decimal digit, up to the first other byte; a `-` negates modulo 2^64. `None`
/// where it throws (no digits: `invalid_argument`; more than 64 bits: `out_of_range`).
fn stoull(s: &[u8]) -> Option<u64> {
    let mut i = s
        .iter()
        .position(|&b| !matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
        .unwrap_or(s.len());
    let negative = match s.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let digits = s[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let mut v: u64 = 0;
    for &d in &s[i..i + digits] {
        v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    Some(if negative { v.wrapping_neg() } else { v })
}

/// The entry `<prefix>data/<key>` of `zip`: storage `key`'s data.
fn storage_entry<S: Source>(zip: &ZipReader<S>, prefix: &str, key: &str) -> Result<zip::Entry> {
    let name = format!("{prefix}data/{key}");
    zip.entry(&format!("data/{key}"))
        .cloned()
        .ok_or_else(|| Error::MissingArchiveEntry {
            file: zip.file().to_string(),
            entry: name,
        })
}

/// The `data/<key>` entries of an archive, as the pickle VM's storages.
struct ArchiveStorages<'f, S: Source> {
    zip: ZipReader<S>,
    prefix: String,
    file: &'f str,
}

impl<S: Source> ArchiveStorages<'_, S> {
    fn storage_err(&self, key: &str, reason: String) -> Error {
        Error::TensorStorage {
            file: self.file.to_string(),
            storage: key.to_string(),
            reason,
        }
    }
}

impl<S: Source> unpickle::Storages for ArchiveStorages<'_, S> {
    fn check(&mut self, key: &str, dtype: DType, numel: usize) -> Result<()> {
        let entry = storage_entry(&self.zip, &self.prefix, key)?;
        let (name, size) = (entry.name.clone(), entry.size);
        let nbytes = numel.checked_mul(dtype.size()).ok_or_else(|| {
            self.storage_err(key, format!("{numel} elements of {dtype} overflow"))
        })?;
        if size != nbytes as u64 {
            return Err(self.storage_err(key, format!(
                "declared as {numel} elements of {dtype} ({nbytes} bytes) but entry `{name}` holds {size} bytes"
            )));
        }
        if size > self.zip.source_len() {
            return Err(self.storage_err(key, format!("entry `{name}` is larger than the file")));
        }
        // What PyTorch checks when it extracts the storage (its data is not read here).
        self.zip.data_start(&entry)?;
        Ok(())
    }

    fn read(&mut self, key: &str, dtype: DType, numel: usize) -> Result<HostTensor> {
        let entry = storage_entry(&self.zip, &self.prefix, key)?;
        HostTensor::filled_by(dtype, &[numel], |buf| self.zip.read_entry_into(&entry, buf))
    }
}

/// Writes a file through `write` into a temporary file beside `path`, syncs it, and renames it
/// to `path`; the temporary file is removed on failure.
pub(crate) fn write_atomic(
    path: &Path,
    write: impl FnOnce(BufWriter<StreamedFile>) -> Result<BufWriter<StreamedFile>>,
) -> Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let target = path.display().to_string();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::Io {
            op: "writing".into(),
            path: target.clone(),
            source: crate::error::IoError::new(
                std::io::ErrorKind::InvalidInput,
                "the path has no file name",
            ),
        })?
        .to_string_lossy()
        .into_owned();
    crate::storage::check_file_output(path)?;
    let tmp = dir.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(Error::io("creating", &tmp))?;
    let result = (|| {
        let w = write(BufWriter::with_capacity(1 << 20, StreamedFile::new(file)))?;
        let file = w
            .into_inner()
            .map_err(|e| Error::io("writing", &tmp)(e.into_error()))?
            .into_file();
        file.sync_all().map_err(Error::io("syncing", &tmp))?;
        drop(file);
        crate::storage::check_file_output(path)?;
        std::fs::rename(&tmp, path).map_err(Error::io("renaming into place", path))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    // Make the rename itself durable (directories cannot be opened for syncing everywhere).
    #[cfg(unix)]
    if let Ok(d) = File::open(&dir) {
        d.sync_all().map_err(Error::io("syncing directory", &dir))?;
    }
    Ok(())
}
