//! Feeds arbitrary bytes to the sharded-checkpoint loader: the input is split into a manifest
//! and one rank data file, committed with a matching marker (so the manifest parser, the
//! consistency checks and the ranged, checksummed reads are all reached), then verified and
//! consolidated. Every outcome must be a value or a typed error, never a panic.
#![no_main]

use fsdp::io::checkpoint::{load_full, verify, LoadOptions, COMMIT, FORMAT, MANIFEST, VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let (manifest, rest) = data.split_at(split);
    let file = rest.get(1..).unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("fsdp-fuzz-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let commit = format!(
        "{FORMAT} {VERSION} manifest-crc32c={:08x}\n",
        crc32c::crc32c(manifest)
    );
    let ok = std::fs::write(dir.join(MANIFEST), manifest).is_ok()
        && std::fs::write(dir.join(COMMIT), commit).is_ok()
        && std::fs::write(dir.join("rank0.safetensors"), file).is_ok();
    if ok {
        let _ = verify(&dir);
        let _ = load_full(&dir, &LoadOptions { verify: false });
    }
});
