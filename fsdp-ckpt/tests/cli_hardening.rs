//! `fsdp-ckpt` against hostile or careless input and failing disks: outputs that would
//! overwrite inputs or foreign files, rank files in the wrong order or given twice, FIFOs and
//! devices in place of metadata, killed runs' temporaries, full disks (simulated with
//! `RLIMIT_FSIZE`, which makes writes past the limit fail with `EFBIG`), manifests that only a
//! later step would reject. Every case: a typed message, exit code 1, inputs untouched.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::{nested_model, wrap};
use fsdp::checkpoint::{self, Manifest};
use fsdp::collectives::ThreadGroup;
use fsdp::commands::rank_dicts::shard_full_dict;
use fsdp::commands::rank_dicts::DescFile;
use fsdp::io::torch_save;
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimStateDict, ParamKey, ParamState, Value, WrapPolicy,
};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

mod tool;
use tool::{command, fails, ok, run, run_cmd, Args};

/// Runs the tool with writes limited to `limit` bytes per file (`RLIMIT_FSIZE`; `SIGXFSZ`
/// ignored, so a write past it fails with `EFBIG` as a write to a full disk fails).
fn run_with_file_limit(args: &Args, limit: u64) -> Output {
    let mut c = command(args);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    run_cmd(c)
}

fn full_adam(model: &ModelDesc) -> OptimStateDict {
    let mut full = OptimStateDict::default();
    for (i, p) in model.params.iter().enumerate() {
        let n = p.numel();
        let avg: Vec<f32> = (0..n).map(|j| (i * 100 + j) as f32 * 0.5).collect();
        let mut st = ParamState::new();
        st.insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::from_slice(&avg, &p.shape).unwrap()),
        );
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
        full.state.insert(ParamKey::Name(p.name.clone()), st);
    }
    full.param_groups = None;
    full
}

/// Saves a `ws`-rank checkpoint of the nested model at `dir`.
fn make_checkpoint(dir: &Path, ws: usize) {
    let model = nested_model();
    let full = full_adam(&model);
    ThreadGroup::run(ws, |pg| {
        let fsdp = Fsdp::new(&model, &wrap(false), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params).unwrap();
        fsdp.save_optim_checkpoint(&local, &params, dir, &Default::default())
            .unwrap();
    });
}

/// Every file under `dir` with its bytes, sorted by path.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p.clone());
                out.push((p, Vec::new()));
            } else {
                let bytes = std::fs::read(&p).unwrap();
                out.push((p, bytes));
            }
        }
    }
    out.sort();
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The pid of a process that has exited (a temporary named after it is stale).
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// Rewrites a checkpoint's manifest through `edit` and recommits it (a valid commit marker
/// for the new bytes), as a buggy or malicious writer would leave it.
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(checkpoint::MANIFEST);
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    let bytes = serde_json::to_vec_pretty(&m).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let commit = format!(
        "{} {} manifest-crc32c={:08x}\n",
        checkpoint::FORMAT,
        checkpoint::VERSION,
        crc32c::crc32c(&bytes)
    );
    std::fs::write(dir.join(checkpoint::COMMIT), commit).unwrap();
}

// ----- 1. reshard never deletes its input or foreign files -----

#[test]
fn reshard_refuses_an_output_that_holds_its_input_or_other_files() {
    let root = tempfile::tempdir().unwrap();
    let sb = root.path().join("sb");
    std::fs::create_dir_all(sb.join("subfolder")).unwrap();
    std::fs::write(sb.join("notes.txt"), "my notes").unwrap();
    std::fs::write(sb.join("subfolder/data.bin"), "data").unwrap();
    let ck = sb.join("ck");
    make_checkpoint(&ck, 4);
    let before = snapshot(&sb);

    fails(
        &run(&[&"reshard", &ck, &sb, &"--world-size", &"2"]),
        &["refusing to write", "contains the input"],
    );
    assert_eq!(snapshot(&sb), before, "sb/ is untouched");
    ok(&run(&[&"verify", &ck]));

    // Into its own input, or inside it.
    fails(
        &run(&[&"reshard", &ck, &ck, &"--world-size", &"2"]),
        &["refusing to write", "is the input"],
    );
    fails(
        &run(&[&"reshard", &ck, &ck.join("inner"), &"--world-size", &"2"]),
        &["refusing to write", "inside the input"],
    );
    // A directory of other files (no input in it).
    let other = root.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "keep me").unwrap();
    fails(
        &run(&[&"reshard", &ck, &other, &"--world-size", &"2"]),
        &["refusing to write", "not a committed checkpoint"],
    );
    assert_eq!(names(&other), ["notes.txt"]);
    assert_eq!(snapshot(&sb), before, "sb/ is untouched");

    // Missing, empty, and an earlier checkpoint are replaced.
    let out = root.path().join("out");
    ok(&run(&[&"reshard", &ck, &out, &"--world-size", &"2"]));
    ok(&run(&[&"reshard", &ck, &out, &"--world-size", &"3"]));
    assert_eq!(checkpoint::read_manifest(&out).unwrap().world_size, 3);
    assert_eq!(
        names(&out),
        [
            "COMMITTED",
            "manifest.json",
            "rank0.safetensors",
            "rank1.safetensors",
            "rank2.safetensors"
        ]
    );
    let empty = root.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    ok(&run(&[&"reshard", &ck, &empty, &"--world-size", &"2"]));
    // A checkpoint with a stray file in it is not replaced.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    fails(
        &run(&[&"reshard", &ck, &out, &"--world-size", &"2"]),
        &["refusing to write", "notes.txt"],
    );
    assert_eq!(checkpoint::read_manifest(&out).unwrap().world_size, 3);
}

#[test]
fn the_rename_fallback_replaces_a_checkpoint_without_exposing_a_partial_one() {
    let root = tempfile::tempdir().unwrap();
    let ck = root.path().join("ck");
    make_checkpoint(&ck, 4);
    let out = root.path().join("out");
    ok(&run(&[&"reshard", &ck, &out, &"--world-size", &"2"]));
    let mut c = command(&[&"reshard", &ck, &out, &"--world-size", &"3"]);
    c.env("FSDP_FORCE_RENAME_FALLBACK", "1");
    ok(&run_cmd(c));
    assert_eq!(checkpoint::read_manifest(&out).unwrap().world_size, 3);
    assert_eq!(names(root.path()), ["ck", "out"], "no aside directory left");

    // A crash between the fallback's two renames: the output is missing, the previous
    // checkpoint sits aside under a dead process's name. The next run puts it back first.
    let aside = root.path().join(format!(".out.old-{}-17", dead_pid()));
    std::fs::rename(&out, &aside).unwrap();
    let o = run(&[&"reshard", &ck, &out, &"--world-size", &"2"]);
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("note: restored the previous output"), "{err}");
    assert_eq!(checkpoint::read_manifest(&out).unwrap().world_size, 2);
    assert_eq!(names(root.path()), ["ck", "out"]);
}

// ----- 3. shard-torch installs its rank files as one set -----

#[test]
fn shard_torch_replaces_its_whole_output_set_or_nothing() {
    let root = tempfile::tempdir().unwrap();
    let spec = DescFile::new(nested_model(), wrap(false));
    let desc = root.path().join("desc.json");
    std::fs::write(&desc, spec.to_json()).unwrap();
    let full = root.path().join("full.pt");
    torch_save::save_optim_state_dict(&full_adam(&spec.model), &full).unwrap();
    let out = root.path().join("shards");
    let shard = |ws: &str| {
        run(&[
            &"shard-torch",
            &"--model",
            &desc,
            &full,
            &"--world-size",
            &ws,
            &"-o",
            &out,
        ])
    };

    ok(&shard("3"));
    assert_eq!(
        names(&out),
        ["fsdp-shard-torch.json", "rank0.pt", "rank1.pt", "rank2.pt"]
    );
    // A smaller world size leaves no stale rank file.
    ok(&shard("2"));
    assert_eq!(
        names(&out),
        ["fsdp-shard-torch.json", "rank0.pt", "rank1.pt"]
    );
    let before = snapshot(&out);

    // A run that fails while writing (a full disk) leaves the previous set as it was.
    let o = run_with_file_limit(
        &[
            &"shard-torch",
            &"--model",
            &desc,
            &full,
            &"--world-size",
            &"4",
            &"-o",
            &out,
        ],
        600,
    );
    fails(&o, &["File too large"]);
    assert_eq!(snapshot(&out), before);
    assert_eq!(
        names(root.path()),
        ["desc.json", "full.pt", "shards"],
        "no temporaries left"
    );

    // A directory holding other files, or the input, is not replaced.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    fails(&shard("2"), &["refusing to write", "notes.txt"]);
    std::fs::remove_file(out.join("notes.txt")).unwrap();
    let o = run(&[
        &"shard-torch",
        &"--model",
        &desc,
        &full,
        &"--world-size",
        &"2",
        &"-o",
        &root.path(),
    ]);
    fails(&o, &["refusing to write", "contains the input"]);
    assert_eq!(snapshot(&out), before);
}

// ----- 4. consolidate-torch refuses wrong input -----

/// Writes every rank's local dict of `spec` at `ws` as `dir/rank{r}.pt`.
fn rank_files(spec: &DescFile, dir: &Path, ws: usize) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    let locals = shard_full_dict(spec, &full_adam(&spec.model), ws).unwrap();
    locals
        .iter()
        .enumerate()
        .map(|(r, l)| {
            let p = dir.join(format!("rank{r}.pt"));
            torch_save::save_optim_state_dict(l, &p).unwrap();
            p
        })
        .collect()
}

#[test]
fn consolidate_torch_refuses_files_out_of_order_twice_or_of_another_model() {
    let root = tempfile::tempdir().unwrap();
    let spec = DescFile::new(nested_model(), wrap(false));
    let desc = root.path().join("desc.json");
    std::fs::write(&desc, spec.to_json()).unwrap();
    let r = rank_files(&spec, &root.path().join("ranks"), 3);
    let out = root.path().join("full.pt");
    let consolidate = |files: &[&PathBuf]| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
            vec![&"consolidate-torch", &"--model", &desc, &"-o", &out];
        args.extend(files.iter().map(|f| *f as &dyn AsRef<std::ffi::OsStr>));
        run(&args)
    };

    fails(
        &consolidate(&[&r[1], &r[0], &r[2]]),
        &["rank1.pt` (given as rank 0)", "its name says rank 1"],
    );
    fails(
        &consolidate(&[&r[0], &r[0], &r[0]]),
        &["given as rank 1", "same file as rank 0"],
    );
    // A copy under another name is the same bytes.
    let copy = root.path().join("ranks/other-1.pt");
    std::fs::copy(&r[0], &copy).unwrap();
    fails(
        &consolidate(&[&r[0], &copy, &r[2]]),
        &["other-1.pt` (given as rank 1)", "same bytes as rank 0"],
    );
    assert!(!out.exists());
    ok(&consolidate(&[&r[0], &r[1], &r[2]]));

    // Another model whose flat sizes fit, with an unwrapped bias of another size.
    let model = |bias: usize| {
        DescFile::new(
            ModelDesc::new()
                .param("layer.weight", &[6, 4], DType::F32)
                .param("bias", &[bias], DType::F32),
            WrapPolicy::units(&["layer"]),
        )
    };
    let theirs = rank_files(&model(54), &root.path().join("theirs"), 2);
    let mine = root.path().join("mine.json");
    std::fs::write(&mine, model(5).to_json()).unwrap();
    let out2 = root.path().join("full2.pt");
    let o = run(&[
        &"consolidate-torch",
        &"--model",
        &mine,
        &theirs[0],
        &theirs[1],
        &"-o",
        &out2,
    ]);
    fails(&o, &["parameter `bias`", "expected [5], found [54]"]);
    assert!(!out2.exists());
}

#[test]
fn desc_json_with_unknown_or_misspelled_fields_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let spec = DescFile::new(nested_model(), wrap(false));
    let mut json: serde_json::Value = serde_json::from_str(&spec.to_json()).unwrap();
    json["fsdp_version"] = 2.into();
    let desc = root.path().join("desc.json");
    std::fs::write(&desc, json.to_string()).unwrap();
    assert!(DescFile::from_json_file(&desc)
        .unwrap_err()
        .to_string()
        .contains("unknown field `fsdp_version`"));
    let mut json: serde_json::Value = serde_json::from_str(&spec.to_json()).unwrap();
    json["policy"]["use_orig_param"] = true.into();
    std::fs::write(&desc, json.to_string()).unwrap();
    let full = root.path().join("full.pt");
    torch_save::save_optim_state_dict(&full_adam(&spec.model), &full).unwrap();
    let o = run(&[
        &"shard-torch",
        &"--model",
        &desc,
        &full,
        &"--world-size",
        &"2",
        &"-o",
        &root.path().join("s"),
    ]);
    fails(&o, &["unknown field `use_orig_param`"]);
    // The checked-in descriptions still parse.
    for case in ["flat", "orig"] {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(format!("tests/golden/fsdp_ckpt/{case}/desc.json"));
        DescFile::from_json_file(&p).unwrap();
    }
}

// ----- 5. FIFOs and devices in place of metadata -----

#[test]
fn a_fifo_or_dev_zero_as_commit_marker_or_manifest_is_an_error_not_a_hang() {
    let root = tempfile::tempdir().unwrap();
    let good = root.path().join("good");
    make_checkpoint(&good, 2);
    for file in [checkpoint::COMMIT, checkpoint::MANIFEST] {
        for kind in ["fifo", "zero"] {
            let ck = root.path().join(format!("{kind}-{file}"));
            std::fs::create_dir_all(&ck).unwrap();
            for e in std::fs::read_dir(&good).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
            }
            let p = ck.join(file);
            std::fs::remove_file(&p).unwrap();
            if kind == "fifo" {
                let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
                // SAFETY: a valid path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
            } else {
                std::os::unix::fs::symlink("/dev/zero", &p).unwrap();
            }
            let what = if kind == "fifo" {
                "FIFO"
            } else {
                "character device"
            };
            fails(&run(&[&"verify", &ck]), &[what]);
            fails(&run(&[&"inspect", &ck]), &[what]);
            fails(
                &run(&[&"consolidate", &ck, &root.path().join("x.pt")]),
                &[what],
            );
            fails(
                &run(&[
                    &"reshard",
                    &ck,
                    &root.path().join("y"),
                    &"--world-size",
                    &"1",
                ]),
                &[what],
            );
        }
    }
}

// ----- 6. safetensors outputs: atomic, reproducible, 0644; stale temporaries -----

#[test]
fn safetensors_output_is_atomic_reproducible_and_world_readable() {
    let root = tempfile::tempdir().unwrap();
    let input = root.path().join("in.pt");
    torch_save::save_optim_state_dict(&full_adam(&nested_model()), &input).unwrap();
    let out = root.path().join("out.safetensors");
    let mut seen = Vec::new();
    for _ in 0..8 {
        let mut c = command(&[&"convert", &input, &out]);
        // SAFETY: umask is async-signal-safe.
        unsafe {
            c.pre_exec(|| {
                libc::umask(0o022);
                Ok(())
            });
        }
        ok(&run_cmd(c));
        seen.push(std::fs::read(&out).unwrap());
    }
    assert!(seen.iter().all(|b| *b == seen[0]), "same bytes every run");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644);

    // A failed write (full disk) leaves the old file whole and names the file and the cause.
    let before = std::fs::read(&out).unwrap();
    let o = run_with_file_limit(&[&"convert", &input, &out], 1000);
    let err = fails(
        &o,
        &[
            "I/O error while writing",
            "out.safetensors",
            "File too large",
        ],
    );
    assert!(!err.contains("invalid safetensors file"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), before);
    assert_eq!(names(root.path()), ["in.pt", "out.safetensors"]);
}

#[test]
fn temporaries_of_killed_runs_are_cleaned_and_reported() {
    let root = tempfile::tempdir().unwrap();
    let ck = root.path().join("ck");
    make_checkpoint(&ck, 2);
    let dead = dead_pid();
    let live = std::process::id();
    // A killed convert and a killed reshard of earlier runs, and a live writer's temporary.
    let stale_file = root.path().join(format!(".out.safetensors.{dead}.0.tmp"));
    std::fs::write(&stale_file, "half").unwrap();
    let stale_dir = root.path().join(format!(".re.tmp-{dead}-123"));
    std::fs::create_dir_all(&stale_dir).unwrap();
    std::fs::write(stale_dir.join("rank0.safetensors"), "half").unwrap();
    let live_file = root.path().join(format!(".out.safetensors.{live}.0.tmp"));
    std::fs::write(&live_file, "in progress").unwrap();

    let o = run(&[&"consolidate", &ck, &root.path().join("out.safetensors")]);
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("note: removed") && err.contains(&format!(".out.safetensors.{dead}.0.tmp")),
        "{err}"
    );
    assert!(!stale_file.exists());
    assert!(live_file.exists(), "a live process's temporary is kept");

    let o = run(&[
        &"reshard",
        &ck,
        &root.path().join("re"),
        &"--world-size",
        &"1",
    ]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains(&format!(".re.tmp-{dead}-123")));
    assert!(!stale_dir.exists());
}

/// The Hugging Face fixture's DCP checkpoint (FSDP2 at world 2, a tiny tied Llama).
fn hf_fixture_dcp() -> PathBuf {
    tool::golden("hf/llama_tied/dcp")
}

/// Flips one byte in the middle of the tensor bytes (`<archive>/data/0`) of the model tensor
/// stored last in the DCP data file `__1_0.distcp` of `dir`: its zip CRC-32 no longer
/// matches, which a reader finds only once it has streamed the tensor.
fn corrupt_last_model_item(dir: &Path) {
    let meta = std::fs::read(dir.join(".metadata")).unwrap();
    let meta = fsdp::io::dcp::parse_metadata(".metadata", &meta).unwrap();
    let (start, len) = meta
        .storage
        .iter()
        .filter(|(k, _)| k.fqn.starts_with("model."))
        .filter_map(|(_, info)| info.as_ref().ok())
        .filter(|info| info.relative_path == "__1_0.distcp")
        .map(|info| (info.offset as usize, info.length as usize))
        .max()
        .expect("a model item in __1_0.distcp");
    let path = dir.join("__1_0.distcp");
    let mut bytes = std::fs::read(&path).unwrap();
    let item = &bytes[start..start + len];
    let le16 = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) as usize;
    let at = item
        .windows(4)
        .enumerate()
        .filter(|(_, w)| *w == b"PK\x03\x04")
        .map(|(i, _)| i)
        .find(|&i| item[i + 30..i + 30 + le16(item, i + 26)].ends_with(b"/data/0"))
        .expect("a tensor record");
    // torch.save's records put their sizes in a data descriptor after the bytes.
    let data = at + 30 + le16(item, at + 26) + le16(item, at + 28);
    let data_len = item[data..]
        .windows(4)
        .position(|w| w == b"PK\x07\x08")
        .unwrap();
    assert!(data_len > 0);
    bytes[start + data + data_len / 2] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

/// Entries of `dir` whose names mark a temporary of the output named `out`.
fn temporaries_of(dir: &Path, out: &str) -> Vec<String> {
    names(dir)
        .into_iter()
        .filter(|n| n.starts_with(&format!(".{out}.")))
        .collect()
}

#[test]
fn a_failed_hf_export_leaves_no_temporary_and_a_dead_runs_shards_are_cleaned() {
    let root = tempfile::tempdir().unwrap();
    let dcp = root.path().join("dcp");
    std::fs::create_dir(&dcp).unwrap();
    for e in std::fs::read_dir(hf_fixture_dcp()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dcp.join(e.file_name())).unwrap();
    }
    corrupt_last_model_item(&dcp);
    let out = root.path().join("hf");

    // A CRC mismatch found while the shards are being written.
    let o = run(&[
        &"convert",
        &dcp,
        &out,
        &"--to",
        &"hf",
        &"--max-shard-size",
        &"60KB",
    ]);
    fails(&o, &["CRC"]);
    assert!(!out.exists());
    assert_eq!(temporaries_of(root.path(), "hf"), Vec::<String>::new());

    // A full disk (EFBIG) in the middle of the first shard.
    let o = run_with_file_limit(
        &[
            &"convert",
            &hf_fixture_dcp(),
            &out,
            &"--to",
            &"hf",
            &"--max-shard-size",
            &"60KB",
        ],
        20_000,
    );
    fails(&o, &["File too large"]);
    assert!(!out.exists());
    assert_eq!(temporaries_of(root.path(), "hf"), Vec::<String>::new());

    // What a killed export left (its shards, index and config) is removed by the next one.
    let dead = dead_pid();
    let stale = root.path().join(format!(".hf.tmp-{dead}-7"));
    std::fs::create_dir(&stale).unwrap();
    for n in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors",
        "model.safetensors.index.json",
        "config.json",
    ] {
        std::fs::write(stale.join(n), "half").unwrap();
    }
    let o = run(&[
        &"convert",
        &hf_fixture_dcp(),
        &out,
        &"--to",
        &"hf",
        &"--max-shard-size",
        &"60KB",
    ]);
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!(".hf.tmp-{dead}-7")), "{err}");
    assert!(!stale.exists());
    assert_eq!(temporaries_of(root.path(), "hf"), Vec::<String>::new());
}

#[test]
fn consolidate_refuses_an_output_inside_its_input() {
    let root = tempfile::tempdir().unwrap();
    let ck = root.path().join("ck");
    make_checkpoint(&ck, 2);
    let before = snapshot(&ck);
    fails(
        &run(&[&"consolidate", &ck, &ck.join("rank0.safetensors")]),
        &["refusing to write", "inside the input"],
    );
    fails(
        &run(&[&"consolidate", &ck, &ck.join("full.pt")]),
        &["refusing to write", "inside the input"],
    );
    assert_eq!(snapshot(&ck), before);
    ok(&run(&[&"verify", &ck]));
}

// ----- 7. error messages that say what went wrong -----

#[test]
fn write_failures_and_bad_manifests_name_the_path_and_the_cause() {
    let root = tempfile::tempdir().unwrap();
    // Consolidating to .pt on a full disk names the output, also when the disk fills while a
    // tensor is streamed (past the writer's 1 MiB buffer: a 4 MiB state).
    let big = root.path().join("big");
    let model = ModelDesc::new().param("w", &[1024, 1024], DType::F32);
    let f = full_adam(&model);
    ThreadGroup::run(2, |pg| {
        let fsdp = Fsdp::new(&model, &WrapPolicy::units(&[""]), Arc::new(pg)).unwrap();
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&f, &params).unwrap();
        fsdp.save_optim_checkpoint(&local, &params, &big, &Default::default())
            .unwrap();
    });
    let out = root.path().join("full.pt");
    let o = run_with_file_limit(&[&"consolidate", &big, &out], 2_000_000);
    let err = fails(&o, &["full.pt", "File too large"]);
    assert!(!err.contains("``"), "an empty path: {err}");
    assert!(!out.exists());

    let ck = root.path().join("ck");
    make_checkpoint(&ck, 2);

    // A header length beyond the file.
    edit_manifest(&ck, |m| m["files"][0]["header_len"] = 1_000_000.into());
    let len = std::fs::metadata(ck.join("rank0.safetensors"))
        .unwrap()
        .len();
    fails(
        &run(&[&"verify", &ck]),
        &[&format!(
            "header of 1000000 bytes for a file of {len} bytes"
        )],
    );

    // shard-torch with a per-rank optimizer description too short for the world size.
    let mut spec = DescFile::new(nested_model(), wrap(false));
    let layout = spec.layout(2).unwrap();
    let p = fsdp::OptimParams::of_model(&layout);
    spec.optim_params_per_rank = Some(vec![p.clone(), p]);
    let desc = root.path().join("desc.json");
    std::fs::write(&desc, spec.to_json()).unwrap();
    let full = root.path().join("in.pt");
    torch_save::save_optim_state_dict(&full_adam(&spec.model), &full).unwrap();
    let o = run(&[
        &"shard-torch",
        &"--model",
        &desc,
        &full,
        &"--world-size",
        &"7",
        &"-o",
        &root.path().join("s"),
    ]);
    let err = fails(
        &o,
        &[
            "`optim_params_per_rank` of the model spec has 2 entries",
            "world size 7",
        ],
    );
    assert!(!err.contains("files were given"), "{err}");
}

/// A change to a manifest's JSON.
type ManifestEdit = fn(&mut serde_json::Value);

// ----- 8. verify catches what reshard rejects; inspect says what it checks -----

#[test]
fn verify_rejects_manifests_that_do_not_fit_their_model() {
    let root = tempfile::tempdir().unwrap();
    let good = root.path().join("good");
    make_checkpoint(&good, 2);
    let text = ok(&run(&[&"inspect", &good]));
    assert!(text.contains("data checksums: not checked"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&ok(&run(&[&"inspect", &"--json", &good]))).unwrap();
    assert_eq!(json["data_checksums_verified"], false);

    let cases: [(&str, ManifestEdit, &str); 3] = [
        (
            "dup",
            |m| {
                let first = m["params"][0].clone();
                m["params"].as_array_mut().unwrap().push(first);
            },
            "twice",
        ),
        (
            "missing",
            |m| {
                let params = m["model"]["params"].as_array_mut().unwrap();
                let i = params.iter().position(|p| p["name"] == "bias").unwrap();
                params.remove(i);
            },
            "`bias`, which the saved model lacks",
        ),
        (
            "shape",
            |m| {
                let params = m["model"]["params"].as_array_mut().unwrap();
                let i = params.iter().position(|p| p["name"] == "bias").unwrap();
                params[i]["shape"] = serde_json::json!([1, 5]);
            },
            "but the saved model gives the parameter shape [1, 5]",
        ),
    ];
    for (name, edit, needle) in cases {
        let ck = root.path().join(name);
        std::fs::create_dir_all(&ck).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
        }
        edit_manifest(&ck, edit);
        let m: Manifest =
            serde_json::from_slice(&std::fs::read(ck.join("manifest.json")).unwrap()).unwrap();
        assert!(m.check(&ck).is_err(), "{name}");
        fails(&run(&[&"verify", &ck]), &[needle]);
        fails(
            &run(&[
                &"reshard",
                &ck,
                &root.path().join(format!("{name}-out")),
                &"--world-size",
                &"3",
            ]),
            &[needle],
        );
    }
}
