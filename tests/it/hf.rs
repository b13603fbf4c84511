//! Hugging Face model directories against the real libraries: the export equals
//! `save_pretrained` of the same weights (transformers 5.24, huggingface_hub 2.4) byte for
//! byte, the import loads into FSDP2 ranks with logits equal to the original model's (live
//! PyTorch), and bad inputs get typed errors. Fixtures: `tests/golden/hf/gen.py`.

use crate::common::{self, model_files, python};
use fsdp::collectives::{Solo, ThreadGroup};
use fsdp::commands::conversions::{self, HfExportOptions, HfImportOptions};
use fsdp::commands::{recognize, Input};
use fsdp::io::hf::{self, Rename};
use fsdp::io::torch_save::PyObj;
use fsdp::{DType, Error, HostTensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn golden(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/hf")
        .join(p)
}

fn dcp_sources(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/dcp_sources")
        .join(p)
}

/// The form `fsdp-ckpt convert --to hf` exports `src` as: its entry in the one recognition
/// table.
fn from(src: &Path) -> conversions::HfSource {
    recognize(src).unwrap().hf_source().unwrap()
}

fn export(
    src: &Path,
    opts: &HfExportOptions,
) -> (tempfile::TempDir, PathBuf, conversions::HfExported) {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("hf");
    let done = conversions::checkpoint_to_hf(src, from(src), &out, opts, &Solo).unwrap();
    (t, out, done)
}

fn sized(max: &str) -> HfExportOptions {
    HfExportOptions {
        max_shard_size: Some(hf::parse_shard_size(max).unwrap()),
        ..Default::default()
    }
}

/// Every tensor of a model directory by name: (dtype, shape, bytes).
fn tensors_of(dir: &Path) -> BTreeMap<String, (DType, Vec<usize>, Vec<u8>)> {
    let mut all = BTreeMap::new();
    for (name, _) in model_files(dir) {
        if !name.ends_with(".safetensors") {
            continue;
        }
        let PyObj::OrderedDict { items, .. } =
            fsdp::io::safetensors::load(dir.join(&name)).unwrap()
        else {
            panic!("{name}: not a flat state dict")
        };
        for (k, v) in items {
            let (PyObj::Str(k), PyObj::Tensor(t)) = (k, v) else {
                panic!()
            };
            let t: HostTensor = t;
            assert!(
                all.insert(
                    k.clone(),
                    (t.dtype(), t.shape().to_vec(), t.as_bytes().to_vec())
                )
                .is_none(),
                "{k} twice"
            );
        }
    }
    all
}

#[test]
fn an_fsdp2_dcp_checkpoint_exports_byte_for_byte_as_save_pretrained_writes_it() {
    for (model, refs) in [
        (
            "llama_untied",
            &["hf_60KB", "hf_60KB_bf16", "hf_default", "hf_15KB"][..],
        ),
        ("llama_tied", &["hf_60KB", "hf_60KB_bf16", "hf_default"][..]),
    ] {
        let tied = model == "llama_tied";
        for reference in refs {
            let mut opts = match *reference {
                "hf_default" => HfExportOptions::default(),
                "hf_15KB" => sized("15KB"),
                _ => sized("60KB"),
            };
            if reference.ends_with("bf16") {
                opts.dtype = Some(DType::BF16);
            }
            let ref_dir = golden(&format!("{model}/{reference}"));
            if tied {
                // `tie_word_embeddings: true` drops `lm_head.weight`, as save_pretrained does.
                opts.config = Some(ref_dir.join("config.json"));
            }
            let (_t, out, done) = export(&golden(&format!("{model}/dcp")), &opts);
            assert_eq!(
                model_files(&out),
                model_files(&ref_dir),
                "{model}/{reference}: files differ from save_pretrained's"
            );
            assert_eq!(done.indexed, *reference != "hf_default");
            let dropped: Vec<(String, String)> = if tied {
                vec![("lm_head.weight".into(), "model.embed_tokens.weight".into())]
            } else {
                vec![]
            };
            assert_eq!(done.dropped, dropped, "{model}/{reference}");
            if tied {
                assert_eq!(
                    std::fs::read(out.join("config.json")).unwrap(),
                    std::fs::read(ref_dir.join("config.json")).unwrap()
                );
            }
        }
    }
}

#[test]
fn the_export_is_the_same_for_any_number_of_processes() {
    let src = golden("llama_untied/dcp");
    let (_t, whole, _) = export(&src, &sized("60KB"));
    for ws in [2, 3] {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("hf");
        for r in ThreadGroup::run(ws, |pg| {
            conversions::checkpoint_to_hf(&src, from(&src), &out, &sized("60KB"), &pg)
        }) {
            assert_eq!(r.unwrap().files.len(), 3);
        }
        assert_eq!(model_files(&out), model_files(&whole), "{ws} processes");
    }
}

#[test]
fn a_torch_save_state_dict_with_tied_storage_exports_the_tensor_once() {
    // `torch.save(model.state_dict())` of the tied model: one storage for the head and the
    // embedding; the first name is kept.
    let src = golden("llama_tied/state_dict.pt");
    let opts = HfExportOptions {
        prefix: Some(String::new()),
        ..Default::default()
    };
    let (_t, out, done) = export(&src, &opts);
    assert_eq!(
        done.dropped,
        [(
            "lm_head.weight".to_string(),
            "model.embed_tokens.weight".to_string()
        )]
    );
    assert_eq!(
        model_files(&out),
        model_files(&golden("llama_tied/hf_default"))
    );
    // The same file with the default prefix is refused: its keys are top level.
    let t = tempfile::tempdir().unwrap();
    let err = conversions::checkpoint_to_hf(
        &src,
        from(&src),
        &t.path().join("hf"),
        &HfExportOptions::default(),
        &Solo,
    )
    .unwrap_err();
    match err {
        Error::HfSelection { reason, .. } => {
            assert!(
                reason.contains("`lm_head.weight`") && reason.contains("--prefix ''"),
                "{reason}"
            )
        }
        e => panic!("{e}"),
    }
}

#[test]
fn hugging_face_storage_exports_with_the_file_plan_its_shard_names_imply() {
    // What PyTorch's consolidate_safetensors_files(sharded/, ckpt/, mapping) wrote beside the
    // shards: the same file names, tensors per file and weight_map.
    let pytorch = dcp_sources("hf_consolidated/ckpt");
    for src in [
        dcp_sources("hf_consolidated/ckpt"),
        dcp_sources("hf_distributed_mapped/ckpt"),
    ] {
        let (_t, out, done) = export(&src, &HfExportOptions::default());
        assert!(done.indexed);
        let names = |d: &Path| -> Vec<String> {
            model_files(d)
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| n.ends_with(".safetensors"))
                .collect()
        };
        assert_eq!(names(&out), names(&pytorch), "{}", src.display());
        for f in names(&out) {
            assert_eq!(
                tensors_of_file(&out.join(&f)),
                tensors_of_file(&pytorch.join(&f)),
                "{f}"
            );
        }
        let weight_map = |d: &Path| -> serde_json::Value {
            let v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(d.join(hf::INDEX_FILE)).unwrap()).unwrap();
            v["weight_map"].clone()
        };
        assert_eq!(weight_map(&out), weight_map(&pytorch));
    }
}

fn tensors_of_file(p: &Path) -> BTreeMap<String, (DType, Vec<usize>, Vec<u8>)> {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(p, d.path().join("model.safetensors")).unwrap();
    tensors_of(d.path())
}

/// Runs `tests/golden/hf/load_check.py`: an FSDP2-wrapped LlamaForCausalLM at `ws` ranks
/// loads `dcp` (`dcp.load` + `set_model_state_dict`) and its logits must equal the
/// reference's exactly.
fn fsdp2_loads(config: &Path, dcp: &Path, logits: &Path, ws: usize) {
    let out = std::process::Command::new(python())
        .arg(golden("load_check.py"))
        .args([config, dcp, logits])
        .arg(ws.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "FSDP2 at {ws} ranks did not reproduce the model:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_save_pretrained_directory_imports_into_dcp_that_fsdp2_loads_at_any_world_size() {
    for model in ["llama_untied", "llama_tied"] {
        let hf_dir = golden(&format!("{model}/hf_60KB"));
        assert_eq!(recognize(&hf_dir).unwrap(), Input::HfModel);
        let t = tempfile::tempdir().unwrap();
        let dcp = t.path().join("dcp");
        let opts = HfImportOptions {
            // The tied model's directory lacks lm_head.weight; the config restores it.
            config: Some(hf_dir.join("config.json")),
            ..Default::default()
        };
        let bytes = conversions::hf_to_dcp(&hf_dir, &dcp, &opts, &Solo).unwrap();
        assert_eq!(
            bytes, 137_856,
            "{model}: every weight, the head restored when tied"
        );
        for ws in [2, 3] {
            fsdp2_loads(
                &hf_dir.join("config.json"),
                &dcp,
                &golden(&format!("{model}/logits.pt")),
                ws,
            );
        }
        // And back: the exported files hold the original tensors.
        let mut back = sized("60KB");
        if model == "llama_tied" {
            back.config = Some(hf_dir.join("config.json"));
        }
        let (_t2, out, _) = export(&dcp, &back);
        assert_eq!(tensors_of(&out), tensors_of(&hf_dir), "{model}");
    }
}

#[test]
fn the_import_renames_prefixes_and_casts() {
    let hf_dir = golden("llama_untied/hf_default");
    let t = tempfile::tempdir().unwrap();
    let dcp = t.path().join("dcp");
    let opts = HfImportOptions {
        prefix: "student.".into(),
        renames: vec![Rename::parse(r"^model\.=").unwrap()],
        dtype: Some(DType::BF16),
        ..Default::default()
    };
    conversions::hf_to_dcp(&hf_dir, &dcp, &opts, &Solo).unwrap();
    let ckpt = fsdp::io::dcp::DcpCheckpoint::open(&dcp).unwrap();
    let w = ckpt
        .read_tensor("student.layers.0.mlp.up_proj.weight")
        .unwrap();
    assert_eq!(w.dtype(), DType::BF16);
    let original = &tensors_of(&hf_dir)["model.layers.0.mlp.up_proj.weight"];
    let f32s: Vec<f32> = bytemuck::pod_collect_to_vec(&original.2);
    let want: Vec<u8> = f32s
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    assert_eq!(w.as_bytes(), want);
    assert!(ckpt.entry("student.lm_head.weight").is_some());
}

fn import_err(dir: &Path) -> Error {
    let t = tempfile::tempdir().unwrap();
    conversions::hf_to_dcp(
        dir,
        &t.path().join("dcp"),
        &HfImportOptions::default(),
        &Solo,
    )
    .unwrap_err()
}

#[test]
fn a_damaged_model_directory_is_refused_naming_file_and_tensor() {
    let src = golden("llama_untied/hf_60KB");
    let index_path = |d: &Path| d.join(hf::INDEX_FILE);

    // A corrupt index.
    let (_t, d) = common::copy_dir(&src, "model");
    std::fs::write(index_path(&d), b"{\"weight_map\": {\"a\": ").unwrap();
    assert!(
        matches!(import_err(&d), Error::HfModelDir { ref file, .. } if file.ends_with(hf::INDEX_FILE))
    );

    // A missing shard.
    let (_t, d) = common::copy_dir(&src, "model");
    std::fs::remove_file(d.join("model-00002-of-00003.safetensors")).unwrap();
    match import_err(&d) {
        Error::HfModelDir { file, key, reason } => {
            assert!(file.ends_with("model-00002-of-00003.safetensors"), "{file}");
            assert!(key.is_some() && reason.contains("missing"), "{reason}");
        }
        e => panic!("{e}"),
    }

    // The index maps a tensor to another file than the one holding it.
    let (_t, d) = common::copy_dir(&src, "model");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(index_path(&d)).unwrap()).unwrap();
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors".into();
    std::fs::write(index_path(&d), serde_json::to_vec(&index).unwrap()).unwrap();
    match import_err(&d) {
        Error::HfModelDir { key, reason, .. } => {
            assert_eq!(key.as_deref(), Some("lm_head.weight"));
            assert!(
                reason.contains("maps it to `model-00001-of-00003.safetensors`"),
                "{reason}"
            );
        }
        e => panic!("{e}"),
    }

    // A tensor the index does not name (an extra tensor in a file).
    let (_t, d) = common::copy_dir(&src, "model");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(index_path(&d)).unwrap()).unwrap();
    index["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.norm.weight");
    std::fs::write(index_path(&d), serde_json::to_vec(&index).unwrap()).unwrap();
    match import_err(&d) {
        Error::HfModelDir { key, reason, .. } => {
            assert_eq!(key.as_deref(), Some("model.norm.weight"));
            assert!(reason.contains("does not name it"), "{reason}");
        }
        e => panic!("{e}"),
    }

    // Hugging Face storage is DCP (shards of tensors), not a model directory.
    match import_err(&dcp_sources("hf_rank0/ckpt")) {
        Error::HfModelDir { reason, .. } => {
            assert!(reason.contains("DCP_SHARDING_INFO"), "{reason}")
        }
        e => panic!("{e}"),
    }

    // A tensor in two files: one file copied over another's name in a two-file directory.
    let (_t, d) = common::copy_dir(&golden("llama_untied/hf_60KB_bf16"), "model");
    let (a, b) = (
        d.join("model-00001-of-00002.safetensors"),
        d.join("model-00002-of-00002.safetensors"),
    );
    std::fs::copy(&a, &b).unwrap();
    assert!(matches!(
        import_err(&d),
        Error::HfModelDir { key: Some(_), .. }
    ));
}

#[test]
fn export_refusals_are_typed() {
    let src = golden("llama_untied/dcp");
    let t = tempfile::tempdir().unwrap();

    // Two keys renamed to one name.
    let opts = HfExportOptions {
        renames: vec![Rename::parse(r"(gate|up)_proj=gate_up").unwrap()],
        ..Default::default()
    };
    match conversions::checkpoint_to_hf(&src, from(&src), &t.path().join("a"), &opts, &Solo)
        .unwrap_err()
    {
        Error::HfNameCollision {
            name,
            first,
            second,
        } => {
            assert_eq!(name, "model.layers.0.mlp.gate_up.weight");
            assert_eq!(first, "model.layers.0.mlp.gate_proj.weight");
            assert_eq!(second, "model.layers.0.mlp.up_proj.weight");
        }
        e => panic!("{e}"),
    }

    // A tie whose two tensors differ (the untied model's head is not its embedding).
    let opts = HfExportOptions {
        ties: vec![("lm_head.weight".into(), "model.embed_tokens.weight".into())],
        ..Default::default()
    };
    match conversions::checkpoint_to_hf(&src, from(&src), &t.path().join("b"), &opts, &Solo)
        .unwrap_err()
    {
        Error::HfTie { name, kept, reason } => {
            assert_eq!(
                (name.as_str(), kept.as_str()),
                ("lm_head.weight", "model.embed_tokens.weight")
            );
            assert!(reason.contains("differ"), "{reason}");
        }
        e => panic!("{e}"),
    }

    // An output directory that already holds files is left alone.
    let full = t.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("README.md"), b"mine").unwrap();
    match conversions::checkpoint_to_hf(&src, from(&src), &full, &HfExportOptions::default(), &Solo)
        .unwrap_err()
    {
        Error::OutputRefused { reason, .. } => assert!(reason.contains("README.md"), "{reason}"),
        e => panic!("{e}"),
    }
    assert_eq!(std::fs::read(full.join("README.md")).unwrap(), b"mine");
    for name in ["a", "b"] {
        assert!(
            !t.path().join(name).exists(),
            "{name}: a failed export left output"
        );
    }

    // A raw HF state dict saved to DCP: a `model.` subtree next to a top-level lm_head.
    let raw = t.path().join("raw");
    let w = HostTensor::from_bytes(DType::F32, &[2], &[0u8; 8]).unwrap();
    let obj = PyObj::Dict(vec![
        (
            PyObj::Str("model.embed_tokens.weight".into()),
            PyObj::Tensor(w.clone()),
        ),
        (PyObj::Str("lm_head.weight".into()), PyObj::Tensor(w)),
    ]);
    fsdp::io::dcp::save_dcp(&obj, &raw).unwrap();
    match conversions::checkpoint_to_hf(
        &raw,
        from(&raw),
        &t.path().join("c"),
        &HfExportOptions::default(),
        &Solo,
    )
    .unwrap_err()
    {
        Error::HfSelection { reason, .. } => {
            assert!(reason.contains("`lm_head.weight`"), "{reason}")
        }
        e => panic!("{e}"),
    }
    let opts = HfExportOptions {
        prefix: Some(String::new()),
        ..Default::default()
    };
    let done =
        conversions::checkpoint_to_hf(&raw, from(&raw), &t.path().join("c"), &opts, &Solo).unwrap();
    assert_eq!(done.tensors, 2);
}

/// The tensor names Python's `safetensors` (what transformers calls) reads from `file`.
fn python_names(file: &Path) -> Vec<String> {
    let out = std::process::Command::new(python())
        .args([
            "-c",
            "import sys, json; from safetensors import safe_open\n\
             with safe_open(sys.argv[1], 'pt') as f: print(json.dumps(sorted(f.keys())))",
        ])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn f32s(v: &[f32]) -> HostTensor {
    HostTensor::from_vec1(v)
}

#[test]
fn a_model_directory_is_read_by_its_safetensors_names_never_by_the_crates_own_metadata() {
    // A save_pretrained shard whose `fsdp.pyobj.v1` maps q_proj to k_proj's bytes and back.
    let t = tempfile::tempdir().unwrap();
    let swapped = t.path().join("swapped");
    std::fs::create_dir(&swapped).unwrap();
    let (q, k) = (f32s(&[1.0, 2.0]), f32s(&[3.0, 4.0]));
    fn bytes(t: &HostTensor) -> ::safetensors::tensor::TensorView<'_> {
        ::safetensors::tensor::TensorView::new(
            ::safetensors::tensor::Dtype::F32,
            t.shape().to_vec(),
            t.as_bytes(),
        )
        .unwrap()
    }
    let meta = std::collections::HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (
            fsdp::io::safetensors::OBJECT_KEY.to_string(),
            r#"{"odict": [["q_proj.weight", {"tensor": "k_proj.weight"}], ["k_proj.weight", {"tensor": "q_proj.weight"}]], "attrs": []}"#
                .to_string(),
        ),
    ]);
    let file = swapped.join("model.safetensors");
    ::safetensors::tensor::serialize_to_file(
        vec![("q_proj.weight", bytes(&q)), ("k_proj.weight", bytes(&k))],
        Some(meta),
        &file,
    )
    .unwrap();
    assert_eq!(python_names(&file), ["k_proj.weight", "q_proj.weight"]);
    let dcp = t.path().join("swapped_dcp");
    conversions::hf_to_dcp(&swapped, &dcp, &HfImportOptions::default(), &Solo).unwrap();
    let ckpt = fsdp::io::dcp::DcpCheckpoint::open(&dcp).unwrap();
    assert_eq!(
        ckpt.read_tensor("model.q_proj.weight").unwrap().as_bytes(),
        q.as_bytes(),
        "q_proj imported with another tensor's bytes"
    );
    assert_eq!(
        ckpt.read_tensor("model.k_proj.weight").unwrap().as_bytes(),
        k.as_bytes()
    );

    // A `.safetensors` the tool wrote from a nested `.pt` (`{"model": {"x": ...}}`): its header
    // names the tensor `model/x`, which is what transformers sees and what imports.
    let nested = t.path().join("nested");
    std::fs::create_dir(&nested).unwrap();
    let obj = PyObj::Dict(vec![(
        PyObj::Str("model".into()),
        PyObj::Dict(vec![(PyObj::Str("x".into()), PyObj::Tensor(q.clone()))]),
    )]);
    let file = nested.join("model.safetensors");
    fsdp::io::safetensors::save(&obj, &file).unwrap();
    assert_eq!(python_names(&file), ["model/x"]);
    let summary = hf::summary(&nested).unwrap();
    let names: Vec<&str> = summary.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["model/x"]);
    let dcp = t.path().join("nested_dcp");
    conversions::hf_to_dcp(&nested, &dcp, &HfImportOptions::default(), &Solo).unwrap();
    let ckpt = fsdp::io::dcp::DcpCheckpoint::open(&dcp).unwrap();
    assert!(ckpt.entry("model.model.x").is_none());
    assert_eq!(
        ckpt.read_tensor("model.model/x").unwrap().as_bytes(),
        q.as_bytes()
    );
}

#[test]
fn a_tensor_named_metadata_is_refused_by_every_safetensors_writer() {
    let t = tempfile::tempdir().unwrap();
    let w = f32s(&[1.0, 2.0]);
    let src = t.path().join("src");
    let obj = PyObj::Dict(vec![(
        PyObj::Str("model".into()),
        PyObj::Dict(vec![
            (PyObj::Str("a.weight".into()), PyObj::Tensor(w.clone())),
            (PyObj::Str("b.weight".into()), PyObj::Tensor(w.clone())),
        ]),
    )]);
    fsdp::io::dcp::save_dcp(&obj, &src).unwrap();
    // A rename to the reserved name.
    let opts = HfExportOptions {
        renames: vec![Rename::parse(r"^a\.weight$=__metadata__").unwrap()],
        ..Default::default()
    };
    let out = t.path().join("renamed");
    match conversions::checkpoint_to_hf(&src, from(&src), &out, &opts, &Solo).unwrap_err() {
        Error::ReservedTensorName { tensor, origin } => {
            assert_eq!(tensor, "__metadata__");
            assert!(
                origin.contains("`model.a.weight`") && origin.contains("__metadata__"),
                "{origin}"
            );
        }
        e => panic!("{e}"),
    }
    assert!(!out.exists());
    // A source tensor named so.
    let src2 = t.path().join("src2");
    let obj = PyObj::Dict(vec![(
        PyObj::Str("model".into()),
        PyObj::Dict(vec![(PyObj::Str("__metadata__".into()), PyObj::Tensor(w))]),
    )]);
    fsdp::io::dcp::save_dcp(&obj, &src2).unwrap();
    let out = t.path().join("source");
    match conversions::checkpoint_to_hf(
        &src2,
        from(&src2),
        &out,
        &HfExportOptions::default(),
        &Solo,
    )
    .unwrap_err()
    {
        Error::ReservedTensorName { tensor, origin } => {
            assert_eq!(tensor, "__metadata__");
            assert!(origin.contains("`model.__metadata__`"), "{origin}");
        }
        e => panic!("{e}"),
    }
    assert!(!out.exists());
}

fn torchtitan(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/torchtitan")
        .join(p)
}

#[test]
fn a_torchtitan_checkpoint_exports_its_model_and_never_its_training_state() {
    // tests/golden/torchtitan/gen.py: torchtitan's layout, model keys at the top level beside
    // `optimizer` (flattened AdamW state), `lr_scheduler`, `dataloader`, `train_state`.
    let src = torchtitan("ckpt");
    let want = tensors_of_file(&torchtitan("model.safetensors"));
    assert_eq!(want.len(), 9);
    for prefix in [None, Some(String::new())] {
        let opts = HfExportOptions {
            prefix: prefix.clone(),
            ..Default::default()
        };
        let (_t, out, done) = export(&src, &opts);
        assert_eq!(done.tensors, want.len(), "--prefix {prefix:?}");
        assert_eq!(tensors_of(&out), want, "--prefix {prefix:?}");
    }
    // A prefix inside the training state is refused.
    let t = tempfile::tempdir().unwrap();
    let opts = HfExportOptions {
        prefix: Some("optimizer".into()),
        ..Default::default()
    };
    match conversions::checkpoint_to_hf(&src, from(&src), &t.path().join("o"), &opts, &Solo)
        .unwrap_err()
    {
        Error::HfSelection { reason, .. } => assert!(reason.contains("training state"), "{reason}"),
        e => panic!("{e}"),
    }
}

/// The architectures of `tests/golden/hf/tied` (`gen_ties.py`), each with the input embedding
/// `transformers` ties its `lm_head.weight` to (`_tied_weights_keys`).
const TIED: &[(&str, &str)] = &[
    ("gpt2", "transformer.wte.weight"),
    ("opt", "model.decoder.embed_tokens.weight"),
    ("bloom", "transformer.word_embeddings.weight"),
    ("falcon", "transformer.word_embeddings.weight"),
    ("gpt_neox", "gpt_neox.embed_in.weight"),
    ("gemma", "model.embed_tokens.weight"),
    ("qwen2", "model.embed_tokens.weight"),
];

/// Every `model.` tensor of a DCP directory by key: (dtype, shape, bytes).
fn dcp_model_tensors(dir: &Path) -> BTreeMap<String, (DType, Vec<usize>, Vec<u8>)> {
    let ckpt = fsdp::io::dcp::DcpCheckpoint::open(dir).unwrap();
    let keys: Vec<String> = ckpt
        .metadata()
        .entries
        .iter()
        .map(|e| e.key.clone())
        .filter(|k| k.starts_with("model."))
        .collect();
    keys.into_iter()
        .map(|k| {
            let t = ckpt.read_tensor(&k).unwrap();
            (k, (t.dtype(), t.shape().to_vec(), t.as_bytes().to_vec()))
        })
        .collect()
}

#[test]
fn each_architecture_ties_its_own_embedding_as_save_pretrained_does() {
    // Issue 40: an FSDP2 DCP (world 2, AdamW) of a tiny GPT-2, OPT, BLOOM, Falcon, GPT-NeoX,
    // Gemma and Qwen2 with `tie_word_embeddings: true`, and save_pretrained of the same weights.
    for (arch, input) in TIED {
        let dir = golden(&format!("tied/{arch}"));
        let reference = dir.join("hf");
        let opts = HfExportOptions {
            config: Some(reference.join("config.json")),
            ..Default::default()
        };
        let (_t, out, done) = export(&dir.join("dcp"), &opts);
        assert_eq!(
            done.dropped,
            [("lm_head.weight".to_string(), input.to_string())],
            "{arch}"
        );
        assert_eq!(
            model_files(&out),
            model_files(&reference),
            "{arch}: files differ from save_pretrained's"
        );

        // And back: the import restores the head as the copy `get_state_dict` held.
        let t = tempfile::tempdir().unwrap();
        let dcp = t.path().join("dcp");
        let opts = HfImportOptions {
            config: Some(reference.join("config.json")),
            ..Default::default()
        };
        conversions::hf_to_dcp(&reference, &dcp, &opts, &Solo).unwrap();
        let (got, want) = (dcp_model_tensors(&dcp), dcp_model_tensors(&dir.join("dcp")));
        assert!(got.contains_key("model.lm_head.weight"), "{arch}");
        assert_eq!(got, want, "{arch}: the import is not what FSDP2 saved");
    }
}

#[test]
fn a_tying_architecture_outside_the_table_is_refused_by_name() {
    let dir = golden("tied/gpt2");
    let t = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(dir.join("hf/config.json")).unwrap();
    let renamed = text.replace("GPT2LMHeadModel", "MyGPTForCausalLM");
    assert_ne!(renamed, text);
    let config = t.path().join("config.json");
    std::fs::write(&config, renamed).unwrap();
    let opts = HfExportOptions {
        config: Some(config.clone()),
        ..Default::default()
    };
    let out = t.path().join("hf");
    match conversions::checkpoint_to_hf(
        &dir.join("dcp"),
        from(&dir.join("dcp")),
        &out,
        &opts,
        &Solo,
    )
    .unwrap_err()
    {
        Error::HfTieArchitecture {
            architectures,
            known,
            ..
        } => {
            assert_eq!(architectures, ["MyGPTForCausalLM"]);
            assert!(known.iter().any(|k| k == "GPT2LMHeadModel"), "{known:?}");
        }
        e => panic!("{e}"),
    }
    assert!(!out.exists());
    let import = HfImportOptions {
        config: Some(config.clone()),
        ..Default::default()
    };
    let dcp = t.path().join("dcp");
    let err = conversions::hf_to_dcp(&dir.join("hf"), &dcp, &import, &Solo).unwrap_err();
    assert!(matches!(err, Error::HfTieArchitecture { .. }), "{err}");
    assert!(!dcp.exists());

    // Named with --tie, it exports as save_pretrained wrote it, and imports back.
    let tie = (
        "lm_head.weight".to_string(),
        "transformer.wte.weight".to_string(),
    );
    let opts = HfExportOptions {
        ties: vec![tie.clone()],
        ..opts
    };
    let done =
        conversions::checkpoint_to_hf(&dir.join("dcp"), from(&dir.join("dcp")), &out, &opts, &Solo)
            .unwrap();
    assert_eq!(done.dropped, std::slice::from_ref(&tie));
    let import = HfImportOptions {
        ties: vec![tie],
        ..import
    };
    conversions::hf_to_dcp(&dir.join("hf"), &dcp, &import, &Solo).unwrap();
    assert_eq!(dcp_model_tensors(&dcp), dcp_model_tensors(&dir.join("dcp")));

    // A config that leaves `tie_word_embeddings` out ties as its architecture's class does
    // by default: GPT-2 ties.
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_object_mut().unwrap().remove("tie_word_embeddings");
    std::fs::write(&config, json.to_string()).unwrap();
    let opts = HfExportOptions {
        config: Some(config),
        ..Default::default()
    };
    let (_t, out, done) = export(&dir.join("dcp"), &opts);
    assert_eq!(done.dropped.len(), 1);
    assert_eq!(model_files(&out), model_files(&dir.join("hf")));
}
