//! Models, wrapping policies and a training loop shared by the scenario tests: ports of the
//! models of PyTorch's `test_fsdp_optim_state.py`.
#![allow(dead_code)]

pub mod conformance;
pub mod fsdp2;
pub mod harness;
pub mod job;

use fsdp::flat_param::ModelLayout;
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_shards::{shard_tensors, synthetic_grads, synthetic_params};
use fsdp::{
    DType, HostTensor, ModelDesc, OptimParam, OptimParams, OptimStateDict, ParamKey, ParamState,
    Value, WrapPolicy,
};

/// The Python with PyTorch 2.13 that the tests compare with: `FSDP_PYTHON`, else the crate's
/// `.venv` (`scripts/setup-venv.sh`). Without one the test fails: these tests are never
/// skipped.
pub fn python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("FSDP_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with PyTorch found: set FSDP_PYTHON to a python that has torch 2.13, or run \
         scripts/setup-venv.sh to create .venv in the crate root; this test compares with \
         PyTorch and is never skipped"
    );
    venv
}

/// Runs the Python script `script` of [`python`] with `args`; its standard output, or a panic
/// naming the script and its arguments, with everything it printed.
pub fn python_script(
    script: &std::path::Path,
    args: impl IntoIterator<Item = impl AsRef<std::ffi::OsStr>>,
) -> String {
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().into()).collect();
    let out = std::process::Command::new(python())
        .arg(script)
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} {args:?} failed:\n{}{}",
        script.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every file of the directory `dir` (names sorted) with its bytes: two outputs compared
/// byte for byte.
pub fn files_of(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// A copy of the directory `src`, subdirectories included, at `<fresh temporary>/name`: a
/// fixture to damage.
pub fn copy_dir(src: &std::path::Path, name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    fn copy(src: &std::path::Path, dst: &std::path::Path) {
        std::fs::create_dir(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                copy(&e.path(), &dst.join(e.file_name()));
            } else {
                std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(name);
    copy(src, &dst);
    (tmp, dst)
}

/// The model files of a Hugging Face directory (`.safetensors` files and the index) with
/// their bytes, by name: two exports compared byte for byte.
pub fn model_files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") || n.ends_with(".index.json"))
        .map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap()))
        .collect();
    v.sort();
    v
}

/// The `Net` of the DCP fixtures (tests/golden/dcp/gen.py, untied, nothing frozen).
pub fn dcp_fixture_net() -> ModelDesc {
    let f = DType::F32;
    ModelDesc::new()
        .param("embed.weight", &[10, 4], f)
        .param("net1.0.weight", &[10, 4], f)
        .param("net1.0.bias", &[10], f)
        .param("net2.0.weight", &[3, 10], f)
        .param("net2.0.bias", &[3], f)
        .param("head.weight", &[10, 3], f)
        .param("out.weight", &[10, 4], f)
}

/// `NestedModel` of the PyTorch test: blocks of `BlockA`/`BlockB` with biases, in
/// `named_parameters()` order (the root's own `bias` first).
pub fn nested_model() -> ModelDesc {
    let f = DType::F32;
    let mut m = ModelDesc::new().param("bias", &[5], f);
    // BlockB(in, out): weight, bias_module0.bias, bias_module1.bias
    for (p, i, o) in [("block0", 5, 3), ("block1", 3, 7)] {
        m = m
            .param(&format!("{p}.weight"), &[i, o], f)
            .param(&format!("{p}.bias_module0.bias"), &[o], f)
            .param(&format!("{p}.bias_module1.bias"), &[o], f);
    }
    // BlockA(in, out): weight is registered between its two Bias children but, being the
    // module's own parameter, comes first.
    for (p, i, o) in [("block2.0", 7, 9), ("block2.1", 9, 9)] {
        m = m
            .param(&format!("{p}.weight"), &[i, o], f)
            .param(&format!("{p}.bias_module0.bias"), &[o], f)
            .param(&format!("{p}.bias_module1.bias"), &[o], f);
    }
    m.param("block2.2.weight", &[9, 5], f)
        .param("block2.2.bias_module0.bias", &[5], f)
        .param("block2.2.bias_module1.bias", &[5], f)
}

/// `NestedModel.wrap`, optionally ignoring `block2[2].bias_module0`.
pub fn wrap(ignore_modules: bool) -> WrapPolicy {
    let p = WrapPolicy::units(&[
        "block1.bias_module0",
        "block1",
        "block2.1.bias_module0",
        "block2.1.bias_module1",
        "block2.1",
        "block2.2",
    ]);
    if ignore_modules {
        p.with_ignored(&["block2.2.bias_module0"])
    } else {
        p
    }
}

/// `NestedModel.wrap_alt`.
pub fn wrap_alt() -> WrapPolicy {
    WrapPolicy::units(&["block0.bias_module0", "block0"])
}

/// `module.parameters()` of the wrapped model restricted to the module `prefix`.
pub fn module_params(layout: &ModelLayout, prefix: &str) -> Vec<OptimParam> {
    let inside = |n: &str| fsdp::model::prefix_contains(prefix, n) || n == prefix;
    OptimParam::in_model_order(layout)
        .into_iter()
        .filter(|p| match p {
            OptimParam::Flat(u) => inside(u),
            OptimParam::Param(n) => inside(n),
        })
        .collect()
}

/// The optimizer input of `_init_nested_model`: `model.parameters()` or the two groups
/// (`block1`; `block2` then `block0`, the second with weight_decay 0.9), reversed on odd ranks
/// when `diff_inputs`.
pub fn nested_optim_input(
    layout: &ModelLayout,
    multiple_groups: bool,
    diff_inputs: bool,
    rank: usize,
) -> OptimParams {
    let mut groups = if multiple_groups {
        let g0 = module_params(layout, "block1");
        let mut g1 = module_params(layout, "block2");
        g1.extend(module_params(layout, "block0"));
        vec![g0, g1]
    } else {
        vec![OptimParam::in_model_order(layout)]
    };
    if diff_inputs && rank % 2 == 1 {
        for g in &mut groups {
            g.reverse();
        }
    }
    OptimParams {
        groups,
        named: false,
    }
}

/// A transformer-like model with a tied embedding / output projection, wrapped per layer and
/// at the root (`TransformerWithSharedParams` in spirit, smaller).
pub fn transformer_model() -> ModelDesc {
    let f = DType::F32;
    let d = 8;
    let mut m = ModelDesc::new().param("embed_tokens.weight", &[20, d], f);
    for stack in ["encoder", "decoder"] {
        for l in 0..2 {
            let p = format!("transformer.{stack}.layers.{l}");
            m = m
                .param(&format!("{p}.self_attn.in_proj_weight"), &[3 * d, d], f)
                .param(&format!("{p}.self_attn.in_proj_bias"), &[3 * d], f)
                .param(&format!("{p}.self_attn.out_proj.weight"), &[d, d], f)
                .param(&format!("{p}.self_attn.out_proj.bias"), &[d], f)
                .param(&format!("{p}.linear1.weight"), &[2 * d, d], f)
                .param(&format!("{p}.linear1.bias"), &[2 * d], f)
                .param(&format!("{p}.linear2.weight"), &[d, 2 * d], f)
                .param(&format!("{p}.linear2.bias"), &[d], f)
                .param(&format!("{p}.norm1.weight"), &[d], f)
                .param(&format!("{p}.norm1.bias"), &[d], f);
        }
        m = m
            .param(&format!("transformer.{stack}.norm.weight"), &[d], f)
            .param(&format!("transformer.{stack}.norm.bias"), &[d], f);
    }
    m.param("output_proj.bias", &[20], f)
        .tie("output_proj.weight", "embed_tokens.weight")
}

/// Every encoder/decoder layer is a unit, plus the root.
pub fn transformer_policy() -> WrapPolicy {
    let mut units = vec![];
    for stack in ["encoder", "decoder"] {
        for l in 0..2 {
            units.push(format!("transformer.{stack}.layers.{l}"));
        }
    }
    units.push(String::new());
    WrapPolicy::units(&units)
}

/// `TestDummyModel`: four linear layers, the first optionally frozen.
pub fn dummy_model(frozen_first: bool) -> ModelDesc {
    let f = DType::F32;
    let m = ModelDesc::new();
    let m = if frozen_first {
        m.frozen_param("net1.0.weight", &[16, 8], f)
            .frozen_param("net1.0.bias", &[16], f)
    } else {
        m.param("net1.0.weight", &[16, 8], f)
            .param("net1.0.bias", &[16], f)
    };
    m.param("net2.0.weight", &[32, 16], f)
        .param("net2.0.bias", &[32], f)
        .param("net3.weight", &[64, 32], f)
        .param("net3.bias", &[64], f)
        .param("net4.1.weight", &[8, 64], f)
        .param("net4.1.bias", &[8], f)
}

/// The layout of the same model without FSDP (every parameter unmanaged, one rank).
pub fn unwrapped(model: &ModelDesc) -> ModelLayout {
    ModelLayout::new(model, &WrapPolicy::default(), 1).unwrap()
}

/// Maps an FSDP optimizer input onto the unwrapped model: each flat parameter becomes its
/// members, in order.
pub fn unwrapped_input(layout: &ModelLayout, params: &OptimParams) -> OptimParams {
    let groups = params
        .groups
        .iter()
        .map(|g| {
            g.iter()
                .flat_map(|p| match p {
                    OptimParam::Flat(u) => layout
                        .flat_of_unit(u)
                        .unwrap()
                        .fqns()
                        .into_iter()
                        .map(OptimParam::Param)
                        .collect::<Vec<_>>(),
                    other => vec![other.clone()],
                })
                .collect()
        })
        .collect();
    OptimParams {
        groups,
        named: params.named,
    }
}

/// The tensors an optimizer steps on and their synthetic gradients for `steps` steps.
pub struct Slots {
    pub params: Vec<HostTensor>,
}

impl Slots {
    pub fn new(layout: &ModelLayout, rank: usize, input: &OptimParams) -> Self {
        let p = shard_tensors(layout, rank, input, &synthetic_params(layout)).unwrap();
        Slots {
            params: p
                .into_iter()
                .map(|t| t.unwrap_or_else(|| HostTensor::zeros(DType::F32, &[0])))
                .collect(),
        }
    }

    pub fn grads(
        layout: &ModelLayout,
        rank: usize,
        input: &OptimParams,
        step: usize,
    ) -> Vec<Option<HostTensor>> {
        shard_tensors(layout, rank, input, &synthetic_grads(layout, step)).unwrap()
    }
}

/// Asserts two name-keyed dicts hold the same state: same keys, same state names, tensors
/// bit-identical (sharded tensors compared by their local chunk), scalars equal.
pub fn assert_same_state(a: &OptimStateDict, b: &OptimStateDict, what: &str) {
    let ka: std::collections::BTreeSet<&ParamKey> = a.state.keys().collect();
    let kb: std::collections::BTreeSet<&ParamKey> = b.state.keys().collect();
    assert_eq!(ka, kb, "{what}: different parameter keys");
    for (k, sa) in &a.state {
        let sb = &b.state[k];
        let na: std::collections::BTreeSet<&String> = sa.keys().collect();
        let nb: std::collections::BTreeSet<&String> = sb.keys().collect();
        assert_eq!(na, nb, "{what}: different state names for {k}");
        for (n, va) in sa {
            let vb = &sb[n.as_str()];
            match (va, vb) {
                (Value::Tensor(x), Value::Tensor(y)) => assert!(
                    x.bit_eq(y),
                    "{what}: state `{n}` of {k} differs:\n{x:?}\n{y:?}"
                ),
                _ => assert_eq!(va, vb, "{what}: state `{n}` of {k} differs"),
            }
        }
    }
}

/// Asserts param groups agree in hyper-parameters and, when `keys`, in `params`.
pub fn assert_same_groups(a: &OptimStateDict, b: &OptimStateDict, keys: bool, what: &str) {
    let (ga, gb) = (
        a.param_groups.as_ref().unwrap(),
        b.param_groups.as_ref().unwrap(),
    );
    assert_eq!(ga.len(), gb.len(), "{what}: number of param groups");
    for (x, y) in ga.iter().zip(gb) {
        assert_eq!(x.options, y.options, "{what}: hyper-parameters");
        if keys {
            assert_eq!(x.params, y.params, "{what}: params");
        }
    }
}

/// `optim_class(optim_input, lr=0.01)`, the second group `{"params": ..., "weight_decay": 0.9}`
/// (the Adam of PyTorch's `test_fsdp_optim_state.py`).
pub fn make_adam(input: &OptimParams) -> Box<dyn Optimizer> {
    let mut adam = Adam::new(
        input.clone(),
        AdamConfig {
            lr: 0.01,
            ..AdamConfig::default()
        },
    )
    .unwrap();
    if input.groups.len() > 1 {
        adam = adam
            .with_group_options(1, [("weight_decay", Value::Float(0.9))])
            .unwrap();
    }
    Box::new(adam)
}

/// A full Adam state (`exp_avg`, `exp_avg_sq`, `step`) for every trained parameter of `model`,
/// keyed by name, with distinct values per element and one param group (`lr`, `betas`, `eps`).
pub fn full_adam(model: &ModelDesc) -> OptimStateDict {
    let mut full = OptimStateDict::default();
    let mut names = vec![];
    for (i, p) in model.params.iter().enumerate() {
        if !p.requires_grad {
            continue;
        }
        let n = p.numel();
        let avg: Vec<f32> = (0..n).map(|j| (i * 1000 + j) as f32 * 0.001).collect();
        let sq: Vec<f32> = (0..n).map(|j| ((i + j) as f32).sqrt()).collect();
        let mut st = ParamState::new();
        st.insert(
            "exp_avg".into(),
            Value::Tensor(HostTensor::from_slice(&avg, &p.shape).unwrap()),
        );
        st.insert(
            "exp_avg_sq".into(),
            Value::Tensor(HostTensor::from_slice(&sq, &p.shape).unwrap()),
        );
        st.insert("step".into(), Value::Tensor(HostTensor::scalar(7.0f32)));
        full.state.insert(ParamKey::Name(p.name.clone()), st);
        names.push(ParamKey::Name(p.name.clone()));
    }
    let mut options = indexmap::IndexMap::new();
    options.insert("lr".into(), Value::Float(1e-3));
    options.insert(
        "betas".into(),
        Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
    );
    options.insert("eps".into(), Value::Float(1e-8));
    full.param_groups = Some(vec![fsdp::ParamGroup {
        options,
        params: names,
    }]);
    full
}
