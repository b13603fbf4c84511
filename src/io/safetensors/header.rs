//! The one safetensors header writer: an 8-byte little-endian header length, then a JSON
//! header naming each tensor's dtype, shape and byte range, padded to 8 bytes. Every
//! safetensors file the crate writes (single files, Hugging Face shards, DCP's Hugging Face
//! storage, the crate's rank data files) gets its header here, so that Python's
//! `safetensors` reads every piece directly.

use crate::error::{Error, Result};
use crate::tensor::DType;
use std::collections::BTreeMap;

/// One tensor of a data file, in file order.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub nbytes: u64,
}

/// The name a safetensors header reserves for its metadata, which no tensor may take.
pub(crate) const RESERVED_NAME: &str = "__metadata__";

/// The header bytes (length prefix included, padded to 8 bytes) for `entries` laid out back
/// to back in order, and each entry's absolute byte offset in the file. Every safetensors
/// writer of the crate passes through here: a tensor named [`RESERVED_NAME`] is refused
/// ([`Error::ReservedTensorName`], `origin` saying where it came from).
pub(crate) fn encode(
    entries: &[Entry],
    metadata: &BTreeMap<String, String>,
    origin: &dyn Fn(&Entry) -> String,
) -> Result<(Vec<u8>, Vec<u64>)> {
    if let Some(e) = entries.iter().find(|e| e.name == RESERVED_NAME) {
        return Err(Error::ReservedTensorName {
            tensor: e.name.clone(),
            origin: origin(e),
        });
    }
    // Written as the `safetensors` library writes it: `__metadata__` first, then each tensor
    // in data order with its keys `dtype`, `shape`, `data_offsets`, compact.
    let ser = |what: &str, v: &dyn erased_json::Json| {
        v.to_json().map_err(|e| Error::Serialization {
            what: what.into(),
            reason: e.to_string(),
        })
    };
    let mut json = String::from("{");
    if !metadata.is_empty() {
        json.push_str("\"__metadata__\":");
        json.push_str(&ser("safetensors metadata", metadata)?);
    }
    let mut at = 0u64;
    let mut relative = Vec::with_capacity(entries.len());
    for e in entries {
        let Some(dtype) = e.dtype.safetensors_name() else {
            return Err(Error::TensorNotStorable {
                tensor: e.name.clone(),
                shape: e.shape.clone(),
                reason: format!("safetensors has no dtype for {}", e.dtype),
            });
        };
        if json.len() > 1 {
            json.push(',');
        }
        json.push_str(&ser("a safetensors tensor name", &e.name)?);
        json.push_str(&format!(
            ":{{\"dtype\":\"{dtype}\",\"shape\":{},\"data_offsets\":[{at},{}]}}",
            ser("a safetensors shape", &e.shape)?,
            at + e.nbytes
        ));
        relative.push(at);
        at += e.nbytes;
    }
    json.push('}');
    let mut json = json.into_bytes();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    let base = out.len() as u64;
    Ok((out, relative.into_iter().map(|r| base + r).collect()))
}

/// Values serialized to compact JSON (a tensor name, a shape, the metadata map).
mod erased_json {
    pub(super) trait Json {
        fn to_json(&self) -> serde_json::Result<String>;
    }
    impl<T: serde::Serialize> Json for T {
        fn to_json(&self) -> serde_json::Result<String> {
            serde_json::to_string(self)
        }
    }
}
