//! Which part of a dimension a rank owns.

use std::ops::Range;

use candle_core::Tensor;
use tutti_collectives::Comm;

use crate::error::{Error, Result};

/// Rank `rank`'s part of a dimension of size `n` split over `world` ranks: the contiguous range
/// `[r*n/ws, (r+1)*n/ws)` of `numpy.array_split` / `torch.tensor_split` (the first `n % world`
/// ranks get one extra element).
pub fn shard_range(n: usize, rank: usize, world: usize) -> Range<usize> {
    let base = n / world;
    let extra = n % world;
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start..start + len
}

/// This rank's shard of `t` along `dim` by [`shard_range`] (uneven splits allowed), copied so
/// the full tensor can be dropped.
///
/// # Errors
/// [`Error::Shape`] when `dim` is out of range.
pub fn shard(t: &Tensor, dim: usize, comm: &Comm) -> Result<Tensor> {
    let dims = t.dims();
    if dim >= dims.len() {
        return Err(Error::Shape {
            rank: comm.rank(),
            layer: "shard",
            detail: format!("dim {dim} outside the shape {dims:?}"),
        });
    }
    let r = shard_range(dims[dim], comm.rank(), comm.size());
    Ok(t.narrow(dim, r.start, r.len())?.copy()?)
}

/// As [`shard`], but the dimension must divide by the world size (tensor-parallel layers whose
/// parts are gathered or reduced with equal sizes).
///
/// # Errors
/// [`Error::Shape`] naming `layer` when `dim` is out of range or does not divide.
pub fn shard_even(t: &Tensor, dim: usize, comm: &Comm, layer: &'static str) -> Result<Tensor> {
    let dims = t.dims();
    let n = comm.size();
    if dim >= dims.len() || !dims[dim].is_multiple_of(n) {
        return Err(Error::Shape {
            rank: comm.rank(),
            layer,
            detail: format!(
                "cannot split dim {dim} of a {dims:?} tensor over {n} ranks: it must divide by the world size"
            ),
        });
    }
    shard(t, dim, comm)
}

#[cfg(test)]
mod tests {
    use super::shard_range;

    #[test]
    fn ranges_cover_like_array_split() {
        for n in 0..40 {
            for w in 1..9 {
                let mut next = 0;
                for r in 0..w {
                    let s = shard_range(n, r, w);
                    assert_eq!(s.start, next);
                    assert!(s.len() == n / w || s.len() == n / w + 1);
                    assert_eq!(s.len() == n / w + 1, r < n % w);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
