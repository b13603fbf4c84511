//! A stored zip entry read forward in pieces, each piece checksummed as it passes: what reads
//! a storage by byte ranges without holding it whole (a DCP chunk's lone tensor, a DeepSpeed
//! rank's flat partitions) and still checks its CRC-32, once the read reaches the end.

use super::zip::{Entry, Source, ZipReader};
use crate::error::{Error, Result};

/// Where a forward read of one entry stands: bytes `0..pos` read and checksummed.
pub(super) struct EntryCursor {
    entry: Entry,
    /// Where the entry's data starts in the archive.
    start: u64,
    pos: u64,
    crc: crc32fast::Hasher,
    /// Whether the current pass reached the end and its CRC-32 matched.
    checked: bool,
}

impl EntryCursor {
    /// A cursor at the first byte of `entry` of `zip`.
    pub(super) fn new<S: Source>(zip: &mut ZipReader<S>, entry: Entry) -> Result<Self> {
        let start = zip.data_start(&entry)?;
        Ok(EntryCursor {
            entry,
            start,
            pos: 0,
            crc: crc32fast::Hasher::new(),
            checked: false,
        })
    }

    /// The entry's length in bytes.
    pub(super) fn size(&self) -> u64 {
        self.entry.size
    }

    /// Bytes read so far in this pass: a read can start at any byte from here.
    pub(super) fn pos(&self) -> u64 {
        self.pos
    }

    /// Where the entry's data starts in the archive.
    pub(super) fn start(&self) -> u64 {
        self.start
    }

    /// Whether this pass read every byte and the CRC-32 matched.
    pub(super) fn is_checked(&self) -> bool {
        self.checked
    }

    /// Starts a new pass from the entry's first byte.
    pub(super) fn restart(&mut self) {
        self.pos = 0;
        self.crc = crc32fast::Hasher::new();
        self.checked = false;
    }

    /// Hands bytes `from..to` of the entry to `sink`, at most `buf.len()` at a time, after
    /// reading (and checksumming) the bytes between [`Self::pos`] and `from`; checks the
    /// CRC-32 when the read reaches the entry's end. The caller checks `pos() <= from <= to
    /// <= size()`. Returns the bytes read from the archive.
    pub(super) fn read<S: Source>(
        &mut self,
        zip: &mut ZipReader<S>,
        buf: &mut [u8],
        (from, to): (u64, u64),
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<u64> {
        if buf.is_empty() && self.pos < to {
            return Err(Error::Internal("a forward read with no buffer".into()));
        }
        let mut read = 0;
        while self.pos < to {
            let n = (to - self.pos).min(buf.len() as u64) as usize;
            let piece = &mut buf[..n];
            zip.read_part(&self.entry, self.start + self.pos, piece)?;
            read += n as u64;
            self.crc.update(piece);
            let first = self.pos;
            self.pos += n as u64;
            if self.pos > from {
                let skip = from.saturating_sub(first) as usize;
                sink(&piece[skip..])?;
            }
        }
        if self.pos == self.entry.size && !self.checked {
            let crc = std::mem::take(&mut self.crc).finalize();
            zip.check_crc(&self.entry, self.start, crc)?;
            self.checked = true;
        }
        Ok(read)
    }
}
