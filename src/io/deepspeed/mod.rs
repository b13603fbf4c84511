//! DeepSpeed checkpoints read without DeepSpeed: a ZeRO stage 1, 2 or 3 checkpoint (fp32 or
//! bf16, and `BF16_Optimizer`'s), the directory `engine.save_checkpoint` writes, and a
//! universal checkpoint (`ds_to_universal`'s output), each as per-parameter fp32 master
//! weights, Adam states and param groups, named as the plain model names its parameters.
//!
//! Teams that move from DeepSpeed to FSDP lose their optimizer state: DeepSpeed's own
//! `zero_to_fp32` keeps only the weights and needs DeepSpeed installed. Here the files are read
//! with `torch.load(weights_only=True)`'s allow-list plus the three inert DeepSpeed globals
//! their pickles name (`LossScaler`, `ZeroStageEnum`, `fragment_address`), and only for the
//! files of a recognised DeepSpeed checkpoint; every other DeepSpeed global is refused by
//! name. The format is described in `tests/golden/deepspeed/FORMAT.md`.
//!
//! [`DeepSpeedCheckpoint::open`] reads the structure only (the pickles, never the tensor
//! data) and checks the ranks' files against the ZeRO layout (`layout.rs`): a partition
//! shorter than the layout needs, a `latest` naming a missing tag, a rank file missing, or
//! files that disagree are typed errors before anything is read. Tensors are then read one
//! parameter at a time, each rank's byte ranges straight from its storage, every storage's
//! CRC-32 checked ([`DeepSpeedCheckpoint::read`]; the consolidations of [`crate::convert`]
//! stream them into their output).
//!
//! ```no_run
//! use fsdp::io::deepspeed::{DeepSpeedCheckpoint, State};
//! # fn main() -> fsdp::Result<()> {
//! let ckpt = DeepSpeedCheckpoint::open("checkpoints".as_ref())?; // the root with `latest`
//! println!("ZeRO-{} at {} ranks, tag {}", ckpt.stage(), ckpt.world_size(), ckpt.tag());
//! let exp_avg = ckpt.read("emb.weight", State::ExpAvg)?;
//! # Ok(()) }
//! ```

mod layout;
mod read;
mod stream;
mod universal;

pub(crate) use stream::Streamed;

use crate::error::{Error, Result};
use crate::io::torch_save::{Allow, Headers, PyObj, TensorValue};
use crate::tensor::{DType, HostTensor};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Which kind of DeepSpeed directory was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Form {
    /// `engine.save_checkpoint`'s directory: `latest` and a tag directory of
    /// `*_optim_states.pt` rank files (or the tag directory itself).
    Zero,
    /// A universal checkpoint (`ds_to_universal`): `zero/<param>/*.pt` per parameter and
    /// `zero/optimizer_state.pt`.
    Universal,
}

/// The DeepSpeed optimizer wrapper that saved the optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Wrapper {
    /// ZeRO stages 1 and 2 (`DeepSpeedZeroOptimizer`).
    DeepSpeedZeroOptimizer,
    /// ZeRO stage 3 (`DeepSpeedZeroOptimizer_Stage3`).
    #[serde(rename = "DeepSpeedZeroOptimizer_Stage3")]
    DeepSpeedZeroOptimizerStage3,
    /// bf16 with fp32 gradient accumulation at stage 1 (`BF16_Optimizer`).
    #[serde(rename = "BF16_Optimizer")]
    Bf16Optimizer,
}

impl Wrapper {
    /// DeepSpeed's class name.
    pub fn name(self) -> &'static str {
        match self {
            Wrapper::DeepSpeedZeroOptimizer => "DeepSpeedZeroOptimizer",
            Wrapper::DeepSpeedZeroOptimizerStage3 => "DeepSpeedZeroOptimizer_Stage3",
            Wrapper::Bf16Optimizer => "BF16_Optimizer",
        }
    }
}

/// A per-parameter tensor a DeepSpeed checkpoint holds (all float32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// The fp32 master weight.
    Fp32,
    /// Adam's first moment.
    ExpAvg,
    /// Adam's second moment.
    ExpAvgSq,
}

impl State {
    /// Every state, in the order Adam's state dict holds them (after `step`).
    pub const ALL: [State; 3] = [State::Fp32, State::ExpAvg, State::ExpAvgSq];

    /// The name: `fp32`, `exp_avg`, `exp_avg_sq` (the universal checkpoint's file stems).
    pub fn name(self) -> &'static str {
        match self {
            State::Fp32 => "fp32",
            State::ExpAvg => "exp_avg",
            State::ExpAvgSq => "exp_avg_sq",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A trained parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Param {
    /// Its name in the model (`model.named_parameters()`; a tied parameter's first name).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The optimizer param group it belongs to.
    pub group: usize,
}

/// An optimizer param group.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// The hyper-parameters, as the client optimizer's `state_dict()` has them, in order
    /// (`lr`, `betas`, …; without `params`).
    pub hyperparameters: Vec<(String, PyObj)>,
    /// The parameters, by name, in the optimizer's order.
    pub members: Vec<String>,
}

/// A persistent buffer of the model (`module.state_dict()` holds it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Buffer {
    /// Its name.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// Where a run of elements comes from: a stored tensor's storage in one of the files, or a
/// tensor read with the pickle (one of at most one element).
#[derive(Debug, Clone)]
enum Src {
    Stored {
        /// Index into [`DeepSpeedCheckpoint::files`].
        file: usize,
        /// The storage's key (`data/<key>`).
        key: String,
        /// The tensor's first element in the storage.
        offset: usize,
        dtype: DType,
        /// The end of the last element any run needs (reaching it checks the storage's
        /// CRC-32 at once).
        needed: usize,
    },
    Held(HostTensor),
}

/// Elements `start..start + len` of source `src`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    src: usize,
    start: usize,
    len: usize,
}

/// A DeepSpeed checkpoint's structure, checked, and where each parameter's tensors lie.
#[derive(Debug, Clone)]
pub struct DeepSpeedCheckpoint {
    /// The tag directory.
    dir: PathBuf,
    form: Form,
    stage: u8,
    dtype: DType,
    world_size: usize,
    tag: String,
    wrapper: Wrapper,
    params: Vec<Param>,
    groups: Vec<ParamGroup>,
    buffers: Vec<Buffer>,
    aliases: Vec<(String, String)>,
    /// `module.state_dict()`'s keys, in order.
    module_order: Vec<String>,
    /// Each parameter's Adam `step` (a 0-dim float32 tensor).
    steps: Vec<HostTensor>,
    /// The files tensors are read from.
    files: Vec<PathBuf>,
    srcs: Vec<Src>,
    /// Per parameter, per [`State`], the runs that make its flattened elements, in order.
    spans: Vec<[Vec<Span>; 3]>,
    /// Per buffer, its one run.
    buffer_spans: Vec<Span>,
}

impl DeepSpeedCheckpoint {
    /// Reads the structure of the DeepSpeed checkpoint at `path`: a ZeRO checkpoint's root
    /// (holding `latest`) or tag directory, or a universal checkpoint's tag directory
    /// (holding `zero/`) or its root (holding `latest_universal`). Only the pickles are read;
    /// every rank's partitions are checked against the ZeRO layout.
    pub fn open(path: &Path) -> Result<Self> {
        match locate(path)? {
            (Form::Zero, dir, tag) => read::open(&dir, tag),
            (Form::Universal, dir, tag) => universal::open(&dir, tag),
        }
    }

    /// The tag directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A ZeRO checkpoint or a universal one.
    pub fn form(&self) -> Form {
        self.form
    }

    /// The ZeRO stage (1, 2 or 3; `BF16_Optimizer`'s checkpoints are stage 1).
    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// The model's dtype (`bfloat16` for a bf16 run); the master weights and Adam states are
    /// float32 whatever it is.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The data-parallel world size it was saved at.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The tag (`latest`'s content, or the tag directory's name).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The optimizer wrapper that saved it.
    pub fn wrapper(&self) -> Wrapper {
        self.wrapper
    }

    /// The trained parameters, in the optimizer's flat order (param group by param group).
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The param groups.
    pub fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    /// The model's persistent buffers.
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }

    /// Tied aliases (DeepSpeed's `shared_params`): (alias, the parameter it is).
    pub fn aliases(&self) -> &[(String, String)] {
        &self.aliases
    }

    /// `module.state_dict()`'s keys, in order: parameters, buffers and tied aliases.
    pub fn module_order(&self) -> &[String] {
        &self.module_order
    }

    /// The files the tensors are read from.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Parameter `name`'s Adam `step` (a 0-dim float32 tensor, from the ZeRO optimizer
    /// states).
    pub fn step(&self, name: &str) -> Result<&HostTensor> {
        Ok(&self.steps[self.param_index(name)?])
    }

    fn param_index(&self, name: &str) -> Result<usize> {
        self.params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| Error::UnknownParameter {
                name: name.to_string(),
                site: crate::error::LookupSite::DeepSpeedCheckpoint,
            })
    }

    /// Reads parameter `name`'s `state` (float32, the parameter's shape; at stage 3 and in
    /// the universal checkpoint too), from every rank's partition, each storage's CRC-32
    /// checked.
    pub fn read(&self, name: &str, state: State) -> Result<HostTensor> {
        let i = self.param_index(name)?;
        let shape = self.params[i].shape.clone();
        let mut readers = stream::Readers::new(self);
        let t = readers.collect(&self.spans[i][state.index()], DType::F32, &shape)?;
        readers.finish()?;
        Ok(t)
    }

    /// Reads buffer `name` in its own dtype.
    pub fn read_buffer(&self, name: &str) -> Result<HostTensor> {
        let i = self
            .buffers
            .iter()
            .position(|b| b.name == name)
            .ok_or_else(|| Error::UnknownParameter {
                name: name.to_string(),
                site: crate::error::LookupSite::DeepSpeedCheckpoint,
            })?;
        let b = &self.buffers[i];
        let mut readers = stream::Readers::new(self);
        let t = readers.collect(&[self.buffer_spans[i]], b.dtype, &b.shape)?;
        readers.finish()?;
        Ok(t)
    }

    /// Bytes of the fp32 master weights.
    pub fn fp32_bytes(&self) -> u64 {
        self.params.iter().map(|p| numel(&p.shape) as u64 * 4).sum()
    }

    /// What `fsdp-ckpt inspect` prints.
    pub fn summary(&self) -> Summary {
        Summary::of(self)
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// What the DeepSpeed directory `path` is: its form, the tag directory and the tag.
fn locate(path: &Path) -> Result<(Form, PathBuf, String)> {
    let dir_name = |d: &Path| {
        d.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    if is_universal_tag_dir(path) {
        return Ok((Form::Universal, path.to_path_buf(), dir_name(path)));
    }
    if holds_optim_states(path) {
        return Ok((Form::Zero, path.to_path_buf(), dir_name(path)));
    }
    for (marker, form) in [
        ("latest_universal", Form::Universal),
        ("latest", Form::Zero),
    ] {
        if let Some(tag) = read_tag(&path.join(marker))? {
            let dir = path.join(&tag);
            if !dir.is_dir() {
                return Err(Error::DeepSpeedMissingTag {
                    dir: path.display().to_string(),
                    tag,
                });
            }
            return Ok((form, dir, tag));
        }
    }
    Err(Error::UnrecognizedInput {
        path: path.display().to_string(),
        found: "it is not a DeepSpeed checkpoint (no `latest` or `latest_universal`, no `*_optim_states.pt` files, no `zero/optimizer_state.pt`)".into(),
    })
}

/// The most bytes of a `latest` file read.
const MAX_TAG_BYTES: u64 = 4096;

/// The tag a `latest` (or `latest_universal`) file names: `None` when there is no such
/// regular file. A tag must be one path component.
pub(crate) fn read_tag(file: &Path) -> Result<Option<String>> {
    match std::fs::metadata(file) {
        Ok(m) if m.is_file() => {}
        _ => return Ok(None),
    }
    let bytes = crate::io::output::read_small_file(file)?;
    if bytes.len() as u64 > MAX_TAG_BYTES {
        return Err(Error::DeepSpeedInconsistent {
            file: file.display().to_string(),
            rank: None,
            param: None,
            reason: format!("{} bytes, more than a tag", bytes.len()),
        });
    }
    let tag = String::from_utf8_lossy(&bytes).trim().to_string();
    if tag.is_empty() || tag == "." || tag == ".." || tag.contains('/') || tag.contains('\0') {
        return Err(Error::DeepSpeedInconsistent {
            file: file.display().to_string(),
            rank: None,
            param: None,
            reason: format!("{tag:?} is not a tag directory's name"),
        });
    }
    Ok(Some(tag))
}

/// Whether `dir` is a universal checkpoint's tag directory (`zero/optimizer_state.pt`).
pub(crate) fn is_universal_tag_dir(dir: &Path) -> bool {
    dir.join("zero").join("optimizer_state.pt").is_file()
}

/// Whether `dir` holds ZeRO optimizer rank files (`*_optim_states.pt`).
pub(crate) fn holds_optim_states(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_string_lossy()
                .ends_with("_optim_states.pt")
        })
    })
}

/// Whether `dir` is a DeepSpeed checkpoint a reader takes, and of which form: a tag
/// directory of either form, or a root whose `latest` / `latest_universal` names a tag (a
/// tag whose directory is missing counts: reading it says so). What
/// [`crate::offline::recognize`] asks.
pub fn recognize_dir(dir: &Path) -> Option<Form> {
    if is_universal_tag_dir(dir) {
        return Some(Form::Universal);
    }
    if holds_optim_states(dir) {
        return Some(Form::Zero);
    }
    for (marker, form) in [
        ("latest_universal", Form::Universal),
        ("latest", Form::Zero),
    ] {
        let Ok(Some(tag)) = read_tag(&dir.join(marker)) else {
            continue;
        };
        let tag_dir = dir.join(tag);
        let fits = match form {
            Form::Universal => is_universal_tag_dir(&tag_dir),
            Form::Zero => holds_optim_states(&tag_dir),
        };
        if fits || !tag_dir.exists() {
            return Some(form);
        }
    }
    None
}

/// `(bf16, data-parallel rank, model-parallel rank)` of a ZeRO optimizer rank file's name,
/// `{bf16_}zero_pp_rank_{r}_mp_rank_{mp:02}_optim_states.pt`.
pub(crate) fn optim_file_rank(name: &str) -> Option<(bool, usize, usize)> {
    let (bf16, rest) = match name.strip_prefix("bf16_") {
        Some(rest) => (true, rest),
        None => (false, name),
    };
    let (dp, mp) = ranks_of(rest.strip_suffix("_optim_states.pt")?)?;
    Some((bf16, dp, mp))
}

/// `(dp, mp)` of `zero_pp_rank_{dp}_mp_rank_{mp}`.
fn ranks_of(stem: &str) -> Option<(usize, usize)> {
    let rest = stem.strip_prefix("zero_pp_rank_")?;
    let (dp, mp) = rest.split_once("_mp_rank_")?;
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    Some((number(dp)?, number(mp)?))
}

/// Whether the file at `path` is a lone file of a DeepSpeed checkpoint, by its name:
/// `zero_pp_rank_{r}_mp_rank_{mp}_optim_states.pt` (with or without `bf16_`),
/// `mp_rank_{mp}_model_states.pt`, `zero_pp_rank_{r}_mp_rank_{mp}_model_states.pt`, or a
/// universal checkpoint's `zero/optimizer_state.pt`. Such a file is read with the
/// DeepSpeed allow-list ([`load_file_headers`]).
pub fn is_checkpoint_file(path: &Path) -> bool {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy()) else {
        return false;
    };
    if optim_file_rank(&name).is_some() {
        return true;
    }
    if let Some(stem) = name.strip_suffix("_model_states.pt") {
        let mp = stem
            .strip_prefix("mp_rank_")
            .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()));
        return mp || ranks_of(stem).is_some();
    }
    name == "optimizer_state.pt"
        && path
            .parent()
            .and_then(Path::file_name)
            .is_some_and(|p| p == "zero")
}

/// The structure of a lone DeepSpeed checkpoint file ([`is_checkpoint_file`]), read with the
/// DeepSpeed allow-list: what `fsdp-ckpt inspect` shows of it. Any other file is refused.
pub fn load_file_headers(path: &Path) -> Result<Headers> {
    if !is_checkpoint_file(path) {
        return Err(Error::Unsupported(format!(
            "`{}` is not named as a DeepSpeed checkpoint file (`zero_pp_rank_R_mp_rank_MM_optim_states.pt`, `mp_rank_MM_model_states.pt`, …); its DeepSpeed globals are not read",
            path.display()
        )));
    }
    crate::io::torch_save::load_headers_with(path, Allow::DeepSpeed)
}

// ----- reading the pickles -----

/// One file's pickle, read with placeholders for its tensors.
struct Pickled {
    path: PathBuf,
    rank: Option<usize>,
    headers: Headers,
}

impl Pickled {
    fn load(path: &Path, rank: Option<usize>, allow: Allow) -> Result<Self> {
        Ok(Pickled {
            path: path.to_path_buf(),
            rank,
            headers: crate::io::torch_save::load_headers_with(path, allow)?,
        })
    }

    fn root(&self) -> &PyObj {
        &self.headers.obj
    }

    fn err(&self, param: Option<&str>, reason: impl Into<String>) -> Error {
        Error::DeepSpeedInconsistent {
            file: self.path.display().to_string(),
            rank: self.rank,
            param: param.map(str::to_string),
            reason: reason.into(),
        }
    }

    /// `obj[key]`, or an error naming `what` (`optimizer_state_dict['zero_stage']`).
    fn at<'a>(&self, obj: &'a PyObj, key: &str, what: &str) -> Result<&'a PyObj> {
        get(obj, key).ok_or_else(|| self.err(None, format!("no `{what}`")))
    }

    fn seq<'a>(&self, obj: &'a PyObj, what: &str) -> Result<&'a [PyObj]> {
        seq(obj).ok_or_else(|| {
            self.err(
                None,
                format!("`{what}` is a {}, not a list", obj.describe()),
            )
        })
    }

    fn int(&self, obj: &PyObj, what: &str) -> Result<usize> {
        match obj {
            PyObj::Int(i) if *i >= 0 => Ok(*i as usize),
            other => Err(self.err(
                None,
                format!("`{what}` is a {}, not a count", other.describe()),
            )),
        }
    }

    /// The dense tensor `obj`, or an error naming `what`.
    fn tensor<'a>(&self, obj: &'a PyObj, what: &str) -> Result<&'a HostTensor> {
        tensor(obj).ok_or_else(|| {
            self.err(
                None,
                format!("`{what}` is a {}, not a dense tensor", obj.describe()),
            )
        })
    }

    /// The real shape of the tensor `t` of this file.
    fn shape(&self, t: &HostTensor) -> Vec<usize> {
        self.headers.shape(t).to_vec()
    }

    /// Where tensor `t` (`what`) of this file, index `file` of the checkpoint's files, lies:
    /// its source and element count. A tensor must be contiguous.
    fn src(&self, t: &HostTensor, file: usize, what: &str) -> Result<(Src, usize)> {
        let n = numel(&self.shape(t));
        Ok(match self.headers.view(t) {
            None => (Src::Held(t.clone()), t.numel()),
            Some(v) if v.contiguous => (
                Src::Stored {
                    file,
                    key: v.key.clone(),
                    offset: v.offset,
                    dtype: t.dtype(),
                    needed: 0,
                },
                n,
            ),
            Some(_) => {
                return Err(self.err(
                    None,
                    format!("`{what}` is a non-contiguous view, which DeepSpeed never saves"),
                ))
            }
        })
    }
}

/// `obj[key]` of a dict or `OrderedDict` with string keys.
fn get<'a>(obj: &'a PyObj, key: &str) -> Option<&'a PyObj> {
    items(obj)?
        .iter()
        .find(|(k, _)| matches!(k, PyObj::Str(s) if s == key))
        .map(|(_, v)| v)
}

/// `obj[key]` of a dict with int keys.
fn get_int(obj: &PyObj, key: i64) -> Option<&PyObj> {
    items(obj)?
        .iter()
        .find(|(k, _)| matches!(k, PyObj::Int(i) if *i == key))
        .map(|(_, v)| v)
}

fn items(obj: &PyObj) -> Option<&[(PyObj, PyObj)]> {
    match obj {
        PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => Some(items),
        _ => None,
    }
}

fn seq(obj: &PyObj) -> Option<&[PyObj]> {
    match obj {
        PyObj::List(v) | PyObj::Tuple(v) => Some(v),
        _ => None,
    }
}

/// The dense tensor `obj` is (a plain tensor, or one with attributes such as ZeRO-3's
/// `ds_id`).
fn tensor(obj: &PyObj) -> Option<&HostTensor> {
    match obj {
        PyObj::Tensor(t) => Some(t),
        PyObj::RichTensor(r) => match &r.value {
            TensorValue::Dense(t) => Some(t),
            _ => None,
        },
        _ => None,
    }
}

/// A `torch.Size` (or a tuple or list of ints) as a shape.
fn shape_of(obj: &PyObj) -> Option<Vec<usize>> {
    match obj {
        PyObj::Size(d) => d.iter().map(|&x| usize::try_from(x).ok()).collect(),
        _ => seq(obj)?
            .iter()
            .map(|x| match x {
                PyObj::Int(i) => usize::try_from(*i).ok(),
                _ => None,
            })
            .collect(),
    }
}

/// A parameter name that can name a file of a universal checkpoint and a key: not empty,
/// one path component.
fn check_name(p: &Pickled, name: &str) -> Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(p.err(
            Some(name),
            "a parameter name that is not one path component",
        ));
    }
    Ok(())
}

/// What the model-states file (`mp_rank_00_model_states.pt`, or rank 0's at stage 3) says.
struct ModelStates {
    /// Per flat group (ZeRO-1/2) or sub-group (ZeRO-3): names and shapes, in flat order.
    param_shapes: Vec<Vec<(String, Vec<usize>)>>,
    /// Buffers: name, tensor source, dtype, shape.
    buffers: Vec<(Buffer, Src)>,
    /// `shared_params`: alias → primary.
    aliases: Vec<(String, String)>,
    module_order: Vec<String>,
    dtype: DType,
    dp_world_size: Option<usize>,
}

impl ModelStates {
    /// Reads the model-states file `p`, index `file` of the checkpoint's files.
    fn read(p: &Pickled, file: usize) -> Result<Self> {
        let root = p.root();
        let mut param_shapes = Vec::new();
        for (g, group) in p
            .seq(p.at(root, "param_shapes", "param_shapes")?, "param_shapes")?
            .iter()
            .enumerate()
        {
            let entries = items(group).ok_or_else(|| {
                p.err(None, format!("`param_shapes[{g}]` is not a dict of shapes"))
            })?;
            let mut names = Vec::new();
            for (k, v) in entries {
                let PyObj::Str(name) = k else {
                    return Err(p.err(
                        None,
                        format!("`param_shapes[{g}]` has a key that is not a name"),
                    ));
                };
                check_name(p, name)?;
                let shape = shape_of(v).ok_or_else(|| {
                    p.err(Some(name), "its shape in `param_shapes` is not a shape")
                })?;
                names.push((name.clone(), shape));
            }
            param_shapes.push(names);
        }
        let frozen: Vec<String> = get(root, "frozen_param_shapes")
            .and_then(items)
            .map(|f| f.iter().map(|(k, _)| k.describe()).collect())
            .unwrap_or_default();
        if !frozen.is_empty() {
            return Err(Error::Unsupported(format!(
                "`{}` has frozen parameters (requires_grad=False: {}); reading them is not implemented yet",
                p.path.display(),
                frozen.join(", ")
            )));
        }
        let module = p.at(root, "module", "module")?;
        let module_items = items(module).ok_or_else(|| p.err(None, "`module` is not a dict"))?;
        let buffer_names: Vec<String> = match get(root, "buffer_names") {
            None | Some(PyObj::None) => Vec::new(),
            Some(list) => p
                .seq(list, "buffer_names")?
                .iter()
                .map(|b| match b {
                    PyObj::Str(s) => Ok(s.clone()),
                    other => Err(p.err(
                        None,
                        format!("a buffer name that is a {}", other.describe()),
                    )),
                })
                .collect::<Result<_>>()?,
        };
        let mut buffers = Vec::new();
        for name in &buffer_names {
            let t = get(module, name).ok_or_else(|| {
                p.err(
                    Some(name),
                    "a buffer `buffer_names` lists but `module` lacks",
                )
            })?;
            let t = p.tensor(t, &format!("module['{name}']"))?;
            let shape = p.shape(t);
            let (src, n) = p.src(t, file, &format!("module['{name}']"))?;
            if n != numel(&shape) {
                return Err(p.err(Some(name), "a buffer whose data is not its shape's"));
            }
            buffers.push((
                Buffer {
                    name: name.clone(),
                    dtype: t.dtype(),
                    shape,
                },
                src,
            ));
        }
        let mut aliases = Vec::new();
        if let Some(shared) = get(root, "shared_params").and_then(items) {
            for (k, v) in shared {
                let (PyObj::Str(alias), PyObj::Str(primary)) = (k, v) else {
                    return Err(p.err(None, "`shared_params` is not a dict of names"));
                };
                aliases.push((alias.clone(), primary.clone()));
            }
        }
        let module_order: Vec<String> = module_items
            .iter()
            .map(|(k, _)| match k {
                PyObj::Str(s) => Ok(s.clone()),
                other => Err(p.err(
                    None,
                    format!("a `module` key that is a {}", other.describe()),
                )),
            })
            .collect::<Result<_>>()?;
        let first_param = param_shapes.iter().flatten().map(|(n, _)| n).next();
        let dtype = match first_param.and_then(|n| get(module, n)).and_then(tensor) {
            Some(t) => t.dtype(),
            None => config_dtype(root),
        };
        let dp_world_size = match get(root, "dp_world_size") {
            Some(PyObj::Int(n)) if *n > 0 => Some(*n as usize),
            _ => None,
        };
        Ok(ModelStates {
            param_shapes,
            buffers,
            aliases,
            module_order,
            dtype,
            dp_world_size,
        })
    }

    /// Checks the aliases and the module's keys against the parameters and buffers.
    fn check(&self, p: &Pickled) -> Result<()> {
        let params: std::collections::HashSet<&str> = self
            .param_shapes
            .iter()
            .flatten()
            .map(|(n, _)| n.as_str())
            .collect();
        if params.len() != self.param_shapes.iter().map(Vec::len).sum::<usize>() {
            return Err(p.err(None, "`param_shapes` names a parameter twice"));
        }
        for (alias, primary) in &self.aliases {
            if !params.contains(primary.as_str()) {
                return Err(p.err(
                    Some(alias),
                    format!(
                        "`shared_params` ties it to `{primary}`, which is no trained parameter"
                    ),
                ));
            }
        }
        for name in &self.module_order {
            let known = params.contains(name.as_str())
                || self.buffers.iter().any(|(b, _)| &b.name == name)
                || self.aliases.iter().any(|(a, _)| a == name);
            if !known {
                return Err(p.err(
                    Some(name),
                    "a `module` entry that is no trained parameter, buffer or tied alias",
                ));
            }
        }
        Ok(())
    }
}

/// The model dtype `ds_config` names (`bf16.enabled`, `fp16.enabled`), float32 otherwise.
fn config_dtype(root: &PyObj) -> DType {
    let enabled = |section: &str| {
        get(root, "ds_config")
            .and_then(|c| get(c, section))
            .and_then(|s| get(s, "enabled"))
            .is_some_and(|e| matches!(e, PyObj::Bool(true)))
    };
    if enabled("bf16") || enabled("bfloat16") {
        DType::BF16
    } else if enabled("fp16") {
        DType::F16
    } else {
        DType::F32
    }
}

/// A param group's hyper-parameters, in order (its dict without `params`).
type Hyper = Vec<(String, PyObj)>;

/// A param group's hyper-parameters (its dict without `params`) and the indices `params`
/// lists.
fn hyperparameters(p: &Pickled, group: &PyObj, g: usize) -> Result<(Hyper, Vec<usize>)> {
    let entries =
        items(group).ok_or_else(|| p.err(None, format!("`param_groups[{g}]` is not a dict")))?;
    let mut hyper = Vec::new();
    let mut ids = None;
    for (k, v) in entries {
        let PyObj::Str(k) = k else {
            return Err(p.err(
                None,
                format!("`param_groups[{g}]` has a key that is not a name"),
            ));
        };
        if k == "params" {
            ids = Some(
                p.seq(v, &format!("param_groups[{g}]['params']"))?
                    .iter()
                    .map(|x| p.int(x, &format!("param_groups[{g}]['params']")))
                    .collect::<Result<Vec<_>>>()?,
            );
        } else {
            hyper.push((k.clone(), v.clone()));
        }
    }
    let ids = ids.ok_or_else(|| p.err(None, format!("`param_groups[{g}]` has no `params`")))?;
    Ok((hyper, ids))
}

/// The parts of a checkpoint [`read`] and [`universal`] build, assembled and checked.
struct Parts {
    dir: PathBuf,
    form: Form,
    stage: u8,
    wrapper: Wrapper,
    world_size: usize,
    tag: String,
    model: ModelStates,
    /// Per sub-group: the param group it belongs to.
    group_of: Vec<usize>,
    /// Per param group: hyper-parameters.
    hyper: Vec<Hyper>,
    /// Per parameter in `param_shapes` order: its step and state spans.
    steps: Vec<HostTensor>,
    spans: Vec<[Vec<Span>; 3]>,
    files: Vec<PathBuf>,
    srcs: Vec<Src>,
    /// Index of the model-states file in `files`.
    model_file: usize,
}

impl Parts {
    fn assemble(self) -> DeepSpeedCheckpoint {
        let mut srcs = self.srcs;
        let mut params = Vec::new();
        let mut members = vec![Vec::new(); self.hyper.len()];
        for (s, names) in self.model.param_shapes.iter().enumerate() {
            for (name, shape) in names {
                let group = self.group_of[s];
                members[group].push(name.clone());
                params.push(Param {
                    name: name.clone(),
                    shape: shape.clone(),
                    group,
                });
            }
        }
        let groups = self
            .hyper
            .into_iter()
            .zip(members)
            .map(|(hyperparameters, members)| ParamGroup {
                hyperparameters,
                members,
            })
            .collect();
        let mut buffers = Vec::new();
        let mut buffer_spans = Vec::new();
        for (b, src) in self.model.buffers {
            buffer_spans.push(Span {
                src: srcs.len(),
                start: 0,
                len: numel(&b.shape),
            });
            srcs.push(src);
            buffers.push(b);
        }
        debug_assert!(self.model_file < self.files.len());
        // Each stored source's last needed element, so that reading it checks its CRC-32.
        for span in self.spans.iter().flatten().flatten().chain(&buffer_spans) {
            if let Src::Stored { needed, .. } = &mut srcs[span.src] {
                *needed = (*needed).max(span.start + span.len);
            }
        }
        DeepSpeedCheckpoint {
            dir: self.dir,
            form: self.form,
            stage: self.stage,
            dtype: self.model.dtype,
            world_size: self.world_size,
            tag: self.tag,
            wrapper: self.wrapper,
            params,
            groups,
            buffers,
            aliases: self.model.aliases,
            module_order: self.model.module_order,
            steps: self.steps,
            files: self.files,
            srcs,
            spans: self.spans,
            buffer_spans,
        }
    }
}

/// Maps each sub-group to its param group from the groups' `params` lists, which must list
/// every sub-group exactly once.
fn group_of_subgroups(p: &Pickled, ids: &[Vec<usize>], subgroups: usize) -> Result<Vec<usize>> {
    let mut group_of = vec![usize::MAX; subgroups];
    for (g, list) in ids.iter().enumerate() {
        for &s in list {
            match group_of.get_mut(s) {
                Some(slot) if *slot == usize::MAX => *slot = g,
                Some(_) => {
                    return Err(p.err(
                        None,
                        format!(
                            "param group {g} lists flat group {s}, which another group lists too"
                        ),
                    ))
                }
                None => {
                    return Err(p.err(
                        None,
                        format!(
                        "param group {g} lists flat group {s}, but `param_shapes` has {subgroups}"
                    ),
                    ))
                }
            }
        }
    }
    if let Some(s) = group_of.iter().position(|&g| g == usize::MAX) {
        return Err(p.err(None, format!("no param group lists flat group {s}")));
    }
    Ok(group_of)
}

// ----- inspect -----

/// What a DeepSpeed checkpoint holds, from its structure alone (`fsdp-ckpt inspect`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// The tag directory.
    pub dir: String,
    /// ZeRO or universal.
    pub form: Form,
    /// The ZeRO stage.
    pub stage: u8,
    /// The model dtype (`torch.bfloat16`, …).
    pub dtype: String,
    /// The data-parallel world size.
    pub world_size: usize,
    /// The tag.
    pub tag: String,
    /// The optimizer wrapper.
    pub optimizer: Wrapper,
    /// The files read.
    pub files: Vec<String>,
    /// Per trained parameter: name, shape, group, states and step.
    pub params: Vec<ParamSummary>,
    /// The param groups: hyper-parameters and members.
    pub param_groups: Vec<serde_json::Value>,
    /// The persistent buffers.
    pub buffers: Vec<Buffer>,
    /// Tied aliases: alias → parameter.
    pub tied: Vec<(String, String)>,
    /// Bytes of float32 tensors of the parameters' states (master weights and Adam's).
    pub state_bytes: u64,
}

/// One parameter in a [`Summary`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParamSummary {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its param group.
    pub group: usize,
    /// The states it has (`fp32`, `exp_avg`, `exp_avg_sq`, all float32 of its shape).
    pub states: Vec<State>,
    /// Adam's `step`.
    pub step: Option<f64>,
}

impl Summary {
    fn of(c: &DeepSpeedCheckpoint) -> Summary {
        let params: Vec<ParamSummary> = c
            .params
            .iter()
            .zip(&c.steps)
            .map(|(p, s)| ParamSummary {
                name: p.name.clone(),
                shape: p.shape.clone(),
                group: p.group,
                states: State::ALL.to_vec(),
                step: s.item(),
            })
            .collect();
        Summary {
            dir: c.dir.display().to_string(),
            form: c.form,
            stage: c.stage,
            dtype: c.dtype.torch_name().to_string(),
            world_size: c.world_size,
            tag: c.tag.clone(),
            optimizer: c.wrapper,
            files: c
                .files
                .iter()
                .map(|f| f.strip_prefix(&c.dir).unwrap_or(f).display().to_string())
                .collect(),
            state_bytes: c.fp32_bytes() * State::ALL.len() as u64,
            params,
            param_groups: c
                .groups
                .iter()
                .map(|g| {
                    let hyper: serde_json::Map<String, serde_json::Value> = g
                        .hyperparameters
                        .iter()
                        .map(|(k, v)| (k.clone(), value_json(v)))
                        .collect();
                    serde_json::json!({"hyperparameters": hyper, "members": g.members})
                })
                .collect(),
            buffers: c.buffers.clone(),
            tied: c.aliases.clone(),
        }
    }
}

/// A hyper-parameter as JSON: numbers, bools, strings, `null`, lists for tuples and lists;
/// anything else as its description.
fn value_json(v: &PyObj) -> serde_json::Value {
    use serde_json::json;
    match v {
        PyObj::None => json!(null),
        PyObj::Bool(b) => json!(b),
        PyObj::Int(i) => json!(i),
        PyObj::Float(x) if x.is_finite() => json!(x),
        PyObj::Float(x) => json!(x.to_string()),
        PyObj::Str(s) => json!(s),
        PyObj::List(items) | PyObj::Tuple(items) => {
            serde_json::Value::Array(items.iter().map(value_json).collect())
        }
        other => json!(other.describe()),
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let form = match self.form {
            Form::Zero => "DeepSpeed ZeRO checkpoint",
            Form::Universal => "DeepSpeed universal checkpoint",
        };
        writeln!(f, "{form}: {} (tag {})", self.dir, self.tag)?;
        writeln!(
            f,
            "ZeRO stage {}, model dtype {}, world size {}, optimizer {}",
            self.stage,
            self.dtype,
            self.world_size,
            self.optimizer.name()
        )?;
        writeln!(
            f,
            "{} parameters, {} bytes of float32 state (fp32 master, exp_avg, exp_avg_sq)",
            self.params.len(),
            self.state_bytes
        )?;
        writeln!(f, "files:")?;
        for file in &self.files {
            writeln!(f, "  {file}")?;
        }
        writeln!(f, "param groups:")?;
        for (i, g) in self.param_groups.iter().enumerate() {
            writeln!(f, "  {i}: {}", g["hyperparameters"])?;
        }
        writeln!(
            f,
            "parameters (states fp32, exp_avg, exp_avg_sq: float32 of the shape; step):"
        )?;
        for p in &self.params {
            let step = p.step.map_or("-".to_string(), |s| s.to_string());
            writeln!(
                f,
                "  {} {:?} group {} step {step}",
                p.name, p.shape, p.group
            )?;
        }
        if !self.buffers.is_empty() {
            writeln!(f, "buffers:")?;
            for b in &self.buffers {
                writeln!(f, "  {} {} {:?}", b.name, b.dtype.torch_name(), b.shape)?;
            }
        }
        if !self.tied.is_empty() {
            writeln!(f, "tied:")?;
            for (alias, primary) in &self.tied {
                writeln!(f, "  {alias} = {primary}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_file_names() {
        assert_eq!(
            optim_file_rank("bf16_zero_pp_rank_10_mp_rank_00_optim_states.pt"),
            Some((true, 10, 0))
        );
        assert_eq!(
            optim_file_rank("zero_pp_rank_3_mp_rank_01_optim_states.pt"),
            Some((false, 3, 1))
        );
        assert_eq!(
            optim_file_rank("zero_pp_rank__mp_rank_00_optim_states.pt"),
            None
        );
        assert_eq!(
            optim_file_rank("fp16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
            None
        );
        for lone in [
            "a/mp_rank_00_model_states.pt",
            "zero_pp_rank_1_mp_rank_00_model_states.pt",
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "ucp/step3/zero/optimizer_state.pt",
        ] {
            assert!(is_checkpoint_file(Path::new(lone)), "{lone}");
        }
        for other in [
            "model_states.pt",
            "optimizer_state.pt",
            "mp_rank__model_states.pt",
            "x/zero_pp_rank_0_optim_states.pt",
        ] {
            assert!(!is_checkpoint_file(Path::new(other)), "{other}");
        }
    }

    #[test]
    fn hyperparameters_as_json() {
        let betas = PyObj::Tuple(vec![PyObj::Float(0.9), PyObj::Float(0.95)]);
        assert_eq!(value_json(&betas), serde_json::json!([0.9, 0.95]));
        assert_eq!(value_json(&PyObj::None), serde_json::Value::Null);
    }
}
