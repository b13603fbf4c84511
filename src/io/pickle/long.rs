//! The payload of pickle's `LONG1` and `LONG4`: an integer as little-endian two's-complement
//! bytes, shortest first (empty for 0).

/// A decoded `LONG1` / `LONG4` payload.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Long<'b> {
    /// It fits in 64 bits.
    Small(i64),
    /// It does not: its bytes without redundant sign bytes.
    Big(&'b [u8]),
}

/// Decodes a payload.
pub(crate) fn decode(b: &[u8]) -> Long<'_> {
    let Some(&last) = b.last() else {
        return Long::Small(0);
    };
    let neg = last & 0x80 != 0;
    let fill = if neg { 0xff } else { 0 };
    // Drop redundant sign bytes, then fit into i64 if possible.
    let mut n = b.len();
    while n > 1 && b[n - 1] == fill && (b[n - 2] & 0x80 != 0) == neg {
        n -= 1;
    }
    if n <= 8 {
        let mut a = [fill; 8];
        a[..n].copy_from_slice(&b[..n]);
        Long::Small(i64::from_le_bytes(a))
    } else {
        Long::Big(&b[..n])
    }
}

/// The shortest payload of `v` (empty for 0), as Python's pickler writes it.
pub(crate) fn encode(v: i128) -> Vec<u8> {
    if v == 0 {
        return Vec::new();
    }
    let mut b = v.to_le_bytes().to_vec();
    while b.len() > 1 {
        let last = b[b.len() - 1];
        let prev_sign = b[b.len() - 2] & 0x80;
        if (last == 0 && prev_sign == 0) || (last == 0xff && prev_sign != 0) {
            b.pop();
        } else {
            break;
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_matches_python() {
        // pickle.dumps(n, 2) payloads.
        assert_eq!(encode(255), vec![0xff, 0x00]);
        assert_eq!(encode(-1), vec![0xff]);
        assert_eq!(encode(-256), vec![0x00, 0xff]);
        assert_eq!(encode(1 << 70), {
            let mut v = vec![0u8; 9];
            v[8] = 0x40;
            v
        });
    }

    #[test]
    fn decoding_undoes_encoding_and_drops_redundant_sign_bytes() {
        for v in [0i64, 1, -1, 127, 128, -128, -129, i64::MAX, i64::MIN] {
            assert_eq!(decode(&encode(i128::from(v))), Long::Small(v), "{v}");
        }
        assert_eq!(decode(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0]), Long::Small(1));
        assert_eq!(decode(&[0xff; 12]), Long::Small(-1));
        let big = encode(1 << 63);
        assert_eq!(decode(&big), Long::Big(&big));
        assert_eq!(decode(&[big.clone(), vec![0, 0]].concat()), Long::Big(&big));
    }
}
