//! tutti under the launchers the README names that are not its own, run for real: Slurm's srun
//! (a one-host cluster, and two network-namespace hosts as two nodes, started by
//! `tests/slurm/slurm.sh`) and Open MPI's mpirun. The jobs the README shows run exact; a task
//! SIGKILLed mid-allreduce is named by every other task, which fails at once instead of waiting.
//!
//! Slurm (slurm-wlm, munge) and Open MPI (openmpi-bin) come from Debian; `tools/test.sh`
//! installs them. A machine without them fails these tests, unless `TUTTI_TEST_NO_SLURM=1` /
//! `TUTTI_TEST_NO_MPI=1` says to skip them (printed). Starting a Slurm cluster needs root.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tutti_tests::run_with_deadline;

const BENCH: &str = env!("CARGO_BIN_EXE_tt-collbench");
const RANK: &str = env!("CARGO_BIN_EXE_tt-rank");
const SLURM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/slurm/slurm.sh");
const CLUSTER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/cluster.sh");
const LIMIT: Duration = Duration::from_secs(180);

/// One cluster at a time in this process (each has its own daemons, but the machine has 2 cores);
/// under cargo-nextest, whose tests are processes, the `namespaces` group of .config/nextest.toml
/// (shared with the cluster tests, whose namespace hosts use the same addresses).
static ONE: Mutex<()> = Mutex::new(());

/// Whether `prog` is installed (on PATH, or in /usr/sbin where Debian puts the daemons).
fn have(prog: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("PATH=\"$PATH:/usr/sbin:/sbin\" command -v {prog}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether the Slurm tests run here; panics (saying what to do) when they cannot and were not
/// told to skip.
fn slurm_here() -> bool {
    // SAFETY: getuid cannot fail and touches no memory.
    let root = unsafe { libc::getuid() } == 0;
    let skip = std::env::var_os("TUTTI_TEST_NO_SLURM").is_some();
    if have("srun") && have("slurmctld") && have("munged") {
        assert!(
            root || skip,
            "the Slurm tests start a cluster's daemons, which needs root (or set \
             TUTTI_TEST_NO_SLURM=1 to skip them)"
        );
        if !root {
            eprintln!("TUTTI_TEST_NO_SLURM set and not root: the srun tests did not run");
        }
        return root;
    }
    assert!(
        skip,
        "Slurm is not installed: run tools/test.sh (it installs slurm-wlm and munge), or set \
         TUTTI_TEST_NO_SLURM=1 to skip the srun tests"
    );
    eprintln!("TUTTI_TEST_NO_SLURM set and no Slurm: the srun tests did not run");
    false
}

fn text(o: &Output) -> String {
    tutti_tests::describe(o)
}

/// A Slurm cluster in its own directory, taken down (and its namespace hosts with it) when
/// dropped.
struct Slurm {
    dir: PathBuf,
    /// The network namespace hosts, when the nodes are hosts of a namespace cluster.
    hosts: Option<(String, usize)>,
}

impl Slurm {
    /// One node: this host.
    fn one_host() -> Slurm {
        let dir = std::env::temp_dir().join(format!("tutti-slurm-{}-1", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = Slurm { dir, hosts: None };
        s.start(&[]);
        s
    }

    /// `n` nodes, each a network namespace host on a bridge (tests/cluster/cluster.sh).
    fn namespace_hosts(n: usize) -> Slurm {
        let name = format!("sl{}", std::process::id() % 100_000);
        let out = Command::new("bash")
            .args([CLUSTER, "up", &n.to_string(), "--name", &name])
            .output()
            .expect("bash");
        assert!(out.status.success(), "cluster.sh up:\n{}", text(&out));
        let dir = std::env::temp_dir().join(format!("tutti-slurm-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = Slurm { dir, hosts: Some((name.clone(), n)) };
        let nss: Vec<String> = (0..n).map(|i| format!("{name}-h{i}")).collect();
        s.start(&nss.iter().map(String::as_str).collect::<Vec<_>>());
        s
    }

    fn start(&self, nss: &[&str]) {
        let out = Command::new("bash")
            .arg(SLURM)
            .arg("up")
            .arg(&self.dir)
            .args(nss)
            .output()
            .expect("bash");
        assert!(out.status.success(), "slurm.sh up:\n{}", text(&out));
    }

    /// `srun args…`, from node 0 (inside its namespace for a namespace cluster), with `env`.
    fn srun(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut c = match &self.hosts {
            Some((name, _)) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{name}-h0")).arg("srun");
                c
            }
            None => Command::new("srun"),
        };
        c.args(args).env("SLURM_CONF", self.dir.join("slurm.conf"));
        // Nothing of this test process's own job may leak into the tasks' rendezvous.
        for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TUTTI_STORE", "TUTTI_TOKEN"]
        {
            c.env_remove(k);
        }
        c.env("TUTTI_CONNECT_TIMEOUT", "60").envs(env.iter().copied());
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new("bash").arg(SLURM).arg("down").arg(&self.dir).output();
        if let Some((name, _)) = &self.hosts {
            let _ = Command::new("bash").args([CLUSTER, "down", "--name", name]).output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// collbench's verdict lines: every size checked and none wrong.
fn assert_exact(out: &Output, what: &str) {
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{what}:\n{}", text(out));
    assert!(so.contains("Out of bounds values : 0 OK"), "{what}: not verified:\n{}", text(out));
    assert!(!so.contains("FAILED"), "{what}:\n{}", text(out));
}

/// Start a job of `tt-rank loop-pid` through `cmd`, SIGKILL the rank `victim` once every rank
/// looped, and check that every other rank names it and the job ends well inside the timeout.
fn kill_one_and_see_it_named(mut cmd: Command, n: usize, victim: usize, what: &str) {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child: Child = cmd.spawn().expect("spawn the launcher");
    let (tx, rx) = mpsc::channel::<String>();
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    for s in [Box::new(out) as Box<dyn std::io::Read + Send>, Box::new(err)] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(s).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
    }
    drop(tx);
    let start = Instant::now();
    let mut lines: Vec<String> = Vec::new();
    let mut pid = None;
    let mut ready = 0;
    while (pid.is_none() || ready < n) && start.elapsed() < LIMIT {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            if let Some(rest) = l.split("PID ").nth(1) {
                let mut f = rest.split_whitespace();
                if f.next() == Some(&victim.to_string()) {
                    pid = f.next().and_then(|p| p.parse::<i32>().ok());
                }
            }
            if l.contains("READY ") {
                ready += 1;
            }
            lines.push(l);
        }
    }
    let Some(pid) = pid.filter(|_| ready == n) else {
        let _ = child.kill();
        panic!("{what}: the job never got going:\n{}", lines.join("\n"));
    };
    // Let the ranks be mid-allreduce, then kill the victim.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: killing the process of one task of our own job.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed = Instant::now();
    let mut errs = 0;
    while errs < n - 1 && killed.elapsed() < LIMIT {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            if l.contains("ERR ") {
                errs += 1;
            }
            lines.push(l);
        }
    }
    let named_after = killed.elapsed();
    let end = Instant::now();
    while child.try_wait().ok().flatten().is_none() && end.elapsed() < LIMIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let all = lines.join("\n");
    let err_lines: Vec<&String> = lines.iter().filter(|l| l.contains("ERR ")).collect();
    assert_eq!(err_lines.len(), n - 1, "{what}: every survivor should fail:\n{all}");
    for l in &err_lines {
        assert!(
            l.contains(&format!("rank {victim}")),
            "{what}: a survivor did not name rank {victim}: {l}\n{all}"
        );
    }
    // The default per-operation timeout is 30 s: naming the dead rank must not wait for it.
    assert!(
        named_after < Duration::from_secs(10),
        "{what}: the survivors took {named_after:?} to name rank {victim}:\n{all}"
    );
    eprintln!("{what}: every survivor named rank {victim} within {named_after:?}");
}

#[test]
fn srun_on_one_host_runs_the_readme_job_exact_and_names_a_killed_task() {
    if !slurm_here() {
        return;
    }
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::one_host();
    // The README's job (at smaller sizes), over TCP and QUIC (alone: a QUIC job's ranks of one
    // host otherwise link through shared memory).
    for t in ["tcp", "quic"] {
        let shm = if t == "quic" { "0" } else { "1" };
        let cmd = slurm.srun(
            &[
                "-n",
                "4",
                "--overcommit",
                BENCH,
                "all",
                "-b",
                "8",
                "-e",
                "1M",
                "-f",
                "32",
                "-n",
                "3",
            ],
            &[("TUTTI_TRANSPORT", t), ("TUTTI_SHM", shm)],
        );
        let (out, killed) = run_with_deadline(cmd, LIMIT);
        assert!(!killed, "srun {t} did not end:\n{}", text(&out));
        assert_exact(&out, &format!("srun -n 4, {t}"));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("nranks 4 transport {t}")));
    }
    for (t, victim) in [("tcp", 2), ("quic", 0)] {
        let shm = if t == "quic" { "0" } else { "1" };
        let cmd = slurm.srun(
            &["-n", "4", "--overcommit", RANK, "loop-pid"],
            &[("TUTTI_TRANSPORT", t), ("TUTTI_SHM", shm)],
        );
        kill_one_and_see_it_named(cmd, 4, victim, &format!("srun -n 4, {t}, rank {victim} killed"));
    }
}

#[test]
fn srun_on_two_namespace_nodes_runs_the_readme_job_exact_and_names_a_killed_task() {
    if !slurm_here() {
        return;
    }
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::namespace_hosts(2);
    // Across hosts the ranks need a shared secret, as the README says.
    let token = [("TUTTI_TOKEN", "slurm-test-secret-0123456789")];
    let cmd = slurm.srun(
        &[
            "-N",
            "2",
            "--ntasks-per-node",
            "4",
            BENCH,
            "allreduce",
            "-b",
            "8",
            "-e",
            "4M",
            "-f",
            "8",
            "-n",
            "3",
        ],
        &token,
    );
    let (out, killed) = run_with_deadline(cmd, LIMIT);
    assert!(!killed, "srun -N 2 did not end:\n{}", text(&out));
    assert_exact(&out, "srun -N 2 --ntasks-per-node 4");
    let so = String::from_utf8_lossy(&out.stdout);
    // Both nodes took part: collbench's device list names each rank's host.
    assert!(so.contains("nranks 8"), "{so}");
    // A task on the second node killed: named by all seven others.
    let cmd = slurm.srun(&["-N", "2", "--ntasks-per-node", "4", RANK, "loop-pid"], &token);
    kill_one_and_see_it_named(cmd, 8, 6, "srun -N 2, rank 6 (node 1) killed");
}

/// Whether the mpirun test runs here (see the file's docs).
fn mpi_here() -> bool {
    if have("mpirun") {
        return true;
    }
    assert!(
        std::env::var_os("TUTTI_TEST_NO_MPI").is_some(),
        "Open MPI is not installed: run tools/test.sh (it installs openmpi-bin), or set \
         TUTTI_TEST_NO_MPI=1 to skip the mpirun tests"
    );
    eprintln!("TUTTI_TEST_NO_MPI set and no mpirun: the mpirun tests did not run");
    false
}

fn mpirun(args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    // As the README says: the store on 127.0.0.1, a free port; root is allowed explicitly.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    c.args(["-np", "4", "--oversubscribe", "-x", "MASTER_ADDR=127.0.0.1"])
        .args(["-x", &format!("MASTER_PORT={port}")])
        .args(["-x", "TUTTI_TRANSPORT", "-x", "TUTTI_SHM", "-x", "TUTTI_CONNECT_TIMEOUT=60"])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    for k in ["RANK", "WORLD_SIZE", "TUTTI_STORE", "TUTTI_TOKEN"] {
        c.env_remove(k);
    }
    c
}

#[test]
fn mpirun_runs_the_readme_job_exact_and_names_a_killed_rank() {
    if !mpi_here() {
        return;
    }
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    for t in ["tcp", "quic"] {
        let mut cmd = mpirun(&[BENCH, "all", "-b", "8", "-e", "1M", "-f", "32", "-n", "3"]);
        cmd.env("TUTTI_TRANSPORT", t).env("TUTTI_SHM", if t == "quic" { "0" } else { "1" });
        let (out, killed) = run_with_deadline(cmd, LIMIT);
        assert!(!killed, "mpirun {t} did not end:\n{}", text(&out));
        assert_exact(&out, &format!("mpirun -np 4, {t}"));
    }
    let mut cmd = mpirun(&[RANK, "loop-pid"]);
    cmd.env("TUTTI_TRANSPORT", "tcp").env("TUTTI_SHM", "1");
    kill_one_and_see_it_named(cmd, 4, 1, "mpirun -np 4, rank 1 killed");
}
