//! `reshard IN OUT --world-size M [--policy P]`: the crate's checkpoint for another world
//! size or wrapping.

use super::{clean_stale, expect_input, on_processes, phase, Input, Progress, Unit, Written};
use crate::checkpoint;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::model::WrapPolicy;
use crate::storage;
use std::path::Path;

/// A `WrapPolicy` from JSON: the policy itself, or a DESC.json's `policy`.
fn read_policy(path: &Path) -> Result<WrapPolicy> {
    let bytes = storage::read_small_file(path)?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::Serialization {
            what: format!("policy file `{}`", path.display()),
            reason: e.to_string(),
        })?;
    let policy = json.get("policy").cloned().unwrap_or(json);
    serde_json::from_value(policy).map_err(|e| Error::Serialization {
        what: format!("wrapping policy in `{}`", path.display()),
        reason: e.to_string(),
    })
}

/// The input of `reshard`: a checkpoint of this crate.
fn reshard_input(input: &Path) -> Result<Input> {
    expect_input(
        "reshard",
        input,
        "a checkpoint of this crate (convert a DCP directory with --to fsdp first)",
        |i| i == Input::Checkpoint,
    )
}

/// `reshard IN OUT --world-size M [--policy P]`: the crate's checkpoint rewritten for another
/// world size and optionally another wrapping policy (a JSON `WrapPolicy`, or a DESC.json
/// whose `policy` is used), streamed with bounded memory.
///
/// Run by the processes of `pg` (`&Solo` for one; under `mpirun -np N fsdp-ckpt reshard …`
/// each writes its share of the output rank files with [`checkpoint::reshard`] and process 0
/// commits). The output is the same for any number of processes; a failure on any process
/// fails all of them with the same error and leaves `out` as it was. `p` reports this
/// process's share.
pub fn reshard(
    input: &Path,
    out: &Path,
    world_size: usize,
    policy: Option<&Path>,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    pg.agree(reshard_input(input))?;
    let policy = pg.agree(policy.map(read_policy).transpose())?;
    let saved = pg.agree(checkpoint::read_manifest(input))?;
    pg.on_root(|| {
        storage::check_dir_output(out, checkpoint::CHECKPOINT_DIR, &[input])?;
        clean_stale(p, out, Some(checkpoint::CHECKPOINT_DIR))
    })?;
    let total = saved.tensor_bytes() + saved.model_param_bytes();
    let share_total = (pg.world_size() == 1).then_some((total, Unit::Bytes));
    p.start(&phase("resharding", pg), share_total);
    let copied = checkpoint::reshard(input, out, world_size, policy.as_ref(), pg, |b| p.update(b));
    p.finish();
    let copied = copied?;
    Ok(Written {
        operation: "reshard",
        output: out.to_path_buf(),
        tensor_bytes: copied,
        count: None,
        world_size: Some(world_size),
        message: format!(
            "resharded {} -> {} for {world_size} ranks{}: {copied} bytes of tensor state",
            input.display(),
            out.display(),
            on_processes(pg)
        ),
    })
}
