//! Bounded reads of small metadata files: regular files only, never blocking on a FIFO or
//! reading a device forever.

use super::file_kind;
use crate::error::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The largest commit marker, marker file or JSON description (`DESC.json`, a policy) read.
pub const SMALL_METADATA_MAX_BYTES: u64 = 64 << 20;

/// Why a metadata file could not be read.
#[derive(Debug)]
pub enum ReadRegularError {
    /// The operating system's error (missing file, permissions, …).
    Io(std::io::Error),
    /// The path is a FIFO, device, directory or socket.
    NotRegular(&'static str),
    /// The file is longer than the cap.
    TooLarge {
        /// The cap in bytes.
        cap: u64,
    },
}

impl std::fmt::Display for ReadRegularError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadRegularError::Io(e) => write!(f, "{e}"),
            ReadRegularError::NotRegular(kind) => write!(f, "it is a {kind}, not a regular file"),
            ReadRegularError::TooLarge { cap } => {
                write!(f, "it is larger than the {cap}-byte limit for this file")
            }
        }
    }
}

impl From<ReadRegularError> for std::io::Error {
    fn from(e: ReadRegularError) -> Self {
        match e {
            ReadRegularError::Io(e) => e,
            ReadRegularError::NotRegular(_) => {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
            }
            ReadRegularError::TooLarge { .. } => {
                std::io::Error::new(std::io::ErrorKind::FileTooLarge, e.to_string())
            }
        }
    }
}

/// Opens `path` for reading without blocking (`O_NONBLOCK`, so a FIFO does not wait for a
/// writer) and checks that what was opened is a regular file (not a FIFO or a device such as
/// `/dev/zero`, which would be read forever).
pub(crate) fn open_regular(path: &Path) -> std::result::Result<File, ReadRegularError> {
    open_regular_with(path, 0)
}

/// [`open_regular`] with more `open` flags (`O_DIRECT`), Unix only (ignored elsewhere).
pub(crate) fn open_regular_with(
    path: &Path,
    #[cfg_attr(not(unix), allow(unused_variables))] flags: i32,
) -> std::result::Result<File, ReadRegularError> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK | flags);
    }
    let f = opts.open(path).map_err(ReadRegularError::Io)?;
    let meta = f.metadata().map_err(ReadRegularError::Io)?;
    if !meta.is_file() {
        return Err(ReadRegularError::NotRegular(file_kind(&meta.file_type())));
    }
    Ok(f)
}

/// Reads the whole regular file `path`, refusing a FIFO, a device or a file over `cap` bytes.
pub fn read_regular(path: &Path, cap: u64) -> std::result::Result<Vec<u8>, ReadRegularError> {
    let f = open_regular(path)?;
    let mut bytes = Vec::new();
    f.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(ReadRegularError::Io)?;
    if bytes.len() as u64 > cap {
        return Err(ReadRegularError::TooLarge { cap });
    }
    Ok(bytes)
}

/// [`read_regular`] for a small metadata file, as [`Error::Io`] naming `path`.
pub fn read_small_file(path: &Path) -> Result<Vec<u8>> {
    read_regular(path, SMALL_METADATA_MAX_BYTES).map_err(|e| Error::io("reading", path)(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_a_fifo_or_a_device_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        assert!(matches!(
            read_regular(&fifo, 10),
            Err(ReadRegularError::NotRegular("FIFO"))
        ));
        let zero = d.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert!(matches!(
            read_regular(&zero, 10),
            Err(ReadRegularError::NotRegular("character device"))
        ));
        let big = d.path().join("big");
        std::fs::write(&big, [0u8; 11]).unwrap();
        assert!(matches!(
            read_regular(&big, 10),
            Err(ReadRegularError::TooLarge { cap: 10 })
        ));
    }
}
