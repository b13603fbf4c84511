//! Offline resharding: a checkpoint saved at one world size and wrapping rewritten for
//! another, streaming block by block, without a process group and with memory bounded by two
//! checksum blocks whatever the model size.

use super::container::{self, Entry};
use super::load::Reader;
use super::manifest::{
    commit_text, read_manifest, FileRecord, Manifest, ParamRecord, Piece, StoredValue,
    CHECKSUM_BLOCK, MANIFEST,
};
use super::save::{CrashPoint, SaveOptions};
use super::{install, sync_dir, COMMIT};
use crate::error::{Error, Result};
use crate::flat_param::{ModelLayout, Ownership, ShardPiece};
use crate::model::WrapPolicy;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

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
/// `None`) into `dst`, committed atomically like a save. Every block read is verified.
/// Returns the tensor bytes copied.
///
/// The resharded checkpoint loads into the new layout reading one file per rank; it keeps the
/// saved key order, param groups and key type.
pub fn reshard(
    src: &Path,
    dst: &Path,
    world_size: usize,
    policy: Option<&WrapPolicy>,
    progress: impl FnMut(u64),
) -> Result<u64> {
    reshard_with(
        src,
        dst,
        world_size,
        policy,
        &SaveOptions::default(),
        progress,
    )
}

/// [`reshard`] with save options: [`SaveOptions::crash_at`] stops the rewrite at that point as
/// a crashed process would (the temporary directory is left behind, `dst` is untouched).
pub fn reshard_with(
    src: &Path,
    dst: &Path,
    world_size: usize,
    policy: Option<&WrapPolicy>,
    opts: &SaveOptions,
    mut progress: impl FnMut(u64),
) -> Result<u64> {
    let old = read_manifest(src)?;
    let policy = policy.unwrap_or(&old.policy).clone();
    let layout = ModelLayout::new(&old.model, &policy, world_size)?;
    let tmp = super::save::make_tmp_dir(dst)?;
    let crash_at = |point: CrashPoint| -> Result<()> {
        match opts.crash_at {
            Some(p) if p == point => Err(super::save::crash(point)),
            _ => Ok(()),
        }
    };
    let result = (|| {
        crash_at(CrashPoint::BeforeData)?;
        let mut reader = Reader::new(src, &old, true);
        // Optimizer state records, then model parameter records.
        let n_optim = old.params.len();
        let all: Vec<&ParamRecord> = old.params.iter().chain(&old.model_params).collect();
        // Target parameter index of each record, checked once.
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
        let mut new_params: Vec<ParamRecord> = all
            .iter()
            .map(|r| ParamRecord {
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
            })
            .collect();
        let mut files = Vec::with_capacity(world_size);
        let mut copied = 0u64;
        let mut block = Vec::new();
        for rank in 0..world_size {
            // (record, state, start, len) of every piece this rank's file holds, in file order.
            let mut wanted = Vec::new();
            let mut entries = Vec::new();
            for (ri, rec) in all.iter().enumerate() {
                let Some((start, len)) = range_of(&layout, params[ri], rank) else {
                    continue;
                };
                for (si, (n, v)) in rec.states.iter().enumerate() {
                    if let StoredValue::Tensor { dtype, .. } = v {
                        let section = if ri >= n_optim {
                            super::save::MODEL_ENTRY_PREFIX
                        } else {
                            ""
                        };
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
            let mut meta = BTreeMap::new();
            meta.insert("format".to_string(), super::FORMAT.to_string());
            meta.insert("rank".to_string(), rank.to_string());
            let (header, offsets) = container::header(&entries, &meta)?;
            let name = format!("rank{rank}.safetensors");
            let path = tmp.join(&name);
            let file = File::create(&path).map_err(Error::io("creating", &path))?;
            let mut out = BufWriter::with_capacity(1 << 20, file);
            out.write_all(&header)
                .map_err(Error::io("writing", &path))?;
            let mut writeback = super::Writeback::new(0);
            let file_total: u64 = entries.iter().map(|e| e.nbytes).sum();
            let mut file_copied = 0u64;
            for (&(ri, si, start, len), &offset) in wanted.iter().zip(&offsets) {
                let rec = all[ri];
                let (n, v) = &rec.states[si];
                let StoredValue::Tensor { dtype, pieces, .. } = v else {
                    unreachable!("only tensor states are wanted")
                };
                let size = dtype.size();
                let what = format!("{}/{n}", rec.name);
                // Chunks end where a stored block or a new block ends, so each is read (in
                // place when it is a whole stored block) and checked once; the new blocks'
                // checksums accumulate over their chunks.
                let elems_per_block = CHECKSUM_BLOCK / size;
                let mut crcs = Vec::new();
                let mut crc = 0u32;
                let mut at = start;
                while at < start + len {
                    let new_block_end = (start
                        + ((at - start) / elems_per_block + 1) * elems_per_block)
                        .min(start + len);
                    let take = Reader::block_end(pieces, size, at, new_block_end) - at;
                    block.resize(take * size, 0);
                    reader.read_range(&what, pieces, size, at, &mut block)?;
                    crc = crc32c::crc32c_append(crc, &block);
                    out.write_all(&block).map_err(Error::io("writing", &path))?;
                    writeback.wrote(out.get_ref(), block.len() as u64);
                    at += take;
                    if at == new_block_end {
                        crcs.push(crc);
                        crc = 0;
                    }
                    copied += block.len() as u64;
                    progress(copied);
                    file_copied += block.len() as u64;
                    if rank == 0 && file_copied * 2 >= file_total {
                        out.flush().map_err(Error::io("writing", &path))?;
                        crash_at(CrashPoint::MidFile)?;
                    }
                }
                if let StoredValue::Tensor { pieces, .. } = &mut new_params[ri].states[si].1 {
                    pieces.push(Piece {
                        file: rank,
                        start,
                        len,
                        offset,
                        crc32c: crcs,
                    });
                }
            }
            let file = out
                .into_inner()
                .map_err(|e| Error::io("writing", &path)(e.into_error()))?;
            file.sync_all().map_err(Error::io("syncing", &path))?;
            let len = file.metadata().map_err(Error::io("reading", &path))?.len();
            files.push(FileRecord {
                name,
                len,
                header_len: header.len() as u64,
                header_crc32c: crc32c::crc32c(&header),
            });
        }
        for rec in &mut new_params {
            for (_, v) in &mut rec.states {
                if let StoredValue::Tensor { pieces, .. } = v {
                    pieces.sort_by_key(|p| p.start);
                }
            }
        }
        crash_at(CrashPoint::BeforeManifest)?;
        let model_params = new_params.split_off(n_optim);
        let manifest = Manifest {
            policy,
            world_size,
            files,
            params: new_params,
            model_params,
            ..old.clone()
        };
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Serialization {
            what: "checkpoint manifest".into(),
            reason: e.to_string(),
        })?;
        super::save::write_synced(&tmp.join(MANIFEST), &bytes)?;
        crash_at(CrashPoint::BeforeCommit)?;
        super::save::write_synced(&tmp.join(COMMIT), commit_text(&bytes).as_bytes())?;
        sync_dir(&tmp)?;
        manifest.check(&tmp)?;
        Ok(copied)
    })();
    match result {
        Ok(copied) => {
            install(&tmp, dst)?;
            Ok(copied)
        }
        Err(e) => {
            if opts.crash_at.is_none() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            Err(e)
        }
    }
}
