//! A communicator reuses the plan of a recent call with the same shape (collective, algorithm,
//! element size, counts, root, in place or not, topology). These tests interleave calls that
//! share all but one of those on one communicator, so a plan taken for the wrong call would
//! send to the wrong ranks, the wrong bytes or the wrong amount: every result is compared
//! element for element, and a stale plan fails as a mismatch or a timeout instead.

use crate::common::*;
use tutti_collectives::{Algo, Coll, Comm, ReduceOp};

/// The broadcast and reduce roots change from call to call, with everything else the same.
#[test]
fn roots_change_between_identical_calls() {
    for n in [2, 3, 4, 5] {
        world(n, 512 << 10, |c| {
            let r = c.rank();
            for round in 0..3 {
                for root in (0..n).chain((0..n).rev()) {
                    let count = 1000 + round;
                    let mut b: Vec<i32> = if r == root {
                        input::<i32>(31, root, count, ReduceOp::Sum)
                    } else {
                        vec![0; count]
                    };
                    c.broadcast(&mut b, root).unwrap();
                    assert!(
                        b == input::<i32>(31, root, count, ReduceOp::Sum),
                        "bcast n={n} root {root} rank {r}"
                    );
                    let mut v = input::<i32>(32, r, count, ReduceOp::Sum);
                    c.reduce(&mut v, ReduceOp::Sum, root).unwrap();
                    if r == root {
                        let want: Vec<i32> =
                            (0..count).map(|i| reduced(32, n, i, ReduceOp::Sum)).collect();
                        assert!(v == want, "reduce n={n} root {root}");
                    }
                }
            }
        });
    }
}

/// In place and out of place back to back (each rank alternating, the ranks out of step), then
/// the same bytes as `f64` (other element size and count), under each allreduce algorithm.
#[test]
fn same_shape_other_form_dtype_or_algorithm() {
    for n in [2, 3, 4] {
        world(n, 4 << 10, |c| {
            let r = c.rank();
            for &algo in &allreduce_algos(&c) {
                let ca = c.with_algo(algo);
                for count in [2048usize, 4096] {
                    let want32: Vec<f32> =
                        (0..count).map(|i| reduced(33, n, i, ReduceOp::Sum)).collect();
                    for k in 0..4 {
                        let mut a = input::<f32>(33, r, count, ReduceOp::Sum);
                        if (r + k) % 2 == 0 {
                            ca.allreduce(&mut a, ReduceOp::Sum).unwrap();
                        } else {
                            let mut out = vec![0f32; count];
                            ca.allreduce_from(&a, &mut out, ReduceOp::Sum).unwrap();
                            a = out;
                        }
                        assert!(same_bits(&a, &want32), "{algo} f32 n={n} count {count} k {k}");
                    }
                    let half = count / 2;
                    let want64: Vec<f64> =
                        (0..half).map(|i| reduced(34, n, i, ReduceOp::Sum)).collect();
                    let mut d = input::<f64>(34, r, half, ReduceOp::Sum);
                    ca.allreduce(&mut d, ReduceOp::Sum).unwrap();
                    assert!(same_bits(&d, &want64), "{algo} f64 n={n} count {half}");
                }
            }
        });
    }
}

/// Copies of one communicator that know other hosts share its cache: the ring follows hosts,
/// so each plans its own neighbours (that the cache tells topologies apart is checked where it
/// lives, in the executor's unit tests: any valid ring gives these results). More shapes than
/// the cache keeps go by between repeats, then the first ones come back.
#[test]
fn other_hosts_and_more_shapes_than_kept() {
    let n = 4;
    world(n, 512 << 10, |c| {
        let r = c.rank();
        let spread = c.with_hosts(&[0, 1, 0, 1]).unwrap();
        let packed = c.with_hosts(&[0, 0, 1, 1]).unwrap();
        for round in 0..2 {
            for (k, cc) in [&c, &spread, &packed, &spread, &c].into_iter().enumerate() {
                let ca = cc.with_algo(Algo::Ring);
                for count in 1..=20usize {
                    let count = count * 17 + round + k;
                    let want: Vec<i32> =
                        (0..n).flat_map(|q| input::<i32>(35, q, count, ReduceOp::Sum)).collect();
                    let mine = input::<i32>(35, r, count, ReduceOp::Sum);
                    let mut out = vec![0i32; n * count];
                    ca.allgather(&mine, &mut out).unwrap();
                    assert!(out == want, "ring allgather {k} count {count} rank {r}");
                }
            }
        }
        // And back to every collective's first shapes after the cache turned over.
        for coll in [Coll::Allgather, Coll::AllToAll] {
            for &algo in coll.algos().iter().filter(|a| coll.supports(**a, n, true).is_ok()) {
                if algo == Algo::TwoLevel {
                    continue; // one host
                }
                let ca = c.with_algo(algo);
                let count = 18;
                if coll == Coll::Allgather {
                    let want: Vec<i32> =
                        (0..n).flat_map(|q| input::<i32>(36, q, count, ReduceOp::Sum)).collect();
                    let mut out = vec![0i32; n * count];
                    ca.allgather(&input::<i32>(36, r, count, ReduceOp::Sum), &mut out).unwrap();
                    assert!(out == want, "{algo} allgather rank {r}");
                } else {
                    let val = |s: usize, d: usize, j: usize| (s * 7919 + d * 104_729 + j) as i32;
                    let inp: Vec<i32> =
                        (0..n).flat_map(|d| (0..count).map(move |j| val(r, d, j))).collect();
                    let want: Vec<i32> =
                        (0..n).flat_map(|s| (0..count).map(move |j| val(s, r, j))).collect();
                    let mut out = vec![0i32; n * count];
                    ca.all_to_all(&inp, &mut out).unwrap();
                    assert!(out == want, "{algo} alltoall rank {r}");
                }
            }
        }
    });
}

/// Uneven (`v`) calls are planned afresh: the same total split differently between the ranks.
#[test]
fn uneven_counts_with_the_same_total() {
    let n = 3;
    world(n, 512 << 10, |c: Comm| {
        let r = c.rank();
        for counts in [[1usize, 2, 3], [3, 2, 1], [2, 2, 2], [1, 2, 3]] {
            let total: usize = counts.iter().sum();
            let mine = input::<i32>(37 + r as u64, r, counts[r], ReduceOp::Sum);
            let want: Vec<i32> = (0..n)
                .flat_map(|q| input::<i32>(37 + q as u64, q, counts[q], ReduceOp::Sum))
                .collect();
            let mut out = vec![0i32; total];
            c.allgatherv(&mine, &mut out, &counts).unwrap();
            assert!(out == want, "allgatherv {counts:?} rank {r}");
        }
    });
}
