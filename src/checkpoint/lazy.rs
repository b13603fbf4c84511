//! A tensor known by where its elements lie (ranges of a DCP directory's tensors, zeros, or
//! host bytes), so that converting a DCP directory can plan every output rank's flattened
//! state without reading it, and stream the bytes when the rank files are written.

use crate::error::{Error, Result};
use crate::io::dcp::{DcpCheckpoint, RangeReader};
use crate::tensor::{DType, HostTensor, Tensor};
use std::sync::Arc;

/// A tensor whose elements, in flattened order, are its parts one after another. The
/// optimizer-state algorithms (flattening, sharding) run on it as on any [`Tensor`]:
/// narrowing and concatenating only rearrange parts.
#[derive(Clone, Debug)]
pub(crate) struct LazyTensor {
    dtype: DType,
    shape: Vec<usize>,
    parts: Vec<Part>,
}

/// A run of a [`LazyTensor`]'s elements.
#[derive(Clone, Debug)]
enum Part {
    /// Elements `start..start + len` of the flattening of the DCP tensor under `key`.
    Stored {
        ckpt: Arc<DcpCheckpoint>,
        key: Arc<str>,
        start: usize,
        len: usize,
    },
    /// `len` zeros (padding, or a member without this state).
    Zeros(usize),
    /// Elements `start..start + len` of a host tensor.
    Host {
        t: Arc<HostTensor>,
        start: usize,
        len: usize,
    },
}

impl Part {
    fn len(&self) -> usize {
        match *self {
            Part::Stored { len, .. } | Part::Host { len, .. } | Part::Zeros(len) => len,
        }
    }

    /// Elements `at..at + len` of this part (inside it).
    fn slice(&self, at: usize, len: usize) -> Part {
        match self {
            Part::Stored {
                ckpt, key, start, ..
            } => Part::Stored {
                ckpt: Arc::clone(ckpt),
                key: Arc::clone(key),
                start: start + at,
                len,
            },
            Part::Zeros(_) => Part::Zeros(len),
            Part::Host { t, start, .. } => Part::Host {
                t: Arc::clone(t),
                start: start + at,
                len,
            },
        }
    }

    /// `next` appended to this part when it continues it.
    fn merge(&mut self, next: &Part) -> bool {
        match (self, next) {
            (Part::Zeros(a), Part::Zeros(b)) => {
                *a += b;
                true
            }
            (
                Part::Stored {
                    key, start, len, ..
                },
                Part::Stored {
                    key: k2, start: s2, ..
                },
            ) if key == k2 && *start + *len == *s2 => {
                *len += next.len();
                true
            }
            _ => false,
        }
    }
}

/// Zeros handed to a sink at most this many bytes at a time.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

impl LazyTensor {
    /// Elements `start..start + len` of the flattening of `ckpt`'s tensor `key`, of `shape`
    /// (whose element count is `len`), checked to lie inside it (nothing is read).
    pub(crate) fn stored(
        ckpt: &Arc<DcpCheckpoint>,
        key: &str,
        (start, len): (usize, usize),
        shape: &[usize],
    ) -> Result<Self> {
        let (_, dtype) = ckpt.flat_range_meta(key, start, len)?;
        let parts = vec![Part::Stored {
            ckpt: Arc::clone(ckpt),
            key: key.into(),
            start,
            len,
        }];
        Ok(LazyTensor {
            dtype,
            shape: shape.to_vec(),
            parts,
        })
    }

    /// Hands its bytes to `sink` in order, reading stored parts through `reader`.
    pub(crate) fn write_to(
        &self,
        reader: &mut RangeReader<'_>,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let es = self.dtype.size();
        for p in &self.parts {
            match p {
                Part::Stored {
                    key, start, len, ..
                } => reader.read(key, *start, *len, sink)?,
                Part::Zeros(len) => {
                    let mut left = len * es;
                    while left > 0 {
                        let n = left.min(ZEROS.len());
                        sink(&ZEROS[..n])?;
                        left -= n;
                    }
                }
                Part::Host { t, start, len } => {
                    sink(&t.as_bytes()[start * es..(start + len) * es])?
                }
            }
        }
        Ok(())
    }

    fn numel_of(shape: &[usize]) -> Result<usize> {
        crate::tensor::checked_numel(shape).ok_or_else(|| Error::ShapeMismatch {
            context: "a tensor's shape overflows".into(),
            expected: Vec::new(),
            found: shape.to_vec(),
        })
    }
}

impl Tensor for LazyTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        let n = Self::numel_of(shape)?;
        Ok(LazyTensor {
            dtype,
            shape: shape.to_vec(),
            parts: (n > 0).then_some(Part::Zeros(n)).into_iter().collect(),
        })
    }

    fn from_host(t: HostTensor) -> Result<Self> {
        let len = t.numel();
        Ok(LazyTensor {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            parts: vec![Part::Host {
                t: Arc::new(t),
                start: 0,
                len,
            }],
        })
    }

    /// Reads the stored parts (what the conversion asks only of small values: param-group
    /// options, zero-dim states).
    fn to_host(&self) -> Result<HostTensor> {
        let es = self.dtype.size();
        HostTensor::filled_by(self.dtype, &self.shape, |out| {
            let mut at = 0;
            for p in &self.parts {
                let dst = &mut out[at * es..(at + p.len()) * es];
                at += p.len();
                match p {
                    Part::Stored {
                        ckpt,
                        key,
                        start,
                        len,
                    } => dst.copy_from_slice(ckpt.read_flat_range(key, *start, *len)?.as_bytes()),
                    Part::Zeros(_) => dst.fill(0),
                    Part::Host { t, start, len } => {
                        dst.copy_from_slice(&t.as_bytes()[start * es..(start + len) * es])
                    }
                }
            }
            Ok(())
        })
    }

    fn narrow_flat(&self, start: usize, len: usize) -> Result<Self> {
        crate::tensor::check_narrow(&self.shape, start, len, "tensor")?;
        let mut parts = Vec::new();
        let (mut at, end) = (0, start + len);
        for p in &self.parts {
            let (lo, hi) = (at, at + p.len());
            at = hi;
            let (a, b) = (lo.max(start), hi.min(end));
            if a < b {
                parts.push(p.slice(a - lo, b - a));
            }
        }
        Ok(LazyTensor {
            dtype: self.dtype,
            shape: vec![len],
            parts,
        })
    }

    fn reshape(&self, shape: &[usize]) -> Result<Self> {
        if Self::numel_of(shape)? != self.numel() {
            return Err(Error::ShapeMismatch {
                context: "reshape".into(),
                expected: shape.to_vec(),
                found: self.shape.clone(),
            });
        }
        Ok(LazyTensor {
            shape: shape.to_vec(),
            ..self.clone()
        })
    }

    fn cat_flat(parts: &[Self]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(Error::Internal("cat_flat of no tensors".into()));
        };
        let mut out: Vec<Part> = Vec::new();
        let mut total = 0;
        for t in parts {
            if t.dtype != first.dtype {
                return Err(Error::DtypeMismatch {
                    context: "cat_flat".into(),
                    expected: first.dtype.to_string(),
                    found: t.dtype.to_string(),
                });
            }
            total += t.numel();
            for p in &t.parts {
                if !out.last_mut().is_some_and(|last| last.merge(p)) {
                    out.push(p.clone());
                }
            }
        }
        Ok(LazyTensor {
            dtype: first.dtype,
            shape: vec![total],
            parts: out,
        })
    }

    fn bit_eq(&self, other: &Self) -> bool {
        match (self.to_host(), other.to_host()) {
            (Ok(a), Ok(b)) => a.bit_eq(&b),
            _ => false,
        }
    }
}

impl super::save::Pieces for LazyTensor {
    type Piece<'a> = LazyTensor;

    fn piece(&self, start: usize, len: usize) -> Result<LazyTensor> {
        self.narrow_flat(start, len)
    }
}
