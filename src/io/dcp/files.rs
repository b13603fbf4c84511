//! Confined access to the files of a DCP directory: every path a checkpoint names is resolved
//! inside it, and metadata files are read bounded. Shared by the readers of each metadata
//! source (`read.rs`, `per_rank.rs`, `hf_storage.rs`).

use super::metadata::{Metadata, MAX_METADATA_BYTES};
use crate::error::{Error, Result};
use std::path::{Component, Path, PathBuf};

/// Resolves `relative` inside `root` (canonical): no absolute path, no `..`, and no symlink
/// leading out; the file must exist and be a regular file. Returns it with its length, or
/// why not (`what` names the file in the reason: "data file", "metadata file").
pub(super) fn confine(
    root: &Path,
    relative: &str,
    what: &str,
) -> std::result::Result<(PathBuf, u64), String> {
    let rel = Path::new(relative);
    if relative.is_empty() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!(
            "relative_path {:?} is not a plain path inside the checkpoint directory",
            crate::error::shown(relative)
        ));
    }
    let path = root.join(rel);
    let real = match path.canonicalize() {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("the {what} is missing"))
        }
        Err(e) => return Err(format!("cannot resolve the {what}: {e}")),
    };
    if !real.starts_with(root) {
        return Err(format!(
            "{:?} leads outside the checkpoint directory (through a symlink)",
            crate::error::shown(relative)
        ));
    }
    match std::fs::metadata(&real) {
        Ok(m) if m.is_file() => Ok((real, m.len())),
        Ok(m) => Err(format!(
            "the {what} is a {}, not a regular file",
            crate::io::output::file_kind(&m.file_type())
        )),
        Err(e) => Err(format!("cannot stat the {what}: {e}")),
    }
}

/// Reads and parses the metadata file `name` of `dir` (canonical path `root`) as
/// [`read_metadata`] reads `.metadata`.
pub(super) fn metadata_file_in(dir: &Path, root: &Path, name: &str) -> Result<Metadata> {
    let path = dir.join(name);
    let file = name;
    let name = path.display().to_string();
    let refused = |reason: String| Error::DcpMetadata {
        file: name.clone(),
        reason,
    };
    let (real, len) = confine(root, file, "metadata file").map_err(refused)?;
    if len > MAX_METADATA_BYTES {
        return Err(refused(format!(
            "{len} bytes, more than the {MAX_METADATA_BYTES} read"
        )));
    }
    let data = crate::io::output::read_regular(&real, MAX_METADATA_BYTES).map_err(|e| match e {
        crate::io::output::ReadRegularError::Io(e) => Error::io("reading", &path)(e),
        other => refused(other.to_string()),
    })?;
    super::parse_metadata(&name, &data)
}
