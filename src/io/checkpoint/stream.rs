//! Streaming consolidation: a checkpoint directory written out as one full (unflattened,
//! name-keyed) optimizer state dict file, one checksum block at a time.

use super::container::{self, Entry};
use super::fs_err;
use super::load::{consolidated_order, Reader};
use super::manifest::{read_manifest, StoredValue, CHECKSUM_BLOCK};
use crate::error::Result;
use crate::flat_param::{ModelLayout, Ownership};
use crate::io::torch_save::optim_to_pyobj;
use crate::optim_state::{OptimStateDict, ParamKey, ParamState, Value};
use crate::tensor::HostTensor;
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

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
    let manifest = read_manifest(dir)?;
    let layout = ModelLayout::new(&manifest.model, &manifest.policy, manifest.world_size)?;
    // The dict's structure with a one-element placeholder per stored tensor state; each
    // placeholder's address says which state it stands for.
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
    let (tensors, meta) = crate::io::safetensors::parts(&obj);
    let entries: Vec<Entry> = tensors
        .iter()
        .map(
            |(name, t)| match stands_for.get(&(t.as_bytes().as_ptr() as usize)) {
                Some(&(ri, si)) => {
                    let StoredValue::Tensor { dtype, shape, .. } =
                        &manifest.params[ri].states[si].1
                    else {
                        unreachable!("placeholders stand for tensor states")
                    };
                    let numel: usize = shape.iter().product();
                    Entry {
                        name: name.clone(),
                        dtype: *dtype,
                        shape: shape.clone(),
                        nbytes: (numel * dtype.size()) as u64,
                    }
                }
                None => Entry {
                    name: name.clone(),
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    nbytes: t.nbytes() as u64,
                },
            },
        )
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
            .map_err(fs_err("creating", &tmp))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&header).map_err(fs_err("writing", &tmp))?;
        let mut writeback = super::Writeback::new(0);
        let mut reader = Reader::new(dir, &manifest, true);
        let mut block = Vec::new();
        let mut written = 0u64;
        for (_, t) in &tensors {
            let Some(&(ri, si)) = stands_for.get(&(t.as_bytes().as_ptr() as usize)) else {
                w.write_all(t.as_bytes()).map_err(fs_err("writing", &tmp))?;
                continue;
            };
            let (n, v) = &manifest.params[ri].states[si];
            let StoredValue::Tensor {
                dtype,
                shape,
                pieces,
            } = v
            else {
                unreachable!("placeholders stand for tensor states")
            };
            let size = dtype.size();
            let numel: usize = shape.iter().product();
            let what = format!("{}/{n}", manifest.params[ri].name);
            let mut at = 0;
            while at < numel {
                // Up to the end of the stored block holding `at` (at most one block): whole
                // blocks are read in place.
                let cap = numel.min(at + CHECKSUM_BLOCK / size);
                let take = Reader::block_end(pieces, size, at, cap) - at;
                block.resize(take * size, 0);
                reader.read_range(&what, pieces, size, at, &mut block)?;
                w.write_all(&block).map_err(fs_err("writing", &tmp))?;
                writeback.wrote(w.get_ref(), block.len() as u64);
                at += take;
                written += block.len() as u64;
                progress(written);
            }
        }
        let file: File = w
            .into_inner()
            .map_err(|e| fs_err("writing", &tmp)(e.into_error()))?;
        file.sync_all().map_err(fs_err("syncing", &tmp))?;
        std::fs::rename(&tmp, out).map_err(fs_err("renaming into place", out))?;
        Ok(written)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
