//! Ranks that disagree about a collective: every rank gets a catchable error naming both
//! descriptors, quickly — never a hang, never wrong data. Over memory, TCP and QUIC; a poisoned
//! group keeps refusing while the same ranks rebuild a working one.

use std::time::{Duration, Instant};

use tutti_collectives::{Algo, Comm, Config, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

/// Run `f` on every rank of a 4-rank world; return each rank's error text and the slowest time.
fn run(
    kind: Kind,
    f: impl Fn(&Comm) -> tutti_collectives::Result<()> + Sync,
) -> (Vec<String>, Duration) {
    run_cfg(kind, |_| Config::default(), f)
}

/// As [`run`], each rank with the settings `cfg` gives it.
fn run_cfg(
    kind: Kind,
    cfg: impl Fn(usize) -> Config + Sync,
    f: impl Fn(&Comm) -> tutti_collectives::Result<()> + Sync,
) -> (Vec<String>, Duration) {
    let gs = groups(kind, 4).unwrap();
    let start = Instant::now();
    let out: Vec<(String, Duration)> = std::thread::scope(|s| {
        let (f, cfg) = (&f, &cfg);
        let hs: Vec<_> = gs
            .into_iter()
            .map(|g| {
                g.set_timeout(Duration::from_secs(30));
                s.spawn(move || {
                    let c = Comm::with_config(g.clone(), cfg(g.rank()));
                    let r = f(&c);
                    let t = start.elapsed();
                    (r.expect_err("a mismatched collective must fail on every rank").to_string(), t)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let slowest = out.iter().map(|o| o.1).max().unwrap();
    (out.into_iter().map(|o| o.0).collect(), slowest)
}

fn assert_all(errs: &[String], slowest: Duration, needles: &[&str]) {
    for (r, e) in errs.iter().enumerate() {
        for n in needles {
            assert!(e.contains(n), "rank {r}: error lacks {n:?}: {e}");
        }
    }
    assert!(slowest < Duration::from_secs(10), "took {slowest:?}: {errs:?}");
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
            fn tcp() {
                ($body)(Kind::Tcp)
            }
            #[test]
            fn shm() {
                ($body)(Kind::Shm)
            }
            #[test]
            fn quic() {
                ($body)(Kind::Quic)
            }
            #[test]
            fn quic_shm() {
                ($body)(Kind::QuicShm)
            }
        }
    };
}

both!(count_mismatch, |kind| {
    let (errs, t) = run(kind, |c| {
        let n = if c.rank() == 2 { 4011 } else { 4010 };
        let mut x = vec![1.0f32; n];
        c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
    });
    assert_all(&errs, t, &["count 4010", "count 4011", "mismatch"]);
});

both!(op_mismatch, |kind| {
    let (errs, t) = run(kind, |c| {
        let mut x = vec![1.0f32; 1000];
        if c.rank() == 1 {
            c.broadcast(&mut x, 0).map(|_| ())
        } else {
            c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
        }
    });
    assert_all(&errs, t, &["op allreduce", "op broadcast"]);
});

both!(dtype_mismatch, |kind| {
    let (errs, t) = run(kind, |c| {
        if c.rank() == 3 {
            let mut x = vec![1i32; 1000];
            c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
        } else {
            let mut x = vec![1.0f32; 1000];
            c.allreduce(&mut x, ReduceOp::Sum).map(|_| ())
        }
    });
    assert_all(&errs, t, &["dtype float", "dtype int32"]);
});

both!(root_mismatch, |kind| {
    let (errs, t) = run(kind, |c| {
        let mut x = vec![1u8; 100];
        let root = if c.rank() == 0 { 1 } else { 0 };
        c.broadcast(&mut x, root).map(|_| ())
    });
    assert_all(&errs, t, &["root 0", "root 1"]);
});

both!(small_broadcasts_that_differ_are_named, |kind| {
    // The smallest broadcasts (8 bytes and less) go on their own cells where ranks read each
    // other's memory; 16 bytes go on the line slots and 400 KB in the buffers. Rank 2, or the
    // root, differs in count (on the cells or not) or in root. The root returns before its
    // readers read, so it learns at its next call.
    // (the rank that differs, its count, everyone else's)
    for (odd, theirs, ours) in [(2, 16, 8), (0, 16, 8), (0, 400_000, 8), (2, 4, 8)] {
        let (errs, t) = run(kind, |c| {
            let mut x = vec![1u8; if c.rank() == odd { theirs } else { ours }];
            c.broadcast(&mut x, 0)?;
            c.barrier().map(|_| ())
        });
        assert_all(&errs, t, &[&format!("count {ours}"), &format!("count {theirs}")]);
    }
    let (errs, t) = run(kind, |c| {
        let mut x = [1u8; 8];
        c.broadcast(&mut x, if c.rank() == 2 { 1 } else { 0 })?;
        c.barrier().map(|_| ())
    });
    assert_all(&errs, t, &["mismatch", "root 1"]);
});

both!(skipped_call, |kind| {
    // Rank 3 skips the first allreduce and goes straight to an allgather.
    let (errs, t) = run(kind, |c| {
        let mut x = vec![1.0f32; 64];
        if c.rank() != 3 {
            c.allreduce(&mut x, ReduceOp::Sum)?;
        }
        let mut out = vec![0.0f32; 64 * 4];
        c.allgather(&x, &mut out).map(|_| ())
    });
    assert_all(&errs, t, &["op allreduce", "op allgather"]);
});

type Call = fn(&Comm) -> tutti_collectives::Result<()>;

both!(a_local_refusal_fails_every_rank_at_once, |kind| {
    // Rank 1 refuses the call before sending anything (a bad argument, a forced algorithm that
    // does not implement the collective) and tells its peers: they fail at once naming it and
    // the cause, instead of waiting out their 30 s timeout in a call rank 1 never makes.
    let cases: [(&str, Call); 3] = [
        ("root 7 is outside", |c| {
            let root = if c.rank() == 1 { 7 } else { 0 };
            c.broadcast(&mut [0u8; 4], root).map(|_| ())
        }),
        ("expected 4 x 4", |c| {
            let mut out = vec![0u8; if c.rank() == 1 { 15 } else { 16 }];
            c.allgather(&[0u8; 4], &mut out).map(|_| ())
        }),
        ("bruck does not implement allreduce", |c| {
            let c = if c.rank() == 1 { c.with_algo(Algo::Bruck) } else { c.clone() };
            c.allreduce(&mut [0f32; 4], ReduceOp::Sum).map(|_| ())
        }),
    ];
    for (needle, f) in cases {
        // A rank that does not need rank 1 in this call may finish it; its next call fails.
        let (errs, t) = run(kind, |c| f(c).and_then(|_| c.barrier().map(|_| ())));
        assert!(t < Duration::from_secs(5), "{needle}: took {t:?}: {errs:?}");
        for (r, e) in errs.iter().enumerate() {
            assert!(e.contains(needle), "rank {r}: {e}");
            if r != 1 {
                assert!(e.contains("rank 1 refused"), "rank {r} does not name the culprit: {e}");
            }
        }
    }
});

both!(diverging_settings_are_a_named_mismatch, |kind| {
    // `TUTTI_ALGO` differs on rank 2: it forces the ring where the others force the tree.
    let (errs, t) = run(kind, |c| {
        let a = if c.rank() == 2 { Algo::Ring } else { Algo::Tree };
        c.with_algo(a).allreduce(&mut vec![1.0f32; 1000], ReduceOp::Sum).map(|_| ())
    });
    assert_all(&errs, t, &["settings", "mismatch"]);
    // `TUTTI_SEGMENT_BYTES` differs on rank 0.
    let seg = |r: usize| Config {
        segment: if r == 0 { 64 << 10 } else { 512 << 10 },
        ..Config::default()
    };
    let (errs, t) = run_cfg(kind, seg, |c| {
        c.with_algo(Algo::Ring).allreduce(&mut vec![1.0f32; 1 << 20], ReduceOp::Sum).map(|_| ())
    });
    assert_all(&errs, t, &["settings", "mismatch"]);
    // `TUTTI_CHUNK_BYTES` differs on rank 1: it cuts the allreduce into pieces, the others
    // do not. The piece size is in the settings digest, so the mismatch names the settings (and
    // the variable), not only the counts.
    let chunk = |r: usize| Config {
        segment: 16 << 10,
        chunk: if r == 1 { 256 << 10 } else { 0 },
        ..Config::default()
    };
    let (errs, t) = run_cfg(kind, chunk, |c| {
        c.allreduce(&mut vec![1.0f32; 1 << 20], ReduceOp::Sum).map(|_| ())
    });
    assert_all(&errs, t, &["settings", "mismatch", "TUTTI_CHUNK_BYTES"]);
});

both!(poisoned_group_fails_fast_and_a_rebuilt_group_works, |kind| {
    // 1. A mismatch poisons the group on every rank.
    let comms: Vec<Comm> = groups(kind, 4)
        .unwrap()
        .into_iter()
        .map(|g| {
            g.set_timeout(Duration::from_secs(30));
            Comm::new(g)
        })
        .collect();
    let first: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let n = if c.rank() == 0 { 9 } else { 8 };
                    let mut x = vec![1.0f32; n];
                    c.allreduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, e) in first.iter().enumerate() {
        assert!(e.contains("count 9") && e.contains("count 8"), "rank {r}: {e}");
    }
    // 2. The same ranks rebuild: a new group over a new transport of the same kind, while the
    // old one is still held. The new group computes exact results; the old one keeps refusing
    // at once; dropping it afterwards does not hang.
    let fresh = groups(kind, 4).unwrap();
    std::thread::scope(|s| {
        for (old, g) in comms.into_iter().zip(fresh) {
            s.spawn(move || {
                let r = old.rank();
                let start = Instant::now();
                let mut x = vec![1i64; 100];
                let e = old.allreduce(&mut x, ReduceOp::Sum).unwrap_err().to_string();
                assert!(e.contains("poisoned") || e.contains("aborted"), "rank {r}: {e}");
                assert!(start.elapsed() < Duration::from_secs(2), "rank {r}: refusal was slow");
                let new = Comm::new(g);
                let mut y = vec![r as i64 + 1; 1000];
                new.allreduce(&mut y, ReduceOp::Sum).unwrap();
                assert!(y.iter().all(|v| *v == 10), "rank {r}: {:?}", &y[..3]);
                let e = old.barrier().unwrap_err().to_string();
                assert!(e.contains("poisoned") || e.contains("aborted"), "rank {r}: {e}");
                let start = Instant::now();
                drop(old);
                assert!(start.elapsed() < Duration::from_secs(10), "rank {r}: drop hung");
                let mut b = vec![0u8; 10];
                if r == 0 {
                    b = (0..10).collect();
                }
                new.broadcast(&mut b, 0).unwrap();
                assert_eq!(b, (0..10).collect::<Vec<u8>>());
            });
        }
    });
});
