//! A broadcast loop whose root runs ahead of receivers that have not begun, on every transport
//! and for every broadcast algorithm: flow control holds what each receiver keeps for calls it
//! has not made to the window per peer (`LinkConfig::window`, as
//! `Transport::unexpected_bytes` reports it), the root waits instead of finishing every call,
//! and every call then arrives intact. With direct reads the root waits in each call for
//! every reader to begin it, and nothing is held outside the windows.
//!
//! Seen when written: over QUIC the tree's receivers held exactly the 16 MiB window, at either
//! size, and the root ran 30–31 calls of 1 MiB (963–1,022 of 32 KiB) ahead, the rest waiting in
//! quinn's stream window; over TCP, shared memory and memory the messages waited below the
//! core (the kernel's socket buffers, the ring, the pipe), which held nothing, and the root ran
//! 3–6 calls of 1 MiB and 31–127 of 32 KiB ahead. Scatter–all-gather's root takes part in the
//! all-gather, so it waits in every call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tutti_collectives::{Algo, Comm};
use tutti_runtime::testing::{groups, Kind};
use tutti_runtime::transport::LinkConfig;

const RANKS: usize = 3;
/// (f32 elements a call, calls): 128 calls of 1 MiB and 4,096 of 32 KiB, 128 MiB each, eight
/// times the default window of 16 MiB: more than the window and what waits below it together
/// (at 1,024 calls of 32 KiB over QUIC the root once finished them all).
const LOOPS: [(usize, usize); 2] = [(1 << 18, 128), (1 << 13, 4096)];
/// How long the receivers stay away before their first call.
const AWAY: Duration = Duration::from_millis(400);

fn value(call: usize, i: usize) -> f32 {
    // Exact in f32: below 2^24.
    ((call * 7919 + i) % (1 << 20)) as f32
}

fn broadcast_loop(kind: Kind, algo: Algo, count: usize, calls: usize) {
    let window = LinkConfig::default().window;
    let done = AtomicUsize::new(0);
    let gs = groups(kind, RANKS).unwrap();
    std::thread::scope(|s| {
        for g in gs {
            let done = &done;
            s.spawn(move || {
                g.set_timeout(Duration::from_secs(60));
                let c = Comm::new(g).with_algo(algo);
                let mut buf = vec![0f32; count];
                // One call together first: it makes what a first call makes (the windows'
                // set-up, itself a collective, for direct reads; the links, on first use), so
                // that the root can then run ahead.
                c.broadcast(&mut buf, 0).unwrap();
                if c.rank() == 0 {
                    for call in 0..calls {
                        buf.iter_mut().enumerate().for_each(|(i, v)| *v = value(call, i));
                        c.broadcast(&mut buf, 0).unwrap();
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                    return;
                }
                std::thread::sleep(AWAY);
                let ahead = done.load(Ordering::SeqCst);
                let held = c.group().transport().unexpected_bytes();
                let what =
                    format!("{kind:?}, {algo:?}, {calls} calls of {count}, rank {}", c.rank());
                // Only the root sends before the receivers begin (each receives from one
                // parent, or from the root alone): one peer's window at most.
                assert!(held <= window, "{what}: holds {held} bytes for calls it has not made");
                assert!(ahead < calls, "{what}: the root finished all {calls} calls alone");
                if algo == Algo::Direct {
                    // Past the line slots, a direct broadcast's root waits in each call for
                    // every reader's stamp of it (so that a reader in another call is named):
                    // it runs no call ahead, and posts nothing through the transport.
                    assert_eq!(ahead, 0, "{what}: the root ran {ahead} calls ahead");
                    assert_eq!(held, 0, "{what}");
                }
                for call in 0..calls {
                    let st = c.broadcast(&mut buf, 0).unwrap();
                    assert_eq!(st.algo, algo, "{what}");
                    assert!(
                        buf.iter().enumerate().all(|(i, v)| *v == value(call, i)),
                        "{what}: call {call} differs"
                    );
                }
            });
        }
    });
}

fn every_algo(kind: Kind) {
    for algo in [Algo::Tree, Algo::Chain, Algo::ScatterAllgather] {
        for (count, calls) in LOOPS {
            broadcast_loop(kind, algo, count, calls);
        }
    }
}

#[test]
fn a_root_running_ahead_holds_each_receiver_to_the_window_mem() {
    every_algo(Kind::Mem);
}

#[test]
fn a_root_running_ahead_holds_each_receiver_to_the_window_tcp() {
    every_algo(Kind::Tcp);
}

#[test]
fn a_root_running_ahead_holds_each_receiver_to_the_window_shm() {
    every_algo(Kind::Shm);
    for (count, calls) in LOOPS {
        broadcast_loop(Kind::Shm, Algo::Direct, count, calls);
    }
}

#[test]
fn a_root_running_ahead_holds_each_receiver_to_the_window_quic() {
    every_algo(Kind::Quic);
}
