//! The Hugging Face model directory: what `transformers`' `save_pretrained` writes and
//! `from_pretrained` reads.
//!
//! * one `model.safetensors`, or `model-{i:05}-of-{n:05}.safetensors` files plus
//!   `model.safetensors.index.json` (`{"metadata": {"total_parameters", "total_size"},
//!   "weight_map": {name: file}}`, written as `json.dumps(index, indent=2, sort_keys=True)`);
//! * each file's `__metadata__` is `{"format": "pt"}`, its tensors laid out as the
//!   `safetensors` library lays them out (descending dtype, then name);
//! * the files are split as huggingface_hub's `split_state_dict_into_shards_factory` splits
//!   (`plan.rs`); `config.json` is the model's, which a checkpoint does not hold.
//!
//! A directory whose headers carry `DCP_SHARDING_INFO` is not one of these: it is a DCP
//! checkpoint in Hugging Face storage ([`crate::io::dcp`]), whose keys are kept as saved.
//!
//! This module plans the directory (`plan.rs`), maps checkpoint keys to model names
//! (`names.rs`, [`Rename`]), writes one planned file from a stream of tensor bytes
//! (`write.rs`), knows each architecture's tied embeddings (`ties.rs`, the table
//! `tied_embeddings.txt`) and reads a directory back, checking its index against its files (`read.rs`,
//! [`summary`]). Running a plan over a process group is [`crate::commands::conversions`]'s.

pub(crate) mod names;
pub(crate) mod plan;
pub(crate) mod read;
pub(crate) mod ties;
pub(crate) mod write;

pub use names::{Rename, MODEL_PREFIX, OPTIM_PREFIX, STATE_ROOTS};
pub use plan::{parse_shard_size, DEFAULT_MAX_SHARD_SIZE};
pub(crate) use read::HfModelDir;
pub use read::{summary, HfSummary, HfTensorSummary};
pub use ties::{tied_embeddings, TiedEmbedding};

use std::path::Path;

/// The index of a sharded model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The one file of an unsharded model directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The model's configuration, copied in by the export's `--config`.
pub const CONFIG_FILE: &str = "config.json";

/// The name of file `i` (from 0) of `n`: [`SINGLE_FILE`] when `n` is 1, else
/// `model-{i+1:05}-of-{n:05}.safetensors`.
pub(crate) fn single_or_sharded_name(i: usize, n: usize) -> String {
    if n == 1 {
        SINGLE_FILE.to_string()
    } else {
        format!("model-{:05}-of-{n:05}.safetensors", i + 1)
    }
}

/// What a Hugging Face model directory is for the replace rule of
/// [`crate::storage::check_dir_output`]: the export writes into a missing or empty
/// directory only, since a directory of model files usually holds more (tokenizer, config,
/// README) that a new export must not mix with.
pub const HF_MODEL_DIR: crate::storage::DirKind = crate::storage::DirKind {
    what: "an empty directory",
    entries: |_| Err("a Hugging Face export writes only into a missing or empty directory".into()),
};

/// Whether `dir` looks like a plain Hugging Face model directory: it holds
/// [`INDEX_FILE`] or `.safetensors` files (their headers are checked when it is read).
pub(crate) fn looks_like_model_dir(dir: &Path) -> bool {
    // Any entry (reading it says what is wrong with one that is not a regular file).
    std::fs::symlink_metadata(dir.join(INDEX_FILE)).is_ok()
        || crate::io::safetensors::file_names(dir).is_ok_and(|names| !names.is_empty())
}
