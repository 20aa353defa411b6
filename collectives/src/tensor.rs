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

/// Cut a row-major buffer of `shape` into `n` equal parts along `dim` and lay the parts one after
/// the other (part `j` = the elements whose index along `dim` is in `[j*s/n, (j+1)*s/n)`), the
/// layout the collectives' block-wise calls (all-to-all, reduce-scatter) expect.
///
/// # Panics
/// When `dim` is out of range, `shape[dim]` does not divide by `n` or `data` does not hold
/// `shape`'s elements (callers check first).
pub fn split_blocks<T: Copy>(data: &[T], shape: &[usize], dim: usize, n: usize) -> Vec<T> {
    let (so, sm, si) = around(shape, dim);
    assert!(sm % n == 0 && data.len() == so * sm * si, "split_blocks: bad shape");
    let part = sm / n;
    let mut packed = Vec::with_capacity(data.len());
    for j in 0..n {
        for o in 0..so {
            let base = (o * sm + j * part) * si;
            packed.extend_from_slice(&data[base..base + part * si]);
        }
    }
    packed
}

/// The inverse of [`split_blocks`]: `blocks` holds `n` consecutive row-major blocks of
/// `block_shape`; block `i` is written at position `i` along `dim` of `output` (whose shape is
/// `block_shape` with `dim` multiplied by `n`).
///
/// # Panics
/// When the lengths do not match the shapes (callers check first).
pub fn concat_blocks<T: Copy>(
    blocks: &[T],
    block_shape: &[usize],
    dim: usize,
    n: usize,
    output: &mut [T],
) {
    let (go, gm, gi) = around(block_shape, dim);
    let blk = go * gm * gi;
    assert!(blocks.len() == blk * n && output.len() == blk * n, "concat_blocks: bad shape");
    for i in 0..n {
        let b = &blocks[i * blk..(i + 1) * blk];
        for o in 0..go {
            let src = &b[o * gm * gi..(o + 1) * gm * gi];
            let dst = (o * gm * n + i * gm) * gi;
            output[dst..dst + gm * gi].copy_from_slice(src);
        }
    }
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
        if !shape[scatter_dim].is_multiple_of(n) {
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
        let packed = split_blocks(input, shape, scatter_dim, n);
        let mut recv = vec![T::default(); total];
        let st = self.all_to_all(&packed, &mut recv)?;
        let mut bshape = shape.to_vec();
        bshape[scatter_dim] /= n;
        concat_blocks(&recv, &bshape, gather_dim, n, output);
        Ok(st)
    }
}
