//! Matching of arriving messages to posted receives, shared by every transport.
//!
//! Per source peer, posted receives and unexpected (arrived before being posted) messages wait in
//! FIFO order. A message matches the first posted receive with the same [`Tag`]; its fingerprint
//! and length are then checked. A data frame for a later sequence number of a group while a
//! receive for an earlier one is still posted proves the peer moved on without sending what this
//! rank waits for: that receive fails as a mismatch instead of hanging until the timeout.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::error::{Error, OpContext, Result};
use crate::transport::OpId;
use crate::wire::{MsgDesc, Tag};

/// Groups at or above this id carry point-to-point traffic, whose sequence numbers never advance.
pub(crate) const P2P_GROUP_BIT: u32 = 0x8000_0000;

/// A raw buffer pointer that may cross threads; the poster's safety contract keeps it valid.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBuf(pub(crate) *mut u8);

// SAFETY: the pointer is only dereferenced while the operation that owns it is posted, and the
// poster guarantees exclusive access to the range for that long (see `Transport::post_recv`).
unsafe impl Send for RawBuf {}

/// A posted receive waiting for its message.
#[derive(Debug)]
pub(crate) struct RecvPost {
    pub(crate) id: OpId,
    pub(crate) desc: MsgDesc,
    pub(crate) buf: RawBuf,
    pub(crate) cap: usize,
}

/// State of one posted operation.
#[derive(Debug)]
pub(crate) enum OpState {
    Pending { peer: usize, desc: MsgDesc, bytes: u64, posted: Instant },
    Done(usize),
    Failed(Error),
}

/// Hashes operation ids. They are this rank's own counter, never a peer's input, so a
/// multiplicative hash spreads them well enough; SipHash's resistance to chosen keys would buy
/// nothing here and costs a few per cent of a small message's time (it showed in profiles of
/// 8-byte broadcasts, on every post, test and wait).
#[derive(Debug, Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The table of operations posted on one rank.
#[derive(Debug, Default)]
pub(crate) struct Ops {
    map: HashMap<u64, OpState, std::hash::BuildHasherDefault<IdHasher>>,
    next: u64,
    /// Operations that have ended (done or failed) so far: threads waiting for others' work
    /// compare it before and after to know whether to wake anyone.
    ended: u64,
}

impl Ops {
    pub(crate) fn insert(
        &mut self,
        peer: usize,
        desc: MsgDesc,
        bytes: usize,
        posted: Instant,
    ) -> OpId {
        self.next += 1;
        let state = OpState::Pending { peer, desc, bytes: bytes as u64, posted };
        self.map.insert(self.next, state);
        OpId(self.next)
    }

    pub(crate) fn complete(&mut self, id: OpId, bytes: usize) {
        if let Some(s) = self.map.get_mut(&id.0) {
            if matches!(s, OpState::Pending { .. }) {
                *s = OpState::Done(bytes);
                self.ended += 1;
            }
        }
    }

    pub(crate) fn fail(&mut self, id: OpId, err: Error) {
        if let Some(s) = self.map.get_mut(&id.0) {
            if matches!(s, OpState::Pending { .. }) {
                *s = OpState::Failed(err);
                self.ended += 1;
            }
        }
    }

    /// Fail every pending operation; `make` builds the error from (peer, context).
    pub(crate) fn fail_all(&mut self, mut make: impl FnMut(usize, OpContext) -> Error) {
        for s in self.map.values_mut() {
            if let OpState::Pending { peer, desc, bytes, posted } = s {
                let err = make(*peer, context(desc, 0, *bytes, *posted));
                *s = OpState::Failed(err);
                self.ended += 1;
            }
        }
    }

    /// Fail every pending operation with `peer`.
    pub(crate) fn fail_peer(&mut self, peer: usize, mut make: impl FnMut(OpContext) -> Error) {
        for s in self.map.values_mut() {
            if let OpState::Pending { peer: p, desc, bytes, posted } = s {
                if *p == peer {
                    let err = make(context(desc, 0, *bytes, *posted));
                    *s = OpState::Failed(err);
                    self.ended += 1;
                }
            }
        }
    }

    /// How many operations have ended (done or failed) since the table was made.
    pub(crate) fn ended(&self) -> u64 {
        self.ended
    }

    /// `Some(result)` when finished (and forgets the op); `None` while pending or unknown.
    pub(crate) fn take_finished(&mut self, id: OpId) -> Option<Result<usize>> {
        match self.map.get(&id.0)? {
            OpState::Pending { .. } => None,
            _ => match self.map.remove(&id.0) {
                Some(OpState::Done(n)) => Some(Ok(n)),
                Some(OpState::Failed(e)) => Some(Err(e)),
                _ => None,
            },
        }
    }

    pub(crate) fn pending(&self, id: OpId) -> Option<(usize, MsgDesc, u64, Instant)> {
        match self.map.get(&id.0)? {
            OpState::Pending { peer, desc, bytes, posted } => Some((*peer, *desc, *bytes, *posted)),
            _ => None,
        }
    }

    /// A pending operation of the same collective (group and sequence number) as `probe` whose
    /// fingerprint differs: proof that the two ranks disagree about that collective.
    pub(crate) fn conflict(&self, probe: &MsgDesc) -> Option<MsgDesc> {
        if probe.tag.group & P2P_GROUP_BIT != 0 {
            return None;
        }
        self.map.values().find_map(|s| match s {
            OpState::Pending { desc, .. }
                if desc.tag.group == probe.tag.group
                    && desc.tag.seq == probe.tag.seq
                    && desc.fp != probe.fp =>
            {
                Some(*desc)
            }
            _ => None,
        })
    }

    pub(crate) fn forget(&mut self, id: OpId) {
        self.map.remove(&id.0);
    }
}

/// Refuse a peer rank outside the world, before anything is posted.
pub(crate) fn check_peer(rank: usize, world: usize, peer: usize, what: &str) -> Result<()> {
    if peer >= world {
        return Err(Error::InvalidArgument {
            rank,
            op: what.into(),
            detail: format!("peer rank {peer} is outside the world of {world}"),
        });
    }
    Ok(())
}

/// A whole message for a posted receive: check its fingerprint and length, copy it in, and
/// complete (or fail) the operation.
pub(crate) fn deliver(
    rank: usize,
    peer: usize,
    ops: &mut Ops,
    post: RecvPost,
    got: &MsgDesc,
    data: &[u8],
) {
    let posted_at = ops.pending(post.id).map_or_else(Instant::now, |p| p.3);
    match check(rank, peer, &post, got, data.len() as u64, posted_at) {
        Ok(()) => {
            // SAFETY: the receive is posted, so its buffer is valid for `cap` bytes, and `check`
            // proved `data.len() <= cap`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), post.buf.0, data.len()) };
            ops.complete(post.id, data.len());
        }
        Err(e) => ops.fail(post.id, e),
    }
}

/// The error for waiting on an id that is not posted (never was, or already waited for).
pub(crate) fn not_posted(rank: usize, op: OpId) -> Error {
    Error::InvalidArgument {
        rank,
        op: "wait".into(),
        detail: format!("operation {op:?} is not posted (already waited for?)"),
    }
}

/// The error for an operation whose deadline passed.
pub(crate) fn timed_out(
    rank: usize,
    peer: usize,
    desc: &MsgDesc,
    done: u64,
    bytes: u64,
    posted: Instant,
    deadline: Instant,
) -> Error {
    Error::Timeout {
        rank,
        peer,
        ctx: Box::new(context(desc, done, bytes, posted)),
        timeout: deadline.saturating_duration_since(posted),
    }
}

/// Context of an operation for error messages.
pub(crate) fn context(desc: &MsgDesc, done: u64, bytes: u64, posted: Instant) -> OpContext {
    OpContext {
        op: desc.fp.op,
        group: desc.tag.group,
        seq: desc.tag.seq,
        step: desc.tag.step,
        bytes_done: done,
        bytes,
        elapsed: posted.elapsed(),
    }
}

/// Check an arriving message against the receive posted for its tag.
pub(crate) fn check(
    rank: usize,
    peer: usize,
    post: &RecvPost,
    got: &MsgDesc,
    len: u64,
    posted_at: Instant,
) -> Result<()> {
    if post.desc.fp != got.fp {
        return Err(Error::Mismatch {
            rank,
            peer,
            expected: post.desc.to_string(),
            got: got.to_string(),
        });
    }
    if len > post.cap as u64 {
        return Err(Error::TooLong {
            rank,
            peer,
            ctx: Box::new(context(&post.desc, 0, post.cap as u64, posted_at)),
            posted: post.cap as u64,
            got: len,
        });
    }
    Ok(())
}

/// What became of a posted receive.
#[derive(Debug)]
pub(crate) enum Posted {
    /// An unexpected message with its tag was waiting: check and copy it.
    Matched(RecvPost, MsgDesc, Vec<u8>),
    /// The peer already sent this later message of the group: the receive can never match.
    Stale(RecvPost, MsgDesc),
    /// Queued until its message arrives.
    Queued,
}

/// Where an arriving message goes.
#[derive(Debug)]
pub(crate) enum Dest {
    /// Into this posted receive (already removed from the queue; check it first).
    Posted(RecvPost),
    /// Into the unexpected queue.
    Unexpected,
}

/// Posted receives and unexpected messages from one source peer.
#[derive(Debug, Default)]
pub(crate) struct PeerQueues {
    posted: VecDeque<RecvPost>,
    unexpected: VecDeque<(MsgDesc, Vec<u8>)>,
    /// Payload bytes waiting in `unexpected`.
    buffered: u64,
}

impl PeerQueues {
    /// Post a receive: takes an unexpected message with its tag if one is waiting (the caller
    /// checks and copies it); fails it as stale when the peer already sent a later collective of
    /// the same group; else queues it.
    pub(crate) fn post(&mut self, post: RecvPost) -> Posted {
        let tag = post.desc.tag;
        if let Some(i) = self.unexpected.iter().position(|(d, _)| d.tag == tag) {
            if let Some((desc, data)) = self.unexpected.remove(i) {
                self.buffered -= data.len() as u64;
                return Posted::Matched(post, desc, data);
            }
        }
        if tag.group & P2P_GROUP_BIT == 0 {
            let later = self
                .unexpected
                .iter()
                .find(|(d, _)| d.tag.group == tag.group && d.tag.seq > tag.seq);
            if let Some((d, _)) = later {
                let d = *d;
                return Posted::Stale(post, d);
            }
        }
        self.posted.push_back(post);
        Posted::Queued
    }

    /// A data header arrived: find its destination. Receives proven unmatched by a sequence
    /// advance are returned in `stale` for the caller to fail.
    pub(crate) fn arrive(&mut self, desc: &MsgDesc, stale: &mut Vec<RecvPost>) -> Dest {
        let tag = desc.tag;
        if let Some(i) = self.posted.iter().position(|p| p.desc.tag == tag) {
            if let Some(p) = self.posted.remove(i) {
                return Dest::Posted(p);
            }
        }
        if tag.group & P2P_GROUP_BIT == 0 {
            let mut i = 0;
            while i < self.posted.len() {
                let t: Tag = self.posted[i].desc.tag;
                let other_fp = t.seq == tag.seq && self.posted[i].desc.fp != desc.fp;
                if t.group == tag.group && (t.seq < tag.seq || other_fp) {
                    if let Some(p) = self.posted.remove(i) {
                        stale.push(p);
                    }
                } else {
                    i += 1;
                }
            }
        }
        Dest::Unexpected
    }

    /// Queue a fully arrived unexpected message.
    pub(crate) fn push_unexpected(&mut self, desc: MsgDesc, data: Vec<u8>) {
        self.buffered += data.len() as u64;
        self.unexpected.push_back((desc, data));
    }

    /// Remove a posted receive (cancel); true if it was still queued.
    pub(crate) fn remove(&mut self, id: OpId) -> bool {
        if let Some(i) = self.posted.iter().position(|p| p.id == id) {
            self.posted.remove(i);
            true
        } else {
            false
        }
    }

    /// Whether a whole message with `tag` waits here for its receive.
    pub(crate) fn has_unexpected(&self, tag: Tag) -> bool {
        self.unexpected.iter().any(|(d, _)| d.tag == tag)
    }

    /// Payload bytes of messages that arrived before their receive and wait here.
    pub(crate) fn buffered(&self) -> u64 {
        self.buffered
    }

    /// Is receive `id` still waiting in this queue?
    pub(crate) fn is_posted(&self, id: OpId) -> bool {
        self.posted.iter().any(|p| p.id == id)
    }

    /// Drop every queued receive (after the peer failed).
    pub(crate) fn clear_posted(&mut self) {
        self.posted.clear();
    }
}

/// The error for a receive that can never match: the peer sent a message of the same
/// collective with another fingerprint, or moved on to a later collective.
pub(crate) fn stale_error(rank: usize, peer: usize, post: &RecvPost, got: &MsgDesc) -> Error {
    let got = if got.tag.seq == post.desc.tag.seq {
        got.to_string()
    } else {
        format!(
            "{got} (rank {peer} already moved on to a later collective without sending the \
             expected message)"
        )
    };
    Error::Mismatch { rank, peer, expected: post.desc.to_string(), got }
}

/// The bookkeeping one rank's transport keeps for matching, borrowed together: the queues of
/// one source peer, the operation table and the unexpected-bytes budget. The steps below are
/// the same for every connection-based transport (TCP, QUIC); each returns how many posted
/// receives it used up (delivered or failed), for transports that count them per connection.
pub(crate) struct Matching<'a> {
    pub(crate) rank: usize,
    pub(crate) peer: usize,
    pub(crate) queues: &'a mut PeerQueues,
    pub(crate) ops: &'a mut Ops,
    pub(crate) unexpected_bytes: &'a mut u64,
}

/// Where the payload of an arriving data frame goes.
#[derive(Debug)]
pub(crate) enum Landing {
    /// Straight into this posted receive (checked).
    Posted { id: OpId, buf: RawBuf },
    /// Into a buffer for the unexpected queue (its bytes are already counted).
    Buffer,
    /// No receive yet and larger than the caller buffers eagerly: leave it where it is.
    Park,
    /// Read and drop (the receive it matched failed its check).
    Discard,
}

impl Matching<'_> {
    /// Fail receives proven stale by `got`.
    fn fail_stale(&mut self, stale: Vec<RecvPost>, got: &MsgDesc) -> usize {
        let n = stale.len();
        for p in stale {
            let err = stale_error(self.rank, self.peer, &p, got);
            self.ops.fail(p.id, err);
        }
        n
    }

    /// A send from this rank to itself (the `Matching` of its own queue): delivered to a posted
    /// receive or buffered at once, and complete.
    ///
    /// # Safety
    /// `data` is readable for `len` bytes for the duration of the call.
    pub(crate) unsafe fn send_to_self(
        &mut self,
        id: OpId,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) {
        let slice: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: the caller's contract; the copy ends before return.
            unsafe { std::slice::from_raw_parts(data, len) }
        };
        self.arrive_whole(&desc, std::borrow::Cow::Borrowed(slice), false);
        self.ops.complete(id, len);
    }

    /// Post a receive: a matching buffered message is delivered at once, a stale receive fails.
    /// `true` when the receive stays queued, waiting for its message.
    pub(crate) fn post_recv(&mut self, post: RecvPost) -> bool {
        let id = post.id;
        match self.queues.post(post) {
            Posted::Matched(post, got, data) => {
                *self.unexpected_bytes -= data.len() as u64;
                deliver(self.rank, self.peer, self.ops, post, &got, &data);
                false
            }
            Posted::Stale(post, got) => {
                let err = stale_error(self.rank, self.peer, &post, &got);
                self.ops.fail(id, err);
                false
            }
            Posted::Queued => true,
        }
    }

    /// A whole message (a send to self, or one buffered while it arrived): into the first
    /// matching posted receive, else the unexpected queue. `counted`: its bytes are already in
    /// the unexpected budget.
    pub(crate) fn arrive_whole(
        &mut self,
        desc: &MsgDesc,
        data: std::borrow::Cow<'_, [u8]>,
        counted: bool,
    ) -> usize {
        let mut stale = Vec::new();
        let used = match self.queues.arrive(desc, &mut stale) {
            Dest::Posted(post) => {
                if counted {
                    *self.unexpected_bytes -= data.len() as u64;
                }
                deliver(self.rank, self.peer, self.ops, post, desc, &data);
                1
            }
            Dest::Unexpected => {
                if !counted {
                    *self.unexpected_bytes += data.len() as u64;
                }
                self.queues.push_unexpected(*desc, data.into_owned());
                0
            }
        };
        used + self.fail_stale(stale, desc)
    }

    /// A data frame's header arrived: where its `len` payload bytes go. A message with no
    /// receive yet is parked when longer than `park_above`, else buffered within `limit` bytes
    /// of unexpected messages in all — `Err` (to poison with) beyond that.
    pub(crate) fn arrive_header(
        &mut self,
        desc: &MsgDesc,
        len: u64,
        park_above: u64,
        limit: u64,
    ) -> (Result<Landing>, usize) {
        let mut stale = Vec::new();
        let dest = self.queues.arrive(desc, &mut stale);
        let mut used = self.fail_stale(stale, desc);
        let landing = match dest {
            Dest::Posted(post) => {
                used += 1;
                let posted_at = self.ops.pending(post.id).map_or_else(Instant::now, |p| p.3);
                match check(self.rank, self.peer, &post, desc, len, posted_at) {
                    Ok(()) => Ok(Landing::Posted { id: post.id, buf: post.buf }),
                    Err(e) => {
                        tracing::warn!(rank = self.rank, peer = self.peer, "{e}");
                        self.ops.fail(post.id, e);
                        Ok(Landing::Discard)
                    }
                }
            }
            Dest::Unexpected if len > park_above => Ok(Landing::Park),
            Dest::Unexpected => {
                let total = self.unexpected_bytes.saturating_add(len);
                if total > limit {
                    Err(Error::UnexpectedOverflow {
                        rank: self.rank,
                        peer: self.peer,
                        bytes: total,
                        limit,
                    })
                } else {
                    *self.unexpected_bytes = total;
                    Ok(Landing::Buffer)
                }
            }
        };
        (landing, used)
    }
}

/// The error for posting to (or from) a peer that already closed its transport.
pub(crate) fn closed_peer(rank: usize, peer: usize, desc: &MsgDesc, len: usize) -> Error {
    Error::PeerLost {
        rank,
        peer,
        ctx: Some(Box::new(context(desc, 0, len as u64, Instant::now()))),
        detail: "the peer already closed its transport (it finished or exited)".into(),
    }
}

/// Register an operation with `peer` of `bytes` bytes, unless the transport is poisoned.
pub(crate) fn register(
    poisoned: &Option<Error>,
    ops: &mut Ops,
    peer: usize,
    desc: MsgDesc,
    bytes: usize,
    now: Instant,
) -> Result<OpId> {
    match poisoned {
        Some(e) => Err(e.poisoned()),
        None => Ok(ops.insert(peer, desc, bytes, now)),
    }
}

/// A probe from `peer` about `desc`: the mismatch it proves, if this rank waits in the same
/// collective with another fingerprint.
pub(crate) fn probe_mismatch(rank: usize, peer: usize, ops: &Ops, desc: &MsgDesc) -> Option<Error> {
    ops.conflict(desc).map(|mine| Error::Mismatch {
        rank,
        peer,
        expected: mine.to_string(),
        got: format!("{desc} (rank {peer} is waiting in it)"),
    })
}

/// Fail the operations that still need `peer`, which closed its transport cleanly.
pub(crate) fn fail_closed_peer(rank: usize, peer: usize, ops: &mut Ops, queues: &mut PeerQueues) {
    ops.fail_peer(peer, |ctx| Error::PeerLost {
        rank,
        peer,
        ctx: Some(Box::new(ctx)),
        detail: "the peer closed its transport (it finished or exited) while this operation \
                 still needed it"
            .into(),
    });
    queues.clear_posted();
}

/// The connection to `peer` failed (`detail` says how): its operations fail naming it; returns
/// the error to poison the transport with and the reason to tell the other peers.
pub(crate) fn peer_lost(
    rank: usize,
    peer: usize,
    ops: &mut Ops,
    detail: String,
) -> (Error, String) {
    let d2 = detail.clone();
    ops.fail_peer(peer, |ctx| Error::PeerLost {
        rank,
        peer,
        ctx: Some(Box::new(ctx)),
        detail: d2.clone(),
    });
    let reason = format!("rank {rank} lost its connection to rank {peer} ({detail})");
    (Error::PeerLost { rank, peer, ctx: None, detail }, reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{DType, Fingerprint, OpKind};

    fn desc(group: u32, seq: u64, step: u32, count: u64) -> MsgDesc {
        MsgDesc {
            tag: Tag { group, seq, step },
            fp: Fingerprint {
                op: OpKind::Allreduce,
                dtype: DType::U8,
                redop: 1,
                root: u32::MAX,
                count,
                settings: 0,
            },
        }
    }

    /// One peer's matching state (this is rank 0, the peer rank 1).
    #[derive(Default)]
    struct State {
        queues: PeerQueues,
        ops: Ops,
        unexpected: u64,
    }

    impl State {
        fn matching(&mut self) -> Matching<'_> {
            Matching {
                rank: 0,
                peer: 1,
                queues: &mut self.queues,
                ops: &mut self.ops,
                unexpected_bytes: &mut self.unexpected,
            }
        }

        /// Post a receive of `cap` bytes into `buf`; true when it stays queued.
        fn post(&mut self, d: MsgDesc, buf: &mut [u8]) -> (OpId, bool) {
            let id = self.ops.insert(1, d, buf.len(), Instant::now());
            let post = RecvPost { id, desc: d, buf: RawBuf(buf.as_mut_ptr()), cap: buf.len() };
            (id, self.matching().post_recv(post))
        }

        fn result(&mut self, id: OpId) -> Option<Result<usize>> {
            self.ops.take_finished(id)
        }
    }

    #[test]
    fn a_posted_receive_takes_its_message_and_others_wait() {
        let mut s = State::default();
        let mut buf = [0u8; 8];
        let (id, queued) = s.post(desc(0, 1, 0, 8), &mut buf);
        assert!(queued);
        // Another tag arrives first: it is unexpected and counted against the budget.
        let (l, used) = s.matching().arrive_header(&desc(0, 1, 1, 8), 4, 64, 100);
        assert!(matches!(l, Ok(Landing::Buffer)) && used == 0, "{l:?}");
        // Its own tag lands in the posted buffer.
        let (l, used) = s.matching().arrive_header(&desc(0, 1, 0, 8), 8, 64, 100);
        assert!(matches!(l, Ok(Landing::Posted { id: got, .. }) if got == id), "{l:?}");
        assert_eq!(used, 1);
    }

    #[test]
    fn an_early_message_is_delivered_when_its_receive_is_posted() {
        let mut s = State { unexpected: 3, ..State::default() };
        let used = s.matching().arrive_whole(&desc(0, 1, 0, 3), vec![7, 8, 9].into(), true);
        assert_eq!((used, s.unexpected), (0, 3));
        let mut buf = [0u8; 3];
        let (id, queued) = s.post(desc(0, 1, 0, 3), &mut buf);
        assert!(!queued);
        assert_eq!(s.unexpected, 0, "delivery gives the budget back");
        assert_eq!(s.result(id).map(|r| r.ok()), Some(Some(3)));
        assert_eq!(buf, [7, 8, 9]);
    }

    #[test]
    fn budget_big_messages_and_length_are_checked() {
        let mut s = State::default();
        // Larger than the eager size with no receive: parked, nothing buffered.
        let (l, _) = s.matching().arrive_header(&desc(0, 1, 0, 9), 1000, 64, 100);
        assert!(matches!(l, Ok(Landing::Park)), "{l:?}");
        assert_eq!(s.unexpected, 0);
        // Small ones fill the budget, then the next fails naming the peer.
        for step in 1..=2 {
            let (l, _) = s.matching().arrive_header(&desc(0, 1, step, 9), 50, 64, 100);
            assert!(matches!(l, Ok(Landing::Buffer)), "{l:?}");
        }
        let (l, _) = s.matching().arrive_header(&desc(0, 1, 3, 9), 1, 64, 100);
        match l {
            Err(Error::UnexpectedOverflow { rank: 0, peer: 1, bytes: 101, limit: 100 }) => {}
            other => panic!("{other:?}"),
        }
        // A message longer than its posted receive fails that receive and is discarded.
        let mut buf = [0u8; 4];
        let (id, _) = s.post(desc(0, 2, 0, 4), &mut buf);
        let (l, used) = s.matching().arrive_header(&desc(0, 2, 0, 4), 5, 64, 100);
        assert!(matches!(l, Ok(Landing::Discard)) && used == 1, "{l:?}");
        match s.result(id) {
            Some(Err(Error::TooLong { posted: 4, got: 5, peer: 1, .. })) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn mismatches_and_stale_receives_fail_with_both_descriptors() {
        let mut s = State::default();
        // Same tag, other fingerprint.
        let mut buf = [0u8; 4];
        let (id, _) = s.post(desc(0, 1, 0, 4), &mut buf);
        let (l, _) = s.matching().arrive_header(&desc(0, 1, 0, 5), 4, 64, 100);
        assert!(matches!(l, Ok(Landing::Discard)), "{l:?}");
        match s.result(id) {
            Some(Err(e @ Error::Mismatch { .. })) => {
                let t = e.to_string();
                assert!(t.contains("count 4") && t.contains("count 5"), "{t}");
            }
            other => panic!("{other:?}"),
        }
        // The peer already moved on to a later collective of the group: the waiting receive
        // can never match and fails at once.
        let mut buf = [0u8; 4];
        let (id, _) = s.post(desc(0, 2, 0, 4), &mut buf);
        let (l, used) = s.matching().arrive_header(&desc(0, 3, 0, 4), 4, 64, 100);
        assert!(matches!(l, Ok(Landing::Buffer)) && used == 1, "{l:?}");
        match s.result(id) {
            Some(Err(e @ Error::Mismatch { .. })) => {
                assert!(e.to_string().contains("moved on"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        // Its payload arrives and waits in the unexpected queue; a receive of the older
        // collective posted now fails on posting.
        s.matching().arrive_whole(&desc(0, 3, 0, 4), vec![1, 2, 3, 4].into(), true);
        let mut buf = [0u8; 4];
        let (id, queued) = s.post(desc(0, 2, 1, 4), &mut buf);
        assert!(!queued);
        assert!(matches!(s.result(id), Some(Err(Error::Mismatch { .. }))));
        // Point-to-point tags have no order: no staleness there.
        let p2p = P2P_GROUP_BIT | 5;
        let mut buf = [0u8; 4];
        let (_, queued) = s.post(desc(p2p, 1, 0, 4), &mut buf);
        let (l, _) = s.matching().arrive_header(&desc(p2p, 9, 0, 4), 4, 64, 1000);
        assert!(queued && matches!(l, Ok(Landing::Buffer)), "{l:?}");
    }
}
