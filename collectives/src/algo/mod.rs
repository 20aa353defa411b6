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
pub mod scatter_allgather;
pub mod tree;
pub mod two_level;

use crate::plan::{Plan, Region};
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

/// Exchanges whose larger side is at least this long interleave a local copy with the send
/// ([`exchange_interleaved`]); below it the copy's bytes stay in cache anyway.
pub const INTERLEAVE_MIN: usize = 4 << 20;
/// The pieces of an interleaved exchange: small enough that what the kernel has just read for
/// the send is still in the core's cache when the copy runs.
pub const INTERLEAVE_PIECE: usize = 1 << 20;

/// The tags an [`exchange_interleaved`] of messages of at most `len` bytes uses, at least one:
/// callers that run several in turn start each at a multiple of it, so every rank's tags agree
/// whatever the lengths of its own messages.
pub fn exchange_tags(len: usize, esize: usize) -> u32 {
    if len >= INTERLEAVE_MIN {
        crate::plan::segments(len, INTERLEAVE_PIECE, esize).len().max(1) as u32
    } else {
        1
    }
}

/// One exchange — `send = (to, region)` goes out, `recv = (from, region)` comes in — with a local
/// copy `copy = (dst, src)` done along the way instead of before or after it. A message of at
/// least [`INTERLEAVE_MIN`] goes in pieces of [`INTERLEAVE_PIECE`] (tags `tag0..`), a shorter one
/// whole under `tag0`, so the peer at the other end may build its side with this or with a plain
/// send or receive under `tag0` when the message is short. The copy advances in step with the
/// send: after each piece has been taken by the transport, the copy catches up to the same
/// fraction. Done whole, before the exchange, the copy keeps the sockets idle while it runs
/// and, where it reads the bytes being sent (an out-of-place all-gather's own block), reads the
/// whole block from memory a second time. Returns the first tag after the ones used.
pub fn exchange_interleaved(
    p: &mut Plan,
    sh: &PlanCtx,
    send: (usize, Region),
    recv: (usize, Region),
    copy: (Region, Region),
    tag0: u32,
) -> u32 {
    // A message is cut by its own length alone, which both of its ends know: whole below
    // INTERLEAVE_MIN (one message under `tag0`, as a plain exchange sends it), in pieces above.
    let cut = |r: &Region| {
        if r.len >= INTERLEAVE_MIN {
            crate::plan::segments(r.len, INTERLEAVE_PIECE, sh.esize)
        } else {
            crate::plan::segments(r.len, r.len.max(1), 1)
        }
    };
    let (sp, rp) = (cut(&send.1), cut(&recv.1));
    for (k, &(o, l)) in rp.iter().enumerate() {
        p.recv(recv.0, tag0 + k as u32, recv.1.sub(o, l));
    }
    let (dst, src) = copy;
    let mut copied = 0;
    let mut copy_to = |p: &mut Plan, upto: usize| {
        let upto = upto.min(src.len) / sh.esize * sh.esize;
        if upto > copied {
            p.copy_out(dst.sub(copied, upto - copied), src.sub(copied, upto - copied), src.len);
            copied = upto;
        }
    };
    let mut prev: Option<(Option<usize>, usize)> = None;
    for (k, &(o, l)) in sp.iter().enumerate() {
        let h = p.send(send.0, tag0 + k as u32, send.1.sub(o, l));
        if let Some((hp, done)) = prev.replace((h, o + l)) {
            p.wait(hp);
            copy_to(p, (src.len as u128 * done as u128 / send.1.len as u128) as usize);
        }
    }
    if let Some((hp, _)) = prev {
        p.wait(hp);
    }
    copy_to(p, src.len);
    p.wait_all();
    tag0 + sp.len().max(rp.len()) as u32
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
    use crate::plan::{simulate, Buf, Step};

    /// Where the copies sit among the sends: for each copy, how many sends precede it.
    fn copies_after_sends(p: &Plan) -> Vec<usize> {
        let mut sends = 0;
        let mut at = Vec::new();
        for s in &p.steps {
            match s {
                Step::Send { .. } => sends += 1,
                Step::Copy { .. } => at.push(sends),
                _ => {}
            }
        }
        at
    }

    /// Whether each copy of `p` streams (writes around the caches).
    fn streams(p: &Plan) -> Vec<bool> {
        p.steps
            .iter()
            .filter_map(|s| match s {
                Step::Copy { stream, .. } => Some(*stream),
                _ => None,
            })
            .collect()
    }

    /// Both ranks' plans of a 2-rank call, out of place, 1-byte elements.
    fn two_rank_plans(build: impl Fn(&PlanCtx) -> Plan) -> Vec<Plan> {
        (0..2)
            .map(|rank| build(&PlanCtx { rank, n: 2, esize: 1, seg: 1 << 20, in_place: false }))
            .collect()
    }

    /// Both ranks' 2-rank pairwise all-to-all plans, from each rank's (send, recv) blocks.
    fn pairwise_plans(
        blocks: impl Fn(usize) -> ([(usize, usize); 2], [(usize, usize); 2]),
    ) -> Vec<Plan> {
        two_rank_plans(|sh| {
            let (send, recv) = blocks(sh.rank);
            let mut p = Plan::new();
            alltoall::pairwise(&mut p, sh, Buf::Input, &send, &recv);
            p
        })
    }

    #[test]
    fn copies_stream_from_their_thresholds() {
        use crate::plan::{STREAM_MIN, STREAM_OUT_MIN};
        let at = |len| (Region::new(Buf::Data, 0, len), Region::new(Buf::Input, 0, len));
        let mut p = Plan::new();
        for len in [STREAM_MIN - 1, STREAM_MIN] {
            let (d, s) = at(len);
            p.copy(d, s);
        }
        // A piece of a final place streams by the size of the whole place.
        let (d, s) = at(1 << 20);
        p.copy_out(d, s, STREAM_OUT_MIN - 1);
        p.copy_out(d, s, STREAM_OUT_MIN);
        assert_eq!(streams(&p), vec![false, true, false, true]);
    }

    #[test]
    fn interleaved_exchanges_copy_between_the_pieces_and_match_up() {
        let big = 4 * INTERLEAVE_PIECE + 3;
        // Out-of-place all-gather, 2 ranks: 5 pieces each way, the copy in 5 steps that trail
        // the sends (after sends 2, 3, 4, 5 and the last wait).
        let plans = two_rank_plans(|sh| recursive_doubling::allgather(sh, &[(0, big), (big, big)]));
        let sim = simulate(&plans).unwrap();
        assert_eq!(sim.messages, vec![5, 5]);
        assert_eq!(copies_after_sends(&plans[0]), vec![2, 3, 4, 5, 5]);
        // The own block's final place is 4 MiB and more: its pieces stream.
        assert_eq!(streams(&plans[0]), vec![true; 5]);
        // Below the threshold: one whole exchange, the copy once its send was taken.
        let small =
            two_rank_plans(|sh| recursive_doubling::allgather(sh, &[(0, 1000), (1000, 1000)]));
        assert_eq!(simulate(&small).unwrap().messages, vec![1, 1]);
        assert_eq!(copies_after_sends(&small[0]), vec![1]);
        assert_eq!(streams(&small[0]), vec![false]);
        // 2-rank all-to-all with unequal blocks: 7 pieces one way, 1 the other; the tags agree.
        let (a, b) = (6 * INTERLEAVE_PIECE + 1, 3);
        // Rank 0 sends `a` to rank 1 and keeps `b`; rank 1 sends `b` and keeps `a` (blocks in
        // rank order).
        let plans = pairwise_plans(|rank| {
            if rank == 0 {
                ([(0, b), (b, a)], [(0, b), (b, b)])
            } else {
                ([(0, b), (b, a)], [(0, a), (a, a)])
            }
        });
        let sim = simulate(&plans).unwrap();
        assert_eq!(sim.messages, vec![7, 1]);
        // Rank 1 copies its large own block in one go after its single send; rank 0 copies its
        // 3-byte own block a byte at a time, as its 7 pieces pass a half, five sixths and the end.
        assert_eq!(copies_after_sends(&plans[1]), vec![1]);
        assert_eq!(copies_after_sends(&plans[0]), vec![4, 6, 7]);
        // A large own block on one rank only, 2 MiB each way: whole messages on both sides,
        // which only the length of each message decides.
        let (own, x) = (5 * INTERLEAVE_PIECE, 2 * INTERLEAVE_PIECE);
        let plans = pairwise_plans(|rank| {
            if rank == 0 {
                ([(0, own), (own, x)], [(0, own), (own, x)])
            } else {
                ([(0, x), (x, 10)], [(0, x), (x, 10)])
            }
        });
        assert_eq!(simulate(&plans).unwrap().messages, vec![1, 1]);
    }

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
