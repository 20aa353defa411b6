//! In-memory transport: the ranks of a job are threads of one process.
//!
//! Sends are eager: the payload is copied into the receiver's posted buffer, or into its
//! unexpected queue, when the send is posted, and the send completes at once. Matching, fingerprint
//! checks and error reporting are the same code the TCP transport uses, so an algorithm that passes
//! here fails the same way over the wire. An optional per-link delay hook delays deliveries, to
//! exercise orderings in tests.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transport::matcher::{self, Dest, Ops, PeerQueues, Posted, RawBuf, RecvPost};
use crate::transport::{OpId, Transport};
use crate::wire::MsgDesc;

/// A function giving the delay of a message from `src` to `dst` of `len` bytes.
pub type DelayFn = dyn Fn(usize, usize, usize) -> Duration + Send + Sync;

/// How long a wait lasts before the waiter checks its peer for a conflicting collective.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// Default budget for buffered unexpected messages per rank (1 GiB; tests move large buffers).
const UNEXPECTED_LIMIT: u64 = 1 << 30;

struct Delayed {
    ready: Instant,
    src: usize,
    desc: MsgDesc,
    data: Vec<u8>,
}

#[derive(Default)]
struct MailState {
    queues: Vec<PeerQueues>,
    ops: Ops,
    poisoned: Option<Error>,
    dead: Vec<Option<String>>,
    delayed: Vec<Delayed>,
    last_ready: Vec<Option<Instant>>,
    unexpected_bytes: u64,
}

struct Mailbox {
    state: Mutex<MailState>,
    cv: Condvar,
}

struct Fabric {
    boxes: Vec<Mailbox>,
    delay: Option<Arc<DelayFn>>,
}

/// One rank of an in-memory job. Build a whole job with [`MemTransport::world`].
pub struct MemTransport {
    rank: usize,
    fabric: Arc<Fabric>,
}

impl std::fmt::Debug for MemTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemTransport").field("rank", &self.rank).finish_non_exhaustive()
    }
}

impl MemTransport {
    /// Create the `n` ranks of one in-memory job; give each to its own thread.
    pub fn world(n: usize) -> Vec<MemTransport> {
        Self::build(n, None)
    }

    /// As [`world`](MemTransport::world), with every message from `src` to `dst` delivered after
    /// `delay(src, dst, len)`. Order per link is kept.
    pub fn world_with_delay(n: usize, delay: Arc<DelayFn>) -> Vec<MemTransport> {
        Self::build(n, Some(delay))
    }

    fn build(n: usize, delay: Option<Arc<DelayFn>>) -> Vec<MemTransport> {
        let boxes = (0..n)
            .map(|_| Mailbox {
                state: Mutex::new(MailState {
                    queues: (0..n).map(|_| PeerQueues::default()).collect(),
                    dead: vec![None; n],
                    last_ready: vec![None; n],
                    ..MailState::default()
                }),
                cv: Condvar::new(),
            })
            .collect();
        let fabric = Arc::new(Fabric { boxes, delay });
        (0..n).map(|rank| MemTransport { rank, fabric: fabric.clone() }).collect()
    }

    fn lock(&self, rank: usize) -> MutexGuard<'_, MailState> {
        // A poisoned mutex means a rank thread panicked while holding it; the state itself stays
        // consistent (every critical section is short and panic-free), so keep going.
        self.fabric.boxes[rank].state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deliver one message into `dst`'s mailbox (caller holds its lock).
    fn deliver(dst: usize, st: &mut MailState, src: usize, desc: MsgDesc, data: &[u8]) {
        let mut stale = Vec::new();
        let dest = st.queues[src].arrive(&desc, &mut stale);
        for p in stale {
            let err = matcher::stale_error(dst, src, &p, &desc);
            st.ops.fail(p.id, err);
        }
        match dest {
            Dest::Posted(post) => matcher::deliver(dst, src, &mut st.ops, post, &desc, data),
            Dest::Unexpected => {
                st.unexpected_bytes += data.len() as u64;
                if st.unexpected_bytes > UNEXPECTED_LIMIT {
                    let err = Error::UnexpectedOverflow {
                        rank: dst,
                        peer: src,
                        bytes: st.unexpected_bytes,
                        limit: UNEXPECTED_LIMIT,
                    };
                    st.ops.fail_all(|_, _| err.clone());
                    st.poisoned = Some(err);
                } else {
                    st.queues[src].push_unexpected(desc, data.to_vec());
                }
            }
        }
    }

    /// Move delayed messages whose time has come; returns the earliest pending ready time.
    fn release_delayed(dst: usize, st: &mut MailState) -> Option<Instant> {
        if st.delayed.is_empty() {
            return None;
        }
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut i = 0;
        // Delivered in posting order per link: `delayed` is kept in arrival order and a link's
        // ready times never decrease.
        while i < st.delayed.len() {
            if st.delayed[i].ready <= now {
                let d = st.delayed.remove(i);
                Self::deliver(dst, st, d.src, d.desc, &d.data);
            } else {
                next = Some(next.map_or(st.delayed[i].ready, |n| n.min(st.delayed[i].ready)));
                i += 1;
            }
        }
        if st.dead.iter().any(Option::is_some) {
            Self::settle_dead(dst, st);
        }
        next
    }

    /// Fail the receives that wait on ranks that are gone, once everything those ranks sent
    /// (including delayed messages still in flight) has been delivered.
    fn settle_dead(dst: usize, st: &mut MailState) {
        for peer in 0..st.dead.len() {
            let Some(reason) = st.dead[peer].clone() else { continue };
            if st.delayed.iter().any(|d| d.src == peer) {
                continue;
            }
            let lost = |ctx| Error::PeerLost {
                rank: dst,
                peer,
                ctx: Some(Box::new(ctx)),
                detail: reason.clone(),
            };
            st.ops.fail_peer(peer, lost);
            st.queues[peer].clear_posted();
        }
    }

    /// Tell every other rank this one is gone. Operations with it fail naming it; with
    /// `poison` (an abort, as opposed to a clean exit) every other pending and future operation
    /// fails too, as over TCP where an abort frame reaches every peer.
    fn mark_dead(&self, reason: &str, poison: bool) {
        for (dst, mb) in self.fabric.boxes.iter().enumerate() {
            if dst == self.rank {
                continue;
            }
            let mut st = mb.state.lock().unwrap_or_else(|p| p.into_inner());
            if st.dead[self.rank].is_none() {
                st.dead[self.rank] = Some(reason.to_string());
                let (rank, peer) = (dst, self.rank);
                if poison {
                    let err = Error::PeerAborted { rank, peer, reason: reason.to_string() };
                    st.ops.fail_all(|_, _| err.clone());
                    st.queues[peer].clear_posted();
                    if st.poisoned.is_none() {
                        st.poisoned = Some(err);
                    }
                } else {
                    Self::settle_dead(rank, &mut st);
                }
            }
            mb.cv.notify_all();
        }
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.fabric.boxes.len()
    }

    fn name(&self) -> &'static str {
        "mem"
    }

    unsafe fn post_send(
        &self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world_size(), peer, "send")?;
        let id = {
            let mut me = self.lock(self.rank);
            if let Some(e) = &me.poisoned {
                return Err(e.poisoned());
            }
            if let Some(reason) = &me.dead[peer] {
                let err = Error::PeerLost {
                    rank: self.rank,
                    peer,
                    ctx: Some(Box::new(matcher::context(&desc, 0, len as u64, Instant::now()))),
                    detail: reason.clone(),
                };
                return Err(err);
            }
            let id = me.ops.insert(peer, desc, len, Instant::now());
            me.ops.complete(id, len);
            id
        };
        let data: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees `data..data+len` is readable until completion, and the
            // copy below finishes before this function returns.
            unsafe { std::slice::from_raw_parts(data, len) }
        };
        let delay = self.fabric.delay.as_ref().map(|f| f(self.rank, peer, len));
        let mb = &self.fabric.boxes[peer];
        let mut st = self.lock(peer);
        if st.poisoned.is_none() {
            match delay {
                Some(d) if !d.is_zero() => {
                    let mut ready = Instant::now() + d;
                    if let Some(last) = st.last_ready[self.rank] {
                        ready = ready.max(last);
                    }
                    st.last_ready[self.rank] = Some(ready);
                    st.delayed.push(Delayed { ready, src: self.rank, desc, data: data.to_vec() });
                }
                _ if st.delayed.iter().any(|d| d.src == self.rank) => {
                    // Keep order behind earlier delayed messages on this link.
                    let ready = st.last_ready[self.rank].unwrap_or_else(Instant::now);
                    st.delayed.push(Delayed { ready, src: self.rank, desc, data: data.to_vec() });
                }
                _ => Self::deliver(peer, &mut st, self.rank, desc, data),
            }
        }
        drop(st);
        mb.cv.notify_all();
        Ok(id)
    }

    unsafe fn post_recv(
        &self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
    ) -> Result<OpId> {
        matcher::check_peer(self.rank, self.world_size(), peer, "recv")?;
        let mut st = self.lock(self.rank);
        if let Some(e) = &st.poisoned {
            return Err(e.poisoned());
        }
        let id = st.ops.insert(peer, desc, cap, Instant::now());
        let post = RecvPost { id, desc, buf: RawBuf(buf), cap };
        match st.queues[peer].post(post) {
            Posted::Queued => {
                // Messages sent before the peer went away were still delivered above; only a
                // receive that must wait for more fails.
                let in_flight = st.delayed.iter().any(|d| d.src == peer);
                if let Some(reason) = st.dead[peer].clone().filter(|_| !in_flight) {
                    st.queues[peer].remove(id);
                    let err = Error::PeerLost {
                        rank: self.rank,
                        peer,
                        ctx: Some(Box::new(matcher::context(&desc, 0, cap as u64, Instant::now()))),
                        detail: reason,
                    };
                    st.ops.fail(id, err);
                }
            }
            Posted::Stale(post, got) => {
                let err = matcher::stale_error(self.rank, peer, &post, &got);
                st.ops.fail(id, err);
            }
            Posted::Matched(post, got, data) => {
                st.unexpected_bytes -= data.len() as u64;
                matcher::deliver(self.rank, peer, &mut st.ops, post, &got, &data);
            }
        }
        Ok(id)
    }

    fn wait(&self, op: OpId, deadline: Instant) -> Result<usize> {
        let mb = &self.fabric.boxes[self.rank];
        let start = Instant::now();
        let mut probed = false;
        let mut st = self.lock(self.rank);
        loop {
            let next_ready = Self::release_delayed(self.rank, &mut st);
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
            if !probed && now.duration_since(start) >= PROBE_AFTER && peer != self.rank {
                // Ask the peer, as the TCP transport's probe frame does, whether it is in the
                // same collective with another fingerprint.
                probed = true;
                drop(st);
                let theirs = self.lock(peer).ops.conflict(&desc);
                st = self.lock(self.rank);
                if let Some(theirs) = theirs {
                    st.ops.forget(op);
                    for q in st.queues.iter_mut() {
                        q.remove(op);
                    }
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        peer,
                        expected: desc.to_string(),
                        got: format!("{theirs} (rank {peer} is in the same collective)"),
                    });
                }
                continue;
            }
            let mut until = next_ready.map_or(deadline, |r| r.min(deadline));
            if !probed {
                until = until.min(start + PROBE_AFTER);
            }
            let (g, _) = mb
                .cv
                .wait_timeout(st, until.saturating_duration_since(now))
                .unwrap_or_else(|p| p.into_inner());
            st = g;
        }
    }

    fn probe(&self, peer: usize, desc: MsgDesc) -> Result<bool> {
        matcher::check_peer(self.rank, self.world_size(), peer, "probe")?;
        let mut st = self.lock(self.rank);
        if let Some(e) = &st.poisoned {
            return Err(e.poisoned());
        }
        Self::release_delayed(self.rank, &mut st);
        Ok(st.queues[peer].has_unexpected(desc.tag))
    }

    fn test(&self, op: OpId) -> Result<Option<usize>> {
        let mut st = self.lock(self.rank);
        Self::release_delayed(self.rank, &mut st);
        st.ops.take_finished(op).transpose()
    }

    fn cancel(&self, op: OpId) {
        let mut st = self.lock(self.rank);
        for q in st.queues.iter_mut() {
            if q.remove(op) {
                break;
            }
        }
        st.ops.forget(op);
    }

    fn abort(&self, reason: &str) {
        {
            let mut st = self.lock(self.rank);
            if st.poisoned.is_none() {
                let err = Error::Aborted { rank: self.rank, reason: reason.to_string() };
                st.ops.fail_all(|_, _| err.clone());
                st.poisoned = Some(err);
            }
        }
        self.fabric.boxes[self.rank].cv.notify_all();
        self.mark_dead(reason, true);
    }

    fn poisoned(&self) -> Option<Error> {
        self.lock(self.rank).poisoned.clone()
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        // A rank that an abort reached passes it on as it goes, as a TCP or QUIC rank does
        // (its poisoning queues abort frames on every link): a peer that the original abort has
        // not reached yet then learns why, not just that this rank left.
        let poisoned = self.lock(self.rank).poisoned.clone();
        match poisoned {
            Some(Error::PeerAborted { reason, .. }) | Some(Error::Aborted { reason, .. }) => {
                self.mark_dead(&reason, true)
            }
            _ => self
                .mark_dead("peer rank's transport was dropped (thread exited or panicked)", false),
        }
    }
}
