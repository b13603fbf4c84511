//! Conversions between [`PyObj`] and the crate's state dicts.

use super::pyobj::{PyObj, TensorValue};
use crate::error::{Error, Result};
use crate::optim_state::{OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::tensor::HostTensor;
use indexmap::IndexMap;

/// A model state dict as a file holds it (`torch.save(module.state_dict())`): parameter and
/// buffer names to tensors, in order, with PyTorch's `_metadata`. The live API's dict of
/// values is [`crate::state_dict::ModelStateDict`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SavedModelStateDict {
    /// Name → tensor, in the module's order.
    pub tensors: IndexMap<String, HostTensor>,
    /// The `_metadata` attribute PyTorch attaches to the `OrderedDict` (module prefix →
    /// `{"version": n}`), kept as read so that it survives a round trip; `None` if absent.
    pub metadata: Option<PyObj>,
}

fn unexpected(path: &str, expected: &str, found: &PyObj) -> Error {
    Error::UnexpectedObject {
        path: path.to_string(),
        expected: expected.to_string(),
        found: found.describe(),
    }
}

fn key_path(key: &PyObj) -> String {
    match key {
        PyObj::Str(s) => format!("{s:?}"),
        PyObj::Int(i) => i.to_string(),
        other => other.describe(),
    }
}

/// The items of a `dict` or `OrderedDict` (attributes of an `OrderedDict` are ignored).
fn into_items(obj: PyObj, path: &str) -> Result<Vec<(PyObj, PyObj)>> {
    match obj {
        PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => Ok(items),
        other => Err(unexpected(path, "a dict", &other)),
    }
}

fn into_str_key(k: PyObj, path: &str) -> Result<String> {
    match k {
        PyObj::Str(s) => Ok(s),
        other => Err(unexpected(path, "a str key", &other)),
    }
}

fn param_key_from(k: PyObj, path: &str) -> Result<ParamKey> {
    match k {
        PyObj::Int(i) if i >= 0 => usize::try_from(i)
            .map(ParamKey::Id)
            .map_err(|_| unexpected(path, "a parameter id", &PyObj::Int(i))),
        PyObj::Str(s) => Ok(ParamKey::Name(s)),
        other => Err(unexpected(
            path,
            "a parameter id (int >= 0) or name (str)",
            &other,
        )),
    }
}

fn param_key_to(k: &ParamKey) -> Result<PyObj> {
    Ok(match k {
        ParamKey::Id(i) => PyObj::Int(i64::try_from(*i).map_err(|_| Error::UnexpectedObject {
            path: "parameter key".into(),
            expected: "an id that fits in a Python int of 64 bits".into(),
            found: i.to_string(),
        })?),
        ParamKey::Name(n) => PyObj::Str(n.clone()),
    })
}

fn value_from(obj: PyObj, path: &str) -> Result<Value> {
    Ok(match obj {
        PyObj::None => Value::None,
        PyObj::Bool(b) => Value::Bool(b),
        PyObj::Int(i) => Value::Int(i),
        PyObj::Float(x) => Value::Float(x),
        PyObj::Str(s) => Value::Str(s),
        PyObj::Tensor(t) => Value::Tensor(t),
        PyObj::RichTensor(r) => match r.value {
            TensorValue::Dense(t) => Value::Tensor(t),
            _ => return Err(unexpected(path, "a dense tensor", &PyObj::RichTensor(r))),
        },
        PyObj::Sharded(s) => Value::Sharded(*s),
        // A state dict's values have no torch.Size: one reads as the tuple it is a subclass of.
        PyObj::Size(v) => Value::Tuple(v.into_iter().map(Value::Int).collect()),
        PyObj::Tuple(v) => Value::Tuple(
            v.into_iter()
                .enumerate()
                .map(|(i, x)| value_from(x, &format!("{path}[{i}]")))
                .collect::<Result<_>>()?,
        ),
        PyObj::List(v) => Value::List(
            v.into_iter()
                .enumerate()
                .map(|(i, x)| value_from(x, &format!("{path}[{i}]")))
                .collect::<Result<_>>()?,
        ),
        other => {
            return Err(unexpected(
                path,
                "None, bool, int (64-bit), float, str, tensor, tuple or list",
                &other,
            ))
        }
    })
}

/// The Python object of one state value or hyper-parameter (`path` names it in errors).
pub fn value_to_pyobj(v: &Value, path: &str) -> Result<PyObj> {
    value_to(v, path)
}

fn value_to(v: &Value, path: &str) -> Result<PyObj> {
    Ok(match v {
        Value::None => PyObj::None,
        Value::Bool(b) => PyObj::Bool(*b),
        Value::Int(i) => PyObj::Int(*i),
        Value::Float(x) => PyObj::Float(*x),
        Value::Str(s) => PyObj::Str(s.clone()),
        Value::Tensor(t) => PyObj::Tensor(t.clone()),
        Value::Sharded(_) => {
            return Err(Error::Unsupported(format!(
                "{path}: a sharded tensor (SHARDED_STATE_DICT) cannot be written to a torch.save file; consolidate it first"
            )))
        }
        Value::Tuple(xs) => PyObj::Tuple(
            xs.iter()
                .enumerate()
                .map(|(i, x)| value_to(x, &format!("{path}[{i}]")))
                .collect::<Result<_>>()?,
        ),
        Value::List(xs) => PyObj::List(
            xs.iter()
                .enumerate()
                .map(|(i, x)| value_to(x, &format!("{path}[{i}]")))
                .collect::<Result<_>>()?,
        ),
    })
}

fn state_map_from(obj: PyObj, path: &str) -> Result<ParamState> {
    let mut out = ParamState::new();
    for (k, v) in into_items(obj, path)? {
        let name = into_str_key(k, &format!("{path} key"))?;
        let value = value_from(v, &format!("{path}[{name:?}]"))?;
        out.insert(name, value);
    }
    Ok(out)
}

fn state_map_to(s: &ParamState, path: &str) -> Result<Vec<(PyObj, PyObj)>> {
    s.iter()
        .map(|(k, v)| {
            Ok((
                PyObj::Str(k.clone()),
                value_to(v, &format!("{path}[{k:?}]"))?,
            ))
        })
        .collect()
}

/// Converts an optimizer state dict to the Python object `optimizer.state_dict()` returns:
/// `{"state": {key: {name: value}}, "param_groups": [{option: value, ..., "params": [...]}]}`
/// (`param_groups` omitted when absent; `params` last in each group, as PyTorch writes it).
///
/// Fails for sharded tensors (`Value::Sharded`), which have no `torch.save` form here.
pub fn optim_to_pyobj(osd: &OptimStateDict) -> Result<PyObj> {
    let mut state = Vec::with_capacity(osd.state.len());
    for (k, s) in &osd.state {
        let path = format!("state[{k}]");
        state.push((param_key_to(k)?, PyObj::Dict(state_map_to(s, &path)?)));
    }
    let mut top = vec![(PyObj::Str("state".into()), PyObj::Dict(state))];
    if let Some(groups) = &osd.param_groups {
        let mut out = Vec::with_capacity(groups.len());
        for (i, g) in groups.iter().enumerate() {
            let path = format!("param_groups[{i}]");
            if g.options.contains_key("params") {
                return Err(Error::UnexpectedObject {
                    path: format!("{path}.options"),
                    expected: "hyper-parameters without a `params` entry".into(),
                    found: "an option named `params`".into(),
                });
            }
            let mut items = state_map_to(&g.options, &path)?;
            let params = g.params.iter().map(param_key_to).collect::<Result<_>>()?;
            items.push((PyObj::Str("params".into()), PyObj::List(params)));
            out.push(PyObj::Dict(items));
        }
        top.push((PyObj::Str("param_groups".into()), PyObj::List(out)));
    }
    Ok(PyObj::Dict(top))
}

/// Converts the Python object of an optimizer state dict (as [`optim_to_pyobj`] describes it;
/// `dict` or `OrderedDict` at every level) to an [`OptimStateDict`].
///
/// `state` is required, `param_groups` optional, and no other top-level key is accepted.
/// State keys must be `int >= 0` or `str`; values must be `None`, `bool`, 64-bit `int`,
/// `float`, `str`, tensors, or tuples and lists of those.
pub fn optim_from_pyobj(obj: PyObj) -> Result<OptimStateDict> {
    let mut state = None;
    let mut param_groups = None;
    for (k, v) in into_items(obj, "<root>")? {
        match k {
            PyObj::Str(s) if s == "state" => {
                let mut out = IndexMap::new();
                for (pk, ps) in into_items(v, "state")? {
                    let path = format!("state[{}]", key_path(&pk));
                    let key = param_key_from(pk, &format!("{path} (key)"))?;
                    out.insert(key, state_map_from(ps, &path)?);
                }
                state = Some(out);
            }
            PyObj::Str(s) if s == "param_groups" => {
                let groups = match v {
                    PyObj::List(g) | PyObj::Tuple(g) => g,
                    other => return Err(unexpected("param_groups", "a list", &other)),
                };
                let mut out = Vec::with_capacity(groups.len());
                for (i, g) in groups.into_iter().enumerate() {
                    let path = format!("param_groups[{i}]");
                    let mut options = IndexMap::new();
                    let mut params = None;
                    for (ok, ov) in into_items(g, &path)? {
                        let name = into_str_key(ok, &format!("{path} key"))?;
                        let vpath = format!("{path}[{name:?}]");
                        if name == "params" {
                            let keys = match ov {
                                PyObj::List(ks) | PyObj::Tuple(ks) => ks,
                                other => return Err(unexpected(&vpath, "a list", &other)),
                            };
                            params = Some(
                                keys.into_iter()
                                    .enumerate()
                                    .map(|(j, pk)| param_key_from(pk, &format!("{vpath}[{j}]")))
                                    .collect::<Result<Vec<_>>>()?,
                            );
                        } else {
                            options.insert(name, value_from(ov, &vpath)?);
                        }
                    }
                    let params = params.ok_or_else(|| Error::UnexpectedObject {
                        path: path.clone(),
                        expected: "a `params` entry".into(),
                        found: "none".into(),
                    })?;
                    out.push(ParamGroup { options, params });
                }
                param_groups = Some(out);
            }
            other => {
                return Err(unexpected(
                    &format!("<root>[{}]", key_path(&other)),
                    "only the keys 'state' and 'param_groups'",
                    &other,
                ))
            }
        }
    }
    let state = state.ok_or_else(|| Error::UnexpectedObject {
        path: "<root>".into(),
        expected: "an optimizer state dict with a 'state' key".into(),
        found: "no 'state' key".into(),
    })?;
    Ok(OptimStateDict {
        state,
        param_groups,
    })
}

/// Converts a model state dict to the `collections.OrderedDict` `module.state_dict()` returns,
/// with its `_metadata` attribute when there is one.
pub fn model_to_pyobj(msd: &SavedModelStateDict) -> PyObj {
    PyObj::OrderedDict {
        items: msd
            .tensors
            .iter()
            .map(|(k, t)| (PyObj::Str(k.clone()), PyObj::Tensor(t.clone())))
            .collect(),
        attrs: msd
            .metadata
            .iter()
            .map(|m| ("_metadata".to_string(), m.clone()))
            .collect(),
    }
}

/// Converts a `dict` or `OrderedDict` of name → tensor to a [`SavedModelStateDict`].
///
/// Every value must be a tensor (a module's non-tensor extra state is rejected, naming the
/// key); attributes other than `_metadata` are rejected too.
pub fn model_from_pyobj(obj: PyObj) -> Result<SavedModelStateDict> {
    let (items, attrs) = match obj {
        PyObj::Dict(items) => (items, Vec::new()),
        PyObj::OrderedDict { items, attrs } => (items, attrs),
        other => return Err(unexpected("<root>", "a dict of tensors", &other)),
    };
    let mut out = SavedModelStateDict::default();
    for (k, v) in items {
        let name = into_str_key(k, "<root> key")?;
        match v {
            PyObj::Tensor(t) => {
                out.tensors.insert(name, t);
            }
            // FSDP1's full state dict marks its tensors with `_has_been_cloned`; the values
            // are what a model state dict holds.
            PyObj::RichTensor(r) if matches!(r.value, TensorValue::Dense(_)) => {
                if let TensorValue::Dense(t) = r.value {
                    out.tensors.insert(name, t);
                }
            }
            other => return Err(unexpected(&format!("[{name:?}]"), "a dense tensor", &other)),
        }
    }
    for (k, v) in attrs {
        if k == "_metadata" {
            out.metadata = Some(v);
        } else {
            return Err(Error::UnexpectedObject {
                path: format!("<root>.{k}"),
                expected: "no attribute other than `_metadata`".into(),
                found: v.describe(),
            });
        }
    }
    Ok(out)
}
