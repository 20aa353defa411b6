//! The TCP store server: one thread runs an event loop (epoll) over the listener and every
//! connection; no thread per connection.
//!
//! Each connection is a small state machine: the server's nonce goes out on accept; the hello
//! must arrive whole within [`HANDSHAKE_DEADLINE`]; then requests are answered one at a time in
//! order (a client waits for each answer), a waiting get parks the connection until its key is
//! set or its deadline passes. Bounded whatever clients do:
//! - at most [`MAX_UNAUTHENTICATED`] connections may be in their hello at once (more are closed
//!   as soon as they are accepted), and each must finish it within the handshake deadline;
//! - authenticated connections are capped by the world size ([`max_clients`]);
//! - a message must arrive whole within [`MESSAGE_DEADLINE`] of its first byte, and its length
//!   is checked before anything is allocated for it; a connection holds at most one message in
//!   and one answer out (the next request is not read until the answer is taken), and an answer
//!   not taken within the message deadline closes the connection;
//! - the data held is capped per client and in total ([`Quota`]).
//!
//! The listener's backlog is sized for the world (at least 1,024), so the kernel does not refuse
//! a start-up storm of connections before the loop accepts them; accepted ones beyond the
//! connections in their hello are closed at once, and clients retry with backoff.

use std::collections::{BinaryHeap, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::protocol::{
    announced, decode_request, frame, hello_proof, open, Request, Response, Seal, Side, StoreHello,
    CLIENT_PROOF, GET_ALL_KEYS, HANDSHAKE_DEADLINE, MAX_HELLO, MAX_KEY, MAX_STORE_MESSAGE,
    MAX_VALUE, MESSAGE_DEADLINE, SERVER_PROOF, STORE_MAGIC, STORE_VERSION, TOO_LARGE,
};
use crate::auth::{self, JobKey};
use crate::error::{Error, Result};

/// Connections allowed in their hello at once; more are closed as soon as they are accepted.
pub const MAX_UNAUTHENTICATED: usize = 64;

/// Authenticated connections allowed at once, for a job of `world` ranks: every rank's client
/// and the transports' (a rank holds one), with room for a launcher's and tools'.
pub fn max_clients(world: usize) -> usize {
    world.saturating_mul(4).saturating_add(16)
}

/// The listen backlog for a job of `world` ranks: room for every rank's first connection at
/// once (the kernel caps it at `net.core.somaxconn`).
fn backlog(world: usize) -> i32 {
    world.saturating_add(64).clamp(1024, 65_535) as i32
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

/// What a request needs: an answer now, or a wait for keys not set yet.
enum Applied {
    Now(Response),
    /// Wait for `keys` (one for a get, several for a get-all) until `deadline`.
    Wait {
        keys: Vec<String>,
        all: bool,
        deadline: Instant,
    },
}

/// The store's contents and what they may grow to.
struct Db {
    data: Data,
    quota: Quota,
}

impl Db {
    /// Insert `key` = `value` for `owner`, within the quotas.
    fn put(&mut self, key: String, value: Vec<u8>, owner: u64) -> Response {
        let d = &mut self.data;
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
        Response::Ok
    }

    /// The first of `keys` not set: what a wait on them is woken by next.
    fn first_missing(&self, keys: &[String]) -> Option<String> {
        keys.iter().find(|k| !self.data.map.contains_key(*k)).cloned()
    }

    /// The answer to a wait on `keys` if it can be given now.
    fn ready(&self, keys: &[String], all: bool) -> Option<Response> {
        if all {
            // Every key set, and the answer within one message, before anything is copied.
            let mut size = 64;
            for k in keys {
                // Each value costs its bytes and at most 10 of length in the answer.
                size += self.data.map.get(k)?.value.len() + 10;
            }
            if size > MAX_STORE_MESSAGE {
                return Some(Response::Err(format!(
                    "the {} values asked for take {size} bytes, more than one store message \
                     ({MAX_STORE_MESSAGE}); {TOO_LARGE}",
                    keys.len()
                )));
            }
            let vals = keys.iter().filter_map(|k| self.data.map.get(k)).map(|e| e.value.clone());
            Some(Response::Values(vals.collect()))
        } else {
            keys.first()
                .and_then(|k| self.data.map.get(k))
                .map(|e| Response::Value(e.value.clone()))
        }
    }

    /// Apply `req` from connection `owner`; the key it set, if it set one.
    fn apply(&mut self, req: Request, owner: u64) -> (Applied, Option<String>) {
        let too_long = |k: &str| k.len() > MAX_KEY;
        let now = |r| (Applied::Now(r), None);
        match req {
            Request::Set { key, value } => {
                if too_long(&key) || value.len() > MAX_VALUE {
                    return now(Response::Err(format!(
                        "key or value too large (limits {MAX_KEY} and {MAX_VALUE} bytes)"
                    )));
                }
                let r = self.put(key.clone(), value, owner);
                let set = matches!(r, Response::Ok).then_some(key);
                (Applied::Now(r), set)
            }
            Request::Get { key, timeout_ms } => self.wait(vec![key], false, timeout_ms),
            Request::GetAll { keys, timeout_ms } => {
                if keys.len() > GET_ALL_KEYS {
                    return now(Response::Err(format!(
                        "{} keys in one get-all; at most {GET_ALL_KEYS}",
                        keys.len()
                    )));
                }
                if keys.iter().any(|k| too_long(k)) {
                    return now(Response::Err(format!("key too long (limit {MAX_KEY} bytes)")));
                }
                self.wait(keys, true, timeout_ms)
            }
            Request::Add { key, delta } => {
                if too_long(&key) {
                    return now(Response::Err(format!("key too long (limit {MAX_KEY} bytes)")));
                }
                let cur = match self.data.map.get(&key) {
                    None => 0,
                    Some(e) => {
                        match std::str::from_utf8(&e.value).ok().and_then(|s| s.parse::<i64>().ok())
                        {
                            Some(n) => n,
                            None => {
                                return now(Response::Err(format!("key {key:?} is not an integer")))
                            }
                        }
                    }
                };
                let new = cur.wrapping_add(delta);
                match self.put(key.clone(), new.to_string().into_bytes(), owner) {
                    Response::Ok => (Applied::Now(Response::Int(new)), Some(key)),
                    refused => now(refused),
                }
            }
            Request::Delete { key } => {
                let d = &mut self.data;
                now(match d.map.remove(&key) {
                    Some(e) => {
                        let n = key.len() + e.value.len();
                        d.bytes -= n;
                        if let Some(b) = d.per_owner.get_mut(&e.owner) {
                            *b -= n;
                        }
                        Response::Bool(true)
                    }
                    None => Response::Bool(false),
                })
            }
            Request::Check { keys } => {
                now(Response::Bool(keys.iter().all(|k| self.data.map.contains_key(k))))
            }
        }
    }

    fn wait(&self, keys: Vec<String>, all: bool, timeout_ms: u64) -> (Applied, Option<String>) {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(1 << 40));
        match self.ready(&keys, all) {
            Some(r) => (Applied::Now(r), None),
            None => (Applied::Wait { keys, all, deadline }, None),
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
    /// [`Error::Io`] when the listener or the event loop cannot be set up.
    pub fn serve_with(
        listener: TcpListener,
        world: usize,
        key: Option<JobKey>,
        quota: Quota,
    ) -> Result<StoreServer> {
        let addr = listener.local_addr().map_err(|e| Error::io(0, "store address", &e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(0, "store listener", &e))?;
        // Listening again only resizes the queue of connections waiting to be accepted.
        socket2::SockRef::from(&listener)
            .listen(backlog(world))
            .map_err(|e| Error::io(0, "store listener backlog", &e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut db = Db { data: Data::default(), quota };
        // This store tells who is connected (see `PRESENT`).
        db.put(PRESENCE.into(), b"1".to_vec(), u64::MAX);
        let ev = Epoll::new().map_err(|e| Error::io(0, "store event loop", &e))?;
        ev.add(listener.as_raw_fd(), LISTENER, libc::EPOLLIN as u32)
            .map_err(|e| Error::io(0, "store event loop", &e))?;
        let mut server = Server {
            listener,
            ev,
            world,
            key,
            db,
            conns: HashMap::new(),
            waiters: HashMap::new(),
            timers: BinaryHeap::new(),
            in_hello: 0,
            clients: 0,
            next_id: 0,
            accept_paused: None,
            doomed: Vec::new(),
        };
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tutti-store".into())
            .spawn(move || server.run(&stop2))
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

/// The epoll token of the listener (connections use their id, which starts at 0 and never
/// reaches it).
const LISTENER: u64 = u64::MAX;
/// How often the loop looks at the stop flag when nothing happens.
const STOP_SLICE: Duration = Duration::from_millis(100);
/// Messages taken from one connection per readiness event.
const MESSAGES_PER_EVENT: usize = 16;

/// A level-triggered epoll instance.
struct Epoll(RawFd);

impl Epoll {
    fn new() -> std::io::Result<Epoll> {
        // SAFETY: a plain system call; the descriptor is owned by the returned value.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Epoll(fd))
    }

    fn ctl(&self, op: i32, fd: RawFd, token: u64, events: u32) -> std::io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` lives across the call; the kernel copies it.
        if unsafe { libc::epoll_ctl(self.0, op, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn add(&self, fd: RawFd, token: u64, events: u32) -> std::io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, token, events)
    }

    fn modify(&self, fd: RawFd, token: u64, events: u32) -> std::io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, token, events)
    }

    fn wait(&self, evs: &mut [libc::epoll_event], timeout: Duration) -> usize {
        // Rounded up: a wait shorter than a millisecond must not become a busy poll.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: `evs` is valid for `evs.len()` entries, which the kernel fills.
        let n = unsafe { libc::epoll_wait(self.0, evs.as_mut_ptr(), evs.len() as i32, ms) };
        usize::try_from(n).unwrap_or(0)
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Our nonce is out; the hello must arrive whole by the deadline.
    Hello { by: Instant },
    /// Authenticated: requests, one at a time.
    Serving,
    /// The last answer (a refusal) goes out, then the connection closes.
    Closing,
}

/// A parked request: the connection waits for keys.
struct Parked {
    keys: Vec<String>,
    all: bool,
    deadline: Instant,
    /// The key whose waiters list names this connection.
    on: Option<String>,
}

struct Conn {
    stream: TcpStream,
    phase: Phase,
    nonce_s: [u8; 16],
    seal: Option<Seal>,
    /// The client's rank once its hello was accepted.
    rank: Option<u32>,
    /// Bytes of the message being received (its 4-byte length first).
    inbuf: Vec<u8>,
    /// When the first byte of the message being received came.
    msg_since: Option<Instant>,
    /// The answer going out, and how much of it has.
    out: Vec<u8>,
    out_at: usize,
    out_since: Option<Instant>,
    parked: Option<Parked>,
    /// The events asked of epoll now.
    interest: u32,
    /// What this connection counts against until it closes.
    counted: Counted,
}

/// The limit a connection counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    /// The connections in their hello ([`MAX_UNAUTHENTICATED`]).
    Hello,
    /// The authenticated clients ([`max_clients`]), and its rank's presence.
    Client,
}

struct Server {
    listener: TcpListener,
    ev: Epoll,
    world: usize,
    key: Option<JobKey>,
    db: Db,
    conns: HashMap<u64, Conn>,
    /// Key → the parked connections that wait for it.
    waiters: HashMap<String, Vec<u64>>,
    /// (When, connection): a deadline to look at then (stale entries are skipped).
    timers: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    in_hello: usize,
    clients: usize,
    next_id: u64,
    /// Accepting failed (out of descriptors, most likely): the listener is left alone until
    /// then, and what waits stays in its backlog.
    accept_paused: Option<Instant>,
    /// Connections to close once the current event is handled (closing them in the middle of
    /// answering others could recurse through the waiters).
    doomed: Vec<(u64, String)>,
}

impl Server {
    fn run(&mut self, stop: &AtomicBool) {
        let mut evs = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        while !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            let mut timeout = STOP_SLICE;
            if let Some(std::cmp::Reverse((t, _))) = self.timers.peek() {
                timeout = timeout.min(t.saturating_duration_since(now));
            }
            if let Some(t) = self.accept_paused {
                if t <= now {
                    self.accept_paused = None;
                    let fd = self.listener.as_raw_fd();
                    if let Err(e) = self.ev.modify(fd, LISTENER, libc::EPOLLIN as u32) {
                        warn!("store listener: {e}");
                    }
                } else {
                    timeout = timeout.min(t - now);
                }
            }
            let n = self.ev.wait(&mut evs, timeout);
            for e in &evs[..n] {
                let (token, flags) = (e.u64, e.events);
                if token == LISTENER {
                    self.accept_all();
                } else {
                    self.on_event(token, flags);
                }
                while let Some((id, why)) = self.doomed.pop() {
                    self.close(id, Some(why));
                }
            }
            self.expire(Instant::now());
            while let Some((id, why)) = self.doomed.pop() {
                self.close(id, Some(why));
            }
        }
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id, None);
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((s, peer)) => {
                    if self.in_hello >= MAX_UNAUTHENTICATED {
                        debug!(%peer, "store: {MAX_UNAUTHENTICATED} connections already in their hello; closed");
                        continue;
                    }
                    if let Err(e) = self.admit(s) {
                        warn!(%peer, "store connection dropped: {e}");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // Out of descriptors, most likely: what is queued waits in the backlog
                    // while the listener rests (it stays readable, so watching it would spin).
                    warn!("store accept failed: {e}; accepting again in 50 ms");
                    let fd = self.listener.as_raw_fd();
                    let _ = self.ev.modify(fd, LISTENER, 0);
                    self.accept_paused = Some(Instant::now() + Duration::from_millis(50));
                    return;
                }
            }
        }
    }

    fn admit(&mut self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        let nonce_s = auth::random::<16>().map_err(std::io::Error::other)?;
        let id = self.next_id;
        self.next_id += 1;
        let now = Instant::now();
        let by = now + HANDSHAKE_DEADLINE;
        let interest = libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32;
        self.ev.add(stream.as_raw_fd(), id, interest)?;
        self.conns.insert(
            id,
            Conn {
                stream,
                phase: Phase::Hello { by },
                nonce_s,
                seal: None,
                rank: None,
                inbuf: Vec::new(),
                msg_since: None,
                out: Vec::new(),
                out_at: 0,
                out_since: None,
                parked: None,
                interest,
                counted: Counted::Hello,
            },
        );
        self.in_hello += 1;
        self.timers.push(std::cmp::Reverse((by, id)));
        self.queue(id, nonce_s.to_vec());
        Ok(())
    }

    fn on_event(&mut self, id: u64, flags: u32) {
        if !self.conns.contains_key(&id) {
            return;
        }
        if flags & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 {
            return self.close(id, None);
        }
        if flags & libc::EPOLLOUT as u32 != 0 {
            self.flush(id);
        }
        let Some(c) = self.conns.get(&id) else { return };
        let reading = c.parked.is_none() && c.out.is_empty() && c.phase != Phase::Closing;
        if flags & libc::EPOLLRDHUP as u32 != 0 && !reading {
            // The client shut its end while it waits for an answer or has not taken one: it
            // is gone (no client of this protocol half-closes), and must not hold its slot.
            return self.close(id, None);
        }
        if flags & (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 != 0 {
            self.read(id);
        }
    }

    /// Read what the connection may send now: at most the rest of one message.
    fn read(&mut self, id: u64) {
        // A few messages per event, then the others' turn (level triggered: the rest is
        // reported again), so a client sending back to back cannot hold the loop.
        let mut messages = 0;
        loop {
            let Some(c) = self.conns.get_mut(&id) else { return };
            if c.parked.is_some() || !c.out.is_empty() || c.phase == Phase::Closing {
                // One request at a time: the next is read once this one's answer is out.
                return;
            }
            let (max, sealed) = match c.phase {
                Phase::Hello { .. } => (MAX_HELLO, false),
                _ => (MAX_STORE_MESSAGE, c.seal.is_some()),
            };
            // How much this message still needs: its length first, then its body.
            let want = if c.inbuf.len() < 4 {
                4 - c.inbuf.len()
            } else {
                let mut len = [0u8; 4];
                len.copy_from_slice(&c.inbuf[..4]);
                match announced(len, sealed, max) {
                    Ok(n) => 4 + n - c.inbuf.len(),
                    Err(e) => return self.refuse(id, format!("bad message: {e}")),
                }
            };
            if want == 0 {
                let mut msg = std::mem::take(&mut c.inbuf);
                c.msg_since = None;
                msg.drain(..4);
                self.message(id, msg);
                messages += 1;
                if messages == MESSAGES_PER_EVENT {
                    return;
                }
                continue;
            }
            let at = c.inbuf.len();
            c.inbuf.resize(at + want, 0);
            match c.stream.read(&mut c.inbuf[at..]) {
                Ok(0) => {
                    c.inbuf.truncate(at);
                    let ended_cleanly = at == 0 && c.phase == Phase::Serving;
                    let why = (!ended_cleanly).then(|| "the client closed mid-message".to_string());
                    return self.close(id, why);
                }
                Ok(k) => {
                    c.inbuf.truncate(at + k);
                    if at == 0 {
                        let since = Instant::now();
                        c.msg_since = Some(since);
                        self.timers.push(std::cmp::Reverse((since + MESSAGE_DEADLINE, id)));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    c.inbuf.truncate(at);
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => c.inbuf.truncate(at),
                Err(e) => {
                    c.inbuf.truncate(at);
                    return self.close(id, Some(e.to_string()));
                }
            }
        }
    }

    /// A whole message arrived on `id`.
    fn message(&mut self, id: u64, body: Vec<u8>) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        if matches!(c.phase, Phase::Hello { .. }) {
            return self.hello(id, body);
        }
        let body = match open(c.seal.as_mut(), body) {
            Ok(b) => b,
            Err(e) => {
                let rank = c.rank.unwrap_or(u32::MAX);
                return self.close(id, Some(format!("bad request from rank {rank}: {e}")));
            }
        };
        let req = match decode_request(&body) {
            Ok(r) => r,
            Err(e) => return self.refuse(id, e),
        };
        let (applied, set) = self.db.apply(req, id);
        match applied {
            Applied::Now(r) => self.answer(id, &r),
            Applied::Wait { keys, all, deadline } => {
                self.timers.push(std::cmp::Reverse((deadline, id)));
                let on = self.db.first_missing(&keys);
                if let Some(k) = &on {
                    self.waiters.entry(k.clone()).or_default().push(id);
                }
                if let Some(c) = self.conns.get_mut(&id) {
                    c.parked = Some(Parked { keys, all, deadline, on });
                }
                self.rearm(id);
            }
        }
        if let Some(k) = set {
            self.wake(&k);
        }
    }

    fn hello(&mut self, id: u64, body: Vec<u8>) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let hello: StoreHello = match postcard::from_bytes(&body) {
            Ok(h) => h,
            Err(e) => return self.close(id, Some(format!("malformed hello: {e}"))),
        };
        let verdict =
            check_hello(&hello, self.world, self.key.as_ref(), &c.nonce_s).and_then(|()| {
                if self.clients >= max_clients(self.world) {
                    Err(format!("more than {} store clients at once", max_clients(self.world)))
                } else {
                    Ok(())
                }
            });
        if let Err(e) = verdict {
            debug!("store refused a client: {e}");
            return self.refuse(id, e);
        }
        let proof = self.key.as_ref().map(|k| hello_proof(k, SERVER_PROOF, &c.nonce_s, &hello));
        c.seal =
            self.key.as_ref().map(|k| Seal::new(k.clone(), &c.nonce_s, &hello.nonce, Side::Server));
        c.phase = Phase::Serving;
        c.rank = Some(hello.rank);
        c.counted = Counted::Client;
        self.in_hello -= 1;
        self.clients += 1;
        // Count this rank's open connections while they last: a rank whose process died has
        // none (the kernel closes its sockets), which its survivors can read.
        self.present(hello.rank, 1, id);
        self.queue(id, frame(None, &Response::Welcome(proof)).unwrap_or_default());
    }

    fn present(&mut self, rank: u32, delta: i64, id: u64) {
        let key = format!("{PRESENT}{rank}");
        let _ = self.db.apply(Request::Add { key: key.clone(), delta }, id);
        self.wake(&key);
    }

    /// Answer the request of `id` (sealed when the connection is).
    fn answer(&mut self, id: u64, r: &Response) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        match frame(c.seal.as_mut(), r) {
            Ok(bytes) => self.queue(id, bytes),
            Err(e) => self.close(id, Some(format!("cannot encode an answer: {e}"))),
        }
    }

    /// Say why (unsealed in the hello, sealed after) and close once it is out.
    fn refuse(&mut self, id: u64, why: String) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let sealed = if c.phase == Phase::Serving { c.seal.as_mut() } else { None };
        let bytes = frame(sealed, &Response::Err(why.clone())).unwrap_or_default();
        // Its slot stays taken until the socket is closed (`close`).
        c.phase = Phase::Closing;
        warn!(rank = ?c.rank, "store connection refused: {why}");
        self.queue(id, bytes);
    }

    fn queue(&mut self, id: u64, bytes: Vec<u8>) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        c.out.extend_from_slice(&bytes);
        if c.out_since.is_none() {
            let now = Instant::now();
            c.out_since = Some(now);
            self.timers.push(std::cmp::Reverse((now + MESSAGE_DEADLINE, id)));
        }
        self.flush(id);
    }

    /// Write what is queued; when all is out, read on (or close a closing connection).
    fn flush(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        while c.out_at < c.out.len() {
            match c.stream.write(&c.out[c.out_at..]) {
                Ok(0) => return self.doomed.push((id, "the client stopped reading".into())),
                Ok(k) => c.out_at += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return self.doomed.push((id, e.to_string())),
            }
        }
        if c.out_at == c.out.len() {
            if c.out.capacity() > 64 << 10 {
                c.out = Vec::new();
            }
            c.out.clear();
            c.out_at = 0;
            c.out_since = None;
            if c.phase == Phase::Closing {
                return self.doomed.push((id, "refused".into()));
            }
        }
        self.rearm(id);
        // A request already waiting in the socket is reported by the next wait (level
        // triggered), or read by the `read` loop this answer came from: never read from here,
        // so a client that sends many requests at once cannot deepen the stack.
    }

    /// Ask epoll for what connection `id` can take now: its answer going out, nothing but its
    /// end while its request is parked, its next request otherwise.
    fn rearm(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let want = libc::EPOLLRDHUP as u32
            | if !c.out.is_empty() {
                libc::EPOLLOUT as u32
            } else if c.parked.is_some() || c.phase == Phase::Closing {
                0
            } else {
                libc::EPOLLIN as u32
            };
        if want != c.interest {
            c.interest = want;
            if let Err(e) = self.ev.modify(c.stream.as_raw_fd(), id, want) {
                self.doomed.push((id, e.to_string()));
            }
        }
    }

    /// `key` was set: answer the connections parked on it that can be answered now.
    fn wake(&mut self, key: &str) {
        let Some(ids) = self.waiters.remove(key) else { return };
        for id in ids {
            let Some(c) = self.conns.get_mut(&id) else { continue };
            let Some(p) = c.parked.as_mut() else { continue };
            if p.on.as_deref() != Some(key) {
                continue;
            }
            match self.db.ready(&p.keys, p.all) {
                Some(r) => {
                    c.parked = None;
                    self.answer(id, &r);
                }
                None => {
                    // A get-all still missing keys waits for the next of them.
                    p.on = self.db.first_missing(&p.keys);
                    if let Some(k) = &p.on {
                        self.waiters.entry(k.clone()).or_default().push(id);
                    }
                }
            }
        }
    }

    /// Deadlines that have passed by `now`: hellos and messages too slow, answers not taken,
    /// waits out of time.
    fn expire(&mut self, now: Instant) {
        while let Some(std::cmp::Reverse((t, id))) = self.timers.peek().copied() {
            if t > now {
                return;
            }
            self.timers.pop();
            let Some(c) = self.conns.get_mut(&id) else { continue };
            if matches!(c.phase, Phase::Hello { by } if by <= now) {
                self.close(id, Some("no valid hello in time".into()));
                continue;
            }
            if c.msg_since.is_some_and(|s| s + MESSAGE_DEADLINE <= now) {
                let rank = c.rank.unwrap_or(u32::MAX);
                self.close(id, Some(format!("rank {rank}'s message did not arrive whole in time")));
                continue;
            }
            if c.out_since.is_some_and(|s| s + MESSAGE_DEADLINE <= now) {
                self.close(id, Some("the client did not take its answer in time".into()));
                continue;
            }
            if c.parked.as_ref().is_some_and(|p| p.deadline <= now) {
                let p = c.parked.take();
                let r = match p.as_ref() {
                    Some(p) if p.all => Response::TimeoutOn(p.on.clone().unwrap_or_default()),
                    _ => Response::Timeout,
                };
                self.unwait(id, p);
                self.answer(id, &r);
            }
        }
        // Entries for deadlines already met (answered waits, messages that came whole) go
        // stale; rebuild the heap from the live deadlines before they outnumber the
        // connections by much.
        if self.timers.len() > 1024 + 4 * self.conns.len() {
            let mut live = BinaryHeap::new();
            for (id, c) in &self.conns {
                let mut push = |t: Instant| live.push(std::cmp::Reverse((t, *id)));
                if let Phase::Hello { by } = c.phase {
                    push(by);
                }
                if let Some(s) = c.msg_since {
                    push(s + MESSAGE_DEADLINE);
                }
                if let Some(s) = c.out_since {
                    push(s + MESSAGE_DEADLINE);
                }
                if let Some(p) = &c.parked {
                    push(p.deadline);
                }
            }
            self.timers = live;
        }
    }

    /// Take connection `id` off the waiters list its parked request is on.
    fn unwait(&mut self, id: u64, p: Option<Parked>) {
        let Some(k) = p.and_then(|p| p.on) else { return };
        if let Some(ids) = self.waiters.get_mut(&k) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.waiters.remove(&k);
            }
        }
    }

    /// Drop connection `id` (its slot and its presence count go with it).
    fn close(&mut self, id: u64, why: Option<String>) {
        let Some(mut c) = self.conns.remove(&id) else { return };
        self.unwait(id, c.parked.take());
        match c.counted {
            Counted::Hello => self.in_hello -= 1,
            Counted::Client => {
                self.clients -= 1;
                if let Some(r) = c.rank {
                    self.present(r, -1, id);
                }
            }
        }
        if let Some(why) = why {
            warn!(rank = ?c.rank, "store connection dropped: {why}");
        }
        // Closing the socket removes it from the epoll set.
        drop(c);
    }
}

/// Set in a store that counts each rank's open connections under [`PRESENT`].
pub const PRESENCE: &str = "tutti/presence";
/// `PRESENT` + rank: how many connections that rank has open to this store now.
pub const PRESENT: &str = "tutti/present/";

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
