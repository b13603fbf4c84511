//! Pickle opcodes (protocols 0–5): one constant per opcode and one table of their names,
//! both written out once by `opcodes!` from the same list, as Python's `pickle` module names
//! them.

/// Defines one `pub(crate) const NAME: u8` per opcode and [`TABLE`], which pairs each byte
/// with its name.
macro_rules! opcodes {
    ($($name:ident = $byte:expr,)*) => {
        $(
            #[doc = concat!("`", stringify!($name), "`.")]
            pub(crate) const $name: u8 = $byte;
        )*
        /// Every opcode of protocols 0–5, with its name.
        const TABLE: &[(u8, &str)] = &[$(($name, stringify!($name)),)*];
    };
}

opcodes! {
    MARK = b'(',
    STOP = b'.',
    POP = b'0',
    POP_MARK = b'1',
    DUP = b'2',
    FLOAT = b'F',
    INT = b'I',
    BININT = b'J',
    BININT1 = b'K',
    LONG = b'L',
    BININT2 = b'M',
    NONE = b'N',
    PERSID = b'P',
    BINPERSID = b'Q',
    REDUCE = b'R',
    STRING = b'S',
    BINSTRING = b'T',
    SHORT_BINSTRING = b'U',
    UNICODE = b'V',
    BINUNICODE = b'X',
    APPEND = b'a',
    BUILD = b'b',
    GLOBAL = b'c',
    DICT = b'd',
    EMPTY_DICT = b'}',
    APPENDS = b'e',
    GET = b'g',
    BINGET = b'h',
    INST = b'i',
    LONG_BINGET = b'j',
    LIST = b'l',
    EMPTY_LIST = b']',
    OBJ = b'o',
    PUT = b'p',
    BINPUT = b'q',
    LONG_BINPUT = b'r',
    SETITEM = b's',
    TUPLE = b't',
    EMPTY_TUPLE = b')',
    SETITEMS = b'u',
    BINFLOAT = b'G',
    PROTO = 0x80,
    NEWOBJ = 0x81,
    EXT1 = 0x82,
    EXT2 = 0x83,
    EXT4 = 0x84,
    TUPLE1 = 0x85,
    TUPLE2 = 0x86,
    TUPLE3 = 0x87,
    NEWTRUE = 0x88,
    NEWFALSE = 0x89,
    LONG1 = 0x8a,
    LONG4 = 0x8b,
    BINBYTES = b'B',
    SHORT_BINBYTES = b'C',
    SHORT_BINUNICODE = 0x8c,
    BINUNICODE8 = 0x8d,
    BINBYTES8 = 0x8e,
    EMPTY_SET = 0x8f,
    ADDITEMS = 0x90,
    FROZENSET = 0x91,
    NEWOBJ_EX = 0x92,
    STACK_GLOBAL = 0x93,
    MEMOIZE = 0x94,
    FRAME = 0x95,
    BYTEARRAY8 = 0x96,
    NEXT_BUFFER = 0x97,
    READONLY_BUFFER = 0x98,
}

/// The opcodes that build a tuple of the top 1, 2 or 3 items, by that count less one.
pub(crate) const TUPLE_N: [u8; 3] = [TUPLE1, TUPLE2, TUPLE3];

/// The name of opcode `op` (`UNKNOWN` for a byte that is no pickle opcode).
pub(crate) fn name(op: u8) -> &'static str {
    TABLE
        .iter()
        .find(|(byte, _)| *byte == op)
        .map_or("UNKNOWN", |(_, name)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_holds_each_of_pythons_68_opcodes_once() {
        assert_eq!(TABLE.len(), 68);
        for (i, (byte, name)) in TABLE.iter().enumerate() {
            assert!(
                TABLE[i + 1..].iter().all(|(b, n)| b != byte && n != name),
                "{name}"
            );
        }
        assert_eq!(name(MARK), "MARK");
        assert_eq!(name(READONLY_BUFFER), "READONLY_BUFFER");
        assert_eq!(name(0xff), "UNKNOWN");
    }
}
