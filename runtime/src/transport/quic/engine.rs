//! The QUIC progress engine: quinn-proto's state machines for every peer, driven by whichever
//! thread waits.
//!
//! No async runtime and no I/O thread on the data path, as in the TCP engine. A thread in
//! [`Engine::wait`] reads datagrams from the one UDP socket, feeds them to the endpoint and the
//! connections, copies arriving stream data into posted receives, writes queued frames into the
//! send streams and transmits the packets quinn-proto builds. Posting a send does the same for
//! that peer at once, so a small message is encrypted and on the wire before `post_send`
//! returns. A background thread takes over only while nobody waits: it sleeps in `ppoll` on the
//! socket until a datagram or a quinn timer (ACK delay, loss detection, keep-alive, idle
//! timeout) is due, so acknowledgements, keep-alives, aborts and dead peers are handled while the
//! application computes, and what a large send left buffered keeps flowing.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use quinn_proto::{
    ClientConfig, ConnectionError, ConnectionHandle, DatagramEvent, Dir, Endpoint, Event,
    ReadError, ReadableError, StreamEvent, StreamId, VarInt, WriteError,
};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::transport::matcher::{self, Landing, Matching, Ops, PeerQueues, RawBuf, RecvPost};
use crate::transport::queue::{self, RxDest, RxFrame, SendItem};
use crate::transport::OpId;
use crate::util::WakePipe;
use crate::wire::{FrameKind, Header, MsgDesc, HEADER_LEN};

/// Longest abort reason accepted from a peer.
const MAX_ABORT_REASON: u64 = 4096;
/// Datagrams read per pass before the connections are served.
const RX_BATCH: usize = 64;
/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_536;
/// Most bytes in one segmentation-offload batch.
const GSO_BYTES: usize = 60_000;
/// Datagrams read per `recvmmsg` off loopback.
const RECV_BATCH: usize = 16;
/// Bytes allocated at a time for received datagrams.
const RX_ALLOC: usize = 4 * MAX_DATAGRAM;
/// Longest a blocked thread sleeps before looking again.
const POLL_SLICE: Duration = Duration::from_millis(100);
/// Frames with at most this much payload are written to quinn in one piece with their header.
const SMALL: usize = 4096;
/// Most bytes handed to quinn in one write.
const WRITE_PIECE: usize = 1 << 20;
/// How long the background thread naps while some thread is waiting (and driving).
const NAP: Duration = Duration::from_millis(5);
/// Application error code of a clean close (the transport was dropped).
const CLOSE_DONE: u32 = 0;
/// Application error code for a connection refused because of the rank it claims.
const CLOSE_UNEXPECTED: u32 = 1;
/// Application error code of a connection this rank gave up on (protocol error, lost peer).
const CLOSE_FAILED: u32 = 2;

/// Tunables of the engine.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub(crate) spin: Duration,
    pub(crate) unexpected_limit: u64,
    pub(crate) probe_after: Duration,
}

/// Why a connection failed.
enum ConnFail {
    Protocol(String),
    Aborted(String),
    Lost(String),
}

/// The UDP socket. On loopback plain `recvfrom`/`sendto` (the cheapest calls: every control
/// message costs latency there); elsewhere through quinn-udp for segmentation offload (GSO),
/// receive offload (GRO), ECN and packet info.
pub(crate) struct Io {
    sock: UdpSocket,
    offload: Option<quinn_udp::UdpSocketState>,
}

/// Where one read from the socket came from; its bytes are datagrams of `stride` bytes.
struct Received {
    stride: usize,
    addr: SocketAddr,
    dst_ip: Option<std::net::IpAddr>,
    ecn: Option<quinn_proto::EcnCodepoint>,
}

impl Io {
    fn new(sock: UdpSocket, offload: bool) -> std::io::Result<Io> {
        sock.set_nonblocking(true)?;
        let offload = if offload {
            Some(quinn_udp::UdpSocketState::new(quinn_udp::UdpSockRef::from(&sock))?)
        } else {
            None
        };
        Ok(Io { sock, offload })
    }

    /// Datagrams per send for a connection whose datagrams are at most `mtu` bytes. A batch
    /// must stay within one IP datagram's 64 KiB: larger sends fail with EMSGSIZE, which
    /// quinn-udp drops silently (measured: 16 % of datagrams lost with 64-segment batches of
    /// 1,472 bytes).
    fn batch(&self, mtu: u16) -> usize {
        match &self.offload {
            Some(st) => {
                (GSO_BYTES / usize::from(mtu).max(1)).clamp(1, st.max_gso_segments().max(1))
            }
            None => 1,
        }
    }

    /// Read what waits in the socket into `out`; how many reads landed (0: nothing waits). On
    /// loopback one datagram, split off `rxbuf`, whose allocation is reused once quinn has
    /// dropped every earlier piece of it; elsewhere a batch through `batch`.
    fn recv(
        &self,
        rxbuf: &mut BytesMut,
        batch: &mut Vec<u8>,
        out: &mut Vec<(BytesMut, Received)>,
    ) -> std::io::Result<usize> {
        let Some(st) = &self.offload else {
            // Straight into spare capacity (nothing to initialise); `reserve` takes the whole
            // allocation back when the earlier datagrams cut from it are gone.
            if rxbuf.capacity() < MAX_DATAGRAM {
                rxbuf.reserve(RX_ALLOC);
            }
            let spare = &mut rxbuf.spare_capacity_mut()[..MAX_DATAGRAM];
            return match socket2::SockRef::from(&self.sock).recv_from(spare) {
                Ok((len, addr)) => {
                    // SAFETY: `recv_from` initialised the first `len` bytes of the spare room.
                    unsafe { rxbuf.set_len(len) };
                    let data = rxbuf.split_to(len);
                    if let Some(addr) = addr.as_socket() {
                        out.push((data, Received { stride: len, addr, dst_ip: None, ecn: None }));
                    }
                    Ok(1)
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
                Err(e) => Err(e),
            };
        };
        // quinn-udp reads several datagrams per `recvmmsg` into a batch buffer initialised
        // once (`IoSliceMut` needs initialised bytes); each is then copied out at its own size
        // — off loopback datagrams are small and a system call per datagram cost more.
        if batch.is_empty() {
            batch.resize(RECV_BATCH * MAX_DATAGRAM, 0);
        }
        let mut meta = [quinn_udp::RecvMeta::default(); RECV_BATCH];
        let mut bufs: Vec<std::io::IoSliceMut<'_>> =
            batch.chunks_mut(MAX_DATAGRAM).map(std::io::IoSliceMut::new).collect();
        match st.recv(quinn_udp::UdpSockRef::from(&self.sock), &mut bufs, &mut meta) {
            Ok(n) => {
                drop(bufs);
                for (m, chunk) in meta.iter().zip(batch.chunks(MAX_DATAGRAM)).take(n) {
                    out.push((
                        BytesMut::from(&chunk[..m.len]),
                        Received {
                            stride: m.stride,
                            addr: m.addr,
                            dst_ip: m.dst_ip,
                            ecn: m.ecn.and_then(|e| quinn_proto::EcnCodepoint::from_bits(e as u8)),
                        },
                    ));
                }
                Ok(n)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Send `contents` as `t` describes. Only `WouldBlock` is returned; other errors count as a
    /// loss (quinn retransmits) and are logged.
    fn send(&self, rank: usize, contents: &[u8], t: &quinn_proto::Transmit) -> std::io::Result<()> {
        let r = match &self.offload {
            None => self.sock.send_to(contents, t.destination).map(|_| ()),
            Some(st) => {
                let tx = quinn_udp::Transmit {
                    destination: t.destination,
                    ecn: t.ecn.and_then(|e| quinn_udp::EcnCodepoint::from_bits(e as u8)),
                    contents,
                    segment_size: t.segment_size,
                    src_ip: t.src_ip,
                };
                st.send(quinn_udp::UdpSockRef::from(&self.sock), &tx)
            }
        };
        match r {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(e),
            Err(e) => {
                debug!(rank, "UDP send to {}: {e}", t.destination);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// Send, or hand back what to retry when the socket has room.
    fn send_or_keep(
        &self,
        rank: usize,
        buf: Vec<u8>,
        t: &quinn_proto::Transmit,
    ) -> Option<Pending> {
        match self.send(rank, &buf, t) {
            Ok(()) => None,
            Err(_) => Some(Pending {
                to: t.destination,
                ecn: t.ecn,
                segment: t.segment_size,
                src_ip: t.src_ip,
                buf,
            }),
        }
    }
}

/// Datagrams waiting for room in the socket.
struct Pending {
    buf: Vec<u8>,
    to: SocketAddr,
    ecn: Option<quinn_proto::EcnCodepoint>,
    segment: Option<usize>,
    src_ip: Option<std::net::IpAddr>,
}

/// Connections by handle (quinn's handles are small slab indices): a vector, not a hash map, on
/// the path every message takes.
#[derive(Default)]
struct Peers(Vec<Option<Peer>>);

impl Peers {
    fn get(&self, ch: &usize) -> Option<&Peer> {
        self.0.get(*ch).and_then(Option::as_ref)
    }

    fn get_mut(&mut self, ch: &usize) -> Option<&mut Peer> {
        self.0.get_mut(*ch).and_then(Option::as_mut)
    }

    fn insert(&mut self, ch: usize, p: Peer) {
        if self.0.len() <= ch {
            self.0.resize_with(ch + 1, || None);
        }
        self.0[ch] = Some(p);
    }

    fn remove(&mut self, ch: &usize) {
        if let Some(slot) = self.0.get_mut(*ch) {
            *slot = None;
        }
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn values(&self) -> impl Iterator<Item = &Peer> {
        self.0.iter().flatten()
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Peer> {
        self.0.iter_mut().flatten()
    }
}

/// One QUIC connection and the tutti stream state on it.
struct Peer {
    /// The rank at the other end; `None` for an accepted connection until its certificate is
    /// checked.
    rank: Option<usize>,
    conn: quinn_proto::Connection,
    connected: bool,
    /// Our stream towards the peer.
    tx: Option<StreamId>,
    /// The peer's stream towards us.
    rx: Option<StreamId>,
    sendq: VecDeque<SendItem>,
    hdr: [u8; HEADER_LEN],
    hdr_have: usize,
    cur: Option<RxFrame>,
    /// A close frame arrived: the peer finished cleanly.
    peer_closed: bool,
    /// We queued our own close frame (the last frame on our stream).
    close_sent: bool,
    /// Our stream is finished and the peer acknowledged all of it.
    acked: bool,
    /// The connection is closed (by either side) or failed: no more stream I/O.
    dead: bool,
    /// Datagrams arrived since the connection was last served.
    input: bool,
}

// SAFETY: the raw pointers inside (`Payload::Borrowed`, `RxDest::Posted`) are only dereferenced
// under the engine lock while their operations are posted; posters guarantee validity until then.
unsafe impl Send for Peer {}

pub(crate) struct Inner {
    rank: usize,
    ep: Endpoint,
    /// Connections by `ConnectionHandle` index.
    peers: Peers,
    /// Connection handle of each rank, once known.
    by_rank: Vec<Option<usize>>,
    queues: Vec<PeerQueues>,
    ops: Ops,
    poisoned: Option<Error>,
    unexpected_bytes: u64,
    cfg: EngineConfig,
    /// Certificate fingerprint → rank, for identifying accepted connections (start-up only).
    accepting: Option<HashMap<[u8; 32], usize>>,
    rxbuf: BytesMut,
    /// Receive batch buffer (off loopback), initialised once.
    batch: Vec<u8>,
    /// Reads of one pass, reused.
    received: Vec<(BytesMut, Received)>,
    txbuf: Vec<u8>,
    /// Datagrams the socket had no room for.
    pending_tx: Option<Pending>,
    chunks: Vec<Bytes>,
}

/// All QUIC connections of one rank.
pub(crate) struct Engine {
    rank: usize,
    world: usize,
    inner: Mutex<Inner>,
    io: Io,
    aborted: AtomicBool,
    /// Threads inside `wait` (they drive; the background thread stays out of the way).
    waiters: AtomicUsize,
    stop: AtomicBool,
    /// Wakes threads blocked in `poll`.
    pipe: WakePipe,
}

impl Engine {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        sock: UdpSocket,
        network: bool,
        ep: Endpoint,
        allowed: HashMap<[u8; 32], usize>,
        cfg: EngineConfig,
    ) -> std::io::Result<Engine> {
        let io = Io::new(sock, network)?;
        let pipe = WakePipe::new()?;
        Ok(Engine {
            rank,
            world,
            io,
            inner: Mutex::new(Inner {
                rank,
                ep,
                peers: Peers::default(),
                by_rank: vec![None; world],
                queues: (0..world).map(|_| PeerQueues::default()).collect(),
                ops: Ops::default(),
                poisoned: None,
                unexpected_bytes: 0,
                cfg,
                accepting: Some(allowed),
                rxbuf: BytesMut::new(),
                batch: Vec::new(),
                received: Vec::new(),
                txbuf: Vec::with_capacity(MAX_DATAGRAM),
                pending_tx: None,
                chunks: Vec::new(),
            }),
            aborted: AtomicBool::new(false),
            waiters: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            pipe,
        })
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Critical sections do not panic on network input; if a caller's thread panicked inside
        // one, the state is still structurally valid, so continue rather than cascade panics.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleep until the socket is readable (or writable, when a datagram waits for room), the
    /// wake pipe is written, or `until`; with µs precision, as quinn's timers need.
    fn block(&self, until: Instant, want_write: bool) {
        let mut fds = [
            libc::pollfd { fd: self.pipe.fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd {
                fd: self.io.sock.as_raw_fd(),
                events: libc::POLLIN | if want_write { libc::POLLOUT } else { 0 },
                revents: 0,
            },
        ];
        let d = until.saturating_duration_since(Instant::now()).min(POLL_SLICE);
        let ts = libc::timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ };
        // SAFETY: valid pollfd array and timespec; no signal mask change.
        unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if fds[0].revents != 0 {
            self.pipe.drain();
        }
    }

    /// Start a connection to `peer` (the higher rank of each pair dials the lower one).
    pub(crate) fn connect_to(
        &self,
        peer: usize,
        cfg: ClientConfig,
        addr: SocketAddr,
    ) -> std::result::Result<(), String> {
        let mut g = self.lock();
        let (ch, conn) =
            g.ep.connect(Instant::now(), cfg, addr, "tutti")
                .map_err(|e| format!("connecting to rank {peer} at {addr}: {e}"))?;
        g.peers.insert(ch.0, Peer::new(Some(peer), conn));
        g.by_rank[peer] = Some(ch.0);
        g.service(&self.io, ch.0, Instant::now());
        Ok(())
    }

    /// Drive start-up until every peer is connected and identified, or `deadline`. Afterwards
    /// new connection attempts are refused.
    pub(crate) fn establish(&self, deadline: Instant) -> std::result::Result<(), String> {
        loop {
            let (missing, want_write) = {
                let mut g = self.lock();
                g.drive(&self.io);
                if let Some(e) = &g.poisoned {
                    return Err(e.to_string());
                }
                let missing: Vec<usize> = (0..self.world)
                    .filter(|&j| j != self.rank)
                    .filter(|&j| !g.peer(j).is_some_and(|p| p.connected && p.tx.is_some()))
                    .collect();
                if missing.is_empty() {
                    g.accepting = None;
                    return Ok(());
                }
                (missing, g.pending_tx.is_some())
            };
            if Instant::now() >= deadline {
                return Err(format!(
                    "ranks {missing:?} did not complete a QUIC connection in time"
                ));
            }
            let next = self.lock().next_timer().unwrap_or(deadline).min(deadline);
            self.block(next, want_write);
        }
    }

    /// # Safety
    /// See `Transport::post_send`.
    pub(crate) unsafe fn post_send(
        &self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world, peer, "send")?;
        let mut guard = self.lock();
        let g = &mut *guard;
        let id = matcher::register(&g.poisoned, &mut g.ops, peer, desc, len)?;
        if peer == self.rank {
            // SAFETY: the caller guarantees the range is readable (the copy ends before return).
            unsafe { g.matching(peer).send_to_self(id, desc, data, len) };
            return Ok(id);
        }
        let hdr = Header::data(desc, self.rank, len).encode();
        let item = SendItem::data(id, hdr, data, len);
        let Some(ch) = g.by_rank[peer] else {
            g.ops.forget(id);
            return Err(matcher::closed_peer(self.rank, peer, &desc, len));
        };
        match g.peers.get_mut(&ch) {
            Some(p) if !p.peer_closed && !p.dead => p.sendq.push_back(item),
            _ => {
                g.ops.forget(id);
                return Err(matcher::closed_peer(self.rank, peer, &desc, len));
            }
        }
        // Eager: into quinn and onto the wire now, without waiting for a waiter.
        g.service(&self.io, ch, Instant::now());
        Ok(id)
    }

    /// Queue a frame of exactly these header bytes and payload to `peer`, as a misbehaving but
    /// authenticated peer would send it: the tests of the receiving side's protocol checks.
    #[cfg(test)]
    pub(crate) fn send_raw(&self, peer: usize, hdr: [u8; HEADER_LEN], payload: Vec<u8>) {
        let mut guard = self.lock();
        let g = &mut *guard;
        let Some(ch) = g.by_rank[peer] else { return };
        if let Some(p) = g.peers.get_mut(&ch) {
            p.sendq.push_back(SendItem::control(hdr, payload));
        }
        g.service(&self.io, ch, Instant::now());
    }

    /// # Safety
    /// See `Transport::post_recv`.
    pub(crate) unsafe fn post_recv(
        &self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world, peer, "recv")?;
        let mut guard = self.lock();
        let g = &mut *guard;
        let id = matcher::register(&g.poisoned, &mut g.ops, peer, desc, cap)?;
        let post = RecvPost { id, desc, buf: RawBuf(buf), cap };
        let queued = g.matching(peer).post_recv(post);
        if queued && peer != self.rank && !g.peer(peer).is_some_and(|p| !p.peer_closed && !p.dead) {
            g.queues[peer].remove(id);
            g.ops.forget(id);
            return Err(matcher::closed_peer(self.rank, peer, &desc, cap));
        }
        Ok(id)
    }

    pub(crate) fn test(&self, op: OpId) -> Result<Option<usize>> {
        let mut g = self.lock();
        g.drive(&self.io);
        g.ops.take_finished(op).transpose()
    }

    pub(crate) fn wait(&self, op: OpId, deadline: Instant) -> Result<usize> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let r = self.wait_inner(op, deadline);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        r
    }

    fn wait_inner(&self, op: OpId, deadline: Instant) -> Result<usize> {
        let mut spin_until = None;
        let wait_start = Instant::now();
        let mut probed = false;
        loop {
            let (until, want_write) = {
                let mut g = self.lock();
                g.drive(&self.io);
                if let Some(r) = g.ops.take_finished(op) {
                    return r;
                }
                let Some((peer, desc, bytes, posted)) = g.ops.pending(op) else {
                    return Err(matcher::not_posted(self.rank, op));
                };
                let now = Instant::now();
                if now >= deadline {
                    let done = g.bytes_done(op);
                    return Err(matcher::timed_out(
                        self.rank, peer, &desc, done, bytes, posted, deadline,
                    ));
                }
                if !probed && now.duration_since(wait_start) >= g.cfg.probe_after {
                    probed = true;
                    g.send_probe(&self.io, peer, desc);
                }
                let spin_end = *spin_until.get_or_insert(now + g.cfg.spin);
                if now < spin_end {
                    drop(g);
                    std::thread::yield_now();
                    continue;
                }
                let mut until = deadline;
                if let Some(t) = g.next_timer() {
                    until = until.min(t);
                }
                if !probed {
                    until = until.min(wait_start + g.cfg.probe_after);
                }
                (until, g.pending_tx.is_some())
            };
            self.block(until, want_write);
            // After a block, spin again briefly: the next message often follows closely.
            spin_until = None;
        }
    }

    pub(crate) fn cancel(&self, op: OpId) {
        self.lock().cancel(op);
    }

    pub(crate) fn abort(&self, reason: &str) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut g = self.lock();
        let err = Error::Aborted { rank: self.rank, reason: reason.to_string() };
        g.poison(err, Some(reason));
        g.drive(&self.io);
        drop(g);
        self.pipe.wake();
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        self.lock().poisoned.clone()
    }

    /// The background driver: runs until [`Engine::stop`], serving the connections whenever no
    /// thread is inside `wait`.
    pub(crate) fn background(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            if self.waiters.load(Ordering::SeqCst) > 0 {
                std::thread::sleep(NAP);
                continue;
            }
            let (until, want_write) = {
                let mut g = self.lock();
                g.drive(&self.io);
                let now = Instant::now();
                (g.next_timer().unwrap_or(now + POLL_SLICE), g.pending_tx.is_some())
            };
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            self.block(until, want_write);
        }
    }

    /// Stop the background driver (it returns within one poll slice; the wake makes it sooner).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.pipe.wake();
    }

    /// Clean shutdown: a close frame on every stream, then serve the connections until every
    /// peer has sent its own close (so nothing in flight is cut off) or `timeout` passes; then
    /// close the connections with code 0 and send the closing packets.
    pub(crate) fn shutdown(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        {
            let mut g = self.lock();
            let rank = self.rank;
            for p in g.peers.values_mut().filter(|p| !p.dead && !p.close_sent) {
                p.close_sent = true;
                p.sendq.push_back(SendItem::control(
                    Header::control(FrameKind::Close, rank, 0).encode(),
                    Vec::new(),
                ));
            }
        }
        loop {
            let (done, next, want_write) = {
                let mut g = self.lock();
                g.drive(&self.io);
                let done = g.peers.values().all(|p| p.dead || (p.peer_closed && p.acked));
                (done, g.next_timer(), g.pending_tx.is_some())
            };
            let now = Instant::now();
            if done || now >= deadline {
                if !done {
                    debug!(rank = self.rank, "shutdown: peers still open at the deadline");
                }
                break;
            }
            self.block(next.unwrap_or(deadline).min(deadline), want_write);
        }
        let mut g = self.lock();
        let now = Instant::now();
        for ch in 0..g.peers.len() {
            if let Some(p) = g.peers.get_mut(&ch) {
                p.log_stats(self.rank);
                if !p.conn.is_closed() {
                    p.conn.close(now, VarInt::from_u32(CLOSE_DONE), Bytes::from_static(b"done"));
                }
                p.dead = true;
            }
            g.service(&self.io, ch, now);
        }
    }
}

impl Peer {
    fn new(rank: Option<usize>, conn: quinn_proto::Connection) -> Peer {
        Peer {
            rank,
            conn,
            connected: false,
            tx: None,
            rx: None,
            sendq: VecDeque::new(),
            hdr: [0; HEADER_LEN],
            hdr_have: 0,
            cur: None,
            peer_closed: false,
            close_sent: false,
            acked: false,
            dead: false,
            input: false,
        }
    }

    fn log_stats(&self, rank: usize) {
        let st = self.conn.stats();
        debug!(
            rank,
            peer = ?self.rank,
            mtu = st.path.current_mtu,
            cwnd = st.path.cwnd,
            rtt = ?st.path.rtt,
            lost = st.path.lost_packets,
            congestion_events = st.path.congestion_events,
            sent = st.path.sent_packets,
            udp_tx = ?st.udp_tx,
            udp_rx = ?st.udp_rx,
            "quic connection statistics"
        );
    }

    /// Hand queued frames to quinn until its send buffer (flow control, send window) is full.
    fn flush(&mut self, ops: &mut Ops) -> std::result::Result<(), ConnFail> {
        let Some(tx) = self.tx else { return Ok(()) };
        while let Some(s) = self.sendq.front_mut() {
            let mut stream = self.conn.send_stream(tx);
            let r = if s.off == 0 && s.len <= SMALL {
                // Header and payload assembled once and handed over as quinn's own chunk (no
                // second copy); a partial write leaves the rest to the paths below.
                let mut frame = Vec::with_capacity(HEADER_LEN + s.len);
                frame.extend_from_slice(&s.hdr);
                frame.extend_from_slice(s.payload());
                stream.write_chunks(&mut [Bytes::from(frame)]).map(|w| w.bytes)
            } else if s.off < HEADER_LEN {
                stream.write(&s.hdr[s.off..])
            } else {
                // In pieces: quinn copies each write into its own allocation, freed when the
                // peer acknowledges it; pieces of this size are reused by the allocator instead
                // of being mapped (and page-faulted) afresh.
                let rest = &s.payload()[s.off - HEADER_LEN..];
                stream.write(&rest[..rest.len().min(WRITE_PIECE)])
            };
            match r {
                Ok(n) => s.off += n,
                Err(WriteError::Blocked) => return Ok(()),
                Err(e) => return Err(ConnFail::Lost(format!("sending failed: {e}"))),
            }
            if s.off == HEADER_LEN + s.len {
                if let Some(id) = s.id {
                    ops.complete(id, s.len);
                }
                self.sendq.pop_front();
            }
        }
        if self.close_sent {
            // Our close frame is in quinn: finish the stream; `Finished` reports it acknowledged.
            let _ = self.conn.send_stream(tx).finish();
        }
        Ok(())
    }
}

impl Inner {
    fn peer(&self, rank: usize) -> Option<&Peer> {
        self.by_rank.get(rank).copied().flatten().and_then(|ch| self.peers.get(&ch))
    }

    /// The earliest quinn timer of any connection.
    fn next_timer(&mut self) -> Option<Instant> {
        self.peers.values_mut().filter_map(|p| p.conn.poll_timeout()).min()
    }

    /// One pass over everything: arriving datagrams, due timers, every connection's events,
    /// streams and packets.
    fn drive(&mut self, io: &Io) {
        self.retry_pending(io);
        let now = Instant::now();
        let mut reads = 0;
        let mut got = std::mem::take(&mut self.received);
        while reads < RX_BATCH {
            match io.recv(&mut self.rxbuf, &mut self.batch, &mut got) {
                Ok(0) => break,
                Ok(n) => reads += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP errors surface here (a peer's port closed); quinn's own timers decide.
                    debug!(rank = self.rank, "UDP receive: {e}");
                    reads += 1;
                    continue;
                }
            }
            for (mut data, r) in got.drain(..) {
                // With GRO one read holds several datagrams of `stride` bytes.
                while !data.is_empty() {
                    let seg = data.split_to(r.stride.max(1).min(data.len()));
                    self.handle_datagram(io, now, r.addr, r.dst_ip, r.ecn, seg);
                }
            }
        }
        self.received = got;
        let now = Instant::now();
        let was_poisoned = self.poisoned.is_some();
        for ch in 0..self.peers.len() {
            // Only connections with something to do: input, a due timer, frames to hand over.
            let Some(p) = self.peers.get_mut(&ch) else { continue };
            let due = p.conn.poll_timeout().is_some_and(|t| t <= now);
            if due {
                p.conn.handle_timeout(now);
            }
            if due || std::mem::take(&mut p.input) || !p.sendq.is_empty() {
                self.service(io, ch, now);
            }
        }
        if !was_poisoned && self.poisoned.is_some() {
            // Abort frames were queued for every peer during this pass: send them now.
            for ch in 0..self.peers.len() {
                self.service(io, ch, now);
            }
        }
    }

    fn handle_datagram(
        &mut self,
        io: &Io,
        now: Instant,
        from: SocketAddr,
        dst: Option<std::net::IpAddr>,
        ecn: Option<quinn_proto::EcnCodepoint>,
        data: BytesMut,
    ) {
        self.txbuf.clear();
        match self.ep.handle(now, from, dst, ecn, data, &mut self.txbuf) {
            Some(DatagramEvent::ConnectionEvent(ch, ev)) => {
                if let Some(p) = self.peers.get_mut(&ch.0) {
                    p.conn.handle_event(ev);
                    p.input = true;
                }
            }
            Some(DatagramEvent::NewConnection(incoming)) => {
                self.txbuf.clear();
                if self.accepting.is_some() {
                    match self.ep.accept(incoming, now, &mut self.txbuf, None) {
                        Ok((ch, conn)) => {
                            let mut p = Peer::new(None, conn);
                            p.input = true;
                            self.peers.insert(ch.0, p);
                        }
                        Err(e) => {
                            warn!(rank = self.rank, "refused QUIC connection: {}", e.cause);
                            if let Some(t) = e.response {
                                self.send_response(io, &t);
                            }
                        }
                    }
                } else {
                    warn!(
                        rank = self.rank,
                        remote = %incoming.remote_address(),
                        "refused QUIC connection after start-up"
                    );
                    let t = self.ep.refuse(incoming, &mut self.txbuf);
                    self.send_response(io, &t);
                }
            }
            Some(DatagramEvent::Response(t)) => self.send_response(io, &t),
            None => {}
        }
    }

    /// An endpoint-level answer in `txbuf` (refusal, version negotiation, reset): best effort.
    fn send_response(&mut self, io: &Io, t: &quinn_proto::Transmit) {
        if self.pending_tx.is_none() {
            let buf = self.txbuf[..t.size].to_vec();
            self.pending_tx = io.send_or_keep(self.rank, buf, t);
        }
    }

    fn retry_pending(&mut self, io: &Io) {
        if let Some(p) = self.pending_tx.take() {
            let t = quinn_proto::Transmit {
                destination: p.to,
                ecn: p.ecn,
                size: p.buf.len(),
                segment_size: p.segment,
                src_ip: p.src_ip,
            };
            self.pending_tx = io.send_or_keep(self.rank, p.buf, &t);
        }
    }

    /// Everything one connection needs after input: endpoint events, application events, reads,
    /// writes, packets out.
    fn service(&mut self, io: &Io, ch: usize, now: Instant) {
        let Some(p) = self.peers.get_mut(&ch) else { return };
        while let Some(ev) = p.conn.poll_endpoint_events() {
            if let Some(back) = self.ep.handle_event(ConnectionHandle(ch), ev) {
                p.conn.handle_event(back);
            }
        }
        let mut fail = None;
        let mut lost = None;
        let mut identify = false;
        while let Some(ev) = p.conn.poll() {
            match ev {
                Event::Connected => {
                    p.connected = true;
                    if p.tx.is_none() {
                        p.tx = p.conn.streams().open(Dir::Uni);
                    }
                    identify = p.rank.is_none();
                }
                Event::Stream(StreamEvent::Opened { dir: Dir::Uni }) => {
                    while let Some(id) = p.conn.streams().accept(Dir::Uni) {
                        if p.rx.is_some() {
                            fail =
                                Some(ConnFail::Protocol("the peer opened a second stream".into()));
                        }
                        p.rx = Some(id);
                    }
                }
                Event::Stream(StreamEvent::Finished { id }) if Some(id) == p.tx => p.acked = true,
                Event::Stream(StreamEvent::Stopped { .. }) => {
                    fail = Some(ConnFail::Lost("the peer stopped reading our stream".into()));
                }
                Event::ConnectionLost { reason } => lost = Some(reason),
                _ => {}
            }
        }
        if identify {
            self.identify(ch);
        }
        if let Some(reason) = lost {
            match reason {
                // The peer dropped its transport: a clean close, like a close frame (which the
                // connection close may have overtaken).
                ConnectionError::ApplicationClosed(c)
                    if c.error_code == VarInt::from_u32(CLOSE_DONE) =>
                {
                    self.peer_left(ch);
                }
                ConnectionError::LocallyClosed => {}
                ConnectionError::TimedOut => self.conn_failed(
                    ch,
                    ConnFail::Lost(
                        "nothing (not even a keep-alive) arrived from the peer within the idle \
                         timeout: the process is stopped (SIGSTOP), hung, or its host is \
                         unreachable"
                            .into(),
                    ),
                ),
                other => {
                    self.conn_failed(ch, ConnFail::Lost(format!("QUIC connection lost: {other}")))
                }
            }
            if let Some(p) = self.peers.get_mut(&ch) {
                p.dead = true;
            }
        }
        if let Some(f) = fail {
            self.conn_failed(ch, f);
        }
        if self.peers.get(&ch).is_some_and(|p| p.rx.is_some() && !p.dead) {
            if let Err(f) = self.read(ch) {
                self.conn_failed(ch, f);
            }
        }
        let r = match self.peers.get_mut(&ch) {
            Some(p) if !p.dead => p.flush(&mut self.ops),
            _ => Ok(()),
        };
        if let Err(f) = r {
            self.conn_failed(ch, f);
        }
        self.transmit(io, ch, now);
    }

    /// Packets of one connection onto the wire (batches of equal-size datagrams in one
    /// `sendmsg` where GSO is on).
    fn transmit(&mut self, io: &Io, ch: usize, now: Instant) {
        loop {
            if self.pending_tx.is_some() {
                return;
            }
            let Some(p) = self.peers.get_mut(&ch) else { return };
            let batch = io.batch(p.conn.current_mtu());
            self.txbuf.clear();
            let Some(t) = p.conn.poll_transmit(now, batch, &mut self.txbuf) else { break };
            if io.send(self.rank, &self.txbuf[..t.size], &t).is_err() {
                self.pending_tx = Some(Pending {
                    buf: self.txbuf[..t.size].to_vec(),
                    to: t.destination,
                    ecn: t.ecn,
                    segment: t.segment_size,
                    src_ip: t.src_ip,
                });
                return;
            }
        }
        if let Some(p) = self.peers.get(&ch) {
            if p.conn.is_drained() {
                self.peers.remove(&ch);
            }
        }
    }

    /// An accepted connection finished its handshake: find its rank by certificate.
    fn identify(&mut self, ch: usize) {
        let Some(p) = self.peers.get_mut(&ch) else { return };
        let fp = p
            .conn
            .crypto_session()
            .peer_identity()
            .and_then(|i| i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok())
            .and_then(|certs| certs.first().map(|c| super::tls::fingerprint(c)));
        let rank = fp.and_then(|fp| self.accepting.as_ref().and_then(|a| a.get(&fp).copied()));
        match rank {
            Some(j) if j > self.rank && self.by_rank[j].is_none() => {
                p.rank = Some(j);
                self.by_rank[j] = Some(ch);
            }
            other => {
                warn!(rank = self.rank, ?other, "refused QUIC connection from an unexpected rank");
                p.conn.close(
                    Instant::now(),
                    VarInt::from_u32(CLOSE_UNEXPECTED),
                    Bytes::from_static(b"unexpected rank"),
                );
                p.dead = true;
            }
        }
    }

    /// Take what the peer's stream holds and parse it.
    fn read(&mut self, ch: usize) -> std::result::Result<(), ConnFail> {
        let Some(p) = self.peers.get_mut(&ch) else { return Ok(()) };
        let Some(rx) = p.rx else { return Ok(()) };
        let mut chunks = std::mem::take(&mut self.chunks);
        let mut ended = None;
        {
            let mut stream = p.conn.recv_stream(rx);
            let r = stream.read(true);
            match r {
                Ok(mut c) => {
                    loop {
                        match c.next(usize::MAX) {
                            Ok(Some(chunk)) => chunks.push(chunk.bytes),
                            Ok(None) => {
                                ended = Some("the peer finished its stream".to_string());
                                break;
                            }
                            Err(ReadError::Blocked) => break,
                            Err(ReadError::Reset(code)) => {
                                ended = Some(format!("the peer reset its stream (code {code})"));
                                break;
                            }
                        }
                    }
                    // Flow-control credit goes out with the next transmit.
                    let _ = c.finalize();
                }
                Err(ReadableError::ClosedStream) => {}
                Err(e) => ended = Some(format!("reading the peer's stream: {e}")),
            };
        }
        let mut r = Ok(());
        for b in chunks.drain(..) {
            if r.is_ok() {
                r = self.consume(ch, &b);
            }
        }
        self.chunks = chunks;
        r?;
        match ended {
            Some(why) if !self.peers.get(&ch).is_some_and(|p| p.peer_closed) => {
                Err(ConnFail::Lost(why))
            }
            _ => Ok(()),
        }
    }

    /// Parse stream bytes: frame headers, and payloads into their destinations.
    fn consume(&mut self, ch: usize, mut data: &[u8]) -> std::result::Result<(), ConnFail> {
        while !data.is_empty() {
            let Some(p) = self.peers.get_mut(&ch) else { return Ok(()) };
            if let Some(f) = p.cur.as_mut() {
                let n = data.len().min(f.len - f.done);
                match &mut f.dest {
                    RxDest::Posted { id, buf } => {
                        if self.ops.pending(*id).is_some() {
                            // SAFETY: the receive is still posted (checked under the lock that
                            // `cancel` takes) with `cap >= len`, and `done + n <= len`.
                            unsafe {
                                std::ptr::copy_nonoverlapping(data.as_ptr(), buf.0.add(f.done), n)
                            };
                        }
                    }
                    RxDest::Unexpected { data: v, .. } | RxDest::Abort(v) => {
                        v.extend_from_slice(&data[..n])
                    }
                    RxDest::Discard | RxDest::Parked(_) => {}
                }
                f.done += n;
                data = &data[n..];
                if f.done == f.len {
                    if let Some(f) = p.cur.take() {
                        self.finish(ch, f)?;
                    }
                }
                continue;
            }
            let n = data.len().min(HEADER_LEN - p.hdr_have);
            p.hdr[p.hdr_have..p.hdr_have + n].copy_from_slice(&data[..n]);
            p.hdr_have += n;
            data = &data[n..];
            if p.hdr_have < HEADER_LEN {
                break;
            }
            p.hdr_have = 0;
            let hdr = Header::decode(&p.hdr)
                .map_err(|e| ConnFail::Protocol(format!("undecodable frame header: {e}")))?;
            self.start_frame(ch, hdr)?;
        }
        Ok(())
    }

    fn start_frame(&mut self, ch: usize, hdr: Header) -> std::result::Result<(), ConnFail> {
        let peer = self.peers.get(&ch).and_then(|p| p.rank).unwrap_or(usize::MAX);
        if self.peers.get(&ch).is_some_and(|p| p.peer_closed) {
            return Err(ConnFail::Protocol(format!(
                "a {:?} frame after the peer's close frame",
                hdr.kind
            )));
        }
        if hdr.src as usize != peer {
            return Err(ConnFail::Protocol(format!(
                "frame claims source rank {} on the connection of rank {peer}",
                hdr.src
            )));
        }
        let len = hdr.len;
        let control_empty = |what: &str| {
            if len != 0 {
                Err(ConnFail::Protocol(format!("{what} frame with a payload")))
            } else {
                Ok(RxDest::Discard)
            }
        };
        let dest = match hdr.kind {
            FrameKind::KeepAlive => control_empty("keep-alive")?,
            FrameKind::Probe => {
                let d = control_empty("probe")?;
                if let Some(err) = matcher::probe_mismatch(self.rank, peer, &self.ops, &hdr.desc) {
                    let reason = err.to_string();
                    self.poison(err, Some(&reason));
                }
                d
            }
            FrameKind::Close => {
                let d = control_empty("close")?;
                self.peer_closing(ch);
                d
            }
            FrameKind::Abort => {
                if len > MAX_ABORT_REASON {
                    return Err(ConnFail::Protocol(format!("abort reason of {len} bytes")));
                }
                RxDest::Abort(Vec::with_capacity(len as usize))
            }
            FrameKind::Data => {
                // Nothing is parked: quinn's receive buffer is not the kernel's, so a message
                // without its receive is buffered (within the budget).
                let limit = self.cfg.unexpected_limit;
                match self.matching(peer).arrive_header(&hdr.desc, len, u64::MAX, limit).0 {
                    Ok(Landing::Posted { id, buf }) => RxDest::Posted { id, buf },
                    // Bounded by the budget `arrive_header` checked.
                    Ok(Landing::Buffer) => RxDest::Unexpected {
                        desc: hdr.desc,
                        data: Vec::with_capacity(len as usize),
                    },
                    Ok(Landing::Park | Landing::Discard) => RxDest::Discard,
                    Err(err) => {
                        self.poison(err, None);
                        RxDest::Discard
                    }
                }
            }
        };
        let Ok(len) = usize::try_from(len) else {
            return Err(ConnFail::Protocol(format!("frame length {len} does not fit in memory")));
        };
        let f = RxFrame { dest, len, done: 0 };
        if len == 0 {
            return self.finish(ch, f);
        }
        if let Some(p) = self.peers.get_mut(&ch) {
            p.cur = Some(f);
        }
        Ok(())
    }

    fn finish(&mut self, ch: usize, f: RxFrame) -> std::result::Result<(), ConnFail> {
        let peer = self.peers.get(&ch).and_then(|p| p.rank).unwrap_or(usize::MAX);
        match f.dest {
            RxDest::Posted { id, .. } => self.ops.complete(id, f.len),
            RxDest::Unexpected { desc, data } => {
                // A receive may have been posted while the message was arriving.
                self.matching(peer).arrive_whole(&desc, std::borrow::Cow::Owned(data), true);
            }
            RxDest::Abort(reason) => {
                return Err(ConnFail::Aborted(String::from_utf8_lossy(&reason).into_owned()));
            }
            RxDest::Discard | RxDest::Parked(_) => {}
        }
        Ok(())
    }

    /// The matching state of messages from `peer`.
    fn matching(&mut self, peer: usize) -> Matching<'_> {
        Matching {
            rank: self.rank,
            peer,
            queues: &mut self.queues[peer],
            ops: &mut self.ops,
            unexpected_bytes: &mut self.unexpected_bytes,
        }
    }

    /// Ask `peer` whether it is in the same collective as `desc` (see `FrameKind::Probe`).
    fn send_probe(&mut self, io: &Io, peer: usize, desc: MsgDesc) {
        if peer == self.rank || desc.tag.group & matcher::P2P_GROUP_BIT != 0 {
            return;
        }
        let Some(ch) = self.by_rank[peer] else { return };
        let Some(p) = self.peers.get_mut(&ch).filter(|p| !p.dead) else { return };
        let mut h = Header::data(desc, self.rank, 0);
        h.kind = FrameKind::Probe;
        p.sendq.push_back(SendItem::control(h.encode(), Vec::new()));
        self.service(io, ch, Instant::now());
    }

    fn bytes_done(&self, op: OpId) -> u64 {
        self.peers.values().find_map(|p| queue::progress(&p.cur, &p.sendq, op)).unwrap_or(0)
    }

    fn cancel(&mut self, op: OpId) {
        for q in self.queues.iter_mut() {
            q.remove(op);
        }
        for p in self.peers.values_mut() {
            queue::forget(&mut p.cur, &mut p.sendq, op);
        }
        self.ops.forget(op);
    }

    /// Fail everything, tell every live peer why (abort frame), stop taking work.
    fn poison(&mut self, err: Error, abort_reason: Option<&str>) {
        if self.poisoned.is_some() {
            return;
        }
        warn!(rank = self.rank, "transport poisoned: {err}");
        let e2 = err.clone();
        self.ops.fail_all(|_, _| e2.clone());
        self.poisoned = Some(err.clone());
        for q in self.queues.iter_mut() {
            q.clear_posted();
        }
        let reason = abort_reason.map_or_else(|| err.to_string(), str::to_string);
        let reason = reason.as_bytes();
        let reason = &reason[..reason.len().min(MAX_ABORT_REASON as usize)];
        let rank = self.rank;
        for p in self.peers.values_mut().filter(|p| !p.dead && !p.peer_closed) {
            queue::abort_queue(&mut p.sendq, rank, reason);
        }
    }

    /// The peer is leaving cleanly (close frame, or its connection closed with code 0).
    /// Operations still waiting on it fail (naming it); nothing is poisoned.
    fn peer_closing(&mut self, ch: usize) {
        let rank = self.rank;
        let Some(p) = self.peers.get_mut(&ch) else { return };
        let Some(peer) = p.rank else { return };
        p.peer_closed = true;
        if !p.close_sent && !p.dead {
            // Answer with our own close so a peer waiting in its shutdown need not wait for
            // our exit.
            p.close_sent = true;
            p.sendq.push_back(SendItem::control(
                Header::control(FrameKind::Close, rank, 0).encode(),
                Vec::new(),
            ));
        }
        matcher::fail_closed_peer(rank, peer, &mut self.ops, &mut self.queues[peer]);
    }

    fn peer_left(&mut self, ch: usize) {
        let already = self.peers.get(&ch).is_some_and(|p| p.peer_closed);
        if !already {
            self.peer_closing(ch);
        }
    }

    fn conn_failed(&mut self, ch: usize, f: ConnFail) {
        let Some(p) = self.peers.get_mut(&ch) else { return };
        if p.dead && !matches!(f, ConnFail::Aborted(_)) {
            return;
        }
        p.dead = true;
        let Some(peer) = p.rank else {
            // A connection that never became a rank's (refused, or failed in its handshake).
            return;
        };
        if p.peer_closed && matches!(f, ConnFail::Lost(_)) {
            // End of a clean shutdown.
            return;
        }
        if !p.conn.is_closed() {
            p.conn.close(
                Instant::now(),
                VarInt::from_u32(CLOSE_FAILED),
                Bytes::from_static(b"failed"),
            );
        }
        let detail = match &f {
            ConnFail::Protocol(d) => format!("protocol error: {d}"),
            ConnFail::Lost(d) => d.clone(),
            ConnFail::Aborted(r) => format!("peer aborted: {r}"),
        };
        debug!(rank = self.rank, peer, "{detail}");
        let rank = self.rank;
        self.queues[peer].clear_posted();
        if let ConnFail::Aborted(reason) = f {
            // Pass the original reason on: it names the culprit, wherever the abort started.
            let err = Error::PeerAborted { rank, peer, reason: reason.clone() };
            self.poison(err, Some(&reason));
            return;
        }
        let (err, reason) = matcher::peer_lost(rank, peer, &mut self.ops, detail);
        self.poison(err, Some(&reason));
    }
}
