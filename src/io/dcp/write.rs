//! Writing a state dict as a DCP directory, as
//! `torch.distributed.checkpoint.format_utils.torch_save_to_dcp` does: the dict flattened by
//! DCP's traversal, every tensor and non-tensor value `torch.save`d into `__0_0.distcp`,
//! and `.metadata` pickled last so that `dcp.load` and `dcp_to_torch_save` read it.

use super::metadata::PathItem;
use super::pickler::{Record, StoredChunk};
use crate::error::{Error, IoError, Result};
use crate::io::torch_save::{self, writer::LazyTensors, PyObj};
use crate::tensor::DType;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// The one data file a single-process save writes.
const DATA_FILE: &str = "__0_0.distcp";

/// How the DCP writer stores each item in the data file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Compression {
    /// Each item a plain `torch.save` archive, as `FileSystemWriter()` writes it.
    #[default]
    None,
    /// Each item one zstd frame of its archive (level 3, with a checksum), recorded as
    /// `transform_descriptors=["stream.zstd/1"]`: what
    /// `FileSystemWriter(_extensions=[ZStandard()])` writes, and `dcp.load` reads back.
    Zstd,
}

/// Options of the DCP writer ([`save_dcp_with`], `convert::torch_save_to_dcp_with`,
/// `convert::checkpoint_to_dcp_with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DcpWriteOptions {
    /// How each item is stored. With [`Compression::Zstd`] the items' lengths are known only
    /// once they are compressed, so one process writes the whole data file in order (a job
    /// of several processes leaves it to process 0).
    pub compression: Compression,
}

impl DcpWriteOptions {
    /// Sets [`DcpWriteOptions::compression`] (the struct is `#[non_exhaustive]`).
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }
}

/// One flattened value: where it is (its container, an index of [`Flat::parents`], and its
/// own key or index there) and the value. Its path and dotted key are made when needed
/// ([`Flat::path`], [`Flat::key`]), so that a state dict of a million tensors holds one
/// copy of their containers' path, not a million.
struct Item<'a> {
    parent: usize,
    last: Last<'a>,
    value: &'a PyObj,
}

/// An item's own key or index in its container: a `str` key borrowed from the state dict
/// (not copied: a model's keys are most of its state dict's memory), or any other.
enum Last<'a> {
    Str(&'a str),
    Other(PathItem),
}

impl Last<'_> {
    fn item(&self) -> PathItem {
        match self {
            Last::Str(s) => PathItem::Key(s.to_string()),
            Last::Other(p) => p.clone(),
        }
    }
}

/// DCP's flattened state dict: every leaf in traversal order, and the path of each
/// container holding one (the root's is empty).
struct Flat<'a> {
    items: Vec<Item<'a>>,
    parents: Vec<Vec<PathItem>>,
}

impl<'a> Flat<'a> {
    /// `item`'s path in the nested dict.
    fn path(&self, item: &Item<'_>) -> Vec<PathItem> {
        let mut path = Vec::with_capacity(self.parents[item.parent].len() + 1);
        path.extend_from_slice(&self.parents[item.parent]);
        path.push(item.last.item());
        path
    }

    /// `item`'s dotted key, as DCP's `flatten_state_dict` joins its path.
    fn key(&self, item: &Item<'_>) -> String {
        super::plan::joined(&self.path(item))
    }

    /// The container at `parent`'s path extended by `last`, added; its index.
    fn push_parent(&mut self, parent: usize, last: PathItem) -> usize {
        let mut path = self.parents[parent].clone();
        path.push(last);
        self.parents.push(path);
        self.parents.len() - 1
    }

    /// Refuses two values with one dotted key (`{0: x, '0': y}`, or `{'a.b': x, 'a': {'b':
    /// y}}`), naming the first key repeated in traversal order. The keys are compared by
    /// hash first, so that no set of every key is held.
    fn check_distinct(&self) -> Result<()> {
        use std::hash::{Hash, Hasher};
        let hash = |i: usize| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            self.key(&self.items[i]).hash(&mut h);
            h.finish()
        };
        let mut hashes: Vec<(u64, usize)> = (0..self.items.len()).map(|i| (hash(i), i)).collect();
        hashes.sort_unstable();
        let mut repeated: Option<usize> = None;
        for group in hashes.chunk_by(|a, b| a.0 == b.0).filter(|g| g.len() > 1) {
            let keys: Vec<String> = group
                .iter()
                .map(|&(_, i)| self.key(&self.items[i]))
                .collect();
            for (n, k) in keys.iter().enumerate().skip(1) {
                if keys[..n].contains(k) {
                    repeated = Some(repeated.map_or(group[n].1, |r| r.min(group[n].1)));
                }
            }
        }
        match repeated {
            None => Ok(()),
            Some(i) => Err(Error::UnexpectedObject {
                path: self.key(&self.items[i]),
                expected: "distinct flattened keys".into(),
                found: "a duplicated flatten key (e.g. both 0 and '0')".into(),
            }),
        }
    }
}

/// Python's `str(k)` of a dict key, for the key types a state dict uses.
fn key_str(k: &PyObj, at: &str) -> Result<String> {
    Ok(match k {
        PyObj::Str(s) => s.clone(),
        PyObj::Int(i) => i.to_string(),
        PyObj::Bool(b) => if *b { "True" } else { "False" }.into(),
        PyObj::None => "None".into(),
        other => {
            return Err(Error::UnexpectedObject {
                path: at.to_string(),
                expected: "dict keys that are str, int, bool or None".into(),
                found: other.describe(),
            })
        }
    })
}

/// The dict key `k` as an item's [`Last`] (`at`, its container's key, for messages).
fn last<'a>(k: &'a PyObj, at: &str) -> Result<Last<'a>> {
    Ok(match k {
        PyObj::Str(s) => Last::Str(s),
        _ => Last::Other(PathItem::Key(key_str(k, at)?)),
    })
}

/// DCP's `_is_terminal`: a mapping never is; a list is unless it holds a tensor or a
/// non-terminal container; anything else is.
fn is_terminal(v: &PyObj) -> bool {
    match v {
        PyObj::Dict(_) | PyObj::OrderedDict { .. } => false,
        PyObj::List(items) => items.iter().all(|e| match e {
            PyObj::Tensor(_) => false,
            PyObj::Dict(_) | PyObj::OrderedDict { .. } | PyObj::List(_) => is_terminal(e),
            _ => true,
        }),
        _ => true,
    }
}

/// DCP's `flatten_state_dict`: every leaf with its container and key, in traversal order.
fn flatten(obj: &PyObj) -> Result<Flat<'_>> {
    let Some(items) = obj.dict_items() else {
        return Err(Error::UnexpectedObject {
            path: "<root>".into(),
            expected: "a dict (a state dict)".into(),
            found: obj.describe(),
        });
    };
    let mut flat = Flat {
        items: Vec::new(),
        parents: vec![Vec::new()],
    };
    for (k, v) in items {
        visit(v, (0, last(k, "<root>")?), &mut flat, 0)?;
    }
    flat.check_distinct()?;
    Ok(flat)
}

/// Visits `v`, found at `last` in the container `parent` of `flat`.
fn visit<'a>(
    v: &'a PyObj,
    (parent, last): (usize, Last<'a>),
    flat: &mut Flat<'a>,
    depth: usize,
) -> Result<()> {
    if depth > 200 {
        let mut path = flat.parents[parent].clone();
        path.push(last.item());
        return Err(Error::UnexpectedObject {
            path: super::plan::joined(&path),
            expected: "containers nested at most 200 deep".into(),
            found: "deeper nesting".into(),
        });
    }
    if let Some(items) = v.dict_items() {
        let me = flat.push_parent(parent, last.item());
        let key = super::plan::joined(&flat.parents[me]);
        for (k, x) in items {
            visit(x, (me, self::last(k, &key)?), flat, depth + 1)?;
        }
    } else if is_terminal(v) {
        flat.items.push(Item {
            parent,
            last,
            value: v,
        });
    } else if let PyObj::List(items) = v {
        let me = flat.push_parent(parent, last.item());
        for (i, x) in items.iter().enumerate() {
            visit(x, (me, Last::Other(PathItem::Index(i))), flat, depth + 1)?;
        }
    }
    Ok(())
}

/// The largest archive [`DataPlan::write`] makes in memory before writing it.
const BATCHED_ARCHIVE: u64 = 1 << 20;

/// How many bytes of small archives [`DataPlan::write`] gathers before one write (its
/// buffer holds this and one more archive, so it never grows).
const BATCH: usize = 4 << 20;

/// Small archives gathered in memory, in file order, for one positioned write of
/// `bytes` at `start` (with write-back and drop-behind, as the streamed archives get).
struct Batch<'f> {
    file: &'f File,
    path: &'f Path,
    start: u64,
    bytes: Vec<u8>,
    writeback: crate::storage::Writeback,
}

impl Batch<'_> {
    /// Makes the next bytes gathered land at `offset`: a range that does not follow the
    /// gathered ones writes them first.
    fn place(&mut self, offset: u64) -> Result<()> {
        if self.start + self.bytes.len() as u64 != offset {
            self.flush()?;
            self.start = offset;
        }
        Ok(())
    }

    /// Writes the gathered bytes.
    fn flush(&mut self) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if self.bytes.is_empty() {
            return Ok(());
        }
        let len = self.bytes.len() as u64;
        self.file
            .write_all_at(&self.bytes, self.start)
            .and_then(|()| self.writeback.wrote_at(self.file, self.start, len))
            .map_err(|e| io_err("writing", self.path, e))?;
        self.start += len;
        self.bytes.clear();
        Ok(())
    }
}

/// Where one item lands in the data file.
#[derive(Clone, Copy, Default)]
struct Place {
    offset: u64,
    length: u64,
}

/// The data file of a DCP directory, planned before any byte is written: every flattened
/// value's archive and its byte range. Non-tensor values come first, then tensors, each in
/// traversal order (as PyTorch's writer orders them); the items and their places keep
/// traversal order, which `.metadata` lists. Per item it holds its place and an index; the
/// values stay in the state dict (a million small tensors plan in a few tens of megabytes).
struct DataPlan<'a> {
    /// The items, and the containers' paths they refer to ([`Flat::parents`]).
    flat: Flat<'a>,
    /// Where each item lands, by index of `flat.items`.
    places: Vec<Place>,
    /// The real shape of each tensor `lazy` stands for another shape (a placeholder's), by
    /// item index; every other tensor's shape is its own.
    lazy_shapes: std::collections::HashMap<usize, Vec<usize>>,
    /// Indices of the items in file order.
    file_order: Vec<usize>,
    /// The archives of the non-tensor values (small), by item index.
    objects: std::collections::HashMap<usize, Vec<u8>>,
    len: u64,
    tensor_bytes: u64,
    /// Whether the ranges are zstd frames ([`DataPlan::write_compressed`]).
    zstd: bool,
}

/// A writer that counts the bytes written through it.
struct Counted<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<'a> DataPlan<'a> {
    fn new(mut flat: Flat<'a>, lazy: &dyn LazyTensors) -> Result<Self> {
        // Items are numbered in 32 bits where many are listed ([`DataPlan::share`]).
        if u32::try_from(flat.items.len()).is_err() {
            return Err(Error::UnexpectedObject {
                path: "<root>".into(),
                expected: "at most 2^32 - 1 values".into(),
                found: format!("{} values", flat.items.len()),
            });
        }
        flat.items.shrink_to_fit();
        let mut lazy_shapes = std::collections::HashMap::new();
        for (i, item) in flat.items.iter().enumerate() {
            if let PyObj::Tensor(t) = item.value {
                if let Some(shape) = lazy.shape_of(t) {
                    lazy_shapes.insert(i, shape);
                }
            }
        }
        let is_tensor = |i: usize| matches!(flat.items[i].value, PyObj::Tensor(_));
        let (mut objects_first, tensors): (Vec<usize>, Vec<usize>) =
            (0..flat.items.len()).partition(|&i| !is_tensor(i));
        objects_first.extend(tensors);
        let mut plan = DataPlan {
            places: vec![Place::default(); flat.items.len()],
            flat,
            lazy_shapes,
            file_order: Vec::new(),
            objects: std::collections::HashMap::new(),
            len: 0,
            tensor_bytes: 0,
            zstd: false,
        };
        let mut at = 0u64;
        for &i in &objects_first {
            let value = plan.flat.items[i].value;
            let length = match plan.tensor(i) {
                Some((dtype, shape)) => {
                    plan.tensor_bytes += (shape.iter().product::<usize>() * dtype.size()) as u64;
                    torch_save::archive_len(value, ARCHIVE, lazy)?
                }
                None => {
                    let bytes = torch_save::save_to_bytes(value)?;
                    let len = bytes.len() as u64;
                    plan.objects.insert(i, bytes);
                    len
                }
            };
            plan.places[i] = Place { offset: at, length };
            at += length;
        }
        plan.file_order = objects_first;
        plan.len = at;
        Ok(plan)
    }

    /// Item `i`'s dtype and real shape, when it is a tensor.
    fn tensor(&self, i: usize) -> Option<(DType, &[usize])> {
        let PyObj::Tensor(t) = self.flat.items[i].value else {
            return None;
        };
        let shape = self.lazy_shapes.get(&i).map_or(t.shape(), Vec::as_slice);
        Some((t.dtype(), shape))
    }

    /// Writes the archives of items `i` for every `i` of `which` into the data file `file`
    /// (`path`, for messages), each at its planned range. Archives of at most
    /// [`BATCHED_ARCHIVE`] bytes are made in memory and written [`BATCH`] bytes at a time (a
    /// `torch.save` archive is about thirty small pieces: a million small tensors would be
    /// thirty million system calls); larger ones stream to the file.
    fn write(
        &self,
        file: &File,
        path: &Path,
        which: impl Iterator<Item = usize>,
        lazy: &mut dyn LazyTensors,
    ) -> Result<()> {
        let name = path.display().to_string();
        let mut batch = Batch {
            file,
            path,
            start: 0,
            bytes: Vec::with_capacity(BATCH + BATCHED_ARCHIVE as usize),
            writeback: crate::storage::Writeback::new(0),
        };
        for i in which {
            let (s, item) = (self.places[i], &self.flat.items[i]);
            let end = if s.length <= BATCHED_ARCHIVE {
                batch.place(s.offset)?;
                let before = batch.bytes.len() as u64;
                match self.objects.get(&i) {
                    Some(bytes) => batch.bytes.extend_from_slice(bytes),
                    None => {
                        torch_save::writer::write_with(
                            item.value,
                            ARCHIVE,
                            &name,
                            &mut batch.bytes,
                            lazy,
                        )?;
                    }
                }
                s.offset + batch.bytes.len() as u64 - before
            } else {
                batch.flush()?;
                torch_save::write_archive_at(
                    item.value,
                    ARCHIVE,
                    (file, s.offset),
                    &mut batch.writeback,
                    &name,
                    lazy,
                )?
            };
            if end != s.offset + s.length {
                return Err(Error::Internal(format!(
                    "`{}` took {} bytes of {name}, {} were planned",
                    self.flat.key(item),
                    end - s.offset,
                    s.length
                )));
            }
            if batch.bytes.len() >= BATCH {
                batch.flush()?;
            }
        }
        batch.flush()
    }

    /// Writes every archive into `tmp`'s data file one after another, each compressed as one
    /// zstd frame, and records where each landed (replacing the planned plain ranges); the
    /// file is synced. The tensors `lazy` streams go through the compressor as they come.
    fn write_compressed(&mut self, tmp: &Path, lazy: &mut dyn LazyTensors) -> Result<()> {
        let path = tmp.join(DATA_FILE);
        let name = path.display().to_string();
        // Staged at the plain length: the frames start at 0 and end where they end.
        let file = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| io_err("opening", &path, e))?;
        let io = |e: std::io::Error| io_err("writing", &path, e);
        let mut out = Counted {
            inner: std::io::BufWriter::with_capacity(
                1 << 20,
                crate::storage::StreamedFile::new(file),
            ),
            n: 0,
        };
        for &i in &self.file_order {
            let start = out.n;
            let mut z =
                zstd::stream::write::Encoder::new(&mut out, zstd::DEFAULT_COMPRESSION_LEVEL)
                    .map_err(io)?;
            z.include_checksum(true).map_err(io)?;
            let mut plain = Counted { inner: z, n: 0 };
            let item = &self.flat.items[i];
            plain = match self.objects.get(&i) {
                Some(bytes) => {
                    plain.write_all(bytes).map_err(io)?;
                    plain
                }
                None => torch_save::writer::write_with(item.value, ARCHIVE, &name, plain, lazy)?,
            };
            if plain.n != self.places[i].length {
                return Err(Error::Internal(format!(
                    "`{}` took {} bytes before compression, {} were planned",
                    self.flat.key(item),
                    plain.n,
                    self.places[i].length
                )));
            }
            plain.inner.finish().map_err(io)?;
            self.places[i] = Place {
                offset: start,
                length: out.n - start,
            };
        }
        lazy.finish()?;
        self.len = out.n;
        self.zstd = true;
        let file = out
            .inner
            .into_inner()
            .map_err(|e| io(e.into_error()))?
            .into_file();
        file.sync_all().map_err(|e| io_err("syncing", &path, e))
    }

    /// The values process `rank` of `world_size` writes, in the order to write them: on
    /// process 0 the non-tensor values, then the tensors of its equal share of the tensor
    /// bytes. The tensors are cut into groups, each written by one process, in order of their
    /// first tensor: the tensors `lazy` cuts from one read of its input
    /// ([`LazyTensors::read_group`]) form one group, written one after another (so that the
    /// input is read once), and every other tensor a group of its own. A group belongs to the
    /// process whose share holds its start when the groups are laid end to end (for groups
    /// of one tensor, where its archive starts in the file).
    fn share(&self, rank: usize, world_size: usize, lazy: &dyn LazyTensors) -> Vec<u32> {
        let first = self
            .file_order
            .iter()
            .find(|&&i| self.tensor(i).is_some())
            .map_or(self.len, |&i| self.places[i].offset);
        // Each tensor's group, numbered in order of its first tensor: (group, index).
        let mut by_read: std::collections::HashMap<usize, u32> = Default::default();
        let mut groups = 0u32;
        let mut grouped: Vec<(u32, u32)> = Vec::new();
        let mut mine = Vec::new();
        for &i in &self.file_order {
            let read = match self.flat.items[i].value {
                PyObj::Tensor(t) => lazy.read_group(t),
                _ if rank == 0 => {
                    mine.push(i as u32);
                    continue;
                }
                _ => continue,
            };
            let group = match read {
                Some(g) => *by_read.entry(g).or_insert_with(|| {
                    groups += 1;
                    groups - 1
                }),
                None => {
                    groups += 1;
                    groups - 1
                }
            };
            grouped.push((group, i as u32));
        }
        drop(by_read);
        // Stable: a group's tensors keep their order.
        grouped.sort_by_key(|&(g, _)| g);
        let mut at = 0;
        for group in grouped.chunk_by(|a, b| a.0 == b.0) {
            let len: u64 = group
                .iter()
                .map(|&(_, i)| self.places[i as usize].length)
                .sum();
            if crate::storage::writer_of(at, self.len - first, world_size) == rank {
                mine.extend(group.iter().map(|&(_, i)| i));
            }
            at += len;
        }
        mine
    }

    /// Creates the data file in the temporary directory `tmp` at its planned length.
    fn create(&self, tmp: &Path) -> Result<File> {
        let path = tmp.join(DATA_FILE);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err("creating", &path, e))?;
        file.set_len(self.len)
            .map_err(|e| io_err("sizing", &path, e))?;
        Ok(file)
    }

    /// With every archive in `tmp`'s data file written and synced: writes `.metadata` (the
    /// checkpoint id `name`), syncs and renames `tmp` to `out`.
    fn commit(&self, tmp: &Path, out: &Path, name: &str) -> Result<()> {
        write_metadata(&tmp.join(".metadata"), self, name)?;
        sync_dir(tmp)?;
        std::fs::rename(tmp, out).map_err(|e| io_err("renaming into place", out, e))?;
        sync_dir(
            out.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new(".")),
        )
    }
}

/// The folder name of each value's `torch.save` archive (what `torch.save` to a buffer uses).
const ARCHIVE: &str = "archive";

/// Writes the DCP directory for `obj` (a state dict) at `out`, which must be missing or an
/// empty directory: into a temporary sibling, data file first and `.metadata` last, each
/// synced, then renamed into place. `storage_meta.checkpoint_id` is `out`'s last component.
/// Returns the bytes of tensor data written.
pub fn save_dcp(obj: &PyObj, out: &Path) -> Result<u64> {
    save_dcp_with(obj, out, &DcpWriteOptions::default())
}

/// [`save_dcp`] with options: [`Compression::Zstd`] stores every item as a zstd frame, as
/// `FileSystemWriter(_extensions=[ZStandard()])` does.
pub fn save_dcp_with(obj: &PyObj, out: &Path, opts: &DcpWriteOptions) -> Result<u64> {
    match opts.compression {
        Compression::None => save_dcp_streaming(obj, out, &mut torch_save::writer::Eager),
        Compression::Zstd => save_dcp_compressed(obj, out, &mut torch_save::writer::Eager),
    }
}

/// [`save_dcp_streaming`] with every item compressed ([`Compression::Zstd`]): the items are
/// planned as for a plain directory (their archives' lengths check the bytes compressed),
/// written one after another through the compressor, and `.metadata` records where each
/// frame landed. One process writes it all.
pub(crate) fn save_dcp_compressed(
    obj: &PyObj,
    out: &Path,
    lazy: &mut dyn LazyTensors,
) -> Result<u64> {
    let obj = obj.values_only("a DCP checkpoint")?;
    let mut plan = PlannedDcp::new(&obj, out, lazy)?;
    let tmp = plan.stage(out)?;
    let result = plan
        .plan
        .write_compressed(&tmp, lazy)
        .and_then(|()| plan.commit(&tmp, out));
    if result.is_err() {
        crate::storage::discard_tmp_dir(&tmp);
    }
    result.map(|()| plan.tensor_bytes())
}

/// [`save_dcp`] of an object whose tensors `lazy` recognizes are placeholders, streamed by it
/// into the data file (see [`LazyTensors`]): memory stays at what `lazy` holds, whatever the
/// tensors' size, and the data file's pages leave the page cache as they are written. The
/// steps of a [`PlannedDcp`], run by this one process.
fn save_dcp_streaming(obj: &PyObj, out: &Path, lazy: &mut dyn LazyTensors) -> Result<u64> {
    let obj = obj.values_only("a DCP checkpoint")?;
    let plan = PlannedDcp::new(&obj, out, lazy)?;
    let tmp = plan.stage(out)?;
    let result = plan
        .write_share(&tmp, (0, 1), lazy)
        .and_then(|()| plan.commit(&tmp, out));
    if result.is_err() {
        crate::storage::discard_tmp_dir(&tmp);
    }
    result.map(|()| plan.tensor_bytes())
}

/// A DCP directory planned before any byte is written, in steps that several processes can
/// share: one stages the temporary directory with the data file at its planned length, each
/// writes its share of the archives, and one commits `.metadata` and renames the directory
/// into place. The data file is the same whoever writes which share.
pub(crate) struct PlannedDcp<'a> {
    plan: DataPlan<'a>,
    /// The checkpoint id `.metadata` records: the output's last component.
    name: String,
}

impl<'a> PlannedDcp<'a> {
    /// Plans `obj` (a state dict) as the DCP directory `out`, its tensors that `lazy`
    /// recognizes at their real size.
    pub(crate) fn new(obj: &'a PyObj, out: &Path, lazy: &dyn LazyTensors) -> Result<Self> {
        let flat = flatten(obj)?;
        let name = dir_name(out)?;
        let plan = DataPlan::new(flat, lazy)?;
        Ok(PlannedDcp { plan, name })
    }

    /// The bytes of tensor data the directory holds.
    pub(crate) fn tensor_bytes(&self) -> u64 {
        self.plan.tensor_bytes
    }

    /// Refuses an `out` that is not missing or an empty directory, then creates the temporary
    /// sibling (named as every writer of the crate names one, so that
    /// `output::clean_stale_temporaries` recognises it if this process is killed) holding the
    /// data file at its planned length. Returns the temporary's path.
    pub(crate) fn stage(&self, out: &Path) -> Result<std::path::PathBuf> {
        check_target(out)?;
        let tmp = crate::storage::make_tmp_dir(out)?;
        if let Err(e) = self.plan.create(&tmp) {
            crate::storage::discard_tmp_dir(&tmp);
            return Err(e);
        }
        Ok(tmp)
    }

    /// Writes process `rank`'s share (of `world_size`) of the archives into the staged data
    /// file in `tmp`, and syncs it.
    pub(crate) fn write_share(
        &self,
        tmp: &Path,
        (rank, world_size): (usize, usize),
        lazy: &mut dyn LazyTensors,
    ) -> Result<()> {
        let path = tmp.join(DATA_FILE);
        let file = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| io_err("opening", &path, e))?;
        let share = self.plan.share(rank, world_size, lazy);
        let share = share.into_iter().map(|i| i as usize);
        self.plan.write(&file, &path, share, lazy)?;
        lazy.finish()?;
        file.sync_all().map_err(|e| io_err("syncing", &path, e))
    }

    /// With every share written: writes `.metadata`, syncs and renames `tmp` to `out`.
    pub(crate) fn commit(&self, tmp: &Path, out: &Path) -> Result<()> {
        self.plan.commit(tmp, out, &self.name)
    }
}

/// `out`'s last component: the checkpoint id `.metadata` records.
fn dir_name(out: &Path) -> Result<String> {
    out.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| {
            io_err(
                "writing",
                out,
                refusal(
                    std::io::ErrorKind::InvalidInput,
                    "the path has no directory name",
                ),
            )
        })
}

/// Writes `.metadata` at `path` for the stored items (the checkpoint id `name`), streamed
/// through a buffer as it is pickled, and syncs it. Each item's record is made as the
/// pickler reaches it: its value whole, as one chunk at the origin.
fn write_metadata(path: &Path, plan: &DataPlan<'_>, name: &str) -> Result<()> {
    let zstd = plan.zstd;
    let ndim = (0..plan.places.len())
        .filter_map(|i| plan.tensor(i).map(|(_, shape)| shape.len()))
        .max()
        .unwrap_or(0);
    let origin = vec![0usize; ndim];
    let each = |f: &mut dyn FnMut(&Record<'_>)| {
        for (i, s) in plan.places.iter().enumerate() {
            let tensor = plan.tensor(i);
            let dims = tensor.map_or(&[][..], |(_, shape)| shape);
            let path = plan.flat.path(&plan.flat.items[i]);
            f(&Record {
                key: &super::plan::joined(&path),
                path: &path,
                tensor,
                chunks: vec![StoredChunk {
                    offsets: &origin[..dims.len()],
                    sizes: dims,
                    file: DATA_FILE,
                    offset: s.offset,
                    length: s.length,
                    zstd,
                }],
            })
        }
    };
    let file = File::create(path).map_err(|e| io_err("creating", path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    super::pickler::write_metadata(&mut w, &each, name).map_err(|e| io_err("writing", path, e))?;
    let file = w
        .into_inner()
        .map_err(|e| io_err("writing", path, e.into_error()))?;
    file.sync_all().map_err(|e| io_err("syncing", path, e))
}

/// Refuses an existing output that is not an empty directory: the replace rule of every
/// writer ([`crate::storage::check_dir_output`]), so that each refusal reads the same.
fn check_target(out: &Path) -> Result<()> {
    crate::storage::check_dir_output(out, crate::storage::EMPTY_DIR, &[])
}

fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("syncing directory", dir, e))?;
    Ok(())
}

fn io_err(op: &str, path: &Path, source: impl Into<IoError>) -> Error {
    Error::Io {
        op: op.into(),
        path: path.display().to_string(),
        source: source.into(),
    }
}

/// A refusal found before any system call, as an I/O error of `kind`.
fn refusal(kind: std::io::ErrorKind, message: &str) -> IoError {
    IoError::new(kind, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(k: &str) -> PyObj {
        PyObj::Str(k.into())
    }

    #[test]
    fn a_key_flattened_twice_is_refused_by_name_and_distinct_keys_pass() {
        // `{'a.b': 1, 'a': {'b': 2}}`: both flatten to `a.b`, as DCP refuses.
        let twice = PyObj::Dict(vec![
            (s("x"), PyObj::Int(0)),
            (s("a.b"), PyObj::Int(1)),
            (s("a"), PyObj::Dict(vec![(s("b"), PyObj::Int(2))])),
        ]);
        match flatten(&twice) {
            Err(Error::UnexpectedObject { path, .. }) => assert_eq!(path, "a.b"),
            other => panic!("{:?}", other.map(|f| f.items.len())),
        }
        let distinct = PyObj::Dict(vec![
            (s("0"), PyObj::Int(0)),
            (s("1"), PyObj::Dict(vec![(PyObj::Int(0), PyObj::Int(1))])),
        ]);
        let flat = flatten(&distinct).unwrap();
        let keys: Vec<String> = flat.items.iter().map(|i| flat.key(i)).collect();
        assert_eq!(keys, ["0", "1.0"]);
    }
}
