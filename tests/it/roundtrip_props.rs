//! Property tests: for random parameter shapes, wrappings, world sizes 1–9 and both
//! `use_orig_params` modes, the layout invariants hold and shard → consolidate is the identity.

use crate::common;

use fsdp::collectives::ThreadGroup;
use fsdp::flat_param::ModelLayout;
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, Value, WrapPolicy,
};
use proptest::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Case {
    shapes: Vec<(usize, Vec<usize>)>, // (module, shape)
    units: Vec<usize>,
    root_unit: bool,
    world_size: usize,
    orig: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let shape = prop_oneof![
        Just(vec![]),
        (1usize..7).prop_map(|a| vec![a]),
        (1usize..5, 1usize..5).prop_map(|(a, b)| vec![a, b]),
        (1usize..3, 1usize..3, 1usize..4).prop_map(|(a, b, c)| vec![a, b, c]),
    ];
    (
        prop::collection::vec((0usize..4, shape), 1..7),
        prop::collection::btree_set(0usize..4, 0..4),
        any::<bool>(),
        1usize..10,
        any::<bool>(),
    )
        .prop_map(|(shapes, units, root_unit, world_size, orig)| Case {
            shapes,
            units: units.into_iter().collect(),
            root_unit,
            world_size,
            orig,
        })
}

fn build(c: &Case) -> (ModelDesc, WrapPolicy) {
    let mut m = ModelDesc::new();
    for (i, (module, shape)) in c.shapes.iter().enumerate() {
        // A flat parameter cannot round-trip 0-dim members in PyTorch either: their
        // `exp_avg` is 0-dim and so indistinguishable from scalar state such as `step`.
        let shape = if shape.is_empty() && !c.orig {
            vec![1]
        } else {
            shape.clone()
        };
        m = m.param(&format!("m{module}.p{i}"), &shape, DType::F32);
    }
    let present: Vec<usize> = c
        .units
        .iter()
        .copied()
        .filter(|u| c.shapes.iter().any(|(m, _)| m == u))
        .collect();
    let mut units: Vec<String> = present.iter().map(|u| format!("m{u}")).collect();
    if c.root_unit {
        units.push(String::new());
    }
    (m, WrapPolicy::units(&units).with_orig_params(c.orig))
}

fn full_state(model: &ModelDesc) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let vals: Vec<f32> = (0..p.numel()).map(|k| (i * 100 + k) as f32 + 0.5).collect();
        let mut st = ParamState::new();
        st.insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::from_slice(&vals, &p.shape).unwrap()),
        );
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    sd.param_groups = None;
    sd
}

fn check_layout(layout: &ModelLayout) {
    let ws = layout.world_size();
    for f in layout.flat_params() {
        assert_eq!(
            f.numels_with_padding.iter().sum::<usize>(),
            f.unpadded_numel
        );
        assert_eq!(f.numels_with_padding.len(), f.is_padding_mask.len());
        assert_eq!(
            f.is_padding_mask.iter().filter(|p| !**p).count(),
            f.members.len()
        );
        if layout.use_orig_params() {
            let a = fsdp::flat_param::aligned_numel(f.dtype);
            for m in &f.members {
                assert_eq!(m.offset % a, 0, "member `{}` not aligned", m.fqn);
            }
            assert_eq!(
                f.unpadded_numel % ws,
                0,
                "orig-params flat parameter is padded to the world size"
            );
        } else {
            assert!(
                f.is_padding_mask.iter().all(|p| !p),
                "no padding without use_orig_params"
            );
        }
        // Shards tile [0, N) in rank order; every member's elements are covered once.
        let mut next = 0;
        let mut covered = vec![0usize; f.members.len()];
        for r in 0..ws {
            let s = f.shard(r);
            assert_eq!(s.padded_numel(), f.shard_numel());
            if f.sharded {
                assert_eq!(s.start, next.min(f.unpadded_numel));
            }
            next = s.start + s.numel;
            for (i, info) in s.params.iter().enumerate() {
                if info.in_shard {
                    assert!(info.offset_in_shard + info.numel_in_shard <= s.numel);
                    assert_eq!(
                        info.intra_param_end_idx + 1 - info.intra_param_start_idx,
                        info.numel_in_shard
                    );
                }
                covered[i] += info.numel_in_shard;
            }
            if !f.sharded {
                break;
            }
        }
        assert_eq!(next, f.unpadded_numel);
        for (m, c) in f.members.iter().zip(covered) {
            assert_eq!(
                c, m.numel,
                "member `{}` covered {c} times its elements",
                m.fqn
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    #[test]
    fn shard_then_consolidate_is_identity(c in case()) {
        let (model, policy) = build(&c);
        let layout = ModelLayout::new(&model, &policy, c.world_size).unwrap();
        check_layout(&layout);
        let full = full_state(&model);
        let results = ThreadGroup::run(c.world_size, |pg| {
            let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
            let params = fsdp.optim_params();
            let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
            fsdp.full_optim_state_dict(&local, &params, false).unwrap().unwrap()
        });
        for (rank, back) in results.iter().enumerate() {
            common::assert_same_state(back, &full, &format!("rank {rank} of {c:?}"));
        }
    }
}
