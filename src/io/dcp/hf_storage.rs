//! DCP directories in Hugging Face storage (`HuggingFaceStorageWriter`,
//! `torch/distributed/checkpoint/hf_storage.py`, torchtitan's HF saving): no pickled metadata,
//! the tensors in `.safetensors` files whose headers' `__metadata__["DCP_SHARDING_INFO"]` is a
//! JSON string `{fqn: {"saved_offsets": [...]}}` giving each stored tensor's offsets in the
//! global tensor. Three forms ([`HfForm`]):
//!
//! * rank 0 alone saved the full state dict: `model-{i:05}-of-{N:05}.safetensors` (one file,
//!   `model-00001-of-00001.safetensors`, without an `fqn_to_index_mapping`) and
//!   `model.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map": {fqn:
//!   file}}`); every offset is 0;
//! * every rank saved its shards (`save_distributed=True`):
//!   `shard-{rank+1:05}-model-{i:05}-of-{N:05}.safetensors`, no index;
//! * as the distributed form, consolidated (`enable_consolidation=True`): the shards in
//!   `sharded/`, PyTorch's merged files (plain Hugging Face files, no `DCP_SHARDING_INFO`)
//!   beside it. The crate reads `sharded/`: that is the checkpoint `dcp.save` wrote, with the
//!   sharding information that marks it as DCP; the merged files are a copy PyTorch derived
//!   from it (a plain model directory, read as such once those are supported), so reading
//!   the shards gives the same tensors and does not depend on the copy being complete.
//!
//! [`read`] builds the same global [`Metadata`] as PyTorch's `HuggingFaceStorageReader.
//! read_metadata`: a tensor entry per name (keys kept as saved, no nesting), a chunk per file
//! holding it at its `saved_offsets` with its header shape, the global shape the largest
//! `offset + shape` in each dimension, and a storage record at its `data_offsets`. The chunks
//! are raw little-endian elements, not `torch.save` archives. Unlike PyTorch's reader it checks
//! what it is given: every tensor has its sharding entry with one non-negative offset per
//! dimension, a supported dtype that every file agrees on, and data inside its file; the
//! chunks tile the inferred shape exactly once (a gap is what an offset outside the true shape
//! leaves); and the index, when there is one, names the file that holds each tensor.
//!
//! Keys are ordered by file name, then by name within each file (the order of
//! `safe_open(...).keys()`); PyTorch's order follows the directory listing, which is not
//! stable.

use super::files::confine;
use super::metadata::{Chunk, Entry, EntryKind, Metadata, StorageInfo, StorageKey, TensorMeta};
use super::plan::{check_tiling, volume};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::collections::HashMap;
use std::path::Path;

/// The `__metadata__` entry that marks a DCP file in Hugging Face storage.
pub const SHARDING_INFO_KEY: &str = "DCP_SHARDING_INFO";

/// The index the rank-0 form writes beside its files.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// The subdirectory of the consolidated form that holds the shards.
const SHARDED_DIR: &str = "sharded";

/// The largest safetensors header read (the `safetensors` crate's limit).
const MAX_HEADER: u64 = 100_000_000;

/// The largest index file read.
const MAX_INDEX: u64 = 1 << 28;

/// Which form of Hugging Face storage a directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HfForm {
    /// Rank 0 saved the full state dict (`model-*-of-*.safetensors` and the index).
    Rank0,
    /// Every rank saved its shards (`shard-*-model-*-of-*.safetensors`).
    Distributed,
    /// The distributed form in `sharded/`, with PyTorch's merged files beside it.
    Consolidated,
}

impl HfForm {
    /// For messages.
    pub fn describe(self) -> &'static str {
        match self {
            HfForm::Rank0 => "Hugging Face storage saved by rank 0",
            HfForm::Distributed => "Hugging Face storage saved by every rank",
            HfForm::Consolidated => {
                "Hugging Face storage saved by every rank and consolidated (its `sharded/` shards are read)"
            }
        }
    }
}

/// One safetensors file's header, as far as it matters here.
struct Header {
    /// Bytes before the tensor data (the 8-byte length and the JSON).
    data_start: u64,
    /// The file's length.
    len: u64,
    /// The tensors, by name.
    tensors: Vec<HeaderTensor>,
    /// `__metadata__`, when present.
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// One tensor of a header: (name, dtype name, shape, data_offsets).
type HeaderTensor = (String, String, Vec<usize>, (u64, u64));

fn file_err(file: &str, key: Option<&str>, reason: impl Into<String>) -> Error {
    Error::DcpHfFile {
        file: file.to_string(),
        key: key.map(str::to_string),
        reason: reason.into(),
    }
}

/// Reads the header of the safetensors file `path` (`file` names it in errors).
fn header(path: &Path, file: &str) -> Result<Header> {
    use std::os::unix::fs::FileExt;
    let f = crate::storage::open_regular(path).map_err(|e| {
        file_err(
            file,
            None,
            format!("cannot open it: {}", std::io::Error::from(e)),
        )
    })?;
    let len = f
        .metadata()
        .map_err(|e| file_err(file, None, format!("cannot stat it: {e}")))?
        .len();
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0)
        .map_err(|_| file_err(file, None, "shorter than the 8-byte header length"))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n.saturating_add(8) > len {
        return Err(file_err(
            file,
            None,
            format!(
                "the header length {n} does not fit the file ({len} bytes; at most {MAX_HEADER})"
            ),
        ));
    }
    let mut json = vec![0u8; n as usize];
    f.read_exact_at(&mut json, 8)
        .map_err(|e| file_err(file, None, format!("reading the header: {e}")))?;
    let root: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&json)
        .map_err(|e| file_err(file, None, format!("the header is not a JSON object: {e}")))?;
    let mut tensors = Vec::new();
    let mut metadata = None;
    for (name, v) in root {
        if name == "__metadata__" {
            match v {
                serde_json::Value::Object(m) => metadata = Some(m),
                _ => return Err(file_err(file, None, "`__metadata__` is not an object")),
            }
            continue;
        }
        let bad = |what: &str| file_err(file, Some(&name), format!("its header entry {what}"));
        let obj = v.as_object().ok_or_else(|| bad("is not an object"))?;
        let dtype = obj
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("has no dtype string"))?
            .to_string();
        let shape = obj
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("has no shape list"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad("has a shape that is not a list of sizes"))?;
        let offsets = obj
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| match a.as_slice() {
                [s, e] => Some((s.as_u64()?, e.as_u64()?)),
                _ => None,
            })
            .ok_or_else(|| bad("has no data_offsets pair"))?;
        tensors.push((name, dtype, shape, offsets));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Header {
        data_start: 8 + n,
        len,
        tensors,
        metadata,
    })
}

/// Whether the regular file `path`'s header carries `DCP_SHARDING_INFO` (`false` for a file
/// that is unreadable or no safetensors file: the reader reports those).
fn has_sharding_info(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file())
        && crate::io::safetensors::header_metadata(path)
            .is_ok_and(|m| m.is_some_and(|m| m.contains_key(SHARDING_INFO_KEY)))
}

/// The form of Hugging Face storage `dir` holds, if any: some `.safetensors` file in it whose
/// header carries `DCP_SHARDING_INFO` (the distributed form when the files are named
/// `shard-*`, else the rank-0 form), or none but such files in `dir/sharded/` (the
/// consolidated form). A directory of safetensors files without it is a plain Hugging Face
/// model directory, not this.
pub fn hf_form(dir: &Path) -> Result<Option<HfForm>> {
    let names = crate::io::safetensors::file_names(dir)?;
    if let Some(n) = names.iter().find(|n| has_sharding_info(&dir.join(n))) {
        return Ok(Some(if n.starts_with("shard-") {
            HfForm::Distributed
        } else {
            HfForm::Rank0
        }));
    }
    let sharded = dir.join(SHARDED_DIR);
    if sharded.is_dir() && hf_form(&sharded)? == Some(HfForm::Distributed) {
        return Ok(Some(HfForm::Consolidated));
    }
    Ok(None)
}

/// The rank (`shard_index - 1`) in a `shard-{rank+1:05}-model-{i:05}-of-{N:05}.safetensors`
/// name.
fn shard_rank(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("shard-")?;
    let (idx, rest) = rest.split_once('-')?;
    rest.strip_prefix("model-")?;
    let i: usize = idx.parse().ok()?;
    i.checked_sub(1)
}

/// The model file (`i` from 1, of `n`) a Hugging Face storage data file holds tensors of:
/// `model-{i:05}-of-{n:05}.safetensors`, or a rank's shard of it,
/// `shard-{rank+1:05}-model-{i:05}-of-{n:05}.safetensors` (under `sharded/` in the
/// consolidated form). This is the file plan `consolidate_safetensors_files` follows.
pub(crate) fn model_file_of(relative_path: &str) -> Option<(usize, usize)> {
    let name = relative_path.rsplit('/').next()?;
    let name = name.strip_suffix(".safetensors")?;
    let rest = match name.strip_prefix("shard-") {
        Some(r) => r.split_once('-')?.1,
        None => name,
    };
    let (i, n) = rest.strip_prefix("model-")?.split_once("-of-")?;
    let (i, n): (usize, usize) = (i.parse().ok()?, n.parse().ok()?);
    (1..=n).contains(&i).then_some((i, n))
}

/// The global metadata of the Hugging Face storage directory `dir` (canonical path `root`),
/// and its [`super::Source`]; see [the module](self).
pub(super) fn read(dir: &Path, root: &Path) -> Result<(Metadata, super::Source)> {
    let dir_name = dir.display().to_string();
    let form = hf_form(dir)?.ok_or_else(|| {
        file_err(
            &dir_name,
            None,
            format!("no safetensors file in it carries {SHARDING_INFO_KEY}"),
        )
    })?;
    let prefix = if form == HfForm::Consolidated {
        format!("{SHARDED_DIR}/")
    } else {
        String::new()
    };
    let data_dir = dir.join(&prefix);
    let names = crate::io::safetensors::file_names(&data_dir)?;
    let mut found = Gathered::default();
    let mut ranks = std::collections::BTreeSet::new();
    for name in &names {
        let rel = format!("{prefix}{name}");
        let shown_name = data_dir.join(name).display().to_string();
        let (path, _) = confine(root, &rel, "safetensors file")
            .map_err(|reason| file_err(&shown_name, None, reason))?;
        let h = header(&path, &shown_name)?;
        let info = sharding_info(&shown_name, &h)?;
        if let Some(r) = shard_rank(name) {
            ranks.insert(r);
        }
        for tensor in &h.tensors {
            let chunk = stored_chunk(&h, &shown_name, &info, tensor)?;
            found.add(chunk, (name, &rel, &shown_name))?;
        }
    }
    found.check_tilings(&dir_name)?;
    if form == HfForm::Rank0 {
        check_index(dir, root, &found.held_by)?;
    }
    let ranks = match form {
        HfForm::Rank0 => None,
        _ => ranks.last().map(|r| r + 1),
    };
    Ok((
        Metadata {
            entries: found.entries,
            storage: found.storage,
            checkpoint_id: None,
            version: None,
            saved_plans: None,
        },
        super::Source::HfStorage {
            form,
            files: names.len(),
            ranks,
        },
    ))
}

/// One tensor of a shard's header, checked: its key, dtype, its chunk in the global tensor,
/// the global extent that chunk implies, and its byte range in the file.
struct StoredChunk<'h> {
    key: &'h String,
    dtype: DType,
    chunk: Chunk,
    global: Vec<usize>,
    offset: u64,
    length: u64,
}

/// Checks the header entry `(key, dtype, shape, data_offsets)` of the shard `file` against its
/// `DCP_SHARDING_INFO` and the file's length.
fn stored_chunk<'h>(
    h: &Header,
    file: &str,
    info: &HashMap<String, Vec<usize>>,
    (key, dtype_name, shape, (s, e)): &'h HeaderTensor,
) -> Result<StoredChunk<'h>> {
    let bad = |reason: String| file_err(file, Some(key), reason);
    let dtype = DType::from_safetensors_name(dtype_name)
        .ok_or_else(|| bad(format!("dtype {dtype_name} is not supported")))?;
    let offsets = info
        .get(key.as_str())
        .ok_or_else(|| bad(format!("{SHARDING_INFO_KEY} has no entry for it")))?
        .clone();
    if offsets.len() != shape.len() {
        return Err(bad(format!(
            "{SHARDING_INFO_KEY} gives {} saved_offsets {offsets:?} for its {} dimensions {shape:?}",
            offsets.len(),
            shape.len()
        )));
    }
    let nbytes = volume(shape)
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let end = h.data_start.checked_add(*e);
    if s > e || end.is_none_or(|end| end > h.len) {
        return Err(bad(format!(
            "data_offsets [{s}, {e}] lie outside the file's {} bytes of data",
            h.len - h.data_start
        )));
    }
    if e - s != nbytes as u64 {
        return Err(bad(format!(
            "data_offsets [{s}, {e}] hold {} bytes, its shape {shape:?} {dtype} needs {nbytes}",
            e - s
        )));
    }
    let global: Vec<usize> = offsets
        .iter()
        .zip(shape)
        .map(|(&o, &d)| o.checked_add(d))
        .collect::<Option<_>>()
        .ok_or_else(|| bad(format!("saved_offsets {offsets:?} overflow")))?;
    Ok(StoredChunk {
        key,
        dtype,
        chunk: Chunk {
            offsets,
            sizes: shape.clone(),
        },
        global,
        offset: h.data_start + s,
        length: e - s,
    })
}

/// The entries and storage records gathered from the shards so far.
#[derive(Default)]
struct Gathered {
    entries: Vec<Entry>,
    at: HashMap<String, usize>,
    /// Per entry: the file that first described it, and each chunk's file.
    first_file: Vec<String>,
    chunk_files: Vec<Vec<String>>,
    storage: HashMap<StorageKey, std::result::Result<StorageInfo, String>>,
    held_by: HashMap<String, Vec<String>>,
}

impl Gathered {
    /// Adds chunk `c` of the shard `name` (`rel` from the directory, `shown` for messages):
    /// a new entry, or one more chunk of an entry an earlier shard began, which must agree
    /// with it in dtype and rank; the global shape grows to cover every chunk.
    fn add(&mut self, c: StoredChunk<'_>, (name, rel, shown): (&str, &str, &str)) -> Result<()> {
        let key = c.key;
        match self.at.get(key) {
            None => {
                self.at.insert(key.clone(), self.entries.len());
                self.entries.push(Entry {
                    key: key.clone(),
                    path: None,
                    kind: EntryKind::Tensor(TensorMeta {
                        dtype: c.dtype.torch_attr().to_string(),
                        size: c.global,
                        chunks: vec![c.chunk.clone()],
                    }),
                });
                self.first_file.push(shown.to_string());
                self.chunk_files.push(vec![rel.to_string()]);
            }
            Some(&i) => {
                let EntryKind::Tensor(t) = &mut self.entries[i].kind else {
                    unreachable!("every entry here is a tensor")
                };
                let disagree = |reason: String| Error::DcpHfDisagree {
                    key: Some(key.clone()),
                    file: self.first_file[i].clone(),
                    other_file: shown.to_string(),
                    reason,
                };
                if t.dtype != c.dtype.torch_attr() {
                    return Err(disagree(format!(
                        "dtype torch.{} against torch.{}",
                        t.dtype,
                        c.dtype.torch_attr()
                    )));
                }
                if t.size.len() != c.global.len() {
                    return Err(disagree(format!(
                        "{} dimensions against {}",
                        t.size.len(),
                        c.global.len()
                    )));
                }
                for (d, g) in t.size.iter_mut().zip(&c.global) {
                    *d = (*d).max(*g);
                }
                t.chunks.push(c.chunk.clone());
                self.chunk_files[i].push(rel.to_string());
            }
        }
        self.storage.insert(
            StorageKey {
                fqn: key.clone(),
                offset: Some(c.chunk.offsets),
            },
            Ok(StorageInfo {
                relative_path: rel.to_string(),
                offset: c.offset,
                length: c.length,
                transforms: Vec::new(),
            }),
        );
        self.held_by
            .entry(key.clone())
            .or_default()
            .push(name.to_string());
        Ok(())
    }

    /// Every tensor's chunks must tile the global shape inferred from them, as PyTorch's
    /// reader infers it.
    fn check_tilings(&self, dir_name: &str) -> Result<()> {
        for (i, e) in self.entries.iter().enumerate() {
            let EntryKind::Tensor(t) = &e.kind else {
                continue;
            };
            if let Err(reason) = check_tiling(&t.size, &t.chunks) {
                let listed: Vec<String> = t
                    .chunks
                    .iter()
                    .zip(&self.chunk_files[i])
                    .take(8)
                    .map(|(c, f)| format!("`{f}` at {:?} size {:?}", c.offsets, c.sizes))
                    .collect();
                return Err(Error::DcpChunks {
                    dir: dir_name.to_string(),
                    key: e.key.clone(),
                    reason: format!(
                        "{reason}; the global shape {:?} is inferred from the chunks as PyTorch's reader infers it (chunks: {})",
                        t.size,
                        listed.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The `DCP_SHARDING_INFO` of a header: tensor name → saved offsets.
fn sharding_info(file: &str, h: &Header) -> Result<HashMap<String, Vec<usize>>> {
    let raw = h
        .metadata
        .as_ref()
        .and_then(|m| m.get(SHARDING_INFO_KEY))
        .ok_or_else(|| {
            file_err(
                file,
                None,
                format!("its header has no {SHARDING_INFO_KEY}, as the other files of the directory do (a plain Hugging Face file among DCP shards)"),
            )
        })?;
    let text = raw.as_str().ok_or_else(|| {
        file_err(
            file,
            None,
            format!("{SHARDING_INFO_KEY} is not a JSON string"),
        )
    })?;
    let parsed: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| {
            file_err(
                file,
                None,
                format!("{SHARDING_INFO_KEY} is not a JSON object: {e}"),
            )
        })?;
    let mut out = HashMap::new();
    for (key, v) in parsed {
        let offsets = v
            .get("saved_offsets")
            .and_then(|o| o.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| {
                file_err(
                    file,
                    Some(&key),
                    format!("its {SHARDING_INFO_KEY} entry has no saved_offsets list of non-negative ints"),
                )
            })?;
        if !h.tensors.iter().any(|t| t.0 == key) {
            return Err(file_err(
                file,
                Some(&key),
                format!("{SHARDING_INFO_KEY} names it, but the file holds no such tensor"),
            ));
        }
        out.insert(key, offsets);
    }
    Ok(out)
}

/// The rank-0 form's `model.safetensors.index.json`, when present: its `weight_map` names,
/// for every tensor, a file that holds it, and lists every tensor.
fn check_index(dir: &Path, root: &Path, held_by: &HashMap<String, Vec<String>>) -> Result<()> {
    let index = dir.join(INDEX_FILE);
    let index_name = index.display().to_string();
    if std::fs::symlink_metadata(&index).is_err() {
        return Ok(());
    }
    let disagree = |key: Option<&str>, other: &str, reason: String| Error::DcpHfDisagree {
        key: key.map(str::to_string),
        file: index_name.clone(),
        other_file: other.to_string(),
        reason,
    };
    let bad = |reason: String| file_err(&index_name, None, reason);
    let (real, _) = confine(root, INDEX_FILE, "index file").map_err(bad)?;
    let bytes = crate::storage::read_regular(&real, MAX_INDEX)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("it has no weight_map object".into()))?;
    for (key, file) in map {
        let file = file.as_str().ok_or_else(|| {
            file_err(
                &index_name,
                Some(key),
                "its weight_map entry is not a file name",
            )
        })?;
        match held_by.get(key) {
            None => {
                return Err(disagree(
                    Some(key),
                    file,
                    "the index maps it to this file, but no file holds it".into(),
                ))
            }
            Some(files) if !files.iter().any(|f| f == file) => {
                return Err(disagree(
                    Some(key),
                    &files[0],
                    format!(
                        "the index maps it to `{}`, but it is stored here",
                        crate::error::shown(file)
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    let mut unlisted: Vec<&String> = held_by.keys().filter(|k| !map.contains_key(*k)).collect();
    unlisted.sort();
    if let Some(key) = unlisted.first() {
        return Err(disagree(
            Some(key),
            &held_by[*key][0],
            "the file holds it, but the index's weight_map does not list it".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_give_ranks() {
        assert_eq!(
            shard_rank("shard-00001-model-00001-of-00002.safetensors"),
            Some(0)
        );
        assert_eq!(
            shard_rank("shard-00003-model-00002-of-00002.safetensors"),
            Some(2)
        );
        assert_eq!(
            shard_rank("shard-00000-model-00001-of-00001.safetensors"),
            None
        );
        assert_eq!(shard_rank("model-00001-of-00001.safetensors"), None);
        assert_eq!(
            model_file_of("sharded/shard-00002-model-00003-of-00004.safetensors"),
            Some((3, 4))
        );
        assert_eq!(
            model_file_of("model-00001-of-00001.safetensors"),
            Some((1, 1))
        );
        assert_eq!(model_file_of("model-00005-of-00004.safetensors"), None);
        assert_eq!(model_file_of("__0_0.distcp"), None);
    }
}
