//! `shard-torch --model DESC FULL --world-size N -o DIR`: a full optimizer state dict cut
//! into the local dict of every rank; and the output directory it writes: its marker file,
//! and how an earlier output is recognised (which a new run may replace, under the library's
//! replace rule).

use super::{clean_stale, load_optim, load_spec, save_optim, step, Progress, TorchOptions};
use super::{Unit, Written};
use crate::commands::rank_dicts::{shard_full_dict_with, ShardOptions};
use crate::error::{Error, Result};
use crate::optim_state::OptimStateDict;
use crate::storage::{self, DirKind};
use std::ffi::OsString;
use std::path::Path;

/// File name of the marker `fsdp-ckpt shard-torch` writes into its output directory: JSON
/// `{"format": "fsdp-shard-torch", "version": 1, "files": [...]}` naming the rank files. A
/// directory holding exactly this marker and the files it names is an earlier `shard-torch`
/// output, which a new run may replace.
const SHARD_TORCH_MARKER: &str = "fsdp-shard-torch.json";
const SHARD_TORCH_FORMAT: &str = "fsdp-shard-torch";

/// `fsdp-ckpt shard-torch` rank files with [`SHARD_TORCH_MARKER`].
const SHARD_TORCH: DirKind = DirKind {
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
fn shard_torch_marker(files: &[String]) -> Result<Vec<u8>> {
    let m = ShardTorchMarker {
        format: SHARD_TORCH_FORMAT.into(),
        version: 1,
        files: files.to_vec(),
    };
    let mut v = serde_json::to_vec_pretty(&m).map_err(|e| Error::Serialization {
        what: "the shard-torch marker".into(),
        reason: e.to_string(),
    })?;
    v.push(b'\n');
    Ok(v)
}

/// `shard-torch --model DESC FULL --world-size N -o DIR`: the local dict each rank's optimizer
/// loads (`FSDP.shard_full_optim_state_dict`), written as `DIR/rank{r}.{ext}` (`ext`: `pt`,
/// `pth` or `safetensors`). The rank files are written into a temporary sibling of DIR with
/// a marker naming them, then installed as one directory.
pub fn shard_torch(
    model: &Path,
    full: &Path,
    ws: usize,
    out: &Path,
    ext: &str,
    opts: &TorchOptions,
    p: &dyn Progress,
) -> Result<Written> {
    if !["pt", "pth", "safetensors"].contains(&ext) {
        return Err(Error::Unsupported(format!(
            "rank file extension `{ext}` (use pt, pth or safetensors)"
        )));
    }
    let spec = load_spec(model, opts.named_optimizer)?;
    spec.layout(ws)?;
    let full_osd = step(p, &format!("reading {}", full.display()), || {
        load_optim(full)
    })?;
    let shard_opts = ShardOptions::default().with_tuples_as_lists(opts.tuples_as_lists);
    let locals = step(p, &format!("sharding for {ws} ranks"), || {
        shard_full_dict_with(&spec, &full_osd, ws, &shard_opts)
    })?;
    storage::check_dir_output(out, SHARD_TORCH, &[full, model])?;
    clean_stale(p, out, Some(SHARD_TORCH))?;
    let tmp = storage::make_tmp_dir(out)?;
    let written = write_rank_files(p, &locals, &tmp, ext)
        .and_then(|()| storage::install_dir(&tmp, out, SHARD_TORCH));
    if written.is_err() {
        storage::discard_tmp_dir(&tmp);
    }
    written?;
    Ok(Written {
        operation: "shard_torch",
        output: out.to_path_buf(),
        tensor_bytes: locals.iter().map(|l| l.tensor_bytes() as u64).sum(),
        count: Some(ws),
        world_size: Some(ws),
        message: format!(
            "wrote {ws} rank files to {}/rank{{0..{}}}.{ext}",
            out.display(),
            ws - 1
        ),
    })
}

/// Writes `rank{r}.{ext}` for every rank and the shard-torch marker into `dir`, synced.
fn write_rank_files(
    p: &dyn Progress,
    locals: &[OptimStateDict],
    dir: &Path,
    ext: &str,
) -> Result<()> {
    p.start(
        "writing rank files",
        Some((locals.len() as u64, Unit::Files)),
    );
    let mut names = Vec::with_capacity(locals.len());
    for (r, osd) in locals.iter().enumerate() {
        let name = format!("rank{r}.{ext}");
        if let Err(e) = save_optim(osd, &dir.join(&name)) {
            p.finish();
            return Err(e);
        }
        names.push(name);
        p.update(r as u64 + 1);
    }
    p.finish();
    storage::write_synced(&dir.join(SHARD_TORCH_MARKER), &shard_torch_marker(&names)?)?;
    storage::sync_dir(dir)
}
