//! Direct reads: collectives among the ranks of one host that read each other's memory instead
//! of sending it (`Algo::Direct`).
//!
//! Every rank of the group maps every other rank's [`Window`] (shared memory, set up once per
//! group at its first direct call: an all-gather of the offers over the group's authenticated
//! links, then an agreement that every rank attached every window). A call runs in
//! *generations* of at most one window buffer each; every rank counts the same generations, and
//! each window has two buffers, used by turns. In generation `g`, on buffer `g mod 2`:
//!
//! 1. **Free**: wait until every peer has *done* generation `g − 2` (it finished reading this
//!    buffer the last time).
//! 2. **Post**: stamp the buffer (the call's descriptor: group, sequence number, op, dtype,
//!    count, root, settings; and `g`), then copy this rank's contribution in, publishing
//!    *posted* = `g`·2³² + the bytes written so far (every 64 KiB where each rank has a core).
//! 3. **Read** what the collective needs from the peers' buffers once their *posted* covers it,
//!    after checking their stamps (a different call is a named mismatch). An allreduce reduces
//!    its own slice straight out of every buffer, in rank order, writes the result back into its
//!    own buffer and publishes *reduced* = `g`; every rank then copies the other slices as their
//!    owners publish them. Each slice is reduced once, by one rank, so every rank ends with the
//!    same bits.
//! 4. **Done**: publish *done* = `g`.
//!
//! Per generation an allreduce moves `S` into the window, reads `S` to reduce `S/n` and copies
//! `S` out: no byte crosses a socket or a ring, and no rank forwards another's data. Waits spin
//! briefly and then sleep on the peer's window; between sleeps they ask the transport whether
//! the group failed and apply the dead-peer rule to the peer waited for
//! (`Transport::check_peer`), and give up at the call's deadline with a timeout that names the
//! peer and the generation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tutti_runtime::window::{Offer, Window, OFFER_LEN};
use tutti_runtime::wire::{Fingerprint, Header, MsgDesc, Tag, HEADER_LEN};
use tutti_runtime::{Error as RtError, OpContext};

use crate::coll::Coll;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::kernel::{self, Finish};
use crate::plan::split;

/// Counters of a window.
const POSTED: usize = 0;
const REDUCED: usize = 1;
const DONE: usize = 2;
/// *Posted* counts generations in units of this, plus the bytes posted so far in the current
/// one: a reader may copy the first pieces of a buffer while its owner writes the rest.
const GEN: u64 = 1 << 32;
/// Bytes between two publications of *posted* where every rank has a core of its own; with
/// fewer cores than ranks a buffer is posted whole (a reader that waits on each piece would
/// sleep and be woken for each).
const PIECE: usize = 64 << 10;
/// Allreduces whose n buffers together hold at most this many bytes run in one phase: every
/// rank reduces everything, which reads n times its buffer but waits once instead of twice.
const ONE_PHASE: usize = 16 << 10;

/// Bytes of one buffer of a window for a group of `n` ranks: 1 MiB up to 128 ranks, then the
/// largest power of two at most 128 MiB / n (at least 64 KiB). Each rank's window holds two
/// buffers and a 4 KiB header, so a group's windows on one host hold at most
/// `n × (4 KiB + 2 × buffer)`: 8 MiB at 4 ranks, 128 MiB at 64, 256 MiB at most up to 2,048
/// ranks. Only the pages a call touches are allocated.
pub(crate) fn buffer_for(n: usize) -> usize {
    (1usize << ((128usize << 20) / n.max(1)).max(1).ilog2()).clamp(64 << 10, 1 << 20)
}

/// What a group's direct reads hold: every rank's window (this rank's own at its rank) and the
/// generations run so far.
pub(crate) struct Direct {
    me: usize,
    wins: Vec<Window>,
    gen: u64,
    /// How long a wait spins before it sleeps.
    spin: Duration,
    /// Bytes between two publications of *posted* ([`PIECE`], or a whole buffer).
    piece: usize,
}

/// Where a communicator's direct reads stand.
#[derive(Default)]
pub(crate) enum State {
    /// Not tried yet.
    #[default]
    Unknown,
    /// Set up on every rank.
    Ready(Box<Direct>),
    /// Not possible in this group (some rank could not make or map a window); the reason.
    Off(String),
}

/// One direct call: the group, this rank's descriptor for it, its deadline.
pub(crate) struct Call<'a> {
    pub(crate) group: &'a tutti_runtime::Group,
    pub(crate) op_name: &'static str,
    pub(crate) desc: MsgDesc,
    pub(crate) start: Instant,
    pub(crate) deadline: Instant,
    pub(crate) bytes: usize,
}

impl Call<'_> {
    fn global(&self, r: usize) -> usize {
        self.group.global_rank(r)
    }

    fn ctx(&self, step: u64, done: usize) -> Box<OpContext> {
        Box::new(OpContext {
            op: self.desc.fp.op,
            group: self.desc.tag.group,
            seq: self.desc.tag.seq,
            step: step as u32,
            bytes_done: done as u64,
            bytes: self.bytes as u64,
            elapsed: self.start.elapsed(),
        })
    }
}

/// The offer record each rank contributes at set-up: whether it can take part, then its offer.
const RECORD: usize = 1 + OFFER_LEN;

impl Direct {
    /// Set up direct reads over `group` (every rank calls it at the same call): make this
    /// rank's window, all-gather the offers with `allgather`, attach every peer's, and agree
    /// with `agree` (a maximum over the group) that every rank did. Returns the state every
    /// rank then shares: ready, or off with the reason.
    ///
    /// # Errors
    /// The exchange's errors (a lost peer, named).
    pub(crate) fn setup(
        group: &tutti_runtime::Group,
        allgather: impl FnOnce(&[u8], &mut [u8]) -> Result<()>,
        agree: impl FnOnce(f64) -> Result<f64>,
    ) -> Result<State> {
        let (n, me) = (group.size(), group.rank());
        let t = group.transport();
        // Every rank reads every other's window: connect the links that were not needed yet
        // (a transport that connects on first use), so each link says how it travels.
        let globals: Vec<usize> = (0..n).map(|r| group.global_rank(r)).collect();
        t.connect_peers(&globals, group.timeout())?;
        let apart = (0..n)
            .map(|r| group.global_rank(r))
            .find(|&g| g != t.rank() && !t.shares_memory_with(g));
        let made = match apart {
            Some(g) => Err(format!("rank {g} does not share memory with rank {}", t.rank())),
            None => Window::create(2 * buffer_for(n)).map_err(|e| e.to_string()),
        };
        let mut mine = [0u8; RECORD];
        if let Ok((_, offer)) = &made {
            mine[0] = 1;
            mine[1..].copy_from_slice(&offer.encode());
        }
        let mut all = vec![0u8; RECORD * n];
        allgather(&mine, &mut all)?;
        let mut why = made.as_ref().err().cloned();
        let mut wins = Vec::with_capacity(n);
        if let Ok((own, _)) = made {
            for (r, rec) in all.chunks(RECORD).enumerate() {
                if r == me {
                    continue;
                }
                let w = if rec[0] == 1 {
                    Offer::decode(&rec[1..]).map_err(|e| e.to_string()).and_then(|o| {
                        // Every window alike: offsets in a peer's are computed from ours.
                        if o.data_len as usize == own.data_len() {
                            Window::attach(&o).map_err(|e| e.to_string())
                        } else {
                            Err(format!(
                                "rank {}'s window holds {} bytes, ours {}",
                                group.global_rank(r),
                                o.data_len,
                                own.data_len()
                            ))
                        }
                    })
                } else {
                    Err(format!("rank {} has no window", group.global_rank(r)))
                };
                match w {
                    Ok(w) => wins.push(w),
                    Err(e) => {
                        why.get_or_insert(e);
                        break;
                    }
                }
            }
            wins.insert(me.min(wins.len()), own);
        }
        // Every rank learns whether any could not attach: all go direct or none does.
        let failed = agree(if why.is_some() { 1.0 } else { 0.0 })?;
        if failed > 0.0 || wins.len() != n {
            let why = why.unwrap_or_else(|| "another rank could not map every window".into());
            tracing::debug!(rank = me, "no direct reads in this group: {why}");
            return Ok(State::Off(why));
        }
        // Every rank has attached every window: no descriptor needs to stay open.
        wins[me].seal_attachments();
        let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
        let (spin, piece) = if cpus >= n {
            (Duration::from_micros(50), PIECE)
        } else {
            (Duration::from_micros(5), usize::MAX)
        };
        Ok(State::Ready(Box::new(Direct { me, wins, gen: 0, spin, piece })))
    }

    /// Bytes of one buffer.
    fn buf_len(&self) -> usize {
        self.wins[self.me].data_len() / 2
    }

    fn buf(&self, r: usize, b: usize) -> *mut u8 {
        // SAFETY: buffer `b` (0 or 1) lies inside window `r`'s data.
        unsafe { self.wins[r].data().add(b * self.buf_len()) }
    }

    fn next(&mut self) -> (u64, usize) {
        self.gen += 1;
        (self.gen, (self.gen % 2) as usize)
    }

    /// Wait until rank `r`'s `counter` reaches `at_least` (a timeout names `r`, the generation
    /// and the bytes `done`).
    fn wait(
        &self,
        call: &Call<'_>,
        r: usize,
        counter: usize,
        at_least: u64,
        done: usize,
    ) -> Result<()> {
        // Between sleeps: the transport's failure, and the dead-peer rule for the rank waited
        // for (nothing is posted to it, so no operation applies the rule).
        let (t, peer, since) = (call.group.transport(), call.global(r), Instant::now());
        let check = || t.check_peer(peer, since);
        match self.wins[r].wait(counter, at_least, call.deadline, self.spin, check) {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(Error::Runtime(RtError::Timeout {
                rank: call.global(self.me),
                peer: call.global(r),
                ctx: call.ctx(self.gen, done),
                timeout: call.group.timeout(),
            })),
            Err(e) => Err(Error::Runtime(e)),
        }
    }

    /// Step 1 of generation `g` and the start of step 2: wait until buffer `b` is free, stamp
    /// it and publish that nothing is posted yet; [`Direct::progress`] publishes the bytes.
    fn begin(&self, call: &Call<'_>, g: u64, b: usize, done: usize) -> Result<()> {
        if g > 2 {
            for r in self.peers() {
                self.wait(call, r, DONE, g - 2, done)?;
            }
        }
        let stamp = Header::data(call.desc, call.global(self.me), g as usize).encode();
        // SAFETY: our own window's stamp slot, HEADER_LEN ≤ STAMP_BYTES; peers read it only
        // after the publish below.
        unsafe {
            std::ptr::copy_nonoverlapping(stamp.as_ptr(), self.wins[self.me].stamp(b), HEADER_LEN)
        };
        self.wins[self.me].publish(POSTED, g * GEN);
        Ok(())
    }

    /// The first `bytes` of our buffer hold generation `g`'s data.
    fn progress(&self, g: u64, bytes: usize) {
        self.wins[self.me].publish(POSTED, g * GEN + bytes as u64);
    }

    /// Write `len` bytes into our buffer `b` of generation `g` with `fill(offset, len)`, piece
    /// by piece, publishing each.
    fn fill(&self, g: u64, b: usize, len: usize, mut fill: impl FnMut(*mut u8, usize, usize)) {
        let mut at = 0;
        while at < len {
            let l = self.piece.min(len - at);
            // SAFETY: inside our own buffer.
            fill(unsafe { self.buf(self.me, b).add(at) }, at, l);
            at += l;
            self.progress(g, at);
        }
    }

    /// Step 3's first half for peer `r`: wait until it posted the first `need` bytes of
    /// generation `g` and check that it posted the same call.
    fn posted(
        &self,
        call: &Call<'_>,
        r: usize,
        g: u64,
        b: usize,
        need: usize,
        done: usize,
    ) -> Result<()> {
        // The stamp as soon as the peer began the generation (a call of another length is named
        // as a mismatch, not waited for), then the bytes.
        self.wait(call, r, POSTED, g * GEN, done)?;
        let mut raw = [0u8; HEADER_LEN];
        // SAFETY: the peer's stamp slot, written before it published `g`; it does not write it
        // again before we publish *done* = `g`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.wins[r].stamp(b), raw.as_mut_ptr(), HEADER_LEN)
        };
        let (me, peer) = (call.global(self.me), call.global(r));
        match Header::decode(&raw) {
            Ok(h) if h.desc == call.desc && h.len == g && h.src as usize == peer => {
                if need > 0 {
                    self.wait(call, r, POSTED, g * GEN + need as u64, done)?;
                }
                Ok(())
            }
            Ok(h) if h.desc != call.desc => Err(Error::Runtime(RtError::Mismatch {
                rank: me,
                peer,
                expected: call.desc.to_string(),
                got: h.desc.to_string(),
            })),
            Ok(h) => Err(Error::Runtime(RtError::Protocol {
                rank: me,
                peer,
                detail: format!(
                    "its window holds generation {} from rank {} in {}, expected generation {g} \
                     from rank {peer}",
                    h.len, h.src, call.op_name
                ),
            })),
            Err(e) => Err(Error::Runtime(RtError::Protocol {
                rank: me,
                peer,
                detail: format!("its window's stamp in {} is not a descriptor: {e}", call.op_name),
            })),
        }
    }

    fn finish(&self, g: u64) {
        self.wins[self.me].publish(DONE, g);
    }

    /// `out` = the `out.len()` bytes at `at` of buffer `b` of every window reduced with `op`,
    /// rank 0's first and then every other rank's in rank order, so that whichever rank does it
    /// gets the same bits.
    ///
    /// # Safety
    /// Every window's bytes there are posted and not written before we publish *done*; `out`
    /// does not overlap any window.
    unsafe fn reduce_from(&self, b: usize, at: usize, out: &mut [u8], dtype: DType, op: ReduceOp) {
        // SAFETY: forwarded contract.
        unsafe {
            std::ptr::copy_nonoverlapping(self.buf(0, b).add(at), out.as_mut_ptr(), out.len());
            for r in 1..self.wins.len() {
                let theirs = std::slice::from_raw_parts(self.buf(r, b).add(at), out.len());
                kernel::reduce_into(dtype, op, out, theirs);
            }
        }
    }

    /// The peers, in rank order.
    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.wins.len()).filter(|r| *r != self.me)
    }

    /// Allreduce of `len` bytes of `dtype` from `src` into `dst` (the same address in place).
    ///
    /// # Safety
    /// `src..src+len` readable and `dst..dst+len` writable for the call; when they differ they
    /// do not overlap.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn allreduce(
        &mut self,
        call: &Call<'_>,
        src: *const u8,
        dst: *mut u8,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        finish: Option<Finish>,
    ) -> Result<()> {
        let (n, es) = (self.wins.len(), dtype.size());
        if len * n <= ONE_PHASE {
            // Small: every rank reduces the whole buffer out of every window, in rank order
            // (the same bits everywhere), with one wait instead of two.
            let (g, b) = self.next();
            self.begin(call, g, b, 0)?;
            // SAFETY: `len` bytes of the caller's source into our own free buffer.
            unsafe { std::ptr::copy_nonoverlapping(src, self.buf(self.me, b), len) };
            self.progress(g, len);
            for r in self.peers() {
                self.posted(call, r, g, b, len, 0)?;
            }
            // SAFETY: every buffer posted `len` bytes, not written again before we publish
            // *done*; `dst` is the caller's, and its input is already in our buffer.
            unsafe {
                let out = std::slice::from_raw_parts_mut(dst, len);
                self.reduce_from(b, 0, out, dtype, op);
                if let Some(f) = finish {
                    kernel::finish_raw(dtype, f, out.as_mut_ptr(), len);
                }
            }
            self.finish(g);
            return Ok(());
        }
        let piece = self.buf_len() / es * es;
        // One generation at least: a call of nothing still checks that the peers make it.
        for off in (0..len.div_ceil(piece).max(1)).map(|k| k * piece) {
            let l = piece.min(len - off);
            let (g, b) = self.next();
            self.begin(call, g, b, off)?;
            // SAFETY: `l` bytes of the caller's source into our own free buffer.
            self.fill(g, b, l, |w, at, k| unsafe {
                std::ptr::copy_nonoverlapping(src.add(off + at), w, k)
            });
            let slices = split(l / es, n, es);
            let (so, sl) = slices[self.me];
            for r in self.peers() {
                self.posted(call, r, g, b, so + sl, off)?;
            }
            // Our slice, reduced from every buffer.
            // SAFETY: `dst + off + so` is ours to write (inside the caller's range); every
            // buffer's slice `so` was posted by its owner and is not written before we publish
            // *done* (ours: only by us, below).
            unsafe {
                let out = std::slice::from_raw_parts_mut(dst.add(off + so), sl);
                self.reduce_from(b, so, out, dtype, op);
                if let Some(f) = finish {
                    kernel::finish_raw(dtype, f, out.as_mut_ptr(), sl);
                }
                std::ptr::copy_nonoverlapping(out.as_ptr(), self.buf(self.me, b).add(so), sl);
            }
            self.wins[self.me].publish(REDUCED, g);
            for r in self.peers() {
                self.wait(call, r, REDUCED, g, off)?;
                let (ro, rl) = slices[r];
                // SAFETY: rank `r`'s reduced slice, published; ours to copy into our range.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.buf(r, b).add(ro), dst.add(off + ro), rl)
                };
            }
            self.finish(g);
        }
        Ok(())
    }

    /// Broadcast of `len` bytes from group rank `root`: the root reads `src`, every rank
    /// (the root too, when `src` differs) writes `dst`.
    ///
    /// # Safety
    /// As [`Direct::allreduce`] (`src` is read on the root only).
    pub(crate) unsafe fn broadcast(
        &mut self,
        call: &Call<'_>,
        root: usize,
        src: *const u8,
        dst: *mut u8,
        len: usize,
    ) -> Result<()> {
        let piece = self.buf_len();
        // One generation at least: a call of nothing still checks that the peers make it.
        for off in (0..len.div_ceil(piece).max(1)).map(|k| k * piece) {
            let l = piece.min(len - off);
            let (g, b) = self.next();
            // Every rank stamps its buffer, so that the root too learns of a peer that makes
            // another call (another root, say), in the call's first generation.
            self.begin(call, g, b, off)?;
            if self.me == root {
                // SAFETY: the caller's bytes into our own free buffer, and to its output when
                // out of place.
                self.fill(g, b, l, |w, at, k| unsafe {
                    std::ptr::copy_nonoverlapping(src.add(off + at), w, k);
                    if !std::ptr::eq(src, dst) {
                        std::ptr::copy_nonoverlapping(src.add(off + at), dst.add(off + at), k);
                    }
                });
                if off == 0 {
                    for r in self.peers() {
                        self.posted(call, r, g, b, 0, off)?;
                    }
                }
            } else {
                self.posted(call, root, g, b, 0, off)?;
                // Each piece as soon as the root has posted it.
                let mut at = 0;
                while at < l {
                    let k = self.piece.min(l - at);
                    self.posted(call, root, g, b, at + k, off + at)?;
                    // SAFETY: the root's posted bytes into our output.
                    unsafe { kernel::copy_stream(dst.add(off + at), self.buf(root, b).add(at), k) };
                    at += k;
                }
            }
            self.finish(g);
        }
        Ok(())
    }

    /// Gathering moves of uniform blocks of `block` bytes, in pieces: all-gather (`Gather`),
    /// all-to-all (`Exchange`), reduce-scatter (`Reduce`). `src` and `dst` as the collective's
    /// input and data buffers (the same address in place).
    ///
    /// # Safety
    /// As [`Direct::allreduce`], with the collective's lengths: `dst` holds `n` blocks
    /// (one for an out-of-place reduce-scatter), `src` one block for an out-of-place all-gather
    /// and `n` otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn blocks(
        &mut self,
        call: &Call<'_>,
        coll: Coll,
        src: *const u8,
        dst: *mut u8,
        block: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me, es) = (self.wins.len(), self.me, dtype.size());
        let in_place = std::ptr::eq(src, dst);
        // Per generation: one piece of our block (all-gather), or of each of the n blocks.
        let per = if coll == Coll::Allgather { self.buf_len() } else { self.buf_len() / n };
        let piece = (per / es * es).max(es);
        // Where block k of what we send starts, and where block k of what we receive goes.
        let ours = |k: usize| match (coll, in_place) {
            (Coll::Allgather, false) => 0,
            _ => k * block,
        };
        // One generation at least: a call of nothing still checks that the peers make it.
        for off in (0..block.div_ceil(piece).max(1)).map(|k| k * piece) {
            let l = piece.min(block - off);
            let (g, b) = self.next();
            self.begin(call, g, b, off)?;
            if coll == Coll::Allgather {
                // Piece by piece: ours posted, then each peer's copied as soon as it is posted.
                let mut at = 0;
                while at < l {
                    let k = self.piece.min(l - at);
                    let mine = self.buf(me, b);
                    // SAFETY: our input's piece into our own free buffer; then posted pieces
                    // of every buffer into our output's blocks at this offset (ours too when
                    // out of place).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.add(ours(me) + off + at),
                            mine.add(at),
                            k,
                        );
                        self.progress(g, at + k);
                        if !in_place {
                            std::ptr::copy_nonoverlapping(
                                mine.add(at),
                                dst.add(me * block + off + at),
                                k,
                            );
                        }
                    }
                    for r in self.peers() {
                        self.posted(call, r, g, b, at + k, off + at)?;
                        // SAFETY: as above.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                self.buf(r, b).add(at),
                                dst.add(r * block + off + at),
                                k,
                            )
                        };
                    }
                    at += k;
                }
                if l == 0 {
                    // A call of nothing: still check that the peers make the same call.
                    for r in self.peers() {
                        self.posted(call, r, g, b, 0, off)?;
                    }
                }
                self.finish(g);
                continue;
            }
            // All-to-all and reduce-scatter: a piece of each of the n blocks, posted at once.
            // SAFETY: pieces of the caller's input into our own free buffer.
            unsafe {
                let w = self.buf(me, b);
                for k in 0..n {
                    std::ptr::copy_nonoverlapping(src.add(ours(k) + off), w.add(k * piece), l);
                }
            }
            self.progress(g, n * piece);
            for r in self.peers() {
                self.posted(call, r, g, b, me * piece + l, off)?;
            }
            // SAFETY: every read is of a posted piece; every write inside the caller's output
            // at this generation's offset (the input's pieces there were posted already).
            unsafe {
                match coll {
                    Coll::AllToAll => {
                        for r in 0..n {
                            let from = self.buf(r, b).add(me * piece);
                            std::ptr::copy_nonoverlapping(from, dst.add(r * block + off), l);
                        }
                    }
                    _ => {
                        let at = if in_place { me * block } else { 0 };
                        let out = std::slice::from_raw_parts_mut(dst.add(at + off), l);
                        self.reduce_from(b, me * piece, out, dtype, op);
                    }
                }
            }
            self.finish(g);
        }
        Ok(())
    }
}

/// The descriptor of a direct call: its tag (step 0) and fingerprint.
pub(crate) fn desc(group: u32, seq: u64, fp: Fingerprint) -> MsgDesc {
    MsgDesc { tag: Tag { group, seq, step: 0 }, fp }
}

/// Keeps the windows of a communicator and its clones.
pub(crate) type Shared = Arc<std::sync::Mutex<State>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_keep_a_group_under_its_bound() {
        for n in [1, 2, 3, 4, 8, 64, 100, 128, 129, 256, 1000, 2048] {
            let b = buffer_for(n);
            assert!(b.is_power_of_two() && (64 << 10..=1 << 20).contains(&b), "{n}: {b}");
            assert!(n * (4096 + 2 * b) <= (256 << 20) + n * 4096, "{n} ranks: {b}");
        }
        assert_eq!(buffer_for(4), 1 << 20);
        assert_eq!(buffer_for(256), 512 << 10);
    }
}
