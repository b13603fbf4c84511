//! `torch.distributed.checkpoint.state_dict` for optimizer state (layer 9): one API,
//! [`OptimStateDictApi`], over FSDP1 ([`crate::Fsdp`], flat parameters) and FSDP2
//! ([`FullyShardedModel`], per-parameter dim-0 shards), with [`StateDictOptions`].
//!
//! PyTorch deprecates FSDP1's own optimizer-state functions in favour of
//! `get_optimizer_state_dict` / `set_optimizer_state_dict`, which serve both generations:
//! - `get` turns a rank's local `optim.state_dict()` into a dict keyed by parameter names
//!   (FQNs), param groups listing names: sharded (each tensor state this rank's piece of the
//!   whole, as DCP saves it) or, with `full_state_dict`, whole tensors (on rank 0 only with
//!   `cpu_offload`, where the crate gathers to rank 0 so bytes move once);
//! - `set` turns such a dict back into the local dict this rank's optimizer loads; with
//!   `broadcast_from_rank0` only rank 0 holds the full dict and every other rank receives
//!   only its own rows.
//!
//! The crate does not own the optimizer: `get` takes the local dict, `set` returns it, and
//! [`OptimStateDictApi::verify_optim_state_dict_by_load`] is PyTorch's
//! `_verify_osd_by_load` check of the round trip.

mod fsdp1;
mod fsdp2;

pub use fsdp2::FullyShardedModel;

use crate::error::{Error, Result};
use crate::optim_state::{OptimParams, OptimStateDict, ParamKey, Value};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// `StateDictOptions`: how `get_*` and `set_*` work. `Default` is PyTorch's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDictOptions {
    /// Whole tensors instead of each rank's piece.
    pub full_state_dict: bool,
    /// With `full_state_dict`, only rank 0 gets the dict (the others get an empty one), as
    /// PyTorch's CPU offload does to avoid holding it on every rank.
    pub cpu_offload: bool,
    /// Leave frozen parameters out (model state dicts; optimizer state has none for them).
    pub ignore_frozen_params: bool,
    /// `set_*`: a trained parameter without state in the loaded dict is an error.
    pub strict: bool,
    /// `set_*` with `full_state_dict`: only rank 0 passes the dict; the others receive their
    /// own parts of it.
    pub broadcast_from_rank0: bool,
    /// PyTorch's flattened `{"state.<fqn>.<name>": ...}` form. Not supported: the crate's
    /// dicts are nested; use [`crate::io::dcp`] for flattened keys on disk.
    pub flatten_optimizer_state_dict: bool,
}

impl Default for StateDictOptions {
    fn default() -> Self {
        StateDictOptions {
            full_state_dict: false,
            cpu_offload: false,
            ignore_frozen_params: false,
            strict: true,
            broadcast_from_rank0: false,
            flatten_optimizer_state_dict: false,
        }
    }
}

impl StateDictOptions {
    /// `StateDictOptions(full_state_dict=True)`.
    pub fn full() -> Self {
        StateDictOptions {
            full_state_dict: true,
            ..Self::default()
        }
    }

    /// PyTorch's `_verify_options` checks that concern the optimizer.
    fn check(&self, op: &str, rank: usize) -> Result<()> {
        let bad = |reason: &str| Error::InvalidArgument {
            op: op.into(),
            rank,
            reason: reason.into(),
        };
        if self.broadcast_from_rank0 && !self.full_state_dict {
            return Err(bad(
                "broadcast_from_rank0 needs full_state_dict (only a full dict can be broadcast)",
            ));
        }
        if self.flatten_optimizer_state_dict {
            return Err(Error::Unsupported(
                "flatten_optimizer_state_dict: the crate's optimizer state dicts are nested (DCP's flattened keys are read and written by fsdp::io::dcp)".into(),
            ));
        }
        Ok(())
    }
}

/// A rank passed no dict where it must (only `broadcast_from_rank0` lets ranks other than 0
/// pass none).
fn missing_dict(op: &str, rank: usize) -> Error {
    Error::InvalidArgument {
        op: op.into(),
        rank,
        reason: "this rank must pass the dict (only broadcast_from_rank0 lets ranks other than 0 pass none)".into(),
    }
}

/// `get_optimizer_state_dict` / `set_optimizer_state_dict` on one rank of a wrapped model.
/// Every method is collective: all ranks call it with the same options.
pub trait OptimStateDictApi {
    /// `get_optimizer_state_dict(model, optim, options)`: this rank's local optimizer state
    /// dict `optim` (keyed by ids of `params`) as a dict keyed by parameter names (see the
    /// module docs for the sharded and full forms). With `full_state_dict` and `cpu_offload`,
    /// ranks other than 0 get an empty dict (no state, no param groups).
    fn get_optimizer_state_dict<T: Tensor>(
        &self,
        optim: &OptimStateDict<T>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<OptimStateDict<T>>;

    /// `set_optimizer_state_dict(model, optim, osd, options)`: the local dict this rank's
    /// optimizer (holding `params`) loads, from a dict made by
    /// [`OptimStateDictApi::get_optimizer_state_dict`] with the same `full_state_dict`,
    /// possibly at another world size (full dicts). With `broadcast_from_rank0`, ranks other
    /// than 0 pass `None`.
    fn set_optimizer_state_dict<T: Tensor>(
        &self,
        osd: Option<&OptimStateDict<T>>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<OptimStateDict<T>>;

    /// PyTorch's `_verify_osd_by_load`: gets the full dict of `optim`, loads it into a fresh
    /// optimizer holding `params` and checks that the fresh optimizer's local dict equals
    /// `optim` (every key, state and param-group option, tensors bit for bit; orders may
    /// differ, as in PyTorch's dict comparison). [`Error::PlanMismatch`] names the first
    /// difference.
    fn verify_optim_state_dict_by_load<T: Tensor>(
        &self,
        optim: &OptimStateDict<T>,
        params: &OptimParams,
    ) -> Result<()> {
        let full = StateDictOptions::full();
        let gathered = self.get_optimizer_state_dict(optim, params, &full)?;
        let loaded = self.set_optimizer_state_dict(Some(&gathered), params, &full)?;
        match first_difference(optim, &loaded) {
            None => Ok(()),
            Some(detail) => Err(Error::PlanMismatch {
                op: "verify_optim_state_dict_by_load".into(),
                reference: 0,
                ranks: vec![],
                detail: format!("the reloaded optimizer differs from the original: {detail}"),
            }),
        }
    }
}

/// The first difference between two local dicts, ignoring orders.
fn first_difference<T: Tensor>(a: &OptimStateDict<T>, b: &OptimStateDict<T>) -> Option<String> {
    let key = |k: &ParamKey| k.to_string();
    for (k, sa) in &a.state {
        let Some(sb) = b.state.get(k) else {
            return Some(format!("key {} is missing", key(k)));
        };
        for (name, va) in sa {
            match sb.get(name) {
                None => return Some(format!("state `{name}` of key {} is missing", key(k))),
                Some(vb) if !value_eq(va, vb) => {
                    return Some(format!("state `{name}` of key {} differs", key(k)))
                }
                Some(_) => {}
            }
        }
        if sb.len() != sa.len() {
            return Some(format!("key {} has other state names", key(k)));
        }
    }
    if let Some(k) = b.state.keys().find(|k| !a.state.contains_key(*k)) {
        return Some(format!("key {} is new", key(k)));
    }
    let (ga, gb) = (
        a.param_groups.as_deref().unwrap_or_default(),
        b.param_groups.as_deref().unwrap_or_default(),
    );
    if ga.len() != gb.len() {
        return Some(format!("{} param groups against {}", gb.len(), ga.len()));
    }
    for (g, (x, y)) in ga.iter().zip(gb).enumerate() {
        let mut px = x.params.clone();
        let mut py = y.params.clone();
        px.sort();
        py.sort();
        if px != py {
            return Some(format!("param group {g} holds other parameters"));
        }
        for (name, v) in &x.options {
            if !y.options.get(name).is_some_and(|w| value_eq(v, w)) {
                return Some(format!("option `{name}` of param group {g} differs"));
            }
        }
    }
    None
}

/// Equal values: floats and tensors by bits.
fn value_eq<T: Tensor>(a: &Value<T>, b: &Value<T>) -> bool {
    let all = |x: &[Value<T>], y: &[Value<T>]| {
        x.len() == y.len() && x.iter().zip(y).all(|(x, y)| value_eq(x, y))
    };
    match (a, b) {
        (Value::None, Value::None) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Float(x), Value::Float(y)) => x.to_bits() == y.to_bits(),
        (Value::Str(x), Value::Str(y)) => x == y,
        (Value::Tensor(x), Value::Tensor(y)) => x.bit_eq(y),
        (Value::Sharded(x), Value::Sharded(y)) => {
            x.global_shape == y.global_shape
                && x.offsets == y.offsets
                && match (&x.local, &y.local) {
                    (Some(x), Some(y)) => x.bit_eq(y),
                    (None, None) => true,
                    _ => false,
                }
        }
        // PyTorch's `assertEqual` compares a tuple and a list element-wise (loading a full
        // FSDP2 dict turns `betas` into a list).
        (Value::Tuple(x) | Value::List(x), Value::Tuple(y) | Value::List(y)) => all(x, y),
        _ => false,
    }
}
