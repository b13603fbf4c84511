//! The rank data files: standard safetensors files (an 8-byte little-endian header length, a
//! JSON header naming each tensor's dtype, shape and byte range, then the bytes), so that
//! Python's `safetensors` reads every piece directly.

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

/// The header bytes (length prefix included, padded to 8 bytes) for `entries` laid out back
/// to back in order, and each entry's absolute byte offset in the file.
pub(crate) fn header(
    entries: &[Entry],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<u64>)> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).map_err(|e| Error::Serialization {
                what: "safetensors metadata".into(),
                reason: e.to_string(),
            })?,
        );
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
        map.insert(
            e.name.clone(),
            serde_json::json!({
                "dtype": dtype,
                "shape": e.shape,
                "data_offsets": [at, at + e.nbytes],
            }),
        );
        relative.push(at);
        at += e.nbytes;
    }
    let mut json =
        serde_json::to_vec(&serde_json::Value::Object(map)).map_err(|e| Error::Serialization {
            what: "safetensors header".into(),
            reason: e.to_string(),
        })?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    let base = out.len() as u64;
    Ok((out, relative.into_iter().map(|r| base + r).collect()))
}
