//! Recursive doubling: `log2(p)` rounds in which rank `r` exchanges with `r xor 2^k`.
//!
//! Allreduce: each round exchanges the whole buffer and reduces it, `log2(p)·S` bytes sent per
//! rank in `log2(p)` steps: the small-message algorithm. Worlds that are not a power of two fold
//! first: of the first `2·rem` ranks (`rem = n - p`), each even rank hands its data to the odd rank
//! above it and sits out, and receives the result at the end (two extra steps).
//! Operands are combined as `mine op theirs` on both sides; IEEE addition and multiplication
//! are commutative, so both ranks of a pair hold identical bits.
//! Allgather: each round exchanges the window gathered so far (power-of-two worlds).

use super::PlanCtx;
use crate::plan::{pow2_floor, Buf, Plan, Region};

/// The folding of a non-power-of-two world onto `p = pow2_floor(n)` ranks.
#[derive(Debug, Clone, Copy)]
pub struct Fold {
    /// Power of two taking part in the main phase.
    pub p: usize,
    /// Ranks folded away.
    pub rem: usize,
}

impl Fold {
    /// The fold for `n` ranks.
    pub fn new(n: usize) -> Fold {
        let p = pow2_floor(n);
        Fold { p, rem: n - p }
    }

    /// This rank's index in the main phase, `None` when it sits out.
    pub fn new_rank(&self, r: usize) -> Option<usize> {
        if r < 2 * self.rem {
            (r % 2 == 1).then_some(r / 2)
        } else {
            Some(r - self.rem)
        }
    }

    /// Group rank of main-phase rank `nr`.
    pub fn real_rank(&self, nr: usize) -> usize {
        if nr < self.rem {
            nr * 2 + 1
        } else {
            nr + self.rem
        }
    }

    /// Append the fold-in step on `data` (the whole buffer); `tmp` receives the partner's data.
    pub fn fold_in(&self, p: &mut Plan, r: usize, data: Region, tmp: Buf, tag: u32) {
        if r >= 2 * self.rem {
            return;
        }
        if r.is_multiple_of(2) {
            let h = p.send(r + 1, tag, data);
            p.wait(h);
        } else {
            let t = Region::new(tmp, 0, data.len);
            let h = p.recv(r - 1, tag, t);
            p.wait(h);
            p.reduce(data, data, t);
        }
    }

    /// Append the fold-out step: odd ranks of the folded pairs return the result.
    pub fn fold_out(&self, p: &mut Plan, r: usize, data: Region, tag: u32) {
        if r >= 2 * self.rem {
            return;
        }
        let h =
            if r.is_multiple_of(2) { p.recv(r + 1, tag, data) } else { p.send(r - 1, tag, data) };
        p.wait(h);
    }
}

/// Recursive-doubling allreduce of `count` elements.
pub fn allreduce(sh: &PlanCtx, count: usize) -> Plan {
    let mut p = Plan::new();
    let len = count * sh.esize;
    let data = Region::new(Buf::Data, 0, len);
    if !sh.in_place {
        p.copy(data, Region::new(Buf::Input, 0, len));
    }
    if sh.n == 1 || len == 0 {
        return p;
    }
    let tmp = p.scratch(len);
    let fold = Fold::new(sh.n);
    fold.fold_in(&mut p, sh.rank, data, tmp, 0);
    if let Some(nr) = fold.new_rank(sh.rank) {
        let mut tag = 1;
        let mut mask = 1;
        while mask < fold.p {
            let partner = fold.real_rank(nr ^ mask);
            let t = Region::new(tmp, 0, len);
            let hr = p.recv(partner, tag, t);
            let hs = p.send(partner, tag, data);
            p.wait(hr);
            p.wait(hs);
            p.reduce(data, data, t);
            mask <<= 1;
            tag += 1;
        }
    }
    fold.fold_out(&mut p, sh.rank, data, 1000);
    p
}

/// Byte region of the block range `[a, b)` in the data buffer.
pub fn range(blocks: &[(usize, usize)], a: usize, b: usize) -> Region {
    if a >= b {
        return Region::new(Buf::Data, 0, 0);
    }
    let start = blocks[a].0;
    let end = blocks[b - 1].0 + blocks[b - 1].1;
    Region::new(Buf::Data, start, end - start)
}

/// Recursive-doubling allgather (power-of-two worlds): `log2(n)` rounds, each exchanging the
/// window gathered so far; `(n-1)/n·S` bytes sent per rank.
///
/// Every round is an [`exchange_interleaved`](super::exchange_interleaved): a window of at least
/// [`INTERLEAVE_MIN`](super::INTERLEAVE_MIN) goes in pieces, so the sockets carry a piece or two
/// at a time instead of a whole window. Out of place, round one also carries the own block's copy
/// into place along with its send. Whether a message is cut depends on its length alone, and
/// round `k` uses tags from `k` times the most any message can take, so ranks that call in place
/// and ranks that do not, and pairs whose windows differ in length (allgatherv), agree on every
/// tag.
///
/// # Panics
/// If `n` is not a power of two (selection never asks for it then).
pub fn allgather(sh: &PlanCtx, blocks: &[(usize, usize)]) -> Plan {
    assert!(sh.n.is_power_of_two(), "recursive-doubling allgather needs a power-of-two world");
    let mut p = Plan::new();
    let r = sh.rank;
    let (off, len) = blocks[r];
    let own = Region::new(Buf::Input, 0, len);
    let place = Region::new(Buf::Data, off, len);
    if sh.n == 1 {
        if !sh.in_place {
            p.copy(place, own);
        }
        return p;
    }
    let total = blocks.iter().map(|b| b.1).sum();
    let stride = super::exchange_tags(total, sh.esize);
    let none = Region::new(Buf::Data, off, 0);
    let mut d = 1;
    while d < sh.n {
        let w = r & !(d - 1);
        let pw = w ^ d;
        let partner = r ^ d;
        // Out of place, round one sends the own block from the input and copies it into place
        // along the way, piece by piece, reading what the send just read.
        let (outgoing, copy) = if d == 1 && !sh.in_place {
            (own, (place, own))
        } else {
            (range(blocks, w, w + d), (none, none))
        };
        let tag = d.trailing_zeros() * stride;
        let incoming = (partner, range(blocks, pw, pw + d));
        super::exchange_interleaved(&mut p, sh, (partner, outgoing), incoming, copy, tag);
        d <<= 1;
    }
    p
}
