//! Which parameter each optimizer key means: resolving [`OptimParams`] against a
//! [`ModelLayout`] into rank-independent [`OptimStateKey`]s (`_OptimStateKey`).

use super::{OptimParam, OptimParams, ParamKey};
use crate::error::{Error, LookupSite, Result};
use crate::flat_param::{ModelLayout, Ownership};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A rank-independent key for one optimizer parameter: the unflattened names it stands for
/// and whether FSDP manages it. Ordered like PyTorch's `_OptimStateKey` tuples.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OptimStateKey {
    /// Unflattened parameter names (all members of a flat parameter, or one name).
    pub names: Vec<String>,
    /// Whether an FSDP flat parameter holds these parameters.
    pub managed: bool,
}

/// What an optimizer parameter is, resolved against the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// Flat parameter `flat` (use_orig_params=False).
    Flat(usize),
    /// Original parameter `param` (model index), with its flat parameter and member index
    /// when FSDP manages it (use_orig_params=True), `None` when unmanaged.
    Orig {
        /// Model parameter index.
        param: usize,
        /// `(flat, member)` if managed.
        owner: Option<(usize, usize)>,
    },
}

/// One parameter of a rank's optimizer.
#[derive(Debug, Clone)]
pub struct LocalParam {
    /// Key in this optimizer's state dict (id, or name for a named optimizer).
    pub key: ParamKey,
    /// What it is.
    pub resolved: Resolved,
    /// Its rank-independent key.
    pub skey: OptimStateKey,
}

/// Resolves one optimizer parameter.
pub fn resolve(layout: &ModelLayout, p: &OptimParam) -> Result<Resolved> {
    match p {
        OptimParam::Flat(unit) => {
            let f = layout
                .flat_of_unit(unit)
                .ok_or_else(|| Error::UnknownUnit { unit: unit.clone() })?;
            if layout.use_orig_params() {
                return Err(Error::WrongOptimParam {
                    param: format!("the flat parameter of unit `{unit}`"),
                    reason:
                        "with use_orig_params=True the optimizer must hold the original parameters"
                            .into(),
                });
            }
            Ok(Resolved::Flat(f.index))
        }
        OptimParam::Param(name) => {
            let idx = layout
                .param_index(name)
                .ok_or_else(|| Error::UnknownParameter {
                    name: name.clone(),
                    site: LookupSite::HeldByOptimizer,
                })?;
            match layout.ownership[idx] {
                Ownership::Unmanaged => Ok(Resolved::Orig {
                    param: idx,
                    owner: None,
                }),
                Ownership::Flat { flat, member } => {
                    if !layout.use_orig_params() {
                        return Err(Error::WrongOptimParam {
                            param: format!("`{name}`"),
                            reason: format!(
                                "it is flattened into unit `{}`; with use_orig_params=False the optimizer must hold that unit's flat parameter",
                                layout.flat_params[flat].unit
                            ),
                        });
                    }
                    Ok(Resolved::Orig {
                        param: idx,
                        owner: Some((flat, member)),
                    })
                }
            }
        }
    }
}

impl ModelLayout {
    /// Rank-independent key of a resolved parameter.
    pub fn state_key(&self, r: Resolved) -> OptimStateKey {
        match r {
            Resolved::Flat(f) => OptimStateKey {
                names: self.flat_params[f].fqns(),
                managed: true,
            },
            Resolved::Orig { param, owner } => OptimStateKey {
                names: vec![self.state_fqn(param).to_string()],
                managed: owner.is_some(),
            },
        }
    }

    /// The name a named optimizer keys this parameter by.
    pub fn named_key(&self, r: Resolved) -> String {
        match r {
            Resolved::Flat(f) => self.flat_params[f].fqn(),
            Resolved::Orig { param, .. } => self.state_fqn(param).to_string(),
        }
    }

    /// Resolves every parameter of an optimizer, in id order; a parameter held twice is an
    /// error, as in `torch.optim`.
    pub fn local_params(&self, params: &OptimParams) -> Result<Vec<LocalParam>> {
        let mut seen: HashMap<OptimStateKey, usize> = HashMap::new();
        let mut out = Vec::with_capacity(params.len());
        for (id, p) in params.iter() {
            let resolved = resolve(self, p)?;
            let skey = self.state_key(resolved);
            if let Some(prev) = seen.insert(skey.clone(), id) {
                return Err(Error::InvalidParamGroups {
                    context: "the optimizer's parameters".into(),
                    group: None,
                    reason: format!("{p} appears twice (ids {prev} and {id})"),
                });
            }
            let key = if params.named {
                ParamKey::Name(self.named_key(resolved))
            } else {
                ParamKey::Id(id)
            };
            out.push(LocalParam {
                key,
                resolved,
                skey,
            });
        }
        Ok(out)
    }

    /// The parameters in the wrapped model's `named_parameters()` order (flat parameters at
    /// their unit, or original parameters with use_orig_params), as resolved entries.
    pub fn model_order(&self) -> Vec<Resolved> {
        crate::optim_state::OptimParam::in_model_order(self)
            .iter()
            .map(|p| resolve(self, p).expect("default parameters resolve"))
            .collect()
    }
}
