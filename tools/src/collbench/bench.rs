//! The measurement loop of one rank.

use std::borrow::Cow;
use std::io::{IsTerminal, Write};
use tutti_runtime::clock::Moment;

use half::{bf16, f16};
use tutti_collectives::device::{overlap_fraction, Device, DeviceBuffer, Staged, StagingConfig};
use tutti_collectives::dtype::{as_bytes, as_bytes_mut};
use tutti_collectives::verify::{count_wrong, fill, reduced, value};
use tutti_collectives::{Comm, DType, Element, Error, ReduceOp, Result, Stats};

use super::report::{self, Mode, Row, Run};
use super::Settings;

const SEED: u64 = 0x7475_7474;

/// One collective call on prepared buffers: (communicator, input, output or in-place buffer,
/// op, root) to the call's stats (`None` for point-to-point).
type CallFn<T> = fn(&Comm, &[T], &mut [T], ReduceOp, usize) -> Result<Option<Stats>>;

/// One rank's benchmark state.
pub struct Bench {
    comm: Comm,
    s: Settings,
    transport: String,
    progress: bool,
    dev: Option<DevCtx>,
}

/// Device buffers: the device, its staging engine, and (feature `nccl`) the NCCL communicator.
struct DevCtx {
    device: std::sync::Arc<dyn Device>,
    /// The GPU (or simulated device) index this rank uses.
    ordinal: usize,
    staged: Staged,
    #[cfg(feature = "nccl")]
    nccl: Option<tutti_collectives::device::nccl::NcclComm>,
}

/// Collectives a device run covers.
pub(crate) const DEVICE_COLLS: [&str; 6] =
    ["allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce"];

/// The shape of one size of one collective.
#[derive(Debug, Clone, Copy)]
struct Dims {
    /// Elements per rank as nccl-tests counts them.
    count: usize,
    in_len: usize,
    out_len: usize,
    /// nccl-tests' S in bytes.
    bytes: u64,
    factor: f64,
    root: i64,
}

fn dims(coll: &str, size: u64, esize: usize, n: usize, root: usize) -> Dims {
    let nf = n as f64;
    let per = |c: usize| c;
    let (count, in_len, out_len, bytes, factor, rooted) = match coll {
        "allreduce" => {
            let c = size as usize / esize;
            (c, c, c, c * esize, 2.0 * (nf - 1.0) / nf, false)
        }
        "broadcast" | "reduce" => {
            let c = size as usize / esize;
            (c, c, c, c * esize, 1.0, true)
        }
        "sendrecv" => {
            let c = size as usize / esize;
            (c, c, c, c * esize, 1.0, false)
        }
        "allgather" => {
            let c = per(size as usize / esize / n);
            (c, c, c * n, c * n * esize, (nf - 1.0) / nf, false)
        }
        "reduce_scatter" => {
            let c = size as usize / esize / n;
            (c, c * n, c, c * n * esize, (nf - 1.0) / nf, false)
        }
        "alltoall" => {
            let c = size as usize / esize / n;
            (c * n, c * n, c * n, c * n * esize, (nf - 1.0) / nf, false)
        }
        "gather" => {
            let c = size as usize / esize / n;
            (c, c, c * n, c * n * esize, (nf - 1.0) / nf, true)
        }
        "scatter" => {
            let c = size as usize / esize / n;
            (c, c * n, c, c * n * esize, (nf - 1.0) / nf, true)
        }
        _ => (0, 0, 0, 0, 1.0, false),
    };
    Dims {
        count,
        in_len,
        out_len,
        bytes: bytes as u64,
        factor,
        root: if rooted { root as i64 } else { -1 },
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl Bench {
    /// A benchmark over `comm`.
    pub fn new(comm: Comm, s: Settings, transport: &str) -> Bench {
        let progress = comm.rank() == 0 && crate::colour_wanted(std::io::stderr().is_terminal());
        Bench { comm, s, transport: transport.to_string(), progress, dev: None }
    }

    /// Open the device of `--device` (for cuda/nccl GPU `LOCAL_RANK` modulo the GPUs present,
    /// so more local ranks than GPUs share them round-robin).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when the GPU path is not compiled in or not present.
    fn open_device(&mut self) -> Result<()> {
        let name = self.s.args.device.clone();
        if name == "host" {
            return Ok(());
        }
        #[cfg(feature = "nccl")]
        if name == "nccl" {
            tutti_collectives::device::nccl::require_library(self.comm.rank())?;
        }
        let local: usize =
            std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        #[cfg(feature = "cuda")]
        let local = match name.as_str() {
            "sim" => local,
            _ => tutti_collectives::device::cuda::local_ordinal().unwrap_or(local),
        };
        let device = tutti_collectives::device::open(&name, local).map_err(|e| match e {
            Error::CudaUnavailable { detail, .. } => {
                Error::CudaUnavailable { rank: self.comm.rank(), detail }
            }
            e => e,
        })?;
        if self.s.args.copy_timing {
            device.time_copies(true)?;
        }
        let staged = self.comm.staged(device.clone(), StagingConfig::from_env()?);
        #[cfg(feature = "nccl")]
        let nccl = if name == "nccl" {
            let cuda =
                std::sync::Arc::new(tutti_collectives::device::cuda::CudaDevice::new(local)?);
            Some(tutti_collectives::device::nccl::NcclComm::new(&self.comm, cuda)?)
        } else {
            None
        };
        #[cfg(not(feature = "nccl"))]
        if name == "nccl" {
            return Err(Error::CudaUnavailable {
                rank: self.comm.rank(),
                detail: "tutti was built without the `nccl` feature (cargo build --features nccl)"
                    .into(),
            });
        }
        self.dev = Some(DevCtx {
            device,
            ordinal: local,
            staged,
            #[cfg(feature = "nccl")]
            nccl,
        });
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Run every selected collective; returns the exit code (non-zero on wrong results or a
    /// bandwidth below `--min-bw`).
    ///
    /// # Errors
    /// Any collective failure.
    pub fn run(&mut self) -> Result<i32> {
        self.open_device()?;
        if self.dev.is_some() {
            self.s.colls.retain(|c| DEVICE_COLLS.contains(c));
        }
        let me = self.comm.rank();
        let n = self.comm.size();
        // Hosts and links (the measurement runs here, before any timing, on multi-host groups).
        let topo = self.comm.topology()?;
        let model = self.comm.link_model();
        let a = &self.s.args;
        if me == 0 {
            let step = match a.stepfactor {
                Some(f) if f > 1 => format!("{f}(factor)"),
                _ => format!("{}(bytes)", a.stepbytes),
            };
            crate::outln!(
                "# collbench (tutti {}): nranks {n} transport {} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} agg iters: {} validation: {}",
                env!("CARGO_PKG_VERSION"),
                self.transport,
                a.minbytes,
                a.maxbytes,
                a.warmup,
                a.iters,
                a.agg,
                a.check
            );
            if a.isolated {
                crate::outln!(
                    "# isolated: a barrier before every timed iteration; times are single calls"
                );
            }
        }
        // Every rank's device index, for the header (ranks may share a GPU), and how its links
        // move their bytes (shared memory to the ranks of its host).
        let (shm, unconnected) = self.link_counts();
        const REC: usize = 6;
        let mut ords = vec![0i64; REC * n];
        // The CPUs this rank may run on (`--bind`): a mask of CPUs 0–62 (-1: higher ones
        // too), the lowest, and how many.
        let cpus = crate::launch::allowed_cpus();
        let mask = if cpus.iter().any(|c| *c >= 63) {
            -1
        } else {
            cpus.iter().fold(0i64, |m, c| m | (1 << c))
        };
        let lowest = cpus.iter().min().map_or(-1, |c| *c as i64);
        let mine = [
            self.dev.as_ref().map_or(-1, |d| d.ordinal as i64),
            shm,
            unconnected,
            mask,
            lowest,
            cpus.len() as i64,
        ];
        self.comm.allgather(&mine, &mut ords)?;
        let t = self.comm.group().transport();
        let peers = self.peer_links()?;
        if me == 0 {
            crate::outln!("#");
            crate::outln!("# Using devices");
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            for (r, rec) in ords.chunks(REC).enumerate() {
                let (ord, shm, unc) = (&rec[0], rec[1], rec[2]);
                let cpus = match (rec[3], rec[4], rec[5]) {
                    (_, _, 0) => "cpus ?".to_string(),
                    (_, lowest, 1) => format!("cpu {lowest}"),
                    (m, _, _) if m > 0 => {
                        let list: Vec<usize> = (0..63).filter(|c| m & (1 << c) != 0).collect();
                        format!("cpus {}", crate::launch::describe_list(&list))
                    }
                    (_, lowest, k) => format!("{k} cpus from {lowest}"),
                };
                let kind = match a.device.as_str() {
                    "host" => "cpu".to_string(),
                    "nccl" => "nccl".to_string(),
                    d => format!("{d}, staged through host memory"),
                };
                let on = if topo.hosts() > 1 {
                    format!("host {}", topo.host_of(r))
                } else {
                    host.trim().to_string()
                };
                let dev = if *ord < 0 { "-".to_string() } else { ord.to_string() };
                let links = match &peers {
                    Some(p) => describe_peer_links(&p[r * n..(r + 1) * n], t.name()),
                    None => describe_links(n, shm, unc, t.name()),
                };
                crate::outln!(
                    "#  Rank {r:>2} Group  0 on {on:>10} device {dev:>2} [{kind}] {cpus} links: {links}"
                );
            }
            match model {
                Some(m) => crate::outln!(
                    "# Links: {} hosts; measured {:.1} us per message, {:.3} GB/s per host link, {:.2} ns per byte reduced: automatic choice by the cost model",
                    topo.hosts(),
                    m.alpha * 1e6,
                    1e-9 / m.beta,
                    m.gamma * 1e9
                ),
                None => crate::outln!(
                    "# Links: {} host(s), loopback-class: automatic choice by the built-in table",
                    topo.hosts()
                ),
            }
        }
        let inert = self.s.args.inert_flags();
        if me == 0 && !inert.is_empty() {
            crate::outln!("# nccl-tests flags accepted without effect here: {}", inert.join(", "));
        }
        let mut runs = Vec::new();
        let mut code = 0;
        let cycles = self.s.args.run_cycles;
        let mut cycle = 0u32;
        while cycles == 0 || cycle < cycles {
            cycle += 1;
            if me == 0 && cycles != 1 {
                crate::outln!(
                    "# cycle {cycle}{}",
                    if cycles == 0 { String::new() } else { format!(" of {cycles}") }
                );
            }
            for coll in self.s.colls.clone() {
                let run = match self.s.dtype {
                    DType::F32 => self.coll::<f32>(coll)?,
                    DType::F64 => self.coll::<f64>(coll)?,
                    DType::F16 => self.coll::<f16>(coll)?,
                    DType::BF16 => self.coll::<bf16>(coll)?,
                    DType::I8 => self.coll::<i8>(coll)?,
                    DType::U8 => self.coll::<u8>(coll)?,
                    DType::I32 => self.coll::<i32>(coll)?,
                    _ => self.coll::<i64>(coll)?,
                };
                if run.wrong() > 0 {
                    code = 1;
                }
                if let Some(min) = self.s.args.min_bw {
                    if coll != "barrier" && run.avg_busbw() < min {
                        if me == 0 {
                            eprintln!(
                            "collbench: {coll}: average busbw {:.3} GB/s is below --min-bw {min}",
                            run.avg_busbw()
                        );
                        }
                        code = 1;
                    }
                }
                runs.push(run);
            }
        }
        // Links connect on first use: say which ones the run needed.
        let name = self.comm.group().transport().name();
        let per: Vec<String> = match self.peer_links()? {
            Some(p) => p.chunks(n).map(|c| describe_peer_links(c, name)).collect(),
            None => {
                let (shm, unconnected) = self.link_counts();
                let mut after = vec![0i64; 2 * n];
                self.comm.allgather(&[shm, unconnected], &mut after)?;
                after.chunks(2).map(|c| describe_links(n, c[0], c[1], name)).collect()
            }
        };
        if me == 0 {
            let mut kinds = per.clone();
            kinds.sort();
            kinds.dedup();
            if kinds.len() == 1 {
                crate::outln!("# Links after the run, every rank: {}", kinds[0]);
            } else {
                crate::outln!("# Links after the run:");
                for (r, l) in per.iter().enumerate() {
                    crate::outln!("#  Rank {r:>2} links: {l}");
                }
            }
        }
        if me == 0 {
            if let Some(p) = &self.s.args.json {
                if let Err(e) = std::fs::write(p, report::json(&runs)) {
                    eprintln!("collbench: writing {}: {e}", p.display());
                    code = code.max(1);
                }
            }
            if let Some(p) = &self.s.args.plot {
                if let Err(e) = report::plot(&runs, p) {
                    eprintln!("collbench: {e}");
                    code = code.max(1);
                }
            }
        }
        Ok(code)
    }

    /// How every rank's link to every other goes, for groups of up to [`PER_PEER`] ranks (a
    /// collective step: every rank calls it): `n` codes per rank ([`LinkCode`]), on every rank;
    /// `None` for larger groups, whose reports give counts.
    fn peer_links(&self) -> Result<Option<Vec<i64>>> {
        let (me, n) = (self.comm.rank(), self.comm.size());
        if n > PER_PEER {
            return Ok(None);
        }
        let t = self.comm.group().transport();
        let mine: Vec<i64> = (0..n)
            .map(|p| {
                let code = if p == me {
                    LinkCode::Own
                } else {
                    match t.link_kind(p) {
                        "shm" => LinkCode::Shm,
                        "unconnected" => LinkCode::Unconnected,
                        _ => LinkCode::Net,
                    }
                };
                code as i64
            })
            .collect();
        let mut all = vec![0i64; n * n];
        self.comm.allgather(&mine, &mut all)?;
        Ok(Some(all))
    }

    /// This rank's links through shared memory, and those not connected (yet: links connect
    /// on first use).
    fn link_counts(&self) -> (i64, i64) {
        let (me, n) = (self.comm.rank(), self.comm.size());
        let t = self.comm.group().transport();
        let count = |kind: &str| (0..n).filter(|p| *p != me && t.link_kind(*p) == kind).count();
        (count("shm") as i64, count("unconnected") as i64)
    }

    fn coll<T: Element>(&mut self, coll: &'static str) -> Result<Run> {
        let me = self.comm.rank();
        let n = self.comm.size();
        let reduces = matches!(coll, "allreduce" | "reduce" | "reduce_scatter");
        let run_op = if reduces { self.s.op.name().to_string() } else { "none".into() };
        if me == 0 {
            crate::out!("{}", report::header());
        }
        let mut run = Run {
            collective: coll.to_string(),
            nranks: n,
            transport: self.transport.clone(),
            dtype: T::DTYPE.name().to_string(),
            op: run_op.clone(),
            rows: Vec::new(),
        };
        let sizes = if coll == "barrier" { vec![0] } else { self.s.args.sizes() };
        for size in sizes {
            if self.progress {
                eprint!("\r\x1b[2K[collbench] {coll} {size} B");
                let _ = std::io::stderr().flush();
            }
            let row = self.size::<T>(coll, size)?;
            if me == 0 {
                crate::outln!("{}", report::row(&row, T::DTYPE.name(), &run_op));
            }
            run.rows.push(row);
        }
        if self.progress {
            eprint!("\r\x1b[2K");
        }
        if me == 0 {
            crate::out!("{}", report::footer(&run));
        }
        if let Some(dev) = &self.dev {
            let (net, copies) = dev.staged.take_trace();
            if me == 0 && !copies.is_empty() {
                crate::outln!(
                    "# {coll} on {}: {:.0} % of the copy time ran while a segment was on the network ({} copies, {} segment collectives)",
                    dev.device.name(),
                    100.0 * overlap_fraction(&net, &copies),
                    copies.len(),
                    net.len()
                );
            }
        }
        Ok(run)
    }

    fn size<T: Element>(&mut self, coll: &'static str, size: u64) -> Result<Row> {
        let n = self.comm.size();
        let d = dims(coll, size, size_of::<T>(), n, self.s.args.root);
        let (oop, algo) = self.mode::<T>(coll, d, false)?;
        let (ip, _) = self.mode::<T>(coll, d, true)?;
        Ok(Row {
            bytes: d.bytes,
            count: d.count as u64,
            root: d.root,
            algo,
            oop,
            ip,
            p50_us: oop.p50_us,
            p99_us: oop.p99_us,
        })
    }

    /// The call of `coll` on prepared buffers (input, output or in-place buffer, op, root),
    /// chosen once per mode: the timed loop then makes the call itself and nothing else.
    fn caller<T: Element>(coll: &str, ip: bool) -> CallFn<T> {
        match (coll, ip) {
            ("allreduce", false) => |c, i, o, op, _| c.allreduce_from(i, o, op).map(Some),
            ("allreduce", true) => |c, _, o, op, _| c.allreduce(o, op).map(Some),
            ("broadcast", false) => |c, i, o, _, root| c.broadcast_from(i, o, root).map(Some),
            ("broadcast", true) => |c, _, o, _, root| c.broadcast(o, root).map(Some),
            ("reduce", false) => |c, i, o, op, root| c.reduce_from(i, o, op, root).map(Some),
            ("reduce", true) => |c, _, o, op, root| c.reduce(o, op, root).map(Some),
            ("allgather", false) => |c, i, o, _, _| c.allgather(i, o).map(Some),
            ("allgather", true) => |c, _, o, _, _| c.allgather_inplace(o).map(Some),
            ("reduce_scatter", false) => |c, i, o, op, _| c.reduce_scatter(i, o, op).map(Some),
            ("reduce_scatter", true) => |c, _, o, op, _| c.reduce_scatter_inplace(o, op).map(Some),
            ("alltoall", false) => |c, i, o, _, _| c.all_to_all(i, o).map(Some),
            ("alltoall", true) => |c, _, o, _, _| c.all_to_all_inplace(o).map(Some),
            ("gather", false) => |c, i, o, _, root| c.gather(i, o, root).map(Some),
            ("gather", true) => |c, _, o, _, root| c.gather_inplace(o, root).map(Some),
            ("scatter", false) => |c, i, o, _, root| c.scatter(i, o, root).map(Some),
            ("scatter", true) => |c, _, o, _, root| c.scatter_inplace(o, root).map(Some),
            ("sendrecv", _) => |c, i, o, _, _| {
                let (r, n) = (c.rank(), c.size());
                c.sendrecv(i, (r + 1) % n, o, (r + n - 1) % n, 0).map(|_| None)
            },
            _ => |c, _, _, _, _| c.barrier().map(Some),
        }
    }

    /// Buffers for one mode: (input, output-or-inplace buffer) filled with exact data.
    fn buffers<T: Element>(&self, coll: &str, d: Dims, ip: bool) -> (Vec<T>, Vec<T>) {
        let (r, op, root) = (self.comm.rank(), self.s.op, self.s.args.root);
        let mut inp = vec![T::default(); d.in_len];
        fill(&mut inp, SEED, r, 0, op);
        // sendrecv cannot alias its buffers: its "in-place" column repeats the measurement.
        if !ip || coll == "sendrecv" {
            return (inp, vec![T::default(); d.out_len]);
        }
        let full = d.in_len.max(d.out_len);
        let mut buf = vec![T::default(); full];
        match coll {
            "allgather" | "gather" => buf[r * d.count..(r + 1) * d.count].copy_from_slice(&inp),
            "broadcast" | "scatter" if r != root => {}
            _ => buf[..d.in_len].copy_from_slice(&inp),
        }
        (Vec::new(), buf)
    }

    fn verify<T: Element>(&self, coll: &str, d: Dims, ip: bool, out: &[T]) -> u64 {
        let (r, n, op, root) = (self.comm.rank(), self.comm.size(), self.s.op, self.s.args.root);
        let c = d.count;
        match coll {
            "allreduce" => count_wrong(out, |i| reduced(SEED, n, i, op)),
            "broadcast" => count_wrong(out, |i| value(SEED, root, i, op)),
            "reduce" if r == root => count_wrong(out, |i| reduced(SEED, n, i, op)),
            "allgather" => count_wrong(out, |i| value(SEED, i / c.max(1), i % c.max(1), op)),
            "reduce_scatter" => {
                let mine = if ip { &out[r * c..(r + 1) * c] } else { out };
                count_wrong(mine, |i| reduced(SEED, n, r * c + i, op))
            }
            "alltoall" => {
                let b = c / n.max(1);
                count_wrong(out, |i| value(SEED, i / b.max(1), r * b + i % b.max(1), op))
            }
            "gather" if r == root => {
                count_wrong(out, |i| value(SEED, i / c.max(1), i % c.max(1), op))
            }
            "scatter" => {
                let mine = if ip { &out[r * c..(r + 1) * c] } else { out };
                count_wrong(mine, |i| value(SEED, root, r * c + i, op))
            }
            "sendrecv" => count_wrong(out, |i| value(SEED, (r + n - 1) % n, i, op)),
            _ => 0,
        }
    }

    fn mode<T: Element>(
        &mut self,
        coll: &'static str,
        d: Dims,
        ip: bool,
    ) -> Result<(Mode, String)> {
        if self.dev.is_some() {
            return self.mode_dev::<T>(coll, d, ip);
        }
        let c = match self.s.algo {
            Some(a) => self.comm.with_algo(a),
            None => self.comm.clone(),
        };
        let (inp, mut out) = self.buffers::<T>(coll, d, ip);
        if ip && coll == "allgather" && self.s.args.local_register != 0 {
            return self.mode_shared::<T>(&c, d, out);
        }
        let mut wrong = 0u64;
        let mut algo = String::from("-");
        let (f, op, root) = (Self::caller::<T>(coll, ip), self.s.op, self.s.args.root);
        if self.s.args.check > 0 {
            if let Some(st) = f(&c, &inp, &mut out, op, root)? {
                algo = st.algo.name().to_string();
            }
            wrong = self.verify(coll, d, ip, &out);
        }
        // The algorithm's name is borrowed: the timed loop allocates nothing of its own.
        let mut call = |_: &Bench| -> Result<Option<Cow<'static, str>>> {
            Ok(f(&c, &inp, &mut out, op, root)?.map(|st| Cow::Borrowed(st.algo.name())))
        };
        self.measure(d, wrong, algo, &mut call)
    }

    /// The in-place all-gather on a shared buffer (`-R`), which starts as `init`.
    fn mode_shared<T: Element>(
        &mut self,
        c: &Comm,
        d: Dims,
        init: Vec<T>,
    ) -> Result<(Mode, String)> {
        let mut buf = c.shared_buffer::<T>(init.len())?;
        buf.copy_from_slice(&init);
        drop(init);
        let mut wrong = 0u64;
        let mut algo = String::from("-");
        if self.s.args.check > 0 {
            algo = format!("{}+shared", c.allgather_shared(&mut buf)?.algo.name());
            wrong = self.verify("allgather", d, true, &buf);
        }
        let mut call = |_: &Bench| -> Result<Option<Cow<'static, str>>> {
            c.allgather_shared(&mut buf)?;
            Ok(Some(Cow::Borrowed("direct+shared")))
        };
        self.measure(d, wrong, algo, &mut call)
    }

    /// The same on device buffers: the input uploaded once, the collective staged (or NCCL),
    /// the output downloaded once for the check. In-place modes run allreduce in place; the
    /// other collectives repeat the out-of-place call.
    fn mode_dev<T: Element>(
        &mut self,
        coll: &'static str,
        d: Dims,
        ip: bool,
    ) -> Result<(Mode, String)> {
        let Some(dev) = &self.dev else {
            return Err(Error::InvalidArgument {
                rank: self.rank(),
                op: "collbench",
                detail: "no device".into(),
            });
        };
        let device = dev.device.clone();
        let (inp, out) = self.buffers::<T>(coll, d, false);
        let esz = size_of::<T>();
        let din = device.alloc(d.in_len.max(1) * esz)?;
        let dout = device.alloc(d.out_len.max(1) * esz)?;
        let in_place = ip && coll == "allreduce";
        // Broadcast and reduce work in place on the output buffer.
        let into_out = in_place || matches!(coll, "broadcast" | "reduce");
        device.upload(as_bytes(&inp), if into_out { &*dout } else { &*din })?;
        let mut call = |b: &Bench| -> Result<Option<Cow<'static, str>>> {
            b.call_dev::<T>(coll, d, in_place, &*din, &*dout).map(|x| Some(Cow::Owned(x)))
        };
        let check = self.s.args.check > 0;
        let mut algo = String::from("-");
        let mut wrong = 0u64;
        if check {
            algo = call(self)?.unwrap_or_default().into_owned();
            let mut host = out;
            device.download(&*dout, as_bytes_mut(&mut host))?;
            wrong = self.verify(coll, d, false, &host);
        }
        self.measure(d, wrong, algo, &mut call)
    }

    fn call_dev<T: Element>(
        &self,
        coll: &str,
        d: Dims,
        in_place: bool,
        din: &dyn DeviceBuffer,
        dout: &dyn DeviceBuffer,
    ) -> Result<String> {
        let Some(dev) = &self.dev else { return Ok("-".into()) };
        let op = self.s.op;
        #[cfg(feature = "nccl")]
        if let Some(nc) = &dev.nccl {
            match coll {
                "allreduce" if in_place => nc.allreduce::<T>(dout, d.count, op)?,
                "allreduce" => nc.allreduce_from::<T>(din, dout, d.count, op)?,
                "allgather" => nc.allgather::<T>(din, dout, d.count)?,
                "reduce_scatter" => nc.reduce_scatter::<T>(din, dout, d.count, op)?,
                "broadcast" => nc.broadcast::<T>(dout, d.count, self.s.args.root)?,
                "reduce" => nc.reduce::<T>(dout, d.count, op, self.s.args.root)?,
                "alltoall" => nc.all_to_all::<T>(din, dout, d.count / self.comm.size().max(1))?,
                _ => {
                    return Err(Error::InvalidArgument {
                        rank: self.rank(),
                        op: "collbench",
                        detail: format!("{coll} has no NCCL path here"),
                    })
                }
            }
            return Ok("nccl".into());
        }
        let st = match coll {
            "allreduce" if in_place => dev.staged.allreduce::<T>(dout, d.count, op)?,
            "allreduce" => dev.staged.allreduce_from::<T>(din, dout, d.count, op)?,
            "allgather" => dev.staged.allgather::<T>(din, dout, d.count)?,
            "reduce_scatter" => dev.staged.reduce_scatter::<T>(din, dout, d.count, op)?,
            "broadcast" => dev.staged.broadcast::<T>(dout, d.count, self.s.args.root)?,
            "reduce" => dev.staged.reduce::<T>(dout, d.count, op, self.s.args.root)?,
            _ => dev.staged.all_to_all::<T>(din, dout, d.count / self.comm.size().max(1))?,
        };
        Ok(format!("staged:{}", st.algo.map_or("-", |a| a.name())))
    }

    /// Warm up, time `iters`, combine over ranks.
    fn measure(
        &mut self,
        d: Dims,
        wrong: u64,
        mut algo: String,
        // Generic, not `dyn`: the timed loop calls the closure in line.
        call: &mut impl FnMut(&Bench) -> Result<Option<Cow<'static, str>>>,
    ) -> Result<(Mode, String)> {
        let a = self.s.args.clone();
        // With tuning on (TUTTI_TUNE=1), warm up at least as long as a size class takes to try
        // its candidates (at most 5 algorithms per collective, 5 runs each, two passes), so the
        // timed iterations measure the choice.
        let tuning = std::env::var("TUTTI_TUNE").is_ok_and(|v| v.trim() == "1");
        let warmup = if tuning { a.warmup.max(5 * 5 * 2 + 1) } else { a.warmup };
        let mut last = None;
        // The barrier that starts the timing warms up too: links connect on first use, and at
        // 64 ranks on 2 cores a first barrier that connects its links left the ranks 25–34 ms
        // apart, which the first timed iteration took in.
        self.comm.barrier()?;
        for _ in 0..warmup {
            if let Some(x) = call(self)? {
                last = Some(x);
            }
        }
        self.comm.barrier()?;
        // Back to back, one clock reading per iteration: each one's end is the next one's start.
        // The runtime's clock: a counter read where the machine has a reliable one. The
        // readings are kept as they are and turned into times after the loop.
        // Both written in full before the loop, so that no page of theirs is first touched
        // (a page fault) while the loop runs.
        let mut ends = vec![Moment::now(); a.iters];
        let mut starts = vec![Moment::now(); if a.isolated { a.iters + 1 } else { 1 }];
        starts[0] = Moment::now();
        for i in 0..a.iters {
            if a.isolated {
                self.comm.barrier()?;
                starts[i + 1] = Moment::now();
            }
            for _ in 0..a.agg.max(1) {
                if let Some(x) = call(self)? {
                    last = Some(x);
                }
            }
            ends[i] = Moment::now();
        }
        let per = 1e6 / a.agg.max(1) as f64;
        let mut iter_us: Vec<f64> = (0..ends.len())
            .map(|i| {
                // Isolated: from the barrier's end; otherwise from the previous iteration's end.
                let t = match (a.isolated, i) {
                    (true, _) => starts[i + 1],
                    (false, 0) => starts[0],
                    (false, _) => ends[i - 1],
                };
                ends[i].since(t).as_secs_f64() * per
            })
            .collect();
        if let Some(x) = last {
            algo = x.into_owned();
        }
        let mean: f64 = iter_us.iter().sum::<f64>() / iter_us.len() as f64;
        // Combine over ranks: the -a statistic of the mean, the max per iteration, wrong counts.
        let n = self.comm.size() as f64;
        let time_us = match a.average {
            0 => {
                let mut v = [mean];
                self.comm.broadcast(&mut v, 0)?;
                v[0]
            }
            2 | 3 => {
                let mut v = [mean];
                let op = if a.average == 2 { ReduceOp::Min } else { ReduceOp::Max };
                self.comm.allreduce(&mut v, op)?;
                v[0]
            }
            _ => {
                let mut v = [mean];
                self.comm.allreduce(&mut v, ReduceOp::Sum)?;
                v[0] / n
            }
        };
        self.comm.allreduce(&mut iter_us, ReduceOp::Max)?;
        let mut w = [wrong as i64];
        self.comm.allreduce(&mut w, ReduceOp::Sum)?;
        iter_us.sort_by(f64::total_cmp);
        let algbw = if time_us > 0.0 { d.bytes as f64 / time_us / 1e3 } else { 0.0 };
        let mode = Mode {
            time_us,
            algbw,
            busbw: algbw * d.factor,
            wrong: w[0] as u64,
            p50_us: percentile(&iter_us, 0.5),
            p99_us: percentile(&iter_us, 0.99),
        };
        Ok((mode, algo))
    }
}

/// Up to how many ranks the reports name the peers behind each kind of link.
const PER_PEER: usize = 16;

/// How one rank's link to a peer goes, as [`Bench::peer_links`] exchanges it.
#[derive(Clone, Copy)]
enum LinkCode {
    Own = 0,
    Shm = 1,
    Net = 2,
    Unconnected = 3,
}

/// One rank's links by kind, naming the peers: `2 shm (1-2), 1 tcp (3)`.
fn describe_peer_links(codes: &[i64], name: &str) -> String {
    let kinds = [
        (LinkCode::Shm as i64, "shm"),
        (LinkCode::Net as i64, name),
        (LinkCode::Unconnected as i64, "not connected"),
    ];
    let parts: Vec<String> = kinds
        .iter()
        .filter_map(|&(code, word)| {
            let peers: Vec<usize> = (0..codes.len()).filter(|p| codes[*p] == code).collect();
            (!peers.is_empty()).then(|| {
                format!("{} {word} ({})", peers.len(), crate::launch::describe_list(&peers))
            })
        })
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// One rank's links among `n` ranks: `shm` through shared memory, `unconnected` not connected
/// (links connect on first use), the rest over the transport `name`.
fn describe_links(n: usize, shm: i64, unconnected: i64, name: &str) -> String {
    let net = n as i64 - 1 - shm - unconnected;
    let mut parts = Vec::new();
    if shm > 0 {
        parts.push(format!("{shm} shm"));
    }
    if net > 0 {
        parts.push(format!("{net} {name}"));
    }
    if unconnected > 0 {
        parts.push(format!("{unconnected} not connected"));
    }
    if parts.is_empty() {
        parts.push("none".into());
    }
    parts.join(", ")
}
