//! What every optimizer shares: param groups as torch's group dicts, per-parameter state in
//! insertion order, the known slots, `state_dict`, `load_state_dict` and input validation.

use super::{param_fqn, GroupOptions, SlotSpec};
use crate::error::{Error, LookupSite, Result};
use crate::optim_state::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor};
use half::{bf16, f16};
use indexmap::IndexMap;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// The algorithm-specific parts of loading and checking state.
pub(crate) trait Rules {
    /// `torch.optim.<Name>` for messages.
    fn name(&self) -> &'static str;
    /// torch's `__setstate__`: fills missing keys of a loaded group (appended, in torch's
    /// `setdefault` order) and overrides forced ones (AdamW's `decoupled_weight_decay`).
    fn setdefaults(&self, options: &mut GroupOptions);
    /// Checks the kinds of the hyper-parameters the step reads.
    fn check_group(&self, group: usize, options: &GroupOptions) -> Result<()>;
    /// Checks and normalizes one parameter's state (required names, kinds, shapes, dtypes).
    fn fix_state(
        &self,
        id: usize,
        group: usize,
        options: &GroupOptions,
        state: &mut ParamState,
        slot: Option<&SlotSpec>,
    ) -> Result<()>;
}

/// The options of `config` that differ from `base`, in `config`'s order: the overrides a
/// `with_group_config` call makes.
pub(crate) fn changed_options(base: &GroupOptions, config: GroupOptions) -> Vec<(String, Value)> {
    config
        .into_iter()
        .filter(|(k, v)| base.get(k) != Some(v))
        .collect()
}

/// Param groups, state and slots of one optimizer.
#[derive(Debug, Clone)]
pub(crate) struct Core {
    pub params: OptimParams,
    pub groups: Vec<GroupOptions>,
    pub state: IndexMap<ParamKey, ParamState>,
    pub slots: Vec<Option<SlotSpec>>,
}

impl Core {
    /// Every group gets `defaults`; checks that no parameter is in two groups.
    pub fn new(rules: &dyn Rules, params: OptimParams, defaults: GroupOptions) -> Result<Self> {
        let mut seen = HashSet::new();
        for (_, p) in params.iter() {
            if !seen.insert(p) {
                return Err(Error::InvalidParamGroups {
                    context: rules.name().into(),
                    group: None,
                    reason: format!("some parameters appear in more than one parameter group: {p}"),
                });
            }
        }
        let n = params.len();
        let groups = vec![defaults; params.groups.len()];
        Ok(Core {
            params,
            groups,
            state: IndexMap::new(),
            slots: vec![None; n],
        })
    }

    /// Rebuilds group `group` like `add_param_group({"params": ..., **overrides})`: overrides
    /// first in their order, then the remaining defaults.
    pub fn override_group(
        &mut self,
        rules: &dyn Rules,
        group: usize,
        defaults: &GroupOptions,
        overrides: Vec<(String, Value)>,
    ) -> Result<()> {
        self.check_group_index(rules, group)?;
        let mut options = GroupOptions::new();
        for (k, v) in overrides {
            if k == "params" {
                return Err(Error::InvalidParamGroups {
                    context: rules.name().into(),
                    group: Some(group),
                    reason: "`params` is not a hyper-parameter".into(),
                });
            }
            options.insert(k, v);
        }
        for (k, v) in defaults {
            if !options.contains_key(k) {
                options.insert(k.clone(), v.clone());
            }
        }
        rules.check_group(group, &options)?;
        self.groups[group] = options;
        Ok(())
    }

    pub fn check_group_index(&self, rules: &dyn Rules, group: usize) -> Result<()> {
        if group >= self.groups.len() {
            return Err(Error::InvalidParamGroups {
                context: rules.name().into(),
                group: Some(group),
                reason: format!(
                    "no such group (the optimizer has {} groups)",
                    self.groups.len()
                ),
            });
        }
        Ok(())
    }

    pub fn set_group_option(
        &mut self,
        rules: &dyn Rules,
        group: usize,
        key: &str,
        value: Value,
    ) -> Result<()> {
        self.check_group_index(rules, group)?;
        if key == "params" {
            return Err(Error::InvalidParamGroups {
                context: rules.name().into(),
                group: Some(group),
                reason: "`params` is not a hyper-parameter".into(),
            });
        }
        let mut options = self.groups[group].clone();
        options.insert(key.to_string(), value);
        rules.check_group(group, &options)?;
        self.groups[group] = options;
        Ok(())
    }

    /// Ids of group `g`.
    pub fn group_ids(&self, g: usize) -> Range<usize> {
        let start: usize = self.params.groups[..g].iter().map(Vec::len).sum();
        start..start + self.params.groups[g].len()
    }

    /// The group of every id.
    fn group_of_ids(&self) -> Vec<usize> {
        self.params
            .groups
            .iter()
            .enumerate()
            .flat_map(|(g, ps)| std::iter::repeat_n(g, ps.len()))
            .collect()
    }

    pub fn state_dict(&self) -> OptimStateDict {
        let named = self.params.named;
        let names: Vec<String> = if named {
            self.params.iter().map(|(_, p)| param_fqn(p)).collect()
        } else {
            Vec::new()
        };
        let key_of = |id: usize| {
            if named {
                ParamKey::Name(names[id].clone())
            } else {
                ParamKey::Id(id)
            }
        };
        let state = self
            .state
            .iter()
            .map(|(k, s)| {
                let key = match k {
                    ParamKey::Id(id) if *id < self.params.len() => key_of(*id),
                    other => other.clone(),
                };
                (key, s.clone())
            })
            .collect();
        let param_groups = self
            .groups
            .iter()
            .enumerate()
            .map(|(g, options)| {
                let mut params: Vec<ParamKey> = self.group_ids(g).map(key_of).collect();
                if named {
                    params.sort();
                }
                ParamGroup {
                    options: options.clone(),
                    params,
                }
            })
            .collect();
        OptimStateDict {
            state,
            param_groups: Some(param_groups),
        }
    }

    pub fn load(&mut self, rules: &dyn Rules, sd: &OptimStateDict) -> Result<()> {
        let name = rules.name();
        let Some(saved) = sd.param_groups.as_ref() else {
            return Err(Error::InvalidParamGroups {
                context: name.into(),
                group: None,
                reason: "the loaded state dict has no `param_groups`".into(),
            });
        };
        if saved.len() != self.groups.len() {
            return Err(Error::ParamGroupsMismatch {
                context: name.into(),
                group: None,
                expected: self.groups.len(),
                found: saved.len(),
            });
        }
        let mut id_map: HashMap<ParamKey, usize> = HashMap::new();
        let mut groups = Vec::with_capacity(saved.len());
        for (g, sg) in saved.iter().enumerate() {
            let ids = self.group_ids(g);
            if sg.params.len() != ids.len() {
                return Err(Error::ParamGroupsMismatch {
                    context: name.into(),
                    group: Some(g),
                    expected: ids.len(),
                    found: sg.params.len(),
                });
            }
            for (pos, key) in sg.params.iter().enumerate() {
                let id = match key {
                    ParamKey::Id(_) => ids.start + pos,
                    ParamKey::Name(n) => ids
                        .clone()
                        .find(|&id| param_fqn(&self.params.groups[g][id - ids.start]) == *n)
                        .ok_or_else(|| Error::UnknownParameter {
                            name: n.clone(),
                            site: LookupSite::LoadedParamGroup {
                                group: g,
                                optimizer: name.to_string(),
                            },
                        })?,
                };
                id_map.insert(key.clone(), id);
            }
            let mut options = sg.options.clone();
            options.shift_remove("params");
            rules.setdefaults(&mut options);
            rules.check_group(g, &options)?;
            groups.push(options);
        }
        let group_of = self.group_of_ids();
        let mut state = IndexMap::with_capacity(sd.state.len());
        for (key, st) in &sd.state {
            match id_map.get(key) {
                Some(&id) => {
                    let mut st = st.clone();
                    let slot = self.slots[id].as_ref();
                    if let Some(slot) = slot {
                        cast_state(&mut st, slot.dtype);
                    }
                    rules.fix_state(id, group_of[id], &groups[group_of[id]], &mut st, slot)?;
                    state.insert(ParamKey::Id(id), st);
                }
                None => {
                    state.insert(key.clone(), st.clone());
                }
            }
        }
        self.groups = groups;
        self.state = state;
        Ok(())
    }

    /// Validates step inputs: lengths, floating dtypes, gradient dtype and shape.
    /// The start of every step: validates the inputs, parses each group's hyper-parameters
    /// with `parse`, and records the slots that get a gradient.
    pub fn begin_step<H>(
        &mut self,
        rules: &dyn Rules,
        params: &[HostTensor],
        grads: &[Option<HostTensor>],
        parse: impl Fn(usize, &GroupOptions) -> Result<H>,
    ) -> Result<Vec<H>> {
        self.check_inputs(rules, params, grads)?;
        let hypers = self
            .groups
            .iter()
            .enumerate()
            .map(|(g, o)| parse(g, o))
            .collect::<Result<_>>()?;
        let with_grad: Vec<bool> = grads.iter().map(Option::is_some).collect();
        self.bind(rules, params, Some(&with_grad))?;
        Ok(hypers)
    }

    pub fn check_inputs(
        &self,
        rules: &dyn Rules,
        params: &[HostTensor],
        grads: &[Option<HostTensor>],
    ) -> Result<()> {
        let n = self.params.len();
        if params.len() != n || grads.len() != n {
            return Err(Error::ShapeMismatch {
                context: format!("{}::step: number of parameters and gradients", rules.name()),
                expected: vec![n, n],
                found: vec![params.len(), grads.len()],
            });
        }
        for (id, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            if !matches!(
                p.dtype(),
                DType::F32 | DType::F64 | DType::BF16 | DType::F16
            ) {
                return Err(Error::DtypeMismatch {
                    context: format!(
                        "{}::step: parameter id {id} ({})",
                        rules.name(),
                        self.describe(id)
                    ),
                    expected: "a floating point dtype".into(),
                    found: p.dtype().to_string(),
                });
            }
            if g.dtype() != p.dtype() {
                return Err(Error::DtypeMismatch {
                    context: format!(
                        "{}::step: gradient of parameter id {id} ({})",
                        rules.name(),
                        self.describe(id)
                    ),
                    expected: p.dtype().to_string(),
                    found: g.dtype().to_string(),
                });
            }
            if g.shape() != p.shape() {
                return Err(Error::ShapeMismatch {
                    context: format!(
                        "{}::step: gradient of parameter id {id} ({})",
                        rules.name(),
                        self.describe(id)
                    ),
                    expected: p.shape().to_vec(),
                    found: g.shape().to_vec(),
                });
            }
        }
        Ok(())
    }

    /// Records the slot specs and checks/casts existing state of the parameters that are about
    /// to be stepped (`only` = ids with a gradient) or of all parameters (`None`).
    pub fn bind(
        &mut self,
        rules: &dyn Rules,
        slots: &[HostTensor],
        only: Option<&[bool]>,
    ) -> Result<()> {
        let n = self.params.len();
        if slots.len() != n {
            return Err(Error::ShapeMismatch {
                context: format!("{}: number of parameter slots", rules.name()),
                expected: vec![n],
                found: vec![slots.len()],
            });
        }
        let group_of = self.group_of_ids();
        // Check first, then commit, so that an error changes nothing.
        let mut fixed = Vec::new();
        for (id, t) in slots.iter().enumerate() {
            if only.is_some_and(|m| !m[id]) {
                continue;
            }
            let spec = SlotSpec::of(t);
            if let Some(st) = self.state.get(&ParamKey::Id(id)) {
                if !st.is_empty() {
                    let mut st = st.clone();
                    cast_state(&mut st, spec.dtype);
                    rules.fix_state(
                        id,
                        group_of[id],
                        &self.groups[group_of[id]],
                        &mut st,
                        Some(&spec),
                    )?;
                    fixed.push((id, st));
                }
            }
        }
        for (id, t) in slots.iter().enumerate() {
            if only.is_none_or(|m| m[id]) {
                self.slots[id] = Some(SlotSpec::of(t));
            }
        }
        for (id, st) in fixed {
            self.state.insert(ParamKey::Id(id), st);
        }
        Ok(())
    }

    /// `parameter id 3` plus its name, for messages.
    pub fn describe(&self, id: usize) -> String {
        match self.params.iter().nth(id) {
            Some((_, p)) => p.to_string(),
            None => "unknown parameter".into(),
        }
    }
}

/// PyTorch's `_process_value_according_to_param_policy`: every tensor except `step` is cast to
/// the parameter's (floating) dtype, recursively through tuples and lists.
fn cast_state(state: &mut ParamState, dtype: DType) {
    for (name, v) in state.iter_mut() {
        if name != "step" {
            cast_value(v, dtype);
        }
    }
}

fn cast_value(v: &mut Value, dtype: DType) {
    match v {
        Value::Tensor(t) if t.dtype() != dtype => *t = cast_tensor(t, dtype),
        Value::Tuple(xs) | Value::List(xs) => xs.iter_mut().for_each(|x| cast_value(x, dtype)),
        _ => {}
    }
}

/// `tensor.to(dtype)` into a floating dtype (through f32 for the half types, as c10 does).
pub(crate) fn cast_tensor(t: &HostTensor, dtype: DType) -> HostTensor {
    let vals = t.to_f64_vec();
    let shape = t.shape();
    let out = match dtype {
        DType::F64 => HostTensor::from_slice(&vals, shape),
        DType::F32 => {
            HostTensor::from_slice(&vals.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape)
        }
        DType::BF16 => HostTensor::from_slice(
            &vals
                .iter()
                .map(|&x| bf16::from_f32(x as f32))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::F16 => HostTensor::from_slice(
            &vals
                .iter()
                .map(|&x| f16::from_f32(x as f32))
                .collect::<Vec<_>>(),
            shape,
        ),
        // Parameters are floating point (checked before stepping); keep anything else as is.
        _ => Ok(t.clone()),
    };
    out.expect("element count unchanged")
}

/// Reads a float hyper-parameter (Python `float`, `int` or a 1-element tensor).
pub(crate) fn get_f64(opt: &str, group: usize, options: &GroupOptions, key: &str) -> Result<f64> {
    match options.get(key) {
        Some(v) => value_f64(v).ok_or_else(|| Error::InvalidParamGroups {
            context: opt.into(),
            group: Some(group),
            reason: format!("`{key}` must be a number, found {}", v.kind()),
        }),
        None => Err(Error::InvalidParamGroups {
            context: opt.into(),
            group: Some(group),
            reason: format!("has no `{key}`"),
        }),
    }
}

fn value_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Float(x) => Some(*x),
        Value::Int(i) => Some(*i as f64),
        Value::Tensor(t) if t.numel() == 1 => t.item(),
        _ => None,
    }
}

/// Reads a bool hyper-parameter.
pub(crate) fn get_bool(opt: &str, group: usize, options: &GroupOptions, key: &str) -> Result<bool> {
    match options.get(key) {
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(Error::InvalidParamGroups {
            context: opt.into(),
            group: Some(group),
            reason: format!("`{key}` must be a bool, found {}", v.kind()),
        }),
        None => Err(Error::InvalidParamGroups {
            context: opt.into(),
            group: Some(group),
            reason: format!("has no `{key}`"),
        }),
    }
}

/// Checks an optional-bool hyper-parameter (`foreach`, `fused`: bool or None); absent is fine.
pub(crate) fn check_opt_bool(
    opt: &str,
    group: usize,
    options: &GroupOptions,
    key: &str,
) -> Result<()> {
    match options.get(key) {
        None | Some(Value::Bool(_)) | Some(Value::None) => Ok(()),
        Some(v) => Err(Error::InvalidParamGroups {
            context: opt.into(),
            group: Some(group),
            reason: format!("`{key}` must be a bool or None, found {}", v.kind()),
        }),
    }
}

/// Reads a pair of numbers (`betas`).
pub(crate) fn get_pair(
    opt: &str,
    group: usize,
    options: &GroupOptions,
    key: &str,
) -> Result<(f64, f64)> {
    let bad = |what: String| Error::InvalidParamGroups {
        context: opt.into(),
        group: Some(group),
        reason: format!("`{key}` must be a pair of numbers, found {what}"),
    };
    match options.get(key) {
        Some(Value::Tuple(xs) | Value::List(xs)) if xs.len() == 2 => {
            match (value_f64(&xs[0]), value_f64(&xs[1])) {
                (Some(a), Some(b)) => Ok((a, b)),
                _ => Err(bad(Value::<HostTensor>::Tuple(xs.clone()).render())),
            }
        }
        Some(v) => Err(bad(v.kind())),
        None => Err(Error::InvalidParamGroups {
            context: opt.into(),
            group: Some(group),
            reason: format!("has no `{key}`"),
        }),
    }
}

/// `setdefault` of a loaded group key.
pub(crate) fn setdefault(options: &mut GroupOptions, key: &str, v: Value) {
    if !options.contains_key(key) {
        options.insert(key.to_string(), v);
    }
}

/// Checks a parameter-shaped state tensor of parameter `id` against its slot: it must be a plain
/// tensor of the slot's shape (its dtype is cast to the slot's, as PyTorch does).
pub(crate) fn check_param_shaped(
    opt: &str,
    id: usize,
    name: &str,
    v: &Value,
    slot: Option<&SlotSpec>,
) -> Result<()> {
    let t =
        match v {
            Value::Tensor(t) => t,
            Value::Sharded(_) => return Err(Error::WrongStateKind {
                context: opt.into(),
                param: format!("parameter id {id}"),
                state: name.into(),
                expected:
                    "a plain tensor (convert the dict for loading first: optim_state_dict_to_load)"
                        .into(),
                found: "a sharded tensor".into(),
            }),
            other => {
                return Err(Error::WrongStateKind {
                    context: opt.into(),
                    param: format!("parameter id {id}"),
                    state: name.into(),
                    expected: "a tensor".into(),
                    found: other.kind(),
                })
            }
        };
    if let Some(slot) = slot {
        if t.shape() != slot.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                context: format!("{opt}: state `{name}` of parameter id {id}"),
                expected: slot.shape.clone(),
                found: t.shape().to_vec(),
            });
        }
    }
    Ok(())
}
