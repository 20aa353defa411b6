//! The TCP store's client.

use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::protocol::{
    hello_proof, recv, send, Request, Response, Seal, Side, StoreHello, CLIENT_PROOF, GET_ALL_KEYS,
    HANDSHAKE_DEADLINE, MAX_HELLO, MAX_STORE_MESSAGE, SERVER_PROOF, STORE_MAGIC, STORE_VERSION,
    TOO_LARGE,
};
use super::Store;
use crate::auth::{self, JobKey};
use crate::error::{Error, Result};
use crate::util::read_exact_by;

/// A client of a [`StoreServer`](super::StoreServer).
pub struct TcpStore {
    addr: SocketAddr,
    conn: Mutex<(TcpStream, Option<Seal>)>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Connect to the store at `addr`, retrying until `timeout` (the server may start later).
    /// With a `key`, the server must prove it holds the same one, and every later answer is
    /// checked against its tag.
    ///
    /// # Errors
    /// [`Error::Store`] when no server answers in time, the server refuses this client (world
    /// size disagreement, wrong secret), or the server cannot prove the job key (not this job's
    /// store, or something between us rewrote its answer); the message says which.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        world: usize,
        key: Option<&JobKey>,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(5);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt =
                match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
                    Ok(s) => hello(s, addr, rank, world, key),
                    Err(e) => Err(Attempt::Retry(store_err(
                        addr,
                        format!(
                        "no store answered within {timeout:?} ({e}); is rank 0 running and are \
                         MASTER_ADDR/MASTER_PORT right?"
                    ),
                    ))),
                };
            match attempt {
                Ok(conn) => return Ok(TcpStore { addr, conn: Mutex::new(conn) }),
                Err(Attempt::Final(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    if Instant::now() + backoff >= deadline {
                        return Err(e);
                    }
                }
            }
            // Exponential, with jitter: a whole job's ranks retrying a store that is not up yet
            // (or whose backlog overflowed) spread out.
            std::thread::sleep(crate::util::jitter(backoff));
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }

    fn call(&self, req: &Request, timeout: Duration) -> Result<Response> {
        let err = |detail: String| Error::Store { addr: self.addr.to_string(), detail };
        let mut g = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let (s, seal) = &mut *g;
        let io = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                err(format!("the store's answer failed its check: {e}"))
            } else {
                err(format!("store connection failed (rank 0 died?): {e}"))
            }
        };
        send(s, seal.as_mut(), req).map_err(io)?;
        let by = Instant::now()
            .checked_add(timeout.saturating_add(Duration::from_secs(10)))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 30));
        let body = recv(s, seal.as_mut(), MAX_STORE_MESSAGE, by).map_err(io)?;
        postcard::from_bytes(&body).map_err(|e| err(format!("malformed store answer: {e}")))
    }
}

/// How one connection attempt ended, when it did not connect.
enum Attempt {
    /// An answer: a refusal, a failed proof. Trying again would not change it.
    Final(Error),
    /// No server yet, or one too busy to greet us (it closes at once when
    /// `MAX_UNAUTHENTICATED` hellos are under way): try again until the deadline.
    Retry(Error),
}

fn store_err(addr: SocketAddr, detail: String) -> Error {
    Error::Store { addr: addr.to_string(), detail }
}

/// The hello exchange on a fresh connection.
fn hello(
    mut s: TcpStream,
    addr: SocketAddr,
    rank: usize,
    world: usize,
    key: Option<&JobKey>,
) -> std::result::Result<(TcpStream, Option<Seal>), Attempt> {
    let fail = |e: std::io::Error| {
        Attempt::Final(store_err(addr, format!("handshake with the store failed: {e}")))
    };
    s.set_nodelay(true).map_err(fail)?;
    s.set_write_timeout(Some(HANDSHAKE_DEADLINE)).map_err(fail)?;
    // The server's deadline for the whole hello is HANDSHAKE_DEADLINE; ours is a little longer,
    // so a slow server is told apart from a dead one by its own refusal.
    let hs_deadline = Instant::now() + HANDSHAKE_DEADLINE + Duration::from_secs(1);
    let mut nonce_s = [0u8; 16];
    read_exact_by(&mut s, &mut nonce_s, hs_deadline).map_err(|e| {
        Attempt::Retry(store_err(
            addr,
            format!("the store closed the connection before greeting us (busy?): {e}"),
        ))
    })?;
    let nonce = auth::random::<16>().map_err(|e| Attempt::Final(store_err(addr, e)))?;
    let mut hello = StoreHello {
        magic: STORE_MAGIC,
        version: STORE_VERSION,
        rank: rank as u32,
        world: world as u32,
        nonce,
        mac: None,
    };
    hello.mac = key.map(|k| hello_proof(k, CLIENT_PROOF, &nonce_s, &hello));
    send(&mut s, None, &hello).map_err(fail)?;
    let body = recv(&mut s, None, MAX_HELLO, hs_deadline).map_err(fail)?;
    let final_err = |d: String| Attempt::Final(store_err(addr, d));
    match postcard::from_bytes::<Response>(&body) {
        Ok(Response::Welcome(proof)) => {
            if let Some(k) = key {
                let want = hello_proof(k, SERVER_PROOF, &nonce_s, &hello);
                if !proof.is_some_and(|p| auth::ct_eq(&want, &p)) {
                    return Err(final_err(
                        "the store did not prove it holds the job secret: it is not this job's \
                         store, or something between us rewrote its answer; check \
                         MASTER_ADDR/MASTER_PORT and TUTTI_TOKEN"
                            .into(),
                    ));
                }
            }
        }
        Ok(Response::Err(e)) => return Err(final_err(format!("store refused rank {rank}: {e}"))),
        _ => return Err(final_err("store sent a malformed answer".into())),
    }
    let seal = key.map(|k| Seal::new(k.clone(), &nonce_s, &hello.nonce, Side::Client));
    s.set_write_timeout(Some(Duration::from_secs(10))).map_err(fail)?;
    Ok((s, seal))
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

    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        // In requests of at most GET_ALL_KEYS keys and 64 KiB of them, so that request and
        // answer stay within one store message for values of rendezvous size.
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(keys.len());
        let mut rest = keys;
        while !rest.is_empty() {
            let mut take = 0;
            let mut bytes = 0;
            while take < rest.len() && take < GET_ALL_KEYS && bytes + rest[take].len() <= 64 << 10 {
                bytes += rest[take].len();
                take += 1;
            }
            let (chunk, tail) = rest.split_at(take.max(1));
            out.extend(self.get_chunk(chunk, deadline)?);
            rest = tail;
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        format!("tcp://{}", self.addr)
    }
}

impl TcpStore {
    /// One get-all request for `keys`; halved and asked again while the values are too large
    /// for one answer.
    fn get_chunk(&self, keys: &[&str], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let timeout = deadline.saturating_duration_since(Instant::now());
        let req = Request::GetAll {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout_ms: timeout.as_millis() as u64,
        };
        match self.call(&req, timeout)? {
            Response::Values(v) if v.len() == keys.len() => Ok(v),
            Response::Err(e) if e.contains(TOO_LARGE) && keys.len() > 1 => {
                let (a, b) = keys.split_at(keys.len() / 2);
                let mut v = self.get_chunk(a, deadline)?;
                v.extend(self.get_chunk(b, deadline)?);
                Ok(v)
            }
            Response::TimeoutOn(missing) => Err(Error::StoreTimeout {
                addr: self.addr.to_string(),
                key: missing,
                after: timeout,
            }),
            r => Err(unexpected(&self.addr, r)),
        }
    }
}
