//! A stored zip entry read forward in pieces, each piece checksummed as it passes: what reads
//! a storage by byte ranges without holding it whole (a DCP chunk's lone tensor, a DeepSpeed
//! rank's flat partitions) and still checks its CRC-32, once the read reaches the end. The
//! bytes ahead are asked of the kernel while the reader works on the ones it has
//! ([`READ_AHEAD`]), so that reading from a cold disk overlaps the writing of the output.

use super::zip::{Entry, Source, ZipReader};
use crate::error::{Error, Result};

/// How far ahead of a forward read the kernel is asked to read (`POSIX_FADV_WILLNEED`), in
/// steps of half of it: far enough that the disk stays busy while a piece is written, near
/// enough that the bytes are still cached when the read gets there.
const READ_AHEAD: u64 = 8 << 20;

/// Where a forward read of one entry stands: bytes `0..pos` read and checksummed.
pub(super) struct EntryCursor {
    entry: Entry,
    /// Where the entry's data starts in the archive.
    start: u64,
    pos: u64,
    crc: crc32fast::Hasher,
    /// Whether the current pass reached the end and its CRC-32 matched.
    checked: bool,
    /// Bytes `0..advised` were asked to be read ahead.
    advised: u64,
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
            advised: 0,
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
        self.advised = 0;
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
            self.read_ahead(zip, buf.len() as u64);
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

    /// Asks the kernel for the bytes ahead of the read ([`advice`]).
    fn read_ahead<S: Source>(&mut self, zip: &ZipReader<S>, piece: u64) {
        if let Some((from, to)) = advice(self.pos, self.advised, self.entry.size, piece) {
            zip.will_need(self.start + from, to - from);
            self.advised = to;
        }
    }
}

/// The bytes of an entry of `size` bytes to ask for next, when a read at `pos` had bytes
/// `0..advised` asked for: the rest of the next [`READ_AHEAD`] once the read is within half
/// of it of `advised`, so the kernel stays 4 to 8 MiB ahead. `None` when nothing is due, and
/// for an entry that one piece of `piece` bytes reads.
fn advice(pos: u64, advised: u64, size: u64, piece: u64) -> Option<(u64, u64)> {
    if size <= piece || advised >= size || pos + READ_AHEAD / 2 < advised {
        return None;
    }
    let from = advised.max(pos);
    Some((from, (pos + READ_AHEAD).min(size)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_ahead_stays_four_to_eight_mib_ahead_and_stops_at_the_end() {
        const MIB: u64 = 1 << 20;
        let (size, piece) = (20 * MIB, MIB);
        let mut advised = 0;
        let mut asked = Vec::new();
        for pos in (0..size).step_by(piece as usize) {
            if let Some((from, to)) = advice(pos, advised, size, piece) {
                assert_eq!(from, advised, "the asks are contiguous");
                asked.push((from / MIB, to / MIB));
                advised = to;
            }
            assert!(advised >= (pos + 4 * MIB).min(size), "at {pos}: {advised}");
            assert!(advised <= pos + READ_AHEAD, "at {pos}: {advised}");
        }
        assert_eq!(asked, [(0, 8), (8, 12), (12, 16), (16, 20)]);
        // One piece reads a small entry: no advice.
        assert_eq!(advice(0, 0, MIB, MIB), None);
    }
}
