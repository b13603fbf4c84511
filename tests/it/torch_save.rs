//! `torch.save` reader and writer: PyTorch-written fixtures read bit for bit, write → read round
//! trips, corrupted input, and Rust-written files loaded by PyTorch itself.
//!
//! Fixtures come from `tests/golden/torch_save_fixtures.py`; each `<name>.pt` has a
//! `<name>.json` describing its contents (format in `tests/golden/check_torch_load.py`).

use fsdp::io::torch_save::{self, PyObj, SavedModelStateDict};
use fsdp::{DType, Error, HostTensor, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use indexmap::IndexMap;
use proptest::prelude::*;
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 7] = [
    "adam_int_keys",
    "named_state",
    "model_state",
    "dtypes",
    "views",
    "misc",
    "more_dtypes",
];

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/torch_save")
}

fn fixture(name: &str) -> PathBuf {
    golden().join(format!("{name}.pt"))
}

fn expectation(name: &str) -> Json {
    let text = std::fs::read_to_string(golden().join(format!("{name}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

// ----- the JSON description of check_torch_load.py, both ways -----

fn dtype_from(s: &str) -> DType {
    match s {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "i64" => DType::I64,
        "i32" => DType::I32,
        "u8" => DType::U8,
        "bool" => DType::Bool,
        "i8" => DType::I8,
        "i16" => DType::I16,
        "u16" => DType::U16,
        "u32" => DType::U32,
        "u64" => DType::U64,
        "f8e4m3fn" => DType::F8E4M3FN,
        "f8e5m2" => DType::F8E5M2,
        "c64" => DType::C64,
        "c128" => DType::C128,
        other => panic!("dtype {other}"),
    }
}

pub(crate) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::Bool => "bool",
        DType::I8 => "i8",
        DType::I16 => "i16",
        DType::U16 => "u16",
        DType::U32 => "u32",
        DType::U64 => "u64",
        DType::F8E4M3FN => "f8e4m3fn",
        DType::F8E5M2 => "f8e5m2",
        DType::C64 => "c64",
        DType::C128 => "c128",
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn from_json(j: &Json) -> PyObj {
    let (tag, v) = j
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| *k != "attrs")
        .unwrap();
    let pairs = |v: &Json| -> Vec<(PyObj, PyObj)> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|p| (from_json(&p[0]), from_json(&p[1])))
            .collect()
    };
    match tag.as_str() {
        "none" => PyObj::None,
        "bool" => PyObj::Bool(v.as_bool().unwrap()),
        "int" => PyObj::int(v.as_str().unwrap().parse::<i128>().unwrap()),
        "float" => PyObj::Float(f64::from_bits(v.as_str().unwrap().parse().unwrap())),
        "str" => PyObj::Str(v.as_str().unwrap().into()),
        "bytes" => PyObj::Bytes(unhex(v.as_str().unwrap())),
        "tuple" => PyObj::Tuple(v.as_array().unwrap().iter().map(from_json).collect()),
        "size" => PyObj::Size(
            v.as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_i64().unwrap())
                .collect(),
        ),
        "list" => PyObj::List(v.as_array().unwrap().iter().map(from_json).collect()),
        "dict" => PyObj::Dict(pairs(v)),
        "odict" => PyObj::OrderedDict {
            items: pairs(v),
            attrs: j["attrs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_str().unwrap().to_string(), from_json(&p[1])))
                .collect(),
        },
        "tensor" => {
            let shape: Vec<usize> = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            let bytes = unhex(v["hex"].as_str().unwrap());
            PyObj::Tensor(
                HostTensor::from_bytes(dtype_from(v["dtype"].as_str().unwrap()), &shape, &bytes)
                    .unwrap(),
            )
        }
        other => panic!("tag {other}"),
    }
}

fn to_json(o: &PyObj) -> Json {
    let pairs = |items: &[(PyObj, PyObj)]| -> Json {
        items
            .iter()
            .map(|(k, v)| json!([to_json(k), to_json(v)]))
            .collect()
    };
    match o {
        PyObj::None => json!({ "none": null }),
        PyObj::Bool(b) => json!({ "bool": b }),
        PyObj::Int(_) | PyObj::BigInt(_) => json!({ "int": o.as_i128().unwrap().to_string() }),
        PyObj::Float(x) => json!({ "float": x.to_bits().to_string() }),
        PyObj::Str(s) => json!({ "str": s }),
        PyObj::Bytes(b) => json!({ "bytes": hex(b) }),
        PyObj::Tuple(v) => json!({ "tuple": v.iter().map(to_json).collect::<Vec<_>>() }),
        PyObj::Size(v) => json!({ "size": v }),
        PyObj::List(v) => json!({ "list": v.iter().map(to_json).collect::<Vec<_>>() }),
        PyObj::Dict(items) => json!({ "dict": pairs(items) }),
        PyObj::OrderedDict { items, attrs } => json!({
            "odict": pairs(items),
            "attrs": attrs.iter().map(|(k, v)| json!([k, to_json(v)])).collect::<Vec<_>>(),
        }),
        PyObj::Tensor(t) => json!({ "tensor": {
            "dtype": dtype_name(t.dtype()),
            "shape": t.shape(),
            "hex": hex(t.as_bytes()),
        }}),
        PyObj::Sharded(_) => panic!("the fixtures hold no sharded tensors"),
        other => panic!(
            "the fixtures of this module hold no {} (tests/it/torch_load.rs reads those)",
            other.type_name()
        ),
    }
}

fn get<'a>(o: &'a PyObj, key: &str) -> &'a PyObj {
    o.get(key)
        .unwrap_or_else(|| panic!("no key {key:?} in {}", o.describe()))
}

fn tensor<'a>(o: &'a PyObj, key: &str) -> &'a HostTensor {
    match get(o, key) {
        PyObj::Tensor(t) => t,
        other => panic!("{key}: {}", other.describe()),
    }
}

fn assert_bit_eq(got: &PyObj, expected: &PyObj, what: &str) {
    assert!(
        got.bit_eq(expected),
        "{what}: contents differ\n got: {got:?}\nwant: {expected:?}"
    );
}

// ----- reading PyTorch's files -----

#[test]
fn every_fixture_reads_bit_exact() {
    for name in FIXTURES {
        let got = torch_save::load(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = from_json(&expectation(name)["object"]);
        assert_bit_eq(&got, &want, name);
        // The same bytes read from memory give the same object.
        let bytes = std::fs::read(fixture(name)).unwrap();
        assert_bit_eq(&torch_save::load_from_bytes(&bytes).unwrap(), &want, name);
    }
}

#[test]
fn adam_state_dict_with_int_keys_and_two_groups() {
    let osd = torch_save::load_optim_state_dict(fixture("adam_int_keys")).unwrap();
    let keys: Vec<_> = osd.state.keys().cloned().collect();
    assert_eq!(keys, (0..4).map(ParamKey::Id).collect::<Vec<_>>());
    let s0 = &osd.state[&ParamKey::Id(0)];
    assert_eq!(
        s0.keys().collect::<Vec<_>>(),
        ["step", "exp_avg", "exp_avg_sq"]
    );
    let step = s0["step"].as_tensor().unwrap();
    assert_eq!(
        (step.dtype(), step.dim(), step.item()),
        (DType::F32, 0, Some(2.0))
    );
    assert_eq!(s0["exp_avg"].as_tensor().unwrap().shape(), &[4, 3]);
    let groups = osd.param_groups.as_ref().unwrap();
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].params, vec![ParamKey::Id(0), ParamKey::Id(1)]);
    assert_eq!(groups[1].params, vec![ParamKey::Id(2), ParamKey::Id(3)]);
    assert_eq!(groups[0].options["lr"], Value::Float(1e-3));
    assert_eq!(
        groups[1].options["betas"],
        Value::Tuple(vec![Value::Float(0.8), Value::Float(0.99)])
    );
    assert_eq!(groups[1].options["weight_decay"], Value::Float(0.01));
    assert_eq!(groups[0].options["foreach"], Value::None);
    assert_eq!(groups[0].options["amsgrad"], Value::Bool(false));
    // Options keep PyTorch's order; `params` is not among them.
    assert_eq!(groups[0].options.keys().next().unwrap(), "lr");
    assert!(!groups[0].options.contains_key("params"));
}

#[test]
fn named_state_dict_with_user_state() {
    let osd = torch_save::load_optim_state_dict(fixture("named_state")).unwrap();
    assert!(osd.is_name_keyed());
    let user = &osd.state[&ParamKey::from("user_state")];
    assert_eq!(user["note"], Value::Str("hello".into()));
    assert_eq!(user["count"], Value::Int(3));
    assert_eq!(user["flag"], Value::Bool(true));
    assert_eq!(user["nothing"], Value::None);
    let g = &osd.param_groups.as_ref().unwrap()[0];
    assert_eq!(
        g.params,
        vec![ParamKey::from("layer.bias"), ParamKey::from("layer.weight")]
    );
}

#[test]
fn model_state_dict_keeps_order_and_metadata() {
    let msd = torch_save::load_model_state_dict(fixture("model_state")).unwrap();
    let names: Vec<_> = msd.tensors.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
            "2.weight"
        ]
    );
    let n = &msd.tensors["1.num_batches_tracked"];
    assert_eq!((n.dtype(), n.dim(), n.item()), (DType::I64, 0, Some(1.0)));
    let meta = msd.metadata.as_ref().expect("_metadata");
    let root = meta.get("").unwrap();
    assert_eq!(root.get("version"), Some(&PyObj::Int(1)));
    assert_eq!(meta.get("1").unwrap().get("version"), Some(&PyObj::Int(2)));
}

#[test]
fn views_share_storage_and_strided_tensors_are_copied() {
    let o = torch_save::load(fixture("views")).unwrap();
    let base = tensor(&o, "base");
    for k in ["head", "tail", "grid"] {
        assert!(tensor(&o, k).shares_storage_with(base), "{k}");
    }
    assert_eq!(
        tensor(&o, "tail").as_slice::<f32>().unwrap(),
        &[8.0, 9.0, 10.0, 11.0]
    );
    let t = tensor(&o, "transposed");
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(
        t.as_slice::<f64>().unwrap(),
        &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    );
    assert_eq!(
        tensor(&o, "offset_only").as_slice::<i64>().unwrap(),
        &[3, 4, 5, 6]
    );
    assert_eq!(tensor(&o, "strided").as_slice::<i32>().unwrap(), &[1, 4, 7]);
    assert_eq!(
        tensor(&o, "expanded").as_slice::<f32>().unwrap(),
        &[5.0, 5.0, 5.0, 6.0, 6.0, 6.0]
    );
    let c = tensor(&o, "col_of_3d");
    assert_eq!(c.shape(), &[2, 2]);
    assert_eq!(c.to_f64_vec(), vec![6.0, 10.0, 18.0, 22.0]);
}

#[test]
fn dtypes_and_zero_dim_tensors() {
    let o = torch_save::load(fixture("dtypes")).unwrap();
    for (k, d) in [
        ("scalar_f32", DType::F32),
        ("scalar_f64", DType::F64),
        ("scalar_f16", DType::F16),
        ("scalar_bf16", DType::BF16),
        ("scalar_i64", DType::I64),
        ("scalar_i32", DType::I32),
        ("scalar_u8", DType::U8),
        ("scalar_bool", DType::Bool),
    ] {
        let t = tensor(&o, k);
        assert_eq!((t.dtype(), t.dim()), (d, 0), "{k}");
    }
    assert_eq!(tensor(&o, "scalar_bf16").item(), Some(-7.0));
    assert_eq!(tensor(&o, "empty_2d").shape(), &[2, 0]);
    assert_eq!(
        tensor(&o, "i64").as_slice::<i64>().unwrap(),
        &[i64::MIN, i64::MAX, 0]
    );
}

#[test]
fn misc_values() {
    let o = torch_save::load(fixture("misc")).unwrap();
    let PyObj::List(big) = get(&o, "big_ints") else {
        panic!()
    };
    assert_eq!(big[0].as_i128(), Some(1i128 << 64));
    assert_eq!(big[1].as_i128(), Some(-(1i128 << 70)));
    assert_eq!(big[3].as_i128(), Some(i128::from(i64::MIN) - 1));
    assert_eq!(
        get(&o, "bytes"),
        &PyObj::Bytes(b"\x00\x01\xff raw".to_vec())
    );
    // A torch.Size stays one (it used to be read as a plain tuple and written back so).
    assert_eq!(get(&o, "size"), &PyObj::Size(vec![2, 3]));
    let PyObj::List(l) = get(&o, "long_list") else {
        panic!()
    };
    assert_eq!(l.len(), 1001);
    assert!(matches!(get(&o, "odict"), PyObj::OrderedDict { .. }));
}

// ----- typed errors -----

#[test]
fn legacy_file_reads() {
    // torch.save({"a": torch.ones(2)}, _use_new_zipfile_serialization=False)
    let o = torch_save::load(fixture("legacy")).unwrap();
    assert_bit_eq(
        &o,
        &PyObj::Dict(vec![(
            PyObj::Str("a".into()),
            PyObj::Tensor(HostTensor::from_vec1(&[1.0f32, 1.0])),
        )]),
        "legacy.pt",
    );
}

#[test]
fn missing_file_is_an_io_error() {
    let e = torch_save::load(golden().join("nope.pt")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::NotFound), "{e}");
    // The OS error stays reachable as the source, and crosses the wire intact.
    assert!(std::error::Error::source(&e).is_some(), "{e}");
    let wire = fsdp::collectives::decode::<Error>(&fsdp::collectives::encode(&e).unwrap()).unwrap();
    assert_eq!(wire, e);
    assert_eq!(wire.io_kind(), Some(std::io::ErrorKind::NotFound));
}

/// A stored zip archive with the given entries, as torch.save lays it out (crafted input),
/// plus a `version` record (which PyTorch requires) in the first entry's folder when no entry
/// is one.
fn zip_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut entries = entries.to_vec();
    let version;
    if let Some((first, _)) = entries.first() {
        if !entries.iter().any(|(n, _)| n.ends_with("version")) {
            version = format!("{}/version", first.split('/').next().unwrap());
            entries.push((&version, b"3\n"));
        }
    }
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in &entries {
        let crc = crc32fast::hash(data);
        let at = out.len() as u32;
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0u8; 12]);
        central.extend_from_slice(&at.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd_at = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_at.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

fn with_pickle(pkl: &[u8]) -> Vec<u8> {
    zip_of(&[("a/data.pkl", pkl), ("a/byteorder", b"little")])
}

fn binunicode(s: &str) -> Vec<u8> {
    let mut v = vec![b'X'];
    v.extend_from_slice(&(s.len() as u32).to_le_bytes());
    v.extend_from_slice(s.as_bytes());
    v
}

/// The pickle of one f32 tensor viewing storage "0" of `numel` elements.
fn tensor_pickle(numel: u8, offset: u8, size: &[u8], stride: &[u8]) -> Vec<u8> {
    let mut p = vec![0x80, 2];
    p.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n((");
    p.extend(binunicode("storage"));
    p.extend_from_slice(b"ctorch\nFloatStorage\n");
    p.extend(binunicode("0"));
    p.extend(binunicode("cpu"));
    p.extend_from_slice(&[b'K', numel, b't', b'Q', b'K', offset, b'(']);
    for &d in size {
        p.extend_from_slice(&[b'K', d]);
    }
    p.extend_from_slice(b"t(");
    for &s in stride {
        p.extend_from_slice(&[b'K', s]);
    }
    p.extend_from_slice(b"t\x89ccollections\nOrderedDict\n)RtR.");
    p
}

#[test]
fn crafted_tensor_pickle_reads() {
    let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let file = zip_of(&[
        ("a/data.pkl", &tensor_pickle(4, 1, &[3], &[1])),
        ("a/data/0", &data),
    ]);
    let PyObj::Tensor(t) = torch_save::load_from_bytes(&file).unwrap() else {
        panic!()
    };
    assert_eq!(t.as_slice::<f32>().unwrap(), &[2.0, 3.0, 4.0]);
}

#[test]
fn storage_problems_are_typed_errors() {
    let data = [0u8; 16];
    let cases: [(Vec<u8>, &[u8]); 4] = [
        (tensor_pickle(4, 2, &[3], &[1]), &data), // past the end
        (tensor_pickle(4, 0, &[2, 2], &[3, 1]), &data), // strided past the end
        (tensor_pickle(4, 5, &[], &[]), &data),   // offset past the end
        (tensor_pickle(5, 0, &[2], &[1]), &data), // entry smaller than declared
    ];
    for (pkl, data) in cases {
        let file = zip_of(&[("a/data.pkl", &pkl), ("a/data/0", data)]);
        let e = torch_save::load_from_bytes(&file).unwrap_err();
        assert!(matches!(e, Error::TensorStorage { .. }), "{e}");
    }
    let file = zip_of(&[("a/data.pkl", &tensor_pickle(4, 0, &[4], &[1]))]);
    let e = torch_save::load_from_bytes(&file).unwrap_err();
    assert!(
        matches!(&e, Error::MissingArchiveEntry { entry, .. } if entry == "a/data/0"),
        "{e}"
    );
}

#[test]
fn unsupported_pickle_content_is_named() {
    let e = torch_save::load_from_bytes(&with_pickle(b"\x80\x02cos\nsystem\n.")).unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleGlobal { module, name, offset: 2, .. } if module == "os" && name == "system"),
        "{e}"
    );
    let e = torch_save::load_from_bytes(&with_pickle(b"\x80\x02I1\n.")).unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleOpcode { opcode: b'I', name, offset: 2, .. } if name == "INT"),
        "{e}"
    );
    let e = torch_save::load_from_bytes(&with_pickle(b"\x80\x02\xff.")).unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleOpcode { opcode: 0xff, .. }),
        "{e}"
    );
    // Dtypes are values of their own, those the crate holds no tensors of too (as
    // weights_only reads them); a name outside the allow-list is refused by name.
    for dtype in ["complex64", "float8_e4m3fnuz", "uint4"] {
        let p = [&b"\x80\x02ctorch\n"[..], dtype.as_bytes(), b"\n."].concat();
        let o = torch_save::load_from_bytes(&with_pickle(&p)).unwrap();
        assert_eq!(o, PyObj::TorchConst(format!("torch.{dtype}")));
    }
    for class in ["ComplexHalfStorage", "float3"] {
        let p = [&b"\x80\x02ctorch\n"[..], class.as_bytes(), b"\n."].concat();
        let e = torch_save::load_from_bytes(&with_pickle(&p)).unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedPickleGlobal { module, name, .. } if module == "torch" && name == class),
            "{e}"
        );
    }
    // Opcodes weights_only does not execute (protocol 0/1's POP and LIST, protocol 4's
    // FRAME, even one longer than the stream) are refused by name.
    for (bad, op) in [
        (&b"\x80\x02N0N."[..], "POP"),
        (b"\x80\x02(l.", "LIST"),
        (b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00N.", "FRAME"),
    ] {
        let e = torch_save::load_from_bytes(&with_pickle(bad)).unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedPickleOpcode { name, .. } if name == op),
            "{e}"
        );
    }
    for bad in [
        &b"\x80\x02a."[..],
        b"\x80\x02]",
        b"\x80\x02h\x05.",
        b"\x80\x02X\xff\x00\x00\x00ab",
    ] {
        let e = torch_save::load_from_bytes(&with_pickle(bad)).unwrap_err();
        assert!(matches!(e, Error::Pickle { .. }), "{bad:?}: {e}");
    }
}

#[test]
fn big_endian_and_missing_pickle_are_typed_errors() {
    let file = zip_of(&[("a/data.pkl", b"\x80\x02N."), ("a/byteorder", b"big")]);
    let e = torch_save::load_from_bytes(&file).unwrap_err();
    assert!(matches!(e, Error::UnsupportedByteOrder { .. }), "{e}");
    let file = zip_of(&[("a/version", b"3\n")]);
    let e = torch_save::load_from_bytes(&file).unwrap_err();
    assert!(matches!(e, Error::MissingArchiveEntry { .. }), "{e}");
    let e = torch_save::load_from_bytes(b"hello world").unwrap_err();
    assert!(matches!(e, Error::TorchSaveArchive { .. }), "{e}");
}

#[test]
fn cycles_deep_nesting_and_blowups_are_errors_not_crashes() {
    // A list containing itself.
    let e = torch_save::load_from_bytes(&with_pickle(b"\x80\x02]q\x00h\x00a.")).unwrap_err();
    assert!(matches!(e, Error::Pickle { .. }), "{e}");
    // 200 000 nested lists built through the memo, without a deep stack.
    let mut p = b"\x80\x02]q\x00".to_vec();
    for _ in 0..200_000 {
        p.extend_from_slice(b"]h\x00aq\x00");
    }
    p.extend_from_slice(b"h\x00.");
    let e = torch_save::load_from_bytes(&with_pickle(&p)).unwrap_err();
    assert!(matches!(e, Error::Pickle { .. }), "{e}");
    // Each level holds the previous twice: 2^60 nodes if expanded.
    let mut p = b"\x80\x02]q\x00".to_vec();
    for _ in 0..60 {
        p.extend_from_slice(b"(h\x00h\x00tq\x00");
    }
    p.extend_from_slice(b"h\x00.");
    let e = torch_save::load_from_bytes(&with_pickle(&p)).unwrap_err();
    assert!(matches!(e, Error::Pickle { .. }), "{e}");
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = std::fs::read(fixture("named_state")).unwrap();
    for n in 0..bytes.len() {
        assert!(
            torch_save::load_from_bytes(&bytes[..n]).is_err(),
            "prefix of {n} bytes was accepted"
        );
    }
}

#[test]
fn flipped_bytes_never_panic_and_damaged_data_is_caught() {
    let bytes = std::fs::read(fixture("views")).unwrap();
    let read: Vec<_> = entry_ranges(&bytes)
        .into_iter()
        .filter(|(n, _)| {
            n.ends_with("data.pkl") || n.contains("/data/") || n.ends_with("byteorder")
        })
        .map(|(_, r)| r)
        .collect();
    assert_eq!(read.len(), 8);
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= mask;
            let r = torch_save::load_from_bytes(&b);
            // Bytes of the entries that are read are covered by their CRC-32; other bytes
            // (padding, timestamps, unread records) may change without harm.
            if read.iter().any(|rg| rg.contains(&i)) {
                assert!(r.is_err(), "flipping byte {i} with {mask:#x} was accepted");
            }
        }
    }
}

/// The entries of an archive written with data descriptors (as PyTorch and this crate write),
/// found by walking the local headers.
fn entries_of(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    entry_ranges(bytes)
        .into_iter()
        .map(|(n, r)| (n, bytes[r].to_vec()))
        .collect()
}

/// Name and data range of each entry, see [`entries_of`].
fn entry_ranges(bytes: &[u8]) -> Vec<(String, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while bytes[at..at + 4] == [0x50, 0x4b, 0x03, 0x04] {
        let nlen = u16::from_le_bytes([bytes[at + 26], bytes[at + 27]]) as usize;
        let elen = u16::from_le_bytes([bytes[at + 28], bytes[at + 29]]) as usize;
        let name = String::from_utf8(bytes[at + 30..at + 30 + nlen].to_vec()).unwrap();
        let data = at + 30 + nlen + elen;
        let len = (data..)
            .map(|d| d - data)
            .find(|&n| {
                bytes[data + n..data + n + 4] == [0x50, 0x4b, 0x07, 0x08]
                    && u32::from_le_bytes(bytes[data + n + 12..data + n + 16].try_into().unwrap())
                        as usize
                        == n
            })
            .unwrap();
        out.push((name, data..data + len));
        at = data + len + 16;
    }
    out
}

#[test]
fn mutated_pickles_never_panic() {
    // Damage data.pkl but keep CRCs valid, so the pickle machine itself sees the damage.
    let bytes = std::fs::read(fixture("adam_int_keys")).unwrap();
    let entries = entries_of(&bytes);
    assert_eq!(entries[0].0, "adam_int_keys/data.pkl");
    let pkl = entries[0].1.clone();
    let rebuild = |p: &[u8]| {
        let mut e: Vec<(&str, &[u8])> = entries.iter().map(|(n, d)| (n.as_str(), &d[..])).collect();
        e[0].1 = p;
        zip_of(&e)
    };
    assert!(torch_save::load_from_bytes(&rebuild(&pkl)).is_ok());
    for i in 0..pkl.len() {
        for v in [0u8, 1, 0x7f, 0xff, b'(', b't', b'R', b'Q', b'h', b'a'] {
            let mut p = pkl.clone();
            p[i] = v;
            let _ = torch_save::load_from_bytes(&rebuild(&p));
        }
        assert!(torch_save::load_from_bytes(&rebuild(&pkl[..i])).is_err());
    }
}

// ----- writing -----

#[test]
fn fixtures_round_trip_through_the_writer() {
    for name in FIXTURES {
        let obj = torch_save::load(fixture(name)).unwrap();
        let bytes = torch_save::save_to_bytes(&obj).unwrap();
        let back = torch_save::load_from_bytes(&bytes).unwrap();
        assert_bit_eq(&back, &obj, name);
        // Deterministic: the same object gives the same bytes.
        assert_eq!(torch_save::save_to_bytes(&back).unwrap(), bytes, "{name}");
    }
    let o = torch_save::load_from_bytes(
        &torch_save::save_to_bytes(&torch_save::load(fixture("views")).unwrap()).unwrap(),
    )
    .unwrap();
    for k in ["head", "tail", "grid"] {
        assert!(tensor(&o, k).shares_storage_with(tensor(&o, "base")), "{k}");
    }
}

#[test]
fn written_layout_matches_pytorch() {
    let obj = torch_save::load(fixture("views")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.pt");
    torch_save::save(&obj, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    // Local headers: names in PyTorch's order, data 64-byte aligned.
    let mut at = 0;
    for (name, data) in entries_of(&bytes) {
        let nlen = u16::from_le_bytes([bytes[at + 26], bytes[at + 27]]) as usize;
        let elen = u16::from_le_bytes([bytes[at + 28], bytes[at + 29]]) as usize;
        let start = at + 30 + nlen + elen;
        assert_eq!(start % 64, 0, "{name} data at {start}");
        assert_eq!(&bytes[at + 30 + nlen..at + 30 + nlen + 2], b"FB");
        at = start + data.len() + 16;
    }
    let names: Vec<String> = entries_of(&bytes).into_iter().map(|(n, _)| n).collect();
    let storages = names.iter().filter(|n| n.starts_with("ckpt/data/")).count();
    // base/head/tail/grid share one storage; the other five tensors have their own.
    assert_eq!(storages, 6);
    assert_eq!(
        names[..4],
        [
            "ckpt/data.pkl",
            "ckpt/.format_version",
            "ckpt/.storage_alignment",
            "ckpt/byteorder"
        ]
    );
    assert_eq!(
        names[names.len() - 2..],
        ["ckpt/version", "ckpt/.data/serialization_id"]
    );
    // Atomic write: nothing but the target in the directory.
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(files, ["ckpt.pt"]);
}

#[test]
fn zip64_end_records_are_followed() {
    // PyTorch (and this crate) always write zip64 end records; a reader must use them when the
    // classic end record says 0xffff / 0xffffffff, as it does in files over 4 GiB.
    let obj = torch_save::load(fixture("views")).unwrap();
    let mut bytes = torch_save::save_to_bytes(&obj).unwrap();
    let eocd = bytes.len() - 22;
    assert_eq!(bytes[eocd..eocd + 4], [0x50, 0x4b, 0x05, 0x06]);
    bytes[eocd + 8..eocd + 20].fill(0xff);
    assert_bit_eq(&torch_save::load_from_bytes(&bytes).unwrap(), &obj, "zip64");
    // Without the zip64 locator the same file is refused.
    bytes[eocd - 20] ^= 0xff;
    let e = torch_save::load_from_bytes(&bytes).unwrap_err();
    assert!(matches!(e, Error::TorchSaveArchive { .. }), "{e}");
}

// ----- the zip checks PyTorch's reader makes (miniz 3.0.2 under `PyTorchStreamReader`) -----

/// A file the crate's writer lays out as PyTorch does, and where its records are.
struct Written {
    bytes: Vec<u8>,
    obj: PyObj,
}

impl Written {
    fn new() -> Self {
        let obj = torch_save::load(fixture("views")).unwrap();
        let bytes = torch_save::save_to_bytes(&obj).unwrap();
        Written { bytes, obj }
    }
    fn le(&self, at: usize, n: usize) -> u64 {
        let mut a = [0u8; 8];
        a[..n].copy_from_slice(&self.bytes[at..at + n]);
        u64::from_le_bytes(a)
    }
    fn put(&mut self, at: usize, v: u64, n: usize) {
        self.bytes[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
    }
    fn eocd(&self) -> usize {
        self.bytes.len() - 22
    }
    fn locator(&self) -> usize {
        self.bytes.len() - 42
    }
    fn zip64(&self) -> usize {
        self.bytes.len() - 98
    }
    /// The central entry of the record `archive/<name>`.
    fn central(&self, name: &str) -> usize {
        let full = format!("archive/{name}");
        let mut at = self.le(self.zip64() + 48, 8) as usize;
        loop {
            assert_eq!(self.le(at, 4), 0x0201_4b50);
            let nlen = self.le(at + 28, 2) as usize;
            if self.bytes[at + 46..at + 46 + nlen] == *full.as_bytes() {
                return at;
            }
            at += 46 + nlen + self.le(at + 30, 2) as usize + self.le(at + 32, 2) as usize;
        }
    }
    /// The local header of the record `archive/<name>`.
    fn local(&self, name: &str) -> usize {
        self.le(self.central(name) + 42, 4) as usize
    }
    fn load(&self) -> fsdp::Result<PyObj> {
        torch_save::load_from_bytes(&self.bytes)
    }
    /// Refused with a typed archive error whose reason contains `why`.
    fn refused(&self, why: &str) {
        match self.load() {
            Err(Error::TorchSaveArchive { reason, .. }) => {
                assert!(reason.contains(why), "`{reason}` does not say `{why}`")
            }
            other => panic!("expected a TorchSaveArchive error saying `{why}`, got {other:?}"),
        }
    }
    fn accepted(&self) {
        assert_bit_eq(&self.load().unwrap(), &self.obj, "damaged but readable");
    }
}

/// Every record PyTorch's `torch.load` extracts (`PyTorchStreamReader::init`, `_load`).
const EXTRACTED: [&str; 7] = [
    "data.pkl",
    ".format_version",
    ".storage_alignment",
    "byteorder",
    "data/0",
    "version",
    ".data/serialization_id",
];

#[test]
fn local_headers_of_every_record_pytorch_extracts_are_checked() {
    // miniz (mz_zip_reader_extract_to_mem_no_alloc1): "if (MZ_READ_LE32(pLocal_header) !=
    // MZ_ZIP_LOCAL_DIR_HEADER_SIG) return ... MZ_ZIP_INVALID_HEADER_OR_CORRUPTED".
    for name in EXTRACTED {
        let mut w = Written::new();
        let at = w.local(name);
        w.bytes[at] ^= 0x01;
        // The first local header is also the file's magic number.
        w.refused(if at == 0 {
            "not a zip archive"
        } else {
            "bad local header signature"
        });
        // The data is found through the local name and extra lengths: too far is refused...
        let mut w = Written::new();
        let at = w.local(name);
        w.put(at + 26, 0xffff, 2);
        w.refused("do not fit in the file");
    }
    // Data shifted by a wrong local extra length: PyTorch checks no CRC-32, this crate checks
    // that of what it reads itself (the pickle, byteorder, storages) ...
    for name in ["data.pkl", "byteorder", "data/0"] {
        let mut w = Written::new();
        let at = w.local(name);
        w.put(at + 28, w.le(at + 28, 2) + 1, 2);
        w.refused("CRC-32 mismatch");
    }
    // ... and reads the other records as PyTorch does: `.format_version` may hold anything.
    let mut w = Written::new();
    let at = w.local(".format_version");
    w.put(at + 28, w.le(at + 28, 2) + 1, 2);
    w.accepted();
    // miniz reads neither the local sizes, CRC, method nor name (the data descriptor holds
    // them in PyTorch's files): damage there is harmless.
    let mut w = Written::new();
    let at = w.local("data.pkl");
    w.bytes[at + 8..at + 26].fill(0xa5);
    w.bytes[at + 30] ^= 0x20;
    w.accepted();
}

#[test]
fn central_entries_are_checked_as_miniz_opens_the_archive() {
    // "if ((disk_index == MZ_UINT16_MAX) || ((disk_index != num_this_disk) && (disk_index !=
    // 1))) return ... MZ_ZIP_UNSUPPORTED_MULTIDISK"
    for (disk, ok) in [(1, true), (2, false), (0xffff, false)] {
        let mut w = Written::new();
        let at = w.central("version");
        w.put(at + 34, disk, 2);
        if ok {
            w.accepted();
        } else {
            w.refused("unsupported multidisk archive");
        }
    }
    // "if ((local_header_ofs + MZ_ZIP_LOCAL_DIR_HEADER_SIZE + comp_size) > m_archive_size)"
    let mut w = Written::new();
    let at = w.central(".format_version");
    w.put(at + 42, w.bytes.len() as u64 - 30, 4);
    w.refused("does not fit in the file");
    // A local-header offset inside the file but at no local header.
    let mut w = Written::new();
    let at = w.central(".storage_alignment");
    w.put(at + 42, w.le(at + 42, 4) + 1, 4);
    w.refused("bad local header signature");
    // MZ_ZIP_GENERAL_PURPOSE_BIT_FLAG_LOCAL_DIR_IS_MASKED
    let mut w = Written::new();
    let at = w.central("byteorder");
    w.put(at + 8, 0x2808, 2);
    w.refused("unsupported encryption");
    // Encrypted entries are not extracted.
    let mut w = Written::new();
    let at = w.central("data/0");
    w.put(at + 8, 0x0809, 2);
    w.refused("unsupported encryption");
    // An entry miniz takes for a directory (DOS attribute 0x10) is "extracted" without
    // reading its data: PyTorch sees memory it never filled.
    for name in EXTRACTED {
        let mut w = Written::new();
        let at = w.central(name);
        w.put(at + 38, 0x10, 4);
        if name == ".format_version" {
            // `version >= b"1"` takes any bytes.
            w.accepted();
        } else {
            w.refused("marked as a directory");
        }
    }
    // Other attribute bits are not looked at.
    let mut w = Written::new();
    let at = w.central("data.pkl");
    w.put(at + 38, 0x81a4_0000 | 0x20, 4);
    w.accepted();
}

#[test]
fn every_name_is_utf8_and_inside_the_archive_folder() {
    // get_all_records: "file in archive is not in a subdirectory archive/: ..."; the names
    // become Python str (UnicodeDecodeError).
    let mut w = Written::new();
    let at = w.central(".data/serialization_id");
    w.bytes[at + 46 + 2] = b's';
    w.refused("not inside the archive folder");
    let mut w = Written::new();
    let at = w.central(".data/serialization_id");
    w.bytes[at + 46 + 9] = 0x90;
    w.refused("not UTF-8");
}

#[test]
fn the_archive_folder_is_bytes_that_need_not_be_utf8() {
    // PyTorch names the folder after the first entry's name up to its first `/`, compares the
    // other names with it as bytes, and decodes only what follows it (`getAllRecords`): a
    // folder `ar\xcf` in every entry loads, as PyTorch 2.13 loads it (mutant 4468 of the
    // seed-39 campaign: a zstd bit flip that renamed the folder of every entry).
    let mut w = Written::new();
    let mut at = w.le(w.zip64() + 48, 8) as usize;
    while w.le(at, 4) == 0x0201_4b50 {
        w.bytes[at + 46 + 2] = 0xcf;
        let nlen = w.le(at + 28, 2) as usize;
        at += 46 + nlen + w.le(at + 30, 2) as usize + w.le(at + 32, 2) as usize;
    }
    w.accepted();
    // The same byte in the first entry alone: the other entries are outside its folder,
    // which the message shows with the byte escaped.
    let mut w = Written::new();
    let at = w.le(w.zip64() + 48, 8) as usize;
    w.bytes[at + 46 + 2] = 0xcf;
    w.refused("not inside the archive folder `ar\\xcfhive/`");
}

#[test]
fn records_are_found_in_any_letter_case_as_miniz_finds_them() {
    // `archive/data.Pkl` in the central directory: miniz's locate_file ignores case, so
    // PyTorch reads the file (the local header keeps its own name; miniz never compares it).
    let mut w = Written::new();
    let at = w.central("data.pkl");
    w.bytes[at + 46 + "archive/data.".len()] = b'P';
    w.accepted();
    // Two names that differ only in case: either could be the one PyTorch finds.
    let twins = zip_of(&[("a/data.pkl", b"N."), ("a/DATA.pkl", b"N.")]);
    match torch_save::load_from_bytes(&twins) {
        Err(Error::TorchSaveArchive { reason, .. }) => {
            assert!(reason.contains("regardless of letter case"), "{reason}")
        }
        other => panic!("expected a duplicate entry, got {other:?}"),
    }
}

#[test]
fn a_compressed_entry_matters_only_when_pytorch_extracts_it() {
    // `version` beside `.data/version`: PyTorch reads the latter and never extracts the
    // former, so miniz never looks at its compression method.
    let mut bytes = zip_of(&[
        ("a/data.pkl", b"\x80\x02N."),
        ("a/byteorder", b"little"),
        ("a/.data/version", b"3\n"),
        ("a/version", b"3\n"),
    ]);
    let central = |bytes: &[u8], name: &[u8]| {
        let at = bytes.windows(name.len()).rposition(|w| w == name).unwrap();
        at - 46
    };
    let at = central(&bytes, b"a/version");
    bytes[at + 10] = 8; // deflate
    assert_eq!(torch_save::load_from_bytes(&bytes).unwrap(), PyObj::None);
    let at = central(&bytes, b"a/.data/version");
    bytes[at + 10] = 8;
    match torch_save::load_from_bytes(&bytes) {
        Err(Error::TorchSaveArchive { reason, .. }) => {
            assert!(reason.contains("compression method 8"), "{reason}")
        }
        other => panic!("expected the compressed record refused, got {other:?}"),
    }
}

#[test]
fn zip64_end_record_is_used_as_miniz_uses_it() {
    let w = Written::new();
    let (rec, loc) = (w.zip64(), w.locator());
    let damaged = |f: &dyn Fn(&mut Written)| {
        let mut w = Written::new();
        f(&mut w);
        w
    };
    // "zip64_size_of_end_of_central_dir_record < (MZ_ZIP64_END_OF_CENTRAL_DIR_HEADER_SIZE - 12)"
    damaged(&|w| w.put(rec + 4, 36, 8)).refused("(< 44)");
    // "if (zip64_total_num_of_disks != 1U) return ... MZ_ZIP_UNSUPPORTED_MULTIDISK"
    damaged(&|w| w.put(loc + 16, 2, 4)).refused("unsupported multidisk archive");
    damaged(&|w| w.put(loc + 16, 0, 4)).refused("unsupported multidisk archive");
    // "if (zip64_end_of_central_dir_ofs > (m_archive_size - MZ_ZIP64_END_OF_CENTRAL_DIR_
    // HEADER_SIZE)) return ... MZ_ZIP_NOT_AN_ARCHIVE"
    damaged(&|w| w.put(loc + 8, w.bytes.len() as u64 - 55, 8)).refused("not a ZIP archive");
    // "zip64_cdir_total_entries > MZ_UINT32_MAX ... MZ_ZIP_TOO_MANY_FILES"
    damaged(&|w| w.put(rec + 32, 1 << 40, 8)).refused("too many files");
    damaged(&|w| w.put(rec + 24, 1 << 40, 8)).refused("too many files");
    // "zip64_size_of_central_directory > MZ_UINT32_MAX ... MZ_ZIP_UNSUPPORTED_CDIR_SIZE"
    damaged(&|w| w.put(rec + 40, 1 << 34, 8)).refused("unsupported central directory size");
    // "if (m_total_files != cdir_entries_on_this_disk) ... MZ_ZIP_UNSUPPORTED_MULTIDISK"
    damaged(&|w| w.put(rec + 24, w.le(rec + 24, 8) + 1, 8)).refused("multidisk");
    // Disk numbers: both 0 or both 1.
    damaged(&|w| w.put(rec + 20, 1, 4)).refused("multidisk");
    damaged(&|w| w.put(rec + 16, 1, 4)).refused("multidisk");
    // The zip64 record's directory size and offset are the ones used.
    damaged(&|w| w.put(rec + 40, w.le(rec + 40, 8) + 0x10000, 8)).refused("extends past");
    damaged(&|w| w.put(rec + 48, w.le(rec + 48, 8) + 1, 8)).refused("central directory");
    // A locator pointing at no zip64 record, or no locator: the classic record is used.
    let mut w = damaged(&|w| w.bytes[rec] ^= 0x01);
    w.accepted();
    w.bytes[loc] ^= 0x01;
    w.accepted();
}

#[test]
fn classic_end_record_is_ignored_when_the_zip64_one_is_found() {
    // Two mutants of the campaign: PyTorch loads them, miniz reading only the zip64 record.
    let mut w = Written::new();
    let e = w.eocd();
    w.put(e + 10, 0x7dd9, 2);
    w.accepted();
    let mut w = Written::new();
    w.put(e + 15, 0x4717, 2);
    w.accepted();
    // All of it, disk numbers included.
    let mut w = Written::new();
    w.bytes[e + 4..e + 20].fill(0x5a);
    w.accepted();
    // Without the zip64 records the classic one is checked the same way.
    let file = zip_of(&[("a/data.pkl", b"\x80\x02N."), ("a/byteorder", b"little")]);
    assert!(torch_save::load_from_bytes(&file).is_ok());
    let eocd = file.len() - 22;
    for (at, v) in [(4usize, 1u16), (6, 1), (8, 5)] {
        let mut f = file.clone();
        f[eocd + at..eocd + at + 2].copy_from_slice(&v.to_le_bytes());
        let e = torch_save::load_from_bytes(&f).unwrap_err();
        assert!(e.to_string().contains("multidisk"), "{e}");
    }
}

#[test]
fn the_version_record_is_parsed_and_bounded_as_pytorch_does() {
    let load = |entries: &[(&str, &[u8])]| {
        let mut e = vec![("a/data.pkl", &b"\x80\x02N."[..])];
        e.extend_from_slice(entries);
        torch_save::load_from_bytes(&zip_of(&e))
    };
    // std::stoull: white space, a sign, digits up to the first other byte.
    for v in [&b"3\n"[..], b"1", b"10", b" \t+7xyz", b"010", b"\n\x0b5"] {
        assert!(load(&[("a/version", v)]).is_ok(), "{v:?}");
    }
    // kMinSupportedFileFormatVersion = 1, kMaxSupportedFileFormatVersion = 0xA; "-1" wraps.
    for v in [
        &b"0"[..],
        b"11",
        b"-1",
        b"-0",
        b"",
        b"x3",
        b"+-3",
        b" ",
        b"99999999999999999999",
    ] {
        match load(&[("a/version", v)]) {
            Err(Error::TorchSaveArchive { entry, .. }) => {
                assert_eq!(entry.as_deref(), Some("a/version"), "{v:?}")
            }
            other => panic!("version {v:?}: {other:?}"),
        }
    }
    // `.data/version` comes first.
    assert!(load(&[("a/.data/version", b"3"), ("a/version", b"99")]).is_ok());
    assert!(load(&[("a/.data/version", b"99"), ("a/version", b"3")]).is_err());
    // Missing: refused (zip_of adds none, seeing a name ending in "version").
    let e = load(&[("a/xversion", b"3")]).unwrap_err();
    assert!(matches!(e, Error::MissingArchiveEntry { .. }), "{e}");
}

#[test]
fn records_read_only_for_pytorch_get_its_checks() {
    // `int(zip_file.get_record(".storage_alignment"))`; the serialization id becomes a str.
    let pkl: &[u8] = b"\x80\x02N.";
    let load = |name: &str, v: &[u8]| {
        torch_save::load_from_bytes(&zip_of(&[("a/data.pkl", pkl), (name, v)]))
    };
    for v in [&b"64"[..], b" -0_1\n", b"+7", b"1_000", b"\x0b3\x0c"] {
        assert!(load("a/.storage_alignment", v).is_ok(), "{v:?}");
    }
    for v in [&b""[..], b"6 4", b"1__0", b"_1", b"1_", b"0x40", b"4P"] {
        let e = load("a/.storage_alignment", v).unwrap_err();
        assert!(e.to_string().contains("not an integer"), "{v:?}: {e}");
    }
    assert!(load("a/.data/serialization_id", b"0123").is_ok());
    let e = load("a/.data/serialization_id", b"\xb7\x01").unwrap_err();
    assert!(e.to_string().contains("not UTF-8"), "{e}");
    // Their CRC-32 is not checked, as PyTorch does not check it.
    let mut w = Written::new();
    let at = w.central(".data/serialization_id");
    w.bytes[at + 16] ^= 0xff;
    let at = w.central(".storage_alignment");
    w.bytes[at + 16] ^= 0xff;
    w.accepted();
}

#[test]
fn every_way_in_checks_the_archive() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = Written::new();
    let at = w.central("version");
    w.put(at + 38, 0x10, 4);
    let path = dir.path().join("damaged.pt");
    let mut padded = vec![0u8; 7];
    padded.extend_from_slice(&w.bytes);
    std::fs::write(&path, &padded).unwrap();
    let is_archive_error = |e: Error| {
        assert!(
            matches!(e, Error::TorchSaveArchive { .. }) || e.to_string().contains("directory"),
            "{e}"
        )
    };
    std::fs::write(&path, &w.bytes).unwrap();
    is_archive_error(torch_save::load(&path).unwrap_err());
    is_archive_error(torch_save::load_headers(&path).unwrap_err());
    std::fs::write(&path, &padded).unwrap();
    is_archive_error(torch_save::load_from_file_range(&path, 7, w.bytes.len() as u64).unwrap_err());
    // load_headers reads no tensor data but checks the storages' local headers.
    let mut w = Written::new();
    let at = w.local("data/0");
    w.bytes[at] ^= 1;
    std::fs::write(&path, &w.bytes).unwrap();
    is_archive_error(torch_save::load_headers(&path).unwrap_err());
}

#[test]
fn only_referenced_bytes_of_a_shared_buffer_are_written() {
    let big = HostTensor::from_vec1(&(0..1000).map(|i| i as f32).collect::<Vec<_>>());
    let a = big.narrow_flat(100, 10).unwrap();
    let b = big.narrow_flat(105, 10).unwrap().reshape(&[2, 5]).unwrap();
    let obj = PyObj::List(vec![PyObj::Tensor(a.clone()), PyObj::Tensor(b.clone())]);
    let bytes = torch_save::save_to_bytes(&obj).unwrap();
    assert!(bytes.len() < 2000, "{} bytes written", bytes.len());
    let PyObj::List(back) = torch_save::load_from_bytes(&bytes).unwrap() else {
        panic!()
    };
    let (PyObj::Tensor(a2), PyObj::Tensor(b2)) = (&back[0], &back[1]) else {
        panic!()
    };
    assert!(a2.bit_eq(&a) && b2.bit_eq(&b) && a2.shares_storage_with(b2));
}

#[test]
fn optim_state_dict_round_trips_and_rejects_sharded() {
    let osd = torch_save::load_optim_state_dict(fixture("adam_int_keys")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optim.pt");
    torch_save::save_optim_state_dict(&osd, &path).unwrap();
    assert_eq!(torch_save::load_optim_state_dict(&path).unwrap(), osd);
    // Overwriting an existing file works and stays atomic.
    let mut no_groups = osd.clone();
    no_groups.param_groups = None;
    torch_save::save_optim_state_dict(&no_groups, &path).unwrap();
    assert_eq!(torch_save::load_optim_state_dict(&path).unwrap(), no_groups);

    let mut sharded = osd.clone();
    sharded.state[0].insert(
        "x".into(),
        Value::Sharded(fsdp::optim_state::ShardedTensor {
            global_shape: vec![2],
            offsets: vec![0],
            local: None,
        }),
    );
    assert!(matches!(
        torch_save::save_optim_state_dict(&sharded, &path),
        Err(Error::Unsupported(_))
    ));
    assert_eq!(torch_save::load_optim_state_dict(&path).unwrap(), no_groups);

    let e = torch_save::load_optim_state_dict(fixture("model_state")).unwrap_err();
    assert!(matches!(e, Error::UnexpectedObject { .. }), "{e}");
    let e = torch_save::load_model_state_dict(fixture("named_state")).unwrap_err();
    assert!(matches!(e, Error::UnexpectedObject { .. }), "{e}");
}

#[test]
fn model_state_dict_round_trips() {
    let msd = torch_save::load_model_state_dict(fixture("model_state")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.pt");
    torch_save::save_model_state_dict(&msd, &path).unwrap();
    assert_eq!(torch_save::load_model_state_dict(&path).unwrap(), msd);
}

// ----- property tests -----

fn arb_tensor() -> impl Strategy<Value = HostTensor> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(0usize..4, 0..4),
        any::<u64>(),
    )
        .prop_map(|(dtype, shape, seed)| {
            let n: usize = shape.iter().product::<usize>() * dtype.size();
            let mut x = seed;
            let bytes: Vec<u8> = (0..n)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let b = (x >> 56) as u8;
                    if dtype == DType::Bool {
                        b & 1
                    } else {
                        b
                    }
                })
                .collect();
            HostTensor::from_bytes(dtype, &shape, &bytes).unwrap()
        })
}

fn arb_pyobj() -> impl Strategy<Value = PyObj> {
    let leaf = prop_oneof![
        Just(PyObj::None),
        any::<bool>().prop_map(PyObj::Bool),
        any::<i64>().prop_map(PyObj::Int),
        any::<i128>().prop_map(PyObj::int),
        any::<u64>().prop_map(|b| PyObj::Float(f64::from_bits(b))),
        ".{0,8}".prop_map(PyObj::Str),
        prop::collection::vec(any::<u8>(), 0..8).prop_map(PyObj::Bytes),
        arb_tensor().prop_map(PyObj::Tensor),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        let key = prop_oneof![
            ".{0,6}".prop_map(PyObj::Str),
            any::<i64>().prop_map(PyObj::Int)
        ];
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(PyObj::Tuple),
            prop::collection::vec(inner.clone(), 0..6).prop_map(PyObj::List),
            prop::collection::btree_map(".{0,6}", inner.clone(), 0..6).prop_map(|m| PyObj::Dict(
                m.into_iter().map(|(k, v)| (PyObj::Str(k), v)).collect()
            )),
            (
                prop::collection::vec((key, inner.clone()), 0..6),
                prop::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
            )
                .prop_map(|(items, attrs)| {
                    // Python dicts have unique keys: keep the first of equal ones.
                    let mut seen = Vec::new();
                    let items = items
                        .into_iter()
                        .filter(|(k, _)| {
                            let fresh = !seen.contains(k);
                            seen.push(k.clone());
                            fresh
                        })
                        .collect();
                    PyObj::OrderedDict {
                        items,
                        attrs: attrs.into_iter().collect(),
                    }
                }),
        ]
    })
}

fn arb_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::None),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        any::<f64>()
            .prop_filter("NaN != NaN", |x| !x.is_nan())
            .prop_map(Value::Float),
        "[a-z]{0,5}".prop_map(Value::Str),
        arb_tensor().prop_map(Value::Tensor),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Tuple),
            prop::collection::vec(inner, 0..4).prop_map(Value::List),
        ]
    })
}

fn arb_optim() -> impl Strategy<Value = OptimStateDict> {
    let key = prop_oneof![
        (0usize..1000).prop_map(ParamKey::Id),
        "[a-z.]{1,8}".prop_map(ParamKey::Name)
    ];
    let state = prop::collection::vec(("[a-z_]{1,6}", arb_value()), 0..4)
        .prop_map(|v| v.into_iter().collect::<ParamState>());
    let group = (
        prop::collection::vec(("[a-z_]{1,6}", arb_value()), 0..4),
        prop::collection::vec(0usize..1000, 0..4),
    )
        .prop_map(|(opts, ids)| ParamGroup {
            options: opts.into_iter().filter(|(k, _)| k != "params").collect(),
            params: ids.into_iter().map(ParamKey::Id).collect(),
        });
    (
        prop::collection::vec((key, state), 0..5),
        prop::option::of(prop::collection::vec(group, 0..3)),
    )
        .prop_map(|(state, param_groups)| OptimStateDict {
            state: state.into_iter().collect::<IndexMap<_, _>>(),
            param_groups,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_objects_round_trip(obj in arb_pyobj()) {
        let bytes = torch_save::save_to_bytes(&obj).unwrap();
        let back = torch_save::load_from_bytes(&bytes).unwrap();
        prop_assert!(back.bit_eq(&obj), "{:?} != {:?}", back, obj);
    }

    #[test]
    fn random_optim_state_dicts_round_trip(osd in arb_optim()) {
        let obj = torch_save::optim_to_pyobj(&osd).unwrap();
        let bytes = torch_save::save_to_bytes(&obj).unwrap();
        let back = torch_save::optim_from_pyobj(torch_save::load_from_bytes(&bytes).unwrap()).unwrap();
        prop_assert_eq!(back, osd);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = torch_save::load_from_bytes(&bytes);
        let _ = torch_save::load_from_bytes(&with_pickle(&bytes));
    }
}

// ----- PyTorch loads what Rust writes -----

fn write_case(dir: &Path, name: &str, obj: &PyObj, shared: Json) {
    torch_save::save(obj, dir.join(format!("{name}.pt"))).unwrap();
    let expected = json!({ "object": to_json(obj), "shared": shared });
    std::fs::write(dir.join(format!("{name}.json")), expected.to_string()).unwrap();
}

#[test]
fn pytorch_loads_rust_written_files() {
    let python = crate::common::python();
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let obj = torch_save::load(fixture(name)).unwrap();
        let shared = expectation(name)["shared"].clone();
        write_case(dir.path(), &format!("rust_{name}"), &obj, shared);
    }
    // A Rust-built optimizer state dict through the typed API.
    let mut osd = OptimStateDict::default();
    let buf = HostTensor::from_vec1(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let mut st = ParamState::new();
    st.insert("step".into(), Value::Tensor(HostTensor::scalar(3.0f32)));
    st.insert(
        "exp_avg".into(),
        Value::Tensor(buf.narrow_flat(0, 4).unwrap().reshape(&[2, 2]).unwrap()),
    );
    st.insert(
        "exp_avg_sq".into(),
        Value::Tensor(buf.narrow_flat(4, 2).unwrap()),
    );
    osd.state.insert(ParamKey::Id(0), st);
    let mut options = IndexMap::new();
    options.insert("lr".into(), Value::Float(0.1));
    options.insert(
        "betas".into(),
        Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]),
    );
    options.insert("foreach".into(), Value::None);
    osd.param_groups = Some(vec![ParamGroup {
        options,
        params: vec![ParamKey::Id(0)],
    }]);
    write_case(
        dir.path(),
        "rust_optim",
        &torch_save::optim_to_pyobj(&osd).unwrap(),
        json!([[["state", 0, "exp_avg"], ["state", 0, "exp_avg_sq"]]]),
    );
    let mut msd = SavedModelStateDict::default();
    msd.tensors.insert(
        "w".into(),
        HostTensor::from_vec1(&[half::bf16::from_f32(1.5)]),
    );
    write_case(
        dir.path(),
        "rust_model",
        &torch_save::model_to_pyobj(&msd),
        json!([]),
    );

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/check_torch_load.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(dir.path())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "PyTorch rejected a Rust-written file ({}):\n{}\n{}",
        python.display(),
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        FIXTURES.len() + 2
    );
}

#[test]
fn inspecting_the_structure_alone_gives_the_summary_of_the_loaded_object() {
    use fsdp::io::inspect::Summary;
    for name in FIXTURES {
        let full = Summary::of(&torch_save::load(fixture(name)).unwrap());
        let headers = Summary::of_headers(&torch_save::load_headers(fixture(name)).unwrap());
        assert_eq!(headers, full, "{name}");
    }
}

#[test]
fn int8_and_the_unsigned_and_float8_dtypes_are_read_and_round_trip() {
    // Generated by PyTorch (torch_save_fixtures.py, `more_dtypes`); the JSON comparison and
    // the PyTorch re-load of the written files are in the fixture-wide tests above.
    let o = torch_save::load(fixture("more_dtypes")).unwrap();
    let PyObj::Dict(state) = get(&o, "state") else {
        panic!("state is not a dict")
    };
    let st0 = &state[0].1;
    let q = tensor(st0, "state1");
    assert_eq!((q.dtype(), q.shape()), (DType::I8, &[2usize, 3][..]));
    assert_eq!(q.to_f64_vec(), vec![-128.0, -1.0, 0.0, 1.0, 64.0, 127.0]);
    // The transposed int8 view is copied in PyTorch's element order.
    let qt = tensor(st0, "state1_t");
    assert_eq!(qt.to_f64_vec(), vec![-128.0, 1.0, -1.0, 64.0, 0.0, 127.0]);
    assert_eq!(tensor(st0, "scalar_i8").item(), Some(-5.0));
    // uint16 / uint64 views of untyped storages (_rebuild_tensor_v3) at offsets and strides.
    assert_eq!(
        tensor(&o, "u16_col").to_f64_vec(),
        vec![5000.0, 25000.0, 45000.0]
    );
    assert_eq!(tensor(&o, "u64_tail").as_bytes(), {
        let mut b = 3u64.to_le_bytes().to_vec();
        b.extend(4u64.to_le_bytes());
        b
    });
    let u64s = tensor(&o, "u64");
    assert_eq!(&u64s.as_bytes()[8..16], &(u64::MAX / 2 + 6).to_le_bytes());
    let e4 = tensor(&o, "f8e4m3fn").to_f64_vec();
    assert_eq!(&e4[..4], &[0.0, -1.5, 448.0, 0.001953125]);
    assert!(e4[4].is_nan());
    assert_eq!(
        tensor(&o, "f8e5m2").to_f64_vec(),
        vec![0.0, -1.5, 57344.0, f64::INFINITY, 1.52587890625e-05]
    );
    // Written back (torch.save and safetensors) and read again: the same object, bit for bit.
    let back = torch_save::load_from_bytes(&torch_save::save_to_bytes(&o).unwrap()).unwrap();
    assert_bit_eq(&back, &o, "more_dtypes via torch.save");
    let st = fsdp::io::safetensors::save_to_bytes(&o).unwrap();
    let back = fsdp::io::safetensors::load_from_bytes(&st).unwrap();
    assert_bit_eq(&back, &o, "more_dtypes via safetensors");
}
