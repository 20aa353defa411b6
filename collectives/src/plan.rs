//! Schedules: an algorithm is a pure function from (rank, world, sizes) to a [`Plan`], a list of
//! sends, receives, waits and local reductions over byte regions. One executor runs every plan
//! over the transport (see `exec.rs`); tests run plans symbolically to count bytes and steps and
//! to prove that every send has its receive.

/// Which buffer a region lies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The user's output (or in-place) buffer.
    Data,
    /// The user's separate input buffer (read-only); only in out-of-place calls.
    Input,
    /// Executor-allocated scratch buffer number `k`.
    Scratch(u16),
}

/// A byte range of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// The buffer.
    pub buf: Buf,
    /// Offset in bytes.
    pub off: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Region {
    /// A region of `buf`.
    pub fn new(buf: Buf, off: usize, len: usize) -> Region {
        Region { buf, off, len }
    }

    /// Do two regions share a byte?
    pub fn overlaps(&self, o: &Region) -> bool {
        self.buf == o.buf
            && self.len > 0
            && o.len > 0
            && self.off < o.off + o.len
            && o.off < self.off + self.len
    }

    /// The sub-range `[off, off+len)` of this region.
    pub fn sub(&self, off: usize, len: usize) -> Region {
        Region { buf: self.buf, off: self.off + off, len }
    }
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Post a send of `region` to group rank `peer` under tag step `tag`.
    Send {
        /// Destination (group rank).
        peer: usize,
        /// Tag step.
        tag: u32,
        /// What to send.
        region: Region,
    },
    /// Post a receive into `region` from `peer` under `tag`.
    Recv {
        /// Source (group rank).
        peer: usize,
        /// Tag step.
        tag: u32,
        /// Where it lands.
        region: Region,
    },
    /// Wait for the send or receive with this handle (its index among posts).
    Wait(usize),
    /// Wait for every outstanding send and receive.
    WaitAll,
    /// `dst = a op b`, elementwise.
    Reduce {
        /// Destination.
        dst: Region,
        /// Left operand (may equal `dst`).
        a: Region,
        /// Right operand.
        b: Region,
    },
    /// `dst = src`.
    Copy {
        /// Destination.
        dst: Region,
        /// Source.
        src: Region,
        /// Write `dst` with non-temporal stores, around the caches (see [`Plan::copy_out`]).
        stream: bool,
    },
    /// Apply the call's finishing transform (the division of `Avg`, the factor of a scaled
    /// allreduce) to a region whose reduction is complete: an algorithm that owns each block of
    /// the result once (the ring, between its reduce-scatter and its all-gather) finishes only
    /// that block, and the all-gather spreads it. Plans without one are finished whole after
    /// they ran.
    Finish(Region),
}

/// Copies of at least this many bytes stream ([`Plan::copy`]): half the last-level cache of the
/// machines tutti is measured on, which two ranks share.
pub const STREAM_MIN: usize = 16 << 20;
/// A result's final place of at least this many bytes is written by streaming copies
/// ([`Plan::copy_out`]): the size at which exchanges go in pieces, whose copies are 1 MiB each.
pub const STREAM_OUT_MIN: usize = 4 << 20;

/// A schedule for one rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Steps in program order.
    pub steps: Vec<Step>,
    /// Sizes of the scratch buffers, in bytes.
    pub scratch: Vec<usize>,
    /// Number of posts (sends plus receives) = number of handles.
    pub posts: usize,
    /// Whether the plan finishes the result itself ([`Step::Finish`]).
    pub finishes: bool,
}

impl Plan {
    /// An empty plan.
    pub fn new() -> Plan {
        Plan::default()
    }

    /// Declare a scratch buffer of `len` bytes.
    pub fn scratch(&mut self, len: usize) -> Buf {
        self.scratch.push(len);
        Buf::Scratch((self.scratch.len() - 1) as u16)
    }

    /// Post a send; returns its handle. Empty regions are skipped (both sides skip them).
    pub fn send(&mut self, peer: usize, tag: u32, region: Region) -> Option<usize> {
        if region.len == 0 {
            return None;
        }
        self.steps.push(Step::Send { peer, tag, region });
        self.posts += 1;
        Some(self.posts - 1)
    }

    /// Post a receive; returns its handle. Empty regions are skipped.
    pub fn recv(&mut self, peer: usize, tag: u32, region: Region) -> Option<usize> {
        if region.len == 0 {
            return None;
        }
        self.steps.push(Step::Recv { peer, tag, region });
        self.posts += 1;
        Some(self.posts - 1)
    }

    /// Wait for a handle (nothing for a skipped post).
    pub fn wait(&mut self, h: Option<usize>) {
        if let Some(h) = h {
            self.steps.push(Step::Wait(h));
        }
    }

    /// Wait for everything outstanding.
    pub fn wait_all(&mut self) {
        self.steps.push(Step::WaitAll);
    }

    /// `dst = a op b`.
    pub fn reduce(&mut self, dst: Region, a: Region, b: Region) {
        if dst.len > 0 {
            self.steps.push(Step::Reduce { dst, a, b });
        }
    }

    /// `dst = src` (nothing when they are the same region). A copy of at least [`STREAM_MIN`]
    /// bytes streams (see [`Step::Copy`]): that much cannot stay in the caches anyway, and
    /// written through them it would push out what can.
    pub fn copy(&mut self, dst: Region, src: Region) {
        self.copy_as(dst, src, dst.len >= STREAM_MIN);
    }

    /// `dst = src` where `dst` is a piece of a result's final place of `whole` bytes that the
    /// rest of the plan never reads: it streams when `whole` is at least [`STREAM_OUT_MIN`].
    pub fn copy_out(&mut self, dst: Region, src: Region, whole: usize) {
        self.copy_as(dst, src, whole >= STREAM_OUT_MIN);
    }

    fn copy_as(&mut self, dst: Region, src: Region, stream: bool) {
        if dst.len > 0 && dst != src {
            self.steps.push(Step::Copy { dst, src, stream });
        }
    }

    /// Finish `region` (see [`Step::Finish`]); the plan then finishes the result itself.
    pub fn finish(&mut self, region: Region) {
        self.finishes = true;
        if region.len > 0 {
            self.steps.push(Step::Finish(region));
        }
    }

    /// The plan with every peer `v` replaced by `map[v]`: a plan built for position `v` of a
    /// sub-group or of a reordered ring, run by the group ranks `map` names.
    ///
    /// # Panics
    /// If a peer is outside `map` (a bug in the caller: `map` lists every position).
    pub fn relabel(mut self, map: &[usize]) -> Plan {
        for st in &mut self.steps {
            if let Step::Send { peer, .. } | Step::Recv { peer, .. } = st {
                *peer = map[*peer];
            }
        }
        self
    }

    /// Apply `f` to every region the steps from index `start` on name.
    fn regions_from(&mut self, start: usize, mut f: impl FnMut(&mut Region)) {
        for st in &mut self.steps[start..] {
            match st {
                Step::Send { region, .. } | Step::Recv { region, .. } => f(region),
                Step::Reduce { dst, a, b } => {
                    f(dst);
                    f(a);
                    f(b);
                }
                Step::Copy { dst, src, .. } => {
                    f(dst);
                    f(src);
                }
                Step::Finish(region) => f(region),
                Step::Wait(_) | Step::WaitAll => {}
            }
        }
    }

    /// The plan with every region of the data buffer moved `off` bytes on: a plan over
    /// `[off, off + len)` of the data buffer built as if that range were the whole buffer.
    pub fn shift_data(mut self, off: usize) -> Plan {
        self.regions_from(0, |r| {
            if r.buf == Buf::Data {
                r.off += off;
            }
        });
        self
    }

    /// Replace buffer `from` by `to` in every step from index `start` on: a phase built over
    /// the user's buffers that runs on a scratch buffer instead.
    pub fn map_buf(&mut self, start: usize, from: Buf, to: Buf) {
        self.regions_from(start, |r| {
            if r.buf == from {
                r.buf = to;
            }
        });
    }

    /// Total bytes this plan sends.
    pub fn bytes_sent(&self) -> u64 {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Send { region, .. } => region.len as u64,
                _ => 0,
            })
            .sum()
    }
}

/// Split `count` elements of `esize` bytes into `n` nearly equal blocks; returns byte (offset,
/// length) per block. The first `count % n` blocks have one element more.
pub fn split(count: usize, n: usize, esize: usize) -> Vec<(usize, usize)> {
    let base = count / n;
    let extra = count % n;
    let mut off = 0;
    (0..n)
        .map(|i| {
            let len = (base + usize::from(i < extra)) * esize;
            let r = (off, len);
            off += len;
            r
        })
        .collect()
}

/// Byte (offset, length) blocks from per-rank element counts.
pub fn blocks_from_counts(counts: &[usize], esize: usize) -> Vec<(usize, usize)> {
    let mut off = 0;
    counts
        .iter()
        .map(|c| {
            let r = (off, c * esize);
            off += c * esize;
            r
        })
        .collect()
}

/// Segments of `len` bytes: (offset, length) pieces of at most `seg` bytes, element aligned.
pub fn segments(len: usize, seg: usize, esize: usize) -> Vec<(usize, usize)> {
    let seg = (seg / esize).max(1) * esize;
    if len == 0 {
        return Vec::new();
    }
    (0..len.div_ceil(seg)).map(|i| (i * seg, seg.min(len - i * seg))).collect()
}

/// Largest power of two not above `n` (n ≥ 1).
pub fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// What a symbolic run of one plan per rank found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimResult {
    /// Bytes sent by each rank.
    pub bytes_sent: Vec<u64>,
    /// Messages sent by each rank.
    pub messages: Vec<usize>,
    /// Length of the longest chain of dependent messages (steps on the critical path).
    pub critical_steps: u64,
}

/// Run one plan per rank symbolically, in lockstep: sends are eager, a wait on a receive blocks
/// until the matching send was posted. Proves that every send has its receive (same peer, tag
/// and length), that nothing deadlocks, and measures bytes and the critical path.
///
/// # Errors
/// A description of the first deadlock, unmatched message or length disagreement.
pub fn simulate(plans: &[Plan]) -> Result<SimResult, String> {
    use std::collections::{HashMap, VecDeque};
    /// Messages in flight: (src, dst, tag) -> queue of (send time, length).
    type Wire = HashMap<(usize, usize, u32), VecDeque<(u64, usize)>>;
    let n = plans.len();
    let mut wire: Wire = HashMap::new();
    let mut pc = vec![0usize; n];
    let mut clock = vec![0u64; n];
    // Per rank, per handle: Some((src, tag, len)) for a pending receive; None once done/sends.
    let mut pending: Vec<Vec<Option<(usize, u32, usize)>>> =
        plans.iter().map(|p| vec![None; p.posts]).collect();
    let mut next_handle = vec![0usize; n];
    let mut done = vec![false; n];
    let mut bytes = vec![0u64; n];
    let mut msgs = vec![0usize; n];
    let try_complete = |wire: &mut Wire,
                        me: usize,
                        h: &mut Option<(usize, u32, usize)>,
                        clock: &mut u64|
     -> Result<bool, String> {
        let Some((src, tag, len)) = *h else { return Ok(true) };
        let q = wire.entry((src, me, tag)).or_default();
        match q.pop_front() {
            Some((ts, l)) => {
                if l != len {
                    return Err(format!(
                        "rank {me} receives {len} bytes from {src} tag {tag}, {l} sent"
                    ));
                }
                *clock = (*clock).max(ts + 1);
                *h = None;
                Ok(true)
            }
            None => Ok(false),
        }
    };
    loop {
        let mut progress = false;
        for r in 0..n {
            if done[r] {
                continue;
            }
            loop {
                let Some(step) = plans[r].steps.get(pc[r]) else {
                    // Implicit final wait-all.
                    let mut all = true;
                    for h in pending[r].iter_mut() {
                        all &= try_complete(&mut wire, r, h, &mut clock[r])?;
                    }
                    if all {
                        done[r] = true;
                        progress = true;
                    }
                    break;
                };
                let advanced = match step {
                    Step::Send { peer, tag, region } => {
                        wire.entry((r, *peer, *tag)).or_default().push_back((clock[r], region.len));
                        bytes[r] += region.len as u64;
                        msgs[r] += 1;
                        next_handle[r] += 1;
                        true
                    }
                    Step::Recv { peer, tag, region } => {
                        pending[r][next_handle[r]] = Some((*peer, *tag, region.len));
                        next_handle[r] += 1;
                        true
                    }
                    Step::Wait(h) => {
                        let mut slot = pending[r][*h];
                        let ok = try_complete(&mut wire, r, &mut slot, &mut clock[r])?;
                        pending[r][*h] = slot;
                        ok
                    }
                    Step::WaitAll => {
                        let mut all = true;
                        for h in pending[r].iter_mut() {
                            all &= try_complete(&mut wire, r, h, &mut clock[r])?;
                        }
                        all
                    }
                    Step::Reduce { .. } | Step::Copy { .. } | Step::Finish(_) => true,
                };
                if !advanced {
                    break;
                }
                pc[r] += 1;
                progress = true;
            }
        }
        if done.iter().all(|d| *d) {
            break;
        }
        if !progress {
            let blocked: Vec<usize> = (0..n).filter(|r| !done[*r]).collect();
            return Err(format!(
                "deadlock: ranks {blocked:?} blocked at steps {:?}",
                blocked.iter().map(|r| pc[*r]).collect::<Vec<_>>()
            ));
        }
    }
    if let Some(((s, d, t), q)) = wire.iter().find(|(_, q)| !q.is_empty()) {
        return Err(format!("{} message(s) from {s} to {d} tag {t} never received", q.len()));
    }
    Ok(SimResult {
        bytes_sent: bytes,
        messages: msgs,
        critical_steps: clock.into_iter().max().unwrap_or(0),
    })
}
