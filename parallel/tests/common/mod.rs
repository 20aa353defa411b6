//! Helpers shared by the parallel tests.
#![allow(dead_code, unreachable_pub)]

use candle_core::{Device, Tensor};
use tutti_parallel::Comm;
use tutti_runtime::testing::{groups, run, Kind};

/// Run `f` on every rank of an `n`-rank world (threads) and collect the results in rank order.
pub fn on_world<T: Send>(kind: Kind, n: usize, f: impl Fn(Comm) -> T + Sync) -> Vec<T> {
    run(groups(kind, n).unwrap(), |g| f(Comm::new(g)))
}

/// A tensor of small integers (exact in f32 under any summation order): `(i * 7 + seed) % 11 - 5`.
pub fn ints(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 7 + seed) % 11) as f32 - 5.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn rand(shape: &[usize], seed: u64) -> Tensor {
    tutti_parallel::data::uniform(shape, 1.0, seed).unwrap()
}

/// Max |a - b| (shapes must hold the same number of elements); infinity if either side holds a
/// NaN or an infinity anywhere, so such a tensor fails every tolerance.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.elem_count(), b.elem_count(), "{:?} vs {:?}", a.dims(), b.dims());
    tutti_parallel::compare::max_abs_diff(a, b).unwrap() as f32
}

/// Max |a - b| relative to max |b|.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let m = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    max_diff(a, b) / m.max(1e-30)
}

/// Exact equality of values.
pub fn assert_exact(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let d = max_diff(a, b);
    assert_eq!(d, 0.0, "{what}: differs by {d}");
}
