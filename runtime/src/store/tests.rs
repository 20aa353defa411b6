//! Tests of the stores: protocol decoding, server and client under load and attack, file store.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::auth::JobKey;

proptest! {
    #[test]
    fn request_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_request(&bytes);
        crate::fuzzing::store_request(&bytes);
        crate::fuzzing::handshake(&bytes);
        crate::fuzzing::wire_header(&bytes);
    }

    #[test]
    fn requests_round_trip(key in "[a-z/0-9]{0,40}", value in proptest::collection::vec(any::<u8>(), 0..100), delta in any::<i64>()) {
        for req in [
            Request::Set { key: key.clone(), value: value.clone() },
            Request::Get { key: key.clone(), timeout_ms: 5 },
            Request::Add { key: key.clone(), delta },
            Request::Delete { key: key.clone() },
            Request::Check { keys: vec![key.clone(), key.clone()] },
            Request::GetAll { keys: vec![key.clone(), key.clone()], timeout_ms: 5 },
        ] {
            let body = postcard::to_stdvec(&req).unwrap();
            prop_assert_eq!(decode_request(&body), Ok(req));
        }
    }
}

fn server(world: usize, key: Option<JobKey>) -> StoreServer {
    StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), world, key).unwrap()
}

#[test]
fn sixty_four_concurrent_clients() {
    let n = 64;
    let key = JobKey::from_token("t");
    let srv = server(n, Some(key.clone()));
    let addr = srv.addr();
    std::thread::scope(|s| {
        for r in 0..n {
            let key = key.clone();
            s.spawn(move || {
                let c = TcpStore::connect(addr, r, n, Some(&key), Duration::from_secs(30)).unwrap();
                c.set(&format!("k{r}"), &[r as u8; 3]).unwrap();
                assert!(c.add("counter", 1).unwrap() >= 1);
                // Everyone waits for everyone's key.
                let other = (r * 7 + 1) % n;
                let v = c.get(&format!("k{other}"), Duration::from_secs(30)).unwrap();
                assert_eq!(v, vec![other as u8; 3]);
            });
        }
    });
    let c = TcpStore::connect(addr, 0, n, Some(&key), Duration::from_secs(5)).unwrap();
    assert_eq!(c.add("counter", 0).unwrap(), n as i64);
    let keys: Vec<String> = (0..n).map(|r| format!("k{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert!(c.check(&refs).unwrap());
    c.wait(&refs, Duration::from_secs(1)).unwrap();
}

#[test]
fn missing_key_times_out_naming_it() {
    let srv = server(1, None);
    let c = TcpStore::connect(srv.addr(), 0, 1, None, Duration::from_secs(5)).unwrap();
    let start = Instant::now();
    let e = c.get("nope", Duration::from_millis(200)).unwrap_err().to_string();
    assert!(e.contains("timed out") && e.contains("nope"), "{e}");
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(!c.check(&["nope"]).unwrap());
    assert!(!c.delete("nope").unwrap());
    c.set("x", b"1").unwrap();
    assert!(c.delete("x").unwrap());
    c.set("s", b"text").unwrap();
    assert!(c.add("s", 1).unwrap_err().to_string().contains("not an integer"));
}

#[test]
fn wait_is_woken_by_a_later_set() {
    let srv = server(2, None);
    let addr = srv.addr();
    std::thread::scope(|s| {
        s.spawn(move || {
            let c = TcpStore::connect(addr, 1, 2, None, Duration::from_secs(5)).unwrap();
            c.wait(&["late"], Duration::from_secs(20)).unwrap();
        });
        std::thread::sleep(Duration::from_millis(100));
        let c = TcpStore::connect(addr, 0, 2, None, Duration::from_secs(5)).unwrap();
        c.set("late", b"").unwrap();
    });
}

#[test]
fn refuses_wrong_world_and_wrong_token() {
    let key = JobKey::from_token("right");
    let srv = server(4, Some(key.clone()));
    let e = TcpStore::connect(srv.addr(), 1, 3, Some(&key), Duration::from_secs(5)).unwrap_err();
    assert!(
        e.to_string().contains("WORLD_SIZE=3") && e.to_string().contains("WORLD_SIZE=4"),
        "{e}"
    );
    let bad = JobKey::from_token("wrong");
    let e = TcpStore::connect(srv.addr(), 1, 4, Some(&bad), Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("TUTTI_TOKEN"), "{e}");
    let e = TcpStore::connect(srv.addr(), 1, 4, None, Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("authentication"), "{e}");
    // Without the key, a wrong world size is not revealed: authentication fails first.
    let e = TcpStore::connect(srv.addr(), 1, 3, Some(&bad), Duration::from_secs(5)).unwrap_err();
    let t = e.to_string();
    assert!(t.contains("authentication") && !t.contains("WORLD_SIZE=4"), "{t}");
}

#[test]
fn junk_on_the_store_port_is_dropped() {
    // The server sends its 16-byte nonce, then drops a connection whose hello is oversized
    // at once and one whose hello never completes after its 5 s hello deadline. "Closed"
    // means end of file or a reset seen well before our own 12 s read timeout, which counts
    // as a failure: a store that leaves junk connections open fails this test.
    let srv = server(1, None);
    for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xff; 64][..], &[0x16, 0x03, 0x01][..]] {
        let mut s = TcpStream::connect(srv.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(12))).unwrap();
        let start = Instant::now();
        let _ = s.write_all(junk);
        let mut b = [0u8; 256];
        let mut outcome = None;
        for _ in 0..10 {
            match s.read(&mut b) {
                Ok(0) => outcome = Some("end of file".to_string()),
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    panic!("junk {junk:?}: connection still open after {:?}", start.elapsed())
                }
                Err(e) => outcome = Some(e.to_string()),
            }
            break;
        }
        assert!(outcome.is_some(), "junk {junk:?}: the server kept talking");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "junk {junk:?}: closed only after {:?} (hello deadline 2 s)",
            start.elapsed()
        );
    }
    let c = TcpStore::connect(srv.addr(), 0, 1, None, Duration::from_secs(5)).unwrap();
    c.set("still", b"fine").unwrap();
    assert_eq!(c.get("still", Duration::from_secs(1)).unwrap(), b"fine");
}

#[test]
fn two_jobs_on_one_master_port_are_reported() {
    let first = server(2, None);
    let e = StoreServer::start(first.addr(), 2, None).unwrap_err().to_string();
    assert!(e.contains("MASTER_PORT in use by another job"), "{e}");
}

#[test]
fn no_server_fails_in_time() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let start = Instant::now();
    let e = TcpStore::connect(addr, 1, 2, None, Duration::from_millis(300)).unwrap_err();
    assert!(e.to_string().contains("rank 0"), "{e}");
    // It retries (backing off up to 200 ms) until its deadline, then gives up; a wide margin
    // above for a loaded machine.
    assert!(start.elapsed() >= Duration::from_millis(100), "gave up early: {e}");
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
}

#[test]
fn file_store() {
    let dir = std::env::temp_dir().join(format!("tutti-fs-{}", std::process::id()));
    let s = FileStore::new(&dir).unwrap();
    s.set("a/b", b"v").unwrap();
    assert_eq!(s.get("a/b", Duration::from_millis(10)).unwrap(), b"v");
    assert!(s.get("zz", Duration::from_millis(30)).unwrap_err().to_string().contains("zz"));
    std::thread::scope(|sc| {
        for _ in 0..8 {
            let s = s.clone();
            sc.spawn(move || {
                for _ in 0..10 {
                    s.add("n", 1).unwrap();
                }
            });
        }
    });
    assert_eq!(s.add("n", 0).unwrap(), 80);
    assert!(s.check(&["a/b", "n"]).unwrap());
    assert!(s.delete("a/b").unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A relay between a client and the real store that passes the hello exchange through and then
/// applies `tamper` to every byte the server sends back (position counted from the first byte
/// after the hello answer).
fn relay(store: SocketAddr, tamper: fn(usize, u8) -> u8) -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let Ok((mut c, _)) = l.accept() else { return };
        let mut up = TcpStream::connect(store).unwrap();
        let mut c2 = c.try_clone().unwrap();
        let mut up2 = up.try_clone().unwrap();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut c2, &mut up2);
        });
        // Nonce (16 bytes), then the length-prefixed hello answer, pass unchanged.
        let mut nonce = [0u8; 16];
        if up.read_exact(&mut nonce).is_err() || c.write_all(&nonce).is_err() {
            return;
        }
        let mut len = [0u8; 4];
        if up.read_exact(&mut len).is_err() {
            return;
        }
        let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
        if up.read_exact(&mut answer).is_err() {
            return;
        }
        let _ = c.write_all(&len);
        let _ = c.write_all(&answer);
        let mut pos = 0usize;
        let mut b = [0u8; 4096];
        while let Ok(k) = up.read(&mut b) {
            if k == 0 {
                break;
            }
            for x in &mut b[..k] {
                *x = tamper(pos, *x);
                pos += 1;
            }
            if c.write_all(&b[..k]).is_err() {
                break;
            }
        }
    });
    addr
}

#[test]
fn a_relay_that_changes_answers_is_caught() {
    let key = JobKey::from_token("relay-test-secret");
    let srv = server(2, Some(key.clone()));
    let honest = TcpStore::connect(srv.addr(), 0, 2, Some(&key), Duration::from_secs(5)).unwrap();
    honest.set("tutti/addr/1", b"127.0.0.1:5000").unwrap();
    // Flip one bit in the value of the first answer, or rewrite the published address in it.
    let tampers: [fn(usize, u8) -> u8; 2] =
        [|pos, b| if pos == 6 { b ^ 1 } else { b }, |_, b| if b == b'5' { b'6' } else { b }];
    for tamper in tampers {
        let via = relay(srv.addr(), tamper);
        let c = TcpStore::connect(via, 1, 2, Some(&key), Duration::from_secs(5)).unwrap();
        let e = c.get("tutti/addr/1", Duration::from_secs(1)).unwrap_err().to_string();
        assert!(e.contains("integrity check failed"), "{e}");
    }
    // Untouched, the same relay path works.
    let via = relay(srv.addr(), |_, b| b);
    let c = TcpStore::connect(via, 1, 2, Some(&key), Duration::from_secs(5)).unwrap();
    assert_eq!(c.get("tutti/addr/1", Duration::from_secs(1)).unwrap(), b"127.0.0.1:5000");
}

#[test]
fn a_store_without_the_secret_is_refused_by_the_client() {
    // A fake store: any key (it does not know ours) and it welcomes everybody.
    let fake = server(2, Some(JobKey::from_token("not-the-job-secret")));
    let key = JobKey::from_token("the-job-secret-1");
    let e = TcpStore::connect(fake.addr(), 1, 2, Some(&key), Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("authentication failed"), "{e}");
    // A store that answers Welcome without a proof (a keyless server) is refused by a client
    // that has a key, naming the problem.
    let keyless = server(2, None);
    let e =
        TcpStore::connect(keyless.addr(), 1, 2, Some(&key), Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("TUTTI_TOKEN"), "{e}");
}

#[test]
fn welcome_without_proof_is_refused() {
    // A fake store speaking the protocol: nonce, then Welcome(None) to any hello.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let forged = [Response::Welcome(None), Response::Welcome(Some([7u8; 32]))];
        for (c, forged) in l.incoming().zip(forged) {
            let Ok(mut c) = c else { continue };
            let _ = c.write_all(&[9u8; 16]);
            let mut len = [0u8; 4];
            let _ = c.read_exact(&mut len);
            let mut hello = vec![0u8; u32::from_le_bytes(len) as usize];
            let _ = c.read_exact(&mut hello);
            let body = postcard::to_stdvec(&forged).unwrap();
            let mut m = (body.len() as u32).to_le_bytes().to_vec();
            m.extend_from_slice(&body);
            let _ = c.write_all(&m);
        }
    });
    let key = JobKey::from_token("the-job-secret-2");
    // A Welcome without a proof, then one with a wrong proof: both refused.
    for _ in 0..2 {
        let e = TcpStore::connect(addr, 1, 2, Some(&key), Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("did not prove"), "{e}");
    }
}

#[test]
fn a_stranger_learns_nothing() {
    let key = JobKey::from_token("stranger-test-secret");
    let srv = server(7, Some(key));
    for (world, guess) in [(7, None), (3, Some(JobKey::from_token("guess")))] {
        let e = TcpStore::connect(srv.addr(), 0, world, guess.as_ref(), Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        assert!(e.contains("authentication failed") && !e.contains("WORLD_SIZE"), "{e}");
    }
}

/// A connection to a store without a secret, through its hello by hand (rank 0 of 1).
fn raw_client(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut nonce = [0u8; 16];
    s.read_exact(&mut nonce).unwrap();
    let hello = StoreHello {
        magic: *b"TUTTISTR",
        version: 3,
        rank: 0,
        world: 1,
        nonce: [1; 16],
        mac: None,
    };
    let body = postcard::to_stdvec(&hello).unwrap();
    let mut m = (body.len() as u32).to_le_bytes().to_vec();
    m.extend_from_slice(&body);
    s.write_all(&m).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(postcard::from_bytes::<Response>(&answer).unwrap(), Response::Welcome(None));
    s
}

#[test]
fn a_message_split_across_pauses_is_read_whole() {
    // The length prefix and body in pieces 300 ms apart (beyond the old 200 ms slice that
    // desynchronised the framing): answered correctly.
    let srv = server(1, None);
    let mut s = raw_client(srv.addr());
    let mut len = [0u8; 4];
    let req = postcard::to_stdvec(&Request::Add { key: "n".into(), delta: 5 }).unwrap();
    let mut m = (req.len() as u32).to_le_bytes().to_vec();
    m.extend_from_slice(&req);
    for piece in [&m[..1], &m[1..3], &m[3..5], &m[5..]] {
        s.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    s.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(postcard::from_bytes::<Response>(&answer).unwrap(), Response::Int(5));
}

#[test]
fn quotas_refuse_and_the_store_stays_healthy() {
    let quota = Quota { keys: 100, bytes: 1 << 20, per_client: 256 << 10 };
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let key = JobKey::from_token("quota-test-secret");
    let srv = StoreServer::serve_with(l, 2, Some(key.clone()), quota).unwrap();
    let hog = TcpStore::connect(srv.addr(), 0, 2, Some(&key), Duration::from_secs(5)).unwrap();
    let big = vec![7u8; 64 << 10];
    let mut stored = 0;
    let e = loop {
        match hog.set(&format!("hog/{stored}"), &big) {
            Ok(()) => stored += 1,
            Err(e) => break e.to_string(),
        }
        assert!(stored < 100, "never refused");
    };
    assert!(e.contains("quota"), "{e}");
    assert_eq!(stored, 3, "256 KiB per client holds three 64 KiB values and their keys");
    // Overwriting its own key stays within its quota; a value over the limit is refused.
    hog.set("hog/0", &big).unwrap();
    let e = hog.set("huge", &vec![0u8; MAX_VALUE + 1]).unwrap_err().to_string();
    assert!(e.contains("too large") || e.contains("exceeds") || e.contains("outside"), "{e}");
    // Deleting gives the quota back.
    assert!(hog.delete("hog/0").unwrap());
    hog.set("hog/again", &big).unwrap();
    // Another client is unaffected.
    let other = TcpStore::connect(srv.addr(), 1, 2, Some(&key), Duration::from_secs(5)).unwrap();
    other.set("fine", b"yes").unwrap();
    assert_eq!(other.get("hog/1", Duration::from_secs(1)).unwrap(), big);
    // The key-count limit, with small values.
    let e = loop {
        match other.add(&format!("n/{stored}"), 1) {
            Ok(_) => stored += 1,
            Err(e) => break e.to_string(),
        }
        assert!(stored < 1000, "never refused");
    };
    assert!(e.contains("100 keys"), "{e}");
}

#[test]
fn dripping_connections_are_bounded_and_closed_in_time() {
    // 300 connections that send a hello one byte per second: at most MAX_UNAUTHENTICATED of
    // them are taken in (they get the server's nonce), the rest are closed at once, the ones
    // taken in are closed at the handshake deadline, and real clients keep working meanwhile.
    let key = JobKey::from_token("drip-test-secret");
    let srv = server(2, Some(key.clone()));
    let start = Instant::now();
    let mut drips: Vec<TcpStream> =
        (0..300).filter_map(|_| TcpStream::connect(srv.addr()).ok()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut taken_in = 0;
    for d in &mut drips {
        d.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut nonce = [0u8; 16];
        if d.read_exact(&mut nonce).is_ok() {
            taken_in += 1;
        }
    }
    assert_eq!(taken_in, MAX_UNAUTHENTICATED, "of 300 drips");
    let c = TcpStore::connect(srv.addr(), 0, 2, Some(&key), Duration::from_secs(10)).unwrap();
    c.set("k", b"v").unwrap();
    // Drip one byte per connection per second until every one is closed.
    let mut open = drips.len();
    while open > 0 && start.elapsed() < Duration::from_secs(8) {
        open = 0;
        for d in &mut drips {
            let _ = d.set_nonblocking(true);
            let mut b = [0u8; 64];
            let closed = match d.read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != ErrorKind::WouldBlock,
            };
            if !closed && d.write_all(&[0]).is_err() {
                continue;
            }
            if !closed {
                open += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(1000));
    }
    assert_eq!(open, 0, "drips still open after {:?}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(6), "took {:?}", start.elapsed());
    assert_eq!(c.get("k", Duration::from_secs(1)).unwrap(), b"v");
}

#[test]
fn file_store_is_private_authenticated_and_cleaned_up() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = std::env::temp_dir().join(format!("tutti-fs-sec-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let key = JobKey::from_token("file-store-secret-0123");
    let fs = FileStore::new(&dir).unwrap();
    let s = SignedStore::new(fs.clone(), key.clone());
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    s.set("tutti/addr/0", b"10.0.0.1:5000").unwrap();
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with('k'))
        .unwrap()
        .path();
    assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
    assert_eq!(s.get("tutti/addr/0", Duration::from_secs(1)).unwrap(), b"10.0.0.1:5000");
    // Changed in place, or planted without the secret: refused, naming the key.
    let mut raw = std::fs::read(&file).unwrap();
    raw[8] ^= 1;
    std::fs::write(&file, &raw).unwrap();
    let e = s.get("tutti/addr/0", Duration::from_secs(1)).unwrap_err().to_string();
    assert!(e.contains("integrity check failed") && e.contains("tutti/addr/0"), "{e}");
    FileStore::new(&dir).unwrap().set("tutti/addr/0", b"10.6.6.6:5000").unwrap();
    let e = s.get("tutti/addr/0", Duration::from_secs(1)).unwrap_err().to_string();
    assert!(e.contains("integrity check failed"), "{e}");
    // A directory others can enter is refused.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = FileStore::new(&dir).unwrap_err().to_string();
    assert!(e.contains("chmod 700"), "{e}");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // The last of the job's ranks to leave removes the directory.
    let leavers: Vec<_> = (0..3).map(|_| fs.leaver(3)).collect();
    let mut leavers = leavers.into_iter();
    drop(leavers.next());
    drop(leavers.next());
    assert!(dir.exists(), "removed before the last rank left");
    drop(leavers.next());
    assert!(!dir.exists(), "left behind after a clean end");
}

#[test]
fn get_all_waits_for_the_last_key_and_names_a_missing_one() {
    let key = JobKey::from_token("t");
    let srv = server(2, Some(key.clone()));
    let a = TcpStore::connect(srv.addr(), 0, 2, Some(&key), Duration::from_secs(5)).unwrap();
    let b = TcpStore::connect(srv.addr(), 1, 2, Some(&key), Duration::from_secs(5)).unwrap();
    a.set("x/0", b"zero").unwrap();
    a.set("x/1", b"one").unwrap();
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            b.set("x/2", b"two").unwrap();
        });
        let v = a.get_all(&["x/2", "x/0", "x/1"], Duration::from_secs(10)).unwrap();
        assert_eq!(v, [b"two".to_vec(), b"zero".to_vec(), b"one".to_vec()]);
    });
    assert!(t.elapsed() >= Duration::from_millis(190), "answered before the last key was set");
    match a.get_all(&["x/0", "x/9", "x/1"], Duration::from_millis(200)) {
        Err(Error::StoreTimeout { key, .. }) => assert_eq!(key, "x/9"),
        other => panic!("{other:?}"),
    }
    // More keys than one request carries: asked in several, answered in order.
    let keys: Vec<String> = (0..3000).map(|i| format!("many/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        b.set(k, i.to_string().as_bytes()).unwrap();
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let v = a.get_all(&refs, Duration::from_secs(5)).unwrap();
    assert!(v.iter().enumerate().all(|(i, x)| *x == i.to_string().into_bytes()));
    // Values too large for one answer together: the client asks again in halves.
    let big: Vec<String> = (0..4).map(|i| format!("big/{i}")).collect();
    for (i, k) in big.iter().enumerate() {
        b.set(k, &vec![i as u8; 100 << 10]).unwrap();
    }
    let refs: Vec<&str> = big.iter().map(String::as_str).collect();
    let v = a.get_all(&refs, Duration::from_secs(5)).unwrap();
    assert!(v.iter().enumerate().all(|(i, x)| *x == vec![i as u8; 100 << 10]));
    // The store still answers the waiting client's partner after all this.
    assert_eq!(b.get("x/1", Duration::from_secs(1)).unwrap(), b"one");
}

/// The store's threads alive in this process now (named `tutti-store…`; tests running beside
/// this one in the same process have their own threads, which this leaves out).
fn threads() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return 0 };
    dir.filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.trim_end().starts_with("tutti-store"))
        })
        .count()
}

#[test]
fn one_thread_serves_every_client() {
    // As many clients as the descriptor limit allows (up to 1,000; the test raises its soft
    // limit to the hard one), all connected at once: the server's thread count does not grow
    // with them, and each is answered.
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    let n = ((lim.rlim_cur as usize).saturating_sub(200) / 2).min(1000);
    assert!(n >= 300, "descriptor limit {} too low for the test", lim.rlim_cur);
    let key = JobKey::from_token("t");
    let srv = server(n, Some(key.clone()));
    let before = threads();
    let clients: Vec<TcpStore> = (0..n)
        .map(|r| TcpStore::connect(srv.addr(), r, n, Some(&key), Duration::from_secs(10)).unwrap())
        .collect();
    for (r, c) in clients.iter().enumerate() {
        c.set(&format!("addr/{r}"), r.to_string().as_bytes()).unwrap();
    }
    // Store tests beside this one in the same process may start a few servers: 8 to spare, far
    // below the one thread per client a threaded server would need.
    let after = threads();
    assert!(after <= before + 8, "{after} threads with {n} clients (before {before})");
    let keys: Vec<String> = (0..n).map(|r| format!("addr/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let v = clients[n - 1].get_all(&refs, Duration::from_secs(5)).unwrap();
    assert!(v.iter().enumerate().all(|(r, x)| *x == r.to_string().into_bytes()));
}

#[test]
fn many_requests_sent_at_once_are_answered_in_order() {
    // A client that does not wait for its answers (20,000 adds in one write): answered one by
    // one, in order, and the server stays healthy (no recursion or buffering per request).
    let srv = server(1, None);
    let mut s = raw_client(srv.addr());
    let mut len = [0u8; 4];
    let n = 20_000;
    let req = postcard::to_stdvec(&Request::Add { key: "n".into(), delta: 1 }).unwrap();
    let mut all = Vec::new();
    for _ in 0..n {
        all.extend_from_slice(&(req.len() as u32).to_le_bytes());
        all.extend_from_slice(&req);
    }
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&all).unwrap());
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for i in 1..=n {
        s.read_exact(&mut len).unwrap();
        let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(postcard::from_bytes::<Response>(&answer).unwrap(), Response::Int(i));
    }
    writer.join().unwrap();
    let c = TcpStore::connect(srv.addr(), 0, 1, None, Duration::from_secs(5)).unwrap();
    assert_eq!(c.add("n", 0).unwrap(), n);
}
