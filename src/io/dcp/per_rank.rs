//! DCP directories saved without collectives (`dcp.save(..., use_collectives=False)`): no
//! `.metadata`, but one `__{rank}.metadata` per rank, each describing only the items that rank
//! wrote into its own `__{rank}_{n}.distcp` files. PyTorch can load such a directory only with
//! the same ranks, each reading its own file (`dcp_to_torch_save` reads `__0.metadata` alone
//! and returns the other ranks' rows as uninitialised memory).
//!
//! [`merge`] reads every rank's file and builds the one global [`Metadata`] a collective save
//! would have written: the keys in order of first appearance (rank 0's order, then keys only
//! later ranks hold), each tensor's chunks from all ranks, each storage record from the rank
//! that listed the chunk. The files must be parts of one checkpoint: ranks `0..N` without a
//! gap, every key described alike on every rank holding it (tensor or not, dtype, global
//! shape, `planner_data` path), and every tensor's chunks tiling its shape exactly once. An
//! item several ranks saved (a replicated chunk such as an optimizer `step`, a non-tensor
//! value such as a `param_groups` option) is accepted only when every copy's stored bytes are
//! identical; the lowest rank's copy is read.

use super::files::{confine, metadata_file_in};
use super::metadata::{Chunk, Entry, EntryKind, Metadata, StorageInfo, StorageKey};
use super::plan::{check_tiling, holds_elements};
use crate::error::{Error, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// The rank of a `__{rank}.metadata` name (canonical decimal: `__01.metadata` is no rank's).
pub(crate) fn metadata_rank(name: &str) -> Option<usize> {
    let r = name.strip_prefix("__")?.strip_suffix(".metadata")?;
    canonical_rank(r)
}

/// The rank of a `__{rank}_{n}.distcp` data file name.
fn data_file_rank(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("__")?.strip_suffix(".distcp")?;
    let (rank, n) = rest.split_once('_')?;
    canonical_rank(n)?;
    canonical_rank(rank)
}

fn canonical_rank(s: &str) -> Option<usize> {
    let r: usize = s.parse().ok()?;
    (s.bytes().all(|b| b.is_ascii_digit()) && r.to_string() == s).then_some(r)
}

/// The ranks with a `__{rank}.metadata` in `dir` (sorted), and those of its data files.
fn rank_files(dir: &Path) -> Result<(BTreeSet<usize>, BTreeMap<usize, String>)> {
    let mut ranks = BTreeSet::new();
    let mut data = BTreeMap::new();
    for e in std::fs::read_dir(dir).map_err(Error::io("listing", dir))? {
        let name = e.map_err(Error::io("listing", dir))?.file_name();
        let name = name.to_string_lossy();
        if let Some(r) = metadata_rank(&name) {
            ranks.insert(r);
        } else if let Some(r) = data_file_rank(&name) {
            data.entry(r).or_insert_with(|| name.into_owned());
        }
    }
    Ok((ranks, data))
}

/// Whether `dir` holds any `__{rank}.metadata` file.
pub(crate) fn has_rank_metadata(dir: &Path) -> Result<bool> {
    Ok(!rank_files(dir)?.0.is_empty())
}

/// One rank's parsed file, and the chunks it listed per key.
struct RankFile {
    rank: usize,
    metadata: Metadata,
}

/// Where a merged tensor's chunks came from.
struct Merging {
    /// Per entry index: the rank that listed each chunk (parallel to the entry's chunks).
    chunk_ranks: HashMap<usize, Vec<usize>>,
    /// Items two ranks both saved: (key, offsets, first rank, other rank).
    replicas: Vec<(String, Option<Vec<usize>>, usize, usize)>,
}

/// The global metadata of the per-rank DCP directory `dir` (canonical path `root`) and its
/// number of ranks; see [the module](self).
pub(super) fn merge(dir: &Path, root: &Path) -> Result<(Metadata, usize)> {
    let dir_name = dir.display().to_string();
    let (ranks, data) = rank_files(dir)?;
    let listed = || {
        ranks
            .iter()
            .map(|r| format!("__{r}.metadata"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(&last) = ranks.last() else {
        return Err(Error::DcpRankMissing {
            dir: dir_name,
            rank: 0,
            found: "no `__{rank}.metadata` file at all".into(),
        });
    };
    if let Some(gap) = (0..last).find(|r| !ranks.contains(r)) {
        return Err(Error::DcpRankMissing {
            dir: dir_name,
            rank: gap,
            found: format!("found {}", listed()),
        });
    }
    if let Some((&r, file)) = data.range(last + 1..).next() {
        return Err(Error::DcpRankMissing {
            dir: dir_name,
            rank: r,
            found: format!(
                "found {}, but the data file `{}` was written by rank {r}",
                listed(),
                crate::error::shown(file)
            ),
        });
    }
    let files = (0..=last)
        .map(|rank| {
            Ok(RankFile {
                rank,
                metadata: metadata_file_in(dir, root, &format!("__{rank}.metadata"))?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (mut metadata, merging) = merge_files(&dir_name, &files)?;
    check_chunks(&dir_name, &metadata, &merging)?;
    check_replicas(dir, root, &files, &merging)?;
    // Each file's paths were checked alone; the union is checked as one `.metadata` would be.
    let placed = super::plan::check_paths(&metadata.entries).map_err(|e| {
        e.into_error(&format!(
            "{}/__{{0..{last}}}.metadata (merged)",
            dir.display()
        ))
    })?;
    metadata.entries = placed.apply(metadata.entries);
    Ok((metadata, last + 1))
}

/// The union of the ranks' entries and storage records, each key compared across ranks.
fn merge_files(dir: &str, files: &[RankFile]) -> Result<(Metadata, Merging)> {
    let (entries, first_rank, merging) = merge_entries(dir, files)?;
    let storage = storage_records(&entries, &first_rank, &merging, files);
    let rank0 = &files[0].metadata;
    Ok((
        Metadata {
            entries,
            storage,
            checkpoint_id: rank0.checkpoint_id.clone(),
            version: rank0.version.clone(),
            saved_plans: None,
        },
        merging,
    ))
}

/// Every rank's entries in one list, in first-seen order, with the rank that first listed
/// each; a key listed again is compared with its first listing ([`merge_entry`]).
fn merge_entries(dir: &str, files: &[RankFile]) -> Result<(Vec<Entry>, Vec<usize>, Merging)> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut first_rank: Vec<usize> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    let mut merging = Merging {
        chunk_ranks: HashMap::new(),
        replicas: Vec::new(),
    };
    for f in files {
        for e in &f.metadata.entries {
            let Some(&i) = at.get(&e.key) else {
                at.insert(e.key.clone(), entries.len());
                if let EntryKind::Tensor(t) = &e.kind {
                    merging
                        .chunk_ranks
                        .insert(entries.len(), vec![f.rank; t.chunks.len()]);
                }
                entries.push(e.clone());
                first_rank.push(f.rank);
                continue;
            };
            let first = (&mut entries[i], first_rank[i]);
            merge_entry(dir, first, (e, f.rank), i, &mut merging)?;
        }
    }
    Ok((entries, first_rank, merging))
}

/// Merges entry `i` as rank `rank` lists it (`e`) into its first listing (`have`, from rank
/// `first`): the same planner path and kind; a tensor's dtype and shape equal, its new chunks
/// added and its repeated ones recorded as replicas, whose bytes are compared later.
fn merge_entry(
    dir: &str,
    (have, first): (&mut Entry, usize),
    (e, rank): (&Entry, usize),
    i: usize,
    merging: &mut Merging,
) -> Result<()> {
    let disagree = |reason: String| Error::DcpRanksDisagree {
        dir: dir.to_string(),
        key: e.key.clone(),
        rank: first,
        other_rank: rank,
        reason,
    };
    if have.path != e.path {
        return Err(disagree(format!(
            "its planner_data path is {} on rank {first} and {} on rank {rank}",
            path_text(&have.path),
            path_text(&e.path),
        )));
    }
    match (&mut have.kind, &e.kind) {
        (EntryKind::Bytes, EntryKind::Bytes) => {
            merging.replicas.push((e.key.clone(), None, first, rank));
        }
        (EntryKind::Tensor(have), EntryKind::Tensor(t)) => {
            if have.dtype != t.dtype {
                return Err(disagree(format!(
                    "dtype torch.{} against torch.{}",
                    have.dtype, t.dtype
                )));
            }
            if have.size != t.size {
                return Err(disagree(format!(
                    "global shape {:?} against {:?}",
                    have.size, t.size
                )));
            }
            let ranks = merging.chunk_ranks.entry(i).or_default();
            for c in &t.chunks {
                let same = have.chunks.iter().position(|h| h == c);
                match same {
                    // A replicated chunk (the same box on both): kept once, its bytes
                    // compared.
                    Some(j) if holds_elements(c) => merging.replicas.push((
                        e.key.clone(),
                        Some(c.offsets.clone()),
                        ranks[j],
                        rank,
                    )),
                    Some(_) => {}
                    None => {
                        have.chunks.push(c.clone());
                        ranks.push(rank);
                    }
                }
            }
        }
        (a, _) => {
            let kind = |k: &EntryKind| match k {
                EntryKind::Tensor(_) => "a tensor",
                EntryKind::Bytes => "a non-tensor value",
            };
            return Err(disagree(format!(
                "{} on rank {first}, {} on rank {rank}",
                kind(a),
                kind(&e.kind),
            )));
        }
    }
    Ok(())
}

/// Each merged entry's storage records, from the rank that listed the chunk (the lowest for
/// a replicated one) or first saved the value.
fn storage_records(
    entries: &[Entry],
    first_rank: &[usize],
    merging: &Merging,
    files: &[RankFile],
) -> HashMap<StorageKey, std::result::Result<StorageInfo, String>> {
    let mut storage = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        let keys: Vec<(StorageKey, usize)> = match &e.kind {
            EntryKind::Tensor(t) => {
                let ranks = &merging.chunk_ranks[&i];
                t.chunks
                    .iter()
                    .zip(ranks)
                    .map(|(c, &r)| {
                        (
                            StorageKey {
                                fqn: e.key.clone(),
                                offset: Some(c.offsets.clone()),
                            },
                            r,
                        )
                    })
                    .collect()
            }
            EntryKind::Bytes => vec![(
                StorageKey {
                    fqn: e.key.clone(),
                    offset: None,
                },
                first_rank[i],
            )],
        };
        for (k, r) in keys {
            if storage.contains_key(&k) {
                continue;
            }
            if let Some(info) = files[r].metadata.storage.get(&k) {
                storage.insert(k, info.clone());
            }
        }
    }
    storage
}

fn path_text(p: &Option<Vec<super::metadata::PathItem>>) -> String {
    match p {
        Some(p) => super::plan::path_repr(p),
        None => "(none)".into(),
    }
}

/// Every merged tensor's chunks tile its shape exactly once; the error names the ranks.
fn check_chunks(dir: &str, md: &Metadata, merging: &Merging) -> Result<()> {
    for (i, e) in md.entries.iter().enumerate() {
        let EntryKind::Tensor(t) = &e.kind else {
            continue;
        };
        if let Err(reason) = check_tiling(&t.size, &t.chunks) {
            let ranks = merging
                .chunk_ranks
                .get(&i)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            return Err(Error::DcpChunks {
                dir: dir.to_string(),
                key: e.key.clone(),
                reason: format!(
                    "merging the per-rank metadata: {reason} (chunks listed: {})",
                    chunk_list(&t.chunks, ranks)
                ),
            });
        }
    }
    Ok(())
}

/// "rank 0 at [0, 0] size [3, 3], rank 1 at …" (at most 8 chunks named).
fn chunk_list(chunks: &[Chunk], ranks: &[usize]) -> String {
    let mut parts: Vec<String> = chunks
        .iter()
        .zip(ranks)
        .take(8)
        .map(|(c, r)| format!("rank {r} at {:?} size {:?}", c.offsets, c.sizes))
        .collect();
    if chunks.len() > 8 {
        parts.push(format!("{} more", chunks.len() - 8));
    }
    parts.join(", ")
}

/// Every item two ranks both saved has identical stored bytes in each rank's data file.
fn check_replicas(dir: &Path, root: &Path, files: &[RankFile], merging: &Merging) -> Result<()> {
    let dir_name = dir.display().to_string();
    let record = |rank: usize, key: &str, offsets: &Option<Vec<usize>>| {
        let k = StorageKey {
            fqn: key.to_string(),
            offset: offsets.clone(),
        };
        let what = || match offsets {
            Some(o) => format!("rank {rank}'s copy of the chunk at {o:?}"),
            None => format!("rank {rank}'s copy of the value"),
        };
        match files[rank].metadata.storage.get(&k) {
            Some(Ok(info)) => Ok(info.clone()),
            Some(Err(reason)) => Err(Error::DcpChunks {
                dir: dir_name.clone(),
                key: key.to_string(),
                reason: format!(
                    "the storage_data record of {} in `__{rank}.metadata` is malformed: {reason}",
                    what()
                ),
            }),
            None => Err(Error::DcpChunks {
                dir: dir_name.clone(),
                key: key.to_string(),
                reason: format!(
                    "{} has no storage_data entry in `__{rank}.metadata`",
                    what()
                ),
            }),
        }
    };
    for (key, offsets, a, b) in &merging.replicas {
        let (ia, ib) = (record(*a, key, offsets)?, record(*b, key, offsets)?);
        let copy = |rank: usize, info: &StorageInfo| {
            Box::new(crate::error::StoredCopy {
                rank,
                file: info.relative_path.clone(),
                offset: info.offset,
                length: info.length,
            })
        };
        let differ = || Error::DcpReplicasDiffer {
            dir: dir_name.clone(),
            key: key.clone(),
            offsets: offsets.clone(),
            first: copy(*a, &ia),
            second: copy(*b, &ib),
        };
        if ia.length != ib.length || ia.transforms != ib.transforms {
            return Err(differ());
        }
        if !same_bytes(dir, root, key, &ia, &ib)? {
            return Err(differ());
        }
    }
    Ok(())
}

/// Whether the byte ranges of `a` and `b` (of equal length) hold the same bytes, compared a
/// block at a time.
fn same_bytes(
    dir: &Path,
    root: &Path,
    key: &str,
    a: &StorageInfo,
    b: &StorageInfo,
) -> Result<bool> {
    use std::os::unix::fs::FileExt;
    let open = |info: &StorageInfo| -> Result<std::fs::File> {
        let storage_err = |reason: String| Error::DcpStorage {
            dir: dir.display().to_string(),
            key: key.to_string(),
            file: info.relative_path.clone(),
            reason,
        };
        let (path, len) = confine(root, &info.relative_path, "data file").map_err(storage_err)?;
        if info.offset.checked_add(info.length).is_none_or(|e| e > len) {
            return Err(storage_err(format!(
                "range {}..+{} lies past the end of the {len}-byte file",
                info.offset, info.length
            )));
        }
        crate::storage::open_regular(&path)
            .map_err(|e| storage_err(format!("opening: {}", std::io::Error::from(e))))
    };
    let (fa, fb) = (open(a)?, open(b)?);
    const BLOCK: u64 = 1 << 20;
    let n = BLOCK.min(a.length) as usize;
    let (mut ba, mut bb) = (vec![0u8; n], vec![0u8; n]);
    let mut done = 0u64;
    while done < a.length {
        let k = BLOCK.min(a.length - done) as usize;
        let read = |f: &std::fs::File, buf: &mut [u8], info: &StorageInfo| {
            f.read_exact_at(buf, info.offset + done)
                .map_err(|e| Error::DcpStorage {
                    dir: dir.display().to_string(),
                    key: key.to_string(),
                    file: info.relative_path.clone(),
                    reason: format!("reading: {e}"),
                })
        };
        read(&fa, &mut ba[..k], a)?;
        read(&fb, &mut bb[..k], b)?;
        if ba[..k] != bb[..k] {
            return Ok(false);
        }
        done += k as u64;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_names_are_canonical_decimals() {
        assert_eq!(metadata_rank("__0.metadata"), Some(0));
        assert_eq!(metadata_rank("__12.metadata"), Some(12));
        assert_eq!(metadata_rank("__01.metadata"), None);
        assert_eq!(metadata_rank("__.metadata"), None);
        assert_eq!(metadata_rank("__+1.metadata"), None);
        assert_eq!(metadata_rank(".metadata"), None);
        assert_eq!(data_file_rank("__3_0.distcp"), Some(3));
        assert_eq!(data_file_rank("__3_x.distcp"), None);
    }
}
