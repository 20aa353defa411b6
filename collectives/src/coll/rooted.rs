//! What gather and scatter share: a rooted collective over per-rank blocks, out of place and
//! in place.

use crate::algo::PlanCtx;
use crate::coll::Coll;
use crate::comm::Stats;
use crate::comm::{Comm, Req};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::plan::split;
use crate::plan::Plan;
use crate::select::Algo;

/// The `plan` of a rooted collective over per-rank blocks (gather, scatter).
pub(crate) type RootedPlan = fn(&PlanCtx, Algo, &[(usize, usize)], usize) -> Result<Plan>;

impl Comm {
    /// Gather or scatter out of place: `block` elements per rank; the root's output (gather) or
    /// input (scatter) holds every rank's block, in rank order.
    pub(crate) fn rooted<T: Element>(
        &self,
        coll: Coll,
        input: &[T],
        output: &mut [T],
        block: usize,
        root: usize,
        plan: RootedPlan,
    ) -> Result<Stats> {
        self.call(coll.name(), || {
            self.check_root(coll.name(), root)?;
            let n = self.size();
            let (what, whole) = if coll == Coll::Gather {
                ("output", output.len())
            } else {
                ("input", input.len())
            };
            if self.rank() == root && whole != block * n {
                return Err(self.invalid(
                    coll.name(),
                    format!("root {what} has {whole} elements, expected {block} x {n}"),
                ));
            }
            let es = size_of::<T>();
            let blocks = split(block * n, n, es);
            let req = Req {
                coll,
                dtype: T::DTYPE,
                redop: None,
                root: Some(root),
                count: block,
                bytes: block * n * es,
                uniform: true,
                data: as_bytes_mut(output),
                input: Some(as_bytes(input)),
                finish: None,
            };
            self.run(req, &|ctx, algo, _| plan(ctx, algo, &blocks, root))
        })
    }

    /// Gather or scatter in place: rank `r`'s block is `buf[r*c..(r+1)*c]`.
    pub(crate) fn rooted_inplace<T: Element>(
        &self,
        coll: Coll,
        buf: &mut [T],
        root: usize,
        plan: RootedPlan,
    ) -> Result<Stats> {
        self.call(coll.name(), || {
            self.check_root(coll.name(), root)?;
            let n = self.size();
            if !buf.len().is_multiple_of(n) {
                return Err(self.invalid(
                    coll.name(),
                    format!("{} elements do not divide by {n} ranks", buf.len()),
                ));
            }
            let blocks = split(buf.len(), n, size_of::<T>());
            let req = Req {
                coll,
                dtype: T::DTYPE,
                redop: None,
                root: Some(root),
                count: buf.len() / n,
                bytes: size_of_val(buf),
                uniform: true,
                data: as_bytes_mut(buf),
                input: None,
                finish: None,
            };
            self.run(req, &|ctx, algo, _| plan(ctx, algo, &blocks, root))
        })
    }
}
