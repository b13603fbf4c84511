//! Feeds arbitrary bytes to the DCP reader as a directory's `.metadata` (first byte 0) or as
//! its first data file `__0_0.distcp` (first byte 1), the rest of the directory being a real
//! PyTorch checkpoint (`tests/golden/dcp/fsdp2_adam_ws4/ckpt`): opening, summarizing,
//! verifying and loading must give a value or a typed error, never panic, hang or allocate
//! without bound.
#![no_main]

use fsdp::io::dcp::{self, DcpCheckpoint};
use libfuzzer_sys::fuzz_target;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The fixture checkpoint.
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/dcp/fsdp2_adam_ws4/ckpt")
}

/// A private copy of the fixture, made once per process.
fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("fsdp-dcp-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        for e in std::fs::read_dir(fixture()).expect("fixture") {
            let e = e.expect("fixture entry");
            std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy fixture");
        }
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let dir = scratch();
    let (meta, first): (Vec<u8>, Vec<u8>) = match mode {
        0 => (
            rest.to_vec(),
            std::fs::read(fixture().join("__0_0.distcp")).expect("fixture"),
        ),
        1 => (
            std::fs::read(fixture().join(".metadata")).expect("fixture"),
            rest.to_vec(),
        ),
        _ => return,
    };
    std::fs::write(dir.join(".metadata"), meta).expect("write .metadata");
    std::fs::write(dir.join("__0_0.distcp"), first).expect("write data file");
    let _ = dcp::summary(dir);
    let _ = dcp::verify(dir);
    if let Ok(ckpt) = DcpCheckpoint::open(dir) {
        let _ = ckpt.load();
    }
});
