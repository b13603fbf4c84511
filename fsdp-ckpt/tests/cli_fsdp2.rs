//! `fsdp-ckpt consolidate-torch` and `shard-torch` with `"fsdp_version": 2` (FSDP2,
//! `fully_shard`) against real PyTorch 2.13 FSDP2 on CPU/gloo
//! (`tests/golden/fsdp2/gen_optim.py`, fixtures in `tests/golden/fsdp2/optim/`).
//!
//! The model has an embedding of 7 rows tied to the head, 5-row linears in two `fully_shard`
//! blocks, a frozen LayerNorm weight and a 2-row parameter that rank 2 of 3 holds none of;
//! Adam (amsgrad), AdamW (two param groups) and SGD (momentum) trained two steps at world
//! sizes 2 and 3.

use fsdp::io::torch_save::{self, optim_to_pyobj};
use fsdp::{DType, HostTensor, OptimStateDict, ParamKey, Value};
use std::path::{Path, PathBuf};

mod tool;
use tool::{fails, golden, ok, run};

const OPTIMIZERS: [&str; 3] = ["adam_amsgrad", "adamw", "sgd"];

fn fixture(optim: &str, f: &str) -> PathBuf {
    golden(&format!("fsdp2/optim/{optim}/{f}"))
}

/// Rank files `ws{N}/{stem}{r}.pt` of one run.
fn rank_files(optim: &str, ws: usize, stem: &str) -> Vec<PathBuf> {
    (0..ws)
        .map(|r| fixture(optim, &format!("ws{ws}/{stem}{r}.pt")))
        .collect()
}

fn consolidate(desc: &Path, ranks: &[PathBuf], out: &Path) -> std::process::Output {
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"consolidate-torch", &"--model", &desc];
    for r in ranks {
        args.push(r);
    }
    args.push(&"-o");
    args.push(&out);
    run(&args)
}

fn shard(desc: &Path, full: &Path, ws: usize, out: &Path) -> std::process::Output {
    shard_with(desc, full, ws, out, &[])
}

fn shard_with(
    desc: &Path,
    full: &Path,
    ws: usize,
    out: &Path,
    extra: &[&str],
) -> std::process::Output {
    let ws = ws.to_string();
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"shard-torch",
        &"--model",
        &desc,
        &full,
        &"--world-size",
        &ws,
        &"-o",
        &out,
    ];
    for e in extra {
        args.push(e);
    }
    run(&args)
}

/// The same dict bit for bit: key order, key types, param groups, tensors.
fn same(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    let (pa, pb) = (optim_to_pyobj(a).unwrap(), optim_to_pyobj(b).unwrap());
    assert!(pa.bit_eq(&pb), "{what}: dicts differ\n{pa:?}\n!=\n{pb:?}");
}

fn load(p: &Path) -> OptimStateDict {
    torch_save::load_optim_state_dict(p).unwrap()
}

#[test]
fn consolidate_torch_gives_pytorch_fsdp2_full_optimizer_state_dict_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for optim in OPTIMIZERS {
        for ws in [2, 3] {
            let out = dir.path().join(format!("{optim}-{ws}.pt"));
            let ranks = rank_files(optim, ws, "rank");
            ok(&consolidate(&fixture(optim, "desc.json"), &ranks, &out));
            // The whole object, order and key types included, as PyTorch wrote it.
            let expected = torch_save::load(fixture(optim, &format!("ws{ws}/full.pt"))).unwrap();
            assert!(
                torch_save::load(&out).unwrap().bit_eq(&expected),
                "{optim} at {ws} ranks: consolidate-torch differs from get_optimizer_state_dict"
            );
        }
    }
}

#[test]
fn shard_torch_with_tuples_as_lists_gives_what_set_optimizer_state_dict_leaves_at_another_world_size(
) {
    let dir = tempfile::tempdir().unwrap();
    for optim in OPTIMIZERS {
        for (from, to) in [(3, 2), (2, 3)] {
            let out = dir.path().join(format!("{optim}-{from}-to-{to}"));
            let full = fixture(optim, &format!("ws{from}/full.pt"));
            let desc = fixture(optim, "desc.json");
            ok(&shard_with(&desc, &full, to, &out, &["--tuples-as-lists"]));
            for (r, want) in rank_files(optim, to, "load").iter().enumerate() {
                let got = load(&out.join(format!("rank{r}.pt")));
                same(&got, &load(want), &format!("{optim} {from}->{to} rank {r}"));
            }
        }
    }
}

#[test]
fn consolidate_torch_then_shard_torch_at_the_saved_world_size_gives_the_rank_files_back() {
    // What every rank's optimizer held (`optim.state_dict()`, DTensors as `to_local()`),
    // consolidated and sharded again for the same ranks: unchanged, `betas` a tuple.
    let dir = tempfile::tempdir().unwrap();
    for optim in OPTIMIZERS {
        for ws in [2, 3] {
            let desc = fixture(optim, "desc.json");
            let ranks = rank_files(optim, ws, "rank");
            let full = dir.path().join(format!("{optim}-{ws}.pt"));
            ok(&consolidate(&desc, &ranks, &full));
            let out = dir.path().join(format!("{optim}-{ws}-shards"));
            ok(&shard(&desc, &full, ws, &out));
            for (r, want) in ranks.iter().enumerate() {
                let got = torch_save::load(out.join(format!("rank{r}.pt"))).unwrap();
                let want = torch_save::load(want).unwrap();
                assert!(
                    got.bit_eq(&want),
                    "{optim} at {ws} ranks, rank {r}: shard-torch differs from the saved file\n{got:?}\n!=\n{want:?}"
                );
            }
        }
    }
}

#[test]
fn a_rank_with_no_rows_of_a_parameter_gets_an_empty_shard_with_the_other_dims() {
    // `small` is [2, 3]: at 3 ranks rank 2 holds none of it, as PyTorch's to_local() shows.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shards");
    let full = fixture("sgd", "ws2/full.pt");
    ok(&shard(&fixture("sgd", "desc.json"), &full, 3, &out));
    let rank2 = load(&out.join("rank2.pt"));
    let Value::Tensor(t) = &rank2.state[&ParamKey::Id(0)]["momentum_buffer"] else {
        panic!("momentum_buffer is a tensor");
    };
    assert_eq!(t.shape(), &[0, 3]);
}

#[test]
fn shard_then_consolidate_gives_back_the_full_dict() {
    let dir = tempfile::tempdir().unwrap();
    for optim in OPTIMIZERS {
        let desc = fixture(optim, "desc.json");
        let full = fixture(optim, "ws2/full.pt");
        let shards = dir.path().join(format!("{optim}-3"));
        ok(&shard(&desc, &full, 3, &shards));
        let back = dir.path().join(format!("{optim}-back.pt"));
        let ranks: Vec<PathBuf> = (0..3).map(|r| shards.join(format!("rank{r}.pt"))).collect();
        ok(&consolidate(&desc, &ranks, &back));
        // Bit for bit but for the tuples PyTorch's loading turns into lists (`betas`).
        let (mut got, mut want) = (load(&back), load(&full));
        for osd in [&mut got, &mut want] {
            for g in osd.param_groups.iter_mut().flatten() {
                for v in g.options.values_mut() {
                    if let Value::Tuple(items) = v {
                        *v = Value::List(std::mem::take(items));
                    }
                }
            }
        }
        same(&got, &want, optim);
    }
}

#[test]
fn a_named_optimizer_keys_every_rank_by_fqn_and_consolidates_back() {
    let dir = tempfile::tempdir().unwrap();
    let desc = fixture("sgd", "desc.json");
    let full = fixture("sgd", "ws3/full.pt");
    let shards = dir.path().join("named");
    ok(&run(&[
        &"shard-torch",
        &"--model",
        &desc,
        &full,
        &"--world-size",
        &"2",
        &"-o",
        &shards,
        &"--named-optimizer",
    ]));
    let rank1 = load(&shards.join("rank1.pt"));
    let keys: Vec<String> = rank1.state.keys().map(|k| k.to_string()).collect();
    assert_eq!(
        keys.first().map(String::as_str),
        Some("'small'"),
        "{keys:?}"
    );
    assert_eq!(
        keys.len(),
        11,
        "every trained parameter, the frozen norm.weight not: {keys:?}"
    );
    let back = dir.path().join("back.pt");
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"consolidate-torch", &"--model", &desc];
    let ranks: Vec<PathBuf> = (0..2).map(|r| shards.join(format!("rank{r}.pt"))).collect();
    for r in &ranks {
        args.push(r);
    }
    args.extend([
        &"-o" as &dyn AsRef<std::ffi::OsStr>,
        &back,
        &"--named-optimizer",
    ]);
    ok(&run(&args));
    same(&load(&back), &load(&full), "named round trip");
}

// ----- errors: typed messages naming rank, parameter and sizes, exit code 1, no panic -----

/// Copies of the ws-3 Adam rank files into `dir`, rank `r` edited by `edit`.
fn edited_ranks(dir: &Path, r: usize, mut edit: impl FnMut(&mut OptimStateDict)) -> Vec<PathBuf> {
    let ranks = rank_files("adam_amsgrad", 3, "rank");
    let out: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("rank{i}.pt"))).collect();
    for (i, (src, dst)) in ranks.iter().zip(&out).enumerate() {
        let mut osd = load(src);
        if i == r {
            edit(&mut osd);
            torch_save::save_optim_state_dict(&osd, dst).unwrap();
            continue;
        }
        std::fs::copy(src, dst).unwrap();
    }
    out
}

#[test]
fn files_of_another_world_size_are_refused_naming_the_sizes_that_fit() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("full.pt");
    let ranks = rank_files("adam_amsgrad", 3, "rank");
    let e = consolidate(&fixture("adam_amsgrad", "desc.json"), &ranks[..2], &out);
    let msg = fails(
        &e,
        &[
            "2 per-rank files were given",
            "rank 0's state",
            "fits world size(s) [3",
        ],
    );
    assert!(!out.exists(), "{msg}");
}

#[test]
fn a_shard_whose_rows_do_not_fit_the_layout_is_refused_naming_rank_and_parameter() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1's embed.weight (key 1, rows 3..6 of 7) given 2 rows.
    let ranks = edited_ranks(dir.path(), 1, |osd| {
        let st = osd.state.get_mut(&ParamKey::Id(1)).unwrap();
        st.insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::zeros(DType::F32, &[2, 4])),
        );
    });
    let e = consolidate(
        &fixture("adam_amsgrad", "desc.json"),
        &ranks,
        &dir.path().join("full.pt"),
    );
    fails(
        &e,
        &[
            "rank 1's state `exp_avg`",
            "`embed.weight`",
            "rows 3..6",
            "[2, 4]",
        ],
    );
}

#[test]
fn a_rank_missing_a_parameter_or_of_another_dtype_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("full.pt");
    let desc = fixture("adam_amsgrad", "desc.json");
    let missing = dir.path().join("missing");
    std::fs::create_dir(&missing).unwrap();
    let ranks = edited_ranks(&missing, 2, |osd| {
        osd.state.shift_remove(&ParamKey::Id(3));
    });
    fails(
        &consolidate(&desc, &ranks, &out),
        &["rank 2", "no state for key 3"],
    );
    let f64s = dir.path().join("f64");
    std::fs::create_dir(&f64s).unwrap();
    let ranks = edited_ranks(&f64s, 0, |osd| {
        let st = osd.state.get_mut(&ParamKey::Id(2)).unwrap();
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(HostTensor::zeros(DType::F64, &[2, 4])),
        );
    });
    fails(
        &consolidate(&desc, &ranks, &out),
        &[
            "dtype mismatch",
            "rank 0's state `exp_avg_sq`",
            "`layers.0.lin.weight`",
            "torch.float64",
        ],
    );
    assert!(!out.exists());
}

#[test]
fn shard_torch_refuses_a_full_dict_missing_a_trained_parameter_or_keyed_by_ids() {
    let dir = tempfile::tempdir().unwrap();
    let desc = fixture("sgd", "desc.json");
    let mut full = load(&fixture("sgd", "ws2/full.pt"));
    full.state.shift_remove(&ParamKey::Name("small".into()));
    let cut = dir.path().join("cut.pt");
    torch_save::save_optim_state_dict(&full, &cut).unwrap();
    let out = dir.path().join("shards");
    fails(
        &shard(&desc, &cut, 2, &out),
        &["`small`", "no optimizer state"],
    );
    // A rank's local dict is not a full dict.
    fails(
        &shard(&desc, &fixture("sgd", "ws2/rank0.pt"), 2, &out),
        &["keyed by parameter names", "0"],
    );
    assert!(!out.exists());
}

#[test]
fn desc_json_with_fsdp_version_2_still_refuses_unknown_fields() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(fixture("sgd", "desc.json")).unwrap();
    let typo = text.replace("\"fsdp_version\"", "\"fsdp_verison\"");
    assert_ne!(typo, text);
    let desc = dir.path().join("desc.json");
    std::fs::write(&desc, typo).unwrap();
    fails(
        &shard(
            &desc,
            &fixture("sgd", "ws2/full.pt"),
            2,
            &dir.path().join("o"),
        ),
        &["unknown field `fsdp_verison`"],
    );
}
