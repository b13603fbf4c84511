//! Load-side communication: scattering a full dict held by one rank
//! (`scatter_full_optim_state_dict`, rank-0-only `optim_state_dict_to_load`) and gathering the
//! row chunks of a sharded dict (`flatten_sharded_optim_state_dict`).

use super::flatten::{
    flat_param_state_for_rank, flat_param_state_with, flatten_from_source, flatten_tensor_state,
    orig_param_state_for_rank, parameter_names, user_state, ShardSource,
};
use super::plan::{check_digests, layout_digest};
use super::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::flat_param::{ModelLayout, ShardPiece};
use crate::tensor::{DType, HostTensor, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// A state value as broadcast ahead of the tensors: tensors by shape and dtype only.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Skel {
    Tensor { shape: Vec<usize>, dtype: DType },
    Value(Value<HostTensor>),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Skeleton {
    state: Vec<(ParamKey, Vec<(String, Skel)>)>,
    param_groups: Option<Vec<ParamGroup<HostTensor>>>,
}

fn skeleton_of<T: Tensor>(full: &OptimStateDict<T>) -> Result<Skeleton> {
    if let Some(k) = full.state.keys().find(|k| matches!(k, ParamKey::Id(_))) {
        return Err(Error::WrongKeyType {
            dict: "a full optimizer state dict".into(),
            expected: "parameter names".into(),
            key: k.to_string(),
            hint: String::new(),
        });
    }
    let mut state = Vec::with_capacity(full.state.len());
    for (k, st) in &full.state {
        let mut entries = Vec::with_capacity(st.len());
        for (n, v) in st {
            let s = match v {
                Value::Tensor(t) if t.dim() > 0 => Skel::Tensor {
                    shape: t.shape(),
                    dtype: t.dtype(),
                },
                Value::Sharded(_) => {
                    return Err(Error::WrongStateKind {
                        context: "scatter_full_optim_state_dict".into(),
                        param: k.to_string(),
                        state: n.clone(),
                        expected: "a full tensor (scatter takes a full dict)".into(),
                        found: "a sharded tensor".into(),
                    })
                }
                other => Skel::Value(other.try_map(&mut |t: &T| t.to_host())?),
            };
            entries.push((n.clone(), s));
        }
        state.push((k.clone(), entries));
    }
    let param_groups = full
        .param_groups
        .as_ref()
        .map(|gs| {
            gs.iter()
                .map(|g| g.try_map(&mut |t: &T| t.to_host()))
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?;
    Ok(Skeleton {
        state,
        param_groups,
    })
}

/// What one rank gets of one parameter's state, described ahead of the bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Entry {
    /// A positive-dim tensor, scattered after the header.
    Tensor { shape: Vec<usize>, dtype: DType },
    /// Anything else (0-dim tensors included), carried in the header.
    Value(Value<HostTensor>),
}

/// One parameter's state for every rank, in rank order: `None` where a rank gets none.
type Header = Vec<Option<Vec<(String, Entry)>>>;

fn header_of<T: Tensor>(parts: &[Option<ParamState<T>>]) -> Result<Header> {
    parts
        .iter()
        .map(|p| {
            p.as_ref()
                .map(|st| {
                    st.iter()
                        .map(|(n, v)| {
                            let e = match v {
                                Value::Tensor(t) if t.dim() > 0 => Entry::Tensor {
                                    shape: t.shape(),
                                    dtype: t.dtype(),
                                },
                                other => Entry::Value(other.try_map(&mut |t: &T| t.to_host())?),
                            };
                            Ok((n.clone(), e))
                        })
                        .collect()
                })
                .transpose()
        })
        .collect()
}

/// The root cuts every rank's part of each parameter's state with the pure functions of
/// `flatten`; a header (structure and small values) is broadcast, then each tensor state is
/// scattered so that every rank receives only its own part.
struct ScatterSource<'a, T: Tensor> {
    pg: &'a dyn ProcessGroup,
    root: usize,
    full: Option<&'a OptimStateDict<T>>,
    /// Each rank's rank within the layout's shard group (they differ with hybrid sharding).
    layout_ranks: Vec<usize>,
}

impl<T: Tensor> ScatterSource<'_, T> {
    /// Runs one parameter's exchange; `cut(full, r)` is the part of layout rank `r`, computed
    /// on the root once per layout rank.
    fn exchange(
        &self,
        cut: impl Fn(&OptimStateDict<T>, usize) -> Result<Option<ParamState<T>>>,
    ) -> Result<Option<ParamState<T>>> {
        let (rank, world) = (self.pg.rank(), self.pg.world_size());
        let mut parts: Vec<Option<ParamState<T>>> = Vec::new();
        let header: Option<std::result::Result<Header, Error>> = match self.full {
            Some(full) if rank == self.root => {
                let mut by_layout_rank: HashMap<usize, Option<ParamState<T>>> = HashMap::new();
                let cut_all = (0..world)
                    .map(|r| {
                        let lr = self.layout_ranks[r];
                        if let Some(part) = by_layout_rank.get(&lr) {
                            return Ok(part.clone());
                        }
                        let part = cut(full, lr)?;
                        by_layout_rank.insert(lr, part.clone());
                        Ok(part)
                    })
                    .collect::<Result<Vec<_>>>();
                Some(cut_all.and_then(|p| {
                    parts = p;
                    header_of(&parts)
                }))
            }
            _ => None,
        };
        let header: Header = self.pg.broadcast_agreed(header.as_ref(), self.root)?;
        let mut names: Vec<&String> = Vec::new();
        for (n, e) in header.iter().flatten().flatten() {
            if matches!(e, Entry::Tensor { .. }) && !names.contains(&n) {
                names.push(n);
            }
        }
        let mut received: HashMap<&str, T> = HashMap::new();
        for name in names {
            let mine = header[rank]
                .iter()
                .flatten()
                .find(|(n, _)| n == name)
                .map(|(_, e)| e);
            if rank == self.root {
                // The root keeps its own part as it is (a view of the full dict when it can be).
                let hosts: Vec<Option<HostTensor>> = parts
                    .iter()
                    .enumerate()
                    .map(
                        |(r, p)| match p.as_ref().and_then(|p| p.get(name.as_str())) {
                            Some(Value::Tensor(t)) if r != rank && t.dim() > 0 => {
                                t.to_host().map(Some)
                            }
                            _ => Ok(None),
                        },
                    )
                    .collect::<Result<_>>()?;
                let sends: Vec<&[u8]> = hosts
                    .iter()
                    .map(|h| h.as_ref().map_or(&[][..], HostTensor::as_bytes))
                    .collect();
                self.pg.scatter_into(Some(&sends), &mut [], self.root)?;
            } else if let Some(Entry::Tensor { shape, dtype }) = mine {
                // The scatter writes every byte of the buffer (or fails, dropping it).
                let t = HostTensor::filled_by(*dtype, shape, |recv| {
                    self.pg.scatter_into(None, recv, self.root)
                })?;
                received.insert(name, T::from_host(t)?);
            } else {
                self.pg.scatter_into(None, &mut [], self.root)?;
            }
        }
        if rank == self.root {
            return Ok(parts.swap_remove(rank));
        }
        let Some(entries) = &header[rank] else {
            return Ok(None);
        };
        let mut out = ParamState::new();
        for (n, e) in entries {
            let v = match e {
                Entry::Value(v) => v.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?,
                Entry::Tensor { .. } => Value::Tensor(
                    received
                        .remove(n.as_str())
                        .expect("every tensor entry was received"),
                ),
            };
            out.insert(n.clone(), v);
        }
        Ok(Some(out))
    }

    /// User-defined state: every rank receives the root's whole entry.
    fn receive_whole(&self, key: &ParamKey, entries: &[(String, Skel)]) -> Result<ParamState<T>> {
        let world = self.pg.world_size();
        let mut out = ParamState::new();
        for (n, s) in entries {
            let v = match s {
                Skel::Value(v) => v.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?,
                Skel::Tensor { shape, dtype } => match self.full {
                    Some(full) if self.pg.rank() == self.root => {
                        let t = full.state[key][n.as_str()]
                            .as_tensor()
                            .expect("skeleton says tensor")
                            .clone();
                        let host = t.to_host()?;
                        let mut sends = vec![host.as_bytes(); world];
                        sends[self.root] = &[];
                        self.pg.scatter_into(Some(&sends), &mut [], self.root)?;
                        Value::Tensor(t)
                    }
                    _ => {
                        let t = HostTensor::filled_by(*dtype, shape, |recv| {
                            self.pg.scatter_into(None, recv, self.root)
                        })?;
                        Value::Tensor(T::from_host(t)?)
                    }
                },
            };
            out.insert(n.clone(), v);
        }
        Ok(out)
    }
}

impl<T: Tensor> ShardSource<T> for ScatterSource<'_, T> {
    fn flat_param(&mut self, layout: &ModelLayout, f: usize) -> Result<Option<ParamState<T>>> {
        let fl = &layout.flat_params[f];
        self.exchange(|full, r| flat_param_state_for_rank(fl, r, full))
    }

    fn orig_param(
        &mut self,
        layout: &ModelLayout,
        param: usize,
        owner: Option<(usize, usize)>,
    ) -> Result<Option<ParamState<T>>> {
        self.exchange(|full, r| orig_param_state_for_rank(layout, param, owner, r, full))
    }
}

/// Every rank receives the full dict that `root` holds, one parameter's tensors at a time, and
/// flattens and shards it for its own optimizer. Collective over `pg`; `layout_rank` is the
/// rank within the layout's shard group.
pub fn scatter_full<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    layout_rank: usize,
    pg: &dyn ProcessGroup,
    root: usize,
    full: Option<&OptimStateDict<T>>,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    // Every rank checks its optimizer's parameters before the first tensor moves, and all
    // ranks fail with the first failing rank's error.
    let mine = layout_digest(op, layout)
        .and_then(|digest| layout.local_params(params).map(|_| (digest, layout_rank)));
    let all: Vec<(u64, usize)> = pg.all_gather_agreed(mine)?;
    check_digests(op, &all.iter().map(|(d, _)| *d).collect::<Vec<_>>())?;
    let layout_ranks: Vec<usize> = all.iter().map(|(_, r)| *r).collect();
    if let Some(r) = layout_ranks.iter().find(|&&r| r >= layout.world_size) {
        return Err(Error::InvalidCollective {
            op: op.into(),
            rank: pg.rank(),
            reason: format!(
                "a rank reports layout rank {r}, outside the layout's world size {}",
                layout.world_size
            ),
        });
    }
    let skeleton = (pg.rank() == root).then(|| match full {
        Some(f) => skeleton_of(f),
        None => Err(Error::InvalidArgument {
            op: op.into(),
            rank: root,
            reason: "the root rank must pass the full dict".into(),
        }),
    });
    let skeleton: Skeleton = pg.broadcast_agreed(skeleton.as_ref(), root)?;
    let names = parameter_names(layout);
    let mut src = ScatterSource {
        pg,
        root,
        full,
        layout_ranks,
    };
    let mut user = Vec::new();
    for (k, entries) in &skeleton.state {
        if !matches!(k, ParamKey::Name(n) if names.contains(n)) {
            user.push((k.clone(), src.receive_whole(k, entries)?));
        }
    }
    let groups: Option<Vec<ParamGroup<T>>> = skeleton
        .param_groups
        .map(|gs| {
            gs.iter()
                .map(|g| g.try_map(&mut |t: &HostTensor| T::from_host(t.clone())))
                .collect()
        })
        .transpose()?;
    flatten_from_source(layout, &mut src, groups.as_deref(), user, params)
}

/// Per sharded tensor, as each rank exchanges it: the dtype, first element (in the flattened
/// tensor) and element count of its chunk.
type ChunkDesc = (Option<DType>, usize, usize);

/// Digest, (key, state, global shape) of every sharded tensor (equal on every rank), and this
/// rank's chunk of each.
type ShardedPlan = (u64, Vec<(ParamKey, String, Vec<usize>)>, Vec<ChunkDesc>);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ShardedEntry {
    key: ParamKey,
    state: String,
    global_shape: Vec<usize>,
}

/// The sharded tensors of `sharded`, checked to be the same on every rank of `pg`, and every
/// rank's chunk of each (`chunks[rank][entry]`). One object all-gather.
fn exchange_sharded_plan<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
) -> Result<(Vec<ShardedEntry>, Vec<Vec<ChunkDesc>>)> {
    let mut entries = Vec::new();
    let mut chunks = Vec::new();
    for (k, st) in &sharded.state {
        for (n, v) in st {
            if let Value::Sharded(s) = v {
                entries.push(ShardedEntry {
                    key: k.clone(),
                    state: n.clone(),
                    global_shape: s.global_shape.clone(),
                });
                let row: usize = s.global_shape.iter().skip(1).product();
                let first = s.offsets.first().copied().unwrap_or(0).saturating_mul(row);
                chunks.push(match &s.local {
                    Some(t) => (Some(t.dtype()), first, t.numel()),
                    None => (None, first, 0),
                });
            }
        }
    }
    let mine: ShardedPlan = (
        layout_digest(op, layout)?,
        entries
            .iter()
            .map(|e| (e.key.clone(), e.state.clone(), e.global_shape.clone()))
            .collect(),
        chunks,
    );
    let all: Vec<ShardedPlan> = pg.all_gather_object(&mine)?;
    check_digests(op, &all.iter().map(|a| a.0).collect::<Vec<_>>())?;
    let differ: Vec<usize> = (1..all.len()).filter(|&r| all[r].1 != all[0].1).collect();
    if let Some(&r) = differ.first() {
        let (a, b) = (&all[0].1, &all[r].1);
        let first = (0..a.len().max(b.len()))
            .find(|&i| a.get(i) != b.get(i))
            .unwrap_or(0);
        let show = |e: Option<&(ParamKey, String, Vec<usize>)>| {
            e.map_or("nothing".to_string(), |(k, n, s)| {
                format!("state `{n}` of {k} with global shape {s:?}")
            })
        };
        return Err(Error::PlanMismatch {
            op: op.into(),
            reference: 0,
            ranks: differ,
            detail: format!(
                "the sharded dicts differ: at entry {first} rank 0 has {} but rank {r} has {}",
                show(a.get(first)),
                show(b.get(first))
            ),
        });
    }
    Ok((entries, all.into_iter().map(|a| a.2).collect()))
}

/// Gathers the whole tensor of entry `i` from every rank's chunk (every rank gets all of it).
fn gather_whole<T: Tensor>(
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
    e: &ShardedEntry,
    i: usize,
    chunks: &[Vec<ChunkDesc>],
) -> Result<T> {
    let Value::Sharded(s) = &sharded.state[&e.key][e.state.as_str()] else {
        unreachable!("listed by exchange_sharded_plan")
    };
    let local = s.local.as_ref().map(|t| t.to_host()).transpose()?;
    let bytes = local.as_ref().map_or(&[][..], |t| t.as_bytes());
    let dtype = chunks.iter().find_map(|c| c[i].0).unwrap_or(DType::F32);
    let parts = pg.all_gather_bytes(bytes)?;
    let total: usize = parts.iter().map(Vec::len).sum();
    let numel: usize = e.global_shape.iter().product();
    if total != numel * dtype.size() {
        return Err(Error::ShapeMismatch {
            context: format!("gathering sharded state `{}` of {}", e.state, e.key),
            expected: e.global_shape.clone(),
            found: vec![total / dtype.size()],
        });
    }
    let full = HostTensor::filled_by(dtype, &e.global_shape, |dst| {
        let mut at = 0;
        for p in &parts {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok::<(), Error>(())
    })?;
    T::from_host(full)
}

/// Replaces every sharded tensor of a `SHARDED_STATE_DICT` with the whole tensor, gathered
/// from the row chunks of every rank of `pg`.
pub fn gather_sharded<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
) -> Result<OptimStateDict<T>> {
    let (entries, chunks) = exchange_sharded_plan(op, layout, pg, sharded)?;
    let mut out = sharded.clone();
    for (i, e) in entries.iter().enumerate() {
        let full = gather_whole(pg, sharded, e, i, &chunks)?;
        out.state[&e.key].insert(e.state.clone(), Value::Tensor(full));
    }
    Ok(out)
}

/// Where rank `rank`'s shard of `fl` holds member `m`: (offset in the shard, first element of
/// the member, length), all in elements.
fn member_place(pieces: &[ShardPiece], m: usize) -> Option<(usize, usize, usize)> {
    let mut at = 0;
    for p in pieces {
        match *p {
            ShardPiece::Member { member, start, len } if member == m => {
                return Some((at, start, len))
            }
            ShardPiece::Member { len, .. } | ShardPiece::Padding(len) => at += len,
        }
    }
    None
}

/// `optim_state_dict_to_load` of a `SHARDED_STATE_DICT` (and
/// `flatten_sharded_optim_state_dict`): this rank's flattened dict for its optimizer, from every
/// rank's part of a sharded dict saved at this world size and wrapping.
///
/// Same result as [`gather_sharded`] followed by [`super::flatten_optim_state_dict`], without
/// gathering whole tensors: for each flat parameter and tensor state whose members are all
/// row-sharded (the usual case), every rank receives only the element ranges of its own flat
/// shard, straight from the ranks holding them (one `scatter_into` per holding rank that
/// sends anything, for all states at once), into one buffer per state that becomes it.
/// Anything else (unmanaged parameters, `use_orig_params=True`, incomplete or inconsistent
/// states, whose errors the flattening then reports) is gathered whole first, as before.
pub fn load_sharded<T: Tensor>(
    op: &str,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    let (entries, chunks) = exchange_sharded_plan(op, layout, pg, sharded)?;
    // Everything below up to the flattening depends only on what every rank agreed on, so all
    // ranks run the same collectives.
    let (direct, plans) = plan_direct_loads(layout, &entries, &chunks);
    let mut buffers: HashMap<(usize, String), T> = HashMap::new();
    let received = receive_direct(layout, pg, sharded, &entries, &chunks, &plans)?;
    for (plan, buf) in plans.iter().zip(received) {
        buffers.insert((plan.flat, plan.state.to_string()), T::from_host(buf)?);
    }
    // The rest is gathered whole, as `gather_sharded` does.
    let mut full = sharded.clone();
    for (i, e) in entries.iter().enumerate() {
        if !direct[i] {
            let t = gather_whole(pg, sharded, e, i, &chunks)?;
            full.state[&e.key].insert(e.state.clone(), Value::Tensor(t));
        }
    }
    if let Some(k) = full.state.keys().find(|k| matches!(k, ParamKey::Id(_))) {
        return Err(Error::WrongKeyType {
            dict: "a sharded optimizer state dict".into(),
            expected: "parameter names".into(),
            key: k.to_string(),
            hint: String::new(),
        });
    }
    let user = user_state(layout, &full);
    let mut src = GatheredSource {
        full: &full,
        rank: pg.rank(),
        buffers,
    };
    flatten_from_source(layout, &mut src, full.param_groups.as_deref(), user, params)
}

/// One flat parameter's tensor state that every rank receives directly: the entries of its
/// members (entry index, member index) and their common dtype.
struct DirectLoad<'e> {
    flat: usize,
    state: &'e str,
    dtype: DType,
    members: Vec<(usize, usize)>,
}

/// Which sharded entries can be received directly (pure, the same on every rank): a flat
/// parameter's state whose every member is present once, with its model shape, and whose
/// chunks tile it in rank order in one dtype. Returns the per-entry verdict and the plans.
fn plan_direct_loads<'e>(
    layout: &ModelLayout,
    entries: &'e [ShardedEntry],
    chunks: &[Vec<ChunkDesc>],
) -> (Vec<bool>, Vec<DirectLoad<'e>>) {
    let mut member_of: HashMap<&str, (usize, usize)> = HashMap::new();
    if !layout.use_orig_params() {
        for (f, fl) in layout.flat_params.iter().enumerate() {
            for (m, mem) in fl.members.iter().enumerate() {
                member_of.insert(mem.fqn.as_str(), (f, m));
            }
        }
    }
    let mut groups: BTreeMap<(usize, &str), Vec<(usize, usize)>> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        if let ParamKey::Name(n) = &e.key {
            if let Some(&(f, m)) = member_of.get(n.as_str()) {
                groups
                    .entry((f, e.state.as_str()))
                    .or_default()
                    .push((i, m));
            }
        }
    }
    let mut direct = vec![false; entries.len()];
    let mut plans = Vec::new();
    for ((f, state), members) in groups {
        let fl = &layout.flat_params[f];
        let mut seen = vec![false; fl.members.len()];
        let mut dtype: Option<DType> = None;
        let mut ok = members.len() == fl.members.len();
        for &(i, m) in &members {
            let shape = &fl.members[m].shape;
            ok &= !std::mem::replace(&mut seen[m], true);
            ok &= !shape.is_empty() && entries[i].global_shape == *shape;
            // The chunks must tile the tensor in rank order, all of one dtype.
            let mut at = 0;
            for rc in chunks {
                let (dt, first, n) = rc[i];
                if n == 0 {
                    continue;
                }
                ok &= first == at && dt.is_some() && (dtype.is_none() || dtype == dt);
                dtype = dtype.or(dt);
                at += n;
            }
            ok &= at == shape.iter().product::<usize>() && at > 0;
        }
        if let (true, Some(dtype)) = (ok, dtype) {
            for &(i, _) in &members {
                direct[i] = true;
            }
            plans.push(DirectLoad {
                flat: f,
                state,
                dtype,
                members,
            });
        }
    }
    (direct, plans)
}

/// One piece of a row chunk on its way into a flat shard: bytes `src..src + len` of rank
/// `from`'s local chunk of sharded entry `entry` go to bytes `dst..dst + len` of rank `to`'s
/// buffer for planned state `plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Move {
    from: usize,
    to: usize,
    plan: usize,
    entry: usize,
    src: usize,
    dst: usize,
    len: usize,
}

/// Every piece every rank receives of the planned states, in plan order (pure: the same on
/// every rank, from what all of them agreed on).
fn plan_moves(
    layout: &ModelLayout,
    chunks: &[Vec<ChunkDesc>],
    plans: &[DirectLoad<'_>],
) -> Vec<Move> {
    let ws = chunks.len();
    let mut moves = Vec::new();
    for (p, plan) in plans.iter().enumerate() {
        let fl = &layout.flat_params[plan.flat];
        let es = plan.dtype.size();
        let pieces: Vec<Vec<ShardPiece>> = (0..ws).map(|r| fl.shard_pieces(r)).collect();
        for &(entry, m) in &plan.members {
            for (from, held) in chunks.iter().enumerate() {
                let (_, first, n) = held[entry];
                for (to, theirs) in pieces.iter().enumerate() {
                    let Some((off, start, len)) = member_place(theirs, m) else {
                        continue;
                    };
                    let (lo, hi) = (start.max(first), (start + len).min(first + n));
                    if lo < hi {
                        moves.push(Move {
                            from,
                            to,
                            plan: p,
                            entry,
                            src: (lo - first) * es,
                            dst: (off + lo - start) * es,
                            len: (hi - lo) * es,
                        });
                    }
                }
            }
        }
    }
    moves
}

/// Receives this rank's flat shard of every planned state straight from the ranks holding
/// its elements: the pieces a rank holds itself are copied locally, and the others move in
/// one `scatter_into` per holding rank that sends anything, whose part for each rank is the
/// concatenation of every piece that rank gets from it (at most `world_size` round trips and
/// large messages, whatever the number of states). Padding is zero-filled. An inconsistency
/// found on any rank fails every rank with the same error, after the collectives.
fn receive_direct<T: Tensor>(
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
    sharded: &OptimStateDict<T>,
    entries: &[ShardedEntry],
    chunks: &[Vec<ChunkDesc>],
    plans: &[DirectLoad<'_>],
) -> Result<Vec<HostTensor>> {
    let rank = pg.rank();
    let moves = plan_moves(layout, chunks, plans);
    let mut failed: Option<Error> = None;
    let mut locals: HashMap<usize, HostTensor> = HashMap::new();
    let held: std::collections::BTreeSet<usize> = moves
        .iter()
        .filter(|m| m.from == rank)
        .map(|m| m.entry)
        .collect();
    for entry in held {
        match local_chunk(sharded, &entries[entry]) {
            Ok(Some(t)) => drop(locals.insert(entry, t)),
            Ok(None) => {}
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    let piece = |m: &Move| local_piece(&locals, entries, m);
    let mut own: Vec<Vec<&Move>> = vec![Vec::new(); plans.len()];
    for m in moves.iter().filter(|m| m.from == rank && m.to == rank) {
        own[m.plan].push(m);
    }
    // Each buffer's padding zeroed and this rank's own pieces copied in; the rounds below
    // write the rest (every element of a planned state lies in some chunk).
    let mut bufs = Vec::with_capacity(plans.len());
    for (plan, own) in plans.iter().zip(&own) {
        let es = plan.dtype.size();
        let mine = layout.flat_params[plan.flat].shard_pieces(rank);
        let total: usize = mine.iter().map(ShardPiece::len).sum();
        let buf = HostTensor::filled_by(plan.dtype, &[total], |dst| -> Result<()> {
            let mut at = 0;
            for p in &mine {
                if let ShardPiece::Padding(len) = *p {
                    dst[at * es..(at + len) * es].fill(0);
                }
                at += p.len();
            }
            for m in own {
                dst[m.dst..m.dst + m.len].copy_from_slice(piece(m)?);
            }
            Ok(())
        });
        match buf {
            Ok(b) => bufs.push(b),
            Err(e) => {
                failed = failed.or(Some(e));
                bufs.push(HostTensor::zeros(plan.dtype, &[total]));
            }
        }
    }
    let missing = move_pieces(pg, &moves, (&locals, entries), &mut bufs)?;
    pg.agree(failed.or(missing).map_or(Ok(()), Err))?;
    Ok(bufs)
}

/// The rounds of [`receive_direct`]: one `scatter_into` per holding rank that sends anything
/// to another rank, its part for each rank the concatenation of that rank's pieces, which
/// land in `bufs`. A collective's failure is the error (every rank sees it); a piece missing
/// from this rank's local chunks is sent as zeros, so that the collectives
/// stay whole, and its error is returned as `Ok(Some(_))` for the caller to share.
fn move_pieces(
    pg: &dyn ProcessGroup,
    moves: &[Move],
    (locals, entries): (&HashMap<usize, HostTensor>, &[ShardedEntry]),
    bufs: &mut [HostTensor],
) -> Result<Option<Error>> {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let mut failed: Option<Error> = None;
    for q in 0..ws {
        let sends: Vec<&Move> = moves.iter().filter(|m| m.from == q && m.to != q).collect();
        if sends.is_empty() {
            continue;
        }
        let incoming: usize = sends.iter().filter(|m| m.to == rank).map(|m| m.len).sum();
        let mut staging = vec![0u8; incoming];
        if q == rank {
            let mut parts: Vec<Vec<u8>> = vec![Vec::new(); ws];
            for m in &sends {
                let part = &mut parts[m.to];
                match local_piece(locals, entries, m) {
                    Ok(src) => part.extend_from_slice(src),
                    Err(e) => {
                        part.resize(part.len() + m.len, 0);
                        failed = failed.or(Some(e));
                    }
                }
            }
            let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            pg.scatter_into(Some(&parts), &mut staging, q)?;
        } else {
            pg.scatter_into(None, &mut staging, q)?;
        }
        let mut at = 0;
        for m in sends.iter().filter(|m| m.to == rank) {
            bufs[m.plan].bytes_mut()[m.dst..m.dst + m.len]
                .copy_from_slice(&staging[at..at + m.len]);
            at += m.len;
        }
    }
    Ok(failed)
}

/// The bytes move `m` sends from this rank's local chunks `locals` (by entry index).
fn local_piece<'l>(
    locals: &'l HashMap<usize, HostTensor>,
    entries: &[ShardedEntry],
    m: &Move,
) -> Result<&'l [u8]> {
    let src = locals.get(&m.entry).map_or(&[][..], |t| t.as_bytes());
    src.get(m.src..m.src + m.len).ok_or_else(|| {
        Error::Internal(format!(
            "the local chunk of {} has {} bytes, the plan reads {} from byte {}",
            entries[m.entry].key,
            src.len(),
            m.len,
            m.src
        ))
    })
}

/// This rank's local chunk of sharded entry `e`, if it holds one.
fn local_chunk<T: Tensor>(
    sharded: &OptimStateDict<T>,
    e: &ShardedEntry,
) -> Result<Option<HostTensor>> {
    let Value::Sharded(s) = &sharded.state[&e.key][e.state.as_str()] else {
        return Err(Error::Internal(format!(
            "state `{}` of {} was planned as sharded but is not",
            e.state, e.key
        )));
    };
    s.local.as_ref().map(|t| t.to_host()).transpose()
}

/// The flattening source of [`load_sharded`]: the shards received directly, and the rest cut
/// from the dict whose other sharded tensors were gathered whole.
struct GatheredSource<'a, T> {
    full: &'a OptimStateDict<T>,
    rank: usize,
    buffers: HashMap<(usize, String), T>,
}

impl<T: Tensor> ShardSource<T> for GatheredSource<'_, T> {
    fn flat_param(&mut self, layout: &ModelLayout, f: usize) -> Result<Option<ParamState<T>>> {
        let fl = &layout.flat_params[f];
        let (rank, buffers) = (self.rank, &self.buffers);
        flat_param_state_with(fl, self.full, &mut |sname, values| {
            if let Some(b) = buffers.get(&(f, sname.to_string())) {
                // Every member's value is its row chunk (checked on every rank before).
                if values.iter().all(|v| matches!(v, Some(Value::Sharded(_)))) {
                    return Ok(b.clone());
                }
            }
            flatten_tensor_state(fl, rank, sname, values)
        })
    }

    fn orig_param(
        &mut self,
        layout: &ModelLayout,
        param: usize,
        owner: Option<(usize, usize)>,
    ) -> Result<Option<ParamState<T>>> {
        orig_param_state_for_rank(layout, param, owner, self.rank, self.full)
    }
}
