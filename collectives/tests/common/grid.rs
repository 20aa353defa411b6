//! The grid of every collective and every algorithm on a communicator, with exact data (each
//! rank computes the expected output from the seed, its rank, the world and the op): run by the
//! tests of this crate on ranks that are threads, and by `tt-rank grid` on ranks that are
//! processes (`tests/tests/collectives_tcp.rs`). Self-contained: it uses only the public API.

#![allow(dead_code)]

use half::{bf16, f16};
use tutti_collectives::verify::{input, reduced};
use tutti_collectives::{Algo, Coll, Comm, Element, ReduceOp};

/// Bitwise equality of two slices of elements.
pub(crate) fn same_bits<T: Element>(a: &[T], b: &[T]) -> bool {
    tutti_collectives::dtype::as_bytes(a) == tutti_collectives::dtype::as_bytes(b)
}

/// The allreduce algorithms that can run on `c`: all of them, less two-level unless `c`'s ranks
/// sit on at least 2 hosts with the same number (at least 2) on each.
pub(crate) fn allreduce_algos(c: &Comm) -> Vec<Algo> {
    let two_level = c.topology().unwrap().two_level().is_some();
    algos(c, Coll::Allreduce).into_iter().filter(|a| *a != Algo::TwoLevel || two_level).collect()
}

/// The algorithms of `coll` that can run on `c`: all of them, less direct reads where a link
/// of the group goes through the network (a QUIC job across hosts).
pub(crate) fn algos(c: &Comm, coll: Coll) -> Vec<Algo> {
    let t = c.group().transport();
    let net = (0..c.size()).any(|p| matches!(t.link_kind(p), "tcp" | "quic"));
    coll.algos().iter().copied().filter(|a| *a != Algo::Direct || !net).collect()
}

/// The element counts of the grid for world `n`.
pub(crate) fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, n.saturating_sub(1), n, n + 1, 1000, 10007];
    c.sort_unstable();
    c.dedup();
    c
}

/// Whether `algo` cannot run `coll` on `n` ranks: only a power-of-two algorithm may be refused,
/// only on a world that is not a power of two. (A refused call poisons the group, so the grid
/// skips it; `mismatch.rs` checks the refusal itself.)
pub(crate) fn skip(coll: Coll, algo: Algo, n: usize, pof2_only: bool) -> bool {
    match coll.supports(algo, n, true) {
        Ok(()) => {
            assert!(!pof2_only || n.is_power_of_two(), "{algo} claims to run on {n} ranks");
            false
        }
        Err(e) => {
            assert!(pof2_only && !n.is_power_of_two(), "{algo} refused on {n} ranks: {e}");
            true
        }
    }
}

/// Two-level where the group's hosts do not allow it (a forced refusal aborts the group).
pub(crate) fn no_two_level(c: &Comm, algo: Algo) -> bool {
    algo == Algo::TwoLevel && c.topology().unwrap().two_level().is_none()
}

pub(crate) fn check_allreduce<T: Element>(
    c: &Comm,
    seed: u64,
    count: usize,
    op: ReduceOp,
    in_place: bool,
    what: &str,
) {
    let n = c.size();
    let inp = input::<T>(seed, c.rank(), count, op);
    let want: Vec<T> = (0..count).map(|i| reduced(seed, n, i, op)).collect();
    let out = if in_place {
        let mut b = inp.clone();
        c.allreduce(&mut b, op).unwrap();
        b
    } else {
        let mut b = vec![T::default(); count];
        c.allreduce_from(&inp, &mut b, op).unwrap();
        b
    };
    assert!(
        same_bits(&out, &want),
        "{what}: allreduce n={n} count={count} op={op} rank={}",
        c.rank()
    );
}

/// A scaled allreduce: the exact sum times the factor, rounded once (f32 by 1/3, through
/// f64, as the contract says), and bf16 by 0.25 (exact); in place or out of place.
pub(crate) fn check_scaled(c: &Comm, seed: u64, count: usize, in_place: bool, what: &str) {
    let n = c.size();
    let run = |inp: Vec<f32>, k: f64| {
        if in_place {
            let mut b = inp;
            c.allreduce_scaled(&mut b, k).unwrap();
            b
        } else {
            let mut b = vec![0.0; count];
            c.allreduce_scaled_from(&inp, &mut b, k).unwrap();
            b
        }
    };
    let out = run(input::<f32>(seed, c.rank(), count, ReduceOp::Sum), 1.0 / 3.0);
    let want: Vec<f32> = (0..count)
        .map(|i| (f64::from(reduced::<f32>(seed, n, i, ReduceOp::Sum)) * (1.0 / 3.0)) as f32)
        .collect();
    assert!(same_bits(&out, &want), "{what}: scaled allreduce n={n} count={count}");
    let inp = input::<bf16>(seed, c.rank(), count, ReduceOp::Sum);
    let mut b = if in_place { inp.clone() } else { vec![bf16::ZERO; count] };
    if in_place {
        c.allreduce_scaled(&mut b, 0.25).unwrap();
    } else {
        c.allreduce_scaled_from(&inp, &mut b, 0.25).unwrap();
    }
    let want: Vec<bf16> = (0..count)
        .map(|i| bf16::from_f32(reduced::<bf16>(seed, n, i, ReduceOp::Sum).to_f32() * 0.25))
        .collect();
    assert!(same_bits(&b, &want), "{what}: scaled bf16 allreduce n={n} count={count}");
}

pub(crate) fn allreduce_grid(c: &Comm, seg_note: &str) {
    let n = c.size();
    for &count in &counts(n) {
        for algo in allreduce_algos(c) {
            let ca = c.with_algo(algo);
            for in_place in [true, false] {
                check_allreduce::<f32>(
                    &ca,
                    1,
                    count,
                    ReduceOp::Sum,
                    in_place,
                    &format!("{algo} {seg_note}"),
                );
                check_scaled(&ca, 4, count, in_place, &format!("{algo} {seg_note}"));
            }
        }
        check_allreduce::<f32>(c, 2, count, ReduceOp::Sum, true, "auto");
        check_scaled(c, 5, count, false, "auto");
    }
}

pub(crate) fn broadcast_grid(c: &Comm) {
    let n = c.size();
    for &count in &counts(n) {
        for algo in algos(c, Coll::Broadcast) {
            for root in 0..n {
                let ca = c.with_algo(algo);
                let src = input::<i32>(root as u64, root, count, ReduceOp::Sum);
                let mut b = if c.rank() == root { src.clone() } else { vec![99; count] };
                ca.broadcast(&mut b, root).unwrap();
                assert_eq!(b, src, "{algo} broadcast n={n} count={count} root={root}");
                let mut out = vec![7; count];
                ca.broadcast_from(&src, &mut out, root).unwrap();
                assert_eq!(out, src, "{algo} broadcast_from n={n} count={count} root={root}");
            }
        }
    }
}

pub(crate) fn reduce_grid(c: &Comm) {
    let n = c.size();
    for &count in &counts(n) {
        for root in 0..n {
            let inp = input::<f64>(3, c.rank(), count, ReduceOp::Max);
            let want: Vec<f64> = (0..count).map(|i| reduced(3, n, i, ReduceOp::Max)).collect();
            let mut b = inp.clone();
            c.reduce(&mut b, ReduceOp::Max, root).unwrap();
            if c.rank() == root {
                assert!(same_bits(&b, &want), "reduce n={n} count={count} root={root}");
            }
            let mut out = vec![0.0; count];
            c.reduce_from(&inp, &mut out, ReduceOp::Max, root).unwrap();
            if c.rank() == root {
                assert!(same_bits(&out, &want), "reduce_from n={n} count={count} root={root}");
            }
        }
    }
}

pub(crate) fn allgather_grid(c: &Comm) {
    let n = c.size();
    let r = c.rank();
    for &count in &counts(n) {
        let want: Vec<i64> =
            (0..n).flat_map(|q| input::<i64>(5, q, count, ReduceOp::Sum)).collect();
        for algo in algos(c, Coll::Allgather) {
            if skip(Coll::Allgather, algo, n, algo == Algo::RecursiveDoubling)
                || no_two_level(c, algo)
            {
                continue;
            }
            let ca = c.with_algo(algo);
            let mut out = vec![0i64; n * count];
            ca.allgather(&input(5, r, count, ReduceOp::Sum), &mut out).unwrap();
            assert_eq!(out, want, "{algo} allgather n={n} count={count}");
            let mut b = vec![0i64; n * count];
            b[r * count..(r + 1) * count].copy_from_slice(&input(5, r, count, ReduceOp::Sum));
            ca.allgather_inplace(&mut b).unwrap();
            assert_eq!(b, want, "{algo} allgather in place n={n} count={count}");
        }
    }
    // allgatherv: rank q contributes q % 3 * count / 2 + q elements.
    for &count in &[0usize, 7, 1000] {
        let cnts: Vec<usize> = (0..n).map(|q| (q % 3) * count / 2 + q).collect();
        let want: Vec<u8> =
            (0..n).flat_map(|q| input::<u8>(6, q, cnts[q], ReduceOp::Sum)).collect();
        for algo in [Algo::Ring, Algo::TwoLevel] {
            if no_two_level(c, algo) {
                continue;
            }
            let mut out = vec![0u8; want.len()];
            c.with_algo(algo)
                .allgatherv(&input(6, r, cnts[r], ReduceOp::Sum), &mut out, &cnts)
                .unwrap();
            assert_eq!(out, want, "{algo} allgatherv n={n} count={count}");
        }
    }
}

pub(crate) fn reduce_scatter_grid(c: &Comm) {
    let n = c.size();
    let r = c.rank();
    for &count in &counts(n) {
        let full = input::<f32>(7, r, count * n, ReduceOp::Sum);
        let want: Vec<f32> =
            (r * count..(r + 1) * count).map(|i| reduced(7, n, i, ReduceOp::Sum)).collect();
        for algo in algos(c, Coll::ReduceScatter) {
            if skip(Coll::ReduceScatter, algo, n, algo == Algo::RecursiveHalving)
                || no_two_level(c, algo)
            {
                continue;
            }
            let ca = c.with_algo(algo);
            let mut out = vec![0.0f32; count];
            ca.reduce_scatter(&full, &mut out, ReduceOp::Sum).unwrap();
            assert!(same_bits(&out, &want), "{algo} reduce_scatter n={n} count={count} rank={r}");
            let mut b = full.clone();
            ca.reduce_scatter_inplace(&mut b, ReduceOp::Sum).unwrap();
            assert!(
                same_bits(&b[r * count..(r + 1) * count], &want),
                "{algo} reduce_scatter in place n={n} count={count}"
            );
        }
    }
    for &count in &[0usize, 5, 999] {
        let cnts: Vec<usize> = (0..n).map(|q| (q * 5 + count) % (count + 3)).collect();
        let total: usize = cnts.iter().sum();
        let off: usize = cnts[..r].iter().sum();
        let full = input::<i32>(8, r, total, ReduceOp::Sum);
        let want: Vec<i32> =
            (off..off + cnts[r]).map(|i| reduced(8, n, i, ReduceOp::Sum)).collect();
        for algo in [Algo::Ring, Algo::TwoLevel] {
            if no_two_level(c, algo) {
                continue;
            }
            let mut out = vec![0i32; cnts[r]];
            c.with_algo(algo).reduce_scatter_v(&full, &mut out, &cnts, ReduceOp::Sum).unwrap();
            assert_eq!(out, want, "{algo} reduce_scatter_v n={n} counts={cnts:?}");
        }
    }
}

/// Element j of the block rank `src` sends to rank `dst`.
pub(crate) fn a2a_val(src: usize, dst: usize, j: usize) -> i32 {
    (src * 1000 + dst * 10 + j % 10) as i32
}

pub(crate) fn alltoall_grid(c: &Comm) {
    let n = c.size();
    let r = c.rank();
    for &count in &[0usize, 1, 3, 1000] {
        let inp: Vec<i32> =
            (0..n).flat_map(|d| (0..count).map(move |j| a2a_val(r, d, j))).collect();
        let want: Vec<i32> =
            (0..n).flat_map(|s| (0..count).map(move |j| a2a_val(s, r, j))).collect();
        for algo in algos(c, Coll::AllToAll) {
            let ca = c.with_algo(algo);
            let mut out = vec![0; n * count];
            ca.all_to_all(&inp, &mut out).unwrap();
            assert_eq!(out, want, "{algo} alltoall n={n} count={count}");
            let mut b = inp.clone();
            ca.all_to_all_inplace(&mut b).unwrap();
            assert_eq!(b, want, "{algo} alltoall in place n={n} count={count}");
        }
        // v: rank s sends (s + d) % 4 * count / 2 elements to d.
        let sz = |s: usize, d: usize| (s + d) % 4 * count / 2;
        let sc: Vec<usize> = (0..n).map(|d| sz(r, d)).collect();
        let rc: Vec<usize> = (0..n).map(|s| sz(s, r)).collect();
        let inp: Vec<i32> =
            (0..n).flat_map(|d| (0..sz(r, d)).map(move |j| a2a_val(r, d, j))).collect();
        let want: Vec<i32> =
            (0..n).flat_map(|s| (0..sz(s, r)).map(move |j| a2a_val(s, r, j))).collect();
        let mut out = vec![0; want.len()];
        c.all_to_all_v(&inp, &sc, &mut out, &rc).unwrap();
        assert_eq!(out, want, "alltoall_v n={n} count={count}");
    }
}

pub(crate) fn gather_scatter_grid(c: &Comm) {
    let n = c.size();
    let r = c.rank();
    for &count in &[0usize, 1, 1000] {
        for root in 0..n {
            let mine = input::<bf16>(9, r, count, ReduceOp::Sum);
            let all: Vec<bf16> =
                (0..n).flat_map(|q| input::<bf16>(9, q, count, ReduceOp::Sum)).collect();
            let mut out = if r == root { vec![bf16::ZERO; n * count] } else { Vec::new() };
            c.gather(&mine, &mut out, root).unwrap();
            if r == root {
                assert!(same_bits(&out, &all), "gather n={n} count={count} root={root}");
            }
            let src = if r == root { all.clone() } else { Vec::new() };
            let mut got = vec![bf16::ZERO; count];
            c.scatter(&src, &mut got, root).unwrap();
            assert!(same_bits(&got, &mine), "scatter n={n} count={count} root={root}");
        }
    }
    for _ in 0..3 {
        c.barrier().unwrap();
    }
}

pub(crate) fn dtype_op_case<T: Element>(c: &Comm, what: &str) {
    let n = c.size();
    let r = c.rank();
    for op in ReduceOp::ALL {
        for algo in allreduce_algos(c) {
            check_allreduce::<T>(&c.with_algo(algo), 13, 1000, op, false, what);
        }
        let count = 100;
        let full = input::<T>(14, r, count * n, op);
        let want: Vec<T> = (r * count..(r + 1) * count).map(|i| reduced(14, n, i, op)).collect();
        let mut out = vec![T::default(); count];
        c.with_algo(Algo::Ring).reduce_scatter(&full, &mut out, op).unwrap();
        assert!(same_bits(&out, &want), "{what} reduce_scatter op={op} n={n}");
    }
}

/// Every collective's grid on `c`.
pub(crate) fn every_grid(c: &Comm, what: &str) {
    allreduce_grid(c, what);
    broadcast_grid(c);
    reduce_grid(c);
    gather_scatter_grid(c);
    allgather_grid(c);
    reduce_scatter_grid(c);
    alltoall_grid(c);
}

/// [`dtype_op_case`] for every dtype.
pub(crate) fn every_dtype(c: &Comm, what: &str) {
    dtype_op_case::<f32>(c, &format!("f32 {what}"));
    dtype_op_case::<f64>(c, &format!("f64 {what}"));
    dtype_op_case::<f16>(c, &format!("f16 {what}"));
    dtype_op_case::<bf16>(c, &format!("bf16 {what}"));
    dtype_op_case::<i8>(c, &format!("i8 {what}"));
    dtype_op_case::<u8>(c, &format!("u8 {what}"));
    dtype_op_case::<i32>(c, &format!("i32 {what}"));
    dtype_op_case::<i64>(c, &format!("i64 {what}"));
}
