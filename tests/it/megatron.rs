//! Megatron-Core `torch_dist` checkpoints written by real megatron-core 0.19.2 and 0.16.1 on
//! CPU (`tests/golden/megatron/gen.py`; `FORMAT.md` there says what they hold): recognized
//! from any of their roots, inspected, and consolidated to exactly the model tensors of
//! PyTorch's `dcp_to_torch_save` of the same directory (`expected.safetensors`, written by
//! the generator); a legacy backend, a broken tree and `--optim` refused by name.

use fsdp::collectives::{Solo, ThreadGroup};
use fsdp::commands::{self, conversions, Input};
use fsdp::io::megatron::{MegatronCheckpoint, OptimLayout, Tree};
use fsdp::io::torch_save::PyObj;
use fsdp::io::{self, torch_save};
use fsdp::{Error, HostTensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/megatron")
}

/// One fixture: its folder, the root a user points the tool at, and what the generator
/// recorded about it (`case.json`).
struct Case {
    name: String,
    root: PathBuf,
    case: serde_json::Value,
}

/// Every fixture of both Megatron versions.
fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for version in ["v0.19.2", "v0.16.1"] {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(golden().join(version))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        for dir in dirs {
            let case: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.join("case.json")).unwrap()).unwrap();
            out.push(Case {
                name: format!("{version}/{}", dir.file_name().unwrap().to_string_lossy()),
                root: dir.join("ckpt"),
                case,
            });
        }
    }
    assert_eq!(out.len(), 14, "the fixtures FORMAT.md lists");
    out
}

/// A tensor of `expected.safetensors` as written there: dtype (safetensors' name), shape and
/// bytes.
#[derive(Debug, PartialEq)]
struct Stored {
    dtype: String,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Stored {
    fn of(t: &HostTensor) -> Stored {
        let dtype = match t.dtype().torch_attr() {
            "float32" => "F32",
            "bfloat16" => "BF16",
            other => panic!("no fixture holds {other}"),
        };
        Stored {
            dtype: dtype.to_string(),
            shape: t.shape().to_vec(),
            bytes: t.as_bytes().to_vec(),
        }
    }
}

/// The tensors of `expected.safetensors` (every tensor of `dcp_to_torch_save`'s output, by
/// its flat DCP key, read with the `safetensors` crate) outside `optimizer.`.
fn expected_model_tensors(c: &Case) -> BTreeMap<String, Stored> {
    let bytes = std::fs::read(c.root.parent().unwrap().join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("optimizer."))
        .map(|(k, v)| {
            let stored = Stored {
                dtype: format!("{:?}", v.dtype()),
                shape: v.shape().to_vec(),
                bytes: v.data().to_vec(),
            };
            (k, stored)
        })
        .collect()
}

/// The tensors of a consolidated file, in file order.
fn tensors_of(obj: PyObj) -> Vec<(String, HostTensor)> {
    let PyObj::Dict(items) = obj else {
        panic!("not a dict")
    };
    items
        .into_iter()
        .map(|(k, v)| match (k, v) {
            (PyObj::Str(k), PyObj::Tensor(t)) => (k, t),
            (k, v) => panic!("{k:?}: {v:?} is not a tensor"),
        })
        .collect()
}

#[test]
fn every_fixture_is_recognized_from_its_root_and_inspects_with_its_layout() {
    for c in cases() {
        assert_eq!(
            commands::recognize(&c.root).unwrap(),
            Input::Megatron,
            "{}",
            c.name
        );
        let s = MegatronCheckpoint::open(&c.root).unwrap().summary();
        let (tree, iteration) = match c.case["layout"].as_str().unwrap() {
            "dcp" => (Tree::Directory, None),
            "mlm" => (Tree::MegatronLm, Some(1)),
            "bridge" => (Tree::Bridge, Some(1)),
            other => panic!("{other}"),
        };
        assert_eq!((s.tree, s.iteration), (tree, iteration), "{}", c.name);
        let layout = match c.case["opt"].as_str().unwrap() {
            "plain" => OptimLayout::Plain,
            "fully_reshardable" => OptimLayout::FullyReshardable,
            "dp_reshardable" => OptimLayout::DpReshardable,
            "dp_zero_gather_scatter" => OptimLayout::DpZeroGatherScatter,
            other => panic!("{other}"),
        };
        assert_eq!(s.optimizer, layout, "{}", c.name);
        assert_eq!(s.layers, Some(2), "{}", c.name);
        assert_eq!(
            s.world_size,
            c.case["ws"].as_u64().map(|w| w as usize),
            "{}",
            c.name
        );
        let expected = expected_model_tensors(&c);
        let keys: Vec<&str> = s.model_tensors.iter().map(|t| t.key.as_str()).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            expected.keys().map(String::as_str).collect::<Vec<_>>(),
            "{}",
            c.name
        );
        // Tied embeddings save no output layer.
        let tied = c.case["tied"].as_bool().unwrap();
        assert_eq!(keys.contains(&"output_layer.weight"), !tied, "{}", c.name);
        let version = if c.name.starts_with("v0.16") {
            "common.pt"
        } else {
            "common_state item"
        };
        assert_eq!(s.common_state, version, "{}", c.name);
        let text = fsdp::commands::Inspection::Megatron(s).to_string();
        assert!(
            text.contains(&format!("optimizer: {}", layout.name())),
            "{text}"
        );
    }
}

#[test]
fn consolidate_writes_exactly_the_model_tensors_dcp_to_torch_save_gives_in_both_formats() {
    for c in cases() {
        let expected = expected_model_tensors(&c);
        let tmp = tempfile::tempdir().unwrap();
        let pt = tmp.path().join("model.pt");
        conversions::megatron_to_torch_save(&c.root, &pt, &Solo, |_| {}).unwrap();
        let st = tmp.path().join("model.safetensors");
        conversions::megatron_to_safetensors(&c.root, &st, &Solo, |_| {}).unwrap();
        for (what, got) in [
            ("pt", tensors_of(torch_save::load(&pt).unwrap())),
            ("safetensors", tensors_of(io::load(&st).unwrap())),
        ] {
            assert_eq!(got.len(), expected.len(), "{} {what}", c.name);
            for (k, t) in &got {
                assert_eq!(Stored::of(t), expected[k], "{} {what}: {k}", c.name);
            }
        }
        // In metadata order, as dcp_to_torch_save writes them.
        let order: Vec<String> = tensors_of(torch_save::load(&pt).unwrap())
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let summary = MegatronCheckpoint::open(&c.root).unwrap().summary();
        let listed: Vec<String> = summary.model_tensors.into_iter().map(|t| t.key).collect();
        assert_eq!(order, listed, "{}", c.name);
    }
}

#[test]
fn consolidation_split_across_processes_is_the_same_file() {
    let root = golden().join("v0.19.2/mlm_tp2dp2/ckpt");
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one/model.pt");
    std::fs::create_dir(tmp.path().join("one")).unwrap();
    conversions::megatron_to_torch_save(&root, &one, &Solo, |_| {}).unwrap();
    let three = tmp.path().join("three/model.pt");
    std::fs::create_dir(tmp.path().join("three")).unwrap();
    for r in ThreadGroup::run(3, |pg| {
        conversions::megatron_to_torch_save(&root, &three, &pg, |_| {})
    }) {
        r.unwrap();
    }
    assert!(std::fs::read(&one).unwrap() == std::fs::read(&three).unwrap());
}

/// A copy of the `v0.19.2/dp2` torch_dist directory, with `metadata.json` replaced.
fn with_backend(json: &str) -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = crate::common::copy_dir(&golden().join("v0.19.2/dp2/ckpt"), "ckpt");
    std::fs::write(dir.join("metadata.json"), json).unwrap();
    (tmp, dir)
}

fn megatron_reason(e: Error) -> String {
    match e {
        Error::Megatron { reason, .. } => reason,
        other => panic!("expected Error::Megatron, got {other:?}"),
    }
}

#[test]
fn a_legacy_or_unknown_backend_and_a_broken_metadata_json_are_refused_by_name() {
    let (_t, zarr) = with_backend(r#"{"sharded_backend": "zarr", "sharded_backend_version": 1}"#);
    assert_eq!(commands::recognize(&zarr).unwrap(), Input::Megatron);
    let reason = megatron_reason(MegatronCheckpoint::open(&zarr).err().unwrap());
    assert!(
        reason.contains("`zarr`") && reason.contains("legacy"),
        "{reason}"
    );
    let (_t, other) = with_backend(r#"{"sharded_backend": "torch_foo"}"#);
    let reason = megatron_reason(MegatronCheckpoint::open(&other).err().unwrap());
    assert!(reason.contains("`torch_foo`"), "{reason}");
    // Beside a `.metadata`, a metadata.json that is no JSON still marks the directory, and
    // opening it says so (it is not taken for a plain DCP directory).
    let (_t, broken) = with_backend("{not json");
    assert_eq!(commands::recognize(&broken).unwrap(), Input::Megatron);
    let reason = megatron_reason(MegatronCheckpoint::open(&broken).err().unwrap());
    assert!(reason.contains("is not JSON"), "{reason}");
    // Elsewhere some other program's metadata.json marks nothing.
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("metadata.json"), "[1, 2]").unwrap();
    assert!(!fsdp::io::megatron::recognize_dir(t.path()).unwrap());
}

#[test]
fn a_tree_whose_latest_iteration_is_missing_or_garbled_is_refused_naming_it() {
    let (_t, root) = crate::common::copy_dir(&golden().join("v0.19.2/mlm_tp2dp2/ckpt"), "ckpt");
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "7").unwrap();
    let reason = megatron_reason(MegatronCheckpoint::open(&root).err().unwrap());
    assert!(reason.contains("`iter_0000007`"), "{reason}");
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "seven").unwrap();
    let reason = megatron_reason(MegatronCheckpoint::open(&root).err().unwrap());
    assert!(reason.contains("`seven`"), "{reason}");
}

#[test]
fn consolidate_takes_the_tree_and_refuses_optim_for_now_by_name() {
    let root = golden().join("v0.19.2/bridge_bf16_dp2/ckpt");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.safetensors");
    let done = commands::consolidate(&root, &out, &Solo, &commands::Silent).unwrap();
    assert!(
        done.message.contains("Megatron-Core checkpoint"),
        "{}",
        done.message
    );
    let opts = commands::ConsolidateOptions { optim: true };
    let err = commands::consolidate_with(
        &root,
        &tmp.path().join("o.pt"),
        &opts,
        &Solo,
        &commands::Silent,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("--optim of a Megatron-Core checkpoint"),
        "{err}"
    );
}
