//! Every collective, every algorithm, every world size of the grid, every root, exact data:
//! in memory, and over shared memory between ranks of one host (fewer worlds: the same state
//! machine, another driver).

mod common;

use common::*;
use half::{bf16, f16};
use tutti_collectives::{Algo, Coll, Comm, Element, ReduceOp};

/// Whether `algo` cannot run `coll` on `n` ranks: only a power-of-two algorithm may be refused,
/// only on a world that is not a power of two. (A refused call poisons the group, so the grid
/// skips it; `mismatch.rs` checks the refusal itself.)
fn skip(coll: Coll, algo: Algo, n: usize, pof2_only: bool) -> bool {
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
fn no_two_level(c: &Comm, algo: Algo) -> bool {
    algo == Algo::TwoLevel && c.topology().unwrap().two_level().is_none()
}

fn check_allreduce<T: Element>(
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
fn check_scaled(c: &Comm, seed: u64, count: usize, in_place: bool, what: &str) {
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

fn allreduce_grid(c: &Comm, seg_note: &str) {
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

fn broadcast_grid(c: &Comm) {
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

fn reduce_grid(c: &Comm) {
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

fn allgather_grid(c: &Comm) {
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

fn reduce_scatter_grid(c: &Comm) {
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
fn a2a_val(src: usize, dst: usize, j: usize) -> i32 {
    (src * 1000 + dst * 10 + j % 10) as i32
}

fn alltoall_grid(c: &Comm) {
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

fn gather_scatter_grid(c: &Comm) {
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

#[test]
fn allreduce_every_world_and_algorithm() {
    for n in WORLDS {
        world(n, 512 << 10, |c| allreduce_grid(&c, "default segment"));
    }
}

#[test]
fn every_host_placement() {
    // The ring and the chain follow hosts, two-level runs where it applies; with the default
    // segment and with 64-byte ones (many segments per block in every phase).
    for (hosts, what) in PLACEMENTS {
        for seg in [512 << 10, 64] {
            world(hosts.len(), seg, |c| {
                let c = c.with_hosts(hosts).unwrap();
                assert_eq!(c.topology().unwrap().hosts(), hosts.iter().max().unwrap() + 1);
                allreduce_grid(&c, what);
                broadcast_grid(&c);
                allgather_grid(&c);
                reduce_scatter_grid(&c);
            });
        }
    }
}

#[test]
fn pipelined_with_tiny_segments() {
    // 64-byte segments: hundreds of pipeline segments per block.
    for n in [2, 3, 5, 8, 13] {
        world(n, 64, |c| {
            for algo in [Algo::Ring, Algo::Tree] {
                for count in [1000usize, 10007] {
                    check_allreduce::<f32>(
                        &c.with_algo(algo),
                        11,
                        count,
                        ReduceOp::Sum,
                        false,
                        "tiny seg",
                    );
                }
            }
            broadcast_grid(&c);
            let n = c.size();
            let r = c.rank();
            let full = input::<f32>(12, r, 1000 * n, ReduceOp::Sum);
            let want: Vec<f32> =
                (r * 1000..(r + 1) * 1000).map(|i| reduced(12, n, i, ReduceOp::Sum)).collect();
            let mut out = vec![0.0f32; 1000];
            c.with_algo(Algo::Ring).reduce_scatter(&full, &mut out, ReduceOp::Sum).unwrap();
            assert!(same_bits(&out, &want));
        });
    }
}

#[test]
fn rooted_and_gathering_collectives_every_world() {
    for n in WORLDS {
        world(n, 512 << 10, |c| {
            broadcast_grid(&c);
            reduce_grid(&c);
            gather_scatter_grid(&c);
        });
    }
}

#[test]
fn allgather_reduce_scatter_alltoall_every_world() {
    for n in WORLDS {
        world(n, 512 << 10, |c| {
            allgather_grid(&c);
            reduce_scatter_grid(&c);
            alltoall_grid(&c);
        });
    }
}

fn dtype_op_case<T: Element>(c: &Comm, what: &str) {
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

#[test]
fn every_dtype_and_op() {
    for n in [1, 2, 3, 4, 7, 8] {
        world(n, 256, |c| {
            dtype_op_case::<f32>(&c, "f32");
            dtype_op_case::<f64>(&c, "f64");
            dtype_op_case::<f16>(&c, "f16");
            dtype_op_case::<bf16>(&c, "bf16");
            dtype_op_case::<i8>(&c, "i8");
            dtype_op_case::<u8>(&c, "u8");
            dtype_op_case::<i32>(&c, "i32");
            dtype_op_case::<i64>(&c, "i64");
        });
    }
}

#[test]
fn tensor_all_to_all_is_ulysses_and_inverts() {
    // [b, s/N, h, d] -> [b, s, h/N, d] and back, checked against index arithmetic.
    for n in [1, 2, 3, 4] {
        world(n, 512 << 10, |c| {
            let (b, s, h, d) = (2, 6 * n, 3 * n, 5);
            let r = c.rank();
            let sl = s / n;
            let idx =
                |bi: usize, si: usize, hi: usize, di: usize| ((bi * s + si) * h + hi) * d + di;
            // Local shard: sequence rows r*sl..(r+1)*sl, all heads.
            let mut shard = Vec::new();
            for bi in 0..b {
                for si in r * sl..(r + 1) * sl {
                    for hi in 0..h {
                        for di in 0..d {
                            shard.push(idx(bi, si, hi, di) as i32);
                        }
                    }
                }
            }
            let mut heads = vec![0i32; shard.len()];
            c.all_to_all_tensor(&shard, &[b, sl, h, d], 2, 1, &mut heads).unwrap();
            let hl = h / n;
            let mut k = 0;
            for bi in 0..b {
                for si in 0..s {
                    for hi in r * hl..(r + 1) * hl {
                        for di in 0..d {
                            assert_eq!(heads[k], idx(bi, si, hi, di) as i32);
                            k += 1;
                        }
                    }
                }
            }
            let mut back = vec![0i32; shard.len()];
            c.all_to_all_tensor(&heads, &[b, s, hl, d], 1, 2, &mut back).unwrap();
            assert_eq!(back, shard);
            if n > 1 {
                let e =
                    c.all_to_all_tensor(&shard, &[b, sl, h + 1, d], 2, 1, &mut heads).unwrap_err();
                assert!(e.to_string().contains("not divisible"), "{e}");
            }
        });
    }
}

#[test]
fn random_link_delays_do_not_change_results() {
    // Every message is delayed by a pseudo-random 0-300 µs per (src, dst, len): orderings change,
    // results must not.
    use std::sync::Arc;
    use std::time::Duration;
    use tutti_runtime::transport::mem::MemTransport;
    for n in [2, 3, 5, 8] {
        let delay = Arc::new(|s: usize, d: usize, len: usize| {
            Duration::from_micros(((s * 7919 + d * 104_729 + len * 31) % 300) as u64)
        });
        let ts = MemTransport::world_with_delay(n, delay);
        std::thread::scope(|sc| {
            for t in ts {
                sc.spawn(move || {
                    let c = Comm::new(tutti_runtime::Group::new(Arc::new(t)));
                    for algo in allreduce_algos(&c) {
                        check_allreduce::<f32>(
                            &c.with_algo(algo),
                            31,
                            5000,
                            ReduceOp::Sum,
                            false,
                            "delayed",
                        );
                    }
                    broadcast_grid(&c);
                    alltoall_grid(&c);
                });
            }
        });
    }
}

/// Every collective's grid on `c`.
fn every_grid(c: &Comm, what: &str) {
    allreduce_grid(c, what);
    broadcast_grid(c);
    reduce_grid(c);
    gather_scatter_grid(c);
    allgather_grid(c);
    reduce_scatter_grid(c);
    alltoall_grid(c);
}

#[test]
fn every_collective_and_algorithm_over_shared_memory() {
    for n in [1, 2, 3, 4, 5, 8] {
        shm_world(n, 512 << 10, |c| every_grid(&c, "shared memory"));
    }
    for n in [2, 3] {
        shm_world(n, 256, |c| {
            dtype_op_case::<f32>(&c, "f32 over shared memory");
            dtype_op_case::<bf16>(&c, "bf16 over shared memory");
            dtype_op_case::<i64>(&c, "i64 over shared memory");
            dtype_op_case::<u8>(&c, "u8 over shared memory");
        });
    }
}

#[test]
fn every_collective_and_algorithm_in_a_quic_job_across_hosts() {
    // Ranks 0, 1 say one host, 2, 3 another, 4 a third: the pairs of one host link through
    // shared memory, the rest through QUIC, under one transport. The ranks also say where they
    // run, so the topology (two-level schedules, host-ordered rings) sees the same hosts.
    for n in [3, 4, 5] {
        let hosts: Vec<usize> = (0..n).map(|r| r / 2).collect();
        let groups = tutti_runtime::testing::groups(tutti_runtime::testing::Kind::QuicShm, n)
            .expect("a QUIC job of threads");
        on_groups(groups, 512 << 10, |c| {
            let c = c.with_hosts(&hosts).unwrap();
            every_grid(&c, "quic job across hosts");
            let t = c.group().transport();
            for p in (0..n).filter(|p| *p != c.rank()) {
                let want = if p / 2 == c.rank() / 2 { "shm" } else { "quic" };
                assert_eq!(t.link_kind(p), want, "rank {}'s link to {p}", c.rank());
            }
        });
    }
}
