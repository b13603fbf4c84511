//! Boxes of tensors (layer 2): a [`Chunk`] is an N-D box of a global tensor, the unit both
//! DCP's chunk metadata (`io::dcp::Chunk` is this type) and FSDP2's dim-0 row shards
//! (`param_layout`) are described in. [`TensorPlacement`], a tensor's shape with the
//! (rank, box) pieces the ranks hold, is what `param_layout` reports per parameter; the DCP
//! reader and the crate's checkpoint keep their own records of byte ranges (`StoredChunk`,
//! `checkpoint::Piece`), which add where the bytes are. Crate-private: the public types are
//! the formats' own.

use crate::tensor::DType;
use serde::{Deserialize, Serialize};

/// A box of a tensor: the elements `offsets .. offsets + sizes` in every dimension (DCP's
/// `ChunkStorageMetadata`). A 0-dim tensor's only box has no dimensions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Start of the box in every dimension.
    pub offsets: Vec<usize>,
    /// Extent of the box in every dimension.
    pub sizes: Vec<usize>,
}

impl Chunk {
    /// The box of whole rows `start .. start + rows` of dimension 0 of a tensor of `shape`
    /// (all of every other dimension). `shape` must have at least one dimension.
    pub fn rows(shape: &[usize], start: usize, rows: usize) -> Chunk {
        let mut offsets = vec![0; shape.len()];
        let mut sizes = shape.to_vec();
        offsets[0] = start;
        sizes[0] = rows;
        Chunk { offsets, sizes }
    }

    /// The box covering all of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Chunk {
        Chunk {
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
        }
    }

    /// Number of elements in the box.
    pub fn numel(&self) -> usize {
        self.sizes.iter().product()
    }
}

/// One piece of a tensor: the box a rank holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The rank holding the box.
    pub rank: usize,
    /// The box, in global coordinates.
    pub chunk: Chunk,
}

/// Where every element of one tensor lives: its global shape and dtype and the pieces the
/// ranks hold. Pieces of a sharded tensor tile the shape once; a replicated tensor has one
/// whole-shape piece per rank. Empty pieces (a rank with zero rows) are listed too, as DCP
/// lists them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPlacement {
    /// The tensor's name (a parameter's fully qualified name).
    pub name: String,
    /// The global shape.
    pub shape: Vec<usize>,
    /// The element type.
    pub dtype: DType,
    /// The pieces, in rank order.
    pub pieces: Vec<Piece>,
}

impl TensorPlacement {
    /// The pieces `rank` holds.
    pub fn held_by(&self, rank: usize) -> impl Iterator<Item = &Chunk> {
        self.pieces
            .iter()
            .filter(move |p| p.rank == rank)
            .map(|p| &p.chunk)
    }
}
