//! 1,000 connections dripping one byte a second at a job's store and at every rank's listener,
//! while the job runs exact collectives: the job finishes right, each rank's thread count stays
//! within the handshake cap of where it started, and every drip is closed within its handshake
//! deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use tutti_runtime::auth::JobKey;
use tutti_runtime::store::{Store, TcpStore};
use tutti_tests::{LiveJob, Rendezvous};

const EXE: &str = env!("CARGO_BIN_EXE_tt-rank");

fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0)
}

/// The store a rank was started with, from its environment. Right after the spawn the child may
/// not have reached `exec` yet (its environment is still the test's), so look again until the
/// rank's own environment shows.
fn store_of(pid: u32) -> SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let url = env
            .split(|b| *b == 0)
            .find_map(|v| v.strip_prefix(b"TUTTI_STORE=tcp://"))
            .map(|v| String::from_utf8_lossy(v).into_owned());
        if let Some(url) = url {
            return url.parse().unwrap();
        }
        assert!(Instant::now() < deadline, "rank {pid} never showed TUTTI_STORE");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_thousand_drips_at_the_store_and_every_listener_change_nothing() {
    let n = 3;
    let mut job =
        LiveJob::start_with(Path::new(EXE), &["collectives", "20"], n, &[], &Rendezvous::Store);
    let pids: Vec<u32> = job.children.iter().map(|c| c.id()).collect();
    // The rank listeners' addresses, from the store (each entry ends in its 32-byte tag).
    let store = store_of(pids[0]);
    let key = JobKey::from_token("integration-test-token");
    let client = TcpStore::connect(store, 0, n, Some(&key), Duration::from_secs(30)).unwrap();
    let mut targets = vec![store];
    for r in 0..n {
        let raw = client.get(&format!("tutti/addr/{r}"), Duration::from_secs(60)).unwrap();
        let text = String::from_utf8_lossy(&raw[..raw.len() - 32]).into_owned();
        targets.push(text.parse().unwrap());
    }
    let before: Vec<usize> = pids.iter().map(|p| threads(*p)).collect();
    let start = Instant::now();
    let mut drips: Vec<(usize, TcpStream)> = (0..1000)
        .filter_map(|i| {
            let t = i % targets.len();
            TcpStream::connect(targets[t]).ok().map(|s| (t, s))
        })
        .collect();
    for (_, d) in &drips {
        d.set_nonblocking(true).unwrap();
    }
    let mut peak = before.clone();
    let mut open = drips.len();
    while open > 0 && start.elapsed() < Duration::from_secs(12) {
        for (r, p) in pids.iter().enumerate() {
            peak[r] = peak[r].max(threads(*p));
        }
        open = 0;
        for (_, d) in &mut drips {
            let mut b = [0u8; 64];
            let closed = match d.read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != ErrorKind::WouldBlock,
            };
            if !closed && d.write_all(&[0]).is_ok() {
                open += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(1000));
    }
    let closed_after = start.elapsed();
    let running = pids.iter().all(|p| tutti_tests::alive(*p));
    eprintln!(
        "{} drips; all closed after {closed_after:?}; threads per rank before {before:?}, peak \
         {peak:?}; job still running then: {}",
        drips.len(),
        pids.iter().any(|p| tutti_tests::alive(*p))
    );
    assert!(job.wait_exit(&(0..n).collect::<Vec<_>>(), Duration::from_secs(120)), "job hung");
    for r in 0..n {
        assert!(job.line(r, &format!("OK {r}")).is_some(), "rank {r} did not finish exact");
        // The handshake cap (64) bounds the extra threads; the job's own are a handful (main,
        // the transport's driver, its acceptor).
        assert!(
            peak[r] <= 64 + 8,
            "rank {r}: {} threads at the peak, {} before",
            peak[r],
            before[r]
        );
    }
    assert_eq!(open, 0, "drips still open after {closed_after:?}");
    assert!(running, "the job ended before the drips did: the flood did not overlap it");
    // Closed within the 2 s handshake deadlines (one more second per check round, and the
    // connections refused at once while the cap was full).
    assert!(closed_after < Duration::from_secs(8), "drips closed only after {closed_after:?}");
}
