//! The c10d `TCPStore` client (`fsdp::collectives::tcp_store`) and the rendezvous through it,
//! against a real PyTorch 2.13 `TCPStore` server (`tests/support/tcp_store_server.py`, both
//! server backends), and against fake servers that answer garbage.

use fsdp::collectives::rendezvous::TcpRendezvous;
use fsdp::collectives::tcp_store::TcpStoreClient;
use fsdp::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(30);

/// A PyTorch `TCPStore` server process, driven line by line.
struct PyStore {
    port: u16,
    io: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    child: Child,
}

impl PyStore {
    fn start(backend: &str) -> Self {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/tcp_store_server.py");
        let mut child = Command::new(crate::common::python())
            .arg(script)
            .arg(backend)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the Python TCPStore server");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let port = line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("the server did not print its port: {line:?}"));
        Self {
            port,
            io: Mutex::new((stdin, stdout)),
            child,
        }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn command(&self, line: &str) -> String {
        let mut io = self.io.lock().unwrap();
        writeln!(io.0, "{line}").unwrap();
        io.0.flush().unwrap();
        let mut answer = String::new();
        io.1.read_line(&mut answer).unwrap();
        answer.trim().to_string()
    }

    /// `store.set(key, value)` in Python.
    fn set(&self, key: &str, value: &[u8]) {
        assert_eq!(self.command(&format!("set {key} {}", hex(value))), "ok");
    }

    /// `store.get(key)` in Python.
    fn get(&self, key: &str) -> Vec<u8> {
        unhex(&self.command(&format!("get {key}")))
    }
}

/// One server per backend for the whole test binary (starting Python takes seconds); every
/// test uses keys of its own. It exits when this process ends and its stdin closes.
fn server(backend: &'static str) -> &'static PyStore {
    static LIBUV: OnceLock<PyStore> = OnceLock::new();
    static CLASSIC: OnceLock<PyStore> = OnceLock::new();
    let cell = if backend == "libuv" { &LIBUV } else { &CLASSIC };
    cell.get_or_init(|| PyStore::start(backend))
}

impl Drop for PyStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn set_get_wait_check_add(backend: &'static str) {
    let py = server(backend);
    let mut store = TcpStoreClient::connect(&py.addr(), 3, LONG).unwrap();

    // Rust sets, Python reads: every byte value survives.
    let all_bytes: Vec<u8> = (0..=255u8).collect();
    store.set("fsdp/test/from_rust", &all_bytes).unwrap();
    assert_eq!(py.get("fsdp/test/from_rust"), all_bytes);
    store.set("fsdp/test/empty", b"").unwrap();
    assert_eq!(py.get("fsdp/test/empty"), b"");

    // Python sets, Rust reads.
    py.set("fsdp/test/from_python", b"\x00hello\xff");
    assert!(store.check(&["fsdp/test/from_python"]).unwrap());
    assert!(!store
        .check(&["fsdp/test/from_python", "fsdp/test/absent"])
        .unwrap());
    assert!(store
        .wait(&["fsdp/test/from_python", "fsdp/test/from_rust"], LONG)
        .unwrap());
    assert_eq!(
        store.get("fsdp/test/from_python", LONG).unwrap().unwrap(),
        b"\x00hello\xff"
    );

    // `add` keeps the decimal string PyTorch keeps.
    assert_eq!(store.add("fsdp/test/counter", 1).unwrap(), 1);
    assert_eq!(store.add("fsdp/test/counter", 41).unwrap(), 42);
    assert_eq!(py.get("fsdp/test/counter"), b"42");
}

#[test]
fn set_get_wait_check_add_against_pytorch_libuv_store() {
    set_get_wait_check_add("libuv");
}

#[test]
fn set_get_wait_check_add_against_pytorch_classic_store() {
    set_get_wait_check_add("classic");
}

#[test]
fn a_key_that_never_comes_times_out_and_the_connection_stays_usable() {
    for backend in ["libuv", "classic"] {
        let py = server(backend);
        let mut store = TcpStoreClient::connect(&py.addr(), 1, LONG).unwrap();
        let start = Instant::now();
        assert!(!store
            .wait(&["fsdp/test/timeout/never"], Duration::from_millis(300))
            .unwrap());
        assert_eq!(
            store
                .get("fsdp/test/timeout/never", Duration::from_millis(300))
                .unwrap(),
            None
        );
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(600),
            "{backend}: {waited:?}"
        );
        assert!(waited < Duration::from_secs(10), "{backend}: {waited:?}");
        // The cancelled waits left nothing behind: the next answers are the right ones.
        store.set("fsdp/test/timeout/after", b"fine").unwrap();
        assert_eq!(
            store.get("fsdp/test/timeout/after", LONG).unwrap().unwrap(),
            b"fine"
        );
        py.set("fsdp/test/timeout/never", b"late");
        assert_eq!(
            store.get("fsdp/test/timeout/never", LONG).unwrap().unwrap(),
            b"late"
        );
    }
}

#[test]
fn a_waiting_client_wakes_when_python_sets_the_key() {
    let py = server("libuv");
    let addr = py.addr();
    let waiter = thread::spawn(move || {
        let mut store = TcpStoreClient::connect(&addr, 1, LONG).unwrap();
        let start = Instant::now();
        let value = store.get("fsdp/test/wake/later", LONG).unwrap();
        (value, start.elapsed())
    });
    thread::sleep(Duration::from_millis(500));
    py.set("fsdp/test/wake/later", b"now");
    let (value, waited) = waiter.join().unwrap();
    assert_eq!(value.as_deref(), Some(&b"now"[..]));
    assert!(waited < Duration::from_secs(10), "{waited:?}");
}

#[test]
fn oversized_keys_and_values_are_refused_before_sending() {
    let py = server("libuv");
    let mut store = TcpStoreClient::connect(&py.addr(), 0, LONG).unwrap();
    let long_key = "k".repeat(9000);
    assert!(matches!(
        store.set(&long_key, b"x"),
        Err(Error::Rendezvous { rank: 0, reason, .. }) if reason.contains("longer than")
    ));
    let huge = vec![0u8; 8 * 1024 * 1024 + 1];
    assert!(matches!(
        store.set("fsdp/test/oversized/huge", &huge),
        Err(Error::Rendezvous { reason, .. }) if reason.contains("more than the store's")
    ));
    // Nothing was sent: the connection still works.
    store.set("fsdp/test/oversized/small", b"ok").unwrap();
    assert_eq!(py.get("fsdp/test/oversized/small"), b"ok");
}

#[test]
fn nothing_listening_is_a_typed_error_after_the_timeout() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let err = TcpStoreClient::connect(&format!("127.0.0.1:{port}"), 2, Duration::from_millis(300))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Rendezvous { rank: 2, reason, .. } if reason.contains("no TCPStore accepted")),
        "{err:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

// ----- fake servers -----

/// A server that validates the client's first two requests (VALIDATE, PING), answers the
/// ping as `ping` says, then hands the connection to `then`.
fn fake_server(
    ping: impl FnOnce(&mut TcpStream, [u8; 4]) + Send + 'static,
    then: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut validate = [0u8; 5];
        s.read_exact(&mut validate).unwrap();
        assert_eq!(
            validate,
            [0, 0xCE, 0xF7, 0x85, 0x3C],
            "VALIDATE and the magic"
        );
        let mut ping_req = [0u8; 5];
        s.read_exact(&mut ping_req).unwrap();
        assert_eq!(ping_req[0], 13, "PING");
        ping(&mut s, ping_req[1..].try_into().unwrap());
        then(&mut s);
        // Keep the connection open until the client is done.
        let _ = s.read_to_end(&mut Vec::new());
    });
    addr
}

fn echo(s: &mut TcpStream, nonce: [u8; 4]) {
    s.write_all(&nonce).unwrap();
}

fn assert_garbage_error(result: fsdp::Result<impl std::fmt::Debug>, needle: &str) {
    match result {
        Err(Error::Rendezvous {
            rank: 5, reason, ..
        }) => {
            assert!(reason.contains(needle), "`{needle}` not in: {reason}")
        }
        other => panic!("expected Error::Rendezvous with `{needle}`, got {other:?}"),
    }
}

/// Reads one WAIT request for one key and discards it.
fn read_wait(s: &mut TcpStream) {
    let mut head = [0u8; 17];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[0], 6, "WAIT");
    let len = u64::from_le_bytes(head[9..17].try_into().unwrap());
    let mut key = vec![0u8; len as usize];
    s.read_exact(&mut key).unwrap();
}

#[test]
fn a_wrong_ping_echo_is_a_typed_error() {
    let addr = fake_server(|s, _| s.write_all(b"HTTP").unwrap(), |_| {});
    assert_garbage_error(TcpStoreClient::connect(&addr, 5, LONG), "not a TCPStore");
}

#[test]
fn a_server_that_hangs_up_or_stays_silent_is_a_typed_error() {
    let addr = fake_server(|s, _| s.shutdown(std::net::Shutdown::Both).unwrap(), |_| {});
    assert_garbage_error(TcpStoreClient::connect(&addr, 5, LONG), "PING");
    let addr = fake_server(|_, _| {}, |_| {});
    let start = Instant::now();
    assert_garbage_error(
        TcpStoreClient::connect(&addr, 5, Duration::from_millis(300)),
        "no complete answer in time",
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn an_unknown_wait_answer_is_a_typed_error() {
    let addr = fake_server(echo, |s| {
        read_wait(s);
        s.write_all(&[7]).unwrap();
    });
    let mut store = TcpStoreClient::connect(&addr, 5, LONG).unwrap();
    assert_garbage_error(store.get("k", LONG), "expected answer byte 0, got 7");
}

#[test]
fn a_huge_announced_length_is_a_typed_error() {
    let addr = fake_server(echo, |s| {
        read_wait(s);
        s.write_all(&[0]).unwrap();
        s.write_all(&u64::MAX.to_le_bytes()).unwrap();
    });
    let mut store = TcpStoreClient::connect(&addr, 5, LONG).unwrap();
    assert_garbage_error(store.get("k", LONG), "more than the");
}

#[test]
fn a_truncated_value_is_a_typed_error() {
    let addr = fake_server(echo, |s| {
        read_wait(s);
        s.write_all(&[0]).unwrap();
        s.write_all(&100u64.to_le_bytes()).unwrap();
        s.write_all(b"only a part").unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut store = TcpStoreClient::connect(&addr, 5, LONG).unwrap();
    assert_garbage_error(
        store.get("k", LONG),
        "closed before the answer was complete",
    );
}

#[test]
fn random_bytes_never_panic_the_client() {
    // Deterministic pseudo-random garbage after a correct ping, for every operation.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..40 {
        let garbage: Vec<u8> = (0..(round * 7 % 64 + 1))
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let addr = fake_server(echo, move |s| {
            let _ = s.write_all(&garbage);
            let _ = s.shutdown(std::net::Shutdown::Write);
        });
        let mut store = TcpStoreClient::connect(&addr, 5, Duration::from_secs(2)).unwrap();
        let result = match round % 4 {
            0 => store.get("k", Duration::from_secs(2)).map(|_| ()),
            1 => store.add("k", 1).map(|_| ()),
            2 => store.check(&["k"]).map(|_| ()),
            _ => store.wait(&["k"], Duration::from_secs(2)).map(|_| ()),
        };
        // Garbage may happen to be a valid answer; it must never be a panic or a hang, and
        // any error is the typed one.
        if let Err(e) = result {
            assert!(matches!(e, Error::Rendezvous { rank: 5, .. }), "{e:?}");
        }
    }
}

// ----- the rendezvous through a PyTorch store -----

/// Runs ranks `0..world_size` (claimed rank and world size each) of a rendezvous through
/// `py`'s store under `namespace`, rank 0 handing out `blob`.
fn run_ranks(
    py: &PyStore,
    namespace: &str,
    ranks: &[(usize, usize)],
    blob: &[u8],
    timeout: Duration,
) -> Vec<fsdp::Result<Vec<u8>>> {
    thread::scope(|s| {
        let joins: Vec<_> = ranks
            .iter()
            .map(|&(rank, ws)| {
                s.spawn(move || {
                    let r =
                        TcpRendezvous::with_agent_store(rank, ws, "127.0.0.1", py.port, namespace)?
                            .with_timeout(timeout);
                    assert!(r.uses_agent_store());
                    assert_eq!(r.local_addr(), None);
                    r.exchange((rank == 0).then_some(blob))
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

#[test]
fn rendezvous_hands_rank_zeros_blob_to_every_rank_through_the_store() {
    let py = server("libuv");
    let id: Vec<u8> = (0..128u8).rev().collect();
    let ranks: Vec<_> = (0..4).map(|r| (r, 4)).collect();
    for result in run_ranks(py, "hand_out/attempt_0/0", &ranks, &id, LONG) {
        assert_eq!(result.unwrap(), id);
    }
    // The answer sits under this crate's prefix, where Python sees it too.
    let answer = py.get("fsdp/rendezvous/v1/hand_out/attempt_0/0/0/answer");
    assert_eq!(answer[0], 0);
    assert_eq!(&answer[1..], &id[..]);
}

#[test]
fn a_second_exchange_and_a_restart_never_read_stale_bytes() {
    let py = server("libuv");
    let first = run_ranks(py, "job/attempt_0/0", &[(0, 2), (1, 2)], b"first", LONG);
    assert!(first
        .iter()
        .all(|r| r.as_deref().ok() == Some(&b"first"[..])));
    // The restarted job (attempt 1): rank 1 comes long before rank 0 and must get rank 0's
    // new bytes, not attempt 0's.
    let (late_root, joiner) = thread::scope(|s| {
        let joiner = s.spawn(move || {
            TcpRendezvous::with_agent_store(1, 2, "127.0.0.1", py.port, "job/attempt_1/0")?
                .with_timeout(LONG)
                .exchange(None)
        });
        thread::sleep(Duration::from_millis(500));
        let root = TcpRendezvous::with_agent_store(0, 2, "127.0.0.1", py.port, "job/attempt_1/0")
            .unwrap()
            .with_timeout(LONG);
        (root.exchange(Some(b"second")), joiner.join().unwrap())
    });
    assert_eq!(late_root.unwrap(), b"second");
    assert_eq!(joiner.unwrap(), b"second");
    // Two exchanges on one rendezvous use their own keys too.
    let rdzv: Vec<_> = (0..2)
        .map(|r| {
            TcpRendezvous::with_agent_store(r, 2, "127.0.0.1", py.port, "job/attempt_1/1")
                .unwrap()
                .with_timeout(LONG)
        })
        .collect();
    for blob in [&b"one"[..], b"two"] {
        let (a, b) = thread::scope(|s| {
            let b = s.spawn(|| rdzv[1].exchange(None));
            (rdzv[0].exchange(Some(blob)), b.join().unwrap())
        });
        assert_eq!(a.unwrap(), blob);
        assert_eq!(b.unwrap(), blob);
    }
}

#[test]
fn a_rank_that_never_comes_is_named_on_every_rank() {
    let py = server("libuv");
    let results = run_ranks(
        py,
        "timeout/0",
        &[(0, 4), (2, 4)],
        b"id",
        Duration::from_millis(800),
    );
    for (who, r) in results.into_iter().enumerate() {
        match r {
            Err(Error::CollectiveTimeout { missing, op, .. }) => {
                assert_eq!(missing, [1, 3], "result {who}");
                assert!(op.starts_with("rendezvous at 127.0.0.1:"), "{op}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    // Without rank 0, a rank times out naming rank 0.
    let results = run_ranks(py, "timeout/1", &[(1, 2)], b"", Duration::from_millis(300));
    assert!(
        matches!(&results[0], Err(Error::CollectiveTimeout { rank: 1, missing, .. }) if missing == &[0]),
        "{results:?}"
    );
}

#[test]
fn a_different_world_size_or_a_duplicate_rank_fails_through_the_store() {
    let py = server("libuv");
    let results = run_ranks(py, "ws/0", &[(0, 3), (1, 3), (2, 4)], b"id", LONG);
    for r in results {
        match r {
            Err(Error::CollectiveMismatch { detail, .. }) => {
                assert!(detail.contains("world size 4, rank 0 with 3"), "{detail}")
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
    // A rank beyond rank 0's world size is not awaited; it learns the mismatch itself.
    let results = run_ranks(py, "ws/1", &[(0, 2), (1, 2), (3, 4)], b"id", LONG);
    assert_eq!(results[0].as_deref().unwrap(), b"id");
    assert_eq!(results[1].as_deref().unwrap(), b"id");
    assert!(
        matches!(&results[2], Err(Error::CollectiveMismatch { detail, .. }) if detail.contains("world size 4, rank 0 with 2")),
        "{:?}",
        results[2]
    );
    // Rank 1 twice: the second to arrive fails at once, rank 0 fails everyone it answers.
    let results = run_ranks(
        py,
        "dup/0",
        &[(1, 2), (1, 2)],
        b"",
        Duration::from_millis(500),
    );
    assert!(results.iter().any(|r| matches!(r, Err(Error::CollectiveMismatch { detail, .. }) if detail.contains("rank 1 connected twice"))), "{results:?}");
    let root = run_ranks(py, "dup/0", &[(0, 2)], b"id", LONG);
    assert!(
        matches!(&root[0], Err(Error::CollectiveMismatch { detail, .. }) if detail.contains("rank 1 connected twice")),
        "{root:?}"
    );
}

#[test]
fn rank_zero_without_a_blob_or_with_too_big_a_blob_fails_everyone() {
    let py = server("libuv");
    let too_big = vec![1u8; (1 << 20) + 1];
    for r in run_ranks(py, "big/0", &[(0, 2), (1, 2)], &too_big, LONG) {
        assert!(
            matches!(&r, Err(Error::CollectiveMismatch { detail, .. }) if detail.contains("more than the 1048576")),
            "{r:?}"
        );
    }
    let results = thread::scope(|s| {
        let b = s.spawn(|| {
            TcpRendezvous::with_agent_store(1, 2, "127.0.0.1", py.port, "none/0")?
                .with_timeout(LONG)
                .exchange(None)
        });
        let a = TcpRendezvous::with_agent_store(0, 2, "127.0.0.1", py.port, "none/0")
            .unwrap()
            .with_timeout(LONG)
            .exchange(None);
        [a, b.join().unwrap()]
    });
    for r in results {
        assert!(
            matches!(&r, Err(Error::CollectiveMismatch { detail, .. }) if detail.contains("passed no bytes")),
            "{r:?}"
        );
    }
}
