//! A universal checkpoint's tag directory (`ds_to_universal`'s output): one file per
//! parameter and state (`zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`; `{'cat_dim': 0,
//! 'param': tensor}` from stages 1 and 2, a bare flat tensor from stage 3), the param groups
//! in `zero/optimizer_state.pt`, and a copy of the model-states file naming the parameters,
//! buffers and tied aliases.

use super::pickled::{frozen_spans, get, get_int, tensor, ModelStates, Parts, Pickled};
use super::read::{other_rank_model_states, param_groups};
use super::{numel, DeepSpeedCheckpoint, Form, Span, Src, State, Wrapper};
use crate::error::{Error, Result};
use crate::io::torch_save::{Allow, PyObj};
use crate::tensor::{DType, HostTensor};
use std::path::{Path, PathBuf};

/// The model-states copies a universal checkpoint holds: stages 1 and 2 copy
/// `mp_rank_00_model_states.pt`, stage 3 every rank's (rank 0's names the tied aliases).
/// The first entry of any kind is read (reading says what is wrong with one that is not a
/// regular file).
const MODEL_FILES: [&str; 2] = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_model_states.pt",
];

/// Reads the universal checkpoint in the tag directory `dir`.
pub(super) fn open(dir: &Path, tag: String) -> Result<DeepSpeedCheckpoint> {
    let zero = dir.join("zero");
    let op = Pickled::load(&zero.join("optimizer_state.pt"), None, Allow::DeepSpeed)?;
    let root = op.root();
    let (stage, wrapper) = stage_of(&op)?;
    let model_path = model_states_file(dir)?;
    let mut files = vec![model_path.clone()];
    let mp = Pickled::load(&model_path, None, Allow::DeepSpeed)?;
    let model = ModelStates::read(&mp, 0)?;
    model.check(&mp)?;
    let world_size = world_size_of(&op, &model)?;
    let subgroups = model.param_shapes.len();
    let (group_of, hyper) =
        param_groups(&op, op.at(root, "param_groups", "param_groups")?, subgroups)?;
    let mut srcs = Vec::new();
    let (spans, steps) = param_files(&op, &model, stage, &zero, (&mut files, &mut srcs))?;
    let ranks_model = if stage == 3 && !model.frozen.is_empty() {
        other_rank_model_states(dir, world_size, &mut files)?
    } else {
        Vec::new()
    };
    let mut frozen_files = vec![(&mp, 0)];
    frozen_files.extend(ranks_model.iter().map(|(p, f)| (p, *f)));
    let frozen_spans = frozen_spans(&frozen_files, &model.frozen, &mut srcs)?;
    Ok(Parts {
        dir: dir.to_path_buf(),
        form: Form::Universal,
        stage,
        wrapper,
        world_size,
        tag,
        model,
        group_of,
        hyper,
        steps,
        spans,
        files,
        srcs,
        frozen_spans,
        model_file: 0,
    }
    .assemble())
}

/// The ZeRO stage and optimizer wrapper `zero/optimizer_state.pt` names (no `zero_stage`:
/// `BF16_Optimizer`, stage 1).
fn stage_of(op: &Pickled) -> Result<(u8, Wrapper)> {
    Ok(match get(op.root(), "zero_stage") {
        None => (1, Wrapper::Bf16Optimizer),
        Some(PyObj::Int(n @ (1 | 2))) => (*n as u8, Wrapper::DeepSpeedZeroOptimizer),
        Some(PyObj::Int(3)) => (3, Wrapper::DeepSpeedZeroOptimizerStage3),
        Some(other) => {
            return Err(op.err(
                None,
                format!(
                    "`zero_stage` is {}, not a ZeRO stage 1 to 3",
                    other.describe()
                ),
            ))
        }
    })
}

/// The model-states copy beside `zero/` (the first of [`MODEL_FILES`] present).
fn model_states_file(dir: &Path) -> Result<PathBuf> {
    MODEL_FILES
        .iter()
        .map(|f| dir.join(f))
        .find(|p| std::fs::symlink_metadata(p).is_ok())
        .ok_or_else(|| Error::DeepSpeedRankFiles {
            dir: dir.display().to_string(),
            expected: None,
            found: Vec::new(),
            reason: format!(
                "no model states file (`{}` or `{}`) beside `zero/`: its param_shapes name the parameters",
                MODEL_FILES[0], MODEL_FILES[1]
            ),
        })
}

/// The data-parallel world size: the model states' `dp_world_size`, else the optimizer
/// state's `partition_count` (the largest, for a list).
fn world_size_of(op: &Pickled, model: &ModelStates) -> Result<usize> {
    Ok(
        match (model.dp_world_size, get(op.root(), "partition_count")) {
            (Some(n), _) => n,
            (None, Some(PyObj::Int(n))) if *n > 0 => *n as usize,
            (None, Some(PyObj::List(counts))) => counts
                .iter()
                .filter_map(|c| match c {
                    PyObj::Int(n) if *n > 0 => Some(*n as usize),
                    _ => None,
                })
                .max()
                .unwrap_or(1),
            _ => {
                return Err(op.err(
                    None,
                    "no world size (`dp_world_size` of the model states, `partition_count`)",
                ))
            }
        },
    )
}

/// Per trained parameter, in `param_shapes` order: its state spans and its `step`.
type ParamStates = (Vec<[Vec<Span>; 3]>, Vec<HostTensor>);

/// Each trained parameter's state files `zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`, checked
/// against `param_shapes` (each file added to `files`, its tensor to `srcs`), and its `step`
/// (stage 3: from the optimizer state; else `zero/<name>/step.pt`).
fn param_files(
    op: &Pickled,
    model: &ModelStates,
    stage: u8,
    zero: &Path,
    (files, srcs): (&mut Vec<PathBuf>, &mut Vec<Src>),
) -> Result<ParamStates> {
    let stage3_state = if stage == 3 {
        let inner = op.at(op.root(), "optimizer_state_dict", "optimizer_state_dict")?;
        Some(op.at(inner, "state", "optimizer_state_dict['state']")?)
    } else {
        None
    };
    let mut spans = Vec::new();
    let mut steps = Vec::new();
    for (s, names) in model.param_shapes.iter().enumerate() {
        for (name, shape) in names {
            let n = numel(shape);
            let mut per_state: [Vec<Span>; 3] = Default::default();
            for st in State::ALL {
                let path = zero.join(name).join(format!("{}.pt", st.name()));
                let file = files.len();
                let p = Pickled::load(&path, None, Allow::TorchLoad)?;
                let t = param_tensor(&p, name)?;
                let got = p.shape(t);
                if t.dtype() != DType::F32 {
                    return Err(p.err(Some(name), format!("{} tensor, not float32", t.dtype())));
                }
                if got != *shape && got != [n] {
                    return Err(p.err(
                        Some(name),
                        format!("a tensor of shape {got:?}, but `param_shapes` gives {shape:?}"),
                    ));
                }
                let (src, _) = p.src(t, file, st.name())?;
                files.push(path);
                per_state[st.index()] = vec![Span {
                    src: srcs.len(),
                    start: 0,
                    len: n,
                }];
                srcs.push(src);
            }
            spans.push(per_state);
            steps.push(match stage3_state {
                Some(state) => {
                    let s_state = get_int(state, s as i64).ok_or_else(|| {
                        op.err(None, format!("no optimizer state for sub-group {s}"))
                    })?;
                    step_tensor(
                        op,
                        op.at(s_state, "step", &format!("state[{s}]['step']"))?,
                        name,
                    )?
                }
                None => {
                    let p =
                        Pickled::load(&zero.join(name).join("step.pt"), None, Allow::TorchLoad)?;
                    step_tensor(&p, p.root(), name)?
                }
            });
        }
    }
    Ok((spans, steps))
}

/// The tensor of a per-parameter file: `{'cat_dim': 0, 'param': t}` (stages 1 and 2) or a
/// bare tensor (stage 3).
fn param_tensor<'p>(p: &'p Pickled, name: &str) -> Result<&'p HostTensor> {
    let obj = p.root();
    let t = match get(obj, "param") {
        Some(t) => t,
        None => obj,
    };
    tensor(t).ok_or_else(|| {
        p.err(
            Some(name),
            format!(
                "holds a {}, not a tensor or {{'param': tensor}}",
                t.describe()
            ),
        )
    })
}

/// A `step`: one number, read with the pickle.
fn step_tensor(p: &Pickled, obj: &PyObj, name: &str) -> Result<HostTensor> {
    match tensor(obj) {
        Some(t) if t.numel() == 1 && p.headers.view(t).is_none() => Ok(t.clone()),
        _ => Err(p.err(
            Some(name),
            format!("its step is a {}, not one number", obj.describe()),
        )),
    }
}
