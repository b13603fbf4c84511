//! The crate's own sharded checkpoint format: one data file per rank plus a manifest,
//! committed atomically, loadable at any world size and wrapping, verified by checksums.
//!
//! A checkpoint is a directory:
//! - `rank{r}.safetensors`: rank `r`'s tensor state as standard safetensors, one 1-D tensor
//!   per *piece* — a contiguous element range of one parameter's tensor state
//!   (`{param}/{state}/{first element}`). Padding is never stored, so the pieces are
//!   independent of the wrapping that produced them.
//! - `manifest.json` ([`Manifest`]): format and version, model description, wrapping policy,
//!   world size, key type, param groups, scalar and user-defined state, and for every tensor
//!   state its dtype, shape and pieces (file, element range, byte offset, CRC-32C per 4 MiB
//!   block).
//! - `COMMITTED`: written last; holds the manifest's checksum. A directory without it is not a
//!   checkpoint.
//!
//! Writing goes to a temporary sibling directory; every file and the directory are synced,
//! then the directory replaces the old checkpoint in one atomic exchange (`renameat2` with
//! `RENAME_EXCHANGE` on Linux). A crash at any point leaves either the old or the new
//! checkpoint at the path, never a mixture. Loading reads only the byte ranges that overlap the
//! loading rank's shards and verifies each block it reads.

mod background;
mod container;
mod load;
mod manifest;
mod prefetch;
mod reshard;
mod save;
mod stream;

pub use background::{BackgroundSaver, SaveMode};
pub use load::{load, load_full, load_model_params, verify, LoadOptions};
pub use manifest::{
    block_checksums, read_manifest, FileRecord, Manifest, ParamRecord, Piece, StoredValue,
    CHECKSUM_BLOCK, COMMIT, FORMAT, MANIFEST, MODEL_PARAM_STATE, VERSION,
};
pub use reshard::reshard;
pub use save::{save, CrashPoint, SaveOptions};
pub use stream::consolidate_to_safetensors;

use crate::error::{Error, Result};
use std::path::Path;

/// Maps an I/O error on `path` while doing `op` to [`Error::Io`].
pub(crate) fn fs_err(op: &str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let op = op.to_string();
    let path = path.display().to_string();
    move |e| Error::Io {
        op,
        path,
        reason: e.to_string(),
    }
}

/// Makes a directory's entries (creations, renames) durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let d = std::fs::File::open(dir).map_err(fs_err("opening", dir))?;
        d.sync_all().map_err(fs_err("syncing", dir))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Puts the complete checkpoint `tmp` at `dir`: a rename when `dir` does not exist, else an
/// atomic exchange of the two directories followed by removing the old one (now at `tmp`).
fn install(tmp: &Path, dir: &Path) -> Result<()> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    if !dir.exists() {
        std::fs::rename(tmp, dir).map_err(fs_err("renaming into place", dir))?;
        return sync_dir(&parent);
    }
    exchange(tmp, dir)?;
    sync_dir(&parent)?;
    // `tmp` now holds the previous checkpoint.
    std::fs::remove_dir_all(tmp).map_err(fs_err("removing the previous checkpoint at", tmp))
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| Error::Io {
            op: "renaming".into(),
            path: p.display().to_string(),
            reason: "the path contains a NUL byte".into(),
        })
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: both are valid NUL-terminated paths; renameat2 only reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc != 0 {
        return Err(fs_err("exchanging the new checkpoint with", b)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Without an atomic exchange: move the old directory aside, then the new one in. A crash
/// between the two renames leaves the old checkpoint complete at the aside path.
#[cfg(not(target_os = "linux"))]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    let aside = a.with_extension("old");
    std::fs::rename(b, &aside).map_err(fs_err("moving aside", b))?;
    std::fs::rename(a, b).map_err(fs_err("renaming into place", b))?;
    std::fs::rename(&aside, a).map_err(fs_err("renaming", &aside))
}
