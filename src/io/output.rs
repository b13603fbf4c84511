//! Safe outputs: which existing paths a writer may replace, how a finished output is
//! installed, how stale temporaries of killed runs are cleaned, and how metadata files are
//! read without blocking on a FIFO or reading a device forever.
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

use crate::error::{Error, Result};
use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
#[cfg(feature = "fault-injection")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest commit marker, marker file or JSON description (`DESC.json`, a policy) read.
pub const SMALL_METADATA_MAX_BYTES: u64 = 64 << 20;

/// What kind of directory a writer produces, which decides what it may replace: an earlier
/// output of the same kind, recognised by `entries`.
#[derive(Debug, Clone, Copy)]
pub struct DirKind {
    /// What an earlier output of this kind is, for messages (`a committed checkpoint`).
    pub what: &'static str,
    /// The entry names an earlier output of this kind in the directory consists of, or why
    /// the directory is not one.
    pub entries: fn(&Path) -> std::result::Result<Vec<OsString>, String>,
}

/// What is at an output path now.
#[derive(Debug, PartialEq, Eq)]
enum Existing {
    Missing,
    EmptyDir,
    /// An earlier output of the right kind; these entry names are all it holds.
    Replaceable(Vec<OsString>),
}

fn refused(path: &Path, reason: String) -> Error {
    Error::OutputRefused {
        path: path.display().to_string(),
        reason,
    }
}

/// The absolute, symlink-free form of `p`, resolving what exists and appending the rest.
fn resolved(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut tail = Vec::new();
    let mut cur = abs.as_path();
    loop {
        if let Ok(c) = cur.canonicalize() {
            return tail.iter().rev().fold(c, |acc: PathBuf, t| acc.join(t));
        }
        match (cur.parent(), cur.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_os_string());
                cur = parent;
            }
            _ => return abs,
        }
    }
}

/// Refuses an output that is an input, contains one, or lies inside one (an input directory,
/// such as a checkpoint being consolidated or resharded).
pub fn check_not_overlapping(output: &Path, inputs: &[&Path]) -> Result<()> {
    let out = resolved(output);
    for input in inputs {
        let inp = resolved(input);
        let reason = if inp == out {
            format!("it is the input `{}`", input.display())
        } else if inp.starts_with(&out) {
            format!("it contains the input `{}`", input.display())
        } else if out.starts_with(&inp) {
            format!("it lies inside the input `{}`", input.display())
        } else {
            continue;
        };
        return Err(refused(output, reason));
    }
    Ok(())
}

/// The replace rule for file outputs: `out` may be a missing path (in an existing directory)
/// or a regular file, which is replaced whole. A symbolic link, a directory, a FIFO, a socket
/// or a device is refused: renaming over it would silently replace the special file (or the
/// link, not its target), so the user must remove it or name another path. Called before any
/// work, and again just before the finished file is renamed into place.
pub fn check_file_output(out: &Path) -> Result<()> {
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let (parent, _) = split(out)?;
            match std::fs::metadata(&parent) {
                Ok(m) if m.is_dir() => Ok(()),
                Ok(m) => Err(refused(
                    out,
                    format!(
                        "`{}` is a {}, not a directory",
                        parent.display(),
                        file_kind(&m.file_type())
                    ),
                )),
                Err(e) => Err(refused(
                    out,
                    format!("its directory `{}`: {e}", parent.display()),
                )),
            }
        }
        Err(e) => Err(Error::io("inspecting the output", out)(e)),
        Ok(m) if m.is_file() => Ok(()),
        Ok(m) => Err(refused(
            out,
            format!(
                "it is a {}, not a regular file; a file output replaces only a regular file or a missing path (remove it or choose another output)",
                file_kind(&m.file_type())
            ),
        )),
    }
}

/// The replace rule for directory outputs: `out` may be missing, an empty directory, or an
/// earlier output of `kind` holding nothing else; it must not overlap any of `inputs`.
pub fn check_dir_output(out: &Path, kind: DirKind, inputs: &[&Path]) -> Result<()> {
    check_not_overlapping(out, inputs)?;
    existing(out, kind).map(drop)
}

fn existing(out: &Path, kind: DirKind) -> Result<Existing> {
    let meta = match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Missing),
        Err(e) => return Err(Error::io("inspecting the output", out)(e)),
        Ok(m) => m,
    };
    if !meta.is_dir() {
        return Err(refused(
            out,
            format!(
                "it is a {}, not a directory; remove it first",
                file_kind(&meta.file_type())
            ),
        ));
    }
    let mut names = Vec::new();
    for e in std::fs::read_dir(out).map_err(Error::io("listing", out))? {
        names.push(e.map_err(Error::io("listing", out))?.file_name());
    }
    if names.is_empty() {
        return Ok(Existing::EmptyDir);
    }
    let expected = (kind.entries)(out).map_err(|why| {
        let mut shown: Vec<String> = names
            .iter()
            .take(3)
            .map(|n| format!("`{}`", n.to_string_lossy()))
            .collect();
        if names.len() > 3 {
            shown.push(format!("{} more", names.len() - 3));
        }
        refused(
            out,
            format!(
                "it holds {} and is not {} ({why}); remove it or choose another output",
                shown.join(", "),
                kind.what
            ),
        )
    })?;
    for n in &names {
        let is_plain_file = std::fs::symlink_metadata(out.join(n)).is_ok_and(|m| m.is_file());
        if !expected.iter().any(|x| x == n) || !is_plain_file {
            return Err(refused(
                out,
                format!(
                    "it is {} but also holds `{}`, which is not part of it; remove that first",
                    kind.what,
                    n.to_string_lossy()
                ),
            ));
        }
    }
    Ok(Existing::Replaceable(names))
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
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
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

// ----- temporaries -----

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

/// A fresh temporary directory beside `out` (`.NAME.tmp-PID-NANOS`), its parent created.
pub fn make_tmp_dir(out: &Path) -> Result<PathBuf> {
    let (parent, name) = split(out)?;
    std::fs::create_dir_all(&parent).map_err(Error::io("creating", &parent))?;
    let tmp = parent.join(format!(".{name}.tmp-{}-{}", std::process::id(), nanos()));
    std::fs::create_dir(&tmp).map_err(Error::io("creating", &tmp))?;
    Ok(tmp)
}

/// A fresh temporary file name beside `out` (`.NAME.PID.N.tmp`).
pub(crate) fn tmp_file_path(out: &Path) -> Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let (parent, name) = split(out)?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    Ok(parent.join(format!(".{name}.{}.{n}.tmp", std::process::id())))
}

/// What a temporary name says about its writer.
#[derive(Debug, PartialEq, Eq)]
enum Temp {
    /// `.NAME.tmp-PID-NANOS`: a directory being written (or an old one being removed).
    Dir(u32),
    /// `.NAME.old-PID-NANOS`: a previous checkpoint moved aside by the fallback install.
    Aside(u32),
    /// `.NAME.PID[.N].tmp`: a file being written.
    File(u32),
}

/// Parses the temporary name `entry` of an output named `name`.
fn parse_temp(entry: &str, name: &str) -> Option<Temp> {
    let rest = entry
        .strip_prefix('.')?
        .strip_prefix(name)?
        .strip_prefix('.')?;
    let pid_of = |s: &str| s.parse::<u32>().ok().filter(|&p| p > 0);
    if let Some(r) = rest.strip_prefix("tmp-").or(rest.strip_prefix("old-")) {
        let (pid, stamp) = r.split_once('-')?;
        stamp.parse::<u128>().ok()?;
        let pid = pid_of(pid)?;
        return Some(if rest.starts_with("tmp-") {
            Temp::Dir(pid)
        } else {
            Temp::Aside(pid)
        });
    }
    let body = rest.strip_suffix(".tmp")?;
    let mut parts = body.split('.');
    let pid = pid_of(parts.next()?)?;
    match (parts.next(), parts.next()) {
        (None, _) => Some(Temp::File(pid)),
        (Some(n), None) if n.parse::<u64>().is_ok() => Some(Temp::File(pid)),
        _ => None,
    }
}

/// Whether process `pid` is alive on this host (unknown counts as alive).
fn alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    #[cfg(unix)]
    {
        let Ok(p) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let rc = unsafe { libc::kill(p, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    true
}

/// Entry names a temporary directory of this crate may hold.
fn ours(entry: &str) -> bool {
    let data = |e: &str| {
        e.strip_prefix("rank").is_some_and(|r| {
            let (num, ext) = r.split_once('.').unwrap_or((r, ""));
            !num.is_empty()
                && num.bytes().all(|b| b.is_ascii_digit())
                && matches!(ext, "safetensors" | "pt" | "pth")
        })
    };
    // DCP data files `__{rank}_{n}.distcp`.
    let distcp = |e: &str| {
        e.strip_prefix("__")
            .and_then(|r| r.strip_suffix(".distcp"))
            .and_then(|r| r.split_once('_'))
            .is_some_and(|(a, b)| {
                [a, b]
                    .iter()
                    .all(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
            })
    };
    // A checkpoint's commit marker and manifest (`crate::checkpoint::{COMMIT, MANIFEST}`),
    // the marker of the tool's `shard-torch` output, named here because this layer is below
    // them; rank files, reports, nested temporaries, a DCP directory's `.metadata` and data
    // files.
    entry == "COMMITTED"
        || entry == ".metadata"
        || distcp(entry)
        || entry == "manifest.json"
        || entry == "fsdp-shard-torch.json"
        || data(entry)
        || (entry.starts_with("report-") && entry.ends_with(".json"))
        || (entry.starts_with(".report-") && entry.ends_with(".json.part"))
        || (entry.starts_with('.') && entry.ends_with(".tmp"))
}

/// Removes directory `dir` if every entry in it is one of `allowed` (regular files), the
/// commit marker first, so a crash midway leaves an uncommitted directory. Returns whether it
/// was removed; entries it does not know are left in place with the directory.
fn remove_known(dir: &Path, allowed: &dyn Fn(&str) -> bool) -> Result<bool> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(Error::io("listing", dir))? {
        let e = e.map_err(Error::io("listing", dir))?;
        let n = e.file_name().to_string_lossy().into_owned();
        let plain = e.file_type().is_ok_and(|t| t.is_file());
        if !plain || !allowed(&n) {
            return Ok(false);
        }
        names.push(n);
    }
    names.sort_by_key(|n| n != "COMMITTED");
    for n in names {
        let p = dir.join(&n);
        std::fs::remove_file(&p).map_err(Error::io("removing", &p))?;
    }
    std::fs::remove_dir(dir).map_err(Error::io("removing", dir))?;
    Ok(true)
}

/// Removes this process's own temporary directory `tmp` after a failed write: only the
/// entries writers put there (never a recursive delete), ignoring errors.
pub fn discard_tmp_dir(tmp: &Path) {
    let _ = remove_known(tmp, &ours);
}

/// What [`clean_stale_temporaries`] did to one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cleaned {
    /// A stale temporary file or directory was removed.
    Removed(PathBuf),
    /// A previous output that an interrupted install had moved aside was put back at the
    /// output path (which was missing).
    Restored {
        /// Where it was.
        from: PathBuf,
        /// The output path it is at again.
        to: PathBuf,
    },
}

impl std::fmt::Display for Cleaned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cleaned::Removed(p) => write!(
                f,
                "removed `{}`, left behind by an interrupted earlier run",
                p.display()
            ),
            Cleaned::Restored { from, to } => write!(
                f,
                "restored the previous output `{}` from `{}`, where an interrupted earlier run had moved it",
                to.display(),
                from.display()
            ),
        }
    }
}

/// Removes the temporaries that killed earlier runs left beside `out` (see the module docs):
/// only names this crate gives its temporaries, only when the process in the name is no
/// longer alive on this host, and in a temporary directory only the entries a writer puts
/// there. If `out` is missing and a stale aside directory holds a complete output of `kind`
/// (an install interrupted between its two renames), it is moved back to `out`.
pub fn clean_stale_temporaries(out: &Path, kind: Option<DirKind>) -> Result<Vec<Cleaned>> {
    let (parent, name) = split(out)?;
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return Ok(Vec::new()); // a missing parent holds no temporaries
    };
    let mut stale = Vec::new();
    for e in entries {
        let e = e.map_err(Error::io("listing", &parent))?;
        let entry = e.file_name().to_string_lossy().into_owned();
        if let Some(t) = parse_temp(&entry, &name) {
            let pid = match t {
                Temp::Dir(p) | Temp::Aside(p) | Temp::File(p) => p,
            };
            if !alive(pid) {
                stale.push((t, e.path()));
            }
        }
    }
    // Asides first: one may have to go back into place before the rest is removed.
    stale.sort_by_key(|(t, _)| !matches!(t, Temp::Aside(_)));
    let mut done = Vec::new();
    for (t, path) in stale {
        match t {
            Temp::Aside(_) if !out.exists() && kind.is_some_and(|k| (k.entries)(&path).is_ok()) => {
                std::fs::rename(&path, out).map_err(Error::io("restoring", out))?;
                sync_dir(&parent)?;
                done.push(Cleaned::Restored {
                    from: path,
                    to: out.to_path_buf(),
                });
            }
            Temp::File(_) => {
                let plain = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file());
                if plain {
                    std::fs::remove_file(&path).map_err(Error::io("removing", &path))?;
                    done.push(Cleaned::Removed(path));
                }
            }
            Temp::Dir(_) | Temp::Aside(_) => {
                let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
                if is_dir && remove_known(&path, &ours)? {
                    done.push(Cleaned::Removed(path));
                }
            }
        }
    }
    Ok(done)
}

// ----- installing -----

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
/// [`check_dir_output`] (checked again here, just before the swap).
///
/// - `out` missing or an empty directory: one `rename`.
/// - an earlier output of `kind`: `renameat2(RENAME_EXCHANGE)` swaps the two directories in
///   one step, then the old one (now at `tmp`) is removed entry by entry. Where the exchange
///   is unsupported (`EINVAL`, `ENOSYS`, `EOPNOTSUPP`: NFS, Lustre, FUSE, or forced by
///   the test switch `force_rename_fallback`), the old directory is renamed aside to `.NAME.old-PID-NANOS`,
///   the new one renamed to `out`, and the aside one removed. A reader then finds either the
///   old complete output, the new complete one, or — after a crash between the two renames —
///   nothing at `out`, never a mixture; the next write to `out` (or
///   [`clean_stale_temporaries`]) moves the old checkpoint back.
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

    #[test]
    fn temporary_names_are_recognised_only_for_their_output() {
        assert_eq!(parse_temp(".ck.tmp-42-1700", "ck"), Some(Temp::Dir(42)));
        assert_eq!(parse_temp(".ck.old-42-1700", "ck"), Some(Temp::Aside(42)));
        assert_eq!(parse_temp(".f.pt.42.3.tmp", "f.pt"), Some(Temp::File(42)));
        assert_eq!(parse_temp(".f.pt.42.tmp", "f.pt"), Some(Temp::File(42)));
        assert_eq!(parse_temp(".ck2.tmp-42-1700", "ck"), None);
        assert_eq!(parse_temp(".ck.tmp-x-1700", "ck"), None);
        assert_eq!(parse_temp("ck.tmp-42-1700", "ck"), None);
        assert_eq!(parse_temp(".f.pt.notes.tmp", "f.pt"), None);
    }

    #[test]
    fn overlap_is_refused_both_ways() {
        let d = tempfile::tempdir().unwrap();
        let ck = d.path().join("sb/ck");
        std::fs::create_dir_all(&ck).unwrap();
        let sb = d.path().join("sb");
        assert!(check_not_overlapping(&sb, &[&ck]).is_err());
        assert!(check_not_overlapping(&ck.join("x.pt"), &[&ck]).is_err());
        assert!(check_not_overlapping(&ck, &[&ck]).is_err());
        assert!(check_not_overlapping(&d.path().join("other"), &[&ck]).is_ok());
    }

    #[test]
    fn stale_cleanup_removes_only_dead_writers_known_files() {
        let d = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let out = d.path().join("ck");
        let ours = d.path().join(format!(".ck.tmp-{dead}-1"));
        std::fs::create_dir(&ours).unwrap();
        std::fs::write(ours.join("rank0.safetensors"), b"x").unwrap();
        let foreign = d.path().join(format!(".ck.tmp-{dead}-2"));
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("notes.txt"), b"keep").unwrap();
        let live = d.path().join(format!(".ck.{}.0.tmp", std::process::id()));
        std::fs::write(&live, b"busy").unwrap();
        let done = clean_stale_temporaries(&out, None).unwrap();
        assert_eq!(done, [Cleaned::Removed(ours.clone())]);
        assert!(!ours.exists());
        assert!(
            foreign.join("notes.txt").exists(),
            "unknown files are never removed"
        );
        assert!(live.exists(), "a live writer's temporary is kept");
    }

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
