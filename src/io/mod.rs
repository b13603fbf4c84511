//! File formats (layer 6): reading and writing single checkpoint files.
//!
//! [`torch_save`] reads and writes PyTorch's `torch.save` format, so that optimizer and model
//! state dicts move between Rust and Python without conversion scripts. [`safetensors`] stores
//! the same objects as single `.safetensors` files that Python's `safetensors` reads directly.
//! [`load`] and [`save`] pick one of the two by the file's extension; [`inspect`] summarizes
//! what a file holds. [`dcp`], [`hf`] and [`deepspeed`] read (and the first two write) the
//! directories of PyTorch DCP, Hugging Face and DeepSpeed; [`megatron`] reads Megatron-Core's
//! `torch_dist` checkpoints (DCP directories with Megatron's layout and markers).

pub mod dcp;
pub mod deepspeed;
pub mod hf;
pub mod inspect;
pub mod megatron;
pub(crate) mod pickle;
pub mod safetensors;
pub mod torch_save;

use crate::error::{Error, Result};
use std::path::Path;
use torch_save::PyObj;

/// Bytes a file streamer ([`torch_save`]'s and [`safetensors`]'s, converting to DCP) reads
/// and hands on at a time.
const STREAM_CHUNK: u64 = 4 << 20;

/// Streams bytes `start..start + len` of a file: `read` (offset, buffer) fills one reused
/// buffer [`STREAM_CHUNK`] bytes at a time and `each` gets every chunk, in order.
pub(crate) fn stream_range(
    start: u64,
    len: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
    mut each: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; STREAM_CHUNK.min(len) as usize];
    let mut at = 0;
    while at < len {
        let n = STREAM_CHUNK.min(len - at) as usize;
        read(start + at, &mut buf[..n])?;
        each(&buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

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
