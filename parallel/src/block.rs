//! A pre-LN transformer block (attention + GELU MLP) as the golden README defines it, in four
//! forms: the single-process reference, Megatron tensor parallel, Megatron tensor + sequence
//! parallel, and Ulysses sequence parallel.
//!
//! ```text
//! a = LN1(x); q, k, v = a Wqᵀ, a Wkᵀ, a Wvᵀ; att_h = softmax(q_h k_hᵀ / √hd [+ causal mask]) v_h
//! h = x + concat_h(att_h) Woᵀ;  y = h + GELU_erf(LN2(h) W1ᵀ + b1) W2ᵀ + b2
//! ```

use std::collections::HashMap;

use candle_core::{backprop::GradStore, DType, Tensor, Var, D};
use tutti_collectives::{Comm, ReduceOp};

use crate::error::{Error, Result};
use crate::ops;
use crate::shard::{shard_even, shard_range};
use crate::tp::linear;

/// The parameter names of a block, in order (prefix them for a model: `block.ln1.weight`).
pub const BLOCK_PARAMS: [&str; 12] = [
    "ln1.weight",
    "ln1.bias",
    "attn.q.weight",
    "attn.k.weight",
    "attn.v.weight",
    "attn.o.weight",
    "ln2.weight",
    "ln2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
];

/// Shape settings of a block.
#[derive(Clone, Copy, Debug)]
pub struct BlockConfig {
    /// Attention heads (`d_model / n_heads` is the head dim).
    pub n_heads: usize,
    /// Causal mask (a key after the query is not attended to).
    pub causal: bool,
    /// LayerNorm epsilon.
    pub eps: f64,
}

/// How a rank holds a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// The whole tensor (replicated).
    Whole,
    /// This rank's [`shard_range`] of dimension `0` or `1`.
    Split(usize),
}

/// A parameter of a layer: its name, variable and how this rank holds it.
#[derive(Clone, Debug)]
pub struct Param {
    /// Name (as in the golden files).
    pub name: String,
    /// The variable.
    pub var: Var,
    /// Whole or split.
    pub held: Held,
    /// Replicated across the group but trained on different data (sequence shards), so its
    /// gradient must be summed over the group before the optimizer step.
    pub needs_grad_sum: bool,
}

impl Param {
    /// The part of the full tensor `full` this rank holds.
    ///
    /// # Errors
    /// Candle errors (a dim out of range).
    pub fn part_of(&self, full: &Tensor, comm: &Comm) -> Result<Tensor> {
        Ok(match self.held {
            Held::Whole => full.clone(),
            Held::Split(d) => {
                let r = shard_range(full.dim(d)?, comm.rank(), comm.size());
                full.narrow(d, r.start, r.len())?
            }
        })
    }
}

/// LayerNorm over the last dim: biased variance, then `* w + b`.
///
/// # Errors
/// Candle errors.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xn.broadcast_mul(w)?.broadcast_add(b)
}

/// Multi-head attention on `[B, S, H·hd]` projections holding `heads` heads: softmax over keys,
/// optional causal mask; returns `[B, S, H·hd]` (heads concatenated in order).
///
/// # Errors
/// Candle errors.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    causal: bool,
) -> candle_core::Result<Tensor> {
    let (b, s, f) = q.dims3()?;
    let hd = f / heads;
    let split = |t: &Tensor| t.reshape((b, s, heads, hd))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(q)?, split(k)?, split(v)?);
    let mut scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    if causal {
        let mask: Vec<f32> =
            (0..s * s).map(|i| if i % s > i / s { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (s, s), q.device())?.to_dtype(scores.dtype())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b, s, f))
}

fn get(map: &HashMap<String, Tensor>, prefix: &str, name: &str) -> Result<Tensor> {
    let key = format!("{prefix}{name}");
    map.get(&key).cloned().ok_or_else(|| Error::Golden {
        case: "block weights".into(),
        detail: format!("no tensor {key:?}"),
    })
}

fn var(t: &Tensor) -> Result<Var> {
    Ok(Var::from_tensor(&t.copy()?)?)
}

/// Which parallel form a [`Block`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockMode {
    /// One process holds everything (the oracle).
    Reference,
    /// Megatron TP: heads and FFN columns split, two allreduces forward and two backward.
    Tp,
    /// Megatron TP + sequence parallel: input/output and the LayerNorm/residual regions sharded
    /// on the sequence; allgather before each TP region, reduce-scatter after.
    TpSp,
    /// Ulysses: input sharded on the sequence, all weights replicated; all-to-all to head
    /// shards before attention and back after.
    Ulysses,
}

/// A transformer block in one of the [`BlockMode`]s. Built from full weights (each rank keeps
/// its part); `forward` takes and returns `[B, S, D]` (Reference, Tp) or this rank's sequence
/// shard `[B, S/N, D]` (TpSp, Ulysses).
///
/// # Collective contract
/// Every rank of the group builds it from the same weights and mode and calls `forward` with
/// inputs of the same shape.
#[derive(Debug)]
pub struct Block {
    mode: BlockMode,
    cfg: BlockConfig,
    comm: Option<Comm>,
    params: Vec<Param>,
}

impl Block {
    /// Build from full weights named [`BLOCK_PARAMS`] under `prefix`; `comm` is the group
    /// (ignored by [`BlockMode::Reference`]).
    ///
    /// # Errors
    /// [`Error::Shape`] up front when the heads, the FFN width or (for the sequence-parallel
    /// modes, checked in `forward`) the sequence do not divide by the world; a missing tensor.
    pub fn from_weights(
        map: &HashMap<String, Tensor>,
        prefix: &str,
        cfg: BlockConfig,
        mode: BlockMode,
        comm: &Comm,
    ) -> Result<Block> {
        let n = if mode == BlockMode::Reference { 1 } else { comm.size() };
        let layer = match mode {
            BlockMode::Reference => "Block",
            BlockMode::Tp => "TP block",
            BlockMode::TpSp => "TP+SP block",
            BlockMode::Ulysses => "Ulysses block",
        };
        if !cfg.n_heads.is_multiple_of(n) {
            return Err(Error::Shape {
                rank: comm.rank(),
                layer,
                detail: format!(
                    "{} attention heads do not divide by the world size {n}",
                    cfg.n_heads
                ),
            });
        }
        let split = matches!(mode, BlockMode::Tp | BlockMode::TpSp);
        let mut params = Vec::with_capacity(12);
        for name in BLOCK_PARAMS {
            let full = get(map, prefix, name)?;
            let held = match name {
                "attn.q.weight" | "attn.k.weight" | "attn.v.weight" | "fc1.weight" | "fc1.bias"
                    if split =>
                {
                    Held::Split(0)
                }
                "attn.o.weight" | "fc2.weight" if split => Held::Split(1),
                _ => Held::Whole,
            };
            let t = match held {
                Held::Whole => full,
                Held::Split(d) => shard_even(&full, d, comm, layer)?,
            };
            let needs_grad_sum = match mode {
                BlockMode::Reference | BlockMode::Tp => false,
                BlockMode::TpSp => held == Held::Whole,
                BlockMode::Ulysses => true,
            };
            params.push(Param {
                name: format!("{prefix}{name}"),
                var: var(&t)?,
                held,
                needs_grad_sum,
            });
        }
        let comm = (mode != BlockMode::Reference).then(|| comm.clone());
        Ok(Block { mode, cfg, comm, params })
    }

    /// The parameters in [`BLOCK_PARAMS`] order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The mode.
    pub fn mode(&self) -> BlockMode {
        self.mode
    }

    fn p(&self, i: usize) -> &Tensor {
        self.params[i].var.as_tensor()
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, Comm::size)
    }

    fn shape_err(&self, detail: String) -> Error {
        Error::Shape {
            rank: self.comm.as_ref().map_or(0, Comm::rank),
            layer: "transformer block",
            detail,
        }
    }

    /// Apply the block.
    ///
    /// # Errors
    /// [`Error::Shape`] for an input that is not `[B, S, D]` or (sequence-parallel modes) a
    /// sequence that does not divide; candle and collective errors.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, d) = x
            .dims3()
            .map_err(|_| self.shape_err(format!("input {:?} is not [B, S, D]", x.dims())))?;
        if d % self.cfg.n_heads != 0 {
            return Err(self.shape_err(format!(
                "d_model {d} does not divide into {} heads",
                self.cfg.n_heads
            )));
        }
        let heads_local = self.cfg.n_heads / self.world();
        let eps = self.cfg.eps;
        let a = layer_norm(x, self.p(0), self.p(1), eps)?;
        let att_in = match (&self.comm, self.mode) {
            (Some(c), BlockMode::Tp) => ops::copy_to_parallel_region(&a, c)?,
            (Some(c), BlockMode::TpSp) => ops::gather_from_sequence_parallel_region(&a, c, 1)?,
            _ => a,
        };
        let q = linear(&att_in, self.p(2), None)?;
        let k = linear(&att_in, self.p(3), None)?;
        let v = linear(&att_in, self.p(4), None)?;
        let att = match (&self.comm, self.mode) {
            (Some(c), BlockMode::Ulysses) => {
                // Sequence shards → head shards (full sequence), attention, and back.
                let to_heads = |t: &Tensor| ops::all_to_all(t, c, 2, 1);
                let att = attention(
                    &to_heads(&q)?,
                    &to_heads(&k)?,
                    &to_heads(&v)?,
                    heads_local,
                    self.cfg.causal,
                )?;
                ops::all_to_all(&att, c, 1, 2)?
            }
            _ => attention(&q, &k, &v, heads_local, self.cfg.causal)?,
        };
        let o = linear(&att, self.p(5), None)?;
        let o = match (&self.comm, self.mode) {
            (Some(c), BlockMode::Tp) => ops::reduce_from_parallel_region(&o, c)?,
            (Some(c), BlockMode::TpSp) => {
                ops::reduce_scatter_to_sequence_parallel_region(&o, c, 1)?
            }
            _ => o,
        };
        let h = (x + o)?;
        let b = layer_norm(&h, self.p(6), self.p(7), eps)?;
        let b = match (&self.comm, self.mode) {
            (Some(c), BlockMode::Tp) => ops::copy_to_parallel_region(&b, c)?,
            (Some(c), BlockMode::TpSp) => ops::gather_from_sequence_parallel_region(&b, c, 1)?,
            _ => b,
        };
        let f = linear(&b, self.p(8), Some(self.p(9)))?.gelu_erf()?;
        let f = linear(&f, self.p(10), None)?;
        let f = match (&self.comm, self.mode) {
            (Some(c), BlockMode::Tp) => ops::reduce_from_parallel_region(&f, c)?,
            (Some(c), BlockMode::TpSp) => {
                ops::reduce_scatter_to_sequence_parallel_region(&f, c, 1)?
            }
            _ => f,
        };
        // fc2's bias once, after the reduction.
        Ok((h + f.broadcast_add(self.p(11))?)?)
    }
}

/// This rank's shard of the sequence (dim 1) of a `[B, S, D]` tensor, for the sequence-parallel
/// modes.
///
/// # Errors
/// [`Error::Shape`] when `S` does not divide by the world size.
pub fn sequence_shard(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    shard_even(x, 1, comm, "sequence parallel: the sequence length")
}

/// Sum over the group the gradients of the parameters marked
/// [`Param::needs_grad_sum`] (replicated parameters trained on sequence shards), in place in
/// `grads`, in one allreduce per dtype.
///
/// # Collective contract
/// Every rank calls it with the same parameter list.
///
/// # Errors
/// Collective and candle errors.
pub fn sum_replicated_grads(params: &[Param], grads: &mut GradStore, comm: &Comm) -> Result<()> {
    let wanted: Vec<&Param> = params.iter().filter(|p| p.needs_grad_sum).collect();
    if wanted.is_empty() || comm.size() == 1 {
        return Ok(());
    }
    let mut flat = Vec::with_capacity(wanted.len());
    for p in &wanted {
        let g = match grads.get(p.var.as_tensor()) {
            Some(g) => g.to_dtype(DType::F32)?.flatten_all()?,
            None => Tensor::zeros(p.var.elem_count(), DType::F32, p.var.device())?,
        };
        flat.push(g);
    }
    let sum = ops::all_reduce(&Tensor::cat(&flat, 0)?, comm, ReduceOp::Sum)?;
    let mut off = 0;
    for p in wanted {
        let n = p.var.elem_count();
        let g = sum.narrow(0, off, n)?.reshape(p.var.dims())?.to_dtype(p.var.dtype())?;
        grads.insert(p.var.as_tensor(), g);
        off += n;
    }
    Ok(())
}
