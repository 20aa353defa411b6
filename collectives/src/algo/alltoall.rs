//! All-to-all: pairwise exchange, post-all and Bruck.
//!
//! Pairwise: in round `i` (1..n) rank `r` sends its block for `r+i` and receives from `r-i`, a
//! few rounds in flight at once; every rank talks to one peer per round, so no link is
//! oversubscribed and no world size can deadlock. Post-all posts every send and receive at once
//! and lets the transport sort them out (best for small blocks). Both send `(n-1)/n·S` bytes.
//!
//! Bruck (equal blocks): `⌈log2 n⌉` messages per rank instead of `n-1`, for tiny blocks, where
//! each message's fixed cost is what counts. Rank `r` first rotates its blocks so that position
//! `i` holds the block for `r+i`. In round `k` it sends every block whose position has bit `k`
//! set, packed into one message, to `r+2^k`, and puts the blocks it gets from `r-2^k` at the same
//! positions. Afterwards position `i` holds the block from `r-i`, which a last copy puts in place.
//! Each round moves about half the blocks: `⌈log2 n⌉·S/2` bytes sent per rank.
//!
//! In place, the blocks for the peers are first saved to scratch (`coll/alltoall.rs`); pairwise
//! and post-all leave the own block where it is, Bruck saves it too.
//!
//! With 2 ranks, pairwise is one exchange that carries the own block's copy along in pieces
//! (`exchange_interleaved`).

use super::PlanCtx;
use crate::plan::{Buf, Plan, Region};

/// Rounds of the pairwise exchange kept in flight.
const WINDOW: usize = 4;

/// Append a pairwise all-to-all to `p`. `send` and `recv` give per-peer byte (offset, length)
/// in the source and destination buffers; `src` is the buffer the blocks are read from.
pub fn pairwise(
    p: &mut Plan,
    sh: &PlanCtx,
    src: Buf,
    send: &[(usize, usize)],
    recv: &[(usize, usize)],
) {
    let (n, r) = (sh.n, sh.rank);
    let own = own_copy(sh, src, send, recv);
    if n == 2 {
        // One exchange: the own block's copy goes along with it (`exchange_interleaved`; a
        // message cut in pieces is one both ranks see, and a short one is sent whole).
        let o = 1 - r;
        let out = (o, Region::new(src, send[o].0, send[o].1));
        let inc = (o, Region::new(Buf::Data, recv[o].0, recv[o].1));
        super::exchange_interleaved(p, sh, out, inc, own, 1);
        return;
    }
    p.copy_out(own.0, own.1, own.0.len);
    let mut inflight: Vec<(Option<usize>, Option<usize>)> = Vec::new();
    for i in 1..n {
        let to = (r + i) % n;
        let from = (r + n - i) % n;
        let hr = p.recv(from, i as u32, Region::new(Buf::Data, recv[from].0, recv[from].1));
        let hs = p.send(to, i as u32, Region::new(src, send[to].0, send[to].1));
        inflight.push((hr, hs));
        if inflight.len() >= WINDOW {
            let (a, b) = inflight.remove(0);
            p.wait(a);
            p.wait(b);
        }
    }
    p.wait_all();
}

/// The own block's copy into place `(dst, src)`: empty in place, where the block already is at
/// its offset and the in-place setup did not save it to scratch (`coll/alltoall.rs`).
fn own_copy(
    sh: &PlanCtx,
    src: Buf,
    send: &[(usize, usize)],
    recv: &[(usize, usize)],
) -> (Region, Region) {
    let r = sh.rank;
    let len = if sh.in_place { 0 } else { recv[r].1 };
    (Region::new(Buf::Data, recv[r].0, len), Region::new(src, send[r].0, len))
}

/// Append a post-all all-to-all (same arguments as [`pairwise`]).
pub fn post_all(
    p: &mut Plan,
    sh: &PlanCtx,
    src: Buf,
    send: &[(usize, usize)],
    recv: &[(usize, usize)],
) {
    let (n, r) = (sh.n, sh.rank);
    for i in 1..n {
        let from = (r + n - i) % n;
        p.recv(from, 0, Region::new(Buf::Data, recv[from].0, recv[from].1));
    }
    for i in 1..n {
        let to = (r + i) % n;
        p.send(to, 0, Region::new(src, send[to].0, send[to].1));
    }
    let own = own_copy(sh, src, send, recv);
    p.copy_out(own.0, own.1, own.0.len);
    p.wait_all();
}

/// Append a Bruck all-to-all of equal blocks (same arguments as [`pairwise`]; every block has
/// the length of the first).
pub fn bruck(
    p: &mut Plan,
    sh: &PlanCtx,
    src: Buf,
    send: &[(usize, usize)],
    recv: &[(usize, usize)],
) {
    let (n, r) = (sh.n, sh.rank);
    let blk = send.first().map_or(0, |b| b.1);
    // Position i holds the block for rank r+i.
    let rot = p.scratch(n * blk);
    for i in 0..n {
        let to = (r + i) % n;
        p.copy(Region::new(rot, i * blk, blk), Region::new(src, send[to].0, blk));
    }
    let most = n.div_ceil(2);
    let (out, inb) = (p.scratch(most * blk), p.scratch(most * blk));
    let mut d = 1;
    let mut round = 0u32;
    while d < n {
        let moved: Vec<usize> = (0..n).filter(|i| i & d != 0).collect();
        let len = moved.len() * blk;
        let hr = p.recv((r + n - d) % n, round, Region::new(inb, 0, len));
        for (j, &i) in moved.iter().enumerate() {
            p.copy(Region::new(out, j * blk, blk), Region::new(rot, i * blk, blk));
        }
        let hs = p.send((r + d) % n, round, Region::new(out, 0, len));
        p.wait(hr);
        for (j, &i) in moved.iter().enumerate() {
            p.copy(Region::new(rot, i * blk, blk), Region::new(inb, j * blk, blk));
        }
        // The next round packs into `out` again.
        p.wait(hs);
        d <<= 1;
        round += 1;
    }
    // Position i holds the block from rank r-i.
    for i in 0..n {
        let from = (r + n - i) % n;
        p.copy(Region::new(Buf::Data, recv[from].0, blk), Region::new(rot, i * blk, blk));
    }
}
