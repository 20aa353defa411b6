//! The TCP store server: one thread accepts, one thread per connection serves.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::protocol::{
    decode_request, read_frame, write_frame, Request, Response, StoreHello, MAX_HELLO,
    MAX_STORE_MESSAGE, STORE_MAGIC, STORE_VERSION,
};
use crate::auth::{self, JobKey};
use crate::error::{Error, Result};

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
    // Authentication first: a client without the job key learns nothing about the job.
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
    Ok(())
}
