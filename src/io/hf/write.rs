//! One planned file of a model directory written from a stream of its tensors' bytes, each
//! tensor cast on the way when the plan changes its dtype.

use super::plan::{PlannedFile, PlannedTensor};
use crate::error::{Error, Result};
use crate::tensor::cast;
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Bytes buffered between the stream and the file.
const BUFFER: usize = 8 << 20;

/// What yields a planned tensor's bytes in its source dtype, in order, through the sink.
pub(crate) type TensorBytes<'a> =
    dyn FnMut(&PlannedTensor, &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Result<()> + 'a;

/// Writes `planned` into `file` (created empty at `path`, the temporary of `out`): the header,
/// then each tensor's bytes from `bytes`, cast to its planned dtype, then syncs it. A source
/// that yields another number of bytes than its shape needs is an error naming the tensor.
pub(crate) fn write_file(
    planned: &PlannedFile,
    file: File,
    (out, path): (&Path, &Path),
    bytes: &mut TensorBytes<'_>,
) -> Result<()> {
    let err = crate::storage::tmp_io_err("writing", out, path);
    let mut w = std::io::BufWriter::with_capacity(BUFFER, file);
    w.write_all(&planned.header).map_err(&err)?;
    for t in &planned.tensors {
        let mut caster = Caster::new(t);
        let mut got = 0u64;
        bytes(t, &mut |chunk: &[u8]| {
            got += chunk.len() as u64;
            caster.push(chunk, &mut |b| w.write_all(b))
        })?;
        let want = t.shape.iter().product::<usize>() as u64 * t.from.size() as u64;
        if got != want || !caster.carry.is_empty() {
            return Err(Error::Internal(format!(
                "writing `{}` into {}: its source gave {got} bytes, its shape {:?} of {} needs {want}",
                t.name,
                out.display(),
                t.shape,
                t.from
            )));
        }
    }
    let file = w.into_inner().map_err(|e| err(e.into_error()))?;
    file.sync_all().map_err(&err)
}

/// Casts one tensor's byte stream element by element, holding back a partial element
/// between chunks.
pub(crate) struct Caster {
    from: crate::tensor::DType,
    to: crate::tensor::DType,
    carry: Vec<u8>,
    out: Vec<u8>,
}

impl Caster {
    fn new(t: &PlannedTensor) -> Self {
        Caster::between(t.from, t.to)
    }

    /// A caster from `from` to `to` (the bytes pass through when they are equal).
    pub(crate) fn between(from: crate::tensor::DType, to: crate::tensor::DType) -> Self {
        Caster {
            from,
            to,
            carry: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Casts `chunk` (continuing the last one) into `w`.
    pub(crate) fn push(
        &mut self,
        chunk: &[u8],
        w: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if self.from == self.to {
            return w(chunk);
        }
        let size = self.from.size();
        let mut chunk = chunk;
        if !self.carry.is_empty() {
            let need = (size - self.carry.len()).min(chunk.len());
            self.carry.extend_from_slice(&chunk[..need]);
            chunk = &chunk[need..];
            if self.carry.len() < size {
                return Ok(());
            }
            self.out.clear();
            cast::cast(self.from, self.to, &self.carry, &mut self.out);
            self.carry.clear();
            w(&self.out)?;
        }
        let whole = chunk.len() / size * size;
        self.out.clear();
        cast::cast(self.from, self.to, &chunk[..whole], &mut self.out);
        self.carry.extend_from_slice(&chunk[whole..]);
        w(&self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn a_cast_stream_split_inside_elements_gives_the_same_bytes() {
        let t = PlannedTensor {
            name: "w".into(),
            source: 0,
            from: DType::F32,
            to: DType::BF16,
            shape: vec![3],
        };
        let src: Vec<u8> = [1.0f32, -2.5, 3.0e-3]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut whole = Vec::new();
        Caster::new(&t)
            .push(&src, &mut |b| {
                whole.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        let mut split = Vec::new();
        let mut c = Caster::new(&t);
        for piece in src.chunks(3) {
            c.push(piece, &mut |b| {
                split.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(whole, split);
        assert_eq!(&whole[..2], &0x3F80u16.to_le_bytes());
    }
}
