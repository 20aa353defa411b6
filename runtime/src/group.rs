//! Groups: the handle users hold.
//!
//! A [`Group`] is a set of ranks over one transport, with its own id, collective sequence numbers
//! and timeout; its failure state is the transport's, shared by every group over it. [`Group::new_group`] makes sub-groups that share the parent's
//! connections (for 2-D data × tensor parallel layouts). Group ranks are dense `0..size`; the
//! group maps them to transport (global) ranks.

use std::any::Any;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::transport::matcher::P2P_GROUP_BIT;
use crate::transport::{OpId, Transport, TransportExt};
use crate::wire::{DType, Fingerprint, MsgDesc, OpKind, Tag};

/// Default per-operation timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A set of ranks that run collectives together.
///
/// Cloning is cheap and shares the sequence counter: clones are the same group. A group has no
/// failure state of its own: its transport's is the one every group over it asks
/// ([`Transport::fail`]).
#[derive(Clone)]
pub struct Group {
    inner: Arc<GroupInner>,
}

struct GroupInner {
    /// Let go of through the launcher (see the `Drop` below).
    transport: std::mem::ManuallyDrop<Arc<dyn Transport>>,
    id: u32,
    members: Vec<usize>,
    rank: usize,
    seq: AtomicU64,
    children: AtomicU32,
    timeout_ms: AtomicU64,
    /// Things that must live as long as the group (the store server on rank 0).
    keep: Vec<Arc<dyn Any + Send + Sync>>,
    /// How to rebuild the world over the survivors of a failure (groups made by rendezvous).
    rejoin: Option<Arc<crate::membership::Membership>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("id", &self.inner.id)
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.members.len())
            .field("transport", &self.inner.transport.name())
            .finish()
    }
}

impl Drop for GroupInner {
    fn drop(&mut self) {
        // The launcher's notice reader holds a transport for a moment while it fails it; had
        // it the last reference then, the transport would shut down on that thread (its close
        // frames, its abort note) while this one returned and could end the process first.
        // The last group's reference comes back from `release` and the transport shuts down
        // here, on this thread.
        // SAFETY: taken once, in the group's drop; the field is not used again.
        let t = unsafe { std::mem::ManuallyDrop::take(&mut self.transport) };
        drop(crate::rendezvous::launcher::release(t));
    }
}

impl Group {
    /// The world group over `transport`: every rank of the job, id 0.
    pub fn new(transport: Arc<dyn Transport>) -> Group {
        Self::with_parts(transport, Vec::new(), None)
    }

    pub(crate) fn with_parts(
        transport: Arc<dyn Transport>,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
        rejoin: Option<Arc<crate::membership::Membership>>,
    ) -> Group {
        let n = transport.world_size();
        let rank = transport.rank();
        Group {
            inner: Arc::new(GroupInner {
                transport: std::mem::ManuallyDrop::new(transport),
                id: 0,
                members: (0..n).collect(),
                rank,
                seq: AtomicU64::new(0),
                children: AtomicU32::new(0),
                timeout_ms: AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64),
                keep,
                rejoin,
            }),
        }
    }

    /// One group per thread over the in-memory transport: `Group::mem_world(4)` gives the 4
    /// ranks of a job; hand each to its own thread.
    pub fn mem_world(n: usize) -> Vec<Group> {
        crate::transport::mem::MemTransport::world(n)
            .into_iter()
            .map(|t| Group::new(Arc::new(t)))
            .collect()
    }

    /// This rank within the group (`0..size()`).
    #[inline]
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    #[inline]
    pub fn size(&self) -> usize {
        self.inner.members.len()
    }

    /// Group id carried in every frame (0 is the world group).
    #[inline]
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// The transport (global) rank of group rank `r`.
    ///
    /// # Panics
    /// If `r >= size()`; callers check ranks with [`Group::check_rank`] first.
    #[inline]
    pub fn global_rank(&self, r: usize) -> usize {
        self.inner.members[r]
    }

    /// The global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.inner.members
    }

    /// The address this rank listens on and published to its peers (TCP, QUIC); `None` over
    /// memory.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.transport.local_addr()
    }

    /// The transport under this group.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.inner.transport
    }

    /// Per-operation timeout. Default 30 s ([`DEFAULT_TIMEOUT`]), or `TUTTI_TIMEOUT` seconds when
    /// built by rendezvous.
    #[inline]
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.timeout_ms.load(Ordering::Relaxed))
    }

    /// Set the per-operation timeout. Hazard: too short fails legitimately slow ranks; too long
    /// delays the report of a stuck peer (dead peers are reported at once regardless).
    pub fn set_timeout(&self, t: Duration) {
        // At least 1 ms; at most u64::MAX ms (half a billion years, still a valid deadline),
        // so a huge "no limit" value cannot wrap around to a short one.
        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1);
        self.inner.timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// Take the next collective sequence number. Every member takes them in the same order.
    #[inline]
    pub fn next_seq(&self) -> u64 {
        self.inner.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Fail when the transport under this group is poisoned (by this group, another group
    /// over it, a peer's abort or a lost link).
    ///
    /// # Errors
    /// [`Error::Poisoned`] with the original cause.
    #[inline]
    pub fn check(&self) -> Result<()> {
        match self.inner.transport.poisoned() {
            Some(e) => Err(e.poisoned()),
            None => Ok(()),
        }
    }

    /// A point-to-point call failed: on a fatal error, fail the group, so ranks waiting on this
    /// one fail now, naming it, instead of at their timeout (as a failed collective does).
    fn p2p_failed(&self, op: &str, e: &Error) {
        let reason = format!("rank {} failed in {op}: {e}", self.global_rank(self.rank()));
        self.fail(e, &reason);
    }

    /// Record a fatal failure `e` and tell every peer `reason` — the one way a call's failure
    /// is recorded. It goes to the transport ([`Transport::fail`]), which every group over it
    /// asks and whose first failure stays the cause. Under torchrun `e`, which names the
    /// operation, is left in the agent's error file (the process's latest failed call). A bad
    /// argument or setting (not fatal) changes nothing.
    pub fn fail(&self, e: &Error, reason: &str) {
        if !e.is_fatal() {
            return;
        }
        if self.inner.transport.fail(e.clone(), reason) {
            warn!(group = self.inner.id, rank = self.inner.rank, "group failed: {e}");
        }
        self.inner.transport.publish_failure();
        crate::rendezvous::launcher::record_failure(&e.to_string());
    }

    /// Refuse a rank argument outside the group, before anything is sent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the operation.
    pub fn check_rank(&self, r: usize, op: &str, what: &str) -> Result<()> {
        if r >= self.size() {
            return Err(Error::InvalidArgument {
                rank: self.rank(),
                op: op.into(),
                detail: format!("{what} {r} is outside the group of {} ranks", self.size()),
            });
        }
        Ok(())
    }

    /// How this group rebuilds itself after a failure, and what it keeps alive.
    pub(crate) fn parts(
        &self,
    ) -> (Option<&Arc<crate::membership::Membership>>, &[Arc<dyn Any + Send + Sync>]) {
        (self.inner.rejoin.as_ref(), &self.inner.keep)
    }

    /// The error that poisoned this group's transport, if any: the first failure of any group
    /// over it, a peer's abort or a lost link.
    pub fn failure(&self) -> Option<Error> {
        self.inner.transport.poisoned()
    }

    /// Stop everything: pending and future operations of every group over this transport fail
    /// with [`Error::Aborted`], and peers are told. Callable from any thread; idempotent.
    pub fn abort(&self, reason: &str) {
        self.inner.transport.abort(reason);
    }

    /// Make a sub-group of the given group ranks (sorted, distinct). Every member of `self` must
    /// call this, in the same order relative to other `new_group` calls (like
    /// `torch.distributed.new_group`); members of `ranks` get `Some(group)`, others `None`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty, unsorted, duplicated or out-of-range list.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Group>> {
        let n = self.inner.children.fetch_add(1, Ordering::Relaxed);
        self.child(ranks, u64::from(n))
    }

    /// Make a sub-group of the given group ranks (sorted, distinct) named by `key`: only its
    /// members call this, each with the same key, which no other sub-group of this group may
    /// use (for example a hash of the name a framework gave the group). Non-members get `None`.
    /// For frameworks that create a group only on its members (torch's `new_group` calls a
    /// backend only there).
    ///
    /// # Errors
    /// As [`Group::new_group`].
    pub fn new_group_keyed(&self, ranks: &[usize], key: u64) -> Result<Option<Group>> {
        // Keyed ids live apart from counted ones: the top bit of the mixed-in value.
        self.child(ranks, key | 1 << 63)
    }

    fn child(&self, ranks: &[usize], n: u64) -> Result<Option<Group>> {
        let bad = |d: String| Error::InvalidArgument {
            rank: self.rank(),
            op: "new_group".into(),
            detail: d,
        };
        if ranks.is_empty() {
            return Err(bad("the rank list is empty".into()));
        }
        if ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad(format!("ranks {ranks:?} must be sorted and distinct")));
        }
        if let Some(r) = ranks.iter().find(|r| **r >= self.size()) {
            return Err(bad(format!("rank {r} is outside the group of {}", self.size())));
        }
        let Some(my) = ranks.iter().position(|r| *r == self.rank()) else {
            return Ok(None);
        };
        // Deterministic id from parent id, creation index and members: equal on every member.
        let words = std::iter::once(n).chain(ranks.iter().map(|r| *r as u64));
        let h = crate::wire::fnv1a(u64::from(self.inner.id), words);
        let id = ((h ^ (h >> 32)) as u32 & !P2P_GROUP_BIT).max(1);
        let members: Vec<usize> = ranks.iter().map(|r| self.inner.members[*r]).collect();
        info!(parent = self.inner.id, id, ?members, "new group");
        Ok(Some(Group {
            inner: Arc::new(GroupInner {
                transport: self.inner.transport.clone(),
                id,
                members,
                rank: my,
                seq: AtomicU64::new(0),
                children: AtomicU32::new(0),
                timeout_ms: AtomicU64::new(self.inner.timeout_ms.load(Ordering::Relaxed)),
                keep: Vec::new(),
                rejoin: None,
            }),
        }))
    }

    fn p2p_desc(&self, tag: u32) -> MsgDesc {
        MsgDesc {
            tag: Tag { group: self.inner.id | P2P_GROUP_BIT, seq: 0, step: tag },
            fp: Fingerprint {
                op: OpKind::SendRecv,
                dtype: DType::U8,
                redop: 0,
                root: u32::MAX,
                count: 0,
                settings: 0,
            },
        }
    }

    /// Send `data` to group rank `dst` under a user `tag`. Messages of one (peer, tag) arrive in
    /// order.
    ///
    /// # Collective contract
    /// Point to point: `dst` posts a matching [`recv`](Group::recv) from this rank with the same
    /// tag and a buffer at least `data.len()` long.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad rank; transport errors; timeouts.
    pub fn send(&self, dst: usize, tag: u32, data: &[u8]) -> Result<()> {
        self.check()?;
        self.check_rank(dst, "send", "destination rank")?;
        let r = self.inner.transport.send(
            self.global_rank(dst),
            self.p2p_desc(tag),
            data,
            self.timeout(),
        );
        r.inspect_err(|e| self.p2p_failed("send", e))
    }

    /// Receive from group rank `src` under `tag` into `buf`; returns the bytes received.
    ///
    /// # Collective contract
    /// Point to point, matching a [`send`](Group::send) from `src`.
    ///
    /// # Errors
    /// As [`send`](Group::send); [`Error::TooLong`] when the message does not fit.
    pub fn recv(&self, src: usize, tag: u32, buf: &mut [u8]) -> Result<usize> {
        self.check()?;
        self.check_rank(src, "recv", "source rank")?;
        let r = self.inner.transport.recv(
            self.global_rank(src),
            self.p2p_desc(tag),
            buf,
            self.timeout(),
        );
        r.inspect_err(|e| self.p2p_failed("recv", e))
    }

    /// Receive under `tag` into `buf` from whichever group rank sent first; returns that rank
    /// and the bytes received. Messages of one (peer, tag) still arrive in order.
    ///
    /// It looks for an arrived message from each rank in turn ([`Transport::probe`]), then
    /// sleeps (10 µs, doubling up to 1 ms) and looks again until the group's timeout: a message
    /// is taken up to 1 ms after it arrived. Receives from a named rank wait without polling.
    ///
    /// # Collective contract
    /// Point to point: some rank sends to this one with `tag`.
    ///
    /// # Errors
    /// [`Error::AnySourceTimeout`] when nothing arrives in time (the group is poisoned, as
    /// for a timed-out [`recv`](Group::recv)); as [`recv`](Group::recv) otherwise.
    pub fn recv_any(&self, tag: u32, buf: &mut [u8]) -> Result<(usize, usize)> {
        self.check()?;
        let desc = self.p2p_desc(tag);
        let start = Instant::now();
        let timeout = self.timeout();
        let n = self.size();
        let mut nap = Duration::from_micros(10);
        loop {
            for src in 0..n {
                let found = self
                    .inner
                    .transport
                    .probe(self.global_rank(src), desc)
                    .inspect_err(|e| self.p2p_failed("recv from any source", e))?;
                if found {
                    return Ok((src, self.recv(src, tag, buf)?));
                }
            }
            if start.elapsed() >= timeout {
                let e = Error::AnySourceTimeout { rank: self.rank(), tag, timeout };
                self.p2p_failed("recv from any source", &e);
                return Err(e);
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Send `data` to `dst` and receive from `src` into `buf` at the same time (both under
    /// `tag`); returns the bytes received. Rings of sendrecv never deadlock.
    ///
    /// # Collective contract
    /// Point to point: `dst` receives from this rank and `src` sends to it, with the same tag.
    ///
    /// # Errors
    /// As [`Group::send`] and [`Group::recv`].
    pub fn sendrecv(
        &self,
        dst: usize,
        data: &[u8],
        src: usize,
        buf: &mut [u8],
        tag: u32,
    ) -> Result<usize> {
        self.check()?;
        self.check_rank(dst, "sendrecv", "destination rank")?;
        self.check_rank(src, "sendrecv", "source rank")?;
        let d = self.p2p_desc(tag);
        let mut ops = [
            crate::transport::Op::Recv { peer: self.global_rank(src), desc: d, buf, received: 0 },
            crate::transport::Op::Send { peer: self.global_rank(dst), desc: d, data },
        ];
        self.inner
            .transport
            .exchange(&mut ops, self.timeout())
            .inspect_err(|e| self.p2p_failed("sendrecv", e))?;
        match ops[0] {
            crate::transport::Op::Recv { received, .. } => Ok(received),
            _ => unreachable!("slot 0 holds the receive built above"),
        }
    }

    /// Several point-to-point sends and receives at once (PyTorch's `batch_isend_irecv`): all
    /// are posted, then all waited for, so neighbours that send to each other at the same time
    /// never deadlock whatever the sizes. `sends` are `(dst, tag, data)`, `recvs` are
    /// `(src, tag, buf)`; returns the bytes received per receive.
    ///
    /// # Collective contract
    /// Point to point: every send is matched by a receive of the same tag on its destination.
    ///
    /// # Errors
    /// As [`Group::send`] and [`Group::recv`].
    pub fn batch_p2p(
        &self,
        sends: &[(usize, u32, &[u8])],
        recvs: &mut [(usize, u32, &mut [u8])],
    ) -> Result<Vec<usize>> {
        self.check()?;
        for (dst, _, _) in sends {
            self.check_rank(*dst, "batch_p2p", "destination rank")?;
        }
        for (src, _, _) in recvs.iter() {
            self.check_rank(*src, "batch_p2p", "source rank")?;
        }
        let mut ops: Vec<crate::transport::Op<'_>> = Vec::with_capacity(sends.len() + recvs.len());
        for (src, tag, buf) in recvs.iter_mut() {
            ops.push(crate::transport::Op::Recv {
                peer: self.global_rank(*src),
                desc: self.p2p_desc(*tag),
                buf,
                received: 0,
            });
        }
        for (dst, tag, data) in sends {
            ops.push(crate::transport::Op::Send {
                peer: self.global_rank(*dst),
                desc: self.p2p_desc(*tag),
                data,
            });
        }
        self.inner
            .transport
            .exchange(&mut ops, self.timeout())
            .inspect_err(|e| self.p2p_failed("batch_p2p", e))?;
        Ok(ops
            .iter()
            .filter_map(|op| match op {
                crate::transport::Op::Recv { received, .. } => Some(*received),
                crate::transport::Op::Send { .. } => None,
            })
            .collect())
    }

    /// Post a non-blocking point-to-point send; see [`Group::send`].
    ///
    /// # Safety
    /// As [`Transport::post_send`]: `data` must stay valid and unchanged until the returned
    /// operation is waited for or cancelled on [`Group::transport`].
    ///
    /// # Errors
    /// As [`Group::send`].
    pub unsafe fn isend(&self, dst: usize, tag: u32, data: &[u8]) -> Result<OpId> {
        self.check()?;
        self.check_rank(dst, "isend", "destination rank")?;
        // SAFETY: forwarded to the caller.
        unsafe {
            self.inner.transport.post_send(
                self.global_rank(dst),
                self.p2p_desc(tag),
                data.as_ptr(),
                data.len(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_failed_point_to_point_call_tells_every_peer() {
        // Rank 0 times out waiting for rank 1 (which waits for rank 2, which waits for rank 0):
        // ranks 1 and 2 must hear of it at once, not at their own 30 s timeout.
        let gs = Group::mem_world(3);
        gs[0].set_timeout(Duration::from_millis(300));
        let errs: Vec<(String, Duration)> = std::thread::scope(|s| {
            let hs: Vec<_> = gs
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let start = Instant::now();
                        let mut b = [0u8; 4];
                        let from = (g.rank() + 1) % 3;
                        let e = g.recv(from, 5, &mut b).unwrap_err();
                        (e.to_string(), start.elapsed())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(errs[0].0.contains("timed out"), "{}", errs[0].0);
        for (r, (e, t)) in errs.iter().enumerate().skip(1) {
            assert!(e.contains("rank 0 failed in recv"), "rank {r}: {e}");
            assert!(*t < Duration::from_secs(10), "rank {r} heard only after {t:?}");
        }
    }

    #[test]
    fn a_timeout_meant_as_no_limit_stays_long_and_calls_still_work() {
        // Callers pass huge timeouts to mean "no limit" (torch's `timedelta.max`, or
        // `Duration::MAX`): it must neither wrap around to a short timeout nor overflow a
        // deadline, on every transport.
        use crate::testing::Kind;
        #[cfg(feature = "quic")]
        let kinds = [Kind::Mem, Kind::Tcp, Kind::Shm, Kind::Quic];
        #[cfg(not(feature = "quic"))]
        let kinds = [Kind::Mem, Kind::Tcp, Kind::Shm];
        for kind in kinds {
            let gs = crate::testing::groups(kind, 2).unwrap();
            for g in &gs {
                g.set_timeout(Duration::MAX);
                assert!(g.timeout() > Duration::from_secs(1 << 40), "{:?}", g.timeout());
                // 2^62 s is a multiple of 2^64 ms: cast to 64 bits, it was 0 ms.
                g.set_timeout(Duration::from_secs(1 << 62));
                assert!(g.timeout() > Duration::from_secs(1 << 40), "{:?}", g.timeout());
                g.set_timeout(Duration::from_secs(86_400 * 999_999_999)); // timedelta.max
                assert!(g.timeout() > Duration::from_secs(1 << 40), "{:?}", g.timeout());
            }
            let got = crate::testing::run(gs, |g| {
                let mut b = [g.rank() as u8; 4];
                if g.rank() == 0 {
                    g.send(1, 9, &b).map(|_| b)
                } else {
                    g.recv(0, 9, &mut b).map(|_| b)
                }
            });
            for r in got {
                assert_eq!(r.unwrap(), [0; 4], "{kind:?}");
            }
        }
    }
}
