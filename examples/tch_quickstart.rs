//! The `tch` backend end to end: a model built with `tch::nn`, described for FSDP from its
//! VarStore, trained on 2 thread ranks with this crate's Adam stepping libtorch shards, and
//! its optimizer state consolidated as a full dict of `tch` tensors, then re-sharded for 4
//! ranks.
//!
//! ```text
//! PATH=$PWD/.venv/bin:$PATH LIBTORCH_USE_PYTORCH=1 cargo run --example tch_quickstart --features tch
//! ```

use fsdp::collectives::ThreadGroup;
use fsdp::libtorch::{
    model_desc_from_var_store, model_desc_from_var_store_in_order, state_dict_to_tch, step_tch,
    var_store_params_in_order,
};
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_shards::shard_tensors;
use fsdp::{Fsdp, HostTensor, TchTensor, Tensor, WrapPolicy};
use std::sync::Arc;
use tch::nn::{self, Module};
use tch::{Device, Kind};

fn main() -> fsdp::Result<()> {
    // A small MLP; variables are created in the order PyTorch would register them.
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "layers" / 0, 8, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "layers" / 1, 16, 4, Default::default()));
    // tch creates each linear layer's bias before its weight; PyTorch registers the weight
    // first. Give PyTorch's `named_parameters()` order so that layouts, optimizer ids and
    // checkpoints match a Python run of the same model.
    println!(
        "VarStore creation order: {:?}",
        model_desc_from_var_store(&vs)?
            .params
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
    );
    let torch_order = [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ];
    let model = model_desc_from_var_store_in_order(&vs, &torch_order)?;
    println!("model parameters (PyTorch order):");
    for p in &model.params {
        println!("  {:<18} {:?} {}", p.name, p.shape, p.dtype);
    }

    // Full gradients from one forward/backward pass in libtorch, copied to the host once.
    let x = tch::Tensor::randn([32, 8], (Kind::Float, Device::Cpu));
    let loss = net.forward(&x).square().mean(Kind::Float);
    loss.backward();
    let vars = var_store_params_in_order(&vs, &torch_order)?.params;
    let host = |t: &tch::Tensor| TchTensor::new(t.shallow_clone())?.to_host();
    let values = vars
        .iter()
        .map(|(_, t)| host(t).map(Some))
        .collect::<fsdp::Result<Vec<Option<HostTensor>>>>()?;
    let grads = vars
        .iter()
        .map(|(_, t)| host(&t.grad()).map(Some))
        .collect::<fsdp::Result<Vec<Option<HostTensor>>>>()?;

    // Two ranks: each cuts its flat shards, steps them as libtorch tensors, and rank 0
    // consolidates the full optimizer state as `tch` tensors.
    let policy = WrapPolicy::units(&["layers.0", "layers.1", ""]);
    let full = ThreadGroup::run(2, |pg| -> fsdp::Result<_> {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let to_tch = |v: Vec<Option<HostTensor>>| -> fsdp::Result<Vec<Option<tch::Tensor>>> {
            v.into_iter()
                .map(|t| {
                    t.map(|t| TchTensor::from_host(t).map(TchTensor::into_tch))
                        .transpose()
                })
                .collect()
        };
        let mut slots: Vec<tch::Tensor> =
            to_tch(shard_tensors(fsdp.layout(), fsdp.rank(), &params, &values)?)?
                .into_iter()
                .flatten()
                .collect();
        let shard_grads = to_tch(shard_tensors(fsdp.layout(), fsdp.rank(), &params, &grads)?)?;
        let mut adam = Adam::new(params.clone(), AdamConfig::default())?;
        step_tch(&mut adam, &mut slots, &shard_grads)?;
        let local = state_dict_to_tch(&adam.state_dict())?;
        fsdp.full_optim_state_dict(&local, &params, true)
    });
    let full = full
        .into_iter()
        .next()
        .expect("rank 0")?
        .expect("rank 0 holds the full dict");
    println!(
        "full optimizer state on rank 0 ({} bytes):",
        full.tensor_bytes()
    );
    for (key, st) in &full.state {
        let names: Vec<String> = st
            .iter()
            .map(|(n, v)| match v.as_tensor() {
                Some(t) => format!("{n} {:?}", t.shape()),
                None => n.clone(),
            })
            .collect();
        println!("  {key}: {}", names.join(", "));
    }

    // Four ranks load it: rank 0 scatters, every rank gets its flat shard for its optimizer.
    let shard_sizes = ThreadGroup::run(4, |pg| -> fsdp::Result<Vec<usize>> {
        let fsdp = Fsdp::new(&model, &policy, Arc::new(pg))?;
        let params = fsdp.optim_params();
        let mine =
            fsdp.scatter_full_optim_state_dict((fsdp.rank() == 0).then_some(&full), &params)?;
        Ok(mine
            .state
            .values()
            .filter_map(|st| st.get("exp_avg").and_then(|v| v.as_tensor()))
            .map(|t: &TchTensor| t.numel())
            .collect())
    });
    for (rank, sizes) in shard_sizes.into_iter().enumerate() {
        println!("rank {rank} of 4: exp_avg shard sizes {:?}", sizes?);
    }
    Ok(())
}
