//! `Group::reconfigure` over real connections (TCP and QUIC), ranks as threads of this process:
//! members the caller chose, in the caller's order, go on over a new world; the old world's
//! pending calls fail naming the reconfigure; a reused uuid, a bad member list and a member
//! that never comes are each named.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tutti_runtime::rendezvous::TransportKind;
use tutti_runtime::{init_on_store, Error, Group, Secret};

mod common;
use common::{options, store};

/// Every rank sends its payload to every other rank; returns what came, by sender.
fn exchange(g: &Group, tag: u32, mine: u8) -> Result<Vec<u8>, Error> {
    let n = g.size();
    let mut got = vec![0u8; n];
    got[g.rank()] = mine;
    for d in 1..n {
        let to = (g.rank() + d) % n;
        let from = (g.rank() + n - d) % n;
        g.send(to, tag, &[mine])?;
        let mut b = [0u8; 1];
        g.recv(from, tag, &mut b)?;
        got[from] = b[0];
    }
    Ok(got)
}

/// World 4: rank 2 leaves; the others reconfigure to old ranks [3, 1, 0] (new ranks 0, 1, 2),
/// then that world reconfigures to its ranks [2, 0] (old ranks 0 and 3, swapped back).
fn chosen_members_go_on(kind: TransportKind) {
    let n = 4;
    let store = store(&format!("reconf-{kind:?}"));
    let opts = options(kind);
    let secret = Secret::Given("reconfigure-test-secret-01".into());
    let up = Arc::new(Barrier::new(n));
    let reconfigured = Arc::new(Barrier::new(n));
    let exchanged = Arc::new(Barrier::new(n - 1));
    std::thread::scope(|s| {
        for r in 0..n {
            let (store, opts, secret, up) =
                (store.clone(), opts.clone(), secret.clone(), up.clone());
            let (reconfigured, exchanged) = (reconfigured.clone(), exchanged.clone());
            s.spawn(move || {
                let g = init_on_store(r, n, store, secret, None, &opts).unwrap();
                assert_eq!(exchange(&g, 1, r as u8).unwrap(), vec![0, 1, 2, 3]);
                up.wait();
                if r == 2 {
                    // Left out, but alive until the others have gone on (a closing rank would
                    // fail the old world's pending calls itself).
                    reconfigured.wait();
                    return;
                }
                // A receive of the old world is pending when the reconfigure starts: it fails,
                // naming it, instead of waiting for a sender that never comes.
                let old = g.clone();
                let pending = std::thread::spawn(move || {
                    let mut b = [0u8; 1];
                    old.recv((old.rank() + 1) % 4, 77, &mut b)
                });
                std::thread::sleep(Duration::from_millis(50));
                let members = [3, 1, 0];
                let ng = g.reconfigure(7, &members, Duration::from_secs(10)).unwrap();
                reconfigured.wait();
                let e = pending.join().unwrap().unwrap_err().to_string();
                assert!(e.contains("reconfiguring"), "{e}");
                assert!(g.send(0, 2, &[1]).is_err(), "the old world is aborted");
                let want = members.iter().position(|m| *m == r).unwrap();
                assert_eq!((ng.rank(), ng.size()), (want, 3));
                assert_eq!(exchange(&ng, 2, r as u8).unwrap(), vec![3, 1, 0]);
                // The same uuid again is refused before anything is aborted.
                let e = ng.reconfigure(7, &[0, 1, 2], Duration::from_secs(1)).unwrap_err();
                assert!(matches!(e, Error::Config(_)) && e.to_string().contains("uuid 7"), "{e}");
                assert_eq!(exchange(&ng, 3, r as u8).unwrap(), vec![3, 1, 0]);
                exchanged.wait();
                // A reconfigured world reconfigures again (old 1 is left out).
                if r == 1 {
                    return;
                }
                let nn = ng.reconfigure(8, &[2, 0], Duration::from_secs(10)).unwrap();
                assert_eq!(nn.size(), 2);
                assert_eq!(exchange(&nn, 4, r as u8).unwrap(), vec![0, 3]);
            });
        }
    });
}

#[test]
fn chosen_members_go_on_in_the_chosen_order() {
    chosen_members_go_on(TransportKind::Tcp);
    #[cfg(feature = "quic")]
    chosen_members_go_on(TransportKind::Quic);
}

#[test]
fn bad_lists_and_a_member_that_never_comes_are_named() {
    let n = 3;
    let store = store("reconf-missing");
    let opts = options(TransportKind::Tcp);
    let secret = Secret::Given("reconfigure-test-secret-02".into());
    std::thread::scope(|s| {
        for r in 0..n {
            let (store, opts, secret) = (store.clone(), opts.clone(), secret.clone());
            s.spawn(move || {
                let g = init_on_store(r, n, store, secret, None, &opts).unwrap();
                for bad in [&[][..], &[0, 0][..], &[0, 5][..]] {
                    let e = g.reconfigure(1, bad, Duration::from_secs(1)).unwrap_err();
                    assert!(matches!(e, Error::InvalidArgument { .. }), "{bad:?}: {e}");
                }
                if r == 2 {
                    // Named in the new list, but never calls: the others fail, naming it.
                    std::thread::sleep(Duration::from_secs(3));
                    return;
                }
                let without_me = if r == 0 { [1, 2] } else { [0, 2] };
                let e = g.reconfigure(2, &without_me, Duration::from_secs(1)).unwrap_err();
                assert!(e.to_string().contains("not among the members"), "{e}");
                let t = Instant::now();
                let e = g.reconfigure(3, &[0, 1, 2], Duration::from_secs(1)).unwrap_err();
                assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
                // Member 2 never published its address in the new world: named as rank 2.
                assert!(matches!(e, Error::Rendezvous { .. }), "{e}");
                assert!(e.to_string().contains("ranks [2]"), "{e}");
            });
        }
    });
}
