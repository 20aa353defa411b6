//! The algorithms, one file each. Every function here is pure: it returns the [`Plan`] one rank
//! runs; `docs/algorithms.md` describes each with its cost.
//!
//! [`Plan`]: crate::plan::Plan

pub mod alltoall;
pub mod barrier;
pub mod bruck;
pub mod chain;
pub mod halving_doubling;
pub mod linear;
pub mod recursive_doubling;
pub mod ring;
pub mod tree;
pub mod two_level;

use crate::plan::Plan;
use crate::topo::Topology;

/// A ring algorithm's plan on `topo`'s ring order (host by host): `build` gets this rank's
/// position in that order as its rank, the blocks in that order, and the order itself
/// (position → rank; `None` for rank order); the peers of the plan it returns are mapped back to
/// group ranks. When ranks are already placed host by host this is `build(sh, blocks, None)`.
/// `blocks` may be empty (allreduce splits by position itself).
pub fn on_ring(
    sh: &PlanCtx,
    topo: &Topology,
    blocks: &[(usize, usize)],
    build: impl FnOnce(&PlanCtx, &[(usize, usize)], Option<&[usize]>) -> Plan,
) -> Plan {
    if topo.size() != sh.n || topo.ring_is_identity() {
        return build(sh, blocks, None);
    }
    let order = topo.ring();
    let pos = order.iter().position(|r| *r == sh.rank).unwrap_or(sh.rank);
    let ordered: Vec<(usize, usize)> =
        if blocks.is_empty() { Vec::new() } else { order.iter().map(|r| blocks[*r]).collect() };
    build(&PlanCtx { rank: pos, ..*sh }, &ordered, Some(&order)).relabel(&order)
}

/// Receives kept posted ahead of the one being processed in pipelined algorithms.
pub const LOOKAHEAD: usize = 4;

/// The context a plan is built for: who runs it (rank, group size), the element size, the
/// pipeline segment and whether the call is in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanCtx {
    /// Group rank.
    pub rank: usize,
    /// Group size.
    pub n: usize,
    /// Element size in bytes.
    pub esize: usize,
    /// Pipeline segment size in bytes.
    pub seg: usize,
    /// True when the call is in place (no separate input buffer).
    pub in_place: bool,
}

impl PlanCtx {
    /// The buffer the local contribution is read from.
    pub fn src(&self) -> crate::plan::Buf {
        if self.in_place {
            crate::plan::Buf::Data
        } else {
            crate::plan::Buf::Input
        }
    }

    /// Rank at distance `d` to the right in the ring.
    pub fn right(&self, d: usize) -> usize {
        (self.rank + d) % self.n
    }

    /// Rank at distance `d` to the left in the ring.
    pub fn left(&self, d: usize) -> usize {
        (self.rank + self.n - d % self.n) % self.n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_neighbours_at_every_distance() {
        for n in 1..=9 {
            for rank in 0..n {
                let sh = PlanCtx { rank, n, esize: 4, seg: 64, in_place: true };
                for d in 0..3 * n {
                    // Written out: walking d steps right then d steps left comes home.
                    let right = (rank + d) % n;
                    let left = ((rank as isize - d as isize).rem_euclid(n as isize)) as usize;
                    assert_eq!((sh.right(d), sh.left(d)), (right, left), "n={n} r={rank} d={d}");
                }
            }
        }
    }
}
