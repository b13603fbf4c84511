//! The optimizer state dict, shaped like `torch.optim.Optimizer.state_dict()`.

use crate::flat_param::{ModelLayout, ParamSlot};
use crate::tensor::{HostTensor, Tensor};
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Key of a `state` entry: a parameter id (position in the concatenated param groups) or a
/// name (full/sharded dicts, named optimizers, user-defined state).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ParamKey {
    /// `int` key.
    Id(usize),
    /// `str` key.
    Name(String),
}

impl ParamKey {
    /// The name, for a `str` key.
    pub fn as_name(&self) -> Option<&str> {
        match self {
            ParamKey::Name(n) => Some(n),
            ParamKey::Id(_) => None,
        }
    }
}

impl fmt::Display for ParamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamKey::Id(i) => write!(f, "{i}"),
            ParamKey::Name(n) => write!(f, "'{n}'"),
        }
    }
}

impl From<usize> for ParamKey {
    fn from(i: usize) -> Self {
        ParamKey::Id(i)
    }
}

impl From<&str> for ParamKey {
    fn from(s: &str) -> Self {
        ParamKey::Name(s.to_string())
    }
}

/// One rank's dim-0 chunk of a tensor (PyTorch's `ShardedTensor` in `SHARDED_STATE_DICT`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardedTensor<T = HostTensor> {
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Offset of the local chunk in each dimension (only dim 0 is ever non-zero).
    pub offsets: Vec<usize>,
    /// The local chunk; `None` when `torch.chunk` leaves this rank no chunk.
    pub local: Option<T>,
}

/// A value in a parameter's state or a param group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value<T = HostTensor> {
    /// Python `None`.
    None,
    /// Python `bool`.
    Bool(bool),
    /// Python `int`.
    Int(i64),
    /// Python `float`.
    Float(f64),
    /// Python `str`.
    Str(String),
    /// A tensor (0-dim for scalars such as Adam's `step`).
    Tensor(T),
    /// A row-sharded tensor of a `SHARDED_STATE_DICT`.
    Sharded(ShardedTensor<T>),
    /// Python `tuple`.
    Tuple(Vec<Value<T>>),
    /// Python `list`.
    List(Vec<Value<T>>),
}

impl<T: Tensor> Value<T> {
    /// A positive-dim tensor (or a sharded tensor, which always has a positive dim).
    pub fn is_pos_dim_tensor(&self) -> bool {
        match self {
            Value::Tensor(t) => t.dim() > 0,
            Value::Sharded(_) => true,
            _ => false,
        }
    }

    /// A 0-dim tensor.
    pub fn is_zero_dim_tensor(&self) -> bool {
        matches!(self, Value::Tensor(t) if t.dim() == 0)
    }

    /// Any tensor.
    pub fn is_tensor(&self) -> bool {
        matches!(self, Value::Tensor(_) | Value::Sharded(_))
    }

    /// The tensor, if this is a plain tensor.
    pub fn as_tensor(&self) -> Option<&T> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// Short kind name for error messages (`tensor`, `0-dim tensor`, `float`, …).
    pub fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(_) => "bool".into(),
            Value::Int(_) => "int".into(),
            Value::Float(_) => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Tensor(t) if t.dim() == 0 => format!("0-dim tensor ({})", t.dtype()),
            Value::Tensor(t) => format!("tensor {:?} ({})", t.shape(), t.dtype()),
            Value::Sharded(s) => format!("sharded tensor {:?}", s.global_shape),
            Value::Tuple(_) => "tuple".into(),
            Value::List(_) => "list".into(),
        }
    }

    /// Python-like rendering of a non-tensor value or 0-dim tensor, for error messages.
    pub fn render(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(b) => if *b { "True" } else { "False" }.into(),
            Value::Int(i) => i.to_string(),
            Value::Float(x) => format!("{x:?}"),
            Value::Str(s) => format!("'{s}'"),
            Value::Tensor(t) => match t.to_host().ok().and_then(|h| h.item()) {
                Some(v) if t.dim() == 0 => format!("tensor({v:?}, dtype={})", t.dtype()),
                _ => self.kind(),
            },
            Value::Sharded(_) => self.kind(),
            Value::Tuple(v) => format!(
                "({})",
                v.iter().map(Value::render).collect::<Vec<_>>().join(", ")
            ),
            Value::List(v) => format!(
                "[{}]",
                v.iter().map(Value::render).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// Equality for non-tensor values and 0-dim tensors: same kind, same bits (so that NaN
    /// equals itself as in Python's identity-based set check).
    pub fn same_scalar(&self, other: &Value<T>) -> bool {
        match (self, other) {
            (Value::Float(a), Value::Float(b)) => a.to_bits() == b.to_bits(),
            (Value::Tensor(a), Value::Tensor(b)) => a.bit_eq(b),
            (Value::Tuple(a), Value::Tuple(b)) | (Value::List(a), Value::List(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_scalar(y))
            }
            (Value::None, Value::None) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            (Value::Str(a), Value::Str(b)) => a == b,
            _ => false,
        }
    }

    /// Converts every tensor with `f` (e.g. to another backend).
    pub fn try_map<U, E>(&self, f: &mut impl FnMut(&T) -> Result<U, E>) -> Result<Value<U>, E> {
        Ok(match self {
            Value::None => Value::None,
            Value::Bool(b) => Value::Bool(*b),
            Value::Int(i) => Value::Int(*i),
            Value::Float(x) => Value::Float(*x),
            Value::Str(s) => Value::Str(s.clone()),
            Value::Tensor(t) => Value::Tensor(f(t)?),
            Value::Sharded(s) => Value::Sharded(ShardedTensor {
                global_shape: s.global_shape.clone(),
                offsets: s.offsets.clone(),
                local: s.local.as_ref().map(&mut *f).transpose()?,
            }),
            Value::Tuple(v) => {
                Value::Tuple(v.iter().map(|x| x.try_map(f)).collect::<Result<_, E>>()?)
            }
            Value::List(v) => {
                Value::List(v.iter().map(|x| x.try_map(f)).collect::<Result<_, E>>()?)
            }
        })
    }
}

/// The state of one parameter: state name → value, in insertion order.
pub type ParamState<T = HostTensor> = IndexMap<String, Value<T>>;

/// One entry of `param_groups`: hyper-parameters in order, and `params` (always last when saved).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamGroup<T = HostTensor> {
    /// Hyper-parameters (`lr`, `betas`, `weight_decay`, …) in the optimizer's order.
    pub options: IndexMap<String, Value<T>>,
    /// Parameter keys: ids for local dicts, names for full/sharded dicts.
    pub params: Vec<ParamKey>,
}

/// Converts every tensor of one parameter's state (or of a group's options) with `f`.
pub(crate) fn map_state<T: Tensor, U, E>(
    s: &ParamState<T>,
    f: &mut impl FnMut(&T) -> Result<U, E>,
) -> Result<ParamState<U>, E> {
    s.iter()
        .map(|(k, v)| Ok((k.clone(), v.try_map(f)?)))
        .collect()
}

impl<T: Tensor> ParamGroup<T> {
    /// Converts every tensor among the hyper-parameters with `f`.
    pub fn try_map<U, E>(
        &self,
        f: &mut impl FnMut(&T) -> Result<U, E>,
    ) -> Result<ParamGroup<U>, E> {
        Ok(ParamGroup {
            options: map_state(&self.options, f)?,
            params: self.params.clone(),
        })
    }
}

/// An optimizer state dict: `{"state": {...}, "param_groups": [...]}`; `param_groups` may be
/// absent, as PyTorch allows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimStateDict<T = HostTensor> {
    /// Per-parameter (or user-defined) state.
    pub state: IndexMap<ParamKey, ParamState<T>>,
    /// Parameter groups, if present.
    pub param_groups: Option<Vec<ParamGroup<T>>>,
}

impl<T> Default for OptimStateDict<T> {
    fn default() -> Self {
        OptimStateDict {
            state: IndexMap::new(),
            param_groups: Some(Vec::new()),
        }
    }
}

impl<T: Tensor> OptimStateDict<T> {
    /// Whether `state` is keyed by names (a named optimizer or a full/sharded dict).
    pub fn is_name_keyed(&self) -> bool {
        matches!(self.state.keys().next(), Some(ParamKey::Name(_)))
    }

    /// Converts every tensor with `f`.
    pub fn try_map<U, E>(
        &self,
        mut f: impl FnMut(&T) -> Result<U, E>,
    ) -> Result<OptimStateDict<U>, E> {
        let state = self
            .state
            .iter()
            .map(|(k, s)| Ok((k.clone(), map_state(s, &mut f)?)))
            .collect::<Result<_, E>>()?;
        let param_groups = match &self.param_groups {
            None => None,
            Some(gs) => Some(
                gs.iter()
                    .map(|g| g.try_map(&mut f))
                    .collect::<Result<_, E>>()?,
            ),
        };
        Ok(OptimStateDict {
            state,
            param_groups,
        })
    }

    /// Total bytes of tensor state (local chunks for sharded tensors).
    pub fn tensor_bytes(&self) -> usize {
        fn v<T: Tensor>(x: &Value<T>) -> usize {
            match x {
                Value::Tensor(t) => t.numel() * t.dtype().size(),
                Value::Sharded(s) => s.local.as_ref().map_or(0, |t| t.numel() * t.dtype().size()),
                Value::Tuple(xs) | Value::List(xs) => xs.iter().map(v).sum(),
                _ => 0,
            }
        }
        self.state.values().flat_map(|s| s.values()).map(v).sum()
    }
}

/// A parameter as an optimizer holds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OptimParam {
    /// The flat parameter of the FSDP unit with this module prefix (`use_orig_params=False`).
    Flat(String),
    /// An original parameter by name: FSDP-managed with `use_orig_params=True`, or unmanaged.
    Param(String),
}

impl fmt::Display for OptimParam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptimParam::Flat(u) if u.is_empty() => f.write_str("flat parameter of the root unit"),
            OptimParam::Flat(u) => write!(f, "flat parameter of unit `{u}`"),
            OptimParam::Param(n) => write!(f, "parameter `{n}`"),
        }
    }
}

/// What an optimizer was built with: its param groups in order. A parameter's id is its
/// position in the concatenation of the groups, exactly as `torch.optim` numbers them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimParams {
    /// Param groups, each a list of parameters in the order the optimizer received them.
    pub groups: Vec<Vec<OptimParam>>,
    /// A named optimizer (`_NamedOptimizer`): state is keyed by FQN instead of id.
    #[serde(default)]
    pub named: bool,
}

impl OptimParam {
    /// What `model.parameters()` of the wrapped model yields, in that order (see
    /// [`ModelLayout::parameters_in_model_order`]).
    pub fn in_model_order(layout: &ModelLayout) -> Vec<OptimParam> {
        layout
            .parameters_in_model_order()
            .into_iter()
            .map(|slot| match slot {
                ParamSlot::Flat(f) => OptimParam::Flat(layout.flat_params[f].unit.clone()),
                ParamSlot::Param(i) => OptimParam::Param(layout.model.params[i].name.clone()),
            })
            .collect()
    }
}

impl OptimParams {
    /// The param groups of an optimizer built from `model.parameters()` of the wrapped model:
    /// one group, [`OptimParam::in_model_order`]. What `torch.optim.Adam(model.parameters())`
    /// holds, and what [`crate::Fsdp::optim_params`] returns.
    pub fn of_model(layout: &ModelLayout) -> Self {
        OptimParams::single(OptimParam::in_model_order(layout))
    }

    /// One group holding `params`.
    pub fn single(params: Vec<OptimParam>) -> Self {
        OptimParams {
            groups: vec![params],
            named: false,
        }
    }

    /// Every parameter with its id, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &OptimParam)> {
        self.groups.iter().flatten().enumerate()
    }

    /// Number of parameters over all groups.
    pub fn len(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }

    /// Whether the optimizer holds no parameter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
