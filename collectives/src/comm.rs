//! The communicator: the collectives users call.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::debug;
use tutti_runtime::{Fingerprint, Group};

use crate::algo::PlanCtx;
use crate::coll::Coll;
use crate::dtype::{as_bytes, as_bytes_mut, DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::exec::{self, Call, PlanKey, Scratch};
use crate::model::Model;
use crate::plan::{split, Plan};
use crate::select::{choose, Algo, Overrides};
use crate::topo::Topology;

/// Default pipeline segment size in bytes (`TUTTI_SEGMENT_BYTES`).
pub const DEFAULT_SEGMENT: usize = 512 << 10;

/// Default allreduce chunk in bytes (`TUTTI_CHUNK_BYTES`): see [`Config::chunk`].
pub const DEFAULT_CHUNK: usize = 4 << 20;

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
    /// Allreduces larger than this many bytes (and than two segments per rank) run as
    /// back-to-back allreduces of pieces this large, each a whole reduce-scatter and
    /// all-gather, on links as fast as loopback: a rank's block is then still in the
    /// processor's cache when the all-gather sends it, instead of read back from memory.
    /// Default 4 MiB ([`DEFAULT_CHUNK`]); 0 turns it off. Hazard: each piece pays the ring's
    /// `2(n-1)` latency steps again, which on slow links (where the cost model chooses, and
    /// pieces are never made) would cost more than the cache saves.
    pub chunk: usize,
    /// Per-collective algorithm overrides (`TUTTI_ALGO`). Default none: automatic choice.
    pub overrides: Overrides,
    /// Choose algorithms by timing them on the first calls of each size class (`TUTTI_TUNE=1`;
    /// see `tune.rs`). Default off: the built-in table. Hazard: the first few calls of each class
    /// run slower algorithms on purpose, and one small allreduce is added when a class is decided.
    pub tune: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            segment: DEFAULT_SEGMENT,
            chunk: DEFAULT_CHUNK,
            overrides: Overrides::default(),
            tune: false,
        }
    }
}

impl Config {
    /// Defaults plus `TUTTI_ALGO`, `TUTTI_TUNE`, `TUTTI_SEGMENT_BYTES` and `TUTTI_CHUNK_BYTES`
    /// from the environment.
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
        if let Ok(v) = std::env::var("TUTTI_TUNE") {
            c.tune = match v.trim() {
                "1" => true,
                "0" | "" => false,
                _ => return Err(bad(format!("TUTTI_TUNE={v:?}: expected 1 or 0"))),
            };
        }
        if let Ok(v) = std::env::var("TUTTI_SEGMENT_BYTES") {
            c.segment = v.trim().parse::<usize>().ok().filter(|s| *s > 0).ok_or_else(|| {
                bad(format!("TUTTI_SEGMENT_BYTES={v:?} is not a positive integer"))
            })?;
        }
        if let Ok(v) = std::env::var("TUTTI_CHUNK_BYTES") {
            c.chunk = v.trim().parse::<usize>().map_err(|_| {
                bad(format!("TUTTI_CHUNK_BYTES={v:?} is not an integer (0 turns chunks off)"))
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
    pub(crate) force: Option<Algo>,
    tuner: Arc<crate::tune::Tuner>,
    /// Which ranks share a host, once known (see [`Comm::topology`]).
    pub(crate) topo: Arc<std::sync::OnceLock<Arc<Topology>>>,
    /// The links, once measured (see [`Comm::link_scale`]): the cost model on links at least
    /// [`LINK_SLOW`] times slower than loopback, `None` otherwise.
    pub(crate) link: Arc<std::sync::OnceLock<Option<Model>>>,
    scratch: Arc<Mutex<Scratch>>,
    /// The background worker that runs non-blocking calls in program order (started lazily,
    /// shared by clones).
    pub(crate) worker: Arc<std::sync::OnceLock<crate::nonblocking::Worker>>,
    /// True on the worker's own handle: it never waits for itself.
    pub(crate) in_worker: bool,
    /// The groups of the lanes for non-blocking calls (see [`Comm::with_lanes`]); none (the
    /// default): one worker on this communicator's own group, every job in program order.
    pub(crate) lanes: Arc<Vec<Group>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("group", &self.group)
            .field("force", &self.force)
            .finish_non_exhaustive()
    }
}

/// Allreduces of at most this many bytes choose from the table even on slow links: there the
/// per-message CPU cost of ranks that share cores decides, as on loopback, more than the link,
/// and the tree, with fewer ranks busy at once, wins. Measured on 1 Gbit/s links (4 hosts × 1
/// and 2 ranks): at 4 KiB the tree took 0.4–0.5 of the model's choice, at 16 KiB 0.5 with 2
/// ranks per host; at 64 KiB the model's choice was the best. (Broadcast, all-gather and
/// reduce-scatter follow the model at every size: it picked their best there.)
pub(crate) const MODEL_FROM: usize = 16 << 10;

/// Messages of the probe's latency measurement.
const LINK_PROBE_SMALL: usize = 5;
/// Bytes of the probe's local reduction (larger than a core's cache, as real buffers are).
const LINK_PROBE_REDUCE: usize = 8 << 20;
/// Bytes per rank of the link probe's all-gather.
const LINK_PROBE_BYTES: usize = 1 << 20;
/// Per-link bandwidth of that probe on loopback on the machine the built-in table was measured
/// on (2-core VM, 4 ranks over TCP), in bytes per second.
const REFERENCE_BW: f64 = 1.0e9;
/// Links at least this many times slower than the reference count as slower (`link_scale`).
const LINK_SLOW: f64 = 4.0;

thread_local! {
    /// Set while this thread runs the link probe: its own collectives do not probe again.
    static PROBING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The `plan` of a rooted collective over per-rank blocks (gather, scatter).
pub(crate) type RootedPlan = fn(&PlanCtx, Algo, &[(usize, usize)], usize) -> Result<Plan>;

/// One collective call, as its method validated it.
pub(crate) struct Req<'a> {
    pub(crate) coll: Coll,
    pub(crate) dtype: DType,
    pub(crate) redop: Option<ReduceOp>,
    pub(crate) root: Option<usize>,
    pub(crate) count: usize,
    /// nccl-tests' S, for the automatic choice.
    pub(crate) bytes: usize,
    pub(crate) uniform: bool,
    pub(crate) data: &'a mut [u8],
    pub(crate) input: Option<&'a [u8]>,
    /// A transform of the result the executor applies (allreduce's `Avg` and scale).
    pub(crate) finish: Option<crate::kernel::Finish>,
}

/// The settings every rank must share for a call, folded into 16 bits of its fingerprint: the
/// algorithm that runs (high 4 bits, its position in [`Algo::ALL`] plus one) and a digest of the
/// pipeline segment size and the allreduce piece size (low 12 bits). Ranks with different
/// `TUTTI_ALGO`, `TUTTI_SEGMENT_BYTES` or `TUTTI_CHUNK_BYTES` then fail with a mismatch that
/// shows both settings instead of waiting on each other or blaming the counts.
pub(crate) fn settings_digest(algo: Algo, segment: usize, chunk: usize) -> u16 {
    let a = Algo::ALL.iter().position(|x| *x == algo).map_or(0, |i| i + 1) as u16;
    // FNV-1a over the two sizes' bytes, folded to 12 bits.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in (segment as u64).to_le_bytes().into_iter().chain((chunk as u64).to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let folded = (h ^ (h >> 12) ^ (h >> 24) ^ (h >> 36) ^ (h >> 48)) as u16 & 0x0fff;
    (a << 12) | folded
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
            tuner: Arc::new(crate::tune::Tuner::default()),
            topo: Arc::new(std::sync::OnceLock::new()),
            link: Arc::new(std::sync::OnceLock::new()),
            scratch: Arc::new(Mutex::new(Scratch::default())),
            worker: Arc::new(std::sync::OnceLock::new()),
            in_worker: false,
            lanes: Arc::new(Vec::new()),
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

    /// A sub-communicator over `ranks` (sorted group ranks) named by `key`, made by its members
    /// only (see [`Group::new_group_keyed`]): for frameworks that build a group only where it
    /// has members.
    ///
    /// # Collective contract
    /// Every member calls it with the same `ranks` and `key`; no two sub-groups of this
    /// communicator share a key.
    ///
    /// # Errors
    /// [`Error::Runtime`] for an empty, unsorted, duplicated or out-of-range list.
    pub fn split_keyed(&self, ranks: &[usize], key: u64) -> Result<Option<Comm>> {
        Ok(self
            .group
            .new_group_keyed(ranks, key)?
            .map(|g| Comm::with_config(g, (*self.cfg).clone())))
    }

    /// After a failure, agree with the other survivors on who is left and go on over them:
    /// a new communicator over a new world group, with this one's settings (see
    /// `tutti_runtime::Group::shrink_with`, which also describes the agreement). `note`
    /// reaches every survivor, in [`Shrunk::notes`](tutti_runtime::elastic::Shrunk::notes).
    ///
    /// # Collective contract
    /// Every surviving rank calls it once after an error; ranks keep their relative order.
    /// Sub-communicators are rebuilt from the new one. This communicator is aborted; its
    /// threads and sockets close when its last handle is dropped.
    ///
    /// # Errors
    /// [`Error::Runtime`] wrapping `CutOff` when this rank may not go on (left out, too few
    /// left, or the store unreachable), or `Config` for a communicator that cannot shrink.
    pub fn shrink_with(&self, note: &[u8]) -> Result<(Comm, tutti_runtime::elastic::Shrunk)> {
        let shrunk = self.group.shrink_with(note)?;
        let comm = Comm::with_config(shrunk.group.clone(), (*self.cfg).clone());
        Ok((Comm { force: self.force, ..comm }, shrunk))
    }

    /// Take in the newcomers waiting to join (replacement processes started with
    /// `TUTTI_JOIN=1`): a new communicator over the members, in their order, then the
    /// newcomers; `None` when nobody was waiting. See `tutti_runtime::Group::grow`.
    ///
    /// # Collective contract
    /// Every member calls it at the same point; the newcomers are the ones whose
    /// [`Comm::from_env`] returns (their group's `joined()` is true), and both sides then
    /// make the same calls (the members send the state).
    ///
    /// # Errors
    /// [`Error::Runtime`] when the store fails or someone does not connect.
    pub fn grow(&self) -> Result<Option<(Comm, tutti_runtime::elastic::Grown)>> {
        Ok(self.group.grow()?.map(|g| {
            let comm = Comm::with_config(g.group.clone(), (*self.cfg).clone());
            (Comm { force: self.force, ..comm }, g)
        }))
    }

    /// This communicator's settings.
    pub(crate) fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether `coll`'s algorithm is forced ([`Comm::with_algo`] or `TUTTI_ALGO`).
    pub(crate) fn forced(&self, coll: Coll) -> bool {
        self.force.is_some() || self.cfg.overrides.0.contains_key(&coll)
    }

    pub(crate) fn invalid(&self, op: &'static str, detail: String) -> Error {
        Error::InvalidArgument { rank: self.rank(), op, detail }
    }

    /// The choices tuning has made so far (`TUTTI_TUNE=1`): collective, size class (bytes, a
    /// power of two: the class holds sizes above half of it up to it) and algorithm.
    pub fn tuned(&self) -> Vec<(Coll, usize, Algo)> {
        self.tuner.decided()
    }

    /// The tuning class of a call, when tuning decides it.
    fn tuning(&self, coll: Coll, bytes: usize, uniform: bool) -> Option<crate::tune::Key> {
        let tunable = match coll {
            Coll::Allreduce | Coll::Broadcast | Coll::Reduce => true,
            Coll::Allgather | Coll::ReduceScatter | Coll::AllToAll => uniform,
            Coll::Gather | Coll::Scatter | Coll::Barrier => false,
        };
        (self.cfg.tune && tunable && !self.forced(coll))
            .then(|| crate::tune::Key::new(coll, bytes, uniform))
    }

    /// The same communicator told which host each rank is on (`hosts[r]`, any numbering;
    /// ranks with equal numbers share a host) instead of finding out: for tests over memory,
    /// and for jobs whose ranks reach each other through addresses that do not tell hosts
    /// apart. Links are then taken as measured equal to loopback unless
    /// [`Comm::with_model`] says otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `hosts` does not have one entry per rank.
    pub fn with_hosts(&self, hosts: &[usize]) -> Result<Comm> {
        if hosts.len() != self.size() {
            return Err(self.invalid(
                "with_hosts",
                format!("{} host numbers for {} ranks", hosts.len(), self.size()),
            ));
        }
        let topo = std::sync::OnceLock::from(Arc::new(Topology::from_hosts(hosts)));
        let link = std::sync::OnceLock::from(self.link_model());
        Ok(Comm { topo: Arc::new(topo), link: Arc::new(link), ..self.clone() })
    }

    /// The same communicator choosing from `model` (as if the link probe had measured it):
    /// what a job whose links are known can set instead of probing, and how tests check the
    /// choice on slow links.
    pub fn with_model(&self, model: Model) -> Comm {
        Comm { link: Arc::new(std::sync::OnceLock::from(Some(model))), ..self.clone() }
    }

    /// Which host each rank is on: over memory and on a loopback address, one host; otherwise
    /// found at the group's first collective (with [`Comm::link_scale`]'s probe): ranks that
    /// advertise the same address to their peers share a host.
    ///
    /// # Collective contract
    /// As [`Comm::link_scale`].
    ///
    /// # Errors
    /// As [`Comm::link_scale`].
    pub fn topology(&self) -> Result<Arc<Topology>> {
        self.link_scale()?;
        Ok(self.topo_now())
    }

    /// The cost model the automatic choice follows, when the link probe found links at least
    /// 4 times slower than loopback (or [`Comm::with_model`] set one); `None` before the first
    /// collective and on loopback-class links.
    pub fn link_model(&self) -> Option<Model> {
        self.link.get().copied().flatten()
    }

    /// The topology known so far (one host before the probe).
    fn topo_now(&self) -> Arc<Topology> {
        self.topo.get().cloned().unwrap_or_else(|| Arc::new(Topology::flat(self.size())))
    }

    /// How many times slower per byte this group's links are than the loopback the built-in
    /// table was measured on: 1 on one host (a loopback address, or every rank advertising the
    /// same address) and over memory; otherwise measured once, at the group's first collective
    /// (every rank makes the same one). The probe: an all-gather of each rank's address (which
    /// ranks share a host, [`Comm::topology`]), then 5 allreduces of 8 bytes (the per-message
    /// cost α: the best time over the tree's steps), a ring all-gather of 1 MiB per rank twice
    /// (the link's per-byte cost β: the faster), and 3 local reductions of 8 MiB (the per-byte
    /// reduction cost γ); the slowest rank's times, agreed by an allreduce, are every rank's.
    /// On links at least 4 times slower than the reference the choice follows the cost model
    /// built from them (`model.rs`; for allreduce above 16 KiB); under that it counts as 1
    /// (noise on a loaded host must not move the loopback choices).
    ///
    /// # Collective contract
    /// The first call on a multi-host group is collective: every rank of the group makes it
    /// (every collective does, first thing), or none calls it directly. Later calls return the
    /// measured value at once.
    ///
    /// # Errors
    /// The probe's collectives' errors (a peer lost during it, named).
    pub fn link_scale(&self) -> Result<f64> {
        // The scale is the model's β against the reference; without a model, 1.
        let scale = |m: &Option<Model>| m.map_or(1.0, |m| m.beta * REFERENCE_BW);
        if let Some(l) = self.link.get() {
            return Ok(scale(l));
        }
        if PROBING.with(|p| p.get()) {
            // The probe's own collectives.
            return Ok(1.0);
        }
        let remote = self.group.local_addr().filter(|a| !a.ip().is_loopback());
        let Some(addr) = remote.filter(|_| self.size() >= 2) else {
            let _ = self.topo.set(Arc::new(Topology::flat(self.size())));
            return Ok(scale(self.link.get_or_init(|| None)));
        };
        PROBING.with(|p| p.set(true));
        let r = self.probe(addr.ip());
        PROBING.with(|p| p.set(false));
        let l = r?;
        Ok(scale(self.link.get_or_init(|| l)))
    }

    /// The link probe (see [`Comm::link_scale`]).
    fn probe(&self, ip: std::net::IpAddr) -> Result<Option<Model>> {
        let n = self.size();
        let key = match ip {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(v6) => v6.octets(),
        };
        let mut keys = vec![0u8; 16 * n];
        self.with_algo(Algo::Ring).allgather(&key, &mut keys)?;
        let topo = Topology::from_keys(&keys.chunks(16).collect::<Vec<_>>());
        let hosts = topo.hosts();
        let _ = self.topo.set(Arc::new(topo));
        if hosts < 2 {
            return Ok(None);
        }
        let tree = self.with_algo(Algo::Tree);
        let mut small = f64::MAX;
        for _ in 0..LINK_PROBE_SMALL {
            let mut x = [0.0f64];
            let t = Instant::now();
            tree.allreduce(&mut x, ReduceOp::Sum)?;
            small = small.min(t.elapsed().as_secs_f64());
        }
        let block = LINK_PROBE_BYTES;
        let mine = vec![0u8; block];
        let mut all = vec![0u8; block * n];
        let ring = self.with_algo(Algo::Ring);
        let mut big = f64::MAX;
        for _ in 0..2 {
            let t = Instant::now();
            ring.allgather(&mine, &mut all)?;
            big = big.min(t.elapsed().as_secs_f64());
        }
        let mut reduce = f64::MAX;
        let rbytes = LINK_PROBE_REDUCE;
        let (mut acc, add) = (vec![0u8; rbytes], vec![0u8; rbytes]);
        for _ in 0..3 {
            let t = Instant::now();
            crate::kernel::reduce_into(DType::F32, ReduceOp::Sum, &mut acc, &add);
            reduce = reduce.min(t.elapsed().as_secs_f64());
        }
        let mut worst = [small, big, reduce];
        tree.allreduce(&mut worst, ReduceOp::Max)?;
        let [small, big, reduce] = worst;
        let steps = 2 * crate::model::ceil_log2(n);
        let bw = (n - 1) as f64 * block as f64 / big.max(1e-9);
        let model = Model {
            alpha: small / steps as f64,
            beta: 1.0 / bw,
            beta_local: crate::model::LOCAL_BETA,
            gamma: reduce / rbytes as f64,
        };
        let scale = REFERENCE_BW / bw;
        debug!(bw, scale, ?model, hosts, "link probe");
        Ok((scale >= LINK_SLOW).then_some(model))
    }

    fn algo_for(&self, coll: Coll, bytes: usize, uniform: bool) -> Algo {
        let model = self.link_model();
        let auto = || {
            // On links slower than loopback, the cost model, above MODEL_FROM; it covers the
            // collectives whose choice trades steps against bytes. All-to-all's choice is
            // about message counts.
            let modelled = matches!(
                coll,
                Coll::Allreduce | Coll::Broadcast | Coll::Allgather | Coll::ReduceScatter
            );
            let n = self.size();
            model
                .filter(|_| modelled && (coll != Coll::Allreduce || bytes > MODEL_FROM))
                .and_then(|m| {
                    let algos = coll
                        .algos()
                        .iter()
                        .copied()
                        .filter(|a| coll.supports(*a, n, uniform).is_ok());
                    m.best(coll, algos, bytes as f64, &self.topo_now())
                })
                .unwrap_or_else(|| choose(coll, bytes, n, uniform))
        };
        if let Some(key) = self.tuning(coll, bytes, uniform) {
            return self.tuner.pick(key, self.size(), auto());
        }
        self.force.or_else(|| self.cfg.overrides.0.get(&coll).copied()).unwrap_or_else(auto)
    }

    /// One call's life, the one path of every entry point (collectives, point-to-point,
    /// device staging). Begin: earlier non-blocking calls finish first (program order on every
    /// rank) and a poisoned group refuses at once. Finish: any error poisons the group once and
    /// aborts the peers once, naming this rank, the call and the cause — a local refusal too (a
    /// bad argument, a forced algorithm that does not apply), since the peers would otherwise
    /// wait in a call this rank never makes until their timeout.
    pub(crate) fn call<R>(&self, op: &'static str, body: impl FnOnce() -> Result<R>) -> Result<R> {
        self.drain()?;
        self.group.check()?;
        let r = body();
        if let Err(e) = &r {
            self.failed(op, e);
        }
        r
    }

    /// A call failed: poison the group and tell every peer (both idempotent).
    fn failed(&self, op: &'static str, e: &Error) {
        let me = self.group.global_rank(self.rank());
        let (re, reason) = match e {
            // Already poisoned: whoever poisoned it told the peers.
            Error::Runtime(tutti_runtime::Error::Poisoned(_)) => return,
            Error::Runtime(re) if re.is_fatal() => {
                (re.clone(), format!("rank {me} failed in {op}: {e}"))
            }
            other => {
                let how = match other {
                    Error::InvalidArgument { .. } | Error::Unsupported { .. } => "refused",
                    _ => "failed in",
                };
                let reason = format!("rank {me} {how} {op}: {other}");
                (
                    tutti_runtime::Error::Aborted { rank: self.rank(), reason: reason.clone() },
                    reason,
                )
            }
        };
        self.group.fail(&re);
        self.group.abort(&reason);
    }

    /// Choose the algorithm, plan, take the sequence number and execute. Called by the
    /// collectives' methods inside [`Comm::call`], after they validated their arguments.
    pub(crate) fn run(
        &self,
        req: Req<'_>,
        plan: impl FnOnce(&PlanCtx, Algo, &Topology) -> Result<Plan>,
    ) -> Result<Stats> {
        // The link probe, once per group, at its first collective (the same call on every rank).
        self.link_scale()?;
        let start = Instant::now();
        let op = req.coll.name();
        // The collective's `plan` refuses an algorithm that cannot run here (`Coll::supports`).
        let algo = self.algo_for(req.coll, req.bytes, req.uniform);
        let ctx = PlanCtx {
            rank: self.rank(),
            n: self.size(),
            esize: req.dtype.size(),
            seg: self.cfg.segment,
            in_place: req.input.is_none(),
        };
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        // A call shaped like a recent one runs that one's plan (algorithms are pure functions
        // of the key and the topology); `v` calls, whose per-rank counts the key lacks, plan
        // afresh.
        let topo = self.topo.get();
        let plan = if req.uniform {
            let key = PlanKey {
                coll: req.coll,
                algo,
                rank: ctx.rank,
                n: ctx.n,
                esize: ctx.esize,
                seg: ctx.seg,
                in_place: ctx.in_place,
                count: req.count,
                bytes: req.bytes,
                root: req.root,
            };
            scratch.plans.get_or_make(key, topo, || plan(&ctx, algo, &self.topo_now()))?
        } else {
            Arc::new(plan(&ctx, algo, &self.topo_now())?)
        };
        let seq = self.group.next_seq();
        let fp = Fingerprint {
            op: req.coll.op_kind(),
            dtype: req.dtype,
            redop: req.redop.map_or(0, ReduceOp::code),
            root: req.root.map_or(u32::MAX, |r| r as u32),
            count: req.count as u64,
            settings: settings_digest(algo, self.cfg.segment, self.cfg.chunk),
        };
        let call = Call {
            group: &self.group,
            op_name: op,
            fp,
            dtype: req.dtype,
            redop: req.redop.unwrap_or(ReduceOp::Sum),
            finish: req.finish,
        };
        let bytes_sent =
            exec::execute(&call, seq, &plan, req.data, req.input, &mut scratch, start)?;
        drop(scratch);
        let elapsed = start.elapsed();
        debug!(op, seq, bytes = req.bytes, %algo, ?elapsed, "collective done");
        if let Some(key) = self.tuning(req.coll, req.bytes, req.uniform) {
            if let Some(mut times) = self.tuner.record(key, algo, elapsed) {
                // Every rank reaches this at the same call: agree on the slowest rank's times.
                self.with_algo(Algo::Tree).allreduce(&mut times, ReduceOp::Max)?;
                if let Some(best) = self.tuner.decide(key, &times) {
                    debug!(op, bytes = req.bytes, %best, ?times, "tuned");
                }
            }
        }
        Ok(Stats { algo, bytes_sent, elapsed, seq })
    }

    /// Gather or scatter out of place: `block` elements per rank; the root's output (gather) or
    /// input (scatter) holds every rank's block, in rank order.
    pub(crate) fn rooted<T: Element>(
        &self,
        coll: Coll,
        input: &[T],
        output: &mut [T],
        block: usize,
        root: usize,
        plan: RootedPlan,
    ) -> Result<Stats> {
        self.call(coll.name(), || {
            self.check_root(coll.name(), root)?;
            let n = self.size();
            let (what, whole) = if coll == Coll::Gather {
                ("output", output.len())
            } else {
                ("input", input.len())
            };
            if self.rank() == root && whole != block * n {
                return Err(self.invalid(
                    coll.name(),
                    format!("root {what} has {whole} elements, expected {block} x {n}"),
                ));
            }
            let es = size_of::<T>();
            let blocks = split(block * n, n, es);
            let req = Req {
                coll,
                dtype: T::DTYPE,
                redop: None,
                root: Some(root),
                count: block,
                bytes: block * n * es,
                uniform: true,
                data: as_bytes_mut(output),
                input: Some(as_bytes(input)),
                finish: None,
            };
            self.run(req, |ctx, algo, _| plan(ctx, algo, &blocks, root))
        })
    }

    /// Gather or scatter in place: rank `r`'s block is `buf[r*c..(r+1)*c]`.
    pub(crate) fn rooted_inplace<T: Element>(
        &self,
        coll: Coll,
        buf: &mut [T],
        root: usize,
        plan: RootedPlan,
    ) -> Result<Stats> {
        self.call(coll.name(), || {
            self.check_root(coll.name(), root)?;
            let n = self.size();
            if !buf.len().is_multiple_of(n) {
                return Err(self.invalid(
                    coll.name(),
                    format!("{} elements do not divide by {n} ranks", buf.len()),
                ));
            }
            let blocks = split(buf.len(), n, size_of::<T>());
            let req = Req {
                coll,
                dtype: T::DTYPE,
                redop: None,
                root: Some(root),
                count: buf.len() / n,
                bytes: size_of_val(buf),
                uniform: true,
                data: as_bytes_mut(buf),
                input: None,
                finish: None,
            };
            self.run(req, |ctx, algo, _| plan(ctx, algo, &blocks, root))
        })
    }

    pub(crate) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        check_root(self.rank(), self.size(), op, root)
    }

    pub(crate) fn finish_avg<T: Element>(&self, op: ReduceOp, out: &mut [T]) {
        if op == ReduceOp::Avg {
            let n = self.size();
            for x in out {
                *x = x.div_n(n);
            }
        }
    }

    pub(crate) fn check_counts(
        &self,
        op: &'static str,
        counts: &[usize],
        total: usize,
    ) -> Result<()> {
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

    /// Send `buf` to group rank `dst` under `tag` (see [`Group::send`]).
    ///
    /// # Collective contract
    /// Point to point: `dst` calls [`Comm::recv`] from this rank with the same tag.
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.call("send", || Ok(self.group.send(dst, tag, as_bytes(buf))?))
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
        self.call("sendrecv", || {
            let got = self.group.sendrecv(dst, as_bytes(send), src, as_bytes_mut(recv), tag)?;
            Ok(got / size_of::<T>())
        })
    }

    /// Receive into `buf` from group rank `src` under `tag`; returns the elements received.
    ///
    /// # Collective contract
    /// Matches a [`Comm::send`] from `src`.
    ///
    /// # Errors
    /// As [`Group::recv`].
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<usize> {
        self.call("recv", || Ok(self.group.recv(src, tag, as_bytes_mut(buf))? / size_of::<T>()))
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
        self.call("batch_p2p", || {
            let s: Vec<(usize, u32, &[u8])> =
                sends.iter().map(|(d, t, b)| (*d, *t, as_bytes(b))).collect();
            let mut r: Vec<(usize, u32, &mut [u8])> =
                recvs.iter_mut().map(|(src, t, b)| (*src, *t, as_bytes_mut(b))).collect();
            let got = self.group.batch_p2p(&s, &mut r)?;
            Ok(got.into_iter().map(|n| n / size_of::<T>()).collect())
        })
    }
}

/// `root` must be a rank of a group of `size` (rank `rank` calls `op`); the check every rooted
/// call makes, on the host, staged or through NCCL.
pub(crate) fn check_root(rank: usize, size: usize, op: &'static str, root: usize) -> Result<()> {
    if root >= size {
        return Err(Error::InvalidArgument {
            rank,
            op,
            detail: format!("root {root} is outside the group of {size} ranks"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod link_tests {
    use super::*;

    #[test]
    fn slow_links_choose_from_the_model() {
        let comms = Comm::mem_world(8);
        let c = &comms[0];
        // Over memory (and on one host) nothing is probed: the table's choices.
        assert_eq!(c.link_scale().unwrap(), 1.0);
        assert_eq!(c.topology().unwrap().hosts(), 1);
        assert_eq!(c.algo_for(Coll::Allreduce, 64 << 10, true), Algo::Tree);
        // 1 Gbit/s links (8 ns per byte), 50 µs per message, reductions at 2 GB/s.
        let m = Model { alpha: 50e-6, beta: 8e-9, beta_local: 0.4e-9, gamma: 0.5e-9 };
        let one = c.with_hosts(&[0, 1, 2, 3, 4, 5, 6, 7]).unwrap().with_model(m);
        assert!((one.link_scale().unwrap() - 8.0).abs() < 1e-9);
        let ar = |c: &Comm, b: usize| c.algo_for(Coll::Allreduce, b, true);
        assert_eq!(ar(&one, 64 << 20), Algo::Ring);
        // Small calls keep the table (tree beyond 2 ranks).
        assert_eq!(ar(&one, 8), Algo::Tree);
        assert_eq!(ar(&one, MODEL_FROM), Algo::Tree);
        assert_eq!(one.algo_for(Coll::Broadcast, 16 << 20, true), Algo::Chain);
        // Back to back, the chain's calls overlap: it wins small broadcasts on these links too
        // (the table keeps the tree up to 256 KiB).
        assert_eq!(one.algo_for(Coll::Broadcast, 4 << 10, true), Algo::Chain);
        assert_eq!(one.algo_for(Coll::Allgather, 16 << 20, true), Algo::Ring);
        // Four ranks on each of two hosts: large allreduces go two-level, and recursive doubling
        // (whose far partners all cross the host's link) is not chosen for middle sizes.
        let two = c.with_hosts(&[0, 0, 0, 0, 1, 1, 1, 1]).unwrap().with_model(m);
        assert_eq!(ar(&two, 64 << 20), Algo::TwoLevel);
        assert_ne!(ar(&two, 1 << 20), Algo::RecursiveDoubling);
        // All-to-all is not moved; a forced algorithm still wins; on one host, the table.
        assert_eq!(
            two.algo_for(Coll::AllToAll, 64 << 10, true),
            c.algo_for(Coll::AllToAll, 64 << 10, true)
        );
        assert_eq!(two.with_algo(Algo::Ring).algo_for(Coll::Allreduce, 8, true), Algo::Ring);
        assert_eq!(ar(&c.with_hosts(&[0; 8]).unwrap(), 64 << 10), Algo::Tree);
        assert!(c.with_hosts(&[0; 3]).is_err());
    }
}
