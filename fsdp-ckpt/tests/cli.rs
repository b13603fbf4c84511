//! The `fsdp-ckpt` binary, run as a user runs it: inspect, convert (with Python's
//! `safetensors` reading the result), consolidate-torch and shard-torch against the crate's
//! own thread ranks and against real PyTorch FSDP output (`tests/golden/fsdp_ckpt/`), and the
//! error paths (typed message, exit code 1, never a panic).

#[path = "../../tests/common/mod.rs"]
mod common;

use common::{full_adam, nested_model, transformer_model, transformer_policy, wrap};
use fsdp::collectives::ThreadGroup;
use fsdp::commands::rank_dicts::DescFile;
use fsdp::io::torch_save::{self, optim_to_pyobj};
use fsdp::{DType, Fsdp, ModelDesc, OptimStateDict, WrapPolicy};
use indexmap::IndexMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

mod tool;
use tool::{golden, ok, run};

/// A failure with a typed message naming `needle` and exit code 1, not a panic.
fn fails(out: &Output, needle: &str) {
    tool::fails(out, &[needle]);
}

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("FSDP_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(".venv/bin/python");
    if venv.exists() {
        return venv;
    }
    panic!(
        "no Python with PyTorch and safetensors found: set FSDP_PYTHON, or run \
         scripts/setup-venv.sh to create .venv in the crate root; this test checks that \
         Python's safetensors reads the files fsdp-ckpt writes and is never skipped"
    );
}

fn same(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    let (pa, pb) = (optim_to_pyobj(a).unwrap(), optim_to_pyobj(b).unwrap());
    assert!(pa.bit_eq(&pb), "{what}: dicts differ\n{pa:?}\n!=\n{pb:?}");
}

// ----- inspect -----

#[test]
fn inspect_shows_keys_states_steps_groups_and_bytes() {
    let f = golden("torch_save/adam_int_keys.pt");
    let text = ok(&run(&[&"inspect", &f]));
    for needle in [
        "kind: optimizer state dict",
        "state: 4 keys (key types: int)",
        "state names: step, exp_avg, exp_avg_sq",
        "steps: 2.0 (4 keys)",
        "exp_avg: float32 [4, 3]",
        "param_groups: 2",
        "lr=0.0005",
        "weight_decay=0.01",
        "params (2): [2, 3]",
        "tensors: 12",
        "total tensor bytes: 224 B",
    ] {
        assert!(text.contains(needle), "`{needle}` not in:\n{text}");
    }

    let json: serde_json::Value = serde_json::from_str(&ok(&run(&[&"inspect", &"--json", &f])))
        .expect("inspect --json prints JSON");
    assert_eq!(json["kind"], "optimizer");
    assert_eq!(json["format"], "torch.save");
    assert_eq!(json["total_tensor_bytes"], 224);
    let o = &json["optimizer"];
    assert_eq!(o["key_types"], serde_json::json!(["int"]));
    assert_eq!(o["keys"].as_array().unwrap().len(), 4);
    assert_eq!(
        o["keys"][0]["state"][1]["tensor"]["shape"],
        serde_json::json!([4, 3])
    );
    assert_eq!(o["steps"][0]["value"], 2.0);
    assert_eq!(o["param_groups"][1]["options"]["lr"], 0.0005);
    // Hyper-parameters keep the optimizer's order (the text shows it; a JSON parser may not).
    assert!(text.contains("  [1] lr=0.0005 betas=[0.8,0.99]"), "{text}");

    let text = ok(&run(&[&"inspect", &golden("torch_save/named_state.pt")]));
    assert!(text.contains("key types: str"), "{text}");
    let text = ok(&run(&[&"inspect", &golden("torch_save/model_state.pt")]));
    assert!(text.contains("kind: model state dict"), "{text}");
    assert!(
        text.contains("1.num_batches_tracked  int64 [] = 1"),
        "{text}"
    );
}

// ----- convert -----

const CONVERTED: [&str; 6] = [
    "adam_int_keys",
    "named_state",
    "model_state",
    "dtypes",
    "misc",
    "views",
];

#[test]
fn convert_round_trips_and_python_safetensors_reads_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    for name in CONVERTED {
        let pt = golden(&format!("torch_save/{name}.pt"));
        let st = dir.path().join(format!("{name}.safetensors"));
        let back = dir.path().join(format!("{name}.pt"));
        ok(&run(&[&"convert", &pt, &st]));
        ok(&run(&[&"convert", &st, &back]));
        let a = torch_save::load(&pt).unwrap();
        assert!(
            fsdp::io::safetensors::load(&st).unwrap().bit_eq(&a),
            "{name}: .safetensors differs"
        );
        assert!(
            torch_save::load(&back).unwrap().bit_eq(&a),
            "{name}: .pt -> .safetensors -> .pt differs"
        );
        // Inspect reads safetensors too and sees the same thing.
        let i1 = ok(&run(&[&"inspect", &"--json", &pt]));
        let i2 = ok(&run(&[&"inspect", &"--json", &st]));
        let strip = |s: &str| {
            let mut v: serde_json::Value = serde_json::from_str(s).unwrap();
            let m = v.as_object_mut().unwrap();
            m.remove("file");
            m.remove("format");
            v
        };
        assert_eq!(strip(&i1), strip(&i2), "{name}: inspect differs");
    }
    // Python's safetensors loads every tensor under its documented name, bit for bit.
    let python = python();
    let out = Command::new(&python)
        .arg(golden("check_safetensors.py"))
        .arg(dir.path())
        .args(CONVERTED.map(|n| golden(&format!("torch_save/{n}.pt"))))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "Python rejected a safetensors file ({}):\n{stdout}\n{}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        CONVERTED.len(),
        "{stdout}"
    );
}

// ----- consolidate-torch and shard-torch against thread ranks -----

/// Each rank's local dict (`shard_full_optim_state_dict` on thread ranks) and the dict
/// `full_optim_state_dict` gives from them.
fn reference(
    spec: &DescFile,
    full: &OptimStateDict,
    ws: usize,
) -> (Vec<OptimStateDict>, OptimStateDict) {
    let out = ThreadGroup::run(ws, |pg| {
        let fsdp = Fsdp::new(&spec.model, &spec.policy, Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(full, &params).unwrap();
        let back = fsdp.full_optim_state_dict(&local, &params, true).unwrap();
        (local, back)
    });
    let consolidated = out[0].1.clone().unwrap();
    (out.into_iter().map(|(l, _)| l).collect(), consolidated)
}

fn cases() -> Vec<(&'static str, DescFile, usize)> {
    vec![
        (
            "nested flat ws2",
            DescFile::new(nested_model(), wrap(false)),
            2,
        ),
        (
            "nested ignored ws3",
            DescFile::new(nested_model(), wrap(true)),
            3,
        ),
        (
            "nested orig ws3",
            DescFile::new(nested_model(), wrap(false).with_orig_params(true)),
            3,
        ),
        (
            "transformer tied ws2",
            DescFile::new(transformer_model(), transformer_policy()),
            2,
        ),
    ]
}

#[test]
fn consolidate_and_shard_match_the_thread_ranks_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (what, spec, ws)) in cases().into_iter().enumerate() {
        let d = dir.path().join(format!("case{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let desc = d.join("desc.json");
        std::fs::write(&desc, spec.to_json()).unwrap();
        let full = full_adam(&spec.model);
        let (locals, consolidated) = reference(&spec, &full, ws);
        common::assert_same_state(&consolidated, &full, what);
        let mut ranks = vec![];
        for (r, l) in locals.iter().enumerate() {
            let p = d.join(format!("rank{r}.pt"));
            torch_save::save_optim_state_dict(l, &p).unwrap();
            ranks.push(p);
        }

        // consolidate-torch, to torch.save and to safetensors.
        for out_name in ["full.pt", "full.safetensors"] {
            let out = d.join(out_name);
            let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
                vec![&"consolidate-torch", &"--model", &desc, &"-o", &out];
            args.extend(ranks.iter().map(|r| r as &dyn AsRef<std::ffi::OsStr>));
            ok(&run(&args));
            let got = torch_save::optim_from_pyobj(fsdp::io::load(&out).unwrap()).unwrap();
            same(
                &got,
                &consolidated,
                &format!("{what}: consolidate-torch -> {out_name}"),
            );
        }

        // shard-torch of the consolidated dict gives each rank's dict from it.
        let (locals, _) = reference(&spec, &consolidated, ws);
        let shard_dir = d.join("shards");
        let ws_s = ws.to_string();
        ok(&run(&[
            &"shard-torch",
            &"--model",
            &desc,
            &d.join("full.pt"),
            &"--world-size",
            &ws_s,
            &"-o",
            &shard_dir,
        ]));
        for (r, l) in locals.iter().enumerate() {
            let got =
                torch_save::load_optim_state_dict(shard_dir.join(format!("rank{r}.pt"))).unwrap();
            same(&got, l, &format!("{what}: shard-torch rank {r}"));
        }
    }
}

// ----- against real PyTorch FSDP (tests/golden/fsdp_ckpt_fixtures.py) -----

/// Equal values, ignoring the order of each parameter's state names, which PyTorch's loading
/// takes from a Python set (hash-seed dependent; the crate's order is documented).
fn same_ignoring_state_order(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    assert_eq!(
        a.state.keys().collect::<Vec<_>>(),
        b.state.keys().collect::<Vec<_>>(),
        "{what}: keys"
    );
    for (k, sa) in &a.state {
        let sb = &b.state[k];
        let mut na: Vec<_> = sa.keys().collect();
        let mut nb: Vec<_> = sb.keys().collect();
        na.sort();
        nb.sort();
        assert_eq!(na, nb, "{what}: state names of {k}");
        for (n, v) in sa {
            assert!(v.same_scalar(&sb[n]), "{what}: state {k}/{n} differs");
        }
    }
    let ga = optim_to_pyobj(&OptimStateDict {
        state: IndexMap::new(),
        param_groups: a.param_groups.clone(),
    })
    .unwrap();
    let gb = optim_to_pyobj(&OptimStateDict {
        state: IndexMap::new(),
        param_groups: b.param_groups.clone(),
    })
    .unwrap();
    assert!(ga.bit_eq(&gb), "{what}: param_groups differ");
}

#[test]
fn consolidate_and_shard_match_pytorch_fsdp() {
    let dir = tempfile::tempdir().unwrap();
    for case in ["flat", "orig"] {
        let g = |f: &str| golden(&format!("fsdp_ckpt/{case}/{f}"));
        let out = dir.path().join(format!("{case}.pt"));
        ok(&run(&[
            &"consolidate-torch",
            &"--model",
            &g("desc.json"),
            &g("rank0.pt"),
            &g("rank1.pt"),
            &"-o",
            &out,
        ]));
        // The whole object, order included, as PyTorch wrote it.
        let expected = torch_save::load(g("full.pt")).unwrap();
        assert!(
            torch_save::load(&out).unwrap().bit_eq(&expected),
            "{case}: consolidate-torch differs from FSDP's full dict"
        );

        let shards = dir.path().join(format!("{case}-shards"));
        ok(&run(&[
            &"shard-torch",
            &"--model",
            &g("desc.json"),
            &g("full.pt"),
            &"--world-size",
            &"2",
            &"-o",
            &shards,
        ]));
        for r in 0..2 {
            let got =
                torch_save::load_optim_state_dict(shards.join(format!("rank{r}.pt"))).unwrap();
            let want = torch_save::load_optim_state_dict(g(&format!("shard{r}.pt"))).unwrap();
            same_ignoring_state_order(&got, &want, &format!("{case} shard rank {r}"));
        }
    }
}

// ----- errors -----

#[test]
fn errors_are_typed_messages_with_exit_code_1() {
    let dir = tempfile::tempdir().unwrap();
    let g = |f: &str| golden(&format!("fsdp_ckpt/flat/{f}"));
    let out = dir.path().join("full.pt");

    // Missing files.
    fails(&run(&[&"inspect", &dir.path().join("nope.pt")]), "nope.pt");
    fails(
        &run(&[
            &"consolidate-torch",
            &"--model",
            &g("desc.json"),
            &g("rank0.pt"),
            &dir.path().join("rank9.pt"),
            &"-o",
            &out,
        ]),
        "rank9.pt",
    );
    fails(
        &run(&[
            &"consolidate-torch",
            &"--model",
            &dir.path().join("nodesc.json"),
            &g("rank0.pt"),
            &"-o",
            &out,
        ]),
        "nodesc.json",
    );
    // Unknown extension.
    fails(
        &run(&[
            &"convert",
            &golden("torch_save/misc.pt"),
            &dir.path().join("x.npz"),
        ]),
        "cannot tell the format",
    );
    // Wrong world size: one of the two rank files, or the first twice plus another.
    fails(
        &run(&[
            &"consolidate-torch",
            &"--model",
            &g("desc.json"),
            &g("rank0.pt"),
            &"-o",
            &out,
        ]),
        "1 per-rank files were given, but rank 0's state",
    );
    let e = run(&[
        &"consolidate-torch",
        &"--model",
        &g("desc.json"),
        &g("rank0.pt"),
        &g("rank1.pt"),
        &g("rank1.pt"),
        &"-o",
        &out,
    ]);
    fails(&e, "fits world size(s) [2]");
    // A model description that does not match the files.
    let other = DescFile::new(
        ModelDesc::new()
            .param("a.weight", &[7, 3], DType::F32)
            .param("b.weight", &[2], DType::F32),
        WrapPolicy::units(&["a", ""]),
    );
    let desc = dir.path().join("other.json");
    std::fs::write(&desc, other.to_json()).unwrap();
    fails(
        &run(&[
            &"consolidate-torch",
            &"--model",
            &desc,
            &g("rank0.pt"),
            &g("rank1.pt"),
            &"-o",
            &out,
        ]),
        "another model description",
    );
    // A description naming a unit the model lacks.
    std::fs::write(
        &desc,
        r#"{"model": {"params": [{"name": "a.w", "shape": [2], "dtype": "f32"}]}, "policy": {"units": ["zzz"]}}"#,
    )
    .unwrap();
    fails(
        &run(&[
            &"shard-torch",
            &"--model",
            &desc,
            &g("full.pt"),
            &"--world-size",
            &"2",
            &"-o",
            &dir.path(),
        ]),
        "`zzz`",
    );
    // Not a model spec at all.
    std::fs::write(&desc, "{}").unwrap();
    fails(
        &run(&[
            &"shard-torch",
            &"--model",
            &desc,
            &g("full.pt"),
            &"--world-size",
            &"2",
            &"-o",
            &dir.path(),
        ]),
        "model spec",
    );
    // A model state dict where an optimizer state dict is needed.
    fails(
        &run(&[
            &"shard-torch",
            &"--model",
            &g("desc.json"),
            &golden("torch_save/model_state.pt"),
            &"--world-size",
            &"2",
            &"-o",
            &dir.path(),
        ]),
        "unexpected object",
    );
    assert!(!out.exists(), "no output is written on failure");
}

#[test]
fn readme_desc_json_example_is_a_valid_model_spec() {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("```json\n{\n  \"model\"")
        .expect("README has the DESC.json example")
        + "```json\n".len();
    let len = readme[start..].find("```").unwrap();
    let spec = DescFile::from_json(&readme[start..start + len], "README.md").unwrap();
    let layout = spec.layout(2).unwrap();
    assert_eq!(
        spec.optim_params_for(&layout, 0).unwrap(),
        fsdp::OptimParams::of_model(&layout)
    );
}

// ----- sharded checkpoint directories -----

#[test]
fn checkpoint_commands_reshard_consolidate_verify_and_inspect() {
    let model = nested_model();
    let full = full_adam(&model);
    let root = tempfile::tempdir().unwrap();
    let ckpt = root.path().join("ckpt8");
    let consolidated = ThreadGroup::run(8, |pg| {
        let fsdp = Fsdp::new(&model, &wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.save_optim_checkpoint(&local, &params, &ckpt, &Default::default())
            .unwrap();
        fsdp.full_optim_state_dict(&local, &params, true).unwrap()
    })
    .swap_remove(0)
    .unwrap();

    let text = ok(&run(&[&"inspect", &ckpt]));
    assert!(
        text.contains("world size 8") && text.contains("16 parameters with state"),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&ok(&run(&[&"inspect", &"--json", &ckpt]))).unwrap();
    assert_eq!(json["world_size"], 8);
    assert!(ok(&run(&[&"verify", &ckpt])).contains("OK"));

    // Reshard to 3 ranks with the other wrapping, then consolidate both ways.
    let policy = root.path().join("alt.json");
    std::fs::write(&policy, serde_json::to_string(&common::wrap_alt()).unwrap()).unwrap();
    let ckpt3 = root.path().join("ckpt3");
    ok(&run(&[
        &"reshard",
        &ckpt,
        &ckpt3,
        &"--world-size",
        &"3",
        &"--policy",
        &policy,
    ]));
    assert_eq!(
        fsdp::checkpoint::read_manifest(&ckpt3).unwrap().world_size,
        3
    );
    for out in ["full.safetensors", "full.pt"] {
        let path = root.path().join(out);
        ok(&run(&[&"consolidate", &ckpt3, &path]));
        let back = fsdp::io::torch_save::optim_from_pyobj(fsdp::io::load(&path).unwrap()).unwrap();
        same(&back, &consolidated, out);
    }

    // A flipped data byte: verify and consolidate fail with the file and rank named.
    let file = ckpt3.join("rank2.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    fails(
        &run(&[&"verify", &ckpt3]),
        "rank2.safetensors` (rank 2) is corrupt",
    );
    fails(
        &run(&[
            &"consolidate",
            &ckpt3,
            &root.path().join("again.safetensors"),
        ]),
        "fails its checksum",
    );
    assert!(!root.path().join("again.safetensors").exists());
    fails(
        &run(&[&"verify", &root.path().join("missing")]),
        "No such file or directory",
    );
}
