//! Running the `fsdp-ckpt` executable in tests: the command, a hang guard, and the checks
//! every CLI test makes of its exit status and messages.
#![allow(dead_code)] // each test binary uses its own subset

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The tool under test, built by cargo for this package's integration tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_fsdp-ckpt");

/// A command line's arguments after the program name.
pub type Args<'a> = [&'a dyn AsRef<OsStr>];

/// A file of the repository's PyTorch fixtures (`tests/golden/` at the workspace root).
pub fn golden(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(p)
}

/// `fsdp-ckpt --quiet ARGS...`, not yet run.
pub fn command(args: &Args) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--quiet");
    for a in args {
        c.arg(a.as_ref());
    }
    c
}

/// Runs a command; one still going after 60 s is killed and fails the test (a hang).
pub fn run_cmd(mut c: Command) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fsdp-ckpt");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("fsdp-ckpt hung: {:?}", c);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Runs `fsdp-ckpt --quiet ARGS...` with the hang guard.
pub fn run(args: &Args) -> Output {
    run_cmd(command(args))
}

/// The standard output of a run that must succeed.
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "fsdp-ckpt failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A run that must fail the way the tool fails on bad input: exit code 1, one `error: ...`
/// message naming every needle, no panic. Returns the message.
pub fn fails(out: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "expected exit code 1: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(err.starts_with("error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    err
}
