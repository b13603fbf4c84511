//! A client of PyTorch's c10d `TCPStore`: the key-value server `torchrun`'s elastic agent runs
//! at `MASTER_ADDR:MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`), which the
//! [`rendezvous`](super::rendezvous) uses instead of listening on that port itself.
//!
//! # Wire protocol (PyTorch 2.13, both server backends: libuv and the classic one)
//!
//! Integers are little-endian; a string or byte value is a `u64` length then the bytes. A
//! request is a one-byte query type then its fields:
//!
//! | query | byte | fields | reply |
//! | --- | --- | --- | --- |
//! | `VALIDATE` | 0 | `u32` magic `0x3C85F7CE` | none (must be the first request) |
//! | `SET` | 1 | key, value | none |
//! | `GET` | 3 | key | value |
//! | `ADD` | 4 | key, `i64` delta | `i64` new value (stored as its decimal string) |
//! | `CHECK` | 5 | `u64` count, keys | `u8`: 0 all set, 1 not yet |
//! | `WAIT` | 6 | `u64` count, keys | `u8` 0 once all are set |
//! | `CANCEL_WAIT` | 12 | — | `u8` 1 (after a possible late 0 for the cancelled wait) |
//! | `PING` | 13 | `u32` nonce | the nonce |
//!
//! Like PyTorch's `TCPStore` client, every key goes on the wire with a leading `/`, so that
//! `store.get("k")` in Python and [`TcpStoreClient::get`]`("k")` here name the same entry.
//! The servers reject keys over 8 KiB and values over 8 MiB by closing the connection; this
//! client refuses them before sending. `GET` of a missing key closes the connection on the
//! classic server, so [`TcpStoreClient::get`] waits for the key first, as PyTorch does.
//!
//! Every reply is read with a deadline and checked (lengths bounded, status bytes known, the
//! ping nonce echoed): a server that is not a `TCPStore` gives [`Error::Rendezvous`], never a
//! hang or a panic.

use super::net::{connect_once, read_until, ConnectError, ReadError};
use crate::error::{Error, Result};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
/// `c10d::detail::validationMagicNumber`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
const CHECK_READY: u8 = 0;
const CHECK_NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// The libuv server's `MAX_STRING_LEN` (keys).
const MAX_KEY: usize = 8 * 1024;
/// The libuv server's `MAX_PAYLOAD_LEN` (values); also the largest value this client reads.
pub(crate) const MAX_VALUE: usize = 8 * 1024 * 1024;
/// How long a cancelled wait may take to be acknowledged.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// Pause between connection attempts.
const RETRY: Duration = Duration::from_millis(20);

/// One connection to a `TCPStore` server (protocol in the [module docs](self)).
///
/// ```no_run
/// use fsdp::collectives::tcp_store::TcpStoreClient;
/// use std::time::Duration;
///
/// let mut store = TcpStoreClient::connect("127.0.0.1:29500", 0, Duration::from_secs(30))?;
/// store.set("fsdp/hello", b"world")?;
/// assert_eq!(store.get("fsdp/hello", Duration::from_secs(1))?.as_deref(), Some(&b"world"[..]));
/// # Ok::<(), fsdp::Error>(())
/// ```
#[derive(Debug)]
pub struct TcpStoreClient {
    stream: TcpStream,
    addr: String,
    rank: usize,
    timeout: Duration,
}

impl TcpStoreClient {
    /// Connects to the server at `addr` (`host:port`) on behalf of `rank` (named in errors),
    /// retrying until `timeout` while nothing listens, then validates the connection and
    /// checks with a ping that a `TCPStore` answers. `timeout` also bounds every later reply
    /// (except a [`TcpStoreClient::wait`], which has its own).
    pub fn connect(addr: &str, rank: usize, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now().checked_add(timeout);
        let stream = loop {
            match connect_once(addr) {
                Ok(stream) => break stream,
                Err(ConnectError::Resolve(reason)) => {
                    return Err(Error::Rendezvous {
                        rank,
                        addr: addr.into(),
                        reason,
                    })
                }
                Err(ConnectError::Retry) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Err(Error::Rendezvous {
                        rank,
                        addr: addr.into(),
                        reason: format!(
                            "no TCPStore accepted a connection within {timeout:?} \
                             (is torchrun's agent still running?)"
                        ),
                    })
                }
                Err(ConnectError::Retry) => std::thread::sleep(RETRY),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut client = Self {
            stream,
            addr: addr.into(),
            rank,
            timeout,
        };
        let mut validate = vec![VALIDATE];
        validate.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        client.send("VALIDATE", &validate)?;
        client.ping()?;
        Ok(client)
    }

    /// The server's address as given to [`TcpStoreClient::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sets `key` to `value`, waking the clients that wait for it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE {
            return Err(self.error(
                "SET",
                format!(
                    "value of key `{key}` has {} bytes, more than the store's {MAX_VALUE}",
                    value.len()
                ),
            ));
        }
        let mut request = vec![SET];
        self.push_key(&mut request, "SET", key)?;
        push_bytes(&mut request, value);
        self.send("SET", &request)
    }

    /// Adds `delta` to the integer at `key` (a missing key counts as 0) and returns the sum.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let mut request = vec![ADD];
        self.push_key(&mut request, "ADD", key)?;
        request.extend_from_slice(&delta.to_le_bytes());
        self.send("ADD", &request)?;
        let mut sum = [0u8; 8];
        self.read("ADD", &mut sum, self.reply_deadline())?;
        Ok(i64::from_le_bytes(sum))
    }

    /// Whether every key in `keys` is set now (does not wait).
    pub fn check(&mut self, keys: &[&str]) -> Result<bool> {
        let request = self.keys_request(CHECK, "CHECK", keys)?;
        self.send("CHECK", &request)?;
        let mut answer = [0u8; 1];
        self.read("CHECK", &mut answer, self.reply_deadline())?;
        match answer[0] {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            other => Err(self.error("CHECK", format!("unknown answer byte {other}"))),
        }
    }

    /// Waits until every key in `keys` is set: `Ok(true)` when they are, `Ok(false)` when
    /// `timeout` passed first (the server has then dropped the wait; the connection stays
    /// usable).
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<bool> {
        let request = self.keys_request(WAIT, "WAIT", keys)?;
        self.send("WAIT", &request)?;
        let mut answer = [0u8; 1];
        match read_until(
            &mut self.stream,
            &mut answer,
            Instant::now().checked_add(timeout),
        ) {
            Ok(()) => self
                .expect_wait_byte(answer[0], STOP_WAITING)
                .map(|()| true),
            Err(ReadError::TimedOut) => self.cancel_wait(),
            Err(ReadError::Io(e)) => Err(self.error("WAIT", e.to_string())),
        }
    }

    /// Waits up to `timeout` for `key` and returns its value, or `None` when it was not set
    /// in time.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        if !self.wait(&[key], timeout)? {
            return Ok(None);
        }
        let mut request = vec![GET];
        self.push_key(&mut request, "GET", key)?;
        self.send("GET", &request)?;
        let deadline = self.reply_deadline();
        let mut len = [0u8; 8];
        self.read("GET", &mut len, deadline)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_VALUE as u64 {
            return Err(self.error(
                "GET",
                format!("the server announced {len} bytes for key `{key}`, more than the {MAX_VALUE} a TCPStore holds"),
            ));
        }
        let mut value = vec![0u8; len as usize];
        self.read("GET", &mut value, deadline)?;
        Ok(Some(value))
    }

    /// Checks that a `TCPStore` answers: it must echo a nonce.
    fn ping(&mut self) -> Result<()> {
        let nonce = std::process::id() ^ 0x5A5A_0000;
        let mut request = vec![PING];
        request.extend_from_slice(&nonce.to_le_bytes());
        self.send("PING", &request)?;
        let mut echo = [0u8; 4];
        self.read("PING", &mut echo, self.reply_deadline())?;
        let echo = u32::from_le_bytes(echo);
        if echo != nonce {
            return Err(self.error(
                "PING",
                format!("sent nonce {nonce:#x}, got {echo:#x} back: not a TCPStore"),
            ));
        }
        Ok(())
    }

    /// After a wait timed out: cancels it. The server may have answered the wait just before
    /// the cancel arrived; then the keys are set after all.
    fn cancel_wait(&mut self) -> Result<bool> {
        self.send("CANCEL_WAIT", &[CANCEL_WAIT])?;
        let deadline = Instant::now().checked_add(CANCEL_GRACE);
        let mut answer = [0u8; 1];
        self.read("CANCEL_WAIT", &mut answer, deadline)?;
        if answer[0] == WAIT_CANCELED {
            return Ok(false);
        }
        self.expect_wait_byte(answer[0], STOP_WAITING)?;
        self.read("CANCEL_WAIT", &mut answer, deadline)?;
        self.expect_wait_byte(answer[0], WAIT_CANCELED)?;
        Ok(true)
    }

    fn expect_wait_byte(&self, got: u8, expected: u8) -> Result<()> {
        if got == expected {
            Ok(())
        } else {
            Err(self.error(
                "WAIT",
                format!("expected answer byte {expected}, got {got}: not a TCPStore"),
            ))
        }
    }

    fn keys_request(&self, query: u8, op: &str, keys: &[&str]) -> Result<Vec<u8>> {
        let mut request = vec![query];
        request.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for key in keys {
            self.push_key(&mut request, op, key)?;
        }
        Ok(request)
    }

    /// Appends `/key`, as PyTorch's client sends it.
    fn push_key(&self, request: &mut Vec<u8>, op: &str, key: &str) -> Result<()> {
        if key.len() + 1 > MAX_KEY {
            return Err(self.error(
                op,
                format!(
                    "key of {} bytes is longer than the store's {MAX_KEY}",
                    key.len()
                ),
            ));
        }
        request.extend_from_slice(&(key.len() as u64 + 1).to_le_bytes());
        request.push(b'/');
        request.extend_from_slice(key.as_bytes());
        Ok(())
    }

    fn send(&mut self, op: &str, request: &[u8]) -> Result<()> {
        let _ = self.stream.set_write_timeout(Some(self.timeout));
        self.stream
            .write_all(request)
            .map_err(|e| self.error(op, format!("sending the request: {e}")))
    }

    fn read(&mut self, op: &str, buf: &mut [u8], deadline: Option<Instant>) -> Result<()> {
        read_until(&mut self.stream, buf, deadline).map_err(|e| match e {
            ReadError::TimedOut => self.error(op, "no complete answer in time".into()),
            ReadError::Io(e) => self.error(op, format!("reading the answer: {e}")),
        })
    }

    fn reply_deadline(&self) -> Option<Instant> {
        Instant::now().checked_add(self.timeout)
    }

    fn error(&self, op: &str, reason: String) -> Error {
        Error::Rendezvous {
            rank: self.rank,
            addr: self.addr.clone(),
            reason: format!("TCPStore `{op}`: {reason}"),
        }
    }
}

fn push_bytes(request: &mut Vec<u8>, bytes: &[u8]) {
    request.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    request.extend_from_slice(bytes);
}
