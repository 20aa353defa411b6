//! The communicator: the collectives users call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::debug;
use tutti_runtime::clock::{Deadline, Moment};
use tutti_runtime::{Fingerprint, Group};

use crate::algo::PlanCtx;
use crate::call_lock::CallGuard;
use crate::coll::Coll;
use crate::config::Config;
use crate::dtype::{as_bytes_mut, DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::exec::{self, Call, PlanKey, Scratch};
use crate::model::Model;
use crate::plan::Plan;
use crate::select::{Algo, Selector};
use crate::topo::Topology;

/// How a collective plans a call: from the call's context, the algorithm and the topology.
pub(crate) type PlanFn<'a> = dyn Fn(&PlanCtx, Algo, &Topology) -> Result<Plan> + 'a;

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
    /// The one owner of algorithm choice, with the settings and what was measured and tuned.
    pub(crate) sel: Selector,
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
            .field("force", &self.sel.force)
            .finish_non_exhaustive()
    }
}

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

impl Req<'_> {
    /// What every rank must agree on for this call run by `algo` under `cfg`.
    fn fingerprint(&self, algo: Algo, cfg: &Config) -> Fingerprint {
        Fingerprint {
            op: self.coll.op_kind(),
            dtype: self.dtype,
            redop: self.redop.map_or(0, ReduceOp::code),
            root: self.root.map_or(u32::MAX, |r| r as u32),
            count: self.count as u64,
            settings: settings_digest(algo, cfg),
        }
    }
}

/// The settings every rank must share for a call, folded into 16 bits of its fingerprint: the
/// algorithm that runs (high 4 bits, its position in [`Algo::ALL`] plus one) and a digest of the
/// pipeline segment size, the allreduce piece size and whether direct reads are allowed (low 12
/// bits). Ranks with different `TUTTI_ALGO`, `TUTTI_SEGMENT_BYTES`, `TUTTI_CHUNK_BYTES` or
/// `TUTTI_DIRECT` then fail with a mismatch that shows both settings instead of waiting on each
/// other or blaming the counts.
pub(crate) fn settings_digest(algo: Algo, cfg: &Config) -> u16 {
    let a = Algo::ALL.iter().position(|x| *x == algo).map_or(0, |i| i + 1) as u16;
    // The settings hashed, folded to 12 bits.
    let h =
        tutti_runtime::wire::fnv1a(0, [cfg.segment as u64, cfg.chunk as u64, cfg.direct as u64]);
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
        tutti_runtime::clock::init();
        Comm {
            group,
            sel: Selector::new(cfg),
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
        let mut c = self.clone();
        c.sel.force = Some(algo);
        c
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
        Ok(self.group.new_group(ranks)?.map(|g| Comm::with_config(g, (*self.sel.cfg).clone())))
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
            .map(|g| Comm::with_config(g, (*self.sel.cfg).clone())))
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
        let comm = Comm::with_config(shrunk.group.clone(), (*self.sel.cfg).clone());
        Ok((comm.forcing(self.sel.force), shrunk))
    }

    /// Go on over members the caller chose, in the caller's order: a new communicator over a
    /// new world in which `members[i]` (a rank of this one) has rank `i`, with this one's
    /// settings (see `tutti_runtime::Group::reconfigure`). This communicator is aborted first:
    /// its pending calls fail, naming the reconfigure.
    ///
    /// # Collective contract
    /// Every rank named in `members` calls it once with the same `uuid` (fresh for every
    /// reconfigure) and the same `members`; the others do not call it. Sub-communicators are
    /// rebuilt from the new one.
    ///
    /// # Errors
    /// [`Error::Runtime`] wrapping `InvalidArgument` for a bad member list, `Config` for a
    /// reused uuid or a communicator not made by rendezvous, and the connect's errors (naming
    /// the members that did not come within `connect_within`).
    pub fn reconfigure(
        &self,
        uuid: u64,
        members: &[usize],
        connect_within: Duration,
    ) -> Result<Comm> {
        let g = self.group.reconfigure(uuid, members, connect_within)?;
        Ok(Comm::with_config(g, (*self.sel.cfg).clone()).forcing(self.sel.force))
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
            let comm = Comm::with_config(g.group.clone(), (*self.sel.cfg).clone());
            (comm.forcing(self.sel.force), g)
        }))
    }

    /// This communicator's settings.
    pub(crate) fn config(&self) -> &Config {
        &self.sel.cfg
    }

    /// This communicator with `force` as its forced algorithm (the same as `with_algo` when
    /// there is one).
    fn forcing(mut self, force: Option<Algo>) -> Comm {
        self.sel.force = force;
        self
    }

    pub(crate) fn invalid(&self, op: &'static str, detail: String) -> Error {
        Error::InvalidArgument { rank: self.rank(), op, detail }
    }

    /// The choices tuning has made so far (`TUTTI_TUNE=1`): collective, size class (bytes, a
    /// power of two: the class holds sizes above half of it up to it) and algorithm.
    pub fn tuned(&self) -> Vec<(Coll, usize, Algo)> {
        self.sel.tuned()
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
        let mut c = self.clone();
        c.sel.topo = Arc::new(std::sync::OnceLock::from(Arc::new(Topology::from_hosts(hosts))));
        c.sel.link = Arc::new(std::sync::OnceLock::from(self.link_model()));
        Ok(c)
    }

    /// The same communicator choosing from `model` (as if the link measurement had measured it):
    /// what a job whose links are known can set instead of probing, and how tests check the
    /// choice on slow links.
    pub fn with_model(&self, model: Model) -> Comm {
        let mut c = self.clone();
        c.sel.link = Arc::new(std::sync::OnceLock::from(Some(model)));
        c
    }

    /// Which host each rank is on: over memory and on a loopback address, one host; otherwise
    /// found at the group's first collective (with [`Comm::link_scale`]'s measurement): ranks that
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

    /// The cost model the automatic choice follows, when the link measurement found links at least
    /// 4 times slower than loopback (or [`Comm::with_model`] set one); `None` before the first
    /// collective and on loopback-class links.
    pub fn link_model(&self) -> Option<Model> {
        self.sel.link_model()
    }

    /// The topology known so far (one host before the link measurement).
    pub(crate) fn topo_now(&self) -> Arc<Topology> {
        self.sel.topo_now(self.size())
    }

    /// How many times slower per byte this group's links are than the loopback the built-in
    /// table was measured on: 1 on one host (a loopback address, or every rank advertising the
    /// same address) and over memory; otherwise measured once, at the group's first collective
    /// (every rank makes the same one). The measurement: an all-gather of each rank's address (which
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
    /// The measurement's collectives' errors (a peer lost during it, named).
    pub fn link_scale(&self) -> Result<f64> {
        // The scale is the model's β against the reference; without a model, 1.
        let scale = |m: Option<Model>| m.map_or(1.0, |m| m.beta * crate::measure::REFERENCE_BW);
        if self.sel.link.get().is_none() {
            self.call("link_scale", || self.ensure_measured())?;
        }
        Ok(scale(self.link_model()))
    }

    /// Run the link measurement if this group has not yet (inside a call: every collective's first
    /// step, on every rank alike). One host (a loopback address, or a single rank) needs none.
    #[inline]
    pub(crate) fn ensure_measured(&self) -> Result<()> {
        if self.sel.link.get().is_some() {
            return Ok(());
        }
        let remote = self.group.local_addr().filter(|a| !a.ip().is_loopback());
        let Some(addr) = remote.filter(|_| self.size() >= 2) else {
            let _ = self.sel.topo.set(Arc::new(Topology::flat(self.size())));
            let _ = self.sel.link.set(None);
            return Ok(());
        };
        let (topo, model) = crate::measure::measure(self, addr.ip())?;
        let _ = self.sel.topo.set(Arc::new(topo));
        let _ = self.sel.link.set(model);
        Ok(())
    }

    /// One call's life, the one path of every entry point (collectives, point-to-point,
    /// device staging). Begin: earlier non-blocking calls finish first (program order on every
    /// rank) and a poisoned group refuses at once. Finish: any error poisons the group once and
    /// aborts the peers once, naming this rank, the call and the cause — a local refusal too (a
    /// bad argument, a forced algorithm that does not apply), since the peers would otherwise
    /// wait in a call this rank never makes until their timeout.
    #[inline]
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
                (tutti_runtime::Error::Aborted { rank: me, reason: reason.clone() }, reason)
            }
        };
        self.group.fail(&re, &reason);
    }

    /// Choose the algorithm, then [`Comm::execute`]. Called by the collectives' methods inside
    /// [`Comm::call`], after they validated their arguments.
    ///
    /// `plan` is a trait object, as in [`Comm::execute`]: one copy of each serves every
    /// collective and element type (as generics they were compiled once per caller and type,
    /// 64 copies in collbench's crate).
    pub(crate) fn run(&self, req: Req<'_>, plan: &PlanFn<'_>) -> Result<Stats> {
        // The link measurement, once per group, at its first collective (the same call on every rank).
        self.ensure_measured()?;
        // The collective's `plan` refuses an algorithm that cannot run here (`Coll::supports`).
        let (coll, bytes, uniform) = (req.coll, req.bytes, req.uniform);
        let algo = self.sel.algo(coll, bytes, self.size(), uniform);
        let stats = self.execute(req, algo, plan)?;
        if let Some(key) = self.sel.tuning(coll, bytes, uniform) {
            // The algorithm that ran (direct reads may have fallen back to messages).
            if let Some(mut times) = self.sel.record(key, stats.algo, stats.elapsed) {
                // Every rank reaches this at the same call: agree on the slowest rank's times.
                self.exec_allreduce_f64(Algo::Tree, &mut times, ReduceOp::Max)?;
                if let Some(best) = self.sel.decide(key, &times) {
                    debug!(op = coll.name(), bytes, %best, ?times, "tuned");
                }
            }
        }
        Ok(stats)
    }

    /// Plan `req` with `algo`, take the sequence number and execute: no choice, no link measurement, no
    /// tuning (what the link measurement and the tuner's agreement run on).
    pub(crate) fn execute(&self, req: Req<'_>, algo: Algo, plan: &PlanFn<'_>) -> Result<Stats> {
        let mut algo = algo;
        if algo == Algo::Direct {
            // Set up already, the common case: straight to the call.
            let st = self.sel.direct.lock();
            if let crate::direct::State::Ready(_) = &*st {
                return self.direct_call(st, req, Moment::now());
            }
            let (st, ready) = self.direct_ready(st)?;
            // The call's deadline starts after the one-time set-up, whichever way it runs.
            let start = Moment::now();
            match ready {
                None => return self.direct_call(st, req, start),
                Some(why) if self.sel.forced(req.coll) => {
                    return Err(Error::Unsupported {
                        rank: self.rank(),
                        op: req.coll.name(),
                        algo: algo.name(),
                        detail: why,
                    })
                }
                // Every rank learned the same at the set-up: all choose again alike.
                Some(_) => algo = self.sel.algo(req.coll, req.bytes, self.size(), req.uniform),
            }
        }
        self.settle_direct()?;
        let start = Moment::now();
        let op = req.coll.name();
        let cfg = &self.sel.cfg;
        let ctx = PlanCtx {
            rank: self.rank(),
            n: self.size(),
            esize: req.dtype.size(),
            seg: cfg.segment,
            in_place: req.input.is_none(),
        };
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        // A call shaped like a recent one runs that one's plan (algorithms are pure functions
        // of the key and the topology); `v` calls, whose per-rank counts the key lacks, plan
        // afresh.
        let topo = self.sel.topo.get();
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
        let fp = req.fingerprint(algo, cfg);
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
        Ok(Stats { algo, bytes_sent, elapsed, seq })
    }

    /// Before a call that does not read directly: the stamps of this rank's unchecked small
    /// broadcasts as root ([`crate::direct::Direct::settle_all`]).
    pub(crate) fn settle_direct(&self) -> Result<()> {
        // Held already on this thread only by the windows' set-up, whose exchange runs here
        // (nothing to check then).
        let Some(st) = self.sel.direct.try_lock() else { return Ok(()) };
        match &*st {
            crate::direct::State::Ready(d) => d.settle_all(&self.group),
            _ => Ok(()),
        }
    }

    /// Set up direct reads in this group if not yet done (a collective step, the same on every
    /// rank), `st` being its state, held: the state, still held, and `None` when they can run,
    /// else why not.
    fn direct_ready<'a>(
        &'a self,
        mut st: CallGuard<'a, crate::direct::State>,
    ) -> Result<(CallGuard<'a, crate::direct::State>, Option<String>)> {
        if let crate::direct::State::Unknown = *st {
            *st = crate::direct::Direct::setup(
                &self.group,
                self.topo_now().hosts() <= 1,
                self.sel.cfg.single_copy,
                |mine, all| self.exec_allgather(Algo::Ring, mine, all),
                |x| {
                    let mut v = [x];
                    self.exec_allreduce_f64(Algo::Tree, &mut v, ReduceOp::Max)?;
                    Ok(v[0])
                },
            )?;
            // The set-up, which every rank reaches at the same call (the first the table or a
            // forced algorithm gives to direct reads), told every rank the same.
            match &*st {
                crate::direct::State::Ready(d) if !d.single() => self.sel.single_failed(),
                crate::direct::State::Ready(_) => {}
                _ => self.sel.direct_failed(),
            }
            self.sel.fix();
        }
        let why = match &*st {
            crate::direct::State::Ready(_) => None,
            crate::direct::State::Off(why) => Some(why.clone()),
            crate::direct::State::Unknown => Some("not set up".into()),
        };
        Ok((st, why))
    }

    /// Run `req` by direct reads (`st`, set up) from `start`, and its stats. They are built
    /// here from the two words [`Comm::execute_direct`] returns: with the stats built there and
    /// moved out, the 2-rank 8-byte allreduce took 0.19–0.23 µs against 0.17–0.19.
    #[inline(always)]
    fn direct_call(
        &self,
        st: CallGuard<'_, crate::direct::State>,
        req: Req<'_>,
        start: Moment,
    ) -> Result<Stats> {
        let (coll, bytes) = (req.coll, req.bytes);
        let (sent, seq) = self.execute_direct(st, req, start)?;
        let elapsed = start.elapsed();
        debug!(op = coll.name(), seq, bytes, algo = "direct", ?elapsed, "collective done");
        Ok(Stats { algo: Algo::Direct, bytes_sent: sent, elapsed, seq })
    }

    /// Run `req` by direct reads of the peers' windows (`st`, set up: see
    /// [`Comm::direct_ready`]): the bytes this rank published and the call's sequence number,
    /// from which [`Comm::direct_call`] builds the stats.
    fn execute_direct(
        &self,
        mut st: CallGuard<'_, crate::direct::State>,
        req: Req<'_>,
        start: Moment,
    ) -> Result<(u64, u64)> {
        let crate::direct::State::Ready(d) = &mut *st else {
            return Err(Error::Unsupported {
                rank: self.rank(),
                op: req.coll.name(),
                algo: Algo::Direct.name(),
                detail: "direct reads are not set up in this group".into(),
            });
        };
        let cfg = &self.sel.cfg;
        let seq = self.group.next_seq();
        let fp = req.fingerprint(Algo::Direct, cfg);
        let call = crate::direct::Call {
            group: &self.group,
            op_name: req.coll.name(),
            desc: crate::direct::desc(self.group.id(), seq, fp),
            start,
            deadline: Deadline::after(start, self.group.timeout()),
            bytes: req.bytes,
        };
        let (n, len) = (self.size(), req.data.len());
        let dst = req.data.as_mut_ptr();
        let src = req.input.map_or(dst as *const u8, <[u8]>::as_ptr);
        let op = req.redop.unwrap_or(ReduceOp::Sum);
        // SAFETY: `src` and `dst` are the call's input and data, valid for the lengths each
        // collective's method checked, and distinct when the call is out of place.
        let published = unsafe {
            match req.coll {
                Coll::Allreduce => {
                    d.allreduce(&call, src, dst, len, req.dtype, op, req.finish).map(|()| len)
                }
                Coll::Broadcast => {
                    let root = req.root.unwrap_or(0);
                    d.broadcast(&call, root, src, dst, len).map(|()| {
                        if root == self.rank() {
                            len
                        } else {
                            0
                        }
                    })
                }
                Coll::Allgather | Coll::ReduceScatter | Coll::AllToAll if req.uniform => {
                    let block = req.bytes / n;
                    // What the peers take from this rank: its block (all-gather, read by each),
                    // or the n - 1 blocks that are theirs, as a message algorithm sends them.
                    d.blocks(&call, req.coll, src, dst, block, req.dtype, op).map(|()| {
                        if req.coll == Coll::Allgather {
                            block
                        } else {
                            block * (n - 1)
                        }
                    })
                }
                _ => {
                    return Err(Error::Unsupported {
                        rank: self.rank(),
                        op: req.coll.name(),
                        algo: Algo::Direct.name(),
                        detail: "direct reads run allreduce, broadcast, and all-gather, \
                                 reduce-scatter and all-to-all of equal counts"
                            .into(),
                    })
                }
            }
        }?;
        drop(st);
        Ok((published as u64, seq))
    }

    /// An in-place allreduce of `x` with `algo`, straight through [`Comm::execute`].
    pub(crate) fn exec_allreduce_f64(&self, algo: Algo, x: &mut [f64], op: ReduceOp) -> Result<()> {
        let count = x.len();
        let req = Req {
            coll: Coll::Allreduce,
            dtype: DType::F64,
            redop: Some(op),
            root: None,
            count,
            bytes: size_of_val(x),
            uniform: true,
            data: as_bytes_mut(x),
            input: None,
            finish: None,
        };
        self.execute(req, algo, &|ctx, a, t| crate::coll::allreduce::plan(ctx, a, count, t))
            .map(|_| ())
    }

    /// An allgather of `mine` (the same length on every rank) into `all` with `algo`, straight
    /// through [`Comm::execute`].
    pub(crate) fn exec_allgather(&self, algo: Algo, mine: &[u8], all: &mut [u8]) -> Result<()> {
        let blocks = crate::plan::blocks_from_counts(&vec![mine.len(); self.size()], 1);
        let req = Req {
            coll: Coll::Allgather,
            dtype: DType::U8,
            redop: None,
            root: None,
            count: all.len(),
            bytes: all.len(),
            uniform: true,
            data: all,
            input: Some(mine),
            finish: None,
        };
        self.execute(req, algo, &|ctx, a, t| crate::coll::allgather::plan(ctx, a, &blocks, t))
            .map(|_| ())
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
