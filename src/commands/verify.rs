//! `verify DIR`: the crate's checkpoint or a DCP directory read and checked completely.

use super::{expect_input, step, Input, Progress};
use crate::checkpoint;
use crate::error::Result;
use crate::io::dcp;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What `verify` checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "format", rename_all = "lowercase")]
pub enum Verified {
    /// The crate's checkpoint: every checksum block was read and matched.
    Checkpoint {
        /// The directory.
        input: PathBuf,
        /// Bytes of tensor state verified.
        tensor_bytes: u64,
    },
    /// A DCP directory: every byte range, chunk header and the tiling of every tensor.
    Dcp {
        /// The directory.
        input: PathBuf,
        /// What was read.
        #[serde(flatten)]
        report: dcp::VerifyReport,
    },
}

impl std::fmt::Display for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verified::Checkpoint {
                input,
                tensor_bytes,
            } => write!(
                f,
                "{}: OK ({tensor_bytes} bytes of tensor state verified)",
                input.display()
            ),
            Verified::Dcp { input, report: r } => write!(
                f,
                "{}: OK ({} tensors in {} chunks, {} objects, {} bytes read)",
                input.display(),
                r.tensors,
                r.chunks,
                r.objects,
                r.bytes_read
            ),
        }
    }
}

/// `verify DIR`: checks the crate's checkpoint directory (every checksum block) or a DCP
/// directory (byte ranges, chunk headers, tiling) completely; a Megatron-Core checkpoint is
/// checked as its `torch_dist` DCP directory.
pub fn verify(input: &Path, p: &dyn Progress) -> Result<Verified> {
    let found = expect_input(
        "verify",
        input,
        "a DCP directory, a Megatron-Core checkpoint or a checkpoint of this crate (inspect reads single files)",
        |i| i.is_dcp() || i == Input::Checkpoint || i == Input::Megatron,
    )?;
    step(p, "verifying", || {
        let dcp_dir = match found {
            Input::Megatron => Some(crate::io::megatron::directory_of(input)?),
            i if i.is_dcp() => Some(input.to_path_buf()),
            _ => None,
        };
        Ok(if let Some(dir) = dcp_dir {
            Verified::Dcp {
                input: input.to_path_buf(),
                report: dcp::verify(&dir)?,
            }
        } else {
            Verified::Checkpoint {
                input: input.to_path_buf(),
                tensor_bytes: checkpoint::verify(input)?,
            }
        })
    })
}
