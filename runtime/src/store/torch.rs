//! A client of PyTorch's `TCPStore` (the store torchrun's agent serves), so a tutti job can
//! rendezvous through it instead of binding a store of its own.
//!
//! The protocol, as torch 2.x speaks it (checked against torch 2.15's libuv server and its
//! classic one, `tests/torch/`): one request after another on one connection; a request is a
//! command byte and its arguments; strings and byte strings are a little-endian `u64` length and
//! the bytes; integers are little-endian.
//!
//! | command | byte | arguments | answer |
//! |---|---|---|---|
//! | validate | 0 | `u32` magic `0x3C85F7CE` | none |
//! | set | 1 | key, value | none |
//! | get | 3 | key | value (empty when missing: wait first) |
//! | add | 4 | key, `i64` | `i64` new value |
//! | check | 5 | `u64` count, keys | `u8`: 0 ready, 1 not ready |
//! | wait | 6 | `u64` count, keys | `u8` 0 when all are set |
//! | delete | 8 | key | `i64` keys deleted |
//! | cancel wait | 12 | — | `u8` 1 (after a possible late 0) |
//! | ping | 13 | `u32` nonce | the same `u32` |
//!
//! torch's own clients prefix every key with `/`; tutti writes its keys under `/<namespace>/`
//! (`/tutti-0/tutti/…` for torchrun's first attempt), so it never collides with torch's keys
//! (`/default_pg/…`, `/torchelastic/…`) nor with an earlier attempt's.
//! The store is not authenticated: rendezvous wraps it in a [`SignedStore`](super::SignedStore)
//! under the job secret, so an entry forged by anyone who can reach the port is refused.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Store, MAX_VALUE};
use crate::error::{Error, Result};
use crate::util::read_exact_by;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE: u8 = 8;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// How long one answer that does not wait may take.
const ANSWER: Duration = Duration::from_secs(30);

/// A client of a PyTorch `TCPStore` (`TUTTI_STORE=torch://host:port`, or torchrun's agent store
/// when `TORCHELASTIC_USE_AGENT_STORE=True`).
pub struct TorchStore {
    addr: SocketAddr,
    namespace: String,
    conn: Mutex<TcpStream>,
}

impl std::fmt::Debug for TorchStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchStore").field("addr", &self.addr).finish_non_exhaustive()
    }
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

impl TorchStore {
    /// Connect to the torch store at `addr`, retrying until `timeout`, and check that it is one
    /// (validate, then a ping whose nonce must come back). Keys live under `/namespace/`
    /// (rendezvous uses `tutti-<restart>`, torchrun's restart count, so a restarted job never
    /// meets the last attempt's entries).
    ///
    /// # Errors
    /// [`Error::Store`] when nothing answers in time or what answers is not a torch store.
    pub fn connect(addr: SocketAddr, namespace: &str, timeout: Duration) -> Result<TorchStore> {
        let deadline = Instant::now() + timeout;
        let err = |d: String| Error::Store { addr: format!("torch://{addr}"), detail: d };
        let mut backoff = Duration::from_millis(5);
        let s = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) if Instant::now() + backoff >= deadline => {
                    return Err(err(format!(
                        "no torch store answered within {timeout:?} ({e}); is torchrun's agent \
                         (or the TCPStore server) running there?"
                    )))
                }
                Err(_) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
        };
        let t = TorchStore { addr, namespace: namespace.to_string(), conn: Mutex::new(s) };
        {
            let mut s = t.lock();
            let io = |e: std::io::Error| err(format!("checking the torch store failed: {e}"));
            s.set_nodelay(true).map_err(io)?;
            s.set_write_timeout(Some(ANSWER)).map_err(io)?;
            let nonce = u32::from_le_bytes(crate::auth::random::<4>().map_err(err)?);
            let mut req = vec![VALIDATE];
            req.extend_from_slice(&MAGIC.to_le_bytes());
            req.push(PING);
            req.extend_from_slice(&nonce.to_le_bytes());
            s.write_all(&req).map_err(io)?;
            let mut back = [0u8; 4];
            read_exact_by(&mut s, &mut back, Instant::now() + Duration::from_secs(5)).map_err(
                |e| {
                    err(format!(
                        "what answers there is not a torch store (no answer to its ping: {e}); \
                     check MASTER_ADDR/MASTER_PORT or TUTTI_STORE"
                    ))
                },
            )?;
            if u32::from_le_bytes(back) != nonce {
                return Err(err(
                    "what answers there is not a torch store (wrong ping answer)".into()
                ));
            }
        }
        Ok(t)
    }

    fn wire_key(&self, key: &str) -> Vec<u8> {
        format!("/{}/{key}", self.namespace).into_bytes()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TcpStream> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, detail: String) -> Error {
        Error::Store { addr: format!("torch://{}", self.addr), detail }
    }

    fn io(&self, e: std::io::Error) -> Error {
        self.err(format!("torch store connection failed (torchrun's agent gone?): {e}"))
    }

    fn read<const N: usize>(&self, s: &mut TcpStream, by: Instant) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        read_exact_by(s, &mut b, by).map_err(|e| self.io(e))?;
        Ok(b)
    }

    /// Wait up to `timeout` for every key; false when the wait was cancelled at the timeout.
    fn wait_keys(&self, s: &mut TcpStream, keys: &[&str], timeout: Duration) -> Result<bool> {
        let mut req = vec![WAIT];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, &self.wire_key(k));
        }
        s.write_all(&req).map_err(|e| self.io(e))?;
        let until = Instant::now().checked_add(timeout).unwrap_or_else(|| Instant::now() + ANSWER);
        match read_exact_by(s, &mut [0u8; 1][..], until) {
            Ok(()) => return Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) => return Err(self.io(e)),
        }
        s.write_all(&[CANCEL_WAIT]).map_err(|e| self.io(e))?;
        let by = Instant::now() + ANSWER;
        let [first] = self.read::<1>(s, by)?;
        match first {
            WAIT_CANCELED => Ok(false),
            // The keys arrived just before the cancel: the cancel's answer follows.
            STOP_WAITING => {
                let [second] = self.read::<1>(s, by)?;
                if second != WAIT_CANCELED {
                    return Err(self.err(format!("unexpected answer {second} to a cancelled wait")));
                }
                Ok(true)
            }
            other => Err(self.err(format!("unexpected answer {other} to a cancelled wait"))),
        }
    }
}

impl Store for TorchStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![SET];
        put_bytes(&mut req, &self.wire_key(key));
        put_bytes(&mut req, value);
        self.lock().write_all(&req).map_err(|e| self.io(e))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut s = self.lock();
        if !self.wait_keys(&mut s, &[key], timeout)? {
            return Err(Error::StoreTimeout {
                addr: format!("torch://{}", self.addr),
                key: key.into(),
                after: timeout,
            });
        }
        let mut req = vec![GET];
        put_bytes(&mut req, &self.wire_key(key));
        s.write_all(&req).map_err(|e| self.io(e))?;
        let by = Instant::now() + ANSWER;
        let len = u64::from_le_bytes(self.read::<8>(&mut s, by)?);
        if len > MAX_VALUE as u64 {
            return Err(
                self.err(format!("value of {key:?} is {len} bytes, over the limit of {MAX_VALUE}"))
            );
        }
        let mut v = vec![0u8; len as usize];
        read_exact_by(&mut s, &mut v, by).map_err(|e| self.io(e))?;
        Ok(v)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![ADD];
        put_bytes(&mut req, &self.wire_key(key));
        req.extend_from_slice(&delta.to_le_bytes());
        let mut s = self.lock();
        s.write_all(&req).map_err(|e| self.io(e))?;
        Ok(i64::from_le_bytes(self.read::<8>(&mut s, Instant::now() + ANSWER)?))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let mut req = vec![DELETE];
        put_bytes(&mut req, &self.wire_key(key));
        let mut s = self.lock();
        s.write_all(&req).map_err(|e| self.io(e))?;
        Ok(i64::from_le_bytes(self.read::<8>(&mut s, Instant::now() + ANSWER)?) > 0)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let mut req = vec![CHECK];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, &self.wire_key(k));
        }
        let mut s = self.lock();
        s.write_all(&req).map_err(|e| self.io(e))?;
        match self.read::<1>(&mut s, Instant::now() + ANSWER)? {
            [0] => Ok(true),
            [1] => Ok(false),
            [other] => Err(self.err(format!("unexpected answer {other} to a check"))),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut s = self.lock();
        if self.wait_keys(&mut s, keys, timeout)? {
            return Ok(());
        }
        drop(s);
        let missing: Vec<&str> =
            keys.iter().copied().filter(|k| !self.check(&[k]).unwrap_or(false)).collect();
        Err(self.err(format!("timed out after {timeout:?} waiting for keys {missing:?}")))
    }

    fn describe(&self) -> String {
        format!("torch://{}", self.addr)
    }
}
