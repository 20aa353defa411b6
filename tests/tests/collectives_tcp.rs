//! Every collective across real processes on one host, started through tutti-run: over shared
//! memory (the default between ranks of one host) at N = 1 to 8, over TCP alone
//! (`TUTTI_SHM=0`), over QUIC alone, and in a QUIC job (whose ranks of one host use shared
//! memory); each rank says how its links went, and the test checks it.

use std::process::Command;
use std::time::Duration;

use tutti_tests::run_with_deadline;

fn job(n: usize) {
    job_with(n, &[], "shm");
}

/// Run the collectives on `n` ranks with `env`; every link must be of `kind`.
fn job_with(n: usize, env: &[(&str, &str)], kind: &str) {
    job_of("collectives", n, env, kind);
}

/// Run `tt-rank scenario` on `n` ranks with `env`; every link must be of `kind`.
fn job_of(scenario: &str, n: usize, env: &[(&str, &str)], kind: &str) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.envs(env.iter().copied());
    cmd.args(["--nproc", &n.to_string(), "--", env!("CARGO_BIN_EXE_tt-rank"), scenario]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!killed, "n={n}: job did not finish in time:\n{text}");
    assert!(out.status.success(), "n={n}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..n {
        assert!(
            text.contains(&format!("[{r}] OK {r}")),
            "n={n}: rank {r} did not report OK:\n{text}"
        );
        let links = text
            .lines()
            .find_map(|l| l.split_once(&format!("LINKS {r} ")).map(|x| x.1))
            .unwrap_or_else(|| panic!("n={n}: rank {r} did not report its links:\n{text}"));
        for (p, k) in links.trim().split(',').enumerate() {
            let want = if p == r { "-" } else { kind };
            assert_eq!(k, want, "n={n}: rank {r}'s link to rank {p}");
        }
    }
}

#[test]
fn collectives_one_rank() {
    job(1);
}

#[test]
fn collectives_two_ranks() {
    job(2);
}

#[test]
fn collectives_three_ranks() {
    job(3);
}

#[test]
fn collectives_four_ranks() {
    job(4);
}

#[test]
fn collectives_five_to_seven_ranks() {
    for n in 5..8 {
        job(n);
    }
}

#[test]
fn collectives_eight_ranks() {
    job(8);
}

/// Every collective with every algorithm that can run, every dtype and op, exact, at 1 to 8
/// ranks that are processes of one host (so over shared memory, direct reads included): the
/// grid the collectives' own tests run on threads (`collectives/tests/common/grid.rs`).
#[test]
fn every_collective_algorithm_and_dtype_as_processes_at_one_to_eight_ranks() {
    for n in 1..=8 {
        job_of("grid", n, &[], "shm");
    }
}

#[test]
fn collectives_over_tcp_alone() {
    for n in [2, 4] {
        job_with(n, &[("TUTTI_SHM", "0")], "tcp");
    }
}

#[test]
fn collectives_three_ranks_over_quic() {
    job_with(3, &[("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")], "quic");
}

/// A QUIC job's ranks of one host link through shared memory, as a TCP job's do (QUIC is for
/// the pairs on different hosts: the namespace cluster's tests run that mix).
#[test]
fn collectives_three_ranks_of_a_quic_job_on_one_host() {
    job_with(3, &[("TUTTI_TRANSPORT", "quic")], "shm");
}
