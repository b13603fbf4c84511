//! Unit tests: state-dict structure, load/step round trips, load validation.

use super::*;
use crate::error::Error;
use crate::optim_state::{ParamKey, ParamState};

fn names(n: usize) -> OptimParams {
    OptimParams::single((0..n).map(|i| OptimParam::Param(format!("p{i}"))).collect())
}

fn slots() -> Vec<HostTensor> {
    vec![
        HostTensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25, 3.0, -0.75], &[2, 3]).unwrap(),
        HostTensor::from_vec1(&[1.5f32, -2.5, 0.125]),
        HostTensor::from_vec1(&[0.1f64, 0.2]),
    ]
}

fn grads(step: usize) -> Vec<Option<HostTensor>> {
    slots()
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let vals: Vec<f64> = (0..p.numel())
                .map(|i| (0.37 * i as f64 + 1.3 * step as f64 + 0.11 * k as f64).sin())
                .collect();
            Some(match p.dtype() {
                DType::F64 => HostTensor::from_slice(&vals, p.shape()).unwrap(),
                _ => HostTensor::from_slice(
                    &vals.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                    p.shape(),
                )
                .unwrap(),
            })
        })
        .collect()
}

fn keys(o: &GroupOptions) -> Vec<&str> {
    o.keys().map(String::as_str).collect()
}

fn state_names(st: &ParamState) -> Vec<&str> {
    st.keys().map(String::as_str).collect()
}

fn tensor<'a>(sd: &'a OptimStateDict, id: usize, name: &str) -> &'a HostTensor {
    sd.state[&ParamKey::Id(id)][name].as_tensor().unwrap()
}

const ADAM_KEYS: [&str; 11] = [
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
];

#[test]
fn adam_state_dict_has_torch_structure() {
    let mut adam = Adam::new(names(3), AdamConfig::default()).unwrap();
    let mut p = slots();
    // Parameter 0 gets no gradient first: state is created in the order of first use.
    let mut g = grads(0);
    g[0] = None;
    adam.step(&mut p, &g).unwrap();
    adam.step(&mut p, &grads(1)).unwrap();
    let sd = adam.state_dict();
    assert_eq!(
        sd.state.keys().cloned().collect::<Vec<_>>(),
        [ParamKey::Id(1), ParamKey::Id(2), ParamKey::Id(0)]
    );
    assert_eq!(
        state_names(&sd.state[&ParamKey::Id(0)]),
        ["step", "exp_avg", "exp_avg_sq"]
    );
    let step = tensor(&sd, 1, "step");
    assert_eq!(
        (step.dtype(), step.dim(), step.item()),
        (DType::F32, 0, Some(2.0))
    );
    assert_eq!(tensor(&sd, 0, "step").item(), Some(1.0));
    assert_eq!(tensor(&sd, 0, "exp_avg").shape(), &[2, 3]);
    assert_eq!(tensor(&sd, 2, "exp_avg_sq").dtype(), DType::F64);

    let groups = sd.param_groups.as_ref().unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(keys(&groups[0].options), ADAM_KEYS);
    let o = &groups[0].options;
    assert_eq!(o["lr"], Value::Float(1e-3));
    assert_eq!(
        o["betas"],
        Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)])
    );
    assert_eq!(o["weight_decay"], Value::Int(0));
    assert_eq!(o["foreach"], Value::None);
    assert_eq!(o["fused"], Value::None);
    assert_eq!(o["decoupled_weight_decay"], Value::Bool(false));
    assert_eq!(
        groups[0].params,
        [ParamKey::Id(0), ParamKey::Id(1), ParamKey::Id(2)]
    );
}

#[test]
fn amsgrad_adds_max_exp_avg_sq_and_adamw_is_decoupled_adam() {
    let mut adam = Adam::new(
        names(3),
        AdamConfig {
            amsgrad: true,
            ..AdamConfig::default()
        },
    )
    .unwrap();
    let mut p = slots();
    adam.step(&mut p, &grads(0)).unwrap();
    assert_eq!(
        state_names(&adam.state_dict().state[&ParamKey::Id(0)]),
        ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    );

    let adamw = AdamW::new(names(1), AdamConfig::adamw()).unwrap();
    let o = adamw.group_options(0).unwrap();
    assert_eq!(keys(o), ADAM_KEYS);
    assert_eq!(o["weight_decay"], Value::Float(1e-2));
    assert_eq!(o["decoupled_weight_decay"], Value::Bool(true));
    // Decoupled regardless of the config passed.
    let adamw = AdamW::new(names(1), AdamConfig::default()).unwrap();
    assert_eq!(
        adamw.group_options(0).unwrap()["decoupled_weight_decay"],
        Value::Bool(true)
    );
}

#[test]
fn group_overrides_come_first_like_add_param_group() {
    let params = OptimParams {
        groups: vec![
            vec![OptimParam::Param("a".into())],
            vec![
                OptimParam::Param("b".into()),
                OptimParam::Flat("blk".into()),
            ],
        ],
        named: false,
    };
    let adam = Adam::new(params.clone(), AdamConfig::default())
        .unwrap()
        .with_group_options(
            1,
            [
                ("weight_decay", Value::Float(0.5)),
                ("lr", Value::Float(0.02)),
            ],
        )
        .unwrap();
    let sd = adam.state_dict();
    let g = sd.param_groups.as_ref().unwrap();
    assert_eq!(keys(&g[0].options), ADAM_KEYS);
    assert_eq!(&keys(&g[1].options)[..3], ["weight_decay", "lr", "betas"]);
    assert_eq!(g[1].params, [ParamKey::Id(1), ParamKey::Id(2)]);

    let sgd = Sgd::new(
        params,
        SgdConfig {
            momentum: 0.9.into(),
            ..SgdConfig::default()
        },
    )
    .unwrap()
    .with_group_config(0, |c| c.lr = 0.5)
    .unwrap();
    assert_eq!(
        keys(sgd.group_options(0).unwrap()),
        [
            "lr",
            "momentum",
            "dampening",
            "weight_decay",
            "nesterov",
            "maximize",
            "foreach",
            "differentiable",
            "fused"
        ]
    );
    assert_eq!(sgd.group_options(0).unwrap()["lr"], Value::Float(0.5));
    assert_eq!(sgd.group_options(1).unwrap()["momentum"], Value::Float(0.9));
    assert_eq!(sgd.group_options(1).unwrap()["dampening"], Value::Int(0));
}

#[test]
fn sgd_stores_momentum_buffer_only_with_momentum() {
    let mut plain = Sgd::new(
        names(3),
        SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        },
    )
    .unwrap();
    let mut p = slots();
    plain.step(&mut p, &grads(0)).unwrap();
    assert!(plain.state_dict().state.is_empty());
    // p -= lr * g, fused as torch does.
    let g = grads(0)[1].clone().unwrap();
    let want: Vec<f32> = slots()[1]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .zip(g.as_slice::<f32>().unwrap())
        .map(|(&p, &g)| g.mul_add(-0.1f64 as f32, p))
        .collect();
    assert_eq!(p[1].as_slice::<f32>().unwrap(), &want[..]);

    let mut sgd = Sgd::new(
        names(3),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9.into(),
            ..SgdConfig::default()
        },
    )
    .unwrap();
    let mut p = slots();
    sgd.step(&mut p, &grads(0)).unwrap();
    let sd = sgd.state_dict();
    assert_eq!(
        state_names(&sd.state[&ParamKey::Id(0)]),
        ["momentum_buffer"]
    );
    // First buffer is the gradient itself.
    assert!(tensor(&sd, 1, "momentum_buffer").bit_eq(grads(0)[1].as_ref().unwrap()));
}

/// Steps `a` twice, loads its dict into `b`, steps both once more: identical results.
fn round_trip(mut a: Box<dyn Optimizer>, mut b: Box<dyn Optimizer>) {
    let mut pa = slots();
    a.step(&mut pa, &grads(0)).unwrap();
    a.step(&mut pa, &grads(1)).unwrap();
    let sd = a.state_dict();
    b.load_state_dict(&sd).unwrap();
    assert_eq!(b.state_dict(), sd);
    let mut pb = pa.clone();
    a.step(&mut pa, &grads(2)).unwrap();
    b.step(&mut pb, &grads(2)).unwrap();
    assert_eq!(pa, pb);
    assert_eq!(a.state_dict(), b.state_dict());
    // The dict taken earlier is a snapshot, not aliased to the live state.
    assert_ne!(a.state_dict(), sd);
}

#[test]
fn load_then_step_matches_uninterrupted_training() {
    let cfg = AdamConfig {
        lr: 0.01,
        weight_decay: 0.1.into(),
        amsgrad: true,
        ..AdamConfig::default()
    };
    round_trip(
        Box::new(Adam::new(names(3), cfg.clone()).unwrap()),
        Box::new(Adam::new(names(3), AdamConfig::default()).unwrap()),
    );
    round_trip(
        Box::new(AdamW::new(names(3), AdamConfig::adamw()).unwrap()),
        Box::new(AdamW::new(names(3), AdamConfig::adamw()).unwrap()),
    );
    let sgd = SgdConfig {
        lr: 0.1,
        momentum: 0.9.into(),
        nesterov: true,
        weight_decay: 0.01.into(),
        ..SgdConfig::default()
    };
    round_trip(
        Box::new(Sgd::new(names(3), sgd).unwrap()),
        Box::new(Sgd::new(names(3), SgdConfig::default()).unwrap()),
    );
}

fn trained_adam() -> (Adam, OptimStateDict) {
    let mut adam = Adam::new(names(3), AdamConfig::default()).unwrap();
    let mut p = slots();
    adam.step(&mut p, &grads(0)).unwrap();
    let sd = adam.state_dict();
    (adam, sd)
}

#[test]
fn load_rejects_a_different_number_of_groups() {
    let (_, mut sd) = trained_adam();
    let g = sd.param_groups.as_mut().unwrap();
    g.push(g[0].clone());
    let mut fresh = Adam::new(names(3), AdamConfig::default()).unwrap();
    let err = fresh.load_state_dict(&sd).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::ParamGroupsMismatch {
                group: None,
                expected: 1,
                found: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        fresh.state_dict().state.is_empty(),
        "nothing changes on error"
    );

    let (_, mut sd) = trained_adam();
    sd.param_groups.as_mut().unwrap()[0].params.pop();
    let err = fresh.load_state_dict(&sd).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::ParamGroupsMismatch {
                group: Some(0),
                expected: 3,
                found: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn load_rejects_missing_state_names() {
    let (_, mut sd) = trained_adam();
    sd.state
        .get_mut(&ParamKey::Id(1))
        .unwrap()
        .shift_remove("exp_avg_sq");
    let mut fresh = Adam::new(names(3), AdamConfig::default()).unwrap();
    let err = fresh.load_state_dict(&sd).unwrap_err();
    assert!(
        matches!(&err, Error::MissingState { param, state, .. } if param == "parameter id 1" && state == "exp_avg_sq"),
        "{err}"
    );

    // amsgrad in the loaded group requires max_exp_avg_sq.
    let (_, mut sd) = trained_adam();
    sd.param_groups.as_mut().unwrap()[0]
        .options
        .insert("amsgrad".into(), Value::Bool(true));
    let err = fresh.load_state_dict(&sd).unwrap_err();
    assert!(
        matches!(&err, Error::MissingState { state, .. } if state == "max_exp_avg_sq"),
        "{err}"
    );

    let (_, mut sd) = trained_adam();
    sd.param_groups.as_mut().unwrap()[0]
        .options
        .shift_remove("lr");
    let err = fresh.load_state_dict(&sd).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidParamGroups { group: Some(0), reason, .. } if reason == "has no `lr`"),
        "{err}"
    );
}

#[test]
fn load_rejects_wrong_shapes_eagerly_with_bound_slots_else_at_step() {
    let (_, mut sd) = trained_adam();
    let bad = Value::Tensor(HostTensor::from_vec1(&[0.0f32; 5]));
    sd.state
        .get_mut(&ParamKey::Id(0))
        .unwrap()
        .insert("exp_avg".into(), bad);

    let mut bound = Adam::new(names(3), AdamConfig::default()).unwrap();
    bound.bind_slots(&slots()).unwrap();
    let err = bound.load_state_dict(&sd).unwrap_err();
    match &err {
        Error::ShapeMismatch {
            context,
            expected,
            found,
        } => {
            assert!(
                context.contains("`exp_avg`") && context.contains("parameter id 0"),
                "{err}"
            );
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[2, 3][..], &[5][..])
            );
        }
        other => panic!("unexpected {other:?}"),
    }

    let mut unbound = Adam::new(names(3), AdamConfig::default()).unwrap();
    unbound.load_state_dict(&sd).unwrap();
    let mut p = slots();
    let err = unbound.step(&mut p, &grads(1)).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { context, .. } if context.contains("`exp_avg`")),
        "{err}"
    );
    assert_eq!(p, slots(), "a failed step changes nothing");
}

#[test]
fn step_validates_inputs() {
    let mut adam = Adam::new(names(3), AdamConfig::default()).unwrap();
    let mut p = slots();
    let mut g = grads(0);
    g[1] = Some(HostTensor::from_vec1(&[1.0f32]));
    let err = adam.step(&mut p, &g).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { context, .. } if context.contains("parameter id 1") && context.contains("`p1`")),
        "{err}"
    );
    let mut g = grads(0);
    g[2] = Some(HostTensor::from_vec1(&[1.0f32, 2.0]));
    assert!(matches!(
        adam.step(&mut p, &g),
        Err(Error::DtypeMismatch { .. })
    ));
    assert!(matches!(
        adam.step(&mut p[..2], &grads(0)[..2]),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(adam.state_dict().state.is_empty());
}

#[test]
fn load_accepts_views_and_casts_like_torch() {
    let (mut trained, sd) = trained_adam();
    // Rebuild the dict with every positive-dim tensor a view into one shared f64 buffer.
    let mut parts = Vec::new();
    for st in sd.state.values() {
        for v in st.values() {
            if let Value::Tensor(t) = v {
                if t.dim() > 0 {
                    parts.push(crate::optim::core::cast_tensor(t, DType::F64));
                }
            }
        }
    }
    let flat = HostTensor::cat_flat(&parts).unwrap();
    let mut viewed = sd.clone();
    let mut at = 0;
    for st in viewed.state.values_mut() {
        for v in st.values_mut() {
            if let Value::Tensor(t) = v {
                if t.dim() > 0 {
                    let view = flat
                        .narrow_flat(at, t.numel())
                        .unwrap()
                        .reshape(t.shape())
                        .unwrap();
                    at += t.numel();
                    *t = view;
                }
            }
        }
    }
    // `step` as a plain number (older checkpoints) becomes a float32 0-dim tensor.
    viewed
        .state
        .get_mut(&ParamKey::Id(2))
        .unwrap()
        .insert("step".into(), Value::Float(1.0));

    let mut fresh = Adam::new(names(3), AdamConfig::default()).unwrap();
    fresh.bind_slots(&slots()).unwrap();
    fresh.load_state_dict(&viewed).unwrap();
    let loaded = fresh.state_dict();
    assert_eq!(
        tensor(&loaded, 0, "exp_avg").dtype(),
        DType::F32,
        "cast to the slot dtype"
    );
    assert_eq!(tensor(&loaded, 2, "exp_avg").dtype(), DType::F64);
    assert_eq!(tensor(&loaded, 2, "step").dtype(), DType::F32);
    assert_eq!(loaded, sd, "f32 -> f64 -> f32 is exact");

    let mut pa = slots();
    let mut pb = slots();
    trained.step(&mut pa, &grads(1)).unwrap();
    fresh.step(&mut pb, &grads(1)).unwrap();
    assert_eq!(pa, pb);
}

#[test]
fn named_state_dict_uses_fqns_and_loads_back() {
    let params = OptimParams {
        groups: vec![vec![
            OptimParam::Flat("block".into()),
            OptimParam::Flat(String::new()),
            OptimParam::Param("head.w".into()),
        ]],
        named: true,
    };
    let mut named = Adam::new(params.clone(), AdamConfig::default()).unwrap();
    let mut p = slots();
    named.step(&mut p, &grads(0)).unwrap();
    let sd = named.state_dict();
    let want = ["block._flat_param", "_flat_param", "head.w"].map(ParamKey::from);
    assert_eq!(sd.state.keys().cloned().collect::<Vec<_>>(), want);
    let mut sorted = want.to_vec();
    sorted.sort();
    assert_eq!(sd.param_groups.as_ref().unwrap()[0].params, sorted);

    // Names map back by FQN, not by position, into a plain (id-keyed) optimizer.
    let mut plain = Adam::new(
        OptimParams {
            named: false,
            ..params
        },
        AdamConfig::default(),
    )
    .unwrap();
    plain.load_state_dict(&sd).unwrap();
    let by_id = plain.state_dict();
    assert!(tensor(&by_id, 0, "exp_avg").bit_eq(
        sd.state[&ParamKey::from("block._flat_param")]["exp_avg"]
            .as_tensor()
            .unwrap()
    ));
    assert!(tensor(&by_id, 2, "exp_avg").bit_eq(
        sd.state[&ParamKey::from("head.w")]["exp_avg"]
            .as_tensor()
            .unwrap()
    ));

    let mut bad = sd.clone();
    bad.param_groups.as_mut().unwrap()[0].params[0] = ParamKey::from("nope");
    let err = plain.load_state_dict(&bad).unwrap_err();
    assert!(
        matches!(&err, Error::UnknownParameter { name, .. } if name == "nope"),
        "{err}"
    );
}

#[test]
fn loading_fills_torch_setstate_defaults_and_keeps_user_state() {
    let (_, mut sd) = trained_adam();
    let o = &mut sd.param_groups.as_mut().unwrap()[0].options;
    o.shift_remove("fused");
    o.shift_remove("decoupled_weight_decay");
    o.shift_remove("amsgrad");
    o.insert("initial_lr".into(), Value::Float(0.5));
    sd.state.insert(
        ParamKey::from("user"),
        [("count".to_string(), Value::Int(3))].into_iter().collect(),
    );

    let mut adam = Adam::new(names(3), AdamConfig::default()).unwrap();
    adam.load_state_dict(&sd).unwrap();
    let loaded = adam.state_dict();
    let k = keys(&loaded.param_groups.as_ref().unwrap()[0].options);
    assert_eq!(
        k,
        [
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "maximize",
            "foreach",
            "capturable",
            "differentiable",
            "initial_lr",
            "amsgrad",
            "decoupled_weight_decay",
            "fused"
        ]
    );
    assert_eq!(
        loaded.state[&ParamKey::from("user")]["count"],
        Value::Int(3)
    );

    // AdamW forces decoupled weight decay on load (AdamW.__setstate__).
    let mut adamw = AdamW::new(names(3), AdamConfig::adamw()).unwrap();
    adamw.load_state_dict(&sd).unwrap();
    assert_eq!(
        adamw.group_options(0).unwrap()["decoupled_weight_decay"],
        Value::Bool(true)
    );

    // SGD's setdefault of `fused` is False (the constructor's default is None).
    let mut sgd = Sgd::new(names(3), SgdConfig::default()).unwrap();
    let mut sd = sgd.state_dict();
    sd.param_groups.as_mut().unwrap()[0]
        .options
        .shift_remove("fused");
    sgd.load_state_dict(&sd).unwrap();
    assert_eq!(sgd.group_options(0).unwrap()["fused"], Value::Bool(false));
}

#[test]
fn zero_element_slots_behave_like_torch() {
    let mut adam = Adam::new(names(2), AdamConfig::default()).unwrap();
    let mut p = vec![
        HostTensor::zeros(DType::F32, &[0]),
        HostTensor::zeros(DType::F32, &[0]),
    ];
    // FSDP gives an empty shard no gradient: no state. With a gradient, torch creates state.
    adam.step(&mut p, &[None, Some(HostTensor::zeros(DType::F32, &[0]))])
        .unwrap();
    let sd = adam.state_dict();
    assert_eq!(
        sd.state.keys().cloned().collect::<Vec<_>>(),
        [ParamKey::Id(1)]
    );
    assert_eq!(tensor(&sd, 1, "exp_avg").shape(), &[0]);
    assert_eq!(tensor(&sd, 1, "step").item(), Some(1.0));
}

#[test]
fn constructor_checks_mirror_torch() {
    let bad = SgdConfig {
        nesterov: true,
        ..SgdConfig::default()
    };
    let err = Sgd::new(names(1), bad).unwrap_err();
    assert!(
        err.to_string()
            .contains("Nesterov momentum requires a momentum and zero dampening"),
        "{err}"
    );
    let err = Adam::new(
        names(1),
        AdamConfig {
            betas: (1.0, 0.9),
            ..AdamConfig::default()
        },
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("Invalid beta parameter at index 0"),
        "{err}"
    );
    let dup = OptimParams::single(vec![
        OptimParam::Param("a".into()),
        OptimParam::Param("a".into()),
    ]);
    assert!(Adam::new(dup, AdamConfig::default()).is_err());
    let mut adam = Adam::new(names(1), AdamConfig::default()).unwrap();
    assert!(adam
        .set_group_option(0, "lr", Value::Str("fast".into()))
        .is_err());
    adam.set_group_option(0, "lr", Value::Float(0.1)).unwrap();
    assert_eq!(
        keys(adam.group_options(0).unwrap()),
        ADAM_KEYS,
        "an existing key keeps its position"
    );
    assert!(adam.set_group_option(3, "lr", Value::Float(0.1)).is_err());
}

#[test]
fn param_fqn_names_flat_parameters() {
    assert_eq!(param_fqn(&OptimParam::Flat(String::new())), "_flat_param");
    assert_eq!(
        param_fqn(&OptimParam::Flat("layer1.0".into())),
        "layer1.0._flat_param"
    );
    assert_eq!(
        param_fqn(&OptimParam::Param("fc.weight".into())),
        "fc.weight"
    );
}
