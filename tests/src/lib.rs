//! Helpers for the integration tests: run a program as N real processes on 127.0.0.1, with a
//! deadline, and collect what each printed.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Run `cmd` to completion, killing it after `limit`. Returns its output and whether it was
/// killed.
pub fn run_with_deadline(mut cmd: Command, limit: Duration) -> (Output, bool) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let start = Instant::now();
    let mut killed = false;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().expect("wait"), killed)
}

/// Start `n` processes of `exe args…` as ranks of one job whose store this test process serves
/// (`TUTTI_STORE`, port from the OS), with `env(rank)` extra variables; wait up to `limit`.
/// Returns each rank's output in rank order.
pub fn spawn_job(
    exe: &Path,
    args: &[&str],
    n: usize,
    env: impl Fn(usize) -> Vec<(String, String)>,
    limit: Duration,
) -> Vec<Output> {
    use tutti_runtime::auth::JobKey;
    use tutti_runtime::rendezvous::StoreServer;
    let token = "integration-test-token";
    let store = StoreServer::start(
        "127.0.0.1:0".parse().expect("addr"),
        n,
        Some(JobKey::from_token(token)),
    )
    .expect("store");
    let url = format!("tcp://{}", store.addr());
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(exe);
            c.args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("TUTTI_STORE", &url)
                .env("TUTTI_TOKEN", token)
                .env("TUTTI_CONNECT_TIMEOUT", "30");
            for (k, v) in env(r) {
                c.env(k, v);
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn rank")
        })
        .collect();
    let start = Instant::now();
    let mut children = children;
    loop {
        if children.iter_mut().all(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            break;
        }
        if start.elapsed() > limit {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children.into_iter().map(|c| c.wait_with_output().expect("wait")).collect()
}

/// True when process `pid` still exists (and is not a zombie we could reap).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s.split_whitespace().nth(2).is_none_or(|st| st != "Z"),
        Err(_) => false,
    }
}
