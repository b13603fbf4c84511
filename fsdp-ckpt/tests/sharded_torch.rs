//! Per-rank SHARDED optimizer state dicts saved with `torch.save` by real PyTorch 2.13 on 2
//! gloo CPU ranks (`tests/golden/sharded_torch_fixtures.py`): FSDP1 `ShardedTensor` states
//! (`SHARDED_STATE_DICT` + `FSDP.optim_state_dict`) and FSDP2 `DTensor` states
//! (`fully_shard` + `optim.state_dict()`). Each is read as local shard plus global metadata,
//! and the ranks' files consolidate to exactly the full dict PyTorch gives.

use fsdp::commands::rank_dicts::consolidate_sharded;
use fsdp::io::torch_save::{self, PyObj};
use fsdp::optim_state::ShardedTensor;
use fsdp::{Error, OptimStateDict, ParamKey, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

mod tool;
use tool::BIN;

fn golden(case: &str, file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("tests/golden/sharded_torch")
        .join(case)
        .join(file)
}

fn ranks(case: &str) -> Vec<OptimStateDict> {
    (0..2)
        .map(|r| torch_save::load_optim_state_dict(golden(case, &format!("rank{r}.pt"))).unwrap())
        .collect()
}

fn sharded<'a>(d: &'a OptimStateDict, key: ParamKey, state: &str) -> &'a ShardedTensor {
    match &d.state[&key][state] {
        Value::Sharded(s) => s,
        other => panic!("{key} {state}: {}", other.kind()),
    }
}

/// Same keys, state names and order, equal values, bit-equal tensors.
fn assert_same(got: &OptimStateDict, want: &OptimStateDict) {
    let a = torch_save::optim_to_pyobj(got).unwrap();
    let b = torch_save::optim_to_pyobj(want).unwrap();
    assert!(a.bit_eq(&b), "got {a:?}\nwant {b:?}");
}

#[test]
fn fsdp1_sharded_tensors_read_as_local_shard_plus_global_metadata() {
    let r = ranks("fsdp1");
    // embed.weight is [5, 4]: torch.chunk gives rank 0 rows 0..3 and rank 1 rows 3..5.
    let w0 = sharded(&r[0], "embed.weight".into(), "exp_avg");
    let w1 = sharded(&r[1], "embed.weight".into(), "exp_avg");
    assert_eq!(w0.global_shape, vec![5, 4]);
    assert_eq!(
        (w0.offsets.clone(), w1.offsets.clone()),
        (vec![0, 0], vec![3, 0])
    );
    assert_eq!(w0.local.as_ref().unwrap().shape(), &[3, 4]);
    assert_eq!(w1.local.as_ref().unwrap().shape(), &[2, 4]);
    // blocks.2.bias is [1]: rank 1 holds no shard.
    assert!(sharded(&r[1], "blocks.2.bias".into(), "exp_avg")
        .local
        .is_none());
    assert!(matches!(
        r[1].state[&ParamKey::from("embed.weight")]["step"],
        Value::Tensor(_)
    ));
}

#[test]
fn fsdp1_sharded_files_consolidate_to_pytorchs_full_state_dict() {
    let full = consolidate_sharded(&ranks("fsdp1")).unwrap();
    let want = torch_save::load_optim_state_dict(golden("fsdp1", "full.pt")).unwrap();
    assert_same(&full, &want);
}

#[test]
fn fsdp2_dtensors_read_as_local_shard_plus_global_metadata() {
    let r = ranks("fsdp2");
    let w1 = sharded(&r[1], ParamKey::Id(0), "exp_avg");
    assert_eq!(
        (w1.global_shape.clone(), w1.offsets.clone()),
        (vec![5, 4], vec![3, 0])
    );
    assert_eq!(w1.local.as_ref().unwrap().shape(), &[2, 4]);
    // Parameter 5 (blocks.2.bias, [1]): rank 1's local tensor is empty.
    let b1 = sharded(&r[1], ParamKey::Id(5), "exp_avg");
    assert_eq!(b1.local.as_ref().unwrap().numel(), 0);
}

#[test]
fn fsdp2_rank_files_consolidate_to_the_full_tensors_of_the_dtensors() {
    let full = consolidate_sharded(&ranks("fsdp2")).unwrap();
    let want = torch_save::load_optim_state_dict(golden("fsdp2", "full_ids.pt")).unwrap();
    assert_same(&full, &want);
}

#[test]
fn the_cli_consolidates_sharded_rank_files_and_pytorch_loads_the_result() {
    let dir = tempfile::tempdir().unwrap();
    for case in ["fsdp1", "fsdp2"] {
        let out = dir.path().join(format!("{case}.pt"));
        let o = Command::new(BIN)
            .args(["--quiet", "consolidate-sharded"])
            .arg(golden(case, "rank0.pt"))
            .arg(golden(case, "rank1.pt"))
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let want = if case == "fsdp1" {
            "full.pt"
        } else {
            "full_ids.pt"
        };
        let got = torch_save::load(&out).unwrap();
        let want = torch_save::load(golden(case, want)).unwrap();
        assert!(got.bit_eq(&want), "{case}");
    }
}

#[test]
fn missing_or_mismatched_ranks_are_typed_errors() {
    // Rank 1's file alone does not tile the tensors: rows 0..3 are missing.
    let r = ranks("fsdp1");
    match consolidate_sharded(&r[1..]) {
        Err(Error::ShardedMismatch { key, reason, .. }) => {
            assert_eq!(key, "'embed.weight'");
            assert!(reason.contains("cover"), "{reason}");
        }
        other => panic!("expected ShardedMismatch, got {other:?}"),
    }
    // A rank without a key the others have is named.
    let mut short = r.clone();
    short[1].state.shift_remove(&ParamKey::from("head.bias"));
    match consolidate_sharded(&short) {
        Err(Error::ShardedMismatch { rank, key, .. }) => {
            assert_eq!((rank, key.as_str()), (1, "'head.bias'"))
        }
        other => panic!("expected ShardedMismatch, got {other:?}"),
    }
    // Rank 0 given twice: its shards are identical replicas, rows 3..5 stay uncovered.
    match consolidate_sharded(&[r[0].clone(), r[0].clone()]) {
        Err(Error::ShardedMismatch { reason, .. }) => assert!(reason.contains("cover"), "{reason}"),
        other => panic!("expected ShardedMismatch, got {other:?}"),
    }
    // Writing a sharded dict without consolidating is refused, not silently lossy.
    let obj = torch_save::load(golden("fsdp1", "rank0.pt")).unwrap();
    assert!(matches!(
        torch_save::save_to_bytes(&obj),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(obj.get("state"), Some(PyObj::Dict(_))));
}
