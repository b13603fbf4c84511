//! Offline resharding: a checkpoint saved at one world size and wrapping rewritten for
//! another, streaming block by block, without a process group and with memory bounded by two
//! checksum blocks whatever the model size.

use super::load::Reader;
use super::manifest::{
    commit_text, read_manifest, FileRecord, Manifest, ParamRecord, Piece, StoredValue,
    CHECKSUM_BLOCK, MANIFEST,
};
use super::rank_file::{self, RankFile};
use super::save::{CrashPoint, SaveOptions};
use super::{install, sync_dir, COMMIT};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::flat_param::{ModelLayout, Ownership, ShardPiece};
use crate::io::safetensors::header::Entry;
use crate::model::WrapPolicy;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// How many new rank files one pass over the input writes at once (each an open file with a
/// 1 MiB buffer).
const FILES_PER_PASS: usize = 16;

/// The element range of parameter `param` that rank `rank` of `layout` holds, if any.
fn range_of(layout: &ModelLayout, param: usize, rank: usize) -> Option<(usize, usize)> {
    match layout.ownership[param] {
        Ownership::Unmanaged => {
            let numel = layout.model.params[param].numel();
            (rank == 0).then_some((0, numel))
        }
        Ownership::Flat { flat, member } => {
            let fl = &layout.flat_params[flat];
            fl.shard_pieces(rank).into_iter().find_map(|p| match p {
                ShardPiece::Member {
                    member: m,
                    start,
                    len,
                } if m == member && len > 0 => Some((start, len)),
                _ => None,
            })
        }
    }
}

/// Rewrites the checkpoint `src` for `world_size` ranks under `policy` (the saved policy when
/// `None`) into `dst`, committed atomically like a save. Every block read is verified. Reads
/// go through the page cache, or bypass it when `FSDP_DIRECT_IO=1` ([`LoadOptions::direct_io`]).
/// Returns the tensor bytes copied.
///
/// [`LoadOptions::direct_io`]: super::LoadOptions::direct_io
///
/// The job is split across the processes of `pg` (`&Solo` for one process; each process
/// calls it with the same arguments, the paths naming the same directories on every process,
/// e.g. on a shared filesystem): output rank file `r` is written by process
/// `r % pg.world_size()`, which reads only the byte ranges of `src` that file needs; process
/// 0 creates the temporary directory and, once every process reported its files written,
/// writes the manifest and the commit marker and installs the directory. The result is byte
/// for byte the same for any number of processes. A failure on any process (an unreadable
/// input, a full disk) fails every process with the error of the lowest failing one, and
/// `dst` is left as it was. `progress` gets this process's tensor bytes copied so far; the
/// return value is the tensor bytes copied by all of them.
///
/// The resharded checkpoint loads into the new layout reading one file per rank; it keeps the
/// saved key order, param groups and key type.
///
/// ```no_run
/// use fsdp::checkpoint::reshard;
/// use fsdp::collectives::Solo;
/// # fn main() -> fsdp::Result<()> {
/// let copied = reshard("ckpt8".as_ref(), "ckpt4".as_ref(), 4, None, &Solo, |_| {})?;
/// # Ok(()) }
/// ```
pub fn reshard(
    src: &Path,
    dst: &Path,
    world_size: usize,
    policy: Option<&WrapPolicy>,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let opts = SaveOptions::default();
    reshard_with(src, dst, world_size, policy, &opts, pg, progress)
}

/// [`reshard`] with save options (with the feature `fault-injection`, `SaveOptions::crash_at`
/// stops the rewrite at that point as a crashed process would: the temporary directory is
/// left behind, `dst` is untouched).
///
/// `dst` must be missing, an empty directory or a committed checkpoint holding nothing else,
/// and must neither contain nor lie inside `src` ([`crate::storage::check_dir_output`]);
/// otherwise the result is [`Error::OutputRefused`] and nothing is written.
pub fn reshard_with(
    src: &Path,
    dst: &Path,
    world_size: usize,
    policy: Option<&WrapPolicy>,
    opts: &SaveOptions,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    // Planning, on every process: the same inputs give the same plan or the same error.
    let old = pg.agree(read_manifest(src))?;
    let policy = policy.unwrap_or(&old.policy).clone();
    let layout = pg.agree(ModelLayout::new(&old.model, &policy, world_size))?;
    let tmp = pg.on_root(|| super::prepare_output(dst, &[src]))?;
    let job = Reshard::new(src, &old, &layout, opts, progress);
    let discard = |e: Error| {
        if pg.rank() == 0 && !super::save::keeps_tmp(opts) {
            crate::storage::discard_tmp_dir(&tmp);
        }
        e
    };
    let mut job = pg.agree(job).map_err(discard)?;
    // Copying: each process writes its share of the rank files.
    let ranks: Vec<usize> = (pg.rank()..world_size).step_by(pg.world_size()).collect();
    let mine = job
        .crash_at(CrashPoint::BeforeData)
        .and_then(|()| job.write_rank_files(&ranks, &tmp))
        .map(|files| (files, job.copied));
    let all = pg.all_gather_agreed(mine).map_err(discard)?;
    // Commit, on process 0 once all succeeded; every process learns its outcome.
    let copied = all.iter().map(|(_, c)| c).sum::<u64>();
    let mut files: Vec<RankWritten> = all.into_iter().flat_map(|(f, _)| f).collect();
    files.sort_by_key(|w| w.rank);
    pg.on_root(|| {
        job.commit(&tmp, files).map_err(discard)?;
        // A failed install leaves its temporary to the next run's cleanup (it may hold the
        // previous checkpoint moved aside).
        install(&tmp, dst).map(|()| copied)
    })
}

/// One offline reshard in progress: the saved records, where each goes in the new layout,
/// and the new records whose pieces accumulate as the rank files are written.
struct Reshard<'a, P> {
    old: &'a Manifest,
    layout: &'a ModelLayout,
    opts: &'a SaveOptions,
    progress: P,
    /// Optimizer state records, then model parameter records.
    all: Vec<&'a ParamRecord>,
    /// How many of `all` are optimizer state records.
    n_optim: usize,
    /// Target parameter index of each record.
    params: Vec<usize>,
    /// The new records (same states, pieces filled in as they are written).
    new_params: Vec<ParamRecord>,
    reader: Reader<'a>,
    block: Vec<u8>,
    copied: u64,
}

impl<'a, P: FnMut(u64)> Reshard<'a, P> {
    fn new(
        src: &'a Path,
        old: &'a Manifest,
        layout: &'a ModelLayout,
        opts: &'a SaveOptions,
        progress: P,
    ) -> Result<Self> {
        let all: Vec<&ParamRecord> = old.params.iter().chain(&old.model_params).collect();
        let params: Vec<usize> = all
            .iter()
            .map(|r| {
                layout
                    .param_index(&r.name)
                    .ok_or_else(|| Error::CheckpointInvalid {
                        dir: src.display().to_string(),
                        reason: format!("state for `{}`, which the saved model lacks", r.name),
                    })
            })
            .collect::<Result<_>>()?;
        let new_params = all.iter().map(|r| without_pieces(r)).collect();
        Ok(Reshard {
            old,
            layout,
            opts,
            progress,
            n_optim: old.params.len(),
            all,
            params,
            new_params,
            // One pass reads the input front to back (per file), so the reader's own
            // drop-behind follows it; a block split between two new ranks of one pass is
            // read once (the reader keeps the last block), one split between two passes is
            // read again from disk.
            reader: Reader::new(src, old, true).dropping_behind(),
            block: Vec::new(),
            copied: 0,
        })
    }

    fn crash_at(&self, point: CrashPoint) -> Result<()> {
        super::save::crash_point(self.opts, point)
    }

    /// Writes the rank files of `ranks` into `tmp`, [`FILES_PER_PASS`] of them per pass over
    /// the input ([`Reshard::write_pass`]).
    fn write_rank_files(&mut self, ranks: &[usize], tmp: &Path) -> Result<Vec<RankWritten>> {
        let mut files = Vec::with_capacity(ranks.len());
        for pass in ranks.chunks(FILES_PER_PASS) {
            files.extend(self.write_pass(pass, tmp)?);
        }
        Ok(files)
    }

    /// Records the pieces of the written rank files `files` (all of them, in rank order), then
    /// writes the manifest and the commit marker into `tmp`.
    fn commit(&mut self, tmp: &Path, files: Vec<RankWritten>) -> Result<()> {
        let mut records = Vec::with_capacity(files.len());
        for written in files {
            for (ri, si, piece) in written.pieces {
                if let Some((_, StoredValue::Tensor { pieces, .. })) = self
                    .new_params
                    .get_mut(ri)
                    .and_then(|r| r.states.get_mut(si))
                {
                    pieces.push(piece);
                }
            }
            records.push(written.file);
        }
        for rec in &mut self.new_params {
            for (_, v) in &mut rec.states {
                if let StoredValue::Tensor { pieces, .. } = v {
                    pieces.sort_by_key(|p| p.start);
                }
            }
        }
        self.crash_at(CrashPoint::BeforeManifest)?;
        let mut params = std::mem::take(&mut self.new_params);
        let model_params = params.split_off(self.n_optim);
        let manifest = Manifest {
            policy: self.layout.policy.clone(),
            world_size: self.layout.world_size,
            files: records,
            params,
            model_params,
            ..self.old.clone()
        };
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Serialization {
            what: "checkpoint manifest".into(),
            reason: e.to_string(),
        })?;
        super::save::write_synced(&tmp.join(MANIFEST), &bytes)?;
        self.crash_at(CrashPoint::BeforeCommit)?;
        super::save::write_synced(&tmp.join(COMMIT), commit_text(&bytes).as_bytes())?;
        sync_dir(tmp)?;
        manifest.check(tmp)
    }

    /// The pieces rank `rank`'s new file holds, in file order: its entries and (record, state,
    /// start, len) of each.
    fn rank_entries(&self, rank: usize) -> (Vec<Entry>, Vec<Wanted>) {
        let mut wanted = Vec::new();
        let mut entries = Vec::new();
        for (ri, rec) in self.all.iter().enumerate() {
            let Some((start, len)) = range_of(self.layout, self.params[ri], rank) else {
                continue;
            };
            let section = if ri >= self.n_optim {
                super::save::MODEL_ENTRY_PREFIX
            } else {
                ""
            };
            for (si, (n, v)) in rec.states.iter().enumerate() {
                if let StoredValue::Tensor { dtype, .. } = v {
                    entries.push(Entry {
                        name: format!("{section}{}/{n}/{start}", rec.name),
                        dtype: *dtype,
                        shape: vec![len],
                        nbytes: (len * dtype.size()) as u64,
                    });
                    wanted.push((ri, si, start, len));
                }
            }
        }
        (entries, wanted)
    }

    /// Writes the rank files of `ranks` in one pass over the saved records: per tensor state,
    /// the ranges of those ranks one after another, so that the input is read front to back
    /// and a checksum block split between two of the files is read once.
    fn write_pass(&mut self, ranks: &[usize], tmp: &Path) -> Result<Vec<RankWritten>> {
        let mut open = ranks
            .iter()
            .map(|&rank| self.open_rank_file(rank, tmp))
            .collect::<Result<Vec<_>>>()?;
        for ri in 0..self.all.len() {
            for si in 0..self.all[ri].states.len() {
                for f in &mut open {
                    let Some(&(wri, wsi, start, len)) = f.wanted.get(f.pieces.len()) else {
                        continue;
                    };
                    if (wri, wsi) != (ri, si) {
                        continue;
                    }
                    let crc32c = self.copy_piece(&mut f.out, ri, si, start, len)?;
                    let offset = f.offsets[f.pieces.len()];
                    let piece = Piece {
                        file: f.rank,
                        start,
                        len,
                        offset,
                        crc32c,
                    };
                    f.pieces.push((ri, si, piece));
                }
            }
        }
        open.into_iter().map(OpenRankFile::finish).collect()
    }

    /// Creates `rank{rank}.safetensors` in `tmp` and writes its header.
    fn open_rank_file(&self, rank: usize, tmp: &Path) -> Result<OpenRankFile> {
        let (entries, wanted) = self.rank_entries(rank);
        let (header, offsets) = rank_file::header(rank, &entries)?;
        let total = entries.iter().map(|e| e.nbytes).sum();
        let out = RankFile::create(tmp, rank, header, total)?.crashing_mid_file(rank == 0);
        Ok(OpenRankFile {
            rank,
            pieces: Vec::with_capacity(wanted.len()),
            wanted,
            offsets,
            out,
        })
    }

    /// Copies elements `start..start + len` of state `si` of record `ri` into `out`, one
    /// verified block at a time, and returns the new piece's block checksums.
    ///
    /// Chunks end where a stored block or a new block ends, so each is read (in place when it
    /// is a whole stored block) and checked once; the new blocks' checksums accumulate over
    /// their chunks.
    fn copy_piece(
        &mut self,
        out: &mut RankFile,
        ri: usize,
        si: usize,
        start: usize,
        len: usize,
    ) -> Result<Vec<u32>> {
        let rec = self.all[ri];
        let (n, v) = &rec.states[si];
        let StoredValue::Tensor { dtype, pieces, .. } = v else {
            return Ok(Vec::new()); // only tensor states are wanted
        };
        let size = dtype.size();
        let what = format!("{}/{n}", rec.name);
        let elems_per_block = CHECKSUM_BLOCK / size;
        let mut crcs = Vec::new();
        let mut crc = 0u32;
        let mut at = start;
        while at < start + len {
            let new_block_end =
                (start + ((at - start) / elems_per_block + 1) * elems_per_block).min(start + len);
            let take = Reader::block_end(pieces, size, at, new_block_end) - at;
            self.block.resize(take * size, 0);
            self.reader
                .read_range(&what, pieces, size, at, &mut self.block)?;
            crc = crc32c::crc32c_append(crc, &self.block);
            at += take;
            if at == new_block_end {
                crcs.push(crc);
                crc = 0;
            }
            self.copied += self.block.len() as u64;
            (self.progress)(self.copied);
            if out.write(&self.block)? {
                out.flush()?;
                self.crash_at(CrashPoint::MidFile)?;
            }
        }
        Ok(crcs)
    }
}

/// A piece a new rank file holds: (record, state, first element, element count).
type Wanted = (usize, usize, usize, usize);

/// One written rank file: its record and its pieces as (record, state, piece), which the
/// writing process hands to the committing one.
#[derive(Debug, Serialize, Deserialize)]
struct RankWritten {
    /// The output rank the file belongs to.
    rank: usize,
    file: FileRecord,
    pieces: Vec<(usize, usize, Piece)>,
}

/// A rank file open during a pass: what it holds, in file order, and the pieces written.
struct OpenRankFile {
    rank: usize,
    /// The pieces it holds, in file order, and the byte offset of each.
    wanted: Vec<Wanted>,
    offsets: Vec<u64>,
    /// The pieces written so far (the next one to write is `wanted[pieces.len()]`).
    pieces: Vec<(usize, usize, Piece)>,
    out: RankFile,
}

impl OpenRankFile {
    /// Flushes and syncs the file; its record and pieces.
    fn finish(self) -> Result<RankWritten> {
        Ok(RankWritten {
            rank: self.rank,
            file: self.out.finish()?,
            pieces: self.pieces,
        })
    }
}

/// A copy of `r` whose tensor states have no pieces yet.
fn without_pieces(r: &ParamRecord) -> ParamRecord {
    ParamRecord {
        name: r.name.clone(),
        states: r
            .states
            .iter()
            .map(|(n, v)| {
                let v = match v {
                    StoredValue::Tensor { dtype, shape, .. } => StoredValue::Tensor {
                        dtype: *dtype,
                        shape: shape.clone(),
                        pieces: Vec::new(),
                    },
                    other => other.clone(),
                };
                (n.clone(), v)
            })
            .collect(),
    }
}
