//! `fsdp::state_dict` over FSDP2 (`FullyShardedModel`, thread ranks) against real PyTorch 2.13
//! FSDP2 on CPU/gloo (`tests/golden/fsdp2/gen_optim.py`): `get_optimizer_state_dict` with
//! `full_state_dict` of every rank's saved local dict gives PyTorch's full dict, and
//! `set_optimizer_state_dict` of a full dict saved at the other world size gives each rank the
//! local dict PyTorch's ranks held after loading it. The same fixtures check the offline
//! `fsdp-ckpt consolidate-torch` / `shard-torch` (`fsdp-ckpt/tests/cli_fsdp2.rs`).

use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::commands::rank_dicts::DescFile;
use fsdp::io::torch_save::{load_optim_state_dict, optim_to_pyobj};
use fsdp::{FullyShardedModel, OptimStateDictApi, StateDictOptions};
use fsdp::{OptimParams, OptimStateDict};
use std::path::PathBuf;
use std::sync::Arc;

const OPTIMIZERS: [&str; 3] = ["adam_amsgrad", "adamw", "sgd"];

fn fixture(optim: &str, f: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/fsdp2/optim/{optim}/{f}"))
}

fn desc(optim: &str) -> DescFile {
    DescFile::from_json_file(fixture(optim, "desc.json")).unwrap()
}

/// What each optimizer holds: DESC.json's groups, or `model.parameters()`.
fn params(spec: &DescFile, ws: usize) -> OptimParams {
    spec.optim_params_for(&spec.layout(ws).unwrap(), 0).unwrap()
}

fn same(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    let (pa, pb) = (optim_to_pyobj(a).unwrap(), optim_to_pyobj(b).unwrap());
    assert!(pa.bit_eq(&pb), "{what}: dicts differ\n{pa:?}\n!=\n{pb:?}");
}

#[test]
fn get_optimizer_state_dict_full_of_the_saved_ranks_is_pytorchs_full_dict() {
    for optim in OPTIMIZERS {
        let spec = desc(optim);
        for ws in [2, 3] {
            let locals: Vec<OptimStateDict> = (0..ws)
                .map(|r| load_optim_state_dict(fixture(optim, &format!("ws{ws}/rank{r}.pt"))))
                .collect::<Result<_, _>>()
                .unwrap();
            let p = params(&spec, ws);
            let got = ThreadGroup::run(ws, |pg| {
                let rank = pg.rank();
                let m = FullyShardedModel::new(&spec.model, &spec.policy, Arc::new(pg))?;
                m.get_optimizer_state_dict(&locals[rank], &p, &StateDictOptions::full())
            });
            let want = load_optim_state_dict(fixture(optim, &format!("ws{ws}/full.pt"))).unwrap();
            for (r, g) in got.into_iter().enumerate() {
                same(
                    &g.unwrap(),
                    &want,
                    &format!("{optim} at {ws} ranks, rank {r}"),
                );
            }
        }
    }
}

#[test]
fn set_optimizer_state_dict_full_at_the_other_world_size_is_what_pytorch_ranks_load() {
    for optim in OPTIMIZERS {
        let spec = desc(optim);
        for (from, to) in [(3, 2), (2, 3)] {
            let full = load_optim_state_dict(fixture(optim, &format!("ws{from}/full.pt"))).unwrap();
            let p = params(&spec, to);
            let got = ThreadGroup::run(to, |pg| {
                let m = FullyShardedModel::new(&spec.model, &spec.policy, Arc::new(pg))?;
                m.set_optimizer_state_dict(Some(&full), &p, &StateDictOptions::full())
            });
            for (r, g) in got.into_iter().enumerate() {
                let want =
                    load_optim_state_dict(fixture(optim, &format!("ws{to}/load{r}.pt"))).unwrap();
                same(
                    &g.unwrap(),
                    &want,
                    &format!("{optim} {from}->{to} rank {r}"),
                );
            }
        }
    }
}
