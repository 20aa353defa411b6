//! Gather: the root receives every rank's block, in rank order.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::plan::{split, Plan};
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
        self.call(Coll::Gather.name(), || {
            self.check_root(Coll::Gather.name(), root)?;
            let n = self.size();
            if self.rank() == root && output.len() != input.len() * n {
                return Err(self.invalid(
                    "gather",
                    format!(
                        "root output has {} elements, expected {} x {n}",
                        output.len(),
                        input.len()
                    ),
                ));
            }
            let es = size_of::<T>();
            let blocks = split(input.len() * n, n, es);
            let req = Req {
                coll: Coll::Gather,
                dtype: T::DTYPE,
                redop: None,
                root: Some(root),
                count: input.len(),
                bytes: input.len() * n * es,
                uniform: true,
                data: as_bytes_mut(output),
                input: Some(as_bytes(input)),
            };
            self.run(req, |ctx, algo| plan(ctx, algo, &blocks, root))
        })
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
        | Algo::Dissemination => return Err(super::refuse(ctx, Coll::Gather, algo)),
    })
}
