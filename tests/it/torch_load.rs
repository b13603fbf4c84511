//! What `torch.load(weights_only=True)` reads, the crate reads the same way.
//!
//! `tests/golden/torch_load/` holds one small file per kind of value (written by
//! `tests/golden/torch_load_fixtures.py` with PyTorch 2.13): FSDP1's full state dict, whose
//! tensors carry `_has_been_cloned`, Parameters with and without state, complex, sparse,
//! quantized and meta tensors, the builtin values of the allow-list, the legacy format, and
//! files PyTorch refuses. At test time `tests/golden/torch_load/check.py` asks the installed
//! PyTorch what it reads from each; the crate must read the same or refuse the same.
//! `expected.json` names the kinds the crate refuses by design although `weights_only` reads
//! them.

use crate::torch_save::{dtype_name, hex};
use fsdp::collectives::Solo;
use fsdp::io::torch_save::{self, PyObj, QScheme, RichTensor, TensorValue};
use fsdp::{Error, HostTensor};
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/torch_load")
}

fn fixture(name: &str) -> PathBuf {
    dir().join(format!("{name}.pt"))
}

/// Runs `check.py` with `args`; its standard output, or a panic with its errors.
fn check_py(args: &[&std::ffi::OsStr]) -> String {
    crate::common::python_script(&dir().join("check.py"), args)
}

fn files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pt"))
        .collect();
    files.sort();
    assert!(files.len() >= 20, "the fixtures are missing: {files:?}");
    files
}

// ----- the JSON form of check.py's `describe` -----

fn bits(x: f64) -> String {
    x.to_bits().to_string()
}

fn dense(t: &HostTensor) -> Json {
    json!({ "dtype": dtype_name(t.dtype()), "shape": t.shape(), "hex": hex(t.as_bytes()) })
}

fn tensor_value(v: &TensorValue) -> Json {
    match v {
        TensorValue::Dense(t) => json!({ "tensor": dense(t) }),
        TensorValue::SparseCoo {
            indices,
            values,
            size,
            coalesced,
        } => json!({ "sparse_coo": {
            "indices": dense(indices),
            "values": dense(values),
            "size": size,
            "coalesced": coalesced,
        }}),
        TensorValue::SparseCompressed {
            layout,
            compressed_indices,
            plain_indices,
            values,
            size,
        } => json!({ "sparse_compressed": {
            "layout": layout.torch_name(),
            "compressed": dense(compressed_indices),
            "plain": dense(plain_indices),
            "values": dense(values),
            "size": size,
        }}),
        TensorValue::Quantized(q) => json!({ "quantized": {
            "dtype": q.dtype.torch_name(),
            "int_repr": dense(&q.int_repr),
            "scheme": match &q.scheme {
                QScheme::PerTensorAffine { scale, zero_point } => {
                    json!({ "per_tensor": [bits(*scale), zero_point] })
                }
                QScheme::PerChannel { float_qparams, scales, zero_points, axis } => {
                    json!({ "per_channel": {
                        "float_qparams": float_qparams,
                        "scales": dense(scales),
                        "zero_points": dense(zero_points),
                        "axis": axis,
                    }})
                }
            },
        }}),
        TensorValue::Meta {
            dtype,
            size,
            stride,
        } => json!({ "meta": { "dtype": dtype_name(*dtype), "shape": size, "stride": stride } }),
    }
}

fn rich(r: &RichTensor) -> Json {
    json!({ "rich": {
        "value": tensor_value(&r.value),
        "requires_grad": r.requires_grad,
        "parameter": r.parameter,
        "attrs": r.attrs.iter().map(|(k, v)| json!([k, describe(v)])).collect::<Vec<_>>(),
    }})
}

/// The crate's object in `check.py`'s JSON form.
fn describe(o: &PyObj) -> Json {
    let pairs = |items: &[(PyObj, PyObj)]| -> Json {
        items
            .iter()
            .map(|(k, v)| json!([describe(k), describe(v)]))
            .collect()
    };
    let seq = |v: &[PyObj]| v.iter().map(describe).collect::<Vec<_>>();
    match o {
        PyObj::None => json!({ "none": null }),
        PyObj::Bool(b) => json!({ "bool": b }),
        PyObj::Int(_) | PyObj::BigInt(_) => json!({ "int": o.as_i128().unwrap().to_string() }),
        PyObj::Float(x) => json!({ "float": bits(*x) }),
        PyObj::Complex(re, im) => json!({ "complex": [bits(*re), bits(*im)] }),
        PyObj::Str(s) => json!({ "str": s }),
        PyObj::Bytes(b) => json!({ "bytes": hex(b) }),
        PyObj::ByteArray(b) => json!({ "bytearray": hex(b) }),
        PyObj::TorchConst(name) => json!({ "torch": name }),
        PyObj::Device(kind, index) => json!({ "device": [kind, index] }),
        PyObj::Tensor(t) => json!({ "tensor": dense(t) }),
        PyObj::RichTensor(r) => rich(r),
        PyObj::Size(v) => json!({ "size": v }),
        PyObj::Tuple(v) => json!({ "tuple": seq(v) }),
        PyObj::List(v) => json!({ "list": seq(v) }),
        PyObj::Set(v) => json!({ "set": seq(v) }),
        PyObj::Counter(items) => json!({ "counter": pairs(items) }),
        PyObj::OrderedDict { items, attrs } => json!({
            "odict": pairs(items),
            "attrs": attrs.iter().map(|(k, v)| json!([k, describe(v)])).collect::<Vec<_>>(),
        }),
        PyObj::Dict(items) => json!({ "dict": pairs(items) }),
        other => panic!("no description for a {}", other.type_name()),
    }
}

/// The kinds the crate refuses by design although `weights_only` reads them: file name →
/// the global its refusal must name.
fn deliberate_refusals() -> serde_json::Map<String, Json> {
    let text = std::fs::read_to_string(dir().join("expected.json")).unwrap();
    let j: Json = serde_json::from_str(&text).unwrap();
    j["crate_refuses"].as_object().unwrap().clone()
}

#[test]
fn pytorch_and_the_crate_read_or_refuse_every_file_alike() {
    let files = files();
    let args: Vec<&std::ffi::OsStr> = std::iter::once("verdicts".as_ref())
        .chain(files.iter().map(|f| f.as_os_str()))
        .collect();
    let verdicts = check_py(&args);
    let refusals = deliberate_refusals();
    let mut seen = 0;
    for line in verdicts.lines() {
        let v: Json = serde_json::from_str(line).unwrap();
        let file = PathBuf::from(v["file"].as_str().unwrap());
        let name = file.file_name().unwrap().to_str().unwrap().to_string();
        let torch_reads = v["reads"].as_bool().unwrap();
        let ours = torch_save::load(&file);
        seen += 1;
        if let Some(global) = refusals.get(&name) {
            assert!(
                torch_reads,
                "{name}: listed as read by PyTorch, which refuses it"
            );
            let e = ours.expect_err(&name);
            let global = global.as_str().unwrap();
            assert!(
                matches!(e, Error::Unsupported(_)) && e.to_string().contains(global),
                "{name}: {e}"
            );
            continue;
        }
        match (torch_reads, ours) {
            (true, Ok(obj)) => assert_eq!(
                describe(&obj),
                v["object"],
                "{name}: the crate reads another object than torch.load"
            ),
            (false, Err(_)) => {}
            (true, Err(e)) => panic!("{name}: torch.load reads it, the crate refuses: {e}"),
            (false, Ok(_)) => panic!(
                "{name}: torch.load refuses it ({}), the crate reads it",
                v["error"]
            ),
        }
    }
    assert_eq!(seen, files.len(), "check.py answered for every file");
}

#[test]
fn every_file_both_read_round_trips_through_the_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let refusals = deliberate_refusals();
    let mut pairs: Vec<std::ffi::OsString> = vec!["same".into()];
    for file in files() {
        let name = file.file_name().unwrap().to_str().unwrap().to_string();
        if refusals.contains_key(&name) {
            continue;
        }
        let Ok(obj) = torch_save::load(&file) else {
            continue; // refused by both (the agreement test checks which)
        };
        let out = tmp.path().join(&name);
        torch_save::save(&obj, &out).unwrap();
        // The crate reads its own output back as the same object.
        assert!(torch_save::load(&out).unwrap().bit_eq(&obj), "{name}");
        pairs.push(file.into());
        pairs.push(out.into());
    }
    assert!(pairs.len() > 30, "too few files read: {}", pairs.len() / 2);
    let args: Vec<&std::ffi::OsStr> = pairs.iter().map(|p| p.as_os_str()).collect();
    check_py(&args);
}

/// The tensors of `obj`'s top level dict, as values.
fn values(obj: &PyObj) -> Vec<(String, HostTensor)> {
    obj.dict_items()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let PyObj::Str(k) = k else { panic!() };
            (k.clone(), v.dense_tensor().expect(k).clone())
        })
        .collect()
}

#[test]
fn an_fsdp1_full_state_dict_converts_to_dcp_and_safetensors_by_its_values() {
    let src = fixture("fsdp1_full_state_dict");
    let obj = torch_save::load(&src).unwrap();
    let expected = values(&obj);
    assert!(
        obj.dict_items().unwrap().iter().all(|(_, v)| matches!(
            v, PyObj::RichTensor(r) if r.attrs.iter().any(|(k, _)| k == "_has_been_cloned")
        )),
        "FSDP1 marks every tensor of its full state dict"
    );
    let tmp = tempfile::tempdir().unwrap();

    let dcp = tmp.path().join("dcp");
    fsdp::commands::conversions::torch_save_to_dcp(&src, &dcp, &Solo).unwrap();
    let back = tmp.path().join("back.pt");
    fsdp::commands::conversions::dcp_to_torch_save(&dcp, &back, &Solo, |_| {}).unwrap();
    assert_eq!(values(&torch_save::load(&back).unwrap()), expected);

    let st = tmp.path().join("model.safetensors");
    fsdp::io::safetensors::save(&obj, &st).unwrap();
    assert_eq!(values(&fsdp::io::safetensors::load(&st).unwrap()), expected);
}

#[test]
fn formats_without_a_place_for_a_kind_refuse_it_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |name: &str, e: Error, what: &str| {
        let msg = e.to_string();
        assert!(
            matches!(e, Error::TensorNotStorable { .. }) && msg.contains(what),
            "{name}: {msg}"
        );
    };
    for (file, what) in [
        ("sparse_coo", "`s`"),
        ("sparse_csr", "sparse tensor (torch.sparse_csr)"),
        ("quantized_per_tensor", "quantized tensor (torch.qint8)"),
        ("meta", "meta tensor"),
    ] {
        let obj = torch_save::load(fixture(file)).unwrap();
        let e = fsdp::io::safetensors::save(&obj, tmp.path().join("x.safetensors")).unwrap_err();
        refused(file, e, what);
        assert!(e_contains(
            fsdp::io::safetensors::save_to_bytes(&obj).unwrap_err(),
            "safetensors stores only dense tensors"
        ));
        let e = fsdp::commands::conversions::torch_save_to_dcp(
            &fixture(file),
            &tmp.path().join(file),
            &Solo,
        )
        .unwrap_err();
        refused(file, e, what);
        assert!(!tmp.path().join(file).exists(), "{file}: no partial output");
    }
    // safetensors has complex64 but no complex128; DCP holds both.
    let c128 = torch_save::load(fixture("complex128")).unwrap();
    let e = fsdp::io::safetensors::save_to_bytes(&c128).unwrap_err();
    refused(
        "complex128",
        e,
        "safetensors has no dtype for torch.complex128",
    );
    let c64 = torch_save::load(fixture("complex64")).unwrap();
    let bytes = fsdp::io::safetensors::save_to_bytes(&c64).unwrap();
    assert!(fsdp::io::safetensors::load_from_bytes(&bytes)
        .unwrap()
        .bit_eq(&c64));
    for file in ["complex64", "complex128"] {
        let dcp = tmp.path().join(format!("{file}.dcp"));
        fsdp::commands::conversions::torch_save_to_dcp(&fixture(file), &dcp, &Solo).unwrap();
        let back = tmp.path().join(format!("{file}.back.pt"));
        fsdp::commands::conversions::dcp_to_torch_save(&dcp, &back, &Solo, |_| {}).unwrap();
        let (orig, back) = (
            torch_save::load(fixture(file)).unwrap(),
            torch_save::load(&back).unwrap(),
        );
        assert_eq!(orig.get("c"), back.get("c"), "{file}");
    }
}

fn e_contains(e: Error, what: &str) -> bool {
    e.to_string().contains(what)
}

#[test]
fn damaged_legacy_files_are_errors_never_panics() {
    let bytes = std::fs::read(fixture("legacy_format")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("damaged.pt");
    for cut in (0..bytes.len()).step_by(7) {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        assert!(torch_save::load(&path).is_err(), "cut at {cut}");
    }
    let mut flipped = 0;
    for at in (0..bytes.len()).step_by(3) {
        let mut b = bytes.clone();
        b[at] ^= 0x5a;
        std::fs::write(&path, &b).unwrap();
        flipped += usize::from(torch_save::load(&path).is_err());
    }
    assert!(flipped > 0);
    // A storage whose stored element count disagrees with its declaration is named.
    let obj = torch_save::load(fixture("legacy_format")).unwrap();
    assert_eq!(obj.get("step"), Some(&PyObj::Int(7)));
    let at = bytes.len() - 24 - 8; // the header of the last storage (24 bytes)
    let mut b = bytes.clone();
    b[at] = 9;
    std::fs::write(&path, &b).unwrap();
    let e = torch_save::load(&path).unwrap_err();
    assert!(
        matches!(e, Error::TensorStorage { .. }) && e.to_string().contains("stored with 9"),
        "{e}"
    );
}
