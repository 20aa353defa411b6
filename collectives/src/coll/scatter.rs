//! Scatter: rank `r` receives block `r` of the root's buffer.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::plan::{split, Plan};
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
        self.call(Coll::Scatter.name(), || {
            self.check_root(Coll::Scatter.name(), root)?;
            let n = self.size();
            if self.rank() == root && input.len() != output.len() * n {
                return Err(self.invalid(
                    "scatter",
                    format!(
                        "root input has {} elements, expected {} x {n}",
                        input.len(),
                        output.len()
                    ),
                ));
            }
            let es = size_of::<T>();
            let blocks = split(output.len() * n, n, es);
            let req = Req {
                coll: Coll::Scatter,
                dtype: T::DTYPE,
                redop: None,
                root: Some(root),
                count: output.len(),
                bytes: output.len() * n * es,
                uniform: true,
                data: as_bytes_mut(output),
                input: Some(as_bytes(input)),
            };
            self.run(req, |ctx, algo| plan(ctx, algo, &blocks, root))
        })
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
        | Algo::Dissemination => return Err(super::refuse(ctx, Coll::Scatter, algo)),
    })
}
