//! A checkpoint exported as a Hugging Face model directory: what `save_pretrained` writes of
//! the model's weights, streamed one tensor at a time.

use crate::checkpoint::stream::Skeleton;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::io::dcp::{DcpCheckpoint, Headers, Placeholders, Views};
use crate::io::hf::plan::{self, DirPlan, PlannedTensor};
use crate::io::hf::{self, names, Rename};
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::PyObj;
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// How [`checkpoint_to_hf`] exports.
#[derive(Debug, Clone, Default)]
pub struct HfExportOptions {
    /// The most bytes of tensors per file (`save_pretrained`'s `max_shard_size`); `None`:
    /// [`hf::DEFAULT_MAX_SHARD_SIZE`], or, for a DCP directory in Hugging Face storage, the
    /// files its shard names imply (what `consolidate_safetensors_files` writes).
    pub max_shard_size: Option<u64>,
    /// Cast floating-point tensors to this dtype (`bf16`, `f16`, `f32`) as `Tensor.to` does;
    /// integer and bool tensors keep theirs.
    pub dtype: Option<DType>,
    /// The subtree that holds the model: `None` for `model.` (refused when tensors lie
    /// outside `model.` and the training state), or a torchtitan checkpoint's top-level
    /// keys; `Some("")` for every tensor outside the training state. Tensors under
    /// [`hf::STATE_ROOTS`] (`optim`, torchtitan's `optimizer`, `lr_scheduler`, `dataloader`,
    /// `train_state`) are never exported.
    pub prefix: Option<String>,
    /// Key renames, applied in order once the prefix is stripped.
    pub renames: Vec<Rename>,
    /// Tied weights `(name, kept)`: `name` is checked to equal `kept` and left out.
    pub ties: Vec<(String, String)>,
    /// A `config.json` to copy into the directory; when it ties the word embeddings, its
    /// architecture's output embedding is tied to its input embedding as `transformers` ties
    /// them ([`hf::tied_embeddings`]: GPT-2's `lm_head.weight` to `transformer.wte.weight`).
    pub config: Option<PathBuf>,
}

/// What the input of [`checkpoint_to_hf`] is, as the caller recognized it (the commands' one
/// recognition table, `crate::commands::recognize`, which this layer does not call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfSource {
    /// A `torch.save` or `.safetensors` file.
    File,
    /// A DCP directory of any form (`.metadata`, per-rank metadata, Hugging Face storage).
    Dcp,
    /// The crate's checkpoint directory, saved with the model.
    Checkpoint,
}

/// What [`checkpoint_to_hf`] wrote.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HfExported {
    /// The `.safetensors` files, in order.
    pub files: Vec<String>,
    /// Whether `model.safetensors.index.json` was written.
    pub indexed: bool,
    /// Tensors written.
    pub tensors: usize,
    /// Their bytes (the index's `total_size`).
    pub total_size: u64,
    /// Their elements (the index's `total_parameters`).
    pub total_parameters: u64,
    /// Tied tensors left out, each with the tensor it equals: `(dropped, kept)`.
    pub dropped: Vec<(String, String)>,
}

/// Exports the model weights of `src` — a DCP directory of any form, the crate's checkpoint
/// (saved with the model), or a `torch.save` / `.safetensors` file, as `from` says — as the Hugging Face
/// model directory `dst` (missing or empty): `model.safetensors`, or
/// `model-{i:05}-of-{n:05}.safetensors` files and `model.safetensors.index.json`, split and
/// laid out as `save_pretrained` writes them ([`crate::io::hf`]).
///
/// The tensors are streamed one at a time (memory holds the largest, cast when `dtype`
/// asks), into a temporary directory beside `dst` that is renamed into place once every file
/// and the index are written and synced: the directory appears whole or not at all. Run by
/// the processes of `pg` (see [the module](super)), each writes its share of the files and
/// process 0 the index.
pub fn checkpoint_to_hf(
    src: &Path,
    from: HfSource,
    dst: &Path,
    opts: &HfExportOptions,
    pg: &dyn ProcessGroup,
) -> Result<HfExported> {
    pg.on_root(|| check_output(src, dst, opts))?;
    let source = pg.agree(Opened::open(src, from))?;
    let mut lazy = pg.agree(source.streamer(dst))?;
    let tensors = pg.agree(source.tensors(lazy.as_ref()))?;
    let config = pg.agree(opts.config.as_deref().map(read_config).transpose())?;
    let chosen = pg.agree(choose(src, &source, &tensors, opts, config.as_ref()))?;
    let plan = pg.agree(make_plan(&source, &tensors, &chosen, opts))?;
    pg.on_root(|| check_ties(&tensors, &chosen.ties, lazy.as_mut()))?;
    let tmp = pg.on_root(|| crate::storage::make_tmp_dir(dst))?;
    let mine = write_share(&plan, &tensors, lazy.as_mut(), (dst, &tmp), pg);
    let committed = pg
        .all_gather_agreed(mine)
        .and_then(|_| pg.on_root(|| commit(&plan, config.as_ref(), &tmp, dst)));
    if committed.is_err() && pg.rank() == 0 {
        crate::storage::discard_tmp_dir(&tmp);
    }
    committed?;
    Ok(HfExported {
        files: plan.files.iter().map(|f| f.name.clone()).collect(),
        indexed: plan.indexed,
        tensors: plan.files.iter().map(|f| f.tensors.len()).sum(),
        total_size: plan.total_size,
        total_parameters: plan.total_parameters,
        dropped: chosen
            .ties
            .iter()
            .map(|t| (t.name.clone(), t.kept.clone()))
            .collect(),
    })
}

/// The output may be a missing path or an empty directory, outside the input and config.
fn check_output(src: &Path, dst: &Path, opts: &HfExportOptions) -> Result<()> {
    let mut inputs = vec![src];
    inputs.extend(opts.config.as_deref());
    crate::storage::check_dir_output(dst, hf::HF_MODEL_DIR, &inputs)?;
    crate::storage::clean_stale_temporaries(dst, None)?;
    Ok(())
}

/// An opened checkpoint: its object with placeholders for the tensors, and what streams them.
struct Opened {
    path: PathBuf,
    kind: Kind,
}

enum Kind {
    Dcp(DcpCheckpoint, Placeholders),
    File(Headers),
    /// A `torch.save` file whose tensors share storages in ways that do not stream: read whole.
    Loaded(PyObj),
    Checkpoint(Skeleton),
}

/// One tensor of the checkpoint: its flattened key, its placeholder (or value), and its real
/// shape.
struct SourceTensor {
    key: String,
    t: HostTensor,
    shape: Vec<usize>,
}

impl SourceTensor {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl Opened {
    /// Opens `src` as the form `from` the caller recognized.
    fn open(src: &Path, from: HfSource) -> Result<Self> {
        let kind = match from {
            HfSource::File => {
                let headers = Headers::read(src)?;
                if headers.streamer(src, src, Views::Whole)?.is_some() {
                    Kind::File(headers)
                } else {
                    Kind::Loaded(crate::io::load(src)?)
                }
            }
            HfSource::Dcp => {
                let ckpt = DcpCheckpoint::open(src)?.dropping_behind();
                let placeholders = Placeholders::new(&ckpt)?;
                Kind::Dcp(ckpt, placeholders)
            }
            HfSource::Checkpoint => Kind::Checkpoint(Skeleton::model_params(src)?),
        };
        Ok(Opened {
            path: src.to_path_buf(),
            kind,
        })
    }

    fn obj(&self) -> &PyObj {
        match &self.kind {
            Kind::Dcp(_, p) => &p.obj,
            Kind::File(h) => h.obj(),
            Kind::Loaded(o) => o,
            Kind::Checkpoint(s) => &s.obj,
        }
    }

    /// Whether this is a DCP directory in Hugging Face storage, whose model keys sit at the
    /// top level (the default prefix is then `''`).
    fn hf_storage(&self) -> Option<&DcpCheckpoint> {
        match &self.kind {
            Kind::Dcp(ckpt, _)
                if matches!(ckpt.source(), crate::io::dcp::Source::HfStorage { .. }) =>
            {
                Some(ckpt)
            }
            _ => None,
        }
    }

    /// What streams the placeholders while `out` is written.
    fn streamer<'s>(&'s self, out: &'s Path) -> Result<Box<dyn LazyTensors + 's>> {
        Ok(match &self.kind {
            Kind::Dcp(ckpt, p) => Box::new(crate::io::dcp::Streamed::new(ckpt, p, |_| {})),
            Kind::File(h) => h
                .streamer(&self.path, out, Views::Whole)?
                .ok_or_else(|| Error::Internal("a streamable file stopped streaming".into()))?,
            Kind::Loaded(_) => Box::new(crate::io::torch_save::writer::Eager),
            Kind::Checkpoint(s) => Box::new(crate::checkpoint::stream::Streamed::new(
                &self.path,
                out,
                s,
                |_| {},
            )),
        })
    }

    /// The tensors, flattened (bytes entries and other values left out), with their real
    /// shapes. A tensor `safetensors` cannot hold (sparse, quantized) is refused by name.
    fn tensors(&self, lazy: &dyn LazyTensors) -> Result<Vec<SourceTensor>> {
        let obj = self.obj().values_only("a Hugging Face model")?;
        Ok(names::flatten(&obj)
            .into_iter()
            .map(|(key, t)| SourceTensor {
                shape: lazy.shape_of(&t).unwrap_or_else(|| t.shape().to_vec()),
                key,
                t,
            })
            .collect())
    }
}

/// A `config.json` to copy, and what it says of tied word embeddings.
pub(super) struct Config {
    bytes: Vec<u8>,
    pub(super) tie: hf::ties::WordEmbeddingTie,
}

pub(super) fn read_config(path: &Path) -> Result<Config> {
    let bytes = crate::storage::read_small_file(path)?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::HfModelDir {
            file: path.display().to_string(),
            key: None,
            reason: format!("the model configuration is not JSON: {e}"),
        })?;
    if !json.is_object() {
        return Err(Error::HfModelDir {
            file: path.display().to_string(),
            key: None,
            reason: format!(
                "the model configuration is {}, not an object",
                hf::ties::json_kind(&json)
            ),
        });
    }
    Ok(Config {
        tie: hf::ties::WordEmbeddingTie::of(&json, path)?,
        bytes,
    })
}

/// The tensors chosen: (index into the source's tensors, name in the output), in the
/// source's order, and the ties that leave some out.
struct Chosen {
    picked: Vec<(usize, String)>,
    ties: Vec<Tie>,
}

/// A tensor left out as equal to another: both names, and their source indices.
struct Tie {
    name: String,
    kept: String,
    dropped_src: usize,
    kept_src: usize,
    /// Saved as one storage (nothing to compare).
    same_storage: bool,
}

/// Selection (prefix), renames and ties; see [`HfExportOptions`].
fn choose(
    src: &Path,
    source: &Opened,
    tensors: &[SourceTensor],
    opts: &HfExportOptions,
    config: Option<&Config>,
) -> Result<Chosen> {
    let keys: Vec<String> = tensors.iter().map(|t| t.key.clone()).collect();
    let prefix = match (&opts.prefix, source.hf_storage()) {
        (Some(p), _) => Some(p.as_str()),
        (None, Some(_)) => Some(""),
        (None, None) => None,
    };
    let layout = names::Layout::of(source.obj(), &keys);
    let selected = names::select(src, &keys, prefix, layout)?;
    let stripped: Vec<String> = selected.iter().map(|(_, n)| n.clone()).collect();
    let renamed = names::rename_all(&opts.renames, &stripped)?;
    let picked: Vec<(usize, String)> = selected.iter().map(|(i, _)| *i).zip(renamed).collect();
    let by_name: HashMap<&str, usize> = picked.iter().map(|(i, n)| (n.as_str(), *i)).collect();

    let mut asked: Vec<(String, String, bool)> = opts
        .ties
        .iter()
        .map(|(n, k)| (n.clone(), k.clone(), true))
        .collect();
    for (n, k) in config.map_or(Ok(vec![]), |c| c.tie.ties(!opts.ties.is_empty()))? {
        if !asked.iter().any(|(a, _, _)| *a == n) {
            asked.push((n, k, false));
        }
    }
    let mut ties: Vec<Tie> = Vec::new();
    for (name, kept, explicit) in asked {
        let err = |reason: String| Error::HfTie {
            name: name.clone(),
            kept: kept.clone(),
            reason,
        };
        let (Some(&d), Some(&k)) = (by_name.get(name.as_str()), by_name.get(kept.as_str())) else {
            if !explicit {
                // `tie_word_embeddings` with the head already left out of the checkpoint.
                continue;
            }
            let missing = if by_name.contains_key(name.as_str()) {
                &kept
            } else {
                &name
            };
            return Err(err(format!(
                "the export has no tensor `{missing}` (names are compared after the prefix is stripped and the renames applied)"
            )));
        };
        if ties.iter().any(|t| t.name == name) {
            continue;
        }
        ties.push(Tie {
            name,
            kept,
            dropped_src: d,
            kept_src: k,
            same_storage: false,
        });
    }
    ties.extend(shared_storages(source, tensors, &picked, &ties));
    if let Some(t) = ties.iter().find(|t| ties.iter().any(|o| o.name == t.kept)) {
        return Err(Error::HfTie {
            name: t.name.clone(),
            kept: t.kept.clone(),
            reason: format!("`{}` is itself left out as tied to another tensor; tie both to the one that is kept", t.kept),
        });
    }
    Ok(Chosen { picked, ties })
}

/// Tensors of a `torch.save` file that are one view of one storage (tied weights saved as
/// one tensor): every one after the first is left out.
fn shared_storages(
    source: &Opened,
    tensors: &[SourceTensor],
    picked: &[(usize, String)],
    ties: &[Tie],
) -> Vec<Tie> {
    /// Where a tensor's bytes are: the archive storage a `torch.save` placeholder streams,
    /// or the memory it views (storage, first byte).
    #[derive(PartialEq, Eq, Hash)]
    enum Bytes<'a> {
        Stored(&'a str),
        Memory(usize, usize),
    }
    let view = |t: &SourceTensor| {
        let stored = match &source.kind {
            Kind::File(h) => h.storage_key(&t.t),
            _ => None,
        };
        let bytes = match stored {
            Some(key) => Bytes::Stored(key),
            None => Bytes::Memory(t.t.storage_id(), t.t.as_bytes().as_ptr() as usize),
        };
        (bytes, t.t.dtype(), t.shape.clone())
    };
    let mut first: HashMap<_, &(usize, String)> = HashMap::new();
    let mut out = Vec::new();
    for p in picked {
        if ties.iter().any(|t| t.name == p.1) {
            continue;
        }
        let v = view(&tensors[p.0]);
        match first.get(&v) {
            Some(k) => out.push(Tie {
                name: p.1.clone(),
                kept: k.1.clone(),
                dropped_src: p.0,
                kept_src: k.0,
                same_storage: true,
            }),
            None => {
                first.insert(v, p);
            }
        }
    }
    out
}

/// The directory plan: the chosen tensors not tied away, in the source's order, cast as
/// asked, split as `save_pretrained` splits (or as the Hugging Face storage's shard names
/// say, for such a source without `max_shard_size`).
fn make_plan(
    source: &Opened,
    tensors: &[SourceTensor],
    chosen: &Chosen,
    opts: &HfExportOptions,
) -> Result<DirPlan> {
    if let Some(to) = opts.dtype {
        if !(to.is_floating_point() && crate::tensor::cast::castable_to(to)) {
            return Err(Error::InvalidArgument {
                op: "exporting a Hugging Face model".into(),
                rank: 0,
                reason: format!(
                    "--dtype {to}: the export casts to bfloat16, float16, float32 or float64"
                ),
            });
        }
    }
    let planned: Vec<PlannedTensor> = chosen
        .picked
        .iter()
        .filter(|(_, n)| !chosen.ties.iter().any(|t| &t.name == n))
        .map(|(i, name)| {
            let from = tensors[*i].t.dtype();
            let to = match opts.dtype {
                Some(to) if crate::tensor::cast::casts(from, to) => to,
                _ => from,
            };
            PlannedTensor {
                name: name.clone(),
                source: *i,
                from,
                to,
                shape: tensors[*i].shape.clone(),
            }
        })
        .collect();
    let origin = |p: &PlannedTensor| {
        let key = &tensors[p.source].key;
        let renamed = if opts.renames.is_empty() {
            String::new()
        } else {
            let rules: Vec<&str> = opts.renames.iter().map(Rename::rule).collect();
            format!(", named by the renames {}", rules.join(" "))
        };
        format!("the key `{key}` of {}{renamed}", source.path.display())
    };
    let implied = source
        .hf_storage()
        .filter(|_| opts.max_shard_size.is_none())
        .and_then(|ckpt| ckpt.hf_model_files());
    match implied {
        Some(files) => {
            let mut named: std::collections::BTreeMap<(usize, usize), Vec<usize>> =
                Default::default();
            for (j, p) in planned.iter().enumerate() {
                let Some(&file) = files.get(&tensors[p.source].key) else {
                    return plan::split_plan(&planned, hf::DEFAULT_MAX_SHARD_SIZE, &origin);
                };
                named.entry(file).or_default().push(j);
            }
            let named = named
                .into_iter()
                .map(|((i, n), g)| (format!("model-{i:05}-of-{n:05}.safetensors"), g))
                .collect();
            plan::dir_plan(&planned, named, true, &origin)
        }
        None => plan::split_plan(
            &planned,
            opts.max_shard_size.unwrap_or(hf::DEFAULT_MAX_SHARD_SIZE),
            &origin,
        ),
    }
}

/// Streams tensor `t`'s bytes (in its own dtype) through `sink`.
fn stream_tensor(
    t: &SourceTensor,
    lazy: &mut dyn LazyTensors,
    out: &Path,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<()> {
    if lazy.shape_of(&t.t).is_some() {
        return lazy.stream(&t.t, sink);
    }
    sink(t.t.as_bytes()).map_err(Error::io("writing", out))
}

/// Checks that each tie's two tensors are equal: dtype, shape and every byte (the kept one
/// held in memory, the other streamed against it).
fn check_ties(tensors: &[SourceTensor], ties: &[Tie], lazy: &mut dyn LazyTensors) -> Result<()> {
    for tie in ties {
        let (d, k) = (&tensors[tie.dropped_src], &tensors[tie.kept_src]);
        let err = |reason: String| Error::HfTie {
            name: tie.name.clone(),
            kept: tie.kept.clone(),
            reason,
        };
        if d.t.dtype() != k.t.dtype() || d.shape != k.shape {
            return Err(err(format!(
                "`{}` is {} {:?} and `{}` is {} {:?}; tied tensors are one tensor",
                tie.name,
                d.t.dtype(),
                d.shape,
                tie.kept,
                k.t.dtype(),
                k.shape
            )));
        }
        if tie.same_storage {
            continue;
        }
        let mut kept = Vec::with_capacity(k.numel() * k.t.dtype().size());
        stream_tensor(k, lazy, Path::new("memory"), &mut |b| {
            kept.extend_from_slice(b);
            Ok(())
        })?;
        let (mut at, mut differs) = (0usize, None);
        stream_tensor(d, lazy, Path::new("memory"), &mut |b| {
            if differs.is_none() {
                let theirs = kept.get(at..at + b.len()).unwrap_or(&[]);
                if let Some(p) = b.iter().zip(theirs).position(|(x, y)| x != y) {
                    differs = Some(at + p);
                } else if theirs.len() < b.len() {
                    differs = Some(at + theirs.len());
                }
            }
            at += b.len();
            Ok(())
        })?;
        if let Some(byte) = differs {
            let element = byte / d.t.dtype().size();
            return Err(err(format!(
                "their values differ (first at element {element}); equal tensors are no proof of a tie, but different ones disprove it: export both (drop the tie) or fix the checkpoint"
            )));
        }
    }
    Ok(())
}

/// Writes this process's files of `plan` into the temporary `tmp` of `out`: each file goes to
/// the process whose equal span of the directory's bytes holds its first byte.
fn write_share(
    plan: &DirPlan,
    tensors: &[SourceTensor],
    lazy: &mut dyn LazyTensors,
    (out, tmp): (&Path, &Path),
    pg: &dyn ProcessGroup,
) -> Result<()> {
    let total: u64 = plan.files.iter().map(|f| f.len()).sum();
    let mut at = 0u64;
    for f in &plan.files {
        let start = at;
        at += f.len();
        if crate::storage::writer_of(start, total, pg.world_size()) != pg.rank() {
            continue;
        }
        let path = tmp.join(&f.name);
        let file = std::fs::File::create(&path)
            .map_err(crate::storage::tmp_io_err("creating", out, &path))?;
        hf::write::write_file(f, file, (out, &path), &mut |pt, sink| {
            stream_tensor(&tensors[pt.source], lazy, out, sink)
        })?;
    }
    Ok(())
}

/// With every file written: the index and the config, then the directory renamed into place.
fn commit(plan: &DirPlan, config: Option<&Config>, tmp: &Path, out: &Path) -> Result<()> {
    use crate::storage::{sync_dir, write_synced};
    if plan.indexed {
        write_synced(&tmp.join(hf::INDEX_FILE), &plan.index_json()?)?;
    }
    if let Some(c) = config {
        write_synced(&tmp.join(hf::CONFIG_FILE), &c.bytes)?;
    }
    sync_dir(tmp)?;
    crate::storage::check_dir_output(out, hf::HF_MODEL_DIR, &[])?;
    std::fs::rename(tmp, out).map_err(Error::io("renaming into place", out))?;
    sync_dir(
        out.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new(".")),
    )
}
