//! Exact test data: small integers every dtype stores exactly, kept inside the exact
//! range after reduction, so any summation order gives the same bits. Each rank computes the
//! expected output locally from (seed, rank, world, op).

#![allow(dead_code)]

use tutti_collectives::{Comm, Config, Element};

#[allow(unused_imports)]
pub(crate) use tutti_collectives::verify::{input, reduced};

/// Bitwise equality of two slices of elements.
pub(crate) fn same_bits<T: Element>(a: &[T], b: &[T]) -> bool {
    tutti_collectives::dtype::as_bytes(a) == tutti_collectives::dtype::as_bytes(b)
}

/// Run `f` on every rank of an in-memory world of `n` with segment size `seg`.
pub(crate) fn world(n: usize, seg: usize, f: impl Fn(Comm) + Sync) {
    let groups = tutti_runtime::Group::mem_world(n);
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                g.set_timeout(std::time::Duration::from_secs(60));
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

/// The element counts of the grid for world `n`.
pub(crate) fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, n.saturating_sub(1), n, n + 1, 1000, 10007];
    c.sort_unstable();
    c.dedup();
    c
}

/// The world sizes of the grid.
pub(crate) const WORLDS: [usize; 18] =
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32];
