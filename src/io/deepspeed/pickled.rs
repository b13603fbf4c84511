//! The checkpoint's pickles read into its structure: the model-states file (parameters,
//! buffers, tied aliases, dtype), the param groups' hyper-parameters, and the parts the ZeRO
//! and universal readers ([`super::read`], [`super::universal`]) assemble into a
//! [`DeepSpeedCheckpoint`], each fault an error naming the file, rank and parameter.

use super::{
    numel, Buffer, DeepSpeedCheckpoint, Form, FrozenParam, Param, ParamGroup, Span, Src, Wrapper,
};
use crate::error::{Error, Result};
use crate::io::torch_save::{Allow, Headers, PyObj, TensorValue};
use crate::tensor::{DType, HostTensor};
use std::path::{Path, PathBuf};

/// One file's pickle, read with placeholders for its tensors.
pub(super) struct Pickled {
    pub(super) path: PathBuf,
    pub(super) rank: Option<usize>,
    pub(super) headers: Headers,
}

impl Pickled {
    pub(super) fn load(path: &Path, rank: Option<usize>, allow: Allow) -> Result<Self> {
        Ok(Pickled {
            path: path.to_path_buf(),
            rank,
            headers: crate::io::torch_save::load_headers_with(path, allow)?,
        })
    }

    pub(super) fn root(&self) -> &PyObj {
        &self.headers.obj
    }

    pub(super) fn err(&self, param: Option<&str>, reason: impl Into<String>) -> Error {
        Error::DeepSpeedInconsistent {
            file: self.path.display().to_string(),
            rank: self.rank,
            param: param.map(str::to_string),
            reason: reason.into(),
        }
    }

    /// `obj[key]`, or an error naming `what` (`optimizer_state_dict['zero_stage']`).
    pub(super) fn at<'a>(&self, obj: &'a PyObj, key: &str, what: &str) -> Result<&'a PyObj> {
        get(obj, key).ok_or_else(|| self.err(None, format!("no `{what}`")))
    }

    pub(super) fn seq<'a>(&self, obj: &'a PyObj, what: &str) -> Result<&'a [PyObj]> {
        seq(obj).ok_or_else(|| {
            self.err(
                None,
                format!("`{what}` is a {}, not a list", obj.describe()),
            )
        })
    }

    pub(super) fn int(&self, obj: &PyObj, what: &str) -> Result<usize> {
        match obj {
            PyObj::Int(i) if *i >= 0 => Ok(*i as usize),
            other => Err(self.err(
                None,
                format!("`{what}` is a {}, not a count", other.describe()),
            )),
        }
    }

    /// The dense tensor `obj`, or an error naming `what`.
    pub(super) fn tensor<'a>(&self, obj: &'a PyObj, what: &str) -> Result<&'a HostTensor> {
        tensor(obj).ok_or_else(|| {
            self.err(
                None,
                format!("`{what}` is a {}, not a dense tensor", obj.describe()),
            )
        })
    }

    /// The real shape of the tensor `t` of this file.
    pub(super) fn shape(&self, t: &HostTensor) -> Vec<usize> {
        self.headers.shape(t).to_vec()
    }

    /// Where tensor `t` (`what`) of this file, index `file` of the checkpoint's files, lies:
    /// its source and element count. A tensor must be contiguous.
    pub(super) fn src(&self, t: &HostTensor, file: usize, what: &str) -> Result<(Src, usize)> {
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
pub(super) fn get<'a>(obj: &'a PyObj, key: &str) -> Option<&'a PyObj> {
    items(obj)?
        .iter()
        .find(|(k, _)| matches!(k, PyObj::Str(s) if s == key))
        .map(|(_, v)| v)
}

/// `obj[key]` of a dict with int keys.
pub(super) fn get_int(obj: &PyObj, key: i64) -> Option<&PyObj> {
    items(obj)?
        .iter()
        .find(|(k, _)| matches!(k, PyObj::Int(i) if *i == key))
        .map(|(_, v)| v)
}

pub(super) fn items(obj: &PyObj) -> Option<&[(PyObj, PyObj)]> {
    match obj {
        PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => Some(items),
        _ => None,
    }
}

pub(super) fn seq(obj: &PyObj) -> Option<&[PyObj]> {
    match obj {
        PyObj::List(v) | PyObj::Tuple(v) => Some(v),
        _ => None,
    }
}

/// The dense tensor `obj` is (a plain tensor, or one with attributes such as ZeRO-3's
/// `ds_id`).
pub(super) fn tensor(obj: &PyObj) -> Option<&HostTensor> {
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
pub(super) fn shape_of(obj: &PyObj) -> Option<Vec<usize>> {
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

/// A parameter name that can name a directory of a universal checkpoint and a key: a plain
/// name ([`crate::storage::check_name`]).
pub(super) fn check_name(p: &Pickled, name: &str) -> Result<()> {
    match crate::storage::check_name(name, crate::storage::NameForm::Plain) {
        None => Ok(()),
        Some(why) => Err(p.err(
            Some(name),
            format!(
                "a parameter name that cannot name a directory of a universal checkpoint: {why}"
            ),
        )),
    }
}

/// What the model-states file (`mp_rank_00_model_states.pt`, or rank 0's at stage 3) says.
pub(super) struct ModelStates {
    /// Per flat group (ZeRO-1/2) or sub-group (ZeRO-3): names and shapes, in flat order.
    pub(super) param_shapes: Vec<Vec<(String, Vec<usize>)>>,
    /// The frozen parameters (`requires_grad=False`), in the order DeepSpeed saved them.
    pub(super) frozen: Vec<FrozenParam>,
    /// Buffers: name, tensor source, dtype, shape.
    pub(super) buffers: Vec<(Buffer, Src)>,
    /// `shared_params`: alias → primary.
    pub(super) aliases: Vec<(String, String)>,
    pub(super) module_order: Vec<String>,
    pub(super) dtype: DType,
    pub(super) dp_world_size: Option<usize>,
}

impl ModelStates {
    /// Reads the model-states file `p`, index `file` of the checkpoint's files.
    pub(super) fn read(p: &Pickled, file: usize) -> Result<Self> {
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
        let frozen = frozen_params(p, &param_shapes, &buffers, &aliases, &module_order)?;
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
            frozen,
            buffers,
            aliases,
            module_order,
            dtype,
            dp_world_size,
        })
    }

    /// Checks the aliases and the module's keys against the parameters and buffers.
    pub(super) fn check(&self, p: &Pickled) -> Result<()> {
        let params: std::collections::HashSet<&str> = self
            .param_shapes
            .iter()
            .flatten()
            .map(|(n, _)| n.as_str())
            .collect();
        if params.len() != self.param_shapes.iter().map(Vec::len).sum::<usize>() {
            return Err(p.err(None, "`param_shapes` names a parameter twice"));
        }
        if let Some(f) = self
            .frozen
            .iter()
            .find(|f| params.contains(f.name.as_str()))
        {
            return Err(p.err(
                Some(&f.name),
                "both trained (`param_shapes`) and frozen (`frozen_param_shapes`)",
            ));
        }
        let frozen = |n: &str| self.frozen.iter().any(|f| f.name == n);
        for (alias, primary) in &self.aliases {
            if !params.contains(primary.as_str()) && !frozen(primary) {
                return Err(p.err(
                    Some(alias),
                    format!(
                        "`shared_params` ties it to `{primary}`, which is no trained or frozen parameter"
                    ),
                ));
            }
        }
        for name in &self.module_order {
            let known = params.contains(name.as_str())
                || frozen(name)
                || self.buffers.iter().any(|(b, _)| &b.name == name)
                || self.aliases.iter().any(|(a, _)| a == name);
            if !known {
                return Err(p.err(
                    Some(name),
                    "a `module` entry that is no trained or frozen parameter, buffer or tied alias",
                ));
            }
        }
        Ok(())
    }
}

/// The frozen parameters of the model-states file `p`: `frozen_param_shapes` (saved from
/// stage 2 on), or, where it is None (stage 1 saves no frozen fragments), the `module`
/// entries that are no trained parameter, buffer or tied alias (`module` is the whole
/// `state_dict()` at stages 1 and 2). Each one's dtype is its saved weight's
/// ([`frozen_weight`]).
fn frozen_params(
    p: &Pickled,
    param_shapes: &[Vec<(String, Vec<usize>)>],
    buffers: &[(Buffer, Src)],
    aliases: &[(String, String)],
    module_order: &[String],
) -> Result<Vec<FrozenParam>> {
    let root = p.root();
    let mut named: Vec<(String, Option<Vec<usize>>)> = Vec::new();
    match get(root, "frozen_param_shapes") {
        None | Some(PyObj::None) => {
            let other = |n: &String| {
                !param_shapes.iter().flatten().any(|(p, _)| p == n)
                    && !buffers.iter().any(|(b, _)| &b.name == n)
                    && !aliases.iter().any(|(a, _)| a == n)
            };
            named.extend(
                module_order
                    .iter()
                    .filter(|n| other(n))
                    .map(|n| (n.clone(), None)),
            );
        }
        Some(shapes) => {
            let entries = items(shapes)
                .ok_or_else(|| p.err(None, "`frozen_param_shapes` is not a dict of shapes"))?;
            for (k, v) in entries {
                let PyObj::Str(name) = k else {
                    return Err(p.err(None, "`frozen_param_shapes` has a key that is not a name"));
                };
                check_name(p, name)?;
                let shape = shape_of(v).ok_or_else(|| {
                    p.err(
                        Some(name),
                        "its shape in `frozen_param_shapes` is not a shape",
                    )
                })?;
                named.push((name.clone(), Some(shape)));
            }
        }
    }
    let mut out: Vec<FrozenParam> = Vec::new();
    for (name, shape) in named {
        if out.iter().any(|f| f.name == name) {
            return Err(p.err(Some(&name), "`frozen_param_shapes` names it twice"));
        }
        let (t, _) = frozen_weight(p, &name)?;
        out.push(FrozenParam {
            shape: shape.unwrap_or_else(|| p.shape(t)),
            dtype: t.dtype(),
            name,
        });
    }
    Ok(out)
}

/// Frozen parameter `name`'s saved weight in the model-states file `p`, and what it is
/// called there: `frozen_param_fragments[name]` where saved (the whole weight at stage 2,
/// this rank's partition at stage 3), else `module[name]` (stage 1).
fn frozen_weight<'p>(p: &'p Pickled, name: &str) -> Result<(&'p HostTensor, String)> {
    let root = p.root();
    let (obj, what) = match get(root, "frozen_param_fragments") {
        Some(fragments) if items(fragments).is_some() => (
            get(fragments, name),
            format!("frozen_param_fragments['{name}']"),
        ),
        _ => (
            p.at(root, "module", "module")
                .ok()
                .and_then(|m| get(m, name)),
            format!("module['{name}']"),
        ),
    };
    let obj = obj.ok_or_else(|| {
        p.err(
            Some(name),
            format!("a frozen parameter without its weight (no `{what}`)"),
        )
    })?;
    Ok((p.tensor(obj, &what)?, what))
}

/// The runs that make each frozen parameter's elements, their sources pushed on `srcs`:
/// from `files` (each a model-states file and its index in the checkpoint's files), one
/// file holding every weight whole (stages 1 and 2), or every rank's file in rank order, rank
/// `r` holding elements `[r·c, (r+1)·c)` of the flattened weight, `c = ceil(numel / ranks)`,
/// as a partition of `c` elements padded at the end (stage 3's `ds_tensor`). Each saved
/// tensor must have the parameter's dtype and that many elements.
pub(super) fn frozen_spans(
    files: &[(&Pickled, usize)],
    frozen: &[FrozenParam],
    srcs: &mut Vec<Src>,
) -> Result<Vec<Vec<Span>>> {
    let ranks = files.len().max(1);
    let mut out = Vec::new();
    for f in frozen {
        let n = numel(&f.shape);
        let c = n.div_ceil(ranks);
        let mut spans = Vec::new();
        for (r, (p, file)) in files.iter().enumerate() {
            let (t, what) = frozen_weight(p, &f.name)?;
            if t.dtype() != f.dtype {
                return Err(p.err(
                    Some(&f.name),
                    format!("`{what}` is {}, but rank 0's is {}", t.dtype(), f.dtype),
                ));
            }
            let (src, got) = p.src(t, *file, &what)?;
            if got != c {
                let whole = if ranks == 1 {
                    format!("its shape {:?}", f.shape)
                } else {
                    format!("ceil({n} / {ranks} ranks)")
                };
                return Err(p.err(
                    Some(&f.name),
                    format!("`{what}` holds {got} elements, but {whole} gives {c}"),
                ));
            }
            spans.push(Span {
                src: srcs.len(),
                start: 0,
                len: c.min(n.saturating_sub(r * c)),
            });
            srcs.push(src);
        }
        out.push(spans);
    }
    Ok(out)
}

/// The model dtype `ds_config` names (`bf16.enabled`, `fp16.enabled`), float32 otherwise.
pub(super) fn config_dtype(root: &PyObj) -> DType {
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
pub(super) type Hyper = Vec<(String, PyObj)>;

/// A param group's hyper-parameters (its dict without `params`) and the indices `params`
/// lists.
pub(super) fn hyperparameters(p: &Pickled, group: &PyObj, g: usize) -> Result<(Hyper, Vec<usize>)> {
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
pub(super) struct Parts {
    pub(super) dir: PathBuf,
    pub(super) form: Form,
    pub(super) stage: u8,
    pub(super) wrapper: Wrapper,
    pub(super) world_size: usize,
    pub(super) tag: String,
    pub(super) model: ModelStates,
    /// Per sub-group: the param group it belongs to.
    pub(super) group_of: Vec<usize>,
    /// Per param group: hyper-parameters.
    pub(super) hyper: Vec<Hyper>,
    /// Per parameter in `param_shapes` order: its step and state spans.
    pub(super) steps: Vec<HostTensor>,
    pub(super) spans: Vec<[Vec<Span>; 3]>,
    pub(super) files: Vec<PathBuf>,
    pub(super) srcs: Vec<Src>,
    /// Per frozen parameter (`model.frozen`), its runs.
    pub(super) frozen_spans: Vec<Vec<Span>>,
    /// Index of the model-states file in `files`.
    pub(super) model_file: usize,
}

impl Parts {
    pub(super) fn assemble(self) -> DeepSpeedCheckpoint {
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
        let frozen_spans = self.frozen_spans.iter().flatten();
        for span in self
            .spans
            .iter()
            .flatten()
            .flatten()
            .chain(&buffer_spans)
            .chain(frozen_spans)
        {
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
            frozen: self.model.frozen,
            groups,
            buffers,
            aliases: self.model.aliases,
            module_order: self.model.module_order,
            steps: self.steps,
            files: self.files,
            srcs,
            spans: self.spans,
            buffer_spans,
            frozen_spans: self.frozen_spans,
        }
    }
}

/// Maps each sub-group to its param group from the groups' `params` lists, which must list
/// every sub-group exactly once.
pub(super) fn group_of_subgroups(
    p: &Pickled,
    ids: &[Vec<usize>],
    subgroups: usize,
) -> Result<Vec<usize>> {
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
