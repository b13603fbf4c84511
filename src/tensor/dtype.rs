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
    /// `torch.complex64`: a pair of f32 (real, imaginary) per element
    C64,
    /// `torch.complex128`: a pair of f64 per element
    C128,
}

/// Everything the crate knows of one dtype, by the names each format gives it: one row per
/// [`DType`], in the enum's order (a test checks it).
struct Row {
    dtype: DType,
    /// PyTorch's name (`torch.float32`).
    torch: &'static str,
    /// The legacy typed storage class `torch.save` pickles for it (`FloatStorage`); `None`
    /// for dtypes newer than typed storages, which PyTorch saves as `UntypedStorage`.
    storage_class: Option<&'static str>,
    /// The safetensors header's name (`F32`); `None` for dtypes safetensors has no name for.
    safetensors: Option<&'static str>,
    size: usize,
    floating_point: bool,
}

#[rustfmt::skip]
const TABLE: [Row; 17] = [
    Row { dtype: DType::F32, torch: "torch.float32", storage_class: Some("FloatStorage"), safetensors: Some("F32"), size: 4, floating_point: true },
    Row { dtype: DType::F64, torch: "torch.float64", storage_class: Some("DoubleStorage"), safetensors: Some("F64"), size: 8, floating_point: true },
    Row { dtype: DType::F16, torch: "torch.float16", storage_class: Some("HalfStorage"), safetensors: Some("F16"), size: 2, floating_point: true },
    Row { dtype: DType::BF16, torch: "torch.bfloat16", storage_class: Some("BFloat16Storage"), safetensors: Some("BF16"), size: 2, floating_point: true },
    Row { dtype: DType::I64, torch: "torch.int64", storage_class: Some("LongStorage"), safetensors: Some("I64"), size: 8, floating_point: false },
    Row { dtype: DType::I32, torch: "torch.int32", storage_class: Some("IntStorage"), safetensors: Some("I32"), size: 4, floating_point: false },
    Row { dtype: DType::U8, torch: "torch.uint8", storage_class: Some("ByteStorage"), safetensors: Some("U8"), size: 1, floating_point: false },
    Row { dtype: DType::Bool, torch: "torch.bool", storage_class: Some("BoolStorage"), safetensors: Some("BOOL"), size: 1, floating_point: false },
    Row { dtype: DType::I8, torch: "torch.int8", storage_class: Some("CharStorage"), safetensors: Some("I8"), size: 1, floating_point: false },
    Row { dtype: DType::I16, torch: "torch.int16", storage_class: Some("ShortStorage"), safetensors: Some("I16"), size: 2, floating_point: false },
    Row { dtype: DType::U16, torch: "torch.uint16", storage_class: None, safetensors: Some("U16"), size: 2, floating_point: false },
    Row { dtype: DType::U32, torch: "torch.uint32", storage_class: None, safetensors: Some("U32"), size: 4, floating_point: false },
    Row { dtype: DType::U64, torch: "torch.uint64", storage_class: None, safetensors: Some("U64"), size: 8, floating_point: false },
    Row { dtype: DType::F8E4M3FN, torch: "torch.float8_e4m3fn", storage_class: None, safetensors: Some("F8_E4M3"), size: 1, floating_point: true },
    Row { dtype: DType::F8E5M2, torch: "torch.float8_e5m2", storage_class: None, safetensors: Some("F8_E5M2"), size: 1, floating_point: true },
    Row { dtype: DType::C64, torch: "torch.complex64", storage_class: Some("ComplexFloatStorage"), safetensors: Some("C64"), size: 8, floating_point: false },
    Row { dtype: DType::C128, torch: "torch.complex128", storage_class: Some("ComplexDoubleStorage"), safetensors: None, size: 16, floating_point: false },
];

/// PyTorch dtypes a file may name that the crate cannot hold: a checkpoint that has them is
/// read far enough to list them, and refused by name where their values are needed.
pub(crate) const OTHER_TORCH_DTYPES: &[&str] = &["complex32", "float8_e4m3fnuz", "float8_e5m2fnuz"];

impl DType {
    /// All supported dtypes.
    pub const ALL: [DType; 17] = {
        let mut all = [DType::F32; 17];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].dtype;
            i += 1;
        }
        all
    };

    const fn row(self) -> &'static Row {
        &TABLE[self as usize]
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        self.row().size
    }

    /// Whether PyTorch considers the dtype floating point (FSDP flattens only these).
    pub const fn is_floating_point(self) -> bool {
        self.row().floating_point
    }

    /// PyTorch's name, e.g. `torch.float32`.
    pub const fn torch_name(self) -> &'static str {
        self.row().torch
    }

    /// PyTorch's attribute name, e.g. `float32` (what a pickle names as the global
    /// `torch.float32`).
    pub fn torch_attr(self) -> &'static str {
        &self.row().torch["torch.".len()..]
    }

    /// The dtype PyTorch calls `name` (`float32` or `torch.float32`), if the crate has it.
    pub fn from_torch_name(name: &str) -> Option<DType> {
        DType::from_torch_attr(name.strip_prefix("torch.").unwrap_or(name))
    }

    /// The dtype whose attribute name is `name` (`float32`), as a pickle's global
    /// `torch.<name>` names it.
    pub(crate) fn from_torch_attr(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.torch_attr() == name)
    }

    /// The legacy typed storage class `torch.save` pickles for this dtype (`FloatStorage`),
    /// or `None` where PyTorch pickles an `UntypedStorage` and the dtype.
    pub const fn storage_class(self) -> Option<&'static str> {
        self.row().storage_class
    }

    /// The dtype of the legacy storage class `name` (`FloatStorage`).
    pub fn from_storage_class(name: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| r.storage_class == Some(name))
            .map(|r| r.dtype)
    }

    /// The name a safetensors header gives this dtype (`F32`), or `None` where the format
    /// has none (`torch.complex128`).
    pub const fn safetensors_name(self) -> Option<&'static str> {
        self.row().safetensors
    }

    /// The dtype a safetensors header calls `name`, if the crate has it.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| r.safetensors == Some(name))
            .map(|r| r.dtype)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_one_row_per_dtype_in_the_enums_order_and_names_round_trip() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i);
            assert_eq!(d.row().dtype, *d);
            assert_eq!(DType::from_torch_name(d.torch_attr()), Some(*d));
            assert_eq!(DType::from_torch_name(d.torch_name()), Some(*d));
            if let Some(name) = d.safetensors_name() {
                assert_eq!(DType::from_safetensors_name(name), Some(*d));
            }
            if let Some(class) = d.storage_class() {
                assert_eq!(DType::from_storage_class(class), Some(*d));
            }
        }
        assert_eq!(DType::from_torch_name("complex32"), None);
        assert!(OTHER_TORCH_DTYPES
            .iter()
            .all(|n| DType::from_torch_name(n).is_none()));
    }
}
