//! The connection core: everything one rank knows about its connections except how bytes move.
//!
//! A sans-IO state machine in the manner of quinn-proto. It owns, per peer, the frames waiting to
//! be sent and the parser of the arriving byte stream (headers, payloads into posted receives or
//! the unexpected queue, control frames); it owns matching, poisoning, and the timing decisions
//! (keep-alives, the probe of a long wait, dead-peer detection). It never touches a socket or
//! reads the clock: every call that depends on time takes `now`. A driver (`tcp/driver.rs`,
//! `quic/driver.rs`) moves the bytes — it hands the core what arrived ([`Core::rx_bytes`]), writes
//! what [`Core::sendq`] holds and reports how far it got ([`Core::tx_done`]), and sleeps until
//! the earlier of its own timers and the core's. The generic engine (`engine.rs`) ties the two
//! together behind the [`Transport`](crate::transport::Transport) trait.
//!
//! ## The core's methods, by family
//!
//! | family | methods | who calls, when |
//! |---|---|---|
//! | life | `new`, `link_up`, `close_all`, `fail`, `peer_closing`, `link_failed` | the driver as links come up, close or break; the engine on a local abort or a clean shutdown |
//! | operations | `post_send`, `post_recv`, `take_finished`, `cancel`, `probe`, `unpark` | the engine for the transport's callers (post, then wait on the op) |
//! | transmit | `sendq`, `wants_tx`, `tx_done`, `tx_finished`, `send_raw` | the driver: write what `sendq` holds, report how far with `tx_done` |
//! | receive | `wants_rx`, `rx_parked`, `rx_idle`, `heard`, `rx_direct`, `rx_direct_done`, `rx_bytes` | the driver: offer arrived bytes (`rx_bytes`, or straight into a posted buffer with `rx_direct`) |
//! | time | `poll_wait`, `poll_timeout`, `handle_timeout` | the engine: each pass of a wait asks `poll_wait` what to do next; it sleeps until the earlier of `poll_timeout` and the driver's timer, then `handle_timeout` (keep-alives, probes, dead peers) |
//! | events | `take_down`, `take_fresh_poison` | the engine after each pass: links the core gave up on (the driver closes them), and a fresh poisoning whose abort frames must go out |
//! | getters | `rank`, `world`, `poisoned`, `ops_ended`, `is_up`, `lost_peers`, `peer_closed`, `unexpected_held` | anyone holding the lock |
//!
//! The order of one engine pass: post (operations) → the driver's flush and reads (transmit,
//! receive) → `poll_wait` (time) → `take_down` / `take_fresh_poison` (events) → sleep until the
//! next deadline or input.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::transport::matcher::{self, Landing, Matching, Ops, PeerQueues, RawBuf, RecvPost};
use crate::transport::queue::{self, RxDest, RxFrame, SendItem};
use crate::transport::OpId;
use crate::wire::{FrameKind, Header, MsgDesc, HEADER_LEN};

/// Longest abort reason accepted from a peer.
pub(crate) const MAX_ABORT_REASON: u64 = 4096;

/// Tunables of the core.
#[derive(Debug, Clone)]
pub(crate) struct CoreConfig {
    /// Most bytes of unexpected messages (arrived before their receive) held at once.
    pub(crate) unexpected_limit: u64,
    /// A message without its receive that is longer than this is parked: its header is read,
    /// its payload stays in the driver's lower layer (TCP: the kernel, which flow-controls the
    /// sender) until the receive is posted. `u64::MAX`: never park.
    pub(crate) park_above: u64,
    /// Flow control: most payload bytes one peer may have waiting here before their receives
    /// are posted. A message that arrives with no receive and no room left is parked — the
    /// driver stops reading that peer, so the sender waits in the lower layer's flow control
    /// (TCP's window, QUIC's stream credit) until the receive is posted.
    pub(crate) window: u64,
    /// A wait this long asks the peer whether it is in the same collective.
    pub(crate) probe_after: Duration,
    /// A peer silent this long while a wait needs it is dead.
    pub(crate) dead_after: Duration,
    /// Send a keep-alive on a link idle this long; `None`: the driver's protocol keeps the
    /// link alive itself (QUIC).
    pub(crate) keepalive: Option<Duration>,
    /// Links start pending and are connected on first use: the first send to or receive from
    /// a pending peer asks the driver to connect it ([`Core::take_dial`]), and its frames wait
    /// in the link's queue until [`Core::link_up`].
    pub(crate) lazy: bool,
}

impl CoreConfig {
    /// The settings a driver's core takes from the link settings: the driver says which
    /// messages it parks (`park_above`) and whether the core sends keep-alives (`keepalive`:
    /// `false` when the driver's protocol keeps the link alive itself). Keep-alives go at the
    /// link settings' interval or a quarter of the dead-peer limit, whichever is shorter.
    pub(crate) fn from_link(
        cfg: &crate::transport::LinkConfig,
        park_above: u64,
        keepalive: bool,
    ) -> CoreConfig {
        CoreConfig {
            unexpected_limit: cfg.unexpected_limit,
            window: cfg.window,
            park_above,
            probe_after: cfg.probe_after,
            dead_after: cfg.dead_after,
            // At most a quarter of the dead-peer limit: a peer that only receives from us is
            // heard from through its keep-alives alone, and one that came a little late
            // (its driver's wake-up) must not make a live peer look dead.
            keepalive: keepalive.then_some(cfg.keepalive_interval.min(cfg.dead_after / 4)),
            lazy: false,
        }
    }
}

/// Why a link failed, as the driver or the core saw it.
#[derive(Debug)]
pub(crate) enum LinkFail {
    /// The peer closed the connection (end of stream).
    Closed,
    /// The connection failed (reset, unreachable, a stream error).
    Lost(String),
    /// The peer broke the protocol.
    Protocol(String),
    /// Nothing arrived from the peer for too long.
    Silent(String),
    /// The peer aborted with this reason.
    Aborted(String),
}

/// One peer's connection, as the core sees it.
struct Link {
    /// Frames waiting for the driver (the first one possibly partly handed over).
    sendq: VecDeque<SendItem>,
    hdr: [u8; HEADER_LEN],
    hdr_have: usize,
    /// The frame being received.
    cur: Option<RxFrame>,
    /// Receives posted for this peer that wait for data (queued or being filled).
    want: usize,
    /// The driver has a working connection and no failure was seen.
    up: bool,
    /// Not connected yet, connected on first use (a lazy core): operations queue here and
    /// ask the driver to connect; no dead-peer rule applies until the link is up.
    pending: bool,
    /// The driver was asked to connect this pending link.
    dialing: bool,
    /// The peer said it is shutting down cleanly (a close frame arrived).
    peer_closed: bool,
    /// Our own close frame is queued (it is the last frame we send).
    close_sent: bool,
    /// The peer is gone: it closed, its connection broke, or it fell silent (not: it told us
    /// it aborted, which a live peer does).
    gone: bool,
    /// When bytes last arrived from the peer (data, control, or the driver's own traffic).
    last_rx: Instant,
    /// Anything at all arrived from the peer on this link. Until then the peer's side may not
    /// be serving it yet: the dead-peer rule does not apply to it yet.
    heard_from: bool,
    /// When the driver last handed bytes of ours to its wire.
    last_tx: Instant,
    /// When the current run of waits on this peer began: waits that follow each other within
    /// [`WAIT_RUN_GAP`] count the peer's silence from the first one's start, not each from its
    /// own (a peer that lets each wait end just short of the limit is still named).
    waits_since: Instant,
    /// When a wait on this peer last looked ([`Core::poll_wait`]).
    waited_at: Option<Instant>,
    /// Messages longer than this that arrive before their receive are parked
    /// ([`CoreConfig::park_above`], unless [`Core::set_park_above`] changed it for this link:
    /// a driver that carries links of two kinds).
    park_above: u64,
}

// SAFETY: the raw pointers inside (`Payload::Borrowed`, `RxDest::Posted`) are only dereferenced
// under the engine lock while their operations are posted; posters guarantee validity until then.
unsafe impl Send for Link {}

impl Link {
    fn new(now: Instant) -> Link {
        Link {
            sendq: VecDeque::new(),
            hdr: [0; HEADER_LEN],
            hdr_have: 0,
            cur: None,
            want: 0,
            up: false,
            pending: false,
            dialing: false,
            peer_closed: false,
            close_sent: false,
            gone: false,
            last_rx: now,
            last_tx: now,
            heard_from: false,
            waits_since: now,
            waited_at: None,
            park_above: u64::MAX,
        }
    }

    fn parked(&self) -> bool {
        matches!(self.cur, Some(RxFrame { dest: RxDest::Parked(_), .. }))
    }
}

/// One blocked call's view of an operation: when it began to wait and what it already did.
#[derive(Debug)]
pub(crate) struct Waiter {
    pub(crate) op: OpId,
    pub(crate) start: Instant,
    pub(crate) deadline: Instant,
    probed: bool,
}

impl Waiter {
    pub(crate) fn new(op: OpId, start: Instant, deadline: Instant) -> Waiter {
        Waiter { op, start, deadline, probed: false }
    }
}

/// What a wait should do next.
#[derive(Debug)]
pub(crate) enum Step {
    /// The operation finished (or failed, or its deadline passed).
    Done(Result<usize>),
    /// The core changed state (a frame to send, a parked frame to read): drive again now.
    Again,
    /// Nothing to do before this instant unless the driver sees input.
    Sleep(Instant),
}

/// The connection core of one rank: every peer's link, the operation table and the matching.
pub(crate) struct Core {
    rank: usize,
    links: Vec<Link>,
    queues: Vec<PeerQueues>,
    ops: Ops,
    poisoned: Option<Error>,
    /// Set once `poisoned` is: read without the engine's lock on every call's check.
    poison_flag: Arc<AtomicBool>,
    unexpected_bytes: u64,
    cfg: CoreConfig,
    /// Links that failed since the driver last asked: it closes their connections.
    down: Vec<usize>,
    /// Poisoned since the driver last asked: it writes the abort frames out.
    fresh_poison: bool,
    /// Pending links to connect, for the driver ([`Core::take_dial`]).
    dial: Vec<usize>,
    /// A clean shutdown began: a link that comes up now gets its close frame at once.
    closing: bool,
    /// What the abort frames say, once poisoned (the original culprit's words).
    abort_reason: Option<String>,
}

impl Core {
    /// A core for `rank` of `world`; no link is up until the driver says so.
    pub(crate) fn new(rank: usize, world: usize, cfg: CoreConfig, now: Instant) -> Core {
        let lazy = cfg.lazy;
        Core {
            rank,
            links: (0..world)
                .map(|p| Link {
                    pending: lazy && p != rank,
                    park_above: cfg.park_above,
                    ..Link::new(now)
                })
                .collect(),
            queues: (0..world).map(|_| PeerQueues::default()).collect(),
            ops: Ops::default(),
            poisoned: None,
            poison_flag: Arc::default(),
            unexpected_bytes: 0,
            cfg,
            down: Vec::new(),
            fresh_poison: false,
            dial: Vec::new(),
            closing: false,
            abort_reason: None,
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.links.len()
    }

    pub(crate) fn poisoned(&self) -> Option<&Error> {
        self.poisoned.as_ref()
    }

    /// A flag set when this core is poisoned, for a look without the lock around the core
    /// ([`Core::poisoned`] then says why).
    pub(crate) fn poison_flag(&self) -> Arc<AtomicBool> {
        self.poison_flag.clone()
    }

    /// What this rank's abort frames tell its peers, once it is poisoned.
    pub(crate) fn abort_reason(&self) -> Option<&str> {
        self.abort_reason.as_deref()
    }

    /// How many operations have ended (done or failed) so far.
    pub(crate) fn ops_ended(&self) -> u64 {
        self.ops.ended()
    }

    /// The driver connected `peer`: its link carries frames from now on (those queued while
    /// it was pending first). A link that comes up after a failure carries the abort frame;
    /// one that comes up during a clean shutdown, the close frame.
    pub(crate) fn link_up(&mut self, peer: usize, now: Instant) {
        let rank = self.rank;
        let Some(l) = self.links.get_mut(peer).filter(|_| peer != rank) else { return };
        l.up = true;
        l.pending = false;
        l.dialing = false;
        l.last_rx = now;
        l.last_tx = now;
        if let Some(reason) = &self.abort_reason {
            // `poison` left the abort frame on a link pending then; a link that had nothing
            // queued gets its own, with the same words.
            if l.sendq.is_empty() {
                queue::abort_queue(&mut l.sendq, rank, reason.as_bytes());
            }
        }
        if self.closing {
            self.queue_close(peer);
        }
    }

    /// Park messages from `peer` longer than `bytes` that arrive before their receive, in place
    /// of [`CoreConfig::park_above`]: for a driver whose links are of two kinds (a QUIC job's
    /// links to the ranks of its own host go through TCP's driver, which parks above its eager
    /// limit; its QUIC links buffer any size, quinn's stream credit holding the sender).
    pub(crate) fn set_park_above(&mut self, peer: usize, bytes: u64) {
        if let Some(l) = self.links.get_mut(peer) {
            l.park_above = bytes;
        }
    }

    /// Whether `peer`'s link is up (not failed, not finished).
    pub(crate) fn is_up(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.up)
    }

    /// Whether `peer`'s link is still to be connected (a lazy core's, before first use or
    /// while the driver connects it).
    pub(crate) fn is_pending(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.pending)
    }

    /// Ask the driver to connect `peer`'s link now if it is pending and not asked for yet.
    pub(crate) fn want_link(&mut self, peer: usize) {
        if let Some(l) = self.links.get_mut(peer).filter(|l| l.pending && !l.dialing) {
            l.dialing = true;
            self.dial.push(peer);
        }
    }

    /// A pending link the driver should start connecting (asked for since the last call).
    pub(crate) fn take_dial(&mut self) -> Option<usize> {
        self.dial.pop()
    }

    /// Whether a message with `tag` from `peer` has arrived (whole, or its header) and waits
    /// for a receive.
    pub(crate) fn probe(&self, peer: usize, tag: crate::wire::Tag) -> bool {
        if self.queues.get(peer).is_some_and(|q| q.has_unexpected(tag)) {
            return true;
        }
        match self.links.get(peer).and_then(|l| l.cur.as_ref()).map(|f| &f.dest) {
            Some(RxDest::Parked(d)) | Some(RxDest::Unexpected { desc: d, .. }) => d.tag == tag,
            _ => false,
        }
    }

    /// The peers that are gone (closed, broken or silent), for the survivors' agreement; a
    /// peer counts as silent here when nothing, not even a keep-alive, came from it for
    /// `dead_after`, whether or not an operation waits on it.
    pub(crate) fn lost_peers(&self, now: Instant) -> Vec<usize> {
        // A link still up that has carried nothing for the dead-peer limit: after our own
        // failure the live peers have closed theirs (answering our abort), so what stays up
        // and silent is a peer we cannot reach.
        let silent = |l: &Link| {
            self.cfg.keepalive.is_some()
                && l.up
                && l.heard_from
                && now.saturating_duration_since(l.last_rx) >= self.cfg.dead_after
        };
        (0..self.links.len())
            .filter(|p| *p != self.rank && (self.links[*p].gone || silent(&self.links[*p])))
            .collect()
    }

    /// Whether `peer` said it is leaving cleanly (its close frame arrived).
    pub(crate) fn peer_closed(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.peer_closed)
    }

    /// A link that failed since the last call; its driver connection should be closed.
    pub(crate) fn take_down(&mut self) -> Option<usize> {
        self.down.pop()
    }

    /// Whether the core was poisoned since the last call: abort frames wait on every link.
    pub(crate) fn take_fresh_poison(&mut self) -> bool {
        std::mem::take(&mut self.fresh_poison)
    }

    // ---- posting -------------------------------------------------------------------------

    /// Post a send; the frame waits in `peer`'s queue for the driver (a send to self completes
    /// at once).
    ///
    /// # Safety
    /// As `Transport::post_send`: `data..data+len` stays readable until the operation finished
    /// or was cancelled.
    pub(crate) unsafe fn post_send(
        &mut self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
        now: Instant,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world(), peer, "send")?;
        let id = matcher::register(&self.poisoned, &mut self.ops, peer, desc, len, now)?;
        if peer == self.rank {
            // SAFETY: the caller guarantees the range is readable (the copy ends before return).
            unsafe { self.matching(peer).send_to_self(id, desc, data, len) };
            return Ok(id);
        }
        let l = &mut self.links[peer];
        if !l.pending && (!l.up || l.peer_closed) {
            self.ops.forget(id);
            return Err(matcher::closed_peer(self.rank, peer, &desc, len));
        }
        let hdr = Header::data(desc, self.rank, len).encode();
        l.sendq.push_back(SendItem::data(id, hdr, data, len));
        self.want_link(peer);
        Ok(id)
    }

    /// Post a receive. Returns its id and whether a parked frame was attached to it (the driver
    /// then reads the payload in).
    ///
    /// # Safety
    /// As `Transport::post_recv`: `buf..buf+cap` stays writable and untouched by the caller
    /// until the operation finished or was cancelled.
    pub(crate) unsafe fn post_recv(
        &mut self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
        now: Instant,
    ) -> Result<(OpId, bool)> {
        matcher::check_peer(self.rank, self.world(), peer, "recv")?;
        let id = matcher::register(&self.poisoned, &mut self.ops, peer, desc, cap, now)?;
        let post = RecvPost { id, desc, buf: RawBuf(buf), cap };
        if !self.matching(peer).post_recv(post) || peer == self.rank {
            return Ok((id, false));
        }
        let l = &mut self.links[peer];
        if l.pending {
            l.want += 1;
            self.want_link(peer);
            return Ok((id, false));
        }
        if !l.up || l.peer_closed {
            self.queues[peer].remove(id);
            self.ops.forget(id);
            return Err(matcher::closed_peer(self.rank, peer, &desc, cap));
        }
        l.want += 1;
        Ok((id, self.attach_parked(peer)))
    }

    /// `Some(result)` when `op` finished (it is then forgotten).
    pub(crate) fn take_finished(&mut self, op: OpId) -> Option<Result<usize>> {
        self.ops.take_finished(op)
    }

    /// Withdraw `op`: when this returns no buffer of it is referenced any more.
    pub(crate) fn cancel(&mut self, op: OpId) {
        for peer in 0..self.queues.len() {
            if self.queues[peer].remove(op) {
                let l = &mut self.links[peer];
                l.want = l.want.saturating_sub(1);
            }
        }
        for l in self.links.iter_mut() {
            queue::forget(&mut l.cur, &mut l.sendq, op);
        }
        self.ops.forget(op);
    }

    /// A failure found above the transport, or a local abort (`cause`, told to the peers as
    /// `reason`): fail everything and send an abort frame on every link. Returns whether it was
    /// the first failure (an earlier one stays the cause).
    pub(crate) fn fail(&mut self, cause: Error, reason: &str) -> bool {
        let first = self.poisoned.is_none();
        self.poison(cause, Some(reason));
        first
    }

    // ---- the send side -------------------------------------------------------------------

    /// Frames waiting to be written to `peer` (the first one possibly partly written: its
    /// `off` says how far).
    pub(crate) fn sendq(&self, peer: usize) -> &VecDeque<SendItem> {
        &self.links[peer].sendq
    }

    /// Whether `peer` has frames to write (on a link that is connected).
    pub(crate) fn wants_tx(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| !l.pending && !l.sendq.is_empty())
    }

    /// The driver handed `n` more bytes of `peer`'s queue to its wire: completes the sends
    /// whose last byte went.
    pub(crate) fn tx_done(&mut self, peer: usize, mut n: usize, now: Instant) {
        let l = &mut self.links[peer];
        if n > 0 {
            l.last_tx = now;
        }
        while n > 0 {
            let Some(s) = l.sendq.front_mut() else { break };
            let take = n.min(s.total() - s.off);
            s.off += take;
            n -= take;
            if s.off == s.total() {
                if let Some(id) = s.id {
                    self.ops.complete(id, s.len);
                }
                l.sendq.pop_front();
            }
        }
    }

    /// Our close frame is queued and everything before it was written: the driver may end its
    /// side of the stream.
    pub(crate) fn tx_finished(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.close_sent && l.sendq.is_empty())
    }

    /// Clean shutdown: queue a close frame on every link that is up (and on each that comes
    /// up from now on).
    pub(crate) fn close_all(&mut self) {
        self.closing = true;
        for peer in 0..self.links.len() {
            self.queue_close(peer);
        }
    }

    fn queue_close(&mut self, peer: usize) {
        let rank = self.rank;
        let l = &mut self.links[peer];
        if l.up && !l.close_sent {
            l.close_sent = true;
            let hdr = Header::control(FrameKind::Close, rank, 0).encode();
            l.sendq.push_back(SendItem::control(hdr, Vec::new()));
        }
    }

    /// Payload bytes of messages waiting for their receives, from every peer.
    pub(crate) fn unexpected_held(&self) -> u64 {
        self.queues.iter().map(PeerQueues::buffered).sum()
    }

    /// Queue a frame of exactly these header bytes and payload, as a misbehaving but
    /// authenticated peer would send it: the tests of the receiving side's protocol checks.
    #[cfg(test)]
    pub(crate) fn send_raw(&mut self, peer: usize, hdr: [u8; HEADER_LEN], payload: Vec<u8>) {
        self.links[peer].sendq.push_back(SendItem::control(hdr, payload));
        self.want_link(peer);
    }

    // ---- the receive side ----------------------------------------------------------------

    /// Whether `peer`'s link needs reading: a receive waits for it or a frame is half read.
    pub(crate) fn wants_rx(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.up && (l.want > 0 || l.cur.is_some()))
    }

    /// Whether the frame being received from `peer` is parked (the driver must not read).
    pub(crate) fn rx_parked(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(Link::parked)
    }

    /// Whether `peer`'s stream is between frames (no header or payload half read).
    pub(crate) fn rx_idle(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(|l| l.cur.is_none() && l.hdr_have == 0)
    }

    /// The driver heard from `peer` (any traffic of its protocol): the peer is alive.
    pub(crate) fn heard(&mut self, peer: usize, now: Instant) {
        if let Some(l) = self.links.get_mut(peer) {
            l.last_rx = l.last_rx.max(now);
            l.heard_from = true;
        }
    }

    /// Where the current frame's payload may be read directly: the rest of a posted receive's
    /// buffer, when at least `min` bytes of it are still to come. Valid until the next call
    /// into the core; report what was read with [`Core::rx_direct_done`].
    pub(crate) fn rx_direct(&mut self, peer: usize, min: usize) -> Option<(*mut u8, usize)> {
        self.release_failed_receive(peer);
        match &self.links[peer].cur {
            Some(RxFrame { dest: RxDest::Posted { buf, .. }, len, done }) if len - done >= min => {
                // SAFETY: `done < len <= cap` of the posted buffer (checked at header time).
                Some((unsafe { buf.0.add(*done) }, len - done))
            }
            _ => None,
        }
    }

    /// `n` bytes were read directly into the place [`Core::rx_direct`] gave.
    pub(crate) fn rx_direct_done(&mut self, peer: usize, n: usize, now: Instant) {
        let l = &mut self.links[peer];
        l.last_rx = now;
        l.heard_from = true;
        let Some(f) = l.cur.as_mut() else { return };
        f.done += n;
        if f.done == f.len {
            if let Some(f) = l.cur.take() {
                if let Err(fail) = self.finish(peer, f) {
                    self.link_failed(peer, fail);
                }
            }
        }
    }

    /// Bytes of `peer`'s stream arrived. Returns how many the core took: all of them, except
    /// when a frame is (or becomes) parked, where the driver keeps the rest and offers it again
    /// once [`Core::rx_parked`] is false. A protocol violation fails the link (and poisons).
    pub(crate) fn rx_bytes(&mut self, peer: usize, mut data: &[u8], now: Instant) -> usize {
        let total = data.len();
        if total > 0 {
            self.links[peer].last_rx = now;
            self.links[peer].heard_from = true;
        }
        while !data.is_empty() {
            if !self.links[peer].up {
                return total;
            }
            self.release_failed_receive(peer);
            let l = &mut self.links[peer];
            if let Some(f) = l.cur.as_mut() {
                if matches!(f.dest, RxDest::Parked(_)) {
                    return total - data.len();
                }
                let n = data.len().min(f.len - f.done);
                match &mut f.dest {
                    RxDest::Posted { buf, .. } => {
                        // SAFETY: the receive is still posted (`release_failed_receive` just
                        // turned a failed or cancelled one into a discard, under the engine lock
                        // that `cancel` and every failure take) with `cap >= len` (checked at
                        // header time), and `done + n <= len`.
                        unsafe {
                            std::ptr::copy_nonoverlapping(data.as_ptr(), buf.0.add(f.done), n)
                        };
                    }
                    RxDest::Unexpected { data: v, .. } | RxDest::Abort(v) => {
                        v.extend_from_slice(&data[..n])
                    }
                    RxDest::Discard | RxDest::Parked(_) => {}
                }
                f.done += n;
                data = &data[n..];
                if f.done == f.len {
                    if let Some(f) = l.cur.take() {
                        if let Err(fail) = self.finish(peer, f) {
                            self.link_failed(peer, fail);
                            return total;
                        }
                    }
                }
                continue;
            }
            let n = data.len().min(HEADER_LEN - l.hdr_have);
            l.hdr[l.hdr_have..l.hdr_have + n].copy_from_slice(&data[..n]);
            l.hdr_have += n;
            data = &data[n..];
            if l.hdr_have < HEADER_LEN {
                break;
            }
            l.hdr_have = 0;
            let started = match Header::decode(&l.hdr) {
                Ok(hdr) => self.start_frame(peer, hdr),
                Err(e) => Err(LinkFail::Protocol(format!("undecodable frame header: {e}"))),
            };
            if let Err(fail) = started {
                self.link_failed(peer, fail);
                return total;
            }
        }
        total
    }

    /// The frame being received belongs to a receive that failed or was cancelled: its caller
    /// may already have freed the buffer, so the rest of the payload is read and dropped.
    fn release_failed_receive(&mut self, peer: usize) {
        let Some(f) = self.links[peer].cur.as_mut() else { return };
        if let RxDest::Posted { id, .. } = f.dest {
            if self.ops.pending(id).is_none() {
                f.dest = RxDest::Discard;
            }
        }
    }

    fn start_frame(&mut self, peer: usize, hdr: Header) -> Result<(), LinkFail> {
        if self.links[peer].peer_closed {
            return Err(LinkFail::Protocol(format!(
                "a {:?} frame after the peer's close frame",
                hdr.kind
            )));
        }
        if hdr.src as usize != peer {
            return Err(LinkFail::Protocol(format!(
                "frame claims source rank {} on the connection of rank {peer}",
                hdr.src
            )));
        }
        let len = hdr.len;
        let empty = |what: &str| {
            if len != 0 {
                Err(LinkFail::Protocol(format!("{what} frame with a payload")))
            } else {
                Ok(RxDest::Discard)
            }
        };
        let dest = match hdr.kind {
            FrameKind::KeepAlive => empty("keep-alive")?,
            FrameKind::Probe => {
                let d = empty("probe")?;
                if let Some(err) = matcher::probe_mismatch(self.rank, peer, &self.ops, &hdr.desc) {
                    let reason = err.to_string();
                    self.poison(err, Some(&reason));
                }
                d
            }
            FrameKind::Close => {
                let d = empty("close")?;
                self.peer_closing(peer);
                d
            }
            FrameKind::Abort => {
                if len > MAX_ABORT_REASON {
                    return Err(LinkFail::Protocol(format!("abort reason of {len} bytes")));
                }
                RxDest::Abort(Vec::with_capacity(len as usize))
            }
            FrameKind::Data => {
                // Park what the driver would not buffer, and what exceeds the peer's window.
                let room = self.cfg.window.saturating_sub(self.queues[peer].buffered());
                let park = self.links[peer].park_above.min(room);
                let limit = self.cfg.unexpected_limit;
                let (landing, used) =
                    self.matching(peer).arrive_header(&hdr.desc, len, park, limit);
                self.used(peer, used);
                match landing {
                    Ok(Landing::Posted { id, buf }) => RxDest::Posted { id, buf },
                    Ok(Landing::Park) => RxDest::Parked(hdr.desc),
                    // Bounded by the budget `arrive_header` checked.
                    Ok(Landing::Buffer) => RxDest::Unexpected {
                        desc: hdr.desc,
                        data: Vec::with_capacity(len as usize),
                    },
                    Ok(Landing::Discard) => RxDest::Discard,
                    Err(err) => {
                        // Over the budget: poisoned; the payload is read and dropped.
                        self.poison(err, None);
                        RxDest::Discard
                    }
                }
            }
        };
        let Ok(len) = usize::try_from(len) else {
            return Err(LinkFail::Protocol(format!("frame length {len} does not fit in memory")));
        };
        let f = RxFrame { dest, len, done: 0 };
        if len == 0 {
            return self.finish(peer, f);
        }
        self.links[peer].cur = Some(f);
        Ok(())
    }

    fn finish(&mut self, peer: usize, f: RxFrame) -> Result<(), LinkFail> {
        match f.dest {
            RxDest::Posted { id, .. } => self.ops.complete(id, f.len),
            RxDest::Unexpected { desc, data } => {
                // A receive may have been posted while the message was arriving.
                let used =
                    self.matching(peer).arrive_whole(&desc, std::borrow::Cow::Owned(data), true);
                self.used(peer, used);
            }
            RxDest::Abort(reason) => {
                return Err(LinkFail::Aborted(String::from_utf8_lossy(&reason).into_owned()));
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

    /// `used` posted receives of `peer` were matched or failed: they no longer wait for data.
    fn used(&mut self, peer: usize, used: usize) {
        let l = &mut self.links[peer];
        l.want = l.want.saturating_sub(used);
    }

    /// A receive was posted: if the frame parked on `peer`'s link is its message, attach it
    /// (the payload then goes straight into the receive buffer). True when attached.
    fn attach_parked(&mut self, peer: usize) -> bool {
        let (desc, len) = match &self.links[peer].cur {
            Some(RxFrame { dest: RxDest::Parked(d), len, .. }) => (*d, *len),
            _ => return false,
        };
        // `park_above` 0: if the new receive is not this message's, the frame stays parked.
        let (landing, used) = self.matching(peer).arrive_header(&desc, len as u64, 0, 0);
        self.used(peer, used);
        let new = match landing {
            Ok(Landing::Posted { id, buf }) => RxDest::Posted { id, buf },
            Ok(Landing::Discard) => RxDest::Discard,
            _ => return false,
        };
        if let Some(f) = self.links[peer].cur.as_mut() {
            f.dest = new;
        }
        true
    }

    /// Someone needs a later message from `peer`, or the peer is going away: move the parked
    /// frame to the unexpected queue (bounded by the budget) so the stream can advance.
    pub(crate) fn unpark(&mut self, peer: usize) {
        let (desc, len) = match &self.links[peer].cur {
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
        if let Some(f) = self.links[peer].cur.as_mut() {
            f.dest = RxDest::Unexpected { desc, data: Vec::with_capacity(len) };
        }
    }

    // ---- time ----------------------------------------------------------------------------

    /// The dead-peer limit (`LinkConfig::dead_after`).
    pub(crate) fn dead_after(&self) -> Duration {
        self.cfg.dead_after
    }

    /// The dead-peer rule for a wait that needs `peer` but has no operation posted to it
    /// (direct reads wait on the peer's memory, not its messages): fail the link when nothing,
    /// not even a keep-alive, came from it for `dead_after` since the later of its last
    /// traffic and `since` — the rule [`Core::poll_wait`] applies to a single wait (no run of
    /// waits here: `since` is this wait's start), only once anything at all came from it, and
    /// not while the link is parked. Returns whether the link failed now.
    pub(crate) fn check_silent(&mut self, peer: usize, since: Instant, now: Instant) -> bool {
        // A parked link holds a message nobody asked for yet in front of whatever came after
        // it (keep-alives included): its silence says nothing.
        let Some(l) = self.links.get(peer).filter(|l| l.up && peer != self.rank && !l.parked())
        else {
            return false;
        };
        let quiet = now.saturating_duration_since(l.last_rx.max(since));
        if !l.heard_from || quiet < self.cfg.dead_after {
            return false;
        }
        self.link_failed(peer, LinkFail::Silent(silent_detail(peer, quiet)));
        true
    }

    /// One step of a wait for `w.op`: its result, or what to do before looking again. Decides
    /// the deadline, the dead-peer rule (the peer silent for `dead_after` since the later of
    /// its last traffic and the start of this run of waits on it — waits less than
    /// [`WAIT_RUN_GAP`] apart, or this wait alone while its link is parked; only once anything
    /// at all came from it, so a peer still connecting the rest of its world is waited for
    /// until the deadline), unparking, and the probe.
    pub(crate) fn poll_wait(&mut self, w: &mut Waiter, now: Instant) -> Step {
        if let Some(r) = self.ops.take_finished(w.op) {
            return Step::Done(r);
        }
        let Some((peer, desc, bytes, posted)) = self.ops.pending(w.op) else {
            return Step::Done(Err(matcher::not_posted(self.rank, w.op)));
        };
        if now >= w.deadline {
            let done = self.bytes_done(w.op);
            return Step::Done(Err(matcher::timed_out(
                self.rank, peer, &desc, done, bytes, posted, w.deadline,
            )));
        }
        let mut until = w.deadline;
        if let Some(l) = self.links.get_mut(peer).filter(|l| l.up) {
            // Waits on the peer that follow each other closely are one run: silence counts
            // from the run's first wait. (Each wait counting from its own start let a stopped
            // peer whose kernel still took our small messages, a little at a time, end every
            // wait before the limit: its survivors went on at a crawl, never naming it.)
            if l.waited_at.is_none_or(|t| now.saturating_duration_since(t) > WAIT_RUN_GAP) {
                l.waits_since = w.start;
            }
            l.waited_at = Some(now);
            // A parked link is not read (its keep-alives wait behind the parked frame): there
            // each wait counts from its own start, as a peer is not to blame for that.
            let from = if l.parked() { w.start } else { l.waits_since.min(w.start) };
            let since = l.last_rx.max(from);
            let quiet = now.saturating_duration_since(since);
            if l.heard_from && quiet >= self.cfg.dead_after {
                self.link_failed(peer, LinkFail::Silent(silent_detail(peer, quiet)));
                return Step::Again;
            }
            if l.heard_from {
                until = until.min(since + self.cfg.dead_after);
            }
            if l.parked() && self.queues[peer].is_posted(w.op) {
                self.unpark(peer);
                return Step::Again;
            }
        }
        // A link still connecting carries no probe yet: it is sent once the link is up.
        if !w.probed && !self.links[peer].pending {
            if now.saturating_duration_since(w.start) >= self.cfg.probe_after {
                w.probed = true;
                self.send_probe(peer, desc);
                return Step::Again;
            }
            until = until.min(w.start + self.cfg.probe_after);
        }
        if let Some(t) = self.poll_timeout() {
            until = until.min(t);
        }
        Step::Sleep(until)
    }

    /// The next instant [`Core::handle_timeout`] has work (a keep-alive due).
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let every = self.cfg.keepalive?;
        if self.poisoned.is_some() {
            return None;
        }
        self.links.iter().filter(|l| l.up && l.sendq.is_empty()).map(|l| l.last_tx + every).min()
    }

    /// Queue a keep-alive on every link idle for the keep-alive interval.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        let Some(every) = self.cfg.keepalive else { return };
        if self.poisoned.is_some() {
            return;
        }
        let rank = self.rank;
        for l in self.links.iter_mut().filter(|l| l.up && !l.close_sent) {
            if l.sendq.is_empty() && now.saturating_duration_since(l.last_tx) >= every {
                let hdr = Header::control(FrameKind::KeepAlive, rank, 0).encode();
                l.sendq.push_back(SendItem::control(hdr, Vec::new()));
            }
        }
    }

    /// Ask `peer` whether it is in the same collective as `desc` (see `FrameKind::Probe`).
    fn send_probe(&mut self, peer: usize, desc: MsgDesc) {
        if peer == self.rank || desc.tag.group & matcher::P2P_GROUP_BIT != 0 {
            return;
        }
        let rank = self.rank;
        let l = &mut self.links[peer];
        if !l.up || l.close_sent {
            return;
        }
        let mut h = Header::data(desc, rank, 0);
        h.kind = FrameKind::Probe;
        l.sendq.push_back(SendItem::control(h.encode(), Vec::new()));
    }

    fn bytes_done(&self, op: OpId) -> u64 {
        self.links.iter().find_map(|l| queue::progress(&l.cur, &l.sendq, op)).unwrap_or(0)
    }

    // ---- failure -------------------------------------------------------------------------

    /// Fail everything, tell every live peer why (abort frame), stop taking work.
    fn poison(&mut self, err: Error, abort_reason: Option<&str>) {
        if self.poisoned.is_some() {
            return;
        }
        warn!(rank = self.rank, "transport poisoned: {err}");
        let e2 = err.clone();
        self.ops.fail_all(|_, _| e2.clone());
        self.poisoned = Some(err.clone());
        self.poison_flag.store(true, Ordering::Release);
        self.fresh_poison = true;
        for q in self.queues.iter_mut() {
            q.clear_posted();
        }
        let mut reason = abort_reason.map_or_else(|| err.to_string(), str::to_string);
        // At most the longest reason a peer takes, cut on a character boundary.
        let mut cut = reason.len().min(MAX_ABORT_REASON as usize);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        let reason = self.abort_reason.insert(reason).as_bytes();
        let rank = self.rank;
        for l in self.links.iter_mut() {
            l.want = 0;
            // A pending link with frames queued: the failed operations' frames go, and the
            // abort waits for the link (a peer that dials us learns why at once).
            if (l.up && !l.peer_closed) || (l.pending && !l.sendq.is_empty()) {
                queue::abort_queue(&mut l.sendq, rank, reason);
            }
        }
    }

    /// A close frame arrived (or the driver saw the peer leave cleanly): the peer finished.
    /// Operations still waiting on it fail (naming it) but the transport is not poisoned; our
    /// own close answers it, so a peer waiting in its shutdown need not wait for our exit.
    pub(crate) fn peer_closing(&mut self, peer: usize) {
        let l = &mut self.links[peer];
        if l.peer_closed || !l.up {
            return;
        }
        l.peer_closed = true;
        // A close frame says the peer is leaving the job, whatever happened before (a peer
        // answering our abort drops the connection without one).
        l.gone = true;
        l.want = 0;
        self.queue_close(peer);
        matcher::fail_closed_peer(self.rank, peer, &mut self.ops, &mut self.queues[peer]);
    }

    /// `peer`'s link failed. After the peer's close frame an end of stream is the normal end;
    /// otherwise every operation with the peer fails naming it and the transport is poisoned.
    pub(crate) fn link_failed(&mut self, peer: usize, f: LinkFail) {
        let l = &mut self.links[peer];
        if !l.up && !l.pending {
            return;
        }
        // A pending link fails when connecting it failed, or when its peer is known gone
        // (the launcher's notice) before the pair ever connected.
        l.pending = false;
        l.dialing = false;
        l.up = false;
        l.want = 0;
        l.cur = None;
        l.hdr_have = 0;
        l.sendq.clear();
        // A peer that told us it aborted is alive. After our own failure (whose abort frames
        // make live peers close their ends) a closed or reset link says nothing either; a
        // silent one still does.
        l.gone |= match &f {
            LinkFail::Aborted(_) => false,
            LinkFail::Silent(_) => true,
            _ => self.poisoned.is_none(),
        };
        self.down.push(peer);
        if l.peer_closed && matches!(f, LinkFail::Closed | LinkFail::Lost(_)) {
            // End of a clean shutdown.
            return;
        }
        let detail = match &f {
            LinkFail::Closed => "connection closed by peer".to_string(),
            LinkFail::Lost(d) => d.clone(),
            LinkFail::Protocol(p) => format!("protocol error: {p}"),
            LinkFail::Silent(d) => d.clone(),
            LinkFail::Aborted(r) => format!("peer aborted: {r}"),
        };
        debug!(rank = self.rank, peer, "{detail}");
        let rank = self.rank;
        self.queues[peer].clear_posted();
        if let LinkFail::Aborted(reason) = f {
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

/// Waits on one peer less than this apart are one run for the dead-peer rule
/// ([`Core::poll_wait`]): more than a wait's longest sleep between two looks (its poll slice),
/// far less than the limit.
const WAIT_RUN_GAP: Duration = Duration::from_millis(500);

/// Why a silent peer is declared dead.
fn silent_detail(peer: usize, quiet: Duration) -> String {
    format!(
        "nothing (not even a keep-alive) arrived from rank {peer} for {quiet:.1?}: the process \
         is stopped (SIGSTOP), hung in the kernel, or its host is unreachable"
    )
}

/// Feed arbitrary bytes to one connection core as peer 1's stream, cut into pieces whose sizes
/// the bytes choose, with receives posted, waits polled on a moving fake clock and a receive
/// cancelled midway. It must never panic, and never hold more unexpected bytes than its budget.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_stream(data: &[u8]) {
    use crate::wire::{DType, Fingerprint, OpKind, Tag};
    let Some((&mode, mut data)) = data.split_first() else { return };
    let t0 = Instant::now();
    let cfg = CoreConfig {
        unexpected_limit: 4096,
        park_above: 1024,
        window: 2048,
        probe_after: Duration::from_secs(1),
        dead_after: Duration::from_secs(5),
        keepalive: Some(Duration::from_secs(1)),
        lazy: false,
    };
    let mut c = Core::new(0, 3, cfg, t0);
    c.link_up(1, t0);
    c.link_up(2, t0);
    let desc = |seq: u64, count: u64| MsgDesc {
        tag: Tag { group: u32::from(mode & 1) << 31, seq, step: 0 },
        fp: Fingerprint {
            op: OpKind::Allreduce,
            dtype: DType::U8,
            redop: 1,
            root: u32::MAX,
            count,
            settings: 0,
        },
    };
    let mut bufs: Vec<Vec<u8>> = [0usize, 8, 2048].iter().map(|&n| vec![0u8; n]).collect();
    let mut ids = Vec::new();
    for (i, b) in bufs.iter_mut().enumerate() {
        let d = desc(i as u64, b.len() as u64);
        // SAFETY: the buffers live (unmoved on the heap) until the end of this function, after
        // the core is dropped.
        let posted = unsafe { c.post_recv(1, d, b.as_mut_ptr(), b.len(), Instant::now()) };
        if let Ok((id, _)) = posted {
            ids.push(id);
        }
    }
    let mut now = t0;
    let mut waiter = ids.first().map(|&id| Waiter::new(id, t0, t0 + Duration::from_secs(30)));
    let mut step = 0usize;
    while let Some((&cut, rest)) = data.split_first() {
        let n = (usize::from(cut) % 64 + 1).min(rest.len());
        let piece = &rest[..n];
        data = &rest[n..];
        let took = c.rx_bytes(1, piece, now);
        assert!(took <= piece.len());
        if took < piece.len() {
            assert!(c.rx_parked(1), "bytes refused without a parked frame");
        }
        assert!(c.unexpected_bytes <= c.cfg.unexpected_limit, "over the unexpected budget");
        step += 1;
        now += Duration::from_millis(u64::from(cut) * 10);
        if let Some(w) = waiter.as_mut() {
            if let Step::Done(_) = c.poll_wait(w, now) {
                waiter = None;
            }
        }
        c.handle_timeout(now);
        if step == 3 {
            if let Some(&id) = ids.get(2) {
                c.cancel(id);
            }
        }
        while c.take_down().is_some() {}
        let _ = c.take_fresh_poison();
        if c.wants_tx(1) {
            let n = c.sendq(1).iter().map(|s| s.total() - s.off).sum();
            c.tx_done(1, n, now);
        }
    }
    drop(c);
    drop(bufs);
}

#[cfg(test)]
mod tests;
