//! The progress engine shared by the connection-based transports: the [`Core`] and a [`Driver`]
//! under one lock, driven by whichever thread waits.
//!
//! There is no I/O thread on the data path. A thread in [`Engine::wait`] lets the driver move
//! bytes for every connection with work, asks the core what the wait should do next, spins for a
//! short, bounded time yielding the CPU, then sleeps in `ppoll` on the driver's descriptors with
//! the lock released, until input arrives or the earliest of the core's and the driver's
//! deadlines. Posting a send writes at once when the connection has room, so small messages leave
//! without waiting for anyone. A background thread drives only while nobody waits (keep-alives,
//! aborts, dead peers, what a large send left queued), so 2-core machines running 4+ ranks never
//! spin without bound.
//!
//! The one [`Transport`] implementation for every driver is here: TCP, QUIC and the in-memory
//! transport differ only in their driver (`tcp/driver.rs`, `quic/driver.rs`, `mem.rs`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transport::core::{Core, LinkFail, Step, Waiter};
use crate::transport::{OpId, Transport};
use crate::util::WakePipe;
use crate::wire::MsgDesc;

/// How long a failed transport's shutdown lets its abort frames and the peers' ends arrive.
const FAILED_LINGER: Duration = Duration::from_millis(100);
/// How long a wait spins without yielding the CPU first, where the driver allows it
/// ([`Driver::hot_spin`]).
const HOT_SPIN: Duration = Duration::from_micros(3);
/// Longest a blocked thread sleeps before looking again (abort and deadlines are also checked).
const POLL_SLICE: Duration = Duration::from_millis(100);

/// What the engine is doing when it asks the driver to move bytes or sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A thread waits for an operation: read everything that arrives.
    Wait,
    /// Nobody waits: handle control traffic and keep sending, but leave data for receives not
    /// yet posted where it is when the driver can (TCP: in the kernel, flow-controlling the
    /// sender).
    Idle,
    /// Clean shutdown: the core queued close frames; see them out.
    Shutdown,
}

/// How long after a look first saw a peer's process ended [`Engine::check_process`] declares
/// it lost: time for the abort of a rank that failed and then exited to arrive through the
/// ranks linked to it (which pass it on within milliseconds), so that the abort's reason, not
/// the exit, is what every rank reports. A killed rank is still named far within a second.
pub(crate) const ENDED_GRACE: Duration = Duration::from_millis(100);

/// How one transport moves bytes: sockets, system calls and the protocol below the frames.
/// Never blocks; the engine sleeps on the descriptors it names.
pub(crate) trait Driver: Send + 'static {
    /// How long the background thread naps while a thread waits (and drives). QUIC needs its
    /// timers served soon after a wait ends; TCP's background has nothing urgent.
    const WAITING_NAP: Duration;
    /// Whether a spinning wait should look at readiness (one `poll` without a timeout over
    /// every descriptor) instead of reading blindly: true where a read that finds nothing
    /// costs more than a look (TCP: `recv` takes the socket's lock, which the sender's
    /// delivery into that socket then contends for; `poll` does not). Shared memory reads
    /// blindly: a look at a ring is one atomic load.
    fn look_while_spinning(&self) -> bool {
        false
    }
    /// About to sleep in `mode` on [`Driver::poll_set`]'s descriptors: ask the peers whose input
    /// raises no descriptor by itself (shared-memory rings) for a wake-up. True when input or
    /// room is there already, so the engine passes again instead of sleeping.
    fn arm(&mut self, _core: &Core, _mode: Mode) -> bool {
        false
    }
    /// Whether a wait may spin briefly without yielding the CPU ([`HOT_SPIN`]): where the
    /// answer comes through memory and every rank of the host has a CPU of its own.
    fn hot_spin(&self) -> bool {
        false
    }
    /// A count that grows while bytes move on links where a sleep is expensive (shared memory:
    /// each sleep costs the peer a wake-up per ring of data). A wait that sees it grow spins on
    /// instead of sleeping halfway through a transfer that flows; when it stops growing, the
    /// wait sleeps after its usual spin.
    fn spin_progress(&self) -> u64 {
        0
    }
    /// How the frames to `peer` travel, when this driver has more than one way (`"shm"`).
    fn link_kind(&self, _peer: usize) -> Option<&'static str> {
        None
    }
    /// Whether a link to a peer of this host, connected now, would go through shared memory
    /// ([`Transport::offers_shared_memory`]).
    fn offers_shared_memory(&self) -> bool {
        false
    }
    /// Start connecting `peer`, whose link the core holds pending (a lazy core's first use of
    /// it); the connection joins through [`Engine::with_driver`], or the core hears that it
    /// failed. Drivers that connect every link up front never see this.
    fn dial(&mut self, _core: &mut Core, _peer: usize) {}
    /// Write what the core queued for `peer` (eagerly, right after a post).
    fn flush(&mut self, core: &mut Core, peer: usize, now: Instant);
    /// `peer`'s frame in progress got a destination (a receive was posted for a parked
    /// message): read its payload in.
    fn read(&mut self, core: &mut Core, peer: usize, now: Instant);
    /// One non-blocking pass over every connection with work.
    fn progress(&mut self, core: &mut Core, mode: Mode, now: Instant);
    /// The driver's own next deadline (protocol timers), if any.
    fn next_timer(&mut self) -> Option<Instant>;
    /// Append the descriptors to sleep on in `mode`.
    fn poll_set(&mut self, core: &Core, mode: Mode, fds: &mut Vec<libc::pollfd>);
    /// Serve what the sleep flagged (`fds` as `poll_set` appended them, `revents` set).
    fn ready(&mut self, core: &mut Core, mode: Mode, fds: &[libc::pollfd], now: Instant);
    /// The core gave up on `peer`'s link: close the connection.
    fn link_down(&mut self, core: &mut Core, peer: usize);
    /// One step of a clean shutdown; true when every connection is finished.
    fn shutdown_step(&mut self, core: &mut Core, now: Instant) -> bool;
    /// Close what is left once the shutdown is over (or out of time).
    fn close(&mut self, core: &mut Core, now: Instant);
}

/// The core and the driver, always locked together.
pub(crate) struct State<D> {
    pub(crate) core: Core,
    pub(crate) driver: D,
    /// A waiting thread sleeps on the sockets for every waiter (see [`Engine::wait`]).
    driving: bool,
    /// Waiters asleep on [`Engine::ended`] (notified only when there are some: a notify is a
    /// system call).
    followers: usize,
}

impl<D: Driver> State<D> {
    /// Let the driver close the links the core gave up on, and write out the abort frames a
    /// fresh poisoning queued on every other link. A fresh poisoning is this transport's first
    /// failure: under torchrun one the transport found itself (a lost or silent peer, a peer's
    /// abort, a protocol violation) is left in the agent's error file at once, even if no call
    /// is there to see it; a failed call records its own error, with the operation, through
    /// `Group::fail`, and a plain local abort (a shrink, the user's `abort`) records nothing.
    fn settle(&mut self) {
        while let Some(peer) = self.core.take_dial() {
            self.driver.dial(&mut self.core, peer);
        }
        loop {
            while let Some(peer) = self.core.take_down() {
                self.driver.link_down(&mut self.core, peer);
            }
            if !self.core.take_fresh_poison() {
                return;
            }
            if let Some(cause) =
                self.core.poisoned().filter(|e| !matches!(e, Error::Aborted { .. }))
            {
                crate::rendezvous::launcher::record_failure(&cause.to_string());
            }
            self.flush_links(Instant::now());
        }
    }

    fn flush_links(&mut self, now: Instant) {
        for peer in 0..self.core.world() {
            if self.core.wants_tx(peer) {
                self.driver.flush(&mut self.core, peer, now);
            }
        }
    }

    /// Write whatever the core queued, on every link.
    fn flush_all(&mut self, now: Instant) {
        self.flush_links(now);
        self.settle();
    }
}

/// All connections of one rank.
pub(crate) struct Engine<D> {
    rank: usize,
    world: usize,
    state: Mutex<State<D>>,
    /// Waiters other than the one sleeping on the sockets wait here; notified whenever an
    /// operation ends and when the sleeper leaves.
    ended: Condvar,
    /// Wakes threads blocked in `ppoll` (abort, stop, an operation ended by another thread).
    pipe: WakePipe,
    /// Threads inside `wait` (they drive; the background thread stays out of the way).
    waiters: AtomicUsize,
    stop: AtomicBool,
    spin: Duration,
    /// The core's [`Core::poison_flag`].
    poisoned: Arc<AtomicBool>,
}

impl<D: Driver> Engine<D> {
    /// An engine over `core` and `driver`; waits spin `spin` before they sleep.
    pub(crate) fn new(core: Core, driver: D, spin: Duration) -> std::io::Result<Engine<D>> {
        Ok(Engine {
            rank: core.rank(),
            world: core.world(),
            poisoned: core.poison_flag(),
            state: Mutex::new(State { core, driver, driving: false, followers: 0 }),
            ended: Condvar::new(),
            pipe: WakePipe::new()?,
            waiters: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            spin,
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State<D>> {
        // Critical sections do not panic on network input; if a caller's thread panicked inside
        // one, the state is still structurally valid, so continue rather than cascade panics.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleep until a descriptor of `fds` (as [`Engine::poll_set`] built it: the wake pipe first)
    /// is ready, or `until` (at most one poll slice); µs precision, as protocol timers need.
    /// Returns whether a descriptor other than the pipe is ready.
    pub(crate) fn sleep(&self, fds: &mut [libc::pollfd], until: Instant) -> bool {
        self.sleep_as(fds, until, false)
    }

    /// [`Engine::sleep`]; `background` for the background thread, which leaves a wake in the
    /// pipe while threads wait: it may be meant for one about to sleep on the sockets.
    fn sleep_as(&self, fds: &mut [libc::pollfd], until: Instant, background: bool) -> bool {
        let d = until.saturating_duration_since(Instant::now()).min(POLL_SLICE);
        let ts = libc::timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ };
        // SAFETY: `fds` is a valid pollfd array of its length; a valid timespec; no mask change.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        if fds[0].revents != 0 && (!background || self.waiters.load(Ordering::SeqCst) == 0) {
            self.pipe.drain();
        }
        fds[1..].iter().any(|f| f.revents != 0)
    }

    /// Build the descriptor list for `mode` under the lock: the wake pipe, then the driver's.
    pub(crate) fn poll_set(&self, s: &mut State<D>, mode: Mode, fds: &mut Vec<libc::pollfd>) {
        fds.clear();
        fds.reserve(self.world + 1);
        fds.push(libc::pollfd { fd: self.pipe.fd(), events: libc::POLLIN, revents: 0 });
        s.driver.poll_set(&s.core, mode, fds);
    }

    /// # Safety
    /// See `Transport::post_send`.
    pub(crate) unsafe fn post_send(
        &self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) -> Result<OpId> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let before = s.core.ops_ended();
        let now = Instant::now();
        // SAFETY: forwarded contract.
        let id = unsafe { s.core.post_send(peer, desc, data, len, now) }?;
        if peer != self.rank {
            // Eager: small messages leave now, without waiting for a waiter.
            s.driver.flush(&mut s.core, peer, now);
            s.settle();
        }
        self.wake_others(s, before);
        Ok(id)
    }

    /// # Safety
    /// See `Transport::post_recv`.
    pub(crate) unsafe fn post_recv(
        &self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
    ) -> Result<OpId> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let before = s.core.ops_ended();
        let now = Instant::now();
        // SAFETY: forwarded contract.
        let (id, attached) = unsafe { s.core.post_recv(peer, desc, buf, cap, now) }?;
        if attached {
            s.driver.read(&mut s.core, peer, now);
        }
        // Reads a parked frame in, or starts connecting a link used for the first time.
        s.settle();
        self.wake_others(s, before);
        Ok(id)
    }

    pub(crate) fn test(&self, op: OpId) -> Result<Option<usize>> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let before = s.core.ops_ended();
        s.driver.progress(&mut s.core, Mode::Wait, Instant::now());
        s.settle();
        self.wake_others(s, before);
        s.core.take_finished(op).transpose()
    }

    /// Wait for `op` until `deadline`. Several threads may wait at once (different
    /// operations): one of them drives — sleeps on the sockets and moves the bytes of every
    /// operation — and the others sleep on [`Engine::ended`] until an operation ends (theirs,
    /// perhaps) or the driver leaves (one of them then drives). A thread that ends another's
    /// operation outside the driver (a post, `test`) wakes the driver through the pipe.
    pub(crate) fn wait(&self, op: OpId, deadline: Instant) -> Result<usize> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let r = self.wait_inner(op, deadline);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        r
    }

    fn wait_inner(&self, op: OpId, deadline: Instant) -> Result<usize> {
        let t0 = Instant::now();
        let mut w = Waiter::new(op, t0, deadline);
        let mut spin_until = None;
        let mut hot_until = None;
        let mut spun = false;
        let mut moved = 0;
        // Filled (and allocated) only if the first pass does not end the wait.
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut guard = self.lock();
        // The first pass reads the clock once with the waiter's start.
        let mut first = Some(t0);
        loop {
            let s = &mut *guard;
            let now = first.take().unwrap_or_else(Instant::now);
            // A look while another thread sleeps on the descriptors could drain a wake-up meant
            // for it: then a plain pass.
            if spun && s.driver.look_while_spinning() && !s.driving {
                self.look(s, now, &mut fds);
            } else {
                self.pass(s, Mode::Wait, now);
            }
            let until = match s.core.poll_wait(&mut w, now) {
                Step::Done(r) => return r,
                Step::Again => continue,
                Step::Sleep(t) => t,
            };
            let progress = s.driver.spin_progress();
            if progress != moved {
                moved = progress;
                spin_until = None;
            }
            let spin_end = *spin_until.get_or_insert(now + self.spin);
            if hot_until.is_none() && s.driver.hot_spin() {
                hot_until = Some(now + HOT_SPIN);
            }
            if now < spin_end {
                drop(guard);
                // The first microseconds without giving the CPU away (a yield is a system call,
                // and the answer often comes sooner) where every rank has a CPU of its own.
                if hot_until.is_some_and(|h| now < h) {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                guard = self.lock();
                spun = true;
                continue;
            }
            if s.driving {
                // Another waiter sleeps on the sockets; it wakes us when an operation ends.
                let d = until.saturating_duration_since(now).min(POLL_SLICE);
                s.followers += 1;
                guard = self.ended.wait_timeout(guard, d).unwrap_or_else(|e| e.into_inner()).0;
                guard.followers -= 1;
                continue;
            }
            if s.driver.arm(&s.core, Mode::Wait) {
                continue;
            }
            self.poll_set(s, Mode::Wait, &mut fds);
            let until = s.driver.next_timer().map_or(until, |t| t.min(until));
            s.driving = true;
            drop(guard);
            let ready = self.sleep(&mut fds, until);
            guard = self.lock();
            let s = &mut *guard;
            s.driving = false;
            if ready {
                s.driver.ready(&mut s.core, Mode::Wait, &fds[1..], Instant::now());
                s.settle();
            }
            if s.followers > 0 {
                // Operations may have ended, and this thread may not drive next (it may be
                // done): the others look for themselves.
                self.ended.notify_all();
            }
            // After a sleep, spin again briefly: the next message often follows closely.
            spin_until = None;
            spun = false;
        }
    }

    /// One pass outside the driver's sleep: the core's timers (keep-alives, dead peers), then
    /// the driver over every connection with work, in `mode`.
    fn pass(&self, s: &mut State<D>, mode: Mode, now: Instant) {
        let before = s.core.ops_ended();
        s.core.handle_timeout(now);
        s.driver.progress(&mut s.core, mode, now);
        s.settle();
        self.wake_others(s, before);
    }

    /// A spinning waiter's pass (drivers that [`Driver::look_while_spinning`]): the core's
    /// timers, then one `poll` without a timeout over the descriptors a sleep would watch, and
    /// the driver serves what it flagged (and what no descriptor flags: shared memory).
    fn look(&self, s: &mut State<D>, now: Instant, fds: &mut Vec<libc::pollfd>) {
        let before = s.core.ops_ended();
        s.core.handle_timeout(now);
        self.poll_set(s, Mode::Wait, fds);
        // SAFETY: `fds` is a valid pollfd array of its length; a zero timeout never blocks.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        if r >= 0 {
            s.driver.ready(&mut s.core, Mode::Wait, &fds[1..], now);
        }
        s.settle();
        self.wake_others(s, before);
    }

    /// After `s` was moved on outside the driver's sleep: if operations ended since `before`,
    /// wake the waiters on [`Engine::ended`] and the driver asleep on the sockets (one of the
    /// operations may be its own).
    fn wake_others(&self, s: &State<D>, before: u64) {
        if s.core.ops_ended() != before {
            if s.followers > 0 {
                self.ended.notify_all();
            }
            if s.driving {
                self.pipe.wake();
            }
        }
    }

    pub(crate) fn cancel(&self, op: OpId) {
        self.lock().core.cancel(op);
    }

    pub(crate) fn abort(&self, reason: &str) {
        let cause = Error::Aborted { rank: self.rank, reason: reason.to_string() };
        self.fail(cause, reason);
    }

    /// The core records the failure (the first one wins); a first one's abort frames go out
    /// at once and every waiter looks again.
    pub(crate) fn fail(&self, cause: Error, reason: &str) -> bool {
        let mut g = self.lock();
        if !g.core.fail(cause, reason) {
            return false;
        }
        g.flush_all(Instant::now());
        drop(g);
        self.ended.notify_all();
        self.pipe.wake();
        true
    }

    /// Change the driver and the core under the lock (a connection that joins while the
    /// engine runs), then wake the thread asleep on the descriptors so its next poll sees it.
    pub(crate) fn with_driver<T>(&self, f: impl FnOnce(&mut D, &mut Core) -> T) -> T {
        let mut g = self.lock();
        let s = &mut *g;
        let before = s.core.ops_ended();
        let out = f(&mut s.driver, &mut s.core);
        s.flush_all(Instant::now());
        self.wake_others(s, before);
        drop(g);
        self.ended.notify_all();
        self.pipe.wake();
        out
    }

    /// [`Transport::connect_peers`]: ask for every pending link among `want`, then wait until
    /// none of `wait` is pending ([`Engine::await_links`]).
    pub(crate) fn connect_peers(
        &self,
        want: &[usize],
        wait: &[usize],
        deadline: Instant,
        check: impl Fn() -> Result<()>,
    ) -> Result<()> {
        {
            let mut g = self.lock();
            for &p in want {
                g.core.want_link(p);
            }
            g.settle();
        }
        let mut nap = Duration::from_micros(100);
        loop {
            check()?;
            let waiting: Vec<usize> = {
                let g = self.lock();
                if let Some(e) = g.core.poisoned() {
                    return Err(e.clone());
                }
                wait.iter().copied().filter(|p| g.core.is_pending(*p)).collect()
            };
            if waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Rendezvous {
                    rank: self.rank,
                    detail: format!(
                        "ranks {} were not connected in time: they may be waiting for others, \
                         overloaded, or unreachable at the addresses they published",
                        crate::util::list_ranks(&waiting)
                    ),
                });
            }
            std::thread::sleep(nap.min(deadline.saturating_duration_since(Instant::now())));
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }

    pub(crate) fn peer_died(&self, peer: usize, detail: &str) {
        if peer >= self.world || peer == self.rank {
            return;
        }
        let mut g = self.lock();
        g.core.link_failed(peer, LinkFail::Lost(detail.to_string()));
        g.flush_all(Instant::now());
        drop(g);
        self.ended.notify_all();
        self.pipe.wake();
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        self.lock().core.poisoned().cloned()
    }

    /// [`Transport::check_peer`]: the dead-peer rule for a wait on `peer` with nothing posted.
    pub(crate) fn check_peer(&self, peer: usize, since: Instant) -> Result<()> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let mut failed = false;
        if peer < self.world && peer != self.rank && s.core.poisoned().is_none() {
            // Take in what the peer sent first (as a probe does): with no thread waiting, the
            // background thread reads control frames only when they come first, and a data
            // frame nobody has asked for yet would hide the keep-alives behind it.
            let before = s.core.ops_ended();
            s.driver.read(&mut s.core, peer, Instant::now());
            s.settle();
            self.wake_others(s, before);
            let now = Instant::now();
            failed = s.core.check_silent(peer, since, now);
            if failed {
                s.flush_all(now);
            }
        }
        self.report(guard, failed)
    }

    /// The end of a dead-peer check: the transport's failure, if any; when the check failed a
    /// link (`failed`), the waiters and the sleeping driver are woken once the lock is let go.
    fn report(&self, guard: MutexGuard<'_, State<D>>, failed: bool) -> Result<()> {
        let r = match guard.core.poisoned() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        };
        drop(guard);
        if failed {
            self.ended.notify_all();
            self.pipe.wake();
        }
        r
    }

    /// [`Transport::check_process`]: the dead-peer rule from what the kernel says of `peer`'s
    /// process (an end counts once a look saw it [`ENDED_GRACE`] ago).
    pub(crate) fn check_process(
        &self,
        peer: usize,
        state: &crate::window::ProcessState,
        since: Instant,
    ) -> Result<()> {
        use crate::window::ProcessState;
        let mut guard = self.lock();
        let s = &mut *guard;
        let mut failed = false;
        let fail = |s: &State<D>, now: Instant| match state {
            ProcessState::Running => None,
            // Not at once: a rank that failed and then exited sent its abort to the ranks
            // linked to it, and the abort they pass on names what went wrong, not the exit it
            // led to.
            ProcessState::Ended { since: ended, how } => {
                (now.saturating_duration_since(*ended) >= ENDED_GRACE).then(|| {
                    LinkFail::Lost(format!(
                        "rank {peer}'s {how} (seen by the kernel while this rank waited on its \
                         memory)"
                    ))
                })
            }
            ProcessState::Stopped { since: stopped } => {
                let quiet = now.saturating_duration_since((*stopped).max(since));
                (quiet >= s.core.dead_after()).then(|| {
                    LinkFail::Silent(format!(
                        "rank {peer}'s process has been stopped (SIGSTOP, or a debugger) for \
                         {quiet:.1?}, seen by the kernel while this rank waited on its memory"
                    ))
                })
            }
        };
        let gone = !matches!(state, ProcessState::Running);
        if gone && peer < self.world && peer != self.rank && s.core.poisoned().is_none() {
            // First what the other links brought: with no link to `peer`, an abort about its
            // end comes from the ranks linked to it, and an idle rank's background thread
            // reads shared-memory links only on its schedule.
            let now = Instant::now();
            self.pass(s, Mode::Idle, now);
            if let Some(f) = fail(s, now).filter(|_| s.core.poisoned().is_none()) {
                // A link never connected is pending (links connect on first use): it fails as
                // one whose connecting failed.
                s.core.link_failed(peer, f);
                s.flush_all(now);
                failed = true;
            }
        }
        self.report(guard, failed)
    }

    pub(crate) fn probe(&self, peer: usize, desc: MsgDesc) -> Result<bool> {
        crate::transport::matcher::check_peer(self.rank, self.world, peer, "probe")?;
        let mut guard = self.lock();
        let s = &mut *guard;
        if let Some(e) = s.core.poisoned() {
            return Err(e.poisoned());
        }
        // A receive from any source probes every peer: connect the links not made yet, so a
        // sender that died before it connected is named (its address refuses), not waited for.
        s.core.want_link(peer);
        s.settle();
        // Take in what the peer sent (a driver reads idle sockets only for a waiter).
        if peer != self.rank {
            let before = s.core.ops_ended();
            s.driver.read(&mut s.core, peer, Instant::now());
            s.settle();
            self.wake_others(s, before);
        }
        Ok(s.core.probe(peer, desc.tag))
    }

    pub(crate) fn lost_peers(&self) -> Vec<usize> {
        self.lock().core.lost_peers(Instant::now())
    }

    /// The background driver: runs until [`Engine::stop`], serving the connections (and the
    /// core's keep-alives) whenever no thread is inside `wait`.
    pub(crate) fn background(&self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        while !self.stop.load(Ordering::SeqCst) {
            if self.waiters.load(Ordering::SeqCst) > 0 {
                // Parked, not asleep: `Running`'s drop unparks it, so a transport dropped
                // while a thread waited is not held up a whole nap.
                std::thread::park_timeout(D::WAITING_NAP);
                continue;
            }
            let until = {
                let mut guard = self.lock();
                let s = &mut *guard;
                let now = Instant::now();
                // Keep-alives first: the pass writes them with everything else queued.
                self.pass(s, Mode::Idle, now);
                self.poll_set(s, Mode::Idle, &mut fds);
                let mut until = now + POLL_SLICE;
                if let Some(t) = s.core.poll_timeout() {
                    until = until.min(t);
                }
                if let Some(t) = s.driver.next_timer() {
                    until = until.min(t);
                }
                if s.driver.arm(&s.core, Mode::Idle) {
                    continue;
                }
                until
            };
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            // A thread that started waiting meanwhile drives: what woke us is its to serve (a
            // shared-memory wake-up is given once).
            if self.sleep_as(&mut fds, until, true) && self.waiters.load(Ordering::SeqCst) == 0 {
                let mut guard = self.lock();
                let s = &mut *guard;
                let before = s.core.ops_ended();
                s.driver.ready(&mut s.core, Mode::Idle, &fds[1..], Instant::now());
                s.settle();
                self.wake_others(s, before);
            }
        }
    }

    /// Stop the background driver (it returns within one poll slice; the wake makes it sooner).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.pipe.wake();
    }

    /// Clean shutdown: a close frame on every link, then let the driver see them out and wait
    /// for the peers' own ends (so nothing in flight is cut off) until `timeout`; then close.
    /// After a failure the abort frames are what matters, and the peers are failing too: the
    /// wait is cut to [`FAILED_LINGER`], so a rank never waits seconds for a stopped or dying peer
    /// before it exits.
    pub(crate) fn shutdown(&self, timeout: Duration) {
        let timeout = {
            let mut g = self.lock();
            g.core.close_all();
            if g.core.poisoned().is_some() {
                timeout.min(FAILED_LINGER)
            } else {
                timeout
            }
        };
        let deadline = Instant::now() + timeout;
        let mut fds: Vec<libc::pollfd> = Vec::new();
        loop {
            let until = {
                let mut guard = self.lock();
                let s = &mut *guard;
                let now = Instant::now();
                let done = s.driver.shutdown_step(&mut s.core, now);
                s.settle();
                if done {
                    break;
                }
                if now >= deadline {
                    tracing::debug!(rank = self.rank, "shutdown: peers still open at the deadline");
                    break;
                }
                if s.driver.arm(&s.core, Mode::Shutdown) {
                    continue;
                }
                self.poll_set(s, Mode::Shutdown, &mut fds);
                s.driver.next_timer().map_or(deadline, |t| t.min(deadline))
            };
            self.sleep(&mut fds, until);
        }
        let mut guard = self.lock();
        let s = &mut *guard;
        s.driver.close(&mut s.core, Instant::now());
    }

    /// Queue a frame of exactly these header bytes and payload to `peer`, as a misbehaving but
    /// authenticated peer would send it: the tests of the receiving side's protocol checks.
    #[cfg(test)]
    pub(crate) fn send_raw(
        &self,
        peer: usize,
        hdr: [u8; crate::wire::HEADER_LEN],
        payload: Vec<u8>,
    ) {
        let mut guard = self.lock();
        let s = &mut *guard;
        s.core.send_raw(peer, hdr, payload);
        s.driver.flush(&mut s.core, peer, Instant::now());
        s.settle();
    }
}

/// An engine at work: the engine and its background thread. Dropping it stops the thread, then
/// shuts the connections down cleanly (close frames out, the peers' ends awaited, at most 2 s).
pub(crate) struct Running<D: Driver> {
    engine: Arc<Engine<D>>,
    background: Option<JoinHandle<()>>,
}

impl<D: Driver> Running<D> {
    /// Start the background thread (named `name`) of `engine`.
    pub(crate) fn start(engine: Engine<D>, name: String) -> std::io::Result<Running<D>> {
        let engine = Arc::new(engine);
        let e = engine.clone();
        let background = std::thread::Builder::new().name(name).spawn(move || e.background())?;
        Ok(Running { engine, background: Some(background) })
    }

    pub(crate) fn engine(&self) -> &Engine<D> {
        &self.engine
    }

    /// The engine, shared (with the threads that connect links while it runs).
    pub(crate) fn shared(&self) -> Arc<Engine<D>> {
        self.engine.clone()
    }
}

impl<D: Driver> Drop for Running<D> {
    fn drop(&mut self) {
        self.engine.stop();
        if let Some(t) = self.background.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        self.engine.shutdown(Duration::from_secs(2));
    }
}

/// A transport made of an [`Engine`]: it gets the one [`Transport`] implementation below.
pub(crate) trait Wired: Send + Sync {
    /// How its bytes move.
    type Driver: Driver;
    /// The transport's name (`tcp`, `quic`, `mem`).
    const NAME: &'static str;
    /// Its engine.
    fn engine(&self) -> &Engine<Self::Driver>;
    /// The address it listens on and published (`None`: it has none, in memory).
    fn listen_addr(&self) -> Option<std::net::SocketAddr>;
    /// [`Transport::publish_failure`].
    fn publish_failure(&self) {}
}

impl<T: Wired> Transport for T {
    fn rank(&self) -> usize {
        self.engine().rank()
    }

    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.listen_addr()
    }

    fn world_size(&self) -> usize {
        self.engine().world()
    }

    fn link_kind(&self, peer: usize) -> &'static str {
        self.engine().lock().driver.link_kind(peer).unwrap_or(T::NAME)
    }

    fn offers_shared_memory(&self) -> bool {
        self.engine().lock().driver.offers_shared_memory()
    }

    fn connect_peers(&self, peers: &[usize], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        self.engine().connect_peers(peers, peers, deadline, || Ok(())).map_err(|e| match e {
            Error::Rendezvous { .. } => e,
            other => other.poisoned(),
        })
    }

    fn publish_failure(&self) {
        Wired::publish_failure(self)
    }

    fn is_connected(&self, peer: usize) -> bool {
        let g = self.engine().lock();
        peer == self.rank() || g.core.is_up(peer)
    }

    fn name(&self) -> &'static str {
        T::NAME
    }

    unsafe fn post_send(
        &self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) -> Result<OpId> {
        // SAFETY: forwarded contract.
        unsafe { self.engine().post_send(peer, desc, data, len) }
    }

    unsafe fn post_recv(
        &self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
    ) -> Result<OpId> {
        // SAFETY: forwarded contract.
        unsafe { self.engine().post_recv(peer, desc, buf, cap) }
    }

    fn wait(&self, op: OpId, deadline: Instant) -> Result<usize> {
        self.engine().wait(op, deadline)
    }

    fn test(&self, op: OpId) -> Result<Option<usize>> {
        self.engine().test(op)
    }

    fn cancel(&self, op: OpId) {
        self.engine().cancel(op)
    }

    fn abort(&self, reason: &str) {
        self.engine().abort(reason)
    }

    fn fail(&self, cause: Error, reason: &str) -> bool {
        self.engine().fail(cause, reason)
    }

    fn peer_died(&self, peer: usize, detail: &str) {
        self.engine().peer_died(peer, detail)
    }

    fn check_peer(&self, peer: usize, since: Instant) -> Result<()> {
        self.engine().check_peer(peer, since)
    }

    fn check_process(
        &self,
        peer: usize,
        state: &crate::window::ProcessState,
        since: Instant,
    ) -> Result<()> {
        self.engine().check_process(peer, state, since)
    }

    fn poisoned(&self) -> Option<Error> {
        self.engine().poisoned()
    }

    fn lost_peers(&self) -> Vec<usize> {
        self.engine().lost_peers()
    }

    fn unexpected_bytes(&self) -> u64 {
        self.engine().lock().core.unexpected_held()
    }

    fn probe(&self, peer: usize, desc: MsgDesc) -> Result<bool> {
        self.engine().probe(peer, desc)
    }
}
