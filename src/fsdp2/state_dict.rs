//! The state-dict API over FSDP2: `get_optimizer_state_dict` / `set_optimizer_state_dict`
//! and the model state dict for a [`FullyShardedModel`], with DTensor states as their dim-0
//! rows.

use super::*;

/// One sharded state tensor moved by a collective: the parameter (index in the layout), the
/// state name and its dtype. Ranks exchange these lists to agree before moving bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Moved {
    param: usize,
    state: String,
    dtype: DType,
}

/// The model state dict over FSDP2: the optimizer paths' slicing, gathering and scattering,
/// with each parameter as a one-state entry (`param`).
impl StateDictApi for FullyShardedModel {
    fn get_model_state_dict<T: Tensor>(
        &self,
        local: &[T],
        opts: &StateDictOptions,
    ) -> Result<ModelStateDict<T>> {
        const OP: &str = "get_model_state_dict";
        opts.check(OP, self.rank())?;
        self.agree(self.check_local_params(local, OP))?;
        let to_rank0 = opts.full_state_dict && opts.cpu_offload && self.world_size() > 1;
        let mut out = IndexMap::with_capacity(local.len());
        for (p, t) in self.layout.params.iter().zip(local) {
            if opts.ignore_frozen_params && !p.requires_grad {
                continue;
            }
            let v = if !p.is_sharded() {
                Value::Tensor(t.clone())
            } else if opts.full_state_dict {
                match self.gather_rows(p, t, to_rank0)? {
                    Some(whole) => Value::Tensor(whole),
                    None => continue,
                }
            } else {
                let rows = p.rows(self.rank());
                let mut offsets = vec![0; p.shape.len()];
                offsets[0] = rows.start;
                Value::Sharded(ShardedTensor {
                    global_shape: p.shape.clone(),
                    offsets,
                    local: (!rows.is_empty()).then(|| t.clone()),
                })
            };
            out.insert(p.name.clone(), v);
        }
        if to_rank0 && self.rank() != 0 {
            // PyTorch's offloaded full dict is `{}` on the other ranks.
            out.clear();
        }
        Ok(with_tied_aliases(out, &self.tied))
    }

    fn set_model_state_dict<T: Tensor>(
        &self,
        sd: Option<&ModelStateDict<T>>,
        opts: &StateDictOptions,
    ) -> Result<Vec<Option<T>>> {
        const OP: &str = "set_model_state_dict";
        opts.check(OP, self.rank())?;
        // The model dict as an optimizer dict of one state per parameter (`param`), so that
        // the optimizer paths slice, scatter and check it.
        // A tied alias given beside its parameter holds the same value: loaded once.
        let as_osd = |sd: &ModelStateDict<T>| OptimStateDict {
            state: sd
                .iter()
                .filter(|(k, _)| !self.tied.get(*k).is_some_and(|p| sd.contains_key(p)))
                .map(|(k, v)| {
                    let st: ParamState<T> = [("param".to_string(), v.clone())].into();
                    (ParamKey::Name(k.clone()), st)
                })
                .collect(),
            param_groups: None,
        };
        let osd = sd.map(as_osd);
        let local = if opts.full_state_dict && opts.broadcast_from_rank0 {
            self.receive_from_rank0(osd.as_ref())?
        } else {
            let mine = osd.ok_or_else(|| crate::state_dict::missing_dict(OP, self.rank()));
            let local = mine.and_then(|osd| {
                if opts.full_state_dict {
                    self.slice_full(&osd)
                } else {
                    self.unshard(&osd)
                }
            });
            self.pg.agree(local)?
        };
        let mut by_param: HashMap<usize, T> = HashMap::new();
        for (k, mut st) in local.state {
            let i = self.by_name[&key_name(&k, OP, self.rank())?];
            if let Some(Value::Tensor(t)) = st.shift_remove("param") {
                by_param.insert(i, t);
            }
        }
        let out: Result<Vec<Option<T>>> = self
            .layout
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| match by_param.remove(&i) {
                Some(t) => Ok(Some(t)),
                None if opts.strict => Err(Error::MissingState {
                    context: format!("{OP} on rank {} (strict)", self.rank()),
                    param: format!("`{}`", p.name),
                    state: String::new(),
                }),
                None => Ok(None),
            })
            .collect();
        self.pg.agree(out)
    }
}

impl OptimStateDictApi for FullyShardedModel {
    fn get_optimizer_state_dict<T: Tensor>(
        &self,
        optim: &OptimStateDict<T>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<OptimStateDict<T>> {
        opts.check(GET, self.rank())?;
        let keyed = self.agree(self.by_names(optim, params))?;
        if !opts.full_state_dict {
            return self.as_sharded(keyed);
        }
        let to_rank0 = opts.cpu_offload && self.world_size() > 1;
        let moved = self.agree_on_moves(self.sharded_states(&keyed))?;
        let mut full = keyed;
        for m in &moved {
            let p = &self.layout.params[m.param];
            let st = full
                .state
                .get_mut(&ParamKey::Name(p.name.clone()))
                .expect("agreed state");
            let Some(Value::Tensor(local)) = st.get(&m.state) else {
                unreachable!("listed by sharded_states");
            };
            match self.gather_rows(p, local, to_rank0)? {
                Some(whole) => {
                    st.insert(m.state.clone(), Value::Tensor(whole));
                }
                None => {
                    st.shift_remove(&m.state);
                }
            }
        }
        if to_rank0 && self.rank() != 0 {
            // PyTorch's offloaded full dict is `{}` on the other ranks.
            return Ok(OptimStateDict {
                state: IndexMap::new(),
                param_groups: None,
            });
        }
        Ok(full)
    }

    fn set_optimizer_state_dict<T: Tensor>(
        &self,
        osd: Option<&OptimStateDict<T>>,
        params: &OptimParams,
        opts: &StateDictOptions,
    ) -> Result<OptimStateDict<T>> {
        opts.check(SET, self.rank())?;
        let local = if opts.full_state_dict && opts.broadcast_from_rank0 {
            self.receive_from_rank0(osd)?
        } else {
            let osd = osd.ok_or_else(|| crate::state_dict::missing_dict(SET, self.rank()));
            let local = osd.and_then(|osd| {
                if opts.full_state_dict {
                    self.slice_full(osd)
                } else {
                    self.unshard(osd)
                }
            });
            // Every rank learns the first error, so that none goes on alone.
            self.pg.agree(local)?
        };
        let mut loaded = self
            .pg
            .agree(self.to_optimizer(local, params, opts.strict))?;
        if opts.full_state_dict {
            // PyTorch loads a full dict into an FSDP2 model by flattening and unflattening it
            // (`_flatten_state_dict`), which turns every tuple into a list: the optimizer's
            // `betas` come back as `[0.9, 0.999]` (checked against PyTorch 2.13,
            // tests/it/fsdp2_state_dict_golden.rs).
            for g in loaded.param_groups.iter_mut().flatten() {
                g.options.values_mut().for_each(tuples_as_lists);
            }
        }
        Ok(loaded)
    }
}

/// `v` with every tuple, at any depth, made a list.
fn tuples_as_lists<T>(v: &mut Value<T>) {
    match v {
        Value::Tuple(items) => {
            let mut items = std::mem::take(items);
            items.iter_mut().for_each(tuples_as_lists);
            *v = Value::List(items);
        }
        Value::List(items) => items.iter_mut().for_each(tuples_as_lists),
        _ => {}
    }
}

impl FullyShardedModel {
    /// Every rank's result, or the lowest failing rank's error on every rank.
    fn agree<V>(&self, local: Result<V>) -> Result<V> {
        self.pg.agree(local)
    }

    /// The local dict keyed by parameter names, param groups listing names (tied aliases
    /// resolved to first names). Checks every key against the optimizer's parameters.
    fn by_names<T: Tensor>(
        &self,
        optim: &OptimStateDict<T>,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        let by_id = self.params_by_id(params, GET)?;
        let name_of =
            |k: &ParamKey| -> Result<String> {
                match k {
                    ParamKey::Id(i) => by_id.get(*i).map(|p| p.name.clone()).ok_or_else(|| {
                        Error::InvalidParamGroups {
                            context: format!("{GET} on rank {}", self.rank()),
                            group: None,
                            reason: format!(
                            "state key {i} is not a parameter id of the optimizer ({} parameters)",
                            by_id.len()
                        ),
                        }
                    }),
                    ParamKey::Name(n) => Ok(self.param(n, GET)?.name.clone()),
                }
            };
        let mut state = IndexMap::with_capacity(optim.state.len());
        for (k, st) in &optim.state {
            let name = name_of(k)?;
            let p = self.param(&name, GET)?;
            for (s, v) in st {
                self.is_sharded_state(p, s, v)?;
            }
            state.insert(ParamKey::Name(name), st.clone());
        }
        let param_groups = optim
            .param_groups
            .as_ref()
            .map(|groups| {
                groups
                    .iter()
                    .map(|g| {
                        Ok(ParamGroup {
                            options: g.options.clone(),
                            params: g
                                .params
                                .iter()
                                .map(|k| name_of(k).map(ParamKey::Name))
                                .collect::<Result<_>>()?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        Ok(OptimStateDict {
            state,
            param_groups,
        })
    }

    /// The sharded states of a name-keyed local dict, in layout order then state name.
    fn sharded_states<T: Tensor>(&self, keyed: &OptimStateDict<T>) -> Vec<Moved> {
        let mut out = Vec::new();
        for (k, st) in &keyed.state {
            let i = self.by_name[k.as_name().expect("keyed by names")];
            let p = &self.layout.params[i];
            for (s, v) in st {
                if let Value::Tensor(t) = v {
                    if p.is_sharded() && t.dim() > 0 {
                        out.push(Moved {
                            param: i,
                            state: s.clone(),
                            dtype: t.dtype(),
                        });
                    }
                }
            }
        }
        out.sort_by(|a, b| (a.param, &a.state).cmp(&(b.param, &b.state)));
        out
    }

    /// Checks that every rank moves the same states in the same order (a rank holding
    /// another optimizer's state would otherwise pair the wrong bytes).
    fn agree_on_moves(&self, mine: Vec<Moved>) -> Result<Vec<Moved>> {
        let all = self.pg.all_gather_object(&mine)?;
        let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
        if let Some(&r) = differ.first() {
            let name = |m: &[Moved]| -> Vec<String> {
                m.iter()
                    .map(|m| format!("{}.{}", self.layout.params[m.param].name, m.state))
                    .collect()
            };
            return Err(Error::PlanMismatch {
                op: GET.into(),
                reference: 0,
                ranks: differ.clone(),
                detail: format!(
                    "sharded optimizer states differ: rank 0 has {:?}, rank {r} has {:?}",
                    name(&all[0]),
                    name(&all[r])
                ),
            });
        }
        Ok(mine)
    }

    /// The whole tensor of a sharded state from every rank's local rows: each rank sends its
    /// rows padded to the uniform chunk size (as FSDP2's all-gather does) straight into the
    /// output's buffer, whose first `dim0` rows are the tensor. To every rank, or to rank 0
    /// only (`None` elsewhere).
    fn gather_rows<T: Tensor>(
        &self,
        p: &ShardedParam,
        local: &T,
        to_rank0: bool,
    ) -> Result<Option<T>> {
        let ws = self.world_size();
        let dtype = local.dtype();
        let c = chunk_size(p.shape[0], ws);
        let host = local.to_host()?;
        let send = padded_rows(host.as_bytes(), c * p.row_numel() * dtype.size());
        let receives = !to_rank0 || self.rank() == 0;
        let mut padded_shape = p.shape.clone();
        padded_shape[0] = c * ws;
        let gathered = if receives {
            Some(HostTensor::filled_by(dtype, &padded_shape, |recv| {
                if to_rank0 {
                    self.pg.gather_into(&send, Some(recv), 0)
                } else {
                    self.pg.all_gather_into(&send, recv)
                }
            })?)
        } else {
            self.pg.gather_into(&send, None, 0)?;
            None
        };
        gathered
            .map(|g| {
                let whole = g
                    .narrow_flat(0, p.shape[0] * p.row_numel())?
                    .reshape(&p.shape)?;
                T::from_host(whole)
            })
            .transpose()
    }

    /// The sharded form: every sharded state as this rank's piece of the whole tensor.
    fn as_sharded<T: Tensor>(&self, mut keyed: OptimStateDict<T>) -> Result<OptimStateDict<T>> {
        let rank = self.rank();
        for (k, st) in keyed.state.iter_mut() {
            let p = &self.layout.params[self.by_name[k.as_name().expect("keyed by names")]];
            for (_, v) in st.iter_mut() {
                if let Value::Tensor(t) = v {
                    if p.is_sharded() && t.dim() > 0 {
                        let rows = p.rows(rank);
                        let mut offsets = vec![0; p.shape.len()];
                        offsets[0] = rows.start;
                        let local = (!rows.is_empty()).then(|| t.clone());
                        *v = Value::Sharded(ShardedTensor {
                            global_shape: p.shape.clone(),
                            offsets,
                            local,
                        });
                    }
                }
            }
        }
        Ok(keyed)
    }

    /// A full dict every rank holds: this rank's rows of each sharded state (no
    /// communication; `_distribute_state_dict`).
    pub(super) fn slice_full<T: Tensor>(
        &self,
        osd: &OptimStateDict<T>,
    ) -> Result<OptimStateDict<T>> {
        let mut out = osd.clone();
        for (k, st) in out.state.iter_mut() {
            let name = key_name(k, SET, self.rank())?;
            let p = self.param(&name, SET)?;
            for (s, v) in st.iter_mut() {
                if let Value::Tensor(t) = v {
                    if p.is_sharded() && t.dim() > 0 {
                        check_shape(p, t, &p.shape, &format!("full state `{s}`"))?;
                        *v = Value::Tensor(self.local_rows(&p.name, t)?);
                    }
                }
            }
        }
        Ok(out)
    }

    /// A sharded dict (this rank's pieces, as `get` or a DCP load gives them): the local
    /// tensors, after checking each piece is the one this rank holds.
    fn unshard<T: Tensor>(&self, osd: &OptimStateDict<T>) -> Result<OptimStateDict<T>> {
        let rank = self.rank();
        let mut out = osd.clone();
        for (k, st) in out.state.iter_mut() {
            let name = key_name(k, SET, rank)?;
            let p = self.param(&name, SET)?;
            for (s, v) in st.iter_mut() {
                let Value::Sharded(sh) = v else {
                    self.is_sharded_state(p, s, v)?;
                    continue;
                };
                let rows = p.rows(rank);
                let mismatch = |reason: String| Error::ShardedMismatch {
                    rank,
                    key: name.clone(),
                    state: s.clone(),
                    reason,
                };
                if sh.global_shape != p.shape {
                    return Err(mismatch(format!(
                        "global shape {:?}, but the parameter's is {:?}",
                        sh.global_shape, p.shape
                    )));
                }
                let local = match &sh.local {
                    Some(t)
                        if sh.offsets.first() == Some(&rows.start)
                            && t.shape().first() == Some(&rows.len()) =>
                    {
                        t.clone()
                    }
                    None if rows.is_empty() => {
                        let mut shape = p.shape.clone();
                        shape[0] = 0;
                        T::zeros(self.dtype_of(sh, p), &shape)?
                    }
                    _ => {
                        return Err(mismatch(format!(
                            "the piece of {:?} rows at row {:?} is not this rank's (rows {rows:?} at world size {}); a sharded dict loads at the world size it was saved at",
                            sh.local.as_ref().and_then(|t| t.shape().first().copied()),
                            sh.offsets.first(),
                            self.world_size()
                        )))
                    }
                };
                check_shape(
                    p,
                    &local,
                    &p.local_shape(rank),
                    &format!("sharded state `{s}`"),
                )?;
                *v = Value::Tensor(local);
            }
        }
        Ok(out)
    }

    fn dtype_of<T: Tensor>(&self, sh: &ShardedTensor<T>, p: &ShardedParam) -> DType {
        sh.local.as_ref().map_or(p.dtype, |t| t.dtype())
    }

    /// `broadcast_from_rank0`: rank 0 sends the dict's structure (non-tensor values, 0-dim
    /// tensors, the dtype of every sharded state) to every rank, then each sharded state's
    /// rows by one scatter, so each rank receives only its own rows.
    fn receive_from_rank0<T: Tensor>(
        &self,
        osd: Option<&OptimStateDict<T>>,
    ) -> Result<OptimStateDict<T>> {
        let root = self.rank() == 0;
        let skeleton: Result<OptimStateDict<HostTensor>> = match (root, osd) {
            (true, Some(osd)) => self.skeleton(osd),
            (true, None) => Err(Error::InvalidArgument {
                op: SET.into(),
                rank: 0,
                reason: "rank 0 must pass the full dict with broadcast_from_rank0".into(),
            }),
            (false, _) => Ok(OptimStateDict::default()),
        };
        let skeleton = self.pg.broadcast_agreed(root.then_some(&skeleton), 0)?;
        let mut out: OptimStateDict<T> =
            skeleton.try_map(&mut |t: &HostTensor| T::from_host(t.clone()))?;
        for (k, st) in out.state.iter_mut() {
            let p = self.param(&key_name(k, SET, self.rank())?, SET)?;
            for (s, v) in st.iter_mut() {
                let Value::Sharded(sh) = v else { continue };
                let dtype = self.dtype_of(sh, p);
                let full = osd
                    .filter(|_| root)
                    .and_then(|o| o.state.get(k))
                    .and_then(|st| st.get(s));
                *v = Value::Tensor(self.scatter_rows(p, dtype, full)?);
            }
        }
        Ok(out)
    }

    /// Rank 0's dict without the sharded tensors' data: each becomes a `Sharded` marker with
    /// a 0-row local tensor carrying its dtype.
    fn skeleton<T: Tensor>(&self, osd: &OptimStateDict<T>) -> Result<OptimStateDict<HostTensor>> {
        let mut out: OptimStateDict<HostTensor> = osd.try_map(&mut |t: &T| {
            if t.dim() > 0 {
                HostTensor::from_bytes(t.dtype(), &[0], &[])
            } else {
                t.to_host()
            }
        })?;
        for (k, st) in out.state.iter_mut() {
            let p = self.param(&key_name(k, SET, 0)?, SET)?;
            for (s, v) in st.iter_mut() {
                let Value::Tensor(t) = v else { continue };
                if t.dim() == 0 {
                    continue;
                }
                let whole = &osd.state[k][s.as_str()];
                let Value::Tensor(whole) = whole else {
                    unreachable!("same structure")
                };
                check_shape(p, whole, &p.shape, &format!("full state `{s}`"))?;
                if !p.is_sharded() {
                    *v = Value::Tensor(whole.to_host()?);
                    continue;
                }
                *v = Value::Sharded(ShardedTensor {
                    global_shape: p.shape.clone(),
                    offsets: vec![0; p.shape.len()],
                    local: Some(HostTensor::from_bytes(t.dtype(), &[0], &[])?),
                });
            }
        }
        Ok(out)
    }

    /// This rank's rows of a sharded state rank 0 holds whole (`full`, on rank 0 only): rank
    /// 0 sends each other rank exactly its rows, slices of the tensor, received straight into
    /// that rank's local tensor; rank 0 keeps a view of its own rows (sharing the full dict's
    /// storage, as `shard_full_optim_state_dict`'s results do), so no byte of its part is
    /// copied.
    fn scatter_rows<T: Tensor>(
        &self,
        p: &ShardedParam,
        dtype: DType,
        full: Option<&Value<T>>,
    ) -> Result<T> {
        let rank = self.rank();
        let row_bytes = p.row_numel() * dtype.size();
        let host = match full {
            Some(Value::Tensor(t)) if rank == 0 => Some(t.to_host()?),
            _ => None,
        };
        let parts: Option<Vec<&[u8]>> = host.as_ref().map(|h| {
            let bytes = h.as_bytes();
            (0..self.world_size())
                .map(|r| match r {
                    0 => &[][..],
                    _ => {
                        let rows = p.rows(r);
                        &bytes[rows.start * row_bytes..rows.end * row_bytes]
                    }
                })
                .collect()
        });
        let rows = p.rows(rank);
        let shape = p.local_shape(rank);
        let local = match &host {
            Some(h) => {
                self.pg.scatter_into(parts.as_deref(), &mut [], 0)?;
                h.narrow_flat(rows.start * p.row_numel(), rows.len() * p.row_numel())?
                    .reshape(&shape)?
            }
            None => {
                HostTensor::filled_by(dtype, &shape, |recv| self.pg.scatter_into(None, recv, 0))?
            }
        };
        T::from_host(local)
    }

    /// The name-keyed local dict as the optimizer holding `params` loads it: keys are its
    /// ids, in its parameter order; each of its param groups takes the options of the loaded
    /// group holding its parameters. With `strict`, a trained parameter without state is an
    /// error ([`Error::MissingState`]), as in PyTorch's `_split_optim_state_dict`.
    pub(super) fn to_optimizer<T: Tensor>(
        &self,
        local: OptimStateDict<T>,
        params: &OptimParams,
        strict: bool,
    ) -> Result<OptimStateDict<T>> {
        let by_id = self.params_by_id(params, SET)?;
        let mut state_of: BTreeMap<String, ParamState<T>> = BTreeMap::new();
        for (k, st) in local.state {
            let name = self
                .param(&key_name(&k, SET, self.rank())?, SET)?
                .name
                .clone();
            state_of.insert(name, st);
        }
        let mut state = IndexMap::new();
        for (id, p) in by_id.iter().enumerate() {
            match state_of.remove(&p.name) {
                Some(st) => {
                    state.insert(ParamKey::Id(id), st);
                }
                None if strict && p.requires_grad => {
                    return Err(Error::MissingState {
                        context: format!("{SET} on rank {} (strict)", self.rank()),
                        param: format!("`{}`", p.name),
                        state: String::new(),
                    })
                }
                None => {}
            }
        }
        let loaded = local.param_groups.unwrap_or_default();
        let group_of = |name: &str| {
            loaded.iter().position(|g| {
                g.params.iter().any(|k| {
                    k.as_name()
                        .and_then(|n| self.by_name.get(n))
                        .is_some_and(|&i| self.layout.params[i].name == name)
                })
            })
        };
        let mut groups = Vec::with_capacity(params.groups.len());
        let mut id = 0;
        for (g, group) in params.groups.iter().enumerate() {
            let ids: Vec<ParamKey> = (id..id + group.len()).map(ParamKey::Id).collect();
            let source = by_id[id..id + group.len()]
                .iter()
                .find_map(|p| group_of(&p.name))
                .or(if loaded.len() == params.groups.len() {
                    Some(g)
                } else {
                    None
                });
            let Some(source) = source else {
                return Err(Error::ParamGroupsMismatch {
                    context: format!("{SET} on rank {}", self.rank()),
                    group: None,
                    expected: params.groups.len(),
                    found: loaded.len(),
                });
            };
            groups.push(ParamGroup {
                options: loaded[source].options.clone(),
                params: ids,
            });
            id += group.len();
        }
        Ok(OptimStateDict {
            state,
            param_groups: Some(groups),
        })
    }
}

/// `bytes` padded with zeros to `len` (borrowed when already that long).
fn padded_rows(bytes: &[u8], len: usize) -> std::borrow::Cow<'_, [u8]> {
    if bytes.len() == len {
        return std::borrow::Cow::Borrowed(bytes);
    }
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&bytes[..bytes.len().min(len)]);
    v.resize(len, 0);
    std::borrow::Cow::Owned(v)
}

fn key_name(k: &ParamKey, op: &str, rank: usize) -> Result<String> {
    k.as_name()
        .map(str::to_string)
        .ok_or_else(|| Error::WrongKeyType {
            dict: format!("the optimizer state dict given to {op} on rank {rank}"),
            expected: "parameter names".into(),
            key: k.to_string(),
            hint: "; get_optimizer_state_dict makes one from the local dict".into(),
        })
}
