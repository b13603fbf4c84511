//! A Hugging Face model directory imported as a DCP directory, for FSDP ranks to load.

use super::coordinate::write_dcp;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::DcpWriteOptions;
use crate::io::hf::{self, names, HfModelDir, Rename};
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::PyObj;
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;
use std::path::Path;

/// How [`hf_to_dcp`] imports.
#[derive(Debug, Clone)]
pub struct HfImportOptions {
    /// Added to every key (after the renames): `model.` by default, so that the directory
    /// loads as the `model` part of `get_state_dict` (`dcp.load({"model": msd})`).
    pub prefix: String,
    /// Key renames, applied in order to the model's names.
    pub renames: Vec<Rename>,
    /// Cast floating-point tensors to this dtype, as `Tensor.to` does.
    pub dtype: Option<DType>,
    /// Tied weights `(name, source)` the directory leaves out, as `save_pretrained` does:
    /// `name` is written as a copy of `source` (names after the renames, before the
    /// prefix), since `get_model_state_dict` of the model holds both and `dcp.load` needs
    /// every key.
    pub ties: Vec<(String, String)>,
    /// The model's `config.json`: when it ties the word embeddings, its architecture's output
    /// embedding is restored from its input embedding ([`hf::tied_embeddings`]) when the
    /// directory lacks it.
    pub config: Option<std::path::PathBuf>,
    /// The DCP writer's options.
    pub write: DcpWriteOptions,
}

impl Default for HfImportOptions {
    fn default() -> Self {
        HfImportOptions {
            prefix: hf::MODEL_PREFIX.into(),
            renames: Vec::new(),
            dtype: None,
            ties: Vec::new(),
            config: None,
            write: DcpWriteOptions::default(),
        }
    }
}

/// Writes the Hugging Face model directory `src` (`model.safetensors.index.json` and its
/// files, or one `model.safetensors`; the index checked against every file's header) as the
/// DCP directory `dst`, its keys `prefix + name`, as `dcp.save({"model": state_dict})` writes
/// it: an FSDP2 or FSDP1 model at any world size loads it with `dcp.load` and
/// `set_model_state_dict`. The tensors stream from the files (memory holds one 4 MiB chunk).
///
/// Run by the processes of `pg` (see [the module](super)): each streams its share of the
/// tensors into the one data file, and process 0 writes `.metadata` and installs the
/// directory. Returns the tensor bytes written.
pub fn hf_to_dcp(
    src: &Path,
    dst: &Path,
    opts: &HfImportOptions,
    pg: &dyn ProcessGroup,
) -> Result<u64> {
    pg.agree(crate::storage::check_not_overlapping(dst, &[src]))?;
    pg.agree(not_dcp_storage(src))?;
    let mut dir = pg.agree(HfModelDir::open(src))?;
    // Moved into the state dict rather than copied: one record per tensor, not two.
    let tensors = std::mem::take(&mut dir.tensors);
    let files = pg.agree(dir.streamer(dst))?;
    let (obj, mut lazy) = pg.agree(imported(tensors, files, opts))?;
    write_dcp(&obj, dst, &mut lazy, pg, &opts.write)
}

/// Refuses a DCP checkpoint in Hugging Face storage: its files hold shards of tensors
/// (`DCP_SHARDING_INFO`), not a model's tensors, and [`super::dcp_to_dcp`] reads it.
fn not_dcp_storage(src: &Path) -> Result<()> {
    match crate::io::dcp::hf_form(src)? {
        None => Ok(()),
        Some(form) => Err(crate::error::Error::HfModelDir {
            file: src.display().to_string(),
            key: None,
            reason: format!(
                "its headers carry {}: it is a DCP checkpoint in {}, whose keys are kept as saved (convert::dcp_to_dcp, `convert --to dcp`)",
                crate::io::dcp::SHARDING_INFO_KEY,
                form.describe()
            ),
        }),
    }
}

/// The state dict the DCP directory holds, nested under the prefix's parts
/// (`{"model": {name: tensor}}`), with what streams its placeholders (cast as asked).
fn imported<'h>(
    tensors: Vec<(String, HostTensor)>,
    files: hf::read::Files<'h>,
    opts: &HfImportOptions,
) -> Result<(PyObj, Cast<'h>)> {
    let (names, tensors): (Vec<String>, Vec<HostTensor>) = tensors.into_iter().unzip();
    // A model directory's names are distinct (each header is checked, and no tensor is in
    // two files).
    let renamed = names::renamed_distinct(&opts.renames, names)?;
    let mut lazy = Cast {
        files,
        casts: HashMap::new(),
    };
    let mut items = Vec::with_capacity(renamed.len());
    for (t, name) in tensors.into_iter().zip(renamed) {
        let t = lazy.cast(&t, opts.dtype)?;
        items.push((PyObj::Str(name), PyObj::Tensor(t)));
    }
    for (name, source) in restored_ties(&items, opts)? {
        let copy = items
            .iter()
            .find(|(k, _)| matches!(k, PyObj::Str(k) if *k == source))
            .map(|(_, t)| t.clone())
            .expect("restored_ties checked the source");
        items.push((PyObj::Str(name), copy));
    }
    let mut obj = PyObj::OrderedDict {
        items,
        attrs: Vec::new(),
    };
    for part in opts.prefix.split('.').filter(|p| !p.is_empty()).rev() {
        obj = PyObj::Dict(vec![(PyObj::Str(part.to_string()), obj)]);
    }
    Ok((obj, lazy))
}

/// The tied names to write as copies of their sources: `opts.ties`, each checked (its source
/// present, its name absent), and with a config that ties word embeddings, its
/// architecture's output embedding when the directory lacks it.
fn restored_ties(
    items: &[(PyObj, PyObj)],
    opts: &HfImportOptions,
) -> Result<Vec<(String, String)>> {
    let has = |n: &str| {
        items
            .iter()
            .any(|(k, _)| matches!(k, PyObj::Str(k) if k == n))
    };
    let mut out = Vec::new();
    for (name, source) in &opts.ties {
        let err = |reason: String| crate::error::Error::HfTie {
            name: name.clone(),
            kept: source.clone(),
            reason,
        };
        if !has(source) {
            return Err(err(format!("the model directory has no tensor `{source}` (names are compared after the renames)")));
        }
        if has(name) {
            return Err(err(format!("the model directory holds `{name}` already; a tie restores a tensor `save_pretrained` left out")));
        }
        out.push((name.clone(), source.clone()));
    }
    if let Some(path) = &opts.config {
        let config = super::to_hf::read_config(path)?;
        for (name, source) in config.tie.ties(!opts.ties.is_empty())? {
            if !has(&name) && has(&source) && !out.iter().any(|(n, _)| *n == name) {
                out.push((name, source));
            }
        }
    }
    Ok(out)
}

/// The files' placeholders, with some replaced by placeholders of another dtype whose bytes
/// are cast on the way.
struct Cast<'h> {
    files: hf::read::Files<'h>,
    /// Cast placeholder's storage → (the file's placeholder, its dtype).
    casts: HashMap<usize, (HostTensor, DType)>,
}

impl Cast<'_> {
    /// `t` (a placeholder or a value read whole) as it is written with `dtype`.
    fn cast(&mut self, t: &HostTensor, dtype: Option<DType>) -> Result<HostTensor> {
        let from = t.dtype();
        let Some(to) = dtype.filter(|&to| crate::tensor::cast::casts(from, to)) else {
            return Ok(t.clone());
        };
        if self.files.shape_of(t).is_none() {
            let mut out = Vec::new();
            crate::tensor::cast::cast(from, to, t.as_bytes(), &mut out);
            return HostTensor::from_bytes(to, t.shape(), &out);
        }
        let placeholder = HostTensor::zeros(to, &[0]);
        self.casts
            .insert(placeholder.storage_id(), (t.clone(), from));
        Ok(placeholder)
    }
}

impl LazyTensors for Cast<'_> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        match self.casts.get(&t.storage_id()) {
            Some((src, _)) => self.files.shape_of(src),
            None => self.files.shape_of(t),
        }
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        let Some((src, from)) = self.casts.get(&t.storage_id()) else {
            return self.files.stream(t, sink);
        };
        let mut caster = hf::write::Caster::between(*from, t.dtype());
        self.files
            .stream(src, &mut |chunk| caster.push(chunk, sink))
    }
}
