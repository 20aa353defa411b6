//! Two tutti-run launchers, as on two nodes (here both on 127.0.0.1), form one job: node 0 serves
//! the store on a chosen port, node 1 joins with the same token, global ranks follow the node
//! order, and every rank runs the collectives suite — over TCP and over QUIC.

use std::process::Command;
use std::time::Duration;

use tutti_tests::run_with_deadline;

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// One node's launcher: 2 local ranks of a 2-node job running the collectives suite.
fn node(rank: &str, port: &str, token: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nnodes", "2", "--node-rank", rank, "--nproc", "2"]);
    cmd.args(["--master-addr", "127.0.0.1", "--master-port", port]).env("TUTTI_TOKEN", token);
    cmd.args(["--grace", "1", "--", env!("CARGO_BIN_EXE_tt-rank"), "collectives"]);
    cmd
}

fn two_nodes(transport: &str) {
    let port = free_port().to_string();
    let token = format!("nodes-test-token-{}", std::process::id());
    let node = |rank: &str| {
        let mut cmd = node(rank, &port, &token);
        cmd.env("TUTTI_TRANSPORT", transport);
        // Both "nodes" run on this host: QUIC alone keeps their pairs on QUIC.
        if transport == "quic" {
            cmd.env("TUTTI_SHM", "0");
        }
        cmd
    };
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = ["0", "1"]
            .into_iter()
            .map(|r| {
                let cmd = node(r);
                s.spawn(move || run_with_deadline(cmd, Duration::from_secs(120)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for (n, (out, killed)) in results.iter().enumerate() {
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!killed, "{transport}: node {n} hung\n{text}\n{err}");
        assert!(out.status.success(), "{transport}: node {n} failed\n{text}\n{err}");
        // Node n runs global ranks 2n and 2n+1.
        for r in [2 * n, 2 * n + 1] {
            assert!(text.contains(&format!("[{r}] OK {r}")), "{transport}: node {n}: {text}");
        }
    }
}

#[test]
fn two_launchers_form_one_job_over_tcp() {
    two_nodes("tcp");
}

#[test]
fn two_launchers_form_one_job_over_quic() {
    two_nodes("quic");
}

#[test]
fn a_node_with_the_wrong_token_is_refused_and_the_other_names_the_missing_ranks() {
    let port = free_port().to_string();
    let node = |rank: &str, token: &str| {
        let mut cmd = node(rank, &port, token);
        cmd.env("TUTTI_CONNECT_TIMEOUT", "5");
        cmd
    };
    let results = std::thread::scope(|s| {
        let a = node("0", "the-job-token-0123");
        let b = node("1", "a-stale-token-0123");
        let ha = s.spawn(move || run_with_deadline(a, Duration::from_secs(60)));
        let hb = s.spawn(move || run_with_deadline(b, Duration::from_secs(60)));
        [ha.join().unwrap(), hb.join().unwrap()]
    });
    for (n, (out, killed)) in results.iter().enumerate() {
        assert!(!killed, "node {n} hung");
        assert!(!out.status.success(), "node {n} succeeded with mismatched tokens");
    }
    let all = |n: usize| {
        let (out, _) = &results[n];
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let (zero, one) = (all(0), all(1));
    assert!(
        one.contains("authentication failed: wrong or missing job secret (TUTTI_TOKEN)"),
        "node 1: {one}"
    );
    assert!(zero.contains("ranks [2, 3] did not publish an address"), "node 0: {zero}");
}
