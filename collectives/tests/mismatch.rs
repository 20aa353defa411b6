//! Ranks that disagree about a collective: every rank gets a catchable error naming both
//! descriptors, quickly — never a hang, never wrong data. Over memory and TCP.

use std::time::{Duration, Instant};

use tutti_collectives::{Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

/// Run `f` on every rank of a 4-rank world; return each rank's error text and the slowest time.
fn run(
    kind: Kind,
    f: impl Fn(&Comm) -> tutti_collectives::Result<()> + Sync,
) -> (Vec<String>, Duration) {
    let gs = groups(kind, 4).unwrap();
    let start = Instant::now();
    let out: Vec<(String, Duration)> = std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = gs
            .into_iter()
            .map(|g| {
                g.set_timeout(Duration::from_secs(30));
                s.spawn(move || {
                    let c = Comm::new(g);
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
            fn quic() {
                ($body)(Kind::Quic)
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

#[test]
fn bad_arguments_are_refused_before_sending() {
    let comms = Comm::mem_world(2);
    let c = &comms[0];
    let e = c.broadcast(&mut [0u8; 4], 2).unwrap_err().to_string();
    assert!(e.contains("root 2 is outside"), "{e}");
    let e = c.allgather(&[0u8; 4], &mut [0u8; 7]).unwrap_err().to_string();
    assert!(e.contains("expected 4 x 2"), "{e}");
    let e = c.reduce_scatter(&[0f32; 5], &mut [0f32; 2], ReduceOp::Sum).unwrap_err().to_string();
    assert!(e.contains("input has 5"), "{e}");
    let e = c.allreduce_from(&[0f32; 5], &mut [0f32; 4], ReduceOp::Sum).unwrap_err().to_string();
    assert!(e.contains("input has 5"), "{e}");
    let e = c.allgatherv(&[0u8; 1], &mut [0u8; 3], &[1, 1]).unwrap_err().to_string();
    assert!(e.contains("counts sum to 2"), "{e}");
    let e = c
        .with_algo(tutti_collectives::Algo::Bruck)
        .allreduce(&mut [0f32; 4], ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("bruck"), "{e}");
    // Nothing was sent: the group still works.
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let mut x = [c.rank() as f32; 3];
                c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, [1.0; 3]);
            });
        }
    });
}

#[test]
fn poisoned_group_fails_fast_and_a_new_group_works() {
    let (errs, _) = run(Kind::Mem, |c| {
        let n = if c.rank() == 0 { 9 } else { 8 };
        let mut x = vec![1.0f32; n];
        c.allreduce(&mut x, ReduceOp::Sum)?;
        unreachable!()
    });
    assert_eq!(errs.len(), 4);
    // A rebuilt world computes correct results.
    let comms = Comm::mem_world(3);
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let mut x = vec![1i64; 100];
                c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                assert!(x.iter().all(|v| *v == 3));
                // After a failure the same group refuses at once.
                let mut bad = vec![1i64; if c.rank() == 0 { 5 } else { 6 }];
                assert!(c.allreduce(&mut bad, ReduceOp::Sum).is_err());
                let start = Instant::now();
                let e = c.allreduce(&mut x, ReduceOp::Sum).unwrap_err().to_string();
                assert!(e.contains("poisoned") || e.contains("aborted"), "{e}");
                assert!(start.elapsed() < Duration::from_secs(1));
            });
        }
    });
}
