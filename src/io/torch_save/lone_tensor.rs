//! The lone tensor of a `torch.save` archive stored inside a larger file (each chunk of a DCP
//! data file is one), read forward in small pieces instead of whole: a reader that hands
//! parts of a chunk to several outputs keeps each piece in the CPU cache from the read to the
//! last write, where a whole multi-megabyte chunk would go through memory twice.

use super::cursor::EntryCursor;
use super::unpickle::{self, Mode};
use super::zip::{FileSource, ZipReader};
use super::{open_archive, read_zip, shared_range, starts_legacy, storage_entry};
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// Bytes read at a time: half the L2 cache of the machines measured (2 MiB per core), so a
/// piece stays cached while its parts are checksummed and written.
const PIECE: usize = 1 << 20;

/// Refuses a forward read of bytes `from..to` of a `size`-byte tensor whose reader stands at
/// byte `pos` unless `pos <= from <= to <= size` (a caller's mistake, not the input's).
pub(crate) fn check_forward(from: u64, to: u64, pos: u64, size: u64) -> Result<()> {
    if from < pos || to < from || to > size {
        return Err(Error::Internal(format!(
            "bytes {from}..{to} of a {size}-byte tensor read from byte {pos}"
        )));
    }
    Ok(())
}

/// The tensor that is the whole object of a `torch.save` archive, when it is also the whole
/// of its storage (contiguous, of the storage's dtype): its bytes are the storage entry's, read
/// forward from where the last read stopped. The entry's CRC-32 is checked when the read
/// reaches the storage's end, or at [`LoneTensor::finish`], which reads the rest.
pub(crate) struct LoneTensor {
    zip: ZipReader<FileSource>,
    cursor: EntryCursor,
    dtype: DType,
    shape: Vec<usize>,
    buf: Vec<u8>,
}

impl LoneTensor {
    /// Opens the archive at bytes `start..start + len` of `file`, open at `path` (shared
    /// with the other chunks of its data file, so that the kernel's read-ahead follows the
    /// whole file). `None` when its object is not one tensor that is its whole storage (a
    /// view, a legacy file, a tiny tensor read with the pickle): the caller then reads it
    /// whole. The pickle and the records are checked as a full read checks them.
    pub(crate) fn open(file: Arc<File>, path: &Path, start: u64, len: u64) -> Result<Option<Self>> {
        let (name, mut src) = shared_range(file, path, start, len);
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
        let cursor = EntryCursor::new(&mut zip, entry)?;
        Ok(Some(LoneTensor {
            zip,
            cursor,
            dtype: t.dtype(),
            shape,
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
        self.cursor.pos()
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
        let (pos, size) = (self.cursor.pos(), self.cursor.size());
        check_forward(from, to, pos, size)?;
        if self.buf.is_empty() && to > pos {
            self.buf = vec![0; PIECE.min(size as usize)];
        }
        self.cursor
            .read(&mut self.zip, &mut self.buf, (from, to), sink)
            .map(drop)
    }

    /// Whether every byte was read and the CRC-32 checked.
    pub(crate) fn is_checked(&self) -> bool {
        self.cursor.is_checked()
    }

    /// Reads the rest of the storage, so that its CRC-32 is checked.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let end = self.cursor.size();
        self.read(end, end, &mut |_| Ok(()))
    }
}
