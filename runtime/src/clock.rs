//! A cheap monotonic clock for timing calls of a microsecond or less.
//!
//! Every call is timed ([`Moment::elapsed`] gives its `Stats::elapsed`) and has a deadline, so
//! the clock is read at least twice per call. `Instant::now` is a `clock_gettime` through the
//! vDSO, 20–30 ns on the machines we measure: a tenth of an 8-byte call between two ranks of
//! one host. On x86-64 with an invariant time-stamp counter that the kernel itself keeps time
//! with (its clocksource is `tsc`), a [`Moment`] is one `rdtsc` instead (about 10 ns); anywhere
//! else it is an `Instant`.
//!
//! Counter ticks become nanoseconds by a rate measured against `Instant` while the process
//! runs, not assumed. In the first 2 ms after the clock's first use ([`init`]: a rendezvous,
//! or a communicator's creation), each [`Moment::elapsed`] also reads `Instant` and measures
//! the rate afresh. After that the rate is measured again each time the span since the first
//! use has doubled, and fixed after 1 s; between those measurements a reading is the counter
//! alone. A wait that must sleep turns its [`Deadline`] into an `Instant` only then, so a call
//! that never sleeps reads no other clock.
//!
//! The choice is made once per process: a kernel that stops trusting the counter later (and
//! moves to another clocksource) does not move this clock with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A point in time from the process's clock: see the module's documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Moment(u64);

/// From how long after the anchor a measured rate is kept.
const FIRST: Duration = Duration::from_millis(2);
/// After how long the rate is fixed.
const SETTLE: Duration = Duration::from_secs(1);

enum Source {
    /// Nanoseconds since `Clock::anchor`.
    Mono,
    /// Time-stamp counter ticks.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Tsc {
        /// The counter at `Clock::anchor`, read on either side of it.
        ticks0: u64,
    },
}

struct Clock {
    anchor: Instant,
    source: Source,
    /// Nanoseconds per tick × 2³², once measured over [`FIRST`] at least (0: not yet).
    rate: AtomicU64,
    /// The counter at which the rate is measured again.
    next: AtomicU64,
}

static CLOCK: OnceLock<Clock> = OnceLock::new();

/// The clock, started at its first use (a load and a test once started: every call reads it).
#[inline]
fn clock() -> &'static Clock {
    match CLOCK.get() {
        Some(c) => c,
        None => start(),
    }
}

/// The clock's first use: chooses its source and anchors it.
#[cold]
fn start() -> &'static Clock {
    CLOCK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if tsc::usable() {
            if let Some((ticks0, anchor)) = tsc::pair() {
                return Clock {
                    anchor,
                    source: Source::Tsc { ticks0 },
                    rate: AtomicU64::new(0),
                    next: AtomicU64::new(0),
                };
            }
        }
        Clock {
            anchor: Instant::now(),
            source: Source::Mono,
            rate: AtomicU64::new(0),
            next: AtomicU64::new(0),
        }
    })
}

/// Start the clock now (its first use otherwise), so that its rate is measured by the time
/// the first calls are timed.
pub fn init() {
    clock();
}

impl Moment {
    /// Now.
    #[inline]
    pub fn now() -> Moment {
        let c = clock();
        match c.source {
            #[cfg(target_arch = "x86_64")]
            Source::Tsc { .. } => Moment(tsc::read()),
            _ => Moment(c.anchor.elapsed().as_nanos() as u64),
        }
    }

    /// The time from `self` to now (zero if `self` is later).
    #[inline]
    pub fn elapsed(&self) -> Duration {
        Moment::now().since(*self)
    }

    /// The time from `earlier` to `self` (zero if `earlier` is later).
    #[inline]
    pub fn since(&self, earlier: Moment) -> Duration {
        let c = clock();
        let d = self.0.saturating_sub(earlier.0);
        match c.source {
            Source::Mono => Duration::from_nanos(d),
            Source::Tsc { ticks0 } => {
                let rate = match c.rate.load(Ordering::Relaxed) {
                    r if r != 0 && self.0 < c.next.load(Ordering::Relaxed) => r,
                    _ => c.measure(ticks0),
                };
                Duration::from_nanos(((d as u128 * rate as u128) >> 32) as u64)
            }
        }
    }
}

impl Clock {
    /// The rate from the anchor to now. It is kept from [`FIRST`] after the anchor on, and
    /// measured again each time the span since the anchor has doubled, up to [`SETTLE`].
    #[cold]
    fn measure(&self, ticks0: u64) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if let Some((ticks, at)) = tsc::pair() {
            let span = at.duration_since(self.anchor);
            let dt = ticks.saturating_sub(ticks0).max(1);
            let rate = ((span.as_nanos() << 32) / dt as u128).max(1) as u64;
            if span >= FIRST {
                // Threads that measure at once store nearly the same rate.
                self.rate.store(rate, Ordering::Relaxed);
                let next = if span >= SETTLE { u64::MAX } else { ticks.saturating_add(dt) };
                self.next.store(next, Ordering::Relaxed);
            }
            return rate;
        }
        let _ = ticks0;
        // Unreachable in practice (`pair` always answers): one tick per nanosecond is within
        // a factor of a few of every counter this runs on.
        1 << 32
    }
}

/// When a wait gives up: an instant, or a span after a [`Moment`] (a call's start) that
/// becomes an instant only when a wait first needs one ([`Deadline::instant`]).
#[derive(Debug, Clone, Copy)]
pub enum Deadline {
    /// At this instant.
    At(Instant),
    /// `after` past `from`.
    After {
        /// The start.
        from: Moment,
        /// The span.
        after: Duration,
    },
}

impl Deadline {
    /// `after` past `from`.
    #[inline]
    pub fn after(from: Moment, after: Duration) -> Deadline {
        Deadline::After { from, after }
    }

    /// The deadline as an instant (reads the clock for [`Deadline::After`]).
    pub fn instant(&self) -> Instant {
        match *self {
            Deadline::At(t) => t,
            Deadline::After { from, after } => {
                let now = Instant::now();
                let left = after.saturating_sub(from.elapsed());
                // Past what an Instant can hold: as good as never (a century).
                now.checked_add(left)
                    .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
                    .unwrap_or(now)
            }
        }
    }
}

impl From<Instant> for Deadline {
    fn from(t: Instant) -> Deadline {
        Deadline::At(t)
    }
}

#[cfg(target_arch = "x86_64")]
mod tsc {
    use std::time::Instant;

    #[inline]
    pub(super) fn read() -> u64 {
        // SAFETY: `rdtsc` has no memory effects; `usable` checked that the counter runs at a
        // constant rate in every state and that the kernel keeps time with it (so it is
        // synchronised across cores).
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    /// Whether the counter is invariant (CPUID 8000_0007h, EDX bit 8) and the kernel's own
    /// clocksource.
    pub(super) fn usable() -> bool {
        use core::arch::x86_64::__cpuid;
        let max = __cpuid(0x8000_0000).eax;
        if max < 0x8000_0007 {
            return false;
        }
        // The leaf is supported (checked above).
        let invariant = __cpuid(0x8000_0007).edx & (1 << 8) != 0;
        invariant
            && std::fs::read_to_string(
                "/sys/devices/system/clocksource/clocksource0/current_clocksource",
            )
            .is_ok_and(|s| s.trim() == "tsc")
    }

    /// The counter and `Instant::now` read together: the counter's midpoint around the
    /// instant, from a try whose two counter readings are close (a try that was preempted
    /// between them is thrown away).
    pub(super) fn pair() -> Option<(u64, Instant)> {
        let mut best: Option<(u64, u64, Instant)> = None;
        for _ in 0..8 {
            let a = read();
            let at = Instant::now();
            let b = read();
            let spread = b.saturating_sub(a);
            if best.is_none_or(|(s, _, _)| spread < s) {
                best = Some((spread, a + spread / 2, at));
            }
            if spread < 2_000 {
                break;
            }
        }
        // A spread of tens of microseconds on every try: preempted each time; keep the best.
        best.map(|(_, t, at)| (t, at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A moment and the instant read right around it, from the try with the two instants
    /// closest together (a try preempted between its reads is not used).
    fn paired() -> (Moment, Instant) {
        (0..20)
            .map(|_| {
                let a = Instant::now();
                let m = Moment::now();
                let b = Instant::now();
                (b - a, m, a + (b - a) / 2)
            })
            .min_by_key(|t| t.0)
            .map(|t| (t.1, t.2))
            .unwrap()
    }

    #[test]
    fn moments_agree_with_instant_over_a_long_span_and_short_ones() {
        // Past SETTLE, so the rate is fixed.
        let (m0, i0) = paired();
        std::thread::sleep(SETTLE + Duration::from_millis(30));
        let (m1, i1) = paired();
        let (dm, di) = (m1.since(m0), i1 - i0);
        assert!(dm.abs_diff(di) < Duration::from_millis(1), "moment {dm:?} against {di:?}");
        // Short spans after the rate is fixed: the best of a few tries (a busy machine may
        // preempt a try between its reads).
        let best = (0..5)
            .map(|_| {
                let (m, i) = paired();
                std::thread::sleep(Duration::from_millis(2));
                let (m2, i2) = paired();
                m2.since(m).abs_diff(i2 - i)
            })
            .min()
            .unwrap();
        assert!(best < Duration::from_micros(50), "{best:?} off over 2 ms");
    }

    #[test]
    fn time_never_runs_backwards_and_a_later_start_gives_zero() {
        let a = Moment::now();
        let b = Moment::now();
        assert!(b >= a);
        assert_eq!(a.since(b), Duration::ZERO);
    }

    #[test]
    fn a_deadline_after_a_moment_is_that_far_from_it() {
        let m = Moment::now();
        std::thread::sleep(Duration::from_millis(20));
        let d = Deadline::after(m, Duration::from_secs(10)).instant();
        let left = d.saturating_duration_since(Instant::now());
        // At most 10 s − 20 ms; at least 10 s less whatever a busy machine adds to the sleep.
        assert!(left <= Duration::from_millis(9_981), "{left:?}");
        assert!(left >= Duration::from_secs(8), "{left:?}");
        let past = Deadline::after(m, Duration::from_millis(1)).instant();
        assert!(past <= Instant::now());
        let never = Deadline::after(m, Duration::MAX).instant();
        assert!(never > Instant::now() + Duration::from_secs(365 * 86_400), "{never:?}");
        let t = Instant::now();
        assert_eq!(Deadline::from(t).instant(), t);
    }
}
