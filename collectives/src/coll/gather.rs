//! Gather: the root receives every rank's block, in rank order.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Stats};
use crate::dtype::Element;
use crate::error::Result;
use crate::plan::Plan;
use crate::select::Algo;

use super::Coll;

impl Comm {
    /// Gather every rank's `input` into the root's `output` (length `size() * input.len()`, rank
    /// order). Non-roots may pass an empty `output`.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `root` and inputs of the same length.
    ///
    /// # Errors
    /// As [`Comm::broadcast`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a wrong output length at the root.
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<Stats> {
        self.rooted(Coll::Gather, input, output, input.len(), root, plan)
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
        self.rooted_inplace(Coll::Gather, buf, root, plan)
    }
}

/// The algorithms that implement gather.
pub(crate) const ALGOS: &[Algo] = &[Algo::Linear];

/// The schedule `algo` runs for a gather of `blocks` (byte offset and length per rank) to `root`.
pub(crate) fn plan(
    ctx: &PlanCtx,
    algo: Algo,
    blocks: &[(usize, usize)],
    root: usize,
) -> Result<Plan> {
    Ok(match algo {
        Algo::Linear => algo::linear::gather(ctx, blocks, root),
        Algo::Ring
        | Algo::RecursiveDoubling
        | Algo::Rabenseifner
        | Algo::RecursiveHalving
        | Algo::Tree
        | Algo::Chain
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Dissemination
        | Algo::TwoLevel
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Gather, algo)),
    })
}
