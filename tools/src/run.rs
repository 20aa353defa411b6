//! `tutti-run`: start a job's local ranks, torchrun style.
//!
//! ```text
//! tutti-run --nproc 4 -- ./my_program args…
//! tutti-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --token-file ~/.tutti-token --nproc 8 -- prog
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::launch::{self, Bind, Job};
use clap::Parser;

/// What `tutti-run --help` prints after the flags.
const AFTER_HELP: &str = "\
Examples:
  tutti-run --nproc 4 -- target/release/collbench allreduce
  # two nodes, the same secret on both (never on the command line):
  tutti-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
            --token-file ~/.tutti-token --nproc 8 -- ./train --steps 1000
  tutti-run --elastic --max-restarts 2 --nproc 8 -- ./train    (goes on when a rank dies)
  tutti-run --connect eager --nproc 64 -- ./train    (the full mesh at start-up)

Variables set for every rank:
  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (this node's index), MASTER_ADDR,
  MASTER_PORT (the store's port + 1, left free for a framework's own store, e.g. torch's
  env:// init), TUTTI_STORE (tcp://ADDR:PORT, the store tutti-run serves on node 0),
  TUTTI_TOKEN (the job secret), TUTTI_LAUNCHER_FD (the pipe on which tutti-run names a rank
  that ended, so every survivor fails at once naming it), and TUTTI_JOIN=1 for a replacement
  started by --max-restarts. Any of these already in tutti-run's environment is replaced;
  TUTTI_JOIN and TUTTI_TOKEN_FILE are removed from the other ranks' environment.
Variables read:
  TUTTI_TOKEN or TUTTI_TOKEN_FILE (the job secret, as --token-file; give one of the three),
  RUST_LOG (default warn),
  NO_COLOR (no colour in logs; logs are coloured only on a terminal). Every other variable
  passes to the ranks unchanged.

Exit status: 0 when every rank succeeded; the failing rank's status (128 + signal when a
signal ended it) otherwise; 130 when interrupted; 141 when the output's reader went away
(tutti-run … | head); 2 for bad arguments.

Every variable the ranks read, with its default: the Configuration table of tutti's README.";

/// Start N local processes of PROGRAM as the ranks of one tutti job.
#[derive(Parser, Debug)]
#[command(
    name = "tutti-run",
    version,
    about = "tutti-run: start the ranks of a tutti job on this node, torchrun style",
    long_about = "tutti-run: start the ranks of a tutti job on this node, torchrun style.\n\n\
        Node 0 serves the rendezvous store; every rank gets its RANK and the store's address. \
        When a rank dies, every other rank is told which one at once and the job stops (or, \
        with --elastic, goes on without it).",
    after_long_help = AFTER_HELP,
    after_help = "Examples and the variables set and read: tutti-run --help"
)]
pub(crate) struct Args {
    /// Processes on this node (at least 1).
    #[arg(long = "nproc", alias = "nproc-per-node", alias = "nproc_per_node", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    nproc: u32,
    /// Nodes in the job (at least 1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    nnodes: u32,
    /// This node's index (0 serves the rendezvous store).
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0.
    #[arg(long = "master-addr", alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Store port on node 0 (0: pick a free one; multi-node jobs must choose).
    #[arg(long = "master-port", alias = "master_port", default_value_t = 0)]
    master_port: u16,
    /// A file holding the job secret shared by all nodes, readable by this user only (default:
    /// TUTTI_TOKEN or TUTTI_TOKEN_FILE, or a fresh secret on a single node). The secret never goes on a command line,
    /// where every user of the host could read it.
    #[arg(long = "token-file", alias = "token_file")]
    token_file: Option<PathBuf>,
    /// Also write each rank's output to DIR/rank-N.log.
    #[arg(long = "log-dir")]
    log_dir: Option<PathBuf>,
    /// Do not prefix output lines with the rank.
    #[arg(long = "no-prefix")]
    no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks (0 to 3600).
    #[arg(long, default_value_t = 5.0, value_parser = grace_secs)]
    grace: f64,
    /// Keep the job going when a rank ends in failure: the others are told at once and go on
    /// without it (a program that shrinks its world, e.g. `ElasticDp`). The exit code is that
    /// of the last rank to end.
    #[arg(long)]
    elastic: bool,
    /// With --elastic: start up to N replacement processes in all, one for each rank that
    /// ends in failure; each joins the running job (`TUTTI_JOIN=1`) when its ranks next grow.
    #[arg(long = "max-restarts", alias = "max_restarts", default_value_t = 0)]
    max_restarts: usize,
    /// How TCP links connect: `lazy` (each pair when it first talks, the default) or `eager`
    /// (every pair at start-up: a missing rank is found before the first call, no call pays a
    /// connect). Sets TUTTI_CONNECT for every rank.
    #[arg(long, value_parser = ["lazy", "eager"])]
    connect: Option<String>,
    /// Bind each local rank to one CPU (`core`: local rank i to the i-th CPU this launcher may
    /// use, wrapping around; `auto`: the same where every rank gets a CPU of its own, else
    /// not bound) or leave them to the kernel (`none`, as torchrun does).
    #[arg(long, value_enum, default_value_t = Bind::None)]
    bind: Bind,
    /// The program and its arguments.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required = true,
        value_name = "PROGRAM"
    )]
    program: Vec<std::ffi::OsString>,
}

/// The `tutti-run` program.
pub fn main() -> ExitCode {
    crate::init_tracing();
    let a = Args::parse();
    let env_file =
        std::env::var_os("TUTTI_TOKEN_FILE").filter(|f| !f.is_empty()).map(PathBuf::from);
    let given = [
        a.token_file.is_some(),
        std::env::var("TUTTI_TOKEN").is_ok_and(|t| !t.is_empty()),
        env_file.is_some(),
    ];
    if given.iter().filter(|g| **g).count() > 1 {
        eprintln!(
            "tutti-run: the job secret is given more than once (--token-file, TUTTI_TOKEN, \
             TUTTI_TOKEN_FILE): use one"
        );
        return ExitCode::from(2);
    }
    let token = match (
        a.token_file.or(env_file),
        std::env::var("TUTTI_TOKEN").ok().filter(|t| !t.is_empty()),
    ) {
        (Some(_), Some(_)) => Err("both --token-file and TUTTI_TOKEN are given: use one".into()),
        (Some(f), None) => tutti_runtime::rendezvous::secret::read_token_file(&f)
            .map(Some)
            .map_err(|e| e.to_string()),
        (None, Some(t)) => tutti_runtime::rendezvous::secret::check_token(&t, "TUTTI_TOKEN")
            .map(|()| Some(t))
            .map_err(|e| e.to_string()),
        (None, None) => Ok(None),
    };
    let token = match token {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tutti-run: {e}");
            return ExitCode::from(2);
        }
    };
    if a.node_rank >= a.nnodes as usize {
        eprintln!(
            "tutti-run: --node-rank {} is not below --nnodes {} (nodes count from 0)",
            a.node_rank, a.nnodes
        );
        return ExitCode::from(2);
    }
    if a.nnodes > 1 && a.master_port == 0 {
        eprintln!(
            "tutti-run: a job of {} nodes needs --master-port (every node must find node 0's \
             store there) and the same secret on every node (--token-file, TUTTI_TOKEN or \
             TUTTI_TOKEN_FILE)",
            a.nnodes
        );
        return ExitCode::from(2);
    }
    if a.max_restarts > 0 && !a.elastic {
        eprintln!(
            "tutti-run: --max-restarts needs --elastic (without it a lost rank stops the job)"
        );
        return ExitCode::from(2);
    }
    let job = Job {
        nproc: a.nproc as usize,
        nnodes: a.nnodes as usize,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        token,
        program: a.program,
        prefix: !a.no_prefix,
        log_dir: a.log_dir,
        grace: Duration::from_secs_f64(a.grace),
        name: "tutti-run",
        env: a.connect.into_iter().map(|c| ("TUTTI_CONNECT".to_string(), c)).collect(),
        elastic: a.elastic,
        max_restarts: a.max_restarts,
        bind: a.bind.cpus(a.nproc as usize),
    };
    match launch::run(&job) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("tutti-run: {e}");
            ExitCode::from(2)
        }
    }
}

/// `--grace`: a finite number of seconds from 0 to an hour (anything else would panic or hang).
fn grace_secs(v: &str) -> Result<f64, String> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| (0.0..=3600.0).contains(s))
        .ok_or_else(|| format!("{v:?} is not a number of seconds from 0 to 3600"))
}
