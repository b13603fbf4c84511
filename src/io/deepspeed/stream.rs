//! A DeepSpeed checkpoint's tensors read one parameter at a time, and the consolidated dicts
//! that stream them into an output file.
//!
//! A parameter's elements are runs of its ranks' flat tensors; each run is read straight
//! from its storage's byte range ([`StorageReader`]), forward, so memory holds one 1 MiB
//! piece whatever the model's size. Every storage's CRC-32 is checked when the read of its
//! last needed run reaches on to its end, or at [`Readers::finish`].

use super::{DeepSpeedCheckpoint, Span, Src, State};
use crate::error::{Error, Result};
use crate::io::torch_save::writer::LazyTensors;
use crate::io::torch_save::{PyObj, StorageReader};
use crate::tensor::{DType, HostTensor};
use std::collections::HashMap;
use std::path::Path;

/// The files of a checkpoint, each opened on first use.
pub(super) struct Readers<'c> {
    ckpt: &'c DeepSpeedCheckpoint,
    open: Vec<Option<StorageReader>>,
}

impl<'c> Readers<'c> {
    pub(super) fn new(ckpt: &'c DeepSpeedCheckpoint) -> Self {
        Readers {
            ckpt,
            open: (0..ckpt.files.len()).map(|_| None).collect(),
        }
    }

    fn reader(&mut self, file: usize) -> Result<&mut StorageReader> {
        let slot = self.open.get_mut(file).ok_or_else(|| {
            Error::Internal(format!("no file {file} in the DeepSpeed checkpoint"))
        })?;
        if slot.is_none() {
            *slot = Some(StorageReader::open(&self.ckpt.files[file])?);
        }
        slot.as_mut()
            .ok_or_else(|| Error::Internal("a reader just opened".into()))
    }

    /// Hands the bytes of `spans`, in order, to `sink`.
    pub(super) fn stream(
        &mut self,
        spans: &[Span],
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let ckpt = self.ckpt;
        for span in spans.iter().filter(|s| s.len > 0) {
            match &ckpt.srcs[span.src] {
                Src::Stored {
                    file,
                    key,
                    offset,
                    dtype,
                    needed,
                } => {
                    let es = dtype.size() as u64;
                    let from = (offset + span.start) as u64 * es;
                    let to = from + span.len as u64 * es;
                    let r = self.reader(*file)?;
                    r.read(key, from, to, sink)?;
                    if span.start + span.len == *needed {
                        r.read_to_end(key)?;
                    }
                }
                Src::Held(t) => {
                    let es = t.dtype().size();
                    let bytes = t
                        .as_bytes()
                        .get(span.start * es..(span.start + span.len) * es)
                        .ok_or_else(|| {
                            Error::Internal(format!(
                                "elements {}..+{} of a {}-element tensor",
                                span.start,
                                span.len,
                                t.numel()
                            ))
                        })?;
                    sink(bytes)?;
                }
            }
        }
        Ok(())
    }

    /// The tensor of `dtype` and `shape` whose elements `spans` hold.
    pub(super) fn collect(
        &mut self,
        spans: &[Span],
        dtype: DType,
        shape: &[usize],
    ) -> Result<HostTensor> {
        HostTensor::filled_by(dtype, shape, |buf| {
            let mut at = 0;
            self.stream(spans, &mut |chunk| {
                let dst = buf.get_mut(at..at + chunk.len()).ok_or_else(|| {
                    Error::Internal("the runs of a DeepSpeed tensor overflow it".into())
                })?;
                dst.copy_from_slice(chunk);
                at += chunk.len();
                Ok(())
            })?;
            if at != buf.len() {
                return Err(Error::Internal(format!(
                    "the runs of a DeepSpeed tensor gave {at} of its {} bytes",
                    buf.len()
                )));
            }
            Ok(())
        })
    }

    /// Bytes read from the files so far.
    #[cfg(test)]
    pub(super) fn bytes_read(&self) -> u64 {
        self.open
            .iter()
            .flatten()
            .map(StorageReader::bytes_read)
            .sum()
    }

    /// Checks the CRC-32 of every storage read from (reading each on to its end).
    pub(super) fn finish(&mut self) -> Result<()> {
        for r in self.open.iter_mut().flatten() {
            r.finish()?;
        }
        Ok(())
    }
}

/// What a placeholder of a [`Consolidated`] dict stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// A state of parameter `.0`.
    Param(usize, State),
    /// Buffer `.0`, cast to float32 when `.1`.
    Buffer(usize, bool),
    /// Frozen parameter `.0`, cast to float32 when `.1`.
    Frozen(usize, bool),
}

/// A consolidated dict of a DeepSpeed checkpoint, its tensors placeholders that [`Streamed`]
/// streams from the checkpoint.
pub(crate) struct Consolidated {
    /// The dict.
    pub(crate) obj: PyObj,
    /// Per placeholder (by storage id): what it stands for, its shape and dtype.
    stands_for: HashMap<usize, (Want, Vec<usize>, DType)>,
}

impl Consolidated {
    fn placeholder(&mut self, want: Want, shape: &[usize], dtype: DType) -> HostTensor {
        let t = HostTensor::zeros(dtype, &[0]);
        self.stands_for
            .insert(t.storage_id(), (want, shape.to_vec(), dtype));
        t
    }
}

impl DeepSpeedCheckpoint {
    /// The dict `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`
    /// returns: the buffers (as float32), then the frozen parameters in their own dtype (the
    /// model's), then the fp32 master weights in flat order, then each tied alias as the same
    /// tensor as its parameter. (At stage 1 DeepSpeed saves no frozen fragments and
    /// zero_to_fp32 leaves the frozen parameters and their aliases out; here they are taken
    /// from `module`.) With `optim`, `{"model": …, "optim": {"state": …, "param_groups": …}}`
    /// as `get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))` of the
    /// plain float32 model and a `torch.optim.Adam` over its trainable parameters names it:
    /// `model` in `module.state_dict()` order (master weights and frozen weights as float32,
    /// buffers in their own dtype, tied aliases sharing their parameter's tensor), `state`
    /// keyed by parameter name in param-group order, each `{"step", "exp_avg", "exp_avg_sq"}`
    /// (Adam's order; a frozen parameter has none), and `param_groups` with the client
    /// optimizer's hyper-parameters and `params` listing names.
    pub(crate) fn consolidated(&self, optim: bool) -> Consolidated {
        let mut c = Consolidated {
            obj: PyObj::None,
            stands_for: HashMap::new(),
        };
        let masters: Vec<HostTensor> = self
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| c.placeholder(Want::Param(i, State::Fp32), &p.shape, DType::F32))
            .collect();
        let frozen: Vec<HostTensor> = self
            .frozen
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let dtype = if optim { DType::F32 } else { f.dtype };
                c.placeholder(Want::Frozen(i, optim), &f.shape, dtype)
            })
            .collect();
        let master = |name: &str| {
            let trained = self.params.iter().position(|p| p.name == name);
            let fixed = || self.frozen.iter().position(|f| f.name == name);
            match trained {
                Some(i) => Some(masters[i].clone()),
                None => fixed().map(|i| frozen[i].clone()),
            }
        };
        let item = |k: &str, t: HostTensor| (PyObj::Str(k.to_string()), PyObj::Tensor(t));
        if !optim {
            let mut items = Vec::new();
            for (i, b) in self.buffers.iter().enumerate() {
                let t = c.placeholder(Want::Buffer(i, true), &b.shape, DType::F32);
                items.push(item(&b.name, t));
            }
            for (f, t) in self.frozen.iter().zip(&frozen) {
                items.push(item(&f.name, t.clone()));
            }
            for (p, t) in self.params.iter().zip(&masters) {
                items.push(item(&p.name, t.clone()));
            }
            for (alias, primary) in &self.aliases {
                if let Some(t) = master(primary) {
                    items.push(item(alias, t));
                }
            }
            c.obj = PyObj::OrderedDict {
                items,
                attrs: Vec::new(),
            };
            return c;
        }
        let mut model = Vec::new();
        for name in &self.module_order {
            if let Some(t) = master(name) {
                model.push(item(name, t));
            } else if let Some(i) = self.buffers.iter().position(|b| &b.name == name) {
                let b = &self.buffers[i];
                let t = c.placeholder(Want::Buffer(i, false), &b.shape, b.dtype);
                model.push(item(name, t));
            } else if let Some((_, primary)) = self.aliases.iter().find(|(a, _)| a == name) {
                if let Some(t) = master(primary) {
                    model.push(item(name, t));
                }
            }
        }
        let mut state = Vec::new();
        for g in &self.groups {
            for name in &g.members {
                let Some(i) = self.params.iter().position(|p| &p.name == name) else {
                    continue;
                };
                let p = &self.params[i];
                // A step of its own per parameter: Adam increments it in place.
                let s = &self.steps[i];
                let step = HostTensor::from_bytes(s.dtype(), s.shape(), s.as_bytes())
                    .unwrap_or_else(|_| s.clone());
                let exp_avg = c.placeholder(Want::Param(i, State::ExpAvg), &p.shape, DType::F32);
                let exp_avg_sq =
                    c.placeholder(Want::Param(i, State::ExpAvgSq), &p.shape, DType::F32);
                state.push((
                    PyObj::Str(name.clone()),
                    PyObj::Dict(vec![
                        item("step", step),
                        item("exp_avg", exp_avg),
                        item("exp_avg_sq", exp_avg_sq),
                    ]),
                ));
            }
        }
        let param_groups = self
            .groups
            .iter()
            .map(|g| {
                let mut d: Vec<(PyObj, PyObj)> = g
                    .hyperparameters
                    .iter()
                    .map(|(k, v)| (PyObj::Str(k.clone()), v.clone()))
                    .collect();
                d.push((
                    PyObj::Str("params".into()),
                    PyObj::List(g.members.iter().cloned().map(PyObj::Str).collect()),
                ));
                PyObj::Dict(d)
            })
            .collect();
        c.obj = PyObj::Dict(vec![
            (PyObj::Str("model".into()), PyObj::Dict(model)),
            (
                PyObj::Str("optim".into()),
                PyObj::Dict(vec![
                    (PyObj::Str("state".into()), PyObj::Dict(state)),
                    (PyObj::Str("param_groups".into()), PyObj::List(param_groups)),
                ]),
            ),
        ]);
        c
    }
}

/// The placeholders of a [`Consolidated`] dict, streamed from the checkpoint.
pub(crate) struct Streamed<'c, P> {
    ckpt: &'c DeepSpeedCheckpoint,
    cons: &'c Consolidated,
    readers: Readers<'c>,
    /// The output, for messages.
    out: &'c Path,
    written: u64,
    progress: P,
    /// Bytes of a cast buffer that end inside an element, carried to the next chunk.
    carry: Vec<u8>,
    cast: Vec<u8>,
}

impl<'c, P: FnMut(u64)> Streamed<'c, P> {
    /// Streams `cons`'s placeholders from `ckpt` into the output `out`; `progress` gets the
    /// tensor bytes written so far.
    pub(crate) fn new(
        ckpt: &'c DeepSpeedCheckpoint,
        cons: &'c Consolidated,
        out: &'c Path,
        progress: P,
    ) -> Self {
        Streamed {
            ckpt,
            cons,
            readers: Readers::new(ckpt),
            out,
            written: 0,
            progress,
            carry: Vec::new(),
            cast: Vec::new(),
        }
    }
}

impl<P: FnMut(u64)> LazyTensors for Streamed<'_, P> {
    fn shape_of(&self, t: &HostTensor) -> Option<Vec<usize>> {
        self.cons
            .stands_for
            .get(&t.storage_id())
            .map(|(_, shape, _)| shape.clone())
    }

    fn stream(
        &mut self,
        t: &HostTensor,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        let Some(&(want, _, _)) = self.cons.stands_for.get(&t.storage_id()) else {
            return Ok(());
        };
        let ckpt = self.ckpt;
        let out = self.out;
        let (spans, from): (&[Span], Option<DType>) = match want {
            Want::Param(i, state) => (&ckpt.spans[i][state.index()], None),
            Want::Frozen(i, as_f32) => {
                let dtype = ckpt.frozen[i].dtype;
                (
                    &ckpt.frozen_spans[i][..],
                    (as_f32 && dtype != DType::F32).then_some(dtype),
                )
            }
            Want::Buffer(i, as_f32) => {
                let dtype = ckpt.buffers[i].dtype;
                (
                    std::slice::from_ref(&ckpt.buffer_spans[i]),
                    (as_f32 && dtype != DType::F32).then_some(dtype),
                )
            }
        };
        let Streamed {
            readers,
            written,
            progress,
            carry,
            cast,
            ..
        } = self;
        carry.clear();
        let mut put = |bytes: &[u8]| -> Result<()> {
            sink(bytes).map_err(Error::io(
                "writing the consolidated file (through a temporary beside it)",
                out,
            ))?;
            *written += bytes.len() as u64;
            progress(*written);
            Ok(())
        };
        readers.stream(spans, &mut |chunk| match from {
            None => put(chunk),
            Some(dtype) => {
                carry.extend_from_slice(chunk);
                let whole = carry.len() / dtype.size() * dtype.size();
                cast.clear();
                to_f32(dtype, &carry[..whole], cast)?;
                carry.drain(..whole);
                put(cast)
            }
        })?;
        if !carry.is_empty() {
            return Err(Error::Internal(
                "a tensor's bytes end inside an element".into(),
            ));
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.readers.finish()
    }
}

/// Appends the elements of `bytes` (of `dtype`) as float32, as `Tensor.float()` converts
/// them: floating dtypes rounded as PyTorch rounds, integers and bools by value.
fn to_f32(dtype: DType, bytes: &[u8], out: &mut Vec<u8>) -> Result<()> {
    if crate::tensor::cast::casts(dtype, DType::F32) {
        crate::tensor::cast::cast(dtype, DType::F32, bytes, out);
        return Ok(());
    }
    let es = dtype.size();
    for e in bytes.chunks_exact(es) {
        let x = match dtype {
            DType::F32 => f32::from_le_bytes([e[0], e[1], e[2], e[3]]),
            DType::Bool => f32::from(u8::from(e[0] != 0)),
            DType::U8 => f32::from(e[0]),
            DType::I8 => f32::from(e[0] as i8),
            DType::I16 => f32::from(i16::from_le_bytes([e[0], e[1]])),
            DType::U16 => f32::from(u16::from_le_bytes([e[0], e[1]])),
            DType::I32 => i32::from_le_bytes([e[0], e[1], e[2], e[3]]) as f32,
            DType::U32 => u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as f32,
            DType::I64 => i64::from_le_bytes(e.try_into().map_err(|_| bad_width())?) as f32,
            DType::U64 => u64::from_le_bytes(e.try_into().map_err(|_| bad_width())?) as f32,
            other => {
                return Err(Error::Unsupported(format!(
                    "a {other} buffer cannot be written as float32 (zero_to_fp32 calls .float() on every buffer)"
                )))
            }
        };
        out.extend_from_slice(&x.to_le_bytes());
    }
    Ok(())
}

fn bad_width() -> Error {
    Error::Internal("an element of the wrong width".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(case: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden/deepspeed")
            .join(case)
            .join("ckpt")
    }

    /// Streaming every parameter's states in order reads each storage of the optimizer files
    /// once (to its end, for its CRC-32), however many parameters share it.
    #[test]
    fn in_order_each_storage_is_read_once() {
        for case in ["zero2_fp32", "zero3_bf16", "zero1_bf16_fp32acc"] {
            let ckpt = DeepSpeedCheckpoint::open(&fixture(case)).unwrap();
            let mut readers = Readers::new(&ckpt);
            for state in State::ALL {
                for spans in &ckpt.spans {
                    readers
                        .stream(&spans[state.index()], &mut |_| Ok(()))
                        .unwrap();
                }
            }
            readers.finish().unwrap();
            // Every stored source, its storage counted once.
            let mut storages = std::collections::BTreeMap::new();
            for src in &ckpt.srcs {
                if let Src::Stored { file, key, .. } = src {
                    if *file < ckpt.world_size {
                        let mut r = StorageReader::open(&ckpt.files[*file]).unwrap();
                        let len = r.storage_len(key).unwrap();
                        storages.insert((*file, key.clone()), len);
                    }
                }
            }
            assert_eq!(
                readers.bytes_read(),
                storages.values().sum::<u64>(),
                "{case}"
            );
        }
    }

    /// Reading behind a storage's cursor starts a new pass, whose CRC-32 is checked too.
    #[test]
    fn reading_backwards_rereads_and_still_checks() {
        let ckpt = DeepSpeedCheckpoint::open(&fixture("zero2_fp32")).unwrap();
        let mut readers = Readers::new(&ckpt);
        let last = ckpt.params.len() - 1;
        let mut a = Vec::new();
        readers
            .stream(&ckpt.spans[last][0], &mut |c| {
                a.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
        let mut b = Vec::new();
        readers
            .stream(&ckpt.spans[0][0], &mut |c| {
                b.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
        readers.finish().unwrap();
        assert_eq!(a.len(), 4, "logit_scale");
        assert_eq!(b.len(), 4 * 444, "emb.weight");
        let emb = ckpt.read("emb.weight", State::Fp32).unwrap();
        assert_eq!(emb.as_bytes(), &b[..]);
    }
}
