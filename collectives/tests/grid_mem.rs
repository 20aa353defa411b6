//! Every collective, every algorithm, every world size of the grid, every root, exact data:
//! in memory, and over shared memory between ranks of one host (fewer worlds: the same state
//! machine, another driver).

use crate::common::grid::*;
use crate::common::*;
use tutti_collectives::{Algo, Comm, ReduceOp};

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

#[test]
fn every_dtype_and_op() {
    for n in [1, 2, 3, 4, 7, 8] {
        world(n, 256, |c| every_dtype(&c, "in memory"));
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

#[test]
fn every_collective_and_algorithm_over_shared_memory() {
    for n in 1..=8 {
        shm_world(n, 512 << 10, |c| every_grid(&c, "shared memory"));
    }
    for n in [2, 3, 4, 8] {
        shm_world(n, 256, |c| every_dtype(&c, "over shared memory"));
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
