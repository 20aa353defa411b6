//! Shared-memory links: how two ranks on one host move their frames without the network stack.
//!
//! Two ranks whose connection shows them on the same host (the same kernel boot, network and
//! pid namespaces) keep their authenticated TCP connection, but their frames travel through a
//! pair of rings in one shared segment; the socket carries only wake-ups and the end of the link.
//! The connection core above is untouched: it sees the same byte stream of frames, so framing,
//! matching, flow control, deadlines, keep-alives, aborts and the mismatch checks are the
//! production code, whichever way the bytes went.
//!
//! ```text
//! segment (memfd, sealed against resizing), 4 KiB + 2 × R bytes, R = ring_for(world)
//!   page 0      magic, nonce, ring size; each ring's control block:
//!               head (writer's position), tail (reader's position), reader-sleeps, writer-waits,
//!               each on its own cache line
//!   ring 0      server → client (the rank dialled → the rank that dialled), R bytes
//!   ring 1      client → server, R bytes
//! ```
//!
//! Positions count bytes ever written and read (`u64`), so `head - tail` is what the ring holds.
//! The writer copies bytes in, then publishes its head (release); the reader sees only published
//! bytes, so nothing is read half written. Each side keeps its own position privately and only
//! checks the peer's: a peer that writes garbage into the control block is a named protocol
//! error, never a read or write outside the ring; garbage in the ring's bytes is caught by the
//! core's frame checks, as garbage on a socket is.
//!
//! **Waking.** A waiting rank spins on the rings first (the engine's spin). Before it sleeps it
//! sets *reader-sleeps* on the rings it reads (and *writer-waits* on a full ring it writes), then
//! looks again; a writer that publishes, or a reader that makes room, and finds the flag set clears
//! it and writes one byte to the socket, which wakes the sleeper's `poll`. Ranks that keep each
//! other busy never write a wake-up (they only yield the CPU while they spin).
//!
//! **Set-up** ([`server_side`], [`client_side`]), on every connection right after the handshake
//! authenticated it, within the handshake's deadline:
//! the rank dialled (the handshake's server) creates the pair's segment and offers it, right
//! behind the handshake's last answer, with where it runs, its process id, the segment's
//! descriptor number and a random nonce; the dialling rank, on the same host, opens
//! `/proc/<pid>/fd/<n>` (the kernel allows that only to the same user or root), checks the
//! seals, the owner, the size and the nonce, and says whether it attached. The dialling rank
//! waits for nothing more than the handshake did. The segment has no name: no process of another user can open it, and
//! it is freed by the kernel when both have exited, however they ended. Any failure on the way
//! leaves the pair on TCP.
//!
//! **Memory.** One segment per pair of same-host ranks that are connected, of which only the
//! pages touched are allocated: a 4 KiB header page and at most `2 × R` per pair, with the ring
//! size R from the job's world size `w` ([`ring_for`]): the largest power of two at most
//! 768 MiB / (w (w − 1)), between 64 KiB and 1 MiB. So however many of a job's ranks share a
//! host, their rings hold at most 768 MiB (up to 111 ranks on one host; 64 ranks: R = 128 KiB,
//! 504 MiB), which leaves room under 1 GiB for the header pages and the world's windows for
//! direct reads (`window.rs`), and a small job (up to 28 ranks) gets 1 MiB rings, which a 2 MiB
//! collective crosses in two ring-fulls instead of eight.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::memfd::Mapping;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// Smallest ring ([`ring_for`]).
pub(crate) const RING_MIN: usize = 64 << 10;
/// Largest ring: larger ones measured no faster (2 and 64 MiB collectives, 2 ranks).
pub(crate) const RING_MAX: usize = 1 << 20;
/// What all the rings of a job on one host may hold together ([`ring_for`]): three quarters
/// of a GiB, so that with the header pages and the world's windows (132.3 MiB at 64 ranks) a
/// host's ranks stay under 1 GiB, up to 111 ranks on one host (a unit test checks the sum).
const RING_BUDGET: usize = 768 << 20;
/// Most bytes copied into or out of a ring between two publications of a position: the
/// writer and the reader work on different pieces of the ring at once instead of taking turns
/// over the whole of it.
pub(crate) const PIECE_BYTES: usize = 32 << 10;
/// Bytes of the first page: header and control blocks.
const HEAD_PAGE: usize = 4096;
/// Bytes of each direction's ring in a job of `world` ranks: the largest power of two that
/// lets every pair of the job, all on one host, hold at most [`RING_BUDGET`] in rings, within
/// [`RING_MIN`]..=[`RING_MAX`].
pub(crate) fn ring_for(world: usize) -> usize {
    let pairs = world.max(2) * (world.max(2) - 1);
    let fit = RING_BUDGET / pairs;
    let pow2 = if fit == 0 { 0 } else { 1usize << (usize::BITS - 1 - fit.leading_zeros()) };
    pow2.clamp(RING_MIN, RING_MAX)
}

/// Bytes of one pair's segment with rings of `ring` bytes.
pub(crate) fn segment_bytes(ring: usize) -> usize {
    HEAD_PAGE + 2 * ring
}
/// Magic at the start of a segment.
const SEG_MAGIC: &[u8; 8] = b"TUTTISEG";
/// Where each ring's control block starts in the first page.
const CTL_AT: [usize; 2] = [1024, 2048];

/// One cache line (two on some machines' prefetchers) for one field.
#[repr(C, align(128))]
struct Line<T>(T);

/// One ring's shared positions and flags.
#[repr(C)]
struct RingCtl {
    /// Bytes the writer has published.
    head: Line<AtomicU64>,
    /// Bytes the reader has consumed.
    tail: Line<AtomicU64>,
    /// The reader is about to sleep: the writer wakes it after publishing.
    reader_sleeps: Line<AtomicU32>,
    /// The writer found the ring full and is about to sleep: the reader wakes it after reading.
    writer_waits: Line<AtomicU32>,
}

const _: () = assert!(size_of::<RingCtl>() <= CTL_AT[1] - CTL_AT[0]);
const _: () = assert!(CTL_AT[1] + size_of::<RingCtl>() <= HEAD_PAGE);

/// A mapped segment (unmapped on drop) with rings of `ring` bytes.
struct Segment {
    map: Mapping,
    /// Bytes of each ring (a power of two, checked when attaching).
    ring: usize,
}

impl Segment {
    /// A new segment stamped with `nonce`, and its descriptor (sealed against resizing, so the
    /// peer cannot shrink it under our mapping).
    fn create(nonce: &[u8; 16], ring: usize) -> Result<(Segment, OwnedFd), String> {
        let (map, fd) =
            Mapping::create(c"tutti-shm", segment_bytes(ring), SEG_MAGIC, ring as u32, nonce)?;
        Ok((Segment { map, ring }, fd))
    }

    /// Open the segment the peer `pid` holds as descriptor `fd`, and check it is the one it
    /// stamped with `nonce`: ours to use, of the right size, sealed.
    fn attach(pid: u32, fd: u32, nonce: &[u8; 16], ring: usize) -> Result<Segment, String> {
        if !ring.is_power_of_two() || !(RING_MIN..=RING_MAX).contains(&ring) {
            return Err(format!("the peer's ring size {ring} is not one we use"));
        }
        let map = Mapping::attach(pid, fd, segment_bytes(ring), SEG_MAGIC, ring as u32, nonce)?;
        Ok(Segment { map, ring })
    }

    fn ctl(&self, ring: usize) -> &RingCtl {
        // SAFETY: inside the first page, aligned (page-aligned base + multiple of 128), valid for
        // the mapping's life; every field is an atomic, so sharing it is sound.
        unsafe { &*self.map.base().add(CTL_AT[ring]).cast::<RingCtl>() }
    }

    fn data(&self, ring: usize) -> *mut u8 {
        // SAFETY: ring `ring`'s bytes lie inside the mapping.
        unsafe { self.map.base().add(HEAD_PAGE + ring * self.ring) }
    }
}

/// This rank's side of one shared-memory link.
pub(crate) struct ShmLink {
    seg: Segment,
    /// The ring we write and the one we read.
    tx: usize,
    rx: usize,
    /// What we published (the shared head of our ring is checked against it, never trusted).
    tx_head: u64,
    /// What we consumed.
    rx_tail: u64,
    /// The peer ended the link (its socket reached its end): what the ring holds is all.
    pub(crate) peer_eof: bool,
    /// Bytes copied in and out, ever (a waiting rank spins on while it grows).
    pub(crate) moved: u64,
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLink").field("tx", &self.tx).field("tx_head", &self.tx_head).finish()
    }
}

/// Copy `n` bytes into `ring` (of `size` bytes) at position `pos`, wrapping.
///
/// # Safety
/// `src` is readable for `n <= size` bytes; `ring` is writable for `size` bytes.
unsafe fn copy_in(ring: *mut u8, size: usize, pos: u64, src: *const u8, n: usize) {
    let at = (pos % size as u64) as usize;
    let first = n.min(size - at);
    // SAFETY: `at + first <= size` and `n - first <= at`; the caller vouches for `src`.
    unsafe {
        std::ptr::copy_nonoverlapping(src, ring.add(at), first);
        std::ptr::copy_nonoverlapping(src.add(first), ring, n - first);
    }
}

/// Copy `n` bytes out of `ring` (of `size` bytes) from position `pos`, wrapping.
///
/// # Safety
/// `dst` is writable for `n <= size` bytes; `ring` is readable for `size` bytes.
unsafe fn copy_out(ring: *const u8, size: usize, pos: u64, dst: *mut u8, n: usize) {
    let at = (pos % size as u64) as usize;
    let first = n.min(size - at);
    // SAFETY: as in `copy_in`.
    unsafe {
        std::ptr::copy_nonoverlapping(ring.add(at), dst, first);
        std::ptr::copy_nonoverlapping(ring, dst.add(first), n - first);
    }
}

/// Publish our position `pos = to` (release), then take the peer's request for a wake-up, if
/// it made one: true when it did, and this side must wake it. With [`ask`] on the other side,
/// the two fences make sure that of a request and a position stored at the same time, at least
/// one is seen: a sleeper is never left without its wake-up.
fn advance(pos: &AtomicU64, to: u64, asks: &AtomicU32) -> bool {
    pos.store(to, Ordering::Release);
    fence(Ordering::SeqCst);
    asks.load(Ordering::Relaxed) != 0 && asks.swap(0, Ordering::AcqRel) != 0
}

/// Ask the peer for a wake-up (before looking at its position once more, then sleeping).
fn ask(flag: &AtomicU32) {
    flag.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

impl ShmLink {
    fn new(seg: Segment, server: bool) -> ShmLink {
        let tx = usize::from(!server);
        ShmLink { seg, tx, rx: 1 - tx, tx_head: 0, rx_tail: 0, peer_eof: false, moved: 0 }
    }

    /// Free bytes in the ring we write. Errors when the peer's read position is impossible.
    pub(crate) fn room(&self) -> Result<usize, String> {
        let tail = self.seg.ctl(self.tx).tail.0.load(Ordering::Acquire);
        let used = self.tx_head.wrapping_sub(tail);
        let size = self.seg.ring;
        if used > size as u64 {
            return Err(format!(
                "the peer's read position in the shared ring ({tail}) is not within \
                 {size} bytes behind what we wrote ({}): the peer corrupted the segment",
                self.tx_head
            ));
        }
        Ok(size - used as usize)
    }

    /// Published bytes not yet read. Errors when the peer's write position is impossible.
    pub(crate) fn avail(&self) -> Result<usize, String> {
        let head = self.seg.ctl(self.rx).head.0.load(Ordering::Acquire);
        let n = head.wrapping_sub(self.rx_tail);
        let size = self.seg.ring;
        if n > size as u64 {
            return Err(format!(
                "the peer's write position in the shared ring ({head}) is not within \
                 {size} bytes ahead of what we read ({}): the peer corrupted the segment",
                self.rx_tail
            ));
        }
        Ok(n as usize)
    }

    /// Copy `n` bytes into our ring, after what is there; invisible until [`ShmLink::publish`].
    ///
    /// # Safety
    /// `src` is readable for `n` bytes, and `n` is at most the [`ShmLink::room`] left.
    pub(crate) unsafe fn put(&mut self, src: *const u8, n: usize) {
        // SAFETY: the caller vouches for `src` and `n <= room <= ring`.
        unsafe { copy_in(self.seg.data(self.tx), self.seg.ring, self.tx_head, src, n) };
        self.tx_head += n as u64;
        self.moved += n as u64;
    }

    /// Make what was put readable. True when the reader sleeps and must be woken.
    pub(crate) fn publish(&mut self) -> bool {
        let c = self.seg.ctl(self.tx);
        advance(&c.head.0, self.tx_head, &c.reader_sleeps.0)
    }

    /// Copy `n` published bytes out; they stay held until [`ShmLink::release`].
    ///
    /// # Safety
    /// `dst` is writable for `n` bytes, and `n` is at most [`ShmLink::avail`].
    pub(crate) unsafe fn take(&mut self, dst: *mut u8, n: usize) {
        // SAFETY: the caller vouches for `dst` and `n <= avail <= ring`.
        unsafe { copy_out(self.seg.data(self.rx), self.seg.ring, self.rx_tail, dst, n) };
        self.rx_tail += n as u64;
        self.moved += n as u64;
    }

    /// Copy the first published bytes into `dst` without consuming them; returns how many.
    pub(crate) fn peek(&self, dst: &mut [u8]) -> usize {
        let n = self.avail().unwrap_or(0).min(dst.len());
        // SAFETY: `n` bytes fit `dst` and are published.
        unsafe {
            copy_out(self.seg.data(self.rx), self.seg.ring, self.rx_tail, dst.as_mut_ptr(), n)
        };
        n
    }

    /// Drop `n` published bytes unread (shutdown); `n` is at most [`ShmLink::avail`].
    pub(crate) fn skip(&mut self, n: usize) {
        self.rx_tail += n as u64;
    }

    /// Give the bytes taken back to the writer. True when it waits for room and must be woken.
    pub(crate) fn release(&mut self) -> bool {
        let c = self.seg.ctl(self.rx);
        advance(&c.tail.0, self.rx_tail, &c.writer_waits.0)
    }

    /// About to sleep for input: ask the writer for a wake-up. True when there is input already
    /// (or the ring is corrupt, which the next read reports): do not sleep.
    pub(crate) fn arm_rx(&self) -> bool {
        ask(&self.seg.ctl(self.rx).reader_sleeps.0);
        self.avail().map_or(true, |n| n > 0)
    }

    /// About to sleep for room: ask the reader for a wake-up. True when there is room already
    /// (or the ring is corrupt): do not sleep.
    pub(crate) fn arm_tx(&self) -> bool {
        ask(&self.seg.ctl(self.tx).writer_waits.0);
        self.room().map_or(true, |n| n > 0)
    }
}

/// Wake the peer's `poll` through the link's socket. A full socket already holds a wake-up.
pub(crate) fn wake(fd: RawFd) {
    let b = 1u8;
    // SAFETY: sending one byte from a local on our socket, never blocking.
    unsafe { libc::send(fd, (&b as *const u8).cast(), 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
}

/// Consume the wake-ups waiting on a shared-memory link's socket. Returns true when the peer
/// ended its side (or the socket broke): what its ring holds is then all there will be.
pub(crate) fn drain_wakes(fd: RawFd) -> bool {
    let mut sink = [0u8; 64];
    loop {
        // SAFETY: reading into a local buffer, never blocking.
        let r = unsafe { libc::recv(fd, sink.as_mut_ptr().cast(), sink.len(), libc::MSG_DONTWAIT) };
        if r == 0 {
            return true;
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock => false,
                std::io::ErrorKind::Interrupted => continue,
                _ => true,
            };
        }
        if (r as usize) < sink.len() {
            return false;
        }
    }
}

/// Where this process runs, as far as sharing memory goes: the kernel's boot id and the network
/// and pid namespaces. Ranks with equal ids share memory; in different network namespaces (the
/// namespace cluster's hosts, containers) they are different hosts.
pub(crate) fn host_id() -> [u8; 32] {
    use std::os::unix::fs::MetadataExt;
    let mut id = [0u8; 32];
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: Vec<u8> =
        boot.bytes().filter_map(|c| (c as char).to_digit(16).map(|d| d as u8)).collect();
    for (i, pair) in hex.chunks(2).take(16).enumerate() {
        id[i] = pair.iter().fold(0, |a, d| a * 16 + d);
    }
    let ino = |p: &str| std::fs::metadata(p).map(|m| m.ino()).unwrap_or(0);
    id[16..24].copy_from_slice(&ino("/proc/self/ns/net").to_le_bytes());
    id[24..32].copy_from_slice(&ino("/proc/self/ns/pid").to_le_bytes());
    id
}

/// [`host_id`], or `None` when the boot id or a namespace cannot be read: then nothing tells which
/// processes share this host (a QUIC job then links no pair through shared memory; TCP's
/// set-up still checks the segment itself).
#[cfg_attr(not(feature = "quic"), allow(dead_code))]
pub(crate) fn known_host_id() -> Option<[u8; 32]> {
    let id = host_id();
    let part = |r: std::ops::Range<usize>| id[r].iter().any(|b| *b != 0);
    (part(0..16) && part(16..24) && part(24..32)).then_some(id)
}

/// Magic of a set-up message.
const MSG_MAGIC: &[u8; 8] = b"TUTTISM1";
/// Length of a set-up message.
pub(crate) const MSG_LEN: usize = 80;

/// Which step of the set-up a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Server → client: where it runs and the segment it made (or none).
    Offer = 1,
    /// Client → server: attached (or not).
    Ack = 2,
}

/// One set-up message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SetupMsg {
    pub(crate) step: Step,
    /// Offer: shared memory wanted; Segment: one was made; Ack: attached.
    pub(crate) yes: bool,
    pub(crate) pid: u32,
    pub(crate) fd: u32,
    pub(crate) ring: u32,
    pub(crate) host: [u8; 32],
    pub(crate) nonce: [u8; 16],
}

impl SetupMsg {
    fn new(step: Step, yes: bool, ring: usize) -> SetupMsg {
        SetupMsg {
            step,
            yes,
            pid: std::process::id(),
            fd: 0,
            ring: ring as u32,
            host: [0; 32],
            nonce: [0; 16],
        }
    }

    pub(crate) fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[..8].copy_from_slice(MSG_MAGIC);
        b[8] = self.step as u8;
        b[9] = u8::from(self.yes);
        b[12..16].copy_from_slice(&self.pid.to_le_bytes());
        b[16..20].copy_from_slice(&self.fd.to_le_bytes());
        b[20..24].copy_from_slice(&self.ring.to_le_bytes());
        b[24..56].copy_from_slice(&self.host);
        b[56..72].copy_from_slice(&self.nonce);
        b
    }

    /// Parse a message; never panics.
    pub(crate) fn decode(b: &[u8]) -> Result<SetupMsg, &'static str> {
        if b.len() < MSG_LEN {
            return Err("short message");
        }
        if &b[..8] != MSG_MAGIC {
            return Err("bad magic");
        }
        let step = match b[8] {
            1 => Step::Offer,
            2 => Step::Ack,
            _ => return Err("unknown step"),
        };
        if b[9] > 1 || b[10..12] != [0, 0] || b[72..80] != [0; 8] {
            return Err("reserved bytes set");
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut host = [0u8; 32];
        host.copy_from_slice(&b[24..56]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[56..72]);
        Ok(SetupMsg {
            step,
            yes: b[9] == 1,
            pid: u32_at(12),
            fd: u32_at(16),
            ring: u32_at(20),
            host,
            nonce,
        })
    }
}

fn send_msg(s: &mut TcpStream, m: SetupMsg) -> Result<(), String> {
    s.write_all(&m.encode()).map_err(|e| format!("sending the shared-memory set-up: {e}"))
}

fn recv_msg(s: &mut TcpStream, step: Step, deadline: Instant) -> Result<SetupMsg, String> {
    let mut b = [0u8; MSG_LEN];
    crate::util::read_exact_by(s, &mut b, deadline)
        .map_err(|e| format!("receiving the shared-memory set-up: {e}"))?;
    let m = SetupMsg::decode(&b).map_err(|e| format!("shared-memory set-up: {e}"))?;
    if m.step != step {
        return Err(format!("shared-memory set-up: expected step {step:?}, got {:?}", m.step));
    }
    Ok(m)
}

/// The dialled rank's side of the set-up on a freshly authenticated connection (the handshake's
/// server, which answers in its own thread): make the pair's segment (before knowing where the
/// peer runs: a peer on another host leaves it, and its untouched pages cost nothing), offer it
/// with where this rank runs, and keep it if the peer attached. `enabled` is this rank's
/// `TUTTI_SHM`. Returns the link, or `None` when the pair stays on TCP.
///
/// # Errors
/// The connection broke, or the peer sent something else, by `deadline`.
pub(crate) fn server_side(
    s: &mut TcpStream,
    enabled: bool,
    world: usize,
    deadline: Instant,
) -> Result<Option<ShmLink>, String> {
    let ring = ring_for(world);
    let mut offer = SetupMsg::new(Step::Offer, false, ring);
    offer.host = host_id();
    let mut made = None;
    if enabled {
        let made_one = crate::auth::random::<16>()
            .and_then(|nonce| Segment::create(&nonce, ring).map(|(seg, fd)| (seg, fd, nonce)));
        match made_one {
            Ok((seg, fd, nonce)) => {
                offer.yes = true;
                offer.fd = fd.as_raw_fd() as u32;
                offer.nonce = nonce;
                made = Some((seg, fd));
            }
            Err(e) => tracing::debug!("no shared segment, the link stays on TCP: {e}"),
        }
    }
    send_msg(s, offer)?;
    let ack = recv_msg(s, Step::Ack, deadline)?;
    // The descriptor closes here: the peer holds its own, and the mappings keep the memory.
    Ok(made.filter(|_| ack.yes).map(|(seg, _fd)| ShmLink::new(seg, true)))
}

/// The dialling rank's side (the handshake's client, on a dial thread):
/// on the same host, with both offering, attach the offered segment and say so. It waits for
/// nothing after the handshake's own messages: the offer comes right behind the handshake's
/// last answer.
///
/// # Errors
/// As [`server_side`].
pub(crate) fn client_side(
    s: &mut TcpStream,
    enabled: bool,
    world: usize,
    deadline: Instant,
) -> Result<Option<ShmLink>, String> {
    let ring = ring_for(world);
    let offer = recv_msg(s, Step::Offer, deadline)?;
    let mut ack = SetupMsg::new(Step::Ack, false, ring);
    let mut link = None;
    if enabled && offer.yes && offer.host == host_id() && offer.ring as usize == ring {
        match Segment::attach(offer.pid, offer.fd, &offer.nonce, ring) {
            Ok(mapped) => {
                ack.yes = true;
                link = Some(ShmLink::new(mapped, false));
            }
            Err(e) => tracing::debug!("shared segment not attached, the link stays on TCP: {e}"),
        }
    }
    send_msg(s, ack)?;
    Ok(link)
}

/// A pair of linked ends over one segment in this process (tests and fuzzing): the first is
/// the server's.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn local_pair(ring: usize) -> Result<(ShmLink, ShmLink), String> {
    let nonce = [7u8; 16];
    let (seg, fd) = Segment::create(&nonce, ring)?;
    let other = Segment::attach(std::process::id(), fd.as_raw_fd() as u32, &nonce, ring)?;
    Ok((ShmLink::new(seg, true), ShmLink::new(other, false)))
}

/// Overwrite a position of the ring `link` reads (`head`: the writer's, else the reader's), as
/// a broken peer could (tests and fuzzing).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn scribble(link: &ShmLink, head: bool, value: u64) {
    let c = link.seg.ctl(link.rx);
    let field = if head { &c.head.0 } else { &c.tail.0 };
    field.store(value, Ordering::SeqCst);
}

#[cfg(test)]
mod tests;
