//! Choosing algorithms by timing them on the job's own calls (`TUTTI_TUNE=1`).
//!
//! The built-in table ([`choose`](crate::select::choose)) was measured on loopback, where the
//! CPU, not the link, is the limit; on real links (or shaped ones) other algorithms win. With
//! tuning on, the first calls of each (collective, size class, uniformity) run every algorithm
//! that applies, each `TRIES` (5) calls in a row — the same one on every rank, since every rank
//! makes the same calls — and record how long each call after the first took; up to 4 MiB they
//! do so twice and only the second pass counts (see `passes`). When the last of them finishes, the
//! ranks agree on the times (an allreduce of each candidate's best time on each rank, taking the
//! slowest rank's, which is what the collective costs) and keep the fastest for that class from then on. The
//! agreement is one small extra allreduce at the same call on every rank; the choice is the same
//! everywhere, so it goes into the call's fingerprint as any choice does.
//!
//! Size classes are powers of two of nccl-tests' S. Only collectives whose S is the same on every
//! rank are tuned (uneven all-gathers and the like keep the table's choice).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::coll::Coll;
use crate::select::Algo;

/// Runs of each candidate before the choice.
pub(crate) const TRIES: usize = 5;

/// What a choice is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    coll: Coll,
    class: u32,
    uniform: bool,
}

impl Key {
    pub(crate) fn new(coll: Coll, bytes: usize, uniform: bool) -> Key {
        Key { coll, class: bytes.max(1).next_power_of_two().trailing_zeros(), uniform }
    }
}

#[derive(Debug)]
enum State {
    Exploring { cands: Vec<Algo>, times: Vec<Vec<f64>>, calls: usize, passes: usize },
    Decided(Algo),
}

/// The choices of one communicator (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Tuner {
    table: Mutex<HashMap<Key, State>>,
}

/// Passes over the candidates before the choice: two for classes up to 4 MiB, where the first
/// pass only brings every candidate to the same starting point (a rate shaper's burst allowance
/// spent, as it is in steady state: otherwise whichever candidate runs first looks fast), and
/// only the second is timed; one above, where a burst is small beside a call.
fn passes(key: Key) -> usize {
    if key.class <= 22 {
        2
    } else {
        1
    }
}

/// The algorithms worth trying for `coll` on `n` ranks, the table's choice first; `direct`:
/// whether direct reads may run in this group (every rank on one host, nothing found against
/// them yet).
fn candidates(coll: Coll, n: usize, uniform: bool, default: Algo, direct: bool) -> Vec<Algo> {
    let mut v = vec![default];
    for a in coll.algos() {
        // Linear and post-all gain nothing on a link-limited world that the others lack, and
        // chain only pays off for broadcast; keep every algorithm the collective has, as long
        // as it can run here.
        // Two-level depends on the hosts, which the candidates do not know: the cost model
        // chooses it on slow links, tuning does not explore it.
        // Direct reads are tried where the group may share memory. If their one-time set-up
        // then finds it cannot, every rank learns so at the same call and runs messages
        // instead (the time is recorded for the algorithm that ran, so direct reads are never
        // kept there).
        let skip = *a == Algo::TwoLevel || (*a == Algo::Direct && !direct);
        if *a != default && !skip && coll.supports(*a, n, uniform).is_ok() {
            v.push(*a);
        }
    }
    v
}

impl Tuner {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, State>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The algorithm for the next call of class `key` (`direct`: as for [`candidates`]).
    pub(crate) fn pick(&self, key: Key, n: usize, default: Algo, direct: bool) -> Algo {
        let mut t = self.lock();
        let s = t.entry(key).or_insert_with(|| {
            let cands = candidates(key.coll, n, key.uniform, default, direct);
            if cands.len() < 2 || n < 2 {
                State::Decided(default)
            } else {
                let times = vec![Vec::new(); cands.len()];
                State::Exploring { cands, times, calls: 0, passes: passes(key) }
            }
        });
        match s {
            State::Decided(a) => *a,
            // Each candidate runs TRIES calls in a row, and the first of them is not counted:
            // a call's time depends on what the previous call left behind (a rate shaper's
            // bucket, the peers' caches and skew), so each candidate is timed after itself.
            State::Exploring { cands, calls, .. } => {
                cands[(*calls % (cands.len() * TRIES) / TRIES).min(cands.len() - 1)]
            }
        }
    }

    /// A call of class `key` ran `algo` in `elapsed`. Returns this rank's best time of every
    /// candidate when that was the last exploring call (the best, not the median: a call's time
    /// also holds the wait for ranks that arrived late, which has nothing to do with the
    /// algorithm): the caller agrees on them with the
    /// other ranks and passes the agreed times to [`decide`](Tuner::decide).
    pub(crate) fn record(&self, key: Key, algo: Algo, elapsed: Duration) -> Option<Vec<f64>> {
        let mut t = self.lock();
        let Some(State::Exploring { cands, times, calls, passes }) = t.get_mut(&key) else {
            return None;
        };
        let pass_len = cands.len() * TRIES;
        if *calls / pass_len + 1 == *passes && *calls % TRIES != 0 {
            if let Some(i) = cands.iter().position(|a| *a == algo) {
                times[i].push(elapsed.as_secs_f64());
            }
        }
        *calls += 1;
        (*calls == pass_len * *passes)
            .then(|| times.iter().map(|v| v.iter().copied().fold(f64::MAX, f64::min)).collect())
    }

    /// Keep the candidate whose agreed time is least.
    pub(crate) fn decide(&self, key: Key, agreed: &[f64]) -> Option<Algo> {
        let mut t = self.lock();
        let Some(State::Exploring { cands, .. }) = t.get(&key) else { return None };
        let best = agreed
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .and_then(|(i, _)| cands.get(i).copied())?;
        t.insert(key, State::Decided(best));
        Some(best)
    }

    /// The choices made so far, for reports: (collective, size class as bytes, algorithm).
    pub(crate) fn decided(&self) -> Vec<(Coll, usize, Algo)> {
        let mut v: Vec<(Coll, usize, Algo)> = self
            .lock()
            .iter()
            .filter_map(|(k, s)| match s {
                State::Decided(a) => Some((k.coll, 1usize << k.class.min(63), *a)),
                State::Exploring { .. } => None,
            })
            .collect();
        v.sort_by_key(|(c, b, _)| (c.name(), *b));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explores_each_candidate_then_keeps_the_fastest() {
        let t = Tuner::default();
        let key = Key::new(Coll::Allreduce, 65_536, true);
        let default = Algo::Tree;
        let mut seen = Vec::new();
        let mut medians = None;
        for i in 0.. {
            let a = t.pick(key, 4, default, false);
            seen.push(a);
            // Ring is fastest here.
            let ms = if a == Algo::Ring { 1 } else { 5 + i as u64 % 3 };
            if let Some(m) = t.record(key, a, Duration::from_millis(ms)) {
                medians = Some(m);
                break;
            }
        }
        let cands = candidates(Coll::Allreduce, 4, true, default, false);
        assert_eq!(seen.len(), cands.len() * TRIES * 2, "two passes at 64 KiB");
        assert_eq!(seen[0], default, "the table's choice goes first");
        for c in &cands {
            assert_eq!(seen.iter().filter(|a| *a == c).count(), TRIES * 2, "{c}");
        }
        let m = medians.unwrap();
        assert_eq!(t.decide(key, &m), Some(Algo::Ring));
        assert_eq!(t.pick(key, 4, default, false), Algo::Ring);
        assert_eq!(t.record(key, Algo::Ring, Duration::from_millis(1)), None, "decided");
        assert_eq!(t.decided(), vec![(Coll::Allreduce, 65_536, Algo::Ring)]);
        // Another size class starts over; one rank or one candidate needs no tuning.
        assert_eq!(t.pick(Key::new(Coll::Allreduce, 65_537, true), 4, default, false), default);
        assert_eq!(
            t.pick(Key::new(Coll::Allreduce, 8, true), 1, Algo::RecursiveDoubling, true),
            Algo::RecursiveDoubling
        );
        let b = Key::new(Coll::Barrier, 0, true);
        assert_eq!(t.pick(b, 4, Algo::Dissemination, true), Algo::Dissemination);
        assert_eq!(t.record(b, Algo::Dissemination, Duration::from_millis(1)), None);
    }

    #[test]
    fn only_algorithms_that_can_run_are_tried() {
        for c in Coll::ALL {
            for n in [2, 3, 4, 5, 8] {
                for uniform in [true, false] {
                    let d = crate::select::choose(c, 1 << 20, n, uniform);
                    for direct in [false, true] {
                        let cands = candidates(c, n, uniform, d, direct);
                        for a in &cands {
                            assert!(c.supports(*a, n, uniform).is_ok(), "{c} {a} n={n}");
                        }
                        // Direct reads are tried where they may run, and only there.
                        let may = direct && c.supports(Algo::Direct, n, uniform).is_ok();
                        assert_eq!(cands.contains(&Algo::Direct), may || d == Algo::Direct);
                    }
                }
            }
        }
    }
}
