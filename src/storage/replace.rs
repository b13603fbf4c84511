//! The replace rule: which existing path a writer may replace, and outputs that must not
//! overlap their inputs.

use super::{file_kind, refused, split};
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

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

/// An output written only into a missing or empty directory: nothing earlier is replaced
/// (`convert --to dcp`).
pub const EMPTY_DIR: DirKind = DirKind {
    what: "an empty directory",
    entries: |_| Err("this output is written only into a missing or empty directory".into()),
};

/// What is at an output path now.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Existing {
    Missing,
    EmptyDir,
    /// An earlier output of the right kind; these entry names are all it holds.
    Replaceable(Vec<OsString>),
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

pub(super) fn existing(out: &Path, kind: DirKind) -> Result<Existing> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
