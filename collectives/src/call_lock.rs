//! The lock a call takes on its communicator's windows: a flag set by one atomic exchange and
//! released by a plain store.
//!
//! `std::sync::Mutex` releases with an atomic swap, to learn whether a waiter sleeps on it. On
//! x86 a locked instruction waits for every store before it to leave the core's store buffer,
//! and the store just before the release of a small call is that call's post into its window:
//! a cache line its reader on another core holds, whose transfer (100–500 ns between the two
//! cores of the reference VM) the swap then waited for, at every call. A release by a plain
//! store (on x86 an ordinary `mov`) lets the post drain while the rank returns and enters its
//! next call, whose exchange then waits only for what is left of it.
//!
//! Waiters do not sleep on the flag: they spin briefly, then yield, then nap. Two threads meet
//! on one communicator's windows only when a program calls collectives on clones of it from
//! two threads at once (the calls are ordered, one waits for the other). A holder keeps it for
//! one call, whose own deadline bounds it, or, at the windows' one-time set-up, for the set-up's
//! own exchanges too; those run on the holder's thread and look with [`CallLock::try_lock`],
//! which leaves them alone while the set-up holds it.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A value behind the call lock (see the module's documentation).
#[derive(Default)]
pub(crate) struct CallLock<T> {
    held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `CallGuard`, of which there is at most one at a
// time (the flag, taken with acquire and released with release ordering, as a mutex).
unsafe impl<T: Send> Send for CallLock<T> {}
// SAFETY: as above: shared references give access to the value one guard at a time.
unsafe impl<T: Send> Sync for CallLock<T> {}

/// The value, held: released when dropped (also while unwinding from a panic).
pub(crate) struct CallGuard<'a, T> {
    lock: &'a CallLock<T>,
    /// A guard gives `&T` and `&mut T` as a `&mut T` would: shared between threads only where
    /// `T` itself is `Sync` (the reference to the lock alone would make it `Sync` wherever `T`
    /// is `Send`, and let two threads read a `Cell` inside at once).
    _value: PhantomData<&'a mut T>,
}

/// Spins on a held lock before yielding.
const SPINS: u32 = 64;
/// Yields before napping.
const YIELDS: u32 = 64;
/// A nap between looks once the holder has kept it through the spins and yields.
const NAP: Duration = Duration::from_micros(20);

impl<T> CallLock<T> {
    /// Take the lock, waiting for its holder to release it.
    #[inline]
    pub(crate) fn lock(&self) -> CallGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.lock_slow()
    }

    #[cold]
    fn lock_slow(&self) -> CallGuard<'_, T> {
        let mut looks = 0u32;
        loop {
            // Look before the exchange: a held flag is only read, not pulled away from its
            // holder's core at every look.
            if !self.held.load(Ordering::Relaxed) {
                if let Some(g) = self.try_lock() {
                    return g;
                }
            }
            looks = looks.saturating_add(1);
            if looks < SPINS {
                std::hint::spin_loop();
            } else if looks < SPINS + YIELDS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }

    /// The lock if it is free now.
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<CallGuard<'_, T>> {
        // A guard only once the flag is ours: one made and dropped on failure would release
        // the holder's lock.
        match self.held.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => Some(CallGuard { lock: self, _value: PhantomData }),
            Err(_) => None,
        }
    }
}

impl<T> Deref for CallGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the one holder (see `CallLock`).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for CallGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for CallGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // A plain store on x86: see the module's documentation.
        self.lock.held.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Threads that take the lock in turn never see each other's half-done update: each adds
    /// one in two steps with a yield between, and no increment is lost.
    #[test]
    fn holders_take_turns() {
        let l = Arc::new(CallLock::<(u64, u64)>::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        let mut g = l.lock();
                        let v = g.0;
                        std::thread::yield_now();
                        g.0 = v + 1;
                        g.1 += 1;
                    }
                })
            })
            .collect();
        // A lock that is never released fails here, within a deadline, instead of hanging.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        for t in threads {
            while !t.is_finished() {
                assert!(std::time::Instant::now() < deadline, "a holder never released the lock");
                std::thread::sleep(Duration::from_millis(5));
            }
            t.join().unwrap();
        }
        let g = l.try_lock().expect("the lock is free once every holder is done");
        assert_eq!(*g, (8000, 8000));
    }

    /// A held lock is not taken by `try_lock` (and a failed look leaves it held); a released
    /// one is, and a guard dropped while unwinding from a panic releases it.
    #[test]
    fn try_lock_sees_the_holder_and_a_panic_releases() {
        let l = Arc::new(CallLock::<u32>::default());
        let g = l.lock();
        assert!(l.try_lock().is_none());
        // A failed look leaves the holder's lock held.
        assert!(l.try_lock().is_none());
        drop(g);
        assert!(l.try_lock().is_some());
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            let _g = l2.lock();
            panic!("a call that panics while holding the lock");
        })
        .join();
        assert!(r.is_err());
        assert!(l.try_lock().is_some());
    }
}
