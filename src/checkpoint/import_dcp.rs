//! Converting a DCP directory into the crate's checkpoint offline, without live ranks, in
//! bounded memory: each output rank's state is planned as that rank would load it
//! ([`super::load_dcp`]) with every tensor standing for where its elements lie
//! ([`LazyTensor`]), so its file header and pieces are what that rank would save
//! ([`super::save`]'s rank file); then up to [`FILES_PER_PASS`] rank files are written in one
//! pass over the input, each piece streamed from the directory's chunks as it is written.
//! The manifest and the commit follow the save's protocol.
//!
//! Every rank file lists its pieces in one common order (parameters in model order, then
//! state, member and element); a pass writes the files' pieces in that order (always the
//! file whose next piece comes first), reading through one [`RangeReader`], which holds the
//! last chunk read: a chunk split between two output ranks of a pass is read once. Memory
//! holds that chunk, the one being read (so at most twice the largest tensor) and the files'
//! 1 MiB buffers.
//!
//! Split across an MPI job, output rank `r` is converted by process `r % N`.

use super::dcp::DcpOptimState;
use super::lazy::LazyTensor;
use super::manifest::CHECKSUM_BLOCK;
use super::rank_file::RankFile;
use super::save::{
    commit, dict_parts, plan_pieces, rank_file_header, rank_report, record_piece, states_to_save,
    DictParts, KeyedStates, Plan, Report, Reports, SaveOptions,
};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::io::dcp::{DcpCheckpoint, RangeReader};
use crate::optim_state::keys::Resolved;
use crate::optim_state::{OptimParams, OptimStateDict};
use std::path::Path;

/// How many output rank files one pass over the input writes at once (each an open file
/// with a 1 MiB buffer), as `reshard` does.
const FILES_PER_PASS: usize = 16;

/// Writes the crate's checkpoint of the optimizer state in the DCP directory `src` (as
/// PyTorch's `get_state_dict` + `dcp.save` or `Fsdp::save_dcp` wrote it, FSDP1 or FSDP2, at
/// any world size) for the ranks of `layout` into `dst`: the checkpoint every rank of a live
/// job writes by calling `load_dcp` then `save`, byte for byte. Committed atomically; `dst`
/// follows the replace rule of a save and must not overlap `src`.
///
/// Streamed: the output rank files are written up to 16 per pass over the input, each
/// chunk of the input read once per pass, so memory stays within about twice the largest
/// tensor plus 64 MiB whatever the model size.
///
/// The job is split across the processes of `pg` (`&Solo` for one process; each calls it
/// with the same arguments, the paths naming the same directories on every process): output
/// rank `r` is written by process `r % pg.world_size()`; process 0 creates the temporary
/// directory and, once every process reported its files, writes the manifest and the
/// commit marker and installs the directory. The result is the same for any number of
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
    let mine = write_ranks(src, layout, &ranks, &tmp).map(|(written, _)| written);
    let gathered = pg.all_gather_agreed(mine);
    pg.on_root(|| {
        let written = gathered.and_then(|all| {
            let reports = in_rank_order(all.into_iter().flatten().collect());
            commit(layout, reports, &tmp, dst, &opts)
        });
        if written.is_err() {
            crate::storage::discard_tmp_dir(&tmp);
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

/// Writes the rank files of `ranks` into `tmp`, [`FILES_PER_PASS`] per pass over the input
/// (the directory opened and checked once); each rank's report for the manifest, with its
/// rank, and how many chunks (or whole tensors) were read.
fn write_ranks(
    src: &Path,
    layout: &ModelLayout,
    ranks: &[usize],
    tmp: &Path,
) -> Result<(Vec<(usize, Report)>, u64)> {
    let params = OptimParams::of_model(layout);
    let dcp = DcpOptimState::opened(DcpCheckpoint::open(src)?.dropping_behind(), src, layout)?;
    let order = read_order(layout);
    let mut written = Vec::with_capacity(ranks.len());
    let mut units_read = 0;
    for pass in ranks.chunks(FILES_PER_PASS) {
        let mut files = pass
            .iter()
            .map(|&rank| PlannedRank::open(&dcp, layout, rank, &params, &order, tmp))
            .collect::<Result<Vec<_>>>()?;
        let mut reader = RangeReader::new(dcp.checkpoint());
        while let Some(i) = next_file(&files) {
            files[i].write_next(&mut reader)?;
        }
        reader.finish()?;
        units_read += reader.units_read();
        for f in files {
            written.push(f.finish()?);
        }
    }
    Ok((written, units_read))
}

/// Per model parameter: its place in the order every rank file lists its pieces in (the
/// position of its flat or original parameter in model order, and its member index), which
/// is the order a pass writes and reads in: `(place, state, member, first element)`.
fn read_order(layout: &ModelLayout) -> Vec<(usize, usize)> {
    let mut order = vec![(0, 0); layout.model.params.len()];
    for (pos, r) in layout.model_order().into_iter().enumerate() {
        match r {
            Resolved::Flat(f) => {
                for (m, member) in layout.flat_params[f].members.iter().enumerate() {
                    if let Some(p) = layout.param_index(&member.fqn) {
                        order[p] = (pos, m);
                    }
                }
            }
            Resolved::Orig { param, .. } => order[param] = (pos, 0),
        }
    }
    order
}

/// The file whose next piece comes first in the common order (ties to the lowest rank),
/// or `None` when every file is written.
fn next_file(files: &[PlannedRank]) -> Option<usize> {
    files
        .iter()
        .enumerate()
        .filter_map(|(i, f)| Some((f.order.get(f.next)?, i)))
        .min()
        .map(|(_, i)| i)
}

/// An output rank's file: its planned pieces (each a [`LazyTensor`] of the input), open
/// and written up to `next`.
struct PlannedRank {
    rank: usize,
    plan: Plan<LazyTensor>,
    offsets: Vec<u64>,
    report_params: KeyedStates,
    n_optim: usize,
    parts: Option<DictParts>,
    /// Per piece: (place, state, member, first element), see [`read_order`].
    order: Vec<(usize, usize, usize, usize)>,
    out: RankFile,
    /// The next piece to write.
    next: usize,
}

impl PlannedRank {
    /// Plans rank `rank`'s state as it would load it from the directory and save it, creates
    /// its file and writes the header.
    fn open(
        dcp: &DcpOptimState<'_>,
        layout: &ModelLayout,
        rank: usize,
        params: &OptimParams,
        read_order: &[(usize, usize)],
        tmp: &Path,
    ) -> Result<Self> {
        let osd: OptimStateDict<LazyTensor> = dcp.plan(layout, rank, params)?;
        let local = layout.local_params(params)?;
        let saved = states_to_save(rank, &osd, &local, &mut |t: &LazyTensor| Ok(t.clone()))?;
        let mut report_params: KeyedStates = Vec::new();
        let mut plan = Plan::default();
        plan_pieces(layout, rank, &saved, &mut report_params, &mut plan)?;
        let n_optim = report_params.len();
        let (header, offsets) = rank_file_header(rank, &mut plan, &report_params, n_optim)?;
        let parts = (rank == 0)
            .then(|| dict_parts(layout, &local, &osd))
            .transpose()?;
        let order = plan
            .at
            .iter()
            .map(|&(k, si, start, _)| {
                let fqn = &report_params[k].0.names[0];
                let (place, member) = layout
                    .param_index(fqn)
                    .and_then(|p| read_order.get(p).copied())
                    .unwrap_or_default();
                (place, si, member, start)
            })
            .collect();
        let total = plan.entries.iter().map(|e| e.nbytes).sum();
        let out = RankFile::create(tmp, rank, header, total)?;
        Ok(PlannedRank {
            rank,
            plan,
            offsets,
            report_params,
            n_optim,
            parts,
            order,
            out,
            next: 0,
        })
    }

    /// Streams the next piece into the file, checksumming its blocks as they pass.
    fn write_next(&mut self, reader: &mut RangeReader<'_>) -> Result<()> {
        let i = self.next;
        let mut crcs = BlockChecksums::default();
        let out = &mut self.out;
        self.plan.data[i].write_to(reader, &mut |bytes| {
            crcs.update(bytes);
            out.write(bytes).map(|_| ())
        })?;
        let at = self.plan.at[i];
        record_piece(
            &mut self.report_params,
            self.rank,
            at,
            self.offsets[i],
            crcs.finish(),
        );
        self.next += 1;
        Ok(())
    }

    /// Syncs the file; its rank and report for the manifest.
    fn finish(self) -> Result<(usize, Report)> {
        let file = self.out.finish()?;
        let report = rank_report(file, self.report_params, self.n_optim);
        Ok((self.rank, Some((report, self.parts))))
    }
}

/// The CRC-32C of each [`CHECKSUM_BLOCK`] of a piece, computed as its bytes pass in any
/// slicing: what `manifest::block_checksums` gives for the whole piece.
#[derive(Default)]
struct BlockChecksums {
    done: Vec<u32>,
    crc: u32,
    in_block: usize,
}

impl BlockChecksums {
    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (CHECKSUM_BLOCK - self.in_block).min(bytes.len());
            self.crc = crc32c::crc32c_append(self.crc, &bytes[..take]);
            self.in_block += take;
            bytes = &bytes[take..];
            if self.in_block == CHECKSUM_BLOCK {
                self.done.push(self.crc);
                (self.crc, self.in_block) = (0, 0);
            }
        }
    }

    fn finish(mut self) -> Vec<u32> {
        if self.in_block > 0 {
            self.done.push(self.crc);
        }
        self.done
    }
}

/// The reports of [`write_ranks`] in rank order, without their ranks (process `p` of a job
/// wrote ranks `p`, `p + N`, …).
fn in_rank_order(mut reports: Vec<(usize, Report)>) -> Reports {
    reports.sort_by_key(|(rank, _)| *rank);
    reports.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::manifest::block_checksums;

    #[test]
    fn block_checksums_of_a_piece_passed_in_any_slicing_are_those_of_the_whole() {
        let bytes: Vec<u8> = (0..(2 * CHECKSUM_BLOCK + 12345))
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        for slice in [1 << 20, CHECKSUM_BLOCK, 4097, bytes.len()] {
            let mut c = BlockChecksums::default();
            for part in bytes.chunks(slice) {
                c.update(part);
            }
            assert_eq!(c.finish(), block_checksums(&bytes), "slices of {slice}");
        }
        assert_eq!(BlockChecksums::default().finish(), block_checksums(&[]));
    }

    /// The PyTorch fixture's model (`tests/common::dcp_fixture_net`).
    fn fixture_net() -> crate::model::ModelDesc {
        let f = crate::tensor::DType::F32;
        crate::model::ModelDesc::new()
            .param("embed.weight", &[10, 4], f)
            .param("net1.0.weight", &[10, 4], f)
            .param("net1.0.bias", &[10], f)
            .param("net2.0.weight", &[3, 10], f)
            .param("net2.0.bias", &[3], f)
            .param("head.weight", &[10, 3], f)
            .param("out.weight", &[10, 4], f)
    }

    #[test]
    fn each_chunk_is_read_once_per_pass_however_many_output_ranks_share_it() {
        let src =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dcp/fsdp2_adam_ws4/ckpt");
        // Every row chunk of a positive-dim optimizer state (FSDP2 at 4 ranks: up to 4 per
        // tensor) holds elements some output rank needs.
        let md = DcpCheckpoint::open(&src).unwrap().metadata().clone();
        let chunks: u64 = md
            .entries
            .iter()
            .filter(|e| e.key.starts_with("optim.state."))
            .filter_map(|e| match &e.kind {
                crate::io::dcp::EntryKind::Tensor(t) if !t.size.is_empty() => Some(t),
                _ => None,
            })
            .map(|t| {
                t.chunks
                    .iter()
                    .filter(|c| c.sizes.iter().product::<usize>() > 0)
                    .count() as u64
            })
            .sum();
        assert!(chunks > 20, "{chunks}");
        for orig in [false, true] {
            let policy =
                crate::model::WrapPolicy::units(&["net1", "net2", ""]).with_orig_params(orig);
            // 3 and 5 ranks: one pass; 20 ranks: two passes (16 + 4).
            for (ws, passes) in [(3, 1), (5, 1), (20, 2)] {
                let layout = ModelLayout::new(&fixture_net(), &policy, ws).unwrap();
                let tmp = tempfile::tempdir().unwrap();
                let ranks: Vec<usize> = (0..ws).collect();
                let (written, units) = write_ranks(&src, &layout, &ranks, tmp.path()).unwrap();
                assert_eq!(written.len(), ws);
                let what = format!("{ws} ranks, use_orig_params={orig}");
                assert!(
                    units >= chunks && units <= passes * chunks,
                    "{what}: {units} of {chunks}"
                );
                if passes == 1 {
                    assert_eq!(units, chunks, "{what}");
                }
            }
        }
    }
}
