//! The executor: runs a [`Plan`] over a group's transport.
//!
//! It resolves regions to addresses, posts sends and receives, waits, and applies reductions.
//! Memory safety of the raw posts rests on checks made here for every step, not on the plans
//! being right: a region must lie inside its buffer, nothing may write the input buffer, and no
//! step may touch bytes that an outstanding receive writes (or write bytes an outstanding send
//! reads). A plan that breaks a rule fails with [`Error::Internal`] instead of corrupting memory.

use std::time::Instant;

use tutti_runtime::{Fingerprint, Group, MsgDesc, OpId, Tag, Transport};

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::kernel;
use crate::plan::{Buf, Plan, Region, Step};

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

/// Scratch memory: 8-byte aligned, reused across calls.
#[derive(Default)]
pub(crate) struct Scratch {
    bufs: Vec<Vec<u64>>,
}

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
    }
}

/// Run `plan` with `data` as [`Buf::Data`] and `input` as [`Buf::Input`]. Returns bytes sent.
pub(crate) fn execute(
    call: &Call<'_>,
    seq: u64,
    plan: &Plan,
    data: &mut [u8],
    input: Option<&[u8]>,
    scratch: &mut Scratch,
) -> Result<u64> {
    scratch.prepare(&plan.scratch);
    let start = Instant::now();
    let mut ex = Exec {
        call,
        seq,
        t: call.group.transport().as_ref(),
        data: data.as_mut_ptr(),
        data_len: data.len(),
        input: input.map(|i| (i.as_ptr(), i.len())),
        scratch: scratch
            .bufs
            .iter_mut()
            .map(|b| (b.as_mut_ptr().cast::<u8>(), b.len() * 8))
            .collect(),
        handles: Vec::with_capacity(plan.posts),
        outstanding: Vec::new(),
        start,
        deadline: start + call.group.timeout(),
        sent: 0,
    };
    let mut r = ex.run(plan);
    if let (Ok(()), Some(f), false) = (&r, call.finish, plan.finishes) {
        r = ex.finish(f, &Region::new(Buf::Data, 0, ex.data_len));
    }
    if r.is_err() {
        for i in std::mem::take(&mut ex.outstanding) {
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
    scratch: Vec<(*mut u8, usize)>,
    handles: Vec<Option<Posted>>,
    outstanding: Vec<usize>,
    start: Instant,
    deadline: Instant,
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
        for &h in &self.outstanding {
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
        let got = self.t.wait(id, self.deadline)?;
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
