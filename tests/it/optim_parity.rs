//! Parity of `fsdp::optim` with real PyTorch 2.13 `torch.optim` (Adam, AdamW, SGD).
//!
//! Reference: `tests/golden/optim_steps.json`, written by `tests/golden/optim_steps.py` (run
//! manually; tests never run Python). Parameters and gradients come from closed formulas that
//! this test regenerates and checks against the stored bits.
//!
//! Tolerances:
//! * SGD: every parameter and state bit-identical to PyTorch.
//! * Adam/AdamW: bit-identical to `ieee_sqrt`, PyTorch's own op sequence with a correctly
//!   rounded `sqrt`. Against `torch.optim` itself, `step` and every state that does not depend
//!   on the parameters (all but L2 weight decay) are bit-identical; parameters (and, with L2
//!   weight decay, the states fed by them) are within [`MAX_ULP_VS_TORCH`] ulp, because
//!   PyTorch's CPU `sqrt` (MKL `VML_HA`) is not correctly rounded.
//! * Structure (state keys and their order, state names and their order, param-group keys,
//!   their order and values with Python kinds) is identical everywhere.

use fsdp::optim::{Adam, AdamConfig, AdamW, Number, Optimizer, Sgd, SgdConfig};
use fsdp::{
    DType, HostTensor, OptimParam, OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState,
    Value,
};
use half::{bf16, f16};
use serde_json::Value as J;
use std::fmt::Write as _;

/// Largest ulp distance from `torch.optim` allowed for Adam/AdamW after 3 steps (measured: see
/// the report printed by `adam_cases_match_torch`).
const MAX_ULP_VS_TORCH: u64 = 2;

fn golden() -> J {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/optim_steps.json");
    let text = std::fs::read_to_string(path)
        .expect("tests/golden/optim_steps.json (run tests/golden/optim_steps.py)");
    serde_json::from_str(&text).expect("valid JSON")
}

fn dtype(name: &str) -> DType {
    match name {
        "float32" => DType::F32,
        "float64" => DType::F64,
        "bfloat16" => DType::BF16,
        "float16" => DType::F16,
        other => panic!("unexpected dtype {other}"),
    }
}

fn shape(j: &J) -> Vec<usize> {
    j.as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect()
}

fn tensor_from_bits(dt: DType, shape: &[usize], bits: &J) -> HostTensor {
    let hex: Vec<&str> = bits
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap())
        .collect();
    let mut bytes = Vec::new();
    for h in hex {
        match dt {
            DType::F32 => {
                bytes.extend_from_slice(&u32::from_str_radix(h, 16).unwrap().to_le_bytes())
            }
            DType::F64 => {
                bytes.extend_from_slice(&u64::from_str_radix(h, 16).unwrap().to_le_bytes())
            }
            DType::BF16 | DType::F16 => {
                bytes.extend_from_slice(&u16::from_str_radix(h, 16).unwrap().to_le_bytes())
            }
            other => panic!("unexpected dtype {other}"),
        }
    }
    HostTensor::from_bytes(dt, shape, &bytes).unwrap()
}

fn tensor(j: &J) -> HostTensor {
    tensor_from_bits(
        dtype(j["dtype"].as_str().unwrap()),
        &shape(&j["shape"]),
        &j["bits"],
    )
}

fn f64_bits(j: &J) -> f64 {
    f64::from_bits(u64::from_str_radix(j.as_str().unwrap(), 16).unwrap())
}

/// Tagged JSON value (see `enc_value` in the script) -> `Value`.
fn value(j: &J) -> Value {
    let (tag, v) = j
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| *k != "bits")
        .unwrap();
    match tag.as_str() {
        "bool" => Value::Bool(v.as_bool().unwrap()),
        "int" => Value::Int(v.as_i64().unwrap()),
        "float" => Value::Float(f64_bits(&j["bits"])),
        "none" => Value::None,
        "str" => Value::Str(v.as_str().unwrap().to_string()),
        "tuple" => Value::Tuple(v.as_array().unwrap().iter().map(value).collect()),
        "list" => Value::List(v.as_array().unwrap().iter().map(value).collect()),
        "tensor" => Value::Tensor(tensor(v)),
        other => panic!("unexpected tag {other}"),
    }
}

fn pairs(j: &J) -> Vec<(String, Value)> {
    j.as_array()
        .unwrap()
        .iter()
        .map(|kv| (kv["key"].as_str().unwrap().to_string(), value(&kv["value"])))
        .collect()
}

fn state_entries(j: &J) -> Vec<(ParamKey, ParamState)> {
    j.as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let key = ParamKey::Id(s["key"].as_u64().unwrap() as usize);
            let st = s["entries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e["name"].as_str().unwrap().to_string(), value(&e["value"])))
                .collect();
            (key, st)
        })
        .collect()
}

fn state_dict(j: &J) -> OptimStateDict {
    let groups = j["param_groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| ParamGroup {
            options: pairs(&g["options"]).into_iter().collect(),
            params: g["params"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| ParamKey::Id(p.as_u64().unwrap() as usize))
                .collect(),
        })
        .collect();
    OptimStateDict {
        state: state_entries(&j["state"]).into_iter().collect(),
        param_groups: Some(groups),
    }
}

fn number(v: &Value) -> Number {
    match v {
        Value::Int(i) => Number::Int(*i),
        Value::Float(x) => Number::Float(*x),
        other => panic!("not a number: {other:?}"),
    }
}

fn float(v: &Value) -> f64 {
    number(v).as_f64()
}

fn boolean(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        other => panic!("not a bool: {other:?}"),
    }
}

/// A test case: the optimizer spec and the parameter/gradient formulas.
struct Case {
    j: J,
    name: String,
    kind: String,
    /// Parameter index of each optimizer id.
    order: Vec<usize>,
    specs: Vec<(DType, Vec<usize>)>,
}

impl Case {
    fn new(j: &J) -> Case {
        let order = j["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| {
                g["params"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p.as_u64().unwrap() as usize)
            })
            .collect();
        let specs = j["param_specs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (dtype(s["dtype"].as_str().unwrap()), shape(&s["shape"])))
            .collect();
        Case {
            name: j["name"].as_str().unwrap().to_string(),
            kind: j["optimizer"].as_str().unwrap().to_string(),
            j: j.clone(),
            order,
            specs,
        }
    }

    fn optimizer(&self) -> Box<dyn Optimizer> {
        let groups: Vec<Vec<OptimParam>> = self.j["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                g["params"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| OptimParam::Param(format!("p{p}")))
                    .collect()
            })
            .collect();
        let params = OptimParams {
            groups,
            named: false,
        };
        let kwargs = pairs(&self.j["kwargs"]);
        let overrides: Vec<Vec<(String, Value)>> = self.j["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| pairs(&g["overrides"]))
            .collect();
        match self.kind.as_str() {
            "Adam" | "AdamW" => {
                let mut c = if self.kind == "Adam" {
                    AdamConfig::default()
                } else {
                    AdamConfig::adamw()
                };
                for (k, v) in &kwargs {
                    match k.as_str() {
                        "lr" => c.lr = float(v),
                        "betas" => match v {
                            Value::Tuple(b) => c.betas = (float(&b[0]), float(&b[1])),
                            other => panic!("betas {other:?}"),
                        },
                        "eps" => c.eps = float(v),
                        "weight_decay" => c.weight_decay = number(v),
                        "amsgrad" => c.amsgrad = boolean(v),
                        "maximize" => c.maximize = boolean(v),
                        other => panic!("unexpected Adam kwarg {other}"),
                    }
                }
                if self.kind == "Adam" {
                    let mut o = Adam::new(params, c).unwrap();
                    for (g, ov) in overrides.into_iter().enumerate() {
                        o = o.with_group_options(g, ov).unwrap();
                    }
                    Box::new(o)
                } else {
                    let mut o = AdamW::new(params, c).unwrap();
                    for (g, ov) in overrides.into_iter().enumerate() {
                        o = o.with_group_options(g, ov).unwrap();
                    }
                    Box::new(o)
                }
            }
            "SGD" => {
                let mut c = SgdConfig::default();
                for (k, v) in &kwargs {
                    match k.as_str() {
                        "lr" => c.lr = float(v),
                        "momentum" => c.momentum = number(v),
                        "dampening" => c.dampening = number(v),
                        "weight_decay" => c.weight_decay = number(v),
                        "nesterov" => c.nesterov = boolean(v),
                        "maximize" => c.maximize = boolean(v),
                        other => panic!("unexpected SGD kwarg {other}"),
                    }
                }
                let mut o = Sgd::new(params, c).unwrap();
                for (g, ov) in overrides.into_iter().enumerate() {
                    o = o.with_group_options(g, ov).unwrap();
                }
                Box::new(o)
            }
            other => panic!("unexpected optimizer {other}"),
        }
    }

    /// Whether Adam's gradient depends on the parameters (L2 weight decay).
    fn l2_weight_decay(&self) -> bool {
        self.kind == "Adam"
            && pairs(&self.j["kwargs"])
                .iter()
                .any(|(k, v)| k == "weight_decay" && float(v) != 0.0)
    }

    fn steps(&self) -> &Vec<J> {
        self.j["steps"].as_array().unwrap()
    }

    /// Initial parameters by optimizer id, from the formula (checked against the stored bits).
    fn initial_params(&self) -> Vec<HostTensor> {
        let by_param: Vec<HostTensor> = self
            .specs
            .iter()
            .enumerate()
            .map(|(k, (dt, shape))| {
                let n: usize = shape.iter().product();
                let vals: Vec<f64> = (0..n)
                    .map(|i| (0.23 * i as f64 + 0.5 * k as f64).cos() * (1.0 + 0.25 * k as f64))
                    .collect();
                let t = from_f64(*dt, shape, &vals);
                let stored = tensor(&self.j["initial_params"][k]);
                assert!(
                    t.bit_eq(&stored),
                    "{}: initial param {k} formula differs from the stored bits",
                    self.name
                );
                t
            })
            .collect();
        self.order.iter().map(|&k| by_param[k].clone()).collect()
    }

    /// Gradients of step `s` by optimizer id (None where the script gave none).
    fn grads(&self, s: usize) -> Vec<Option<HostTensor>> {
        let stored = self.j["grads"][s].as_array().unwrap();
        let by_param: Vec<Option<HostTensor>> = self
            .specs
            .iter()
            .enumerate()
            .map(|(k, (dt, shape))| {
                if stored[k].is_null() {
                    return None;
                }
                let n: usize = shape.iter().product();
                let vals: Vec<f64> = (0..n)
                    .map(|i| (0.37 * i as f64 + 1.3 * s as f64 + 0.11 * k as f64).sin())
                    .collect();
                let t = from_f64(*dt, shape, &vals);
                let want = tensor_from_bits(*dt, shape, &stored[k]);
                assert!(
                    t.bit_eq(&want),
                    "{}: grad formula of param {k} at step {s} differs from the stored bits",
                    self.name
                );
                Some(t)
            })
            .collect();
        self.order.iter().map(|&k| by_param[k].clone()).collect()
    }

    /// torch's parameters after step `s`, by optimizer id.
    fn torch_params(&self, s: usize, record: &str) -> Vec<HostTensor> {
        let step = &self.steps()[s];
        let list = if record == "torch" {
            &step["params"]
        } else {
            &step[record]["params"]
        };
        self.order.iter().map(|&k| tensor(&list[k])).collect()
    }
}

/// `torch.tensor(vals, dtype=float64).to(dtype)`.
fn from_f64(dt: DType, shape: &[usize], vals: &[f64]) -> HostTensor {
    match dt {
        DType::F64 => HostTensor::from_slice(vals, shape),
        DType::F32 => {
            HostTensor::from_slice(&vals.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape)
        }
        DType::BF16 => HostTensor::from_slice(
            &vals.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<_>>(),
            shape,
        ),
        DType::F16 => HostTensor::from_slice(
            &vals.iter().map(|&v| f16::from_f64(v)).collect::<Vec<_>>(),
            shape,
        ),
        other => panic!("unexpected dtype {other}"),
    }
    .unwrap()
}

/// Distance in ulps between two tensors of one dtype and shape (max over elements).
fn max_ulp(a: &HostTensor, b: &HostTensor) -> u64 {
    assert_eq!(a.dtype(), b.dtype());
    assert_eq!(a.shape(), b.shape());
    fn ordered(bits: u64, sign: u64) -> i128 {
        if bits & sign != 0 {
            -((bits & !sign) as i128)
        } else {
            bits as i128
        }
    }
    let (width, sign) = match a.dtype() {
        DType::F64 => (8, 1u64 << 63),
        DType::F32 => (4, 1u64 << 31),
        DType::BF16 | DType::F16 => (2, 1u64 << 15),
        other => panic!("unexpected dtype {other}"),
    };
    let word = |c: &[u8]| {
        let mut w = [0u8; 8];
        w[..width].copy_from_slice(c);
        u64::from_le_bytes(w)
    };
    a.as_bytes()
        .chunks(width)
        .zip(b.as_bytes().chunks(width))
        .map(|(x, y)| (ordered(word(x), sign) - ordered(word(y), sign)).unsigned_abs() as u64)
        .max()
        .unwrap_or(0)
}

/// Which values are allowed to differ from the reference, and by how much.
#[derive(Clone, Copy)]
struct Policy {
    /// Tolerance for parameters.
    params: u64,
    /// Tolerance for positive-dim state tensors (`step` is always exact).
    state: u64,
}

/// The largest ulp distances seen, for the report.
#[derive(Default, Debug)]
struct Seen {
    params: u64,
    state: u64,
    params_inexact: usize,
    params_total: usize,
}

fn compare_tensors(ctx: &str, ours: &HostTensor, want: &HostTensor, tol: u64) -> u64 {
    assert_eq!(ours.dtype(), want.dtype(), "{ctx}: dtype");
    assert_eq!(ours.shape(), want.shape(), "{ctx}: shape");
    let d = max_ulp(ours, want);
    assert!(
        d <= tol,
        "{ctx}: {d} ulp from the reference (allowed {tol}): ours {ours:?}, reference {want:?}"
    );
    d
}

/// Compares a state (keys, names, order, values) with a reference state.
fn compare_state(
    ctx: &str,
    ours: &OptimStateDict,
    want: &[(ParamKey, ParamState)],
    tol: u64,
    seen: &mut Seen,
) {
    let our_keys: Vec<&ParamKey> = ours.state.keys().collect();
    let want_keys: Vec<&ParamKey> = want.iter().map(|(k, _)| k).collect();
    assert_eq!(our_keys, want_keys, "{ctx}: state keys and their order");
    for (key, wst) in want {
        let ost = &ours.state[key];
        let on: Vec<&String> = ost.keys().collect();
        let wn: Vec<&String> = wst.keys().collect();
        assert_eq!(on, wn, "{ctx}: state names of {key} and their order");
        for (name, wv) in wst {
            let c = format!("{ctx}: state {key} `{name}`");
            match (&ost[name], wv) {
                (Value::Tensor(o), Value::Tensor(w)) => {
                    let t = if name == "step" { 0 } else { tol };
                    let d = compare_tensors(&c, o, w, t);
                    seen.state = seen.state.max(d);
                }
                (o, w) => assert_eq!(o, w, "{c}"),
            }
        }
    }
}

fn compare_params(ctx: &str, ours: &[HostTensor], want: &[HostTensor], tol: u64, seen: &mut Seen) {
    for (id, (o, w)) in ours.iter().zip(want).enumerate() {
        let d = compare_tensors(&format!("{ctx}: parameter id {id}"), o, w, tol);
        seen.params = seen.params.max(d);
        seen.params_total += o.numel();
        seen.params_inexact += count_inexact(o, w);
    }
}

fn count_inexact(a: &HostTensor, b: &HostTensor) -> usize {
    let w = a.dtype().size();
    a.as_bytes()
        .chunks(w)
        .zip(b.as_bytes().chunks(w))
        .filter(|(x, y)| x != y)
        .count()
}

fn compare_groups(ctx: &str, ours: &OptimStateDict, want: &OptimStateDict) {
    let og = ours.param_groups.as_ref().unwrap();
    let wg = want.param_groups.as_ref().unwrap();
    assert_eq!(og.len(), wg.len(), "{ctx}: number of param groups");
    for (g, (o, w)) in og.iter().zip(wg).enumerate() {
        let ok: Vec<&String> = o.options.keys().collect();
        let wk: Vec<&String> = w.options.keys().collect();
        assert_eq!(ok, wk, "{ctx}: keys of param group {g} and their order");
        for (k, v) in &w.options {
            assert!(
                o.options[k].same_scalar(v),
                "{ctx}: param group {g} `{k}`: ours {:?}, torch {v:?}",
                o.options[k]
            );
        }
        assert_eq!(o.params, w.params, "{ctx}: params of group {g}");
    }
}

/// Steps a case from scratch and compares every step with the references.
fn run_case(case: &Case, vs_torch: Policy, vs_ieee: Option<Policy>) -> (Seen, Seen) {
    let mut opt = case.optimizer();
    let mut params = case.initial_params();
    let (mut seen_torch, mut seen_ieee) = (Seen::default(), Seen::default());
    for (s, record) in case.steps().iter().enumerate() {
        let ctx = format!("{} step {s}", case.name);
        opt.step(&mut params, &case.grads(s)).unwrap();
        let sd = opt.state_dict();
        let torch_sd = state_dict(&record["state_dict"]);
        compare_groups(&ctx, &sd, &torch_sd);
        let torch_state: Vec<_> = torch_sd.state.into_iter().collect();
        compare_state(
            &format!("{ctx} vs torch"),
            &sd,
            &torch_state,
            vs_torch.state,
            &mut seen_torch,
        );
        compare_params(
            &format!("{ctx} vs torch"),
            &params,
            &case.torch_params(s, "torch"),
            vs_torch.params,
            &mut seen_torch,
        );
        if let Some(pol) = vs_ieee {
            let ieee = state_entries(&record["ieee_sqrt"]["state"]);
            compare_state(
                &format!("{ctx} vs ieee_sqrt"),
                &sd,
                &ieee,
                pol.state,
                &mut seen_ieee,
            );
            compare_params(
                &format!("{ctx} vs ieee_sqrt"),
                &params,
                &case.torch_params(s, "ieee_sqrt"),
                pol.params,
                &mut seen_ieee,
            );
        }
    }
    (seen_torch, seen_ieee)
}

/// Loads torch's dict after step `s - 1` into a fresh optimizer, with torch's parameters, and
/// compares step `s` with torch.
fn run_resumed(case: &Case, vs_torch: Policy) -> Seen {
    let mut seen = Seen::default();
    for s in 1..case.steps().len() {
        let ctx = format!("{} resumed at step {s}", case.name);
        let mut opt = case.optimizer();
        let prev = state_dict(&case.steps()[s - 1]["state_dict"]);
        opt.load_state_dict(&prev).unwrap();
        compare_groups(&format!("{ctx} (loaded)"), &opt.state_dict(), &prev);
        let mut params = case.torch_params(s - 1, "torch");
        opt.step(&mut params, &case.grads(s)).unwrap();
        let sd = opt.state_dict();
        let torch_sd = state_dict(&case.steps()[s]["state_dict"]);
        compare_groups(&ctx, &sd, &torch_sd);
        let torch_state: Vec<_> = torch_sd.state.into_iter().collect();
        compare_state(&ctx, &sd, &torch_state, vs_torch.state, &mut seen);
        compare_params(
            &ctx,
            &params,
            &case.torch_params(s, "torch"),
            vs_torch.params,
            &mut seen,
        );
    }
    seen
}

fn cases(kinds: &[&str]) -> Vec<Case> {
    let g = golden();
    assert!(
        g["torch_version"].as_str().unwrap().starts_with("2.13"),
        "golden file is not from PyTorch 2.13"
    );
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(Case::new)
        .filter(|c| kinds.contains(&c.kind.as_str()))
        .collect()
}

const EXACT: Policy = Policy {
    params: 0,
    state: 0,
};

#[test]
fn sgd_cases_match_torch_bit_for_bit() {
    let cases = cases(&["SGD"]);
    assert!(cases.len() >= 5);
    for case in &cases {
        run_case(case, EXACT, None);
        run_resumed(case, EXACT);
    }
}

#[test]
fn adam_cases_match_torch() {
    let cases = cases(&["Adam", "AdamW"]);
    assert!(cases.len() >= 6);
    let mut report = String::new();
    for case in &cases {
        let state_tol = if case.l2_weight_decay() {
            MAX_ULP_VS_TORCH
        } else {
            0
        };
        let vs_torch = Policy {
            params: MAX_ULP_VS_TORCH,
            state: state_tol,
        };
        let (torch, ieee) = run_case(case, vs_torch, Some(EXACT));
        let resumed = run_resumed(case, vs_torch);
        writeln!(
            report,
            "{:<28} vs torch: params max {} ulp ({}/{} elements inexact), state max {} ulp; resumed: params max {} ulp, state max {} ulp; vs ieee_sqrt: max {} ulp",
            case.name,
            torch.params,
            torch.params_inexact,
            torch.params_total,
            torch.state,
            resumed.params,
            resumed.state,
            ieee.params.max(ieee.state)
        )
        .unwrap();
    }
    println!("{report}");
}

#[test]
fn golden_file_covers_the_matrix() {
    let names: Vec<String> = cases(&["Adam", "AdamW", "SGD"])
        .into_iter()
        .map(|c| c.name)
        .collect();
    for want in [
        "adam_default",
        "adam_weight_decay",
        "adam_amsgrad",
        "adamw_default",
        "sgd_momentum",
        "sgd_nesterov_wd",
        "sgd_plain",
    ] {
        assert!(names.iter().any(|n| n == want), "missing case {want}");
    }
}
