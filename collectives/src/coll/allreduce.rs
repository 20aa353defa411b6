//! Allreduce: every rank ends with the elementwise reduction of every rank's buffer.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element, ReduceOp};
use crate::error::Result;
use crate::plan::Plan;
use crate::select::Algo;
use crate::topo::Topology;

use super::Coll;

impl Comm {
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
            dtype: T::DTYPE,
            redop: Some(op),
            root: None,
            count,
            bytes,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
        };
        let st = self.run(req, |ctx, algo, topo| plan(ctx, algo, count, topo))?;
        self.finish_avg(op, out);
        Ok(st)
    }

    /// Allreduce in place: every rank ends with the elementwise reduction of every rank's `buf`.
    ///
    /// # Collective contract
    /// Every rank of the group calls it with the same `op` and a buffer of the same length.
    ///
    /// # Errors
    /// [`Error::Runtime`](crate::Error::Runtime) for transport failures, timeouts and mismatched calls (the group is
    /// poisoned); [`Error::Unsupported`](crate::Error::Unsupported) for a forced algorithm that does not apply.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<Stats> {
        self.call(Coll::Allreduce.name(), || self.allreduce_impl(None, buf, op))
    }

    /// Allreduce out of place: `output` receives the reduction of every rank's `input`.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`]; `input` and `output` have the same length on every rank.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the lengths differ.
    pub fn allreduce_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<Stats> {
        self.call(Coll::Allreduce.name(), || {
            if input.len() != output.len() {
                return Err(self.invalid(
                    "allreduce",
                    format!("input has {} elements, output {}", input.len(), output.len()),
                ));
            }
            self.allreduce_impl(Some(input), output, op)
        })
    }
}

/// The algorithms that implement allreduce.
pub(crate) const ALGOS: &[Algo] =
    &[Algo::Ring, Algo::RecursiveDoubling, Algo::Rabenseifner, Algo::Tree, Algo::TwoLevel];

/// The schedule `algo` runs for an allreduce of `count` elements on `topo` (which ranks share a
/// host: the ring follows hosts; two-level needs the same number ≥ 2 of ranks on ≥ 2 hosts).
pub(crate) fn plan(ctx: &PlanCtx, algo: Algo, count: usize, topo: &Topology) -> Result<Plan> {
    Ok(match algo {
        Algo::Ring => algo::on_ring(ctx, topo, &[], |c, _, _| algo::ring::allreduce(c, count)),
        Algo::TwoLevel => algo::two_level::allreduce(ctx, count, topo).ok_or_else(|| {
            crate::Error::Unsupported {
                rank: ctx.rank,
                op: Coll::Allreduce.name(),
                algo: algo.name(),
                detail: format!(
                    "twolevel needs at least 2 hosts with the same number (at least 2) of \
                     ranks on each; this group has {} ranks on {} hosts",
                    ctx.n,
                    topo.hosts()
                ),
            }
        })?,
        Algo::RecursiveDoubling => algo::recursive_doubling::allreduce(ctx, count),
        Algo::Rabenseifner => algo::halving_doubling::allreduce(ctx, count),
        Algo::Tree => algo::tree::allreduce(ctx, count),
        Algo::RecursiveHalving
        | Algo::Chain
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::Dissemination => return Err(super::refuse(ctx, Coll::Allreduce, algo)),
    })
}
