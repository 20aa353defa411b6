//! The store lost: during rendezvous every waiting rank says the store is gone, at once (not
//! after the connect timeout, and not as a slow rank); once the job's links are connected (TCP
//! connects each pair on first use, looking its address up in the store) the job does not need
//! it, and a rank that dies later is still named by every survivor. On TCP and QUIC.
//!
//! The store runs as its own process (`tt-rank serve-store`, as a launcher serves one), so
//! SIGKILL takes it away the way a crash does: the kernel closes its sockets.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tutti_runtime::auth::JobKey;
use tutti_runtime::store::{Store, TcpStore};
use tutti_tests::{LiveJob, Rendezvous};

const EXE: &str = env!("CARGO_BIN_EXE_tt-rank");
const TOKEN: &str = "store-failure-token";

/// A store process for a job of `n`; returns it and its address.
fn store_process(n: usize) -> (Child, std::net::SocketAddr) {
    let mut c = Command::new(EXE)
        .args(["serve-store", &n.to_string()])
        .env("TUTTI_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the store");
    let out = c.stdout.take().expect("stdout");
    let mut line = String::new();
    std::io::BufReader::new(out).read_line(&mut line).expect("the store's first line");
    let addr = line.trim().strip_prefix("STORE ").unwrap_or_else(|| panic!("store said {line:?}"));
    (c, addr.parse().expect("store address"))
}

fn kill(c: &mut Child) {
    let _ = c.kill();
    let _ = c.wait();
}

fn lost_during_rendezvous(env: &[(&str, &str)]) {
    let n = 4;
    let (mut store, addr) = store_process(n);
    let rdv = Rendezvous::External { url: format!("tcp://{addr}"), token: TOKEN.into() };
    // Rank 0 never starts: ranks 1-3 claim their ranks, then wait in the store for rank 0's
    // job id.
    let mut env = env.to_vec();
    env.push(("TUTTI_CONNECT_TIMEOUT", "60"));
    let mut job = LiveJob::start_ranks(Path::new(EXE), &["connect"], n, &[1, 2, 3], &env, &rdv);
    let probe =
        TcpStore::connect(addr, 0, n, Some(&JobKey::from_token(TOKEN)), Duration::from_secs(30))
            .unwrap();
    let start = Instant::now();
    while !probe.check(&["tutti/rank/1", "tutti/rank/2", "tutti/rank/3"]).unwrap() {
        assert!(start.elapsed() < Duration::from_secs(60), "ranks never reached the store");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(probe);
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    kill(&mut store);
    // 60 s connect timeout: a rank that waits for it has not noticed the store is gone.
    assert!(job.wait_exit(&[0, 1, 2], Duration::from_secs(20)), "a rank hung on a dead store");
    let took = t.elapsed();
    for i in 0..3 {
        let line = job.line(i, "ERR").unwrap_or_else(|| panic!("rank {} printed no error", i + 1));
        assert!(
            line.contains("store") && line.contains(&addr.to_string()),
            "rank {}: {line}",
            i + 1
        );
        assert!(!line.contains("did not publish"), "a lost store blamed on a rank: {line}");
    }
    assert!(took < Duration::from_secs(20), "noticed after {took:?}");
}

fn lost_mid_job(env: &[(&str, &str)]) {
    let n = 4;
    let (mut store, addr) = store_process(n);
    let rdv = Rendezvous::External { url: format!("tcp://{addr}"), token: TOKEN.into() };
    let mut job = LiveJob::start_with(Path::new(EXE), &["loop"], n, env, &rdv);
    assert!(job.wait_all("READY", Duration::from_secs(60)), "job did not start");
    kill(&mut store);
    // The job keeps running its allreduce loop without the store.
    std::thread::sleep(Duration::from_secs(2));
    for r in 0..n {
        assert!(job.line(r, "ERR").is_none(), "rank {r} failed without the store");
        assert!(matches!(job.children[r].try_wait(), Ok(None)), "rank {r} exited");
    }
    // And a rank dying now is still named by every survivor.
    job.signal(2, libc::SIGKILL);
    assert!(job.wait_exit(&[0, 1, 3], Duration::from_secs(20)), "a survivor hung");
    for r in [0, 1, 3] {
        let line = job.line(r, "ERR ").unwrap_or_else(|| panic!("rank {r} printed no error"));
        assert!(line.contains("rank 2"), "rank {r}: {line}");
    }
}

#[test]
fn store_lost_during_rendezvous_tcp() {
    lost_during_rendezvous(&[]);
}

#[test]
fn store_lost_during_rendezvous_quic() {
    lost_during_rendezvous(&[("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")]);
}

#[test]
fn store_lost_mid_job_tcp() {
    lost_mid_job(&[]);
}

#[test]
fn store_lost_mid_job_quic() {
    lost_mid_job(&[("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")]);
}
