//! Direct reads (`Algo::Direct`): what goes wrong is named as it is for messages — a mismatch
//! names both calls, a missing rank is a timeout naming it, an abort wakes a waiting rank at
//! once — and a group whose ranks cannot map each other's memory falls back to messages (or
//! refuses a forced `direct` on every rank, without a hang). Over memory and over TCP with
//! shared memory; the exact results at every world, dtype and op are in `grid_mem.rs`.

use std::time::{Duration, Instant};

use tutti_collectives::{Algo, Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

/// Run `f` on every rank of an `n`-rank world of `kind` (group timeout `timeout`); each rank's
/// result and the slowest rank's time.
fn run<T: Send>(
    kind: Kind,
    n: usize,
    timeout: Duration,
    f: impl Fn(&Comm) -> T + Sync,
) -> (Vec<T>, Duration) {
    let gs = groups(kind, n).unwrap();
    let start = Instant::now();
    let out: Vec<(T, Duration)> = std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = gs
            .into_iter()
            .map(|g| {
                g.set_timeout(timeout);
                s.spawn(move || {
                    let c = Comm::new(g);
                    let r = f(&c);
                    (r, start.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let slowest = out.iter().map(|o| o.1).max().unwrap();
    (out.into_iter().map(|o| o.0).collect(), slowest)
}

fn errors(rs: Vec<tutti_collectives::Result<()>>) -> Vec<String> {
    rs.into_iter()
        .enumerate()
        .map(|(r, x)| x.expect_err(&format!("rank {r} must fail")).to_string())
        .collect()
}

macro_rules! both {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn mem() {
                ($body)(Kind::Mem)
            }
            #[test]
            fn shm() {
                ($body)(Kind::Shm)
            }
        }
    };
}

both!(the_automatic_choice_reads_directly_where_memory_is_shared, |kind| {
    let (algos, _) = run(kind, 3, Duration::from_secs(30), |c| {
        let mut x: Vec<f32> = (0..300_000).map(|i| (i % 1000) as f32 + c.rank() as f32).collect();
        let st = c.allreduce(&mut x, ReduceOp::Sum).unwrap();
        let bad = x.iter().enumerate().position(|(i, v)| *v != 3.0 * (i % 1000) as f32 + 3.0);
        assert_eq!(bad, None, "rank {}", c.rank());
        st.algo
    });
    assert!(algos.iter().all(|a| *a == Algo::Direct), "{algos:?}");
});

both!(a_count_mismatch_is_named, |kind| {
    let (errs, t) = run(kind, 4, Duration::from_secs(30), |c| {
        let c = c.with_algo(Algo::Direct);
        let n = if c.rank() == 2 { 100_001 } else { 100_000 };
        let mut x = vec![1.0f32; n];
        c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
    });
    let errs = errors(errs);
    assert!(
        errs.iter().any(|e| e.contains("count 100000") && e.contains("count 100001")),
        "{errs:?}"
    );
    assert!(t < Duration::from_secs(10), "{t:?}");
});

both!(an_op_mismatch_is_named, |kind| {
    let (errs, t) = run(kind, 3, Duration::from_secs(30), |c| {
        let c = c.with_algo(Algo::Direct);
        let mut x = vec![1i32; 90_000];
        if c.rank() == 1 {
            let mut all = vec![0i32; 270_000];
            c.allgather(&x, &mut all).map(|_| ())
        } else {
            c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
        }
    });
    let errs = errors(errs);
    assert!(
        errs.iter().any(|e| e.contains("op allreduce") && e.contains("op allgather")),
        "{errs:?}"
    );
    assert!(t < Duration::from_secs(10), "{t:?}");
});

/// A rank that never makes the second call of `count` elements (a buffer's worth, or a line
/// slot's): the others time out naming it.
fn missing_rank(kind: Kind, count: usize) {
    let (errs, t) = run(kind, 3, Duration::from_secs(2), |c| {
        let c = c.with_algo(Algo::Direct);
        let mut x = vec![1.0f64; count];
        c.allreduce(&mut x, ReduceOp::Sum)?;
        if c.rank() == 2 {
            // Alive, but never makes the second call.
            std::thread::sleep(Duration::from_secs(4));
            return Err(tutti_collectives::Error::Runtime(tutti_runtime::Error::Config(
                "skipped".into(),
            )));
        }
        c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
    });
    let errs = errors(errs);
    for e in &errs[..2] {
        assert!(e.contains("rank 2"), "{count}: {errs:?}");
    }
    assert!(errs.iter().any(|e| e.contains("timed out waiting for peer rank 2")), "{errs:?}");
    assert!(t < Duration::from_secs(8), "{count}: {t:?}");
}

both!(a_missing_rank_is_a_timeout_naming_it, |kind| missing_rank(kind, 50_000));
both!(a_rank_missing_from_a_small_call_is_a_timeout_naming_it, |kind| missing_rank(kind, 3));

/// An abort from one rank wakes the other, waiting in a call of `count` elements.
fn abort_wakes(kind: Kind, count: usize) {
    let (errs, _) = run(kind, 2, Duration::from_secs(60), |c| {
        let c = c.with_algo(Algo::Direct);
        let mut x = vec![1.0f32; count];
        c.allreduce(&mut x, ReduceOp::Sum)?;
        let t0 = Instant::now();
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
            c.group().abort("stopping the job");
            return Err(tutti_collectives::Error::Runtime(tutti_runtime::Error::Config(
                "aborted".into(),
            )));
        }
        let r = c.allreduce(&mut x, ReduceOp::Sum).map(|_| ());
        assert!(t0.elapsed() < Duration::from_secs(5), "woken after {:?}", t0.elapsed());
        r
    });
    let errs = errors(errs);
    assert!(errs[0].contains("stopping the job"), "{count}: {errs:?}");
}

both!(an_abort_wakes_a_waiting_rank, |kind| abort_wakes(kind, 100_000));
both!(an_abort_wakes_a_rank_waiting_in_a_small_call, |kind| abort_wakes(kind, 2));

#[test]
fn without_shared_memory_the_choice_falls_back_and_a_forced_direct_is_refused() {
    let (_, t) = run(Kind::Tcp, 3, Duration::from_secs(30), |c| {
        let mut x = vec![2.0f32; 300_000];
        let st = c.allreduce(&mut x, ReduceOp::Sum).unwrap();
        assert_ne!(st.algo, Algo::Direct);
        assert!(x.iter().all(|v| *v == 6.0));
    });
    assert!(t < Duration::from_secs(10), "{t:?}");
    // Forced (in a job of its own: a refusal aborts the group, which could overtake a peer
    // still in an earlier call). Every rank learns at the set-up that the group cannot read
    // directly: all refuse.
    let (rs, t) = run(Kind::Tcp, 3, Duration::from_secs(30), |c| {
        let mut x = vec![2.0f32; 300_000];
        c.with_algo(Algo::Direct).allreduce(&mut x, ReduceOp::Sum).map(|_| ())
    });
    for (r, e) in errors(rs).iter().enumerate() {
        assert!(e.contains("direct") && e.contains("share memory"), "rank {r}: {e}");
    }
    assert!(t < Duration::from_secs(10), "{t:?}");
}

#[test]
fn turned_off_the_automatic_choice_stays_on_messages() {
    let gs = groups(Kind::Mem, 2).unwrap();
    std::thread::scope(|s| {
        for g in gs {
            s.spawn(move || {
                let cfg = tutti_collectives::Config { direct: false, ..Default::default() };
                let c = Comm::with_config(g, cfg);
                let mut x = vec![1u8; 1 << 20];
                let st = c.broadcast(&mut x, 0).unwrap();
                assert_ne!(st.algo, Algo::Direct);
                // Forced, it still runs.
                let st = c.with_algo(Algo::Direct).broadcast(&mut x, 1).unwrap();
                assert_eq!(st.algo, Algo::Direct);
                let st = c.broadcast(&mut x, 0).unwrap();
                assert_ne!(st.algo, Algo::Direct);
            });
        }
    });
}

/// Element `i` of rank `r`'s part `k`: exact in i64, different everywhere.
fn val(r: usize, k: usize, i: usize) -> i64 {
    (r * 1_000_003 + k * 7_919 + i * 13) as i64
}

both!(calls_larger_than_a_buffer_run_in_generations_exactly, |kind| {
    // Blocks larger than a window's buffer (1 MiB), or than its n-th part: several
    // generations per call, both buffers by turns, in place and out of place.
    let (oks, _) = run(kind, 3, Duration::from_secs(60), |c| {
        let c = c.with_algo(Algo::Direct);
        let (r, n) = (c.rank(), c.size());
        let blk = 160_000; // 1.28 MB of i64 per block
                           // All-gather, out of place and in place.
        let mine: Vec<i64> = (0..blk).map(|i| val(r, 0, i)).collect();
        let want: Vec<i64> = (0..n).flat_map(|q| (0..blk).map(move |i| val(q, 0, i))).collect();
        let mut all = vec![0i64; n * blk];
        c.allgather(&mine, &mut all).unwrap();
        assert!(all == want, "rank {r}: allgather");
        let mut all: Vec<i64> =
            (0..n * blk).map(|j| if j / blk == r { val(r, 0, j % blk) } else { -1 }).collect();
        c.allgather_inplace(&mut all).unwrap();
        assert!(all == want, "rank {r}: allgather in place");
        // All-to-all: rank q's block for rank r is val(q, r, i).
        let input: Vec<i64> = (0..n).flat_map(|j| (0..blk).map(move |i| val(r, j, i))).collect();
        let want: Vec<i64> = (0..n).flat_map(|q| (0..blk).map(move |i| val(q, r, i))).collect();
        let mut out = vec![0i64; n * blk];
        c.all_to_all(&input, &mut out).unwrap();
        assert!(out == want, "rank {r}: all-to-all");
        let mut buf = input.clone();
        c.all_to_all_inplace(&mut buf).unwrap();
        assert!(buf == want, "rank {r}: all-to-all in place");
        // Reduce-scatter: block j summed over the ranks.
        let sum = |j: usize, i: usize| (0..n).map(|q| val(q, j, i)).sum::<i64>();
        let mut out = vec![0i64; blk];
        c.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
        assert!(out.iter().enumerate().all(|(i, v)| *v == sum(r, i)), "rank {r}: reduce-scatter");
        let mut buf = input.clone();
        c.reduce_scatter_inplace(&mut buf, ReduceOp::Sum).unwrap();
        let got = &buf[r * blk..(r + 1) * blk];
        assert!(got.iter().enumerate().all(|(i, v)| *v == sum(r, i)), "rank {r}: in place");
        // Broadcast from the last rank, and allreduce, of 3 buffers' worth.
        let len = 3 * blk;
        let mut b: Vec<i64> = (0..len).map(|i| if r == n - 1 { val(9, 9, i) } else { 0 }).collect();
        c.broadcast(&mut b, n - 1).unwrap();
        assert!(b.iter().enumerate().all(|(i, v)| *v == val(9, 9, i)), "rank {r}: broadcast");
        let mut x: Vec<i64> = (0..len).map(|i| val(r, 1, i)).collect();
        c.allreduce(&mut x, ReduceOp::Sum).unwrap();
        let s = |i: usize| (0..n).map(|q| val(q, 1, i)).sum::<i64>();
        assert!(x.iter().enumerate().all(|(i, v)| *v == s(i)), "rank {r}: allreduce");
        // A call of nothing, then a small one: the generations stay in step.
        c.allreduce(&mut Vec::<i64>::new(), ReduceOp::Sum).unwrap();
        let mut y = vec![r as i64; 5];
        c.allreduce(&mut y, ReduceOp::Max).unwrap();
        assert_eq!(y, vec![n as i64 - 1; 5]);
        true
    });
    assert!(oks.iter().all(|o| *o));
});

both!(a_root_mismatch_is_named_on_the_roots_too, |kind| {
    // Each rank believes itself the root: without a check on the root's side every call would
    // return, with wrong data.
    let (errs, t) = run(kind, 2, Duration::from_secs(30), |c| {
        let c = c.with_algo(Algo::Direct);
        let mut x = vec![c.rank() as u8; 1 << 16];
        c.broadcast(&mut x, c.rank()).map(|_| ())
    });
    let errs = errors(errs);
    assert!(errs.iter().any(|e| e.contains("root 0") && e.contains("root 1")), "{errs:?}");
    assert!(t < Duration::from_secs(10), "{t:?}");
});

both!(in_a_subgroup_errors_name_the_job_ranks, |kind| {
    let (rs, t) = run(kind, 3, Duration::from_secs(2), |c| {
        let Some(sub) = c.split(&[1, 2]).unwrap() else { return Ok(()) };
        let sub = sub.with_algo(Algo::Direct);
        let mut x = vec![1.0f32; 100_000];
        sub.allreduce(&mut x, ReduceOp::Sum).map_err(|e| e.to_string())?;
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_secs(4));
            return Ok(());
        }
        match sub.allreduce(&mut x, ReduceOp::Sum) {
            Ok(_) => Err("the call without its peer returned".to_string()),
            Err(e) => Err(e.to_string()),
        }
    });
    let e = rs[1].as_ref().expect_err("job rank 1 must time out");
    assert!(e.contains("rank 1: timed out waiting for peer rank 2"), "{e}");
    assert!(t < Duration::from_secs(8), "{t:?}");
});

/// A peer that sent a message this rank has not asked for yet, then computes past the dead-peer
/// limit before joining a direct call, is alive: its keep-alives queue behind that message, and
/// the direct wait reads them, as a waiting receive would.
#[test]
fn a_busy_peer_behind_an_unread_message_is_not_called_dead() {
    use std::sync::Arc;
    use tutti_runtime::transport::{mem::MemTransport, LinkConfig};
    let cfg = LinkConfig {
        dead_after: Duration::from_millis(800),
        keepalive_interval: Duration::from_millis(100),
        ..LinkConfig::default()
    };
    let (shm, _store) = tutti_runtime::testing::shm_world(2, &cfg).unwrap();
    let mems = MemTransport::world_with(2, &cfg);
    for world in [
        shm.into_iter()
            .map(|t| Arc::new(t) as Arc<dyn tutti_runtime::Transport>)
            .collect::<Vec<_>>(),
        mems.into_iter().map(|t| Arc::new(t) as Arc<dyn tutti_runtime::Transport>).collect(),
    ] {
        std::thread::scope(|s| {
            for t in world {
                s.spawn(move || {
                    let c = Comm::new(tutti_runtime::Group::new(t)).with_algo(Algo::Direct);
                    let mut x = vec![1.0f32; 1 << 18];
                    c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                    if c.rank() == 1 {
                        c.send(&[7u8; 100], 0, 5).unwrap();
                        std::thread::sleep(Duration::from_millis(2500));
                    }
                    c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                    assert!(x.iter().all(|v| *v == 4.0));
                    if c.rank() == 0 {
                        let mut m = [0u8; 100];
                        c.recv(&mut m, 1, 5).unwrap();
                        assert_eq!(m, [7u8; 100]);
                    }
                });
            }
        });
    }
}

both!(small_calls_run_on_the_line_slots_exactly, |kind| {
    // Every small collective the automatic choice gives to direct reads (the line slots), in
    // place and out of place, every root, between calls that use the buffers: the generations
    // of both kinds stay in step and every result is exact.
    let (oks, _) = run(kind, 3, Duration::from_secs(60), |c| {
        let (r, n) = (c.rank(), c.size());
        for round in 0..20 {
            if (round + r) % 3 == 0 {
                // Ranks out of step: a slot is reused only once every peer is done with it.
                std::thread::yield_now();
            }
            for blk in [1usize, 7, 80] {
                // Every call's data differs from the last ones' (a stale slot would show).
                let round = round * 100 + blk;
                let mine: Vec<i64> = (0..blk).map(|i| val(r, round, i)).collect();
                let want: Vec<i64> =
                    (0..n).flat_map(|q| (0..blk).map(move |i| val(q, round, i))).collect();
                let mut all = vec![0i64; n * blk];
                let st = c.allgather(&mine, &mut all).unwrap();
                assert_eq!(st.algo, Algo::Direct, "allgather of {blk}");
                assert!(all == want, "rank {r}: allgather of {blk}");
                let mut all: Vec<i64> =
                    (0..n * blk).map(|j| if j / blk == r { mine[j % blk] } else { -1 }).collect();
                c.allgather_inplace(&mut all).unwrap();
                assert!(all == want, "rank {r}: allgather in place of {blk}");
                let input: Vec<i64> =
                    (0..n).flat_map(|j| (0..blk).map(move |i| val(r, j + round, i))).collect();
                let a2a: Vec<i64> =
                    (0..n).flat_map(|q| (0..blk).map(move |i| val(q, r + round, i))).collect();
                let mut out = vec![0i64; n * blk];
                let st = c.all_to_all(&input, &mut out).unwrap();
                assert_eq!(st.algo, Algo::Direct, "all-to-all of {blk}");
                assert!(out == a2a, "rank {r}: all-to-all of {blk}");
                let mut buf = input.clone();
                c.all_to_all_inplace(&mut buf).unwrap();
                assert!(buf == a2a, "rank {r}: all-to-all in place of {blk}");
                let sum = |i: usize| (0..n).map(|q| val(q, r + round, i)).sum::<i64>();
                let mut out = vec![0i64; blk];
                let st = c.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
                assert_eq!(st.algo, Algo::Direct, "reduce-scatter of {blk}");
                assert!(out.iter().enumerate().all(|(i, v)| *v == sum(i)), "rank {r}: rs {blk}");
                let mut buf = input.clone();
                c.reduce_scatter_inplace(&mut buf, ReduceOp::Sum).unwrap();
                let got = &buf[r * blk..(r + 1) * blk];
                assert!(got.iter().enumerate().all(|(i, v)| *v == sum(i)), "rank {r}: rs in place");
                let mut x = mine.clone();
                let st = c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(st.algo, Algo::Direct, "allreduce of {blk}");
                let s = |i: usize| (0..n).map(|q| val(q, round, i)).sum::<i64>();
                assert!(x.iter().enumerate().all(|(i, v)| *v == s(i)), "rank {r}: allreduce");
                let mut y = vec![0i64; blk];
                c.allreduce_from(&mine, &mut y, ReduceOp::Max).unwrap();
                assert!(y.iter().enumerate().all(|(i, v)| *v == val(n - 1, round, i)), "max");
                // From each root (whose small broadcasts wait for nobody).
                for root in 0..n {
                    let w = |i: usize| val(root, round + 9, i);
                    let mut b: Vec<i64> =
                        (0..blk).map(|i| if r == root { w(i) } else { 0 }).collect();
                    let st = c.broadcast(&mut b, root).unwrap();
                    assert_eq!(st.algo, Algo::Direct);
                    assert!(b.iter().enumerate().all(|(i, v)| *v == w(i)), "bcast");
                }
            }
            // Calls that use the buffers between small ones: an allreduce, and a broadcast of
            // two buffers whose root runs ahead of the others (it waits for nobody after the
            // first generation).
            let mut big = vec![r as i64 + round as i64; 400_000];
            let st = c.allreduce(&mut big, ReduceOp::Sum).unwrap();
            assert_eq!(st.algo, Algo::Direct);
            assert!(big.iter().all(|v| *v == 3 + 3 * round as i64), "rank {r}: large allreduce");
            let root = round % n;
            let mut b: Vec<i64> =
                (0..200_000).map(|i| if r == root { val(round, 5, i) } else { 0 }).collect();
            c.with_algo(Algo::Direct).broadcast(&mut b, root).unwrap();
            assert!(b.iter().enumerate().all(|(i, v)| *v == val(round, 5, i)), "large broadcast");
        }
        true
    });
    assert!(oks.iter().all(|o| *o));
});

both!(a_small_count_mismatch_is_named, |kind| {
    let (errs, t) = run(kind, 3, Duration::from_secs(30), |c| {
        let n = if c.rank() == 1 { 11 } else { 10 };
        let mut x = vec![1.0f32; n];
        c.with_algo(Algo::Direct).allreduce(&mut x, ReduceOp::Sum).map(|_| ())
    });
    let errs = errors(errs);
    assert!(errs.iter().any(|e| e.contains("count 10") && e.contains("count 11")), "{errs:?}");
    assert!(t < Duration::from_secs(10), "{t:?}");
});

both!(a_small_call_against_a_large_one_is_named, |kind| {
    // One rank's call fits the line slots, the others' use the buffers: each side finds the
    // other's stamp where it does not wait, and names the mismatch, long before the timeout.
    let (errs, t) = run(kind, 3, Duration::from_secs(30), |c| {
        let n = if c.rank() == 0 { 4 } else { 100_000 };
        let mut x = vec![1.0f32; n];
        c.with_algo(Algo::Direct).allreduce(&mut x, ReduceOp::Sum).map(|_| ())
    });
    let errs = errors(errs);
    assert!(errs.iter().any(|e| e.contains("count 4") && e.contains("count 100000")), "{errs:?}");
    assert!(t < Duration::from_secs(10), "{t:?}");
});

both!(a_small_broadcast_root_mismatch_is_named_on_the_roots, |kind| {
    for len in [8, 64] {
        let (errs, t) = run(kind, 2, Duration::from_secs(30), |c| {
            let mut x = vec![c.rank() as u8; len];
            let c = c.with_algo(Algo::Direct);
            // A small broadcast's root waits for nobody: it checks the others' stamps at its
            // next direct call, which fails naming the broadcast.
            c.broadcast(&mut x, c.rank())?;
            c.allreduce(&mut x, ReduceOp::Max).map(|_| ())
        });
        // Each root reads the other's stamp (whichever names it first, the other may learn it
        // from its abort, which quotes it).
        let errs = errors(errs);
        let named = errs.iter().all(|e| e.contains("root 0") && e.contains("root 1"));
        assert!(named, "{len}: {errs:?}");
        assert!(t < Duration::from_secs(10), "{len}: {t:?}");
    }
});

type Agreed = fn(&Comm) -> tutti_collectives::Result<()>;

/// Two ranks make the calls `agreed` makes, then each believes itself the root of every small
/// broadcast of `len` bytes: each fails within 32 calls naming both roots, in time.
fn self_roots_are_named(kind: Kind, len: usize, agreed: Agreed) {
    let (rs, t) = run(kind, 2, Duration::from_secs(30), |c| {
        let c = c.with_algo(Algo::Direct);
        if let Err(e) = agreed(&c) {
            return (0, e.to_string());
        }
        for made in 0..200 {
            let mut x = vec![c.rank() as u8; len];
            if let Err(e) = c.broadcast(&mut x, c.rank()) {
                return (made, e.to_string());
            }
        }
        (200, String::new())
    });
    for (made, e) in &rs {
        assert!(e.contains("root 0") && e.contains("root 1"), "{len}: {e}");
        assert!(*made <= 32, "{len}: {made} calls returned before the mismatch was named");
    }
    assert!(t < Duration::from_secs(10), "{len}: {t:?}");
}

both!(roots_that_only_broadcast_are_named_by_a_line_slot_reuse, |kind| {
    // Two ranks each believe themselves the root of every small broadcast and make no other
    // call: each runs ahead, and checks the other's stamps when it needs that line slot again
    // (32 calls on with 2 ranks), not later. On the cells (8 bytes) and the line slots.
    for len in [8, 64] {
        self_roots_are_named(kind, len, |_| Ok(()));
    }
});

both!(roots_that_disagree_after_agreeing_are_named, |kind| {
    // As above, after calls both ranks agreed on (6 broadcasts from rank 0, or a small
    // allreduce): a root at the edge that waits for its reader to get further first checks its
    // broadcasts when the reader's *done* does not come, so neither root waits out its timeout
    // for the other's *done*, which each holds below its own unchecked broadcasts.
    let agreed: [Agreed; 2] = [
        |c| {
            for _ in 0..6 {
                c.broadcast(&mut [c.rank() as u8; 8], 0)?;
            }
            Ok(())
        },
        |c| c.allreduce(&mut [1f32], ReduceOp::Sum).map(|_| ()),
    ];
    for len in [8, 64] {
        for first in agreed {
            self_roots_are_named(kind, len, first);
        }
    }
});

both!(two_roots_with_a_reader_that_agrees_with_one_are_named_everywhere, |kind| {
    // Rank 0 believes itself the root; ranks 1 and 2 believe rank 1 is. Rank 2 finishes each
    // call (rank 1's stamp agrees with its own), so its *done* passes rank 0's broadcasts.
    // Checked: every rank fails, naming both roots, in time (which root finds it first is
    // not: the other may learn it from the abort, which quotes it).
    for len in [8, 16] {
        let (rs, t) = run(kind, 3, Duration::from_secs(30), |c| {
            let root = if c.rank() == 0 { 0 } else { 1 };
            for _ in 0..200 {
                let mut x = vec![c.rank() as u8; len];
                c.with_algo(Algo::Direct).broadcast(&mut x, root)?;
            }
            Ok(())
        });
        let errs = errors(rs);
        let named = errs.iter().all(|e| e.contains("root 0") && e.contains("root 1"));
        assert!(named, "{len}: {errs:?}");
        assert!(t < Duration::from_secs(10), "{len}: {t:?}");
    }
});

both!(a_small_broadcast_root_runs_ahead_of_slow_readers_exactly, |kind| {
    // The root of small broadcasts waits for nobody: it runs up to a line slot's reuse ahead
    // of its slowest reader, which here falls behind now and then. Every reader gets every
    // call's own data, in order; a change of root and the calls after catch up. One element
    // (8 bytes: the cells) and three (the line slots).
    let (oks, _) = run(kind, 4, Duration::from_secs(60), |c| {
        let r = c.rank();
        let calls = (0..300).map(|k| (k, if k < 200 { 0 } else { 1 + k % 3 }));
        for (blk, (k, root)) in
            [1usize, 3].into_iter().flat_map(|b| calls.clone().map(move |x| (b, x)))
        {
            if r == 3 && k % 50 == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            if r == 0 && k % 50 == 32 {
                // Rank 3 fell behind at call k − 32, which the root has not checked: while the
                // root sleeps here, rank 3 catches up, and must not write its slot of call
                // k − 32 again (call k) before the root checked it.
                std::thread::sleep(Duration::from_millis(50));
            }
            let w = |i: usize| val(root, k, i);
            let mut b: Vec<i64> = (0..blk).map(|i| if r == root { w(i) } else { 0 }).collect();
            let st = c.broadcast(&mut b, root).unwrap();
            assert_eq!(st.algo, Algo::Direct);
            assert!(b.iter().enumerate().all(|(i, v)| *v == w(i)), "rank {r}: {blk}, call {k}");
        }
        let mut x = [r as i64];
        c.allreduce(&mut x, ReduceOp::Sum).unwrap();
        x[0] == 6
    });
    assert!(oks.iter().all(|o| *o));
});

both!(a_small_broadcast_root_runs_ahead_as_far_as_the_turns_allow, |kind| {
    // Rank 1 stops calling for 1.5 s: the root of small broadcasts makes at most as many
    // calls past rank 1's last as the turns allow before it waits: T − 4 on the cells (8 bytes;
    // a line of cells short of the turns, T = 32), T − 5 calls ahead of the one rank 1 makes
    // next, and T on the line slots (16 bytes), T − 1 ahead. One call more would write a slot
    // rank 1 has not read. The root may stop a call or two short: its record of rank 1's
    // *done* can be older than rank 1's window, and at the edge it waits for a quarter of the
    // turns more instead of reading the window again. Then every call's data arrives.
    for (len, most) in [(1usize, 28usize), (2, 32)] {
        let woke = std::sync::atomic::AtomicBool::new(false);
        let (counts, _) = run(kind, 2, Duration::from_secs(30), |plain| {
            let c = plain.with_algo(Algo::Direct);
            // Past the first lap of the turns, whose slots are all free; then a call on
            // messages, before which the root checks every broadcast: both start even.
            for _ in 0..70 {
                let mut b = vec![0i64; len];
                c.broadcast(&mut b, 0).unwrap();
            }
            plain.barrier().unwrap();
            // Long enough for the root's few dozen calls of a few µs on a loaded machine.
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                woke.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            let mut before = 0;
            for k in 0..40 {
                let w = |i: usize| val(0, k, i);
                let mut b: Vec<i64> =
                    (0..len).map(|i| if c.rank() == 0 { w(i) } else { 0 }).collect();
                c.broadcast(&mut b, 0).unwrap();
                assert!(b.iter().enumerate().all(|(i, v)| *v == w(i)), "{len}: call {k}");
                if !woke.load(std::sync::atomic::Ordering::SeqCst) {
                    before += 1;
                }
            }
            before
        });
        let made = counts[0];
        let ok = made <= most && made + 2 >= most;
        assert!(ok, "{len} elements: {made} calls while rank 1 slept, {most} at most");
    }
});

both!(a_root_that_ran_ahead_and_stopped_leaves_no_reader_waiting, |kind| {
    // The root's calls are all broadcasts of its own, and after the last it makes no call: a
    // reader that fell behind still finishes, since each call of the root checked the stamps
    // up to a line slot's reuse (32 calls) back. Rank 2 is 32 calls behind (28 on the cells)
    // when the root makes its last call, and posts its stamp of that call only while the root waits for it to be
    // done with it (after the root looked for the stamp without waiting).
    for blk in [1, 2] {
        let (oks, t) = run(kind, 3, Duration::from_secs(10), |c| {
            let r = c.rank();
            for k in 0..80 {
                if r == 2 && k == 80 - 33 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let mut b: Vec<i64> =
                    (0..blk).map(|i| if r == 0 { val(0, k, i) } else { 0 }).collect();
                c.broadcast(&mut b, 0).unwrap();
                let exact = b.iter().enumerate().all(|(i, v)| *v == val(0, k, i));
                assert!(exact, "rank {r}: {blk}, call {k}");
            }
            true
        });
        assert!(oks.iter().all(|o| *o));
        assert!(t < Duration::from_secs(5), "{blk}: {t:?}");
    }
});

both!(a_small_broadcast_root_mismatch_is_named_before_a_message_call, |kind| {
    // Two ranks each believe themselves the root; the next call runs on messages (a barrier),
    // and each rank checks its broadcast's stamps first.
    let (errs, t) = run(kind, 2, Duration::from_secs(30), |c| {
        let mut x = vec![c.rank() as u8; 64];
        c.broadcast(&mut x, c.rank())?;
        c.barrier().map(|_| ())
    });
    let errs = errors(errs);
    assert!(errs.iter().all(|e| e.contains("root 0") && e.contains("root 1")), "{errs:?}");
    assert!(t < Duration::from_secs(10), "{t:?}");
});

both!(a_reader_that_believes_another_root_is_named_on_every_rank, |kind| {
    // Rank 2 takes rank 1 for the root: it finds rank 1's stamp (a reader's, naming root 0)
    // and names the mismatch; the others learn it at their next call, the root from the stamp
    // it checks there or from the abort.
    for len in [8, 16] {
        let (errs, t) = run(kind, 3, Duration::from_secs(30), |c| {
            let mut x = vec![7u8; len];
            c.broadcast(&mut x, if c.rank() == 2 { 1 } else { 0 })?;
            c.allreduce(&mut x, ReduceOp::Max).map(|_| ())
        });
        let errs = errors(errs);
        let named = errs.iter().all(|e| e.contains("root 0") && e.contains("root 1"));
        assert!(named, "{len}: {errs:?}");
        assert!(t < Duration::from_secs(10), "{len}: {t:?}");
    }
});
