//! Streaming consolidation: a checkpoint directory written out as one full (unflattened,
//! name-keyed) optimizer state dict file, one checksum block at a time.

use super::load::{consolidated_order, Reader};
use super::manifest::{read_manifest, Manifest, Piece, StoredValue, CHECKSUM_BLOCK};
use crate::error::{Error, Result};
use crate::flat_param::{ModelLayout, Ownership};
use crate::io::safetensors::header::{self, Entry};
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::{optim_to_pyobj, PyObj};
use crate::optim_state::{OptimStateDict, ParamKey, ParamState, Value};
use crate::tensor::{DType, HostTensor};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The full dict's structure with a one-element placeholder per stored tensor state, whose
/// buffer address says which state (record, state index) it stands for.
pub(crate) struct Skeleton {
    manifest: Manifest,
    pub(crate) obj: PyObj,
    stands_for: HashMap<usize, (usize, usize)>,
}

impl Skeleton {
    pub(crate) fn new(dir: &Path) -> Result<Self> {
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

    /// The model's parameter values the checkpoint holds (`Fsdp::save_checkpoint` with the
    /// model), as `{"model": {name: placeholder}}` in model order: what a Hugging Face export
    /// of the checkpoint takes. An optimizer-only checkpoint gives an empty `model`.
    pub(crate) fn model_params(dir: &Path) -> Result<Self> {
        let mut manifest = read_manifest(dir)?;
        manifest.params = std::mem::take(&mut manifest.model_params);
        let mut stands_for: HashMap<usize, (usize, usize)> = HashMap::new();
        let mut items = Vec::new();
        for (ri, rec) in manifest.params.iter().enumerate() {
            for (si, (_, v)) in rec.states.iter().enumerate() {
                if let StoredValue::Tensor { dtype, .. } = v {
                    let t = HostTensor::zeros(*dtype, &[1]);
                    stands_for.insert(t.as_bytes().as_ptr() as usize, (ri, si));
                    items.push((PyObj::Str(rec.name.clone()), PyObj::Tensor(t)));
                }
            }
        }
        let model = PyObj::OrderedDict {
            items,
            attrs: Vec::new(),
        };
        Ok(Skeleton {
            manifest,
            obj: PyObj::Dict(vec![(PyObj::Str("model".into()), model)]),
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

/// The layout of a consolidated `.safetensors` file, known before any byte is written: its
/// tensors in file order (stored states as placeholders), the header, and where each
/// tensor's data starts.
pub(crate) struct SafetensorsPlan<'s> {
    tensors: Vec<(String, &'s HostTensor)>,
    header: Vec<u8>,
    /// File offset of each tensor's data.
    starts: Vec<u64>,
    /// Bytes of each tensor's data.
    lens: Vec<u64>,
}

impl<'s> SafetensorsPlan<'s> {
    pub(crate) fn new(sk: &'s Skeleton) -> Result<Self> {
        let (tensors, meta) = crate::io::safetensors::parts(&sk.obj)?;
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
        let (header, starts) = header::encode(&entries, &meta, &|e| {
            format!("the path `{}` of the checkpoint's object", e.name)
        })?;
        Ok(SafetensorsPlan {
            tensors,
            starts,
            lens: entries.iter().map(|e| e.nbytes).collect(),
            header,
        })
    }

    /// The file's length.
    pub(crate) fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.lens.iter().sum::<u64>()
    }

    /// Writes the header at the start of `file`, the temporary `tmp` of `out`.
    pub(crate) fn write_header(&self, file: &std::fs::File, out: &Path, tmp: &Path) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let err = crate::storage::tmp_io_err("writing", out, tmp);
        file.write_all_at(&self.header, 0).map_err(err)
    }

    /// The process of `ws` that writes tensor `i`: the data is cut into `ws` spans of equal
    /// bytes, and each tensor goes to the process whose span holds its first byte.
    fn writer_of(&self, i: usize, ws: usize) -> usize {
        let data = self.lens.iter().sum::<u64>();
        let from = self.starts[i] - self.header.len() as u64;
        crate::storage::writer_of(from, data, ws)
    }
}

/// Writes process `rank`'s share (of `world_size`) of the tensors of the planned file `file`
/// (the temporary `tmp` of `out`), streamed from the checkpoint `dir`; returns the tensor
/// bytes written.
pub(crate) fn write_share(
    dir: &Path,
    (file, out, tmp): (&std::fs::File, &Path, &Path),
    sk: &Skeleton,
    plan: &SafetensorsPlan<'_>,
    (rank, world_size): (usize, usize),
    mut progress: impl FnMut(u64),
) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let err = crate::storage::tmp_io_err("writing", out, tmp);
    let mut reader = Reader::new(dir, &sk.manifest, true).dropping_behind();
    let mut writeback = super::Writeback::new(0);
    let mut block = Vec::new();
    let mut written = 0u64;
    for (i, (_, t)) in plan.tensors.iter().enumerate() {
        if plan.writer_of(i, world_size) != rank {
            continue;
        }
        let mut at = plan.starts[i];
        let Some(stored) = sk.stored(t) else {
            file.write_all_at(t.as_bytes(), at).map_err(&err)?;
            continue;
        };
        stream_state(&mut reader, stored, &mut block, &mut |bytes| {
            file.write_all_at(bytes, at).map_err(&err)?;
            writeback
                .wrote_at(file, at, bytes.len() as u64)
                .map_err(&err)?;
            at += bytes.len() as u64;
            written += bytes.len() as u64;
            progress(written);
            Ok(())
        })?;
    }
    Ok(written)
}

/// Before writing the consolidated file `out` of the checkpoint `dir`: `out` must not lie
/// inside `dir` (nor be or contain it), and stale temporaries of killed runs are removed.
pub(crate) fn prepare_output(dir: &Path, out: &Path) -> Result<()> {
    crate::storage::check_not_overlapping(out, &[dir])?;
    crate::storage::clean_stale_temporaries(out, None)?;
    Ok(())
}

/// [`prepare_output`] for a DCP directory `out`.
pub(crate) fn prepare_dcp_output(dir: &Path, out: &Path) -> Result<()> {
    crate::storage::check_not_overlapping(out, &[dir])?;
    crate::storage::clean_stale_temporaries(out, Some(crate::io::dcp::DCP_DIR))?;
    Ok(())
}

/// The placeholders of a [`Skeleton`], streamed from the checkpoint into a `torch.save` file.
pub(crate) struct Streamed<'s, P> {
    /// The output file, for messages.
    out: &'s Path,
    reader: Reader<'s>,
    skeleton: &'s Skeleton,
    block: Vec<u8>,
    written: u64,
    progress: P,
}

impl<'s, P> Streamed<'s, P> {
    /// Streams `skeleton`'s states from the checkpoint in `dir`, dropping what it has read
    /// from the page cache; `out` names the output in messages.
    pub(crate) fn new(dir: &'s Path, out: &'s Path, skeleton: &'s Skeleton, progress: P) -> Self {
        Streamed {
            out,
            reader: Reader::new(dir, &skeleton.manifest, true).dropping_behind(),
            skeleton,
            block: Vec::new(),
            written: 0,
            progress,
        }
    }
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
        let (written, progress, out) = (&mut self.written, &mut self.progress, self.out);
        stream_state(&mut self.reader, stored, &mut self.block, &mut |bytes| {
            sink(bytes).map_err(Error::io(
                "writing the consolidated torch.save file (through a temporary beside it)",
                out,
            ))?;
            *written += bytes.len() as u64;
            progress(*written);
            Ok(())
        })?;
        Ok(())
    }
}
