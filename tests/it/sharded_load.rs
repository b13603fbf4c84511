//! `optim_state_dict_to_load` of a `SHARDED_STATE_DICT` receives each rank's flat shard
//! directly from the ranks holding the row chunks (`scatter::load_sharded`); it must give
//! exactly what gathering whole tensors and flattening gives, and what the optimizer held.

use fsdp::collectives::{ProcessGroup, ThreadGroup, ThreadProcessGroup};
use fsdp::optim_state::flatten_optim_state_dict;
use fsdp::optim_state::gather_sharded;
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, StateDictType, Value,
    WrapPolicy,
};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// Forwards to a thread rank and counts its `scatter_into` calls.
struct CountingScatters {
    inner: ThreadProcessGroup,
    scatters: AtomicUsize,
}

impl ProcessGroup for CountingScatters {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> fsdp::Result<()> {
        self.inner.all_gather_into(send, recv)
    }
    fn broadcast(&self, buf: &mut [u8], root: usize) -> fsdp::Result<()> {
        self.inner.broadcast(buf, root)
    }
    fn all_gather_bytes(&self, send: &[u8]) -> fsdp::Result<Vec<Vec<u8>>> {
        self.inner.all_gather_bytes(send)
    }
    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> fsdp::Result<Vec<u8>> {
        self.inner.broadcast_bytes(send, root)
    }
    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> fsdp::Result<()> {
        self.inner.gather_into(send, recv, root)
    }
    fn scatter_into(
        &self,
        send: Option<&[&[u8]]>,
        recv: &mut [u8],
        root: usize,
    ) -> fsdp::Result<()> {
        self.scatters.fetch_add(1, Ordering::Relaxed);
        self.inner.scatter_into(send, recv, root)
    }
    fn barrier(&self) -> fsdp::Result<()> {
        self.inner.barrier()
    }
    fn new_subgroup(&self, ranks: &[usize]) -> fsdp::Result<Option<Arc<dyn ProcessGroup>>> {
        self.inner.new_subgroup(ranks)
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}

/// Loads the SHARDED dict of one unit `a` at world size 2 and returns how many `scatter_into`
/// calls each rank made, checking that the result is what the optimizer held.
fn scatters_of_sharded_load(model: ModelDesc) -> Vec<usize> {
    let policy = WrapPolicy::units(&["a"]);
    let full = Arc::new(full_state(&model));
    ThreadGroup::run(2, |pg| {
        let pg = Arc::new(CountingScatters {
            inner: pg,
            scatters: AtomicUsize::new(0),
        });
        let mut fsdp = Fsdp::new(&model, &policy, pg.clone()).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.set_state_dict_type(StateDictType::Sharded, None)
            .unwrap();
        let sharded = fsdp.optim_state_dict(&local, &params).unwrap().unwrap();
        pg.scatters.store(0, Ordering::Relaxed);
        let loaded = fsdp
            .optim_state_dict_to_load(Some(&sharded), &params)
            .unwrap();
        same(&loaded, &local, &format!("rank {}", fsdp.rank()));
        pg.scatters.load(Ordering::Relaxed)
    })
}

#[test]
fn sharded_load_copies_own_row_chunks_locally_and_moves_the_rest_in_one_scatter_per_holder() {
    // [4, 3] at 2 ranks: each flat shard is exactly its rank's 2-row chunk, so nothing moves
    // between ranks and no rank joins a scatter.
    let aligned = ModelDesc::new().param("a.w", &[4, 3], DType::F32);
    assert_eq!(scatters_of_sharded_load(aligned), vec![0, 0]);
    // [4, 3] + [2]: the shards split at element 7 (inside row 2 of `w`), so per tensor state
    // rank 1's chunk of `w` (1 element goes to rank 0) and rank 0's chunk of `b` (rank 1 holds
    // all of `b`) cross ranks; the other two chunks stay with their holders and are copied
    // locally. Both states' pieces travel together: one scatter from each holding rank.
    let straddling =
        ModelDesc::new()
            .param("a.w", &[4, 3], DType::F32)
            .param("a.b", &[2], DType::F32);
    assert_eq!(scatters_of_sharded_load(straddling), vec![2, 2]);
    // Eight such units' worth of members in one unit: still one scatter per holding rank.
    let mut many = ModelDesc::new();
    for i in 0..8 {
        many = many.param(&format!("a.w{i}"), &[4, 3], DType::F32).param(
            &format!("a.b{i}"),
            &[3],
            DType::F32,
        );
    }
    assert_eq!(scatters_of_sharded_load(many), vec![2, 2]);
}
