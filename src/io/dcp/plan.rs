//! Pure planning over DCP metadata: whether a tensor's chunks tile its global shape exactly
//! once, where each chunk's bytes land in the assembled tensor, and the nested state dict
//! structure that `planner_data` describes. No file is touched here.

use super::metadata::{Chunk, Entry, PathItem};
use crate::io::torch_save::PyObj;
use std::collections::HashMap;

/// Most chunks one tensor may have (the overlap check compares pairs of chunks).
pub const MAX_CHUNKS_PER_TENSOR: usize = 1 << 14;

/// Number of elements of a box, or `None` on overflow.
pub fn volume(sizes: &[usize]) -> Option<usize> {
    sizes.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Checks that `chunks` tile the shape `size` exactly once: every chunk has the tensor's rank
/// and lies inside it, no two overlap, and together they cover every element. Returns what
/// is wrong.
pub fn check_tiling(size: &[usize], chunks: &[Chunk]) -> Result<(), String> {
    if chunks.len() > MAX_CHUNKS_PER_TENSOR {
        return Err(format!(
            "{} chunks, more than the {MAX_CHUNKS_PER_TENSOR} accepted per tensor",
            chunks.len()
        ));
    }
    let total = volume(size).ok_or_else(|| format!("shape {size:?} overflows"))?;
    let mut covered = 0usize;
    for c in chunks {
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
pub fn place_chunk(dst: &mut [u8], size: &[usize], chunk: &Chunk, src: &[u8], esize: usize) {
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
pub fn flat_range_boxes(shape: &[usize], start: usize, len: usize) -> Vec<(Chunk, usize)> {
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

/// Rebuilds the nested structure of `entries` as PyTorch's `set_element` does (dicts in
/// first-insertion order, lists padded with `None`), with `leaf(i)` as the value of entry
/// `i`. Entries without a path sit at the top level under their flat key.
pub fn nest(
    entries: &[Entry],
    leaf: &mut dyn FnMut(usize) -> crate::error::Result<PyObj>,
) -> Result<PyObj, NestError> {
    let mut root = Tree::Dict(Vec::new(), HashMap::new());
    for (i, e) in entries.iter().enumerate() {
        let flat = [PathItem::Key(e.key.clone())];
        let path = e.path.as_deref().unwrap_or(&flat);
        insert(&mut root, path, i, entries.len()).map_err(|reason| NestError::Path {
            key: e.key.clone(),
            reason,
        })?;
    }
    to_pyobj(root, leaf).map_err(NestError::Leaf)
}

/// Why [`nest`] failed.
#[derive(Debug)]
pub enum NestError {
    /// The key's path conflicts with another's or is out of range.
    Path {
        /// The flattened key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Producing a leaf value failed.
    Leaf(crate::error::Error),
}

fn insert(root: &mut Tree, path: &[PathItem], leaf: usize, max_index: usize) -> Result<(), String> {
    let mut cur = root;
    for (i, item) in path.iter().enumerate() {
        let last = i + 1 == path.len();
        let fresh = || match path.get(i + 1) {
            Some(PathItem::Index(_)) => Tree::List(Vec::new()),
            _ => Tree::Dict(Vec::new(), HashMap::new()),
        };
        let slot: &mut Tree = match (cur, item) {
            (Tree::Dict(items, at), PathItem::Key(k)) => {
                let j = *at.entry(k.clone()).or_insert_with(|| {
                    items.push((k.clone(), Tree::Hole));
                    items.len() - 1
                });
                &mut items[j].1
            }
            (Tree::List(items), PathItem::Index(j)) => {
                if *j >= max_index {
                    return Err(format!(
                        "list index {j} is beyond the checkpoint's {max_index} entries"
                    ));
                }
                if items.len() <= *j {
                    items.resize_with(j + 1, || Tree::Hole);
                }
                &mut items[*j]
            }
            (_, item) => {
                return Err(format!(
                    "step {item:?} of its path does not fit the container another key put there"
                ))
            }
        };
        if last {
            *slot = Tree::Leaf(leaf);
            return Ok(());
        }
        match slot {
            Tree::Hole => *slot = fresh(),
            Tree::Leaf(_) => {
                return Err(format!(
                    "step {item:?} of its path holds another key's value"
                ))
            }
            _ => {}
        }
        cur = slot;
    }
    Err("the path is empty".into())
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
            e("a", vec![K("a".into()), K("b".into())]),
            e("a.0", vec![K("a".into()), I(0)]),
        ];
        assert!(
            matches!(nest(&clash, &mut |_| Ok(PyObj::None)), Err(NestError::Path { key, .. }) if key == "a.0")
        );
    }
}
