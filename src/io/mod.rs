//! File formats (layer 6): reading and writing single checkpoint files.
//!
//! [`torch_save`] reads and writes PyTorch's `torch.save` format, so that optimizer and model
//! state dicts move between Rust and Python without conversion scripts. [`safetensors`] stores
//! the same objects as single `.safetensors` files that Python's `safetensors` reads directly.
//! [`load`] and [`save`] pick one of the two by the file's extension; [`inspect`] summarizes
//! what a file holds.

pub mod dcp;
pub mod inspect;
pub mod safetensors;
pub mod torch_save;

use crate::error::{Error, Result};
use std::path::Path;
use torch_save::PyObj;

/// A checkpoint file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FileFormat {
    /// `torch.save` (zip + pickle): `.pt`, `.pth`, `.bin`, `.ckpt`.
    TorchSave,
    /// One safetensors file: `.safetensors`.
    Safetensors,
}

impl FileFormat {
    /// The format named by the path's extension (case-insensitive).
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("pt" | "pth" | "bin" | "ckpt") => Ok(FileFormat::TorchSave),
            Some("safetensors") => Ok(FileFormat::Safetensors),
            _ => Err(Error::UnknownFileFormat {
                path: path.display().to_string(),
            }),
        }
    }

    /// A short name: `torch.save` or `safetensors`.
    pub fn name(self) -> &'static str {
        match self {
            FileFormat::TorchSave => "torch.save",
            FileFormat::Safetensors => "safetensors",
        }
    }
}

/// Reads the object stored at `path`, in the format its extension names.
pub fn load(path: impl AsRef<Path>) -> Result<PyObj> {
    let path = path.as_ref();
    match FileFormat::from_path(path)? {
        FileFormat::TorchSave => torch_save::load(path),
        FileFormat::Safetensors => safetensors::load(path),
    }
}

/// [`load`] with options for `torch.save` files (safetensors files hold no views, so the
/// options do not apply to them).
pub fn load_with(path: impl AsRef<Path>, opts: &torch_save::LoadOptions) -> Result<PyObj> {
    let path = path.as_ref();
    match FileFormat::from_path(path)? {
        FileFormat::TorchSave => torch_save::load_with(path, opts),
        FileFormat::Safetensors => safetensors::load(path),
    }
}

/// Writes `obj` to `path`, in the format its extension names, atomically.
pub fn save(obj: &PyObj, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    match FileFormat::from_path(path)? {
        FileFormat::TorchSave => torch_save::save(obj, path),
        FileFormat::Safetensors => safetensors::save(obj, path),
    }
}
