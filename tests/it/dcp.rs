//! DCP directories written by real PyTorch 2.13 (`tests/golden/dcp/gen.py`): read,
//! consolidated into what `dcp_to_torch_save` writes, verified, and refused when hostile.

use fsdp::collectives::Solo;
use fsdp::collectives::ThreadGroup;
use fsdp::commands::conversions;
use fsdp::io::dcp::{self, DcpCheckpoint};
use fsdp::io::torch_save::{self, PyObj};
use fsdp::{Error, HostTensor};
use std::path::{Path, PathBuf};

use crate::common;

const SCENARIOS: [&str; 6] = [
    "fsdp2_adam_ws4",
    "fsdp2_adamw_ws3_tied",
    "fsdp2_sgd_ws2_frozen",
    "fsdp1_orig_ws3",
    "fsdp1_flat_ws4",
    "dtensor_grid_ws4",
];

fn golden(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/dcp")
        .join(p)
}

/// A copy of `name`'s `ckpt/` in a fresh temporary directory (`<tmp>/ckpt`).
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    crate::common::copy_dir(&golden(name).join("ckpt"), "ckpt")
}

#[test]
fn every_fixture_consolidates_to_what_dcp_to_torch_save_wrote() {
    for name in SCENARIOS {
        let expected = torch_save::load(golden(name).join("expected.pt")).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out.pt");
        let written =
            conversions::dcp_to_torch_save(&golden(name).join("ckpt"), &out, &Solo, |_| {})
                .unwrap();
        assert!(written > 0, "{name}");
        let got = torch_save::load(&out).unwrap();
        assert!(
            got.bit_eq(&expected),
            "{name}: consolidated dict differs from expected.pt"
        );
        // In memory too.
        let ckpt = DcpCheckpoint::open(golden(name).join("ckpt")).unwrap();
        assert!(
            ckpt.load().unwrap().bit_eq(&expected),
            "{name}: load() differs"
        );
    }
}

#[test]
fn every_fixture_consolidated_by_1_to_4_processes_is_the_single_process_file_in_either_format() {
    // Row slabs (FSDP2, FSDP1 dim-0 shards) and a 2-D grid (assembled whole) alike.
    for name in SCENARIOS {
        let ckpt = golden(name).join("ckpt");
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let written =
            conversions::dcp_to_torch_save(&ckpt, &a.join("out.pt"), &Solo, |_| {}).unwrap();
        let expected = std::fs::read(a.join("out.pt")).unwrap();
        let st = a.join("out.safetensors");
        assert_eq!(
            conversions::dcp_to_safetensors(&ckpt, &st, &Solo, |_| {}).unwrap(),
            written
        );
        let expected_st = std::fs::read(&st).unwrap();
        for ws in 1..=4 {
            let split = b.join("out.safetensors");
            let each: Vec<u64> = ThreadGroup::run(ws, |pg| {
                conversions::dcp_to_safetensors(&ckpt, &split, &pg, |_| {})
            })
            .into_iter()
            .map(Result::unwrap)
            .collect();
            assert_eq!(each, vec![written; ws], "{name}, {ws} processes");
            assert!(
                std::fs::read(&split).unwrap() == expected_st,
                "{name}, {ws} processes: not the single-process .safetensors file"
            );
            std::fs::remove_file(&split).unwrap();
        }
        for ws in 1..=4 {
            let each: Vec<u64> = ThreadGroup::run(ws, |pg| {
                conversions::dcp_to_torch_save(&ckpt, &b.join("out.pt"), &pg, |_| {})
            })
            .into_iter()
            .map(Result::unwrap)
            .collect();
            assert_eq!(each, vec![written; ws], "{name}, {ws} processes");
            assert!(
                std::fs::read(b.join("out.pt")).unwrap() == expected,
                "{name}, {ws} processes: not the single-process file"
            );
            std::fs::remove_file(b.join("out.pt")).unwrap();
        }
    }
}

#[test]
fn pytorch_loads_the_consolidated_file_equal_to_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = Vec::new();
    for name in SCENARIOS {
        let out = tmp.path().join(format!("{name}.pt"));
        conversions::dcp_to_torch_save(&golden(name).join("ckpt"), &out, &Solo, |_| {}).unwrap();
        args.push(golden(name).join("expected.pt"));
        args.push(out);
    }
    crate::common::python_script(&golden("check_equal.py"), &args);
}

#[test]
fn consolidated_keys_are_strings_in_metadata_order_with_lists_rebuilt() {
    let ckpt = DcpCheckpoint::open(golden("dtensor_grid_ws4/ckpt")).unwrap();
    let obj = ckpt.load().unwrap();
    let extra = obj.get("extra").unwrap();
    // The int key 0 was flattened to the string "0", as DCP does.
    assert!(extra.get("0").is_some());
    let Some(PyObj::List(mixed)) = extra.get("mixed") else {
        panic!("mixed is not a list: {extra:?}");
    };
    assert_eq!(mixed.len(), 5);
    assert_eq!(mixed[1], PyObj::Int(3));
    assert_eq!(mixed[3], PyObj::None);
    // The 2-D grid of chunks assembles to arange(35) / 7.
    let Some(PyObj::Tensor(grid)) = obj.get("model").and_then(|m| m.get("grid")) else {
        panic!("no grid tensor");
    };
    let expected: Vec<f32> = (0..35).map(|i| i as f32 / 7.0).collect();
    assert_eq!(grid.shape(), &[7, 5]);
    assert_eq!(grid.as_slice::<f32>().unwrap(), expected.as_slice());
    let chunks = |k: &str| match &ckpt.entry(k).unwrap().kind {
        dcp::EntryKind::Tensor(t) => t.chunks.len(),
        dcp::EntryKind::Bytes => 0,
    };
    assert_eq!(chunks("model.grid"), 4);
    assert_eq!(chunks("model.cube"), 4);
}

#[test]
fn fsdp2_records_the_empty_chunk_of_a_tensor_with_fewer_rows_than_ranks() {
    let ckpt = DcpCheckpoint::open(golden("fsdp2_adam_ws4/ckpt")).unwrap();
    let dcp::EntryKind::Tensor(t) = &ckpt.entry("model.net2.0.weight").unwrap().kind else {
        panic!("not a tensor");
    };
    assert_eq!(t.size, vec![3, 10]);
    let rows: Vec<usize> = t.chunks.iter().map(|c| c.sizes[0]).collect();
    assert_eq!(rows, vec![1, 1, 1, 0]);
    assert_eq!(
        ckpt.read_tensor("model.net2.0.weight").unwrap().shape(),
        &[3, 10]
    );
}

#[test]
fn verify_accepts_every_fixture_and_summary_counts_files_and_ranks() {
    for name in SCENARIOS {
        let r = dcp::verify(&golden(name).join("ckpt")).unwrap();
        assert!(r.tensors > 0 && r.chunks >= r.tensors, "{name}: {r:?}");
    }
    let s = dcp::summary(&golden("fsdp2_adamw_ws3_tied/ckpt")).unwrap();
    assert_eq!(s.world_size, Some(3));
    assert_eq!(s.files.len(), 3);
    for f in &s.files {
        let len = std::fs::metadata(golden("fsdp2_adamw_ws3_tied/ckpt").join(&f.name))
            .unwrap()
            .len();
        assert_eq!(f.bytes, Some(len));
    }
    let w = s
        .entries
        .iter()
        .find(|e| e.key == "model.net1.0.weight")
        .unwrap();
    assert_eq!(w.shape.as_deref(), Some(&[10usize, 4][..]));
    assert_eq!(w.chunks, 3);
    assert_eq!(w.dtype.as_deref(), Some("torch.float32"));
}

#[test]
fn a_metadata_pickle_that_would_run_a_command_is_refused() {
    let (_tmp, dir) = copy_of("fsdp2_adam_ws4");
    let marker = Path::new("/tmp/fsdp-dcp-exploit-ran");
    let _ = std::fs::remove_file(marker);
    std::fs::copy(golden("hostile/exploit.metadata"), dir.join(".metadata")).unwrap();
    let err = DcpCheckpoint::open(&dir).unwrap_err();
    assert!(
        matches!(&err, Error::UnsupportedPickleGlobal { module, name, .. } if module == "posix" && name == "system"),
        "{err}"
    );
    assert!(!marker.exists());
}

/// Puts hostile `.metadata` `case` into a copy of the ws4 checkpoint and returns the error
/// that verifying and consolidating it give (they must agree).
fn hostile(case: &str, prepare: impl FnOnce(&Path)) -> Error {
    let (tmp, dir) = copy_of("fsdp2_adam_ws4");
    std::fs::copy(
        golden(&format!("hostile/{case}.metadata")),
        dir.join(".metadata"),
    )
    .unwrap();
    prepare(tmp.path());
    let err = dcp::verify(&dir).unwrap_err();
    let out = tmp.path().join("out.pt");
    let err2 = conversions::dcp_to_torch_save(&dir, &out, &Solo, |_| {}).unwrap_err();
    assert_eq!(err, err2, "{case}");
    for e in ThreadGroup::run(2, |pg| {
        conversions::dcp_to_torch_save(&dir, &out, &pg, |_| {})
    }) {
        assert_eq!(e.unwrap_err(), err, "{case}: split across 2 processes");
    }
    assert!(!out.exists(), "{case}: an output was left behind");
    err
}

fn storage_error(err: &Error, want_file: &str, needle: &str) {
    match err {
        Error::DcpStorage {
            key, file, reason, ..
        } => {
            assert_eq!(key, "model.net1.0.weight", "{err}");
            assert_eq!(file, want_file, "{err}");
            assert!(reason.contains(needle), "{err}");
        }
        other => panic!("expected DcpStorage, got {other:?}"),
    }
}

fn chunk_error(err: &Error, needle: &str) {
    match err {
        Error::DcpChunks { key, reason, .. } => {
            assert_eq!(key, "model.net1.0.weight", "{err}");
            assert!(reason.contains(needle), "{err}");
        }
        other => panic!("expected DcpChunks, got {other:?}"),
    }
}

#[test]
fn paths_escaping_the_directory_are_refused() {
    let e = hostile("escape_parent", |tmp| {
        // Even when the target exists.
        std::fs::copy(
            golden("fsdp2_adam_ws4/ckpt/__0_0.distcp"),
            tmp.join("outside.distcp"),
        )
        .unwrap();
    });
    storage_error(&e, "../outside.distcp", "not a plain path");
    let e = hostile("escape_absolute", |_| {});
    storage_error(&e, "/etc/passwd", "not a plain path");
    // A symbolic link the directory holds is followed wherever it leads (the rule of every
    // input, as PyTorch's reader follows it), and must end at a regular file.
    let e = hostile("escape_symlink", |tmp| {
        let outside = tmp.join("elsewhere");
        std::fs::create_dir(&outside).unwrap();
        let c = std::ffi::CString::new(outside.join("__0_0.distcp").to_str().unwrap()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        std::os::unix::fs::symlink(&outside, tmp.join("ckpt/link")).unwrap();
    });
    storage_error(
        &e,
        "link/__0_0.distcp",
        "the data file is a FIFO, not a regular file",
    );
    let (tmp, dir) = copy_of("fsdp2_adam_ws4");
    std::fs::copy(
        golden("hostile/escape_symlink.metadata"),
        dir.join(".metadata"),
    )
    .unwrap();
    let outside = tmp.path().join("elsewhere");
    std::fs::create_dir(&outside).unwrap();
    std::fs::copy(
        golden("fsdp2_adam_ws4/ckpt/__0_0.distcp"),
        outside.join("__0_0.distcp"),
    )
    .unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
    dcp::verify(&dir).unwrap();
}

#[test]
fn missing_files_and_ranges_past_the_end_are_refused() {
    storage_error(&hostile("missing_file", |_| {}), "__9_0.distcp", "missing");
    let e = hostile("past_eof", |_| {});
    storage_error(&e, "__0_0.distcp", "past the end");
    let e = hostile("long_length", |_| {});
    storage_error(&e, "__0_0.distcp", "past the end");
}

#[test]
fn overlapping_missing_and_unrecorded_chunks_are_refused() {
    chunk_error(&hostile("overlap", |_| {}), "overlap");
    chunk_error(&hostile("missing_chunk", |_| {}), "missing");
    chunk_error(&hostile("missing_storage", |_| {}), "no storage_data entry");
}

#[test]
fn chunks_disagreeing_with_the_metadata_are_refused() {
    let e = hostile("wrong_dtype", |_| {});
    match &e {
        Error::DcpStorage { key, reason, .. } => {
            assert_eq!(key, "model.net1.0.weight");
            assert!(reason.contains("torch.float64"), "{e}");
        }
        other => panic!("expected DcpStorage, got {other:?}"),
    }
    let e = hostile("wrong_shape", |_| {});
    assert!(
        matches!(&e, Error::DcpStorage { key, reason, .. } if key == "model.net1.0.weight" && reason.contains("metadata says")),
        "{e}"
    );
}

#[test]
fn two_keys_sharing_a_planner_data_path_are_refused_naming_both() {
    // `eps` given `lr`'s path: PyTorch's dcp_to_torch_save silently drops `eps`, and a
    // reader that nested by path alone gave `lr` the value of `eps` (1e-08).
    match hostile("shared_path", |_| {}) {
        Error::DcpSharedPath {
            first,
            second,
            path,
            ..
        } => {
            assert_eq!(first, "optim.param_groups.0.lr");
            assert_eq!(second, "optim.param_groups.0.eps");
            assert_eq!(path, "('optim', 'param_groups', 0, 'lr')");
        }
        other => panic!("expected DcpSharedPath, got {other:?}"),
    }
}

/// The key and reason of a [`Error::DcpPlannerData`].
fn planner_error(err: &Error) -> (&str, &str) {
    match err {
        Error::DcpPlannerData { key, reason, .. } => (key, reason),
        other => panic!("expected DcpPlannerData, got {other:?}"),
    }
}

#[test]
fn planner_data_paths_pytorch_refuses_are_refused() {
    // PyTorch: "Missing key in checkpoint state_dict" for each.
    let e = hostile("path_not_key", |_| {});
    let (key, reason) = planner_error(&e);
    assert_eq!(key, "model.net1.0.weight");
    assert!(reason.contains("model.net9.0.weight"), "{e}");
    let e = hostile("path_through_value", |_| {});
    let (key, reason) = planner_error(&e);
    assert_eq!(key, "optim.param_groups.0.lr");
    assert!(
        reason.contains("runs through the value of the key `model.net1.0.weight`"),
        "{e}"
    );
    let e = hostile("param_groups_gap", |_| {});
    let (key, reason) = planner_error(&e);
    assert_eq!(key, "optim.param_groups");
    assert!(
        reason.contains("no item 0") && reason.contains("dense"),
        "{e}"
    );
}

#[test]
fn every_hostile_metadata_is_refused_alike_by_verify_and_every_reader() {
    // `hostile` checks that verify and consolidation (alone and split) give one error; the
    // offline conversion to the crate's checkpoint refuses the same metadata.
    let model = common::dcp_fixture_net();
    let policy = fsdp::WrapPolicy::units(&["net1", "net2", ""]);
    let layout = fsdp::flat_param::ModelLayout::new(&model, &policy, 2).unwrap();
    for entry in std::fs::read_dir(golden("hostile")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let Some(case) = name.strip_suffix(".metadata") else {
            continue;
        };
        if case == "exploit" || case.starts_with("escape_") {
            continue; // need their own setup (tests above)
        }
        let err = hostile(case, |_| {});
        if !matches!(
            err,
            Error::DcpSharedPath { .. } | Error::DcpPlannerData { .. }
        ) {
            continue; // a broken chunk fails only the readers that read it
        }
        let (tmp, dir) = copy_of("fsdp2_adam_ws4");
        std::fs::copy(
            golden(&format!("hostile/{case}.metadata")),
            dir.join(".metadata"),
        )
        .unwrap();
        let out = tmp.path().join("ckpt-out");
        let converted = conversions::dcp_to_checkpoint(&dir, &out, &layout, &Solo).unwrap_err();
        assert_eq!(
            std::mem::discriminant(&converted),
            std::mem::discriminant(&err),
            "{case}: {converted}"
        );
        let text = |e: &Error| {
            e.to_string()
                .rsplit_once(".metadata")
                .unwrap()
                .1
                .to_string()
        };
        assert_eq!(text(&converted), text(&err), "{case}");
        assert!(!out.exists(), "{case}: an output was left behind");
    }
}

#[test]
fn a_layout_pytorch_does_not_know_is_refused() {
    // PyTorch: `_get_layout('torch.st0ided')` is a KeyError.
    let e = hostile("unknown_layout", |_| {});
    assert!(
        e.to_string()
            .contains("`torch.st0ided` is not a torch layout"),
        "{e}"
    );
}

#[test]
fn a_storage_meta_pytorch_cannot_set_load_id_on_is_refused() {
    let e = hostile("storage_meta_int", |_| {});
    assert!(e.to_string().contains("cannot set `load_id`"), "{e}");
}

#[test]
fn metadata_pytorch_reads_back_whole_is_read_as_pytorch_reads_it() {
    // Not what `dcp.save` writes, but `dcp_to_torch_save` gives the original's result
    // (gen.py checks it): a plain list or a gap named by an object key, a negative index that
    // overwrites another key's slot which that key's name fills again, a path PyTorch's
    // loader finds only by its 2.3 traversal, a `storage_meta`, root object or chunk of
    // another class, and malformed `planner_data` entries and records that PyTorch never reads.
    let mut cases = 0;
    for entry in std::fs::read_dir(golden("pytorch_reads")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "metadata") {
            continue;
        }
        let base = std::fs::read_to_string(path.with_extension("base")).unwrap();
        let base = base.trim();
        let (tmp, dir) = copy_of(base);
        std::fs::copy(&path, dir.join(".metadata")).unwrap();
        dcp::verify(&dir).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let out = tmp.path().join("out.pt");
        conversions::dcp_to_torch_save(&dir, &out, &Solo, |_| {})
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let expected = torch_save::load(golden(base).join("expected.pt")).unwrap();
        assert!(
            torch_save::load(&out).unwrap().bit_eq(&expected),
            "{}: differs from {base}/expected.pt",
            path.display()
        );
        cases += 1;
    }
    assert_eq!(cases, 9);
}

#[test]
fn truncated_or_garbled_metadata_gives_typed_errors() {
    let raw = std::fs::read(golden("fsdp2_adam_ws4/ckpt/.metadata")).unwrap();
    for cut in [0, 1, 2, 11, 100, raw.len() / 2, raw.len() - 1] {
        assert!(
            dcp::parse_metadata("m", &raw[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    let mut flipped = raw.clone();
    for i in (0..flipped.len()).step_by(97) {
        flipped[i] ^= 0x5a;
        let _ = dcp::parse_metadata("m", &flipped);
        flipped[i] ^= 0x5a;
    }
    assert!(dcp::parse_metadata("m", &raw).is_ok());
    // A FRAME longer than the rest of the pickle: Python refuses it ("pickle data was
    // truncated"), though every opcode after it is whole.
    assert_eq!(&raw[..3], &[0x80, 4, 0x95], "protocol 4, framed");
    let mut long_frame = raw.clone();
    long_frame[7..9].copy_from_slice(&[0xd2, 0xaf]);
    let e = dcp::parse_metadata("m", &long_frame).unwrap_err();
    assert!(
        e.to_string().contains("runs past the end of the pickle"),
        "{e}"
    );
}

#[test]
fn written_dcp_directories_load_in_pytorch_like_torch_save_to_dcp_output() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = Vec::new();
    for name in SCENARIOS {
        let input = golden(name).join("expected.pt");
        let out = tmp.path().join(name);
        conversions::torch_save_to_dcp(&input, &out, &Solo).unwrap();
        // The crate reads back what it wrote, equal to the input.
        let back = DcpCheckpoint::open(&out).unwrap().load().unwrap();
        assert!(back.bit_eq(&torch_save::load(&input).unwrap()), "{name}");
        dcp::verify(&out).unwrap();
        let md = dcp::read_metadata(&out).unwrap();
        assert_eq!(
            md.checkpoint_id.as_deref(),
            Some(name),
            "a relative checkpoint_id"
        );
        args.push(input);
        args.push(out);
    }
    crate::common::python_script(&golden("check_dcp_writer.py"), &args);
}

/// The data file of the DCP directory `dir`.
fn data_file(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("__0_0.distcp")).unwrap()
}

#[test]
fn torch_save_files_convert_streamed_to_the_in_memory_bytes_and_split_across_1_to_4_processes() {
    for name in SCENARIOS {
        let input = golden(name).join("expected.pt");
        let tmp = tempfile::tempdir().unwrap();
        let in_memory = tmp.path().join("in-memory");
        let written = dcp::save_dcp(&torch_save::load(&input).unwrap(), &in_memory).unwrap();
        let streamed = tmp.path().join("streamed");
        assert_eq!(
            conversions::torch_save_to_dcp(&input, &streamed, &Solo).unwrap(),
            written
        );
        assert!(
            data_file(&streamed) == data_file(&in_memory),
            "{name}: the streamed data file differs"
        );
        for ws in 1..=4 {
            let split = tmp.path().join(format!("split{ws}"));
            for r in ThreadGroup::run(ws, |pg| conversions::torch_save_to_dcp(&input, &split, &pg))
            {
                assert_eq!(r.unwrap(), written, "{name}, {ws} processes");
            }
            assert!(
                data_file(&split) == data_file(&in_memory),
                "{name}, {ws} processes: the data file differs"
            );
        }
    }
}

#[test]
fn safetensors_files_convert_streamed_to_the_in_memory_bytes_and_split_across_1_to_4_processes() {
    let tmp = tempfile::tempdir().unwrap();
    // The crate's own safetensors of every fixture, and one written by another tool (no
    // object metadata: an ordered dict of its tensors by name).
    let mut inputs = Vec::new();
    for name in SCENARIOS {
        let input = tmp.path().join(format!("{name}.safetensors"));
        let obj = torch_save::load(golden(name).join("expected.pt")).unwrap();
        fsdp::io::safetensors::save(&obj, &input).unwrap();
        inputs.push(input);
    }
    let plain = tmp.path().join("plain.safetensors");
    let a: Vec<u8> = (0..96u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let b: Vec<u8> = 7.5f32.to_le_bytes().to_vec();
    let views = [
        (
            "w",
            ::safetensors::tensor::TensorView::new(::safetensors::Dtype::F32, vec![8, 12], &a)
                .unwrap(),
        ),
        (
            "step",
            ::safetensors::tensor::TensorView::new(::safetensors::Dtype::F32, vec![], &b).unwrap(),
        ),
    ];
    std::fs::write(&plain, ::safetensors::serialize(views, None).unwrap()).unwrap();
    inputs.push(plain);
    for input in &inputs {
        let what = input.file_name().unwrap().to_string_lossy().into_owned();
        let in_memory = tmp.path().join("in-memory");
        let obj = fsdp::io::safetensors::load(input).unwrap();
        let written = dcp::save_dcp(&obj, &in_memory).unwrap();
        let streamed = tmp.path().join("streamed");
        assert_eq!(
            conversions::torch_save_to_dcp(input, &streamed, &Solo).unwrap(),
            written
        );
        assert!(
            data_file(&streamed) == data_file(&in_memory),
            "{what}: the streamed data file differs"
        );
        let load = |dir: &Path| DcpCheckpoint::open(dir).unwrap().load().unwrap();
        assert!(
            load(&streamed).bit_eq(&load(&in_memory)),
            "{what}: the state read back differs"
        );
        for ws in 1..=4 {
            let split = tmp.path().join(format!("split{ws}"));
            for r in ThreadGroup::run(ws, |pg| conversions::torch_save_to_dcp(input, &split, &pg)) {
                assert_eq!(r.unwrap(), written, "{what}, {ws} processes");
            }
            assert!(
                data_file(&split) == data_file(&in_memory),
                "{what}, {ws} processes: the data file differs"
            );
            std::fs::remove_dir_all(&split).unwrap();
        }
        std::fs::remove_dir_all(&in_memory).unwrap();
        std::fs::remove_dir_all(&streamed).unwrap();
    }
}

#[test]
fn a_truncated_or_lying_safetensors_file_fails_on_every_process_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let obj = torch_save::load(golden(SCENARIOS[0]).join("expected.pt")).unwrap();
    let good = fsdp::io::safetensors::save_to_bytes(&obj).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    let mut bad_json = good.clone();
    bad_json[8] = b'[';
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("truncated", good[..good.len() - 4].to_vec(), "truncated"),
        (
            "padded",
            [good.as_slice(), &[0; 4]].concat(),
            "truncated or padded",
        ),
        ("header longer than the file", huge, "does not fit the file"),
        ("header not JSON", bad_json, "invalid header"),
    ];
    assert!(n > 0);
    for (what, bytes, reason) in cases {
        let input = tmp.path().join("bad.safetensors");
        std::fs::write(&input, &bytes).unwrap();
        let out = tmp.path().join("out");
        let alone = conversions::torch_save_to_dcp(&input, &out, &Solo).unwrap_err();
        let text = alone.to_string();
        assert!(
            text.contains("bad.safetensors") && text.contains(reason),
            "{what}: {text}"
        );
        for r in ThreadGroup::run(2, |pg| conversions::torch_save_to_dcp(&input, &out, &pg)) {
            assert_eq!(r.unwrap_err(), alone, "{what}");
        }
        assert!(!out.exists(), "{what}: no output");
    }
}

#[test]
fn a_file_of_views_into_one_storage_converts_and_a_corrupt_storage_fails() {
    // Two halves of one buffer: views, not whole storages, streamed from one read of it.
    let whole = HostTensor::from_vec1(&(0..64).map(|i| i as f32).collect::<Vec<_>>());
    let views = PyObj::Dict(vec![
        (
            PyObj::Str("a".into()),
            PyObj::Tensor(whole.narrow_flat(0, 32).unwrap()),
        ),
        (
            PyObj::Str("b".into()),
            PyObj::Tensor(whole.narrow_flat(32, 32).unwrap()),
        ),
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("views.pt");
    torch_save::save(&views, &input).unwrap();
    for ws in [1, 2] {
        let out = tmp.path().join(format!("views{ws}"));
        for r in ThreadGroup::run(ws, |pg| conversions::torch_save_to_dcp(&input, &out, &pg)) {
            assert_eq!(r.unwrap(), 256);
        }
        let back = DcpCheckpoint::open(&out).unwrap().load().unwrap();
        assert!(back.bit_eq(&views), "{ws} processes");
    }

    // A flipped byte inside a streamed storage: its CRC-32 fails, nothing is installed.
    let input = tmp.path().join("whole.pt");
    let obj = PyObj::Dict(vec![(PyObj::Str("w".into()), PyObj::Tensor(whole.clone()))]);
    torch_save::save(&obj, &input).unwrap();
    let mut bytes = std::fs::read(&input).unwrap();
    let at = bytes
        .windows(4)
        .position(|w| w == 5.0f32.to_le_bytes())
        .unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(&input, &bytes).unwrap();
    let out = tmp.path().join("corrupt");
    let alone = conversions::torch_save_to_dcp(&input, &out, &Solo).unwrap_err();
    assert!(alone.to_string().contains("CRC-32"), "{alone}");
    for r in ThreadGroup::run(2, |pg| conversions::torch_save_to_dcp(&input, &out, &pg)) {
        assert_eq!(r.unwrap_err(), alone);
    }
    assert!(!out.exists(), "no output");
}

/// `tests/golden/dcp/shared_storage/input.pt` (its `gen.py`): tensors that are views into
/// shared storages, at offsets, transposed, strided, expanded, tied, apart in dict order.
fn shared_storage_input() -> PathBuf {
    golden("shared_storage/input.pt")
}

/// The DCP directory `<parent>/ckpt` (one name for all, as `.metadata` records it).
fn ckpt_in(parent: &Path, what: &str) -> PathBuf {
    let dir = parent.join(what);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("ckpt")
}

/// Asserts that the DCP directories `a` and `b` hold the same data file and the same
/// `.metadata` but for its random save id.
fn same_dcp(a: &Path, b: &Path, what: &str) {
    assert!(
        data_file(a) == data_file(b),
        "{what}: the data file differs"
    );
    assert_eq!(
        dcp::read_metadata(a).unwrap(),
        dcp::read_metadata(b).unwrap(),
        "{what}: .metadata"
    );
    let len = |d: &Path| std::fs::metadata(d.join(".metadata")).unwrap().len();
    assert_eq!(len(a), len(b), "{what}: .metadata length");
}

#[test]
fn a_file_of_views_into_shared_storages_streams_the_in_memory_bytes_split_across_1_to_4_processes()
{
    let input = shared_storage_input();
    let tmp = tempfile::tempdir().unwrap();
    let zstd = dcp::DcpWriteOptions::default().compression(dcp::Compression::Zstd);
    for opts in [dcp::DcpWriteOptions::default(), zstd] {
        let what = format!("{:?}", opts.compression);
        let in_memory = ckpt_in(tmp.path(), &format!("in-memory-{what}"));
        let loaded = torch_save::load(&input).unwrap();
        let written = dcp::save_dcp_with(&loaded, &in_memory, &opts).unwrap();
        let streamed = ckpt_in(tmp.path(), &format!("streamed-{what}"));
        assert_eq!(
            conversions::torch_save_to_dcp_with(&input, &streamed, &Solo, &opts).unwrap(),
            written
        );
        same_dcp(&streamed, &in_memory, &what);
        assert!(
            DcpCheckpoint::open(&streamed)
                .unwrap()
                .load()
                .unwrap()
                .bit_eq(&loaded),
            "{what}: the state read back differs"
        );
        for ws in 1..=4 {
            let split = ckpt_in(tmp.path(), &format!("split-{what}-{ws}"));
            let run = ThreadGroup::run(ws, |pg| {
                conversions::torch_save_to_dcp_with(&input, &split, &pg, &opts)
            });
            for r in run {
                assert_eq!(r.unwrap(), written, "{what}, {ws} processes");
            }
            same_dcp(&split, &in_memory, &format!("{what}, {ws} processes"));
        }
    }
    // PyTorch reads it back as it reads its own `torch_save_to_dcp` output.
    let plain = tmp.path().join("streamed-None/ckpt");
    crate::common::python_script(&golden("check_dcp_writer.py"), [&input, &plain]);
}

#[test]
fn a_damaged_shared_storage_fails_its_crc_on_every_process_and_installs_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("input.pt");
    let mut bytes = std::fs::read(shared_storage_input()).unwrap();
    // Element 45 of the float32 storage every `flat` view and `late` share.
    let at = bytes
        .windows(4)
        .position(|w| w == 1045.0f32.to_le_bytes())
        .unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(&input, &bytes).unwrap();
    let zstd = dcp::DcpWriteOptions::default().compression(dcp::Compression::Zstd);
    for opts in [dcp::DcpWriteOptions::default(), zstd] {
        let out = tmp.path().join("out");
        let alone = conversions::torch_save_to_dcp_with(&input, &out, &Solo, &opts).unwrap_err();
        match &alone {
            Error::TorchSaveArchive {
                file,
                entry,
                reason,
                ..
            } => {
                assert_eq!(file, &input.display().to_string(), "{alone}");
                assert_eq!(entry.as_deref(), Some("input/data/0"), "{alone}");
                assert!(reason.contains("CRC-32"), "{alone}");
            }
            other => panic!("not a CRC error: {other}"),
        }
        // The in-memory read fails alike.
        assert_eq!(torch_save::load(&input).unwrap_err(), alone);
        for ws in [2, 3] {
            let run = ThreadGroup::run(ws, |pg| {
                conversions::torch_save_to_dcp_with(&input, &out, &pg, &opts)
            });
            for r in run {
                assert_eq!(r.unwrap_err(), alone, "{ws} processes");
            }
        }
        assert!(!out.exists(), "no output");
        assert_eq!(
            std::fs::read_dir(tmp.path()).unwrap().count(),
            1,
            "no temporary left"
        );
    }
}

#[test]
fn views_whose_copies_loading_refuses_are_refused_alike_when_converted() {
    // 200 stride-0 views of 64 MiB each over one 4-element storage: loading refuses to copy
    // them (TensorExpansion), and so does the conversion, which reads it the same way.
    let input =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/expansion_bomb/expansion_bomb.pt");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let err = conversions::torch_save_to_dcp(&input, &out, &Solo).unwrap_err();
    assert!(matches!(err, Error::TensorExpansion { .. }), "{err}");
    assert!(!out.exists(), "no output");
}

#[test]
fn writing_refuses_a_non_empty_output_directory_and_leaves_it_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    let input = golden("fsdp2_sgd_ws2_frozen/expected.pt");
    let err = conversions::torch_save_to_dcp(&input, &out, &Solo).unwrap_err();
    // The replace rule of every directory writer, in its words.
    assert!(matches!(err, Error::OutputRefused { .. }), "{err}");
    assert!(
        err.to_string().contains("is not an empty directory"),
        "{err}"
    );
    assert_eq!(std::fs::read(out.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "no temporary left"
    );
    // An empty directory is replaced.
    std::fs::remove_file(out.join("keep.txt")).unwrap();
    conversions::torch_save_to_dcp(&input, &out, &Solo).unwrap();
    assert_eq!(
        fsdp::commands::recognize(&out).unwrap(),
        fsdp::commands::Input::Dcp
    );
}

#[test]
fn a_flat_range_read_alone_equals_the_same_range_of_the_whole_tensor() {
    // Row slabs (FSDP1 and FSDP2 dim-0 shards) and a 2-D grid of DTensor chunks.
    for name in SCENARIOS {
        let ckpt = DcpCheckpoint::open(golden(name).join("ckpt")).unwrap();
        for e in &ckpt.metadata().entries {
            let dcp::EntryKind::Tensor(t) = &e.kind else {
                continue;
            };
            if t.size.is_empty() {
                continue;
            }
            let whole = ckpt.read_tensor(&e.key).unwrap();
            let n = whole.numel();
            let mut ranges = vec![(0, n), (0, 0), (n, 0), (n / 3, n / 2), (n - 1, 1)];
            ranges.extend(
                (0..n)
                    .step_by(n.div_ceil(5).max(1))
                    .map(|s| (s, (n - s).min(7))),
            );
            for (start, len) in ranges {
                let part = ckpt.read_flat_range(&e.key, start, len).unwrap();
                assert_eq!(part.shape(), [len], "{name} {}", e.key);
                assert!(
                    part.bit_eq(&whole.narrow_flat(start, len).unwrap()),
                    "{name} {} elements {start}..+{len}",
                    e.key
                );
            }
            let err = ckpt.read_flat_range(&e.key, n, 1).unwrap_err();
            assert!(err.to_string().contains("outside the tensor"), "{err}");
        }
    }
}
