//! Seed 000: one SGD step of a linear layer four ways — single process, gradient accumulation,
//! data parallel, column-parallel tensor parallel — must give the same updated weight.
//!
//! Alone: 4 ranks as threads (`--threads N` to change). Under a launcher:
//! `tutti-run --nproc 4 -- target/release/examples/seed000_strategies`.

use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, SGD};
use tutti_parallel::data::randn;
use tutti_parallel::{
    ops, run_example, ColumnParallelLinear, Comm, DataParallel, DpConfig, Result,
};

const IN: usize = 64;
const OUT: usize = 32;
const BATCH: usize = 128;
const LR: f64 = 0.5;
const ACCUMULATION: usize = 4;

fn mse(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok((a - b)?.sqr()?.mean_all()?)
}

/// W is [in, out], used as x @ W (the seed's CustomLinearLayer).
fn data() -> Result<(Tensor, Tensor, Tensor)> {
    let w0 = (randn(&[IN, OUT], 1)? / (IN as f64).sqrt())?;
    Ok((w0, randn(&[BATCH, IN], 2)?, randn(&[BATCH, OUT], 3)?))
}

fn single_step(w0: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let w = Var::from_tensor(w0)?;
    let loss = mse(&x.matmul(w.as_tensor())?, y)?;
    SGD::new(vec![w.clone()], LR)?.step(&loss.backward()?)?;
    Ok(w.as_tensor().clone())
}

/// Accumulation on one rank (a world of one): four micro-batches, one update.
fn accumulation(w0: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let w = Var::from_tensor(w0)?;
    let solo = Comm::mem_world(1).remove(0);
    let mut dp = DataParallel::new(solo, vec![w.clone()], DpConfig::default())?;
    let mb = BATCH / ACCUMULATION;
    for k in 0..ACCUMULATION {
        let (xb, yb) = (x.narrow(0, k * mb, mb)?, y.narrow(0, k * mb, mb)?);
        dp.backward(&mse(&xb.matmul(w.as_tensor())?, &yb)?, mb)?;
    }
    SGD::new(vec![w.clone()], LR)?.step(&dp.sync()?.grads)?;
    Ok(w.as_tensor().clone())
}

fn data_parallel(c: &Comm, w0: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let w = Var::from_tensor(w0)?;
    let mut dp = DataParallel::new(c.clone(), vec![w.clone()], DpConfig::default())?;
    let r = tutti_parallel::shard_range(BATCH, c.rank(), c.size());
    let (xb, yb) = (x.narrow(0, r.start, r.len())?, y.narrow(0, r.start, r.len())?);
    dp.backward(&mse(&xb.matmul(w.as_tensor())?, &yb)?, r.len())?;
    SGD::new(vec![w.clone()], LR)?.step(&dp.sync()?.grads)?;
    Ok(w.as_tensor().clone())
}

/// Column parallel with the output gathered: every rank sees the full output and the same loss;
/// each updates its own columns; an allgather assembles the weight for the comparison.
fn column_parallel(c: &Comm, w0: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let layer = ColumnParallelLinear::from_full(&w0.t()?, None, true, c)?;
    let loss = mse(&layer.forward(x)?, y)?;
    SGD::new(layer.vars(), LR)?.step(&loss.backward()?)?;
    Ok(ops::all_gather(layer.weight().as_tensor(), c, 0)?.t()?)
}

fn report(rank: usize, what: &str, got: &Tensor, want: &Tensor) -> Result<bool> {
    let d = (got - want)?.abs()?.flatten_all()?;
    // NaN or infinity anywhere counts as an infinite difference.
    let max = tutti_parallel::compare::max_abs_diff(got, want)? as f32;
    let mean = d.mean(0)?.to_scalar::<f32>()?;
    println!(
        "[Rank {rank}] {what:<22} match: {} | max diff: {max:.3e} | mean diff: {mean:.3e}",
        max <= 1e-5
    );
    Ok(max <= 1e-5)
}

fn main() -> std::process::ExitCode {
    run_example("seed000_strategies", 4, |c| {
        let (w0, x, y) = data()?;
        let reference = single_step(&w0, &x, &y)?;
        let r = c.rank();
        if r == 0 {
            println!("# linear {IN}x{OUT}, batch {BATCH}, lr {LR}, {} ranks", c.size());
            let moved = (&reference - &w0)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            println!("[Rank 0] single step moved the weight by up to {moved:.3e}");
        }
        c.barrier()?;
        let mut ok = report(r, "gradient accumulation", &accumulation(&w0, &x, &y)?, &reference)?;
        c.barrier()?;
        ok &= report(r, "data parallel", &data_parallel(&c, &w0, &x, &y)?, &reference)?;
        c.barrier()?;
        ok &= report(r, "column parallel", &column_parallel(&c, &w0, &x, &y)?, &reference)?;
        Ok(ok)
    })
}
