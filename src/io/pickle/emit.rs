//! A small pickle writer: the opcodes and encodings of the values the crate writes, and the
//! memo numbering of Python's pickler. What to write, and what to memoize, is the caller's.

use super::long;
use super::op;

/// Pickle bytes being written, from `PROTO` to `STOP`.
pub(crate) struct Emitter {
    out: Vec<u8>,
    /// The memo index the next [`Emitter::memoize`] stores at.
    next_memo: u32,
}

impl Emitter {
    /// A stream of `protocol`.
    pub(crate) fn new(protocol: u8) -> Self {
        Emitter {
            out: vec![op::PROTO, protocol],
            next_memo: 0,
        }
    }

    /// Ends the stream with `STOP` and returns its bytes.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.out.push(op::STOP);
        self.out
    }

    /// The bytes written since the last [`Emitter::spill`] (all of them, before any).
    pub(crate) fn buffered(&self) -> usize {
        self.out.len()
    }

    /// Writes the bytes held so far to `w` and forgets them, so that a long stream is written
    /// as it is made ([`Emitter::finish`] then returns only the rest).
    pub(crate) fn spill(&mut self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        w.write_all(&self.out)?;
        self.out.clear();
        Ok(())
    }

    /// An opcode without argument (`MARK`, `TUPLE`, `REDUCE`, `EMPTY_DICT`, …).
    pub(crate) fn op(&mut self, op: u8) {
        self.out.push(op);
    }

    /// `None`.
    pub(crate) fn none(&mut self) {
        self.out.push(op::NONE);
    }

    /// `True` or `False`.
    pub(crate) fn bool(&mut self, b: bool) {
        self.out.push(if b { op::NEWTRUE } else { op::NEWFALSE });
    }

    /// An int as Python's pickler writes it: the shortest of `BININT1`, `BININT2`, `BININT`
    /// and `LONG1`.
    pub(crate) fn int(&mut self, v: i64) {
        if let Ok(b) = u8::try_from(v) {
            self.out.extend_from_slice(&[op::BININT1, b]);
        } else if let Ok(h) = u16::try_from(v) {
            self.out.push(op::BININT2);
            self.out.extend_from_slice(&h.to_le_bytes());
        } else if let Ok(w) = i32::try_from(v) {
            self.binint(w);
        } else {
            self.long(&long::encode(i128::from(v)));
        }
    }

    /// A 4-byte signed int (`BININT`).
    pub(crate) fn binint(&mut self, v: i32) {
        self.out.push(op::BININT);
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    /// An int by its `LONG` payload (`LONG1`, or `LONG4` from 256 bytes on).
    pub(crate) fn long(&mut self, payload: &[u8]) {
        match u8::try_from(payload.len()) {
            Ok(n) => self.out.extend_from_slice(&[op::LONG1, n]),
            Err(_) => {
                self.out.push(op::LONG4);
                self.out
                    .extend_from_slice(&(payload.len() as u32).to_le_bytes());
            }
        }
        self.out.extend_from_slice(payload);
    }

    /// A float (`BINFLOAT`).
    pub(crate) fn float(&mut self, x: f64) {
        self.out.push(op::BINFLOAT);
        self.out.extend_from_slice(&x.to_be_bytes());
    }

    /// A string (`BINUNICODE`).
    pub(crate) fn str(&mut self, s: &str) {
        self.out.push(op::BINUNICODE);
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    /// The global `module.name` (`GLOBAL`).
    pub(crate) fn global(&mut self, module: &str, name: &str) {
        self.out.push(op::GLOBAL);
        for part in [module, name] {
            self.out.extend_from_slice(part.as_bytes());
            self.out.push(b'\n');
        }
    }

    /// Stores the top of the stack at the next memo index (`BINPUT`, or `LONG_BINPUT` from
    /// 256 on) and returns the index; `None` once the indices are used up.
    pub(crate) fn memoize(&mut self) -> Option<u32> {
        let i = self.next_memo;
        match u8::try_from(i) {
            Ok(b) => self.out.extend_from_slice(&[op::BINPUT, b]),
            Err(_) => {
                self.out.push(op::LONG_BINPUT);
                self.out.extend_from_slice(&i.to_le_bytes());
            }
        }
        self.next_memo = self.next_memo.checked_add(1)?;
        Some(i)
    }

    /// Pushes memo entry `i` (`BINGET`, or `LONG_BINGET` from 256 on).
    pub(crate) fn get(&mut self, i: u32) {
        match u8::try_from(i) {
            Ok(b) => self.out.extend_from_slice(&[op::BINGET, b]),
            Err(_) => {
                self.out.push(op::LONG_BINGET);
                self.out.extend_from_slice(&i.to_le_bytes());
            }
        }
    }

    /// Opens a tuple of `n` items as Python does: a `MARK` from 4 items on.
    pub(crate) fn tuple_start(&mut self, n: usize) {
        if n > 3 {
            self.out.push(op::MARK);
        }
    }

    /// Closes a tuple of `n` items opened by [`Emitter::tuple_start`]: `EMPTY_TUPLE`,
    /// `TUPLE1`–`TUPLE3` or `TUPLE`.
    pub(crate) fn tuple_end(&mut self, n: usize) {
        self.out.push(match n {
            0 => op::EMPTY_TUPLE,
            1..=3 => op::TUPLE_N[n - 1],
            _ => op::TUPLE,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_take_pythons_shortest_opcode() {
        let mut e = Emitter::new(2);
        for v in [0, 255, 256, 65535, 65536, -1, i64::from(i32::MAX) + 1] {
            e.int(v);
        }
        // pickle.dumps([...], 2) without the list opcodes.
        let want: &[u8] = b"\x80\x02K\x00K\xffM\x00\x01M\xff\xffJ\x00\x00\x01\x00J\xff\xff\xff\xff\x8a\x05\x00\x00\x00\x80\x00.";
        assert_eq!(e.finish(), want);
    }

    #[test]
    fn memo_indices_switch_to_four_bytes_at_256() {
        let mut e = Emitter::new(2);
        for _ in 0..257 {
            e.memoize();
        }
        e.get(255);
        e.get(256);
        let out = e.finish();
        assert_eq!(&out[2 + 2 * 255..2 + 2 * 256], &[op::BINPUT, 255]);
        assert_eq!(
            &out[2 + 2 * 256..2 + 2 * 256 + 5],
            &[op::LONG_BINPUT, 0, 1, 0, 0]
        );
        assert_eq!(
            &out[out.len() - 8..],
            &[op::BINGET, 255, op::LONG_BINGET, 0, 1, 0, 0, op::STOP]
        );
    }
}
