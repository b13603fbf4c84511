//! State dicts as single `.safetensors` files that Python's `safetensors` reads directly, and
//! that come back as the same [`PyObj`] (same keys, key types, order and non-tensor values,
//! bit-equal tensors).
//!
//! # Mapping
//!
//! Every tensor anywhere in the object becomes one safetensors tensor (0-dim tensors
//! included, with shape `[]`), named by its path from the root: the keys of dicts and indices
//! of lists and tuples joined with `/`. An `int` key is written in decimal, a `str` key as it
//! is, any other key as its [`PyObj::describe`] text. So:
//!
//! | object | tensor names |
//! | --- | --- |
//! | optimizer state dict (`optim.state_dict()`) | `state/<key>/<state name>` (`state/0/exp_avg`, `state/layer.weight/step`); a tensor hyper-parameter `param_groups/<i>/<option>` |
//! | model state dict (`module.state_dict()`) | the parameter or buffer name itself (`layer.weight`) |
//! | nested values | one more segment per level (`state/0/betas/1`) |
//!
//! If two paths give the same name (a key containing `/`), or a name would be the reserved
//! `__metadata__` or empty, the later tensor gets the first free name of `<name>#2`,
//! `<name>#3`, …; the metadata below records which name each tensor got, so the mapping back
//! never depends on parsing names.
//!
//! The header's `__metadata__` holds two entries: `format: "pt"` (the convention of
//! `safetensors.torch`) and [`OBJECT_KEY`], the object's structure as JSON with every tensor
//! replaced by a reference to its name:
//!
//! | Python value | JSON |
//! | --- | --- |
//! | `None`, `bool`, `str` | `null`, `true`/`false`, a string |
//! | `int` (64-bit) | a JSON integer |
//! | `int` (beyond 64 bits) | `{"bigint": "<hex of the little-endian two's-complement bytes>"}` |
//! | `float` | `{"float": "<Rust's shortest round-trip text>"}` (`"0.9"`, `"1e-8"`, `"inf"`); NaN as `"nan:<hex bits>"` so its payload survives |
//! | `bytes` | `{"bytes": "<hex>"}` |
//! | `list` | a JSON array |
//! | `tuple` | `{"tuple": [...]}` |
//! | `torch.Size` | `{"size": [...]}` |
//! | `dict` | `{"dict": [[key, value], ...]}` in order (keys keep their type) |
//! | `collections.OrderedDict` | `{"odict": [[key, value], ...], "attrs": [["name", value], ...]}` (a model state dict's `_metadata` goes in `attrs`) |
//! | tensor | `{"tensor": "<name in the file>"}` |
//! | sharded tensor (`ShardedTensor`, `DTensor`) | `{"sharded": {"global_shape": [...], "offsets": [...], "local": {"tensor": "<name>"} or null}}` |
//!
//! A safetensors file without [`OBJECT_KEY`] (written by another tool) reads as an
//! `OrderedDict` of its tensors, sorted by name (the order `safetensors.torch.load_file`
//! gives).
//!
//! Tensors that share storage in a `torch.save` file are written as separate tensors
//! (safetensors has no aliasing), so they come back equal but no longer shared.
//!
//! ```
//! use fsdp::io::{safetensors, torch_save::PyObj};
//! use fsdp::HostTensor;
//!
//! let sd = PyObj::Dict(vec![
//!     (PyObj::Str("state".into()), PyObj::Dict(vec![(
//!         PyObj::Int(0),
//!         PyObj::Dict(vec![(PyObj::Str("step".into()), PyObj::Tensor(HostTensor::scalar(3.0f32)))]),
//!     )])),
//!     (PyObj::Str("param_groups".into()), PyObj::List(vec![])),
//! ]);
//! let bytes = safetensors::save_to_bytes(&sd).unwrap();
//! assert_eq!(safetensors::tensor_names(&sd), ["state/0/step"]);
//! assert!(safetensors::load_from_bytes(&bytes).unwrap().bit_eq(&sd));
//! ```

pub(crate) mod header;

use super::torch_save::{PyObj, SavedModelStateDict};
use crate::error::{Error, Result};
use crate::optim_state::OptimStateDict;
use crate::tensor::{DType, HostTensor};
use ::safetensors::tensor::{Dtype, View};
use serde_json::{json, Value as Json};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The `__metadata__` entry holding the object's structure (see the module docs).
pub const OBJECT_KEY: &str = "fsdp.pyobj.v1";

/// Name used for in-memory files in error messages.
const MEMORY: &str = "<memory>";

/// The `safetensors` crate's dtype for `d`, by its name in the one dtype table; `None` for
/// the dtypes safetensors has no name for (refused before anything is laid out).
pub(crate) fn to_st_dtype(d: DType) -> Option<Dtype> {
    use serde::de::IntoDeserializer;
    use serde::Deserialize;
    let name: serde::de::value::StrDeserializer<'_, serde::de::value::Error> =
        d.safetensors_name()?.into_deserializer();
    Dtype::deserialize(name).ok()
}

/// Checks that safetensors can store `t` (named `name`): its dtype has a safetensors name.
pub(crate) fn check_storable(name: &str, t: &HostTensor) -> Result<()> {
    match to_st_dtype(t.dtype()) {
        Some(_) => Ok(()),
        None => Err(Error::TensorNotStorable {
            tensor: name.to_string(),
            shape: t.shape().to_vec(),
            reason: format!("safetensors has no dtype for {}", t.dtype()),
        }),
    }
}

/// The crate's dtype for the `safetensors` crate's `d`, if it has one.
fn from_st_dtype(d: Dtype) -> Option<DType> {
    DType::from_safetensors_name(&d.to_string())
}

/// A [`HostTensor`] as the `safetensors` crate's [`View`].
struct TensorRef<'a>(&'a HostTensor);

impl View for TensorRef<'_> {
    fn dtype(&self) -> Dtype {
        // Every tensor is checked by `check_storable` before it is laid out.
        to_st_dtype(self.0.dtype()).unwrap_or(Dtype::U8)
    }
    fn shape(&self) -> &[usize] {
        self.0.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.0.as_bytes())
    }
    fn data_len(&self) -> usize {
        self.0.nbytes()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn key_segment(key: &PyObj) -> String {
    match key {
        PyObj::Str(s) => s.clone(),
        PyObj::Int(i) => i.to_string(),
        other => other.describe(),
    }
}

/// Walks an object, naming tensors and building the JSON skeleton.
struct Encoder<'a> {
    used: HashSet<String>,
    tensors: Vec<(String, &'a HostTensor)>,
    /// The first value met that safetensors cannot hold.
    refused: Option<Error>,
    /// The sparse, quantized and meta tensors met, by name.
    others: Vec<(String, &'a crate::io::torch_save::RichTensor)>,
}

impl<'a> Encoder<'a> {
    /// Walks `obj`: the encoder with what it met, and the JSON skeleton.
    fn run(obj: &'a PyObj) -> (Self, Json) {
        let mut enc = Encoder {
            used: HashSet::new(),
            tensors: Vec::new(),
            refused: None,
            others: Vec::new(),
        };
        let skeleton = enc.encode(obj, "");
        (enc, skeleton)
    }

    fn name(&mut self, path: &str) -> String {
        let base = if path.is_empty() { "tensor" } else { path };
        let mut name = base.to_string();
        let mut n = 1;
        while name == "__metadata__" || self.used.contains(&name) {
            n += 1;
            name = format!("{base}#{n}");
        }
        self.used.insert(name.clone());
        name
    }

    fn child(path: &str, seg: &str) -> String {
        if path.is_empty() {
            seg.to_string()
        } else {
            format!("{path}/{seg}")
        }
    }

    fn pairs(&mut self, items: &'a [(PyObj, PyObj)], path: &str) -> Json {
        Json::Array(
            items
                .iter()
                .map(|(k, v)| {
                    let seg = key_segment(k);
                    // Keys are never tensors in a state dict; a tensor key is still stored.
                    let kj = self.encode(k, &Self::child(path, &format!("{seg}#key")));
                    json!([kj, self.encode(v, &Self::child(path, &seg))])
                })
                .collect(),
        )
    }

    fn encode(&mut self, obj: &'a PyObj, path: &str) -> Json {
        match obj {
            PyObj::None => Json::Null,
            PyObj::Bool(b) => Json::Bool(*b),
            PyObj::Int(i) => json!(i),
            PyObj::BigInt(b) => json!({ "bigint": hex(b) }),
            PyObj::Float(x) => json!({ "float": float_text(*x) }),
            PyObj::Str(s) => Json::String(s.clone()),
            PyObj::Bytes(b) => json!({ "bytes": hex(b) }),
            PyObj::List(xs) => Json::Array(
                xs.iter()
                    .enumerate()
                    .map(|(i, x)| self.encode(x, &Self::child(path, &i.to_string())))
                    .collect(),
            ),
            PyObj::Tuple(xs) => json!({ "tuple": xs
                .iter()
                .enumerate()
                .map(|(i, x)| self.encode(x, &Self::child(path, &i.to_string())))
                .collect::<Vec<_>>() }),
            PyObj::Size(dims) => json!({ "size": dims }),
            PyObj::Dict(items) => json!({ "dict": self.pairs(items, path) }),
            PyObj::OrderedDict { items, attrs } => {
                let items = self.pairs(items, path);
                let attrs: Vec<Json> = attrs
                    .iter()
                    .map(|(k, v)| json!([k, self.encode(v, &Self::child(path, &format!("@{k}")))]))
                    .collect();
                json!({ "odict": items, "attrs": attrs })
            }
            PyObj::Tensor(t) => {
                let name = self.name(path);
                self.tensors.push((name.clone(), t));
                json!({ "tensor": name })
            }
            // A Parameter or a tensor with attributes is stored by its values, as PyTorch's
            // own safetensors writer stores it.
            PyObj::RichTensor(r) => match r.dense() {
                Some(t) => {
                    let name = self.name(path);
                    self.tensors.push((name.clone(), t));
                    json!({ "tensor": name })
                }
                None => {
                    let name = self.name(path);
                    self.others.push((name, r));
                    self.refused
                        .get_or_insert_with(|| r.not_storable(path, "safetensors"));
                    Json::Null
                }
            },
            PyObj::Complex(re, im) => json!({ "complex": [float_text(*re), float_text(*im)] }),
            PyObj::Set(xs) => json!({ "set": xs
                .iter()
                .enumerate()
                .map(|(i, x)| self.encode(x, &Self::child(path, &i.to_string())))
                .collect::<Vec<_>>() }),
            PyObj::ByteArray(b) => json!({ "bytearray": hex(b) }),
            PyObj::Counter(items) => json!({ "counter": self.pairs(items, path) }),
            PyObj::Device(kind, index) => json!({ "device": [kind, index] }),
            PyObj::TorchConst(name) => json!({ "torch": name }),
            PyObj::Sharded(s) => {
                let local = match &s.local {
                    Some(t) => {
                        let name = self.name(path);
                        self.tensors.push((name.clone(), t));
                        json!({ "tensor": name })
                    }
                    None => Json::Null,
                };
                json!({ "sharded": {
                    "global_shape": s.global_shape,
                    "offsets": s.offsets,
                    "local": local,
                } })
            }
        }
    }
}

fn float_text(x: f64) -> String {
    if x.is_nan() {
        format!("nan:{:016x}", x.to_bits())
    } else {
        format!("{x:?}")
    }
}

fn parse_float(s: &str) -> Option<f64> {
    match s.strip_prefix("nan:") {
        Some(bits) => u64::from_str_radix(bits, 16).ok().map(f64::from_bits),
        None => s.parse().ok(),
    }
}

/// Every tensor of `obj` with the name it gets in a safetensors file, in the order they are
/// met (depth first, in dict order).
pub fn named_tensors(obj: &PyObj) -> Vec<(String, &HostTensor)> {
    Encoder::run(obj).0.tensors
}

/// The sparse, quantized and meta tensors of `obj`, which a safetensors file cannot hold,
/// named as [`named_tensors`] names tensors.
pub(crate) fn named_other_tensors(
    obj: &PyObj,
) -> Vec<(String, &crate::io::torch_save::RichTensor)> {
    Encoder::run(obj).0.others
}

/// The names the tensors of `obj` get in a safetensors file, in the order they are met.
pub fn tensor_names(obj: &PyObj) -> Vec<String> {
    named_tensors(obj).into_iter().map(|(n, _)| n).collect()
}

fn st_err(file: &str, reason: impl std::fmt::Display) -> Error {
    Error::Safetensors {
        file: file.to_string(),
        reason: reason.to_string(),
    }
}

/// Named tensors and `__metadata__` entries.
pub(crate) type Parts<T> = (Vec<(String, T)>, HashMap<String, String>);

/// The tensors of `obj` with their names, and the `__metadata__` entries describing it; an
/// error naming the first value safetensors cannot hold (a sparse or quantized tensor, a
/// dtype it has no name for).
pub(crate) fn parts(obj: &PyObj) -> Result<Parts<&HostTensor>> {
    let (tensors, meta) = prepare(obj)?;
    Ok((tensors.into_iter().map(|(n, t)| (n, t.0)).collect(), meta))
}

fn prepare(obj: &PyObj) -> Result<Parts<TensorRef<'_>>> {
    let (enc, skeleton) = Encoder::run(obj);
    if let Some(e) = enc.refused {
        return Err(e);
    }
    for (name, t) in &enc.tensors {
        check_storable(name, t)?;
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert(OBJECT_KEY.to_string(), skeleton.to_string());
    let tensors = enc
        .tensors
        .into_iter()
        .map(|(n, t)| (n, TensorRef(t)))
        .collect();
    Ok((tensors, meta))
}

/// The `.safetensors` entries of `dir` (every name ending so, as PyTorch's reader lists them),
/// sorted by name.
pub(crate) fn file_names(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(Error::io("listing", dir))? {
        let name = e.map_err(Error::io("listing", dir))?.file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".safetensors") {
            names.push(name.into_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// The largest header safetensors readers accept (the `safetensors` crate's limit).
const MAX_HEADER_BYTES: usize = 100_000_000;

/// The file's header (length prefix included) and its tensors in data order: sorted by
/// descending dtype alignment, then name, as the `safetensors` crate lays them out, with the
/// `__metadata__` keys sorted, so the same object always gives the same bytes.
fn layout<'o>(obj: &'o PyObj, file: &str) -> Result<(Vec<u8>, Vec<&'o HostTensor>)> {
    let (tensors, meta) = parts(obj)?;
    let mut tensors: Vec<(String, &HostTensor)> = tensors;
    tensors.sort_by(|(ln, l), (rn, r)| {
        to_st_dtype(r.dtype())
            .cmp(&to_st_dtype(l.dtype()))
            .then(ln.cmp(rn))
    });
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, t) in &tensors {
        let numel = t.shape().iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = numel.and_then(|n| n.checked_mul(t.dtype().size()));
        if bytes.is_none() {
            return Err(Error::TensorNotStorable {
                tensor: name.clone(),
                shape: t.shape().to_vec(),
                reason: "its element count overflows 64 bits, which a safetensors header cannot describe".into(),
            });
        }
        entries.push(header::Entry {
            name: name.clone(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            nbytes: t.nbytes() as u64,
        });
    }
    let meta: std::collections::BTreeMap<String, String> = meta.into_iter().collect();
    let (header, _) = header::encode(&entries, &meta, &|e| {
        format!("the path `{}` of the object", e.name)
    })?;
    if header.len() - 8 > MAX_HEADER_BYTES {
        return Err(Error::Serialization {
            what: format!("the safetensors header of `{file}`"),
            reason: format!(
                "{} bytes, over the {MAX_HEADER_BYTES}-byte limit of safetensors readers",
                header.len() - 8
            ),
        });
    }
    Ok((header, tensors.into_iter().map(|(_, t)| t).collect()))
}

/// Writes `obj` to `path` as one safetensors file (see the module docs for the mapping),
/// atomically: a temporary file beside `path` (`.NAME.PID.N.tmp`) is written, synced and
/// renamed over it. The bytes depend only on `obj`; the mode is 0644 less the umask. A write
/// failure (disk full, read-only file system) is [`Error::Io`] naming the file and the
/// operating system's error.
pub fn save(obj: &PyObj, path: impl AsRef<Path>) -> Result<()> {
    use std::io::Write;
    let path = path.as_ref();
    let (header, tensors) = layout(obj, &path.display().to_string())?;
    crate::storage::write_file_atomic(path, |w, tmp| {
        let err = crate::storage::tmp_io_err("writing", path, tmp);
        w.write_all(&header).map_err(&err)?;
        for t in tensors {
            w.write_all(t.as_bytes()).map_err(&err)?;
        }
        Ok(())
    })
}

/// The layout of a `.safetensors` file of an object whose placeholder tensors a
/// [`LazyTensors`](super::torch_save::writer::LazyTensors) streams, known before any byte is
/// written: the file [`save`] writes of the object holding the real tensors.
pub(crate) struct LazyPlan<'o> {
    tensors: Vec<(String, &'o HostTensor)>,
    header: Vec<u8>,
    /// File offset of each tensor's data.
    starts: Vec<u64>,
    /// Bytes of each tensor's data.
    lens: Vec<u64>,
}

impl<'o> LazyPlan<'o> {
    /// Plans `obj` (written as `file`), the real shape of each placeholder given by `lazy`.
    pub(crate) fn new(
        obj: &'o PyObj,
        file: &str,
        lazy: &dyn super::torch_save::writer::LazyTensors,
    ) -> Result<Self> {
        let (tensors, meta) = parts(obj)?;
        let entries: Vec<header::Entry> = tensors
            .iter()
            .map(|(name, t)| {
                let shape = lazy.shape_of(t).unwrap_or_else(|| t.shape().to_vec());
                let nbytes = (shape.iter().product::<usize>() * t.dtype().size()) as u64;
                header::Entry {
                    name: name.clone(),
                    dtype: t.dtype(),
                    shape,
                    nbytes,
                }
            })
            .collect();
        let meta: std::collections::BTreeMap<String, String> = meta.into_iter().collect();
        let (header, starts) = header::encode(&entries, &meta, &|e| {
            format!("the path `{}` of the object", e.name)
        })?;
        if header.len() - 8 > MAX_HEADER_BYTES {
            return Err(Error::Serialization {
                what: format!("the safetensors header of `{file}`"),
                reason: format!(
                    "{} bytes, over the {MAX_HEADER_BYTES}-byte limit of safetensors readers",
                    header.len() - 8
                ),
            });
        }
        Ok(LazyPlan {
            tensors,
            header,
            starts,
            lens: entries.iter().map(|e| e.nbytes).collect(),
        })
    }

    /// The file's length.
    pub(crate) fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.lens.iter().sum::<u64>()
    }

    /// Writes the header at the start of `file`, the temporary `tmp` of `out`.
    pub(crate) fn write_header(&self, file: &std::fs::File, out: &Path, tmp: &Path) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let err = crate::storage::tmp_io_err("writing", out, tmp);
        file.write_all_at(&self.header, 0).map_err(err)
    }

    /// Writes process `rank`'s share (of `world_size`) of the tensors' data at their places
    /// in `file` (the temporary `tmp` of `out`): the data is cut into `world_size` spans of
    /// equal bytes, and each tensor goes to the process whose span holds its first byte.
    /// Placeholders are streamed by `lazy`, which is finished at the end. Returns the bytes
    /// written.
    pub(crate) fn write_share(
        &self,
        lazy: &mut dyn super::torch_save::writer::LazyTensors,
        (file, out, tmp): (&std::fs::File, &Path, &Path),
        (rank, world_size): (usize, usize),
    ) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let err = crate::storage::tmp_io_err("writing", out, tmp);
        let data = self.lens.iter().sum::<u64>();
        let mut writeback = crate::storage::Writeback::new(0);
        let mut written = 0u64;
        for (i, (name, t)) in self.tensors.iter().enumerate() {
            let from = self.starts[i] - self.header.len() as u64;
            if crate::storage::writer_of(from, data, world_size) != rank {
                continue;
            }
            let (start, end) = (self.starts[i], self.starts[i] + self.lens[i]);
            if lazy.shape_of(t).is_none() {
                file.write_all_at(t.as_bytes(), start).map_err(&err)?;
                written += t.nbytes() as u64;
                continue;
            }
            let mut at = start;
            let mut failed: Option<std::io::Error> = None;
            let streamed = lazy.stream(t, &mut |chunk| {
                let mut put = || -> std::io::Result<()> {
                    if at + chunk.len() as u64 > end {
                        return Err(std::io::Error::other(format!(
                            "tensor `{name}` streamed more than its {} planned bytes",
                            end - start
                        )));
                    }
                    file.write_all_at(chunk, at)?;
                    writeback.wrote_at(file, at, chunk.len() as u64)
                };
                put().map_err(|e| {
                    let kind = e.kind();
                    failed = Some(e);
                    std::io::Error::from(kind)
                })?;
                at += chunk.len() as u64;
                Ok(())
            });
            if let Some(e) = failed {
                return Err(err(e));
            }
            streamed?;
            if at != end {
                return Err(Error::Internal(format!(
                    "tensor `{name}` of {} streamed {} of its {} planned bytes",
                    out.display(),
                    at - start,
                    end - start
                )));
            }
            written += end - start;
        }
        lazy.finish()?;
        Ok(written)
    }
}

/// Serializes `obj` as a safetensors file in memory (the bytes [`save`] writes).
pub fn save_to_bytes(obj: &PyObj) -> Result<Vec<u8>> {
    let (mut out, tensors) = layout(obj, MEMORY)?;
    for t in tensors {
        out.extend_from_slice(t.as_bytes());
    }
    Ok(out)
}

/// Reads the object stored in the safetensors file at `path`.
pub fn load(path: impl AsRef<Path>) -> Result<PyObj> {
    let path = path.as_ref();
    let name = path.display().to_string();
    // A regular file only: a FIFO would block and a device never end.
    let f = open_input(path)?;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut bytes).map_err(Error::io("reading", path))?;
    read(&name, &bytes)
}

/// Reads the object stored in a safetensors file held in memory.
pub fn load_from_bytes(bytes: &[u8]) -> Result<PyObj> {
    read(MEMORY, bytes)
}

fn read(file: &str, bytes: &[u8]) -> Result<PyObj> {
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| st_err(file, "the file is shorter than the 8-byte header length"))?;
    let len = bytes.len() as u64;
    if n > MAX_HEADER || n + 8 > len {
        return Err(st_err(
            file,
            format!(
                "the header length {n} does not fit the file ({len} bytes; at most {MAX_HEADER})"
            ),
        ));
    }
    let parsed: ParsedHeader = serde_json::from_slice(&bytes[8..8 + n as usize])
        .map_err(|e| st_err(file, format!("invalid header: {e}")))?;
    let raw = checked_header(file, parsed, 8 + n, len)?;
    let skeleton = raw.metadata.as_ref().and_then(|m| m.get(OBJECT_KEY));
    let tensors = raw
        .tensors
        .iter()
        .map(|t| {
            let data = &bytes[t.range.start as usize..t.range.end as usize];
            HostTensor::from_bytes(t.dtype, &t.shape, data)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| st_err(file, format!("tensor `{}`: {e}", t.name)))
        })
        .collect::<Result<Vec<_>>>()?;
    build(file, tensors, skeleton)
}

/// One tensor of a safetensors header, by the name the header gives it (what the
/// `safetensors` library and transformers read).
#[derive(Debug, Clone)]
pub(crate) struct HeaderTensor {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// Its bytes' range in the file.
    pub(crate) range: std::ops::Range<u64>,
}

/// The header of a `.safetensors` file, checked as the `safetensors` library checks it
/// (`read_metadata`): tensor byte ranges that tile the data exactly, each as long as its dtype
/// and shape say, the data ending where the file does; and, beyond it, no name twice.
pub(crate) struct RawHeader {
    /// The tensors in name order.
    pub(crate) tensors: Vec<HeaderTensor>,
    /// The `__metadata__` entries.
    pub(crate) metadata: Option<HashMap<String, String>>,
}

/// The header's JSON object as parsed: `__metadata__` and the tensors in the header's order.
struct ParsedHeader {
    metadata: Option<HashMap<String, String>>,
    tensors: Vec<(String, TensorInfo)>,
}

/// One tensor entry of a header, as the `safetensors` library's `TensorInfo` parses it (the
/// same fields and messages), its shape allocated at its exact length (a header of a
/// million tensors holds a million shapes).
#[derive(serde::Deserialize)]
struct TensorInfo {
    dtype: Dtype,
    #[serde(deserialize_with = "exact_shape")]
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// A shape parsed as `Vec<usize>` parses it, into a vector of exactly its length.
fn exact_shape<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<usize>, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Vec<usize>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a sequence")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Vec<usize>, A::Error> {
            let (mut head, mut rest, mut n) = ([0usize; 8], Vec::new(), 0);
            while let Some(d) = seq.next_element::<usize>()? {
                match head.get_mut(n) {
                    Some(slot) => *slot = d,
                    None => rest.push(d),
                }
                n += 1;
            }
            let mut out = Vec::with_capacity(n);
            out.extend_from_slice(&head[..n.min(head.len())]);
            out.extend(rest);
            Ok(out)
        }
    }
    d.deserialize_seq(V)
}

impl<'de> serde::Deserialize<'de> for ParsedHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = ParsedHeader;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a safetensors header (a JSON object of tensors)")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<ParsedHeader, A::Error> {
                let mut out = ParsedHeader {
                    metadata: None,
                    tensors: Vec::with_capacity(map.size_hint().unwrap_or(0)),
                };
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if out.metadata.is_some() {
                            return Err(serde::de::Error::duplicate_field("__metadata__"));
                        }
                        out.metadata = Some(map.next_value()?);
                    } else {
                        out.tensors.push((key, map.next_value()?));
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// The `__metadata__` of a header's JSON object, every tensor entry skipped unparsed.
struct MetadataOnly(Option<HashMap<String, String>>);

impl<'de> serde::Deserialize<'de> for MetadataOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = MetadataOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a safetensors header (a JSON object of tensors)")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<MetadataOnly, A::Error> {
                let mut out = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "__metadata__" {
                        if out.is_some() {
                            return Err(serde::de::Error::duplicate_field("__metadata__"));
                        }
                        out = Some(map.next_value()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(MetadataOnly(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// The header bytes of the regular file `path` (its length checked against the file's and
/// [`MAX_HEADER`]) and the file's length.
fn header_bytes(path: &Path) -> Result<(Vec<u8>, u64)> {
    use std::os::unix::fs::FileExt;
    let file = path.display().to_string();
    let f = open_input(path)?;
    let len = f.metadata().map_err(Error::io("reading", path))?.len();
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0)
        .map_err(|_| st_err(&file, "the file is shorter than the 8-byte header length"))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n + 8 > len {
        return Err(st_err(
            &file,
            format!(
                "the header length {n} does not fit the file ({len} bytes; at most {MAX_HEADER})"
            ),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact_at(&mut header, 8)
        .map_err(Error::io("reading", path))?;
    Ok((header, len))
}

/// The `__metadata__` entries of the `.safetensors` file at `path`, read without building its
/// tensors' entries (a header of a million tensors parses in a fraction of a second).
pub(crate) fn header_metadata(path: &Path) -> Result<Option<HashMap<String, String>>> {
    let (header, _) = header_bytes(path)?;
    serde_json::from_slice::<MetadataOnly>(&header)
        .map(|m| m.0)
        .map_err(|e| st_err(&path.display().to_string(), format!("invalid header: {e}")))
}

/// Reads and checks the header of the regular file `path` (see [`RawHeader`]). Memory holds
/// the header's bytes while it is parsed, then one compact entry per tensor.
pub(crate) fn read_header(path: &Path) -> Result<RawHeader> {
    let file = path.display().to_string();
    let (header, len) = header_bytes(path)?;
    let parsed: ParsedHeader = serde_json::from_slice(&header)
        .map_err(|e| st_err(&file, format!("invalid header: {e}")))?;
    let data_start = 8 + header.len() as u64;
    drop(header);
    checked_header(&file, parsed, data_start, len)
}

/// The tensors of `parsed` checked against a file of `len` bytes whose data starts at
/// `data_start`, in name order.
fn checked_header(
    file: &str,
    parsed: ParsedHeader,
    data_start: u64,
    len: u64,
) -> Result<RawHeader> {
    let mut dtypes: Vec<(Dtype, DType)> = Vec::new();
    let mut tensors = Vec::with_capacity(parsed.tensors.len());
    for (name, info) in parsed.tensors {
        let dtype = match dtypes.iter().find(|(st, _)| *st == info.dtype) {
            Some((_, d)) => *d,
            None => {
                let d = from_st_dtype(info.dtype).ok_or_else(|| {
                    st_err(
                        file,
                        format!(
                            "tensor `{name}` has dtype {:?}, which is not supported",
                            info.dtype
                        ),
                    )
                })?;
                dtypes.push((info.dtype, d));
                d
            }
        };
        let (s, e) = info.data_offsets;
        tensors.push(HeaderTensor {
            name,
            dtype,
            shape: info.shape,
            range: s as u64..e as u64,
        });
    }
    let mut by_offset: Vec<u32> = (0..tensors.len() as u32).collect();
    by_offset.sort_unstable_by_key(|&i| {
        let r = &tensors[i as usize].range;
        (r.start, r.end)
    });
    let mut at = 0u64;
    for &i in &by_offset {
        let t = &tensors[i as usize];
        let bytes = t
            .shape
            .iter()
            .try_fold(t.dtype.size() as u64, |a, &d| a.checked_mul(d as u64));
        if t.range.start != at
            || bytes != Some(t.range.end.wrapping_sub(t.range.start))
            || t.range.end < t.range.start
        {
            return Err(st_err(
                file,
                format!(
                    "tensor `{}` ({} {:?}) takes bytes {}..{} of the data, where {at}..{} was expected (tensors tile the data in offset order)",
                    t.name,
                    t.dtype,
                    t.shape,
                    t.range.start,
                    t.range.end,
                    bytes.map_or_else(|| "an overflowing size".to_string(), |b| (at + b).to_string())
                ),
            ));
        }
        at = t.range.end;
    }
    drop(by_offset);
    if data_start + at != len {
        return Err(st_err(
            file,
            format!(
                "the tensors take {at} bytes after the header, the file has {} (truncated or padded)",
                len - data_start
            ),
        ));
    }
    for t in &mut tensors {
        t.range = data_start + t.range.start..data_start + t.range.end;
    }
    tensors.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(st_err(
            file,
            format!("tensor `{}` is named twice in the header", w[0].name),
        ));
    }
    Ok(RawHeader {
        tensors,
        metadata: parsed.metadata,
    })
}

/// Where the placeholders of a file's tensors lie: by a placeholder's storage id, its real
/// shape and its bytes' range in the file.
pub(crate) type Placed = HashMap<usize, (Vec<usize>, std::ops::Range<u64>)>;

/// `t` of the file `f`: read, when it has at most one element, else a placeholder recorded
/// in `placed` (what [`FileTensors`] streams). `t`'s shape moves into what is made.
pub(crate) fn placeholder(
    f: &std::fs::File,
    t: &mut HeaderTensor,
    placed: &mut Placed,
) -> std::result::Result<HostTensor, String> {
    use std::os::unix::fs::FileExt;
    let shape = std::mem::take(&mut t.shape);
    if shape.iter().product::<usize>() <= 1 {
        let mut bytes = vec![0u8; (t.range.end - t.range.start) as usize];
        f.read_exact_at(&mut bytes, t.range.start)
            .map_err(|e| format!("cannot read it: {e}"))?;
        return HostTensor::from_bytes_shaped(t.dtype, shape, &bytes).map_err(|e| e.to_string());
    }
    let p = HostTensor::zeros(t.dtype, &[0]);
    placed.insert(p.storage_id(), (shape, t.range.clone()));
    Ok(p)
}

/// The structure of a `.safetensors` file without its tensor data ([`load_headers`]).
pub(crate) struct Headers {
    /// The object. Tensors of more than one element are empty placeholders of the right
    /// dtype; smaller ones are read.
    pub(crate) obj: PyObj,
    /// Per placeholder (by storage id): its real shape and its bytes' range in the file.
    pub(crate) placed: Placed,
}

/// Reads the header of the `.safetensors` file at `path` ([`read_header`]) and the object it
/// describes (its [`OBJECT_KEY`] structure, or an `OrderedDict` of its tensors by name), with
/// placeholders for tensors of more than one element: what [`FileTensors`] streams. Memory
/// holds the header, not the tensors.
pub(crate) fn load_headers(path: &Path) -> Result<Headers> {
    let file = path.display().to_string();
    let RawHeader {
        tensors: header,
        metadata,
    } = read_header(path)?;
    let f = open_input(path)?;
    let mut placed = HashMap::new();
    let mut tensors = Vec::with_capacity(header.len());
    for mut t in header {
        let p = placeholder(&f, &mut t, &mut placed)
            .map_err(|e| st_err(&file, format!("tensor `{}`: {e}", t.name)))?;
        tensors.push((t.name, p));
    }
    let skeleton = metadata.as_ref().and_then(|m| m.get(OBJECT_KEY));
    let obj = build(&file, tensors, skeleton)?;
    Ok(Headers { obj, placed })
}

/// The regular file `path`, opened for reading.
fn open_input(path: &Path) -> Result<std::fs::File> {
    crate::storage::open_regular(path).map_err(|e| e.at("reading", path))
}

/// The largest header [`load_headers`] reads (the `safetensors` crate's limit).
const MAX_HEADER: u64 = 100_000_000;

/// The placeholders of a [`Headers`] streamed from the `.safetensors` file they were read
/// from, 4 MiB at a time ([`super::stream_range`]), each tensor's pages dropped from the
/// page cache once read.
pub(crate) struct FileTensors<'h> {
    placed: &'h Placed,
    file: std::fs::File,
    path: &'h Path,
    /// The output being written, for messages.
    out: &'h Path,
}

impl<'h> FileTensors<'h> {
    /// Streams the placeholders `placed` from the file `path` they were read from, writing `out`.
    pub(crate) fn open(path: &'h Path, placed: &'h Placed, out: &'h Path) -> Result<Self> {
        let file = open_input(path)?;
        Ok(FileTensors {
            placed,
            file,
            path,
            out,
        })
    }
}

impl super::torch_save::writer::LazyTensors for FileTensors<'_> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        self.placed.get(&t.storage_id()).map(|(s, _)| s.clone())
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let Some((_, range)) = self.placed.get(&t.storage_id()) else {
            return Ok(());
        };
        let (file, path, out) = (&self.file, self.path, self.out);
        super::stream_range(
            range.start,
            range.end - range.start,
            |at, buf| {
                file.read_exact_at(buf, at)
                    .map_err(Error::io("reading", path))
            },
            |chunk| sink(chunk).map_err(Error::io("writing", out)),
        )?;
        crate::storage::drop_cached_pages(&self.file, range.start, range.end - range.start);
        Ok(())
    }
}

/// The object of a safetensors file from its tensors (in name order) and its
/// [`OBJECT_KEY`] structure, if it has one; without, an `OrderedDict` of the tensors by name.
fn build(
    file: &str,
    tensors: Vec<(String, HostTensor)>,
    skeleton: Option<&String>,
) -> Result<PyObj> {
    let Some(skeleton) = skeleton else {
        return Ok(PyObj::OrderedDict {
            items: tensors
                .into_iter()
                .map(|(k, t)| (PyObj::Str(k), PyObj::Tensor(t)))
                .collect(),
            attrs: Vec::new(),
        });
    };
    let tensors: HashMap<String, HostTensor> = tensors.into_iter().collect();
    let json: Json = serde_json::from_str(skeleton)
        .map_err(|e| st_err(file, format!("`{OBJECT_KEY}` metadata is not JSON: {e}")))?;
    let mut dec = Decoder {
        file,
        tensors,
        taken: HashSet::new(),
    };
    let obj = dec.decode(&json, "<root>")?;
    if let Some(extra) = dec.tensors.keys().find(|k| !dec.taken.contains(*k)) {
        return Err(st_err(
            file,
            format!("tensor `{extra}` is not referenced by the `{OBJECT_KEY}` metadata"),
        ));
    }
    Ok(obj)
}

struct Decoder<'f> {
    file: &'f str,
    tensors: HashMap<String, HostTensor>,
    taken: HashSet<String>,
}

impl Decoder<'_> {
    fn bad(&self, path: &str, what: &Json) -> Error {
        let mut text = what.to_string();
        if text.len() > 80 {
            text.truncate(77);
            text.push_str("...");
        }
        st_err(
            self.file,
            format!("malformed `{OBJECT_KEY}` metadata at {path}: unexpected {text}"),
        )
    }

    fn pairs(&mut self, j: &Json, path: &str) -> Result<Vec<(PyObj, PyObj)>> {
        let arr = j.as_array().ok_or_else(|| self.bad(path, j))?;
        arr.iter()
            .enumerate()
            .map(|(i, p)| match p.as_array().map(Vec::as_slice) {
                Some([k, v]) => {
                    let p = format!("{path}[{i}]");
                    Ok((self.decode(k, &p)?, self.decode(v, &p)?))
                }
                _ => Err(self.bad(path, p)),
            })
            .collect()
    }

    fn decode(&mut self, j: &Json, path: &str) -> Result<PyObj> {
        Ok(match j {
            Json::Null => PyObj::None,
            Json::Bool(b) => PyObj::Bool(*b),
            Json::Number(n) => PyObj::Int(n.as_i64().ok_or_else(|| self.bad(path, j))?),
            Json::String(s) => PyObj::Str(s.clone()),
            Json::Array(xs) => PyObj::List(self.decode_items(xs, path)?),
            Json::Object(m) => match (m.len(), m.iter().next()) {
                (1, Some((tag, value))) => self.decode_tagged(tag, value, j, path)?,
                (2, _) => match (m.get("odict"), m.get("attrs")) {
                    (Some(items), Some(Json::Array(attrs))) => {
                        self.decode_odict(items, attrs, path)?
                    }
                    _ => return Err(self.bad(path, j)),
                },
                _ => return Err(self.bad(path, j)),
            },
        })
    }

    fn decode_items(&mut self, xs: &[Json], path: &str) -> Result<Vec<PyObj>> {
        xs.iter()
            .enumerate()
            .map(|(i, x)| self.decode(x, &format!("{path}[{i}]")))
            .collect()
    }

    /// A one-key object `{tag: value}` (`j`, for errors): a float, big int, bytes, tuple,
    /// sharded tensor, `torch.Size`, dict or tensor reference.
    fn decode_tagged(&mut self, tag: &str, value: &Json, j: &Json, path: &str) -> Result<PyObj> {
        match (tag, value) {
            ("float", Json::String(s)) => parse_float(s)
                .map(PyObj::Float)
                .ok_or_else(|| self.bad(path, j)),
            ("bigint", Json::String(s)) => {
                unhex(s).map(PyObj::BigInt).ok_or_else(|| self.bad(path, j))
            }
            ("bytes", Json::String(s)) => {
                unhex(s).map(PyObj::Bytes).ok_or_else(|| self.bad(path, j))
            }
            ("tuple", Json::Array(xs)) => Ok(PyObj::Tuple(self.decode_items(xs, path)?)),
            ("sharded", Json::Object(sh)) => self.decode_sharded(sh, j, path),
            ("size", Json::Array(xs)) => xs
                .iter()
                .map(Json::as_i64)
                .collect::<Option<_>>()
                .map(PyObj::Size)
                .ok_or_else(|| self.bad(path, j)),
            ("dict", d) => Ok(PyObj::Dict(self.pairs(d, path)?)),
            ("counter", d) => Ok(PyObj::Counter(self.pairs(d, path)?)),
            ("set", Json::Array(xs)) => Ok(PyObj::Set(self.decode_items(xs, path)?)),
            ("bytearray", Json::String(s)) => unhex(s)
                .map(PyObj::ByteArray)
                .ok_or_else(|| self.bad(path, j)),
            ("complex", Json::Array(parts)) => match parts.as_slice() {
                [Json::String(re), Json::String(im)] => parse_float(re)
                    .zip(parse_float(im))
                    .map(|(re, im)| PyObj::Complex(re, im))
                    .ok_or_else(|| self.bad(path, j)),
                _ => Err(self.bad(path, j)),
            },
            ("device", Json::Array(parts)) => match parts.as_slice() {
                [Json::String(kind), Json::Null] => Ok(PyObj::Device(kind.clone(), None)),
                [Json::String(kind), Json::Number(i)] => i
                    .as_i64()
                    .map(|i| PyObj::Device(kind.clone(), Some(i)))
                    .ok_or_else(|| self.bad(path, j)),
                _ => Err(self.bad(path, j)),
            },
            ("torch", Json::String(name)) => Ok(PyObj::TorchConst(name.clone())),
            ("tensor", Json::String(name)) => self.decode_tensor_ref(name, path),
            _ => Err(self.bad(path, j)),
        }
    }

    /// A sharded tensor: global shape, offsets and the local piece (a tensor reference).
    fn decode_sharded(
        &mut self,
        sh: &serde_json::Map<String, Json>,
        j: &Json,
        path: &str,
    ) -> Result<PyObj> {
        let dims = |k: &str| -> Option<Vec<usize>> {
            sh.get(k)?
                .as_array()?
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect()
        };
        let (Some(global_shape), Some(offsets)) = (dims("global_shape"), dims("offsets")) else {
            return Err(self.bad(path, j));
        };
        let local = match sh.get("local") {
            None | Some(Json::Null) => None,
            Some(l) => match self.decode(l, path)? {
                PyObj::Tensor(t) => Some(t),
                _ => return Err(self.bad(path, j)),
            },
        };
        Ok(PyObj::Sharded(Box::new(
            crate::optim_state::ShardedTensor {
                global_shape,
                offsets,
                local,
            },
        )))
    }

    /// A reference to tensor `name` of the file; each tensor may be referenced once.
    fn decode_tensor_ref(&mut self, name: &str, path: &str) -> Result<PyObj> {
        if !self.taken.insert(name.to_string()) {
            return Err(st_err(
                self.file,
                format!("tensor `{name}` is referenced twice by the metadata"),
            ));
        }
        self.tensors.get(name).cloned().map(PyObj::Tensor).ok_or_else(|| {
            st_err(
                self.file,
                format!("the metadata refers to tensor `{name}` (at {path}), which is not in the file"),
            )
        })
    }

    /// An `OrderedDict` with its instance attributes.
    fn decode_odict(&mut self, items: &Json, attrs: &[Json], path: &str) -> Result<PyObj> {
        let items = self.pairs(items, path)?;
        let attrs = attrs
            .iter()
            .map(|a| match a.as_array().map(Vec::as_slice) {
                Some([Json::String(k), v]) => {
                    Ok((k.clone(), self.decode(v, &format!("{path}.{k}"))?))
                }
                _ => Err(self.bad(path, a)),
            })
            .collect::<Result<_>>()?;
        Ok(PyObj::OrderedDict { items, attrs })
    }
}

/// Reads an optimizer state dict from a safetensors file written by [`save_optim_state_dict`]
/// (or by [`save`] of an optimizer state dict's object).
pub fn load_optim_state_dict(path: impl AsRef<Path>) -> Result<OptimStateDict> {
    super::torch_save::optim_from_pyobj(load(path)?)
}

/// Writes an optimizer state dict as one safetensors file (`state/<key>/<state name>`).
pub fn save_optim_state_dict(osd: &OptimStateDict, path: impl AsRef<Path>) -> Result<()> {
    save(&super::torch_save::optim_to_pyobj(osd)?, path)
}

/// Reads a model state dict from a safetensors file (ours, or any other: then in name order).
pub fn load_model_state_dict(path: impl AsRef<Path>) -> Result<SavedModelStateDict> {
    super::torch_save::model_from_pyobj(load(path)?)
}

/// Writes a model state dict as one safetensors file whose tensor names are the state dict's
/// keys.
pub fn save_model_state_dict(msd: &SavedModelStateDict, path: impl AsRef<Path>) -> Result<()> {
    save(&super::torch_save::model_to_pyobj(msd), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: f32) -> PyObj {
        PyObj::Tensor(HostTensor::from_vec1(&[v, v + 1.0]))
    }

    #[test]
    fn every_kind_of_value_round_trips() {
        let obj = PyObj::Dict(vec![
            (
                PyObj::Str("state".into()),
                PyObj::Dict(vec![
                    (
                        PyObj::Int(0),
                        PyObj::Dict(vec![
                            (PyObj::Str("exp_avg".into()), t(1.0)),
                            (
                                PyObj::Str("step".into()),
                                PyObj::Tensor(HostTensor::scalar(2.0f32)),
                            ),
                        ]),
                    ),
                    (
                        PyObj::Str("0".into()),
                        PyObj::Dict(vec![(PyObj::Str("x".into()), t(5.0))]),
                    ),
                    (PyObj::Str("a/b".into()), t(7.0)),
                    (
                        PyObj::Str("a".into()),
                        PyObj::Dict(vec![(PyObj::Str("b".into()), t(9.0))]),
                    ),
                ]),
            ),
            (
                PyObj::Str("misc".into()),
                PyObj::List(vec![
                    PyObj::None,
                    PyObj::Bool(true),
                    PyObj::Int(-3),
                    PyObj::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 1]),
                    PyObj::Float(f64::from_bits(0x7ff8_0000_0000_0001)),
                    PyObj::Float(-0.0),
                    PyObj::Float(0.1 + 0.2),
                    PyObj::Float(f64::INFINITY),
                    PyObj::Float(1e-300),
                    PyObj::Bytes(vec![0, 255]),
                    PyObj::Tuple(vec![PyObj::Float(0.9), PyObj::Float(0.999)]),
                    PyObj::Tensor(HostTensor::from_bools(&[true, false], &[2]).unwrap()),
                    PyObj::Tensor(HostTensor::zeros(DType::BF16, &[0, 3])),
                ]),
            ),
            (
                PyObj::Str("__metadata__".into()),
                PyObj::OrderedDict {
                    items: vec![(PyObj::Str("w".into()), t(3.0))],
                    attrs: vec![(
                        "_metadata".into(),
                        PyObj::Dict(vec![(PyObj::Str("".into()), PyObj::Int(1))]),
                    )],
                },
            ),
        ]);
        let bytes = save_to_bytes(&obj).unwrap();
        let back = load_from_bytes(&bytes).unwrap();
        assert!(back.bit_eq(&obj), "{back:?}");
        let names = tensor_names(&obj);
        assert_eq!(
            names,
            [
                "state/0/exp_avg",
                "state/0/step",
                "state/0/x",
                "state/a/b",
                "state/a/b#2",
                "misc/11",
                "misc/12",
                "__metadata__/w"
            ]
        );
    }

    #[test]
    fn foreign_files_read_as_ordered_dicts_and_bad_metadata_is_an_error() {
        let a = HostTensor::from_vec1(&[1.0f32]);
        let b = HostTensor::from_vec1(&[2i64]);
        let bytes = ::safetensors::tensor::serialize(
            vec![("z", TensorRef(&a)), ("b", TensorRef(&b))],
            None,
        )
        .unwrap();
        let obj = load_from_bytes(&bytes).unwrap();
        let keys: Vec<_> = obj
            .dict_items()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(keys, [PyObj::Str("b".into()), PyObj::Str("z".into())]);

        let mut meta = HashMap::new();
        meta.insert(
            OBJECT_KEY.to_string(),
            r#"{"tensor": "missing"}"#.to_string(),
        );
        let bytes =
            ::safetensors::tensor::serialize(vec![("z", TensorRef(&a))], Some(meta)).unwrap();
        let e = load_from_bytes(&bytes).unwrap_err();
        assert!(matches!(e, Error::Safetensors { .. }), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
        let e = load_from_bytes(b"garbage").unwrap_err();
        assert!(matches!(e, Error::Safetensors { .. }), "{e}");
    }
}
