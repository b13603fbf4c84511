//! Tensor chunks stored through zstd, decompressed in bounded pieces straight to where their
//! bytes go (the module docs of [`crate::io::dcp`] give the rule): a whole read
//! ([`DcpCheckpoint::read_zstd_chunk`]) decompresses the chunk's data into its tensor, the
//! rest of the archive into small buffers; a chunk opened to be read forward
//! ([`DcpCheckpoint::open_zstd_chunk`]) is decompressed once to find and check its layout,
//! keeping only the bytes around its data, and again, a piece at a time, as it is read
//! ([`ZstdChunk`]). Either way the archive is checked whole, as a whole read checked it; a
//! layout other than the one `torch.save` writes is read whole, as before.

use super::{chunk_bytes, chunk_site, zstd_bound, zstd_layers, DcpCheckpoint, ARCHIVE_ALLOWANCE};
use crate::error::{Error, Result};
use crate::io::dcp::metadata::{Chunk, StorageInfo};
use crate::io::torch_save::{Hold, Inflated, PyObj, Split};
use crate::tensor::DType;
use std::io::{Read, Seek, SeekFrom};

/// Bytes decompressed at a time, and the most handed to a sink at once.
const PIECE: usize = 1 << 20;

/// A decompressed stream: the item's range through every zstd layer.
type Stream = Box<dyn Read + Send>;

/// How compressed chunks were read on this thread (public with the feature
/// `fault-injection`): what the tests check to see which path a reader took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZstdChunkReads {
    /// Chunks read forward in pieces to their end ([`ZstdChunk`]).
    pub streamed: u64,
    /// Chunks read whole whose data went straight into their tensor.
    pub into_tensor: u64,
    /// Chunks read whole from every byte kept (a layout the split does not vouch for).
    pub whole: u64,
    /// The most bytes handed to a sink at once by a chunk read forward.
    pub largest_piece: u64,
}

thread_local! {
    static READS: std::cell::Cell<ZstdChunkReads> = const {
        std::cell::Cell::new(ZstdChunkReads {
            streamed: 0,
            into_tensor: 0,
            whole: 0,
            largest_piece: 0,
        })
    };
}

/// The counts of compressed chunk reads on this thread so far (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
pub fn zstd_chunk_reads() -> ZstdChunkReads {
    READS.with(std::cell::Cell::get)
}

fn count(f: impl FnOnce(&mut ZstdChunkReads)) {
    READS.with(|c| {
        let mut r = c.get();
        f(&mut r);
        c.set(r);
    });
}

/// What an item's output may hold: its limit and what that is made of, for
/// [`Error::DcpExpansion`].
fn chunk_limit(need: u64, dtype: DType) -> (u64, String) {
    let limit = need.saturating_add(ARCHIVE_ALLOWANCE);
    let what = format!(
        "the chunk's {need} bytes of {dtype} plus {ARCHIVE_ALLOWANCE} for the torch.save archive around them"
    );
    (limit, what)
}

impl DcpCheckpoint {
    /// The decompressed stream of `info`'s range (through its `layers` zstd layers, after
    /// [`Self::checked_range`]): every frame of the range, one after another (skippable
    /// frames give nothing), as PyTorch's `zstandard` stream reader reads it; bytes that are
    /// no frame, or a frame the range cuts, are an error. An inner layer may hold a little
    /// more than the outer one's output; the stream ends one byte past `limit`, so a reader
    /// sees the output pass it.
    pub(super) fn zstd_stream(
        &self,
        key: &str,
        info: &StorageInfo,
        path: &std::path::Path,
        limit: u64,
    ) -> Result<Stream> {
        let f = &info.relative_path;
        let io = |e: std::io::Error| self.storage_err(key, f, format!("reading: {e}"));
        let layers = zstd_layers(&info.transforms).map_err(|r| self.storage_err(key, f, r))?;
        let mut file = crate::storage::open_regular(path).map_err(|e| io(e.into()))?;
        file.seek(SeekFrom::Start(info.offset)).map_err(io)?;
        let mut stream: Stream = Box::new(file.take(info.length));
        for _ in 0..layers {
            let decoder = zstd::stream::read::Decoder::new(stream).map_err(io)?;
            stream = Box::new(decoder.take(zstd_bound(limit)));
        }
        Ok(Box::new(stream.take(limit.saturating_add(1))))
    }

    /// The error of a compressed range that does not decompress.
    pub(super) fn decode_err(&self, key: &str, info: &StorageInfo, e: std::io::Error) -> Error {
        self.storage_err(
            key,
            &info.relative_path,
            format!(
                "bytes {}..+{} do not decompress as {:?}: {e}",
                info.offset, info.length, info.transforms
            ),
        )
    }

    /// Decompresses the chunk `info` (of `need` bytes of `dtype`, its range checked) into an
    /// [`Inflated`] that keeps its bytes as `hold` says, with the errors and the limit of a
    /// whole read ([`Self::read_item`]). `None` when the bytes cannot be kept so (then nothing
    /// past that point was decompressed).
    fn inflate(
        &self,
        key: &str,
        info: &StorageInfo,
        (need, dtype): (u64, DType),
        hold: Hold<'_>,
    ) -> Result<Option<Inflated>> {
        let path = self.checked_range(key, info, need)?;
        let (limit, what) = chunk_limit(need, dtype);
        let mut stream = self.zstd_stream(key, info, path, limit)?;
        let mut inflated = Inflated::new(need, hold, ARCHIVE_ALLOWANCE as usize);
        let mut piece = vec![0u8; (PIECE as u64).min(limit.saturating_add(1)) as usize];
        loop {
            let n = match stream.read(&mut piece) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.decode_err(key, info, e)),
            };
            if !inflated.push(&piece[..n]) {
                return Ok(None);
            }
        }
        if inflated.len() > limit {
            return Err(Error::DcpExpansion {
                dir: self.dir_name(),
                key: key.to_string(),
                file: info.relative_path.clone(),
                limit,
                what,
            });
        }
        self.drop_read_pages(path, info.offset, info.offset + info.length);
        Ok(Some(inflated))
    }

    /// Reads a compressed chunk whole ([`Self::read_chunk`]'s result): its data decompressed
    /// into the tensor when the archive is the one `torch.save` writes, else the archive's
    /// object read from all its bytes as before. The tensor is checked by the caller.
    pub(super) fn read_zstd_chunk(
        &self,
        key: &str,
        (chunk, info): (&Chunk, &StorageInfo),
        dtype: DType,
    ) -> Result<PyObj> {
        let need = chunk_bytes(&chunk.sizes, dtype);
        let hold = Hold::Data(dtype, &chunk.sizes);
        let Some(inflated) = self.inflate(key, info, (need, dtype), hold)? else {
            return Err(Error::Internal("a held chunk was not kept".into()));
        };
        if let Some(found) = inflated.lone_tensor() {
            let f = &info.relative_path;
            self.check_chunk_tensor(key, (chunk, info), dtype, (&found.1, found.0))?;
            if let Some(t) = inflated.into_data() {
                count(|r| r.into_tensor += 1);
                return Ok(PyObj::Tensor(t));
            }
            return Err(self.storage_err(key, f, "internal: the chunk's data was not held"));
        }
        count(|r| r.whole += 1);
        let at = chunk_site(chunk, info);
        inflated.load().map_err(|e| {
            self.storage_err(
                key,
                &info.relative_path,
                format!("{at} does not parse: {e}"),
            )
        })
    }

    /// Opens a compressed chunk to be read forward in pieces ([`ZstdChunk`]): `None` when
    /// its archive is not the one `torch.save` writes of one whole-storage tensor (the caller
    /// reads it whole, with today's result). The tensor must be of the metadata's dtype and
    /// the chunk's shape.
    pub(super) fn open_zstd_chunk(
        &self,
        key: &str,
        (chunk, info): (&Chunk, &StorageInfo),
        dtype: DType,
    ) -> Result<Option<ZstdChunk>> {
        let need = chunk_bytes(&chunk.sizes, dtype);
        if need <= PIECE as u64 {
            // One piece holds it: a whole read costs no more.
            return Ok(None);
        }
        let Some(inflated) = self.inflate(key, info, (need, dtype), Hold::Skip)? else {
            return Ok(None);
        };
        let Some((found_dtype, shape)) = inflated.lone_tensor() else {
            return Ok(None);
        };
        self.check_chunk_tensor(key, (chunk, info), dtype, (&shape, found_dtype))?;
        let path = self.checked_range(key, info, need)?;
        let (limit, _) = chunk_limit(need, dtype);
        let stream = self.zstd_stream(key, info, path, limit)?;
        Ok(Some(ZstdChunk {
            split: inflated.into_split(),
            stream,
            at: 0,
            pos: 0,
            crc: crc32fast::Hasher::new(),
            checked: false,
            buf: Vec::new(),
            site: Site {
                dir: self.dir_name(),
                key: key.to_string(),
                file: info.relative_path.clone(),
                range: format!(
                    "bytes {}..+{} ({:?})",
                    info.offset, info.length, info.transforms
                ),
            },
        }))
    }
}

/// Where a [`ZstdChunk`] lies, for its errors.
struct Site {
    dir: String,
    key: String,
    file: String,
    range: String,
}

impl Site {
    fn err(&self, reason: String) -> Error {
        Error::DcpStorage {
            dir: self.dir.clone(),
            key: self.key.clone(),
            file: self.file.clone(),
            reason: format!("{}: {reason}", self.range),
        }
    }

    fn changed(&self, what: &str) -> Error {
        self.err(format!(
            "decompressed a second time, {what} than in the first pass, which opened the chunk (the file changed while it was read?)"
        ))
    }
}

/// A compressed chunk read forward: its range decompressed again, a piece at a time, the
/// bytes before and after the data checked against those the first pass kept, the data's
/// CRC-32 against the first pass's (which the archive's entry holds) when the read reaches
/// its end, and the stream's end where the first pass found it.
pub(crate) struct ZstdChunk {
    split: Split,
    stream: Stream,
    /// Bytes of the decompressed stream read.
    at: u64,
    /// Bytes of the data read.
    pos: u64,
    crc: crc32fast::Hasher,
    checked: bool,
    buf: Vec<u8>,
    site: Site,
}

impl ZstdChunk {
    /// Bytes of the tensor read so far: a read can start at any byte from here.
    pub(crate) fn pos(&self) -> u64 {
        self.pos
    }

    pub(crate) fn is_checked(&self) -> bool {
        self.checked
    }

    /// Fills `self.buf[..n]` from the stream.
    fn fill(&mut self, n: usize) -> Result<()> {
        if self.buf.len() < n {
            self.buf.resize(n, 0);
        }
        match self.stream.read_exact(&mut self.buf[..n]) {
            Ok(()) => {
                self.at += n as u64;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(self.site.changed("they give fewer bytes"))
            }
            Err(e) => Err(self.site.err(format!("they do not decompress: {e}"))),
        }
    }

    /// Reads the head again, checking it is the one kept.
    fn pass_head(&mut self) -> Result<()> {
        let head = self.split.head.len() as u64;
        while self.at < head {
            let n = (head - self.at).min(PIECE as u64) as usize;
            let at = self.at as usize;
            self.fill(n)?;
            if self.buf[..n] != self.split.head[at..at + n] {
                return Err(self.site.changed("the bytes before the data are other"));
            }
        }
        Ok(())
    }

    /// Reads the tail again, checking it is the one kept and that the stream ends there.
    fn pass_tail(&mut self) -> Result<()> {
        let n = self.split.tail.len();
        self.fill(n)?;
        if self.buf[..n] != self.split.tail[..] {
            return Err(self.site.changed("the bytes after the data are other"));
        }
        let mut more = [0u8; 1];
        loop {
            return match self.stream.read(&mut more) {
                Ok(0) => Ok(()),
                Ok(_) => Err(self.site.changed("they give more bytes")),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(self.site.err(format!("they do not decompress: {e}"))),
            };
        }
    }

    /// Hands bytes `from..to` of the tensor to `sink`, at most [`PIECE`] at a time, after
    /// reading (and checksumming) any bytes between [`Self::pos`] and `from`; once the read
    /// reaches the data's end, checks its CRC-32 and the rest of the stream. Needs `pos() <=
    /// from <= to <=` the data's length.
    pub(crate) fn read(
        &mut self,
        from: u64,
        to: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let size = self.split.len;
        crate::io::torch_save::check_forward(from, to, self.pos, size)?;
        self.pass_head()?;
        while self.pos < to {
            let n = (to - self.pos).min(PIECE as u64) as usize;
            self.fill(n)?;
            let piece = &self.buf[..n];
            self.crc.update(piece);
            let first = self.pos;
            self.pos += n as u64;
            if self.pos > from {
                let part = &piece[from.saturating_sub(first) as usize..];
                count(|r| r.largest_piece = r.largest_piece.max(part.len() as u64));
                sink(part)?;
            }
        }
        if self.pos == size && !self.checked {
            let crc = std::mem::take(&mut self.crc).finalize();
            if crc != self.split.crc {
                return Err(self.site.changed(&format!(
                    "the data's CRC-32 ({crc:08x}) is other (it was {:08x})",
                    self.split.crc
                )));
            }
            self.pass_tail()?;
            self.checked = true;
            count(|r| r.streamed += 1);
        }
        Ok(())
    }

    /// Reads the rest of the data, so that its CRC-32 and the stream's end are checked.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let end = self.split.len;
        self.read(end, end, &mut |_| Ok(()))
    }
}
