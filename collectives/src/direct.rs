//! Direct reads: collectives among the ranks of one host that read each other's memory instead
//! of sending it (`Algo::Direct`).
//!
//! Every rank of the group maps every other rank's [`Window`] (shared memory, set up once per
//! group at its first direct call: an all-gather of the offers over the group's authenticated
//! links, then an agreement that every rank attached every window). The set-up connects only
//! the links its own all-gather and agreement use: a group of many ranks does not connect its
//! full mesh for its windows. A call runs in
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
//! `S` out: no byte crosses a socket or a ring, and no rank forwards another's data.
//!
//! An out-of-place all-to-all of large blocks posts nothing: each peer copies its whole block
//! straight out of the owner's input, one copy through the kernel ([`Window::read_owner`],
//! where the set-up found that the kernel allows it on every pair), at the address the owner
//! wrote next to its first generation's stamp; the owner returns once every peer is *done*.
//! A peer takes it at the call's last generation (in place, once all of its own pieces are
//! posted) and waits for a lending owner's *posted* at no other generation: a call whose ranks
//! all lend waits for its peers to begin it once, not once per buffer's worth (from the third
//! generation each buffer is still freed by the peers' *done* of two generations before).
//!
//! Small calls ([`on_lines`]) run in one generation on the windows' line slots instead of the
//! buffers, by turns ([`line_turns`] of the [`LINES`]), each carrying its stamp and data in the cache lines a reader waits
//! on. A small broadcast's root waits for nobody: it checks its readers' stamps at its later
//! generations, and keeps its *done* below the first it has not checked
//! ([`Direct::settle`]). A broadcast of at most [`CELL_DATA`] bytes puts its data on the
//! root's cell of the same turn instead, four cells to a cache line, under a check word of
//! a hash of its stamp ([`cell_word`]; the full stamp stays in the line slot): a reader
//! that trails its root finds the next calls in the line it already read. Waits spin
//! briefly and then sleep on the peer's window; between sleeps they ask the transport whether
//! the group failed and apply the dead-peer rule to the peer waited for — from its link
//! (`Transport::check_peer`), or, with no link to it connected, from what the kernel says of
//! the process that owns its window (`Transport::check_process`: ended, or stopped for the
//! dead-peer limit) — and give up at the call's deadline with a timeout that names the peer
//! and the generation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;

use tutti_runtime::clock::{Deadline, Moment};
use tutti_runtime::window::{
    Offer, ProcessState, ReadError, Spin, Window, CELL_DATA, LINES, LINE_BYTES, OFFER_LEN,
};
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

/// Where a buffer's stamp slot holds the *source* of a generation's pieces after the stamp: 0
/// when they are in the buffer, else the address of the owner's input (in its own memory), which
/// a reader copies from with one copy through the kernel ([`Window::read_owner`]).
const SOURCE_AT: usize = HEADER_LEN;
const _: () = assert!(SOURCE_AT + 8 <= tutti_runtime::window::STAMP_BYTES);
// Stamp slots start 8-byte aligned (window.rs): the word is too.
const _: () = assert!(SOURCE_AT.is_multiple_of(8));
/// The *source* of an owner that left its call with an error: its input is its caller's again,
/// and nothing copied from it counts (a reader checks the word again after each copy).
const WITHDRAWN: u64 = u64::MAX;
/// All-to-all blocks of at least this many bytes go by single copy where the group can
/// ([`Direct::blocks`]). The kernel's copy runs at a quarter of `memcpy`'s speed on data in
/// cache (13 against 47–56 GB/s on the reference machine): it pays where it saves copies of
/// larger blocks, not at 256 KiB.
pub(crate) const SINGLE_FROM: usize = 512 << 10;
/// All-gather blocks of at least this many bytes go by single copy in a group of 2 ranks that
/// can: a rank lends its block (in place too) and the peer takes it with one copy through the
/// kernel, instead of two through the windows. With 2 ranks, each on a core, that took 0.72–0.92
/// of messages' time out of place from 1 to 32 MiB and 0.97 and 1.08 at 64 MiB (two runs), 0.36–0.89
/// in place (the VM's slow phase); with 4 ranks on 2 cores (a trial build that lent there too)
/// 1.26–1.36 of the windows' time out of place, so groups of 3 or more keep the windows.
pub(crate) const GATHER_SINGLE_FROM: usize = 512 << 10;

/// Whether a call's rank runs ahead of its peers: a small broadcast's root, on the line slots
/// or the cells ([`Direct::free`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ahead {
    No,
    Line,
    Cell,
}

/// Cells in a cache line.
const CELLS_PER_LINE: u64 = (64 / tutti_runtime::window::CELL_BYTES) as u64;
/// How long a small broadcast's root at the edge waits for a reader to get a quarter of the
/// turns further than it needs ([`Direct::free`]) before it checks its broadcasts instead:
/// tens of back-to-back small calls.
const BATCH_WAIT: Duration = Duration::from_micros(20);

/// Where a line slot's stamp starts (after its generation word), and its data.
const LINE_STAMP: usize = 8;
const LINE_DATA_AT: usize = LINE_STAMP + HEADER_LEN;
/// Bytes of data a call may put in a line slot.
pub(crate) const LINE_DATA: usize = LINE_BYTES - LINE_DATA_AT;

/// Whether a call of `coll` moving `bytes` (nccl-tests' S) of equal blocks on `n` ranks runs on
/// the line slots: every rank's contribution fits one slot (and, for an allreduce, where every
/// rank reduces all n, the n contributions together stay small).
pub(crate) fn on_lines(coll: Coll, bytes: usize, n: usize) -> bool {
    match coll {
        Coll::Allreduce => bytes <= LINE_DATA && bytes * n <= ONE_PHASE,
        Coll::Broadcast | Coll::ReduceScatter | Coll::AllToAll => bytes <= LINE_DATA,
        Coll::Allgather => bytes / n.max(1) <= LINE_DATA,
        _ => false,
    }
}

/// Bytes of one buffer of a window for a group of `n` ranks: 1 MiB up to 128 ranks, then the
/// largest power of two at most 128 MiB / n (at least 64 KiB). Each rank's window holds two
/// buffers and a 68 KiB header (its line slots included), so a group's windows on one host hold
/// at most `n × (68 KiB + 2 × buffer)`: 8.27 MiB at 4 ranks, 132.3 MiB at 64, 392 MiB at most up
/// to 2,048 ranks. Only the pages a call touches are allocated.
pub(crate) fn buffer_for(n: usize) -> usize {
    (1usize << ((128usize << 20) / n.max(1)).max(1).ilog2()).clamp(64 << 10, 1 << 20)
}

/// Line slots a group of `n` ranks uses by turns: 32 (all of [`LINES`]) up to 8 ranks, then
/// fewer, down to 2 from 128 ranks. A small broadcast's root runs up to this many calls less one
/// ahead of its readers on the line slots (less five on the cells, where there are at least 16);
/// a small call reads a slot of every peer, so the first calls through the
/// slots touch `(n − 1) × turns` slots of peers' windows (2 per page), each page a first-touch
/// fault of its own: with `256 / n` slots that stays near 128 pages per rank at any size (at
/// 128 ranks, 32 slots had doubled a short job's page faults).
pub(crate) fn line_turns(n: usize) -> u64 {
    (256 / n.max(1)).clamp(2, LINES) as u64
}

/// What a group's direct reads hold: every rank's window (this rank's own at its rank) and the
/// generations run so far.
pub(crate) struct Direct {
    me: usize,
    wins: Vec<Window>,
    gen: u64,
    /// How a wait spins before it sleeps.
    spin: Spin,
    /// Bytes between two publications of *posted* ([`PIECE`], or a whole buffer).
    piece: usize,
    /// A broadcast of more than this many bytes is copied out with non-temporal stores
    /// (`kernel::copy_stream`): every size where each rank has a core, else where the group's
    /// n copies together pass `plan::STREAM_MIN`.
    stream_above: usize,
    /// Every rank may copy from every other's memory with one copy through the kernel
    /// ([`Window::read_owner`]): found at set-up, the same on every rank.
    single: bool,
    /// The latest generation each peer is known to be done with, from its *done* as last read
    /// or from a later generation it was seen to begin: a buffer or line slot needs no look at
    /// a peer's *done* when this covers its last use.
    known_done: Vec<Cell<u64>>,
    /// The latest *done* read from each peer's window (never inferred): see [`Direct::settle`].
    agreed: Vec<Cell<u64>>,
    /// The least of the peers' [`Direct::agreed`] (`u64::MAX` without peers), as of the last
    /// time [`Direct::settle`] needed it: a small broadcast up to it needs no look at any peer.
    /// [`Direct::agree`] only marks it stale (`agreed_stale`), so a loop over the peers that
    /// raises each does not take the least n times.
    agreed_by_all: Cell<u64>,
    agreed_stale: Cell<bool>,
    /// Calls run on the line slots (for the tests).
    lines: u64,
    /// Of those, calls on the cells (for the tests).
    cells: u64,
    /// Calls whose pieces the peers took by single copy (for the tests).
    singles: u64,
    /// Lend nothing, as where the kernel cannot read the input through (for the tests).
    #[cfg(test)]
    lend_none: bool,
    /// Line slots used by turns ([`line_turns`]).
    turns: u64,
    /// Small broadcasts this rank made as root whose peers' stamps it has not checked yet, in
    /// generation order: its *done* stays below the first, so no peer writes its line slot of
    /// that generation again before the check ([`Direct::settle`]).
    unchecked: RefCell<VecDeque<Unchecked>>,
}

/// A call's lent input: dropped, it marks every stamp slot of ours that lends it [`WITHDRAWN`]
/// (the call left with an error or a panic before every peer was done), unless the call
/// returned normally ([`Lending::returned`]). A reader checks the word after each copy: one
/// that saw the input change under it (the caller's writes come after this mark) sees it.
struct Lending {
    /// Our two stamp slots' *source* words, in our own window's mapping, which outlives the
    /// call.
    words: [*const AtomicU64; 2],
    source: u64,
}

impl Lending {
    fn new(d: &Direct, source: u64) -> Lending {
        let words = [0, 1].map(|b| std::ptr::from_ref(d.source_word(d.me, b)));
        Lending { words, source }
    }

    /// Every peer is done with the input: nothing to mark.
    fn returned(self) {
        std::mem::forget(self);
    }
}

impl Drop for Lending {
    fn drop(&mut self) {
        for w in self.words {
            // SAFETY: our own window's word, valid while the group's direct state lives, which
            // holds the call that made this.
            let w = unsafe { &*w };
            let _ = w.compare_exchange(self.source, WITHDRAWN, Ordering::SeqCst, Ordering::SeqCst);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// A small broadcast whose root did not wait for its peers' stamps: the generation, its line
/// slot, and the call's descriptor and name.
#[derive(Clone, Copy)]
struct Unchecked {
    g: u64,
    s: usize,
    desc: MsgDesc,
    op_name: &'static str,
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
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) group: &'a tutti_runtime::Group,
    pub(crate) op_name: &'static str,
    pub(crate) desc: MsgDesc,
    pub(crate) start: Moment,
    pub(crate) deadline: Deadline,
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
        one_host: bool,
        single_copy: bool,
        allgather: impl FnOnce(&[u8], &mut [u8]) -> Result<()>,
        agree: impl FnOnce(f64) -> Result<f64>,
    ) -> Result<State> {
        let data = 2 * buffer_for(group.size());
        Self::setup_sized(group, one_host, single_copy, data, allgather, agree)
    }

    /// [`Direct::setup`] with windows of `data` bytes each (a shared buffer's: see
    /// `shared.rs`).
    ///
    /// # Errors
    /// As [`Direct::setup`].
    pub(crate) fn setup_sized(
        group: &tutti_runtime::Group,
        one_host: bool,
        single_copy: bool,
        data: usize,
        allgather: impl FnOnce(&[u8], &mut [u8]) -> Result<()>,
        agree: impl FnOnce(f64) -> Result<f64>,
    ) -> Result<State> {
        let (n, me) = (group.size(), group.rank());
        let t = group.transport();
        // Every rank reads every other's window, but needs no link to every other: a link
        // connected now says whether it goes through shared memory; one not connected yet
        // would, on one host, where this rank offers it (a peer that does not makes no
        // window, and every rank learns so below). A wait on a peer with no link learns
        // whether it ended or stopped from the kernel (`Window::owner`), so a group of many
        // ranks does not connect its full mesh for its windows.
        let apart = (0..n).map(|r| group.global_rank(r)).find(|&g| {
            g != t.rank()
                && !t.shares_memory_with(g)
                && (t.is_connected(g) || !one_host || !t.offers_shared_memory())
        });
        let made = match apart {
            Some(g) => Err(format!("rank {g} does not share memory with rank {}", t.rank())),
            None => Window::create(data).map_err(|e| e.to_string()),
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
        // Whether the kernel lets this rank copy from every peer's memory (`single_copy`:
        // `TUTTI_SINGLE_COPY`): a read of nothing checks it, and that each peer is its
        // window's owner.
        let single = single_copy
            && why.is_none()
            && wins.iter().enumerate().filter(|(r, _)| *r != me).all(|(r, w)| {
                // SAFETY: nothing is written with a length of 0.
                let probe = unsafe { w.read_owner(0, std::ptr::null_mut(), 0) };
                if let Err(e) = &probe {
                    tracing::debug!(rank = me, peer = r, "no single-copy reads: {e}");
                }
                probe.is_ok()
            });
        // Every rank learns whether any could not attach (2: all go direct or none does), and
        // whether any cannot copy from every peer (1: all use single copies or none does).
        let failed = agree(if why.is_some() {
            2.0
        } else if single {
            0.0
        } else {
            1.0
        })?;
        if failed > 1.0 || wins.len() != n {
            let why = why.unwrap_or_else(|| "another rank could not map every window".into());
            tracing::debug!(rank = me, "no direct reads in this group: {why}");
            return Ok(State::Off(why));
        }
        // Every rank has attached every window: no descriptor needs to stay open.
        wins[me].seal_attachments();
        let cpus = tutti_runtime::host_cpus();
        // Where each rank has a core, a wait spins hot for 5 µs, then gives the CPU away before
        // each look (another process may have taken the peer's core: spinning on would keep
        // it off this one). Where ranks share cores, a waiting rank gives its CPU away at once
        // and keeps looking for half a millisecond before it sleeps: the rank it waits for is often the one that
        // runs next on its core, and a sleep costs a wake-up on both sides (an 8-byte direct
        // allreduce of 4 ranks on 2 cores took 33–38 µs sleeping after 5 µs, 6.5 µs yielding).
        let us = Duration::from_micros;
        // A broadcast's readers copy out with streaming stores (no read for ownership,
        // nothing evicted) where each has a core. Where ranks share cores, a copy out that
        // stays in the caches took 0.4–0.8 of the streamed one's time at 1–4 MiB with 3 and 4
        // ranks on 2 cores in the VM's usual phase, and as long in its slow one; with 8 ranks
        // it won at 1 MiB but lost at 4 and 8 MiB (1.3–1.45 times as long): streamed there only
        // where the group's copies together (n × S) pass what the caches can hold.
        let (spin, piece, stream_above) = if cpus >= n {
            (Spin { hot: us(5), yielding: us(45) }, PIECE, 0)
        } else {
            (Spin { hot: us(0), yielding: us(500) }, usize::MAX, crate::plan::STREAM_MIN / n)
        };
        let known_done = (0..n).map(|_| Cell::new(0)).collect();
        let agreed = (0..n).map(|_| Cell::new(0)).collect();
        Ok(State::Ready(Box::new(Direct {
            me,
            wins,
            gen: 0,
            spin,
            piece,
            stream_above,
            single: failed == 0.0,
            known_done,
            agreed,
            agreed_by_all: Cell::new(if n > 1 { 0 } else { u64::MAX }),
            agreed_stale: Cell::new(false),
            lines: 0,
            cells: 0,
            singles: 0,
            #[cfg(test)]
            lend_none: false,
            turns: line_turns(n),
            unchecked: RefCell::default(),
        })))
    }

    /// Whether the group's large out-of-place all-to-all blocks go by single copy (agreed at
    /// the set-up: the same on every rank).
    pub(crate) fn single(&self) -> bool {
        self.single
    }

    /// This rank's window's data (a shared buffer's memory) and its length.
    pub(crate) fn own_data(&self) -> (*mut u8, usize) {
        (self.wins[self.me].data(), self.wins[self.me].data_len())
    }

    /// An all-gather in place on windows that are the ranks' own buffers (a shared buffer,
    /// `shared.rs`): rank `r`'s block of `block` bytes at `r × block` of its window is its
    /// contribution; each rank copies every peer's block straight from the peer's window into
    /// its own, one copy of each byte. One generation: stamp and publish *posted* (the block is
    /// there), read each peer's block once its *posted* says so (after checking its stamp),
    /// publish *done*, and return once every peer is done (none reads our block any more, so
    /// the caller may write it).
    ///
    /// # Errors
    /// A peer's mismatched call, a lost peer, an abort, the deadline.
    pub(crate) fn gather_in_place(&mut self, call: &Call<'_>, block: usize) -> Result<()> {
        let n = self.wins.len();
        assert!(block * n <= self.wins[self.me].data_len(), "blocks past the shared buffer");
        let (g, b) = self.next();
        self.begin(call, g, b, 0, 0)?;
        let mut done = 0;
        for i in 1..n {
            let r = (self.me + i) % n;
            self.posted(call, r, g, b, 0, done)?;
            // SAFETY: block `r` of window `r` (its owner's contribution, which it does not write
            // during the call) into block `r` of ours (which no peer reads: each reads only
            // its owner's block); both inside the windows (asserted above, every window alike).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.wins[r].data().add(r * block).cast_const(),
                    self.wins[self.me].data().add(r * block),
                    block,
                )
            };
            done += block;
        }
        self.finish(g);
        for r in self.peers() {
            let v = self.wait(call, r, DONE, g, done)?;
            self.agree(r, v);
        }
        Ok(())
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

    /// The next generation, on the line slots: it and its slot (the slots are used by turns).
    fn next_line(&mut self) -> (u64, usize) {
        self.lines += 1;
        self.gen += 1;
        (self.gen, (self.gen % self.turns) as usize)
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
    ) -> Result<u64> {
        // Between sleeps: whether the peer is alive, and whether it made a call on its line
        // slots at this generation instead (a mismatch).
        let v = self.wins[r].counter(counter);
        if v >= at_least {
            return Ok(v);
        }
        let alive = self.alive(call, r, || self.wins[r].counter(counter) >= at_least);
        let check = || {
            alive()?;
            if counter == POSTED {
                self.line_call_at(call, r, at_least / GEN)?;
            }
            Ok(())
        };
        let w = self.wins[r].wait(counter, at_least, call.deadline, self.spin, check);
        self.waited(call, w, r, done)
    }

    /// What a wait on peer `r` asks between sleeps: the transport's failure, and the dead-peer
    /// rule for `r` (nothing is posted to it, so no operation applies the rule), timed from
    /// the first ask (after the spin) — from `r`'s link, or, where none is connected, from
    /// what the kernel says of the process that owns `r`'s window. `met` says whether what
    /// the wait needs is there: read again after the kernel said the process ended or
    /// stopped (a peer that published it and then exited, which closed no link with us, is
    /// no failure; an ended process writes nothing more, so a second look is final).
    fn alive<'c>(
        &'c self,
        call: &'c Call<'_>,
        r: usize,
        met: impl Fn() -> bool + 'c,
    ) -> impl Fn() -> std::result::Result<(), RtError> + 'c {
        let (t, peer, since) = (call.group.transport(), call.global(r), OnceCell::new());
        let owner = self.wins[r].owner();
        move || {
            let since = *since.get_or_init(Instant::now);
            t.check_peer(peer, since)?;
            match owner {
                Some(p) if !t.is_connected(peer) => {
                    let state = p.state();
                    if state != ProcessState::Running && met() {
                        return Ok(());
                    }
                    t.check_process(peer, &state, since)
                }
                _ => Ok(()),
            }
        }
    }

    /// A wait's outcome: `None` (the deadline passed) is a timeout naming `r` and the
    /// generation.
    fn waited(
        &self,
        call: &Call<'_>,
        r: std::result::Result<Option<u64>, RtError>,
        peer: usize,
        done: usize,
    ) -> Result<u64> {
        match r {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(Error::Runtime(RtError::Timeout {
                rank: call.global(self.me),
                peer: call.global(peer),
                ctx: call.ctx(self.gen, done),
                timeout: call.group.timeout(),
            })),
            Err(e) => Err(Error::Runtime(e)),
        }
    }

    /// Peer `r` began generation `g`: it is done with every earlier one.
    fn saw(&self, r: usize, g: u64) {
        self.knew_done(r, g - 1);
    }

    /// Peer `r` is done with generation `g` and every earlier one.
    fn knew_done(&self, r: usize, g: u64) {
        if self.known_done[r].get() < g {
            self.known_done[r].set(g);
        }
    }

    /// Step 1 of generation `g`, which uses one of `turns` buffers or line slots by turns:
    /// check the peers' stamps of our earlier small broadcasts as root ([`Direct::settle`]: all
    /// of them, unless `g` is such a broadcast too, which leaves the latest `turns − 1`), then
    /// wait until every peer is done with generation `g − turns` (the last that could have
    /// used the same one), unless that is known already. A small broadcast's root (`ahead`)
    /// that has to wait waits for more, as below.
    ///
    /// A peer that begins a generation other than a small broadcast's as root is then done
    /// with every earlier one: that is what [`Direct::saw`] relies on.
    fn free(&self, call: &Call<'_>, g: u64, turns: u64, ahead: Ahead, done: usize) -> Result<()> {
        // As generation `g` begins, every earlier one is over here.
        let must = if ahead == Ahead::No { g } else { g.saturating_sub(turns) };
        self.settle(call, must, g - 1)?;
        if g <= turns {
            return Ok(());
        }
        // A root running ahead that must wait for a reader waits for a quarter of the turns
        // more than it needs, then runs that many calls without looking at the reader's
        // lines: at the edge it would read the reader's *done* at every call, and the reader
        // would take that line back at every call. On the cells it also stays a cache line of
        // cells short of what the turns allow, so at the edge it does not write into the line
        // the reader is reading. (gap + turns / 4 < turns: `more` ≤ g − 1, posted already.)
        let (need, more) = match ahead {
            Ahead::No => (g - turns, g - turns),
            Ahead::Line | Ahead::Cell => {
                let gap = if ahead == Ahead::Cell && turns >= 16 { CELLS_PER_LINE } else { 0 };
                let need = g - turns + gap;
                (need, need + turns / 4)
            }
        };
        for r in self.peers() {
            if self.known_done[r].get() >= need {
                continue;
            }
            if more > need {
                // Matched calls get there: our *done* covers every generation where we were
                // not the root, and in ours a reader needs only our posts and our *done* at
                // h − turns, which our last call published. A peer whose *done* does not come
                // within BATCH_WAIT is slow, or holds it (it believes itself the root, say):
                // check our broadcasts up to `more` first, which waits (to the call's
                // deadline) for the peer to begin each of them and names such a peer from its
                // stamps, then wait for its *done* at what we need only. The look takes
                // BATCH_WAIT in all, spinning as the group's waits do, then yielding.
                let until = Deadline::after(Moment::now(), BATCH_WAIT);
                let hot = self.spin.hot.min(BATCH_WAIT);
                let spin = Spin { hot, yielding: BATCH_WAIT - hot };
                let quick = || Ok::<(), RtError>(());
                if let Ok(Some(v)) = self.wins[r].wait(DONE, more, until, spin, quick) {
                    self.agree(r, v);
                    continue;
                }
                self.settle(call, more, g - 1)?;
                if self.known_done[r].get() >= need {
                    continue;
                }
            }
            let v = self.wait(call, r, DONE, need, done)?;
            self.agree(r, v);
        }
        Ok(())
    }

    /// Whether peer `r` made a call on its line slots at generation `g` while we wait for it in
    /// a buffer: then the call it made, as a mismatch.
    fn line_call_at(&self, call: &Call<'_>, r: usize, g: u64) -> std::result::Result<(), RtError> {
        let s = (g % self.turns) as usize;
        if self.wins[r].line_gen(s) != g {
            return Ok(());
        }
        self.line_stamp_at(call, r, g, s).and(Err(RtError::Protocol {
            rank: call.global(self.me),
            peer: call.global(r),
            detail: format!(
                "it made {} on its line slot where this rank uses a buffer",
                call.op_name
            ),
        }))
    }

    /// The same for a peer that made generation `g` in a buffer while we wait on its line
    /// slot. The peer may be past it already (a broadcast's non-root waits only for its root):
    /// its stamp for `g`'s buffer counts while it still says generation `g`.
    fn buffer_call_at(
        &self,
        call: &Call<'_>,
        r: usize,
        g: u64,
    ) -> std::result::Result<(), RtError> {
        let began = self.wins[r].counter(POSTED) / GEN;
        if began != g && began != g + 1 {
            return Ok(());
        }
        // SAFETY: the peer's stamp slot for the generation's buffer, which it does not write
        // again before generation g + 2 (it needs us done with g for that).
        let raw = unsafe { Self::read_stamp(self.wins[r].stamp((g % 2) as usize)) };
        // A stamp of an earlier generation (the peer made g on its line slot, then g + 1 in
        // a buffer) decides nothing.
        match Header::decode(&raw) {
            Ok(h) if h.len == g => {}
            _ => return Ok(()),
        }
        self.check_stamp(call, r, g, &raw).and(Err(RtError::Protocol {
            rank: call.global(self.me),
            peer: call.global(r),
            detail: format!(
                "it made {} in a buffer where this rank uses its line slot",
                call.op_name
            ),
        }))
    }

    /// The 48-byte stamp at `p` (in a peer's window).
    ///
    /// # Safety
    /// `p..p+HEADER_LEN` lies inside a mapped window.
    unsafe fn read_stamp(p: *const u8) -> [u8; HEADER_LEN] {
        let mut raw = [0u8; HEADER_LEN];
        // SAFETY: forwarded contract; `raw` is ours.
        unsafe { std::ptr::copy_nonoverlapping(p, raw.as_mut_ptr(), HEADER_LEN) };
        raw
    }

    /// Whether `raw`, read from peer `r`'s window for generation `g`, stamps this call: a
    /// different call is a named mismatch, anything else a protocol error.
    fn check_stamp(
        &self,
        call: &Call<'_>,
        r: usize,
        g: u64,
        raw: &[u8; HEADER_LEN],
    ) -> std::result::Result<(), RtError> {
        let (me, peer) = (call.global(self.me), call.global(r));
        // The stamp the peer writes when it makes this call: the same bytes, the common case,
        // need no decoding.
        if same_stamp(raw, &Header::data(call.desc, peer, g as usize).encode()) {
            return Ok(());
        }
        match Header::decode(raw) {
            Ok(h) if h.desc == call.desc && h.len == g && h.src as usize == peer => Ok(()),
            Ok(h) if h.desc != call.desc => Err(RtError::Mismatch {
                rank: me,
                peer,
                expected: call.desc.to_string(),
                got: h.desc.to_string(),
            }),
            Ok(h) => Err(RtError::Protocol {
                rank: me,
                peer,
                detail: format!(
                    "its window holds generation {} from rank {} in {}, expected generation {g} \
                     from rank {peer}",
                    h.len, h.src, call.op_name
                ),
            }),
            Err(e) => Err(RtError::Protocol {
                rank: me,
                peer,
                detail: format!("its window's stamp in {} is not a descriptor: {e}", call.op_name),
            }),
        }
    }

    /// Step 1 of generation `g` and the start of step 2: wait until buffer `b` is free, stamp
    /// it and publish that nothing is posted yet; [`Direct::progress`] publishes the bytes.
    fn begin(&self, call: &Call<'_>, g: u64, b: usize, done: usize, source: u64) -> Result<()> {
        // A generation moves up to a buffer: an abort (or a failure seen by the transport)
        // ends a long call between two, even where no wait ever needs to sleep.
        call.group.check()?;
        self.free(call, g, 2, Ahead::No, done)?;
        let stamp = Header::data(call.desc, call.global(self.me), g as usize).encode();
        let slot = self.wins[self.me].stamp(b);
        // SAFETY: our own window's stamp slot, HEADER_LEN ≤ STAMP_BYTES; peers read it only
        // after the publish below.
        unsafe { std::ptr::copy_nonoverlapping(stamp.as_ptr(), slot, HEADER_LEN) };
        self.source_word(self.me, b).store(source, Ordering::Relaxed);
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
        self.saw(r, g);
        // SAFETY: the peer's stamp slot, written before it published `g`; it does not write it
        // again before we publish *done* = `g`.
        let raw = unsafe { Self::read_stamp(self.wins[r].stamp(b)) };
        self.check_stamp(call, r, g, &raw).map_err(Error::Runtime)?;
        if need > 0 {
            self.wait(call, r, POSTED, g * GEN + need as u64, done)?;
        }
        Ok(())
    }

    /// Begin generation `g` on our line slot `s`: once it is free, stamp it, write `len`
    /// bytes of data with `fill` and publish. `ahead`: a small broadcast's root, which does not
    /// wait for its peers' stamps ([`Direct::settle`]).
    fn line_post(
        &self,
        call: &Call<'_>,
        (g, s): (u64, usize),
        ahead: Ahead,
        len: usize,
        fill: impl FnOnce(*mut u8),
    ) -> Result<()> {
        debug_assert!(len <= LINE_DATA);
        self.line_stamp(call, (g, s), ahead)?;
        if len > 0 {
            // SAFETY: our own free line slot: `len` ≤ LINE_DATA bytes of data after the stamp.
            fill(unsafe { self.wins[self.me].line(s).add(LINE_DATA_AT) });
        }
        self.wins[self.me].publish_line(s, g);
        Ok(())
    }

    /// Step 1 of generation `g` on our line slot `s` ([`Direct::free`]), and its stamp written
    /// there (not published); returns the stamp.
    fn line_stamp(
        &self,
        call: &Call<'_>,
        (g, s): (u64, usize),
        ahead: Ahead,
    ) -> Result<[u8; HEADER_LEN]> {
        self.free(call, g, self.turns, ahead, 0)?;
        let stamp = Header::data(call.desc, call.global(self.me), g as usize).encode();
        // SAFETY: our own free line slot, which holds the stamp after its generation word.
        unsafe {
            let slot = self.wins[self.me].line(s);
            std::ptr::copy_nonoverlapping(stamp.as_ptr(), slot.add(LINE_STAMP), HEADER_LEN);
        }
        Ok(stamp)
    }

    /// Begin generation `g` on our cell `s` (and line slot `s`, which gets the stamp): once
    /// they are free, write the stamp and `data` (at most [`CELL_DATA`] bytes), and post the
    /// cell with its check word ([`cell_word`]). `ahead` as for [`Direct::line_post`].
    fn cell_post(
        &self,
        call: &Call<'_>,
        (g, s): (u64, usize),
        ahead: Ahead,
        data: *const u8,
        len: usize,
    ) -> Result<()> {
        debug_assert!(len <= CELL_DATA);
        let stamp = self.line_stamp(call, (g, s), ahead)?;
        // SAFETY: the caller's `len` ≤ CELL_DATA bytes into our own free cell.
        unsafe { std::ptr::copy_nonoverlapping(data, self.wins[self.me].cell(s), len) };
        self.wins[self.me].post_cell(s, g, cell_word(&stamp));
        Ok(())
    }

    /// Wait until peer `r` posted generation `g` on its cell `s` with the check word the stamp
    /// this rank expects of it gives; return where its data starts (valid until we publish
    /// *done* = `g`). A peer that made another call never posts that word: the waits' check
    /// names it from the stamp in its line slot, or from its buffer's.
    fn cell_wait(&self, call: &Call<'_>, r: usize, g: u64, s: usize) -> Result<*const u8> {
        let want = cell_word(&Header::data(call.desc, call.global(r), g as usize).encode());
        if self.wins[r].cell_word(s) != want {
            let alive = self.alive(call, r, || self.wins[r].cell_word(s) == want);
            let check = || {
                alive()?;
                self.buffer_call_at(call, r, g)?;
                self.line_stamp_at(call, r, g, s)
            };
            let w = self.wins[r].wait_cell(s, want, call.deadline, self.spin, check);
            self.waited(call, w, r, 0)?;
        }
        Ok(self.wins[r].cell(s))
    }

    /// While we wait on peer `r` for generation `g` (on its cell `s`, or in a buffer): a peer
    /// whose line slot `s` holds `g` with another stamp made another call there (a peer
    /// posting its cell stamps the slot first, with the same stamp).
    fn line_stamp_at(
        &self,
        call: &Call<'_>,
        r: usize,
        g: u64,
        s: usize,
    ) -> std::result::Result<(), RtError> {
        if self.wins[r].line_gen(s) != g {
            return Ok(());
        }
        // SAFETY: the peer's line slot, which holds generation `g` until the peer begins
        // `g + turns` (it needs us done with `g` for that).
        let raw = unsafe { Self::read_stamp(self.wins[r].line(s).add(LINE_STAMP)) };
        self.check_stamp(call, r, g, &raw)
    }

    /// Wait until peer `r` posted generation `g` on its line slot `s`, check its stamp, and
    /// return where its data starts (valid until we publish *done* = `g`); the peer is then
    /// known to have begun `g`.
    fn line_read(&self, call: &Call<'_>, r: usize, g: u64, s: usize) -> Result<*const u8> {
        let p = self.line_wait(call, r, g, s)?;
        self.saw(r, g);
        Ok(p)
    }

    /// [`Direct::line_read`], without noting that the peer began `g`.
    fn line_wait(&self, call: &Call<'_>, r: usize, g: u64, s: usize) -> Result<*const u8> {
        if self.wins[r].line_gen(s) < g {
            let alive = self.alive(call, r, || self.wins[r].line_gen(s) >= g);
            let check = || {
                alive()?;
                self.buffer_call_at(call, r, g)
            };
            let w = self.wins[r].wait_line(s, g, call.deadline, self.spin, check);
            self.waited(call, w, r, 0)?;
        }
        // SAFETY: the peer's line slot, written before it published `g`; it does not write it
        // again before we publish *done* = `g`.
        let raw = unsafe { Self::read_stamp(self.wins[r].line(s).add(LINE_STAMP)) };
        self.check_stamp(call, r, g, &raw).map_err(Error::Runtime)?;
        Ok(self.line_data(r, s))
    }

    /// Publish *done* = `g`, or just below the first small broadcast whose peers' stamps are
    /// still unchecked.
    fn finish(&self, g: u64) {
        let first = self.unchecked.borrow().front().map_or(u64::MAX, |u| u.g);
        let v = g.min(first - 1);
        // Unchanged (a root whose unchecked broadcasts hold it): no store, which would take
        // the line back from the peers that read it.
        if self.wins[self.me].counter(DONE) != v {
            self.wins[self.me].publish(DONE, v);
        }
    }

    /// Check the small broadcasts this rank made as root without waiting for its peers: those
    /// of generations up to `must` now (peers about to begin a later generation need our
    /// *done* past them), later ones only where the peers' *done* already covers them; then
    /// publish *done* = `done` (the last generation this rank is through), below the first
    /// still unchecked.
    ///
    /// A peer whose *done* has reached a generation agreed with our call there: it finished
    /// that generation, which as a non-root meant checking its root's stamp (ours, or that of a
    /// rank that believed itself the root and holds its own *done* below it until it has
    /// checked ours), and as a root of its own meant checking ours. So the check reads each
    /// peer's *done* once, which covers many broadcasts at a time, and reads a peer's stamp
    /// (waiting for it) only for a generation up to `must` that its *done* does not cover.
    /// Each stamp stays in its peer's line slot until then. A peer that made another call is
    /// named as a mismatch of the broadcast it did not make.
    fn settle(&self, call: &Call<'_>, must: u64, done: u64) -> Result<()> {
        let (mut read, mut popped) = (false, false);
        loop {
            // (A `while let` would hold this borrow through the body, over the pop below.)
            let Some(g) = self.unchecked.borrow().front().map(|u| u.g) else { break };
            if g > self.agreed_by_all.get() && self.agreed_stale.replace(false) {
                let least = self.peers().map(|r| self.agreed[r].get()).min();
                self.agreed_by_all.set(least.unwrap_or(u64::MAX));
            }
            if g > self.agreed_by_all.get() {
                // Not covered, and not needed yet: no look at the peers (a look is a read of
                // memory another core writes).
                if g > must {
                    break;
                }
                let Some(u) = self.unchecked.borrow().front().copied() else { break };
                if !read {
                    read = true;
                    for r in self.peers() {
                        let v = self.wins[r].counter(DONE);
                        self.agree(r, v);
                    }
                    continue;
                }
                let then = Call { desc: u.desc, op_name: u.op_name, ..*call };
                for r in self.peers() {
                    if self.agreed[r].get() < u.g {
                        self.line_read(&then, r, u.g, u.s)?;
                    }
                }
            }
            self.unchecked.borrow_mut().pop_front();
            popped = true;
        }
        if popped {
            self.finish(done);
        }
        Ok(())
    }

    /// Peer `r` published *done* = `v` (read from its window): it is through generation `v`
    /// and agreed with every call of ours up to it ([`Direct::settle`]).
    fn agree(&self, r: usize, v: u64) {
        if self.agreed[r].get() < v {
            self.agreed[r].set(v);
            self.agreed_stale.set(true);
        }
        self.knew_done(r, v);
    }

    /// Before a call that does not read directly (messages, point to point): check the peers'
    /// stamps of every small broadcast this rank made as root and has not checked yet, waiting
    /// for them (each peer that makes the same calls posted its stamp before it read the
    /// broadcast), so a peer that made another call is named now, not at a later direct call
    /// that may never come.
    ///
    /// # Errors
    /// A mismatched stamp; a lost peer, an abort, or the group's timeout while waiting.
    pub(crate) fn settle_all(&self, group: &tutti_runtime::Group) -> Result<()> {
        let Some(u) = self.unchecked.borrow().front().copied() else { return Ok(()) };
        let start = Moment::now();
        let call = Call {
            group,
            op_name: u.op_name,
            desc: u.desc,
            start,
            deadline: Deadline::after(start, group.timeout()),
            bytes: 0,
        };
        self.settle(&call, u64::MAX, self.gen)
    }

    /// `out` = the `out.len()` bytes at `at` of buffer `b` of every window reduced with `op`
    /// ([`Direct::reduce_ranks`]).
    ///
    /// # Safety
    /// As [`Direct::reduce_ranks`].
    unsafe fn reduce_from(&self, b: usize, at: usize, out: &mut [u8], dtype: DType, op: ReduceOp) {
        // SAFETY: forwarded contract.
        unsafe { self.reduce_ranks(|r| self.buf(r, b).add(at), out, dtype, op) }
    }

    /// `out` = the `out.len()` bytes at `base(r)` of every rank `r` reduced with `op`, rank 0's
    /// first and then every other rank's in rank order, so that whichever rank does it gets the
    /// same bits.
    ///
    /// # Safety
    /// Every rank's bytes there are posted and not written before we publish *done*; `out`
    /// does not overlap any of them.
    unsafe fn reduce_ranks(
        &self,
        base: impl Fn(usize) -> *const u8,
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            std::ptr::copy_nonoverlapping(base(0), out.as_mut_ptr(), out.len());
            for r in 1..self.wins.len() {
                let theirs = std::slice::from_raw_parts(base(r), out.len());
                kernel::reduce_into(dtype, op, out, theirs);
            }
        }
    }

    /// Where rank `r`'s data starts in its line slot `s`.
    fn line_data(&self, r: usize, s: usize) -> *const u8 {
        // SAFETY: inside the slot.
        unsafe { self.wins[r].line(s).add(LINE_DATA_AT).cast_const() }
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
        if on_lines(Coll::Allreduce, len, n) {
            // Small: every rank posts its input on its line slot and reduces all of them, in
            // rank order (the same bits everywhere): one wait per peer, on the cache lines that
            // carry the data.
            let (g, s) = self.next_line();
            // SAFETY: `len` ≤ LINE_DATA bytes of the caller's source into our free slot.
            self.line_post(call, (g, s), Ahead::No, len, |p| unsafe {
                std::ptr::copy_nonoverlapping(src, p, len)
            })?;
            for r in self.peers() {
                self.line_read(call, r, g, s)?;
            }
            // SAFETY: every slot posted `len` bytes (checked above) and is not written again
            // before we publish *done*; `dst` is the caller's, and its input is already in our
            // slot.
            unsafe {
                let out = std::slice::from_raw_parts_mut(dst, len);
                self.reduce_ranks(|r| self.line_data(r, s), out, dtype, op);
                if let Some(f) = finish {
                    kernel::finish_raw(dtype, f, out.as_mut_ptr(), len);
                }
            }
            self.finish(g);
            return Ok(());
        }
        if len * n <= ONE_PHASE {
            // Small, past the line slot: every rank reduces the whole buffer out of every
            // window, in rank order (the same bits everywhere), with one wait instead of two.
            let (g, b) = self.next();
            self.begin(call, g, b, 0, 0)?;
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
            self.begin(call, g, b, off, 0)?;
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
        if on_lines(Coll::Broadcast, len, self.wins.len()) {
            // Small: the root posts on its line slot and the others copy it out; the others
            // post their stamp alone. The root waits for nobody: it may run up to turns − 1
            // calls ahead of its slowest reader (fewer on the cells: `free`), as a root of
            // messages runs ahead on its links' credits, and checks the others' stamps at its
            // next generations (`settle`: a peer that made another call, or believes another
            // rank the root, is named there). A non-root finds such a mismatch in the root's
            // stamp.
            let (g, s) = self.next_line();
            if len <= CELL_DATA {
                // The smallest: on the cells, several calls to a cache line, so a reader that
                // trails its root finds the next calls in the line it already has. The root's
                // stamp goes to its line slot, the others' as below.
                self.cells += 1;
                if self.me == root {
                    self.cell_post(call, (g, s), Ahead::Cell, src, len)?;
                    if !std::ptr::eq(src, dst) {
                        // SAFETY: the caller's distinct input and output, `len` bytes each.
                        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
                    }
                    let op_name = call.op_name;
                    let u = Unchecked { g, s, desc: call.desc, op_name };
                    self.unchecked.borrow_mut().push_back(u);
                } else {
                    self.line_post(call, (g, s), Ahead::No, 0, |_| ())?;
                    let p = self.cell_wait(call, root, g, s)?;
                    // SAFETY: the root's posted bytes into our output.
                    unsafe { std::ptr::copy_nonoverlapping(p, dst, len) };
                }
                self.finish(g);
                return Ok(());
            }
            if self.me == root {
                // SAFETY: `len` ≤ LINE_DATA bytes of the caller's source into our free slot,
                // and to its output when out of place.
                self.line_post(call, (g, s), Ahead::Line, len, |p| unsafe {
                    std::ptr::copy_nonoverlapping(src, p, len)
                })?;
                if !std::ptr::eq(src, dst) {
                    // SAFETY: the caller's distinct input and output, `len` bytes each.
                    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
                }
                let op_name = call.op_name;
                self.unchecked.borrow_mut().push_back(Unchecked { g, s, desc: call.desc, op_name });
            } else {
                self.line_post(call, (g, s), Ahead::No, 0, |_| ())?;
                // The root may have unchecked broadcasts before this one: that it began `g`
                // says nothing of its *done* (no `saw`).
                let p = self.line_wait(call, root, g, s)?;
                // SAFETY: the root's posted bytes into our output.
                unsafe { std::ptr::copy_nonoverlapping(p, dst, len) };
            }
            self.finish(g);
            return Ok(());
        }
        let piece = self.buf_len();
        // One generation at least: a call of nothing still checks that the peers make it.
        for off in (0..len.div_ceil(piece).max(1)).map(|k| k * piece) {
            let l = piece.min(len - off);
            let (g, b) = self.next();
            // Every rank stamps its buffer, so that the root too learns of a peer that makes
            // another call (another root, say), in the call's first generation.
            self.begin(call, g, b, off, 0)?;
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
                    unsafe {
                        let (to, from) = (dst.add(off + at), self.buf(root, b).add(at));
                        if len > self.stream_above {
                            kernel::copy_stream(to, from, k)
                        } else {
                            std::ptr::copy_nonoverlapping(from, to, k)
                        }
                    };
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
        if on_lines(coll, n * block, n) {
            // SAFETY: forwarded contract.
            return unsafe { self.blocks_on_lines(call, coll, src, dst, block, dtype, op) };
        }
        // Per generation: one piece of our block (all-gather), or of each of the n blocks.
        let per = if coll == Coll::Allgather { self.buf_len() } else { self.buf_len() / n };
        let piece = (per / es * es).max(es);
        // Where block k of what we send starts, and where block k of what we receive goes.
        let ours = |k: usize| match (coll, in_place) {
            (Coll::Allgather, false) => 0,
            _ => k * block,
        };
        // An all-to-all of blocks that may be lent: out of place, our pieces may stay in our
        // input, and the peers copy them from there with one copy through the kernel (the
        // `single` reads), which the generation's stamp slot says; this rank returns only once
        // every peer is done with them. In place the input is also the output, so the pieces go
        // through our buffer. (Only memory the kernel can read through: not a device's mapping,
        // say.)
        //
        // An all-gather lends its one block, in place too: there it is the output's own block,
        // which nobody writes during the call. Its readers take it whole at the last
        // generation, as an all-to-all's. `lends`: whether the peers may lend (the same on
        // every rank); `single`: whether we do.
        let lends = match coll {
            Coll::AllToAll => self.single && block >= SINGLE_FROM,
            Coll::Allgather => self.single && n == 2 && block >= GATHER_SINGLE_FROM,
            _ => false,
        };
        let (lent_at, lent_len) =
            if coll == Coll::Allgather { (ours(me), block) } else { (0, n * block) };
        #[cfg(test)]
        let lends_here = !self.lend_none;
        #[cfg(not(test))]
        let lends_here = true;
        let single = lends
            && lends_here
            && (coll == Coll::Allgather || !in_place)
            && tutti_runtime::window::lendable(src.wrapping_add(lent_at), lent_len);
        let source = if single { src as u64 + lent_at as u64 } else { 0 };
        self.singles += u64::from(single);
        // Leaving with an error (an early return) or a panic before every peer is done drops
        // it armed: a copy of our input that a peer makes from now on, or is making, is found
        // out and not used.
        let lent = single.then(|| Lending::new(self, source));
        // Peers that lent their input, as their first generation's stamp slot says: no later
        // generation waits for them, and their whole block for us is taken at the last one,
        // once all of ours is posted (in place it overwrites our input). A call of lenders
        // waits for its peers to begin it once, not once per buffer's worth. Only an
        // all-to-all or all-gather of blocks that may be lent has any.
        let mut lent_by = vec![false; if lends { n } else { 0 }];
        let mut first = (0, 0);
        // One generation at least: a call of nothing still checks that the peers make it.
        for off in (0..block.div_ceil(piece).max(1)).map(|k| k * piece) {
            let l = piece.min(block - off);
            let (g, b) = self.next();
            self.begin(call, g, b, off, source)?;
            if off == 0 {
                first = (g, b);
            }
            if coll == Coll::Allgather {
                if single {
                    // Our block stays where it is, lent (the peer may take it as soon as we
                    // publish): out of place, then straight into our output's block; nothing
                    // goes through our buffer.
                    self.progress(g, l);
                    if !in_place {
                        // SAFETY: the caller's input and our output's block, at this offset.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                src.add(off),
                                dst.add(me * block + off),
                                l,
                            )
                        };
                    }
                }
                // Piece by piece: ours posted, then each peer's copied as soon as it is posted
                // (a lender's block is taken whole at the last generation, below).
                let mut at = 0;
                while at < l {
                    let k = self.piece.min(l - at);
                    if !single {
                        let mine = self.buf(me, b);
                        // SAFETY: our input's piece into our own free buffer, then (out of
                        // place) into our output's block at this offset.
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
                    }
                    for r in self.peers() {
                        if lent_by.get(r) == Some(&true) {
                            continue;
                        }
                        self.posted(call, r, g, b, at + k, off + at)?;
                        if lends && off == 0 && at == 0 {
                            // As an all-to-all's lenders are learned (below).
                            lent_by[r] = self.source_word(r, b).load(Ordering::Relaxed) != 0;
                            if lent_by[r] {
                                continue;
                            }
                        }
                        // SAFETY: a posted piece of peer r's buffer into our output's block r
                        // at this offset.
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
                if off + l == block {
                    for r in self.peers().filter(|r| lent_by.get(*r) == Some(&true)) {
                        // SAFETY: our output's block r, `block` bytes.
                        unsafe {
                            self.take_lent(call, r, first, 0, dst.add(r * block), block, off)?
                        };
                    }
                }
                self.finish(g);
                continue;
            }
            // All-to-all and reduce-scatter: a piece of each of the n blocks, posted at once.
            // Our own block goes to no peer: an all-to-all's is not posted (see below), nor an
            // out-of-place reduce-scatter's, which we reduce straight from the input (in place
            // the output is that block, so it is posted and read from our buffer).
            let a2a = coll == Coll::AllToAll;
            let own_posted = !a2a && in_place;
            // SAFETY: pieces of the caller's input into our own free buffer.
            unsafe {
                let w = self.buf(me, b);
                for k in (0..n).filter(|k| !single && (own_posted || *k != me)) {
                    std::ptr::copy_nonoverlapping(src.add(ours(k) + off), w.add(k * piece), l);
                }
            }
            self.progress(g, n * piece);
            if a2a && !in_place {
                // Our own block straight from input to output, while the peers post theirs (in
                // place it is where it belongs already).
                // SAFETY: the caller's buffers at this generation's offset of our block.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.add(me * block + off),
                        dst.add(me * block + off),
                        l,
                    )
                };
            }
            for r in self.peers() {
                if lent_by.get(r) == Some(&true) {
                    continue;
                }
                self.posted(call, r, g, b, me * piece + l, off)?;
                if lends && off == 0 {
                    // Read after the wait for the generation (an acquire): the owner wrote it
                    // before. A lender's stamp is not checked again: the generations after
                    // the first are the same call's (every rank counts the same ones), and a
                    // lender that leaves with an error poisons the group, so it makes no other
                    // call in this window; its word then says WITHDRAWN.
                    lent_by[r] = self.source_word(r, b).load(Ordering::Relaxed) != 0;
                }
            }
            // SAFETY: every read is of a posted piece, of our own input, or (through the kernel,
            // which checks it) of a peer's lent input; every write inside the caller's output:
            // at this generation's offset, or, at the last generation, a lender's whole block as
            // lent at the first (our input's pieces there were all posted already).
            unsafe {
                match coll {
                    Coll::AllToAll => {
                        for r in self.peers() {
                            if lent_by.get(r) != Some(&true) {
                                let from = self.buf(r, b).add(me * piece);
                                std::ptr::copy_nonoverlapping(from, dst.add(r * block + off), l);
                            } else if off + l == block {
                                let to = dst.add(r * block);
                                self.take_lent(call, r, first, me * block, to, block, off)?;
                            }
                        }
                    }
                    _ if in_place => {
                        let out = std::slice::from_raw_parts_mut(dst.add(me * block + off), l);
                        self.reduce_from(b, me * piece, out, dtype, op);
                    }
                    _ => {
                        // Out of place: our own piece from the input (the output, one block,
                        // does not overlap it), the others' from their buffers, in rank order.
                        let out = std::slice::from_raw_parts_mut(dst.add(off), l);
                        let base = |r: usize| {
                            if r == me {
                                src.add(me * block + off)
                            } else {
                                self.buf(r, b).add(me * piece).cast_const()
                            }
                        };
                        self.reduce_ranks(base, out, dtype, op);
                    }
                }
            }
            self.finish(g);
        }
        if single {
            // Our input stays the caller's to change once we return: every peer must be done
            // copying from it.
            let g = self.gen;
            for r in self.peers() {
                if self.known_done[r].get() < g {
                    let v = self.wait(call, r, DONE, g, block)?;
                    self.agree(r, v);
                }
            }
        }
        // Every peer is done with our input: nothing to withdraw.
        if let Some(l) = lent {
            l.returned();
        }
        Ok(())
    }

    /// Peer `r`'s *source* word in its stamp slot `b` (ours at `r` = `me`).
    fn source_word(&self, r: usize, b: usize) -> &AtomicU64 {
        // SAFETY: inside the window's stamp slot `b`, 8-byte aligned (checked above), valid
        // for the mapping's life; only ever accessed atomically.
        unsafe { AtomicU64::from_ptr(self.wins[r].stamp(b).add(SOURCE_AT).cast()) }
    }

    /// Take the `len` bytes at `at` of peer `r`'s input, lent at generation `(g, b)`, into `to`
    /// (`done`: the bytes of the call done before), with one copy through the kernel. A copy counts
    /// only if the peer's *source* is still the same after it (it did not leave the call with
    /// an error meanwhile). A peer found gone is named as a wait on it names it (from its link,
    /// or from what the kernel says of its process).
    ///
    /// # Safety
    /// `to` is valid for writes of `len` bytes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn take_lent(
        &self,
        call: &Call<'_>,
        r: usize,
        (g, b): (u64, usize),
        at: usize,
        to: *mut u8,
        len: usize,
        done: usize,
    ) -> Result<()> {
        // Read after a wait for the peer's *posted* of generation `g` (an acquire), here or at
        // an earlier generation of the call: the owner wrote it before.
        let source = self.source_word(r, b).load(Ordering::Relaxed);
        let why = match source {
            // (A peer that lends says so in every generation of the call.)
            0 => "it lent nothing".to_string(),
            WITHDRAWN => "it left the call with an error".to_string(),
            _ => {
                // SAFETY: forwarded contract.
                let read =
                    unsafe { self.wins[r].read_owner(source.wrapping_add(at as u64), to, len) };
                // Whatever the copy saw of the owner's writes, a look at the word after it sees
                // the mark stored before them.
                std::sync::atomic::fence(Ordering::SeqCst);
                let now = self.source_word(r, b).load(Ordering::Relaxed);
                match read {
                    // Whatever the read found, an owner that withdrew its input meanwhile is
                    // the reason (its caller may have changed or freed it).
                    _ if now != source => {
                        "it left the call with an error while this rank copied".to_string()
                    }
                    Ok(()) => return Ok(()),
                    Err(ReadError::Gone(e)) => {
                        // A counter it never reaches: the wait ends with the peer's loss, named.
                        self.wait(call, r, DONE, u64::MAX, done)?;
                        e
                    }
                    Err(e) => e.to_string(),
                }
            }
        };
        // The group's failure first (an abort names what went wrong), else the peer.
        call.group.check()?;
        Err(Error::Runtime(RtError::Protocol {
            rank: call.global(self.me),
            peer: call.global(r),
            detail: format!(
                "{} (sequence {}, lent at generation {g}, taken at {}): {len} bytes of its input \
                 not taken: {why}",
                call.op_name, call.desc.tag.seq, self.gen
            ),
        }))
    }

    /// [`Direct::blocks`] on the line slots ([`on_lines`]): every rank posts its block (all-gather)
    /// or its n blocks, then takes what it needs from every slot.
    ///
    /// # Safety
    /// As [`Direct::blocks`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn blocks_on_lines(
        &mut self,
        call: &Call<'_>,
        coll: Coll,
        src: *const u8,
        dst: *mut u8,
        block: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me) = (self.wins.len(), self.me);
        let in_place = std::ptr::eq(src, dst);
        let (g, s) = self.next_line();
        let (from, len) = match (coll, in_place) {
            (Coll::Allgather, true) => (me * block, block),
            (Coll::Allgather, false) => (0, block),
            _ => (0, n * block),
        };
        // SAFETY: our input (one block, or n) into our free slot.
        self.line_post(call, (g, s), Ahead::No, len, |p| unsafe {
            std::ptr::copy_nonoverlapping(src.add(from), p, len)
        })?;
        // SAFETY: every slot read below was posted (and checked) by `line_read`, and is not
        // written again before we publish *done*; every write is inside the caller's output.
        unsafe {
            match coll {
                Coll::Allgather => {
                    if !in_place {
                        std::ptr::copy_nonoverlapping(src, dst.add(me * block), block);
                    }
                    for r in self.peers() {
                        let p = self.line_read(call, r, g, s)?;
                        std::ptr::copy_nonoverlapping(p, dst.add(r * block), block);
                    }
                }
                Coll::AllToAll => {
                    for r in self.peers() {
                        self.line_read(call, r, g, s)?;
                    }
                    for r in 0..n {
                        std::ptr::copy_nonoverlapping(
                            self.line_data(r, s).add(me * block),
                            dst.add(r * block),
                            block,
                        );
                    }
                }
                _ => {
                    for r in self.peers() {
                        self.line_read(call, r, g, s)?;
                    }
                    let at = if in_place { me * block } else { 0 };
                    let out = std::slice::from_raw_parts_mut(dst.add(at), block);
                    self.reduce_ranks(|r| self.line_data(r, s).add(me * block), out, dtype, op);
                }
            }
        }
        self.finish(g);
        Ok(())
    }
}

/// Whether two stamps hold the same bytes: word compares in line (an array compare calls
/// `memcmp`).
#[inline]
fn same_stamp(a: &[u8; HEADER_LEN], b: &[u8; HEADER_LEN]) -> bool {
    const { assert!(HEADER_LEN.is_multiple_of(8)) };
    let word = |x: &[u8; HEADER_LEN], i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&x[i * 8..i * 8 + 8]);
        u64::from_ne_bytes(w)
    };
    (0..HEADER_LEN / 8).fold(0, |d, i| d | (word(a, i) ^ word(b, i))) == 0
}

/// A cell's check word for `stamp` (its writer's, which holds the call, the writer's rank and
/// the generation): a 64-bit hash of it, never 0 (a cell never posted). A reader waits for the
/// word the stamp it expects gives: another call, or an earlier generation's post still in the
/// cell, gives another word but for one stamp in 2^63.
fn cell_word(stamp: &[u8; HEADER_LEN]) -> u64 {
    let mut h = 0u64;
    for w in stamp.chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        h = (h.rotate_left(29) ^ u64::from_le_bytes(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    (h ^ (h >> 31)) | 1
}

/// The descriptor of a direct call: its tag (step 0) and fingerprint.
pub(crate) fn desc(group: u32, seq: u64, fp: Fingerprint) -> MsgDesc {
    MsgDesc { tag: Tag { group, seq, step: 0 }, fp }
}

/// Keeps the windows of a communicator and its clones, each call holding them
/// ([`crate::call_lock`]).
pub(crate) type Shared = Arc<crate::call_lock::CallLock<State>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Comm;
    use crate::select::Algo;

    /// Run `f` on the `Direct` of `c` (set up).
    fn with_direct<R>(c: &Comm, f: impl FnOnce(&Direct) -> R) -> R {
        let st = c.sel.direct.lock();
        let State::Ready(d) = &*st else { panic!("direct reads are not set up") };
        f(d)
    }

    /// A group of `n` ranks over the in-memory transport, with single copies off on the ranks
    /// in `offs` (one is enough to turn them off for the group).
    fn single_copy_off_on(n: usize, offs: &[usize]) -> Vec<Comm> {
        tutti_runtime::testing::groups(tutti_runtime::testing::Kind::Mem, n)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(r, g)| {
                let cfg = crate::Config { single_copy: !offs.contains(&r), ..Default::default() };
                Comm::with_config(g, cfg)
            })
            .collect()
    }

    /// The stamp compare that skips decoding sees every byte: the same call, rank and
    /// generation give the same bytes, and a change anywhere (any one byte, the rank, the
    /// generation, the sequence number, the count) is a different stamp.
    #[test]
    fn a_stamp_is_the_same_only_when_every_byte_is() {
        let fp = Fingerprint {
            op: Coll::Broadcast.op_kind(),
            dtype: DType::F32,
            redop: 0,
            root: 1,
            count: 2,
            settings: 0x1234,
        };
        let d = desc(7, 41, fp);
        let base = Header::data(d, 3, 9).encode();
        assert!(same_stamp(&base, &Header::data(d, 3, 9).encode()));
        for i in 0..HEADER_LEN {
            let mut b = base;
            b[i] ^= 0x40;
            assert!(!same_stamp(&base, &b), "byte {i}");
        }
        assert!(!same_stamp(&base, &Header::data(d, 4, 9).encode()));
        assert!(!same_stamp(&base, &Header::data(d, 3, 10).encode()));
        assert!(!same_stamp(&base, &Header::data(desc(7, 42, fp), 3, 9).encode()));
        let other = Fingerprint { count: 3, ..fp };
        assert!(!same_stamp(&base, &Header::data(desc(7, 41, other), 3, 9).encode()));
    }

    #[test]
    fn small_calls_take_the_line_slots() {
        let comms = Comm::mem_world(3);
        std::thread::scope(|s| {
            for c in comms {
                s.spawn(move || {
                    let (r, n) = (c.rank(), c.size());
                    let mut x = [r as f32 + 1.0; 3];
                    c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                    assert_eq!(x, [6.0; 3]);
                    let mut all = [0i32; 6];
                    c.allgather(&[r as i32; 2], &mut all).unwrap();
                    assert_eq!(all, [0, 0, 1, 1, 2, 2]);
                    let mut out = [0i32; 2];
                    c.reduce_scatter(&[1i32; 6], &mut out, ReduceOp::Sum).unwrap();
                    assert_eq!(out, [3; 2]);
                    let mut out = [0u8; 3];
                    c.all_to_all(&[r as u8 * 10, r as u8 * 10 + 1, r as u8 * 10 + 2], &mut out)
                        .unwrap();
                    assert_eq!(out, [r as u8, 10 + r as u8, 20 + r as u8]);
                    let mut b = [if r == 1 { 7i64 } else { 0 }; 4];
                    c.with_algo(Algo::Direct).broadcast(&mut b, 1).unwrap();
                    assert_eq!(b, [7; 4]);
                    // One past a line slot: the buffers.
                    let mut big = vec![1u8; LINE_DATA + 1];
                    c.with_algo(Algo::Direct).broadcast(&mut big, 0).unwrap();
                    with_direct(&c, |d| assert_eq!((d.lines, d.cells), (5, 0), "rank {r} of {n}"));
                    // A cell's worth, from every root in turn, more calls than there are cells,
                    // the roots running ahead: on the cells.
                    for k in 0..3 * LINES as i64 {
                        let root = (k % n as i64) as usize;
                        let mut x = [if r == root { k * 0x0101_0101_0101 + 3 } else { 0 }];
                        c.with_algo(Algo::Direct).broadcast(&mut x, root).unwrap();
                        assert_eq!(x, [k * 0x0101_0101_0101 + 3], "call {k}");
                    }
                    let mut tiny = [r as u8; 3];
                    c.with_algo(Algo::Direct).broadcast(&mut tiny, 2).unwrap();
                    assert_eq!(tiny, [2; 3]);
                    with_direct(&c, |d| {
                        let cells = 3 * LINES as u64 + 1;
                        assert_eq!((d.lines, d.cells), (5 + cells, cells), "rank {r} of {n}");
                    });
                });
            }
        });
    }

    #[test]
    fn a_peer_in_the_other_kind_of_call_is_named_from_its_stamp() {
        // Rank 1 waits in a call of one kind (line slot or buffer) at generation g; rank 0
        // looks with the checker for the other kind, as its waits do between sleeps.
        for small_peer in [false, true] {
            let mut comms = Comm::mem_world(2).into_iter();
            let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
            std::thread::scope(|s| {
                let h = s.spawn(move || {
                    c1.allreduce(&mut [0f32; 1], ReduceOp::Sum).unwrap();
                    let mut x = vec![1f32; if small_peer { 4 } else { 100_000 }];
                    c1.with_algo(Algo::Direct).allreduce(&mut x, ReduceOp::Sum).is_err()
                });
                c0.allreduce(&mut [0f32; 1], ReduceOp::Sum).unwrap();
                with_direct(&c0, |d| {
                    let g = d.gen + 1;
                    let (s, b) = ((g % d.turns) as usize, (g % 2) as usize);
                    let until = Instant::now() + Duration::from_secs(20);
                    let stamp = loop {
                        let at = if small_peer {
                            (d.wins[1].line_gen(s) == g)
                                .then(|| d.wins[1].line(s).wrapping_add(LINE_STAMP))
                        } else {
                            (d.wins[1].counter(POSTED) / GEN == g).then(|| d.wins[1].stamp(b))
                        };
                        if let Some(p) = at {
                            let mut raw = [0u8; HEADER_LEN];
                            // SAFETY: the peer's stamp, published; it waits for us now.
                            unsafe {
                                std::ptr::copy_nonoverlapping(p, raw.as_mut_ptr(), HEADER_LEN)
                            };
                            break Header::decode(&raw).unwrap();
                        }
                        assert!(Instant::now() < until, "rank 1 never began generation {g}");
                        std::thread::sleep(Duration::from_millis(1));
                    };
                    // Our own call: the peer's with another count.
                    let fp = Fingerprint { count: stamp.desc.fp.count + 1, ..stamp.desc.fp };
                    let now = Moment::now();
                    let call = Call {
                        group: &c0.group,
                        op_name: "allreduce",
                        desc: MsgDesc { fp, ..stamp.desc },
                        start: now,
                        deadline: Deadline::after(now, Duration::from_secs(10)),
                        bytes: 16,
                    };
                    let (other, same) = if small_peer {
                        (d.line_call_at(&call, 1, g), d.buffer_call_at(&call, 1, g))
                    } else {
                        (d.buffer_call_at(&call, 1, g), d.line_call_at(&call, 1, g))
                    };
                    assert!(matches!(other, Err(RtError::Mismatch { .. })), "{other:?}");
                    assert!(same.is_ok(), "the same kind of call decides nothing: {same:?}");
                });
                c0.group.abort("the test is done");
                assert!(h.join().unwrap(), "rank 1's call must end with the abort");
            });
        }
    }

    #[test]
    fn a_cell_of_another_call_is_named_and_its_data_never_used() {
        // Rank 1, root of an 8-byte broadcast, posts its cell and returns (it waits for
        // nobody), then waits in its next call. Rank 0 reads the cell as its waits do: with the
        // root's own call it gets the bytes; with another count (a call of another cell's
        // worth), the word's check fails and the root's stamp names the call; and a reader of
        // another kind of small call finds the stamp in the line slot.
        let mut comms = Comm::mem_world(2).into_iter();
        let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
        std::thread::scope(|s| {
            let h = s.spawn(move || {
                c1.allreduce(&mut [0f32; 1], ReduceOp::Sum).unwrap();
                c1.with_algo(Algo::Direct).broadcast(&mut [0x55u8; 8], 1).unwrap();
                c1.barrier().is_err()
            });
            c0.allreduce(&mut [0f32; 1], ReduceOp::Sum).unwrap();
            with_direct(&c0, |d| {
                let g = d.gen + 1;
                let s = (g % d.turns) as usize;
                let until = Instant::now() + Duration::from_secs(20);
                while d.wins[1].line_gen(s) != g || d.wins[1].cell_word(s) == 0 {
                    assert!(Instant::now() < until, "rank 1 never posted generation {g}");
                    std::thread::sleep(Duration::from_millis(1));
                }
                // SAFETY: the root's stamp, in its line slot before its cell was posted.
                let raw = unsafe { Direct::read_stamp(d.wins[1].line(s).add(LINE_STAMP)) };
                let stamp = Header::decode(&raw).unwrap();
                let now = Moment::now();
                let call = |count: u64| Call {
                    group: &c0.group,
                    op_name: "broadcast",
                    desc: MsgDesc { fp: Fingerprint { count, ..stamp.desc.fp }, ..stamp.desc },
                    start: now,
                    deadline: Deadline::after(now, Duration::from_secs(10)),
                    bytes: count as usize,
                };
                let p = d.cell_wait(&call(8), 1, g, s).expect("the root's own call");
                // SAFETY: the root's cell, posted; it waits for us now.
                assert_eq!(unsafe { std::slice::from_raw_parts(p, 8) }, &[0x55; 8]);
                for other in [4, 16] {
                    let e = d.cell_wait(&call(other), 1, g, s).map(|_| ()).unwrap_err();
                    let e = e.to_string();
                    assert!(e.contains("count 8") && e.contains(&format!("count {other}")), "{e}");
                    let e = d.line_stamp_at(&call(other), 1, g, s).unwrap_err();
                    assert!(matches!(e, RtError::Mismatch { .. }), "{e:?}");
                }
                assert!(d.line_stamp_at(&call(8), 1, g, s).is_ok(), "the same call: no mismatch");
            });
            c0.group.abort("the test is done");
            assert!(h.join().unwrap(), "rank 1's barrier must end with the abort");
        });
    }

    #[test]
    fn an_all_to_all_out_of_place_lends_large_blocks_by_single_copy() {
        // Rank q's block for rank r, element i, at call k: exact, different everywhere.
        let val = |k: usize, q: usize, r: usize, i: usize| {
            (k * 1_000_000_007 + q * 1_000_003 + r * 7_919 + i * 13) as i64
        };
        let n = 4;
        // Blocks of 640 KB, 880 KB and 1.2 MB: over SINGLE_FROM, and 3, 4 and 5 generations of
        // a buffer's n-th part (a lender's first stamp slot is used again before its block is
        // taken, at an odd and an even last generation).
        let blks = [80_000, 110_000, 150_000];
        // On for all; off for all; off on rank 2 only, which turns it off for the group.
        for offs in [&[][..], &[0, 1, 2, 3], &[2]] {
            let comms = single_copy_off_on(n, offs);
            std::thread::scope(|s| {
                for c in &comms {
                    s.spawn(move || {
                        let (c, r) = (c.with_algo(Algo::Direct), c.rank());
                        for (k, blk) in blks.into_iter().enumerate() {
                            let input = |k: usize| -> Vec<i64> {
                                (0..n)
                                    .flat_map(|j| (0..blk).map(move |i| val(k, r, j, i)))
                                    .collect()
                            };
                            let want: Vec<i64> = (0..n)
                                .flat_map(|q| (0..blk).map(move |i| val(k, q, r, i)))
                                .collect();
                            // Ranks 0 and 2 in place (through their buffers, taking the lenders'
                            // blocks once their own pieces are posted), 1 and 3 out of place: a
                            // call mixes both kinds of pieces. Each rank then overwrites the
                            // buffer it passed, as a caller may once the call returned: a peer
                            // still copying from it would take the new bytes.
                            if r % 2 == 0 {
                                let mut buf = input(k);
                                c.all_to_all_inplace(&mut buf).unwrap();
                                assert!(buf == want, "rank {r}: in place, {blk}");
                            } else {
                                let (mut inp, mut out) = (input(k), vec![0i64; n * blk]);
                                c.all_to_all(&inp, &mut out).unwrap();
                                inp.fill(-1);
                                assert!(out == want, "rank {r}: out of place, {blk}");
                            }
                        }
                        // A small block stays in the buffers.
                        let small: Vec<i64> = (0..n * 1000).map(|i| val(0, r, 0, i)).collect();
                        let mut out = vec![0i64; small.len()];
                        c.all_to_all(&small, &mut out).unwrap();
                    });
                }
            });
            for c in &comms {
                let singles = with_direct(c, |d| d.singles);
                let want = if offs.is_empty() && c.rank() % 2 == 1 { blks.len() as u64 } else { 0 };
                assert_eq!(singles, want, "rank {} (single copies off on {offs:?})", c.rank());
            }
        }
    }

    #[test]
    fn an_all_gather_lends_large_blocks_by_single_copy_in_place_and_out() {
        // Rank q's block, element i, at call k: exact, different everywhere.
        let val =
            |k: usize, q: usize, i: usize| (k * 1_000_000_007 + q * 1_000_003 + i * 13) as i64;
        // Blocks of 640 KB, 1.2 MB and 2.4 MB: over GATHER_SINGLE_FROM, and 1, 2 and 3
        // generations of a 1 MiB buffer (a lender's first stamp slot used again before its
        // block is taken); 2 ranks lend, 3 do not.
        let blks = [80_000, 150_000, 300_000];
        for n in [2, 3] {
            // On for all; off for all; off on the last rank only, which turns it off for all.
            for offs in [vec![], (0..n).collect(), vec![n - 1]] {
                let comms = single_copy_off_on(n, &offs);
                std::thread::scope(|s| {
                    for c in &comms {
                        s.spawn(move || {
                            let (c, r) = (c.with_algo(Algo::Direct), c.rank());
                            for (k, blk) in blks.into_iter().enumerate() {
                                let want: Vec<i64> = (0..n)
                                    .flat_map(|q| (0..blk).map(move |i| val(k, q, i)))
                                    .collect();
                                // Rank 0 in place (its block lent from its output), the others
                                // out of place: every rank then overwrites what it passed, as a
                                // caller may once the call returned (a peer still copying
                                // would take the new bytes).
                                if r == 0 {
                                    let mut buf = vec![-7i64; n * blk];
                                    for i in 0..blk {
                                        buf[r * blk + i] = val(k, r, i);
                                    }
                                    c.allgather_inplace(&mut buf).unwrap();
                                    assert!(buf == want, "rank {r}: in place, {blk}");
                                    buf.fill(-1);
                                } else {
                                    let mut inp: Vec<i64> =
                                        (0..blk).map(|i| val(k, r, i)).collect();
                                    let mut out = vec![0i64; n * blk];
                                    c.allgather(&inp, &mut out).unwrap();
                                    inp.fill(-1);
                                    assert!(out == want, "rank {r}: out of place, {blk}");
                                }
                            }
                            // A small block goes through the buffers.
                            let small: Vec<i64> = (0..1000).map(|i| val(9, r, i)).collect();
                            let mut out = vec![0i64; n * small.len()];
                            c.allgather(&small, &mut out).unwrap();
                            assert!(out
                                .chunks(1000)
                                .enumerate()
                                .all(|(q, b)| b[7] == val(9, q, 7)));
                        });
                    }
                });
                for c in &comms {
                    let singles = with_direct(c, |d| d.singles);
                    // Only a group of 2 lends (3 keep the windows, whose results are checked
                    // above all the same).
                    let want = if offs.is_empty() && n == 2 { blks.len() as u64 } else { 0 };
                    assert_eq!(singles, want, "{n} ranks, rank {} (off on {offs:?})", c.rank());
                }
            }
        }
    }

    #[test]
    fn an_all_gather_mixes_a_lender_and_a_rank_that_posts_its_pieces() {
        use tutti_runtime::testing::{groups, Kind};
        // Rank 1 lends nothing (as where the kernel cannot read its input through): it posts
        // its pieces, which rank 0 copies, while rank 0 lends and rank 1 takes its block.
        let n = 2;
        let comms: Vec<Comm> = groups(Kind::Mem, n).unwrap().into_iter().map(Comm::new).collect();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || c.with_algo(Algo::Direct).allreduce(&mut [1f32; 4], ReduceOp::Sum));
            }
        });
        let mut st = comms[1].sel.direct.lock();
        let State::Ready(d) = &mut *st else { panic!("direct reads are not set up") };
        d.lend_none = true;
        drop(st);
        let blk = 300_000;
        let val = |q: usize, i: usize| (q * 1_000_003 + i * 13) as i64;
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let (c, r) = (c.with_algo(Algo::Direct), c.rank());
                    let want: Vec<i64> =
                        (0..n).flat_map(|q| (0..blk).map(move |i| val(q, i))).collect();
                    let inp: Vec<i64> = (0..blk).map(|i| val(r, i)).collect();
                    let mut out = vec![0i64; n * blk];
                    c.allgather(&inp, &mut out).unwrap();
                    assert!(out == want, "rank {r}: out of place");
                    let mut buf = vec![-7i64; n * blk];
                    buf[r * blk..(r + 1) * blk].copy_from_slice(&inp);
                    c.allgather_inplace(&mut buf).unwrap();
                    assert!(buf == want, "rank {r}: in place");
                });
            }
        });
        assert_eq!(with_direct(&comms[0], |d| d.singles), 2);
        assert_eq!(with_direct(&comms[1], |d| d.singles), 0);
    }

    #[test]
    fn a_group_without_single_copies_keeps_large_all_to_alls_of_4_on_messages() {
        use crate::coll::Coll;
        // Off on one rank only: the set-up tells every rank, and every rank's choice follows.
        for off in [None, Some(3)] {
            let comms = single_copy_off_on(4, off.as_slice());
            std::thread::scope(|s| {
                for c in &comms {
                    s.spawn(move || {
                        c.with_algo(Algo::Direct).allreduce(&mut [1f32; 4], ReduceOp::Sum).unwrap()
                    });
                }
            });
            let want = if off.is_none() { Algo::Direct } else { Algo::Pairwise };
            for c in &comms {
                assert_eq!(c.sel.algo(Coll::AllToAll, 2 << 20, 4, true), want, "off on {off:?}");
                assert_eq!(c.sel.algo(Coll::AllToAll, 1 << 20, 4, true), Algo::Direct);
            }
        }
    }

    #[test]
    fn a_copy_from_an_owner_that_left_with_an_error_is_not_used() {
        use tutti_runtime::testing::{groups, Kind};
        // 2 ranks, 1 MiB blocks: single copies, two generations.
        let (n, blk) = (2, 1 << 17);
        let comms: Vec<Comm> = groups(Kind::Mem, n).unwrap().into_iter().map(Comm::new).collect();
        let inputs: Vec<Vec<i64>> = (0..n).map(|r| vec![r as i64 + 1; n * blk]).collect();
        std::thread::scope(|s| {
            for (c, input) in comms.iter().zip(&inputs) {
                s.spawn(move || {
                    let mut out = vec![0i64; n * blk];
                    c.with_algo(Algo::Direct).all_to_all(input, &mut out).unwrap();
                    assert!(out[..blk].iter().all(|x| *x == 1));
                    assert!(out[blk..].iter().all(|x| *x == 2));
                });
            }
        });
        assert!(comms.iter().all(|c| with_direct(c, |d| d.singles) == 1));
        let take = |d: &Direct| {
            // The call's first generation, where its lenders are learned.
            let (g, b) = (d.gen - 1, ((d.gen - 1) % 2) as usize);
            // SAFETY: our own stamp slot of that generation.
            let raw = unsafe { Direct::read_stamp(d.wins[0].stamp(b)) };
            let now = Moment::now();
            let call = Call {
                group: comms[0].group(),
                op_name: "all_to_all",
                desc: Header::decode(&raw).unwrap().desc,
                start: now,
                deadline: Deadline::after(now, Duration::from_secs(5)),
                bytes: 0,
            };
            let mut to = [0u8; 64];
            // SAFETY: `to` holds 64 bytes.
            let r = unsafe { d.take_lent(&call, 1, (g, b), 0, to.as_mut_ptr(), 64, 0) };
            (r, to)
        };
        // A piece of rank 1's input, taken again while it is lent: its bytes.
        let (r, to) = with_direct(&comms[0], take);
        r.expect("lent");
        assert_eq!(to[..8], 2i64.to_ne_bytes());
        // Rank 1 leaves as if with an error: its input is withdrawn, and a copy is refused,
        // naming it.
        with_direct(&comms[1], |d| drop(Lending::new(d, inputs[1].as_ptr() as u64)));
        let e = with_direct(&comms[0], take).0.unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("left the call with an error"), "{e}");
    }

    #[test]
    fn a_peer_gone_under_a_single_copy_is_named_and_nothing_it_lent_is_used() {
        use tutti_runtime::testing::{groups, Kind};
        let n = 4;
        let comms: Vec<Comm> = groups(Kind::Shm, n).unwrap().into_iter().map(Comm::new).collect();
        std::thread::scope(|s| {
            for c in &comms {
                c.group().set_timeout(Duration::from_secs(5));
                s.spawn(move || {
                    c.with_algo(Algo::Direct).allreduce(&mut [1f32; 4], ReduceOp::Sum).unwrap()
                });
            }
        });
        assert!(comms.iter().all(|c| with_direct(c, |d| d.single)), "single copies refused");
        // Rank w sees rank v's window owned by a process that ended (a pid of another
        // process, then none): w's read of v's block finds no owner.
        let (w, v, mut child) = a_pair_owned_by_a_child(&comms);
        child.kill().unwrap();
        child.wait().unwrap();
        let blk = 1 << 17; // 1 MiB of i64 per block
        let start = Instant::now();
        let outs: Vec<(Result<()>, Vec<i64>)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let input = vec![c.rank() as i64 + 1; n * blk];
                        let mut out = vec![-1i64; n * blk];
                        let r = c.with_algo(Algo::Direct).all_to_all(&input, &mut out);
                        (r.map(|_| ()), out)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let took = start.elapsed();
        let e = outs[w].0.as_ref().expect_err("the read from a gone owner must fail").to_string();
        assert!(e.contains(&format!("rank {v}")) && e.contains("seen by the kernel"), "{e}");
        // Nothing of v's block was taken from the other process: the output kept what the
        // read found there (none of it) or stayed as it was.
        let got = &outs[w].1[v * blk..(v + 1) * blk];
        assert!(got.iter().all(|x| *x == -1), "rank {w} kept bytes from the gone owner");
        // Rank w lent its own input in that call and left with the error: withdrawn (the slot
        // of the generation it failed in, and the other one if it lent it there too).
        let words = with_direct(&comms[w], |d| {
            [0, 1].map(|b| d.source_word(d.me, b).load(Ordering::SeqCst))
        });
        assert!(words.contains(&WITHDRAWN), "rank {w}'s lent input: {words:?}");
        assert!(words.iter().all(|x| [0, WITHDRAWN].contains(x)), "rank {w}: {words:?}");
        assert!(took < Duration::from_secs(10), "named after {took:?}");
    }

    /// On `comms`, set up for direct reads: ranks `w` and `v` that the set-up did not link,
    /// with `w` seeing `v`'s window as owned by the child returned (a `sleep`, for the caller
    /// to kill).
    fn a_pair_owned_by_a_child(comms: &[Comm]) -> (usize, usize, std::process::Child) {
        use tutti_runtime::window::Process;
        let n = comms.len();
        let (w, v) = (0..n)
            .flat_map(|a| (0..n).map(move |b| (a, b)))
            .find(|&(a, b)| a != b && !comms[a].group().transport().is_connected(b))
            .expect("a pair the set-up did not connect");
        let child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let mut st = comms[w].sel.direct.lock();
        let State::Ready(d) = &mut *st else { panic!("not set up") };
        d.wins[v].watch_as_owner(Process::watch(child.id()).unwrap());
        (w, v, child)
    }

    /// A wait on a peer this rank has no link to learns from the kernel that the peer's
    /// process ended (the windows' set-up connected only the links it used): 4 ranks as
    /// threads, a pair never connected, and the one's window watched as if a child process
    /// that is killed owned it. The other rank, waiting for it in a call, names it at the end
    /// of the grace after the kill, well before the call's deadline.
    #[test]
    fn a_wait_without_a_link_learns_from_the_kernel_that_its_peer_ended() {
        use tutti_runtime::testing::{groups, Kind};
        let gs = groups(Kind::Shm, 4).unwrap();
        let comms: Vec<Comm> = gs.into_iter().map(Comm::new).collect();
        // Set up direct reads; then find a pair that never connected.
        std::thread::scope(|s| {
            for c in &comms {
                c.group().set_timeout(Duration::from_secs(30));
                s.spawn(move || {
                    c.with_algo(Algo::Direct).allreduce(&mut [1f32; 4], ReduceOp::Sum).unwrap()
                });
            }
        });
        let (w, v, mut child) = a_pair_owned_by_a_child(&comms);
        child.kill().unwrap();
        // Rank w waits for rank v, which never comes (its thread makes no call); the others
        // make the call too.
        let start = Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .filter(|r| *r != v)
                .map(|r| {
                    let c = &comms[r];
                    s.spawn(move || {
                        c.with_algo(Algo::Direct)
                            .allreduce(&mut [1f32; 4], ReduceOp::Sum)
                            .unwrap_err()
                            .to_string()
                    })
                })
                .collect();
            let got = hs.into_iter().map(|h| h.join().unwrap()).collect();
            comms[v].group().abort("the test is done");
            got
        });
        child.wait().unwrap();
        let took = start.elapsed();
        let mine = &errs[(0..4).filter(|r| *r != v).position(|r| r == w).unwrap()];
        assert!(
            mine.contains(&format!("rank {v}")) && mine.contains("seen by the kernel"),
            "{mine}"
        );
        assert!(took < Duration::from_secs(10), "named after {took:?}");
    }

    #[test]
    fn buffers_keep_a_group_under_its_bound() {
        for n in [1, 2, 3, 4, 8, 64, 100, 128, 129, 256, 1000, 2048] {
            let b = buffer_for(n);
            assert!(b.is_power_of_two() && (64 << 10..=1 << 20).contains(&b), "{n}: {b}");
            assert!(n * (4096 + 2 * b) <= (256 << 20) + n * 4096, "{n} ranks: {b}");
        }
        assert_eq!(buffer_for(4), 1 << 20);
        assert_eq!(buffer_for(256), 512 << 10);
        // With the shared-memory links' rings (every pair connected, every ring filled), the
        // world's windows keep a host's ranks under 1 GiB, up to 111 ranks on one host.
        for w in 2..=111usize {
            let rings = w * (w - 1) / 2 * tutti_runtime::transport::tcp::shared_pair_bytes(w);
            let windows = w * (tutti_runtime::window::HEADER + 2 * buffer_for(w));
            assert!(rings + windows < 1 << 30, "{w} ranks: {rings} + {windows} bytes");
            if w == 64 {
                assert!(rings + windows < 645 << 20, "{w} ranks: {rings} + {windows} bytes");
            }
        }
    }
}
