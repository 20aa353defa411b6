//! `gpucheck`: the checks of `tools/gpu-check.sh` that need a GPU and a program of their own
//! (collbench covers the timings): the copy limit, the staged collectives against the host path
//! and the oracle on real GPU memory, faults in the middle of a collective, and NCCL.
//!
//! Every subcommand but `copy` is one rank of a job: run it under `tutti-run` (or any launcher
//! tutti rendezvouses under). Rank 0 prints one line per case, starting with the subcommand's
//! name, which the script collects into its summary table.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use tutti_collectives::device::cuda::CudaDevice;
use tutti_collectives::device::{
    self, CopySpan, Device, DeviceBuffer, HostStage, Staged, StagingConfig, Ticket,
};
use tutti_collectives::dtype::{as_bytes, as_bytes_mut};
use tutti_collectives::verify::{count_wrong, input, reduced, value};
use tutti_collectives::{Comm, Element, Error, ReduceOp, Result};

/// GPU checks (see tools/gpu-check.sh).
#[derive(Parser, Debug)]
#[command(name = "gpucheck")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// GPU ordinal (default: LOCAL_RANK modulo the GPUs present).
    #[arg(long, global = true)]
    gpu: Option<usize>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Copy bandwidth, pinned and pageable, each way, timed with CUDA events (pinned) and the
    /// host clock around a synchronous copy (pageable). One process.
    Copy {
        /// Sizes in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = [1usize << 20, 16 << 20, 256 << 20, 1 << 30])]
        sizes: Vec<usize>,
        /// Repetitions per point (the median is reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
    },
    /// Every staged collective on GPU buffers, bit for bit against the host collective on the
    /// same data and against the independent oracle.
    Correct {
        /// Element counts (per rank, per block for the collectives with blocks).
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 3, 1000, 65_537, 1_048_583, 16_777_259])]
        counts: Vec<usize>,
        /// Dtypes.
        #[arg(long, value_delimiter = ',', default_values_t = ["f32".to_string(), "f16".to_string(), "bf16".to_string()])]
        dtypes: Vec<String>,
        /// Bytes of the largest case (allreduce and broadcast, f32); 0 skips it.
        #[arg(long, default_value_t = 1 << 30)]
        big: usize,
    },
    /// A fault in the middle of a 256 MiB staged allreduce on rank `victim`: `cuda` (a real
    /// CUDA error: a copy to an address the GPU does not have) or `kill` (the process aborts
    /// between two copies). Every rank prints what it saw and when.
    Fault {
        /// cuda or kill.
        what: String,
        /// The rank that fails.
        #[arg(long, default_value_t = 1)]
        victim: usize,
    },
    /// NCCL: with one rank, every collective against the host path; with more ranks on one
    /// GPU, NCCL's refusal must come back as an error on every rank.
    Nccl {
        /// Element counts.
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 1000, 1_048_583])]
        counts: Vec<usize>,
    },
}

/// Run the tool.
///
/// # Errors
/// A failed setup (no GPU, no rendezvous); the checks themselves report mismatches as lines
/// and through the exit code.
pub fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucheck: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<bool> {
    let gpu = match cli.gpu {
        Some(g) => g,
        None => device::cuda::local_ordinal()?,
    };
    let dev = Arc::new(CudaDevice::new(gpu)?);
    match cli.cmd {
        Cmd::Copy { sizes, reps } => copy(&dev, &sizes, reps),
        Cmd::Correct { counts, dtypes, big } => correct(dev, &counts, &dtypes, big),
        Cmd::Fault { what, victim } => fault(dev, &what, victim),
        Cmd::Nccl { counts } => nccl(dev, &counts),
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-12) / 1e9
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn copy(dev: &Arc<CudaDevice>, sizes: &[usize], reps: usize) -> Result<bool> {
    let max = sizes.iter().copied().max().unwrap_or(0);
    let buf = dev.alloc(max)?;
    let pinned = dev.alloc_stage(max)?;
    let mut pageable = vec![1u8; max];
    dev.time_copies(true)?;
    println!("# copy: bytes, then GB/s: pinned H2D, pinned D2H, pageable H2D, pageable D2H");
    for &bytes in sizes {
        let mut t = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..reps.max(1) {
            for d2h in [false, true] {
                // SAFETY: both ranges are in bounds and nothing else touches them until the
                // wait below returns.
                unsafe {
                    if d2h {
                        dev.d2h(&*buf, 0, &*pinned, 0, bytes)?;
                    } else {
                        dev.h2d(&*pinned, 0, &*buf, 0, bytes)?;
                    }
                }
                let tk = dev.record()?;
                dev.wait(tk)?;
                let spans: Vec<CopySpan> = dev.copy_spans();
                let d: Duration = spans.iter().map(|s| s.end - s.start).sum();
                t[usize::from(d2h)].push(d);
            }
            let s = Instant::now();
            dev.upload(&pageable[..bytes], &*buf)?;
            t[2].push(s.elapsed());
            let s = Instant::now();
            dev.download(&*buf, &mut pageable[..bytes])?;
            t[3].push(s.elapsed());
        }
        let [a, b, c, d] = t.map(median);
        println!(
            "copy {bytes:>12} {:>7.2} {:>7.2} {:>7.2} {:>7.2}",
            gbps(bytes, a),
            gbps(bytes, b),
            gbps(bytes, c),
            gbps(bytes, d)
        );
    }
    dev.time_copies(false)?;
    Ok(true)
}

fn up<T: Element>(dev: &dyn Device, v: &[T], len: usize) -> Result<Box<dyn DeviceBuffer>> {
    let b = dev.alloc(len.max(v.len()) * size_of::<T>())?;
    dev.upload(as_bytes(v), &*b)?;
    Ok(b)
}

fn down<T: Element>(dev: &dyn Device, b: &dyn DeviceBuffer, n: usize) -> Result<Vec<T>> {
    let mut v = vec![T::default(); n];
    dev.download(b, as_bytes_mut(&mut v))?;
    Ok(v)
}

/// Elements whose bits differ.
fn diff<T: Element>(a: &[T], b: &[T]) -> u64 {
    let (a, b) = (as_bytes(a), as_bytes(b));
    let w = size_of::<T>();
    if a.len() != b.len() {
        return u64::MAX;
    }
    a.chunks(w).zip(b.chunks(w)).filter(|(x, y)| x != y).count() as u64
}

/// One case's result on this rank: elements differing from the host path, from the oracle.
struct Case {
    name: String,
    bytes: usize,
    vs_host: u64,
    vs_oracle: u64,
    took: Duration,
}

const SEED: u64 = 23;

fn cases<T: Element>(st: &Staged, count: usize, ops: &[ReduceOp]) -> Result<Vec<Case>> {
    let c = st.comm();
    let (r, n) = (c.rank(), c.size());
    let dev = st.device().clone();
    let dev = &*dev;
    let esz = size_of::<T>();
    let mut out = Vec::new();
    let mut push = |name: String, bytes: usize, vs_host: u64, vs_oracle: u64, took: Duration| {
        out.push(Case { name, bytes, vs_host, vs_oracle, took });
    };
    for &op in ops {
        let x: Vec<T> = input(SEED, r, count, op);
        let mut host = x.clone();
        c.allreduce(&mut host, op)?;
        let b = up(dev, &x, count)?;
        let t = Instant::now();
        st.allreduce::<T>(&*b, count, op)?;
        let took = t.elapsed();
        let got = down::<T>(dev, &*b, count)?;
        let oracle = count_wrong(&host, |i| reduced(SEED, n, i, op));
        push(format!("allreduce/{}", op.name()), count * esz, diff(&got, &host), oracle, took);
    }
    let op = ReduceOp::Sum;
    let x: Vec<T> = input(SEED, r, count, op);
    // Out of place: the input stays.
    let (bi, bo) = (up(dev, &x, count)?, dev.alloc(count.max(1) * esz)?);
    let t = Instant::now();
    st.allreduce_from::<T>(&*bi, &*bo, count, op)?;
    let took = t.elapsed();
    let mut host = x.clone();
    c.allreduce(&mut host, op)?;
    let got = down::<T>(dev, &*bo, count)?;
    let kept = diff(&down::<T>(dev, &*bi, count)?, &x);
    push("allreduce_from".into(), count * esz, diff(&got, &host) + kept, 0, took);
    // Broadcast from the last rank.
    let root = n - 1;
    let b = up(dev, &x, count)?;
    let t = Instant::now();
    st.broadcast::<T>(&*b, count, root)?;
    let took = t.elapsed();
    let mut host = x.clone();
    c.broadcast(&mut host, root)?;
    let got = down::<T>(dev, &*b, count)?;
    let oracle = count_wrong(&host, |i| value(SEED, root, i, op));
    push("broadcast".into(), count * esz, diff(&got, &host), oracle, took);
    // Reduce to rank 0 (the others' buffers stay).
    let b = up(dev, &x, count)?;
    let t = Instant::now();
    st.reduce::<T>(&*b, count, op, 0)?;
    let took = t.elapsed();
    let mut host = x.clone();
    c.reduce(&mut host, op, 0)?;
    let got = down::<T>(dev, &*b, count)?;
    let (want, oracle) = if r == 0 {
        let o = count_wrong(&host, |i| reduced(SEED, n, i, op));
        (host, o)
    } else {
        (x.clone(), 0)
    };
    push("reduce".into(), count * esz, diff(&got, &want), oracle, took);
    // All-gather.
    let (bi, bo) = (up(dev, &x, count)?, dev.alloc((n * count).max(1) * esz)?);
    let t = Instant::now();
    st.allgather::<T>(&*bi, &*bo, count)?;
    let took = t.elapsed();
    let mut host = vec![T::default(); n * count];
    c.allgather(&x, &mut host)?;
    let got = down::<T>(dev, &*bo, n * count)?;
    let cc = count.max(1);
    let oracle = count_wrong(&host, |i| value(SEED, i / cc, i % cc, op));
    push("allgather".into(), n * count * esz, diff(&got, &host), oracle, took);
    // Reduce-scatter and all-to-all on n blocks.
    let big: Vec<T> = input(SEED + 1, r, n * count, op);
    let (bi, bo) = (up(dev, &big, n * count)?, dev.alloc(count.max(1) * esz)?);
    let t = Instant::now();
    st.reduce_scatter::<T>(&*bi, &*bo, count, op)?;
    let took = t.elapsed();
    let mut host = vec![T::default(); count];
    c.reduce_scatter(&big, &mut host, op)?;
    let got = down::<T>(dev, &*bo, count)?;
    let oracle = count_wrong(&host, |i| reduced(SEED + 1, n, r * count + i, op));
    push("reduce_scatter".into(), n * count * esz, diff(&got, &host), oracle, took);
    let (bi, bo) = (up(dev, &big, n * count)?, dev.alloc((n * count).max(1) * esz)?);
    let t = Instant::now();
    st.all_to_all::<T>(&*bi, &*bo, count)?;
    let took = t.elapsed();
    let mut host = vec![T::default(); n * count];
    c.all_to_all(&big, &mut host)?;
    let got = down::<T>(dev, &*bo, n * count)?;
    // Block i comes from rank i, which sent its block r.
    let oracle = count_wrong(&host, |k| value(SEED + 1, k / cc, r * count + k % cc, op));
    push("alltoall".into(), n * count * esz, diff(&got, &host), oracle, took);
    Ok(out)
}

/// The largest case: allreduce and broadcast of `bytes` of f32, against the host path and
/// (every 4093rd element, to keep it short) the oracle.
fn big_cases(st: &Staged, bytes: usize) -> Result<Vec<Case>> {
    let c = st.comm();
    let (r, n) = (c.rank(), c.size());
    let dev = st.device().clone();
    let count = bytes / 4;
    let op = ReduceOp::Sum;
    let x: Vec<f32> = input(SEED, r, count, op);
    let mut out = Vec::new();
    let b = up(&*dev, &x, count)?;
    let t = Instant::now();
    st.allreduce::<f32>(&*b, count, op)?;
    let took = t.elapsed();
    let mut host = x.clone();
    c.allreduce(&mut host, op)?;
    let got = down::<f32>(&*dev, &*b, count)?;
    let oracle = (0..count)
        .step_by(4093)
        .filter(|&i| host[i].to_bits() != reduced::<f32>(SEED, n, i, op).to_bits())
        .count() as u64;
    out.push(Case {
        name: "allreduce/sum".into(),
        bytes,
        vs_host: diff(&got, &host),
        vs_oracle: oracle,
        took,
    });
    drop((got, host, b));
    let root = n - 1;
    let b = up(&*dev, &x, count)?;
    let t = Instant::now();
    st.broadcast::<f32>(&*b, count, root)?;
    let took = t.elapsed();
    let got = down::<f32>(&*dev, &*b, count)?;
    let oracle = (0..count)
        .step_by(4093)
        .filter(|&i| got[i].to_bits() != value::<f32>(SEED, root, i, op).to_bits())
        .count() as u64;
    let want: Vec<f32> = input(SEED, root, count, op);
    out.push(Case {
        name: "broadcast".into(),
        bytes,
        vs_host: diff(&got, &want),
        vs_oracle: oracle,
        took,
    });
    Ok(out)
}

/// Sum every rank's mismatch counts and take the slowest time, print on rank 0; true when all
/// are zero.
fn report(c: &Comm, dtype: &str, count: usize, cases: Vec<Case>) -> Result<bool> {
    let mut ok = true;
    for k in cases {
        let mut v = [k.vs_host.min(1 << 40) as i64, k.vs_oracle.min(1 << 40) as i64];
        c.allreduce(&mut v, ReduceOp::Sum)?;
        let mut ms = [k.took.as_secs_f64() * 1e3];
        c.allreduce(&mut ms, ReduceOp::Max)?;
        let pass = v == [0, 0];
        ok &= pass;
        if c.rank() == 0 {
            println!(
                "correct n={} {dtype:<4} {:<15} count={count:<10} bytes={:<11} vs_host={} vs_oracle={} staged_ms={:.2} {}",
                c.size(),
                k.name,
                k.bytes,
                v[0],
                v[1],
                ms[0],
                if pass { "PASS" } else { "FAIL" }
            );
        }
    }
    Ok(ok)
}

fn correct(dev: Arc<CudaDevice>, counts: &[usize], dtypes: &[String], big: usize) -> Result<bool> {
    let comm = Comm::from_env()?;
    let st = comm.staged(dev, StagingConfig::from_env()?);
    let mut ok = true;
    let all = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg];
    for dt in dtypes {
        for (i, &count) in counts.iter().enumerate() {
            // Every op on the middle size, the sum on the others.
            let ops: &[ReduceOp] = if i == counts.len() / 2 { &all } else { &all[..1] };
            let cs = match dt.as_str() {
                "f32" => cases::<f32>(&st, count, ops)?,
                "f16" => cases::<half::f16>(&st, count, ops)?,
                "bf16" => cases::<half::bf16>(&st, count, ops)?,
                other => {
                    return Err(Error::InvalidArgument {
                        rank: comm.rank(),
                        op: "gpucheck",
                        detail: format!("dtype {other:?} (f32, f16, bf16)"),
                    })
                }
            };
            ok &= report(&comm, dt, count, cs)?;
        }
    }
    if big > 0 {
        let cs = big_cases(&st, big)?;
        ok &= report(&comm, "f32", big / 4, cs)?;
    }
    Ok(ok)
}

fn epoch_us() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros()).unwrap_or(0)
}

/// A CUDA device that fails on its `at`-th copy up: with a real CUDA error (a copy to a device
/// address that was never allocated) or by aborting the process.
struct Faulty {
    inner: Arc<CudaDevice>,
    at: usize,
    kill: bool,
    ups: AtomicUsize,
}

impl Device for Faulty {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>> {
        self.inner.alloc(bytes)
    }
    fn alloc_stage(&self, bytes: usize) -> Result<Box<dyn HostStage>> {
        self.inner.alloc_stage(bytes)
    }
    fn upload(&self, src: &[u8], dst: &dyn DeviceBuffer) -> Result<()> {
        self.inner.upload(src, dst)
    }
    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        self.inner.download(src, dst)
    }
    unsafe fn d2h(
        &self,
        src: &dyn DeviceBuffer,
        src_off: usize,
        dst: &dyn HostStage,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.d2h(src, src_off, dst, dst_off, len) }
    }
    unsafe fn h2d(
        &self,
        src: &dyn HostStage,
        src_off: usize,
        dst: &dyn DeviceBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        if self.ups.fetch_add(1, Ordering::Relaxed) + 1 == self.at {
            if self.kill {
                println!("fault victim aborts t_us={}", epoch_us());
                std::process::abort();
            }
            // A real driver error: a copy to a device address this process never allocated.
            // SAFETY: the driver checks the address and refuses the copy; nothing is written.
            let host = unsafe { std::slice::from_raw_parts(src.ptr().add(src_off), len) };
            let bogus: cudarc::driver::sys::CUdeviceptr = 0x10;
            // SAFETY: as above.
            let r = unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    bogus,
                    host,
                    self.inner.stream().cu_stream(),
                )
            };
            let detail = match r {
                Err(e) => format!("CUDA error from the driver: {e}"),
                Ok(()) => "the driver accepted a copy to an unallocated address".into(),
            };
            return Err(Error::Device { rank: 0, op: "copy", detail });
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.h2d(src, src_off, dst, dst_off, len) }
    }
    fn record(&self) -> Result<Ticket> {
        self.inner.record()
    }
    fn wait(&self, t: Ticket) -> Result<()> {
        self.inner.wait(t)
    }
}

fn fault(dev: Arc<CudaDevice>, what: &str, victim: usize) -> Result<bool> {
    let comm = Comm::from_env()?;
    let kill = match what {
        "kill" => true,
        "cuda" => false,
        other => {
            return Err(Error::InvalidArgument {
                rank: comm.rank(),
                op: "gpucheck",
                detail: format!("fault {other:?} (cuda, kill)"),
            })
        }
    };
    let me = comm.rank();
    let at = if me == victim { 40 } else { usize::MAX };
    let faulty: Arc<dyn Device> =
        Arc::new(Faulty { inner: dev, at, kill, ups: AtomicUsize::new(0) });
    let st = comm.staged(faulty.clone(), StagingConfig::from_env()?);
    let count = 64 << 20;
    let b = faulty.alloc(count * 4)?;
    comm.barrier()?;
    let t = Instant::now();
    let r = st.allreduce::<f32>(&*b, count, ReduceOp::Sum);
    let took = t.elapsed();
    match r {
        Ok(_) => {
            println!(
                "fault rank={me} what={what} no error after {:.1} ms",
                took.as_secs_f64() * 1e3
            );
            Ok(false)
        }
        Err(e) => {
            let msg = e.to_string().replace('\n', " | ");
            let named = me == victim || msg.contains(&format!("rank {victim}"));
            println!(
                "fault rank={me} what={what} t_us={} after_ms={:.1} names_victim={named} error={msg}",
                epoch_us(),
                took.as_secs_f64() * 1e3
            );
            Ok(named)
        }
    }
}

#[cfg(feature = "nccl")]
use tutti_collectives::device::nccl::NcclComm;

#[cfg(feature = "nccl")]
fn nccl(dev: Arc<CudaDevice>, counts: &[usize]) -> Result<bool> {
    let comm = Comm::from_env()?;
    let me = comm.rank();
    let t = Instant::now();
    let nc = match NcclComm::new(&comm, dev.clone()) {
        Ok(nc) => nc,
        Err(e) => {
            println!(
                "nccl rank={me} init failed after {:.1} ms: {}",
                t.elapsed().as_secs_f64() * 1e3,
                e.to_string().replace('\n', " | ")
            );
            // Several ranks on one GPU: NCCL must refuse, on every rank, in bounded time.
            return Ok(comm.size() > 1);
        }
    };
    println!(
        "nccl rank={me} init ok in {:.1} ms (world {})",
        t.elapsed().as_secs_f64() * 1e3,
        comm.size()
    );
    let mut ok = true;
    for &count in counts {
        ok &= nccl_cases::<f32>(&comm, &nc, &dev, count, "f32")?;
        ok &= nccl_cases::<half::f16>(&comm, &nc, &dev, count, "f16")?;
        ok &= nccl_cases::<half::bf16>(&comm, &nc, &dev, count, "bf16")?;
    }
    Ok(ok)
}

#[cfg(feature = "nccl")]
fn nccl_cases<T: Element>(
    c: &Comm,
    nc: &NcclComm,
    dev: &Arc<CudaDevice>,
    count: usize,
    dt: &str,
) -> Result<bool> {
    let (r, n) = (c.rank(), c.size());
    let dev: &dyn Device = &**dev;
    let esz = size_of::<T>();
    let mut ok = true;
    let mut line = |name: &str, bad: u64| {
        ok &= bad == 0;
        println!(
            "nccl n={n} {dt:<4} {name:<15} count={count:<10} vs_host={bad} {}",
            if bad == 0 { "PASS" } else { "FAIL" }
        );
    };
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
        let x: Vec<T> = input(SEED, r, count, op);
        let b = up(dev, &x, count)?;
        nc.allreduce::<T>(&*b, count, op)?;
        let mut host = x.clone();
        c.allreduce(&mut host, op)?;
        line(&format!("allreduce/{}", op.name()), diff(&down::<T>(dev, &*b, count)?, &host));
    }
    let op = ReduceOp::Sum;
    let x: Vec<T> = input(SEED, r, count, op);
    let (bi, bo) = (up(dev, &x, count)?, dev.alloc(count.max(1) * esz)?);
    nc.allreduce_from::<T>(&*bi, &*bo, count, op)?;
    let mut host = x.clone();
    c.allreduce(&mut host, op)?;
    line("allreduce_from", diff(&down::<T>(dev, &*bo, count)?, &host));
    let b = up(dev, &x, count)?;
    nc.broadcast::<T>(&*b, count, n - 1)?;
    let mut host = x.clone();
    c.broadcast(&mut host, n - 1)?;
    line("broadcast", diff(&down::<T>(dev, &*b, count)?, &host));
    let b = up(dev, &x, count)?;
    nc.reduce::<T>(&*b, count, op, 0)?;
    let mut host = x.clone();
    c.reduce(&mut host, op, 0)?;
    let got = down::<T>(dev, &*b, count)?;
    line("reduce", if r == 0 { diff(&got, &host) } else { 0 });
    let (bi, bo) = (up(dev, &x, count)?, dev.alloc((n * count).max(1) * esz)?);
    nc.allgather::<T>(&*bi, &*bo, count)?;
    let mut host = vec![T::default(); n * count];
    c.allgather(&x, &mut host)?;
    line("allgather", diff(&down::<T>(dev, &*bo, n * count)?, &host));
    let big: Vec<T> = input(SEED + 1, r, n * count, op);
    let (bi, bo) = (up(dev, &big, n * count)?, dev.alloc(count.max(1) * esz)?);
    nc.reduce_scatter::<T>(&*bi, &*bo, count, op)?;
    let mut host = vec![T::default(); count];
    c.reduce_scatter(&big, &mut host, op)?;
    line("reduce_scatter", diff(&down::<T>(dev, &*bo, count)?, &host));
    let (bi, bo) = (up(dev, &big, n * count)?, dev.alloc((n * count).max(1) * esz)?);
    nc.all_to_all::<T>(&*bi, &*bo, count)?;
    let mut host = vec![T::default(); n * count];
    c.all_to_all(&big, &mut host)?;
    line("alltoall", diff(&down::<T>(dev, &*bo, n * count)?, &host));
    Ok(ok)
}

#[cfg(not(feature = "nccl"))]
fn nccl(_dev: Arc<CudaDevice>, _counts: &[usize]) -> Result<bool> {
    Err(Error::CudaUnavailable {
        rank: 0,
        detail: "gpucheck was built without the `nccl` feature (cargo build --features nccl)"
            .into(),
    })
}
