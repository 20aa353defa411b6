//! The TCP progress engine: every peer connection of one rank, driven by whichever thread waits.
//!
//! There is no I/O thread on the data path. A thread in [`Engine::wait`] makes progress on every
//! connection with work: it writes queued frames with one vectored `sendmsg` (header and payload
//! together) and reads arriving frames, payloads straight into the posted receive buffer. Posting
//! a send writes at once when the socket has room, so small messages leave without waiting for
//! anyone. A waiter first spins for a short, bounded time yielding the CPU between attempts, then
//! blocks in `poll(2)` with the lock released; 2-core machines running 4+ ranks never spin
//! without bound.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::transport::matcher::{self, Landing, Matching, Ops, PeerQueues, RawBuf, RecvPost};
use crate::transport::queue::{self, RxDest, RxFrame, SendItem};
use crate::transport::OpId;
use crate::util::WakePipe;
use crate::wire::{FrameKind, Header, HeaderError, MsgDesc, HEADER_LEN};

/// Bytes of the per-connection staging buffer small frames are read through.
const STAGE: usize = 64 * 1024;
/// A payload with at least this much left is read directly into its destination.
const DIRECT_MIN: usize = 16 * 1024;
/// Largest message buffered when it arrives before its receive is posted. A larger one is
/// parked: its header is read, its payload stays in the kernel (the sender is flow-controlled)
/// until the receive is posted, and is then read straight into it. A wait for another message
/// of the same peer unparks it into the unexpected queue, so nothing can deadlock on it.
const EAGER_MAX: u64 = 64 * 1024;
/// Longest abort reason accepted from a peer.
const MAX_ABORT_REASON: u64 = 4096;
/// Most frames gathered into one `sendmsg`.
const MAX_IOV: usize = 64;
/// Longest a waiter sleeps in `poll` before looking again (abort and deadlines are also checked).
const POLL_SLICE: Duration = Duration::from_millis(100);

/// Tunables of the engine.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub(crate) spin: Duration,
    pub(crate) unexpected_limit: u64,
    pub(crate) probe_after: Duration,
    pub(crate) dead_after: Duration,
}

struct Conn {
    stream: TcpStream,
    fd: RawFd,
    sendq: VecDeque<SendItem>,
    stage: Box<[u8]>,
    start: usize,
    end: usize,
    hdr: [u8; HEADER_LEN],
    hdr_have: usize,
    cur: Option<RxFrame>,
    /// Receives posted for this peer that wait for data (queued or being filled).
    want: usize,
    /// The peer said it is shutting down cleanly (a close frame arrived).
    peer_closed: bool,
    /// When bytes (data or keep-alive) last arrived from the peer.
    last_rx: Instant,
    last_tx: Instant,
}

// SAFETY: the raw pointers inside (`Payload::Borrowed`, `RxDest::Posted`) are only dereferenced
// under the engine lock while their operations are posted; posters guarantee validity until then.
unsafe impl Send for Conn {}

/// Why a connection failed.
enum ConnFail {
    Closed,
    Io(std::io::Error),
    Protocol(String),
    Aborted(String),
    Silent(String),
}

pub(crate) struct Inner {
    rank: usize,
    conns: Vec<Option<Conn>>,
    queues: Vec<PeerQueues>,
    ops: Ops,
    poisoned: Option<Error>,
    unexpected_bytes: u64,
    cfg: EngineConfig,
}

/// All connections of one rank.
pub(crate) struct Engine {
    rank: usize,
    world: usize,
    inner: Mutex<Inner>,
    aborted: AtomicBool,
    /// Wakes threads blocked in `poll`.
    pipe: WakePipe,
}

impl Engine {
    /// Build an engine over connected streams (`None` at our own index).
    pub(crate) fn new(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        cfg: EngineConfig,
    ) -> std::io::Result<Engine> {
        let world = streams.len();
        let mut conns = Vec::with_capacity(world);
        for s in streams {
            conns.push(match s {
                None => None,
                Some(stream) => {
                    stream.set_nonblocking(true)?;
                    stream.set_nodelay(true)?;
                    let now = Instant::now();
                    Some(Conn {
                        fd: stream.as_raw_fd(),
                        stream,
                        sendq: VecDeque::new(),
                        stage: vec![0u8; STAGE].into_boxed_slice(),
                        start: 0,
                        end: 0,
                        hdr: [0; HEADER_LEN],
                        hdr_have: 0,
                        cur: None,
                        want: 0,
                        peer_closed: false,
                        last_rx: now,
                        last_tx: now,
                    })
                }
            });
        }
        let pipe = WakePipe::new()?;
        Ok(Engine {
            rank,
            world,
            inner: Mutex::new(Inner {
                rank,
                conns,
                queues: (0..world).map(|_| PeerQueues::default()).collect(),
                ops: Ops::default(),
                poisoned: None,
                unexpected_bytes: 0,
                cfg,
            }),
            aborted: AtomicBool::new(false),
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
        let Some(c) = g.conns[peer].as_mut().filter(|c| !c.peer_closed) else {
            g.ops.forget(id);
            return Err(matcher::closed_peer(self.rank, peer, &desc, len));
        };
        c.sendq.push_back(item);
        // Eager write: small messages leave now, without waiting for a waiter.
        g.progress_tx(peer);
        Ok(id)
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
        if g.matching(peer).post_recv(post) {
            match g.conns[peer].as_mut() {
                Some(c) if !c.peer_closed => {
                    c.want += 1;
                    g.attach_parked(peer);
                }
                _ if peer == self.rank => {}
                _ => {
                    g.queues[peer].remove(id);
                    g.ops.forget(id);
                    return Err(matcher::closed_peer(self.rank, peer, &desc, cap));
                }
            }
        }
        Ok(id)
    }

    pub(crate) fn test(&self, op: OpId) -> Result<Option<usize>> {
        let mut g = self.lock();
        g.progress_all(false);
        g.ops.take_finished(op).transpose()
    }

    pub(crate) fn wait(&self, op: OpId, deadline: Instant) -> Result<usize> {
        let mut spin_until = None;
        let wait_start = Instant::now();
        let mut probed = false;
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.world + 1);
        let mut fd_peer: Vec<usize> = Vec::with_capacity(self.world + 1);
        loop {
            {
                let mut g = self.lock();
                g.progress_all(false);
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
                let silent = g
                    .conns
                    .get(peer)
                    .and_then(Option::as_ref)
                    .map(|c| now.saturating_duration_since(c.last_rx.max(wait_start)));
                if let Some(quiet) = silent.filter(|q| *q >= g.cfg.dead_after) {
                    let detail = format!(
                        "nothing (not even a keep-alive) arrived from rank {peer} for {quiet:.1?}: \
                         the process is stopped (SIGSTOP), hung in the kernel, or its host is \
                         unreachable"
                    );
                    g.conn_failed(peer, ConnFail::Silent(detail));
                    continue;
                }
                if g.parked(peer) && g.queues[peer].is_posted(op) {
                    g.unpark(peer);
                    continue;
                }
                if !probed && now.duration_since(wait_start) >= g.cfg.probe_after {
                    probed = true;
                    g.send_probe(peer, desc);
                }
                let spin_end = *spin_until.get_or_insert(now + g.cfg.spin);
                if now < spin_end {
                    drop(g);
                    std::thread::yield_now();
                    continue;
                }
                fds.clear();
                fd_peer.clear();
                fds.push(libc::pollfd { fd: self.pipe.fd(), events: libc::POLLIN, revents: 0 });
                fd_peer.push(usize::MAX);
                for (peer, c) in g.conns.iter().enumerate() {
                    let Some(c) = c else { continue };
                    let parked = matches!(c.cur, Some(RxFrame { dest: RxDest::Parked(_), .. }));
                    let mut events = if parked { libc::POLLRDHUP } else { libc::POLLIN };
                    if !c.sendq.is_empty() {
                        events |= libc::POLLOUT;
                    }
                    fds.push(libc::pollfd { fd: c.fd, events, revents: 0 });
                    fd_peer.push(peer);
                }
            }
            let slice = deadline.saturating_duration_since(Instant::now()).min(POLL_SLICE);
            let ms = slice.as_millis().max(1) as libc::c_int;
            // SAFETY: `fds` is a valid array of pollfd of the given length.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if fds[0].revents != 0 {
                self.pipe.drain();
            }
            // Serve every connection poll flagged, including ones nobody waits on: their data
            // goes to the unexpected queue (bounded) and a closed peer is noticed now.
            if fds[1..].iter().any(|f| f.revents != 0) {
                let mut g = self.lock();
                for (f, &peer) in fds.iter().zip(&fd_peer).skip(1) {
                    if f.revents & libc::POLLOUT != 0 {
                        g.progress_tx(peer);
                    }
                    if f.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                        // The peer is gone or going: take in what it sent, then see the end.
                        g.unpark(peer);
                    }
                    if f.revents & !libc::POLLOUT != 0 {
                        g.progress_rx(peer);
                    }
                }
            }
            // After a block, spin again briefly: the next message often follows closely.
            spin_until = None;
        }
    }

    pub(crate) fn cancel(&self, op: OpId) {
        let mut g = self.lock();
        g.cancel(op);
    }

    pub(crate) fn abort(&self, reason: &str) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut g = self.lock();
        let err = Error::Aborted { rank: self.rank, reason: reason.to_string() };
        g.poison(err, Some(reason));
        drop(g);
        self.pipe.wake();
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        self.lock().poisoned.clone()
    }

    /// Clean shutdown: send a close frame on every connection, let queued frames out, shut the
    /// write side, and read (discarding) until each peer closes too or `timeout` passes. Reading
    /// to the end keeps the kernel from answering late frames with a reset that could destroy
    /// data the peer has not read yet.
    pub(crate) fn shutdown(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut g = self.lock();
        let rank = self.rank;
        for c in g.conns.iter_mut().flatten() {
            let hdr = Header::control(FrameKind::Close, rank, 0).encode();
            c.sendq.push_back(SendItem::control(hdr, Vec::new()));
        }
        let mut shut = vec![false; g.conns.len()];
        let mut sink = vec![0u8; 64 * 1024];
        loop {
            let Inner { conns, ops, .. } = &mut *g;
            let mut fds = Vec::new();
            for (peer, slot) in conns.iter_mut().enumerate() {
                let Some(c) = slot else { continue };
                if c.flush(ops).is_err() {
                    *slot = None;
                    continue;
                }
                if !c.sendq.is_empty() {
                    fds.push(libc::pollfd { fd: c.fd, events: libc::POLLOUT, revents: 0 });
                    continue;
                }
                if !shut[peer] {
                    let _ = c.stream.shutdown(std::net::Shutdown::Write);
                    shut[peer] = true;
                }
                // SAFETY: reading into a local scratch buffer.
                let r = unsafe {
                    libc::recv(c.fd, sink.as_mut_ptr().cast(), sink.len(), libc::MSG_DONTWAIT)
                };
                let err = std::io::Error::last_os_error();
                if r == 0 || (r < 0 && err.kind() != std::io::ErrorKind::WouldBlock) {
                    *slot = None;
                } else if r < 0 {
                    fds.push(libc::pollfd { fd: c.fd, events: libc::POLLIN, revents: 0 });
                }
            }
            if conns.iter().all(Option::is_none) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                debug!(rank, "shutdown: peers still open at the deadline; closing anyway");
                return;
            }
            if !fds.is_empty() {
                drop(g);
                let ms = (deadline - now).min(POLL_SLICE).as_millis().max(1) as libc::c_int;
                // SAFETY: valid pollfd array.
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
                g = self.lock();
            }
        }
    }

    /// Handle control frames (keep-alive, close, abort) and closed connections without anyone
    /// waiting: peeks at the next header of every idle connection and consumes it only when it
    /// is a control frame, so data for receives not yet posted stays in the kernel. Called by the
    /// transport's background thread; this is how an abort or a death reaches a rank that is
    /// computing between collectives.
    pub(crate) fn poll_control(&self) {
        let mut g = self.lock();
        for peer in 0..g.conns.len() {
            let Some(c) = g.conns[peer].as_mut() else { continue };
            if c.cur.is_some() || c.start != c.end || c.hdr_have != 0 {
                continue;
            }
            let mut hb = [0u8; HEADER_LEN];
            // SAFETY: peeking into a local buffer.
            let r = unsafe {
                libc::recv(
                    c.fd,
                    hb.as_mut_ptr().cast(),
                    HEADER_LEN,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if r == 0 {
                g.conn_failed(peer, ConnFail::Closed);
                continue;
            }
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    g.conn_failed(peer, ConnFail::Io(e));
                }
                continue;
            }
            if r as usize == HEADER_LEN {
                let control = matches!(
                    Header::decode(&hb),
                    Ok(h) if h.kind != FrameKind::Data
                );
                if control {
                    g.progress_rx(peer);
                }
            }
        }
    }

    /// Queue a frame of exactly these header bytes and payload to `peer`, as a misbehaving but
    /// authenticated peer would send it: the tests of the receiving side's protocol checks.
    #[cfg(test)]
    pub(crate) fn send_raw(&self, peer: usize, hdr: [u8; HEADER_LEN], payload: Vec<u8>) {
        let mut g = self.lock();
        if let Some(c) = g.conns[peer].as_mut() {
            c.sendq.push_back(SendItem::control(hdr, payload));
            g.progress_tx(peer);
        }
    }

    /// Queue a keep-alive on every connection idle for `idle`; called by the transport's
    /// keep-alive thread. Never reads: data for unposted receives stays in the kernel.
    pub(crate) fn send_keepalives(&self, idle: Duration) {
        let mut g = self.lock();
        if g.poisoned.is_some() {
            return;
        }
        let now = Instant::now();
        let rank = self.rank;
        for peer in 0..g.conns.len() {
            let Some(c) = g.conns[peer].as_mut() else { continue };
            if c.sendq.is_empty() && now.duration_since(c.last_tx) >= idle {
                let hdr = Header::control(FrameKind::KeepAlive, rank, 0).encode();
                c.sendq.push_back(SendItem::control(hdr, Vec::new()));
                g.progress_tx(peer);
            }
        }
    }
}

impl Inner {
    /// Ask `peer` whether it is in the same collective as `desc` (see `FrameKind::Probe`).
    fn send_probe(&mut self, peer: usize, desc: MsgDesc) {
        if peer == self.rank || desc.tag.group & matcher::P2P_GROUP_BIT != 0 {
            return;
        }
        let Some(c) = self.conns[peer].as_mut() else { return };
        let mut h = Header::data(desc, self.rank, 0);
        h.kind = FrameKind::Probe;
        c.sendq.push_back(SendItem::control(h.encode(), Vec::new()));
        self.progress_tx(peer);
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

    /// `used` posted receives of `peer` were matched or failed: they no longer wait for data.
    fn used(&mut self, peer: usize, used: usize) {
        if let Some(c) = self.conns[peer].as_mut() {
            c.want = c.want.saturating_sub(used);
        }
    }

    fn bytes_done(&self, op: OpId) -> u64 {
        self.conns.iter().flatten().find_map(|c| queue::progress(&c.cur, &c.sendq, op)).unwrap_or(0)
    }

    /// Progress every connection that has work; with `all`, read every connection.
    fn progress_all(&mut self, all: bool) {
        for peer in 0..self.conns.len() {
            let (tx, rx) = match &self.conns[peer] {
                Some(c) => (!c.sendq.is_empty(), all || c.want > 0 || c.cur.is_some()),
                None => continue,
            };
            if tx {
                self.progress_tx(peer);
            }
            if rx {
                self.progress_rx(peer);
            }
        }
    }

    fn progress_tx(&mut self, peer: usize) {
        let r = match self.conns[peer].as_mut() {
            Some(c) => c.flush(&mut self.ops),
            None => return,
        };
        if let Err(f) = r {
            self.conn_failed(peer, f);
        }
    }

    fn progress_rx(&mut self, peer: usize) {
        // Staged bytes first: a frame that was parked or just attached may be waiting there.
        if self.conns[peer].as_ref().is_some_and(|c| c.start < c.end) {
            if let Err(f) = self.consume(peer) {
                self.conn_failed(peer, f);
                return;
            }
        }
        loop {
            self.release_failed_receive(peer);
            let r = match self.conns[peer].as_mut() {
                Some(c) => c.read_some(),
                None => return,
            };
            match r {
                Ok(0) => return,
                Ok(_) => {
                    if let Err(f) = self.consume(peer) {
                        self.conn_failed(peer, f);
                        return;
                    }
                }
                Err(f) => {
                    self.conn_failed(peer, f);
                    return;
                }
            }
        }
    }

    /// The frame being received belongs to a receive that failed (poison, a dead peer): its
    /// caller may already have freed the buffer, so the rest of the payload is read and dropped.
    fn release_failed_receive(&mut self, peer: usize) {
        let Some(f) = self.conns[peer].as_mut().and_then(|c| c.cur.as_mut()) else { return };
        if let RxDest::Posted { id, .. } = f.dest {
            if self.ops.pending(id).is_none() {
                f.dest = RxDest::Discard;
            }
        }
    }

    /// Parse what sits in the staging buffer (and finish direct reads).
    fn consume(&mut self, peer: usize) -> Result<(), ConnFail> {
        loop {
            self.release_failed_receive(peer);
            let Some(c) = self.conns[peer].as_mut() else { return Ok(()) };
            if let Some(f) = c.cur.as_mut() {
                if matches!(f.dest, RxDest::Parked(_)) {
                    break;
                }
                let avail = c.end - c.start;
                let n = avail.min(f.len - f.done);
                if n > 0 {
                    let src = &c.stage[c.start..c.start + n];
                    match &mut f.dest {
                        RxDest::Posted { buf, .. } => {
                            // SAFETY: the receive is still posted (`release_failed_receive` just
                            // turned a failed one into a discard, under the engine lock that
                            // `cancel` and every failure take) with `cap >= len` (checked at
                            // header time), and `done + n <= len`.
                            unsafe {
                                std::ptr::copy_nonoverlapping(src.as_ptr(), buf.0.add(f.done), n)
                            };
                        }
                        RxDest::Unexpected { data, .. } | RxDest::Abort(data) => {
                            data[f.done..f.done + n].copy_from_slice(src)
                        }
                        RxDest::Discard | RxDest::Parked(_) => {}
                    }
                    f.done += n;
                    c.start += n;
                }
                if f.done == f.len {
                    let f = c.cur.take();
                    if let Some(f) = f {
                        self.finish(peer, f)?;
                    }
                    continue;
                }
                break;
            }
            let avail = c.end - c.start;
            if avail == 0 {
                break;
            }
            let n = avail.min(HEADER_LEN - c.hdr_have);
            c.hdr[c.hdr_have..c.hdr_have + n].copy_from_slice(&c.stage[c.start..c.start + n]);
            c.hdr_have += n;
            c.start += n;
            if c.hdr_have < HEADER_LEN {
                break;
            }
            c.hdr_have = 0;
            let hdr = Header::decode(&c.hdr).map_err(|e: HeaderError| {
                ConnFail::Protocol(format!("undecodable frame header: {e}"))
            })?;
            self.start_frame(peer, hdr)?;
        }
        if let Some(c) = self.conns[peer].as_mut() {
            if c.start == c.end {
                c.start = 0;
                c.end = 0;
            }
        }
        Ok(())
    }

    fn start_frame(&mut self, peer: usize, hdr: Header) -> Result<(), ConnFail> {
        if self.conns[peer].as_ref().is_some_and(|c| c.peer_closed) {
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
        let dest = match hdr.kind {
            FrameKind::KeepAlive => {
                if len != 0 {
                    return Err(ConnFail::Protocol("keep-alive with a payload".into()));
                }
                RxDest::Discard
            }
            FrameKind::Probe => {
                if len != 0 {
                    return Err(ConnFail::Protocol("probe frame with a payload".into()));
                }
                if let Some(err) = matcher::probe_mismatch(self.rank, peer, &self.ops, &hdr.desc) {
                    let reason = err.to_string();
                    self.poison(err, Some(&reason));
                }
                RxDest::Discard
            }
            FrameKind::Close => {
                if len != 0 {
                    return Err(ConnFail::Protocol("close frame with a payload".into()));
                }
                self.peer_closing(peer);
                RxDest::Discard
            }
            FrameKind::Abort => {
                if len > MAX_ABORT_REASON {
                    return Err(ConnFail::Protocol(format!("abort reason of {len} bytes")));
                }
                RxDest::Abort(vec![0; len as usize])
            }
            FrameKind::Data => {
                let limit = self.cfg.unexpected_limit;
                let (landing, used) =
                    self.matching(peer).arrive_header(&hdr.desc, len, EAGER_MAX, limit);
                self.used(peer, used);
                match landing {
                    Ok(Landing::Posted { id, buf }) => RxDest::Posted { id, buf },
                    Ok(Landing::Park) => RxDest::Parked(hdr.desc),
                    // Bounded by the budget `arrive_header` checked.
                    Ok(Landing::Buffer) => {
                        RxDest::Unexpected { desc: hdr.desc, data: vec![0; len as usize] }
                    }
                    Ok(Landing::Discard) => RxDest::Discard,
                    Err(err) => {
                        self.poison(err, None);
                        return Ok(());
                    }
                }
            }
        };
        let Ok(len) = usize::try_from(len) else {
            return Err(ConnFail::Protocol(format!("frame length {len} does not fit in memory")));
        };
        let f = RxFrame { dest, len, done: 0 };
        if len == 0 {
            return self.finish(peer, f);
        }
        if let Some(c) = self.conns[peer].as_mut() {
            c.cur = Some(f);
        }
        Ok(())
    }

    fn finish(&mut self, peer: usize, f: RxFrame) -> Result<(), ConnFail> {
        match f.dest {
            RxDest::Posted { id, .. } => self.ops.complete(id, f.len),
            RxDest::Unexpected { desc, data } => {
                // A receive may have been posted while the message was arriving.
                let used =
                    self.matching(peer).arrive_whole(&desc, std::borrow::Cow::Owned(data), true);
                self.used(peer, used);
            }
            RxDest::Abort(reason) => {
                let reason = String::from_utf8_lossy(&reason).into_owned();
                return Err(ConnFail::Aborted(reason));
            }
            RxDest::Discard | RxDest::Parked(_) => {}
        }
        Ok(())
    }

    /// A receive was posted: if the frame parked on `peer`'s connection is its message, attach
    /// it (the payload then goes straight into the receive buffer).
    fn attach_parked(&mut self, peer: usize) {
        let desc = match self.conns[peer].as_ref().and_then(|c| c.cur.as_ref()) {
            Some(RxFrame { dest: RxDest::Parked(d), .. }) => *d,
            _ => return,
        };
        let len = self.conns[peer].as_ref().and_then(|c| c.cur.as_ref()).map_or(0, |f| f.len);
        // `park_above` 0: if the new receive is not this message's, the frame stays parked.
        let (landing, used) = self.matching(peer).arrive_header(&desc, len as u64, 0, 0);
        self.used(peer, used);
        let new = match landing {
            Ok(Landing::Posted { id, buf }) => RxDest::Posted { id, buf },
            Ok(Landing::Discard) => RxDest::Discard,
            _ => return,
        };
        if let Some(f) = self.conns[peer].as_mut().and_then(|c| c.cur.as_mut()) {
            f.dest = new;
        }
        self.progress_rx(peer);
    }

    /// Someone needs a later message from `peer`: move the parked frame to the unexpected queue
    /// (bounded by the budget) so the stream can advance.
    fn unpark(&mut self, peer: usize) {
        let (desc, len) = match self.conns[peer].as_ref().and_then(|c| c.cur.as_ref()) {
            Some(RxFrame { dest: RxDest::Parked(d), len, .. }) => (*d, *len),
            _ => return,
        };
        let limit = self.cfg.unexpected_limit;
        let total = self.unexpected_bytes.saturating_add(len as u64);
        if total > limit {
            let err = Error::UnexpectedOverflow { rank: self.rank, peer, bytes: total, limit };
            self.poison(err, None);
            return;
        }
        self.unexpected_bytes = total;
        if let Some(f) = self.conns[peer].as_mut().and_then(|c| c.cur.as_mut()) {
            f.dest = RxDest::Unexpected { desc, data: vec![0; len] };
        }
        self.progress_rx(peer);
    }

    fn parked(&self, peer: usize) -> bool {
        matches!(
            self.conns[peer].as_ref().and_then(|c| c.cur.as_ref()),
            Some(RxFrame { dest: RxDest::Parked(_), .. })
        )
    }

    fn cancel(&mut self, op: OpId) {
        for peer in 0..self.queues.len() {
            if self.queues[peer].remove(op) {
                if let Some(c) = self.conns[peer].as_mut() {
                    c.want = c.want.saturating_sub(1);
                }
            }
        }
        for c in self.conns.iter_mut().flatten() {
            queue::forget(&mut c.cur, &mut c.sendq, op);
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
        let reason = abort_reason.map_or_else(|| err.to_string(), str::to_string);
        let reason = reason.as_bytes();
        let reason = &reason[..reason.len().min(MAX_ABORT_REASON as usize)];
        let rank = self.rank;
        for peer in 0..self.conns.len() {
            for q in self.queues.iter_mut() {
                q.clear_posted();
            }
            let Some(c) = self.conns[peer].as_mut() else { continue };
            c.want = 0;
            queue::abort_queue(&mut c.sendq, rank, reason);
            let _ = c.flush(&mut self.ops);
        }
    }

    /// A close frame arrived: the peer finished. Operations still waiting on it fail (naming it)
    /// but the transport is not poisoned; our side of the connection is shut for writing once
    /// queued frames are out.
    fn peer_closing(&mut self, peer: usize) {
        let rank = self.rank;
        let Some(c) = self.conns[peer].as_mut() else { return };
        c.peer_closed = true;
        c.want = 0;
        if c.sendq.is_empty() {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
        matcher::fail_closed_peer(rank, peer, &mut self.ops, &mut self.queues[peer]);
    }

    fn conn_failed(&mut self, peer: usize, f: ConnFail) {
        if self.conns[peer].as_ref().is_some_and(|c| c.peer_closed)
            && matches!(f, ConnFail::Closed | ConnFail::Io(_))
        {
            // End of a clean shutdown.
            self.conns[peer] = None;
            return;
        }
        let Some(c) = self.conns[peer].take() else { return };
        let detail = match &f {
            ConnFail::Closed => "connection closed by peer".to_string(),
            ConnFail::Io(e) => format!("connection error: {e}"),
            ConnFail::Protocol(p) => format!("protocol error: {p}"),
            ConnFail::Silent(d) => d.clone(),
            ConnFail::Aborted(r) => format!("peer aborted: {r}"),
        };
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        debug!(rank = self.rank, peer, "{detail}");
        let rank = self.rank;
        self.queues[peer].clear_posted();
        if let ConnFail::Aborted(reason) = f {
            // Pass the original reason on: it names the culprit, wherever the abort started.
            let err = Error::PeerAborted { rank, peer, reason: reason.clone() };
            self.poison(err, Some(&reason));
            return;
        }
        // Operations with the failed peer name it and themselves; the rest fail through poison.
        let (err, reason) = matcher::peer_lost(rank, peer, &mut self.ops, detail);
        self.poison(err, Some(&reason));
    }
}

impl Conn {
    /// Write queued frames until the socket is full or the queue empty.
    fn flush(&mut self, ops: &mut Ops) -> Result<(), ConnFail> {
        while !self.sendq.is_empty() {
            let mut iov: [libc::iovec; MAX_IOV] =
                [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOV];
            let mut n = 0;
            for s in self.sendq.iter() {
                if n + 2 > MAX_IOV {
                    break;
                }
                if s.off < HEADER_LEN {
                    iov[n] = libc::iovec {
                        iov_base: s.hdr[s.off..].as_ptr() as *mut libc::c_void,
                        iov_len: HEADER_LEN - s.off,
                    };
                    n += 1;
                }
                let pdone = s.off.saturating_sub(HEADER_LEN);
                if s.len > pdone {
                    iov[n] = libc::iovec {
                        // SAFETY: `pdone < len`, inside the posted (or owned) payload.
                        iov_base: unsafe { s.data_ptr().add(pdone) } as *mut libc::c_void,
                        iov_len: s.len - pdone,
                    };
                    n += 1;
                }
            }
            // SAFETY: msghdr is plain data; we fill the iovec fields below.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            // SAFETY: the iovecs point into live headers and posted payloads.
            let r =
                unsafe { libc::sendmsg(self.fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock => Ok(()),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => Err(ConnFail::Io(e)),
                };
            }
            self.last_tx = Instant::now();
            let mut left = r as usize;
            while left > 0 {
                let Some(s) = self.sendq.front_mut() else { break };
                let take = left.min(s.total() - s.off);
                s.off += take;
                left -= take;
                if s.off == s.total() {
                    if let Some(id) = s.id {
                        ops.complete(id, s.len);
                    }
                    self.sendq.pop_front();
                }
            }
        }
        Ok(())
    }

    /// One read: straight into the destination for a large payload, else into the staging
    /// buffer. Returns the bytes read, 0 when nothing is available.
    fn read_some(&mut self) -> Result<usize, ConnFail> {
        if matches!(self.cur, Some(RxFrame { dest: RxDest::Parked(_), .. })) {
            return Ok(0);
        }
        let direct = match &self.cur {
            Some(f) if self.start == self.end && f.len - f.done >= DIRECT_MIN => match &f.dest {
                // SAFETY: `done < len <= cap` of the posted buffer.
                RxDest::Posted { buf, .. } => Some((unsafe { buf.0.add(f.done) }, f.len - f.done)),
                _ => None,
            },
            _ => None,
        };
        let (ptr, room) = match direct {
            Some(d) => d,
            None => {
                if self.end == self.stage.len() {
                    return Ok(0);
                }
                // SAFETY: `end < stage.len()`.
                (unsafe { self.stage.as_mut_ptr().add(self.end) }, self.stage.len() - self.end)
            }
        };
        loop {
            // SAFETY: `ptr..ptr+room` is writable (posted buffer remainder or staging space).
            let r = unsafe { libc::recv(self.fd, ptr.cast(), room, libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock => Ok(0),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => Err(ConnFail::Io(e)),
                };
            }
            if r == 0 {
                return Err(ConnFail::Closed);
            }
            let r = r as usize;
            self.last_rx = Instant::now();
            if direct.is_some() {
                if let Some(f) = self.cur.as_mut() {
                    f.done += r;
                }
            } else {
                self.end += r;
            }
            return Ok(r);
        }
    }
}
