//! DCP directories in every form PyTorch 2.13's `FileSystemWriter` writes
//! (`tests/golden/dcp_forms/gen.py`): zstd-compressed items, one file per item, several files
//! per rank, read as PyTorch reads them; the SAFETENSORS serialization PyTorch cannot read back
//! refused; hostile compressed items refused; and compressed directories the crate writes,
//! which PyTorch loads at another world size.

use fsdp::collectives::{Solo, ThreadGroup};
use fsdp::commands::conversions;
use fsdp::io::dcp::{self, Compression, DcpCheckpoint, DcpWriteOptions};
use fsdp::io::{self, torch_save};
use fsdp::Error;
use std::path::{Path, PathBuf};

/// The forms PyTorch reads back, each with the `expected.pt` its `dcp_to_torch_save` wrote
/// (`local_plans_ws2`: every rank's `SavePlan` kept in `.metadata`, as Megatron-Core's
/// `torch_dist` keeps them).
const READABLE: [&str; 4] = ["zstd_ws3", "per_item_ws2", "threads_ws3", "local_plans_ws2"];

fn golden(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/dcp_forms")
        .join(p)
}

/// A copy of `name`'s `ckpt/` in a fresh temporary directory (`<tmp>/ckpt`).
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    crate::common::copy_dir(&golden(name).join("ckpt"), "ckpt")
}

#[test]
fn every_form_pytorch_reads_consolidates_to_what_its_dcp_to_torch_save_wrote() {
    for name in READABLE {
        let ckpt = golden(name).join("ckpt");
        let expected = torch_save::load(golden(name).join("expected.pt")).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let pt = tmp.path().join("out.pt");
        conversions::dcp_to_torch_save(&ckpt, &pt, &Solo, |_| {}).unwrap();
        assert!(torch_save::load(&pt).unwrap().bit_eq(&expected), "{name}");
        let st = tmp.path().join("out.safetensors");
        conversions::dcp_to_safetensors(&ckpt, &st, &Solo, |_| {}).unwrap();
        assert!(
            io::load(&st).unwrap().bit_eq(&expected),
            "{name}: .safetensors"
        );
        let loaded = DcpCheckpoint::open(&ckpt).unwrap().load().unwrap();
        assert!(loaded.bit_eq(&expected), "{name}: load()");
        // Split across processes, the same file (under the same name: it names the archive).
        let single = std::fs::read(&pt).unwrap();
        std::fs::create_dir(tmp.path().join("split")).unwrap();
        let split = tmp.path().join("split/out.pt");
        for r in ThreadGroup::run(3, |pg| {
            conversions::dcp_to_torch_save(&ckpt, &split, &pg, |_| {})
        }) {
            r.unwrap();
        }
        assert!(
            std::fs::read(&split).unwrap() == single,
            "{name}: 3 processes"
        );
    }
}

#[test]
fn verify_reads_every_item_of_every_form_and_summary_shows_files_and_transforms() {
    for name in READABLE {
        let ckpt = golden(name).join("ckpt");
        let md = dcp::read_metadata(&ckpt).unwrap();
        let r = dcp::verify(&ckpt).unwrap();
        let records = md.storage.len();
        assert_eq!(r.chunks + r.objects, records, "{name}: every record read");
        let s = dcp::summary(&ckpt).unwrap();
        let names: Vec<&str> = s.files.iter().map(|f| f.name.as_str()).collect();
        let ws: usize = name[name.len() - 1..].parse().unwrap();
        assert_eq!(s.world_size, Some(ws), "{name}");
        match name {
            "zstd_ws3" => {
                assert_eq!(names, ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]);
                for f in &s.files {
                    assert_eq!(f.transforms, ["stream.zstd/1"], "{}", f.name);
                }
                // The recorded lengths are the compressed ones: the items' ranges add up to
                // the files, byte for byte.
                let on_disk: u64 = s.files.iter().map(|f| f.bytes.unwrap()).sum();
                assert_eq!(r.bytes_read, on_disk, "{name}");
            }
            // One file per item: as many files as records, one range each.
            "per_item_ws2" => {
                assert_eq!(s.files.len(), records);
                assert!(s
                    .files
                    .iter()
                    .all(|f| f.ranges == 1 && f.transforms.is_empty()));
            }
            // thread_count=2: two files per rank.
            "threads_ws3" => assert_eq!(
                names,
                [
                    "__0_0.distcp",
                    "__0_1.distcp",
                    "__1_0.distcp",
                    "__1_1.distcp",
                    "__2_0.distcp",
                    "__2_1.distcp"
                ]
            ),
            // The default writer: one file per rank; the plans are in `.metadata`, and read
            // past (this reader, like PyTorch's loader, has no use for them).
            "local_plans_ws2" => {
                assert_eq!(names, ["__0_0.distcp", "__1_0.distcp"]);
                let raw = std::fs::read(ckpt.join(".metadata")).unwrap();
                for global in [
                    "all_local_plans",
                    "SavePlan",
                    "WriteItem",
                    "TensorWriteData",
                ] {
                    let found = raw.windows(global.len()).any(|w| w == global.as_bytes());
                    assert!(found, "{global} in .metadata");
                }
            }
            _ => unreachable!(),
        }
    }
}

#[test]
fn a_safetensors_serialized_directory_is_refused_saying_pytorch_cannot_read_it_either() {
    let ckpt = golden("safetensors_ws2/ckpt");
    // What PyTorch 2.13 did with it when the fixture was generated: both readers failed.
    let pytorch = std::fs::read_to_string(golden("safetensors_ws2/pytorch.txt")).unwrap();
    assert!(
        pytorch.contains("dcp_to_torch_save: CheckpointException"),
        "{pytorch}"
    );
    assert!(
        pytorch.contains("dcp.load of model.embed.weight: CheckpointException"),
        "{pytorch}"
    );
    let err = DcpCheckpoint::open(&ckpt).unwrap_err();
    match &err {
        Error::DcpSafetensorsData { file, key, .. } => {
            assert_eq!(file, "__0_0.distcp");
            assert_eq!(key, "model.embed.weight");
        }
        other => panic!("expected DcpSafetensorsData, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("SerializationFormat.SAFETENSORS"), "{msg}");
    assert!(msg.contains("PyTorch 2.13 cannot read it either"), "{msg}");
    assert_eq!(dcp::verify(&ckpt).unwrap_err(), err);
    assert_eq!(dcp::summary(&ckpt).unwrap_err(), err);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.pt");
    assert_eq!(
        conversions::dcp_to_torch_save(&ckpt, &out, &Solo, |_| {}).unwrap_err(),
        err
    );
    assert!(!out.exists());
}

/// A copy of the zstd checkpoint with hostile `.metadata` `case` (and `bomb.distcp`), and the
/// error verifying it gives; consolidating gives the same and leaves no output.
fn hostile(case: &str) -> Error {
    let (tmp, dir) = copy_of("zstd_ws3");
    std::fs::copy(
        golden(&format!("hostile/{case}.metadata")),
        dir.join(".metadata"),
    )
    .unwrap();
    for data in ["bomb.distcp", "frames.distcp"] {
        std::fs::copy(golden(&format!("hostile/{data}")), dir.join(data)).unwrap();
    }
    let err = dcp::verify(&dir).unwrap_err();
    let out = tmp.path().join("out.pt");
    let err2 = conversions::dcp_to_torch_save(&dir, &out, &Solo, |_| {}).unwrap_err();
    assert_eq!(err, err2, "{case}");
    let st = tmp.path().join("out.safetensors");
    let err3 = conversions::dcp_to_safetensors(&dir, &st, &Solo, |_| {}).unwrap_err();
    assert_eq!(err, err3, "{case}: .safetensors");
    let err4 = DcpCheckpoint::open(&dir).unwrap().load().unwrap_err();
    assert_eq!(err, err4, "{case}: load()");
    let names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        ["ckpt"],
        "{case}: an output or a temporary was left behind"
    );
    err
}

#[test]
fn a_declared_size_its_compressed_bytes_cannot_hold_is_refused_before_anything_is_allocated() {
    // model.net2.0.bias declared [2**34] float32 (64 GiB) in one chunk, stored in a compressed
    // item of a few hundred bytes: 64 GiB were allocated (an abort) before this was refused.
    match hostile("huge_declared") {
        Error::DcpCompressedTooShort {
            key,
            file,
            stored,
            most,
            needs,
            ..
        } => {
            assert_eq!(key, "model.net2.0.bias");
            assert_eq!(file, "__0_0.distcp");
            assert_eq!(needs, 4 << 34);
            // 128 KiB per 4 stored bytes after a 6-byte frame head.
            assert_eq!(most, (stored - 6) / 4 * (128 << 10));
            assert!(most < needs);
        }
        other => panic!("expected DcpCompressedTooShort, got {other:?}"),
    }
}

/// The expected `model.net1.0.weight` of the zstd fixture.
fn net1_weight() -> torch_save::PyObj {
    let expected = torch_save::load(golden("zstd_ws3/expected.pt")).unwrap();
    expected
        .get("model")
        .and_then(|m| m.get("net1.0.weight"))
        .cloned()
        .unwrap()
}

#[test]
fn an_items_range_must_decompress_across_its_frames_to_exactly_one_archive() {
    // What PyTorch 2.13 + zstandard loads of well-formed frames reads alike: the archive split
    // over two frames, a skippable frame after it (gen.py checks that PyTorch loads them).
    for case in ["trailing_split", "trailing_skippable"] {
        let (_tmp, dir) = copy_of("zstd_ws3");
        std::fs::copy(
            golden(&format!("hostile/{case}.metadata")),
            dir.join(".metadata"),
        )
        .unwrap();
        std::fs::copy(golden("hostile/frames.distcp"), dir.join("frames.distcp")).unwrap();
        dcp::verify(&dir).unwrap();
        let got = DcpCheckpoint::open(&dir)
            .unwrap()
            .read_tensor("model.net1.0.weight")
            .unwrap();
        assert!(
            torch_save::PyObj::Tensor(got).bit_eq(&net1_weight()),
            "{case}"
        );
    }
    // Bytes that are no frame (PyTorch refuses too) and a frame the range cuts short (PyTorch's
    // stream reader passes over it): no zstd stream.
    for (case, needle) in [
        ("trailing_garbage", "Unknown frame descriptor"),
        ("trailing_cut_frame", "incomplete frame"),
    ] {
        match hostile(case) {
            Error::DcpStorage {
                key, file, reason, ..
            } => {
                assert_eq!(key, "model.net1.0.weight");
                assert_eq!(file, "frames.distcp");
                assert!(reason.contains("do not decompress"), "{case}: {reason}");
                assert!(reason.contains(needle), "{case}: {reason}");
            }
            other => panic!("{case}: expected DcpStorage, got {other:?}"),
        }
    }
    // Output past the archive's end: a second frame of the same archive, or of other bytes.
    // PyTorch loads the first archive and ignores the rest; the first-frame reader did too.
    for case in ["trailing_second_frame", "trailing_hello_frame"] {
        match hostile(case) {
            Error::DcpStorage {
                key, file, reason, ..
            } => {
                assert_eq!(key, "model.net1.0.weight");
                assert_eq!(file, "frames.distcp");
                assert!(
                    reason.contains("does not take the whole"),
                    "{case}: {reason}"
                );
            }
            other => panic!("{case}: expected DcpStorage, got {other:?}"),
        }
    }
    // A trailing frame of a gibibyte is inflated no further than the item's bound.
    let started = std::time::Instant::now();
    match hostile("trailing_gib_frame") {
        Error::DcpExpansion {
            key, file, limit, ..
        } => {
            assert_eq!(key, "model.net1.0.weight");
            assert_eq!(file, "frames.distcp");
            assert_eq!(limit, 16 * 4 + dcp::ARCHIVE_ALLOWANCE);
        }
        other => panic!("expected DcpExpansion, got {other:?}"),
    }
    assert!(started.elapsed().as_secs() < 20, "{:?}", started.elapsed());
}

#[test]
fn a_zstd_bomb_is_refused_at_the_items_bound_naming_key_and_file() {
    // A tensor chunk: 4 MiB of zeros where net1.0.weight's first chunk (4 of its 10 rows of
    // 4 floats) belongs; its bound is the chunk's bytes plus the archive allowance.
    let md = dcp::read_metadata(&golden("zstd_ws3/ckpt")).unwrap();
    let chunk = match &md
        .entries
        .iter()
        .find(|e| e.key == "model.net1.0.weight")
        .unwrap()
        .kind
    {
        dcp::EntryKind::Tensor(t) => t.chunks[0].clone(),
        dcp::EntryKind::Bytes => unreachable!(),
    };
    let chunk_bytes = (chunk.sizes.iter().product::<usize>() * 4) as u64;
    match hostile("tensor_bomb") {
        Error::DcpExpansion {
            key, file, limit, ..
        } => {
            assert_eq!(key, "model.net1.0.weight");
            assert_eq!(file, "bomb.distcp");
            assert_eq!(limit, chunk_bytes + dcp::ARCHIVE_ALLOWANCE);
        }
        other => panic!("expected DcpExpansion, got {other:?}"),
    }
    // A non-tensor value: 80 MiB of zeros, past the 64 MiB a value may hold.
    let e = hostile("bytes_bomb");
    match &e {
        Error::DcpExpansion {
            key, file, limit, ..
        } => {
            assert_eq!(key, "optim.param_groups.0.lr");
            assert_eq!(file, "bomb.distcp");
            assert_eq!(*limit, dcp::MAX_OBJECT_BYTES);
        }
        other => panic!("expected DcpExpansion, got {other:?}"),
    }
    assert!(e.to_string().contains("zstd bomb"), "{e}");
}

#[test]
fn transforms_pytorch_does_not_know_are_refused_naming_the_descriptor() {
    for (case, descriptor, needle) in [
        ("unknown_transform", "stream.lz4/1", "does not know"),
        ("zstd_v2", "stream.zstd/2", "reads version 1"),
    ] {
        match hostile(case) {
            Error::DcpStorage {
                key, file, reason, ..
            } => {
                assert_eq!(key, "model.net1.0.weight");
                assert_eq!(file, "__0_0.distcp");
                assert!(reason.contains(descriptor), "{reason}");
                assert!(reason.contains(needle), "{reason}");
            }
            other => panic!("{case}: expected DcpStorage, got {other:?}"),
        }
    }
}

#[test]
fn a_compressed_range_past_the_file_or_a_corrupt_frame_is_a_typed_error() {
    // The range checks apply to the compressed range: cut the last file short.
    let (_tmp, dir) = copy_of("zstd_ws3");
    let f = dir.join("__2_0.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    match dcp::verify(&dir).unwrap_err() {
        Error::DcpStorage { file, reason, .. } => {
            assert_eq!(file, "__2_0.distcp");
            assert!(reason.contains("past the end"), "{reason}");
        }
        other => panic!("expected DcpStorage, got {other:?}"),
    }
    // Garbled bytes inside every frame of a file: each item fails to decompress or to parse,
    // never panics.
    let (_tmp, dir) = copy_of("zstd_ws3");
    let f = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&f).unwrap();
    for b in bytes.iter_mut().skip(20).step_by(97) {
        *b ^= 0x5a;
    }
    std::fs::write(&f, bytes).unwrap();
    match dcp::verify(&dir).unwrap_err() {
        Error::DcpStorage { file, reason, .. } => {
            assert_eq!(file, "__0_0.distcp");
            assert!(
                reason.contains("do not decompress") || reason.contains("does not parse"),
                "{reason}"
            );
        }
        other => panic!("expected DcpStorage, got {other:?}"),
    }
}

#[test]
fn compressed_directories_the_crate_writes_read_back_and_load_in_pytorch_at_another_world_size() {
    let input = golden("zstd_ws3/expected.pt");
    let expected = torch_save::load(&input).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let zstd = DcpWriteOptions::default().compression(Compression::Zstd);
    let plain_dir = tmp.path().join("plain");
    conversions::torch_save_to_dcp(&input, &plain_dir, &Solo).unwrap();
    // Written by a job of 2 processes: process 0 writes the frames, both succeed.
    let dir = tmp.path().join("zstd");
    for r in ThreadGroup::run(2, |pg| {
        conversions::torch_save_to_dcp_with(&input, &dir, &pg, &zstd)
    }) {
        r.unwrap();
    }
    let md = dcp::read_metadata(&dir).unwrap();
    assert!(md
        .storage
        .values()
        .all(|i| i.as_ref().unwrap().transforms == ["stream.zstd/1"]));
    let size = |d: &Path| std::fs::metadata(d.join("__0_0.distcp")).unwrap().len();
    assert!(size(&dir) < size(&plain_dir), "compressed is smaller");
    assert!(DcpCheckpoint::open(&dir)
        .unwrap()
        .load()
        .unwrap()
        .bit_eq(&expected));
    dcp::verify(&dir).unwrap();
    // The in-memory writer gives the same items.
    let mem = tmp.path().join("mem");
    dcp::save_dcp_with(&expected, &mem, &zstd).unwrap();
    assert!(DcpCheckpoint::open(&mem)
        .unwrap()
        .load()
        .unwrap()
        .bit_eq(&expected));
    // Saved at 3 ranks, loaded by PyTorch's dcp.load into FSDP2 at 2 and FSDP1 at 2.
    crate::dcp_live::load_in_torch([
        (dir.clone(), input.clone(), "2", "fsdp2"),
        (mem.clone(), input.clone(), "2", "fsdp1_orig"),
    ]);
}
