//! `torch.optim.Adam` and `torch.optim.AdamW` (PyTorch 2.13).
//!
//! In 2.13 `AdamW` is `Adam` with `decoupled_weight_decay=True` and `weight_decay=1e-2` by
//! default; its groups carry the same keys as Adam's, and loading forces
//! `decoupled_weight_decay` to `True` (`AdamW.__setstate__`).

use super::core::{
    changed_options, check_opt_bool, check_param_shaped, get_bool, get_f64, get_pair, setdefault,
    Core, Rules,
};
use super::kernels::{self, AdamScalars, Store};
use super::{GroupOptions, Number, Optimizer, SlotSpec};
use crate::error::{Error, Result};
use crate::optim_state::{OptimParams, OptimStateDict, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor};
use half::{bf16, f16};

/// Hyper-parameters of `torch.optim.Adam` with its defaults ([`Default`]) or AdamW's
/// ([`AdamConfig::adamw`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamConfig {
    /// `lr` (default `1e-3`).
    pub lr: f64,
    /// `betas` (default `(0.9, 0.999)`).
    pub betas: (f64, f64),
    /// `eps` (default `1e-8`).
    pub eps: f64,
    /// `weight_decay` (Adam: the int `0`; AdamW: `1e-2`).
    pub weight_decay: Number,
    /// `amsgrad` (default `False`).
    pub amsgrad: bool,
    /// `maximize` (default `False`).
    pub maximize: bool,
    /// `foreach` (default `None`); stored only, steps use the single-tensor path.
    pub foreach: Option<bool>,
    /// `capturable` (default `False`); stored only.
    pub capturable: bool,
    /// `differentiable` (default `False`); stored only.
    pub differentiable: bool,
    /// `fused` (default `None`); stored only.
    pub fused: Option<bool>,
    /// `decoupled_weight_decay` (Adam: `False`; always `True` for [`AdamW`]).
    pub decoupled_weight_decay: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: Number::Int(0),
            amsgrad: false,
            maximize: false,
            foreach: None,
            capturable: false,
            differentiable: false,
            fused: None,
            decoupled_weight_decay: false,
        }
    }
}

fn opt_bool(b: Option<bool>) -> Value {
    b.map_or(Value::None, Value::Bool)
}

impl AdamConfig {
    /// `torch.optim.AdamW`'s defaults: `weight_decay=1e-2`, `decoupled_weight_decay=True`.
    pub fn adamw() -> Self {
        AdamConfig {
            weight_decay: Number::Float(1e-2),
            decoupled_weight_decay: true,
            ..Self::default()
        }
    }

    /// The group dict torch builds from these values (`Adam.__init__`'s `defaults`, in order).
    pub fn options(&self) -> GroupOptions {
        let mut o = GroupOptions::new();
        o.insert("lr".into(), Value::Float(self.lr));
        o.insert(
            "betas".into(),
            Value::Tuple(vec![Value::Float(self.betas.0), Value::Float(self.betas.1)]),
        );
        o.insert("eps".into(), Value::Float(self.eps));
        o.insert("weight_decay".into(), self.weight_decay.to_value());
        o.insert("amsgrad".into(), Value::Bool(self.amsgrad));
        o.insert("maximize".into(), Value::Bool(self.maximize));
        o.insert("foreach".into(), opt_bool(self.foreach));
        o.insert("capturable".into(), Value::Bool(self.capturable));
        o.insert("differentiable".into(), Value::Bool(self.differentiable));
        o.insert("fused".into(), opt_bool(self.fused));
        o.insert(
            "decoupled_weight_decay".into(),
            Value::Bool(self.decoupled_weight_decay),
        );
        o
    }

    /// The range checks of `Adam.__init__`.
    fn validate(&self, opt: &str) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidOptimizerConfig {
                optimizer: opt.into(),
                reason,
            })
        };
        let wd = self.weight_decay.as_f64();
        if !(0.0..=f64::INFINITY).contains(&self.lr) {
            return bad(format!("Invalid learning rate: {}", self.lr));
        }
        if !(0.0..=f64::INFINITY).contains(&self.eps) {
            return bad(format!("Invalid epsilon value: {}", self.eps));
        }
        if !(0.0..1.0).contains(&self.betas.0) {
            return bad(format!(
                "Invalid beta parameter at index 0: {}",
                self.betas.0
            ));
        }
        if !(0.0..1.0).contains(&self.betas.1) {
            return bad(format!(
                "Invalid beta parameter at index 1: {}",
                self.betas.1
            ));
        }
        if !(0.0..=f64::INFINITY).contains(&wd) {
            return bad(format!("Invalid weight_decay value: {wd}"));
        }
        Ok(())
    }
}

/// What one group's step reads.
#[derive(Debug, Clone, Copy)]
struct AdamHyper {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    /// `capturable or fused`: `step` is kept float32.
    step_f32: bool,
}

#[derive(Debug, Clone, Copy)]
struct AdamRules {
    adamw: bool,
}

impl AdamRules {
    fn parse(&self, g: usize, o: &GroupOptions) -> Result<AdamHyper> {
        let n = self.name();
        let (beta1, beta2) = get_pair(n, g, o, "betas")?;
        check_opt_bool(n, g, o, "foreach")?;
        check_opt_bool(n, g, o, "fused")?;
        get_bool(n, g, o, "differentiable")?;
        Ok(AdamHyper {
            lr: get_f64(n, g, o, "lr")?,
            beta1,
            beta2,
            eps: get_f64(n, g, o, "eps")?,
            weight_decay: get_f64(n, g, o, "weight_decay")?,
            amsgrad: get_bool(n, g, o, "amsgrad")?,
            maximize: get_bool(n, g, o, "maximize")?,
            decoupled: get_bool(n, g, o, "decoupled_weight_decay")?,
            step_f32: get_bool(n, g, o, "capturable")?
                || matches!(o.get("fused"), Some(Value::Bool(true))),
        })
    }
}

impl Rules for AdamRules {
    fn name(&self) -> &'static str {
        if self.adamw {
            "AdamW"
        } else {
            "Adam"
        }
    }

    fn setdefaults(&self, o: &mut GroupOptions) {
        // `Adam.__setstate__`, in its order (not the constructor's).
        setdefault(o, "amsgrad", Value::Bool(false));
        setdefault(o, "maximize", Value::Bool(false));
        setdefault(o, "foreach", Value::None);
        setdefault(o, "capturable", Value::Bool(false));
        setdefault(o, "differentiable", Value::Bool(false));
        setdefault(o, "decoupled_weight_decay", Value::Bool(false));
        setdefault(o, "fused", Value::None);
        if self.adamw {
            o.insert("decoupled_weight_decay".into(), Value::Bool(true));
        }
    }

    fn check_group(&self, g: usize, o: &GroupOptions) -> Result<()> {
        self.parse(g, o).map(|_| ())
    }

    fn fix_state(
        &self,
        id: usize,
        g: usize,
        o: &GroupOptions,
        st: &mut ParamState,
        slot: Option<&SlotSpec>,
    ) -> Result<()> {
        if st.is_empty() {
            return Ok(()); // initialized by the next step, as in torch
        }
        let n = self.name();
        let h = self.parse(g, o)?;
        let Some(step) = st.get_mut("step") else {
            return Err(Error::MissingState {
                context: n.into(),
                param: format!("parameter id {id}"),
                state: "step".into(),
            });
        };
        match step {
            // `Adam.__setstate__`: a number step becomes a float32 0-dim tensor.
            Value::Float(x) => *step = Value::Tensor(HostTensor::scalar(*x as f32)),
            Value::Int(i) => *step = Value::Tensor(HostTensor::scalar(*i as f32)),
            Value::Tensor(t) if t.numel() == 1 && step_dtype_ok(t.dtype()) => {
                if h.step_f32 && t.dtype() != DType::F32 {
                    *t = super::core::cast_tensor(t, DType::F32);
                }
            }
            other => {
                return Err(Error::WrongStateKind {
                    context: n.into(),
                    param: format!("parameter id {id}"),
                    state: "step".into(),
                    expected: "a number or a one-element tensor".into(),
                    found: other.kind(),
                })
            }
        }
        let mut names = vec!["exp_avg", "exp_avg_sq"];
        if h.amsgrad {
            names.push("max_exp_avg_sq");
        }
        for name in names {
            let Some(v) = st.get(name) else {
                return Err(Error::MissingState {
                    context: n.into(),
                    param: format!("parameter id {id}"),
                    state: name.into(),
                });
            };
            check_param_shaped(n, id, name, v, slot)?;
        }
        Ok(())
    }
}

fn step_dtype_ok(d: DType) -> bool {
    matches!(
        d,
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::I64 | DType::I32
    )
}

/// `step_t += 1` in the step's dtype; returns `step_t.item()`.
fn bump_step(t: &mut HostTensor) -> Result<f64> {
    Ok(match t.dtype() {
        DType::F32 => {
            let s = &mut t.as_mut_slice::<f32>()?[0];
            *s += 1.0;
            f64::from(*s)
        }
        DType::F64 => {
            let s = &mut t.as_mut_slice::<f64>()?[0];
            *s += 1.0;
            *s
        }
        DType::BF16 => {
            let s = &mut t.as_mut_slice::<bf16>()?[0];
            *s = bf16::from_f32(s.to_f32() + 1.0);
            s.to_f64()
        }
        DType::F16 => {
            let s = &mut t.as_mut_slice::<f16>()?[0];
            *s = f16::from_f32(s.to_f32() + 1.0);
            s.to_f64()
        }
        DType::I64 => {
            let s = &mut t.as_mut_slice::<i64>()?[0];
            *s += 1;
            *s as f64
        }
        DType::I32 => {
            let s = &mut t.as_mut_slice::<i32>()?[0];
            *s += 1;
            f64::from(*s)
        }
        other => {
            return Err(Error::DtypeMismatch {
                context: "Adam state `step`".into(),
                expected: "a floating point or integer dtype".into(),
                found: other.to_string(),
            })
        }
    })
}

/// Moves a tensor out of a state entry (put back with [`put`]).
fn take(st: &mut ParamState, id: usize, name: &str) -> Result<HostTensor> {
    match st.get_mut(name).map(|v| std::mem::replace(v, Value::None)) {
        Some(Value::Tensor(t)) => Ok(t),
        _ => Err(Error::MissingState {
            context: "Adam step".into(),
            param: format!("parameter id {id}"),
            state: name.into(),
        }),
    }
}

fn put(st: &mut ParamState, name: &str, t: HostTensor) {
    st.insert(name.to_string(), Value::Tensor(t));
}

fn run<S: Store>(
    p: &mut HostTensor,
    g: &HostTensor,
    m: &mut HostTensor,
    v: &mut HostTensor,
    mx: Option<&mut HostTensor>,
    h: &AdamScalars,
) -> Result<()> {
    let mx = match mx {
        Some(t) => Some(t.as_mut_slice::<S>()?),
        None => None,
    };
    kernels::adam(
        p.as_mut_slice::<S>()?,
        g.as_slice::<S>()?,
        m.as_mut_slice::<S>()?,
        v.as_mut_slice::<S>()?,
        mx,
        h,
    );
    Ok(())
}

/// `torch.optim.Adam` over parameter slots (see the [module docs](super)).
#[derive(Debug, Clone)]
pub struct Adam {
    core: Core,
    rules: AdamRules,
    defaults: AdamConfig,
}

impl Adam {
    /// `Adam(params, **config)`: every group gets `config`.
    pub fn new(params: OptimParams, config: AdamConfig) -> Result<Self> {
        Self::build(params, config, false)
    }

    fn build(params: OptimParams, config: AdamConfig, adamw: bool) -> Result<Self> {
        let rules = AdamRules { adamw };
        config.validate(rules.name())?;
        let core = Core::new(&rules, params, config.options())?;
        Ok(Adam {
            core,
            rules,
            defaults: config,
        })
    }

    /// Group `group` built like `{"params": ..., **overrides}`: the overrides come first, in
    /// the given order, then the defaults (torch's `add_param_group`). Keys that Adam does
    /// not know are kept and saved, as in PyTorch.
    pub fn with_group_options<K: Into<String>>(
        mut self,
        group: usize,
        overrides: impl IntoIterator<Item = (K, Value)>,
    ) -> Result<Self> {
        let defaults = self.defaults.options();
        let overrides = overrides.into_iter().map(|(k, v)| (k.into(), v)).collect();
        self.core
            .override_group(&self.rules, group, &defaults, overrides)?;
        Ok(self)
    }

    /// Group `group` with the fields that `f` changes overridden (in the defaults' order),
    /// e.g. `.with_group_config(1, |c| c.weight_decay = 0.9.into())`.
    pub fn with_group_config(self, group: usize, f: impl FnOnce(&mut AdamConfig)) -> Result<Self> {
        let mut c = self.defaults.clone();
        f(&mut c);
        c.validate(self.rules.name())?;
        let changed = changed_options(&self.defaults.options(), c.options());
        self.with_group_options(group, changed)
    }

    /// The defaults the optimizer was built with.
    pub fn defaults(&self) -> &AdamConfig {
        &self.defaults
    }
}

impl Optimizer for Adam {
    fn params(&self) -> &OptimParams {
        &self.core.params
    }

    fn step(&mut self, params: &mut [HostTensor], grads: &[Option<HostTensor>]) -> Result<()> {
        let rules = self.rules;
        let hypers = self
            .core
            .begin_step(&rules, params, grads, |g, o| rules.parse(g, o))?;
        for (g, h) in hypers.iter().enumerate() {
            for id in self.core.group_ids(g) {
                let Some(grad) = &grads[id] else { continue };
                let param = &mut params[id];
                let st = self.core.state.entry(ParamKey::Id(id)).or_default();
                if st.is_empty() {
                    st.insert("step".into(), Value::Tensor(HostTensor::scalar(0.0f32)));
                    let zeros = || Value::Tensor(HostTensor::zeros(param.dtype(), param.shape()));
                    st.insert("exp_avg".into(), zeros());
                    st.insert("exp_avg_sq".into(), zeros());
                    if h.amsgrad {
                        st.insert("max_exp_avg_sq".into(), zeros());
                    }
                }
                let mut step_t = take(st, id, "step")?;
                let step = bump_step(&mut step_t);
                put(st, "step", step_t);
                let step = step?;
                let bias_correction1 = 1.0 - h.beta1.powf(step);
                let bias_correction2 = 1.0 - h.beta2.powf(step);
                let scalars = AdamScalars {
                    lr: h.lr,
                    beta1: h.beta1,
                    beta2: h.beta2,
                    eps: h.eps,
                    weight_decay: h.weight_decay,
                    maximize: h.maximize,
                    decoupled: h.decoupled,
                    step_size: h.lr / bias_correction1,
                    // Python's `x ** 0.5` is libm `pow`; keep LLVM from turning it into `sqrt`.
                    bias_correction2_sqrt: bias_correction2.powf(std::hint::black_box(0.5)),
                };
                let mut m = take(st, id, "exp_avg")?;
                let mut v = take(st, id, "exp_avg_sq")?;
                let mut mx = if h.amsgrad {
                    Some(take(st, id, "max_exp_avg_sq")?)
                } else {
                    None
                };
                let res = match param.dtype() {
                    DType::F32 => run::<f32>(param, grad, &mut m, &mut v, mx.as_mut(), &scalars),
                    DType::F64 => run::<f64>(param, grad, &mut m, &mut v, mx.as_mut(), &scalars),
                    DType::BF16 => run::<bf16>(param, grad, &mut m, &mut v, mx.as_mut(), &scalars),
                    DType::F16 => run::<f16>(param, grad, &mut m, &mut v, mx.as_mut(), &scalars),
                    other => Err(Error::DtypeMismatch {
                        context: format!("{}::step: parameter id {id}", rules.name()),
                        expected: "a floating point dtype".into(),
                        found: other.to_string(),
                    }),
                };
                put(st, "exp_avg", m);
                put(st, "exp_avg_sq", v);
                if let Some(mx) = mx {
                    put(st, "max_exp_avg_sq", mx);
                }
                res?;
            }
        }
        Ok(())
    }

    fn state_dict(&self) -> OptimStateDict {
        self.core.state_dict()
    }

    fn load_state_dict(&mut self, sd: &OptimStateDict) -> Result<()> {
        self.core.load(&self.rules, sd)
    }

    fn bind_slots(&mut self, slots: &[HostTensor]) -> Result<()> {
        self.core.bind(&self.rules, slots, None)
    }

    fn group_options(&self, group: usize) -> Option<&GroupOptions> {
        self.core.groups.get(group)
    }

    fn set_group_option(&mut self, group: usize, key: &str, value: Value) -> Result<()> {
        self.core.set_group_option(&self.rules, group, key, value)
    }
}

/// `torch.optim.AdamW`: [`Adam`] with `decoupled_weight_decay=True` (see the module docs).
#[derive(Debug, Clone)]
pub struct AdamW(Adam);

impl AdamW {
    /// `AdamW(params, **config)`; `decoupled_weight_decay` is forced to `True`. Start from
    /// [`AdamConfig::adamw`] for torch's AdamW defaults.
    pub fn new(params: OptimParams, config: AdamConfig) -> Result<Self> {
        let config = AdamConfig {
            decoupled_weight_decay: true,
            ..config
        };
        Ok(AdamW(Adam::build(params, config, true)?))
    }

    /// See [`Adam::with_group_options`].
    pub fn with_group_options<K: Into<String>>(
        self,
        group: usize,
        overrides: impl IntoIterator<Item = (K, Value)>,
    ) -> Result<Self> {
        Ok(AdamW(self.0.with_group_options(group, overrides)?))
    }

    /// See [`Adam::with_group_config`].
    pub fn with_group_config(self, group: usize, f: impl FnOnce(&mut AdamConfig)) -> Result<Self> {
        Ok(AdamW(self.0.with_group_config(group, f)?))
    }

    /// The defaults the optimizer was built with.
    pub fn defaults(&self) -> &AdamConfig {
        self.0.defaults()
    }
}

impl Optimizer for AdamW {
    fn params(&self) -> &OptimParams {
        self.0.params()
    }
    fn step(&mut self, params: &mut [HostTensor], grads: &[Option<HostTensor>]) -> Result<()> {
        self.0.step(params, grads)
    }
    fn state_dict(&self) -> OptimStateDict {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, sd: &OptimStateDict) -> Result<()> {
        self.0.load_state_dict(sd)
    }
    fn bind_slots(&mut self, slots: &[HostTensor]) -> Result<()> {
        self.0.bind_slots(slots)
    }
    fn group_options(&self, group: usize) -> Option<&GroupOptions> {
        self.0.group_options(group)
    }
    fn set_group_option(&mut self, group: usize, key: &str, value: Value) -> Result<()> {
        self.0.set_group_option(group, key, value)
    }
}
