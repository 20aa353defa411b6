//! One test body per transport: each `transport_test!` expands into `_mem` and `_tcp` tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::testing::{world, Kind};
use crate::transport::{Op, Transport, TransportExt};
use crate::wire::{DType, Fingerprint, MsgDesc, OpKind, Tag};

const T: Duration = Duration::from_secs(60);

fn desc(seq: u64, step: u32, count: u64) -> MsgDesc {
    MsgDesc {
        tag: Tag { group: 0, seq, step },
        fp: Fingerprint {
            op: OpKind::Allreduce,
            dtype: DType::U8,
            redop: 0,
            root: u32::MAX,
            count,
            settings: 0,
        },
    }
}

/// Bytes that identify (src, dst, salt) at every position, so misplaced data is caught.
fn pattern(len: usize, src: usize, dst: usize, salt: u64) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u64)
                .wrapping_mul(0x9e37_79b9)
                .wrapping_add(salt * 131 + (src * 31 + dst) as u64);
            (x ^ (x >> 13)) as u8
        })
        .collect()
}

fn run_ranks<F>(ts: Vec<Arc<dyn Transport>>, f: F)
where
    F: Fn(&dyn Transport) + Sync,
{
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = ts.iter().map(|t| s.spawn(move || f(t.as_ref()))).collect();
        for h in hs {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
}

macro_rules! transport_test {
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
            fn eager() {
                ($body)(Kind::Eager)
            }
            #[cfg(feature = "quic")]
            #[test]
            fn quic() {
                ($body)(Kind::Quic)
            }
            #[cfg(feature = "quic")]
            #[test]
            fn quic_shm() {
                ($body)(Kind::QuicShm)
            }
        }
    };
}

transport_test!(ping_pong_sizes, |kind| {
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        for (i, &len) in [0usize, 1, 4 << 10, 1 << 20, 64 << 20].iter().enumerate() {
            let d = desc(i as u64, 0, len as u64);
            let me = t.rank();
            let peer = 1 - me;
            let mine = pattern(len, me, peer, i as u64);
            let mut got = vec![0u8; len];
            if me == 0 {
                t.send(peer, d, &mine, T).unwrap();
                assert_eq!(t.recv(peer, d, &mut got, T).unwrap(), len);
            } else {
                assert_eq!(t.recv(peer, d, &mut got, T).unwrap(), len);
                t.send(peer, d, &mine, T).unwrap();
            }
            assert!(got == pattern(len, peer, me, i as u64), "payload of {len} bytes differs");
        }
    });
});

transport_test!(interleaved_tags_arrive_by_tag, |kind| {
    // Rank 0 sends tags 0..8 in order; rank 1 receives them in reverse order, so every message
    // but the last waits in the unexpected queue.
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        let n = 8u32;
        if t.rank() == 0 {
            for step in 0..n {
                let data = pattern(1000 + step as usize * 5000, 0, 1, step as u64);
                t.send(1, desc(0, step, 0), &data, T).unwrap();
            }
        } else {
            for step in (0..n).rev() {
                let len = 1000 + step as usize * 5000;
                let mut buf = vec![0u8; len];
                assert_eq!(t.recv(0, desc(0, step, 0), &mut buf, T).unwrap(), len);
                assert!(buf == pattern(len, 0, 1, step as u64));
            }
        }
    });
});

transport_test!(same_tag_is_fifo, |kind| {
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        for i in 0..50u8 {
            if t.rank() == 0 {
                t.send(1, desc(0, 0, 0), &[i; 3], T).unwrap();
            } else {
                let mut b = [0u8; 3];
                t.recv(0, desc(0, 0, 0), &mut b, T).unwrap();
                assert_eq!(b, [i; 3]);
            }
        }
    });
});

transport_test!(many_in_flight_full_mesh, |kind| {
    // Every rank posts, all at once, 4 sends to and 4 receives from every peer, of mixed sizes,
    // then waits for all of them: no deadlock and every byte in place.
    let n = 5;
    let ts = world(kind, n).unwrap();
    run_ranks(ts, |t| {
        let me = t.rank();
        let sizes = [0usize, 100, 70_000, 300_000];
        let sends: Vec<(usize, u32, Vec<u8>)> = (0..n)
            .filter(|p| *p != me)
            .flat_map(|p| sizes.iter().enumerate().map(move |(k, &s)| (p, k as u32, s)))
            .map(|(p, k, s)| (p, k, pattern(s, me, p, k as u64)))
            .collect();
        let mut recvs: Vec<(usize, u32, Vec<u8>)> = (0..n)
            .filter(|p| *p != me)
            .flat_map(|p| sizes.iter().enumerate().map(move |(k, &s)| (p, k as u32, vec![0u8; s])))
            .collect();
        let mut ops: Vec<Op<'_>> = Vec::new();
        for (p, k, data) in &sends {
            ops.push(Op::Send { peer: *p, desc: desc(1, *k, 0), data });
        }
        for (p, k, buf) in recvs.iter_mut() {
            ops.push(Op::Recv { peer: *p, desc: desc(1, *k, 0), buf, received: 0 });
        }
        t.exchange(&mut ops, T).unwrap();
        drop(ops);
        for (p, k, buf) in &recvs {
            assert!(*buf == pattern(buf.len(), *p, me, *k as u64), "from {p} step {k}");
        }
    });
});

transport_test!(self_send, |kind| {
    let ts = world(kind, 1).unwrap();
    run_ranks(ts, |t| {
        let data = pattern(5000, 0, 0, 9);
        let mut buf = vec![0u8; 5000];
        let mut ops = [
            Op::Send { peer: 0, desc: desc(0, 0, 0), data: &data },
            Op::Recv { peer: 0, desc: desc(0, 0, 0), buf: &mut buf, received: 0 },
        ];
        t.exchange(&mut ops, T).unwrap();
        assert!(buf == data);
    });
});

transport_test!(fingerprint_mismatch_names_both, |kind| {
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        if t.rank() == 0 {
            t.send(1, desc(0, 0, 10), &[1u8; 10], T).unwrap();
        } else {
            let mut buf = [0u8; 16];
            let e = t.recv(0, desc(0, 0, 16), &mut buf, T).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Mismatch { peer: 0, .. }), "{msg}");
            assert!(msg.contains("count 16") && msg.contains("count 10"), "{msg}");
        }
    });
});

transport_test!(too_long_is_refused, |kind| {
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        if t.rank() == 0 {
            t.send(1, desc(0, 0, 0), &[1u8; 100], T).unwrap();
            t.send(1, desc(0, 1, 0), &[2u8; 4], T).unwrap();
        } else {
            let mut small = [0u8; 10];
            let e = t.recv(0, desc(0, 0, 0), &mut small, T).unwrap_err();
            assert!(matches!(e, Error::TooLong { posted: 10, got: 100, .. }), "{e}");
            assert_eq!(small, [0u8; 10], "nothing written into a too-short buffer");
            // The stream stays in sync: the next message arrives intact.
            let mut b = [0u8; 4];
            t.recv(0, desc(0, 1, 0), &mut b, T).unwrap();
            assert_eq!(b, [2u8; 4]);
        }
    });
});

transport_test!(stale_receive_fails_fast, |kind| {
    // Rank 1 waits for seq 0 step 5, which rank 0 never sends: rank 0 moves on to seq 1. The
    // receive must fail as a mismatch at once, not at the timeout.
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        if t.rank() == 0 {
            t.send(1, desc(1, 0, 0), &[7u8; 8], T).unwrap();
        } else {
            let mut b = [0u8; 8];
            let start = Instant::now();
            let e = t.recv(0, desc(0, 5, 0), &mut b, T).unwrap_err();
            assert!(matches!(e, Error::Mismatch { .. }), "{e}");
            assert!(e.to_string().contains("moved on"), "{e}");
            assert!(start.elapsed() < Duration::from_secs(20));
        }
    });
});

transport_test!(timeout_names_peer, |kind| {
    let ts = world(kind, 2).unwrap();
    run_ranks(ts, |t| {
        if t.rank() == 1 {
            let mut b = [0u8; 8];
            let e = t.recv(0, desc(0, 0, 0), &mut b, Duration::from_millis(200)).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Timeout { peer: 0, .. }), "{msg}");
            assert!(msg.contains("timed out") && msg.contains("peer rank 0"), "{msg}");
        }
        // Both ranks stay alive until rank 1 has timed out (the other rank's exit would
        // otherwise be reported first, as a lost peer).
        std::thread::sleep(Duration::from_millis(400));
    });
});

transport_test!(abort_fails_pending_and_future, |kind| {
    let ts = world(kind, 2).unwrap();
    let t1 = ts[1].clone();
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            t1.abort("test abort");
            t1.abort("again: idempotent");
        });
        let mut b = [0u8; 8];
        let e = ts[1].recv(0, desc(0, 0, 0), &mut b, T).unwrap_err();
        assert!(e.to_string().contains("test abort"), "{e}");
        let e = ts[1].send(0, desc(0, 1, 0), &b, T).unwrap_err();
        assert!(e.to_string().contains("test abort"), "{e}");
        // The peer learns of the abort too.
        let e = ts[0].recv(1, desc(0, 0, 0), &mut b, T).unwrap_err();
        assert_eq!(e.peer(), Some(1), "{e}");
    });
    assert!(start.elapsed() < Duration::from_secs(10));
});

#[test]
fn tcp_full_mesh_16_ranks() {
    let n = 16;
    let ts = world(Kind::Tcp, n).unwrap();
    run_ranks(ts, |t| exchange_with_everyone(t, n, 1000, 3));
}

/// Every rank sends `len` bytes to every other and receives theirs, all at once, and checks
/// each arrived intact (with links made on first use, every pair dials both ways at once).
fn exchange_with_everyone(t: &dyn Transport, n: usize, len: usize, salt: u64) {
    let me = t.rank();
    let data: Vec<Vec<u8>> = (0..n).map(|p| pattern(len, me, p, salt)).collect();
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; len]).collect();
    let mut ops: Vec<Op<'_>> = Vec::new();
    for (p, d) in data.iter().enumerate().filter(|(p, _)| *p != me) {
        ops.push(Op::Send { peer: p, desc: desc(0, 0, 0), data: d });
    }
    for (p, b) in bufs.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        ops.push(Op::Recv { peer: p, desc: desc(0, 0, 0), buf: b, received: 0 });
    }
    t.exchange(&mut ops, T).unwrap();
    drop(ops);
    for (p, b) in bufs.iter().enumerate().filter(|(p, _)| *p != me) {
        assert!(*b == pattern(len, p, me, salt), "rank {me}: bytes from rank {p}");
    }
}

mod refused {
    use super::*;
    use crate::auth::JobKey;
    use crate::transport::tcp::handshake::{self, Hello};
    use crate::transport::tcp::TcpTransport;
    use crate::transport::LinkConfig;

    fn junk(addr: SocketAddr, bytes: &[u8]) -> bool {
        // Returns true when the server closed the connection on us promptly.
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(bytes);
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = [0u8; 256];
        loop {
            match s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }

    fn hello(job: u64, from: u32) -> Hello {
        Hello { version: handshake::HS_VERSION, world: 2, from, to: 0, job, nonce: [3; 16] }
    }

    #[test]
    fn junk_connections_are_refused_and_the_group_still_works() {
        let cfg =
            LinkConfig { handshake_timeout: Duration::from_millis(500), ..LinkConfig::default() };
        let (ts, _server) = crate::testing::tcp_world(2, &cfg).unwrap();
        let addr0 = ts[0].local_addr();
        let job = 0x7475_7474_6900_0000 ^ _server.addr().port() as u64;
        // Random bytes, an HTTP request, a TLS ClientHello prefix.
        assert!(junk(addr0, &[0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9]));
        assert!(junk(addr0, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(junk(addr0, &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]));
        // A truncated handshake: the server gives up after the handshake timeout.
        assert!(junk(addr0, &hello(job, 1).encode()[..20]));
        // Another job (different job id), and a wrong token.
        let other_job = {
            let mut s = TcpStream::connect(addr0).unwrap();
            handshake::client(
                &mut s,
                &JobKey::from_token("tutti-test"),
                hello(job ^ 1, 1),
                Instant::now() + T,
            )
        };
        assert_eq!(other_job, Err(handshake::HsError::Refused(handshake::Status::WrongJob)));
        let wrong_token = {
            // The key first: deriving it (slow on purpose, more so in a debug build) must not
            // eat the server's handshake timeout.
            let wrong = JobKey::from_token("wrong");
            let mut s = TcpStream::connect(addr0).unwrap();
            handshake::client(&mut s, &wrong, hello(job, 1), Instant::now() + T)
        };
        assert_eq!(wrong_token, Err(handshake::HsError::Proof));
        // Without the key, a wrong job id, world or rank is not revealed: the proof is checked
        // first, and that is all the stranger hears about.
        for h in [hello(job ^ 1, 1), Hello { world: 9, ..hello(job, 1) }, hello(job, 5)] {
            let mut s = TcpStream::connect(addr0).unwrap();
            s.write_all(&h.encode()).unwrap();
            let mut ch = [0u8; 49];
            s.read_exact(&mut ch).unwrap();
            assert_eq!(ch[0], handshake::Status::Ok as u8, "challenge");
            s.write_all(&[0u8; 32]).unwrap();
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).unwrap();
            assert_eq!(ack[0], handshake::Status::BadProof as u8, "{h:?}");
        }
        // Right token, but rank 1 is already connected: a duplicate. (Links connect on first
        // use: connect this one first.)
        ts[1].connect_peers(&[0], T).unwrap();
        let dup = {
            let mut s = TcpStream::connect(addr0).unwrap();
            handshake::client(
                &mut s,
                &JobKey::from_token("tutti-test"),
                hello(job, 1),
                Instant::now() + T,
            )
        };
        assert_eq!(dup, Err(handshake::HsError::Refused(handshake::Status::Duplicate)));
        // The group's next exchange still succeeds.
        let ts: Vec<Arc<dyn Transport>> = ts.into_iter().map(|t| Arc::new(t) as _).collect();
        run_ranks(ts, |t| {
            let mut b = [0u8; 4];
            if t.rank() == 0 {
                t.send(1, desc(0, 0, 0), b"okay", T).unwrap();
            } else {
                t.recv(0, desc(0, 0, 0), &mut b, T).unwrap();
                assert_eq!(&b, b"okay");
            }
        });
    }

    #[test]
    fn listens_only_on_the_interface_asked_for() {
        let (ts, _server) = crate::testing::tcp_world(2, &LinkConfig::default()).unwrap();
        for t in &ts {
            assert!(t.local_addr().ip().is_loopback(), "{}", t.local_addr());
        }
    }

    /// Ranks 0 and 1 of a world of 3 (job `job`) connect through `server`'s store with
    /// connect timeouts of `ms[0]` and `ms[1]` milliseconds, where rank 2 does not come (or
    /// does not count in); their errors.
    fn two_of_three_fail(
        server: &crate::store::StoreServer,
        key: &JobKey,
        job: u64,
        ms: [u64; 2],
    ) -> Vec<String> {
        use crate::store::TcpStore;
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (key, addr) = (key.clone(), server.addr());
                    let wait = Duration::from_millis(ms[rank]);
                    let cfg = LinkConfig { connect_timeout: wait, ..LinkConfig::default() };
                    s.spawn(move || {
                        let store = TcpStore::connect(addr, rank, 3, Some(&key), T).unwrap();
                        let id = crate::transport::tcp::JobIdentity { rank, world: 3, job, key };
                        TcpTransport::connect(&id, Arc::new(store), &cfg).unwrap_err().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A store for a world of 3 with rank 2's address `at` in it for job `job`, published as
    /// rank 2 does, and rank 2's connection to it.
    fn rank_2_published(
        key: &JobKey,
        job: u64,
        at: SocketAddr,
    ) -> (crate::store::StoreServer, crate::store::TcpStore) {
        use crate::store::{StoreServer, TcpStore};
        let server =
            StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), 3, Some(key.clone()))
                .unwrap();
        let store = TcpStore::connect(server.addr(), 2, 3, Some(key), T).unwrap();
        let name = crate::transport::tcp::addr_key(2);
        crate::store::set_signed(&store, key, job, &name, at.to_string().as_bytes()).unwrap();
        (server, store)
    }

    #[test]
    fn missing_rank_is_named() {
        // World of 3, rank 2 never starts: ranks 0 and 1 fail within the connect timeout,
        // naming rank 2.
        use crate::store::StoreServer;
        let key = JobKey::from_token("k");
        let server =
            StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), 3, Some(key.clone()))
                .unwrap();
        let start = Instant::now();
        for e in &two_of_three_fail(&server, &key, 1, [1500, 1500]) {
            assert!(e.contains("[2]") || e.contains("rank 2"), "{e}");
        }
        assert!(start.elapsed() < Duration::from_secs(15));
    }

    #[test]
    fn a_rank_that_published_and_died_before_counting_in_is_named() {
        // World of 3: rank 2 published its address and died before counting in (its listener
        // is closed). Every address is in the store, so the silent ranks are none: ranks 0
        // and 1 must still name rank 2, found by the connection its address refuses.
        let key = JobKey::from_token("k");
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let (server, _rank_2) = rank_2_published(&key, 4, closed);
        let start = Instant::now();
        for e in &two_of_three_fail(&server, &key, 4, [1500, 1500]) {
            assert!(e.contains("ranks [2] published an address but refuse connections"), "{e}");
            assert!(!e.contains("did not publish"), "no rank is silent: {e}");
        }
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    }

    #[test]
    fn a_rank_that_gave_up_first_is_not_named_as_dead() {
        // World of 3: rank 2 published its address and stopped before counting in (its
        // listener still takes connections, as a stopped process's kernel does). Rank 0 gives
        // up first (1 s) and closes its listener, having left its reason in the store; rank 1
        // gives up later (3 s) and finds rank 0's address refusing. Rank 0 counted in and
        // failed on its own: rank 1 must not name it as the rank that died.
        let key = JobKey::from_token("k");
        let stopped = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (server, _rank_2) = rank_2_published(&key, 5, stopped.local_addr().unwrap());
        for e in &two_of_three_fail(&server, &key, 5, [1000, 3000]) {
            assert!(!e.contains("refuse connections"), "nobody died: {e}");
            assert!(e.contains("1 rank(s) published an address but did not count in"), "{e}");
        }
        drop(stopped);
    }

    /// A watched connect (a rebuild) fails as soon as the watch reports a member gone, naming
    /// it, long before its connect deadline; and a member whose published address refuses
    /// connections is taken for ended. Unwatched, both wait for the deadline.
    #[test]
    fn a_watched_connect_fails_at_once_on_a_gone_or_refusing_member() {
        use crate::store::{Store, StoreServer, TcpStore};
        use crate::transport::Watch;
        let key = JobKey::from_token("k");
        let server =
            StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), 3, Some(key.clone()))
                .unwrap();
        // Watched connects are rebuilds, which connect the full mesh.
        let cfg = LinkConfig {
            connect_timeout: Duration::from_secs(30),
            lazy: false,
            ..LinkConfig::default()
        };
        // Rank 2 never comes; after 200 ms the watch says it is gone.
        let start = Instant::now();
        let gone = || {
            (start.elapsed() > Duration::from_millis(200)).then(|| (2, "was killed".to_string()))
        };
        let errs: Vec<(String, Duration)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (key, cfg, addr, gone) = (key.clone(), cfg.clone(), server.addr(), &gone);
                    s.spawn(move || {
                        let store = TcpStore::connect(addr, rank, 3, Some(&key), T).unwrap();
                        let id = crate::transport::tcp::JobIdentity { rank, world: 3, job: 2, key };
                        let e = TcpTransport::connect_watched(
                            &id,
                            Arc::new(store),
                            &cfg,
                            Watch::new(gone),
                        )
                        .unwrap_err()
                        .to_string();
                        (e, start.elapsed())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (e, at) in &errs {
            assert!(e.contains("rank 2 of the world being connected is gone"), "{e}");
            assert!(e.contains("connection to peer rank 2 lost"), "typed as a lost peer: {e}");
            assert!(*at < Duration::from_secs(5), "took {at:?}: {e}");
        }
        // Rank 0 published an address whose listener is closed now (its process ended): the
        // watched rank 1 says so at once. (Every rank had arrived: a fresh store.)
        let server =
            StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), 3, Some(key.clone()))
                .unwrap();
        let store = TcpStore::connect(server.addr(), 1, 3, Some(&key), T).unwrap();
        store.add(crate::transport::tcp::UP_KEY, 1).unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        crate::store::set_signed(
            &store,
            &key,
            3,
            &crate::transport::tcp::addr_key(0),
            closed.to_string().as_bytes(),
        )
        .unwrap();
        let id = crate::transport::tcp::JobIdentity { rank: 1, world: 2, job: 3, key: key.clone() };
        let never = || None;
        let start = Instant::now();
        let e = TcpTransport::connect_watched(&id, Arc::new(store), &cfg, Watch::new(&never))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 0 refuses connections") && e.contains("ended"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    }
}

transport_test!(probe_sees_arrived_messages_and_recv_any_takes_them, |kind| {
    // Ranks 1..3 each send rank 0 two messages under one tag (a small one, then one too large
    // to buffer eagerly over TCP, whose header alone has arrived). Rank 0 first probes, then
    // takes all six with `recv_any`: from every sender, in each sender's order, intact.
    let ts = world(kind, 4).unwrap();
    let groups: Vec<crate::Group> = ts.into_iter().map(crate::Group::new).collect();
    let sizes = [100usize, 3 << 20];
    std::thread::scope(|s| {
        for g in &groups {
            s.spawn(move || {
                let me = g.rank();
                if me != 0 {
                    for (k, len) in sizes.iter().enumerate() {
                        g.send(0, 9, &pattern(*len, me, 0, k as u64)).unwrap();
                    }
                    return;
                }
                let t = g.transport();
                let probe_desc = |tag: u32| {
                    let mut d = desc(0, tag, 0);
                    d.tag.group = crate::transport::matcher::P2P_GROUP_BIT;
                    d.fp = Fingerprint::p2p(0);
                    d
                };
                // Nothing is ever sent under tag 8; rank 1's first message shows under 9.
                let start = Instant::now();
                while !t.probe(1, probe_desc(9)).unwrap() {
                    assert!(start.elapsed() < T, "rank 1's message never showed");
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(!t.probe(1, probe_desc(8)).unwrap());
                assert!(t.probe(9, probe_desc(9)).is_err(), "a rank outside the world");
                let mut next = [0usize; 4];
                for _ in 0..6 {
                    let mut buf = vec![0u8; 3 << 20];
                    let (src, got) = g.recv_any(9, &mut buf).unwrap();
                    let k = next[src];
                    next[src] += 1;
                    assert_eq!(got, sizes[k], "from rank {src}");
                    assert!(buf[..got] == pattern(got, src, 0, k as u64), "from rank {src}");
                }
                assert_eq!(next, [0, 2, 2, 2]);
            });
        }
    });
});

transport_test!(recv_any_times_out_naming_the_tag_and_poisons, |kind| {
    let ts = world(kind, 3).unwrap();
    let groups: Vec<crate::Group> = ts.into_iter().map(crate::Group::new).collect();
    let g = &groups[0];
    g.set_timeout(Duration::from_millis(300));
    let start = Instant::now();
    let e = g.recv_any(5, &mut [0u8; 4]).unwrap_err();
    assert!(matches!(e, Error::AnySourceTimeout { tag: 5, .. }), "{e}");
    assert!(e.to_string().contains("tag 5") && e.to_string().contains("any rank"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    assert!(g.check().is_err(), "the group must be poisoned");
});

/// Connecting on first use: a ring opens exactly the two links each rank uses (both sides of a
/// pair may dial at once; one connection is kept), and the rest stay unconnected.
#[test]
fn a_ring_connects_only_its_neighbours() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let n = 6;
        let ts = world(kind, n).unwrap();
        let ts2 = ts.clone();
        run_ranks(ts, |t| {
            let (me, next, prev) = (t.rank(), (t.rank() + 1) % n, (t.rank() + n - 1) % n);
            let mine = pattern(1000, me, next, 5);
            let mut got = vec![0u8; 1000];
            let mut ops = vec![
                Op::Send { peer: next, desc: desc(0, 0, 0), data: &mine },
                Op::Recv { peer: prev, desc: desc(0, 0, 0), buf: &mut got, received: 0 },
            ];
            t.exchange(&mut ops, T).unwrap();
            drop(ops);
            assert!(got == pattern(1000, prev, me, 5));
        });
        for t in &ts2 {
            let me = t.rank();
            let linked: Vec<usize> = (0..n).filter(|p| *p != me && t.is_connected(*p)).collect();
            let mut want = vec![(me + 1) % n, (me + n - 1) % n];
            want.sort_unstable();
            assert_eq!(linked, want, "{kind:?}: rank {me}'s links");
            let far = (me + 3) % n;
            assert_eq!(t.link_kind(far), "unconnected", "{kind:?}: rank {me} to {far}");
        }
    }
}

/// A rank that left before any pair reached it is named by the first rank that needs it, at
/// once: its published address refuses connections.
#[test]
fn a_peer_gone_before_its_first_use_is_named_at_once() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let mut ts = world(kind, 3).unwrap();
        drop(ts.pop()); // rank 2 ends, connected to no one
        let start = Instant::now();
        let e = ts[0].send(2, desc(0, 0, 0), b"hello", T).unwrap_err();
        let took = start.elapsed();
        let msg = e.to_string();
        assert!(msg.contains("rank 2") && msg.contains("ended"), "{kind:?}: {msg}");
        assert!(took < Duration::from_secs(2), "{kind:?}: named after {took:?}");
        // The transport is poisoned, as after any lost peer.
        assert!(ts[0].poisoned().is_some(), "{kind:?}");
    }
}

/// An abort reaches ranks that never connected to the rank that aborted: each poisoned rank
/// passes the abort on over the links it has (0 → 1 → 2 here; 2 never talked to 0).
#[test]
fn an_abort_crosses_ranks_that_never_connected() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let ts = world(kind, 3).unwrap();
        run_ranks(ts, |t| {
            let mut b = [0u8; 4];
            match t.rank() {
                0 => {
                    // Connect 0 → 1 first, then give up.
                    t.send(1, desc(0, 0, 0), b"ping", T).unwrap();
                    std::thread::sleep(Duration::from_millis(200));
                    t.abort("rank 0 gives up on purpose");
                }
                1 => {
                    t.recv(0, desc(0, 0, 0), &mut b, T).unwrap();
                    t.send(2, desc(1, 0, 0), b"pong", T).unwrap();
                    let e = t.recv(0, desc(2, 0, 0), &mut b, T).unwrap_err().to_string();
                    assert!(e.contains("gives up on purpose"), "{kind:?}: {e}");
                }
                _ => {
                    t.recv(1, desc(1, 0, 0), &mut b, T).unwrap();
                    let start = Instant::now();
                    // Waits on rank 1, which will never send: rank 0's abort ends it.
                    let e = t.recv(1, desc(3, 0, 0), &mut b, T).unwrap_err().to_string();
                    assert!(e.contains("gives up on purpose"), "{kind:?}: {e}");
                    assert!(start.elapsed() < Duration::from_secs(3), "{kind:?}");
                    assert!(!t.is_connected(0), "{kind:?}: rank 2 never needed rank 0");
                }
            }
        });
    }
}

/// A rank that starts 2.5 s after the others, with a 1 s dead-peer limit, is waited for (the
/// start-up waits until every rank published its address, up to the connect timeout) and not
/// called dead: no link exists before every rank arrived, and a pair's dead-peer clock starts
/// when it connects. With the full mesh up front or connecting on first use alike.
#[test]
fn a_late_rank_is_waited_for_not_called_dead() {
    use crate::transport::tcp::TcpTransport;
    use crate::transport::LinkConfig;
    for (shm, lazy) in [(false, false), (true, false), (true, true)] {
        let cfg = LinkConfig {
            keepalive_interval: Duration::from_millis(100),
            dead_after: Duration::from_secs(1),
            shm,
            lazy,
            ..LinkConfig::default()
        };
        let (ts, _server) = crate::testing::job(3, &cfg, |id, store, cfg| {
            if id.rank == 2 {
                std::thread::sleep(Duration::from_millis(2500));
            }
            TcpTransport::connect(id, store, cfg)
        })
        .unwrap();
        let ts: Vec<Arc<dyn Transport>> =
            ts.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect();
        run_ranks(ts, |t| exchange_with_everyone(t, 3, 100, 9));
    }
}

/// A rank that failed before any pair reached it tells the rank that dials it later why: alive
/// (the new link carries its abort frame first) or already closed (it left its abort reason in
/// the store as it closed, and the dial that finds its listener closed reads it).
#[test]
fn a_rank_that_failed_before_it_connected_passes_its_abort_on() {
    for kind in [Kind::Tcp, Kind::Shm] {
        for closed in [false, true] {
            let mut ts = world(kind, 3).unwrap();
            ts[1].abort("rank 1 gave up before talking to anyone");
            let keep = if closed {
                drop(ts.remove(1));
                None
            } else {
                Some(ts.remove(1))
            };
            let start = Instant::now();
            let mut b = [0u8; 4];
            let e = ts[0].recv(1, desc(0, 0, 0), &mut b, T).unwrap_err().to_string();
            assert!(
                e.contains("rank 1 gave up before talking to anyone"),
                "{kind:?} closed {closed}: {e}"
            );
            assert!(start.elapsed() < Duration::from_secs(3), "{kind:?} closed {closed}");
            drop(keep);
        }
    }
}

/// A wait on a peer's memory with no link to it (direct reads) learns from the kernel: an
/// ended process is lost 100 ms after it was first seen ended, a stopped one once it stayed stopped for the dead-peer limit
/// since the later of the first look that saw it stopped and the wait's start; either fails
/// the transport as a lost link does, and the peer counts among the lost.
#[test]
fn a_peer_seen_gone_by_the_kernel_fails_the_transport_without_a_link() {
    use crate::window::ProcessState;
    for kind in [Kind::Tcp, Kind::Shm] {
        // Not ended, not stopped long enough: nothing happens, the link stays unconnected.
        let ts = world(kind, 3).unwrap();
        let now = Instant::now();
        assert!(!ts[0].is_connected(2), "{kind:?}");
        ts[0].check_process(2, &ProcessState::Running, now).unwrap();
        let long_ago = now.checked_sub(Duration::from_secs(60)).unwrap();
        // Stopped since long ago, but the wait began now: the limit counts from now.
        ts[0].check_process(2, &ProcessState::Stopped { since: long_ago }, now).unwrap();
        ts[0].check_process(2, &ProcessState::Stopped { since: now }, long_ago).unwrap();
        assert!(ts[0].poisoned().is_none() && ts[0].lost_peers().is_empty(), "{kind:?}");
        // Stopped past the limit (5 s by default) on both counts: a silent peer.
        let e = ts[0]
            .check_process(2, &ProcessState::Stopped { since: long_ago }, long_ago)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2") && e.contains("stopped"), "{kind:?}: {e}");
        assert_eq!(ts[0].lost_peers(), vec![2], "{kind:?}");
        // Ended: lost once the first look that saw it is 100 ms old (not at once: the abort of
        // a rank that failed and exited may still be on its way), named with how it was seen.
        let ts = world(kind, 3).unwrap();
        let how = "process 4242 ended".to_string();
        let fresh = ProcessState::Ended { since: Instant::now(), how: how.clone() };
        ts[1].check_process(0, &fresh, now).unwrap();
        assert!(ts[1].poisoned().is_none(), "{kind:?}");
        let old = ProcessState::Ended { since: long_ago, how };
        let e = ts[1].check_process(0, &old, now).unwrap_err().to_string();
        assert!(e.contains("rank 0") && e.contains("process 4242 ended"), "{kind:?}: {e}");
        assert_eq!(ts[1].lost_peers(), vec![0], "{kind:?}");
        // Later calls report the same failure, whatever they are told.
        assert!(ts[1].check_process(2, &ProcessState::Running, now).is_err(), "{kind:?}");
    }
}
