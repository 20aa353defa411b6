//! The staging engine on the simulated device (or a GPU, `TUTTI_TEST_DEVICE=cuda`): every staged collective bit-exact against the
//! host collective on the same data, at worlds 1–4 (memory) and 3 (TCP), with segment sizes that
//! leave a short last segment and pool depths 2 and 3; the pipeline order (segment k+1's copy
//! down queued before segment k's collective); and a failing copy reported on every rank.

use std::sync::Arc;
use std::time::Duration;

use tutti_collectives::device::sim::{SimConfig, SimDevice};
use tutti_collectives::device::{Action, Device, DeviceBuffer, StagingConfig, ONE_HOST_PIECES};
use tutti_collectives::dtype::{as_bytes, as_bytes_mut};
use tutti_collectives::verify::input;
use tutti_collectives::{Comm, Element, Error, ReduceOp};
use tutti_runtime::testing::{groups, run, Kind};

/// The device under test: the simulated one, or with `TUTTI_TEST_DEVICE=cuda` GPU 0 (the GPU
/// check script runs this suite that way on a GPU machine).
fn device() -> Arc<dyn Device> {
    if std::env::var("TUTTI_TEST_DEVICE").is_ok_and(|v| v == "cuda") {
        return tutti_collectives::device::open("cuda", 0).unwrap();
    }
    Arc::new(SimDevice::new(SimConfig { latency: Duration::ZERO, ..SimConfig::default() }))
}

fn world<T: Send>(kind: Kind, n: usize, f: impl Fn(Comm) -> T + Sync) -> Vec<T> {
    run(groups(kind, n).unwrap(), |g| f(Comm::new(g)))
}

fn up<T: Element>(dev: &dyn Device, v: &[T]) -> Box<dyn DeviceBuffer> {
    let b = dev.alloc(size_of_val(v)).unwrap();
    dev.upload(as_bytes(v), &*b).unwrap();
    b
}

fn down<T: Element>(dev: &dyn Device, b: &dyn DeviceBuffer, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    dev.download(b, as_bytes_mut(&mut v)).unwrap();
    v
}

fn bits<T: Element>(v: &[T]) -> Vec<u8> {
    as_bytes(v).to_vec()
}

fn check<T: Element>(kind: Kind, n: usize, count: usize, cfg: StagingConfig) {
    world(kind, n, |c: Comm| {
        let r = c.rank();
        let dev = device();
        let st = c.staged(dev.clone(), cfg);
        let op = ReduceOp::Sum;
        // Allreduce.
        let x: Vec<T> = input(1, r, count, op);
        let mut want = x.clone();
        c.allreduce(&mut want, op).unwrap();
        let b = up(&*dev, &x);
        let s = st.allreduce::<T>(&*b, count, op).unwrap();
        assert_eq!(
            bits(&down::<T>(&*dev, &*b, count)),
            bits(&want),
            "allreduce n={n} count={count}"
        );
        let eff = st.settings().unwrap();
        assert_eq!(s.segments, count.div_ceil(eff.segment_elems(count, size_of::<T>())));
        // Allreduce out of place: the input stays.
        let (bi, bo) = (up(&*dev, &x), dev.alloc(count * size_of::<T>()).unwrap());
        st.allreduce_from::<T>(&*bi, &*bo, count, op).unwrap();
        assert_eq!(
            bits(&down::<T>(&*dev, &*bo, count)),
            bits(&down::<T>(&*dev, &*b, count)),
            "allreduce_from"
        );
        assert_eq!(bits(&down::<T>(&*dev, &*bi, count)), bits(&x), "allreduce_from input");
        // Allgather.
        let mut want = vec![T::default(); n * count];
        c.allgather(&x, &mut want).unwrap();
        let (bi, bo) = (up(&*dev, &x), dev.alloc(n * count * size_of::<T>()).unwrap());
        st.allgather::<T>(&*bi, &*bo, count).unwrap();
        assert_eq!(bits(&down::<T>(&*dev, &*bo, n * count)), bits(&want), "allgather");
        // Reduce-scatter.
        let big: Vec<T> = input(2, r, n * count, op);
        let mut want = vec![T::default(); count];
        c.reduce_scatter(&big, &mut want, op).unwrap();
        let (bi, bo) = (up(&*dev, &big), dev.alloc(count * size_of::<T>()).unwrap());
        st.reduce_scatter::<T>(&*bi, &*bo, count, op).unwrap();
        assert_eq!(bits(&down::<T>(&*dev, &*bo, count)), bits(&want), "reduce_scatter");
        // All-to-all.
        let mut want = vec![T::default(); n * count];
        c.all_to_all(&big, &mut want).unwrap();
        let (bi, bo) = (up(&*dev, &big), dev.alloc(n * count * size_of::<T>()).unwrap());
        st.all_to_all::<T>(&*bi, &*bo, count).unwrap();
        assert_eq!(bits(&down::<T>(&*dev, &*bo, n * count)), bits(&want), "all_to_all");
        // Broadcast from the last rank: the root's buffer stays, everyone gets it.
        let root = n - 1;
        let b = up(&*dev, &x);
        let mut want = x.clone();
        c.broadcast(&mut want, root).unwrap();
        st.broadcast::<T>(&*b, count, root).unwrap();
        assert_eq!(bits(&down::<T>(&*dev, &*b, count)), bits(&want), "broadcast");
        // Reduce to rank 0: the others' buffers stay as they were.
        let b = up(&*dev, &x);
        let mut want = x.clone();
        c.reduce(&mut want, op, 0).unwrap();
        st.reduce::<T>(&*b, count, op, 0).unwrap();
        let want = if r == 0 { want } else { x.clone() };
        assert_eq!(bits(&down::<T>(&*dev, &*b, count)), bits(&want), "reduce");
        // In place again, now on pooled slots that carry output stages from the calls above.
        let mut want = x.clone();
        c.allreduce(&mut want, op).unwrap();
        let b = up(&*dev, &x);
        st.allreduce::<T>(&*b, count, op).unwrap();
        assert_eq!(bits(&down::<T>(&*dev, &*b, count)), bits(&want), "allreduce on pooled slots");
    });
}

#[test]
fn staged_collectives_are_bit_exact_mem() {
    for n in 1..=4 {
        for (count, seg_bytes, depth) in
            [(0, 64, 3), (1, 64, 3), (1000, 256, 3), (1001, 400, 2), (5000, 1 << 20, 3)]
        {
            let cfg = StagingConfig { segment_bytes: seg_bytes, depth, ..StagingConfig::default() };
            check::<f32>(Kind::Mem, n, count, cfg);
        }
        check::<f64>(
            Kind::Mem,
            n,
            777,
            StagingConfig { segment_bytes: 512, depth: 3, ..StagingConfig::default() },
        );
        check::<i32>(
            Kind::Mem,
            n,
            777,
            StagingConfig { segment_bytes: 100, depth: 2, ..StagingConfig::default() },
        );
        check::<half::bf16>(
            Kind::Mem,
            n,
            300,
            StagingConfig { segment_bytes: 64, depth: 3, ..StagingConfig::default() },
        );
    }
}

#[test]
fn pieces_cut_a_call_of_one_segment_and_stay_exact() {
    let cfg = StagingConfig { pieces: 4, min_piece_bytes: 1024, ..StagingConfig::default() };
    // 4,000 bytes: four pieces of 1,000 would be under the 1,024-byte floor, so three of 334
    // elements (1,336 bytes; the last 332).
    assert_eq!(cfg.segment_elems(1000, 4), 334);
    // 20,000 bytes: four equal pieces.
    assert_eq!(cfg.segment_elems(5000, 4), 1250);
    // An odd count: four pieces, never a fifth for the remainder.
    assert_eq!(cfg.segment_elems(1_048_577, 4), 262_145);
    assert_eq!(1_048_577usize.div_ceil(262_145), 4);
    // Under the floor: one piece, the call's own size.
    assert_eq!(cfg.segment_elems(100, 4), 100);
    // Large calls keep whole segments.
    assert_eq!(cfg.segment_elems(1 << 24, 4), (4 << 20) / 4);
    assert_eq!(StagingConfig::default().segment_elems(1 << 20, 4), 1 << 20);
    assert_eq!(StagingConfig::default().segment_elems(0, 4), 1);
    for n in 1..=3 {
        check::<f32>(Kind::Mem, n, 5000, cfg);
        check::<half::bf16>(Kind::Mem, n, 3001, cfg);
    }
    world(Kind::Mem, 2, |c: Comm| {
        let dev = device();
        let st = c.staged(dev.clone(), cfg);
        let b = dev.alloc(4 * 5000).unwrap();
        let s = st.allreduce::<f32>(&*b, 5000, ReduceOp::Sum).unwrap();
        assert_eq!(s.segments, 4);
    });
}

#[test]
fn staged_allreduce_with_default_segments() {
    for n in [2, 3] {
        check::<f32>(Kind::Mem, n, 1 << 20, StagingConfig::default());
    }
}

#[test]
fn pieces_default_to_four_on_one_host_only_and_follow_an_explicit_setting() {
    world(Kind::Mem, 2, |c: Comm| {
        let dev = device();
        let b = dev.alloc(4 << 20).unwrap();
        // One host (memory transport): a 4 MiB call, one segment, runs as 4 pieces of 1 MiB; a
        // 1 MiB call as 4 of 256 KiB (the smallest piece); 256 KiB stays whole.
        let st = c.staged(dev.clone(), StagingConfig::default());
        assert_eq!(st.settings().unwrap().pieces, ONE_HOST_PIECES);
        let s = st.allreduce::<f32>(&*b, 1 << 20, ReduceOp::Sum).unwrap();
        assert_eq!(s.segments, 4, "4 MiB call");
        let s = st.allreduce::<f32>(&*b, 1 << 18, ReduceOp::Sum).unwrap();
        assert_eq!(s.segments, 4, "1 MiB call");
        let s = st.allreduce::<f32>(&*b, 1 << 16, ReduceOp::Sum).unwrap();
        assert_eq!(s.segments, 1, "256 KiB call");
        // An explicit setting is kept: 1 turns cutting off.
        let one = StagingConfig { pieces: 1, ..StagingConfig::default() };
        let st = c.staged(dev.clone(), one);
        assert_eq!(st.settings().unwrap().pieces, 1);
        let s = st.allreduce::<f32>(&*b, 1 << 20, ReduceOp::Sum).unwrap();
        assert_eq!(s.segments, 1);
        // Across hosts the default does not cut.
        let apart = c.with_hosts(&[0, 1]).unwrap();
        let st = apart.staged(dev.clone(), StagingConfig::default());
        assert_eq!(st.settings().unwrap().pieces, 1);
        let s = st.allreduce::<f32>(&*b, 1 << 20, ReduceOp::Sum).unwrap();
        assert_eq!(s.segments, 1);
    });
    // Nor for one rank, whose host collective does nothing to overlap.
    world(Kind::Mem, 1, |c: Comm| {
        let st = c.staged(device(), StagingConfig::default());
        assert_eq!(st.settings().unwrap().pieces, 1);
    });
}

#[test]
fn staged_collectives_are_bit_exact_tcp() {
    check::<f32>(
        Kind::Tcp,
        3,
        10_007,
        StagingConfig { segment_bytes: 4096, depth: 3, ..StagingConfig::default() },
    );
}

#[test]
fn the_next_copy_down_is_queued_before_the_collective() {
    world(Kind::Mem, 2, |c: Comm| {
        let dev = device();
        let st = c.staged(
            dev.clone(),
            StagingConfig { segment_bytes: 1024, depth: 3, ..StagingConfig::default() },
        );
        let b = dev.alloc(4 * 10_000).unwrap();
        let s = st.allreduce::<f32>(&*b, 10_000, ReduceOp::Sum).unwrap();
        let a = st.take_actions();
        let pos = |x: Action| a.iter().position(|y| *y == x).unwrap();
        for k in 0..s.segments {
            assert!(pos(Action::QueueDown(k)) < pos(Action::Collective(k)));
            assert!(pos(Action::Collective(k)) < pos(Action::QueueUp(k)));
            if k + 1 < s.segments {
                // Overlap: the next segment's copy down is in the queue before this segment
                // goes on the network, and this segment's copy up before the next one's.
                assert!(pos(Action::QueueDown(k + 1)) < pos(Action::Collective(k)), "{a:?}");
                assert!(pos(Action::QueueUp(k)) < pos(Action::Collective(k + 1)));
            }
        }
    });
}

#[test]
fn a_failing_copy_is_reported_on_every_rank() {
    let errs = world(Kind::Mem, 3, |c: Comm| {
        let fail_at = if c.rank() == 1 { Some(5) } else { None };
        let dev: Arc<dyn Device> =
            Arc::new(SimDevice::new(SimConfig { fail_at, ..SimConfig::default() }));
        let st = c.staged(
            dev.clone(),
            StagingConfig { segment_bytes: 256, depth: 2, ..StagingConfig::default() },
        );
        let b = dev.alloc(4 * 4000).unwrap();
        let t = std::time::Instant::now();
        let e = st.allreduce::<f32>(&*b, 4000, ReduceOp::Sum).unwrap_err();
        (c.rank(), e, t.elapsed())
    });
    for (r, e, took) in errs {
        let msg = e.to_string();
        if r == 1 {
            assert!(matches!(e, Error::Device { rank: 1, op: "allreduce", .. }), "{msg}");
            assert!(msg.contains("simulated copy failure at copy #5"), "{msg}");
        } else {
            // The others learn it from rank 1's abort, naming it, well before any timeout.
            assert!(
                msg.contains("rank 1") && msg.contains("device error in allreduce"),
                "rank {r}: {msg}"
            );
        }
        assert!(took < Duration::from_secs(5), "rank {r} took {took:?}");
    }
}

#[test]
fn cuda_requested_without_a_gpu_is_a_typed_error_not_a_panic() {
    match tutti_collectives::device::open("cuda", 0) {
        // A GPU machine (built with `cuda`, driver present): the device must work.
        Ok(dev) => {
            let b = dev.alloc(16).unwrap();
            dev.upload(&[7u8; 16], &*b).unwrap();
            let mut back = [0u8; 16];
            dev.download(&*b, &mut back).unwrap();
            assert_eq!(back, [7u8; 16]);
        }
        Err(Error::CudaUnavailable { detail, .. }) => {
            if cfg!(feature = "cuda") {
                assert!(
                    detail.contains("libcuda") || detail.contains("cannot open GPU"),
                    "{detail}"
                );
            } else {
                assert!(detail.contains("built without the `cuda` feature"), "{detail}");
            }
        }
        Err(e) => panic!("expected CudaUnavailable, got {e}"),
    }
    let e =
        tutti_collectives::device::open("tpu", 0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("unknown device \"tpu\""), "{e}");
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_requested_without_the_library_is_a_typed_error() {
    use tutti_collectives::device::nccl;
    match nccl::require_library(3) {
        Ok(()) => assert!(nccl::library_present()),
        Err(Error::CudaUnavailable { rank, detail }) => {
            assert_eq!(rank, 3);
            assert!(detail.contains("NCCL library") && detail.contains("libnccl.so"), "{detail}");
        }
        Err(e) => panic!("expected CudaUnavailable, got {e}"),
    }
}

/// A simulated device that counts the staging buffers it has handed out and how many are alive.
struct Counting {
    sim: SimDevice,
    made: std::sync::atomic::AtomicUsize,
    largest: std::sync::atomic::AtomicUsize,
    live: Arc<std::sync::atomic::AtomicUsize>,
}

struct CountedStage(
    Box<dyn tutti_collectives::device::HostStage>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl tutti_collectives::device::HostStage for CountedStage {
    fn len_bytes(&self) -> usize {
        self.0.len_bytes()
    }
    fn ptr(&self) -> *mut u8 {
        self.0.ptr()
    }
}

impl Drop for CountedStage {
    fn drop(&mut self) {
        self.1.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Device for Counting {
    fn name(&self) -> String {
        self.sim.name()
    }
    fn alloc(&self, bytes: usize) -> tutti_collectives::Result<Box<dyn DeviceBuffer>> {
        self.sim.alloc(bytes)
    }
    fn alloc_stage(
        &self,
        bytes: usize,
    ) -> tutti_collectives::Result<Box<dyn tutti_collectives::device::HostStage>> {
        use std::sync::atomic::Ordering::Relaxed;
        self.made.fetch_add(1, Relaxed);
        self.largest.fetch_max(bytes, Relaxed);
        self.live.fetch_add(1, Relaxed);
        Ok(Box::new(CountedStage(self.sim.alloc_stage(bytes)?, self.live.clone())))
    }
    fn upload(&self, src: &[u8], dst: &dyn DeviceBuffer) -> tutti_collectives::Result<()> {
        self.sim.upload(src, dst)
    }
    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> tutti_collectives::Result<()> {
        self.sim.download(src, dst)
    }
    unsafe fn d2h(
        &self,
        src: &dyn DeviceBuffer,
        src_off: usize,
        dst: &dyn tutti_collectives::device::HostStage,
        dst_off: usize,
        len: usize,
    ) -> tutti_collectives::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.d2h(src, src_off, dst, dst_off, len) }
    }
    unsafe fn h2d(
        &self,
        src: &dyn tutti_collectives::device::HostStage,
        src_off: usize,
        dst: &dyn DeviceBuffer,
        dst_off: usize,
        len: usize,
    ) -> tutti_collectives::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.sim.h2d(src, src_off, dst, dst_off, len) }
    }
    fn record(&self) -> tutti_collectives::Result<tutti_collectives::device::Ticket> {
        self.sim.record()
    }
    fn wait(&self, t: tutti_collectives::device::Ticket) -> tutti_collectives::Result<()> {
        self.sim.wait(t)
    }
}

#[test]
fn staging_slots_fit_the_call_and_the_pool_stays_bounded() {
    use std::sync::atomic::Ordering::Relaxed;
    world(Kind::Mem, 2, |c: Comm| {
        let dev = Arc::new(Counting {
            sim: SimDevice::new(SimConfig { latency: Duration::ZERO, ..SimConfig::default() }),
            made: 0.into(),
            largest: 0.into(),
            live: Arc::new(0.into()),
        });
        let cfg = StagingConfig { segment_bytes: 1 << 20, depth: 3, ..StagingConfig::default() };
        let st = c.staged(dev.clone(), cfg);
        // A call far smaller than a segment gets a slot of its own size, not a segment's.
        let b = dev.alloc(40).unwrap();
        st.allreduce::<f32>(&*b, 10, ReduceOp::Sum).unwrap();
        assert_eq!(dev.largest.load(Relaxed), 40);
        // The same call again takes the pooled slot.
        let made = dev.made.load(Relaxed);
        st.allreduce::<f32>(&*b, 10, ReduceOp::Sum).unwrap();
        assert_eq!(dev.made.load(Relaxed), made);
        // Ever larger calls (each needing new slots) leave at most two calls' worth alive.
        for count in [100, 1_000, 10_000, 100_000, 1 << 20, 3 << 20] {
            let b = dev.alloc(count * 4).unwrap();
            st.allreduce::<f32>(&*b, count, ReduceOp::Sum).unwrap();
            let live = dev.live.load(Relaxed);
            assert!(live <= 2 * cfg.depth, "{live} stages alive after a call of {count}");
        }
        // Slots never exceed a segment.
        assert_eq!(dev.largest.load(Relaxed), 1 << 20);
    });
}
