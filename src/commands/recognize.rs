//! What an input path is: the one recognition step every offline command takes first, so
//! that each form is told apart by one precedence table and an unknown input is described
//! by what it holds rather than by the first reader's complaint.
//!
//! A directory is the first of these forms whose marker it holds (`DIRECTORY_FORMS`):
//!
//! | order | marker | form |
//! | --- | --- | --- |
//! | 0 | `metadata.json` naming a `sharded_backend`, or `latest_checkpointed_iteration.txt` | [`Input::Megatron`]: Megatron-Core's `dist_checkpointing.save` (a `torch_dist` directory, or a Megatron-LM / Bridge tree) |
//! | 1 | `.metadata` (any kind of entry) | [`Input::Dcp`]: `dcp.save` |
//! | 2 | `__{rank}.metadata` | [`Input::DcpPerRank`]: `dcp.save(..., use_collectives=False)` |
//! | 3 | `manifest.json` or `COMMITTED` | [`Input::Checkpoint`]: this crate's checkpoint |
//! | 4 | `*_optim_states.pt` rank files, or `latest` naming a tag directory of them | [`Input::DeepSpeed`]: DeepSpeed's `engine.save_checkpoint` (ZeRO 1, 2, 3) |
//! | 5 | `zero/optimizer_state.pt`, or `latest_universal` naming a tag directory with it | [`Input::DeepSpeedUniversal`]: DeepSpeed's `ds_to_universal` |
//! | 6 | a `.safetensors` file whose header's `__metadata__` has `DCP_SHARDING_INFO`, here or in `sharded/` | [`Input::DcpHf`]: `HuggingFaceStorageWriter` |
//! | 7 | `model.safetensors.index.json`, or `.safetensors` files (none with `DCP_SHARDING_INFO`) | [`Input::HfModel`]: `save_pretrained` |
//!
//! The order is PyTorch's where PyTorch has one (its loader reads `.metadata` before a rank's
//! own file); a Megatron `torch_dist` directory is a DCP directory too, told apart by the
//! `metadata.json` Megatron writes beside `.metadata`, so it comes first; the crate's checkpoint never holds DCP markers; Hugging Face storage comes last
//! because telling it apart reads file headers. A directory of safetensors files without
//! `DCP_SHARDING_INFO` is a plain Hugging Face model directory, recognised last. A `latest`
//! naming a tag whose directory is missing still marks a DeepSpeed checkpoint: its reader
//! says which tag is missing.
//!
//! A single file is a [`Input::File`] of the format its extension (or its first bytes) says.
//! A `torch.save` file named as one of a DeepSpeed checkpoint's
//! ([`deepspeed_file`]: `zero_pp_rank_R_mp_rank_MM_optim_states.pt`, with or without
//! `bf16_`, `mp_rank_MM_model_states.pt`, …) is read with the three DeepSpeed globals of its
//! pickles allowed ([`crate::io::deepspeed`]); any other file is not.

use crate::commands::conversions::HfSource;
use crate::error::{Error, Result};
use crate::io::dcp::HfForm;
use crate::io::FileFormat;
use std::path::Path;

/// What [`recognize`] found at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A PyTorch DCP directory with one global `.metadata` (`dcp.save`).
    Dcp,
    /// A PyTorch DCP directory with per-rank metadata files (`__0.metadata`, …) and no
    /// `.metadata`: what `dcp.save(..., use_collectives=False)` writes.
    DcpPerRank,
    /// A PyTorch DCP directory in Hugging Face storage (`HuggingFaceStorageWriter`):
    /// safetensors files whose headers carry `DCP_SHARDING_INFO`, in one of three forms.
    DcpHf(HfForm),
    /// This crate's sharded checkpoint directory (`manifest.json`, `COMMITTED`).
    Checkpoint,
    /// A Hugging Face model directory (`save_pretrained`): `model.safetensors`, or
    /// `model-*-of-*.safetensors` files and `model.safetensors.index.json`.
    HfModel,
    /// A DeepSpeed ZeRO checkpoint (`engine.save_checkpoint`): the root holding `latest`, or
    /// a tag directory of `*_optim_states.pt` rank files.
    DeepSpeed,
    /// A DeepSpeed universal checkpoint (`ds_to_universal`): a tag directory holding
    /// `zero/optimizer_state.pt`, or the root holding `latest_universal`.
    DeepSpeedUniversal,
    /// A Megatron-Core checkpoint (`dist_checkpointing.save`, `torch_dist` backend): the
    /// directory holding `metadata.json`, or the root of a Megatron-LM or Megatron-Bridge
    /// tree holding `latest_checkpointed_iteration.txt` ([`crate::io::megatron`]).
    Megatron,
    /// A single state dict file.
    File(FileFormat),
}

impl Input {
    /// Whether this is a DeepSpeed checkpoint of either form (what
    /// [`crate::io::deepspeed::DeepSpeedCheckpoint`] opens).
    pub fn is_deepspeed(self) -> bool {
        matches!(self, Input::DeepSpeed | Input::DeepSpeedUniversal)
    }

    /// Whether this is a DCP directory of any form (what [`crate::io::dcp::DcpCheckpoint`]
    /// opens).
    pub fn is_dcp(self) -> bool {
        matches!(self, Input::Dcp | Input::DcpPerRank | Input::DcpHf(_))
    }

    /// What `convert --to hf` exports this form as ([`crate::commands::conversions::checkpoint_to_hf`]): a
    /// DCP directory of any form, the crate's checkpoint or a file; `None` for the others.
    pub fn hf_source(self) -> Option<HfSource> {
        match self {
            Input::Checkpoint => Some(HfSource::Checkpoint),
            Input::File(_) => Some(HfSource::File),
            i if i.is_dcp() => Some(HfSource::Dcp),
            _ => None,
        }
    }

    /// What the input is, for messages ("a DCP directory").
    pub fn describe(self) -> &'static str {
        match self {
            Input::Dcp => "a DCP directory",
            Input::DcpPerRank => "a DCP directory with per-rank metadata",
            Input::DcpHf(HfForm::Rank0) => {
                "a DCP directory in Hugging Face storage (saved by rank 0)"
            }
            Input::DcpHf(HfForm::Distributed) => {
                "a DCP directory in Hugging Face storage (saved by every rank)"
            }
            Input::DcpHf(HfForm::Consolidated) => {
                "a DCP directory in Hugging Face storage (saved by every rank, consolidated)"
            }
            Input::Checkpoint => "a checkpoint of this crate",
            Input::HfModel => "a Hugging Face model directory",
            Input::DeepSpeed => "a DeepSpeed ZeRO checkpoint",
            Input::DeepSpeedUniversal => "a DeepSpeed universal checkpoint",
            Input::Megatron => "a Megatron-Core checkpoint",
            Input::File(FileFormat::TorchSave) => "a torch.save file",
            Input::File(FileFormat::Safetensors) => "a safetensors file",
        }
    }
}

/// One directory form: what marks it, and the probe that says whether `dir` is one (`Err`
/// when it is one but the marker is unusable, e.g. a `.metadata` that is a FIFO).
struct Form {
    marker: &'static str,
    probe: fn(&Path) -> Result<Option<Input>>,
}

/// The directory forms, in precedence order: the first whose probe matches decides (see [the
/// module](self) for the table).
const DIRECTORY_FORMS: &[Form] = &[
    Form {
        marker: "`metadata.json` or `latest_checkpointed_iteration.txt`",
        probe: megatron,
    },
    Form {
        marker: "`.metadata`",
        probe: dcp_global,
    },
    Form {
        marker: "`__0.metadata`",
        probe: dcp_per_rank,
    },
    Form {
        marker: "`manifest.json`",
        probe: crate_checkpoint,
    },
    Form {
        marker: "`latest` with a tag directory of `*_optim_states.pt`",
        probe: deepspeed_zero,
    },
    Form {
        marker: "`zero/optimizer_state.pt`",
        probe: deepspeed_universal,
    },
    Form {
        marker: "`.safetensors` files with `DCP_SHARDING_INFO`",
        probe: dcp_hf,
    },
    Form {
        marker: "`model.safetensors.index.json`",
        probe: hf_model,
    },
];

/// Decides what `path` is: a directory by the first of its forms whose marker it holds
/// (DCP `.metadata`, DCP per-rank `__{rank}.metadata`, this crate's `manifest.json` or
/// `COMMITTED`); a file by its extension (`.pt`, `.pth`, `.bin`, `.ckpt`, `.safetensors`),
/// or by its first bytes when the extension says nothing (a zip archive is a `torch.save`
/// file, an 8-byte length and a JSON header a safetensors file). Anything else is an error
/// that says what was found.
pub fn recognize(path: &Path) -> Result<Input> {
    use crate::storage::ReadRegularError;
    let meta = match crate::storage::stat(path) {
        Ok(meta) => meta,
        Err(ReadRegularError::NotRegular(kind)) => {
            return Err(Error::UnrecognizedInput {
                path: path.display().to_string(),
                found: format!("it is a {kind}, not a file or directory"),
            })
        }
        Err(e) => return Err(e.at("opening the input", path)),
    };
    if meta.is_dir() {
        for form in DIRECTORY_FORMS {
            if let Some(found) = (form.probe)(path)? {
                return Ok(found);
            }
        }
        return Err(unrecognized_dir(path));
    }
    if !meta.is_file() {
        return Err(Error::UnrecognizedInput {
            path: path.display().to_string(),
            found: format!(
                "it is a {}, not a file or directory",
                crate::storage::file_kind(&meta.file_type())
            ),
        });
    }
    match FileFormat::from_path(path) {
        Ok(format) => Ok(Input::File(format)),
        Err(unknown) => sniff(path)?.map(Input::File).ok_or(unknown),
    }
}

/// A `.metadata` entry of any kind marks a DCP directory; one that is not a regular file
/// (symbolic links followed) is an error naming what it is.
fn dcp_global(dir: &Path) -> Result<Option<Input>> {
    let marker = dir.join(".metadata");
    match std::fs::symlink_metadata(&marker) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("inspecting", &marker)(e)),
    }
    match crate::storage::regular_len(&marker) {
        Ok(_) => Ok(Some(Input::Dcp)),
        Err(crate::storage::ReadRegularError::NotRegular(kind)) => Err(Error::DcpMetadata {
            file: marker.display().to_string(),
            reason: format!("`.metadata` is a {kind}, not a regular file"),
        }),
        Err(e) => Err(e.at("reading", &marker)),
    }
}

/// `metadata.json` naming a `sharded_backend`, or `latest_checkpointed_iteration.txt`,
/// marks a Megatron-Core checkpoint ([`crate::io::megatron::recognize_dir`]).
fn megatron(dir: &Path) -> Result<Option<Input>> {
    Ok(crate::io::megatron::recognize_dir(dir)?.then_some(Input::Megatron))
}

/// `__{rank}.metadata` files (and no `.metadata`) mark a DCP directory saved without
/// collectives.
fn dcp_per_rank(dir: &Path) -> Result<Option<Input>> {
    let found = entries(dir)?.iter().any(|n| {
        n.strip_prefix("__")
            .and_then(|r| r.strip_suffix(".metadata"))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
    });
    Ok(found.then_some(Input::DcpPerRank))
}

/// Safetensors files whose headers carry `DCP_SHARDING_INFO` (in the directory, or in its
/// `sharded/` subdirectory) mark a DCP directory in Hugging Face storage
/// ([`crate::io::dcp::hf_form`]).
fn dcp_hf(dir: &Path) -> Result<Option<Input>> {
    Ok(crate::io::dcp::hf_form(dir)?.map(Input::DcpHf))
}

/// `model.safetensors.index.json` or `.safetensors` files (after [`dcp_hf`] found none with
/// `DCP_SHARDING_INFO`) mark a Hugging Face model directory.
fn hf_model(dir: &Path) -> Result<Option<Input>> {
    Ok(crate::io::hf::looks_like_model_dir(dir).then_some(Input::HfModel))
}

/// `*_optim_states.pt` rank files, or `latest` naming a tag directory of them (or a
/// missing one), mark a DeepSpeed ZeRO checkpoint.
fn deepspeed_zero(dir: &Path) -> Result<Option<Input>> {
    let found = crate::io::deepspeed::recognize_dir(dir)?;
    Ok((found == Some(crate::io::deepspeed::Form::Zero)).then_some(Input::DeepSpeed))
}

/// `zero/optimizer_state.pt`, or `latest_universal` naming a tag directory with it, marks a
/// DeepSpeed universal checkpoint.
fn deepspeed_universal(dir: &Path) -> Result<Option<Input>> {
    let found = crate::io::deepspeed::recognize_dir(dir)?;
    Ok((found == Some(crate::io::deepspeed::Form::Universal)).then_some(Input::DeepSpeedUniversal))
}

/// Whether the file `path` is named as a file of a DeepSpeed checkpoint, whose pickles are
/// then read with DeepSpeed's three inert globals allowed
/// ([`crate::io::deepspeed::is_checkpoint_file`]).
pub fn deepspeed_file(path: &Path) -> bool {
    crate::io::deepspeed::is_checkpoint_file(path)
}

/// `manifest.json` or `COMMITTED` marks this crate's checkpoint (complete or not: its reader
/// says which part is missing).
fn crate_checkpoint(dir: &Path) -> Result<Option<Input>> {
    let marked = [crate::checkpoint::MANIFEST, crate::checkpoint::COMMIT]
        .iter()
        .any(|m| std::fs::symlink_metadata(dir.join(m)).is_ok());
    Ok(marked.then_some(Input::Checkpoint))
}

/// The names in `dir`, sorted.
fn entries(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(Error::io("listing", dir))? {
        let e = e.map_err(Error::io("listing", dir))?;
        names.push(e.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// The error for a directory no form matches: which markers are missing, and what it holds
/// (files counted by extension).
fn unrecognized_dir(dir: &Path) -> Error {
    let markers: Vec<&str> = DIRECTORY_FORMS.iter().map(|f| f.marker).collect();
    let holds = match entries(dir) {
        Err(e) => format!("it cannot be listed: {e}"),
        Ok(names) if names.is_empty() => "it is empty".to_string(),
        Ok(names) => format!("it holds {}", count_by_extension(&names)),
    };
    Error::UnrecognizedInput {
        path: dir.display().to_string(),
        found: format!(
            "it is neither a DCP directory (no `.metadata`, `__0.metadata` or safetensors files with `DCP_SHARDING_INFO`) nor a checkpoint of this crate (no `manifest.json`) nor a DeepSpeed checkpoint (no `latest` naming a tag of `*_optim_states.pt`, no `zero/optimizer_state.pt`) nor a Megatron-Core checkpoint (no `metadata.json`, no `latest_checkpointed_iteration.txt`) nor a Hugging Face model directory (no `.safetensors` files); {holds} (looked for {})",
            markers.join(", ")
        ),
    }
}

/// "3 `.safetensors` files, 1 `.json` file and 2 other entries".
fn count_by_extension(names: &[String]) -> String {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for n in names {
        let key = match Path::new(n).extension() {
            Some(ext) => format!("`.{}`", crate::error::shown(&ext.to_string_lossy())),
            None => String::new(),
        };
        *counts.entry(key).or_default() += 1;
    }
    let mut parts: Vec<String> = counts
        .iter()
        .filter(|(k, _)| !k.is_empty())
        .map(|(ext, n)| format!("{n} {ext} file{}", if *n == 1 { "" } else { "s" }))
        .collect();
    if let Some(n) = counts.get("") {
        parts.push(format!(
            "{n} other entr{}",
            if *n == 1 { "y" } else { "ies" }
        ));
    }
    match parts.len() {
        1 => parts.remove(0),
        _ => {
            let last = parts.pop().unwrap_or_default();
            format!("{} and {last}", parts.join(", "))
        }
    }
}

/// The format of a file whose extension says nothing, from its first bytes.
fn sniff(path: &Path) -> Result<Option<FileFormat>> {
    use std::io::Read;
    let f = crate::storage::open_regular(path)
        .map_err(|e| Error::io("opening the input", path)(e.into()))?;
    let mut head = Vec::with_capacity(9);
    f.take(9)
        .read_to_end(&mut head)
        .map_err(Error::io("reading", path))?;
    Ok(match head.as_slice() {
        [b'P', b'K', 3, 4, ..] => Some(FileFormat::TorchSave),
        [_, _, _, _, _, _, _, _, b'{'] => Some(FileFormat::Safetensors),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_counted_for_the_message() {
        let names: Vec<String> = ["a.safetensors", "b.safetensors", "index.json", "README"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            count_by_extension(&names),
            "1 `.json` file, 2 `.safetensors` files and 1 other entry"
        );
    }
}
