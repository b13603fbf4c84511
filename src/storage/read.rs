//! Reading inputs: the one rule for every file a reader opens.
//!
//! Every file a reader opens goes through [`open_regular`] (or [`read_regular`],
//! [`regular_len`], built on it): a top-level input, and every file inside a directory form —
//! DCP data files, `.metadata` and per-rank `__{rank}.metadata`, Hugging Face shards and
//! `model.safetensors.index.json`, DeepSpeed rank files, `latest` and a universal
//! checkpoint's `zero/<param>/*.pt`, this crate's `manifest.json`, `COMMITTED` and rank
//! files, a `--config` or rename file.
//!
//! - **Regular files only.** The file is opened without blocking (`O_NONBLOCK`: a FIFO does
//!   not wait for a writer) and must be a regular file. A FIFO, a device (`/dev/zero`, read
//!   forever), a socket or a directory is refused by what it is, before a byte is read.
//! - **Symbolic links are followed**, wherever they lead, as PyTorch and transformers follow
//!   them (a Hugging Face cache snapshot links every file into `../../blobs/`). The link must
//!   end at a regular file: a link to a FIFO, a device or a directory is refused as that, a
//!   loop as a "symbolic link loop", a dangling link as a "symbolic link to nothing". A
//!   DeepSpeed tag names a directory instead: [`check_dir`] applies the same rule to it.
//! - **Names written inside a checkpoint** (an index's `weight_map` file names, DCP
//!   `.metadata` `relative_path`s, DeepSpeed `latest`, the manifest's file names) are checked
//!   by [`check_name`] before they are joined to the directory: never empty, never a NUL
//!   byte, never absolute, never `.` or `..`; a plain name ([`NameForm::Plain`]) has no path
//!   separator either. A name cannot lead out of its directory; only a symbolic link the
//!   user's file system holds can.
//!
//! Small metadata files are read bounded ([`read_regular`]'s cap).

use super::file_kind;
use crate::error::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The largest commit marker, marker file or JSON description (`DESC.json`, a policy) read.
pub const SMALL_METADATA_MAX_BYTES: u64 = 64 << 20;

/// Why an input file could not be read.
#[derive(Debug)]
pub enum ReadRegularError {
    /// The operating system's error (missing file, permissions, …).
    Io(std::io::Error),
    /// The path is a FIFO, device, directory or socket, or a symbolic link loop or one to
    /// nothing (what it is), where a regular file was expected.
    NotRegular(&'static str),
    /// The path is not a directory (what it is), where a directory was expected.
    NotDirectory(&'static str),
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
            ReadRegularError::NotDirectory(kind) => write!(f, "it is a {kind}, not a directory"),
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
            ReadRegularError::NotRegular(_) | ReadRegularError::NotDirectory(_) => {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
            }
            ReadRegularError::TooLarge { .. } => {
                std::io::Error::new(std::io::ErrorKind::FileTooLarge, e.to_string())
            }
        }
    }
}

impl ReadRegularError {
    /// The crate's error for `path`: [`Error::NotRegularInput`] for what is not a regular
    /// file (or not a directory), [`Error::Io`] (`op`, e.g. "reading") otherwise.
    pub fn at(self, op: &str, path: &Path) -> Error {
        match self {
            ReadRegularError::NotRegular(found) => Error::NotRegularInput {
                path: path.display().to_string(),
                found: found.into(),
                expected: "regular file".into(),
            },
            ReadRegularError::NotDirectory(found) => Error::NotRegularInput {
                path: path.display().to_string(),
                found: found.into(),
                expected: "directory".into(),
            },
            other => Error::io(op, path)(other.into()),
        }
    }

    /// Whether the path is missing (and not a dangling symbolic link).
    pub fn is_missing(&self) -> bool {
        matches!(self, ReadRegularError::Io(e) if e.kind() == std::io::ErrorKind::NotFound)
    }
}

/// What a failed `open` or `stat` of `path` says: a symbolic link loop (`ELOOP`) and a link
/// to nothing are named as what they are; anything else is the operating system's error.
fn classify(path: &Path, e: std::io::Error) -> ReadRegularError {
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::ELOOP) {
        return ReadRegularError::NotRegular("symbolic link loop");
    }
    if e.kind() == std::io::ErrorKind::NotFound
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
    {
        return ReadRegularError::NotRegular("symbolic link to nothing");
    }
    ReadRegularError::Io(e)
}

/// Opens `path` for reading without blocking (`O_NONBLOCK`, so a FIFO does not wait for a
/// writer), following symbolic links, and checks that what was opened is a regular file (not
/// a FIFO or a device such as `/dev/zero`, which would be read forever, nor a directory): the
/// rule of [the module](self).
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
    let f = opts.open(path).map_err(|e| classify(path, e))?;
    let meta = f.metadata().map_err(ReadRegularError::Io)?;
    if !meta.is_file() {
        return Err(ReadRegularError::NotRegular(file_kind(&meta.file_type())));
    }
    Ok(f)
}

/// The length of the regular file `path` ([`open_regular`]'s rule).
pub(crate) fn regular_len(path: &Path) -> std::result::Result<u64, ReadRegularError> {
    let f = open_regular(path)?;
    Ok(f.metadata().map_err(ReadRegularError::Io)?.len())
}

/// What `path` is, following symbolic links: a loop or a link to nothing is named as what it
/// is ([`ReadRegularError::NotRegular`]).
pub(crate) fn stat(path: &Path) -> std::result::Result<std::fs::Metadata, ReadRegularError> {
    std::fs::metadata(path).map_err(|e| classify(path, e))
}

/// Checks that `path` is a directory, following symbolic links ([the module](self)'s rule
/// for a DeepSpeed tag).
pub(crate) fn check_dir(path: &Path) -> std::result::Result<(), ReadRegularError> {
    let meta = stat(path).map_err(|e| match e {
        ReadRegularError::NotRegular(kind) => ReadRegularError::NotDirectory(kind),
        other => other,
    })?;
    if meta.is_dir() {
        return Ok(());
    }
    Err(ReadRegularError::NotDirectory(file_kind(&meta.file_type())))
}

/// How a name written inside a checkpoint may name a file of its directory ([`check_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameForm {
    /// One path component: a file or directory right in the directory (a Hugging Face
    /// index's file names, a DeepSpeed tag, the manifest's file names).
    Plain,
    /// A relative path of plain components (a DCP `relative_path`).
    Relative,
}

/// Why `name`, written inside a checkpoint, may not name a file of its directory: empty, a
/// NUL byte, absolute, a `.` or `..` component, or (for [`NameForm::Plain`]) a path
/// separator. `None` when it may. The reason does not quote the name; the caller does.
pub fn check_name(name: &str, form: NameForm) -> Option<&'static str> {
    use std::path::Component;
    if name.is_empty() {
        return Some("it is empty");
    }
    if name.contains('\0') {
        return Some("it contains a NUL byte");
    }
    if name.starts_with('/') || name.starts_with('\\') {
        return Some("it is an absolute path");
    }
    if form == NameForm::Plain && (name.contains('/') || name.contains('\\')) {
        return Some("it is a path, not a plain name (it holds a path separator)");
    }
    let p = Path::new(name);
    if p.components().any(|c| c == Component::ParentDir) {
        return Some("it leads out of the directory (`..`)");
    }
    if name == "." || p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Some("it is not a file name (`.`)");
    }
    None
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

/// [`read_regular`] for a small metadata file, its error naming `path`
/// ([`ReadRegularError::at`]).
pub fn read_small_file(path: &Path) -> Result<Vec<u8>> {
    read_regular(path, SMALL_METADATA_MAX_BYTES).map_err(|e| e.at("reading", path))
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
        let dir = d.path().join("dir");
        std::fs::create_dir(&dir).unwrap();
        assert!(matches!(
            read_regular(&dir, 10),
            Err(ReadRegularError::NotRegular("directory"))
        ));
        let big = d.path().join("big");
        std::fs::write(&big, [0u8; 11]).unwrap();
        assert!(matches!(
            read_regular(&big, 10),
            Err(ReadRegularError::TooLarge { cap: 10 })
        ));
    }

    #[test]
    fn symbolic_links_are_followed_to_a_regular_file_and_loops_are_named() {
        let d = tempfile::tempdir().unwrap();
        let at = |n: &str| d.path().join(n);
        std::fs::create_dir(at("blobs")).unwrap();
        std::fs::write(at("blobs/abc"), b"data").unwrap();
        // As a Hugging Face cache snapshot links into `../../blobs/`: followed out of the
        // directory.
        std::fs::create_dir(at("snap")).unwrap();
        std::os::unix::fs::symlink("../blobs/abc", at("snap/model.safetensors")).unwrap();
        assert_eq!(
            read_regular(&at("snap/model.safetensors"), 10).unwrap(),
            b"data"
        );
        assert_eq!(regular_len(&at("snap/model.safetensors")).unwrap(), 4);
        std::os::unix::fs::symlink("loop_b", at("loop_a")).unwrap();
        std::os::unix::fs::symlink("loop_a", at("loop_b")).unwrap();
        assert!(matches!(
            open_regular(&at("loop_a")),
            Err(ReadRegularError::NotRegular("symbolic link loop"))
        ));
        std::os::unix::fs::symlink("nowhere", at("dangling")).unwrap();
        assert!(matches!(
            open_regular(&at("dangling")),
            Err(ReadRegularError::NotRegular("symbolic link to nothing"))
        ));
        let missing = open_regular(&at("missing")).unwrap_err();
        assert!(missing.is_missing(), "{missing}");
        std::os::unix::fs::symlink("blobs", at("tag")).unwrap();
        check_dir(&at("tag")).unwrap();
        assert!(matches!(
            check_dir(&at("blobs/abc")),
            Err(ReadRegularError::NotDirectory("regular file"))
        ));
        assert!(matches!(
            check_dir(&at("loop_a")),
            Err(ReadRegularError::NotDirectory("symbolic link loop"))
        ));
        let e = ReadRegularError::NotRegular("FIFO").at("reading", &at("x"));
        assert!(
            e.to_string().ends_with("x` is a FIFO, not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn names_written_inside_a_checkpoint_stay_in_its_directory() {
        use NameForm::{Plain, Relative};
        for ok in [
            "model-00001-of-00002.safetensors",
            "global_step3",
            "..x",
            "a..b",
        ] {
            assert_eq!(check_name(ok, Plain), None, "{ok}");
        }
        assert_eq!(check_name("sub/__0_0.distcp", Relative), None);
        for (bad, form, why) in [
            ("", Plain, "empty"),
            ("a\0b", Plain, "NUL"),
            ("/etc/passwd", Relative, "absolute"),
            ("/", Plain, "absolute"),
            ("../x", Relative, "`..`"),
            ("a/../../x", Relative, "`..`"),
            ("..", Plain, "`..`"),
            (".", Plain, "`.`"),
            ("./x", Relative, "`.`"),
            ("sub/x", Plain, "separator"),
            ("sub\\x", Plain, "separator"),
        ] {
            let got = check_name(bad, form).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(got.contains(why), "{bad:?}: {got}");
        }
    }
}
