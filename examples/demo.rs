//! The main demo: PyTorch's nested test model trained with Adam on 4 thread ranks, its full
//! optimizer state dict saved to disk, then reloaded into 2 ranks that wrap the model
//! differently — and checked bit for bit against those ranks' own training.
//!
//! Run with `cargo run --release --example demo`.

use fsdp::collectives::{decode, encode, ProcessGroup, ThreadGroup};
use fsdp::flat_param::ModelLayout;
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_shards::{shard_tensors, synthetic_grads, synthetic_params};
use fsdp::{DType, Fsdp, HostTensor, ModelDesc, OptimParams, OptimStateDict, Value, WrapPolicy};
use std::sync::Arc;

const STEPS: usize = 3;

/// `NestedModel` from PyTorch's `test_fsdp_optim_state.py`, in `named_parameters()` order.
fn nested_model() -> ModelDesc {
    let f = DType::F32;
    let mut m = ModelDesc::new().param("bias", &[5], f);
    for (p, i, o) in [
        ("block0", 5, 3),
        ("block1", 3, 7),
        ("block2.0", 7, 9),
        ("block2.1", 9, 9),
        ("block2.2", 9, 5),
    ] {
        m = m
            .param(&format!("{p}.weight"), &[i, o], f)
            .param(&format!("{p}.bias_module0.bias"), &[o], f)
            .param(&format!("{p}.bias_module1.bias"), &[o], f);
    }
    m
}

/// Trains `STEPS` Adam steps on this rank's shards and returns the optimizer.
fn train(layout: &ModelLayout, rank: usize, input: &OptimParams) -> fsdp::Result<Adam> {
    let mut adam = Adam::new(
        input.clone(),
        AdamConfig {
            lr: 0.01,
            ..AdamConfig::default()
        },
    )?;
    let mut slots: Vec<HostTensor> = shard_tensors(layout, rank, input, &synthetic_params(layout))?
        .into_iter()
        .map(|t| t.unwrap_or_else(|| HostTensor::zeros(DType::F32, &[0])))
        .collect();
    for step in 0..STEPS {
        let grads = shard_tensors(layout, rank, input, &synthetic_grads(layout, step))?;
        adam.step(&mut slots, &grads)?;
    }
    Ok(adam)
}

fn main() -> fsdp::Result<()> {
    let model = nested_model();
    let wrap = WrapPolicy::units(&[
        "block1.bias_module0",
        "block1",
        "block2.1.bias_module0",
        "block2.1.bias_module1",
        "block2.1",
        "block2.2",
    ]);
    let wrap_alt = WrapPolicy::units(&["block0.bias_module0", "block0", ""]);
    let path = std::env::temp_dir().join(format!("fsdp-demo-{}.bin", std::process::id()));

    println!(
        "fsdp demo: {} parameters ({} elements), Adam, {STEPS} steps of synthetic gradients",
        model.params.len(),
        model.numel()
    );

    // 1. Four ranks, wrapping `wrap`: train, consolidate on rank 0, save.
    let saved: Vec<fsdp::Result<Option<usize>>> = ThreadGroup::run(4, |pg| {
        let fsdp = Fsdp::new(&model, &wrap, Arc::new(pg))?;
        let input = fsdp.optim_params();
        let adam = train(fsdp.layout(), fsdp.rank(), &input)?;
        let local = adam.state_dict();
        let full = fsdp.full_optim_state_dict(&local, &input, true)?;
        if let Some(full) = full {
            let bytes = encode(&full)?;
            std::fs::write(&path, &bytes).map_err(|e| fsdp::Error::Serialization {
                what: path.display().to_string(),
                reason: e.to_string(),
            })?;
            println!(
                "[4 ranks] {} flat parameters; rank 0 consolidated {} parameter states ({} bytes of tensors) into {}",
                fsdp.layout().flat_params().len(),
                full.state.len(),
                full.tensor_bytes(),
                path.display()
            );
            return Ok(Some(full.state.len()));
        }
        Ok(None)
    });
    for r in saved {
        r?;
    }

    // 2. Two ranks, wrapping `wrap_alt` (root unit too): train the same steps for reference,
    //    load the saved dict, compare.
    let bytes = std::fs::read(&path).map_err(|e| fsdp::Error::Serialization {
        what: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let full: OptimStateDict = decode(&bytes)?;
    let _ = std::fs::remove_file(&path);
    let results: Vec<fsdp::Result<String>> = ThreadGroup::run(2, |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let fsdp = Fsdp::new(&model, &wrap_alt, pg)?;
        let input = fsdp.optim_params();
        let own = train(fsdp.layout(), fsdp.rank(), &input)?.state_dict();
        let loaded = fsdp.scatter_full_optim_state_dict(
            if fsdp.rank() == 0 { Some(&full) } else { None },
            &input,
        )?;
        let (mut tensors, mut equal, mut elements) = (0, 0, 0);
        for (k, st) in &own.state {
            for (n, v) in st {
                let w = loaded.state.get(k).and_then(|s| s.get(n));
                if let (Value::Tensor(a), Some(Value::Tensor(b))) = (v, w) {
                    tensors += 1;
                    elements += a.numel();
                    equal += usize::from(a.bit_eq(b));
                } else if w != Some(v) {
                    return Ok(format!("rank {}: state `{n}` of {k} differs", fsdp.rank()));
                }
            }
        }
        let same = equal == tensors
            && own.state.len() == loaded.state.len()
            && own.param_groups == loaded.param_groups;
        Ok(format!(
            "[2 ranks, other wrapping] rank {}: {} flat parameters, {} parameter states loaded, {equal}/{tensors} tensors ({elements} elements) bit-identical to its own training, param_groups {} -> {}",
            fsdp.rank(),
            fsdp.layout().flat_params().len(),
            loaded.state.len(),
            if own.param_groups == loaded.param_groups { "equal" } else { "DIFFERENT" },
            if same { "MATCH" } else { "MISMATCH" }
        ))
    });
    let mut ok = true;
    for r in results {
        let line = r?;
        ok &= line.ends_with("MATCH") && !line.ends_with("MISMATCH");
        println!("{line}");
    }
    println!(
        "{}",
        if ok {
            "states match: saved at 4 ranks, loaded at 2 ranks with another wrapping"
        } else {
            "STATES DIFFER"
        }
    );
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
