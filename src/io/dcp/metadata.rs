//! The typed content of a DCP `.metadata` file, read with the restricted unpickler.

use super::unpickle::{self, Class, Global, Instance, Node, Pickled, V};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::collections::HashMap;

/// Largest `.metadata` file read (it is held in memory while it is parsed).
pub(crate) const MAX_METADATA_BYTES: u64 = 1 << 30;

/// Longest path of a key in the nested dict (`planner_data`), as deep as the crate nests.
pub const MAX_PATH_LEN: usize = 200;

/// One step of a key's path in the nested state dict (`planner_data`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(untagged)]
pub enum PathItem {
    /// A dict key (DCP stores every mapping key as a string).
    Key(String),
    /// A list index.
    Index(usize),
    /// A negative list index (`-n`, counted from the end as Python counts): PyTorch's
    /// `set_element` accepts one; the crate resolves it when the metadata is parsed.
    FromEnd(usize),
}

/// A chunk of a tensor: the box `offsets .. offsets + sizes` of the global tensor (the crate's
/// one placement model's box).
pub use crate::placement::Chunk;

/// A tensor entry: its dtype, global shape and chunks.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorMeta {
    /// PyTorch's dtype name without `torch.` (`float32`, `bfloat16`, …).
    pub dtype: String,
    /// The global shape.
    pub size: Vec<usize>,
    /// The saved chunks, in metadata order.
    pub chunks: Vec<Chunk>,
}

impl TensorMeta {
    /// The crate's dtype, if it supports this one.
    pub fn dtype(&self) -> Option<DType> {
        DType::from_torch_name(&self.dtype)
    }
}

/// What one flattened key holds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum EntryKind {
    /// A tensor stored as chunks (`TensorStorageMetadata`).
    Tensor(TensorMeta),
    /// Any other object, stored as one `torch.save` blob (`BytesStorageMetadata`).
    Bytes,
}

/// One key of `state_dict_metadata`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Entry {
    /// The flattened key (`model.net.0.weight`, `optim.param_groups.0.lr`).
    pub key: String,
    /// Its path in the nested dict (`planner_data`), if recorded.
    pub path: Option<Vec<PathItem>>,
    /// Tensor or bytes.
    pub kind: EntryKind,
}

/// Where a chunk or bytes object is stored: `MetadataIndex(fqn, offset)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StorageKey {
    /// The flattened key.
    pub fqn: String,
    /// The chunk's offsets (`None` for bytes objects).
    pub offset: Option<Vec<usize>>,
}

/// A byte range of a data file (`_StorageInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageInfo {
    /// The data file, relative to the checkpoint directory.
    pub relative_path: String,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub length: u64,
    /// Stream transforms applied when saving (compression etc.); empty for plain files.
    pub transforms: Vec<String>,
}

/// A DCP checkpoint's `.metadata`.
#[derive(Debug, Clone, PartialEq)]
pub struct Metadata {
    /// `state_dict_metadata`, in its order (a repeated key keeps its first place and its last
    /// value, as in a Python dict).
    pub entries: Vec<Entry>,
    /// `storage_data`. PyTorch looks at a record only when a chunk or value needs it, so a
    /// malformed one is kept with what is wrong with it, and reported when it is used.
    pub storage: HashMap<StorageKey, std::result::Result<StorageInfo, String>>,
    /// `storage_meta.checkpoint_id`, as recorded.
    pub checkpoint_id: Option<String>,
    /// The DCP format version (`1.0.0`).
    pub version: Option<String>,
    /// How many save plans `all_local_plans` holds (one per rank that took part in the save;
    /// Megatron-Core keeps them there), `None` without that attribute or when it is no list.
    pub saved_plans: Option<usize>,
}

/// Most chunks one tensor may have (the overlap check compares pairs of chunks).
pub(crate) const MAX_CHUNKS_PER_TENSOR: usize = 1 << 14;

/// Whether PyTorch's loader reads a saved chunk at `offsets` of `sizes` into a tensor of
/// shape `size` (its overlap test against the whole tensor: in every dimension the chunk
/// starts before the tensor ends and ends after it starts). A chunk it does not read needs
/// no valid offsets, sizes or storage.
fn overlaps_tensor(size: &[usize], offsets: &[i64], sizes: &[i64]) -> bool {
    size.iter()
        .zip(offsets.iter().zip(sizes))
        .all(|(&d, (&o, &s))| i128::from(o) < d as i128 && i128::from(o) + i128::from(s) > 0)
}

/// Reads the records of the `.metadata` bytes `data` (`file` names it in errors), their paths
/// not yet checked ([`super::parse_metadata`] checks them).
pub(super) fn extract_metadata(file: &str, data: &[u8]) -> Result<Metadata> {
    let p = unpickle::unpickle(file, data)?;
    // Shared references (the memo) let a small pickle name one object many times; what is
    // built from it may hold at most this many items and string bytes.
    let budget = std::cell::Cell::new(data.len().saturating_mul(16).saturating_add(1 << 16));
    Extract {
        file,
        p: &p,
        budget,
        exhausted: std::cell::Cell::new(false),
    }
    .metadata()
}

struct Extract<'a> {
    file: &'a str,
    p: &'a Pickled,
    budget: std::cell::Cell<usize>,
    /// Set once the budget has run out (every later error is that one).
    exhausted: std::cell::Cell<bool>,
}

impl Extract<'_> {
    /// Counts `n` items or bytes against the budget.
    fn charge(&self, n: usize) -> Result<()> {
        match self.budget.get().checked_sub(n) {
            Some(left) => {
                self.budget.set(left);
                Ok(())
            }
            None => {
                self.exhausted.set(true);
                Err(self.err(
                "the metadata expands to far more objects than its size allows (shared references)",
            ))
            }
        }
    }

    /// An owned copy of the string `v`, charged to the budget.
    fn string(&self, v: &V, what: &str) -> Result<String> {
        let s = self.str(v, what)?;
        self.charge(s.len() + 1)?;
        Ok(s.to_string())
    }

    fn err(&self, reason: impl Into<String>) -> Error {
        Error::DcpMetadata {
            file: self.file.to_string(),
            reason: reason.into(),
        }
    }

    fn node(&self, v: &V) -> Option<&Node> {
        match v {
            V::Obj(i) => self.p.arena.get(*i),
            _ => None,
        }
    }

    fn dict(&self, v: &V, what: &str) -> Result<&[(V, V)]> {
        match self.node(v) {
            Some(Node::Dict(d)) => Ok(d.items()),
            _ => Err(self.err(format!("{what} is not a dict"))),
        }
    }

    fn seq(&self, v: &V, what: &str) -> Result<&[V]> {
        match self.node(v) {
            Some(Node::Tuple(s) | Node::List(s)) => Ok(s),
            _ => Err(self.err(format!("{what} is not a tuple or list"))),
        }
    }

    fn str<'v>(&self, v: &'v V, what: &str) -> Result<&'v str> {
        match v {
            V::Str(s) => Ok(s),
            _ => Err(self.err(format!("{what} is not a string"))),
        }
    }

    fn uint(&self, v: &V, what: &str) -> Result<u64> {
        match v {
            V::Int(i) if *i >= 0 => Ok(*i as u64),
            _ => Err(self.err(format!("{what} is not a non-negative int"))),
        }
    }

    fn dims(&self, v: &V, what: &str) -> Result<Vec<usize>> {
        self.ints(v, what)?
            .into_iter()
            .map(|d| usize::try_from(d).map_err(|_| self.err(format!("{what}: {d} is not a size"))))
            .collect()
    }

    /// A `torch.Size` or sequence of ints, any sign (as Python's `torch.Size` takes them).
    fn ints(&self, v: &V, what: &str) -> Result<Vec<i64>> {
        let items = self.seq(v, what)?;
        self.charge(items.len() + 1)?;
        items
            .iter()
            .map(|x| match x {
                V::Int(i) => Ok(*i),
                _ => Err(self.err(format!("{what} is not a sequence of ints"))),
            })
            .collect()
    }

    /// The attributes of the root object (PyTorch reads only its attributes).
    fn root_attrs(&self) -> Result<HashMap<&str, &V>> {
        self.attrs(&self.p.root, Class::Metadata, "the root object")
    }

    /// The attributes of an instance of `class` (its `BUILD` dict).
    ///
    /// Where PyTorch only reads the object's attributes (the root `Metadata`, a chunk, a
    /// `_StorageInfo`), an instance of another DCP dataclass whose `BUILD` gave it those
    /// attributes reads the same, as it does in PyTorch; not a `TensorProperties` (whose
    /// `__setstate__` takes a tuple) or an enum member. Where PyTorch tests the class
    /// (`isinstance` of `TensorStorageMetadata`) or hashes the object (`MetadataIndex`), the
    /// class must be the one named.
    fn attrs(&self, v: &V, class: Class, what: &str) -> Result<HashMap<&str, &V>> {
        let duck_typed = matches!(
            class,
            Class::Metadata | Class::ChunkStorageMetadata | Class::StorageInfo | Class::StorageMeta
        );
        let state = match self.node(v) {
            Some(Node::Ext(Instance(c, s))) if *c == class => s.as_ref(),
            Some(Node::Ext(Instance(c, s)))
                if duck_typed && !matches!(c, Class::TensorProperties) && !c.is_enum() =>
            {
                s.as_ref()
            }
            _ => return Err(self.err(format!("{what} is not a {class:?}"))),
        };
        let mut out = HashMap::new();
        if let Some(s) = state {
            // Python's BUILD sets non-string keys too; no field of a DCP class is one.
            for (k, v) in self.dict(s, what)? {
                if let V::Str(k) = k {
                    out.insert(&**k, v);
                }
            }
        }
        Ok(out)
    }

    fn metadata(&self) -> Result<Metadata> {
        let a = self.root_attrs()?;
        let sdm = a
            .get("state_dict_metadata")
            .ok_or_else(|| self.err("Metadata has no state_dict_metadata"))?;
        let planner = match a.get("planner_data") {
            Some(v) if !matches!(v, V::None) => self.planner_data(v)?,
            _ => HashMap::new(),
        };
        let mut entries: Vec<Entry> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        for (k, v) in self.dict(sdm, "state_dict_metadata")? {
            let key = self.string(k, "a state_dict_metadata key")?;
            let kind = self.entry_kind(&key, v)?;
            let path = match planner.get(&key) {
                Some(p) => Some(self.path(&key, p)?),
                None => None,
            };
            self.charge(path.as_ref().map_or(0, Vec::len))?;
            let e = Entry { key, path, kind };
            match at.get(&e.key) {
                Some(&i) => entries[i] = e,
                None => {
                    at.insert(e.key.clone(), entries.len());
                    entries.push(e);
                }
            }
        }
        let storage = match a.get("storage_data") {
            Some(v) => self.storage_data(v)?,
            None => return Err(self.err("Metadata has no storage_data")),
        };
        let checkpoint_id = match a.get("storage_meta") {
            None | Some(V::None) => None,
            Some(v) => self.checkpoint_id(v)?,
        };
        let version = match a.get("version") {
            Some(V::Str(s)) => Some(s.to_string()),
            _ => None,
        };
        let saved_plans = match a.get("all_local_plans").map(|v| self.node(v)) {
            Some(Some(Node::List(plans))) => Some(plans.len()),
            _ => None,
        };
        Ok(Metadata {
            entries,
            storage,
            checkpoint_id,
            version,
            saved_plans,
        })
    }

    /// `storage_meta.checkpoint_id`. PyTorch's reader only sets `load_id` on `storage_meta`,
    /// which any instance of DCP's classes, a class or a function takes; on other values
    /// (an int, a string, a tuple, a dtype, ...) it fails.
    fn checkpoint_id(&self, v: &V) -> Result<Option<String>> {
        match (v, self.node(v)) {
            (_, Some(Node::Ext(Instance(Class::StorageMeta, _)))) => {
                let sm = self.attrs(v, Class::StorageMeta, "storage_meta")?;
                Ok(match sm.get("checkpoint_id") {
                    Some(V::Str(s)) => Some(s.to_string()),
                    _ => None,
                })
            }
            (_, Some(Node::Ext(Instance(..))))
            | (V::Global(Global::Class(_) | Global::Path | Global::GetLayout), _) => Ok(None),
            _ => Err(self.err(
                "storage_meta is a value PyTorch's reader cannot set `load_id` on (not a StorageMeta)",
            )),
        }
    }

    /// `planner_data`'s paths by key, unparsed: PyTorch looks a path up only by a key of
    /// `state_dict_metadata`, so another key (not a string, or naming no entry) and its path
    /// are never used.
    fn planner_data<'v>(&'v self, v: &'v V) -> Result<HashMap<String, &'v V>> {
        let mut out = HashMap::new();
        for (k, p) in self.dict(v, "planner_data")? {
            if let V::Str(_) = k {
                out.insert(self.string(k, "a planner_data key")?, p);
            }
        }
        Ok(out)
    }

    /// The path `p` of `key` in `planner_data`.
    fn path(&self, key: &str, p: &V) -> Result<Vec<PathItem>> {
        let what = format!("planner_data[{:?}]", crate::error::shown(key));
        let items = self.seq(p, &what)?;
        if items.len() > MAX_PATH_LEN {
            return Err(self.err(format!(
                "{what} is {} steps long, more than {MAX_PATH_LEN}",
                items.len()
            )));
        }
        let mut path = Vec::new();
        for item in items {
            path.push(match item {
                v @ V::Str(_) => PathItem::Key(self.string(v, &what)?),
                V::Int(i) if *i >= 0 => PathItem::Index(*i as usize),
                V::Int(i) => {
                    PathItem::FromEnd(usize::try_from(i.unsigned_abs()).unwrap_or(usize::MAX))
                }
                _ => {
                    return Err(self.err(format!(
                        "{what} holds an item that is neither a string nor an int"
                    )))
                }
            });
        }
        if path.is_empty() {
            return Err(self.err(format!("{what} is empty")));
        }
        Ok(path)
    }

    fn entry_kind(&self, key: &str, v: &V) -> Result<EntryKind> {
        if let Some(Node::Ext(Instance(Class::BytesStorageMetadata, _))) = self.node(v) {
            return Ok(EntryKind::Bytes);
        }
        let what = format!("state_dict_metadata[{:?}]", crate::error::shown(key));
        let a = self.attrs(v, Class::TensorStorageMetadata, &what)?;
        let get = |n: &str| {
            a.get(n)
                .copied()
                .ok_or_else(|| self.err(format!("{what} has no {n}")))
        };
        let dtype = self.dtype(get("properties")?, &what)?;
        let size = self.dims(get("size")?, &format!("{what}.size"))?;
        let mut chunks = Vec::new();
        let listed = self.seq(get("chunks")?, &format!("{what}.chunks"))?;
        if listed.len() > MAX_CHUNKS_PER_TENSOR {
            return Err(self.err(format!(
                "{what} has {} chunks, more than the {} accepted per tensor",
                listed.len(),
                MAX_CHUNKS_PER_TENSOR
            )));
        }
        for c in listed {
            let ca = self.attrs(
                c,
                Class::ChunkStorageMetadata,
                &format!("a chunk of {what}"),
            )?;
            let dim = |n: &str| match ca.get(n) {
                Some(v) => self.ints(v, &format!("a chunk's {n} in {what}")),
                None => Err(self.err(format!("a chunk of {what} has no {n}"))),
            };
            let (offsets, sizes) = (dim("offsets")?, dim("sizes")?);
            if offsets.iter().chain(&sizes).all(|&d| d >= 0) {
                chunks.push(Chunk {
                    offsets: offsets.iter().map(|&d| d as usize).collect(),
                    sizes: sizes.iter().map(|&d| d as usize).collect(),
                });
            } else if overlaps_tensor(&size, &offsets, &sizes) {
                return Err(self.err(format!(
                    "a chunk of {what} at {offsets:?} of size {sizes:?} has a negative offset or size"
                )));
            }
            // Else PyTorch never reads the chunk (it meets no element of the tensor).
        }
        Ok(EntryKind::Tensor(TensorMeta {
            dtype,
            size,
            chunks,
        }))
    }

    /// The dtype name of a `TensorProperties` (pickled as a `__getstate__` tuple whose first
    /// item is the dtype, or as an attribute dict).
    fn dtype(&self, v: &V, what: &str) -> Result<String> {
        let state = match self.node(v) {
            Some(Node::Ext(Instance(Class::TensorProperties, Some(s)))) => s,
            _ => return Err(self.err(format!("{what}.properties is not a TensorProperties"))),
        };
        let d = match self.node(state) {
            // `TensorProperties.__setstate__` unpacks exactly (dtype, layout, requires_grad,
            // memory-format encoding, pin_memory) and refuses an encoding that is not one.
            Some(Node::Tuple(t)) => {
                if t.len() != 5 {
                    return Err(self.err(format!(
                        "{what}.properties has {} fields, not the 5 of a TensorProperties",
                        t.len()
                    )));
                }
                if !matches!(
                    self.node(&t[3]),
                    Some(Node::Ext(Instance(Class::MemFormatEncoding, _)))
                ) {
                    return Err(
                        self.err(format!("{what}.properties has no memory-format encoding"))
                    );
                }
                t.first()
            }
            Some(Node::Dict(d)) => d
                .items()
                .iter()
                .find(|(k, _)| matches!(k, V::Str(s) if &**s == "dtype"))
                .map(|(_, v)| v),
            _ => None,
        };
        match d {
            Some(V::Global(Global::Dtype(name))) => Ok(name.to_string()),
            _ => Err(self.err(format!("{what}.properties has no torch dtype"))),
        }
    }

    fn storage_data(
        &self,
        v: &V,
    ) -> Result<HashMap<StorageKey, std::result::Result<StorageInfo, String>>> {
        let mut out = HashMap::new();
        for (k, s) in self.dict(v, "storage_data")? {
            let ka = self.attrs(k, Class::MetadataIndex, "a storage_data key")?;
            let fqn = match ka.get("fqn") {
                Some(f) => self.string(f, "MetadataIndex.fqn")?,
                None => return Err(self.err("a MetadataIndex has no fqn")),
            };
            let what = format!("storage_data[{:?}]", crate::error::shown(&fqn));
            let offset = match ka.get("offset") {
                Some(V::None) | None => None,
                Some(o) => match self.ints(o, &format!("{what}.offset"))? {
                    // No chunk is looked up at a negative offset: PyTorch never reads it.
                    o if o.iter().any(|&d| d < 0) => continue,
                    o => Some(o.into_iter().map(|d| d as usize).collect()),
                },
            };
            let info = match self.storage_info(s, &what) {
                Ok(info) => Ok(info),
                Err(e) if self.exhausted.get() => return Err(e),
                Err(Error::DcpMetadata { reason, .. }) => Err(reason),
                Err(e) => return Err(e),
            };
            out.insert(StorageKey { fqn, offset }, info);
        }
        Ok(out)
    }

    /// A `_StorageInfo` record.
    fn storage_info(&self, s: &V, what: &str) -> Result<StorageInfo> {
        let sa = self.attrs(s, Class::StorageInfo, what)?;
        let get = |n: &str| {
            sa.get(n)
                .copied()
                .ok_or_else(|| self.err(format!("{what} has no {n}")))
        };
        let transforms = match sa.get("transform_descriptors") {
            Some(V::None) | None => Vec::new(),
            Some(t) => self
                .seq(t, what)?
                .iter()
                .map(|x| self.string(x, "a transform descriptor"))
                .collect::<Result<_>>()?,
        };
        Ok(StorageInfo {
            relative_path: self.string(get("relative_path")?, what)?,
            offset: self.uint(get("offset")?, &format!("{what}.offset"))?,
            length: self.uint(get("length")?, &format!("{what}.length"))?,
            transforms,
        })
    }
}
