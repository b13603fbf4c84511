//! FSDP2's per-parameter layout: `torch.chunk` rows on dim 0, padded shards, `fully_shard`
//! groups in PyTorch's order, frozen, tied, mixed-dtype and unmanaged parameters, the
//! placement pieces tiling every tensor once, and the policies `fully_shard` refuses.

use fsdp::flat_param::ModelLayout;
use fsdp::io::dcp::check_tiling;
use fsdp::param_layout::{chunk_rows, Holding, ParamLayout};
use fsdp::{DType, Error, ModelDesc, WrapPolicy};

/// The ranks' row counts, as `_chunk_with_empty(torch.chunk(...))` gives them: row `j` goes to
/// chunk `j / ceil(n / ws)`.
fn torch_chunk_counts(n: usize, ws: usize) -> Vec<usize> {
    let c = n.div_ceil(ws).max(1);
    let mut counts = vec![0; ws];
    for j in 0..n {
        counts[j / c] += 1;
    }
    counts
}

#[test]
fn rows_follow_torch_chunk_with_trailing_ranks_short_or_empty() {
    let counts = |n, ws| {
        (0..ws)
            .map(|r| chunk_rows(n, ws, r).len())
            .collect::<Vec<_>>()
    };
    assert_eq!(counts(6, 4), [2, 2, 2, 0]);
    assert_eq!(counts(10, 4), [3, 3, 3, 1]);
    assert_eq!(counts(5, 4), [2, 2, 1, 0]);
    for ws in 1..=9 {
        for n in 0..40 {
            assert_eq!(
                counts(n, ws),
                torch_chunk_counts(n, ws),
                "{n} rows on {ws} ranks"
            );
            let mut next = 0;
            for r in 0..ws {
                let rows = chunk_rows(n, ws, r);
                if !rows.is_empty() {
                    assert_eq!(
                        rows.start, next,
                        "{n} rows on {ws} ranks: rank {r} is not contiguous"
                    );
                    next = rows.end;
                }
            }
            assert_eq!(next, n);
        }
    }
}

/// Embedding tied to the output head, two blocks, a frozen parameter, mixed dtypes and a
/// root-level parameter registered before the children.
fn transformer() -> ModelDesc {
    ModelDesc::new()
        .param("scale", &[3], DType::F32)
        .param("embed.weight", &[10, 4], DType::BF16)
        .param("layers.0.attn.weight", &[6, 4], DType::F32)
        .frozen_param("layers.0.norm.weight", &[4], DType::F32)
        .param("layers.1.attn.weight", &[6, 4], DType::F16)
        .param("layers.1.norm.weight", &[4], DType::F32)
        .param("norm.weight", &[4], DType::F32)
        .tie("head.weight", "embed.weight")
}

fn policy() -> WrapPolicy {
    WrapPolicy::fully_shard(&["layers.0", "layers.1", ""])
}

#[test]
fn groups_are_fully_shard_calls_with_modules_in_post_order() {
    let layout = ParamLayout::new(&transformer(), &policy(), 4).unwrap();
    let names = |g: usize| -> Vec<&str> {
        layout
            .group_params(g)
            .iter()
            .map(|p| p.name.as_str())
            .collect()
    };
    assert_eq!(names(0), ["layers.0.attn.weight", "layers.0.norm.weight"]);
    assert_eq!(names(1), ["layers.1.attn.weight", "layers.1.norm.weight"]);
    // The root's own `scale` comes after its children's parameters; the tied head is the
    // embedding's one entry, under its first name.
    assert_eq!(names(2), ["embed.weight", "norm.weight", "scale"]);
    assert!(layout.param("head.weight").is_none());
}

#[test]
fn shards_are_dim0_chunks_padded_to_the_chunk_size() {
    let layout = ParamLayout::new(&transformer(), &policy(), 4).unwrap();
    let embed = layout.param("embed.weight").unwrap();
    let local: Vec<Vec<usize>> = (0..4).map(|r| embed.local_shape(r)).collect();
    assert_eq!(local, [vec![3, 4], vec![3, 4], vec![3, 4], vec![1, 4]]);
    assert_eq!(embed.padded_shape(), [3, 4]);
    let attn = layout.param("layers.0.attn.weight").unwrap();
    let local: Vec<Vec<usize>> = (0..4).map(|r| attn.local_shape(r)).collect();
    // A rank without rows keeps the other dimensions, as `_get_dim_chunked_size`.
    assert_eq!(local, [vec![2, 4], vec![2, 4], vec![2, 4], vec![0, 4]]);
    let scale = layout.param("scale").unwrap();
    let local: Vec<usize> = (0..4).map(|r| scale.local_numel(r)).collect();
    assert_eq!(local, [1, 1, 1, 0]);
    assert_eq!(scale.padded_numel(), 1);
}

#[test]
fn every_tensor_is_tiled_once_and_frozen_ones_hold_no_optimizer_state() {
    for ws in [1, 2, 3, 4, 8, 11] {
        let layout = ParamLayout::new(&transformer(), &policy(), ws).unwrap();
        let placements = layout.placements();
        assert_eq!(placements.len(), 7);
        for t in &placements {
            assert_eq!(t.pieces.len(), ws, "{} at {ws}: one piece per rank", t.name);
            let chunks: Vec<_> = t.pieces.iter().map(|p| p.chunk.clone()).collect();
            check_tiling(&t.shape, &chunks).unwrap_or_else(|e| panic!("{} at {ws}: {e}", t.name));
        }
        let dtypes: Vec<DType> = placements.iter().map(|t| t.dtype).collect();
        assert!(dtypes.contains(&DType::BF16) && dtypes.contains(&DType::F16));
        let optim: Vec<String> = layout
            .optimizer_placements()
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(optim.len(), 6);
        assert!(!optim.contains(&"layers.0.norm.weight".to_string()));
    }
}

#[test]
fn parameters_outside_every_unit_or_ignored_are_replicated_whole() {
    let model = transformer().param("extra.step", &[], DType::F32);
    // `fully_shard` on the blocks only: everything else stays a plain tensor on every rank,
    // including the 0-dim parameter fully_shard would refuse to manage.
    let layout = ParamLayout::new(
        &model,
        &WrapPolicy::fully_shard(&["layers.0", "layers.1"]),
        3,
    )
    .unwrap();
    let step = layout.param("extra.step").unwrap();
    assert_eq!(step.holding, Holding::Replicated);
    let norm = layout.param("norm.weight").unwrap();
    assert_eq!(norm.holding, Holding::Replicated);
    assert!((0..3).all(|r| norm.local_shape(r) == [4]));
    let ignored = WrapPolicy::fully_shard(&["layers.0", ""]).with_ignored(&["extra"]);
    let layout = ParamLayout::new(&model, &ignored, 3).unwrap();
    assert_eq!(
        layout.param("extra.step").unwrap().holding,
        Holding::Replicated
    );
    assert_eq!(
        layout.param("norm.weight").unwrap().holding,
        Holding::Sharded { group: 1 }
    );
}

fn invalid_model(e: Error) -> String {
    match e {
        Error::InvalidModel(m) => m,
        other => panic!("expected InvalidModel, got {other:?}"),
    }
}

#[test]
fn what_fully_shard_refuses_is_refused_naming_the_culprit() {
    // A 0-dim parameter inside a unit (fully_shard: "doesn't support scalar parameters").
    let model = transformer().param("layers.1.gain", &[], DType::F32);
    let m = invalid_model(ParamLayout::new(&model, &policy(), 2).unwrap_err());
    assert!(m.contains("scalar") && m.contains("`layers.1.gain`"), "{m}");
    // Tied names in two units: PyTorch would shard the parameter twice.
    let split = WrapPolicy::fully_shard(&["embed", ""]);
    let m = invalid_model(ParamLayout::new(&transformer(), &split, 2).unwrap_err());
    assert!(
        m.contains("`embed.weight`") && m.contains("`head.weight`"),
        "{m}"
    );
    // A unit applied after its ancestor.
    let outer_first = WrapPolicy::fully_shard(&["", "layers.0"]);
    let m = invalid_model(ParamLayout::new(&transformer(), &outer_first, 2).unwrap_err());
    assert!(
        m.contains("`layers.0`") && m.contains("innermost first"),
        "{m}"
    );
    // FSDP1's flat layout and FSDP2's layout each refuse the other's policy.
    let m = invalid_model(ModelLayout::new(&transformer(), &policy(), 2).unwrap_err());
    assert!(m.contains("fsdp_version 2"), "{m}");
    let m =
        invalid_model(ParamLayout::new(&transformer(), &WrapPolicy::units(&[""]), 2).unwrap_err());
    assert!(m.contains("fsdp_version 1"), "{m}");
}

#[test]
fn desc_json_reads_fsdp_version_defaulting_to_1_and_refuses_misspellings() {
    let v2: WrapPolicy =
        serde_json::from_str(r#"{"units": ["a", ""], "fsdp_version": 2}"#).unwrap();
    assert_eq!(v2, WrapPolicy::fully_shard(&["a", ""]));
    let v1: WrapPolicy = serde_json::from_str(r#"{"units": [""]}"#).unwrap();
    assert_eq!(v1.fsdp_version, fsdp::FsdpVersion::V1);
    let e =
        serde_json::from_str::<WrapPolicy>(r#"{"units": [""], "fsdp_version": 3}"#).unwrap_err();
    assert!(e.to_string().contains("fsdp_version 3 is neither 1"), "{e}");
    let e =
        serde_json::from_str::<WrapPolicy>(r#"{"units": [""], "fsdp_verison": 2}"#).unwrap_err();
    assert!(e.to_string().contains("fsdp_verison"), "{e}");
}

/// `tests/golden/fsdp2/layout.json`, written by `gen.py` from PyTorch 2.13's `fully_shard` on
/// CPU/gloo at 2, 3 and 4 ranks: every group's order and every rank's local shape and global
/// offset equal the layout's, and the scalar refusal is PyTorch's.
#[test]
fn layout_equals_pytorch_fully_shard_at_2_3_and_4_ranks() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/fsdp2/layout.json"
    );
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let model: ModelDesc = serde_json::from_value(golden["model"].clone()).unwrap();
    let units: Vec<String> = serde_json::from_value(golden["units"].clone()).unwrap();
    let ignored: Vec<String> = serde_json::from_value(golden["ignored_modules"].clone()).unwrap();
    let policy = WrapPolicy::fully_shard(&units).with_ignored(&ignored);
    let layouts = golden["layouts"].as_array().unwrap();
    assert_eq!(layouts.len(), 3);
    for want in layouts {
        let ws = want["world_size"].as_u64().unwrap() as usize;
        let layout = ParamLayout::new(&model, &policy, ws).unwrap();
        let groups: Vec<Vec<String>> = (0..layout.groups.len())
            .map(|g| {
                layout
                    .group_params(g)
                    .iter()
                    .map(|p| p.name.clone())
                    .collect()
            })
            .collect();
        let want_groups: Vec<Vec<String>> = serde_json::from_value(want["groups"].clone()).unwrap();
        assert_eq!(groups, want_groups, "groups at {ws} ranks");
        for (rank, held) in want["ranks"].as_array().unwrap().iter().enumerate() {
            let held = held.as_object().unwrap();
            assert_eq!(held.len(), layout.params.len(), "parameters at {ws} ranks");
            for p in &layout.params {
                let what = format!("`{}` on rank {rank} of {ws}", p.name);
                let chunk = p.local_chunk(rank);
                match &held[&p.name] {
                    serde_json::Value::String(s) => {
                        assert_eq!(s, "replicated", "{what}");
                        assert_eq!(p.holding, Holding::Replicated, "{what}");
                    }
                    local => {
                        let shape: Vec<usize> =
                            serde_json::from_value(local["shape"].clone()).unwrap();
                        let offset: Vec<usize> =
                            serde_json::from_value(local["offset"].clone()).unwrap();
                        assert_eq!((chunk.sizes, chunk.offsets), (shape, offset), "{what}");
                    }
                }
            }
        }
    }
    let mut scalar = model.clone();
    scalar.params.push(fsdp::ParamDesc {
        name: "layers.1.step".into(),
        shape: vec![],
        dtype: DType::F32,
        requires_grad: true,
    });
    let m = invalid_model(ParamLayout::new(&scalar, &policy, 2).unwrap_err());
    let torch_says = golden["scalar_refused"].as_str().unwrap();
    assert!(torch_says.starts_with("fully_shard doesn't support scalar parameters"));
    assert!(
        m.contains("fully_shard does not support scalar parameters"),
        "{m}"
    );
}
