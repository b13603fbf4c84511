//! What ranks exchange before moving tensors: a digest of the layout and, per optimizer key,
//! the state names with their kinds, shapes, dtypes and scalar values. One object all-gather
//! lets every rank check agreement and detect a mismatch identically, so all ranks fail
//! together with the same typed error instead of hanging or mis-gathering.

use super::keys::OptimStateKey;
use super::{ParamState, Value};
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::tensor::{DType, HostTensor, Tensor};
use serde::{Deserialize, Serialize};

/// Description of one state value that every rank can see.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StateInfo {
    /// A positive-dim tensor (its bytes are gathered later).
    Tensor {
        /// Shape.
        shape: Vec<usize>,
        /// Dtype.
        dtype: DType,
    },
    /// A 0-dim tensor or a plain value, carried whole.
    Scalar(Value<HostTensor>),
}

impl StateInfo {
    /// Describes a value.
    pub fn of<T: Tensor>(v: &Value<T>) -> Result<Self> {
        Ok(match v {
            Value::Tensor(t) if t.dim() > 0 => StateInfo::Tensor {
                shape: t.shape(),
                dtype: t.dtype(),
            },
            Value::Sharded(s) => StateInfo::Tensor {
                shape: s.global_shape.clone(),
                dtype: s.local.as_ref().map_or(DType::F32, |t| t.dtype()),
            },
            other => StateInfo::Scalar(other.try_map(&mut |t: &T| t.to_host())?),
        })
    }

    /// Number of elements of a tensor state (0 for scalars).
    pub fn numel(&self) -> usize {
        match self {
            StateInfo::Tensor { shape, .. } => shape.iter().product(),
            StateInfo::Scalar(_) => 0,
        }
    }
}

/// One optimizer key with its state description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyInfo {
    /// The rank-independent key.
    pub key: OptimStateKey,
    /// State names and descriptions, in the dict's order.
    pub states: Vec<(String, StateInfo)>,
}

impl KeyInfo {
    /// Describes one parameter's state.
    pub fn of<T: Tensor>(key: &OptimStateKey, st: &ParamState<T>) -> Result<Self> {
        Ok(KeyInfo {
            key: key.clone(),
            states: st
                .iter()
                .map(|(n, v)| Ok((n.clone(), StateInfo::of(v)?)))
                .collect::<Result<_>>()?,
        })
    }

    /// The description of state `name`.
    pub fn get(&self, name: &str) -> Option<&StateInfo> {
        self.states.iter().find(|(n, _)| n == name).map(|(_, i)| i)
    }
}

/// The per-rank message of the plan agreement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanMsg {
    /// Digest of operation name, model, policy and world size.
    pub digest: u64,
    /// Keys with state on this rank, in optimizer order.
    pub keys: Vec<KeyInfo>,
}

/// 64-bit FNV-1a.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Digest of what must be identical on every rank for `op` to be valid.
pub fn layout_digest(op: &str, layout: &ModelLayout) -> Result<u64> {
    let bytes =
        crate::collectives::encode(&(op, &layout.model, &layout.policy, layout.world_size))?;
    Ok(fnv1a(&bytes))
}

/// Fails on every rank alike when some rank's digest differs from rank 0's.
pub fn check_digests(op: &str, digests: &[u64]) -> Result<()> {
    let ranks: Vec<usize> = (0..digests.len())
        .filter(|&r| digests[r] != digests[0])
        .collect();
    if ranks.is_empty() {
        return Ok(());
    }
    Err(Error::PlanMismatch {
        op: op.into(),
        reference: 0,
        ranks,
        detail: "the operation, model description, wrapping policy or world size differs".into(),
    })
}
