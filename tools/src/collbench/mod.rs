//! collbench: nccl-tests for tutti.
//!
//! The same flags, columns, busbw factors and footer as nccl-tests (so existing parsers work),
//! plus per-iteration p50/p99 and the algorithm that ran in a second table after the footer and
//! in the JSON. Starts its own local ranks (`--np`, TCP on 127.0.0.1 or threads over memory) or
//! runs as one rank under `tutti-run`, `srun` or `mpirun`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tutti_collectives::{Algo, Comm, Config, DType, ReduceOp};

pub mod bench;
pub mod report;

pub use bench::Bench;
pub use report::{Row, Run};

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

/// Parse `8`, `1K`, `32M`, `1G` (binary multiples, as nccl-tests).
///
/// # Errors
/// A message for anything else.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("{s:?} is not a size (like 8, 64K, 32M, 1G)"))
}

/// Command line, nccl-tests compatible.
#[derive(Parser, Debug, Clone)]
#[command(name = "collbench", version, about = "nccl-tests-style benchmark of tutti's collectives")]
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
    #[arg(short = 'm', long = "agg_iters", default_value_t = 1)]
    pub agg: usize,
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
    #[arg(short = 'a', long = "average", default_value_t = 1)]
    pub average: u32,
    /// Per-iteration timing (p50/p99 are always in the extras table; accepted for
    /// compatibility).
    #[arg(short = 'I', long = "per_iter_timing", default_value_t = 0)]
    pub per_iter: u32,
    /// Per-operation timeout in seconds (0: tutti's default, 30 s).
    #[arg(short = 'T', long = "timeout", default_value_t = 0)]
    pub timeout: u64,
    /// Local ranks to start when not launched by tutti-run/srun/mpirun.
    #[arg(long = "np", default_value_t = 4)]
    pub np: usize,
    /// Transport for --np runs: tcp, quic or mem.
    #[arg(long, default_value = "tcp")]
    pub transport: String,
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
    /// postall, linear, dissemination, scatter_allgather).
    #[arg(long)]
    pub algo: Option<String>,
    /// Write results as JSON to FILE.
    #[arg(short = 'J', long = "json")]
    pub json: Option<std::path::PathBuf>,
    /// Plot busbw against size to FILE.svg.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// Exit non-zero when the average busbw of a collective is below this (GB/s).
    #[arg(long = "min-bw")]
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
    /// nccl-tests' buffer registration. Accepted; buffers are used in place, nothing to register.
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
        note(self.local_register != 0, "-R".into(), "nothing to register");
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
            Some(a) => Some(Algo::parse(a).ok_or_else(|| format!("unknown algorithm {a:?}"))?),
            None => None,
        };
        if args.iters == 0 {
            return Err("-n must be at least 1".into());
        }
        if !matches!(args.device.as_str(), "host" | "sim" | "cuda" | "nccl") {
            return Err(format!(
                "unknown device {:?}; choose from host, sim, cuda, nccl",
                args.device
            ));
        }
        Ok(Settings { args, colls, dtype, op, algo })
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
        Err(e) => {
            // tutti's errors start with the rank already; others get it here.
            let msg = e.to_string();
            let mine = format!("rank {}:", bench.rank());
            if msg.starts_with(&mine) {
                eprintln!("collbench: {msg}");
            } else {
                eprintln!("collbench: {mine} {msg}");
            }
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
        Err(e) => {
            eprintln!("collbench: {e}");
            return ExitCode::from(2);
        }
    };
    let code = if running_under_launcher() {
        match Comm::from_env() {
            Ok(c) => {
                let t = c.group().transport().name();
                run_rank(c, &settings, t)
            }
            Err(e) => {
                eprintln!("collbench: {e}");
                1
            }
        }
    } else {
        match settings.args.transport.as_str() {
            "mem" => {
                let comms = tutti_runtime::Group::mem_world(settings.args.np.max(1))
                    .into_iter()
                    .map(|g| Comm::with_config(g, Config::default()))
                    .collect::<Vec<_>>();
                let codes: Vec<i32> = std::thread::scope(|sc| {
                    let hs: Vec<_> = comms
                        .into_iter()
                        .map(|c| sc.spawn(|| run_rank(c, &settings, "mem")))
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap_or(101)).collect()
                });
                codes.into_iter().max().unwrap_or(0)
            }
            t @ ("tcp" | "quic") => {
                let exe = match std::env::current_exe() {
                    Ok(e) => e,
                    Err(e) => {
                        eprintln!("collbench: cannot find my own executable: {e}");
                        return ExitCode::from(2);
                    }
                };
                let mut program = vec![exe.into_os_string()];
                program.extend(std::env::args_os().skip(1));
                let job = crate::launch::Job {
                    nproc: settings.args.np.max(1),
                    nnodes: 1,
                    node_rank: 0,
                    master_addr: "127.0.0.1".into(),
                    master_port: 0,
                    token: None,
                    program,
                    prefix: false,
                    log_dir: None,
                    grace: Duration::from_secs(2),
                    env: vec![("TUTTI_TRANSPORT".into(), t.into())],
                    elastic: false,
                    max_restarts: 0,
                };
                match crate::launch::run(&job) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("{e}");
                        2
                    }
                }
            }
            other => {
                eprintln!("collbench: unknown transport {other:?} (tcp, quic or mem)");
                2
            }
        }
    };
    ExitCode::from(code.clamp(0, 255) as u8)
}
