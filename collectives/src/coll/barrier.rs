//! Barrier: no rank leaves before every rank has entered.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::Plan;
use crate::select::Algo;

use super::Coll;

impl Comm {
    /// Block until every rank of the group has entered the barrier.
    ///
    /// # Collective contract
    /// Every rank calls it.
    ///
    /// # Errors
    /// As [`Comm::allreduce`].
    pub fn barrier(&self) -> Result<Stats> {
        self.call(Coll::Barrier.name(), || {
            let mut none: [u8; 0] = [];
            let req = Req {
                coll: Coll::Barrier,
                dtype: DType::U8,
                redop: None,
                root: None,
                count: 0,
                bytes: 0,
                uniform: true,
                data: &mut none,
                input: None,
                finish: None,
            };
            self.run(req, &|ctx, algo, _| plan(ctx, algo))
        })
    }
}

/// The algorithms that implement the barrier.
pub(crate) const ALGOS: &[Algo] = &[Algo::Dissemination];

/// The schedule `algo` runs for a barrier.
pub(crate) fn plan(ctx: &PlanCtx, algo: Algo) -> Result<Plan> {
    Ok(match algo {
        Algo::Dissemination => algo::barrier::dissemination(ctx),
        Algo::Ring
        | Algo::RecursiveDoubling
        | Algo::Rabenseifner
        | Algo::RecursiveHalving
        | Algo::Tree
        | Algo::Chain
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::TwoLevel
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Barrier, algo)),
    })
}
