//! Shared buffers (`Comm::shared_buffer`, `Comm::allgather_shared`): exact all-gathers at every
//! world and several dtypes, call after call with new data; what cannot work is refused on
//! every rank alike, naming why; a rank that stays away is named by the others.

use std::time::{Duration, Instant};

use half::bf16;
use tutti_collectives::{Comm, Element, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

/// Run `f` on every rank of an `n`-rank world of `kind` (group timeout `timeout`).
fn run<T: Send>(kind: Kind, n: usize, timeout: Duration, f: impl Fn(&Comm) -> T + Sync) -> Vec<T> {
    let gs = groups(kind, n).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = gs
            .into_iter()
            .map(|g| {
                g.set_timeout(timeout);
                s.spawn(move || f(&Comm::new(g)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Element `i` of rank `r`'s block in round `k`: small integers, exact in every dtype.
fn val<T: Element>(k: usize, r: usize, i: usize) -> T {
    tutti_collectives::verify::value::<T>(k as u64, r, i, ReduceOp::Sum)
}

fn rounds<T: Element>(c: &Comm, block: usize) {
    let (n, me) = (c.size(), c.rank());
    let mut buf = c.shared_buffer::<T>(block * n).unwrap();
    assert_eq!(buf.len(), block * n);
    assert!(buf.iter().all(|x| *x == T::default()), "a new shared buffer starts zeroed");
    for k in 0..4 {
        // A new contribution each round: what a peer reads is this round's, never the last.
        for (i, x) in buf[me * block..(me + 1) * block].iter_mut().enumerate() {
            *x = val(k, me, i);
        }
        let st = c.allgather_shared(&mut buf).unwrap();
        assert_eq!(st.algo.name(), "direct");
        for r in 0..n {
            for i in 0..block {
                let (got, want) = (buf[r * block + i], val::<T>(k, r, i));
                assert!(got == want, "n={n} round {k}: rank {me} is wrong at block {r}[{i}]");
            }
        }
    }
}

fn exact(kind: Kind) {
    for n in 1..=5 {
        run(kind, n, Duration::from_secs(60), |c| {
            rounds::<f32>(c, 1000);
            rounds::<bf16>(c, 4097);
            rounds::<u8>(c, 1);
            rounds::<i64>(c, 300_000);
        });
    }
}

#[test]
fn allgather_on_shared_buffers_is_exact_in_memory() {
    exact(Kind::Mem);
}

#[test]
fn allgather_on_shared_buffers_is_exact_over_shared_memory() {
    exact(Kind::Shm);
}

#[test]
fn different_counts_are_refused_on_every_rank() {
    let rs = run(Kind::Shm, 3, Duration::from_secs(30), |c| {
        c.shared_buffer::<f32>(if c.rank() == 1 { 96 } else { 99 }).map(|_| ())
    });
    for (r, x) in rs.iter().enumerate() {
        let e = x.as_ref().expect_err("different counts must be refused").to_string();
        assert!(e.contains("bytes, ours"), "rank {r}: {e}");
    }
}

#[test]
fn a_refusal_leaves_the_communicator_usable() {
    // Every rank refused alike: nobody waits for anybody, and the next collective runs.
    let rs = run(Kind::Shm, 3, Duration::from_secs(30), |c| {
        let refused = c.shared_buffer::<f32>(if c.rank() == 0 { 6 } else { 9 }).is_err();
        let mut x = [c.rank() as f32 + 1.0];
        c.allreduce(&mut x, ReduceOp::Sum).unwrap();
        (refused, x[0])
    });
    assert!(rs.iter().all(|(refused, sum)| *refused && *sum == 6.0), "{rs:?}");
}

#[test]
fn ranks_on_another_host_are_refused_naming_one() {
    // A QUIC job whose ranks 0, 1 and 2, 3 claim two hosts.
    let rs =
        run(Kind::QuicShm, 4, Duration::from_secs(30), |c| c.shared_buffer::<f32>(16).map(|_| ()));
    for (r, x) in rs.iter().enumerate() {
        let e = x.as_ref().expect_err("ranks of two hosts must be refused").to_string();
        assert!(e.contains("does not share memory"), "rank {r}: {e}");
    }
}

#[test]
fn a_buffer_of_another_group_is_refused() {
    let rs = run(Kind::Mem, 2, Duration::from_secs(30), |c| {
        let mut buf = c.shared_buffer::<f32>(8).unwrap();
        let other = c.split(&[0, 1]).unwrap().expect("a member");
        let e = other.allgather_shared(&mut buf).unwrap_err().to_string();
        assert!(e.contains("another group"), "{e}");
    });
    assert_eq!(rs.len(), 2);
}

#[test]
fn a_rank_that_stays_away_is_named_by_the_others() {
    // Rank 2 makes the buffer but never calls the all-gather: the others give up at their
    // 1 s deadline, naming it (the first to time out aborts the group, so the other may
    // report that abort, whose reason names rank 2: a timeout, not a hang). The buffer is
    // read-only afterwards.
    let start = Instant::now();
    let rs = run(Kind::Shm, 3, Duration::from_secs(1), |c| {
        let mut buf = c.shared_buffer::<i32>(30).unwrap();
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        let e = c.allgather_shared(&mut buf).unwrap_err().to_string();
        let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| buf[0] = 1));
        assert!(again.is_err(), "a buffer whose call failed must refuse writes");
        Some(e)
    });
    for e in rs.iter().flatten() {
        assert!(e.contains("rank 2") || e.contains("peer 2"), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(20));
}
