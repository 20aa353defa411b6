//! Reduce: the root receives the elementwise reduction of every rank's buffer.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element, ReduceOp};
use crate::error::Result;
use crate::plan::Plan;
use crate::select::Algo;

use super::Coll;

impl Comm {
    /// Reduce every rank's `buf` into the root's `buf`. On other ranks `buf` is used as scratch
    /// and holds partial results afterwards.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `op`, `root` and buffer length.
    ///
    /// # Errors
    /// As [`Comm::broadcast`].
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<Stats> {
        self.call(Coll::Reduce.name(), || self.reduce_impl(None, buf, op, root))
    }

    /// Reduce out of place: the root's `output` receives the reduction of every `input`; other
    /// ranks' `output` is scratch. `input` is never written.
    ///
    /// # Collective contract
    /// As [`Comm::reduce`]; `input` and `output` have the same length on every rank.
    ///
    /// # Errors
    /// As [`Comm::reduce`].
    pub fn reduce_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Stats> {
        self.call(Coll::Reduce.name(), || {
            if input.len() != output.len() {
                return Err(self.invalid(
                    "reduce",
                    format!("input has {} elements, output {}", input.len(), output.len()),
                ));
            }
            self.reduce_impl(Some(input), output, op, root)
        })
    }

    fn reduce_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Stats> {
        self.check_root(Coll::Reduce.name(), root)?;
        let len = size_of_val(out);
        let req = Req {
            coll: Coll::Reduce,
            dtype: T::DTYPE,
            redop: Some(op),
            root: Some(root),
            count: out.len(),
            bytes: len,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
            finish: None,
        };
        let st = self.run(req, &|ctx, algo, _| plan(ctx, algo, len, root))?;
        if self.rank() == root {
            self.finish_avg(op, out);
        }
        Ok(st)
    }
}

/// The algorithms that implement reduce.
pub(crate) const ALGOS: &[Algo] = &[Algo::Tree];

/// The schedule `algo` runs for a reduce of `len` bytes to `root`.
pub(crate) fn plan(ctx: &PlanCtx, algo: Algo, len: usize, root: usize) -> Result<Plan> {
    Ok(match algo {
        Algo::Tree => algo::tree::reduce(ctx, len, root),
        Algo::Ring
        | Algo::RecursiveDoubling
        | Algo::Rabenseifner
        | Algo::RecursiveHalving
        | Algo::Chain
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::Dissemination
        | Algo::TwoLevel
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Reduce, algo)),
    })
}
