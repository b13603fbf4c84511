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
//! CRC-32 checked ([`DeepSpeedCheckpoint::read`]; the consolidations of [`crate::commands::conversions`]
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
mod pickled;
mod read;
mod stream;
mod summary;
mod universal;

pub(crate) use stream::Streamed;
pub use summary::{ParamSummary, Summary};

use crate::error::{Error, Result};
use crate::io::torch_save::{Allow, Headers, PyObj};
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

/// A frozen parameter (`requires_grad=False`): the optimizer does not hold it, so it has no
/// fp32 master and no Adam state; its weight is the model's, in the model's dtype, from the
/// model-states files (`frozen_param_fragments` from stage 2 on, each rank's partition at
/// stage 3; at stage 1, which saves no fragments, `module`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FrozenParam {
    /// Its name in the model (a tied parameter's first name).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype (the model's: `bfloat16` in a bf16 run).
    pub dtype: DType,
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
    frozen: Vec<FrozenParam>,
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
    /// Per frozen parameter, the runs that make its flattened elements (in its own dtype).
    frozen_spans: Vec<Vec<Span>>,
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

    /// The frozen parameters, in the order DeepSpeed saved them (`module.parameters()`
    /// order).
    pub fn frozen(&self) -> &[FrozenParam] {
        &self.frozen
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

    /// `module.state_dict()`'s keys, in order: parameters (frozen ones too), buffers and tied
    /// aliases.
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

    /// Reads frozen parameter `name` in its own dtype (the model's), from every rank's
    /// partition at stage 3, each storage's CRC-32 checked.
    pub fn read_frozen(&self, name: &str) -> Result<HostTensor> {
        let i = self
            .frozen
            .iter()
            .position(|f| f.name == name)
            .ok_or_else(|| Error::UnknownParameter {
                name: name.to_string(),
                site: crate::error::LookupSite::DeepSpeedCheckpoint,
            })?;
        let f = &self.frozen[i];
        let mut readers = stream::Readers::new(self);
        let t = readers.collect(&self.frozen_spans[i], f.dtype, &f.shape)?;
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
            return match crate::storage::check_dir(&dir) {
                Ok(()) => Ok((form, dir, tag)),
                Err(e) if e.is_missing() => Err(Error::DeepSpeedMissingTag {
                    dir: path.display().to_string(),
                    tag,
                }),
                Err(e) => Err(e.at("opening", &dir)),
            };
        }
    }
    Err(Error::UnrecognizedInput {
        path: path.display().to_string(),
        found: "it is not a DeepSpeed checkpoint (no `latest` or `latest_universal`, no `*_optim_states.pt` files, no `zero/optimizer_state.pt`)".into(),
    })
}

/// The most bytes of a `latest` file read.
const MAX_TAG_BYTES: u64 = 4096;

/// The tag a `latest` (or `latest_universal`) file names (DeepSpeed strips it): `None` when
/// there is no such entry. The file is read by the rule of every input
/// ([`crate::storage::read_regular`]: a regular file, symbolic links followed, at most
/// [`MAX_TAG_BYTES`]), and the tag must be a plain name ([`crate::storage::check_name`]):
/// each fault is an error naming the file and what is wrong.
pub(crate) fn read_tag(file: &Path) -> Result<Option<String>> {
    let refused = |reason: String| Error::DeepSpeedInconsistent {
        file: file.display().to_string(),
        rank: None,
        param: None,
        reason,
    };
    let bytes = match crate::storage::read_regular(file, MAX_TAG_BYTES) {
        Ok(bytes) => bytes,
        Err(e) if e.is_missing() => return Ok(None),
        Err(e @ crate::storage::ReadRegularError::Io(_)) => {
            return Err(e.at("reading", file));
        }
        Err(e) => return Err(refused(format!("{e}; it must name the tag directory"))),
    };
    let tag = String::from_utf8_lossy(&bytes).trim().to_string();
    if let Some(why) = crate::storage::check_name(&tag, crate::storage::NameForm::Plain) {
        return Err(refused(format!(
            "it names the tag `{}`, which cannot be a directory beside it: {why}",
            crate::error::shown(&tag)
        )));
    }
    Ok(Some(tag))
}

/// Whether `dir` is a universal checkpoint's tag directory: it holds an entry
/// `zero/optimizer_state.pt` (of any kind: reading it says what is wrong with it).
pub(crate) fn is_universal_tag_dir(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join("zero").join("optimizer_state.pt")).is_ok()
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
/// tag whose directory is missing, or is not a directory, counts: reading it says so). A
/// `latest` that cannot be read or names no plain tag is an error naming it. What
/// [`crate::commands::recognize`] asks.
pub fn recognize_dir(dir: &Path) -> Result<Option<Form>> {
    if is_universal_tag_dir(dir) {
        return Ok(Some(Form::Universal));
    }
    if holds_optim_states(dir) {
        return Ok(Some(Form::Zero));
    }
    for (marker, form) in [
        ("latest_universal", Form::Universal),
        ("latest", Form::Zero),
    ] {
        let Some(tag) = read_tag(&dir.join(marker))? else {
            continue;
        };
        let tag_dir = dir.join(tag);
        let fits = match form {
            Form::Universal => is_universal_tag_dir(&tag_dir),
            Form::Zero => holds_optim_states(&tag_dir),
        };
        if fits || crate::storage::check_dir(&tag_dir).is_err() {
            return Ok(Some(form));
        }
    }
    Ok(None)
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
}
