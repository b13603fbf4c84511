//! TCP helpers the rendezvous and the store client share: one connection attempt, and a read
//! that fills its buffer or fails at a deadline.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why [`connect_once`] did not connect.
pub(crate) enum ConnectError {
    /// The address does not resolve: retrying will not help.
    Resolve(String),
    /// Nobody listens yet (or the network hiccuped): try again.
    Retry,
}

pub(crate) fn connect_once(addr: &str) -> std::result::Result<TcpStream, ConnectError> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| ConnectError::Resolve(format!("cannot resolve MASTER_ADDR: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(ConnectError::Resolve(
            "MASTER_ADDR resolves to no address".into(),
        ));
    }
    for a in addrs {
        if let Ok(s) = TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
            return Ok(s);
        }
    }
    Err(ConnectError::Retry)
}

/// Why [`read_until`] did not fill its buffer.
pub(crate) enum ReadError {
    TimedOut,
    Io(std::io::Error),
}

/// Fills `buf` from `stream`, failing when `deadline` passes first (`None`: no deadline).
pub(crate) fn read_until(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> std::result::Result<(), ReadError> {
    let mut filled = 0;
    while filled < buf.len() {
        let wait = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => return Err(ReadError::TimedOut),
            },
            None => None,
        };
        stream.set_read_timeout(wait).map_err(ReadError::Io)?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(ReadError::Io(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "connection closed before the answer was complete",
                )))
            }
            Ok(n) => filled += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}
