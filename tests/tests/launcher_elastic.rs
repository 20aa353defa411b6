//! `tutti-run --elastic`: a killed rank does not stop the job; with `--max-restarts` a
//! replacement joins and the job ends whole, every rank with the same weights; when the job
//! cannot go on (half the world lost), it exits non-zero, naming the ranks. The program is
//! the `elastic_dp` example, which `cargo test --workspace` builds.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn example() -> PathBuf {
    tutti_tests::example("elastic_dp")
}

/// The pids of `parent`'s child processes.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The fields after the command (which may hold spaces) close with ')'.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        if rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

/// Start the launcher; once `n` ranks run, kill `kill` of them (after `delay`); wait for the
/// end. Returns (exit code, stdout, stderr).
fn run(args: &[&str], n: usize, kill: usize, delay: Duration) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(args)
        .args(["--nproc", &n.to_string(), "--grace", "1", "--"])
        .arg(example())
        .args(["--steps", "250", "--step-ms", "10"])
        .env("TUTTI_DEAD_AFTER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("tutti-run");
    let t = Instant::now();
    while children_of(child.id()).len() < n && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(delay);
    // Lost together: all stopped first, so none can notice another's death (and check in to
    // the survivors' agreement) between this thread's signals, however it is scheduled.
    let victims: Vec<u32> = children_of(child.id()).into_iter().take(kill).collect();
    for sig in [libc::SIGSTOP, libc::SIGKILL] {
        for pid in &victims {
            // SAFETY: signalling a process this test's launcher started.
            unsafe { libc::kill(*pid as i32, sig) };
        }
    }
    let start = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("tutti-run --elastic hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_replacement_joins_and_the_job_ends_whole() {
    let (code, out, err) =
        run(&["--elastic", "--max-restarts", "1"], 4, 1, Duration::from_millis(1500));
    assert_eq!(code, Some(0), "{err}\n{out}");
    assert!(
        err.contains("was killed by signal 9") && err.contains("which go on without it"),
        "{err}"
    );
    assert!(err.contains("started a replacement for rank"), "{err}");
    assert!(out.contains("RECOVERED") && out.contains("JOINED"), "{out}");
    let done: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_once("DONE ").map(|(_, d)| d))
        .map(|d| d.split(" schedule ").next().unwrap_or_default())
        .collect();
    assert_eq!(done.len(), 4, "{out}");
    assert!(done.windows(2).all(|w| w[0] == w[1]), "the ranks' weights differ: {done:?}");
}

#[test]
fn half_the_world_lost_fails_the_job_with_the_usual_line() {
    let (code, out, err) = run(&["--elastic"], 4, 2, Duration::from_millis(1500));
    assert_eq!(code, Some(1), "{err}\n{out}");
    assert!(err.contains("no rank is left, the job failed"), "{err}");
    assert!(out.contains("cut off") && out.contains("not a strict majority"), "{out}");
}
