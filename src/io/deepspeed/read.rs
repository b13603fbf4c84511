//! A ZeRO checkpoint's tag directory (`engine.save_checkpoint`): its rank files found and
//! checked (one per rank, as many as `partition_count`), each rank's flat partitions
//! located in its file, and every parameter's pieces taken from the ZeRO layout and checked
//! against what each rank holds (`group_paddings`, `param_slice_mappings`, lengths).

use super::layout::{FlatGroup, PartitionedGroup, Piece};
use super::pickled::{
    check_name, frozen_spans, get, get_int, group_of_subgroups, hyperparameters, items, Hyper,
    ModelStates, Parts, Pickled,
};
use super::{numel, optim_file_rank, DeepSpeedCheckpoint, Form, Span, Src, State, Wrapper};
use crate::error::{Error, Result};
use crate::io::torch_save::{Allow, PyObj};
use crate::tensor::{DType, HostTensor};
use std::path::{Path, PathBuf};

/// Which param group each flat group (sub-group) belongs to, and each param group's
/// hyper-parameters.
pub(super) type Groups = (Vec<usize>, Vec<Hyper>);

/// Reads the ZeRO checkpoint in the tag directory `dir`.
pub(super) fn open(dir: &Path, tag: String) -> Result<DeepSpeedCheckpoint> {
    let ranks = rank_files(dir)?;
    let ws = ranks.len();
    let optim: Vec<Pickled> = ranks
        .iter()
        .enumerate()
        .map(|(r, f)| Pickled::load(f, Some(r), Allow::DeepSpeed))
        .collect::<Result<_>>()?;
    let states: Vec<&PyObj> = optim
        .iter()
        .map(|p| p.at(p.root(), "optimizer_state_dict", "optimizer_state_dict"))
        .collect::<Result<_>>()?;
    let (stage, wrapper) = stage_of(&optim[0], states[0])?;
    for (p, s) in optim.iter().zip(&states).skip(1) {
        if stage_of(p, s)? != (stage, wrapper) {
            return Err(p.err(
                None,
                format!("saved by another ZeRO stage than rank 0's ({stage})"),
            ));
        }
    }
    let model_name = if stage == 3 {
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    } else {
        "mp_rank_00_model_states.pt"
    };
    let model_path = dir.join(model_name);
    // Any entry: reading it says what is wrong with one that is not a regular file.
    if std::fs::symlink_metadata(&model_path).is_err() {
        return Err(Error::DeepSpeedRankFiles {
            dir: dir.display().to_string(),
            expected: Some(ws),
            found: (0..ws).collect(),
            reason: format!(
                "no model states file `{model_name}` (its param_shapes name the parameters)"
            ),
        });
    }
    let mut files = ranks;
    let model_file = files.len();
    files.push(model_path.clone());
    let mp = Pickled::load(&model_path, None, Allow::DeepSpeed)?;
    let model = ModelStates::read(&mp, model_file)?;
    model.check(&mp)?;
    if let Some(dp) = model.dp_world_size {
        if dp != ws {
            return Err(Error::DeepSpeedRankFiles {
                dir: dir.display().to_string(),
                expected: Some(dp),
                found: (0..ws).collect(),
                reason: format!(
                    "{ws} optimizer rank files, but `{model_name}` says the data-parallel world size was {dp}"
                ),
            });
        }
    }
    let mut b = Builder {
        optim: &optim,
        states: &states,
        ws,
        srcs: Vec::new(),
        spans: Vec::new(),
        steps: Vec::new(),
    };
    let (group_of, hyper) = if stage == 3 {
        b.zero3(dir, &model)?
    } else {
        b.zero12(dir, &model, wrapper)?
    };
    let Builder {
        mut srcs,
        spans,
        steps,
        ..
    } = b;
    let ranks_model = if stage == 3 && !model.frozen.is_empty() {
        other_rank_model_states(dir, ws, &mut files)?
    } else {
        Vec::new()
    };
    let mut frozen_files = vec![(&mp, model_file)];
    frozen_files.extend(ranks_model.iter().map(|(p, f)| (p, *f)));
    let frozen_spans = frozen_spans(&frozen_files, &model.frozen, &mut srcs)?;
    Ok(Parts {
        dir: dir.to_path_buf(),
        form: Form::Zero,
        stage,
        wrapper,
        world_size: ws,
        tag,
        model,
        group_of,
        hyper,
        steps,
        spans,
        files,
        srcs,
        frozen_spans,
        model_file,
    }
    .assemble())
}

/// The model-states files of ranks 1 to `ws - 1` at stage 3
/// (`zero_pp_rank_{r}_mp_rank_00_model_states.pt`), which hold those ranks' partitions of the
/// frozen parameters: read, and added to `files`. Each with its index in `files`.
pub(super) fn other_rank_model_states(
    dir: &Path,
    ws: usize,
    files: &mut Vec<PathBuf>,
) -> Result<Vec<(Pickled, usize)>> {
    let mut out = Vec::new();
    for r in 1..ws {
        let path = dir.join(format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt"));
        if !path.is_file() {
            return Err(Error::DeepSpeedRankFiles {
                dir: dir.display().to_string(),
                expected: Some(ws),
                found: (0..r).collect(),
                reason: format!(
                    "no model states file of rank {r} (`{}`), which holds its partition of the frozen parameters",
                    path.file_name().unwrap_or_default().to_string_lossy()
                ),
            });
        }
        out.push((
            Pickled::load(&path, Some(r), Allow::DeepSpeed)?,
            files.len(),
        ));
        files.push(path);
    }
    Ok(out)
}

/// The ZeRO stage and wrapper of an optimizer state `s`: `zero_stage` 1 or 2
/// (`DeepSpeedZeroOptimizer`), 3 (`DeepSpeedZeroOptimizer_Stage3`), or none
/// (`BF16_Optimizer`, stage 1).
fn stage_of(p: &Pickled, s: &PyObj) -> Result<(u8, Wrapper)> {
    match get(s, "zero_stage") {
        None => Ok((1, Wrapper::Bf16Optimizer)),
        Some(PyObj::Int(n @ (1 | 2))) => Ok((*n as u8, Wrapper::DeepSpeedZeroOptimizer)),
        Some(PyObj::Int(3)) => Ok((3, Wrapper::DeepSpeedZeroOptimizerStage3)),
        Some(other) => Err(p.err(
            None,
            format!(
                "`zero_stage` is {}, not a ZeRO stage 1 to 3",
                other.describe()
            ),
        )),
    }
}

/// The optimizer rank files of `dir`, in rank order: `{bf16_}zero_pp_rank_{r}_mp_rank_00_optim_states.pt`
/// for every rank from 0, one prefix for all.
fn rank_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let refuse = |found: Vec<usize>, reason: String| Error::DeepSpeedRankFiles {
        dir: dir.display().to_string(),
        expected: None,
        found,
        reason,
    };
    let mut ranks: Vec<(usize, bool, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir).map_err(Error::io("listing", dir))? {
        let e = e.map_err(Error::io("listing", dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with("_optim_states.pt") {
            continue;
        }
        match optim_file_rank(&name) {
            Some((bf16, r, 0)) => ranks.push((r, bf16, e.path())),
            Some((_, _, mp)) => {
                return Err(Error::Unsupported(format!(
                    "`{}`: model-parallel rank {mp}; tensor-parallel DeepSpeed checkpoints are not read",
                    e.path().display()
                )))
            }
            None => {
                return Err(Error::Unsupported(format!(
                    "`{}`: not a ZeRO data-parallel rank file (pipeline- and expert-parallel checkpoints are not read)",
                    e.path().display()
                )))
            }
        }
    }
    ranks.sort_by_key(|(r, _, _)| *r);
    let found: Vec<usize> = ranks.iter().map(|(r, _, _)| *r).collect();
    if ranks.is_empty() {
        return Err(refuse(found, "no `*_optim_states.pt` rank files".into()));
    }
    if ranks.iter().any(|(_, bf16, _)| *bf16 != ranks[0].1) {
        return Err(refuse(
            found,
            "rank files with and without the `bf16_` prefix: two checkpoints in one directory"
                .into(),
        ));
    }
    for (i, (r, _, path)) in ranks.iter().enumerate() {
        if *r != i {
            let reason = if *r < i {
                format!("two rank files for rank {r} (`{}`)", path.display())
            } else {
                format!("the rank file of rank {i} is missing")
            };
            return Err(refuse(found, reason));
        }
    }
    Ok(ranks.into_iter().map(|(_, _, p)| p).collect())
}

/// What is read from the ranks' optimizer files.
struct Builder<'a> {
    optim: &'a [Pickled],
    /// Each rank's `optimizer_state_dict`.
    states: &'a [&'a PyObj],
    ws: usize,
    srcs: Vec<Src>,
    spans: Vec<[Vec<Span>; 3]>,
    steps: Vec<HostTensor>,
}

/// A rank's flat float32 tensor and what the layout says of it.
struct Flat<'t> {
    /// `single_partition_of_fp32_groups[0]`, `state[1]['exp_avg']`, …
    what: String,
    tensor: &'t HostTensor,
    /// The length DeepSpeed saves.
    expected: usize,
    /// The elements the parameters' pieces need.
    needed: usize,
}

/// Every flat group of ZeRO-1/2 was partitioned over the ranks whose files are here
/// (`partition_count`).
fn check_partition_counts(p0: &Pickled, s0: &PyObj, ws: usize, dir: &Path) -> Result<()> {
    let counts = p0.seq(
        p0.at(s0, "partition_count", "partition_count")?,
        "partition_count",
    )?;
    for (g, c) in counts.iter().enumerate() {
        let c = p0.int(c, "partition_count")?;
        if c != ws {
            return Err(Error::DeepSpeedRankFiles {
                dir: dir.display().to_string(),
                expected: Some(c),
                found: (0..ws).collect(),
                reason: format!(
                    "{ws} optimizer rank files, but flat group {g} was partitioned over {c} ranks (`partition_count`)"
                ),
            });
        }
    }
    Ok(())
}

/// Each rank's `base_optimizer_state` (a dict; the list of an elastic checkpoint is refused).
fn base_optimizer_states<'a>(optim: &'a [Pickled], states: &[&'a PyObj]) -> Result<Vec<&'a PyObj>> {
    let mut bases = Vec::new();
    for (p, s) in optim.iter().zip(states) {
        let base = p.at(s, "base_optimizer_state", "base_optimizer_state")?;
        if items(base).is_none() {
            return Err(Error::Unsupported(format!(
                "`{}`: `base_optimizer_state` is a {} (an elastic checkpoint, `zero_optimization.elastic_checkpoint`), which is not read",
                p.path.display(),
                base.describe()
            )));
        }
        bases.push(base);
    }
    Ok(bases)
}

/// `param_alignment_paddings` per flat group (none when absent).
fn alignment_paddings(p0: &Pickled, s0: &PyObj, groups: usize) -> Result<Vec<Vec<usize>>> {
    Ok(match get(s0, "param_alignment_paddings") {
        None | Some(PyObj::None) => vec![Vec::new(); groups],
        Some(list) => p0
            .seq(list, "param_alignment_paddings")?
            .iter()
            .map(|g| {
                p0.seq(g, "param_alignment_paddings")?
                    .iter()
                    .map(|x| p0.int(x, "param_alignment_paddings"))
                    .collect()
            })
            .collect::<Result<_>>()?,
    })
}

impl Builder<'_> {
    /// Locates rank `r`'s flat tensor `f`, checked: float32, at least `needed` elements
    /// (else [`Error::DeepSpeedTruncated`] naming the first parameter that does not fit), and
    /// exactly `expected`. Returns its source index.
    fn flat(
        &mut self,
        r: usize,
        f: Flat<'_>,
        first_short: impl Fn(usize) -> Option<String>,
    ) -> Result<usize> {
        let optim = self.optim;
        let p = &optim[r];
        if f.tensor.dtype() != DType::F32 {
            return Err(p.err(
                None,
                format!("`{}` is {}, not float32", f.what, f.tensor.dtype()),
            ));
        }
        let (src, n) = p.src(f.tensor, r, &f.what)?;
        if n < f.needed {
            return Err(Error::DeepSpeedTruncated {
                file: p.path.display().to_string(),
                rank: r,
                tensor: f.what,
                param: first_short(n),
                needed: f.needed,
                found: n,
            });
        }
        if n != f.expected {
            return Err(p.err(
                None,
                format!(
                    "`{}` holds {n} elements, but the ZeRO layout of the parameters gives {}",
                    f.what, f.expected
                ),
            ));
        }
        self.srcs.push(src);
        Ok(self.srcs.len() - 1)
    }

    /// Rank `r`'s Adam state of flat group `g`: (`exp_avg`, `exp_avg_sq`, `step`) from
    /// `state` (the inner optimizer's `state_dict()['state']`).
    fn adam<'s>(
        &self,
        r: usize,
        state: &'s PyObj,
        g: usize,
    ) -> Result<(&'s HostTensor, &'s HostTensor, HostTensor)> {
        let p = &self.optim[r];
        let s = get_int(state, g as i64)
            .ok_or_else(|| p.err(None, format!("no optimizer state for flat group {g}")))?;
        let t = |name: &str| -> Result<&'s HostTensor> {
            let v = get(s, name).ok_or_else(|| {
                Error::Unsupported(format!(
                    "`{}`: the optimizer state of flat group {g} has no `{name}`: only Adam's states (exp_avg, exp_avg_sq, step) are read",
                    p.path.display()
                ))
            })?;
            p.tensor(v, &format!("state[{g}]['{name}']"))
        };
        let step = t("step")?;
        if p.headers.view(step).is_some() || step.numel() != 1 {
            return Err(p.err(None, format!("`state[{g}]['step']` is not one number")));
        }
        Ok((t("exp_avg")?, t("exp_avg_sq")?, step.clone()))
    }

    /// The step of flat group `g` from every rank: equal on all of them.
    fn agreed_step(&self, steps: &[HostTensor], g: usize) -> Result<HostTensor> {
        for (r, s) in steps.iter().enumerate().skip(1) {
            if s.as_bytes() != steps[0].as_bytes() || s.dtype() != steps[0].dtype() {
                return Err(self.optim[r].err(
                    None,
                    format!(
                        "the step of flat group {g} is {:?}, rank 0's {:?}",
                        s.item(),
                        steps[0].item()
                    ),
                ));
            }
        }
        Ok(steps[0].clone())
    }

    /// ZeRO-1/2 (and `BF16_Optimizer`): each param group one flat group, cut into `ws`
    /// partitions. Returns each flat group's param group and the groups' hyper-parameters.
    fn zero12(&mut self, dir: &Path, model: &ModelStates, wrapper: Wrapper) -> Result<Groups> {
        let groups = model.param_shapes.len();
        let (optim, states) = (self.optim, self.states);
        let (p0, s0) = (&optim[0], states[0]);
        check_partition_counts(p0, s0, self.ws, dir)?;
        let bases = base_optimizer_states(optim, states)?;
        let (group_of, hyper) = param_groups(
            p0,
            p0.at(
                bases[0],
                "param_groups",
                "base_optimizer_state['param_groups']",
            )?,
            groups,
        )?;
        let paddings = alignment_paddings(p0, s0, groups)?;
        let lists = |name: &str| -> Result<Vec<&[PyObj]>> {
            optim
                .iter()
                .zip(states)
                .map(|(p, s)| {
                    let l = p.seq(p.at(s, name, name)?, name)?;
                    if l.len() != groups {
                        return Err(p.err(
                            None,
                            format!(
                                "`{name}` has {} entries, `param_shapes` {groups} flat groups",
                                l.len()
                            ),
                        ));
                    }
                    Ok(l)
                })
                .collect()
        };
        let fp32s = lists("single_partition_of_fp32_groups")?;
        if paddings.len() != groups {
            return Err(p0.err(None, format!("`param_alignment_paddings` has {} entries, `param_shapes` {groups} flat groups", paddings.len())));
        }
        for (g, names) in model.param_shapes.iter().enumerate() {
            self.zero12_group((g, names), &paddings[g], (&fp32s, &bases), wrapper)?;
        }
        Ok((group_of, hyper))
    }

    /// Flat group `g` (its parameters `names`, their alignment `paddings`) of ZeRO-1/2: each
    /// rank's fp32 partition (`fp32s[r][g]`) and Adam states (`bases[r]`), checked against
    /// the ZeRO layout, then each parameter's pieces and the group's agreed `step`.
    fn zero12_group(
        &mut self,
        (g, names): (usize, &[(String, Vec<usize>)]),
        paddings: &[usize],
        (fp32s, bases): (&[&[PyObj]], &[&PyObj]),
        wrapper: Wrapper,
    ) -> Result<()> {
        let (optim, states) = (self.optim, self.states);
        let p0 = &optim[0];
        let numels: Vec<usize> = names.iter().map(|(_, s)| numel(s)).collect();
        let layout = FlatGroup::new(&numels, paddings, self.ws).ok_or_else(|| {
            p0.err(None, format!("flat group {g} has no ZeRO layout (sizes that overflow, or {} alignment paddings for {} parameters)", paddings.len(), numels.len()))
        })?;
        let pieces: Vec<Vec<Piece>> = (0..names.len()).map(|i| layout.pieces(i)).collect();
        let first_short = |r: usize, n: usize| first_short_param(names, &pieces, r, n);
        let mut src = vec![[0usize; 3]; self.ws];
        let mut steps = Vec::new();
        for r in 0..self.ws {
            let p = &optim[r];
            let fp32 = p.tensor(
                &fp32s[r][g],
                &format!("single_partition_of_fp32_groups[{g}]"),
            )?;
            if let Some(pads) = get(states[r], "group_paddings") {
                let pads = p.seq(pads, "group_paddings")?;
                let got = pads
                    .get(g)
                    .map(|x| p.int(x, "group_paddings"))
                    .transpose()?;
                if got != Some(layout.group_padding(r)) {
                    return Err(p.err(None, format!(
                        "`group_paddings[{g}]` is {got:?}, but the ZeRO layout gives {} (flat group of {} elements over {} ranks)",
                        layout.group_padding(r), layout.padded_numel(), self.ws
                    )));
                }
            }
            let expected = match wrapper {
                Wrapper::Bf16Optimizer => layout.partition_numel(),
                _ => layout.cut_partition_numel(r),
            };
            let fp32 = Flat {
                what: format!("single_partition_of_fp32_groups[{g}]"),
                tensor: fp32,
                expected,
                needed: layout.needed(r),
            };
            let state = p.at(bases[r], "state", "base_optimizer_state['state']")?;
            let (flats, step) =
                self.rank_flats(r, g, fp32, state, layout.partition_numel(), |n| {
                    first_short(r, n)
                })?;
            src[r] = flats;
            steps.push(step);
            check_slice_mappings(p, states[r], g, r, &layout, names)?;
        }
        let step = self.agreed_step(&steps, g)?;
        for param_pieces in &pieces {
            self.push_param(param_pieces, &src);
            self.steps.push(step.clone());
        }
        Ok(())
    }

    /// ZeRO-3: each sub-group's parameters partitioned one by one.
    fn zero3(&mut self, dir: &Path, model: &ModelStates) -> Result<Groups> {
        let subgroups = model.param_shapes.len();
        let (optim, states) = (self.optim, self.states);
        let (p0, s0) = (&optim[0], states[0]);
        let count = p0.int(
            p0.at(s0, "partition_count", "partition_count")?,
            "partition_count",
        )?;
        if count != self.ws {
            return Err(Error::DeepSpeedRankFiles {
                dir: dir.display().to_string(),
                expected: Some(count),
                found: (0..self.ws).collect(),
                reason: format!(
                    "{} optimizer rank files, but the parameters were partitioned over {count} ranks (`partition_count`)",
                    self.ws
                ),
            });
        }
        let inner: Vec<&PyObj> = self
            .optim
            .iter()
            .zip(states)
            .map(|(p, s)| {
                p.at(
                    s,
                    "optimizer_state_dict",
                    "optimizer_state_dict['optimizer_state_dict']",
                )
            })
            .collect::<Result<_>>()?;
        let (group_of, hyper) = param_groups(
            p0,
            p0.at(
                inner[0],
                "param_groups",
                "optimizer_state_dict['param_groups']",
            )?,
            subgroups,
        )?;
        let flats: Vec<&[PyObj]> = self
            .optim
            .iter()
            .zip(states)
            .map(|(p, s)| {
                let l = p.seq(p.at(s, "fp32_flat_groups", "fp32_flat_groups")?, "fp32_flat_groups")?;
                if l.len() != subgroups {
                    return Err(p.err(None, format!("`fp32_flat_groups` has {} entries, `param_shapes` {subgroups} sub-groups", l.len())));
                }
                Ok(l)
            })
            .collect::<Result<_>>()?;
        for (s, names) in model.param_shapes.iter().enumerate() {
            let numels: Vec<usize> = names.iter().map(|(_, sh)| numel(sh)).collect();
            let layout = PartitionedGroup::new(&numels, self.ws)
                .ok_or_else(|| p0.err(None, format!("sub-group {s} has sizes that overflow")))?;
            let pieces: Vec<Vec<Piece>> = (0..names.len()).map(|i| layout.pieces(i)).collect();
            let first_short = |r: usize, n: usize| first_short_param(names, &pieces, r, n);
            let mut src = vec![[0usize; 3]; self.ws];
            let mut steps = Vec::new();
            for r in 0..self.ws {
                let p = &optim[r];
                let needed = layout.needed(r);
                let expected = layout.partition_numel();
                let fp32 = Flat {
                    what: format!("fp32_flat_groups[{s}]"),
                    tensor: p.tensor(&flats[r][s], &format!("fp32_flat_groups[{s}]"))?,
                    expected,
                    needed,
                };
                let state = p.at(inner[r], "state", "optimizer_state_dict['state']")?;
                let (rank_flats, step) =
                    self.rank_flats(r, s, fp32, state, expected, |n| first_short(r, n))?;
                src[r] = rank_flats;
                steps.push(step);
            }
            let step = self.agreed_step(&steps, s)?;
            for param_pieces in &pieces {
                self.push_param(param_pieces, &src);
                self.steps.push(step.clone());
            }
        }
        Ok((group_of, hyper))
    }

    /// Locates rank `r`'s three flat tensors of flat group (or sub-group) `g`, each checked
    /// by [`Builder::flat`]: the fp32 master `fp32`, and Adam's `exp_avg` and `exp_avg_sq`
    /// in `state` (`state_numel` long, needing what `fp32` needs). Returns their sources by
    /// [`State`] and the group's `step`.
    fn rank_flats(
        &mut self,
        r: usize,
        g: usize,
        fp32: Flat<'_>,
        state: &PyObj,
        state_numel: usize,
        first_short: impl Fn(usize) -> Option<String>,
    ) -> Result<([usize; 3], HostTensor)> {
        let needed = fp32.needed;
        let mut src = [0; 3];
        src[State::Fp32.index()] = self.flat(r, fp32, &first_short)?;
        let (exp_avg, exp_avg_sq, step) = self.adam(r, state, g)?;
        for (st, t) in [(State::ExpAvg, exp_avg), (State::ExpAvgSq, exp_avg_sq)] {
            let f = Flat {
                what: format!("state[{g}]['{}']", st.name()),
                tensor: t,
                expected: state_numel,
                needed,
            };
            src[st.index()] = self.flat(r, f, &first_short)?;
        }
        Ok((src, step))
    }

    /// A parameter made of `pieces`, rank `r`'s from the sources `src[r]`.
    fn push_param(&mut self, pieces: &[Piece], src: &[[usize; 3]]) {
        let spans = |st: State| -> Vec<Span> {
            pieces
                .iter()
                .map(|pc| Span {
                    src: src[pc.rank][st.index()],
                    start: pc.start,
                    len: pc.len,
                })
                .collect()
        };
        self.spans.push([
            spans(State::Fp32),
            spans(State::ExpAvg),
            spans(State::ExpAvgSq),
        ]);
    }
}

/// The param groups of the inner optimizer's state dict: each group's hyper-parameters, and
/// which param group each of the `subgroups` flat groups (sub-groups) belongs to.
pub(super) fn param_groups(p: &Pickled, groups: &PyObj, subgroups: usize) -> Result<Groups> {
    let mut hyper = Vec::new();
    let mut ids = Vec::new();
    for (g, group) in p.seq(groups, "param_groups")?.iter().enumerate() {
        let (h, i) = hyperparameters(p, group, g)?;
        hyper.push(h);
        ids.push(i);
    }
    Ok((group_of_subgroups(p, &ids, subgroups)?, hyper))
}

/// The first parameter (of `names`, each laid out in `pieces`) whose piece on rank `r` does
/// not fit in the `n` elements that rank holds: what a truncated partition error names.
fn first_short_param(
    names: &[(String, Vec<usize>)],
    pieces: &[Vec<Piece>],
    r: usize,
    n: usize,
) -> Option<String> {
    pieces
        .iter()
        .position(|p| p.iter().any(|pc| pc.rank == r && pc.start + pc.len > n))
        .map(|i| names[i].0.clone())
}

/// Rank `r`'s `param_slice_mappings[g]` (when saved) against the layout: the parameters
/// with elements in its partition, in flat order, each `fragment_address(numel, start)`.
fn check_slice_mappings(
    p: &Pickled,
    s: &PyObj,
    g: usize,
    r: usize,
    layout: &FlatGroup,
    names: &[(String, Vec<usize>)],
) -> Result<()> {
    let Some(all) = get(s, "param_slice_mappings") else {
        return Ok(());
    };
    let saved = p
        .seq(all, "param_slice_mappings")?
        .get(g)
        .and_then(items)
        .ok_or_else(|| p.err(None, format!("`param_slice_mappings[{g}]` is not a dict")))?;
    let want = layout.slice_mappings(r);
    let mut got = Vec::new();
    for (k, v) in saved {
        let PyObj::Str(name) = k else {
            return Err(p.err(
                None,
                format!("`param_slice_mappings[{g}]` has a key that is not a name"),
            ));
        };
        check_name(p, name)?;
        let field = |f: &str| match get(v, f) {
            Some(PyObj::Int(n)) if *n >= 0 => Ok(*n as usize),
            _ => Err(p.err(
                Some(name),
                format!("its `param_slice_mappings` entry has no `{f}` count"),
            )),
        };
        got.push((name.clone(), field("numel")?, field("start")?));
    }
    let want: Vec<(String, usize, usize)> = want
        .into_iter()
        .map(|(i, numel, start)| (names[i].0.clone(), numel, start))
        .collect();
    if got != want {
        let differs = want
            .iter()
            .zip(&got)
            .find(|(a, b)| a != b)
            .map(|(a, _)| a.0.clone())
            .or_else(|| want.get(got.len()).map(|w| w.0.clone()))
            .or_else(|| got.get(want.len()).map(|x| x.0.clone()));
        return Err(p.err(
            differs.as_deref(),
            format!(
                "`param_slice_mappings[{g}]` of rank {r} is {got:?} (name, numel, start), but the ZeRO layout gives {want:?}"
            ),
        ));
    }
    Ok(())
}
