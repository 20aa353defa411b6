//! Every collective over TCP across real processes at N = 2, 3, 4, 8, started through tutti-run.

use std::process::Command;
use std::time::Duration;

use tutti_tests::run_with_deadline;

fn job(n: usize) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nproc", &n.to_string(), "--", env!("CARGO_BIN_EXE_tt-rank"), "collectives"]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!killed, "n={n}: job did not finish in time:\n{text}");
    assert!(out.status.success(), "n={n}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..n {
        assert!(
            text.contains(&format!("[{r}] OK {r}")),
            "n={n}: rank {r} did not report OK:\n{text}"
        );
    }
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
fn collectives_eight_ranks() {
    job(8);
}

#[test]
fn collectives_three_ranks_over_quic() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.env("TUTTI_TRANSPORT", "quic");
    cmd.args(["--nproc", "3", "--", env!("CARGO_BIN_EXE_tt-rank"), "collectives"]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!killed && out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..3 {
        assert!(text.contains(&format!("[{r}] OK {r}")), "{text}");
    }
}
