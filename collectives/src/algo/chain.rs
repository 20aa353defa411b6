//! Pipelined chain broadcast: the root streams segments to the next rank, which forwards each
//! segment as soon as it has it. `n-1` hops of latency plus one segment time per segment: for
//! large messages every rank receives at nearly the bandwidth of one link, where a binomial tree
//! makes the root send `log2 n` copies.

use super::{PlanCtx, LOOKAHEAD};
use crate::plan::{segments, Buf, Plan, Region};

/// Chain broadcast of `len` bytes from `root`.
pub fn broadcast(sh: &PlanCtx, len: usize, root: usize) -> Plan {
    let mut p = Plan::new();
    let n = sh.n;
    let v = (sh.rank + n - root) % n;
    let data = Region::new(Buf::Data, 0, len);
    let segs = segments(len, sh.seg, sh.esize);
    let next = (v + 1 < n).then(|| (sh.rank + 1) % n);
    if v == 0 {
        let src = Region::new(sh.src(), 0, len);
        if let Some(nx) = next {
            for (k, &(off, l)) in segs.iter().enumerate() {
                p.send(nx, k as u32, src.sub(off, l));
            }
        }
        p.copy(data, src);
        return p;
    }
    let prev = (sh.rank + n - 1) % n;
    let depth = 2 * LOOKAHEAD;
    let mut hs = vec![None; segs.len()];
    for (k, &(off, l)) in segs.iter().enumerate().take(depth) {
        hs[k] = p.recv(prev, k as u32, data.sub(off, l));
    }
    for (k, &(off, l)) in segs.iter().enumerate() {
        p.wait(hs[k]);
        if let Some(&(o2, l2)) = segs.get(k + depth) {
            hs[k + depth] = p.recv(prev, (k + depth) as u32, data.sub(o2, l2));
        }
        if let Some(nx) = next {
            p.send(nx, k as u32, data.sub(off, l));
        }
    }
    p
}
