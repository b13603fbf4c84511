//! Writing a sharded checkpoint collectively: every saving rank writes its own data file into
//! a temporary directory, rank 0 merges the ranks' reports into the manifest, commits, and
//! swaps the directory into place.

use super::manifest::{
    block_checksums, commit_text, FileRecord, Manifest, ParamRecord, Piece, StoredValue, FORMAT,
    MANIFEST, MODEL_PARAM_STATE, VERSION,
};
use super::{sync_dir, GroupContext, COMMIT};
use crate::collectives::ProcessGroupExt;
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, ModelLayout, ShardPiece};
use crate::io::safetensors::header::Entry;
use crate::optim_state::consolidate::named_param_groups;
use crate::optim_state::keys::{LocalParam, OptimStateKey, Resolved};
use crate::optim_state::{OptimParams, OptimStateDict, ParamGroup, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where `SaveOptions::crash_at` stops a save, as if the process died there (fault injection
/// for the crate's crash-safety tests; public with the feature `fault-injection`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CrashPoint {
    /// After the temporary directory exists, before any data is written.
    BeforeData,
    /// Halfway through rank 0's data file.
    MidFile,
    /// After every data file is written and synced, before the manifest.
    BeforeManifest,
    /// After the manifest, before the commit marker and the rename.
    BeforeCommit,
}

/// Options of `save`: none to set today (`SaveOptions::default()`); the type exists so that
/// saving options can be added without changing every call.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SaveOptions {
    /// Fault injection for crash-safety tests: stop at this point as a crashed process would,
    /// leaving the temporary directory behind, and return `Error::InjectedCrash` on every
    /// rank (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub crash_at: Option<CrashPoint>,
}

#[cfg(feature = "fault-injection")]
impl SaveOptions {
    /// Sets `crash_at` (feature `fault-injection`).
    pub fn crash_at(mut self, point: Option<CrashPoint>) -> Self {
        self.crash_at = point;
        self
    }
}

/// What one rank contributes to the manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RankReport {
    file: FileRecord,
    /// (state key, state name, value) of every parameter this rank saved, in its order.
    params: Vec<(OptimStateKey, Vec<(String, LocalValue)>)>,
    /// The same for the model's parameter values, when the caller handed them over.
    model: Vec<(OptimStateKey, Vec<(String, LocalValue)>)>,
}

/// A local parameter with the values to save: host copies (views for HostTensor), or
/// [`super::lazy::LazyTensor`]s when a DCP directory is converted.
pub(super) type Saved<'l, T = HostTensor> = Vec<(&'l LocalParam, Vec<(String, Value<T>)>)>;

/// A saved tensor whose element ranges become a rank file's pieces.
pub(super) trait Pieces: Tensor {
    /// One piece's data: borrowed bytes of a host tensor, a narrowed view otherwise.
    type Piece<'a>
    where
        Self: 'a;

    /// Elements `start..start + len` of the flattening.
    fn piece(&self, start: usize, len: usize) -> Result<Self::Piece<'_>>;
}

impl Pieces for HostTensor {
    type Piece<'a> = &'a [u8];

    fn piece(&self, start: usize, len: usize) -> Result<&[u8]> {
        let size = self.dtype().size();
        self.as_bytes()
            .get(start * size..(start + len) * size)
            .ok_or_else(|| Error::OutOfBounds {
                context: format!("a piece of a {:?} tensor", self.shape()),
                start,
                end: start + len,
                numel: self.numel(),
            })
    }
}

/// Per parameter: its state key and state values (flat, sharded, as the optimizer holds them).
pub(super) type KeyedStates = Vec<(OptimStateKey, Vec<(String, LocalValue)>)>;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum LocalValue {
    Value(Value<HostTensor>),
    Tensor {
        dtype: DType,
        shape: Vec<usize>,
        pieces: Vec<Piece>,
    },
}

/// Rank 0's extra contribution: the dict-level parts that do not depend on shards.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct DictParts {
    named: bool,
    pub(super) param_groups: Option<Vec<ParamGroup<HostTensor>>>,
    pub(super) user_state: Vec<(ParamKey, ParamState<HostTensor>)>,
}

/// Whether the test hook asks the save to stop at `point` (never without the feature
/// `fault-injection`).
pub(super) fn crashes_at(opts: &SaveOptions, point: CrashPoint) -> bool {
    #[cfg(feature = "fault-injection")]
    return opts.crash_at == Some(point);
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = (opts, point);
        false
    }
}

/// Stops here, as a crashed process would, when the test hook asks for `point`: the
/// temporary directory stays, and the error is `Error::InjectedCrash`.
pub(super) fn crash_point(opts: &SaveOptions, point: CrashPoint) -> Result<()> {
    #[cfg(feature = "fault-injection")]
    if opts.crash_at == Some(point) {
        return Err(Error::InjectedCrash {
            point: format!("{point:?}"),
        });
    }
    #[cfg(not(feature = "fault-injection"))]
    let _ = (opts, point);
    Ok(())
}

/// Whether a failed save leaves its temporary directory for a test to inspect (a crash the
/// test hook injected).
pub(super) fn keeps_tmp(opts: &SaveOptions) -> bool {
    #[cfg(feature = "fault-injection")]
    return opts.crash_at.is_some();
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = opts;
        false
    }
}

/// Saves this rank's local optimizer state `osd` (for the optimizer described by `params`)
/// into the checkpoint directory `dir`. Collective over `pg`, whose rank 0 commits;
/// `layout_rank` is this rank's rank in the layout's shard group and `writer` says whether it
/// writes a data file (with hybrid sharding only the first replica group does).
///
/// `model`, when given, is this rank's parameter tensors aligned with the ids of
/// `OptimParams::of_model(&layout)` (what [`crate::param_shards::shard_tensors`]
/// cuts for them; `None` entries are not saved); they are stored beside the optimizer state
/// and read back by [`super::load_model_params`].
///
/// The previous checkpoint at `dir`, if any, stays complete and loadable until the new one
/// replaces it in one atomic exchange. `dir` must be missing, an empty directory or a
/// committed checkpoint holding nothing else; anything else is [`Error::OutputRefused`] on
/// every rank, and nothing is written ([`crate::storage::check_dir_output`]).
pub(crate) fn save<T: Tensor>(
    ctx: GroupContext<'_>,
    osd: &OptimStateDict<T>,
    params: &OptimParams,
    model: Option<&[Option<T>]>,
    dir: &Path,
    opts: &SaveOptions,
) -> Result<()> {
    let GroupContext {
        layout,
        layout_rank,
        writes_files: writer,
        pg,
    } = ctx;
    let rank = pg.rank();
    // 1. Rank 0 creates the temporary directory beside `dir`; every rank learns it, or its error.
    let tmp = (rank == 0).then(|| super::prepare_output(dir, &[]));
    let tmp: PathBuf = pg.broadcast_agreed(tmp.as_ref(), 0)?;
    // 2. Each writer writes its file; every rank learns every report, or the first failure.
    let report = if writer {
        write_rank(layout, layout_rank, osd, params, model, &tmp, opts).map(Some)
    } else {
        Ok(None)
    };
    let reports = pg.all_gather_agreed(report);
    // 3. Rank 0 merges, writes the manifest and commits, or removes the temporary directory;
    //    every rank learns the outcome.
    let outcome = (rank == 0).then(|| {
        let result = reports.and_then(|reports| commit(layout, reports, &tmp, dir, opts));
        if result.is_err() && !keeps_tmp(opts) {
            crate::storage::discard_tmp_dir(&tmp);
        }
        result
    });
    pg.broadcast_agreed(outcome.as_ref(), 0)
}

/// One rank's pieces: which bytes of which local tensor go where (`P`: each piece's data).
pub(super) struct Plan<P> {
    pub(super) entries: Vec<Entry>,
    pub(super) data: Vec<P>,
    /// Per entry: (state key, state name, element start, element len).
    pub(super) at: Vec<(usize, usize, usize, usize)>,
}

impl<P> Default for Plan<P> {
    fn default() -> Self {
        Plan {
            entries: Vec::new(),
            data: Vec::new(),
            at: Vec::new(),
        }
    }
}

/// Writes this rank's data file into `tmp` and returns its report for the manifest (and, on
/// layout rank 0, the dict-level parts): host copies of the state, the plan of pieces, the
/// file, the report.
pub(super) fn write_rank<T: Tensor>(
    layout: &ModelLayout,
    layout_rank: usize,
    osd: &OptimStateDict<T>,
    params: &OptimParams,
    model: Option<&[Option<T>]>,
    tmp: &Path,
    opts: &SaveOptions,
) -> Result<(RankReport, Option<DictParts>)> {
    crash_point(opts, CrashPoint::BeforeData)?;
    let local = layout.local_params(params)?;
    // Host copies of the local tensors (views for HostTensor), kept alive while writing.
    let saved = host_states(layout_rank, osd, &local)?;
    let model_local = match model {
        Some(_) => layout.local_params(&OptimParams::of_model(layout))?,
        None => Vec::new(),
    };
    let model_saved = model
        .map(|m| host_model_params(layout_rank, m, &model_local))
        .transpose()?
        .unwrap_or_default();
    // Per saved key: its member keys (flat) or itself, with the element ranges this rank holds.
    let mut report_params: KeyedStates = Vec::new();
    let mut plan = Plan::default();
    plan_pieces(layout, layout_rank, &saved, &mut report_params, &mut plan)?;
    let n_optim = report_params.len();
    plan_pieces(
        layout,
        layout_rank,
        &model_saved,
        &mut report_params,
        &mut plan,
    )?;
    let file = write_data_file(
        layout_rank,
        &mut plan,
        &mut report_params,
        n_optim,
        tmp,
        opts,
    )?;
    let parts = (layout_rank == 0)
        .then(|| dict_parts(layout, &local, osd))
        .transpose()?;
    Ok((rank_report(file, report_params, n_optim), parts))
}

/// The report of a written rank file: its record, and the states of its parameters (the
/// first `n_optim` optimizer state, the rest model parameters) that have any.
pub(super) fn rank_report(
    file: FileRecord,
    mut report_params: KeyedStates,
    n_optim: usize,
) -> RankReport {
    let nonempty = |v: KeyedStates| v.into_iter().filter(|(_, v)| !v.is_empty()).collect();
    RankReport {
        file,
        model: nonempty(report_params.split_off(n_optim)),
        params: nonempty(report_params),
    }
}

/// Host copies (views for HostTensor) of the state of every local parameter this rank saves:
/// unmanaged state is the same everywhere, so only layout rank 0 saves it.
pub(super) fn host_states<'l, T: Tensor>(
    layout_rank: usize,
    osd: &OptimStateDict<T>,
    local: &'l [LocalParam],
) -> Result<Saved<'l>> {
    states_to_save(layout_rank, osd, local, &mut |t: &T| t.to_host())
}

/// [`host_states`] with each value made by `to_save`.
pub(super) fn states_to_save<'l, T: Tensor, U: Tensor>(
    layout_rank: usize,
    osd: &OptimStateDict<T>,
    local: &'l [LocalParam],
    to_save: &mut impl FnMut(&T) -> Result<U>,
) -> Result<Saved<'l, U>> {
    let mut saved: Saved<U> = Vec::new();
    for l in local {
        let Some(st) = osd.state.get(&l.key) else {
            continue;
        };
        if matches!(l.resolved, Resolved::Orig { owner: None, .. }) && layout_rank != 0 {
            continue;
        }
        let mut vals = Vec::with_capacity(st.len());
        for (n, v) in st {
            if let Value::Sharded(_) = v {
                return Err(Error::WrongStateKind {
                    context: format!("saving a checkpoint, rank {layout_rank}"),
                    param: l.key.to_string(),
                    state: n.clone(),
                    expected: "a plain tensor (save takes the optimizer's own state dict)".into(),
                    found: "a sharded tensor".into(),
                });
            }
            vals.push((n.clone(), v.try_map(to_save)?));
        }
        saved.push((l, vals));
    }
    Ok(saved)
}

/// The model's parameters as one more state ([`MODEL_PARAM_STATE`]) of every parameter, host
/// copies aligned with `model_local`.
pub(super) fn host_model_params<'l, T: Tensor>(
    layout_rank: usize,
    model: &[Option<T>],
    model_local: &'l [LocalParam],
) -> Result<Saved<'l>> {
    if model.len() != model_local.len() {
        return Err(Error::InvalidArgument {
            op: "save_checkpoint".into(),
            rank: layout_rank,
            reason: format!(
                "{} model parameter tensors given, expected {} (one per parameter of `Fsdp::optim_params()`, as `param_shards::shard_tensors` cuts them)",
                model.len(),
                model_local.len()
            ),
        });
    }
    let mut saved: Saved = Vec::new();
    for (l, t) in model_local.iter().zip(model) {
        let Some(t) = t else { continue };
        if matches!(l.resolved, Resolved::Orig { owner: None, .. }) && layout_rank != 0 {
            continue;
        }
        let v = Value::Tensor(t.to_host()?);
        saved.push((l, vec![(MODEL_PARAM_STATE.to_string(), v)]));
    }
    Ok(saved)
}

/// Writes `rank{layout_rank}.safetensors` into `tmp`: the header naming every planned piece,
/// then the pieces back to back, recording each piece's offset and checksums in
/// `report_params`. Returns the file's record.
fn write_data_file(
    layout_rank: usize,
    plan: &mut Plan<&[u8]>,
    report_params: &mut KeyedStates,
    n_optim: usize,
    tmp: &Path,
    opts: &SaveOptions,
) -> Result<FileRecord> {
    let (header, offsets) = rank_file_header(layout_rank, plan, report_params, n_optim)?;
    let name = format!("rank{layout_rank}.safetensors");
    let path = tmp.join(&name);
    let mut file = File::create(&path).map_err(Error::io("creating", &path))?;
    file.write_all(&header)
        .map_err(Error::io("writing", &path))?;
    let total: u64 = plan.entries.iter().map(|e| e.nbytes).sum();
    let mut written = 0u64;
    let mut writeback = super::Writeback::new(header.len() as u64);
    for (i, bytes) in plan.data.iter().enumerate() {
        if layout_rank == 0 && written * 2 >= total && crashes_at(opts, CrashPoint::MidFile) {
            file.sync_all().map_err(Error::io("syncing", &path))?;
            crash_point(opts, CrashPoint::MidFile)?;
        }
        // In slices, so that the disk writes one slice back while the next is copied.
        for slice in bytes.chunks(super::WRITEBACK_CHUNK) {
            file.write_all(slice).map_err(Error::io("writing", &path))?;
            writeback
                .wrote(&file, slice.len() as u64)
                .map_err(Error::io("writing", &path))?;
        }
        written += bytes.len() as u64;
        let crcs = block_checksums(bytes);
        record_piece(report_params, layout_rank, plan.at[i], offsets[i], crcs);
    }
    if layout_rank == 0 {
        crash_point(opts, CrashPoint::MidFile)?;
    }
    file.sync_all().map_err(Error::io("syncing", &path))?;
    Ok(FileRecord {
        name,
        len: header.len() as u64 + total,
        header_len: header.len() as u64,
        header_crc32c: crc32c::crc32c(&header),
    })
}

/// Names the planned entries (`{param}/{state}/{start}`, model parameters under
/// [`MODEL_ENTRY_PREFIX`]) and builds rank `layout_rank`'s file header; each entry's data
/// offset.
pub(super) fn rank_file_header<P>(
    layout_rank: usize,
    plan: &mut Plan<P>,
    report_params: &KeyedStates,
    n_optim: usize,
) -> Result<(Vec<u8>, Vec<u64>)> {
    for (e, &(k, si, start, _)) in plan.entries.iter_mut().zip(&plan.at) {
        let (state, _) = &report_params[k].1[si];
        let section = if k >= n_optim { MODEL_ENTRY_PREFIX } else { "" };
        e.name = format!("{section}{}/{state}/{start}", report_params[k].0.names[0]);
    }
    super::rank_file::header(layout_rank, &plan.entries)
}

/// Records the written piece `at` (state key, state name, start, len) of rank file `file`,
/// at byte `offset`, with its block checksums.
pub(super) fn record_piece(
    report_params: &mut KeyedStates,
    file: usize,
    (k, state, start, len): (usize, usize, usize, usize),
    offset: u64,
    crc32c: Vec<u32>,
) {
    let piece = Piece {
        file,
        start,
        len,
        offset,
        crc32c,
    };
    if let Some((_, LocalValue::Tensor { pieces, .. })) = report_params[k].1.get_mut(state) {
        pieces.push(piece);
    }
}

/// Prefix of the data-file entry names of model parameter pieces (`@param/{name}/param/{start}`);
/// `@` appears in no parameter name, so they never collide with optimizer state entries.
pub(super) const MODEL_ENTRY_PREFIX: &str = "@param/";

/// Queues the pieces of `saved` (local parameters with their host values) that this rank
/// holds, adding each parameter's (member) keys and state slots to `report`.
pub(super) fn plan_pieces<'a, T: Pieces>(
    layout: &ModelLayout,
    layout_rank: usize,
    saved: &'a Saved<T>,
    report_params: &mut KeyedStates,
    plan: &mut Plan<T::Piece<'a>>,
) -> Result<()> {
    for (l, vals) in saved {
        match l.resolved {
            Resolved::Flat(f) => {
                let fl = &layout.flat_params[f];
                plan_flat_pieces(fl, layout_rank, vals, report_params, plan)?;
            }
            Resolved::Orig { param, owner } => {
                let shape = &layout.model.params[param].shape;
                let numel: usize = shape.iter().product();
                let (start, want) = match owner {
                    Some((f, m)) if layout.flat_params[f].sharded => {
                        let info = layout.flat_params[f].shard(layout_rank).params[m];
                        (info.intra_param_start_idx, info.numel_in_shard)
                    }
                    _ => (0, numel),
                };
                let local = OrigShard {
                    key: &l.skey,
                    shape,
                    start,
                    want,
                };
                plan_orig_pieces(&local, layout_rank, vals, report_params, plan)?;
            }
        }
    }
    Ok(())
}

/// The state of one flat parameter's local shard: every member gets a key and every state's
/// name; a tensor state is cut at the shard's member boundaries (padding skipped) into pieces.
fn plan_flat_pieces<'a, T: Pieces>(
    fl: &FlatParamLayout,
    layout_rank: usize,
    vals: &'a [(String, Value<T>)],
    report_params: &mut KeyedStates,
    plan: &mut Plan<T::Piece<'a>>,
) -> Result<()> {
    let c = fl.shard_numel();
    let first = report_params.len();
    for m in &fl.members {
        let key = OptimStateKey {
            names: vec![m.fqn.clone()],
            managed: true,
        };
        report_params.push((key, Vec::new()));
    }
    let pieces = fl.shard_pieces(layout_rank);
    for (n, v) in vals {
        let t = match v {
            Value::Tensor(t) if t.dim() > 0 => t,
            // Scalars are shared by every member of the flat parameter.
            _ => {
                let v = v.try_map(&mut |t: &T| t.to_host())?;
                for (_, list) in &mut report_params[first..] {
                    list.push((n.clone(), LocalValue::Value(v.clone())));
                }
                continue;
            }
        };
        if t.shape() != [c] {
            return Err(Error::ShapeMismatch {
                context: format!(
                    "state `{n}` of the flat parameter of unit `{}` on rank {layout_rank} (a local shard has {c} elements)",
                    fl.unit
                ),
                expected: vec![c],
                found: t.shape().to_vec(),
            });
        }
        // Every member gets the state's name, holding elements here or not.
        for (mi, m) in fl.members.iter().enumerate() {
            tensor_slot(&mut report_params[first + mi].1, n, t.dtype(), &m.shape);
        }
        let mut pos = 0;
        for piece in &pieces {
            match *piece {
                ShardPiece::Padding(len) => pos += len,
                ShardPiece::Member { member, start, len } => {
                    let data = t.piece(pos, len)?;
                    pos += len;
                    let k = first + member;
                    let si = tensor_slot(
                        &mut report_params[k].1,
                        n,
                        t.dtype(),
                        &fl.members[member].shape,
                    );
                    push_entry(plan, (k, si, start, len), t.dtype(), data);
                }
            }
        }
    }
    Ok(())
}

/// Where one original parameter's local state lies: its key, full shape, and the element
/// range `start..start + want` this rank holds.
struct OrigShard<'k> {
    key: &'k OptimStateKey,
    shape: &'k [usize],
    start: usize,
    want: usize,
}

/// The state of one original parameter (`use_orig_params`, or unmanaged): one piece per
/// tensor state, holding this rank's elements.
fn plan_orig_pieces<'a, T: Pieces>(
    local: &OrigShard<'_>,
    layout_rank: usize,
    vals: &'a [(String, Value<T>)],
    report_params: &mut KeyedStates,
    plan: &mut Plan<T::Piece<'a>>,
) -> Result<()> {
    let OrigShard {
        key,
        shape,
        start,
        want,
    } = *local;
    let k = report_params.len();
    report_params.push((key.clone(), Vec::new()));
    for (n, v) in vals {
        match v {
            Value::Tensor(t) if t.dim() > 0 => {
                if t.numel() != want {
                    return Err(Error::ShapeMismatch {
                        context: format!(
                            "state `{n}` of parameter `{}` on rank {layout_rank} (its shard holds {want} elements)",
                            key.names[0]
                        ),
                        expected: vec![want],
                        found: t.shape().to_vec(),
                    });
                }
                let si = tensor_slot(&mut report_params[k].1, n, t.dtype(), shape);
                if want > 0 {
                    push_entry(plan, (k, si, start, want), t.dtype(), t.piece(0, want)?);
                }
            }
            other => report_params[k].1.push((
                n.clone(),
                LocalValue::Value(other.try_map(&mut |t: &T| t.to_host())?),
            )),
        }
    }
    Ok(())
}

/// The position of tensor state `name` in a parameter's list, added (without pieces) if
/// absent.
fn tensor_slot(
    list: &mut Vec<(String, LocalValue)>,
    name: &str,
    dtype: DType,
    shape: &[usize],
) -> usize {
    if let Some(i) = list.iter().position(|(n, _)| n == name) {
        return i;
    }
    list.push((
        name.to_string(),
        LocalValue::Tensor {
            dtype,
            shape: shape.to_vec(),
            pieces: Vec::new(),
        },
    ));
    list.len() - 1
}

/// Queues `bytes` (elements `at.2..at.2 + at.3` of state `at.1` of parameter `at.0`).
fn push_entry<P>(plan: &mut Plan<P>, at: (usize, usize, usize, usize), dtype: DType, data: P) {
    plan.entries.push(Entry {
        name: String::new(),
        dtype,
        shape: vec![at.3],
        nbytes: (at.3 * dtype.size()) as u64,
    });
    plan.data.push(data);
    plan.at.push(at);
}

/// Rank 0's param groups (by names) and user state, as `full_optim_state_dict` returns them.
pub(super) fn dict_parts<T: Tensor>(
    layout: &ModelLayout,
    local: &[LocalParam],
    osd: &OptimStateDict<T>,
) -> Result<DictParts> {
    let by_key: HashMap<&ParamKey, &LocalParam> = local.iter().map(|l| (&l.key, l)).collect();
    let param_groups =
        named_param_groups("saving a checkpoint", local, osd.param_groups.as_deref())?
            .map(|groups| {
                groups
                    .iter()
                    .map(|g| g.try_map(&mut |t: &T| t.to_host()))
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
    let flat_fqns: BTreeSet<String> = layout.flat_params.iter().map(|f| f.fqn()).collect();
    let mut user_state = Vec::new();
    for (k, st) in &osd.state {
        let owned = by_key.contains_key(k) || k.as_name().is_some_and(|n| flat_fqns.contains(n));
        if !owned {
            let st: ParamState<HostTensor> = st
                .iter()
                .map(|(n, v)| Ok((n.clone(), v.try_map(&mut |t: &T| t.to_host())?)))
                .collect::<Result<_>>()?;
            user_state.push((k.clone(), st));
        }
    }
    let named = local.iter().any(|l| matches!(l.key, ParamKey::Name(_)));
    Ok(DictParts {
        named,
        param_groups,
        user_state,
    })
}

/// One rank's report (with the dict-level parts on layout rank 0), `None` for a rank that
/// writes no file.
pub(super) type Report = Option<(RankReport, Option<DictParts>)>;

/// Every rank's report, in rank order.
pub(super) type Reports = Vec<Report>;

pub(super) fn commit(
    layout: &ModelLayout,
    reports: Reports,
    tmp: &Path,
    dir: &Path,
    opts: &SaveOptions,
) -> Result<()> {
    let mut ranks: Vec<RankReport> = Vec::new();
    let mut parts = None;
    for (report, p) in reports.into_iter().flatten() {
        if p.is_some() {
            parts = p;
        }
        ranks.push(report);
    }
    let parts = parts.ok_or_else(|| Error::InvalidCollective {
        op: "save".into(),
        rank: 0,
        reason: "no rank with layout rank 0 wrote a data file".into(),
    })?;
    crash_point(opts, CrashPoint::BeforeManifest)?;
    let manifest = merge(layout, ranks, parts)?;
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Serialization {
        what: "checkpoint manifest".into(),
        reason: e.to_string(),
    })?;
    write_synced(&tmp.join(MANIFEST), &bytes)?;
    crash_point(opts, CrashPoint::BeforeCommit)?;
    write_synced(&tmp.join(COMMIT), commit_text(&bytes).as_bytes())?;
    sync_dir(tmp)?;
    super::install(tmp, dir)
}

pub(super) use crate::storage::write_synced;

/// Merges the ranks' reports into the manifest: per parameter, the same state names and
/// scalar values on every rank, tensor pieces that tile the parameter, in the key order of
/// `full_optim_state_dict`.
fn merge(layout: &ModelLayout, ranks: Vec<RankReport>, parts: DictParts) -> Result<Manifest> {
    let files: Vec<FileRecord> = ranks.iter().map(|r| r.file.clone()).collect();
    let (optim, model): (Vec<KeyedStates>, Vec<KeyedStates>) =
        ranks.into_iter().map(|r| (r.params, r.model)).unzip();
    let (mut order, merged) = merge_ranks(optim)?;
    // Key order: rank 0's order with use_orig_params=False; sorted keys otherwise (unmanaged
    // first, then flat parameters in first-appearance order, as consolidation does).
    if layout.use_orig_params() {
        order.sort();
        let mut unmanaged: Vec<OptimStateKey> = Vec::new();
        let mut groups: Vec<(usize, Vec<OptimStateKey>)> = Vec::new();
        for k in order {
            let flat = layout
                .param_index(&k.names[0])
                .and_then(|i| match layout.ownership[i] {
                    crate::flat_param::Ownership::Flat { flat, .. } => Some(flat),
                    crate::flat_param::Ownership::Unmanaged => None,
                });
            match flat {
                Some(f) if k.managed => match groups.iter_mut().find(|(g, _)| *g == f) {
                    Some((_, ks)) => ks.push(k),
                    None => groups.push((f, vec![k])),
                },
                _ => unmanaged.push(k),
            }
        }
        order = unmanaged;
        order.extend(groups.into_iter().flat_map(|(_, ks)| ks));
    }
    let params = records(order, merged);
    // Model parameters in model order.
    let (mut model_order, model_merged) = merge_ranks(model)?;
    model_order.sort_by_key(|k| layout.param_index(&k.names[0]));
    let model_params = records(model_order, model_merged);
    Ok(Manifest {
        format: FORMAT.into(),
        version: VERSION,
        model: layout.model.clone(),
        policy: layout.policy.clone(),
        world_size: layout.world_size,
        named: parts.named,
        files,
        params,
        param_groups: parts.param_groups,
        user_state: parts.user_state,
        model_params,
    })
}

/// Per state key, the state values of every rank merged (pieces collected, scalars checked
/// equal), with the keys in first-appearance order.
#[allow(clippy::type_complexity)]
fn merge_ranks(
    lists: Vec<KeyedStates>,
) -> Result<(
    Vec<OptimStateKey>,
    HashMap<OptimStateKey, Vec<(String, StoredValue, usize)>>,
)> {
    let mut order: Vec<OptimStateKey> = Vec::new();
    let mut merged: HashMap<OptimStateKey, Vec<(String, StoredValue, usize)>> = HashMap::new();
    for (r, list) in lists.into_iter().enumerate() {
        for (key, vals) in list {
            let entry = match merged.get_mut(&key) {
                Some(e) => e,
                None => {
                    order.push(key.clone());
                    merged.entry(key.clone()).or_default()
                }
            };
            let first_rank = entry.is_empty();
            for (n, v) in vals {
                match entry.iter_mut().find(|(en, _, _)| *en == n) {
                    None if first_rank => entry.push((n, to_stored(v), r)),
                    None => {
                        return Err(Error::MissingState {
                            context: format!("rank {} (rank {r} has it)", entry[0].2),
                            param: format!("`{}`", key.names[0]),
                            state: n,
                        })
                    }
                    Some((_, stored, r0)) => match (stored, v) {
                        (
                            StoredValue::Tensor { pieces, .. },
                            LocalValue::Tensor { pieces: p, .. },
                        ) => pieces.extend(p),
                        (StoredValue::Value(a), LocalValue::Value(b)) if a.same_scalar(&b) => {}
                        (StoredValue::Value(a), LocalValue::Value(b)) => {
                            return Err(Error::ScalarStateMismatch {
                                state: n,
                                params: vec![
                                    format!("{} on rank {r0}", key.names[0]),
                                    format!("{} on rank {r}", key.names[0]),
                                ],
                                values: vec![a.render(), b.render()],
                            })
                        }
                        _ => {
                            return Err(Error::DifferingStateTypes {
                                state: n,
                                params: vec![key.names[0].clone()],
                                kinds: vec![format!("rank {r0}"), format!("rank {r}")],
                            })
                        }
                    },
                }
            }
        }
    }
    Ok((order, merged))
}

/// The manifest records of merged keys, in `order`, pieces sorted.
fn records(
    order: Vec<OptimStateKey>,
    mut merged: HashMap<OptimStateKey, Vec<(String, StoredValue, usize)>>,
) -> Vec<ParamRecord> {
    let mut params = Vec::with_capacity(order.len());
    for key in order {
        let vals = merged.remove(&key).unwrap_or_default();
        let mut states = Vec::with_capacity(vals.len());
        for (n, mut v, _) in vals {
            if let StoredValue::Tensor { pieces, .. } = &mut v {
                pieces.sort_by_key(|p| p.start);
            }
            states.push((n, v));
        }
        params.push(ParamRecord {
            name: key.names[0].clone(),
            states,
        });
    }
    params
}

fn to_stored(v: LocalValue) -> StoredValue {
    match v {
        LocalValue::Value(v) => StoredValue::Value(v),
        LocalValue::Tensor {
            dtype,
            shape,
            pieces,
        } => StoredValue::Tensor {
            dtype,
            shape,
            pieces,
        },
    }
}
