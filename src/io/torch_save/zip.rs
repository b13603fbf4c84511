//! The stored-only zip container that `torch.save` writes, read and written by hand so that
//! alignment, zip64 records and every bounds check stay under our control.
//!
//! Layout written (as PyTorch's `PyTorchStreamWriter` does): each entry is a local header with
//! flags `0x0808` (data descriptor follows, UTF-8 name), zero sizes and CRC, an extra field
//! `FB` padded with `Z` so that the data starts at a multiple of [`ALIGNMENT`], the data, and a
//! data descriptor; then the central directory, a zip64 end-of-central-directory record and
//! locator, and the classic end record.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::Write;

/// Data entries start at multiples of this many bytes (PyTorch's default storage alignment).
pub(crate) const ALIGNMENT: u64 = 64;

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const LOCAL_HEADER_LEN: u64 = 30;
const CENTRAL_HEADER_LEN: usize = 46;
const EOCD_LEN: usize = 22;
const FLAGS: u16 = 0x0808;

/// How many bytes at the end of an archive are read, in one read, to find its end record
/// (which holds a comment of at most 65535 bytes).
pub(super) const EOCD_SEARCH: u64 = EOCD_LEN as u64 + 0xffff;

/// Whether `bytes` hold an end record's signature with room for the record after it.
pub(super) fn holds_end_record(bytes: &[u8]) -> bool {
    bytes.len() >= EOCD_LEN && (0..=bytes.len() - EOCD_LEN).any(|i| le32(bytes, i) == EOCD_SIG)
}

/// An entry name's bytes as a message shows them: UTF-8 as it is, `\xNN` for each byte that
/// is not.
fn shown_bytes(raw: &[u8]) -> String {
    let mut out = String::with_capacity(raw.len());
    for chunk in raw.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Random access to the bytes of an archive (a file or a buffer).
pub(crate) trait Source {
    /// Total length in bytes.
    fn len(&self) -> u64;
    /// Fills `buf` with the bytes at `offset`; the range has been checked against `len`.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
    /// Advice that the bytes `offset..offset + len` will be read soon (a file starts reading
    /// them into the page cache); nothing for memory.
    fn will_need(&self, _offset: u64, _len: u64) {}
}

/// An archive held in memory.
#[derive(Clone, Copy)]
pub(crate) struct SliceSource<'a>(pub(crate) &'a [u8]);

impl Source for SliceSource<'_> {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(std::io::Error::other)?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.0.get(start..end))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// An archive on disk: the `len` bytes of `file` from `start` (a whole file, or an archive
/// stored inside a larger one, as each chunk of a DCP data file is).
pub(crate) struct FileSource {
    /// Shared, so that the archives of one data file read through one open file (and its
    /// read-ahead state).
    pub(crate) file: std::sync::Arc<std::fs::File>,
    pub(crate) start: u64,
    pub(crate) len: u64,
    /// Whether forward reads ask the kernel for the bytes ahead ([`Source::will_need`]):
    /// not through a file that the chunks of a DCP data file share, which are read in
    /// another order than the file's; there the file's own read-ahead costs less (asking
    /// as well took 22 s instead of 13 s at 2B parameters, BENCHMARKS.md).
    pub(crate) read_ahead: bool,
}

impl ZipReader<FileSource> {
    /// Drops `len` bytes of the file at `offset` (of the source) from the page cache: for a
    /// reader that reads each byte once.
    pub(crate) fn drop_cached(&self, offset: u64, len: u64) {
        crate::storage::drop_cached_pages(&self.src.file, self.src.start + offset, len);
    }
}

impl Source for FileSource {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&*self.file, buf, self.start + offset)
    }
    fn will_need(&self, offset: u64, len: u64) {
        if self.read_ahead {
            crate::storage::will_need_pages(&self.file, self.start + offset, len);
        }
    }
}

/// One stored entry: where its data lies and its checksum.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// The name as a message shows it: the stored bytes where they are UTF-8, `\xNN` for each
    /// byte that is not (miniz and PyTorch take names as bytes).
    pub(crate) name: String,
    /// The name's stored bytes.
    pub(crate) raw: Box<[u8]>,
    /// Offset of the local header.
    header: u64,
    /// Size of the data (uncompressed).
    pub(crate) size: u64,
    /// Compressed size (equal to `size` in a stored entry).
    csize: u64,
    /// Compression method (0: stored, the only one torch.save writes).
    method: u16,
    crc: u32,
    /// General-purpose flags of the central entry.
    flags: u16,
    /// miniz takes the entry for a directory (name ending in `/`, or the DOS directory bit
    /// 0x10 of the external attributes) and extracts no data for it.
    directory: bool,
}

/// What PyTorch's extraction of an entry gives it.
pub(crate) enum Extracted {
    /// The entry's data (its CRC-32 unchecked, as PyTorch leaves it).
    Data(Vec<u8>),
    /// Nothing was read: miniz takes the entry for a directory and PyTorch gets a buffer of
    /// the entry's size that it never filled.
    Unfilled,
}

/// The central directory of an archive, and access to its entries' data.
pub(crate) struct ZipReader<S> {
    file: String,
    src: S,
    entries: Vec<Entry>,
    /// Entries by name (its bytes) in ASCII lower case: miniz finds names regardless of case.
    by_name: HashMap<Box<[u8]>, usize>,
    /// The folder [`ZipReader::entry`] looks names up in: empty, or the archive folder with its
    /// `/` once [`ZipReader::enter_folder`] has found it.
    folder: Vec<u8>,
    /// Whether the archive's records take the whole source ([`ZipReader::check_fills`]).
    fills: Gap,
}

/// Where an archive's records leave bytes of the source outside it: `None` when the central
/// directory, the zip64 end record and locator (if any) and the end record (with its comment)
/// follow one another and the end record ends where the source does; else the offset of the
/// first gap and what lies there.
type Gap = Option<(u64, String)>;

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Where the central directory lies, as the end records say (miniz's
/// `mz_zip_reader_read_central_dir`).
struct CentralDirectory {
    count: u64,
    size: u64,
    offset: u64,
    /// "Number of this disk": 0 or 1 (miniz accepts both), which each entry's disk-start
    /// field must equal unless it is 1.
    disk: u32,
    /// Whether the records take the whole source.
    fills: Gap,
}

/// Where the records of an archive in a source of `len` bytes leave bytes outside it ([`Gap`]):
/// the end record at `eocd` with a comment of `comment` bytes, the zip64 end record (its
/// offset and where it ends by its own size) when miniz uses one, and the central directory
/// at `cd_offset` of `cd_size` bytes.
fn records_gap(
    len: u64,
    (eocd, comment): (u64, u64),
    zip64: Option<(u64, u64)>,
    (cd_offset, cd_size): (u64, u64),
) -> Gap {
    let end = eocd + EOCD_LEN as u64 + comment;
    if end != len {
        let what = format!(
            "{} bytes after the end record and its comment",
            len.abs_diff(end)
        );
        return Some((end.min(len), what));
    }
    if let Some((rec, rec_end)) = zip64 {
        if rec_end != eocd - 20 {
            let what = format!(
                "the zip64 end record here ends at byte {rec_end}, not at its locator (byte {})",
                eocd - 20
            );
            return Some((rec, what));
        }
    }
    let records = zip64.map_or(eocd, |(rec, _)| rec);
    (cd_offset + cd_size != records).then(|| {
        let what = format!(
            "the central directory here ({cd_size} bytes) ends at byte {}, not where the end records start (byte {records})",
            cd_offset + cd_size
        );
        (cd_offset, what)
    })
}

/// The suffix of reasons for checks that follow miniz (PyTorch's zip reader), with its error.
fn miniz(what: &str) -> String {
    format!("PyTorch's reader (miniz) refuses this: {what}")
}

impl<S: Source> ZipReader<S> {
    /// Parses the end records and the central directory: the file's kind, where the central
    /// directory lies, then its entries.
    pub(crate) fn new(file: &str, src: S) -> Result<Self> {
        let mut r = ZipReader {
            file: file.to_string(),
            src,
            entries: Vec::new(),
            by_name: HashMap::new(),
            folder: Vec::new(),
            fills: None,
        };
        r.check_magic()?;
        let dir = r.central_directory()?;
        r.fills = dir.fills.clone();
        let mut cd = vec![0u8; dir.size as usize];
        r.read(dir.offset, &mut cd, None)?;
        let mut at = 0usize;
        for _ in 0..dir.count {
            let (entry, used) = r.central_entry(&cd, at, dir.offset + at as u64, dir.disk)?;
            r.by_name
                .insert(entry.raw.to_ascii_lowercase().into(), r.entries.len());
            r.entries.push(entry);
            at += used;
        }
        Ok(r)
    }

    /// Refuses what is not a zip archive, naming legacy (pickle-stream) torch.save files.
    fn check_magic(&mut self) -> Result<()> {
        let mut magic = [0u8; 4];
        let head = self.src.len().min(4) as usize;
        self.read(0, &mut magic[..head], None)?;
        // Legacy torch.save files are a pickle stream (protocol 2 starts with 0x80 0x02).
        if head >= 2 && magic[0] == 0x80 && magic[1] <= 5 {
            return Err(Error::LegacyTorchSave {
                file: self.file.clone(),
            });
        }
        if head < 4 || u32::from_le_bytes(magic) != LOCAL_SIG {
            return Err(self.err(
                None,
                0,
                format!("not a zip archive (starts with {magic:02x?})"),
            ));
        }
        Ok(())
    }

    /// Finds the end record and, as miniz does, the zip64 end record when a zip64 locator
    /// sits just before the end record and points to a zip64 record: then the zip64 record's
    /// entry counts, disk numbers, and directory size and offset are used and the classic
    /// record's are ignored. Checks what miniz checks (`mz_zip_reader_read_central_dir`).
    fn central_directory(&mut self) -> Result<CentralDirectory> {
        let len = self.src.len();
        // The end record is in the last 22 + 65535 bytes.
        let tail_len = len.min(EOCD_SEARCH);
        let tail_start = len - tail_len;
        let mut tail = vec![0u8; tail_len as usize];
        self.read(tail_start, &mut tail, None)?;
        let eocd = (0..=tail.len().saturating_sub(EOCD_LEN))
            .rev()
            .find(|&i| tail.len() >= EOCD_LEN && le32(&tail, i) == EOCD_SIG)
            .ok_or_else(|| self.err(None, len, "no end-of-central-directory record".into()))?;
        let eocd_pos = tail_start + eocd as u64;
        let e = &tail[eocd..eocd + EOCD_LEN];
        let mut count = u64::from(le16(e, 10));
        let mut on_disk = u64::from(le16(e, 8));
        let mut disk = u32::from(le16(e, 4));
        let mut cd_disk = u32::from(le16(e, 6));
        let mut size = u64::from(le32(e, 12));
        let mut offset = u64::from(le32(e, 16));
        let mut at = eocd_pos;
        let comment = u64::from(le16(e, 20));
        let mut rec_end = None;
        if let Some((rec_pos, rec, total_disks)) = self.zip64_records(eocd_pos)? {
            at = rec_pos;
            rec_end = Some(rec_pos.saturating_add(12).saturating_add(le64(&rec, 4)));
            // miniz: "if (zip64_size_of_end_of_central_dir_record < (MZ_ZIP64_END_OF_CENTRAL_
            // DIR_HEADER_SIZE - 12)) return ... MZ_ZIP_INVALID_HEADER_OR_CORRUPTED".
            let rec_size = le64(&rec, 4);
            if rec_size < 44 {
                return Err(self.err(
                    None,
                    rec_pos + 4,
                    format!(
                        "zip64 end record says it has {rec_size} bytes (< 44); {}",
                        miniz("invalid header or archive is corrupted")
                    ),
                ));
            }
            if total_disks != 1 {
                return Err(self.err(
                    None,
                    eocd_pos - 4,
                    format!(
                        "zip64 locator says {total_disks} disks; {}",
                        miniz("unsupported multidisk archive")
                    ),
                ));
            }
            count = le64(&rec, 32);
            on_disk = le64(&rec, 24);
            if count > u64::from(u32::MAX) || on_disk > u64::from(u32::MAX) {
                return Err(self.err(
                    None,
                    rec_pos + 24,
                    format!(
                        "zip64 end record counts {count} entries ({on_disk} on this disk); {}",
                        miniz("too many files")
                    ),
                ));
            }
            size = le64(&rec, 40);
            if size > u64::from(u32::MAX) {
                return Err(self.err(
                    None,
                    rec_pos + 40,
                    format!(
                        "zip64 end record says the central directory has {size} bytes; {}",
                        miniz("unsupported central directory size")
                    ),
                ));
            }
            disk = le32(&rec, 16);
            cd_disk = le32(&rec, 20);
            offset = le64(&rec, 48);
        }
        if count != on_disk || ((disk | cd_disk) != 0 && (disk != 1 || cd_disk != 1)) {
            return Err(self.err(
                None,
                at,
                format!(
                    "end record: {count} entries, {on_disk} on this disk, disk {disk}, \
                     central directory on disk {cd_disk}; {}",
                    miniz("unsupported multidisk archive")
                ),
            ));
        }
        // Every central entry takes at least 46 bytes.
        if size < count * CENTRAL_HEADER_LEN as u64 {
            return Err(self.err(
                None,
                offset,
                format!("{count} entries cannot fit in a central directory of {size} bytes"),
            ));
        }
        if offset.checked_add(size).is_none_or(|end| end > len) {
            return Err(self.err(
                None,
                offset,
                format!(
                    "central directory ({size} bytes) extends past the end of the file ({len} bytes)"
                ),
            ));
        }
        Ok(CentralDirectory {
            count,
            size,
            offset,
            disk,
            fills: records_gap(
                len,
                (eocd_pos, comment),
                rec_end.map(|e| (at, e)),
                (offset, size),
            ),
        })
    }

    /// The zip64 end record (its offset and first 56 bytes) and the locator's total number of
    /// disks, when miniz would use them: the end record at `eocd_pos` has at least 76 bytes
    /// before it, the 20 just before it are a zip64 locator, and the record it points to has
    /// the zip64 end record's signature. A locator pointing past where a 56-byte record could
    /// start refuses the file (miniz: "not a ZIP archive"); a record without the signature is
    /// ignored.
    fn zip64_records(&mut self, eocd_pos: u64) -> Result<Option<(u64, [u8; 56], u32)>> {
        if eocd_pos < 20 + 56 {
            return Ok(None);
        }
        let loc_pos = eocd_pos - 20;
        let mut loc = [0u8; 20];
        self.read(loc_pos, &mut loc, None)?;
        if le32(&loc, 0) != ZIP64_LOCATOR_SIG {
            return Ok(None);
        }
        let rec_pos = le64(&loc, 8);
        let len = self.src.len();
        if rec_pos > len - 56 {
            return Err(self.err(
                None,
                loc_pos + 8,
                format!(
                    "zip64 locator points to byte {rec_pos}, past the file's end ({len} bytes); {}",
                    miniz("not a ZIP archive")
                ),
            ));
        }
        let mut rec = [0u8; 56];
        self.read(rec_pos, &mut rec, None)?;
        if le32(&rec, 0) != ZIP64_EOCD_SIG {
            return Ok(None);
        }
        Ok(Some((rec_pos, rec, le32(&loc, 16))))
    }

    /// Parses the central entry at `at` of the directory `cd` (`pos` in the file) of an
    /// archive on disk `disk`: the entry and the bytes it takes. Checks what miniz checks of
    /// every entry when it opens an archive (`mz_zip_reader_read_central_dir`); besides, only
    /// stored (uncompressed), uniquely named entries are allowed.
    fn central_entry(&self, cd: &[u8], at: usize, pos: u64, disk: u32) -> Result<(Entry, usize)> {
        let h = cd
            .get(at..at + CENTRAL_HEADER_LEN)
            .ok_or_else(|| self.err(None, pos, "truncated central directory".into()))?;
        if le32(h, 0) != CENTRAL_SIG {
            return Err(self.err(None, pos, "bad central directory signature".into()));
        }
        let flags = le16(h, 8);
        let method = le16(h, 10);
        let crc = le32(h, 16);
        let mut csize = u64::from(le32(h, 20));
        let mut size = u64::from(le32(h, 24));
        let nlen = usize::from(le16(h, 28));
        let elen = usize::from(le16(h, 30));
        let clen = usize::from(le16(h, 32));
        let disk_start = le16(h, 34);
        let external = le32(h, 38);
        let mut header = u64::from(le32(h, 42));
        let var = cd
            .get(at + CENTRAL_HEADER_LEN..at + CENTRAL_HEADER_LEN + nlen + elen + clen)
            .ok_or_else(|| self.err(None, pos, "truncated central directory".into()))?;
        // Names are bytes to miniz and to PyTorch's reader; which of them must be UTF-8 is
        // `enter_folder`'s rule.
        let raw: Box<[u8]> = var[..nlen].into();
        let name = shown_bytes(&raw);
        self.zip64_extra(
            &name,
            pos,
            &var[nlen..nlen + elen],
            [&mut size, &mut csize, &mut header],
        )?;
        // miniz: "if ((disk_index == MZ_UINT16_MAX) || ((disk_index != num_this_disk) &&
        // (disk_index != 1))) return ... MZ_ZIP_UNSUPPORTED_MULTIDISK".
        if disk_start == 0xffff || (u32::from(disk_start) != disk && disk_start != 1) {
            return Err(self.err(
                Some(&name),
                pos + 34,
                format!(
                    "entry starts on disk {disk_start}; {}",
                    miniz("unsupported multidisk archive")
                ),
            ));
        }
        // miniz: "if ((local_header_ofs + MZ_ZIP_LOCAL_DIR_HEADER_SIZE + comp_size) >
        // pZip->m_archive_size) return ... MZ_ZIP_INVALID_HEADER_OR_CORRUPTED".
        let len = self.src.len();
        if csize != 0xffff_ffff
            && header
                .checked_add(LOCAL_HEADER_LEN + csize)
                .is_none_or(|end| end > len)
        {
            return Err(self.err(
                Some(&name),
                pos + 42,
                format!(
                    "local header at byte {header} with {csize} bytes of data does not fit in \
                     the file ({len} bytes); {}",
                    miniz("invalid header or archive is corrupted")
                ),
            ));
        }
        // miniz: MZ_ZIP_GENERAL_PURPOSE_BIT_FLAG_LOCAL_DIR_IS_MASKED (0x2000).
        if flags & 0x2000 != 0 {
            return Err(self.err(
                Some(&name),
                pos + 8,
                format!(
                    "flags {flags:#06x} mask the local header; {}",
                    miniz("unsupported encryption")
                ),
            ));
        }
        // miniz would find either of two names that differ only in letter case.
        if self.by_name.contains_key(&*raw.to_ascii_lowercase()) {
            return Err(self.err(
                Some(&name),
                pos,
                "duplicate entry (names are compared regardless of letter case, as PyTorch's reader finds them)".into(),
            ));
        }
        let entry = Entry {
            directory: raw.ends_with(b"/") || external & 0x10 != 0,
            name,
            raw,
            header,
            size,
            csize,
            method,
            crc,
            flags,
        };
        Ok((entry, CENTRAL_HEADER_LEN + nlen + elen + clen))
    }

    /// Applies an entry's zip64 extra field as miniz does (`mz_zip_file_stat_internal`): only
    /// when one of `fields` (size, compressed size, header offset) is 0xffffffff, each such
    /// field takes the next 8-byte value of the first field with id 1, in that order. The
    /// fields before it must be well formed.
    fn zip64_extra(
        &self,
        name: &str,
        pos: u64,
        mut extra: &[u8],
        mut fields: [&mut u64; 3],
    ) -> Result<()> {
        if !fields.iter().any(|v| **v == 0xffff_ffff) {
            return Ok(());
        }
        while !extra.is_empty() {
            let bad = || {
                self.err(
                    Some(name),
                    pos,
                    format!(
                        "truncated extra field; {}",
                        miniz("invalid header or archive is corrupted")
                    ),
                )
            };
            if extra.len() < 4 {
                return Err(bad());
            }
            let id = le16(extra, 0);
            let n = usize::from(le16(extra, 2));
            let body = extra.get(4..4 + n).ok_or_else(bad)?;
            if id == 1 {
                let mut values = body.chunks_exact(8).map(|c| le64(c, 0));
                for v in fields.iter_mut() {
                    if **v == 0xffff_ffff {
                        **v = values.next().ok_or_else(|| {
                            self.err(Some(name), pos, "short zip64 extra field".into())
                        })?;
                    }
                }
                break;
            }
            extra = &extra[4 + n..];
        }
        Ok(())
    }

    fn err(&self, entry: Option<&str>, offset: u64, reason: String) -> Error {
        Error::TorchSaveArchive {
            file: self.file.clone(),
            entry: entry.map(str::to_string),
            offset,
            reason,
        }
    }

    fn read(&mut self, offset: u64, buf: &mut [u8], entry: Option<&str>) -> Result<()> {
        let len = self.src.len();
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|end| end > len)
        {
            return Err(self.err(
                entry,
                offset,
                format!(
                    "needs {} bytes but the file has {len} (truncated?)",
                    buf.len()
                ),
            ));
        }
        self.src.read_at(offset, buf).map_err(|e| Error::Io {
            op: "reading".into(),
            path: self.file.clone(),
            source: e.into(),
        })
    }

    /// Refuses an archive whose records do not take the whole source: bytes after its end
    /// record, or a central directory and end records that are not one after another (the end
    /// records of another archive appended to this one). miniz reads such a source without a
    /// word (it finds the last end record and follows its offsets from the source's start);
    /// a reader that must find exactly one archive in a range checks this.
    pub(crate) fn check_fills(&self) -> Result<()> {
        match &self.fills {
            None => Ok(()),
            Some((offset, what)) => Err(self.err(
                None,
                *offset,
                format!(
                    "the archive does not take the whole of its {} bytes: {what}",
                    self.src.len()
                ),
            )),
        }
    }

    /// The entry called `name` inside the folder entered (the whole name before
    /// [`ZipReader::enter_folder`]), in any ASCII letter case (as miniz's
    /// `mz_zip_reader_locate_file` finds it for PyTorch).
    pub(crate) fn entry(&self, name: &str) -> Option<&Entry> {
        let mut key = self.folder.clone();
        key.extend_from_slice(name.as_bytes());
        key.make_ascii_lowercase();
        self.by_name.get(&*key).map(|&i| &self.entries[i])
    }

    /// Finds the archive folder as PyTorch's `PyTorchStreamReader::init` does (the first
    /// entry's name up to its first `/`, as bytes), checks every entry as `getAllRecords`
    /// lists them for `torch.load` (each name starts with the folder: "file in archive is not
    /// in a subdirectory"; the rest of it becomes a Python `str`, so it must be UTF-8), and
    /// looks names up inside the folder from then on. Returns the folder with its `/`, as a
    /// message shows it. The folder's own bytes need not be UTF-8: PyTorch never decodes them.
    pub(crate) fn enter_folder(&mut self) -> Result<String> {
        let Some(first) = self.entries.first() else {
            return Err(Error::MissingArchiveEntry {
                file: self.file.clone(),
                entry: "<archive>/data.pkl".into(),
            });
        };
        let Some(slash) = first.raw.iter().position(|&b| b == b'/') else {
            return Err(self.err(
                Some(&first.name),
                0,
                "entries are not inside an archive folder".into(),
            ));
        };
        let folder = first.raw[..=slash].to_vec();
        let shown = shown_bytes(&folder);
        for e in &self.entries {
            let Some(rest) = e.raw.strip_prefix(folder.as_slice()) else {
                return Err(self.err(
                    Some(&e.name),
                    0,
                    format!(
                        "entry is not inside the archive folder `{shown}` (PyTorch: file in \
                         archive is not in a subdirectory)"
                    ),
                ));
            };
            if std::str::from_utf8(rest).is_err() {
                return Err(self.err(
                    Some(&e.name),
                    0,
                    format!(
                        "the entry's name inside the archive folder `{shown}` is not UTF-8 \
                         (`torch.load` lists it as a Python str: UnicodeDecodeError)"
                    ),
                ));
            }
        }
        self.folder = folder;
        Ok(shown)
    }

    /// Reads an entry's data into `buf` (whose length must be the entry's size) and checks
    /// its CRC-32.
    pub(crate) fn read_entry_into(&mut self, entry: &Entry, buf: &mut [u8]) -> Result<()> {
        let name = entry.name.as_str();
        if buf.len() as u64 != entry.size {
            return Err(self.err(Some(name), entry.header, "internal: buffer size".into()));
        }
        let start = self.data_start(entry)?;
        self.read(start, buf, Some(name))?;
        self.check_crc(entry, start, crc32fast::hash(buf))
    }

    /// Where `entry`'s data starts in the source (after its local header), with the checks
    /// miniz makes when PyTorch extracts an entry (`mz_zip_reader_extract_to_mem_no_alloc1`):
    /// the local header's signature, and that the data, found through the local header's own
    /// name and extra lengths, fits in the file; miniz reads nothing of an empty entry (0 is
    /// returned for it) and nothing of one it takes for a directory or an encrypted one
    /// (refused here: PyTorch would hand back memory it never filled, or fail). A compressed
    /// entry, or a stored one whose two sizes differ, is refused here too, when PyTorch would
    /// extract it (it would inflate bytes torch.save never deflated, or fill its buffer only
    /// in part); miniz does not look at an entry it does not extract.
    pub(crate) fn data_start(&mut self, entry: &Entry) -> Result<u64> {
        let name = entry.name.as_str();
        if entry.size == 0 && entry.csize == 0 {
            return Ok(0);
        }
        if entry.directory {
            return Err(self.err(
                Some(name),
                entry.header,
                "entry is marked as a directory (name ending in `/` or DOS directory \
                 attribute), so PyTorch's reader (miniz) extracts none of its data"
                    .into(),
            ));
        }
        // IS_ENCRYPTED | COMPRESSED_PATCH | USES_STRONG_ENCRYPTION
        if entry.flags & (0x01 | 0x20 | 0x40) != 0 {
            return Err(self.err(
                Some(name),
                entry.header,
                format!(
                    "flags {:#06x} mark the entry encrypted or patched; {}",
                    entry.flags,
                    miniz("unsupported encryption")
                ),
            ));
        }
        if entry.method != 0 {
            return Err(self.err(
                Some(name),
                entry.header,
                format!(
                    "compression method {} (torch.save stores entries uncompressed)",
                    entry.method
                ),
            ));
        }
        if entry.csize != entry.size {
            return Err(self.err(
                Some(name),
                entry.header,
                format!(
                    "stored entry with compressed size {} != size {}",
                    entry.csize, entry.size
                ),
            ));
        }
        let mut h = [0u8; LOCAL_HEADER_LEN as usize];
        self.read(entry.header, &mut h, Some(name))?;
        if le32(&h, 0) != LOCAL_SIG {
            return Err(self.err(
                Some(name),
                entry.header,
                format!(
                    "bad local header signature; {}",
                    miniz("invalid header or archive is corrupted")
                ),
            ));
        }
        let start =
            entry.header + LOCAL_HEADER_LEN + u64::from(le16(&h, 26)) + u64::from(le16(&h, 28));
        let len = self.src.len();
        if start.checked_add(entry.size).is_none_or(|end| end > len) {
            return Err(self.err(
                Some(name),
                entry.header + 26,
                format!(
                    "the local header's name and extra lengths put the data at byte {start}, \
                     and its {} bytes do not fit in the file ({len} bytes); {}",
                    entry.size,
                    miniz("invalid header or archive is corrupted")
                ),
            ));
        }
        Ok(start)
    }

    /// The entry `name` as PyTorch extracts it, with miniz's checks but not its CRC-32: for
    /// records PyTorch reads whose content this crate does not need.
    pub(crate) fn extract_as_pytorch(&mut self, name: &str) -> Result<Option<Extracted>> {
        let Some(entry) = self.entry(name).cloned() else {
            return Ok(None);
        };
        if entry.size > 0 && entry.directory {
            return Ok(Some(Extracted::Unfilled));
        }
        let start = self.data_start(&entry)?;
        let mut buf = vec![0u8; entry.size as usize];
        self.read(start, &mut buf, Some(&entry.name))?;
        Ok(Some(Extracted::Data(buf)))
    }

    /// Reads `buf.len()` bytes at `offset` of the source, part of `entry`'s data (for
    /// messages): a reader of an entry in chunks, which checks the CRC-32 of the whole with
    /// [`ZipReader::check_crc`].
    /// Advice that bytes `offset..offset + len` of the archive will be read soon.
    pub(crate) fn will_need(&self, offset: u64, len: u64) {
        self.src.will_need(offset, len);
    }

    pub(crate) fn read_part(&mut self, entry: &Entry, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read(offset, buf, Some(entry.name.as_str()))
    }

    /// Checks that `crc` (of the data starting at `start`) is `entry`'s stored CRC-32.
    pub(crate) fn check_crc(&self, entry: &Entry, start: u64, crc: u32) -> Result<()> {
        if crc != entry.crc {
            return Err(self.err(
                Some(entry.name.as_str()),
                start,
                format!(
                    "CRC-32 mismatch: stored {:08x}, computed {crc:08x}",
                    entry.crc
                ),
            ));
        }
        Ok(())
    }

    /// Reads an entry's data.
    pub(crate) fn read_entry(&mut self, name: &str) -> Result<Option<Vec<u8>>> {
        let Some(entry) = self.entry(name).cloned() else {
            return Ok(None);
        };
        if entry.size > self.src.len() {
            return Err(self.err(
                Some(&entry.name),
                entry.header,
                format!(
                    "entry size {} exceeds the file size {}",
                    entry.size,
                    self.src.len()
                ),
            ));
        }
        let mut buf = vec![0u8; entry.size as usize];
        self.read_entry_into(&entry, &mut buf)?;
        Ok(Some(buf))
    }

    /// The file name used in error messages.
    pub(crate) fn file(&self) -> &str {
        &self.file
    }

    /// Total length of the archive in bytes.
    pub(crate) fn source_len(&self) -> u64 {
        self.src.len()
    }
}

/// A [`Write`] at a position of a file that can also step over bytes written by someone else
/// (another process of a job), or of no file at all: planning where everything goes.
pub(crate) struct Positioned<'f> {
    file: Option<&'f std::fs::File>,
    pos: u64,
    /// Hands what is written to the disk as it goes and drops it from the page cache.
    writeback: Option<&'f mut crate::storage::Writeback>,
}

impl<'f> Positioned<'f> {
    /// Writes into `file` from its start.
    pub(crate) fn into_file(file: &'f std::fs::File) -> Self {
        Positioned {
            file: Some(file),
            pos: 0,
            writeback: None,
        }
    }

    /// Writes into `file` from byte `offset` on, with write-back and drop-behind through
    /// `writeback` ([`crate::storage::Writeback`], which one writer keeps across the ranges
    /// it writes): for data that is not read again.
    pub(crate) fn streaming_into(
        file: &'f std::fs::File,
        offset: u64,
        writeback: &'f mut crate::storage::Writeback,
    ) -> Self {
        Positioned {
            file: Some(file),
            pos: offset,
            writeback: Some(writeback),
        }
    }

    /// Writes nowhere: only counts.
    pub(crate) fn nowhere() -> Self {
        Positioned {
            file: None,
            pos: 0,
            writeback: None,
        }
    }

    /// Where the next byte goes.
    pub(crate) fn position(&self) -> u64 {
        self.pos
    }
}

impl Write for Positioned<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(f) = self.file {
            std::os::unix::fs::FileExt::write_all_at(f, buf, self.pos)?;
            if let Some(wb) = self.writeback.as_mut() {
                wb.wrote_at(f, self.pos, buf.len() as u64)?;
            }
        }
        self.pos += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ZipWriter<Positioned<'_>> {
    /// Data of the entry in progress that is not written here: `len` bytes, which another
    /// writer puts at [`ZipWriter::position`].
    pub(crate) fn skip_data(&mut self, len: u64) -> std::io::Result<()> {
        if self.open.is_none() {
            return Err(std::io::Error::other("zip entry data outside an entry"));
        }
        self.out.pos += len;
        self.pos += len;
        Ok(())
    }
}

/// Writes a stored-only, aligned zip archive entry by entry.
pub(crate) struct ZipWriter<W: Write> {
    out: W,
    pos: u64,
    central: Vec<(String, u32, u64, u64)>,
    /// The entry being written: (name, header offset, data offset).
    open: Option<(String, u64, u64)>,
}

impl<W: Write> ZipWriter<W> {
    pub(crate) fn new(out: W) -> Self {
        ZipWriter {
            out,
            pos: 0,
            central: Vec::new(),
            open: None,
        }
    }

    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    /// Writes one entry whose data is the concatenation of `parts`.
    pub(crate) fn entry(&mut self, name: &str, parts: &[&[u8]]) -> std::io::Result<()> {
        let mut hasher = crc32fast::Hasher::new();
        for p in parts {
            hasher.update(p);
        }
        self.entry_with_crc(name, parts, hasher.finalize())
    }

    /// [`ZipWriter::entry`] for a caller that has computed the CRC-32 of the data already.
    pub(crate) fn entry_with_crc(
        &mut self,
        name: &str,
        parts: &[&[u8]],
        crc: u32,
    ) -> std::io::Result<()> {
        self.begin_entry(name)?;
        for p in parts {
            self.data(p)?;
        }
        self.end_entry(crc)
    }

    /// Starts an entry whose data follows in [`ZipWriter::data`] calls and which
    /// [`ZipWriter::end_entry`] closes (sizes and CRC go in the data descriptor, so nothing
    /// needs to be known up front).
    pub(crate) fn begin_entry(&mut self, name: &str) -> std::io::Result<()> {
        let header = self.pos;
        let nlen = name.len() as u64;
        let unpadded = header + LOCAL_HEADER_LEN + nlen + 4;
        let pad = (ALIGNMENT - unpadded % ALIGNMENT) % ALIGNMENT;
        let mut h = Vec::with_capacity(64 + name.len());
        h.extend_from_slice(&LOCAL_SIG.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // version needed
        h.extend_from_slice(&FLAGS.to_le_bytes());
        h.extend_from_slice(&[0u8; 18]); // method, time, date, crc, sizes (in the descriptor)
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&((4 + pad) as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        h.extend_from_slice(b"FB");
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad as usize, b'Z');
        self.put(&h)?;
        self.open = Some((name.to_string(), header, self.pos));
        Ok(())
    }

    /// Where the next byte goes: after [`ZipWriter::begin_entry`], where the entry's data
    /// starts.
    pub(crate) fn position(&self) -> u64 {
        self.pos
    }

    /// Data of the entry [`ZipWriter::begin_entry`] started.
    pub(crate) fn data(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.open.is_none() {
            return Err(std::io::Error::other("zip entry data outside an entry"));
        }
        self.put(bytes)
    }

    /// Closes the entry in progress, whose data has CRC-32 `crc`.
    pub(crate) fn end_entry(&mut self, crc: u32) -> std::io::Result<()> {
        let (name, header, data_start) = self
            .open
            .take()
            .ok_or_else(|| std::io::Error::other("no zip entry to end"))?;
        let size = self.pos - data_start;
        let mut d = Vec::with_capacity(24);
        d.extend_from_slice(&DESCRIPTOR_SIG.to_le_bytes());
        d.extend_from_slice(&crc.to_le_bytes());
        if size >= 0xffff_ffff {
            d.extend_from_slice(&size.to_le_bytes());
            d.extend_from_slice(&size.to_le_bytes());
        } else {
            d.extend_from_slice(&(size as u32).to_le_bytes());
            d.extend_from_slice(&(size as u32).to_le_bytes());
        }
        self.put(&d)?;
        self.central.push((name, crc, size, header));
        Ok(())
    }

    /// Writes the central directory and end records; returns the writer.
    pub(crate) fn finish(mut self) -> std::io::Result<W> {
        let cd_offset = self.pos;
        let central = std::mem::take(&mut self.central);
        for (name, crc, size, header) in &central {
            let mut zip64 = Vec::new();
            let size32 = if *size >= 0xffff_ffff {
                zip64.extend_from_slice(&size.to_le_bytes());
                zip64.extend_from_slice(&size.to_le_bytes());
                0xffff_ffff
            } else {
                *size as u32
            };
            let header32 = if *header >= 0xffff_ffff {
                zip64.extend_from_slice(&header.to_le_bytes());
                0xffff_ffff
            } else {
                *header as u32
            };
            let mut extra = Vec::new();
            if !zip64.is_empty() {
                extra.extend_from_slice(&1u16.to_le_bytes());
                extra.extend_from_slice(&(zip64.len() as u16).to_le_bytes());
                extra.extend_from_slice(&zip64);
            }
            let mut h = Vec::with_capacity(CENTRAL_HEADER_LEN + name.len() + extra.len());
            h.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // made by
            let needed: u16 = if extra.is_empty() { 0 } else { 45 };
            h.extend_from_slice(&needed.to_le_bytes());
            h.extend_from_slice(&FLAGS.to_le_bytes());
            h.extend_from_slice(&[0u8; 6]); // method, time, date
            h.extend_from_slice(&crc.to_le_bytes());
            h.extend_from_slice(&size32.to_le_bytes());
            h.extend_from_slice(&size32.to_le_bytes());
            h.extend_from_slice(&(name.len() as u16).to_le_bytes());
            h.extend_from_slice(&(extra.len() as u16).to_le_bytes());
            h.extend_from_slice(&[0u8; 10]); // comment len, disk, attributes
            h.extend_from_slice(&header32.to_le_bytes());
            h.extend_from_slice(name.as_bytes());
            h.extend_from_slice(&extra);
            self.put(&h)?;
        }
        let cd_size = self.pos - cd_offset;
        let n = central.len() as u64;
        let rec_pos = self.pos;
        let mut e = Vec::with_capacity(56 + 20 + 22);
        e.extend_from_slice(&ZIP64_EOCD_SIG.to_le_bytes());
        e.extend_from_slice(&44u64.to_le_bytes());
        e.extend_from_slice(&0x031eu16.to_le_bytes());
        e.extend_from_slice(&45u16.to_le_bytes());
        e.extend_from_slice(&[0u8; 8]); // disk numbers
        e.extend_from_slice(&n.to_le_bytes());
        e.extend_from_slice(&n.to_le_bytes());
        e.extend_from_slice(&cd_size.to_le_bytes());
        e.extend_from_slice(&cd_offset.to_le_bytes());
        e.extend_from_slice(&ZIP64_LOCATOR_SIG.to_le_bytes());
        e.extend_from_slice(&0u32.to_le_bytes());
        e.extend_from_slice(&rec_pos.to_le_bytes());
        e.extend_from_slice(&1u32.to_le_bytes());
        e.extend_from_slice(&EOCD_SIG.to_le_bytes());
        e.extend_from_slice(&[0u8; 4]);
        let n16 = n.min(0xffff) as u16;
        e.extend_from_slice(&n16.to_le_bytes());
        e.extend_from_slice(&n16.to_le_bytes());
        e.extend_from_slice(&(cd_size.min(0xffff_ffff) as u32).to_le_bytes());
        e.extend_from_slice(&(cd_offset.min(0xffff_ffff) as u32).to_le_bytes());
        e.extend_from_slice(&0u16.to_le_bytes());
        self.put(&e)?;
        self.out.flush()?;
        Ok(self.out)
    }
}
