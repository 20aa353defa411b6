//! Communication on candle tensors: eager functions ([`all_reduce`], [`all_gather`], …) and the
//! same moves as autograd operations (Megatron's `f` and `g`, gather/scatter to and from the
//! parallel region, the sequence-parallel pairs and Ulysses' all-to-all).
//!
//! Every function takes the [`Comm`] of the group it runs over, so a 2-D layout (data × tensor)
//! passes the tensor-parallel sub-communicator here and the data-parallel one to
//! [`crate::DataParallel`].
//!
//! # Collective contract
//! Every rank of the group calls the same functions in the same order with tensors of the same
//! shape and dtype (the autograd ops' backward passes then also line up, because every rank
//! builds the same graph). A rank that skips a call, or passes another shape, gets a typed
//! mismatch or timeout error naming the peer, never a hang.

use std::borrow::Cow;

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use tutti_collectives::tensor::{concat_blocks, split_blocks};
use tutti_collectives::{Comm, Element, ReduceOp};

use crate::error::{Error, Result};

/// One communication step on a row-major buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Move {
    /// No communication (the backward of `g`, the forward of `f`).
    Identity,
    /// Allreduce with the operator.
    AllReduce(ReduceOp),
    /// Allgather, concatenating the ranks' tensors along the dim in rank order.
    AllGather(usize),
    /// Keep this rank's part of the dim (no communication).
    Split(usize),
    /// Sum across ranks and keep this rank's part of the dim.
    ReduceScatter(usize),
    /// All-to-all: split the first dim across ranks, concatenate along the second.
    AllToAll(usize, usize),
    /// Broadcast from the root (eager only).
    Broadcast(usize),
}

fn shape_err(comm: &Comm, layer: &'static str, detail: String) -> Error {
    Error::Shape { rank: comm.rank(), layer, detail }
}

fn check_dim(comm: &Comm, layer: &'static str, shape: &[usize], dim: usize) -> Result<()> {
    if dim >= shape.len() {
        return Err(shape_err(comm, layer, format!("dim {dim} outside the shape {shape:?}")));
    }
    Ok(())
}

fn check_divides(comm: &Comm, layer: &'static str, shape: &[usize], dim: usize) -> Result<()> {
    check_dim(comm, layer, shape, dim)?;
    let n = comm.size();
    if !shape[dim].is_multiple_of(n) {
        return Err(shape_err(
            comm,
            layer,
            format!(
                "dim {dim} of shape {shape:?} has size {}, which does not divide by the world size {n}",
                shape[dim]
            ),
        ));
    }
    Ok(())
}

/// Run `mv` on one rank's contiguous data; returns the result and its shape.
fn run_move<T: Element>(
    comm: &Comm,
    layer: &'static str,
    mv: Move,
    data: Cow<'_, [T]>,
    shape: &[usize],
) -> Result<(Vec<T>, Vec<usize>)> {
    let n = comm.size();
    let mut out_shape = shape.to_vec();
    let out = match mv {
        Move::Identity => data.into_owned(),
        Move::AllReduce(op) => {
            // Reduced in place: owned data (the eager path) is not copied again.
            let mut v = data.into_owned();
            comm.allreduce(&mut v, op)?;
            v
        }
        Move::AllGather(dim) => {
            check_dim(comm, layer, shape, dim)?;
            let mut all = vec![T::default(); data.len() * n];
            comm.allgather(&data, &mut all)?;
            out_shape[dim] *= n;
            if dim == 0 || shape[..dim].iter().product::<usize>() == 1 {
                all
            } else {
                let mut out = vec![T::default(); all.len()];
                concat_blocks(&all, shape, dim, n, &mut out);
                out
            }
        }
        Move::Split(dim) => {
            check_divides(comm, layer, shape, dim)?;
            let outer: usize = shape[..dim].iter().product();
            let inner: usize = shape[dim + 1..].iter().product();
            let part = shape[dim] / n;
            let r = comm.rank();
            let mut out = Vec::with_capacity(data.len() / n);
            for o in 0..outer {
                let base = (o * shape[dim] + r * part) * inner;
                out.extend_from_slice(&data[base..base + part * inner]);
            }
            out_shape[dim] = part;
            out
        }
        Move::ReduceScatter(dim) => {
            check_divides(comm, layer, shape, dim)?;
            let packed = split_blocks(&data, shape, dim, n);
            let mut out = vec![T::default(); data.len() / n];
            comm.reduce_scatter(&packed, &mut out, ReduceOp::Sum)?;
            out_shape[dim] /= n;
            out
        }
        Move::Broadcast(root) => {
            let mut v = data.into_owned();
            comm.broadcast(&mut v, root)?;
            v
        }
        Move::AllToAll(sd, gd) => {
            check_divides(comm, layer, shape, sd)?;
            check_dim(comm, layer, shape, gd)?;
            let mut out = vec![T::default(); data.len()];
            comm.all_to_all_tensor(&data, shape, sd, gd, &mut out)?;
            out_shape[sd] /= n;
            out_shape[gd] *= n;
            out
        }
    };
    Ok((out, out_shape))
}

/// Calls `$body` with `$t` bound to the Rust type of a candle dtype the collectives move.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr, $other:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            other => $other(other),
        }
    };
}

fn unsupported(comm: &Comm, layer: &'static str, dtype: DType) -> Error {
    shape_err(
        comm,
        layer,
        format!("dtype {dtype:?} cannot be communicated (f32, f64, bf16, f16, i64, u8 can)"),
    )
}

/// Eager `mv` on a tensor (any layout, any device): the op's forward, recording no graph.
fn move_tensor(comm: &Comm, layer: &'static str, mv: Move, t: &Tensor) -> Result<Tensor> {
    if mv == Move::Identity {
        return Ok(t.clone());
    }
    let op = CommOp { comm: comm.clone(), name: layer, fwd: mv, bwd: Move::Identity };
    Ok(t.contiguous()?.apply_op1_no_bwd(&op)?)
}

/// A communication step with its adjoint, as a candle op.
struct CommOp {
    comm: Comm,
    name: &'static str,
    fwd: Move,
    bwd: Move,
}

impl CustomOp1 for CommOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::RequiresContiguous { op: self.name });
        };
        let shape = layout.dims().to_vec();
        with_dtype!(
            storage.dtype(),
            T => {
                let data = &<T as candle_core::WithDType>::cpu_storage_as_slice(storage)?[a..b];
                let (out, out_shape) =
                    run_move(&self.comm, self.name, self.fwd, Cow::Borrowed(data), &shape)?;
                Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(out), Shape::from(out_shape)))
            },
            |d| Err(unsupported(&self.comm, self.name, d).into())
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::RequiresContiguous { op: self.name });
        };
        let shape = layout.dims().to_vec();
        with_dtype!(
            storage.dtype(),
            T => cuda::fwd::<T>(&self.comm, self.name, self.fwd, storage, a..b, &shape),
            |d| Err(unsupported(&self.comm, self.name, d).into())
        )
    }

    /// The adjoint move runs as an op of its own (recording no graph), so a CUDA gradient takes
    /// the same path as a CUDA forward.
    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(move_tensor(&self.comm, self.name, self.bwd, grad_res)?))
    }
}

/// CUDA tensors: an allreduce goes through tutti's staging engine (pinned host buffers,
/// copies overlapped with the wire) straight from and to the tensors' device memory; the other
/// moves copy the tensor down into a pinned buffer, run the same code as the CPU path on it and
/// copy the result up from another (their reshuffles around the collective are host code).
/// The pinned buffers come from the device's kept buffers, so a training loop pins memory only
/// in its first steps. `TUTTI_CUDA_MOVES=pageable` makes the other moves use candle's pageable
/// copies instead (for comparison).
#[cfg(feature = "cuda")]
mod cuda {
    use std::borrow::Cow;
    use std::sync::{Arc, Mutex, OnceLock};

    use tutti_collectives::device::Device;

    use candle_core::backend::BackendDevice;
    use candle_core::cuda::cudarc::driver::{DevicePtr, DeviceRepr};
    use candle_core::cuda::CudaDType;
    use candle_core::{CudaStorage, DeviceLocation, Shape};
    use tutti_collectives::device::cuda::{CudaDevice, CudaView};
    use tutti_collectives::device::StagingConfig;
    use tutti_collectives::{Comm, Element};

    use super::{run_move, Move};
    use crate::error::Error;

    /// The tutti devices opened so far, by GPU ordinal.
    type Devices = Mutex<Vec<(usize, Arc<CudaDevice>)>>;

    /// One tutti device (copy stream, events) per GPU, shared by every op on it.
    fn device(ordinal: usize) -> crate::error::Result<Arc<CudaDevice>> {
        static DEVICES: OnceLock<Devices> = OnceLock::new();
        let mut g = DEVICES
            .get_or_init(|| Mutex::new(Vec::new()))
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some((_, d)) = g.iter().find(|(o, _)| *o == ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(CudaDevice::new(ordinal)?);
        g.push((ordinal, d.clone()));
        Ok(d)
    }

    pub(super) fn fwd<T: Element + CudaDType + DeviceRepr + candle_core::WithDType>(
        comm: &Comm,
        name: &'static str,
        mv: Move,
        st: &CudaStorage,
        range: std::ops::Range<usize>,
        shape: &[usize],
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = st.device.clone();
        let n = range.len();
        let view = st.as_cuda_slice::<T>()?.slice(range);
        if let (Move::AllReduce(op), true) = (mv, n > 0) {
            let DeviceLocation::Cuda { gpu_id } = dev.location() else {
                return Err(candle_core::Error::Msg(format!("{name}: not a CUDA device")));
            };
            let stream = dev.cuda_stream();
            // The kernels that produced the input ran on candle's stream: done before the
            // staging engine's copy stream reads it.
            stream.synchronize().map_err(candle_core::Error::wrap)?;
            // SAFETY: every element is written by the allreduce below before anyone reads it.
            let out = unsafe { dev.alloc::<T>(n)? };
            let bytes = n * size_of::<T>();
            let staged =
                comm.staged(device(gpu_id)?, StagingConfig::from_env().map_err(Error::from)?);
            {
                let (pi, _ri) = view.device_ptr(&stream);
                let (po, _ro) = out.device_ptr(&stream);
                // SAFETY: both are allocations of candle's context on this GPU (the primary
                // context, which tutti's device uses too), alive for this block; the input is
                // complete (synchronised above), and nothing else touches either until the
                // staged call returns (it waits for its own copies).
                let (vi, vo) = unsafe { (CudaView::new(pi, bytes), CudaView::new(po, bytes)) };
                staged.allreduce_from::<T>(&vi, &vo, n, op).map_err(Error::from)?;
            }
            return Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(shape.to_vec())));
        }
        if mv == Move::Identity {
            // A copy on the device, in candle's stream order.
            let s = dev.cuda_stream().clone_dtod(&view).map_err(candle_core::Error::wrap)?;
            return Ok((CudaStorage::wrap_cuda_slice(s, dev), Shape::from(shape.to_vec())));
        }
        if pageable() || n == 0 {
            let host: Vec<T> = dev.clone_dtoh(&view)?;
            let (out, out_shape) = run_move(comm, name, mv, Cow::Owned(host), shape)?;
            let s = dev.clone_htod(&out)?;
            return Ok((CudaStorage::wrap_cuda_slice(s, dev), Shape::from(out_shape)));
        }
        let DeviceLocation::Cuda { gpu_id } = dev.location() else {
            return Err(candle_core::Error::Msg(format!("{name}: not a CUDA device")));
        };
        let tdev = device(gpu_id)?;
        let stream = dev.cuda_stream();
        let esz = size_of::<T>();
        // The input is complete before tutti's copy stream reads it.
        stream.synchronize().map_err(candle_core::Error::wrap)?;
        // Wait for a queued copy. It is done before anything it touches is dropped, on every
        // path: after a failed queue, record or wait, the whole stream is waited for.
        let settle = |queued: tutti_collectives::Result<()>| -> crate::error::Result<()> {
            let r = queued.and_then(|()| tdev.wait(tdev.record()?));
            if r.is_err() {
                let _ = tdev.stream().synchronize();
            }
            r.map_err(Error::from)
        };
        let down = tdev.alloc_stage(n * esz).map_err(Error::from)?;
        {
            let (pi, _ri) = view.device_ptr(&stream);
            // SAFETY: candle's allocation on this GPU's primary context, complete (synchronised
            // above) and alive for this block; the copy is waited for before the block ends.
            let vi = unsafe { CudaView::new(pi, n * esz) };
            // SAFETY: both ranges are in bounds, and nothing else touches them until the wait
            // (or, after an error, the stream's synchronisation in `settle`).
            settle(unsafe { tdev.d2h(&vi, 0, &*down, 0, n * esz) })?;
        }
        // SAFETY: the stage holds n elements, copied down and waited for above; stages are
        // aligned to 16 bytes.
        let host = unsafe { std::slice::from_raw_parts(down.ptr().cast::<T>(), n) };
        let (out, out_shape) = run_move(comm, name, mv, Cow::Borrowed(host), shape)?;
        drop(down);
        let ob = out.len() * esz;
        let up = tdev.alloc_stage(ob).map_err(Error::from)?;
        // SAFETY: the stage holds at least `ob` bytes and is not in any copy.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr().cast::<u8>(), up.ptr(), ob) };
        // SAFETY: every element is written by the copy up below before anyone reads it.
        let s = unsafe { dev.alloc::<T>(out.len())? };
        // candle's allocation is ordered on its own stream: done before tutti's stream writes.
        stream.synchronize().map_err(candle_core::Error::wrap)?;
        {
            let (po, _ro) = s.device_ptr(&stream);
            // SAFETY: as for the input: candle's allocation of `ob` bytes (or more), alive here,
            // written only by this copy, which is waited for before the block ends.
            let vo = unsafe { CudaView::new(po, ob) };
            // SAFETY: in bounds; the stage is not touched until the wait (or `settle`).
            settle(unsafe { tdev.h2d(&*up, 0, &vo, 0, ob) })?;
        }
        Ok((CudaStorage::wrap_cuda_slice(s, dev), Shape::from(out_shape)))
    }

    /// `TUTTI_CUDA_MOVES=pageable`: the moves other than allreduce use candle's pageable copies.
    fn pageable() -> bool {
        static P: OnceLock<bool> = OnceLock::new();
        *P.get_or_init(|| std::env::var("TUTTI_CUDA_MOVES").is_ok_and(|v| v == "pageable"))
    }
}

fn apply(comm: &Comm, name: &'static str, fwd: Move, bwd: Move, x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = CommOp { comm: comm.clone(), name, fwd, bwd };
    Ok(x.apply_op1(op)?)
}

/// Megatron's `f`: identity forward, allreduce (sum) of the gradient backward. Put it where a
/// replicated activation enters a tensor-parallel region (before a column-parallel linear), so
/// the replicated producers (LayerNorm, the residual stream) receive the full gradient.
///
/// # Errors
/// Collective errors (in backward, through candle's `backward()`), unsupported dtypes.
pub fn copy_to_parallel_region(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    apply(comm, "copy_to_parallel_region", Move::Identity, Move::AllReduce(ReduceOp::Sum), x)
}

/// Megatron's `g`: allreduce (sum) forward, identity backward. Put it where a tensor-parallel
/// region's partial results leave it (after a row-parallel linear).
///
/// # Errors
/// Collective errors, unsupported dtypes.
pub fn reduce_from_parallel_region(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    apply(comm, "reduce_from_parallel_region", Move::AllReduce(ReduceOp::Sum), Move::Identity, x)
}

/// Allgather along `dim` forward (rank order), keep this rank's part of the gradient backward.
/// After a column-parallel linear with `dim` = last dim, this gives every rank the full output.
///
/// # Errors
/// Collective errors; [`Error::Shape`] for a dim out of range.
pub fn gather_from_parallel_region(x: &Tensor, comm: &Comm, dim: usize) -> Result<Tensor> {
    apply(comm, "gather_from_parallel_region", Move::AllGather(dim), Move::Split(dim), x)
}

/// Keep this rank's part of `dim` forward, allgather the gradient backward. Before a
/// row-parallel linear whose input is replicated.
///
/// # Errors
/// [`Error::Shape`] when `dim` does not divide by the world size; collective errors backward.
pub fn scatter_to_parallel_region(x: &Tensor, comm: &Comm, dim: usize) -> Result<Tensor> {
    apply(comm, "scatter_to_parallel_region", Move::Split(dim), Move::AllGather(dim), x)
}

/// Megatron sequence parallel's entry: allgather along the sequence `dim` forward,
/// reduce-scatter (sum) of the gradient backward.
///
/// # Errors
/// Collective errors; [`Error::Shape`] for a dim out of range or, backward, not divisible.
pub fn gather_from_sequence_parallel_region(x: &Tensor, comm: &Comm, dim: usize) -> Result<Tensor> {
    apply(
        comm,
        "gather_from_sequence_parallel_region",
        Move::AllGather(dim),
        Move::ReduceScatter(dim),
        x,
    )
}

/// Megatron sequence parallel's exit: reduce-scatter (sum) along the sequence `dim` forward,
/// allgather of the gradient backward.
///
/// # Errors
/// [`Error::Shape`] when `dim` does not divide by the world size; collective errors.
pub fn reduce_scatter_to_sequence_parallel_region(
    x: &Tensor,
    comm: &Comm,
    dim: usize,
) -> Result<Tensor> {
    apply(
        comm,
        "reduce_scatter_to_sequence_parallel_region",
        Move::ReduceScatter(dim),
        Move::AllGather(dim),
        x,
    )
}

/// Ulysses' redistribution: all-to-all that splits `scatter_dim` across ranks and concatenates
/// the parts received along `gather_dim`; backward is the inverse all-to-all.
///
/// # Errors
/// [`Error::Shape`] when `scatter_dim` (or, backward, `gather_dim`) does not divide by the world
/// size; collective errors.
pub fn all_to_all(
    x: &Tensor,
    comm: &Comm,
    scatter_dim: usize,
    gather_dim: usize,
) -> Result<Tensor> {
    apply(
        comm,
        "all_to_all",
        Move::AllToAll(scatter_dim, gather_dim),
        Move::AllToAll(gather_dim, scatter_dim),
        x,
    )
}

/// Eager allreduce of a tensor (no autograd).
///
/// # Errors
/// Collective errors, unsupported dtypes.
pub fn all_reduce(x: &Tensor, comm: &Comm, op: ReduceOp) -> Result<Tensor> {
    move_tensor(comm, "all_reduce", Move::AllReduce(op), x)
}

/// Eager allgather along `dim` (no autograd).
///
/// # Errors
/// Collective errors; [`Error::Shape`] for a dim out of range.
pub fn all_gather(x: &Tensor, comm: &Comm, dim: usize) -> Result<Tensor> {
    move_tensor(comm, "all_gather", Move::AllGather(dim), x)
}

/// Eager reduce-scatter (sum) along `dim` (no autograd).
///
/// # Errors
/// Collective errors; [`Error::Shape`] when `dim` does not divide by the world size.
pub fn reduce_scatter(x: &Tensor, comm: &Comm, dim: usize) -> Result<Tensor> {
    move_tensor(comm, "reduce_scatter", Move::ReduceScatter(dim), x)
}

/// Eager broadcast of a tensor from `root` (no autograd): every rank passes a tensor of the same
/// shape and dtype and gets `root`'s values.
///
/// # Errors
/// Collective errors, unsupported dtypes.
pub fn broadcast(x: &Tensor, comm: &Comm, root: usize) -> Result<Tensor> {
    move_tensor(comm, "broadcast", Move::Broadcast(root), x)
}
