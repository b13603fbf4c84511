//! `torch.distributed.checkpoint.state_dict` for optimizer state (layer 8): one API,
//! [`OptimStateDictApi`], over FSDP1 ([`crate::Fsdp`], flat parameters) and FSDP2
//! ([`FullyShardedModel`](crate::FullyShardedModel), per-parameter dim-0 shards), with [`StateDictOptions`].
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

use crate::error::{Error, Result};
use crate::optim_state::{OptimParams, OptimStateDict, ParamKey, Value};
use crate::tensor::{HostTensor, Tensor};
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A model state dict, `model.state_dict()` as `get_model_state_dict` returns it: `{fqn:
/// value}` in `named_parameters()` order, then each tied alias (as `model.state_dict()` lists
/// it, under every name) holding its parameter's value.
pub type ModelStateDict<T = HostTensor> = IndexMap<String, Value<T>>;

/// `StateDictOptions`: how `get_*` and `set_*` work. `Default` is PyTorch's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
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
    pub(crate) fn check(&self, op: &str, rank: usize) -> Result<()> {
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

    // Setters, one per option, for building options outside the crate
    // (`StateDictOptions::full().cpu_offload(true)`): the struct is `#[non_exhaustive]` so
    // that options can be added without breaking callers.

    /// Sets [`StateDictOptions::full_state_dict`].
    pub fn full_state_dict(mut self, on: bool) -> Self {
        self.full_state_dict = on;
        self
    }
    /// Sets [`StateDictOptions::cpu_offload`].
    pub fn cpu_offload(mut self, on: bool) -> Self {
        self.cpu_offload = on;
        self
    }
    /// Sets [`StateDictOptions::ignore_frozen_params`].
    pub fn ignore_frozen_params(mut self, on: bool) -> Self {
        self.ignore_frozen_params = on;
        self
    }
    /// Sets [`StateDictOptions::strict`].
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }
    /// Sets [`StateDictOptions::broadcast_from_rank0`].
    pub fn broadcast_from_rank0(mut self, on: bool) -> Self {
        self.broadcast_from_rank0 = on;
        self
    }
    /// Sets [`StateDictOptions::flatten_optimizer_state_dict`].
    pub fn flatten_optimizer_state_dict(mut self, on: bool) -> Self {
        self.flatten_optimizer_state_dict = on;
        self
    }
}

/// A rank passed no dict where it must (only `broadcast_from_rank0` lets ranks other than 0
/// pass none).
pub(crate) fn missing_dict(op: &str, rank: usize) -> Error {
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

/// `get_state_dict` / `set_state_dict` and their model halves, over FSDP1 ([`crate::Fsdp`])
/// and FSDP2 ([`FullyShardedModel`](crate::FullyShardedModel)) alike. Every method is collective.
///
/// A rank's parameters are its local tensors: for FSDP2 one per parameter of
/// [`crate::param_layout::ParamLayout::params`] (its dim-0 rows), for FSDP1 one per id of
/// [`crate::Fsdp::optim_params`] (a flat shard per flat parameter, padding included; the
/// local view per original parameter with `use_orig_params`). Either way the whole tensor
/// of a parameter FSDP does not manage.
pub trait StateDictApi: OptimStateDictApi {
    /// `get_model_state_dict(model, options)`: this rank's parameters `local` as a model
    /// state dict. Sharded: each managed parameter as [`Value::Sharded`], this rank's dim-0
    /// chunk (`torch.chunk` rows) of the global shape, as FSDP2's DTensors and FSDP1's
    /// `SHARDED_STATE_DICT` hold it. `full_state_dict`: whole tensors (on rank 0 only with
    /// `cpu_offload`, an empty dict elsewhere). `ignore_frozen_params` leaves parameters
    /// without `requires_grad` out.
    fn get_model_state_dict<T: Tensor>(
        &self,
        local: &[T],
        opts: &StateDictOptions,
    ) -> Result<ModelStateDict<T>>;

    /// `set_model_state_dict(model, sd, options)`: this rank's parameters (as
    /// [`StateDictApi::get_model_state_dict`] takes them) from a model dict made with the same
    /// `full_state_dict` (full: at any world size and, for FSDP1, wrapping; with
    /// `broadcast_from_rank0` only rank 0 passes it). Keys are first names or tied aliases.
    /// With `strict`, a parameter the dict lacks is an error ([`Error::MissingState`]);
    /// without, its tensor comes back `None` (for FSDP1 without `use_orig_params`, the whole
    /// flat parameter it belongs to; with them, an empty view on a rank holding none of it).
    fn set_model_state_dict<T: Tensor>(
        &self,
        sd: Option<&ModelStateDict<T>>,
        opts: &StateDictOptions,
    ) -> Result<Vec<Option<T>>>;

    /// `get_state_dict(model, optimizers, options)`: the model and optimizer state dicts of
    /// this rank's parameters `local` and local optimizer dict `optim` (keyed by ids of
    /// `params`), as `dcp.save({"model": ..., "optim": ...})` takes them.
    fn get_state_dict<T: Tensor>(
        &self,
        local: &[T],
        optim: &OptimStateDict<T>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<(ModelStateDict<T>, OptimStateDict<T>)> {
        let model = self.get_model_state_dict(local, opts)?;
        let optim = self.get_optimizer_state_dict(optim, params, opts)?;
        Ok((model, optim))
    }

    /// `set_state_dict(model, optimizers, model_state_dict, optim_state_dict, options)`:
    /// this rank's parameters and the local dict its optimizer (holding `params`) loads.
    /// With `broadcast_from_rank0`, ranks other than 0 pass `None` for both.
    fn set_state_dict<T: Tensor>(
        &self,
        model: Option<&ModelStateDict<T>>,
        optim: Option<&OptimStateDict<T>>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<(Vec<Option<T>>, OptimStateDict<T>)> {
        let local = self.set_model_state_dict(model, opts)?;
        let optim = self.set_optimizer_state_dict(optim, params, opts)?;
        Ok((local, optim))
    }
}

/// `out` (first names, model order) with every tied alias of a parameter it holds added
/// after them, sharing the parameter's value, as `model.state_dict()` lists shared
/// parameters under each name.
pub(crate) fn with_tied_aliases<T: Tensor>(
    mut out: ModelStateDict<T>,
    tied: &BTreeMap<String, String>,
) -> ModelStateDict<T> {
    for (alias, primary) in tied {
        if let Some(v) = out.get(primary).cloned() {
            out.insert(alias.clone(), v);
        }
    }
    out
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
