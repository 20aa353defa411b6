//! Broadcast: the root's buffer reaches every rank.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::plan::Plan;
use crate::select::Algo;
use crate::topo::Topology;

use super::Coll;

impl Comm {
    /// Broadcast `buf` from `root` to every rank.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `root` and a buffer of the same length.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a root outside the group.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<Stats> {
        self.call(Coll::Broadcast.name(), || self.broadcast_impl(None, buf, root))
    }

    /// Broadcast out of place: the root's `input` lands in every rank's `output` (`input` is
    /// read only at the root).
    ///
    /// # Collective contract
    /// As [`Comm::broadcast`]; at the root `input` and `output` have the same length.
    ///
    /// # Errors
    /// As [`Comm::broadcast`].
    pub fn broadcast_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<Stats> {
        self.call(Coll::Broadcast.name(), || {
            if self.rank() == root && input.len() != output.len() {
                return Err(self.invalid(
                    "broadcast",
                    format!("input has {} elements, output {}", input.len(), output.len()),
                ));
            }
            let input = if self.rank() == root { Some(input) } else { None };
            self.broadcast_impl(input, output, root)
        })
    }

    fn broadcast_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        root: usize,
    ) -> Result<Stats> {
        self.check_root(Coll::Broadcast.name(), root)?;
        let len = size_of_val(out);
        let req = Req {
            coll: Coll::Broadcast,
            dtype: T::DTYPE,
            redop: None,
            root: Some(root),
            count: out.len(),
            bytes: len,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
            finish: None,
        };
        self.run(req, &|ctx, algo, topo| plan(ctx, algo, len, root, topo))
    }
}

/// The algorithms that implement broadcast.
pub(crate) const ALGOS: &[Algo] = &[Algo::Tree, Algo::Chain, Algo::ScatterAllgather, Algo::Direct];

/// The schedule `algo` runs for a broadcast of `len` bytes from `root` on `topo` (the chain
/// follows hosts).
pub(crate) fn plan(
    ctx: &PlanCtx,
    algo: Algo,
    len: usize,
    root: usize,
    topo: &Topology,
) -> Result<Plan> {
    Ok(match algo {
        Algo::Tree => algo::tree::broadcast(ctx, len, root),
        // The chain starts at the root and walks the ring order from there.
        Algo::Chain => algo::on_ring(ctx, topo, &[], |c, _, order| {
            let at = order.and_then(|o| o.iter().position(|r| *r == root)).unwrap_or(root);
            algo::chain::broadcast(c, len, at)
        }),
        // The allgather's ring follows hosts; distances from the root are taken along it.
        Algo::ScatterAllgather => algo::on_ring(ctx, topo, &[], |c, _, order| {
            let at = order.and_then(|o| o.iter().position(|r| *r == root)).unwrap_or(root);
            algo::scatter_allgather::broadcast(c, len, at)
        }),
        Algo::Ring
        | Algo::RecursiveDoubling
        | Algo::Rabenseifner
        | Algo::RecursiveHalving
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::Dissemination
        | Algo::TwoLevel
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Broadcast, algo)),
    })
}
