//! The one rule for every file a reader opens, in every input form (DCP, Hugging Face model
//! directory, DeepSpeed ZeRO and universal checkpoints, this crate's checkpoint, single
//! files): a regular file, symbolic links followed wherever they lead, a FIFO, a device, a
//! directory or a symlink loop refused by what it is (never waited on), and names written
//! inside a checkpoint that leave its directory refused. And messages that say what is there
//! and what was expected.

use std::path::Path;
use std::process::Output;

#[path = "../../tests/common/mod.rs"]
mod common;
mod tool;
use tool::{fails, golden, ok, run};

/// A copy of the directory tree `from` at `to` (files copied, directories recreated).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), &dst).unwrap();
        }
    }
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "{p:?}");
}

fn symlink(target: impl AsRef<Path>, link: &Path) {
    std::os::unix::fs::symlink(target, link).unwrap();
}

/// What `path` (an entry of some input) is turned into, and what the message must say of it.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    Fifo,
    DevZero,
    Dir,
    Loop,
}

impl Hostile {
    const ALL: [Hostile; 4] = [Hostile::Fifo, Hostile::DevZero, Hostile::Dir, Hostile::Loop];

    /// Replaces `path` (removed first if present) by this.
    fn plant(self, path: &Path) {
        if path.is_dir() {
            std::fs::remove_dir_all(path).unwrap();
        } else if std::fs::symlink_metadata(path).is_ok() {
            std::fs::remove_file(path).unwrap();
        }
        match self {
            Hostile::Fifo => mkfifo(path),
            Hostile::DevZero => symlink("/dev/zero", path),
            Hostile::Dir => {
                // Through a symlink to a directory, as the rule follows links.
                let target = path.with_extension("realdir");
                std::fs::create_dir(&target).unwrap();
                symlink(&target, path)
            }
            Hostile::Loop => symlink(path.file_name().unwrap(), path),
        }
    }

    /// What the message calls it.
    fn kind(self) -> &'static str {
        match self {
            Hostile::Fifo => "a FIFO",
            Hostile::DevZero => "a character device",
            Hostile::Dir => "a directory",
            Hostile::Loop => "a symbolic link loop",
        }
    }

    fn said(self) -> String {
        format!("is {}, not a regular file", self.kind())
    }
}

/// The file name of `p`, as messages show it.
fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

// ----- issue 39, item 2: a FIFO inside a DeepSpeed directory -----

#[test]
fn a_fifo_inside_a_deepspeed_directory_is_refused_by_name_not_waited_on() {
    let tmp = tempfile::tempdir().unwrap();
    let zero = golden("deepspeed/zero2_fp32/ckpt");
    let ucp = golden("deepspeed/zero2_fp32/ucp");
    let cases: [(&str, &Path, &str); 4] = [
        (
            "added",
            &zero,
            "step3/zero_pp_rank_2_mp_rank_00_optim_states.pt",
        ),
        (
            "rank",
            &zero,
            "step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ),
        ("model", &zero, "step3/mp_rank_00_model_states.pt"),
        ("ucp", &ucp, "step3/zero/fc1.weight/exp_avg.pt"),
    ];
    for (case, src, entry) in cases {
        for h in [Hostile::Fifo, Hostile::DevZero] {
            let dir = tmp.path().join(format!("{case}-{h:?}"));
            copy_tree(src, &dir);
            h.plant(&dir.join(entry));
            let out = tmp.path().join("out.pt");
            let dcp = tmp.path().join("out_dcp");
            for args in [
                vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &dir],
                vec![&"consolidate", &dir, &out],
                vec![&"consolidate", &dir, &out, &"--optim"],
                vec![&"convert", &dir, &dcp, &"--to", &"dcp"],
            ] {
                fails(&run(&args), &[&name(Path::new(entry)), &h.said()]);
                assert!(!out.exists() && !dcp.exists(), "{case}: an output was left");
            }
        }
    }
}

// ----- issue 39, item 9: symbolic links, one rule for every input form -----

/// Links `entry` of `dir` to a regular copy outside `dir` (`../blobs/NAME`, as a Hugging Face
/// cache snapshot links its files), runs `check` (which must succeed), then turns the entry
/// into each of `hostiles` and runs `refuse`, which must fail naming the entry and what it
/// is (`refuse` may check more itself).
fn one_rule(
    dir: &Path,
    entry: &str,
    hostiles: &[Hostile],
    check: &dyn Fn(&Path) -> Output,
    refuse: &dyn Fn(&Path, Hostile) -> Output,
) {
    let path = dir.join(entry);
    let blobs = dir.parent().unwrap().join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let blob = blobs.join(format!("{}-{}", name(dir), name(&path)));
    std::fs::rename(&path, &blob).unwrap();
    symlink(&blob, &path);
    ok(&check(dir));
    for &h in hostiles {
        h.plant(&path);
        let out = refuse(dir, h);
        fails(&out, &[&name(&path), &h.said()]);
    }
}

fn inspect(d: &Path) -> Output {
    run(&[&"inspect", &d])
}

fn verify(d: &Path) -> Output {
    run(&[&"verify", &d])
}

/// `inspect` as the refusal to check.
fn inspect_refused(d: &Path, _: Hostile) -> Output {
    inspect(d)
}

/// `verify` as the refusal to check.
fn verify_refused(d: &Path, _: Hostile) -> Output {
    verify(d)
}

#[test]
fn dcp_files_follow_the_one_rule() {
    let tmp = tempfile::tempdir().unwrap();
    for entry in ["__1_0.distcp", ".metadata"] {
        let dir = tmp.path().join(format!("dcp{}", entry.len()));
        copy_tree(&golden("dcp/fsdp2_adam_ws4/ckpt"), &dir);
        one_rule(&dir, entry, &Hostile::ALL, &verify, &verify_refused);
    }
}

#[test]
fn hugging_face_files_follow_the_one_rule_and_a_shard_says_what_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    let sharded = tmp.path().join("sharded");
    copy_tree(&golden("hf/llama_tied/hf_60KB"), &sharded);
    one_rule(
        &sharded,
        "model-00002-of-00003.safetensors",
        &Hostile::ALL,
        &inspect,
        &|d, h| {
            let out = inspect(d);
            let said = format!(
                "model.safetensors.index.json maps tensors to this file, and it {}",
                h.said()
            );
            fails(&out, &[&said]);
            out
        },
    );
    let index = tmp.path().join("index");
    copy_tree(&golden("hf/llama_tied/hf_60KB"), &index);
    one_rule(
        &index,
        "model.safetensors.index.json",
        &Hostile::ALL,
        &inspect,
        &inspect_refused,
    );
    // Without an index, the one file is not blamed on the index.
    let single = tmp.path().join("single");
    copy_tree(&golden("hf/llama_tied/hf_default"), &single);
    one_rule(
        &single,
        "model.safetensors",
        &Hostile::ALL,
        &inspect,
        &|d, h| {
            let out = inspect(d);
            let said = format!("the model's one `.safetensors` file: it {}", h.said());
            let err = fails(&out, &[&said]);
            assert!(!err.contains("index"), "{err}");
            out
        },
    );
}

/// `dir/model.safetensors.index.json` with its first file name replaced by `file`.
fn index_naming(dir: &Path, file: &str) {
    let p = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let map = json["weight_map"].as_object_mut().unwrap();
    let first = map.keys().next().unwrap().clone();
    map.insert(first, serde_json::Value::String(file.into()));
    std::fs::write(&p, serde_json::to_string(&json).unwrap()).unwrap();
}

#[test]
fn names_in_a_hugging_face_index_stay_in_the_directory_and_a_nul_is_escaped() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("x.safetensors");
    std::fs::copy(
        golden("hf/llama_tied/hf_60KB/model-00001-of-00003.safetensors"),
        &outside,
    )
    .unwrap();
    for (i, (file, why)) in [
        ("../x.safetensors", "path separator"),
        ("..", "`..`"),
        (outside.to_str().unwrap(), "absolute path"),
        ("", "it is empty"),
        ("model\0.safetensors", "NUL byte"),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tmp.path().join(format!("hf{i}"));
        copy_tree(&golden("hf/llama_tied/hf_60KB"), &dir);
        index_naming(&dir, file);
        let err = fails(
            &inspect(&dir),
            &["which is not a file name in the same directory", why],
        );
        assert!(!err.contains('\0'), "a raw NUL byte in: {err:?}");
        if file.contains('\0') {
            assert!(err.contains(r"model\0.safetensors"), "{err}");
        }
    }
}

#[test]
fn deepspeed_files_and_tags_follow_the_one_rule() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, src, entry) in [
        (
            "zero",
            "ckpt",
            "step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ),
        ("model", "ckpt", "step3/mp_rank_00_model_states.pt"),
        ("latest", "ckpt", "latest"),
        ("ucp", "ucp", "step3/zero/fc1.weight/exp_avg.pt"),
        ("ucp_latest", "ucp", "latest_universal"),
    ] {
        let dir = tmp.path().join(case);
        copy_tree(&golden("deepspeed/zero2_fp32").join(src), &dir);
        one_rule(&dir, entry, &Hostile::ALL, &inspect, &inspect_refused);
    }
    // A tag is a directory: a symlink to one is followed, anything else is named.
    let tag = tmp.path().join("tag");
    copy_tree(&golden("deepspeed/zero2_fp32/ckpt"), &tag);
    std::fs::rename(tag.join("step3"), tmp.path().join("real_step3")).unwrap();
    symlink(tmp.path().join("real_step3"), &tag.join("step3"));
    ok(&inspect(&tag));
    std::fs::remove_file(tag.join("step3")).unwrap();
    symlink("step3", &tag.join("step3"));
    fails(
        &inspect(&tag),
        &["step3` is a symbolic link loop, not a directory"],
    );
    std::fs::remove_file(tag.join("step3")).unwrap();
    mkfifo(&tag.join("step3"));
    fails(&inspect(&tag), &["step3` is a FIFO, not a directory"]);
}

/// What writes a hostile file at a path.
type Plant = dyn Fn(&Path);

#[test]
fn a_bad_deepspeed_latest_says_what_is_wrong_with_the_tag() {
    let tmp = tempfile::tempdir().unwrap();
    let plant = |i: usize, write: &dyn Fn(&Path)| {
        let dir = tmp.path().join(format!("ds{i}"));
        copy_tree(&golden("deepspeed/zero2_fp32/ckpt"), &dir);
        std::fs::remove_file(dir.join("latest")).unwrap();
        write(&dir.join("latest"));
        dir
    };
    let text = |s: &'static str| move |p: &Path| std::fs::write(p, s).unwrap();
    let cases: Vec<(Box<Plant>, &str)> = vec![
        (Box::new(text("../..")), "names the tag `../..`"),
        (Box::new(text("/tmp")), "names the tag `/tmp`"),
        (Box::new(text("/")), "it is an absolute path"),
        (Box::new(text("")), "it is empty"),
        (Box::new(text("\n")), "it is empty"),
        (Box::new(text("..")), "it leads out of the directory"),
        (Box::new(mkfifo), "it is a FIFO, not a regular file"),
        (
            Box::new(|p: &Path| symlink("/dev/zero", p)),
            "it is a character device, not a regular file",
        ),
        (
            Box::new(|p: &Path| {
                let f = std::fs::File::create(p).unwrap();
                f.set_len(200 << 20).unwrap();
            }),
            "larger than the 4096-byte limit",
        ),
    ];
    for (i, (write, said)) in cases.iter().enumerate() {
        let dir = plant(i, write.as_ref());
        let out = tmp.path().join("o.pt");
        for args in [
            vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &dir],
            vec![&"consolidate", &dir, &out],
        ] {
            let err = fails(&run(&args), &["latest", said]);
            assert!(!err.contains("is not an input this tool reads"), "{err}");
        }
    }
}

#[test]
fn the_crates_checkpoint_files_follow_the_one_rule() {
    use fsdp::commands::rank_dicts::DescFile;
    let tmp = tempfile::tempdir().unwrap();
    let desc = tmp.path().join("desc.json");
    let policy = fsdp::WrapPolicy::units(&["net1", "net2", ""]);
    std::fs::write(
        &desc,
        DescFile::new(common::dcp_fixture_net(), policy).to_json(),
    )
    .unwrap();
    let ckpt = tmp.path().join("ckpt");
    ok(&run(&[
        &"convert",
        &golden("dcp/fsdp2_adam_ws4/ckpt"),
        &ckpt,
        &"--to",
        &"fsdp",
        &"--model",
        &desc,
        &"--world-size",
        &"2",
    ]));
    let rank_file = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| name(&e.unwrap().path()))
        .find(|n| n != "manifest.json" && n != "COMMITTED")
        .unwrap();
    let copy = tmp.path().join("copy");
    copy_tree(&ckpt, &copy);
    one_rule(&copy, &rank_file, &Hostile::ALL, &verify, &verify_refused);
    let manifest = tmp.path().join("manifest");
    copy_tree(&ckpt, &manifest);
    one_rule(
        &manifest,
        "manifest.json",
        &Hostile::ALL,
        &verify,
        &verify_refused,
    );
    // A manifest naming a file out of the directory (its commit marker matching it).
    let text = std::fs::read_to_string(ckpt.join("manifest.json")).unwrap();
    for (i, bad) in ["../x", "/etc/passwd"].iter().enumerate() {
        let dir = tmp.path().join(format!("named{i}"));
        copy_tree(&ckpt, &dir);
        let edited = text.replacen(&format!("\"{rank_file}\""), &format!("\"{bad}\""), 1);
        assert_ne!(edited, text);
        std::fs::write(dir.join("manifest.json"), &edited).unwrap();
        let commit = std::fs::read_to_string(ckpt.join("COMMITTED")).unwrap();
        let (head, _) = commit.rsplit_once('=').unwrap();
        let crc = crc32c::crc32c(edited.as_bytes());
        std::fs::write(dir.join("COMMITTED"), format!("{head}={crc:08x}\n")).unwrap();
        fails(&verify(&dir), &[bad, "is not plain"]);
    }
}

#[test]
fn single_file_inputs_follow_the_one_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("files");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(
        golden("dcp/fsdp2_adam_ws4/expected.pt"),
        dir.join("state.pt"),
    )
    .unwrap();
    std::fs::copy(
        golden("hf/llama_tied/hf_default/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    // A link to a directory makes a directory input (read as one), so not that here.
    let hostiles = [Hostile::Fifo, Hostile::DevZero, Hostile::Loop];
    for f in ["state.pt", "model.safetensors"] {
        let path = dir.join(f);
        let blob = tmp.path().join(format!("blob-{f}"));
        std::fs::rename(&path, &blob).unwrap();
        symlink(&blob, &path);
        ok(&inspect(&path));
        for h in hostiles {
            h.plant(&path);
            for args in [
                vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &path],
                vec![&"convert", &path, &tmp.path().join("p.safetensors")],
            ] {
                fails(&run(&args), &[f, &format!("is {}", h.kind())]);
            }
        }
    }
}

// ----- issue 39, item 8: messages that say what is there and what was expected -----

#[test]
fn a_shard_size_out_of_range_is_named_with_the_range() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = golden("hf/llama_untied/dcp");
    for (i, (size, what)) in [
        ("1e100", "more than 2^63−1 bytes"),
        ("inf", "not a finite number"),
        ("NaN", "not a finite number"),
        ("18446744073709551615", "more than 2^63−1 bytes"),
        ("0.1", "less than one byte"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path().join(format!("o{i}"));
        let err = fails(
            &run(&[
                &"convert",
                &dcp,
                &out,
                &"--to",
                &"hf",
                &"--max-shard-size",
                &size,
            ]),
            &[
                &format!("`{size}` is {what}"),
                "the size must be a finite number of bytes from 1 to 2^63−1",
            ],
        );
        assert!(!err.contains("at least one byte"), "{err}");
        assert!(!out.exists());
    }
}

#[test]
fn a_rename_referring_to_a_group_the_pattern_lacks_is_refused_naming_the_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = golden("hf/llama_untied/dcp");
    for (i, (rule, said)) in [
        ("(a)=$9", "refers to group 9, but the pattern has 1 group"),
        (
            r"(self_attn)=\9",
            "refers to group 9, but the pattern has 1 group",
        ),
        (
            "(?P<x>attn)=${y}",
            "refers to the group `y`, which the pattern does not name",
        ),
        ("(attn)=$1x", "write `${1}x`"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path().join(format!("o{i}"));
        fails(
            &run(&[&"convert", &dcp, &out, &"--to", &"hf", &"--rename", &rule]),
            &[&format!("rename rule `{rule}`"), said],
        );
        assert!(!out.exists());
    }
}

#[test]
fn a_config_field_of_the_wrong_type_is_refused_naming_field_value_and_type() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = golden("hf/llama_tied/dcp");
    for (i, (value, said)) in [
        (
            r#""yes""#,
            r#"`tie_word_embeddings` is "yes" (a JSON string)"#,
        ),
        ("1", "`tie_word_embeddings` is 1 (a JSON number)"),
        ("null", "`tie_word_embeddings` is null (a JSON null)"),
    ]
    .into_iter()
    .enumerate()
    {
        let config = tmp.path().join(format!("config{i}.json"));
        std::fs::write(
            &config,
            format!(r#"{{"model_type": "llama", "tie_word_embeddings": {value}}}"#),
        )
        .unwrap();
        let out = tmp.path().join(format!("o{i}"));
        fails(
            &run(&[&"convert", &dcp, &out, &"--to", &"hf", &"--config", &config]),
            &[&name(&config), said, "transformers expects a bool"],
        );
        assert!(!out.exists());
    }
    let config = tmp.path().join("list.json");
    std::fs::write(&config, "[]").unwrap();
    fails(
        &run(&[
            &"convert",
            &dcp,
            &tmp.path().join("l"),
            &"--to",
            &"hf",
            &"--config",
            &config,
        ]),
        &["is a JSON array, not an object"],
    );
}

#[test]
fn an_output_symlink_to_an_empty_directory_is_refused_in_one_wording() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir(tmp.path().join("empty")).unwrap();
    let out = tmp.path().join("link");
    symlink(tmp.path().join("empty"), &out);
    let said = "it is a symbolic link, not a directory; remove it first";
    let hf = golden("hf/llama_untied/hf_60KB");
    let dcp = golden("hf/llama_untied/dcp");
    fails(
        &run(&[&"convert", &hf, &out, &"--to", &"dcp"]),
        &["refusing to write", said],
    );
    fails(
        &run(&[&"convert", &dcp, &out, &"--to", &"hf"]),
        &["refusing to write", said],
    );
    // A non-empty directory reads alike too.
    let full = tmp.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("notes.txt"), b"mine").unwrap();
    for (input, to) in [(&hf, "dcp"), (&dcp, "hf")] {
        fails(
            &run(&[&"convert", input, &full, &"--to", &to]),
            &[
                "refusing to write",
                "it holds `notes.txt` and is not an empty directory",
            ],
        );
    }
    assert!(std::fs::read_dir(tmp.path().join("empty"))
        .unwrap()
        .next()
        .is_none());
    assert_eq!(std::fs::read(full.join("notes.txt")).unwrap(), b"mine");
}
