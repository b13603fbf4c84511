//! Writes seed inputs for the `checkpoint_load` fuzz target into
//! `corpus/checkpoint_load/`: real one-rank checkpoints saved by `Fsdp::save_checkpoint`
//! (Adam state after three steps, model parameters; flat and `use_orig_params` layouts), in
//! the target's input format, `manifest.json` bytes, a zero byte, then `rank0.safetensors`.
//! A fuzzer that starts from valid checkpoints reaches the loader's deep paths (ranged reads,
//! checksums, resharding) instead of stopping at the JSON parser.
//!
//! Run from `fuzz/`: `cargo run --bin make_seeds`.

use fsdp::checkpoint::{SaveOptions, MANIFEST};
use fsdp::collectives::ThreadGroup;
use fsdp::flat_param::ModelLayout;
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_shards::{shard_tensors, synthetic_grads, synthetic_params};
use fsdp::{DType, Fsdp, HostTensor, ModelDesc, OptimParams, Value, WrapPolicy};
use std::path::Path;
use std::sync::Arc;

fn model() -> ModelDesc {
    let f = DType::F32;
    ModelDesc::new()
        .param("embed.weight", &[6, 3], f)
        .param("layers.0.weight", &[3, 3], f)
        .param("layers.0.bias", &[3], f)
        .param("layers.1.weight", &[3, 2], f)
        .param("layers.1.bias", &[2], f)
        .param("head.bias", &[5], f)
}

/// Saves, at world size 1 under `policy`, the state of this crate's Adam (lr 0.01, a second
/// param group with weight decay 0.9) after three steps on synthetic gradients, with the
/// parameters, and writes it as one fuzz input to `out`.
fn seed(dir: &Path, out: &Path, policy: &WrapPolicy) {
    let model = model();
    let layout = ModelLayout::new(&model, policy, 1).expect("layout");
    let values = synthetic_params(&layout);
    ThreadGroup::run(1, |pg| {
        let fsdp = Fsdp::new(&model, policy, Arc::new(pg)).expect("Fsdp::new");
        // Two param groups: the first flat (or original) parameter, then the rest.
        let mut all = fsdp.optim_params().groups.concat();
        let rest = all.split_off(1);
        let params = OptimParams {
            groups: vec![all, rest],
            named: false,
        };
        let shards = shard_tensors(&layout, 0, &params, &values).expect("parameter shards");
        let mut slots: Vec<HostTensor> = shards
            .iter()
            .map(|t| {
                t.clone()
                    .unwrap_or_else(|| HostTensor::zeros(DType::F32, &[0]))
            })
            .collect();
        let config = AdamConfig {
            lr: 0.01,
            ..AdamConfig::default()
        };
        let mut adam = Adam::new(params.clone(), config)
            .and_then(|a| a.with_group_options(1, [("weight_decay", Value::Float(0.9))]))
            .expect("Adam with two param groups");
        for step in 0..3 {
            let grads = shard_tensors(&layout, 0, &params, &synthetic_grads(&layout, step))
                .expect("gradient shards");
            adam.step(&mut slots, &grads).expect("Adam step");
        }
        let shards: Vec<Option<HostTensor>> = slots.into_iter().map(Some).collect();
        fsdp.save_checkpoint(
            &adam.state_dict(),
            &params,
            &shards,
            dir,
            &SaveOptions::default(),
        )
        .expect("save_checkpoint");
    });
    let mut input = std::fs::read(dir.join(MANIFEST)).expect("the manifest");
    input.push(0);
    input.extend(std::fs::read(dir.join("rank0.safetensors")).expect("the data file"));
    std::fs::write(out, input).expect("writing the seed");
    println!("{}", out.display());
}

fn main() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/checkpoint_load");
    std::fs::create_dir_all(&corpus).expect("creating the corpus folder");
    let tmp = std::env::temp_dir().join(format!("fsdp-make-seeds-{}", std::process::id()));
    let units = WrapPolicy::units(&["layers.0", "layers.1"]);
    for (name, policy) in [
        ("flat-units", units.clone()),
        ("orig-params", units.with_orig_params(true)),
        ("root-only", WrapPolicy::units::<&str>(&[])),
    ] {
        let _ = std::fs::remove_dir_all(&tmp);
        seed(
            &tmp.join(name),
            &corpus.join(format!("seed-{name}")),
            &policy,
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
