//! Pickling DCP's `Metadata` (protocol 2) for the directories the crate writes: what
//! Python's `pickle.load` turns back into the same dataclasses `dcp.save` pickles.

use super::metadata::PathItem;
use crate::error::Result;
use crate::io::pickle::{op, Emitter};
use crate::tensor::DType;

const MD: &str = "torch.distributed.checkpoint.metadata";

/// One stored key, as the pickler needs it.
pub(crate) struct Record<'a> {
    pub key: &'a str,
    pub path: &'a [PathItem],
    /// dtype and global shape for a tensor.
    pub tensor: Option<(DType, &'a [usize])>,
    /// Where its value is: one chunk per box of a tensor (offsets and sizes), or one entry
    /// with empty offsets and sizes for a non-tensor value.
    pub chunks: Vec<StoredChunk<'a>>,
}

/// One chunk of a key: its N-D box (empty for a non-tensor) and its byte range.
pub(crate) struct StoredChunk<'a> {
    pub offsets: &'a [usize],
    pub sizes: &'a [usize],
    pub file: &'a str,
    pub offset: u64,
    pub length: u64,
    /// Stored as one zstd frame (`transform_descriptors=["stream.zstd/1"]`, `length` the
    /// compressed bytes), as `FileSystemWriter(_extensions=[ZStandard()])` stores it.
    pub zstd: bool,
}

/// A protocol-2 writer of DCP's classes, without memo: every object is written where it
/// occurs, and every int as `BININT` (or `LONG1` of 9 bytes). The bytes go to `sink` in
/// pieces ([`P::spill`]); the first error writing them is kept in `failed`.
struct P<'w> {
    e: Emitter,
    sink: &'w mut dyn std::io::Write,
    failed: Option<std::io::Error>,
}

impl P<'_> {
    /// Writes the bytes made so far to the sink once they are [`SPILL_AT`] or more (and
    /// nothing more after a failed write).
    fn spill(&mut self) {
        if self.failed.is_none() && self.e.buffered() >= SPILL_AT {
            if let Err(e) = self.e.spill(self.sink) {
                self.failed = Some(e);
            }
        }
    }

    fn int(&mut self, v: u64) {
        match i32::try_from(v) {
            Ok(v) => self.e.binint(v),
            // 8 bytes plus a sign byte.
            Err(_) => self.e.long(&[&v.to_le_bytes()[..], &[0]].concat()),
        }
    }

    /// `-n`.
    fn negative_int(&mut self, n: u64) {
        match i32::try_from(n) {
            Ok(v) => self.e.binint(-v),
            Err(_) => self
                .e
                .long(&[&n.wrapping_neg().to_le_bytes()[..], &[0xff]].concat()),
        }
    }

    /// `torch.Size(dims)`.
    fn size(&mut self, dims: &[usize]) {
        self.e.global("torch", "Size");
        self.e.op(op::MARK);
        for &d in dims {
            self.int(d as u64);
        }
        self.e.op(op::TUPLE);
        self.e.op(op::TUPLE1);
        self.e.op(op::REDUCE);
    }

    /// `cls()` via `NEWOBJ`.
    fn new_instance(&mut self, module: &str, cls: &str) {
        self.e.global(module, cls);
        self.e.op(op::EMPTY_TUPLE);
        self.e.op(op::NEWOBJ);
    }

    /// `cls()` via `NEWOBJ`, then `BUILD` with the attribute dict `fill` writes.
    fn instance(&mut self, module: &str, cls: &str, fill: impl FnOnce(&mut Self)) {
        self.new_instance(module, cls);
        self.dict(fill);
        self.e.op(op::BUILD);
    }

    /// A dict of the items `fill` writes.
    fn dict(&mut self, fill: impl FnOnce(&mut Self)) {
        self.e.op(op::EMPTY_DICT);
        self.e.op(op::MARK);
        fill(self);
        self.e.op(op::SETITEMS);
    }

    fn tensor_properties(&mut self, dtype: DType) {
        self.new_instance(MD, "TensorProperties");
        // The __getstate__ tuple: (dtype, layout, requires_grad, memory format, pin_memory).
        self.e.op(op::MARK);
        self.e.global("torch", dtype.torch_attr());
        self.e.global("torch", "strided");
        self.e.bool(false);
        self.e.global(MD, "_MEM_FORMAT_ENCODING");
        self.int(0);
        self.e.op(op::TUPLE1);
        self.e.op(op::REDUCE);
        self.e.bool(false);
        self.e.op(op::TUPLE);
        self.e.op(op::BUILD);
    }
}

/// The `.metadata` bytes for `records`, with `checkpoint_id` (relative) in `storage_meta`.
pub(crate) fn metadata_pickle(records: &[Record<'_>], checkpoint_id: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    write_metadata(&mut out, &|f| records.iter().for_each(f), checkpoint_id).map_err(|e| {
        crate::error::Error::Internal(format!("pickling .metadata into memory: {e}"))
    })?;
    Ok(out)
}

/// Calls its argument with each record in turn (made as it is needed, so that a writer
/// of many keys does not hold them all).
pub(crate) type EachRecord<'f> = dyn Fn(&mut dyn FnMut(&Record<'_>)) + 'f;

/// How many pickled bytes [`write_metadata`] holds before it writes them out.
const SPILL_AT: usize = 1 << 16;

/// Writes [`metadata_pickle`]'s bytes for the records `each` gives (it is called three
/// times, and must give the same records each time) to `w` as they are made: memory stays at
/// one record's, however many keys the checkpoint has.
pub(crate) fn write_metadata(
    w: &mut dyn std::io::Write,
    each: &EachRecord<'_>,
    checkpoint_id: &str,
) -> std::io::Result<()> {
    let mut p = P {
        e: Emitter::new(2),
        sink: w,
        failed: None,
    };
    p.instance(MD, "Metadata", |p| {
        p.e.str("state_dict_metadata");
        p.dict(|p| {
            each(&mut |r| {
                p.e.str(r.key);
                state_dict_entry(p, r);
                p.spill();
            })
        });
        p.e.str("planner_data");
        p.dict(|p| {
            each(&mut |r| {
                p.e.str(r.key);
                planner_path(p, r.path);
                p.spill();
            })
        });
        p.e.str("storage_data");
        p.dict(|p| {
            each(&mut |r| {
                for (i, c) in r.chunks.iter().enumerate() {
                    storage_entry(p, r, i, c);
                }
                p.spill();
            })
        });
        p.e.str("storage_meta");
        p.instance(MD, "StorageMeta", |p| {
            p.e.str("checkpoint_id");
            p.e.str(checkpoint_id);
            p.e.str("save_id");
            p.e.str(&save_id());
            p.e.str("load_id");
            p.e.none();
            p.e.str("modules");
            p.e.op(op::EMPTY_LIST);
        });
        p.e.str("version");
        p.e.str("1.0.0");
    });
    if let Some(e) = p.failed {
        return Err(e);
    }
    p.sink.write_all(&p.e.finish())
}

/// A key's path in `planner_data`: a tuple of strings and ints.
fn planner_path(p: &mut P<'_>, path: &[PathItem]) {
    p.e.op(op::MARK);
    for item in path {
        match item {
            PathItem::Key(k) => p.e.str(k),
            PathItem::Index(i) => p.int(*i as u64),
            PathItem::FromEnd(n) => p.negative_int(*n as u64),
        }
    }
    p.e.op(op::TUPLE);
}

fn state_dict_entry(p: &mut P<'_>, r: &Record<'_>) {
    match r.tensor {
        None => p.new_instance(MD, "BytesStorageMetadata"),
        Some((dtype, shape)) => p.instance(MD, "TensorStorageMetadata", |p| {
            p.e.str("properties");
            p.tensor_properties(dtype);
            p.e.str("size");
            p.size(shape);
            p.e.str("chunks");
            p.e.op(op::EMPTY_LIST);
            p.e.op(op::MARK);
            for c in &r.chunks {
                p.instance(MD, "ChunkStorageMetadata", |p| {
                    p.e.str("offsets");
                    p.size(c.offsets);
                    p.e.str("sizes");
                    p.size(c.sizes);
                });
            }
            p.e.op(op::APPENDS);
        }),
    }
}

fn storage_entry(p: &mut P<'_>, r: &Record<'_>, index: usize, c: &StoredChunk<'_>) {
    p.instance(MD, "MetadataIndex", |p| {
        p.e.str("fqn");
        p.e.str(r.key);
        p.e.str("offset");
        match r.tensor {
            Some(_) => p.size(c.offsets),
            None => p.e.none(),
        }
        p.e.str("index");
        match r.tensor {
            Some(_) => p.int(index as u64),
            None => p.e.none(),
        }
    });
    p.instance(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        |p| {
            p.e.str("relative_path");
            p.e.str(c.file);
            p.e.str("offset");
            p.int(c.offset);
            p.e.str("length");
            p.int(c.length);
            // Left out without transforms, as PyTorch's `__getstate__` leaves out `None`.
            if c.zstd {
                p.e.str("transform_descriptors");
                p.e.op(op::EMPTY_LIST);
                p.e.str(super::read::ZSTD_DESCRIPTOR);
                p.e.op(op::APPEND);
            }
        },
    );
}

/// A save id (PyTorch uses a random UUID): time and process id, formatted like one.
fn save_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let x = nanos ^ (u128::from(std::process::id()) << 64);
    let h = format!("{x:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}
