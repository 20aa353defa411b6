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

/// A finished process's status, stdout and stderr, for an assertion message.
pub fn describe(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// How the ranks of a test job find each other.
#[derive(Debug, Clone)]
pub enum Rendezvous {
    /// A token-authenticated store served by the test process on 127.0.0.1 (`TUTTI_STORE`).
    Store,
    /// As `Store`, served on this address (port 0: from the OS), e.g. `[::1]:0`.
    StoreAt(std::net::SocketAddr),
    /// The README's path: `MASTER_ADDR=127.0.0.1` and a free `MASTER_PORT`; rank 0 serves the
    /// store and generates the job secret (no `TUTTI_STORE`, no `TUTTI_TOKEN`).
    Master,
    /// A shared directory (`TUTTI_STORE=file:///dir`), no token.
    File(std::path::PathBuf),
    /// A store served elsewhere (`TUTTI_STORE=url`) for a job with this token.
    External {
        /// `tcp://host:port`.
        url: String,
        /// `TUTTI_TOKEN`.
        token: String,
    },
}

/// What the ranks of a job are told, and the store the test serves for them (if any).
struct Setup {
    env: Vec<(String, String)>,
    store: Option<tutti_runtime::store::StoreServer>,
}

fn setup(rdv: &Rendezvous, n: usize) -> Setup {
    use tutti_runtime::auth::JobKey;
    use tutti_runtime::store::StoreServer;
    let served = |addr: std::net::SocketAddr| {
        let token = "integration-test-token";
        let store =
            StoreServer::start(addr, n, Some(JobKey::from_token(token))).expect("store server");
        let url = match store.addr() {
            std::net::SocketAddr::V6(a) => format!("tcp://[{}]:{}", a.ip(), a.port()),
            a => format!("tcp://{a}"),
        };
        Setup {
            env: vec![("TUTTI_STORE".into(), url), ("TUTTI_TOKEN".into(), token.into())],
            store: Some(store),
        }
    };
    match rdv {
        Rendezvous::Store => served("127.0.0.1:0".parse().expect("addr")),
        Rendezvous::StoreAt(a) => served(*a),
        Rendezvous::Master => {
            // A port the OS just handed out and released: rank 0 binds it again at once.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            Setup {
                env: vec![
                    ("MASTER_ADDR".into(), "127.0.0.1".into()),
                    ("MASTER_PORT".into(), port.to_string()),
                ],
                store: None,
            }
        }
        Rendezvous::External { url, token } => Setup {
            env: vec![("TUTTI_STORE".into(), url.clone()), ("TUTTI_TOKEN".into(), token.clone())],
            store: None,
        },
        Rendezvous::File(dir) => Setup {
            env: vec![("TUTTI_STORE".into(), format!("file://{}", dir.display()))],
            store: None,
        },
    }
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
    spawn_job_with(exe, args, n, env, limit, &Rendezvous::Store).0
}

/// As [`spawn_job`], rendezvousing as `rdv` says. Also returns whether the deadline ran out
/// (then the ranks were killed).
pub fn spawn_job_with(
    exe: &Path,
    args: &[&str],
    n: usize,
    env: impl Fn(usize) -> Vec<(String, String)>,
    limit: Duration,
    rdv: &Rendezvous,
) -> (Vec<Output>, bool) {
    let setup = setup(rdv, n);
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(exe);
            c.args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("TUTTI_CONNECT_TIMEOUT", "30");
            for (k, v) in setup.env.iter().cloned().chain(env(r)) {
                c.env(k, v);
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn rank")
        })
        .collect();
    let start = Instant::now();
    let mut children = children;
    let mut killed = false;
    loop {
        if children.iter_mut().all(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            break;
        }
        if start.elapsed() > limit {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(setup.store);
    (children.into_iter().map(|c| c.wait_with_output().expect("wait")).collect(), killed)
}

/// Assert that every rank exited 0 after printing `OK <rank>`; `what` starts each message.
pub fn assert_all_ok(outs: &[Output], what: &str) {
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && text.contains(&format!("OK {r}")),
            "{what}: rank {r}: {text}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
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
    _store: Option<tutti_runtime::store::StoreServer>,
}

impl LiveJob {
    /// Start `n` ranks of `exe args…` (store served here, ports from the OS).
    pub fn start(exe: &Path, args: &[&str], n: usize, env: &[(&str, &str)]) -> LiveJob {
        LiveJob::start_with(exe, args, n, env, &Rendezvous::Store)
    }

    /// Start `n` ranks of `exe args…` rendezvousing as `rdv` says.
    pub fn start_with(
        exe: &Path,
        args: &[&str],
        n: usize,
        env: &[(&str, &str)],
        rdv: &Rendezvous,
    ) -> LiveJob {
        LiveJob::start_ranks(exe, args, n, &(0..n).collect::<Vec<_>>(), env, rdv)
    }

    /// Start only the ranks in `which` of an `n`-rank job (the others never start, so the job
    /// stays in rendezvous); `children[i]` is then rank `which[i]`.
    pub fn start_ranks(
        exe: &Path,
        args: &[&str],
        n: usize,
        which: &[usize],
        env: &[(&str, &str)],
        rdv: &Rendezvous,
    ) -> LiveJob {
        use std::io::BufRead;
        let setup = setup(rdv, n);
        let mut children = Vec::new();
        let mut lines = Vec::new();
        let mut eofs = Vec::new();
        for &r in which {
            let mut c = Command::new(exe);
            c.args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            for (k, v) in &setup.env {
                c.env(k, v);
            }
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
        LiveJob { children, lines, eof: eofs, _store: setup.store }
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

/// An example of this workspace, built by `cargo test --workspace` next to the test binaries
/// (`target/<profile>/examples/<name>`).
///
/// # Panics
/// When it is missing, saying how to build it.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo test --workspace` (or `cargo build --example \
         {name}` in this profile)",
        path.display()
    );
    path
}
