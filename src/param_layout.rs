//! FSDP2's per-parameter layout (layer 3): pure arithmetic, as `fully_shard` computes it.
//!
//! `fully_shard` (PyTorch's FSDP2) keeps every parameter whole in name and shape and shards it
//! on dim 0 as `torch.chunk` does: `ceil(dim0 / world_size)` rows per rank, trailing ranks
//! fewer or none (6 rows on 4 ranks: 2, 2, 2, 0; 10 rows: 3, 3, 3, 1). For the all-gather every
//! rank's shard is padded with zero rows to that uniform chunk size
//! (`FSDPParam.padded_sharded_param_size`). Optimizer state follows the same placement.
//!
//! The parameters of one `fully_shard` call form a group (`FSDPParamGroup`), all-gathered and
//! reduce-scattered together (see [`crate::fully_shard`]). [`ParamLayout::new`] derives the
//! groups from a [`WrapPolicy`] with `fsdp_version` 2 and expresses each rank's holding in the
//! boxes of `placement` (`Chunk`, the DCP chunk type). It is a pure function of the model, the
//! policy and the world size.

use crate::error::{Error, Result};
use crate::model::{
    ancestors, module_of, prefix_contains, ModelDesc, ShardingStrategy, WrapPolicy,
};
use crate::placement::{Chunk, Piece, TensorPlacement};
use crate::tensor::DType;
use std::collections::HashMap;
use std::ops::Range;

/// Rows per rank of a dim-0 chunking: `ceil(dim0 / world_size)` (`torch.chunk`'s chunk size,
/// and the padded shard's row count).
pub(crate) fn chunk_size(dim0: usize, world_size: usize) -> usize {
    dim0.div_ceil(world_size.max(1))
}

/// The rows of dim 0 that `rank` holds when `dim0` rows are split over `world_size` ranks as
/// `torch.chunk` (plus `_chunk_with_empty`) splits them: whole chunks first, then at most one
/// partial chunk, then empty ranks, whose range starts at `dim0`.
pub fn chunk_rows(dim0: usize, world_size: usize, rank: usize) -> Range<usize> {
    let c = chunk_size(dim0, world_size);
    let start = rank.saturating_mul(c).min(dim0);
    start..(start + c).min(dim0)
}

/// How a parameter is held across the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// Sharded on dim 0 by the `fully_shard` group with this index in
    /// [`ParamLayout::groups`].
    Sharded {
        /// Index of the group.
        group: usize,
    },
    /// Not managed by any `fully_shard` call (ignored, or outside every unit): every rank
    /// holds the whole tensor.
    Replicated,
}

/// One parameter and how the ranks hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedParam {
    /// The parameter's first name (tied aliases share this one entry).
    pub name: String,
    /// Index in [`ModelDesc::params`].
    pub index: usize,
    /// Global (unsharded) shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Whether it is trained; frozen parameters are sharded alike but have no optimizer state.
    pub requires_grad: bool,
    /// Sharded by a group, or replicated.
    pub holding: Holding,
    /// Number of ranks.
    pub world_size: usize,
}

impl ShardedParam {
    /// A trainable parameter sharded by group 0: what one entry of an `FSDPParamGroup` is.
    /// Refuses a 0-dim shape, as `fully_shard` does.
    pub fn new(name: &str, shape: &[usize], dtype: DType, world_size: usize) -> Result<Self> {
        check_world_size(world_size)?;
        check_not_scalar(name, shape)?;
        Ok(ShardedParam {
            name: name.to_string(),
            index: 0,
            shape: shape.to_vec(),
            dtype,
            requires_grad: true,
            holding: Holding::Sharded { group: 0 },
            world_size,
        })
    }

    /// Whether the parameter is sharded (and not replicated).
    pub fn is_sharded(&self) -> bool {
        matches!(self.holding, Holding::Sharded { .. })
    }

    /// Elements per dim-0 row (the product of the other dimensions).
    pub fn row_numel(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// The dim-0 rows `rank` holds (all of them for a replicated parameter).
    pub fn rows(&self, rank: usize) -> Range<usize> {
        let dim0 = self.shape.first().copied().unwrap_or(1);
        match self.holding {
            Holding::Sharded { .. } => chunk_rows(dim0, self.world_size, rank),
            Holding::Replicated => 0..dim0,
        }
    }

    /// The box `rank` holds in global coordinates (`DTensor.to_local()`'s place).
    pub fn local_chunk(&self, rank: usize) -> Chunk {
        match self.holding {
            Holding::Sharded { .. } => {
                let r = self.rows(rank);
                Chunk::rows(&self.shape, r.start, r.len())
            }
            Holding::Replicated => Chunk::whole(&self.shape),
        }
    }

    /// Shape of `rank`'s local tensor (`FSDPParam.sharded_size`): a rank without rows keeps
    /// the other dimensions, `[0, ...]`.
    pub fn local_shape(&self, rank: usize) -> Vec<usize> {
        self.local_chunk(rank).sizes
    }

    /// Elements of `rank`'s local tensor.
    pub fn local_numel(&self, rank: usize) -> usize {
        self.local_chunk(rank).numel()
    }

    /// Shape of every rank's padded shard (`padded_sharded_param_size`): the chunk size in
    /// dim 0, the global shape elsewhere.
    pub fn padded_shape(&self) -> Vec<usize> {
        let mut s = self.shape.clone();
        if let (Holding::Sharded { .. }, Some(d0)) = (self.holding, s.first_mut()) {
            *d0 = chunk_size(*d0, self.world_size);
        }
        s
    }

    /// Elements of every rank's padded shard.
    pub fn padded_numel(&self) -> usize {
        self.padded_shape().iter().product()
    }

    /// Every rank's piece, in rank order (empty pieces included).
    pub fn placement(&self) -> TensorPlacement {
        TensorPlacement {
            name: self.name.clone(),
            shape: self.shape.clone(),
            dtype: self.dtype,
            pieces: (0..self.world_size)
                .map(|rank| Piece {
                    rank,
                    chunk: self.local_chunk(rank),
                })
                .collect(),
        }
    }
}

/// The parameters one `fully_shard` call manages, all-gathered and reduce-scattered together
/// (`FSDPParamGroup`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardGroup {
    /// The module `fully_shard` was applied to (`""` is the root).
    pub module: String,
    /// Indices into [`ParamLayout::params`], in the group's order: managed modules in
    /// post-order (children before their parent), each module's own parameters in
    /// registration order. A group may be empty.
    pub params: Vec<usize>,
}

/// FSDP2's layout of a whole model at one world size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    /// Number of ranks.
    pub world_size: usize,
    /// Every unique parameter, in model order.
    pub params: Vec<ShardedParam>,
    /// The `fully_shard` groups, in application order.
    pub groups: Vec<ShardGroup>,
}

impl ParamLayout {
    /// The layout `fully_shard` gives `model` when applied to `policy.units` in order on a
    /// 1-D mesh of `world_size` ranks.
    ///
    /// Refuses a policy that is not FSDP2, a strategy other than `FULL_SHARD` (reshard after
    /// forward) or `SHARD_GRAD_OP` (keep unsharded), a unit applied after one of its
    /// ancestors, a 0-dim managed parameter (`fully_shard` refuses scalars), and a tied
    /// parameter whose names fall in different units (PyTorch would shard it twice).
    pub fn new(model: &ModelDesc, policy: &WrapPolicy, world_size: usize) -> Result<Self> {
        check_world_size(world_size)?;
        model.validate()?;
        policy.validate(model)?;
        check_fsdp2_policy(policy)?;
        let names = model.names_with_aliases();
        let owner = owning_units(model, policy, &names)?;
        let params: Vec<ShardedParam> = model
            .params
            .iter()
            .enumerate()
            .map(|(index, p)| ShardedParam {
                name: p.name.clone(),
                index,
                shape: p.shape.clone(),
                dtype: p.dtype,
                requires_grad: p.requires_grad,
                holding: owner[index]
                    .map_or(Holding::Replicated, |group| Holding::Sharded { group }),
                world_size,
            })
            .collect();
        for p in params.iter().filter(|p| p.is_sharded()) {
            check_not_scalar(&p.name, &p.shape)?;
        }
        let groups = group_order(policy, &names, &owner);
        Ok(ParamLayout {
            world_size,
            params,
            groups,
        })
    }

    /// The parameters of group `g`, in the group's order.
    pub fn group_params(&self, g: usize) -> Vec<&ShardedParam> {
        self.groups[g]
            .params
            .iter()
            .map(|&i| &self.params[i])
            .collect()
    }

    /// The parameter with this first name, if any.
    pub fn param(&self, name: &str) -> Option<&ShardedParam> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Every parameter's placement, in model order: what the model state dict holds.
    pub fn placements(&self) -> Vec<TensorPlacement> {
        self.params.iter().map(ShardedParam::placement).collect()
    }

    /// The placements of the trained parameters only: where optimizer state tensors live.
    pub fn optimizer_placements(&self) -> Vec<TensorPlacement> {
        self.params
            .iter()
            .filter(|p| p.requires_grad)
            .map(ShardedParam::placement)
            .collect()
    }
}

fn check_world_size(world_size: usize) -> Result<()> {
    if world_size == 0 {
        return Err(Error::InvalidModel("world size must be at least 1".into()));
    }
    Ok(())
}

fn check_not_scalar(name: &str, shape: &[usize]) -> Result<()> {
    if shape.is_empty() {
        return Err(Error::InvalidModel(format!(
            "fully_shard does not support scalar parameters: `{name}` is 0-dim (PyTorch asks \
             for a 1-D tensor of one element, or ignore its module)"
        )));
    }
    Ok(())
}

/// FSDP2 only, on a 1-D mesh, with the units applied innermost first.
fn check_fsdp2_policy(policy: &WrapPolicy) -> Result<()> {
    if !policy.is_fsdp2() {
        return Err(Error::InvalidModel(format!(
            "the per-parameter layout is FSDP2's; the policy has fsdp_version {}",
            policy.fsdp_version
        )));
    }
    if !matches!(
        policy.sharding_strategy,
        ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp
    ) {
        return Err(Error::Unsupported(format!(
            "fsdp_version 2 with sharding strategy {:?}: only a 1-D mesh (FULL_SHARD or \
             SHARD_GRAD_OP) is supported",
            policy.sharding_strategy
        )));
    }
    for (i, later) in policy.units.iter().enumerate() {
        if let Some(outer) = policy.units[..i].iter().find(|u| prefix_contains(u, later)) {
            return Err(Error::InvalidModel(format!(
                "fully_shard unit `{later}` is applied after its ancestor `{outer}`; apply \
                 fully_shard innermost first"
            )));
        }
    }
    Ok(())
}

/// For each parameter, the group that manages it: the first unit in application order that
/// contains one of its names, unless a name lies in an ignored module. Every name of a tied
/// parameter must reach the same group (or none).
fn owning_units(
    model: &ModelDesc,
    policy: &WrapPolicy,
    names: &[(String, usize)],
) -> Result<Vec<Option<usize>>> {
    let ignored = |n: &str| ancestors(n).any(|m| policy.ignored_modules.iter().any(|i| i == m));
    let mut ignored_param = vec![false; model.params.len()];
    for (n, p) in names {
        ignored_param[*p] |= ignored(n);
    }
    let mut owner: Vec<Option<(usize, &str)>> = vec![None; model.params.len()];
    let mut seen = vec![false; model.params.len()];
    for (n, p) in names {
        let unit = if ignored_param[*p] {
            None
        } else {
            policy.units.iter().position(|u| prefix_contains(u, n))
        };
        if seen[*p] && owner[*p].map(|o| o.0) != unit {
            let first = owner[*p].map_or("no unit".to_string(), |(u, name)| {
                format!("unit `{}` (as `{name}`)", policy.units[u])
            });
            let second = unit.map_or("no unit".to_string(), |u| {
                format!("unit `{}`", policy.units[u])
            });
            return Err(Error::InvalidModel(format!(
                "tied parameter `{}` falls in {first} and, as `{n}`, in {second}; fully_shard \
                 would shard it twice and untie it: apply fully_shard so that all its names \
                 are in one unit",
                model.params[*p].name
            )));
        }
        seen[*p] = true;
        owner[*p] = unit.map(|u| (u, n.as_str()));
    }
    Ok(owner.into_iter().map(|o| o.map(|(u, _)| u)).collect())
}

/// Each group's parameters in `FSDPParamGroup` order: `_get_managed_modules` lists modules in
/// post-order, and each module contributes its own parameters (a tied one at its first name
/// met this way).
fn group_order(
    policy: &WrapPolicy,
    names: &[(String, usize)],
    owner: &[Option<usize>],
) -> Vec<ShardGroup> {
    let post = post_order(names);
    // Each parameter's earliest (module post-order, name position) over its names.
    let mut first: HashMap<usize, (usize, usize)> = HashMap::new();
    for (pos, (n, p)) in names.iter().enumerate() {
        let key = (post[module_of(n)], pos);
        first
            .entry(*p)
            .and_modify(|k| *k = (*k).min(key))
            .or_insert(key);
    }
    let mut keyed: Vec<((usize, usize), usize)> = first.into_iter().map(|(p, k)| (k, p)).collect();
    keyed.sort();
    let mut groups: Vec<ShardGroup> = policy
        .units
        .iter()
        .map(|u| ShardGroup {
            module: u.clone(),
            params: Vec::new(),
        })
        .collect();
    for (_, p) in keyed {
        if let Some(g) = owner[p] {
            groups[g].params.push(p);
        }
    }
    groups
}

/// Post-order position of every module that holds a parameter name or contains one: children
/// (in order of first appearance in `named_parameters`) before their parent, the root last.
fn post_order(names: &[(String, usize)]) -> HashMap<&str, usize> {
    let mut children: HashMap<&str, Vec<&str>> = HashMap::new();
    for (n, _) in names {
        let mut child = module_of(n);
        for parent in ancestors(child) {
            let list = children.entry(parent).or_default();
            if list.contains(&child) {
                break;
            }
            list.push(child);
            child = parent;
        }
    }
    let mut order = HashMap::new();
    // Iterative post-order from the root: (module, next child index).
    let mut stack: Vec<(&str, usize)> = vec![("", 0)];
    while let Some((m, i)) = stack.pop() {
        match children.get(m).and_then(|c| c.get(i)) {
            Some(&c) => {
                stack.push((m, i + 1));
                stack.push((c, 0));
            }
            None => {
                let next = order.len();
                order.insert(m, next);
            }
        }
    }
    order
}
