//! CUDA device buffers (feature `cuda`): cudarc with the driver loaded at run time, so tutti
//! builds and runs on machines without CUDA and asking for a GPU there returns
//! [`Error::CudaUnavailable`], never a panic.
//!
//! Staging uses a dedicated stream for the copies and page-locked host buffers
//! (`cuMemHostAlloc`, not write-combined: the host reduces in them, and write-combined memory
//! is slow to read).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::{CopySpan, Device, DeviceBuffer, HostStage, Ticket};
use crate::error::{Error, Result};

/// True when the CUDA driver library can be loaded (checked before any cudarc call, which
/// would panic without it).
#[cfg(feature = "cuda")]
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// True: a build that links the driver (feature `cuda-linked` alone) does not start without it.
#[cfg(not(feature = "cuda"))]
pub fn driver_present() -> bool {
    true
}

fn require_driver() -> Result<()> {
    if driver_present() {
        return Ok(());
    }
    Err(Error::CudaUnavailable {
        rank: 0,
        detail: "the CUDA driver library (libcuda.so) is not installed on this machine".into(),
    })
}

/// GPUs the driver sees.
///
/// # Errors
/// [`Error::CudaUnavailable`] without the driver library or when the driver cannot count.
pub fn device_count() -> Result<usize> {
    require_driver()?;
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| Error::CudaUnavailable { rank: 0, detail: format!("cannot count GPUs: {e}") })
}

/// This process's GPU: `LOCAL_RANK` (0 when unset) modulo the GPUs present, so more local ranks
/// than GPUs share them round-robin.
///
/// # Errors
/// As [`device_count`].
pub fn local_ordinal() -> Result<usize> {
    let local: usize = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    Ok(local % device_count()?.max(1))
}

fn dev_err(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Device { rank: 0, op, detail: e.to_string() }
}

/// GPU memory.
pub struct CudaBuffer(CudaSlice<u8>);

impl CudaBuffer {
    /// The cudarc slice (for NCCL and for callers' kernels).
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.0
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len_bytes(&self) -> usize {
        self.0.len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// GPU memory someone else owns (a framework tensor's storage), lent for the staged calls made
/// while the view lives. Made by [`CudaView::new`].
#[derive(Debug)]
pub struct CudaView {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl CudaView {
    /// A view of `len` bytes of device memory at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` is device memory of the context the [`CudaDevice`] it is used with
    /// belongs to (the device's primary context: frameworks built on cudarc, candle among
    /// them, use it too); it stays allocated while the view lives, and nothing else writes it
    /// (nor, when the view is a call's output, reads it) during a call that uses the view.
    /// Work queued on other streams that produces it must be complete before the call.
    pub unsafe fn new(ptr: sys::CUdeviceptr, len: usize) -> CudaView {
        CudaView { ptr, len }
    }
}

impl DeviceBuffer for CudaView {
    fn len_bytes(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Page-locked buffers most recently given back, kept for the next stages: pinning memory costs
/// far more than copying it, and a caller that makes a `Staged` per call (the parallel layers'
/// CUDA path does) would otherwise pin and unpin on every call.
struct Recycled {
    ctx: Arc<CudaContext>,
    /// (start, capacity) of free pinned buffers, at most [`KEEP_PINNED`].
    free: Mutex<Vec<(*mut u8, usize)>>,
}

/// Free pinned buffers a device keeps (a few calls' worth of staging slots).
const KEEP_PINNED: usize = 16;

/// The most page-locked memory a device keeps free, in bytes: past it the largest kept buffers
/// are freed (whole tensors staged by the parallel layers' moves can be large).
const KEEP_PINNED_BYTES: usize = 512 << 20;

/// `cuMemHostAlloc` calls made by this process's CUDA devices so far.
static PINNED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// How many page-locked buffers this process's CUDA devices have allocated (`cuMemHostAlloc`
/// calls) so far. A stage served from a device's kept buffers does not count: a loop of staged
/// calls of the same sizes (a training step) stops adding to it after its first iteration.
pub fn pinned_allocations() -> u64 {
    PINNED_ALLOCATIONS.load(Ordering::Relaxed)
}

// SAFETY: the pointers are page-locked host memory owned by this list, touched only under its
// lock (to hand out or free).
unsafe impl Send for Recycled {}
// SAFETY: as above.
unsafe impl Sync for Recycled {}

impl Recycled {
    /// The smallest kept buffer of at least `bytes`.
    fn take(&self, bytes: usize) -> Option<(*mut u8, usize)> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let i = (0..free.len()).filter(|&i| free[i].1 >= bytes).min_by_key(|&i| free[i].1)?;
        Some(free.swap_remove(i))
    }

    /// Keep a buffer; when too many are kept, free the smallest, and when they hold too much,
    /// the largest.
    fn give(&self, ptr: *mut u8, cap: usize) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push((ptr, cap));
        if free.len() > KEEP_PINNED {
            if let Some(i) = (0..free.len()).min_by_key(|&i| free[i].1) {
                let (p, _) = free.swap_remove(i);
                self.release(p);
            }
        }
        while free.iter().map(|f| f.1).sum::<usize>() > KEEP_PINNED_BYTES {
            let Some(i) = (0..free.len()).max_by_key(|&i| free[i].1) else { break };
            let (p, _) = free.swap_remove(i);
            self.release(p);
        }
    }

    fn release(&self, ptr: *mut u8) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `cuMemHostAlloc` in `alloc_stage`; it left the list (or the list
        // is being dropped), so it is freed once.
        let _ = unsafe { result::free_host(ptr.cast()) };
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let free = std::mem::take(self.free.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (p, _) in free {
            self.release(p);
        }
    }
}

/// Page-locked host memory; when dropped it goes back to its device, which keeps a few such
/// buffers for the next stages.
pub struct PinnedStage {
    ptr: *mut u8,
    len: usize,
    home: Arc<Recycled>,
}

// SAFETY: plain host memory; access is ordered by the staging engine.
unsafe impl Send for PinnedStage {}
// SAFETY: as above.
unsafe impl Sync for PinnedStage {}

impl HostStage for PinnedStage {
    fn len_bytes(&self) -> usize {
        self.len
    }
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for PinnedStage {
    fn drop(&mut self) {
        self.home.give(self.ptr, self.len);
    }
}

/// Recorded events: the last ticket issued, and the events not yet known to be complete.
type Events = (u64, VecDeque<(u64, Arc<CudaEvent>)>);

/// A copy timed on the device: direction, bytes, and events before and after it.
type Timed = (bool, usize, CudaEvent, CudaEvent);

/// Copy timing: a base event with the host instant it completed at, and the timed copies
/// since; `None` when timing is off.
struct Timing {
    base: CudaEvent,
    at: Instant,
    copies: Vec<Timed>,
}

/// One GPU with a copy stream.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    events: Mutex<Events>,
    timing: Mutex<Option<Timing>>,
    pinned: Arc<Recycled>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("ordinal", &self.ordinal).finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Open GPU `ordinal` (for a rank, usually `LOCAL_RANK`).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when the driver is not installed or the GPU does not exist.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        require_driver()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::CudaUnavailable {
            rank: 0,
            detail: format!("cannot open GPU {ordinal}: {e}"),
        })?;
        let stream = ctx.new_stream().map_err(|e| dev_err("creating a stream", e))?;
        Ok(CudaDevice {
            ordinal,
            stream,
            events: Mutex::new((0, VecDeque::new())),
            timing: Mutex::new(None),
            pinned: Arc::new(Recycled { ctx: ctx.clone(), free: Mutex::new(Vec::new()) }),
            ctx,
        })
    }

    /// The cudarc stream the copies run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A timing base: an event recorded on the copy stream, waited for, and the host instant
    /// right after (the event's device time maps to host time within the wait's latency).
    fn base(&self) -> Result<(CudaEvent, Instant)> {
        let ev = self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| dev_err("time_copies", e))?;
        ev.synchronize().map_err(|e| dev_err("time_copies", e))?;
        Ok((ev, Instant::now()))
    }

    /// Queue `copy` on the stream, between two timing events when timing is on.
    fn timed(
        &self,
        d2h: bool,
        len: usize,
        copy: impl FnOnce() -> std::result::Result<(), cudarc::driver::DriverError>,
    ) -> Result<()> {
        let mut g = self.timing.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = g.as_mut() else {
            return copy().map_err(|e| dev_err("copy", e));
        };
        let ev = || {
            self.stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| dev_err("copy", e))
        };
        let a = ev()?;
        copy().map_err(|e| dev_err("copy", e))?;
        let b = ev()?;
        t.copies.push((d2h, len, a, b));
        Ok(())
    }

    /// Start and length of a buffer this device can copy to and from.
    fn raw(&self, b: &dyn DeviceBuffer) -> Result<(sys::CUdeviceptr, usize)> {
        if let Some(c) = b.as_any().downcast_ref::<CudaBuffer>() {
            let (p, _sync) = c.0.device_ptr(&self.stream);
            return Ok((p, c.0.len()));
        }
        if let Some(v) = b.as_any().downcast_ref::<CudaView>() {
            return Ok((v.ptr, v.len));
        }
        Err(dev_err("copy", "the buffer is neither a CUDA allocation nor a CudaView"))
    }

    fn ptr(&self, b: &dyn DeviceBuffer, off: usize, len: usize) -> Result<sys::CUdeviceptr> {
        let (p, cap) = self.raw(b)?;
        super::check_range("device", off, len, cap)?;
        Ok(p + off as u64)
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>> {
        let s = self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(|e| dev_err("alloc", e))?;
        Ok(Box::new(CudaBuffer(s)))
    }

    fn alloc_stage(&self, bytes: usize) -> Result<Box<dyn HostStage>> {
        let home = self.pinned.clone();
        if let Some((ptr, len)) = home.take(bytes) {
            return Ok(Box::new(PinnedStage { ptr, len, home }));
        }
        self.ctx.bind_to_thread().map_err(|e| dev_err("alloc_stage", e))?;
        let len = bytes.max(16);
        // SAFETY: a plain page-locked allocation (flags 0: portable to this context only,
        // cached), given back to `pinned` by `PinnedStage::drop` and freed by it.
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(|e| dev_err("alloc_stage", e))?;
        PINNED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(PinnedStage { ptr: ptr.cast(), len, home }))
    }

    fn upload(&self, src: &[u8], dst: &dyn DeviceBuffer) -> Result<()> {
        let p = self.ptr(dst, 0, src.len())?;
        self.ctx.bind_to_thread().map_err(|e| dev_err("upload", e))?;
        // SAFETY: in bounds; synchronised before `src` can go away.
        unsafe { result::memcpy_htod_async(p, src, self.stream.cu_stream()) }
            .map_err(|e| dev_err("upload", e))?;
        self.stream.synchronize().map_err(|e| dev_err("upload", e))
    }

    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        let p = self.ptr(src, 0, dst.len())?;
        self.ctx.bind_to_thread().map_err(|e| dev_err("download", e))?;
        // SAFETY: in bounds; synchronised before `dst` can go away.
        unsafe { result::memcpy_dtoh_async(dst, p, self.stream.cu_stream()) }
            .map_err(|e| dev_err("download", e))?;
        self.stream.synchronize().map_err(|e| dev_err("download", e))
    }

    unsafe fn d2h(
        &self,
        src: &dyn DeviceBuffer,
        src_off: usize,
        dst: &dyn HostStage,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        let p = self.ptr(src, src_off, len)?;
        super::check_range("host destination", dst_off, len, dst.len_bytes())?;
        self.ctx.bind_to_thread().map_err(|e| dev_err("copy", e))?;
        // SAFETY: in bounds (checked); the caller keeps both alive and untouched until waited.
        let host = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(dst_off), len) };
        // SAFETY: as above.
        self.timed(true, len, || unsafe {
            result::memcpy_dtoh_async(host, p, self.stream.cu_stream())
        })
    }

    unsafe fn h2d(
        &self,
        src: &dyn HostStage,
        src_off: usize,
        dst: &dyn DeviceBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        let p = self.ptr(dst, dst_off, len)?;
        super::check_range("host source", src_off, len, src.len_bytes())?;
        self.ctx.bind_to_thread().map_err(|e| dev_err("copy", e))?;
        // SAFETY: in bounds (checked); the caller keeps both alive and untouched until waited.
        let host = unsafe { std::slice::from_raw_parts(src.ptr().add(src_off), len) };
        // SAFETY: as above.
        self.timed(false, len, || unsafe {
            result::memcpy_htod_async(p, host, self.stream.cu_stream())
        })
    }

    fn record(&self) -> Result<Ticket> {
        // Recorded under the lock, so tickets follow the events' order on the stream when
        // threads share the device (`wait` relies on it).
        let mut g = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let ev = self.stream.record_event(None).map_err(|e| dev_err("record", e))?;
        g.0 += 1;
        let t = g.0;
        g.1.push_back((t, Arc::new(ev)));
        Ok(Ticket(t))
    }

    fn wait(&self, t: Ticket) -> Result<()> {
        // Events complete in order: synchronise on the first one at or after `t`, drop the
        // older ones.
        let ev = {
            let mut g = self.events.lock().unwrap_or_else(|p| p.into_inner());
            while g.1.front().is_some_and(|(k, _)| *k < t.0) {
                g.1.pop_front();
            }
            match g.1.front() {
                Some((_, ev)) => ev.clone(),
                None => return Ok(()),
            }
        };
        ev.synchronize().map_err(|e| dev_err("wait", e))
    }

    fn time_copies(&self, on: bool) -> Result<()> {
        let next = if on {
            let (base, at) = self.base()?;
            Some(Timing { base, at, copies: Vec::new() })
        } else {
            None
        };
        *self.timing.lock().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(())
    }

    fn copy_spans(&self) -> Vec<CopySpan> {
        let mut g = self.timing.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = g.as_mut() else { return Vec::new() };
        let copies = std::mem::take(&mut t.copies);
        let at = |ev: &CudaEvent| -> Option<Instant> {
            // Milliseconds after the base, as f32: about 8 µs of resolution 100 s after it,
            // so the base moves forward at every read.
            let ms = t.base.elapsed_ms(ev).ok()?;
            Some(t.at + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
        };
        let spans = copies
            .iter()
            .filter_map(|(d2h, bytes, a, b)| {
                Some(CopySpan { d2h: *d2h, bytes: *bytes, start: at(a)?, end: at(b)? })
            })
            .collect();
        if let Ok((base, at)) = self.base() {
            t.base = base;
            t.at = at;
        }
        spans
    }
}
