//! tutti programs under torchrun as it is: torchrun's agent already serves a `TCPStore` on
//! `MASTER_ADDR:MASTER_PORT`, and tutti rendezvouses through it (one node × 4 ranks, two
//! agents as two nodes × 2 with static rendezvous, the c10d rendezvous backend); a failing
//! rank's message reaches torchrun's "Root Cause" summary; an entry forged in a torch store is
//! refused.
//!
//! torch comes from the package registry into a virtualenv outside the clone (`tools/test.sh` makes
//! it: `~/.cache/tutti/venv-torch`, or `TUTTI_TORCH_PYTHON` names the interpreter). A machine
//! without it fails these tests, unless `TUTTI_TEST_NO_TORCH=1` says to skip them (printed).

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tutti_tests::run_with_deadline;

fn python() -> Option<PathBuf> {
    let p = match std::env::var_os("TUTTI_TORCH_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/tutti/venv-torch/bin/python"),
    };
    p.exists().then_some(p)
}

/// The interpreter with torch, or `None` (after saying so) when the tests are to be skipped.
fn torch() -> Option<PathBuf> {
    match python() {
        Some(p) => Some(p),
        None => {
            assert!(
                std::env::var_os("TUTTI_TEST_NO_TORCH").is_some(),
                "no Python with torch (~/.cache/tutti/venv-torch, or TUTTI_TORCH_PYTHON): run \
                 tools/test.sh once to make it, or set TUTTI_TEST_NO_TORCH=1 to skip the torchrun tests"
            );
            eprintln!("TUTTI_TEST_NO_TORCH set and no torch: the torchrun tests did not run");
            None
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn torchrun(py: &PathBuf, args: &[&str], prog: &[&str]) -> Command {
    let mut c = Command::new(py);
    c.args(["-m", "torch.distributed.run"]).args(args).arg("--no-python").args(prog);
    // A fresh job secret each time is made by rank 0 (a single host); none is inherited.
    c.env_remove("TUTTI_TOKEN").env_remove("TUTTI_STORE").env("TUTTI_CONNECT_TIMEOUT", "60");
    c
}

fn text(o: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn collbench_and_the_collectives_run_under_torchrun() {
    let Some(py) = torch() else { return };
    // collbench as a new user would run it.
    let cmd = torchrun(
        &py,
        &["--nproc-per-node", "4"],
        &[
            env!("CARGO_BIN_EXE_tt-collbench"),
            "allreduce",
            "-b",
            "8",
            "-e",
            "1M",
            "-f",
            "32",
            "-n",
            "5",
        ],
    );
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(180));
    assert!(!killed && out.status.success(), "collbench under torchrun:\n{}", text(&out));
    assert!(text(&out).contains("Out of bounds values : 0 OK"), "{}", text(&out));
    // Every collective, exact, over TCP and QUIC (alone: a QUIC job's ranks of one host would
    // otherwise link through shared memory).
    for transport in ["tcp", "quic"] {
        let mut cmd = torchrun(
            &py,
            &["--nproc-per-node", "4"],
            &[env!("CARGO_BIN_EXE_tt-rank"), "collectives"],
        );
        cmd.env("TUTTI_TRANSPORT", transport);
        if transport == "quic" {
            cmd.env("TUTTI_SHM", "0");
        }
        let (out, killed) = run_with_deadline(cmd, Duration::from_secs(180));
        let t = text(&out);
        assert!(!killed && out.status.success(), "{transport}:\n{t}");
        for r in 0..4 {
            assert!(t.contains(&format!("OK {r}")), "{transport}: rank {r} did not pass:\n{t}");
        }
    }
}

/// Two torchrun agents on this host as two nodes of two ranks each, with static rendezvous and
/// with the c10d rendezvous backend.
#[test]
fn two_agents_as_two_nodes() {
    let Some(py) = torch() else { return };
    for backend in ["static", "c10d"] {
        let port = free_port().to_string();
        let agents: Vec<_> = (0..2)
            .map(|node| {
                let node = node.to_string();
                let mut args = vec!["--nnodes", "2", "--nproc-per-node", "2"];
                let endpoint = format!("127.0.0.1:{port}");
                let mut cmd = if backend == "static" {
                    args.extend(["--node-rank", &node, "--master-addr", "127.0.0.1"]);
                    args.extend(["--master-port", &port]);
                    torchrun(&py, &args, &[env!("CARGO_BIN_EXE_tt-rank"), "collectives"])
                } else {
                    args.extend(["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint]);
                    args.extend(["--rdzv-id", "tutti-test"]);
                    torchrun(&py, &args, &[env!("CARGO_BIN_EXE_tt-rank"), "collectives"])
                };
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
            })
            .collect();
        let start = Instant::now();
        let outs: Vec<Output> = agents
            .into_iter()
            .map(|mut c| {
                while c.try_wait().unwrap().is_none() {
                    if start.elapsed() > Duration::from_secs(180) {
                        let _ = c.kill();
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                c.wait_with_output().unwrap()
            })
            .collect();
        let all: String = outs.iter().map(text).collect();
        for (n, o) in outs.iter().enumerate() {
            assert!(o.status.success(), "{backend}: node {n} failed:\n{all}");
        }
        for r in 0..4 {
            assert!(all.contains(&format!("OK {r}")), "{backend}: rank {r} did not pass:\n{all}");
        }
    }
}

/// Ranks that disagree about a collective: every rank fails with tutti's message (the
/// operation, the ranks and what differs), and torchrun's "Root Cause" shows it — read from the
/// error file tutti writes — instead of `<N/A>`.
#[test]
fn a_failing_rank_is_named_in_torchruns_summary() {
    let Some(py) = torch() else { return };
    let cmd =
        torchrun(&py, &["--nproc-per-node", "3"], &[env!("CARGO_BIN_EXE_tt-rank"), "diverge", "1"]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(120));
    let t = text(&out);
    assert!(!killed && !out.status.success(), "{t}");
    let root = &t[t.find("Root Cause").unwrap_or_else(|| panic!("no summary:\n{t}"))..];
    assert!(root.contains("TuttiError: rank "), "the root cause is not tutti's message:\n{t}");
    assert!(root.contains("allreduce"), "the root cause does not name the operation:\n{t}");
    assert!(!root.contains("error_file: <N/A>"), "{root}");
}

/// Start `script` (a torch store server) and return it, its port and torch's version line.
fn serve(py: &PathBuf, script: &str, args: &[&str]) -> (std::process::Child, u16, String) {
    let mut server =
        Command::new(py).arg(script).args(args).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    let (mut port, mut version, mut line) = (None, String::new(), String::new());
    for _ in 0..10 {
        line.clear();
        if std::io::BufRead::read_line(&mut out, &mut line).unwrap() == 0 {
            break;
        }
        if let Some(p) = line.strip_prefix("PORT ") {
            port = p.trim().parse::<u16>().ok();
        }
        if let Some(v) = line.strip_prefix("TORCH ") {
            version = v.trim().to_string();
            break;
        }
    }
    (server, port.expect("the torch store did not start"), version)
}

/// A job rendezvouses through torch's store with either of its servers (libuv, the default,
/// and the classic one), given as `TUTTI_STORE=torch://host:port`.
#[test]
fn a_job_rendezvouses_through_both_torch_store_servers() {
    let Some(py) = torch() else { return };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/torch/serve.py");
    for server in ["libuv", "classic"] {
        let (mut srv, port, version) = serve(&py, script, &[server]);
        eprintln!("torch {version}");
        let want = format!("libuv={}", server == "libuv");
        assert!(version.to_lowercase().contains(&want), "{version}");
        let n = 3;
        let ranks: Vec<_> = (0..n)
            .map(|r| {
                let mut c = Command::new(env!("CARGO_BIN_EXE_tt-rank"));
                c.arg("collectives")
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("TUTTI_STORE", format!("torch://127.0.0.1:{port}"))
                    .env_remove("TUTTI_TOKEN")
                    .env("TUTTI_CONNECT_TIMEOUT", "60")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                c.spawn().unwrap()
            })
            .collect();
        let outs: Vec<Output> = ranks.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
        let _ = srv.kill();
        let _ = srv.wait();
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.status.success() && text(o).contains(&format!("OK {r}")),
                "{server}: rank {r}:\n{}",
                text(o)
            );
        }
    }
}

/// torch's store authenticates nobody: an entry forged there (the job id, an address) is
/// refused by a rank that has the job secret, naming the entry.
#[test]
fn an_entry_forged_in_a_torch_store_is_refused() {
    let Some(py) = torch() else { return };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/torch/forge.py");
    let (mut server, port, version) = serve(&py, script, &[]);
    eprintln!("torch {version}");
    // Rank 1 of 2 joins (rank 0 never comes): the job id it reads was forged.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-rank"));
    cmd.arg("connect")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("TUTTI_STORE", format!("torch://127.0.0.1:{port}"))
        .env("TUTTI_TOKEN", "forgery-test-secret-0123")
        .env("TUTTI_CONNECT_TIMEOUT", "20");
    let (o, killed) = run_with_deadline(cmd, Duration::from_secs(60));
    let _ = server.kill();
    let _ = server.wait();
    let t = text(&o);
    assert!(!killed && !o.status.success(), "{t}");
    assert!(t.contains("tutti/job") && t.contains("fails its check"), "{t}");
}
