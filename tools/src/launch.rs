//! Starting and supervising the local ranks of a job (`tutti-run`, `collbench --np`).
//!
//! Every child gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `TUTTI_STORE`, `TUTTI_TOKEN` and `TUTTI_LAUNCHER_FD`. On node 0 the launcher
//! itself serves the rendezvous store on the master port (bound before any child starts, so there
//! is no race for the port), which tutti programs find through `TUTTI_STORE`. The children's
//! `MASTER_PORT` is the next port, left for a program whose framework serves its own store there
//! (torch's `env://` init: rank 0 binds `MASTER_ADDR:MASTER_PORT`), so torch programs with the
//! `tutti` backend run under tutti-run unchanged. Children die with the launcher (`PR_SET_PDEATHSIG`).
//!
//! When one child fails, the launcher first tells the others which rank it was and how it ended,
//! on each child's notice pipe (`TUTTI_LAUNCHER_FD`, read by `tutti_runtime`'s rendezvous), so
//! every survivor fails at once naming it — whatever the transport, and whether or not the dead
//! process's sockets tell its peers. It gives them [`NOTICE_WAIT`] (at most the grace period) to
//! report that and exit; the rest get SIGTERM, then SIGKILL after the grace period, and the
//! launcher exits non-zero with one line naming the rank.
//!
//! Each child leads its own process group: stopping a rank stops what it forked, and when the
//! job ends whatever its ranks left running is killed (with one line saying so), so a finished
//! job leaves no process behind and a forked process holding an output pipe cannot keep the
//! launcher waiting (it waits at most 2 s more for output).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tutti_runtime::auth::{self, JobKey};
use tutti_runtime::rendezvous::launcher::{notice, LAUNCHER_FD};
use tutti_runtime::store::StoreServer;

/// The port children see as `MASTER_PORT`: the one after the store's (before it at the top of
/// the range), for a framework that serves its own rendezvous there.
pub fn framework_port(store: u16) -> u16 {
    store.checked_add(1).unwrap_or(store - 1)
}

/// How long the surviving children get, after being told which rank died, to report it and exit
/// by themselves before they are sent SIGTERM (capped by the grace period).
pub const NOTICE_WAIT: Duration = Duration::from_secs(2);

/// Set by the SIGINT/SIGTERM handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Set when the launcher's standard output was closed by its reader (`tutti-run … | head`): the
/// job is stopped quietly and the launcher exits as a tool killed by SIGPIPE does (141).
static OUTPUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// The exit code of a job whose output's reader went away: 128 + SIGPIPE, as a shell reports a
/// process that SIGPIPE ended.
pub const BROKEN_PIPE_EXIT: i32 = 128 + libc::SIGPIPE;

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// A job to start on this node.
#[derive(Clone)]
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
    /// The program that launches, in its messages (`tutti-run`, or `collbench` for `--np`).
    pub name: &'static str,
    /// Extra environment for every child.
    pub env: Vec<(String, String)>,
    /// `--elastic`: a rank that ends in failure does not stop the job; the others are told and
    /// go on without it (they shrink their world); the job's exit code is that of the last
    /// rank to end.
    pub elastic: bool,
    /// With `elastic`: how many replacement processes to start in all, one for each rank that
    /// ends in failure while others run (`TUTTI_JOIN=1`: they join the running job).
    pub max_restarts: usize,
    /// The CPUs to bind the local ranks to, by local rank (local rank `i` to `bind[i % len]`,
    /// one CPU each: [`Bind::cpus`]); empty: no binding, the kernel places them.
    pub bind: Vec<usize>,
}

/// Whether the ranks of a node are bound to CPUs (`--bind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Local rank `i` on the `i`-th CPU this launcher may use, where every rank gets one of
    /// its own; otherwise not bound (as `mpirun` binds up to 2 ranks to a core each, and
    /// leaves more to the kernel).
    Auto,
    /// Local rank `i` on the `i`-th CPU this launcher may use, wrapping around.
    Core,
    /// Not bound: the kernel places and moves them.
    None,
}

impl Bind {
    /// The CPUs for [`Job::bind`] with `nproc` local ranks.
    pub fn cpus(self, nproc: usize) -> Vec<usize> {
        let cpus = allowed_cpus();
        match self {
            Bind::Core => cpus,
            Bind::Auto if nproc <= cpus.len() => cpus,
            Bind::Auto | Bind::None => Vec::new(),
        }
    }
}

/// The CPUs this process may run on (its affinity mask), one hardware thread of every core
/// before any second one of the same core (so that binding ranks in this order gives each a
/// core of its own first), then by number; empty if unknown.
pub fn allowed_cpus() -> Vec<usize> {
    let cpus = allowed_cpu_numbers();
    // (package, core) of each CPU; a CPU whose topology is unknown counts as a core of its own.
    let core = |c: usize| {
        let read = |f: &str| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{c}/topology/{f}"))
                .ok()
                .and_then(|v| v.trim().parse::<i64>().ok())
        };
        (read("physical_package_id").unwrap_or(-1), read("core_id").unwrap_or(-(c as i64) - 2))
    };
    let mut seen: std::collections::HashMap<(i64, i64), usize> = Default::default();
    let mut keyed: Vec<(usize, usize)> = cpus
        .iter()
        .map(|&c| {
            let k = seen.entry(core(c)).or_insert(0);
            *k += 1;
            (*k, c)
        })
        .collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, c)| c).collect()
}

/// The CPUs this process may run on, by number; empty if unknown.
fn allowed_cpu_numbers() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is ours and as large as passed.
    let r = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Vec::new();
    }
    // SAFETY: reading bits of a set the kernel filled.
    (0..libc::CPU_SETSIZE as usize).filter(|c| unsafe { libc::CPU_ISSET(*c, &set) }).collect()
}

/// CPU numbers in order as a short list (`0`, `0-3`, `0,2`), for reports.
pub fn describe_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if j > i { format!("{}-{}", cpus[i], cpus[j]) } else { cpus[i].to_string() });
        i = j + 1;
    }
    if parts.is_empty() {
        "?".into()
    } else {
        parts.join(",")
    }
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("nproc", &self.nproc)
            .field("nnodes", &self.nnodes)
            .field("node_rank", &self.node_rank)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("token", &self.token.as_ref().map(|_| "(redacted)"))
            .field("program", &self.program)
            .field("prefix", &self.prefix)
            .field("log_dir", &self.log_dir)
            .field("grace", &self.grace)
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .finish()
    }
}

/// Why the launcher failed before or while running the job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// The store could not be started.
    #[error("{0}")]
    Store(#[from] tutti_runtime::Error),
    /// A child could not be started.
    #[error("cannot start rank {rank} ({program}): {err}")]
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
    log: Option<Arc<Mutex<File>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let text = String::from_utf8_lossy(&line);
            let out = format!("[{rank}] {text}\n");
            if err {
                // Once the output is gone the job is being stopped for it: what the ranks say
                // about their peers ending then is not news.
                if !OUTPUT_CLOSED.load(Ordering::SeqCst) {
                    let _ = std::io::stderr().lock().write_all(out.as_bytes());
                }
            } else {
                let mut o = std::io::stdout().lock();
                if let Err(e) = o.write_all(out.as_bytes()).and_then(|()| o.flush()) {
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        OUTPUT_CLOSED.store(true, Ordering::SeqCst);
                    }
                }
            }
            if let Some(f) = &log {
                let _ = f.lock().unwrap_or_else(|p| p.into_inner()).write_all(out.as_bytes());
            }
        }
    })
}

/// Signal every child's process group (each child leads its own, so what it forked is signalled
/// with it), and the child itself while it runs.
fn signal_all(children: &mut [(usize, Child)], sig: i32) {
    for (_, c) in children.iter_mut() {
        let pid = c.id() as libc::pid_t;
        // SAFETY: signalling the process group our child leads (its pid), and the child.
        unsafe { libc::kill(-pid, sig) };
        if let Ok(None) = c.try_wait() {
            // SAFETY: as above.
            unsafe { libc::kill(pid, sig) };
        }
    }
}

/// Kill what is left in the children's process groups once the children have ended (processes
/// they forked that outlived them), saying so; a finished job leaves nothing running.
fn reap_leftovers(children: &[(usize, Child)], name: &str) {
    for (rank, c) in children {
        let pgid = c.id() as libc::pid_t;
        // SAFETY: signal 0 only checks whether the group has members.
        if unsafe { libc::kill(-pgid, 0) } == 0 {
            eprintln!("{name}: rank {rank} left processes running; killing them");
            // SAFETY: killing the process group our child led.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }
}

/// Wait up to `limit` for every child to end; true when they all did.
fn all_ended_within(children: &mut [(usize, Child)], limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if children.iter_mut().all(|(_, c)| matches!(c.try_wait(), Ok(Some(_)))) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stop every child still running: SIGTERM, then SIGKILL after `grace`; reap them all.
fn stop_all(children: &mut [(usize, Child)], grace: Duration) {
    signal_all(children, libc::SIGTERM);
    if all_ended_within(children, grace) {
        return;
    }
    signal_all(children, libc::SIGKILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
}

/// A pipe whose read end a child inherits as its notice pipe and whose write end the launcher
/// keeps (non-blocking: a child that stopped reading never stalls the launcher).
fn notice_pipe() -> std::io::Result<(OwnedFd, File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array; both ends start close-on-exec.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // pipe2 made both ends non-blocking; the child's reader blocks, so clear the read end's.
    // SAFETY: F_SETFL with flags 0 on a descriptor we own.
    unsafe { libc::fcntl(r.as_raw_fd(), libc::F_SETFL, 0) };
    Ok((r, w))
}

/// Tell every child still running that `rank` ended as `what`.
fn tell_survivors(
    children: &mut [(usize, Child)],
    notices: &mut [Option<File>],
    rank: usize,
    what: &str,
) {
    let line = notice(rank, what);
    for ((r, c), pipe) in children.iter_mut().zip(notices.iter_mut()) {
        if *r == rank || !matches!(c.try_wait(), Ok(None)) {
            continue;
        }
        if let Some(p) = pipe.as_mut() {
            // One line is far below the pipe's atomic-write size: it goes whole or not at all.
            let _ = p.write_all(line.as_bytes());
        }
    }
}

/// What every rank's process is started with.
struct Spawn<'a> {
    job: &'a Job,
    world: usize,
    port: u16,
    store_url: &'a str,
    token: &'a str,
    /// The key derived from `token`, for the ranks (`auth::KEY_ENV`).
    key_handoff: String,
}

impl Spawn<'_> {
    /// Start the process of `rank` (`local` on this node); `join` makes it a replacement that
    /// joins the running job. Returns it, the write end of its notice pipe, and its output
    /// pumps.
    #[allow(clippy::type_complexity)]
    fn rank(
        &self,
        rank: usize,
        local: usize,
        join: bool,
    ) -> Result<(Child, Option<File>, Vec<std::thread::JoinHandle<()>>), LaunchError> {
        let job = self.job;
        let mut cmd = Command::new(&job.program[0]);
        cmd.args(&job.program[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_WORLD_SIZE", job.nproc.to_string())
            .env("GROUP_RANK", job.node_rank.to_string())
            .env("MASTER_ADDR", &job.master_addr)
            .env("MASTER_PORT", framework_port(self.port).to_string())
            .env("TUTTI_STORE", self.store_url)
            .env("TUTTI_TOKEN", self.token)
            // The key stretched from it once here, not again in every rank (25 ms of a core
            // each: 3 s of a 256-rank job's start on 2 cores).
            .env(auth::KEY_ENV, &self.key_handoff)
            // The launcher read the secret (a file named here would clash with the token it
            // hands out), and only a replacement joins a running job: neither may leak in from
            // the launcher's own environment.
            .env_remove("TUTTI_TOKEN_FILE")
            .env_remove("TUTTI_JOIN")
            .stdin(Stdio::null());
        if join {
            cmd.env("TUTTI_JOIN", "1");
        }
        if !job.bind.is_empty() && job.nproc <= job.bind.len() {
            // Each rank sees one CPU, its own: tell it how many the ranks of this node share,
            // so that its waits still spin. (Ranks that wrap around share CPUs, and their
            // one CPU each tells them not to.)
            cmd.env(tutti_runtime::HOST_CPUS_ENV, job.bind.len().to_string());
        }
        cmd.envs(job.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        if job.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        // Without a pipe the child simply gets no notices (its transport still sees the loss).
        let pipe = notice_pipe().ok();
        let read_fd = pipe.as_ref().map(|(r, _)| r.as_raw_fd());
        if let Some(fd) = read_fd {
            cmd.env(LAUNCHER_FD, fd.to_string());
        }
        // SAFETY: getpid, setpgid, prctl, getppid, fcntl, sched_setaffinity and _exit are
        // async-signal-safe; the closure runs in the child before exec.
        let launcher = unsafe { libc::getpid() };
        // The CPU this rank is bound to, as a set made before the fork.
        let cpu = (!job.bind.is_empty()).then(|| {
            // SAFETY: a zeroed cpu_set_t is a valid empty set.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: the CPU came from `allowed_cpus`, below CPU_SETSIZE.
            unsafe { libc::CPU_SET(job.bind[local % job.bind.len()], &mut set) };
            set
        });
        // SAFETY: see above.
        unsafe {
            cmd.pre_exec(move || {
                // Its own process group, so stopping it reaches what it forks too.
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // The launcher may have died between fork and prctl: then nobody would
                // signal us, so do not start.
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                if let Some(fd) = read_fd {
                    // This child, alone, keeps its notice pipe's read end across exec.
                    libc::fcntl(fd, libc::F_SETFD, 0);
                }
                if let Some(set) = &cpu {
                    // sched_setaffinity is a plain system call (async-signal-safe).
                    if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        // Our copy of the read end goes now: the child holds the only one.
        let notice_w = pipe.map(|(_, w)| w);
        let mut child = spawned.map_err(|err| LaunchError::Spawn {
            rank,
            program: job.program[0].to_string_lossy().into_owned(),
            err,
        })?;
        let mut pumps = Vec::new();
        if job.prefix {
            let log = match &job.log_dir {
                Some(d) => File::create(d.join(format!("rank-{rank}.log")))
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
        Ok((child, notice_w, pumps))
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
            "a multi-node job needs --master-port and the same secret on every node (TUTTI_TOKEN or \
             --token-file)"
                .into(),
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
    let mut notices: Vec<Option<File>> = Vec::new();
    let mut pumps = Vec::new();
    let key_handoff = JobKey::handoff(&token);
    let spawn_ctx = Spawn { job, world, port, store_url: &store_url, token: &token, key_handoff };
    for local in 0..job.nproc {
        let rank = job.node_rank * job.nproc + local;
        match spawn_ctx.rank(rank, local, false) {
            Ok((child, notice_w, p)) => {
                children.push((rank, child));
                notices.push(notice_w);
                pumps.extend(p);
            }
            Err(e) => {
                stop_all(&mut children, job.grace);
                return Err(e);
            }
        }
    }
    let mut code = 0;
    let mut running = children.len();
    // --elastic: the ranks whose end was already handled, and the replacements started.
    let mut ended = vec![false; children.len()];
    let mut restarts = 0;
    // The first rank that finished the job (exit 0), and when.
    let mut finished: Option<(usize, Instant)> = None;
    while running > 0 {
        if OUTPUT_CLOSED.load(Ordering::SeqCst) {
            stop_all(&mut children, job.grace);
            code = BROKEN_PIPE_EXIT;
            break;
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            eprintln!("{}: interrupted; stopping all {} ranks", job.name, children.len());
            stop_all(&mut children, job.grace);
            code = 130;
            break;
        }
        if job.elastic {
            running = 0;
            let mut lost = Vec::new();
            for (i, (rank, c)) in children.iter_mut().enumerate() {
                match c.try_wait() {
                    Ok(Some(st)) if !ended[i] => {
                        ended[i] = true;
                        code = exit_code(st);
                        if st.success() {
                            finished.get_or_insert((*rank, Instant::now()));
                        } else {
                            lost.push((*rank, describe(st)));
                        }
                    }
                    Ok(Some(_)) => {}
                    _ => running += 1,
                }
            }
            for (rank, what) in lost {
                if running > 0 {
                    eprintln!(
                        "tutti-run: rank {rank} {what}; telling the other ranks, which go on \
                         without it (--elastic)"
                    );
                    tell_survivors(&mut children, &mut notices, rank, &what);
                    if restarts < job.max_restarts {
                        restarts += 1;
                        let local = rank - job.node_rank * job.nproc;
                        match spawn_ctx.rank(rank, local, true) {
                            Ok((child, notice_w, p)) => {
                                eprintln!(
                                    "tutti-run: started a replacement for rank {rank} \
                                     (restart {restarts} of {}); it joins the running job",
                                    job.max_restarts
                                );
                                children.push((rank, child));
                                notices.push(notice_w);
                                ended.push(false);
                                pumps.extend(p);
                                running += 1;
                            }
                            Err(e) => eprintln!("{}: cannot start a replacement: {e}", job.name),
                        }
                    }
                } else {
                    eprintln!("{}: rank {rank} {what}; no rank is left, the job failed", job.name);
                }
            }
            if running > 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            // A rank finished the job: the ranks still running after --grace are ones the others
            // went on without (a stopped or cut-off process). Stop them; the job is done.
            if let Some((done, at)) =
                finished.filter(|(_, at)| running > 0 && at.elapsed() > job.grace)
            {
                let mut left: Vec<usize> = Vec::new();
                for ((r, c), e) in children.iter_mut().zip(&ended) {
                    if !*e && matches!(c.try_wait(), Ok(None)) {
                        left.push(*r);
                    }
                }
                eprintln!(
                    "tutti-run: rank {done} finished the job {:.1} s ago and ranks {left:?} are \
                     still running (left behind by the others); stopping them (--elastic)",
                    at.elapsed().as_secs_f64()
                );
                let keep = code;
                stop_all(&mut children, job.grace);
                code = keep;
                break;
            }
            continue;
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
        if let Some((_, st)) = failed {
            // A rank writing to the output it shares with the launcher found its reader gone
            // (`collbench | head`): stop the job quietly and end as it did.
            if st.signal() == Some(libc::SIGPIPE) && crate::stdout_closed() {
                OUTPUT_CLOSED.store(true, Ordering::SeqCst);
                signal_all(&mut children, libc::SIGKILL);
                for (_, c) in children.iter_mut() {
                    let _ = c.wait();
                }
                code = BROKEN_PIPE_EXIT;
                break;
            }
        }
        if let Some((rank, st)) = failed {
            let what = describe(st);
            eprintln!("{}: rank {rank} {what}; telling and stopping the other ranks", job.name);
            tell_survivors(&mut children, &mut notices, rank, &what);
            all_ended_within(&mut children, NOTICE_WAIT.min(job.grace));
            stop_all(&mut children, job.grace);
            code = exit_code(st);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    reap_leftovers(&children, job.name);
    // The pumps end when the last holder of each pipe is gone; a process that left the group
    // (setsid) may still hold one, so wait a little, never forever.
    let deadline = Instant::now() + PUMP_WAIT;
    while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in pumps.into_iter().filter(|p| p.is_finished()) {
        let _ = p.join();
    }
    Ok(code)
}

/// How long the launcher waits, after the job, for the rest of its children's output.
const PUMP_WAIT: Duration = Duration::from_secs(2);
