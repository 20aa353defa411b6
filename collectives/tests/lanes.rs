//! `Comm::with_lanes`: non-blocking calls spread over several lanes, each its own thread and
//! sub-group. Results stay exact with owned and lent buffers mixed with blocking calls, over
//! memory, TCP and QUIC; a job held up on one lane does not hold up the next job on another
//! lane, where one lane runs them in order.

use std::time::Duration;

use tutti_collectives::{Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

fn on_world(kind: Kind, n: usize, f: impl Fn(Comm) + Sync) {
    let gs = groups(kind, n).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = gs.into_iter().map(|g| s.spawn(move || f(Comm::new(g)))).collect();
        for h in hs {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
}

/// Job `k`'s contribution from rank `r`, element `i`, and the sum over `n` ranks.
fn val(k: usize, r: usize, i: usize) -> i64 {
    (k * 1000 + r * 10 + i) as i64
}
fn sum(k: usize, n: usize, i: usize) -> i64 {
    (0..n).map(|r| val(k, r, i)).sum()
}

fn exact(kind: Kind, n: usize, lanes: usize) {
    on_world(kind, n, |c: Comm| {
        let r = c.rank();
        let l = c.with_lanes(lanes).unwrap();
        // Owned buffers: 12 jobs spread over the lanes, then a blocking call in between.
        let len = |k: usize| 1 + (k * 37) % 5000;
        let hs: Vec<_> = (0..12)
            .map(|k| l.iallreduce((0..len(k)).map(|i| val(k, r, i)).collect(), ReduceOp::Sum))
            .collect();
        let mut b = vec![r as i64; 3];
        l.allreduce(&mut b, ReduceOp::Sum).unwrap();
        assert_eq!(b, vec![(n * (n - 1) / 2) as i64; 3]);
        for (k, h) in hs.into_iter().enumerate() {
            let (v, _) = h.wait().unwrap();
            assert!(v.iter().enumerate().all(|(i, x)| *x == sum(k, n, i)), "job {k}");
        }
        // Lent buffers, and a blocking call on the original communicator meanwhile.
        let mut bufs: Vec<Vec<i64>> =
            (12..20).map(|k| (0..len(k)).map(|i| val(k, r, i)).collect()).collect();
        l.scope(|s| {
            let hs: Vec<_> = bufs.iter_mut().map(|b| s.iallreduce(b, ReduceOp::Sum)).collect();
            let mut m = [1i64];
            c.allreduce(&mut m, ReduceOp::Max).unwrap();
            for h in hs {
                h.wait().unwrap();
            }
        });
        for (j, b) in bufs.iter().enumerate() {
            let k = 12 + j;
            assert!(b.iter().enumerate().all(|(i, x)| *x == sum(k, n, i)), "job {k}");
        }
    });
}

#[test]
fn lanes_give_exact_results_mem() {
    for n in [1, 2, 3, 4] {
        for lanes in [1, 2, 3] {
            exact(Kind::Mem, n, lanes);
        }
    }
}

#[test]
fn lanes_give_exact_results_tcp() {
    exact(Kind::Tcp, 3, 3);
}

#[test]
fn lanes_give_exact_results_quic() {
    exact(Kind::Quic, 2, 2);
}

/// Job 0 waits 300 ms on rank 0 before its allreduce; job 1 is a small allreduce. With two
/// lanes job 1 ends while job 0 is still held up, on every rank; with one it cannot.
fn held_up(kind: Kind, lanes: usize) -> Vec<bool> {
    let out = std::sync::Mutex::new(Vec::new());
    on_world(kind, 2, |c: Comm| {
        let l = c.with_lanes(lanes).unwrap();
        let r = l.rank();
        let mut h0 = l.submit(move |c| {
            if r == 0 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let mut b = [1i32; 4];
            c.allreduce(&mut b, ReduceOp::Sum)?;
            Ok(b)
        });
        let h1 = l.iallreduce(vec![2i32; 4], ReduceOp::Sum);
        assert_eq!(h1.wait().unwrap().0, vec![4; 4]);
        let first = h0.test().is_none();
        if first {
            assert_eq!(h0.wait().unwrap(), [2; 4]);
        }
        out.lock().unwrap().push(first);
    });
    out.into_inner().unwrap()
}

#[test]
fn a_held_up_job_holds_up_only_its_lane() {
    for kind in [Kind::Mem, Kind::Tcp] {
        assert_eq!(held_up(kind, 2), vec![true, true], "{kind:?}");
        assert_eq!(held_up(kind, 1), vec![false, false], "{kind:?}");
    }
}

/// Rank 2 leaves before any job: every job on every lane of the others fails naming it, well
/// within the group's timeout — no lane hangs.
fn lost_rank(kind: Kind) {
    let gs = groups(kind, 3).unwrap();
    std::thread::scope(|s| {
        for g in gs {
            g.set_timeout(Duration::from_secs(20));
            s.spawn(move || {
                let c = Comm::new(g);
                if c.rank() == 2 {
                    return;
                }
                let l = c.with_lanes(2).unwrap();
                let t0 = std::time::Instant::now();
                let hs: Vec<_> =
                    (0..4).map(|_| l.iallreduce(vec![1i64; 1000], ReduceOp::Sum)).collect();
                for h in hs {
                    let e = h.wait().expect_err("a job finished without rank 2");
                    // Lost by this rank, or by the other survivor, which aborts and says why.
                    // (A link never connected names it as the one its dial found gone.)
                    let e = e.to_string();
                    assert!(
                        e.contains("peer rank 2") || e.contains("connection to rank 2"),
                        "{kind:?}: {e}"
                    );
                }
                assert!(t0.elapsed() < Duration::from_secs(10), "{kind:?}: {:?}", t0.elapsed());
            });
        }
    });
}

#[test]
fn a_lost_rank_fails_every_lane() {
    for kind in [Kind::Mem, Kind::Tcp, Kind::Quic] {
        lost_rank(kind);
    }
}
