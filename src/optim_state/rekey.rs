//! Rekeying a state dict between parameter ids and parameter names
//! (`FSDP.rekey_optim_state_dict`).

use super::keys::Resolved;
use super::{OptimParams, OptimStateDict, ParamGroup, ParamKey};
use crate::error::{Error, LookupSite, Result};
use crate::flat_param::ModelLayout;
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The key type to rekey to (`OptimStateKeyType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimStateKeyType {
    /// Key by parameter name.
    ParamName,
    /// Key by parameter id in the given optimizer.
    ParamId,
}

/// Rekeys `osd` to `key_type` using the optimizer `params` of a model with this layout.
///
/// Ids map to the parameter's name (a flat parameter's name is `unit._flat_param`); names map
/// to the id of the parameter in `params` (aliases are accepted). `params` of each group are
/// sorted, as PyTorch sorts them. A dict already of the target type is returned as is.
pub fn rekey_optim_state_dict<T: Tensor>(
    osd: &OptimStateDict<T>,
    key_type: OptimStateKeyType,
    layout: &ModelLayout,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    let names = check_one_key_type(osd)?;
    let is_names = names > 0;
    let is_ids = !osd.state.is_empty() && names == 0;
    if (key_type == OptimStateKeyType::ParamName && is_names)
        || (key_type == OptimStateKeyType::ParamId && is_ids)
    {
        return Ok(osd.clone());
    }
    let ids = OptimParams {
        groups: params.groups.clone(),
        named: false,
    };
    let local = layout.local_params(&ids)?;
    let mut map: HashMap<ParamKey, ParamKey> = HashMap::new();
    for l in &local {
        let name = layout.named_key(l.resolved);
        match key_type {
            OptimStateKeyType::ParamName => {
                map.insert(l.key.clone(), ParamKey::Name(name));
            }
            OptimStateKeyType::ParamId => {
                map.insert(ParamKey::Name(name), l.key.clone());
                if let Resolved::Orig { param, .. } = l.resolved {
                    for (n, p) in layout.model.names_with_aliases() {
                        if p == param {
                            map.insert(ParamKey::Name(n), l.key.clone());
                        }
                    }
                }
            }
        }
    }
    let lookup = |k: &ParamKey, what: &str| -> Result<ParamKey> {
        map.get(k).cloned().ok_or_else(|| Error::UnknownParameter {
            name: k.to_string(),
            site: LookupSite::NotInOptimizer {
                part: what.to_string(),
            },
        })
    };
    let mut state = indexmap::IndexMap::new();
    for (k, v) in &osd.state {
        state.insert(lookup(k, "the state")?, v.clone());
    }
    let param_groups = match &osd.param_groups {
        None => None,
        Some(groups) => Some(
            groups
                .iter()
                .enumerate()
                .map(|(gi, g)| {
                    let mut params = g
                        .params
                        .iter()
                        .map(|k| lookup(k, &format!("param_groups[{gi}]")))
                        .collect::<Result<Vec<_>>>()?;
                    params.sort();
                    Ok(ParamGroup {
                        options: g.options.clone(),
                        params,
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    Ok(OptimStateDict {
        state,
        param_groups,
    })
}

/// The number of name keys of `osd`'s state, after checking that its keys are all names or
/// all ids.
fn check_one_key_type<T: Tensor>(osd: &OptimStateDict<T>) -> Result<usize> {
    let is_name = |k: &ParamKey| matches!(k, ParamKey::Name(_));
    let names = osd.state.keys().filter(|k| is_name(k)).count();
    if names == 0 || names == osd.state.len() {
        return Ok(names);
    }
    let first = osd.state.keys().next().map(is_name);
    let odd = osd.state.keys().find(|k| Some(is_name(k)) != first);
    Err(Error::WrongKeyType {
        dict: "an optimizer state dict".into(),
        expected: if first == Some(true) {
            "parameter names only".into()
        } else {
            "parameter ids only".into()
        },
        key: odd.map(ToString::to_string).unwrap_or_default(),
        hint: format!(
            " (the state mixes ids and names: {:?})",
            osd.state
                .keys()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        ),
    })
}
