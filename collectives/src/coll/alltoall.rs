//! All-to-all(v): block `j` of every rank's input goes to rank `j`.

use crate::algo::{self, PlanCtx};
use crate::comm::{Comm, Req, Stats};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::plan::{blocks_from_counts, Buf, Plan, Region};
use crate::select::Algo;

use super::Coll;

impl Comm {
    /// All-to-all: block `j` of `input` (length `size() * c`) goes to rank `j`; block `i` of
    /// `output` comes from rank `i`.
    ///
    /// # Collective contract
    /// Every rank calls it with buffers of the same length, divisible by the group size.
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for wrong lengths.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<Stats> {
        self.call(Coll::AllToAll.name(), || {
            let n = self.size();
            if input.len() != output.len() || !input.len().is_multiple_of(n) {
                return Err(self.invalid(
                    Coll::AllToAll.name(),
                    format!(
                        "input {} and output {} elements must be equal and divide by {n}",
                        input.len(),
                        output.len()
                    ),
                ));
            }
            let c = input.len() / n;
            super::with_equal_counts(c, n, |counts| {
                self.all_to_all_impl(Some(input), output, counts, counts, true)
            })
        })
    }

    /// All-to-all in place (through a scratch copy of `buf`).
    ///
    /// # Collective contract
    /// As [`Comm::all_to_all`].
    ///
    /// # Errors
    /// As [`Comm::all_to_all`].
    pub fn all_to_all_inplace<T: Element>(&self, buf: &mut [T]) -> Result<Stats> {
        self.call(Coll::AllToAll.name(), || {
            let n = self.size();
            if !buf.len().is_multiple_of(n) {
                return Err(self.invalid(
                    Coll::AllToAll.name(),
                    format!("{} elements do not divide by {n} ranks", buf.len()),
                ));
            }
            super::with_equal_counts(buf.len() / n, n, |counts| {
                self.all_to_all_impl(None, buf, counts, counts, true)
            })
        })
    }

    /// All-to-all with per-peer counts: `send_counts[j]` elements of `input` go to rank `j`
    /// (blocks in rank order), `recv_counts[i]` elements of `output` come from rank `i`.
    ///
    /// # Collective contract
    /// `send_counts[j]` on rank `i` equals `recv_counts[i]` on rank `j`.
    ///
    /// # Errors
    /// As [`Comm::all_to_all`]; a count disagreement between ranks is reported as a mismatch.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<Stats> {
        self.call(Coll::AllToAll.name(), || {
            self.check_counts(Coll::AllToAll.name(), send_counts, input.len())?;
            self.check_counts(Coll::AllToAll.name(), recv_counts, output.len())?;
            self.all_to_all_impl(Some(input), output, send_counts, recv_counts, false)
        })
    }

    fn all_to_all_impl<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        sc: &[usize],
        rc: &[usize],
        uniform: bool,
    ) -> Result<Stats> {
        let es = size_of::<T>();
        let total = out.len();
        let total_bytes = size_of_val(out);
        let req = Req {
            coll: Coll::AllToAll,
            dtype: T::DTYPE,
            redop: None,
            root: None,
            // Per-peer counts legitimately differ in the v variant; only uniform calls carry a
            // count in the fingerprint (lengths are still checked on arrival).
            count: if uniform { total } else { 0 },
            bytes: total_bytes,
            uniform,
            data: as_bytes_mut(out),
            input: input.map(as_bytes),
            finish: None,
        };
        let _in_place = input.is_none();
        self.run(req, &|ctx, algo, _| {
            let (send, recv) = (blocks_from_counts(sc, es), blocks_from_counts(rc, es));
            plan(ctx, algo, &send, &recv, total_bytes)
        })
    }
}

/// The algorithms that implement all-to-all.
pub(crate) const ALGOS: &[Algo] = &[Algo::Pairwise, Algo::PostAll, Algo::Bruck, Algo::Direct];

/// The schedule `algo` runs for an all-to-all of `send` and `recv` blocks (byte offset and
/// length per peer); in place, the data is first copied to a scratch buffer of `total` bytes.
pub(crate) fn plan(
    ctx: &PlanCtx,
    algo: Algo,
    send: &[(usize, usize)],
    recv: &[(usize, usize)],
    total: usize,
) -> Result<Plan> {
    let mut p = Plan::new();
    // In place, the blocks for the peers are saved to scratch before any arrives over them.
    // Pairwise and post-all leave the own block where it is (in place it is already at its
    // offset: in-place calls have equal blocks), so it is neither saved nor copied back.
    let own = (algo != Algo::Bruck).then(|| send.get(ctx.rank).copied()).flatten();
    let src = if ctx.in_place {
        let s = p.scratch(total);
        match own {
            Some((o, l)) => {
                p.copy(Region::new(s, 0, o), Region::new(Buf::Data, 0, o));
                p.copy(
                    Region::new(s, o + l, total - o - l),
                    Region::new(Buf::Data, o + l, total - o - l),
                );
            }
            None => p.copy(Region::new(s, 0, total), Region::new(Buf::Data, 0, total)),
        }
        s
    } else {
        Buf::Input
    };
    match algo {
        Algo::Pairwise => algo::alltoall::pairwise(&mut p, ctx, src, send, recv),
        Algo::PostAll => algo::alltoall::post_all(&mut p, ctx, src, send, recv),
        Algo::Bruck => algo::alltoall::bruck(&mut p, ctx, src, send, recv),
        Algo::Ring
        | Algo::RecursiveDoubling
        | Algo::Rabenseifner
        | Algo::RecursiveHalving
        | Algo::Tree
        | Algo::Chain
        | Algo::Linear
        | Algo::Dissemination
        | Algo::TwoLevel
        | Algo::ScatterAllgather
        | Algo::Direct => return Err(super::refuse(ctx, Coll::AllToAll, algo)),
    }
    Ok(p)
}
