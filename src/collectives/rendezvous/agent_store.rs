//! The rendezvous through torchrun's agent store: every rank is a client of the `TCPStore`
//! at `MASTER_ADDR:MASTER_PORT` (protocol in the [parent module's docs](super)).

use super::{
    timeout_payload, TcpRendezvous, GRACE, MAX_PAYLOAD, STATUS_MISMATCH, STATUS_OK, STATUS_TIMEOUT,
};
use crate::collectives::tcp_store::TcpStoreClient;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// Prefix of every key this crate writes to a store.
pub(super) const KEY_ROOT: &str = "fsdp/rendezvous/v1";

/// The store keys of one exchange.
pub(super) struct Keys {
    prefix: String,
}

impl Keys {
    /// The keys of exchange number `exchange` of the rendezvous `namespace`.
    pub(super) fn new(namespace: &str, exchange: u64) -> Self {
        Self {
            prefix: format!("{KEY_ROOT}/{namespace}/{exchange}"),
        }
    }

    /// Rank 0's world size.
    fn world_size(&self) -> String {
        format!("{}/world_size", self.prefix)
    }

    /// Rank `rank`'s arrival counter.
    fn rank(&self, rank: usize) -> String {
        format!("{}/rank/{rank}", self.prefix)
    }

    /// Rank `rank`'s world size.
    fn rank_world_size(&self, rank: usize) -> String {
        format!("{}/rank/{rank}/world_size", self.prefix)
    }

    /// Rank 0's answer: status byte, payload.
    fn answer(&self) -> String {
        format!("{}/answer", self.prefix)
    }
}

impl TcpRendezvous {
    /// Rank 0: publishes its world size, waits for every rank's arrival, checks them and
    /// sets the answer.
    pub(super) fn serve_store(
        &self,
        keys: &Keys,
        outcome: std::result::Result<Vec<u8>, String>,
    ) -> Result<Vec<u8>> {
        let start = Instant::now();
        let mut store = TcpStoreClient::connect(&self.addr, 0, self.timeout)?;
        store.set(&keys.world_size(), self.world_size.to_string().as_bytes())?;
        let arrivals: Vec<String> = (1..self.world_size).map(|r| keys.rank(r)).collect();
        let arrivals: Vec<&str> = arrivals.iter().map(String::as_str).collect();
        if !store.wait(&arrivals, self.timeout.saturating_sub(start.elapsed()))? {
            let mut missing = Vec::new();
            for (r, key) in (1..).zip(&arrivals) {
                if !store.check(&[key])? {
                    missing.push(r);
                }
            }
            let waited = start.elapsed();
            let mut answer = vec![STATUS_TIMEOUT];
            answer.extend_from_slice(&timeout_payload(waited, &missing));
            store.set(&keys.answer(), &answer)?;
            return Err(Error::CollectiveTimeout {
                op: format!("rendezvous at {}", self.addr),
                rank: 0,
                waited,
                missing,
            });
        }
        let outcome = match self.first_problem(&mut store, keys)? {
            Some(problem) => Err(problem),
            None => outcome.and_then(|blob| fits(blob.len()).map(|()| blob)),
        };
        match outcome {
            Ok(blob) => {
                let mut answer = vec![STATUS_OK];
                answer.extend_from_slice(&blob);
                store.set(&keys.answer(), &answer)?;
                Ok(blob)
            }
            Err(problem) => {
                let mut answer = vec![STATUS_MISMATCH];
                answer.extend_from_slice(problem.as_bytes());
                store.set(&keys.answer(), &answer)?;
                Err(self.mismatch(problem))
            }
        }
    }

    /// Rank 0, once every rank arrived: the first rank launched with another world size or
    /// arrived twice.
    fn first_problem(&self, store: &mut TcpStoreClient, keys: &Keys) -> Result<Option<String>> {
        for r in 1..self.world_size {
            let world_size = match read_number(store, &keys.rank_world_size(r))? {
                Ok(n) => n,
                Err(problem) => return Ok(Some(format!("rank {r}: {problem}"))),
            };
            if world_size != self.world_size as u64 {
                return Ok(Some(format!(
                    "rank {r} was launched with world size {world_size}, rank 0 with {}",
                    self.world_size
                )));
            }
            match read_number(store, &keys.rank(r))? {
                Ok(1) => {}
                Ok(_) => return Ok(Some(format!("rank {r} connected twice (duplicate RANK)"))),
                Err(problem) => return Ok(Some(format!("rank {r}: {problem}"))),
            }
        }
        Ok(None)
    }

    /// Ranks other than 0: announce the arrival, wait for rank 0's answer, check rank 0's
    /// world size.
    pub(super) fn join_store(&self, keys: &Keys) -> Result<Vec<u8>> {
        let start = Instant::now();
        let mut store = TcpStoreClient::connect(&self.addr, self.rank, self.timeout)?;
        store.set(
            &keys.rank_world_size(self.rank),
            self.world_size.to_string().as_bytes(),
        )?;
        if store.add(&keys.rank(self.rank), 1)? > 1 {
            return Err(self.mismatch(format!(
                "rank {} connected twice (duplicate RANK)",
                self.rank
            )));
        }
        // Rank 0 answers at its own deadline at the latest: wait a little longer than that.
        let left = self
            .timeout
            .saturating_add(GRACE)
            .saturating_sub(start.elapsed());
        let Some(answer) = store.get(&keys.answer(), left)? else {
            return Err(Error::CollectiveTimeout {
                op: format!("rendezvous at {}", self.addr),
                rank: self.rank,
                waited: start.elapsed(),
                missing: vec![0],
            });
        };
        let Some((&status, payload)) = answer.split_first() else {
            return Err(self.store_error("rank 0's answer is empty: not an fsdp rendezvous"));
        };
        if let Err(problem) = fits(payload.len()) {
            return Err(self.store_error(&problem));
        }
        let blob = self.decode_answer(status, payload.to_vec())?;
        match read_number(&mut store, &keys.world_size())? {
            Ok(n) if n == self.world_size as u64 => Ok(blob),
            Ok(n) => Err(self.mismatch(format!(
                "rank {} was launched with world size {}, rank 0 with {n}",
                self.rank, self.world_size
            ))),
            Err(problem) => Err(self.store_error(&format!("rank 0's world size: {problem}"))),
        }
    }

    fn store_error(&self, reason: &str) -> Error {
        Error::Rendezvous {
            rank: self.rank,
            addr: self.addr.clone(),
            reason: reason.into(),
        }
    }
}

/// A blob the rendezvous carries: at most [`MAX_PAYLOAD`] bytes.
fn fits(len: usize) -> std::result::Result<(), String> {
    if len as u64 > MAX_PAYLOAD {
        Err(format!(
            "rank 0's blob has {len} bytes, more than the {MAX_PAYLOAD} the rendezvous carries"
        ))
    } else {
        Ok(())
    }
}

/// How long a key that is known to exist may take to be read.
const PRESENT: Duration = GRACE;

/// The decimal number at `key`, which its writer set before the key rank 0 waited for; the
/// inner `Err` says what is wrong with the value.
fn read_number(store: &mut TcpStoreClient, key: &str) -> Result<std::result::Result<u64, String>> {
    Ok(match store.get(key, PRESENT)? {
        None => Err(format!("key `{key}` is missing")),
        Some(value) => std::str::from_utf8(&value)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| {
                format!(
                    "key `{key}` holds {:?}, not a decimal number",
                    String::from_utf8_lossy(&value[..value.len().min(64)])
                )
            }),
    })
}
