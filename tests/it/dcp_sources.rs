//! DCP directories whose metadata is not one `.metadata` (`tests/golden/dcp_sources/gen.py`,
//! real PyTorch 2.13): per-rank `__{rank}.metadata` files merged into one checkpoint, and
//! Hugging Face storage read from its `DCP_SHARDING_INFO` headers; consolidated equal to what
//! PyTorch holds, verified, and refused with typed errors when the parts do not fit.

use fsdp::collectives::{Solo, ThreadGroup};
use fsdp::commands::conversions;
use fsdp::commands::{recognize, Input};
use fsdp::io::dcp::{self, DcpCheckpoint, HfForm, Source};
use fsdp::io::torch_save::PyObj;
use fsdp::io::{self, torch_save};
use fsdp::Error;
use std::path::{Path, PathBuf};

fn golden(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/dcp_sources")
        .join(p)
}

/// A copy of `name`'s `ckpt/` in a fresh temporary directory (`<tmp>/ckpt`).
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    crate::common::copy_dir(&golden(name).join("ckpt"), "ckpt")
}

/// What a hostile case's error must be.
type Expect = dyn Fn(&Error) -> bool;

const PER_RANK: [(&str, usize); 2] = [("per_rank_ws2", 2), ("per_rank_ws3", 3)];

const HF: [(&str, HfForm, Option<usize>, usize); 5] = [
    ("hf_rank0", HfForm::Rank0, None, 1),
    ("hf_rank0_mapped", HfForm::Rank0, None, 2),
    ("hf_distributed", HfForm::Distributed, Some(2), 2),
    ("hf_distributed_mapped", HfForm::Distributed, Some(2), 4),
    ("hf_consolidated", HfForm::Consolidated, Some(2), 4),
];

// ----- per-rank metadata -----

#[test]
fn per_rank_metadata_consolidates_to_the_saving_runs_full_state_dict_in_either_format() {
    for (name, ranks) in PER_RANK {
        let dir = golden(name).join("ckpt");
        assert_eq!(recognize(&dir).unwrap(), Input::DcpPerRank, "{name}");
        // What get_state_dict(full_state_dict=True) gave the saving run, not what PyTorch's
        // dcp_to_torch_save makes of the directory (pytorch.txt).
        let expected = torch_save::load(golden(name).join("expected.pt")).unwrap();
        let ckpt = DcpCheckpoint::open(&dir).unwrap();
        assert_eq!(ckpt.source(), &Source::PerRank { ranks }, "{name}");
        assert!(ckpt.load().unwrap().bit_eq(&expected), "{name}: load()");
        let tmp = tempfile::tempdir().unwrap();
        let pt = tmp.path().join("out.pt");
        let written = conversions::dcp_to_torch_save(&dir, &pt, &Solo, |_| {}).unwrap();
        assert!(torch_save::load(&pt).unwrap().bit_eq(&expected), "{name}");
        let st = tmp.path().join("out.safetensors");
        assert_eq!(
            conversions::dcp_to_safetensors(&dir, &st, &Solo, |_| {}).unwrap(),
            written
        );
        assert!(
            io::load(&st).unwrap().bit_eq(&expected),
            "{name}: safetensors"
        );
        // Split across processes: the same file (of the same name: it names the archive).
        let whole = std::fs::read(&pt).unwrap();
        for ws in 2..=3 {
            let sub = tmp.path().join(format!("split{ws}"));
            std::fs::create_dir(&sub).unwrap();
            let split = sub.join("out.pt");
            for r in ThreadGroup::run(ws, |pg| {
                conversions::dcp_to_torch_save(&dir, &split, &pg, |_| {})
            }) {
                assert_eq!(r.unwrap(), written);
            }
            assert!(
                std::fs::read(&split).unwrap() == whole,
                "{name}, {ws} processes"
            );
        }
    }
}

#[test]
fn pytorchs_own_consolidation_of_per_rank_metadata_is_recorded_wrong() {
    // gen.py checked that dcp_to_torch_save's result differs from expected.pt and wrote down
    // where; the crate's result (above) is the right one.
    for (name, _) in PER_RANK {
        let note = std::fs::read_to_string(golden(name).join("pytorch.txt")).unwrap();
        assert!(
            note.contains("Falling back to rank local metadata"),
            "{note}"
        );
        assert!(note.contains("model.fc1.weight"), "{note}");
    }
}

#[test]
fn per_rank_metadata_is_summarized_and_verified_as_one_checkpoint() {
    let dir = golden("per_rank_ws3/ckpt");
    let s = dcp::summary(&dir).unwrap();
    assert_eq!(s.world_size, Some(3));
    assert_eq!(s.source, Source::PerRank { ranks: 3 });
    let w = s
        .entries
        .iter()
        .find(|e| e.key == "model.fc2.weight")
        .unwrap();
    // 5 rows on 3 ranks: 2, 2, 1.
    assert_eq!((w.shape.clone(), w.chunks), (Some(vec![5, 6]), 3));
    assert_eq!(s.files.len(), 3);
    let text = s.to_string();
    assert!(text.contains("3 per-rank"), "{text}");
    let r = dcp::verify(&dir).unwrap();
    assert_eq!(r.tensors + r.objects, s.entries.len());
    assert!(r.chunks > r.tensors);
}

#[test]
fn per_rank_metadata_converts_to_one_metadata_and_back_equal() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("global");
    conversions::dcp_to_dcp(&golden("per_rank_ws3/ckpt"), &out, &Solo).unwrap();
    assert!(out.join(".metadata").is_file());
    assert_eq!(recognize(&out).unwrap(), Input::Dcp);
    let expected = torch_save::load(golden("per_rank_ws3/expected.pt")).unwrap();
    assert!(DcpCheckpoint::open(&out)
        .unwrap()
        .load()
        .unwrap()
        .bit_eq(&expected));
}

#[test]
fn a_missing_rank_file_is_named() {
    // A gap: rank 1 of 3.
    let (_t, dir) = copy_of("per_rank_ws3");
    std::fs::remove_file(dir.join("__1.metadata")).unwrap();
    match DcpCheckpoint::open(&dir).unwrap_err() {
        Error::DcpRankMissing { rank, found, .. } => {
            assert_eq!(rank, 1);
            assert!(found.contains("__0.metadata, __2.metadata"), "{found}");
        }
        e => panic!("{e}"),
    }
    // The last rank: its data file says it existed.
    let (_t, dir) = copy_of("per_rank_ws3");
    std::fs::remove_file(dir.join("__2.metadata")).unwrap();
    match DcpCheckpoint::open(&dir).unwrap_err() {
        Error::DcpRankMissing { rank, found, .. } => {
            assert_eq!(rank, 2);
            assert!(found.contains("__2_0.distcp"), "{found}");
        }
        e => panic!("{e}"),
    }
}

#[test]
fn replicated_items_must_hold_the_same_bytes_on_every_rank() {
    // Rank 1 really saved another step for fc2.bias.
    let dir = golden("per_rank_disagree_step/ckpt");
    match DcpCheckpoint::open(&dir).unwrap_err() {
        Error::DcpReplicasDiffer {
            key,
            offsets,
            first,
            second,
            ..
        } => {
            assert_eq!(key, "optim.state.fc2.bias.step");
            assert_eq!(offsets, Some(vec![]));
            assert_eq!((first.rank, second.rank), (0, 1));
            assert_eq!(
                (first.file.as_str(), second.file.as_str()),
                ("__0_0.distcp", "__1_0.distcp")
            );
        }
        e => panic!("{e}"),
    }
    // A non-tensor value: rank 1's `lr` record points at the bytes of `eps`.
    let (_t, dir) = copy_of("per_rank_ws3");
    std::fs::copy(
        golden("hostile/lr_differs.__1.metadata"),
        dir.join("__1.metadata"),
    )
    .unwrap();
    let e = DcpCheckpoint::open(&dir).unwrap_err();
    assert!(
        matches!(&e, Error::DcpReplicasDiffer { key, offsets: None, second, .. } if key == "optim.param_groups.0.lr" && second.rank == 1),
        "{e}"
    );
    // Nothing is written from such a directory.
    let out = dir.parent().unwrap().join("out.pt");
    assert!(conversions::dcp_to_torch_save(&dir, &out, &Solo, |_| {}).is_err());
    assert!(!out.exists());
}

#[test]
fn rank_files_that_disagree_are_refused_naming_key_and_ranks() {
    let cases: [(&str, usize, &Expect); 5] = [
        ("overlap", 1, &|e| {
            matches!(e, Error::DcpChunks { key, reason, .. }
                if key == "model.fc1.weight" && reason.contains("overlap") && reason.contains("rank 1"))
        }),
        ("missing_chunk", 1, &|e| {
            matches!(e, Error::DcpChunks { key, reason, .. }
                if key == "model.fc1.weight" && reason.contains("missing"))
        }),
        ("wrong_dtype", 2, &|e| {
            matches!(e, Error::DcpRanksDisagree { key, rank: 0, other_rank: 2, reason, .. }
                if key == "model.fc1.weight" && reason.contains("float64"))
        }),
        ("wrong_size", 2, &|e| {
            matches!(e, Error::DcpRanksDisagree { key, other_rank: 2, reason, .. }
                if key == "model.fc1.weight" && reason.contains("global shape"))
        }),
        ("bytes_as_tensor", 2, &|e| {
            matches!(e, Error::DcpRanksDisagree { key, other_rank: 2, reason, .. }
                if key == "optim.param_groups.0.lr" && reason.contains("a non-tensor value on rank 0"))
        }),
    ];
    for (case, rank, expect) in cases {
        let (_t, dir) = copy_of("per_rank_ws3");
        std::fs::copy(
            golden(&format!("hostile/{case}.__{rank}.metadata")),
            dir.join(format!("__{rank}.metadata")),
        )
        .unwrap();
        let e = DcpCheckpoint::open(&dir).unwrap_err();
        assert!(expect(&e), "{case}: {e}");
        assert!(dcp::verify(&dir).is_err(), "{case}");
    }
}

#[test]
fn a_global_metadata_takes_precedence_over_rank_files() {
    // PyTorch's loader reads `.metadata` first; so does the crate.
    let (_t, dir) = copy_of("per_rank_ws2");
    let global = dir.parent().unwrap().join("global");
    conversions::dcp_to_dcp(&dir, &global, &Solo).unwrap();
    std::fs::copy(global.join(".metadata"), dir.join(".metadata")).unwrap();
    assert_eq!(recognize(&dir).unwrap(), Input::Dcp);
    assert_eq!(
        DcpCheckpoint::open(&dir).unwrap().source(),
        &Source::Metadata
    );
}

// ----- Hugging Face storage -----

#[test]
fn every_hf_storage_form_consolidates_to_what_pytorchs_reader_loads() {
    for (name, form, ranks, files) in HF {
        let dir = golden(name).join("ckpt");
        assert_eq!(recognize(&dir).unwrap(), Input::DcpHf(form), "{name}");
        // dcp.load with HuggingFaceStorageReader into a plain dict (gen.py), keys as saved.
        let expected = torch_save::load(golden(name).join("expected.pt")).unwrap();
        let ckpt = DcpCheckpoint::open(&dir).unwrap();
        assert_eq!(
            ckpt.source(),
            &Source::HfStorage { form, files, ranks },
            "{name}"
        );
        assert!(ckpt.load().unwrap().bit_eq(&expected), "{name}: load()");
        let tmp = tempfile::tempdir().unwrap();
        let pt = tmp.path().join("out.pt");
        conversions::dcp_to_torch_save(&dir, &pt, &Solo, |_| {}).unwrap();
        assert!(torch_save::load(&pt).unwrap().bit_eq(&expected), "{name}");
        let st = tmp.path().join("out.safetensors");
        conversions::dcp_to_safetensors(&dir, &st, &Solo, |_| {}).unwrap();
        assert!(
            io::load(&st).unwrap().bit_eq(&expected),
            "{name}: safetensors"
        );
        let r = dcp::verify(&dir).unwrap();
        assert_eq!((r.tensors, r.objects), (7, 0), "{name}");
        let s = dcp::summary(&dir).unwrap();
        assert_eq!(s.world_size, ranks, "{name}");
        let head = s.entries.iter().find(|e| e.key == "head.weight").unwrap();
        assert_eq!(head.dtype.as_deref(), Some("torch.bfloat16"));
        assert_eq!(head.shape, Some(vec![4, 2]));
        // And rewritten with one `.metadata`.
        let out = tmp.path().join("global");
        conversions::dcp_to_dcp(&dir, &out, &Solo).unwrap();
        assert!(DcpCheckpoint::open(&out)
            .unwrap()
            .load()
            .unwrap()
            .bit_eq(&expected));
    }
}

#[test]
fn the_consolidated_form_reads_its_shards_which_equal_the_merged_files() {
    let dir = golden("hf_consolidated/ckpt");
    let s = dcp::summary(&dir).unwrap();
    assert!(s.files.iter().all(|f| f.name.starts_with("sharded/shard-")));
    // The merged files beside them hold the same tensors.
    let expected = torch_save::load(golden("hf_consolidated/expected.pt")).unwrap();
    for i in 1..=2 {
        let merged = io::load(dir.join(format!("model-0000{i}-of-00002.safetensors"))).unwrap();
        let PyObj::OrderedDict { items, .. } = &merged else {
            panic!("{merged:?}")
        };
        for (k, v) in items {
            let PyObj::Str(k) = k else { panic!() };
            assert!(expected.get(k).unwrap().bit_eq(v), "{k}");
        }
    }
}

#[test]
fn a_plain_hugging_face_directory_is_not_taken_for_dcp() {
    // The merged files alone: safetensors without DCP_SHARDING_INFO, a model directory.
    let (_t, dir) = copy_of("hf_consolidated");
    std::fs::remove_dir_all(dir.join("sharded")).unwrap();
    assert_eq!(recognize(&dir).unwrap(), Input::HfModel);
    assert_eq!(dcp::hf_form(&dir).unwrap(), None);
    assert!(DcpCheckpoint::open(&dir).is_err());
}

/// Rewrites the header of the safetensors file `path` with `edit` (its data unchanged).
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

/// Sets the `DCP_SHARDING_INFO` offsets of `key` in a header.
fn set_offsets(h: &mut serde_json::Map<String, serde_json::Value>, key: &str, offsets: &[u64]) {
    let md = h["__metadata__"].as_object_mut().unwrap();
    let mut info: serde_json::Value =
        serde_json::from_str(md["DCP_SHARDING_INFO"].as_str().unwrap()).unwrap();
    info[key]["saved_offsets"] = serde_json::json!(offsets);
    md.insert(
        "DCP_SHARDING_INFO".into(),
        serde_json::Value::String(info.to_string()),
    );
}

const RANK1: &str = "shard-00002-model-00001-of-00001.safetensors";

#[test]
fn hostile_hf_storage_is_refused_naming_file_and_key() {
    type Edit = Box<dyn Fn(&Path)>;
    let header = |f: fn(&mut serde_json::Map<String, serde_json::Value>)| -> Edit {
        Box::new(move |dir: &Path| edit_header(&dir.join(RANK1), f))
    };
    let cases: Vec<(&str, Edit, &Expect)> = vec![
        (
            // Rank 1's rows of fc1.weight (3..6 of 6) claimed at 7..10: the inferred shape
            // grows to 10 rows with a gap.
            "offset outside the shape",
            header(|h| set_offsets(h, "fc1.weight", &[7, 0])),
            &|e| {
                matches!(e, Error::DcpChunks { key, reason, .. }
                    if key == "fc1.weight" && reason.contains("missing") && reason.contains("inferred"))
            },
        ),
        (
            "overlapping chunks",
            header(|h| set_offsets(h, "fc1.weight", &[1, 0])),
            &|e| {
                matches!(e, Error::DcpChunks { key, reason, .. }
                    if key == "fc1.weight" && reason.contains("overlap"))
            },
        ),
        (
            "offsets of another rank",
            header(|h| set_offsets(h, "fc1.bias", &[3, 0])),
            &|e| {
                matches!(e, Error::DcpHfFile { key: Some(k), reason, .. }
                    if k == "fc1.bias" && reason.contains("saved_offsets"))
            },
        ),
        (
            "no sharding entry",
            header(|h| {
                let md = h["__metadata__"].as_object_mut().unwrap();
                let mut info: serde_json::Value =
                    serde_json::from_str(md["DCP_SHARDING_INFO"].as_str().unwrap()).unwrap();
                info.as_object_mut().unwrap().remove("out.bias");
                md.insert(
                    "DCP_SHARDING_INFO".into(),
                    serde_json::Value::String(info.to_string()),
                );
            }),
            &|e| matches!(e, Error::DcpHfFile { key: Some(k), file, .. } if k == "out.bias" && file.ends_with(RANK1)),
        ),
        (
            "no sharding info at all",
            header(|h| {
                h["__metadata__"]
                    .as_object_mut()
                    .unwrap()
                    .remove("DCP_SHARDING_INFO");
            }),
            &|e| matches!(e, Error::DcpHfFile { key: None, file, reason } if file.ends_with(RANK1) && reason.contains("no DCP_SHARDING_INFO")),
        ),
        (
            "dtypes disagree",
            header(|h| {
                h["fc2.bias"]["dtype"] = "I32".into();
            }),
            &|e| {
                matches!(e, Error::DcpHfDisagree { key: Some(k), reason, other_file, .. }
                    if k == "fc2.bias" && reason.contains("int32") && other_file.ends_with(RANK1))
            },
        ),
        (
            "data past the file",
            header(|h| {
                h["head.weight"]["data_offsets"] = serde_json::json!([104, 1104]);
            }),
            &|e| matches!(e, Error::DcpHfFile { key: Some(k), reason, .. } if k == "head.weight" && reason.contains("outside")),
        ),
        (
            "data of the wrong length",
            header(|h| {
                h["head.weight"]["data_offsets"] = serde_json::json!([100, 104]);
            }),
            &|e| matches!(e, Error::DcpHfFile { key: Some(k), reason, .. } if k == "head.weight" && reason.contains("needs 8")),
        ),
        (
            "an unsupported dtype",
            header(|h| {
                h["fc1.bias"]["dtype"] = "Q4".into();
            }),
            &|e| matches!(e, Error::DcpHfFile { key: Some(k), reason, .. } if k == "fc1.bias" && reason.contains("Q4")),
        ),
        (
            "a malformed header",
            Box::new(|dir: &Path| {
                let p = dir.join(RANK1);
                let mut b = std::fs::read(&p).unwrap();
                b[8] = b'!';
                std::fs::write(&p, b).unwrap();
            }),
            &|e| matches!(e, Error::DcpHfFile { key: None, file, .. } if file.ends_with(RANK1)),
        ),
        (
            "a truncated file",
            Box::new(|dir: &Path| {
                let p = dir.join(RANK1);
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() - 20]).unwrap();
            }),
            &|e| matches!(e, Error::DcpHfFile { key: Some(_), file, .. } if file.ends_with(RANK1)),
        ),
    ];
    for (case, edit, expect) in cases {
        let (_t, dir) = copy_of("hf_distributed");
        edit(&dir);
        let e = DcpCheckpoint::open(&dir).unwrap_err();
        assert!(expect(&e), "{case}: {e}");
        let out = dir.parent().unwrap().join("out.pt");
        assert!(conversions::dcp_to_torch_save(&dir, &out, &Solo, |_| {}).is_err());
        assert!(!out.exists(), "{case}");
    }
}

#[test]
fn the_rank0_index_must_name_the_file_holding_each_tensor() {
    let (_t, dir) = copy_of("hf_rank0_mapped");
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["weight_map"]["fc2.bias"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(&index, json.to_string()).unwrap();
    let e = DcpCheckpoint::open(&dir).unwrap_err();
    assert!(
        matches!(&e, Error::DcpHfDisagree { key: Some(k), other_file, .. } if k == "fc2.bias" && other_file == "model-00002-of-00002.safetensors"),
        "{e}"
    );
    json["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("fc2.bias");
    std::fs::write(&index, json.to_string()).unwrap();
    let e = DcpCheckpoint::open(&dir).unwrap_err();
    assert!(
        matches!(&e, Error::DcpHfDisagree { key: Some(k), reason, .. } if k == "fc2.bias" && reason.contains("does not list")),
        "{e}"
    );
}
