//! Installing a finished output: the atomic swap of a directory (with its fallback), atomic
//! and planned files, synced writes.

use super::replace::{check_file_output, existing, DirKind, Existing};
use super::temp::{remove_known, tmp_file_path};
use super::writeback::StreamedFile;
use super::{nanos, refused, split, sync_dir};
use crate::error::{Error, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(feature = "fault-injection")]
static FORCE_FALLBACK: AtomicBool = AtomicBool::new(false);

/// Test switch (feature `fault-injection`): make [`install_dir`] use its fallback protocol
/// (as on a file system without `RENAME_EXCHANGE`). The environment variable
/// `FSDP_FORCE_RENAME_FALLBACK=1` does the same for a whole process, in builds with the
/// feature only.
#[cfg(feature = "fault-injection")]
pub fn force_rename_fallback(on: bool) {
    FORCE_FALLBACK.store(on, Ordering::SeqCst);
}

fn fallback_forced() -> bool {
    #[cfg(feature = "fault-injection")]
    return FORCE_FALLBACK.load(Ordering::SeqCst)
        || std::env::var_os("FSDP_FORCE_RENAME_FALLBACK").is_some_and(|v| v == "1");
    #[cfg(not(feature = "fault-injection"))]
    false
}

/// Puts the complete, synced directory `tmp` at `out`, following the replace rule of
/// [`check_dir_output`](super::check_dir_output) (checked again here, just before the swap).
///
/// - `out` missing or an empty directory: one `rename`.
/// - an earlier output of `kind`: `renameat2(RENAME_EXCHANGE)` swaps the two directories in
///   one step, then the old one (now at `tmp`) is removed entry by entry. Where the exchange
///   is unsupported (`EINVAL`, `ENOSYS`, `EOPNOTSUPP`: NFS, Lustre, FUSE, or forced by
///   the test switch `force_rename_fallback`), the old directory is renamed aside to `.NAME.old-PID-NANOS`,
///   the new one renamed to `out`, and the aside one removed. A reader then finds either the
///   old complete output, the new complete one, or — after a crash between the two renames —
///   nothing at `out`, never a mixture; the next write to `out` (or
///   [`clean_stale_temporaries`](super::clean_stale_temporaries)) moves the old checkpoint back.
pub fn install_dir(tmp: &Path, out: &Path, kind: DirKind) -> Result<()> {
    let (parent, name) = split(out)?;
    let old = existing(out, kind)?;
    let Existing::Replaceable(_) = old else {
        // Missing or empty: rename replaces an empty directory atomically.
        std::fs::rename(tmp, out).map_err(Error::io("renaming into place", out))?;
        return sync_dir(&parent);
    };
    let old_at = if fallback_forced() {
        swap_by_renames(tmp, out, &parent, &name)?
    } else {
        match exchange(tmp, out) {
            Ok(()) => tmp.to_path_buf(),
            Err(e) if exchange_unsupported(&e) => swap_by_renames(tmp, out, &parent, &name)?,
            Err(e) => return Err(Error::io("exchanging the new output with", out)(e)),
        }
    };
    sync_dir(&parent)?;
    remove_previous(&old_at, out, kind)
}

/// The fallback install: `out` aside, `tmp` into place. Returns where the old output is.
fn swap_by_renames(tmp: &Path, out: &Path, parent: &Path, name: &str) -> Result<PathBuf> {
    let aside = parent.join(format!(".{name}.old-{}-{}", std::process::id(), nanos()));
    std::fs::rename(out, &aside)
        .map_err(Error::io("moving the previous output aside from", out))?;
    if let Err(e) = std::fs::rename(tmp, out) {
        // Put the old one back; the new one stays at `tmp` for the caller to remove.
        let _ = std::fs::rename(&aside, out);
        return Err(Error::io("renaming into place", out)(e));
    }
    Ok(aside)
}

/// Removes the previous output now at `old_at`, entry by entry. If it gained entries it should
/// not hold (something wrote into it during the write), it is kept under a visible name and
/// the error says where.
fn remove_previous(old_at: &Path, out: &Path, kind: DirKind) -> Result<()> {
    let known = (kind.entries)(old_at).unwrap_or_default();
    let allowed = |n: &str| known.iter().any(|k| k == n);
    if remove_known(old_at, &allowed)? {
        return Ok(());
    }
    let (parent, name) = split(out)?;
    let kept = parent.join(format!(
        "{name}.replaced-{}-{}",
        std::process::id(),
        nanos()
    ));
    std::fs::rename(old_at, &kept).map_err(Error::io("keeping the previous output at", &kept))?;
    Err(refused(
        out,
        format!(
            "the new output is in place, but the previous one gained other files while it was written; it was kept at `{}`",
            kept.display()
        ),
    ))
}

fn exchange_unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
    )
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the path contains a NUL byte",
            )
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
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> std::io::Result<()> {
    Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
}

/// Writes `bytes` to `path`, synced (for files inside a temporary directory).
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = File::create(path).map_err(Error::io("creating", path))?;
    f.write_all(bytes).map_err(Error::io("writing", path))?;
    f.sync_all().map_err(Error::io("syncing", path))
}

/// Maps an I/O error while doing `op` on the temporary `tmp` of the output `out` to
/// [`Error::Io`] naming the output, the operating system's error and the temporary.
pub(crate) fn tmp_io_err(op: &str, out: &Path, tmp: &Path) -> impl Fn(std::io::Error) -> Error {
    let op = op.to_string();
    let out = out.display().to_string();
    let tmp = tmp.display().to_string();
    move |e| {
        let e = std::io::Error::new(e.kind(), format!("{e} (in its temporary `{tmp}`)"));
        Error::io(op.clone(), &out)(e)
    }
}

/// Writes a file through `write` into a temporary sibling of `out` (`.NAME.PID.N.tmp`), syncs
/// it, renames it to `out` and syncs the directory; the temporary file is removed on failure.
/// Mode 0644 (less the umask), like every output of the crate. `write` gets the writer and
/// the temporary's path (for [`tmp_io_err`]).
pub(crate) fn write_file_atomic(
    out: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<StreamedFile>, &Path) -> Result<()>,
) -> Result<()> {
    check_file_output(out)?;
    let tmp = tmp_file_path(out)?;
    let (parent, _) = split(out)?;
    let result = (|| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(tmp_io_err("creating", out, &tmp))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, StreamedFile::new(file));
        write(&mut w, &tmp)?;
        let file = w
            .into_inner()
            .map_err(|e| tmp_io_err("writing", out, &tmp)(e.into_error()))?
            .into_file();
        file.sync_all().map_err(tmp_io_err("syncing", out, &tmp))?;
        drop(file);
        check_file_output(out)?;
        std::fs::rename(&tmp, out).map_err(Error::io("renaming into place", out))?;
        sync_dir(&parent)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Creates a fresh temporary sibling of `out` (`.NAME.PID.N.tmp`) of `len` bytes (zeros),
/// for writers that fill planned byte ranges of one output from several processes
/// ([`finish_planned_file`] installs it; remove it on failure).
pub(crate) fn create_planned_file(out: &Path, len: u64) -> Result<PathBuf> {
    check_file_output(out)?;
    let tmp = tmp_file_path(out)?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(tmp_io_err("creating", out, &tmp))?;
    if let Err(e) = file.set_len(len) {
        let _ = std::fs::remove_file(&tmp);
        return Err(tmp_io_err("sizing", out, &tmp)(e));
    }
    Ok(tmp)
}

/// Puts the planned file `tmp` (every byte range written and synced by its writers) at `out`:
/// syncs it, renames it into place and syncs the directory, as [`write_file_atomic`] does.
pub(crate) fn finish_planned_file(tmp: &Path, out: &Path) -> Result<()> {
    let (parent, _) = split(out)?;
    let file = File::open(tmp).map_err(tmp_io_err("opening", out, tmp))?;
    file.sync_all().map_err(tmp_io_err("syncing", out, tmp))?;
    drop(file);
    check_file_output(out)?;
    std::fs::rename(tmp, out).map_err(Error::io("renaming into place", out))?;
    sync_dir(&parent)
}

/// The process of `world_size` that writes the byte at `offset` of `len` bytes shared out
/// by a planned writer (`convert`'s coordinator): the bytes are cut into `world_size`
/// spans of equal length, one per process in rank order.
pub(crate) fn writer_of(offset: u64, len: u64, world_size: usize) -> usize {
    let share = offset as u128 * world_size as u128 / len.max(1) as u128;
    (share as usize).min(world_size.saturating_sub(1))
}
