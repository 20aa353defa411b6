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

/// A job whose ranks this test started and can signal, with their output lines streamed.
pub struct LiveJob {
    /// The rank processes, in rank order.
    pub children: Vec<std::process::Child>,
    /// Lines printed by each rank so far.
    pub lines: Vec<std::sync::Arc<std::sync::Mutex<Vec<String>>>>,
    /// Set when a rank's output reached its end (all its lines are in `lines`).
    eof: Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    _store: tutti_runtime::rendezvous::StoreServer,
}

impl LiveJob {
    /// Start `n` ranks of `exe args…` (store served here, ports from the OS).
    pub fn start(exe: &Path, args: &[&str], n: usize, env: &[(&str, &str)]) -> LiveJob {
        use std::io::BufRead;
        use tutti_runtime::auth::JobKey;
        use tutti_runtime::rendezvous::StoreServer;
        let token = "live-job-token";
        let store = StoreServer::start(
            "127.0.0.1:0".parse().expect("addr"),
            n,
            Some(JobKey::from_token(token)),
        )
        .expect("store");
        let url = format!("tcp://{}", store.addr());
        let mut children = Vec::new();
        let mut lines = Vec::new();
        let mut eofs = Vec::new();
        for r in 0..n {
            let mut c = Command::new(exe);
            c.args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("TUTTI_STORE", &url)
                .env("TUTTI_TOKEN", token)
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            for (k, v) in env {
                c.env(k, v);
            }
            let mut child = c.spawn().expect("spawn rank");
            let out = child.stdout.take().expect("stdout");
            let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let b2 = buf.clone();
            let eof = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let e2 = eof.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    b2.lock().unwrap_or_else(|p| p.into_inner()).push(line);
                }
                e2.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            children.push(child);
            lines.push(buf);
            eofs.push(eof);
        }
        LiveJob { children, lines, eof: eofs, _store: store }
    }

    /// Wait until every rank printed a line starting with `prefix`, up to `limit`.
    pub fn wait_all(&self, prefix: &str, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if self.lines.iter().all(|l| {
                l.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|x| x.starts_with(prefix))
            }) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// The first line of rank `r` starting with `prefix`.
    pub fn line(&self, r: usize, prefix: &str) -> Option<String> {
        self.lines[r]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|x| x.starts_with(prefix))
            .cloned()
    }

    /// Send `sig` to rank `r`.
    pub fn signal(&self, r: usize, sig: i32) {
        // SAFETY: signalling a child this job started.
        unsafe { libc::kill(self.children[r].id() as i32, sig) };
    }

    /// Wait for the ranks in `which` to exit, up to `limit`; true if all did. Their output is
    /// then read to the end (a process can exit before its last line has been read from the
    /// pipe).
    pub fn wait_exit(&mut self, which: &[usize], limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            if which.iter().all(|r| {
                matches!(self.children[*r].try_wait(), Ok(Some(_)))
                    && self.eof[*r].load(std::sync::atomic::Ordering::SeqCst)
            }) {
                return true;
            }
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for LiveJob {
    fn drop(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}
