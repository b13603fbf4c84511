//! Membership, order and padding of the flat parameters (`FlatParamHandle` init), as pure
//! arithmetic over a [`ModelDesc`], a [`WrapPolicy`] and the shard-group size.

use super::shard::{chunk_bounds, chunk_size, shard_param_infos, Shard};
use crate::error::{Error, Result};
use crate::model::{ancestors, module_of, ModelDesc, WrapPolicy};
use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

/// Name under which FSDP registers a flat parameter on its unit.
pub(crate) const FLAT_PARAM: &str = "_flat_param";

/// One original parameter inside a flat parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatParamMember {
    /// The name that keys this parameter's optimizer state (first name within the unit).
    pub fqn: String,
    /// Index into [`ModelDesc::params`].
    pub param_index: usize,
    /// Original shape.
    pub shape: Vec<usize>,
    /// Number of elements.
    pub numel: usize,
    /// Whether the parameter is trained.
    pub requires_grad: bool,
    /// First element in the unsharded flat parameter (alignment padding included).
    pub offset: usize,
}

/// Layout of one flat parameter: members, padding and sharding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatParamLayout {
    /// Position among the model's flat parameters (claim order).
    pub index: usize,
    /// Module prefix of the FSDP unit (`""` is the root).
    pub unit: String,
    /// Common dtype of the members.
    pub dtype: DType,
    /// Original parameters in flattening order.
    pub members: Vec<FlatParamMember>,
    /// `_numels_with_padding`: member and padding sizes in order.
    pub numels_with_padding: Vec<usize>,
    /// `_is_padding_mask`, parallel to `numels_with_padding`.
    pub is_padding_mask: Vec<bool>,
    /// `_unpadded_unsharded_size`: every member and padding entry (so with `use_orig_params`
    /// it includes the world-size padding, as in PyTorch).
    pub unpadded_numel: usize,
    /// Size of the shard group.
    pub world_size: usize,
    /// Whether the flat parameter is split (false for `NO_SHARD` and world size 1).
    pub sharded: bool,
}

/// `16 / element size`: alignment in elements for `use_orig_params=True`.
pub fn aligned_numel(dtype: DType) -> usize {
    16 / dtype.size()
}

impl FlatParamLayout {
    /// Builds the layout of one unit from its members (`(fqn, param_index)` in order).
    pub fn new(
        index: usize,
        unit: &str,
        model: &ModelDesc,
        members: &[(String, usize)],
        align: bool,
        world_size: usize,
        sharded: bool,
    ) -> Result<Self> {
        let Some(&(_, first)) = members.first() else {
            return Err(Error::Flatten {
                unit: unit.into(),
                reason: "no parameters to flatten".into(),
            });
        };
        let dtype = model.params[first].dtype;
        let aligned = if align { aligned_numel(dtype) } else { 0 };
        let mut out = FlatParamLayout {
            index,
            unit: unit.to_string(),
            dtype,
            members: Vec::with_capacity(members.len()),
            numels_with_padding: Vec::new(),
            is_padding_mask: Vec::new(),
            unpadded_numel: 0,
            world_size,
            sharded: sharded && world_size > 1,
        };
        let mut total = 0usize;
        for (fqn, pidx) in members {
            let p = &model.params[*pidx];
            if !p.dtype.is_floating_point() {
                return Err(Error::Flatten {
                    unit: unit.into(),
                    reason: format!(
                        "parameter `{fqn}` has dtype {}, FSDP flattens only floating point",
                        p.dtype
                    ),
                });
            }
            if p.dtype != dtype {
                return Err(Error::Flatten {
                    unit: unit.into(),
                    reason: format!(
                        "parameters must share one dtype: `{}` is {dtype} but `{fqn}` is {}",
                        members[0].0, p.dtype
                    ),
                });
            }
            if !align && p.requires_grad != model.params[first].requires_grad {
                return Err(Error::Flatten {
                    unit: unit.into(),
                    reason: format!(
                        "with use_orig_params=False all parameters must share requires_grad, but `{}` and `{fqn}` differ",
                        members[0].0
                    ),
                });
            }
            if aligned > 0 {
                let pad = aligned - total % aligned;
                if pad > 0 && pad < aligned {
                    out.numels_with_padding.push(pad);
                    out.is_padding_mask.push(true);
                    total += pad;
                }
            }
            out.members.push(FlatParamMember {
                fqn: fqn.clone(),
                param_index: *pidx,
                shape: p.shape.clone(),
                numel: p.numel(),
                requires_grad: p.requires_grad,
                offset: total,
            });
            out.numels_with_padding.push(p.numel());
            out.is_padding_mask.push(false);
            total += p.numel();
        }
        if aligned > 0 {
            let pad = world_size - total % world_size;
            if pad > 0 && pad < world_size {
                out.numels_with_padding.push(pad);
                out.is_padding_mask.push(true);
                total += pad;
            }
        }
        out.unpadded_numel = total;
        Ok(out)
    }

    /// Fully qualified name of the flat parameter itself (`block1._flat_param`).
    pub fn fqn(&self) -> String {
        if self.unit.is_empty() {
            FLAT_PARAM.to_string()
        } else {
            format!("{}.{FLAT_PARAM}", self.unit)
        }
    }

    /// Member FQNs in order (the `_OptimStateKey` of the flat parameter).
    pub fn fqns(&self) -> Vec<String> {
        self.members.iter().map(|m| m.fqn.clone()).collect()
    }

    /// Each member's `[begin, end]` (inclusive) offsets in the unsharded flat parameter.
    pub fn member_offsets(&self) -> Vec<(usize, usize)> {
        // An empty member gets (offset, offset - 1) like PyTorch; wrapping is avoided by
        // expressing it as (offset + 1, offset) which `shard_param_infos` treats as empty.
        self.members
            .iter()
            .map(|m| {
                if m.numel == 0 {
                    (m.offset + 1, m.offset)
                } else {
                    (m.offset, m.offset + m.numel - 1)
                }
            })
            .collect()
    }

    /// Elements per rank: `ceil(N / world_size)` when sharded, else `N`.
    pub fn shard_numel(&self) -> usize {
        if self.sharded {
            chunk_size(self.unpadded_numel, self.world_size)
        } else {
            self.unpadded_numel
        }
    }

    /// Size of the all-gathered buffer (`_padded_unsharded_size`).
    pub fn padded_numel(&self) -> usize {
        if self.sharded {
            self.shard_numel() * self.world_size
        } else {
            self.unpadded_numel
        }
    }

    /// Rank `rank`'s shard (the whole flat parameter when not sharded).
    pub fn shard(&self, rank: usize) -> Shard {
        let (start, numel, numel_padded) = if self.sharded {
            chunk_bounds(self.unpadded_numel, rank, self.world_size)
        } else {
            (0, self.unpadded_numel, 0)
        };
        Shard {
            rank,
            start,
            numel,
            numel_padded,
            params: shard_param_infos(&self.member_offsets(), start, numel),
        }
    }

    /// The contiguous pieces of rank `rank`'s padded shard, in order: ranges of members'
    /// elements and runs of padding (alignment, world-size and right padding alike).
    pub fn shard_pieces(&self, rank: usize) -> Vec<ShardPiece> {
        let shard = self.shard(rank);
        let (s, e) = (shard.start, shard.start + shard.numel);
        let mut pieces = Vec::new();
        let (mut off, mut member) = (0, 0);
        for (&n, &pad) in self.numels_with_padding.iter().zip(&self.is_padding_mask) {
            let (lo, hi) = (off.max(s), (off + n).min(e));
            if lo < hi {
                pieces.push(if pad {
                    ShardPiece::Padding(hi - lo)
                } else {
                    ShardPiece::Member {
                        member,
                        start: lo - off,
                        len: hi - lo,
                    }
                });
            }
            member += usize::from(!pad);
            off += n;
        }
        if shard.numel_padded > 0 {
            pieces.push(ShardPiece::Padding(shard.numel_padded));
        }
        pieces
    }

    /// Index of the member with this FQN.
    pub fn member_index(&self, fqn: &str) -> Option<usize> {
        self.members.iter().position(|m| m.fqn == fqn)
    }
}

/// One contiguous piece of a rank's padded shard of a flat parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShardPiece {
    /// Elements `[start, start + len)` of member `member` (flattened).
    Member {
        /// Member index.
        member: usize,
        /// First element within the member.
        start: usize,
        /// Number of elements.
        len: usize,
    },
    /// `len` padding elements (zeros).
    Padding(usize),
}

impl ShardPiece {
    /// Number of elements of the shard this piece covers.
    pub fn len(&self) -> usize {
        match *self {
            ShardPiece::Member { len, .. } | ShardPiece::Padding(len) => len,
        }
    }

    /// Whether the piece covers no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What manages a model parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ownership {
    /// Member `member` of flat parameter `flat`.
    Flat {
        /// Flat parameter index.
        flat: usize,
        /// Member index.
        member: usize,
    },
    /// Not managed by FSDP (outside every unit, or in an ignored module).
    Unmanaged,
}

/// The whole model's FSDP layout for one shard-group size: a pure function of the model, the
/// policy and the world size ([`ModelLayout::new`]). Its fields are read through accessors, so
/// a layout cannot drift from what it was computed from; deserializing one recomputes it from
/// those three and refuses a record whose other fields differ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LayoutRecord")]
pub struct ModelLayout {
    pub(crate) model: ModelDesc,
    pub(crate) policy: WrapPolicy,
    pub(crate) world_size: usize,
    pub(crate) flat_params: Vec<FlatParamLayout>,
    pub(crate) ownership: Vec<Ownership>,
    pub(crate) ignored: Vec<bool>,
    /// Name lookups, built on first use (derived data: not serialized, not compared).
    #[serde(skip)]
    index: LayoutIndex,
}

/// A serialized [`ModelLayout`], checked against the layout its model, policy and world size
/// give before it becomes one.
#[derive(Deserialize)]
struct LayoutRecord {
    model: ModelDesc,
    policy: WrapPolicy,
    world_size: usize,
    flat_params: Vec<FlatParamLayout>,
    ownership: Vec<Ownership>,
    ignored: Vec<bool>,
}

impl TryFrom<LayoutRecord> for ModelLayout {
    type Error = Error;

    fn try_from(r: LayoutRecord) -> Result<Self> {
        let layout = ModelLayout::new(&r.model, &r.policy, r.world_size)?;
        if layout.flat_params != r.flat_params
            || layout.ownership != r.ownership
            || layout.ignored != r.ignored
        {
            return Err(Error::InvalidModel(
                "a serialized layout differs from the one its model, policy and world size give"
                    .into(),
            ));
        }
        Ok(layout)
    }
}

/// Hash maps from names to positions, so lookups cost O(1) instead of a scan of the model.
#[derive(Debug, Clone, Default)]
struct LayoutIndex(std::sync::OnceLock<Lookups>);

#[derive(Debug, Clone)]
struct Lookups {
    /// Every parameter name and tied alias → parameter index.
    param: HashMap<String, usize>,
    /// Unit prefix → flat parameter index.
    flat: HashMap<String, usize>,
}

impl PartialEq for LayoutIndex {
    fn eq(&self, _: &Self) -> bool {
        true // derived from the compared fields
    }
}

impl ModelLayout {
    /// The model.
    pub fn model(&self) -> &ModelDesc {
        &self.model
    }

    /// The wrapping policy.
    pub fn policy(&self) -> &WrapPolicy {
        &self.policy
    }

    /// Size of the shard group the flat parameters are split over.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Flat parameters in claim order (innermost units first).
    pub fn flat_params(&self) -> &[FlatParamLayout] {
        &self.flat_params
    }

    /// Per model parameter, what manages it.
    pub fn ownership(&self) -> &[Ownership] {
        &self.ownership
    }

    /// Per model parameter, whether an ignored module holds it.
    pub fn ignored(&self) -> &[bool] {
        &self.ignored
    }

    /// Computes membership, order and padding of every flat parameter.
    pub fn new(model: &ModelDesc, policy: &WrapPolicy, world_size: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidModel("world size must be at least 1".into()));
        }
        model.validate()?;
        policy.validate(model)?;
        if policy.is_fsdp2() {
            return Err(Error::InvalidModel(
                "the policy is FSDP2 (fsdp_version 2, fully_shard): it has no flat parameters; \
                 use param_layout::ParamLayout"
                    .into(),
            ));
        }
        let names = model.names_with_aliases();
        let ignored_modules: HashSet<&str> =
            policy.ignored_modules.iter().map(String::as_str).collect();
        let mut ignored = vec![false; model.params.len()];
        for (n, p) in &names {
            if ancestors(n).any(|m| ignored_modules.contains(m)) {
                ignored[*p] = true;
            }
        }
        let order = claim_order(&policy.units);
        let sharded = policy.sharding_strategy.shards();
        // A name belongs to the innermost unit containing it, the first of those units to
        // claim; a parameter goes to the first unit in claim order that any of its names
        // belongs to, under its first name in model order within that unit.
        let claim_pos: HashMap<&str, usize> = order
            .iter()
            .enumerate()
            .map(|(pos, &u)| (policy.units[u].as_str(), pos))
            .collect();
        let innermost = |name: &str| -> Option<usize> {
            let mut module = name;
            loop {
                module = module_of(module);
                if let Some(&pos) = claim_pos.get(module) {
                    return Some(pos);
                }
                if module.is_empty() {
                    return None;
                }
            }
        };
        let mut owner_pos: Vec<Option<usize>> = vec![None; model.params.len()];
        let mut name_pos: Vec<Option<usize>> = Vec::with_capacity(names.len());
        for (n, p) in &names {
            let pos = if ignored[*p] { None } else { innermost(n) };
            name_pos.push(pos);
            if let Some(pos) = pos {
                owner_pos[*p] = Some(owner_pos[*p].map_or(pos, |q| q.min(pos)));
            }
        }
        let mut members_of: Vec<Vec<(String, usize)>> = vec![Vec::new(); order.len()];
        let mut taken = vec![false; model.params.len()];
        for ((n, p), pos) in names.iter().zip(&name_pos) {
            if let Some(pos) = *pos {
                if owner_pos[*p] == Some(pos) && !taken[*p] {
                    taken[*p] = true;
                    members_of[pos].push((n.clone(), *p));
                }
            }
        }
        let mut ownership = vec![Ownership::Unmanaged; model.params.len()];
        let mut flat_params = Vec::new();
        for (&u, members) in order.iter().zip(&members_of) {
            if members.is_empty() {
                continue;
            }
            let unit = &policy.units[u];
            let flat = flat_params.len();
            for (m, (_, p)) in members.iter().enumerate() {
                ownership[*p] = Ownership::Flat { flat, member: m };
            }
            flat_params.push(FlatParamLayout::new(
                flat,
                unit,
                model,
                members,
                policy.use_orig_params,
                world_size,
                sharded,
            )?);
        }
        Ok(ModelLayout {
            model: model.clone(),
            policy: policy.clone(),
            world_size,
            flat_params,
            ownership,
            ignored,
            index: LayoutIndex::default(),
        })
    }

    fn lookups(&self) -> &Lookups {
        self.index.0.get_or_init(|| Lookups {
            param: self.model.names_with_aliases().into_iter().collect(),
            flat: self
                .flat_params
                .iter()
                .map(|f| (f.unit.clone(), f.index))
                .collect(),
        })
    }

    /// Index of the parameter with this name or tied alias.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.lookups().param.get(name).copied()
    }

    /// Whether the optimizer sees original parameters (`use_orig_params=True`).
    pub fn use_orig_params(&self) -> bool {
        self.policy.use_orig_params
    }

    /// The flat parameter of a unit, if the unit has one.
    pub fn flat_of_unit(&self, unit: &str) -> Option<&FlatParamLayout> {
        let f = *self.lookups().flat.get(unit)?;
        self.flat_params.get(f)
    }

    /// The name that keys parameter `index`'s optimizer state (its FQN inside its unit, or its
    /// primary name when unmanaged).
    pub fn state_fqn(&self, index: usize) -> &str {
        match self.ownership[index] {
            Ownership::Flat { flat, member } => &self.flat_params[flat].members[member].fqn,
            Ownership::Unmanaged => &self.model.params[index].name,
        }
    }

    /// Map from every state FQN (and alias) to the parameter index.
    pub fn fqn_index(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for (n, p) in self.model.names_with_aliases() {
            m.insert(n, p);
        }
        for i in 0..self.model.params.len() {
            m.insert(self.state_fqn(i).to_string(), i);
        }
        m
    }

    /// What `model.parameters()` of the wrapped model yields, in that order: pre-order over
    /// modules, each module's unmanaged own parameters, then its flat parameter
    /// (use_orig_params=False), then its children; every original parameter in model order
    /// with use_orig_params.
    pub fn parameters_in_model_order(&self) -> Vec<ParamSlot> {
        if self.use_orig_params() {
            return (0..self.model.params.len()).map(ParamSlot::Param).collect();
        }
        // Module tree in first-appearance order.
        let mut modules: HashSet<String> = HashSet::from([String::new()]);
        let mut children: HashMap<String, Vec<String>> = HashMap::new();
        let mut own: HashMap<String, Vec<usize>> = HashMap::new();
        let add_module = |m: &str,
                          modules: &mut HashSet<String>,
                          children: &mut HashMap<String, Vec<String>>| {
            let mut chain = vec![];
            let mut cur = m.to_string();
            while !cur.is_empty() && !modules.contains(&cur) {
                chain.push(cur.clone());
                cur = module_of(&cur).to_string();
            }
            for c in chain.into_iter().rev() {
                children
                    .entry(module_of(&c).to_string())
                    .or_default()
                    .push(c.clone());
                modules.insert(c);
            }
        };
        for (i, p) in self.model.params.iter().enumerate() {
            let m = module_of(&p.name);
            add_module(m, &mut modules, &mut children);
            own.entry(m.to_string()).or_default().push(i);
        }
        for f in &self.flat_params {
            add_module(&f.unit, &mut modules, &mut children);
        }
        let mut out = Vec::new();
        let mut stack = vec![String::new()];
        while let Some(m) = stack.pop() {
            for &i in own.get(&m).map(Vec::as_slice).unwrap_or(&[]) {
                if self.ownership[i] == Ownership::Unmanaged {
                    out.push(ParamSlot::Param(i));
                }
            }
            if let Some(f) = self.flat_of_unit(&m) {
                out.push(ParamSlot::Flat(f.index));
            }
            if let Some(ch) = children.get(&m) {
                for c in ch.iter().rev() {
                    stack.push(c.clone());
                }
            }
        }
        out
    }
}

/// One entry of `model.parameters()` of the wrapped model
/// ([`ModelLayout::parameters_in_model_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamSlot {
    /// The flat parameter with this index in [`ModelLayout::flat_params`].
    Flat(usize),
    /// The model parameter with this index in the model description (unmanaged, or any
    /// parameter with use_orig_params).
    Param(usize),
}

/// Claim order of the units (indices into `units`): a unit claims before every unit that
/// contains it, otherwise in list order — the smallest ready index first (Kahn's algorithm).
fn claim_order(units: &[String]) -> Vec<usize> {
    let pos: HashMap<&str, usize> = units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.as_str(), i))
        .collect();
    // containers[i]: the units that contain unit i; waiting[j]: units inside j not yet placed.
    let mut containers: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
    let mut waiting = vec![0usize; units.len()];
    for (i, u) in units.iter().enumerate() {
        if u.is_empty() {
            continue;
        }
        for m in ancestors(u) {
            if let Some(&j) = pos.get(m) {
                containers[i].push(j);
                waiting[j] += 1;
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..units.len())
        .filter(|&i| waiting[i] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(units.len());
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &j in &containers[i] {
            waiting[j] -= 1;
            if waiting[j] == 0 {
                ready.push(Reverse(j));
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::prefix_contains;

    #[test]
    fn a_model_whose_bytes_overflow_is_refused_not_laid_out() {
        // Shapes that fit one by one but not together: the layout refuses the model with the
        // model's own error instead of overflowing.
        let half = (isize::MAX as usize) / 4 / 2 + 1;
        let m = ModelDesc::new()
            .param("a", &[half], DType::F32)
            .param("b", &[half], DType::F32);
        let e = ModelLayout::new(&m, &WrapPolicy::units::<&str>(&[]), 2).unwrap_err();
        assert!(matches!(e, crate::error::Error::InvalidModel(_)), "{e}");
    }

    /// The definition, by repeated search: the smallest unplaced unit that contains no
    /// unplaced unit.
    fn claim_order_by_search(units: &[String]) -> Vec<usize> {
        let mut placed = vec![false; units.len()];
        let mut order = Vec::new();
        while order.len() < units.len() {
            let next = (0..units.len())
                .find(|&i| {
                    !placed[i]
                        && !(0..units.len())
                            .any(|j| !placed[j] && j != i && prefix_contains(&units[i], &units[j]))
                })
                .unwrap();
            placed[next] = true;
            order.push(next);
        }
        order
    }

    #[test]
    fn claim_order_puts_inner_units_first_and_otherwise_keeps_list_order() {
        let cases: &[&[&str]] = &[
            &["", "a", "a.b", "c", "a.b.c", "ab", "c.d"],
            &["a.b.c", "a", "", "a.b", "x.y", "x"],
            &["z", "y", "x"],
            &[
                "",
                "layers.0",
                "layers.1",
                "layers",
                "layers.10",
                "layers.1.attn",
            ],
        ];
        for units in cases {
            let units: Vec<String> = units.iter().map(|u| u.to_string()).collect();
            assert_eq!(
                claim_order(&units),
                claim_order_by_search(&units),
                "{units:?}"
            );
        }
        let units: Vec<String> = ["", "a", "a.b", "c", "a.b.c"].map(String::from).to_vec();
        assert_eq!(claim_order(&units), vec![3, 4, 2, 1, 0]);
    }
}
