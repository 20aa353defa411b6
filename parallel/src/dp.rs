//! Data parallel: replicated parameters, gradients averaged in buckets, weighted by samples.

use std::ops::Range;

use std::cell::RefCell;

use candle_core::{backprop::GradStore, CpuStorage, DType, InplaceOp1, Tensor, Var};
use tutti_collectives::{Comm, Lent, ReduceOp, Stats};

use crate::error::{Error, Result};
use crate::ops;

mod overlap;
pub use overlap::{Stage, StageFn};

/// Bucket sizes of [`DataParallel`].
#[derive(Clone, Copy, Debug)]
pub struct DpConfig {
    /// Bytes of the first bucket (the last parameters, whose gradients are ready first in a
    /// backward pass). Default 1 MiB, as PyTorch DDP.
    pub first_bucket_bytes: usize,
    /// Bytes of every later bucket. Default 25 MiB, as PyTorch DDP.
    pub bucket_bytes: usize,
}

impl Default for DpConfig {
    fn default() -> Self {
        DpConfig { first_bucket_bytes: 1 << 20, bucket_bytes: 25 << 20 }
    }
}

/// What [`DataParallel::sync`] returns.
#[derive(Debug)]
pub struct Synced {
    /// The averaged gradients, keyed by the parameters (feed it to a candle optimizer's `step`).
    pub grads: GradStore,
    /// The global mean loss: `sum_r sum_mb n_mb * loss_mb / N` over every rank's micro-batches.
    pub loss: f64,
    /// `N`: the samples of this step over all ranks.
    pub samples: u64,
    /// Buckets reduced.
    pub buckets: usize,
    /// Whether the large gradients were reduced one by one, each scaled by the ring, rather
    /// than packed into the buckets with the small ones (every rank had one factor for every
    /// gradient, as with even shards of one micro-batch each).
    pub direct: bool,
    /// Whether, with [`Synced::direct`], this rank's large gradients were all reduced in
    /// candle's own gradient tensors (each alone in its storage): `grads` then holds those
    /// tensors for them. A large gradient that shares its storage is copied to its place in the
    /// bucket and reduced there, and comes back as a view of the bucket.
    pub in_place: bool,
}

struct Accum {
    store: GradStore,
    /// Per parameter: the gradient so far and the factor it is still to be multiplied by (the
    /// samples of a lone micro-batch, applied while packing; 1 once micro-batches were summed).
    grads: Vec<Option<(Tensor, f64)>>,
    samples: u64,
    loss_sum: f64,
}

/// Data-parallel training over a group: every rank holds all parameters, computes gradients on
/// its own samples, and [`DataParallel::sync`] combines them once per optimizer step.
///
/// The combination is weighted by samples: with `n_r` samples on rank `r` (over its
/// micro-batches) and `N = sum n_r`, the gradient is `sum_r n_r * grad_r / N`: the gradient of
/// the mean loss over the whole global batch even when it does not divide by the world (a plain
/// average of the ranks' gradients would weight the smaller shards too much).
///
/// Gradients travel in buckets (first [`DpConfig::first_bucket_bytes`], then
/// [`DpConfig::bucket_bytes`]), taken from the last parameter backwards as in PyTorch DDP. Each
/// bucket is one flat tensor that lives as long as the `DataParallel` and is reused every step:
/// [`DataParallel::sync`] packs the gradients into it (scaled, in one pass), lends it to a
/// non-blocking allreduce ([`Comm::scope`]: no copy in or out) and packs the next bucket while
/// it is on the wire. The averaged gradients it returns are views of these buckets, as PyTorch's
/// `gradient_as_bucket_view`: the next `sync` overwrites them, so copy any you want to keep.
/// Large gradients (256 KiB and more) are not packed when every rank weighs them alike: each is
/// reduced on its own, in place in candle's gradient tensor when it is alone in its storage
/// (it then comes back as that tensor, [`Synced::in_place`]), else in its place in the bucket.
///
/// # Collective contract
/// Every rank constructs it with the same parameter shapes and calls [`DataParallel::sync`]
/// the same number of times (any number of [`DataParallel::backward`] calls in between).
pub struct DataParallel {
    comm: Comm,
    vars: Vec<Var>,
    buckets: Vec<Range<usize>>,
    /// Where each bucket's gradients live, reused every step.
    bufs: Vec<Bucket>,
    acc: Option<Accum>,
}

/// Gradients of at least this many bytes are reduced on their own, in candle's gradient tensor
/// where it is alone in its storage, when every rank weighs them alike; smaller ones are packed
/// together first.
const DIRECT_BYTES: usize = 256 << 10;

/// One bucket's memory: a flat CPU tensor holding its parameters' gradients, the large ones
/// first in parameter order, then the small ones packed together.
struct Bucket {
    /// Element offset of each parameter of the bucket (in the bucket's parameter order).
    offs: Vec<usize>,
    /// Element count of each parameter.
    lens: Vec<usize>,
    /// Whether each parameter is large ([`DIRECT_BYTES`]).
    large: Vec<bool>,
    /// Where the small parameters start.
    small: usize,
    flat: Tensor,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("params", &self.vars.len())
            .field("buckets", &self.buckets)
            .finish_non_exhaustive()
    }
}

/// A fingerprint of a tensor's shape, dtype and (with `values`) bytes, for cross-rank checks.
fn fingerprint(t: &Tensor, values: bool) -> Result<i64> {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for d in t.dims() {
        h.write_usize(*d);
    }
    h.write(t.dtype().as_str().as_bytes());
    if values {
        let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        for x in v {
            h.write_u64(x.to_bits());
        }
    }
    // Keep it positive so min/max reductions compare plainly.
    Ok((h.finish() >> 1) as i64)
}

impl DataParallel {
    /// Wrap the parameters `vars` (in the model's forward order) for data-parallel training:
    /// checks that every rank has the same parameter shapes and dtypes and broadcasts the values
    /// of rank 0 to the others.
    ///
    /// # Errors
    /// [`Error::ReplicaMismatch`] when shapes or dtypes differ between ranks; collective errors.
    pub fn new(comm: Comm, vars: Vec<Var>, cfg: DpConfig) -> Result<DataParallel> {
        let buckets = Self::plan(&vars, cfg);
        let bufs = buckets
            .iter()
            .map(|b| {
                let dtype = vars[b.start].dtype();
                let large: Vec<bool> = b
                    .clone()
                    .map(|i| vars[i].elem_count() * dtype.size_in_bytes() >= DIRECT_BYTES)
                    .collect();
                let mut offs = vec![0; b.len()];
                let mut off = 0;
                for want in [true, false] {
                    for (j, i) in b.clone().enumerate() {
                        if large[j] == want {
                            offs[j] = off;
                            off += vars[i].elem_count();
                        }
                    }
                }
                let small = b
                    .clone()
                    .zip(&large)
                    .filter(|(_, l)| **l)
                    .map(|(i, _)| vars[i].elem_count())
                    .sum();
                let lens = b.clone().map(|i| vars[i].elem_count()).collect();
                Ok(Bucket { offs, lens, large, small, flat: warm_zeros(dtype, off)? })
            })
            .collect::<Result<Vec<_>>>()?;
        let dp = DataParallel { buckets, bufs, comm, vars, acc: None };
        dp.compare(false)?;
        for v in &dp.vars {
            let t = ops::broadcast(v.as_tensor(), &dp.comm, 0)?;
            v.set(&t)?;
        }
        Ok(dp)
    }

    /// Buckets of consecutive parameters of one dtype, from the last parameter backwards.
    fn plan(vars: &[Var], cfg: DpConfig) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut end = vars.len();
        let mut cap = cfg.first_bucket_bytes.max(1);
        while end > 0 {
            let dtype = vars[end - 1].dtype();
            let mut start = end;
            let mut bytes = 0;
            while start > 0 && vars[start - 1].dtype() == dtype && (bytes < cap || start == end) {
                bytes += vars[start - 1].elem_count() * dtype.size_in_bytes();
                start -= 1;
            }
            out.push(start..end);
            end = start;
            cap = cfg.bucket_bytes.max(1);
        }
        out
    }

    /// Go on over another communicator (the survivors' world after
    /// [`Comm::shrink_with`]), keeping the parameters and buckets; gradients accumulated and
    /// not yet synced are dropped. Checks that every rank holds the same parameter values,
    /// bit for bit: nothing is broadcast, so replicas that diverged are an error, not hidden.
    ///
    /// # Collective contract
    /// Every rank of `comm` calls it, with the same parameters.
    ///
    /// # Errors
    /// [`Error::ReplicaMismatch`] naming the first parameter that differs; collective errors
    /// (the new world lost a rank too).
    pub fn rejoin(&mut self, comm: Comm) -> Result<()> {
        self.comm = comm;
        self.acc = None;
        self.compare(true)
    }

    /// Go on over a grown world (after [`Comm::grow`](tutti_collectives::Comm::grow)): the
    /// same steps as [`DataParallel::new`] on the newcomers — shapes checked, every
    /// parameter broadcast from rank 0 — so the newcomers, which construct theirs with
    /// `new`, receive the parameters.
    ///
    /// # Collective contract
    /// The members call it on the grown communicator while the newcomers call
    /// [`DataParallel::new`] on theirs, with the same parameter shapes.
    ///
    /// # Errors
    /// As [`DataParallel::new`].
    pub fn adopt(&mut self, comm: Comm) -> Result<()> {
        self.comm = comm;
        self.acc = None;
        self.compare(false)?;
        for v in &self.vars {
            let t = ops::broadcast(v.as_tensor(), &self.comm, 0)?;
            v.set(&t)?;
        }
        Ok(())
    }

    /// Drop the gradients accumulated since the last [`DataParallel::sync`] (a step being
    /// redone after a failure starts from nothing).
    pub fn clear(&mut self) {
        self.acc = None;
    }

    /// Check that every rank holds the same parameter values (bit for bit).
    ///
    /// # Errors
    /// [`Error::ReplicaMismatch`] naming the first parameter that differs; collective errors.
    pub fn check_replicas(&self) -> Result<()> {
        self.compare(true)
    }

    fn compare(&self, values: bool) -> Result<()> {
        let mut fp = vec![self.vars.len() as i64];
        for v in &self.vars {
            fp.push(fingerprint(v.as_tensor(), values)?);
        }
        // The count first, so ranks with different parameter lists fail the same way.
        let mut count = [fp[0], -fp[0]];
        self.comm.allreduce(&mut count, ReduceOp::Max)?;
        if count[0] != -count[1] {
            return Err(Error::ReplicaMismatch {
                rank: self.comm.rank(),
                name: "<parameter list>".into(),
                detail: format!(
                    "this rank has {} parameters, others between {} and {}",
                    self.vars.len(),
                    -count[1],
                    count[0]
                ),
            });
        }
        let mut hi = fp.clone();
        let mut lo: Vec<i64> = fp.iter().map(|x| -x).collect();
        self.comm.allreduce(&mut hi, ReduceOp::Max)?;
        self.comm.allreduce(&mut lo, ReduceOp::Max)?;
        if let Some(i) = (1..fp.len()).find(|&i| hi[i] != -lo[i]) {
            let v = &self.vars[i - 1];
            return Err(Error::ReplicaMismatch {
                rank: self.comm.rank(),
                name: format!("#{} {:?} {:?}", i - 1, v.dims(), v.dtype()),
                detail: if values {
                    "the values differ".into()
                } else {
                    "the shape or dtype differs".into()
                },
            });
        }
        Ok(())
    }

    /// This rank's factor if every gradient has the same one and every large gradient lies
    /// contiguous in CPU memory; NaN otherwise.
    fn direct_factor(&self, acc: &Accum) -> f64 {
        let mut f = None;
        for (b, buf) in self.buckets.iter().zip(&self.bufs) {
            for (i, large) in b.clone().zip(&buf.large) {
                let Some((g, k)) = &acc.grads[i] else { return f64::NAN };
                if *f.get_or_insert(*k) != *k || (*large && contiguous_cpu(g).is_none()) {
                    return f64::NAN;
                }
            }
        }
        f.unwrap_or(f64::NAN)
    }

    /// The parameters, in the order given to [`DataParallel::new`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The communicator of the data-parallel group.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The buckets, as ranges of parameter indices, in the order they are reduced.
    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// Backward of one micro-batch: `loss` is the mean loss over its `samples` samples. The
    /// gradients are accumulated locally (weighted by `samples`); nothing is sent.
    ///
    /// # Errors
    /// Candle errors of the backward pass (and collective errors of autograd communication ops
    /// inside the model).
    pub fn backward(&mut self, loss: &Tensor, samples: usize) -> Result<()> {
        let store = loss.backward()?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let w = samples as f64;
        let grads: Vec<Option<(Tensor, f64)>> =
            self.vars.iter().map(|v| store.get(v.as_tensor()).map(|g| (g.clone(), w))).collect();
        match &mut self.acc {
            None => {
                self.acc =
                    Some(Accum { store, grads, samples: samples as u64, loss_sum: value * w })
            }
            Some(acc) => {
                for (a, g) in acc.grads.iter_mut().zip(grads) {
                    *a = match (a.take(), g) {
                        (Some((a, fa)), Some((g, fg))) => {
                            Some(((a.affine(fa, 0.0)? + g.affine(fg, 0.0)?)?, 1.0))
                        }
                        (a, g) => a.or(g),
                    };
                }
                acc.samples += samples as u64;
                acc.loss_sum += value * w;
            }
        }
        Ok(())
    }

    /// Combine the accumulated gradients of every rank (one allreduce per bucket, all started
    /// before the first is waited for) and return them for the optimizer. A rank with no samples
    /// this step (an empty shard) still calls it, and contributes nothing.
    ///
    /// # Errors
    /// Collective errors (a dead or diverging rank is named); [`Error::Shape`] when no rank had
    /// any sample; candle errors.
    pub fn sync(&mut self) -> Result<Synced> {
        let acc = match self.acc.take() {
            Some(a) => a,
            None => {
                // No backward on this rank: contribute zeros so the others are not blocked.
                let zero = Tensor::zeros((), DType::F32, &candle_core::Device::Cpu)?;
                let store = zero.backward()?;
                Accum { store, grads: vec![None; self.vars.len()], samples: 0, loss_sum: 0.0 }
            }
        };
        // One tiny allreduce first: the global sample count, by which each rank divides its
        // contribution while packing (no pass over the reduced buckets), and whether every rank
        // can reduce its large gradients straight from candle's tensors — the same factor on
        // every rank for every gradient ((Σf)² = n·Σf² holds only for equal f), each large one
        // contiguous in CPU memory.
        let f = self.direct_factor(&acc);
        let mut sv = [acc.samples as f64, acc.loss_sum, f, f * f];
        self.comm.allreduce(&mut sv, ReduceOp::Sum)?;
        let n = sv[0];
        if n == 0.0 {
            return Err(Error::Shape {
                rank: self.comm.rank(),
                layer: "DataParallel::sync",
                detail: "no rank had any sample this step".into(),
            });
        }
        let direct = sv[2].is_finite() && sv[2] * sv[2] == self.comm.size() as f64 * sv[3];
        // The overlapped exchange with the backward pass already over: every bucket ready.
        let factor = sv[2] / self.comm.size() as f64;
        let mut bw = overlap::Backward::settled(
            &self.vars,
            self.comm.rank(),
            acc.grads,
            acc.store,
            direct,
            factor,
        );
        let ready = vec![0; self.buckets.len()];
        overlap::overlap(&self.comm, &self.bufs, &self.buckets, &ready, &mut bw, n)?;
        self.results(bw, &sv)
    }
}

impl DataParallel {
    /// What a step's exchange returns, from its gradients and its first allreduce's sums
    /// (`sv[0]` the samples, `sv[1]` the weighted loss).
    fn synced(&self, grads: GradStore, sv: &[f64], direct: bool, in_place: bool) -> Synced {
        Synced {
            grads,
            loss: sv[1] / sv[0],
            samples: sv[0] as u64,
            buckets: self.buckets.len(),
            direct,
            in_place,
        }
    }

    /// Put every parameter's averaged gradient, a view of its bucket (moved to the parameter's
    /// device), into `store`.
    fn insert_views(&self, store: &mut GradStore) -> Result<()> {
        for (b, buf) in self.buckets.iter().zip(&self.bufs) {
            for (i, off) in b.clone().zip(&buf.offs) {
                let v = &self.vars[i];
                let mut g = buf.flat.narrow(0, *off, v.elem_count())?.reshape(v.dims())?;
                if !v.device().same_device(g.device()) {
                    g = g.to_device(v.device())?;
                }
                store.insert(v.as_tensor(), g);
            }
        }
        Ok(())
    }
}

/// One parameter of a bucket: its gradient with the factor to multiply it by (none: zeros).
type Part<'a> = Option<(&'a Tensor, f64)>;

/// The element range of `t` in its CPU storage, when it is contiguous there.
fn contiguous_cpu(t: &Tensor) -> Option<(usize, usize)> {
    let (st, layout) = t.storage_and_layout();
    match &*st {
        candle_core::Storage::Cpu(_) => layout.contiguous_offsets(),
        _ => None,
    }
}

/// The byte range of `t`'s whole CPU storage (float storages only: a gradient's storage is one
/// of those, and storages of other kinds cannot be the same storage).
fn cpu_span(t: &Tensor) -> Option<(usize, usize)> {
    fn span<T>(v: &[T]) -> (usize, usize) {
        let a = v.as_ptr() as usize;
        (a, a + size_of_val(v))
    }
    let (st, _) = t.storage_and_layout();
    match &*st {
        candle_core::Storage::Cpu(cs) => match cs {
            CpuStorage::F32(v) => Some(span(v)),
            CpuStorage::F64(v) => Some(span(v)),
            CpuStorage::BF16(v) => Some(span(v)),
            CpuStorage::F16(v) => Some(span(v)),
            _ => None,
        },
        _ => None,
    }
}

/// Run `f` with the tensors `ts` (contiguous CPU tensors of `T`) lent mutably, in order, after
/// `lent`: each one's storage is locked for writing (candle's in-place op) while `f` runs.
fn with_all_mut<T: BucketElem, R>(
    rank: usize,
    ts: &[&Tensor],
    lent: Vec<&mut [T]>,
    f: impl FnOnce(Vec<&mut [T]>) -> Result<R>,
) -> Result<R> {
    let Some((t, rest)) = ts.split_first() else { return f(lent) };
    with_storage_mut(t, move |s, layout| {
        let mut lent = lent;
        let range = layout.contiguous_offsets();
        match (T::slice_mut(s), range) {
            (Some(v), Some((a, e))) => lent.push(&mut v[a..e]),
            _ => {
                return Err(Error::Shape {
                    rank,
                    layer: "DataParallel",
                    detail: "a large gradient changed dtype or layout during sync".into(),
                })
            }
        }
        with_all_mut(rank, rest, lent, f)
    })
}

/// A float dtype a bucket can hold.
trait BucketElem: candle_core::WithDType + tutti_collectives::Element {
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
    fn scaled(x: Self, f: f64) -> Self;
}

macro_rules! bucket_elem {
    ($t:ty, $v:ident, $x:ident, $f:ident, $e:expr) => {
        impl BucketElem for $t {
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            #[inline(always)]
            fn scaled($x: Self, $f: f64) -> Self {
                $e
            }
        }
    };
}
bucket_elem!(f32, F32, x, f, x * f as f32);
bucket_elem!(f64, F64, x, f, x * f);
bucket_elem!(half::bf16, BF16, x, f, half::bf16::from_f64(x.to_f64() * f));
bucket_elem!(half::f16, F16, x, f, half::f16::from_f64(x.to_f64() * f));

/// Run `f` on the storage of the CPU tensor `t`, mutably (candle's in-place custom op is the
/// one door to it); `f`'s own result comes back.
fn with_storage_mut<R>(
    t: &Tensor,
    f: impl FnOnce(&mut CpuStorage, &candle_core::Layout) -> Result<R>,
) -> Result<R> {
    struct Op<F, R> {
        f: RefCell<Option<F>>,
        out: RefCell<Option<Result<R>>>,
    }
    impl<F: FnOnce(&mut CpuStorage, &candle_core::Layout) -> Result<R>, R> InplaceOp1 for Op<F, R> {
        fn name(&self) -> &'static str {
            "tutti-dp-bucket"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &candle_core::Layout) -> candle_core::Result<()> {
            if let Some(f) = self.f.borrow_mut().take() {
                *self.out.borrow_mut() = Some(f(s, l));
            }
            Ok(())
        }
    }
    let op = Op { f: RefCell::new(Some(f)), out: RefCell::new(None) };
    t.inplace_op1(&op)?;
    op.out.into_inner().unwrap_or_else(|| {
        Err(candle_core::Error::Msg("a DataParallel bucket is not in CPU memory".into()).into())
    })
}

/// Wait for every handle, even after one failed (each lends a buffer until it ends), then
/// give the first error, or `later`'s result.
fn wait_all(hs: Vec<Lent<'_, Stats>>, later: Result<()>) -> Result<()> {
    let mut first = Ok(());
    for h in hs {
        if let (Err(e), Ok(())) = (h.wait(), &first) {
            first = Err(e);
        }
    }
    first?;
    later
}

/// Write each gradient (zeros for `None`) at its element offset in `dst` (with its length),
/// multiplied by its factor: one pass, straight from each tensor's storage when it is
/// contiguous.
fn pack<T: BucketElem>(dst: &mut [T], parts: &[(Part<'_>, usize, usize)]) -> Result<()> {
    for (t, off, n) in parts {
        let out = &mut dst[*off..off + n];
        match t {
            Some((t, f)) => {
                let (st, layout) = t.storage_and_layout();
                match (&*st, layout.contiguous_offsets()) {
                    (candle_core::Storage::Cpu(cs), Some((a, b))) => {
                        for (o, x) in out.iter_mut().zip(&cs.as_slice::<T>()?[a..b]) {
                            *o = T::scaled(*x, *f);
                        }
                    }
                    _ => {
                        drop(st);
                        let v = t
                            .flatten_all()?
                            .to_device(&candle_core::Device::Cpu)?
                            .to_vec1::<T>()?;
                        for (o, x) in out.iter_mut().zip(v) {
                            *o = T::scaled(x, *f);
                        }
                    }
                }
            }
            None => out.fill(T::zero()),
        }
    }
    Ok(())
}

/// A flat CPU tensor of `len` zeros of `dtype`, its pages already touched (and, when large,
/// backed by huge pages where the kernel allows), so the first step does not pay for them.
fn warm_zeros(dtype: DType, len: usize) -> Result<Tensor> {
    fn make<T: candle_core::WithDType>(len: usize) -> Result<Tensor> {
        let mut v = huge_vec::<T>(len);
        v.resize(len, T::zero());
        Ok(Tensor::from_vec(v, len, &candle_core::Device::Cpu)?)
    }
    match dtype {
        DType::F32 => make::<f32>(len),
        DType::F64 => make::<f64>(len),
        DType::BF16 => make::<half::bf16>(len),
        DType::F16 => make::<half::f16>(len),
        // Refused at the first sync, with the dtype named.
        d => Ok(Tensor::zeros(len, d, &candle_core::Device::Cpu)?),
    }
}

/// An empty vector with room for `n` elements whose memory the kernel is asked to back with
/// 2 MiB pages (Linux transparent huge pages, `madvise` mode): fewer faults when the bucket is
/// first touched and fewer TLB misses on every pass. Best effort: without THP nothing changes.
fn huge_vec<T>(n: usize) -> Vec<T> {
    let v = Vec::<T>::with_capacity(n);
    let bytes = n * size_of::<T>();
    #[cfg(target_os = "linux")]
    if bytes >= 4 << 20 {
        const PAGE: usize = 4096;
        let start = (v.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (v.as_ptr() as usize + bytes) / PAGE * PAGE;
        if end > start {
            // SAFETY: advice on whole pages inside this vector's own, still untouched
            // allocation; it changes how the kernel backs them, not their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// One large parameter (280 KB) and one small; `loss = 3·Σv + 5·Σw` gives gradients 3
    /// and 5 (times 2 samples, divided by 2 samples).
    fn setup() -> (DataParallel, Var, Var) {
        let comm = Comm::mem_world(1).pop().unwrap();
        let v = Var::zeros(70_000, DType::F32, &Device::Cpu).unwrap();
        let w = Var::zeros(10, DType::F32, &Device::Cpu).unwrap();
        let dp = DataParallel::new(comm, vec![v.clone(), w.clone()], DpConfig::default()).unwrap();
        (dp, v, w)
    }

    fn loss(v: &Var, w: &Var) -> Tensor {
        let a = (v.as_tensor().sum_all().unwrap() * 3.0).unwrap();
        (a + (w.as_tensor().sum_all().unwrap() * 5.0).unwrap()).unwrap()
    }

    fn check(s: &Synced, v: &Var, w: &Var) {
        let g = s.grads.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        assert!(g.len() == 70_000 && g.iter().all(|x| *x == 3.0));
        let g = s.grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        assert!(g.iter().all(|x| *x == 5.0));
    }

    #[test]
    fn large_gradients_are_reduced_in_place_only_when_alone_in_their_storage() {
        let (mut dp, v, w) = setup();
        dp.backward(&loss(&v, &w), 2).unwrap();
        let s = dp.sync().unwrap();
        assert!(s.direct && s.in_place, "candle's gradients own their storage");
        check(&s, &v, &w);
        // The large gradient is now candle's own tensor, not a view of the bucket.
        let bucket = cpu_span(&dp.bufs[0].flat).unwrap();
        let g = cpu_span(s.grads.get(v.as_tensor()).unwrap()).unwrap();
        assert!(g.1 <= bucket.0 || g.0 >= bucket.1);

        // A view of the gradient filed under another tensor of the store: it shares the
        // storage, so the gradient is reduced in its place in the bucket instead and the view
        // keeps its values.
        dp.backward(&loss(&v, &w), 2).unwrap();
        let acc = dp.acc.as_mut().unwrap();
        let grad = acc.grads[0].as_ref().unwrap().0.clone();
        let other = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
        acc.store.insert(&other, grad.narrow(0, 100, 5).unwrap());
        let s = dp.sync().unwrap();
        assert!(s.direct && !s.in_place, "a gradient sharing its storage is not written");
        let g = cpu_span(s.grads.get(v.as_tensor()).unwrap()).unwrap();
        assert!(g.0 >= bucket.0 && g.1 <= bucket.1, "the gradient is a view of the bucket");
        check(&s, &v, &w);
        let view = s.grads.get(&other).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(view, vec![3.0; 5], "the tensor sharing the storage is untouched");
    }
}
