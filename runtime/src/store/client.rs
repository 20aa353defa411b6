//! The TCP store's client.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::protocol::{
    read_frame, write_frame, Request, Response, StoreHello, MAX_HELLO, MAX_STORE_MESSAGE,
    STORE_MAGIC, STORE_VERSION,
};
use super::Store;
use crate::auth::JobKey;
use crate::error::{Error, Result};

/// A client of a [`StoreServer`](super::StoreServer).
pub struct TcpStore {
    addr: SocketAddr,
    conn: Mutex<TcpStream>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Connect to the store at `addr`, retrying until `timeout` (the server may start later).
    ///
    /// # Errors
    /// [`Error::Store`] when no server answers in time or the server refuses this client (world
    /// size disagreement, wrong token); the message says which.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        world: usize,
        key: Option<&JobKey>,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let deadline = Instant::now() + timeout;
        let err = |detail: String| Error::Store { addr: addr.to_string(), detail };
        let mut backoff = Duration::from_millis(5);
        let mut s = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) => {
                    if Instant::now() + backoff >= deadline {
                        return Err(err(format!(
                            "no store answered within {timeout:?} ({e}); is rank 0 running and \
                             are MASTER_ADDR/MASTER_PORT right?"
                        )));
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
        };
        let io = |e: std::io::Error| err(format!("handshake with the store failed: {e}"));
        s.set_nodelay(true).map_err(io)?;
        s.set_read_timeout(Some(timeout.max(Duration::from_secs(1)))).map_err(io)?;
        let mut nonce = [0u8; 16];
        s.read_exact(&mut nonce).map_err(io)?;
        let (r, w) = (rank as u32, world as u32);
        let hello = StoreHello {
            magic: STORE_MAGIC,
            version: STORE_VERSION,
            rank: r,
            world: w,
            mac: key.map(|k| k.mac(&[b"store", &nonce, &r.to_le_bytes(), &w.to_le_bytes()])),
        };
        write_frame(&mut s, &hello).map_err(io)?;
        let body = read_frame(&mut s, MAX_HELLO).map_err(io)?;
        match postcard::from_bytes::<Response>(&body) {
            Ok(Response::Ok) => {}
            Ok(Response::Err(e)) => return Err(err(format!("store refused rank {rank}: {e}"))),
            _ => return Err(err("store sent a malformed answer".into())),
        }
        s.set_read_timeout(None).map_err(io)?;
        Ok(TcpStore { addr, conn: Mutex::new(s) })
    }

    fn call(&self, req: &Request, timeout: Duration) -> Result<Response> {
        let err = |detail: String| Error::Store { addr: self.addr.to_string(), detail };
        let mut s = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let io = |e: std::io::Error| err(format!("store connection failed (rank 0 died?): {e}"));
        s.set_read_timeout(Some(timeout.saturating_add(Duration::from_secs(10)))).map_err(io)?;
        write_frame(&mut s, req).map_err(io)?;
        let body = read_frame(&mut s, MAX_STORE_MESSAGE).map_err(io)?;
        postcard::from_bytes(&body).map_err(|e| err(format!("malformed store answer: {e}")))
    }
}

fn unexpected(addr: &SocketAddr, r: Response) -> Error {
    let detail = match r {
        Response::Err(e) => e,
        other => format!("unexpected store answer {other:?}"),
    };
    Error::Store { addr: addr.to_string(), detail }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Set { key: key.into(), value: value.to_vec() };
        match self.call(&req, Duration::ZERO)? {
            Response::Ok => Ok(()),
            r => Err(unexpected(&self.addr, r)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let req = Request::Get { key: key.into(), timeout_ms: timeout.as_millis() as u64 };
        match self.call(&req, timeout)? {
            Response::Value(v) => Ok(v),
            Response::Timeout => Err(Error::StoreTimeout {
                addr: self.addr.to_string(),
                key: key.into(),
                after: timeout,
            }),
            r => Err(unexpected(&self.addr, r)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.call(&Request::Add { key: key.into(), delta }, Duration::ZERO)? {
            Response::Int(n) => Ok(n),
            r => Err(unexpected(&self.addr, r)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        match self.call(&Request::Delete { key: key.into() }, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            r => Err(unexpected(&self.addr, r)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let req = Request::Check { keys: keys.iter().map(|k| k.to_string()).collect() };
        match self.call(&req, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            r => Err(unexpected(&self.addr, r)),
        }
    }

    fn describe(&self) -> String {
        format!("tcp://{}", self.addr)
    }
}
