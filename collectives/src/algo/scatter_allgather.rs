//! Broadcast as a binomial scatter followed by a ring allgather (van de Geijn's broadcast).
//!
//! The buffer is cut into `n` blocks, block `v` for the rank at distance `v` from the root
//! (`v = (r - root) mod n`). The scatter walks a binomial tree over those distances: rank `v`
//! receives blocks `[v, v + lowbit(v))` from `v - lowbit(v)` and hands each child `v + m` (`m`
//! a power of two below `lowbit(v)`, largest first) the blocks `[v + m, v + 2m)`; the root holds
//! all of them. Then a segmented, pipelined ring allgather spreads every block to every rank.
//! The root sends `2(n-1)/n·S` bytes and every other rank at most `(n-1)/n·S` plus what it
//! forwards in the scatter, against the chain's `S` per rank and the tree root's `⌈log2 n⌉·S`.
//! The critical path is the scatter tree's depth (the most set bits of any distance below `n`)
//! plus the ring's `n - 1` steps, each a message of at most `S/n` when the scatter's are cut to
//! segments. Measured on loopback and on shaped links the chain beats it at every size tried
//! (`docs/algorithms.md`), as the cost model predicts; it is there to be chosen with `--algo`
//! or `TUTTI_ALGO`, and by the model wherever its formula comes out cheapest.

use super::{ring, PlanCtx};
use crate::plan::{segments, split, Buf, Plan, Region};

/// Scatter + allgather broadcast of `len` bytes from `root` (data buffer; the root's data comes
/// from the input buffer when out of place).
pub fn broadcast(sh: &PlanCtx, len: usize, root: usize) -> Plan {
    let n = sh.n;
    let v = (sh.rank + n - root) % n;
    let mut p = Plan::new();
    let src = if v == 0 { sh.src() } else { Buf::Data };
    if n == 1 {
        p.copy(Region::new(Buf::Data, 0, len), Region::new(src, 0, len));
        return p;
    }
    let blocks = split(len / sh.esize, n, sh.esize);
    // Blocks [a, b) of `buf` (by distance from the root): one contiguous range.
    let range = |buf: Buf, a: usize, b: usize| {
        let off = blocks[a].0;
        let end = blocks[b - 1].0 + blocks[b - 1].1;
        Region::new(buf, off, end - off)
    };
    let low = if v == 0 { n.next_power_of_two() } else { v & v.wrapping_neg() };
    if v != 0 {
        let mine = range(Buf::Data, v, (v + low).min(n));
        let hs: Vec<_> = segments(mine.len, sh.seg, sh.esize)
            .iter()
            .enumerate()
            .map(|(k, &(off, l))| p.recv(v - low, k as u32, mine.sub(off, l)))
            .collect();
        for h in hs {
            p.wait(h);
        }
    }
    let mut m = low >> 1;
    while m >= 1 {
        if v + m < n {
            let theirs = range(src, v + m, (v + 2 * m).min(n));
            for (k, &(off, l)) in segments(theirs.len, sh.seg, sh.esize).iter().enumerate() {
                p.send(v + m, k as u32, theirs.sub(off, l));
            }
        }
        m >>= 1;
    }
    // The allgather writes blocks this rank may still be sending in the scatter (the same
    // bytes): the scatter's sends end first.
    p.wait_all();
    // Scatter tags stay below the segment count of the whole buffer.
    let tag0 = segments(len, sh.seg, sh.esize).len() as u32;
    let own = Region::new(src, blocks[v].0, blocks[v].1);
    let copy = (v == 0).then(|| (Region::new(Buf::Data, blocks[0].0, blocks[0].1), own));
    ring::allgather_phase(&mut p, &PlanCtx { rank: v, ..*sh }, &blocks, own, copy, tag0);
    let order: Vec<usize> = (0..n).map(|x| (x + root) % n).collect();
    p.relabel(&order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::simulate;

    fn plans(n: usize, len: usize, root: usize, seg: usize) -> Vec<Plan> {
        (0..n)
            .map(|rank| broadcast(&PlanCtx { rank, n, esize: 4, seg, in_place: true }, len, root))
            .collect()
    }

    #[test]
    fn bytes_and_path_are_what_the_module_says() {
        for n in (2usize..=17).chain([24, 32]) {
            let len = 4 * n * 1000;
            let block = (len / n) as u64;
            // Block v travels popcount(v) hops of the scatter tree.
            let hops: u64 = (0..n).map(|v| u64::from(v.count_ones())).sum();
            let depth = (0..n).map(|v| u64::from(v.count_ones())).max().unwrap_or(0);
            for root in [0, n / 2, n - 1] {
                let r = simulate(&plans(n, len, root, 1 << 20)).unwrap();
                // The root: every other block in the scatter, then n - 1 blocks in the ring.
                assert_eq!(r.bytes_sent[root], 2 * (n as u64 - 1) * block, "n={n} root={root}");
                let total: u64 = r.bytes_sent.iter().sum();
                assert_eq!(total, (hops + (n as u64) * (n as u64 - 1)) * block, "n={n}");
                // The deepest rank's block, then n - 1 steps around the ring.
                assert_eq!(r.critical_steps, depth + n as u64 - 1, "n={n} root={root}");
                // Segments add messages, not hops.
                let r = simulate(&plans(n, len, root, 400)).unwrap();
                assert_eq!(r.critical_steps, depth + n as u64 - 1, "segmented n={n}");
            }
        }
    }
}
