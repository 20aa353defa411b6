//! TCP across real OS processes on 127.0.0.1: the store's port comes from the OS and every
//! rank's listening port travels through it, so these tests run in parallel without collisions.

use std::path::Path;
use std::time::Duration;

use tutti_tests::spawn_job;

fn ok_all(outs: &[std::process::Output]) {
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && text.contains(&format!("OK {r}")),
            "rank {r}: {text}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn p2p_ring_and_tags_across_processes() {
    for n in [2, 3, 4] {
        let outs = spawn_job(
            Path::new(env!("CARGO_BIN_EXE_tt-rank")),
            &["p2p"],
            n,
            |_| vec![],
            Duration::from_secs(120),
        );
        ok_all(&outs);
    }
}

#[test]
fn ipv6_loopback_store_and_ranks() {
    // Only where the host has IPv6 loopback.
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("no IPv6 loopback here; skipping");
        return;
    }
    use tutti_runtime::auth::JobKey;
    use tutti_runtime::rendezvous::StoreServer;
    let n = 3;
    let store =
        StoreServer::start("[::1]:0".parse().unwrap(), n, Some(JobKey::from_token("v6"))).unwrap();
    let url = format!("tcp://[::1]:{}", store.addr().port());
    let children: Vec<_> = (0..n)
        .map(|r| {
            std::process::Command::new(env!("CARGO_BIN_EXE_tt-rank"))
                .arg("p2p")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("TUTTI_STORE", &url)
                .env("TUTTI_TOKEN", "v6")
                .env("TUTTI_CONNECT_TIMEOUT", "30")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    ok_all(&outs);
}
