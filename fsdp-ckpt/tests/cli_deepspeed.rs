//! `fsdp-ckpt` on DeepSpeed checkpoints (`tests/golden/deepspeed/`, written by DeepSpeed
//! 0.19.8): the contract forms `inspect DS_DIR`, `consolidate DS_DIR OUT`,
//! `consolidate DS_DIR OUT --optim` and `convert DS_DIR OUT_DIR --to dcp`, and `--optim`
//! refused for other inputs. (That PyTorch FSDP2 loads the DCP directory at other world sizes
//! and trains on from it is tests/it/deepspeed.rs's.)

use fsdp::io::{self, torch_save::PyObj};
use std::path::PathBuf;

mod tool;
use tool::{fails, ok, run};

fn golden(p: &str) -> PathBuf {
    tool::golden("deepspeed").join(p)
}

fn names(obj: &PyObj) -> Vec<String> {
    match obj {
        PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => items
            .iter()
            .map(|(k, _)| match k {
                PyObj::Str(s) => s.clone(),
                other => panic!("{other:?}"),
            })
            .collect(),
        other => panic!("{other:?}"),
    }
}

fn get<'a>(obj: &'a PyObj, key: &str) -> &'a PyObj {
    match obj {
        PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => items
            .iter()
            .find(|(k, _)| matches!(k, PyObj::Str(s) if s == key))
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no {key}")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn inspect_a_deepspeed_checkpoint_shows_stage_dtype_world_size_tag_parameters_and_states() {
    let text = ok(&run(&[&"inspect", &golden("zero3_bf16/ckpt")]));
    for needle in [
        "DeepSpeed ZeRO checkpoint",
        "(tag step3)",
        "ZeRO stage 3, model dtype torch.bfloat16, world size 2, optimizer DeepSpeedZeroOptimizer_Stage3",
        "8 parameters",
        "emb.weight [37, 12] group 0 step 3",
        "logit_scale [1] group 1 step 3",
        "pos_scale torch.float32 [12]",
        "head_lm.weight = emb.weight",
        "\"lr\":0.003",
    ] {
        assert!(text.contains(needle), "`{needle}` not in:\n{text}");
    }
    let json: serde_json::Value = serde_json::from_str(&ok(&run(&[
        &"inspect",
        &golden("zero2_fp32/ucp"),
        &"--json",
    ])))
    .unwrap();
    assert_eq!(json["form"], "universal");
    assert_eq!(json["stage"], 2);
    assert_eq!(json["dtype"], "torch.float32");
    assert_eq!(json["world_size"], 2);
    assert_eq!(json["tag"], "step3");
    assert_eq!(json["optimizer"], "DeepSpeedZeroOptimizer");
    let p = &json["params"][0];
    assert_eq!(p["name"], "emb.weight");
    assert_eq!(
        p["states"],
        serde_json::json!(["fp32", "exp_avg", "exp_avg_sq"])
    );
    assert_eq!(p["step"], 3.0);
    assert_eq!(
        json["param_groups"][1]["members"],
        serde_json::json!([
            "fc1.bias",
            "norm.weight",
            "norm.bias",
            "shift",
            "logit_scale"
        ])
    );
}

#[test]
fn inspect_a_lone_rank_file_reads_its_deepspeed_globals() {
    let file = golden("zero1_fp32/ckpt/step3/zero_pp_rank_1_mp_rank_00_optim_states.pt");
    let text = ok(&run(&[&"inspect", &file]));
    assert!(text.contains("single_partition_of_fp32_groups"), "{text}");
    // The same bytes under another name are an ordinary torch.save file.
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("state.pt");
    std::fs::copy(&file, &other).unwrap();
    fails(
        &run(&[&"inspect", &other]),
        &["unsupported Python global `deepspeed."],
    );
}

#[test]
fn consolidate_writes_zero_to_fp32s_weights_and_with_optim_the_adam_state() {
    let tmp = tempfile::tempdir().unwrap();
    for case in ["zero1_bf16", "zero2_fp32", "zero3_fp32"] {
        let expected = io::load(golden(case).join("expected_fp32.safetensors")).unwrap();
        let pt = tmp.path().join(format!("{case}.pt"));
        let msg = run(&[&"consolidate", &golden(case).join("ckpt"), &pt]);
        ok(&msg);
        assert!(
            String::from_utf8_lossy(&msg.stderr).contains("8 parameters"),
            "{}",
            String::from_utf8_lossy(&msg.stderr)
        );
        let got = io::load(&pt).unwrap();
        let mut a = names(&got);
        let mut b = names(&expected);
        a.sort();
        b.sort();
        assert_eq!(a, b, "{case}");
        for n in &b {
            assert!(get(&got, n).bit_eq(get(&expected, n)), "{case} {n}");
        }
        let full = tmp.path().join(format!("{case}_optim.safetensors"));
        ok(&run(&[
            &"consolidate",
            &golden(case).join("ckpt"),
            &full,
            &"--optim",
        ]));
        let got = io::load(&full).unwrap();
        assert_eq!(names(&got), ["model", "optim"]);
        let state = get(get(&got, "optim"), "state");
        let ucp = io::load(golden(case).join("ucp/step3/zero/fc1.weight/exp_avg_sq.pt")).unwrap();
        let want = match &ucp {
            PyObj::Tensor(t) => t.reshape(&[23, 12]).unwrap(),
            d => match get(d, "param") {
                PyObj::Tensor(t) => t.clone(),
                other => panic!("{other:?}"),
            },
        };
        assert!(
            get(get(state, "fc1.weight"), "exp_avg_sq").bit_eq(&PyObj::Tensor(want)),
            "{case}"
        );
    }
}

#[test]
fn convert_to_dcp_holds_the_model_and_adam_state_that_consolidate_optim_writes() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, input) in [
        ("zero1_bf16_fp32acc", "ckpt"),
        ("zero3_bf16", "ckpt/step3"),
        ("zero2_fp32", "ucp"),
    ] {
        let src = golden(case).join(input);
        let dcp = tmp.path().join(format!("{case}_dcp"));
        let msg = run(&[&"convert", &src, &dcp, &"--to", &"dcp"]);
        ok(&msg);
        assert!(
            String::from_utf8_lossy(&msg.stderr).contains("-> DCP directory"),
            "{}",
            String::from_utf8_lossy(&msg.stderr)
        );
        let summary = ok(&run(&[&"inspect", &dcp]));
        for key in [
            "model.head_lm.weight torch.float32 [37, 12]",
            "optim.state.emb.weight.step torch.float32 []",
            "optim.state.head.weight.exp_avg_sq torch.float32 [5, 23]",
            "optim.param_groups.1.lr",
        ] {
            assert!(summary.contains(key), "{case}: `{key}` not in\n{summary}");
        }
        let full = tmp.path().join(format!("{case}.pt"));
        ok(&run(&[&"consolidate", &src, &full, &"--optim"]));
        let loaded = io::dcp::DcpCheckpoint::open(&dcp).unwrap().load().unwrap();
        assert!(
            loaded.bit_eq(&io::load(&full).unwrap()),
            "{case}: the DCP directory holds other state than consolidate --optim writes"
        );
    }
}

#[test]
fn consolidate_optim_takes_only_deepspeed_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.pt");
    fails(
        &run(&[
            &"consolidate",
            &tool::golden("dcp/fsdp1_orig_ws3/ckpt"),
            &out,
            &"--optim",
        ]),
        &[
            "consolidate --optim takes a DeepSpeed checkpoint",
            "is a DCP directory",
        ],
    );
    assert!(!out.exists());
}

#[test]
fn consolidate_of_a_latest_naming_a_missing_tag_names_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("latest"), "global_step100").unwrap();
    let out = tmp.path().join("o.safetensors");
    fails(
        &run(&[&"consolidate", &dir, &out]),
        &["`latest` names the tag `global_step100`"],
    );
    assert!(!out.exists());
}

#[test]
fn frozen_parameters_are_inspected_consolidated_and_converted() {
    // Issue 40: `emb.weight` frozen (requires_grad=False), AdamW, ZeRO-3 bf16 at 3 ranks.
    let tmp = tempfile::tempdir().unwrap();
    let case = "frozen_zero3_bf16_ws3";
    let text = ok(&run(&[&"inspect", &golden(case).join("ckpt")]));
    for needle in [
        "world size 3",
        "7 parameters",
        "frozen parameters (requires_grad=False: no optimizer state; weights in their dtype):",
        "emb.weight torch.bfloat16 [37, 12]",
        "head_lm.weight = emb.weight",
    ] {
        assert!(text.contains(needle), "`{needle}` not in:\n{text}");
    }
    let expected = io::load(golden(case).join("expected_fp32.safetensors")).unwrap();
    let out = tmp.path().join("fp32.safetensors");
    ok(&run(&[&"consolidate", &golden(case).join("ucp"), &out]));
    let got = io::load(&out).unwrap();
    let sorted = |o: &PyObj| {
        let mut v = names(o);
        v.sort();
        v
    };
    assert_eq!(sorted(&got), sorted(&expected));
    for n in names(&expected) {
        assert!(get(&got, &n).bit_eq(get(&expected, &n)), "{n}");
    }
    let dcp = tmp.path().join("dcp");
    ok(&run(&[
        &"convert",
        &golden(case).join("ckpt"),
        &dcp,
        &"--to",
        &"dcp",
    ]));
    let summary = ok(&run(&[&"inspect", &dcp]));
    assert!(
        summary.contains("model.emb.weight torch.float32 [37, 12]"),
        "{summary}"
    );
    assert!(!summary.contains("optim.state.emb.weight"), "{summary}");
}
