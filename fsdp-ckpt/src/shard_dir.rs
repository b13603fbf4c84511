//! The output directory of `shard-torch`: its marker file, and how an earlier output is
//! recognised (which a new run may replace, under the library's replace rule).

use fsdp::storage::{self, DirKind};
use std::ffi::OsString;
use std::path::Path;

/// File name of the marker `fsdp-ckpt shard-torch` writes into its output directory: JSON
/// `{"format": "fsdp-shard-torch", "version": 1, "files": [...]}` naming the rank files. A
/// directory holding exactly this marker and the files it names is an earlier `shard-torch`
/// output, which a new run may replace.
pub(crate) const SHARD_TORCH_MARKER: &str = "fsdp-shard-torch.json";
const SHARD_TORCH_FORMAT: &str = "fsdp-shard-torch";

/// `fsdp-ckpt shard-torch` rank files with [`SHARD_TORCH_MARKER`].
pub(crate) const SHARD_TORCH: DirKind = DirKind {
    what: "an earlier `shard-torch` output",
    entries: shard_torch_entries,
};

/// The entries an earlier `shard-torch` output in `dir` consists of, or why it is not one.
fn shard_torch_entries(dir: &Path) -> std::result::Result<Vec<OsString>, String> {
    let bytes = storage::read_regular(
        &dir.join(SHARD_TORCH_MARKER),
        storage::SMALL_METADATA_MAX_BYTES,
    )
    .map_err(|e| format!("`{SHARD_TORCH_MARKER}`: {e}"))?;
    let marker: ShardTorchMarker = serde_json::from_slice(&bytes)
        .map_err(|e| format!("`{SHARD_TORCH_MARKER}` does not parse: {e}"))?;
    if marker.format != SHARD_TORCH_FORMAT {
        return Err(format!(
            "`{SHARD_TORCH_MARKER}` has format `{}`",
            marker.format
        ));
    }
    let mut names: Vec<OsString> = vec![SHARD_TORCH_MARKER.into()];
    for f in marker.files {
        if f.contains('/') || f.starts_with('.') {
            return Err(format!("`{SHARD_TORCH_MARKER}` names the file `{f}`"));
        }
        names.push(f.into());
    }
    Ok(names)
}

/// The marker of a `shard-torch` output directory ([`SHARD_TORCH_MARKER`]).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardTorchMarker {
    format: String,
    version: u32,
    files: Vec<String>,
}

/// The bytes of the marker naming `files` (in the output directory of `shard-torch`).
pub(crate) fn shard_torch_marker(files: &[String]) -> fsdp::Result<Vec<u8>> {
    let m = ShardTorchMarker {
        format: SHARD_TORCH_FORMAT.into(),
        version: 1,
        files: files.to_vec(),
    };
    let mut v = serde_json::to_vec_pretty(&m).map_err(|e| fsdp::Error::Serialization {
        what: "the shard-torch marker".into(),
        reason: e.to_string(),
    })?;
    v.push(b'\n');
    Ok(v)
}
