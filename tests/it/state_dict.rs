//! `get_optimizer_state_dict` / `set_optimizer_state_dict`, their model counterparts and
//! `get_state_dict` / `set_state_dict` (`fsdp::state_dict`) on thread ranks, over FSDP2
//! (`FullyShardedModel`) and FSDP1 (`Fsdp`): full and sharded dicts,
//! `cpu_offload`, `broadcast_from_rank0`, loading at another world size, the
//! `_verify_osd_by_load` round trip, and the errors every rank must see together.

use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::state_dict::{ModelStateDict, OptimStateDictApi, StateDictApi, StateDictOptions};
use fsdp::FullyShardedModel;
use fsdp::{
    DType, Error, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamGroup, ParamKey, ParamState,
    Value, WrapPolicy,
};
use std::sync::Arc;

/// A model FSDP2 shards unevenly: 10 embedding rows (3, 3, 3, 1 on 4 ranks), a 2-row
/// parameter (fewer rows than ranks), a bf16 block, a frozen norm, an output head tied to the
/// embedding, and a scalar outside every unit (`extra.scale`, replicated).
fn model() -> ModelDesc {
    let f = DType::F32;
    ModelDesc::new()
        .param("embed.weight", &[10, 4], f)
        .param("layers.0.weight", &[6, 4], f)
        .param("layers.0.bias", &[2], f)
        .frozen_param("layers.0.norm.weight", &[6], f)
        .param("layers.1.weight", &[5, 6], DType::BF16)
        .param("layers.1.bias", &[5], DType::BF16)
        .param("extra.scale", &[3], f)
        .tie("head.weight", "embed.weight")
}

fn fsdp2_policy() -> WrapPolicy {
    let mut p = WrapPolicy::units(&["layers.0", "layers.1", ""]);
    p.fsdp_version = fsdp::FsdpVersion::V2;
    p.ignored_modules = vec!["extra".into()];
    p
}

fn tensor(shape: &[usize], dtype: DType, salt: usize) -> HostTensor {
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n)
        .map(|i| ((i * 7 + salt * 13) % 23) as f64 - 11.5)
        .collect();
    let t = HostTensor::from_slice(&values, shape).unwrap();
    let bytes = fsdp::fully_shard::cast(t.as_bytes(), DType::F64, dtype).unwrap();
    HostTensor::from_bytes(dtype, shape, &bytes).unwrap()
}

/// The full, name-keyed Adam dict of `model()` (no state for the frozen parameter), as
/// `get_optimizer_state_dict(full_state_dict=True)` returns it.
fn full_adam() -> OptimStateDict {
    let mut full = OptimStateDict::default();
    let mut names = Vec::new();
    for (i, p) in model().params.iter().enumerate() {
        names.push(ParamKey::Name(p.name.clone()));
        if !p.requires_grad {
            continue;
        }
        let mut st = ParamState::new();
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
        st.insert(
            "exp_avg".into(),
            Value::Tensor(tensor(&p.shape, p.dtype, i)),
        );
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(tensor(&p.shape, p.dtype, i + 50)),
        );
        full.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    let mut options = indexmap::IndexMap::new();
    options.insert("lr".to_string(), Value::Float(0.01));
    options.insert("amsgrad".to_string(), Value::Bool(false));
    full.param_groups = Some(vec![ParamGroup {
        options,
        params: names,
    }]);
    full
}

fn fsdp2(pg: impl ProcessGroup + 'static) -> FullyShardedModel {
    FullyShardedModel::new(&model(), &fsdp2_policy(), Arc::new(pg)).unwrap()
}

fn assert_bits_eq(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    assert_eq!(
        a.state.keys().collect::<Vec<_>>(),
        b.state.keys().collect::<Vec<_>>(),
        "{what}: keys"
    );
    for (k, sa) in &a.state {
        let sb = &b.state[k];
        assert_eq!(
            sa.keys().collect::<Vec<_>>(),
            sb.keys().collect::<Vec<_>>(),
            "{what}: {k}"
        );
        for (n, va) in sa {
            match (va, &sb[n]) {
                (Value::Tensor(x), Value::Tensor(y)) => assert!(x.bit_eq(y), "{what}: {k}.{n}"),
                (x, y) => assert_eq!(x, y, "{what}: {k}.{n}"),
            }
        }
    }
    assert_eq!(a.param_groups, b.param_groups, "{what}: param groups");
}

#[test]
fn fsdp2_full_dict_loads_on_every_rank_and_gathers_back_bit_for_bit_at_ws_2_3_4() {
    let full = full_adam();
    for ws in [2, 3, 4] {
        let results = ThreadGroup::run(ws, |pg| {
            let m = fsdp2(pg);
            let params = m.optim_params();
            let local =
                m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
            // Each sharded state holds this rank's rows: 10 rows on 4 ranks give 3, 3, 3, 1.
            let emb = &local.state[&ParamKey::Id(0)]["exp_avg"];
            let Value::Tensor(emb) = emb else {
                panic!("a tensor")
            };
            assert_eq!(
                emb.shape()[0],
                fsdp::param_layout::chunk_rows(10, ws, m.rank()).len()
            );
            let back = m.get_optimizer_state_dict(&local, &params, &StateDictOptions::full())?;
            m.verify_optim_state_dict_by_load(&local, &params)?;
            Ok::<_, Error>(back)
        });
        for (r, back) in results.into_iter().enumerate() {
            assert_bits_eq(&back.unwrap(), &full, &format!("ws {ws} rank {r}"));
        }
    }
}

#[test]
fn fsdp2_cpu_offload_gives_the_full_dict_to_rank_0_only() {
    let full = full_adam();
    let results = ThreadGroup::run(3, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let local = m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        let opts = StateDictOptions::full().cpu_offload(true);
        m.get_optimizer_state_dict(&local, &params, &opts)
    });
    let mut results = results.into_iter();
    assert_bits_eq(&results.next().unwrap().unwrap(), &full, "rank 0");
    for other in results {
        let other = other.unwrap();
        assert!(other.state.is_empty() && other.param_groups.is_none());
    }
}

#[test]
fn fsdp2_broadcast_from_rank0_gives_each_rank_what_it_would_slice_itself() {
    let full = full_adam();
    let results = ThreadGroup::run(4, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let sliced = m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        let opts = StateDictOptions::full().broadcast_from_rank0(true);
        let mine = (m.rank() == 0).then_some(&full);
        let received = m.set_optimizer_state_dict(mine, &params, &opts)?;
        Ok::<_, Error>((sliced, received))
    });
    for (r, res) in results.into_iter().enumerate() {
        let (sliced, received) = res.unwrap();
        assert_bits_eq(&received, &sliced, &format!("rank {r}"));
    }
}

#[test]
fn fsdp2_sharded_dict_round_trips_and_reloads_at_another_world_size_through_the_full_dict() {
    let full = full_adam();
    // Save at 4 ranks (sharded, as DCP would write it), load back at 4.
    let results = ThreadGroup::run(4, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let local = m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        let sharded = m.get_optimizer_state_dict(&local, &params, &StateDictOptions::default())?;
        assert!(matches!(
            sharded.state[&ParamKey::Name("embed.weight".into())]["exp_avg"],
            Value::Sharded(_)
        ));
        let again =
            m.set_optimizer_state_dict(Some(&sharded), &params, &StateDictOptions::default())?;
        assert_bits_eq(&again, &local, &format!("rank {}", m.rank()));
        m.get_optimizer_state_dict(&local, &params, &StateDictOptions::full())
    });
    let at4 = results.into_iter().next().unwrap().unwrap();
    // The full dict of 4 ranks loads at 3 and gathers back the same.
    let results = ThreadGroup::run(3, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let local = m.set_optimizer_state_dict(Some(&at4), &params, &StateDictOptions::full())?;
        m.get_optimizer_state_dict(&local, &params, &StateDictOptions::full())
    });
    for back in results {
        assert_bits_eq(&back.unwrap(), &full, "4 -> 3 ranks");
    }
}

#[test]
fn fsdp2_sharded_dict_of_another_world_size_is_refused_on_every_rank() {
    let full = full_adam();
    let sharded_at_2 = ThreadGroup::run(2, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let local = m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        m.get_optimizer_state_dict(&local, &params, &StateDictOptions::default())
    });
    let sharded_at_2: Vec<_> = sharded_at_2.into_iter().map(Result::unwrap).collect();
    let results = ThreadGroup::run(3, |pg| {
        let m = fsdp2(pg);
        let mine = &sharded_at_2[m.rank().min(1)];
        m.set_optimizer_state_dict(Some(mine), &m.optim_params(), &StateDictOptions::default())
    });
    for r in results {
        assert!(matches!(r, Err(Error::ShardedMismatch { .. })), "{r:?}");
    }
}

#[test]
fn fsdp2_bad_options_and_inputs_are_typed_errors_on_every_rank() {
    let full = full_adam();
    let results = ThreadGroup::run(2, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let bad = StateDictOptions::default().broadcast_from_rank0(true);
        assert!(matches!(
            m.set_optimizer_state_dict(Some(&full), &params, &bad),
            Err(Error::InvalidArgument { .. })
        ));
        // Strict: a trained parameter without state.
        let mut missing = full.clone();
        missing
            .state
            .shift_remove(&ParamKey::Name("layers.0.bias".into()));
        let strict = m.set_optimizer_state_dict(Some(&missing), &params, &StateDictOptions::full());
        assert!(
            matches!(strict, Err(Error::MissingState { ref param, .. }) if param.contains("layers.0.bias")),
            "{strict:?}"
        );
        let lenient = StateDictOptions::full().strict(false);
        assert!(m
            .set_optimizer_state_dict(Some(&missing), &params, &lenient)
            .is_ok());
        // Rank 1 holds another optimizer's state: a state name rank 0 lacks.
        let mut local =
            m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        if m.rank() == 1 {
            let st = local.state.get_mut(&ParamKey::Id(0)).unwrap();
            let v = st["exp_avg"].clone();
            st.insert("momentum_buffer".into(), v);
        }
        let differ = m.get_optimizer_state_dict(&local, &params, &StateDictOptions::full());
        assert!(
            matches!(differ, Err(Error::PlanMismatch { .. })),
            "{differ:?}"
        );
        // A key that is not an id of the optimizer, on rank 0 only: every rank fails.
        let mut unknown =
            m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        if m.rank() == 0 {
            let st = unknown.state[&ParamKey::Id(0)].clone();
            unknown.state.insert(ParamKey::Id(99), st);
        }
        let r = m.get_optimizer_state_dict(&unknown, &params, &StateDictOptions::full());
        assert!(matches!(r, Err(Error::InvalidParamGroups { .. })), "{r:?}");
        Ok::<_, Error>(())
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn fsdp1_get_and_set_are_full_optim_state_dict_and_its_scatter() {
    let desc = model();
    // The frozen norm shares a unit with trained parameters: original parameters.
    let mut policy = WrapPolicy::units(&["layers.0", "layers.1", ""]);
    policy.use_orig_params = true;
    let full = full_adam();
    let results = ThreadGroup::run(3, |pg| {
        let f = Fsdp::new(&desc, &policy, Arc::new(pg))?;
        let params = f.optim_params();
        let local = f.shard_full_optim_state_dict(&full, &params)?;
        let opts = StateDictOptions::full().broadcast_from_rank0(true);
        let mine = (f.rank() == 0).then_some(&full);
        let received = f.set_optimizer_state_dict(mine, &params, &opts)?;
        assert_bits_eq(&received, &local, &format!("rank {}", f.rank()));
        let got = f.get_optimizer_state_dict(&local, &params, &StateDictOptions::full())?;
        let theirs = f.full_optim_state_dict(&local, &params, false)?.unwrap();
        assert_bits_eq(&got, &theirs, "get_optimizer_state_dict");
        f.verify_optim_state_dict_by_load(&local, &params)?;
        Ok::<_, Error>(())
    });
    for r in results {
        r.unwrap();
    }
}

/// The whole parameters of `model()` in model order, as `model.state_dict()` holds them
/// (first names only).
fn full_params() -> indexmap::IndexMap<String, Value> {
    model()
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                p.name.clone(),
                Value::Tensor(tensor(&p.shape, p.dtype, 100 + i)),
            )
        })
        .collect()
}

#[test]
fn fsdp2_model_state_dict_loads_gathers_and_reloads_in_every_form_at_ws_3() {
    let full = full_params();
    let results = ThreadGroup::run(3, |pg| {
        let m = fsdp2(pg);
        let local: Vec<HostTensor> = m
            .set_model_state_dict(Some(&full), &StateDictOptions::full())?
            .into_iter()
            .map(Option::unwrap)
            .collect();
        // Whole tensors back on every rank, or on rank 0 only with cpu_offload.
        let back = m.get_model_state_dict(&local, &StateDictOptions::full())?;
        let offload = StateDictOptions::full().cpu_offload(true);
        let rank0 = m.get_model_state_dict(&local, &offload)?;
        // Sharded, and loaded back.
        let sharded = m.get_model_state_dict(&local, &StateDictOptions::default())?;
        let again = m.set_model_state_dict(Some(&sharded), &StateDictOptions::default())?;
        // broadcast_from_rank0 gives the same rows.
        let bcast = StateDictOptions::full().broadcast_from_rank0(true);
        let received = m.set_model_state_dict((m.rank() == 0).then_some(&full), &bcast)?;
        // ignore_frozen_params leaves the frozen norm out.
        let trained = StateDictOptions::full().ignore_frozen_params(true);
        let without_frozen = m.get_model_state_dict(&local, &trained)?;
        assert!(!without_frozen.contains_key("layers.0.norm.weight"));
        for (i, t) in local.iter().enumerate() {
            assert!(
                again[i].as_ref().unwrap().bit_eq(t),
                "sharded round trip {i}"
            );
            assert!(received[i].as_ref().unwrap().bit_eq(t), "broadcast {i}");
        }
        Ok::<_, Error>((m.rank(), back, rank0))
    });
    for r in results {
        let (rank, back, rank0) = r.unwrap();
        // Model order, then the tied alias, as `model.state_dict()` lists it.
        assert_eq!(back.keys().collect::<Vec<_>>(), full_keys_with_alias());
        assert!(back["head.weight"] == back["embed.weight"]);
        for (k, v) in &full {
            let (Value::Tensor(a), Value::Tensor(b)) = (v, &back[k]) else {
                panic!("{k}")
            };
            assert!(a.bit_eq(b), "rank {rank} {k}");
        }
        assert_eq!(rank0.is_empty(), rank != 0, "rank {rank}");
    }
}

#[test]
fn fsdp2_model_state_dict_refuses_missing_parameters_and_wrong_local_tensors() {
    let mut full = full_params();
    full.shift_remove("layers.1.bias");
    let results = ThreadGroup::run(2, |pg| {
        let m = fsdp2(pg);
        let strict = m.set_model_state_dict(Some(&full), &StateDictOptions::full());
        assert!(
            matches!(strict, Err(Error::MissingState { ref param, .. }) if param.contains("layers.1.bias")),
            "{strict:?}"
        );
        let lenient = StateDictOptions::full().strict(false);
        let local = m.set_model_state_dict(Some(&full), &lenient)?;
        assert!(local[5].is_none() && local[4].is_some());
        let too_few: Vec<HostTensor> = local.iter().flatten().cloned().collect();
        let r = m.get_model_state_dict(&too_few, &StateDictOptions::full());
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        Ok::<_, Error>(())
    });
    for r in results {
        r.unwrap();
    }
}

/// `full_params()`'s keys and then the tied head, as `get_model_state_dict` lists them.
fn full_keys_with_alias() -> Vec<&'static str> {
    vec![
        "embed.weight",
        "layers.0.weight",
        "layers.0.bias",
        "layers.0.norm.weight",
        "layers.1.weight",
        "layers.1.bias",
        "extra.scale",
        "head.weight",
    ]
}

/// FSDP1 wrappings of `model()`: flat parameters (the frozen norm trained, since a flat
/// parameter's members share `requires_grad`) and original parameters (norm frozen).
fn fsdp1_cases() -> Vec<(ModelDesc, WrapPolicy)> {
    let mut unfrozen = model();
    for p in &mut unfrozen.params {
        p.requires_grad = true;
    }
    let mut flat = WrapPolicy::units(&["layers.0", "layers.1", ""]);
    flat.ignored_modules = vec!["extra".into()];
    let mut orig = flat.clone();
    orig.use_orig_params = true;
    vec![(unfrozen, flat), (model(), orig)]
}

/// This rank's rows of `t` as `torch.chunk(t, ws)[rank]` cuts them.
fn chunk_rows(t: &HostTensor, ws: usize, rank: usize) -> (usize, HostTensor) {
    let shape = t.shape();
    let row: usize = shape[1..].iter().product();
    let c = shape[0].div_ceil(ws);
    let (a, b) = ((rank * c).min(shape[0]), ((rank + 1) * c).min(shape[0]));
    let mut local = shape.to_vec();
    local[0] = b - a;
    let piece = t.narrow_flat(a * row, (b - a) * row).unwrap();
    (a, piece.reshape(&local).unwrap())
}

#[test]
fn fsdp1_model_state_dict_loads_gathers_chunks_and_reloads_like_shard_tensors_at_ws_3() {
    let full = full_params();
    let whole: Vec<Option<HostTensor>> = full
        .values()
        .map(|v| match v {
            Value::Tensor(t) => Some(t.clone()),
            _ => unreachable!(),
        })
        .collect();
    for (desc, policy) in fsdp1_cases() {
        let results = ThreadGroup::run(3, |pg| {
            let f = Fsdp::new(&desc, &policy, Arc::new(pg))?;
            let (rank, params) = (f.rank(), f.optim_params());
            // Loading the full dict gives what shard_tensors cuts (padding zero-filled).
            let local: Vec<HostTensor> = f
                .set_model_state_dict(Some(&full), &StateDictOptions::full())?
                .into_iter()
                .map(Option::unwrap)
                .collect();
            let cut = fsdp::param_shards::shard_tensors(f.layout(), rank, &params, &whole)?;
            for (id, (got, want)) in local.iter().zip(&cut).enumerate() {
                match want {
                    Some(w) => assert!(got.bit_eq(w), "rank {rank} id {id}"),
                    None => assert_eq!(got.numel(), 0, "rank {rank} id {id}"),
                }
            }
            // Whole tensors back on every rank; on rank 0 only with cpu_offload.
            let back = f.get_model_state_dict(&local, &StateDictOptions::full())?;
            let offload = StateDictOptions::full().cpu_offload(true);
            let rank0 = f.get_model_state_dict(&local, &offload)?;
            // Sharded: each parameter's torch.chunk rows; loads back to the same tensors.
            let sharded = f.get_model_state_dict(&local, &StateDictOptions::default())?;
            let again = f.set_model_state_dict(Some(&sharded), &StateDictOptions::default())?;
            // broadcast_from_rank0: the same tensors from rank 0's dict alone.
            let bcast = StateDictOptions::full().broadcast_from_rank0(true);
            let received = f.set_model_state_dict((rank == 0).then_some(&full), &bcast)?;
            for (id, t) in local.iter().enumerate() {
                assert!(again[id].as_ref().unwrap().bit_eq(t), "sharded {id}");
                assert!(received[id].as_ref().unwrap().bit_eq(t), "broadcast {id}");
            }
            Ok::<_, Error>((rank, back, rank0, sharded))
        });
        for r in results {
            let (rank, back, rank0, sharded) = r.unwrap();
            assert_eq!(back.keys().collect::<Vec<_>>(), full_keys_with_alias());
            assert_eq!(rank0.is_empty(), rank != 0, "rank {rank}");
            for (k, v) in &full {
                let Value::Tensor(want) = v else { panic!() };
                let Value::Tensor(got) = &back[k] else {
                    panic!("{k}")
                };
                assert!(got.bit_eq(want), "rank {rank} full {k}");
                match &sharded[k] {
                    // The ignored module's scalar stays whole on every rank.
                    Value::Tensor(t) => assert!(k == "extra.scale" && t.bit_eq(want), "{k}"),
                    Value::Sharded(sh) => {
                        let (start, rows) = chunk_rows(want, 3, rank);
                        assert_eq!(sh.global_shape, want.shape(), "{k}");
                        assert_eq!(sh.offsets[0], start, "rank {rank} {k}");
                        match &sh.local {
                            Some(t) => assert!(t.bit_eq(&rows), "rank {rank} chunk of {k}"),
                            None => assert_eq!(rows.numel(), 0, "rank {rank} {k}"),
                        }
                    }
                    other => panic!("{k}: {other:?}"),
                }
            }
        }
    }
}

#[test]
fn fsdp1_model_state_dict_refuses_a_missing_parameter_unless_not_strict() {
    let mut full = full_params();
    full.shift_remove("layers.1.bias");
    for (desc, policy) in fsdp1_cases() {
        let orig = policy.use_orig_params;
        let results = ThreadGroup::run(2, |pg| {
            let f = Fsdp::new(&desc, &policy, Arc::new(pg))?;
            // Only rank 0 holds the dict: every rank gets rank 0's error.
            let bcast = StateDictOptions::full().broadcast_from_rank0(true);
            let strict = f.set_model_state_dict((f.rank() == 0).then_some(&full), &bcast);
            assert!(
                matches!(strict, Err(Error::MissingState { ref param, .. }) if param.contains("layers.1.bias")),
                "rank {}: {strict:?}",
                f.rank()
            );
            let lenient = StateDictOptions::full().strict(false);
            let local = f.set_model_state_dict(Some(&full), &lenient)?;
            let names: Vec<Vec<String>> = f
                .layout()
                .local_params(&f.optim_params())?
                .into_iter()
                .map(|l| l.skey.names)
                .collect();
            for (id, members) in names.iter().enumerate() {
                // A flat parameter missing a member is left alone; with original parameters
                // only the missing one is (a rank holding none of it gets its empty view).
                let what = format!("orig {orig} id {id} {members:?}");
                if members.iter().any(|m| m == "layers.1.bias") {
                    let empty_view = |t: &HostTensor| orig && t.numel() == 0;
                    assert!(local[id].as_ref().is_none_or(empty_view), "{what}");
                } else {
                    assert!(local[id].is_some(), "{what}");
                }
            }
            let too_few = vec![HostTensor::scalar(1.0f32)];
            let r = f.get_model_state_dict(&too_few, &StateDictOptions::full());
            assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
            Ok::<_, Error>(())
        });
        for r in results {
            r.unwrap();
        }
    }
}

#[test]
fn get_and_set_state_dict_move_model_and_optimizer_from_fsdp1_at_3_to_fsdp2_at_2_and_back() {
    // FSDP1 (original parameters, 3 ranks) -> full model and optimizer dicts on rank 0 ->
    // FSDP2 (2 ranks) by broadcast_from_rank0 -> full dicts again, equal bit for bit.
    let (desc, policy) = fsdp1_cases().pop().unwrap();
    let (full_model, full_optim) = (full_params(), full_adam());
    let offload = StateDictOptions::full().cpu_offload(true);
    let from_fsdp1 = ThreadGroup::run(3, |pg| {
        let f = Fsdp::new(&desc, &policy, Arc::new(pg))?;
        let params = f.optim_params();
        let (local, osd) = f.set_state_dict(
            Some(&full_model),
            Some(&full_optim),
            &params,
            &StateDictOptions::full(),
        )?;
        let local: Vec<HostTensor> = local.into_iter().map(Option::unwrap).collect();
        f.get_state_dict(&local, &osd, &params, &offload)
    });
    let mut from_fsdp1 = from_fsdp1.into_iter().map(Result::unwrap);
    let (model1, optim1) = from_fsdp1.next().unwrap();
    assert!(from_fsdp1.all(|(m, o)| m.is_empty() && o.state.is_empty()));
    let bcast = StateDictOptions::full().broadcast_from_rank0(true);
    let from_fsdp2 = ThreadGroup::run(2, |pg| {
        let m = fsdp2(pg);
        let params = m.optim_params();
        let rank0 = m.rank() == 0;
        let (local, osd) = m.set_state_dict(
            rank0.then_some(&model1),
            rank0.then_some(&optim1),
            &params,
            &bcast,
        )?;
        let local: Vec<HostTensor> = local.into_iter().map(Option::unwrap).collect();
        m.get_state_dict(&local, &osd, &params, &offload)
    });
    let (model2, optim2) = from_fsdp2.into_iter().next().unwrap().unwrap();
    assert_model_bits_eq(&model1, &model2);
    assert_model_bits_eq(&with_alias(&full_model), &model1);
    // The same dicts; key orders follow each generation's parameter order.
    assert_bits_eq(
        &sorted(&optim1),
        &sorted(&optim2),
        "FSDP1 ws 3 -> FSDP2 ws 2",
    );
    assert_bits_eq(&sorted(&full_optim), &sorted(&optim1), "full -> FSDP1 ws 3");
}

/// `d` with its state and each group's parameters in name order.
fn sorted(d: &OptimStateDict) -> OptimStateDict {
    let mut d = d.clone();
    d.state.sort_keys();
    for g in d.param_groups.iter_mut().flatten() {
        g.params.sort();
    }
    d
}

fn with_alias(full: &ModelStateDict) -> ModelStateDict {
    let mut out = full.clone();
    out.insert("head.weight".into(), full["embed.weight"].clone());
    out
}

fn assert_model_bits_eq(a: &ModelStateDict, b: &ModelStateDict) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in a {
        let (Value::Tensor(x), Value::Tensor(y)) = (v, &b[k]) else {
            panic!("{k}")
        };
        assert!(x.bit_eq(y), "{k}");
    }
}
