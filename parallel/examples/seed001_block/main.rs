//! Seed 001: a pre-LN transformer block in Megatron tensor parallel, Megatron TP + sequence
//! parallel and Ulysses sequence parallel, each checked on every rank against the single-process
//! block (output, input gradient, every parameter gradient; loss = sum(y * g)).
//!
//! Alone: 4 ranks as threads (`--threads N`). Under a launcher:
//! `tutti-run --nproc 4 -- target/release/examples/seed001_block`.

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use tutti_parallel::data::{block_weights, randn};
use tutti_parallel::{
    run_example, sequence_shard, sum_replicated_grads, Block, BlockConfig, BlockMode, Comm, Result,
};

const B: usize = 2;
const S: usize = 16;
const D: usize = 64;
const HEADS: usize = 8;
const FF: usize = 256;

fn weights() -> Result<HashMap<String, Tensor>> {
    Ok(block_weights("", D, FF, 0.1, 10)?)
}

/// NaN or infinity anywhere counts as an infinite difference.
fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok(tutti_parallel::compare::max_abs_diff(a, b)? as f32)
}

/// Output, input gradient and parameter gradients of `block` (on this rank's part).
fn run(block: &Block, x: &Tensor, g: &Tensor, c: &Comm) -> Result<(Tensor, Tensor, Vec<Tensor>)> {
    let xv = Var::from_tensor(x)?;
    let y = block.forward(xv.as_tensor())?;
    let mut grads = (&y * g)?.sum_all()?.backward()?;
    sum_replicated_grads(block.params(), &mut grads, c)?;
    let gx = grads.get(xv.as_tensor()).cloned().unwrap_or(x.zeros_like()?);
    let gp = block
        .params()
        .iter()
        .map(|p| grads.get(p.var.as_tensor()).cloned().map_or_else(|| p.var.zeros_like(), Ok))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((y, gx, gp))
}

fn main() -> std::process::ExitCode {
    run_example("seed001_block", 4, |c| {
        let w = weights()?;
        let cfg = BlockConfig { n_heads: HEADS, causal: false, eps: 1e-5 };
        let (x, g) = (randn(&[B, S, D], 1)?, randn(&[B, S, D], 2)?);
        let solo = Comm::mem_world(1).remove(0);
        let reference = Block::from_weights(&w, "", cfg, BlockMode::Reference, &solo)?;
        let (ry, rgx, rgp) = run(&reference, &x, &g, &solo)?;
        if c.rank() == 0 {
            println!("# block B={B} S={S} D={D} heads={HEADS} d_ff={FF}, {} ranks", c.size());
        }
        let mut ok = true;
        for mode in [BlockMode::Tp, BlockMode::TpSp, BlockMode::Ulysses] {
            c.barrier()?;
            let blk = Block::from_weights(&w, "", cfg, mode, &c)?;
            let seq = mode != BlockMode::Tp;
            let local = |t: &Tensor| if seq { sequence_shard(t, &c) } else { Ok(t.clone()) };
            let (y, gx, gp) = run(&blk, &local(&x)?, &local(&g)?, &c)?;
            let dy = max_diff(&y, &local(&ry)?)?;
            let dx = max_diff(&gx, &local(&rgx)?)?;
            let mut dw = 0f32;
            for ((p, got), full) in blk.params().iter().zip(&gp).zip(&rgp) {
                dw = dw.max(max_diff(got, &p.part_of(full, &c)?)?);
            }
            let good = dy <= 1e-5 && dx <= 1e-4 && dw <= 1e-4;
            ok &= good;
            let name = format!("{mode:?}");
            println!(
                "[Rank {}] {name:<8} match: {good} | max diff y {dy:.2e} | grad x {dx:.2e} | grad params {dw:.2e} | params held {} of {}",
                c.rank(),
                blk.params().iter().map(|p| p.var.elem_count()).sum::<usize>(),
                reference.params().iter().map(|p| p.var.elem_count()).sum::<usize>(),
            );
        }
        Ok(ok)
    })
}
