//! zstd-compressed DCP chunks decompressed in bounded pieces straight to where their bytes go
//! (issue 39, item 1): a consolidation reads a large chunk forward a megabyte at a time and
//! gives the bytes the uncompressed directory gives; a whole read puts the chunk's data into
//! its tensor; an archive laid out otherwise than `torch.save` lays it out is read whole, as
//! PyTorch reads it; hostile items are refused as before. The path a read took is seen
//! through `dcp::zstd_chunk_reads` (feature `fault-injection`).

use fsdp::collectives::Solo;
use fsdp::commands::conversions;
use fsdp::io::dcp::{self, Compression, DcpCheckpoint, DcpWriteOptions, StorageKey};
use fsdp::io::torch_save::{self, PyObj};
use fsdp::{Error, HostTensor};
use std::path::{Path, PathBuf};

/// Elements of the large tensor: 1.6 MB, more than one piece.
const N: usize = 400_000;

/// `n` floats of noise in [-1, 1) (zstd cannot shrink them much).
fn noise(n: usize) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `{"w": [400, 1000] noise, "b": [3]}`.
fn state() -> PyObj {
    let w = HostTensor::from_vec1(&noise(N))
        .reshape(&[400, 1000])
        .unwrap();
    let b = HostTensor::from_vec1(&[1.0f32, 2.0, 3.0]);
    PyObj::Dict(vec![
        (PyObj::Str("w".into()), PyObj::Tensor(w)),
        (PyObj::Str("b".into()), PyObj::Tensor(b)),
    ])
}

/// `state()` saved as a DCP directory at `dir`, plain or through zstd.
fn save(dir: &Path, zstd: bool) {
    let opts = match zstd {
        true => DcpWriteOptions::default().compression(Compression::Zstd),
        false => DcpWriteOptions::default(),
    };
    dcp::save_dcp_with(&state(), dir, &opts).unwrap();
}

/// `src` consolidated to `<out>/out.pt` (the same name everywhere: it names the archive).
fn consolidate(src: &Path, out: &Path) -> fsdp::Result<Vec<u8>> {
    std::fs::create_dir_all(out).unwrap();
    let pt = out.join("out.pt");
    conversions::dcp_to_torch_save(src, &pt, &Solo, |_| {})?;
    Ok(std::fs::read(pt).unwrap())
}

#[test]
fn a_zstd_dcp_consolidates_bit_equal_to_the_plain_one_its_large_chunk_read_in_pieces() {
    let tmp = tempfile::tempdir().unwrap();
    let (plain, zstd) = (tmp.path().join("plain"), tmp.path().join("zstd"));
    save(&plain, false);
    save(&zstd, true);
    let want = consolidate(&plain, &tmp.path().join("p")).unwrap();
    let before = dcp::zstd_chunk_reads();
    let got = consolidate(&zstd, &tmp.path().join("z")).unwrap();
    let after = dcp::zstd_chunk_reads();
    assert!(
        got == want,
        "the zstd directory consolidates to other bytes"
    );
    // `w` (1.6 MB) was read forward, at most a megabyte at a time; `b` (12 bytes) whole,
    // straight into its tensor; nothing from a buffer of the whole archive.
    assert_eq!(after.streamed - before.streamed, 1, "{before:?} {after:?}");
    assert_eq!(after.into_tensor - before.into_tensor, 1, "{after:?}");
    assert_eq!(after.whole, before.whole, "{after:?}");
    assert!(
        after.largest_piece > 0 && after.largest_piece <= 1 << 20,
        "{after:?}"
    );
    // The safetensors consolidation streams it too.
    let st = |d: &Path, name: &str| {
        let out = tmp.path().join(name);
        conversions::dcp_to_safetensors(d, &out, &Solo, |_| {}).unwrap();
        std::fs::read(out).unwrap()
    };
    let want = st(&plain, "p.safetensors");
    let before = dcp::zstd_chunk_reads();
    assert!(st(&zstd, "z.safetensors") == want);
    assert_eq!(dcp::zstd_chunk_reads().streamed - before.streamed, 1);
    // A whole read (load, verify) decompresses each chunk's data into its tensor.
    let before = dcp::zstd_chunk_reads();
    let loaded = DcpCheckpoint::open(&zstd).unwrap().load().unwrap();
    assert!(loaded.bit_eq(&state()));
    dcp::verify(&zstd).unwrap();
    let after = dcp::zstd_chunk_reads();
    assert_eq!(after.into_tensor - before.into_tensor, 4, "{after:?}");
    assert_eq!(
        (after.whole, after.streamed),
        (before.whole, before.streamed)
    );
}

/// Replaces the item of `w` in the zstd directory `dir` by crafted bytes of the same length
/// (`case`, see the script), then consolidates it with PyTorch's `dcp_to_torch_save` into
/// `expected`: `Ok(())`, or `Err` with what PyTorch raised.
fn craft(dir: &Path, case: &str, expected: &Path) -> Result<(), String> {
    let md = dcp::read_metadata(dir).unwrap();
    let key = StorageKey {
        fqn: "w".into(),
        offset: Some(vec![0, 0]),
    };
    let info = md.storage[&key].as_ref().unwrap();
    let script = r#"
import io, sys, zipfile
import torch, zstandard
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
d, file, off, length, case, n, out = sys.argv[1:]
off, length, n = int(off), int(length), int(n)
big = (torch.arange(n + 1000) % 997).float().reshape(-1)
def archive(t):
    b = io.BytesIO(); torch.save(t, b); return b.getvalue()
c = lambda b: zstandard.ZstdCompressor().compress(b)
def skip(k):
    assert k >= 8, k
    return (0x184D2A50).to_bytes(4, "little") + (k - 8).to_bytes(4, "little") + bytes(k - 8)
plain = archive(big[:n].clone().reshape(400, -1))
if case == "view":  # a view at an offset of a larger storage
    items = c(archive(big[1000:1000 + n].reshape(400, -1)))
elif case == "view0":  # the first elements of a larger storage
    items = c(archive(big[:n].reshape(400, -1)))
elif case == "split":  # the archive over two frames, cut inside the data
    h = len(plain) // 2
    items = c(plain[:h]) + c(plain[h:])
elif case == "extra_record":  # zipfile's layout, with a record between data.pkl and the data
    src, buf = zipfile.ZipFile(io.BytesIO(plain)), io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for i in src.infolist():
            z.writestr(i.filename, src.read(i.filename))
            if i.filename.endswith("data.pkl"):
                z.writestr("archive/extra", b"x" * 100)
    items = c(buf.getvalue())
elif case == "crc":  # a data byte flipped under the archive's CRC-32
    a = bytearray(plain); a[len(a) // 2] ^= 1
    items = c(bytes(a))
elif case == "garbage":  # bytes that are no frame after the archive's frame
    items = c(plain); items += b"G" * (length - len(items))
elif case == "second_frame":  # the archive's frame twice: output past the bound
    items = c(plain) * 2
elif case == "hello_frame":  # a second frame of other bytes after the archive's
    items = c(plain) + c(b"hello")
elif case == "cut":  # the archive's frame cut short at the range's end
    f = c(plain)
    items = skip(length - len(f) + 3) + f[:-3]
elif case == "bomb":  # zeros past the chunk's bytes and the archive allowance
    items = c(bytes(n * 4 + (1 << 20)))
else:
    raise SystemExit(f"unknown case {case}")
if len(items) < length:
    items += skip(length - len(items))
assert len(items) == length, (len(items), length)
with open(f"{d}/{file}", "r+b") as f:
    f.seek(off); f.write(items)
try:
    dcp_to_torch_save(d, out)
    print("ok")
except BaseException as e:  # CheckpointException is not an Exception
    print("refused:", type(e).__name__, str(e).strip().splitlines()[-1:])
"#;
    let out = std::process::Command::new(crate::common::python())
        .arg("-c")
        .arg(script)
        .arg(dir)
        .arg(&info.relative_path)
        .arg(info.offset.to_string())
        .arg(info.length.to_string())
        .arg(case)
        .arg(N.to_string())
        .arg(expected)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success(),
        "{case}: {said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match said.as_str() {
        "ok" => Ok(()),
        _ => Err(said),
    }
}

/// A copy of the zstd directory with `w`'s item crafted as `case`; PyTorch's result.
fn crafted(case: &str) -> (tempfile::TempDir, PathBuf, Result<PyObj, String>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    save(&dir, true);
    let expected = tmp.path().join("expected.pt");
    let torch = craft(&dir, case, &expected).map(|()| torch_save::load(&expected).unwrap());
    (tmp, dir, torch)
}

#[test]
fn an_archive_laid_out_otherwise_is_read_whole_as_pytorch_reads_it() {
    // (case, whether the split vouches for it and the chunk is read forward).
    for (case, streamed) in [
        ("view", false),
        ("view0", false),
        ("split", true),
        ("extra_record", true),
    ] {
        let (tmp, dir, torch) = crafted(case);
        let want = torch.unwrap_or_else(|e| panic!("{case}: PyTorch: {e}"));
        let before = dcp::zstd_chunk_reads();
        let got = consolidate(&dir, &tmp.path().join("out")).unwrap();
        let after = dcp::zstd_chunk_reads();
        let got = torch_save::load_from_bytes(&got).unwrap();
        assert!(got.bit_eq(&want), "{case}: not what PyTorch read");
        let n = u64::from(streamed);
        assert_eq!(after.streamed - before.streamed, n, "{case}: {after:?}");
        assert_eq!(after.whole - before.whole, 1 - n, "{case}: {after:?}");
        // A whole read agrees.
        let loaded = DcpCheckpoint::open(&dir).unwrap().load().unwrap();
        assert!(loaded.bit_eq(&want), "{case}: load()");
        dcp::verify(&dir).unwrap();
    }
}

#[test]
fn hostile_items_of_a_large_chunk_are_refused_as_a_whole_read_refuses_them() {
    for (case, needle) in [
        ("crc", "CRC-32 mismatch"),
        ("garbage", "Unknown frame descriptor"),
        ("second_frame", "decompresses to more than"),
        ("hello_frame", "does not take the whole"),
        ("cut", "incomplete frame"),
        ("bomb", "decompresses to more than"),
    ] {
        let (tmp, dir, torch) = crafted(case);
        // PyTorch refuses bytes that are no frame and a bomb (it loads the first archive
        // of several frames, and its stream reader passes over a cut frame).
        if matches!(case, "garbage" | "bomb") {
            assert!(torch.is_err(), "{case}: PyTorch read it");
        }
        let verified = dcp::verify(&dir).unwrap_err();
        let err = consolidate(&dir, &tmp.path().join("out")).unwrap_err();
        assert_eq!(err, verified, "{case}");
        let msg = err.to_string();
        assert!(msg.contains(needle), "{case}: {msg}");
        match &err {
            Error::DcpStorage { key, .. } | Error::DcpExpansion { key, .. } => {
                assert_eq!(key, "w", "{case}")
            }
            other => panic!("{case}: {other:?}"),
        }
        assert!(
            !tmp.path().join("out/out.pt").exists(),
            "{case}: an output was left"
        );
    }
}
