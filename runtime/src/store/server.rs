//! The TCP store server: one thread accepts, one thread per connection serves.
//!
//! Bounded whatever clients do: at most [`MAX_UNAUTHENTICATED`] connections may be in their
//! hello at once (more are closed at once), each must finish it within the handshake deadline,
//! authenticated connections are capped by the world size, and the data held is capped per
//! client and in total ([`Quota`]).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::protocol::{
    decode_request, hello_proof, recv, send, Request, Response, Seal, Side, StoreHello,
    CLIENT_PROOF, HANDSHAKE_DEADLINE, MAX_HELLO, MAX_KEY, MAX_STORE_MESSAGE, MAX_VALUE,
    MESSAGE_DEADLINE, SERVER_PROOF, STORE_MAGIC, STORE_VERSION,
};
use crate::auth::{self, JobKey};
use crate::error::{Error, Result};
use crate::util::Slot;

/// Connections allowed in their hello at once; more are closed as soon as they are accepted.
pub const MAX_UNAUTHENTICATED: usize = 64;

/// Authenticated connections allowed at once, for a job of `world` ranks: every rank's client
/// and the transports' (a rank holds one), with room for a launcher's and tools'.
pub fn max_clients(world: usize) -> usize {
    world.saturating_mul(4).saturating_add(16)
}

/// What the store holds at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Keys in the store.
    pub keys: usize,
    /// Bytes of keys and values in the store.
    pub bytes: usize,
    /// Bytes of keys and values last written by one connection.
    pub per_client: usize,
}

impl Default for Quota {
    /// 65,536 keys, 64 MiB in all, 8 MiB per client; a rendezvous uses a few hundred bytes per
    /// rank.
    fn default() -> Quota {
        Quota { keys: 65_536, bytes: 64 << 20, per_client: 8 << 20 }
    }
}

struct Entry {
    value: Vec<u8>,
    owner: u64,
}

#[derive(Default)]
struct Data {
    map: HashMap<String, Entry>,
    bytes: usize,
    per_owner: HashMap<u64, usize>,
}

struct Shared {
    data: Mutex<Data>,
    cv: Condvar,
    quota: Quota,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Data> {
        self.data.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Insert `key` = `value` for `owner`, within the quotas.
    fn put(&self, d: &mut Data, key: String, value: Vec<u8>, owner: u64) -> Response {
        let size = key.len() + value.len();
        let old = d.map.get(&key).map(|e| (key.len() + e.value.len(), e.owner));
        let freed = old.map_or(0, |(n, _)| n);
        if old.is_none() && d.map.len() >= self.quota.keys {
            return Response::Err(format!("store full: {} keys", self.quota.keys));
        }
        if d.bytes - freed + size > self.quota.bytes {
            return Response::Err(format!("store full: {} bytes", self.quota.bytes));
        }
        let mine = d.per_owner.get(&owner).copied().unwrap_or(0);
        let mine_after = mine - if old.is_some_and(|(_, o)| o == owner) { freed } else { 0 } + size;
        if mine_after > self.quota.per_client {
            return Response::Err(format!(
                "this client's store quota of {} bytes is used up",
                self.quota.per_client
            ));
        }
        if let Some((n, o)) = old {
            if let Some(b) = d.per_owner.get_mut(&o) {
                *b -= n;
            }
        }
        *d.per_owner.entry(owner).or_insert(0) += size;
        d.bytes = d.bytes - freed + size;
        d.map.insert(key, Entry { value, owner });
        self.cv.notify_all();
        Response::Ok
    }

    fn serve(&self, req: Request, owner: u64) -> Response {
        let too_long = |k: &str| k.len() > MAX_KEY;
        match req {
            Request::Set { key, value } => {
                if too_long(&key) || value.len() > MAX_VALUE {
                    return Response::Err(format!(
                        "key or value too large (limits {MAX_KEY} and {MAX_VALUE} bytes)"
                    ));
                }
                let mut d = self.lock();
                self.put(&mut d, key, value, owner)
            }
            Request::Get { key, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(1 << 40));
                let mut d = self.lock();
                loop {
                    if let Some(e) = d.map.get(&key) {
                        return Response::Value(e.value.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Response::Timeout;
                    }
                    d = self
                        .cv
                        .wait_timeout(d, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            Request::Add { key, delta } => {
                if too_long(&key) {
                    return Response::Err(format!("key too long (limit {MAX_KEY} bytes)"));
                }
                let mut d = self.lock();
                let cur = match d.map.get(&key) {
                    None => 0,
                    Some(e) => {
                        match std::str::from_utf8(&e.value).ok().and_then(|s| s.parse::<i64>().ok())
                        {
                            Some(n) => n,
                            None => return Response::Err(format!("key {key:?} is not an integer")),
                        }
                    }
                };
                let new = cur.wrapping_add(delta);
                match self.put(&mut d, key, new.to_string().into_bytes(), owner) {
                    Response::Ok => Response::Int(new),
                    refused => refused,
                }
            }
            Request::Delete { key } => {
                let mut d = self.lock();
                match d.map.remove(&key) {
                    Some(e) => {
                        let n = key.len() + e.value.len();
                        d.bytes -= n;
                        if let Some(b) = d.per_owner.get_mut(&e.owner) {
                            *b -= n;
                        }
                        Response::Bool(true)
                    }
                    None => Response::Bool(false),
                }
            }
            Request::Check { keys } => {
                let d = self.lock();
                Response::Bool(keys.iter().all(|k| d.map.contains_key(k)))
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
        Self::serve_with(listener, world, key, Quota::default())
    }

    /// Serve on an already bound listener, holding at most `quota`.
    ///
    /// # Errors
    /// [`Error::Io`] when the listener cannot be configured.
    pub fn serve_with(
        listener: TcpListener,
        world: usize,
        key: Option<JobKey>,
        quota: Quota,
    ) -> Result<StoreServer> {
        let addr = listener.local_addr().map_err(|e| Error::io(0, "store address", &e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(0, "store listener", &e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared =
            Arc::new(Shared { data: Mutex::new(Data::default()), cv: Condvar::new(), quota });
        // This store tells who is connected (see `PRESENT`).
        shared.serve(Request::Set { key: PRESENCE.into(), value: b"1".to_vec() }, u64::MAX);
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
    let hello = Arc::new(AtomicUsize::new(0));
    let clients = Arc::new(AtomicUsize::new(0));
    let next_id = AtomicU64::new(0);
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, peer)) => {
                let Some(slot) = Slot::take(&hello, MAX_UNAUTHENTICATED) else {
                    debug!(%peer, "store: {MAX_UNAUTHENTICATED} connections already in their hello; closed");
                    drop(s);
                    continue;
                };
                let (shared, key, stop, clients) =
                    (shared.clone(), key.clone(), stop.clone(), clients.clone());
                let id = next_id.fetch_add(1, Ordering::Relaxed);
                let spawned =
                    std::thread::Builder::new().name("tutti-store-conn".into()).spawn(move || {
                        let conn = Conn { world, key: key.as_ref(), shared: &shared, stop: &stop };
                        if let Err(e) = conn.serve(s, slot, &clients, id) {
                            warn!(%peer, "store connection dropped: {e}");
                        }
                    });
                if let Err(e) = spawned {
                    warn!("store: cannot start a connection thread: {e}");
                }
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

struct Conn<'a> {
    world: usize,
    key: Option<&'a JobKey>,
    shared: &'a Shared,
    stop: &'a AtomicBool,
}

impl Conn<'_> {
    fn serve(
        &self,
        mut s: TcpStream,
        hello_slot: Slot,
        clients: &Arc<AtomicUsize>,
        id: u64,
    ) -> std::result::Result<(), String> {
        let deadline = Instant::now() + HANDSHAKE_DEADLINE;
        s.set_nonblocking(false).map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(HANDSHAKE_DEADLINE)).map_err(|e| e.to_string())?;
        let nonce_s = auth::random::<16>()?;
        std::io::Write::write_all(&mut s, &nonce_s).map_err(|e| e.to_string())?;
        let body =
            recv(&mut s, None, MAX_HELLO, deadline).map_err(|e| format!("no valid hello: {e}"))?;
        let hello: StoreHello =
            postcard::from_bytes(&body).map_err(|e| format!("malformed hello: {e}"))?;
        let verdict = check_hello(&hello, self.world, self.key, &nonce_s);
        let slot = match verdict {
            Ok(()) => Slot::take(clients, max_clients(self.world)).ok_or_else(|| {
                format!("more than {} store clients at once", max_clients(self.world))
            }),
            Err(e) => Err(e),
        };
        let slot = match slot {
            Ok(slot) => slot,
            Err(e) => {
                let _ = send(&mut s, None, &Response::Err(e.clone()));
                return Err(format!("refused a client: {e}"));
            }
        };
        drop(hello_slot);
        let proof = self.key.map(|k| hello_proof(k, SERVER_PROOF, &nonce_s, &hello));
        send(&mut s, None, &Response::Welcome(proof)).map_err(|e| e.to_string())?;
        let mut seal = self.key.map(|k| Seal::new(k.clone(), &nonce_s, &hello.nonce, Side::Server));
        let _slot = slot;
        // Count this rank's open connections while they last: a rank whose process died has
        // none (the kernel closes its sockets), which its survivors can read.
        let present = format!("{PRESENT}{}", hello.rank);
        self.shared.serve(Request::Add { key: present.clone(), delta: 1 }, id);
        let _gone = Leave(|| {
            self.shared.serve(Request::Add { key: present.clone(), delta: -1 }, id);
        });
        // Requests may legitimately wait long (a get with a long timeout), so wait for the next
        // one in slices, checking for stop; a message, once begun, must arrive whole in time.
        s.set_write_timeout(Some(MESSAGE_DEADLINE)).map_err(|e| e.to_string())?;
        loop {
            while !crate::util::wait_readable(s.as_raw_fd(), Duration::from_millis(200)) {
                if self.stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
            }
            let body = match recv(
                &mut s,
                seal.as_mut(),
                MAX_STORE_MESSAGE,
                Instant::now() + MESSAGE_DEADLINE,
            ) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(format!("bad request from rank {}: {e}", hello.rank)),
            };
            let resp = match decode_request(&body) {
                Ok(req) => self.shared.serve(req, id),
                Err(e) => {
                    let _ = send(&mut s, seal.as_mut(), &Response::Err(e.clone()));
                    return Err(e);
                }
            };
            send(&mut s, seal.as_mut(), &resp).map_err(|e| e.to_string())?;
        }
    }
}

/// Set in a store that counts each rank's open connections under [`PRESENT`].
pub const PRESENCE: &str = "tutti/presence";
/// `PRESENT` + rank: how many connections that rank has open to this store now.
pub const PRESENT: &str = "tutti/present/";

/// Runs its closure when dropped (a connection's end, however it ends).
struct Leave<F: FnMut()>(F);

impl<F: FnMut()> Drop for Leave<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

fn check_hello(
    h: &StoreHello,
    world: usize,
    key: Option<&JobKey>,
    nonce_s: &[u8; 16],
) -> std::result::Result<(), String> {
    if h.magic != STORE_MAGIC {
        return Err("not a tutti store client".into());
    }
    if h.version != STORE_VERSION {
        return Err(format!("store protocol version {} differs from {STORE_VERSION}", h.version));
    }
    // Authentication first: a client without the job key learns nothing about the job.
    if let Some(k) = key {
        let ok = h.mac.is_some_and(|m| auth::ct_eq(&hello_proof(k, CLIENT_PROOF, nonce_s, h), &m));
        if !ok {
            return Err("authentication failed: wrong or missing job secret (TUTTI_TOKEN); a \
                        process of another job?"
                .into());
        }
    } else if h.mac.is_some() {
        return Err("this store runs without a job secret but the client has one: set the same \
                    TUTTI_TOKEN on every rank"
            .into());
    }
    if h.world as usize != world {
        return Err(format!(
            "world size disagreement: rank {} says WORLD_SIZE={} but the store was started \
             with WORLD_SIZE={world}; is another job using this MASTER_PORT?",
            h.rank, h.world
        ));
    }
    if h.rank as usize >= world {
        return Err(format!("rank {} is outside the world of {world}", h.rank));
    }
    Ok(())
}
