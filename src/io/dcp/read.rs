//! Reading a DCP directory: confined data-file access, chunk parsing, tensor assembly, and
//! the consolidation, verification and summary built on them.

use super::files::{confine, metadata_file_in};
use super::metadata::{Chunk, Entry, EntryKind, Metadata, StorageInfo, StorageKey, TensorMeta};
use super::plan::{check_tiling, holds_elements, nest, place_chunk, volume};
use super::Source;
use crate::error::{Error, Result};
use crate::io::torch_save::{self, writer::LazyTensors, LoneTensor, PyObj};
use crate::tensor::{DType, HostTensor};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

mod zstd_chunk;
#[cfg(feature = "fault-injection")]
pub use zstd_chunk::{zstd_chunk_reads, ZstdChunkReads};

/// An opened DCP directory: its metadata, with every data file resolved inside it.
#[derive(Debug)]
pub struct DcpCheckpoint {
    dir: PathBuf,
    metadata: Metadata,
    /// Each key's entry index (the first, should a key repeat).
    by_key: HashMap<String, usize>,
    /// Where the metadata came from (and so how chunks are stored).
    source: Source,
    /// `relative_path` → (the file, its length), or why it is unusable.
    files: HashMap<String, std::result::Result<(PathBuf, u64), String>>,
    /// With drop-behind (offline streams that read each chunk once), what has been read of
    /// each data file.
    drop_behind: Option<Mutex<crate::storage::DropBehind<PathBuf>>>,
    /// The data files open for chunk reads, least recently used first ([`OPEN_FILES`] at
    /// most).
    open_files: Mutex<Vec<(PathBuf, Arc<File>)>>,
}

/// Each key's entry index (the first, should a key repeat).
fn index_by_key(entries: &[Entry]) -> HashMap<String, usize> {
    let mut by_key = HashMap::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        by_key.entry(e.key.clone()).or_insert(i);
    }
    by_key
}

/// How many data files a [`DcpCheckpoint`] keeps open for chunk reads. Reading every chunk of
/// a file through one open file lets the kernel's read-ahead follow the file (a file opened
/// per chunk starts each chunk's read-ahead afresh, in small pages: a third more system CPU
/// at 2B parameters, BENCHMARKS.md); the bound keeps a directory of thousands of rank files
/// within the descriptor limit.
const OPEN_FILES: usize = 64;

impl DcpCheckpoint {
    /// Reads the directory's metadata and resolves every data file it names. A file that
    /// escapes the directory or is missing is reported when a key stored in it is read.
    ///
    /// The metadata comes from whichever source the directory has ([`Source`], in this
    /// order): `.metadata`; the per-rank `__{rank}.metadata` files of a save without
    /// collectives, merged into one global view and checked to agree
    /// (`per_rank.rs`); or the safetensors headers of Hugging Face storage
    /// (`DCP_SHARDING_INFO`, `hf_storage.rs`). Everything above (tensors, the nested
    /// dict, consolidation, verification, resharding) reads the one [`Metadata`] alike.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let root = dir.canonicalize().map_err(Error::io("resolving", &dir))?;
        let (metadata, source) = match Source::of(&dir)? {
            Some(Source::PerRank { .. }) => {
                let (md, ranks) = super::per_rank::merge(&dir, &root)?;
                (md, Source::PerRank { ranks })
            }
            Some(Source::HfStorage { .. }) => super::hf_storage::read(&dir, &root)?,
            // `.metadata`, or nothing: then its absence is the error.
            _ => (metadata_in(&dir, &root)?, Source::Metadata),
        };
        let mut files = HashMap::new();
        for info in metadata.storage.values().flatten() {
            files
                .entry(info.relative_path.clone())
                .or_insert_with(|| confine(&root, &info.relative_path, "data file"));
        }
        let by_key = index_by_key(&metadata.entries);
        let ckpt = DcpCheckpoint {
            dir,
            metadata,
            by_key,
            source,
            files,
            drop_behind: None,
            open_files: Mutex::default(),
        };
        ckpt.refuse_safetensors_data()?;
        Ok(ckpt)
    }

    /// Refuses a directory `FileSystemWriter(serialization_format=SAFETENSORS)` wrote
    /// ([`Error::DcpSafetensorsData`]), which PyTorch cannot read back either: the first
    /// plain tensor chunk (in metadata order) is looked at, and its range starts with a
    /// safetensors header (an 8-byte little-endian length, then `{`) whose JSON holds the
    /// `DCP_SHARDING_INFO` PyTorch writes there, where a `torch.save` archive (`PK\x03\x04`)
    /// belongs. A range that is neither is left to the reads to report.
    fn refuse_safetensors_data(&self) -> Result<()> {
        let first = self.metadata.entries.iter().find_map(|e| match &e.kind {
            EntryKind::Tensor(t) => data_chunks(t).next().map(|c| (&e.key, c)),
            EntryKind::Bytes => None,
        });
        let Some((key, chunk)) = first else {
            return Ok(());
        };
        let k = StorageKey {
            fqn: key.clone(),
            offset: Some(chunk.offsets.clone()),
        };
        let Some(Ok(info)) = self.metadata.storage.get(&k) else {
            return Ok(());
        };
        let Some(Ok((path, len))) = self.files.get(&info.relative_path) else {
            return Ok(());
        };
        if !info.transforms.is_empty() || info.offset.saturating_add(9) > *len {
            return Ok(());
        }
        let Ok(mut file) = crate::storage::open_regular(path) else {
            return Ok(());
        };
        // Enough of the header to hold `__metadata__`, which the safetensors writer puts first.
        let mut head = Vec::new();
        let read = file
            .seek(SeekFrom::Start(info.offset))
            .and_then(|_| (&mut file).take(8 + 4096).read_to_end(&mut head));
        if read.is_err() || head.len() < 9 || head[8] != b'{' {
            return Ok(());
        }
        let header_len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let fits = header_len <= len - info.offset - 8;
        let sharding = head.windows(17).any(|w| w == b"DCP_SHARDING_INFO");
        if fits && sharding {
            return Err(Error::DcpSafetensorsData {
                dir: self.dir_name(),
                file: info.relative_path.clone(),
                key: key.clone(),
            });
        }
        Ok(())
    }

    /// This checkpoint, dropping the data-file pages it has read from the page cache
    /// ([`crate::storage::DropBehind`]): for offline streams that read each chunk once.
    pub(crate) fn dropping_behind(mut self) -> Self {
        self.drop_behind = Some(Default::default());
        self
    }

    /// Records a chunk read of `path` (bytes `start..end`) for drop-behind.
    fn drop_read_pages(&self, path: &Path, start: u64, end: u64) {
        let Some(dropper) = &self.drop_behind else {
            return;
        };
        if let Ok(f) = self.data_file(path) {
            let mut dropper = dropper.lock().unwrap_or_else(|e| e.into_inner());
            dropper.read(path.to_path_buf(), &f, start, end);
        }
    }

    /// The data file at `path` (confined by [`Self::checked_range`]), kept open for the next
    /// chunk read ([`OPEN_FILES`]).
    fn data_file(&self, path: &Path) -> std::io::Result<Arc<File>> {
        let mut open = self.open_files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = open.iter().position(|(p, _)| p == path) {
            let used = open.remove(i);
            let file = Arc::clone(&used.1);
            open.push(used);
            return Ok(file);
        }
        let file = Arc::new(crate::storage::open_regular(path)?);
        if open.len() >= OPEN_FILES {
            open.remove(0);
        }
        open.push((path.to_path_buf(), Arc::clone(&file)));
        Ok(file)
    }

    /// The parsed metadata (of `.metadata`, or built from another [`Source`]).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The checkpoint directory, as given.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The world size that saved it: the number of per-rank metadata files or of Hugging Face
    /// shard indices, or else one more than the highest rank in the data files'
    /// `__{rank}_{n}.distcp` names (`None` when none of these says).
    pub fn world_size(&self) -> Option<usize> {
        match self.source {
            Source::PerRank { ranks } => Some(ranks),
            Source::HfStorage { ranks, .. } => ranks,
            Source::Metadata => self
                .metadata
                .storage
                .values()
                .flatten()
                .filter_map(|info| rank_of(&info.relative_path))
                .max()
                .map(|r| r + 1),
        }
    }

    /// The checkpoint narrowed to the keys `keep` keeps (in their order): what every reader
    /// above then sees, as if the others had not been saved.
    pub(crate) fn retaining(mut self, keep: impl Fn(&Entry) -> bool) -> Self {
        self.metadata.entries.retain(|e| keep(e));
        self.by_key = index_by_key(&self.metadata.entries);
        self
    }

    /// Where the metadata came from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// For a checkpoint in Hugging Face storage, the model file (`i` of `n`) each tensor's
    /// chunks were saved for, by key (see `hf_storage::model_file_of`): the file plan
    /// `consolidate_safetensors_files` follows. `None` for another source, or when some
    /// tensor's chunks name no model file or two.
    pub(crate) fn hf_model_files(&self) -> Option<HashMap<String, (usize, usize)>> {
        if !matches!(self.source, Source::HfStorage { .. }) {
            return None;
        }
        let mut of: HashMap<String, (usize, usize)> = HashMap::new();
        for (key, info) in &self.metadata.storage {
            let file = super::hf_storage::model_file_of(&info.as_ref().ok()?.relative_path)?;
            if *of.entry(key.fqn.clone()).or_insert(file) != file {
                return None;
            }
        }
        Some(of)
    }

    /// The entry of flattened key `key`.
    pub fn entry(&self, key: &str) -> Option<&Entry> {
        self.by_key.get(key).map(|&i| &self.metadata.entries[i])
    }

    fn dir_name(&self) -> String {
        self.dir.display().to_string()
    }

    fn chunk_err(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::DcpChunks {
            dir: self.dir_name(),
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    fn storage_err(&self, key: &str, file: &str, reason: impl Into<String>) -> Error {
        Error::DcpStorage {
            dir: self.dir_name(),
            key: key.to_string(),
            file: file.to_string(),
            reason: reason.into(),
        }
    }

    /// The storage record of `key` at `offset` (a chunk's offsets, or `None` for bytes).
    fn storage(&self, key: &str, offset: Option<&[usize]>) -> Result<&StorageInfo> {
        let k = StorageKey {
            fqn: key.to_string(),
            offset: offset.map(<[usize]>::to_vec),
        };
        let at = || match offset {
            Some(o) => format!("the chunk at {o:?}"),
            None => "the value".to_string(),
        };
        match self.metadata.storage.get(&k) {
            Some(Ok(info)) => Ok(info),
            Some(Err(reason)) => Err(self.chunk_err(
                key,
                format!("the storage_data record of {} is malformed: {reason}", at()),
            )),
            None => Err(self.chunk_err(key, format!("{} has no storage_data entry", at()))),
        }
    }

    /// Checks that `info`'s range lies inside its (confined, existing) file and holds at
    /// least `min_len` bytes (unless it is compressed: then it may be shorter), and that its
    /// transforms are ones the crate reads ([`zstd_layers`]); returns the file.
    fn checked_range(&self, key: &str, info: &StorageInfo, min_len: u64) -> Result<&Path> {
        let f = &info.relative_path;
        let layers = zstd_layers(&info.transforms).map_err(|r| self.storage_err(key, f, r))?;
        let (path, len) = match self.files.get(f) {
            Some(Ok((p, len))) => (p, *len),
            Some(Err(reason)) => return Err(self.storage_err(key, f, reason.clone())),
            None => return Err(self.storage_err(key, f, "the file was not resolved")),
        };
        let end = info.offset.checked_add(info.length);
        if end.is_none_or(|e| e > len) {
            return Err(self.storage_err(
                key,
                f,
                format!(
                    "range {}..+{} lies past the end of the {len}-byte file",
                    info.offset, info.length
                ),
            ));
        }
        if layers == 0 && info.length < min_len {
            return Err(self.storage_err(
                key,
                f,
                format!(
                    "{} bytes stored, too few for the {min_len} bytes of data it must hold",
                    info.length
                ),
            ));
        }
        let most = inflate_bound(info.length, layers);
        if layers > 0 && min_len > most {
            return Err(Error::DcpCompressedTooShort {
                dir: self.dir_name(),
                key: key.to_string(),
                file: f.clone(),
                stored: info.length,
                most,
                needs: min_len,
            });
        }
        Ok(path)
    }

    /// Reads the bytes of `info` (after [`Self::checked_range`] with `need`, the bytes of data
    /// it must hold), decompressed across all its frames when it is compressed, in pieces
    /// into a buffer that grows with what they give (never sized on the metadata's word): at
    /// most `limit` bytes (`what` says what the limit is made of), else
    /// [`Error::DcpExpansion`], found as soon as the output passes the limit.
    fn read_item(
        &self,
        key: &str,
        info: &StorageInfo,
        (limit, what): (u64, &str),
        need: u64,
    ) -> Result<Vec<u8>> {
        let path = self.checked_range(key, info, need)?;
        let f = &info.relative_path;
        if info.transforms.is_empty() {
            let io = |e: std::io::Error| self.storage_err(key, f, format!("reading: {e}"));
            let mut file = crate::storage::open_regular(path).map_err(|e| io(e.into()))?;
            file.seek(SeekFrom::Start(info.offset)).map_err(io)?;
            let mut buf = vec![0u8; info.length as usize];
            file.read_exact(&mut buf).map_err(io)?;
            return Ok(buf);
        }
        let mut stream = self.zstd_stream(key, info, path, limit)?;
        let mut buf = Vec::with_capacity(need.min(limit).min(READ_PIECE) as usize);
        stream
            .read_to_end(&mut buf)
            .map_err(|e| self.decode_err(key, info, e))?;
        if buf.len() as u64 > limit {
            return Err(Error::DcpExpansion {
                dir: self.dir_name(),
                key: key.to_string(),
                file: f.clone(),
                limit,
                what: what.to_string(),
            });
        }
        self.drop_read_pages(path, info.offset, info.offset + info.length);
        Ok(buf)
    }

    fn tensor_meta<'s>(&'s self, key: &str) -> Result<(&'s TensorMeta, DType)> {
        let e = self
            .entry(key)
            .ok_or_else(|| self.chunk_err(key, "no such key in the checkpoint"))?;
        let EntryKind::Tensor(t) = &e.kind else {
            return Err(self.chunk_err(key, "not a tensor"));
        };
        let dtype = t.dtype().ok_or_else(|| {
            self.chunk_err(key, format!("dtype torch.{} is not supported", t.dtype))
        })?;
        Ok((t, dtype))
    }

    /// Checks a tensor's chunks without reading them: they tile its shape, and each has a
    /// byte range inside its file large enough for its elements. Returns the tensor's bytes.
    fn plan_tensor(&self, key: &str) -> Result<usize> {
        let (t, dtype) = self.tensor_meta(key)?;
        check_tiling(&t.size, &t.chunks).map_err(|r| self.chunk_err(key, r))?;
        for c in data_chunks(t) {
            let info = self.storage(key, Some(&c.offsets))?;
            let need = chunk_bytes(&c.sizes, dtype);
            self.checked_range(key, info, need)?;
        }
        // The chunks tile the shape and each chunk's bytes lie in a file, so this is bounded
        // by the data on disk.
        volume(&t.size)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| self.chunk_err(key, format!("shape {:?} overflows", t.size)))
    }

    /// One chunk opened to be read forward in pieces ([`LoneTensor`]), when it is stored
    /// uncompressed as a `torch.save` archive of one whole-storage tensor (what `dcp.save`
    /// writes); `None` for another form, which [`Self::read_chunk`] reads whole. The tensor
    /// must be of the metadata's dtype and the chunk's shape.
    fn open_chunk(&self, key: &str, chunk: &Chunk, dtype: DType) -> Result<Option<OpenChunk>> {
        let info = self.storage(key, Some(&chunk.offsets))?;
        if self.source.raw_chunks() {
            return Ok(None);
        }
        let path = self.checked_range(key, info, chunk_bytes(&chunk.sizes, dtype))?;
        let f = &info.relative_path;
        if !info.transforms.is_empty() {
            let Some(tensor) = self.open_zstd_chunk(key, (chunk, info), dtype)? else {
                return Ok(None);
            };
            return Ok(Some(OpenChunk {
                tensor: ChunkStream::Zstd(tensor),
                path: path.to_path_buf(),
                range: (info.offset, info.offset + info.length),
                file: f.clone(),
            }));
        }
        let at = chunk_site(chunk, info);
        let file = self
            .data_file(path)
            .map_err(|e| self.storage_err(key, f, format!("reading: {e}")))?;
        let opened = LoneTensor::open(file, path, info.offset, info.length)
            .map_err(|e| self.storage_err(key, f, format!("{at} does not parse: {e}")))?;
        let Some(tensor) = opened else {
            return Ok(None);
        };
        self.check_chunk_tensor(key, (chunk, info), dtype, (tensor.shape(), tensor.dtype()))?;
        Ok(Some(OpenChunk {
            tensor: ChunkStream::Plain(tensor),
            path: path.to_path_buf(),
            range: (info.offset, info.offset + info.length),
            file: f.clone(),
        }))
    }

    /// Refuses a chunk's tensor of another shape or dtype (`found`) than the metadata gives
    /// it, naming the chunk and its file.
    fn check_chunk_tensor(
        &self,
        key: &str,
        (chunk, info): (&Chunk, &StorageInfo),
        dtype: DType,
        found: (&[usize], DType),
    ) -> Result<()> {
        if found == (chunk.sizes.as_slice(), dtype) {
            return Ok(());
        }
        Err(self.storage_err(
            key,
            &info.relative_path,
            format!(
                "{} holds a {:?} {} tensor, but the metadata says {:?} {dtype}",
                chunk_site(chunk, info),
                found.0,
                found.1,
                chunk.sizes
            ),
        ))
    }

    /// Reads and parses one chunk; it must be a tensor of the metadata's dtype and the
    /// chunk's shape.
    fn read_chunk(&self, key: &str, chunk: &Chunk, dtype: DType) -> Result<HostTensor> {
        let info = self.storage(key, Some(&chunk.offsets))?;
        if self.source.raw_chunks() {
            return self.read_raw_chunk(key, chunk, dtype, info);
        }
        let path = self.checked_range(key, info, chunk_bytes(&chunk.sizes, dtype))?;
        let f = &info.relative_path;
        let at = chunk_site(chunk, info);
        let obj = if info.transforms.is_empty() {
            let file = self
                .data_file(path)
                .map_err(|e| self.storage_err(key, f, format!("reading: {e}")))?;
            let parsed = torch_save::load_from_shared_range(file, path, info.offset, info.length);
            self.drop_read_pages(path, info.offset, info.offset + info.length);
            parsed.map_err(|e| self.storage_err(key, f, format!("{at} does not parse: {e}")))?
        } else {
            self.read_zstd_chunk(key, (chunk, info), dtype)?
        };
        let PyObj::Tensor(t) = obj else {
            return Err(self.storage_err(
                key,
                f,
                format!("{at} holds a {}, not a tensor", obj.type_name()),
            ));
        };
        self.check_chunk_tensor(key, (chunk, info), dtype, (t.shape(), t.dtype()))?;
        Ok(t)
    }

    /// A chunk stored as its raw little-endian elements (Hugging Face storage: a
    /// safetensors tensor's `data_offsets`), exactly its bytes long.
    fn read_raw_chunk(
        &self,
        key: &str,
        chunk: &Chunk,
        dtype: DType,
        info: &StorageInfo,
    ) -> Result<HostTensor> {
        let need = chunk_bytes(&chunk.sizes, dtype);
        if info.length != need {
            return Err(self.storage_err(
                key,
                &info.relative_path,
                format!(
                    "chunk at {:?} of shape {:?} {dtype} needs {need} bytes, {} are stored",
                    chunk.offsets, chunk.sizes, info.length
                ),
            ));
        }
        let bytes = self.read_item(key, info, (need, "the chunk's bytes"), need)?;
        if let Ok(path) = self.checked_range(key, info, need) {
            self.drop_read_pages(path, info.offset, info.offset + info.length);
        }
        HostTensor::from_bytes(dtype, &chunk.sizes, &bytes)
            .map_err(|e| self.storage_err(key, &info.relative_path, e.to_string()))
    }

    /// The whole tensor stored under flattened key `key`, assembled from its chunks (any
    /// N-D grid), reading only their byte ranges.
    pub fn read_tensor(&self, key: &str) -> Result<HostTensor> {
        self.plan_tensor(key)?;
        let (t, dtype) = self.tensor_meta(key)?;
        let mut out = HostTensor::zeros(dtype, &t.size);
        for c in data_chunks(t) {
            let part = self.read_chunk(key, c, dtype)?;
            place_chunk(out.bytes_mut(), &t.size, c, part.as_bytes(), dtype.size());
        }
        Ok(out)
    }

    /// Elements `start..start + len` of the row-major flattening of the tensor stored under
    /// `key`, as a 1-D tensor. When the chunks are runs of the flattening (FSDP2 and FSDP1 dim-0
    /// shards, single chunks) only the chunks holding some of those elements are read, each
    /// whole and checked as [`Self::read_tensor`] checks it; for another grid the whole tensor
    /// is assembled first. What a rank reads of a parameter's state for its shard.
    pub fn read_flat_range(&self, key: &str, start: usize, len: usize) -> Result<HostTensor> {
        let (t, dtype) = self.flat_range_meta(key, start, len)?;
        let mut reader = RangeReader::new(self);
        HostTensor::filled_by(dtype, &[len], |out| {
            let mut at = 0;
            reader.read_checked(key, (t, dtype), start, len, &mut |bytes| {
                out[at..at + bytes.len()].copy_from_slice(bytes);
                at += bytes.len();
                Ok(())
            })?;
            reader.finish()
        })
    }

    /// Checks the tensor under `key` ([`Self::plan_tensor`]) and that elements
    /// `start..start + len` lie inside it; its metadata and dtype.
    pub(crate) fn flat_range_meta(
        &self,
        key: &str,
        start: usize,
        len: usize,
    ) -> Result<(&TensorMeta, DType)> {
        let bytes = self.plan_tensor(key)?;
        let (t, dtype) = self.tensor_meta(key)?;
        let es = dtype.size();
        let inside = start
            .checked_add(len)
            .is_some_and(|e| e.checked_mul(es).is_some_and(|b| b <= bytes));
        if !inside {
            return Err(self.chunk_err(
                key,
                format!(
                    "elements {start}..+{len} lie outside the tensor's {} elements",
                    bytes / es
                ),
            ));
        }
        Ok((t, dtype))
    }

    /// The non-tensor value stored under `key` (a `torch.save`d object).
    pub fn read_object(&self, key: &str) -> Result<PyObj> {
        let info = self.storage(key, None)?;
        let what = "the limit on a non-tensor value";
        let raw = self.read_item(key, info, (MAX_OBJECT_BYTES, what), 0)?;
        let parsed = if info.transforms.is_empty() {
            torch_save::load_from_bytes(&raw)
        } else {
            torch_save::load_one_archive(&raw)
        };
        parsed.map_err(|e| {
            self.storage_err(
                key,
                &info.relative_path,
                format!("the value does not parse: {e}"),
            )
        })
    }

    /// The nested state dict, as `dcp_to_torch_save` rebuilds it, with `tensor(i, meta)`
    /// standing for entry `i`'s tensor and non-tensor values read.
    fn nested(&self, tensor: &mut dyn FnMut(usize, &TensorMeta) -> Result<PyObj>) -> Result<PyObj> {
        let entries = &self.metadata.entries;
        let mut leaf = |i: usize| match &entries[i].kind {
            EntryKind::Tensor(t) => tensor(i, t),
            EntryKind::Bytes => self.read_object(&entries[i].key),
        };
        nest(entries, &mut leaf).map_err(|e| e.into_error(&self.metadata_name()))
    }

    /// What errors name as the metadata: `DIR/.metadata`, or the files it was built from.
    pub(crate) fn metadata_name(&self) -> String {
        match &self.source {
            Source::Metadata => self.dir.join(".metadata").display().to_string(),
            Source::PerRank { ranks } => {
                format!("{}/__{{0..{}}}.metadata", self.dir.display(), ranks - 1)
            }
            Source::HfStorage { .. } => format!("{}/*.safetensors", self.dir.display()),
        }
    }

    /// The whole nested state dict in memory (every tensor assembled).
    pub fn load(&self) -> Result<PyObj> {
        let entries = &self.metadata.entries;
        self.nested(&mut |i, _| Ok(PyObj::Tensor(self.read_tensor(&entries[i].key)?)))
    }
}

/// The chunks of `t` that are read: those that hold elements ([`holds_elements`]).
fn data_chunks(t: &TensorMeta) -> impl Iterator<Item = &Chunk> {
    t.chunks.iter().filter(|c| holds_elements(c))
}

/// Where a chunk lies, for messages: its offsets in the tensor and its bytes in its file.
fn chunk_site(chunk: &Chunk, info: &StorageInfo) -> String {
    format!(
        "chunk at {:?}, bytes {}..+{}",
        chunk.offsets, info.offset, info.length
    )
}

fn chunk_bytes(sizes: &[usize], dtype: DType) -> u64 {
    volume(sizes)
        .and_then(|n| n.checked_mul(dtype.size()))
        .map_or(u64::MAX, |n| n as u64)
}

/// What a compressed tensor chunk may decompress to beyond its elements' bytes: the
/// `torch.save` archive around them. That archive (`archive/data.pkl` of a few hundred bytes,
/// `byteorder`, `version`, `.format_version`, `.storage_alignment`,
/// `.data/serialization_id`, the storage padded to 64 bytes, their zip headers and the
/// central directory) takes about 1.5 KiB whatever the tensor; 64 KiB leaves room for any
/// archive `torch.save` writes of one tensor, and nothing a bomb could use.
pub const ARCHIVE_ALLOWANCE: u64 = 64 << 10;

/// The most bytes a compressed non-tensor value (a param-group option, a step, a user's plain
/// value: a small pickle) may decompress to: 64 MiB, the limit the crate reads any small
/// metadata it holds in memory whole with ([`crate::storage::SMALL_METADATA_MAX_BYTES`]).
pub const MAX_OBJECT_BYTES: u64 = crate::storage::SMALL_METADATA_MAX_BYTES;

/// The zstd descriptor PyTorch's `ZStandard` extension records (`registry_name()/1`).
pub(crate) const ZSTD_DESCRIPTOR: &str = "stream.zstd/1";

/// How many zstd layers the `transform_descriptors` of a record stand for, resolved as
/// PyTorch's `ExtensionRegistry.from_descriptor_list` resolves them: each descriptor is
/// `name[@local-domain][/version]`, the name before the first `/` is looked up in the
/// registry, whose only built-in entry is `stream.zstd`, and `ZStandard.from_descriptor`
/// takes a version whose major part (before the first `.`) is `1`. Several descriptors chain,
/// each undone in turn (only zstd exists, so their order cannot matter). Why not, otherwise.
fn zstd_layers(descriptors: &[String]) -> std::result::Result<usize, String> {
    for d in descriptors {
        let (name, version) = d.split_once('/').unwrap_or((d, ""));
        if name != "stream.zstd" {
            return Err(format!(
                "stored through the transform {:?}, which PyTorch's extension registry does not know (it knows `stream.zstd`) and the crate cannot undo",
                crate::error::shown(d)
            ));
        }
        if version.split('.').next() != Some("1") {
            return Err(format!(
                "stored through {:?}: a zstd stream of version {:?}, which PyTorch's ZStandard extension refuses (it reads version 1)",
                crate::error::shown(d),
                crate::error::shown(version)
            ));
        }
    }
    Ok(descriptors.len())
}

/// The pieces a compressed item's buffer starts with: it grows with what the decoder gives,
/// never from a declared size.
const READ_PIECE: u64 = 1 << 20;

/// The most `stored` bytes can decompress to through `layers` zstd layers (each layer's bound
/// is the next one's stored length): see the module docs of [`crate::io::dcp`] for the
/// derivation from the zstd format (RFC 8878). A zstd frame is a 4-byte magic number, a frame
/// header of at least 2 bytes, then blocks, each a 3-byte header and its content; a block
/// decompresses to at most `Block_Maximum_Size` = min(window, 128 KiB) bytes, and the most
/// per stored byte is an RLE block: 3 + 1 bytes for 128 KiB. Skippable frames, more frames,
/// checksums and longer headers only add stored bytes. So `L` stored bytes give at most
/// 131072 × ⌊(L − 6) / 4⌋ bytes (none when `L < 10`), reached by one frame with a 6-byte
/// header (magic, descriptor, window descriptor) and RLE blocks of 128 KiB; libzstd refuses
/// a larger block ("Data corruption detected"), checked in the tests.
pub(crate) fn inflate_bound(stored: u64, layers: usize) -> u64 {
    (0..layers).fold(stored, |l, _| {
        (l.saturating_sub(ZSTD_FRAME_HEAD) / ZSTD_RLE_BLOCK).saturating_mul(ZSTD_MAX_BLOCK)
    })
}

/// The fewest bytes of a zstd frame before its first block: the magic number and a 2-byte
/// frame header.
const ZSTD_FRAME_HEAD: u64 = 6;
/// The stored bytes of an RLE block: its 3-byte header and the repeated byte.
const ZSTD_RLE_BLOCK: u64 = 4;
/// The most a zstd block decompresses to (`ZSTD_BLOCKSIZE_MAX`).
const ZSTD_MAX_BLOCK: u64 = 128 << 10;

/// The most an inner zstd layer may decompress to when the outer one may give `limit` bytes:
/// zstd's worst-case growth of incompressible data (`ZSTD_compressBound`) plus a frame.
fn zstd_bound(limit: u64) -> u64 {
    limit
        .saturating_add(limit / 128)
        .saturating_add(ARCHIVE_ALLOWANCE)
}

impl Drop for DcpCheckpoint {
    /// A dropping-behind checkpoint leaves at most the partial folios between its runs of
    /// reads cached.
    fn drop(&mut self) {
        let Some(dropper) = self.drop_behind.as_mut() else {
            return;
        };
        let dropper = dropper.get_mut().unwrap_or_else(|e| e.into_inner());
        for path in self
            .files
            .values()
            .filter_map(|f| f.as_ref().ok())
            .map(|f| &f.0)
        {
            if let Ok(f) = crate::storage::open_regular(path) {
                dropper.finish(path, &f);
            }
        }
    }
}

/// Reads and parses `dir/.metadata`: a regular file (a symbolic link is followed and must end
/// at one, as for data files) of at most 1 GiB (`MAX_METADATA_BYTES`), read without blocking
/// on a FIFO.
pub fn read_metadata(dir: &Path) -> Result<Metadata> {
    let root = dir.canonicalize().map_err(Error::io("resolving", dir))?;
    metadata_in(dir, &root)
}

/// [`read_metadata`] of `dir`, whose canonical path is `root`.
fn metadata_in(dir: &Path, root: &Path) -> Result<Metadata> {
    metadata_file_in(dir, root, ".metadata")
}

/// The placeholders of a nested DCP state dict ([`Placeholders`]), streamed one tensor at a
/// time through a [`RangeReader`]: chunks that are runs of the tensor's flattening (dim-0
/// shards, single chunks, flat parameter shards) go out as they are read, a piece at a time,
/// never assembled; other grids are assembled one tensor at a time. `progress` gets the tensor
/// bytes streamed so far.
pub(crate) struct Streamed<'c, P> {
    ckpt: &'c DcpCheckpoint,
    reader: RangeReader<'c>,
    /// Placeholder buffer identity → entry index.
    stands_for: &'c HashMap<usize, usize>,
    written: u64,
    progress: P,
}

impl<'c, P> Streamed<'c, P> {
    /// Streams the placeholders of `placeholders` from `ckpt`.
    pub(crate) fn new(
        ckpt: &'c DcpCheckpoint,
        placeholders: &'c Placeholders,
        progress: P,
    ) -> Self {
        Streamed {
            ckpt,
            reader: RangeReader::new(ckpt),
            stands_for: &placeholders.stands_for,
            written: 0,
            progress,
        }
    }
}

impl<P: FnMut(u64)> LazyTensors for Streamed<'_, P> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        let i = self.stands_for.get(&t.storage_id())?;
        match &self.ckpt.metadata.entries[*i].kind {
            EntryKind::Tensor(m) => Some(m.size.clone()),
            EntryKind::Bytes => None,
        }
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        let Some(&i) = self.stands_for.get(&t.storage_id()) else {
            return Ok(());
        };
        let key = &self.ckpt.metadata.entries[i].key;
        let (written, progress) = (&mut self.written, &mut self.progress);
        self.reader.read_whole(key, &mut |bytes| {
            sink(bytes).map_err(|e| Error::Io {
                op: "writing a consolidated torch.save file".into(),
                path: String::new(),
                source: e.into(),
            })?;
            *written += bytes.len() as u64;
            progress(*written);
            Ok(())
        })
    }

    /// Finishes the reader ([`RangeReader::finish`]). Every tensor is read whole, so each
    /// chunk's CRC-32 was checked when its read reached its end.
    fn finish(&mut self) -> Result<()> {
        self.reader.finish()
    }
}

/// The chunks in element order, each with the position of its first element in the
/// tensor's row-major flattening, when each is one run of that flattening (whole rows, or a
/// part of one row: dim-0 shards, single chunks, and the partial first row, whole rows and
/// partial last row [`super::plan::flat_range_boxes`] cuts for a flat parameter's shard), so
/// that their bytes, one after another, are the tensor's; `None` for another grid. The chunks
/// must already be known to tile the shape.
pub(super) fn flat_slabs<'c>(
    size: &[usize],
    chunks: impl Iterator<Item = &'c Chunk>,
) -> Option<Vec<(usize, &'c Chunk)>> {
    let mut slabs = Vec::new();
    for c in chunks {
        if c.sizes.len() != size.len() || c.offsets.len() != size.len() {
            return None;
        }
        if c.sizes.contains(&0) {
            continue;
        }
        // Size 1 up to some dimension k, all of every dimension after it.
        let last = size.len().saturating_sub(1);
        let k = c.sizes.iter().position(|&n| n != 1).unwrap_or(last);
        let rest_whole = (k + 1..size.len()).all(|j| c.sizes[j] == size[j] && c.offsets[j] == 0);
        if !rest_whole {
            return None;
        }
        let mut first = 0;
        for (j, &o) in c.offsets.iter().enumerate() {
            first = first * size[j] + o;
        }
        slabs.push((first, c));
    }
    slabs.sort_by_key(|&(first, _)| first);
    Some(slabs)
}

/// Reads element ranges of a DCP directory's tensors front to back, holding the last unit it
/// read: a chunk when the tensor's chunks are runs of its flattening, else the whole tensor
/// assembled. A chunk `dcp.save` wrote (uncompressed) is read forward a piece at a time
/// ([`LoneTensor`]), so each piece is still in the CPU cache when it is written; another
/// is read whole. Ranges that follow one another through a tensor (one output rank's piece,
/// then the next rank's) so read each chunk once, and memory holds at most one unit (at
/// most the largest tensor) besides the one being read.
pub(crate) struct RangeReader<'c> {
    ckpt: &'c DcpCheckpoint,
    held: Option<Held>,
    units_read: u64,
}

/// The unit a [`RangeReader`] holds: its tensor's key, which unit, and the unit itself.
struct Held {
    key: String,
    /// The chunk's offsets, or `None` for the whole tensor.
    chunk: Option<Vec<usize>>,
    unit: Unit,
}

/// A unit read whole, or a chunk read forward in pieces.
enum Unit {
    Whole(HostTensor),
    Open(Box<OpenChunk>),
}

/// A chunk [`DcpCheckpoint::open_chunk`] opened, with where it lies (for page dropping and
/// messages).
struct OpenChunk {
    tensor: ChunkStream,
    path: PathBuf,
    range: (u64, u64),
    file: String,
}

/// A chunk read forward in pieces: stored plain ([`LoneTensor`]) or through zstd
/// ([`zstd_chunk::ZstdChunk`]).
enum ChunkStream {
    Plain(LoneTensor),
    Zstd(zstd_chunk::ZstdChunk),
}

impl ChunkStream {
    fn pos(&self) -> u64 {
        match self {
            ChunkStream::Plain(t) => t.pos(),
            ChunkStream::Zstd(t) => t.pos(),
        }
    }

    fn read(
        &mut self,
        from: u64,
        to: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        match self {
            ChunkStream::Plain(t) => t.read(from, to, sink),
            ChunkStream::Zstd(t) => t.read(from, to, sink),
        }
    }

    fn is_checked(&self) -> bool {
        match self {
            ChunkStream::Plain(t) => t.is_checked(),
            ChunkStream::Zstd(t) => t.is_checked(),
        }
    }

    fn finish(&mut self) -> Result<()> {
        match self {
            ChunkStream::Plain(t) => t.finish(),
            ChunkStream::Zstd(t) => t.finish(),
        }
    }
}

impl<'c> RangeReader<'c> {
    pub(crate) fn new(ckpt: &'c DcpCheckpoint) -> Self {
        RangeReader {
            ckpt,
            held: None,
            units_read: 0,
        }
    }

    /// How many units (chunks or whole tensors) were opened or read so far.
    pub(crate) fn units_read(&self) -> u64 {
        self.units_read
    }

    /// Hands elements `start..start + len` of the flattening of the tensor under `key` to
    /// `sink` in order, in pieces; every unit read is checked as
    /// [`DcpCheckpoint::read_tensor`] checks it, a chunk read in pieces when its last byte
    /// is read or at [`Self::finish`] (so the caller commits nothing before that).
    pub(crate) fn read(
        &mut self,
        key: &str,
        start: usize,
        len: usize,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let meta = self.ckpt.flat_range_meta(key, start, len)?;
        self.read_checked(key, meta, start, len, sink)
    }

    /// [`Self::read`] of every element of the tensor under `key`.
    pub(crate) fn read_whole(
        &mut self,
        key: &str,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (meta, _) = self.ckpt.tensor_meta(key)?;
        let numel = meta.size.iter().product();
        self.read(key, 0, numel, sink)
    }

    /// Finishes the unit held: a chunk read in part is read to its end and its checksum
    /// checked. Call it before committing what was read.
    pub(crate) fn finish(&mut self) -> Result<()> {
        match self.held.take() {
            Some(Held {
                key,
                unit: Unit::Open(mut open),
                ..
            }) => {
                let done = open.tensor.finish();
                opened_done(self.ckpt, &key, &mut open, done)
            }
            _ => Ok(()),
        }
    }

    /// [`Self::read`] of a range [`DcpCheckpoint::flat_range_meta`] checked, with what it
    /// gave.
    fn read_checked(
        &mut self,
        key: &str,
        (t, dtype): (&TensorMeta, DType),
        start: usize,
        len: usize,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let es = dtype.size();
        let end = start + len;
        let slabs = (!t.size.is_empty())
            .then(|| flat_slabs(&t.size, data_chunks(t)))
            .flatten();
        let Some(slabs) = slabs else {
            return self.unit_part(key, None, dtype, (start * es, end * es), sink);
        };
        // The slabs tile the flattening, so together they hand over every byte of the range.
        for (lo, c) in slabs {
            let hi = lo + c.sizes.iter().product::<usize>();
            let (a, b) = (lo.max(start), hi.min(end));
            if a >= b {
                continue;
            }
            self.unit_part(key, Some(c), dtype, ((a - lo) * es, (b - lo) * es), sink)?;
        }
        Ok(())
    }

    /// Hands bytes `from..to` of the unit `chunk` (`None`: the whole tensor) of `key` to
    /// `sink`: from the held unit, or from one opened (or read) in its place after the held
    /// one is finished. A chunk read forward is reopened for bytes before where it stands.
    fn unit_part(
        &mut self,
        key: &str,
        chunk: Option<&Chunk>,
        dtype: DType,
        (from, to): (usize, usize),
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let offsets = chunk.map(|c| c.offsets.as_slice());
        let hit = self.held.as_ref().is_some_and(|h| {
            h.key == key
                && h.chunk.as_deref() == offsets
                && match &h.unit {
                    Unit::Whole(_) => true,
                    Unit::Open(o) => o.tensor.pos() <= from as u64,
                }
        });
        if !hit {
            self.finish()?;
            let ckpt = self.ckpt;
            let unit = match chunk {
                None => Unit::Whole(ckpt.read_tensor(key)?),
                Some(c) => match ckpt.open_chunk(key, c, dtype)? {
                    Some(open) => Unit::Open(Box::new(open)),
                    None => Unit::Whole(ckpt.read_chunk(key, c, dtype)?),
                },
            };
            self.units_read += 1;
            self.held = Some(Held {
                key: key.to_string(),
                chunk: offsets.map(<[usize]>::to_vec),
                unit,
            });
        }
        let Some(held) = self.held.as_mut() else {
            return Err(Error::Internal(
                "a DCP range reader lost the unit it read".into(),
            ));
        };
        match &mut held.unit {
            Unit::Whole(t) => match t.as_bytes().get(from..to) {
                Some(bytes) => sink(bytes),
                None => Err(Error::Internal(format!(
                    "bytes {from}..{to} of a {}-byte unit of {key}",
                    t.as_bytes().len()
                ))),
            },
            Unit::Open(open) => {
                let read = open.tensor.read(from as u64, to as u64, sink);
                opened_done(self.ckpt, key, open, read)
            }
        }
    }
}

/// After a read of an opened chunk: its error named with the key and file, or, once all of
/// it was read and checked, its pages dropped (when the checkpoint drops behind).
fn opened_done(
    ckpt: &DcpCheckpoint,
    key: &str,
    open: &mut OpenChunk,
    done: Result<()>,
) -> Result<()> {
    match done {
        // The sink's own errors (writing) pass through unchanged, and those that name the
        // chunk already (a compressed chunk's).
        Err(e @ (Error::Io { .. } | Error::Internal(_) | Error::DcpStorage { .. })) => Err(e),
        Err(e) => Err(ckpt.storage_err(key, &open.file, e.to_string())),
        Ok(()) => {
            if open.tensor.is_checked() {
                ckpt.drop_read_pages(&open.path, open.range.0, open.range.1);
            }
            Ok(())
        }
    }
}

/// The nested dict of a DCP checkpoint with a one-element placeholder per tensor (each
/// checked before anything is written), and which entry each placeholder stands for: what
/// `dcp_to_torch_save` writes, before its tensors are streamed in ([`Streamed`]).
pub(crate) struct Placeholders {
    pub(crate) obj: PyObj,
    /// Placeholder buffer identity → entry index.
    stands_for: HashMap<usize, usize>,
}

impl Placeholders {
    pub(crate) fn new(ckpt: &DcpCheckpoint) -> Result<Self> {
        let mut stands_for = HashMap::new();
        let obj = ckpt.nested(&mut |i, _| {
            let key = &ckpt.metadata.entries[i].key;
            ckpt.plan_tensor(key)?;
            let (_, dtype) = ckpt.tensor_meta(key)?;
            let t = HostTensor::zeros(dtype, &[1]);
            stands_for.insert(t.storage_id(), i);
            Ok(PyObj::Tensor(t))
        })?;
        Ok(Placeholders { obj, stands_for })
    }
}

/// The consolidated `.safetensors` file of a DCP checkpoint in the crate's mapping
/// ([`crate::io::safetensors`]), planned before any byte is written: the nested dict's
/// structure in `__metadata__`, the tensors by their path, back to back in file order.
pub(crate) struct SafetensorsPlan {
    /// (name, entry index) of each tensor, in file order.
    order: Vec<(String, usize)>,
    header: Vec<u8>,
    /// Bytes of each tensor's data, in file order.
    lens: Vec<u64>,
}

impl SafetensorsPlan {
    pub(crate) fn new(ckpt: &DcpCheckpoint) -> Result<Self> {
        let placeholders = Placeholders::new(ckpt)?;
        let (tensors, meta) = crate::io::safetensors::parts(&placeholders.obj)?;
        let order: Vec<(String, usize)> = tensors
            .iter()
            .filter_map(|(name, t)| {
                let i = placeholders.stands_for.get(&t.storage_id())?;
                Some((name.clone(), *i))
            })
            .collect();
        let (header, lens) = safetensors_header(ckpt, &order, meta.into_iter().collect())?;
        Ok(SafetensorsPlan {
            order,
            header,
            lens,
        })
    }

    /// The file's length.
    pub(crate) fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.lens.iter().sum::<u64>()
    }

    /// Streams process `rank`'s share (of `world_size`) of the tensors into
    /// `file`, the temporary `tmp` of `out`, at their planned offsets: each tensor goes to the
    /// process whose equal span of the data holds its first byte. `progress` gets the tensor
    /// bytes written so far; returns them.
    pub(crate) fn write_share(
        &self,
        ckpt: &DcpCheckpoint,
        (file, out, tmp): (&File, &Path, &Path),
        (rank, world_size): (usize, usize),
        mut progress: impl FnMut(u64),
    ) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let err = crate::storage::tmp_io_err("writing", out, tmp);
        let data: u64 = self.lens.iter().sum();
        let mut writeback = crate::storage::Writeback::new(0);
        let mut reader = RangeReader::new(ckpt);
        let (mut at, mut written) = (0u64, 0u64);
        for ((_, i), len) in self.order.iter().zip(&self.lens) {
            if crate::storage::writer_of(at, data, world_size) == rank {
                let key = &ckpt.metadata.entries[*i].key;
                let start = self.header.len() as u64 + at;
                let mut offset = start;
                reader.read_whole(key, &mut |bytes| {
                    file.write_all_at(bytes, offset).map_err(&err)?;
                    let n = bytes.len() as u64;
                    writeback.wrote_at(file, offset, n).map_err(&err)?;
                    offset += n;
                    written += n;
                    progress(written);
                    Ok(())
                })?;
                if offset - start != *len {
                    return Err(Error::Internal(format!(
                        "tensor `{key}` streamed {} of its {len} planned bytes",
                        offset - start
                    )));
                }
            }
            at += len;
        }
        reader.finish()?;
        Ok(written)
    }

    /// Writes the header at the start of `file`, the temporary `tmp` of `out`.
    pub(crate) fn write_header(&self, file: &File, out: &Path, tmp: &Path) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let err = crate::storage::tmp_io_err("writing", out, tmp);
        file.write_all_at(&self.header, 0).map_err(err)
    }
}

/// The safetensors header (length prefix included, padded to 8 bytes) for the tensors of
/// `order` laid out back to back, with `meta` as `__metadata__`, and each tensor's data bytes.
fn safetensors_header(
    ckpt: &DcpCheckpoint,
    order: &[(String, usize)],
    meta: BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<u64>)> {
    let entries = order
        .iter()
        .map(|(name, i)| {
            let key = &ckpt.metadata.entries[*i].key;
            let (t, dtype) = ckpt.tensor_meta(key)?;
            Ok(crate::io::safetensors::header::Entry {
                name: name.clone(),
                dtype,
                shape: t.size.clone(),
                nbytes: ckpt.plan_tensor(key)? as u64,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let header = crate::io::safetensors::header::encode(&entries, &meta, &|e| {
        format!("the path `{}` of the DCP checkpoint's object", e.name)
    })?
    .0;
    Ok((header, entries.iter().map(|e| e.nbytes).collect()))
}

/// What [`verify`] checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyReport {
    /// Tensor keys.
    pub tensors: usize,
    /// Chunks read and parsed.
    pub chunks: usize,
    /// Non-tensor values read and parsed.
    pub objects: usize,
    /// Bytes of the data files read.
    pub bytes_read: u64,
}

/// Checks a DCP directory completely: every referenced byte range lies inside its file (no
/// escaping path, no missing file), every chunk parses as a tensor of the metadata's dtype
/// and chunk shape, the chunks of every tensor cover its global shape exactly once, and every
/// non-tensor value parses. The first problem is returned as a typed error naming the key
/// and file.
pub fn verify(dir: &Path) -> Result<VerifyReport> {
    let ckpt = DcpCheckpoint::open(dir)?.dropping_behind();
    let mut r = VerifyReport::default();
    for e in &ckpt.metadata.entries {
        match &e.kind {
            EntryKind::Tensor(t) => {
                ckpt.plan_tensor(&e.key)?;
                let (_, dtype) = ckpt.tensor_meta(&e.key)?;
                for c in data_chunks(t) {
                    ckpt.read_chunk(&e.key, c, dtype)?;
                    r.chunks += 1;
                    r.bytes_read += ckpt.storage(&e.key, Some(&c.offsets))?.length;
                }
                r.tensors += 1;
            }
            EntryKind::Bytes => {
                ckpt.read_object(&e.key)?;
                r.objects += 1;
                r.bytes_read += ckpt.storage(&e.key, None)?.length;
            }
        }
    }
    Ok(r)
}

/// One key of a [`DcpSummary`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EntrySummary {
    /// The flattened key.
    pub key: String,
    /// `tensor` or `bytes`.
    pub kind: &'static str,
    /// The dtype (`torch.float32`), for tensors.
    pub dtype: Option<String>,
    /// The global shape, for tensors.
    pub shape: Option<Vec<usize>>,
    /// The number of chunks, for tensors.
    pub chunks: usize,
}

/// One data file of a [`DcpSummary`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DataFileSummary {
    /// The name (relative to the directory).
    pub name: String,
    /// Its length in bytes (`None` when it is missing or outside the directory).
    pub bytes: Option<u64>,
    /// Ranges stored in it.
    pub ranges: usize,
    /// The stream transforms its ranges were stored through (`stream.zstd/1` for
    /// `FileSystemWriter(_extensions=[ZStandard()])`), each once; empty for plain ranges.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub transforms: Vec<String>,
}

/// What `fsdp-ckpt inspect` prints for a DCP directory.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DcpSummary {
    /// The directory.
    pub checkpoint: String,
    /// `dcp`.
    pub format: &'static str,
    /// The DCP version recorded.
    pub version: Option<String>,
    /// Where the metadata came from.
    pub source: Source,
    /// The world size that saved it: the number of per-rank metadata files or of Hugging
    /// Face shard indices, or else one more than the highest rank in the data files'
    /// `__{rank}_{n}.distcp` names (`None` when none of these says).
    pub world_size: Option<usize>,
    /// Every key in metadata order.
    pub entries: Vec<EntrySummary>,
    /// The data files, by name.
    pub files: Vec<DataFileSummary>,
    /// Total bytes of the tensors (global shapes).
    pub tensor_bytes: u64,
}

/// Describes the DCP directory `dir` from its metadata (no chunk is read).
pub fn summary(dir: &Path) -> Result<DcpSummary> {
    let ckpt = DcpCheckpoint::open(dir)?;
    let md = &ckpt.metadata;
    let mut tensor_bytes = 0u64;
    let entries = md
        .entries
        .iter()
        .map(|e| match &e.kind {
            EntryKind::Tensor(t) => {
                let esize = t.dtype().map_or(0, DType::size) as u64;
                let n = volume(&t.size).map_or(u64::MAX, |n| n as u64);
                tensor_bytes = tensor_bytes.saturating_add(n.saturating_mul(esize));
                EntrySummary {
                    key: e.key.clone(),
                    kind: "tensor",
                    dtype: Some(format!("torch.{}", t.dtype)),
                    shape: Some(t.size.clone()),
                    chunks: t.chunks.len(),
                }
            }
            EntryKind::Bytes => EntrySummary {
                key: e.key.clone(),
                kind: "bytes",
                dtype: None,
                shape: None,
                chunks: 0,
            },
        })
        .collect();
    let mut ranges: BTreeMap<&str, (usize, Vec<String>)> = BTreeMap::new();
    for info in md.storage.values().flatten() {
        let (n, transforms) = ranges.entry(&info.relative_path).or_default();
        *n += 1;
        for t in &info.transforms {
            if !transforms.contains(t) {
                transforms.push(t.clone());
            }
        }
    }
    let files: Vec<DataFileSummary> = ranges
        .into_iter()
        .map(|(name, (n, mut transforms))| DataFileSummary {
            name: name.to_string(),
            bytes: ckpt
                .files
                .get(name)
                .and_then(|f| f.as_ref().ok())
                .map(|f| f.1),
            ranges: n,
            transforms: {
                transforms.sort();
                transforms
            },
        })
        .collect();
    let world_size = ckpt.world_size();
    Ok(DcpSummary {
        checkpoint: dir.display().to_string(),
        format: "dcp",
        version: md.version.clone(),
        source: ckpt.source.clone(),
        world_size,
        entries,
        files,
        tensor_bytes,
    })
}

/// The rank in a `__{rank}_{n}.distcp` file name.
fn rank_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("__")?.strip_suffix(".distcp")?;
    let (rank, n) = rest.split_once('_')?;
    n.parse::<usize>().ok()?;
    rank.parse().ok()
}

impl std::fmt::Display for DcpSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "DCP checkpoint: {} (version {})",
            self.checkpoint,
            self.version.as_deref().unwrap_or("?")
        )?;
        writeln!(f, "metadata: {}", self.source.describe())?;
        let ws = self.world_size.map_or("?".to_string(), |w| w.to_string());
        let from = match self.source {
            Source::Metadata => "from the file names",
            Source::PerRank { .. } => "from the metadata files",
            Source::HfStorage {
                form: super::HfForm::Rank0,
                ..
            } => "rank 0 saved the full state dict alone",
            Source::HfStorage { .. } => "from the shard file names",
        };
        writeln!(
            f,
            "world size {ws} ({from}), {} keys, {} bytes of tensors",
            self.entries.len(),
            self.tensor_bytes
        )?;
        writeln!(f, "files:")?;
        for file in &self.files {
            let b = file
                .bytes
                .map_or("missing".to_string(), |b| format!("{b} bytes"));
            let through = if file.transforms.is_empty() {
                String::new()
            } else {
                format!(", through {}", file.transforms.join(" + "))
            };
            writeln!(f, "  {} ({b}, {} ranges{through})", file.name, file.ranges)?;
        }
        writeln!(f, "keys:")?;
        for e in &self.entries {
            match (&e.dtype, &e.shape) {
                (Some(d), Some(s)) => writeln!(f, "  {} {d} {s:?} ({} chunks)", e.key, e.chunks)?,
                _ => writeln!(f, "  {} (object)", e.key)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_files_stay_open_for_the_next_chunk_up_to_a_bound_least_recently_used_closed_first() {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dcp/fsdp2_adam_ws4/ckpt");
        let ckpt = DcpCheckpoint::open(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..OPEN_FILES + 6)
            .map(|i| {
                let p = tmp.path().join(format!("__{i}_0.distcp"));
                std::fs::write(&p, [i as u8]).unwrap();
                p
            })
            .collect();
        let first = ckpt.data_file(&paths[0]).unwrap();
        assert!(Arc::ptr_eq(&first, &ckpt.data_file(&paths[0]).unwrap()));
        for p in &paths[1..] {
            ckpt.data_file(p).unwrap();
        }
        // Reusing file 7 keeps it open past the later ones.
        let seventh = ckpt.data_file(&paths[7]).unwrap();
        ckpt.data_file(&tmp.path().join("one_more")).unwrap_err();
        std::fs::write(tmp.path().join("one_more"), b"x").unwrap();
        ckpt.data_file(&tmp.path().join("one_more")).unwrap();
        let open: Vec<PathBuf> = ckpt
            .open_files
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect();
        assert_eq!(open.len(), OPEN_FILES);
        assert!(
            !open.contains(&paths[0]) && !open.contains(&paths[6]),
            "{open:?}"
        );
        assert!(open.contains(&paths[8]) && open.contains(&paths[OPEN_FILES + 5]));
        assert!(Arc::ptr_eq(&seventh, &ckpt.data_file(&paths[7]).unwrap()));
    }

    fn descs(d: &[&str]) -> Vec<String> {
        d.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn descriptors_resolve_as_pytorchs_registry_resolves_them() {
        // `name, _, version = desc.partition("/")`; `ZStandard.from_descriptor` wants a major
        // version of 1; the list chains.
        assert_eq!(zstd_layers(&[]), Ok(0));
        assert_eq!(zstd_layers(&descs(&["stream.zstd/1"])), Ok(1));
        assert_eq!(zstd_layers(&descs(&["stream.zstd/1.7"])), Ok(1));
        assert_eq!(
            zstd_layers(&descs(&["stream.zstd/1", "stream.zstd/1"])),
            Ok(2)
        );
        for bad in [
            "stream.zstd",
            "stream.zstd/",
            "stream.zstd/2",
            "stream.zstd/10",
            "stream.zstd@corp/1",
            "stream.lz4/1",
            "",
        ] {
            let err = zstd_layers(&descs(&["stream.zstd/1", bad])).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
    }

    /// A zstd frame of `blocks` RLE blocks of `size` bytes each: 6 bytes of frame head (magic,
    /// descriptor, 8 MiB window) and 4 per block.
    fn rle_frame(blocks: usize, size: u32) -> Vec<u8> {
        let mut out = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 13 << 3];
        for i in 0..blocks {
            let header = u32::from(i + 1 == blocks) | 1 << 1 | size << 3;
            out.extend_from_slice(&header.to_le_bytes()[..3]);
            out.push(7);
        }
        out
    }

    #[test]
    fn inflate_bound_is_reached_by_rle_blocks_and_a_larger_block_is_corrupt() {
        for blocks in [1, 3] {
            let frame = rle_frame(blocks, 128 << 10);
            let out = zstd::decode_all(&frame[..]).unwrap();
            assert_eq!(out.len() as u64, inflate_bound(frame.len() as u64, 1));
            // One byte less can give one block less.
            let fewer = inflate_bound(frame.len() as u64 - 1, 1);
            assert_eq!(fewer, out.len() as u64 - (128 << 10));
        }
        // libzstd refuses a block of more than 128 KiB, so the bound holds.
        assert!(zstd::decode_all(&rle_frame(1, (128 << 10) + 1)[..]).is_err());
        assert_eq!(inflate_bound(9, 1), 0);
        assert_eq!(inflate_bound(9, 2), 0);
        assert_eq!(inflate_bound(u64::MAX, 3), u64::MAX);
    }

    #[test]
    fn zstd_bound_leaves_room_for_incompressible_data_and_never_overflows() {
        // xorshift bytes: zstd cannot shrink them, so its frame is larger than the data.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let data: Vec<u8> = (0..200_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        let once = zstd::encode_all(&data[..], 3).unwrap();
        assert!(once.len() > data.len(), "incompressible");
        assert!(once.len() as u64 <= zstd_bound(data.len() as u64));
        assert_eq!(zstd_bound(u64::MAX), u64::MAX);
    }
}
