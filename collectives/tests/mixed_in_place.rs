//! In place or out of place is each rank's own choice: the contracts ask every rank for the
//! same collective, count, op and root, not the same form of the call. So every collective that
//! has both forms runs with some ranks in place and the others out of place, with every
//! algorithm, at sizes below and above the one where large messages go in pieces
//! (`algo::INTERLEAVE_MIN`), and every byte is compared with the answer each rank computes on
//! its own. (Before, an out-of-place all-gather cut its first large exchange in pieces while an
//! in-place one sent it whole: the pair failed with a count mismatch.)

use crate::common::*;
use tutti_collectives::algo::INTERLEAVE_MIN;
use tutti_collectives::{Algo, Coll, Comm, ReduceOp};

/// Which ranks call in place: the even ones, or the odd ones.
const PATTERNS: [usize; 2] = [0, 1];

fn in_place(rank: usize, pattern: usize) -> bool {
    rank % 2 == pattern
}

/// Element counts (of `i32`, 4 bytes) per block: tiny, odd, and one block just above the size
/// at which exchanges go in pieces (plus 3 elements, so the last piece is short).
fn block_counts() -> [usize; 3] {
    [1, 1001, INTERLEAVE_MIN / 4 + 3]
}

/// The algorithms of `coll` that run on `n` ranks of one host with equal counts (two-level
/// needs several hosts).
fn algos(coll: Coll, n: usize) -> Vec<Algo> {
    coll.algos()
        .iter()
        .copied()
        .filter(|&a| coll.supports(a, n, true).is_ok() && a != Algo::TwoLevel)
        .collect()
}

fn allgather_mixed(c: &Comm, pattern: usize) {
    let (n, r) = (c.size(), c.rank());
    for count in block_counts() {
        let want: Vec<i32> =
            (0..n).flat_map(|q| input::<i32>(21, q, count, ReduceOp::Sum)).collect();
        for algo in algos(Coll::Allgather, n) {
            let ca = c.with_algo(algo);
            let mine = input::<i32>(21, r, count, ReduceOp::Sum);
            let mut out = vec![0i32; n * count];
            if in_place(r, pattern) {
                out[r * count..(r + 1) * count].copy_from_slice(&mine);
                ca.allgather_inplace(&mut out).unwrap();
            } else {
                ca.allgather(&mine, &mut out).unwrap();
            }
            assert!(out == want, "{algo} allgather n={n} count={count} rank {r} pattern {pattern}");
        }
    }
}

fn alltoall_mixed(c: &Comm, pattern: usize) {
    let (n, r) = (c.size(), c.rank());
    let val = |s: usize, d: usize, j: usize| (s * 7919 + d * 104_729 + j) as i32;
    for count in block_counts() {
        let inp: Vec<i32> = (0..n).flat_map(|d| (0..count).map(move |j| val(r, d, j))).collect();
        let want: Vec<i32> = (0..n).flat_map(|s| (0..count).map(move |j| val(s, r, j))).collect();
        for algo in algos(Coll::AllToAll, n) {
            let ca = c.with_algo(algo);
            let out = if in_place(r, pattern) {
                let mut b = inp.clone();
                ca.all_to_all_inplace(&mut b).unwrap();
                b
            } else {
                let mut b = vec![0; n * count];
                ca.all_to_all(&inp, &mut b).unwrap();
                b
            };
            assert!(out == want, "{algo} alltoall n={n} count={count} rank {r} pattern {pattern}");
        }
    }
}

fn allreduce_mixed(c: &Comm, pattern: usize) {
    let (n, r) = (c.size(), c.rank());
    for count in [1, 1001, n * (INTERLEAVE_MIN / 4) + 3] {
        let want: Vec<i32> = (0..count).map(|i| reduced(22, n, i, ReduceOp::Sum)).collect();
        for algo in allreduce_algos(c) {
            let ca = c.with_algo(algo);
            let inp = input::<i32>(22, r, count, ReduceOp::Sum);
            let out = if in_place(r, pattern) {
                let mut b = inp;
                ca.allreduce(&mut b, ReduceOp::Sum).unwrap();
                b
            } else {
                let mut b = vec![0; count];
                ca.allreduce_from(&inp, &mut b, ReduceOp::Sum).unwrap();
                b
            };
            assert!(out == want, "{algo} allreduce n={n} count={count} rank {r} pattern {pattern}");
        }
    }
}

fn reduce_scatter_mixed(c: &Comm, pattern: usize) {
    let (n, r) = (c.size(), c.rank());
    for count in block_counts() {
        let full = input::<i32>(23, r, count * n, ReduceOp::Sum);
        let want: Vec<i32> =
            (r * count..(r + 1) * count).map(|i| reduced(23, n, i, ReduceOp::Sum)).collect();
        for algo in algos(Coll::ReduceScatter, n) {
            let ca = c.with_algo(algo);
            let got = if in_place(r, pattern) {
                let mut b = full.clone();
                ca.reduce_scatter_inplace(&mut b, ReduceOp::Sum).unwrap();
                b[r * count..(r + 1) * count].to_vec()
            } else {
                let mut b = vec![0; count];
                ca.reduce_scatter(&full, &mut b, ReduceOp::Sum).unwrap();
                b
            };
            assert!(
                got == want,
                "{algo} reduce_scatter n={n} count={count} rank {r} pattern {pattern}"
            );
        }
    }
}

fn rooted_mixed(c: &Comm, pattern: usize) {
    let (n, r) = (c.size(), c.rank());
    for count in [1, 1001, INTERLEAVE_MIN / 4 + 3] {
        for root in [0, n - 1] {
            let src = input::<i32>(24, root, count, ReduceOp::Sum);
            for &algo in Coll::Broadcast.algos() {
                let ca = c.with_algo(algo);
                let got = if in_place(r, pattern) {
                    let mut b = if r == root { src.clone() } else { vec![-1; count] };
                    ca.broadcast(&mut b, root).unwrap();
                    b
                } else {
                    let mut b = vec![-1; count];
                    let mine = if r == root { src.clone() } else { vec![-2; count] };
                    ca.broadcast_from(&mine, &mut b, root).unwrap();
                    b
                };
                assert!(got == src, "{algo} broadcast n={n} count={count} rank {r} root {root}");
            }
            let inp = input::<i32>(25, r, count, ReduceOp::Sum);
            let want: Vec<i32> = (0..count).map(|i| reduced(25, n, i, ReduceOp::Sum)).collect();
            let got = if in_place(r, pattern) {
                let mut b = inp;
                c.reduce(&mut b, ReduceOp::Sum, root).unwrap();
                b
            } else {
                let mut b = vec![0; count];
                c.reduce_from(&inp, &mut b, ReduceOp::Sum, root).unwrap();
                b
            };
            if r == root {
                assert!(got == want, "reduce n={n} count={count} root {root} pattern {pattern}");
            }
            let all: Vec<i32> =
                (0..n).flat_map(|q| input::<i32>(26, q, count, ReduceOp::Sum)).collect();
            let mine = input::<i32>(26, r, count, ReduceOp::Sum);
            if in_place(r, pattern) {
                // In place every rank passes room for every block, its own at its offset.
                let mut b = vec![0; n * count];
                b[r * count..(r + 1) * count].copy_from_slice(&mine);
                c.gather_inplace(&mut b, root).unwrap();
                if r == root {
                    assert!(b == all, "gather n={n} count={count} root {root} pattern {pattern}");
                }
                let mut b = if r == root { all.clone() } else { vec![0; n * count] };
                c.scatter_inplace(&mut b, root).unwrap();
                assert!(
                    b[r * count..(r + 1) * count] == mine[..],
                    "scatter n={n} count={count} root {root}"
                );
            } else {
                let mut out = if r == root { vec![0; n * count] } else { Vec::new() };
                c.gather(&mine, &mut out, root).unwrap();
                if r == root {
                    assert!(out == all, "gather n={n} count={count} root {root} pattern {pattern}");
                }
                let src = if r == root { all.clone() } else { Vec::new() };
                let mut got = vec![0; count];
                c.scatter(&src, &mut got, root).unwrap();
                assert!(got == mine, "scatter n={n} count={count} root {root}");
            }
        }
    }
}

/// Run `f` on every rank of each world, once with each pattern of in-place ranks.
fn each_world(worlds: &[usize], f: impl Fn(&Comm, usize) + Sync) {
    for &n in worlds {
        for pattern in PATTERNS {
            world(n, 512 << 10, |c| f(&c, pattern));
        }
    }
}

#[test]
fn allgather_and_alltoall_with_ranks_in_place_and_not() {
    each_world(&[2, 3, 4, 5], |c, pattern| {
        allgather_mixed(c, pattern);
        alltoall_mixed(c, pattern);
    });
}

#[test]
fn reductions_with_ranks_in_place_and_not() {
    each_world(&[2, 3, 4], |c, pattern| {
        allreduce_mixed(c, pattern);
        reduce_scatter_mixed(c, pattern);
    });
}

#[test]
fn rooted_collectives_with_ranks_in_place_and_not() {
    each_world(&[2, 3, 4], rooted_mixed);
}
