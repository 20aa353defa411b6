//! The TCP driver: moves the core's frames over one stream socket per peer.
//!
//! Writes gather queued frames into one vectored `sendmsg` (header and payload together). Reads
//! go through a per-connection staging buffer, except a large payload bound for a posted
//! receive, which is read straight into it. A message that arrives before its receive and is too
//! large to buffer is parked by the core: its payload stays in the kernel, which flow-controls
//! the sender, until the receive is posted. While nobody waits, only control frames are taken
//! off the sockets (peeking at each header), so data for receives not yet posted stays there.
//!
//! A connection to a rank on the same host may carry its frames through shared memory instead
//! (`shm.rs`): the same writes and reads, with a copy into and out of a ring in place of
//! `sendmsg` and `recv`; its socket then carries only wake-ups and the end of the link.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm::{self, ShmLink};
use super::Connector;
use crate::transport::core::{Core, LinkFail};
use crate::transport::engine::{Driver, Mode};
use crate::wire::{FrameKind, Header, HEADER_LEN};

/// Bytes of the per-connection staging buffer small frames are read through.
const STAGE: usize = 64 * 1024;
/// A payload with at least this much left is read directly into its destination.
pub(crate) const DIRECT_MIN: usize = 16 * 1024;
/// Largest message buffered when it arrives before its receive is posted; a larger one parks.
pub(crate) const EAGER_MAX: u64 = 64 * 1024;
/// Most frames gathered into one `sendmsg`.
const MAX_IOV: usize = 64;

struct Conn {
    stream: TcpStream,
    fd: RawFd,
    stage: Box<[u8]>,
    start: usize,
    end: usize,
    /// Our write side is shut (our close frame went out).
    shut: bool,
    /// The frames go through shared memory (a peer on this host).
    shm: Option<ShmLink>,
}

/// Every peer's TCP connection of one rank.
pub(crate) struct TcpDriver {
    conns: Vec<Option<Conn>>,
    /// Where shutdown drops what peers still send.
    sink: Vec<u8>,
    /// Some connection is a socket's (not shared memory's): a spinning wait looks at readiness.
    any_socket: bool,
    /// Some connection goes through shared memory.
    any_shm: bool,
    /// Some connection goes through shared memory and this host has a CPU for each of the
    /// ranks this one shares memory with (itself included): a wait may spin without yielding.
    hot: bool,
    /// The congestion control set on each connection (`LinkConfig::tcp_congestion`).
    congestion: Option<String>,
    /// This rank offers shared memory to the ranks of its host (`LinkConfig::shm`).
    offers_shm: bool,
    /// Dials the links the core asks for (`None`: nothing connects after start, in tests).
    connector: Option<Arc<Connector>>,
}

/// Choose the socket's congestion control (`LinkConfig::tcp_congestion`); the system's default
/// stays when the kernel lacks the algorithm.
fn set_congestion(stream: &TcpStream, cc: &str, peer: usize) {
    // SAFETY: setsockopt on our own socket with a byte string and its length.
    let r = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            cc.as_ptr().cast(),
            cc.len() as libc::socklen_t,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!(
            peer,
            cc,
            "TCP congestion control not set, the system's default stays: {e}"
        );
    }
}

fn io_fail(e: &std::io::Error) -> LinkFail {
    LinkFail::Lost(format!("connection error: {e}"))
}

impl TcpDriver {
    /// A driver for `world` ranks with no connection yet: [`TcpDriver::attach`] adds each as
    /// its handshake completes, so the engine (and its keep-alives) runs while links are still
    /// connecting; `connector` dials the links the core asks for.
    pub(crate) fn empty(
        world: usize,
        congestion: Option<String>,
        offers_shm: bool,
        connector: Option<Arc<Connector>>,
    ) -> TcpDriver {
        TcpDriver {
            conns: (0..world).map(|_| None).collect(),
            sink: Vec::new(),
            any_socket: false,
            any_shm: false,
            hot: false,
            congestion,
            offers_shm,
            connector,
        }
    }

    /// Add `peer`'s connected stream (and its shared-memory link, where the set-up after its
    /// handshake made one) and bring its link up in `core`.
    ///
    /// # Errors
    /// When the socket cannot be made non-blocking.
    pub(crate) fn attach(
        &mut self,
        core: &mut Core,
        peer: usize,
        stream: TcpStream,
        link: Option<ShmLink>,
        now: Instant,
    ) -> std::io::Result<()> {
        if self.conns.get(peer).is_none() {
            // Closed (`close` cleared the table): the connection just closes.
            return Err(std::io::Error::other("the transport has shut down"));
        }
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        if let Some(cc) = &self.congestion {
            set_congestion(&stream, cc, peer);
        }
        self.conns[peer] = Some(Conn {
            fd: stream.as_raw_fd(),
            stream,
            stage: vec![0u8; STAGE].into_boxed_slice(),
            start: 0,
            end: 0,
            shut: false,
            shm: link,
        });
        core.link_up(peer, now);
        self.any_socket = self.conns.iter().flatten().any(|c| c.shm.is_none());
        let local = self.conns.iter().flatten().filter(|c| c.shm.is_some()).count();
        let cpus = crate::options::host_cpus();
        // Links connect on first use, so the shared-memory links made so far undercount the
        // ranks of this host: take the launcher's count of them (`LOCAL_WORLD_SIZE`, set by
        // tutti-run and torchrun) when it says more, and without one the whole world.
        let hinted = std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(self.conns.len());
        let ranks_here = (local + 1).max(hinted.min(self.conns.len()));
        self.hot = local > 0 && ranks_here <= cpus;
        self.any_shm = local > 0;
        Ok(())
    }

    /// Connections that go through shared memory.
    pub(crate) fn shared_links(&self) -> usize {
        self.conns.iter().flatten().filter(|c| c.shm.is_some()).count()
    }

    /// `peer`'s shared-memory link, if its connection has one.
    fn shm(&self, peer: usize) -> Option<&ShmLink> {
        self.conns.get(peer)?.as_ref()?.shm.as_ref()
    }

    /// Serve the shared-memory links outside a sleep's flags: the rings have no readiness to
    /// poll for, so every pass looks at them (an atomic load each).
    fn serve_shm(&mut self, core: &mut Core, mode: Mode, now: Instant) {
        if !self.any_shm {
            return;
        }
        for peer in 0..self.conns.len() {
            if self.shm(peer).is_some() {
                self.serve_shm_link(core, peer, mode, now);
            }
        }
    }

    /// One pass over a shared-memory link: its end, once seen; otherwise what it has to write
    /// and, while a thread waits, to read (into the unexpected queue, bounded, for receives not
    /// yet posted, as `ready` does for a flagged socket).
    fn serve_shm_link(&mut self, core: &mut Core, peer: usize, mode: Mode, now: Instant) {
        if self.shm(peer).is_some_and(|l| l.peer_eof) {
            self.finish_ended(core, peer, now);
            return;
        }
        if core.wants_tx(peer) {
            self.progress_tx(core, peer, now);
        }
        if mode == Mode::Wait {
            self.progress_rx(core, peer, now);
        }
    }

    /// A shared-memory peer ended its side (its socket reached its end): whatever the mode,
    /// take in what its ring holds (a parked frame moves to the unexpected queue, bounded by
    /// the budget) and then see the end, which fails the link unless its close came first.
    fn finish_ended(&mut self, core: &mut Core, peer: usize, now: Instant) {
        core.unpark(peer);
        self.progress_rx(core, peer, now);
    }

    fn progress_tx(&mut self, core: &mut Core, peer: usize, now: Instant) {
        let Some(c) = self.conns[peer].as_mut() else { return };
        if !core.is_up(peer) {
            return;
        }
        match c.flush(core, peer, now) {
            Err(f) => core.link_failed(peer, f),
            Ok(()) => {
                if core.tx_finished(peer) && !c.shut {
                    let _ = c.stream.shutdown(std::net::Shutdown::Write);
                    c.shut = true;
                }
            }
        }
    }

    fn progress_rx(&mut self, core: &mut Core, peer: usize, now: Instant) {
        let Some(c) = self.conns[peer].as_mut() else { return };
        // Staged bytes first: a frame that was parked or just attached may be waiting there.
        c.consume(core, peer, now);
        loop {
            if !core.is_up(peer) || core.rx_parked(peer) {
                return;
            }
            match c.read_some(core, peer, now) {
                Ok(n) if n.bytes == 0 => return,
                Ok(n) => {
                    c.consume(core, peer, now);
                    if n.drained {
                        // The kernel had less than we asked for: the socket was empty a
                        // moment ago. Asking again would cost a `recv` that finds nothing
                        // (and takes the socket's lock, which the sender's delivery needs);
                        // poll is level-triggered, so later bytes are seen on the next pass.
                        return;
                    }
                }
                Err(f) => {
                    core.link_failed(peer, f);
                    return;
                }
            }
        }
    }

    /// Take control frames (keep-alive, close, abort) and closed connections off idle sockets:
    /// peeks at the next header and reads only when it is a control frame, so data for
    /// receives not yet posted stays in the kernel. This is how an abort or a death reaches a
    /// rank that is computing between collectives.
    fn poll_control(&mut self, core: &mut Core, now: Instant) {
        for peer in 0..self.conns.len() {
            let Some(c) = self.conns[peer].as_mut() else { continue };
            if !core.is_up(peer) || !core.rx_idle(peer) || c.start != c.end {
                continue;
            }
            let mut hb = [0u8; HEADER_LEN];
            if let Some(l) = c.shm.as_ref() {
                // The end of the link was seen on its socket (`ready`); the ring says the rest.
                let control = match l.avail() {
                    Err(e) => {
                        core.link_failed(peer, LinkFail::Protocol(e));
                        continue;
                    }
                    // An ended link is finished by the pass (`serve_shm_link`).
                    Ok(0) => false,
                    Ok(_) => {
                        l.peek(&mut hb) == HEADER_LEN
                            && matches!(Header::decode(&hb), Ok(h) if h.kind != FrameKind::Data)
                    }
                };
                if control {
                    self.progress_rx(core, peer, now);
                }
                continue;
            }
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
                core.link_failed(peer, LinkFail::Closed);
                continue;
            }
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    core.link_failed(peer, io_fail(&e));
                }
                continue;
            }
            if r as usize == HEADER_LEN
                && matches!(Header::decode(&hb), Ok(h) if h.kind != FrameKind::Data)
            {
                self.progress_rx(core, peer, now);
            }
        }
    }
}

impl Driver for TcpDriver {
    const WAITING_NAP: Duration = Duration::from_millis(100);

    fn look_while_spinning(&self) -> bool {
        self.any_socket
    }

    fn dial(&mut self, core: &mut Core, peer: usize) {
        let why = match &self.connector {
            Some(c) => c.request(peer).err(),
            None => Some("this transport connects no links after start-up".to_string()),
        };
        if let Some(why) = why {
            core.link_failed(peer, LinkFail::Lost(why));
        }
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        // Not connected (yet: links connect on first use; or no more).
        let Some(c) = self.conns.get(peer)?.as_ref() else { return Some("unconnected") };
        Some(if c.shm.is_some() { "shm" } else { "tcp" })
    }

    fn offers_shared_memory(&self) -> bool {
        self.offers_shm
    }

    fn hot_spin(&self) -> bool {
        self.hot
    }

    fn spin_progress(&self) -> u64 {
        if !self.any_shm {
            return 0;
        }
        self.conns.iter().flatten().filter_map(|c| c.shm.as_ref()).map(|l| l.moved).sum()
    }

    fn flush(&mut self, core: &mut Core, peer: usize, now: Instant) {
        self.progress_tx(core, peer, now);
    }

    fn read(&mut self, core: &mut Core, peer: usize, now: Instant) {
        self.progress_rx(core, peer, now);
    }

    fn progress(&mut self, core: &mut Core, mode: Mode, now: Instant) {
        if mode == Mode::Idle {
            self.poll_control(core, now);
        }
        for peer in 0..self.conns.len() {
            if self.conns[peer].is_none() {
                continue;
            }
            if self.shm(peer).is_some() {
                self.serve_shm_link(core, peer, mode, now);
                continue;
            }
            if core.wants_tx(peer) {
                self.progress_tx(core, peer, now);
            }
            if mode == Mode::Wait && core.wants_rx(peer) {
                self.progress_rx(core, peer, now);
            }
        }
    }

    /// Before a sleep: ask the peers on shared memory to wake us when they write to a ring we
    /// read (not while idle: data for receives not yet posted stays in the ring, and control
    /// frames are looked for on the background's schedule, as on a socket) or make room in one
    /// we wait to write to.
    fn arm(&mut self, core: &Core, mode: Mode) -> bool {
        if !self.any_shm {
            return false;
        }
        let mut ready = false;
        for (peer, c) in self.conns.iter().enumerate() {
            let Some(l) = c.as_ref().and_then(|c| c.shm.as_ref()) else { continue };
            if !core.is_up(peer) {
                continue;
            }
            if l.peer_eof {
                // Its end was seen and is served by the next pass, not by a sleep.
                return true;
            }
            if core.wants_tx(peer) {
                ready |= l.arm_tx();
            }
            if mode != Mode::Idle && !core.rx_parked(peer) {
                ready |= l.arm_rx();
            }
        }
        ready
    }

    fn next_timer(&mut self) -> Option<Instant> {
        None
    }

    fn poll_set(&mut self, core: &Core, mode: Mode, fds: &mut Vec<libc::pollfd>) {
        for (peer, c) in self.conns.iter().enumerate() {
            let Some(c) = c else { continue };
            if let Some(l) = c.shm.as_ref() {
                // Wake-ups and the peer's end arrive on the socket; the frames never do.
                let events = match mode {
                    // At its end the socket stays readable: the passes finish the link.
                    _ if l.peer_eof => 0,
                    Mode::Idle if core.wants_tx(peer) => libc::POLLIN,
                    Mode::Idle => libc::POLLRDHUP,
                    _ => libc::POLLIN,
                };
                if events != 0 {
                    fds.push(libc::pollfd { fd: c.fd, events, revents: 0 });
                }
                continue;
            }
            let tx = if core.wants_tx(peer) { libc::POLLOUT } else { 0 };
            let events = match mode {
                // A parked frame stays in the kernel: watch only for the peer's end.
                Mode::Wait if core.rx_parked(peer) => libc::POLLRDHUP | tx,
                Mode::Wait => libc::POLLIN | tx,
                // Idle sockets are peeked at on the background's schedule: data waiting for a
                // receive not yet posted would keep `POLLIN` set.
                Mode::Idle => tx,
                Mode::Shutdown if tx != 0 => tx,
                Mode::Shutdown => libc::POLLIN,
            };
            if events != 0 {
                fds.push(libc::pollfd { fd: c.fd, events, revents: 0 });
            }
        }
    }

    fn ready(&mut self, core: &mut Core, mode: Mode, fds: &[libc::pollfd], now: Instant) {
        for f in fds.iter().filter(|f| f.revents != 0) {
            // By descriptor: another thread may have built its own set since this one.
            let Some(peer) =
                self.conns.iter().position(|c| c.as_ref().is_some_and(|c| c.fd == f.fd))
            else {
                continue;
            };
            if let Some(c) = self.conns[peer].as_mut() {
                if let Some(l) = c.shm.as_mut() {
                    if shm::drain_wakes(c.fd) {
                        // The peer is gone or going: served below (`finish_ended`).
                        l.peer_eof = true;
                    }
                    continue;
                }
            }
            if f.revents & libc::POLLOUT != 0 {
                self.progress_tx(core, peer, now);
            }
            if mode != Mode::Wait {
                continue;
            }
            if f.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                // The peer is gone or going: take in what it sent, then see the end.
                core.unpark(peer);
            }
            // Serve every connection poll flagged, including ones nobody waits on: their data
            // goes to the unexpected queue (bounded) and a closed peer is noticed now.
            if f.revents & !libc::POLLOUT != 0 {
                self.progress_rx(core, peer, now);
            }
        }
        match mode {
            Mode::Idle if self.any_shm => self.poll_control(core, now),
            _ => {}
        }
        self.serve_shm(core, mode, now);
    }

    fn link_down(&mut self, _core: &mut Core, peer: usize) {
        if let Some(c) = self.conns[peer].take() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Let queued frames (the close last) out, shut the write side, and read (discarding)
    /// until the peer closes too. Reading to the end keeps the kernel from answering late
    /// frames with a reset that could destroy data the peer has not read yet.
    fn shutdown_step(&mut self, core: &mut Core, now: Instant) -> bool {
        if self.sink.is_empty() {
            self.sink = vec![0u8; STAGE];
        }
        for peer in 0..self.conns.len() {
            let Some(c) = self.conns[peer].as_mut() else { continue };
            if c.shm.is_some() {
                if c.shutdown_shm(core, peer, now) {
                    self.conns[peer] = None;
                }
                continue;
            }
            if core.is_up(peer) && core.wants_tx(peer) {
                if c.flush(core, peer, now).is_err() {
                    self.conns[peer] = None;
                    continue;
                }
                if core.wants_tx(peer) {
                    continue;
                }
            }
            if !c.shut {
                let _ = c.stream.shutdown(std::net::Shutdown::Write);
                c.shut = true;
            }
            // SAFETY: reading into our own scratch buffer.
            let r = unsafe {
                libc::recv(c.fd, self.sink.as_mut_ptr().cast(), self.sink.len(), libc::MSG_DONTWAIT)
            };
            let err = std::io::Error::last_os_error();
            if r == 0 || (r < 0 && err.kind() != std::io::ErrorKind::WouldBlock) {
                self.conns[peer] = None;
            }
        }
        self.conns.iter().all(Option::is_none)
    }

    fn close(&mut self, _core: &mut Core, _now: Instant) {
        self.conns.clear();
    }
}

/// What one [`Conn::read_some`] got.
#[derive(Debug, Clone, Copy)]
struct Read {
    bytes: usize,
    drained: bool,
}

impl Conn {
    /// One shutdown step of a shared-memory link; true when it is finished. Drops what the
    /// peer still writes first (it may be waiting for room to write its close), then sees our
    /// queued frames (the close last) into the ring and ends our side of the socket, until the
    /// peer's end arrives there.
    fn shutdown_shm(&mut self, core: &mut Core, peer: usize, now: Instant) -> bool {
        let fd = self.fd;
        let Some(l) = self.shm.as_mut() else { return true };
        match l.avail() {
            Ok(n) if n > 0 => {
                l.skip(n);
                if l.release() {
                    shm::wake(fd);
                }
            }
            Ok(_) => {}
            Err(_) => return true,
        }
        if shm::drain_wakes(fd) {
            l.peer_eof = true;
        }
        if l.peer_eof {
            // Gone, or finished its side after its close: nothing more to see out.
            return true;
        }
        if core.is_up(peer) && core.wants_tx(peer) {
            if self.flush(core, peer, now).is_err() {
                return true;
            }
            if core.wants_tx(peer) {
                return false;
            }
        }
        if !self.shut {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
            self.shut = true;
        }
        false
    }

    /// Write queued frames into the shared ring until it is full or the queue empty; wake the
    /// peer if it sleeps.
    fn flush_shm(&mut self, core: &mut Core, peer: usize, now: Instant) -> Result<(), LinkFail> {
        let Some(l) = self.shm.as_mut() else { return Ok(()) };
        while core.wants_tx(peer) {
            let mut room = l.room().map_err(LinkFail::Protocol)?.min(shm::PIECE_BYTES);
            let mut n = 0;
            for s in core.sendq(peer).iter() {
                if room == 0 {
                    break;
                }
                if s.off < HEADER_LEN {
                    let k = (HEADER_LEN - s.off).min(room);
                    // SAFETY: `k` bytes of the header, at most the room left.
                    unsafe { l.put(s.hdr[s.off..].as_ptr(), k) };
                    (n, room) = (n + k, room - k);
                    if room == 0 {
                        break;
                    }
                }
                let pdone = s.off.saturating_sub(HEADER_LEN);
                if s.len > pdone {
                    let k = (s.len - pdone).min(room);
                    // SAFETY: `pdone + k <= len`, inside the posted (or owned) payload; at most
                    // the room left.
                    unsafe { l.put(s.data_ptr().add(pdone), k) };
                    (n, room) = (n + k, room - k);
                }
            }
            if n == 0 {
                return Ok(());
            }
            if l.publish() {
                shm::wake(self.fd);
            }
            core.tx_done(peer, n, now);
        }
        Ok(())
    }

    /// Write queued frames until the socket is full or the queue empty.
    fn flush(&mut self, core: &mut Core, peer: usize, now: Instant) -> Result<(), LinkFail> {
        if self.shm.is_some() {
            return self.flush_shm(core, peer, now);
        }
        while core.wants_tx(peer) {
            let mut iov: [libc::iovec; MAX_IOV] =
                [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOV];
            let mut n = 0;
            for s in core.sendq(peer).iter() {
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
                    _ => Err(io_fail(&e)),
                };
            }
            core.tx_done(peer, r as usize, now);
        }
        Ok(())
    }

    /// Offer the staged bytes to the core; keep what it leaves (a parked frame's payload).
    fn consume(&mut self, core: &mut Core, peer: usize, now: Instant) {
        if self.start < self.end {
            self.start += core.rx_bytes(peer, &self.stage[self.start..self.end], now);
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// One read: straight into the destination for a large payload, else into the staging
    /// buffer. Returns the bytes read (0 when nothing is available) and whether the read took
    /// less than there was room for (the socket was drained).
    fn read_some(&mut self, core: &mut Core, peer: usize, now: Instant) -> Result<Read, LinkFail> {
        let direct = if self.start == self.end { core.rx_direct(peer, DIRECT_MIN) } else { None };
        let (ptr, room) = match direct {
            Some(d) => d,
            None => {
                if self.end == self.stage.len() {
                    return Ok(Read { bytes: 0, drained: false });
                }
                // SAFETY: `end < stage.len()`.
                (unsafe { self.stage.as_mut_ptr().add(self.end) }, self.stage.len() - self.end)
            }
        };
        if let Some(l) = self.shm.as_mut() {
            let avail = l.avail().map_err(LinkFail::Protocol)?;
            if avail == 0 {
                return if l.peer_eof {
                    Err(LinkFail::Closed)
                } else {
                    Ok(Read { bytes: 0, drained: true })
                };
            }
            let r = avail.min(room).min(shm::PIECE_BYTES);
            // SAFETY: `r` bytes fit at `ptr` and are published.
            unsafe { l.take(ptr, r) };
            if l.release() {
                shm::wake(self.fd);
            }
            if direct.is_some() {
                core.rx_direct_done(peer, r, now);
            } else {
                self.end += r;
            }
            return Ok(Read { bytes: r, drained: r < room.min(shm::PIECE_BYTES) });
        }
        loop {
            // SAFETY: `ptr..ptr+room` is writable (posted buffer remainder or staging space).
            let r = unsafe { libc::recv(self.fd, ptr.cast(), room, libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock => Ok(Read { bytes: 0, drained: true }),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => Err(io_fail(&e)),
                };
            }
            if r == 0 {
                return Err(LinkFail::Closed);
            }
            let r = r as usize;
            if direct.is_some() {
                core.rx_direct_done(peer, r, now);
            } else {
                self.end += r;
            }
            return Ok(Read { bytes: r, drained: r < room });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn congestion_of(s: &TcpStream) -> String {
        let mut buf = [0u8; 16];
        let mut len = buf.len() as libc::socklen_t;
        // SAFETY: getsockopt into a 16-byte buffer whose length we pass.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_CONGESTION,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        String::from_utf8_lossy(&buf[..len as usize]).trim_end_matches('\0').to_string()
    }

    #[test]
    fn congestion_control_is_set_and_a_missing_one_is_skipped() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let before = congestion_of(&s);
        // Reno is built into every Linux kernel.
        set_congestion(&s, "reno", 1);
        assert_eq!(congestion_of(&s), "reno");
        set_congestion(&s, "no-such-cc", 1);
        assert_eq!(congestion_of(&s), "reno", "a missing algorithm leaves the socket as it was");
        assert!(!before.is_empty());
    }
}
