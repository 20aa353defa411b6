//! Every way a job finds itself, end to end across real processes: the README's main path
//! (`MASTER_ADDR`/`MASTER_PORT` only: rank 0 serves the store and generates the job secret),
//! a `file://` store, and a store on IPv6 loopback. Each job runs real collectives with exact
//! data and must finish within its deadline.

use std::path::Path;
use std::time::Duration;

use tutti_tests::{assert_all_ok, spawn_job_with, Rendezvous};

const EXE: &str = env!("CARGO_BIN_EXE_tt-rank");

fn run(scenario: &str, n: usize, extra: &[(&str, &str)], rdv: &Rendezvous) {
    let extra: Vec<(String, String)> =
        extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let (outs, killed) = spawn_job_with(
        Path::new(EXE),
        &[scenario],
        n,
        |_| extra.clone(),
        Duration::from_secs(120),
        rdv,
    );
    assert!(!killed, "{rdv:?} {scenario}: the job ran past its 120 s deadline");
    assert_all_ok(&outs, &format!("{rdv:?} {scenario}"));
}

#[test]
fn master_addr_only_tcp() {
    run("collectives", 3, &[], &Rendezvous::Master);
}

#[test]
fn master_addr_only_quic() {
    run("p2p", 3, &[("TUTTI_TRANSPORT", "quic")], &Rendezvous::Master);
}

#[test]
fn file_store() {
    let dir = std::env::temp_dir().join(format!("tutti-file-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    run("collectives", 3, &[], &Rendezvous::File(dir.clone()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ipv6_loopback_store_and_ranks() {
    // A host without IPv6 loopback must say so explicitly; the test never passes silently.
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        assert!(
            std::env::var_os("TUTTI_TEST_NO_IPV6").is_some(),
            "no IPv6 loopback (::1) on this host: enable it, or set TUTTI_TEST_NO_IPV6=1 to \
             run without this test"
        );
        eprintln!("TUTTI_TEST_NO_IPV6 set and no ::1: the IPv6 test did not run");
        return;
    }
    run("p2p", 3, &[], &Rendezvous::StoreAt("[::1]:0".parse().unwrap()));
}
