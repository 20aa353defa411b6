//! The communicator: the collectives users call.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::debug;
use tutti_runtime::{Fingerprint, Group, OpKind};

use crate::algo::{self, PlanCtx};
use crate::dtype::{as_bytes, as_bytes_mut, DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::exec::{self, Call, Scratch};
use crate::plan::{blocks_from_counts, split, Buf, Plan};
use crate::select::{choose, Algo, Coll, Overrides};

/// Default pipeline segment size in bytes (`TUTTI_SEGMENT_BYTES`).
pub const DEFAULT_SEGMENT: usize = 512 << 10;

/// What one collective call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// The algorithm that ran.
    pub algo: Algo,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
    /// Wall time of the call on this rank.
    pub elapsed: Duration,
    /// The call's sequence number in the group.
    pub seq: u64,
}

/// Settings of a communicator.
#[derive(Debug, Clone)]
pub struct Config {
    /// Pipeline segment size in bytes. Default 512 KiB ([`DEFAULT_SEGMENT`]). Hazard: below
    /// 128 KiB large messages lose bandwidth to per-segment overhead; above a few MiB the
    /// pipeline has too few segments to overlap.
    pub segment: usize,
    /// Per-collective algorithm overrides (`TUTTI_ALGO`). Default none: automatic choice.
    pub overrides: Overrides,
}

impl Default for Config {
    fn default() -> Config {
        Config { segment: DEFAULT_SEGMENT, overrides: Overrides::default() }
    }
}

impl Config {
    /// Defaults plus `TUTTI_ALGO` and `TUTTI_SEGMENT_BYTES` from the environment.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the malformed variable.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        let bad =
            |detail: String| Error::InvalidArgument { rank: usize::MAX, op: "config", detail };
        if let Ok(v) = std::env::var("TUTTI_ALGO") {
            c.overrides = Overrides::parse(&v).map_err(bad)?;
        }
        if let Ok(v) = std::env::var("TUTTI_SEGMENT_BYTES") {
            c.segment = v.trim().parse::<usize>().ok().filter(|s| *s > 0).ok_or_else(|| {
                bad(format!("TUTTI_SEGMENT_BYTES={v:?} is not a positive integer"))
            })?;
        }
        Ok(c)
    }
}

/// Collectives over a [`Group`].
///
/// Every collective is called by every rank of the group, in the same order, with compatible
/// arguments (the `# Collective contract` of each method). A rank that calls with a different
/// op, dtype, count or root is reported on every rank involved, with both descriptors, instead of
/// hanging or returning wrong data.
///
/// Cloning is cheap; clones share the group (and its sequence numbers).
#[derive(Clone)]
pub struct Comm {
    pub(crate) group: Group,
    cfg: Arc<Config>,
    force: Option<Algo>,
    scratch: Arc<Mutex<Scratch>>,
    /// The background worker that runs non-blocking calls in program order (started lazily,
    /// shared by clones).
    pub(crate) worker: Arc<std::sync::OnceLock<crate::nonblocking::Worker>>,
    /// True on the worker's own handle: it never waits for itself.
    pub(crate) in_worker: bool,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("group", &self.group)
            .field("force", &self.force)
            .finish_non_exhaustive()
    }
}

struct Req<'a> {
    coll: Coll,
    name: &'static str,
    op: OpKind,
    dtype: DType,
    redop: Option<ReduceOp>,
    root: Option<usize>,
    count: usize,
    /// nccl-tests' S, for the automatic choice.
    bytes: usize,
    uniform: bool,
    data: &'a mut [u8],
    input: Option<&'a [u8]>,
}

impl Comm {
    /// A communicator over `group` with default settings.
    pub fn new(group: Group) -> Comm {
        Comm::with_config(group, Config::default())
    }

    /// A communicator with explicit settings.
    pub fn with_config(group: Group, cfg: Config) -> Comm {
        Comm {
            group,
            cfg: Arc::new(cfg),
            force: None,
            scratch: Arc::new(Mutex::new(Scratch::default())),
            worker: Arc::new(std::sync::OnceLock::new()),
            in_worker: false,
        }
    }

    /// Rendezvous from the environment (see `tutti_runtime::init_from_env`) and apply `TUTTI_ALGO`
    /// and `TUTTI_SEGMENT_BYTES`.
    ///
    /// # Errors
    /// Rendezvous and configuration errors.
    pub fn from_env() -> Result<Comm> {
        let g = tutti_runtime::init_from_env()?;
        Ok(Comm::with_config(g, Config::from_env()?))
    }

    /// One communicator per thread over the in-memory transport (tests, examples).
    pub fn mem_world(n: usize) -> Vec<Comm> {
        Group::mem_world(n).into_iter().map(Comm::new).collect()
    }

    /// The same communicator, forcing `algo` for the calls made through the returned value.
    /// Calls whose collective `algo` does not implement fail with [`Error::Unsupported`].
    pub fn with_algo(&self, algo: Algo) -> Comm {
        Comm { force: Some(algo), ..self.clone() }
    }

    /// The group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Sub-communicator over a sub-group (see [`Group::new_group`]); same settings.
    ///
    /// # Errors
    /// As [`Group::new_group`].
    pub fn split(&self, ranks: &[usize]) -> Result<Option<Comm>> {
        Ok(self.group.new_group(ranks)?.map(|g| Comm::with_config(g, (*self.cfg).clone())))
    }

    fn invalid(&self, op: &'static str, detail: String) -> Error {
        Error::InvalidArgument { rank: self.rank(), op, detail }
    }

    fn algo_for(&self, coll: Coll, bytes: usize, uniform: bool) -> Algo {
        self.force
            .or_else(|| self.cfg.overrides.0.get(&coll).copied())
            .unwrap_or_else(|| choose(coll, bytes, self.size(), uniform))
    }

    fn run(
        &self,
        req: Req<'_>,
        plan: impl FnOnce(&PlanCtx, Algo) -> Result<Plan>,
    ) -> Result<Stats> {
        // Non-blocking calls submitted earlier run first: program order on every rank.
        self.drain()?;
        self.group.check()?;
        let start = Instant::now();
        let algo = self.algo_for(req.coll, req.bytes, req.uniform);
        if !req.coll.algos().contains(&algo) {
            return Err(Error::Unsupported {
                rank: self.rank(),
                op: req.name,
                algo: algo.name(),
                detail: format!("{} does not implement {}", algo, req.coll),
            });
        }
        let shape = PlanCtx {
            rank: self.rank(),
            n: self.size(),
            esize: req.dtype.size(),
            seg: self.cfg.segment,
            in_place: req.input.is_none(),
        };
        let plan = plan(&shape, algo)?;
        let seq = self.group.next_seq();
        let fp = Fingerprint {
            op: req.op,
            dtype: req.dtype,
            redop: req.redop.map_or(0, ReduceOp::code),
            root: req.root.map_or(u32::MAX, |r| r as u32),
            count: req.count as u64,
        };
        let call = Call {
            group: &self.group,
            op_name: req.name,
            fp,
            dtype: req.dtype,
            redop: req.redop.unwrap_or(ReduceOp::Sum),
        };
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let r = exec::execute(&call, seq, &plan, req.data, req.input, &mut scratch);
        drop(scratch);
        let elapsed = start.elapsed();
        match r {
            Ok(bytes_sent) => {
                debug!(op = req.name, seq, bytes = req.bytes, %algo, ?elapsed, "collective done");
                Ok(Stats { algo, bytes_sent, elapsed, seq })
            }
            Err(e) => {
                let fatal = match &e {
                    Error::Runtime(re) => {
                        self.group.fail(re);
                        re.is_fatal()
                    }
                    _ => {
                        let re = tutti_runtime::Error::Aborted {
                            rank: self.rank(),
                            reason: e.to_string(),
                        };
                        self.group.fail(&re);
                        true
                    }
                };
                if fatal {
                    // Tell every peer at once, so ranks that do not talk to the culprit in this
                    // collective fail now instead of at their timeout.
                    self.group.abort(&format!(
                        "rank {} failed in {} (seq {seq}): {e}",
                        self.rank(),
                        req.name
                    ));
                }
                Err(e)
            }
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(self.invalid(
                op,
                format!("root {root} is outside the group of {} ranks", self.size()),
            ));
        }
        Ok(())
    }

    fn finish_avg<T: Element>(&self, op: ReduceOp, out: &mut [T]) {
        if op == ReduceOp::Avg {
            let n = self.size();
            for x in out {
                *x = x.div_n(n);
            }
        }
    }

    fn allreduce_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<Stats> {
        let count = out.len();
        let bytes = size_of_val(out);
        let req = Req {
            coll: Coll::Allreduce,
            name: "allreduce",
            op: OpKind::Allreduce,
            dtype: T::DTYPE,
            redop: Some(op),
            root: None,
            count,
            bytes,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        let st = self.run(req, |sh, algo| {
            Ok(match algo {
                Algo::Ring => algo::ring::allreduce(sh, count),
                Algo::RecursiveDoubling => algo::recursive_doubling::allreduce(sh, count),
                Algo::Rabenseifner => algo::halving_doubling::allreduce(sh, count),
                _ => algo::tree::allreduce(sh, count),
            })
        })?;
        self.finish_avg(op, out);
        Ok(st)
    }

    /// Allreduce in place: every rank ends with the elementwise reduction of every rank's `buf`.
    ///
    /// # Collective contract
    /// Every rank of the group calls it with the same `op` and a buffer of the same length.
    ///
    /// # Errors
    /// [`Error::Runtime`] for transport failures, timeouts and mismatched calls (the group is
    /// poisoned); [`Error::Unsupported`] for a forced algorithm that does not apply.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<Stats> {
        self.allreduce_impl(None, buf, op)
    }

    /// Allreduce out of place: `output` receives the reduction of every rank's `input`.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`]; `input` and `output` have the same length on every rank.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`] when the lengths differ.
    pub fn allreduce_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<Stats> {
        if input.len() != output.len() {
            return Err(self.invalid(
                "allreduce",
                format!("input has {} elements, output {}", input.len(), output.len()),
            ));
        }
        self.allreduce_impl(Some(input), output, op)
    }

    /// Broadcast `buf` from `root` to every rank.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `root` and a buffer of the same length.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`] for a root outside the group.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<Stats> {
        self.broadcast_impl(None, buf, root)
    }

    /// Broadcast out of place: the root's `input` lands in every rank's `output` (`input` is
    /// read only at the root).
    ///
    /// # Collective contract
    /// As [`Comm::broadcast`]; at the root `input` and `output` have the same length.
    ///
    /// # Errors
    /// As [`Comm::broadcast`].
    pub fn broadcast_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<Stats> {
        if self.rank() == root && input.len() != output.len() {
            return Err(self.invalid(
                "broadcast",
                format!("input has {} elements, output {}", input.len(), output.len()),
            ));
        }
        let input = if self.rank() == root { Some(input) } else { None };
        self.broadcast_impl(input, output, root)
    }

    fn broadcast_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        root: usize,
    ) -> Result<Stats> {
        self.check_root("broadcast", root)?;
        let len = size_of_val(out);
        let req = Req {
            coll: Coll::Broadcast,
            name: "broadcast",
            op: OpKind::Broadcast,
            dtype: T::DTYPE,
            redop: None,
            root: Some(root),
            count: out.len(),
            bytes: len,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        self.run(req, |sh, algo| {
            Ok(match algo {
                Algo::Chain => algo::chain::broadcast(sh, len, root),
                _ => algo::tree::broadcast(sh, len, root),
            })
        })
    }

    /// Reduce every rank's `buf` into the root's `buf`. On other ranks `buf` is used as scratch
    /// and holds partial results afterwards.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `op`, `root` and buffer length.
    ///
    /// # Errors
    /// As [`Comm::broadcast`].
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<Stats> {
        self.reduce_impl(None, buf, op, root)
    }

    /// Reduce out of place: the root's `output` receives the reduction of every `input`; other
    /// ranks' `output` is scratch. `input` is never written.
    ///
    /// # Collective contract
    /// As [`Comm::reduce`]; `input` and `output` have the same length on every rank.
    ///
    /// # Errors
    /// As [`Comm::reduce`].
    pub fn reduce_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Stats> {
        if input.len() != output.len() {
            return Err(self.invalid(
                "reduce",
                format!("input has {} elements, output {}", input.len(), output.len()),
            ));
        }
        self.reduce_impl(Some(input), output, op, root)
    }

    fn reduce_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Stats> {
        self.check_root("reduce", root)?;
        let len = size_of_val(out);
        let req = Req {
            coll: Coll::Reduce,
            name: "reduce",
            op: OpKind::Reduce,
            dtype: T::DTYPE,
            redop: Some(op),
            root: Some(root),
            count: out.len(),
            bytes: len,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        let st = self.run(req, |sh, _| Ok(algo::tree::reduce(sh, len, root)))?;
        if self.rank() == root {
            self.finish_avg(op, out);
        }
        Ok(st)
    }

    /// Allgather: `output` (length `size() * input.len()`) receives every rank's `input`, in
    /// rank order.
    ///
    /// # Collective contract
    /// Every rank calls it with inputs of the same length.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`] for a wrong output length.
    pub fn allgather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<Stats> {
        let n = self.size();
        if output.len() != input.len() * n {
            return Err(self.invalid(
                "allgather",
                format!(
                    "output has {} elements, expected {} x {} ranks",
                    output.len(),
                    input.len(),
                    n
                ),
            ));
        }
        let counts = vec![input.len(); n];
        self.allgather_impl(Some(input), output, &counts)
    }

    /// Allgather in place: rank `r`'s contribution is `buf[r*c..(r+1)*c]` (`c = len / size`).
    ///
    /// # Collective contract
    /// As [`Comm::allgather`]; the length divides by the group size.
    ///
    /// # Errors
    /// As [`Comm::allgather`].
    pub fn allgather_inplace<T: Element>(&self, buf: &mut [T]) -> Result<Stats> {
        let n = self.size();
        if !buf.len().is_multiple_of(n) {
            return Err(self.invalid(
                "allgather",
                format!("{} elements do not divide by {n} ranks", buf.len()),
            ));
        }
        let counts = vec![buf.len() / n; n];
        self.allgather_impl(None, buf, &counts)
    }

    /// Allgather with per-rank counts: rank `r` contributes `counts[r]` elements; `output` is
    /// their concatenation.
    ///
    /// # Collective contract
    /// Every rank passes the same `counts`; `input.len() == counts[rank]`.
    ///
    /// # Errors
    /// As [`Comm::allgather`].
    pub fn allgatherv<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<Stats> {
        self.check_counts("allgatherv", counts, output.len())?;
        if input.len() != counts[self.rank()] {
            return Err(self.invalid(
                "allgatherv",
                format!(
                    "input has {} elements, counts[{}] = {}",
                    input.len(),
                    self.rank(),
                    counts[self.rank()]
                ),
            ));
        }
        self.allgather_impl(Some(input), output, counts)
    }

    fn check_counts(&self, op: &'static str, counts: &[usize], total: usize) -> Result<()> {
        if counts.len() != self.size() {
            return Err(
                self.invalid(op, format!("{} counts for {} ranks", counts.len(), self.size()))
            );
        }
        let sum: usize = counts.iter().sum();
        if sum != total {
            return Err(self
                .invalid(op, format!("counts sum to {sum} but the buffer has {total} elements")));
        }
        Ok(())
    }

    fn allgather_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        counts: &[usize],
    ) -> Result<Stats> {
        let es = size_of::<T>();
        let blocks = blocks_from_counts(counts, es);
        let uniform = counts.windows(2).all(|w| w[0] == w[1]);
        let total = out.len();
        let req = Req {
            coll: Coll::Allgather,
            name: "allgather",
            op: OpKind::Allgather,
            dtype: T::DTYPE,
            redop: None,
            root: None,
            count: total,
            bytes: size_of_val(out),
            uniform,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        let rank = self.rank();
        self.run(req, |sh, algo| match algo {
            Algo::RecursiveDoubling if sh.n.is_power_of_two() => {
                Ok(algo::recursive_doubling::allgather(sh, &blocks))
            }
            Algo::Bruck if uniform => Ok(algo::bruck::allgather(sh, blocks[0].1)),
            Algo::Ring => Ok(algo::ring::allgather(sh, &blocks)),
            other => Err(Error::Unsupported {
                rank,
                op: "allgather",
                algo: other.name(),
                detail: "needs a power-of-two world (rd) or equal counts (bruck)".into(),
            }),
        })
    }

    /// Reduce-scatter: the inputs (length `size() * output.len()`) are reduced elementwise and
    /// rank `r` receives block `r` of the result.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `op` and the same lengths.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`] for wrong lengths.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<Stats> {
        let n = self.size();
        if input.len() != output.len() * n {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "input has {} elements, expected {} x {n} ranks",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let counts = vec![output.len(); n];
        self.reduce_scatter_impl(Some(input), output, &counts, op)
    }

    /// Reduce-scatter in place: the result block of rank `r` lands at `buf[r*c..(r+1)*c]`; the
    /// rest of `buf` is used as scratch.
    ///
    /// # Collective contract
    /// As [`Comm::reduce_scatter`]; the length divides by the group size.
    ///
    /// # Errors
    /// As [`Comm::reduce_scatter`].
    pub fn reduce_scatter_inplace<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<Stats> {
        let n = self.size();
        if !buf.len().is_multiple_of(n) {
            return Err(self.invalid(
                "reduce_scatter",
                format!("{} elements do not divide by {n} ranks", buf.len()),
            ));
        }
        let counts = vec![buf.len() / n; n];
        self.reduce_scatter_impl(None, buf, &counts, op)
    }

    /// Reduce-scatter with per-rank counts: rank `r` receives `counts[r]` elements.
    ///
    /// # Collective contract
    /// Every rank passes the same `counts` and `op`; `input.len()` is their sum and
    /// `output.len() == counts[rank]`.
    ///
    /// # Errors
    /// As [`Comm::reduce_scatter`].
    pub fn reduce_scatter_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Stats> {
        self.check_counts("reduce_scatter_v", counts, input.len())?;
        if output.len() != counts[self.rank()] {
            return Err(self.invalid(
                "reduce_scatter_v",
                format!(
                    "output has {} elements, counts[{}] = {}",
                    output.len(),
                    self.rank(),
                    counts[self.rank()]
                ),
            ));
        }
        self.reduce_scatter_impl(Some(input), output, counts, op)
    }

    fn reduce_scatter_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Stats> {
        let es = size_of::<T>();
        let blocks = blocks_from_counts(counts, es);
        let total: usize = counts.iter().sum();
        let uniform = counts.windows(2).all(|w| w[0] == w[1]);
        let rank = self.rank();
        let req = Req {
            coll: Coll::ReduceScatter,
            name: "reduce_scatter",
            op: OpKind::ReduceScatter,
            dtype: T::DTYPE,
            redop: Some(op),
            root: None,
            count: total,
            bytes: total * es,
            uniform,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        let in_place = input.is_none();
        let st = self.run(req, |sh, algo| match algo {
            Algo::RecursiveHalving if sh.n.is_power_of_two() => {
                Ok(algo::halving_doubling::reduce_scatter(sh, &blocks))
            }
            Algo::Ring => Ok(algo::ring::reduce_scatter(sh, &blocks)),
            other => Err(Error::Unsupported {
                rank,
                op: "reduce_scatter",
                algo: other.name(),
                detail: "recursive halving needs a power-of-two world".into(),
            }),
        })?;
        if in_place {
            let c = counts[rank];
            let off: usize = counts[..rank].iter().sum();
            self.finish_avg(op, &mut out[off..off + c]);
        } else {
            self.finish_avg(op, out);
        }
        Ok(st)
    }

    /// All-to-all: block `j` of `input` (length `size() * c`) goes to rank `j`; block `i` of
    /// `output` comes from rank `i`.
    ///
    /// # Collective contract
    /// Every rank calls it with buffers of the same length, divisible by the group size.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`] for wrong lengths.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<Stats> {
        let n = self.size();
        if input.len() != output.len() || !input.len().is_multiple_of(n) {
            return Err(self.invalid(
                "all_to_all",
                format!(
                    "input {} and output {} elements must be equal and divide by {n}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let c = input.len() / n;
        let counts = vec![c; n];
        self.all_to_all_impl(Some(input), output, &counts, &counts, true)
    }

    /// All-to-all in place (through a scratch copy of `buf`).
    ///
    /// # Collective contract
    /// As [`Comm::all_to_all`].
    ///
    /// # Errors
    /// As [`Comm::all_to_all`].
    pub fn all_to_all_inplace<T: Element>(&self, buf: &mut [T]) -> Result<Stats> {
        let n = self.size();
        if !buf.len().is_multiple_of(n) {
            return Err(self.invalid(
                "all_to_all",
                format!("{} elements do not divide by {n} ranks", buf.len()),
            ));
        }
        let counts = vec![buf.len() / n; n];
        self.all_to_all_impl(None, buf, &counts, &counts, true)
    }

    /// All-to-all with per-peer counts: `send_counts[j]` elements of `input` go to rank `j`
    /// (blocks in rank order), `recv_counts[i]` elements of `output` come from rank `i`.
    ///
    /// # Collective contract
    /// `send_counts[j]` on rank `i` equals `recv_counts[i]` on rank `j`.
    ///
    /// # Errors
    /// As [`Comm::all_to_all`]; a count disagreement between ranks is reported as a mismatch.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<Stats> {
        self.check_counts("all_to_all_v", send_counts, input.len())?;
        self.check_counts("all_to_all_v", recv_counts, output.len())?;
        self.all_to_all_impl(Some(input), output, send_counts, recv_counts, false)
    }

    fn all_to_all_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        sc: &[usize],
        rc: &[usize],
        uniform: bool,
    ) -> Result<Stats> {
        let es = size_of::<T>();
        let send = blocks_from_counts(sc, es);
        let recv = blocks_from_counts(rc, es);
        let total = out.len();
        let total_bytes = size_of_val(out);
        let req = Req {
            coll: Coll::AllToAll,
            name: "all_to_all",
            op: OpKind::AllToAll,
            dtype: T::DTYPE,
            redop: None,
            root: None,
            // Per-peer counts legitimately differ in the v variant; only uniform calls carry a
            // count in the fingerprint (lengths are still checked on arrival).
            count: if uniform { total } else { 0 },
            bytes: total_bytes,
            uniform,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        let in_place = input.is_none();
        self.run(req, |sh, algo| {
            let mut p = Plan::new();
            let src = if in_place {
                let s = p.scratch(total_bytes);
                p.copy(
                    crate::plan::Region::new(s, 0, total_bytes),
                    crate::plan::Region::new(Buf::Data, 0, total_bytes),
                );
                s
            } else {
                Buf::Input
            };
            match algo {
                Algo::PostAll => algo::alltoall::post_all(&mut p, sh, src, &send, &recv),
                _ => algo::alltoall::pairwise(&mut p, sh, src, &send, &recv),
            }
            Ok(p)
        })
    }

    /// Gather every rank's `input` into the root's `output` (length `size() * input.len()`, rank
    /// order). Non-roots may pass an empty `output`.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `root` and inputs of the same length.
    ///
    /// # Errors
    /// As [`Comm::broadcast`]; [`Error::InvalidArgument`] for a wrong output length at the root.
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<Stats> {
        self.check_root("gather", root)?;
        let n = self.size();
        if self.rank() == root && output.len() != input.len() * n {
            return Err(self.invalid(
                "gather",
                format!(
                    "root output has {} elements, expected {} x {n}",
                    output.len(),
                    input.len()
                ),
            ));
        }
        let es = size_of::<T>();
        let blocks = split(input.len() * n, n, es);
        let req = Req {
            coll: Coll::Gather,
            name: "gather",
            op: OpKind::Gather,
            dtype: T::DTYPE,
            redop: None,
            root: Some(root),
            count: input.len(),
            bytes: input.len() * n * es,
            uniform: true,
            data: as_bytes_mut(output),
            input: Some(as_bytes(input)),
        };
        self.run(req, |sh, _| Ok(algo::linear::gather(sh, &blocks, root)))
    }

    /// Gather in place: rank `r`'s contribution is `buf[r*c..(r+1)*c]` (`c = len / size`); the
    /// root's `buf` receives every block.
    ///
    /// # Collective contract
    /// As [`Comm::gather`]; every rank passes a buffer of `size() * c` elements.
    ///
    /// # Errors
    /// As [`Comm::gather`].
    pub fn gather_inplace<T: Element>(&self, buf: &mut [T], root: usize) -> Result<Stats> {
        self.rooted_inplace(Coll::Gather, buf, root)
    }

    /// Scatter in place: the root's `buf` holds every block; rank `r`'s block lands at
    /// `buf[r*c..(r+1)*c]`.
    ///
    /// # Collective contract
    /// As [`Comm::scatter`]; every rank passes a buffer of `size() * c` elements.
    ///
    /// # Errors
    /// As [`Comm::scatter`].
    pub fn scatter_inplace<T: Element>(&self, buf: &mut [T], root: usize) -> Result<Stats> {
        self.rooted_inplace(Coll::Scatter, buf, root)
    }

    fn rooted_inplace<T: Element>(&self, coll: Coll, buf: &mut [T], root: usize) -> Result<Stats> {
        let (name, op) = if coll == Coll::Gather {
            ("gather", OpKind::Gather)
        } else {
            ("scatter", OpKind::Scatter)
        };
        self.check_root(name, root)?;
        let n = self.size();
        if !buf.len().is_multiple_of(n) {
            return Err(
                self.invalid(name, format!("{} elements do not divide by {n} ranks", buf.len()))
            );
        }
        let es = size_of::<T>();
        let blocks = split(buf.len(), n, es);
        let req = Req {
            coll,
            name,
            op,
            dtype: T::DTYPE,
            redop: None,
            root: Some(root),
            count: buf.len() / n,
            bytes: size_of_val(buf),
            uniform: true,
            data: as_bytes_mut(buf),
            input: None,
        };
        self.run(req, |sh, _| {
            Ok(if coll == Coll::Gather {
                algo::linear::gather(sh, &blocks, root)
            } else {
                algo::linear::scatter(sh, &blocks, root)
            })
        })
    }

    /// Scatter the root's `input` (length `size() * output.len()`): rank `r` receives block `r`
    /// in `output`. Non-roots may pass an empty `input`.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `root` and outputs of the same length.
    ///
    /// # Errors
    /// As [`Comm::gather`].
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<Stats> {
        self.check_root("scatter", root)?;
        let n = self.size();
        if self.rank() == root && input.len() != output.len() * n {
            return Err(self.invalid(
                "scatter",
                format!("root input has {} elements, expected {} x {n}", input.len(), output.len()),
            ));
        }
        let es = size_of::<T>();
        let blocks = split(output.len() * n, n, es);
        let req = Req {
            coll: Coll::Scatter,
            name: "scatter",
            op: OpKind::Scatter,
            dtype: T::DTYPE,
            redop: None,
            root: Some(root),
            count: output.len(),
            bytes: output.len() * n * es,
            uniform: true,
            data: as_bytes_mut(output),
            input: Some(as_bytes(input)),
        };
        self.run(req, |sh, _| Ok(algo::linear::scatter(sh, &blocks, root)))
    }

    /// Block until every rank of the group has entered the barrier.
    ///
    /// # Collective contract
    /// Every rank calls it.
    ///
    /// # Errors
    /// As [`Comm::allreduce`].
    pub fn barrier(&self) -> Result<Stats> {
        let mut none: [u8; 0] = [];
        let req = Req {
            coll: Coll::Barrier,
            name: "barrier",
            op: OpKind::Barrier,
            dtype: DType::U8,
            redop: None,
            root: None,
            count: 0,
            bytes: 0,
            uniform: true,
            data: &mut none,
            input: None,
        };
        self.run(req, |sh, _| Ok(algo::barrier::dissemination(sh)))
    }

    /// Send `buf` to group rank `dst` under `tag` (see [`Group::send`]).
    ///
    /// # Collective contract
    /// Point to point: `dst` calls [`Comm::recv`] from this rank with the same tag.
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.drain()?;
        Ok(self.group.send(dst, tag, as_bytes(buf))?)
    }

    /// Send `send` to `dst` while receiving `recv` from `src` (nccl-tests' sendrecv pattern);
    /// returns the elements received.
    ///
    /// # Collective contract
    /// Point to point, as [`Group::sendrecv`].
    ///
    /// # Errors
    /// As [`Group::sendrecv`].
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        dst: usize,
        recv: &mut [T],
        src: usize,
        tag: u32,
    ) -> Result<usize> {
        // Like every entry point: non-blocking calls posted earlier go first.
        self.drain()?;
        Ok(self.group.sendrecv(dst, as_bytes(send), src, as_bytes_mut(recv), tag)? / size_of::<T>())
    }

    /// Receive into `buf` from group rank `src` under `tag`; returns the elements received.
    ///
    /// # Collective contract
    /// Matches a [`Comm::send`] from `src`.
    ///
    /// # Errors
    /// As [`Group::recv`].
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<usize> {
        self.drain()?;
        Ok(self.group.recv(src, tag, as_bytes_mut(buf))? / size_of::<T>())
    }

    /// Several sends and receives posted together and waited for together (PyTorch's
    /// `batch_isend_irecv`); see [`Group::batch_p2p`]. Returns the elements received per
    /// receive.
    ///
    /// # Collective contract
    /// Point to point: each send is matched by a receive with the same tag on its destination.
    ///
    /// # Errors
    /// As [`Group::batch_p2p`].
    pub fn batch_p2p<T: Element>(
        &self,
        sends: &[(usize, u32, &[T])],
        recvs: &mut [(usize, u32, &mut [T])],
    ) -> Result<Vec<usize>> {
        self.drain()?;
        let s: Vec<(usize, u32, &[u8])> =
            sends.iter().map(|(d, t, b)| (*d, *t, as_bytes(b))).collect();
        let mut r: Vec<(usize, u32, &mut [u8])> =
            recvs.iter_mut().map(|(src, t, b)| (*src, *t, as_bytes_mut(b))).collect();
        let got = self.group.batch_p2p(&s, &mut r)?;
        Ok(got.into_iter().map(|n| n / size_of::<T>()).collect())
    }
}
