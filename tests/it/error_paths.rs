//! Every error path, one scenario per test: each asserts the error variant and that the message
//! names the culprit (parameter, state, rank or unit). Dicts are built by hand; no optimizer
//! runs. Multi-rank scenarios run on thread groups whose collectives give up after a timeout,
//! so a rank left waiting fails the test instead of hanging it.
//!
//! Tests whose comment starts with `// Regression` pin a bug found and fixed while writing
//! them.

use crate::common;

use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::flat_param::ModelLayout;
use fsdp::optim_state::ShardedTensor;
use fsdp::{
    DType, Error, Fsdp, HostTensor, ModelDesc, OptimParam, OptimParams, OptimStateDict,
    OptimStateDictConfig, OptimStateKeyType, ParamDesc, ParamGroup, ParamKey, ParamState,
    ShardingStrategy, StateDictType, Value, WrapPolicy,
};
use std::sync::Arc;
use std::time::Duration;

const F32: DType = DType::F32;

/// Upper bound on any collective wait: long enough never to fire in a passing test, short
/// enough that a rank left waiting fails the test quickly.
const TIMEOUT: Duration = Duration::from_secs(10);

// ----- building dicts by hand -----

/// A tensor of `shape` holding `seed, seed + 0.25, …`.
fn tensor(shape: &[usize], seed: f32) -> HostTensor {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n).map(|i| seed + 0.25 * i as f32).collect();
    HostTensor::from_slice(&vals, shape).unwrap()
}

/// Adam's `step`: a 0-dim float32 tensor.
fn step(v: f32) -> Value {
    Value::Tensor(HostTensor::scalar(v))
}

/// Adam's state for a parameter of `shape` after `steps` steps.
fn adam(shape: &[usize], seed: f32, steps: f32) -> ParamState {
    let mut st = ParamState::new();
    st.insert("exp_avg".into(), Value::Tensor(tensor(shape, seed)));
    st.insert(
        "exp_avg_sq".into(),
        Value::Tensor(tensor(shape, seed + 0.5)),
    );
    st.insert("step".into(), step(steps));
    st
}

/// A param group with `lr` listing `names`.
fn group<'a>(names: impl IntoIterator<Item = &'a str>) -> ParamGroup {
    let mut options = ParamState::new();
    options.insert("lr".into(), Value::Float(1e-3));
    ParamGroup {
        options,
        params: names.into_iter().map(ParamKey::from).collect(),
    }
}

/// The full dict of an Adam optimizer over every parameter of `model`, in one param group.
fn full_adam(model: &ModelDesc, steps: f32) -> OptimStateDict {
    let mut full = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        full.state.insert(
            ParamKey::Name(p.name.clone()),
            adam(&p.shape, i as f32, steps),
        );
    }
    full.param_groups = Some(vec![group(model.params.iter().map(|p| p.name.as_str()))]);
    full
}

/// The state of `key`, to tamper with.
fn state_mut(osd: &mut OptimStateDict, key: impl Into<ParamKey>) -> &mut ParamState {
    let key = key.into();
    osd.state
        .get_mut(&key)
        .unwrap_or_else(|| panic!("no state for {key}"))
}

/// Drops the last element of a tensor state.
fn shorten(v: &mut Value) {
    let Value::Tensor(t) = v else {
        panic!("expected a tensor, got {}", v.kind())
    };
    *v = Value::Tensor(t.narrow_flat(0, t.numel() - 1).unwrap());
}

/// The same tensor state as a `SHARDED_STATE_DICT` chunk (the whole tensor on this rank).
fn as_sharded(v: &Value) -> Value {
    let Value::Tensor(t) = v else {
        panic!("expected a tensor, got {}", v.kind())
    };
    Value::Sharded(ShardedTensor {
        global_shape: t.shape().to_vec(),
        offsets: vec![0; t.dim()],
        local: Some(t.clone()),
    })
}

fn flat(unit: &str) -> OptimParam {
    OptimParam::Flat(unit.into())
}

fn orig(name: &str) -> OptimParam {
    OptimParam::Param(name.into())
}

/// The id of `p` in the optimizer `params`.
fn id_of(params: &OptimParams, p: &OptimParam) -> ParamKey {
    ParamKey::Id(
        params
            .iter()
            .find(|(_, q)| *q == p)
            .unwrap_or_else(|| panic!("the optimizer does not hold {p}"))
            .0,
    )
}

// ----- models -----

/// One FSDP unit `unit` (a [2, 3] matrix and a [3] vector) and a head outside every unit.
fn small_model() -> ModelDesc {
    ModelDesc::new()
        .param("unit.a", &[2, 3], F32)
        .param("unit.b", &[3], F32)
        .param("head.w", &[2], F32)
}

fn small_policy() -> WrapPolicy {
    WrapPolicy::units(&["unit"])
}

/// `unit.a` (2 elements) and `unit.b` (6) flattened with use_orig_params=True. At world size 2
/// with fp32 alignment (a at 0..2, padding, b at 4..10, c = 5), rank 0 holds all of `unit.a`
/// and `unit.b[0..1]`, rank 1 holds `unit.b[1..6]` and nothing of `unit.a`.
fn orig_model() -> ModelDesc {
    ModelDesc::new()
        .param("unit.a", &[2], F32)
        .param("unit.b", &[2, 3], F32)
        .param("head.w", &[2], F32)
}

fn orig_policy() -> WrapPolicy {
    small_policy().with_orig_params(true)
}

#[test]
fn orig_model_shards_as_the_scenarios_assume() {
    let layout = ModelLayout::new(&orig_model(), &orig_policy(), 2).unwrap();
    let f = layout.flat_of_unit("unit").unwrap();
    let (r0, r1) = (f.shard(0), f.shard(1));
    assert_eq!(
        (r0.params[0].numel_in_shard, r0.params[1].numel_in_shard),
        (2, 1)
    );
    assert_eq!(
        (r1.params[0].in_shard, r1.params[1].numel_in_shard),
        (false, 5)
    );
}

/// `NestedModel.wrap_with_unmanaged_params`: a [5, 5] parameter `unmanaged_param` registered on
/// `block2[2]` (inside an FSDP unit) or on the root (outside every unit) before wrapping.
fn nested_with_unmanaged_param(add_to_fsdp_module: bool) -> (ModelDesc, String) {
    let (after, name) = if add_to_fsdp_module {
        ("block2.2.weight", "block2.2.unmanaged_param")
    } else {
        ("bias", "unmanaged_param")
    };
    let mut model = common::nested_model();
    // A module's own parameters come before its children's, in registration order.
    let at = model.params.iter().position(|p| p.name == after).unwrap() + 1;
    model.params.insert(
        at,
        ParamDesc {
            name: name.into(),
            shape: vec![5, 5],
            dtype: F32,
            requires_grad: true,
        },
    );
    (model, name.into())
}

// ----- running ranks -----

/// Runs `f` on every rank of a `world_size`-rank thread group (collectives time out after
/// [`TIMEOUT`]), each with its own `Fsdp` of `model` wrapped by `policy`.
fn on_ranks<R: Send>(
    world_size: usize,
    model: &ModelDesc,
    policy: &WrapPolicy,
    f: impl Fn(Fsdp) -> R + Send + Sync,
) -> Vec<R> {
    ThreadGroup::run_with_timeout(world_size, TIMEOUT, |pg| {
        f(Fsdp::new(model, policy, Arc::new(pg)).unwrap())
    })
}

/// Asserts every rank failed with the same error and returns it.
#[track_caller]
fn same_on_every_rank(errs: Vec<Error>) -> Error {
    for (rank, e) in errs.iter().enumerate() {
        assert_eq!(e, &errs[0], "rank {rank} fails differently from rank 0");
    }
    errs.into_iter().next().expect("at least one rank")
}

/// Asserts the message of `err` names every one of `culprits`.
#[track_caller]
fn assert_names(err: &Error, culprits: &[&str]) {
    let msg = err.to_string();
    for c in culprits {
        assert!(
            msg.contains(c),
            "the error should name {c:?}, but says: {msg}"
        );
    }
}

/// `shard_full_optim_state_dict(full)` on both ranks of a 2-rank group, for the optimizer of
/// `model.parameters()`: the error, which must be the same on both ranks.
fn shard_error(model: &ModelDesc, policy: &WrapPolicy, full: &OptimStateDict) -> Error {
    same_on_every_rank(on_ranks(2, model, policy, |fsdp| {
        fsdp.shard_full_optim_state_dict(full, &fsdp.optim_params())
            .unwrap_err()
    }))
}

// ===== 1. shard_full_optim_state_dict: PyTorch's `_flatten_optim_state` checks =====

#[test]
fn members_of_one_flat_parameter_with_differing_state_names() {
    let mut full = full_adam(&small_model(), 3.0);
    state_mut(&mut full, "unit.b").shift_remove("exp_avg_sq");
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::DifferingStateNames { params, .. } if params == &["unit.a", "unit.b"]),
        "{err:?}"
    );
    assert_names(&err, &["unit.a", "unit.b", "exp_avg_sq"]);
}

#[test]
fn a_state_that_is_a_tensor_for_one_member_and_a_float_for_another() {
    let mut full = full_adam(&small_model(), 3.0);
    state_mut(&mut full, "unit.b").insert("exp_avg".into(), Value::Float(0.5));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::DifferingStateTypes { state, .. } if state == "exp_avg"),
        "{err:?}"
    );
    assert_names(&err, &["`exp_avg`", "unit.a", "unit.b", "float"]);
}

#[test]
fn a_plain_state_that_is_an_int_for_one_member_and_a_float_for_another() {
    let mut full = full_adam(&small_model(), 3.0);
    state_mut(&mut full, "unit.a").insert("version".into(), Value::Int(2));
    state_mut(&mut full, "unit.b").insert("version".into(), Value::Float(2.0));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::DifferingStateTypes { state, .. } if state == "version"),
        "{err:?}"
    );
    assert_names(&err, &["`version`", "unit.a", "unit.b", "int", "float"]);
}

#[test]
fn positive_dim_tensor_states_of_different_dtypes() {
    let mut full = full_adam(&small_model(), 3.0);
    let f64_state = HostTensor::from_slice(&[1.0f64, 2.0, 3.0], &[3]).unwrap();
    state_mut(&mut full, "unit.b").insert("exp_avg".into(), Value::Tensor(f64_state));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::TensorStateDtypeMismatch { state, .. } if state == "exp_avg"),
        "{err:?}"
    );
    assert_names(
        &err,
        &[
            "`exp_avg`",
            "unit.a",
            "unit.b",
            "torch.float32",
            "torch.float64",
        ],
    );
}

#[test]
fn a_tensor_state_whose_shape_is_not_its_parameters() {
    let mut full = full_adam(&small_model(), 3.0);
    // Same number of elements, transposed shape: PyTorch compares shapes, not sizes.
    state_mut(&mut full, "unit.a").insert("exp_avg_sq".into(), Value::Tensor(tensor(&[3, 2], 0.0)));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::ShapeMismatch { expected, found, .. } if expected == &[2, 3] && found == &[3, 2]),
        "{err:?}"
    );
    assert_names(&err, &["`exp_avg_sq`", "`unit.a`"]);
}

#[test]
fn a_zero_dim_parameter_without_state_in_a_flat_parameter_with_tensor_state() {
    let model = ModelDesc::new()
        .param("unit.a", &[2, 3], F32)
        .param("unit.scale", &[], F32)
        .param("head.w", &[2], F32);
    let mut full = OptimStateDict::default();
    full.state.insert("unit.a".into(), adam(&[2, 3], 0.0, 3.0));
    full.state.insert("head.w".into(), adam(&[2], 1.0, 3.0));
    let err = shard_error(&model, &small_policy(), &full);
    assert_eq!(
        err,
        Error::ZeroDimParamWithoutState {
            param: "unit.scale".into(),
            state: "exp_avg".into()
        }
    );
    assert_names(&err, &["`unit.scale`", "`exp_avg`"]);
}

#[test]
fn step_differing_between_members_of_one_flat_parameter() {
    let mut full = full_adam(&small_model(), 3.0);
    state_mut(&mut full, "unit.b").insert("step".into(), step(4.0));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::ScalarStateMismatch { state, .. } if state == "step"),
        "{err:?}"
    );
    assert_names(&err, &["`step`", "unit.a", "unit.b", "3.0", "4.0"]);
}

#[test]
fn a_plain_state_differing_between_members_of_one_flat_parameter() {
    let mut full = full_adam(&small_model(), 3.0);
    state_mut(&mut full, "unit.a").insert("version".into(), Value::Int(1));
    state_mut(&mut full, "unit.b").insert("version".into(), Value::Int(2));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::ScalarStateMismatch { state, .. } if state == "version"),
        "{err:?}"
    );
    assert_names(&err, &["`version`", "unit.a", "unit.b"]);
}

/// Port of `test_shard_full_optim_state_dict_unmanaged_params` (FULL_STATE_DICT,
/// add_to_fsdp_module=True).
#[test]
fn shard_full_optim_state_dict_with_an_unmanaged_param_added_inside_a_unit() {
    // The full dict of the model before the parameter was added: the flat parameter of
    // `block2.2` now mixes members that have `step` with one that has no state at all.
    let full = full_adam(&common::nested_model(), 1.0);
    let (model, added) = nested_with_unmanaged_param(true);
    let err = shard_error(&model, &common::wrap(false), &full);
    let Error::ScalarStateMismatch {
        state,
        params,
        values,
    } = &err
    else {
        panic!("expected ScalarStateMismatch, got {err:?}")
    };
    assert_eq!(state, "step");
    let at = params
        .iter()
        .position(|p| p == &added)
        .expect("the added parameter is a member");
    assert_eq!(values[at], "missing", "{err}");
    assert_names(
        &err,
        &[
            "must have scalar state with the same value and dtype",
            "`step`",
            &added,
            "missing",
        ],
    );
}

/// The same port for SHARDED_STATE_DICT: `flatten_sharded_optim_state_dict`.
#[test]
fn flatten_sharded_optim_state_dict_with_an_unmanaged_param_added_inside_a_unit() {
    let model = common::nested_model();
    let policy = common::wrap(false);
    let full = full_adam(&model, 1.0);
    let (new_model, added) = nested_with_unmanaged_param(true);
    let errs = ThreadGroup::run_with_timeout(2, TIMEOUT, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let old = Fsdp::new(&model, &policy, pg.clone()).unwrap();
        let params = old.optim_params();
        let local = old.shard_full_optim_state_dict(&full, &params).unwrap();
        let sharded = old.sharded_optim_state_dict(&local, &params).unwrap();
        let new = Fsdp::new(&new_model, &policy, pg).unwrap();
        new.flatten_sharded_optim_state_dict(&sharded, &new.optim_params())
            .unwrap_err()
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::ScalarStateMismatch { state, .. } if state == "step"),
        "{err:?}"
    );
    assert_names(&err, &["`step`", &added, "missing"]);
}

/// Port of `test_shard_full_optim_state_dict_unmanaged_params` (add_to_fsdp_module=False): a
/// parameter outside every unit is managed externally; it just gets no state.
#[test]
fn shard_full_optim_state_dict_with_an_unmanaged_param_outside_every_unit() {
    let full = full_adam(&common::nested_model(), 1.0);
    let (model, added) = nested_with_unmanaged_param(false);
    let consolidated = on_ranks(2, &model, &common::wrap(false), |fsdp| {
        let params = fsdp.optim_params();
        let mut local = fsdp
            .shard_full_optim_state_dict(&full, &params)
            .expect("unmanaged parameters are allowed");
        let added_id = id_of(&params, &orig(&added));
        assert!(
            !local.state.contains_key(&added_id),
            "rank {}: state for {added}",
            fsdp.rank()
        );
        assert_eq!(
            local.state.len(),
            params.len() - 1,
            "every other parameter has state"
        );
        // `NestedModel.add_unmanaged_param_entry`; then the dict is a valid local dict again.
        local
            .state
            .insert(added_id.clone(), adam(&[5, 5], 7.0, 1.0));
        let ids = &mut local.param_groups.as_mut().unwrap()[0].params;
        assert!(!ids.contains(&added_id));
        ids.push(added_id);
        ids.sort();
        fsdp.full_optim_state_dict(&local, &params, false)
            .unwrap()
            .unwrap()
    });
    for back in consolidated {
        assert!(back.state.contains_key(&ParamKey::Name(added.clone())));
    }
}

#[test]
fn a_full_dict_keyed_by_ids() {
    let mut full = OptimStateDict::default();
    full.state.insert(ParamKey::Id(0), adam(&[2, 3], 0.0, 3.0));
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::WrongKeyType { key, expected, .. } if key == "0" && expected == "parameter names"),
        "{err:?}"
    );
    assert_names(&err, &["key 0", "rekey"]);
}

#[test]
fn param_groups_naming_a_parameter_the_optimizer_does_not_hold() {
    let full = full_adam(&small_model(), 3.0);
    // The optimizer trains only the unit; the full dict's group also lists `head.w`.
    let errs = on_ranks(2, &small_model(), &small_policy(), |fsdp| {
        fsdp.shard_full_optim_state_dict(&full, &OptimParams::single(vec![flat("unit")]))
            .unwrap_err()
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::UnknownParameter { name, .. } if name == "head.w"),
        "{err:?}"
    );
    assert_names(&err, &["`head.w`", "param_groups[0]"]);
}

#[test]
fn a_flat_parameter_whose_members_all_have_empty_state() {
    let mut full = OptimStateDict::default();
    full.state.insert("unit.a".into(), ParamState::new());
    full.state.insert("unit.b".into(), ParamState::new());
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::MissingState { state, .. } if state.is_empty()),
        "{err:?}"
    );
    assert_names(&err, &["`unit`", "unit.a", "unit.b", "no optimizer state"]);
}

#[test]
fn a_full_dict_holding_sharded_tensors_for_a_flat_parameter() {
    let mut full = full_adam(&small_model(), 3.0);
    for name in ["unit.a", "unit.b"] {
        let st = state_mut(&mut full, name);
        let sharded = as_sharded(&st["exp_avg"]);
        st.insert("exp_avg".into(), sharded);
    }
    let err = shard_error(&small_model(), &small_policy(), &full);
    assert!(
        matches!(&err, Error::WrongStateKind { state, found, .. } if state == "exp_avg" && found.starts_with("sharded tensor")),
        "{err:?}"
    );
    assert_names(&err, &["`exp_avg`", "`unit`", "sharded"]);
}

#[test]
fn a_full_dict_holding_a_sharded_tensor_for_an_original_parameter() {
    // Regression (was a bug): with use_orig_params=True, `flatten::shard_orig_param_state` passes a
    // `Value::Sharded` through (`other => other`) into the local dict, while the same input is
    // a WrongStateKind with use_orig_params=False (`flatten_tensor_state`). The optimizer
    // would receive a ShardedTensor, and `full_optim_state_dict` later rejects the dict.
    let mut full = full_adam(&orig_model(), 3.0);
    let st = state_mut(&mut full, "unit.a");
    let sharded = as_sharded(&st["exp_avg"]);
    st.insert("exp_avg".into(), sharded);
    let results = on_ranks(2, &orig_model(), &orig_policy(), |fsdp| {
        fsdp.shard_full_optim_state_dict(&full, &fsdp.optim_params())
            .map(|local| local.state.len())
    });
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.expect_err(&format!(
            "rank {rank} accepted a sharded tensor in a full dict"
        ));
        assert!(
            matches!(&err, Error::WrongStateKind { state, found, .. } if state == "exp_avg" && found == "a sharded tensor"),
            "{err:?}"
        );
        assert_names(&err, &["`exp_avg`", "unit.a", "sharded"]);
    }
}

// ===== 2. full_optim_state_dict: agreement across ranks =====

/// Port of `test_full_optim_state_dict_nested_invalid`: the optimizer of the odd ranks excludes
/// the last parameter, so they lack state rank 0 has.
#[test]
fn full_optim_state_dict_when_odd_ranks_lack_the_last_parameter() {
    let model = common::nested_model();
    let full = full_adam(&model, 3.0);
    let results = on_ranks(4, &model, &common::wrap(false), |fsdp| {
        let mut params = fsdp.optim_params();
        let mut full = full.clone();
        let last = params.groups[0].last().unwrap().clone();
        assert_eq!(last, flat("block2.2"));
        if fsdp.rank() % 2 == 1 {
            params.groups[0].pop();
            // This rank's optimizer never held the parameter: its group does not list it.
            let names = fsdp.layout().flat_of_unit("block2.2").unwrap().fqns();
            full.param_groups.as_mut().unwrap()[0]
                .params
                .retain(|k| !names.iter().any(|n| k.as_name() == Some(n.as_str())));
        }
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.full_optim_state_dict(&local, &params, false)
            .unwrap_err()
    });
    let err = same_on_every_rank(results);
    let names: Vec<String> = [
        "block2.2.weight",
        "block2.2.bias_module0.bias",
        "block2.2.bias_module1.bias",
    ]
    .map(String::from)
    .to_vec();
    assert_eq!(
        err,
        Error::MissingStateOnRanks {
            missing: vec![(1, vec![names.clone()]), (3, vec![names])]
        }
    );
    assert_names(
        &err,
        &[
            "rank 0's optimizer",
            "Rank 1 is missing states for the parameters",
            "Rank 3",
            "block2.2.weight",
        ],
    );
    let msg = err.to_string();
    assert!(!msg.contains("Rank 0") && !msg.contains("Rank 2"), "{msg}");
}

#[test]
fn full_optim_state_dict_when_one_rank_wraps_the_model_differently() {
    let model = common::nested_model();
    let full = full_adam(&model, 3.0);
    let errs = ThreadGroup::run_with_timeout(3, TIMEOUT, |pg| {
        let policy = if pg.rank() == 2 {
            common::wrap_alt()
        } else {
            common::wrap(false)
        };
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.full_optim_state_dict(&local, &params, false)
            .unwrap_err()
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::PlanMismatch { op, reference: 0, ranks, .. } if op == "full_optim_state_dict" && ranks == &[2]),
        "{err:?}"
    );
    assert_names(
        &err,
        &[
            "full_optim_state_dict",
            "ranks [2] differ from rank 0",
            "wrapping policy",
        ],
    );
}

/// Every rank shards the same full dict of the nested model, `tamper`s with its local dict,
/// and calls `full_optim_state_dict`: the error of each rank.
fn nested_consolidate_errors(
    world_size: usize,
    tamper: impl Fn(usize, &Fsdp, &OptimParams, &mut OptimStateDict) + Send + Sync,
) -> Vec<Error> {
    let model = common::nested_model();
    let full = full_adam(&model, 3.0);
    on_ranks(world_size, &model, &common::wrap(false), |fsdp| {
        let params = fsdp.optim_params();
        let mut local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        tamper(fsdp.rank(), &fsdp, &params, &mut local);
        fsdp.full_optim_state_dict(&local, &params, false)
            .unwrap_err()
    })
}

#[test]
fn full_optim_state_dict_when_one_rank_has_other_flat_state_names() {
    let errs = nested_consolidate_errors(2, |rank, _, params, local| {
        if rank == 1 {
            state_mut(local, id_of(params, &flat("block1"))).shift_remove("exp_avg_sq");
        }
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::PlanMismatch { ranks, .. } if ranks == &[1]),
        "{err:?}"
    );
    assert_names(
        &err,
        &["ranks [1]", "unit `block1`", "exp_avg_sq", "rank 1 has"],
    );
}

#[test]
fn full_optim_state_dict_when_one_rank_has_another_flat_state_shape() {
    let errs = nested_consolidate_errors(2, |rank, _, params, local| {
        if rank == 1 {
            shorten(
                state_mut(local, id_of(params, &flat("block2.2")))
                    .get_mut("exp_avg")
                    .unwrap(),
            );
        }
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::PlanMismatch { ranks, .. } if ranks == &[1]),
        "{err:?}"
    );
    // block2.2 holds 45 + 5 + 5 elements: 28 per rank, 27 after tampering.
    assert_names(&err, &["ranks [1]", "unit `block2.2`", "[28]", "[27]"]);
}

#[test]
fn full_optim_state_dict_when_rank_0_has_a_flat_state_of_the_wrong_shape() {
    let errs = nested_consolidate_errors(2, |rank, _, params, local| {
        if rank == 0 {
            shorten(
                state_mut(local, id_of(params, &flat("block2.2")))
                    .get_mut("exp_avg")
                    .unwrap(),
            );
        }
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::ShapeMismatch { expected, found, .. } if expected == &[28] && found == &[27]),
        "{err:?}"
    );
    assert_names(&err, &["`exp_avg`", "unit `block2.2`", "rank 0"]);
}

#[test]
fn full_optim_state_dict_of_a_local_dict_holding_a_sharded_tensor() {
    let errs = nested_consolidate_errors(2, |rank, _, params, local| {
        if rank == 1 {
            let st = state_mut(local, id_of(params, &flat("block1")));
            let sharded = as_sharded(&st["exp_avg"]);
            st.insert("exp_avg".into(), sharded);
        }
    });
    let layout = ModelLayout::new(&common::nested_model(), &common::wrap(false), 2).unwrap();
    let block1_id = id_of(&OptimParams::of_model(&layout), &flat("block1"));
    // The culprit rank names the state and its key.
    assert!(
        matches!(&errs[1], Error::WrongStateKind { context, param, state, .. }
            if context == "rank 1: local optimizer state" && param == &block1_id.to_string() && state == "exp_avg"),
        "{:?}",
        errs[1]
    );
    assert_names(&errs[1], &["`exp_avg`", "sharded"]);
    // Its peer fails too instead of waiting, with the culprit's own error naming its rank.
    assert_eq!(errs[0], errs[1]);
    assert_names(&errs[0], &["rank 1"]);
}

#[test]
fn a_peer_of_a_rank_with_an_invalid_local_dict_is_told_what_is_wrong() {
    // A rank whose local plan fails sends its error with the plan; every peer reports it.
    let errs = nested_consolidate_errors(2, |rank, _, params, local| {
        if rank == 1 {
            let st = state_mut(local, id_of(params, &flat("block1")));
            let sharded = as_sharded(&st["exp_avg"]);
            st.insert("exp_avg".into(), sharded);
        }
    });
    assert!(
        matches!(&errs[0], Error::WrongStateKind { context, state, .. }
            if context.starts_with("rank 1") && state == "exp_avg"),
        "{:?}",
        errs[0]
    );
    assert_names(&errs[0], &["rank 1", "exp_avg", "sharded"]);
}

#[test]
fn full_optim_state_dict_when_the_param_groups_list_a_key_the_optimizer_does_not_hold() {
    let errs = nested_consolidate_errors(1, |_, _, _, local| {
        local.param_groups.as_mut().unwrap()[0]
            .params
            .push(ParamKey::Id(99));
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::InvalidParamGroups { group: Some(0), .. }),
        "{err:?}"
    );
    assert_names(&err, &["param group 0", "key 99"]);
}

// ----- use_orig_params=True: per-parameter state merged across ranks -----

/// Every rank shards the same full dict of [`orig_model`] at world size 2, `tamper`s with its
/// local dict, and calls `full_optim_state_dict`: each rank's outcome.
fn orig_consolidate(
    full: &OptimStateDict,
    tamper: impl Fn(usize, &OptimParams, &mut OptimStateDict) + Send + Sync,
) -> Vec<fsdp::Result<Option<OptimStateDict>>> {
    on_ranks(2, &orig_model(), &orig_policy(), |fsdp| {
        let params = fsdp.optim_params();
        let mut local = fsdp.shard_full_optim_state_dict(full, &params).unwrap();
        tamper(fsdp.rank(), &params, &mut local);
        fsdp.full_optim_state_dict(&local, &params, false)
    })
}

fn errors(results: Vec<fsdp::Result<Option<OptimStateDict>>>) -> Vec<Error> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.expect_err(&format!("rank {r} succeeded")))
        .collect()
}

#[test]
fn a_trainable_original_parameter_without_state_on_any_rank() {
    let mut full = full_adam(&orig_model(), 3.0);
    full.state.shift_remove(&ParamKey::from("unit.b"));
    full.param_groups = None;
    let err = same_on_every_rank(errors(orig_consolidate(&full, |_, _, _| {})));
    assert_eq!(
        err,
        Error::MissingParamState {
            param: "unit.b".into(),
            unit: "unit".into()
        }
    );
    assert_names(&err, &["`unit.b`", "`unit`"]);
}

#[test]
fn step_of_an_original_parameter_differing_across_ranks() {
    let full = full_adam(&orig_model(), 3.0);
    let errs = errors(orig_consolidate(&full, |rank, params, local| {
        if rank == 1 {
            state_mut(local, id_of(params, &orig("unit.b"))).insert("step".into(), step(4.0));
        }
    }));
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::ScalarStateMismatch { state, .. } if state == "step"),
        "{err:?}"
    );
    assert_names(
        &err,
        &[
            "`step`",
            "unit.b on rank 0",
            "unit.b on rank 1",
            "3.0",
            "4.0",
        ],
    );
}

/// rank 1 holds `unit.b`'s `exp_avg` in float64 while rank 0 holds float32.
fn orig_dtype_mismatch() -> Vec<Error> {
    let full = full_adam(&orig_model(), 3.0);
    errors(orig_consolidate(&full, |rank, params, local| {
        if rank == 1 {
            let f64_state = HostTensor::zeros(DType::F64, &[5]);
            state_mut(local, id_of(params, &orig("unit.b")))
                .insert("exp_avg".into(), Value::Tensor(f64_state));
        }
    }))
}

#[test]
fn tensor_state_of_an_original_parameter_with_another_dtype_on_one_rank() {
    let err = same_on_every_rank(orig_dtype_mismatch());
    assert!(
        matches!(&err, Error::TensorStateDtypeMismatch { state, .. } if state == "exp_avg"),
        "{err:?}"
    );
    assert_names(
        &err,
        &["`exp_avg`", "unit.b", "torch.float32", "torch.float64"],
    );
}

#[test]
fn tensor_state_dtype_mismatch_across_ranks_names_the_rank() {
    // Regression (was a bug): `consolidate::gather_orig_param_states` compares dtypes across ranks but builds
    // `TensorStateDtypeMismatch` without the rank (ScalarStateMismatch, in the same loop, says
    // "unit.b on rank 1"): the message cannot tell which rank holds the float64 state.
    let err = same_on_every_rank(orig_dtype_mismatch());
    assert!(
        matches!(&err, Error::TensorStateDtypeMismatch { state, params, dtypes }
            if state == "exp_avg" && params == &["unit.a", "unit.b"]
                && dtypes[1].starts_with("torch.float64") && dtypes[1].ends_with("on rank 1)")),
        "{err:?}"
    );
    assert_names(&err, &["rank 1"]);
}

#[test]
fn tensor_state_of_an_original_parameter_with_the_wrong_size_on_one_rank() {
    // Regression (was a bug): `consolidate::gather_orig_param_states` checks each rank's local view size only on
    // that rank, after the plan exchange and right before `all_gather_into`. Rank 1 returns
    // ShapeMismatch; rank 0 is left in the all-gather: PeerDied here once rank 1's handle is
    // dropped, a hang on a real backend. Every rank's shapes are in the exchanged plans, so the
    // check can run identically on every rank before any tensor moves.
    let full = full_adam(&orig_model(), 3.0);
    let results = orig_consolidate(&full, |rank, params, local| {
        if rank == 1 {
            shorten(
                state_mut(local, id_of(params, &orig("unit.b")))
                    .get_mut("exp_avg")
                    .unwrap(),
            );
        }
    });
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.expect_err("a wrong-size state must fail");
        assert!(
            matches!(err, Error::ShapeMismatch { .. }),
            "rank {rank}: {err:?}"
        );
        assert_names(&err, &["`exp_avg`", "`unit.b`", "rank 1"]);
    }
}

// ===== 3. the optimizer's parameters =====

/// `shard_full_optim_state_dict` with the optimizer `params` (world size 1).
fn shard_with(model: &ModelDesc, policy: &WrapPolicy, params: OptimParams) -> Error {
    let full: OptimStateDict = OptimStateDict::default();
    same_on_every_rank(on_ranks(1, model, policy, |fsdp| {
        fsdp.shard_full_optim_state_dict(&full, &params)
            .unwrap_err()
    }))
}

#[test]
fn an_optimizer_holding_a_flat_parameter_twice() {
    let err = shard_with(
        &small_model(),
        &small_policy(),
        OptimParams::single(vec![flat("unit"), orig("head.w"), flat("unit")]),
    );
    assert!(
        matches!(&err, Error::InvalidParamGroups { group: None, .. }),
        "{err:?}"
    );
    assert_names(&err, &["unit `unit`", "twice", "ids 0 and 2"]);
}

#[test]
fn an_optimizer_holding_a_tied_parameter_under_both_names() {
    let policy = common::transformer_policy().with_orig_params(true);
    let params = OptimParams::single(vec![
        orig("embed_tokens.weight"),
        orig("output_proj.weight"),
    ]);
    let err = shard_with(&common::transformer_model(), &policy, params);
    assert!(
        matches!(&err, Error::InvalidParamGroups { group: None, .. }),
        "{err:?}"
    );
    assert_names(&err, &["`output_proj.weight`", "twice", "ids 0 and 1"]);
}

#[test]
fn full_optim_state_dict_with_a_parameter_listed_twice_on_every_rank() {
    let params = OptimParams::single(vec![flat("unit"), flat("unit")]);
    let errs = on_ranks(2, &small_model(), &small_policy(), |fsdp| {
        fsdp.full_optim_state_dict(&OptimStateDict::<HostTensor>::default(), &params, false)
            .unwrap_err()
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::InvalidParamGroups { group: None, .. }),
        "{err:?}"
    );
    assert_names(&err, &["unit `unit`", "twice"]);
}

/// One wrong optimizer parameter: the scenario, what the optimizer holds, the error it must
/// give (variant and fields) and the names its message must contain.
struct WrongParamCase {
    scenario: &'static str,
    use_orig_params: bool,
    holds: OptimParam,
    is_expected: fn(&Error) -> bool,
    names: &'static [&'static str],
}

#[test]
fn an_optimizer_holding_a_parameter_fsdp_does_not_expose_is_refused_by_name() {
    let cases = [
        WrongParamCase {
            scenario: "the flat parameter of a module that is no unit",
            use_orig_params: false,
            holds: flat("head"),
            is_expected: |e| matches!(e, Error::UnknownUnit { unit } if unit == "head"),
            names: &["`head`", "no unit with a flat parameter"],
        },
        WrongParamCase {
            scenario: "a parameter the model does not have",
            use_orig_params: false,
            holds: orig("unit.c"),
            is_expected: |e| matches!(e, Error::UnknownParameter { name, site: fsdp::LookupSite::HeldByOptimizer } if name == "unit.c"),
            names: &["`unit.c`", "held by the optimizer"],
        },
        WrongParamCase {
            scenario: "a flattened original parameter without use_orig_params",
            use_orig_params: false,
            holds: orig("unit.a"),
            is_expected: |e| matches!(e, Error::WrongOptimParam { param, .. } if param == "`unit.a`"),
            names: &["`unit.a`", "unit `unit`", "use_orig_params=False"],
        },
        WrongParamCase {
            scenario: "a flat parameter with use_orig_params",
            use_orig_params: true,
            holds: flat("unit"),
            is_expected: |e| {
                matches!(e, Error::WrongOptimParam { param, .. }
                    if param == "the flat parameter of unit `unit`")
            },
            names: &["unit `unit`", "use_orig_params=True"],
        },
    ];
    for case in cases {
        let (model, policy) = if case.use_orig_params {
            (orig_model(), orig_policy())
        } else {
            (small_model(), small_policy())
        };
        let err = shard_with(&model, &policy, OptimParams::single(vec![case.holds]));
        assert!((case.is_expected)(&err), "{}: {err:?}", case.scenario);
        assert_names(&err, case.names);
    }
}

// ===== 4. model description and layout =====

fn layout_error(model: &ModelDesc, policy: &WrapPolicy) -> Error {
    ModelLayout::new(model, policy, 2).unwrap_err()
}

#[test]
fn a_model_listing_a_parameter_twice() {
    let model = ModelDesc::new()
        .param("unit.a", &[2], F32)
        .param("unit.a", &[3], F32);
    let err = layout_error(&model, &small_policy());
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["`unit.a`", "twice"]);
}

#[test]
fn a_tied_alias_of_an_unknown_parameter() {
    let model = ModelDesc::new()
        .param("embed.weight", &[4, 2], F32)
        .tie("head.weight", "embed.wieght");
    let err = layout_error(&model, &WrapPolicy::default());
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["`head.weight`", "`embed.wieght`"]);
}

#[test]
fn a_tied_alias_also_listed_as_a_parameter() {
    let model = ModelDesc::new()
        .param("embed.weight", &[4, 2], F32)
        .param("head.weight", &[4, 2], F32)
        .tie("head.weight", "embed.weight");
    let err = layout_error(&model, &WrapPolicy::default());
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["`head.weight`"]);
}

#[test]
fn a_unit_without_parameters() {
    let err = layout_error(&small_model(), &WrapPolicy::units(&["unit", "ghost"]));
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["unit `ghost`", "no parameter"]);
}

#[test]
fn a_unit_listed_twice() {
    let err = layout_error(&small_model(), &WrapPolicy::units(&["unit", "unit"]));
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["unit `unit`", "twice"]);
}

#[test]
fn an_ignored_module_without_parameters() {
    let err = layout_error(&small_model(), &small_policy().with_ignored(&["ghost"]));
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["`ghost`"]);
}

#[test]
fn a_unit_mixing_dtypes() {
    let model = ModelDesc::new()
        .param("unit.a", &[2], F32)
        .param("unit.b", &[2], DType::BF16);
    let err = layout_error(&model, &small_policy());
    assert!(
        matches!(&err, Error::Flatten { unit, .. } if unit == "unit"),
        "{err:?}"
    );
    assert_names(&err, &["`unit`", "`unit.a`", "`unit.b`", "torch.bfloat16"]);
}

#[test]
fn a_unit_holding_an_integer_parameter() {
    let model = ModelDesc::new()
        .param("unit.a", &[2], F32)
        .param("unit.count", &[1], DType::I64);
    let err = layout_error(&model, &small_policy());
    assert!(
        matches!(&err, Error::Flatten { unit, .. } if unit == "unit"),
        "{err:?}"
    );
    assert_names(&err, &["`unit`", "`unit.count`", "torch.int64"]);
}

#[test]
fn a_unit_mixing_requires_grad_without_use_orig_params() {
    let model = ModelDesc::new()
        .param("unit.a", &[2], F32)
        .frozen_param("unit.b", &[2], F32);
    let err = layout_error(&model, &small_policy());
    assert!(
        matches!(&err, Error::Flatten { unit, .. } if unit == "unit"),
        "{err:?}"
    );
    assert_names(&err, &["`unit`", "`unit.a`", "`unit.b`", "requires_grad"]);
    // With use_orig_params, frozen and trained parameters may share a flat parameter.
    ModelLayout::new(&model, &small_policy().with_orig_params(true), 2).unwrap();
}

#[test]
fn a_world_size_of_zero() {
    let err = ModelLayout::new(&small_model(), &small_policy(), 0).unwrap_err();
    assert!(matches!(err, Error::InvalidModel(_)), "{err:?}");
    assert_names(&err, &["world size"]);
}

#[test]
fn hybrid_sharding_without_a_shard_group() {
    let policy = small_policy().with_strategy(ShardingStrategy::HybridShard);
    let errs = ThreadGroup::run_with_timeout(1, TIMEOUT, |pg| {
        Fsdp::new(&small_model(), &policy, Arc::new(pg)).unwrap_err()
    });
    assert!(
        matches!(&errs[0], Error::ConfigMismatch { expected, found, .. }
            if expected.contains("Fsdp::new_hybrid") && found == "HybridShard"),
        "{:?}",
        errs[0]
    );
}

#[test]
fn a_shard_group_size_that_does_not_divide_the_world_size() {
    let policy = small_policy().with_strategy(ShardingStrategy::HybridShard);
    let errs = ThreadGroup::run_with_timeout(2, TIMEOUT, |pg| {
        Fsdp::new_hybrid(&small_model(), &policy, Arc::new(pg), 3).unwrap_err()
    });
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::ConfigMismatch { expected, found, .. }
            if expected == "a divisor of the world size 2" && found == "3"),
        "{err:?}"
    );
}

#[test]
fn a_state_dict_config_of_another_type() {
    let errs = on_ranks(1, &small_model(), &small_policy(), |mut fsdp| {
        let config = OptimStateDictConfig::Local {
            offload_to_cpu: false,
        };
        fsdp.set_state_dict_type(StateDictType::Sharded, Some(config))
            .unwrap_err()
    });
    assert!(
        matches!(&errs[0], Error::ConfigMismatch { expected, found, .. }
            if expected == "a config for Sharded" && found.starts_with("Local")),
        "{:?}",
        errs[0]
    );
}

// ===== 5. rekey_optim_state_dict =====

/// Rekeys `osd` to `key_type` for an unwrapped `small_model()` whose optimizer holds `unit.a`
/// and `unit.b` (not `head.w`).
fn rekey_error(osd: &OptimStateDict, key_type: OptimStateKeyType) -> Error {
    let params = OptimParams::single(vec![orig("unit.a"), orig("unit.b")]);
    let errs = on_ranks(1, &small_model(), &WrapPolicy::default(), |fsdp| {
        fsdp.rekey_optim_state_dict(osd, key_type, &params)
            .unwrap_err()
    });
    same_on_every_rank(errs)
}

#[test]
fn rekeying_a_dict_that_mixes_ids_and_names() {
    let mut osd = OptimStateDict::default();
    osd.state.insert(ParamKey::Id(0), adam(&[2, 3], 0.0, 1.0));
    osd.state.insert("unit.b".into(), adam(&[3], 1.0, 1.0));
    let err = rekey_error(&osd, OptimStateKeyType::ParamName);
    assert!(
        matches!(&err, Error::WrongKeyType { key, expected, .. } if key == "'unit.b'" && expected == "parameter ids only"),
        "{err:?}"
    );
    assert_names(&err, &["mixes ids and names", "\"0\"", "'unit.b'"]);
}

#[test]
fn rekeying_to_ids_a_name_the_optimizer_does_not_hold() {
    let mut osd = OptimStateDict::default();
    osd.state.insert("unit.a".into(), adam(&[2, 3], 0.0, 1.0));
    osd.state.insert("head.w".into(), adam(&[2], 1.0, 1.0));
    let err = rekey_error(&osd, OptimStateKeyType::ParamId);
    assert!(
        matches!(&err, Error::UnknownParameter { name, .. } if name.contains("head.w")),
        "{err:?}"
    );
    assert_names(&err, &["head.w", "does not hold"]);
}

#[test]
fn rekeying_to_names_an_id_the_optimizer_does_not_hold() {
    let mut osd = OptimStateDict::default();
    osd.state.insert(ParamKey::Id(0), adam(&[2, 3], 0.0, 1.0));
    osd.state.insert(ParamKey::Id(5), adam(&[3], 1.0, 1.0));
    let err = rekey_error(&osd, OptimStateKeyType::ParamName);
    assert!(
        matches!(&err, Error::UnknownParameter { name, .. } if name == "5"),
        "{err:?}"
    );
    assert_names(&err, &["`5`", "does not hold"]);
}

#[test]
fn rekeying_param_groups_that_list_a_name_the_optimizer_does_not_hold() {
    let mut osd = OptimStateDict::default();
    osd.state.insert("unit.a".into(), adam(&[2, 3], 0.0, 1.0));
    osd.param_groups = Some(vec![group(["unit.a", "ghost.weight"])]);
    let err = rekey_error(&osd, OptimStateKeyType::ParamId);
    assert!(
        matches!(&err, Error::UnknownParameter { name, .. } if name.contains("ghost.weight")),
        "{err:?}"
    );
    assert_names(&err, &["ghost.weight", "param_groups[0]"]);
}

// ===== 6. scatter_full_optim_state_dict =====

/// `scatter_full_optim_state_dict` on both ranks of `small_model()`, rank 0 passing
/// `rank0_full`: each rank's error, which must be the same everywhere.
fn scatter_error(rank0_full: Option<&OptimStateDict>) -> Error {
    let errs = on_ranks(2, &small_model(), &small_policy(), |fsdp| {
        let full = if fsdp.rank() == 0 { rank0_full } else { None };
        fsdp.scatter_full_optim_state_dict(full, &fsdp.optim_params())
            .unwrap_err()
    });
    same_on_every_rank(errs)
}

#[test]
fn scatter_when_rank_0_passes_no_dict() {
    let err = scatter_error(None);
    assert!(
        matches!(&err, Error::InvalidArgument { op, rank: 0, .. } if op == "scatter_full_optim_state_dict"),
        "{err:?}"
    );
    assert_names(
        &err,
        &[
            "scatter_full_optim_state_dict on rank 0",
            "the root rank must pass the full dict",
        ],
    );
}

#[test]
fn scatter_when_rank_0_passes_a_dict_keyed_by_ids() {
    let mut full = OptimStateDict::default();
    full.state.insert(ParamKey::Id(0), adam(&[2, 3], 0.0, 3.0));
    let err = scatter_error(Some(&full));
    assert!(
        matches!(&err, Error::WrongKeyType { key, .. } if key == "0"),
        "{err:?}"
    );
    assert_names(&err, &["key 0"]);
}

#[test]
fn scatter_when_rank_0_passes_a_dict_holding_a_sharded_tensor() {
    let mut full = full_adam(&small_model(), 3.0);
    let st = state_mut(&mut full, "head.w");
    let sharded = as_sharded(&st["exp_avg_sq"]);
    st.insert("exp_avg_sq".into(), sharded);
    let err = scatter_error(Some(&full));
    assert!(
        matches!(&err, Error::WrongStateKind { param, state, .. } if param == "'head.w'" && state == "exp_avg_sq"),
        "{err:?}"
    );
    assert_names(&err, &["`exp_avg_sq`", "'head.w'", "sharded"]);
}

#[test]
fn scatter_of_a_full_dict_with_differing_state_names_fails_on_every_rank() {
    let mut full = full_adam(&small_model(), 3.0);
    state_mut(&mut full, "unit.a").shift_remove("exp_avg");
    let err = scatter_error(Some(&full));
    assert!(matches!(err, Error::DifferingStateNames { .. }), "{err:?}");
    assert_names(&err, &["unit.a", "unit.b", "exp_avg"]);
}

#[test]
fn scatter_when_a_non_root_rank_holds_an_unknown_unit() {
    // Regression (was a bug): `scatter::scatter_full` validates the optimizer's parameters only inside
    // `flatten_from_source` (`layout.local_params`), after the skeleton broadcast and before the
    // per-parameter tensor broadcasts. Rank 1 returns UnknownParameter while rank 0 goes on
    // broadcasting: here rank 0 gets PeerDied (not naming the cause) once rank 1's handle is
    // dropped; on a real backend rank 0 hangs. Resolving `params` before the first collective
    // and exchanging the outcome with the digests would fail every rank together.
    let full = full_adam(&small_model(), 3.0);
    let results = on_ranks(2, &small_model(), &small_policy(), |fsdp| {
        let params = if fsdp.rank() == 1 {
            OptimParams::single(vec![flat("nope")])
        } else {
            fsdp.optim_params()
        };
        let full = (fsdp.rank() == 0).then_some(&full);
        fsdp.scatter_full_optim_state_dict(full, &params)
            .map(|_| ())
    });
    let err1 = results[1].clone().unwrap_err();
    assert!(
        matches!(&err1, Error::UnknownUnit { unit } if unit == "nope"),
        "{err1:?}"
    );
    let err0 = results[0]
        .clone()
        .expect_err("rank 0 cannot complete a scatter rank 1 abandoned");
    assert!(
        !matches!(
            err0,
            Error::PeerDied { .. } | Error::CollectiveTimeout { .. }
        ),
        "rank 0: {err0}"
    );
    assert_names(&err0, &["nope"]);
}

#[test]
fn scatter_of_a_wrong_size_state_of_an_original_parameter_only_one_rank_holds() {
    // Regression (was a bug): `flatten::shard_orig_param_state` returns early for a rank that holds none of the
    // parameter, before the size check, so only rank 0 (which holds `unit.a`) reports
    // ShapeMismatch. During a scatter rank 1 goes on to the next broadcast: it gets PeerDied here,
    // and hangs on a real backend. The check should run before `if !info.in_shard` (and also
    // when not sharded), so every rank fails on the same parameter.
    let mut full = full_adam(&orig_model(), 3.0);
    state_mut(&mut full, "unit.a").insert("exp_avg".into(), Value::Tensor(tensor(&[3], 0.0)));
    let results = on_ranks(2, &orig_model(), &orig_policy(), |fsdp| {
        let full = (fsdp.rank() == 0).then_some(&full);
        fsdp.scatter_full_optim_state_dict(full, &fsdp.optim_params())
            .map(|_| ())
    });
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.expect_err("a wrong-size state must fail");
        assert!(
            matches!(err, Error::ShapeMismatch { .. }),
            "rank {rank}: {err:?}"
        );
        assert_names(&err, &["`exp_avg`", "`unit.a`"]);
    }
}

// ===== 7. optim_state_dict_to_load with SHARDED_STATE_DICT =====

/// Each rank's `SHARDED_STATE_DICT` of the nested model is `tamper`ed with, then loaded with
/// `optim_state_dict_to_load` (the dict passed is `None` when `tamper` returns false).
fn sharded_load_errors(
    tamper: impl Fn(usize, &mut OptimStateDict) -> bool + Send + Sync,
) -> Vec<Error> {
    let model = common::nested_model();
    let full = full_adam(&model, 3.0);
    on_ranks(2, &model, &common::wrap(false), |mut fsdp| {
        fsdp.set_state_dict_type(StateDictType::Sharded, None)
            .unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        let mut sharded = fsdp.optim_state_dict(&local, &params).unwrap().unwrap();
        let pass = tamper(fsdp.rank(), &mut sharded);
        fsdp.optim_state_dict_to_load(pass.then_some(&sharded), &params)
            .unwrap_err()
    })
}

/// Rank 1's sharded dict has an extra state `exp_avg_copy` for `block1.weight`.
fn extra_state_on_rank_1(rank: usize, sharded: &mut OptimStateDict) -> bool {
    if rank == 1 {
        let st = state_mut(sharded, "block1.weight");
        let copy = st["exp_avg"].clone();
        assert!(matches!(copy, Value::Sharded(_)));
        st.insert("exp_avg_copy".into(), copy);
    }
    true
}

#[test]
fn loading_sharded_dicts_when_one_rank_has_an_extra_state() {
    let err = same_on_every_rank(sharded_load_errors(extra_state_on_rank_1));
    assert!(
        matches!(&err, Error::PlanMismatch { op, ranks, .. } if op == "optim_state_dict_to_load" && ranks == &[1]),
        "{err:?}"
    );
    assert_names(
        &err,
        &["optim_state_dict_to_load", "ranks [1] differ from rank 0"],
    );
}

#[test]
fn loading_sharded_dicts_names_the_extra_state() {
    // Regression (was a bug): `scatter::gather_sharded` reports only "the sharded dicts hold different parameters,
    // state names or global shapes": the message names the rank but not which parameter/state
    // differs (`exp_avg_copy` of `block1.weight`). The detail should show the first entry in
    // which rank r's list differs from rank 0's.
    let err = same_on_every_rank(sharded_load_errors(extra_state_on_rank_1));
    assert!(
        matches!(&err, Error::PlanMismatch { op, reference: 0, ranks, .. }
            if op == "optim_state_dict_to_load" && ranks == &[1]),
        "{err:?}"
    );
    assert_names(&err, &["block1.weight", "exp_avg_copy"]);
}

#[test]
fn loading_sharded_dicts_when_one_rank_passes_none() {
    let errs = sharded_load_errors(|rank, _| rank != 1);
    let err = same_on_every_rank(errs);
    assert!(
        matches!(&err, Error::PlanMismatch { ranks, .. } if ranks == &[1]),
        "{err:?}"
    );
    assert_names(&err, &["ranks [1]"]);
}

#[test]
fn loading_a_full_dict_that_is_not_passed() {
    let errs = on_ranks(1, &small_model(), &small_policy(), |fsdp| {
        fsdp.optim_state_dict_to_load(None::<&OptimStateDict>, &fsdp.optim_params())
            .unwrap_err()
    });
    assert!(
        matches!(&errs[0], Error::InvalidArgument { op, rank: 0, .. } if op == "optim_state_dict_to_load"),
        "{:?}",
        errs[0]
    );
    assert_names(&errs[0], &["rank 0", "full"]);
}

// ===== 8. collectives through the façade =====

#[test]
fn a_rank_that_never_calls_full_optim_state_dict() {
    let model = small_model();
    let policy = small_policy();
    let full = full_adam(&model, 3.0);
    let timeout = Duration::from_millis(300);
    let errs = ThreadGroup::run_with_timeout(2, timeout, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        if fsdp.rank() == 1 {
            // Busy elsewhere but alive: rank 0 must give up by itself.
            std::thread::sleep(timeout * 3);
        }
        fsdp.full_optim_state_dict(&local, &params, false)
            .unwrap_err()
    });
    let Error::CollectiveTimeout {
        rank,
        waited,
        missing,
        ..
    } = &errs[0]
    else {
        panic!("rank 0: expected CollectiveTimeout, got {:?}", errs[0])
    };
    assert_eq!((*rank, missing.as_slice()), (0, &[1][..]));
    assert!(*waited >= timeout, "{waited:?}");
    assert_names(&errs[0], &["on rank 0", "ranks not arrived: [1]"]);
    // The late rank fails at once, without waiting: its call belongs to the round that timed
    // out, so it gets that round's error, which names it as the rank that did not arrive.
    assert!(
        matches!(&errs[1], Error::CollectiveTimeout { rank: 1, missing, .. } if missing == &[1]),
        "{:?}",
        errs[1]
    );
    assert_names(&errs[1], &["on rank 1", "ranks not arrived: [1]"]);
}

#[test]
fn a_rank_that_leaves_before_full_optim_state_dict() {
    let model = small_model();
    let policy = small_policy();
    let full = full_adam(&model, 3.0);
    let results = on_ranks(2, &model, &policy, |fsdp| {
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        // Rank 1 returns, dropping its handle.
        (fsdp.rank() == 0).then(|| {
            fsdp.full_optim_state_dict(&local, &params, false)
                .unwrap_err()
        })
    });
    let err = results[0].clone().unwrap();
    assert!(
        matches!(
            err,
            Error::PeerDied {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert_names(&err, &["on rank 0", "peer rank 1"]);
}

// ===== 9. HostTensor =====

#[test]
fn narrowing_a_host_tensor_out_of_range() {
    let t = HostTensor::zeros(DType::BF16, &[3]);
    let err = t.narrow_flat(2, 3).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBounds {
            context: "narrow_flat of a [3] tensor".into(),
            start: 2,
            end: 5,
            numel: 3
        }
    );
    assert_names(&err, &["2..5", "[3] tensor", "3 elements"]);
    // An overflowing range is an error too, not a panic.
    let err = t.narrow_flat(usize::MAX, 2).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                start: usize::MAX,
                numel: 3,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_host_tensor_from_bytes_of_the_wrong_length() {
    let err = HostTensor::from_bytes(F32, &[2], &[0u8; 7]).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { expected, .. } if expected == &[2]),
        "{err:?}"
    );
    assert_names(&err, &["from_bytes", "torch.float32", "7 bytes"]);
}

#[test]
fn a_host_tensor_from_bytes_whose_shape_overflows() {
    // Regression (was a bug): `tensor/host.rs` `numel_of` multiplies the shape unchecked: `from_bytes` (and
    // `zeros`, `reshape`, and `Deserialize for HostTensor`, which decodes peers' messages)
    // panics with "attempt to multiply with overflow" in debug builds, and in release builds
    // accepts [2^62, 4] with 0 bytes (the product wraps to 0). Use `checked_mul` and return
    // ShapeMismatch / MissingState instead.
    let shape = [1usize << 62, 4];
    let result =
        std::panic::catch_unwind(|| HostTensor::from_bytes(F32, &shape, &[]).map(|t| t.numel()));
    let result = result.expect("from_bytes panicked on an overflowing shape");
    let err = result.expect_err("a shape of 2^64 elements cannot hold 0 bytes");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
}

#[test]
fn a_typed_view_of_another_dtype() {
    let t = HostTensor::from_vec1(&[1.0f32, 2.0]);
    let err = t.as_slice::<f64>().unwrap_err();
    assert_eq!(
        err,
        Error::DtypeMismatch {
            context: "HostTensor::as_slice".into(),
            expected: "torch.float64".into(),
            found: "torch.float32".into()
        }
    );
    assert_names(&err, &["as_slice", "torch.float64", "torch.float32"]);
}

#[test]
fn reshaping_a_host_tensor_to_another_element_count() {
    let err = HostTensor::from_vec1(&[1.0f32, 2.0, 3.0])
        .reshape(&[2, 2])
        .unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { expected, found, .. } if expected == &[2, 2] && found == &[3]),
        "{err:?}"
    );
    assert_names(&err, &["reshape", "[2, 2]", "[3]"]);
}

#[test]
fn concatenating_host_tensors_of_different_dtypes() {
    let parts = [
        HostTensor::from_vec1(&[1.0f32]),
        HostTensor::from_vec1(&[1.0f64]),
    ];
    let err = HostTensor::cat_flat(&parts).unwrap_err();
    assert!(matches!(err, Error::DtypeMismatch { .. }), "{err:?}");
    assert_names(&err, &["cat_flat", "torch.float32", "torch.float64"]);
}
