//! The contract forms `fsdp-ckpt convert IN OUT_DIR --to hf` and `fsdp-ckpt convert HF_DIR
//! OUT --to dcp`, from outside the crate, against `save_pretrained`'s files
//! (`tests/golden/hf/`, from transformers 5.24).

use std::path::PathBuf;

#[path = "../../tests/common/mod.rs"]
mod common;
mod tool;
use common::model_files;
use tool::{fails, ok, run};

fn golden(p: &str) -> PathBuf {
    tool::golden("hf").join(p)
}

/// The report line (standard error) of a run that must succeed.
fn said(out: &std::process::Output) -> String {
    ok(out);
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn convert_to_hf_writes_what_save_pretrained_writes() {
    let t = tempfile::tempdir().unwrap();
    let dcp = golden("llama_tied/dcp");
    let reference = golden("llama_tied/hf_60KB_bf16");
    let out = t.path().join("hf");
    let config = golden("llama_tied/hf_60KB/config.json");
    let text = said(&run(&[
        &"convert",
        &dcp,
        &out,
        &"--to",
        &"hf",
        &"--max-shard-size",
        &"60KB",
        &"--dtype",
        &"bf16",
        &"--config",
        &config,
    ]));
    assert!(
        text.contains("left out as tied: lm_head.weight (= model.embed_tokens.weight)"),
        "{text}"
    );
    assert!(text.contains("in 2 file(s) and the index"), "{text}");
    assert_eq!(model_files(&out), model_files(&reference));
    assert_eq!(
        std::fs::read(out.join("config.json")).unwrap(),
        std::fs::read(&config).unwrap()
    );
}

#[test]
fn convert_to_hf_renames_with_rules_and_a_map() {
    let t = tempfile::tempdir().unwrap();
    let map = t.path().join("map.json");
    // torchtitan-style names back to Hugging Face's, in two steps.
    std::fs::write(
        &map,
        br#"{"^layers\\.": "model.layers.", "^tok_embeddings": "model.embed_tokens"}"#,
    )
    .unwrap();
    let out = t.path().join("hf");
    ok(&run(&[
        &"convert",
        &golden("llama_untied/dcp"),
        &out,
        &"--to",
        &"hf",
        &"--rename",
        &r"^model\.(layers|embed_tokens)=\1",
        &"--rename",
        &r"^embed_tokens=tok_embeddings",
        &"--rename-map",
        &map,
    ]));
    // The renames undo each other: the default file again.
    assert_eq!(
        model_files(&out),
        model_files(&golden("llama_untied/hf_default"))
    );
}

#[test]
fn convert_hf_dir_to_dcp_and_back() {
    let t = tempfile::tempdir().unwrap();
    let hf = golden("llama_untied/hf_60KB");
    let (dcp, back) = (t.path().join("dcp"), t.path().join("back"));
    let shown = ok(&run(&[&"inspect", &hf]));
    assert!(
        shown.contains("21 tensors, 34464 parameters, 137856 bytes in 3 file(s) and the index"),
        "{shown}"
    );
    assert!(
        shown.contains("lm_head.weight torch.float32 [128, 32] (model-00003-of-00003.safetensors)"),
        "{shown}"
    );
    let text = said(&run(&[&"convert", &hf, &dcp, &"--to", &"dcp"]));
    assert!(text.contains("-> DCP directory"), "{text}");
    let inspect = ok(&run(&[&"inspect", &dcp]));
    assert!(
        inspect.contains("model.lm_head.weight torch.float32 [128, 32]"),
        "{inspect}"
    );
    ok(&run(&[&"convert", &dcp, &back, &"--to", &"hf"]));
    ok(&run(&[&"verify", &dcp]));
    assert!(back.join("model.safetensors").is_file());
}

#[test]
fn bad_inputs_and_options_fail_with_a_message_naming_them() {
    let t = tempfile::tempdir().unwrap();
    let dcp = golden("llama_untied/dcp");
    let occupied = t.path().join("occupied");
    std::fs::create_dir(&occupied).unwrap();
    std::fs::write(occupied.join("tokenizer.json"), b"{}").unwrap();
    fails(
        &run(&[&"convert", &dcp, &occupied, &"--to", &"hf"]),
        &["refusing to write", "tokenizer.json"],
    );
    fails(
        &run(&[
            &"convert",
            &dcp,
            &t.path().join("a"),
            &"--to",
            &"hf",
            &"--max-shard-size",
            &"ten",
        ]),
        &["--max-shard-size ten"],
    );
    fails(
        &run(&[
            &"convert",
            &dcp,
            &t.path().join("b"),
            &"--to",
            &"hf",
            &"--tie",
            &"lm_head.weight=model.embed_tokens.weight",
        ]),
        &["tie `lm_head.weight=model.embed_tokens.weight`", "differ"],
    );
    fails(
        &run(&[
            &"convert",
            &dcp,
            &t.path().join("c"),
            &"--to",
            &"hf",
            &"--rename",
            &"(q|k)_proj=qk",
        ]),
        &["would both be named", "self_attn.qk.weight"],
    );
    fails(
        &run(&[&"convert", &dcp, &t.path().join("d"), &"--dtype", &"bf16"]),
        &["apply to `--to hf`"],
    );
    let hf = golden("llama_untied/hf_60KB");
    fails(
        &run(&[
            &"convert",
            &hf,
            &t.path().join("e"),
            &"--to",
            &"dcp",
            &"--max-shard-size",
            &"1GB",
        ]),
        &["--max-shard-size applies to `--to hf`"],
    );
    for name in ["a", "b", "c", "d", "e"] {
        assert!(!t.path().join(name).exists(), "{name}");
    }
}

/// Writes `dir/model.safetensors` holding `n` float32 tensors of shape [0] named `w.<i>` (the
/// header `safetensors.torch.save_file` writes for them); returns the header's bytes.
fn many_tensor_model(dir: &std::path::Path, n: usize) -> u64 {
    std::fs::create_dir_all(dir).unwrap();
    let mut names: Vec<String> = (0..n).map(|i| format!("w.{i}")).collect();
    names.sort();
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    for name in &names {
        json.push_str(&format!(
            r#","{name}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}"#
        ));
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    json.len() as u64
}

/// Runs the tool with `args` (standard output discarded) and returns its exit status and
/// its own peak RSS in bytes (`wait4`'s `ru_maxrss` of that one child).
// The child is reaped by `wait4`, which `Child::wait` cannot replace: only it reports the
// child's own rusage.
#[allow(clippy::zombie_processes)]
fn peak_rss_of(args: &[&std::ffi::OsStr]) -> (i32, u64) {
    let child = std::process::Command::new(tool::BIN)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for the child it reaps.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child by its pid, writing into the locals above.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4");
    (status, usage.ru_maxrss as u64 * 1024)
}

#[test]
fn a_header_of_100k_tensors_is_read_in_memory_bounded_by_the_header() {
    // Issue 39 item 7: the cost per tensor. The bound is the header's size times four plus
    // 100 MB (the benchmark's target, `benches/hf_tensors.rs`), never a time: for `inspect`,
    // and for `convert --to dcp`, whose `.metadata` (73 MB here) is written as it is pickled.
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("hf");
    let header = many_tensor_model(&dir, 100_000);
    let bound = 4 * header + 100_000_000;
    let (status, peak) = peak_rss_of(&["inspect".as_ref(), dir.as_os_str()]);
    assert_eq!(status, 0, "inspect failed");
    assert!(
        peak <= bound,
        "inspect of {header} header bytes peaked at {peak} bytes RSS, over {bound}"
    );
    let out = t.path().join("dcp");
    let (status, peak) = peak_rss_of(&[
        "convert".as_ref(),
        dir.as_os_str(),
        out.as_os_str(),
        "--to".as_ref(),
        "dcp".as_ref(),
    ]);
    assert_eq!(status, 0, "convert --to dcp failed");
    assert!(
        peak <= bound,
        "convert --to dcp of {header} header bytes peaked at {peak} bytes RSS, over {bound}"
    );
    assert!(out.join(".metadata").is_file());
}

#[test]
fn convert_to_hf_ties_each_architectures_own_embedding() {
    // Issue 40: a GPT-2 (GPT2LMHeadModel) trained with FSDP2 at world 2 and AdamW, saved with
    // dcp.save({"model": msd, "optim": osd}); its config ties lm_head.weight to
    // transformer.wte.weight, which save_pretrained leaves out.
    let t = tempfile::tempdir().unwrap();
    let gpt2 = golden("tied/gpt2");
    let config = gpt2.join("hf/config.json");
    let out = t.path().join("hf");
    let text = said(&run(&[
        &"convert",
        &gpt2.join("dcp"),
        &out,
        &"--to",
        &"hf",
        &"--config",
        &config,
    ]));
    assert!(
        text.contains("left out as tied: lm_head.weight (= transformer.wte.weight)"),
        "{text}"
    );
    assert_eq!(model_files(&out), model_files(&gpt2.join("hf")));
    let dcp = t.path().join("dcp");
    said(&run(&[
        &"convert",
        &gpt2.join("hf"),
        &dcp,
        &"--to",
        &"dcp",
        &"--config",
        &config,
    ]));
    let inspect = ok(&run(&[&"inspect", &dcp]));
    assert!(
        inspect.contains("model.lm_head.weight torch.float32 [64, 16]"),
        "{inspect}"
    );
    // An architecture outside the table that ties is refused by name, with the option to use.
    let other = t.path().join("config.json");
    let renamed = std::fs::read_to_string(&config)
        .unwrap()
        .replace("GPT2LMHeadModel", "MyGPTForCausalLM");
    std::fs::write(&other, renamed).unwrap();
    let refused = t.path().join("refused");
    fails(
        &run(&[
            &"convert",
            &gpt2.join("dcp"),
            &refused,
            &"--to",
            &"hf",
            &"--config",
            &other,
        ]),
        &["MyGPTForCausalLM", "--tie OUTPUT=INPUT", "GPT2LMHeadModel"],
    );
    assert!(!refused.exists());
    ok(&run(&[
        &"convert",
        &gpt2.join("dcp"),
        &refused,
        &"--to",
        &"hf",
        &"--config",
        &other,
        &"--tie",
        &"lm_head.weight=transformer.wte.weight",
    ]));
    assert_eq!(model_files(&refused), model_files(&gpt2.join("hf")));
}
