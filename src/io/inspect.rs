//! What a checkpoint file holds, for people (`Display`) and programs (`serde`): the summary
//! behind `fsdp-ckpt inspect`.
//!
//! An object that [`super::torch_save::optim_from_pyobj`] accepts is
//! summarized as an optimizer state dict (keys and key types, state names, dtypes, shapes,
//! steps, param groups); one that
//! [`super::torch_save::model_from_pyobj`] accepts as a model state dict;
//! anything else as its list of tensors, named by path as in
//! [`safetensors`](super::safetensors).
//!
//! ```
//! use fsdp::io::{inspect::{Kind, Summary}, torch_save::PyObj};
//! use fsdp::HostTensor;
//!
//! let model = PyObj::Dict(vec![(
//!     PyObj::Str("w".into()),
//!     PyObj::Tensor(HostTensor::zeros(fsdp::DType::F32, &[2, 3])),
//! )]);
//! let s = Summary::of(&model);
//! assert_eq!(s.kind, Kind::Model);
//! assert_eq!(s.total_tensor_bytes, 24);
//! assert!(s.to_string().contains("w  float32 [2, 3]"));
//! ```

use super::safetensors::{named_other_tensors, named_tensors};
use super::torch_save::{model_from_pyobj, optim_from_pyobj, Headers, PyObj};
use super::torch_save::{RichTensor, TensorValue};
use crate::optim_state::{OptimStateDict, ParamKey, Value};
use crate::tensor::{DType, HostTensor};
use serde::Serialize;
use serde_json::{json, Value as Json};
use std::fmt;

/// What kind of state dict an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// `optimizer.state_dict()`: `{"state": ..., "param_groups": ...}`.
    Optimizer,
    /// `module.state_dict()`: names to tensors.
    Model,
    /// Anything else.
    Other,
}

/// One tensor: where it is, dtype, shape, bytes, and the value when it has one element.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorInfo {
    /// Path (model key, state name, or `/`-joined path for other objects).
    pub name: String,
    /// `float32`, `bfloat16`, …
    pub dtype: String,
    /// Shape (`[]` for 0-dim).
    pub shape: Vec<usize>,
    /// Size in bytes.
    pub bytes: usize,
    /// The value of a one-element tensor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<Json>,
    /// What it is when it is not a plain dense tensor: `sparse COO tensor`, `sparse tensor
    /// (torch.sparse_csr)`, `quantized tensor (torch.qint8)`, `meta tensor`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
}

fn float_json(x: f64) -> Json {
    if x.is_finite() {
        json!(x)
    } else {
        json!(format!("{x}"))
    }
}

/// The value of a one-element tensor: an integer for integer dtypes, a bool for bool.
fn scalar_json(t: &HostTensor) -> Option<Json> {
    let v = t.item()?;
    Some(match t.dtype() {
        DType::Bool => json!(v != 0.0),
        DType::I64 => json!(i64::from_le_bytes(t.as_bytes().try_into().ok()?)),
        DType::U64 => json!(u64::from_le_bytes(t.as_bytes().try_into().ok()?)),
        DType::I32 | DType::U8 | DType::I8 | DType::I16 | DType::U16 | DType::U32 => {
            json!(v as i64)
        }
        _ => float_json(v),
    })
}

/// The real shape of a tensor of the object summarized: its own, or a placeholder's from
/// the file's [`Headers`].
#[derive(Clone, Copy)]
struct Shapes<'a>(Option<&'a Headers>);

impl Shapes<'_> {
    fn of(&self, t: &HostTensor) -> Vec<usize> {
        match self.0 {
            Some(h) => h.shape(t).to_vec(),
            None => t.shape().to_vec(),
        }
    }

    fn nbytes(&self, t: &HostTensor) -> usize {
        self.of(t).iter().product::<usize>() * t.dtype().size()
    }
}

fn tensor_info(name: &str, t: &HostTensor, sh: Shapes<'_>) -> TensorInfo {
    TensorInfo {
        name: name.to_string(),
        dtype: t.dtype().torch_attr().to_string(),
        shape: sh.of(t),
        bytes: sh.nbytes(t),
        value: scalar_json(t),
        layout: None,
    }
}

/// A sparse, quantized or meta tensor: its dtype and size, the bytes of the tensors that
/// hold it, and what it is.
fn other_tensor_info(name: &str, r: &RichTensor, sh: Shapes<'_>) -> TensorInfo {
    let shape = match &r.value {
        TensorValue::Quantized(q) => sh.of(&q.int_repr),
        _ => r.size().to_vec(),
    };
    TensorInfo {
        name: name.to_string(),
        dtype: r.dtype_name().trim_start_matches("torch.").to_string(),
        shape,
        bytes: r.tensors().iter().map(|t| sh.nbytes(t)).sum(),
        value: None,
        layout: Some(r.kind()),
    }
}

/// A state or hyper-parameter value as JSON: scalars as themselves, tensors described.
fn value_json(v: &Value, sh: Shapes<'_>) -> Json {
    match v {
        Value::None => Json::Null,
        Value::Bool(b) => json!(b),
        Value::Int(i) => json!(i),
        Value::Float(x) => float_json(*x),
        Value::Str(s) => json!(s),
        Value::Tensor(t) => serde_json::to_value(tensor_info("", t, sh))
            .map(|mut j| {
                if let Some(m) = j.as_object_mut() {
                    m.remove("name");
                }
                json!({ "tensor": j })
            })
            .unwrap_or(Json::Null),
        Value::Sharded(s) => json!({ "sharded_tensor": {
            "global_shape": s.global_shape,
            "offsets": s.offsets,
            "local": s.local.as_ref().map(|t| {
                json!({ "dtype": t.dtype().torch_attr(), "shape": sh.of(t) })
            }),
        } }),
        Value::Tuple(xs) | Value::List(xs) => {
            Json::Array(xs.iter().map(|x| value_json(x, sh)).collect())
        }
    }
}

fn key_json(k: &ParamKey) -> Json {
    match k {
        ParamKey::Id(i) => json!(i),
        ParamKey::Name(n) => json!(n),
    }
}

fn key_type(k: &ParamKey) -> &'static str {
    match k {
        ParamKey::Id(_) => "int",
        ParamKey::Name(_) => "str",
    }
}

/// One state entry of one key.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StateEntry {
    /// State name (`exp_avg`, `step`, …).
    pub name: String,
    /// `tensor`, `0-dim tensor`, `float`, `int`, …
    pub kind: String,
    /// The tensor's description, for tensors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<TensorInfo>,
    /// The value, for non-tensors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<Json>,
}

/// The state of one key of `state`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeySummary {
    /// The key: a number for `int` keys, a string for `str` keys.
    pub key: Json,
    /// `int` or `str`.
    pub key_type: &'static str,
    /// Its states, in order.
    pub state: Vec<StateEntry>,
}

/// One param group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupSummary {
    /// Hyper-parameters in order (tensors described).
    pub options: indexmap::IndexMap<String, Json>,
    /// The `params` list (ids or names).
    pub params: Vec<Json>,
}

/// How many keys have one value of `step`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepCount {
    /// The step value (a 0-dim tensor's value or a plain number).
    pub value: Json,
    /// Number of keys with it.
    pub keys: usize,
}

/// Summary of an optimizer state dict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OptimSummary {
    /// The key types present (`int`, `str`), in order of first appearance.
    pub key_types: Vec<&'static str>,
    /// Every state names seen, in order of first appearance.
    pub state_names: Vec<String>,
    /// The distinct values of the `step` state, with how many keys have each.
    pub steps: Vec<StepCount>,
    /// Per key, in order.
    pub keys: Vec<KeySummary>,
    /// The param groups; `None` when the dict has no `param_groups`.
    pub param_groups: Option<Vec<GroupSummary>>,
}

/// Summary of any object a checkpoint file holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// What kind of state dict it is.
    pub kind: Kind,
    /// Number of tensors.
    pub tensor_count: usize,
    /// Bytes of tensor data, summed over tensors (shared storage counted once per tensor).
    pub total_tensor_bytes: usize,
    /// For optimizer state dicts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimSummary>,
    /// For model state dicts and other objects: every tensor, in order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<TensorInfo>>,
    /// For other objects: the Python type at the root.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_type: Option<&'static str>,
}

impl Summary {
    /// Summarizes `obj`.
    pub fn of(obj: &PyObj) -> Summary {
        Self::summarize(obj, Shapes(None))
    }

    /// The summary of a `torch.save` file's structure, read without its tensor data
    /// ([`load_headers`](super::torch_save::load_headers)): the same as [`Summary::of`] the
    /// loaded object.
    pub fn of_headers(h: &Headers) -> Summary {
        Self::summarize(&h.obj, Shapes(Some(h)))
    }

    fn summarize(obj: &PyObj, sh: Shapes<'_>) -> Summary {
        let all = named_tensors(obj);
        let others: Vec<TensorInfo> = named_other_tensors(obj)
            .iter()
            .map(|(n, r)| other_tensor_info(n, r, sh))
            .collect();
        let tensor_count = all.len() + others.len();
        let total_tensor_bytes = all.iter().map(|(_, t)| sh.nbytes(t)).sum::<usize>()
            + others.iter().map(|t| t.bytes).sum::<usize>();
        if let Ok(osd) = optim_from_pyobj(obj.clone()) {
            return Summary {
                kind: Kind::Optimizer,
                tensor_count,
                total_tensor_bytes,
                optimizer: Some(optim_summary(&osd, sh)),
                tensors: None,
                root_type: None,
            };
        }
        let (kind, root_type, tensors) = match model_from_pyobj(obj.clone()) {
            Ok(msd) => (
                Kind::Model,
                None,
                msd.tensors
                    .iter()
                    .map(|(k, t)| tensor_info(k, t, sh))
                    .collect(),
            ),
            Err(_) => (
                Kind::Other,
                Some(obj.type_name()),
                all.iter()
                    .map(|(n, t)| tensor_info(n, t, sh))
                    .chain(others)
                    .collect(),
            ),
        };
        Summary {
            kind,
            tensor_count,
            total_tensor_bytes,
            optimizer: None,
            tensors: Some(tensors),
            root_type,
        }
    }
}

fn optim_summary(osd: &OptimStateDict, sh: Shapes<'_>) -> OptimSummary {
    let mut key_types = Vec::new();
    let mut state_names: Vec<String> = Vec::new();
    let mut steps: Vec<StepCount> = Vec::new();
    let mut keys = Vec::new();
    for (k, st) in &osd.state {
        if !key_types.contains(&key_type(k)) {
            key_types.push(key_type(k));
        }
        let mut state = Vec::new();
        for (name, v) in st {
            if !state_names.contains(name) {
                state_names.push(name.clone());
            }
            let (tensor, value) = match v {
                Value::Tensor(t) => (Some(tensor_info(name, t, sh)), None),
                other => (None, Some(value_json(other, sh))),
            };
            if name == "step" {
                let sv = match v {
                    Value::Tensor(t) => scalar_json(t).unwrap_or(Json::Null),
                    other => value_json(other, sh),
                };
                match steps.iter_mut().find(|s| s.value == sv) {
                    Some(s) => s.keys += 1,
                    None => steps.push(StepCount { value: sv, keys: 1 }),
                }
            }
            state.push(StateEntry {
                name: name.clone(),
                kind: match v {
                    // The real shape, not a placeholder's.
                    Value::Tensor(t) if t.dim() > 0 => {
                        format!("tensor {:?} ({})", sh.of(t), t.dtype())
                    }
                    other => other.kind(),
                },
                tensor,
                value,
            });
        }
        keys.push(KeySummary {
            key: key_json(k),
            key_type: key_type(k),
            state,
        });
    }
    let param_groups = osd.param_groups.as_ref().map(|gs| {
        gs.iter()
            .map(|g| GroupSummary {
                options: g
                    .options
                    .iter()
                    .map(|(k, v)| (k.clone(), value_json(v, sh)))
                    .collect(),
                params: g.params.iter().map(key_json).collect(),
            })
            .collect()
    });
    OptimSummary {
        key_types,
        state_names,
        steps,
        keys,
        param_groups,
    }
}

fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {} ({n} B)", UNITS[u])
    }
}

fn fmt_tensor(t: &TensorInfo) -> String {
    let mut s = format!("{} {:?}", t.dtype, t.shape);
    if let Some(layout) = &t.layout {
        s.push_str(&format!(" ({layout})"));
    }
    if let Some(v) = &t.value {
        s.push_str(&format!(" = {v}"));
    }
    s
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Optimizer => "optimizer state dict",
            Kind::Model => "model state dict",
            Kind::Other => "other object",
        };
        writeln!(f, "kind: {kind}")?;
        if let Some(t) = self.root_type {
            writeln!(f, "root type: {t}")?;
        }
        if let Some(o) = &self.optimizer {
            writeln!(
                f,
                "state: {} keys (key types: {})",
                o.keys.len(),
                if o.key_types.is_empty() {
                    "-".to_string()
                } else {
                    o.key_types.join(", ")
                }
            )?;
            writeln!(f, "state names: {}", o.state_names.join(", "))?;
            if !o.steps.is_empty() {
                let steps: Vec<String> = o
                    .steps
                    .iter()
                    .map(|s| format!("{} ({} keys)", s.value, s.keys))
                    .collect();
                writeln!(f, "steps: {}", steps.join(", "))?;
            }
            for k in &o.keys {
                writeln!(f, "  [{}] {}", k.key_type, k.key)?;
                for e in &k.state {
                    match (&e.tensor, &e.value) {
                        (Some(t), _) => writeln!(f, "      {}: {}", e.name, fmt_tensor(t))?,
                        (None, Some(v)) => writeln!(f, "      {}: {} {v}", e.name, e.kind)?,
                        (None, None) => writeln!(f, "      {}: {}", e.name, e.kind)?,
                    }
                }
            }
            match &o.param_groups {
                None => writeln!(f, "param_groups: absent")?,
                Some(gs) => {
                    writeln!(f, "param_groups: {}", gs.len())?;
                    for (i, g) in gs.iter().enumerate() {
                        let opts: Vec<String> =
                            g.options.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        let params: Vec<String> = g.params.iter().map(Json::to_string).collect();
                        writeln!(f, "  [{i}] {}", opts.join(" "))?;
                        writeln!(
                            f,
                            "      params ({}): [{}]",
                            params.len(),
                            params.join(", ")
                        )?;
                    }
                }
            }
        }
        if let Some(ts) = &self.tensors {
            for t in ts {
                writeln!(f, "  {}  {}", t.name, fmt_tensor(t))?;
            }
        }
        writeln!(f, "tensors: {}", self.tensor_count)?;
        write!(
            f,
            "total tensor bytes: {}",
            human_bytes(self.total_tensor_bytes)
        )
    }
}
