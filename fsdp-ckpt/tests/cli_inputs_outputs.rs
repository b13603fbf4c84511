//! What the tool takes as input and what it may write over: one recognition step names what
//! an input is (or what it holds when it is nothing the tool reads), file outputs replace
//! only a regular file or a missing path, and standard output that cannot be written ends
//! the command with a message (or quietly, for a closed pipe), never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod tool;
use tool::{command, fails, golden, ok, run, run_cmd};

fn dcp_fixture() -> PathBuf {
    golden("dcp/fsdp2_adam_ws4/ckpt")
}

fn sh(cmd: &str, args: &[&dyn AsRef<std::ffi::OsStr>]) {
    let mut c = Command::new(cmd);
    for a in args {
        c.arg(a.as_ref());
    }
    assert!(c.status().unwrap().success(), "{cmd} failed");
}

/// The kind of what is at `p` (not following a symlink), for before/after checks.
fn kind(p: &Path) -> String {
    let t = std::fs::symlink_metadata(p).unwrap().file_type();
    use std::os::unix::fs::FileTypeExt;
    format!(
        "fifo={} chr={} dir={} link={} file={}",
        t.is_fifo(),
        t.is_char_device(),
        t.is_dir(),
        t.is_symlink(),
        t.is_file()
    )
}

#[test]
fn file_outputs_never_replace_a_fifo_a_device_a_symlink_or_a_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let at = |n: &str| tmp.path().join(n);
    sh("mkfifo", &[&at("pipe.pt")]);
    sh("mknod", &[&at("dev.pt"), &"c", &"1", &"3"]); // /dev/null's numbers
    std::fs::create_dir(at("user.pt")).unwrap();
    std::fs::write(at("target.pt"), b"someone else's file").unwrap();
    std::os::unix::fs::symlink(at("target.pt"), at("link.pt")).unwrap();
    let dcp = dcp_fixture();
    let pt = golden("dcp/fsdp2_adam_ws4/expected.pt");
    for (name, what) in [
        ("pipe.pt", "is a FIFO"),
        ("dev.pt", "is a character device"),
        ("user.pt", "is a directory"),
        ("link.pt", "is a symbolic link"),
    ] {
        let out = at(name);
        let before = kind(&out);
        for args in [
            vec![&"consolidate" as &dyn AsRef<std::ffi::OsStr>, &dcp, &out],
            vec![&"convert", &pt, &out],
        ] {
            fails(&run(&args), &["refusing to write", name, what]);
            assert_eq!(kind(&out), before, "{name} was replaced");
        }
    }
    assert_eq!(
        std::fs::read(at("target.pt")).unwrap(),
        b"someone else's file"
    );
    // A regular file is replaced whole, as before.
    std::fs::write(at("old.pt"), b"old").unwrap();
    ok(&run(&[&"consolidate", &dcp, &at("old.pt")]));
    assert!(std::fs::metadata(at("old.pt")).unwrap().len() > 3);
}

#[test]
fn a_full_standard_output_is_an_error_and_a_closed_pipe_ends_quietly() {
    let dcp = dcp_fixture();
    let mut c = command(&[&"verify", &dcp]);
    c.stdout(std::fs::File::create("/dev/full").unwrap());
    let out = c.stderr(Stdio::piped()).output().unwrap();
    fails(
        &out,
        &["writing `standard output`", "No space left on device"],
    );
    // The reader of the pipe is gone before the tool writes (as `| head -c 100` is once it
    // has its bytes): no message, the status a shell shows for SIGPIPE.
    for args in [
        vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &"--json", &dcp],
        vec![&"inspect", &dcp],
        vec![&"verify", &dcp],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut c = command(&args);
        c.stdout(writer);
        let out = c.stderr(Stdio::piped()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{err}");
        assert!(err.is_empty(), "{err}");
    }
}

#[test]
fn an_unrecognised_directory_is_described_by_what_it_holds() {
    // The pre-safetensors Hugging Face layout (pickled shards), which no form matches.
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in [
        "pytorch_model-00001-of-00003.bin",
        "pytorch_model-00002-of-00003.bin",
        "pytorch_model-00003-of-00003.bin",
        "pytorch_model.bin.index.json",
    ] {
        std::fs::write(hf.join(f), b"{}").unwrap();
    }
    let out = tmp.path().join("o.pt");
    for args in [
        vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &hf],
        vec![&"verify", &hf],
        vec![&"consolidate", &hf, &out],
        vec![&"convert", &hf, &tmp.path().join("d"), &"--to", &"dcp"],
    ] {
        let err = fails(
            &run(&args),
            &[
                "neither a DCP directory (no `.metadata`",
                "nor a checkpoint of this crate (no `manifest.json`)",
                "nor a Hugging Face model directory",
                "3 `.bin` files",
            ],
        );
        assert!(!err.contains("COMMITTED"), "{err}");
    }
    // With safetensors files and an index it is a model directory, whose broken index is
    // named.
    let st = tmp.path().join("st");
    std::fs::create_dir(&st).unwrap();
    for f in [
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    ] {
        std::fs::write(st.join(f), b"{}").unwrap();
    }
    for args in [
        vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &st],
        vec![&"convert", &st, &tmp.path().join("e"), &"--to", &"dcp"],
    ] {
        fails(
            &run(&args),
            &["model.safetensors.index.json", "missing field `weight_map`"],
        );
    }
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails(&run(&[&"inspect", &empty]), &["it is empty"]);
}

#[test]
fn a_metadata_that_is_not_a_regular_file_is_named_as_what_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo");
    std::fs::create_dir(&fifo).unwrap();
    sh("mkfifo", &[&fifo.join(".metadata")]);
    let dev = tmp.path().join("dev");
    std::fs::create_dir(&dev).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dev.join(".metadata")).unwrap();
    let dir = tmp.path().join("dir");
    std::fs::create_dir_all(dir.join(".metadata")).unwrap();
    let desc = tmp.path().join("desc.json");
    for (d, what) in [
        (&fifo, "`.metadata` is a FIFO"),
        (&dev, "`.metadata` is a character device"),
        (&dir, "`.metadata` is a directory"),
    ] {
        let out = tmp.path().join("out");
        for args in [
            vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, d],
            vec![&"verify", d],
            vec![&"consolidate", d, &tmp.path().join("o.pt")],
            vec![
                &"convert",
                d,
                &out,
                &"--to",
                &"fsdp",
                &"--model",
                &desc,
                &"--world-size",
                &"2",
            ],
        ] {
            fails(&run(&args), &[what]);
        }
    }
}

#[test]
fn a_metadata_symlink_is_followed_like_a_data_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    for e in std::fs::read_dir(dcp_fixture()).unwrap() {
        let e = e.unwrap();
        if e.file_name() != ".metadata" {
            std::fs::copy(e.path(), ckpt.join(e.file_name())).unwrap();
        }
    }
    // Out of the directory (as a Hugging Face cache snapshot links into `../../blobs/`).
    let outside = tmp.path().join("elsewhere.metadata");
    std::fs::copy(dcp_fixture().join(".metadata"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, ckpt.join(".metadata")).unwrap();
    ok(&run(&[&"verify", &ckpt]));
    // Inside it.
    std::fs::remove_file(ckpt.join(".metadata")).unwrap();
    std::fs::rename(&outside, ckpt.join("real.metadata")).unwrap();
    std::os::unix::fs::symlink("real.metadata", ckpt.join(".metadata")).unwrap();
    ok(&run(&[&"verify", &ckpt]));
}

#[test]
fn per_rank_dcp_metadata_is_recognised_and_read() {
    // Recognised by `__0.metadata` (and read: this one is empty, so it is refused by name;
    // tests/it/dcp_sources.rs reads real ones).
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("per_rank");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("__0.metadata"), b"").unwrap();
    std::fs::write(d.join("__0_0.distcp"), b"").unwrap();
    fails(
        &run(&[&"inspect", &d]),
        &["malformed pickle", "__0.metadata"],
    );
}

#[test]
fn commands_name_the_input_they_take_when_given_another_form() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = dcp_fixture();
    fails(
        &run(&[
            &"reshard",
            &dcp,
            &tmp.path().join("o"),
            &"--world-size",
            &"2",
        ]),
        &[
            "reshard takes a checkpoint of this crate",
            "is a DCP directory",
        ],
    );
    let pt = golden("dcp/fsdp2_adam_ws4/expected.pt");
    fails(
        &run(&[&"verify", &pt]),
        &["verify takes a DCP directory", "is a torch.save file"],
    );
    fails(
        &run(&[&"convert", &dcp, &tmp.path().join("o"), &"--to", &"dcp"]),
        &["convert --to dcp takes", "is a DCP directory"],
    );
}

#[test]
fn the_tool_prints_nothing_through_panicking_macros() {
    // `print!`/`println!`/`eprint!`/`eprintln!` panic when the stream cannot be written; the
    // tool's crate denies them (clippy's print_stdout and print_stderr), and this keeps the
    // lint in place.
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    assert!(lib.contains("#![deny(clippy::print_stdout, clippy::print_stderr)]"));
    let run = run_cmd(command(&[&"--version"]));
    assert!(run.status.success());
}
