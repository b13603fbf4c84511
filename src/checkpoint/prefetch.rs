//! Read-ahead for loading: which byte ranges a rank will read (pure planning), and a thread
//! that asks the kernel to fetch them (`POSIX_FADV_WILLNEED`) a bounded window ahead of the
//! reader, so the disk works while the reader checksums and copies.
//!
//! A rank's reads jump between states, members and files, which the kernel's own sequential
//! read-ahead does not follow: without this, every block read waits for the disk.

use super::manifest::{ParamRecord, StoredValue, CHECKSUM_BLOCK};
use crate::flat_param::{ModelLayout, ShardPiece};
use crate::optim_state::keys::Resolved;
use crate::storage::DataFile;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// How far (in bytes) the read-ahead may run ahead of what the reader has consumed.
pub(super) const WINDOW: u64 = 64 << 20;

/// Largest single read-ahead request.
const REQUEST: u64 = 8 << 20;

/// A byte range of a data file: (file index, offset, length).
pub(super) type Range = (usize, u64, u64);

/// The byte ranges rank `rank` of `layout` reads when loading `records` (target parameter
/// index → its record), in the order the loader reads them ([`ModelLayout::model_order`]:
/// per parameter or flat parameter, per state, per member piece), widened to whole checksum
/// blocks and with adjacent ranges merged.
pub(super) fn planned_reads(
    layout: &ModelLayout,
    rank: usize,
    records: &HashMap<usize, &ParamRecord>,
) -> Vec<Range> {
    let mut out: Vec<Range> = Vec::new();
    let mut push = |v: &StoredValue, start: usize, len: usize| {
        let StoredValue::Tensor { dtype, pieces, .. } = v else {
            return;
        };
        let size = dtype.size();
        let end = start + len;
        let first = pieces.partition_point(|p| p.start + p.len <= start);
        for p in &pieces[first..] {
            let (lo, hi) = (start.max(p.start), end.min(p.start + p.len));
            if lo >= hi {
                break;
            }
            let block = CHECKSUM_BLOCK as u64;
            let piece_bytes = (p.len * size) as u64;
            let b_lo = ((lo - p.start) * size) as u64 / block * block;
            let b_hi = (((hi - p.start) * size) as u64)
                .div_ceil(block)
                .saturating_mul(block)
                .min(piece_bytes);
            let range = (p.file, p.offset + b_lo, b_hi - b_lo);
            match out.last_mut() {
                Some(last) if last.0 == range.0 && last.1 + last.2 == range.1 => last.2 += range.2,
                Some(last) if *last == range => {}
                _ => out.push(range),
            }
        }
    };
    for r in layout.model_order() {
        match r {
            Resolved::Flat(f) => {
                let fl = &layout.flat_params[f];
                let recs: Vec<Option<&ParamRecord>> = fl
                    .members
                    .iter()
                    .map(|m| records.get(&m.param_index).copied())
                    .collect();
                let Some(names) = recs.iter().flatten().next().map(|r| &r.states) else {
                    continue;
                };
                let pieces = fl.shard_pieces(rank);
                for (name, _) in names {
                    for piece in &pieces {
                        let ShardPiece::Member { member, start, len } = *piece else {
                            continue;
                        };
                        let state =
                            recs[member].and_then(|r| r.states.iter().find(|(n, _)| n == name));
                        if let Some((_, v)) = state {
                            push(v, start, len);
                        }
                    }
                }
            }
            Resolved::Orig { param, owner } => {
                let Some(rec) = records.get(&param) else {
                    continue;
                };
                let numel = layout.model.params[param].numel();
                let (start, len) = match owner {
                    Some((f, m)) if layout.flat_params[f].sharded => {
                        let info = layout.flat_params[f].shard(rank).params[m];
                        if !info.in_shard {
                            continue;
                        }
                        (info.intra_param_start_idx, info.numel_in_shard)
                    }
                    _ => (0, numel),
                };
                for (_, v) in &rec.states {
                    push(v, start, len);
                }
            }
        }
    }
    out
}

/// Runs `work` while a thread reads `ranges` of the data files `names` (inside `dir`) ahead,
/// staying at most [`WINDOW`] bytes ahead of `consumed` (bytes the reader has read so far).
/// Read-ahead is advice: failures are ignored, and the reader checks everything it reads.
/// With `direct` (the reader opens the files with `O_DIRECT`), files that accept `O_DIRECT`
/// are skipped: direct reads do not use the page cache, so fetching into it would read the
/// bytes twice; files whose file system refuses it (read through the page cache) are still
/// read ahead.
pub(super) fn with_read_ahead<R>(
    dir: &Path,
    names: &[String],
    ranges: Vec<Range>,
    consumed: &AtomicU64,
    direct: bool,
    work: impl FnOnce() -> R,
) -> R {
    if ranges.is_empty() || !cfg!(target_os = "linux") {
        return work();
    }
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let stop2 = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("fsdp-read-ahead".into())
            .spawn_scoped(s, move || {
                read_ahead(dir, names, &ranges, consumed, direct, &stop2)
            });
        let out = work();
        stop.store(true, Ordering::Relaxed);
        if let Ok(h) = spawned {
            let _ = h.join();
        }
        out
    })
}

fn read_ahead(
    dir: &Path,
    names: &[String],
    ranges: &[Range],
    consumed: &AtomicU64,
    direct: bool,
    stop: &AtomicBool,
) {
    // Per file: not opened yet, opened (`None`: unreadable or read directly, skipped).
    let mut files: Vec<Option<Option<DataFile>>> = (0..names.len()).map(|_| None).collect();
    let mut issued = 0u64;
    for &(file, offset, len) in ranges {
        let mut at = 0;
        while at < len {
            // Wait until the reader is within the window.
            while issued > consumed.load(Ordering::Relaxed) + WINDOW {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let n = (len - at).min(REQUEST);
            let Some(slot) = files.get_mut(file) else {
                return;
            };
            let opened = slot.get_or_insert_with(|| {
                DataFile::open(&dir.join(&names[file]), direct)
                    .ok()
                    .filter(|f| !f.is_direct())
            });
            if let Some(f) = opened {
                crate::storage::will_need_pages(f.file(), offset + at, n);
            }
            at += n;
            issued += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::manifest::Piece;
    use crate::model::{ModelDesc, WrapPolicy};
    use crate::tensor::DType;

    fn stored(file: usize, offset: u64, len: usize) -> StoredValue {
        StoredValue::Tensor {
            dtype: DType::F32,
            shape: vec![len],
            pieces: vec![Piece {
                file,
                start: 0,
                len,
                offset,
                crc32c: vec![0],
            }],
        }
    }

    #[test]
    fn each_rank_plans_the_pieces_its_shard_overlaps_in_read_order_merging_neighbours() {
        // One unit holding `a` (6 elements) and `b` (4): at world size 2, rank 0's shard is
        // a[0..5], rank 1's a[5..6] + b[0..4].
        let model = ModelDesc::new()
            .param("a", &[6], DType::F32)
            .param("b", &[4], DType::F32);
        let layout = ModelLayout::new(&model, &WrapPolicy::units(&[""]), 2).unwrap();
        // `a`'s two states lie back to back in file 0; `b`'s in file 1, apart.
        let a = ParamRecord {
            name: "a".into(),
            states: vec![
                ("exp_avg".into(), stored(0, 100, 6)),
                ("exp_avg_sq".into(), stored(0, 124, 6)),
            ],
        };
        let b = ParamRecord {
            name: "b".into(),
            states: vec![
                ("exp_avg".into(), stored(1, 200, 4)),
                ("exp_avg_sq".into(), stored(1, 300, 4)),
            ],
        };
        let records: HashMap<usize, &ParamRecord> = [(0, &a), (1, &b)].into_iter().collect();
        // Pieces are smaller than a checksum block, so each is read whole.
        assert_eq!(planned_reads(&layout, 0, &records), [(0, 100, 48)]);
        assert_eq!(
            planned_reads(&layout, 1, &records),
            [(0, 100, 24), (1, 200, 16), (0, 124, 24), (1, 300, 16)]
        );
        // A rank of a layout whose parameters have no records plans nothing.
        assert!(planned_reads(&layout, 1, &HashMap::new()).is_empty());
    }

    #[test]
    fn read_ahead_of_missing_files_is_harmless_and_work_still_runs() {
        let consumed = AtomicU64::new(0);
        let out = with_read_ahead(
            Path::new("/nonexistent-fsdp-dir"),
            &["rank0.safetensors".to_string()],
            vec![(0, 0, 3 * REQUEST), (5, 0, 10)],
            &consumed,
            false,
            || 42,
        );
        assert_eq!(out, 42);
    }
}
