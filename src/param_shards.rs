//! Parameter sharding: the tensors one rank's optimizer steps on, cut from full parameter
//! values with the layout — a flat shard per flat parameter (`use_orig_params=False`), the 1-D
//! view of the rank's elements per managed original parameter (`use_orig_params=True`), the
//! whole tensor per unmanaged parameter. Gradients are cut the same way.

use crate::error::{Error, Result};
use crate::flat_param::{shard_from_members, ModelLayout};
use crate::optim_state::keys::Resolved;
use crate::optim_state::OptimParams;
use crate::tensor::HostTensor;

fn check_full(layout: &ModelLayout, full: &[Option<HostTensor>]) -> Result<()> {
    if full.len() != layout.model.params.len() {
        return Err(Error::InvalidModel(format!(
            "expected {} full tensors (one per model parameter), got {}",
            layout.model.params.len(),
            full.len()
        )));
    }
    for (p, t) in layout.model.params.iter().zip(full) {
        if let Some(t) = t {
            if t.shape() != p.shape.as_slice() || t.dtype() != p.dtype {
                return Err(Error::ShapeMismatch {
                    context: format!(
                        "full tensor of parameter `{}` ({} expected, {} given)",
                        p.name,
                        p.dtype,
                        t.dtype()
                    ),
                    expected: p.shape.clone(),
                    found: t.shape().to_vec(),
                });
            }
        }
    }
    Ok(())
}

/// Rank `rank`'s tensor for every parameter of `params` (in id order), cut from `full`
/// (one tensor per model parameter, `None` meaning "no value", e.g. no gradient).
///
/// A flat parameter's slot is `None` only when none of its members has a value; missing
/// members are zeros. Original parameters with no element on this rank get `None`, as FSDP
/// leaves their gradient unset.
pub fn shard_tensors(
    layout: &ModelLayout,
    rank: usize,
    params: &OptimParams,
    full: &[Option<HostTensor>],
) -> Result<Vec<Option<HostTensor>>> {
    check_full(layout, full)?;
    let local = layout.local_params(params)?;
    local
        .iter()
        .map(|l| match l.resolved {
            Resolved::Flat(f) => {
                let fl = &layout.flat_params[f];
                if fl.members.iter().all(|m| full[m.param_index].is_none()) {
                    return Ok(None);
                }
                shard_from_members(fl, rank, fl.dtype, |m| {
                    full[fl.members[m].param_index].as_ref().map(|t| (t, 0))
                })
                .map(Some)
            }
            Resolved::Orig { param, owner: None } => Ok(full[param].clone()),
            Resolved::Orig {
                param,
                owner: Some((f, m)),
            } => {
                let fl = &layout.flat_params[f];
                let info = fl.shard(rank).params[m];
                match &full[param] {
                    Some(t) if info.in_shard && fl.sharded => t
                        .narrow_flat(info.intra_param_start_idx, info.numel_in_shard)
                        .map(Some),
                    Some(t) if info.in_shard => Ok(Some(t.clone())),
                    _ => Ok(None),
                }
            }
        })
        .collect()
}

#[cfg(feature = "fault-injection")]
pub use synthetic::{synthetic_grads, synthetic_params, synthetic_values};

/// Deterministic test data (feature `fault-injection`): parameter values and gradients that
/// are the same for a parameter whatever the wrapping or world size.
#[cfg(feature = "fault-injection")]
mod synthetic {
    use crate::flat_param::ModelLayout;
    use crate::model::ParamDesc;
    use crate::tensor::{DType, HostTensor};

    /// Deterministic pseudo-random values for `spec` at `step`: the same for a parameter whatever
    /// the wrapping or world size, so wrapped and unwrapped runs see identical gradients.
    pub fn synthetic_values(spec: &ParamDesc, step: usize) -> HostTensor {
        let salt = spec
            .name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
            % 1000;
        let n = spec.numel();
        let vals: Vec<f64> = (0..n)
            .map(|i| ((i as f64) * 0.37 + (step as f64) * 1.3 + (salt as f64) * 0.11).sin())
            .collect();
        match spec.dtype {
            DType::F64 => HostTensor::from_slice(&vals, &spec.shape),
            DType::F16 => HostTensor::from_slice(
                &vals
                    .iter()
                    .map(|&v| half::f16::from_f64(v))
                    .collect::<Vec<_>>(),
                &spec.shape,
            ),
            DType::BF16 => HostTensor::from_slice(
                &vals
                    .iter()
                    .map(|&v| half::bf16::from_f64(v))
                    .collect::<Vec<_>>(),
                &spec.shape,
            ),
            _ => HostTensor::from_slice(
                &vals.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                &spec.shape,
            ),
        }
        .expect("shape matches by construction")
    }

    /// Synthetic gradients of every model parameter at `step` (`None` for frozen parameters).
    pub fn synthetic_grads(layout: &ModelLayout, step: usize) -> Vec<Option<HostTensor>> {
        layout
            .model
            .params
            .iter()
            .map(|p| p.requires_grad.then(|| synthetic_values(p, step + 1000)))
            .collect()
    }

    /// Synthetic initial values of every model parameter.
    pub fn synthetic_params(layout: &ModelLayout) -> Vec<Option<HostTensor>> {
        layout
            .model
            .params
            .iter()
            .map(|p| Some(synthetic_values(p, 0)))
            .collect()
    }
}
