//! Writing a state dict as a DCP directory, as
//! `torch.distributed.checkpoint.format_utils.torch_save_to_dcp` does: the dict flattened by
//! DCP's traversal, every tensor and non-tensor value `torch.save`d into `__0_0.distcp`,
//! and `.metadata` pickled last so that `dcp.load` and `dcp_to_torch_save` read it.

use super::metadata::PathItem;
use super::pickler::{Record, StoredChunk};
use crate::error::{Error, IoError, Result};
use crate::io::torch_save::{self, PyObj};
use crate::tensor::DType;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The one data file a single-process save writes.
const DATA_FILE: &str = "__0_0.distcp";

/// One flattened value: its key, its path in the nested dict, the value.
struct Item<'a> {
    key: String,
    path: Vec<PathItem>,
    value: &'a PyObj,
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

/// DCP's `flatten_state_dict`: every leaf with its dotted key and path, in traversal order.
fn flatten(obj: &PyObj) -> Result<Vec<Item<'_>>> {
    let Some(items) = obj.dict_items() else {
        return Err(Error::UnexpectedObject {
            path: "<root>".into(),
            expected: "a dict (a state dict)".into(),
            found: obj.describe(),
        });
    };
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (k, v) in items {
        let path = vec![PathItem::Key(key_str(k, "<root>")?)];
        visit(v, path, &mut out, 0)?;
    }
    for it in &out {
        if !seen.insert(it.key.as_str()) {
            return Err(Error::UnexpectedObject {
                path: it.key.clone(),
                expected: "distinct flattened keys".into(),
                found: "a duplicated flatten key (e.g. both 0 and '0')".into(),
            });
        }
    }
    Ok(out)
}

fn visit<'a>(
    v: &'a PyObj,
    path: Vec<PathItem>,
    out: &mut Vec<Item<'a>>,
    depth: usize,
) -> Result<()> {
    let key = path
        .iter()
        .map(|p| match p {
            PathItem::Key(k) => k.clone(),
            PathItem::Index(i) => i.to_string(),
        })
        .collect::<Vec<_>>()
        .join(".");
    if depth > 200 {
        return Err(Error::UnexpectedObject {
            path: key,
            expected: "containers nested at most 200 deep".into(),
            found: "deeper nesting".into(),
        });
    }
    if let Some(items) = v.dict_items() {
        for (k, x) in items {
            let mut p = path.clone();
            p.push(PathItem::Key(key_str(k, &key)?));
            visit(x, p, out, depth + 1)?;
        }
    } else if is_terminal(v) {
        out.push(Item {
            key,
            path,
            value: v,
        });
    } else if let PyObj::List(items) = v {
        for (i, x) in items.iter().enumerate() {
            let mut p = path.clone();
            p.push(PathItem::Index(i));
            visit(x, p, out, depth + 1)?;
        }
    }
    Ok(())
}

/// Where one item landed in the data file.
struct Stored<'a> {
    /// Position in traversal order (the order of `state_dict_metadata`).
    order: usize,
    item: Item<'a>,
    offset: u64,
    length: u64,
}

/// Writes the DCP directory for `obj` (a state dict) at `out`, which must be missing or an
/// empty directory: into a temporary sibling, data file first and `.metadata` last, each
/// synced, then renamed into place. `storage_meta.checkpoint_id` is `out`'s last component.
/// Returns the bytes of tensor data written.
pub fn save_dcp(obj: &PyObj, out: &Path) -> Result<u64> {
    let items = flatten(obj)?;
    check_target(out)?;
    let name = out
        .file_name()
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
        })?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = parent.join(format!(".{name}.{}.tmp", std::process::id()));
    // Only a temporary directory created here is removed on failure.
    std::fs::create_dir(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
    let result = (|| {
        let (stored, tensor_bytes) = write_data(&tmp.join(DATA_FILE), items)?;
        let origins = origins(&stored);
        let md = super::pickler::metadata_pickle(&stored_view(&stored, &origins), &name)?;
        write_synced(&tmp.join(".metadata"), &md)?;
        sync_dir(&tmp)?;
        std::fs::rename(&tmp, out).map_err(|e| io_err("renaming into place", out, e))?;
        sync_dir(&parent)?;
        Ok(tensor_bytes)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// The view of stored items the pickler needs: each value whole, as one chunk at the origin.
fn stored_view<'s>(stored: &'s [Stored<'_>], origins: &'s [Vec<usize>]) -> Vec<Record<'s>> {
    stored
        .iter()
        .zip(origins)
        .map(|(s, origin)| {
            let tensor = match s.item.value {
                PyObj::Tensor(t) => Some((t.dtype(), t.shape())),
                _ => None,
            };
            Record {
                key: &s.item.key,
                path: &s.item.path,
                tensor,
                chunks: vec![StoredChunk {
                    offsets: origin,
                    sizes: tensor.map_or(&[][..], |(_, shape)| shape),
                    file: DATA_FILE,
                    offset: s.offset,
                    length: s.length,
                }],
            }
        })
        .collect()
}

/// The origin (all-zero offsets) of every stored value's shape.
fn origins(stored: &[Stored<'_>]) -> Vec<Vec<usize>> {
    stored
        .iter()
        .map(|s| match s.item.value {
            PyObj::Tensor(t) => vec![0; t.shape().len()],
            _ => Vec::new(),
        })
        .collect()
}

/// Refuses an existing output that is not an empty directory.
fn check_target(out: &Path) -> Result<()> {
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("inspecting", out, e)),
        Ok(m) if m.is_dir() => {
            let mut entries = std::fs::read_dir(out).map_err(|e| io_err("reading", out, e))?;
            match entries.next() {
                None => Ok(()),
                Some(_) => Err(io_err(
                    "writing",
                    out,
                    refusal(
                        std::io::ErrorKind::DirectoryNotEmpty,
                        "the output directory exists and is not empty; refusing to replace it",
                    ),
                )),
            }
        }
        Ok(_) => Err(io_err(
            "writing",
            out,
            refusal(
                std::io::ErrorKind::AlreadyExists,
                "the output path exists and is not a directory",
            ),
        )),
    }
}

/// Writes every non-tensor value, then every tensor, each as its own `torch.save` archive,
/// into `path` (as PyTorch's writer orders them). Returns the items with their ranges and
/// the tensor bytes.
fn write_data<'a>(path: &Path, items: Vec<Item<'a>>) -> Result<(Vec<Stored<'a>>, u64)> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| io_err("creating", path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let (objects, tensors): (Vec<_>, Vec<_>) = items
        .into_iter()
        .enumerate()
        .partition(|(_, it)| !matches!(it.value, PyObj::Tensor(_)));
    let mut at = 0u64;
    let mut tensor_bytes = 0u64;
    let mut stored = Vec::new();
    for (order, item) in objects.into_iter().chain(tensors) {
        if let PyObj::Tensor(t) = item.value {
            tensor_bytes += t.nbytes() as u64;
        }
        let bytes = torch_save::save_to_bytes(item.value)?;
        w.write_all(&bytes)
            .map_err(|e| io_err("writing", path, e))?;
        let length = bytes.len() as u64;
        stored.push(Stored {
            order,
            item,
            offset: at,
            length,
        });
        at += length;
    }
    let file = w
        .into_inner()
        .map_err(|e| io_err("writing", path, e.into_error()))?;
    file.sync_all().map_err(|e| io_err("syncing", path, e))?;
    // The metadata lists keys in traversal order, whatever the order in the file.
    stored.sort_by_key(|s| s.order);
    Ok((stored, tensor_bytes))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err("creating", path, e))?;
    f.write_all(bytes).map_err(|e| io_err("writing", path, e))?;
    f.sync_all().map_err(|e| io_err("syncing", path, e))
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

/// PyTorch's dtype name without `torch.`.
pub(crate) fn torch_dtype_name(d: DType) -> &'static str {
    &d.torch_name()["torch.".len()..]
}
