//! Seed 004: a tiny causal LM (embedding → block → LayerNorm → LM head) trained with Megatron
//! tensor parallelism and a vocab-parallel embedding, head and cross-entropy, with and without
//! sequence parallelism; the losses per step match one process, and each rank holds a fraction
//! of the parameters.
//!
//! Alone: 4 ranks as threads (`--threads N`). Under a launcher:
//! `tutti-run --nproc 4 -- target/release/examples/seed004_tiny_lm`.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use candle_nn::{Optimizer, SGD};
use tutti_parallel::data::{block_weights, randn, Rng};
use tutti_parallel::{run_example, BlockConfig, Comm, LmConfig, LmMode, Result, TinyLm};

const VOCAB: usize = 96;
const D: usize = 64;
const HEADS: usize = 8;
const FF: usize = 128;
const B: usize = 4;
const S: usize = 32;
const STEPS: usize = 6;
const LR: f64 = 0.1;

fn weights() -> Result<HashMap<String, Tensor>> {
    let mut m = block_weights("block.", D, FF, 0.1, 10)?;
    m.insert("embed.weight".into(), randn(&[VOCAB, D], 1)?);
    m.insert("lnf.weight".into(), Tensor::ones(D, candle_core::DType::F32, &Device::Cpu)?);
    m.insert("lnf.bias".into(), Tensor::zeros(D, candle_core::DType::F32, &Device::Cpu)?);
    m.insert("lm_head.weight".into(), (randn(&[VOCAB, D], 2)? * 0.1)?);
    Ok(m)
}

/// Token ids in [1, VOCAB) with the last few positions of each sequence padded with 0.
fn tokens() -> Result<Tensor> {
    let mut r = Rng::new(7);
    let v: Vec<i64> = (0..B * S)
        .map(|i| {
            if i % S >= S - 1 - (i / S) {
                0
            } else {
                1 + (r.uniform() * (VOCAB - 1) as f64) as i64
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, (B, S), &Device::Cpu)?)
}

fn train(lm: &TinyLm, tokens: &Tensor) -> Result<Vec<f32>> {
    let mut opt = SGD::new(lm.vars(), LR)?;
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let (loss, _) = lm.loss(tokens)?;
        losses.push(loss.to_scalar::<f32>()?);
        opt.step(&lm.backward(&loss)?)?;
    }
    Ok(losses)
}

fn main() -> std::process::ExitCode {
    run_example("seed004_tiny_lm", 4, |c| {
        let (w, toks) = (weights()?, tokens()?);
        let cfg = LmConfig {
            block: BlockConfig { n_heads: HEADS, causal: true, eps: 1e-5 },
            n_blocks: 1,
            ignore_index: Some(0),
        };
        let solo = Comm::mem_world(1).remove(0);
        let reference = TinyLm::from_weights(&w, cfg, LmMode::Reference, &solo)?;
        let want = train(&reference, &toks)?;
        let tp = TinyLm::from_weights(&w, cfg, LmMode::Tp, &c)?;
        let tp_losses = train(&tp, &toks)?;
        let sp = TinyLm::from_weights(&w, cfg, LmMode::TpSp, &c)?;
        let sp_losses = train(&sp, &toks)?;
        if c.rank() == 0 {
            println!(
                "# tiny LM vocab={VOCAB} d={D} heads={HEADS} d_ff={FF}, batch {B}x{S}, {} ranks",
                c.size()
            );
            println!("# step   one process   TP+vocab    TP+vocab+SP");
            for s in 0..STEPS {
                println!(
                    "  {s:>4}  {:>12.7}  {:>10.7}  {:>12.7}",
                    want[s], tp_losses[s], sp_losses[s]
                );
            }
        }
        c.barrier()?;
        // NaN or infinity in a loss counts as an infinite difference.
        let diff = |v: &[f32]| tutti_parallel::compare::max_abs_diff_values(v, &want) as f32;
        let (dt, ds) = (diff(&tp_losses), diff(&sp_losses));
        let ok = dt <= 1e-4 && ds <= 1e-4;
        println!(
            "[Rank {}] match: {ok} | max loss diff TP {dt:.2e}, TP+SP {ds:.2e} | parameter bytes {} of {} ({:.0}%)",
            c.rank(),
            tp.param_bytes(),
            reference.param_bytes(),
            100.0 * tp.param_bytes() as f64 / reference.param_bytes() as f64
        );
        Ok(ok)
    })
}
