#![cfg(target_os = "linux")]
//! A `torch.save` expansion bomb: `tests/golden/expansion_bomb/expansion_bomb.pt` (17 KB, written
//! by `tests/golden/expansion_bomb/gen.py`) holds 200 stride-0 `[4096, 4096]` float32 views of
//! one 4-element storage, 12.8 GiB once materialized. `fsdp-ckpt inspect` must summarize it
//! without materializing anything, and `convert` must refuse it with a typed error instead
//! of allocating, both under a 4 GiB address-space limit.

use fsdp::io::inspect::Summary;
use fsdp::io::torch_save::{self, LoadOptions};
use fsdp::Error;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Output};

mod tool;
use tool::BIN;

/// The address-space limit the CLI runs under: far below what the bomb asks for.
const ADDRESS_SPACE: u64 = 4 << 30;

fn bomb() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden/expansion_bomb/expansion_bomb.pt")
}

/// Runs `fsdp-ckpt --quiet ARGS` with its address space limited to [`ADDRESS_SPACE`].
fn run_limited(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut c = Command::new(BIN);
    c.arg("--quiet");
    for a in args {
        c.arg(a.as_ref());
    }
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: ADDRESS_SPACE,
                rlim_max: ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c.output().expect("run fsdp-ckpt")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn inspect_summarizes_the_bomb_without_materializing_it() {
    let out = run_limited(&[&"inspect", &"--json", &bomb()]);
    assert!(
        out.status.success(),
        "status {:?}\nstderr: {}",
        out.status,
        text(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tensor_count"], 200);
    assert_eq!(v["total_tensor_bytes"], 200u64 * 4096 * 4096 * 4);
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 200);
    assert_eq!(tensors[17]["name"], "t17");
    assert_eq!(tensors[17]["shape"], serde_json::json!([4096, 4096]));
    assert_eq!(tensors[17]["dtype"], "float32");
}

#[test]
fn convert_refuses_the_bomb_with_a_typed_error_under_a_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.safetensors");
    let out = run_limited(&[&"convert", &bomb(), &out_path]);
    // A typed error (exit status 1), not an abort (a signal) or success.
    assert_eq!(out.status.code(), Some(1), "stderr: {}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("expansion_bomb.pt"), "{err}");
    assert!(err.contains("tensor `t"), "{err}");
    assert!(err.contains("allowed expansion"), "{err}");
    assert!(!out_path.exists());
}

#[test]
fn the_library_names_the_tensor_that_exceeds_the_expansion_allowance() {
    let err = torch_save::load(bomb()).unwrap_err();
    let Error::TensorExpansion {
        file,
        tensor,
        size,
        stride,
        storage_bytes,
        max_expansion_bytes,
        ..
    } = err
    else {
        panic!("expected TensorExpansion, got {err}");
    };
    assert!(file.ends_with("expansion_bomb.pt"));
    // 256 MiB allow four 64 MiB copies (plus the 16 storage bytes): the fifth is refused.
    assert_eq!(tensor, "t4");
    assert_eq!((&size[..], &stride[..]), (&[4096, 4096][..], &[0, 0][..]));
    assert_eq!(storage_bytes, 16);
    assert_eq!(
        max_expansion_bytes,
        LoadOptions::DEFAULT_MAX_EXPANSION_BYTES
    );
}

#[test]
fn the_expansion_allowance_is_an_option() {
    // No allowance: the first stride-0 tensor is already too much.
    let none = LoadOptions::default().max_expansion_bytes(0);
    match torch_save::load_with(bomb(), &none) {
        Err(Error::TensorExpansion { tensor, .. }) => assert_eq!(tensor, "t0"),
        other => panic!("expected TensorExpansion, got {other:?}"),
    }
    // The structure alone costs nothing, whatever the views expand to.
    let h = torch_save::load_headers(bomb()).unwrap();
    let s = Summary::of_headers(&h);
    assert_eq!(s.tensor_count, 200);
    assert_eq!(s.total_tensor_bytes, 200 * 4096 * 4096 * 4);
}
