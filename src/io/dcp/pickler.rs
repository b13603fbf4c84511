//! Pickling DCP's `Metadata` (protocol 2) for the directories the crate writes: what
//! Python's `pickle.load` turns back into the same dataclasses `dcp.save` pickles.

use super::metadata::PathItem;
use crate::error::Result;
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
}

/// A minimal protocol-2 pickle writer (no memo: every object is written where it occurs).
struct P {
    out: Vec<u8>,
}

impl P {
    fn global(&mut self, module: &str, name: &str) {
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
    }

    fn str(&mut self, s: &str) {
        self.out.push(b'X');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn int(&mut self, v: u64) {
        if let Ok(v) = i32::try_from(v) {
            self.out.push(b'J');
            self.out.extend_from_slice(&v.to_le_bytes());
        } else {
            // LONG1 with 8 bytes plus a sign byte.
            self.out.extend_from_slice(&[0x8a, 9]);
            self.out.extend_from_slice(&v.to_le_bytes());
            self.out.push(0);
        }
    }

    /// `-n` (as `BININT`, or `LONG1` with 8 bytes plus a sign byte).
    fn negative_int(&mut self, n: u64) {
        match i32::try_from(n) {
            Ok(v) => {
                self.out.push(b'J');
                self.out.extend_from_slice(&(-v).to_le_bytes());
            }
            Err(_) => {
                self.out.extend_from_slice(&[0x8a, 9]);
                self.out.extend_from_slice(&n.wrapping_neg().to_le_bytes());
                self.out.push(0xff);
            }
        }
    }

    fn none(&mut self) {
        self.out.push(b'N');
    }

    fn bool(&mut self, b: bool) {
        self.out.push(if b { 0x88 } else { 0x89 });
    }

    fn mark(&mut self) {
        self.out.push(b'(');
    }

    fn tuple(&mut self) {
        self.out.push(b't');
    }

    /// `torch.Size(dims)`.
    fn size(&mut self, dims: &[usize]) {
        self.global("torch", "Size");
        self.mark();
        for &d in dims {
            self.int(d as u64);
        }
        self.tuple();
        self.out.push(0x85); // TUPLE1
        self.out.push(b'R');
    }

    /// `cls()` via `NEWOBJ`, then `BUILD` with the attribute dict `fill` writes.
    fn instance(&mut self, module: &str, cls: &str, fill: impl FnOnce(&mut P)) {
        self.global(module, cls);
        self.out.push(b')');
        self.out.push(0x81);
        self.out.push(b'}');
        self.mark();
        fill(self);
        self.out.push(b'u');
        self.out.push(b'b');
    }

    fn tensor_properties(&mut self, dtype: DType) {
        self.global(MD, "TensorProperties");
        self.out.push(b')');
        self.out.push(0x81);
        // The __getstate__ tuple: (dtype, layout, requires_grad, memory format, pin_memory).
        self.mark();
        self.global("torch", dtype.torch_attr());
        self.global("torch", "strided");
        self.bool(false);
        self.global(MD, "_MEM_FORMAT_ENCODING");
        self.int(0);
        self.out.push(0x85);
        self.out.push(b'R');
        self.bool(false);
        self.tuple();
        self.out.push(b'b');
    }
}

/// The `.metadata` bytes for `records`, with `checkpoint_id` (relative) in `storage_meta`.
pub(crate) fn metadata_pickle(records: &[Record<'_>], checkpoint_id: &str) -> Result<Vec<u8>> {
    let mut p = P { out: vec![0x80, 2] };
    p.instance(MD, "Metadata", |p| {
        p.str("state_dict_metadata");
        p.out.push(b'}');
        p.mark();
        for r in records {
            p.str(r.key);
            state_dict_entry(p, r);
        }
        p.out.push(b'u');
        p.str("planner_data");
        p.out.push(b'}');
        p.mark();
        for r in records {
            p.str(r.key);
            p.mark();
            for item in r.path {
                match item {
                    PathItem::Key(k) => p.str(k),
                    PathItem::Index(i) => p.int(*i as u64),
                    PathItem::FromEnd(n) => p.negative_int(*n as u64),
                }
            }
            p.tuple();
        }
        p.out.push(b'u');
        p.str("storage_data");
        p.out.push(b'}');
        p.mark();
        for r in records {
            for (i, c) in r.chunks.iter().enumerate() {
                storage_entry(p, r, i, c);
            }
        }
        p.out.push(b'u');
        p.str("storage_meta");
        p.instance(MD, "StorageMeta", |p| {
            p.str("checkpoint_id");
            p.str(checkpoint_id);
            p.str("save_id");
            p.str(&save_id());
            p.str("load_id");
            p.none();
            p.str("modules");
            p.out.push(b']');
        });
        p.str("version");
        p.str("1.0.0");
    });
    p.out.push(b'.');
    Ok(p.out)
}

fn state_dict_entry(p: &mut P, r: &Record<'_>) {
    match r.tensor {
        None => {
            p.global(MD, "BytesStorageMetadata");
            p.out.extend_from_slice(&[b')', 0x81]);
        }
        Some((dtype, shape)) => p.instance(MD, "TensorStorageMetadata", |p| {
            p.str("properties");
            p.tensor_properties(dtype);
            p.str("size");
            p.size(shape);
            p.str("chunks");
            p.out.push(b']');
            p.mark();
            for c in &r.chunks {
                p.instance(MD, "ChunkStorageMetadata", |p| {
                    p.str("offsets");
                    p.size(c.offsets);
                    p.str("sizes");
                    p.size(c.sizes);
                });
            }
            p.out.push(b'e');
        }),
    }
}

fn storage_entry(p: &mut P, r: &Record<'_>, index: usize, c: &StoredChunk<'_>) {
    p.instance(MD, "MetadataIndex", |p| {
        p.str("fqn");
        p.str(r.key);
        p.str("offset");
        match r.tensor {
            Some(_) => p.size(c.offsets),
            None => p.none(),
        }
        p.str("index");
        match r.tensor {
            Some(_) => p.int(index as u64),
            None => p.none(),
        }
    });
    p.instance(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        |p| {
            p.str("relative_path");
            p.str(c.file);
            p.str("offset");
            p.int(c.offset);
            p.str("length");
            p.int(c.length);
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
