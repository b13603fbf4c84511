//! Reads that bypass the page cache: `O_DIRECT` on Linux, through an aligned bounce buffer so
//! that any byte range of a file can be read (the crate's checkpoint pieces are not aligned),
//! with a silent fallback to ordinary reads for a file whose file system refuses `O_DIRECT`
//! (`EINVAL` at `open` or at the first read: some FUSE and overlay mounts, tmpfs before Linux
//! 6.6). Other systems always read through the page cache.
//!
//! Whether readers use it by default: [`direct_io_default`] (`FSDP_DIRECT_IO`).

use super::read::{open_regular, open_regular_with, ReadRegularError};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Alignment of a direct read's file offset, length and memory: 4096 bytes covers the logical
/// block sizes in use (512 and 4096).
pub(crate) const ALIGN: usize = 4096;

/// The bounce buffer's size, the largest single direct read: a 4 MiB checksum block at any
/// offset, rounded out to [`ALIGN`] (one read per block).
pub(crate) const BOUNCE: usize = (4 << 20) + ALIGN;

/// Whether readers bypass the page cache unless told otherwise: `FSDP_DIRECT_IO=1` yes,
/// `FSDP_DIRECT_IO=0` no, unset (or anything else) the crate's default, no (BENCHMARKS.md,
/// "Direct reads"). With the feature `fault-injection`, [`force_direct_io`] decides first for
/// its thread.
pub(crate) fn direct_io_default() -> bool {
    #[cfg(feature = "fault-injection")]
    if let Some(on) = hooks::FORCED.with(|f| f.get()) {
        return on;
    }
    match std::env::var("FSDP_DIRECT_IO").as_deref().map(str::trim) {
        Ok("1") => true,
        Ok("0") => false,
        _ => DIRECT_BY_DEFAULT,
    }
}

/// The crate's default read mode: through the page cache (measured, BENCHMARKS.md).
const DIRECT_BY_DEFAULT: bool = false;

/// One aligned read serving the start of a wanted byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AlignedRead {
    /// File offset of the read: the wanted start rounded down to [`ALIGN`].
    pub(crate) offset: u64,
    /// Bytes to read: a multiple of [`ALIGN`], at most [`BOUNCE`].
    pub(crate) len: usize,
    /// Where the wanted bytes start in what is read.
    pub(crate) skip: usize,
    /// How many wanted bytes the read yields (from `skip`).
    pub(crate) take: usize,
}

/// The aligned read serving the first wanted bytes of `[at, at + len)` (`len > 0`): as many as
/// fit in [`BOUNCE`], so that the next read starts aligned.
pub(crate) fn aligned_read(at: u64, len: usize) -> AlignedRead {
    let align = ALIGN as u64;
    let offset = at / align * align;
    // Below ALIGN, so it fits.
    let skip = (at - offset) as usize;
    let take = len.min(BOUNCE - skip);
    AlignedRead {
        offset,
        len: (skip + take).next_multiple_of(ALIGN),
        skip,
        take,
    }
}

/// A [`BOUNCE`]-byte buffer aligned to [`ALIGN`], allocated at first use (an over-allocated
/// vector, aligned inside).
#[derive(Default)]
pub(crate) struct Bounce {
    raw: Vec<u8>,
}

impl Bounce {
    /// The first `len` (at most [`BOUNCE`]) aligned bytes.
    fn get(&mut self, len: usize) -> io::Result<&mut [u8]> {
        if self.raw.is_empty() {
            self.raw = vec![0; BOUNCE + ALIGN];
        }
        let skip = self.raw.as_ptr().align_offset(ALIGN);
        // `align_offset` may in principle decline (`usize::MAX`): read through the page
        // cache then, as on a file system that refuses direct reads.
        skip.checked_add(len)
            .and_then(|end| self.raw.get_mut(skip..end))
            .ok_or_else(refusal)
    }
}

/// The error a file system refusing `O_DIRECT` gives (`EINVAL`).
fn refusal() -> io::Error {
    io::Error::from_raw_os_error(EINVAL)
}

/// Whether `e` is a file system's refusal of `O_DIRECT`.
fn refused(e: &io::Error) -> bool {
    e.raw_os_error() == Some(EINVAL)
}

#[cfg(target_os = "linux")]
const EINVAL: i32 = libc::EINVAL;
/// Unused off Linux (no direct reads there).
#[cfg(not(target_os = "linux"))]
const EINVAL: i32 = 22;

/// How a [`DataFile`] is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Through the page cache.
    Buffered,
    /// `O_DIRECT`; `proven` once a read succeeded (a refusal after that is an error).
    Direct { proven: bool },
}

/// A data file opened for reading, directly (bypassing the page cache) when asked and the file
/// system allows it, through the page cache otherwise.
pub(crate) struct DataFile {
    file: File,
    path: PathBuf,
    mode: Mode,
}

impl DataFile {
    /// Opens the regular file `path` ([`open_regular`]), with `O_DIRECT` when `direct` and the
    /// file system accepts it.
    pub(crate) fn open(path: &Path, direct: bool) -> Result<DataFile, ReadRegularError> {
        let buffered = |file| DataFile {
            file,
            path: path.to_path_buf(),
            mode: Mode::Buffered,
        };
        if !direct || !cfg!(target_os = "linux") {
            return open_regular(path).map(buffered);
        }
        #[cfg(target_os = "linux")]
        {
            let opened = if hooks::refuses(hooks::AT_OPEN) {
                Err(ReadRegularError::Io(refusal()))
            } else {
                open_regular_with(path, libc::O_DIRECT)
            };
            match opened {
                Ok(file) => {
                    return Ok(DataFile {
                        file,
                        path: path.to_path_buf(),
                        mode: Mode::Direct { proven: false },
                    })
                }
                Err(ReadRegularError::Io(e)) if refused(&e) => {}
                Err(e) => return Err(e),
            }
        }
        open_regular(path).map(buffered)
    }

    /// The open file (for its length and page-cache advice).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Whether reads bypass the page cache.
    pub(crate) fn is_direct(&self) -> bool {
        matches!(self.mode, Mode::Direct { .. })
    }

    /// Fills `buf` from byte `at` (as [`FileExt::read_exact_at`]); a direct file reads the
    /// aligned ranges around it through `bounce`. A refusal of the first direct read reopens
    /// the file for ordinary reads, silently.
    pub(crate) fn read_exact_at(
        &mut self,
        buf: &mut [u8],
        at: u64,
        bounce: &mut Bounce,
    ) -> io::Result<()> {
        if let Mode::Direct { proven } = self.mode {
            let read = if !proven && hooks::refuses(hooks::AT_READ) {
                Err(refusal())
            } else {
                read_direct(&self.file, buf, at, bounce)
            };
            match read {
                Ok(()) => {
                    self.mode = Mode::Direct { proven: true };
                    hooks::count_read();
                    return Ok(());
                }
                Err(e) if !proven && refused(&e) => {
                    self.file = open_regular(&self.path)?;
                    self.mode = Mode::Buffered;
                }
                Err(e) => return Err(e),
            }
        }
        self.file.read_exact_at(buf, at)
    }
}

/// Fills `buf` from byte `at` of the `O_DIRECT` file `file`, one [`aligned_read`] into
/// `bounce` at a time.
fn read_direct(file: &File, buf: &mut [u8], at: u64, bounce: &mut Bounce) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let r = aligned_read(at + done as u64, buf.len() - done);
        let space = bounce.get(r.len)?;
        let got = read_aligned(file, space, r.offset)?;
        if got < r.skip + r.take {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ends at byte {}, before byte {}",
                    r.offset + got as u64,
                    r.offset + (r.skip + r.take) as u64
                ),
            ));
        }
        buf[done..done + r.take].copy_from_slice(&space[r.skip..r.skip + r.take]);
        done += r.take;
    }
    Ok(())
}

/// Reads `space` (aligned) from the aligned offset `offset`; returns the bytes read, fewer at
/// the end of the file (a read ending off the alignment ends there: the next one could not
/// be aligned).
fn read_aligned(file: &File, space: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < space.len() {
        match file.read_at(&mut space[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if n % ALIGN != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Test switches (feature `fault-injection`), per thread: the readers a test thread runs see
/// only its settings.
#[cfg(feature = "fault-injection")]
mod hooks {
    use std::cell::Cell;

    pub(super) const AT_OPEN: u8 = 1;
    pub(super) const AT_READ: u8 = 2;

    thread_local! {
        pub(super) static FORCED: Cell<Option<bool>> = const { Cell::new(None) };
        static REFUSED: Cell<u8> = const { Cell::new(0) };
        static READS: Cell<u64> = const { Cell::new(0) };
    }

    pub(super) fn refuses(at: u8) -> bool {
        REFUSED.with(|r| r.get() & at != 0)
    }

    pub(super) fn count_read() {
        READS.with(|r| r.set(r.get() + 1));
    }

    /// Test switch (feature `fault-injection`): the calling thread's readers of the crate's
    /// checkpoints (load, reshard, consolidation, verify) read with `O_DIRECT` (`Some(true)`),
    /// through the page cache (`Some(false)`), or as `FSDP_DIRECT_IO` says (`None`) unless
    /// their options choose.
    pub fn force_direct_io(on: Option<bool>) {
        FORCED.with(|f| f.set(on));
    }

    /// Test switch (feature `fault-injection`): for the calling thread, file systems refuse
    /// `O_DIRECT` with `EINVAL` at `open` (`at_open`) or at a file's first read
    /// (`at_first_read`), as some FUSE and overlay mounts do, so that the fallback to ordinary
    /// reads runs.
    pub fn refuse_direct_io(at_open: bool, at_first_read: bool) {
        REFUSED
            .with(|r| r.set((u8::from(at_open) * AT_OPEN) | (u8::from(at_first_read) * AT_READ)));
    }

    /// Test probe (feature `fault-injection`): how many reads the calling thread has made with
    /// `O_DIRECT` so far.
    pub fn direct_reads() -> u64 {
        READS.with(|r| r.get())
    }
}

#[cfg(not(feature = "fault-injection"))]
mod hooks {
    pub(super) const AT_OPEN: u8 = 1;
    pub(super) const AT_READ: u8 = 2;

    pub(super) fn refuses(_: u8) -> bool {
        false
    }

    pub(super) fn count_read() {}
}

#[cfg(feature = "fault-injection")]
pub use hooks::{direct_reads, force_direct_io, refuse_direct_io};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aligned_read_rounds_the_start_down_and_the_end_up_and_yields_the_wanted_bytes() {
        let a = ALIGN as u64;
        // Inside one block.
        assert_eq!(
            aligned_read(10, 20),
            AlignedRead {
                offset: 0,
                len: ALIGN,
                skip: 10,
                take: 20
            }
        );
        // Already aligned both ends: nothing extra.
        assert_eq!(
            aligned_read(3 * a, 2 * ALIGN),
            AlignedRead {
                offset: 3 * a,
                len: 2 * ALIGN,
                skip: 0,
                take: 2 * ALIGN
            }
        );
        // Straddling a block boundary: two blocks.
        assert_eq!(
            aligned_read(a - 1, 2),
            AlignedRead {
                offset: 0,
                len: 2 * ALIGN,
                skip: ALIGN - 1,
                take: 2
            }
        );
        // A 4 MiB checksum block at an odd offset: one read of 4 MiB + one block.
        let r = aligned_read(7 * a + 1234, 4 << 20);
        assert_eq!(
            (r.offset, r.skip, r.take, r.len),
            (7 * a, 1234, 4 << 20, BOUNCE)
        );
    }

    #[test]
    fn a_long_range_is_cut_into_bounce_sized_reads_the_later_ones_aligned() {
        // Walk a 10 MiB range from an odd offset as the reader does.
        let (start, len) = (5 * ALIGN as u64 + 77, 10 << 20);
        let mut at = start;
        let mut left = len;
        let mut reads = Vec::new();
        while left > 0 {
            let r = aligned_read(at, left);
            assert_eq!(r.offset % ALIGN as u64, 0);
            assert_eq!(r.len % ALIGN, 0);
            assert!(r.len <= BOUNCE && r.skip + r.take <= r.len && r.skip < ALIGN);
            assert_eq!(r.offset + r.skip as u64, at, "the wanted bytes follow on");
            reads.push(r);
            at += r.take as u64;
            left -= r.take;
        }
        assert_eq!(at, start + len as u64);
        // After the first read, every read starts aligned (no block read twice).
        assert!(reads[1..].iter().all(|r| r.skip == 0));
        assert_eq!(reads.len(), 3);
        for w in reads.windows(2) {
            assert_eq!(w[0].offset + w[0].len as u64, w[1].offset);
        }
    }

    /// A file of `len` bytes `i % 251` in a fresh directory.
    fn sample(len: usize) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        (dir, path, bytes)
    }

    /// Whether the file system of `path` lets it be opened with `O_DIRECT`.
    fn accepts_direct(path: &Path) -> bool {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .is_ok()
        }
        #[cfg(not(target_os = "linux"))]
        false
    }

    #[test]
    fn direct_reads_of_any_range_give_the_file_bytes_up_to_an_unaligned_end() {
        // Not a multiple of 4096: the last aligned read runs past the end.
        let len = BOUNCE + 3 * ALIGN + 123;
        let (_dir, path, bytes) = sample(len);
        let mut f = DataFile::open(&path, true).unwrap();
        let mut bounce = Bounce::default();
        for (at, n) in [
            (0, 1),
            (1, 4095),
            (4095, 2),
            (100, BOUNCE + 2),
            (len - 1, 1),
            (len - 5000, 5000),
            (0, len),
            (17, len - 17),
        ] {
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, at as u64, &mut bounce).unwrap();
            assert!(buf == bytes[at..at + n], "{n} bytes at {at}");
        }
        // Past the end: an error, as `read_exact_at` gives.
        let mut buf = vec![0u8; 10];
        let err = f
            .read_exact_at(&mut buf, (len - 5) as u64, &mut bounce)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(f.is_direct(), accepts_direct(&path));
    }

    #[cfg(feature = "fault-injection")]
    #[test]
    fn a_refused_direct_open_or_first_read_falls_back_to_the_page_cache() {
        let (_dir, path, bytes) = sample(10_000);
        for (open, read) in [(true, false), (false, true)] {
            refuse_direct_io(open, read);
            let before = direct_reads();
            let mut f = DataFile::open(&path, true).unwrap();
            let mut buf = vec![0u8; 5000];
            f.read_exact_at(&mut buf, 3000, &mut Bounce::default())
                .unwrap();
            assert!(buf == bytes[3000..8000]);
            assert!(!f.is_direct(), "refused at open {open}, at read {read}");
            assert_eq!(direct_reads(), before);
        }
        refuse_direct_io(false, false);
        let mut f = DataFile::open(&path, true).unwrap();
        let mut buf = vec![0u8; 5000];
        f.read_exact_at(&mut buf, 3000, &mut Bounce::default())
            .unwrap();
        assert_eq!(f.is_direct(), accepts_direct(&path));
    }

    #[test]
    fn a_missing_file_is_an_error_not_a_fallback() {
        let dir = tempfile::tempdir().unwrap();
        let Err(ReadRegularError::Io(e)) = DataFile::open(&dir.path().join("nope"), true) else {
            panic!("a missing file opened");
        };
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(matches!(
            DataFile::open(dir.path(), true),
            Err(ReadRegularError::NotRegular(_)) | Err(ReadRegularError::Io(_))
        ));
    }
}
