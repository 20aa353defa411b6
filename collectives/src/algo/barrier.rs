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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_round_per_doubling_and_an_inbox_byte_per_round() {
        for n in 1..=33usize {
            let p = dissemination(&PlanCtx { rank: 0, n, esize: 1, seg: 64, in_place: true });
            // ⌈log2 n⌉ rounds, written out as the smallest k with 2^k >= n.
            let rounds = (0..).find(|k| 1usize << k >= n).unwrap_or(0);
            assert_eq!(p.posts, 2 * rounds, "n={n}: a send and a receive per round");
            assert_eq!(p.scratch, vec![1, rounds.max(1)], "n={n}: token and inbox bytes");
        }
    }
}
