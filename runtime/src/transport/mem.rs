//! In-memory transport: the ranks of a job are threads of one process.
//!
//! It is the production transport with the sockets taken out. Every rank runs the same
//! connection core and engine as TCP and QUIC — framing, matching, fingerprint checks, flow
//! control, deadlines, the probe of a long wait, keep-alives, dead-peer rules, poisoning and
//! abort frames — under a driver of its own, `MemDriver`, which moves the core's frames
//! through one bounded in-memory pipe per direction of each pair of ranks (the counterpart of a
//! socket's buffers) and wakes the reading rank's engine through a descriptor it sleeps on. So
//! an algorithm that passes here has run through the state machine that runs on the wire.
//!
//! An optional per-link delay hook holds back what a rank writes, to exercise orderings in
//! tests; order per link is kept.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::transport::core::{Core, CoreConfig, LinkFail};
use crate::transport::engine::{Driver, Engine, Mode, Running, Wired};
use crate::transport::tcp::driver::EAGER_MAX;
use crate::transport::LinkConfig;
use crate::util::WakePipe;
use crate::wire::{FrameKind, Header, HEADER_LEN};

/// A function giving the delay of `len` bytes written from `src` to `dst`.
pub type DelayFn = dyn Fn(usize, usize, usize) -> Duration + Send + Sync;

/// Bytes one direction of a link holds before its writer must wait for the reader, as a
/// loopback socket's buffers do (the core's flow control works above it, in the same way).
pub const PIPE_BYTES: usize = 4 << 20;

/// What the writer handed over in one go.
struct Chunk {
    /// Not readable before this instant (the delay hook); `None`: at once.
    ready: Option<Instant>,
    data: Vec<u8>,
    /// Bytes already read.
    off: usize,
}

/// One direction of a link: what `src` wrote and `dst` has not read yet.
#[derive(Default)]
struct PipeState {
    chunks: VecDeque<Chunk>,
    /// Unread bytes.
    held: usize,
    /// The writer ended its side (after its last byte): the reader sees the end once it has
    /// read everything.
    shut: bool,
    /// The reader went away: writes fail.
    reset: bool,
    /// The writer found the pipe full: the reader wakes it when it makes room.
    writer_waits: bool,
    /// The latest ready time handed out (delays never reorder a link).
    last_ready: Option<Instant>,
}

#[derive(Default)]
struct Pipe {
    state: Mutex<PipeState>,
    /// Mirrors of `held > 0 || shut`, read without the lock by a spinning reader.
    readable: AtomicBool,
}

impl Pipe {
    fn lock(&self) -> MutexGuard<'_, PipeState> {
        // Critical sections are short and panic-free: a poisoned lock holds consistent state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PipeState {
    fn set_readable(&self, pipe: &Pipe) {
        pipe.readable.store(self.held > 0 || self.shut, Ordering::Release);
    }
}

/// The pipes and wake-ups of one in-memory job.
struct Fabric {
    n: usize,
    /// `pipes[src * n + dst]`.
    pipes: Vec<Pipe>,
    /// Raised for a rank when a peer wrote to it or ended its side. Only a rank that waits for
    /// an operation sleeps on it and drains it (the background thread, which leaves data for
    /// receives not yet posted in the pipe, must not swallow a wake-up a waiter needs).
    rx_wakes: Vec<WakePipe>,
    /// Raised for a rank when a peer wrote a control frame (keep-alive, probe, close, abort)
    /// or ended its side: what the background thread sleeps on while nobody waits, so a peer's
    /// abort or close reaches a computing rank at once.
    ctl_wakes: Vec<WakePipe>,
    /// Raised for a rank when a peer made room in a full pipe or closed its end: whoever
    /// drains it also writes.
    tx_wakes: Vec<WakePipe>,
    delay: Option<Arc<DelayFn>>,
}

impl Fabric {
    fn pipe(&self, src: usize, dst: usize) -> &Pipe {
        &self.pipes[src * self.n + dst]
    }
}

/// Moves one rank's frames through the job's pipes.
pub(crate) struct MemDriver {
    rank: usize,
    fabric: Arc<Fabric>,
    /// Links still open on our side.
    open: Vec<bool>,
    /// Our writing side of a link is shut (our close frame went out).
    shut: Vec<bool>,
}

impl MemDriver {
    /// Tell `peer` there is something to read from us.
    fn wake_reader(&self, peer: usize) {
        self.fabric.rx_wakes[peer].wake();
    }

    /// Tell `peer` a control frame or our end is on its way, even if nobody waits there.
    fn wake_idle(&self, peer: usize) {
        self.fabric.ctl_wakes[peer].wake();
    }

    /// Tell `peer` it may write to us again.
    fn wake_writer(&self, peer: usize) {
        self.fabric.tx_wakes[peer].wake();
    }

    /// Write what the core queued for `peer` until its pipe is full.
    fn tx(&mut self, core: &mut Core, peer: usize, now: Instant) {
        if !self.open[peer] || !core.is_up(peer) {
            return;
        }
        let pipe = self.fabric.pipe(self.rank, peer);
        let mut st = pipe.lock();
        if st.reset {
            drop(st);
            core.link_failed(peer, LinkFail::Lost("the peer's end of the link is closed".into()));
            return;
        }
        if core.wants_tx(peer) {
            let room = PIPE_BYTES.saturating_sub(st.held);
            let mut data = Vec::new();
            let mut control = false;
            for s in core.sendq(peer).iter() {
                if data.len() == room {
                    break;
                }
                control |= s.id.is_none();
                let take = |from: &[u8], data: &mut Vec<u8>| {
                    let n = from.len().min(room - data.len());
                    data.extend_from_slice(&from[..n]);
                };
                if s.off < HEADER_LEN {
                    take(&s.hdr[s.off..], &mut data);
                }
                let done = s.off.saturating_sub(HEADER_LEN);
                take(&s.payload()[done..], &mut data);
            }
            if data.is_empty() {
                st.writer_waits = true;
                return;
            }
            let n = data.len();
            let ready = self.fabric.delay.as_ref().map(|f| {
                let r = now + f(self.rank, peer, n);
                let r = st.last_ready.map_or(r, |l| r.max(l));
                st.last_ready = Some(r);
                r
            });
            let was_empty = st.held == 0;
            st.held += n;
            st.chunks.push_back(Chunk { ready, data, off: 0 });
            st.set_readable(pipe);
            // Full now: say so before the lock goes, or a reader emptying the pipe in between
            // would not know to wake us.
            let full = st.held >= PIPE_BYTES;
            st.writer_waits |= full;
            drop(st);
            if was_empty {
                self.wake_reader(peer);
            }
            if control {
                self.wake_idle(peer);
            }
            core.tx_done(peer, n, now);
            if full {
                return;
            }
        } else {
            drop(st);
        }
        if core.tx_finished(peer) && !self.shut[peer] {
            self.shut_write(peer);
        }
    }

    /// End our writing side of the link to `peer`.
    fn shut_write(&mut self, peer: usize) {
        self.shut[peer] = true;
        let pipe = self.fabric.pipe(self.rank, peer);
        let mut st = pipe.lock();
        st.shut = true;
        st.set_readable(pipe);
        drop(st);
        self.wake_reader(peer);
        self.wake_idle(peer);
    }

    /// Hand what `peer` wrote to the core, until the core stops taking (a parked frame), the
    /// pipe is empty, or a delayed chunk is not due yet.
    fn rx(&mut self, core: &mut Core, peer: usize, now: Instant) {
        let pipe = self.fabric.pipe(peer, self.rank);
        if !self.open[peer] || !pipe.readable.load(Ordering::Acquire) {
            return;
        }
        let mut st = pipe.lock();
        let mut freed = false;
        loop {
            if !core.is_up(peer) || core.rx_parked(peer) {
                break;
            }
            let Some(front) = st.chunks.front_mut() else {
                if st.shut {
                    drop(st);
                    core.link_failed(peer, LinkFail::Closed);
                    return;
                }
                break;
            };
            if front.ready.is_some_and(|r| r > now) {
                break;
            }
            let used = core.rx_bytes(peer, &front.data[front.off..], now);
            front.off += used;
            let whole = front.off == front.data.len();
            if whole {
                st.chunks.pop_front();
            }
            st.held -= used;
            freed |= used > 0;
            if !whole {
                break;
            }
        }
        st.set_readable(pipe);
        let wake_writer = freed && std::mem::take(&mut st.writer_waits);
        drop(st);
        if wake_writer {
            self.wake_writer(peer);
        }
    }

    /// While nobody waits: take a control frame (keep-alive, close, abort, probe) or the end of
    /// the link, but leave data for receives not yet posted in the pipe, as the TCP driver
    /// leaves it in the kernel.
    fn rx_control(&mut self, core: &mut Core, peer: usize, now: Instant) {
        let pipe = self.fabric.pipe(peer, self.rank);
        if !self.open[peer]
            || !core.is_up(peer)
            || !core.rx_idle(peer)
            || !pipe.readable.load(Ordering::Acquire)
        {
            return;
        }
        let control = {
            let st = pipe.lock();
            let mut hb = [0u8; HEADER_LEN];
            let mut have = 0;
            for c in st.chunks.iter() {
                if have == HEADER_LEN || c.ready.is_some_and(|r| r > now) {
                    break;
                }
                let from = &c.data[c.off..];
                let n = from.len().min(HEADER_LEN - have);
                hb[have..have + n].copy_from_slice(&from[..n]);
                have += n;
            }
            (have == 0 && st.shut)
                || (have == HEADER_LEN
                    && matches!(Header::decode(&hb), Ok(h) if h.kind != FrameKind::Data))
        };
        if control {
            self.rx(core, peer, now);
        }
    }

    fn serve(&mut self, core: &mut Core, mode: Mode, now: Instant) {
        for peer in 0..self.fabric.n {
            if peer == self.rank || !self.open[peer] {
                continue;
            }
            if core.wants_tx(peer) {
                self.tx(core, peer, now);
            }
            match mode {
                Mode::Wait => self.rx(core, peer, now),
                Mode::Idle => self.rx_control(core, peer, now),
                Mode::Shutdown => {}
            }
        }
    }

    /// Close both directions of the link to `peer`: the peer reads what we wrote, then the end;
    /// its writes fail.
    fn close_link(&mut self, peer: usize) {
        if !std::mem::replace(&mut self.open[peer], false) {
            return;
        }
        if !self.shut[peer] {
            self.shut_write(peer);
        }
        let pipe = self.fabric.pipe(peer, self.rank);
        let mut st = pipe.lock();
        st.reset = true;
        st.chunks.clear();
        st.held = 0;
        st.set_readable(pipe);
        drop(st);
        self.wake_writer(peer);
    }
}

impl Drop for MemDriver {
    fn drop(&mut self) {
        for peer in 0..self.fabric.n {
            if peer != self.rank {
                self.close_link(peer);
            }
        }
    }
}

impl Driver for MemDriver {
    const WAITING_NAP: Duration = Duration::from_millis(100);

    fn flush(&mut self, core: &mut Core, peer: usize, now: Instant) {
        self.tx(core, peer, now);
    }

    fn read(&mut self, core: &mut Core, peer: usize, now: Instant) {
        self.rx(core, peer, now);
    }

    fn progress(&mut self, core: &mut Core, mode: Mode, now: Instant) {
        self.serve(core, mode, now);
    }

    fn next_timer(&mut self) -> Option<Instant> {
        self.fabric.delay.as_ref()?;
        // Only times still to come: a chunk already due that stays in the pipe (behind a parked
        // frame, or data an idle rank leaves) must not make every sleep a zero one.
        let now = Instant::now();
        (0..self.fabric.n)
            .filter(|p| *p != self.rank && self.open[*p])
            .filter_map(|p| self.fabric.pipe(p, self.rank).lock().chunks.front()?.ready)
            .filter(|r| *r > now)
            .min()
    }

    /// Room to write and control frames, always; data, unless nobody waits (the background
    /// thread leaves data for receives not yet posted in the pipe, and must not swallow the
    /// wake-up of a waiter that comes later).
    fn poll_set(&mut self, _core: &Core, mode: Mode, fds: &mut Vec<libc::pollfd>) {
        let f = &self.fabric;
        for w in [&f.tx_wakes[self.rank], &f.ctl_wakes[self.rank]] {
            fds.push(libc::pollfd { fd: w.fd(), events: libc::POLLIN, revents: 0 });
        }
        if mode != Mode::Idle {
            let fd = f.rx_wakes[self.rank].fd();
            fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        }
    }

    fn ready(&mut self, core: &mut Core, mode: Mode, _fds: &[libc::pollfd], now: Instant) {
        // Drain first: whatever is written after this raises the wake-up again.
        self.fabric.tx_wakes[self.rank].drain();
        self.fabric.ctl_wakes[self.rank].drain();
        if mode != Mode::Idle {
            self.fabric.rx_wakes[self.rank].drain();
        }
        self.serve(core, mode, now);
    }

    fn link_down(&mut self, _core: &mut Core, peer: usize) {
        self.close_link(peer);
    }

    /// Let queued frames (the close last) out, shut our side, and discard what the peers still
    /// write until they shut theirs.
    fn shutdown_step(&mut self, core: &mut Core, now: Instant) -> bool {
        self.fabric.tx_wakes[self.rank].drain();
        self.fabric.ctl_wakes[self.rank].drain();
        self.fabric.rx_wakes[self.rank].drain();
        for peer in 0..self.fabric.n {
            if peer == self.rank || !self.open[peer] {
                continue;
            }
            if core.is_up(peer) && core.wants_tx(peer) {
                self.tx(core, peer, now);
                if core.wants_tx(peer) && core.is_up(peer) {
                    continue;
                }
            }
            if !self.shut[peer] {
                self.shut_write(peer);
            }
            let pipe = self.fabric.pipe(peer, self.rank);
            let mut st = pipe.lock();
            st.chunks.clear();
            st.held = 0;
            let ended = st.shut || st.reset;
            let wake_writer = std::mem::take(&mut st.writer_waits);
            st.set_readable(pipe);
            drop(st);
            if wake_writer {
                self.wake_writer(peer);
            }
            if ended {
                self.close_link(peer);
            }
        }
        (0..self.fabric.n).all(|p| p == self.rank || !self.open[p])
    }

    fn close(&mut self, _core: &mut Core, _now: Instant) {
        for peer in 0..self.fabric.n {
            if peer != self.rank {
                self.close_link(peer);
            }
        }
    }
}

/// One rank of an in-memory job. Build a whole job with [`MemTransport::world`] and give each
/// rank to its own thread. Each rank has a background thread (`tutti-mem-R`) that keeps its
/// links alive while its thread computes, as over TCP.
pub struct MemTransport {
    wire: Running<MemDriver>,
}

impl std::fmt::Debug for MemTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemTransport").field("rank", &self.wire.engine().rank()).finish()
    }
}

impl MemTransport {
    /// Create the `n` ranks of one in-memory job with the default link settings.
    ///
    /// # Panics
    /// If the process is out of descriptors or threads (a test machine's limits).
    pub fn world(n: usize) -> Vec<MemTransport> {
        Self::world_with(n, &LinkConfig::default())
    }

    /// As [`world`](MemTransport::world), with every write from `src` to `dst` readable only
    /// after `delay(src, dst, len)`. Order per link is kept.
    ///
    /// # Panics
    /// As [`world`](MemTransport::world).
    pub fn world_with_delay(n: usize, delay: Arc<DelayFn>) -> Vec<MemTransport> {
        Self::build(n, &LinkConfig::default(), Some(delay))
            .unwrap_or_else(|e| panic!("in-memory world of {n}: {e}"))
    }

    /// As [`world`](MemTransport::world), with these link settings: flow control
    /// (`window`), the unexpected budget, keep-alives, the dead-peer limit, the probe and the
    /// spin apply as over TCP; the addresses and the connect settings do not.
    ///
    /// # Panics
    /// As [`world`](MemTransport::world).
    pub fn world_with(n: usize, cfg: &LinkConfig) -> Vec<MemTransport> {
        Self::build(n, cfg, None).unwrap_or_else(|e| panic!("in-memory world of {n}: {e}"))
    }

    fn build(
        n: usize,
        cfg: &LinkConfig,
        delay: Option<Arc<DelayFn>>,
    ) -> std::io::Result<Vec<MemTransport>> {
        let fabric = Arc::new(Fabric {
            n,
            pipes: (0..n * n).map(|_| Pipe::default()).collect(),
            rx_wakes: (0..n).map(|_| WakePipe::new()).collect::<std::io::Result<_>>()?,
            ctl_wakes: (0..n).map(|_| WakePipe::new()).collect::<std::io::Result<_>>()?,
            tx_wakes: (0..n).map(|_| WakePipe::new()).collect::<std::io::Result<_>>()?,
            delay,
        });
        let now = Instant::now();
        (0..n)
            .map(|rank| {
                let mut core = Core::new(rank, n, CoreConfig::from_link(cfg, EAGER_MAX, true), now);
                for peer in (0..n).filter(|p| *p != rank) {
                    core.link_up(peer, now);
                }
                let driver = MemDriver {
                    rank,
                    fabric: fabric.clone(),
                    open: (0..n).map(|p| p != rank).collect(),
                    shut: vec![false; n],
                };
                let engine = Engine::new(core, driver, cfg.spin)?;
                let wire = Running::start(engine, format!("tutti-mem-{rank}"))?;
                Ok(MemTransport { wire })
            })
            .collect()
    }
}

impl Wired for MemTransport {
    type Driver = MemDriver;
    const NAME: &'static str = "mem";

    fn engine(&self) -> &Engine<MemDriver> {
        self.wire.engine()
    }

    fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }
}
