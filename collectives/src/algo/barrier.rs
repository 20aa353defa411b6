//! Dissemination barrier: in round `k` rank `r` sends a one-byte token to `r+2^k` and waits for
//! one from `r-2^k`; after `⌈log2 n⌉` rounds every rank has heard, directly or transitively, from
//! every other. Works for any world size.

use super::PlanCtx;
use crate::plan::{Plan, Region};

/// Dissemination barrier.
pub fn dissemination(sh: &PlanCtx) -> Plan {
    let mut p = Plan::new();
    let n = sh.n;
    let rounds = (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize;
    let token = p.scratch(1);
    let inbox = p.scratch(rounds.max(1));
    let mut d = 1;
    let mut k = 0;
    while d < n {
        let hr = p.recv((sh.rank + n - d) % n, k as u32, Region::new(inbox, k, 1));
        let hs = p.send((sh.rank + d) % n, k as u32, Region::new(token, 0, 1));
        p.wait(hr);
        p.wait(hs);
        d <<= 1;
        k += 1;
    }
    p
}
