//! Timing of the communication ops on one rank's tensors (`tutti-golden --bench-moves`): each
//! op's forward and backward, the median of several steps, and, for CUDA tensors, the pinned
//! buffers allocated after the warm-up steps (none is the contract of the device's kept
//! buffers).

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use tutti_collectives::Comm;

use crate::error::Result;
use crate::ops;

/// One op's timing at one size.
#[derive(Clone, Debug)]
pub struct MoveTiming {
    /// The op (Megatron's name for it).
    pub op: &'static str,
    /// Bytes of this rank's input tensor (f32).
    pub bytes: usize,
    /// Median time of forward plus backward, in milliseconds.
    pub median_ms: f64,
    /// Pinned buffers this process allocated during the timed steps (`None` without the `cuda`
    /// feature).
    pub pinned_after_warmup: Option<u64>,
}

type OpFn = fn(&Tensor, &Comm) -> Result<Tensor>;

/// The ops timed: each takes a `[rows, 1024]` tensor whose row count divides by the world.
fn ops_list() -> Vec<(&'static str, OpFn)> {
    vec![
        ("reduce_from_parallel_region (allreduce fwd)", |x, c| {
            ops::reduce_from_parallel_region(x, c)
        }),
        ("copy_to_parallel_region (allreduce bwd)", |x, c| ops::copy_to_parallel_region(x, c)),
        ("gather_from_sequence_parallel_region (allgather fwd, reduce-scatter bwd)", |x, c| {
            ops::gather_from_sequence_parallel_region(x, c, 0)
        }),
        (
            "reduce_scatter_to_sequence_parallel_region (reduce-scatter fwd, allgather bwd)",
            |x, c| ops::reduce_scatter_to_sequence_parallel_region(x, c, 0),
        ),
        ("gather_from_parallel_region (allgather on the last dim fwd, split bwd)", |x, c| {
            ops::gather_from_parallel_region(x, c, 1)
        }),
        ("all_to_all (Ulysses fwd and bwd)", |x, c| ops::all_to_all(x, c, 0, 1)),
    ]
}

/// Pinned buffers this process's CUDA devices allocated so far (`None` without the feature).
pub(crate) fn pinned() -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        Some(tutti_collectives::device::cuda::pinned_allocations())
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Time every op at every size (bytes of this rank's f32 input), `warmup` untimed steps then
/// `steps` timed ones. Every rank calls it with the same arguments.
///
/// # Errors
/// Collective errors; candle errors.
pub fn bench(
    comm: &Comm,
    device: &Device,
    sizes: &[usize],
    warmup: usize,
    steps: usize,
) -> Result<Vec<MoveTiming>> {
    let n = comm.size();
    let mut out = Vec::new();
    for &bytes in sizes {
        // Rows that divide by the world, 1,024 columns (also a multiple of any world ≤ 1,024).
        let rows = (bytes / 4 / 1024).div_ceil(n).max(1) * n;
        let x = Var::from_tensor(
            &Tensor::arange(0u32, (rows * 1024) as u32, device)?
                .to_dtype(DType::F32)?
                .affine(1.0 / 1024.0, comm.rank() as f64)?
                .reshape((rows, 1024))?,
        )?;
        for (name, f) in ops_list() {
            let mut times = Vec::with_capacity(steps);
            let mut before = None;
            for s in 0..warmup + steps {
                if s == warmup {
                    before = pinned();
                }
                device.synchronize()?;
                let t = Instant::now();
                let y = f(x.as_tensor(), comm)?;
                let grads = y.sum_all()?.backward()?;
                if let Some(g) = grads.get(x.as_tensor()) {
                    // Wait for the gradient itself, not only the queued work.
                    g.flatten_all()?.narrow(0, 0, 1)?.to_vec1::<f32>()?;
                }
                device.synchronize()?;
                if s >= warmup {
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            times.sort_by(f64::total_cmp);
            out.push(MoveTiming {
                op: name,
                bytes: rows * 1024 * 4,
                median_ms: times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
                pinned_after_warmup: before.zip(pinned()).map(|(a, b)| b - a),
            });
        }
    }
    Ok(out)
}
