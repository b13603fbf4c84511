//! `fsdp-ckpt` on PyTorch DCP directories (`tests/golden/dcp/`): inspect, consolidate,
//! verify, and typed refusals of hostile ones.

use fsdp::io::{self, torch_save};
use std::path::PathBuf;

#[path = "../../tests/common/mod.rs"]
mod common;
mod tool;
use tool::{fails, ok, run};

fn golden(p: &str) -> PathBuf {
    tool::golden("dcp").join(p)
}

#[test]
fn inspect_shows_keys_shapes_chunks_files_and_world_size() {
    let dir = golden("fsdp2_adam_ws4/ckpt");
    let text = ok(&run(&[&"inspect", &dir]));
    assert!(text.contains("world size 4"), "{text}");
    assert!(
        text.contains("model.net2.0.weight torch.float32 [3, 10] (4 chunks)"),
        "{text}"
    );
    assert!(text.contains("optim.param_groups.0.lr (object)"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&ok(&run(&[&"inspect", &dir, &"--json"]))).unwrap();
    assert_eq!(json["format"], "dcp");
    assert_eq!(json["world_size"], 4);
    let files = json["files"].as_array().unwrap();
    assert_eq!(files.len(), 4);
    for f in files {
        let name = f["name"].as_str().unwrap();
        let len = std::fs::metadata(dir.join(name)).unwrap().len();
        assert_eq!(f["bytes"], len, "{name}");
    }
    let w = json["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["key"] == "model.embed.weight")
        .unwrap();
    assert_eq!(w["shape"], serde_json::json!([10, 4]));
    assert_eq!(w["chunks"], 4);
}

#[test]
fn consolidate_writes_what_dcp_to_torch_save_writes_in_both_formats() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["fsdp1_orig_ws3", "dtensor_grid_ws4"] {
        let expected = torch_save::load(golden(name).join("expected.pt")).unwrap();
        let pt = tmp.path().join(format!("{name}.pt"));
        ok(&run(&[&"consolidate", &golden(name).join("ckpt"), &pt]));
        assert!(torch_save::load(&pt).unwrap().bit_eq(&expected), "{name}");
        let st = tmp.path().join(format!("{name}.safetensors"));
        ok(&run(&[&"consolidate", &golden(name).join("ckpt"), &st]));
        assert!(io::load(&st).unwrap().bit_eq(&expected), "{name}");
    }
}

#[test]
fn verify_passes_a_good_directory_and_names_key_and_file_of_a_bad_one() {
    let text = ok(&run(&[&"verify", &golden("fsdp2_sgd_ws2_frozen/ckpt")]));
    assert!(text.contains(": OK ("), "{text}");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(golden("fsdp2_adam_ws4/ckpt")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    std::fs::copy(golden("hostile/past_eof.metadata"), dir.join(".metadata")).unwrap();
    let out = run(&[&"verify", &dir]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains("model.net1.0.weight") && err.contains("__0_0.distcp"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let pt = tmp.path().join("out.pt");
    let out = run(&[&"consolidate", &dir, &pt]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!pt.exists());
}

#[test]
fn convert_to_dcp_writes_a_directory_that_consolidates_back_equal() {
    let tmp = tempfile::tempdir().unwrap();
    let input = golden("fsdp2_adamw_ws3_tied/expected.pt");
    let out = tmp.path().join("dcp_out");
    let _ = ok(&run(&[&"convert", &input, &out, &"--to", &"dcp"]));
    ok(&run(&[&"verify", &out]));
    let back = tmp.path().join("back.pt");
    ok(&run(&[&"consolidate", &out, &back]));
    let expected = torch_save::load(&input).unwrap();
    assert!(torch_save::load(&back).unwrap().bit_eq(&expected));
    // The output is now non-empty: a second convert is refused and leaves it alone.
    let again = run(&[&"convert", &input, &out, &"--to", &"dcp"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("is not an empty directory"));
    // DCP -> the crate's format without the model is refused with a typed error naming it.
    let refused = run(&[&"convert", &out, &tmp.path().join("ck"), &"--to", &"fsdp"]);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.starts_with("error: unsupported"), "{stderr}");
    assert!(stderr.contains("--model DESC.json"), "{stderr}");
    assert!(!tmp.path().join("ck").exists());
}

#[test]
fn convert_to_dcp_removes_the_temporary_of_a_killed_run_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dcp_out");
    // A convert killed midway left its temporary directory (named after a process that is
    // gone) holding a partial data file.
    let dead = {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    let stale = tmp.path().join(format!(".dcp_out.tmp-{dead}-1"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("__0_0.distcp"), "half").unwrap();
    let input = golden("fsdp2_adamw_ws3_tied/expected.pt");
    let o = run(&[&"convert", &input, &out, &"--to", &"dcp"]);
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!(".dcp_out.tmp-{dead}-1")), "{err}");
    assert!(!stale.exists());
    ok(&run(&[&"verify", &out]));
    // Only the output is left: the writer's own temporary was renamed into place.
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("dcp_out")]);
}

#[test]
fn convert_a_pytorch_dcp_directory_to_a_checkpoint_for_three_ranks_keeps_its_optimizer_state() {
    use fsdp::commands::rank_dicts::DescFile;
    use fsdp::{DType, ModelDesc, WrapPolicy};
    // gen.py's Net (untied, nothing frozen), wrapped as FSDP1 wraps it: net1, net2, the root.
    let f = DType::F32;
    let model = common::dcp_fixture_net();
    let policy = WrapPolicy::units(&["net1", "net2", ""]);
    let tmp = tempfile::tempdir().unwrap();
    let desc = tmp.path().join("desc.json");
    std::fs::write(&desc, DescFile::new(model, policy).to_json()).unwrap();
    let ckpt = tmp.path().join("ckpt");
    let input = golden("fsdp2_adam_ws4/ckpt");
    ok(&run(&[
        &"convert",
        &input,
        &ckpt,
        &"--to",
        &"fsdp",
        &"--model",
        &desc,
        &"--world-size",
        &"3",
    ]));
    ok(&run(&[&"verify", &ckpt]));
    let back = tmp.path().join("back.pt");
    ok(&run(&[&"consolidate", &ckpt, &back]));
    let got = torch_save::optim_from_pyobj(torch_save::load(&back).unwrap()).unwrap();
    let expected = torch_save::load(golden("fsdp2_adam_ws4/expected.pt")).unwrap();
    let want = torch_save::optim_from_pyobj(expected.get("optim").cloned().unwrap()).unwrap();
    assert_eq!(got.state, want.state);
    let (g, w) = (got.param_groups.unwrap(), want.param_groups.unwrap());
    assert_eq!(g.len(), w.len());
    for (g, w) in g.iter().zip(&w) {
        assert_eq!(g.options, w.options);
        let set =
            |p: &[fsdp::ParamKey]| p.iter().cloned().collect::<std::collections::HashSet<_>>();
        assert_eq!(set(&g.params), set(&w.params));
    }
    // A model that does not fit the directory: a typed error naming the key, no output.
    let wrong = ModelDesc::new().param("embed.weight", &[4, 10], f);
    std::fs::write(
        &desc,
        DescFile::new(wrong, WrapPolicy::units(&[""])).to_json(),
    )
    .unwrap();
    let out2 = tmp.path().join("ckpt2");
    let refused = run(&[
        &"convert",
        &input,
        &out2,
        &"--to",
        &"fsdp",
        &"--model",
        &desc,
        &"--world-size",
        &"2",
    ]);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("optim.state.embed.weight."), "{stderr}");
    assert!(!out2.exists());
}

#[test]
fn convert_a_sharded_checkpoint_to_dcp_keeps_its_full_dict() {
    use fsdp::collectives::ThreadGroup;
    use fsdp::{
        DType, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, Value, WrapPolicy,
    };
    use std::sync::Arc;
    let model = ModelDesc::new()
        .param("embed.weight", &[5, 3], DType::F32)
        .param("layers.0.weight", &[3, 3], DType::F32);
    let policy = WrapPolicy::units(&["layers.0", ""]);
    let mut full = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let mut st = ParamState::new();
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(2.0f32)));
        let n: usize = p.shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|j| (i * 100 + j) as f32 * 0.5).collect();
        st.insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::from_slice(&vals, &p.shape).unwrap()),
        );
        full.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    full.param_groups = None;
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.save_optim_checkpoint(&local, &params, &ckpt, &Default::default())
            .unwrap();
    });
    let out = tmp.path().join("as_dcp");
    ok(&run(&[&"convert", &ckpt, &out, &"--to", &"dcp"]));
    let back = tmp.path().join("back.pt");
    ok(&run(&[&"consolidate", &out, &back]));
    let opts = fsdp::checkpoint::LoadOptions::default();
    let want =
        torch_save::optim_to_pyobj(&fsdp::checkpoint::load_full(&ckpt, &opts).unwrap()).unwrap();
    let got = torch_save::load(&back).unwrap();
    assert!(got.bit_eq(&want), "{got:?}\n{want:?}");
}

/// A fixture of `tests/golden/dcp_forms/` (every form `FileSystemWriter` writes).
fn form(p: &str) -> PathBuf {
    tool::golden("dcp_forms").join(p)
}

#[test]
fn inspect_verify_and_consolidate_every_writer_form_pytorch_reads() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["zstd_ws3", "per_item_ws2", "threads_ws3"] {
        let dir = form(&format!("{name}/ckpt"));
        let expected = torch_save::load(form(&format!("{name}/expected.pt"))).unwrap();
        let text = ok(&run(&[&"inspect", &dir]));
        assert_eq!(
            text.contains("through stream.zstd/1"),
            name == "zstd_ws3",
            "{name}: {text}"
        );
        assert!(ok(&run(&[&"verify", &dir])).contains("OK"), "{name}");
        let pt = tmp.path().join(format!("{name}.pt"));
        ok(&run(&[&"consolidate", &dir, &pt]));
        assert!(torch_save::load(&pt).unwrap().bit_eq(&expected), "{name}");
        let st = tmp.path().join(format!("{name}.safetensors"));
        ok(&run(&[&"consolidate", &dir, &st]));
        assert!(io::load(&st).unwrap().bit_eq(&expected), "{name}");
    }
}

#[test]
fn a_safetensors_serialized_directory_is_refused_by_every_command() {
    let dir = form("safetensors_ws2/ckpt");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.pt");
    for args in [
        vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &dir],
        vec![&"verify", &dir],
        vec![&"consolidate", &dir, &out],
    ] {
        let res = run(&args);
        assert_eq!(res.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert!(
            stderr.contains("serialization_format=SerializationFormat.SAFETENSORS"),
            "{stderr}"
        );
        assert!(
            stderr.contains("PyTorch 2.13 cannot read it either"),
            "{stderr}"
        );
    }
    assert!(!out.exists());
}

#[test]
fn convert_a_compressed_pytorch_directory_to_a_checkpoint_keeps_its_optimizer_state() {
    use fsdp::commands::rank_dicts::DescFile;
    use fsdp::WrapPolicy;
    let tmp = tempfile::tempdir().unwrap();
    let desc = tmp.path().join("desc.json");
    let policy = WrapPolicy::units(&["net1", "net2", ""]);
    std::fs::write(
        &desc,
        DescFile::new(common::dcp_fixture_net(), policy).to_json(),
    )
    .unwrap();
    let ckpt = tmp.path().join("ckpt");
    let input = form("zstd_ws3/ckpt");
    ok(&run(&[
        &"convert",
        &input,
        &ckpt,
        &"--to",
        &"fsdp",
        &"--model",
        &desc,
        &"--world-size",
        &"2",
    ]));
    let back = tmp.path().join("back.pt");
    ok(&run(&[&"consolidate", &ckpt, &back]));
    let got = torch_save::optim_from_pyobj(torch_save::load(&back).unwrap()).unwrap();
    let expected = torch_save::load(form("zstd_ws3/expected.pt")).unwrap();
    let want = torch_save::optim_from_pyobj(expected.get("optim").cloned().unwrap()).unwrap();
    assert_eq!(got.state, want.state);
}

#[test]
fn convert_to_dcp_with_compress_zstd_writes_frames_that_read_back_equal() {
    let tmp = tempfile::tempdir().unwrap();
    let input = form("zstd_ws3/expected.pt");
    let out = tmp.path().join("dcp");
    let res = run(&[
        &"convert",
        &input,
        &out,
        &"--to",
        &"dcp",
        &"--compress",
        &"zstd",
    ]);
    ok(&res);
    let said = String::from_utf8_lossy(&res.stderr);
    assert!(said.contains("(zstd)"), "{said}");
    assert!(ok(&run(&[&"inspect", &out])).contains("through stream.zstd/1"));
    ok(&run(&[&"verify", &out]));
    let back = tmp.path().join("back.pt");
    ok(&run(&[&"consolidate", &out, &back]));
    let expected = torch_save::load(&input).unwrap();
    assert!(torch_save::load(&back).unwrap().bit_eq(&expected));
    // --compress belongs to --to dcp; an algorithm other than zstd is a usage error.
    let other = tmp.path().join("other.safetensors");
    let res = run(&[&"convert", &input, &other, &"--compress", &"zstd"]);
    assert_eq!(res.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&res.stderr).contains("--compress applies to"));
    assert!(!other.exists());
    let res = run(&[
        &"convert",
        &input,
        &tmp.path().join("lz4"),
        &"--to",
        &"dcp",
        &"--compress",
        &"lz4",
    ]);
    assert_eq!(res.status.code(), Some(2));
}

// ----- DCP directories whose metadata is not one `.metadata` (tests/golden/dcp_sources) -----

fn source(p: &str) -> PathBuf {
    tool::golden("dcp_sources").join(p)
}

#[test]
fn per_rank_metadata_is_inspected_verified_consolidated_and_converted() {
    let dir = source("per_rank_ws3/ckpt");
    let text = ok(&run(&[&"inspect", &dir]));
    assert!(
        text.contains("3 per-rank `__{rank}.metadata` files"),
        "{text}"
    );
    assert!(
        text.contains("world size 3 (from the metadata files)"),
        "{text}"
    );
    assert!(
        text.contains("model.fc2.weight torch.float32 [5, 6] (3 chunks)"),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&ok(&run(&[&"inspect", &dir, &"--json"]))).unwrap();
    assert_eq!(json["source"]["kind"], "per_rank");
    assert_eq!(json["world_size"], 3);
    assert!(ok(&run(&[&"verify", &dir])).contains(": OK ("));
    // The saving run's full get_state_dict, which PyTorch's dcp_to_torch_save does not give.
    let expected = torch_save::load(source("per_rank_ws3/expected.pt")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pt = tmp.path().join("full.pt");
    ok(&run(&[&"consolidate", &dir, &pt]));
    assert!(torch_save::load(&pt).unwrap().bit_eq(&expected));
    let st = tmp.path().join("full.safetensors");
    ok(&run(&[&"consolidate", &dir, &st]));
    assert!(io::load(&st).unwrap().bit_eq(&expected));
    // One `.metadata`, read back equal.
    let global = tmp.path().join("global");
    ok(&run(&[&"convert", &dir, &global, &"--to", &"dcp"]));
    assert!(global.join(".metadata").is_file());
    let back = tmp.path().join("back.pt");
    ok(&run(&[&"consolidate", &global, &back]));
    assert!(torch_save::load(&back).unwrap().bit_eq(&expected));
    // The crate's checkpoint for 2 ranks keeps the optimizer state.
    use fsdp::commands::rank_dicts::DescFile;
    use fsdp::{DType, ModelDesc, WrapPolicy};
    let f = DType::F32;
    let model = ModelDesc::new()
        .param("fc1.weight", &[6, 3], f)
        .param("fc1.bias", &[6], f)
        .param("fc2.weight", &[5, 6], f)
        .param("fc2.bias", &[5], f)
        .param("out.weight", &[1, 5], f)
        .param("out.bias", &[1], f);
    let desc = tmp.path().join("desc.json");
    std::fs::write(
        &desc,
        DescFile::new(model, WrapPolicy::units(&["fc1", "fc2", "out", ""])).to_json(),
    )
    .unwrap();
    let ckpt = tmp.path().join("ckpt");
    ok(&run(&[
        &"convert",
        &dir,
        &ckpt,
        &"--to",
        &"fsdp",
        &"--model",
        &desc,
        &"--world-size",
        &"2",
    ]));
    ok(&run(&[&"verify", &ckpt]));
    let optim = tmp.path().join("optim.pt");
    ok(&run(&[&"consolidate", &ckpt, &optim]));
    let got = torch_save::optim_from_pyobj(torch_save::load(&optim).unwrap()).unwrap();
    let want = torch_save::optim_from_pyobj(expected.get("optim").cloned().unwrap()).unwrap();
    assert_eq!(got.state, want.state);
}

#[test]
fn per_rank_metadata_with_a_rank_missing_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(source("per_rank_ws3/ckpt")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    std::fs::remove_file(dir.join("__1.metadata")).unwrap();
    let pt = tmp.path().join("out.pt");
    for args in [
        vec![&"verify" as &dyn AsRef<std::ffi::OsStr>, &dir],
        vec![&"consolidate", &dir, &pt],
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("`__1.metadata` is missing"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(!pt.exists());
}

#[test]
fn every_hf_storage_form_is_inspected_verified_and_consolidated_as_pytorch_loads_it() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, says) in [
        ("hf_rank0", "saved by rank 0"),
        ("hf_rank0_mapped", "saved by rank 0"),
        ("hf_distributed", "saved by every rank"),
        ("hf_distributed_mapped", "saved by every rank"),
        ("hf_consolidated", "`sharded/` shards are read"),
    ] {
        let dir = source(name).join("ckpt");
        let text = ok(&run(&[&"inspect", &dir]));
        assert!(text.contains(says), "{name}: {text}");
        assert!(text.contains("head.weight torch.bfloat16 [4, 2]"), "{text}");
        assert!(ok(&run(&[&"verify", &dir])).contains("7 tensors"), "{name}");
        let expected = torch_save::load(source(name).join("expected.pt")).unwrap();
        let pt = tmp.path().join(format!("{name}.pt"));
        ok(&run(&[&"consolidate", &dir, &pt]));
        assert!(torch_save::load(&pt).unwrap().bit_eq(&expected), "{name}");
        let st = tmp.path().join(format!("{name}.safetensors"));
        ok(&run(&[&"consolidate", &dir, &st]));
        assert!(io::load(&st).unwrap().bit_eq(&expected), "{name}");
        let global = tmp.path().join(format!("{name}_dcp"));
        ok(&run(&[&"convert", &dir, &global, &"--to", &"dcp"]));
        let back = tmp.path().join(format!("{name}_back.pt"));
        ok(&run(&[&"consolidate", &global, &back]));
        assert!(torch_save::load(&back).unwrap().bit_eq(&expected), "{name}");
    }
}

#[test]
fn a_plain_hugging_face_directory_is_not_read_as_dcp() {
    // hf_consolidated's merged files alone: no DCP_SHARDING_INFO, a model directory.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(source("hf_consolidated/ckpt")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    let shown = ok(&run(&[&"inspect", &dir]));
    assert!(shown.starts_with("Hugging Face model:"), "{shown}");
    let out = run(&[&"verify", &dir]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is a Hugging Face model directory"), "{err}");
}

/// A copy of the zstd fixture with `tests/golden/dcp_forms/hostile/CASE.metadata` and the
/// hostile data files, in a fresh temporary directory (`<tmp>/ckpt`).
fn hostile_zstd(case: &str) -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = common::copy_dir(&form("zstd_ws3/ckpt"), "ckpt");
    let hostile = form("hostile");
    std::fs::copy(
        hostile.join(format!("{case}.metadata")),
        dir.join(".metadata"),
    )
    .unwrap();
    std::fs::copy(hostile.join("frames.distcp"), dir.join("frames.distcp")).unwrap();
    (tmp, dir)
}

#[test]
fn hostile_compressed_items_exit_1_naming_key_and_file_with_nothing_left_behind() {
    use fsdp::commands::rank_dicts::DescFile;
    use fsdp::WrapPolicy;
    for (case, key, file) in [
        // 64 GiB declared in a few hundred compressed bytes: was an abort (SIGABRT) after a
        // failed 64 GiB allocation, and consolidate left a 64 GiB sparse temporary.
        ("huge_declared", "model.net2.0.bias", "__0_0.distcp"),
        // A frame, then a second frame: verify said OK and consolidate used the first.
        (
            "trailing_second_frame",
            "model.net1.0.weight",
            "frames.distcp",
        ),
        // A frame, then one inflating to a gibibyte.
        ("trailing_gib_frame", "model.net1.0.weight", "frames.distcp"),
        // A second frame in an optimizer state's item, which `--to fsdp` reads (it reads no
        // model weight).
        (
            "trailing_second_frame_optim",
            "optim.state.net1.0.weight.exp_avg",
            "frames.distcp",
        ),
    ] {
        let (tmp, dir) = hostile_zstd(case);
        let desc = tmp.path().join("desc.json");
        let policy = WrapPolicy::units(&["net1", "net2", ""]);
        std::fs::write(
            &desc,
            DescFile::new(common::dcp_fixture_net(), policy).to_json(),
        )
        .unwrap();
        let (pt, st, hf, fsdp) = (
            tmp.path().join("a.pt"),
            tmp.path().join("a.safetensors"),
            tmp.path().join("hf"),
            tmp.path().join("fsdp"),
        );
        let runs: [Vec<&dyn AsRef<std::ffi::OsStr>>; 5] = [
            vec![&"verify", &dir],
            vec![&"consolidate", &dir, &pt],
            vec![&"consolidate", &dir, &st],
            vec![&"convert", &dir, &hf, &"--to", &"hf"],
            vec![
                &"convert",
                &dir,
                &fsdp,
                &"--to",
                &"fsdp",
                &"--model",
                &desc,
                &"--world-size",
                &"2",
            ],
        ];
        for args in runs {
            let to_fsdp = args.len() > 5;
            // `--to fsdp` reads the optimizer state only (a model weight's item is not read).
            // `--to hf` reads the model weights only.
            let to_hf = args.len() == 5;
            if to_fsdp != case.ends_with("optim") && (to_fsdp || to_hf) {
                continue;
            }
            let res = run(&args);
            let key_named = format!("key `{key}`");
            let file_named = format!("file `{file}`");
            let needles = [key_named.as_str(), file_named.as_str()];
            fails(&res, &needles);
            // Nothing is left: no output, no temporary (a failure after `--to hf` started
            // writing removes its shards too).
            let mut names: Vec<_> = std::fs::read_dir(tmp.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            assert_eq!(
                names,
                ["ckpt", "desc.json"],
                "{case}: {:?}",
                args[0].as_ref()
            );
        }
        // inspect reads the metadata only.
        ok(&run(&[&"inspect", &dir]));
    }
}
