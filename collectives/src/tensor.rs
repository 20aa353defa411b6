//! The tensor-shaped all-to-all: redistribute a row-major N-d buffer from split along one
//! dimension to split along another (Ulysses: `[b, s/N, h, d] → [b, s, h/N, d]` and back).

use crate::comm::{Comm, Stats};
use crate::dtype::Element;
use crate::error::{Error, Result};

/// `(outer, mid, inner)` sizes around dimension `dim` of `shape`.
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

impl Comm {
    /// All-to-all of a tensor: `input` has row-major `shape` (this rank's shard); dimension
    /// `scatter_dim` is split into `size()` parts, part `j` going to rank `j`; the parts received
    /// from ranks `0..size()` are concatenated along `gather_dim`. `output` has `shape` with
    /// `shape[scatter_dim] / size()` and `shape[gather_dim] * size()`. With `scatter_dim` = heads
    /// and `gather_dim` = sequence this is Ulysses' sequence-to-head redistribution; swapping
    /// the two dims inverts it.
    ///
    /// # Collective contract
    /// Every rank calls it with the same shape and dims.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `shape[scatter_dim]` does not divide by the group size, a
    /// dim is out of range, or a buffer length does not match the shape; otherwise as
    /// [`Comm::all_to_all`].
    pub fn all_to_all_tensor<T: Element>(
        &self,
        input: &[T],
        shape: &[usize],
        scatter_dim: usize,
        gather_dim: usize,
        output: &mut [T],
    ) -> Result<Stats> {
        let n = self.size();
        let bad = |detail: String| Error::InvalidArgument {
            rank: self.rank(),
            op: "all_to_all_tensor",
            detail,
        };
        if scatter_dim >= shape.len() || gather_dim >= shape.len() {
            return Err(bad(format!(
                "dims {scatter_dim}, {gather_dim} outside a {}-d shape",
                shape.len()
            )));
        }
        if shape[scatter_dim] % n != 0 {
            return Err(bad(format!(
                "dimension {scatter_dim} of shape {shape:?} has size {}, not divisible by the group size {n}",
                shape[scatter_dim]
            )));
        }
        let total: usize = shape.iter().product();
        if input.len() != total || output.len() != total {
            return Err(bad(format!(
                "shape {shape:?} holds {total} elements; input has {}, output {}",
                input.len(),
                output.len()
            )));
        }
        // Pack: block j = input restricted to part j of scatter_dim, row-major.
        let (so, sm, si) = around(shape, scatter_dim);
        let part = sm / n;
        let mut packed = Vec::with_capacity(total);
        for j in 0..n {
            for o in 0..so {
                let base = (o * sm + j * part) * si;
                packed.extend_from_slice(&input[base..base + part * si]);
            }
        }
        let mut recv = vec![T::default(); total];
        let st = self.all_to_all(&packed, &mut recv)?;
        // Unpack: block i has `shape` with scatter_dim divided by n; it goes to position i along
        // gather_dim of the output.
        let mut bshape = shape.to_vec();
        bshape[scatter_dim] /= n;
        let (go, gm, gi) = around(&bshape, gather_dim);
        let blk = total / n;
        for i in 0..n {
            let b = &recv[i * blk..(i + 1) * blk];
            for o in 0..go {
                let src = &b[o * gm * gi..(o + 1) * gm * gi];
                let dst = (o * gm * n + i * gm) * gi;
                output[dst..dst + gm * gi].copy_from_slice(src);
            }
        }
        Ok(st)
    }
}
