//! Algorithm choice: by collective, message size and world size, from a table measured with
//! collbench (`docs/algorithms.md`), overridable per call and with `TUTTI_ALGO`.

use std::collections::HashMap;
use std::fmt;

use crate::coll::Coll;

/// Algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algo {
    /// Segmented pipelined ring.
    Ring,
    /// Recursive doubling.
    RecursiveDoubling,
    /// Rabenseifner: recursive halving reduce-scatter + recursive doubling allgather.
    Rabenseifner,
    /// Recursive halving reduce-scatter.
    RecursiveHalving,
    /// Binomial tree (reduce + broadcast for allreduce).
    Tree,
    /// Pipelined chain.
    Chain,
    /// Bruck.
    Bruck,
    /// Pairwise exchange.
    Pairwise,
    /// Post every send and receive at once.
    PostAll,
    /// Root talks to every rank directly.
    Linear,
    /// Dissemination.
    Dissemination,
    /// Two-level: messages within each host and across hosts in separate phases (allreduce:
    /// within, across, within again; all-gather: across, then within; reduce-scatter: within,
    /// then across).
    TwoLevel,
    /// Binomial scatter then ring allgather (broadcast).
    ScatterAllgather,
    /// Direct reads of the peers' memory, on one host: every rank publishes its part in shared
    /// memory and reads what it needs straight from the others' (allreduce, broadcast,
    /// all-gather, reduce-scatter, all-to-all; see `direct.rs`). Only where every rank of the
    /// group can map every other's memory.
    Direct,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 14] = [
        Algo::Ring,
        Algo::RecursiveDoubling,
        Algo::Rabenseifner,
        Algo::RecursiveHalving,
        Algo::Tree,
        Algo::Chain,
        Algo::Bruck,
        Algo::Pairwise,
        Algo::PostAll,
        Algo::Linear,
        Algo::Dissemination,
        Algo::TwoLevel,
        Algo::ScatterAllgather,
        Algo::Direct,
    ];

    /// Short name (collbench's algorithm column, `TUTTI_ALGO`).
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Rabenseifner => "rabenseifner",
            Algo::RecursiveHalving => "halving",
            Algo::Tree => "tree",
            Algo::Chain => "chain",
            Algo::Bruck => "bruck",
            Algo::Pairwise => "pairwise",
            Algo::PostAll => "postall",
            Algo::Linear => "linear",
            Algo::Dissemination => "dissemination",
            Algo::TwoLevel => "twolevel",
            Algo::ScatterAllgather => "scatter_allgather",
            Algo::Direct => "direct",
        }
    }

    /// Parse a name or a common alias (`binomial`, `recursive_doubling`, `halving_doubling`,
    /// `hierarchical`, `van_de_geijn`).
    pub fn parse(s: &str) -> Option<Algo> {
        let s = s.trim().to_ascii_lowercase();
        let alias = match s.as_str() {
            "binomial" => "tree",
            "recursive_doubling" | "recursive-doubling" => "rd",
            "halving_doubling" | "halving-doubling" => "rabenseifner",
            "recursive_halving" | "recursive-halving" => "halving",
            "post_all" | "post-all" => "postall",
            "two_level" | "two-level" | "hierarchical" => "twolevel",
            "direct_read" | "direct-read" | "shm_direct" => "direct",
            "scatter-allgather" | "scatter+allgather" | "van_de_geijn" | "vandegeijn" => {
                "scatter_allgather"
            }
            other => other,
        };
        Algo::ALL.into_iter().find(|a| a.name() == alias)
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-collective algorithm overrides, e.g. from `TUTTI_ALGO=allreduce:ring,broadcast:chain`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides(pub HashMap<Coll, Algo>);

impl Overrides {
    /// The algorithm set for `coll`, if any (no hashing when none is set).
    pub fn get(&self, coll: Coll) -> Option<Algo> {
        if self.0.is_empty() {
            return None;
        }
        self.0.get(&coll).copied()
    }

    /// Parse `coll:algo[,coll:algo…]`.
    ///
    /// # Errors
    /// A message naming the unknown collective or algorithm, or an algorithm that does not
    /// implement the collective.
    pub fn parse(s: &str) -> Result<Overrides, String> {
        let mut m = HashMap::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (c, a) = item
                .split_once(':')
                .ok_or_else(|| format!("TUTTI_ALGO item {item:?} is not coll:algo"))?;
            let coll = Coll::parse(c.trim())
                .ok_or_else(|| format!("TUTTI_ALGO: unknown collective {c:?}"))?;
            let algo =
                Algo::parse(a).ok_or_else(|| format!("TUTTI_ALGO: unknown algorithm {a:?}"))?;
            if !coll.algos().contains(&algo) {
                let names: Vec<&str> = coll.algos().iter().map(|a| a.name()).collect();
                return Err(format!(
                    "TUTTI_ALGO: {coll} has no algorithm {algo} (choose from {})",
                    names.join(", ")
                ));
            }
            m.insert(coll, algo);
        }
        Ok(Overrides(m))
    }
}

/// The automatic choice on one host (and over memory). `bytes` is the collective's S as
/// nccl-tests defines it (one rank's buffer for allreduce/broadcast/reduce, the whole gathered
/// or scattered buffer otherwise). Thresholds come from collbench runs on the reference machine
/// (`docs/algorithms.md`); on links measured slower than loopback the communicator chooses from
/// the cost model instead (`model.rs`).
pub fn choose(coll: Coll, bytes: usize, n: usize, uniform: bool) -> Algo {
    const K: usize = 1 << 10;
    match coll {
        Coll::Allreduce => match n {
            1 => Algo::RecursiveDoubling,
            2 if bytes <= 256 * K => Algo::RecursiveDoubling,
            2 => Algo::Ring,
            _ if bytes <= 256 * K => Algo::Tree,
            _ if bytes <= 4096 * K => Algo::Rabenseifner,
            _ => Algo::Ring,
        },
        Coll::Broadcast => {
            if bytes <= 256 * K || n <= 2 {
                Algo::Tree
            } else {
                Algo::Chain
            }
        }
        Coll::Reduce => Algo::Tree,
        Coll::Allgather => {
            // With 2 ranks, one whole-block exchange: at 64 MiB 0.83 of the segmented ring's
            // time (both move the same bytes; the ring's segments only pay off when forwarded).
            if uniform && (n == 2 || n.is_power_of_two() && bytes <= 4096 * K) {
                Algo::RecursiveDoubling
            } else if uniform && bytes <= 64 * K {
                Algo::Bruck
            } else {
                Algo::Ring
            }
        }
        Coll::ReduceScatter => {
            if n.is_power_of_two() && bytes <= 4096 * K {
                Algo::RecursiveHalving
            } else {
                Algo::Ring
            }
        }
        Coll::AllToAll => {
            // Bruck's log2(n) messages for tiny equal blocks from 4 ranks on: with 4 ranks
            // 0.67-0.77 of post-all's time at 8 B and 1 KiB blocks (even at 16 KiB), with 8
            // ranks 0.6; with 3 it is slower (two rounds one after the other for 2 messages).
            if uniform && n >= 4 && bytes / n <= 4 * K {
                Algo::Bruck
            } else if bytes / n.max(1) <= 32 * K {
                Algo::PostAll
            } else {
                Algo::Pairwise
            }
        }
        Coll::Gather | Coll::Scatter => Algo::Linear,
        Coll::Barrier => Algo::Dissemination,
    }
}

/// Whether direct reads ([`Algo::Direct`]) beat messages for a call of `coll` moving `bytes`
/// (nccl-tests' S) on `n` ranks of one host that map each other's memory. From collbench runs
/// on the reference machine (2 cores; `docs/algorithms.md`), direct reads against messages
/// through shared memory, interleaved, in steady state (hundreds of calls of one size): with 2
/// ranks, each on a core, they win up to 16 KiB (64 KiB for a broadcast) and where messages
/// take several steps (a large broadcast, an allreduce of 1–4 MiB); with 4 ranks on 2 cores,
/// whose waits give the CPU to the rank waited for, they win at every size (a small broadcast's
/// root runs ahead of its readers on the line slots, as on messages), but all-to-all past
/// 1 MiB, where blocks under 512 KiB go through the windows (with 8 ranks at 2 MiB, 1.76 of
/// pairwise exchange's time). Blocks of 512 KiB or more go by single copy where the group can
/// (`single`, assumed until the set-up says), and a call waits for its lending peers to begin
/// it once, not once per buffer's worth: pairwise exchange's time over direct reads' (medians per round of 4–6
/// interleaved rounds, out of place / in place) was 1.07 / 2.69 at 8 MiB and 0.91 / 2.28 at
/// 16 MiB with 4 ranks, and at 32 and 64 MiB 0.86 and 0.96 per round in a run mostly of the
/// VM's usual phase (1.6 in its slow one); 1.04–1.08 from 4 to 16 MiB with 6 (slow phase);
/// 1.18–1.30 / 1.56–1.61 from 4 to 16 MiB with 8; 1.16–1.33 from 8 to 32 MiB with 16 (slow
/// phase). With 3 ranks 1.11 and 1.06 out of place at 2 and 4 MiB, but 0.92 and 0.78 at 8 and
/// 16 MiB. The out-of-place call decides (in place direct reads took a third to a half of
/// the time with 2–4 ranks; the choice cannot see it, since it must be the same on every
/// rank and one rank may call in place while another does not): direct reads up to 4 MiB
/// with 3 ranks, 8 MiB with 4–7, 16 MiB from 8 (no usual-phase run past it). With 2 ranks,
/// each on a core, out of place 0.74–0.78 from 16 MiB and 0.77 at 1 MiB: messages. An
/// all-gather of 2 ranks whose blocks go by single copy (`GATHER_SINGLE_FROM`) took 0.73 and
/// 0.92 of messages' time out of place at 8 and 32 MiB, 0.97 and 1.08 at 64 MiB in two runs
/// (0.59–0.89 in place; 4–6 rounds, the VM's slow phase): direct reads from 8 MiB, where the blocks are out of the
/// caches' reach; below, the kernel's copy is slower than `memcpy` on data in cache, and no
/// round of the usual phase came to measure it.
pub fn direct_pays(coll: Coll, bytes: usize, n: usize, uniform: bool, single: bool) -> bool {
    const K: usize = 1 << 10;
    const M: usize = 1 << 20;
    let b = bytes;
    match (coll, n) {
        (_, 0 | 1) => false,
        (Coll::Allgather | Coll::ReduceScatter | Coll::AllToAll, _) if !uniform => false,
        // The smallest calls run on the line slots (one cache line or a few per rank), where a
        // broadcast's root runs ahead of ranks that wait for a core.
        (Coll::Broadcast, 2) => b <= 64 * K || b >= M,
        (Coll::Broadcast, _) => true,
        (Coll::Allreduce, 2) => b <= 16 * K || (M..=4 * M).contains(&b),
        // An all-gather of 2 whose blocks go by single copy, out of the caches' reach.
        (Coll::Allgather, 2) => b <= 16 * K || single && b >= 8 * M,
        (Coll::ReduceScatter | Coll::AllToAll, 2) => b <= 16 * K,
        (Coll::Allreduce | Coll::Allgather | Coll::ReduceScatter, _) => true,
        (Coll::AllToAll, n) => {
            let most = match n {
                3 => 4 * M,
                4..=7 => 8 * M,
                _ => 16 * M,
            };
            b <= M || single && b / n >= crate::direct::SINGLE_FROM && b <= most
        }
        (Coll::Reduce | Coll::Gather | Coll::Scatter | Coll::Barrier, _) => false,
    }
}

/// Allreduces of at most this many bytes choose from the table even on slow links: there the
/// per-message CPU cost of ranks that share cores decides, as on loopback, more than the link,
/// and the tree, with fewer ranks busy at once, wins. Measured on 1 Gbit/s links (4 hosts × 1
/// and 2 ranks): at 4 KiB the tree took 0.4–0.5 of the model's choice, at 16 KiB 0.5 with 2
/// ranks per host; at 64 KiB the model's choice was the best. (Broadcast, all-gather and
/// reduce-scatter follow the model at every size: it picked their best there.)
pub(crate) const MODEL_FROM: usize = 16 << 10;

/// The one owner of a communicator's algorithm choice, in the order it is asked: a forced
/// algorithm (`Comm::with_algo`), the tuner (`TUTTI_TUNE=1`), the per-collective overrides
/// (`TUTTI_ALGO`), the cost model on links the measurement found slow (`measure.rs`), the built-in
/// table ([`choose`]); and the allreduce chunking policy (`TUTTI_CHUNK_BYTES`). Clones share
/// what was measured (the topology, the links) and what was tuned.
#[derive(Clone)]
pub(crate) struct Selector {
    pub(crate) cfg: std::sync::Arc<crate::config::Config>,
    pub(crate) force: Option<Algo>,
    tuner: std::sync::Arc<crate::tune::Tuner>,
    /// Which ranks share a host, once known (see `Comm::topology`).
    pub(crate) topo: std::sync::Arc<std::sync::OnceLock<std::sync::Arc<crate::topo::Topology>>>,
    /// The links, once measured (see `Comm::link_scale`): the cost model on links at least
    /// 4 times slower than loopback, `None` otherwise.
    pub(crate) link: std::sync::Arc<std::sync::OnceLock<Option<crate::model::Model>>>,
    /// The set-up found that this group cannot read directly (some rank does not share memory
    /// with another, or could not map every window): every rank learned it at the same call.
    direct_off: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The set-up found that this group's direct reads make no single copies (see
    /// `direct.rs`): every rank learned it at the same call.
    single_off: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The group's windows, once set up (see `direct.rs`).
    pub(crate) direct: crate::direct::Shared,
    /// The windows' set-up is over and said what it found (`direct_off`, `single_off`): from
    /// then on nothing the automatic choice depends on changes (set by [`Selector::fix`]).
    fixed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// This selector's last automatic choice, once fixed ([`Memo`]).
    memo: Memo,
}

/// The last automatic choice of a selector, once nothing it depends on can change (the
/// windows' set-up over, the links measured and needing no cost model, no tuning, nothing
/// forced): a call shaped like the one before, the common case in a training step or a
/// benchmark, takes it with one load instead of the table. One word: a bit that says it is set,
/// the collective's discriminant, `uniform`, the algorithm's index in [`Algo::ALL`] and the
/// bytes. A clone starts empty: its forced algorithm or links may differ.
#[derive(Default)]
struct Memo(std::sync::atomic::AtomicU64);

impl Memo {
    const SET: u64 = 1;
    /// Sizes the word holds (larger calls are not remembered).
    const MAX_BYTES: u64 = (1 << 54) - 1;

    #[inline]
    fn key(coll: Coll, bytes: usize, uniform: bool) -> Option<u64> {
        // Four bits each for the collective's discriminant and the algorithm's index.
        const _: () = {
            let mut i = 0;
            while i < Coll::ALL.len() {
                assert!((Coll::ALL[i] as usize) < 16);
                i += 1;
            }
            assert!(Algo::ALL.len() <= 16);
        };
        let (c, b) = (coll as u64, bytes as u64);
        (b <= Self::MAX_BYTES).then(|| Self::SET | c << 1 | u64::from(uniform) << 5 | b << 10)
    }

    #[inline]
    fn get(&self, coll: Coll, bytes: usize, uniform: bool) -> Option<Algo> {
        let k = Self::key(coll, bytes, uniform)?;
        let w = self.0.load(std::sync::atomic::Ordering::Relaxed);
        (w & !(0xf << 6) == k).then(|| Algo::ALL.get((w >> 6 & 0xf) as usize).copied()).flatten()
    }

    fn set(&self, coll: Coll, bytes: usize, uniform: bool, algo: Algo) {
        let (Some(k), Some(a)) =
            (Self::key(coll, bytes, uniform), Algo::ALL.iter().position(|x| *x == algo))
        else {
            return;
        };
        self.0.store(k | (a as u64) << 6, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clone for Memo {
    fn clone(&self) -> Memo {
        Memo::default()
    }
}

impl Selector {
    /// A selector with `cfg`'s overrides, nothing measured or tuned yet.
    pub(crate) fn new(cfg: crate::config::Config) -> Selector {
        Selector {
            cfg: std::sync::Arc::new(cfg),
            force: None,
            tuner: Default::default(),
            topo: Default::default(),
            link: Default::default(),
            direct_off: Default::default(),
            single_off: Default::default(),
            direct: Default::default(),
            fixed: Default::default(),
            memo: Memo::default(),
        }
    }

    /// The windows' set-up is over and its findings stored ([`Selector::direct_failed`],
    /// [`Selector::single_failed`]): the automatic choice may be remembered from now on.
    pub(crate) fn fix(&self) {
        self.fixed.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether the automatic choice may take direct reads: the setting (`TUTTI_DIRECT`), until
    /// the set-up finds the group cannot ([`Selector::direct_failed`]).
    #[inline]
    pub(crate) fn direct_on(&self) -> bool {
        self.cfg.direct && !self.direct_off.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The set-up found this group cannot read directly: from now on every rank chooses
    /// messages.
    pub(crate) fn direct_failed(&self) {
        self.direct_off.store(true, std::sync::atomic::Ordering::Release);
    }

    /// The set-up found this group's direct reads make no single copies: from now on the
    /// choice takes that into account on every rank.
    pub(crate) fn single_failed(&self) {
        self.single_off.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether `coll`'s algorithm is forced (`Comm::with_algo` or `TUTTI_ALGO`).
    #[inline]
    pub(crate) fn forced(&self, coll: Coll) -> bool {
        self.force.is_some() || self.cfg.overrides.get(coll).is_some()
    }

    /// The cost model, once the measurement found slow links (or `Comm::with_model` set one).
    #[inline]
    pub(crate) fn link_model(&self) -> Option<crate::model::Model> {
        self.link.get().copied().flatten()
    }

    /// The topology known so far (one host of `n` ranks before the link measurement).
    pub(crate) fn topo_now(&self, n: usize) -> std::sync::Arc<crate::topo::Topology> {
        self.topo
            .get()
            .cloned()
            .unwrap_or_else(|| std::sync::Arc::new(crate::topo::Topology::flat(n)))
    }

    /// The tuning class of a call, when tuning decides it.
    #[inline]
    pub(crate) fn tuning(
        &self,
        coll: Coll,
        bytes: usize,
        uniform: bool,
    ) -> Option<crate::tune::Key> {
        let tunable = match coll {
            Coll::Allreduce | Coll::Broadcast | Coll::Reduce => true,
            Coll::Allgather | Coll::ReduceScatter | Coll::AllToAll => uniform,
            Coll::Gather | Coll::Scatter | Coll::Barrier => false,
        };
        (self.cfg.tune && tunable && !self.forced(coll))
            .then(|| crate::tune::Key::new(coll, bytes, uniform))
    }

    /// The algorithm for a call of `coll` moving `bytes` (nccl-tests' S) on `n` ranks
    /// (`uniform`: every rank contributes the same count). `n` is the group's size, the same
    /// at every call of a selector (its [`Memo`] leaves it out).
    #[inline]
    pub(crate) fn algo(&self, coll: Coll, bytes: usize, n: usize, uniform: bool) -> Algo {
        if self.force.is_none() {
            if let Some(a) = self.memo.get(coll, bytes, uniform) {
                return a;
            }
        }
        let model = self.link_model();
        // Read before anything `auto` reads: a choice made from findings the set-up had not
        // stored yet is then never remembered.
        let fixed = self.fixed.load(std::sync::atomic::Ordering::Acquire);
        let auto = || {
            // Where every rank of the group maps every other's memory, direct reads from the
            // sizes where they measured faster than messages through shared memory. Links the
            // measurement found slow lead to other hosts: none to try there.
            let single = !self.single_off.load(std::sync::atomic::Ordering::Acquire);
            if model.is_none() && self.direct_on() && direct_pays(coll, bytes, n, uniform, single) {
                return Algo::Direct;
            }
            // On links slower than loopback, the cost model, above MODEL_FROM; it covers the
            // collectives whose choice trades steps against bytes. All-to-all's choice is
            // about message counts.
            let modelled = matches!(
                coll,
                Coll::Allreduce | Coll::Broadcast | Coll::Allgather | Coll::ReduceScatter
            );
            model
                .filter(|_| modelled && (coll != Coll::Allreduce || bytes > MODEL_FROM))
                .and_then(|m| {
                    let algos = coll
                        .algos()
                        .iter()
                        .copied()
                        .filter(|a| coll.supports(*a, n, uniform).is_ok());
                    m.best(coll, algos, bytes as f64, &self.topo_now(n))
                })
                .unwrap_or_else(|| choose(coll, bytes, n, uniform))
        };
        if let Some(key) = self.tuning(coll, bytes, uniform) {
            let direct = model.is_none() && self.direct_on();
            let picked = self.tuner.pick(key, n, auto(), direct);
            // A class whose table choice was direct reads, in a group that turned out not to
            // share memory: messages.
            if picked == Algo::Direct && !self.direct_on() {
                return auto();
            }
            return picked;
        }
        if let Some(a) = self.force.or_else(|| self.cfg.overrides.get(coll)) {
            return a;
        }
        let a = auto();
        // Remembered only once every input of `auto` is final: the set-up's findings stored,
        // the links measured (and no cost model, whose topology may come later).
        let measured = matches!(self.link.get(), Some(None));
        if measured && fixed {
            self.memo.set(coll, bytes, uniform, a);
        }
        a
    }

    /// The elements per piece of an allreduce of `count` elements of `esize` bytes on `n`
    /// ranks that runs as back-to-back pieces (`Config::chunk`), or `None` to run it whole:
    /// off, small, forced, tuned, on slow links (the links must have been measured), or
    /// fewer than two pieces.
    pub(crate) fn allreduce_pieces(&self, count: usize, esize: usize, n: usize) -> Option<usize> {
        let cfg = &self.cfg;
        let bytes = count * esize;
        if cfg.chunk == 0
            || bytes <= cfg.chunk
            || n < 2
            || self.forced(Coll::Allreduce)
            || cfg.tune
            || self.link_model().is_some()
        {
            return None;
        }
        let piece = cfg.chunk.max(2 * cfg.segment * n);
        let pieces = bytes.div_ceil(piece);
        (pieces >= 2).then(|| count.div_ceil(pieces))
    }

    /// Record a tuned call's time; the times every rank must agree on (by their maximum)
    /// when this call completes a round of the class.
    pub(crate) fn record(
        &self,
        key: crate::tune::Key,
        algo: Algo,
        t: std::time::Duration,
    ) -> Option<Vec<f64>> {
        self.tuner.record(key, algo, t)
    }

    /// Decide a class from the agreed times.
    pub(crate) fn decide(&self, key: crate::tune::Key, agreed: &[f64]) -> Option<Algo> {
        self.tuner.decide(key, agreed)
    }

    /// The choices tuning has made so far.
    pub(crate) fn tuned(&self) -> Vec<(Coll, usize, Algo)> {
        self.tuner.decided()
    }
}

#[cfg(test)]
mod link_tests {
    use super::*;
    use crate::comm::Comm;
    use crate::model::Model;

    /// The selector's choice for a call on `self`'s group.
    trait AlgoFor {
        fn algo_for(&self, coll: Coll, bytes: usize, uniform: bool) -> Algo;
    }

    impl AlgoFor for Comm {
        fn algo_for(&self, coll: Coll, bytes: usize, uniform: bool) -> Algo {
            self.sel.algo(coll, bytes, self.size(), uniform)
        }
    }

    #[test]
    fn large_all_to_alls_read_directly_where_their_blocks_go_by_single_copy() {
        let comms = Comm::mem_world(4);
        let c = &comms[0];
        let a2a = |b: usize| c.algo_for(Coll::AllToAll, b, true);
        assert_eq!(a2a(1 << 20), Algo::Direct);
        // Blocks under 512 KiB go through the windows: messages past 1 MiB.
        assert_eq!(a2a(3 << 19), Algo::Pairwise);
        for b in [2 << 20, 4 << 20, 8 << 20] {
            assert_eq!(a2a(b), Algo::Direct, "{b}");
        }
        assert_eq!(a2a(16 << 20), Algo::Pairwise);
        // 8 ranks from blocks of 512 KiB up to 16 MiB; 3 up to 4 MiB; 2 keep messages.
        let pays = |b: usize, n: usize| direct_pays(Coll::AllToAll, b, n, true, true);
        assert!(!pays(2 << 20, 8) && pays(4 << 20, 8) && pays(16 << 20, 8));
        assert!(!pays(32 << 20, 8) && !pays(4 << 20, 16) && pays(16 << 20, 16));
        assert!(pays(4 << 20, 3) && !pays(8 << 20, 3));
        assert!(!pays(4 << 20, 2));
        // A group whose set-up found no single copies: messages past 1 MiB.
        c.sel.single_failed();
        assert_eq!(a2a(2 << 20), Algo::Pairwise);
        assert_eq!(a2a(1 << 20), Algo::Direct);
    }

    #[test]
    fn large_all_gathers_of_2_read_directly_where_their_blocks_go_by_single_copy() {
        let comms = Comm::mem_world(2);
        let c = &comms[0];
        let ag = |b: usize| c.algo_for(Coll::Allgather, b, true);
        assert_eq!(ag(16 << 10), Algo::Direct);
        assert_ne!(ag(64 << 10), Algo::Direct);
        assert_ne!(ag(4 << 20), Algo::Direct);
        for b in [8 << 20, 64 << 20, 1 << 30] {
            assert_eq!(ag(b), Algo::Direct, "{b}");
        }
        // A group whose set-up found no single copies keeps messages there.
        c.sel.single_failed();
        assert_ne!(ag(8 << 20), Algo::Direct);
        assert_eq!(ag(16 << 10), Algo::Direct);
    }

    #[test]
    fn slow_links_choose_from_the_model() {
        let comms = Comm::mem_world(8);
        let c = &comms[0];
        // Over memory (and on one host) nothing is measured: the table's choices, direct reads
        // first (every rank maps every other's memory).
        assert_eq!(c.link_scale().unwrap(), 1.0);
        assert_eq!(c.topology().unwrap().hosts(), 1);
        assert_eq!(c.algo_for(Coll::Allreduce, 64 << 10, true), Algo::Direct);
        assert_eq!(c.algo_for(Coll::AllToAll, 2 << 20, true), Algo::Pairwise);
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
        // All-to-all is not moved (the table's choice, and no direct reads across hosts); a
        // forced algorithm still wins; on one host, the table and direct reads.
        assert_eq!(
            two.algo_for(Coll::AllToAll, 64 << 10, true),
            choose(Coll::AllToAll, 64 << 10, 8, true)
        );
        assert_eq!(two.with_algo(Algo::Ring).algo_for(Coll::Allreduce, 8, true), Algo::Ring);
        assert_eq!(ar(&c.with_hosts(&[0; 8]).unwrap(), 64 << 10), Algo::Direct);
        assert!(c.with_hosts(&[0; 3]).is_err());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remembered_choice_is_the_tables_and_a_forced_clone_does_not_take_it() {
        use crate::{Comm, Config, ReduceOp};
        use tutti_runtime::testing::{groups, Kind};
        // Rank 3 makes no single copies: the windows' set-up tells every rank, which then
        // chooses messages for large all-to-alls where it chose direct reads before.
        let comms: Vec<Comm> = groups(Kind::Mem, 4)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(r, g)| {
                Comm::with_config(g, Config { single_copy: r != 3, ..Default::default() })
            })
            .collect();
        let c = &comms[0];
        c.ensure_measured().unwrap();
        let (coll, b) = (Coll::AllToAll, 2usize << 20);
        // Measured, but the set-up not over: chosen, not remembered.
        assert_eq!(c.sel.algo(coll, b, 4, true), Algo::Direct);
        assert_eq!(c.sel.memo.get(coll, b, true), None);
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    c.with_algo(Algo::Direct).allreduce(&mut [1f32; 4], ReduceOp::Sum).unwrap()
                });
            }
        });
        assert_eq!(c.sel.algo(coll, b, 4, true), Algo::Pairwise);
        assert_eq!(c.sel.memo.get(coll, b, true), Some(Algo::Pairwise));
        let table = |k, b, uniform| {
            if direct_pays(k, b, 4, uniform, false) {
                Algo::Direct
            } else {
                choose(k, b, 4, uniform)
            }
        };
        let calls = [
            (Coll::Broadcast, 8),
            (Coll::AllToAll, 2 << 20),
            (Coll::AllToAll, 16 << 10),
            (Coll::Allgather, 2 << 20),
            (Coll::Allgather, 2 << 20),
            (Coll::Broadcast, 8),
            (Coll::Gather, 8),
            (coll, b),
        ];
        for (k, b) in calls {
            for uniform in [false, true] {
                let want = table(k, b, uniform);
                assert_eq!(c.sel.algo(k, b, 4, uniform), want, "{k:?} {b} {uniform}");
                assert_eq!(c.sel.memo.get(k, b, uniform), Some(want), "{k:?} {b} {uniform}");
                assert_eq!(c.sel.algo(k, b, 4, uniform), want, "remembered: {k:?} {b} {uniform}");
            }
        }
        assert_eq!(c.sel.memo.get(coll, b, false), None, "one choice remembered, the last");
        // A clone forced to an algorithm, or given a cost model, does not take it.
        assert_eq!(c.with_algo(Algo::Ring).sel.algo(coll, b, 4, true), Algo::Ring);
        assert_eq!(c.sel.memo.get(coll, b, true), Some(Algo::Pairwise));
        let m = crate::model::Model { alpha: 1e-3, beta: 1e-6, beta_local: 1e-9, gamma: 1e-10 };
        let (bc, bb) = (Coll::Broadcast, 8);
        assert_eq!(c.sel.algo(bc, bb, 4, true), Algo::Direct);
        assert_eq!(c.sel.memo.get(bc, bb, true), Some(Algo::Direct));
        assert_ne!(c.with_model(m).sel.algo(bc, bb, 4, true), Algo::Direct);
    }

    #[test]
    fn parse_overrides() {
        let o = Overrides::parse("allreduce:ring, broadcast:binomial").unwrap();
        assert_eq!(o.0[&Coll::Allreduce], Algo::Ring);
        assert_eq!(o.0[&Coll::Broadcast], Algo::Tree);
        assert!(Overrides::parse("allreduce:bruck").unwrap_err().contains("no algorithm bruck"));
        assert!(Overrides::parse("nope:ring").unwrap_err().contains("unknown collective"));
        assert!(Overrides::parse("allreduce").is_err());
        assert_eq!(Overrides::parse("").unwrap(), Overrides::default());
    }

    #[test]
    fn every_choice_is_valid() {
        for c in Coll::ALL {
            for n in [1, 2, 3, 4, 7, 8, 16] {
                for b in [0, 8, 1 << 12, 1 << 20, 1 << 28] {
                    let a = choose(c, b, n, true);
                    assert!(c.algos().contains(&a), "{c} {a}");
                    let a = choose(c, b, n, false);
                    assert!(c.algos().contains(&a), "{c} {a}");
                }
            }
        }
    }
}
