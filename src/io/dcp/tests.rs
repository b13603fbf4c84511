//! Tests of reading that need a DCP directory built by hand (through the metadata pickler,
//! which the readers do not import).

use super::metadata::Chunk;
use super::read::flat_slabs;
use super::{DcpCheckpoint, RangeReader};
use crate::io::torch_save::{self, PyObj};
use crate::tensor::{DType, HostTensor};

/// A DCP directory holding one f32 tensor `t` of shape `[5, 4]` (elements 0..20) cut as
/// a flat parameter's shards are cut ([`super::plan::flat_range_boxes`] of the
/// element ranges `cuts`), each box a `torch.save` archive in one data file.
fn flat_shard_dcp(cuts: &[(usize, usize)]) -> (tempfile::TempDir, Vec<Chunk>) {
    use super::pickler::{metadata_pickle, Record, StoredChunk};
    let shape = [5usize, 4];
    let values: Vec<f32> = (0..20).map(|v| v as f32).collect();
    let mut data = Vec::new();
    let mut stored = Vec::new();
    for &(start, len) in cuts {
        for (c, _) in super::plan::flat_range_boxes(&shape, start, len) {
            let mut part = Vec::new();
            for r in c.offsets[0]..c.offsets[0] + c.sizes[0] {
                let first = r * 4 + c.offsets[1];
                part.extend_from_slice(&values[first..first + c.sizes[1]]);
            }
            let t = HostTensor::from_slice(&part, &c.sizes).unwrap();
            let bytes = torch_save::save_to_bytes(&PyObj::Tensor(t)).unwrap();
            stored.push((c, data.len() as u64, bytes.len() as u64));
            data.extend_from_slice(&bytes);
        }
    }
    let path = [super::PathItem::Key("t".into())];
    let record = Record {
        key: "t",
        path: &path,
        tensor: Some((DType::F32, &shape)),
        chunks: stored
            .iter()
            .map(|(c, offset, length)| StoredChunk {
                offsets: &c.offsets,
                sizes: &c.sizes,
                file: "__0_0.distcp",
                offset: *offset,
                length: *length,
                zstd: false,
            })
            .collect(),
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("__0_0.distcp"), &data).unwrap();
    let md = metadata_pickle(&[record], "test").unwrap();
    std::fs::write(dir.path().join(".metadata"), md).unwrap();
    (dir, stored.into_iter().map(|(c, ..)| c).collect())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn chunks_cut_from_flat_shards_are_runs_of_the_flattening_read_once_in_pieces() {
    // Shards 0..7, 7..16, 16..20: a partial first row, whole rows, a partial last row.
    let (dir, chunks) = flat_shard_dcp(&[(0, 7), (7, 9), (16, 4)]);
    assert!(chunks.iter().any(|c| c.sizes[0] == 1 && c.sizes[1] < 4));
    let slabs = flat_slabs(&[5, 4], chunks.iter()).expect("runs of the flattening");
    let firsts: Vec<usize> = slabs.iter().map(|(first, _)| *first).collect();
    assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{firsts:?}");
    let ckpt = DcpCheckpoint::open(dir.path()).unwrap();
    // Output ranks of another world size read ranges that cut through the chunks.
    let mut reader = RangeReader::new(&ckpt);
    let mut got = Vec::new();
    for (start, len) in [(0, 3), (3, 6), (9, 2), (11, 9)] {
        reader
            .read("t", start, len, &mut |b| {
                got.extend(f32s(b));
                Ok(())
            })
            .unwrap();
    }
    reader.finish().unwrap();
    assert_eq!(got, (0..20).map(|v| v as f32).collect::<Vec<_>>());
    assert_eq!(reader.units_read(), chunks.len() as u64);
    // A range before where a chunk's reading stands reopens it: still right.
    let back = ckpt.read_flat_range("t", 1, 2).unwrap();
    assert_eq!(f32s(back.as_bytes()), [1.0, 2.0]);
    // A column cut is not a run of the flattening.
    let col = Chunk {
        offsets: vec![0, 0],
        sizes: vec![5, 2],
    };
    assert!(flat_slabs(&[5, 4], [&col].into_iter()).is_none());
}

#[test]
fn a_damaged_chunk_fails_its_crc_even_when_only_its_start_is_wanted() {
    let (dir, _) = flat_shard_dcp(&[(0, 20)]);
    // Element 19 (the last, 19.0f32) is damaged on disk; elements 0..2 are wanted.
    let file = dir.path().join("__0_0.distcp");
    let mut data = std::fs::read(&file).unwrap();
    let last = 19.0f32.to_le_bytes();
    let at = data.windows(4).rposition(|w| w == last).unwrap();
    data[at] ^= 0x40;
    std::fs::write(&file, &data).unwrap();
    let ckpt = DcpCheckpoint::open(dir.path()).unwrap();
    let err = ckpt.read_flat_range("t", 0, 2).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("CRC-32 mismatch"), "{text}");
    assert!(text.contains("key `t`, file `__0_0.distcp`"), "{text}");
}
