//! Byte ranges of the storages of one `torch.save` archive, read forward in small pieces
//! with every storage's CRC-32 still checked: what a reader needs that takes a few elements
//! here and there from large flat tensors (a DeepSpeed ZeRO partition holds pieces of many
//! parameters) and never holds a storage whole.
//!
//! Each storage has a cursor: a read hands bytes `from..to` to a sink after reading (and
//! checksumming) everything between the cursor and `from`. The CRC-32 is checked when a read
//! reaches the storage's end ([`StorageReader::read_to_end`] goes there on purpose). A read
//! behind the cursor first completes the current pass (reads to the end, checks the CRC-32),
//! then starts a new pass from the storage's start; [`StorageReader::finish`] completes every
//! pass, so every byte handed out belongs to a pass whose CRC-32 was checked once `finish`
//! returns.

use super::cursor::EntryCursor;
use super::zip::{FileSource, ZipReader};
use super::{open, open_archive, starts_legacy, storage_entry};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// Bytes read at a time (shared by every cursor, so memory does not grow with the number of
/// storages read).
const PIECE: usize = 1 << 20;

/// The storages of the zip-format `torch.save` file at a path, read by byte ranges.
pub(crate) struct StorageReader {
    zip: ZipReader<FileSource>,
    prefix: String,
    cursors: HashMap<String, EntryCursor>,
    buf: Vec<u8>,
    /// Bytes read from the file so far (every pass), for tests of how often a storage is read.
    #[cfg_attr(not(test), allow(dead_code))]
    read: u64,
}

impl StorageReader {
    /// Opens the archive at `path` (its records checked as [`super::load`] checks them). A
    /// legacy-format file is refused: its storages are not zip entries.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let (name, mut src) = open(path)?;
        if starts_legacy(&name, &mut src)? {
            return Err(Error::Unsupported(format!(
                "`{name}` is a legacy-format torch.save file; its storages cannot be read by byte ranges"
            )));
        }
        let (zip, prefix) = open_archive(&name, src)?;
        Ok(StorageReader {
            zip,
            prefix,
            cursors: HashMap::new(),
            buf: Vec::new(),
            read: 0,
        })
    }

    /// Bytes read from the file so far, counting every pass.
    #[cfg(test)]
    pub(crate) fn bytes_read(&self) -> u64 {
        self.read
    }

    /// The byte length of storage `key`.
    pub(crate) fn storage_len(&mut self, key: &str) -> Result<u64> {
        Ok(self.cursor(key)?.size())
    }

    fn cursor(&mut self, key: &str) -> Result<&mut EntryCursor> {
        if !self.cursors.contains_key(key) {
            let entry = storage_entry(&self.zip, &self.prefix, key)?;
            let cursor = EntryCursor::new(&mut self.zip, entry)?;
            self.cursors.insert(key.to_string(), cursor);
        }
        self.cursors
            .get_mut(key)
            .ok_or_else(|| Error::Internal(format!("no cursor for storage {key}")))
    }

    /// Hands bytes `from..to` of storage `key` to `sink`, at most 1 MiB at a time, reading
    /// forward from the cursor (a range behind it starts a new pass once the current one is
    /// checked). `to` may not pass the storage's end. A storage read through is dropped from
    /// the page cache.
    pub(crate) fn read(
        &mut self,
        key: &str,
        from: u64,
        to: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let size = self.storage_len(key)?;
        if to < from || to > size {
            return Err(Error::Internal(format!(
                "bytes {from}..{to} of the {size}-byte storage {key} of `{}`",
                self.zip.file()
            )));
        }
        if from < self.cursor(key)?.pos() {
            self.complete(key)?;
            self.cursor(key)?.restart();
        }
        if self.buf.is_empty() {
            self.buf = vec![0; PIECE];
        }
        let StorageReader {
            zip,
            cursors,
            buf,
            read,
            ..
        } = self;
        let c = cursors
            .get_mut(key)
            .ok_or_else(|| Error::Internal(format!("no cursor for storage {key}")))?;
        let was_checked = c.is_checked();
        *read += c.read(zip, buf, (from, to), sink)?;
        if c.is_checked() && !was_checked {
            zip.drop_cached(c.start(), size);
        }
        Ok(())
    }

    /// Reads storage `key` on to its end, so that its CRC-32 is checked.
    pub(crate) fn read_to_end(&mut self, key: &str) -> Result<()> {
        self.complete(key)
    }

    /// Completes the current pass over storage `key` (nothing when it is checked).
    fn complete(&mut self, key: &str) -> Result<()> {
        let c = self.cursor(key)?;
        if c.is_checked() {
            return Ok(());
        }
        let (pos, end) = (c.pos(), c.size());
        self.read(key, pos, end, &mut |_| Ok(()))
    }

    /// Completes every pass begun, so that every byte handed out was checked.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let mut keys: Vec<String> = self.cursors.keys().cloned().collect();
        keys.sort();
        for k in keys {
            self.complete(&k)?;
        }
        Ok(())
    }
}
