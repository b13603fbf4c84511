//! Streaming consolidation: a checkpoint directory written out as one full (unflattened,
//! name-keyed) optimizer state dict file, one checksum block at a time.

use super::container::{self, Entry};
use super::load::{consolidated_order, Reader};
use super::manifest::{read_manifest, Manifest, Piece, StoredValue, CHECKSUM_BLOCK};
use crate::error::{Error, Result};
use crate::flat_param::{ModelLayout, Ownership};
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::{optim_to_pyobj, PyObj};
use crate::optim_state::{OptimStateDict, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

/// The full dict's structure with a one-element placeholder per stored tensor state, whose
/// buffer address says which state (record, state index) it stands for.
struct Skeleton {
    manifest: Manifest,
    obj: PyObj,
    stands_for: HashMap<usize, (usize, usize)>,
}

impl Skeleton {
    fn new(dir: &Path) -> Result<Self> {
        let manifest = read_manifest(dir)?;
        let layout = ModelLayout::new(&manifest.model, &manifest.policy, manifest.world_size)?;
        let mut skeleton = OptimStateDict {
            state: Default::default(),
            param_groups: manifest.param_groups.clone(),
        };
        let mut stands_for: HashMap<usize, (usize, usize)> = HashMap::new();
        for (ri, rec) in manifest.params.iter().enumerate() {
            let mut st = ParamState::new();
            for (si, (n, v)) in rec.states.iter().enumerate() {
                let value = match v {
                    StoredValue::Value(v) => v.clone(),
                    StoredValue::Tensor { dtype, .. } => {
                        let t = HostTensor::zeros(*dtype, &[1]);
                        stands_for.insert(t.as_bytes().as_ptr() as usize, (ri, si));
                        Value::Tensor(t)
                    }
                };
                st.insert(n.clone(), value);
            }
            let managed = layout
                .param_index(&rec.name)
                .is_some_and(|i| layout.ownership[i] != Ownership::Unmanaged);
            if managed {
                st = consolidated_order(st, layout.use_orig_params());
            }
            skeleton.state.insert(ParamKey::Name(rec.name.clone()), st);
        }
        for (k, st) in &manifest.user_state {
            skeleton.state.insert(k.clone(), st.clone());
        }
        let obj = optim_to_pyobj(&skeleton)?;
        Ok(Skeleton {
            manifest,
            obj,
            stands_for,
        })
    }

    /// The stored tensor state placeholder `t` stands for: (name for messages, dtype, shape,
    /// pieces).
    fn stored(&self, t: &HostTensor) -> Option<(String, DType, &[usize], &[Piece])> {
        let &(ri, si) = self.stands_for.get(&(t.as_bytes().as_ptr() as usize))?;
        let rec = &self.manifest.params[ri];
        match &rec.states[si] {
            (
                n,
                StoredValue::Tensor {
                    dtype,
                    shape,
                    pieces,
                },
            ) => Some((format!("{}/{n}", rec.name), *dtype, shape, pieces)),
            _ => None,
        }
    }
}

/// Streams one stored tensor state through `sink`, one checksum block at a time (whole
/// blocks read in place, each verified); returns its bytes.
fn stream_state(
    reader: &mut Reader<'_>,
    (what, dtype, shape, pieces): (String, DType, &[usize], &[Piece]),
    block: &mut Vec<u8>,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<u64> {
    let size = dtype.size();
    let numel: usize = shape.iter().product();
    let mut at = 0;
    let mut written = 0u64;
    while at < numel {
        // Up to the end of the stored block holding `at` (at most one block).
        let cap = numel.min(at + CHECKSUM_BLOCK / size);
        let take = Reader::block_end(pieces, size, at, cap) - at;
        block.resize(take * size, 0);
        reader.read_range(&what, pieces, size, at, block)?;
        sink(block)?;
        at += take;
        written += block.len() as u64;
    }
    Ok(written)
}

/// Writes the full dict of the checkpoint in `dir` — what `full_optim_state_dict` returned
/// when it was saved — to `out` as a `.safetensors` file in the crate's mapping
/// ([`crate::io::safetensors`]), streaming: memory stays at two checksum blocks (8 MiB) plus
/// the dict's structure, whatever the model size. Every block read is verified; the file
/// appears atomically. `progress` gets the tensor bytes written so far. Returns the tensor
/// bytes written.
pub fn consolidate_to_safetensors(
    dir: &Path,
    out: &Path,
    mut progress: impl FnMut(u64),
) -> Result<u64> {
    let sk = Skeleton::new(dir)?;
    let (tensors, meta) = crate::io::safetensors::parts(&sk.obj);
    let entries: Vec<Entry> = tensors
        .iter()
        .map(|(name, t)| match sk.stored(t) {
            Some((_, dtype, shape, _)) => {
                let numel: usize = shape.iter().product();
                Entry {
                    name: name.clone(),
                    dtype,
                    shape: shape.to_vec(),
                    nbytes: (numel * dtype.size()) as u64,
                }
            }
            None => Entry {
                name: name.clone(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                nbytes: t.nbytes() as u64,
            },
        })
        .collect();
    let meta: BTreeMap<String, String> = meta.into_iter().collect();
    let (header, _) = container::header(&entries, &meta)?;
    let tmp = out.with_file_name(format!(
        ".{}.{}.tmp",
        out.file_name()
            .map_or("out".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    let result = (|| {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(Error::io("creating", &tmp))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&header).map_err(Error::io("writing", &tmp))?;
        let mut writeback = super::Writeback::new(0);
        let mut reader = Reader::new(dir, &sk.manifest, true);
        let mut block = Vec::new();
        let mut written = 0u64;
        for (_, t) in &tensors {
            let Some(stored) = sk.stored(t) else {
                w.write_all(t.as_bytes())
                    .map_err(Error::io("writing", &tmp))?;
                continue;
            };
            stream_state(&mut reader, stored, &mut block, &mut |bytes| {
                w.write_all(bytes).map_err(Error::io("writing", &tmp))?;
                writeback.wrote(w.get_ref(), bytes.len() as u64);
                written += bytes.len() as u64;
                progress(written);
                Ok(())
            })?;
        }
        let file: File = w
            .into_inner()
            .map_err(|e| Error::io("writing", &tmp)(e.into_error()))?;
        file.sync_all().map_err(Error::io("syncing", &tmp))?;
        std::fs::rename(&tmp, out).map_err(Error::io("renaming into place", out))?;
        Ok(written)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// [`consolidate_to_safetensors`] to a `torch.save` file instead: `torch.load(out)` gives what
/// `FSDP.full_optim_state_dict` returned when the checkpoint was saved, byte for byte the file
/// `torch_save::save_optim_state_dict(&load_full(dir)?, out)` writes, but streamed one
/// checksum block at a time. Every block read is verified; the file appears atomically.
/// `progress` gets the tensor bytes written so far. Returns the tensor bytes written.
pub fn consolidate_to_torch(dir: &Path, out: &Path, progress: impl FnMut(u64)) -> Result<u64> {
    let sk = Skeleton::new(dir)?;
    let mut lazy = Streamed {
        reader: Reader::new(dir, &sk.manifest, true),
        skeleton: &sk,
        block: Vec::new(),
        written: 0,
        progress,
    };
    crate::io::torch_save::save_streaming(&sk.obj, out, &mut lazy)?;
    Ok(lazy.written)
}

/// The placeholders of a [`Skeleton`], streamed from the checkpoint into a `torch.save` file.
struct Streamed<'s, P> {
    reader: Reader<'s>,
    skeleton: &'s Skeleton,
    block: Vec<u8>,
    written: u64,
    progress: P,
}

impl<P: FnMut(u64)> LazyTensors for Streamed<'_, P> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        self.skeleton
            .stored(t)
            .map(|(_, _, shape, _)| shape.to_vec())
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        let Some(stored) = self.skeleton.stored(t) else {
            return Ok(());
        };
        let (written, progress) = (&mut self.written, &mut self.progress);
        stream_state(&mut self.reader, stored, &mut self.block, &mut |bytes| {
            sink(bytes).map_err(|e| Error::Io {
                op: "writing a consolidated torch.save file".into(),
                path: String::new(),
                source: e.into(),
            })?;
            *written += bytes.len() as u64;
            progress(*written);
            Ok(())
        })?;
        Ok(())
    }
}
