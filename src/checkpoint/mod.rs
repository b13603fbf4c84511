//! Sharded checkpoints (layer 7), the crate's own format: one data file per rank plus a manifest,
//! committed atomically, loadable at any world size and wrapping, verified by checksums.
//!
//! A checkpoint is a directory:
//! - `rank{r}.safetensors`: rank `r`'s tensor state as standard safetensors, one 1-D tensor
//!   per *piece* — a contiguous element range of one parameter's tensor state
//!   (`{param}/{state}/{first element}`). Padding is never stored, so the pieces are
//!   independent of the wrapping that produced them.
//! - `manifest.json` ([`Manifest`]): format and version, model description, wrapping policy,
//!   world size, key type, param groups, scalar and user-defined state, and for every tensor
//!   state its dtype, shape and pieces (file, element range, byte offset, CRC-32C per 4 MiB
//!   block).
//! - `COMMITTED`: written last; holds the manifest's checksum. A directory without it is not a
//!   checkpoint.
//!
//! Writing goes to a temporary sibling directory; every file and the directory are synced,
//! then the directory replaces the old checkpoint in one atomic exchange (`renameat2` with
//! `RENAME_EXCHANGE` on Linux; a documented fallback elsewhere, see
//! [`crate::storage::install_dir`]). A crash at any point leaves either the old or the new
//! checkpoint at the path, never a mixture. A writer replaces only a missing path, an empty
//! directory or a committed checkpoint that holds nothing else, never a directory holding its
//! input or other files ([`crate::storage::check_dir_output`]). Loading reads only the byte ranges that overlap the
//! loading rank's shards and verifies each block it reads.

mod background;
mod dcp;
pub(crate) mod import_dcp;
mod lazy;
mod load;
mod manifest;
mod prefetch;
mod rank_file;
mod reshard;
mod save;
pub(crate) mod stream;
mod summary;

pub use background::{BackgroundSaver, SaveMode};
pub(crate) use dcp::{load_dcp, read_optim_by_param, save_dcp, save_sharded_dcp};
pub use load::{load, load_full, load_model_params, verify, LoadOptions};
pub use manifest::{
    read_manifest, FileRecord, Manifest, ParamRecord, Piece, StoredValue, CHECKPOINT_DIR, COMMIT,
    FORMAT, MANIFEST, VERSION,
};
pub use reshard::{reshard, reshard_with};
pub(crate) use save::save;
#[cfg(feature = "fault-injection")]
pub use save::CrashPoint;
pub use save::SaveOptions;
pub use summary::{CheckpointSummary, RankFileSummary};

use crate::collectives::ProcessGroup;
use crate::error::Result;
use crate::flat_param::ModelLayout;
use std::path::Path;
use std::sync::Arc;

/// The calling rank's place in a collective checkpoint save: the model's layout, the rank's
/// place in it, whether it writes a data file, and the process group of the whole job.
///
/// The façade hands one over (`From<&Fsdp>`), so the checkpoint code needs no `Fsdp` and sits
/// below it.
#[derive(Clone, Copy)]
pub struct GroupContext<'a> {
    /// The layout of the model being saved.
    pub layout: &'a ModelLayout,
    /// This rank's rank in the layout (its shard group's rank).
    pub layout_rank: usize,
    /// Whether this rank writes a data file: the ranks of the first shard group do.
    pub writes_files: bool,
    /// The process group of the whole job (every rank takes part in the commit).
    pub pg: &'a Arc<dyn ProcessGroup>,
}

impl std::fmt::Debug for GroupContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupContext")
            .field("layout_rank", &self.layout_rank)
            .field("writes_files", &self.writes_files)
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .finish_non_exhaustive()
    }
}

pub(crate) use crate::storage::sync_dir;
pub(crate) use crate::storage::{Writeback, WRITEBACK_CHUNK};

/// Puts the complete checkpoint `tmp` at `dir` under the replace rule of
/// [`crate::storage::check_dir_output`] (see [`crate::storage::install_dir`]).
fn install(tmp: &Path, dir: &Path) -> Result<()> {
    crate::storage::install_dir(tmp, dir, CHECKPOINT_DIR)
}

/// Before writing a checkpoint to `dir`: removes stale temporaries of killed runs and checks
/// the replace rule (`dir` missing, empty, or a committed checkpoint; not overlapping
/// `inputs`), then creates the temporary sibling directory to write into.
pub(crate) fn prepare_output(dir: &Path, inputs: &[&Path]) -> Result<std::path::PathBuf> {
    use crate::storage;
    storage::clean_stale_temporaries(dir, Some(CHECKPOINT_DIR))?;
    storage::check_dir_output(dir, CHECKPOINT_DIR, inputs)?;
    storage::make_tmp_dir(dir)
}
