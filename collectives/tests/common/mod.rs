//! Exact test data: small integers every dtype stores exactly, kept inside the exact
//! range after reduction, so any summation order gives the same bits. Each rank computes the
//! expected output locally from (seed, rank, world, op).

#![allow(dead_code)]

use std::time::Duration;

use tutti_collectives::{Comm, Config};

#[allow(unused_imports)]
pub(crate) use tutti_collectives::verify::{input, reduced};

pub(crate) mod grid;
#[allow(unused_imports)]
pub(crate) use grid::{algos, allreduce_algos, counts, same_bits};

/// Run `f` on every rank of an in-memory world of `n` with segment size `seg`.
pub(crate) fn world(n: usize, seg: usize, f: impl Fn(Comm) + Sync) {
    on_groups(tutti_runtime::Group::mem_world(n), seg, f);
}

/// As [`world`], over TCP connections whose frames go through shared memory (the ranks are
/// threads of this process, so of one host), checking that every link is shared memory.
pub(crate) fn shm_world(n: usize, seg: usize, f: impl Fn(Comm) + Sync) {
    let groups = tutti_runtime::testing::groups(tutti_runtime::testing::Kind::Shm, n)
        .expect("a shared-memory world of threads");
    let everyone: Vec<usize> = (0..n).collect();
    std::thread::scope(|s| {
        for g in &groups {
            let everyone = &everyone;
            s.spawn(move || {
                g.transport().connect_peers(everyone, Duration::from_secs(60)).unwrap()
            });
        }
    });
    for g in &groups {
        let t = g.transport();
        for p in (0..n).filter(|p| *p != g.rank()) {
            assert_eq!(t.link_kind(p), "shm", "rank {}'s link to {p}", g.rank());
        }
    }
    on_groups(groups, seg, f);
}

pub(crate) fn on_groups(groups: Vec<tutti_runtime::Group>, seg: usize, f: impl Fn(Comm) + Sync) {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                g.set_timeout(Duration::from_secs(60));
                let c = Comm::with_config(g, Config { segment: seg, ..Config::default() });
                s.spawn(move || f(c))
            })
            .collect();
        for h in hs {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
}

/// Host placements to run the grids on: (hosts of each rank, what it is).
pub(crate) const PLACEMENTS: [(&[usize], &str); 6] = [
    (&[0, 0, 1, 1], "2 hosts x 2, by host"),
    (&[0, 1, 0, 1], "2 hosts x 2, round-robin"),
    (&[0, 1, 2, 0, 1, 2], "3 hosts x 2, round-robin"),
    (&[0, 0, 1, 1, 2, 2, 3, 3], "4 hosts x 2, by host"),
    (&[2, 2, 2, 0, 0, 0, 1, 1, 1], "3 hosts x 3, hosts numbered out of order"),
    (&[0, 0, 0, 1, 2], "uneven hosts (no two-level)"),
];

/// The world sizes of the grid.
pub(crate) const WORLDS: [usize; 18] =
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32];
