//! Writing one rank file of the crate's checkpoint as its pieces arrive: the header first,
//! then the data through a 1 MiB buffer, written back to disk as it goes, synced at the end.
//! Used by the offline writers that stream (`reshard`, DCP conversion).

use super::manifest::FileRecord;
use crate::error::{Error, Result};
use crate::io::safetensors::header::{self, Entry};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The header of rank `rank`'s file holding `entries` (its metadata: the format and the
/// rank); each entry's data offset.
pub(super) fn header(rank: usize, entries: &[Entry]) -> Result<(Vec<u8>, Vec<u64>)> {
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), super::FORMAT.to_string());
    meta.insert("rank".to_string(), rank.to_string());
    header::encode(entries, &meta, &|e| {
        format!(
            "parameter `{}` in rank {rank}'s file of the crate's checkpoint",
            e.name
        )
    })
}

/// A rank file being written.
pub(super) struct RankFile {
    w: BufWriter<File>,
    path: PathBuf,
    name: String,
    header: Vec<u8>,
    writeback: super::Writeback,
    /// Data bytes the file will hold.
    total: u64,
    /// Data bytes written so far.
    copied: u64,
    /// Whether this is the file `CrashPoint::MidFile` stops in (rank 0's).
    crash_mid_file: bool,
}

impl RankFile {
    /// Creates `rank{rank}.safetensors` in `tmp` and writes `header`; `total` data bytes
    /// are to follow.
    pub(super) fn create(tmp: &Path, rank: usize, header: Vec<u8>, total: u64) -> Result<Self> {
        let name = format!("rank{rank}.safetensors");
        let path = tmp.join(&name);
        let file = File::create(&path).map_err(Error::io("creating", &path))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&header).map_err(Error::io("writing", &path))?;
        Ok(RankFile {
            w,
            path,
            name,
            header,
            writeback: super::Writeback::new(0),
            total,
            copied: 0,
            crash_mid_file: false,
        })
    }

    /// Marks the file as the one the `MidFile` crash point stops in.
    pub(super) fn crashing_mid_file(mut self, on: bool) -> Self {
        self.crash_mid_file = on;
        self
    }

    /// Appends `bytes`; returns whether the file is now half written (the crash point).
    pub(super) fn write(&mut self, bytes: &[u8]) -> Result<bool> {
        self.w
            .write_all(bytes)
            .map_err(Error::io("writing", &self.path))?;
        self.writeback
            .wrote(self.w.get_ref(), bytes.len() as u64)
            .map_err(Error::io("writing", &self.path))?;
        self.copied += bytes.len() as u64;
        Ok(self.crash_mid_file && self.copied * 2 >= self.total)
    }

    /// Hands the buffered bytes to the file.
    pub(super) fn flush(&mut self) -> Result<()> {
        self.w.flush().map_err(Error::io("writing", &self.path))
    }

    /// Flushes and syncs the file; its record.
    pub(super) fn finish(self) -> Result<FileRecord> {
        let path = self.path;
        let file = self
            .w
            .into_inner()
            .map_err(|e| Error::io("writing", &path)(e.into_error()))?;
        file.sync_all().map_err(Error::io("syncing", &path))?;
        let len = file.metadata().map_err(Error::io("reading", &path))?.len();
        Ok(FileRecord {
            name: self.name,
            len,
            header_len: self.header.len() as u64,
            header_crc32c: crc32c::crc32c(&self.header),
        })
    }
}
