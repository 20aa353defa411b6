//! Allgather(v): every rank receives every rank's block, in rank order.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::plan::{blocks_from_counts, Plan};
use crate::select::Algo;
use crate::topo::Topology;

use super::Coll;

impl Comm {
    /// Allgather: `output` (length `size() * input.len()`) receives every rank's `input`, in
    /// rank order.
    ///
    /// # Collective contract
    /// Every rank calls it with inputs of the same length.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a wrong output length.
    pub fn allgather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<Stats> {
        self.call(Coll::Allgather.name(), || {
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
            super::with_equal_counts(input.len(), n, |counts| {
                self.allgather_impl(Some(input), output, counts)
            })
        })
    }

    /// Allgather in place: rank `r`'s contribution is `buf[r*c..(r+1)*c]` (`c = len / size`).
    ///
    /// # Collective contract
    /// As [`Comm::allgather`]; the length divides by the group size.
    ///
    /// # Errors
    /// As [`Comm::allgather`].
    pub fn allgather_inplace<T: Element>(&self, buf: &mut [T]) -> Result<Stats> {
        self.call(Coll::Allgather.name(), || {
            let n = self.size();
            if !buf.len().is_multiple_of(n) {
                return Err(self.invalid(
                    "allgather",
                    format!("{} elements do not divide by {n} ranks", buf.len()),
                ));
            }
            super::with_equal_counts(buf.len() / n, n, |counts| {
                self.allgather_impl(None, buf, counts)
            })
        })
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
        self.call(Coll::Allgather.name(), || {
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
        })
    }

    fn allgather_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        counts: &[usize],
    ) -> Result<Stats> {
        let es = size_of::<T>();
        let uniform = counts.windows(2).all(|w| w[0] == w[1]);
        let total = out.len();
        let req = Req {
            coll: Coll::Allgather,
            dtype: T::DTYPE,
            redop: None,
            root: None,
            count: total,
            bytes: size_of_val(out),
            uniform,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
            finish: None,
        };
        let _rank = self.rank();
        // The blocks only where a plan is made (not on a cached plan's or direct reads' path).
        self.run(req, &|ctx, algo, topo| plan(ctx, algo, &blocks_from_counts(counts, es), topo))
    }
}

/// The algorithms that implement allgather.
pub(crate) const ALGOS: &[Algo] =
    &[Algo::Ring, Algo::RecursiveDoubling, Algo::Bruck, Algo::TwoLevel, Algo::Direct];

/// The schedule `algo` runs for an allgather of `blocks` (byte offset and length per rank) on
/// `topo` (the ring follows hosts).
pub(crate) fn plan(
    ctx: &PlanCtx,
    algo: Algo,
    blocks: &[(usize, usize)],
    topo: &Topology,
) -> Result<Plan> {
    let uniform = blocks.windows(2).all(|w| w[0].1 == w[1].1);
    super::check(ctx, Coll::Allgather, algo, uniform)?;
    Ok(match algo {
        Algo::Ring => algo::on_ring(ctx, topo, blocks, |c, b, _| algo::ring::allgather(c, b)),
        Algo::TwoLevel => algo::two_level::allgather(ctx, blocks, topo)
            .ok_or_else(|| super::no_two_level(ctx, Coll::Allgather, topo))?,
        Algo::RecursiveDoubling => algo::recursive_doubling::allgather(ctx, blocks),
        Algo::Bruck => algo::bruck::allgather(ctx, blocks.first().map_or(0, |b| b.1)),
        Algo::Rabenseifner
        | Algo::RecursiveHalving
        | Algo::Tree
        | Algo::Chain
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::Dissemination
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Allgather, algo)),
    })
}
