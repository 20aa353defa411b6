//! Key-value stores for rendezvous, below the transports: the [`Store`] trait the transports
//! publish and look up addresses through, the TCP store ([`StoreServer`], served by rank 0 or a
//! launcher, and its client [`TcpStore`]) and a [`FileStore`] for shared filesystems.
//!
//! - `protocol.rs`: the TCP store's wire format (hello, requests, answers, framing);
//! - `server.rs`: [`StoreServer`];
//! - `client.rs`: [`TcpStore`];
//! - `file.rs`: [`FileStore`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

mod client;
mod file;
mod protocol;
mod server;
mod torch;

pub use client::TcpStore;
pub use file::{FileStore, FileStoreLeaver};
pub use protocol::{
    decode_request, Request, Response, StoreHello, HANDSHAKE_DEADLINE, MAX_KEY, MAX_STORE_MESSAGE,
    MAX_VALUE, MESSAGE_DEADLINE,
};
pub use server::{max_clients, Quota, StoreServer, MAX_UNAUTHENTICATED, PRESENCE, PRESENT};
pub use torch::TorchStore;

/// A rendezvous key-value store shared by the ranks of a job.
///
/// Implementations are safe to call from many threads; every blocking call takes a timeout.
pub trait Store: Send + Sync {
    /// Set `key` to `value`, waking waiters.
    ///
    /// # Errors
    /// [`Error::Store`] when the store cannot be reached.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Get `key`, waiting up to `timeout` for it to be set.
    ///
    /// # Errors
    /// [`Error::StoreTimeout`] naming the key on timeout; [`Error::Store`] on failure.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Add `delta` to the integer at `key` (missing counts as 0); returns the new value.
    ///
    /// # Errors
    /// [`Error::Store`] when the value is not an integer or the store fails.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Delete `key`; true if it existed.
    ///
    /// # Errors
    /// [`Error::Store`] on failure.
    fn delete(&self, key: &str) -> Result<bool>;

    /// True if every key is set, without waiting.
    ///
    /// # Errors
    /// [`Error::Store`] on failure.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Wait until every key is set, or `timeout`; on timeout the error lists the missing keys.
    ///
    /// # Errors
    /// [`Error::Store`] on timeout or failure.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for k in keys {
            self.get(k, deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }

    /// Get every one of `keys`, in their order, waiting up to `timeout` for the last to be set
    /// (one round trip where the store can: the TCP store answers it in one request).
    ///
    /// # Errors
    /// [`Error::StoreTimeout`] naming a missing key on timeout; [`Error::Store`] on failure.
    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        keys.iter()
            .map(|k| self.get(k, deadline.saturating_duration_since(Instant::now())))
            .collect()
    }

    /// Where the store lives, for messages.
    fn describe(&self) -> String;

    /// Whether a thread of tutti's own may call this store while the caller goes on (and, at
    /// exit, after the caller has given up waiting for it). Stores backed by an interpreter
    /// (Python objects, which a thread must not call once the interpreter is finalizing) say no.
    fn detached_calls(&self) -> bool {
        true
    }
}

/// A shared store is a store.
impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        (**self).delete(key)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        (**self).check(keys)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        (**self).wait(keys, timeout)
    }
    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        (**self).get_all(keys, timeout)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn detached_calls(&self) -> bool {
        (**self).detached_calls()
    }
}

/// `store.get(key, timeout)` where running out of time ([`Error::StoreTimeout`]) becomes
/// `on_timeout()` (the caller names whoever never wrote the key) and any other failure — the
/// store lost, say — is returned as it is, so a dead store is never reported as a slow rank.
///
/// # Errors
/// `on_timeout()`'s error on a timeout; [`Error::Store`] when the store fails.
pub(crate) fn get_or(
    store: &dyn Store,
    key: &str,
    timeout: Duration,
    on_timeout: impl FnOnce() -> Error,
) -> Result<Vec<u8>> {
    store.get(key, timeout).map_err(|e| match e {
        Error::StoreTimeout { .. } => on_timeout(),
        other => other,
    })
}

/// `value` followed by `HMAC(key, domain… ‖ name ‖ 0 ‖ value)`: what [`SignedStore`] and
/// [`set_signed`] store.
fn seal(key: &crate::auth::JobKey, domain: &[&[u8]], name: &str, value: &[u8]) -> Vec<u8> {
    let mut parts: Vec<&[u8]> = domain.to_vec();
    parts.extend([name.as_bytes(), b"\0", value]);
    let mut v = value.to_vec();
    v.extend_from_slice(&key.mac(&parts));
    v
}

/// The value [`seal`] sealed, or `None` when the tag does not check out.
fn unseal(
    key: &crate::auth::JobKey,
    domain: &[&[u8]],
    name: &str,
    mut raw: Vec<u8>,
) -> Option<Vec<u8>> {
    let at = raw.len().checked_sub(32)?;
    let tag = raw.split_off(at);
    let mut parts: Vec<&[u8]> = domain.to_vec();
    parts.extend([name.as_bytes(), b"\0", &raw]);
    key.verify(&parts, &tag).then_some(raw)
}

/// A store that does not authenticate its clients (torch's `TCPStore`, a file store), made
/// tamper-evident:
/// every value is written with `HMAC(key, "tutti-signed" ‖ name ‖ 0 ‖ value)` after it and
/// checked when read, so an entry written or changed by someone without the job secret is
/// refused, naming the key. Counters (`add`) are not covered: a forger can disturb them (a
/// failed start), not redirect anything.
#[derive(Debug)]
pub struct SignedStore<S> {
    inner: S,
    key: crate::auth::JobKey,
}

impl<S: Store> SignedStore<S> {
    /// Sign and check `inner`'s values with `key`.
    pub fn new(inner: S, key: crate::auth::JobKey) -> SignedStore<S> {
        SignedStore { inner, key }
    }

    /// `raw`'s value, checked against the job secret.
    fn open(&self, key: &str, raw: Vec<u8>) -> Result<Vec<u8>> {
        unseal(&self.key, &[b"tutti-signed"], key, raw).ok_or_else(|| Error::Store {
            addr: self.inner.describe(),
            detail: format!(
                "integrity check failed: the entry {key:?} fails its check against the job \
                 secret; someone without the secret wrote or changed it (or a rank runs with \
                 another TUTTI_TOKEN)"
            ),
        })
    }
}

impl<S: Store> Store for SignedStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(key, &seal(&self.key, &[b"tutti-signed"], key, value))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let raw = self.inner.get(key, timeout)?;
        self.open(key, raw)
    }

    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let raws = self.inner.get_all(keys, timeout)?;
        keys.iter().zip(raws).map(|(k, raw)| self.open(k, raw)).collect()
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(key, delta)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(keys)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(keys, timeout)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// Publish `value` under `name`, bound to the job: what is stored is `value` followed by
/// `HMAC(k, "tutti-entry" ‖ job ‖ name ‖ 0 ‖ value)`, so a store that is not authenticated, or
/// an answer rewritten on its way, cannot substitute an address or a certificate fingerprint.
///
/// # Errors
/// As [`Store::set`].
pub(crate) fn set_signed(
    store: &dyn Store,
    key: &crate::auth::JobKey,
    job: u64,
    name: &str,
    value: &[u8],
) -> Result<()> {
    store.set(name, &seal(key, &[b"tutti-entry", &job.to_le_bytes()], name, value))
}

/// The value of an entry written by [`set_signed`], or `None` when its tag does not check out
/// (forged, altered, or written under another secret or job).
pub(crate) fn open_signed(
    key: &crate::auth::JobKey,
    job: u64,
    name: &str,
    raw: Vec<u8>,
) -> Option<Vec<u8>> {
    unseal(key, &[b"tutti-entry", &job.to_le_bytes()], name, raw)
}

/// What a rank says when a peer's published entry fails its check.
pub(crate) fn forged(rank: usize, peer: usize, what: &str) -> Error {
    Error::Rendezvous {
        rank,
        detail: format!(
            "rank {peer}'s published {what} fails its check against the job secret: the store's \
             answer was forged or altered on its way (or rank {peer} runs with another secret); \
             nothing was sent to it"
        ),
    }
}

/// A store seen under a key prefix (one epoch's rendezvous keys apart from another's).
pub(crate) struct PrefixStore {
    inner: Arc<dyn Store>,
    prefix: String,
}

impl PrefixStore {
    /// `inner`'s keys that start with `prefix`, seen without it.
    pub(crate) fn new(inner: Arc<dyn Store>, prefix: String) -> PrefixStore {
        PrefixStore { inner, prefix }
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&format!("{}{key}", self.prefix), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&format!("{}{key}", self.prefix), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&format!("{}{key}", self.prefix), delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&format!("{}{key}", self.prefix))
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys: Vec<String> = keys.iter().map(|k| format!("{}{k}", self.prefix)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }
    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = keys.iter().map(|k| format!("{}{k}", self.prefix)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.get_all(&refs, timeout).map_err(|e| match e {
            // The missing key as the caller named it.
            Error::StoreTimeout { addr, key, after } => Error::StoreTimeout {
                addr,
                key: key.strip_prefix(&self.prefix).map_or(key.clone(), str::to_string),
                after,
            },
            other => other,
        })
    }
    fn describe(&self) -> String {
        format!("{} under {}", self.inner.describe(), self.prefix)
    }
    fn detached_calls(&self) -> bool {
        self.inner.detached_calls()
    }
}

#[cfg(test)]
mod tests;
