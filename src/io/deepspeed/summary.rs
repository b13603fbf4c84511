//! What `fsdp-ckpt inspect` shows of a DeepSpeed checkpoint, from its structure alone.

use super::{Buffer, DeepSpeedCheckpoint, Form, FrozenParam, State, Wrapper};
use crate::io::torch_save::PyObj;
use serde::Serialize;

/// What a DeepSpeed checkpoint holds, from its structure alone (`fsdp-ckpt inspect`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// `"deepspeed"` (what `fsdp-ckpt inspect --json` names every input's format by).
    pub format: &'static str,
    /// The tag directory.
    pub dir: String,
    /// ZeRO or universal.
    pub form: Form,
    /// The ZeRO stage.
    pub stage: u8,
    /// The model dtype (`torch.bfloat16`, …).
    pub dtype: String,
    /// The data-parallel world size.
    pub world_size: usize,
    /// The tag.
    pub tag: String,
    /// The optimizer wrapper.
    pub optimizer: Wrapper,
    /// The files read.
    pub files: Vec<String>,
    /// Per trained parameter: name, shape, group, states and step.
    pub params: Vec<ParamSummary>,
    /// The frozen parameters (`requires_grad=False`: no optimizer state), each with its
    /// shape and dtype (the model's).
    pub frozen: Vec<FrozenParam>,
    /// The param groups: hyper-parameters and members.
    pub param_groups: Vec<serde_json::Value>,
    /// The persistent buffers.
    pub buffers: Vec<Buffer>,
    /// Tied aliases: alias → parameter.
    pub tied: Vec<(String, String)>,
    /// Bytes of float32 tensors of the parameters' states (master weights and Adam's).
    pub state_bytes: u64,
}

/// One parameter in a [`Summary`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParamSummary {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its param group.
    pub group: usize,
    /// The states it has (`fp32`, `exp_avg`, `exp_avg_sq`, all float32 of its shape).
    pub states: Vec<State>,
    /// Adam's `step`.
    pub step: Option<f64>,
}

impl Summary {
    pub(super) fn of(c: &DeepSpeedCheckpoint) -> Summary {
        let params: Vec<ParamSummary> = c
            .params
            .iter()
            .zip(&c.steps)
            .map(|(p, s)| ParamSummary {
                name: p.name.clone(),
                shape: p.shape.clone(),
                group: p.group,
                states: State::ALL.to_vec(),
                step: s.item(),
            })
            .collect();
        Summary {
            format: "deepspeed",
            dir: c.dir.display().to_string(),
            form: c.form,
            stage: c.stage,
            dtype: c.dtype.torch_name().to_string(),
            world_size: c.world_size,
            tag: c.tag.clone(),
            optimizer: c.wrapper,
            files: c
                .files
                .iter()
                .map(|f| f.strip_prefix(&c.dir).unwrap_or(f).display().to_string())
                .collect(),
            state_bytes: c.fp32_bytes() * State::ALL.len() as u64,
            params,
            frozen: c.frozen.clone(),
            param_groups: c
                .groups
                .iter()
                .map(|g| {
                    let hyper: serde_json::Map<String, serde_json::Value> = g
                        .hyperparameters
                        .iter()
                        .map(|(k, v)| (k.clone(), value_json(v)))
                        .collect();
                    serde_json::json!({"hyperparameters": hyper, "members": g.members})
                })
                .collect(),
            buffers: c.buffers.clone(),
            tied: c.aliases.clone(),
        }
    }
}

/// A hyper-parameter as JSON: numbers, bools, strings, `null`, lists for tuples and lists;
/// anything else as its description.
fn value_json(v: &PyObj) -> serde_json::Value {
    use serde_json::json;
    match v {
        PyObj::None => json!(null),
        PyObj::Bool(b) => json!(b),
        PyObj::Int(i) => json!(i),
        PyObj::Float(x) if x.is_finite() => json!(x),
        PyObj::Float(x) => json!(x.to_string()),
        PyObj::Str(s) => json!(s),
        PyObj::List(items) | PyObj::Tuple(items) => {
            serde_json::Value::Array(items.iter().map(value_json).collect())
        }
        other => json!(other.describe()),
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let form = match self.form {
            Form::Zero => "DeepSpeed ZeRO checkpoint",
            Form::Universal => "DeepSpeed universal checkpoint",
        };
        writeln!(f, "{form}: {} (tag {})", self.dir, self.tag)?;
        writeln!(
            f,
            "ZeRO stage {}, model dtype {}, world size {}, optimizer {}",
            self.stage,
            self.dtype,
            self.world_size,
            self.optimizer.name()
        )?;
        writeln!(
            f,
            "{} parameters, {} bytes of float32 state (fp32 master, exp_avg, exp_avg_sq)",
            self.params.len(),
            self.state_bytes
        )?;
        writeln!(f, "files:")?;
        for file in &self.files {
            writeln!(f, "  {file}")?;
        }
        writeln!(f, "param groups:")?;
        for (i, g) in self.param_groups.iter().enumerate() {
            writeln!(f, "  {i}: {}", g["hyperparameters"])?;
        }
        writeln!(
            f,
            "parameters (states fp32, exp_avg, exp_avg_sq: float32 of the shape; step):"
        )?;
        for p in &self.params {
            let step = p.step.map_or("-".to_string(), |s| s.to_string());
            writeln!(
                f,
                "  {} {:?} group {} step {step}",
                p.name, p.shape, p.group
            )?;
        }
        if !self.frozen.is_empty() {
            writeln!(
                f,
                "frozen parameters (requires_grad=False: no optimizer state; weights in their dtype):"
            )?;
            for p in &self.frozen {
                writeln!(f, "  {} {} {:?}", p.name, p.dtype.torch_name(), p.shape)?;
            }
        }
        if !self.buffers.is_empty() {
            writeln!(f, "buffers:")?;
            for b in &self.buffers {
                writeln!(f, "  {} {} {:?}", b.name, b.dtype.torch_name(), b.shape)?;
            }
        }
        if !self.tied.is_empty() {
            writeln!(f, "tied:")?;
            for (alias, primary) in &self.tied {
                writeln!(f, "  {alias} = {primary}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyperparameters_as_json() {
        let betas = PyObj::Tuple(vec![PyObj::Float(0.9), PyObj::Float(0.95)]);
        assert_eq!(value_json(&betas), serde_json::json!([0.9, 0.95]));
        assert_eq!(value_json(&PyObj::None), serde_json::Value::Null);
    }
}
