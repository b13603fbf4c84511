//! The legacy `torch.save` format (`_use_new_zipfile_serialization=False`, the only format
//! before PyTorch 1.6), read as `torch.load(weights_only=True)` still reads it
//! (`_legacy_load` in `torch/serialization.py`).
//!
//! The file is five pickles back to back, then the storages' bytes:
//! `MAGIC_NUMBER`, `PROTOCOL_VERSION` (1001), a `sys_info` dict (byte order, type sizes), the
//! object (whose persistent ids are `('storage', torch.<T>Storage, key, location, numel,
//! view_metadata)`), the sorted list of storage keys; then per key, in that order, an 8-byte
//! little-endian element count and the storage's bytes. The pickles are read from a window
//! at the front of the file that grows until they fit; the storages are read where they lie,
//! so memory does not depend on the tensors' sizes. The writer writes only the zip format.

use super::unpickle::{self, Storages, Unpickled};
use super::zip::Source;
use super::PyObj;
use crate::error::{Error, Result};
use crate::io::pickle::truncated;
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;

/// `torch.serialization.MAGIC_NUMBER`.
const MAGIC_NUMBER: i128 = 0x1950_A86A_20F9_469C_FC6C;
/// `torch.serialization.PROTOCOL_VERSION`.
const PROTOCOL_VERSION: i64 = 1001;
/// The first window of the file searched for the pickles; it grows eightfold until they fit.
const FIRST_WINDOW: u64 = 1 << 20;

/// Whether the bytes a file starts with are those of a legacy file: a pickle stream of
/// protocol 2 or later (`PROTO`), where a zip archive starts with `PK`.
pub(super) fn is_legacy(head: &[u8]) -> bool {
    head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1])
}

/// Reads the legacy file `src` (`file` names it in errors).
pub(super) fn read<S: Source>(
    file: &str,
    mut src: S,
    mode: unpickle::Mode,
    allow: unpickle::Allow,
) -> Result<Unpickled> {
    let len = src.len();
    let mut window = len.min(FIRST_WINDOW);
    loop {
        let mut head = vec![0u8; window as usize];
        src.read_at(0, &mut head)
            .map_err(Error::io("reading", std::path::Path::new(file)))?;
        let mut store = LegacyStorages {
            file,
            src: &mut src,
            head: &head,
            declared: Vec::new(),
            at: HashMap::new(),
            object_start: 0,
        };
        let attempt = store.preamble().and_then(|start| {
            store.object_start = start;
            unpickle::unpickle(file, &head[start..], &mut store, mode, allow)
        });
        match attempt {
            Err(e) if truncated(&e) && window < len => window = len.min(window * 8),
            other => return other,
        }
    }
}

/// The storages of a legacy file: declared while the object's pickle runs, located once it
/// has ended (the key list that follows it gives their order).
struct LegacyStorages<'f, 's, S: Source> {
    file: &'f str,
    src: &'s mut S,
    /// The front of the file, holding the pickles.
    head: &'f [u8],
    /// Storages as the object declares them: key, element dtype, elements.
    declared: Vec<(String, DType, usize)>,
    /// Where each storage's bytes start in the file, and their length.
    at: HashMap<String, (u64, u64)>,
    /// Where the object's pickle starts in the file.
    object_start: usize,
}

impl<S: Source> LegacyStorages<'_, '_, S> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Pickle {
            file: self.file.to_string(),
            offset: 0,
            opcode: "-".into(),
            reason: format!("legacy torch.save file: {}", reason.into()),
        }
    }

    fn storage_err(&self, key: &str, reason: String) -> Error {
        Error::TensorStorage {
            file: self.file.to_string(),
            storage: key.to_string(),
            reason,
        }
    }

    /// Checks the magic number, protocol version and byte order (the first three pickles);
    /// returns where the object's pickle starts.
    fn preamble(&self) -> Result<usize> {
        let (magic, n1) = unpickle::plain(self.file, self.head)?;
        if magic.as_i128() != Some(MAGIC_NUMBER) {
            // torch.load: "Invalid magic number; corrupt file?"
            return Err(self.err(format!("invalid magic number {}", magic.describe())));
        }
        let (version, n2) = unpickle::plain(self.file, &self.head[n1..])?;
        if version != PyObj::Int(PROTOCOL_VERSION) {
            return Err(self.err(format!("invalid protocol version {}", version.describe())));
        }
        let (sys_info, n3) = unpickle::plain(self.file, &self.head[n1 + n2..])?;
        if sys_info.get("little_endian") == Some(&PyObj::Bool(false)) {
            return Err(Error::UnsupportedByteOrder {
                file: self.file.to_string(),
                byteorder: "big".into(),
            });
        }
        Ok(n1 + n2 + n3)
    }
}

impl<S: Source> Storages for LegacyStorages<'_, '_, S> {
    fn legacy(&self) -> bool {
        true
    }

    fn check(&mut self, key: &str, dtype: DType, numel: usize) -> Result<()> {
        self.declared.push((key.to_string(), dtype, numel));
        Ok(())
    }

    /// Reads the key list after the object and walks the storages it orders: each an 8-byte
    /// element count (checked against the declaration, as `_set_from_file` checks it) and
    /// its bytes, inside the file.
    fn stream_ended(&mut self, consumed: usize) -> Result<()> {
        let keys_at = self.object_start + consumed;
        let (keys, n) = unpickle::plain(self.file, &self.head[keys_at..])?;
        let PyObj::List(keys) = keys else {
            return Err(self.err(format!("the storage key list is a {}", keys.type_name())));
        };
        let declared: HashMap<&str, (DType, usize)> = self
            .declared
            .iter()
            .map(|(k, d, n)| (k.as_str(), (*d, *n)))
            .collect();
        let len = self.src.len();
        let mut at = (keys_at + n) as u64;
        let mut located = HashMap::new();
        for key in &keys {
            let PyObj::Str(key) = key else {
                return Err(self.err(format!("a storage key is a {}", key.type_name())));
            };
            let Some(&(dtype, numel)) = declared.get(key.as_str()) else {
                return Err(self.storage_err(key, "listed but never used by the object".into()));
            };
            let mut count = [0u8; 8];
            if at + 8 > len {
                return Err(self.storage_err(
                    key,
                    format!("its header at byte {at} lies past the end of the {len}-byte file"),
                ));
            }
            self.src
                .read_at(at, &mut count)
                .map_err(Error::io("reading", std::path::Path::new(self.file)))?;
            let stored = u64::from_le_bytes(count);
            if stored != numel as u64 {
                return Err(self.storage_err(
                    key,
                    format!("declared with {numel} elements of {dtype} but stored with {stored}"),
                ));
            }
            let nbytes = (numel as u64)
                .checked_mul(dtype.size() as u64)
                .filter(|b| at + 8 + b <= len)
                .ok_or_else(|| {
                    self.storage_err(key, format!("its {numel} elements of {dtype} run past the end of the {len}-byte file"))
                })?;
            located.insert(key.clone(), (at + 8, nbytes));
            at += 8 + nbytes;
        }
        if let Some((key, ..)) = self
            .declared
            .iter()
            .find(|(k, ..)| !located.contains_key(k))
        {
            return Err(self.storage_err(key, "used by the object but not stored".into()));
        }
        self.at = located;
        Ok(())
    }

    fn read(&mut self, key: &str, dtype: DType, numel: usize) -> Result<HostTensor> {
        let Some(&(start, nbytes)) = self.at.get(key) else {
            return Err(self.storage_err(key, "not stored".into()));
        };
        if numel.checked_mul(dtype.size()) != Some(nbytes as usize) {
            return Err(self.storage_err(
                key,
                format!("{nbytes} bytes read as {numel} elements of {dtype}"),
            ));
        }
        let file = self.file;
        HostTensor::filled_by(dtype, &[numel], |buf| {
            self.src
                .read_at(start, buf)
                .map_err(Error::io("reading", std::path::Path::new(file)))
        })
    }
}
