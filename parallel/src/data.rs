//! Deterministic data for examples and tests: the same values on every rank and every run,
//! without a shared random state.

use std::collections::HashMap;

use candle_core::{Device, Result, Tensor};

/// A small deterministic generator (xorshift64*, Box–Muller for normals).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// An f32 tensor of standard normals.
///
/// # Errors
/// Candle errors.
pub fn randn(shape: &[usize], seed: u64) -> Result<Tensor> {
    let mut r = Rng::new(seed);
    let v: Vec<f32> = (0..shape.iter().product()).map(|_| r.normal() as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// An f32 tensor uniform in `[-bound, bound)` (PyTorch's nn.Linear init uses
/// `bound = 1/sqrt(in_features)`).
///
/// # Errors
/// Candle errors.
pub fn uniform(shape: &[usize], bound: f64, seed: u64) -> Result<Tensor> {
    let mut r = Rng::new(seed);
    let v: Vec<f32> =
        (0..shape.iter().product()).map(|_| ((r.uniform() * 2.0 - 1.0) * bound) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// scikit-learn's two moons: `n` points `[n, 2]` and labels `[n, 1]` (0 outer, 1 inner),
/// shuffled, with Gaussian noise of std `noise`.
///
/// # Errors
/// Candle errors.
pub fn two_moons(n: usize, noise: f64, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut r = Rng::new(seed);
    let outer = n / 2;
    let inner = n - outer;
    let mut pts: Vec<([f64; 2], f32)> = Vec::with_capacity(n);
    let lin = |i: usize, m: usize| {
        if m > 1 {
            std::f64::consts::PI * i as f64 / (m - 1) as f64
        } else {
            0.0
        }
    };
    for i in 0..outer {
        let t = lin(i, outer);
        pts.push(([t.cos(), t.sin()], 0.0));
    }
    for i in 0..inner {
        let t = lin(i, inner);
        pts.push(([1.0 - t.cos(), 1.0 - t.sin() - 0.5], 1.0));
    }
    // Fisher–Yates.
    for i in (1..n).rev() {
        let j = (r.uniform() * (i + 1) as f64) as usize;
        pts.swap(i, j.min(i));
    }
    let mut x = Vec::with_capacity(2 * n);
    let mut y = Vec::with_capacity(n);
    for (p, l) in pts {
        x.push((p[0] + noise * r.normal()) as f32);
        x.push((p[1] + noise * r.normal()) as f32);
        y.push(l);
    }
    Ok((Tensor::from_vec(x, (n, 2), &Device::Cpu)?, Tensor::from_vec(y, (n, 1), &Device::Cpu)?))
}

/// Random weights of a transformer block named [`crate::BLOCK_PARAMS`] under `prefix`: linear
/// weights and biases `N(0, scale²)`, LayerNorm weights `1 + N(0, scale²)`.
///
/// # Errors
/// Candle errors.
pub fn block_weights(
    prefix: &str,
    d_model: usize,
    d_ff: usize,
    scale: f64,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    for (i, name) in crate::BLOCK_PARAMS.iter().enumerate() {
        let shape: Vec<usize> = match *name {
            "ln1.weight" | "ln1.bias" | "ln2.weight" | "ln2.bias" | "fc2.bias" => vec![d_model],
            "fc1.weight" => vec![d_ff, d_model],
            "fc1.bias" => vec![d_ff],
            "fc2.weight" => vec![d_model, d_ff],
            _ => vec![d_model, d_model],
        };
        let mut t = (randn(&shape, seed + i as u64)? * scale)?;
        if *name == "ln1.weight" || *name == "ln2.weight" {
            t = t.affine(1.0, 1.0)?;
        }
        m.insert(format!("{prefix}{name}"), t);
    }
    Ok(m)
}
