//! Device buffers (GPU memory) in the collectives: a small device trait, a staging engine that
//! moves device data through pinned host buffers segment by segment — copying segment `k + 1`
//! down and segment `k - 1` up while segment `k` is on the network (Gloo's
//! `cuda_allreduce_ring_chunked` pattern) — and the backends: [`sim::SimDevice`] (host memory
//! with an artificial copy latency and bandwidth, so the pipeline's ordering, overlap and errors
//! are tested without a GPU), `cuda::CudaDevice` (feature `cuda`, or `cuda-linked` in a build
//! that links the driver) and `nccl::NcclComm` (feature `nccl`).
//!
//! ```
//! use std::sync::Arc;
//! use tutti_collectives::device::{sim::SimDevice, Device, StagingConfig};
//! use tutti_collectives::{Comm, ReduceOp};
//!
//! std::thread::scope(|s| {
//!     for c in Comm::mem_world(2) {
//!         s.spawn(move || {
//!             let dev: Arc<dyn Device> = Arc::new(SimDevice::new(Default::default()));
//!             let buf = dev.alloc(4 * 1000).unwrap();
//!             let x: Vec<f32> = vec![c.rank() as f32 + 1.0; 1000];
//!             dev.upload(tutti_collectives::dtype::as_bytes(&x), &*buf).unwrap();
//!             let staged = c.staged(dev.clone(), StagingConfig::default());
//!             staged.allreduce::<f32>(&*buf, 1000, ReduceOp::Sum).unwrap();
//!             let mut out = vec![0f32; 1000];
//!             dev.download(&*buf, tutti_collectives::dtype::as_bytes_mut(&mut out)).unwrap();
//!             assert!(out.iter().all(|v| *v == 3.0));
//!         });
//!     }
//! });
//! ```

pub mod sim;

#[cfg(feature = "cuda-linked")]
pub mod cuda;
#[cfg(feature = "nccl")]
pub mod nccl;

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::comm::{Comm, Stats};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::select::Algo;

/// Memory on a device, as a handle: reads and writes go through [`Device`] calls (device memory
/// is not addressable from the host).
pub trait DeviceBuffer: Send + Sync {
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// For the backend that allocated it.
    fn as_any(&self) -> &dyn Any;
}

/// Host memory the device copies to and from asynchronously (pinned memory for CUDA).
pub trait HostStage: Send + Sync {
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// Start of the memory. Valid for `len_bytes()` bytes while the stage lives; aligned to at
    /// least 8 bytes, every element type's alignment (the simulated device's stages are boxed
    /// `u64`s; pinned CUDA stages start on a page).
    fn ptr(&self) -> *mut u8;
}

/// A point in a device's copy queue; [`Device::wait`] blocks until every copy queued before it
/// has finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// A device the collectives can stage: allocation, synchronous upload/download (tests, setup)
/// and an ordered queue of asynchronous copies (a CUDA stream).
pub trait Device: Send + Sync {
    /// Backend name (`sim`, `cuda:0`).
    fn name(&self) -> String;
    /// Allocate `bytes` of device memory.
    ///
    /// # Errors
    /// [`Error::Device`] when the device cannot allocate.
    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>>;
    /// Allocate a host staging buffer (pinned where the backend has pinned memory).
    ///
    /// # Errors
    /// [`Error::Device`] when it cannot be allocated.
    fn alloc_stage(&self, bytes: usize) -> Result<Box<dyn HostStage>>;
    /// Copy `src` into the start of `dst` and wait for it.
    ///
    /// # Errors
    /// [`Error::Device`]; [`Error::InvalidArgument`] when `src` is longer than `dst`.
    fn upload(&self, src: &[u8], dst: &dyn DeviceBuffer) -> Result<()>;
    /// Copy the start of `src` into `dst` and wait for it.
    ///
    /// # Errors
    /// As [`Device::upload`].
    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> Result<()>;
    /// Queue a copy of `len` bytes from `src` at `src_off` to `dst` at `dst_off`.
    ///
    /// # Safety
    /// Both ranges are in bounds, and neither is read or written by anyone else until a
    /// [`Device::wait`] on a ticket recorded after this call has returned; both buffers outlive
    /// that wait.
    ///
    /// # Errors
    /// [`Error::Device`] when the copy cannot be queued.
    unsafe fn d2h(
        &self,
        src: &dyn DeviceBuffer,
        src_off: usize,
        dst: &dyn HostStage,
        dst_off: usize,
        len: usize,
    ) -> Result<()>;
    /// Queue a copy of `len` bytes from host `src` to device `dst`.
    ///
    /// # Safety
    /// As [`Device::d2h`].
    ///
    /// # Errors
    /// As [`Device::d2h`].
    unsafe fn h2d(
        &self,
        src: &dyn HostStage,
        src_off: usize,
        dst: &dyn DeviceBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()>;
    /// Mark the current end of the copy queue.
    ///
    /// # Errors
    /// [`Error::Device`].
    fn record(&self) -> Result<Ticket>;
    /// Block until every copy queued before `t` has finished.
    ///
    /// # Errors
    /// [`Error::Device`] when a copy failed.
    fn wait(&self, t: Ticket) -> Result<()>;
    /// Copy spans the backend measured since the last call (the simulated device always
    /// records them; CUDA after [`Device::time_copies`]), for overlap reports; empty when the
    /// backend does not measure.
    fn copy_spans(&self) -> Vec<CopySpan> {
        Vec::new()
    }
    /// Start (or stop) timing every queued copy on the device itself (CUDA: an event with
    /// timing before and after each copy), so that [`Device::copy_spans`] reports when the
    /// copies really ran. Costs two event records per copy; off by default. A backend that
    /// always records (the simulation) ignores it.
    ///
    /// # Errors
    /// [`Error::Device`] when the timing base cannot be recorded.
    fn time_copies(&self, _on: bool) -> Result<()> {
        Ok(())
    }
}

/// One measured copy.
#[derive(Clone, Copy, Debug)]
pub struct CopySpan {
    /// Device-to-host (`true`) or host-to-device.
    pub d2h: bool,
    /// Bytes.
    pub bytes: usize,
    /// Start.
    pub start: Instant,
    /// End.
    pub end: Instant,
}

/// The product of `parts` (a count of elements, the element size, the world size), or `None`
/// when it overflows: a length check on a wrapped product would pass and let a copy run past
/// the buffer.
pub(crate) fn bytes(parts: &[usize]) -> Option<usize> {
    parts.iter().try_fold(1usize, |acc, p| acc.checked_mul(*p))
}

/// The pieces a call of fewer than 4 segments is cut into when its group is on one host and
/// [`StagingConfig::pieces`] is 0 (each piece at least [`StagingConfig::min_piece_bytes`]).
pub const ONE_HOST_PIECES: usize = 4;

/// Settings of the staging engine.
#[derive(Clone, Copy, Debug)]
pub struct StagingConfig {
    /// Elements of one block per segment are `segment_bytes / size_of::<T>()`. Default 4 MiB,
    /// measured on an H100 over PCIe 5 (pinned copies at 55 GB/s, an order of magnitude faster
    /// than the loopback wire): each segment is a separate host collective with its own fixed
    /// cost. In one sweep a 16 MiB allreduce with 4 ranks took 1.06× the host allreduce with
    /// 1 MiB segments and 0.93× with 4 MiB, while a 4 MiB first copy down and last copy up cost
    /// about 80 µs each (docs/gpu.md has the table).
    pub segment_bytes: usize,
    /// Host staging slots in the pool (each holds one segment in and out). Default 3: one being
    /// copied down, one on the network, one being copied up (2 and 4 measured no better).
    pub depth: usize,
    /// The fewest segments a call is cut into, while each stays at least `min_piece_bytes` (per
    /// block). A call of one segment runs its copy down, its collective and its copy up one
    /// after the other; cut into pieces, the copies of one piece run while another is on the
    /// network. 0, the default, chooses by the group: [`ONE_HOST_PIECES`] when it has 2 ranks
    /// or more, all on one host (their host collectives mostly read each other's memory, and
    /// even over messages a piece costs far less than a network round trip), 1 (no cutting)
    /// for one rank and across hosts, where each piece would pay a network round trip and
    /// cutting has not been measured. On an H200 with 2 and 4 ranks on its host, 4 pieces of
    /// 1 and 4 MiB calls took 0.83–0.96× the time of one segment in two runs a day apart (8 of
    /// 8 below 1), while identical settings (16 MiB) gave 0.88–1.10× (docs/gpu.md).
    pub pieces: usize,
    /// The smallest piece `pieces` cuts a call into. Default 256 KiB.
    pub min_piece_bytes: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig { segment_bytes: 4 << 20, depth: 3, pieces: 0, min_piece_bytes: 256 << 10 }
    }
}

impl StagingConfig {
    /// The defaults, overridden by `TUTTI_STAGE_SEGMENT_BYTES`, `TUTTI_STAGE_DEPTH`,
    /// `TUTTI_STAGE_PIECES` and `TUTTI_STAGE_MIN_PIECE_BYTES`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value that is not a positive integer (or 0 for
    /// `TUTTI_STAGE_PIECES`: the choice by the group).
    pub fn from_env() -> Result<StagingConfig> {
        let mut c = StagingConfig::default();
        // The least value `k` takes: 1, or 0 where 0 means something.
        let get = |k: &str, least: usize| -> Result<Option<usize>> {
            match std::env::var(k) {
                Ok(v) => {
                    v.trim().parse::<usize>().ok().filter(|x| *x >= least).map(Some).ok_or_else(
                        || Error::InvalidArgument {
                            rank: 0,
                            op: "StagingConfig::from_env",
                            detail: format!(
                                "{k}={v:?} is not a {} integer",
                                if least == 0 { "non-negative" } else { "positive" }
                            ),
                        },
                    )
                }
                Err(_) => Ok(None),
            }
        };
        if let Some(v) = get("TUTTI_STAGE_SEGMENT_BYTES", 1)? {
            c.segment_bytes = v;
        }
        if let Some(v) = get("TUTTI_STAGE_DEPTH", 1)? {
            c.depth = v.max(2);
        }
        // 0: the choice by the group, as the field's doc says.
        if let Some(v) = get("TUTTI_STAGE_PIECES", 0)? {
            c.pieces = v;
        }
        if let Some(v) = get("TUTTI_STAGE_MIN_PIECE_BYTES", 1)? {
            c.min_piece_bytes = v;
        }
        Ok(c)
    }

    /// Elements of one block per segment for a call of `count` elements of `esz` bytes per
    /// block: a whole segment, or less where `pieces` cuts the call (into as many equal pieces
    /// as `pieces` asks and `min_piece_bytes` allows), never more than the call. `pieces` 0
    /// counts as 1 here: a [`Staged`] resolves it by its group first.
    pub fn segment_elems(&self, count: usize, esz: usize) -> usize {
        let esz = esz.max(1);
        let whole = (self.segment_bytes / esz).max(1);
        let cut = self.pieces.min(count.saturating_mul(esz) / self.min_piece_bytes.max(1)).max(1);
        whole.min(count.div_ceil(cut)).max(1)
    }
}

/// What a staged collective did.
#[derive(Clone, Copy, Debug)]
pub struct StagedStats {
    /// The host algorithm of the segments' collectives (`None` for an empty call).
    pub algo: Option<Algo>,
    /// Segments.
    pub segments: usize,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
    /// Time spent waiting for copies (not hidden behind the network).
    pub copy_wait: Duration,
    /// Wall time of the call.
    pub elapsed: Duration,
}

/// What happened when, for overlap reports (one entry per segment and phase).
#[derive(Clone, Copy, Debug)]
pub struct NetSpan {
    /// Segment index.
    pub segment: usize,
    /// When the host collective of the segment started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

/// A step of the staging pipeline, in the order the engine took it (see [`Staged::take_actions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Segment's copies down queued.
    QueueDown(usize),
    /// Segment's host collective started (its copy down was waited for).
    Collective(usize),
    /// Segment's copies up queued.
    QueueUp(usize),
}

struct Slot {
    input: Box<dyn HostStage>,
    /// `None`: the collective runs in place in `input` (allreduce).
    output: Option<Box<dyn HostStage>>,
}

/// Collectives on device buffers through a staging pipeline; made by [`Comm::staged`].
///
/// # Collective contract
/// As the host collectives: every rank of the group calls the same operations in the same order
/// with the same counts (and the same [`StagingConfig`], so the segments line up).
pub struct Staged {
    comm: Comm,
    device: Arc<dyn Device>,
    cfg: StagingConfig,
    pool: Mutex<Vec<Slot>>,
    trace: Mutex<Vec<NetSpan>>,
    actions: Mutex<Vec<Action>>,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("rank", &self.comm.rank())
            .field("device", &self.device.name())
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Comm {
    /// Collectives on `device`'s buffers over this communicator, staged through host memory.
    pub fn staged(&self, device: Arc<dyn Device>, cfg: StagingConfig) -> Staged {
        Staged {
            comm: self.clone(),
            device,
            cfg: StagingConfig {
                segment_bytes: cfg.segment_bytes.max(1),
                depth: cfg.depth.max(2),
                ..cfg
            },
            pool: Mutex::new(Vec::new()),
            trace: Mutex::new(Vec::new()),
            actions: Mutex::new(Vec::new()),
        }
    }
}

/// The shape of a staged collective: `n_in` input blocks and `n_out` output blocks of `count`
/// elements each.
#[derive(Clone, Copy)]
struct Shape {
    n_in: usize,
    n_out: usize,
    count: usize,
    in_place: bool,
    /// This rank copies its input down (a broadcast's non-roots do not: they only receive).
    down: bool,
    /// This rank copies the result up (a reduce's non-roots and a broadcast's root do not:
    /// their device buffer keeps its contents).
    up: bool,
}

impl Shape {
    fn new(n_in: usize, n_out: usize, count: usize, in_place: bool) -> Shape {
        Shape { n_in, n_out, count, in_place, down: true, up: true }
    }
}

impl Staged {
    /// The communicator.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Host-collective spans of every call so far (then cleared), with the device's copy spans,
    /// for overlap reports.
    pub fn take_trace(&self) -> (Vec<NetSpan>, Vec<CopySpan>) {
        let net = std::mem::take(&mut *self.trace.lock().unwrap_or_else(|p| p.into_inner()));
        (net, self.device.copy_spans())
    }

    /// The pipeline steps of every call so far (then cleared): shows that segment `k + 1`'s
    /// copy down is queued before segment `k`'s collective starts.
    pub fn take_actions(&self) -> Vec<Action> {
        std::mem::take(&mut *self.actions.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The settings calls run with: the [`StagingConfig`] given, with `pieces` 0 resolved by the
    /// group (every rank finds the same topology, so the segments line up).
    ///
    /// # Collective contract
    /// Before the group's first collective, on ranks that advertise a non-loopback address,
    /// this runs the link measurement that finds the hosts: every rank calls it then, as for
    /// [`Comm::topology`]. After that, or on loopback and memory, any rank may call it alone.
    ///
    /// # Errors
    /// As [`Comm::topology`].
    pub fn settings(&self) -> Result<StagingConfig> {
        self.comm.call("staged_settings", || self.resolved())
    }

    /// [`Staged::settings`], inside a call.
    fn resolved(&self) -> Result<StagingConfig> {
        if self.cfg.pieces != 0 {
            return Ok(self.cfg);
        }
        self.comm.ensure_measured()?;
        // A cost model (slow links, or one given by `Comm::with_model`) means other hosts.
        let one_host = self.comm.size() >= 2
            && self.comm.topo_now().hosts() <= 1
            && self.comm.link_model().is_none();
        Ok(StagingConfig { pieces: if one_host { ONE_HOST_PIECES } else { 1 }, ..self.cfg })
    }

    fn check_len(
        &self,
        op: &'static str,
        what: &str,
        b: &dyn DeviceBuffer,
        need: Option<usize>,
    ) -> Result<()> {
        let Some(need) = need else {
            return Err(self.comm.invalid(op, "the element count times its size overflows".into()));
        };
        if b.len_bytes() < need {
            return Err(self.comm.invalid(
                op,
                format!("{what} holds {} bytes, the call needs {need}", b.len_bytes()),
            ));
        }
        Ok(())
    }

    /// Allreduce of `count` elements of `buf`, in place.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`].
    ///
    /// # Errors
    /// As [`Comm::allreduce`]; [`Error::Device`] for a failed copy;
    /// [`Error::InvalidArgument`] when `buf` is too small.
    pub fn allreduce<T: Element>(
        &self,
        buf: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
    ) -> Result<StagedStats> {
        self.comm.call("allreduce", || {
            self.check_len("allreduce", "buffer", buf, bytes(&[count, size_of::<T>()]))?;
            let shape = Shape::new(1, 1, count, true);
            self.run::<T>("allreduce", buf, buf, shape, |c, inp, _out| c.allreduce(inp, op))
        })
    }

    /// Allreduce of `count` elements of `input` into `output` (`input` unchanged).
    ///
    /// # Collective contract
    /// As [`Comm::allreduce_from`].
    ///
    /// # Errors
    /// As [`Staged::allreduce`].
    pub fn allreduce_from<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
    ) -> Result<StagedStats> {
        self.comm.call("allreduce", || {
            self.check_len("allreduce", "input", input, bytes(&[count, size_of::<T>()]))?;
            self.check_len("allreduce", "output", output, bytes(&[count, size_of::<T>()]))?;
            let shape = Shape::new(1, 1, count, false);
            self.run::<T>("allreduce", input, output, shape, |c, inp, out| {
                c.allreduce_from(inp, out, op)
            })
        })
    }

    /// Allgather: `input` holds `count` elements, `output` receives `size() * count`.
    ///
    /// # Collective contract
    /// As [`Comm::allgather`].
    ///
    /// # Errors
    /// As [`Staged::allreduce`].
    pub fn allgather<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
    ) -> Result<StagedStats> {
        self.comm.call("allgather", || {
            let n = self.comm.size();
            self.check_len("allgather", "input", input, bytes(&[count, size_of::<T>()]))?;
            self.check_len("allgather", "output", output, bytes(&[n, count, size_of::<T>()]))?;
            let shape = Shape::new(1, n, count, false);
            self.run::<T>("allgather", input, output, shape, |c, inp, out| c.allgather(inp, out))
        })
    }

    /// Reduce-scatter: `input` holds `size() * count` elements, rank `r` receives block `r`
    /// (`count` elements) of the reduction in `output`.
    ///
    /// # Collective contract
    /// As [`Comm::reduce_scatter`].
    ///
    /// # Errors
    /// As [`Staged::allreduce`].
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
    ) -> Result<StagedStats> {
        self.comm.call("reduce_scatter", || {
            let n = self.comm.size();
            self.check_len("reduce_scatter", "input", input, bytes(&[n, count, size_of::<T>()]))?;
            self.check_len("reduce_scatter", "output", output, bytes(&[count, size_of::<T>()]))?;
            let shape = Shape::new(n, 1, count, false);
            self.run::<T>("reduce_scatter", input, output, shape, |c, inp, out| {
                c.reduce_scatter(inp, out, op)
            })
        })
    }

    /// Broadcast `count` elements of `buf` from `root`: the root's buffer is copied down and
    /// sent, every other rank's is overwritten (the root's is left as it is).
    ///
    /// # Collective contract
    /// As [`Comm::broadcast`].
    ///
    /// # Errors
    /// As [`Staged::allreduce`]; [`Error::InvalidArgument`] for a root outside the group.
    pub fn broadcast<T: Element>(
        &self,
        buf: &dyn DeviceBuffer,
        count: usize,
        root: usize,
    ) -> Result<StagedStats> {
        self.comm.call("broadcast", || {
            self.comm.check_root("broadcast", root)?;
            self.check_len("broadcast", "buffer", buf, bytes(&[count, size_of::<T>()]))?;
            let me = self.comm.rank() == root;
            let shape = Shape { down: me, up: !me, ..Shape::new(1, 1, count, true) };
            self.run::<T>("broadcast", buf, buf, shape, |c, inp, _out| c.broadcast(inp, root))
        })
    }

    /// Reduce `count` elements of every rank's `buf` into `root`'s `buf` (the other ranks'
    /// buffers are left as they are).
    ///
    /// # Collective contract
    /// As [`Comm::reduce`].
    ///
    /// # Errors
    /// As [`Staged::broadcast`].
    pub fn reduce<T: Element>(
        &self,
        buf: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
        root: usize,
    ) -> Result<StagedStats> {
        self.comm.call("reduce", || {
            self.comm.check_root("reduce", root)?;
            self.check_len("reduce", "buffer", buf, bytes(&[count, size_of::<T>()]))?;
            let me = self.comm.rank() == root;
            let shape = Shape { up: me, ..Shape::new(1, 1, count, true) };
            self.run::<T>("reduce", buf, buf, shape, |c, inp, _out| c.reduce(inp, op, root))
        })
    }

    /// All-to-all: block `j` (`count` elements) of `input` goes to rank `j`; block `i` of
    /// `output` comes from rank `i`.
    ///
    /// # Collective contract
    /// As [`Comm::all_to_all`].
    ///
    /// # Errors
    /// As [`Staged::allreduce`].
    pub fn all_to_all<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
    ) -> Result<StagedStats> {
        self.comm.call("alltoall", || {
            let n = self.comm.size();
            self.check_len("alltoall", "input", input, bytes(&[n, count, size_of::<T>()]))?;
            self.check_len("alltoall", "output", output, bytes(&[n, count, size_of::<T>()]))?;
            let shape = Shape::new(n, n, count, false);
            self.run::<T>("alltoall", input, output, shape, |c, inp, out| c.all_to_all(inp, out))
        })
    }

    fn take_slot(&self, in_bytes: usize, out_bytes: Option<usize>) -> Result<Slot> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let fits = |s: &Slot| {
            s.input.len_bytes() >= in_bytes
                && match (out_bytes, &s.output) {
                    (None, _) => true,
                    (Some(b), Some(o)) => o.len_bytes() >= b,
                    (Some(_), None) => false,
                }
        };
        if let Some(i) = pool.iter().position(fits) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        Ok(Slot {
            input: self.device.alloc_stage(in_bytes)?,
            output: out_bytes.map(|b| self.device.alloc_stage(b)).transpose()?,
        })
    }

    /// The pipeline: per segment, copy the input blocks' part down, run the host collective on
    /// the packed segment, copy the output blocks' part up. The typed entry to
    /// [`Staged::run_bytes`], which holds the pipeline once for every element type and
    /// collective (as a generic it was compiled 56 times in collbench's crate).
    fn run<T: Element>(
        &self,
        name: &'static str,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        shape: Shape,
        host: impl Fn(&Comm, &mut [T], &mut [T]) -> Result<Stats>,
    ) -> Result<StagedStats> {
        fn typed<T>(b: &mut [u8]) -> &mut [T] {
            if b.is_empty() {
                return &mut [];
            }
            debug_assert!(b.as_ptr().cast::<T>().is_aligned(), "a stage aligned for its type");
            // SAFETY: the bytes are a stage's, aligned to at least 8 bytes (`HostStage::ptr`),
            // which covers every `Element`'s alignment, and a whole number of elements long
            // (`run_bytes` cuts them in elements); the typed slice borrows them for as long as
            // the byte slice would.
            unsafe {
                std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / size_of::<T>())
            }
        }
        self.run_bytes(name, input, output, shape, size_of::<T>(), &|c, inp, out| {
            host(c, typed::<T>(inp), typed::<T>(out))
        })
    }

    /// [`Staged::run`] on elements of `esz` bytes, the host collective given bytes.
    fn run_bytes(
        &self,
        name: &'static str,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        shape: Shape,
        esz: usize,
        host: &HostBytes<'_>,
    ) -> Result<StagedStats> {
        let start = Instant::now();
        // A call smaller than a segment gets slots of its own size, not a whole segment's.
        let seg = self.resolved()?.segment_elems(shape.count, esz);
        let nseg = shape.count.div_ceil(seg);
        let depth = self.cfg.depth;
        let mut slots = Vec::with_capacity(depth.min(nseg));
        for _ in 0..depth.min(nseg) {
            slots.push(self.take_slot(
                shape.n_in * seg * esz,
                (!shape.in_place).then_some(shape.n_out * seg * esz),
            )?);
        }
        let mut down: Vec<Option<Ticket>> = vec![None; nseg];
        let mut up: Vec<Option<Ticket>> = vec![None; nseg];
        let mut bytes = 0u64;
        let mut algo = None;
        let mut copy_wait = Duration::ZERO;
        let mut spans = Vec::with_capacity(nseg);
        let actions = Mutex::new(Vec::with_capacity(3 * nseg));
        let act = |a: Action| actions.lock().unwrap_or_else(|p| p.into_inner()).push(a);
        let res = (|| -> Result<()> {
            let range = |k: usize| (k * seg, ((k + 1) * seg).min(shape.count) - k * seg);
            // Queue segment k's copy down into its slot (after the slot's previous copy up).
            let issue_down = |k: usize, up: &[Option<Ticket>]| -> Result<Ticket> {
                if k >= depth {
                    if let Some(t) = up[k - depth] {
                        self.device.wait(t)?;
                    }
                }
                let (first, len) = range(k);
                let slot = &slots[k % depth];
                act(Action::QueueDown(k));
                for b in (0..shape.n_in).filter(|_| shape.down) {
                    // SAFETY: in bounds (lengths checked by the callers, slots sized for a full
                    // segment of every block); the slot is free (its previous copy up was waited
                    // for above) and nothing touches the range until this segment's ticket is
                    // waited for; every ticket is waited for before `run` returns.
                    unsafe {
                        self.device.d2h(
                            input,
                            (b * shape.count + first) * esz,
                            &*slot.input,
                            b * len * esz,
                            len * esz,
                        )?
                    };
                }
                self.device.record()
            };
            if nseg > 0 {
                down[0] = Some(issue_down(0, &up)?);
            }
            for k in 0..nseg {
                if let Some(t) = down[k] {
                    let w = Instant::now();
                    self.device.wait(t)?;
                    copy_wait += w.elapsed();
                }
                if k + 1 < nseg {
                    down[k + 1] = Some(issue_down(k + 1, &up)?);
                }
                let (first, len) = range(k);
                let slot = &slots[k % depth];
                // SAFETY: the slot's copy down was waited for; its copy up (below) is queued
                // only after the host collective is done with it; stages are sized for
                // `n * seg` elements.
                let inp = unsafe {
                    std::slice::from_raw_parts_mut(slot.input.ptr(), shape.n_in * len * esz)
                };
                let t0 = Instant::now();
                act(Action::Collective(k));
                // A pooled slot may carry an output stage from an earlier call: an in-place
                // collective ignores it.
                let out_stage = if shape.in_place { None } else { slot.output.as_deref() };
                let st = match out_stage {
                    None => host(&self.comm, inp, &mut [])?,
                    Some(o) => {
                        // SAFETY: as above, for the output stage.
                        let out = unsafe {
                            std::slice::from_raw_parts_mut(o.ptr(), shape.n_out * len * esz)
                        };
                        host(&self.comm, inp, out)?
                    }
                };
                spans.push(NetSpan { segment: k, start: t0, end: Instant::now() });
                bytes += st.bytes_sent;
                algo = Some(st.algo);
                let src: &dyn HostStage = out_stage.unwrap_or(&*slot.input);
                act(Action::QueueUp(k));
                for b in (0..shape.n_out).filter(|_| shape.up) {
                    // SAFETY: as for the copy down; the destination range is this segment's
                    // part of block b, written by no one else.
                    unsafe {
                        self.device.h2d(
                            src,
                            b * len * esz,
                            output,
                            (b * shape.count + first) * esz,
                            len * esz,
                        )?
                    };
                }
                up[k] = Some(self.device.record()?);
            }
            Ok(())
        })();
        // Whatever happened, no copy may still reference the stages or the caller's buffers.
        let w = Instant::now();
        let drained = self.device.record().and_then(|t| self.device.wait(t));
        copy_wait += w.elapsed();
        let res = res.and(drained);
        {
            // Keep the largest slots, at most two calls' worth: a call smaller than a segment
            // has slots of its own size, and sizes that keep growing must not pile up.
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            pool.extend(slots);
            if pool.len() > 2 * depth {
                let size =
                    |s: &Slot| s.input.len_bytes() + s.output.as_ref().map_or(0, |o| o.len_bytes());
                pool.sort_by_key(|s| std::cmp::Reverse(size(s)));
                pool.truncate(2 * depth);
            }
        }
        self.trace.lock().unwrap_or_else(|p| p.into_inner()).extend(spans);
        self.actions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(actions.into_inner().unwrap_or_else(|p| p.into_inner()));
        // A failure (a device copy, the host collective) leaves through `Comm::call`, which
        // poisons the group and tells the peers who failed and why.
        if let Err(Error::Device { detail, .. }) = res {
            return Err(Error::Device { rank: self.comm.rank(), op: name, detail });
        }
        res?;
        Ok(StagedStats {
            algo,
            segments: nseg,
            bytes_sent: bytes,
            copy_wait,
            elapsed: start.elapsed(),
        })
    }
}

/// A staged call's host collective on a segment's input and output stages, as bytes (the
/// output empty in place).
type HostBytes<'a> = dyn Fn(&Comm, &mut [u8], &mut [u8]) -> Result<Stats> + 'a;

/// Open a device by name: `sim` (the simulated device, default settings) or `cuda`
/// (GPU `ordinal`, usually `LOCAL_RANK`).
///
/// # Errors
/// [`Error::CudaUnavailable`] for `cuda` when tutti was built without the `cuda` feature or the
/// driver or GPU is missing; [`Error::InvalidArgument`] for another name.
pub fn open(name: &str, ordinal: usize) -> Result<Arc<dyn Device>> {
    match name {
        "sim" => Ok(Arc::new(sim::SimDevice::new(sim::SimConfig::default()))),
        "cuda" | "nccl" => open_cuda(ordinal),
        other => Err(Error::InvalidArgument {
            rank: 0,
            op: "device::open",
            detail: format!("unknown device {other:?} (sim, cuda)"),
        }),
    }
}

/// `off..off + len` must lie within `cap` bytes (`what` names the range in the error).
pub(crate) fn check_range(what: &str, off: usize, len: usize, cap: usize) -> Result<()> {
    if off.checked_add(len).is_none_or(|e| e > cap) {
        return Err(Error::Device {
            rank: 0,
            op: "copy",
            detail: format!(
                "{what} range {off}..{} outside its {cap} bytes",
                off.saturating_add(len)
            ),
        });
    }
    Ok(())
}

#[cfg(feature = "cuda-linked")]
fn open_cuda(ordinal: usize) -> Result<Arc<dyn Device>> {
    Ok(Arc::new(cuda::CudaDevice::new(ordinal)?))
}

#[cfg(not(feature = "cuda-linked"))]
fn open_cuda(_ordinal: usize) -> Result<Arc<dyn Device>> {
    Err(Error::CudaUnavailable {
        rank: 0,
        detail: "tutti was built without the `cuda` feature (cargo build --features cuda)".into(),
    })
}

/// The fraction of the copy time that ran while a host collective was on the network
/// (`0.0` = fully serial, `1.0` = every copy hidden). Spans of copies that overlap several
/// network spans count once.
pub fn overlap_fraction(net: &[NetSpan], copies: &[CopySpan]) -> f64 {
    let total: f64 = copies.iter().map(|c| (c.end - c.start).as_secs_f64()).sum();
    if total == 0.0 {
        return 0.0;
    }
    let hidden: f64 = copies
        .iter()
        .map(|c| {
            net.iter()
                .map(|n| {
                    let s = c.start.max(n.start);
                    let e = c.end.min(n.end);
                    if e > s {
                        (e - s).as_secs_f64()
                    } else {
                        0.0
                    }
                })
                .sum::<f64>()
                .min((c.end - c.start).as_secs_f64())
        })
        .sum();
    hidden / total
}
