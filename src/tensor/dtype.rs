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
    /// `torch.int8` (8-bit optimizers keep their quantized states in it)
    I8,
    /// `torch.int16`
    I16,
    /// `torch.uint16`
    U16,
    /// `torch.uint32`
    U32,
    /// `torch.uint64`
    U64,
    /// `torch.float8_e4m3fn`
    F8E4M3FN,
    /// `torch.float8_e5m2`
    F8E5M2,
}

impl DType {
    /// All supported dtypes.
    pub const ALL: [DType; 15] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::U8,
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F8E4M3FN,
        DType::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::U8 | DType::Bool | DType::I8 | DType::F8E4M3FN | DType::F8E5M2 => 1,
        }
    }

    /// Whether PyTorch considers the dtype floating point (FSDP flattens only these).
    pub const fn is_floating_point(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2
        )
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
            DType::I8 => "torch.int8",
            DType::I16 => "torch.int16",
            DType::U16 => "torch.uint16",
            DType::U32 => "torch.uint32",
            DType::U64 => "torch.uint64",
            DType::F8E4M3FN => "torch.float8_e4m3fn",
            DType::F8E5M2 => "torch.float8_e5m2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}
