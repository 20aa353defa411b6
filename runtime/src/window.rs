//! Windows: memory a rank publishes to the other ranks of its host, for collectives that read
//! their peers' memory directly instead of sending it.
//!
//! ```text
//! window (memfd, sealed against resizing), 68 KiB + data bytes
//!   0       stamp: magic, nonce (checked when a peer attaches)
//!   32      the owner's address of this mapping (for single-copy reads, see below)
//!   1024    COUNTERS counters (u64), each on its own cache line, written by the owner only
//!   1536    waiters: how many peers sleep on the window; 1600: the ticket (futex word),
//!           bumped at a publish that finds sleepers
//!   2048    STAMPS slots of STAMP_BYTES, written by the owner (what the data holds now)
//!   2560    LINES cells of CELL_BYTES, four to a cache line: a check word (u64), then
//!           CELL_DATA bytes (the smallest calls, whose readers find the next calls' cells
//!           in the cache line they already waited on)
//!   4096    LINES line slots of LINE_BYTES: a generation word (u64), then what the owner
//!           wrote for that generation (small calls carry their stamp and data here, so a
//!           reader finds both in the cache lines it waited on)
//!   69632   data
//! ```
//!
//! The owner writes its data, then [`publishes`](Window::publish) a counter (a release store);
//! a reader that [`waits`](Window::wait) until the counter reaches a value sees the data written
//! before it; a line slot's generation word works the same way
//! ([`Window::publish_line`], [`Window::wait_line`]), and so does a cell's check word
//! ([`Window::post_cell`], [`Window::wait_cell`]), except that a reader waits for one value
//! of it, not a value reached. A waiter spins for a moment, then sleeps
//! on the window (a futex on the shared page, so it works across processes) in slices, asking
//! its caller between slices whether to give up (a lost peer, an abort); the owner wakes
//! sleepers only when some are registered.
//!
//! Nothing read from a peer's window decides where this rank reads or writes: lengths and
//! offsets come from the caller, so a peer that writes garbage into its window gives wrong
//! numbers or a failed stamp check, never an access outside the mapping.
//!
//! A peer may also copy from the owner's own memory (its buffers) with one copy through the
//! kernel, where the kernel allows it ([`Window::read_owner`]: cross-memory attach). The owner
//! decides what to expose, by publishing an address in its window; a reader reads only there,
//! into its own memory at the offsets and lengths its caller gives.
//!
//! A window is made by [`Window::create`], which returns the [`Offer`] to send to the peers
//! over an authenticated link; each peer [`attaches`](Window::attach) it (see the `memfd`
//! checks: sealed, same user, right size, the nonce). The file has no name, and the kernel frees
//! it once the last process that mapped it has exited or unmapped it.

use std::cell::Cell;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::clock::{Deadline, Moment};
use crate::memfd::Mapping;

/// Bytes before the data.
pub const HEADER: usize = LINES_AT + LINES * LINE_BYTES;
/// Counters in a window.
pub const COUNTERS: usize = 4;
/// Stamp slots in a window.
pub const STAMPS: usize = 4;
/// Bytes of one stamp slot.
pub const STAMP_BYTES: usize = 64;
/// Line slots in a window: a small call that waits for nobody (a broadcast's root) may run
/// this many calls ahead of its slowest reader.
pub const LINES: usize = 32;
/// Bytes of one line slot, its generation word included.
pub const LINE_BYTES: usize = 2048;
/// Bytes of one cell, its check word included.
pub const CELL_BYTES: usize = 16;
/// Bytes of data a cell carries.
pub const CELL_DATA: usize = CELL_BYTES - 8;
/// Bytes of an encoded [`Offer`].
pub const OFFER_LEN: usize = 40;

const MAGIC: &[u8; 8] = b"TUTTIWIN";
/// Where the owner writes the address of its own mapping of the window (a `u64`, in its own
/// address space): a single-copy read reads the stamp back from there in the same system call.
const BASE_AT: usize = crate::memfd::STAMP;
const COUNTERS_AT: usize = 1024;
const _: () = assert!(BASE_AT + 8 <= COUNTERS_AT);
const WAITERS_AT: usize = COUNTERS_AT + 128 * COUNTERS;
const TICKET_AT: usize = WAITERS_AT + 64;
const STAMPS_AT: usize = 2048;
const _: () = assert!(TICKET_AT + 4 <= STAMPS_AT);
const CELLS_AT: usize = 2560;
const _: () = assert!(STAMPS_AT + STAMPS * STAMP_BYTES <= CELLS_AT && CELLS_AT.is_multiple_of(64));
const LINES_AT: usize = 4096;
const _: () = assert!(CELLS_AT + LINES * CELL_BYTES <= LINES_AT);
// Stamp slots start 8-byte aligned: a word at an 8-byte offset in one may be an atomic.
const _: () = assert!(STAMPS_AT.is_multiple_of(8) && STAMP_BYTES.is_multiple_of(8));
const _: () = assert!(HEADER.is_multiple_of(4096));
/// Largest data area a window may have (checked when attaching: an offer is untrusted).
pub const MAX_DATA: usize = 1 << 30;
/// Reads of the word between two reads of the clock while spinning hot.
const SPIN_CHECKS: u32 = 16;
/// Yields between two calls of the caller's check while spinning (tens of microseconds: an
/// abort ends a wait that keeps finding its peer busy).
const CHECK_EVERY: u32 = 32;

/// How a [`Window::wait`] spins before it sleeps: first `hot` without giving the CPU away
/// (where each rank has a core: the answer often comes within a microsecond), then `yielding`,
/// giving the CPU away before each look (where ranks share cores: the peer waited for may be
/// the one that runs next here; a yield costs far less than a sleep and a wake-up). The
/// caller's check runs every few dozen yields, and before each sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Spin {
    /// Spinning without yielding.
    pub hot: Duration,
    /// Then spinning with a yield before each look.
    pub yielding: Duration,
}
/// How long a sleeping waiter sleeps before it asks its caller again.
const SLICE: Duration = Duration::from_millis(2);
/// How long a sleeper first sleeps before it looks again: longer than any publish takes to
/// become visible, so a publish that missed its registration is found then.
const NAP: Duration = Duration::from_micros(500);

/// Why a window could not be made or attached. Not fatal: the collectives fall back to
/// messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shared window: {0}")]
pub struct WindowError(pub String);

/// Why a single-copy read of a window owner's memory ([`Window::read_owner`]) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The kernel does not allow such reads here (a `ptrace` policy such as Yama's, a seccomp
    /// filter, a kernel without them): the callers copy through the windows instead.
    #[error("single-copy reads refused: {0}")]
    Refused(String),
    /// The owner's process ended, or its pid names another process now.
    #[error("the window's owner is gone: {0}")]
    Gone(String),
    /// The range is not the owner's readable memory (a broken or hostile peer).
    #[error("single-copy read failed: {0}")]
    Fault(String),
}

/// What a peer needs to attach a window: the owner's process id, its descriptor number, the
/// data size and the nonce stamped in the window. It carries no secret (the kernel checks the
/// user); send it over the job's authenticated links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The owner's process id.
    pub pid: u32,
    /// The owner's descriptor of the window.
    pub fd: u32,
    /// Bytes of data.
    pub data_len: u64,
    /// The random stamp.
    pub nonce: [u8; 16],
}

impl Offer {
    /// The offer as [`OFFER_LEN`] bytes.
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.fd.to_le_bytes());
        b[8..16].copy_from_slice(&self.data_len.to_le_bytes());
        b[16..32].copy_from_slice(&self.nonce);
        b[32..40].copy_from_slice(MAGIC);
        b
    }

    /// Parse [`Offer::encode`]'s bytes.
    ///
    /// # Errors
    /// [`WindowError`] when `b` is not an offer (wrong length or magic, a size over
    /// [`MAX_DATA`]).
    pub fn decode(b: &[u8]) -> Result<Offer, WindowError> {
        if b.len() != OFFER_LEN || &b[32..40] != MAGIC {
            return Err(WindowError("not a window offer".into()));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a[..r.len()].copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        let data_len = word(8..16);
        if data_len > MAX_DATA as u64 {
            return Err(WindowError(format!("a window of {data_len} bytes is over the limit")));
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[16..32]);
        Ok(Offer { pid: word(0..4) as u32, fd: word(4..8) as u32, data_len, nonce })
    }
}

/// One window, this rank's own or a peer's, mapped; unmapped on drop.
pub struct Window {
    map: Mapping,
    data_len: usize,
    /// The owner keeps its descriptor while peers may still attach.
    fd: Option<OwnedFd>,
    /// A peer's window: its owner's process, as the kernel sees it.
    owner: Option<Process>,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("data_len", &self.data_len)
            .field("own", &self.fd.is_some())
            .field("owner", &self.owner)
            .finish()
    }
}

impl Window {
    /// A new window with `data_len` bytes of data, and the offer that lets the ranks of this
    /// host attach it.
    ///
    /// # Errors
    /// [`WindowError`] when the system refuses the memory (or `data_len` is over [`MAX_DATA`]).
    pub fn create(data_len: usize) -> Result<(Window, Offer), WindowError> {
        if data_len > MAX_DATA {
            return Err(WindowError(format!("a window of {data_len} bytes is over the limit")));
        }
        let nonce = crate::auth::random::<16>().map_err(|e| WindowError(e.to_string()))?;
        let (map, fd) = Mapping::create(c"tutti-window", HEADER + data_len, MAGIC, 0, &nonce)
            .map_err(WindowError)?;
        let base = (map.base() as u64).to_le_bytes();
        // SAFETY: inside the header page of our fresh mapping, which no peer has yet.
        unsafe { std::ptr::copy_nonoverlapping(base.as_ptr(), map.base().add(BASE_AT), 8) };
        let offer = Offer {
            pid: std::process::id(),
            fd: fd.as_raw_fd() as u32,
            data_len: data_len as u64,
            nonce,
        };
        Ok((Window { map, data_len, fd: Some(fd), owner: None }, offer))
    }

    /// Map the window a peer of this host offered, and watch its owner's process
    /// ([`Window::owner`]).
    ///
    /// # Errors
    /// [`WindowError`] when it cannot be opened (another host, another user, the owner gone) or
    /// is not the one offered.
    pub fn attach(offer: &Offer) -> Result<Window, WindowError> {
        let data_len = usize::try_from(offer.data_len)
            .ok()
            .filter(|l| *l <= MAX_DATA)
            .ok_or_else(|| WindowError("the offered window is over the limit".into()))?;
        // The process first, then its descriptor: the nonce found through `/proc/<pid>/fd`
        // proves that the process watched is the owner (had the owner ended in between, the
        // pid's new process would not hold the window).
        let owner = Process::watch(offer.pid).map_err(WindowError)?;
        let map = Mapping::attach(offer.pid, offer.fd, HEADER + data_len, MAGIC, 0, &offer.nonce)
            .map_err(WindowError)?;
        Ok(Window { map, data_len, fd: None, owner: Some(owner) })
    }

    /// Watch `owner` as this window's owner (tests: a real process that can be killed, where
    /// the ranks are threads of one process).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn watch_as_owner(&mut self, owner: Process) {
        self.owner = Some(owner);
    }

    /// The process that owns this window, for a window attached from a peer (`None` for this
    /// rank's own): whether it still runs tells a wait on the window whether to go on, where
    /// no link to the owner says it (see [`Process`]).
    pub fn owner(&self) -> Option<&Process> {
        self.owner.as_ref()
    }

    /// Copy `len` bytes at `addr` of the owner's memory (an address in the owner's own space,
    /// which the owner published) straight into `dst`: one copy, made by the kernel
    /// (cross-memory attach, `process_vm_readv`). Each system call it makes (more than one
    /// only after a short read) first reads the segment's stamp back from the owner's mapping
    /// of this window, at the address the owner wrote in it: a process that is not the owner
    /// (one that took its pid after it ended) does not pass. With `len` 0 it only checks that
    /// the kernel allows such reads here.
    ///
    /// Where this rank writes comes from the caller only; `addr` only says where to read in
    /// the owner's memory, which the kernel checks. A read that fails may have written part
    /// of `dst`: what it holds then is not data.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` bytes.
    ///
    /// # Errors
    /// [`ReadError`]: the kernel refuses such reads here (a `ptrace` policy, a seccomp filter,
    /// no support), the owner ended (however the read failed, once the kernel says its process
    /// ended or its pid names another), or the range is not the owner's readable memory.
    pub unsafe fn read_owner(&self, addr: u64, dst: *mut u8, len: usize) -> Result<(), ReadError> {
        let Some(owner) = &self.owner else {
            return Err(ReadError::Refused("a rank's own window has no other owner".into()));
        };
        let r = owner_read(&self.map, owner.pid(), addr, dst, len);
        // A process that no longer exists (or whose pid names another) is gone, however the
        // read failed: its window is not at the published address in a new process either.
        match r {
            Err(ReadError::Fault(e)) if matches!(owner.state(), ProcessState::Ended { .. }) => {
                Err(ReadError::Gone(e))
            }
            r => r,
        }
    }

    /// Close the owner's descriptor: no peer attaches any more (the mappings stay).
    pub fn seal_attachments(&mut self) {
        self.fd = None;
    }

    /// The first byte of the data.
    #[inline]
    pub fn data(&self) -> *mut u8 {
        // SAFETY: the data starts inside the mapping.
        unsafe { self.map.base().add(HEADER) }
    }

    /// Bytes of data.
    #[inline]
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// Stamp slot `i` (of [`STAMPS`]), [`STAMP_BYTES`] long, 8-byte aligned: the owner writes
    /// what its data holds, before publishing; readers check it.
    ///
    /// # Panics
    /// If `i` is not below [`STAMPS`].
    #[inline]
    pub fn stamp(&self, i: usize) -> *mut u8 {
        assert!(i < STAMPS, "stamp slot {i} of {STAMPS}");
        // SAFETY: inside the header page.
        unsafe { self.map.base().add(STAMPS_AT + i * STAMP_BYTES) }
    }

    #[inline]
    fn counter_ref(&self, i: usize) -> &AtomicU64 {
        assert!(i < COUNTERS, "counter {i} of {COUNTERS}");
        // SAFETY: inside the header page, 128-byte aligned, valid for the mapping's life; only
        // ever accessed atomically.
        unsafe { &*self.map.base().add(COUNTERS_AT + 128 * i).cast::<AtomicU64>() }
    }

    /// Line slot `i` (of [`LINES`]), [`LINE_BYTES`] long: its first 8 bytes are the slot's
    /// generation word (written only through [`Window::publish_line`]); the owner writes the
    /// rest before publishing, readers read it after [`Window::wait_line`].
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    #[inline]
    pub fn line(&self, i: usize) -> *mut u8 {
        assert!(i < LINES, "line slot {i} of {LINES}");
        // SAFETY: inside the header, cache-line aligned.
        unsafe { self.map.base().add(LINES_AT + i * LINE_BYTES) }
    }

    #[inline]
    fn line_ref(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the slot's first word, 8-byte aligned, valid for the mapping's life; only ever
        // accessed atomically.
        unsafe { &*self.line(i).cast::<AtomicU64>() }
    }

    /// Line slot `i`'s generation word now (an acquire load).
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    #[inline]
    pub fn line_gen(&self, i: usize) -> u64 {
        self.line_ref(i).load(Ordering::Acquire)
    }

    /// Set line slot `i`'s generation word (of this rank's own window) to `v`, as
    /// [`Window::publish`] sets a counter.
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    #[inline]
    pub fn publish_line(&self, i: usize, v: u64) {
        self.line_ref(i).store(v, Ordering::Release);
        self.wake();
    }

    /// Wait until line slot `i`'s generation word is at least `at_least`, as
    /// [`Window::wait`] waits for a counter.
    ///
    /// # Errors
    /// `check`'s.
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    pub fn wait_line<E>(
        &self,
        i: usize,
        at_least: u64,
        until: impl Into<Deadline>,
        spin: Spin,
        check: impl FnMut() -> Result<(), E>,
    ) -> Result<Option<u64>, E> {
        self.wait_word(self.line_ref(i), |v| v >= at_least, until.into(), spin, check)
    }

    /// Cell `i` (of [`LINES`]): a check word, then [`CELL_DATA`] bytes the owner writes before
    /// posting the cell ([`Window::post_cell`]); readers read them after [`Window::wait_cell`].
    /// Returns where the data starts.
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    #[inline]
    pub fn cell(&self, i: usize) -> *mut u8 {
        assert!(i < LINES, "cell {i} of {LINES}");
        // SAFETY: inside the header page; the cell's data follows its 8-byte word.
        unsafe { self.map.base().add(CELLS_AT + i * CELL_BYTES + 8) }
    }

    #[inline]
    fn cell_ref(&self, i: usize) -> &AtomicU64 {
        assert!(i < LINES, "cell {i} of {LINES}");
        // SAFETY: the cell's first word, 8-byte aligned, valid for the mapping's life; only
        // ever accessed atomically.
        unsafe { &*self.map.base().add(CELLS_AT + i * CELL_BYTES).cast::<AtomicU64>() }
    }

    /// Cell `i`'s check word now (an acquire load).
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    #[inline]
    pub fn cell_word(&self, i: usize) -> u64 {
        self.cell_ref(i).load(Ordering::Acquire)
    }

    /// Post cell `i` of this rank's own window: set line slot `i`'s generation word to `line`
    /// (the owner wrote the slot's stamp first), then the cell's check word to `word` (the
    /// owner wrote the cell's data first), and wake the peers sleeping on the window once. A
    /// reader that sees `word` sees both; one that waits on the line slot instead sees its
    /// generation and stamp.
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    #[inline]
    pub fn post_cell(&self, i: usize, line: u64, word: u64) {
        self.line_ref(i).store(line, Ordering::Release);
        self.cell_ref(i).store(word, Ordering::Release);
        self.wake();
    }

    /// Wait until cell `i`'s check word is `want`, as [`Window::wait`] waits for a counter
    /// to reach a value. A word is one value for one post (its caller makes it so), and the
    /// owner posts a cell again only once its readers are through with it, so the word waited
    /// for stays until then.
    ///
    /// # Errors
    /// `check`'s.
    ///
    /// # Panics
    /// If `i` is not below [`LINES`].
    pub fn wait_cell<E>(
        &self,
        i: usize,
        want: u64,
        until: impl Into<Deadline>,
        spin: Spin,
        check: impl FnMut() -> Result<(), E>,
    ) -> Result<Option<u64>, E> {
        self.wait_word(self.cell_ref(i), |v| v == want, until.into(), spin, check)
    }

    #[inline]
    fn waiters(&self) -> &AtomicU32 {
        // SAFETY: as `counter_ref`.
        unsafe { &*self.map.base().add(WAITERS_AT).cast::<AtomicU32>() }
    }

    /// The futex word: bumped by a publish that finds sleepers registered, so a sleeper that
    /// read it before that publish never sleeps through it (a counter's own bits may come back
    /// to an earlier value).
    #[inline]
    fn ticket(&self) -> &AtomicU32 {
        // SAFETY: as `counter_ref`.
        unsafe { &*self.map.base().add(TICKET_AT).cast::<AtomicU32>() }
    }

    /// Counter `i` now (an acquire load).
    ///
    /// # Panics
    /// If `i` is not below [`COUNTERS`].
    #[inline]
    pub fn counter(&self, i: usize) -> u64 {
        self.counter_ref(i).load(Ordering::Acquire)
    }

    /// Set counter `i` (of this rank's own window) to `v`: everything written before is seen by
    /// a reader that sees `v`. Wakes the peers sleeping on the window.
    ///
    /// # Panics
    /// If `i` is not below [`COUNTERS`].
    #[inline]
    pub fn publish(&self, i: usize, v: u64) {
        self.counter_ref(i).store(v, Ordering::Release);
        self.wake();
    }

    /// After a publishing store: wake the sleepers, if any. A sleeper registers (a SeqCst
    /// increment of *waiters*) before it reads the ticket and the word it waits on. The
    /// publisher's store is a plain release store, not fenced from its read of *waiters* (a
    /// fence there cost every small call a wait for its own stores): a publisher that reads
    /// *waiters* as the sleeper registers may miss it, so a sleeper first naps [`NAP`] and
    /// looks at the word again, by when any such publish is visible; a publish after that sees
    /// the registration and bumps the ticket (so a sleeper that read the old ticket does not
    /// sleep). No bump when nobody sleeps: the ticket's cache line stays put.
    #[inline]
    fn wake(&self) {
        if self.waiters().load(Ordering::Relaxed) != 0 {
            let t = self.ticket();
            t.fetch_add(1, Ordering::SeqCst);
            futex_wake(t.as_ptr());
        }
    }

    /// Wait until counter `i` is at least `at_least`: `Ok(Some(value))`; `Ok(None)` when
    /// `until` passes first. Spins as `spin` says, then
    /// sleeps in slices of a few milliseconds and calls `check` before each: its error ends the
    /// wait.
    ///
    /// # Errors
    /// `check`'s.
    ///
    /// # Panics
    /// If `i` is not below [`COUNTERS`].
    pub fn wait<E>(
        &self,
        i: usize,
        at_least: u64,
        until: impl Into<Deadline>,
        spin: Spin,
        check: impl FnMut() -> Result<(), E>,
    ) -> Result<Option<u64>, E> {
        self.wait_word(self.counter_ref(i), |v| v >= at_least, until.into(), spin, check)
    }

    fn wait_word<E>(
        &self,
        c: &AtomicU64,
        met: impl Fn(u64) -> bool,
        until: Deadline,
        spin: Spin,
        mut check: impl FnMut() -> Result<(), E>,
    ) -> Result<Option<u64>, E> {
        let v = c.load(Ordering::Acquire);
        if met(v) {
            return Ok(Some(v));
        }
        // Spin hot: the word is read after every pause (a pause is tens of nanoseconds, and
        // the answer of a peer on another core often comes within a microsecond), the clock
        // after every SPIN_CHECKS of them — first after them, so a short wait reads no clock.
        // Then give the CPU away before each look, for a peer that may share it.
        let looks = || {
            (0..SPIN_CHECKS).find_map(|_| {
                std::hint::spin_loop();
                Some(c.load(Ordering::Acquire)).filter(|v| met(*v))
            })
        };
        if !spin.hot.is_zero() {
            if let Some(v) = looks() {
                return Ok(Some(v));
            }
        }
        let start = Moment::now();
        while start.elapsed() < spin.hot {
            if let Some(v) = looks() {
                return Ok(Some(v));
            }
        }
        let mut yields = 0u32;
        while start.elapsed() < spin.hot + spin.yielding {
            std::thread::yield_now();
            let v = c.load(Ordering::Acquire);
            if met(v) {
                return Ok(Some(v));
            }
            yields += 1;
            if yields.is_multiple_of(CHECK_EVERY) {
                check()?;
            }
        }
        // The deadline as an instant only now, when the wait is about to sleep.
        let until = until.instant();
        loop {
            check()?;
            let now = Instant::now();
            if now >= until {
                let v = c.load(Ordering::Acquire);
                return Ok(met(v).then_some(v));
            }
            self.waiters().fetch_add(1, Ordering::SeqCst);
            let t = self.ticket().load(Ordering::SeqCst);
            let v = c.load(Ordering::SeqCst);
            if !met(v) {
                // A publish at the moment we registered may have missed us (its store is not
                // fenced from its look at *waiters*): nap, look again, then sleep on.
                futex_wait(self.ticket().as_ptr(), t, NAP.min(until - now));
                if !met(c.load(Ordering::Acquire)) {
                    let now = Instant::now();
                    if now < until {
                        futex_wait(self.ticket().as_ptr(), t, (SLICE - NAP).min(until - now));
                    }
                }
            }
            self.waiters().fetch_sub(1, Ordering::SeqCst);
            let v = c.load(Ordering::Acquire);
            if met(v) {
                return Ok(Some(v));
            }
        }
    }
}

fn futex_wait(word: *mut u32, seen: u32, for_: Duration) {
    let ts = libc::timespec {
        tv_sec: for_.as_secs() as libc::time_t,
        tv_nsec: for_.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` points into a live shared mapping, 4-byte aligned; the kernel only reads
    // it. A shared (not private) futex: the waker may be another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word,
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether the kernel's single-copy reads ([`Window::read_owner`]) can take `len` bytes at `p`
/// of this process's memory: its first and last bytes read through the kernel. Memory that the
/// kernel cannot pin for such a read (a device's mapping, say) answers no; a caller lends
/// memory only where it answers yes.
pub fn lendable(p: *const u8, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let mut two = [0u8; 2];
    let local = [libc::iovec { iov_base: two.as_mut_ptr().cast(), iov_len: 2 }];
    let remote = [
        libc::iovec { iov_base: p as *mut libc::c_void, iov_len: 1 },
        libc::iovec { iov_base: p.wrapping_add(len - 1) as *mut libc::c_void, iov_len: 1 },
    ];
    // SAFETY: the local vector is ours; the kernel checks the remote ones.
    let got =
        unsafe { libc::process_vm_readv(libc::getpid(), local.as_ptr(), 1, remote.as_ptr(), 2, 0) };
    got == 2
}

/// [`Window::read_owner`]'s reads from process `pid`, whose mapping of `map`'s segment the
/// address at `BASE_AT` names: each system call reads the segment's stamp there first, then as
/// much of the range as it can, until all of it is read.
fn owner_read(
    map: &Mapping,
    pid: u32,
    addr: u64,
    dst: *mut u8,
    len: usize,
) -> Result<(), ReadError> {
    let mut base = [0u8; 8];
    // SAFETY: inside the header page of our mapping.
    unsafe { std::ptr::copy_nonoverlapping(map.base().add(BASE_AT), base.as_mut_ptr(), 8) };
    let base = u64::from_le_bytes(base);
    // SAFETY: our mapping of the segment holds the stamp the owner's does.
    let ours = unsafe { std::slice::from_raw_parts(map.base(), crate::memfd::STAMP) };
    let mut stamp = [0u8; crate::memfd::STAMP];
    let mut at = 0usize;
    loop {
        let local = [
            libc::iovec { iov_base: stamp.as_mut_ptr().cast(), iov_len: stamp.len() },
            // SAFETY: inside `dst` (the caller's promise), or its end.
            libc::iovec { iov_base: unsafe { dst.add(at) }.cast(), iov_len: len - at },
        ];
        let remote = [
            libc::iovec { iov_base: base as usize as *mut libc::c_void, iov_len: stamp.len() },
            libc::iovec {
                iov_base: (addr as usize).wrapping_add(at) as *mut libc::c_void,
                iov_len: len - at,
            },
        ];
        // SAFETY: the local vectors are ours (`stamp`) or the caller's (`dst`); the kernel
        // checks the remote ones against the process's memory.
        let got = unsafe {
            libc::process_vm_readv(pid as libc::pid_t, local.as_ptr(), 2, remote.as_ptr(), 2, 0)
        };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            let what = format!("reading process {pid}'s memory: {e}");
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => ReadError::Gone(what),
                Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => ReadError::Refused(what),
                _ => ReadError::Fault(what),
            });
        }
        let got = got as usize;
        if got < stamp.len() {
            return Err(ReadError::Fault(format!(
                "process {pid}'s window is not at the address it published"
            )));
        }
        if stamp[..] != *ours {
            return Err(ReadError::Gone(format!(
                "process {pid} does not map the window it offered (it ended, or its pid names \
                 another process)"
            )));
        }
        at += got - stamp.len();
        if at >= len {
            return Ok(());
        }
        if got == stamp.len() {
            return Err(ReadError::Fault(format!(
                "process {pid}'s memory is readable for {at} of {len} bytes only"
            )));
        }
    }
}

fn futex_wake(word: *mut u32) {
    // SAFETY: as `futex_wait`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word,
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<u8>(),
            0,
            0,
        );
    }
}

/// A process of this host, watched through `/proc/<pid>/stat` (no descriptor held): whether it
/// runs, is stopped, or ended. The process is the one that ran when the watch began (its start
/// time is kept: a pid used again by a new process reads as ended).
#[derive(Debug)]
pub struct Process {
    pid: u32,
    start: u64,
    /// The last look: when, and what it found (the kernel is asked at most every
    /// [`LOOK_EVERY`], and no more once it found an end).
    last: Cell<Option<(Instant, Seen)>>,
    /// Since when the process has been seen stopped without a break.
    stopped: Cell<Option<Instant>>,
}

/// What a look at a process found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Running,
    Stopped,
    /// Gone from `/proc`, or a zombie (it exited or was killed; its parent has not reaped it)
    /// with no thread left.
    Ended,
    /// Its pid now names another process.
    Replaced,
}

/// How often [`Process::state`] reads `/proc` (a read costs a few microseconds; a wait asks
/// every few dozen yields).
const LOOK_EVERY: Duration = Duration::from_millis(5);

/// What the kernel says of a watched [`Process`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessState {
    /// It runs (or sleeps, or waits in the kernel).
    Running,
    /// It is stopped (SIGSTOP, a debugger), and has been without a break since this instant
    /// (the first look that saw it stopped).
    Stopped {
        /// The first look that saw it stopped.
        since: Instant,
    },
    /// It ended (or its pid now names another process).
    Ended {
        /// The first look that saw it ended.
        since: Instant,
        /// How it was seen to end.
        how: String,
    },
}

impl Process {
    /// Watch process `pid` as it runs now.
    ///
    /// # Errors
    /// When `/proc/<pid>/stat` cannot be read or parsed (no such process, another pid
    /// namespace).
    pub fn watch(pid: u32) -> Result<Process, String> {
        let (_, start) = stat(pid).map_err(|e| match e {
            Stat::Gone => format!("process {pid} cannot be watched: no such process"),
            Stat::Unreadable(e) => format!("process {pid} cannot be watched: {e}"),
        })?;
        Ok(Process { pid, start, last: Cell::new(None), stopped: Cell::new(None) })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// What the kernel says of the process now (read at most every few milliseconds; between
    /// reads, the last answer). Only a process gone from `/proc` (or replaced, or a zombie
    /// with no thread left) reads as ended: a read that fails otherwise (no descriptor left
    /// to open the file, say) keeps the last answer.
    pub fn state(&self) -> ProcessState {
        let now = Instant::now();
        // `at`: when the look that found `seen` was made (an end's stays its first look's).
        let (at, seen) = match self.last.get() {
            Some((at, seen)) if now.saturating_duration_since(at) < LOOK_EVERY => (at, seen),
            // An end is final: no more reads.
            Some(end @ (_, Seen::Ended | Seen::Replaced)) => end,
            last => {
                let was = last.map_or(Seen::Running, |(_, seen)| seen);
                let seen = match stat(self.pid) {
                    Ok((_, start)) if start != self.start => Seen::Replaced,
                    Ok(('T' | 't', _)) => Seen::Stopped,
                    // A zombie leader whose other threads still run is a live process.
                    Ok(('Z' | 'X' | 'x', _)) if !threads_left(self.pid) => Seen::Ended,
                    Ok(_) => Seen::Running,
                    Err(Stat::Gone) => Seen::Ended,
                    Err(Stat::Unreadable(_)) => was,
                };
                self.last.set(Some((now, seen)));
                (now, seen)
            }
        };
        if seen != Seen::Stopped {
            self.stopped.set(None);
        }
        match seen {
            Seen::Running => ProcessState::Running,
            Seen::Stopped => {
                let since = self.stopped.get().unwrap_or(now);
                self.stopped.set(Some(since));
                ProcessState::Stopped { since }
            }
            Seen::Ended | Seen::Replaced => {
                let how = if seen == Seen::Ended {
                    format!("process {} ended", self.pid)
                } else {
                    format!("process {} ended (its pid now names another process)", self.pid)
                };
                ProcessState::Ended { since: at, how }
            }
        }
    }
}

/// Why `/proc/<pid>/stat` gave no answer.
enum Stat {
    /// No such process (gone from `/proc`).
    Gone,
    /// Any other failure (no descriptor left, an unexpected format): says nothing of the
    /// process.
    Unreadable(String),
}

/// Whether process `pid` still has a thread other than its (zombie) leader.
fn threads_left(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|d| d.take(2).count() > 1)
}

/// The state letter and the start time (clock ticks since boot) of process `pid`, from
/// `/proc/<pid>/stat`: `pid (comm) S ppid … starttime …`, where `comm` may hold spaces and
/// parentheses, so the fields are counted after its last `)`.
fn stat(pid: u32) -> Result<(char, u64), Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) {
            Stat::Gone
        } else {
            Stat::Unreadable(e.to_string())
        }
    })?;
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let mut fields = rest.split_whitespace();
    let state = fields.next().and_then(|f| f.chars().next());
    // Field 22 (start time) is the 20th after the state (field 3).
    let start = fields.nth(18).and_then(|f| f.parse::<u64>().ok());
    match (state, start) {
        (Some(s), Some(t)) => Ok((s, t)),
        _ => Err(Stat::Unreadable(format!("/proc/{pid}/stat could not be parsed"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_sees_what_was_written_before_the_counter() {
        let (mine, offer) = Window::create(1 << 16).unwrap();
        let peer = Window::attach(&Offer::decode(&offer.encode()).unwrap()).unwrap();
        let t = std::thread::spawn(move || {
            let far = Instant::now() + Duration::from_secs(10);
            for g in 1..=200u64 {
                let v = peer.wait(0, g, far, Spin::default(), || Ok::<(), ()>(())).unwrap();
                assert!(v.is_some_and(|v| v >= g));
                // SAFETY: the owner wrote these bytes before publishing `g`, and does not write
                // again before we publish our counter below.
                let b = unsafe { std::slice::from_raw_parts(peer.data(), 1 << 16) };
                assert!(b.iter().all(|x| *x == g as u8), "generation {g}");
                peer.publish(1, g);
            }
            peer
        });
        let far = Instant::now() + Duration::from_secs(10);
        for g in 1..=200u64 {
            // SAFETY: the peer is done reading (it published generation g-1 on counter 1).
            unsafe { std::ptr::write_bytes(mine.data(), g as u8, 1 << 16) };
            mine.publish(0, g);
            let done = mine.wait(
                1,
                g,
                far,
                Spin { hot: Duration::from_micros(5), yielding: Duration::ZERO },
                || Ok::<(), ()>(()),
            );
            assert_eq!(done, Ok(Some(g)));
        }
        t.join().unwrap();
    }

    #[test]
    fn a_line_slot_carries_what_was_written_before_its_word_and_wakes_a_sleeper() {
        let (mine, offer) = Window::create(4096).unwrap();
        let peer = Window::attach(&offer).unwrap();
        // The peer never spins: every wait that is not already over sleeps on the futex, so a
        // publish that failed to wake it would cost the sleeper's 500 µs nap per generation.
        let t = std::thread::spawn(move || {
            let far = Instant::now() + Duration::from_secs(10);
            let mut took = Vec::with_capacity(1000);
            for g in 1..=1000u64 {
                let s = (g % 2) as usize;
                let t0 = Instant::now();
                let v = peer.wait_line(s, g, far, Spin::default(), || Ok::<(), ()>(())).unwrap();
                took.push(t0.elapsed());
                assert_eq!(v, Some(g));
                // SAFETY: written before the word; not written again before we publish `g`.
                let b = unsafe { std::slice::from_raw_parts(peer.line(s).add(8), LINE_BYTES - 8) };
                assert!(b.iter().all(|x| *x == g as u8), "generation {g}");
                peer.publish(0, g);
            }
            took.sort();
            took[took.len() / 2]
        });
        let far = Instant::now() + Duration::from_secs(10);
        for g in 1..=1000u64 {
            let s = (g % 2) as usize;
            // SAFETY: our own slot; the peer is done with generation g - 2 (it published g - 1).
            unsafe { std::ptr::write_bytes(mine.line(s).add(8), g as u8, LINE_BYTES - 8) };
            mine.publish_line(s, g);
            let hot = Spin { hot: Duration::from_micros(50), yielding: Duration::ZERO };
            assert_eq!(mine.wait(0, g, far, hot, || Ok::<(), ()>(())), Ok(Some(g)));
        }
        let median = t.join().unwrap();
        assert!(median < Duration::from_micros(250), "the median wait took {median:?}");
    }

    #[test]
    fn a_cell_carries_what_was_written_before_its_word_and_wakes_a_sleeper() {
        let (mine, offer) = Window::create(4096).unwrap();
        let peer = Window::attach(&offer).unwrap();
        // Cells of consecutive generations share cache lines; the peer sleeps on every wait
        // not already over (as in the line slot test), and checks the line slot's generation
        // and the data behind the word.
        let word = |g: u64| g.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let t = std::thread::spawn(move || {
            let far = Instant::now() + Duration::from_secs(10);
            for g in 1..=1000u64 {
                let s = (g % LINES as u64) as usize;
                let v = peer.wait_cell(s, word(g), far, Spin::default(), || Ok::<(), ()>(()));
                assert_eq!(v, Ok(Some(word(g))), "generation {g}");
                assert_eq!(peer.line_gen(s), g, "the line slot's generation comes first");
                // SAFETY: written before the word; not written again before we publish `g`.
                let b = unsafe { std::slice::from_raw_parts(peer.cell(s), CELL_DATA) };
                assert_eq!(b, &(g * 3).to_le_bytes(), "generation {g}");
                peer.publish(0, g);
            }
        });
        let far = Instant::now() + Duration::from_secs(10);
        for g in 1..=1000u64 {
            let s = (g % LINES as u64) as usize;
            if g > LINES as u64 {
                let free = g - LINES as u64;
                let hot = Spin { hot: Duration::from_micros(50), yielding: Duration::ZERO };
                assert_eq!(
                    mine.wait(0, free, far, hot, || Ok::<(), ()>(())).map(|v| v.is_some()),
                    Ok(true)
                );
            }
            // SAFETY: our own cell; the peer is done with its previous generation.
            unsafe {
                std::ptr::copy_nonoverlapping((g * 3).to_le_bytes().as_ptr(), mine.cell(s), 8)
            };
            mine.post_cell(s, g, word(g));
        }
        t.join().unwrap();
        // Another word (here an earlier post's) does not end the wait.
        let r = mine.wait_cell(
            1,
            word(2),
            Instant::now() + Duration::from_millis(20),
            Spin::default(),
            || Ok::<(), ()>(()),
        );
        assert_eq!(r, Ok(None));
    }

    #[test]
    fn a_wait_ends_at_its_deadline_or_when_its_caller_says_so() {
        let (w, _) = Window::create(64).unwrap();
        let t0 = Instant::now();
        let r = w.wait(2, 1, t0 + Duration::from_millis(30), Spin::default(), || Ok::<(), ()>(()));
        assert_eq!(r, Ok(None));
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let mut calls = 0;
        let r = w.wait(2, 1, t0 + Duration::from_secs(10), Spin::default(), || {
            calls += 1;
            if calls == 3 {
                Err("peer lost")
            } else {
                Ok(())
            }
        });
        assert_eq!(r, Err("peer lost"));
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn attach_refuses_what_was_not_offered() {
        let (w, offer) = Window::create(4096).unwrap();
        let mut wrong = offer;
        wrong.nonce[0] ^= 1;
        assert!(Window::attach(&wrong).is_err(), "another nonce");
        let mut wrong = offer;
        wrong.data_len += 4096;
        assert!(Window::attach(&wrong).is_err(), "another size");
        let mut bytes = offer.encode();
        bytes[35] ^= 1;
        assert!(Offer::decode(&bytes).is_err(), "not an offer");
        let mut big = offer;
        big.data_len = MAX_DATA as u64 + 1;
        assert!(Offer::decode(&big.encode()).is_err(), "over the limit");
        // Once sealed, the descriptor is gone: nobody attaches any more.
        let mut w = w;
        w.seal_attachments();
        assert!(Window::attach(&offer).is_err());
    }

    #[test]
    fn a_single_copy_read_takes_the_owners_bytes_and_checks_the_owner() {
        // Owner and reader in one process: the kernel's read of "the owner's memory" is of
        // this process, which is what a peer's read is of the owner's.
        let (mine, offer) = Window::create(4096).unwrap();
        let peer = Window::attach(&offer).unwrap();
        let src: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // SAFETY: `dst` holds `src.len()` bytes.
        unsafe { peer.read_owner(src.as_ptr() as u64, dst.as_mut_ptr(), src.len()) }.unwrap();
        assert_eq!(dst, src);
        // SAFETY: nothing is written with a length of 0.
        unsafe { peer.read_owner(0, dst.as_mut_ptr(), 0) }.unwrap();
        // An address outside the owner's memory is a fault, never a read of ours.
        // SAFETY: as above.
        let e = unsafe { peer.read_owner(8, dst.as_mut_ptr(), 16) }.unwrap_err();
        assert!(matches!(e, ReadError::Fault(_)), "{e}");
        // A range that runs off the owner's memory: a fault, after what could be read.
        // SAFETY: two fresh private pages, the second made unreadable; unmapped below.
        let e = unsafe {
            let (rw, none) = (libc::PROT_READ | libc::PROT_WRITE, libc::PROT_NONE);
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
            let p = libc::mmap(std::ptr::null_mut(), 8192, rw, flags, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::mprotect(p.cast::<u8>().add(4096).cast(), 4096, none), 0);
            // The last 100 bytes of the readable page, then the unreadable one.
            let e = peer.read_owner(p as u64 + 4096 - 100, dst.as_mut_ptr(), 200);
            libc::munmap(p, 8192);
            e
        };
        assert!(matches!(e, Err(ReadError::Fault(_))), "{e:?}");
        // A process whose memory at the published address does not hold the window's stamp
        // is not the owner: here, the owner's address of its mapping rewritten.
        let other = [0u8; 64];
        let at = (other.as_ptr() as u64).to_le_bytes();
        // SAFETY: the header of our own window (the peer's mapping of it shows the same).
        unsafe { std::ptr::copy_nonoverlapping(at.as_ptr(), mine.map.base().add(BASE_AT), 8) };
        // SAFETY: as above.
        let e = unsafe { peer.read_owner(src.as_ptr() as u64, dst.as_mut_ptr(), 16) };
        assert!(matches!(e, Err(ReadError::Gone(_))), "{e:?}");
        // What this process lends must be readable through the kernel: its buffers are, an
        // unreadable page is not.
        assert!(lendable(src.as_ptr(), src.len()) && lendable(std::ptr::null(), 0));
        // SAFETY: one fresh page made unreadable; unmapped below.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            assert!(!lendable(p.cast(), 4096));
            libc::munmap(p, 4096);
        }
        // A rank's own window has no owner to read from.
        // SAFETY: as above.
        let e = unsafe { mine.read_owner(src.as_ptr() as u64, dst.as_mut_ptr(), 16) };
        assert!(matches!(e, Err(ReadError::Refused(_))), "{e:?}");
    }

    /// Waits until `p`'s state (read afresh, past the look cache) satisfies `ok`.
    fn until(p: &Process, ok: impl Fn(&ProcessState) -> bool) -> ProcessState {
        let far = Instant::now() + Duration::from_secs(10);
        loop {
            let st = p.state();
            if ok(&st) || Instant::now() > far {
                return st;
            }
            std::thread::sleep(LOOK_EVERY);
        }
    }

    #[test]
    fn a_watched_process_reads_running_stopped_and_ended() {
        assert_eq!(Process::watch(std::process::id()).unwrap().state(), ProcessState::Running);
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let p = Process::watch(pid).unwrap();
        assert_eq!(p.state(), ProcessState::Running);
        // SAFETY: signalling our own child, which has not been reaped.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let st = until(&p, |s| matches!(s, ProcessState::Stopped { .. }));
        let ProcessState::Stopped { since } = st else { panic!("{st:?}") };
        // Seen stopped without a break: the first look's instant stays.
        std::thread::sleep(LOOK_EVERY * 2);
        assert_eq!(p.state(), ProcessState::Stopped { since });
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        assert_eq!(until(&p, |s| *s == ProcessState::Running), ProcessState::Running);
        // Killed and not reaped (a zombie), then reaped (gone from /proc): ended both times.
        child.kill().unwrap();
        let st = until(&p, |s| matches!(s, ProcessState::Ended { .. }));
        let ProcessState::Ended { since, how } = st else { panic!("{st:?}") };
        assert!(how.contains(&pid.to_string()), "{how}");
        // Reaped (gone from /proc): still ended, since the first look that saw it.
        child.wait().unwrap();
        std::thread::sleep(LOOK_EVERY * 2);
        assert!(matches!(p.state(), ProcessState::Ended { since: s, .. } if s == since));
        // A pid that names a process started at another time is not the one watched.
        let me = Process::watch(std::process::id()).unwrap();
        let other = Process { start: me.start + 1, ..Process::watch(me.pid).unwrap() };
        assert!(
            matches!(other.state(), ProcessState::Ended { how, .. } if how.contains("another process"))
        );
        assert!(Process::watch(u32::MAX).is_err());
        // The start time is the right field: clock ticks since boot, the child's after ours,
        // both within the last ten minutes (this test's process is that young).
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
        let up: f64 = uptime.split(' ').next().unwrap().parse().unwrap();
        assert!(p.start >= me.start, "{} before {}", p.start, me.start);
        for t in [me.start, p.start] {
            let secs = t as f64 / hz;
            assert!(secs <= up + 1.0 && secs >= up - 600.0, "start {secs} s, uptime {up} s");
        }
    }
}
