//! One rank of a multi-process scenario (the test executable with `FSDP_MPI_WORKER` set).
//!
//! Each scenario runs on `MpiProcessGroup::world()`, checks its results (panicking on a
//! difference, which fails the job), prints its `ok` line and drops its handles, which
//! finalizes MPI.

use crate::common::conformance::{self, Reductions};
use crate::common::*;
use crate::{ok_line, DIR_ENV};
use fsdp::checkpoint::{LoadOptions, SaveOptions};
use fsdp::collectives::{
    encode, MpiProcessGroup, ProcessGroup, ProcessGroupExt, ReduceOp, ThreadGroup,
};
use fsdp::flat_param::ModelLayout;
use fsdp::optim::Optimizer;
use fsdp::{
    DType, Error, Fsdp, ModelDesc, OptimParams, OptimStateDict, OptimStateDictConfig,
    OptimStateKeyType, StateDictType, Value, WrapPolicy,
};
use std::sync::Arc;

const STEPS: usize = 3;

/// Runs `scenario` as this process's rank; returns the exit code.
pub fn main(scenario: &str) -> i32 {
    // A failed check ends this process at once, without MPI_Finalize (which would wait for
    // peers blocked in a collective): mpirun then ends the whole job.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        std::process::exit(101);
    }));
    let world = match MpiProcessGroup::world() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("fsdp-mpi-worker {scenario}: MpiProcessGroup::world() failed: {e}");
            return 2;
        }
    };
    let (rank, ws) = (world.rank(), world.world_size());
    let world = Arc::new(world);
    match scenario {
        "collectives" => collectives(&world),
        "fsdp2" => crate::common::fsdp2::run(world.as_ref(), "mpi"),
        "errors" => errors(&world),
        "matrix" => matrix(&world),
        "ckpt_save" => ckpt_save(&world),
        "ckpt_load" => ckpt_load(&world),
        "singleton" => singleton(&world),
        "selftest_fail" => {
            if rank == 1 {
                eprintln!("selftest_fail: rank 1 fails on purpose");
                // As a crashed rank: no MPI_Finalize.
                std::process::exit(3);
            }
            world.barrier().unwrap();
        }
        "selftest_hang" => {
            if rank == 0 {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
            world.barrier().unwrap();
        }
        other => {
            eprintln!("unknown scenario `{other}`");
            return 2;
        }
    }
    println!("{}", ok_line(scenario, rank, ws));
    drop(world);
    if scenario == "singleton" {
        // The last handle is gone: MPI is finalized and cannot come back.
        match MpiProcessGroup::world() {
            Err(Error::BackendUnavailable { backend, reason })
                if backend == "mpi" && reason.contains("already finalized") =>
            {
                println!("{}", ok_line("after_finalize", rank, ws));
            }
            other => {
                eprintln!("world() after finalization gave {other:?}");
                return 1;
            }
        }
    }
    0
}

// ----- collectives -----

/// The conformance suite without its argument errors (run once per scenario, on the default
/// limit): what a message limit can change.
fn exercise(pg: &dyn ProcessGroup, what: &str) {
    conformance::data_movement(pg, what);
    conformance::reductions_of_every_dtype(pg, Reductions::RankOrder, what);
    conformance::objects_and_agreement(pg, what);
    conformance::subgroups(pg, what);
}

fn collectives(world: &Arc<MpiProcessGroup>) {
    assert_eq!(world.backend(), "mpi");
    conformance::run(world.as_ref(), Reductions::RankOrder, "default limit");
    // A tiny message limit sends everything above in several messages (chunked paths).
    let small = MpiProcessGroup::world()
        .unwrap()
        .with_max_message_bytes(7)
        .unwrap();
    assert_eq!(
        (small.rank(), small.world_size()),
        (world.rank(), world.world_size())
    );
    exercise(&small, "7-byte messages");
    let odd = MpiProcessGroup::world()
        .unwrap()
        .with_max_message_bytes(1000)
        .unwrap();
    exercise(&odd, "1000-byte messages");
    assert!(MpiProcessGroup::world()
        .unwrap()
        .with_max_message_bytes(0)
        .is_err());
}

// ----- errors -----

fn expect_err<T: std::fmt::Debug>(r: fsdp::Result<T>, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => e,
    }
}

fn errors(world: &Arc<MpiProcessGroup>) {
    let (rank, ws) = (world.rank(), world.world_size());
    let all: Vec<usize> = (0..ws).collect();
    // One fresh communicator per case: a failure poisons its communicator.
    let fresh = || world.new_subgroup(&all).unwrap().expect("member");

    // Different lengths in all_gather_into.
    let g = fresh();
    let send = vec![1u8; if rank == 1 { 2 } else { 1 }];
    let mut recv = vec![0u8; send.len() * ws];
    let e = expect_err(g.all_gather_into(&send, &mut recv), "all_gather_into");
    assert!(
        matches!(&e, Error::CollectiveMismatch { rank: r, detail } if *r == rank
            && detail.contains("rank 1 called all_gather_into(2 bytes) while rank 0 called all_gather_into(1 bytes)")),
        "rank {rank}: {e}"
    );
    let e = expect_err(g.barrier(), "after a mismatch");
    assert!(
        matches!(&e, Error::CollectiveMismatch { detail, .. } if detail.contains("barrier refused: the group failed earlier")),
        "rank {rank}: {e}"
    );

    // A receive length that differs from the root's part.
    let g = fresh();
    let parts: Vec<Vec<u8>> = (0..ws).map(|_| vec![9u8; 4]).collect();
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let mut recv = vec![0u8; if rank == 1 { 3 } else { 4 }];
    let e = expect_err(
        g.scatter_into((rank == 0).then_some(&refs[..]), &mut recv, 0),
        "scatter_into",
    );
    assert!(
        matches!(&e, Error::CollectiveMismatch { detail, .. }
            if detail.contains("scatter_into(root=0): rank 1 receives 3 bytes but root 0 sends it 4")),
        "rank {rank}: {e}"
    );

    // Invalid arguments on one rank fail every rank with that rank's reason.
    let g = fresh();
    let bad = ws - 1;
    let root = if rank == bad { ws } else { 0 };
    let e = expect_err(g.broadcast(&mut [0u8; 4], root), "invalid root");
    assert!(
        matches!(&e, Error::InvalidCollective { op, reason, .. } if op == "broadcast"
            && reason.contains(&format!("rank {bad} passed invalid arguments to broadcast: root {ws} is out of range for world size {ws}"))),
        "rank {rank}: {e}"
    );

    // A reduce-scatter whose send length is wrong on the last rank.
    let g = fresh();
    let send = vec![0u8; if rank == bad { 4 * ws + 4 } else { 4 * ws }];
    let e = expect_err(
        g.reduce_scatter_into(&send, &mut [0u8; 4], DType::F32, ReduceOp::Sum),
        "reduce_scatter_into",
    );
    assert!(
        matches!(&e, Error::InvalidCollective { op, reason, .. } if op == "reduce_scatter_into"
            && reason.contains(&format!("rank {bad} passed invalid arguments to reduce_scatter_into: send has"))),
        "rank {rank}: {e}"
    );

    // An all-reduce of a partial element on one rank, then of differing dtypes.
    let g = fresh();
    let mut buf = vec![0u8; if rank == bad { 5 } else { 8 }];
    let e = expect_err(
        g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum),
        "all_reduce",
    );
    assert!(
        matches!(&e, Error::InvalidCollective { op, reason, .. } if op == "all_reduce"
            && reason.contains(&format!("rank {bad} passed invalid arguments to all_reduce: 5 bytes is not a whole number of"))),
        "rank {rank}: {e}"
    );
    let g = fresh();
    let dtype = if rank == bad { DType::I32 } else { DType::F32 };
    let e = expect_err(
        g.all_reduce(&mut [0u8; 8], dtype, ReduceOp::Sum),
        "all_reduce",
    );
    assert!(
        matches!(&e, Error::CollectiveMismatch { detail, .. } if detail.contains(&format!("rank {bad} called all_reduce(sum over"))),
        "rank {rank}: {e}"
    );

    // Different collectives.
    let g = fresh();
    let r = if rank == 0 {
        g.barrier()
    } else {
        g.broadcast(&mut [0u8; 4], 0)
    };
    let e = expect_err(r, "barrier vs broadcast");
    assert!(
        matches!(&e, Error::CollectiveMismatch { detail, .. }
            if detail.contains("rank 1 called broadcast(root=0, 4 bytes) while rank 0 called barrier")),
        "rank {rank}: {e}"
    );

    // A root without an object.
    let g = fresh();
    let e = expect_err(g.broadcast_object::<u32>(None, 0), "broadcast_object");
    assert!(
        matches!(&e, Error::InvalidCollective { reason, .. } if reason.contains("root")),
        "rank {rank}: {e}"
    );

    // The façade: one rank wraps the model differently; every rank gets the same plan error.
    let g = fresh();
    let model = nested_model();
    let policy = if rank == ws - 1 {
        wrap_alt()
    } else {
        wrap(false)
    };
    let fsdp = Fsdp::new(&model, &policy, g).unwrap();
    let input = fsdp.optim_params();
    let mut optim = make_adam(&input);
    train(fsdp.layout(), fsdp.rank(), &input, optim.as_mut());
    let e = expect_err(
        fsdp.full_optim_state_dict(&optim.state_dict(), &input, false),
        "full_optim_state_dict with differing wrappings",
    );
    assert!(matches!(e, Error::PlanMismatch { .. }), "rank {rank}: {e}");

    // Handles on one communicator with different message limits.
    let other = MpiProcessGroup::world()
        .unwrap()
        .with_max_message_bytes(if rank == 1 { 8 } else { 16 })
        .unwrap();
    let e = expect_err(other.barrier(), "different message limits");
    assert!(
        matches!(&e, Error::CollectiveMismatch { detail, .. }
            if detail.contains("rank 1 sends messages of at most 8 bytes while rank 0 sends 16")),
        "rank {rank}: {e}"
    );
    // `world()` handles share the communicator, so the world is poisoned too.
    assert!(world.barrier().is_err());
}

// ----- the scenario matrix -----

fn train(layout: &ModelLayout, rank: usize, input: &OptimParams, optim: &mut dyn Optimizer) {
    let mut slots = Slots::new(layout, rank, input);
    for s in 0..STEPS {
        let full = fsdp::param_shards::synthetic_grads(layout, s);
        let grads = fsdp::param_shards::shard_tensors(layout, rank, input, &full).unwrap();
        optim.step(&mut slots.params, &grads).unwrap();
    }
}

struct Run {
    fsdp: Fsdp,
    input: OptimParams,
    local: OptimStateDict,
}

#[derive(Clone, Copy)]
struct Input {
    multiple: bool,
    diff: bool,
}

fn input_for(l: &ModelLayout, r: usize, i: Input) -> OptimParams {
    if l.model().params.len() == nested_model().params.len() {
        nested_optim_input(l, i.multiple, i.diff, r)
    } else {
        OptimParams::of_model(l)
    }
}

fn train_wrapped(
    pg: Arc<dyn ProcessGroup>,
    model: &ModelDesc,
    policy: &WrapPolicy,
    i: Input,
) -> Run {
    let fsdp = Fsdp::new(model, policy, pg).unwrap();
    let input = input_for(fsdp.layout(), fsdp.rank(), i);
    let mut optim = make_adam(&input);
    train(fsdp.layout(), fsdp.rank(), &input, optim.as_mut());
    Run {
        fsdp,
        local: optim.state_dict(),
        input,
    }
}

/// The unwrapped model trained with the same gradients, keyed by names.
fn unwrapped_reference(model: &ModelDesc, wrapped: &ModelLayout, i: Input) -> OptimStateDict {
    let layout = unwrapped(model);
    let input = unwrapped_input(wrapped, &input_for(wrapped, 0, Input { diff: false, ..i }));
    let mut optim = make_adam(&input);
    train(&layout, 0, &input, optim.as_mut());
    fsdp::optim_state::rekey_optim_state_dict(
        &optim.state_dict(),
        OptimStateKeyType::ParamName,
        &layout,
        &input,
    )
    .unwrap()
}

struct Case {
    name: &'static str,
    model: ModelDesc,
    policy1: WrapPolicy,
    policy2: WrapPolicy,
    input: Input,
}

fn cases() -> Vec<Case> {
    let nested = |name, policy1, policy2, multiple, diff| Case {
        name,
        model: nested_model(),
        policy1,
        policy2,
        input: Input { multiple, diff },
    };
    vec![
        nested(
            "nested wrap -> wrap_alt",
            wrap(false),
            wrap_alt(),
            false,
            false,
        ),
        nested(
            "nested wrap -> wrap_alt, 2 groups, reversed",
            wrap(false),
            wrap_alt(),
            true,
            true,
        ),
        nested(
            "nested wrap_alt -> wrap, ignored modules",
            wrap_alt(),
            wrap(true),
            false,
            true,
        ),
        Case {
            name: "transformer with tied weights",
            model: transformer_model(),
            policy1: transformer_policy(),
            policy2: transformer_policy(),
            input: Input {
                multiple: false,
                diff: false,
            },
        },
    ]
}

type Results = Vec<(String, Vec<u8>)>;

/// The core scenario matrix on one rank of `pg`, each result serialized: consolidation (all
/// ranks and rank 0 only), sharded dicts, rekeying, and loading into another wrapping at the
/// same world size (shard_full, scatter_full, flatten_sharded) and on the even ranks
/// (shard_full, scatter_full). Also checks the results against single-process references.
fn compute(pg: Arc<dyn ProcessGroup>, case: &Case) -> Results {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let what = |op: &str| format!("{} / {op} / rank {rank} of {ws}", case.name);
    let mut out: Results = Vec::new();
    let mut put = |label: &str, bytes: Vec<u8>| out.push((label.to_string(), bytes));
    let enc = |d: &OptimStateDict| encode(d).unwrap();

    let run1 = train_wrapped(pg.clone(), &case.model, &case.policy1, case.input);
    put("local", enc(&run1.local));
    let full = run1
        .fsdp
        .full_optim_state_dict(&run1.local, &run1.input, false)
        .unwrap()
        .expect("every rank gets the full dict");
    put("full_optim_state_dict", enc(&full));
    let reference = unwrapped_reference(&case.model, run1.fsdp.layout(), case.input);
    assert_same_groups(&full, &reference, false, &what("full vs unwrapped"));
    assert_same_state(&full, &reference, &what("full vs unwrapped"));

    let full_r0 = run1
        .fsdp
        .full_optim_state_dict(&run1.local, &run1.input, true)
        .unwrap();
    assert_eq!(full_r0.is_some(), rank == 0, "{}", what("rank0_only"));
    if let Some(f) = &full_r0 {
        assert_eq!(
            enc(f),
            enc(&full),
            "{}",
            what("rank0_only equals all ranks")
        );
    }
    put("full rank0_only", encode(&full_r0).unwrap());

    let sharded = run1
        .fsdp
        .sharded_optim_state_dict(&run1.local, &run1.input)
        .unwrap();
    put("sharded_optim_state_dict", enc(&sharded));
    for (k, st) in &sharded.state {
        for (n, v) in st {
            if let (Value::Sharded(s), Value::Tensor(f)) = (v, &full.state[k][n.as_str()]) {
                let want = fsdp::optim_state::chunk_dim0(f, rank, ws).unwrap();
                assert_eq!(s.offsets, want.offsets, "{}", what("sharded offsets"));
                match (&s.local, &want.local) {
                    (Some(a), Some(b)) => assert!(a.bit_eq(b), "{}", what("sharded chunk")),
                    (None, None) => {}
                    _ => panic!("{}", what("sharded chunk presence")),
                }
            }
        }
    }

    let by_name = run1
        .fsdp
        .rekey_optim_state_dict(&run1.local, OptimStateKeyType::ParamName, &run1.input)
        .unwrap();
    let back = run1
        .fsdp
        .rekey_optim_state_dict(&by_name, OptimStateKeyType::ParamId, &run1.input)
        .unwrap();
    put("rekey to names", enc(&by_name));
    put("rekey back to ids", enc(&back));

    // Another wrapping at the same world size.
    let run2 = train_wrapped(pg.clone(), &case.model, &case.policy2, case.input);
    let loaded = run2
        .fsdp
        .shard_full_optim_state_dict(&full, &run2.input)
        .unwrap();
    assert_same_groups(&loaded, &run2.local, true, &what("shard_full"));
    assert_same_state(&loaded, &run2.local, &what("shard_full"));
    put("shard_full_optim_state_dict", enc(&loaded));
    let scattered = run2
        .fsdp
        .scatter_full_optim_state_dict(full_r0.as_ref(), &run2.input)
        .unwrap();
    assert_eq!(
        enc(&scattered),
        enc(&loaded),
        "{}",
        what("scatter equals shard")
    );
    put("scatter_full_optim_state_dict", enc(&scattered));
    let flattened = run2
        .fsdp
        .flatten_sharded_optim_state_dict(&sharded, &run2.input)
        .unwrap();
    assert_same_state(&flattened, &run2.local, &what("flatten_sharded"));
    put("flatten_sharded_optim_state_dict", enc(&flattened));

    // optim_state_dict / optim_state_dict_to_load under SHARDED_STATE_DICT.
    let mut fsdp2 = Fsdp::new(&case.model, &case.policy2, pg.clone()).unwrap();
    fsdp2
        .set_state_dict_type(
            StateDictType::Sharded,
            Some(OptimStateDictConfig::Sharded {
                offload_to_cpu: true,
            }),
        )
        .unwrap();
    let osd = fsdp2.optim_state_dict(&run2.local, &run2.input).unwrap();
    let back = fsdp2
        .optim_state_dict_to_load(osd.as_ref(), &run2.input)
        .unwrap();
    assert_same_state(&back, &run2.local, &what("optim_state_dict round trip"));
    put("optim_state_dict_to_load sharded", enc(&back));

    // The even ranks (a sub-group), another wrapping.
    let evens: Vec<usize> = (0..ws).step_by(2).collect();
    if let Some(sub) = pg.new_subgroup(&evens).unwrap() {
        let run3 = train_wrapped(sub, &case.model, &case.policy2, case.input);
        let loaded = run3
            .fsdp
            .shard_full_optim_state_dict(&full, &run3.input)
            .unwrap();
        assert_same_state(&loaded, &run3.local, &what("shard_full into evens"));
        put("evens shard_full", enc(&loaded));
        let scattered = run3
            .fsdp
            .scatter_full_optim_state_dict(full_r0.as_ref(), &run3.input)
            .unwrap();
        assert_eq!(enc(&scattered), enc(&loaded), "{}", what("evens scatter"));
        let full3 = run3
            .fsdp
            .full_optim_state_dict(&run3.local, &run3.input, false)
            .unwrap()
            .unwrap();
        assert_same_state(&full3, &reference, &what("evens full vs unwrapped"));
        put("evens full", enc(&full3));
    }
    out
}

/// Runs every case over MPI and, in this process, over thread ranks of the same world size;
/// this rank's results must be byte-identical.
fn matrix(world: &Arc<MpiProcessGroup>) {
    let (rank, ws) = (world.rank(), world.world_size());
    let small: Arc<dyn ProcessGroup> = Arc::new(
        MpiProcessGroup::world()
            .unwrap()
            .with_max_message_bytes(61)
            .unwrap(),
    );
    for (i, case) in cases().iter().enumerate() {
        // The first case also runs with small messages (chunked collectives under the façade).
        let groups: Vec<Arc<dyn ProcessGroup>> = if i == 0 {
            vec![world.clone(), small.clone()]
        } else {
            vec![world.clone()]
        };
        let threads = ThreadGroup::run(ws, |pg| compute(Arc::new(pg), case));
        let want = &threads[rank];
        for pg in groups {
            let got = compute(pg, case);
            assert_eq!(got.len(), want.len(), "{}: number of results", case.name);
            for ((label, a), (label_t, b)) in got.iter().zip(want) {
                assert_eq!(label, label_t);
                assert!(
                    a == b,
                    "{} / {label} / rank {rank} of {ws}: MPI and thread ranks differ",
                    case.name
                );
            }
        }
    }
}

// ----- checkpoints -----

const CKPT_INPUT: Input = Input {
    multiple: true,
    diff: true,
};

fn dir() -> String {
    std::env::var(DIR_ENV).expect("FSDP_MPI_DIR names the checkpoint directory")
}

fn ckpt_save(world: &Arc<MpiProcessGroup>) {
    assert_eq!(world.world_size(), 4);
    let run = train_wrapped(world.clone(), &nested_model(), &wrap(false), CKPT_INPUT);
    run.fsdp
        .save_optim_checkpoint(&run.local, &run.input, dir(), &SaveOptions::default())
        .unwrap();
}

fn ckpt_load(world: &Arc<MpiProcessGroup>) {
    let (rank, ws) = (world.rank(), world.world_size());
    assert_eq!(ws, 3);
    let model = nested_model();
    // What the save computed: the full dict of the 4-rank run, on thread ranks.
    let full = ThreadGroup::run(4, |pg| {
        let run = train_wrapped(Arc::new(pg), &model, &wrap(false), CKPT_INPUT);
        run.fsdp
            .full_optim_state_dict(&run.local, &run.input, false)
            .unwrap()
            .unwrap()
    })
    .swap_remove(0);
    let run = train_wrapped(world.clone(), &model, &wrap_alt(), CKPT_INPUT);
    let loaded: OptimStateDict = run
        .fsdp
        .load_optim_checkpoint(dir(), &run.input, &LoadOptions::default())
        .unwrap();
    let want = run
        .fsdp
        .shard_full_optim_state_dict(&full, &run.input)
        .unwrap();
    // The loader keeps the optimizer's state-name order (`step` first) where the full dict
    // has the consolidated order (`exp_avg, exp_avg_sq, step`); everything else is identical.
    assert_identical(
        &loaded,
        &want,
        false,
        &format!("rank {rank}: checkpoint loaded at 3 processes vs shard_full_optim_state_dict"),
    );
    // Same gradients, so the 3-process optimizer's own state is what was loaded.
    assert_same_groups(&loaded, &run.local, true, &format!("rank {rank}"));
    assert_same_state(&loaded, &run.local, &format!("rank {rank}"));
    // And the full dict consolidated over MPI at 3 processes equals the saved one.
    let full3 = run
        .fsdp
        .full_optim_state_dict(&loaded, &run.input, false)
        .unwrap()
        .unwrap();
    assert_same_state(&full3, &full, &format!("rank {rank}: full at 3"));
}

/// Same keys in the same order, same state names (in the same order when `name_order`),
/// bit-equal tensors, equal values and param groups.
fn assert_identical(a: &OptimStateDict, b: &OptimStateDict, name_order: bool, what: &str) {
    let ka: Vec<_> = a.state.keys().collect();
    let kb: Vec<_> = b.state.keys().collect();
    assert_eq!(ka, kb, "{what}: keys");
    for (k, sa) in &a.state {
        let sb = &b.state[k];
        let mut na: Vec<&String> = sa.keys().collect();
        let mut nb: Vec<&String> = sb.keys().collect();
        if !name_order {
            na.sort();
            nb.sort();
        }
        assert_eq!(na, nb, "{what}: state names of {k}");
        for (n, va) in sa {
            match (va, &sb[n.as_str()]) {
                (Value::Tensor(x), Value::Tensor(y)) => {
                    assert!(x.bit_eq(y), "{what}: `{n}` of {k}: {x:?} vs {y:?}")
                }
                (x, y) => assert_eq!(x, y, "{what}: `{n}` of {k}"),
            }
        }
    }
    assert_eq!(a.param_groups, b.param_groups, "{what}: param groups");
}

// ----- singleton -----

fn singleton(world: &Arc<MpiProcessGroup>) {
    assert_eq!((world.rank(), world.world_size()), (0, 1));
    let threading = format!("{:?}", world.threading());
    assert!(
        threading == "Multiple" || threading == "Serialized",
        "{threading}"
    );
    println!("MPI thread level: {threading}");
    let again = MpiProcessGroup::world().unwrap();
    assert_eq!((again.rank(), again.world_size()), (0, 1));
    conformance::run(world.as_ref(), Reductions::RankOrder, "singleton");
    let case = &cases()[0];
    let want = ThreadGroup::run(1, |pg| compute(Arc::new(pg), case)).swap_remove(0);
    assert!(compute(world.clone(), case) == want, "singleton matrix");
}
