//! Two-level schedules for groups spread over several hosts with the same number `L ≥ 2` of
//! ranks on each (`h ≥ 2` hosts): the bytes that must cross host links go over them once, in
//! `L` rings at once (one per local rank, the "columns": local rank `i` of every host), and
//! everything else stays within each host, where it moves through memory.
//!
//! **Allreduce.**
//! 1. Within each host, a ring reduce-scatter: local rank `i` ends with block `i` (of `L`)
//!    reduced over its host.
//! 2. Across hosts, `L` ring allreduces at once, one per local rank: local rank `i` of every
//!    host allreduces block `i`. Each host's link carries `L` rings of `S/L` bytes: `2(h−1)/h · S`
//!    per direction, against `2(n−1)/n · S` for one ring over all `n = h·L` ranks.
//! 3. Within each host, a ring allgather of the `L` blocks.
//!
//! Steps 1 and 3 cross only the host's memory, so on links much slower than memory the
//! two-level schedule moves fewer bytes over the slow part: `S` instead of `1.5·S` at 2 hosts
//! × 2 ranks, `1.5·S` instead of `1.75·S` at 4 hosts × 2. Measured on 1 Gbit/s links (2 ranks
//! per host, 1–64 MiB) it takes 0.70–0.74 of the ring's time at 2 hosts and 0.83–0.93 at 3, and
//! the same as the ring at 4: the `L` rings share each host link and each runs at its slowest
//! edge's momentary share (the cost model charges for it, see `model.rs`). Each block is reduced in one fixed order (along the host ring, then along the ring
//! of hosts) and then copied, so every rank ends with the same bits.
//!
//! **Allgather** (blocks of any sizes; `S` is the whole output).
//! 1. Across hosts, one ring allgather per column: local rank `i` of every host gathers the
//!    blocks of the column's ranks. Each host's link carries `(h−1)/h · S` per direction,
//!    against `(n−1)/n · S` for one ring over all ranks (`S/2` instead of `3S/4` at 2 hosts × 2).
//! 2. Within each host, for each host `j` in turn, a ring allgather of host `j`'s blocks (local
//!    rank `i` holds column `i`'s): every rank ends with every block.
//!
//! **Reduce-scatter**, the mirror image.
//! 1. Within each host, for each host `j` in turn, a ring reduce-scatter of host `j`'s blocks:
//!    local rank `i` ends with block `(j, i)` reduced over its own host, for every `j`.
//! 2. Across hosts, one ring reduce-scatter per column over those partial sums: each rank ends
//!    with its own block reduced over all ranks, having sent `(h−1)/h · S/L` across hosts.
//!
//! Out of place, reduce-scatter's first step reduces from the input into a scratch buffer laid
//! out as the input (`S` bytes), since the output holds only the own block; its phases within
//! the host share one set of receive slots.

use super::ring::{self, Acc};
use super::{tree, PlanCtx};
use crate::plan::{segments, split, Buf, Plan, Region};
use crate::topo::Topology;

/// The two-level allreduce of `count` elements on `topo`, or `None` when the group is not
/// spread over ≥ 2 hosts with the same number ≥ 2 of ranks on each.
pub fn allreduce(sh: &PlanCtx, count: usize, topo: &Topology) -> Option<Plan> {
    let (h, l) = topo.two_level().filter(|_| topo.size() == sh.n)?;
    let hosts: Vec<Vec<usize>> = (0..h).map(|j| topo.members(j)).collect();
    let j = topo.host_of(sh.rank);
    let i = hosts[j].iter().position(|r| *r == sh.rank)?;
    let blocks = split(count, l, sh.esize);

    // 1. Reduce-scatter within the host (reads the input directly when out of place).
    let local = PlanCtx { rank: i, n: l, ..*sh };
    let mut p = Plan::new();
    let t1 = ring::reduce_scatter_phase(&mut p, &local, &blocks, Acc::InPlace, false, 0);
    p.wait_all();
    let mut p = p.relabel(&hosts[j]);

    // 2. Allreduce of block i across hosts, among local rank i of every host.
    let (off, blen) = blocks[i];
    let column: Vec<usize> = hosts.iter().map(|m| m[i]).collect();
    let across = PlanCtx { rank: j, n: h, in_place: true, ..*sh };
    let q = ring::allreduce(&across, blen / sh.esize).shift_data(off);
    tree::append_shifted(&mut p, q.relabel(&column), t1);
    p.wait_all();
    // The widest tag range step 2 can use on any rank (its blocks differ by one element).
    let width = 2 * h as u32 * (segments(blocks[0].1, sh.seg, sh.esize).len() as u32 + 1);

    // 3. Allgather within the host.
    let mut q = Plan::new();
    ring::allgather_phase(
        &mut q,
        &PlanCtx { in_place: true, ..local },
        &blocks,
        Region::new(Buf::Data, off, blen),
        None,
        0,
    );
    tree::append_shifted(&mut p, q.relabel(&hosts[j]), t1 + width);
    Some(p)
}

/// The group's hosts (members ascending) and this rank's host and local index, when two-level
/// schedules apply.
fn layout(sh: &PlanCtx, topo: &Topology) -> Option<(Vec<Vec<usize>>, usize, usize)> {
    let (h, _) = topo.two_level().filter(|_| topo.size() == sh.n)?;
    let hosts: Vec<Vec<usize>> = (0..h).map(|j| topo.members(j)).collect();
    let j = topo.host_of(sh.rank);
    let i = hosts[j].iter().position(|r| *r == sh.rank)?;
    Some((hosts, j, i))
}

/// Tag steps one ring phase over `k` ranks may use, for blocks of at most `stride` segments.
fn phase_tags(k: usize, stride: u32) -> u32 {
    (k as u32 - 1) * stride
}

/// The most segments any of `blocks` is cut into: with it every rank computes the same tag
/// ranges for every phase, whichever blocks its own phases carry.
fn stride(sh: &PlanCtx, blocks: &[(usize, usize)]) -> u32 {
    blocks.iter().map(|b| segments(b.1, sh.seg, sh.esize).len()).max().unwrap_or(0).max(1) as u32
}

/// The two-level allgather of `blocks` (byte offset and length of each rank's block in the
/// output) on `topo`, or `None` when the group is not spread over ≥ 2 hosts with the same
/// number ≥ 2 of ranks on each. Out of place the own block is read from the input (offset 0).
pub fn allgather(sh: &PlanCtx, blocks: &[(usize, usize)], topo: &Topology) -> Option<Plan> {
    let (hosts, j, i) = layout(sh, topo)?;
    let (h, l) = (hosts.len(), hosts[j].len());
    let stride = stride(sh, blocks);
    let mut p = Plan::new();

    // 1. Across hosts: column i gathers its ranks' blocks.
    let column: Vec<usize> = hosts.iter().map(|m| m[i]).collect();
    let cblocks: Vec<(usize, usize)> = column.iter().map(|r| blocks[*r]).collect();
    let (off, len) = blocks[sh.rank];
    let placed = Region::new(Buf::Data, off, len);
    let (own, copy) =
        if sh.in_place { (placed, None) } else { (Region::new(Buf::Input, 0, len), Some(placed)) };
    let mut q = Plan::new();
    let across = PlanCtx { rank: j, n: h, ..*sh };
    ring::allgather_phase(&mut q, &across, &cblocks, own, copy.map(|d| (d, own)), 0);
    tree::append_shifted(&mut p, q.relabel(&column), 0);
    p.wait_all();

    // 2. Within the host: host by host, the columns' blocks go round.
    let local = PlanCtx { rank: i, n: l, in_place: true, ..*sh };
    let mut tag = phase_tags(h, stride);
    for (jj, members) in hosts.iter().enumerate() {
        let hb: Vec<(usize, usize)> = members.iter().map(|r| blocks[*r]).collect();
        // This rank's own block is sent from where it came in: out of place, its copy into
        // place may have streamed past the cache.
        let mine = if jj == j { own } else { Region::new(Buf::Data, hb[i].0, hb[i].1) };
        let mut q = Plan::new();
        ring::allgather_phase(&mut q, &local, &hb, mine, None, 0);
        tree::append_shifted(&mut p, q.relabel(&hosts[j]), tag);
        tag += phase_tags(l, stride);
    }
    Some(p)
}

/// The two-level reduce-scatter of `blocks` (byte offset and length of each rank's block in
/// the input) on `topo`, or `None` as [`allgather`]. In place the own block ends at its own
/// offset; out of place at offset 0 of the output.
pub fn reduce_scatter(sh: &PlanCtx, blocks: &[(usize, usize)], topo: &Topology) -> Option<Plan> {
    let (hosts, j, i) = layout(sh, topo)?;
    let (h, l) = (hosts.len(), hosts[j].len());
    let stride = stride(sh, blocks);
    let mut p = Plan::new();
    // Where the host's partial sums accumulate: the data buffer in place, else a scratch
    // buffer laid out as the input.
    let total = blocks.iter().map(|b| b.0 + b.1).max().unwrap_or(0);
    let work = if sh.in_place { Buf::Data } else { p.scratch(total) };

    // 1. Within the host: host by host, local rank k ends with block (host, k) summed here.
    let local = PlanCtx { rank: i, n: l, ..*sh };
    let mut tag = 0;
    // The phases run one after another, each done with its receive slots when it ends: the
    // first phase's slots serve them all (sized for the largest), so scratch does not grow
    // with the number of hosts.
    let mut slots: Vec<usize> = Vec::new();
    for members in &hosts {
        let hb: Vec<(usize, usize)> = members.iter().map(|r| blocks[*r]).collect();
        let mut q = Plan::new();
        ring::reduce_scatter_phase(&mut q, &local, &hb, Acc::InPlace, false, 0);
        let start = p.steps.len();
        let first = p.scratch.len();
        tree::append_shifted(&mut p, q.relabel(&hosts[j]), tag);
        p.map_buf(start, Buf::Data, work);
        let added: Vec<usize> = (first..p.scratch.len()).collect();
        if slots.is_empty() {
            slots = added;
        } else {
            for (k, &s) in added.iter().zip(&slots) {
                p.scratch[s] = p.scratch[s].max(p.scratch[*k]);
                p.map_buf(start, Buf::Scratch(*k as u16), Buf::Scratch(s as u16));
            }
            // Nothing refers to this phase's own slots any more.
            p.scratch.truncate(first);
        }
        tag += phase_tags(l, stride);
    }
    p.wait_all();

    // 2. Across hosts: column i reduces its ranks' blocks over the hosts' partial sums.
    let column: Vec<usize> = hosts.iter().map(|m| m[i]).collect();
    let cblocks: Vec<(usize, usize)> = column.iter().map(|r| blocks[*r]).collect();
    let across = PlanCtx { rank: j, n: h, ..*sh };
    let acc = if sh.in_place { Acc::InPlace } else { Acc::Own };
    let mut q = Plan::new();
    ring::reduce_scatter_phase(&mut q, &across, &cblocks, acc, false, 0);
    let start = p.steps.len();
    tree::append_shifted(&mut p, q.relabel(&column), tag);
    p.map_buf(start, Buf::Input, work);
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::simulate;

    #[test]
    fn refuses_what_it_cannot_run() {
        let sh = PlanCtx { rank: 0, n: 4, esize: 4, seg: 64, in_place: true };
        assert!(allreduce(&sh, 100, &Topology::flat(4)).is_none());
        assert!(allreduce(&sh, 100, &Topology::from_hosts(&[0, 1, 2, 3])).is_none());
        assert!(allreduce(&sh, 100, &Topology::from_hosts(&[0, 0, 0, 1])).is_none());
        assert!(allreduce(&sh, 100, &Topology::from_hosts(&[0, 0, 1, 1])).is_some());
    }

    #[test]
    fn every_send_meets_its_receive_and_links_carry_less() {
        for (hosts, count) in [
            (vec![0, 0, 1, 1], 1000),
            (vec![0, 1, 0, 1], 7),
            (vec![0, 0, 0, 1, 1, 1, 2, 2, 2], 1001),
            (vec![5, 5, 9, 9, 1, 1, 0, 0], 4096),
        ] {
            let topo = Topology::from_hosts(&hosts);
            let n = hosts.len();
            let plans: Vec<Plan> = (0..n)
                .map(|rank| {
                    let sh = PlanCtx { rank, n, esize: 4, seg: 256, in_place: false };
                    allreduce(&sh, count, &topo).unwrap()
                })
                .collect();
            simulate(&plans).unwrap_or_else(|e| panic!("{hosts:?}: {e}"));
            // Bytes leaving each host for other hosts: 2(h-1)/h · S (up to rounding).
            let (h, s) = (topo.hosts(), count * 4);
            for host in 0..h {
                let out: usize = plans
                    .iter()
                    .enumerate()
                    .filter(|(r, _)| topo.host_of(*r) == host)
                    .flat_map(|(_, p)| &p.steps)
                    .map(|st| match st {
                        crate::plan::Step::Send { peer, region, .. }
                            if topo.host_of(*peer) != host =>
                        {
                            region.len
                        }
                        _ => 0,
                    })
                    .sum();
                let want = 2 * (h - 1) * s / h;
                assert!(out.abs_diff(want) <= 8 * n * h, "{hosts:?} host {host}: {out} vs {want}");
            }
        }
    }

    /// Bytes each host sends to other hosts, summed over its ranks' plans.
    fn leaving(plans: &[Plan], topo: &Topology, host: usize) -> usize {
        plans
            .iter()
            .enumerate()
            .filter(|(r, _)| topo.host_of(*r) == host)
            .flat_map(|(_, p)| &p.steps)
            .map(|st| match st {
                crate::plan::Step::Send { peer, region, .. } if topo.host_of(*peer) != host => {
                    region.len
                }
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn gathers_and_scatters_cross_each_link_once() {
        for hosts in
            [&[0, 0, 1, 1][..], &[0, 1, 0, 1], &[0, 0, 0, 1, 1, 1, 2, 2, 2], &[3, 3, 1, 1, 0, 0]]
        {
            let topo = Topology::from_hosts(hosts);
            let n = hosts.len();
            for (count, in_place) in [(1000usize, true), (7, false), (0, true), (4096, false)] {
                let blocks = split(count * n, n, 4);
                for gather in [true, false] {
                    let plans: Vec<Plan> = (0..n)
                        .map(|rank| {
                            let sh = PlanCtx { rank, n, esize: 4, seg: 256, in_place };
                            if gather {
                                allgather(&sh, &blocks, &topo).unwrap()
                            } else {
                                reduce_scatter(&sh, &blocks, &topo).unwrap()
                            }
                        })
                        .collect();
                    simulate(&plans).unwrap_or_else(|e| panic!("{hosts:?} {gather}: {e}"));
                    // (h−1)/h·S leaves each host, S = count·n elements of 4 bytes.
                    let h = topo.hosts();
                    for host in 0..h {
                        let want = (h - 1) * count * n * 4 / h;
                        assert_eq!(leaving(&plans, &topo, host), want, "{hosts:?} host {host}");
                    }
                }
            }
        }
        // Scratch does not grow with the hosts: the phases within a host share their receive
        // slots (16 hosts × 2 ranks, out of place: the input-sized buffer, one set of slots for
        // the host phases, the column ring's slots and accumulators).
        let hosts: Vec<usize> = (0..32).map(|r| r / 2).collect();
        let topo = Topology::from_hosts(&hosts);
        let sh = PlanCtx { rank: 5, n: 32, esize: 4, seg: 64, in_place: false };
        let p = reduce_scatter(&sh, &split(32 * 1000, 32, 4), &topo).unwrap();
        assert!(p.scratch.len() <= 1 + 2 * super::super::LOOKAHEAD + 2, "{:?}", p.scratch);
        let sh = PlanCtx { rank: 0, n: 4, esize: 4, seg: 64, in_place: true };
        let b = split(400, 4, 4);
        assert!(allgather(&sh, &b, &Topology::flat(4)).is_none());
        assert!(reduce_scatter(&sh, &b, &Topology::from_hosts(&[0, 0, 0, 1])).is_none());
    }
}
