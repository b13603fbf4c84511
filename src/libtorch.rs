//! Integration with tch (libtorch) training programs, behind the `tch` feature: whole state
//! dicts between [`HostTensor`] and [`TchTensor`], the parameters of a
//! [`VarStore`](::tch::nn::VarStore) as a [`ModelDesc`], and [`step_tch`], which steps this
//! crate's optimizers on `tch` parameters.
//!
//! The tensor backend itself ([`TchTensor`]) is [`crate::tensor::tch`]; this module sits above
//! the model description and the optimizers, which it connects to a tch program.

use crate::error::{Error, Result};
use crate::model::ModelDesc;
use crate::optim::Optimizer;
use crate::optim_state::OptimStateDict;
use crate::tensor::tch::{backend_err, kind_to_dtype, TchTensor, BACKEND};
use crate::tensor::HostTensor;

/// A host state dict as `tch` tensors (one copy per tensor).
pub fn state_dict_to_tch(sd: &OptimStateDict<HostTensor>) -> Result<OptimStateDict<TchTensor>> {
    sd.try_map(TchTensor::from_host_tensor)
}

/// A `tch` state dict as host tensors (one copy per tensor), e.g. for an [`Optimizer`] or for
/// [`crate::io::torch_save`].
pub fn state_dict_to_host(sd: &OptimStateDict<TchTensor>) -> Result<OptimStateDict<HostTensor>> {
    sd.try_map(TchTensor::to_host_tensor)
}

/// One optimizer step on `tch` parameters: `params[id]` and `grads[id]` as
/// [`Optimizer::step`] takes them, as libtorch tensors (`None`: no gradient).
///
/// The optimizers compute on [`HostTensor`]s (their kernels reproduce torch's CPU numerics),
/// so this copies each parameter and gradient to the host, steps, and copies every parameter
/// that had a gradient back into its `tch` tensor in place (under `no_grad`, so leaf tensors
/// that require grad, such as [`VarStore`](::tch::nn::VarStore) variables, are updated and
/// keep their identity). The optimizer validates everything before changing anything; an
/// error leaves the parameters untouched.
pub fn step_tch(
    optim: &mut dyn Optimizer,
    params: &mut [::tch::Tensor],
    grads: &[Option<::tch::Tensor>],
) -> Result<()> {
    let host = |t: &::tch::Tensor| TchTensor::new(t.shallow_clone())?.to_host_tensor();
    let mut slots = params.iter().map(host).collect::<Result<Vec<_>>>()?;
    let host_grads = grads
        .iter()
        .map(|g| g.as_ref().map(host).transpose())
        .collect::<Result<Vec<_>>>()?;
    optim.step(&mut slots, &host_grads)?;
    // Convert every update first so that a failure cannot leave some parameters written.
    let updates = slots
        .iter()
        .zip(&host_grads)
        .map(|(s, g)| {
            g.as_ref()
                .map(|_| TchTensor::from_host_tensor(s))
                .transpose()
        })
        .collect::<Result<Vec<_>>>()?;
    for (id, (p, u)) in params.iter_mut().zip(updates).enumerate() {
        if let Some(u) = u {
            ::tch::no_grad(|| p.f_copy_(&u.to_tch()))
                .map_err(|e| backend_err(format!("step_tch: writing parameter {id} back"), e))?;
        }
    }
    Ok(())
}

/// The parameters of a [`VarStore`](::tch::nn::VarStore), as [`var_store_params`] finds them.
#[derive(Debug)]
pub struct VarStoreParams {
    /// `(primary name, tensor)` per parameter, in order; the tensors are shallow clones of the
    /// store's variables (writing into them updates the store).
    pub params: Vec<(String, ::tch::Tensor)>,
    /// Tied aliases as `(alias, primary)`: further names of a tensor listed in `params`.
    pub tied: Vec<(String, String)>,
}

/// The parameters of a [`VarStore`](::tch::nn::VarStore) in creation order, as
/// `(name, tensor)` (shallow clones), and the tied aliases (`alias → primary`).
///
/// # Order and its limits
/// `VarStore::variables()` is a `HashMap`; the only ordered record tch 0.26 keeps is
/// `variables_.trainable_variables`, the variables created trainable, in creation order. This
/// function takes that order and finds each tensor's name in `named_variables` by identity
/// (same storage, offset, sizes and strides: `is_set_to`). Consequences:
/// * Parameters are in **creation order**. That is PyTorch's `named_parameters()` order only
///   when the Rust model creates its variables in the order the Python model registers them.
///   tch's own layers do not: `nn::linear` and `nn::conv*` create `bias` before `weight`,
///   where `torch.nn.Linear`/`Conv*d` register `weight` first. Since the order decides flat
///   parameter layout, optimizer ids and key order, use [`var_store_params_in_order`] /
///   [`model_desc_from_var_store_in_order`] with the Python model's order when checkpoints are
///   exchanged with PyTorch.
/// * Variables created non-trainable (`zeros_no_train`, `add(.., false)`: tch's buffers, e.g.
///   batch-norm running statistics) are not parameters and are left out, like PyTorch buffers.
///   Variables frozen after creation (`VarStore::freeze`, `set_requires_grad(false)`) stay
///   in, with `requires_grad = false`.
/// * A tensor registered under several names (one trainable entry each) is one parameter; its
///   lexicographically first name is the primary, the others become tied aliases — tch keeps
///   no record of which name came first.
pub fn var_store_params(vs: &::tch::nn::VarStore) -> Result<VarStoreParams> {
    let vars = vs.variables_.lock().map_err(|_| Error::TensorBackend {
        backend: BACKEND.into(),
        op: "var_store_params".into(),
        reason: "the VarStore's lock is poisoned (a thread panicked while holding it)".into(),
    })?;
    let same = |a: &::tch::Tensor, b: &::tch::Tensor| {
        a.f_is_set_to(b)
            .map_err(|e| backend_err("var_store_params: tensor identity".into(), e))
    };
    // Candidate names by data pointer, checked by identity (empty tensors may share a null
    // data pointer).
    let mut by_ptr: std::collections::HashMap<usize, Vec<&String>> = Default::default();
    for (name, t) in &vars.named_variables {
        by_ptr.entry(t.data_ptr() as usize).or_default().push(name);
    }
    let mut params: Vec<(String, ::tch::Tensor)> = Vec::new();
    let mut tied = Vec::new();
    for var in &vars.trainable_variables {
        let t = &var.tensor;
        let mut dup = false;
        for (_, p) in &params {
            if same(t, p)? {
                dup = true;
                break;
            }
        }
        if dup {
            continue;
        }
        let mut names = Vec::new();
        for n in by_ptr.get(&(t.data_ptr() as usize)).into_iter().flatten() {
            if same(t, &vars.named_variables[*n])? {
                names.push((*n).clone());
            }
        }
        names.sort();
        let Some(primary) = names.first().cloned() else {
            return Err(Error::InvalidModel(
                "a trainable variable of the VarStore has no name in `named_variables`".into(),
            ));
        };
        for alias in &names[1..] {
            tied.push((alias.clone(), primary.clone()));
        }
        params.push((primary, t.shallow_clone()));
    }
    Ok(VarStoreParams { params, tied })
}

/// A [`ModelDesc`] of a [`VarStore`](::tch::nn::VarStore)'s parameters: names, shapes,
/// dtypes and `requires_grad`, in the order [`var_store_params`] documents (creation order;
/// buffers left out).
///
/// ```no_run
/// use tch::nn;
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let _l1 = nn::linear(vs.root() / "layers" / 0, 4, 8, Default::default());
/// let _l2 = nn::linear(vs.root() / "layers" / 1, 8, 2, Default::default());
/// let model = fsdp::libtorch::model_desc_from_var_store(&vs)?;
/// // tch's `nn::linear` creates its bias first.
/// assert_eq!(model.params[0].name, "layers.0.bias");
/// # Ok::<(), fsdp::Error>(())
/// ```
pub fn model_desc_from_var_store(vs: &::tch::nn::VarStore) -> Result<ModelDesc> {
    let VarStoreParams { params, tied } = var_store_params(vs)?;
    model_desc_of(&params, &tied)
}

/// [`var_store_params`] reordered to `order`: the parameters' names in PyTorch's
/// `named_parameters()` order (e.g. `[n for n, _ in model.named_parameters()]` of the Python
/// model, or the parameter keys of a PyTorch checkpoint).
///
/// `order` must name every parameter of the store exactly once, by its primary name or a tied
/// alias; anything else is an [`Error::ParamOrderMismatch`] listing the names that are missing,
/// unknown or repeated.
pub fn var_store_params_in_order<S: AsRef<str>>(
    vs: &::tch::nn::VarStore,
    order: &[S],
) -> Result<VarStoreParams> {
    let VarStoreParams { params, tied } = var_store_params(vs)?;
    let alias_of: std::collections::HashMap<&str, &str> =
        tied.iter().map(|(a, p)| (a.as_str(), p.as_str())).collect();
    let mut slots: Vec<Option<(String, ::tch::Tensor)>> = params.into_iter().map(Some).collect();
    let index: std::collections::HashMap<String, usize> = slots
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_ref().expect("all present").0.clone(), i))
        .collect();
    let (mut out, mut unknown, mut repeated) = (Vec::new(), Vec::new(), Vec::new());
    for name in order {
        let name = name.as_ref();
        let primary = alias_of.get(name).copied().unwrap_or(name);
        match index.get(primary) {
            None => unknown.push(name.to_string()),
            Some(&i) => match slots[i].take() {
                Some(p) => out.push(p),
                None => repeated.push(name.to_string()),
            },
        }
    }
    let missing: Vec<String> = slots.into_iter().flatten().map(|(n, _)| n).collect();
    if !(missing.is_empty() && unknown.is_empty() && repeated.is_empty()) {
        return Err(Error::ParamOrderMismatch {
            source_of_params: "VarStore".into(),
            missing,
            unknown,
            repeated,
        });
    }
    Ok(VarStoreParams { params: out, tied })
}

/// [`model_desc_from_var_store`] with the parameters in `order` (see
/// [`var_store_params_in_order`]): the way to match a PyTorch model's `named_parameters()`.
pub fn model_desc_from_var_store_in_order<S: AsRef<str>>(
    vs: &::tch::nn::VarStore,
    order: &[S],
) -> Result<ModelDesc> {
    let VarStoreParams { params, tied } = var_store_params_in_order(vs, order)?;
    model_desc_of(&params, &tied)
}

fn model_desc_of(
    params: &[(String, ::tch::Tensor)],
    tied: &[(String, String)],
) -> Result<ModelDesc> {
    let mut model = ModelDesc::new();
    for (name, t) in params {
        let kind = t
            .f_kind()
            .map_err(|e| backend_err(format!("model_desc_from_var_store: kind of `{name}`"), e))?;
        let dtype = kind_to_dtype(kind).map_err(|e| match e {
            Error::Unsupported(msg) => Error::Unsupported(format!("parameter `{name}`: {msg}")),
            other => other,
        })?;
        let shape: Vec<usize> = t.size().into_iter().map(|d| d as usize).collect();
        model = if t.requires_grad() {
            model.param(name, &shape, dtype)
        } else {
            model.frozen_param(name, &shape, dtype)
        };
    }
    for (alias, primary) in tied {
        model = model.tie(alias, primary);
    }
    model.validate()?;
    Ok(model)
}
