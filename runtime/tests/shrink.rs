//! `Group::shrink` over real connections (TCP and QUIC), ranks as threads of this process:
//! a rank is lost, the survivors agree, renumber in order and go on; the old groups' threads
//! and sockets are gone once dropped; a rank cut off from the decision stops, naming what it
//! lost. One test function, so nothing else runs in this process while threads and
//! descriptors are counted.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tutti_runtime::rendezvous::TransportKind;
use tutti_runtime::{init_on_store, Error, Group, Secret};

mod common;
use common::{options, store};

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// A ring exchange: each rank sends its rank (one byte) to the next and returns what it got.
fn ring(g: &Group, tag: u32) -> Result<u8, Error> {
    let n = g.size();
    let mut b = [0u8; 1];
    if n == 1 {
        return Ok(g.rank() as u8);
    }
    let r = g.rank();
    let sent = g.send((r + 1) % n, tag, &[r as u8]);
    let got = g.recv((r + n - 1) % n, tag, &mut b);
    sent.and(got).map(|_| b[0])
}

/// What a survivor saw: its new rank, what the new ring brought, the old ranks of the new
/// world and every survivor's note.
type Survivor = (usize, u8, Vec<usize>, Vec<u8>);

/// World `n`; `victim` leaves (its group dropped without a word) after one good ring; the
/// survivors fail, shrink, and exchange again over the new world.
fn lose_one(kind: TransportKind, n: usize, victim: usize) {
    let store = store(&format!("shrink-{kind:?}-{n}"));
    let opts = options(kind);
    let secret = Secret::Given("shrink-test-secret-0123".into());
    let before_threads = count("/proc/self/task");
    let before_fds = count("/proc/self/fd");
    let after_ring = Arc::new(Barrier::new(n));
    let out: Vec<Option<Survivor>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (store, opts, secret, after_ring) =
                    (store.clone(), opts.clone(), secret.clone(), after_ring.clone());
                s.spawn(move || {
                    let g = init_on_store(r, n, store, secret, None, &opts).unwrap();
                    assert_eq!(ring(&g, 1).unwrap() as usize, (r + n - 1) % n);
                    after_ring.wait();
                    if r == victim {
                        drop(g);
                        return None;
                    }
                    // Keep exchanging until the loss shows.
                    let t = Instant::now();
                    let e = loop {
                        if let Err(e) = ring(&g, 2) {
                            break e;
                        }
                        assert!(t.elapsed() < Duration::from_secs(10), "the loss never showed");
                    };
                    assert!(e.to_string().contains("rank"), "{e}");
                    let note = vec![r as u8 + 100];
                    let sh = g.shrink_with(&note).unwrap();
                    drop(g);
                    let ng = sh.group;
                    assert_eq!(ng.size(), n - 1);
                    assert_eq!(sh.epoch, 1);
                    assert_eq!(sh.lost, vec![victim]);
                    // New rank = position among the survivors, in the old order.
                    let want_rank = if r < victim { r } else { r - 1 };
                    assert_eq!(ng.rank(), want_rank);
                    assert_eq!(sh.old_ranks[ng.rank()], r);
                    let notes: Vec<u8> = sh.notes.iter().map(|v| v[0]).collect();
                    let got = ring(&ng, 3).unwrap();
                    Some((ng.rank(), got, sh.old_ranks.clone(), notes))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let survivors: Vec<usize> = (0..n).filter(|r| *r != victim).collect();
    let notes: Vec<u8> = survivors.iter().map(|r| *r as u8 + 100).collect();
    for (old, o) in out.iter().enumerate() {
        let Some((new, got, old_ranks, seen)) = o else {
            assert_eq!(old, victim);
            continue;
        };
        assert_eq!(*got as usize, (new + n - 2) % (n - 1), "rank {old}");
        assert_eq!(old_ranks, &survivors);
        assert_eq!(seen, &notes);
    }
    // Every group is dropped now: the transports' threads and sockets are gone.
    let t = Instant::now();
    while (count("/proc/self/task") > before_threads || count("/proc/self/fd") > before_fds + 2)
        && t.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(count("/proc/self/task") <= before_threads, "threads left: {kind:?}");
    assert!(count("/proc/self/fd") <= before_fds + 2, "descriptors left: {kind:?}");
}

/// Of 4 ranks, 2 are lost at once: the other 2 are not a strict majority, so they stop with
/// `CutOff`, naming the ranks they lost, instead of going on as half a job.
fn half_lost_stops(kind: TransportKind) {
    let store = store(&format!("shrink-{kind:?}-half"));
    let opts = options(kind);
    let secret = Secret::Given("shrink-test-secret-0123".into());
    let after_ring = Arc::new(Barrier::new(4));
    let errs: Vec<Option<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|r| {
                let (store, opts, secret, after_ring) =
                    (store.clone(), opts.clone(), secret.clone(), after_ring.clone());
                s.spawn(move || {
                    let g = init_on_store(r, 4, store, secret, None, &opts).unwrap();
                    ring(&g, 1).unwrap();
                    if r >= 2 {
                        // Both leave before the others go on, so the two are lost at once.
                        // Were one still there when a survivor aborted its transport, it would
                        // answer that abort like a live rank, and with no presence count in
                        // this store nobody could tell it left: the proposer would wait the
                        // group's timeout for it (it did, once in a CI run).
                        drop(g);
                        after_ring.wait();
                        return None;
                    }
                    after_ring.wait();
                    while ring(&g, 2).is_ok() {}
                    let t = Instant::now();
                    let e = g.shrink().unwrap_err().to_string();
                    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
                    Some(e)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, e) in errs.iter().enumerate().take(2) {
        let e = e.as_deref().unwrap_or_default();
        assert!(e.contains("cut off at membership epoch 0"), "rank {r}: {e}");
        assert!(e.contains("only 2 of 4 ranks") && e.contains("not a strict majority"), "{e}");
        assert!(e.contains("lost ranks [2, 3]"), "{e}");
    }
}

#[test]
fn survivors_shrink_and_go_on() {
    let kinds = [
        TransportKind::Tcp,
        #[cfg(feature = "quic")]
        TransportKind::Quic,
    ];
    for kind in kinds {
        lose_one(kind, 4, 2);
        lose_one(kind, 3, 0);
    }
    half_lost_stops(TransportKind::Tcp);
}
