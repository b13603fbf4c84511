//! `torch.optim.SGD` (PyTorch 2.13): momentum, dampening, Nesterov, weight decay, maximize.
//!
//! State is `momentum_buffer`, created by the first step of a parameter with a gradient when
//! `momentum != 0`; with `momentum == 0` no state is stored at all (older PyTorch stored
//! `momentum_buffer: None`; such dicts load, and the buffer starts from the next gradient).

use super::core::{
    changed_options, check_opt_bool, check_param_shaped, get_bool, get_f64, setdefault, Core, Rules,
};
use super::kernels::{self, SgdScalars, Store};
use super::{GroupOptions, Number, Optimizer, SlotSpec};
use crate::error::{Error, Result};
use crate::optim_state::{OptimParams, OptimStateDict, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor};
use half::{bf16, f16};

/// Hyper-parameters of `torch.optim.SGD` with its defaults ([`Default`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SgdConfig {
    /// `lr` (default `1e-3`).
    pub lr: f64,
    /// `momentum` (default the int `0`).
    pub momentum: Number,
    /// `dampening` (default the int `0`).
    pub dampening: Number,
    /// `weight_decay` (default the int `0`).
    pub weight_decay: Number,
    /// `nesterov` (default `False`).
    pub nesterov: bool,
    /// `maximize` (default `False`).
    pub maximize: bool,
    /// `foreach` (default `None`); stored only, steps use the single-tensor path.
    pub foreach: Option<bool>,
    /// `differentiable` (default `False`); stored only.
    pub differentiable: bool,
    /// `fused` (default `None`); stored only.
    pub fused: Option<bool>,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: Number::Int(0),
            dampening: Number::Int(0),
            weight_decay: Number::Int(0),
            nesterov: false,
            maximize: false,
            foreach: None,
            differentiable: false,
            fused: None,
        }
    }
}

impl SgdConfig {
    /// The group dict torch builds from these values (`SGD.__init__`'s `defaults`, in order).
    pub fn options(&self) -> GroupOptions {
        let opt = |b: Option<bool>| b.map_or(Value::None, Value::Bool);
        let mut o = GroupOptions::new();
        o.insert("lr".into(), Value::Float(self.lr));
        o.insert("momentum".into(), self.momentum.to_value());
        o.insert("dampening".into(), self.dampening.to_value());
        o.insert("weight_decay".into(), self.weight_decay.to_value());
        o.insert("nesterov".into(), Value::Bool(self.nesterov));
        o.insert("maximize".into(), Value::Bool(self.maximize));
        o.insert("foreach".into(), opt(self.foreach));
        o.insert("differentiable".into(), Value::Bool(self.differentiable));
        o.insert("fused".into(), opt(self.fused));
        o
    }

    /// The checks of `SGD.__init__`.
    fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidOptimizerConfig {
                optimizer: "SGD".into(),
                reason,
            })
        };
        let (momentum, dampening, wd) = (
            self.momentum.as_f64(),
            self.dampening.as_f64(),
            self.weight_decay.as_f64(),
        );
        if self.lr < 0.0 || self.lr.is_nan() {
            return bad(format!("Invalid learning rate: {}", self.lr));
        }
        if momentum < 0.0 || momentum.is_nan() {
            return bad(format!("Invalid momentum value: {momentum}"));
        }
        if wd < 0.0 || wd.is_nan() {
            return bad(format!("Invalid weight_decay value: {wd}"));
        }
        if self.nesterov && (momentum <= 0.0 || dampening != 0.0) {
            return bad("Nesterov momentum requires a momentum and zero dampening".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct SgdRules;

impl SgdRules {
    fn parse(&self, g: usize, o: &GroupOptions) -> Result<SgdScalars> {
        let n = self.name();
        check_opt_bool(n, g, o, "foreach")?;
        check_opt_bool(n, g, o, "fused")?;
        get_bool(n, g, o, "differentiable")?;
        Ok(SgdScalars {
            lr: get_f64(n, g, o, "lr")?,
            momentum: get_f64(n, g, o, "momentum")?,
            dampening: get_f64(n, g, o, "dampening")?,
            weight_decay: get_f64(n, g, o, "weight_decay")?,
            nesterov: get_bool(n, g, o, "nesterov")?,
            maximize: get_bool(n, g, o, "maximize")?,
        })
    }
}

impl Rules for SgdRules {
    fn name(&self) -> &'static str {
        "SGD"
    }

    fn setdefaults(&self, o: &mut GroupOptions) {
        // `SGD.__setstate__` (note `fused` defaults to False here, None in the constructor).
        setdefault(o, "nesterov", Value::Bool(false));
        setdefault(o, "maximize", Value::Bool(false));
        setdefault(o, "foreach", Value::None);
        setdefault(o, "differentiable", Value::Bool(false));
        setdefault(o, "fused", Value::Bool(false));
    }

    fn check_group(&self, g: usize, o: &GroupOptions) -> Result<()> {
        self.parse(g, o).map(|_| ())
    }

    fn fix_state(
        &self,
        id: usize,
        _g: usize,
        _o: &GroupOptions,
        st: &mut ParamState,
        slot: Option<&SlotSpec>,
    ) -> Result<()> {
        match st.get("momentum_buffer") {
            None | Some(Value::None) => Ok(()),
            Some(v) => check_param_shaped(self.name(), id, "momentum_buffer", v, slot),
        }
    }
}

fn run<S: Store>(
    p: &mut HostTensor,
    g: &HostTensor,
    buf: Option<(&mut HostTensor, bool)>,
    h: &SgdScalars,
) -> Result<()> {
    let buf = match buf {
        Some((t, fresh)) => Some((t.as_mut_slice::<S>()?, fresh)),
        None => None,
    };
    kernels::sgd(p.as_mut_slice::<S>()?, g.as_slice::<S>()?, buf, h);
    Ok(())
}

/// `torch.optim.SGD` over parameter slots (see the [module docs](super)).
#[derive(Debug, Clone)]
pub struct Sgd {
    core: Core,
    defaults: SgdConfig,
}

impl Sgd {
    /// `SGD(params, **config)`: every group gets `config`.
    pub fn new(params: OptimParams, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        let core = Core::new(&SgdRules, params, config.options())?;
        Ok(Sgd {
            core,
            defaults: config,
        })
    }

    /// Group `group` built like `{"params": ..., **overrides}` (overrides first, then the
    /// defaults), as torch's `add_param_group` does.
    pub fn with_group_options<K: Into<String>>(
        mut self,
        group: usize,
        overrides: impl IntoIterator<Item = (K, Value)>,
    ) -> Result<Self> {
        let defaults = self.defaults.options();
        let overrides = overrides.into_iter().map(|(k, v)| (k.into(), v)).collect();
        self.core
            .override_group(&SgdRules, group, &defaults, overrides)?;
        Ok(self)
    }

    /// Group `group` with the fields that `f` changes overridden (in the defaults' order).
    pub fn with_group_config(self, group: usize, f: impl FnOnce(&mut SgdConfig)) -> Result<Self> {
        let mut c = self.defaults.clone();
        f(&mut c);
        c.validate()?;
        let changed = changed_options(&self.defaults.options(), c.options());
        self.with_group_options(group, changed)
    }

    /// The defaults the optimizer was built with.
    pub fn defaults(&self) -> &SgdConfig {
        &self.defaults
    }
}

impl Optimizer for Sgd {
    fn params(&self) -> &OptimParams {
        &self.core.params
    }

    fn step(&mut self, params: &mut [HostTensor], grads: &[Option<HostTensor>]) -> Result<()> {
        let hypers = self
            .core
            .begin_step(&SgdRules, params, grads, |g, o| SgdRules.parse(g, o))?;
        for (g, h) in hypers.iter().enumerate() {
            for id in self.core.group_ids(g) {
                let Some(grad) = &grads[id] else { continue };
                let param = &mut params[id];
                let res = if h.momentum != 0.0 {
                    let st = self.core.state.entry(ParamKey::Id(id)).or_default();
                    let existing = match st.get_mut("momentum_buffer") {
                        Some(v @ Value::Tensor(_)) => match std::mem::replace(v, Value::None) {
                            Value::Tensor(t) => Some(t),
                            _ => None,
                        },
                        _ => None,
                    };
                    let fresh = existing.is_none();
                    let mut buf =
                        existing.unwrap_or_else(|| HostTensor::zeros(param.dtype(), param.shape()));
                    let res = dispatch(param, grad, Some((&mut buf, fresh)), h, id);
                    st.insert("momentum_buffer".into(), Value::Tensor(buf));
                    res
                } else {
                    dispatch(param, grad, None, h, id)
                };
                res?;
            }
        }
        Ok(())
    }

    fn state_dict(&self) -> OptimStateDict {
        self.core.state_dict()
    }

    fn load_state_dict(&mut self, sd: &OptimStateDict) -> Result<()> {
        self.core.load(&SgdRules, sd)
    }

    fn bind_slots(&mut self, slots: &[HostTensor]) -> Result<()> {
        self.core.bind(&SgdRules, slots, None)
    }

    fn group_options(&self, group: usize) -> Option<&GroupOptions> {
        self.core.groups.get(group)
    }

    fn set_group_option(&mut self, group: usize, key: &str, value: Value) -> Result<()> {
        self.core.set_group_option(&SgdRules, group, key, value)
    }
}

fn dispatch(
    p: &mut HostTensor,
    g: &HostTensor,
    buf: Option<(&mut HostTensor, bool)>,
    h: &SgdScalars,
    id: usize,
) -> Result<()> {
    match p.dtype() {
        DType::F32 => run::<f32>(p, g, buf, h),
        DType::F64 => run::<f64>(p, g, buf, h),
        DType::BF16 => run::<bf16>(p, g, buf, h),
        DType::F16 => run::<f16>(p, g, buf, h),
        other => Err(Error::DtypeMismatch {
            context: format!("SGD::step: parameter id {id}"),
            expected: "a floating point dtype".into(),
            found: other.to_string(),
        }),
    }
}
