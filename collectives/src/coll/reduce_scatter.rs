//! Reduce-scatter(v): the inputs are reduced elementwise and rank `r` receives block `r`.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element, ReduceOp};
use crate::error::Result;
use crate::plan::{blocks_from_counts, Plan};
use crate::select::Algo;
use crate::topo::Topology;

use super::Coll;

impl Comm {
    /// Reduce-scatter: the inputs (length `size() * output.len()`) are reduced elementwise and
    /// rank `r` receives block `r` of the result.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `op` and the same lengths.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for wrong lengths.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<Stats> {
        self.call(Coll::ReduceScatter.name(), || {
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
            super::with_equal_counts(output.len(), n, |counts| {
                self.reduce_scatter_impl(Some(input), output, counts, op)
            })
        })
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
        self.call(Coll::ReduceScatter.name(), || {
            let n = self.size();
            if !buf.len().is_multiple_of(n) {
                return Err(self.invalid(
                    "reduce_scatter",
                    format!("{} elements do not divide by {n} ranks", buf.len()),
                ));
            }
            super::with_equal_counts(buf.len() / n, n, |counts| {
                self.reduce_scatter_impl(None, buf, counts, op)
            })
        })
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
        self.call(Coll::ReduceScatter.name(), || {
            self.check_counts(Coll::ReduceScatter.name(), counts, input.len())?;
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
        })
    }

    fn reduce_scatter_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Stats> {
        let es = size_of::<T>();
        let total: usize = counts.iter().sum();
        let uniform = counts.windows(2).all(|w| w[0] == w[1]);
        let rank = self.rank();
        let req = Req {
            coll: Coll::ReduceScatter,
            dtype: T::DTYPE,
            redop: Some(op),
            root: None,
            count: total,
            bytes: total * es,
            uniform,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
            finish: None,
        };
        let in_place = input.is_none();
        let st = self
            .run(req, &|ctx, algo, topo| plan(ctx, algo, &blocks_from_counts(counts, es), topo))?;
        if in_place {
            let c = counts[rank];
            let off: usize = counts[..rank].iter().sum();
            self.finish_avg(op, &mut out[off..off + c]);
        } else {
            self.finish_avg(op, out);
        }
        Ok(st)
    }
}

/// The algorithms that implement reduce-scatter.
pub(crate) const ALGOS: &[Algo] =
    &[Algo::Ring, Algo::RecursiveHalving, Algo::TwoLevel, Algo::Direct];

/// The schedule `algo` runs for a reduce-scatter of `blocks` (byte offset and length per rank)
/// on `topo` (the ring follows hosts).
pub(crate) fn plan(
    ctx: &PlanCtx,
    algo: Algo,
    blocks: &[(usize, usize)],
    topo: &Topology,
) -> Result<Plan> {
    super::check(ctx, Coll::ReduceScatter, algo, true)?;
    Ok(match algo {
        Algo::Ring => algo::on_ring(ctx, topo, blocks, |c, b, _| algo::ring::reduce_scatter(c, b)),
        Algo::TwoLevel => algo::two_level::reduce_scatter(ctx, blocks, topo)
            .ok_or_else(|| super::no_two_level(ctx, Coll::ReduceScatter, topo))?,
        Algo::RecursiveHalving => algo::halving_doubling::reduce_scatter(ctx, blocks),
        Algo::RecursiveDoubling
        | Algo::Rabenseifner
        | Algo::Tree
        | Algo::Chain
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::Dissemination
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::ReduceScatter, algo)),
    })
}
