//! Abort from another thread stops a large allreduce on every rank, fast; a short timeout fires
//! with "timed out" after a successful operation (gloo's timeout test).

use std::time::{Duration, Instant};

use tutti_collectives::{Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

#[test]
fn abort_during_a_256_mib_allreduce_returns_within_a_second_everywhere() {
    for kind in [Kind::Mem, Kind::Tcp, Kind::Shm, Kind::Quic, Kind::QuicShm] {
        let gs = groups(kind, 4).unwrap();
        let aborter = gs[1].clone();
        let abort_at = std::sync::Mutex::new(None);
        // Everyone (ranks and the aborter) starts together once the 256 MiB buffers exist, so
        // the abort lands inside the allreduce, not in a rank still filling its buffer.
        let ready = std::sync::Barrier::new(5);
        let ready = &ready;
        let ends: Vec<(Instant, String)> = std::thread::scope(|s| {
            let hs: Vec<_> = gs
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let c = Comm::new(g);
                        let mut x = vec![1.0f32; 64 << 20];
                        ready.wait();
                        let r = c.allreduce(&mut x, ReduceOp::Sum);
                        (Instant::now(), r.err().map(|e| e.to_string()).unwrap_or_default())
                    })
                })
                .collect();
            s.spawn(|| {
                ready.wait();
                std::thread::sleep(Duration::from_millis(50));
                *abort_at.lock().unwrap() = Some(Instant::now());
                aborter.abort("stop requested by the test");
            });
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let t0 = abort_at.lock().unwrap().unwrap();
        for (r, (end, err)) in ends.iter().enumerate() {
            assert!(
                !err.is_empty(),
                "{kind:?}: rank {r} finished a 256 MiB allreduce before the abort"
            );
            assert!(err.contains("stop requested by the test"), "{kind:?} rank {r}: {err}");
            let took = end.saturating_duration_since(t0);
            assert!(took < Duration::from_secs(1), "{kind:?} rank {r} took {took:?}");
        }
    }
}

#[test]
fn short_timeout_fires_after_a_successful_operation() {
    for kind in [Kind::Mem, Kind::Tcp, Kind::Shm, Kind::Quic, Kind::QuicShm] {
        let gs = groups(kind, 2).unwrap();
        std::thread::scope(|s| {
            for g in gs {
                s.spawn(move || {
                    let c = Comm::new(g);
                    let mut x = vec![1.0f32; 100];
                    c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                    c.group().set_timeout(Duration::from_millis(300));
                    if c.rank() == 0 {
                        let start = Instant::now();
                        let e = c.allreduce(&mut x, ReduceOp::Sum).unwrap_err().to_string();
                        assert!(e.contains("timed out") && e.contains("peer rank 1"), "{e}");
                        assert!(start.elapsed() < Duration::from_secs(5));
                    } else {
                        // Rank 1 never joins the second allreduce; it only waits for the abort.
                        std::thread::sleep(Duration::from_millis(1500));
                    }
                });
            }
        });
    }
}
