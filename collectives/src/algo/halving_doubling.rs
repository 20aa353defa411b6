//! Rabenseifner's allreduce (recursive halving reduce-scatter, then recursive doubling
//! allgather) and the recursive-halving reduce-scatter.
//!
//! Halving: in round `k` rank `r` keeps half of its current window of blocks and sends the other
//! half to `r xor d` (`d = p/2, p/4, …, 1`), reducing what it receives into the half it keeps;
//! after `log2(p)` rounds it owns one block reduced over all ranks. Doubling gathers the blocks
//! back. `2(p-1)/p·S` bytes sent per rank (like the ring) in `2·log2(p)` steps (unlike the ring's
//! `2(p-1)`): the medium-size algorithm. Non-power-of-two worlds fold first (see
//! [`super::recursive_doubling::Fold`]).

use super::recursive_doubling::{range, Fold};
use super::PlanCtx;
use crate::plan::{split, Buf, Plan, Region};

/// Halving reduce-scatter rounds on `work` (a buffer in the blocks' layout), among the `fp`
/// main-phase ranks; `first_src` is read in the first round instead of `work`. Leaves block `nr`
/// reduced in `work`. Returns the next tag.
#[allow(clippy::too_many_arguments)]
fn halving(
    p: &mut Plan,
    fold: &Fold,
    nr: usize,
    blocks: &[(usize, usize)],
    work: Buf,
    first_src: Buf,
    tmp: Buf,
    mut tag: u32,
) -> u32 {
    let (mut lo, mut hi) = (0, fold.p);
    let mut d = fold.p / 2;
    let mut src = first_src;
    let at = |buf: Buf, r: Region| Region::new(buf, r.off, r.len);
    while d >= 1 {
        let partner = fold.real_rank(nr ^ d);
        let mid = lo + d;
        let (keep, give) =
            if nr & d == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
        let keep_r = range(blocks, keep.0, keep.1);
        let give_r = range(blocks, give.0, give.1);
        let t = Region::new(tmp, 0, keep_r.len);
        let hr = p.recv(partner, tag, t);
        let hs = p.send(partner, tag, at(src, give_r));
        p.wait(hr);
        p.wait(hs);
        p.reduce(at(work, keep_r), at(src, keep_r), t);
        src = work;
        lo = keep.0;
        hi = keep.1;
        d /= 2;
        tag += 1;
    }
    tag
}

/// Rabenseifner allreduce of `count` elements.
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
    let fold = Fold::new(sh.n);
    let tmp = p.scratch(len);
    fold.fold_in(&mut p, sh.rank, data, tmp, 0);
    if let Some(nr) = fold.new_rank(sh.rank) {
        let blocks = split(count, fold.p, sh.esize);
        let mut tag = halving(&mut p, &fold, nr, &blocks, Buf::Data, Buf::Data, tmp, 1);
        let mut d = 1;
        while d < fold.p {
            let w = nr & !(d - 1);
            let pw = w ^ d;
            let partner = fold.real_rank(nr ^ d);
            let hr = p.recv(partner, tag, range(&blocks, pw, pw + d));
            let hs = p.send(partner, tag, range(&blocks, w, w + d));
            p.wait(hr);
            p.wait(hs);
            d <<= 1;
            tag += 1;
        }
    }
    fold.fold_out(&mut p, sh.rank, data, 1000);
    p
}

/// Recursive-halving reduce-scatter (power-of-two worlds) with per-rank blocks in the input
/// layout: `(n-1)/n·S` bytes per rank in `log2(n)` steps. Out of place the result lands at
/// offset 0 of the data buffer; in place at its own offset.
///
/// # Panics
/// If `n` is not a power of two.
pub fn reduce_scatter(sh: &PlanCtx, blocks: &[(usize, usize)]) -> Plan {
    assert!(sh.n.is_power_of_two(), "recursive halving needs a power-of-two world");
    let mut p = Plan::new();
    let r = sh.rank;
    let (off, len) = blocks[r];
    let total: usize = blocks.iter().map(|b| b.1).sum();
    if sh.n == 1 {
        if !sh.in_place {
            p.copy(Region::new(Buf::Data, 0, len), Region::new(Buf::Input, off, len));
        }
        return p;
    }
    let fold = Fold::new(sh.n);
    let max_half = total;
    let tmp = p.scratch(max_half);
    let work = if sh.in_place { Buf::Data } else { p.scratch(total) };
    halving(&mut p, &fold, r, blocks, work, sh.src(), tmp, 0);
    if !sh.in_place {
        p.copy(Region::new(Buf::Data, 0, len), Region::new(work, off, len));
    }
    p
}
