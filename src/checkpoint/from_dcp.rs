//! Converting a DCP directory into the crate's checkpoint offline, without live ranks: each
//! output rank's shard is loaded from the directory as that rank would load it
//! ([`super::load_dcp`]) and written as that rank would save it ([`super::save`]'s rank
//! file), one rank at a time, so memory holds one rank's shard; the manifest and the commit
//! follow the save's protocol.
//! Split across an MPI job, output rank `r` is converted by process `r % N`.

use super::dcp::DcpOptimState;
use super::save::{commit, write_rank, Report, Reports, SaveOptions};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::optim_state::{OptimParams, OptimStateDict};
use std::path::Path;

/// Writes the crate's checkpoint of the optimizer state in the DCP directory `src` (as
/// PyTorch's `get_state_dict` + `dcp.save` or `Fsdp::save_dcp` wrote it, FSDP1 or FSDP2, at
/// any world size) for the ranks of `layout` into `dst`: the checkpoint every rank of a live
/// job writes by calling `load_dcp` then `save`, byte for byte. Committed atomically; `dst`
/// follows the replace rule of a save and must not overlap `src`.
///
/// The job is split across the processes of `pg` (`&Solo` for one process; each calls it
/// with the same arguments, the paths naming the same directories on every process): output
/// rank `r` is loaded and written by process `r % pg.world_size()`; process 0 creates the
/// temporary directory and, once every process reported its files, writes the manifest and
/// the commit marker and installs the directory. The result is the same for any number of
/// processes. A failure on any process fails every process with the lowest failing one's
/// error, and `dst` is left as it was.
pub fn dcp_to_checkpoint(
    src: &Path,
    dst: &Path,
    layout: &ModelLayout,
    pg: &dyn ProcessGroup,
) -> Result<()> {
    pg.agree(check_layout(layout))?;
    let opts = SaveOptions::default();
    let tmp = pg.on_root(|| super::prepare_output(dst, &[src]))?;
    let ranks: Vec<usize> = (pg.rank()..layout.world_size)
        .step_by(pg.world_size())
        .collect();
    let gathered = pg.all_gather_agreed(write_ranks(src, layout, &ranks, &tmp, &opts));
    pg.on_root(|| {
        let written = gathered.and_then(|all| {
            let reports = in_rank_order(all.into_iter().flatten().collect());
            commit(layout, reports, &tmp, dst, &opts)
        });
        if written.is_err() {
            crate::io::output::discard_tmp_dir(&tmp);
        }
        written
    })
}

/// A hybrid layout has replicas, which an offline conversion has no ranks for.
fn check_layout(layout: &ModelLayout) -> Result<()> {
    if layout.policy.sharding_strategy.is_hybrid() {
        return Err(Error::ConfigMismatch {
            what: "the sharding strategy of a DCP conversion".into(),
            expected: "a strategy without shard groups (the converted checkpoint holds one shard group's files)".into(),
            found: format!("{:?}", layout.policy.sharding_strategy),
        });
    }
    Ok(())
}

/// Loads and writes the rank files of `ranks` into `tmp`, one rank at a time (the directory
/// opened and checked once); each rank's report for the manifest, with its rank.
fn write_ranks(
    src: &Path,
    layout: &ModelLayout,
    ranks: &[usize],
    tmp: &Path,
    opts: &SaveOptions,
) -> Result<Vec<(usize, Report)>> {
    let params = OptimParams::of_model(layout);
    let dcp = DcpOptimState::open(src, layout)?;
    ranks
        .iter()
        .map(|&rank| {
            let osd: OptimStateDict = dcp.load(layout, rank, &params)?;
            let report = write_rank(layout, rank, &osd, &params, None, tmp, opts)?;
            Ok((rank, Some(report)))
        })
        .collect()
}

/// The reports of [`write_ranks`] in rank order, without their ranks (process `p` of a job
/// wrote ranks `p`, `p + N`, …).
fn in_rank_order(mut reports: Vec<(usize, Report)>) -> Reports {
    reports.sort_by_key(|(rank, _)| *rank);
    reports.into_iter().map(|(_, r)| r).collect()
}
