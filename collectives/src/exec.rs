//! The executor: runs a [`Plan`] over a group's transport.
//!
//! It resolves regions to addresses, posts sends and receives, waits, and applies reductions.
//! Memory safety of the raw posts rests on checks made here for every step, not on the plans
//! being right: a region must lie inside its buffer, nothing may write the input buffer, and no
//! step may touch bytes that an outstanding receive writes (or write bytes an outstanding send
//! reads). A plan that breaks a rule fails with [`Error::Internal`] instead of corrupting memory.

use std::sync::Arc;
use std::time::Instant;

use tutti_runtime::clock::{Deadline, Moment};
use tutti_runtime::{Fingerprint, Group, MsgDesc, OpId, Tag, Transport};

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::kernel;
use crate::plan::{Buf, Plan, Region, Step};
use crate::topo::Topology;

/// What the executor needs to know about the call.
pub(crate) struct Call<'g> {
    pub(crate) group: &'g Group,
    pub(crate) op_name: &'static str,
    pub(crate) fp: Fingerprint,
    pub(crate) dtype: DType,
    pub(crate) redop: ReduceOp,
    /// Applied to the result where the plan says ([`Step::Finish`]), or to all of it after a
    /// plan that does not.
    pub(crate) finish: Option<kernel::Finish>,
}

struct Posted {
    id: OpId,
    peer: usize,
    region: Region,
    recv: bool,
}

/// What the executor keeps between calls (behind the communicator's lock): scratch memory,
/// 8-byte aligned; its own lists of posts; and the plans of recent calls. A call that repeats an
/// earlier one allocates nothing here.
#[derive(Default)]
pub(crate) struct Scratch {
    bufs: Vec<Vec<u64>>,
    /// The scratch buffers' addresses and lengths, as of the latest call's start.
    addrs: Vec<(*mut u8, usize)>,
    handles: Vec<Option<Posted>>,
    outstanding: Vec<usize>,
    /// Plans of recent calls with the same shape (see [`PlanCache`]).
    pub(crate) plans: PlanCache,
}

// SAFETY: `addrs` holds addresses into `bufs`, refreshed at each call's start and followed only
// while that call runs, under the communicator's lock. Nothing else in `Scratch` is tied to a
// thread.
unsafe impl Send for Scratch {}

impl Scratch {
    fn prepare(&mut self, sizes: &[usize]) {
        while self.bufs.len() < sizes.len() {
            self.bufs.push(Vec::new());
        }
        for (b, &len) in self.bufs.iter_mut().zip(sizes) {
            let words = len.div_ceil(8);
            if b.len() < words {
                *b = vec![0u64; words];
            }
        }
        self.addrs.clear();
        self.addrs.extend(self.bufs.iter_mut().map(|b| (b.as_mut_ptr().cast::<u8>(), b.len() * 8)));
    }
}

/// What makes two calls' plans the same: an algorithm is a pure function of these (and of the
/// topology, kept beside the key). Only calls whose blocks all have one size are cached; the
/// `v` collectives' per-rank counts are not part of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlanKey {
    pub(crate) coll: crate::coll::Coll,
    pub(crate) algo: crate::select::Algo,
    pub(crate) rank: usize,
    pub(crate) n: usize,
    pub(crate) esize: usize,
    pub(crate) seg: usize,
    pub(crate) in_place: bool,
    pub(crate) count: usize,
    pub(crate) bytes: usize,
    pub(crate) root: Option<usize>,
}

/// The plans of the most recent distinct calls, newest first. Each entry keeps the topology
/// it was planned on alive and is found only by that same topology (`None`: the flat one of a
/// communicator that has not learned its hosts yet).
#[derive(Default)]
pub(crate) struct PlanCache {
    entries: Vec<(PlanKey, Option<Arc<Topology>>, Arc<Plan>)>,
}

impl PlanCache {
    /// Entries kept: a training step's distinct collective shapes, usually a handful.
    const CAP: usize = 16;

    /// The plan for `key` on `topo`, made by `make` unless a recent call had the same shape.
    pub(crate) fn get_or_make(
        &mut self,
        key: PlanKey,
        topo: Option<&Arc<Topology>>,
        make: impl FnOnce() -> Result<Plan>,
    ) -> Result<Arc<Plan>> {
        let same_topo = |t: &Option<Arc<Topology>>| match (t, topo) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if let Some(i) = self.entries.iter().position(|(k, t, _)| *k == key && same_topo(t)) {
            if i > 0 {
                let e = self.entries.remove(i);
                self.entries.insert(0, e);
            }
            return Ok(self.entries[0].2.clone());
        }
        let plan = Arc::new(make()?);
        if self.entries.len() == Self::CAP {
            self.entries.pop();
        }
        self.entries.insert(0, (key, topo.cloned(), plan.clone()));
        Ok(plan)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Run `plan` with `data` as [`Buf::Data`] and `input` as [`Buf::Input`]; `start` is the
/// call's start, from which its deadline runs. Returns bytes sent.
pub(crate) fn execute(
    call: &Call<'_>,
    seq: u64,
    plan: &Plan,
    data: &mut [u8],
    input: Option<&[u8]>,
    scratch: &mut Scratch,
    start: Moment,
) -> Result<u64> {
    scratch.prepare(&plan.scratch);
    let Scratch { addrs, handles, outstanding, .. } = scratch;
    handles.clear();
    handles.reserve(plan.posts);
    outstanding.clear();
    let mut ex = Exec {
        call,
        seq,
        t: call.group.transport().as_ref(),
        data: data.as_mut_ptr(),
        data_len: data.len(),
        input: input.map(|i| (i.as_ptr(), i.len())),
        scratch: addrs,
        handles,
        outstanding,
        start,
        deadline: Deadline::after(start, call.group.timeout()),
        until: None,
        sent: 0,
    };
    let mut r = ex.run(plan);
    if let (Ok(()), Some(f), false) = (&r, call.finish, plan.finishes) {
        r = ex.finish(f, &Region::new(Buf::Data, 0, ex.data_len));
    }
    if r.is_err() {
        for i in std::mem::take(&mut *ex.outstanding) {
            if let Some(p) = &ex.handles[i] {
                ex.t.cancel(p.id);
            }
        }
    }
    r.map(|()| ex.sent)
}

struct Exec<'a> {
    call: &'a Call<'a>,
    seq: u64,
    t: &'a dyn Transport,
    data: *mut u8,
    data_len: usize,
    input: Option<(*const u8, usize)>,
    scratch: &'a [(*mut u8, usize)],
    handles: &'a mut Vec<Option<Posted>>,
    outstanding: &'a mut Vec<usize>,
    start: Moment,
    deadline: Deadline,
    /// `deadline` as an instant, once a wait needed it (a call with no wait, of one rank,
    /// reads no clock for it).
    until: Option<Instant>,
    sent: u64,
}

impl Exec<'_> {
    /// Apply `f` to `region` of the data buffer.
    fn finish(&mut self, f: kernel::Finish, region: &Region) -> Result<()> {
        if region.buf != Buf::Data || !region.len.is_multiple_of(self.call.dtype.size()) {
            return Err(self.internal(format!("finish of {region:?}")));
        }
        let d = self.resolve(region, true)?;
        self.check_free(region, true)?;
        // SAFETY: the region is inside the data buffer (checked), whole elements of its dtype
        // at an element boundary (the buffer is a slice of that dtype), untouched by any
        // outstanding post (checked).
        unsafe { kernel::finish_raw(self.call.dtype, f, d, region.len) };
        Ok(())
    }

    fn internal(&self, detail: String) -> Error {
        Error::Internal {
            rank: self.call.group.rank(),
            op: self.call.op_name,
            seq: self.seq,
            elapsed: self.start.elapsed(),
            detail,
        }
    }

    /// Address of a region, checked against its buffer; `write` refuses the input buffer.
    fn resolve(&self, r: &Region, write: bool) -> Result<*mut u8> {
        let (base, len) = match r.buf {
            Buf::Data => (self.data, self.data_len),
            Buf::Input => {
                if write {
                    return Err(self.internal(format!("plan writes the input buffer at {r:?}")));
                }
                match self.input {
                    Some((p, l)) => (p.cast_mut(), l),
                    None => {
                        return Err(
                            self.internal("plan reads an input buffer the call lacks".into())
                        )
                    }
                }
            }
            Buf::Scratch(k) => match self.scratch.get(k as usize) {
                Some(&(p, l)) => (p, l),
                None => return Err(self.internal(format!("plan uses undeclared scratch {k}"))),
            },
        };
        match r.off.checked_add(r.len) {
            Some(end) if end <= len => {}
            _ => {
                return Err(self.internal(format!("region {r:?} outside its buffer of {len} bytes")))
            }
        }
        // SAFETY: `off + len <= buffer length` was checked just above.
        Ok(unsafe { base.add(r.off) })
    }

    /// Refuse a step whose region conflicts with an outstanding post: any overlap with a
    /// receive, or (when the step writes) with a send.
    fn check_free(&self, r: &Region, write: bool) -> Result<()> {
        for &h in self.outstanding.iter() {
            if let Some(p) = &self.handles[h] {
                if (p.recv || write) && p.region.overlaps(r) {
                    return Err(self.internal(format!(
                        "step touches {r:?} while post {h} on {:?} is outstanding",
                        p.region
                    )));
                }
            }
        }
        Ok(())
    }

    fn desc(&self, tag: u32) -> MsgDesc {
        MsgDesc {
            tag: Tag { group: self.call.group.id(), seq: self.seq, step: tag },
            fp: self.call.fp,
        }
    }

    fn wait(&mut self, h: usize) -> Result<()> {
        let Some(p) = self.handles.get(h).and_then(Option::as_ref) else {
            return Err(self.internal(format!("wait for unknown or finished handle {h}")));
        };
        let (id, want, peer) = (p.id, p.region.len, p.peer);
        let until = *self.until.get_or_insert_with(|| self.deadline.instant());
        let got = self.t.wait(id, until)?;
        self.handles[h] = None;
        self.outstanding.retain(|&x| x != h);
        if got != want {
            // A shorter message under a matching fingerprint: the ranks disagree on the layout
            // (per-peer counts of a `v` collective).
            return Err(Error::Runtime(tutti_runtime::Error::Mismatch {
                rank: self.call.group.rank(),
                peer,
                expected: format!("{want} bytes in {} (seq {})", self.call.op_name, self.seq),
                got: format!("{got} bytes: the ranks' counts disagree"),
            }));
        }
        Ok(())
    }

    fn run(&mut self, plan: &Plan) -> Result<()> {
        for step in &plan.steps {
            match step {
                Step::Send { peer, tag, region } => {
                    let ptr = self.resolve(region, false)?;
                    self.check_free(region, false)?;
                    let desc = self.desc(*tag);
                    let g = self.call.group.global_rank(*peer);
                    // SAFETY: the region is inside a live buffer (checked) that this call borrows
                    // until every post is waited for or cancelled, and no step writes it while
                    // the send is outstanding (`check_free` on every write).
                    let id = unsafe { self.t.post_send(g, desc, ptr, region.len)? };
                    self.sent += region.len as u64;
                    self.outstanding.push(self.handles.len());
                    self.handles.push(Some(Posted { id, peer: g, region: *region, recv: false }));
                }
                Step::Recv { peer, tag, region } => {
                    let ptr = self.resolve(region, true)?;
                    self.check_free(region, true)?;
                    let desc = self.desc(*tag);
                    let g = self.call.group.global_rank(*peer);
                    // SAFETY: as for sends; additionally nothing else reads or writes the region
                    // while the receive is outstanding.
                    let id = unsafe { self.t.post_recv(g, desc, ptr, region.len)? };
                    self.outstanding.push(self.handles.len());
                    self.handles.push(Some(Posted { id, peer: g, region: *region, recv: true }));
                }
                Step::Wait(h) => self.wait(*h)?,
                Step::WaitAll => {
                    while let Some(&h) = self.outstanding.first() {
                        self.wait(h)?;
                    }
                }
                Step::Reduce { dst, a, b } => {
                    if a.len != dst.len || b.len != dst.len {
                        return Err(
                            self.internal(format!("reduce of unequal regions {dst:?} {a:?} {b:?}"))
                        );
                    }
                    if (a != dst && a.overlaps(dst)) || b.overlaps(dst) {
                        return Err(self.internal(format!("reduce into overlapping {dst:?}")));
                    }
                    let d = self.resolve(dst, true)?;
                    let pa = self.resolve(a, false)?;
                    let pb = self.resolve(b, false)?;
                    self.check_free(dst, true)?;
                    self.check_free(a, false)?;
                    self.check_free(b, false)?;
                    // SAFETY: all three regions are inside live buffers (checked), no outstanding
                    // post touches them (checked), and dst is either `a` exactly or disjoint
                    // from both operands (checked).
                    unsafe {
                        kernel::reduce_raw(self.call.dtype, self.call.redop, d, pa, pb, dst.len)
                    };
                }
                Step::Finish(region) => {
                    if let Some(f) = self.call.finish {
                        self.finish(f, region)?;
                    }
                }
                Step::Copy { dst, src, stream } => {
                    if src.len != dst.len || src.overlaps(dst) {
                        return Err(self.internal(format!("bad copy {src:?} -> {dst:?}")));
                    }
                    let d = self.resolve(dst, true)?;
                    let s = self.resolve(src, false)?;
                    self.check_free(dst, true)?;
                    self.check_free(src, false)?;
                    // SAFETY: both regions are in bounds and disjoint (checked) and untouched by
                    // outstanding posts (checked).
                    unsafe {
                        if *stream {
                            kernel::copy_stream(d, s, dst.len)
                        } else {
                            std::ptr::copy_nonoverlapping(s, d, dst.len)
                        }
                    };
                }
            }
        }
        while let Some(&h) = self.outstanding.first() {
            self.wait(h)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::coll::Coll;
    use crate::select::Algo;

    fn key(algo: Algo, bytes: usize, root: Option<usize>) -> PlanKey {
        PlanKey {
            coll: Coll::Broadcast,
            algo,
            rank: 1,
            n: 4,
            esize: 4,
            seg: 1 << 20,
            in_place: true,
            count: bytes / 4,
            bytes,
            root,
        }
    }

    /// A plan told apart from others by its number of posts.
    fn plan(posts: usize) -> Plan {
        Plan { posts, ..Plan::default() }
    }

    #[test]
    fn a_repeated_shape_reuses_its_plan_and_any_difference_makes_a_new_one() {
        let mut c = PlanCache::default();
        let made = Cell::new(0);
        let get = |c: &mut PlanCache, k: PlanKey, t: Option<&Arc<Topology>>| {
            c.get_or_make(k, t, || {
                made.set(made.get() + 1);
                Ok(plan(made.get()))
            })
            .unwrap()
        };
        let a = get(&mut c, key(Algo::Tree, 8, Some(0)), None);
        let again = get(&mut c, key(Algo::Tree, 8, Some(0)), None);
        assert!(Arc::ptr_eq(&a, &again));
        assert_eq!(made.get(), 1);
        // Each field of the key, and the topology, tells calls apart.
        get(&mut c, key(Algo::Chain, 8, Some(0)), None);
        get(&mut c, key(Algo::Tree, 16, Some(0)), None);
        get(&mut c, key(Algo::Tree, 8, Some(1)), None);
        assert_eq!(made.get(), 4);
        let hosts = Arc::new(Topology::from_hosts(&[0, 1, 0, 1]));
        let other = Arc::new(Topology::from_hosts(&[0, 1, 0, 1]));
        let on_hosts = get(&mut c, key(Algo::Tree, 8, Some(0)), Some(&hosts));
        assert_eq!(made.get(), 5, "a known topology is not the flat one");
        get(&mut c, key(Algo::Tree, 8, Some(0)), Some(&other));
        assert_eq!(made.get(), 6, "topologies are told apart by identity, not by value");
        let back = get(&mut c, key(Algo::Tree, 8, Some(0)), Some(&hosts));
        assert!(Arc::ptr_eq(&on_hosts, &back));
        assert_eq!(made.get(), 6);
        assert_eq!(c.len(), 6);
    }

    #[test]
    fn the_oldest_shape_goes_first_and_failures_are_not_kept() {
        let mut c = PlanCache::default();
        let made = Cell::new(0);
        let get = |c: &mut PlanCache, bytes: usize| {
            c.get_or_make(key(Algo::Tree, bytes, None), None, || {
                made.set(made.get() + 1);
                Ok(plan(0))
            })
            .unwrap()
        };
        for b in 0..PlanCache::CAP {
            get(&mut c, b);
        }
        // Using shape 0 again makes shape 1 the oldest.
        get(&mut c, 0);
        get(&mut c, PlanCache::CAP);
        assert_eq!((made.get(), c.len()), (PlanCache::CAP + 1, PlanCache::CAP));
        get(&mut c, 0);
        assert_eq!(made.get(), PlanCache::CAP + 1, "shape 0 was kept");
        get(&mut c, 1);
        assert_eq!(made.get(), PlanCache::CAP + 2, "shape 1 was dropped");
        let e = c.get_or_make(key(Algo::Ring, 8, None), None, || {
            Err(Error::Internal {
                rank: 1,
                op: "broadcast",
                seq: 0,
                elapsed: std::time::Duration::ZERO,
                detail: "refused".into(),
            })
        });
        assert!(e.is_err());
        let ok = c.get_or_make(key(Algo::Ring, 8, None), None, || Ok(plan(7))).unwrap();
        assert_eq!(ok.posts, 7, "a failed plan is made again, not remembered");
    }
}
