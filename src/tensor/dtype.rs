//! Element types, named and sized as PyTorch names and sizes them.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor; the subset of `torch.dtype` that optimizer state uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// `torch.float32`
    F32,
    /// `torch.float64`
    F64,
    /// `torch.float16`
    F16,
    /// `torch.bfloat16`
    BF16,
    /// `torch.int64`
    I64,
    /// `torch.int32`
    I32,
    /// `torch.uint8`
    U8,
    /// `torch.bool`
    Bool,
}

impl DType {
    /// All supported dtypes.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether PyTorch considers the dtype floating point (FSDP flattens only these).
    pub const fn is_floating_point(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// PyTorch's name, e.g. `torch.float32`.
    pub const fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "torch.float32",
            DType::F64 => "torch.float64",
            DType::F16 => "torch.float16",
            DType::BF16 => "torch.bfloat16",
            DType::I64 => "torch.int64",
            DType::I32 => "torch.int32",
            DType::U8 => "torch.uint8",
            DType::Bool => "torch.bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}
