//! Ports of the scenario matrix of PyTorch's `test_fsdp_optim_state.py`, on thread ranks.
//!
//! The core check of each: an FSDP-wrapped run and an unwrapped run with the same gradients
//! give equal optimizer state (up to key type), and loading a dict saved under one
//! configuration into another equals that configuration's own optimizer state.

use crate::common;

use common::*;
use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::flat_param::ModelLayout;
use fsdp::optim::{Optimizer, Sgd, SgdConfig};
use fsdp::optim_state::chunk_dim0;
use fsdp::{
    Fsdp, ModelDesc, OptimParams, OptimStateDict, OptimStateDictConfig, OptimStateKeyType,
    ParamKey, ShardingStrategy, StateDictType, Value, WrapPolicy,
};
use std::sync::Arc;

const STEPS: usize = 3;

fn make_sgd(input: &OptimParams) -> Box<dyn Optimizer> {
    Box::new(
        Sgd::new(
            input.clone(),
            SgdConfig {
                lr: 0.01,
                momentum: 0.9.into(),
                ..SgdConfig::default()
            },
        )
        .unwrap(),
    )
}

/// Steps `optim` on this rank's slots with the synthetic gradients; `skip(step, param)` drops
/// gradients (unused parameters).
fn train_with(
    layout: &ModelLayout,
    rank: usize,
    input: &OptimParams,
    optim: &mut dyn Optimizer,
    steps: usize,
    skip: &dyn Fn(usize, &str) -> bool,
) {
    let mut slots = Slots::new(layout, rank, input);
    for s in 0..steps {
        let mut full = fsdp::param_shards::synthetic_grads(layout, s);
        for (p, g) in layout.model().params.iter().zip(full.iter_mut()) {
            if skip(s, &p.name) {
                *g = None;
            }
        }
        let grads = fsdp::param_shards::shard_tensors(layout, rank, input, &full).unwrap();
        optim.step(&mut slots.params, &grads).unwrap();
    }
}

/// A trained rank: its façade, optimizer input and local optimizer state dict.
struct Run {
    fsdp: Fsdp,
    input: OptimParams,
    local: OptimStateDict,
}

fn train_wrapped(
    pg: Arc<dyn ProcessGroup>,
    model: &ModelDesc,
    policy: &WrapPolicy,
    input: impl Fn(&ModelLayout, usize) -> OptimParams,
) -> Run {
    let fsdp = Fsdp::new(model, policy, pg).unwrap();
    let input = input(fsdp.layout(), fsdp.rank());
    let mut optim = make_adam(&input);
    train_with(
        fsdp.layout(),
        fsdp.rank(),
        &input,
        optim.as_mut(),
        STEPS,
        &|_, _| false,
    );
    Run {
        fsdp,
        local: optim.state_dict(),
        input,
    }
}

/// The unwrapped model trained with the same gradients, rekeyed to names.
fn unwrapped_reference(
    model: &ModelDesc,
    wrapped: &ModelLayout,
    wrapped_input: &OptimParams,
) -> OptimStateDict {
    let layout = unwrapped(model);
    let input = unwrapped_input(wrapped, wrapped_input);
    let mut optim = make_adam(&input);
    train_with(&layout, 0, &input, optim.as_mut(), STEPS, &|_, _| false);
    fsdp::optim_state::rekey_optim_state_dict(
        &optim.state_dict(),
        OptimStateKeyType::ParamName,
        &layout,
        &input,
    )
    .unwrap()
}

/// Compares a sharded dict's local chunks with the chunks of the full reference.
fn assert_sharded_matches(
    sharded: &OptimStateDict,
    reference: &OptimStateDict,
    rank: usize,
    ws: usize,
) {
    assert_eq!(sharded.state.len(), reference.state.len());
    for (k, st) in &sharded.state {
        for (n, v) in st {
            let r = &reference.state[k][n.as_str()];
            match (v, r) {
                (Value::Sharded(s), Value::Tensor(full)) => {
                    let want = chunk_dim0(full, rank, ws).unwrap();
                    assert_eq!(s.global_shape, full.shape());
                    assert_eq!(s.offsets, want.offsets, "{k} {n}");
                    match (&s.local, &want.local) {
                        (Some(a), Some(b)) => {
                            assert!(a.bit_eq(b), "chunk of `{n}` of {k} on rank {rank}")
                        }
                        (None, None) => {}
                        other => panic!("chunk presence differs for {k} {n}: {other:?}"),
                    }
                }
                _ => assert_eq!(v, r, "state `{n}` of {k}"),
            }
        }
    }
}

#[test]
fn full_and_sharded_dicts_equal_an_unwrapped_run() {
    // test_optim_state_dict_nested: {FULL, SHARDED} × groups × rank0_only × reversed input.
    for sharded in [false, true] {
        for multiple in [false, true] {
            for rank0_only in [false, true] {
                for diff in [false, true] {
                    if sharded && rank0_only {
                        continue; // not supported by PyTorch either
                    }
                    let model = nested_model();
                    let policy = wrap(false);
                    let ws = 2;
                    ThreadGroup::run(ws, |pg| {
                        let run = train_wrapped(Arc::new(pg), &model, &policy, |l, r| {
                            nested_optim_input(l, multiple, diff, r)
                        });
                        let rank = run.fsdp.rank();
                        let reference = unwrapped_reference(
                            &model,
                            run.fsdp.layout(),
                            &nested_optim_input(run.fsdp.layout(), multiple, false, 0),
                        );
                        let what = format!("sharded={sharded} multiple={multiple} rank0_only={rank0_only} diff={diff} rank {rank}");
                        if sharded {
                            let osd = run
                                .fsdp
                                .sharded_optim_state_dict(&run.local, &run.input)
                                .unwrap();
                            assert_same_groups(&osd, &reference, false, &what);
                            assert_sharded_matches(&osd, &reference, rank, ws);
                        } else {
                            let osd = run
                                .fsdp
                                .full_optim_state_dict(&run.local, &run.input, rank0_only)
                                .unwrap();
                            if rank0_only && rank != 0 {
                                assert!(osd.is_none(), "{what}: non-zero ranks get nothing");
                                return;
                            }
                            let osd = osd.unwrap();
                            assert_same_groups(&osd, &reference, false, &what);
                            assert_same_state(&osd, &reference, &what);
                        }
                    });
                }
            }
        }
    }
}

#[test]
fn odd_world_size_and_world_size_one_match_unwrapped() {
    for ws in [1, 3, 5] {
        let model = nested_model();
        let policy = wrap(false);
        ThreadGroup::run(ws, |pg| {
            let run = train_wrapped(Arc::new(pg), &model, &policy, |l, r| {
                nested_optim_input(l, true, true, r)
            });
            let reference = unwrapped_reference(
                &model,
                run.fsdp.layout(),
                &nested_optim_input(run.fsdp.layout(), true, false, 0),
            );
            let osd = run
                .fsdp
                .full_optim_state_dict(&run.local, &run.input, false)
                .unwrap()
                .unwrap();
            assert_same_state(&osd, &reference, &format!("world size {ws}"));
        });
    }
}

/// How the saved dict travels to the new model (`_OSDCommMethod`).
#[derive(Clone, Copy, Debug)]
enum Comm {
    /// full dict on every rank, `shard_full_optim_state_dict`
    BroadcastFull,
    /// full dict on rank 0, `scatter_full_optim_state_dict`
    ScatterFull,
    /// `sharded_optim_state_dict` + `flatten_sharded_optim_state_dict`
    FlattenSharded,
}

/// `_test_load_optim_state`: train at 4 ranks, save; build a model on (possibly) the even
/// ranks with (possibly) another wrapping and reversed inputs, train it, load the first dict
/// into it; it must equal the second model's own optimizer state, keys included.
fn load_scenario(
    model: &ModelDesc,
    policy1: &WrapPolicy,
    policy2: &WrapPolicy,
    comm: Comm,
    multiple: bool,
    diff: bool,
    halve: bool,
) {
    let input_for = |multiple: bool, diff: bool| {
        move |l: &ModelLayout, r: usize| {
            if l.model().params.len() == nested_model().params.len() {
                nested_optim_input(l, multiple, diff, r)
            } else {
                OptimParams::of_model(l)
            }
        }
    };
    ThreadGroup::run(4, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let run1 = train_wrapped(pg.clone(), model, policy1, input_for(multiple, false));
        let rank = pg.rank();
        let saved1 = match comm {
            Comm::BroadcastFull => run1
                .fsdp
                .full_optim_state_dict(&run1.local, &run1.input, false)
                .unwrap(),
            Comm::ScatterFull => run1
                .fsdp
                .full_optim_state_dict(&run1.local, &run1.input, true)
                .unwrap(),
            Comm::FlattenSharded => Some(
                run1.fsdp
                    .sharded_optim_state_dict(&run1.local, &run1.input)
                    .unwrap(),
            ),
        };
        let new_pg = if halve {
            pg.new_subgroup(&[0, 2]).unwrap()
        } else {
            Some(pg.clone())
        };
        let Some(new_pg) = new_pg else { return };
        let run2 = train_wrapped(new_pg, model, policy2, input_for(multiple, diff));
        let saved2 = match comm {
            Comm::BroadcastFull => run2
                .fsdp
                .full_optim_state_dict(&run2.local, &run2.input, false)
                .unwrap(),
            Comm::ScatterFull => run2
                .fsdp
                .full_optim_state_dict(&run2.local, &run2.input, true)
                .unwrap(),
            Comm::FlattenSharded => Some(
                run2.fsdp
                    .sharded_optim_state_dict(&run2.local, &run2.input)
                    .unwrap(),
            ),
        };
        let load = |saved: Option<&OptimStateDict>| match comm {
            Comm::BroadcastFull => run2
                .fsdp
                .shard_full_optim_state_dict(saved.unwrap(), &run2.input)
                .unwrap(),
            Comm::ScatterFull => run2
                .fsdp
                .scatter_full_optim_state_dict(saved.filter(|_| rank == 0), &run2.input)
                .unwrap(),
            Comm::FlattenSharded => run2
                .fsdp
                .flatten_sharded_optim_state_dict(saved.unwrap(), &run2.input)
                .unwrap(),
        };
        let what = format!("{comm:?} multiple={multiple} diff={diff} halve={halve} rank {rank}");
        let loaded2 = load(saved2.as_ref());
        assert_same_groups(&loaded2, &run2.local, true, &what);
        assert_same_state(&loaded2, &run2.local, &what);
        let loaded1 = load(saved1.as_ref());
        assert_same_groups(&loaded1, &run2.local, true, &what);
        assert_same_state(&loaded1, &run2.local, &what);
    });
}

#[test]
fn shard_full_optim_state_dict_nested() {
    for wrap_alt_ in [false, true] {
        for multiple in [false, true] {
            for diff in [false, true] {
                let p2 = if wrap_alt_ { wrap_alt() } else { wrap(false) };
                load_scenario(
                    &nested_model(),
                    &wrap(false),
                    &p2,
                    Comm::BroadcastFull,
                    multiple,
                    diff,
                    false,
                );
            }
        }
    }
}

#[test]
fn shard_and_scatter_into_halved_world_size_with_another_wrapping() {
    for comm in [Comm::BroadcastFull, Comm::ScatterFull] {
        load_scenario(
            &nested_model(),
            &wrap(false),
            &wrap_alt(),
            comm,
            true,
            true,
            true,
        );
    }
}

#[test]
fn scatter_full_optim_state_dict_nested() {
    for wrap_alt_ in [false, true] {
        for multiple in [false, true] {
            let p2 = if wrap_alt_ { wrap_alt() } else { wrap(false) };
            load_scenario(
                &nested_model(),
                &wrap(false),
                &p2,
                Comm::ScatterFull,
                multiple,
                true,
                false,
            );
        }
    }
}

#[test]
fn flatten_sharded_optim_state_dict_nested_and_transformer() {
    load_scenario(
        &nested_model(),
        &wrap(false),
        &wrap_alt(),
        Comm::FlattenSharded,
        false,
        false,
        false,
    );
    load_scenario(
        &transformer_model(),
        &transformer_policy(),
        &transformer_policy(),
        Comm::FlattenSharded,
        false,
        false,
        false,
    );
}

#[test]
fn transformer_with_tied_weights_shards_and_scatters_into_halved_world_size() {
    for comm in [Comm::BroadcastFull, Comm::ScatterFull] {
        load_scenario(
            &transformer_model(),
            &transformer_policy(),
            &transformer_policy(),
            comm,
            false,
            false,
            true,
        );
    }
}

/// `_test_load_optim_state_with_optim_state_dict` under the given settings.
fn optim_state_dict_scenario(
    model: &ModelDesc,
    policy1: &WrapPolicy,
    policy2: &WrapPolicy,
    t: StateDictType,
    cfg: OptimStateDictConfig,
    halve: bool,
) {
    ThreadGroup::run(4, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let single = |l: &ModelLayout, _r: usize| OptimParams::of_model(l);
        let mut run1 = train_wrapped(pg.clone(), model, policy1, single);
        run1.fsdp.set_state_dict_type(t, Some(cfg)).unwrap();
        let saved1 = run1
            .fsdp
            .optim_state_dict(&run1.local, &run1.input)
            .unwrap();
        let new_pg = if halve {
            pg.new_subgroup(&[0, 2]).unwrap()
        } else {
            Some(pg.clone())
        };
        let Some(new_pg) = new_pg else { return };
        let mut run2 = train_wrapped(new_pg, model, policy2, single);
        run2.fsdp.set_state_dict_type(t, Some(cfg)).unwrap();
        let saved2 = run2
            .fsdp
            .optim_state_dict(&run2.local, &run2.input)
            .unwrap();
        let what = format!("{t:?} {cfg:?} halve={halve} rank {}", run2.fsdp.rank());
        let loaded2 = run2
            .fsdp
            .optim_state_dict_to_load(saved2.as_ref(), &run2.input)
            .unwrap();
        assert_same_groups(&loaded2, &run2.local, true, &what);
        assert_same_state(&loaded2, &run2.local, &what);
        let loaded1 = run2
            .fsdp
            .optim_state_dict_to_load(saved1.as_ref(), &run2.input)
            .unwrap();
        assert_same_groups(&loaded1, &run2.local, true, &what);
        assert_same_state(&loaded1, &run2.local, &what);
    });
}

const FULL: OptimStateDictConfig = OptimStateDictConfig::Full {
    offload_to_cpu: true,
    rank0_only: false,
};
const FULL_RANK0: OptimStateDictConfig = OptimStateDictConfig::Full {
    offload_to_cpu: true,
    rank0_only: true,
};
const SHARDED: OptimStateDictConfig = OptimStateDictConfig::Sharded {
    offload_to_cpu: true,
};

#[test]
fn optim_state_dict_round_trips_under_every_state_dict_type() {
    let m = nested_model();
    optim_state_dict_scenario(
        &m,
        &wrap(false),
        &wrap(false),
        StateDictType::Full,
        FULL,
        false,
    );
    optim_state_dict_scenario(
        &m,
        &wrap(false),
        &wrap_alt(),
        StateDictType::Full,
        FULL_RANK0,
        true,
    );
    optim_state_dict_scenario(
        &m,
        &wrap(false),
        &wrap_alt(),
        StateDictType::Sharded,
        SHARDED,
        false,
    );
    let t = transformer_model();
    optim_state_dict_scenario(
        &t,
        &transformer_policy(),
        &transformer_policy(),
        StateDictType::Full,
        FULL_RANK0,
        true,
    );
}

#[test]
fn use_orig_params_round_trips_into_halved_world_size_and_other_wrapping() {
    // test_use_orig_params
    let m = nested_model();
    for halve in [true, false] {
        for alt in [true, false] {
            let p1 = wrap(false).with_orig_params(true);
            let p2 = if alt { wrap_alt() } else { wrap(false) }.with_orig_params(true);
            optim_state_dict_scenario(&m, &p1, &p2, StateDictType::Full, FULL, halve);
            optim_state_dict_scenario(&m, &p1, &p2, StateDictType::Full, FULL_RANK0, halve);
            if !halve {
                optim_state_dict_scenario(&m, &p1, &p2, StateDictType::Sharded, SHARDED, false);
            }
        }
    }
}

#[test]
fn use_orig_params_full_dict_equals_unwrapped_run() {
    let model = nested_model();
    let policy = wrap(false).with_orig_params(true);
    for ws in [2, 3, 4] {
        ThreadGroup::run(ws, |pg| {
            let run = train_wrapped(Arc::new(pg), &model, &policy, |l, _| {
                OptimParams::of_model(l)
            });
            let reference = unwrapped_reference(&model, run.fsdp.layout(), &run.input);
            let osd = run
                .fsdp
                .full_optim_state_dict(&run.local, &run.input, false)
                .unwrap()
                .unwrap();
            assert_same_state(&osd, &reference, &format!("use_orig_params ws {ws}"));
            // PyTorch's order with use_orig_params: unmanaged parameters by name, then each
            // flat parameter's parameters by name, flat parameters in order of their first name.
            let layout = run.fsdp.layout();
            let mut sorted: Vec<&ParamKey> = osd.state.keys().collect();
            sorted.sort();
            let flat_of = |k: &ParamKey| match layout.ownership()
                [layout.model().index_of(k.as_name().unwrap()).unwrap()]
            {
                fsdp::flat_param::Ownership::Flat { flat, .. } => Some(flat),
                fsdp::flat_param::Ownership::Unmanaged => None,
            };
            let mut expected: Vec<&ParamKey> = sorted
                .iter()
                .copied()
                .filter(|k| flat_of(k).is_none())
                .collect();
            let mut flats: Vec<usize> = vec![];
            for k in &sorted {
                if let Some(f) = flat_of(k) {
                    if !flats.contains(&f) {
                        flats.push(f);
                    }
                }
            }
            for f in flats {
                expected.extend(sorted.iter().copied().filter(|k| flat_of(k) == Some(f)));
            }
            assert_eq!(osd.state.keys().collect::<Vec<_>>(), expected);
        });
    }
}

#[test]
fn full_dict_keys_match_the_model_with_ignored_modules() {
    // test_full_optim_state_dict_keys: the keys are the model's parameter names.
    let model = nested_model();
    let policy = wrap(true);
    ThreadGroup::run(2, |pg| {
        let run = train_wrapped(Arc::new(pg), &model, &policy, |l, _| {
            OptimParams::of_model(l)
        });
        let osd = run
            .fsdp
            .full_optim_state_dict(&run.local, &run.input, false)
            .unwrap()
            .unwrap();
        let mut keys: Vec<String> = osd
            .state
            .keys()
            .map(|k| k.as_name().unwrap().to_string())
            .collect();
        let mut names: Vec<String> = model.params.iter().map(|p| p.name.clone()).collect();
        keys.sort();
        names.sort();
        assert_eq!(keys, names);
        assert!(run.fsdp.layout().ignored()[model.index_of("block2.2.bias_module0.bias").unwrap()]);
    });
}

#[test]
fn rekey_to_ids_matches_the_unwrapped_optimizer_and_to_names_shards_into_the_wrapped_one() {
    // test_rekey_optim_state_dict_to_ids / _to_names
    for multiple in [false, true] {
        let model = nested_model();
        ThreadGroup::run(2, |pg| {
            let run = train_wrapped(Arc::new(pg), &model, &wrap(false), |l, r| {
                nested_optim_input(l, multiple, false, r)
            });
            let full = run
                .fsdp
                .full_optim_state_dict(&run.local, &run.input, false)
                .unwrap()
                .unwrap();
            let plain = unwrapped(&model);
            let plain_input = unwrapped_input(run.fsdp.layout(), &run.input);
            let mut optim = make_adam(&plain_input);
            train_with(&plain, 0, &plain_input, optim.as_mut(), STEPS, &|_, _| {
                false
            });
            let plain_osd = optim.state_dict();
            let to_ids = fsdp::optim_state::rekey_optim_state_dict(
                &full,
                OptimStateKeyType::ParamId,
                &plain,
                &plain_input,
            )
            .unwrap();
            assert_same_groups(&to_ids, &plain_osd, true, "to ids");
            assert_same_state(&to_ids, &plain_osd, "to ids");
            let to_names = fsdp::optim_state::rekey_optim_state_dict(
                &plain_osd,
                OptimStateKeyType::ParamName,
                &plain,
                &plain_input,
            )
            .unwrap();
            let sharded = run
                .fsdp
                .shard_full_optim_state_dict(&to_names, &run.input)
                .unwrap();
            assert_same_groups(&sharded, &run.local, true, "to names");
            assert_same_state(&sharded, &run.local, "to names");
        });
    }
}

#[test]
fn save_and_load_when_the_first_parameter_has_no_state() {
    // test_save_load_without_0th_param_state: lin1 is never used, so it gets no state.
    let f = fsdp::DType::F32;
    let model = ModelDesc::new()
        .param("lin1.weight", &[5, 5], f)
        .param("lin1.bias", &[5], f)
        .param("lin2.weight", &[5, 5], f)
        .param("lin2.bias", &[5], f);
    let policy = WrapPolicy::units(&["lin1", "lin2", ""]);
    for sharded in [false, true] {
        ThreadGroup::run(2, |pg| {
            let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
            let input = fsdp.optim_params();
            let mut optim = make_adam(&input);
            train_with(
                fsdp.layout(),
                fsdp.rank(),
                &input,
                optim.as_mut(),
                1,
                &|_, n| n.starts_with("lin1"),
            );
            let local = optim.state_dict();
            assert_eq!(local.state.len(), 1, "only lin2's flat parameter has state");
            let loaded = if sharded {
                let s = fsdp.sharded_optim_state_dict(&local, &input).unwrap();
                fsdp.flatten_sharded_optim_state_dict(&s, &input).unwrap()
            } else {
                let full = fsdp
                    .full_optim_state_dict(&local, &input, false)
                    .unwrap()
                    .unwrap();
                fsdp.shard_full_optim_state_dict(&full, &input).unwrap()
            };
            assert_same_state(&loaded, &local, "without 0th state");
            optim.load_state_dict(&loaded).unwrap();
        });
    }
}

#[test]
fn dicts_without_param_groups_stay_without_param_groups() {
    // test_optim_state_without_param_groups
    let model = dummy_model(false);
    let policy = WrapPolicy::units(&[""]);
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let input = fsdp.optim_params();
        let mut optim = make_adam(&input);
        train_with(
            fsdp.layout(),
            fsdp.rank(),
            &input,
            optim.as_mut(),
            1,
            &|_, _| false,
        );
        let original = optim.state_dict();
        let mut no_groups = original.clone();
        let groups = no_groups.param_groups.take();
        let osd = fsdp.optim_state_dict(&no_groups, &input).unwrap().unwrap();
        assert!(osd.param_groups.is_none());
        let mut to_load = fsdp.optim_state_dict_to_load(Some(&osd), &input).unwrap();
        assert!(to_load.param_groups.is_none());
        to_load.param_groups = groups;
        assert_same_state(&to_load, &original, "without param_groups");
    });
}

#[test]
fn empty_optimizer_state_gives_empty_state() {
    // test_with_empty_optimizer_state
    let model = dummy_model(false);
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &WrapPolicy::units(&[""]), Arc::new(pg)).unwrap();
        let input = fsdp.optim_params();
        let optim = make_adam(&input);
        let local = optim.state_dict();
        let osd = fsdp.optim_state_dict(&local, &input).unwrap().unwrap();
        assert!(osd.state.is_empty());
        assert_eq!(osd.param_groups.as_ref().unwrap().len(), 1);
    });
}

#[test]
fn custom_float_and_none_state_pass_through() {
    // test_state_dict_with_none_tensor_state
    for orig in [false, true] {
        for adam in [false, true] {
            let model = dummy_model(false);
            let policy = WrapPolicy::units(&[""]).with_orig_params(orig);
            ThreadGroup::run(2, |pg| {
                let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
                let input = fsdp.optim_params();
                let mut optim = if adam {
                    make_adam(&input)
                } else {
                    make_sgd(&input)
                };
                train_with(
                    fsdp.layout(),
                    fsdp.rank(),
                    &input,
                    optim.as_mut(),
                    1,
                    &|_, _| false,
                );
                let mut local = optim.state_dict();
                for st in local.state.values_mut() {
                    st.insert("value1".into(), Value::Float(2.74));
                    st.insert("value2".into(), Value::None);
                }
                let osd = fsdp.optim_state_dict(&local, &input).unwrap().unwrap();
                let to_load = fsdp.optim_state_dict_to_load(Some(&osd), &input).unwrap();
                assert!(!to_load.state.is_empty());
                for st in to_load.state.values() {
                    assert_eq!(st["value1"], Value::Float(2.74), "orig={orig} adam={adam}");
                    assert_eq!(st["value2"], Value::None, "orig={orig} adam={adam}");
                }
                assert_same_state(&to_load, &local, &format!("orig={orig} adam={adam}"));
            });
        }
    }
}

#[test]
fn no_shard_round_trips_exactly() {
    // test_with_no_shard
    for orig in [false, true] {
        let model = dummy_model(false);
        let policy = WrapPolicy::units(&[""])
            .with_orig_params(orig)
            .with_strategy(ShardingStrategy::NoShard);
        ThreadGroup::run(2, |pg| {
            let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
            let input = fsdp.optim_params();
            let mut optim = make_adam(&input);
            train_with(
                fsdp.layout(),
                fsdp.rank(),
                &input,
                optim.as_mut(),
                1,
                &|_, _| false,
            );
            let original = optim.state_dict();
            let osd = fsdp.optim_state_dict(&original, &input).unwrap().unwrap();
            let to_load = fsdp.optim_state_dict_to_load(Some(&osd), &input).unwrap();
            optim.load_state_dict(&to_load).unwrap();
            let again = optim.state_dict();
            assert_same_groups(&again, &original, true, "no shard");
            assert_same_state(&again, &original, "no shard");
        });
    }
}

#[test]
fn frozen_parameters_with_use_orig_params_round_trip_at_every_step() {
    // test_no_grad: net1 is frozen on even steps and trained on odd ones.
    ThreadGroup::run(2, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        for steps in 1..5 {
            let frozen_now = (steps - 1) % 2 == 0;
            let model = dummy_model(frozen_now);
            let fsdp = Fsdp::new(
                &model,
                &WrapPolicy::units(&[""]).with_orig_params(true),
                pg.clone(),
            )
            .unwrap();
            let input = fsdp.optim_params();
            let mut optim = make_adam(&input);
            train_with(
                fsdp.layout(),
                fsdp.rank(),
                &input,
                optim.as_mut(),
                steps,
                &|s, n| s % 2 == 0 && n.starts_with("net1"),
            );
            let local = optim.state_dict();
            let osd = fsdp.optim_state_dict(&local, &input).unwrap().unwrap();
            let to_load = fsdp.optim_state_dict_to_load(Some(&osd), &input).unwrap();
            assert_same_state(&to_load, &local, &format!("after {steps} steps"));
        }
    });
}

#[test]
fn hybrid_shard_full_dict_equals_unwrapped_run() {
    let model = nested_model();
    let policy = wrap(false).with_strategy(ShardingStrategy::HybridShard);
    ThreadGroup::run(4, |pg| {
        let fsdp = Fsdp::new_hybrid(&model, &policy, Arc::new(pg), 2).unwrap();
        assert_eq!(fsdp.world_size(), 2);
        let input = fsdp.optim_params();
        let mut optim = make_adam(&input);
        train_with(
            fsdp.layout(),
            fsdp.rank(),
            &input,
            optim.as_mut(),
            STEPS,
            &|_, _| false,
        );
        let local = optim.state_dict();
        let reference = unwrapped_reference(&model, fsdp.layout(), &input);
        let osd = fsdp
            .full_optim_state_dict(&local, &input, false)
            .unwrap()
            .unwrap();
        assert_same_state(&osd, &reference, "hybrid");
        let loaded = fsdp
            .scatter_full_optim_state_dict(Some(&osd), &input)
            .unwrap();
        assert_same_state(&loaded, &local, "hybrid scatter");
    });
}

#[test]
fn named_optimizer_dicts_consolidate_like_id_keyed_ones() {
    // test_compatible_with_trec: a named (string-keyed) optimizer gives the same full dict.
    let model = dummy_model(false);
    let policy = WrapPolicy::units(&[""]).with_orig_params(true);
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let ids = fsdp.optim_params();
        let named = OptimParams {
            named: true,
            ..ids.clone()
        };
        let mut optim = make_adam(&ids);
        train_with(
            fsdp.layout(),
            fsdp.rank(),
            &ids,
            optim.as_mut(),
            2,
            &|_, _| false,
        );
        let by_id = optim.state_dict();
        let by_name = fsdp
            .rekey_optim_state_dict(&by_id, OptimStateKeyType::ParamName, &ids)
            .unwrap();
        let a = fsdp.optim_state_dict(&by_id, &ids).unwrap().unwrap();
        let b = fsdp.optim_state_dict(&by_name, &named).unwrap().unwrap();
        assert_same_state(&a, &b, "named vs ids");
        let back = fsdp.optim_state_dict_to_load(Some(&b), &named).unwrap();
        assert_same_state(&back, &by_name, "named load");
    });
}
