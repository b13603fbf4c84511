//! A `torch.save` archive that arrives forward, a piece at a time (a zstd-compressed DCP chunk
//! as it decompresses), split into the bytes before its storage's data (the head), the data,
//! and the bytes after it (the tail), so that the data need not be held in one buffer with the
//! rest: either it goes straight into the tensor that is the chunk ([`Hold::Data`]), or it is
//! only checksummed as it passes ([`Hold::Skip`]) and read again later, forward, a piece at a
//! time.
//!
//! Where the data starts is found as torch.save lays an archive out: a local header named
//! `<folder>/data/<key>` whose data follows its name and extra field. That is a guess; the
//! archive is then checked whole, as [`super::load_one_archive`] checks it, by the same zip
//! reader over the three parts ([`Parts`]), and [`Inflated::lone_tensor`] vouches for the
//! split only when the archive's object is one tensor that is the whole of a storage whose
//! entry is exactly the data region (its start, its size, its CRC-32). Anything else gives
//! `None`, and the caller reads the archive as before: [`Inflated::load`] (the bytes were all
//! kept) or a whole read.

use super::unpickle::{self, Mode};
use super::zip::{self, Source};
use super::{open_archive, read_zip, storage_entry, PyObj, MEMORY};
use crate::error::Result;
use crate::tensor::{DType, HostTensor};

/// What [`Inflated`] keeps of the storage's data.
pub(crate) enum Hold<'a> {
    /// The data, in a tensor of this dtype and shape (whose bytes are the data's length),
    /// allocated once the data's start is found.
    Data(DType, &'a [usize]),
    /// Nothing but its CRC-32: the head and the tail are kept, at most `allowance` bytes
    /// before the data is found.
    Skip,
}

/// An archive pushed forward ([`Inflated::push`]), split around its storage's data.
pub(crate) struct Inflated {
    head: Vec<u8>,
    /// The data's tensor ([`Hold::Data`], once found), or `None`.
    data: Option<HostTensor>,
    hold: Option<(DType, Vec<usize>)>,
    /// The data's expected length (the chunk's bytes).
    data_len: u64,
    /// Whether the data's start was found: the head ends there.
    found: bool,
    /// Where the search for the data's start goes on in the head.
    scanned: usize,
    /// Whether the search stopped (the head passed `allowance`).
    gave_up: bool,
    allowance: usize,
    /// Bytes of data that passed, and their CRC-32 so far.
    seen: u64,
    crc: crc32fast::Hasher,
    tail: Vec<u8>,
}

/// Where the data of a split archive lies: `head` bytes before it, `len` bytes long, `crc`
/// its CRC-32, with the bytes around it; what a second forward pass checks against.
pub(crate) struct Split {
    pub(crate) head: Vec<u8>,
    pub(crate) len: u64,
    pub(crate) crc: u32,
    pub(crate) tail: Vec<u8>,
}

impl Inflated {
    /// An archive whose storage's data should be `data_len` bytes, kept as `hold` says; the
    /// head may pass `allowance` bytes only with [`Hold::Data`] (then the data is never found
    /// and every byte is kept in the head, as a whole read keeps them).
    pub(crate) fn new(data_len: u64, hold: Hold<'_>, allowance: usize) -> Self {
        Inflated {
            head: Vec::new(),
            data: None,
            hold: match hold {
                Hold::Data(dtype, shape) => Some((dtype, shape.to_vec())),
                Hold::Skip => None,
            },
            data_len,
            found: false,
            scanned: 0,
            gave_up: false,
            allowance,
            seen: 0,
            crc: crc32fast::Hasher::new(),
            tail: Vec::new(),
        }
    }

    /// Bytes pushed so far.
    pub(crate) fn len(&self) -> u64 {
        (self.head.len() + self.tail.len()) as u64 + self.seen
    }

    /// Takes the next bytes of the archive. `false` when they cannot be kept as asked: with
    /// [`Hold::Skip`], a head past the allowance.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> bool {
        if self.found {
            self.push_data(bytes);
            return true;
        }
        self.head.extend_from_slice(bytes);
        if self.gave_up {
            return true;
        }
        let Some(start) = data_start(&self.head, &mut self.scanned) else {
            if self.head.len() > self.allowance {
                self.gave_up = true;
                return self.hold.is_some();
            }
            return true;
        };
        let rest = self.head.split_off(start);
        self.found = true;
        if let Some((dtype, shape)) = &self.hold {
            // Every byte is written before the tensor is handed out ([`Self::into_data`]);
            // pages for reads, as a chunk read from a file gets them.
            let Ok(t) = HostTensor::filled_by_reads(*dtype, shape, |_| {
                Ok::<(), std::convert::Infallible>(())
            });
            if t.nbytes() as u64 != self.data_len {
                // Not the chunk's tensor: keep the bytes in the head, as a whole read would.
                self.found = false;
                self.gave_up = true;
                self.head.extend_from_slice(&rest);
                return true;
            }
            self.data = Some(t);
        }
        self.push_data(&rest);
        true
    }

    /// Data bytes (then tail bytes, once the data's length has passed).
    fn push_data(&mut self, bytes: &[u8]) {
        let n = (self.data_len - self.seen).min(bytes.len() as u64) as usize;
        let (data, tail) = bytes.split_at(n);
        self.crc.update(data);
        if let Some(t) = self.data.as_mut() {
            let at = self.seen as usize;
            t.bytes_mut()[at..at + n].copy_from_slice(data);
        }
        self.seen += n as u64;
        self.tail.extend_from_slice(tail);
    }

    /// The archive's bytes as a zip source: with the data skipped, reads there are refused,
    /// but for the search for the end record (see [`Parts`]).
    fn parts(&self) -> Parts<'_> {
        let scan = self.len().min(zip::EOCD_SEARCH);
        Parts {
            of: self,
            data: self
                .data
                .as_ref()
                .map(|t| &t.as_bytes()[..self.seen as usize]),
            // The search finds the last end record; one wholly in the tail is found whatever
            // the data holds, since a signature has no zero byte and the tail lies after it.
            blank_scan: zip::holds_end_record(&self.tail).then(|| (self.len() - scan, scan)),
        }
    }

    /// The dtype and shape of the archive's object, when the split is right and the archive
    /// is one a whole read takes: exactly one zip archive ([`super::load_one_archive`]'s
    /// checks, with the records and the pickle read as [`super::LoneTensor`] reads them), whose
    /// object is one tensor that is the whole of its storage, whose entry's data starts where
    /// the head ends, is the data's length and has the data's CRC-32. `None` otherwise (the
    /// caller then reads it as before, and gets today's result or error).
    pub(crate) fn lone_tensor(&self) -> Option<(DType, Vec<usize>)> {
        if !self.found || self.seen != self.data_len {
            return None;
        }
        let src = self.parts();
        let (zip, prefix) = open_archive(MEMORY, src).ok()?;
        zip.check_fills().ok()?;
        let (u, mut zip, prefix) = read_zip(
            MEMORY,
            zip,
            prefix,
            Mode::Headers,
            unpickle::Allow::TorchLoad,
        )
        .ok()?;
        let unpickle::Unpickled {
            obj: PyObj::Tensor(t),
            shapes,
            whole,
            views,
            ..
        } = u
        else {
            return None;
        };
        // No other tensor was built on the way (a whole read would have read its storage).
        if views.len() != 1 {
            return None;
        }
        let key = whole.get(&t.storage_id())?;
        let entry = storage_entry(&zip, &prefix, key).ok()?;
        let start = zip.data_start(&entry).ok()?;
        if start != self.head.len() as u64 || entry.size != self.data_len {
            return None;
        }
        zip.check_crc(&entry, start, self.crc.clone().finalize())
            .ok()?;
        let shape = shapes
            .get(&t.storage_id())
            .cloned()
            .unwrap_or_else(|| t.shape().to_vec());
        Some((t.dtype(), shape))
    }

    /// The object of the archive, read from every byte pushed as [`super::load_one_archive`]
    /// reads it (the same bytes, so the same object or error); with [`Hold::Skip`] and the
    /// data found, the data's bytes are missing and this fails.
    pub(crate) fn load(&self) -> Result<PyObj> {
        super::load_one(self.parts())
    }

    /// The data's tensor ([`Hold::Data`], found and full), once [`Self::lone_tensor`] vouched
    /// for it.
    pub(crate) fn into_data(self) -> Option<HostTensor> {
        self.data.filter(|_| self.seen == self.data_len)
    }

    /// Where the data lies, for a second pass ([`Hold::Skip`], once [`Self::lone_tensor`]
    /// vouched for it).
    pub(crate) fn into_split(self) -> Split {
        Split {
            len: self.data_len,
            crc: self.crc.finalize(),
            head: self.head,
            tail: self.tail,
        }
    }
}

/// Where the data of the first `<folder>/data/<key>` local header in `head` starts, looking
/// from `*scanned` on (which is moved past what was looked at); `None` while there is none,
/// or the header is not all there yet.
fn data_start(head: &[u8], scanned: &mut usize) -> Option<usize> {
    const LOCAL: [u8; 4] = *b"PK\x03\x04";
    while *scanned + 30 <= head.len() {
        let i = *scanned;
        if head[i..i + 4] == LOCAL {
            let n = usize::from(u16::from_le_bytes([head[i + 26], head[i + 27]]));
            let e = usize::from(u16::from_le_bytes([head[i + 28], head[i + 29]]));
            let name = head.get(i + 30..i + 30 + n)?;
            if is_storage_name(name) {
                let start = i + 30 + n + e;
                return (start <= head.len()).then_some(start);
            }
        }
        *scanned += 1;
    }
    None
}

/// Whether `name` is a storage's entry as torch.save names it: `<folder>/data/<key>`.
fn is_storage_name(name: &[u8]) -> bool {
    let Some(slash) = name.iter().position(|&b| b == b'/') else {
        return false;
    };
    name[slash + 1..]
        .strip_prefix(b"data/")
        .is_some_and(|key| !key.is_empty() && !key.contains(&b'/'))
}

/// The bytes of an [`Inflated`] as a zip source: the head, the data (when held), the tail.
/// Skipped data reads as zeros in one read only, the end record's search (`blank_scan`: its
/// offset and length, when the tail holds an end record); any other read of it is refused.
#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    of: &'a Inflated,
    data: Option<&'a [u8]>,
    blank_scan: Option<(u64, u64)>,
}

impl Source for Parts<'_> {
    fn len(&self) -> u64 {
        self.of.len()
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let head = self.of.head.len() as u64;
        let data_end = head + self.of.seen;
        let end = offset + buf.len() as u64;
        if end > self.len() {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let blank = self.blank_scan == Some((offset, buf.len() as u64));
        let parts: [(u64, Option<&[u8]>); 3] = [
            (0, Some(&self.of.head)),
            (head, self.data),
            (data_end, Some(&self.of.tail)),
        ];
        let lens = [head, self.of.seen, self.of.tail.len() as u64];
        for ((start, bytes), len) in parts.into_iter().zip(lens) {
            let (lo, hi) = (offset.max(start), end.min(start + len));
            if lo >= hi {
                continue;
            }
            let out = &mut buf[(lo - offset) as usize..(hi - offset) as usize];
            match bytes {
                Some(b) => out.copy_from_slice(&b[(lo - start) as usize..(hi - start) as usize]),
                None if blank => out.fill(0),
                None => {
                    return Err(std::io::Error::other(
                        "the storage's data is not held (it is read in a second pass)",
                    ))
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALLOWANCE: usize = 64 << 10;

    fn ramp(n: usize) -> HostTensor {
        HostTensor::from_vec1(&(0..n).map(|i| i as f32).collect::<Vec<_>>())
    }

    fn archive(t: &HostTensor) -> Vec<u8> {
        super::super::save_to_bytes(&PyObj::Tensor(t.clone())).unwrap()
    }

    fn pushed(bytes: &[u8], piece: usize, len: u64, hold: Hold<'_>) -> Inflated {
        let mut inflated = Inflated::new(len, hold, ALLOWANCE);
        for p in bytes.chunks(piece) {
            assert!(inflated.push(p));
        }
        inflated
    }

    #[test]
    fn the_split_finds_the_storage_whatever_the_pieces_and_vouches_for_torch_saves_layout() {
        let t = ramp(5000);
        let a = archive(&t);
        for piece in [1, 7, 64, 4096, a.len()] {
            let held = pushed(&a, piece, 20_000, Hold::Data(DType::F32, &[5000]));
            assert_eq!(held.len(), a.len() as u64);
            assert_eq!(
                held.lone_tensor(),
                Some((DType::F32, vec![5000])),
                "{piece}"
            );
            assert!(held.load().unwrap().bit_eq(&PyObj::Tensor(t.clone())));
            assert_eq!(held.into_data().unwrap().as_bytes(), t.as_bytes());
            let skipped = pushed(&a, piece, 20_000, Hold::Skip);
            assert_eq!(
                skipped.lone_tensor(),
                Some((DType::F32, vec![5000])),
                "{piece}"
            );
            // The data is not there to be read whole.
            assert!(skipped.load().is_err());
            let split = skipped.into_split();
            let head = split.head.len();
            assert_eq!(head + 20_000 + split.tail.len(), a.len());
            assert_eq!(&a[head..head + 20_000], t.as_bytes());
            assert_eq!(split.crc, crc32fast::hash(t.as_bytes()));
        }
    }

    #[test]
    fn bytes_past_the_archive_another_length_or_a_flipped_data_byte_are_not_vouched_for() {
        let t = ramp(5000);
        let a = archive(&t);
        let mut longer = a.clone();
        longer.push(0);
        let held = pushed(&longer, 4096, 20_000, Hold::Data(DType::F32, &[5000]));
        assert_eq!(held.lone_tensor(), None);
        let whole = super::super::load_one_archive(&longer).unwrap_err();
        assert_eq!(
            held.load().unwrap_err(),
            whole,
            "the same error as a whole read"
        );
        assert_eq!(pushed(&a, 4096, 19_996, Hold::Skip).lone_tensor(), None);
        let mut flipped = a.clone();
        let at = a.len() / 2;
        flipped[at] ^= 1;
        let held = pushed(&flipped, 4096, 20_000, Hold::Data(DType::F32, &[5000]));
        assert_eq!(held.lone_tensor(), None);
        let whole = super::super::load_one_archive(&flipped).unwrap_err();
        assert!(whole.to_string().contains("CRC-32 mismatch"), "{whole}");
        assert_eq!(held.load().unwrap_err(), whole);
        assert_eq!(
            pushed(&flipped, 4096, 20_000, Hold::Skip).lone_tensor(),
            None
        );
    }

    #[test]
    fn a_head_past_the_allowance_stops_a_skipping_split_and_is_all_kept_by_a_holding_one() {
        let junk = vec![7u8; ALLOWANCE + 1];
        let mut skipped = Inflated::new(4, Hold::Skip, ALLOWANCE);
        assert!(!skipped.push(&junk));
        let mut held = Inflated::new(4, Hold::Data(DType::F32, &[1]), ALLOWANCE);
        assert!(held.push(&junk) && held.push(b"more"));
        assert_eq!(held.len(), junk.len() as u64 + 4);
        assert_eq!(held.lone_tensor(), None);
        assert_eq!(
            held.load().unwrap_err(),
            super::super::load_one_archive(&[junk, b"more".to_vec()].concat()).unwrap_err()
        );
    }

    #[test]
    fn storage_names_are_a_folder_then_data_then_a_key() {
        assert!(is_storage_name(b"archive/data/0"));
        assert!(is_storage_name(b"x/data/17"));
        for name in [
            &b"archive/data/"[..],
            b"archive/.data/version",
            b"data/0",
            b"a/data/0/1",
        ] {
            assert!(
                !is_storage_name(name),
                "{:?}",
                String::from_utf8_lossy(name)
            );
        }
    }
}
