//! `optim_state_dict_to_load` of a `SHARDED_STATE_DICT` receives each rank's flat shard
//! directly from the ranks holding the row chunks (`scatter::load_sharded`); it must give
//! exactly what gathering whole tensors and flattening gives, and what the optimizer held.

use fsdp::collectives::ThreadGroup;
use fsdp::optim_state::flatten_optim_state_dict;
use fsdp::optim_state::gather_sharded;
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, StateDictType, Value,
    WrapPolicy,
};
use std::sync::Arc;

/// Odd shapes: uneven row chunks, members with fewer rows than ranks, padded shards, a unit
/// whose members share no rank, and an unmanaged parameter.
fn model() -> (ModelDesc, WrapPolicy) {
    let m = ModelDesc::new()
        .param("a.w", &[5, 3], DType::F32)
        .param("a.b", &[7], DType::F32)
        .param("a.c", &[1, 4], DType::F32)
        .param("b.w", &[2, 2, 3], DType::F32)
        .param("b.b", &[1], DType::F32)
        .param("c.w", &[11], DType::F64)
        .param("head", &[3], DType::F32);
    (m, WrapPolicy::units(&["a", "b", "c"]))
}

fn full_state(model: &ModelDesc) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let mut st = ParamState::new();
        for (s, name) in ["exp_avg", "exp_avg_sq"].iter().enumerate() {
            let n: usize = p.shape.iter().product();
            let vals: Vec<f64> = (0..n)
                .map(|k| (i * 100 + s * 1000 + k) as f64 + 0.25)
                .collect();
            let t = match p.dtype {
                DType::F64 => HostTensor::from_slice(&vals, &p.shape).unwrap(),
                _ => {
                    let v: Vec<f32> = vals.iter().map(|&x| x as f32).collect();
                    HostTensor::from_slice(&v, &p.shape).unwrap()
                }
            };
            st.insert((*name).into(), Value::Tensor(t));
        }
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    sd
}

fn same(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
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
            "{what}: state names of {k}"
        );
        for (n, va) in sa {
            match (va, &sb[n.as_str()]) {
                (Value::Tensor(x), Value::Tensor(y)) => {
                    assert!(x.bit_eq(y), "{what}: `{n}` of {k}:\n{x:?}\n{y:?}")
                }
                (x, y) => assert_eq!(x, y, "{what}: `{n}` of {k}"),
            }
        }
    }
    assert_eq!(a.param_groups, b.param_groups, "{what}: param groups");
}

fn check(ws: usize, skip: Option<&'static str>) {
    let (model, policy) = model();
    let full = Arc::new(full_state(&model));
    ThreadGroup::run(ws, |pg| {
        let pg = Arc::new(pg);
        let mut fsdp = Fsdp::new(&model, &policy, pg.clone()).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.set_state_dict_type(StateDictType::Sharded, None)
            .unwrap();
        let mut sharded = fsdp.optim_state_dict(&local, &params).unwrap().unwrap();
        if let Some(name) = skip {
            // One member has no state (and no member a scalar one): flattening fills zeros.
            sharded.state.shift_remove(&ParamKey::Name(name.into()));
            for st in sharded.state.values_mut() {
                st.shift_remove("step");
            }
        }
        let loaded = fsdp
            .optim_state_dict_to_load(Some(&sharded), &params)
            .unwrap();
        let what = format!("ws {ws}, rank {}, without {skip:?}", fsdp.rank());
        if skip.is_none() {
            same(&loaded, &local, &what);
        }
        let whole = gather_sharded(fsdp.layout(), pg.as_ref(), &sharded).unwrap();
        let reference =
            flatten_optim_state_dict(fsdp.layout(), fsdp.rank(), &whole, &params).unwrap();
        same(&loaded, &reference, &what);
        let again = fsdp
            .flatten_sharded_optim_state_dict(&sharded, &params)
            .unwrap();
        same(&again, &reference, &what);
    });
}

#[test]
fn sharded_load_equals_gather_then_flatten() {
    for ws in 1..=5 {
        check(ws, None);
    }
}

#[test]
fn sharded_load_with_a_member_without_state() {
    for ws in [2, 3, 4] {
        check(ws, Some("a.b"));
        check(ws, Some("b.w"));
    }
}
