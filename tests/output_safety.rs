//! The replace rule and the install protocol for every library writer of a checkpoint
//! directory: `Fsdp` saves and `BackgroundSaver` refuse a directory of foreign files, and the
//! fallback install (forced, as on NFS or Lustre) never exposes a partial checkpoint.

mod common;

use common::{nested_model, wrap};
use fsdp::checkpoint::{self, BackgroundSaver, CrashPoint, SaveOptions};
use fsdp::collectives::ThreadGroup;
use fsdp::storage;
use fsdp::{Error, Fsdp, HostTensor, OptimStateDict, ParamKey, ParamState, Value};
use std::path::Path;
use std::sync::Arc;

fn full(step: f32) -> OptimStateDict {
    let mut full = OptimStateDict::default();
    for p in &nested_model().params {
        let mut st = ParamState::new();
        st.insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::zeros(fsdp::DType::F32, &p.shape)),
        );
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(step)));
        full.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    full.param_groups = None;
    full
}

/// Saves at world size 2 (foreground or background) and returns every rank's outcome.
fn save(dir: &Path, step: f32, background: bool, opts: &SaveOptions) -> Vec<fsdp::Result<()>> {
    let model = nested_model();
    let f = full(step);
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&f, &params).unwrap();
        if background {
            let mut saver = BackgroundSaver::new(1 << 30);
            saver.save(&fsdp, &local, &params, dir)?;
            saver.wait()
        } else {
            fsdp.save_optim_checkpoint(&local, &params, dir, opts)
        }
    })
}

fn step_of(dir: &Path) -> String {
    let m = checkpoint::read_manifest(dir).unwrap();
    match &m.params[0]
        .states
        .iter()
        .find(|(n, _)| n == "step")
        .unwrap()
        .1
    {
        checkpoint::StoredValue::Value(v) => v.render(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn saves_refuse_a_directory_of_other_files_on_every_rank() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ck");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "keep").unwrap();
    for background in [false, true] {
        for r in save(&dir, 1.0, background, &SaveOptions::default()) {
            assert!(
                matches!(&r, Err(Error::OutputRefused { reason, .. }) if reason.contains("notes.txt")),
                "{r:?}"
            );
        }
        assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"keep");
    }
    let mut entries: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
    assert_eq!(entries.len(), 1, "no temporary left: {entries:?}");
    entries.clear();
    // An empty directory and an earlier checkpoint are replaced.
    std::fs::remove_file(dir.join("notes.txt")).unwrap();
    save(&dir, 1.0, false, &SaveOptions::default())
        .into_iter()
        .for_each(|r| r.unwrap());
    save(&dir, 2.0, true, &SaveOptions::default())
        .into_iter()
        .for_each(|r| r.unwrap());
    assert!(step_of(&dir).contains('2'), "{}", step_of(&dir));
}

#[test]
fn forced_rename_fallback_replaces_and_crashes_leave_the_old_checkpoint() {
    storage::force_rename_fallback(true);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ck");
    save(&dir, 1.0, false, &SaveOptions::default())
        .into_iter()
        .for_each(|r| r.unwrap());
    save(&dir, 2.0, false, &SaveOptions::default())
        .into_iter()
        .for_each(|r| r.unwrap());
    assert!(step_of(&dir).contains('2'));
    let names: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["ck"], "the aside copy is removed");
    for point in [CrashPoint::MidFile, CrashPoint::BeforeCommit] {
        let opts = SaveOptions::default().crash_at(Some(point));
        assert!(save(&dir, 3.0, false, &opts).iter().all(|r| r.is_err()));
        assert!(step_of(&dir).contains('2'), "{point:?}");
        checkpoint::verify(&dir).unwrap();
    }
    storage::force_rename_fallback(false);
}

/// The pid of a process that has exited (a temporary named after it is stale).
fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// A killed writer's temporary directory for `out`, holding (as empty stand-ins) the entries
/// of the finished output `like`: the names that writer puts into its temporary.
fn stale_copy_of(like: &Path, out: &Path) -> std::path::PathBuf {
    let name = out.file_name().unwrap().to_string_lossy();
    let tmp = out
        .parent()
        .unwrap()
        .join(format!(".{name}.tmp-{}-1", dead_pid()));
    std::fs::create_dir(&tmp).unwrap();
    for e in std::fs::read_dir(like).unwrap() {
        std::fs::write(tmp.join(e.unwrap().file_name()), b"half").unwrap();
    }
    tmp
}

#[test]
fn what_every_directory_writer_leaves_when_killed_is_cleaned_by_the_next_run() {
    let root = tempfile::tempdir().unwrap();
    let ck = root.path().join("ck");
    assert!(save(&ck, 1.0, false, &SaveOptions::default())
        .iter()
        .all(|r| r.is_ok()));
    let pg = fsdp::collectives::Solo;
    let dcp = root.path().join("dcp");
    fsdp::commands::conversions::checkpoint_to_dcp(&ck, &dcp, &pg, |_| {}).unwrap();
    // The Hugging Face export of the fixture DCP checkpoint, sharded, with its index and config.
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/hf/llama_tied");
    let hf = root.path().join("hf");
    let opts = fsdp::commands::conversions::HfExportOptions {
        max_shard_size: Some(60_000),
        config: Some(golden.join("hf_60KB/config.json")),
        ..Default::default()
    };
    fsdp::commands::conversions::checkpoint_to_hf(
        &golden.join("dcp"),
        fsdp::commands::conversions::HfSource::Dcp,
        &hf,
        &opts,
        &pg,
    )
    .unwrap();
    assert!(hf.join("model.safetensors.index.json").exists());
    let single = root.path().join("hf1");
    let opts = fsdp::commands::conversions::HfExportOptions::default();
    fsdp::commands::conversions::checkpoint_to_hf(
        &golden.join("dcp"),
        fsdp::commands::conversions::HfSource::Dcp,
        &single,
        &opts,
        &pg,
    )
    .unwrap();

    for (i, (like, kind)) in [
        (&ck, Some(checkpoint::CHECKPOINT_DIR)),
        (&dcp, Some(fsdp::io::dcp::DCP_DIR)),
        (&hf, None),
        (&single, None),
    ]
    .into_iter()
    .enumerate()
    {
        let out = root.path().join(format!("again-{i}"));
        let tmp = stale_copy_of(like, &out);
        let done = storage::clean_stale_temporaries(&out, kind).unwrap();
        assert_eq!(done, [storage::Cleaned::Removed(tmp.clone())], "{like:?}");
        assert!(!tmp.exists(), "{like:?}");
    }
}
