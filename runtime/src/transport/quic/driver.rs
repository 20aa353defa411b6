//! The QUIC driver: quinn-proto's state machines for every peer over one UDP socket.
//!
//! No async runtime: the engine's waiting (or background) thread calls in. The driver reads
//! datagrams from the socket, feeds them to the endpoint and the connections, hands the bytes of
//! each peer's stream to the core, writes the core's queued frames into our stream, and
//! transmits the packets quinn-proto builds. Each rank pair shares one connection with one
//! unidirectional stream per direction; quinn's flow control and buffers sit below the core.
//! When the core parks a frame (no receive posted and the peer's window full), the driver keeps
//! the rest of the chunk and stops reading that stream, so quinn's stream credit stops the
//! sender until the receive is posted. Liveness: every datagram from a peer counts as hearing
//! from it, and quinn's keep-alives make sure some flow.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use quinn_proto::{
    ClientConfig, ConnectionError, ConnectionHandle, DatagramEvent, Dir, Endpoint, Event,
    ReadError, ReadableError, StreamEvent, StreamId, VarInt, WriteError,
};
use tracing::{debug, warn};

use crate::transport::core::{Core, LinkFail};
use crate::transport::engine::{Driver, Engine, Mode};
use crate::transport::Watch;
use crate::wire::HEADER_LEN;

/// Datagrams read per pass before the connections are served.
const RX_BATCH: usize = 64;
/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_536;
/// Most bytes in one segmentation-offload batch.
const GSO_BYTES: usize = 60_000;
/// Datagrams read per `recvmmsg` off loopback.
const RECV_BATCH: usize = 16;
/// On loopback, a datagram shorter than this, read first in a pass, is served before reading on
/// (see `QuicDriver::drive`).
const SHORT_DATAGRAM: usize = 4096;
/// Bytes allocated at a time for received datagrams.
const RX_ALLOC: usize = 4 * MAX_DATAGRAM;
/// Frames with at most this much payload are written to quinn in one piece with their header.
const SMALL: usize = 4096;
/// Most bytes handed to quinn in one write.
const WRITE_PIECE: usize = 1 << 20;
/// Application error code of a clean close (the transport was dropped).
const CLOSE_DONE: u32 = 0;
/// Application error code for a connection refused because of the rank it claims.
const CLOSE_UNEXPECTED: u32 = 1;
/// Application error code of a connection this rank gave up on (protocol error, lost peer).
const CLOSE_FAILED: u32 = 2;

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
        // ICMP errors (a peer's port closed: its process died on a live host) are queued on the
        // socket's error queue, with the address our datagram was for; see `Io::errors`.
        let v6 = sock.local_addr()?.is_ipv6();
        let (level, name) = if v6 {
            (libc::IPPROTO_IPV6, libc::IPV6_RECVERR)
        } else {
            (libc::IPPROTO_IP, libc::IP_RECVERR)
        };
        let on: libc::c_int = 1;
        // SAFETY: setsockopt on our own socket with a c_int option value of the right size.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                level,
                name,
                (&on as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let offload = if offload {
            Some(quinn_udp::UdpSocketState::new(quinn_udp::UdpSockRef::from(&sock))?)
        } else {
            None
        };
        Ok(Io { sock, offload })
    }

    /// Take every error waiting on the socket's error queue; returns the destinations that
    /// answered "port unreachable" (nothing listens there any more).
    fn errors(&self, rank: usize) -> Vec<SocketAddr> {
        let mut gone = Vec::new();
        loop {
            // SAFETY: plain-data structures filled by `recvmsg`; every pointer below refers to
            // a local that outlives the call.
            let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let mut control = [0u64; 64];
            let mut byte = [0u8; 1];
            let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: byte.len() };
            // SAFETY: as above.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_name = (&mut name as *mut libc::sockaddr_storage).cast();
            msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = size_of_val(&control) as _;
            // SAFETY: `msg` describes valid local buffers.
            let r = unsafe {
                libc::recvmsg(
                    self.sock.as_raw_fd(),
                    &mut msg,
                    libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT,
                )
            };
            if r < 0 {
                return gone;
            }
            let mut unreachable = false;
            // SAFETY: walking the control messages `recvmsg` wrote into `control`.
            let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
            while !c.is_null() {
                // SAFETY: `c` points to a control message header inside `control`.
                let h = unsafe { &*c };
                let ours = (h.cmsg_level == libc::IPPROTO_IP && h.cmsg_type == libc::IP_RECVERR)
                    || (h.cmsg_level == libc::IPPROTO_IPV6 && h.cmsg_type == libc::IPV6_RECVERR);
                if ours {
                    // SAFETY: an IP(V6)_RECVERR message carries a `sock_extended_err`; read
                    // unaligned, as control data need not be aligned for it.
                    let e: libc::sock_extended_err =
                        unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c).cast()) };
                    unreachable |= e.ee_errno == libc::ECONNREFUSED as u32;
                }
                // SAFETY: as above.
                c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
            }
            // SAFETY: `recvmsg` wrote `msg_namelen` bytes of the address into `name`.
            let addr = unsafe { socket2::SockAddr::new(name, msg.msg_namelen) };
            match addr.as_socket() {
                Some(a) if unreachable => gone.push(a),
                other => debug!(rank, ?other, "UDP socket error (not a closed port)"),
            }
        }
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

/// One QUIC connection and its streams.
struct Peer {
    /// The rank at the other end; `None` for an accepted connection until its certificate is
    /// checked.
    rank: Option<usize>,
    conn: quinn_proto::Connection,
    connected: bool,
    /// The core's link for this rank was brought up (once; a failed link stays down).
    linked: bool,
    /// Our stream towards the peer.
    tx: Option<StreamId>,
    /// The peer's stream towards us.
    rx: Option<StreamId>,
    /// Our stream is finished and the peer acknowledged all of it.
    acked: bool,
    /// The connection is closed (by either side) or failed: no more stream I/O.
    dead: bool,
    /// Datagrams arrived since the connection was last served.
    input: bool,
    /// Stream bytes the core did not take because a frame is parked (flow control): offered
    /// again, before anything more is read from quinn, once the frame has a destination.
    /// Meanwhile quinn's stream credit stops the sender.
    held: Option<Bytes>,
}

/// Every peer's QUIC connection of one rank.
pub(crate) struct QuicDriver {
    rank: usize,
    ep: Endpoint,
    io: Io,
    /// Connections by `ConnectionHandle` index.
    peers: Peers,
    /// Connection handle of each rank, once known.
    by_rank: Vec<Option<usize>>,
    /// Certificate fingerprint → rank, for identifying accepted connections (start-up only).
    accepting: Option<HashMap<[u8; 32], usize>>,
    /// The ranks this driver connects (those whose certificates were allowed): in a QUIC job
    /// with shared memory, the ranks of this host go through TCP's driver instead.
    quic_peers: Vec<bool>,
    rxbuf: BytesMut,
    /// Receive batch buffer (off loopback), initialised once.
    batch: Vec<u8>,
    /// Reads of one pass, reused.
    received: Vec<(BytesMut, Received)>,
    txbuf: Vec<u8>,
    /// Datagrams the socket had no room for.
    pending_tx: Option<Pending>,
}

impl QuicDriver {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        sock: UdpSocket,
        network: bool,
        ep: Endpoint,
        allowed: HashMap<[u8; 32], usize>,
    ) -> std::io::Result<QuicDriver> {
        let mut quic_peers = vec![false; world];
        for &j in allowed.values() {
            if let Some(q) = quic_peers.get_mut(j) {
                *q = true;
            }
        }
        Ok(QuicDriver {
            rank,
            ep,
            io: Io::new(sock, network)?,
            peers: Peers::default(),
            by_rank: vec![None; world],
            accepting: Some(allowed),
            quic_peers,
            rxbuf: BytesMut::new(),
            batch: Vec::new(),
            received: Vec::new(),
            txbuf: Vec::with_capacity(MAX_DATAGRAM),
            pending_tx: None,
        })
    }

    /// Whether any peer's link is this driver's.
    pub(crate) fn has_peers(&self) -> bool {
        self.quic_peers.iter().any(|q| *q)
    }

    /// The UDP socket's descriptor (what [`Driver::poll_set`] adds).
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        self.io.sock.as_raw_fd()
    }

    fn peer(&self, rank: usize) -> Option<&Peer> {
        self.by_rank.get(rank).copied().flatten().and_then(|ch| self.peers.get(&ch))
    }

    /// One pass over everything: arriving datagrams, due timers, every connection's events,
    /// streams and packets. `now` is the engine's reading of the clock for this pass, used
    /// throughout it: a timer that falls due during the pass is served by the next one.
    fn drive(&mut self, core: &mut Core, now: Instant) {
        self.retry_pending();
        let ended = core.ops_ended();
        let mut reads = 0;
        let mut got = std::mem::take(&mut self.received);
        while reads < RX_BATCH {
            let first = reads == 0;
            match self.io.recv(&mut self.rxbuf, &mut self.batch, &mut got) {
                Ok(0) => break,
                Ok(n) => reads += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP errors surface here: a peer's port closed means its process is gone
                    // (killed or exited) while its host lives. Fail its link now, as TCP does on
                    // a reset, instead of waiting for the dead-peer limit.
                    debug!(rank = self.rank, "UDP receive: {e}");
                    for addr in self.io.errors(self.rank) {
                        self.port_closed(core, addr);
                    }
                    reads += 1;
                    continue;
                }
            }
            // On loopback, one short datagram first in a pass is most often a whole small
            // message (or an acknowledgement) and the socket empty behind it. Serve it at once:
            // if that ended an operation, the pass is over, without the read that would only
            // learn the socket is empty (a system call per small message: 8-byte allreduces
            // made 3.8 reads per call before). Otherwise read on as usual, so a stream of large
            // datagrams is read in batches. What did arrive meanwhile is seen by the next pass
            // or sleep (readiness is level-triggered).
            let short = first
                && self.io.offload.is_none()
                && matches!(got.as_slice(), [(d, _)] if d.len() < SHORT_DATAGRAM);
            for (mut data, r) in got.drain(..) {
                // With GRO one read holds several datagrams of `stride` bytes.
                while !data.is_empty() {
                    let seg = data.split_to(r.stride.max(1).min(data.len()));
                    self.handle_datagram(core, now, r.addr, r.dst_ip, r.ecn, seg);
                }
            }
            if short {
                self.serve(core, now);
                if core.ops_ended() != ended {
                    self.received = got;
                    return;
                }
            }
        }
        self.received = got;
        self.serve(core, now);
    }

    /// Serve the connections that have something to do: input, a due timer, frames to hand
    /// over.
    fn serve(&mut self, core: &mut Core, now: Instant) {
        for ch in 0..self.peers.len() {
            // Only connections with something to do: input, a due timer, frames to hand over.
            let Some(p) = self.peers.get_mut(&ch) else { continue };
            let due = p.conn.poll_timeout().is_some_and(|t| t <= now);
            if due {
                p.conn.handle_timeout(now);
            }
            let tx = p.rank.is_some_and(|r| core.wants_tx(r));
            // Bytes held back for a frame that is no longer parked (see `Peer::held`).
            let unheld = p.held.is_some() && p.rank.is_some_and(|r| !core.rx_parked(r));
            if due || std::mem::take(&mut p.input) || tx || unheld {
                self.service(core, ch, now);
            }
        }
    }

    fn handle_datagram(
        &mut self,
        core: &mut Core,
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
                    if let Some(r) = p.rank.filter(|_| p.linked) {
                        core.heard(r, now);
                    }
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
                                self.send_response(&t);
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
                    self.send_response(&t);
                }
            }
            Some(DatagramEvent::Response(t)) => self.send_response(&t),
            None => {}
        }
    }

    /// An endpoint-level answer in `txbuf` (refusal, version negotiation, reset): best effort.
    fn send_response(&mut self, t: &quinn_proto::Transmit) {
        if self.pending_tx.is_none() {
            let buf = self.txbuf[..t.size].to_vec();
            self.pending_tx = self.io.send_or_keep(self.rank, buf, t);
        }
    }

    fn retry_pending(&mut self) {
        if let Some(p) = self.pending_tx.take() {
            let t = quinn_proto::Transmit {
                destination: p.to,
                ecn: p.ecn,
                size: p.buf.len(),
                segment_size: p.segment,
                src_ip: p.src_ip,
            };
            self.pending_tx = self.io.send_or_keep(self.rank, p.buf, &t);
        }
    }

    /// Everything one connection needs after input: endpoint events, application events, reads,
    /// writes, packets out.
    fn service(&mut self, core: &mut Core, ch: usize, now: Instant) {
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
                                Some(LinkFail::Protocol("the peer opened a second stream".into()));
                        }
                        p.rx = Some(id);
                    }
                }
                Event::Stream(StreamEvent::Finished { id }) if Some(id) == p.tx => p.acked = true,
                Event::Stream(StreamEvent::Stopped { .. }) => {
                    fail = Some(LinkFail::Lost("the peer stopped reading our stream".into()));
                }
                Event::ConnectionLost { reason } => lost = Some(reason),
                _ => {}
            }
        }
        if identify {
            self.identify(ch);
        }
        let Some(p) = self.peers.get_mut(&ch) else { return };
        if let (Some(r), false, true, Some(_)) = (p.rank, p.linked, p.connected, p.tx) {
            p.linked = true;
            core.link_up(r, now);
        }
        let rank = p.rank.filter(|_| p.linked);
        // Stream data first: what the peer sent before its connection ended (an abort frame
        // naming the first culprit, say) is handled before the end itself. Read errors while the
        // connection is going are the end's, reported below with its reason.
        if let Some(r) = rank {
            if core.is_up(r) && !p.dead {
                let read = self.read(core, ch, r, now);
                if let (Err(f), None) = (read, &lost) {
                    core.link_failed(r, f);
                }
            }
        }
        let Some(p) = self.peers.get_mut(&ch) else { return };
        if let Some(reason) = lost {
            p.dead = true;
            if let Some(r) = rank {
                match reason {
                    // The peer dropped its transport: a clean close, like a close frame (which
                    // the connection close may have overtaken).
                    ConnectionError::ApplicationClosed(c)
                        if c.error_code == VarInt::from_u32(CLOSE_DONE) =>
                    {
                        core.peer_closing(r);
                    }
                    ConnectionError::LocallyClosed => {}
                    ConnectionError::TimedOut => core.link_failed(
                        r,
                        LinkFail::Lost(
                            "nothing (not even a keep-alive) arrived from the peer within the \
                             idle timeout: the process is stopped (SIGSTOP), hung, or its host \
                             is unreachable"
                                .into(),
                        ),
                    ),
                    other => core
                        .link_failed(r, LinkFail::Lost(format!("QUIC connection lost: {other}"))),
                }
            }
        }
        if let (Some(f), Some(r)) = (fail, rank) {
            core.link_failed(r, f);
        }
        if let Some(r) = rank {
            if core.is_up(r) && !p.dead {
                if let Err(f) = p.flush(core, r, now) {
                    core.link_failed(r, f);
                }
            }
        }
        self.transmit(ch, now);
    }

    /// Packets of one connection onto the wire (batches of equal-size datagrams in one
    /// `sendmsg` where GSO is on).
    fn transmit(&mut self, ch: usize, now: Instant) {
        loop {
            if self.pending_tx.is_some() {
                return;
            }
            let Some(p) = self.peers.get_mut(&ch) else { return };
            let batch = self.io.batch(p.conn.current_mtu());
            self.txbuf.clear();
            let Some(t) = p.conn.poll_transmit(now, batch, &mut self.txbuf) else { break };
            if self.io.send(self.rank, &self.txbuf[..t.size], &t).is_err() {
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

    /// Hand what the peer's stream holds to the core, until it parks a frame.
    fn read(
        &mut self,
        core: &mut Core,
        ch: usize,
        rank: usize,
        now: Instant,
    ) -> Result<(), LinkFail> {
        let Some(p) = self.peers.get_mut(&ch) else { return Ok(()) };
        let Some(rx) = p.rx else { return Ok(()) };
        // What a parked frame left first; nothing more while it stays parked.
        if let Some(b) = p.held.take() {
            let took = core.rx_bytes(rank, &b, now);
            if took < b.len() {
                p.held = Some(b.slice(took..));
                return Ok(());
            }
        }
        let mut ended = None;
        let mut stream = p.conn.recv_stream(rx);
        match stream.read(true) {
            Ok(mut c) => {
                loop {
                    match c.next(usize::MAX) {
                        Ok(Some(chunk)) => {
                            let b = chunk.bytes;
                            let took = core.rx_bytes(rank, &b, now);
                            if took < b.len() {
                                p.held = Some(b.slice(took..));
                                break;
                            }
                        }
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
                // Flow-control credit for what was taken goes out with the next transmit.
                let _ = c.finalize();
            }
            Err(ReadableError::ClosedStream) => {}
            Err(e) => ended = Some(format!("reading the peer's stream: {e}")),
        }
        match ended {
            Some(why) if !core.peer_closed(rank) => Err(LinkFail::Lost(why)),
            _ => Ok(()),
        }
    }

    /// Nothing listens any more at `addr`: fail the link of the peer there.
    fn port_closed(&mut self, core: &mut Core, addr: SocketAddr) {
        let peer = self
            .peers
            .values()
            .find(|p| p.linked && !p.dead && p.conn.remote_address() == addr)
            .and_then(|p| p.rank);
        if let Some(r) = peer {
            core.link_failed(
                r,
                LinkFail::Lost(format!(
                    "its UDP port {addr} is closed (ICMP port unreachable): the process is gone \
                     (killed or exited) while its host is up"
                )),
            );
        }
    }

    /// Start a connection to `peer` (the higher rank of each pair dials the lower one).
    fn connect_to(
        &mut self,
        core: &mut Core,
        peer: usize,
        cfg: ClientConfig,
        addr: SocketAddr,
    ) -> Result<(), String> {
        let (ch, conn) = self
            .ep
            .connect(Instant::now(), cfg, addr, "tutti")
            .map_err(|e| format!("connecting to rank {peer} at {addr}: {e}"))?;
        self.peers.insert(ch.0, Peer::new(Some(peer), conn));
        self.by_rank[peer] = Some(ch.0);
        self.service(core, ch.0, Instant::now());
        Ok(())
    }
}

/// A driver that carries QUIC links: the QUIC driver itself, or one that holds it.
pub(crate) trait HasQuic {
    /// The QUIC driver inside.
    fn quic(&mut self) -> &mut QuicDriver;
}

impl HasQuic for QuicDriver {
    fn quic(&mut self) -> &mut QuicDriver {
        self
    }
}

/// Start a connection to `peer` (the higher rank of each pair dials the lower one).
pub(crate) fn connect_to<D: Driver + HasQuic>(
    engine: &Engine<D>,
    peer: usize,
    cfg: ClientConfig,
    addr: SocketAddr,
) -> Result<(), String> {
    let mut guard = engine.lock();
    let s = &mut *guard;
    s.driver.quic().connect_to(&mut s.core, peer, cfg, addr)
}

/// Drive start-up until every peer this driver connects is connected and identified, or
/// `deadline`, or `watch` says a peer has ended (`Err(Err(…))`). Afterwards new connection
/// attempts are refused.
pub(crate) fn establish<D: Driver + HasQuic>(
    engine: &Engine<D>,
    deadline: Instant,
    watch: Watch<'_>,
) -> Result<(), Result<String, crate::error::Error>> {
    let (rank, world) = (engine.rank(), engine.world());
    let mut fds = Vec::new();
    loop {
        watch.check(rank).map_err(Err)?;
        let (missing, until) = {
            let mut guard = engine.lock();
            let s = &mut *guard;
            let q = s.driver.quic();
            q.drive(&mut s.core, Instant::now());
            if let Some(e) = s.core.poisoned() {
                return Err(Ok(e.to_string()));
            }
            let missing: Vec<usize> = (0..world)
                .filter(|&j| j != rank && q.quic_peers[j])
                .filter(|&j| !q.peer(j).is_some_and(|p| p.linked))
                .collect();
            if missing.is_empty() {
                q.accepting = None;
                return Ok(());
            }
            let timer = q.next_timer();
            engine.poll_set(s, Mode::Wait, &mut fds);
            let look =
                Instant::now() + watch.slice(deadline.saturating_duration_since(Instant::now()));
            (missing, timer.map_or(look, |t| t.min(look)))
        };
        if Instant::now() >= deadline {
            return Err(Ok(format!(
                "ranks {missing:?} did not complete a QUIC connection in time"
            )));
        }
        engine.sleep(&mut fds, until);
    }
}

impl Driver for QuicDriver {
    // 1 ms naps cost p99 latency on 2 cores (42 µs vs 19–29 µs at 8 B).
    const WAITING_NAP: Duration = Duration::from_millis(5);

    fn flush(&mut self, core: &mut Core, peer: usize, now: Instant) {
        if let Some(ch) = self.by_rank[peer] {
            self.service(core, ch, now);
        }
    }

    fn read(&mut self, core: &mut Core, peer: usize, now: Instant) {
        // A parked frame got its receive: feed what was held back, and read on.
        self.flush(core, peer, now);
    }

    fn progress(&mut self, core: &mut Core, _mode: Mode, now: Instant) {
        // Stream data waits in quinn's buffers, not the kernel's: the same pass in every mode.
        self.drive(core, now);
    }

    fn next_timer(&mut self) -> Option<Instant> {
        self.peers.values_mut().filter_map(|p| p.conn.poll_timeout()).min()
    }

    fn poll_set(&mut self, _core: &Core, _mode: Mode, fds: &mut Vec<libc::pollfd>) {
        let write = if self.pending_tx.is_some() { libc::POLLOUT } else { 0 };
        fds.push(libc::pollfd {
            fd: self.io.sock.as_raw_fd(),
            events: libc::POLLIN | write,
            revents: 0,
        });
    }

    fn ready(&mut self, core: &mut Core, _mode: Mode, _fds: &[libc::pollfd], now: Instant) {
        self.drive(core, now);
    }

    fn link_down(&mut self, core: &mut Core, peer: usize) {
        let Some(ch) = self.by_rank[peer] else { return };
        let clean = core.peer_closed(peer);
        let Some(p) = self.peers.get_mut(&ch) else { return };
        p.dead = true;
        if !p.conn.is_closed() && !clean {
            p.conn.close(
                Instant::now(),
                VarInt::from_u32(CLOSE_FAILED),
                Bytes::from_static(b"failed"),
            );
        }
        self.transmit(ch, Instant::now());
    }

    /// Serve the connections until every peer has sent its own close and acknowledged ours
    /// (so nothing in flight is cut off).
    fn shutdown_step(&mut self, core: &mut Core, now: Instant) -> bool {
        self.drive(core, now);
        self.peers.values().all(|p| {
            p.dead || p.rank.is_some_and(|r| !core.is_up(r) || (core.peer_closed(r) && p.acked))
        })
    }

    /// Close every connection with code 0 and send the closing packets.
    fn close(&mut self, _core: &mut Core, now: Instant) {
        for ch in 0..self.peers.len() {
            if let Some(p) = self.peers.get_mut(&ch) {
                p.log_stats(self.rank);
                if !p.conn.is_closed() {
                    p.conn.close(now, VarInt::from_u32(CLOSE_DONE), Bytes::from_static(b"done"));
                }
                p.dead = true;
            }
            self.transmit(ch, now);
        }
    }
}

impl Peer {
    fn new(rank: Option<usize>, conn: quinn_proto::Connection) -> Peer {
        Peer {
            rank,
            conn,
            connected: false,
            linked: false,
            tx: None,
            rx: None,
            acked: false,
            dead: false,
            input: false,
            held: None,
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

    /// Hand the core's queued frames for `rank` to quinn until its send buffer (flow control,
    /// send window) is full; finish our stream once our close frame is in.
    fn flush(&mut self, core: &mut Core, rank: usize, now: Instant) -> Result<(), LinkFail> {
        let Some(tx) = self.tx else { return Ok(()) };
        while let Some(s) = core.sendq(rank).front() {
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
                Ok(0) | Err(WriteError::Blocked) => return Ok(()),
                Ok(n) => core.tx_done(rank, n, now),
                Err(e) => return Err(LinkFail::Lost(format!("sending failed: {e}"))),
            }
        }
        if core.tx_finished(rank) {
            // Our close frame is in quinn: finish the stream; `Finished` reports it acknowledged.
            let _ = self.conn.send_stream(tx).finish();
        }
        Ok(())
    }
}
