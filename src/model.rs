//! Model description and wrapping policy (layer 2).
//!
//! A [`ModelDesc`] replaces `nn.Module`: the parameters in `model.named_parameters()` order
//! (primary names only) and the tied aliases. A [`WrapPolicy`] says which module prefixes are
//! FSDP units, which modules are ignored, whether `use_orig_params` is on and the sharding
//! strategy. Both are serde-serializable; their JSON form is the `DESC.json` schema.

use crate::error::{Error, LookupSite, Result};
use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// One parameter of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamDesc {
    /// Fully qualified name relative to the model root, without wrapper prefixes.
    pub name: String,
    /// Shape; empty for a 0-dim parameter.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Whether the parameter is trained (frozen parameters get no gradient, hence no state).
    #[serde(default = "default_true")]
    pub requires_grad: bool,
}

fn default_true() -> bool {
    true
}

impl ParamDesc {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parameters of a model, in `named_parameters()` order, and its tied aliases.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelDesc {
    /// Unique parameters under their primary (first) name, in registration pre-order.
    pub params: Vec<ParamDesc>,
    /// Tied aliases: alias name → primary name (e.g. `lm_head.weight` → `embed.weight`).
    #[serde(default)]
    pub tied: BTreeMap<String, String>,
}

/// Whether the module `prefix` (`""` is the root) contains the parameter `name`.
pub fn prefix_contains(prefix: &str, name: &str) -> bool {
    prefix.is_empty()
        || (name.len() > prefix.len()
            && name.starts_with(prefix)
            && name.as_bytes()[prefix.len()] == b'.')
}

/// The proper ancestors of a dotted name, innermost first, ending with the root `""`
/// (`"a.b.c"` → `"a.b"`, `"a"`, `""`): exactly the prefixes `p` with `prefix_contains(p, name)`.
pub(crate) fn ancestors(name: &str) -> impl Iterator<Item = &str> {
    let mut cur = Some(name);
    std::iter::from_fn(move || {
        let n = cur?;
        if n.is_empty() {
            cur = None;
            return None;
        }
        let parent = module_of(n);
        cur = Some(parent);
        Some(parent)
    })
}

/// The module that directly owns parameter `name` (`""` for the root).
pub(crate) fn module_of(name: &str) -> &str {
    name.rfind('.').map_or("", |i| &name[..i])
}

impl ModelDesc {
    /// An empty description; add parameters with [`ModelDesc::param`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a trainable parameter (builder style).
    pub fn param(mut self, name: &str, shape: &[usize], dtype: DType) -> Self {
        self.params.push(ParamDesc {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype,
            requires_grad: true,
        });
        self
    }

    /// Adds a frozen parameter (`requires_grad=False`).
    pub fn frozen_param(mut self, name: &str, shape: &[usize], dtype: DType) -> Self {
        self.params.push(ParamDesc {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype,
            requires_grad: false,
        });
        self
    }

    /// Declares `alias` as another name of the parameter `primary` (builder style).
    pub fn tie(mut self, alias: &str, primary: &str) -> Self {
        self.tied.insert(alias.to_string(), primary.to_string());
        self
    }

    /// The tied aliases of the parameter named `primary`, in name order.
    pub fn aliases_of<'a>(&'a self, primary: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.tied
            .iter()
            .filter(move |(_, p)| p.as_str() == primary)
            .map(|(alias, _)| alias.as_str())
    }

    /// Index of the parameter with this primary name or alias.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        let primary = self.tied.get(name).map(String::as_str).unwrap_or(name);
        self.params.iter().position(|p| p.name == primary)
    }

    /// The parameter with this primary name or alias.
    pub fn get(&self, name: &str) -> Result<&ParamDesc> {
        self.index_of(name)
            .map(|i| &self.params[i])
            .ok_or_else(|| Error::UnknownParameter {
                name: name.to_string(),
                site: LookupSite::ModelDescription,
            })
    }

    /// Total number of elements over unique parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamDesc::numel).sum()
    }

    /// Checks names are unique and non-empty, aliases point at existing parameters, and the
    /// model's bytes are countable (every shape's product, and their sum, at most `isize::MAX`
    /// bytes: a shape read from a file can claim anything).
    pub fn validate(&self) -> Result<()> {
        let mut seen = HashMap::new();
        let mut total_bytes = 0usize;
        for (i, p) in self.params.iter().enumerate() {
            let bytes = p
                .shape
                .iter()
                .try_fold(p.dtype.size(), |a, &d| a.checked_mul(d))
                .and_then(|b| total_bytes.checked_add(b))
                .filter(|&t| t <= isize::MAX as usize);
            match bytes {
                Some(t) => total_bytes = t,
                None => {
                    return Err(Error::InvalidModel(format!(
                        "parameter `{}` of shape {:?} ({}) takes the model past {} bytes",
                        p.name,
                        p.shape,
                        p.dtype,
                        isize::MAX
                    )))
                }
            }
            if p.name.is_empty() || p.name.starts_with('.') || p.name.ends_with('.') {
                return Err(Error::InvalidModel(format!(
                    "parameter {i} has an invalid name `{}`",
                    p.name
                )));
            }
            if seen.insert(p.name.as_str(), i).is_some() {
                return Err(Error::InvalidModel(format!(
                    "parameter `{}` is listed twice",
                    p.name
                )));
            }
        }
        for (alias, primary) in &self.tied {
            if seen.contains_key(alias.as_str()) {
                return Err(Error::InvalidModel(format!(
                    "tied alias `{alias}` is also listed as a parameter"
                )));
            }
            if !seen.contains_key(primary.as_str()) {
                return Err(Error::InvalidModel(format!(
                    "tied alias `{alias}` points at `{primary}`, which is not a parameter"
                )));
            }
        }
        Ok(())
    }

    /// Every name of every parameter (aliases included) as `(name, parameter index)`, in the
    /// order of `named_parameters(remove_duplicate=False)`.
    ///
    /// Primaries keep their listed order. An alias is placed after the last primary its module
    /// owns directly; if it owns none, after the last primary in that module's subtree; failing
    /// that, the same rule is applied to the parent module (the root places it last).
    pub fn names_with_aliases(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = self
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        for (alias, primary) in &self.tied {
            let Some(pidx) = self.index_of(primary) else {
                continue;
            };
            let mut module = module_of(alias).to_string();
            let pos = loop {
                let direct = out.iter().rposition(|(n, _)| module_of(n) == module);
                let subtree = out.iter().rposition(|(n, _)| prefix_contains(&module, n));
                if let Some(p) = direct.or(subtree) {
                    break p + 1;
                }
                if module.is_empty() {
                    break out.len();
                }
                module = module_of(&module).to_string();
            };
            out.insert(pos, (alias.clone(), pidx));
        }
        out
    }
}

/// FSDP sharding strategy, named as `torch.distributed.fsdp.ShardingStrategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardingStrategy {
    /// Shard parameters, gradients and optimizer state across the group.
    #[default]
    FullShard,
    /// Shard gradients and optimizer state; for optimizer state identical to `FULL_SHARD`.
    ShardGradOp,
    /// `FULL_SHARD` within each shard group, replicated across shard groups.
    HybridShard,
    /// `SHARD_GRAD_OP` within each shard group, replicated across shard groups.
    #[serde(rename = "_HYBRID_SHARD_ZERO2")]
    HybridShardZero2,
    /// No sharding: every rank holds everything (like DDP).
    NoShard,
}

impl ShardingStrategy {
    /// Whether flat parameters are split across the (shard) group.
    pub fn shards(self) -> bool {
        !matches!(self, ShardingStrategy::NoShard)
    }

    /// Whether the strategy shards within a sub-group and replicates across sub-groups.
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2
        )
    }
}

/// How the model is wrapped: FSDP generation, units, ignored modules, `use_orig_params`,
/// strategy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WrapPolicy {
    /// Module prefixes wrapped as FSDP units, in wrap order (`""` is the root). With FSDP1 a
    /// unit claims its parameters before any unit that contains it, so nested units may be
    /// listed in any order relative to their ancestors. With FSDP2 (`fsdp_version` 2) they are
    /// the modules `fully_shard` was applied to, in application order (innermost first).
    pub units: Vec<String>,
    /// Which FSDP: `1` for `FullyShardedDataParallel` (flat parameters, the default), `2` for
    /// `fully_shard` (each parameter sharded on dim 0; see [`crate::param_layout`]).
    #[serde(default)]
    pub fsdp_version: FsdpVersion,
    /// Module prefixes whose parameters FSDP ignores (their state passes through untouched).
    #[serde(default)]
    pub ignored_modules: Vec<String>,
    /// `use_orig_params=True`: the optimizer sees original parameters instead of flat ones.
    #[serde(default)]
    pub use_orig_params: bool,
    /// Sharding strategy.
    #[serde(default)]
    pub sharding_strategy: ShardingStrategy,
}

/// The FSDP generation a policy describes; `"fsdp_version": 1` or `2` in `DESC.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum FsdpVersion {
    /// `FullyShardedDataParallel`: flat parameters.
    #[default]
    V1,
    /// `fully_shard`: each parameter sharded on dim 0.
    V2,
}

impl TryFrom<u8> for FsdpVersion {
    type Error = String;
    fn try_from(v: u8) -> std::result::Result<Self, String> {
        match v {
            1 => Ok(FsdpVersion::V1),
            2 => Ok(FsdpVersion::V2),
            _ => Err(format!(
                "fsdp_version {v} is neither 1 (FullyShardedDataParallel) nor 2 (fully_shard)"
            )),
        }
    }
}

impl From<FsdpVersion> for u8 {
    fn from(v: FsdpVersion) -> u8 {
        match v {
            FsdpVersion::V1 => 1,
            FsdpVersion::V2 => 2,
        }
    }
}

impl std::fmt::Display for FsdpVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", u8::from(*self))
    }
}

impl Default for WrapPolicy {
    /// No units, FSDP1, nothing ignored, flat parameters, `FULL_SHARD`.
    fn default() -> Self {
        WrapPolicy {
            units: Vec::new(),
            fsdp_version: FsdpVersion::V1,
            ignored_modules: Vec::new(),
            use_orig_params: false,
            sharding_strategy: ShardingStrategy::default(),
        }
    }
}

impl WrapPolicy {
    /// A policy wrapping the given units with default options.
    pub fn units<S: AsRef<str>>(units: &[S]) -> Self {
        WrapPolicy {
            units: units.iter().map(|s| s.as_ref().to_string()).collect(),
            ..Default::default()
        }
    }

    /// An FSDP2 policy: `fully_shard` applied to `modules` in this order (innermost first, the
    /// root `""` last), with default options.
    pub fn fully_shard<S: AsRef<str>>(modules: &[S]) -> Self {
        WrapPolicy {
            fsdp_version: FsdpVersion::V2,
            ..Self::units(modules)
        }
    }

    /// Whether this policy describes FSDP2 (`fully_shard`).
    pub fn is_fsdp2(&self) -> bool {
        self.fsdp_version == FsdpVersion::V2
    }

    /// Sets `use_orig_params` (builder style).
    pub fn with_orig_params(mut self, on: bool) -> Self {
        self.use_orig_params = on;
        self
    }

    /// Sets the ignored modules (builder style).
    pub fn with_ignored<S: AsRef<str>>(mut self, modules: &[S]) -> Self {
        self.ignored_modules = modules.iter().map(|s| s.as_ref().to_string()).collect();
        self
    }

    /// Sets the sharding strategy (builder style).
    pub fn with_strategy(mut self, strategy: ShardingStrategy) -> Self {
        self.sharding_strategy = strategy;
        self
    }

    /// Checks that units are unique and every unit and ignored module holds a parameter.
    pub fn validate(&self, model: &ModelDesc) -> Result<()> {
        let names = model.names_with_aliases();
        // Every module that contains some parameter name.
        let modules: std::collections::HashSet<&str> =
            names.iter().flat_map(|(n, _)| ancestors(n)).collect();
        let mut seen = std::collections::HashSet::new();
        for u in &self.units {
            if !seen.insert(u) {
                return Err(Error::InvalidModel(format!(
                    "FSDP unit `{u}` is listed twice"
                )));
            }
            if !modules.contains(u.as_str()) {
                return Err(Error::InvalidModel(format!(
                    "FSDP unit `{u}` contains no parameter of the model"
                )));
            }
        }
        for m in &self.ignored_modules {
            if !modules.contains(m.as_str()) {
                return Err(Error::InvalidModel(format!(
                    "ignored module `{m}` contains no parameter of the model"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(prefix_contains("", "a.b"));
        assert!(prefix_contains("block1", "block1.weight"));
        assert!(!prefix_contains("block1", "block10.weight"));
        assert!(!prefix_contains("block1.weight", "block1.weight"));
        assert_eq!(module_of("a.b.c"), "a.b");
        assert_eq!(module_of("bias"), "");
    }

    #[test]
    fn aliases_of_a_parameter_are_its_tied_names_in_name_order() {
        let m = ModelDesc::new()
            .param("embed.weight", &[4, 2], DType::F32)
            .param("other.weight", &[2], DType::F32)
            .tie("out.weight", "embed.weight")
            .tie("head.weight", "embed.weight");
        let of = |name| m.aliases_of(name).collect::<Vec<_>>();
        assert_eq!(of("embed.weight"), ["head.weight", "out.weight"]);
        assert!(of("other.weight").is_empty());
        assert!(
            of("out.weight").is_empty(),
            "an alias has no aliases of its own"
        );
    }

    #[test]
    fn alias_of_a_module_without_primaries_goes_last() {
        let m = ModelDesc::new()
            .param("embed.weight", &[4, 2], DType::F32)
            .param("layer.weight", &[2, 2], DType::F32)
            .tie("head.weight", "embed.weight");
        let names: Vec<_> = m.names_with_aliases().into_iter().collect();
        assert_eq!(names.last().unwrap(), &("head.weight".to_string(), 0));
    }

    #[test]
    fn validation_names_the_culprit() {
        let m = ModelDesc::new()
            .param("a", &[1], DType::F32)
            .tie("b", "zzz");
        let e = m.validate().unwrap_err();
        assert!(e.to_string().contains("zzz"), "{e}");
        let m = ModelDesc::new().param("a.w", &[1], DType::F32);
        let e = WrapPolicy::units(&["b"]).validate(&m).unwrap_err();
        assert!(e.to_string().contains("`b`"), "{e}");
    }

    #[test]
    fn shapes_whose_bytes_cannot_be_counted_are_refused_not_wrapped() {
        let huge = 1usize << 40;
        // One shape whose product overflows usize.
        let m = ModelDesc::new().param("w", &[huge, huge], DType::F32);
        let e = m.validate().unwrap_err();
        assert!(matches!(e, Error::InvalidModel(_)), "{e}");
        assert!(e.to_string().contains("parameter `w`"), "{e}");
        // Shapes that fit one by one but not together.
        let half = (isize::MAX as usize) / 4 / 2 + 1;
        let m = ModelDesc::new()
            .param("a", &[half], DType::F32)
            .param("b", &[half], DType::F32);
        let e = m.validate().unwrap_err();
        assert!(e.to_string().contains("parameter `b`"), "{e}");
        // Exactly isize::MAX bytes is accepted; one byte more is not.
        let limit = isize::MAX as usize;
        ModelDesc::new()
            .param("a", &[limit], DType::U8)
            .validate()
            .unwrap();
        let e = ModelDesc::new()
            .param("a", &[limit - 1], DType::U8)
            .param("b", &[2], DType::U8)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("parameter `b`"), "{e}");
    }
}
