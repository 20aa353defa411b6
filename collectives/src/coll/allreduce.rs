//! Allreduce: every rank ends with the elementwise reduction of every rank's buffer.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, DType, Element, ReduceOp};
use crate::error::Result;
use crate::kernel::Finish;
use crate::plan::Plan;
use crate::select::Algo;
use crate::topo::Topology;

use super::Coll;

impl Comm {
    fn allreduce_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        op: ReduceOp,
        scale: Option<f64>,
    ) -> Result<Stats> {
        if let Some(input) = input.filter(|i| i.len() != out.len()) {
            return Err(self.invalid(
                "allreduce",
                format!("input has {} elements, output {}", input.len(), out.len()),
            ));
        }
        let Some(per) = self.allreduce_piece(out.len(), size_of::<T>())? else {
            return self.allreduce_whole(input, out, op, scale);
        };
        // Back-to-back allreduces of cache-sized pieces (see `Config::chunk`).
        let start = std::time::Instant::now();
        let mut total: Option<Stats> = None;
        for (k, piece) in out.chunks_mut(per).enumerate() {
            let inp = input.map(|i| &i[k * per..k * per + piece.len()]);
            let st = self.allreduce_whole(inp, piece, op, scale)?;
            total = Some(match total {
                None => st,
                Some(t) => Stats { bytes_sent: t.bytes_sent + st.bytes_sent, ..t },
            });
        }
        let total = total.ok_or_else(|| self.invalid("allreduce", "no piece ran".into()))?;
        Ok(Stats { elapsed: start.elapsed(), ..total })
    }

    /// Elements per piece when an allreduce of `count` elements of `esize` bytes runs in
    /// pieces ([`crate::Config::chunk`]): automatic choice only (no forced algorithm, no
    /// tuning), links as fast as loopback (no cost model), at least two pieces of at least
    /// the chunk and two segments per rank each.
    fn allreduce_piece(&self, count: usize, esize: usize) -> Result<Option<usize>> {
        // The link measurement first (every rank makes this call at the same point): on slow links
        // the whole allreduce is chosen by the cost model, never pieces.
        self.ensure_measured()?;
        Ok(self.sel.allreduce_pieces(count, esize, self.size()))
    }

    fn allreduce_whole<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        op: ReduceOp,
        scale: Option<f64>,
    ) -> Result<Stats> {
        let count = out.len();
        let bytes = size_of_val(out);
        let req = Req {
            coll: Coll::Allreduce,
            dtype: T::DTYPE,
            redop: Some(op),
            root: None,
            count,
            bytes,
            uniform: true,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
            finish: match (op, scale) {
                (_, Some(k)) => Some(Finish::Mul(k)),
                (ReduceOp::Avg, None) => Some(Finish::DivN(self.size())),
                _ => None,
            },
        };
        self.run(req, &|ctx, algo, topo| plan(ctx, algo, count, topo))
    }

    /// Allreduce in place: every rank ends with the elementwise reduction of every rank's `buf`.
    ///
    /// # Collective contract
    /// Every rank of the group calls it with the same `op` and a buffer of the same length.
    ///
    /// # Errors
    /// [`Error::Runtime`](crate::Error::Runtime) for transport failures, timeouts and mismatched calls (the group is
    /// poisoned); [`Error::Unsupported`](crate::Error::Unsupported) for a forced algorithm that does not apply.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<Stats> {
        self.call(Coll::Allreduce.name(), || self.allreduce_impl(None, buf, op, None))
    }

    /// Allreduce out of place: `output` receives the reduction of every rank's `input`.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`]; `input` and `output` have the same length on every rank.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the lengths differ.
    pub fn allreduce_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<Stats> {
        self.call(Coll::Allreduce.name(), || self.allreduce_impl(Some(input), output, op, None))
    }
}

impl Comm {
    /// Scaled allreduce in place: every rank ends with `factor` × the sum of every rank's
    /// `buf` (NCCL's pre-multiplied sum, applied after the sum). The ring multiplies only the
    /// block each rank owns between its two phases, so averaging with weights — a gradient
    /// mean over uneven shards — costs 1/n of a pass instead of a pass over the result.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `factor` (not checked: a rank with another factor
    /// scales its blocks differently) and a buffer of the same length.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an
    /// integer dtype or a factor that is not finite.
    pub fn allreduce_scaled<T: Element>(&self, buf: &mut [T], factor: f64) -> Result<Stats> {
        self.call(Coll::Allreduce.name(), || {
            self.check_scale::<T>(factor)?;
            self.allreduce_impl(None, buf, ReduceOp::Sum, Some(factor))
        })
    }

    /// [`Comm::allreduce_scaled`] out of place: `output` receives `factor` × the sum of every
    /// rank's `input`, which is only read.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce_scaled`]; `input` and `output` have the same length on every rank.
    ///
    /// # Errors
    /// As [`Comm::allreduce_scaled`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// when the lengths differ.
    pub fn allreduce_scaled_from<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        factor: f64,
    ) -> Result<Stats> {
        self.call(Coll::Allreduce.name(), || {
            self.check_scale::<T>(factor)?;
            self.allreduce_impl(Some(input), output, ReduceOp::Sum, Some(factor))
        })
    }

    fn check_scale<T: Element>(&self, factor: f64) -> Result<()> {
        if !matches!(T::DTYPE, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
            return Err(self.invalid(
                "allreduce",
                format!("a scaled allreduce needs a float dtype, not {:?}", T::DTYPE),
            ));
        }
        if !factor.is_finite() {
            return Err(self.invalid("allreduce", format!("the factor {factor} is not finite")));
        }
        Ok(())
    }
}

/// The algorithms that implement allreduce.
pub(crate) const ALGOS: &[Algo] = &[
    Algo::Ring,
    Algo::RecursiveDoubling,
    Algo::Rabenseifner,
    Algo::Tree,
    Algo::TwoLevel,
    Algo::Direct,
];

/// The schedule `algo` runs for an allreduce of `count` elements on `topo` (which ranks share a
/// host: the ring follows hosts; two-level needs the same number ≥ 2 of ranks on ≥ 2 hosts).
pub(crate) fn plan(ctx: &PlanCtx, algo: Algo, count: usize, topo: &Topology) -> Result<Plan> {
    Ok(match algo {
        Algo::Ring => algo::on_ring(ctx, topo, &[], |c, _, _| algo::ring::allreduce(c, count)),
        Algo::TwoLevel => algo::two_level::allreduce(ctx, count, topo)
            .ok_or_else(|| super::no_two_level(ctx, Coll::Allreduce, topo))?,
        Algo::RecursiveDoubling => algo::recursive_doubling::allreduce(ctx, count),
        Algo::Rabenseifner => algo::halving_doubling::allreduce(ctx, count),
        Algo::Tree => algo::tree::allreduce(ctx, count),
        Algo::RecursiveHalving
        | Algo::Chain
        | Algo::Bruck
        | Algo::Pairwise
        | Algo::PostAll
        | Algo::Linear
        | Algo::Dissemination
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::Allreduce, algo)),
    })
}
