//! Sharded checkpoints on disk: save at one world size and wrapping, load at another; crash
//! safety; corruption and truncation detected with the right error.

use crate::common;

use fsdp::checkpoint::{
    self, load_full, read_manifest, verify, CrashPoint, LoadOptions, SaveOptions, COMMIT, MANIFEST,
};
use fsdp::collectives::Solo;
use fsdp::collectives::ThreadGroup;
use fsdp::commands::conversions;
use fsdp::flat_param::ModelLayout;
use fsdp::io::torch_save::PyObj;
use fsdp::param_shards::{shard_tensors, synthetic_params};
use fsdp::{
    DType, Error, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamGroup, ParamKey, ParamState,
    Value, WrapPolicy,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A deterministic, parameter-shaped tensor.
fn tensor(shape: &[usize], seed: f32) -> HostTensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| seed + i as f32 * 0.25).collect();
    HostTensor::from_slice(&v, shape).unwrap()
}

/// The full Adam dict of `model` after `steps` steps, with two param groups and user state.
fn full_adam(model: &ModelDesc, steps: f32) -> OptimStateDict {
    let mut sd = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let mut st = ParamState::new();
        st.insert("exp_avg".into(), Value::Tensor(tensor(&p.shape, i as f32)));
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(tensor(&p.shape, 100.0 + i as f32)),
        );
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(steps)));
        sd.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    let names: Vec<ParamKey> = model
        .params
        .iter()
        .map(|p| ParamKey::Name(p.name.clone()))
        .collect();
    let group = |params: &[ParamKey], wd: f64| ParamGroup {
        options: [
            ("lr".to_string(), Value::Float(1e-3)),
            ("weight_decay".to_string(), Value::Float(wd)),
        ]
        .into_iter()
        .collect(),
        params: params.to_vec(),
    };
    let half = names.len() / 2;
    sd.param_groups = Some(vec![group(&names[..half], 0.0), group(&names[half..], 0.9)]);
    sd
}

/// Every rank of a `world_size` group shards `full` under `policy` and saves it to `dir`.
fn save_at(
    model: &ModelDesc,
    policy: &WrapPolicy,
    world_size: usize,
    full: &OptimStateDict,
    dir: &Path,
    opts: &SaveOptions,
) -> Vec<fsdp::Result<()>> {
    ThreadGroup::run(world_size, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(full, &params)?;
        fsdp.save_optim_checkpoint(&local, &params, dir, opts)
    })
}

/// Each rank's dict loaded from `dir`, and what `shard_full_optim_state_dict(full)` gives it.
fn load_at(
    model: &ModelDesc,
    policy: &WrapPolicy,
    world_size: usize,
    full: &OptimStateDict,
    dir: &Path,
) -> Vec<(OptimStateDict, OptimStateDict)> {
    load_with(
        model,
        policy,
        world_size,
        full,
        dir,
        &LoadOptions::default(),
    )
}

/// [`load_at`] with load options.
fn load_with(
    model: &ModelDesc,
    policy: &WrapPolicy,
    world_size: usize,
    full: &OptimStateDict,
    dir: &Path,
    opts: &LoadOptions,
) -> Vec<(OptimStateDict, OptimStateDict)> {
    ThreadGroup::run(world_size, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let loaded = fsdp
            .load_optim_checkpoint(dir, &params, opts)
            .unwrap_or_else(|e| panic!("rank {}: {e}", fsdp.rank()));
        let expected = fsdp.shard_full_optim_state_dict(full, &params).unwrap();
        (loaded, expected)
    })
}

/// Same keys in the same order, same state names in the same order, bit-equal tensors,
/// equal values and param groups.
#[track_caller]
fn assert_identical(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    let ka: Vec<&ParamKey> = a.state.keys().collect();
    let kb: Vec<&ParamKey> = b.state.keys().collect();
    assert_eq!(ka, kb, "{what}: keys");
    for (k, sa) in &a.state {
        let sb = &b.state[k];
        let na: Vec<&String> = sa.keys().collect();
        let nb: Vec<&String> = sb.keys().collect();
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

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn loading_with_or_without_read_ahead_and_verification_gives_the_same_shards() {
    let model = common::nested_model();
    let full = full_adam(&model, 3.0);
    let root = tmp();
    let dir = root.path().join("ckpt");
    for r in save_at(
        &model,
        &common::wrap(false),
        3,
        &full,
        &dir,
        &SaveOptions::default(),
    ) {
        r.unwrap();
    }
    for load_ws in [2, 5] {
        for read_ahead in [true, false] {
            for verify in [true, false] {
                let opts = LoadOptions::default().verify(verify).read_ahead(read_ahead);
                let loaded = load_with(&model, &common::wrap_alt(), load_ws, &full, &dir, &opts);
                for (rank, (loaded, expected)) in loaded.iter().enumerate() {
                    assert_identical(
                        loaded,
                        expected,
                        &format!("loaded at {load_ws}, rank {rank}, {opts:?}"),
                    );
                }
            }
        }
    }
}

#[test]
fn nested_model_saved_at_each_world_size_loads_at_every_other_with_either_wrapping() {
    let model = common::nested_model();
    let full = full_adam(&model, 3.0);
    let policies = [common::wrap(false), common::wrap_alt()];
    for save_ws in [1, 2, 3, 5, 8] {
        for (pi, save_policy) in policies.iter().enumerate() {
            let root = tmp();
            let dir = root.path().join("ckpt");
            for r in save_at(
                &model,
                save_policy,
                save_ws,
                &full,
                &dir,
                &SaveOptions::default(),
            ) {
                r.unwrap();
            }
            // Consolidating from disk gives the full dict back.
            let back = load_full(&dir, &LoadOptions::default()).unwrap();
            common::assert_same_state(&back, &full, "load_full");
            // Group params follow the saving optimizer's order (as in full_optim_state_dict).
            common::assert_same_groups(&back, &full, false, "load_full");
            let sets = |d: &OptimStateDict| -> Vec<std::collections::BTreeSet<ParamKey>> {
                let groups = d.param_groups.as_ref().unwrap();
                groups
                    .iter()
                    .map(|g| g.params.iter().cloned().collect())
                    .collect()
            };
            assert_eq!(sets(&back), sets(&full));
            for load_ws in [1, 2, 3, 4, 7, 8] {
                let load_policy = &policies[(pi + load_ws) % 2];
                for (rank, (loaded, expected)) in load_at(&model, load_policy, load_ws, &full, &dir)
                    .iter()
                    .enumerate()
                {
                    assert_identical(
                        loaded,
                        expected,
                        &format!("saved at {save_ws}, loaded at {load_ws}, rank {rank}"),
                    );
                }
            }
        }
    }
}

#[test]
fn state_names_load_in_the_order_shard_full_gives_the_full_dict_whatever_the_saving_order() {
    let model = common::nested_model();
    // The optimizer's own order (torch.optim.Adam: step first), not the consolidated one.
    let mut full = full_adam(&model, 3.0);
    for st in full.state.values_mut() {
        let step = st.shift_remove("step").unwrap();
        st.shift_insert(0, "step".into(), step);
    }
    for policy in [
        common::wrap(false),
        common::wrap(false).with_orig_params(true),
    ] {
        let root = tmp();
        let dir = root.path().join("ckpt");
        for r in save_at(&model, &policy, 2, &full, &dir, &SaveOptions::default()) {
            r.unwrap();
        }
        let consolidated = load_full(&dir, &LoadOptions::default()).unwrap();
        for (rank, (loaded, _)) in load_at(&model, &common::wrap_alt(), 3, &full, &dir)
            .iter()
            .enumerate()
        {
            let expected = ThreadGroup::run(3, |pg| {
                let fsdp = Fsdp::new(&model, &common::wrap_alt(), Arc::new(pg)).unwrap();
                fsdp.shard_full_optim_state_dict(&consolidated, &fsdp.optim_params())
                    .unwrap()
            })
            .swap_remove(rank);
            assert_identical(loaded, &expected, &format!("rank {rank}"));
        }
    }
}

#[test]
fn load_full_equals_full_optim_state_dict_in_key_order_too() {
    for (model, policy) in [
        (common::nested_model(), common::wrap(true)),
        (common::transformer_model(), common::transformer_policy()),
        (
            common::nested_model(),
            common::wrap(false).with_orig_params(true),
        ),
    ] {
        let full = full_adam(&model, 2.0);
        let root = tmp();
        let dir = root.path().join("ckpt");
        let results = ThreadGroup::run(3, |pg| {
            let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
            let params = fsdp.optim_params();
            let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
            let consolidated = fsdp.full_optim_state_dict(&local, &params, true).unwrap();
            fsdp.save_optim_checkpoint(&local, &params, &dir, &SaveOptions::default())
                .unwrap();
            consolidated
        });
        let consolidated = results.into_iter().next().unwrap().unwrap();
        let back = load_full(&dir, &LoadOptions::default()).unwrap();
        assert_identical(&back, &consolidated, &format!("{:?}", policy.units));
    }
}

#[test]
fn use_orig_params_checkpoint_loads_into_flat_wrapping_at_another_world_size() {
    let model = common::nested_model();
    let full = full_adam(&model, 5.0);
    let orig = common::wrap(false).with_orig_params(true);
    let root = tmp();
    let dir = root.path().join("ckpt");
    for r in save_at(&model, &orig, 4, &full, &dir, &SaveOptions::default()) {
        r.unwrap();
    }
    // The checkpoint's full dict is what full_optim_state_dict returns under use_orig_params
    // (state names in that consolidated order); loads equal shard_full of it.
    let consolidated = load_full(&dir, &LoadOptions::default()).unwrap();
    common::assert_same_state(&consolidated, &full, "load_full");
    for (policy, ws) in [(common::wrap_alt(), 3), (orig.clone(), 2), (orig, 5)] {
        for (rank, (loaded, expected)) in load_at(&model, &policy, ws, &consolidated, &dir)
            .iter()
            .enumerate()
        {
            assert_identical(loaded, expected, &format!("ws {ws}, rank {rank}"));
        }
    }
}

/// Saves `full_adam(steps)` of the nested model at 2 ranks into `dir`.
fn save_steps(dir: &Path, steps: f32, opts: &SaveOptions) -> Vec<fsdp::Result<()>> {
    let model = common::nested_model();
    save_at(
        &model,
        &common::wrap(false),
        2,
        &full_adam(&model, steps),
        dir,
        opts,
    )
}

fn leftovers(parent: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(".tmp-"))
        .collect()
}

#[test]
fn a_crash_at_any_stage_leaves_the_previous_checkpoint_loadable_bit_exact() {
    let model = common::nested_model();
    for point in [
        CrashPoint::BeforeData,
        CrashPoint::MidFile,
        CrashPoint::BeforeManifest,
        CrashPoint::BeforeCommit,
    ] {
        let root = tmp();
        let dir = root.path().join("ckpt");
        for r in save_steps(&dir, 1.0, &SaveOptions::default()) {
            r.unwrap();
        }
        let crashed = save_steps(&dir, 2.0, &SaveOptions::default().crash_at(Some(point)));
        for (rank, r) in crashed.into_iter().enumerate() {
            let err = r.expect_err("the injected crash fails the save");
            assert!(
                matches!(&err, Error::InjectedCrash { point: p } if *p == format!("{point:?}")),
                "{point:?}, rank {rank}: {err:?}"
            );
        }
        // The old checkpoint is intact and complete.
        verify(&dir).unwrap();
        let back = load_full(&dir, &LoadOptions::default()).unwrap();
        common::assert_same_state(&back, &full_adam(&model, 1.0), &format!("{point:?}"));
        // The partial one is left behind as a crashed process would, and is not a checkpoint.
        let partial = leftovers(root.path());
        assert_eq!(partial.len(), 1, "{point:?}: {partial:?}");
        let err = read_manifest(&partial[0]).unwrap_err();
        assert!(
            matches!(err, Error::CheckpointInvalid { .. }),
            "{point:?}: {err:?}"
        );
        // The next save succeeds and replaces the old one.
        for r in save_steps(&dir, 3.0, &SaveOptions::default()) {
            r.unwrap();
        }
        let back = load_full(&dir, &LoadOptions::default()).unwrap();
        common::assert_same_state(&back, &full_adam(&model, 3.0), "after recovery");
    }
}

#[test]
fn a_reshard_crashing_at_any_stage_leaves_the_previous_target_loadable_bit_exact() {
    let model = common::nested_model();
    let root = tmp();
    let (src, dst) = (root.path().join("src"), root.path().join("dst"));
    for r in save_at(
        &model,
        &common::wrap(false),
        4,
        &full_adam(&model, 5.0),
        &src,
        &SaveOptions::default(),
    ) {
        r.unwrap();
    }
    // The previous target: another state, at world size 2.
    for r in save_at(
        &model,
        &common::wrap(false),
        2,
        &full_adam(&model, 1.0),
        &dst,
        &SaveOptions::default(),
    ) {
        r.unwrap();
    }
    for point in [
        CrashPoint::BeforeData,
        CrashPoint::MidFile,
        CrashPoint::BeforeManifest,
        CrashPoint::BeforeCommit,
    ] {
        let opts = SaveOptions::default().crash_at(Some(point));
        let err = checkpoint::reshard_with(
            &src,
            &dst,
            3,
            Some(&common::wrap_alt()),
            &opts,
            &Solo,
            |_| {},
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::InjectedCrash { point: p } if *p == format!("{point:?}")),
            "{point:?}: {err:?}"
        );
        verify(&dst).unwrap();
        common::assert_same_state(
            &load_full(&dst, &LoadOptions::default()).unwrap(),
            &full_adam(&model, 1.0),
            &format!("{point:?}"),
        );
        assert_eq!(read_manifest(&dst).unwrap().world_size, 2);
        let partial = leftovers(root.path());
        assert_eq!(partial.len(), 1, "{point:?}: {partial:?}");
        assert!(matches!(
            read_manifest(&partial[0]),
            Err(Error::CheckpointInvalid { .. })
        ));
        std::fs::remove_dir_all(&partial[0]).unwrap();
    }
    // Without a crash the rewrite replaces the target.
    checkpoint::reshard(&src, &dst, 3, Some(&common::wrap_alt()), &Solo, |_| {}).unwrap();
    common::assert_same_state(
        &load_full(&dst, &LoadOptions::default()).unwrap(),
        &full_adam(&model, 5.0),
        "after the reshard",
    );
}

#[test]
fn overwriting_a_checkpoint_leaves_no_temporary_directory() {
    let root = tmp();
    let dir = root.path().join("ckpt");
    for steps in [1.0, 2.0, 3.0] {
        for r in save_steps(&dir, steps, &SaveOptions::default()) {
            r.unwrap();
        }
        assert!(leftovers(root.path()).is_empty());
    }
    let model = common::nested_model();
    let back = load_full(&dir, &LoadOptions::default()).unwrap();
    common::assert_same_state(&back, &full_adam(&model, 3.0), "last save wins");
}

/// A fresh 2-rank checkpoint and the path of rank 1's data file.
fn saved() -> (tempfile::TempDir, PathBuf) {
    let root = tmp();
    let dir = root.path().join("ckpt");
    for r in save_steps(&dir, 1.0, &SaveOptions::default()) {
        r.unwrap();
    }
    (root, dir)
}

fn load_rank0(dir: &Path) -> fsdp::Result<OptimStateDict> {
    let model = common::nested_model();
    let mut out = ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        fsdp.load_optim_checkpoint(dir, &fsdp.optim_params(), &LoadOptions::default())
    });
    out.pop().unwrap()
}

#[test]
fn a_flipped_bit_in_any_data_byte_is_caught_naming_file_rank_and_tensor() {
    let (_root, dir) = saved();
    let file = dir.join("rank1.safetensors");
    let original = std::fs::read(&file).unwrap();
    let manifest = read_manifest(&dir).unwrap();
    let header = manifest.files[1].header_len as usize;
    // Every data byte of a small file: a flip anywhere is caught by load and by verify.
    for at in (0..original.len()).step_by(7) {
        let mut bytes = original.clone();
        bytes[at] ^= 0x10;
        std::fs::write(&file, &bytes).unwrap();
        let err = load_rank0(&dir).unwrap_err();
        let Error::CheckpointCorrupt {
            file: f,
            rank,
            tensor,
            reason,
        } = &err
        else {
            panic!("byte {at}: expected CheckpointCorrupt, got {err:?}");
        };
        assert!(f.ends_with("rank1.safetensors") && *rank == 1, "{err}");
        if at < header {
            assert!(reason.contains("header"), "byte {at}: {err}");
        } else {
            assert!(
                reason.contains("checksum") && tensor.contains('/'),
                "byte {at}: {err}"
            );
        }
        assert!(matches!(
            verify(&dir),
            Err(Error::CheckpointCorrupt { rank: 1, .. })
        ));
    }
    std::fs::write(&file, &original).unwrap();
    assert!(verify(&dir).unwrap() > 0);
}

#[test]
fn truncated_or_missing_files_and_a_damaged_manifest_are_rejected() {
    let (_root, dir) = saved();
    let file = dir.join("rank0.safetensors");
    let original = std::fs::read(&file).unwrap();
    for len in [0, 8, original.len() / 2, original.len() - 1] {
        std::fs::write(&file, &original[..len]).unwrap();
        let err = load_rank0(&dir).unwrap_err();
        assert!(
            matches!(&err, Error::CheckpointCorrupt { rank: 0, reason, .. } if reason.contains("truncated")),
            "length {len}: {err:?}"
        );
    }
    std::fs::remove_file(&file).unwrap();
    let err = load_rank0(&dir).unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointCorrupt { rank: 0, reason, .. } if reason.contains("cannot open")),
        "{err:?}"
    );
    std::fs::write(&file, &original).unwrap();
    load_rank0(&dir).unwrap();

    let manifest = std::fs::read(dir.join(MANIFEST)).unwrap();
    for at in [0, manifest.len() / 3, manifest.len() - 2] {
        let mut m = manifest.clone();
        m[at] ^= 0x01;
        std::fs::write(dir.join(MANIFEST), &m).unwrap();
        let err = load_rank0(&dir).unwrap_err();
        assert!(
            matches!(&err, Error::CheckpointInvalid { reason, .. } if reason.contains("commit marker")),
            "{err:?}"
        );
    }
    std::fs::write(dir.join(MANIFEST), &manifest).unwrap();
    std::fs::remove_file(dir.join(COMMIT)).unwrap();
    let err = load_rank0(&dir).unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointInvalid { reason, .. } if reason.contains("never completed")),
        "{err:?}"
    );
}

#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_parameter() {
    let (_root, dir) = saved();
    // Missing a parameter the checkpoint has state for.
    let smaller = ModelDesc::new().param("bias", &[5], DType::F32).param(
        "block0.weight",
        &[5, 3],
        DType::F32,
    );
    let out = ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(&smaller, &WrapPolicy::units(&["block0"]), Arc::new(pg)).unwrap();
        fsdp.load_optim_checkpoint::<HostTensor>(
            &dir,
            &fsdp.optim_params(),
            &LoadOptions::default(),
        )
        .unwrap_err()
    });
    let err = &out[0];
    assert!(
        matches!(err, Error::CheckpointMismatch { reason, .. } if reason.contains("block0.bias_module0.bias")),
        "{err:?}"
    );
    // A parameter with another shape.
    let mut model = common::nested_model();
    model.params[0].shape = vec![6];
    let out = ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        fsdp.load_optim_checkpoint::<HostTensor>(
            &dir,
            &fsdp.optim_params(),
            &LoadOptions::default(),
        )
        .unwrap_err()
    });
    assert!(
        matches!(&out[0], Error::ShapeMismatch { context, .. } if context.contains("`bias`")),
        "{:?}",
        out[0]
    );
    // The manifest records what was saved.
    let m = checkpoint::read_manifest(&dir).unwrap();
    assert_eq!((m.world_size, m.files.len()), (2, 2));
}

#[test]
fn offline_reshard_to_another_world_size_and_wrapping_loads_like_shard_full() {
    let model = common::nested_model();
    let full = full_adam(&model, 4.0);
    let root = tmp();
    let (src, dst) = (root.path().join("ws8"), root.path().join("ws3"));
    for r in save_at(
        &model,
        &common::wrap(false),
        8,
        &full,
        &src,
        &SaveOptions::default(),
    ) {
        r.unwrap();
    }
    let mut reported = 0;
    let copied = checkpoint::reshard(&src, &dst, 3, Some(&common::wrap_alt()), &Solo, |b| {
        reported = b
    })
    .unwrap();
    // Every positive-dim tensor state byte (0-dim `step`s live in the manifest).
    let tensor_bytes: usize = full
        .state
        .values()
        .flat_map(|st| st.values())
        .filter_map(|v| v.as_tensor().filter(|t| t.dim() > 0))
        .map(HostTensor::nbytes)
        .sum();
    assert_eq!(copied, tensor_bytes as u64);
    assert_eq!(reported, copied);
    let m = read_manifest(&dst).unwrap();
    assert_eq!((m.world_size, m.files.len()), (3, 3));
    assert_eq!(m.policy, common::wrap_alt());
    assert_eq!(verify(&dst).unwrap(), copied);
    for (rank, (loaded, expected)) in load_at(&model, &common::wrap_alt(), 3, &full, &dst)
        .iter()
        .enumerate()
    {
        assert_identical(loaded, expected, &format!("resharded, rank {rank}"));
    }
    // Each new rank's file holds about a third of the state (padding is never stored).
    let sizes: Vec<u64> = m.files.iter().map(|f| f.len - f.header_len).collect();
    assert_eq!(sizes.iter().sum::<u64>(), copied);
    // The source is untouched and still loads.
    common::assert_same_state(
        &load_full(&src, &LoadOptions::default()).unwrap(),
        &full,
        "src",
    );
    // Resharding into an existing checkpoint replaces it atomically.
    checkpoint::reshard(&src, &dst, 2, None, &Solo, |_| {}).unwrap();
    assert_eq!(read_manifest(&dst).unwrap().world_size, 2);
    assert!(leftovers(root.path()).is_empty());
}

#[test]
fn streaming_consolidation_writes_the_full_dict_as_safetensors() {
    for (model, policy) in [
        (common::nested_model(), common::wrap(true)),
        (
            common::nested_model(),
            common::wrap(false).with_orig_params(true),
        ),
        (common::transformer_model(), common::transformer_policy()),
    ] {
        let full = full_adam(&model, 6.0);
        let root = tmp();
        let dir = root.path().join("ckpt");
        for r in save_at(&model, &policy, 3, &full, &dir, &SaveOptions::default()) {
            r.unwrap();
        }
        let out = root.path().join("full.safetensors");
        let written = conversions::checkpoint_to_safetensors(&dir, &out, &Solo, |_| {}).unwrap();
        assert!(written > 0);
        let streamed = fsdp::io::safetensors::load_optim_state_dict(&out).unwrap();
        let in_memory = load_full(&dir, &LoadOptions::default()).unwrap();
        assert_identical(&streamed, &in_memory, "streamed vs in memory");
        common::assert_same_state(&streamed, &full, "streamed vs saved");
    }
}

#[test]
fn streaming_consolidation_to_torch_save_is_byte_identical_to_the_in_memory_file() {
    for (model, policy, ws) in [
        (common::nested_model(), common::wrap(true), 3),
        (
            common::nested_model(),
            common::wrap(false).with_orig_params(true),
            2,
        ),
        (common::transformer_model(), common::transformer_policy(), 4),
    ] {
        let full = full_adam(&model, 6.0);
        let root = tmp();
        let dir = root.path().join("ckpt");
        for r in save_at(&model, &policy, ws, &full, &dir, &SaveOptions::default()) {
            r.unwrap();
        }
        // Same file name (the archive folder inside is named after it), two directories.
        let (streamed, in_memory) = (root.path().join("a"), root.path().join("b"));
        std::fs::create_dir_all(&streamed).unwrap();
        std::fs::create_dir_all(&in_memory).unwrap();
        let (streamed, in_memory) = (streamed.join("full.pt"), in_memory.join("full.pt"));
        let mut reported = 0;
        let written =
            conversions::checkpoint_to_torch_save(&dir, &streamed, &Solo, |b| reported = b)
                .unwrap();
        let m = read_manifest(&dir).unwrap();
        assert_eq!((written, reported), (m.tensor_bytes(), m.tensor_bytes()));
        fsdp::io::torch_save::save_optim_state_dict(
            &load_full(&dir, &LoadOptions::default()).unwrap(),
            &in_memory,
        )
        .unwrap();
        assert!(
            std::fs::read(&streamed).unwrap() == std::fs::read(&in_memory).unwrap(),
            "streamed and in-memory torch.save files differ"
        );
        common::assert_same_state(
            &fsdp::io::torch_save::load_optim_state_dict(&streamed).unwrap(),
            &full,
            "streamed .pt vs saved",
        );
    }
}

#[test]
fn streaming_consolidation_to_torch_save_names_a_corrupt_block_and_leaves_no_file() {
    let (root, dir) = saved();
    let m = read_manifest(&dir).unwrap();
    let file = dir.join(&m.files[1].name);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = m.files[1].header_len as usize + 5;
    bytes[at] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let out = root.path().join("full.pt");
    let err = conversions::checkpoint_to_torch_save(&dir, &out, &Solo, |_| {}).unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointCorrupt { rank: 1, tensor, .. } if tensor.contains('/')),
        "{err}"
    );
    assert!(!out.exists());
    let left: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("full.pt"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

// ----- offline tools split across processes -----

/// Each process's outcome of a run over thread "processes", all required to succeed.
fn all_ok(results: Vec<fsdp::Result<u64>>) -> Vec<u64> {
    results.into_iter().map(Result::unwrap).collect()
}

#[test]
fn reshard_and_consolidation_split_across_3_processes_write_the_single_process_bytes() {
    let (root, src) = saved();
    let alt = common::wrap_alt();
    let alone = root.path().join("alone");
    let split = root.path().join("split");
    let copied = checkpoint::reshard(&src, &alone, 3, Some(&alt), &Solo, |_| {}).unwrap();
    let each = all_ok(ThreadGroup::run(3, |pg| {
        checkpoint::reshard(&src, &split, 3, Some(&alt), &pg, |_| {})
    }));
    assert_eq!(
        each, [copied; 3],
        "every process reports the bytes all copied"
    );
    assert!(contents(&alone) == contents(&split), "the same directory");

    // Same file name in two directories: the comparison is of the bytes alone.
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    let written =
        conversions::checkpoint_to_safetensors(&split, &a.join("full.safetensors"), &Solo, |_| {})
            .unwrap();
    let each = all_ok(ThreadGroup::run(3, |pg| {
        conversions::checkpoint_to_safetensors(&split, &b.join("full.safetensors"), &pg, |_| {})
    }));
    assert_eq!(each, [written; 3]);
    assert!(contents(&a) == contents(&b), "the same .safetensors file");
}

#[test]
fn torch_save_consolidation_split_across_1_to_5_processes_writes_the_single_process_bytes() {
    // 2 → 3 ranks under another wrapping: states of uneven sizes, some split by ranks; at 5
    // processes some write no storage at all.
    let (root, src) = saved();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    let alone = a.join("full.pt");
    let written = conversions::checkpoint_to_torch_save(&src, &alone, &Solo, |_| {}).unwrap();
    let expected = std::fs::read(&alone).unwrap();
    for ws in 1..=5 {
        let split = b.join("full.pt");
        let each = all_ok(ThreadGroup::run(ws, |pg| {
            conversions::checkpoint_to_torch_save(&src, &split, &pg, |_| {})
        }));
        assert_eq!(each, vec![written; ws], "{ws} processes");
        assert!(
            std::fs::read(&split).unwrap() == expected,
            "{ws} processes: not the single-process file"
        );
        std::fs::remove_file(&split).unwrap();
    }
}

#[test]
fn conversion_to_dcp_streams_what_the_in_memory_writer_wrote_and_splits_across_1_to_4_processes() {
    // The nested model's Adam state at 8 ranks: the DCP directory of its full dict, written
    // from the loaded dict (in memory), streamed from the checkpoint, and by N processes.
    let (root, src) = saved();
    let data = |dir: &Path| std::fs::read(dir.join("__0_0.distcp")).unwrap();
    let loaded = |dir: &Path| {
        fsdp::io::dcp::DcpCheckpoint::open(dir)
            .unwrap()
            .load()
            .unwrap()
    };
    let in_memory = root.path().join("in-memory");
    let full = checkpoint::load_full(&src, &Default::default()).unwrap();
    let obj = fsdp::io::torch_save::optim_to_pyobj(&full).unwrap();
    fsdp::io::dcp::save_dcp(&obj, &in_memory).unwrap();
    let streamed = root.path().join("streamed");
    let written = conversions::checkpoint_to_dcp(&src, &streamed, &Solo, |_| {}).unwrap();
    assert_eq!(written, full.tensor_bytes() as u64);
    assert!(data(&streamed) == data(&in_memory), "the same data file");
    assert!(
        loaded(&streamed).bit_eq(&obj),
        "dcp.load gives the full dict"
    );
    for ws in 1..=4 {
        let split = root.path().join(format!("split{ws}"));
        let each = all_ok(ThreadGroup::run(ws, |pg| {
            conversions::checkpoint_to_dcp(&src, &split, &pg, |_| {})
        }));
        assert_eq!(each, vec![written; ws], "{ws} processes");
        assert!(
            data(&split) == data(&in_memory),
            "{ws} processes: the data file"
        );
        assert!(loaded(&split).bit_eq(&obj), "{ws} processes: the dict");
        let mut names: Vec<String> = std::fs::read_dir(&split)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".metadata", "__0_0.distcp"]);
    }
}

#[test]
fn a_corrupt_block_fails_every_process_with_the_single_process_error_and_leaves_no_output() {
    // The end of input rank 1's file: at 2 processes and the same layout, process 1 reads it
    // for output rank 1.
    let (root, src) = saved();
    let file = src.join("rank1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let out = root.path().join("out");
    let alone = checkpoint::reshard(&src, &out, 2, None, &Solo, |_| {}).unwrap_err();
    assert!(matches!(alone, Error::CheckpointCorrupt { .. }), "{alone}");
    for e in ThreadGroup::run(2, |pg| {
        checkpoint::reshard(&src, &out, 2, None, &pg, |_| {})
    }) {
        assert_eq!(e.unwrap_err(), alone);
    }
    let full = root.path().join("full.safetensors");
    let alone = conversions::checkpoint_to_safetensors(&src, &full, &Solo, |_| {}).unwrap_err();
    for e in ThreadGroup::run(2, |pg| {
        conversions::checkpoint_to_safetensors(&src, &full, &pg, |_| {})
    }) {
        assert_eq!(e.unwrap_err(), alone);
    }
    let full = root.path().join("full.pt");
    let alone = conversions::checkpoint_to_torch_save(&src, &full, &Solo, |_| {}).unwrap_err();
    for e in ThreadGroup::run(2, |pg| {
        conversions::checkpoint_to_torch_save(&src, &full, &pg, |_| {})
    }) {
        assert_eq!(e.unwrap_err(), alone);
    }
    let dcp = root.path().join("dcp");
    let alone = conversions::checkpoint_to_dcp(&src, &dcp, &Solo, |_| {}).unwrap_err();
    for e in ThreadGroup::run(2, |pg| {
        conversions::checkpoint_to_dcp(&src, &dcp, &pg, |_| {})
    }) {
        assert_eq!(e.unwrap_err(), alone);
    }
    let left: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["ckpt"], "no output and no temporary");
}

// ----- background saves -----

use fsdp::checkpoint::{BackgroundSaver, SaveMode};

/// The data files and manifest of a checkpoint, for byte comparison.
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_background_save_writes_the_same_bytes_as_a_foreground_save_while_training_goes_on() {
    let model = common::nested_model();
    let full = full_adam(&model, 2.0);
    let root = tmp();
    let (fg, bg) = (root.path().join("fg"), root.path().join("bg"));
    ThreadGroup::run(3, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let mut local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.save_optim_checkpoint(&local, &params, &fg, &SaveOptions::default())
            .unwrap();
        let mut saver = BackgroundSaver::new(1 << 30);
        assert_eq!(
            saver.save(&fsdp, &local, &params, &bg).unwrap(),
            SaveMode::Background
        );
        // Training goes on: the local state changes while the save is written.
        for st in local.state.values_mut() {
            for v in st.values_mut() {
                if let Value::Tensor(t) = v {
                    for b in t.bytes_mut() {
                        *b = 0xAB;
                    }
                }
            }
        }
        saver.wait().unwrap();
    });
    assert_eq!(contents(&fg), contents(&bg));
    common::assert_same_state(
        &load_full(&bg, &LoadOptions::default()).unwrap(),
        &full,
        "bg",
    );
    assert!(leftovers(root.path()).is_empty());
}

#[test]
fn a_background_save_with_parameters_equals_the_foreground_one_while_parameters_change() {
    let model = common::nested_model();
    let full = full_adam(&model, 2.0);
    let values = synthetic_params(&ModelLayout::new(&model, &common::wrap(false), 1).unwrap());
    let root = tmp();
    let (fg, bg) = (root.path().join("fg"), root.path().join("bg"));
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        let mut shards = shard_tensors(fsdp.layout(), fsdp.rank(), &params, &values).unwrap();
        fsdp.save_checkpoint(&local, &params, &shards, &fg, &SaveOptions::default())
            .unwrap();
        let mut saver = BackgroundSaver::new(1 << 30);
        assert_eq!(
            saver
                .save_checkpoint(&fsdp, &local, &params, &shards, &bg)
                .unwrap(),
            SaveMode::Background
        );
        // The optimizer steps the parameters while the save is written.
        for t in shards.iter_mut().flatten() {
            for b in t.bytes_mut() {
                *b = 0xCD;
            }
        }
        saver.wait().unwrap();
    });
    assert_eq!(contents(&fg), contents(&bg));
    assert_eq!(
        read_manifest(&bg).unwrap().model_params.len(),
        model.params.len()
    );
    // A cap below the state makes every rank save in the foreground, parameters included.
    let small = root.path().join("small");
    let modes = ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        let shards = shard_tensors(fsdp.layout(), fsdp.rank(), &params, &values).unwrap();
        BackgroundSaver::new(16)
            .save_checkpoint(&fsdp, &local, &params, &shards, &small)
            .unwrap()
    });
    assert_eq!(modes, [SaveMode::Foreground; 2]);
    assert_eq!(contents(&small), contents(&fg));
}

#[test]
fn consecutive_background_saves_wait_for_each_other_and_the_last_one_wins() {
    let model = common::nested_model();
    let root = tmp();
    let dir = root.path().join("ckpt");
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap_alt(), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let mut saver = BackgroundSaver::new(1 << 30);
        for steps in 1..=4 {
            let local = fsdp
                .shard_full_optim_state_dict(&full_adam(&model, steps as f32), &params)
                .unwrap();
            assert_eq!(
                saver.save(&fsdp, &local, &params, &dir).unwrap(),
                SaveMode::Background
            );
        }
        saver.wait().unwrap();
    });
    common::assert_same_state(
        &load_full(&dir, &LoadOptions::default()).unwrap(),
        &full_adam(&model, 4.0),
        "last save",
    );
    assert!(leftovers(root.path()).is_empty());
}

#[test]
fn state_over_the_staging_cap_is_saved_in_the_foreground_on_every_rank() {
    let model = common::nested_model();
    let full = full_adam(&model, 9.0);
    let root = tmp();
    let dir = root.path().join("ckpt");
    let modes = ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        // A cap below rank 0's state but above rank 1's: both ranks fall back together.
        let mut saver = BackgroundSaver::new(if fsdp.rank() == 0 { 16 } else { 1 << 30 });
        let mode = saver.save(&fsdp, &local, &params, &dir).unwrap();
        // Committed when a foreground save returns.
        assert!(read_manifest(&dir).is_ok());
        mode
    });
    assert_eq!(modes, vec![SaveMode::Foreground; 2]);
    common::assert_same_state(
        &load_full(&dir, &LoadOptions::default()).unwrap(),
        &full,
        "fg",
    );
}

#[test]
fn pieces_of_several_checksum_blocks_reshard_load_and_consolidate_bit_exact() {
    // Pieces of 5.5 MB at world size 3: several 4 MiB checksum blocks each, and ranges that
    // start and end inside blocks when read at other world sizes and wrappings.
    let model = ModelDesc::new()
        .param("a.weight", &[4000, 1024], DType::F32)
        .param("a.bias", &[4000], DType::F32)
        .param("b.weight", &[1500, 1024], DType::F32);
    let (policy, alt) = (
        WrapPolicy::units(&["a", "b"]),
        WrapPolicy::units(&["b", ""]),
    );
    let full = full_adam(&model, 2.0);
    let root = tmp();
    let (src, dst) = (root.path().join("ws3"), root.path().join("ws2"));
    for r in save_at(&model, &policy, 3, &full, &src, &SaveOptions::default()) {
        r.unwrap();
    }
    for (rank, (loaded, expected)) in load_at(&model, &alt, 5, &full, &src).iter().enumerate() {
        assert_identical(loaded, expected, &format!("loaded at 5, rank {rank}"));
    }
    let copied = checkpoint::reshard(&src, &dst, 2, Some(&alt), &Solo, |_| {}).unwrap();
    assert_eq!(verify(&dst).unwrap(), copied);
    for (rank, (loaded, expected)) in load_at(&model, &alt, 2, &full, &dst).iter().enumerate() {
        assert_identical(loaded, expected, &format!("resharded, rank {rank}"));
    }
    let out = root.path().join("full.safetensors");
    for dir in [&src, &dst] {
        conversions::checkpoint_to_safetensors(dir, &out, &Solo, |_| {}).unwrap();
        let streamed = fsdp::io::safetensors::load_optim_state_dict(&out).unwrap();
        common::assert_same_state(&streamed, &full, "streamed vs saved");
    }
}

// ----- model parameters in the checkpoint -----

/// Every rank of a `world_size` group saves optimizer state and its parameter shards, cut
/// from the full values `values` as training would hold them.
fn save_with_params_at(
    model: &ModelDesc,
    policy: &WrapPolicy,
    world_size: usize,
    full: &OptimStateDict,
    values: &[Option<HostTensor>],
    dir: &Path,
) {
    for r in ThreadGroup::run(world_size, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(full, &params)?;
        let shards = shard_tensors(fsdp.layout(), fsdp.rank(), &params, values)?;
        fsdp.save_checkpoint(&local, &params, &shards, dir, &SaveOptions::default())
    }) {
        r.unwrap();
    }
}

/// Each rank's parameter tensors loaded from `dir`, and what `shard_tensors(values)` gives it.
type Shards = Vec<Option<HostTensor>>;
fn load_params_at(
    model: &ModelDesc,
    policy: &WrapPolicy,
    world_size: usize,
    values: &[Option<HostTensor>],
    dir: &Path,
) -> Vec<(Shards, Shards)> {
    ThreadGroup::run(world_size, |pg| {
        let fsdp = Fsdp::new(model, policy, Arc::new(pg)).unwrap();
        let loaded: Shards = fsdp
            .load_model_params(dir, &LoadOptions::default())
            .unwrap_or_else(|e| panic!("rank {}: {e}", fsdp.rank()));
        let expected =
            shard_tensors(fsdp.layout(), fsdp.rank(), &fsdp.optim_params(), values).unwrap();
        (loaded, expected)
    })
}

#[track_caller]
fn assert_same_shards(loaded: &Shards, expected: &Shards, what: &str) {
    assert_eq!(loaded.len(), expected.len(), "{what}: count");
    for (i, (a, b)) in loaded.iter().zip(expected).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) => assert!(a.bit_eq(b), "{what}: param {i}: {a:?} vs {b:?}"),
            (None, None) => {}
            _ => panic!("{what}: param {i}: loaded {a:?}, expected {b:?}"),
        }
    }
}

#[test]
fn parameters_saved_at_4_load_at_3_and_1_with_another_wrapping_like_shard_tensors() {
    // Nested model, with an ignored module (unmanaged parameters are whole on every rank).
    let model = common::nested_model();
    let values = synthetic_params(&ModelLayout::new(&model, &common::wrap(true), 1).unwrap());
    let full = full_adam(&model, 3.0);
    let root = tmp();
    let dir = root.path().join("ckpt");
    save_with_params_at(&model, &common::wrap(true), 4, &full, &values, &dir);
    let m = read_manifest(&dir).unwrap();
    assert_eq!(m.model_params.len(), model.params.len());
    let param_bytes: u64 = model.params.iter().map(|p| (p.numel() * 4) as u64).sum();
    assert_eq!(
        m.model_param_bytes(),
        param_bytes,
        "padding is never stored"
    );
    for (ws, policy) in [
        (3, common::wrap_alt()),
        (1, common::wrap(false)),
        (5, common::wrap(true)),
    ] {
        for (rank, (loaded, expected)) in load_params_at(&model, &policy, ws, &values, &dir)
            .iter()
            .enumerate()
        {
            assert_same_shards(loaded, expected, &format!("ws {ws} rank {rank}"));
        }
    }
    // The optimizer state beside them is unaffected: it loads and consolidates as before.
    common::assert_same_state(
        &load_full(&dir, &LoadOptions::default()).unwrap(),
        &full,
        "full",
    );
    for (rank, (loaded, expected)) in load_at(&model, &common::wrap_alt(), 3, &full, &dir)
        .iter()
        .enumerate()
    {
        assert_identical(loaded, expected, &format!("optimizer state, rank {rank}"));
    }
    // verify checks the parameter bytes too.
    assert_eq!(verify(&dir).unwrap(), m.tensor_bytes() + param_bytes);
}

#[test]
fn use_orig_params_parameters_load_into_a_flat_wrapping_after_an_offline_reshard() {
    let model = common::nested_model();
    let orig = common::wrap(false).with_orig_params(true);
    let values = synthetic_params(&ModelLayout::new(&model, &orig, 1).unwrap());
    let full = full_adam(&model, 2.0);
    let root = tmp();
    let (src, dst) = (root.path().join("ws2"), root.path().join("ws3"));
    save_with_params_at(&model, &orig, 2, &full, &values, &src);
    for (rank, (loaded, expected)) in load_params_at(&model, &common::wrap_alt(), 2, &values, &src)
        .iter()
        .enumerate()
    {
        assert_same_shards(loaded, expected, &format!("direct, rank {rank}"));
    }
    let copied =
        checkpoint::reshard(&src, &dst, 3, Some(&common::wrap_alt()), &Solo, |_| {}).unwrap();
    let m = read_manifest(&dst).unwrap();
    assert_eq!(copied, m.tensor_bytes() + m.model_param_bytes());
    for (rank, (loaded, expected)) in load_params_at(&model, &common::wrap_alt(), 3, &values, &dst)
        .iter()
        .enumerate()
    {
        assert_same_shards(loaded, expected, &format!("resharded, rank {rank}"));
    }
}

#[test]
fn an_optimizer_only_checkpoint_has_no_parameters_to_load() {
    let (_root, dir) = saved();
    let model = common::nested_model();
    let out = ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        fsdp.load_model_params::<HostTensor>(&dir, &LoadOptions::default())
    });
    let err = out.into_iter().next().unwrap().unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointMismatch { reason, .. } if reason.contains("save_checkpoint")),
        "{err}"
    );
}

#[test]
fn a_wrong_number_of_parameter_tensors_fails_every_rank_and_keeps_the_old_checkpoint() {
    let (root, dir) = saved();
    let before = contents(&dir);
    let model = common::nested_model();
    let out = ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full_adam(&model, 9.0), &params)?;
        let shards = vec![None; 2];
        fsdp.save_checkpoint(&local, &params, &shards, &dir, &SaveOptions::default())
    });
    for r in out {
        let err = r.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { op, reason, .. }
                if op == "save_checkpoint" && reason.starts_with("2 model parameter tensors given")),
            "{err}"
        );
    }
    assert_eq!(contents(&dir), before);
    assert!(leftovers(root.path()).is_empty());
}

#[test]
fn a_flipped_byte_in_a_parameter_piece_is_caught_naming_the_parameter() {
    let model = common::nested_model();
    let values = synthetic_params(&ModelLayout::new(&model, &common::wrap(false), 1).unwrap());
    let root = tmp();
    let dir = root.path().join("ckpt");
    save_with_params_at(
        &model,
        &common::wrap(false),
        2,
        &full_adam(&model, 1.0),
        &values,
        &dir,
    );
    let m = read_manifest(&dir).unwrap();
    let rec = m
        .model_params
        .iter()
        .find(|r| r.name == "block1.weight")
        .unwrap();
    let checkpoint::StoredValue::Tensor { pieces, .. } = &rec.states[0].1 else {
        panic!("a weight is stored as pieces");
    };
    let piece = &pieces[0];
    let file = dir.join(&m.files[piece.file].name);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[piece.offset as usize + 3] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let out = ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        fsdp.load_model_params::<HostTensor>(&dir, &LoadOptions::default())
    });
    let err = out.into_iter().next().unwrap().unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointCorrupt { tensor, rank, .. } if tensor.contains("block1.weight") && *rank == piece.file),
        "{err}"
    );
    assert!(matches!(verify(&dir), Err(Error::CheckpointCorrupt { .. })));
    // Optimizer state does not share those bytes, so it still loads.
    load_rank0(&dir).unwrap();
}

/// Bytes of `path` in the page cache (`mincore` over a read-only mapping).
fn cached_bytes(path: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0;
    }
    // SAFETY: plain sysconf query.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: a read-only shared mapping of an open file, unmapped below; mincore writes one
    // byte per page into `vec`, which has that many.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        assert_eq!(libc::mincore(p, len, vec.as_mut_ptr()), 0);
        libc::munmap(p, len);
    }
    (vec.iter().filter(|&&b| b & 1 != 0).count() * page) as u64
}

/// Whether the filesystem under `dir` drops clean pages on `POSIX_FADV_DONTNEED` (tmpfs
/// cannot: its pages are the file).
fn drops_clean_pages(dir: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let probe = dir.join("probe");
    std::fs::write(&probe, vec![1u8; 1 << 20]).unwrap();
    let f = std::fs::File::open(&probe).unwrap();
    f.sync_all().unwrap();
    // SAFETY: a valid open descriptor; advice only.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let dropped = cached_bytes(&probe) == 0;
    std::fs::remove_file(&probe).unwrap();
    dropped
}

#[test]
fn offline_consolidation_reshard_and_verify_leave_neither_input_nor_output_in_the_page_cache() {
    // World size 2, one unit of a [4096, 4096] weight: 128 MiB of Adam state, 64 MiB per rank
    // file, so reads cross the 2 MiB folios the readers drop to, and the output spans four of
    // the 32 MiB chunks its writer retires.
    const MIB: u64 = 1 << 20;
    // What may stay cached of an input: the partial 2 MiB folios where a reader's run of
    // reads jumps (without drop-behind, all 64 MiB stay).
    const LEFT: u64 = 4 * MIB;
    let model = ModelDesc::new().param("w", &[4096, 4096], DType::F32);
    let policy = WrapPolicy::units(&[""]);
    let full = full_adam(&model, 1.0);
    let root = tmp();
    let dir = root.path().join("ckpt");
    for r in save_at(&model, &policy, 2, &full, &dir, &SaveOptions::default()) {
        r.unwrap();
    }
    let inputs = [dir.join("rank0.safetensors"), dir.join("rank1.safetensors")];
    let out = root.path().join("full.safetensors");
    conversions::checkpoint_to_safetensors(&dir, &out, &Solo, |_| {}).unwrap();
    let drops = drops_clean_pages(root.path());
    if drops {
        for input in &inputs {
            let cached = cached_bytes(input);
            assert!(
                cached <= LEFT,
                "{cached} bytes of {} stayed cached",
                input.display()
            );
        }
        // The chunk still in flight, the last bytes and partial folios at most: not 128 MiB.
        let cached = cached_bytes(&out);
        assert!(
            cached <= 80 * MIB,
            "{cached} bytes of the output stayed cached"
        );
    } else {
        eprintln!("this filesystem keeps dropped pages (tmpfs?): only the bytes are checked");
    }
    let streamed = fsdp::io::safetensors::load_optim_state_dict(&out).unwrap();
    common::assert_same_state(&streamed, &full, "consolidated through drop-behind");

    // Rank 0's file pulled back into the page cache: verify reads it once more and drops it.
    std::fs::read(&inputs[0]).unwrap();
    assert_eq!(verify(&dir).unwrap(), 128 * MIB);
    if drops {
        assert!(
            cached_bytes(&inputs[0]) <= LEFT,
            "verify left its input cached"
        );
    }

    // Resharded 2 -> 3: the checksum block around each old shard's 2/3 point is read by two
    // new ranks; it stays cached until the second has read it, then goes like the rest.
    for input in &inputs {
        std::fs::read(input).unwrap();
    }
    let resharded = root.path().join("ckpt3");
    checkpoint::reshard(&dir, &resharded, 3, None, &Solo, |_| {}).unwrap();
    if drops {
        for input in &inputs {
            let cached = cached_bytes(input);
            assert!(
                cached <= LEFT,
                "reshard left {cached} bytes of {} cached",
                input.display()
            );
        }
    }
    assert_eq!(verify(&resharded).unwrap(), 128 * MIB);

    // The same state as a DCP directory, consolidated to a torch.save file.
    let dcp = root.path().join("dcp");
    for r in ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        fsdp.save_dcp(&local, &params, None, &dcp)
    }) {
        r.unwrap();
    }
    let pt = root.path().join("full.pt");
    conversions::dcp_to_torch_save(&dcp, &pt, &Solo, |_| {}).unwrap();
    if drops {
        for rank in 0..2 {
            let data = dcp.join(format!("__{rank}_0.distcp"));
            let cached = cached_bytes(&data);
            assert!(
                cached <= LEFT,
                "{cached} bytes of {} stayed cached",
                data.display()
            );
        }
        let cached = cached_bytes(&pt);
        assert!(
            cached <= 80 * MIB,
            "{cached} bytes of the .pt output stayed cached"
        );
    }
}

#[test]
fn a_checkpoint_saved_with_the_model_exports_its_parameters_as_a_hugging_face_model() {
    let model = common::nested_model();
    let full = full_adam(&model, 2.0);
    let layout = ModelLayout::new(&model, &common::wrap(false), 1).unwrap();
    let values = synthetic_params(&layout);
    let root = tmp();
    let (with_model, optim_only) = (root.path().join("with"), root.path().join("optim"));
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        let shards = shard_tensors(fsdp.layout(), fsdp.rank(), &params, &values).unwrap();
        let opts = SaveOptions::default();
        fsdp.save_checkpoint(&local, &params, &shards, &with_model, &opts)
            .unwrap();
        fsdp.save_optim_checkpoint(&local, &params, &optim_only, &opts)
            .unwrap();
    });

    let out = root.path().join("hf");
    let opts = conversions::HfExportOptions::default();
    let done = conversions::checkpoint_to_hf(
        &with_model,
        conversions::HfSource::Checkpoint,
        &out,
        &opts,
        &Solo,
    )
    .unwrap();
    assert_eq!(done.tensors, model.params.len());
    let exported = fsdp::io::safetensors::load(out.join("model.safetensors")).unwrap();
    for (p, v) in model.params.iter().zip(&values) {
        let got = exported.get(&p.name).expect("every parameter exported");
        let PyObj::Tensor(got) = got else { panic!() };
        assert!(got.bit_eq(v.as_ref().unwrap()), "{}", p.name);
    }

    // An optimizer-only checkpoint has no model to export.
    let err = conversions::checkpoint_to_hf(
        &optim_only,
        conversions::HfSource::Checkpoint,
        &root.path().join("none"),
        &opts,
        &Solo,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::HfSelection { reason, .. } if reason.contains("no tensors at all")),
        "{err}"
    );
}

// ----- direct reads (O_DIRECT) -----

use fsdp::storage::{direct_reads, force_direct_io, refuse_direct_io};

/// Each rank's dict loaded from `dir` with `opts`, and the direct reads its thread made.
fn load_counting(
    model: &ModelDesc,
    policy: &WrapPolicy,
    world_size: usize,
    dir: &Path,
    opts: &LoadOptions,
    refuse: (bool, bool),
) -> Vec<(OptimStateDict, u64)> {
    ThreadGroup::run(world_size, |pg| {
        refuse_direct_io(refuse.0, refuse.1);
        let fsdp = Fsdp::new(model, policy, Arc::new(pg)).unwrap();
        let before = direct_reads();
        let loaded = fsdp
            .load_optim_checkpoint(dir, &fsdp.optim_params(), opts)
            .unwrap_or_else(|e| panic!("rank {}: {e}", fsdp.rank()));
        (loaded, direct_reads() - before)
    })
}

/// Whether the file system of `dir` lets a file be opened with `O_DIRECT`.
fn accepts_direct(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join("direct-probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_ok();
    std::fs::remove_file(&probe).unwrap();
    ok
}

#[test]
fn direct_loads_give_the_bits_of_buffered_loads_whatever_the_piece_offsets_and_file_lengths() {
    // Small pieces at unaligned offsets (the nested model); pieces of several 4 MiB checksum
    // blocks starting and ending inside blocks, and odd element counts (the second model).
    let big = ModelDesc::new()
        .param("a.weight", &[1031, 1033], DType::F32)
        .param("a.bias", &[1031], DType::F32)
        .param("b.weight", &[777, 1024], DType::F32);
    let cases = [
        (
            common::nested_model(),
            common::wrap(false),
            common::wrap_alt(),
            3,
            [2, 5],
        ),
        (
            big,
            WrapPolicy::units(&["a", "b"]),
            WrapPolicy::units(&["b", ""]),
            3,
            [2, 4],
        ),
    ];
    for (model, policy, alt, save_ws, load_wss) in cases {
        let full = full_adam(&model, 3.0);
        let root = tmp();
        let dir = root.path().join("ckpt");
        for r in save_at(
            &model,
            &policy,
            save_ws,
            &full,
            &dir,
            &SaveOptions::default(),
        ) {
            r.unwrap();
        }
        let m = read_manifest(&dir).unwrap();
        assert!(
            m.files.iter().any(|f| f.len % 4096 != 0),
            "a data file whose length is not a multiple of 4096"
        );
        assert!(
            m.files.iter().any(|f| f.header_len % 4096 != 0),
            "pieces at unaligned offsets"
        );
        let direct_works = accepts_direct(root.path());
        for ws in load_wss {
            for verify in [true, false] {
                let buffered = LoadOptions::default().verify(verify).direct_io(false);
                let direct = buffered.clone().direct_io(true);
                let a = load_counting(&model, &alt, ws, &dir, &buffered, (false, false));
                let b = load_counting(&model, &alt, ws, &dir, &direct, (false, false));
                for (rank, ((a, na), (b, nb))) in a.iter().zip(&b).enumerate() {
                    let what = format!("ws {ws}, rank {rank}, verify {verify}");
                    assert_identical(a, b, &what);
                    assert_eq!(*na, 0, "{what}: buffered loads make no direct reads");
                    if direct_works {
                        assert!(*nb > 0, "{what}: the direct load read directly");
                    }
                }
            }
        }
        // The full dict, and the direct load against what was saved.
        let direct = LoadOptions::default().direct_io(true);
        assert_identical(
            &load_full(&dir, &direct).unwrap(),
            &load_full(&dir, &LoadOptions::default().direct_io(false)).unwrap(),
            "load_full",
        );
        for (rank, (loaded, expected)) in load_with(&model, &alt, 2, &full, &dir, &direct)
            .iter()
            .enumerate()
        {
            assert_identical(loaded, expected, &format!("direct, rank {rank}"));
        }
    }
}

#[test]
fn reshard_and_consolidation_with_direct_reads_write_the_bytes_of_buffered_reads() {
    // Pieces of several checksum blocks, split by the new ranks inside blocks.
    let model = ModelDesc::new()
        .param("a.weight", &[1500, 1031], DType::F32)
        .param("a.bias", &[1500], DType::F32)
        .param("b.weight", &[700, 1024], DType::F32);
    let full = full_adam(&model, 2.0);
    let root = tmp();
    let src = root.path().join("ws3");
    for r in save_at(
        &model,
        &WrapPolicy::units(&["a", "b"]),
        3,
        &full,
        &src,
        &SaveOptions::default(),
    ) {
        r.unwrap();
    }
    let alt = WrapPolicy::units(&["b", ""]);
    let direct_works = accepts_direct(root.path());
    let mut outputs = Vec::new();
    for direct in [false, true] {
        force_direct_io(Some(direct));
        let before = direct_reads();
        let out = root.path().join(format!("direct-{direct}"));
        std::fs::create_dir(&out).unwrap();
        let resharded = out.join("ws2");
        checkpoint::reshard(&src, &resharded, 2, Some(&alt), &Solo, |_| {}).unwrap();
        conversions::checkpoint_to_safetensors(&src, &out.join("full.safetensors"), &Solo, |_| {})
            .unwrap();
        conversions::checkpoint_to_torch_save(&src, &out.join("full.pt"), &Solo, |_| {}).unwrap();
        assert_eq!(
            verify(&resharded).unwrap(),
            read_manifest(&src).unwrap().tensor_bytes()
        );
        let reads = direct_reads() - before;
        force_direct_io(None);
        if !direct {
            assert_eq!(reads, 0, "buffered reads only");
        } else if direct_works {
            assert!(reads > 0, "the direct run read directly");
        }
        outputs.push((
            contents(&resharded),
            std::fs::read(out.join("full.safetensors")).unwrap(),
            std::fs::read(out.join("full.pt")).unwrap(),
        ));
    }
    let (a, b) = (&outputs[0], &outputs[1]);
    assert!(a.0 == b.0, "the resharded checkpoints differ");
    assert!(a.1 == b.1, "the consolidated .safetensors files differ");
    assert!(a.2 == b.2, "the consolidated .pt files differ");
    common::assert_same_state(
        &fsdp::io::safetensors::load_optim_state_dict(
            root.path().join("direct-true/full.safetensors"),
        )
        .unwrap(),
        &full,
        "consolidated with direct reads vs saved",
    );
}

#[test]
fn a_flipped_byte_fails_a_direct_read_with_the_error_of_a_buffered_one() {
    let (_root, dir) = saved();
    let file = dir.join("rank1.safetensors");
    let original = std::fs::read(&file).unwrap();
    let header = read_manifest(&dir).unwrap().files[1].header_len as usize;
    let model = common::nested_model();
    let load = |direct: bool| {
        ThreadGroup::run(1, |pg| -> fsdp::Result<OptimStateDict> {
            let fsdp = Fsdp::new(&model, &common::wrap(false), Arc::new(pg)).unwrap();
            let opts = LoadOptions::default().direct_io(direct);
            fsdp.load_optim_checkpoint(&dir, &fsdp.optim_params(), &opts)
        })
        .pop()
        .unwrap()
    };
    // In the header, at the first data byte, in the middle and at the last byte (the end of
    // the file is not aligned).
    for at in [
        header / 2,
        header,
        (header + original.len()) / 2,
        original.len() - 1,
    ] {
        let mut bytes = original.clone();
        bytes[at] ^= 0x08;
        std::fs::write(&file, &bytes).unwrap();
        let (buffered, direct) = (load(false).unwrap_err(), load(true).unwrap_err());
        assert!(
            matches!(&direct, Error::CheckpointCorrupt { rank: 1, .. }),
            "byte {at}: {direct:?}"
        );
        assert_eq!(direct.to_string(), buffered.to_string(), "byte {at}");
        force_direct_io(Some(true));
        let verified = verify(&dir);
        force_direct_io(None);
        assert!(
            matches!(verified, Err(Error::CheckpointCorrupt { rank: 1, .. })),
            "byte {at}: {verified:?}"
        );
    }
    std::fs::write(&file, &original).unwrap();
    load(true).unwrap();
}

#[test]
fn a_file_system_refusing_o_direct_is_read_through_the_page_cache_with_direct_io_on() {
    let model = common::nested_model();
    let full = full_adam(&model, 5.0);
    let root = tmp();
    let dir = root.path().join("ckpt");
    for r in save_at(
        &model,
        &common::wrap(true),
        2,
        &full,
        &dir,
        &SaveOptions::default(),
    ) {
        r.unwrap();
    }
    let direct = LoadOptions::default().direct_io(true);
    // Refused at `open` (tmpfs before Linux 6.6) or at the first read (some FUSE mounts).
    for refuse in [(true, false), (false, true)] {
        for verify in [true, false] {
            let opts = direct.clone().verify(verify);
            let loaded = load_counting(&model, &common::wrap_alt(), 3, &dir, &opts, refuse);
            let expected = load_with(&model, &common::wrap_alt(), 3, &full, &dir, &opts);
            for (rank, ((loaded, n), (_, expected))) in loaded.iter().zip(&expected).enumerate() {
                let what = format!("refused {refuse:?}, verify {verify}, rank {rank}");
                assert_identical(loaded, expected, &what);
                assert_eq!(*n, 0, "{what}: no direct read succeeded");
            }
        }
    }
    // A real tmpfs, where there is one: it refuses O_DIRECT before Linux 6.6 and accepts it
    // since; the load works either way.
    if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
        let dir = shm.path().join("ckpt");
        for r in save_at(
            &model,
            &common::wrap(true),
            2,
            &full,
            &dir,
            &SaveOptions::default(),
        ) {
            r.unwrap();
        }
        for (rank, (loaded, expected)) in
            load_with(&model, &common::wrap_alt(), 3, &full, &dir, &direct)
                .iter()
                .enumerate()
        {
            assert_identical(loaded, expected, &format!("/dev/shm, rank {rank}"));
        }
    }
}
