//! Linear gather and scatter: the root exchanges directly with every other rank, all posted at
//! once. `(n-1)/n·S` bytes cross the root's link in one step; the other ranks send or receive
//! one block.

use super::PlanCtx;
use crate::plan::{Buf, Plan, Region};

/// Gather `blocks` (output layout at the root) to `root`. Non-roots send their input (or, in
/// place, their block of the data buffer).
pub fn gather(sh: &PlanCtx, blocks: &[(usize, usize)], root: usize) -> Plan {
    let mut p = Plan::new();
    let r = sh.rank;
    let own = if sh.in_place {
        Region::new(Buf::Data, blocks[r].0, blocks[r].1)
    } else {
        Region::new(Buf::Input, 0, blocks[r].1)
    };
    if r == root {
        for (i, &(off, len)) in blocks.iter().enumerate() {
            if i != root {
                p.recv(i, 0, Region::new(Buf::Data, off, len));
            }
        }
        p.copy_out(Region::new(Buf::Data, blocks[r].0, blocks[r].1), own, blocks[r].1);
    } else {
        p.send(root, 0, own);
    }
    p.wait_all();
    p
}

/// Scatter `blocks` (input layout at the root) from `root`; every rank's block lands at offset 0
/// of its data buffer (in place: at its own offset).
pub fn scatter(sh: &PlanCtx, blocks: &[(usize, usize)], root: usize) -> Plan {
    let mut p = Plan::new();
    let r = sh.rank;
    let mine = if sh.in_place {
        Region::new(Buf::Data, blocks[r].0, blocks[r].1)
    } else {
        Region::new(Buf::Data, 0, blocks[r].1)
    };
    if r == root {
        let src = sh.src();
        for (i, &(off, len)) in blocks.iter().enumerate() {
            if i != root {
                p.send(i, 0, Region::new(src, off, len));
            }
        }
        p.copy_out(mine, Region::new(src, blocks[r].0, blocks[r].1), blocks[r].1);
    } else {
        p.recv(root, 0, mine);
    }
    p.wait_all();
    p
}
