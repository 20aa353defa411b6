//! Ring algorithms: segmented, pipelined reduce-scatter and allgather, and allreduce as the two
//! in sequence.
//!
//! Reduce-scatter: in step `s` (of `n-1`) rank `r` sends block `r-s-1` to `r+1` and receives
//! block `r-s-2` from `r-1`, reducing it into its accumulator; after `n-1` steps it holds block
//! `r` reduced over all ranks. Allgather: in step `s` rank `r` forwards block `r-s` and receives
//! block `r-s-1`. Each block moves in segments; a segment is forwarded as soon as it is reduced
//! (or received), and [`LOOKAHEAD`] receives stay posted, so transfer and reduction overlap.
//! Blocks may differ in size (the `v` variants); evenly split blocks give the first
//! `count mod n` blocks one element more. Out of place, the first reduction reads the input
//! buffer directly (`dst = input op received`), so no copy of the input is made, and an
//! out-of-place reduce-scatter accumulates in two scratch buffers used alternately and writes
//! only the own block into the output. Every element is reduced in one fixed order (along the
//! ring) and then copied, so every rank ends with the same bits, floating point included.

use super::{PlanCtx, LOOKAHEAD};
use crate::plan::{segments, Buf, Plan, Region};

/// Where reduce-scatter results accumulate.
#[derive(Debug, Clone, Copy)]
pub enum Acc {
    /// In the data buffer at the blocks' own offsets (allreduce; in-place reduce-scatter).
    InPlace,
    /// Only the own block matters and lands at offset 0 of the data buffer; intermediate sums
    /// live in two scratch buffers (out-of-place reduce-scatter).
    Own,
}

/// Append a ring reduce-scatter over `blocks` (byte offset and length per rank, in the source
/// layout) to `p`. Tags start at `tag0`; returns the first unused tag. With `finish`, each
/// segment of the own block gets the call's finishing transform right after its last
/// reduction, while it is still in cache (instead of a pass over the whole block afterwards),
/// and the plan counts as finishing the result itself even where the own block is empty.
pub fn reduce_scatter_phase(
    p: &mut Plan,
    sh: &PlanCtx,
    blocks: &[(usize, usize)],
    acc: Acc,
    finish: bool,
    tag0: u32,
) -> u32 {
    let n = sh.n;
    if n == 1 {
        return tag0;
    }
    p.finishes |= finish;
    let (r, right, left) = (sh.rank, sh.right(1), sh.left(1));
    let sb = |s: usize| (r + 2 * n - s - 1) % n;
    let rb = |s: usize| (r + 2 * n - s - 2) % n;
    let segs: Vec<Vec<(usize, usize)>> =
        blocks.iter().map(|b| segments(b.1, sh.seg, sh.esize)).collect();
    let stride = segs.iter().map(Vec::len).max().unwrap_or(0).max(1) as u32;
    let max_block = blocks.iter().map(|b| b.1).max().unwrap_or(0);
    let slot_len = max_block.min((sh.seg / sh.esize).max(1) * sh.esize);
    let slots: Vec<Buf> = (0..LOOKAHEAD).map(|_| p.scratch(slot_len)).collect();
    let accs: Vec<Buf> = match acc {
        Acc::InPlace => Vec::new(),
        Acc::Own => (0..2).map(|_| p.scratch(max_block)).collect(),
    };
    let src = sh.src();
    let tag = |s: usize, k: usize| tag0 + s as u32 * stride + k as u32;
    // Where the result of step `s` for block `b`, segment (off, len) lives.
    let acc_region = |s: usize, b: usize, off: usize, len: usize| -> Region {
        match acc {
            Acc::InPlace => Region::new(Buf::Data, blocks[b].0 + off, len),
            Acc::Own if s == n - 2 => Region::new(Buf::Data, off, len),
            Acc::Own => Region::new(accs[s % 2], off, len),
        }
    };
    let units: Vec<(usize, usize)> =
        (0..n - 1).flat_map(|s| (0..segs[rb(s)].len()).map(move |k| (s, k))).collect();
    let mut recv_h = vec![None; units.len()];
    // For `Acc::Own`: the last send that read segment k of accumulator j, to wait for before
    // the accumulator is overwritten.
    let max_segs = segs.iter().map(Vec::len).max().unwrap_or(0);
    let mut readers: [Vec<Option<usize>>; 2] = [vec![None; max_segs], vec![None; max_segs]];
    for (i, &(s, k)) in units.iter().take(LOOKAHEAD).enumerate() {
        let len = segs[rb(s)][k].1;
        recv_h[i] = p.recv(left, tag(s, k), Region::new(slots[i % LOOKAHEAD], 0, len));
    }
    for (k, &(off, len)) in segs[sb(0)].iter().enumerate() {
        p.send(right, tag(0, k), Region::new(src, blocks[sb(0)].0 + off, len));
    }
    for (i, &(s, k)) in units.iter().enumerate() {
        let b = rb(s);
        let (off, len) = segs[b][k];
        p.wait(recv_h[i]);
        if matches!(acc, Acc::Own) && s < n - 2 {
            // A send of an earlier step may still read this accumulator segment.
            p.wait(readers[s % 2][k].take());
        }
        let dst = acc_region(s, b, off, len);
        let a = Region::new(src, blocks[b].0 + off, len);
        p.reduce(dst, a, Region::new(slots[i % LOOKAHEAD], 0, len));
        if finish && s == n - 2 {
            // The own block's segment is complete (`rb(n - 2)` is this rank's block).
            p.finish(dst);
        }
        if let Some(&(s2, k2)) = units.get(i + LOOKAHEAD) {
            let len2 = segs[rb(s2)][k2].1;
            recv_h[i + LOOKAHEAD] =
                p.recv(left, tag(s2, k2), Region::new(slots[i % LOOKAHEAD], 0, len2));
        }
        if s + 1 < n - 1 {
            let h = p.send(right, tag(s + 1, k), dst);
            if matches!(acc, Acc::Own) {
                readers[s % 2][k] = h;
            }
        }
    }
    tag0 + (n as u32 - 1) * stride
}

/// Append a ring allgather over `blocks` of the data buffer. Rank `r`'s own block is read from
/// `own` (its place in the data buffer, or the input buffer). `copy`, if any, runs once the
/// first receives and sends are posted, so that it overlaps their transfer (the out-of-place
/// copy of the own block into place). Returns the first unused tag.
pub fn allgather_phase(
    p: &mut Plan,
    sh: &PlanCtx,
    blocks: &[(usize, usize)],
    own: Region,
    copy: Option<(Region, Region)>,
    tag0: u32,
) -> u32 {
    let n = sh.n;
    if n == 1 {
        if let Some((dst, src)) = copy {
            p.copy_out(dst, src, dst.len);
        }
        return tag0;
    }
    let (r, right, left) = (sh.rank, sh.right(1), sh.left(1));
    let sb = |s: usize| (r + n - s % n) % n;
    let rb = |s: usize| (r + 2 * n - s - 1) % n;
    let segs: Vec<Vec<(usize, usize)>> =
        blocks.iter().map(|b| segments(b.1, sh.seg, sh.esize)).collect();
    let stride = segs.iter().map(Vec::len).max().unwrap_or(0).max(1) as u32;
    let tag = |s: usize, k: usize| tag0 + s as u32 * stride + k as u32;
    let at = |b: usize, off: usize, len: usize| Region::new(Buf::Data, blocks[b].0 + off, len);
    let units: Vec<(usize, usize)> =
        (0..n - 1).flat_map(|s| (0..segs[rb(s)].len()).map(move |k| (s, k))).collect();
    let depth = 2 * LOOKAHEAD;
    let mut recv_h = vec![None; units.len()];
    for (i, &(s, k)) in units.iter().take(depth).enumerate() {
        let (off, len) = segs[rb(s)][k];
        recv_h[i] = p.recv(left, tag(s, k), at(rb(s), off, len));
    }
    for (k, &(off, len)) in segs[sb(0)].iter().enumerate() {
        p.send(right, tag(0, k), own.sub(off, len));
    }
    if let Some((dst, src)) = copy {
        p.copy_out(dst, src, dst.len);
    }
    for (i, &(s, k)) in units.iter().enumerate() {
        let (off, len) = segs[rb(s)][k];
        p.wait(recv_h[i]);
        if let Some(&(s2, k2)) = units.get(i + depth) {
            let (off2, len2) = segs[rb(s2)][k2];
            recv_h[i + depth] = p.recv(left, tag(s2, k2), at(rb(s2), off2, len2));
        }
        if s + 1 < n - 1 {
            p.send(right, tag(s + 1, k), at(rb(s), off, len));
        }
    }
    tag0 + (n as u32 - 1) * stride
}

/// Ring allreduce of `count` elements: reduce-scatter then allgather, `2(n-1)/n·S` bytes sent
/// per rank in `2(n-1)` steps.
pub fn allreduce(sh: &PlanCtx, count: usize) -> Plan {
    let mut p = Plan::new();
    let blocks = crate::plan::split(count, sh.n, sh.esize);
    if sh.n == 1 {
        if !sh.in_place {
            let len = count * sh.esize;
            p.copy(Region::new(Buf::Data, 0, len), Region::new(Buf::Input, 0, len));
        }
        return p;
    }
    // This rank's block is finished once, segment by segment as its reduction completes, and
    // nobody else touches it before the all-gather spreads it.
    let t = reduce_scatter_phase(&mut p, sh, &blocks, Acc::InPlace, true, 0);
    p.wait_all();
    let (off, len) = blocks[sh.rank];
    allgather_phase(&mut p, sh, &blocks, Region::new(Buf::Data, off, len), None, t);
    p
}

/// Ring reduce-scatter with per-rank block sizes (`blocks` in the input layout). Out of place,
/// the own block lands at offset 0 of the data buffer; in place, at its own offset.
pub fn reduce_scatter(sh: &PlanCtx, blocks: &[(usize, usize)]) -> Plan {
    let mut p = Plan::new();
    let (off, len) = blocks[sh.rank];
    if sh.n == 1 {
        if !sh.in_place {
            p.copy(Region::new(Buf::Data, 0, len), Region::new(Buf::Input, off, len));
        }
        return p;
    }
    let acc = if sh.in_place { Acc::InPlace } else { Acc::Own };
    reduce_scatter_phase(&mut p, sh, blocks, acc, false, 0);
    p
}

/// Ring allgather with per-rank block sizes (`blocks` in the output layout). Out of place the
/// own block is read from the input buffer (offset 0) and copied into place; in place it is
/// already at its offset.
pub fn allgather(sh: &PlanCtx, blocks: &[(usize, usize)]) -> Plan {
    let mut p = Plan::new();
    let (off, len) = blocks[sh.rank];
    let own = if sh.in_place {
        Region::new(Buf::Data, off, len)
    } else {
        Region::new(Buf::Input, 0, len)
    };
    // Out of place, the own block's copy into place overlaps the first transfers.
    allgather_phase(&mut p, sh, blocks, own, Some((Region::new(Buf::Data, off, len), own)), 0);
    p
}
