//! Bruck allgather: `⌈log2 n⌉` rounds for any world size. Blocks are kept rotated so that
//! position `i` of a scratch buffer holds the block of rank `r+i`; in round `k` rank `r` sends its
//! first `min(2^k, n-2^k)` blocks to `r-2^k` and appends the same number from `r+2^k`. A final
//! copy un-rotates. `(n-1)/n·S` bytes sent per rank; equal blocks only.

use super::PlanCtx;
use crate::plan::{Buf, Plan, Region};

/// Bruck allgather of `blk` bytes per rank.
pub fn allgather(sh: &PlanCtx, blk: usize) -> Plan {
    let mut p = Plan::new();
    let (n, r) = (sh.n, sh.rank);
    let own = if sh.in_place {
        Region::new(Buf::Data, r * blk, blk)
    } else {
        Region::new(Buf::Input, 0, blk)
    };
    if n == 1 {
        p.copy(Region::new(Buf::Data, 0, blk), own);
        return p;
    }
    let tmp = p.scratch(n * blk);
    p.copy(Region::new(tmp, 0, blk), own);
    let mut pof2 = 1;
    let mut tag = 0;
    while pof2 < n {
        let cnt = pof2.min(n - pof2);
        let to = (r + n - pof2) % n;
        let from = (r + pof2) % n;
        let hr = p.recv(from, tag, Region::new(tmp, pof2 * blk, cnt * blk));
        let hs = p.send(to, tag, Region::new(tmp, 0, cnt * blk));
        p.wait(hr);
        p.wait(hs);
        pof2 <<= 1;
        tag += 1;
    }
    // tmp[i] is rank (r+i)'s block.
    p.copy(Region::new(Buf::Data, r * blk, (n - r) * blk), Region::new(tmp, 0, (n - r) * blk));
    p.copy(Region::new(Buf::Data, 0, r * blk), Region::new(tmp, (n - r) * blk, r * blk));
    p
}
