//! Saving and loading PyTorch Distributed Checkpoint (DCP) directories from live ranks,
//! collectively, in the keys PyTorch's `get_state_dict` + `dcp.save` write for the same model
//! (`model.<fqn>`, `optim.state.<fqn>.<name>`, `optim.param_groups.<i>.<option>`), with every
//! tensor's global shape the original parameter's, so that `dcp.load` + `set_state_dict` load
//! it into FSDP1 or FSDP2 models at any world size.
//!
//! One placement model serves both directions: per tensor, a list of (file, global N-D box)
//! pieces. Saving, each rank turns the element ranges of the original parameters it holds
//! (the pieces [`super::save`] plans for the crate's own format) into boxes
//! ([`crate::io::dcp::flat_range_boxes`]: a partial first row, whole rows, a partial last
//! row) and writes only those, so no tensor bytes move between ranks. The protocol is the
//! one of [`super::save`]: rank 0 prepares a temporary sibling directory; every writer writes
//! `__{rank}_0.distcp` and reports its chunks; the reports are all-gathered with the first
//! error agreed by every rank; rank 0 checks that each tensor's boxes tile its shape, writes
//! `.metadata` last, syncs and renames the directory into place under the replace rule
//! ([`crate::io::dcp::DCP_DIR`]); every rank gets rank 0's outcome.

use super::save::{
    dict_parts, host_model_params, host_states, plan_pieces, KeyedStates, LocalValue, Plan,
};
use super::GroupContext;
use crate::collectives::ProcessGroupExt;
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::io::dcp::{self, Chunk, DcpCheckpoint, EntryKind, PathItem, Record, StoredChunk};
use crate::io::torch_save::{self, PyObj};
use crate::optim_state::flatten::{
    flat_param_state_with, flatten_from_source, flatten_tensor_parts, orig_param_state_for_rank,
    ShardSource,
};
use crate::optim_state::{OptimParams, OptimStateDict, ParamState, Value};
use crate::tensor::{DType, HostTensor, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::lazy::LazyTensor;

/// Where a stored value sits in the nested state dict `get_state_dict` returns.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
enum Slot {
    /// `model.<fqn>`.
    Model(String),
    /// `optim.state.<fqn>.<name>`.
    State(String, String),
    /// `optim.param_groups.<i>.<option>`.
    Group(usize, String),
}

impl Slot {
    /// DCP's flattened key.
    fn key(&self) -> String {
        match self {
            Slot::Model(f) => format!("model.{f}"),
            Slot::State(f, n) => format!("optim.state.{f}.{n}"),
            Slot::Group(i, o) => format!("optim.param_groups.{i}.{o}"),
        }
    }

    /// Its path in the nested dict (`planner_data`).
    fn path(&self) -> Vec<PathItem> {
        let k = |s: &str| PathItem::Key(s.to_string());
        match self {
            Slot::Model(f) => vec![k("model"), k(f)],
            Slot::State(f, n) => vec![k("optim"), k("state"), k(f), k(n)],
            Slot::Group(i, o) => vec![k("optim"), k("param_groups"), PathItem::Index(*i), k(o)],
        }
    }
}

/// A key's kind: a tensor of this dtype and global shape, or a pickled object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    Tensor { dtype: DType, shape: Vec<usize> },
    Object,
}

/// One stored chunk, as a rank reports it to rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ChunkRecord {
    /// Index of the key in the rank's `keys`.
    key: usize,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    offset: u64,
    length: u64,
}

/// What one rank wrote: the keys it knows (every key of every parameter it holds state for,
/// holding elements here or not) and its chunks in `file`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RankChunks {
    file: String,
    keys: Vec<(Slot, Kind)>,
    chunks: Vec<ChunkRecord>,
}

/// Saves this rank's local optimizer state `osd` (for the optimizer `params` describes) and,
/// when given, its model parameters (aligned with `OptimParams::of_model`, as for
/// [`super::save`]) as the DCP directory `dir`. Collective over `ctx.pg`; every rank returns
/// the same outcome. `dir` must be missing, empty, or an earlier DCP directory holding
/// nothing else.
pub(crate) fn save_dcp<T: Tensor>(
    ctx: GroupContext<'_>,
    osd: &OptimStateDict<T>,
    params: &OptimParams,
    model: Option<&[Option<T>]>,
    dir: &Path,
) -> Result<()> {
    save_protocol(ctx.pg.as_ref(), dir, |tmp| {
        if ctx.writes_files {
            write_rank(ctx, osd, params, model, tmp).map(Some)
        } else {
            Ok(None)
        }
    })
}

/// Saves a name-keyed sharded optimizer state dict (what `get_optimizer_state_dict` gives
/// without `full_state_dict`: each [`Value::Sharded`] state this rank's box of the whole
/// tensor; anything else the same on every rank) as the DCP directory `dir`, as
/// `dcp.save({"optim": osd})` does. Each rank writes its boxes; rank 0 also writes the values
/// stored whole and the param groups. Collective over `pg`; the protocol and the replace rule
/// are [`save_dcp`]'s.
///
/// `model`, when given, is a sharded model state dict (`{fqn: value}`, as
/// `get_model_state_dict` gives it) saved beside, under `model.<fqn>`.
pub(crate) fn save_sharded_dcp<T: Tensor>(
    pg: &dyn crate::collectives::ProcessGroup,
    osd: &OptimStateDict<T>,
    model: Option<&indexmap::IndexMap<String, Value<T>>>,
    dir: &Path,
) -> Result<()> {
    save_protocol(pg, dir, |tmp| {
        write_sharded_rank(pg.rank(), osd, model, tmp).map(Some)
    })
}

/// The save protocol: rank 0 prepares the temporary directory, every rank writes its part
/// (`write`, `None` for a rank that writes nothing), the reports are all-gathered with the
/// first error agreed, rank 0 commits; every rank returns rank 0's outcome.
fn save_protocol(
    pg: &dyn crate::collectives::ProcessGroup,
    dir: &Path,
    write: impl FnOnce(&Path) -> Result<Option<RankChunks>>,
) -> Result<()> {
    let rank = pg.rank();
    // 1. Rank 0 creates the temporary directory beside `dir`.
    let tmp = (rank == 0).then(|| prepare(dir));
    let tmp: PathBuf = pg.broadcast_agreed(tmp.as_ref(), 0)?;
    // 2. Each writer writes its data file; every rank learns the first failure.
    let reports = pg.all_gather_agreed(write(&tmp));
    // 3. Rank 0 writes `.metadata` last and renames the directory into place.
    let outcome = (rank == 0).then(|| {
        let result = reports.and_then(|r| commit(r.into_iter().flatten().collect(), &tmp, dir));
        if result.is_err() {
            crate::storage::discard_tmp_dir(&tmp);
        }
        result
    });
    pg.broadcast_agreed(outcome.as_ref(), 0)
}

/// Writes `__{rank}_0.distcp` for [`save_sharded_dcp`].
fn write_sharded_rank<T: Tensor>(
    rank: usize,
    osd: &OptimStateDict<T>,
    model: Option<&indexmap::IndexMap<String, Value<T>>>,
    tmp: &Path,
) -> Result<RankChunks> {
    let mut out = DataFile::create(tmp, rank)?;
    let mut keys = Keys::default();
    for (k, st) in &osd.state {
        for (name, v) in st {
            let s = Slot::State(key_name(k), name.clone());
            write_sharded_value(rank, &s, v, &mut out, &mut keys)?;
        }
    }
    for (fqn, v) in model.into_iter().flatten() {
        write_sharded_value(rank, &Slot::Model(fqn.clone()), v, &mut out, &mut keys)?;
    }
    if rank == 0 {
        let groups = osd
            .param_groups
            .iter()
            .flatten()
            .map(|g| g.try_map(&mut |t: &T| t.to_host()))
            .collect::<Result<Vec<_>>>()?;
        write_param_groups(&groups, &mut out, &mut keys)?;
    }
    out.finish(keys.list)
}

/// One value of a sharded dict: this rank's box of a [`Value::Sharded`] tensor, or (on rank 0)
/// a value stored whole.
fn write_sharded_value<T: Tensor>(
    rank: usize,
    s: &Slot,
    v: &Value<T>,
    out: &mut DataFile,
    keys: &mut Keys,
) -> Result<()> {
    match v {
        Value::Sharded(sh) => {
            // A rank without rows of this tensor knows no dtype: the others report it.
            let Some(t) = &sh.local else { return Ok(()) };
            let kind = Kind::Tensor {
                dtype: t.dtype(),
                shape: sh.global_shape.clone(),
            };
            let ki = keys.get(s, kind);
            if t.numel() > 0 {
                let c = Chunk {
                    offsets: sh.offsets.clone(),
                    sizes: t.shape(),
                };
                let bytes = torch_save::save_to_bytes(&PyObj::Tensor(t.to_host()?))?;
                out.push(ki, c, &bytes)?;
            }
            Ok(())
        }
        other if rank == 0 => {
            let h = other.try_map(&mut |t: &T| t.to_host())?;
            let ki = keys.get(s, whole_kind(&h));
            out.write_whole(ki, &s.key(), &h)
        }
        _ => Ok(()),
    }
}

/// The optimizer state of a DCP directory one parameter at a time, reading only that
/// parameter's entries: calls `each(fqn, state)` in metadata order (state names as stored),
/// then returns the param groups (parameters by name). Memory: one parameter's whole state.
pub(crate) fn read_optim_by_param(
    dir: &Path,
    mut each: impl FnMut(&str, ParamState) -> Result<()>,
) -> Result<Option<Vec<crate::optim_state::ParamGroup>>> {
    let ckpt = DcpCheckpoint::open(dir)?;
    let mut order: Vec<String> = Vec::new();
    let mut by_fqn: HashMap<String, Vec<usize>> = HashMap::new();
    let mut groups = Vec::new();
    for (i, e) in ckpt.metadata().entries.iter().enumerate() {
        match e.path.as_deref() {
            Some([PathItem::Key(a), PathItem::Key(b), PathItem::Key(fqn), _])
                if a == "optim" && b == "state" =>
            {
                let at = by_fqn.entry(fqn.clone()).or_default();
                if at.is_empty() {
                    order.push(fqn.clone());
                }
                at.push(i);
            }
            Some([PathItem::Key(a), PathItem::Key(b), ..])
                if a == "optim" && b == "param_groups" =>
            {
                groups.push(i)
            }
            _ => {}
        }
    }
    for fqn in &order {
        let mut one = read_optim(&ckpt, dir, &by_fqn[fqn])?;
        if let Some((_, st)) = one.state.pop() {
            each(fqn, st)?;
        }
    }
    Ok(read_optim(&ckpt, dir, &groups)?.param_groups)
}

/// Removes stale temporaries, checks the replace rule, creates the temporary sibling.
fn prepare(dir: &Path) -> Result<PathBuf> {
    use crate::storage;
    storage::clean_stale_temporaries(dir, Some(dcp::DCP_DIR))?;
    storage::check_dir_output(dir, dcp::DCP_DIR, &[])?;
    storage::make_tmp_dir(dir)
}

/// Writes `__{rank}_0.distcp`: the boxes of every element range this rank holds and, on
/// layout rank 0, every value stored whole (scalars, 0-dim tensors, unmanaged parameters'
/// state, param-group options).
fn write_rank<T: Tensor>(
    ctx: GroupContext<'_>,
    osd: &OptimStateDict<T>,
    params: &OptimParams,
    model: Option<&[Option<T>]>,
    tmp: &Path,
) -> Result<RankChunks> {
    let (layout, lr) = (ctx.layout, ctx.layout_rank);
    let local = layout.local_params(params)?;
    let saved = host_states(lr, osd, &local)?;
    let model_local = match model {
        Some(_) => layout.local_params(&OptimParams::of_model(layout))?,
        None => Vec::new(),
    };
    let model_saved = model
        .map(|m| host_model_params(lr, m, &model_local))
        .transpose()?
        .unwrap_or_default();
    let mut report: KeyedStates = Vec::new();
    let mut plan: Plan<&[u8]> = Plan::default();
    plan_pieces(layout, lr, &saved, &mut report, &mut plan)?;
    let n_optim = report.len();
    plan_pieces(layout, lr, &model_saved, &mut report, &mut plan)?;
    // A tied parameter is written under each of its names, as `model.state_dict()` lists it
    // under each (PyTorch writes the bytes once per key too): the slot, then its aliases.
    let names_of = |s: Slot| -> Vec<Slot> {
        let aliases: Vec<Slot> = match &s {
            Slot::Model(fqn) => layout
                .model
                .aliases_of(fqn)
                .map(|a| Slot::Model(a.to_string()))
                .collect(),
            _ => Vec::new(),
        };
        std::iter::once(s).chain(aliases).collect()
    };
    let slot = |k: usize, name: &str| {
        let fqn = report[k].0.names[0].clone();
        if k >= n_optim {
            Slot::Model(fqn)
        } else {
            Slot::State(fqn, name.to_string())
        }
    };
    let mut out = DataFile::create(tmp, lr)?;
    let mut keys = Keys::default();
    // Every key of every parameter this rank holds state for, in the optimizer's order.
    for (k, (_, states)) in report.iter().enumerate() {
        for (name, v) in states {
            let kind = match v {
                LocalValue::Tensor { dtype, shape, .. } => Kind::Tensor {
                    dtype: *dtype,
                    shape: shape.clone(),
                },
                LocalValue::Value(v) => whole_kind(v),
            };
            for s in names_of(slot(k, name)) {
                let ki = keys.get(&s, kind.clone());
                // A rank may hold no element of a parameter yet its scalar state; each holder
                // writes its (tiny, equal) copy and rank 0 records the lowest rank's.
                if let LocalValue::Value(v) = v {
                    out.write_whole(ki, &s.key(), v)?;
                }
            }
        }
    }
    // The element ranges this rank holds, as boxes.
    for (i, &(k, si, start, len)) in plan.at.iter().enumerate() {
        let (name, LocalValue::Tensor { dtype, shape, .. }) = &report[k].1[si] else {
            continue;
        };
        for s in names_of(slot(k, name)) {
            out.write_boxes(keys.index[&s], *dtype, shape, start, len, plan.data[i])?;
        }
    }
    if lr == 0 {
        write_dict_parts(layout, &local, osd, &mut out, &mut keys)?;
    }
    out.finish(keys.list)
}

/// The keys a rank knows, in order of first appearance.
#[derive(Default)]
struct Keys {
    list: Vec<(Slot, Kind)>,
    index: HashMap<Slot, usize>,
}

impl Keys {
    /// The index of `slot`, added with `kind` if new.
    fn get(&mut self, slot: &Slot, kind: Kind) -> usize {
        if let Some(&i) = self.index.get(slot) {
            return i;
        }
        self.list.push((slot.clone(), kind));
        self.index.insert(slot.clone(), self.list.len() - 1);
        self.list.len() - 1
    }
}

/// A parameter key as DCP's flattened keys spell it: the name, or the id.
fn key_name(k: &crate::optim_state::ParamKey) -> String {
    match k.as_name() {
        Some(n) => n.to_string(),
        None => k.to_string(),
    }
}

/// The kind of a value stored whole: a tensor at its own shape, or an object.
fn whole_kind(v: &Value<HostTensor>) -> Kind {
    match v {
        Value::Tensor(t) => Kind::Tensor {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        },
        _ => Kind::Object,
    }
}

/// On layout rank 0: the param groups (by names, `params` last) and the state of keys the
/// layout does not own, stored whole.
fn write_dict_parts<T: Tensor>(
    layout: &ModelLayout,
    local: &[crate::optim_state::keys::LocalParam],
    osd: &OptimStateDict<T>,
    out: &mut DataFile,
    keys: &mut Keys,
) -> Result<()> {
    let parts = dict_parts(layout, local, osd)?;
    for (k, st) in &parts.user_state {
        for (name, v) in st {
            let s = Slot::State(key_name(k), name.clone());
            let ki = keys.get(&s, whole_kind(v));
            out.write_whole(ki, &s.key(), v)?;
        }
    }
    write_param_groups(parts.param_groups.as_deref().unwrap_or_default(), out, keys)
}

/// The param groups as `optim.param_groups.<i>.<option>` values and a `params` list of names.
fn write_param_groups(
    groups: &[crate::optim_state::ParamGroup<HostTensor>],
    out: &mut DataFile,
    keys: &mut Keys,
) -> Result<()> {
    for (i, g) in groups.iter().enumerate() {
        for (option, v) in &g.options {
            let s = Slot::Group(i, option.clone());
            let ki = keys.get(&s, whole_kind(v));
            out.write_whole(ki, &s.key(), v)?;
        }
        let names = g.params.iter().map(|p| PyObj::Str(key_name(p))).collect();
        let ki = keys.get(&Slot::Group(i, "params".into()), Kind::Object);
        out.write_obj(ki, &PyObj::List(names))?;
    }
    Ok(())
}

/// One rank's data file being written: each chunk a `torch.save` archive, back to back.
struct DataFile {
    name: String,
    path: PathBuf,
    w: std::io::BufWriter<File>,
    at: u64,
    chunks: Vec<ChunkRecord>,
}

impl DataFile {
    fn create(tmp: &Path, rank: usize) -> Result<Self> {
        let name = format!("__{rank}_0.distcp");
        let path = tmp.join(&name);
        let f = File::create(&path).map_err(Error::io("creating", &path))?;
        Ok(DataFile {
            name,
            path,
            w: std::io::BufWriter::with_capacity(1 << 20, f),
            at: 0,
            chunks: Vec::new(),
        })
    }

    fn push(&mut self, key: usize, c: Chunk, bytes: &[u8]) -> Result<()> {
        self.w
            .write_all(bytes)
            .map_err(Error::io("writing", &self.path))?;
        self.chunks.push(ChunkRecord {
            key,
            offsets: c.offsets,
            sizes: c.sizes,
            offset: self.at,
            length: bytes.len() as u64,
        });
        self.at += bytes.len() as u64;
        Ok(())
    }

    /// Elements `start..start + len` (`data`) of a tensor of global `shape`, as boxes.
    fn write_boxes(
        &mut self,
        key: usize,
        dtype: DType,
        shape: &[usize],
        start: usize,
        len: usize,
        data: &[u8],
    ) -> Result<()> {
        let es = dtype.size();
        for (c, at) in dcp::flat_range_boxes(shape, start, len) {
            let n: usize = c.sizes.iter().product();
            let t = HostTensor::from_bytes(dtype, &c.sizes, &data[at * es..(at + n) * es])?;
            let bytes = torch_save::save_to_bytes(&PyObj::Tensor(t))?;
            self.push(key, c, &bytes)?;
        }
        Ok(())
    }

    /// A value stored whole: a tensor as one box at the origin, anything else pickled.
    fn write_whole(&mut self, key: usize, name: &str, v: &Value<HostTensor>) -> Result<()> {
        match v {
            Value::Tensor(t) => {
                let c = Chunk {
                    offsets: vec![0; t.dim()],
                    sizes: t.shape().to_vec(),
                };
                let bytes = torch_save::save_to_bytes(&PyObj::Tensor(t.clone()))?;
                self.push(key, c, &bytes)
            }
            other => self.write_obj(key, &torch_save::value_to_pyobj(other, name)?),
        }
    }

    fn write_obj(&mut self, key: usize, obj: &PyObj) -> Result<()> {
        let bytes = torch_save::save_to_bytes(obj)?;
        let c = Chunk {
            offsets: Vec::new(),
            sizes: Vec::new(),
        };
        self.push(key, c, &bytes)
    }

    /// Flushes and syncs the file; the rank's report.
    fn finish(self, keys: Vec<(Slot, Kind)>) -> Result<RankChunks> {
        let f = self
            .w
            .into_inner()
            .map_err(|e| Error::io("writing", &self.path)(e.into_error()))?;
        f.sync_all().map_err(Error::io("syncing", &self.path))?;
        Ok(RankChunks {
            file: self.name,
            keys,
            chunks: self.chunks,
        })
    }
}

/// A key of the merged plan: its kind and chunks (file, chunk record).
type Merged = Vec<(Slot, Kind, Vec<(String, ChunkRecord)>)>;

/// Merges the ranks' reports by key (first appearance in rank order), keeping the lowest
/// rank's copy of a value stored whole by several, and checks that ranks agree on kinds and
/// that each tensor's boxes tile its shape exactly once. Pure.
fn merge(reports: Vec<RankChunks>, dir: &Path) -> Result<Merged> {
    let mut merged: Merged = Vec::new();
    let mut at: HashMap<Slot, usize> = HashMap::new();
    let bad = |s: &Slot, reason: String| Error::DcpChunks {
        dir: dir.display().to_string(),
        key: s.key(),
        reason,
    };
    for r in reports {
        let mut local = Vec::with_capacity(r.keys.len());
        for (s, kind) in r.keys {
            let i = *at.entry(s.clone()).or_insert_with(|| {
                merged.push((s.clone(), kind.clone(), Vec::new()));
                merged.len() - 1
            });
            if merged[i].1 != kind {
                return Err(bad(
                    &s,
                    format!(
                        "{} saves it as {kind:?}, another rank as {:?}",
                        r.file, merged[i].1
                    ),
                ));
            }
            local.push(i);
        }
        for c in r.chunks {
            let (_, kind, chunks) = &mut merged[local[c.key]];
            let whole = matches!(kind, Kind::Object)
                || matches!(kind, Kind::Tensor { shape, .. } if shape.is_empty());
            // A value stored whole by several ranks: the lowest rank's copy.
            if !whole || chunks.is_empty() {
                chunks.push((r.file.clone(), c));
            }
        }
    }
    for (s, kind, chunks) in &merged {
        match kind {
            Kind::Tensor { shape, .. } => {
                let boxes: Vec<Chunk> = chunks
                    .iter()
                    .map(|(_, c)| Chunk {
                        offsets: c.offsets.clone(),
                        sizes: c.sizes.clone(),
                    })
                    .collect();
                dcp::check_tiling(shape, &boxes).map_err(|r| bad(s, r))?;
            }
            Kind::Object if chunks.len() != 1 => {
                return Err(bad(s, format!("stored {} times, not once", chunks.len())))
            }
            Kind::Object => {}
        }
    }
    Ok(merged)
}

/// Rank 0: merges the reports, writes `.metadata` into `tmp`, syncs, renames into place.
fn commit(reports: Vec<RankChunks>, tmp: &Path, dir: &Path) -> Result<()> {
    let mut merged = merge(reports, dir)?;
    // `{"model": ..., "optim": {"state": ..., "param_groups": ...}}`, as `get_state_dict`
    // users save it.
    merged.sort_by_key(|(s, _, _)| match s {
        Slot::Model(_) => 0,
        Slot::State(..) => 1,
        Slot::Group(..) => 2,
    });
    let keys: Vec<(String, Vec<PathItem>)> =
        merged.iter().map(|(s, _, _)| (s.key(), s.path())).collect();
    let records: Vec<Record<'_>> = merged
        .iter()
        .zip(&keys)
        .map(|((_, kind, chunks), (key, path))| Record {
            key,
            path,
            tensor: match kind {
                Kind::Tensor { dtype, shape } => Some((*dtype, shape.as_slice())),
                Kind::Object => None,
            },
            chunks: chunks
                .iter()
                .map(|(file, c)| StoredChunk {
                    offsets: &c.offsets,
                    sizes: &c.sizes,
                    file,
                    offset: c.offset,
                    length: c.length,
                    zstd: false,
                })
                .collect(),
        })
        .collect();
    let name = dir
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    let md = dcp::metadata_pickle(&records, &name)?;
    crate::storage::write_synced(&tmp.join(".metadata"), &md)?;
    super::sync_dir(tmp)?;
    crate::storage::install_dir(tmp, dir, dcp::DCP_DIR)
}

/// This rank's optimizer state dict from the DCP directory `dir` (as PyTorch's
/// `get_state_dict` + `dcp.save` or [`save_dcp`] wrote it, at any world size, FSDP1 or
/// FSDP2): what [`crate::optim_state::flatten_optim_state_dict`] gives for the directory's
/// full optimizer dict. The metadata is first checked against the model: every
/// `optim.state` key must name a parameter, tensor states must have its global shape, and
/// every parameter with state must have every state name the others have
/// ([`Error::DcpStorage`] naming key and `.metadata`). Parameters are read one flat
/// parameter (or original parameter) at a time, and of each only the chunks holding the
/// rank's element ranges ([`DcpCheckpoint::read_flat_range`]). No communication.
pub(crate) fn load_dcp<T: Tensor>(
    dir: &Path,
    layout: &ModelLayout,
    rank: usize,
    params: &OptimParams,
) -> Result<OptimStateDict<T>> {
    DcpOptimState::open(dir, layout)?.load(layout, rank, params)
}

/// A DCP directory opened for loading ranks of `layout` ([`load_dcp`]): its metadata read
/// and checked against the model and its param groups read, once for any number of ranks.
pub(super) struct DcpOptimState<'d> {
    ckpt: Arc<DcpCheckpoint>,
    dir: &'d Path,
    /// Per fully qualified name with state: its entries' indices in the metadata.
    states: HashMap<String, Vec<usize>>,
    groups: Option<Vec<crate::optim_state::ParamGroup>>,
}

impl<'d> DcpOptimState<'d> {
    /// Opens `dir` and checks its metadata against `layout`'s model.
    pub(super) fn open(dir: &'d Path, layout: &ModelLayout) -> Result<Self> {
        Self::opened(DcpCheckpoint::open(dir)?, dir, layout)
    }

    /// [`Self::open`] of an opened directory.
    pub(super) fn opened(ckpt: DcpCheckpoint, dir: &'d Path, layout: &ModelLayout) -> Result<Self> {
        let states = check_against_model(&ckpt, dir, layout)?;
        let group_entries: Vec<usize> = ckpt
            .metadata()
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                matches!(e.path.as_deref(), Some([PathItem::Key(a), PathItem::Key(b), ..]) if a == "optim" && b == "param_groups")
            })
            .map(|(i, _)| i)
            .collect();
        let groups = read_optim(&ckpt, dir, &group_entries)?.param_groups;
        Ok(DcpOptimState {
            ckpt: Arc::new(ckpt),
            dir,
            states,
            groups,
        })
    }

    /// The opened directory.
    pub(super) fn checkpoint(&self) -> &DcpCheckpoint {
        &self.ckpt
    }

    /// Rank `rank`'s optimizer state dict (see [`load_dcp`]).
    pub(super) fn load<T: Tensor>(
        &self,
        layout: &ModelLayout,
        rank: usize,
        params: &OptimParams,
    ) -> Result<OptimStateDict<T>> {
        let ckpt = &self.ckpt;
        self.load_with(layout, rank, params, &|key, range| {
            let t = match range {
                Some((start, len)) => ckpt.read_flat_range(key, start, len)?,
                None => ckpt.read_tensor(key)?,
            };
            T::from_host(t)
        })
    }

    /// Rank `rank`'s optimizer state dict as [`Self::load`] gives it, with every
    /// positive-dim tensor state standing for where its elements lie, unread: what a
    /// conversion plans its rank files with, to stream them afterwards.
    pub(super) fn plan(
        &self,
        layout: &ModelLayout,
        rank: usize,
        params: &OptimParams,
    ) -> Result<OptimStateDict<LazyTensor>> {
        let ckpt = &self.ckpt;
        self.load_with(layout, rank, params, &|key, range| {
            let (shape, range) = match range {
                Some((start, len)) => (vec![len], (start, len)),
                None => {
                    let shape = tensor_size(ckpt, key)?;
                    let numel = shape.iter().product();
                    (shape, (0, numel))
                }
            };
            LazyTensor::stored(ckpt, key, range, &shape)
        })
    }

    /// [`Self::load`] with each positive-dim tensor state made by `tensor` from its key and
    /// the flat element range wanted (`None`: all of it).
    fn load_with<T: Tensor>(
        &self,
        layout: &ModelLayout,
        rank: usize,
        params: &OptimParams,
        tensor: &TensorFn<'_, T>,
    ) -> Result<OptimStateDict<T>> {
        let groups = self
            .groups
            .as_ref()
            .map(|gs| {
                gs.iter()
                    .map(|g| g.try_map(&mut |t: &HostTensor| T::from_host(t.clone())))
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        let mut source = DcpSource {
            ckpt: &self.ckpt,
            dir: self.dir,
            states: &self.states,
            rank,
            tensor,
        };
        flatten_from_source(layout, &mut source, groups.as_deref(), Vec::new(), params)
    }
}

/// Makes a positive-dim tensor state from its DCP key and the flat element range wanted
/// (`None`: the whole tensor).
type TensorFn<'a, T> = dyn Fn(&str, Option<(usize, usize)>) -> Result<T> + 'a;

/// Where a positive-dim tensor state comes from: its DCP key and the flat element range
/// wanted (`None`: all of it).
type Made<'a> = (&'a str, Option<(usize, usize)>);

/// The global shape of the tensor stored under `key`.
fn tensor_size(ckpt: &DcpCheckpoint, key: &str) -> Result<Vec<usize>> {
    match ckpt.entry(key).map(|e| &e.kind) {
        Some(EntryKind::Tensor(t)) => Ok(t.size.clone()),
        _ => Err(Error::Internal(format!(
            "`{key}` is no tensor of the DCP directory"
        ))),
    }
}

/// A DCP directory as a [`ShardSource`]: the rank's part of each parameter's state, made
/// when the flattening asks for it.
struct DcpSource<'c, T> {
    ckpt: &'c DcpCheckpoint,
    dir: &'c Path,
    /// Per fully qualified name with state: its entries' indices in the metadata.
    states: &'c HashMap<String, Vec<usize>>,
    rank: usize,
    tensor: &'c TensorFn<'c, T>,
}

impl<T: Tensor> DcpSource<'_, T> {
    /// The dict holding only the state of `fqns` (those the directory has state for): whole,
    /// or with `ranges`, each positive-dim tensor state of `fqns[i]` only elements
    /// `ranges[i].0..+ranges[i].1` of its flattening, as a 1-D tensor, made alone by
    /// `self.tensor`. While the dict is nested those states stand as empty placeholders.
    fn dict_of(
        &self,
        fqns: &[&str],
        ranges: Option<&[(usize, usize)]>,
    ) -> Result<OptimStateDict<T>> {
        let entries: Vec<usize> = fqns
            .iter()
            .filter_map(|f| self.states.get(*f))
            .flatten()
            .copied()
            .collect();
        // (fqn, state name) → (key, range) of each positive-dim tensor state.
        let mut made: HashMap<(&str, &str), Made<'_>> = HashMap::new();
        for &i in &entries {
            let e = &self.ckpt.metadata().entries[i];
            let (EntryKind::Tensor(t), Some([_, _, PathItem::Key(fqn), PathItem::Key(n)])) =
                (&e.kind, e.path.as_deref())
            else {
                continue;
            };
            if t.size.is_empty() || t.dtype().is_none() {
                continue;
            }
            let range = ranges.and_then(|r| fqns.iter().position(|f| f == fqn).map(|i| r[i]));
            made.insert((fqn.as_str(), n.as_str()), (e.key.as_str(), range));
        }
        let read = |e: &dcp::Entry| -> Result<PyObj> {
            match (&e.kind, e.path.as_deref()) {
                (EntryKind::Tensor(t), Some([_, _, PathItem::Key(fqn), PathItem::Key(n)]))
                    if made.contains_key(&(fqn.as_str(), n.as_str())) =>
                {
                    let dtype = t.dtype().unwrap_or(DType::U8);
                    Ok(PyObj::Tensor(HostTensor::zeros(dtype, &[0])))
                }
                (EntryKind::Tensor(_), _) => Ok(PyObj::Tensor(self.ckpt.read_tensor(&e.key)?)),
                (EntryKind::Bytes, _) => self.ckpt.read_object(&e.key),
            }
        };
        let mut dict = read_optim_with(self.ckpt, self.dir, &entries, read)?
            .try_map(|t: &HostTensor| T::from_host(t.clone()))?;
        for (k, st) in &mut dict.state {
            let fqn = k.as_name().unwrap_or_default();
            for (n, v) in st {
                if let Some(&(key, range)) = made.get(&(fqn, n.as_str())) {
                    *v = Value::Tensor((self.tensor)(key, range)?);
                }
            }
        }
        Ok(dict)
    }
}

/// The element range (start, len) of each member of `fl` that rank `rank`'s shard covers,
/// (0, 0) for a member it holds none of.
fn member_ranges(fl: &crate::flat_param::FlatParamLayout, rank: usize) -> Vec<(usize, usize)> {
    let mut ranges = vec![(0, 0); fl.members.len()];
    for piece in fl.shard_pieces(rank) {
        if let crate::flat_param::ShardPiece::Member { member, start, len } = piece {
            ranges[member] = (start, len);
        }
    }
    ranges
}

impl<T: Tensor> ShardSource<T> for DcpSource<'_, T> {
    /// Reads only the rank's element ranges of each member's tensor states.
    fn flat_param(&mut self, layout: &ModelLayout, f: usize) -> Result<Option<ParamState<T>>> {
        let fl = &layout.flat_params[f];
        let fqns: Vec<&str> = fl.members.iter().map(|m| m.fqn.as_str()).collect();
        let ranges = member_ranges(fl, self.rank);
        let part = self.dict_of(&fqns, Some(&ranges))?;
        let rank = self.rank;
        flat_param_state_with(fl, &part, &mut |sname, values| {
            flatten_tensor_parts(fl, rank, sname, values, Some(&ranges))
        })
    }

    /// Reads only the slice of a sharded parameter's tensor states the rank's view covers.
    fn orig_param(
        &mut self,
        layout: &ModelLayout,
        param: usize,
        owner: Option<(usize, usize)>,
    ) -> Result<Option<ParamState<T>>> {
        let fqn = layout.state_fqn(param);
        let Some((f, m)) = owner.filter(|&(f, _)| layout.flat_params[f].sharded) else {
            let full = self.dict_of(&[fqn], None)?;
            return orig_param_state_for_rank(layout, param, owner, self.rank, &full);
        };
        let info = layout.flat_params[f].shard(self.rank).params[m];
        if !info.in_shard {
            return Ok(None);
        }
        let range = (info.intra_param_start_idx, info.numel_in_shard);
        let mut part = self.dict_of(&[fqn], Some(&[range]))?;
        Ok(part
            .state
            .shift_remove(&crate::optim_state::ParamKey::Name(fqn.to_string()))
            .filter(|s| !s.is_empty()))
    }
}

/// The optimizer dict of the metadata entries `entries` (all under `optim`), read and nested
/// as `dcp_to_torch_save` nests them; `state` is empty when no entry is under it.
fn read_optim(ckpt: &DcpCheckpoint, dir: &Path, entries: &[usize]) -> Result<OptimStateDict> {
    read_optim_with(ckpt, dir, entries, |e| match e.kind {
        EntryKind::Tensor(_) => Ok(PyObj::Tensor(ckpt.read_tensor(&e.key)?)),
        EntryKind::Bytes => ckpt.read_object(&e.key),
    })
}

/// [`read_optim`] with each entry's value read by `read`.
fn read_optim_with(
    ckpt: &DcpCheckpoint,
    dir: &Path,
    entries: &[usize],
    read: impl Fn(&dcp::Entry) -> Result<PyObj>,
) -> Result<OptimStateDict> {
    let all = &ckpt.metadata().entries;
    let picked: Vec<_> = entries.iter().map(|&i| all[i].clone()).collect();
    let mut leaf = |i: usize| -> Result<PyObj> { read(&picked[i]) };
    let nested = dcp::nest(&picked, &mut leaf)
        .map_err(|e| e.into_error(&dir.join(".metadata").display().to_string()))?;
    // `{"optim": {...}}` (every entry is under `optim`), or `{}` when none is picked.
    let mut optim = match nested {
        PyObj::Dict(mut items) => match items.pop() {
            Some((_, PyObj::Dict(parts))) => parts,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    if !optim
        .iter()
        .any(|(k, _)| matches!(k, PyObj::Str(s) if s == "state"))
    {
        optim.insert(0, (PyObj::Str("state".into()), PyObj::Dict(Vec::new())));
    }
    torch_save::optim_from_pyobj(PyObj::Dict(optim))
}

/// Checks the `optim.state` keys of the metadata against the model (see [`load_dcp`]).
/// Returns, per fully qualified name with state, its entries' indices in the metadata.
fn check_against_model(
    ckpt: &DcpCheckpoint,
    dir: &Path,
    layout: &ModelLayout,
) -> Result<HashMap<String, Vec<usize>>> {
    let err = |key: &str, reason: String| Error::DcpStorage {
        dir: dir.display().to_string(),
        key: key.to_string(),
        file: ".metadata".into(),
        reason,
    };
    // Per parameter with state: its state names, in order of first appearance.
    let mut names: Vec<(String, Vec<String>)> = Vec::new();
    let mut position: HashMap<String, usize> = HashMap::new();
    let mut entries: HashMap<String, Vec<usize>> = HashMap::new();
    for (i, e) in ckpt.metadata().entries.iter().enumerate() {
        let Some([PathItem::Key(a), PathItem::Key(b), PathItem::Key(fqn), PathItem::Key(n)]) =
            e.path.as_deref()
        else {
            continue;
        };
        if a != "optim" || b != "state" {
            continue;
        }
        let Some(p) = layout.param_index(fqn) else {
            return Err(err(&e.key, format!("`{fqn}` is no parameter of the model")));
        };
        let want = &layout.model.params[p].shape;
        if let EntryKind::Tensor(t) = &e.kind {
            if !t.size.is_empty() && &t.size != want {
                return Err(err(
                    &e.key,
                    format!(
                        "global shape {:?}, but the model's parameter `{fqn}` has shape {want:?}",
                        t.size
                    ),
                ));
            }
        }
        let at = entries.entry(fqn.clone()).or_default();
        if at.is_empty() {
            position.insert(fqn.clone(), names.len());
            names.push((fqn.clone(), Vec::new()));
        }
        at.push(i);
        names[position[fqn]].1.push(n.clone());
    }
    let Some((first, reference)) = names.first().cloned() else {
        return Ok(entries);
    };
    for (fqn, list) in &names {
        if let Some(n) = reference.iter().find(|n| !list.contains(n)) {
            return Err(err(
                &format!("optim.state.{fqn}.{n}"),
                format!("missing: `{first}` has state `{n}` but `{fqn}` has not"),
            ));
        }
        if let Some(n) = list.iter().find(|n| !reference.contains(n)) {
            return Err(err(
                &format!("optim.state.{first}.{n}"),
                format!("missing: `{fqn}` has state `{n}` but `{first}` has not"),
            ));
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_paths_are_the_ones_get_state_dict_flattens_to() {
        let s = Slot::State("net.0.weight".into(), "exp_avg".into());
        assert_eq!(s.key(), "optim.state.net.0.weight.exp_avg");
        assert_eq!(s.path().len(), 4);
        let g = Slot::Group(1, "lr".into());
        assert_eq!(g.key(), "optim.param_groups.1.lr");
        assert_eq!(g.path()[2], PathItem::Index(1));
        assert_eq!(Slot::Model("w".into()).key(), "model.w");
    }
}
