//! Seed 003: a deep GELU MLP split into pipeline stages (one per rank), trained with AdamW over
//! micro-batches with the GPipe and 1F1B schedules; the losses match one process, and each stage
//! prints the ideal bubble fraction `(P-1)/(M+P-1)` next to the time it actually waited.
//!
//! Alone: 4 ranks as threads (`--threads N`). Under a launcher:
//! `tutti-run --nproc 4 -- target/release/examples/seed003_pipeline`.

use candle_core::{DType, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use tutti_parallel::data::randn;
use tutti_parallel::{run_example, shard_range, Comm, Pipeline, Result, Schedule};

const LAYERS: usize = 8;
const DIM: usize = 256;
const BATCH: usize = 256;
const MICRO: usize = 8;
const STEPS: usize = 3;

fn layer_weights() -> Result<Vec<Tensor>> {
    (0..LAYERS)
        .map(|i| Ok((randn(&[DIM, DIM], 100 + i as u64)? * (1.7 / (DIM as f64).sqrt()))?))
        .collect()
}

fn stack(x: &Tensor, ws: &[Var]) -> Result<Tensor> {
    let mut t = x.clone();
    for w in ws {
        t = t.matmul(w.as_tensor())?.gelu_erf()?;
    }
    Ok(t)
}

fn reference(x: &Tensor) -> Result<Vec<f64>> {
    let ws: Vec<Var> =
        layer_weights()?.iter().map(Var::from_tensor).collect::<candle_core::Result<_>>()?;
    let mut opt = AdamW::new(ws.clone(), ParamsAdamW::default())?;
    let mut out = Vec::new();
    for _ in 0..STEPS {
        let loss = stack(x, &ws)?.to_dtype(DType::F64)?.sqr()?.mean_all()?;
        out.push(loss.to_scalar::<f64>()?);
        opt.step(&loss.backward()?)?;
    }
    Ok(out)
}

fn pipelined(c: &Comm, x: &Tensor, schedule: Schedule) -> Result<(Vec<f64>, f64)> {
    let mine = shard_range(LAYERS, c.rank(), c.size());
    let all = layer_weights()?;
    let ws: Vec<Var> =
        mine.map(|i| Var::from_tensor(&all[i])).collect::<candle_core::Result<_>>()?;
    let mut opt = AdamW::new(ws.clone(), ParamsAdamW::default())?;
    let pipe = Pipeline::new(c.clone(), schedule);
    let mb = |i: usize| shard_range(BATCH, i, MICRO);
    let (mut losses, mut wait, mut total) = (Vec::new(), 0.0, 0.0);
    for _ in 0..STEPS {
        let r = pipe.step(
            MICRO,
            |i| Ok(x.narrow(0, mb(i).start, mb(i).len())?),
            |i| vec![mb(i).len(), DIM],
            |t| stack(t, &ws),
            // The loss in f64: a float32 mean over 65 536 squares is itself off by ~1e-4.
            |i, y| {
                Ok((y.to_dtype(DType::F64)?.sqr()?.mean_all()?
                    * (mb(i).len() as f64 / BATCH as f64))?)
            },
            &ws,
        )?;
        losses.push(r.loss);
        wait += r.waiting.as_secs_f64();
        total += r.total.as_secs_f64();
        opt.step(&r.grads)?;
    }
    Ok((losses, wait / total))
}

fn main() -> std::process::ExitCode {
    run_example("seed003_pipeline", 4, |c| {
        let x = randn(&[BATCH, DIM], 1)?;
        let want = reference(&x)?;
        let p = c.size();
        let mut ok = true;
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            c.barrier()?;
            let (losses, waited) = pipelined(&c, &x, schedule)?;
            // NaN or infinity in a loss counts as an infinite difference.
            let d = tutti_parallel::compare::max_abs_diff_values(&losses, &want);
            let good = d <= 1e-5 * want[0].abs();
            ok &= good;
            if c.rank() == 0 {
                println!(
                    "# {schedule:?}: {p} stages, {MICRO} micro-batches, ideal bubble {:.1}%; losses {:?} (one process {:?})",
                    100.0 * Schedule::ideal_bubble(p, MICRO),
                    losses.iter().map(|l| format!("{l:.6}")).collect::<Vec<_>>(),
                    want.iter().map(|l| format!("{l:.6}")).collect::<Vec<_>>(),
                );
            }
            c.barrier()?;
            println!(
                "[Stage {}] {schedule:?} match: {} | max loss diff {d:.2e} | waited {:.1}% of the step",
                c.rank(),
                good,
                100.0 * waited
            );
        }
        Ok(ok)
    })
}
