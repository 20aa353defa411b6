//! Key-value stores for rendezvous, below the transports: the [`Store`] trait the transports
//! publish and look up addresses through, the TCP store ([`StoreServer`], served by rank 0 or a
//! launcher, and its client [`TcpStore`]) and a [`FileStore`] for shared filesystems.
//!
//! - `protocol.rs`: the TCP store's wire format (hello, requests, answers, framing);
//! - `server.rs`: [`StoreServer`];
//! - `client.rs`: [`TcpStore`];
//! - `file.rs`: [`FileStore`].

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

mod client;
mod file;
mod protocol;
mod server;

pub use client::TcpStore;
pub use file::FileStore;
pub use protocol::{decode_request, Request, Response, StoreHello, MAX_STORE_MESSAGE};
pub use server::StoreServer;

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

    /// Where the store lives, for messages.
    fn describe(&self) -> String;
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

#[cfg(test)]
mod tests;
