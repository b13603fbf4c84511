//! Access to the files of a DCP directory: every name a checkpoint writes is checked and
//! resolved in it, and every file is opened by the rule of every input
//! ([`crate::storage::read_regular`]: regular files only, symbolic links followed), and
//! metadata files are read bounded. Shared by the readers of each metadata source
//! (`read.rs`, `per_rank.rs`, `hf_storage.rs`).

use super::metadata::{Metadata, MAX_METADATA_BYTES};
use crate::error::{Error, Result};
use crate::storage::{check_name, regular_len, NameForm, ReadRegularError};
use std::path::{Path, PathBuf};

/// Resolves `relative` in `root`: a relative path of plain components
/// ([`check_name`]: not empty, no NUL, not absolute, no `.` or `..`), so that no name the
/// checkpoint writes leads out of it. Symbolic links the directory holds are followed
/// wherever they lead, as PyTorch's `FileSystemReader` follows them, and must end at a
/// regular file. Returns the path with the file's length, or why not (`what` names the file
/// in the reason: "data file", "metadata file").
pub(super) fn confine(
    root: &Path,
    relative: &str,
    what: &str,
) -> std::result::Result<(PathBuf, u64), String> {
    if let Some(why) = check_name(relative, NameForm::Relative) {
        return Err(format!(
            "relative_path {:?} is not a plain path inside the checkpoint directory: {why}",
            crate::error::shown(relative)
        ));
    }
    let path = root.join(relative);
    match regular_len(&path) {
        Ok(len) => Ok((path, len)),
        Err(e) if e.is_missing() => Err(format!("the {what} is missing")),
        Err(ReadRegularError::NotRegular(kind)) => {
            Err(format!("the {what} is a {kind}, not a regular file"))
        }
        Err(e) => Err(format!("cannot open the {what}: {e}")),
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
    let data = crate::storage::read_regular(&real, MAX_METADATA_BYTES).map_err(|e| match e {
        crate::storage::ReadRegularError::Io(e) => Error::io("reading", &path)(e),
        other => refused(other.to_string()),
    })?;
    super::parse_metadata(&name, &data)
}
