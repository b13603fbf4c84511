//! DeepSpeed checkpoints read without DeepSpeed (`tests/golden/deepspeed/`, written by
//! DeepSpeed 0.19.8 and PyTorch 2.13 on 2 CPU ranks by `gen.py`): every ZeRO stage and dtype
//! consolidated equal bit for bit to DeepSpeed's own `zero_to_fp32`, the Adam state equal to
//! DeepSpeed's universal checkpoint, the DCP directory loaded by PyTorch FSDP2 at other world
//! sizes with training continuing from the run's state, and hostile inputs refused with typed
//! errors.

use crate::common::{files_of, python_script};
use fsdp::collectives::{Solo, ThreadGroup};
use fsdp::commands::conversions::{
    deepspeed_to_dcp, deepspeed_to_safetensors, deepspeed_to_torch_save, DeepSpeedOutput,
};
use fsdp::commands::{recognize, Input};
use fsdp::io::dcp::DcpWriteOptions;
use fsdp::io::deepspeed::{DeepSpeedCheckpoint, Form, State};
use fsdp::io::torch_save::{self, PyObj};
use fsdp::{DType, Error, HostTensor};
use std::path::{Path, PathBuf};

const CASES: [&str; 7] = [
    "zero1_fp32",
    "zero1_bf16",
    "zero2_fp32",
    "zero2_bf16",
    "zero3_fp32",
    "zero3_bf16",
    "zero1_bf16_fp32acc",
];

/// Issue 40: the frozen variant of the model (`emb.weight`, and with it the tied
/// `head_lm.weight`, `requires_grad=False`; `torch.optim.AdamW` over the rest in two groups),
/// every stage and dtype, at world sizes 2 and 3.
const FROZEN_CASES: [&str; 6] = [
    "frozen_zero1_fp32_ws2",
    "frozen_zero1_bf16_ws3",
    "frozen_zero2_fp32_ws3",
    "frozen_zero2_bf16_ws2",
    "frozen_zero3_fp32_ws2",
    "frozen_zero3_bf16_ws3",
];

fn golden(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/deepspeed")
        .join(case)
}

fn case_json(case: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(golden(case).join("case.json")).unwrap()).unwrap()
}

/// The items of a dict or `OrderedDict`, by string key.
fn entries(obj: &PyObj) -> Vec<(String, &PyObj)> {
    let items = match obj {
        PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => items,
        other => panic!("not a dict: {other:?}"),
    };
    items
        .iter()
        .map(|(k, v)| match k {
            PyObj::Str(k) => (k.clone(), v),
            other => panic!("key {other:?}"),
        })
        .collect()
}

fn field<'a>(obj: &'a PyObj, key: &str) -> &'a PyObj {
    entries(obj)
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no `{key}`"))
        .1
}

fn tensor(obj: &PyObj) -> &HostTensor {
    match obj {
        PyObj::Tensor(t) => t,
        other => panic!("not a tensor: {other:?}"),
    }
}

/// Same dtype, shape and bits.
fn assert_same(got: &HostTensor, want: &HostTensor, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}");
    assert_eq!(got.shape(), want.shape(), "{what}");
    assert!(got.as_bytes() == want.as_bytes(), "{what}: the bits differ");
}

/// `expected_fp32.safetensors`: what DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`
/// returned (from the universal checkpoint for `BF16_Optimizer`, which it refuses).
fn expected_fp32(case: &str) -> Vec<(String, HostTensor)> {
    let obj = fsdp::io::load(golden(case).join("expected_fp32.safetensors")).unwrap();
    entries(&obj)
        .into_iter()
        .map(|(k, v)| (k, tensor(v).clone()))
        .collect()
}

/// The order `zero_to_fp32` returns: buffers, then the frozen parameters, then the trained
/// ones group by group, then the tied aliases.
fn zero_to_fp32_order(case: &str) -> Vec<String> {
    let info = case_json(case);
    let mut names: Vec<String> = info["buffers"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    if let Some(frozen) = info["frozen"].as_object() {
        names.extend(frozen.keys().cloned());
    }
    for g in info["param_groups"].as_array().unwrap() {
        for m in g["members"].as_array().unwrap() {
            names.push(m.as_str().unwrap().to_string());
        }
    }
    names.extend(info["tied"].as_object().unwrap().keys().cloned());
    names
}

/// Checks a consolidated fp32 dict against DeepSpeed's: same names, same bits.
fn assert_equals_zero_to_fp32(got: &PyObj, case: &str, what: &str) {
    let got = entries(got);
    let mut got_names: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
    let expected = expected_fp32(case);
    let mut want_names: Vec<&str> = expected.iter().map(|(k, _)| k.as_str()).collect();
    got_names.sort();
    want_names.sort();
    assert_eq!(got_names, want_names, "{what}");
    for (name, want) in &expected {
        let (_, t) = got.iter().find(|(k, _)| k == name).unwrap();
        assert_same(tensor(t), want, &format!("{what} {name}"));
    }
}

#[test]
fn deepspeed_consolidate_every_stage_and_dtype_equals_zero_to_fp32() {
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let info = case_json(case);
        let tag = info["tag"].as_str().unwrap();
        // The root with `latest`, the tag directory, and the universal checkpoint's root.
        let inputs = [
            golden(case).join("ckpt"),
            golden(case).join("ckpt").join(tag),
            golden(case).join("ucp"),
        ];
        for (n, input) in inputs.iter().enumerate() {
            let what = format!("{case} input {}", input.display());
            let pt = tmp.path().join(format!("{case}_{n}.pt"));
            let st = tmp.path().join(format!("{case}_{n}.safetensors"));
            let bytes =
                deepspeed_to_torch_save(input, &pt, DeepSpeedOutput::default(), &Solo, |_| {})
                    .unwrap();
            let got = torch_save::load(&pt).unwrap();
            assert_equals_zero_to_fp32(&got, case, &what);
            // zero_to_fp32's order, and the tied alias is its parameter's tensor (one
            // storage in the file, as torch.save of zero_to_fp32's dict stores it).
            let names: Vec<String> = entries(&got).into_iter().map(|(k, _)| k).collect();
            assert_eq!(names, zero_to_fp32_order(case), "{what}");
            let (emb, lm) = (field(&got, "emb.weight"), field(&got, "head_lm.weight"));
            assert_eq!(
                tensor(emb).as_bytes().as_ptr(),
                tensor(lm).as_bytes().as_ptr(),
                "{what}: the tied alias is a copy"
            );
            let fp32_bytes: u64 = expected_fp32(case)
                .iter()
                .filter(|(k, _)| k != "head_lm.weight")
                .map(|(_, t)| t.nbytes() as u64)
                .sum();
            assert_eq!(bytes, fp32_bytes, "{what}");

            deepspeed_to_safetensors(input, &st, DeepSpeedOutput::default(), &Solo, |_| {})
                .unwrap();
            assert_equals_zero_to_fp32(&fsdp::io::load(&st).unwrap(), case, &what);
        }
    }
}

#[test]
fn deepspeed_to_dcp_loads_into_fsdp2_at_world_sizes_1_and_3_and_training_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp_of = |input: &Path, name: &str| {
        let out = tmp.path().join(name);
        deepspeed_to_dcp(input, &out, &Solo, &DcpWriteOptions::default(), |_| {}).unwrap();
        out
    };
    // Every case from its checkpoint root (those with a frozen embedding too, which FSDP2
    // loads into the model with it frozen), and two from their universal checkpoints.
    let mut pairs: Vec<(PathBuf, PathBuf)> = CASES
        .iter()
        .chain(&FROZEN_CASES)
        .map(|case| (golden(case), dcp_of(&golden(case).join("ckpt"), case)))
        .collect();
    for case in ["zero2_fp32", "frozen_zero3_bf16_ws3"] {
        let ucp = dcp_of(&golden(case).join("ucp"), &format!("{case}_ucp"));
        pairs.push((golden(case), ucp));
    }

    // Split across processes, the directory is the same but for `.metadata`'s save id.
    let split = tmp.path().join("zero2_bf16_split");
    ThreadGroup::run(2, |pg| {
        let input = golden("zero2_bf16").join("ckpt");
        deepspeed_to_dcp(&input, &split, &pg, &DcpWriteOptions::default(), |_| {}).unwrap();
    });
    let data = |dir: &Path| {
        files_of(dir)
            .into_iter()
            .filter(|(n, _)| n.ends_with(".distcp"))
            .collect::<Vec<_>>()
    };
    assert_eq!(data(&split), data(&tmp.path().join("zero2_bf16")));

    let script = golden("fsdp2_continue.py");
    for ws in [1, 3] {
        let mut args = vec![ws.to_string().into()];
        for (case, dcp) in &pairs {
            args.push(case.clone().into_os_string());
            args.push(dcp.clone().into_os_string());
        }
        let out = python_script(&script, &args);
        let ok = out.lines().filter(|l| l.contains(": OK ws=")).count();
        assert_eq!(ok, pairs.len(), "FSDP2 at {ws} ranks:\n{out}");
        // The fp32 runs (six, and one from its universal checkpoint) continued.
        let continued = out.lines().filter(|l| l.contains("one step on")).count();
        assert_eq!(continued, 7, "FSDP2 at {ws} ranks:\n{out}");
    }
}

#[test]
fn deepspeed_consolidation_split_across_processes_writes_the_single_process_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    for case in ["zero2_bf16", "zero3_fp32"] {
        let input = golden(case).join("ckpt");
        for ext in ["pt", "safetensors"] {
            // The same file name in a directory per run: torch.save names its archive after
            // the file.
            let out = |n: usize| {
                let dir = tmp.path().join(format!("{case}_{ext}_{n}"));
                std::fs::create_dir_all(&dir).unwrap();
                dir.join(format!("full.{ext}"))
            };
            let what = DeepSpeedOutput { optim: true };
            let write = |dst: &Path, pg: &dyn fsdp::collectives::ProcessGroup| match ext {
                "pt" => deepspeed_to_torch_save(&input, dst, what, pg, |_| {}),
                _ => deepspeed_to_safetensors(&input, dst, what, pg, |_| {}),
            };
            let alone = write(&out(1), &Solo).unwrap();
            for ws in [2, 3] {
                let totals = ThreadGroup::run(ws, |pg| write(&out(ws), &pg).unwrap());
                assert!(totals.iter().all(|&t| t == alone), "{case} {ext} at {ws}");
                assert!(
                    std::fs::read(out(ws)).unwrap() == std::fs::read(out(1)).unwrap(),
                    "{case} .{ext}: {ws} processes wrote other bytes than one"
                );
            }
        }
    }
}

/// The universal checkpoint's file of `name`'s `state`: `{'cat_dim': 0, 'param': t}` at
/// stages 1 and 2, a bare flat tensor at stage 3.
fn ucp_tensor(case: &str, name: &str, state: &str) -> HostTensor {
    let info = case_json(case);
    let path = golden(case)
        .join("ucp")
        .join(info["tag"].as_str().unwrap())
        .join("zero")
        .join(name)
        .join(format!("{state}.pt"));
    let obj = torch_save::load(path).unwrap();
    match &obj {
        PyObj::Tensor(t) => t.clone(),
        dict => {
            assert_eq!(field(dict, "cat_dim"), &PyObj::Int(0));
            tensor(field(dict, "param")).clone()
        }
    }
}

#[test]
fn deepspeed_consolidate_optim_equals_the_universal_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let info = case_json(case);
        let stage = info["stage"].as_u64().unwrap();
        let what = DeepSpeedOutput { optim: true };
        let pt = tmp.path().join(format!("{case}.pt"));
        deepspeed_to_torch_save(&golden(case).join("ckpt"), &pt, what, &Solo, |_| {}).unwrap();
        let st = tmp.path().join(format!("{case}.safetensors"));
        deepspeed_to_safetensors(&golden(case).join("ckpt"), &st, what, &Solo, |_| {}).unwrap();
        let from_st = fsdp::io::load(&st).unwrap();
        for got in [torch_save::load(&pt).unwrap(), from_st] {
            // `model`: the model's state_dict() order, every name zero_to_fp32 gives, the
            // same bits.
            let model = field(&got, "model");
            assert_equals_zero_to_fp32(model, case, case);
            let names: Vec<String> = entries(model).into_iter().map(|(k, _)| k).collect();
            assert_eq!(
                names,
                [
                    "shift",
                    "logit_scale",
                    "pos_scale",
                    "emb.weight",
                    "fc1.weight",
                    "fc1.bias",
                    "norm.weight",
                    "norm.bias",
                    "head.weight",
                    "head_lm.weight"
                ],
                "{case}"
            );
            let optim = field(&got, "optim");
            let state = field(optim, "state");
            let members: Vec<String> = info["param_groups"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["members"].as_array().unwrap().iter())
                .map(|m| m.as_str().unwrap().to_string())
                .collect();
            let keys: Vec<String> = entries(state).into_iter().map(|(k, _)| k).collect();
            assert_eq!(
                keys, members,
                "{case}: state keyed by name, in param-group order"
            );
            for (name, s) in entries(state) {
                let order: Vec<String> = entries(s).into_iter().map(|(k, _)| k).collect();
                assert_eq!(order, ["step", "exp_avg", "exp_avg_sq"], "{case} {name}");
                let shape: Vec<usize> = info["param_shapes"][&name]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect();
                for key in ["exp_avg", "exp_avg_sq"] {
                    let want = ucp_tensor(case, &name, key).reshape(&shape).unwrap();
                    assert_same(
                        tensor(field(s, key)),
                        &want,
                        &format!("{case} {name} {key}"),
                    );
                }
                let step = tensor(field(s, "step"));
                assert_eq!(step.dtype(), DType::F32);
                assert_eq!(step.shape(), &[] as &[usize]);
                assert_eq!(
                    step.item(),
                    Some(info["steps"].as_f64().unwrap()),
                    "{case} {name}"
                );
                if stage <= 2 {
                    assert_same(
                        step,
                        &ucp_tensor(case, &name, "step"),
                        &format!("{case} {name} step"),
                    );
                }
            }
            let groups = match field(optim, "param_groups") {
                PyObj::List(g) => g,
                other => panic!("{other:?}"),
            };
            let want_groups = info["param_groups"].as_array().unwrap();
            assert_eq!(groups.len(), want_groups.len());
            for (g, want) in groups.iter().zip(want_groups) {
                let e = entries(g);
                assert_eq!(
                    e.last().unwrap().0,
                    "params",
                    "{case}: params last, as torch does"
                );
                let params: Vec<PyObj> = want["members"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| PyObj::Str(m.as_str().unwrap().into()))
                    .collect();
                assert_eq!(field(g, "params"), &PyObj::List(params));
                for (k, v) in want["hyperparameters"].as_object().unwrap() {
                    let got = field(g, k);
                    let same = match (got, v) {
                        (PyObj::Float(x), serde_json::Value::Number(n)) => Some(*x) == n.as_f64(),
                        (PyObj::Bool(b), serde_json::Value::Bool(c)) => b == c,
                        (PyObj::None, serde_json::Value::Null) => true,
                        (PyObj::Tuple(t), serde_json::Value::Array(a)) => t
                            .iter()
                            .zip(a)
                            .all(|(x, y)| matches!(x, PyObj::Float(x) if Some(*x) == y.as_f64())),
                        _ => false,
                    };
                    assert!(same, "{case} group hyper-parameter {k}: {got:?} vs {v}");
                }
            }
        }
    }
}

#[test]
fn deepspeed_inspect_gives_stage_dtype_world_size_tag_and_parameters() {
    for case in CASES {
        let info = case_json(case);
        let root = golden(case).join("ckpt");
        assert_eq!(recognize(&root).unwrap(), Input::DeepSpeed, "{case}");
        assert_eq!(
            recognize(&root.join("step3")).unwrap(),
            Input::DeepSpeed,
            "{case}"
        );
        assert_eq!(
            recognize(&golden(case).join("ucp")).unwrap(),
            Input::DeepSpeedUniversal,
            "{case}"
        );
        for (dir, form) in [
            (root, Form::Zero),
            (golden(case).join("ucp"), Form::Universal),
        ] {
            let ckpt = DeepSpeedCheckpoint::open(&dir).unwrap();
            assert_eq!(ckpt.form(), form);
            assert_eq!(
                u64::from(ckpt.stage()),
                info["stage"].as_u64().unwrap(),
                "{case}"
            );
            let dtype = if info["dtype"] == "bf16" {
                DType::BF16
            } else {
                DType::F32
            };
            assert_eq!(ckpt.dtype(), dtype, "{case}");
            assert_eq!(ckpt.world_size(), 2, "{case}");
            assert_eq!(ckpt.tag(), "step3", "{case}");
            assert_eq!(
                ckpt.aliases(),
                [("head_lm.weight".to_string(), "emb.weight".to_string())]
            );
            assert_eq!(ckpt.buffers().len(), 1);
            assert_eq!(ckpt.buffers()[0].name, "pos_scale");
            let groups = ckpt.param_groups();
            for (g, want) in groups.iter().zip(info["param_groups"].as_array().unwrap()) {
                let members: Vec<&str> = want["members"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m.as_str().unwrap())
                    .collect();
                assert_eq!(g.members, members, "{case}");
                assert_eq!(g.hyperparameters[0].0, "lr");
            }
            let summary = ckpt.summary();
            let text = summary.to_string();
            assert!(text.contains("world size 2"), "{text}");
            assert!(
                text.contains("emb.weight [37, 12] group 0 step 3"),
                "{text}"
            );
            let json = serde_json::to_value(&summary).unwrap();
            assert_eq!(json["params"].as_array().unwrap().len(), 8);
            // One parameter read alone equals DeepSpeed's.
            let fp32 = ckpt.read("head.weight", State::Fp32).unwrap();
            let want = expected_fp32(case)
                .into_iter()
                .find(|(k, _)| k == "head.weight")
                .unwrap()
                .1;
            assert_same(&fp32, &want, case);
        }
    }
}

// ----- hostile inputs -----

/// A copy of `case`'s `ckpt/` in a temporary directory.
fn copy_ckpt(case: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("ckpt");
    copy_tree(&golden(case).join("ckpt"), &dst);
    (tmp, dst)
}

fn copy_tree(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// The byte range of the `data.pkl` entry's data in a `torch.save` archive (written with data
/// descriptors, as torch.save writes every entry).
fn pickle_range(bytes: &[u8]) -> std::ops::Range<usize> {
    let find = |pat: &[u8], from: usize| {
        bytes[from..]
            .windows(pat.len())
            .position(|w| w == pat)
            .map(|i| i + from)
    };
    let name = find(b"/data.pkl", 0).unwrap();
    let header = (0..name)
        .rev()
        .find(|&i| bytes[i..].starts_with(b"PK\x03\x04"))
        .unwrap();
    let le16 = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
    let start = header + 30 + le16(header + 26) + le16(header + 28);
    let end = find(b"PK\x07\x08", start).unwrap();
    start..end
}

/// Replaces the archive's `data.pkl` with `new` (of the same length) and its CRC-32 where
/// the data descriptor and the central directory record it.
fn replace_pickle(bytes: &mut [u8], new: &[u8]) {
    let r = pickle_range(bytes);
    assert_eq!(r.len(), new.len(), "a pickle of another length");
    let old_crc = crc32fast::hash(&bytes[r.clone()]).to_le_bytes();
    let new_crc = crc32fast::hash(new).to_le_bytes();
    bytes[r.clone()].copy_from_slice(new);
    let mut replaced = 0;
    let mut i = r.end;
    while i + 4 <= bytes.len() {
        if bytes[i..i + 4] == old_crc {
            bytes[i..i + 4].copy_from_slice(&new_crc);
            replaced += 1;
        }
        i += 1;
    }
    assert_eq!(
        replaced, 2,
        "the CRC-32 in the descriptor and the central directory"
    );
}

/// Rewrites the pickle of the `torch.save` file `path` by replacing `from` (found once) with
/// `to` of the same length.
fn edit_pickle(path: &Path, from: &[u8], to: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    let r = pickle_range(&bytes);
    let mut pkl = bytes[r].to_vec();
    let at: Vec<usize> = (0..pkl.len())
        .filter(|&i| pkl[i..].starts_with(from))
        .collect();
    assert_eq!(at.len(), 1, "{from:?} occurs once");
    pkl[at[0]..at[0] + to.len()].copy_from_slice(to);
    replace_pickle(&mut bytes, &pkl);
    std::fs::write(path, bytes).unwrap();
}

fn binunicode(out: &mut Vec<u8>, s: &str) {
    out.push(b'X');
    out.extend((s.len() as u32).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A `torch.save` archive whose pickle is `pkl`: an archive of a string of the right length,
/// its pickle replaced.
fn archive_with_pickle(pkl: &[u8]) -> Vec<u8> {
    let probe = |n: usize| {
        let bytes = torch_save::save_to_bytes(&PyObj::Str("a".repeat(n))).unwrap();
        let len = pickle_range(&bytes).len();
        (bytes, len)
    };
    let overhead = probe(16).1 - 16;
    let (mut bytes, len) = probe(pkl.len() - overhead);
    assert_eq!(len, pkl.len());
    replace_pickle(&mut bytes, pkl);
    bytes
}

#[test]
fn deepspeed_a_pickle_naming_another_deepspeed_class_is_refused_by_name() {
    let (_tmp, ckpt) = copy_ckpt("zero2_fp32");
    // What an fp16 run pickles: a DynamicLossScaler, which is not one of the three.
    let mut pkl = vec![0x80, 2, b'}', b'('];
    binunicode(&mut pkl, "optimizer_state_dict");
    pkl.extend(b"}(");
    binunicode(&mut pkl, "loss_scaler");
    pkl.extend(b"cdeepspeed.runtime.fp16.loss_scaler\nDynamicLossScaler\n)\x81}");
    binunicode(&mut pkl, "cur_scale");
    pkl.push(b'G');
    pkl.extend(1.0f64.to_be_bytes());
    pkl.extend(b"sbuu.");
    let rank0 = ckpt.join("step3/zero_pp_rank_0_mp_rank_00_optim_states.pt");
    std::fs::write(&rank0, archive_with_pickle(&pkl)).unwrap();
    let e = DeepSpeedCheckpoint::open(&ckpt).unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleGlobal { module, name, .. }
            if module == "deepspeed.runtime.fp16.loss_scaler" && name == "DynamicLossScaler"),
        "{e}"
    );
    let out = ckpt.parent().unwrap().join("out.pt");
    assert!(
        deepspeed_to_torch_save(&ckpt, &out, DeepSpeedOutput::default(), &Solo, |_| {}).is_err()
    );
    assert!(!out.exists());
}

#[test]
fn deepspeed_globals_are_allowed_only_in_files_of_a_deepspeed_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let rank0 =
        golden("zero2_bf16").join("ckpt/step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt");
    // Named as a rank file: read with the three DeepSpeed globals.
    let headers = fsdp::io::deepspeed::load_file_headers(&rank0).unwrap();
    let s = field(&headers.obj, "optimizer_state_dict");
    assert_eq!(field(s, "zero_stage"), &PyObj::Int(2));
    assert_eq!(
        field(s, "loss_scaler"),
        &PyObj::Dict(vec![
            (PyObj::Str("cur_scale".into()), PyObj::Float(1.0)),
            (PyObj::Str("dynamic".into()), PyObj::Bool(false)),
        ])
    );
    let mapping = match field(s, "param_slice_mappings") {
        PyObj::List(m) => &m[0],
        other => panic!("{other:?}"),
    };
    assert_eq!(
        field(mapping, "emb.weight"),
        &PyObj::Dict(vec![
            (PyObj::Str("numel".into()), PyObj::Int(418)),
            (PyObj::Str("start".into()), PyObj::Int(0)),
        ])
    );
    // The same bytes under another name are an ordinary torch.save file: refused by name.
    let other = tmp.path().join("optim.pt");
    std::fs::copy(&rank0, &other).unwrap();
    for e in [
        torch_save::load(&other).unwrap_err(),
        fsdp::io::deepspeed::load_file_headers(&other).unwrap_err(),
    ] {
        assert!(
            matches!(&e, Error::UnsupportedPickleGlobal { module, .. } if module.starts_with("deepspeed."))
                || matches!(&e, Error::Unsupported(m) if m.contains("not named as a DeepSpeed checkpoint file")),
            "{e}"
        );
    }
}

#[test]
fn deepspeed_a_truncated_partition_is_a_typed_error_naming_file_rank_and_parameter() {
    let (_tmp, ckpt) = copy_ckpt("zero2_fp32");
    // Rank 1's fp32 partition of group 0, (417,), saved as (300,): fc1.weight no longer fits.
    let rank1 = ckpt.join("step3/zero_pp_rank_1_mp_rank_00_optim_states.pt");
    edit_pickle(&rank1, b"K\x00M\xa1\x01\x85", b"K\x00M\x2c\x01\x85");
    let e = DeepSpeedCheckpoint::open(&ckpt).unwrap_err();
    match &e {
        Error::DeepSpeedTruncated {
            file,
            rank,
            tensor,
            param,
            needed,
            found,
        } => {
            assert!(
                file.ends_with("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                "{e}"
            );
            assert_eq!(
                (*rank, tensor.as_str(), param.as_deref(), *needed, *found),
                (
                    1,
                    "single_partition_of_fp32_groups[0]",
                    Some("fc1.weight"),
                    417,
                    300
                )
            );
        }
        other => panic!("{other}"),
    }
    // The same at stage 3: rank 0's first (39,) tensor of sub-group 1 in the pickle, its
    // `exp_avg`, cut to 30 elements: norm.bias (elements 24..36) no longer fits.
    let (_tmp3, ckpt3) = copy_ckpt("zero3_fp32");
    let rank0 = ckpt3.join("step3/zero_pp_rank_0_mp_rank_00_optim_states.pt");
    let bytes = std::fs::read(&rank0).unwrap();
    let pkl = bytes[pickle_range(&bytes)].to_vec();
    // `K\x00K'\x85`: offset 0, size (39,) of the flat group's _rebuild_tensor_v2.
    let at: Vec<usize> = (0..pkl.len())
        .filter(|&i| pkl[i..].starts_with(b"K\x00K'\x85"))
        .collect();
    assert!(!at.is_empty());
    edit_first(&rank0, b"K\x00K'\x85", b"K\x00K\x1e\x85");
    let e = DeepSpeedCheckpoint::open(&ckpt3).unwrap_err();
    assert!(
        matches!(&e, Error::DeepSpeedTruncated { rank: 0, needed: 39, found: 30, param: Some(p), tensor, .. }
            if p == "norm.bias" && tensor == "state[1]['exp_avg']"),
        "{e}"
    );
}

/// [`edit_pickle`] of the first occurrence.
fn edit_first(path: &Path, from: &[u8], to: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    let r = pickle_range(&bytes);
    let mut pkl = bytes[r].to_vec();
    let at = (0..pkl.len())
        .find(|&i| pkl[i..].starts_with(from))
        .unwrap();
    pkl[at..at + to.len()].copy_from_slice(to);
    replace_pickle(&mut bytes, &pkl);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn deepspeed_a_latest_naming_a_missing_tag_is_a_typed_error() {
    let (_tmp, ckpt) = copy_ckpt("zero1_fp32");
    std::fs::write(ckpt.join("latest"), "step9").unwrap();
    // Still recognised as a DeepSpeed checkpoint, so that the reader names what is missing.
    assert_eq!(recognize(&ckpt).unwrap(), Input::DeepSpeed);
    let e = DeepSpeedCheckpoint::open(&ckpt).unwrap_err();
    assert!(
        matches!(&e, Error::DeepSpeedMissingTag { tag, .. } if tag == "step9"),
        "{e}"
    );
    assert!(
        e.to_string().contains("`latest` names the tag `step9`"),
        "{e}"
    );
}

#[test]
fn deepspeed_missing_rank_files_are_a_typed_error() {
    let (_tmp, ckpt) = copy_ckpt("zero2_fp32");
    std::fs::remove_file(ckpt.join("step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")).unwrap();
    let e = DeepSpeedCheckpoint::open(&ckpt).unwrap_err();
    assert!(
        matches!(&e, Error::DeepSpeedRankFiles { found, reason, .. } if found == &[1] && reason.contains("rank 0 is missing")),
        "{e}"
    );
    // One rank of two: partition_count says 2.
    let (_tmp2, ckpt2) = copy_ckpt("zero3_bf16");
    std::fs::remove_file(ckpt2.join("step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        .unwrap();
    let e = DeepSpeedCheckpoint::open(&ckpt2).unwrap_err();
    assert!(
        matches!(&e, Error::DeepSpeedRankFiles { expected: Some(2), found, .. } if found == &[0]),
        "{e}"
    );
}

#[test]
fn deepspeed_slice_mappings_that_disagree_with_the_layout_are_refused() {
    let (_tmp, ckpt) = copy_ckpt("zero2_fp32");
    // Rank 1's fragment_address of head.weight: start 302 (`M.\x01`) made 303.
    let rank1 = ckpt.join("step3/zero_pp_rank_1_mp_rank_00_optim_states.pt");
    edit_pickle(&rank1, b"M.\x01", b"M/\x01");
    let e = DeepSpeedCheckpoint::open(&ckpt).unwrap_err();
    assert!(
        matches!(&e, Error::DeepSpeedInconsistent { rank: Some(1), param: Some(p), reason, .. }
            if p == "head.weight" && reason.contains("param_slice_mappings")),
        "{e}"
    );
}

/// `t` as float32 (exact from bfloat16).
fn as_f32(t: &HostTensor) -> HostTensor {
    let values: Vec<f32> = match t.dtype() {
        DType::F32 => return t.clone(),
        DType::BF16 => t
            .as_bytes()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => panic!("{other}"),
    };
    HostTensor::from_bytes(DType::F32, t.shape(), bytemuck::cast_slice(&values)).unwrap()
}

#[test]
fn deepspeed_frozen_parameters_come_out_as_zero_to_fp32_and_get_state_dict_give_them() {
    let tmp = tempfile::tempdir().unwrap();
    for case in FROZEN_CASES {
        let info = case_json(case);
        let tag = info["tag"].as_str().unwrap();
        let ws = info["world_size"].as_u64().unwrap() as usize;
        let dtype = if info["dtype"] == "bf16" {
            DType::BF16
        } else {
            DType::F32
        };
        let expected = expected_fp32(case);
        let want_emb = &expected.iter().find(|(k, _)| k == "emb.weight").unwrap().1;
        assert_eq!(
            want_emb.dtype(),
            dtype,
            "{case}: zero_to_fp32 keeps the model dtype"
        );
        let inputs = [
            golden(case).join("ckpt"),
            golden(case).join("ckpt").join(tag),
            golden(case).join("ucp"),
        ];
        for (n, input) in inputs.iter().enumerate() {
            let what = format!("{case} input {}", input.display());
            // inspect: the frozen embedding, apart from the 7 trained parameters.
            let ckpt = DeepSpeedCheckpoint::open(input).unwrap();
            assert_eq!(ckpt.world_size(), ws, "{what}");
            assert_eq!(ckpt.frozen().len(), 1, "{what}");
            let f = &ckpt.frozen()[0];
            assert_eq!(
                (f.name.as_str(), &f.shape[..], f.dtype),
                ("emb.weight", &[37, 12][..], dtype)
            );
            assert_eq!(ckpt.params().len(), 7, "{what}");
            assert!(
                ckpt.params().iter().all(|p| p.name != "emb.weight"),
                "{what}"
            );
            assert_same(&ckpt.read_frozen("emb.weight").unwrap(), want_emb, &what);
            let text = ckpt.summary().to_string();
            assert!(text.contains("frozen parameters"), "{text}");
            assert!(
                text.contains(&format!("emb.weight {} [37, 12]", dtype.torch_name())),
                "{text}"
            );

            // consolidate: zero_to_fp32's names, order, dtypes and bits (at stage 1, where
            // zero_to_fp32 leaves the frozen weights out, with them put back).
            let pt = tmp.path().join(format!("{case}_{n}.pt"));
            deepspeed_to_torch_save(input, &pt, DeepSpeedOutput::default(), &Solo, |_| {}).unwrap();
            let got = torch_save::load(&pt).unwrap();
            assert_equals_zero_to_fp32(&got, case, &what);
            let names: Vec<String> = entries(&got).into_iter().map(|(k, _)| k).collect();
            assert_eq!(names, zero_to_fp32_order(case), "{what}");
            let (emb, lm) = (field(&got, "emb.weight"), field(&got, "head_lm.weight"));
            assert_eq!(
                tensor(emb).as_bytes().as_ptr(),
                tensor(lm).as_bytes().as_ptr(),
                "{what}"
            );
            let st = tmp.path().join(format!("{case}_{n}.safetensors"));
            deepspeed_to_safetensors(input, &st, DeepSpeedOutput::default(), &Solo, |_| {})
                .unwrap();
            assert_equals_zero_to_fp32(&fsdp::io::load(&st).unwrap(), case, &what);

            // --optim: the frozen weight in the float32 model, and no optimizer state.
            let pt = tmp.path().join(format!("{case}_{n}_optim.pt"));
            let optim = DeepSpeedOutput { optim: true };
            deepspeed_to_torch_save(input, &pt, optim, &Solo, |_| {}).unwrap();
            let got = torch_save::load(&pt).unwrap();
            let model = field(&got, "model");
            for (name, want) in &expected {
                assert_same(
                    tensor(field(model, name)),
                    &as_f32(want),
                    &format!("{what} {name}"),
                );
            }
            let (emb, lm) = (field(model, "emb.weight"), field(model, "head_lm.weight"));
            assert_eq!(
                tensor(emb).as_bytes().as_ptr(),
                tensor(lm).as_bytes().as_ptr(),
                "{what}"
            );
            let members: Vec<String> = info["param_groups"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["members"].as_array().unwrap().iter())
                .map(|m| m.as_str().unwrap().to_string())
                .collect();
            assert!(!members.contains(&"emb.weight".to_string()));
            let state = field(field(&got, "optim"), "state");
            let keys: Vec<String> = entries(state).into_iter().map(|(k, _)| k).collect();
            assert_eq!(keys, members, "{what}: no state for the frozen parameter");
        }
    }
    // zero_to_fp32 itself leaves the frozen weights out at stage 1 only.
    for case in FROZEN_CASES {
        let info = case_json(case);
        let left_out = info["zero_to_fp32_leaves_out"].as_array().unwrap();
        assert_eq!(left_out.is_empty(), info["stage"] != 1, "{case}");
    }
}

#[test]
fn deepspeed_a_missing_rank_partition_of_a_frozen_parameter_is_a_typed_error() {
    // At stage 3 each rank's model-states file holds its partition of the frozen weights.
    let (_tmp, ckpt) = copy_ckpt("frozen_zero3_fp32_ws2");
    std::fs::remove_file(ckpt.join("step3/zero_pp_rank_1_mp_rank_00_model_states.pt")).unwrap();
    let e = DeepSpeedCheckpoint::open(&ckpt).unwrap_err();
    assert!(
        matches!(&e, Error::DeepSpeedRankFiles { expected: Some(2), reason, .. } if reason.contains("rank 1") && reason.contains("frozen")),
        "{e}"
    );
    let out = ckpt.parent().unwrap().join("o.safetensors");
    let what = DeepSpeedOutput::default();
    assert!(deepspeed_to_safetensors(&ckpt, &out, what, &Solo, |_| {}).is_err());
    assert!(!out.exists());
}
