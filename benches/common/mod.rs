//! Synthetic optimizer state shared by the benches.
#![allow(dead_code)] // each bench uses a different subset

use fsdp::{DType, HostTensor, ModelDesc, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use indexmap::IndexMap;

/// A parameter-shaped f32 tensor with cheap deterministic values.
pub fn filled(shape: &[usize], seed: f32) -> HostTensor {
    let mut t = HostTensor::zeros(DType::F32, shape);
    for (k, x) in t.as_mut_slice::<f32>().expect("f32").iter_mut().enumerate() {
        *x = seed + (k % 4096) as f32 * 1e-4;
    }
    t
}

/// The full (unflattened, name-keyed) Adam state dict of `model`, as after one step.
pub fn full_adam_state(model: &ModelDesc) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let mut st = ParamState::new();
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(1.0f32)));
        st.insert("exp_avg".into(), Value::Tensor(filled(&p.shape, i as f32)));
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(filled(&p.shape, 0.5 + i as f32)),
        );
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    let options: IndexMap<String, Value> = [
        ("lr", Value::Float(1e-3)),
        (
            "betas",
            Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
        ),
        ("eps", Value::Float(1e-8)),
        ("weight_decay", Value::Float(0.0)),
        ("amsgrad", Value::Bool(false)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let params = model
        .params
        .iter()
        .map(|p| ParamKey::Name(p.name.clone()))
        .collect();
    sd.param_groups = Some(vec![ParamGroup { options, params }]);
    sd
}

/// A copy that owns its storage, as an optimizer's own state does (shard results are views
/// into the full dict).
pub fn deep_copy(osd: &OptimStateDict) -> OptimStateDict {
    osd.try_map(|t: &HostTensor| HostTensor::from_bytes(t.dtype(), t.shape(), t.as_bytes()))
        .expect("copying a host tensor")
}

/// A field of `/proc/self/status` (`VmRSS:`, `VmHWM:`) in bytes; 0 when unreadable.
pub fn status_bytes(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k * 1024)
        .unwrap_or(0)
}

/// Resets this process's VmHWM to its current RSS (Linux `clear_refs` 5); whether it worked.
pub fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The 1-, 5- and 15-minute load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}
