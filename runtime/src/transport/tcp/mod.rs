//! TCP transport: one connection per peer pair, made eagerly at start-up.
//!
//! Rank `i` listens on one address (port chosen by the OS unless told otherwise), publishes it in
//! the store, connects to every lower rank and accepts every higher one. Each connection is
//! authenticated by the job key (see `handshake.rs`). Eager set-up costs `world - 1` connections per
//! rank up front but means a dead or missing rank is found at start-up, not in the middle of the
//! first collective, and no collective ever pays a connect. Right after its handshake, a
//! connection between two ranks of one host sets up shared memory for its frames (`shm.rs`). The
//! data path is the shared engine and connection core (`../engine.rs`, `../core.rs`) over this
//! transport's driver (`driver.rs`).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::auth::{self, JobKey};
use crate::error::{Error, Result};
use crate::store::Store;

pub(crate) mod driver;
pub(crate) mod handshake;
pub(crate) mod shm;

use crate::transport::core::{Core, CoreConfig};
use crate::transport::engine::{Engine, Running, Wired};
use crate::transport::{LinkConfig, Watch};
use crate::util::Slot;
use driver::TcpDriver;
use shm::ShmLink;

/// Who this rank is within its job, for connection set-up.
#[derive(Debug, Clone)]
pub struct JobIdentity {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Random id shared by the ranks of one job (published by rank 0 through the store).
    pub job: u64,
    /// Key derived from the job token.
    pub key: JobKey,
}

/// The TCP transport of one rank.
pub struct TcpTransport {
    rank: usize,
    /// The engine; dropping it shuts the connections down cleanly.
    wire: Running<TcpDriver>,
    local: SocketAddr,
    /// Stops the acceptor.
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.rank)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// Store key under which rank `r` publishes its listening address.
pub fn addr_key(r: usize) -> String {
    format!("tutti/addr/{r}")
}

impl TcpTransport {
    /// Connect this rank to every other rank of the job, using `store` to exchange addresses.
    ///
    /// # Errors
    /// [`Error::Io`] when the listener cannot be bound; [`Error::Rendezvous`] naming the ranks
    /// that did not publish an address or connect within `connect_timeout`, or that refused us
    /// (different job, world size, token, or a duplicate rank).
    pub fn connect(id: &JobIdentity, store: &dyn Store, cfg: &LinkConfig) -> Result<TcpTransport> {
        Self::connect_watched(id, store, cfg, Watch::NONE)
    }

    /// [`TcpTransport::connect`], failing at once when `watch` says a peer has ended or a peer's
    /// published address refuses connections (its process is gone).
    pub(crate) fn connect_watched(
        id: &JobIdentity,
        store: &dyn Store,
        cfg: &LinkConfig,
        watch: Watch<'_>,
    ) -> Result<TcpTransport> {
        let (rank, world) = (id.rank, id.world);
        let start = Instant::now();
        let deadline = start + cfg.connect_timeout;
        let listener = TcpListener::bind(SocketAddr::new(cfg.bind_ip, cfg.port))
            .map_err(|e| Error::io(rank, format!("binding {}:{}", cfg.bind_ip, cfg.port), &e))?;
        let local = listener.local_addr().map_err(|e| Error::io(rank, "listener address", &e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(rank, "listener", &e))?;
        crate::store::set_signed(
            store,
            &id.key,
            id.job,
            &addr_key(rank),
            local.to_string().as_bytes(),
        )?;
        debug!(rank, %local, "listening");

        let stop = Arc::new(AtomicBool::new(false));
        let connected: Arc<Mutex<Vec<bool>>> = Arc::new(Mutex::new(vec![false; world]));
        let (tx, rx) = mpsc::channel::<(usize, TcpStream, Option<ShmLink>)>();
        let acceptor = {
            let (stop, connected, id, hs) =
                (stop.clone(), connected.clone(), id.clone(), cfg.handshake_timeout);
            let shm = cfg.shm;
            std::thread::Builder::new()
                .name(format!("tutti-accept-{rank}"))
                .spawn(move || accept_loop(listener, id, hs, shm, connected, tx, stop))
                .map_err(|e| Error::io(rank, "spawning the acceptor", &e))?
        };

        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut links: Vec<Option<ShmLink>> = (0..world).map(|_| None).collect();
        let result = (|| {
            // Learn every lower rank's address first, in one round (so the store is not
            // needed once connected).
            let keys: Vec<String> = (0..rank).map(addr_key).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let raws = watch.get_all(store, rank, &refs, deadline, |missing| {
                let j = refs.iter().position(|k| *k == missing).unwrap_or(0);
                Error::Rendezvous {
                    rank,
                    detail: format!(
                        "rank {j} did not publish its address within {:?}: it never started, \
                         crashed before rendezvous, or uses another store",
                        cfg.connect_timeout
                    ),
                }
            })?;
            let mut addrs = Vec::with_capacity(rank);
            for (j, raw) in raws.into_iter().enumerate() {
                let raw = crate::store::open_signed(&id.key, id.job, &addr_key(j), raw)
                    .ok_or_else(|| crate::store::forged(rank, j, "address"))?;
                let text = String::from_utf8_lossy(&raw).into_owned();
                let addr: SocketAddr = text.parse().map_err(|_| Error::Rendezvous {
                    rank,
                    detail: format!("rank {j} published an unparsable address {text:?}"),
                })?;
                addrs.push(addr);
            }
            for (j, addr) in addrs.into_iter().enumerate() {
                let (s, link) = connect_one(id, j, addr, deadline, cfg, watch)?;
                streams[j] = Some(s);
                links[j] = link;
            }
            let higher = world - rank - 1;
            let mut got = 0;
            while got < higher {
                watch.check(rank)?;
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(watch.slice(left)) {
                    Ok((j, s, link)) => {
                        streams[j] = Some(s);
                        links[j] = link;
                        got += 1;
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                    Err(_) => {
                        let missing: Vec<usize> =
                            (rank + 1..world).filter(|j| streams[*j].is_none()).collect();
                        // Tell the dead from the merely waiting: a rank that published its
                        // address is alive (probably waiting on a third rank).
                        let silent: Vec<usize> = missing
                            .iter()
                            .copied()
                            .filter(|j| !store.check(&[addr_key(*j).as_str()]).unwrap_or(false))
                            .collect();
                        return Err(Error::Rendezvous {
                            rank,
                            detail: format!(
                                "ranks {missing:?} did not connect within {:?}; ranks {silent:?} \
                                 never published an address (never started, or died before \
                                 rendezvous); the others may be waiting for them or cannot \
                                 reach {local}",
                                cfg.connect_timeout
                            ),
                        });
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            stop.store(true, Ordering::SeqCst);
            let _ = acceptor.join();
            return Err(e);
        }
        let shared = links.iter().flatten().count();
        let now = Instant::now();
        let mut core =
            Core::new(rank, world, CoreConfig::from_link(cfg, driver::EAGER_MAX, true), now);
        let engine = TcpDriver::new(streams, links, &mut core, now, cfg.tcp_congestion.as_deref())
            .and_then(|d| Engine::new(core, d, cfg.spin))
            .map_err(|e| Error::io(rank, "configuring connections", &e))?;
        let wire = Running::start(engine, format!("tutti-tcp-{rank}"))
            .map_err(|e| Error::io(rank, "spawning the background driver", &e))?;
        info!(rank, world, %local, shared, elapsed = ?start.elapsed(), "tcp transport connected");
        Ok(TcpTransport { rank, wire, local, stop, acceptor: Some(acceptor) })
    }

    /// The address this rank listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

/// Refusals in a row after which a watched connect takes a peer's published address for a
/// closed listener (with the backoff between them, about 15 ms).
const REFUSED_GONE: u32 = 4;

fn connect_one(
    id: &JobIdentity,
    j: usize,
    addr: SocketAddr,
    deadline: Instant,
    cfg: &LinkConfig,
    watch: Watch<'_>,
) -> Result<(TcpStream, Option<ShmLink>)> {
    let rank = id.rank;
    let mut backoff = Duration::from_millis(2);
    // Refusals in a row at an address the peer published after it was listening: its listener
    // is closed, so (when watched) the peer has ended.
    let mut refused = 0;
    loop {
        watch.check(rank)?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Rendezvous {
                rank,
                detail: format!("could not connect to rank {j} at {addr} in time"),
            });
        }
        let attempt = TcpStream::connect_timeout(&addr, left.min(cfg.handshake_timeout));
        let mut s = match attempt {
            Ok(s) => s,
            Err(e) => {
                refused =
                    if e.kind() == std::io::ErrorKind::ConnectionRefused { refused + 1 } else { 0 };
                if refused >= REFUSED_GONE && watch.is_watching() {
                    return Err(Error::PeerLost {
                        rank,
                        peer: j,
                        ctx: None,
                        detail: format!(
                            "rank {j} refuses connections at the address it published ({addr}): \
                             its process has ended"
                        ),
                    });
                }
                debug!(rank, peer = j, %addr, "connect failed: {e}; retrying");
                std::thread::sleep(crate::util::jitter(backoff));
                backoff = (backoff * 2).min(Duration::from_millis(100));
                continue;
            }
        };
        let _ = s.set_nodelay(true);
        let nonce = auth::random::<16>().map_err(|e| Error::Rendezvous { rank, detail: e })?;
        let hello = handshake::Hello {
            version: handshake::HS_VERSION,
            world: id.world as u32,
            from: rank as u32,
            to: j as u32,
            job: id.job,
            nonce,
        };
        let hs_deadline = (Instant::now() + cfg.handshake_timeout).min(deadline);
        let done = handshake::client(&mut s, &id.key, hello, hs_deadline).and_then(|()| {
            shm::client_side(&mut s, cfg.shm, id.world, hs_deadline).map_err(handshake::HsError::Io)
        });
        match done {
            Ok(link) => {
                let _ = s.set_read_timeout(None);
                let _ = s.set_write_timeout(None);
                debug!(rank, peer = j, %addr, shm = link.is_some(), "connected");
                return Ok((s, link));
            }
            // The connection broke or timed out (a listener busy with other handshakes closes
            // new ones at once): try again until the deadline.
            Err(handshake::HsError::Io(e)) if Instant::now() + backoff < deadline => {
                debug!(rank, peer = j, %addr, "handshake i/o failed: {e}; retrying");
                std::thread::sleep(crate::util::jitter(backoff));
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(Error::Rendezvous {
                    rank,
                    detail: format!("rank {j} at {addr} refused the connection: {e}"),
                })
            }
        }
    }
}

/// Handshakes a rank's listener runs at once; more connections are closed as soon as they are
/// accepted (a dialling peer tries again until its connect deadline).
pub const MAX_HANDSHAKES: usize = 64;

fn accept_loop(
    listener: TcpListener,
    id: JobIdentity,
    hs_timeout: Duration,
    shm: bool,
    connected: Arc<Mutex<Vec<bool>>>,
    tx: mpsc::Sender<(usize, TcpStream, Option<ShmLink>)>,
    stop: Arc<AtomicBool>,
) {
    let rank = id.rank;
    let id = Arc::new(id);
    let in_handshake = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                crate::util::wait_readable(listener.as_raw_fd(), Duration::from_millis(100));
                continue;
            }
            Err(e) => {
                warn!(rank, "accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let Some(slot) = Slot::take(&in_handshake, MAX_HANDSHAKES) else {
            debug!(rank, "{MAX_HANDSHAKES} handshakes already under way; closed {from}");
            drop(s);
            continue;
        };
        let (id, connected, tx) = (id.clone(), connected.clone(), tx.clone());
        let spawned =
            std::thread::Builder::new().name(format!("tutti-hs-{rank}")).spawn(move || {
                let _slot = slot;
                let deadline = Instant::now() + hs_timeout;
                let _ = s.set_nonblocking(false);
                // The handshake's last answer and the shared-memory offer leave back to back:
                // without this, Nagle holds the offer until the client's delayed ack (40 ms a
                // connection, in a chain through every rank's dials).
                let _ = s.set_nodelay(true);
                let nonce = match auth::random::<16>() {
                    Ok(n) => n,
                    Err(e) => return warn!(rank, "refused connection from {from}: {e}"),
                };
                let expect = handshake::Expect {
                    key: &id.key,
                    job: id.job,
                    world: id.world as u32,
                    me: id.rank as u32,
                };
                let accept = |r: u32| {
                    let mut c = connected.lock().unwrap_or_else(|p| p.into_inner());
                    let slot = &mut c[r as usize];
                    !std::mem::replace(slot, true)
                };
                match handshake::server(&mut s, &expect, nonce, accept, deadline) {
                    Ok(h) => match shm::server_side(&mut s, shm, id.world, deadline) {
                        Ok(link) => {
                            let _ = s.set_read_timeout(None);
                            let _ = s.set_write_timeout(None);
                            if tx.send((h.from as usize, s, link)).is_err() {
                                warn!(
                                    rank,
                                    peer = h.from,
                                    "late connection after start-up; dropped"
                                );
                            }
                        }
                        Err(e) => {
                            // The peer dials again (or is gone): its rank is free once more.
                            debug!(rank, peer = h.from, "connection from {from} broke: {e}");
                            let mut c = connected.lock().unwrap_or_else(|p| p.into_inner());
                            c[h.from as usize] = false;
                            let _ = s.shutdown(std::net::Shutdown::Both);
                        }
                    },
                    Err(e) => {
                        warn!(rank, "refused connection from {from}: {e}");
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                }
            });
        if let Err(e) = spawned {
            warn!(rank, "could not spawn a handshake thread: {e}");
        }
    }
}

impl Wired for TcpTransport {
    type Driver = TcpDriver;
    const NAME: &'static str = "tcp";

    fn engine(&self) -> &Engine<TcpDriver> {
        self.wire.engine()
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        Some(self.local_addr())
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // The connections shut down when `wire` drops, after this.
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}
