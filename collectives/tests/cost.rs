//! Cost tests: each algorithm's plans, run symbolically for every rank, must match (every send
//! has its receive, nothing deadlocks) and send the bytes and take the critical-path steps that
//! docs/algorithms.md states.

use tutti_collectives::algo::{self, PlanCtx};
use tutti_collectives::plan::{blocks_from_counts, simulate, Buf, Plan, SimResult};
use tutti_collectives::{Algo, Coll, Topology};

const BIG_SEG: usize = 1 << 40;

fn shape(rank: usize, n: usize, seg: usize) -> PlanCtx {
    PlanCtx { rank, n, esize: 4, seg, in_place: true }
}

fn sim(n: usize, f: impl Fn(&PlanCtx) -> Plan, seg: usize) -> SimResult {
    sim_named(n, f, seg, "")
}

fn sim_named(n: usize, f: impl Fn(&PlanCtx) -> Plan, seg: usize, what: &str) -> SimResult {
    let plans: Vec<Plan> = (0..n).map(|r| f(&shape(r, n, seg))).collect();
    simulate(&plans).unwrap_or_else(|e| panic!("n={n} {what}: {e}"))
}

fn log2_ceil(n: usize) -> u64 {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as u64
}

#[test]
fn ring_allreduce_cost() {
    for n in 2..=16 {
        let count = 1024 * n; // divisible: every block is S/n
        let s = (count * 4) as u64;
        let r = sim(n, |sh| algo::ring::allreduce(sh, count), BIG_SEG);
        for b in &r.bytes_sent {
            assert_eq!(*b, 2 * (n as u64 - 1) * s / n as u64, "n={n}");
        }
        assert_eq!(r.critical_steps, 2 * (n as u64 - 1), "n={n}");
        // Pipelined: k segments per block add k-1 steps, not k times the steps.
        let k = 8;
        let seg = s as usize / n / k;
        let r = sim(n, |sh| algo::ring::allreduce(sh, count), seg);
        assert!(
            r.critical_steps <= 2 * (n as u64 - 1) + 2 * (k as u64 - 1),
            "n={n}: {}",
            r.critical_steps
        );
    }
}

#[test]
fn ring_allgather_and_reduce_scatter_cost() {
    for n in 2..=16 {
        let blocks = blocks_from_counts(&vec![256; n], 4);
        let total = (256 * 4 * n) as u64;
        let r = sim(n, |sh| algo::ring::allgather(sh, &blocks), BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * total / n as u64));
        assert_eq!(r.critical_steps, n as u64 - 1);
        let r = sim(
            n,
            |sh| algo::ring::reduce_scatter(&PlanCtx { in_place: false, ..*sh }, &blocks),
            BIG_SEG,
        );
        assert!(r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * total / n as u64));
        assert_eq!(r.critical_steps, n as u64 - 1);
    }
}

#[test]
fn recursive_doubling_and_rabenseifner_cost() {
    for n in [2usize, 4, 8, 16, 32] {
        let count = 64 * n;
        let s = (count * 4) as u64;
        let lg = n.trailing_zeros() as u64;
        let r = sim(n, |sh| algo::recursive_doubling::allreduce(sh, count), BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == lg * s), "rd n={n}");
        assert_eq!(r.critical_steps, lg);
        let r = sim(n, |sh| algo::halving_doubling::allreduce(sh, count), BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == 2 * (n as u64 - 1) * s / n as u64), "rab n={n}");
        assert_eq!(r.critical_steps, 2 * lg);
        let blocks = blocks_from_counts(&vec![64; n], 4);
        let r = sim(n, |sh| algo::halving_doubling::reduce_scatter(sh, &blocks), BIG_SEG);
        let total = (64 * 4 * n) as u64;
        assert!(
            r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * total / n as u64),
            "halving n={n}"
        );
        assert_eq!(r.critical_steps, lg);
        let r = sim(n, |sh| algo::recursive_doubling::allgather(sh, &blocks), BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * total / n as u64));
        assert_eq!(r.critical_steps, lg);
    }
    // Non-powers of two fold: at most two extra steps (the fold-in can overlap the first round
    // of ranks that did not fold).
    for n in [3usize, 5, 6, 7, 12, 24] {
        let lg = (n.next_power_of_two() / 2).trailing_zeros() as u64;
        let r = sim(n, |sh| algo::recursive_doubling::allreduce(sh, 100), BIG_SEG);
        assert!((lg + 1..=lg + 2).contains(&r.critical_steps), "rd n={n}: {}", r.critical_steps);
        let r = sim(n, |sh| algo::halving_doubling::allreduce(sh, 100), BIG_SEG);
        assert!(
            (2 * lg + 1..=2 * lg + 2).contains(&r.critical_steps),
            "rab n={n}: {}",
            r.critical_steps
        );
    }
}

#[test]
fn tree_chain_bruck_barrier_cost() {
    for n in 2..=33 {
        let len = 4096;
        // Depth of the binomial tree: the most set bits of any relative rank below n.
        let depth = (0..n).map(|v: usize| v.count_ones() as u64).max().unwrap_or(0);
        let r = sim(n, |sh| algo::tree::broadcast(sh, len, 0), BIG_SEG);
        assert_eq!(r.critical_steps, depth, "tree bcast n={n}");
        assert_eq!(r.bytes_sent[0], log2_ceil(n) * len as u64, "root sends one copy per child");
        assert_eq!(r.bytes_sent.iter().sum::<u64>(), (n as u64 - 1) * len as u64);
        let r = sim(n, |sh| algo::tree::reduce(sh, len, n / 2), BIG_SEG);
        assert_eq!(r.critical_steps, depth, "tree reduce n={n}");
        assert_eq!(r.bytes_sent.iter().sum::<u64>(), (n as u64 - 1) * len as u64);
        let r = sim(n, |sh| algo::tree::allreduce(sh, len / 4), BIG_SEG);
        assert_eq!(r.critical_steps, 2 * depth, "tree allreduce n={n}");
        let r = sim(n, |sh| algo::chain::broadcast(sh, len, 1), BIG_SEG);
        assert_eq!(r.critical_steps, n as u64 - 1, "chain n={n}");
        // Segments add bandwidth time, not hops: 16 segments still take n-1 hops of latency.
        let r = sim(n, |sh| algo::chain::broadcast(sh, len, 1), len / 16);
        assert_eq!(r.critical_steps, n as u64 - 1, "pipelined chain n={n}");
        assert_eq!(r.messages.iter().sum::<usize>(), (n - 1) * 16);
        let r = sim(n, |sh| algo::bruck::allgather(sh, 400), BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * 400), "bruck n={n}");
        assert_eq!(r.critical_steps, log2_ceil(n), "bruck n={n}");
        let r = sim(n, algo::barrier::dissemination, BIG_SEG);
        assert_eq!(r.critical_steps, log2_ceil(n), "barrier n={n}");
        assert!(r.messages.iter().all(|m| *m as u64 == log2_ceil(n)));
    }
}

#[test]
fn alltoall_gather_scatter_cost() {
    for n in 1..=17 {
        let blocks = blocks_from_counts(&vec![10; n], 4);
        let pw = |sh: &PlanCtx| {
            let mut p = Plan::new();
            algo::alltoall::pairwise(
                &mut p,
                &PlanCtx { in_place: false, ..*sh },
                Buf::Input,
                &blocks,
                &blocks,
            );
            p
        };
        let r = sim(n, pw, BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * 40));
        let pa = |sh: &PlanCtx| {
            let mut p = Plan::new();
            algo::alltoall::post_all(
                &mut p,
                &PlanCtx { in_place: false, ..*sh },
                Buf::Input,
                &blocks,
                &blocks,
            );
            p
        };
        let r = sim(n, pa, BIG_SEG);
        assert!(r.bytes_sent.iter().all(|b| *b == (n as u64 - 1) * 40));
        assert!(r.critical_steps <= 1);
        // Bruck: round k moves the blocks whose position has bit k set, one message a round.
        let br = |sh: &PlanCtx| {
            let mut p = Plan::new();
            algo::alltoall::bruck(
                &mut p,
                &PlanCtx { in_place: false, ..*sh },
                Buf::Input,
                &blocks,
                &blocks,
            );
            p
        };
        let r = sim(n, br, BIG_SEG);
        let moved: u64 =
            (0..log2_ceil(n)).map(|k| (0..n).filter(|i| i >> k & 1 == 1).count() as u64).sum();
        assert!(r.bytes_sent.iter().all(|b| *b == moved * 40), "bruck n={n}: {:?}", r.bytes_sent);
        assert!(r.messages.iter().all(|m| *m as u64 == log2_ceil(n)), "bruck n={n}");
        assert_eq!(r.critical_steps, log2_ceil(n), "bruck n={n}");
        let r = sim(
            n,
            |sh| algo::linear::gather(&PlanCtx { in_place: false, ..*sh }, &blocks, n - 1),
            BIG_SEG,
        );
        assert_eq!(r.bytes_sent.iter().sum::<u64>(), (n as u64 - 1) * 40);
        let r = sim(
            n,
            |sh| algo::linear::scatter(&PlanCtx { in_place: false, ..*sh }, &blocks, 0),
            BIG_SEG,
        );
        assert_eq!(r.bytes_sent[0], (n as u64 - 1) * 40);
    }
}

#[test]
fn every_plan_matches_at_every_world() {
    // Uneven counts and tiny segments: every send must meet its receive, no deadlock.
    for n in (1usize..=16).chain([24, 32]) {
        for count in [0usize, 1, n.saturating_sub(1), n + 1, 1000] {
            for seg in [8usize, 512 << 10] {
                let uneven: Vec<usize> = (0..n).map(|q| (q * 3 + count) % (count + 2)).collect();
                // The library's own lists: every collective, every algorithm it has, uneven
                // and equal counts, in place and not, every kind of root.
                for counts in [uneven, vec![count; n]] {
                    let uniform = counts.windows(2).all(|w| w[0] == w[1]);
                    for coll in Coll::ALL {
                        for &a in coll.algos() {
                            // Two-level needs hosts: `host_placements_match` below. Direct
                            // reads have no message schedule (`tests/direct.rs`).
                            if coll.supports(a, n, uniform).is_err()
                                || matches!(a, Algo::TwoLevel | Algo::Direct)
                            {
                                continue;
                            }
                            let rooted = matches!(
                                coll,
                                Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter
                            );
                            let variants: &[(usize, bool)] = if rooted {
                                &[(0, true), (n / 2, false), (n - 1, true)]
                            } else {
                                &[(0, true), (0, false)]
                            };
                            for &(root, in_place) in variants {
                                let f = |sh: &PlanCtx| {
                                    let sh = PlanCtx { in_place, ..*sh };
                                    coll.plan(a, &sh, &counts, root).unwrap()
                                };
                                let what = format!("{coll} {a} {counts:?} root {root}");
                                sim_named(n, f, seg, &what);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn two_level_cost() {
    // Each rank sends 2(L-1)/L·S within its host and 2(h-1)/h·S/L across hosts, in
    // 2(L-1) + 2(h-1) steps.
    for (h, l) in [(2usize, 2usize), (3, 2), (2, 4), (4, 2), (3, 3)] {
        let n = h * l;
        let hosts: Vec<usize> = (0..n).map(|r| r / l).collect();
        let topo = Topology::from_hosts(&hosts);
        let count = 1024 * n;
        let s = (count * 4) as u64;
        let r = sim(n, |sh| algo::two_level::allreduce(sh, count, &topo).unwrap(), BIG_SEG);
        let (h64, l64) = (h as u64, l as u64);
        let want = 2 * (l64 - 1) * s / l64 + 2 * (h64 - 1) * s / l64 / h64;
        for b in &r.bytes_sent {
            assert_eq!(*b, want, "{h} hosts x {l}");
        }
        assert_eq!(r.critical_steps, 2 * (l64 - 1) + 2 * (h64 - 1), "{h} hosts x {l}");
    }
}

#[test]
fn host_placements_match() {
    // The ring and the chain reordered host by host, and two-level (allreduce, allgather,
    // reduce-scatter), on placements by host and
    // round-robin, even and uneven counts, tiny and whole segments.
    let placements: [&[usize]; 5] = [
        &[0, 0, 1, 1],
        &[0, 1, 0, 1],
        &[0, 1, 2, 0, 1, 2],
        &[1, 1, 0, 0, 2, 2, 3, 3],
        &[0, 0, 0, 1, 2],
    ];
    for hosts in placements {
        let topo = Topology::from_hosts(hosts);
        let n = hosts.len();
        for count in [0usize, 1, n + 1, 1000] {
            let uneven: Vec<usize> = (0..n).map(|q| (q * 3 + count) % (count + 2)).collect();
            for counts in [uneven, vec![count; n]] {
                let uniform = counts.windows(2).all(|w| w[0] == w[1]);
                for (coll, a) in [
                    (Coll::Allreduce, Algo::Ring),
                    (Coll::Allreduce, Algo::TwoLevel),
                    (Coll::Allgather, Algo::Ring),
                    (Coll::Allgather, Algo::TwoLevel),
                    (Coll::ReduceScatter, Algo::Ring),
                    (Coll::ReduceScatter, Algo::TwoLevel),
                    (Coll::Broadcast, Algo::Chain),
                    (Coll::Broadcast, Algo::ScatterAllgather),
                ] {
                    if !uniform && matches!(coll, Coll::Allreduce | Coll::Broadcast) {
                        continue;
                    }
                    let fits = topo.two_level().is_some();
                    for seg in [8usize, BIG_SEG] {
                        for (root, in_place) in [(0, true), (n - 1, false)] {
                            let f = |sh: &PlanCtx| {
                                let sh = PlanCtx { in_place, ..*sh };
                                match coll.plan_on(a, &sh, &counts, root, &topo) {
                                    Ok(p) => p,
                                    Err(e) => {
                                        assert!(a == Algo::TwoLevel && !fits, "{a}: {e}");
                                        Plan::new()
                                    }
                                }
                            };
                            let what = format!("{coll} {a} {hosts:?} {counts:?} root {root}");
                            sim_named(n, f, seg, &what);
                        }
                    }
                }
            }
        }
    }
}
