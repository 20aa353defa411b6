//! tutti-run stops the job when a rank fails, names it, and leaves no process behind.

use std::process::Command;
use std::time::{Duration, Instant};

use tutti_tests::{alive, run_with_deadline};

fn pids(text: &str) -> Vec<u32> {
    text.lines()
        .filter_map(|l| l.split("PID ").nth(1))
        .filter_map(|p| p.trim().parse().ok())
        .collect()
}

/// Read the children's `PID n` lines from the launcher's output until `n` pids are known.
fn read_pids(child: &mut std::process::Child, n: usize) -> Vec<u32> {
    use std::io::BufRead;
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut found = Vec::new();
    let mut line = String::new();
    while found.len() < n {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            break;
        }
        found.extend(pids(&line));
    }
    found
}

fn assert_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|p| alive(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(left.is_empty(), "processes survived: {left:?}");
}

#[test]
fn a_child_exiting_3_stops_the_job_and_is_named() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args([
        "--nproc",
        "4",
        "--grace",
        "1",
        "--",
        env!("CARGO_BIN_EXE_tt-rank"),
        "exit",
        "2",
        "3",
    ]);
    let start = Instant::now();
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(!killed, "tutti-run hung");
    assert!(start.elapsed() < Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 2 exited with status 3"), "{err}");
    assert_gone(&pids(&String::from_utf8_lossy(&out.stdout)));
}

#[test]
fn a_child_killed_by_sigkill_is_named() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args([
        "--nproc",
        "3",
        "--grace",
        "1",
        "--",
        env!("CARGO_BIN_EXE_tt-rank"),
        "killself",
        "1",
    ]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(!killed, "tutti-run hung");
    assert_eq!(out.status.code(), Some(128 + 9));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1 was killed by signal 9 (SIGKILL)"), "{err}");
    assert_gone(&pids(&String::from_utf8_lossy(&out.stdout)));
}

#[test]
fn killing_tutti_run_takes_the_children_with_it() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tt-run"))
        .args(["--nproc", "3", "--", env!("CARGO_BIN_EXE_tt-rank"), "sleep"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read the children's pids as they start.
    let found = read_pids(&mut child, 3);
    assert_eq!(found.len(), 3);
    // SIGKILL the launcher: PR_SET_PDEATHSIG takes the children down.
    child.kill().unwrap();
    let _ = child.wait();
    assert_gone(&found);
}

#[test]
fn sigint_stops_every_child() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tt-run"))
        .args(["--nproc", "2", "--grace", "1", "--", env!("CARGO_BIN_EXE_tt-rank"), "sleep"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let found = read_pids(&mut child, 2);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(130));
    assert_gone(&found);
}

#[test]
fn output_is_prefixed_and_teed_to_per_rank_logs() {
    let dir = std::env::temp_dir().join(format!("tutti-run-logs-{}", std::process::id()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nproc", "2", "--log-dir"]).arg(&dir).args([
        "--",
        env!("CARGO_BIN_EXE_tt-rank"),
        "connect",
    ]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(!killed && out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[0] OK 0") && text.contains("[1] OK 1"), "{text}");
    for r in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("rank-{r}.log"))).unwrap();
        assert!(log.contains(&format!("[{r}] OK {r}")), "{log}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank whose process ends while its sockets live on (a forked child holds them): no reset,
/// no unreachable port, keep-alives answered by the kernel. Only tutti-run's notice can tell the
/// survivors, and it does: they fail at once naming the rank, over TCP and QUIC, exit by
/// themselves, and the launcher exits with the dead rank's status.
#[test]
fn survivors_name_a_rank_that_died_leaving_its_sockets_open() {
    for transport in ["tcp", "quic"] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
        cmd.args([
            "--nproc",
            "3",
            "--grace",
            "5",
            "--",
            env!("CARGO_BIN_EXE_tt-rank"),
            "orphan",
            "1",
        ])
        .env("TUTTI_TRANSPORT", transport)
        // QUIC alone: a QUIC job's ranks of one host otherwise link through shared memory.
        .env("TUTTI_SHM", if transport == "quic" { "0" } else { "1" })
        .env("TUTTI_DEAD_AFTER", "60")
        .env("TUTTI_TIMEOUT", "60");
        let start = Instant::now();
        let (out, killed) = run_with_deadline(cmd, Duration::from_secs(120));
        let took = start.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        for orphan in stdout.lines().filter_map(|l| l.strip_prefix("ORPHAN ")) {
            if let Ok(pid) = orphan.trim().parse::<i32>() {
                // SAFETY: signalling the test's own grandchild.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        assert!(!killed, "{transport}: tutti-run hung\n{stdout}\n{stderr}");
        assert_eq!(out.status.code(), Some(3), "{transport}: {stdout}\n{stderr}");
        assert!(stderr.contains("rank 1 exited with status 3"), "{transport}: {stderr}");
        let errs: Vec<&str> = stdout.lines().filter(|l| l.contains("] ERR ")).collect();
        assert_eq!(errs.len(), 2, "{transport}: both survivors report\n{stdout}\n{stderr}");
        // Each names rank 1 and how it ended: from its own notice ("connection to peer rank 1
        // lost … tutti-run reports that rank 1 exited with status 3") or, when the other
        // survivor's abort frame arrives first, from that ("rank 0 lost its connection to rank 1
        // (tutti-run reports …)").
        for e in &errs {
            assert!(e.contains("rank 1 exited with status 3"), "{transport}: {e}");
        }
        // Dead-after and the operation timeout are both 60 s: well under them means the notice.
        assert!(took < Duration::from_secs(30), "{transport}: took {took:?}\n{stdout}");
    }
}

/// A rank forks a process that keeps the job's output pipe open and outlives it: the launcher
/// kills it when the job ends (it is in the rank's process group) instead of waiting on the pipe.
#[test]
fn a_grandchild_holding_the_output_neither_hangs_the_launcher_nor_survives() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nproc", "2", "--", env!("CARGO_BIN_EXE_tt-rank"), "grandchild"]);
    let start = Instant::now();
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(50));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let grandchildren: Vec<u32> = stdout
        .lines()
        .filter_map(|l| l.split("GRANDCHILD ").nth(1))
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    assert!(!killed, "tutti-run waited on its grandchildren's pipe\n{stdout}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert_eq!(grandchildren.len(), 2, "{stdout}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("left processes running"), "{err}");
    assert_gone(&grandchildren);
}
