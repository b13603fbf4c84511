//! Page-cache writeback: outputs streamed to the disk as they grow and out of the page
//! cache (drop-behind), and readers that drop what they have read.

use std::fs::File;

/// How many written bytes [`Writeback`] lets pile up before it hands them to the disk.
pub(crate) const WRITEBACK_CHUNK: usize = 32 << 20;

/// Streams a file being written front to back to the disk as it grows, and out of the page
/// cache once it is there (drop-behind). Every [`WRITEBACK_CHUNK`] bytes it starts the
/// write-back of the new chunk (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not
/// wait), waits for the previous chunk's write-back to end, and drops that chunk's pages
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`).
///
/// Why: the disk works while the writer copies the next bytes, the final `fsync` finds little
/// left to do, and a multi-GB output no longer fills the page cache. Once memory is full of
/// cached pages, every new page must first be reclaimed, which cost a 1B-parameter
/// consolidation on the project's VM 18.3 s of system time instead of 4.0 s
/// (`cargo bench --bench scale`, BENCHMARKS.md). Durability still comes from the final
/// `sync_all`. A write-back error seen while waiting is returned (the wait consumes it, so a
/// later `fsync` would not report it).
pub(crate) struct Writeback {
    /// Offset of the first byte not yet handed to write-back.
    start: u64,
    /// Bytes written after `start`.
    pending: u64,
    /// The chunk handed to write-back last, not yet waited for: (offset, length).
    in_flight: Option<(u64, u64)>,
}

impl Writeback {
    /// Write-back tracking for a file whose next write lands at byte `offset`.
    pub(crate) fn new(offset: u64) -> Self {
        Writeback {
            start: offset,
            pending: 0,
            in_flight: None,
        }
    }

    /// Records `len` more bytes written to `file` right after the last ones; once
    /// [`WRITEBACK_CHUNK`] bytes have piled up, hands them to write-back.
    pub(crate) fn wrote(&mut self, file: &File, len: u64) -> std::io::Result<()> {
        self.pending += len;
        if self.pending >= WRITEBACK_CHUNK as u64 {
            self.hand_off(file)?;
        }
        Ok(())
    }

    /// [`Writeback::wrote`] for a writer that writes ranges anywhere in the file (a share of a
    /// planned file): a range that does not follow the last one hands the pending bytes to
    /// write-back first.
    pub(crate) fn wrote_at(&mut self, file: &File, offset: u64, len: u64) -> std::io::Result<()> {
        if offset != self.start + self.pending {
            self.hand_off(file)?;
            self.start = offset;
        }
        self.wrote(file, len)
    }

    /// Starts the write-back of the pending bytes, after waiting for the range handed off
    /// before them and dropping its pages.
    fn hand_off(&mut self, file: &File) -> std::io::Result<()> {
        if self.pending == 0 {
            return Ok(());
        }
        if let Some((offset, len)) = self.in_flight.take() {
            wait_writeback(file, offset, len)?;
            drop_cached_pages(file, offset, len);
        }
        start_writeback(file, self.start, self.pending);
        self.in_flight = Some((self.start, self.pending));
        self.start += self.pending;
        self.pending = 0;
        Ok(())
    }
}

/// A file written front to back, handed to the disk every 32 MiB and dropped from the page
/// cache once written (write-back and drop-behind): what the single-file writers
/// ([`write_file_atomic`], `torch.save` files) write through, under their `BufWriter`.
pub(crate) struct StreamedFile {
    file: File,
    writeback: Writeback,
}

impl StreamedFile {
    pub(crate) fn new(file: File) -> Self {
        StreamedFile {
            file,
            writeback: Writeback::new(0),
        }
    }

    /// The file, to sync it.
    pub(crate) fn into_file(self) -> File {
        self.file
    }
}

impl std::io::Write for StreamedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.writeback.wrote(&self.file, n as u64)?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Drop-behind for a reader that reads each byte once (see [`Writeback`] for why): it drops
/// the pages of what it has read from the page cache, run by run. A read that starts where
/// the reader's last read of that file ended (or less than a folio after it) extends the run;
/// pages are dropped from the run's first whole folio up to the last whole folio read, since
/// the page cache holds a file in naturally aligned folios of up to 2 MiB and
/// `POSIX_FADV_DONTNEED` skips a folio it covers in part. So pages another reader of the same
/// file is about to use (a reshard reads one source file for several outputs) are not
/// dropped, except at most a folio at the end of each run when the reader finishes.
#[derive(Debug, Default)]
pub(crate) struct DropBehind<K> {
    /// Per file, the current run of reads.
    runs: std::collections::HashMap<K, Run>,
}

/// A run of reads of one file: bytes `start..end` read, pages below `dropped` dropped.
#[derive(Debug, Clone, Copy)]
struct Run {
    start: u64,
    dropped: u64,
    end: u64,
}

/// The largest page-cache folio (a PMD-sized huge page).
const FOLIO: u64 = 2 << 20;

impl<K: std::hash::Hash + Eq> DropBehind<K> {
    /// Records that bytes `start..end` of `file` (known as `key`) were read, and drops what
    /// the reads of it have covered whole.
    pub(crate) fn read(&mut self, key: K, file: &File, start: u64, end: u64) {
        let fresh = Run {
            start,
            dropped: start.next_multiple_of(FOLIO),
            end,
        };
        let run = self.runs.entry(key).or_insert(fresh);
        if start < run.start || start >= run.end + FOLIO {
            // A jump: the old run keeps its partial folios, a new run begins.
            *run = fresh;
        }
        run.end = run.end.max(end);
        let upto = run.end / FOLIO * FOLIO;
        if upto > run.dropped {
            drop_cached_pages(file, run.dropped, upto - run.dropped);
            run.dropped = upto;
        }
    }

    /// The reader is done with `file` (`key`): drops the rest of its last run, the folio
    /// holding its end included.
    pub(crate) fn finish(&mut self, key: &K, file: &File) {
        if let Some(run) = self.runs.remove(key) {
            let upto = run.end.next_multiple_of(FOLIO);
            if upto > run.dropped {
                drop_cached_pages(file, run.dropped, upto - run.dropped);
            }
        }
    }
}

/// `offset` and `len` as the kernel's file offsets, when they fit.
#[cfg(target_os = "linux")]
fn file_range(offset: u64, len: u64) -> Option<(libc::off64_t, libc::off64_t)> {
    Some((offset.try_into().ok()?, len.try_into().ok()?))
}

/// Hands `len` bytes of `file` at `offset` to write-back without waiting (a hint; errors
/// surface at the wait or the final `fsync`).
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let Some((off, len)) = file_range(offset, len) else {
        return;
    };
    // SAFETY: a valid open descriptor; no memory is passed.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_: &File, _: u64, _: u64) {}

/// Waits until `len` bytes of `file` at `offset` are on the disk.
#[cfg(target_os = "linux")]
fn wait_writeback(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let Some((off, len)) = file_range(offset, len) else {
        return Ok(());
    };
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: a valid open descriptor; no memory is passed.
    if unsafe { libc::sync_file_range(file.as_raw_fd(), off, len, flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn wait_writeback(_: &File, _: u64, _: u64) -> std::io::Result<()> {
    Ok(())
}

/// Drops `len` bytes of `file` at `offset` from the page cache when they are clean (read, or
/// written back): a stream that reads or writes each byte once keeps the page cache, and the
/// reclaiming of it, out of its way. Advice only.
#[cfg(target_os = "linux")]
pub(crate) fn drop_cached_pages(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let Some((off, len)) = file_range(offset, len) else {
        return;
    };
    // SAFETY: a valid open descriptor; advice only.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED);
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn drop_cached_pages(_: &File, _: u64, _: u64) {}

/// Asks the kernel to start reading `len` bytes of `file` at `offset` into the page cache
/// (`POSIX_FADV_WILLNEED`), so that a reader's next reads find them there while it works on
/// the bytes it has: reading overlaps writing. Advice only.
#[cfg(target_os = "linux")]
pub(crate) fn will_need_pages(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let Some((off, len)) = file_range(offset, len) else {
        return;
    };
    // SAFETY: a valid open descriptor; advice only, no memory is passed.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), off, len, libc::POSIX_FADV_WILLNEED);
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn will_need_pages(_: &File, _: u64, _: u64) {}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writeback_hands_over_whole_chunks_and_retires_the_one_before() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(dir.path().join("f")).unwrap();
        let mut wb = Writeback::new(100);
        let chunk = WRITEBACK_CHUNK as u64;
        wb.wrote(&file, chunk - 1).unwrap();
        assert_eq!((wb.start, wb.pending, wb.in_flight), (100, chunk - 1, None));
        wb.wrote(&file, 2).unwrap();
        let first = Some((100, chunk + 1));
        assert_eq!(
            (wb.start, wb.pending, wb.in_flight),
            (100 + chunk + 1, 0, first)
        );
        wb.wrote(&file, 5).unwrap();
        assert_eq!(
            (wb.start, wb.pending, wb.in_flight),
            (100 + chunk + 1, 5, first)
        );
        // A range elsewhere (a planned file's next share) hands the 5 pending bytes over,
        // retiring the first chunk.
        wb.wrote_at(&file, 10 * chunk, 7).unwrap();
        let second = Some((100 + chunk + 1, 5));
        assert_eq!(
            (wb.start, wb.pending, wb.in_flight),
            (10 * chunk, 7, second)
        );
        wb.wrote_at(&file, 10 * chunk + 7, 1).unwrap();
        assert_eq!(
            (wb.start, wb.pending, wb.in_flight),
            (10 * chunk, 8, second)
        );
    }

    #[test]
    fn a_reader_drops_only_its_own_runs_of_reads_folio_aligned() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(dir.path().join("f")).unwrap();
        let mut db = DropBehind::default();
        const MIB: u64 = 1 << 20;
        db.read(0usize, &file, 3 * MIB, 5 * MIB);
        let run = |db: &DropBehind<usize>| {
            let r = db.runs[&0];
            (r.start, r.dropped, r.end)
        };
        // From the first whole folio (4 MiB) up to the last whole one read (4 MiB): nothing.
        assert_eq!(run(&db), (3 * MIB, 4 * MIB, 5 * MIB));
        db.read(0, &file, 5 * MIB, 9 * MIB);
        assert_eq!(run(&db), (3 * MIB, 8 * MIB, 9 * MIB));
        // Less than a folio after the run's end still continues it.
        db.read(0, &file, 10 * MIB, 11 * MIB);
        assert_eq!(run(&db), (3 * MIB, 10 * MIB, 11 * MIB));
        // A jump back (another part of the file) begins a new run.
        db.read(0, &file, MIB, 2 * MIB);
        assert_eq!(run(&db), (MIB, 2 * MIB, 2 * MIB));
        db.finish(&0, &file);
        assert!(db.runs.is_empty());
    }
}
