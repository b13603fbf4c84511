//! Writes seed inputs for the `dcp_load` fuzz target into `corpus/dcp_load/` from the real
//! PyTorch DCP fixtures in `tests/golden/dcp/`: for each, `0` + its `.metadata` and `1` + its
//! `__0_0.distcp` (the target's two modes), and the `.metadata` variants of `hostile/` (which
//! must be refused) and `pytorch_reads/` (which PyTorch reads back whole).
//!
//! Run from `fuzz/`: `cargo run --bin make_dcp_seeds`.

use std::path::Path;

fn main() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/dcp");
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/dcp_load");
    std::fs::create_dir_all(&out).expect("create corpus dir");
    let mut n = 0;
    let mut seed = |name: String, mode: u8, bytes: Vec<u8>| {
        let mut data = vec![mode];
        data.extend(bytes);
        std::fs::write(out.join(name), data).expect("write seed");
        n += 1;
    };
    for e in std::fs::read_dir(&golden).expect("tests/golden/dcp") {
        let e = e.expect("entry");
        let ckpt = e.path().join("ckpt");
        let name = e.file_name().to_string_lossy().into_owned();
        if ckpt.is_dir() {
            seed(
                format!("{name}-meta"),
                0,
                std::fs::read(ckpt.join(".metadata")).expect("read"),
            );
            seed(
                format!("{name}-data"),
                1,
                std::fs::read(ckpt.join("__0_0.distcp")).expect("read"),
            );
        }
        if name == "hostile" || name == "pytorch_reads" {
            for h in std::fs::read_dir(e.path()).expect("variants") {
                let h = h.expect("entry");
                let stem = h.file_name().to_string_lossy().into_owned();
                if !stem.ends_with(".metadata") {
                    continue;
                }
                seed(
                    format!("{name}-{stem}"),
                    0,
                    std::fs::read(h.path()).expect("read"),
                );
            }
        }
    }
    println!("wrote {n} seeds to {}", out.display());
}
