//! Shared buffers: memory that every rank of a group on one host maps, so that a collective on
//! it moves each byte once, straight from its owner's buffer into the reader's.
//!
//! A collective on ordinary memory cannot read a peer's buffer: each rank first copies its
//! contribution into its window (or a ring) and the peers copy it out, two copies of every
//! byte. A [`SharedBuffer`] *is* the rank's window: [`Comm::shared_buffer`] makes one per rank
//! (an anonymous, sealed `memfd`, as the windows of direct reads are), every rank maps every
//! other's, and [`Comm::allgather_shared`] copies each peer's block from the peer's buffer into
//! its own, once. This is what nccl-tests calls buffer registration; collbench's `-R` runs its
//! in-place all-gather this way.

use std::marker::PhantomData;
use tutti_runtime::clock::{Deadline, Moment};

use crate::comm::{settings_digest, Comm, Stats};
use crate::direct::{Call, Direct, State};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::select::Algo;
use crate::Coll;

/// `count` elements of `T` in memory every rank of the group that made it maps. Reads and
/// writes as a slice (`Deref`, `DerefMut`); starts zeroed.
///
/// A buffer belongs to the group of the communicator that made it and is used with that
/// communicator only. Its memory is freed when every rank of the group has dropped its buffer
/// (or exited, however it ended).
///
/// After a call on it failed, a peer may still be reading this rank's block: the buffer can
/// be read but no longer written (`DerefMut` panics, [`Comm::allgather_shared`] refuses it);
/// make a new one.
pub struct SharedBuffer<T: Element> {
    direct: Direct,
    count: usize,
    /// The group it belongs to (id, size, this rank).
    group: (u32, usize, usize),
    /// A call on it failed: peers may still read it.
    broken: bool,
    _t: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for SharedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("count", &self.count)
            .field("dtype", &T::DTYPE)
            .field("rank", &self.group.2)
            .finish_non_exhaustive()
    }
}

impl<T: Element> std::ops::Deref for SharedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        let (p, len) = self.direct.own_data();
        debug_assert!(len >= self.count * size_of::<T>());
        // SAFETY: this rank's window holds `count` elements (made for them, page-aligned,
        // zero-filled: a valid value of every element type, as is any bit pattern); only this
        // rank writes it (peers only read it), and only through `&mut self`.
        unsafe { std::slice::from_raw_parts(p.cast_const().cast::<T>(), self.count) }
    }
}

impl<T: Element> std::ops::DerefMut for SharedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        assert!(
            !self.broken,
            "a call on this shared buffer failed and a peer may still be reading it: it is \
             read-only now; make a new one"
        );
        let (p, _) = self.direct.own_data();
        // SAFETY: as for `deref`; `&mut self` makes this the only reference, and no peer
        // reads it outside a call that succeeded (`broken` otherwise).
        unsafe { std::slice::from_raw_parts_mut(p.cast::<T>(), self.count) }
    }
}

impl Comm {
    /// Make a buffer of `count` elements of `T` that every rank of this group maps: see
    /// [`SharedBuffer`]. The ranks must share a host (their links go through shared memory,
    /// or are not connected yet in a group found on one host).
    ///
    /// # Collective contract
    /// Every rank calls it at the same point with the same `count` and `T`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming why not (a rank on another host, shared memory off, a
    /// window that could not be made or mapped, different counts), on every rank alike, the
    /// communicator still usable;
    /// [`Error::InvalidArgument`] for more than 1 GiB; the exchange's errors (a lost peer).
    pub fn shared_buffer<T: Element>(&self, count: usize) -> Result<SharedBuffer<T>> {
        // A set-up that ends "off" told every rank the same: refused alike, the group stays
        // usable (nobody waits for a rank that refused). Errors inside the set-up (a lost
        // peer, a local refusal the others would wait for) poison it, as any call's do.
        let state = self.call("shared_buffer", || {
            let bytes = count.saturating_mul(size_of::<T>());
            if bytes > tutti_runtime::window::MAX_DATA {
                return Err(self.invalid(
                    "shared_buffer",
                    format!("{bytes} bytes: at most {} in one", tutti_runtime::window::MAX_DATA),
                ));
            }
            Direct::setup_sized(
                self.group(),
                self.topo_now().hosts() <= 1,
                // Shared buffers are read straight from the windows: nothing to copy from
                // elsewhere.
                false,
                bytes.max(1),
                |mine, all| self.exec_allgather(Algo::Ring, mine, all),
                |x| {
                    let mut v = [x];
                    self.exec_allreduce_f64(Algo::Tree, &mut v, ReduceOp::Max)?;
                    Ok(v[0])
                },
            )
        })?;
        match state {
            State::Ready(direct) => Ok(SharedBuffer {
                direct: *direct,
                count,
                group: (self.group().id(), self.size(), self.rank()),
                broken: false,
                _t: PhantomData,
            }),
            State::Off(why) => Err(Error::Unsupported {
                rank: self.rank(),
                op: "shared_buffer",
                algo: Algo::Direct.name(),
                detail: why,
            }),
            State::Unknown => Err(Error::Unsupported {
                rank: self.rank(),
                op: "shared_buffer",
                algo: Algo::Direct.name(),
                detail: "the set-up did not finish".into(),
            }),
        }
    }

    /// All-gather in place on a shared buffer: rank `r`'s contribution is block `r` of its
    /// `buf` (`count / size` elements at `r × count / size`); on return every block of every
    /// rank's `buf` holds its owner's. Each rank copies every peer's block once, straight from
    /// the peer's buffer, and returns once no peer reads its own block any more.
    ///
    /// # Collective contract
    /// Every rank calls it at the same point with its buffer from the same
    /// [`Comm::shared_buffer`] call of this communicator; the count divides by the group size.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of another group, a count that does not divide,
    /// or a buffer a failed call left read-only; a peer's all-gather on this buffer with
    /// another element type or at another point (a mismatch naming both calls), a lost peer,
    /// an abort or the deadline, as [`Comm::allgather`]. A peer in another collective is named
    /// at the deadline (it writes nothing this call looks at). After an error the buffer is
    /// read-only (see [`SharedBuffer`]).
    pub fn allgather_shared<T: Element>(&self, buf: &mut SharedBuffer<T>) -> Result<Stats> {
        self.call(Coll::Allgather.name(), || {
            let start = Moment::now();
            let n = self.size();
            if buf.broken {
                return Err(self.invalid(
                    "allgather",
                    "a call on this shared buffer failed: it is read-only now".to_string(),
                ));
            }
            if buf.group != (self.group().id(), n, self.rank()) {
                return Err(self.invalid(
                    "allgather",
                    "the shared buffer belongs to another group".to_string(),
                ));
            }
            if !buf.count.is_multiple_of(n) {
                return Err(self.invalid(
                    "allgather",
                    format!("{} elements do not divide by {n} ranks", buf.count),
                ));
            }
            let seq = self.group().next_seq();
            let fp = tutti_runtime::wire::Fingerprint {
                op: Coll::Allgather.op_kind(),
                dtype: T::DTYPE,
                redop: 0,
                root: u32::MAX,
                count: (buf.count / n) as u64,
                settings: settings_digest(Algo::Direct, &self.sel.cfg),
            };
            let block = buf.count / n * size_of::<T>();
            let call = Call {
                group: self.group(),
                op_name: Coll::Allgather.name(),
                desc: crate::direct::desc(self.group().id(), seq, fp),
                start,
                deadline: Deadline::after(start, self.group().timeout()),
                bytes: block * n,
            };
            if let Err(e) = buf.direct.gather_in_place(&call, block) {
                buf.broken = true;
                return Err(e);
            }
            Ok(Stats {
                algo: Algo::Direct,
                bytes_sent: block as u64,
                elapsed: start.elapsed(),
                seq,
            })
        })
    }
}
