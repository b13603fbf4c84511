//! Temporaries beside an output (`.NAME.tmp-PID-NANOS/`, `.NAME.old-PID-NANOS/`,
//! `.NAME.PID.N.tmp`), and the cleanup of those a killed run left behind.

use super::replace::DirKind;
use super::{nanos, split, sync_dir};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Entry names a temporary directory of this crate may hold: every name any writer of the
/// crate puts into a directory it is building (the one table of them; a test writes each
/// directory output and checks every entry it holds against it). Cleanup removes only these,
/// never recursively, so a directory holding anything else is left as it is.
fn ours(entry: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // A checkpoint's rank files `rank{r}.{safetensors,pt,pth}`.
    let data = |e: &str| {
        e.strip_prefix("rank").is_some_and(|r| {
            let (num, ext) = r.split_once('.').unwrap_or((r, ""));
            digits(num) && matches!(ext, "safetensors" | "pt" | "pth")
        })
    };
    // DCP data files `__{rank}_{n}.distcp`.
    let distcp = |e: &str| {
        e.strip_prefix("__")
            .and_then(|r| r.strip_suffix(".distcp"))
            .and_then(|r| r.split_once('_'))
            .is_some_and(|(a, b)| digits(a) && digits(b))
    };
    // A Hugging Face export's shards `model-{i:05}-of-{n:05}.safetensors`.
    let hf_shard = |e: &str| {
        e.strip_prefix("model-")
            .and_then(|r| r.strip_suffix(".safetensors"))
            .and_then(|r| r.split_once("-of-"))
            .is_some_and(|(a, b)| digits(a) && digits(b))
    };
    // A checkpoint's commit marker and manifest (`crate::checkpoint::{COMMIT, MANIFEST}`),
    // the marker of the tool's `shard-torch` output, a Hugging Face export's single file,
    // index and config (`crate::io::hf`), named here because this layer is below them; rank
    // files, reports, nested temporaries, a DCP directory's `.metadata` and data files.
    matches!(
        entry,
        "COMMITTED"
            | ".metadata"
            | "manifest.json"
            | "fsdp-shard-torch.json"
            | "model.safetensors"
            | "model.safetensors.index.json"
            | "config.json"
    ) || distcp(entry)
        || hf_shard(entry)
        || data(entry)
        || (entry.starts_with("report-") && entry.ends_with(".json"))
        || (entry.starts_with(".report-") && entry.ends_with(".json.part"))
        || (entry.starts_with('.') && entry.ends_with(".tmp"))
}

/// Removes directory `dir` if every entry in it is one of `allowed` (regular files), the
/// commit marker first, so a crash midway leaves an uncommitted directory. Returns whether it
/// was removed; entries it does not know are left in place with the directory.
pub(super) fn remove_known(dir: &Path, allowed: &dyn Fn(&str) -> bool) -> Result<bool> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
