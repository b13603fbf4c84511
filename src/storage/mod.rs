//! Storage (layer 1, below every format): the one place that opens, creates, syncs, renames
//! and cleans up the files a command reads or writes — a local-disk backend today, the seam a
//! later object-storage backend plugs into. [`crate::io`] holds the formats and moves their
//! bytes through here.
//!
//! Safe outputs: which existing paths a writer may replace, how a finished output is
//! installed, how stale temporaries of killed runs are cleaned, and the one rule for every
//! file a reader opens (regular files only, symbolic links followed, names inside a
//! checkpoint checked: `read`); data files can be read past the page cache (`O_DIRECT`, with
//! a fallback, in `direct`).
//!
//! Every writer of a directory (a checkpoint save or reshard, `shard-torch`) follows one
//! rule, [`check_dir_output`]: the output path may be replaced only if it is missing, an
//! empty directory, or an earlier output of the same kind ([`DirKind`]) holding nothing else;
//! never a directory that contains an input or any other file. A finished output is written
//! into a temporary sibling, synced, then installed by [`install_dir`]: one
//! `renameat2(RENAME_EXCHANGE)` swap, or — where the file system does not support it (NFS,
//! Lustre: `EINVAL`) — the fallback described there, which never exposes a half-written
//! directory. The previous output is removed entry by entry (only the entries it is known to
//! hold), never with a recursive delete.
//!
//! Temporaries are hidden siblings named after the output and the writing process:
//! `.NAME.tmp-PID-NANOS/` and `.NAME.old-PID-NANOS/` (directories), `.NAME.PID.N.tmp`
//! (files). A process killed while writing leaves them behind; [`clean_stale_temporaries`]
//! removes those whose process is no longer alive on this host before a new write to the same
//! output, and restores a previous output the fallback had moved aside.
//!
//! This layer knows no checkpoint format: a writer passes its [`DirKind`], which recognises
//! an earlier output of its kind (`crate::checkpoint::CHECKPOINT_DIR` for checkpoints; the
//! tool's `shard-torch` defines its own).

mod direct;
mod install;
mod read;
mod replace;
mod temp;
mod writeback;

pub(crate) use direct::{direct_io_default, Bounce, DataFile};
#[cfg(feature = "fault-injection")]
#[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
pub use direct::{direct_reads, force_direct_io, refuse_direct_io};
#[cfg(feature = "fault-injection")]
#[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
pub use install::force_rename_fallback;
pub(crate) use install::{
    create_planned_file, finish_planned_file, tmp_io_err, write_file_atomic, writer_of,
};
pub use install::{install_dir, write_synced};
pub(crate) use read::{check_dir, open_regular, regular_len, stat};
pub use read::{
    check_name, read_regular, read_small_file, NameForm, ReadRegularError, SMALL_METADATA_MAX_BYTES,
};
pub use replace::{check_dir_output, check_file_output, check_not_overlapping, DirKind, EMPTY_DIR};
pub use temp::{clean_stale_temporaries, discard_tmp_dir, make_tmp_dir, Cleaned};
pub(crate) use writeback::{
    drop_cached_pages, will_need_pages, DropBehind, StreamedFile, Writeback, WRITEBACK_CHUNK,
};

use crate::error::{Error, Result};
use std::fs::File;
use std::path::{Path, PathBuf};

/// A writer's refusal of the output `path`.
fn refused(path: &Path, reason: String) -> Error {
    Error::OutputRefused {
        path: path.display().to_string(),
        reason,
    }
}

/// What kind of file `t` is, for messages (`FIFO`, `character device`, `directory`, …).
pub(crate) fn file_kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "FIFO";
        }
        if t.is_char_device() {
            return "character device";
        }
        if t.is_block_device() {
            return "block device";
        }
        if t.is_socket() {
            return "socket";
        }
    }
    if t.is_dir() {
        "directory"
    } else if t.is_symlink() {
        "symbolic link"
    } else if t.is_file() {
        "regular file"
    } else {
        "special file"
    }
}

/// The directory holding `out` (`.` for a bare name) and `out`'s file name.
fn split(out: &Path) -> Result<(PathBuf, String)> {
    let name = out
        .file_name()
        .ok_or_else(|| {
            Error::io("writing", out)(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the path has no file or directory name",
            ))
        })?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Makes a directory's entries (creations, renames) durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let d = File::open(dir).map_err(Error::io("opening", dir))?;
        d.sync_all().map_err(Error::io("syncing", dir))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}
