//! The collectives, one file each: the [`Comm`](crate::Comm) methods that validate a call and
//! run it, the algorithms that implement the collective, and `plan`, which turns an algorithm
//! into the schedule one rank runs. `plan` matches every [`Algo`]: one that does not apply is an
//! error, never a silent fallback to another.

use std::fmt;

use tutti_runtime::OpKind;

use crate::algo::PlanCtx;
use crate::error::Error;
use crate::plan::{blocks_from_counts, Plan};
use crate::select::Algo;
use crate::topo::Topology;

pub(crate) mod allgather;
pub(crate) mod allreduce;
pub(crate) mod alltoall;
pub(crate) mod barrier;
pub(crate) mod broadcast;
pub(crate) mod gather;
mod p2p;
pub(crate) mod reduce;
pub(crate) mod reduce_scatter;
mod rooted;
pub(crate) mod scatter;

/// The collectives: one enum, one spelling (`name`) in errors, logs, `TUTTI_ALGO`, collbench
/// and on the wire ([`Coll::op_kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Coll {
    /// Allreduce.
    Allreduce,
    /// Broadcast.
    Broadcast,
    /// Reduce.
    Reduce,
    /// Allgather(v).
    Allgather,
    /// Reduce-scatter(v).
    ReduceScatter,
    /// All-to-all(v).
    AllToAll,
    /// Gather.
    Gather,
    /// Scatter.
    Scatter,
    /// Barrier.
    Barrier,
}

impl Coll {
    /// All collectives.
    pub const ALL: [Coll; 9] = [
        Coll::Allreduce,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::Allgather,
        Coll::ReduceScatter,
        Coll::AllToAll,
        Coll::Gather,
        Coll::Scatter,
        Coll::Barrier,
    ];

    /// The collective's kind on the wire (in every message's fingerprint).
    pub fn op_kind(self) -> OpKind {
        match self {
            Coll::Allreduce => OpKind::Allreduce,
            Coll::Broadcast => OpKind::Broadcast,
            Coll::Reduce => OpKind::Reduce,
            Coll::Allgather => OpKind::Allgather,
            Coll::ReduceScatter => OpKind::ReduceScatter,
            Coll::AllToAll => OpKind::AllToAll,
            Coll::Gather => OpKind::Gather,
            Coll::Scatter => OpKind::Scatter,
            Coll::Barrier => OpKind::Barrier,
        }
    }

    /// Name in errors, logs, `TUTTI_ALGO` and collbench: the wire kind's name.
    pub fn name(self) -> &'static str {
        self.op_kind().name()
    }

    /// Parse a name.
    pub fn parse(s: &str) -> Option<Coll> {
        Coll::ALL.into_iter().find(|c| c.name() == s)
    }

    /// The algorithms that implement this collective.
    pub fn algos(self) -> &'static [Algo] {
        match self {
            Coll::Allreduce => allreduce::ALGOS,
            Coll::Broadcast => broadcast::ALGOS,
            Coll::Reduce => reduce::ALGOS,
            Coll::Allgather => allgather::ALGOS,
            Coll::ReduceScatter => reduce_scatter::ALGOS,
            Coll::AllToAll => alltoall::ALGOS,
            Coll::Gather => gather::ALGOS,
            Coll::Scatter => scatter::ALGOS,
            Coll::Barrier => barrier::ALGOS,
        }
    }

    /// Whether `algo` can run this collective on `n` ranks (`uniform`: every rank contributes
    /// the same count).
    ///
    /// # Errors
    /// Why not: the algorithm does not implement the collective, needs a power-of-two world, or
    /// equal counts.
    pub fn supports(self, algo: Algo, n: usize, uniform: bool) -> Result<(), String> {
        if !self.algos().contains(&algo) {
            return Err(format!("{algo} does not implement {self}"));
        }
        let why = match (self, algo) {
            (Coll::Allgather, Algo::RecursiveDoubling)
            | (Coll::ReduceScatter, Algo::RecursiveHalving)
                if !n.is_power_of_two() =>
            {
                "needs a power-of-two world"
            }
            (Coll::Allgather | Coll::AllToAll | Coll::ReduceScatter, Algo::Direct) if !uniform => {
                "needs equal counts on every rank"
            }
            (Coll::Allgather | Coll::AllToAll, Algo::Bruck) if !uniform => {
                "needs equal counts on every rank"
            }
            _ => return Ok(()),
        };
        Err(format!("{algo} {why} ({n} ranks)"))
    }

    /// The schedule `algo` runs on `ctx.rank` for a call in which rank `r` contributes
    /// `counts[r]` elements (allreduce, broadcast and reduce work on one buffer of `counts[0]`
    /// elements on every rank; in an all-to-all rank `r` sends `counts[r]` elements to every
    /// peer), rooted at `root`: what
    /// [`Comm`](crate::Comm) runs, for tests and tools that examine schedules.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when `algo` cannot run this call (see [`Coll::supports`]);
    /// [`Error::InvalidArgument`] when `counts` does not have one entry per rank.
    pub fn plan(
        self,
        algo: Algo,
        ctx: &PlanCtx,
        counts: &[usize],
        root: usize,
    ) -> Result<Plan, Error> {
        self.plan_on(algo, ctx, counts, root, &Topology::flat(ctx.n))
    }

    /// [`Coll::plan`] on a group whose ranks sit on hosts as `topo` says: the ring and chain
    /// follow hosts, and two-level allreduce, all-gather and reduce-scatter apply.
    ///
    /// # Errors
    /// As [`Coll::plan`]; [`Error::Unsupported`] for two-level on a topology without at least
    /// 2 hosts of the same number (at least 2) of ranks.
    pub fn plan_on(
        self,
        algo: Algo,
        ctx: &PlanCtx,
        counts: &[usize],
        root: usize,
        topo: &Topology,
    ) -> Result<Plan, Error> {
        if counts.len() != ctx.n || root >= ctx.n.max(1) {
            return Err(Error::InvalidArgument {
                rank: ctx.rank,
                op: self.name(),
                detail: format!("{} counts and root {root} for {} ranks", counts.len(), ctx.n),
            });
        }
        let whole = counts.first().copied().unwrap_or(0);
        let blocks = blocks_from_counts(counts, ctx.esize);
        match self {
            Coll::Allreduce => allreduce::plan(ctx, algo, whole, topo),
            Coll::Broadcast => broadcast::plan(ctx, algo, whole * ctx.esize, root, topo),
            Coll::Reduce => reduce::plan(ctx, algo, whole * ctx.esize, root),
            Coll::Allgather => allgather::plan(ctx, algo, &blocks, topo),
            Coll::ReduceScatter => reduce_scatter::plan(ctx, algo, &blocks, topo),
            Coll::AllToAll => {
                let mine = counts.get(ctx.rank).copied().unwrap_or(0);
                let send = blocks_from_counts(&vec![mine; ctx.n], ctx.esize);
                alltoall::plan(ctx, algo, &send, &blocks, mine * ctx.n * ctx.esize)
            }
            Coll::Gather => gather::plan(ctx, algo, &blocks, root),
            Coll::Scatter => scatter::plan(ctx, algo, &blocks, root),
            Coll::Barrier => barrier::plan(ctx, algo),
        }
    }
}

/// `f` of `n` equal counts `c`: on the stack up to 16 ranks, so that a call of equal blocks
/// allocates nothing for them (a heap allocation was a tenth of an 8-byte all-gather).
pub(crate) fn with_equal_counts<R>(c: usize, n: usize, f: impl FnOnce(&[usize]) -> R) -> R {
    const ON_STACK: usize = 16;
    if n <= ON_STACK {
        f(&[c; ON_STACK][..n])
    } else {
        f(&vec![c; n])
    }
}

/// [`Coll::supports`] as the error a call returns (rank `ctx.rank`).
pub(crate) fn check(ctx: &PlanCtx, coll: Coll, algo: Algo, uniform: bool) -> Result<(), Error> {
    coll.supports(algo, ctx.n, uniform).map_err(|detail| Error::Unsupported {
        rank: ctx.rank,
        op: coll.name(),
        algo: algo.name(),
        detail,
    })
}

/// The error of `plan` for two-level on a group it cannot split into hosts.
pub(crate) fn no_two_level(ctx: &PlanCtx, coll: Coll, topo: &Topology) -> Error {
    Error::Unsupported {
        rank: ctx.rank,
        op: coll.name(),
        algo: Algo::TwoLevel.name(),
        detail: format!(
            "twolevel needs at least 2 hosts with the same number (at least 2) of ranks on \
             each; this group has {} ranks on {} hosts",
            ctx.n,
            topo.hosts()
        ),
    }
}

/// The error of `plan` for an algorithm that does not implement the collective.
pub(crate) fn refuse(ctx: &PlanCtx, coll: Coll, algo: Algo) -> Error {
    let detail = if algo == Algo::Direct && coll.algos().contains(&algo) {
        "direct reads have no message schedule: a communicator runs them in shared memory".into()
    } else {
        format!("{algo} does not implement {coll}")
    };
    Error::Unsupported { rank: ctx.rank, op: coll.name(), algo: algo.name(), detail }
}

impl fmt::Display for Coll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spelling_on_the_wire_and_off() {
        for c in Coll::ALL {
            assert_eq!(c.name(), c.op_kind().name());
            assert_eq!(Coll::parse(c.name()), Some(c));
        }
        assert_eq!(Coll::AllToAll.name(), "alltoall");
    }

    #[test]
    fn every_listed_algorithm_is_supported_somewhere_and_others_never() {
        for c in Coll::ALL {
            for a in Algo::ALL {
                let listed = c.algos().contains(&a);
                let somewhere = [1, 2, 3, 4, 8].iter().any(|&n| c.supports(a, n, true).is_ok());
                assert_eq!(listed, somewhere, "{c} {a}");
            }
        }
    }
}
