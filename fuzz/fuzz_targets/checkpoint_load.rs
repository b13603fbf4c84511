//! Feeds arbitrary bytes to the sharded-checkpoint loader: the input is split into a manifest
//! and one rank data file, committed with a matching marker (so the manifest parser, the
//! consistency checks and the ranged, checksummed reads are all reached), then verified,
//! consolidated, and — when the manifest describes a small model — loaded shard by shard at
//! its own world size and at one more rank, optimizer state and model parameters alike.
//! Every outcome must be a value or a typed error, never a panic.
//!
//! Seeds: `cargo run --bin make_seeds` (in `fuzz/`) writes real one-rank checkpoints in this
//! input format to `corpus/checkpoint_load/`.
#![no_main]

use fsdp::checkpoint::{
    load, load_full, load_model_params, read_manifest, verify, LoadOptions, COMMIT, FORMAT,
    MANIFEST, VERSION,
};
use fsdp::flat_param::ModelLayout;
use fsdp::{HostTensor, OptimParams};
use libfuzzer_sys::fuzz_target;

/// Models larger than this many elements are not loaded shard by shard: a manifest can claim
/// any size, and in real use the shapes come from the caller's own model, not the file.
const MAX_NUMEL: usize = 1 << 16;

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
    if !ok {
        return;
    }
    let _ = verify(&dir);
    let _ = load_full(&dir, &LoadOptions::default().verify(false));
    let Ok(m) = read_manifest(&dir) else {
        return;
    };
    if m.model.numel() > MAX_NUMEL || !(1..=4).contains(&m.world_size) {
        return;
    }
    for ws in [m.world_size, m.world_size + 1] {
        let Ok(layout) = ModelLayout::new(&m.model, &m.policy, ws) else {
            continue;
        };
        let params = OptimParams::of_model(&layout);
        for rank in 0..ws {
            for verify in [true, false] {
                let opts = LoadOptions::default().verify(verify);
                let _ = load::<HostTensor>(&dir, &layout, rank, &params, &opts);
                let _ = load_model_params::<HostTensor>(&dir, &layout, rank, &opts);
            }
        }
    }
});
