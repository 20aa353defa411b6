//! Seed 002: the two-moons SimpleMLP (2 → 16 → GELU → 1, no biases, MSE, full-batch SGD)
//! trained three ways — one process, data parallel (the 200 samples split unevenly when the world
//! does not divide them), tensor parallel (lin1 column-, lin2 row-parallel) — with the same loss
//! every epoch.
//!
//! Alone: 4 ranks as threads (`--threads N`). Under a launcher:
//! `tutti-run --nproc 3 -- target/release/examples/seed002_two_moons`.

use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, SGD};
use tutti_parallel::compare::max_abs_diff_values;
use tutti_parallel::data::{two_moons, uniform};
use tutti_parallel::{
    run_example, shard_range, ColumnParallelLinear, Comm, DataParallel, DpConfig, Result,
    RowParallelLinear,
};

const N: usize = 200;
const HIDDEN: usize = 16;
const LR: f64 = 0.05;
const EPOCHS: usize = 10;

fn mse(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok((a - b)?.sqr()?.mean_all()?)
}

fn mlp(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w1.t()?)?.gelu_erf()?.matmul(&w2.t()?)?)
}

fn init() -> Result<(Tensor, Tensor)> {
    // nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)).
    Ok((uniform(&[HIDDEN, 2], 1.0 / 2f64.sqrt(), 7)?, uniform(&[1, HIDDEN], 0.25, 8)?))
}

fn reference(x: &Tensor, y: &Tensor) -> Result<Vec<f32>> {
    let (w1, w2) = init()?;
    let (w1, w2) = (Var::from_tensor(&w1)?, Var::from_tensor(&w2)?);
    let mut opt = SGD::new(vec![w1.clone(), w2.clone()], LR)?;
    let mut losses = Vec::new();
    for _ in 0..EPOCHS {
        let loss = mse(&mlp(x, &w1, &w2)?, y)?;
        losses.push(loss.to_scalar::<f32>()?);
        opt.step(&loss.backward()?)?;
    }
    Ok(losses)
}

fn data_parallel(c: &Comm, x: &Tensor, y: &Tensor) -> Result<Vec<f32>> {
    let (w1, w2) = init()?;
    let (w1, w2) = (Var::from_tensor(&w1)?, Var::from_tensor(&w2)?);
    let mut dp = DataParallel::new(c.clone(), vec![w1.clone(), w2.clone()], DpConfig::default())?;
    let mut opt = SGD::new(vec![w1.clone(), w2.clone()], LR)?;
    let r = shard_range(N, c.rank(), c.size());
    let (xb, yb) = (x.narrow(0, r.start, r.len())?, y.narrow(0, r.start, r.len())?);
    let mut losses = Vec::new();
    for _ in 0..EPOCHS {
        dp.backward(&mse(&mlp(&xb, &w1, &w2)?, &yb)?, r.len())?;
        let s = dp.sync()?;
        losses.push(s.loss as f32);
        opt.step(&s.grads)?;
    }
    Ok(losses)
}

fn tensor_parallel(c: &Comm, x: &Tensor, y: &Tensor) -> Result<Vec<f32>> {
    let (w1, w2) = init()?;
    let lin1 = ColumnParallelLinear::from_full(&w1, None, false, c)?;
    let lin2 = RowParallelLinear::from_full(&w2, None, true, c)?;
    let mut opt = SGD::new(lin1.vars().into_iter().chain(lin2.vars()).collect(), LR)?;
    let mut losses = Vec::new();
    for _ in 0..EPOCHS {
        let loss = mse(&lin2.forward(&lin1.forward(x)?.gelu_erf()?)?, y)?;
        losses.push(loss.to_scalar::<f32>()?);
        opt.step(&loss.backward()?)?;
    }
    Ok(losses)
}

fn main() -> std::process::ExitCode {
    run_example("seed002_two_moons", 4, |c| {
        let (x, y) = two_moons(N, 0.2, 42)?;
        let want = reference(&x, &y)?;
        let dp = data_parallel(&c, &x, &y)?;
        // Tensor parallel needs the hidden width to divide by the world.
        let tp =
            if HIDDEN.is_multiple_of(c.size()) { Some(tensor_parallel(&c, &x, &y)?) } else { None };
        // NaN or infinity in a loss counts as an infinite difference.
        let max_diff = |v: &[f32]| max_abs_diff_values(v, &want) as f32;
        if c.rank() == 0 {
            let sizes: Vec<usize> =
                (0..c.size()).map(|r| shard_range(N, r, c.size()).len()).collect();
            println!("# two moons, {N} samples, {} ranks, DP shards {sizes:?}", c.size());
            println!("# epoch   reference          dp          tp");
            for e in 0..EPOCHS {
                let t = tp.as_ref().map_or("-".to_string(), |t| format!("{:.8}", t[e]));
                println!("  {e:>5}  {:>10.8}  {:>10.8}  {t:>10}", want[e], dp[e]);
            }
        }
        let tol = 1e-6;
        let mut ok = max_diff(&dp) <= tol;
        println!(
            "[Rank {}] data parallel   match: {} | max diff: {:.3e}",
            c.rank(),
            ok,
            max_diff(&dp)
        );
        if let Some(tp) = &tp {
            let d = max_diff(tp);
            ok &= d <= tol;
            println!("[Rank {}] tensor parallel match: {} | max diff: {d:.3e}", c.rank(), d <= tol);
        }
        Ok(ok)
    })
}
