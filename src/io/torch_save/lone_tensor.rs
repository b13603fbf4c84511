//! The lone tensor of a `torch.save` archive stored inside a larger file (each chunk of a DCP
//! data file is one), read forward in small pieces instead of whole: a reader that hands
//! parts of a chunk to several outputs keeps each piece in the CPU cache from the read to the
//! last write, where a whole multi-megabyte chunk would go through memory twice.

use super::unpickle::{self, Mode};
use super::zip::{Entry, FileSource, ZipReader};
use super::{open_archive, open_range, read_zip, starts_legacy, storage_entry};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::path::Path;

/// Bytes read at a time: half the L2 cache of the machines measured (2 MiB per core), so a
/// piece stays cached while its parts are checksummed and written.
const PIECE: usize = 1 << 20;

/// The tensor that is the whole object of a `torch.save` archive, when it is also the whole
/// of its storage (contiguous, of the storage's dtype): its bytes are the storage entry's, read
/// forward from where the last read stopped. The entry's CRC-32 is checked when the read
/// reaches the storage's end, or at [`LoneTensor::finish`], which reads the rest.
pub(crate) struct LoneTensor {
    zip: ZipReader<FileSource>,
    entry: Entry,
    dtype: DType,
    shape: Vec<usize>,
    /// Where the storage's data starts in the archive.
    start: u64,
    /// Bytes of the storage read so far (all checksummed).
    pos: u64,
    crc: crc32fast::Hasher,
    /// Whether the CRC-32 was checked (all bytes read).
    checked: bool,
    buf: Vec<u8>,
}

impl LoneTensor {
    /// Opens the archive at bytes `start..start + len` of `path`. `None` when its object is
    /// not one tensor that is its whole storage (a view, a legacy file, a tiny tensor read
    /// with the pickle): the caller then reads it whole. The pickle and the records are
    /// checked as a full read checks them.
    pub(crate) fn open(path: &Path, start: u64, len: u64) -> Result<Option<Self>> {
        let (name, mut src) = open_range(path, start, len)?;
        if starts_legacy(&name, &mut src)? {
            return Ok(None);
        }
        let (zip, prefix) = open_archive(&name, src)?;
        let (u, mut zip, prefix) = read_zip(
            &name,
            zip,
            prefix,
            Mode::Headers,
            unpickle::Allow::TorchLoad,
        )?;
        let unpickle::Unpickled {
            obj: super::PyObj::Tensor(t),
            shapes,
            whole,
            ..
        } = u
        else {
            return Ok(None);
        };
        let Some(key) = whole.get(&t.storage_id()) else {
            return Ok(None);
        };
        let shape = shapes
            .get(&t.storage_id())
            .cloned()
            .unwrap_or_else(|| t.shape().to_vec());
        let entry = storage_entry(&zip, &prefix, key)?;
        let data = zip.data_start(&entry)?;
        Ok(Some(LoneTensor {
            zip,
            entry,
            dtype: t.dtype(),
            shape,
            start: data,
            pos: 0,
            crc: crc32fast::Hasher::new(),
            checked: false,
            buf: Vec::new(),
        }))
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Bytes of the tensor read so far: [`LoneTensor::read`] can start at any byte from here.
    pub(crate) fn pos(&self) -> u64 {
        self.pos
    }

    /// Hands bytes `from..to` of the tensor to `sink`, at most [`PIECE`] at a time, after
    /// reading (and checksumming) any bytes between [`LoneTensor::pos`] and `from`. Needs
    /// `pos() <= from <= to <=` the storage's size.
    pub(crate) fn read(
        &mut self,
        from: u64,
        to: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if from < self.pos || to < from || to > self.entry.size {
            return Err(Error::Internal(format!(
                "bytes {from}..{to} of a {}-byte tensor read from byte {}",
                self.entry.size, self.pos
            )));
        }
        if self.buf.is_empty() && to > self.pos {
            self.buf = vec![0; PIECE.min(self.entry.size as usize)];
        }
        while self.pos < to {
            let n = (to - self.pos).min(self.buf.len() as u64) as usize;
            let piece = &mut self.buf[..n];
            self.zip
                .read_part(&self.entry, self.start + self.pos, piece)?;
            self.crc.update(piece);
            let first = self.pos;
            self.pos += n as u64;
            if self.pos > from {
                let skip = from.saturating_sub(first) as usize;
                sink(&piece[skip..])?;
            }
        }
        if self.pos == self.entry.size {
            self.check()?;
        }
        Ok(())
    }

    /// Whether every byte was read and the CRC-32 checked.
    pub(crate) fn is_checked(&self) -> bool {
        self.checked
    }

    /// Reads the rest of the storage, so that its CRC-32 is checked.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let end = self.entry.size;
        self.read(end, end, &mut |_| Ok(()))
    }

    fn check(&mut self) -> Result<()> {
        if self.checked {
            return Ok(());
        }
        self.checked = true;
        let crc = std::mem::take(&mut self.crc).finalize();
        self.zip.check_crc(&self.entry, self.start, crc)
    }
}
