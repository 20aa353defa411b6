//! The cost model behind the automatic choice on links slower than memory.
//!
//! A message of `m` bytes costs `α + m·β` on a link between hosts (`β` per byte, shared by the
//! flows that cross the same host link at the same time) and `α + m·β_local` between ranks of
//! one host; reducing `m` bytes costs `m·γ` of CPU, overlapped with the wire in the segmented
//! pipelines (ring, chain, tree) and not in the whole-block exchanges (recursive doubling and
//! halving). Each algorithm's cost sums its steps as `docs/algorithms.md` lists them, with the
//! bytes of every step charged to the slowest link it crosses on this topology — so recursive
//! doubling with several ranks per host, whose partners at large distances all sit on other
//! hosts, pays for every rank of a host crossing the same link, while the ring (ordered host by
//! host) puts one edge on each host link. `α`, `β` and `γ` are measured by the communicator's
//! link measurement (see `Comm::link_scale`); `β_local` is [`LOCAL_BETA`].
//!
//! The model prices calls made back to back, as collbench times them (and as training loops
//! make them): a pipeline's fill overlaps the next call, so the chain costs one receive and one
//! send per rank (`2α`) and one pass of `S` over the slowest link; its `n − 1` hops are fill. It chooses among the algorithms a call can run;
//! `docs/scaling.md` compares its predictions with collbench on shaped links.

use crate::coll::Coll;
use crate::plan::pow2_floor;
use crate::select::Algo;
use crate::topo::Topology;

/// How much more per byte a whole-block exchange (recursive doubling and halving, Bruck, the
/// fold) pays on a host link than the pipelined ring or chain does, for the bytes of each
/// message past [`EXCHANGE_FREE`]. Fitted on links shaped to 1 Gbit/s (4 hosts × 1 and 2 ranks,
/// TCP): measured over predicted without it, such exchanges ran 1.1–2.9 times slower from
/// 256 KiB up (median about 1.5; worst around 1 MiB) and not slower at 64 KiB, while the ring,
/// the chain and the tree ran within 5–10 % of their α-β time. The cause is not isolated:
/// every rank sends a whole block and receives one on the same link at once, unpipelined.
pub const EXCHANGE: f64 = 1.5;

/// The bytes of each exchanged message that run at the link's rate ([`EXCHANGE`]).
pub const EXCHANGE_FREE: f64 = 65536.0;

/// How much more per byte two-level's `L` concurrent rings across hosts pay than one ring:
/// they share every host link, and each runs at its slowest edge's momentary share. Fitted on
/// 1 Gbit/s links with 2 ranks per host: measured over predicted without it, 1.11 (2 hosts),
/// 1.15 (3 hosts), 1.20 (4 hosts).
pub const SHARED_RINGS: f64 = 1.15;

/// Per-byte cost between two ranks of one host, for the measurement's model: one loopback TCP stream
/// between two ranks moved 2.3–3.9 GB/s on the 2-core VM (measured before such links went through
/// shared memory; not refitted).
pub const LOCAL_BETA: f64 = 0.4e-9;

/// Measured link parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Model {
    /// Seconds per message (latency and per-message software cost).
    pub alpha: f64,
    /// Seconds per byte over one host's link.
    pub beta: f64,
    /// Seconds per byte between ranks of one host.
    pub beta_local: f64,
    /// Seconds per byte reduced.
    pub gamma: f64,
}

/// ⌈log2 n⌉ (0 for n ≤ 1): the binomial tree's depth.
pub(crate) fn ceil_log2(n: usize) -> usize {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize
}

impl Model {
    /// Cost of one whole-block exchange step of `m` bytes per rank in which every rank `r`
    /// sends to `partner(r)` at once: the busiest host link's flows times `β` per byte (and
    /// [`EXCHANGE`] times that past [`EXCHANGE_FREE`] bytes), or `β_local` per byte when
    /// nothing leaves a host; plus α.
    fn step(&self, topo: &Topology, m: f64, partner: impl Fn(usize) -> Option<usize>) -> f64 {
        let mut out = vec![0usize; topo.hosts()];
        for r in 0..topo.size() {
            if let Some(q) = partner(r) {
                if topo.host_of(q) != topo.host_of(r) {
                    out[topo.host_of(r)] += 1;
                }
            }
        }
        self.alpha
            + match out.into_iter().max().unwrap_or(0) {
                0 => m * self.beta_local,
                f => {
                    let b = f as f64 * self.beta;
                    m * b + (m - EXCHANGE_FREE).max(0.0) * b * (EXCHANGE - 1.0)
                }
            }
    }

    /// Per-byte cost of a ring over `topo` ordered host by host: one edge per host link.
    fn ring_beta(&self, topo: &Topology) -> f64 {
        if topo.hosts() > 1 {
            self.beta
        } else {
            self.beta_local
        }
    }

    /// The recursive-doubling/halving exchanges at distances `ds` among the first `p` ranks
    /// (`frac(d)`: the fraction of `S` exchanged at distance `d`; `reduce`: whether the received
    /// part is reduced before the next step).
    fn exchanges(
        &self,
        topo: &Topology,
        p: usize,
        ds: &[usize],
        s: f64,
        frac: impl Fn(usize) -> f64,
        reduce: bool,
    ) -> f64 {
        ds.iter()
            .map(|&d| {
                let m = s * frac(d);
                self.step(topo, m, |r| (r < p && (r ^ d) < p).then_some(r ^ d))
                    + if reduce { m * self.gamma } else { 0.0 }
            })
            .sum()
    }

    /// Non-power-of-two worlds fold the extra ranks into the first `n − p` before and after.
    fn fold(&self, topo: &Topology, p: usize, s: f64, reduce: bool) -> f64 {
        let n = topo.size();
        if n == p {
            return 0.0;
        }
        2.0 * self.step(topo, s, |r| r.checked_sub(p)) + if reduce { s * self.gamma } else { 0.0 }
    }

    /// Predicted seconds for `coll` with `algo` over `topo` (`s`: nccl-tests' S in bytes), or
    /// `None` when the model has no formula for it.
    pub fn cost(&self, coll: Coll, algo: Algo, s: f64, topo: &Topology) -> Option<f64> {
        let n = topo.size();
        if n < 2 {
            return Some(0.0);
        }
        let nf = n as f64;
        let (a, g) = (self.alpha, self.gamma);
        let br = self.ring_beta(topo);
        let p = pow2_floor(n);
        let halves: Vec<usize> = (0..p.trailing_zeros()).map(|k| p >> (k + 1)).collect();
        let doubles: Vec<usize> = halves.iter().rev().copied().collect();
        let lg = ceil_log2(n);
        // The binomial tree rooted at 0: children at distances 1, 2, 4, …; those on other hosts
        // share the root host's link.
        let tree_beta = || {
            let cross = (0..lg).filter(|k| topo.host_of(1 << k) != topo.host_of(0)).count();
            cross as f64 * self.beta + (lg - cross) as f64 * self.beta_local
        };
        Some(match (coll, algo) {
            (Coll::Allreduce, Algo::Ring) => {
                2.0 * (nf - 1.0) * a + 2.0 * (nf - 1.0) / nf * s * br + s / nf * g
            }
            (Coll::Allreduce, Algo::Rabenseifner) => {
                let pf = p as f64;
                self.exchanges(topo, p, &halves, s, |d| d as f64 / pf, true)
                    + self.exchanges(topo, p, &doubles, s, |d| d as f64 / pf, false)
                    + self.fold(topo, p, s, true)
            }
            (Coll::Allreduce, Algo::RecursiveDoubling) => {
                self.exchanges(topo, p, &doubles, s, |_| 1.0, true) + self.fold(topo, p, s, true)
            }
            (Coll::Allreduce, Algo::Tree) => {
                2.0 * lg as f64 * a + 2.0 * s * tree_beta() + lg as f64 * s * g
            }
            (Coll::Allreduce, Algo::TwoLevel) => {
                let (h, l) = topo.two_level()?;
                let (hf, lf) = (h as f64, l as f64);
                2.0 * (lf - 1.0) * a
                    + 2.0 * (lf - 1.0) / lf * s * self.beta_local
                    + s / lf * g
                    + 2.0 * (hf - 1.0) * a
                    + 2.0 * (hf - 1.0) / hf * s * self.beta * SHARED_RINGS
            }
            (Coll::Broadcast, Algo::Tree) => lg as f64 * a + s * tree_beta(),
            // Back to back, a chain's calls overlap: each rank receives and forwards once
            // per call, and the n − 1 hops are the pipeline's fill.
            (Coll::Broadcast, Algo::Chain) => 2.0 * a + s * br,
            // The root sends every block but its own twice, once in the scatter and once in
            // the ring; the ring's n − 1 steps are on every call's path.
            (Coll::Broadcast, Algo::ScatterAllgather) => {
                (lg as f64 + nf - 1.0) * a + 2.0 * (nf - 1.0) / nf * s * br
            }
            (Coll::Allgather | Coll::ReduceScatter, Algo::Ring) => {
                (nf - 1.0) * (a + s / nf * br)
                    + if coll == Coll::ReduceScatter { s / nf * g } else { 0.0 }
            }
            // Across hosts, L column rings share each host link: (h−1)/h·S over it; within
            // each host, h ring phases in turn over (L−1)/L·S of memory.
            (Coll::Allgather | Coll::ReduceScatter, Algo::TwoLevel) => {
                let (h, l) = topo.two_level()?;
                let (hf, lf) = (h as f64, l as f64);
                (hf - 1.0) * a
                    + (hf - 1.0) / hf * s * self.beta * SHARED_RINGS
                    + hf * (lf - 1.0) * a
                    + (lf - 1.0) / lf * s * self.beta_local
                    + if coll == Coll::ReduceScatter { s / nf * g } else { 0.0 }
            }
            (Coll::Allgather, Algo::RecursiveDoubling) if n == p => {
                self.exchanges(topo, p, &doubles, s, |d| d as f64 / nf, false)
            }
            (Coll::ReduceScatter, Algo::RecursiveHalving) if n == p => {
                self.exchanges(topo, p, &halves, s, |d| d as f64 / nf, true)
            }
            (Coll::Allgather, Algo::Bruck) => {
                (0..lg)
                    .map(|k| {
                        let d = 1usize << k;
                        self.step(topo, s * (d.min(n - d) as f64) / nf, |r| Some((r + n - d) % n))
                    })
                    .sum::<f64>()
                    + s * g
            }
            _ => return None,
        })
    }

    /// The cheapest of `algos` by [`Model::cost`] (the first on a tie), if any has a formula.
    pub fn best(
        &self,
        coll: Coll,
        algos: impl IntoIterator<Item = Algo>,
        s: f64,
        topo: &Topology,
    ) -> Option<Algo> {
        let mut best: Option<(Algo, f64)> = None;
        for algo in algos {
            if let Some(c) = self.cost(coll, algo, s, topo) {
                if best.is_none_or(|(_, b)| c < b) {
                    best = Some((algo, c));
                }
            }
        }
        best.map(|(a, _)| a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 Gbit/s links, 50 µs per message, loopback at 2.5 GB/s, reductions at 2 GB/s.
    const GBIT: Model = Model { alpha: 50e-6, beta: 8e-9, beta_local: 0.4e-9, gamma: 0.5e-9 };

    #[test]
    fn ring_costs_what_the_table_says() {
        let t = Topology::from_hosts(&[0, 1, 2, 3]);
        let s = 16.0 * 1048576.0;
        let c = GBIT.cost(Coll::Allreduce, Algo::Ring, s, &t).unwrap();
        let want = 6.0 * 50e-6 + 1.5 * s * 8e-9 + s / 4.0 * 0.5e-9;
        assert!((c - want).abs() < 1e-12, "{c} vs {want}");
    }

    #[test]
    fn several_ranks_per_host_make_recursive_doubling_pay_per_rank() {
        // 4 hosts × 2 ranks: the first halving step sends S/2 from both ranks of a host over
        // its link, so Rabenseifner moves 3·S per link against the ring's 1.75·S.
        let t = Topology::from_hosts(&[0, 0, 1, 1, 2, 2, 3, 3]);
        let s = 64.0 * 1048576.0;
        let rab = GBIT.cost(Coll::Allreduce, Algo::Rabenseifner, s, &t).unwrap();
        let ring = GBIT.cost(Coll::Allreduce, Algo::Ring, s, &t).unwrap();
        assert!(rab > 1.6 * ring, "{rab} {ring}");
        let all = || Coll::Allreduce.algos().iter().copied();
        // Two-level moves 1.5·S over each link, in two rings sharing it: as measured, no gain
        // over the ring's 1.75·S at 4 hosts; at 2 and 3 hosts (1·S and 1.33·S against 1.5·S
        // and 1.67·S) it wins.
        assert_eq!(GBIT.best(Coll::Allreduce, all(), s, &t), Some(Algo::Ring));
        for hosts in [&[0, 0, 1, 1][..], &[0, 0, 1, 1, 2, 2]] {
            let t = Topology::from_hosts(hosts);
            assert_eq!(GBIT.best(Coll::Allreduce, all(), s, &t), Some(Algo::TwoLevel));
        }
        // Small messages are latency-bound: fewer steps win.
        let small = GBIT.best(Coll::Allreduce, Coll::Allreduce.algos().iter().copied(), 64.0, &t);
        assert!(matches!(small, Some(Algo::RecursiveDoubling | Algo::Tree)), "{small:?}");
    }

    #[test]
    fn one_rank_per_host_large_messages_take_the_ring() {
        let t = Topology::from_hosts(&[0, 1, 2, 3, 4, 5, 6, 7]);
        let s = 64.0 * 1048576.0;
        let a = GBIT.best(Coll::Allreduce, Coll::Allreduce.algos().iter().copied(), s, &t);
        // Ring and Rabenseifner move the same bytes; the halving's whole-block exchanges pay more.
        assert_eq!(a, Some(Algo::Ring));
        let b = GBIT.best(Coll::Broadcast, [Algo::Tree, Algo::Chain], s, &t);
        assert_eq!(b, Some(Algo::Chain));
        // Scatter + allgather: the root sends 1.75·S against the tree root's 3·S, and the
        // chain's S per link beats both.
        let cost = |a| GBIT.cost(Coll::Broadcast, a, s, &t).unwrap();
        assert!(cost(Algo::Chain) < cost(Algo::ScatterAllgather));
        assert!(cost(Algo::ScatterAllgather) < 0.6 * cost(Algo::Tree));
        let all = Coll::Broadcast.algos().iter().copied();
        assert_eq!(GBIT.best(Coll::Broadcast, all, s, &t), Some(Algo::Chain));
        // Back to back, the chain's hops overlap: it wins small broadcasts across hosts too.
        let b = GBIT.best(Coll::Broadcast, [Algo::Tree, Algo::Chain], 1024.0, &t);
        assert_eq!(b, Some(Algo::Chain));
    }

    #[test]
    fn two_level_gathers_and_scatters_where_hosts_share_a_link() {
        // 2 hosts × 2 ranks: S/2 over each link in two column rings, against the ring's 3S/4.
        let s = 16.0 * 1048576.0;
        let t = Topology::from_hosts(&[0, 0, 1, 1]);
        for coll in [Coll::Allgather, Coll::ReduceScatter] {
            let all = coll.algos().iter().copied();
            assert_eq!(GBIT.best(coll, all, s, &t), Some(Algo::TwoLevel), "{coll}");
            // One rank per host, or uneven hosts: no two-level.
            for hosts in [&[0, 1, 2, 3][..], &[0, 0, 0, 1]] {
                let u = Topology::from_hosts(hosts);
                assert_eq!(GBIT.cost(coll, Algo::TwoLevel, s, &u), None, "{coll} {hosts:?}");
            }
        }
        // 4 hosts × 2: 0.75·S in rings sharing each link against the ring's 0.875·S in one:
        // about even, and the ring keeps it.
        let t = Topology::from_hosts(&[0, 0, 1, 1, 2, 2, 3, 3]);
        let all = Coll::Allgather.algos().iter().copied();
        assert_eq!(GBIT.best(Coll::Allgather, all, s, &t), Some(Algo::Ring));
    }
}
