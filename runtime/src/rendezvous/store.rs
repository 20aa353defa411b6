//! Key-value stores for rendezvous: the [`Store`] trait, a TCP store served by rank 0, and a file
//! store for shared filesystems.
//!
//! Wire protocol of the TCP store: the server greets each connection with a 16-byte nonce; every
//! message after that is a little-endian `u32` length followed by that many bytes of postcard. The
//! client's first message is a [`StoreHello`] (with an HMAC of the nonce when the job has a
//! token); the server answers it, then serves one request at a time. Lengths are checked against
//! a limit before anything is allocated, so junk on the port costs nothing.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::auth::{self, JobKey};
use crate::error::{Error, Result};

/// Largest store message accepted (values included).
pub const MAX_STORE_MESSAGE: usize = 64 << 20;
/// Largest hello accepted.
const MAX_HELLO: usize = 1024;
const STORE_MAGIC: [u8; 8] = *b"TUTTISTR";
const STORE_VERSION: u16 = 1;

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

/// The client's first message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoreHello {
    /// `b"TUTTISTR"`.
    pub magic: [u8; 8],
    /// Protocol version.
    pub version: u16,
    /// Client's rank.
    pub rank: u32,
    /// Client's world size.
    pub world: u32,
    /// HMAC(key, "store" ‖ nonce ‖ rank ‖ world) when the job has a token.
    pub mac: Option<[u8; 32]>,
}

/// A store request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
    /// Set a key.
    Set {
        /// Key.
        key: String,
        /// Value.
        value: Vec<u8>,
    },
    /// Get a key, waiting up to `timeout_ms`.
    Get {
        /// Key.
        key: String,
        /// Wait limit.
        timeout_ms: u64,
    },
    /// Add to an integer key.
    Add {
        /// Key.
        key: String,
        /// Increment.
        delta: i64,
    },
    /// Delete a key.
    Delete {
        /// Key.
        key: String,
    },
    /// Are all keys set?
    Check {
        /// Keys.
        keys: Vec<String>,
    },
}

/// A store response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[non_exhaustive]
pub enum Response {
    /// Done.
    Ok,
    /// A value.
    Value(Vec<u8>),
    /// An integer.
    Int(i64),
    /// A yes/no answer.
    Bool(bool),
    /// The wait timed out.
    Timeout,
    /// The request failed.
    Err(String),
}

/// Decode one store message body. Never panics; this is the entry point fuzzing uses.
///
/// # Errors
/// A description of what is malformed.
pub fn decode_request(body: &[u8]) -> std::result::Result<Request, String> {
    postcard::from_bytes(body).map_err(|e| format!("malformed store request: {e}"))
}

fn write_frame(s: &mut TcpStream, v: &impl Serialize) -> std::io::Result<()> {
    let body = postcard::to_stdvec(v)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    s.write_all(&buf)
}

fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("message of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(body)
}

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn serve(&self, req: Request) -> Response {
        match req {
            Request::Set { key, value } => {
                self.lock().insert(key, value);
                self.cv.notify_all();
                Response::Ok
            }
            Request::Get { key, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms);
                let mut m = self.lock();
                loop {
                    if let Some(v) = m.get(&key) {
                        return Response::Value(v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Response::Timeout;
                    }
                    m = self
                        .cv
                        .wait_timeout(m, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            Request::Add { key, delta } => {
                let mut m = self.lock();
                let cur = match m.get(&key) {
                    None => 0,
                    Some(v) => {
                        match std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()) {
                            Some(n) => n,
                            None => return Response::Err(format!("key {key:?} is not an integer")),
                        }
                    }
                };
                let new = cur.wrapping_add(delta);
                m.insert(key, new.to_string().into_bytes());
                drop(m);
                self.cv.notify_all();
                Response::Int(new)
            }
            Request::Delete { key } => Response::Bool(self.lock().remove(&key).is_some()),
            Request::Check { keys } => {
                let m = self.lock();
                Response::Bool(keys.iter().all(|k| m.contains_key(k)))
            }
        }
    }
}

/// The TCP store server (rank 0 runs one). Stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Bind `addr` and serve a job of `world` ranks. `key`, when given, is required of clients.
    ///
    /// # Errors
    /// [`Error::Io`] when the port is taken (another job on this master port?) or cannot be bound.
    pub fn start(addr: SocketAddr, world: usize, key: Option<JobKey>) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::Io {
            rank: 0,
            what: format!(
                "binding the store on {addr} (MASTER_PORT in use by another job or process?)"
            ),
            detail: e.to_string(),
        })?;
        Self::serve(listener, world, key)
    }

    /// Serve on an already bound listener.
    ///
    /// # Errors
    /// [`Error::Io`] when the listener cannot be configured.
    pub fn serve(listener: TcpListener, world: usize, key: Option<JobKey>) -> Result<StoreServer> {
        let addr = listener.local_addr().map_err(|e| Error::io(0, "store address", &e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(0, "store listener", &e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::default());
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tutti-store".into())
            .spawn(move || accept_loop(listener, world, key, shared, stop2))
            .map_err(|e| Error::io(0, "spawning the store thread", &e))?;
        debug!(%addr, world, "store serving");
        Ok(StoreServer { addr, stop, thread: Some(thread) })
    }

    /// The address the store listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    world: usize,
    key: Option<JobKey>,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, peer)) => {
                let (shared, key, stop) = (shared.clone(), key.clone(), stop.clone());
                let _ =
                    std::thread::Builder::new().name("tutti-store-conn".into()).spawn(move || {
                        if let Err(e) = serve_conn(s, world, key.as_ref(), &shared, &stop) {
                            warn!(%peer, "store connection dropped: {e}");
                        }
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                crate::util::wait_readable(listener.as_raw_fd(), Duration::from_millis(100));
            }
            Err(e) => {
                warn!("store accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve_conn(
    mut s: TcpStream,
    world: usize,
    key: Option<&JobKey>,
    shared: &Shared,
    stop: &AtomicBool,
) -> std::result::Result<(), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let nonce = auth::random::<16>()?;
    s.write_all(&nonce).map_err(|e| e.to_string())?;
    let body = read_frame(&mut s, MAX_HELLO).map_err(|e| format!("no valid hello: {e}"))?;
    let hello: StoreHello =
        postcard::from_bytes(&body).map_err(|e| format!("malformed hello: {e}"))?;
    let verdict = check_hello(&hello, world, key, &nonce);
    let ok = verdict.is_ok();
    let resp = match verdict {
        Ok(()) => Response::Ok,
        Err(e) => Response::Err(e),
    };
    write_frame(&mut s, &resp).map_err(|e| e.to_string())?;
    if !ok {
        return Err(format!("refused client claiming rank {}", hello.rank));
    }
    // Requests may legitimately wait long (a get with a long timeout), so poll for stop instead
    // of a read timeout.
    s.set_read_timeout(Some(Duration::from_millis(200))).map_err(|e| e.to_string())?;
    loop {
        let mut len = [0u8; 4];
        match s.read_exact(&mut len) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                continue;
            }
            Err(_) => return Ok(()), // client went away
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_STORE_MESSAGE {
            return Err(format!("request of {len} bytes exceeds the limit"));
        }
        let mut body = vec![0u8; len];
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        s.read_exact(&mut body).map_err(|e| format!("truncated request: {e}"))?;
        s.set_read_timeout(Some(Duration::from_millis(200))).map_err(|e| e.to_string())?;
        let resp = match decode_request(&body) {
            Ok(req) => shared.serve(req),
            Err(e) => {
                let _ = write_frame(&mut s, &Response::Err(e.clone()));
                return Err(e);
            }
        };
        write_frame(&mut s, &resp).map_err(|e| e.to_string())?;
    }
}

fn check_hello(
    h: &StoreHello,
    world: usize,
    key: Option<&JobKey>,
    nonce: &[u8; 16],
) -> std::result::Result<(), String> {
    if h.magic != STORE_MAGIC {
        return Err("not a tutti store client".into());
    }
    if h.version != STORE_VERSION {
        return Err(format!("store protocol version {} differs from {STORE_VERSION}", h.version));
    }
    if h.world as usize != world {
        return Err(format!(
            "world size disagreement: rank {} says WORLD_SIZE={} but the store (rank 0) was \
             started with WORLD_SIZE={world}; is another job using this MASTER_PORT?",
            h.rank, h.world
        ));
    }
    if h.rank as usize >= world {
        return Err(format!("rank {} is outside the world of {world}", h.rank));
    }
    if let Some(k) = key {
        let ok = h.mac.is_some_and(|m| {
            k.verify(&[b"store", nonce, &h.rank.to_le_bytes(), &h.world.to_le_bytes()], &m)
        });
        if !ok {
            return Err("authentication failed: wrong or missing TUTTI_TOKEN \
                        (a process of another job?)"
                .into());
        }
    }
    Ok(())
}

/// A client of a [`StoreServer`].
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
        s.set_read_timeout(Some(timeout + Duration::from_secs(10))).map_err(io)?;
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

/// A store in a directory of a shared filesystem: one file per key, written atomically.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Use (and create) `dir`.
    ///
    /// # Errors
    /// [`Error::Store`] when the directory cannot be created.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::Store {
            addr: dir.display().to_string(),
            detail: format!("cannot create the store directory: {e}"),
        })?;
        Ok(FileStore { dir })
    }

    fn path(&self, key: &str) -> PathBuf {
        // Keys may hold '/', so encode them as hex to get one flat, safe file name.
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("k{name}"))
    }

    fn err(&self, detail: String) -> Error {
        Error::Store { addr: self.dir.display().to_string(), detail }
    }

    fn write_atomic(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            auth::random::<8>()
                .map_err(|e| self.err(e))?
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ));
        std::fs::write(&tmp, value).map_err(|e| self.err(format!("writing {key:?}: {e}")))?;
        std::fs::rename(&tmp, &path).map_err(|e| self.err(format!("renaming {key:?}: {e}")))
    }

    fn with_lock<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        use std::os::fd::AsRawFd;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join(".lock"))
            .map_err(|e| self.err(format!("opening the lock file: {e}")))?;
        // SAFETY: flock on a descriptor we own; released when `lock` is closed.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(self.err(format!("locking: {}", std::io::Error::last_os_error())));
        }
        f()
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_atomic(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            match std::fs::read(self.path(key)) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.err(format!("reading {key:?}: {e}"))),
            }
            if Instant::now() >= deadline {
                return Err(Error::StoreTimeout {
                    addr: self.describe(),
                    key: key.into(),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.with_lock(|| {
            let cur = match std::fs::read(self.path(key)) {
                Ok(v) => std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| self.err(format!("key {key:?} is not an integer")))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                Err(e) => return Err(self.err(format!("reading {key:?}: {e}"))),
            };
            let new = cur.wrapping_add(delta);
            self.write_atomic(key, new.to_string().as_bytes())?;
            Ok(new)
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        match std::fs::remove_file(self.path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.err(format!("deleting {key:?}: {e}"))),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        Ok(keys.iter().all(|k| self.path(k).exists()))
    }

    fn describe(&self) -> String {
        format!("file://{}", self.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn request_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode_request(&bytes);
            crate::fuzzing::store_request(&bytes);
            crate::fuzzing::handshake(&bytes);
            crate::fuzzing::wire_header(&bytes);
        }

        #[test]
        fn requests_round_trip(key in "[a-z/0-9]{0,40}", value in proptest::collection::vec(any::<u8>(), 0..100), delta in any::<i64>()) {
            for req in [
                Request::Set { key: key.clone(), value: value.clone() },
                Request::Get { key: key.clone(), timeout_ms: 5 },
                Request::Add { key: key.clone(), delta },
                Request::Delete { key: key.clone() },
                Request::Check { keys: vec![key.clone(), key.clone()] },
            ] {
                let body = postcard::to_stdvec(&req).unwrap();
                prop_assert_eq!(decode_request(&body), Ok(req));
            }
        }
    }

    fn server(world: usize, key: Option<JobKey>) -> StoreServer {
        StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), world, key).unwrap()
    }

    #[test]
    fn sixty_four_concurrent_clients() {
        let n = 64;
        let key = JobKey::from_token("t");
        let srv = server(n, Some(key.clone()));
        let addr = srv.addr();
        std::thread::scope(|s| {
            for r in 0..n {
                let key = key.clone();
                s.spawn(move || {
                    let c =
                        TcpStore::connect(addr, r, n, Some(&key), Duration::from_secs(30)).unwrap();
                    c.set(&format!("k{r}"), &[r as u8; 3]).unwrap();
                    assert!(c.add("counter", 1).unwrap() >= 1);
                    // Everyone waits for everyone's key.
                    let other = (r * 7 + 1) % n;
                    let v = c.get(&format!("k{other}"), Duration::from_secs(30)).unwrap();
                    assert_eq!(v, vec![other as u8; 3]);
                });
            }
        });
        let c = TcpStore::connect(addr, 0, n, Some(&key), Duration::from_secs(5)).unwrap();
        assert_eq!(c.add("counter", 0).unwrap(), n as i64);
        let keys: Vec<String> = (0..n).map(|r| format!("k{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        assert!(c.check(&refs).unwrap());
        c.wait(&refs, Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn missing_key_times_out_naming_it() {
        let srv = server(1, None);
        let c = TcpStore::connect(srv.addr(), 0, 1, None, Duration::from_secs(5)).unwrap();
        let start = Instant::now();
        let e = c.get("nope", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("nope"), "{e}");
        assert!(start.elapsed() >= Duration::from_millis(200));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(!c.check(&["nope"]).unwrap());
        assert!(!c.delete("nope").unwrap());
        c.set("x", b"1").unwrap();
        assert!(c.delete("x").unwrap());
        c.set("s", b"text").unwrap();
        assert!(c.add("s", 1).unwrap_err().to_string().contains("not an integer"));
    }

    #[test]
    fn wait_is_woken_by_a_later_set() {
        let srv = server(2, None);
        let addr = srv.addr();
        std::thread::scope(|s| {
            s.spawn(move || {
                let c = TcpStore::connect(addr, 1, 2, None, Duration::from_secs(5)).unwrap();
                c.wait(&["late"], Duration::from_secs(20)).unwrap();
            });
            std::thread::sleep(Duration::from_millis(100));
            let c = TcpStore::connect(addr, 0, 2, None, Duration::from_secs(5)).unwrap();
            c.set("late", b"").unwrap();
        });
    }

    #[test]
    fn refuses_wrong_world_and_wrong_token() {
        let key = JobKey::from_token("right");
        let srv = server(4, Some(key.clone()));
        let e =
            TcpStore::connect(srv.addr(), 1, 3, Some(&key), Duration::from_secs(5)).unwrap_err();
        assert!(
            e.to_string().contains("WORLD_SIZE=3") && e.to_string().contains("WORLD_SIZE=4"),
            "{e}"
        );
        let bad = JobKey::from_token("wrong");
        let e =
            TcpStore::connect(srv.addr(), 1, 4, Some(&bad), Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("TUTTI_TOKEN"), "{e}");
        let e = TcpStore::connect(srv.addr(), 1, 4, None, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("authentication"), "{e}");
    }

    #[test]
    fn junk_on_the_store_port_is_dropped() {
        // The server sends its 16-byte nonce, then drops a connection whose hello is oversized
        // at once and one whose hello never completes after its 5 s hello deadline. "Closed"
        // means end of file or a reset seen well before our own 12 s read timeout, which counts
        // as a failure: a store that leaves junk connections open fails this test.
        let srv = server(1, None);
        for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xff; 64][..], &[0x16, 0x03, 0x01][..]] {
            let mut s = TcpStream::connect(srv.addr()).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(12))).unwrap();
            let start = Instant::now();
            let _ = s.write_all(junk);
            let mut b = [0u8; 256];
            let mut outcome = None;
            for _ in 0..10 {
                match s.read(&mut b) {
                    Ok(0) => outcome = Some("end of file".to_string()),
                    Ok(_) => continue,
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        panic!("junk {junk:?}: connection still open after {:?}", start.elapsed())
                    }
                    Err(e) => outcome = Some(e.to_string()),
                }
                break;
            }
            assert!(outcome.is_some(), "junk {junk:?}: the server kept talking");
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "junk {junk:?}: closed only after {:?} (hello deadline 5 s)",
                start.elapsed()
            );
        }
        let c = TcpStore::connect(srv.addr(), 0, 1, None, Duration::from_secs(5)).unwrap();
        c.set("still", b"fine").unwrap();
        assert_eq!(c.get("still", Duration::from_secs(1)).unwrap(), b"fine");
    }

    #[test]
    fn two_jobs_on_one_master_port_are_reported() {
        let first = server(2, None);
        let e = StoreServer::start(first.addr(), 2, None).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT in use by another job"), "{e}");
    }

    #[test]
    fn no_server_fails_in_time() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let start = Instant::now();
        let e = TcpStore::connect(addr, 1, 2, None, Duration::from_millis(300)).unwrap_err();
        assert!(e.to_string().contains("rank 0"), "{e}");
        // It retries (backing off up to 200 ms) until its deadline, then gives up; a wide margin
        // above for a loaded machine.
        assert!(start.elapsed() >= Duration::from_millis(100), "gave up early: {e}");
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    }

    #[test]
    fn file_store() {
        let dir = std::env::temp_dir().join(format!("tutti-fs-{}", std::process::id()));
        let s = FileStore::new(&dir).unwrap();
        s.set("a/b", b"v").unwrap();
        assert_eq!(s.get("a/b", Duration::from_millis(10)).unwrap(), b"v");
        assert!(s.get("zz", Duration::from_millis(30)).unwrap_err().to_string().contains("zz"));
        std::thread::scope(|sc| {
            for _ in 0..8 {
                let s = s.clone();
                sc.spawn(move || {
                    for _ in 0..10 {
                        s.add("n", 1).unwrap();
                    }
                });
            }
        });
        assert_eq!(s.add("n", 0).unwrap(), 80);
        assert!(s.check(&["a/b", "n"]).unwrap());
        assert!(s.delete("a/b").unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
