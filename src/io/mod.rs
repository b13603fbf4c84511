//! Persistence (layer 7): reading and writing checkpoint files.
//!
//! [`torch_save`] reads and writes PyTorch's `torch.save` format, so that optimizer and model
//! state dicts move between Rust and Python without conversion scripts.

pub mod checkpoint;
pub mod torch_save;
