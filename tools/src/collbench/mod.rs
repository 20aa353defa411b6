//! collbench: nccl-tests for tutti.
//!
//! The same flags, columns, busbw factors and footer as nccl-tests (so existing parsers work),
//! plus per-iteration p50/p99 and the algorithm that ran in a second table after the footer and
//! in the JSON. Starts its own local ranks (`--np`, TCP on 127.0.0.1 or threads over memory) or
//! runs as one rank under `tutti-run`, `srun` or `mpirun`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tutti_collectives::{parse_size, Algo, Coll, Comm, Config, DType, ReduceOp};

pub mod bench;
pub mod report;

pub use bench::Bench;
pub use report::{Row, Run};

/// Most local ranks `--np` starts (threads or processes of one host).
pub const MAX_NP: usize = 1024;

/// Collectives collbench knows, in `all` order.
pub const COLLECTIVES: [&str; 10] = [
    "allreduce",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "alltoall",
    "gather",
    "scatter",
    "sendrecv",
    "barrier",
];

/// What `collbench --help` prints after the flags.
const AFTER_HELP: &str = "\
Examples:
  collbench                                    every collective, 32 MiB, 4 local ranks over TCP
  collbench allreduce -b 8 -e 128M -f 2 --np 2 --transport quic -J out.json
  tutti-run --nproc 8 -- collbench allgather -b 1K -e 1G -f 4      one rank per process

Who sets the ranks:
  Started by itself, collbench starts --np local ranks (default 4) over --transport (default
  TUTTI_TRANSPORT, else tcp). Under a launcher (RANK/WORLD_SIZE from tutti-run or torchrun,
  OMPI_COMM_WORLD_* from mpirun, SLURM_* from srun) each process is one rank: the world size
  and the transport come from the launcher's environment, and a --np or --transport that
  disagrees with them is refused.

Variables read:
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TUTTI_STORE, TUTTI_TOKEN (or the
  OMPI_COMM_WORLD_* / SLURM_* forms), TUTTI_TRANSPORT, TUTTI_TIMEOUT (-T wins over it),
  TUTTI_ALGO (--algo wins over it), the other TUTTI_* tuning variables, RUST_LOG (default warn),
  NO_COLOR (no colour in logs; logs are coloured only on a terminal).
Variables set for the --np ranks: as tutti-run sets them (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TUTTI_STORE, TUTTI_TOKEN, TUTTI_LAUNCHER_FD) and
  TUTTI_TRANSPORT.

Exit status: 0 when every size was measured and verified; 1 when a result was wrong, a
--min-bw check failed or a rank failed; 2 for bad arguments; 141 (SIGPIPE) when the output's
reader went away (collbench | head).

Every variable, with its default: the Configuration table of tutti's README.";

/// Command line, nccl-tests compatible.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "collbench",
    version,
    about = "collbench: nccl-tests-style benchmark of tutti's collectives",
    long_about = "collbench: nccl-tests-style benchmark of tutti's collectives.\n\n\
        Prints nccl-tests' table (size, count, type, redop, root, time, algbw, busbw, #wrong, \
        out of place and in place) for each collective, then p50/p99 and the algorithm used. \
        Started by itself it runs --np local ranks; under a launcher it is one rank.",
    after_long_help = AFTER_HELP,
    after_help = "Examples, the variables read and set, and which setting wins: collbench --help"
)]
pub struct Args {
    /// Collective: allreduce, allgather, reduce_scatter, broadcast, reduce, alltoall, gather,
    /// scatter, sendrecv, barrier, or all.
    #[arg(default_value = "all")]
    pub coll: String,
    /// Smallest size (bytes, K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = parse_size)]
    pub minbytes: u64,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    pub maxbytes: u64,
    /// Increment between sizes (unless -f is given).
    #[arg(short = 'i', long = "stepbytes", default_value = "1M", value_parser = parse_size)]
    pub stepbytes: u64,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor")]
    pub stepfactor: Option<u64>,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 1)]
    pub warmup: usize,
    /// Operations aggregated per timed iteration.
    #[arg(short = 'm', long = "agg_iters", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub agg: u64,
    /// Verify the first iteration of every size (0 disables).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u32,
    /// Reduction op: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Data type: float, double, half, bfloat16, int8, uint8, int32, int64.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: String,
    /// Root of rooted collectives.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Time reported: 0 rank 0, 1 mean over ranks, 2 min, 3 max.
    #[arg(short = 'a', long = "average", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(0..=3))]
    pub average: u32,
    /// Per-iteration timing (p50/p99 are always in the extras table; accepted for
    /// compatibility).
    #[arg(short = 'I', long = "per_iter_timing", default_value_t = 0)]
    pub per_iter: u32,
    /// Per-operation timeout in seconds (0: tutti's default, 30 s).
    #[arg(short = 'T', long = "timeout", default_value_t = 0)]
    pub timeout: u64,
    /// Local ranks to start when not run under a launcher, 1 to 1024 [default: 4]. Under
    /// tutti-run, torchrun, srun or mpirun the launcher's world size wins; a different --np is
    /// refused.
    #[arg(long = "np")]
    pub np: Option<usize>,
    /// How the --np ranks are placed on CPUs: `auto` binds local rank i to the i-th CPU
    /// collbench may use where every rank gets one of its own (as mpirun binds 2 ranks to a
    /// core each; otherwise not bound), `core` always does (wrapping around), `none` leaves
    /// them to the kernel. Each rank's CPUs are in the `# Using devices` lines.
    #[arg(long, value_enum, default_value_t = crate::launch::Bind::Auto)]
    pub bind: crate::launch::Bind,
    /// Transport of the --np ranks: tcp, quic or mem (threads in one process) [default:
    /// TUTTI_TRANSPORT (tcp or quic), else tcp]. Given, it wins over TUTTI_TRANSPORT (and says so). Under a
    /// launcher the environment's transport is used; a different --transport is refused.
    #[arg(long)]
    pub transport: Option<String>,
    /// Where the buffers live: host, sim (simulated device: staged through host buffers with
    /// modelled copy latency and bandwidth), cuda (GPU buffers staged through pinned memory;
    /// feature `cuda`) or nccl (GPU buffers, NCCL; feature `nccl`). Device runs cover
    /// allreduce, allgather, reduce_scatter, alltoall, broadcast and reduce; cuda/nccl ranks use
    /// GPU LOCAL_RANK modulo the GPUs present.
    #[arg(long, default_value = "host")]
    pub device: String,
    /// With --device cuda: time every staging copy with CUDA events and report the share of
    /// copy time that ran while a segment was on the network (two event records per copy).
    #[arg(long)]
    pub copy_timing: bool,
    /// Time each call on its own: a barrier before every timed iteration (untimed), so a
    /// call's time is its latency from a common start, not its share of a back-to-back loop in
    /// which ranks run ahead of each other.
    #[arg(long)]
    pub isolated: bool,
    /// Force an algorithm (ring, rd, rabenseifner, halving, tree, chain, bruck, pairwise,
    /// postall, linear, dissemination, scatter_allgather, twolevel, direct).
    #[arg(long)]
    pub algo: Option<String>,
    /// Write results as JSON to FILE.
    #[arg(short = 'J', long = "json", value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// Plot busbw against size to FILE (SVG).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<std::path::PathBuf>,
    /// Exit non-zero when the average busbw of a collective is below GBPS (GB/s).
    #[arg(long = "min-bw", value_name = "GBPS")]
    pub min_bw: Option<f64>,
    /// Run the whole sweep this many times (nccl-tests' -N; 0: until stopped).
    #[arg(short = 'N', long = "run_cycles", default_value_t = 1)]
    pub run_cycles: u32,
    /// nccl-tests' threads per process. Accepted; tutti runs one rank per process, so the
    /// ranks come from the launcher or --np (noted in the header when not 1).
    #[arg(short = 't', long = "nthreads", default_value_t = 1)]
    pub nthreads: u32,
    /// nccl-tests' GPUs per thread. Accepted; one device per rank here (noted when not 1).
    #[arg(short = 'g', long = "ngpus", default_value_t = 1)]
    pub ngpus: u32,
    /// nccl-tests' parallel communicator init. Accepted; rendezvous is always concurrent.
    #[arg(short = 'p', long = "parallel_init", default_value_t = 0)]
    pub parallel_init: u32,
    /// nccl-tests' blocking mode 0–3. Accepted; every collective here returns when it is done.
    #[arg(short = 'z', long = "blocking", default_value_t = 0)]
    pub blocking: u32,
    /// nccl-tests' CUDA graph launches. Accepted; no graphs here.
    #[arg(short = 'G', long = "cudagraph", default_value_t = 0)]
    pub cudagraph: u32,
    /// nccl-tests' CPU-time report. Accepted; times are wall-clock.
    #[arg(short = 'C', long = "report_cputime", default_value_t = 0)]
    pub report_cputime: u32,
    /// nccl-tests' buffer registration: non-zero runs the in-place all-gather on shared
    /// buffers (`Comm::shared_buffer`, `Comm::allgather_shared`: every rank maps every other's
    /// buffer and copies each peer's block once, straight from it; the ranks must share a
    /// host). Other collectives and the out-of-place column are unchanged.
    #[arg(short = 'R', long = "local_register", default_value_t = 0)]
    pub local_register: u32,
    /// nccl-tests' per-iteration skip. Accepted; warm-up iterations (-w) play that part.
    #[arg(short = 'K', long = "per_iter_skip", default_value_t = 0)]
    pub per_iter_skip: u32,
    /// nccl-tests' memory report. Accepted; not reported.
    #[arg(short = 'M', long = "memory_report", default_value_t = 0)]
    pub memory_report: u32,
    /// nccl-tests' unaligned buffers. Accepted; buffers are aligned.
    #[arg(short = 'u', long = "unalign", default_value_t = 0)]
    pub unalign: u32,
    /// nccl-tests' timestamps. Accepted; not printed.
    #[arg(short = 'S', long = "report_timestamps", default_value_t = 0)]
    pub report_timestamps: u32,
}

impl Args {
    /// The nccl-tests flags given that change nothing here, each with why (for the header).
    pub fn inert_flags(&self) -> Vec<String> {
        let mut v = Vec::new();
        let mut note = |set: bool, flag: String, why: &str| {
            if set {
                v.push(format!("{flag} ({why})"));
            }
        };
        note(
            self.nthreads != 1,
            format!("-t {}", self.nthreads),
            "one rank per process: ranks come from the launcher or --np",
        );
        note(self.ngpus != 1, format!("-g {}", self.ngpus), "one device per rank");
        note(self.parallel_init != 0, "-p".into(), "rendezvous is always concurrent");
        note(self.blocking != 0, format!("-z {}", self.blocking), "collectives block until done");
        note(self.cudagraph != 0, "-G".into(), "no CUDA graphs");
        note(self.report_cputime != 0, "-C".into(), "times are wall-clock");
        let gathers = matches!(self.coll.as_str(), "allgather" | "all");
        let why = if self.device != "host" {
            "shared buffers are host memory"
        } else {
            "only the in-place all-gather runs on shared buffers"
        };
        note(self.local_register != 0 && (self.device != "host" || !gathers), "-R".into(), why);
        note(self.per_iter_skip != 0, "-K".into(), "warm-up iterations (-w) skip instead");
        note(self.memory_report != 0, "-M".into(), "no memory report");
        note(self.unalign != 0, "-u".into(), "buffers are aligned");
        note(self.report_timestamps != 0, "-S".into(), "no timestamps");
        v
    }

    /// The sizes of the sweep.
    pub fn sizes(&self) -> Vec<u64> {
        let mut v = Vec::new();
        let mut s = self.minbytes;
        while s <= self.maxbytes {
            v.push(s);
            let next = match self.stepfactor {
                Some(f) if f > 1 => s.saturating_mul(f),
                _ => s.saturating_add(self.stepbytes.max(1)),
            };
            if next == s {
                break;
            }
            s = if next == 0 { 1 } else { next };
        }
        v
    }

    fn colls(&self) -> Result<Vec<&'static str>, String> {
        if self.coll == "all" {
            return Ok(COLLECTIVES.to_vec());
        }
        let name = self
            .coll
            .trim_end_matches("_perf")
            .replace("all_reduce", "allreduce")
            .replace("all_gather", "allgather");
        COLLECTIVES.iter().find(|c| **c == name).map(|c| vec![*c]).ok_or_else(|| {
            format!(
                "unknown collective {:?}; choose from {} or all",
                self.coll,
                COLLECTIVES.join(", ")
            )
        })
    }
}

fn running_under_launcher() -> bool {
    ["RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"].iter().any(|k| std::env::var_os(k).is_some())
}

/// Validated settings shared by every rank.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The command line.
    pub args: Args,
    /// Collectives to run.
    pub colls: Vec<&'static str>,
    /// Element type.
    pub dtype: DType,
    /// Reduction.
    pub op: ReduceOp,
    /// Forced algorithm.
    pub algo: Option<Algo>,
}

impl Settings {
    /// Validate the arguments.
    ///
    /// # Errors
    /// A message naming the bad flag.
    pub fn new(args: Args) -> Result<Settings, String> {
        let colls = args.colls()?;
        let dtype = DType::ALL.into_iter().find(|d| d.name() == args.dtype || short_dtype(*d) == args.dtype).ok_or_else(|| {
            format!("unknown datatype {:?}; choose from float, double, half, bfloat16, int8, uint8, int32, int64", args.dtype)
        })?;
        let op = ReduceOp::parse(&args.op).ok_or_else(|| {
            format!("unknown op {:?}; choose from sum, prod, min, max, avg", args.op)
        })?;
        let algo = match &args.algo {
            Some(a) => Some(Algo::parse(a).ok_or_else(|| {
                let names: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
                format!("unknown algorithm {a:?}; choose from {}", names.join(", "))
            })?),
            None => None,
        };
        let mut colls = colls;
        if let Some(a) = algo {
            let runs = |c: &str| Coll::parse(c).is_some_and(|c| c.algos().contains(&a));
            if args.coll == "all" {
                colls.retain(|c| runs(c));
                if colls.is_empty() {
                    return Err(format!("--algo {a} implements none of collbench's collectives"));
                }
            } else if let Some(c) = colls.first().filter(|c| !runs(c)) {
                let by: Vec<&str> = Coll::parse(c)
                    .map(|c| c.algos().iter().map(|a| a.name()).collect())
                    .unwrap_or_default();
                return Err(format!(
                    "--algo {a} does not implement {c}; {c} runs {}",
                    if by.is_empty() {
                        "no selectable algorithm".to_string()
                    } else {
                        by.join(", ")
                    }
                ));
            }
        }
        if args.iters == 0 {
            return Err("-n (iterations) must be at least 1".into());
        }
        if let Some(np) = args.np.filter(|n| !(1..=MAX_NP).contains(n)) {
            return Err(format!(
                "--np {np}: the number of local ranks to start must be 1 to {MAX_NP} (for more, \
                 start them with a launcher: tutti-run --nproc N -- collbench …)"
            ));
        }
        if args.minbytes > args.maxbytes {
            return Err(format!(
                "-b (smallest size, {}) is larger than -e (largest size, {}): nothing to \
                 measure; give -b ≤ -e",
                args.minbytes, args.maxbytes
            ));
        }
        match args.stepfactor {
            Some(f @ (0 | 1)) => {
                return Err(format!(
                    "-f {f}: the step factor multiplies each size to get the next, so it must be \
                     at least 2 (for equal steps use -i BYTES instead)"
                ))
            }
            None if args.stepbytes == 0 && args.minbytes < args.maxbytes => {
                return Err(
                    "-i 0: the step between sizes must be at least 1 byte (or give -f)".into()
                )
            }
            _ => {}
        }
        if args.min_bw.is_some_and(|m| !m.is_finite() || m < 0.0) {
            return Err("--min-bw must be a number of GB/s, 0 or more".into());
        }
        if let Some(t) = &args.transport {
            if !matches!(t.as_str(), "tcp" | "quic" | "mem") {
                return Err(format!("--transport {t:?}: choose tcp, quic or mem"));
            }
        }
        if !matches!(args.device.as_str(), "host" | "sim" | "cuda" | "nccl") {
            return Err(format!(
                "unknown device {:?}; choose from host, sim, cuda, nccl",
                args.device
            ));
        }
        if args.min_bw.is_some() && colls == ["barrier"] {
            return Err("--min-bw has nothing to check: barrier moves no bytes".into());
        }
        if args.device != "host" && !colls.iter().any(|c| bench::DEVICE_COLLS.contains(c)) {
            return Err(format!(
                "--device {} runs {}; {} is not one of them",
                args.device,
                bench::DEVICE_COLLS.join(", "),
                args.coll
            ));
        }
        Ok(Settings { args, colls, dtype, op, algo })
    }

    /// What can only be checked once the world's size `n` is known: the root of rooted
    /// collectives, and a forced algorithm's needs (a power-of-two world).
    ///
    /// # Errors
    /// A message naming the flag.
    pub fn check_world(&self, n: usize) -> Result<(), String> {
        let rooted = ["broadcast", "reduce", "gather", "scatter"];
        if self.args.root >= n && self.colls.iter().any(|c| rooted.contains(c)) {
            return Err(format!(
                "-r {}: the root of {} must be a rank of the {n} ranks (0 to {})",
                self.args.root,
                self.colls
                    .iter()
                    .filter(|c| rooted.contains(c))
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", "),
                n - 1
            ));
        }
        if let Some(a) = self.algo {
            for c in self.colls.iter().filter_map(|c| Coll::parse(c)) {
                c.supports(a, n, true)
                    .map_err(|why| format!("--algo {a} with {n} ranks: {why}"))?;
            }
        }
        Ok(())
    }

    /// Whether the output files (-J, --plot) can be written, checked before anything runs (by
    /// creating them; the results overwrite them at the end).
    ///
    /// # Errors
    /// A message naming the flag and the file.
    pub fn check_outputs(&self) -> Result<(), String> {
        for (flag, p) in [("-J", &self.args.json), ("--plot", &self.args.plot)] {
            if let Some(p) = p {
                std::fs::File::create(p)
                    .map_err(|e| format!("{flag} {}: cannot write the file: {e}", p.display()))?;
            }
        }
        Ok(())
    }

    /// The transport of a run that starts its own ranks: `--transport`, else `TUTTI_TRANSPORT`,
    /// else tcp; with a note when the flag wins over a different variable.
    ///
    /// # Errors
    /// A message naming a malformed runtime variable (`TUTTI_TRANSPORT` naming no transport,
    /// among others).
    pub fn local_transport(&self) -> Result<(String, Option<String>), String> {
        // The runtime's settings, checked first, refuse a TUTTI_TRANSPORT that names no
        // transport; here it only matters whether it is set, and to what.
        tutti_runtime::rendezvous::Options::from_env().map_err(|e| e.to_string())?;
        let env = std::env::var("TUTTI_TRANSPORT").ok().filter(|v| !v.trim().is_empty());
        Ok(match (&self.args.transport, env) {
            (Some(flag), Some(v)) if flag != v.trim() => (
                flag.clone(),
                Some(format!("--transport {flag} wins over TUTTI_TRANSPORT={}", v.trim())),
            ),
            (Some(flag), _) => (flag.clone(), None),
            (None, Some(v)) => (v.trim().to_string(), None),
            (None, None) => ("tcp".into(), None),
        })
    }

    /// Notes for settings that a flag takes over from a variable (`-T` over `TUTTI_TIMEOUT`,
    /// `--algo` over `TUTTI_ALGO`).
    pub fn overrides(&self) -> Vec<String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let mut v = Vec::new();
        if let (true, Some(t)) = (self.args.timeout > 0, var("TUTTI_TIMEOUT")) {
            v.push(format!("-T {} wins over TUTTI_TIMEOUT={t}", self.args.timeout));
        }
        if let (Some(a), Some(t)) = (&self.args.algo, var("TUTTI_ALGO")) {
            v.push(format!("--algo {a} wins over TUTTI_ALGO={t} for every collective"));
        }
        v
    }
}

fn short_dtype(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I8 => "i8",
        DType::U8 => "u8",
        DType::I32 => "i32",
        DType::I64 => "i64",
        _ => "?",
    }
}

/// Run the benchmark as one rank; rank 0 prints. Returns the process exit code.
pub fn run_rank(comm: Comm, s: &Settings, transport: &str) -> i32 {
    if s.args.timeout > 0 {
        comm.group().set_timeout(Duration::from_secs(s.args.timeout));
    }
    let mut bench = Bench::new(comm, s.clone(), transport);
    match bench.run() {
        Ok(code) => code,
        Err(_) if crate::stdout_closed() => {
            // The output's reader went away and rank 0 ended for it; this is not a failure.
            crate::die_of_sigpipe()
        }
        Err(e) => {
            // tutti's errors start with the rank already; others get it here.
            let msg = e.to_string();
            let mine = format!("rank {}:", bench.rank());
            let line = if msg.starts_with(&mine) {
                format!("collbench: {msg}\n")
            } else {
                format!("collbench: {mine} {msg}\n")
            };
            // One write: the ranks of a job share stderr, and a line written in pieces would
            // interleave with theirs.
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            1
        }
    }
}

/// The `collbench` program.
pub fn main() -> ExitCode {
    crate::init_tracing();
    let args = Args::parse();
    let settings = match Settings::new(args) {
        Ok(s) => s,
        Err(e) => return usage(&e),
    };
    let code = if running_under_launcher() {
        under_launcher(&settings)
    } else {
        match start_local(&settings) {
            Ok(code) => code,
            Err(e) => return usage(&e),
        }
    };
    ExitCode::from(code.clamp(0, 255) as u8)
}

fn usage(e: &str) -> ExitCode {
    eprintln!("collbench: {e}");
    ExitCode::from(2)
}

fn note(settings: &Settings, extra: Option<String>) {
    for n in extra.into_iter().chain(settings.overrides()) {
        eprintln!("collbench: note: {n}");
    }
}

/// One rank of a job a launcher started: the world and the transport are the launcher's.
fn under_launcher(settings: &Settings) -> i32 {
    let comm = match Comm::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("collbench: {e}");
            // A malformed variable is bad input (2), like a bad flag; anything else failed (1).
            let bad_input =
                matches!(&e, tutti_collectives::Error::Runtime(tutti_runtime::Error::Config(_)));
            return if bad_input { 2 } else { 1 };
        }
    };
    let t = comm.group().transport().name();
    let mut wrong = Vec::new();
    if let Some(np) = settings.args.np.filter(|np| *np != comm.size()) {
        wrong.push(format!(
            "--np {np} disagrees with the launcher's world of {} ranks (under a launcher the \
             launcher's world wins: drop --np, or start {np} ranks)",
            comm.size()
        ));
    }
    if let Some(flag) = settings.args.transport.as_deref().filter(|f| *f != t) {
        wrong.push(format!(
            "--transport {flag} disagrees with this job's transport {t} (under a launcher \
             TUTTI_TRANSPORT sets it for every rank: drop --transport, or set \
             TUTTI_TRANSPORT{})",
            if flag == "mem" {
                " (mem runs only as --np threads)".to_string()
            } else {
                format!("={flag}")
            }
        ));
    }
    if let Err(e) = settings.check_world(comm.size()) {
        wrong.push(e);
    }
    if let Some(w) = wrong.first() {
        if comm.rank() == 0 {
            eprintln!("collbench: {w}");
        }
        return 2;
    }
    // Rank 0 writes the output files: it checks them, and every rank learns its verdict, so a
    // job with an unwritable -J stops before measuring, all ranks alike.
    let mut verdict = [0u8];
    if comm.rank() == 0 {
        if let Err(e) = settings.check_outputs() {
            eprintln!("collbench: {e}");
            verdict[0] = 1;
        }
    }
    if let Err(e) = comm.broadcast(&mut verdict, 0) {
        eprintln!("collbench: rank {}: {e}", comm.rank());
        return 1;
    }
    if verdict[0] != 0 {
        return 2;
    }
    // The ranks that collbench --np started itself: their parent already said the notes.
    if comm.rank() == 0 && std::env::var_os("TUTTI_COLLBENCH_CHILD").is_none() {
        note(settings, None);
    }
    run_rank(comm, settings, t)
}

/// Start `--np` local ranks: threads over memory, or processes over TCP or QUIC.
fn start_local(settings: &Settings) -> Result<i32, String> {
    // Every variable the ranks will read is checked here, before anything starts, so a typo in
    // one is an error naming it rather than a value silently ignored (the runtime's settings
    // in `local_transport`, the collectives' here).
    let (transport, flag_note) = settings.local_transport()?;
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    let np = settings.args.np.unwrap_or(4);
    settings.check_world(np)?;
    settings.check_outputs()?;
    note(settings, flag_note);
    if transport == "mem" {
        let comms = tutti_runtime::Group::mem_world(np)
            .into_iter()
            .map(|g| Comm::with_config(g, cfg.clone()))
            .collect::<Vec<_>>();
        let codes: Vec<i32> = std::thread::scope(|sc| {
            let hs: Vec<_> =
                comms.into_iter().map(|c| sc.spawn(|| run_rank(c, settings, "mem"))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(101)).collect()
        });
        return Ok(codes.into_iter().max().unwrap_or(0));
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let mut program = vec![exe.into_os_string()];
    program.extend(std::env::args_os().skip(1));
    let job = crate::launch::Job {
        nproc: np,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        token: None,
        program,
        prefix: false,
        log_dir: None,
        grace: Duration::from_secs(2),
        name: "collbench",
        // The ranks are told the transport, and no notes again (the parent said them).
        env: vec![
            ("TUTTI_TRANSPORT".into(), transport),
            ("TUTTI_COLLBENCH_CHILD".into(), "1".into()),
        ],
        elastic: false,
        max_restarts: 0,
        bind: settings.args.bind.cpus(np),
    };
    crate::launch::run(&job).or_else(|e| {
        eprintln!("collbench: {e}");
        Ok(2)
    })
}
