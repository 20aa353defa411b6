//! Starting and supervising the local ranks of a job (`tutti-run`, `collbench --np`).
//!
//! Every child gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `TUTTI_STORE` and `TUTTI_TOKEN`. On node 0 the launcher itself serves the
//! rendezvous store on the master port (bound before any child starts, so there is no race for
//! the port). Children die with the launcher (`PR_SET_PDEATHSIG`); when one child fails, the
//! others get SIGTERM, then SIGKILL after a grace period, and the launcher exits non-zero with
//! one line naming the rank.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tutti_runtime::auth::{self, JobKey};
use tutti_runtime::store::StoreServer;

/// Set by the SIGINT/SIGTERM handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// A job to start on this node.
#[derive(Debug, Clone)]
pub struct Job {
    /// Processes on this node.
    pub nproc: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Address of node 0 (where the store runs).
    pub master_addr: String,
    /// Store port on node 0; 0 picks a free one (single node only).
    pub master_port: u16,
    /// Job token; `None` generates a fresh one (single node) .
    pub token: Option<String>,
    /// Program and arguments.
    pub program: Vec<std::ffi::OsString>,
    /// Prefix every output line with `[rank]` (else children inherit stdout/stderr).
    pub prefix: bool,
    /// Also write each rank's output to `DIR/rank-N.log`.
    pub log_dir: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when stopping children.
    pub grace: Duration,
    /// Extra environment for every child.
    pub env: Vec<(String, String)>,
}

/// Why the launcher failed before or while running the job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Bad arguments.
    #[error("tutti-run: {0}")]
    Usage(String),
    /// The store could not be started.
    #[error("tutti-run: {0}")]
    Store(#[from] tutti_runtime::Error),
    /// A child could not be started.
    #[error("tutti-run: cannot start rank {rank} ({program}): {err}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: String,
        /// The OS error.
        err: std::io::Error,
    },
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        _ => "ended".into(),
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}

/// Exit code the launcher reports for a child's status (128+signal for signals, as shells do).
pub fn exit_code(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn forward(
    rank: usize,
    stream: impl std::io::Read + Send + 'static,
    err: bool,
    log: Option<Arc<Mutex<std::fs::File>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let text = String::from_utf8_lossy(&line);
            let out = format!("[{rank}] {text}\n");
            if err {
                let _ = std::io::stderr().lock().write_all(out.as_bytes());
            } else {
                let _ = std::io::stdout().lock().write_all(out.as_bytes());
            }
            if let Some(f) = &log {
                let _ = f.lock().unwrap_or_else(|p| p.into_inner()).write_all(out.as_bytes());
            }
        }
    })
}

fn signal_all(children: &mut [(usize, Child)], sig: i32) {
    for (_, c) in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            // SAFETY: sending a signal to our own child's pid.
            unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        }
    }
}

/// Stop every child still running: SIGTERM, then SIGKILL after `grace`; reap them all.
fn stop_all(children: &mut [(usize, Child)], grace: Duration) {
    signal_all(children, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if children.iter_mut().all(|(_, c)| matches!(c.try_wait(), Ok(Some(_)))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(children, libc::SIGKILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
}

/// Run the job; returns the exit code the launcher should exit with (0 when every rank
/// succeeded).
///
/// # Errors
/// [`LaunchError`] when the job cannot be started.
pub fn run(job: &Job) -> Result<i32, LaunchError> {
    if job.nproc == 0 || job.nnodes == 0 || job.node_rank >= job.nnodes {
        return Err(LaunchError::Usage("need --nproc ≥ 1 and --node-rank < --nnodes".into()));
    }
    if job.program.is_empty() {
        return Err(LaunchError::Usage("no program to run".into()));
    }
    if job.nnodes > 1 && (job.master_port == 0 || job.token.is_none()) {
        return Err(LaunchError::Usage(
            "a multi-node job needs --master-port and the same TUTTI_TOKEN (or --token) on every node".into(),
        ));
    }
    let world = job.nproc * job.nnodes;
    let token = match &job.token {
        Some(t) => t.clone(),
        None => auth::random_token().map_err(LaunchError::Usage)?,
    };
    let master_ip: IpAddr = (job.master_addr.as_str(), job.master_port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(|a| a.ip())
        .ok_or_else(|| {
            LaunchError::Usage(format!("cannot resolve --master-addr {}", job.master_addr))
        })?;
    let mut _store = None;
    let port = if job.node_rank == 0 {
        let s = StoreServer::start(
            SocketAddr::new(master_ip, job.master_port),
            world,
            Some(JobKey::from_token(&token)),
        )?;
        let p = s.addr().port();
        _store = Some(s);
        p
    } else {
        job.master_port
    };
    // SAFETY: installing async-signal-safe handlers that only store to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    if let Some(d) = &job.log_dir {
        std::fs::create_dir_all(d)
            .map_err(|e| LaunchError::Usage(format!("cannot create {}: {e}", d.display())))?;
    }
    let store_url = if master_ip.is_ipv6() {
        format!("tcp://[{master_ip}]:{port}")
    } else {
        format!("tcp://{master_ip}:{port}")
    };
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..job.nproc {
        let rank = job.node_rank * job.nproc + local;
        let mut cmd = Command::new(&job.program[0]);
        cmd.args(&job.program[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", job.nproc.to_string())
            .env("GROUP_RANK", job.node_rank.to_string())
            .env("MASTER_ADDR", &job.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TUTTI_STORE", &store_url)
            .env("TUTTI_TOKEN", &token)
            .stdin(Stdio::null());
        cmd.envs(job.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        if job.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        // SAFETY: prctl is async-signal-safe; it runs in the child before exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(err) => {
                stop_all(&mut children, job.grace);
                return Err(LaunchError::Spawn {
                    rank,
                    program: job.program[0].to_string_lossy().into_owned(),
                    err,
                });
            }
        };
        if job.prefix {
            let log = match &job.log_dir {
                Some(d) => std::fs::File::create(d.join(format!("rank-{rank}.log")))
                    .ok()
                    .map(|f| Arc::new(Mutex::new(f))),
                None => None,
            };
            if let Some(o) = child.stdout.take() {
                pumps.push(forward(rank, o, false, log.clone()));
            }
            if let Some(e) = child.stderr.take() {
                pumps.push(forward(rank, e, true, log));
            }
        }
        children.push((rank, child));
    }
    let mut code = 0;
    let mut running = children.len();
    while running > 0 {
        if INTERRUPTED.load(Ordering::SeqCst) {
            eprintln!("tutti-run: interrupted; stopping all {} ranks", children.len());
            stop_all(&mut children, job.grace);
            code = 130;
            break;
        }
        let mut failed = None;
        running = 0;
        for (rank, c) in children.iter_mut() {
            match c.try_wait() {
                Ok(Some(st)) if !st.success() => {
                    failed.get_or_insert((*rank, st));
                }
                Ok(Some(_)) => {}
                _ => running += 1,
            }
        }
        if let Some((rank, st)) = failed {
            eprintln!("tutti-run: rank {rank} {}; stopping the other ranks", describe(st));
            stop_all(&mut children, job.grace);
            code = exit_code(st);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    Ok(code)
}
