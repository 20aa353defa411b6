//! All-to-all: pairwise exchange and post-all.
//!
//! Pairwise: in round `i` (1..n) rank `r` sends its block for `r+i` and receives from `r-i`, a
//! few rounds in flight at once; every rank talks to one peer per round, so no link is
//! oversubscribed and no world size can deadlock. Post-all posts every send and receive at once
//! and lets the transport sort them out (best for small blocks). Both send `(n-1)/n·S` bytes.
//! In place, the buffer is first copied to scratch (`coll/alltoall.rs`).

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
    p.copy(Region::new(Buf::Data, recv[r].0, recv[r].1), Region::new(src, send[r].0, send[r].1));
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
    p.copy(Region::new(Buf::Data, recv[r].0, recv[r].1), Region::new(src, send[r].0, send[r].1));
    p.wait_all();
}
