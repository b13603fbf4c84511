//! Live ranks save and load PyTorch Distributed Checkpoint (DCP) directories collectively:
//! `Fsdp::save_dcp` at one world size and wrapping, `Fsdp::load_dcp` at another, PyTorch-written
//! fixtures loaded at any world size, and the failure cases (a rank failing mid-save, metadata
//! disagreeing with the model); the same for FSDP2 ranks (`FullyShardedModel`), including
//! FSDP1-written directories loaded into FSDP2; and the offline conversion of a DCP directory
//! into the crate's checkpoint, which must write what live ranks loading and saving write.

use crate::common;

use common::{dcp_fixture_net as net, files_of};
use fsdp::collectives::Solo;
use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::commands::conversions;
use fsdp::io::dcp::{self, DcpCheckpoint};
use fsdp::io::torch_save::{self, PyObj};
use fsdp::{
    Error, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamGroup, ParamKey, ParamState, Value,
    WrapPolicy,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// FSDP1 wrapping of every submodule then the root, flat or with original parameters.
fn wrapping(orig: bool) -> WrapPolicy {
    WrapPolicy::units(&["net1", "net2", ""]).with_orig_params(orig)
}

fn tensor(shape: &[usize], seed: f32) -> HostTensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| seed + i as f32 * 0.25).collect();
    HostTensor::from_slice(&v, shape).unwrap()
}

/// A full Adam dict of `model` keyed by names: exp_avg, exp_avg_sq, 0-dim step, one group
/// with every option torch 2.13's Adam has (`dcp.load` wants each key the loader holds).
fn full_adam(model: &ModelDesc) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let mut st = ParamState::new();
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
        st.insert("exp_avg".into(), Value::Tensor(tensor(&p.shape, i as f32)));
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(tensor(&p.shape, 100.0 + i as f32)),
        );
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    let options = [
        ("lr".to_string(), Value::Float(1e-3)),
        (
            "betas".to_string(),
            Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
        ),
        ("eps".to_string(), Value::Float(1e-8)),
        ("weight_decay".to_string(), Value::Float(0.0)),
        ("amsgrad".to_string(), Value::Bool(false)),
        ("maximize".to_string(), Value::Bool(false)),
        ("foreach".to_string(), Value::None),
        ("capturable".to_string(), Value::Bool(false)),
        ("differentiable".to_string(), Value::Bool(false)),
        ("fused".to_string(), Value::None),
        ("decoupled_weight_decay".to_string(), Value::Bool(false)),
    ];
    sd.param_groups = Some(vec![ParamGroup {
        options: options.into_iter().collect(),
        params: model
            .params
            .iter()
            .map(|p| ParamKey::Name(p.name.clone()))
            .collect(),
    }]);
    sd
}

/// Every rank of a `ws` group shards `full` under `policy` and saves it with `save_dcp`.
fn save_live(
    model: &ModelDesc,
    policy: &WrapPolicy,
    ws: usize,
    full: &OptimStateDict,
    dir: &Path,
) -> Vec<fsdp::Result<()>> {
    ThreadGroup::run(ws, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(full, &params)?;
        fsdp.save_dcp(&local, &params, None, dir)
    })
}

/// Every rank of a `ws` group loads `dir` and compares with sharding `full` itself.
#[track_caller]
fn assert_loads_like(
    model: &ModelDesc,
    policy: &WrapPolicy,
    ws: usize,
    full: &OptimStateDict,
    dir: &Path,
) {
    let results = ThreadGroup::run(ws, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let loaded: OptimStateDict = fsdp
            .load_dcp(dir, &params)
            .unwrap_or_else(|e| panic!("rank {}: {e}", fsdp.rank()));
        let expected = fsdp.shard_full_optim_state_dict(full, &params).unwrap();
        (loaded, expected)
    });
    for (rank, (loaded, expected)) in results.iter().enumerate() {
        assert_eq!(loaded, expected, "ws {ws} rank {rank}");
    }
}

fn golden(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/dcp")
        .join(p)
}

#[test]
fn saved_by_live_ranks_at_two_and_three_loads_at_every_other_world_size_and_wrapping() {
    let model = net();
    let full = full_adam(&model);
    for (ws, orig) in [(2, false), (3, true), (3, false), (2, true)] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        for r in save_live(&model, &wrapping(orig), ws, &full, &dir) {
            r.unwrap();
        }
        // One data file per rank, every tensor tiled exactly once.
        let report = dcp::verify(&dir).unwrap();
        assert!(report.tensors > 0, "{report:?}");
        for f in 0..ws {
            assert!(dir.join(format!("__{f}_0.distcp")).is_file());
        }
        // The keys are get_state_dict's, at the original parameters' global shapes.
        let ckpt = DcpCheckpoint::open(&dir).unwrap();
        let t = ckpt
            .read_tensor("optim.state.net2.0.weight.exp_avg")
            .unwrap();
        assert!(t.bit_eq(&tensor(&[3, 10], 3.0)));
        for load_ws in [1, 2, 3, 4] {
            for load_orig in [false, true] {
                assert_loads_like(&model, &wrapping(load_orig), load_ws, &full, &dir);
            }
        }
        // Consolidated, it is the full dict.
        let optim = ckpt.load().unwrap().get("optim").cloned().unwrap();
        let back = torch_save::optim_from_pyobj(optim).unwrap();
        assert_eq!(back.state, full.state, "ws {ws} orig {orig}");
    }
}

#[test]
fn a_flat_shard_slice_is_written_as_boxes_of_the_original_parameter() {
    // net1.0.weight (10x4) flattened with its bias into one flat parameter of 50 elements,
    // cut at 25 on 2 ranks: rank 0 holds rows 0..6 and the first element of row 6, rank 1
    // the rest of row 6 and rows 7..10.
    let model = net();
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    for r in save_live(&model, &wrapping(false), 2, &full, &dir) {
        r.unwrap();
    }
    let ckpt = DcpCheckpoint::open(&dir).unwrap();
    let entry = ckpt
        .metadata()
        .entries
        .iter()
        .find(|e| e.key == "optim.state.net1.0.weight.exp_avg")
        .unwrap();
    let fsdp::io::dcp::EntryKind::Tensor(t) = &entry.kind else {
        panic!("not a tensor")
    };
    assert_eq!(t.size, vec![10, 4]);
    assert!(t.chunks.len() > 2, "{:?}", t.chunks);
    assert!(
        t.chunks.iter().any(|c| c.sizes[0] == 1 && c.sizes[1] < 4),
        "{:?}",
        t.chunks
    );
}

#[test]
fn model_parameters_saved_beside_the_state_consolidate_to_the_full_parameters() {
    use fsdp::param_shards::{shard_tensors, synthetic_params};
    let model = net();
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    for r in ThreadGroup::run(3, |pg| {
        let fsdp = Fsdp::new(&model, &wrapping(false), Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        let values = synthetic_params(fsdp.layout());
        let mine = shard_tensors(fsdp.layout(), fsdp.rank(), &params, &values)?;
        fsdp.save_dcp(&local, &params, Some(&mine), &dir)
    }) {
        r.unwrap();
    }
    let ckpt = DcpCheckpoint::open(&dir).unwrap();
    // Nested as `{"model": ..., "optim": ...}`, the model first.
    let top: Vec<String> = match ckpt.load().unwrap() {
        PyObj::Dict(items) => items.iter().map(|(k, _)| format!("{k:?}")).collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(top.len(), 2);
    assert!(
        top[0].contains("model") && top[1].contains("optim"),
        "{top:?}"
    );
    let layout = fsdp::flat_param::ModelLayout::new(&model, &wrapping(false), 3).unwrap();
    for (p, want) in model.params.iter().zip(synthetic_params(&layout)) {
        let got = ckpt.read_tensor(&format!("model.{}", p.name)).unwrap();
        assert!(got.bit_eq(&want.unwrap()), "model.{}", p.name);
    }
}

#[test]
fn pytorch_written_fixtures_load_into_live_ranks_at_any_world_size() {
    // The untied Net (fsdp1_orig_ws3 with net2 frozen); fsdp1_flat_ws4 and
    // fsdp2_adamw_ws3_tied tie out.weight to embed.weight (the latter with two groups).
    let cases = [
        ("fsdp2_adam_ws4", false, false),
        ("fsdp1_orig_ws3", true, false),
        ("fsdp1_flat_ws4", false, true),
        ("fsdp2_adamw_ws3_tied", false, true),
    ];
    for (name, frozen, tied) in cases {
        let model = fixture_model(frozen, tied);
        let expected = torch_save::load(golden(name).join("expected.pt")).unwrap();
        let optim = expected.get("optim").cloned().unwrap();
        let full = torch_save::optim_from_pyobj(optim).unwrap();
        for ws in [1, 2, 3, 5] {
            for orig in [false, true] {
                assert_loads_like(
                    &model,
                    &wrapping(orig),
                    ws,
                    &full,
                    &golden(name).join("ckpt"),
                );
            }
        }
    }
}

#[test]
fn a_rank_failing_mid_save_leaves_no_directory_and_every_rank_gets_the_error() {
    let model = net();
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let results = ThreadGroup::run(3, |pg| {
        let rank = pg.rank();
        let fsdp = Fsdp::new(&model, &wrapping(true), Arc::new(pg))?;
        let params = fsdp.optim_params();
        let mut local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        if rank == 1 {
            // Rank 1's state does not fit its shard: it fails while writing its file.
            let st = local.state.values_mut().next().unwrap();
            st.insert("exp_avg".into(), Value::Tensor(tensor(&[1000], 0.0)));
        }
        fsdp.save_dcp(&local, &params, None, &dir)
    });
    for (rank, r) in results.iter().enumerate() {
        assert!(
            matches!(r, Err(Error::ShapeMismatch { .. })),
            "rank {rank}: {r:?}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_non_empty_foreign_directory_is_refused_on_every_rank_and_left_alone() {
    let model = net();
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), b"keep").unwrap();
    for r in save_live(&model, &wrapping(false), 2, &full, &dir) {
        assert!(matches!(r, Err(Error::OutputRefused { .. })), "{r:?}");
    }
    assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"keep");
    // An earlier DCP directory is replaced whole.
    let other = tmp.path().join("other");
    for r in save_live(&model, &wrapping(false), 3, &full, &other) {
        r.unwrap();
    }
    for r in save_live(&model, &wrapping(true), 2, &full, &other) {
        r.unwrap();
    }
    assert!(!other.join("__2_0.distcp").exists());
    assert_loads_like(&model, &wrapping(false), 3, &full, &other);
}

/// Loading `dir` on one rank of `model`.
fn load_one(model: &ModelDesc, dir: &Path) -> fsdp::Result<OptimStateDict> {
    ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(model, &wrapping(false), Arc::new(pg))?;
        fsdp.load_dcp(dir, &fsdp.optim_params())
    })
    .pop()
    .unwrap()
}

#[track_caller]
fn assert_names(err: &Error, key: &str) {
    match err {
        Error::DcpStorage { key: k, file, .. } => {
            assert_eq!(k, key, "{err}");
            assert_eq!(file, ".metadata", "{err}");
        }
        other => panic!("expected a DcpStorage error naming {key}, got {other:?}"),
    }
}

#[test]
fn metadata_disagreeing_with_the_model_names_the_key_and_the_file() {
    let dir = golden("fsdp2_adam_ws4").join("ckpt");
    // A model whose net1.0.weight has another shape.
    let mut model = net();
    model.params[1].shape = vec![4, 10];
    let err = load_one(&model, &dir).unwrap_err();
    assert_names(&err, "optim.state.net1.0.weight.exp_avg");
    // A model without `out.weight`.
    let mut model = net();
    model.params.pop();
    let err = load_one(&model, &dir).unwrap_err();
    assert_names(&err, "optim.state.out.weight.exp_avg");
    // A directory in which one parameter lacks a state the others have.
    let mut full = full_adam(&net());
    full.state[&ParamKey::Name("net2.0.bias".into())].shift_remove("exp_avg_sq");
    let obj = PyObj::Dict(vec![(
        PyObj::Str("optim".into()),
        torch_save::optim_to_pyobj(&full).unwrap(),
    )]);
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    dcp::save_dcp(&obj, &missing).unwrap();
    let err = load_one(&net(), &missing).unwrap_err();
    assert_names(&err, "optim.state.net2.0.bias.exp_avg_sq");
}

/// `{"optim": full}`, the nested dict `get_state_dict` + `dcp.save` would hold.
fn optim_only(full: &OptimStateDict) -> PyObj {
    PyObj::Dict(vec![(
        PyObj::Str("optim".into()),
        torch_save::optim_to_pyobj(full).unwrap(),
    )])
}

#[test]
fn pytorch_loads_crate_written_directories_at_another_world_size_into_fsdp1_and_fsdp2() {
    let model = net();
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let p = |n: &str| tmp.path().join(n);
    torch_save::save(&optim_only(&full), p("expected.pt")).unwrap();
    // Live ranks: flat wrapping at 2 (with the model's parameters), original parameters at 3.
    let layout = fsdp::flat_param::ModelLayout::new(&model, &wrapping(false), 2).unwrap();
    let values = fsdp::param_shards::synthetic_params(&layout);
    for r in ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &wrapping(false), Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        let mine = fsdp::param_shards::shard_tensors(fsdp.layout(), fsdp.rank(), &params, &values)?;
        fsdp.save_dcp(&local, &params, Some(&mine), p("live2"))
    }) {
        r.unwrap();
    }
    let model_values = model
        .params
        .iter()
        .zip(&values)
        .map(|(d, v)| {
            (
                PyObj::Str(d.name.clone()),
                PyObj::Tensor(v.clone().unwrap()),
            )
        })
        .collect();
    let with_model = PyObj::Dict(vec![
        (
            PyObj::Str("optim".into()),
            torch_save::optim_to_pyobj(&full).unwrap(),
        ),
        (PyObj::Str("model".into()), PyObj::Dict(model_values)),
    ]);
    torch_save::save(&with_model, p("expected_model.pt")).unwrap();
    for r in save_live(&model, &wrapping(true), 3, &full, &p("live3")) {
        r.unwrap();
    }
    // A full dict file, as torch_save_to_dcp converts it.
    torch_save::save(&optim_only(&full), p("full.pt")).unwrap();
    conversions::torch_save_to_dcp(&p("full.pt"), &p("from_pt"), &Solo).unwrap();
    // The crate's own checkpoint saved at 3, converted.
    let opts = fsdp::checkpoint::SaveOptions::default();
    for r in ThreadGroup::run(3, |pg| {
        let fsdp = Fsdp::new(&model, &wrapping(false), Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        fsdp.save_optim_checkpoint(&local, &params, p("ckpt"), &opts)
    }) {
        r.unwrap();
    }
    let load_opts = fsdp::checkpoint::LoadOptions::default();
    let from_ckpt = fsdp::checkpoint::load_full(&p("ckpt"), &load_opts).unwrap();
    dcp::save_dcp(&optim_only(&from_ckpt), &p("from_ckpt")).unwrap();
    let cases = [
        ("live2", "expected_model.pt", "3", "fsdp2"),
        ("live3", "expected.pt", "2", "fsdp1_flat"),
        ("live2", "expected_model.pt", "3", "fsdp1_orig"),
        ("from_pt", "expected.pt", "2", "fsdp2"),
        ("from_ckpt", "expected.pt", "2", "fsdp1_flat"),
    ];
    load_in_torch(cases.map(|(dir, expected, ws, wrapper)| (p(dir), p(expected), ws, wrapper)));
}

#[test]
fn with_hybrid_sharding_the_first_shard_group_writes_and_every_rank_commits() {
    // 4 ranks in 2 shard groups of 2: ranks 2 and 3 hold replicas and write nothing.
    let model = net();
    let full = full_adam(&model);
    let policy = wrapping(false).with_strategy(fsdp::model::ShardingStrategy::HybridShard);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    for r in ThreadGroup::run(4, |pg| {
        let fsdp = Fsdp::new_hybrid(&model, &policy, Arc::new(pg), 2)?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        fsdp.save_dcp(&local, &params, None, &dir)
    }) {
        r.unwrap();
    }
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, [".metadata", "__0_0.distcp", "__1_0.distcp"]);
    assert_loads_like(&model, &wrapping(true), 3, &full, &dir);
}

/// `gen.py`'s FSDP2 wrapping: `fully_shard` on net1, net2, then the root.
fn fsdp2_wrapping() -> WrapPolicy {
    WrapPolicy::fully_shard(&["net1", "net2", ""])
}

#[test]
fn fsdp2_ranks_save_dcp_that_pytorch_loads_into_fsdp2_and_fsdp1_at_other_world_sizes() {
    use fsdp::state_dict::{OptimStateDictApi, StateDictApi, StateDictOptions};
    use fsdp::FullyShardedModel;
    let model = net();
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let p = |n: &str| tmp.path().join(n);
    // The model's parameters too: `dcp.save({"model": ..., "optim": ...})`.
    let params_full: indexmap::IndexMap<String, Value> = model
        .params
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                d.name.clone(),
                Value::Tensor(tensor(&d.shape, 1000.0 + i as f32)),
            )
        })
        .collect();
    // 4 FSDP2 ranks (10 rows: 3, 3, 3, 1; 3 rows: 1, 1, 1, 0) each write their own rows.
    let saved = ThreadGroup::run(4, |pg| {
        let m = FullyShardedModel::new(&model, &fsdp2_wrapping(), Arc::new(pg))?;
        let params = m.optim_params();
        let local = m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        let weights: Vec<HostTensor> = m
            .set_model_state_dict(Some(&params_full), &StateDictOptions::full())?
            .into_iter()
            .map(Option::unwrap)
            .collect();
        m.save_dcp(&local, &params, Some(&weights), p("fsdp2_ws4"))?;
        m.get_optimizer_state_dict(&local, &params, &StateDictOptions::full())
    });
    // What PyTorch loads must be get_state_dict(full_state_dict=True) of the saving run
    // (whose optimizer, loaded from a full dict, holds `betas` as a list, as PyTorch's does).
    let saving_run = saved.into_iter().next().unwrap().unwrap();
    let weights = params_full
        .iter()
        .map(|(k, v)| {
            let Value::Tensor(t) = v else { unreachable!() };
            (PyObj::Str(k.clone()), PyObj::Tensor(t.clone()))
        })
        .collect();
    let expected = PyObj::Dict(vec![
        (
            PyObj::Str("optim".into()),
            torch_save::optim_to_pyobj(&saving_run).unwrap(),
        ),
        (PyObj::Str("model".into()), PyObj::Dict(weights)),
    ]);
    torch_save::save(&expected, p("expected.pt")).unwrap();
    // The crate's own ranks read the parameters back at another world size.
    let back = ThreadGroup::run(3, |pg| {
        let m = FullyShardedModel::new(&model, &fsdp2_wrapping(), Arc::new(pg))?;
        let loaded: Vec<HostTensor> = m.load_model_dcp(p("fsdp2_ws4"))?;
        let want = m.set_model_state_dict(Some(&params_full), &StateDictOptions::full())?;
        for (a, b) in loaded.iter().zip(&want) {
            assert!(a.bit_eq(b.as_ref().unwrap()), "rank {}", m.rank());
        }
        Ok::<_, fsdp::Error>(())
    });
    for r in back {
        r.unwrap();
    }
    let cases = [
        ("fsdp2_ws4", "3", "fsdp2"),
        ("fsdp2_ws4", "2", "fsdp1_flat"),
    ];
    load_in_torch(cases.map(|(dir, ws, wrapper)| (p(dir), p("expected.pt"), ws, wrapper)));
}

#[test]
fn fsdp2_ranks_load_pytorch_fsdp2_fixtures_and_crate_fsdp1_directories_at_any_world_size() {
    use fsdp::state_dict::{OptimStateDictApi, StateDictApi, StateDictOptions};
    use fsdp::FullyShardedModel;
    let model = net();
    // PyTorch's FSDP2 directory saved at 4 ranks, loaded at 3 and 1: the full dict gathered
    // back is the one dcp_to_torch_save wrote.
    let fixture = golden("fsdp2_adam_ws4");
    let expected = torch_save::load(fixture.join("expected.pt")).unwrap();
    let want = torch_save::optim_from_pyobj(expected.get("optim").cloned().unwrap()).unwrap();
    for ws in [3, 1] {
        let results = ThreadGroup::run(ws, |pg| {
            let m = FullyShardedModel::new(&model, &fsdp2_wrapping(), Arc::new(pg))?;
            let params = m.optim_params();
            let local: OptimStateDict = m.load_dcp(fixture.join("ckpt"), &params)?;
            m.get_optimizer_state_dict(&local, &params, &StateDictOptions::full())
        });
        for (rank, got) in results.into_iter().enumerate() {
            let got = got.unwrap();
            assert_eq!(got.state, want.state, "ws {ws} rank {rank}");
        }
    }
    // Its model parameters too.
    let want_model = expected.get("model").cloned().unwrap();
    let results = ThreadGroup::run(3, |pg| {
        let m = FullyShardedModel::new(&model, &fsdp2_wrapping(), Arc::new(pg))?;
        let local: Vec<HostTensor> = m.load_model_dcp(fixture.join("ckpt"))?;
        m.get_model_state_dict(&local, &StateDictOptions::full())
    });
    for got in results {
        for (k, v) in got.unwrap() {
            let (Value::Tensor(t), Some(PyObj::Tensor(w))) = (v, want_model.get(&k)) else {
                panic!("{k}")
            };
            assert!(t.bit_eq(w), "model.{k}");
        }
    }
    // A directory FSDP1 ranks wrote (flat parameters, 2 ranks) into FSDP2 at 3 ranks.
    let full = full_adam(&model);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fsdp1_ws2");
    for r in save_live(&model, &wrapping(false), 2, &full, &dir) {
        r.unwrap();
    }
    let results = ThreadGroup::run(3, |pg| {
        let m = FullyShardedModel::new(&model, &fsdp2_wrapping(), Arc::new(pg))?;
        let params = m.optim_params();
        let local: OptimStateDict = m.load_dcp(&dir, &params)?;
        let sliced = m.set_optimizer_state_dict(Some(&full), &params, &StateDictOptions::full())?;
        Ok::<_, fsdp::Error>((local, sliced))
    });
    for (rank, r) in results.into_iter().enumerate() {
        // The same state and groups; options as stored (a DCP load keeps `betas` a tuple, as
        // PyTorch's sharded path does; loading a full dict makes it a list).
        let (local, sliced) = r.unwrap();
        assert_eq!(
            local.state, sliced.state,
            "FSDP1 ws 2 -> FSDP2 ws 3, rank {rank}"
        );
        let params = |d: &OptimStateDict| d.param_groups.as_ref().unwrap()[0].params.clone();
        assert_eq!(params(&local), params(&sliced));
        assert_eq!(
            local.param_groups.as_ref().unwrap()[0].options["lr"],
            Value::Float(1e-3)
        );
    }
}

#[test]
fn tied_parameters_are_saved_under_both_names_so_pytorch_loads_them_into_tied_models() {
    use fsdp::state_dict::StateDictOptions;
    use fsdp::state_dict::{ModelStateDict, OptimStateDictApi, StateDictApi};
    use fsdp::FullyShardedModel;
    // gen.py's Net(tied=True): `out.weight` is `embed.weight`, so `model.state_dict()` and
    // PyTorch's `dcp.load` want both names.
    let mut model = net();
    model.params.pop();
    let model = model.tie("out.weight", "embed.weight");
    let full = full_adam(&model);
    let weights: ModelStateDict = model
        .params
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let t = tensor(&d.shape, 1000.0 + i as f32);
            (d.name.clone(), Value::Tensor(t))
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let p = |n: &str| tmp.path().join(n);
    let full_opts = StateDictOptions::full();
    // FSDP2 at 4 ranks and FSDP1 (flat parameters) at 2 load both dicts with set_state_dict,
    // save them as DCP and report the full optimizer dict PyTorch must find.
    let fsdp2 = ThreadGroup::run(4, |pg| {
        let m = FullyShardedModel::new(&model, &fsdp2_wrapping(), Arc::new(pg))?;
        let params = m.optim_params();
        let (local, osd) = m.set_state_dict(Some(&weights), Some(&full), &params, &full_opts)?;
        let local: Vec<HostTensor> = local.into_iter().map(Option::unwrap).collect();
        m.save_dcp(&osd, &params, Some(&local), p("fsdp2_ws4"))?;
        m.get_optimizer_state_dict(&osd, &params, &full_opts)
    });
    let fsdp1 = ThreadGroup::run(2, |pg| {
        let f = Fsdp::new(&model, &wrapping(false), Arc::new(pg))?;
        let params = f.optim_params();
        let (local, osd) = f.set_state_dict(Some(&weights), Some(&full), &params, &full_opts)?;
        f.save_dcp(&osd, &params, Some(&local), p("fsdp1_ws2"))?;
        f.get_optimizer_state_dict(&osd, &params, &full_opts)
    });
    let mut with_alias: Vec<(PyObj, PyObj)> = weights
        .iter()
        .map(|(k, v)| {
            let Value::Tensor(t) = v else { unreachable!() };
            (PyObj::Str(k.clone()), PyObj::Tensor(t.clone()))
        })
        .collect();
    with_alias.push((PyObj::Str("out.weight".into()), with_alias[0].1.clone()));
    for (name, saved) in [("fsdp2", fsdp2), ("fsdp1", fsdp1)] {
        let optim = saved.into_iter().next().unwrap().unwrap();
        let expected = PyObj::Dict(vec![
            (
                PyObj::Str("optim".into()),
                torch_save::optim_to_pyobj(&optim).unwrap(),
            ),
            (PyObj::Str("model".into()), PyObj::Dict(with_alias.clone())),
        ]);
        torch_save::save(&expected, p(&format!("{name}.pt"))).unwrap();
        // Both names are in the directory.
        let dir = p(if name == "fsdp2" {
            "fsdp2_ws4"
        } else {
            "fsdp1_ws2"
        });
        let ckpt = dcp::DcpCheckpoint::open(&dir).unwrap();
        let a = ckpt.read_tensor("model.out.weight").unwrap();
        assert!(
            a.bit_eq(&ckpt.read_tensor("model.embed.weight").unwrap()),
            "{name}"
        );
    }
    let cases = [
        ("fsdp2_ws4", "fsdp2.pt", "3", "fsdp1_orig+tied"),
        ("fsdp1_ws2", "fsdp1.pt", "3", "fsdp2+tied"),
    ];
    load_in_torch(cases.map(|(dir, expected, ws, wrapper)| (p(dir), p(expected), ws, wrapper)));
}

/// Runs `load_in_torch.py` on `(directory, expected dict file, world size, wrapper)` cases:
/// PyTorch loads each directory into that wrapping and finds the expected dicts.
pub(crate) fn load_in_torch<const N: usize>(cases: [(PathBuf, PathBuf, &str, &str); N]) {
    let mut cmd = std::process::Command::new(crate::common::python());
    cmd.arg(golden("load_in_torch.py"));
    for (dir, expected, ws, wrapper) in &cases {
        cmd.arg(dir).arg(expected).arg(ws).arg(wrapper);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches(": ok").count(), N, "{stdout}");
}

/// `ws` live ranks load the DCP directory `dir` and save the crate's checkpoint at `out`.
fn convert_live(model: &ModelDesc, policy: &WrapPolicy, ws: usize, dir: &Path, out: &Path) {
    for r in ThreadGroup::run(ws, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local: OptimStateDict = fsdp.load_dcp(dir, &params)?;
        fsdp.save_optim_checkpoint(&local, &params, out, &Default::default())
    }) {
        r.unwrap();
    }
}

/// The fixture models of `pytorch_written_fixtures_load_into_live_ranks_at_any_world_size`.
fn fixture_model(frozen: bool, tied: bool) -> ModelDesc {
    let mut model = net();
    if tied {
        model.params.pop();
        model = model.tie("out.weight", "embed.weight");
    }
    if frozen {
        for p in &mut model.params {
            if p.name.starts_with("net2.") {
                p.requires_grad = false;
            }
        }
    }
    model
}

#[test]
fn converting_pytorch_fixtures_offline_writes_what_live_ranks_loading_and_saving_write() {
    use fsdp::flat_param::ModelLayout;
    let cases = [
        ("fsdp2_adam_ws4", false, false),
        ("fsdp1_orig_ws3", true, false),
        ("fsdp1_flat_ws4", false, true),
        ("fsdp2_adamw_ws3_tied", false, true),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (name, frozen, tied) in cases {
        let model = fixture_model(frozen, tied);
        let input = golden(name).join("ckpt");
        // 17 ranks: more than one pass of 16 files over the input.
        for ws in [1, 3, 5, 17] {
            for orig in [false, true] {
                let what = format!("{name} for {ws} ranks, use_orig_params={orig}");
                let live = tmp.path().join("live");
                convert_live(&model, &wrapping(orig), ws, &input, &live);
                let layout = ModelLayout::new(&model, &wrapping(orig), ws).unwrap();
                let offline = tmp.path().join("offline");
                conversions::dcp_to_checkpoint(&input, &offline, &layout, &Solo).unwrap();
                assert!(files_of(&live) == files_of(&offline), "{what}: offline");
                // Split across 2 and 4 processes (threads here): ranks r % N on process N.
                for n in [2, 4] {
                    let split = tmp.path().join(format!("split{n}"));
                    for r in ThreadGroup::run(n, |pg| {
                        conversions::dcp_to_checkpoint(&input, &split, &layout, &pg)
                    }) {
                        r.unwrap();
                    }
                    assert!(files_of(&live) == files_of(&split), "{what}: {n} processes");
                    std::fs::remove_dir_all(&split).unwrap();
                }
                std::fs::remove_dir_all(&live).unwrap();
                std::fs::remove_dir_all(&offline).unwrap();
            }
        }
    }
}

#[test]
fn an_offline_conversion_failing_on_one_process_fails_every_process_and_leaves_nothing() {
    use fsdp::flat_param::ModelLayout;
    let tmp = tempfile::tempdir().unwrap();
    // A copy of a PyTorch fixture whose data file lost its last bytes.
    let input = tmp.path().join("dcp");
    std::fs::create_dir(&input).unwrap();
    for e in std::fs::read_dir(golden("fsdp2_adam_ws4/ckpt")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), input.join(e.file_name())).unwrap();
    }
    let data = input.join("__3_0.distcp");
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..bytes.len() - 100]).unwrap();
    // One output rank on a job of 3: process 0 converts it and fails, 1 and 2 have nothing.
    let layout = ModelLayout::new(&fixture_model(false, false), &wrapping(false), 1).unwrap();
    let out = tmp.path().join("out");
    let results = ThreadGroup::run(3, |pg| {
        conversions::dcp_to_checkpoint(&input, &out, &layout, &pg)
    });
    let first = results[0].clone().unwrap_err();
    assert!(first.to_string().contains("__3_0.distcp"), "{first}");
    for (p, r) in results.iter().enumerate() {
        assert_eq!(r.as_ref().unwrap_err(), &first, "process {p}");
    }
    assert!(!out.exists());
    let mut left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    left.sort();
    assert_eq!(left, ["dcp"], "no temporary left behind");
}
