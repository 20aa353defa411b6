//! QUIC transport on quinn: TLS 1.3 with per-rank self-signed certificates whose fingerprints
//! travel through the authenticated rendezvous and are pinned by every peer.
//!
//! One QUIC connection per pair of ranks (the higher rank connects), and on it one long-lived
//! unidirectional stream per direction carrying the same frames as TCP (48-byte wire header plus
//! payload), so messages of one (peer, tag) stay in order. Tokio tasks on a small runtime owned
//! by the transport write queued frames and read arriving ones; a received payload is copied,
//! under the state lock, into the posted receive (or buffered when none is posted yet). A send
//! copies its payload once at post time, so cancelling never leaves quinn reading freed memory.
//! QUIC's own keep-alives and idle timeout replace TCP's: a silent peer is declared dead after
//! `dead_after`, with the same typed errors.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::transport::matcher::{
    self, Dest, Ops, PeerQueues, Posted, RawBuf, RecvPost, P2P_GROUP_BIT,
};
use crate::transport::tcp::{JobIdentity, TcpConfig};
use crate::transport::{OpId, Transport};
use crate::wire::{FrameKind, Header, MsgDesc, HEADER_LEN};

mod tls;

/// Largest abort reason accepted.
const MAX_REASON: u64 = 4096;
/// Store key under which rank `r` publishes `addr|fingerprint`.
pub fn quic_key(r: usize) -> String {
    format!("tutti/quic/{r}")
}

struct Out {
    id: Option<OpId>,
    hdr: [u8; HEADER_LEN],
    data: Bytes,
}

#[derive(Default)]
struct State {
    queues: Vec<PeerQueues>,
    ops: Ops,
    poisoned: Option<Error>,
    closed: Vec<bool>,
    unexpected_bytes: u64,
}

struct Shared {
    rank: usize,
    st: Mutex<State>,
    cv: Condvar,
    senders: Mutex<Vec<Option<mpsc::UnboundedSender<Out>>>>,
    unexpected_limit: u64,
    probe_after: Duration,
    spin: Duration,
    /// Until when (ns since `epoch`) the runtime's worker should busy-poll instead of parking.
    spin_until: std::sync::atomic::AtomicU64,
    epoch: Instant,
    /// Wakes the spinner task.
    spin_wake: tokio::sync::Notify,
    /// Send buffers, reused.
    pool: Arc<SendPool>,
}

/// Reused send buffers. A message is copied once at post time (so a cancelled send can never
/// leave quinn reading the caller's freed memory); copying into a fresh allocation page-faulted
/// on every large message (7 % of the sender's time at 64 MiB), so buffers come back here when
/// quinn drops them.
#[derive(Default)]
struct SendPool {
    free: Mutex<Vec<Vec<u8>>>,
}

/// Pooled bytes kept: enough for a few pipeline segments of every size in flight.
const POOL_BYTES: usize = 256 << 20;

struct Pooled {
    buf: Vec<u8>,
    pool: Arc<SendPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + buf.capacity() <= POOL_BYTES {
            free.push(buf);
        }
    }
}

impl SendPool {
    /// `data` copied into a pooled buffer (the smallest free one that fits).
    fn copy(self: &Arc<Self>, data: &[u8]) -> Bytes {
        let mut buf = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= data.len())
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            match best {
                Some(i) => free.swap_remove(i),
                None => Vec::with_capacity(data.len()),
            }
        };
        buf.clear();
        buf.extend_from_slice(data);
        Bytes::from_owner(Pooled { buf, pool: self.clone() })
    }
}

/// Where an arriving payload goes.
enum Sink {
    Posted(RecvPost),
    Unexpected(Vec<u8>),
    Discard,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the worker should still busy-poll.
    fn spinning(&self) -> bool {
        let now = self.epoch.elapsed().as_nanos() as u64;
        now < self.spin_until.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A thread starts waiting: busy-poll for the spin period.
    fn spin_for_waiter(&self) {
        let until = (self.epoch.elapsed() + self.spin).as_nanos() as u64;
        let prev = self.spin_until.fetch_max(until, std::sync::atomic::Ordering::Relaxed);
        let now = self.epoch.elapsed().as_nanos() as u64;
        if prev <= now {
            self.spin_wake.notify_one();
        }
    }

    fn send_frame(&self, peer: usize, out: Out) -> bool {
        let s = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        s.get(peer).and_then(Option::as_ref).is_some_and(|tx| tx.send(out).is_ok())
    }

    /// Fail everything, tell every live peer why, stop taking work.
    fn poison(&self, st: &mut State, err: Error, reason: &str) {
        if st.poisoned.is_some() {
            return;
        }
        warn!(rank = self.rank, "transport poisoned: {err}");
        let e2 = err.clone();
        st.ops.fail_all(|_, _| e2.clone());
        for q in st.queues.iter_mut() {
            q.clear_posted();
        }
        st.poisoned = Some(err);
        let reason = reason.as_bytes();
        let reason = Bytes::copy_from_slice(&reason[..reason.len().min(MAX_REASON as usize)]);
        let n = st.queues.len();
        for p in (0..n).filter(|p| *p != self.rank && !st.closed[*p]) {
            let hdr = Header::control(FrameKind::Abort, self.rank, reason.len()).encode();
            self.send_frame(p, Out { id: None, hdr, data: reason.clone() });
        }
        self.cv.notify_all();
    }

    fn peer_failed(&self, peer: usize, detail: String) {
        let mut st = self.lock();
        if st.closed[peer] || st.poisoned.is_some() {
            st.closed[peer] = true;
            self.cv.notify_all();
            return;
        }
        st.closed[peer] = true;
        let rank = self.rank;
        let d2 = detail.clone();
        st.ops.fail_peer(peer, |ctx| Error::PeerLost {
            rank,
            peer,
            ctx: Some(Box::new(ctx)),
            detail: d2.clone(),
        });
        st.queues[peer].clear_posted();
        let reason = format!("rank {rank} lost its connection to rank {peer} ({detail})");
        self.poison(&mut st, Error::PeerLost { rank, peer, ctx: None, detail }, &reason);
    }

    fn peer_aborted(&self, peer: usize, reason: String) {
        let mut st = self.lock();
        st.closed[peer] = true;
        let err = Error::PeerAborted { rank: self.rank, peer, reason: reason.clone() };
        self.poison(&mut st, err, &reason);
    }

    fn peer_closing(&self, peer: usize) {
        let mut st = self.lock();
        st.closed[peer] = true;
        let rank = self.rank;
        st.ops.fail_peer(peer, |ctx| Error::PeerLost {
            rank,
            peer,
            ctx: Some(Box::new(ctx)),
            detail: "the peer closed its transport (it finished or exited) while this operation still needed it".into(),
        });
        st.queues[peer].clear_posted();
        self.cv.notify_all();
    }

    fn probe(&self, peer: usize, desc: MsgDesc) {
        let mut st = self.lock();
        if let Some(mine) = st.ops.conflict(&desc) {
            let err = Error::Mismatch {
                rank: self.rank,
                peer,
                expected: mine.to_string(),
                got: format!("{desc} (rank {peer} is waiting in it)"),
            };
            let reason = err.to_string();
            self.poison(&mut st, err, &reason);
        }
    }

    fn fail_stale(&self, st: &mut State, peer: usize, stale: Vec<RecvPost>, got: &MsgDesc) {
        for p in stale {
            let err = matcher::stale_error(self.rank, peer, &p, got);
            st.ops.fail(p.id, err);
        }
    }

    /// A data header arrived: decide where its payload goes.
    fn start_data(&self, peer: usize, desc: &MsgDesc, len: u64) -> Sink {
        let mut st = self.lock();
        let mut stale = Vec::new();
        let dest = st.queues[peer].arrive(desc, &mut stale);
        self.fail_stale(&mut st, peer, stale, desc);
        match dest {
            Dest::Posted(post) => {
                let at = st.ops.pending(post.id).map_or_else(Instant::now, |p| p.3);
                match matcher::check(self.rank, peer, &post, desc, len, at) {
                    Ok(()) => Sink::Posted(post),
                    Err(e) => {
                        st.ops.fail(post.id, e);
                        self.cv.notify_all();
                        Sink::Discard
                    }
                }
            }
            Dest::Unexpected => {
                let total = st.unexpected_bytes.saturating_add(len);
                if total > self.unexpected_limit {
                    let err = Error::UnexpectedOverflow {
                        rank: self.rank,
                        peer,
                        bytes: total,
                        limit: self.unexpected_limit,
                    };
                    let reason = err.to_string();
                    self.poison(&mut st, err, &reason);
                    return Sink::Discard;
                }
                st.unexpected_bytes = total;
                // Bounded by the budget just checked.
                Sink::Unexpected(Vec::with_capacity(len as usize))
            }
        }
    }

    /// Copy `chunk` to offset `at` of a posted receive, if it is still posted.
    fn fill(&self, post: &RecvPost, at: usize, chunk: &[u8]) {
        let st = self.lock();
        if st.ops.pending(post.id).is_some() {
            // SAFETY: the receive is still posted (checked under the lock that `cancel` takes),
            // so its buffer is valid for `cap` bytes, and `at + chunk.len() <= len <= cap` was
            // checked when the header arrived.
            unsafe {
                std::ptr::copy_nonoverlapping(chunk.as_ptr(), post.buf.0.add(at), chunk.len())
            };
        }
    }

    fn finish_data(&self, peer: usize, sink: Sink, desc: MsgDesc, len: usize) {
        let mut st = self.lock();
        match sink {
            Sink::Posted(post) => st.ops.complete(post.id, len),
            Sink::Unexpected(data) => {
                let mut stale = Vec::new();
                match st.queues[peer].arrive(&desc, &mut stale) {
                    Dest::Posted(post) => {
                        st.unexpected_bytes -= data.len() as u64;
                        matcher::deliver(self.rank, peer, &mut st.ops, post, &desc, &data);
                    }
                    Dest::Unexpected => st.queues[peer].push_unexpected(desc, data),
                }
                self.fail_stale(&mut st, peer, stale, &desc);
            }
            Sink::Discard => {}
        }
        self.cv.notify_all();
    }
}

async fn sender(
    shared: Arc<Shared>,
    peer: usize,
    mut stream: quinn::SendStream,
    mut rx: mpsc::UnboundedReceiver<Out>,
) {
    while let Some(out) = rx.recv().await {
        let len = out.data.len();
        let r = async {
            stream.write_all(&out.hdr).await?;
            if len > 0 {
                stream.write_chunk(out.data).await?;
            }
            Ok::<(), quinn::WriteError>(())
        }
        .await;
        match r {
            Ok(()) => {
                if let Some(id) = out.id {
                    let mut st = shared.lock();
                    st.ops.complete(id, len);
                    shared.cv.notify_all();
                }
            }
            Err(e) => {
                shared.peer_failed(peer, format!("sending failed: {e}"));
                return;
            }
        }
    }
    let _ = stream.finish();
    let _ = stream.stopped().await;
}

async fn reader(shared: Arc<Shared>, peer: usize, mut stream: quinn::RecvStream) {
    let mut hb = [0u8; HEADER_LEN];
    loop {
        if let Err(e) = stream.read_exact(&mut hb).await {
            shared.peer_failed(peer, format!("stream from the peer ended: {e}"));
            return;
        }
        let hdr = match Header::decode(&hb) {
            Ok(h) if h.src as usize == peer => h,
            Ok(h) => {
                return shared.peer_failed(
                    peer,
                    format!("protocol error: frame claims source rank {}", h.src),
                )
            }
            Err(e) => {
                return shared
                    .peer_failed(peer, format!("protocol error: undecodable frame header: {e}"))
            }
        };
        match hdr.kind {
            FrameKind::KeepAlive if hdr.len == 0 => {}
            FrameKind::Close if hdr.len == 0 => {
                shared.peer_closing(peer);
                // Answer with our own close (nothing more will go to a rank that left), so a
                // peer waiting in its shutdown for our close need not wait for our own exit.
                let hdr = Header::control(FrameKind::Close, shared.rank, 0).encode();
                shared.send_frame(peer, Out { id: None, hdr, data: Bytes::new() });
                if let Some(s) =
                    shared.senders.lock().unwrap_or_else(|p| p.into_inner()).get_mut(peer)
                {
                    *s = None;
                }
                return;
            }
            FrameKind::Probe if hdr.len == 0 => shared.probe(peer, hdr.desc),
            FrameKind::Abort if hdr.len <= MAX_REASON => {
                let mut r = vec![0u8; hdr.len as usize];
                let _ = stream.read_exact(&mut r).await;
                return shared.peer_aborted(peer, String::from_utf8_lossy(&r).into_owned());
            }
            FrameKind::Data => {
                let Ok(len) = usize::try_from(hdr.len) else {
                    return shared
                        .peer_failed(peer, format!("protocol error: frame length {}", hdr.len));
                };
                let mut sink = shared.start_data(peer, &hdr.desc, hdr.len);
                let mut done = 0;
                while done < len {
                    // Chunks straight from quinn's receive buffers: one copy, into the posted
                    // receive (or the unexpected queue).
                    let chunk = match stream.read_chunk(len - done, true).await {
                        Ok(Some(c)) => c.bytes,
                        Ok(None) => {
                            return shared.peer_failed(
                                peer,
                                "stream from the peer ended mid-message".to_string(),
                            )
                        }
                        Err(e) => {
                            return shared.peer_failed(
                                peer,
                                format!("stream from the peer ended mid-message: {e}"),
                            )
                        }
                    };
                    let n = chunk.len();
                    match &mut sink {
                        Sink::Posted(post) => shared.fill(post, done, &chunk),
                        Sink::Unexpected(v) => v.extend_from_slice(&chunk),
                        Sink::Discard => {}
                    }
                    done += n;
                }
                shared.finish_data(peer, sink, hdr.desc, len);
            }
            _ => {
                return shared
                    .peer_failed(peer, format!("protocol error: bad {:?} frame", hdr.kind))
            }
        }
    }
}

/// The QUIC transport of one rank.
pub struct QuicTransport {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    local: SocketAddr,
    endpoint: quinn::Endpoint,
    rt: Option<tokio::runtime::Runtime>,
    /// This rank's certificate fingerprint (as published); read by tests.
    #[allow(dead_code)]
    fp: [u8; 32],
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("rank", &self.rank)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// Datagram size on loopback: the largest UDP payload (65,527) less IP options headroom.
const LOOPBACK_MTU: u16 = 65_000;

/// Set the UDP socket buffers to `want` bytes (forcing past `net.core.rmem_max` where the process
/// may, as root does); returns the receive buffer the kernel granted.
fn udp_buffers(s: &socket2::SockRef<'_>, want: usize) -> usize {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    for (force, plain) in
        [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)]
    {
        let v = want as libc::c_int;
        // SAFETY: setsockopt with a valid fd and a c_int option value.
        let forced = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                force,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        } == 0;
        if !forced {
            // SAFETY: as above.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    plain,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }
    s.recv_buffer_size().unwrap_or(212_992)
}

/// Bytes a peer may have unacknowledged towards us: the kernel's receive buffer shared by the
/// `world - 1` peers, with headroom (the buffer also pays per-datagram overhead).
fn in_flight_limit(rcvbuf: usize, world: usize) -> u64 {
    let per_peer = rcvbuf / 2 / world.saturating_sub(1).max(1);
    per_peer.clamp(256 << 10, 128 << 20) as u64
}

fn transport_config(cfg: &TcpConfig, loopback: bool, in_flight: u64) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    // Windows sized for a datacenter bandwidth-delay product (10 GB/s x 2 ms = 20 MB) and so
    // that a 64 MiB message never waits for window updates more than a few times.
    t.stream_receive_window(quinn::VarInt::from_u32(64 << 20));
    t.receive_window(quinn::VarInt::from_u32(128 << 20));
    // What this rank sends unacknowledged; sized from our own receive buffer, as the peers run
    // with the same settings (more than their kernel holds is dropped, and a drop halves the
    // congestion window).
    t.send_window(in_flight);
    t.keep_alive_interval(Some(cfg.keepalive_interval));
    // Collectives are latency-bound request/response chains: acknowledge at once (the default
    // lets a receiver wait up to 25 ms, which stalls a sender whose window is full) and start
    // with a window that covers a pipeline segment instead of ten packets.
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.max_ack_delay(Some(Duration::from_micros(500)));
    ack.ack_eliciting_threshold(quinn::VarInt::from_u32(1));
    t.ack_frequency_config(Some(ack));
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(2 << 20);
    t.congestion_controller_factory(Arc::new(cubic));
    if let Ok(idle) = quinn::IdleTimeout::try_from(cfg.dead_after) {
        t.max_idle_timeout(Some(idle));
    }
    if loopback {
        // Loopback carries 64 KiB datagrams: start there. One datagram per `sendmsg` (no GSO):
        // a GSO batch of 64 KiB segments exceeds the kernel's 64 KiB limit per send, the batch
        // is dropped, quinn counts the losses, its black-hole detection falls back to 1,200-byte
        // packets and the congestion window collapses (measured: 1.3 M datagrams of 1,200
        // bytes and ~100 losses per 32 MiB run before, see docs/transport.md).
        let mtu = std::env::var("TUTTI_QUIC_MTU").ok().and_then(|v| v.parse::<u16>().ok());
        t.initial_mtu(mtu.unwrap_or(LOOPBACK_MTU));
        t.mtu_discovery_config(None);
        t.enable_segmentation_offload(false);
    }
    t
}

impl QuicTransport {
    /// Connect this rank to every other rank over QUIC, exchanging addresses and certificate
    /// fingerprints through `store`.
    ///
    /// # Errors
    /// [`Error::Io`] when the UDP socket cannot be bound; [`Error::Rendezvous`] naming the ranks
    /// that did not publish or connect in time, or whose certificate did not match.
    pub fn connect(id: &JobIdentity, store: &dyn Store, cfg: &TcpConfig) -> Result<QuicTransport> {
        let (rank, world) = (id.rank, id.world);
        let start = Instant::now();
        let deadline = start + cfg.connect_timeout;
        let rv = |detail: String| Error::Rendezvous { rank, detail };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(
                std::env::var("TUTTI_QUIC_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(1),
            )
            .thread_name(format!("tutti-quic-{rank}"))
            .enable_all()
            .build()
            .map_err(|e| Error::io(rank, "starting the QUIC runtime", &e))?;
        let me = tls::Identity::generate().map_err(rv)?;
        let sock = UdpSocket::bind(SocketAddr::new(cfg.bind_ip, cfg.port))
            .map_err(|e| Error::io(rank, format!("binding UDP {}", cfg.bind_ip), &e))?;
        let local = sock.local_addr().map_err(|e| Error::io(rank, "UDP address", &e))?;
        // Bursts of a pipeline segment overflow the default UDP receive buffer (~200 KiB) and
        // every drop halves the congestion window: ask for 32 MiB (the kernel caps it at
        // net.core.rmem_max / wmem_max unless we may force it), then keep what the peers may
        // have in flight towards us within what the kernel will actually hold.
        let rcvbuf = {
            let s2 = socket2::SockRef::from(&sock);
            udp_buffers(&s2, 32 << 20)
        };
        let in_flight = in_flight_limit(rcvbuf, world);
        store.set(&quic_key(rank), format!("{local}|{}", tls::hex(&me.fp)).as_bytes())?;
        // Everyone's address and fingerprint, from the authenticated store.
        let mut peers: Vec<Option<(SocketAddr, [u8; 32])>> = vec![None; world];
        for (j, slot) in peers.iter_mut().enumerate().filter(|(j, _)| *j != rank) {
            let left = deadline.saturating_duration_since(Instant::now());
            let raw = store.get(&quic_key(j), left).map_err(|_| {
                rv(format!(
                    "rank {j} did not publish its QUIC address within {:?}",
                    cfg.connect_timeout
                ))
            })?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let parsed =
                text.split_once('|').and_then(|(a, f)| Some((a.parse().ok()?, tls::unhex(f)?)));
            *slot = Some(parsed.ok_or_else(|| {
                rv(format!("rank {j} published a malformed QUIC address {text:?}"))
            })?);
        }
        let allowed: HashMap<[u8; 32], usize> =
            peers.iter().enumerate().filter_map(|(j, p)| p.map(|(_, fp)| (fp, j))).collect();
        let server_tls =
            tls::server_config(&me, allowed.clone()).map_err(|e| rv(format!("TLS: {e}")))?;
        let server_crypto = quinn::crypto::rustls::QuicServerConfig::try_from(server_tls)
            .map_err(|e| rv(format!("QUIC TLS: {e}")))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        // Every peer on this host's loopback (a single-machine job): 64 KiB datagrams work.
        let loopback = cfg.bind_ip.is_loopback()
            || peers
                .iter()
                .flatten()
                .all(|(addr, _): &(SocketAddr, [u8; 32])| addr.ip().is_loopback());
        server.transport_config(Arc::new(transport_config(cfg, loopback, in_flight)));
        let endpoint = {
            let _g = rt.enter();
            let mut ec = quinn::EndpointConfig::default();
            if loopback {
                // Accept the large datagrams loopback allows (see `transport_config`).
                let _ = ec.max_udp_payload_size(65_527);
            }
            quinn::Endpoint::new(ec, Some(server), sock, Arc::new(quinn::TokioRuntime))
                .map_err(|e| Error::io(rank, "creating the QUIC endpoint", &e))?
        };
        let shared = Arc::new(Shared {
            rank,
            st: Mutex::new(State {
                queues: (0..world).map(|_| PeerQueues::default()).collect(),
                closed: vec![false; world],
                ..State::default()
            }),
            cv: Condvar::new(),
            senders: Mutex::new((0..world).map(|_| None).collect()),
            unexpected_limit: cfg.unexpected_limit,
            probe_after: cfg.probe_after,
            spin: cfg.spin,
            spin_until: std::sync::atomic::AtomicU64::new(0),
            epoch: Instant::now(),
            spin_wake: tokio::sync::Notify::new(),
            pool: Arc::new(SendPool::default()),
        });
        // While a thread waits for an operation, keep the runtime's worker polling the socket
        // instead of parking: a parked worker takes tens of µs to wake on this kind of VM, twice
        // per message (the sender's and the receiver's), which was most of QUIC's latency.
        {
            let sh = shared.clone();
            rt.spawn(async move {
                loop {
                    sh.spin_wake.notified().await;
                    while sh.spinning() {
                        // Give the CPU to the waiting thread between polls (2 cores, 2+ ranks).
                        std::thread::yield_now();
                        tokio::task::yield_now().await;
                    }
                }
            });
        }
        let timeout = cfg.connect_timeout;
        let conns: Result<Vec<(usize, quinn::Connection)>> = rt.block_on(async {
            let mut out = Vec::new();
            for (j, p) in peers.iter().enumerate().take(rank) {
                let Some((addr, fp)) = p else { continue };
                let client_tls =
                    tls::client_config(&me, *fp).map_err(|e| rv(format!("TLS: {e}")))?;
                let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client_tls)
                    .map_err(|e| rv(format!("QUIC TLS: {e}")))?;
                let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
                cc.transport_config(Arc::new(transport_config(cfg, loopback, in_flight)));
                let connecting = endpoint
                    .connect_with(cc, *addr, "tutti")
                    .map_err(|e| rv(format!("connecting to rank {j} at {addr}: {e}")))?;
                let conn = tokio::time::timeout(timeout, connecting)
                    .await
                    .map_err(|_| {
                        rv(format!("rank {j} at {addr} did not answer within {timeout:?}"))
                    })?
                    .map_err(|e| {
                        rv(format!("rank {j} at {addr} refused the QUIC connection: {e}"))
                    })?;
                out.push((j, conn));
            }
            let higher = world - rank - 1;
            let mut got = 0;
            while got < higher {
                let left = deadline.saturating_duration_since(Instant::now());
                let incoming = match tokio::time::timeout(left, endpoint.accept()).await {
                    Ok(Some(i)) => i,
                    _ => {
                        let have: Vec<usize> = out.iter().map(|(j, _)| *j).collect();
                        let missing: Vec<usize> =
                            (rank + 1..world).filter(|j| !have.contains(j)).collect();
                        return Err(rv(format!(
                            "ranks {missing:?} did not connect over QUIC within {timeout:?}"
                        )));
                    }
                };
                let conn = match incoming.await {
                    Ok(c) => c,
                    Err(e) => {
                        warn!(rank, "refused QUIC connection: {e}");
                        continue;
                    }
                };
                let peer = conn
                    .peer_identity()
                    .and_then(|i| {
                        i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok()
                    })
                    .and_then(|certs| certs.first().map(|c| tls::fingerprint(c)))
                    .and_then(|fp| allowed.get(&fp).copied());
                match peer {
                    Some(j) if j > rank && !out.iter().any(|(k, _)| *k == j) => {
                        out.push((j, conn));
                        got += 1;
                    }
                    other => {
                        warn!(rank, ?other, "refused QUIC connection from an unexpected rank");
                        conn.close(quinn::VarInt::from_u32(1), b"unexpected rank");
                    }
                }
            }
            Ok(out)
        });
        let conns = conns?;
        // Streams: each side opens one and announces itself with its rank, then accepts the
        // peer's.
        let streams: Result<Vec<(usize, quinn::SendStream, quinn::RecvStream, quinn::Connection)>> =
            rt.block_on(async {
                let mut out = Vec::new();
                for (j, conn) in conns {
                    let mut tx = conn
                        .open_uni()
                        .await
                        .map_err(|e| rv(format!("opening a stream to rank {j}: {e}")))?;
                    tx.write_all(&(rank as u32).to_le_bytes())
                        .await
                        .map_err(|e| rv(format!("writing to rank {j}: {e}")))?;
                    out.push((j, tx, conn));
                }
                let mut full = Vec::new();
                for (j, tx, conn) in out {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let mut rx = tokio::time::timeout(left, conn.accept_uni())
                        .await
                        .map_err(|_| rv(format!("rank {j} opened no stream in time")))?
                        .map_err(|e| rv(format!("accepting the stream of rank {j}: {e}")))?;
                    let mut who = [0u8; 4];
                    rx.read_exact(&mut who)
                        .await
                        .map_err(|e| rv(format!("reading rank {j}'s stream: {e}")))?;
                    if u32::from_le_bytes(who) as usize != j {
                        return Err(rv(format!(
                            "the stream of rank {j} claims rank {}",
                            u32::from_le_bytes(who)
                        )));
                    }
                    full.push((j, tx, rx, conn));
                }
                Ok(full)
            });
        for (j, tx, rx, conn) in streams? {
            let (stx, srx) = mpsc::unbounded_channel();
            shared.senders.lock().unwrap_or_else(|p| p.into_inner())[j] = Some(stx);
            rt.spawn(sender(shared.clone(), j, tx, srx));
            rt.spawn(reader(shared.clone(), j, rx));
            let sh = shared.clone();
            rt.spawn(async move {
                let e = conn.closed().await;
                let st = conn.stats();
                debug!(
                    rank = sh.rank,
                    peer = j,
                    mtu = st.path.current_mtu,
                    cwnd = st.path.cwnd,
                    rtt = ?st.path.rtt,
                    lost = st.path.lost_packets,
                    congestion_events = st.path.congestion_events,
                    sent = st.path.sent_packets,
                    udp_tx = ?st.udp_tx,
                    "quic connection statistics"
                );
                let detail = match e {
                    // The peer dropped its transport (our own shutdown closes with code 0): the
                    // same clean close as a close frame, which may still be queued behind it.
                    quinn::ConnectionError::ApplicationClosed(c) if c.error_code == quinn::VarInt::from_u32(0) => {
                        sh.peer_closing(j);
                        return;
                    }
                    quinn::ConnectionError::LocallyClosed => return,
                    quinn::ConnectionError::TimedOut => "nothing (not even a keep-alive) arrived from the peer within the idle timeout: the process is stopped (SIGSTOP), hung, or its host is unreachable".to_string(),
                    other => format!("QUIC connection lost: {other}"),
                };
                sh.peer_failed(j, detail);
            });
        }
        // Every rank is connected: any later connection attempt is refused at once.
        let ep = endpoint.clone();
        rt.spawn(async move {
            while let Some(incoming) = ep.accept().await {
                warn!(rank, remote = %incoming.remote_address(), "refused QUIC connection after start-up");
                incoming.refuse();
            }
        });
        info!(rank, world, %local, loopback, elapsed = ?start.elapsed(), "quic transport connected");
        Ok(QuicTransport { rank, world, shared, local, endpoint, rt: Some(rt), fp: me.fp })
    }

    /// The UDP address this rank listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Transport for QuicTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        "quic"
    }

    unsafe fn post_send(
        &self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world, peer, "send")?;
        let slice: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees the range is readable; it is copied before return.
            unsafe { std::slice::from_raw_parts(data, len) }
        };
        let mut st = self.shared.lock();
        if let Some(e) = &st.poisoned {
            return Err(e.poisoned());
        }
        let id = st.ops.insert(peer, desc, len);
        if peer == self.rank {
            let mut stale = Vec::new();
            match st.queues[peer].arrive(&desc, &mut stale) {
                Dest::Posted(post) => {
                    matcher::deliver(self.rank, peer, &mut st.ops, post, &desc, slice)
                }
                Dest::Unexpected => {
                    st.unexpected_bytes += len as u64;
                    st.queues[peer].push_unexpected(desc, slice.to_vec());
                }
            }
            st.ops.complete(id, len);
            self.shared.cv.notify_all();
            return Ok(id);
        }
        if st.closed[peer] {
            st.ops.forget(id);
            return Err(Error::PeerLost {
                rank: self.rank,
                peer,
                ctx: Some(Box::new(matcher::context(&desc, 0, len as u64, Instant::now()))),
                detail: "the connection to the peer is closed".into(),
            });
        }
        let hdr = Header::data(desc, self.rank, len).encode();
        if !self
            .shared
            .send_frame(peer, Out { id: Some(id), hdr, data: self.shared.pool.copy(slice) })
        {
            st.ops.forget(id);
            return Err(Error::PeerLost {
                rank: self.rank,
                peer,
                ctx: None,
                detail: "the sender task is gone".into(),
            });
        }
        Ok(id)
    }

    unsafe fn post_recv(
        &self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world, peer, "recv")?;
        let mut st = self.shared.lock();
        if let Some(e) = &st.poisoned {
            return Err(e.poisoned());
        }
        let id = st.ops.insert(peer, desc, cap);
        let post = RecvPost { id, desc, buf: RawBuf(buf), cap };
        match st.queues[peer].post(post) {
            Posted::Matched(post, got, data) => {
                st.unexpected_bytes -= data.len() as u64;
                matcher::deliver(self.rank, peer, &mut st.ops, post, &got, &data);
            }
            Posted::Stale(post, got) => {
                let err = matcher::stale_error(self.rank, peer, &post, &got);
                st.ops.fail(id, err);
            }
            Posted::Queued if st.closed[peer] && peer != self.rank => {
                st.queues[peer].remove(id);
                let err = Error::PeerLost {
                    rank: self.rank,
                    peer,
                    ctx: Some(Box::new(matcher::context(&desc, 0, cap as u64, Instant::now()))),
                    detail: "the connection to the peer is closed".into(),
                };
                st.ops.fail(id, err);
            }
            Posted::Queued => {}
        }
        Ok(id)
    }

    fn wait(&self, op: OpId, deadline: Instant) -> Result<usize> {
        let start = Instant::now();
        let mut probed = false;
        self.shared.spin_for_waiter();
        let mut st = self.shared.lock();
        loop {
            if let Some(r) = st.ops.take_finished(op) {
                return r;
            }
            let Some((peer, desc, bytes, posted)) = st.ops.pending(op) else {
                return Err(matcher::not_posted(self.rank, op));
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(matcher::timed_out(self.rank, peer, &desc, 0, bytes, posted, deadline));
            }
            if now.duration_since(start) < self.shared.spin {
                drop(st);
                std::thread::yield_now();
                st = self.shared.lock();
                continue;
            }
            if !probed && now.duration_since(start) >= self.shared.probe_after {
                probed = true;
                if peer != self.rank && desc.tag.group & P2P_GROUP_BIT == 0 {
                    let mut h = Header::data(desc, self.rank, 0);
                    h.kind = FrameKind::Probe;
                    self.shared
                        .send_frame(peer, Out { id: None, hdr: h.encode(), data: Bytes::new() });
                }
            }
            let mut until = deadline;
            if !probed {
                until = until.min(start + self.shared.probe_after);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, until.saturating_duration_since(now))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn test(&self, op: OpId) -> Result<Option<usize>> {
        self.shared.lock().ops.take_finished(op).transpose()
    }

    fn cancel(&self, op: OpId) {
        let mut st = self.shared.lock();
        for q in st.queues.iter_mut() {
            if q.remove(op) {
                break;
            }
        }
        st.ops.forget(op);
    }

    fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        let err = Error::Aborted { rank: self.rank, reason: reason.to_string() };
        self.shared.poison(&mut st, err, reason);
    }

    fn poisoned(&self) -> Option<Error> {
        self.shared.lock().poisoned.clone()
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        // Clean shutdown: a close frame on every stream, then wait (bounded) until every peer
        // has closed too, so no frame in flight is cut off by the connection close.
        let n = self.world;
        for p in (0..n).filter(|p| *p != self.rank) {
            let hdr = Header::control(FrameKind::Close, self.rank, 0).encode();
            self.shared.send_frame(p, Out { id: None, hdr, data: Bytes::new() });
        }
        self.shared
            .senders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter_mut()
            .for_each(|s| *s = None);
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut st = self.shared.lock();
        while !(0..n).filter(|p| *p != self.rank).all(|p| st.closed[p]) && Instant::now() < deadline
        {
            st = self
                .shared
                .cv
                .wait_timeout(st, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(st);
        if let Some(rt) = self.rt.take() {
            let ep = self.endpoint.clone();
            rt.block_on(async move {
                ep.close(quinn::VarInt::from_u32(0), b"done");
                let _ = tokio::time::timeout(Duration::from_millis(500), ep.wait_idle()).await;
            });
            rt.shutdown_timeout(Duration::from_millis(200));
        }
        debug!(rank = self.rank, "quic transport closed");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::testing::quic_world;
    use crate::transport::TransportExt;
    use crate::wire::{DType, Fingerprint, OpKind, Tag};

    fn desc(step: u32) -> MsgDesc {
        MsgDesc {
            tag: Tag { group: 0, seq: 0, step },
            fp: Fingerprint {
                op: OpKind::Control,
                dtype: DType::U8,
                redop: 0,
                root: u32::MAX,
                count: 0,
            },
        }
    }

    fn exchange_ok(ts: &[QuicTransport], step: u32) {
        std::thread::scope(|s| {
            s.spawn(|| ts[0].send(1, desc(step), b"still fine", Duration::from_secs(30)).unwrap());
            let mut b = [0u8; 10];
            ts[1].recv(0, desc(step), &mut b, Duration::from_secs(30)).unwrap();
            assert_eq!(&b, b"still fine");
        });
    }

    #[test]
    fn random_udp_datagrams_do_not_disturb_the_group() {
        let ts = quic_world(2, &TcpConfig::default()).unwrap();
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut x: u64 = 0x1234_5678;
        for i in 0..2000 {
            let len = 1 + (i * 37) % 1400;
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (x >> 56) as u8
                })
                .collect();
            let _ = sock.send_to(&junk, ts[(i % 2) as usize].local_addr());
        }
        exchange_ok(&ts, 1);
        assert!(ts[0].poisoned().is_none() && ts[1].poisoned().is_none());
    }

    #[test]
    fn a_certificate_that_was_not_published_is_refused() {
        let ts = quic_world(2, &TcpConfig::default()).unwrap();
        let target = ts[0].local_addr();
        // A stranger with its own self-signed certificate, pinning rank 0's real fingerprint
        // (so only the server side's check can refuse it).
        let stranger = tls::Identity::generate().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let refused = rt.block_on(async {
            let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            // Even knowing rank 0's real fingerprint (so the client side is satisfied), the
            // stranger's own certificate is not in the job's published set: rank 0 refuses.
            let tls_cfg = tls::client_config(&stranger, ts[0].fp).unwrap();
            let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls_cfg).unwrap();
            let conn = ep
                .connect_with(quinn::ClientConfig::new(Arc::new(crypto)), target, "tutti")
                .unwrap();
            tokio::time::timeout(Duration::from_secs(5), conn)
                .await
                .map(|r| r.is_err())
                .unwrap_or(true)
        });
        assert!(refused, "a stranger's QUIC connection was accepted");
        exchange_ok(&ts, 2);
    }
}
