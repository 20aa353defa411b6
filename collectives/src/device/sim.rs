//! A simulated device: "device" memory is host memory, and a copy thread executes the queued
//! copies in order, each taking `latency + bytes / bandwidth` — so the staging pipeline's
//! ordering, overlap and error paths run (and are tested) on machines without a GPU.

use std::any::Any;
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{check_range as bounds, CopySpan, Device, DeviceBuffer, HostStage, Ticket};
use crate::error::{Error, Result};

/// Settings of a [`SimDevice`].
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    /// Fixed cost of every copy. Default 10 µs (a PCIe copy's launch and DMA set-up).
    pub latency: Duration,
    /// Copy bandwidth in bytes per second. Default 12 GB/s (PCIe 4.0 x16, pinned).
    pub bandwidth: f64,
    /// Fail the copy with this index (0-based) and every later one (error-path tests).
    pub fail_at: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { latency: Duration::from_micros(10), bandwidth: 12e9, fail_at: None }
    }
}

/// Memory of the simulated device (8-byte aligned words, so any element type fits). Each word
/// is its own `UnsafeCell`, so the copy queue and the staging threads write through raw
/// pointers without ever forming a `&mut` to the memory (which several threads at once would
/// make undefined behaviour, even on disjoint ranges).
struct Mem {
    words: Box<[UnsafeCell<u64>]>,
    len: usize,
}

// SAFETY: access goes through the device's copy queue, whose contract (the `Device::d2h` and
// `h2d` safety sections) forbids concurrent access to the same range.
unsafe impl Sync for Mem {}

impl Mem {
    fn new(len: usize) -> Mem {
        let words = (0..len.div_ceil(8).max(2)).map(|_| UnsafeCell::new(0u64)).collect();
        Mem { words, len }
    }

    fn ptr(&self) -> *mut u8 {
        // A pointer to the first cell, valid for the whole slice, that writes may go through.
        UnsafeCell::raw_get(self.words.as_ptr()).cast()
    }
}

/// A buffer on the simulated device.
pub struct SimBuffer(Mem);

impl DeviceBuffer for SimBuffer {
    fn len_bytes(&self) -> usize {
        self.0.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A host staging buffer of the simulated device.
pub struct SimStage(Mem);

impl HostStage for SimStage {
    fn len_bytes(&self) -> usize {
        self.0.len
    }
    fn ptr(&self) -> *mut u8 {
        self.0.ptr()
    }
}

struct Copy {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    d2h: bool,
}

// SAFETY: the pointers stay valid until the copy is waited for (the `Device` safety contract).
unsafe impl Send for Copy {}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Copy>,
    submitted: u64,
    done: u64,
    failed: Option<String>,
    shutdown: bool,
}

struct Inner {
    cfg: SimConfig,
    q: Mutex<Queue>,
    cv: Condvar,
    spans: Mutex<Vec<CopySpan>>,
}

/// The simulated device. Cloning an `Arc` of it shares the copy queue (one "stream").
pub struct SimDevice {
    inner: Arc<Inner>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice").field("cfg", &self.inner.cfg).finish_non_exhaustive()
    }
}

/// How long a copy of `bytes` takes at `bandwidth` bytes/s after `latency`.
fn copy_time(bytes: usize, latency: Duration, bandwidth: f64) -> Duration {
    latency + Duration::from_secs_f64(bytes as f64 / bandwidth.max(1.0))
}

/// Sleep for the modelled copy time: a DMA engine does not take a CPU, so neither does the
/// model (spinning here stole a core from the ranks on a 2-core machine). Sleeps overshoot by
/// tens of µs, which makes the model a little pessimistic for small copies.
fn wait_for(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

impl SimDevice {
    /// A simulated device with its copy thread.
    pub fn new(cfg: SimConfig) -> SimDevice {
        let inner = Arc::new(Inner {
            cfg,
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            spans: Mutex::new(Vec::new()),
        });
        let i2 = inner.clone();
        let thread = std::thread::Builder::new()
            .name("tutti-simdev".into())
            .spawn(move || copy_loop(&i2))
            .ok();
        SimDevice { inner, thread }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.inner.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn queue(&self, c: Copy) -> Result<()> {
        let mut q = self.lock();
        if self.thread.is_none() {
            return Err(Error::Device {
                rank: 0,
                op: "copy",
                detail: "the simulated copy thread could not start".into(),
            });
        }
        q.pending.push_back(c);
        q.submitted += 1;
        self.inner.cv.notify_all();
        Ok(())
    }

    fn sim<'a, T: 'static>(&self, b: &'a dyn Any, what: &str) -> Result<&'a T> {
        b.downcast_ref::<T>().ok_or_else(|| Error::Device {
            rank: 0,
            op: "copy",
            detail: format!("{what} was not allocated by the simulated device"),
        })
    }
}

fn copy_loop(inner: &Inner) {
    let mut index = 0u64;
    loop {
        let c = {
            let mut q = inner.q.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(c) = q.pending.pop_front() {
                    break c;
                }
                if q.shutdown {
                    return;
                }
                q = inner.cv.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let fail = inner.cfg.fail_at.is_some_and(|f| index >= f);
        let start = Instant::now();
        if !fail {
            wait_for(copy_time(c.len, inner.cfg.latency, inner.cfg.bandwidth));
            // SAFETY: both ranges are valid and exclusively ours until the copy is waited for
            // (the `Device::d2h`/`h2d` contract), and in bounds (checked when queued).
            unsafe { std::ptr::copy_nonoverlapping(c.src, c.dst, c.len) };
            inner.spans.lock().unwrap_or_else(|p| p.into_inner()).push(CopySpan {
                d2h: c.d2h,
                bytes: c.len,
                start,
                end: Instant::now(),
            });
        }
        index += 1;
        let mut q = inner.q.lock().unwrap_or_else(|p| p.into_inner());
        if fail && q.failed.is_none() {
            q.failed = Some(format!("simulated copy failure at copy #{}", index - 1));
        }
        q.done += 1;
        inner.cv.notify_all();
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        self.lock().shutdown = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Device for SimDevice {
    fn name(&self) -> String {
        "sim".into()
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>> {
        Ok(Box::new(SimBuffer(Mem::new(bytes))))
    }

    fn alloc_stage(&self, bytes: usize) -> Result<Box<dyn HostStage>> {
        Ok(Box::new(SimStage(Mem::new(bytes))))
    }

    fn upload(&self, src: &[u8], dst: &dyn DeviceBuffer) -> Result<()> {
        let d = self.sim::<SimBuffer>(dst.as_any(), "the destination")?;
        bounds("upload", 0, src.len(), d.0.len)?;
        let t = self.record()?;
        self.wait(t)?;
        // SAFETY: in bounds; the queue is drained, so no copy touches the buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), d.0.ptr(), src.len()) };
        Ok(())
    }

    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        let s = self.sim::<SimBuffer>(src.as_any(), "the source")?;
        bounds("download", 0, dst.len(), s.0.len)?;
        let t = self.record()?;
        self.wait(t)?;
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(s.0.ptr(), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn d2h(
        &self,
        src: &dyn DeviceBuffer,
        src_off: usize,
        dst: &dyn HostStage,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        let s = self.sim::<SimBuffer>(src.as_any(), "the source")?;
        bounds("device source", src_off, len, s.0.len)?;
        bounds("host destination", dst_off, len, dst.len_bytes())?;
        // SAFETY: offsets checked against both allocations just above.
        let (sp, dp) = unsafe { (s.0.ptr().add(src_off), dst.ptr().add(dst_off)) };
        self.queue(Copy { src: sp, dst: dp, len, d2h: true })
    }

    unsafe fn h2d(
        &self,
        src: &dyn HostStage,
        src_off: usize,
        dst: &dyn DeviceBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        let d = self.sim::<SimBuffer>(dst.as_any(), "the destination")?;
        bounds("host source", src_off, len, src.len_bytes())?;
        bounds("device destination", dst_off, len, d.0.len)?;
        // SAFETY: offsets checked against both allocations just above.
        let (sp, dp) = unsafe { (src.ptr().add(src_off), d.0.ptr().add(dst_off)) };
        self.queue(Copy { src: sp, dst: dp, len, d2h: false })
    }

    fn record(&self) -> Result<Ticket> {
        Ok(Ticket(self.lock().submitted))
    }

    fn wait(&self, t: Ticket) -> Result<()> {
        let mut q = self.lock();
        while q.done < t.0 {
            q = self.inner.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        match &q.failed {
            Some(f) => Err(Error::Device { rank: 0, op: "copy", detail: f.clone() }),
            None => Ok(()),
        }
    }

    fn copy_spans(&self) -> Vec<CopySpan> {
        std::mem::take(&mut *self.inner.spans.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
