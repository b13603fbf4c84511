//! Loading a sharded checkpoint into any layout: each rank reads only the byte ranges that
//! overlap its shards, verifying the checksum blocks it touches.

use super::manifest::{
    read_manifest, Manifest, ParamRecord, Piece, StoredValue, CHECKSUM_BLOCK, MODEL_PARAM_STATE,
};
use super::prefetch;
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, ModelLayout, Ownership, ShardPiece};
use crate::optim_state::flatten::{flatten_from_source, ShardSource};
use crate::optim_state::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::storage::{Bounce, DataFile};
use crate::tensor::{DType, HostTensor, Tensor};
use indexmap::IndexMap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Options of [`load`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LoadOptions {
    /// Check the CRC-32C of every block read (default `true`).
    pub verify: bool,
    /// Have a thread ask the kernel for the rank's next byte ranges (64 MiB ahead) while the
    /// reader copies and checksums, so the disk works meanwhile (default `true`; see
    /// BENCHMARKS.md for its measured gain). Off, every block read waits for the disk.
    /// Direct reads skip it (they do not go through the page cache it fills).
    pub read_ahead: bool,
    /// Read the data files with `O_DIRECT` (Linux), bypassing the page cache: less CPU per
    /// byte, and nothing of the checkpoint left cached. Pieces need no alignment (aligned
    /// ranges are read through a bounce buffer), and a file system that refuses `O_DIRECT` is
    /// read through the page cache instead, silently. Default: `FSDP_DIRECT_IO=1` or `0` when
    /// set, else off (BENCHMARKS.md, "Direct reads", has the measurement behind that).
    pub direct_io: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            verify: true,
            read_ahead: true,
            direct_io: crate::storage::direct_io_default(),
        }
    }
}

/// Setters for building options outside the crate (`LoadOptions::default().verify(false)`);
/// the struct is `#[non_exhaustive]` so that options can be added without breaking callers.
impl LoadOptions {
    /// Sets [`LoadOptions::verify`].
    pub fn verify(mut self, on: bool) -> Self {
        self.verify = on;
        self
    }
    /// Sets [`LoadOptions::read_ahead`].
    pub fn read_ahead(mut self, on: bool) -> Self {
        self.read_ahead = on;
        self
    }
    /// Sets [`LoadOptions::direct_io`].
    pub fn direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }
}

/// Reads byte ranges of a checkpoint's data files.
pub(super) struct Reader<'m> {
    dir: PathBuf,
    manifest: &'m Manifest,
    files: Vec<Option<DataFile>>,
    verify: bool,
    /// Open the data files with `O_DIRECT` ([`LoadOptions::direct_io`]).
    direct: bool,
    /// The aligned buffer direct reads go through.
    bounce: Bounce,
    /// The last checksum block read and verified, whole.
    scratch: Vec<u8>,
    /// Which block `scratch` holds: (file, byte offset of its piece, block index). Ranges that
    /// straddle block boundaries (a consolidation chunk, a shard boundary) then read and check
    /// each block once, not once per range that touches it.
    cached: Option<(usize, u64, usize)>,
    /// Bytes read from the data files so far (the read-ahead paces itself by it).
    consumed: Arc<AtomicU64>,
    /// With drop-behind (offline streams, which read every byte once), what this reader has
    /// read of each data file, by index.
    drop_behind: Option<crate::storage::DropBehind<usize>>,
}

impl<'m> Reader<'m> {
    /// A reader of the checkpoint `dir` described by `manifest`, checking checksums when
    /// `verify`, reading directly or not as [`crate::storage::direct_io_default`] says.
    pub(super) fn new(dir: &Path, manifest: &'m Manifest, verify: bool) -> Self {
        Reader {
            dir: dir.to_path_buf(),
            manifest,
            files: (0..manifest.files.len()).map(|_| None).collect(),
            verify,
            direct: crate::storage::direct_io_default(),
            bounce: Bounce::default(),
            scratch: Vec::new(),
            cached: None,
            consumed: Arc::new(AtomicU64::new(0)),
            drop_behind: None,
        }
    }

    /// This reader, with `O_DIRECT` reads or without ([`LoadOptions::direct_io`]).
    pub(super) fn direct_io(mut self, on: bool) -> Self {
        self.direct = on;
        self
    }

    /// This reader, dropping the pages it has read from the page cache
    /// ([`crate::storage::DropBehind`]): for offline streams that read each byte once.
    pub(super) fn dropping_behind(mut self) -> Self {
        self.drop_behind = Some(Default::default());
        self
    }

    fn corrupt(&self, file: usize, tensor: &str, reason: String) -> Error {
        Error::CheckpointCorrupt {
            file: self
                .dir
                .join(&self.manifest.files[file].name)
                .display()
                .to_string(),
            rank: file,
            tensor: tensor.to_string(),
            reason,
        }
    }

    /// Opens data file `i`, checking its length and header checksum once.
    fn file(&mut self, i: usize, tensor: &str) -> Result<()> {
        if self.files[i].is_none() {
            let rec = &self.manifest.files[i];
            let path = self.dir.join(&rec.name);
            let mut f = DataFile::open(&path, self.direct)
                .map_err(|e| self.corrupt(i, tensor, format!("cannot open: {e}")))?;
            let len = f
                .file()
                .metadata()
                .map_err(|e| self.corrupt(i, tensor, format!("cannot stat: {e}")))?
                .len();
            if len != rec.len {
                return Err(self.corrupt(
                    i,
                    tensor,
                    format!(
                        "the file has {len} bytes, the manifest says {} (truncated or replaced)",
                        rec.len
                    ),
                ));
            }
            if self.verify {
                let mut header = vec![0u8; usize::try_from(rec.header_len).unwrap_or(0)];
                f.read_exact_at(&mut header, 0, &mut self.bounce)
                    .map_err(|e| self.corrupt(i, tensor, format!("cannot read the header: {e}")))?;
                if crc32c::crc32c(&header) != rec.header_crc32c {
                    return Err(self.corrupt(
                        i,
                        tensor,
                        "the safetensors header fails its checksum".into(),
                    ));
                }
                if let Some(dropper) = self.drop_behind.as_mut().filter(|_| !f.is_direct()) {
                    // The data follows the header: one run from byte 0.
                    dropper.read(i, f.file(), 0, rec.header_len);
                }
            }
            self.files[i] = Some(f);
        }
        Ok(())
    }

    /// Reads elements `[start, start + dst.len() / size)` of a tensor state stored as
    /// `pieces` (of `size`-byte elements) into `dst`.
    pub(super) fn read_range(
        &mut self,
        tensor: &str,
        pieces: &[Piece],
        size: usize,
        start: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        let end = start + dst.len() / size;
        let first = pieces.partition_point(|p| p.start + p.len <= start);
        let mut at = start;
        for p in &pieces[first..] {
            if at >= end {
                break;
            }
            let (lo, hi) = (at.max(p.start), end.min(p.start + p.len));
            if lo >= hi {
                continue;
            }
            let out = &mut dst[(lo - start) * size..(hi - start) * size];
            self.read_piece(tensor, p, p.len * size, (lo - p.start) * size, out)?;
            at = hi;
        }
        if at != end {
            return Err(self.corrupt(
                pieces.first().map_or(0, |p| p.file),
                tensor,
                format!("elements {at}..{end} are in no piece"),
            ));
        }
        Ok(())
    }

    /// The end (exclusive, in elements) of the stored checksum block holding element `at` of a
    /// tensor state stored as `pieces` (of `size`-byte elements), capped at `end`: streaming
    /// chunks cut there are whole stored blocks, read in place.
    pub(super) fn block_end(pieces: &[Piece], size: usize, at: usize, end: usize) -> usize {
        let i = pieces.partition_point(|p| p.start + p.len <= at);
        let Some(p) = pieces.get(i).filter(|p| p.start <= at) else {
            return end;
        };
        let per_block = (CHECKSUM_BLOCK / size).max(1);
        let next = p.start + ((at - p.start) / per_block + 1) * per_block;
        next.min(p.start + p.len).min(end)
    }

    /// Reads `out.len()` bytes of piece `p` (`piece_bytes` long) from its byte `byte_lo`; with
    /// verification, whole checksum blocks are read and checked: a block inside the wanted
    /// range straight into `out`, one that is only partly wanted into the scratch block (kept
    /// for the next read, which often wants the rest of it) and the wanted part copied.
    fn read_piece(
        &mut self,
        tensor: &str,
        p: &Piece,
        piece_bytes: usize,
        byte_lo: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let fi = p.file;
        self.file(fi, tensor)?;
        let Reader {
            files,
            verify,
            bounce,
            scratch,
            cached,
            consumed,
            drop_behind,
            ..
        } = self;
        let Some(f) = files[fi].as_mut() else {
            return Err(Error::Internal(format!(
                "data file {fi} not open after opening"
            )));
        };
        let read_err = |what: String, e: std::io::Error| format!("cannot read {what}: {e}");
        let result: std::result::Result<(), String> = if !*verify {
            let at = p.offset + byte_lo as u64;
            consumed.fetch_add(out.len() as u64, Ordering::Relaxed);
            f.read_exact_at(out, at, bounce)
                .map_err(|e| read_err(format!("{} bytes at {at}", out.len()), e))
        } else {
            let byte_hi = byte_lo + out.len();
            let mut b = byte_lo / CHECKSUM_BLOCK;
            let mut result = Ok(());
            while b * CHECKSUM_BLOCK < byte_hi {
                let blo = b * CHECKSUM_BLOCK;
                let bhi = (blo + CHECKSUM_BLOCK).min(piece_bytes);
                let at = p.offset + blo as u64;
                if blo >= byte_lo && bhi <= byte_hi && *cached != Some((fi, p.offset, b)) {
                    // A whole block wanted: read and check it in place, no copy.
                    let dst = &mut out[blo - byte_lo..bhi - byte_lo];
                    consumed.fetch_add(dst.len() as u64, Ordering::Relaxed);
                    if let Err(e) = f.read_exact_at(dst, at, bounce) {
                        result = Err(read_err(
                            format!("block {b} ({} bytes at {at})", bhi - blo),
                            e,
                        ));
                        break;
                    }
                    if p.crc32c.get(b).copied() != Some(crc32c::crc32c(dst)) {
                        result = Err(format!(
                            "block {b} of the piece at byte {} fails its checksum (bit rot or a partial write)",
                            p.offset
                        ));
                        break;
                    }
                    b += 1;
                    continue;
                }
                if *cached != Some((fi, p.offset, b)) {
                    *cached = None;
                    scratch.resize(bhi - blo, 0);
                    consumed.fetch_add(scratch.len() as u64, Ordering::Relaxed);
                    if let Err(e) = f.read_exact_at(scratch, at, bounce) {
                        result = Err(read_err(
                            format!("block {b} ({} bytes at {at})", bhi - blo),
                            e,
                        ));
                        break;
                    }
                    if p.crc32c.get(b).copied() != Some(crc32c::crc32c(scratch)) {
                        result = Err(format!(
                            "block {b} of the piece at byte {} fails its checksum (bit rot or a partial write)",
                            p.offset
                        ));
                        break;
                    }
                    *cached = Some((fi, p.offset, b));
                }
                let (lo, hi) = (blo.max(byte_lo), bhi.min(byte_hi));
                out[lo - byte_lo..hi - byte_lo].copy_from_slice(&scratch[lo - blo..hi - blo]);
                b += 1;
            }
            result
        };
        // Direct reads leave nothing cached to drop.
        if let (Ok(()), Some(dropper)) = (&result, drop_behind.as_mut().filter(|_| !f.is_direct()))
        {
            // What was read: the checksum blocks around the range (or, unverified, the bytes).
            let (lo, hi) = if *verify {
                let lo = byte_lo / CHECKSUM_BLOCK * CHECKSUM_BLOCK;
                let hi = (byte_lo + out.len()).div_ceil(CHECKSUM_BLOCK) * CHECKSUM_BLOCK;
                (lo, hi.min(piece_bytes))
            } else {
                (byte_lo, byte_lo + out.len())
            };
            dropper.read(fi, f.file(), p.offset + lo as u64, p.offset + hi as u64);
        }
        result.map_err(|reason| self.corrupt(fi, tensor, reason))
    }

    /// A whole tensor state as a tensor of `shape` (a 1-D range when `range` is given).
    fn tensor(
        &mut self,
        tensor: &str,
        dtype: DType,
        shape: &[usize],
        pieces: &[Piece],
        start: usize,
    ) -> Result<HostTensor> {
        let size = dtype.size();
        HostTensor::filled_by_reads(dtype, shape, |dst| {
            self.read_range(tensor, pieces, size, start, dst)
        })
    }
}

/// What the loading source needs of the manifest, indexed by the target layout.
struct CheckpointSource<'m> {
    reader: Reader<'m>,
    /// Target parameter index → the record of its state.
    records: HashMap<usize, &'m ParamRecord>,
    rank: usize,
}

impl Drop for Reader<'_> {
    /// A dropping-behind reader leaves at most the partial folios between its runs cached.
    fn drop(&mut self) {
        if let Some(dropper) = self.drop_behind.as_mut() {
            for (i, f) in self.files.iter().enumerate() {
                if let Some(f) = f.as_ref().filter(|f| !f.is_direct()) {
                    dropper.finish(&i, f.file());
                }
            }
        }
    }
}

fn present(v: &StoredValue) -> bool {
    !matches!(v, StoredValue::Value(Value::None))
}

impl<'m> CheckpointSource<'m> {
    fn record(&self, param: usize) -> Option<&'m ParamRecord> {
        self.records.get(&param).copied()
    }
}

impl<T: Tensor> ShardSource<T> for CheckpointSource<'_> {
    fn flat_param(&mut self, layout: &ModelLayout, f: usize) -> Result<Option<ParamState<T>>> {
        let fl = &layout.flat_params[f];
        let records: Vec<Option<&ParamRecord>> = fl
            .members
            .iter()
            .map(|m| self.record(m.param_index))
            .collect();
        if records.iter().all(Option::is_none) {
            return Ok(None);
        }
        let names = fl.fqns();
        let mut out = ParamState::new();
        for sname in state_order(&records, &names)? {
            // Each member's stored value of this state (`None`: no value stored).
            let values: Vec<Option<&StoredValue>> = records
                .iter()
                .map(|r| {
                    r.and_then(|r| r.states.iter().find(|(n, _)| *n == sname))
                        .map(|(_, v)| v)
                        .filter(|v| present(v))
                })
                .collect();
            let non_none: Vec<&StoredValue> = values.iter().flatten().copied().collect();
            let tensors = non_none
                .iter()
                .filter(|v| matches!(v, StoredValue::Tensor { .. }))
                .count();
            let value = if non_none.is_empty() {
                Value::None
            } else if tensors == non_none.len() {
                let dtype = tensor_state_dtype(fl, &sname, &names, &values, &non_none)?;
                Value::Tensor(T::from_host(self.flat_shard(fl, &sname, dtype, &values)?)?)
            } else if tensors == 0 {
                scalar_state(&sname, &names, &values, &non_none)?
                    .try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?
            } else {
                return Err(Error::DifferingStateTypes {
                    state: sname,
                    params: names,
                    kinds: state_kinds(&values),
                });
            };
            out.insert(sname, value);
        }
        Ok(Some(out))
    }

    fn orig_param(
        &mut self,
        layout: &ModelLayout,
        param: usize,
        owner: Option<(usize, usize)>,
    ) -> Result<Option<ParamState<T>>> {
        let Some(rec) = self.record(param) else {
            return Ok(None);
        };
        let range = match owner {
            Some((f, m)) if layout.flat_params[f].sharded => {
                let info = layout.flat_params[f].shard(self.rank).params[m];
                if !info.in_shard {
                    return Ok(None);
                }
                Some((info.intra_param_start_idx, info.numel_in_shard))
            }
            _ => None,
        };
        let mut out = ParamState::new();
        for (n, v) in &rec.states {
            let value = match v {
                StoredValue::Value(v) => {
                    v.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?
                }
                StoredValue::Tensor {
                    dtype,
                    shape,
                    pieces,
                } => {
                    let what = format!("{}/{n}", rec.name);
                    let t = match range {
                        Some((start, len)) => {
                            self.reader.tensor(&what, *dtype, &[len], pieces, start)?
                        }
                        None => self.reader.tensor(&what, *dtype, shape, pieces, 0)?,
                    };
                    Value::Tensor(T::from_host(t)?)
                }
            };
            out.insert(n.clone(), value);
        }
        Ok(Some(out))
    }
}

impl CheckpointSource<'_> {
    /// Runs `work` on this source while a thread reads this rank's ranges ahead (see
    /// [`super::prefetch`]); without read-ahead (`on` false), just runs it.
    fn with_read_ahead<R>(
        &mut self,
        layout: &ModelLayout,
        on: bool,
        work: impl FnOnce(&mut Self) -> R,
    ) -> R {
        if !on {
            return work(self);
        }
        let ranges = prefetch::planned_reads(layout, self.rank, &self.records);
        let names: Vec<String> = self
            .reader
            .manifest
            .files
            .iter()
            .map(|f| f.name.clone())
            .collect();
        let consumed = self.reader.consumed.clone();
        let dir = self.reader.dir.clone();
        let direct = self.reader.direct;
        prefetch::with_read_ahead(&dir, &names, ranges, &consumed, direct, || work(self))
    }

    /// This rank's padded shard of tensor state `sname` of flat parameter `fl`: member ranges
    /// read from the files, zeros for padding and members without the state.
    fn flat_shard(
        &mut self,
        fl: &FlatParamLayout,
        sname: &str,
        dtype: DType,
        values: &[Option<&StoredValue>],
    ) -> Result<HostTensor> {
        let size = dtype.size();
        let pieces = fl.shard_pieces(self.rank);
        let reader = &mut self.reader;
        HostTensor::filled_by_reads(dtype, &[fl.shard_numel()], |dst| {
            let mut pos = 0;
            for piece in &pieces {
                let (len, member) = match *piece {
                    ShardPiece::Padding(len) => (len, None),
                    ShardPiece::Member { member, start, len } => (len, Some((member, start))),
                };
                let out = &mut dst[pos * size..(pos + len) * size];
                pos += len;
                match member.and_then(|(m, start)| Some((m, start, values[m]?))) {
                    Some((m, start, StoredValue::Tensor { pieces, .. })) => {
                        let what = format!("{}/{sname}", fl.members[m].fqn);
                        reader.read_range(&what, pieces, size, start, out)?;
                    }
                    _ => out.fill(0),
                }
            }
            Ok(())
        })
    }
}

/// Checks that the checkpoint's parameters exist in `layout`'s model with the same shapes, and
/// maps each record to the target parameter index.
fn index_records<'m>(
    dir: &Path,
    manifest: &'m Manifest,
    layout: &ModelLayout,
) -> Result<HashMap<usize, &'m ParamRecord>> {
    let mut out = HashMap::with_capacity(manifest.params.len());
    for rec in &manifest.params {
        let idx = layout
            .param_index(&rec.name)
            .ok_or_else(|| Error::CheckpointMismatch {
                dir: dir.display().to_string(),
                reason: format!(
                    "the checkpoint holds state for `{}`, which the model does not have",
                    rec.name
                ),
            })?;
        let want = &layout.model.params[idx].shape;
        for (n, v) in &rec.states {
            if let StoredValue::Tensor { shape, .. } = v {
                if shape != want {
                    return Err(Error::ShapeMismatch {
                        context: format!(
                            "state `{n}` of `{}` in checkpoint `{}`",
                            rec.name,
                            dir.display()
                        ),
                        expected: want.clone(),
                        found: shape.clone(),
                    });
                }
            }
        }
        out.insert(idx, rec);
    }
    Ok(out)
}

/// Loads the state for rank `rank` of `layout` (any world size, any wrapping of the same
/// model) and the optimizer described by `params` from the checkpoint in `dir`: the dict that
/// `shard_full_optim_state_dict` would give for the checkpoint's full dict. Reads only the byte
/// ranges of this rank's shards. No communication.
pub fn load<T: Tensor>(
    dir: &Path,
    layout: &ModelLayout,
    rank: usize,
    params: &OptimParams,
    opts: &LoadOptions,
) -> Result<OptimStateDict<T>> {
    let mut manifest = read_manifest(dir)?;
    states_in_consolidated_order(&mut manifest)?;
    let records = index_records(dir, &manifest, layout)?;
    let mut src = CheckpointSource {
        reader: Reader::new(dir, &manifest, opts.verify).direct_io(opts.direct_io),
        records,
        rank,
    };
    let groups: Option<Vec<ParamGroup<T>>> = manifest
        .param_groups
        .as_ref()
        .map(|gs| {
            gs.iter()
                .map(|g| g.try_map(&mut |t: &HostTensor| T::from_host(t.clone())))
                .collect()
        })
        .transpose()?;
    let user = manifest
        .user_state
        .iter()
        .map(|(k, st)| {
            let st = st
                .iter()
                .map(|(n, v)| {
                    Ok((
                        n.clone(),
                        v.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?,
                    ))
                })
                .collect::<Result<ParamState<T>>>()?;
            Ok((k.clone(), st))
        })
        .collect::<Result<Vec<_>>>()?;
    src.with_read_ahead(layout, opts.read_ahead, |src| {
        flatten_from_source(layout, src, groups.as_deref(), user, params)
    })
}

/// Rank `rank`'s parameter tensors for `layout` (any world size and wrapping of the same
/// model) from the checkpoint in `dir`, aligned with the ids of
/// `OptimParams::of_model(&layout)`: a flat shard per flat parameter
/// (padding zero-filled), the local view per original parameter with `use_orig_params`, the
/// whole tensor per unmanaged parameter; `None` for parameters saved without a value. Reads
/// only this rank's byte ranges. Fails with [`Error::CheckpointMismatch`] when the checkpoint
/// holds no parameters (it was saved by `save_optim_checkpoint`).
pub fn load_model_params<T: Tensor>(
    dir: &Path,
    layout: &ModelLayout,
    rank: usize,
    opts: &LoadOptions,
) -> Result<Vec<Option<T>>> {
    let saved = read_manifest(dir)?;
    if saved.model_params.is_empty() {
        return Err(Error::CheckpointMismatch {
            dir: dir.display().to_string(),
            reason: "the checkpoint holds no model parameters (it was saved with \
                     `save_optim_checkpoint`; save with `save_checkpoint` to include them)"
                .into(),
        });
    }
    // The parameters are stored as one state of every parameter: load them as optimizer
    // state of an optimizer over all parameters.
    let manifest = Manifest {
        params: saved.model_params.clone(),
        param_groups: None,
        user_state: Vec::new(),
        model_params: Vec::new(),
        ..saved
    };
    let records = index_records(dir, &manifest, layout)?;
    let mut src = CheckpointSource {
        reader: Reader::new(dir, &manifest, opts.verify).direct_io(opts.direct_io),
        records,
        rank,
    };
    let params = OptimParams::of_model(layout);
    let mut osd: OptimStateDict<T> = src.with_read_ahead(layout, opts.read_ahead, |src| {
        flatten_from_source(layout, src, None, Vec::new(), &params)
    })?;
    let local = layout.local_params(&params)?;
    Ok(local
        .iter()
        .map(|l| {
            osd.state
                .get_mut(&l.key)
                .and_then(|st| st.shift_remove(MODEL_PARAM_STATE))
                .and_then(|v| match v {
                    Value::Tensor(t) => Some(t),
                    _ => None,
                })
        })
        .collect())
}

/// The full (unflattened, name-keyed) dict of the checkpoint in `dir`, as
/// `full_optim_state_dict` returned it when saving. Holds every tensor in memory.
pub fn load_full(dir: &Path, opts: &LoadOptions) -> Result<OptimStateDict> {
    let manifest = read_manifest(dir)?;
    let mut reader = Reader::new(dir, &manifest, opts.verify).direct_io(opts.direct_io);
    let mut state: IndexMap<ParamKey, ParamState> = IndexMap::new();
    let layout = ModelLayout::new(&manifest.model, &manifest.policy, manifest.world_size)?;
    for rec in &manifest.params {
        let mut st = ParamState::new();
        for (n, v) in &rec.states {
            let value = match v {
                StoredValue::Value(v) => v.clone(),
                StoredValue::Tensor {
                    dtype,
                    shape,
                    pieces,
                } => Value::Tensor(reader.tensor(
                    &format!("{}/{n}", rec.name),
                    *dtype,
                    shape,
                    pieces,
                    0,
                )?),
            };
            st.insert(n.clone(), value);
        }
        let managed = layout
            .param_index(&rec.name)
            .is_some_and(|i| layout.ownership[i] != Ownership::Unmanaged);
        if managed {
            st = consolidated_order(st, layout.use_orig_params());
        }
        state.insert(ParamKey::Name(rec.name.clone()), st);
    }
    for (k, st) in &manifest.user_state {
        state.insert(k.clone(), st.clone());
    }
    Ok(OptimStateDict {
        state,
        param_groups: manifest.param_groups.clone(),
    })
}

/// Rank of a state kind in [`consolidated_order`]: (positive-dim tensor, 0-dim tensor,
/// `use_orig_params`) → position class.
fn consolidated_class(pos_dim: bool, zero_dim: bool, orig: bool) -> u8 {
    match (pos_dim, zero_dim, orig) {
        (true, _, false) => 0,
        (false, true, false) => 1,
        (false, false, false) => 2,
        (false, false, true) => 0,
        (false, true, true) => 1,
        (true, _, true) => 2,
    }
}

/// Puts every managed parameter's stored states in the order [`consolidated_order`] gives the
/// full dict (the saving optimizer's order is kept in the manifest), so that a load lists state
/// names as `shard_full_optim_state_dict` of the full dict does.
fn states_in_consolidated_order(manifest: &mut Manifest) -> Result<()> {
    let layout = ModelLayout::new(&manifest.model, &manifest.policy, manifest.world_size)?;
    let orig = layout.use_orig_params();
    for rec in &mut manifest.params {
        let managed = layout
            .param_index(&rec.name)
            .is_some_and(|i| layout.ownership[i] != Ownership::Unmanaged);
        if managed {
            let class = |v: &StoredValue| match v {
                StoredValue::Tensor { .. } => consolidated_class(true, false, orig),
                StoredValue::Value(v) => {
                    consolidated_class(v.is_pos_dim_tensor(), v.is_zero_dim_tensor(), orig)
                }
            };
            rec.states
                .sort_by(|(a, va), (b, vb)| class(va).cmp(&class(vb)).then_with(|| a.cmp(b)));
        }
    }
    Ok(())
}

/// The key order consolidation gives a managed parameter's state (PyTorch's): sorted
/// positive-dim tensor states, then sorted 0-dim states, then sorted plain values; with
/// `use_orig_params`, plain values, 0-dim states, then tensor states, each sorted.
pub(super) fn consolidated_order(st: ParamState, orig: bool) -> ParamState {
    let mut entries: Vec<(String, Value)> = st.into_iter().collect();
    let class = |v: &Value| consolidated_class(v.is_pos_dim_tensor(), v.is_zero_dim_tensor(), orig);
    entries.sort_by(|(a, va), (b, vb)| class(va).cmp(&class(vb)).then_with(|| a.cmp(b)));
    entries.into_iter().collect()
}

/// Verifies the checkpoint in `dir` completely: commit marker, manifest, every file's length
/// and header, and every checksum block of every piece (optimizer state and model
/// parameters). Returns the bytes of tensor data checked.
pub fn verify(dir: &Path) -> Result<u64> {
    let manifest = read_manifest(dir)?;
    let mut reader = Reader::new(dir, &manifest, true).dropping_behind();
    for (i, _) in manifest.files.iter().enumerate() {
        reader.file(i, "(header)")?;
    }
    let mut checked = 0u64;
    let mut buf = Vec::new();
    for (rec, section) in manifest.params.iter().map(|r| (r, "")).chain(
        manifest
            .model_params
            .iter()
            .map(|r| (r, "model parameter ")),
    ) {
        for (n, v) in &rec.states {
            if let StoredValue::Tensor { dtype, pieces, .. } = v {
                let what = format!("{section}{}/{n}", rec.name);
                for p in pieces {
                    // Block by block, so memory stays at one block.
                    let bytes = p.len * dtype.size();
                    let mut lo = 0;
                    while lo < bytes {
                        let hi = (lo + CHECKSUM_BLOCK).min(bytes);
                        buf.resize(hi - lo, 0);
                        reader.read_piece(&what, p, bytes, lo, &mut buf)?;
                        lo = hi;
                    }
                    checked += bytes as u64;
                }
            }
        }
    }
    Ok(checked)
}

/// The state names of a flat parameter's members, in the first stored member's order; every
/// member with state must have the same names (`flatten_flat_param_with`'s check).
fn state_order(records: &[Option<&ParamRecord>], names: &[String]) -> Result<Vec<String>> {
    let sets: Vec<Vec<String>> = records
        .iter()
        .flatten()
        .map(|r| {
            let mut v: Vec<String> = r.states.iter().map(|(n, _)| n.clone()).collect();
            v.sort();
            v
        })
        .collect();
    if sets.windows(2).any(|w| w[0] != w[1]) {
        return Err(Error::DifferingStateNames {
            params: names.to_vec(),
            names: sets,
        });
    }
    Ok(records
        .iter()
        .flatten()
        .next()
        .map(|r| r.states.iter().map(|(n, _)| n.clone()).collect())
        .unwrap_or_default())
}

/// The one dtype of a tensor state across a flat parameter's members; a 0-dim member must
/// hold the state too (it cannot be padded with zeros).
fn tensor_state_dtype(
    fl: &FlatParamLayout,
    state: &str,
    names: &[String],
    values: &[Option<&StoredValue>],
    non_none: &[&StoredValue],
) -> Result<DType> {
    let dtypes: std::collections::BTreeSet<DType> = non_none
        .iter()
        .filter_map(|v| match v {
            StoredValue::Tensor { dtype, .. } => Some(*dtype),
            StoredValue::Value(_) => None,
        })
        .collect();
    let mut it = dtypes.iter();
    let (Some(&dtype), None) = (it.next(), it.next()) else {
        return Err(Error::TensorStateDtypeMismatch {
            state: state.to_string(),
            params: names.to_vec(),
            dtypes: dtypes.iter().map(|d| d.to_string()).collect(),
        });
    };
    for (m, v) in fl.members.iter().zip(values) {
        if v.is_none() && m.shape.is_empty() {
            return Err(Error::ZeroDimParamWithoutState {
                param: m.fqn.clone(),
                state: state.to_string(),
            });
        }
    }
    Ok(dtype)
}

/// A non-tensor state of a flat parameter: every member must hold the same scalar.
fn scalar_state<'v>(
    state: &str,
    names: &[String],
    values: &[Option<&'v StoredValue>],
    non_none: &[&'v StoredValue],
) -> Result<&'v Value<HostTensor>> {
    let StoredValue::Value(first) = non_none[0] else {
        return Err(Error::Internal(
            "scalar_state: a tensor among scalars".into(),
        ));
    };
    let same = non_none.len() == values.len()
        && non_none
            .iter()
            .all(|v| matches!(v, StoredValue::Value(x) if x.same_scalar(first)));
    if !same {
        return Err(Error::ScalarStateMismatch {
            state: state.to_string(),
            params: names.to_vec(),
            values: values
                .iter()
                .map(|v| match v {
                    Some(StoredValue::Value(v)) => v.render(),
                    _ => "missing".into(),
                })
                .collect(),
        });
    }
    Ok(first)
}

/// Each member's stored value of a state, described for an error message.
fn state_kinds(values: &[Option<&StoredValue>]) -> Vec<String> {
    values
        .iter()
        .map(|v| match v {
            None => "missing".to_string(),
            Some(StoredValue::Tensor { shape, dtype, .. }) => format!("tensor {shape:?} ({dtype})"),
            Some(StoredValue::Value(v)) => v.kind(),
        })
        .collect()
}
