//! The `tch` backend: conversions of every dtype, the `Tensor` operations against
//! `HostTensor`, the façade on `TchTensor` dicts bit-identical to the host path on the nested
//! scenario model, VarStore parameter order, and optimizers stepping `tch` parameters.
//!
//! Run with `scripts/test-tch.sh` (needs PyTorch 2.13 in `.venv`).
#![cfg(feature = "tch")]

mod common;

use common::*;
use fsdp::collectives::ThreadGroup;
use fsdp::flat_param::ModelLayout;
use fsdp::libtorch::{
    model_desc_from_var_store, model_desc_from_var_store_in_order, state_dict_to_host,
    state_dict_to_tch, step_tch, var_store_params, var_store_params_in_order,
};
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_shards::{shard_tensors, synthetic_grads, synthetic_params};
use fsdp::tensor::tch::dtype_to_kind;
use fsdp::{
    DType, Error, Fsdp, HostTensor, ModelDesc, OptimParams, OptimStateDict, ParamKey, TchTensor,
    Tensor, Value, WrapPolicy,
};
use std::sync::Arc;
use tch::{nn, Device, Kind};

// ===== conversions =====

/// Sample values of each dtype with awkward bits (NaN payloads, -0.0, extremes).
fn sample(dtype: DType, shape: &[usize]) -> HostTensor {
    let n: usize = shape.iter().product();
    let f = |i: usize| [1.5, -0.0, f64::NAN, f64::INFINITY, -3.25e-3, 65504.0][i % 6];
    match dtype {
        DType::F32 => {
            let mut v: Vec<f32> = (0..n).map(|i| f(i) as f32).collect();
            if n > 2 {
                v[2] = f32::from_bits(0x7fc0_1234); // NaN with a payload
            }
            HostTensor::from_slice(&v, shape)
        }
        DType::F64 => HostTensor::from_slice(&(0..n).map(f).collect::<Vec<_>>(), shape),
        DType::F16 => HostTensor::from_slice(
            &(0..n)
                .map(|i| half::f16::from_f64(f(i)))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::BF16 => HostTensor::from_slice(
            &(0..n)
                .map(|i| half::bf16::from_f64(f(i)))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::I64 => HostTensor::from_slice(
            &(0..n)
                .map(|i| [i64::MIN, -1, 0, i64::MAX][i % 4])
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::I32 => HostTensor::from_slice(
            &(0..n)
                .map(|i| [i32::MIN, -7, 0, i32::MAX][i % 4])
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::U8 => {
            HostTensor::from_slice(&(0..n).map(|i| (i * 37) as u8).collect::<Vec<_>>(), shape)
        }
        DType::Bool => {
            HostTensor::from_bools(&(0..n).map(|i| i % 3 == 1).collect::<Vec<_>>(), shape)
        }
        // Any bits are valid values of the other integer and float8 dtypes.
        other => HostTensor::from_bytes(
            other,
            shape,
            &(0..n * other.size())
                .map(|i| (i * 37 + 11) as u8)
                .collect::<Vec<_>>(),
        ),
    }
    .unwrap()
}

/// The dtypes tch 0.26 has a kind for (all but uint16/32/64).
fn tch_dtypes() -> impl Iterator<Item = DType> {
    DType::ALL
        .into_iter()
        .filter(|&d| !matches!(d, DType::U16 | DType::U32 | DType::U64))
}

#[test]
fn unsigned_dtypes_without_a_tch_kind_are_refused_by_name() {
    for d in [DType::U16, DType::U32, DType::U64] {
        let e = TchTensor::from_host(sample(d, &[2])).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported(what) if what.contains(d.torch_name())),
            "{e:?}"
        );
    }
}

#[test]
fn every_dtype_round_trips_bit_exact_including_zero_dim_and_empty() {
    for dtype in tch_dtypes() {
        for shape in [vec![], vec![1], vec![7], vec![2, 3], vec![0], vec![2, 0, 3]] {
            let host = sample(dtype, &shape);
            let t = TchTensor::from_host(host.clone()).unwrap();
            assert_eq!(Tensor::dtype(&t), dtype);
            assert_eq!(Tensor::shape(&t), shape);
            // libtorch agrees on kind and sizes.
            let raw = t.to_tch();
            assert_eq!(
                raw.kind(),
                dtype_to_kind(dtype).unwrap(),
                "{dtype} {shape:?}"
            );
            assert_eq!(
                raw.size(),
                shape.iter().map(|&d| d as i64).collect::<Vec<_>>()
            );
            assert_eq!(raw.device(), Device::Cpu);
            let back = t.to_host().unwrap();
            assert!(
                back.bit_eq(&host),
                "{dtype} {shape:?}: {back:?} vs {host:?}"
            );
            assert_eq!(t, t.clone());
        }
    }
}

#[test]
fn values_read_by_libtorch_match_the_host_values() {
    let h = HostTensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.5, 6.0], &[2, 3]).unwrap();
    let t = TchTensor::from_host(h).unwrap().to_tch();
    assert_eq!(t.double_value(&[1, 0]), 4.0);
    let s = TchTensor::from_host(HostTensor::scalar(half::bf16::from_f32(0.5))).unwrap();
    assert_eq!(s.to_tch().dim(), 0);
    assert_eq!(s.to_tch().double_value(&[]), 0.5);
    let b = TchTensor::from_host(HostTensor::from_bools(&[true, false], &[2]).unwrap()).unwrap();
    assert_eq!(b.to_tch().kind(), Kind::Bool);
    assert_eq!(b.to_tch().int64_value(&[0]), 1);
}

#[test]
fn tensors_made_by_libtorch_convert_to_host() {
    // A non-contiguous view converts in row-major order of the view.
    let t = tch::Tensor::arange(6, (Kind::Float, Device::Cpu))
        .reshape([2, 3])
        .transpose(0, 1);
    let w = TchTensor::new(t).unwrap();
    assert_eq!(Tensor::shape(&w), vec![3, 2]);
    assert_eq!(
        w.to_host().unwrap().as_slice::<f32>().unwrap(),
        &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    );
    // The same for narrow_flat of the view.
    let n = w.narrow_flat(1, 3).unwrap().to_host().unwrap();
    assert_eq!(n.as_slice::<f32>().unwrap(), &[3.0, 1.0, 4.0]);
    // A tensor that requires grad is wrapped detached; a 0-dim one stays 0-dim.
    let p = tch::Tensor::from(2.5f64).set_requires_grad(true);
    let w = TchTensor::new(p.shallow_clone()).unwrap();
    assert!(!w.to_tch().requires_grad());
    assert_eq!(Tensor::dim(&w), 0);
    assert_eq!(w.to_host().unwrap().item(), Some(2.5));
}

#[test]
fn unsupported_kinds_and_bad_arguments_are_errors_not_panics() {
    // int8 and complex64 are supported dtypes; complex32 is not, and is named.
    let i8t = tch::Tensor::zeros([3], (Kind::Int8, Device::Cpu));
    assert_eq!(Tensor::dtype(&TchTensor::new(i8t).unwrap()), DType::I8);
    let c64 = tch::Tensor::zeros([3], (Kind::ComplexFloat, Device::Cpu));
    assert_eq!(Tensor::dtype(&TchTensor::new(c64).unwrap()), DType::C64);
    let c = tch::Tensor::zeros([3], (Kind::ComplexHalf, Device::Cpu));
    let e = TchTensor::new(c).unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported(m) if m.contains("ComplexHalf")),
        "{e}"
    );

    let t = TchTensor::from_host(sample(DType::F32, &[2, 3])).unwrap();
    assert!(matches!(
        t.narrow_flat(4, 3),
        Err(Error::OutOfBounds { numel: 6, .. })
    ));
    assert!(matches!(
        t.narrow_flat(usize::MAX, 2),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(t.reshape(&[4]), Err(Error::ShapeMismatch { .. })));
    let d = TchTensor::from_host(sample(DType::F64, &[2])).unwrap();
    assert!(matches!(
        TchTensor::cat_flat(&[t.clone(), d]),
        Err(Error::DtypeMismatch { .. })
    ));
    assert!(TchTensor::cat_flat(&[]).is_err());
}

#[test]
fn tensor_operations_match_the_host_backend() {
    for dtype in tch_dtypes() {
        let a = sample(dtype, &[3, 4]);
        let b = sample(dtype, &[]);
        let c = sample(dtype, &[0]);
        let (ta, tb, tc) = (
            TchTensor::from_host(a.clone()).unwrap(),
            TchTensor::from_host(b.clone()).unwrap(),
            TchTensor::from_host(c.clone()).unwrap(),
        );
        let same = |t: &TchTensor, h: &HostTensor| assert!(t.to_host().unwrap().bit_eq(h));
        same(
            &ta.narrow_flat(5, 6).unwrap(),
            &a.narrow_flat(5, 6).unwrap(),
        );
        same(
            &ta.narrow_flat(12, 0).unwrap(),
            &a.narrow_flat(12, 0).unwrap(),
        );
        same(
            &tb.narrow_flat(0, 1).unwrap(),
            &b.narrow_flat(0, 1).unwrap(),
        );
        same(&ta.reshape(&[2, 6]).unwrap(), &a.reshape(&[2, 6]).unwrap());
        same(&tb.reshape(&[1, 1]).unwrap(), &b.reshape(&[1, 1]).unwrap());
        same(
            &TchTensor::cat_flat(&[ta.clone(), tb.clone(), tc.clone()]).unwrap(),
            &HostTensor::cat_flat(&[a.clone(), b.clone(), c.clone()]).unwrap(),
        );
        same(
            &TchTensor::zeros(dtype, &[2, 2]).unwrap(),
            &HostTensor::zeros(dtype, &[2, 2]),
        );
        // Views share storage like host views do.
        let v = ta.narrow_flat(0, 2).unwrap();
        assert_eq!(v.to_tch().data_ptr(), ta.to_tch().data_ptr());
        assert!(ta.bit_eq(&ta.clone()) && !ta.bit_eq(&v));
    }
}

// ===== the façade on tch tensors =====

const STEPS: usize = 3;

/// `_init_nested_model` optimizer: Adam lr 0.01, two groups (second with weight_decay 0.9),
/// reversed on odd ranks.
fn trained_local(layout: &ModelLayout, rank: usize) -> (OptimParams, OptimStateDict) {
    let input = nested_optim_input(layout, true, true, rank);
    let mut adam = Adam::new(
        input.clone(),
        AdamConfig {
            lr: 0.01,
            ..AdamConfig::default()
        },
    )
    .unwrap()
    .with_group_options(1, [("weight_decay", Value::Float(0.9))])
    .unwrap();
    let mut slots = Slots::new(layout, rank, &input);
    for s in 0..STEPS {
        let grads = shard_tensors(layout, rank, &input, &synthetic_grads(layout, s)).unwrap();
        adam.step(&mut slots.params, &grads).unwrap();
    }
    (input, adam.state_dict())
}

/// Equal contents *and* equal orders (IndexMap equality ignores order).
fn assert_identical(tch: &OptimStateDict<TchTensor>, host: &OptimStateDict, what: &str) {
    let tch = state_dict_to_host(tch).unwrap();
    assert_eq!(&tch, host, "{what}");
    let keys = |d: &OptimStateDict| -> Vec<(ParamKey, Vec<String>)> {
        d.state
            .iter()
            .map(|(k, s)| (k.clone(), s.keys().cloned().collect()))
            .collect()
    };
    assert_eq!(keys(&tch), keys(host), "{what}: order");
    let groups = |d: &OptimStateDict| -> Vec<(Vec<String>, Vec<ParamKey>)> {
        d.param_groups
            .iter()
            .flatten()
            .map(|g| (g.options.keys().cloned().collect(), g.params.clone()))
            .collect()
    };
    assert_eq!(groups(&tch), groups(host), "{what}: param_groups");
}

fn facade_matches_host(world_size: usize, policy: WrapPolicy) {
    let model = nested_model();
    let results = ThreadGroup::run(world_size, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let rank = fsdp.rank();
        let (input, local) = trained_local(fsdp.layout(), rank);
        let local_tch = state_dict_to_tch(&local).unwrap();

        // full_optim_state_dict, rank-0-only and everywhere.
        for rank0_only in [true, false] {
            let host = fsdp
                .full_optim_state_dict(&local, &input, rank0_only)
                .unwrap();
            let tch = fsdp
                .full_optim_state_dict(&local_tch, &input, rank0_only)
                .unwrap();
            assert_eq!(host.is_some(), tch.is_some());
            if let (Some(h), Some(t)) = (&host, &tch) {
                assert_identical(t, h, "full_optim_state_dict");
            }
        }
        let full = fsdp
            .full_optim_state_dict(&local, &input, false)
            .unwrap()
            .unwrap();
        let full_tch = state_dict_to_tch(&full).unwrap();

        // shard_full_optim_state_dict (local) and scatter_full_optim_state_dict (collective).
        let sharded_host = fsdp.shard_full_optim_state_dict(&full, &input).unwrap();
        let sharded_tch = fsdp.shard_full_optim_state_dict(&full_tch, &input).unwrap();
        assert_identical(&sharded_tch, &sharded_host, "shard_full_optim_state_dict");
        // Re-sharding the consolidated dict gives back this rank's own optimizer state.
        assert_same_state(&sharded_host, &local, "shard(full) vs local");

        let root = rank == 0;
        let scattered_host = fsdp
            .scatter_full_optim_state_dict(root.then_some(&full), &input)
            .unwrap();
        let scattered_tch = fsdp
            .scatter_full_optim_state_dict(root.then_some(&full_tch), &input)
            .unwrap();
        assert_identical(
            &scattered_tch,
            &scattered_host,
            "scatter_full_optim_state_dict",
        );

        // The sharded (SHARDED_STATE_DICT) form and back.
        let sh_host = fsdp.sharded_optim_state_dict(&local, &input).unwrap();
        let sh_tch = fsdp.sharded_optim_state_dict(&local_tch, &input).unwrap();
        assert_identical(&sh_tch, &sh_host, "sharded_optim_state_dict");
        let back_tch = fsdp
            .flatten_sharded_optim_state_dict(&sh_tch, &input)
            .unwrap();
        assert_identical(&back_tch, &sharded_host, "flatten_sharded_optim_state_dict");
        full.state.len()
    });
    assert!(results.iter().all(|&n| n == results[0] && n > 0));
}

#[test]
fn facade_on_tch_tensors_is_bit_identical_to_host_nested_world_2() {
    facade_matches_host(2, wrap(false));
}

#[test]
fn facade_on_tch_tensors_is_bit_identical_to_host_nested_world_3_ignored_modules() {
    facade_matches_host(3, wrap(true));
}

#[test]
fn facade_on_tch_tensors_is_bit_identical_to_host_nested_orig_params() {
    facade_matches_host(2, wrap(false).with_orig_params(true));
}

// ===== VarStore =====

/// The nested model of the scenario tests built with tch, variables created in PyTorch's
/// registration order, plus a buffer and a frozen parameter.
fn nested_var_store() -> nn::VarStore {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let expected = nested_model();
    for p in &expected.params {
        let mut path = root.clone();
        let parts: Vec<&str> = p.name.split('.').collect();
        for seg in &parts[..parts.len() - 1] {
            path = path / *seg;
        }
        let dims: Vec<i64> = p.shape.iter().map(|&d| d as i64).collect();
        let _ = path.randn_standard(parts[parts.len() - 1], &dims);
    }
    vs
}

#[test]
fn var_store_gives_parameters_in_creation_order() {
    let vs = nested_var_store();
    let model = model_desc_from_var_store(&vs).unwrap();
    assert_eq!(model, nested_model());
    // The order is not the HashMap's: `bias` (created first) stays first.
    assert_eq!(model.params[0].name, "bias");
    let found = var_store_params(&vs).unwrap();
    assert!(found.tied.is_empty());
    let names: Vec<&str> = found.params.iter().map(|(n, _)| n.as_str()).collect();
    let expected: Vec<String> = nested_model().params.into_iter().map(|p| p.name).collect();
    assert_eq!(names, expected);
}

#[test]
fn tch_layers_create_bias_first_and_an_explicit_order_restores_pytorchs() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _l0 = nn::linear(vs.root() / "net" / 0, 3, 4, Default::default());
    let _l1 = nn::linear(vs.root() / "net" / 2, 4, 2, Default::default());
    let names = |m: &ModelDesc| m.params.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    // Creation order: tch's nn::linear makes `bias` before `weight`.
    assert_eq!(
        names(&model_desc_from_var_store(&vs).unwrap()),
        ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    );
    // `named_parameters()` of `nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))`
    // under a `net` attribute.
    let torch_order = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"];
    let model = model_desc_from_var_store_in_order(&vs, &torch_order).unwrap();
    assert_eq!(names(&model), torch_order);
    assert_eq!(model.params[0].shape, [4, 3]);
    let found = var_store_params_in_order(&vs, &torch_order).unwrap();
    assert_eq!(found.params[0].1.size(), [4, 3]);

    // Every parameter exactly once.
    let e = model_desc_from_var_store_in_order(&vs, &torch_order[..3]).unwrap_err();
    assert!(
        matches!(&e, Error::ParamOrderMismatch { missing, unknown, repeated, .. }
            if missing == &["net.2.bias"] && unknown.is_empty() && repeated.is_empty()),
        "{e:?}"
    );
    assert!(e.to_string().contains("missing [\"net.2.bias\"]"), "{e}");
    let e = model_desc_from_var_store_in_order(
        &vs,
        &[
            "net.0.weight",
            "net.0.weight",
            "net.2.weight",
            "net.2.bias",
            "x",
        ],
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::ParamOrderMismatch { missing, unknown, repeated, .. }
            if missing == &["net.0.bias"] && unknown == &["x"] && repeated == &["net.0.weight"]),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("\"net.0.bias\"")
            && msg.contains("\"x\"")
            && msg.contains("repeated [\"net.0.weight\"]"),
        "{msg}"
    );
}

#[test]
fn var_store_buffers_frozen_parameters_and_dtypes() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let _w = root.sub("enc").zeros("weight", &[4, 3]);
    let _rm = root.sub("bn").zeros_no_train("running_mean", &[3]); // a buffer
    let _g = root.sub("bn").ones("weight", &[3]);
    let h = root.add(
        "half_bias",
        tch::Tensor::zeros([3], (Kind::BFloat16, Device::Cpu)),
        true,
    );
    let _ = h.set_requires_grad(false); // frozen after creation
    let model = model_desc_from_var_store(&vs).unwrap();
    let expected = ModelDesc::new()
        .param("enc.weight", &[4, 3], DType::F32)
        .param("bn.weight", &[3], DType::F32)
        .frozen_param("half_bias", &[3], DType::BF16);
    assert_eq!(model, expected);

    // The façade takes it (one dtype per FSDP unit, as FSDP requires).
    let layouts = ThreadGroup::run(2, |pg| {
        let policy = WrapPolicy::units(&["enc", "bn", ""]);
        Fsdp::new(&model, &policy, Arc::new(pg))
            .map(|f| f.layout().flat_params().len())
            .map_err(|e| e.to_string())
    });
    assert_eq!(layouts, [Ok(3), Ok(3)]);
    let e = ThreadGroup::run(1, |pg| {
        Fsdp::new(&model, &WrapPolicy::units(&["enc", ""]), Arc::new(pg)).unwrap_err()
    });
    assert!(
        matches!(&e[0], Error::Flatten { unit, .. } if unit.is_empty()),
        "{e:?}"
    );
}

#[test]
fn var_store_tensor_registered_twice_is_one_parameter_with_an_alias() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let e = root.sub("embed").randn_standard("weight", &[5, 2]);
    let _b = root.sub("head").zeros("bias", &[5]);
    let _ = root.sub("head").add("weight", e.shallow_clone(), true);
    let model = model_desc_from_var_store(&vs).unwrap();
    assert_eq!(
        model
            .params
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["embed.weight", "head.bias"]
    );
    assert_eq!(model.tied["head.weight"], "embed.weight");
}

// ===== optimizers on tch parameters =====

#[test]
fn adam_steps_var_store_parameters_like_host_tensors() {
    let vs = nested_var_store();
    let model = model_desc_from_var_store(&vs).unwrap();
    let layout = unwrapped(&model);
    let input = OptimParams::of_model(&layout);
    let cfg = AdamConfig {
        lr: 0.01,
        weight_decay: 0.1.into(),
        ..AdamConfig::default()
    };
    let vars = var_store_params(&vs).unwrap().params;
    let mut tch_params: Vec<tch::Tensor> = vars.iter().map(|(_, t)| t.shallow_clone()).collect();
    let mut host_params: Vec<HostTensor> = tch_params
        .iter()
        .map(|t| {
            TchTensor::new(t.shallow_clone())
                .unwrap()
                .to_host()
                .unwrap()
        })
        .collect();
    let mut tch_adam = Adam::new(input.clone(), cfg.clone()).unwrap();
    let mut host_adam = Adam::new(input, cfg).unwrap();
    for s in 0..STEPS {
        let grads = synthetic_grads(&layout, s);
        let tch_grads: Vec<Option<tch::Tensor>> = grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .map(|g| TchTensor::from_host(g.clone()).unwrap().into_tch())
            })
            .collect();
        step_tch(&mut tch_adam, &mut tch_params, &tch_grads).unwrap();
        host_adam.step(&mut host_params, &grads).unwrap();
    }
    // The VarStore's own variables were updated in place and equal the host run bit for bit.
    let vars_after = vs.variables();
    for (p, h) in model.params.iter().zip(&host_params) {
        let v = TchTensor::new(vars_after[&p.name].shallow_clone()).unwrap();
        assert!(v.to_host().unwrap().bit_eq(h), "{}", p.name);
        assert!(vars_after[&p.name].requires_grad(), "{}", p.name);
    }
    assert_eq!(tch_adam.state_dict(), host_adam.state_dict());

    // A wrong gradient shape is an error and leaves the parameters untouched.
    let before: Vec<HostTensor> = tch_params
        .iter()
        .map(|t| {
            TchTensor::new(t.shallow_clone())
                .unwrap()
                .to_host()
                .unwrap()
        })
        .collect();
    let mut bad: Vec<Option<tch::Tensor>> = (0..tch_params.len()).map(|_| None).collect();
    bad[0] = Some(tch::Tensor::zeros([1], (Kind::Float, Device::Cpu)));
    assert!(step_tch(&mut tch_adam, &mut tch_params, &bad).is_err());
    for (t, b) in tch_params.iter().zip(&before) {
        assert!(TchTensor::new(t.shallow_clone())
            .unwrap()
            .to_host()
            .unwrap()
            .bit_eq(b));
    }
}

#[test]
fn fsdp_shards_of_tch_parameters_train_like_host_shards() {
    // Full parameter values live in tch; each rank cuts its flat shards from host copies,
    // trains them as tch tensors, and the consolidated state equals the host-only run.
    let vs = nested_var_store();
    let model = model_desc_from_var_store(&vs).unwrap();
    let vars = var_store_params(&vs).unwrap().params;
    let full_values: Vec<Option<HostTensor>> = vars
        .iter()
        .map(|(_, t)| {
            Some(
                TchTensor::new(t.shallow_clone())
                    .unwrap()
                    .to_host()
                    .unwrap(),
            )
        })
        .collect();
    let policy = wrap(false);
    let out = ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let (rank, layout) = (fsdp.rank(), fsdp.layout());
        let input = fsdp.optim_params();
        let cut = |full: &[Option<HostTensor>]| shard_tensors(layout, rank, &input, full).unwrap();
        let to_tch = |t: Option<HostTensor>| t.map(|t| TchTensor::from_host(t).unwrap().into_tch());
        let mut tch_slots: Vec<tch::Tensor> = cut(&full_values)
            .into_iter()
            .map(|t| to_tch(t).unwrap())
            .collect();
        let mut host_slots: Vec<HostTensor> =
            cut(&full_values).into_iter().map(Option::unwrap).collect();
        let mut a = Adam::new(input.clone(), AdamConfig::default()).unwrap();
        let mut b = Adam::new(input.clone(), AdamConfig::default()).unwrap();
        for s in 0..STEPS {
            let g = cut(&synthetic_grads(layout, s));
            let gt: Vec<Option<tch::Tensor>> = g.iter().cloned().map(to_tch).collect();
            step_tch(&mut a, &mut tch_slots, &gt).unwrap();
            b.step(&mut host_slots, &g).unwrap();
        }
        for (t, h) in tch_slots.iter().zip(&host_slots) {
            assert!(TchTensor::new(t.shallow_clone())
                .unwrap()
                .to_host()
                .unwrap()
                .bit_eq(h));
        }
        let local_tch = state_dict_to_tch(&a.state_dict()).unwrap();
        let full_tch = fsdp
            .full_optim_state_dict(&local_tch, &input, true)
            .unwrap();
        let full_host = fsdp
            .full_optim_state_dict(&b.state_dict(), &input, true)
            .unwrap();
        match (full_tch, full_host) {
            (Some(t), Some(h)) => {
                assert_identical(&t, &h, "trained on tch");
                true
            }
            (None, None) => false,
            _ => panic!("rank0_only disagreement"),
        }
    });
    assert_eq!(out, [true, false]);
    let _ = synthetic_params; // the VarStore's random values replace the synthetic ones here
}
