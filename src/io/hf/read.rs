//! A Hugging Face model directory read for conversion: its index checked against its files'
//! headers, and the tensors streamed from the files.
//!
//! In a model directory the safetensors names are the truth: a tensor is known by the name
//! its file's header gives it, which is what `safetensors` and transformers read. The
//! crate's own `fsdp.pyobj.v1` metadata ([`crate::io::safetensors::OBJECT_KEY`], the nested
//! structure a single `.safetensors` file written by `fsdp-ckpt` records) is ignored here,
//! whatever it says: a file whose metadata maps `q_proj` to `k_proj`'s bytes imports as its
//! header says, and a file written from a nested `{"model": {...}}` keeps its header names
//! (`model/x`), as transformers sees them.

use super::{INDEX_FILE, SINGLE_FILE};
use crate::error::{Error, Result};
use crate::io::safetensors::HeaderTensor;
use crate::io::safetensors::{FileTensors, Placed};
use crate::io::torch_save::writer::LazyTensors;
use crate::tensor::HostTensor;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// A model directory whose index (when it has one) and file headers agree: every tensor the
/// index maps is in its file, no file holds a tensor the index maps elsewhere or not at all,
/// and no tensor is in two files.
pub(crate) struct HfModelDir {
    /// Each file's name, path and placeholders, in name order.
    files: Vec<(String, PathBuf, Placed)>,
    /// Every tensor: its name and its placeholder (or value, for one element), in file
    /// order, then by name.
    pub(crate) tensors: Vec<(String, HostTensor)>,
}

/// The error for file `file` of the model directory (`key`, the tensor at fault).
fn dir_err(file: &Path, key: Option<&str>, reason: impl Into<String>) -> Error {
    Error::HfModelDir {
        file: file.display().to_string(),
        key: key.map(str::to_string),
        reason: reason.into(),
    }
}

/// The checked headers of a model directory's files: each file's name, path and tensors (by
/// the header's names, in name order), in file name order; and whether it has an index.
struct Headers {
    files: Vec<(String, PathBuf, Vec<HeaderTensor>)>,
    indexed: bool,
}

impl Headers {
    /// Reads `dir`: [`INDEX_FILE`] and the files its `weight_map` names, or, without an
    /// index, its one `.safetensors` file ([`SINGLE_FILE`] by convention), each header
    /// checked, and the index against the headers.
    fn read(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let weight_map = match std::fs::symlink_metadata(&index_path) {
            Ok(_) => Some(read_index(&index_path)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io("reading", &index_path)(e)),
        };
        let names: Vec<String> = match &weight_map {
            Some(map) => {
                let mut n: Vec<String> = map.values().cloned().collect();
                n.sort();
                n.dedup();
                n
            }
            None => vec![lone_file(dir)?],
        };
        let mut files = Vec::with_capacity(names.len());
        for name in names {
            let path = dir.join(&name);
            check_file(&path, &name, weight_map.as_ref())?;
            let raw = crate::io::safetensors::read_header(&path)?;
            files.push((name, path, raw.tensors));
        }
        check_against_index(dir, &files, weight_map.as_ref())?;
        Ok(Headers {
            files,
            indexed: weight_map.is_some(),
        })
    }

    fn count(&self) -> usize {
        self.files.iter().map(|(_, _, t)| t.len()).sum()
    }
}

/// The rule of every input for the model file `path` (`name`, as the index or the directory
/// gives it): a regular file, symbolic links followed; the message names the tensor the index
/// maps to it, if any.
fn check_file(
    path: &Path,
    name: &str,
    weight_map: Option<&BTreeMap<String, String>>,
) -> Result<()> {
    let Err(e) = crate::storage::regular_len(path) else {
        return Ok(());
    };
    let what = match e {
        e if e.is_missing() => "it is missing".to_string(),
        crate::storage::ReadRegularError::Io(e) => format!("it cannot be opened: {e}"),
        other => other.to_string(),
    };
    let Some(map) = weight_map else {
        return Err(dir_err(
            path,
            None,
            format!("the model's one `.safetensors` file: {what}"),
        ));
    };
    let key = map.iter().find(|(_, f)| *f == name).map(|(k, _)| k.clone());
    Err(dir_err(
        path,
        key.as_deref(),
        format!("{INDEX_FILE} maps tensors to this file, and {what}"),
    ))
}

impl HfModelDir {
    /// Reads `dir` ([`Headers::read`]) and makes each tensor's placeholder (tensors of at
    /// most one element are read).
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let headers = Headers::read(dir)?;
        let count = headers.count();
        let mut tensors = Vec::with_capacity(count);
        let mut files = Vec::with_capacity(headers.files.len());
        for (name, path, header) in headers.files {
            let f = crate::storage::open_regular(&path)
                .map_err(std::io::Error::from)
                .map_err(Error::io("reading", &path))?;
            let mut placed = Placed::new();
            for mut t in header {
                let p = crate::io::safetensors::placeholder(&f, &mut t, &mut placed)
                    .map_err(|e| dir_err(&path, Some(&t.name), e))?;
                tensors.push((t.name, p));
            }
            files.push((name, path, placed));
        }
        Ok(HfModelDir { files, tensors })
    }

    /// What streams the tensors' bytes from their files while `out` is written.
    pub(crate) fn streamer<'h>(&'h self, out: &'h Path) -> Result<Files<'h>> {
        let streams = self
            .files
            .iter()
            .map(|(_, path, placed)| FileTensors::open(path, placed, out))
            .collect::<Result<Vec<_>>>()?;
        Ok(Files(streams))
    }
}

/// What `fsdp-ckpt inspect` prints for a Hugging Face model directory.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HfSummary {
    /// The directory.
    pub dir: String,
    /// `hf`.
    pub format: &'static str,
    /// Whether it has `model.safetensors.index.json`.
    pub indexed: bool,
    /// Its `.safetensors` files, in name order, with their bytes.
    pub files: Vec<(String, u64)>,
    /// Every tensor in file order, then by name.
    pub tensors: Vec<HfTensorSummary>,
    /// Bytes of all tensors.
    pub total_size: u64,
    /// Elements of all tensors.
    pub total_parameters: u64,
}

/// One tensor of an [`HfSummary`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HfTensorSummary {
    /// Its name.
    pub name: String,
    /// `torch.float32`, …
    pub dtype: &'static str,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The file holding it (one string shared by the file's tensors).
    pub file: std::sync::Arc<str>,
}

/// Describes the Hugging Face model directory `dir` from its index and headers (checked
/// against each other as for a conversion; no tensor data is read). Each header's entries
/// move into the summary as it is made: a tensor's name and shape are held once.
pub fn summary(dir: &Path) -> Result<HfSummary> {
    let headers = Headers::read(dir)?;
    let mut tensors = Vec::with_capacity(headers.count());
    let (mut total_size, mut total_parameters) = (0u64, 0u64);
    let mut files = Vec::with_capacity(headers.files.len());
    for (name, path, header) in headers.files {
        let len = crate::storage::regular_len(&path).map_err(|e| e.at("reading", &path))?;
        let file: std::sync::Arc<str> = name.as_str().into();
        for t in header {
            let n = t.shape.iter().product::<usize>() as u64;
            total_parameters += n;
            total_size += n * t.dtype.size() as u64;
            tensors.push(HfTensorSummary {
                name: t.name,
                dtype: t.dtype.torch_name(),
                shape: t.shape,
                file: file.clone(),
            });
        }
        files.push((name, len));
    }
    Ok(HfSummary {
        dir: dir.display().to_string(),
        format: "hf",
        indexed: headers.indexed,
        files,
        tensors,
        total_size,
        total_parameters,
    })
}

impl std::fmt::Display for HfSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "Hugging Face model: {}", self.dir)?;
        writeln!(
            f,
            "{} tensors, {} parameters, {} bytes in {} file(s){}",
            self.tensors.len(),
            self.total_parameters,
            self.total_size,
            self.files.len(),
            if self.indexed { " and the index" } else { "" }
        )?;
        writeln!(f, "files:")?;
        for (name, len) in &self.files {
            writeln!(f, "  {name} ({len} bytes)")?;
        }
        writeln!(f, "tensors:")?;
        for t in &self.tensors {
            writeln!(f, "  {} {} {:?} ({})", t.name, t.dtype, t.shape, t.file)?;
        }
        Ok(())
    }
}

/// The `weight_map` of the index `path`: tensor name → file name (a plain name in the same
/// directory).
fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let bytes = crate::storage::read_small_file(path)?;
    let index: Index = serde_json::from_slice(&bytes).map_err(|e| {
        dir_err(
            path,
            None,
            format!("not a model index (a JSON object with a `weight_map` of tensor name to file name): {e}"),
        )
    })?;
    for (key, file) in &index.weight_map {
        let plain = crate::storage::check_name(file, crate::storage::NameForm::Plain);
        if let Some(why) = plain {
            return Err(dir_err(
                path,
                Some(key),
                format!(
                    "maps it to `{}`, which is not a file name in the same directory: {why}",
                    crate::error::shown(file)
                ),
            ));
        }
    }
    Ok(index.weight_map)
}

/// The one `.safetensors` file of a directory without an index.
fn lone_file(dir: &Path) -> Result<String> {
    let mut names = crate::io::safetensors::file_names(dir)?;
    match names.len() {
        1 => Ok(names.remove(0)),
        0 => Err(dir_err(
            dir,
            None,
            format!("it holds neither {INDEX_FILE} nor a `.safetensors` file"),
        )),
        _ if names.iter().any(|n| n == SINGLE_FILE) => Ok(SINGLE_FILE.to_string()),
        n => Err(dir_err(
            &dir.join(INDEX_FILE),
            None,
            format!(
                "it is missing, and the directory holds {n} `.safetensors` files ({}): which tensors each holds is the index's to say",
                super::names::listed(&names.iter().map(String::as_str).collect::<Vec<_>>())
            ),
        )),
    }
}

/// Checks the tensors of `files` (each file's in name order) against `weight_map`: the same
/// names, each in the file the index says and in no other.
fn check_against_index(
    dir: &Path,
    files: &[(String, PathBuf, Vec<HeaderTensor>)],
    weight_map: Option<&BTreeMap<String, String>>,
) -> Result<()> {
    let mut found: HashMap<&str, usize> =
        HashMap::with_capacity(files.iter().map(|(_, _, t)| t.len()).sum());
    for (fi, (name, path, tensors)) in files.iter().enumerate() {
        for t in tensors {
            let key = t.name.as_str();
            if let Some(other) = found.insert(key, fi) {
                return Err(dir_err(
                    path,
                    Some(key),
                    format!("the tensor is also in `{}`", files[other].0),
                ));
            }
            if let Some(map) = weight_map {
                match map.get(key) {
                    Some(f) if f == name => {}
                    Some(f) => {
                        return Err(dir_err(
                            path,
                            Some(key),
                            format!("the file holds the tensor, and {INDEX_FILE} maps it to `{f}`"),
                        ))
                    }
                    None => {
                        return Err(dir_err(
                            path,
                            Some(key),
                            format!("the file holds the tensor, and {INDEX_FILE} does not name it"),
                        ))
                    }
                }
            }
        }
    }
    if let Some(map) = weight_map {
        if let Some((key, file)) = map.iter().find(|(k, _)| !found.contains_key(k.as_str())) {
            return Err(dir_err(
                &dir.join(file),
                Some(key),
                format!(
                    "{INDEX_FILE} maps the tensor to this file, and its header does not hold it"
                ),
            ));
        }
    }
    Ok(())
}

/// The placeholders of several files, each streamed from its own file.
pub(crate) struct Files<'h>(Vec<FileTensors<'h>>);

impl LazyTensors for Files<'_> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        self.0.iter().find_map(|f| f.shape_of(t))
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        match self.0.iter_mut().find(|f| f.shape_of(t).is_some()) {
            Some(f) => f.stream(t, sink),
            None => Ok(()),
        }
    }
}
