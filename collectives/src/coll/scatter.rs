//! Scatter: rank `r` receives block `r` of the root's buffer.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Stats};
use crate::dtype::Element;
use crate::error::Result;
use crate::plan::Plan;
use crate::select::Algo;

use super::Coll;

impl Comm {
    /// Scatter the root's `input` (length `size() * output.len()`): rank `r` receives block `r`
    /// in `output`. Non-roots may pass an empty `input`.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `root` and outputs of the same length.
    ///
    /// # Errors
    /// As [`Comm::gather`].
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<Stats> {
        self.rooted(Coll::Scatter, input, output, output.len(), root, plan)
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
        self.rooted_inplace(Coll::Scatter, buf, root, plan)
    }
}

/// The algorithms that implement scatter.
pub(crate) const ALGOS: &[Algo] = &[Algo::Linear];

/// The schedule `algo` runs for a scatter of `blocks` (byte offset and length per rank) from
/// `root`.
pub(crate) fn plan(
    ctx: &PlanCtx,
    algo: Algo,
    blocks: &[(usize, usize)],
    root: usize,
) -> Result<Plan> {
    Ok(match algo {
        Algo::Linear => algo::linear::scatter(ctx, blocks, root),
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
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Scatter, algo)),
    })
}
