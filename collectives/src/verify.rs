//! Exact, verifiable test data (nccl-tests' `verifiable` idea, GUIDE §4).
//!
//! Inputs are small integers that every dtype stores exactly, kept inside the exact range after
//! reduction over up to 32 ranks (|sum| ≤ 128, products are powers of two up to 2^4), so any
//! summation order gives the same bits and each rank computes the expected output locally from
//! (seed, rank, world, op). Integer types wrap identically on every rank, so they stay exact too.

use crate::dtype::{Element, ReduceOp};

/// Value of element `i` on rank `r` for `op`.
pub fn value<T: Element>(seed: u64, r: usize, i: usize, op: ReduceOp) -> T {
    let h = (seed as usize)
        .wrapping_mul(31)
        .wrapping_add(r.wrapping_mul(7))
        .wrapping_add(i.wrapping_mul(3));
    let v: i64 = match op {
        ReduceOp::Prod => {
            let s = if (h / 9).is_multiple_of(2) { 1 } else { -1 };
            if (r + i).is_multiple_of(8) {
                2 * s
            } else {
                s
            }
        }
        _ => (h % 9) as i64 - 4,
    };
    T::from_i64(v)
}

/// Rank `r`'s input of `count` elements.
pub fn input<T: Element>(seed: u64, r: usize, count: usize, op: ReduceOp) -> Vec<T> {
    (0..count).map(|i| value(seed, r, i, op)).collect()
}

/// Fill `buf` with rank `r`'s input, element `i` of `buf` being global element `first + i`.
pub fn fill<T: Element>(buf: &mut [T], seed: u64, r: usize, first: usize, op: ReduceOp) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = value(seed, r, first + i, op);
    }
}

/// Expected reduction over ranks `0..n` of element `i` (including `Avg`'s division).
pub fn reduced<T: Element>(seed: u64, n: usize, i: usize, op: ReduceOp) -> T {
    let mut acc = value::<T>(seed, 0, i, op);
    for r in 1..n {
        acc = T::combine(op, acc, value(seed, r, i, op));
    }
    if op == ReduceOp::Avg {
        acc = acc.div_n(n);
    }
    acc
}

/// Bitwise equality of two elements.
pub fn same<T: Element>(a: T, b: T) -> bool {
    crate::dtype::as_bytes(std::slice::from_ref(&a))
        == crate::dtype::as_bytes(std::slice::from_ref(&b))
}

/// Elements of `got` that differ bitwise from `want(i)`.
pub fn count_wrong<T: Element>(got: &[T], want: impl Fn(usize) -> T) -> u64 {
    got.iter().enumerate().filter(|(i, g)| !same(**g, want(*i))).count() as u64
}
