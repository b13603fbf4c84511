//! Pure planning over DCP metadata: whether a tensor's chunks tile its global shape exactly
//! once, where each chunk's bytes land in the assembled tensor, and the nested state dict
//! structure that `planner_data` describes. No file is touched here.

use super::metadata::MAX_CHUNKS_PER_TENSOR;
use super::metadata::{Chunk, Entry, EntryKind, PathItem};
use crate::io::torch_save::PyObj;
use std::collections::HashMap;

/// Number of elements of a box, or `None` on overflow.
pub fn volume(sizes: &[usize]) -> Option<usize> {
    crate::tensor::checked_numel(sizes)
}

/// Whether `chunk` holds any element. PyTorch never reads a chunk that holds none (FSDP2
/// records one for a rank that holds no rows), so it needs no storage and may lie anywhere.
pub(crate) fn holds_elements(chunk: &Chunk) -> bool {
    volume(&chunk.sizes) != Some(0)
}

/// Checks that `chunks` tile the shape `size` exactly once: every chunk has the tensor's rank
/// and lies inside it, no two overlap, and together they cover every element. A chunk of no
/// elements is passed over (PyTorch never reads one). Returns what is wrong.
pub fn check_tiling(size: &[usize], chunks: &[Chunk]) -> Result<(), String> {
    if chunks.len() > MAX_CHUNKS_PER_TENSOR {
        return Err(format!(
            "{} chunks, more than the {MAX_CHUNKS_PER_TENSOR} accepted per tensor",
            chunks.len()
        ));
    }
    let total = volume(size).ok_or_else(|| format!("shape {size:?} overflows"))?;
    let mut covered = 0usize;
    for c in chunks.iter().filter(|c| holds_elements(c)) {
        if c.offsets.len() != size.len() || c.sizes.len() != size.len() {
            return Err(format!(
                "chunk at {:?} of size {:?} does not have the tensor's {} dimensions",
                c.offsets,
                c.sizes,
                size.len()
            ));
        }
        let inside = c
            .offsets
            .iter()
            .zip(&c.sizes)
            .zip(size)
            .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|e| e <= d));
        if !inside {
            return Err(format!(
                "chunk at {:?} of size {:?} lies outside the shape {size:?}",
                c.offsets, c.sizes
            ));
        }
        covered = covered.saturating_add(volume(&c.sizes).unwrap_or(usize::MAX));
    }
    check_overlaps(chunks)?;
    if covered != total {
        return Err(format!(
            "the chunks cover {covered} of the {total} elements of shape {size:?} (a chunk is missing)"
        ));
    }
    Ok(())
}

/// Refuses two non-empty chunks that share an element.
fn check_overlaps(chunks: &[Chunk]) -> Result<(), String> {
    let mut order: Vec<&Chunk> = chunks.iter().filter(|c| !c.sizes.contains(&0)).collect();
    // Sorted by the first dimension's start, a chunk can only overlap the ones after it that
    // start before it ends there.
    order.sort_by_key(|c| c.offsets.first().copied().unwrap_or(0));
    for (i, a) in order.iter().enumerate() {
        for b in &order[i + 1..] {
            if let (Some(&bs), Some(&ae)) = (b.offsets.first(), a.offsets.first()) {
                if bs >= ae + a.sizes[0] {
                    break;
                }
            }
            let meet = (0..a.offsets.len()).all(|d| {
                a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d]
            });
            if meet {
                return Err(format!(
                    "chunks at {:?} (size {:?}) and {:?} (size {:?}) overlap",
                    a.offsets, a.sizes, b.offsets, b.sizes
                ));
            }
        }
    }
    Ok(())
}

/// Copies the contiguous bytes `src` of `chunk` into `dst`, the contiguous bytes of the
/// global tensor of shape `size` (`esize` bytes per element). The chunk must lie inside
/// the shape and `src` hold exactly its elements (checked by the caller).
pub(crate) fn place_chunk(dst: &mut [u8], size: &[usize], chunk: &Chunk, src: &[u8], esize: usize) {
    let n = size.len();
    if n == 0 {
        dst[..esize].copy_from_slice(&src[..esize]);
        return;
    }
    if chunk.sizes.contains(&0) {
        return;
    }
    let row = chunk.sizes[n - 1] * esize;
    // Element strides of the global tensor.
    let mut strides = vec![1usize; n];
    for d in (0..n - 1).rev() {
        strides[d] = strides[d + 1] * size[d + 1];
    }
    let rows = chunk.sizes[..n - 1].iter().product::<usize>();
    let mut idx = vec![0usize; n - 1];
    for r in 0..rows {
        let at: usize = (0..n)
            .map(|d| (chunk.offsets[d] + if d < n - 1 { idx[d] } else { 0 }) * strides[d])
            .sum();
        dst[at * esize..at * esize + row].copy_from_slice(&src[r * row..(r + 1) * row]);
        for d in (0..n - 1).rev() {
            idx[d] += 1;
            if idx[d] < chunk.sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The N-D boxes that the row-major element range `start..start + len` of a tensor of shape
/// `shape` consists of, in element order, each with the position of its first element within
/// the range. A rank's slice of a flat parameter covers such a range of each original
/// parameter; written as boxes, DCP and PyTorch's loader accept it as is. A 2-D range gives at
/// most three boxes (a partial first row, whole rows, a partial last row); each further
/// dimension adds at most two. An empty range gives no box; a 0-dim tensor one empty-shaped box.
pub(crate) fn flat_range_boxes(shape: &[usize], start: usize, len: usize) -> Vec<(Chunk, usize)> {
    let mut out = Vec::new();
    if shape.is_empty() {
        if len > 0 {
            out.push((chunk_at(Vec::new(), Vec::new()), 0));
        }
        return out;
    }
    let mut cut = Cut {
        prefix: Vec::new(),
        out: &mut out,
        range_start: start,
    };
    cut.range(shape, start, start + len, 0);
    out
}

fn chunk_at(offsets: Vec<usize>, sizes: Vec<usize>) -> Chunk {
    Chunk { offsets, sizes }
}

/// The state of [`flat_range_boxes`]: the leading coordinates of the sub-tensor being cut
/// (each of size 1) and the boxes found so far.
struct Cut<'o> {
    prefix: Vec<usize>,
    out: &'o mut Vec<(Chunk, usize)>,
    range_start: usize,
}

impl Cut<'_> {
    /// Pushes the boxes of elements `start..end` of the sub-tensor of shape `shape` at the
    /// current prefix, whose element 0 is element `shift` of the whole tensor.
    fn range(&mut self, shape: &[usize], start: usize, end: usize, shift: usize) {
        if start >= end {
            return;
        }
        if shape.len() == 1 {
            self.rows(shape, start, end, 1, shift);
            return;
        }
        let inner: usize = shape[1..].iter().product();
        let (first_row, r1) = (start / inner, end / inner);
        if first_row == (end - 1) / inner && (start % inner != 0 || end % inner != 0) {
            self.row(
                shape,
                first_row,
                start % inner,
                end - first_row * inner,
                inner,
                shift,
            );
            return;
        }
        let mut r0 = first_row;
        if start % inner != 0 {
            self.row(shape, first_row, start % inner, inner, inner, shift);
            r0 += 1;
        }
        if r1 > r0 {
            self.rows(shape, r0, r1, inner, shift);
        }
        if end % inner != 0 {
            self.row(shape, r1, 0, end % inner, inner, shift);
        }
    }

    /// Elements `s..e` of row `r` (of dimension 0 of `shape`): cut inside that row.
    fn row(&mut self, shape: &[usize], r: usize, s: usize, e: usize, inner: usize, shift: usize) {
        self.prefix.push(r);
        self.range(&shape[1..], s, e, shift + r * inner);
        self.prefix.pop();
    }

    /// The box of whole rows `r0..r1` of dimension 0 of `shape`.
    fn rows(&mut self, shape: &[usize], r0: usize, r1: usize, inner: usize, shift: usize) {
        let lead = self.prefix.len();
        let mut offsets = self.prefix.clone();
        offsets.push(r0);
        offsets.extend(std::iter::repeat_n(0, shape.len() - 1));
        let mut sizes = vec![1; lead];
        sizes.push(r1 - r0);
        sizes.extend_from_slice(&shape[1..]);
        let at = shift + r0 * inner - self.range_start;
        self.out.push((chunk_at(offsets, sizes), at));
    }
}

/// The nested state dict being rebuilt: dicts keyed by string, lists, and leaves that stand
/// for an entry (by index).
#[derive(Debug)]
enum Tree {
    Dict(Vec<(String, Tree)>, HashMap<String, usize>),
    List(Vec<Tree>),
    Leaf(usize),
    /// A list slot not (yet) filled: Python's `None`.
    Hole,
}

/// Most list slots that paths may create beyond one per entry. PyTorch pads a list with
/// `None` up to any index; a gap is refused unless the padded list is one plain value, so a
/// few slots suffice, and the bound keeps a hostile index from exhausting memory.
const SPARE_LIST_SLOTS: usize = 1 << 12;

/// Rebuilds the nested structure of `entries` as PyTorch's `set_element` does (dicts in
/// first-insertion order, lists padded with `None`), with `leaf(i)` as the value of entry
/// `i`. Entries without a path sit at the top level under their flat key. The entries must
/// be placed already (see [`check_paths`]): a path that lands on another entry's value or
/// on a container other paths built is refused here.
pub fn nest(
    entries: &[Entry],
    leaf: &mut dyn FnMut(usize) -> crate::error::Result<PyObj>,
) -> Result<PyObj, NestError> {
    let built = build(entries)?;
    if let Some((lost, by)) = built
        .displaced
        .iter()
        .enumerate()
        .find_map(|(j, d)| Some((j, (*d)?)))
    {
        return Err(displaced_error(entries, lost, by));
    }
    to_pyobj(built.root, leaf).map_err(NestError::Leaf)
}

/// Checks that `planner_data` rebuilds a nested dict that PyTorch's loader
/// (`_EmptyStateDictLoadPlanner`, used by `dcp_to_torch_save`) reads back whole, and says
/// where each value goes.
///
/// PyTorch puts a placeholder for each key at its path (a later path overwrites an earlier
/// one), flattens the rebuilt dict again (a path's items joined with `.`, as
/// `flatten_state_dict` writes them; a list that holds no tensor and no container is one
/// value, and so is a `None` gap) and loads, at each place, the value of the key that
/// place's name is. So every place must name a key of the checkpoint; a tensor key must find
/// a tensor placeholder of its dtype and shape (an object key may replace whatever is
/// there); and every key must be loaded at some place. PyTorch refuses a checkpoint that
/// fails the first two ("Missing key in checkpoint state_dict", "Size mismatch") but
/// silently drops a key whose placeholder another path overwrote, and casts a tensor of
/// another dtype; the crate refuses both. Whatever PyTorch reads back whole, the crate reads
/// as PyTorch does: swapped paths, negative list indices, and a gap or a list of plain values
/// that a key's name fills.
pub fn check_paths(entries: &[Entry]) -> Result<Placement, NestError> {
    let built = build(entries)?;
    let places = traverse(&built.root, entries);
    let owner: HashMap<&str, usize> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    // For each place, the key loaded there; for each key, its place and where its own
    // placeholder sits.
    let mut key_at: Vec<usize> = Vec::with_capacity(places.len());
    let mut loaded_at: Vec<Option<usize>> = vec![None; entries.len()];
    let mut placeholder_at: Vec<Option<usize>> = vec![None; entries.len()];
    for (n, place) in places.iter().enumerate() {
        if let PlaceValue::Placeholder(i) = place.value {
            placeholder_at[i] = Some(n);
        }
        let j = load(place, entries, &owner, &loaded_at, &places)?;
        loaded_at[j] = Some(n);
        key_at.push(j);
    }
    for (j, at) in loaded_at.iter().enumerate() {
        if at.is_some() {
            continue;
        }
        // A key no place loads: its placeholder was overwritten, or sits at a place that
        // names another key.
        if let Some(by) = built.displaced[j] {
            return Err(displaced_error(entries, j, by));
        }
        if let Some(n) = placeholder_at[j] {
            let (first, second) = (j.min(key_at[n]), j.max(key_at[n]));
            return Err(NestError::SharedPath {
                first: entries[first].key.clone(),
                second: entries[second].key.clone(),
                path: path_repr(&places[n].path),
            });
        }
        return Err(NestError::Path {
            key: entries[j].key.clone(),
            reason:
                "no place of the rebuilt dict holds or names it, so PyTorch's loader would drop it"
                    .into(),
        });
    }
    let order = key_at
        .into_iter()
        .zip(places)
        .map(|(j, place)| (j, place.path))
        .collect();
    Ok(Placement { order })
}

/// Where [`check_paths`] found each value goes: the entries in the order PyTorch's rebuilt
/// dict holds them (its traversal order), each with the path of its place, list indices
/// resolved. Every entry appears exactly once.
#[derive(Debug)]
pub struct Placement {
    order: Vec<(usize, Vec<PathItem>)>,
}

impl Placement {
    /// The entries in the order of their places, each with its place's path (for a
    /// checkpoint that `dcp.save` wrote, `entries` unchanged but for the paths of keys
    /// without one).
    pub fn apply(self, entries: Vec<Entry>) -> Vec<Entry> {
        let mut slots: Vec<Option<Entry>> = entries.into_iter().map(Some).collect();
        self.order
            .into_iter()
            .filter_map(|(j, path)| {
                let mut e = slots.get_mut(j)?.take()?;
                e.path = Some(path);
                Some(e)
            })
            .collect()
    }
}

/// Why [`nest`] or [`check_paths`] failed.
#[derive(Debug)]
pub enum NestError {
    /// Two keys have the same path.
    SharedPath {
        /// The key first in metadata order.
        first: String,
        /// The other key.
        second: String,
        /// The path, as PyTorch prints it (`('optim', 'param_groups', 0, 'lr')`).
        path: String,
    },
    /// The key's path conflicts with another's, is out of range, or is not what PyTorch's
    /// loader accepts.
    Path {
        /// The flattened key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Producing a leaf value failed.
    Leaf(crate::error::Error),
}

impl NestError {
    /// The crate error for this failure of the paths of `metadata_file` (the `.metadata` file,
    /// for messages).
    pub fn into_error(self, metadata_file: &str) -> crate::error::Error {
        use crate::error::Error;
        match self {
            NestError::SharedPath {
                first,
                second,
                path,
            } => Error::DcpSharedPath {
                file: metadata_file.to_string(),
                first,
                second,
                path,
            },
            NestError::Path { key, reason } => Error::DcpPlannerData {
                file: metadata_file.to_string(),
                key,
                reason,
            },
            NestError::Leaf(e) => e,
        }
    }
}

/// A path as Python prints the tuple (`('a', 0, 'b')`).
pub fn path_repr(path: &[PathItem]) -> String {
    let items: Vec<String> = path
        .iter()
        .map(|p| match p {
            PathItem::Key(k) => format!("'{}'", crate::error::shown(k)),
            PathItem::Index(i) => i.to_string(),
            PathItem::FromEnd(n) => format!("-{n}"),
        })
        .collect();
    match items.len() {
        1 => format!("({},)", items[0]),
        _ => format!("({})", items.join(", ")),
    }
}

/// The flattened key PyTorch derives from a path: its items joined with `.`.
pub(crate) fn joined(path: &[PathItem]) -> String {
    let items: Vec<String> = path
        .iter()
        .map(|p| match p {
            PathItem::Key(k) => k.clone(),
            PathItem::Index(i) => i.to_string(),
            PathItem::FromEnd(n) => format!("-{n}"),
        })
        .collect();
    items.join(".")
}

/// The tree of every entry's path (see [`nest`]), and for each entry whose placeholder a
/// later path overwrote, that later entry.
struct Built {
    root: Tree,
    displaced: Vec<Option<Displaced>>,
}

/// An entry's placeholder was overwritten by entry `by`'s: at the same path (`exact`), or
/// with the container holding it.
#[derive(Debug, Clone, Copy)]
struct Displaced {
    by: usize,
    exact: bool,
}

/// Builds the tree as PyTorch's `set_element` does, each path in metadata order.
fn build(entries: &[Entry]) -> Result<Built, NestError> {
    let mut built = Built {
        root: Tree::Dict(Vec::new(), HashMap::new()),
        displaced: vec![None; entries.len()],
    };
    let mut spare = SPARE_LIST_SLOTS;
    for (i, e) in entries.iter().enumerate() {
        let flat = [PathItem::Key(e.key.clone())];
        let path = e.path.as_deref().unwrap_or(&flat);
        let old = insert(&mut built.root, path, i, &mut spare).map_err(|clash| match clash {
            Clash::Through(j) => NestError::Path {
                key: e.key.clone(),
                reason: format!(
                    "its planner_data path {} runs through the value of the key `{}`",
                    path_repr(path),
                    crate::error::shown(&entries[j].key)
                ),
            },
            Clash::Other(reason) => NestError::Path {
                key: e.key.clone(),
                reason: format!("its planner_data path {}: {reason}", path_repr(path)),
            },
        })?;
        let exact = matches!(old, Tree::Leaf(_));
        for_each_leaf(&old, &mut |j| {
            built.displaced[j] = Some(Displaced { by: i, exact })
        });
    }
    Ok(built)
}

/// Why a path could not be inserted: it runs through entry `.0`'s value (where PyTorch
/// fails or writes into that value), or PyTorch's `set_element` fails on it.
enum Clash {
    Through(usize),
    Other(String),
}

/// Puts entry `leaf` at `path` as `set_element` does and returns what was there before
/// (`Tree::Hole` for a new place). `spare` counts the list slots beyond one per entry still
/// allowed.
fn insert(
    root: &mut Tree,
    path: &[PathItem],
    leaf: usize,
    spare: &mut usize,
) -> Result<Tree, Clash> {
    let Some((last, steps)) = path.split_last() else {
        return Err(Clash::Other("the path is empty".into()));
    };
    let mut cur = root;
    for (i, item) in steps.iter().enumerate() {
        let slot = step(cur, item, i, spare)?;
        match slot {
            Tree::Hole => {
                *slot = match path[i + 1] {
                    PathItem::Key(_) => Tree::Dict(Vec::new(), HashMap::new()),
                    PathItem::Index(_) | PathItem::FromEnd(_) => Tree::List(Vec::new()),
                }
            }
            Tree::Leaf(other) => return Err(Clash::Through(*other)),
            Tree::Dict(..) | Tree::List(_) => {}
        }
        cur = slot;
    }
    if let Tree::Leaf(other) = cur {
        return Err(Clash::Through(*other));
    }
    let slot = step(cur, last, steps.len(), spare)?;
    Ok(std::mem::replace(slot, Tree::Leaf(leaf)))
}

/// The slot `item` names in the container `cur` (step `i` of a path), created as a hole if
/// new: a dict's key, or a list's index with the list padded up to it (`lst[-n]` is the
/// n-th item from the end of the list as it is now).
fn step<'t>(
    cur: &'t mut Tree,
    item: &PathItem,
    i: usize,
    spare: &mut usize,
) -> Result<&'t mut Tree, Clash> {
    match (cur, item) {
        (Tree::Dict(items, at), PathItem::Key(k)) => {
            let j = *at.entry(k.clone()).or_insert_with(|| {
                items.push((k.clone(), Tree::Hole));
                items.len() - 1
            });
            Ok(&mut items[j].1)
        }
        (Tree::List(items), PathItem::Index(j)) => {
            if items.len() <= *j {
                let grow = j - items.len();
                if grow > *spare {
                    return Err(Clash::Other(format!(
                        "list index {j} would pad a list of {} with {grow} empty slots (lists must be dense)",
                        items.len()
                    )));
                }
                *spare -= grow;
                items.resize_with(j + 1, || Tree::Hole);
            }
            Ok(&mut items[*j])
        }
        (Tree::List(items), PathItem::FromEnd(n)) => match items.len().checked_sub(*n) {
            Some(j) => Ok(&mut items[j]),
            None => Err(Clash::Other(format!(
                "list index -{n} is out of range for a list of {} (an IndexError in PyTorch)",
                items.len()
            ))),
        },
        (_, item) => {
            let (what, there) = match item {
                PathItem::Index(i) => (format!("index {i}"), "a dict"),
                PathItem::FromEnd(n) => (format!("index -{n}"), "a dict"),
                PathItem::Key(k) => (format!("'{}'", crate::error::shown(k)), "a list"),
            };
            Err(Clash::Other(format!(
                "step {} ({what}) meets {there} that other keys' paths built",
                i + 1
            )))
        }
    }
}

/// Calls `f` with each entry stored under `tree`.
fn for_each_leaf(tree: &Tree, f: &mut dyn FnMut(usize)) {
    match tree {
        Tree::Dict(items, _) => items.iter().for_each(|(_, t)| for_each_leaf(t, f)),
        Tree::List(items) => items.iter().for_each(|t| for_each_leaf(t, f)),
        Tree::Leaf(i) => f(*i),
        Tree::Hole => {}
    }
}

/// The error for entry `lost`, whose placeholder entry `d.by`'s path overwrote.
fn displaced_error(entries: &[Entry], lost: usize, d: Displaced) -> NestError {
    let own = |i: usize| {
        entries[i].path.as_deref().map_or_else(
            || path_repr(&[PathItem::Key(entries[i].key.clone())]),
            path_repr,
        )
    };
    if d.exact {
        let (first, second) = (lost.min(d.by), lost.max(d.by));
        return NestError::SharedPath {
            first: entries[first].key.clone(),
            second: entries[second].key.clone(),
            path: own(d.by),
        };
    }
    NestError::Path {
        key: entries[lost].key.clone(),
        reason: format!(
            "its planner_data path {} lies inside the path {} of the key `{}`, whose value replaces the whole container, so PyTorch's loader would drop this key",
            own(lost),
            own(d.by),
            crate::error::shown(&entries[d.by].key)
        ),
    }
}

/// A value PyTorch's traversal of the rebuilt dict visits, and the path it joins into the
/// name of the key loaded there.
#[derive(Debug)]
struct Place {
    path: Vec<PathItem>,
    value: PlaceValue,
}

/// What the rebuilt dict holds at a place.
#[derive(Debug, Clone, Copy)]
enum PlaceValue {
    /// Entry `.0`'s placeholder (an empty tensor of its shape, or its metadata object).
    Placeholder(usize),
    /// `None`: a list slot no path filled.
    Gap,
    /// A list or dict that PyTorch's traversal takes as one value (it holds no tensor).
    /// `first` is the first entry in it.
    Plain {
        container: &'static str,
        items: usize,
        first: Option<usize>,
    },
}

/// The traversal rules of PyTorch's `flatten_state_dict`: those of 2.4 and later (a dict is
/// always traversed; a list that holds no tensor, no dict and no such list is one value),
/// and those of 2.3, which its loader falls back to when a key of the checkpoint is missing
/// under the first and found under these (any dict or list that holds no tensor, and no
/// container that does, is one value).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rules {
    Current,
    V2_3,
}

/// The places PyTorch's traversal of the rebuilt dict `root` visits under `rules`, in order.
fn places_of(root: &Tree, entries: &[Entry], rules: Rules) -> Vec<Place> {
    let mut places = Vec::new();
    if let Tree::Dict(items, _) = root {
        for (k, v) in items {
            visit(
                v,
                &mut vec![PathItem::Key(k.clone())],
                entries,
                rules,
                &mut places,
            );
        }
    }
    places
}

/// The places of the 2.4 traversal, or of the 2.3 one where PyTorch's loader falls back to
/// it (`DefaultLoadPlanner.create_local_plan`): when a key of the checkpoint names no place
/// of the first and names one of the second.
fn traverse(root: &Tree, entries: &[Entry]) -> Vec<Place> {
    let places = places_of(root, entries, Rules::Current);
    let names: std::collections::HashSet<String> = places.iter().map(|p| joined(&p.path)).collect();
    let missing: Vec<&str> = entries
        .iter()
        .map(|e| e.key.as_str())
        .filter(|k| !names.contains(*k))
        .collect();
    if missing.is_empty() {
        return places;
    }
    let old = places_of(root, entries, Rules::V2_3);
    let old_names: std::collections::HashSet<String> =
        old.iter().map(|p| joined(&p.path)).collect();
    if missing.iter().any(|k| old_names.contains(*k)) {
        old
    } else {
        places
    }
}

/// Walks `tree` as PyTorch's `traverse_state_dict` does under `rules` and records each
/// value it visits.
fn visit(
    tree: &Tree,
    path: &mut Vec<PathItem>,
    entries: &[Entry],
    rules: Rules,
    places: &mut Vec<Place>,
) {
    let whole = match tree {
        Tree::Dict(..) => rules == Rules::V2_3 && plain(tree, entries),
        Tree::List(items) => match rules {
            Rules::Current => terminal(items, entries),
            Rules::V2_3 => plain(tree, entries),
        },
        Tree::Leaf(_) | Tree::Hole => true,
    };
    let value = match tree {
        Tree::Dict(items, _) if !whole => {
            for (k, v) in items {
                path.push(PathItem::Key(k.clone()));
                visit(v, path, entries, rules, places);
                path.pop();
            }
            return;
        }
        Tree::List(items) if !whole => {
            for (i, v) in items.iter().enumerate() {
                path.push(PathItem::Index(i));
                visit(v, path, entries, rules, places);
                path.pop();
            }
            return;
        }
        Tree::Dict(items, _) => PlaceValue::Plain {
            container: "dict",
            items: items.len(),
            first: first_leaf(tree),
        },
        Tree::List(items) => PlaceValue::Plain {
            container: "list",
            items: items.len(),
            first: first_leaf(tree),
        },
        Tree::Leaf(i) => PlaceValue::Placeholder(*i),
        Tree::Hole => PlaceValue::Gap,
    };
    places.push(Place {
        path: path.clone(),
        value,
    });
}

/// The entry PyTorch loads at `place`: the key its path names, which must exist, must not
/// be loaded at another place, and, for a tensor, must find a tensor placeholder of its
/// dtype and shape (an object replaces whatever the place holds).
fn load(
    place: &Place,
    entries: &[Entry],
    owner: &HashMap<&str, usize>,
    loaded_at: &[Option<usize>],
    places: &[Place],
) -> Result<usize, NestError> {
    let named = joined(&place.path);
    let at = path_repr(&place.path);
    let (key, names) = match place.value {
        PlaceValue::Placeholder(i) => (
            entries[i].key.clone(),
            format!(
                "its planner_data path {at} names the key `{}`",
                crate::error::shown(&named)
            ),
        ),
        PlaceValue::Gap => {
            let (list, index) = place.path.split_at(place.path.len().saturating_sub(1));
            (
                joined(list),
                format!(
                    "the list at {} has no item {} (no key has that path; lists must be dense), and PyTorch's loader reads the gap as the value `{}`",
                    path_repr(list),
                    joined(index),
                    crate::error::shown(&named)
                ),
            )
        }
        PlaceValue::Plain {
            container,
            items,
            first,
        } => (
            first.map_or_else(|| named.clone(), |i| entries[i].key.clone()),
            format!(
                "the {container} at {at} holds no tensor and no container ({items} items), so PyTorch's loader reads it as one value `{}`",
                crate::error::shown(&named)
            ),
        ),
    };
    let fail = |reason: String| {
        Err(NestError::Path {
            key: key.clone(),
            reason,
        })
    };
    let Some(&j) = owner.get(named.as_str()) else {
        return fail(format!(
            "{names}, which the checkpoint does not have (PyTorch refuses it: Missing key in checkpoint state_dict)"
        ));
    };
    if let Some(n) = loaded_at[j] {
        return fail(format!(
            "{names}, as the place {} does (PyTorch refuses it: duplicated flatten key)",
            path_repr(&places[n].path)
        ));
    }
    let mismatch = match (&entries[j].kind, place.value) {
        (EntryKind::Bytes, _) => None,
        (EntryKind::Tensor(_), PlaceValue::Placeholder(i)) => {
            kind_mismatch(&entries[i].kind, &entries[j].kind)
        }
        (EntryKind::Tensor(_), _) => {
            Some("a tensor, which PyTorch's loader cannot load there".into())
        }
    };
    match mismatch {
        Some(m) => fail(format!("{names}: {m}")),
        None => Ok(j),
    }
}

/// Why a placeholder of kind `placed` cannot take the value of kind `value` PyTorch loads
/// there: object against tensor (PyTorch refuses), another shape (PyTorch refuses) or
/// dtype (PyTorch casts the value silently; the crate refuses).
fn kind_mismatch(placed: &EntryKind, value: &EntryKind) -> Option<String> {
    match (placed, value) {
        (EntryKind::Bytes, EntryKind::Bytes) => None,
        (EntryKind::Tensor(a), EntryKind::Tensor(b)) if a.size == b.size && a.dtype == b.dtype => {
            None
        }
        (EntryKind::Tensor(a), EntryKind::Tensor(b)) => Some(format!(
            "a {} {:?} tensor where this key's is {} {:?}",
            b.dtype, b.size, a.dtype, a.size
        )),
        (EntryKind::Tensor(_), EntryKind::Bytes) => {
            Some("an object where this key holds a tensor".into())
        }
        (EntryKind::Bytes, EntryKind::Tensor(_)) => {
            Some("a tensor where this key holds an object".into())
        }
    }
}

/// Whether PyTorch's traversal visits the list `items` as one value: it holds no tensor, no
/// dict, and no list that is not itself such a value.
fn terminal(items: &[Tree], entries: &[Entry]) -> bool {
    items.iter().all(|t| match t {
        Tree::Dict(..) => false,
        Tree::List(inner) => terminal(inner, entries),
        Tree::Leaf(i) => !matches!(entries[*i].kind, EntryKind::Tensor(_)),
        Tree::Hole => true,
    })
}

/// Whether the 2.3 traversal takes the container `tree` as one value: it holds no tensor,
/// and no container that is not itself such a value.
fn plain(tree: &Tree, entries: &[Entry]) -> bool {
    match tree {
        Tree::Dict(items, _) => items.iter().all(|(_, t)| plain(t, entries)),
        Tree::List(items) => items.iter().all(|t| plain(t, entries)),
        Tree::Leaf(i) => !matches!(entries[*i].kind, EntryKind::Tensor(_)),
        Tree::Hole => true,
    }
}

/// The first entry stored under `tree`, if any.
fn first_leaf(tree: &Tree) -> Option<usize> {
    match tree {
        Tree::Dict(items, _) => items.iter().find_map(|(_, t)| first_leaf(t)),
        Tree::List(items) => items.iter().find_map(first_leaf),
        Tree::Leaf(i) => Some(*i),
        Tree::Hole => None,
    }
}

fn to_pyobj(
    t: Tree,
    leaf: &mut dyn FnMut(usize) -> crate::error::Result<PyObj>,
) -> crate::error::Result<PyObj> {
    Ok(match t {
        Tree::Dict(items, _) => PyObj::Dict(
            items
                .into_iter()
                .map(|(k, v)| Ok((PyObj::Str(k), to_pyobj(v, leaf)?)))
                .collect::<crate::error::Result<_>>()?,
        ),
        Tree::List(items) => PyObj::List(
            items
                .into_iter()
                .map(|v| to_pyobj(v, leaf))
                .collect::<crate::error::Result<_>>()?,
        ),
        Tree::Leaf(i) => leaf(i)?,
        Tree::Hole => PyObj::None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::dcp::metadata::EntryKind;

    fn chunk(offsets: &[usize], sizes: &[usize]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        }
    }

    /// Every element of the range lies in exactly one box, at the recorded position.
    fn check_boxes(shape: &[usize], start: usize, len: usize, most: usize) {
        let boxes = flat_range_boxes(shape, start, len);
        assert!(boxes.len() <= most, "{shape:?} {start}+{len}: {boxes:?}");
        let n = shape.len();
        let mut strides = vec![1usize; n];
        for d in (0..n.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let mut seen = vec![usize::MAX; len];
        for (b, at) in &boxes {
            let vol = volume(&b.sizes).unwrap();
            for i in 0..vol {
                // The i-th element of the box in row-major order, as a flat index.
                let mut rest = i;
                let mut flat = 0;
                for d in (0..n).rev() {
                    flat += (b.offsets[d] + rest % b.sizes[d]) * strides[d];
                    rest /= b.sizes[d];
                }
                assert_eq!(flat, start + at + i, "{shape:?} {start}+{len}: box {b:?}");
                assert_eq!(seen[flat - start], usize::MAX);
                seen[flat - start] = i;
            }
        }
        assert!(
            seen.iter().all(|&s| s != usize::MAX),
            "{shape:?} {start}+{len}"
        );
    }

    #[test]
    fn a_flat_range_is_cut_into_few_boxes_covering_it_once_in_order() {
        for start in 0..12 {
            for len in 0..=12 - start {
                check_boxes(&[12], start, len, 1);
                check_boxes(&[3, 4], start, len, 3);
                check_boxes(&[2, 2, 3], start, len, 5);
            }
        }
        // 0-dim: one box with no dimensions.
        assert_eq!(flat_range_boxes(&[], 0, 1).len(), 1);
    }

    #[test]
    fn torch_chunk_rows_with_an_empty_last_chunk_tile_the_shape() {
        // 3 rows on 4 ranks: 1, 1, 1, 0.
        let c = [
            chunk(&[0, 0], &[1, 10]),
            chunk(&[1, 0], &[1, 10]),
            chunk(&[2, 0], &[1, 10]),
            chunk(&[3, 0], &[0, 10]),
        ];
        assert_eq!(check_tiling(&[3, 10], &c), Ok(()));
    }

    #[test]
    fn a_two_by_two_grid_tiles_and_a_hole_or_overlap_does_not() {
        let grid = [
            chunk(&[0, 0], &[2, 3]),
            chunk(&[0, 3], &[2, 2]),
            chunk(&[2, 0], &[1, 3]),
            chunk(&[2, 3], &[1, 2]),
        ];
        assert_eq!(check_tiling(&[3, 5], &grid), Ok(()));
        let hole = &grid[..3];
        assert!(check_tiling(&[3, 5], hole).unwrap_err().contains("missing"));
        let mut overlap = grid.to_vec();
        overlap[1] = chunk(&[0, 2], &[2, 3]);
        assert!(check_tiling(&[3, 5], &overlap)
            .unwrap_err()
            .contains("overlap"));
        let outside = [chunk(&[0, 0], &[4, 5])];
        assert!(check_tiling(&[3, 5], &outside)
            .unwrap_err()
            .contains("outside"));
    }

    #[test]
    fn chunks_of_a_grid_land_in_row_major_order() {
        // A 3x4 tensor 0..12 cut into a 2x2 grid of boxes, placed back.
        let full: Vec<u8> = (0..12).collect();
        let boxes = [
            chunk(&[0, 0], &[2, 1]),
            chunk(&[0, 1], &[2, 3]),
            chunk(&[2, 0], &[1, 1]),
            chunk(&[2, 1], &[1, 3]),
        ];
        let mut out = vec![0xffu8; 12];
        for b in &boxes {
            let mut src = Vec::new();
            for r in 0..b.sizes[0] {
                for c in 0..b.sizes[1] {
                    src.push(full[(b.offsets[0] + r) * 4 + b.offsets[1] + c]);
                }
            }
            place_chunk(&mut out, &[3, 4], b, &src, 1);
        }
        assert_eq!(out, full);
    }

    #[test]
    fn nesting_follows_set_element_with_lists_and_string_keys() {
        let e = |key: &str, path: Vec<PathItem>| Entry {
            key: key.into(),
            path: Some(path),
            kind: EntryKind::Bytes,
        };
        use PathItem::{Index as I, Key as K};
        let entries = vec![
            e(
                "optim.param_groups.1.lr",
                vec![
                    K("optim".into()),
                    K("param_groups".into()),
                    I(1),
                    K("lr".into()),
                ],
            ),
            e("model.w", vec![K("model".into()), K("w".into())]),
            e(
                "optim.param_groups.0.lr",
                vec![
                    K("optim".into()),
                    K("param_groups".into()),
                    I(0),
                    K("lr".into()),
                ],
            ),
        ];
        let got = nest(&entries, &mut |i| Ok(PyObj::Int(i as i64))).unwrap();
        let s = |x: &str| PyObj::Str(x.into());
        let group = |v| PyObj::Dict(vec![(s("lr"), PyObj::Int(v))]);
        assert_eq!(
            got,
            PyObj::Dict(vec![
                (
                    s("optim"),
                    PyObj::Dict(vec![(
                        s("param_groups"),
                        PyObj::List(vec![group(2), group(0)])
                    )])
                ),
                (s("model"), PyObj::Dict(vec![(s("w"), PyObj::Int(1))])),
            ])
        );
        let clash = vec![
            e("a.b", vec![K("a".into()), K("b".into())]),
            e("a.0", vec![K("a".into()), I(0)]),
        ];
        assert!(
            matches!(nest(&clash, &mut |_| Ok(PyObj::None)), Err(NestError::Path { key, .. }) if key == "a.0")
        );
    }

    fn entry(key: &str, path: &[PathItem], tensor: bool) -> Entry {
        Entry {
            key: key.into(),
            path: Some(path.to_vec()),
            kind: if tensor {
                EntryKind::Tensor(crate::io::dcp::TensorMeta {
                    dtype: "float32".into(),
                    size: vec![1],
                    chunks: vec![],
                })
            } else {
                EntryKind::Bytes
            },
        }
    }

    fn k(s: &str) -> PathItem {
        PathItem::Key(s.into())
    }

    /// The optimizer part of a state dict as `dcp.save` records it: a tensor state and two
    /// param-group values.
    fn optim_entries() -> Vec<Entry> {
        vec![
            entry(
                "optim.state.w.exp_avg",
                &[k("optim"), k("state"), k("w"), k("exp_avg")],
                true,
            ),
            entry(
                "optim.param_groups.0.lr",
                &[k("optim"), k("param_groups"), PathItem::Index(0), k("lr")],
                false,
            ),
            entry(
                "optim.param_groups.0.eps",
                &[k("optim"), k("param_groups"), PathItem::Index(0), k("eps")],
                false,
            ),
        ]
    }

    #[test]
    fn paths_as_dcp_save_writes_them_pass() {
        check_paths(&optim_entries()).unwrap();
    }

    #[test]
    fn two_keys_with_one_path_are_refused_naming_both() {
        let mut e = optim_entries();
        e[2].path = e[1].path.clone();
        match check_paths(&e) {
            Err(NestError::SharedPath {
                first,
                second,
                path,
            }) => {
                assert_eq!(first, "optim.param_groups.0.lr");
                assert_eq!(second, "optim.param_groups.0.eps");
                assert_eq!(path, "('optim', 'param_groups', 0, 'lr')");
            }
            other => panic!("expected SharedPath, got {other:?}"),
        }
    }

    #[test]
    fn a_path_that_is_not_the_keys_own_is_refused() {
        let mut e = optim_entries();
        e[0].path = Some(vec![k("optim"), k("state"), k("v"), k("exp_avg")]);
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { key, reason })
                if key == "optim.state.w.exp_avg" && reason.contains("optim.state.v.exp_avg"))
        );
        // Index and string steps join alike: `('a', 0)` is the key `a.0`.
        let ok = vec![entry("a.0", &[k("a"), PathItem::Index(0)], true)];
        check_paths(&ok).unwrap();
    }

    #[test]
    fn a_path_inside_another_keys_value_or_over_a_container_is_refused() {
        // `optim.state`'s value replaces the dict that held `exp_avg`: PyTorch drops it.
        let mut e = optim_entries();
        e.push(entry("optim.state", &[k("optim"), k("state")], false));
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { key, reason })
                if key == "optim.state.w.exp_avg" && reason.contains("replaces the whole container"))
        );
        let mut e = optim_entries();
        e.insert(0, entry("optim", &[k("optim")], false));
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { key, .. }) if key == "optim.state.w.exp_avg")
        );
    }

    #[test]
    fn swapped_paths_are_read_by_the_names_of_the_places_as_pytorch_reads_them() {
        // `lr` and `eps` with each other's paths: PyTorch loads each place by the key its
        // path names, so `eps` comes first in the group and each holds its own value.
        let mut e = optim_entries();
        let (lr, eps) = (e[1].path.clone(), e[2].path.clone());
        e[1].path = eps.clone();
        e[2].path = lr.clone();
        let placed = check_paths(&e).unwrap().apply(e);
        let keys: Vec<&str> = placed.iter().map(|x| x.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "optim.state.w.exp_avg",
                "optim.param_groups.0.eps",
                "optim.param_groups.0.lr"
            ]
        );
        assert_eq!(placed[1].path, eps);
        assert_eq!(placed[2].path, lr);
        // A tensor's path swapped with an object's: PyTorch refuses the kinds.
        let mut e = optim_entries();
        let (w, lr) = (e[0].path.clone(), e[1].path.clone());
        e[0].path = lr;
        e[1].path = w;
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { key, reason }) if key == "optim.param_groups.0.lr" && reason.contains("a tensor where this key holds an object"))
        );
    }

    #[test]
    fn a_negative_list_index_counts_from_the_end_as_python_does() {
        let mut e = optim_entries();
        e[2].path = Some(vec![
            k("optim"),
            k("param_groups"),
            PathItem::FromEnd(1),
            k("eps"),
        ]);
        let placed = check_paths(&e).unwrap().apply(e);
        assert_eq!(
            placed[2].path.as_deref(),
            Some(&[k("optim"), k("param_groups"), PathItem::Index(0), k("eps")][..])
        );
        // Past the start of the list: an IndexError in PyTorch.
        let mut e = optim_entries();
        e[1].path = Some(vec![
            k("optim"),
            k("param_groups"),
            PathItem::FromEnd(1),
            k("lr"),
        ]);
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { reason, .. }) if reason.contains("out of range"))
        );
    }

    #[test]
    fn two_paths_joining_to_one_key_are_refused() {
        // `('a.b',)` and `('a', 'b')` both flatten to `a.b`: PyTorch's "duplicated flatten
        // key", and one of the two values would be lost.
        let e = vec![
            entry("a.b", &[k("a.b")], true),
            entry("c", &[k("a"), k("b")], true),
        ];
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { reason, .. }) if reason.contains("duplicated flatten key"))
        );
    }

    #[test]
    fn a_list_with_a_gap_is_refused() {
        let mut e = optim_entries();
        e.push(entry(
            "optim.param_groups.2.lr",
            &[k("optim"), k("param_groups"), PathItem::Index(2), k("lr")],
            false,
        ));
        match check_paths(&e) {
            Err(NestError::Path { key, reason }) => {
                assert_eq!(key, "optim.param_groups");
                assert!(reason.contains("no item 1"), "{reason}");
            }
            other => panic!("expected a gap, got {other:?}"),
        }
    }

    #[test]
    fn a_list_of_plain_values_is_one_value_for_pytorch_and_refused() {
        // `dcp.save` stores such a list as one bytes entry; split into items, PyTorch's
        // traversal still visits the list whole and misses its key.
        let e = vec![
            entry("a.0", &[k("a"), PathItem::Index(0)], false),
            entry("a.1", &[k("a"), PathItem::Index(1)], false),
        ];
        assert!(matches!(check_paths(&e), Err(NestError::Path { key, .. }) if key == "a.0"));
        // With a tensor among them, the list is traversed item by item.
        let e = vec![
            entry("a.0", &[k("a"), PathItem::Index(0)], false),
            entry("a.1", &[k("a"), PathItem::Index(1)], true),
        ];
        check_paths(&e).unwrap();
    }

    /// A list as `dcp.save` records `[tensor, object, object, object]`.
    fn mixed_list() -> Vec<Entry> {
        (0..4)
            .map(|i| {
                entry(
                    &format!("mixed.{i}"),
                    &[k("mixed"), PathItem::Index(i)],
                    i == 0,
                )
            })
            .collect()
    }

    fn keys_and_paths(placed: &[Entry]) -> Vec<(String, String)> {
        placed
            .iter()
            .map(|e| (e.key.clone(), path_repr(e.path.as_deref().unwrap())))
            .collect()
    }

    #[test]
    fn a_list_of_plain_values_named_by_an_object_key_is_that_value_as_pytorch_loads_it() {
        // `mixed.3`'s path one step deeper: PyTorch builds `[.., .., .., [placeholder]]`,
        // reads the inner list as one value named `mixed.3` and loads that key there.
        let mut e = mixed_list();
        e[3].path = Some(vec![k("mixed"), PathItem::Index(3), PathItem::Index(0)]);
        let placed = check_paths(&e).unwrap().apply(e);
        assert_eq!(keys_and_paths(&placed), keys_and_paths(&mixed_list()));
        // A tensor one step deeper is visited itself, and `mixed.3.0` is no key.
        let mut e = mixed_list();
        e[3] = entry(
            "mixed.3",
            &[k("mixed"), PathItem::Index(3), PathItem::Index(0)],
            true,
        );
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { reason, .. }) if reason.contains("Missing key"))
        );
    }

    #[test]
    fn a_gap_named_by_the_key_whose_slot_another_took_is_loaded_by_that_name() {
        // `mixed.2` moved to index 4 beside `mixed.3`'s: index 2 is a gap, and PyTorch loads
        // `mixed.2` there by name; nothing is lost.
        let mut e = mixed_list();
        e[2].path = Some(vec![k("mixed"), PathItem::Index(3)]);
        let placed = check_paths(&e).unwrap().apply(e);
        assert_eq!(keys_and_paths(&placed), keys_and_paths(&mixed_list()));
        // `mixed.2` at `-1` when the list is `[t, o]`: it overwrites `mixed.1`'s slot, which
        // loads `mixed.1` by name, and the gap it leaves loads `mixed.2`.
        let mut e = mixed_list();
        e[2].path = Some(vec![k("mixed"), PathItem::FromEnd(1)]);
        let placed = check_paths(&e).unwrap().apply(e);
        assert_eq!(keys_and_paths(&placed), keys_and_paths(&mixed_list()));
        // A tensor key's gap: PyTorch cannot load a tensor into `None`. (`mixed.0` moved to
        // index 2, where `mixed.2` overwrites it.)
        let mut e = mixed_list();
        e[1] = entry("mixed.1", &[k("mixed"), PathItem::Index(1)], true);
        e[0].path = Some(vec![k("mixed"), PathItem::Index(2)]);
        assert!(
            matches!(check_paths(&e), Err(NestError::Path { key, reason }) if key == "mixed" && reason.contains("a tensor, which PyTorch's loader cannot load there")),
            "{:?}",
            check_paths(&e)
        );
    }

    #[test]
    fn a_key_missing_under_the_current_traversal_is_looked_up_as_pytorch_2_3_flattened() {
        // `extra.scalar` one step deeper under a string: the 2.4 traversal names the place
        // `extra.scalar.x`, which is no key, so PyTorch's loader flattens again with the 2.3
        // rules, which take the plain dict `{'x': ..}` as one value, `extra.scalar`.
        let e = vec![
            entry("extra.0", &[k("extra"), k("0")], true),
            entry("extra.scalar", &[k("extra"), k("scalar"), k("x")], false),
        ];
        let placed = check_paths(&e).unwrap().apply(e);
        assert_eq!(
            keys_and_paths(&placed),
            [
                ("extra.0".to_string(), "('extra', '0')".to_string()),
                (
                    "extra.scalar".to_string(),
                    "('extra', 'scalar')".to_string()
                )
            ]
        );
        // Under the 2.3 rules a dict of plain values is one value: a checkpoint whose keys
        // are its items stays with the current rules (and loads).
        let e = vec![
            entry("a.x", &[k("a"), k("x")], false),
            entry("a.y", &[k("a"), k("y")], false),
        ];
        let placed = check_paths(&e).unwrap().apply(e);
        assert_eq!(placed[1].path, Some(vec![k("a"), k("y")]));
    }
}
