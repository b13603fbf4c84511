//! The machine's protocol handling, checked against what Python's `pickle.loads` does with
//! the same bytes (noted beside each case).

use super::{op, Format, Globals, Machine, Value};
use crate::error::{Error, Result};
use std::convert::Infallible;

/// A format that builds nothing of its own and allows one global, `builtins.print`.
struct Plain;

type V = Value<&'static str, Infallible>;

fn resolve(module: &str, name: &str) -> Option<&'static str> {
    (module == "builtins" && name == "print").then_some("print")
}

const PRINT_ONLY: Globals<&'static str> = Globals { resolve };

impl Format for Plain {
    type Global = &'static str;
    type Ext = Infallible;
    type Node = Infallible;

    fn reduce(m: &mut Machine<'_, Self>, f: &'static str, _: Vec<V>) -> Result<V> {
        Err(m.err(format!("calling {f}")))
    }
    fn newobj(m: &mut Machine<'_, Self>, _: &'static str, _: Vec<V>) -> Result<V> {
        Err(m.err("NEWOBJ"))
    }
    fn build(m: &mut Machine<'_, Self>, _: V) -> Result<()> {
        Err(m.err("BUILD"))
    }
    fn ext_kind(x: &Infallible) -> String {
        match *x {}
    }
    fn node_kind(n: &Infallible) -> String {
        match *n {}
    }
}

fn run(data: &[u8]) -> Result<V> {
    Machine::new("p", data, &PRINT_ONLY, Plain).run()
}

fn pickle_error(data: &[u8]) -> (String, String) {
    match run(data) {
        Err(Error::Pickle { opcode, reason, .. }) => (opcode, reason),
        other => panic!("{data:?}: expected a pickle error, got {other:?}"),
    }
}

#[test]
fn pop_drops_the_last_mark_when_nothing_is_above_it() {
    // pickle.loads(b'\x80\x02(0N.') is None; pickle.loads(b'\x80\x020N.') is a stack underflow.
    assert!(matches!(run(b"\x80\x02(0N."), Ok(V::None)));
    assert!(matches!(
        run(b"\x80\x02(K\x010."),
        Err(Error::Pickle { .. })
    ));
    let (opcode, reason) = pickle_error(b"\x80\x020N.");
    assert_eq!(
        (opcode.as_str(), reason.as_str()),
        ("POP", "stack underflow")
    );
}

#[test]
fn a_frame_longer_than_the_rest_of_the_stream_is_refused() {
    // "pickle data was truncated" in Python, though the opcodes after it are whole.
    let (opcode, reason) = pickle_error(b"\x80\x04\x95\x10\0\0\0\0\0\0\0N.");
    assert_eq!(opcode, "FRAME");
    assert!(
        reason.contains("runs past the end of the pickle"),
        "{reason}"
    );
    assert!(matches!(
        run(b"\x80\x04\x95\x02\0\0\0\0\0\0\0N."),
        Ok(V::None)
    ));
}

#[test]
fn long4_reads_any_length_and_refuses_a_negative_one() {
    // pickle.loads(b'\x80\x02\x8b\x01\x00\x00\x00\x05.') == 5.
    assert!(matches!(run(b"\x80\x02\x8b\x01\0\0\0\x05."), Ok(V::Int(5))));
    let big = run(b"\x80\x02\x8b\x0a\0\0\0\0\0\0\0\0\0\0\0\0\x01.");
    assert!(matches!(&big, Ok(V::BigInt(b)) if b.len() == 10), "{big:?}");
    // "LONG pickle has negative byte count".
    assert_eq!(pickle_error(b"\x80\x02\x8b\xff\xff\xff\xff.").0, "LONG4");
}

#[test]
fn unsupported_opcodes_and_globals_are_named() {
    // Without persistent ids, BINPERSID is refused before it touches the (empty) stack.
    let e = run(b"\x80\x02Q.").unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleOpcode { opcode: op::BINPERSID, name, offset: 2, .. } if name == "BINPERSID"),
        "{e}"
    );
    let e = run(b"\x80\x02I1\n.").unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleOpcode { name, .. } if name == "INT"),
        "{e}"
    );
    let e = run(b"\x80\x02cos\nsystem\n.").unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedPickleGlobal { module, name, offset: 2, .. } if module == "os" && name == "system"),
        "{e}"
    );
    let (opcode, reason) = pickle_error(b"\x80\x02cbuiltins\nprint\n)R.");
    assert_eq!(
        (opcode.as_str(), reason.as_str()),
        ("REDUCE", "calling print")
    );
}

#[test]
fn malformed_streams_name_the_opcode_they_fail_at() {
    for (data, opcode) in [
        (&b"\x80\x02a."[..], "APPEND"),
        (b"\x80\x02K\x01a.", "APPEND"),
        (b"\x80\x02h\x05.", "BINGET"),
        (b"\x80\x02X\xff\x00\x00\x00ab", "BINUNICODE"),
        (b"\x80\x06N.", "PROTO"),
        (b"\x80\x02N", "UNKNOWN"),
        (b"\x80\x02}K\x01s.", "SETITEM"),
        (b"\x80\x02t.", "TUPLE"),
    ] {
        assert_eq!(pickle_error(data).0, opcode, "{data:?}");
    }
}

#[test]
fn the_memo_shares_one_node_among_its_references() {
    // [[], <the same list>]: both items are arena node 1.
    let mut m = Machine::new("p", b"\x80\x02](]q\x00h\x00e.", &PRINT_ONLY, Plain);
    let root = m.run().unwrap();
    let arena = m.into_arena();
    let super::Node::List(items) = &arena[0] else {
        panic!("{root:?}")
    };
    assert!(matches!(items.as_slice(), [V::Obj(1), V::Obj(1)]));
}
