//! TCP transport: one connection per peer pair, made on first use (or for the whole mesh at
//! start-up, `LinkConfig::lazy` off).
//!
//! Rank `i` listens on one address (port chosen by the OS unless told otherwise), publishes it in
//! the store, and waits until every rank of the job has published its own (one counter and one
//! key in the store: O(1) store requests per rank). Then it returns: the engine runs from the
//! start, and a link is connected when this rank first sends to or posts a receive from its
//! peer (`Core::want_link` → `TcpDriver`'s `dial` → `Connector`). Either side may dial; when
//! both dial at once, the connection the lower rank dialled is kept and the higher rank's is
//! refused with `Status::Crossed` (`accept_from`), so a pair always ends with exactly one
//! connection. Every connection is authenticated by the job key (see `handshake.rs`); right after
//! its handshake, a connection between two ranks of one host sets up shared memory for its
//! frames (`shm.rs`). A connection joins the running engine the moment its handshake completes,
//! so keep-alives flow on it while the rank connects others, and a peer's dead-peer clock starts
//! when the pair connects.
//!
//! With `lazy` off, each rank also dials every lower rank at once and waits until every link is
//! up (the full mesh, `world - 1` connections per rank), so a missing rank is found at start-up.
//! The data path is the shared engine and connection core (`../engine.rs`, `../core.rs`) over
//! this transport's driver (`driver.rs`).

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::auth::{self, JobKey};
use crate::error::{Error, Result};
use crate::store::Store;

pub(crate) mod driver;
pub(crate) mod handshake;
pub(crate) mod shm;

use crate::transport::core::{Core, CoreConfig, LinkFail};
use crate::transport::engine::{Driver, Engine, Running, Wired};
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
    /// The listener, the dials and the abort note; stopped before the engine shuts down
    /// (declared first, so dropped first).
    side: TcpSide,
    /// The engine; dropping it shuts the connections down cleanly.
    wire: Running<TcpDriver>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.side.connector.id.rank)
            .field("local", &self.side.local)
            .finish_non_exhaustive()
    }
}

/// What the TCP driver's connector needs of the engine it runs under: the TCP driver and the
/// core under the engine's lock. A TCP transport's engine runs the TCP driver alone; a QUIC
/// job's runs it beside QUIC's driver, for the pairs of ranks on one host.
pub(crate) trait TcpHost: Send + Sync {
    /// Change the TCP driver and the core under the lock ([`Engine::with_driver`]).
    fn with_tcp(&self, f: &mut dyn FnMut(&mut TcpDriver, &mut Core));
    /// Look at the core under the lock.
    fn with_core(&self, f: &mut dyn FnMut(&Core));
}

/// A driver that carries TCP links: the TCP driver itself, or one that holds it.
pub(crate) trait HasTcp {
    /// The TCP driver inside.
    fn tcp(&mut self) -> &mut TcpDriver;
}

impl HasTcp for TcpDriver {
    fn tcp(&mut self) -> &mut TcpDriver {
        self
    }
}

impl<D: Driver + HasTcp> TcpHost for Engine<D> {
    fn with_tcp(&self, f: &mut dyn FnMut(&mut TcpDriver, &mut Core)) {
        self.with_driver(|d, core| f(d.tcp(), core));
    }

    fn with_core(&self, f: &mut dyn FnMut(&Core)) {
        f(&self.lock().core);
    }
}

/// The most shared memory one pair of same-host ranks of a job of `world` ranks can hold: its
/// segment's header page and a ring each way (only touched pages are allocated). A host's
/// ranks hold at most `world (world − 1) / 2` of these (every pair connected, every ring
/// filled): 504 MiB of rings and 8 MiB of header pages at 64 ranks.
pub fn shared_pair_bytes(world: usize) -> usize {
    shm::segment_bytes(shm::ring_for(world))
}

/// Store key under which rank `r` publishes its listening address.
pub fn addr_key(r: usize) -> String {
    format!("tutti/addr/{r}")
}

/// Store key under which a rank that failed leaves, as it closes, what its abort frames said:
/// a peer that dials it afterwards (links connect on first use, so some never did) finds its
/// listener closed and reads why here.
pub fn abort_key(r: usize) -> String {
    format!("tutti/tcp/aborted/{r}")
}

/// Store counter every rank adds one to once its address is published.
pub(crate) const UP_KEY: &str = "tutti/tcp/up";
/// Store key the rank that brings [`UP_KEY`] to the world size sets: every address is there.
const ALL_UP_KEY: &str = "tutti/tcp/all-up";

impl TcpTransport {
    /// Connect this rank to the job, using `store` to exchange addresses: publish this rank's
    /// address and wait until every rank published its own; then links connect on first use
    /// (`cfg.lazy`), or the whole mesh connects before this returns.
    ///
    /// The transport keeps `store` to look up the addresses of the peers it connects later.
    ///
    /// # Errors
    /// [`Error::Io`] when the listener cannot be bound; [`Error::Rendezvous`] naming the ranks
    /// that did not publish an address (or, with `lazy` off, connect) within
    /// `connect_timeout`, or that refused us (different job, world size, token, or a duplicate
    /// rank).
    pub fn connect(
        id: &JobIdentity,
        store: Arc<dyn Store>,
        cfg: &LinkConfig,
    ) -> Result<TcpTransport> {
        Self::connect_watched(id, store, cfg, Watch::NONE)
    }

    /// [`TcpTransport::connect`], failing at once when `watch` says a peer has ended (a peer
    /// whose published address refuses connections has ended too, watched or not).
    pub(crate) fn connect_watched(
        id: &JobIdentity,
        store: Arc<dyn Store>,
        cfg: &LinkConfig,
        watch: Watch<'_>,
    ) -> Result<TcpTransport> {
        let (rank, world) = (id.rank, id.world);
        let start = Instant::now();
        let deadline = start + cfg.connect_timeout;
        let mut side = TcpSide::bind(id, store.clone(), cfg, cfg.bind_ip)?;
        let local = side.local;
        // The engine runs from the start: each connection joins it as soon as its handshake
        // completes (ours or the peer's).
        let mut core_cfg = CoreConfig::from_link(cfg, driver::EAGER_MAX, true);
        core_cfg.lazy = true;
        let core = Core::new(rank, world, core_cfg, Instant::now());
        let engine = Engine::new(
            core,
            TcpDriver::empty(world, cfg.tcp_congestion.clone(), cfg.shm, Some(side.connector())),
            cfg.spin,
        )
        .map_err(|e| Error::io(rank, "configuring connections", &e))?;
        let wire = Running::start(engine, format!("tutti-tcp-{rank}"))
            .map_err(|e| Error::io(rank, "spawning the background driver", &e))?;
        side.start(wire.shared())?;
        let t = TcpTransport { side, wire };

        let result = (|| -> Result<()> {
            crate::store::set_signed(
                store.as_ref(),
                &id.key,
                id.job,
                &addr_key(rank),
                local.to_string().as_bytes(),
            )?;
            debug!(rank, %local, "listening");
            arrive(store.as_ref(), id, deadline, cfg.connect_timeout, watch)?;
            if !cfg.lazy {
                t.connect_mesh(deadline, watch)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            // The peers already connected learn why at once (and our shutdown does not wait
            // for their close).
            t.wire.engine().fail(e.clone(), "connecting the group failed");
            return Err(e);
        }
        let shared = t.wire.engine().with_driver(|d, _| d.shared_links());
        info!(
            rank, world, %local, shared, lazy = cfg.lazy, elapsed = ?start.elapsed(),
            "tcp transport connected"
        );
        Ok(t)
    }

    /// The full mesh up front: dial every lower rank (learning their addresses in one round)
    /// and wait until every higher rank dialled us.
    fn connect_mesh(&self, deadline: Instant, watch: Watch<'_>) -> Result<()> {
        let c = &self.side.connector;
        let (rank, world) = (c.id.rank, c.id.world);
        let keys: Vec<String> = (0..rank).map(addr_key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let raws = watch.get_all(c.store.as_ref(), rank, &refs, deadline, |_| {
            Error::Rendezvous { rank, detail: "the addresses vanished from the store".into() }
        })?;
        for (j, raw) in raws.into_iter().enumerate() {
            let addr = c.parse_addr(j, raw)?;
            c.addrs.lock().unwrap_or_else(|p| p.into_inner())[j] = Some(addr);
        }
        // Dial every lower rank; every higher rank dials us.
        let lower: Vec<usize> = (0..rank).collect();
        let everyone: Vec<usize> = (0..world).collect();
        self.wire.engine().connect_peers(&lower, &everyone, deadline, || watch.check(rank)).map_err(
            |e| match e {
                // The dial's own error names the peer and why (what the core poisoned with
                // says only that the link failed).
                Error::Rendezvous { .. } => e,
                other => {
                    c.failure.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or(other)
                }
            },
        )
    }

    /// The address this rank listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.side.local
    }
}

/// The TCP side of a rank: its listener and acceptor, the connector that dials the links the
/// core asks for, and the abort note left in the store for peers that dial after a failure.
/// Owned by the transport whose engine runs the TCP driver (declared before that engine, so
/// that dropping it stops the dials and handshakes before the engine shuts down).
pub(crate) struct TcpSide {
    local: SocketAddr,
    connector: Arc<Connector>,
    /// Until [`TcpSide::start`]: the listener the acceptor will serve.
    listener: Option<TcpListener>,
    acceptor: Option<JoinHandle<()>>,
}

impl TcpSide {
    /// Bind a listener on `ip` (port `cfg.port`, 0: the OS chooses) and make the connector;
    /// nothing is accepted or dialled before [`TcpSide::start`].
    ///
    /// # Errors
    /// [`Error::Io`] when the listener cannot be bound.
    pub(crate) fn bind(
        id: &JobIdentity,
        store: Arc<dyn Store>,
        cfg: &LinkConfig,
        ip: std::net::IpAddr,
    ) -> Result<TcpSide> {
        let rank = id.rank;
        let listener = TcpListener::bind(SocketAddr::new(ip, cfg.port))
            .map_err(|e| Error::io(rank, format!("binding {ip}:{}", cfg.port), &e))?;
        let local = listener.local_addr().map_err(|e| Error::io(rank, "listener address", &e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(rank, "listener", &e))?;
        let connector = Arc::new(Connector {
            id: id.clone(),
            cfg: cfg.clone(),
            store,
            state: Mutex::new(vec![PeerConn::Idle; id.world]),
            addrs: Mutex::new(vec![None; id.world]),
            engine: OnceLock::new(),
            stop: AtomicBool::new(false),
            queue: Mutex::new(VecDeque::new()),
            workers: AtomicUsize::new(0),
            handshakes: Arc::new(AtomicUsize::new(0)),
            only: OnceLock::new(),
            failure: Mutex::new(None),
            noted: AtomicBool::new(false),
            note: Mutex::new(None),
        });
        Ok(TcpSide { local, connector, listener: Some(listener), acceptor: None })
    }

    #[cfg_attr(not(feature = "quic"), allow(dead_code))]
    /// The address the listener is bound to.
    pub(crate) fn local(&self) -> SocketAddr {
        self.local
    }

    /// The connector, for the TCP driver.
    pub(crate) fn connector(&self) -> Arc<Connector> {
        self.connector.clone()
    }

    #[cfg_attr(not(feature = "quic"), allow(dead_code))]
    /// `peer` listens at `addr` (learnt with the rest of the rendezvous): dials need not ask
    /// the store.
    pub(crate) fn know_addr(&self, peer: usize, addr: SocketAddr) {
        if let Some(a) =
            self.connector.addrs.lock().unwrap_or_else(|p| p.into_inner()).get_mut(peer)
        {
            *a = Some(addr);
        }
    }

    #[cfg_attr(not(feature = "quic"), allow(dead_code))]
    /// Take connections from the ranks `peers` marks only (before [`TcpSide::start`]).
    pub(crate) fn only(&self, peers: Vec<bool>) {
        let _ = self.connector.only.set(peers);
    }

    /// What the acceptor would answer an authenticated connection from `from` now (for the
    /// tests: it takes the pair when it says `Ok`).
    #[cfg(all(test, feature = "quic"))]
    pub(crate) fn accept_status(&self, from: usize) -> handshake::Status {
        self.connector.accept_from(from)
    }

    /// Run under `engine`: connections made from now on join it; the acceptor starts.
    ///
    /// # Errors
    /// [`Error::Io`] when the acceptor's thread cannot be started.
    pub(crate) fn start<E: TcpHost + 'static>(&mut self, engine: Arc<E>) -> Result<()> {
        let rank = self.connector.id.rank;
        let weak: Weak<dyn TcpHost> = Arc::downgrade(&engine) as Weak<dyn TcpHost>;
        let _ = self.connector.engine.set(weak);
        let Some(listener) = self.listener.take() else { return Ok(()) };
        let c = self.connector.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("tutti-accept-{rank}"))
            .spawn(move || accept_loop(listener, c))
            .map_err(|e| Error::io(rank, "spawning the acceptor", &e))?;
        self.acceptor = Some(acceptor);
        Ok(())
    }

    /// Once poisoned, leave the abort reason in the store ([`abort_key`], signed as addresses
    /// are), once: a peer that dials this rank after it closed (or its process ended) reads it.
    pub(crate) fn note_failure(&self) {
        let c = &self.connector;
        let rank = c.id.rank;
        let Some(engine) = c.engine.get().and_then(Weak::upgrade) else { return };
        // The note is for peers that have not connected to us yet (they read it when they
        // dial). With none left to connect, every peer hears the abort frame, and the store is
        // not asked: its server may be the rank that failed (a stopped rank 0 would hold this
        // rank for the store's timeout).
        let (mut reason, mut waiting) = (None, false);
        engine.with_core(&mut |core| {
            waiting = (0..c.id.world).any(|p| p != rank && core.is_pending(p));
            reason = core.abort_reason().map(str::to_string);
        });
        let Some(reason) = reason.filter(|_| waiting) else { return };
        if c.noted.swap(true, Ordering::SeqCst) {
            return;
        }
        // Written by a thread of its own: the failed call returns at once, even when the
        // store's server is the rank that failed (a stopped rank 0 would hold the write for the
        // store's timeout). Dropping the transport waits for the note, within [`NOTE_WAIT`].
        // A store that no detached thread may call (a Python object) is written here.
        if c.store.detached_calls() {
            let (conn, note) = (c.clone(), reason.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("tutti-note-{rank}"))
                .spawn(move || write_note(&conn, rank, &note));
            match spawned {
                Ok(h) => {
                    *c.note.lock().unwrap_or_else(|p| p.into_inner()) = Some(h);
                    return;
                }
                Err(e) => debug!(rank, "no thread for the abort note, written here: {e}"),
            }
        }
        write_note(c, rank, &reason);
    }
}

/// Leave `rank`'s abort `reason` in the store ([`abort_key`], signed as addresses are).
fn write_note(c: &Connector, rank: usize, reason: &str) {
    let signed = crate::store::set_signed(
        c.store.as_ref(),
        &c.id.key,
        c.id.job,
        &abort_key(rank),
        reason.as_bytes(),
    );
    if let Err(e) = signed {
        debug!(rank, "could not leave the abort reason in the store: {e}");
    }
}

/// How long dropping a transport waits for its abort note to reach the store. A store that
/// has not taken it by then is most likely served by a rank that stopped; the peers that dial
/// this rank later then learn that it ended, without its reason.
const NOTE_WAIT: Duration = Duration::from_secs(5);

/// Count this rank in and wait until every rank of the job has published its address: one
/// `add` per rank, one `set` by the last, one (parked) `get` per rank — O(1) store requests
/// per rank, whatever the world. On timeout, names the ranks that never published, and those
/// that published but are gone (see [`gone_after_publishing`]).
fn arrive(
    store: &dyn Store,
    id: &JobIdentity,
    deadline: Instant,
    limit: Duration,
    watch: Watch<'_>,
) -> Result<()> {
    let (rank, world) = (id.rank, id.world);
    let n = store.add(UP_KEY, 1)?;
    // At or past the world: a rank counted twice (run again on the same store) must not leave
    // everyone waiting; a rank then missing is found by the first dial that needs it.
    if n >= world as i64 {
        return store.set(ALL_UP_KEY, b"1");
    }
    watch
        .get_all(store, rank, &[ALL_UP_KEY], deadline, |_| {
            let (silent, published): (Vec<usize>, Vec<usize>) =
                (0..world).partition(|j| !store.check(&[addr_key(*j).as_str()]).unwrap_or(false));
            let mut detail = String::new();
            if !silent.is_empty() {
                detail = format!(
                    "ranks {} did not publish an address within {limit:?}: they never \
                     started, died before rendezvous, or use another store",
                    crate::util::list_ranks(&silent)
                );
            }
            // A rank that published and then died before counting in is not among the silent
            // ones: the count says how many such ranks there are, a dial says which.
            let counted = store.add(UP_KEY, 0).map_or(world, |c| c.max(0) as usize);
            let uncounted = world.saturating_sub(counted).saturating_sub(silent.len());
            if uncounted > 0 {
                let others: Vec<usize> = published.into_iter().filter(|j| *j != rank).collect();
                let gone = gone_after_publishing(store, id, &others, uncounted);
                if !detail.is_empty() {
                    detail.push_str("; ");
                }
                detail.push_str(&if gone.is_empty() {
                    format!(
                        "{uncounted} rank(s) published an address but did not count in within \
                         {limit:?}: they stopped or died during rendezvous (none refused a \
                         connection, so which is not known)"
                    )
                } else {
                    format!(
                        "ranks {} published an address but refuse connections at it: they \
                         died during rendezvous",
                        crate::util::list_ranks(&gone)
                    )
                });
            }
            if detail.is_empty() {
                detail = format!(
                    "every rank counted in, but the store did not say so within {limit:?} \
                     ({})",
                    store.describe()
                );
            }
            Error::Rendezvous { rank, detail }
        })
        .map(|_| ())
}

/// Of the ranks in `published` (their addresses are in the store), those that refuse a
/// connection at their address and left no abort reason in the store — their listener is
/// closed and they did not fail on their own, so they died — looking until
/// `want` are found or [`PROBE_BUDGET`] is spent. Only a failed rendezvous probes: it costs a
/// connection per rank at most, and a live rank's acceptor sees one that sends nothing.
fn gone_after_publishing(
    store: &dyn Store,
    id: &JobIdentity,
    published: &[usize],
    want: usize,
) -> Vec<usize> {
    let end = Instant::now() + PROBE_BUDGET;
    let mut gone = Vec::new();
    for &j in published {
        let left = end.saturating_duration_since(Instant::now());
        if gone.len() >= want || left.is_zero() {
            break;
        }
        let Ok(raw) = store.get_all(&[addr_key(j).as_str()], left) else { continue };
        let Some(raw) = raw.into_iter().next() else { continue };
        let Some(text) = crate::store::open_signed(&id.key, id.job, &addr_key(j), raw) else {
            continue; // forged: the dial that needs it says so
        };
        let Ok(addr) = String::from_utf8_lossy(&text).parse::<SocketAddr>() else { continue };
        match TcpStream::connect_timeout(&addr, left.min(PROBE_EACH)) {
            // A rank that gave up itself (its own rendezvous timed out first) left its reason
            // in the store before closing its listener: it counted in, and its own error
            // says what it saw. Only a rank that left no reason died.
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && !store.check(&[abort_key(j).as_str()]).unwrap_or(false) =>
            {
                gone.push(j);
            }
            _ => {} // alive, or not answering: not known to be gone
        }
    }
    gone
}

/// The longest a failed rendezvous spends probing published addresses.
const PROBE_BUDGET: Duration = Duration::from_secs(2);
/// The longest one probe waits for its connection.
const PROBE_EACH: Duration = Duration::from_millis(250);

/// Where one pair's connection stands, as this rank sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerConn {
    /// Not connected, and this rank is not dialling.
    Idle,
    /// This rank is dialling the peer.
    Dialing,
    /// Connected (by either side), or its handshake is completing.
    Connected,
}

/// Most dials one rank runs at once; more wait their turn. Each dial costs both ends CPU (the
/// handshake's MACs, a thread on the peer's side): with every rank dialling its whole mesh at
/// once, 16 per rank at 256 ranks on 2 cores left handshake threads descheduled for seconds.
const MAX_DIALS: usize = 4;

/// Connects pairs on demand: dial threads (at most [`MAX_DIALS`]) take the peers the engine
/// asks for, and the acceptor decides which incoming connections to keep. Both attach the
/// connections they make to the engine.
pub(crate) struct Connector {
    id: JobIdentity,
    cfg: LinkConfig,
    store: Arc<dyn Store>,
    state: Mutex<Vec<PeerConn>>,
    /// Peers' addresses, once looked up.
    addrs: Mutex<Vec<Option<SocketAddr>>>,
    engine: OnceLock<Weak<dyn TcpHost>>,
    stop: AtomicBool,
    queue: Mutex<VecDeque<usize>>,
    workers: AtomicUsize,
    /// Handshakes the acceptor's threads are running (at most [`MAX_HANDSHAKES`]).
    handshakes: Arc<AtomicUsize>,
    /// The ranks whose pairs are this listener's, where not all are (a QUIC job's ranks of
    /// this host): any other is refused.
    only: OnceLock<Vec<bool>>,
    /// The first dial that failed, with its own error (the core holds the poisoning).
    failure: Mutex<Option<Error>>,
    /// The abort reason is in the store, or on its way there ([`TcpTransport::note_failure`]).
    noted: AtomicBool,
    /// The thread writing the abort note, once started.
    note: Mutex<Option<JoinHandle<()>>>,
}

impl Connector {
    /// Start connecting `peer` (called under the engine lock; never blocks on the network).
    ///
    /// # Errors
    /// Why no thread could be started to connect it.
    pub(crate) fn request(self: &Arc<Self>, peer: usize) -> std::result::Result<(), String> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).push_back(peer);
        let mut cur = self.workers.load(Ordering::SeqCst);
        loop {
            if cur >= MAX_DIALS {
                return Ok(()); // the running workers take it
            }
            match self.workers.compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("tutti-dial-{}", self.id.rank))
            .spawn(move || me.work());
        spawned.map(|_| ()).map_err(|e| {
            self.workers.fetch_sub(1, Ordering::SeqCst);
            self.queue.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| *p != peer);
            format!("no thread could be started to connect to it: {e}")
        })
    }

    fn work(&self) {
        loop {
            let next = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                let next = q.pop_front();
                if next.is_none() {
                    // Leave under the queue's lock: a request made after this sees the slot
                    // free and starts a worker.
                    self.workers.fetch_sub(1, Ordering::SeqCst);
                }
                next
            };
            let Some(peer) = next else { return };
            if let Err(e) = self.dial(peer) {
                self.fail(peer, e);
            }
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Dial `peer` until connected (by us, or by the peer's dial crossing ours), the
    /// transport stops, or connecting fails.
    fn dial(&self, peer: usize) -> Result<()> {
        let rank = self.id.rank;
        let deadline = Instant::now() + self.cfg.connect_timeout;
        let mut backoff = Duration::from_millis(1);
        // A peer that says the pair is connected while we see no connection: its side of a
        // connection that broke in set-up, or its own dial that won, not yet visible here. It
        // clears within a handshake; for longer, it is another process with our rank.
        let mut duplicate_since: Option<Instant> = None;
        loop {
            if self.stopped() {
                return Ok(());
            }
            {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                match st[peer] {
                    // Connected by the peer's dial: done once the connection has joined the
                    // engine; its set-up may still fail (the pair is then Idle again), so look
                    // until it did.
                    PeerConn::Connected => {
                        drop(st);
                        if !self.link_pending(peer) {
                            return Ok(());
                        }
                        if Instant::now() >= deadline {
                            return Err(Error::Rendezvous {
                                rank,
                                detail: format!(
                                    "the connection from rank {peer} never finished its set-up \
                                     within {:?}",
                                    self.cfg.connect_timeout
                                ),
                            });
                        }
                        std::thread::sleep(crate::util::jitter(backoff));
                        backoff = (backoff * 2).min(Duration::from_millis(50));
                        continue;
                    }
                    PeerConn::Idle => st[peer] = PeerConn::Dialing,
                    PeerConn::Dialing => {}
                }
            }
            let addr = self.addr(peer, deadline)?;
            match connect_one(&self.id, peer, addr, deadline, &self.cfg, &|| self.stopped())? {
                Ok((s, link)) => {
                    let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    if st[peer] == PeerConn::Connected {
                        // Cannot happen by the crossing rule; keep the connection we have.
                        warn!(rank, peer, "a second connection to rank {peer}; dropped");
                        return Ok(());
                    }
                    st[peer] = PeerConn::Connected;
                    drop(st);
                    return self.attach(peer, s, link);
                }
                Err(st) => {
                    // Crossed: the peer (a lower rank) dials us too and its connection is
                    // kept; Duplicate: see `duplicate_since`. Look again shortly (the top of
                    // the loop sees a connection that arrived meanwhile).
                    let now = Instant::now();
                    let since = if st == handshake::Status::Duplicate {
                        *duplicate_since.get_or_insert(now)
                    } else {
                        duplicate_since = None;
                        now
                    };
                    if now.duration_since(since) > DUPLICATE_FOR {
                        return Err(Error::Rendezvous {
                            rank,
                            detail: format!(
                                "rank {peer} refused the connection: {} (for {:?})",
                                st.describe(),
                                now.duration_since(since)
                            ),
                        });
                    }
                    if Instant::now() >= deadline {
                        return Err(Error::Rendezvous {
                            rank,
                            detail: format!(
                                "rank {peer} said it was dialling us, but its connection \
                                 never came within {:?}",
                                self.cfg.connect_timeout
                            ),
                        });
                    }
                    std::thread::sleep(crate::util::jitter(backoff));
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
            }
        }
    }

    /// Whether `peer`'s link is still pending in the engine (true when the transport is gone:
    /// nothing is waited for then).
    fn link_pending(&self, peer: usize) -> bool {
        let Some(e) = self.engine.get().and_then(Weak::upgrade) else { return false };
        let mut pending = false;
        e.with_core(&mut |core| pending = core.is_pending(peer));
        pending
    }

    /// `peer`'s published address, looked up once.
    fn addr(&self, peer: usize, deadline: Instant) -> Result<SocketAddr> {
        if let Some(a) = self.addrs.lock().unwrap_or_else(|p| p.into_inner())[peer] {
            return Ok(a);
        }
        let rank = self.id.rank;
        let left = deadline.saturating_duration_since(Instant::now());
        let raw = crate::store::get_or(self.store.as_ref(), &addr_key(peer), left, || {
            Error::Rendezvous {
                rank,
                detail: format!(
                    "rank {peer}'s address is not in the store ({}): the store is gone (its \
                     server ended with the rank or launcher serving it) or the rank never \
                     published",
                    self.store.describe()
                ),
            }
        })?;
        let a = self.parse_addr(peer, raw)?;
        self.addrs.lock().unwrap_or_else(|p| p.into_inner())[peer] = Some(a);
        Ok(a)
    }

    fn parse_addr(&self, j: usize, raw: Vec<u8>) -> Result<SocketAddr> {
        let rank = self.id.rank;
        let raw = crate::store::open_signed(&self.id.key, self.id.job, &addr_key(j), raw)
            .ok_or_else(|| crate::store::forged(rank, j, "address"))?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        text.parse().map_err(|_| Error::Rendezvous {
            rank,
            detail: format!("rank {j} published an unparsable address {text:?}"),
        })
    }

    /// Hand a connected stream to the engine (its link comes up there).
    fn attach(&self, peer: usize, s: TcpStream, link: Option<ShmLink>) -> Result<()> {
        // A transport shutting down still takes it (the driver refuses once closed): the new
        // link carries its abort frame, or its close, so the peer learns why instead of
        // reading a bare end of stream.
        let Some(engine) = self.engine.get().and_then(Weak::upgrade) else {
            return Ok(()); // the transport is gone: the connection just closes
        };
        let now = Instant::now();
        let (mut stream, mut link) = (Some(s), link);
        let mut out = Ok(());
        engine.with_tcp(&mut |d, core| {
            if let Some(s) = stream.take() {
                out = d.attach(core, peer, s, link.take(), now);
            }
        });
        out.map_err(|e| {
            Error::io(self.id.rank, format!("configuring the connection to rank {peer}"), &e)
        })
    }

    /// Connecting `peer` failed: the link fails in the core (naming the peer, poisoning the
    /// transport as a lost link does). A peer that closed after it failed left its abort
    /// reason in the store ([`abort_key`]): then it is that abort that arrives.
    fn fail(&self, peer: usize, e: Error) {
        {
            // Not dialling any more: the peer's own dial is taken from now on (and, this
            // transport being poisoned, carries our abort back to it).
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if st[peer] == PeerConn::Dialing {
                st[peer] = PeerConn::Idle;
            }
        }
        if self.stopped() {
            return;
        }
        let how = match &e {
            Error::PeerLost { detail, .. } => match self.abort_note(peer) {
                Some(reason) => LinkFail::Aborted(reason),
                None => LinkFail::Lost(detail.clone()),
            },
            other => LinkFail::Lost(format!("connecting to it failed: {other}")),
        };
        warn!(rank = self.id.rank, peer, "connecting to rank {peer} failed: {e} ({how:?})");
        {
            let mut first = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            first.get_or_insert_with(|| e.clone());
        }
        if let Some(engine) = self.engine.get().and_then(Weak::upgrade) {
            let mut how = Some(how);
            engine.with_tcp(&mut |_, core| {
                if let Some(how) = how.take() {
                    core.link_failed(peer, how);
                }
            });
        }
    }

    /// The abort reason `peer` left in the store as it closed, if it did.
    fn abort_note(&self, peer: usize) -> Option<String> {
        let key = abort_key(peer);
        if !self.store.check(&[key.as_str()]).unwrap_or(false) {
            return None;
        }
        let raw = self.store.get(&key, Duration::from_secs(1)).ok()?;
        let raw = crate::store::open_signed(&self.id.key, self.id.job, &key, raw)?;
        Some(String::from_utf8_lossy(&raw).into_owned())
    }

    /// Whether to keep an authenticated incoming connection from `from`: yes when the pair
    /// is not connected and we are not dialling it, or when we dial it too and it is the lower
    /// rank (its dial wins); `Crossed` when we are the lower rank dialling it (ours wins);
    /// `Duplicate` when the pair is connected already; `WrongRank` when its pair is not this
    /// listener's ([`TcpSide::only`]).
    fn accept_from(&self, from: usize) -> handshake::Status {
        if self.only.get().is_some_and(|only| !only.get(from).copied().unwrap_or(false)) {
            return handshake::Status::WrongRank;
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match st[from] {
            PeerConn::Connected => handshake::Status::Duplicate,
            PeerConn::Dialing if from > self.id.rank => handshake::Status::Crossed,
            PeerConn::Idle | PeerConn::Dialing => {
                st[from] = PeerConn::Connected;
                handshake::Status::Ok
            }
        }
    }

    /// An accepted connection broke before it joined: the pair is unconnected again.
    fn release(&self, from: usize) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st[from] == PeerConn::Connected {
            st[from] = PeerConn::Idle;
        }
    }
}

/// How long a dial retries a peer that says the pair is connected while this rank sees no
/// connection, before it names a duplicate rank: the peer's side of a connection we gave up
/// on stays until its handshake thread sees our close, which on an overloaded host takes
/// seconds.
const DUPLICATE_FOR: Duration = Duration::from_secs(10);

/// Refusals in a row after which a dial takes a peer's published address for a closed
/// listener (with the backoff between them, about 15 ms): every address was published by a
/// rank already listening, so its process (or at least its transport) has ended.
const REFUSED_GONE: u32 = 4;

/// Dial `j` at `addr` and run the handshake: the stream and its shared-memory link, or the
/// refusal that says the pair is (being) connected the other way: `Crossed` (`j` dials us too
/// and its connection wins) or `Duplicate` (`j` holds a connection from us, or took its own
/// dial's).
fn connect_one(
    id: &JobIdentity,
    j: usize,
    addr: SocketAddr,
    deadline: Instant,
    cfg: &LinkConfig,
    cancelled: &dyn Fn() -> bool,
) -> Result<std::result::Result<(TcpStream, Option<ShmLink>), handshake::Status>> {
    let rank = id.rank;
    let mut backoff = Duration::from_millis(2);
    let mut refused = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if cancelled() {
            return Err(Error::Aborted { rank, reason: "the transport was dropped".into() });
        }
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
                if refused >= REFUSED_GONE {
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
                return Ok(Ok((s, link)));
            }
            Err(handshake::HsError::Refused(
                st @ (handshake::Status::Crossed | handshake::Status::Duplicate),
            )) => return Ok(Err(st)),
            // Something else answers at the address `j` published (checked against the job
            // key, so it was `j`'s): not a tutti rank, or one of another job — the port was
            // reused after `j`'s listener closed, so `j` has ended.
            Err(
                e @ (handshake::HsError::Magic
                | handshake::HsError::Malformed(_)
                | handshake::HsError::Proof
                | handshake::HsError::Refused(handshake::Status::WrongJob)),
            ) => {
                return Err(Error::PeerLost {
                    rank,
                    peer: j,
                    ctx: None,
                    detail: format!(
                        "the address rank {j} published ({addr}) now answers as another \
                         process ({e}): its process has ended"
                    ),
                })
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

fn accept_loop(listener: TcpListener, c: Arc<Connector>) {
    let rank = c.id.rank;
    let in_handshake = c.handshakes.clone();
    while !c.stopped() {
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
        let c = c.clone();
        let spawned =
            std::thread::Builder::new().name(format!("tutti-hs-{rank}")).spawn(move || {
                let _slot = slot;
                let deadline = Instant::now() + c.cfg.handshake_timeout;
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
                    key: &c.id.key,
                    job: c.id.job,
                    world: c.id.world as u32,
                    me: rank as u32,
                };
                // Which rank `accept_from` took, if the handshake fails after it did.
                let taken = std::cell::Cell::new(None);
                let accept = |r: u32| {
                    let st = c.accept_from(r as usize);
                    if st == handshake::Status::Ok {
                        taken.set(Some(r as usize));
                    }
                    st
                };
                let hs = handshake::server(&mut s, &expect, nonce, accept, deadline);
                if let (Err(_), Some(peer)) = (&hs, taken.get()) {
                    c.release(peer);
                }
                match hs {
                    Ok(h) => {
                        let peer = h.from as usize;
                        // The client is authenticated, and takes the connection as made as
                        // soon as it has sent its last message (the shared-memory answer): a
                        // server that gave up just before reading it would leave the client
                        // with a connection its peer closed (seen with 256 ranks on 2 cores,
                        // a client descheduled for seconds between reading the offer and
                        // answering). So the server waits for that answer as long as a connect
                        // may take; a client that gave up has closed, which ends it at once.
                        let deadline = deadline.max(Instant::now() + c.cfg.connect_timeout);
                        match shm::server_side(&mut s, c.cfg.shm, c.id.world, deadline) {
                            Ok(link) => {
                                let _ = s.set_read_timeout(None);
                                let _ = s.set_write_timeout(None);
                                if let Err(e) = c.attach(peer, s, link) {
                                    warn!(rank, peer, "connection from {from} unusable: {e}");
                                    c.release(peer);
                                }
                            }
                            Err(e) => {
                                // The peer dials again (or is gone): the pair is free again.
                                debug!(rank, peer, "connection from {from} broke: {e}");
                                c.release(peer);
                                let _ = s.shutdown(std::net::Shutdown::Both);
                            }
                        }
                    }
                    Err(handshake::HsError::Refused(handshake::Status::Crossed)) => {
                        debug!(rank, "crossed dials with {from}: ours is kept");
                    }
                    // A dial that crossed ours and arrived after ours completed: the dialler
                    // sees its pair connected and stops (a true duplicate rank is named by its
                    // own dial, which gives up after twice the handshake timeout).
                    Err(handshake::HsError::Refused(handshake::Status::Duplicate)) => {
                        debug!(rank, "a second connection from {from}: refused as a duplicate");
                    }
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

    fn publish_failure(&self) {
        self.side.note_failure();
    }
}

impl Drop for TcpSide {
    fn drop(&mut self) {
        // After a failure, peers that never connected to us and dial later find the listener
        // closed: leave them the reason first, while the listener still answers (if the call
        // that failed has not already), waiting for the note's write within `NOTE_WAIT`.
        self.note_failure();
        let note = self.connector.note.lock().unwrap_or_else(|p| p.into_inner()).take();
        wait_while(Instant::now() + NOTE_WAIT, || note.as_ref().is_some_and(|h| !h.is_finished()));
        // The connections shut down when the engine drops, after this. Dials under way stop at
        // their next look; a connection completing now joins the closing engine, which
        // answers it with the abort or close frame (or refuses it once closed).
        self.connector.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        // Handshakes under way, the acceptor's and our dials', finish first (within their
        // deadline; dials start no new attempt once stopped), so their connections join the
        // engine before it shuts down and carry its abort or close frame: a peer connecting
        // with us just as we failed or finished hears why, not a bare end of stream.
        let c = &self.connector;
        wait_while(Instant::now() + c.cfg.handshake_timeout, || {
            c.handshakes.load(Ordering::SeqCst) > 0 || c.workers.load(Ordering::SeqCst) > 0
        });
    }
}

/// Sleep in steps of a millisecond while `busy()`, until `until` at the latest.
fn wait_while(until: Instant, busy: impl Fn() -> bool) {
    while busy() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
}
