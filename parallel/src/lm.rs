//! A tiny causal language model (seed 004): token embedding → transformer block(s) → final
//! LayerNorm → LM head, next-token cross-entropy with padding ignored; single-process or Megatron
//! tensor parallel with the vocabulary sharded (embedding and loss), optionally with sequence
//! parallelism.

use std::collections::HashMap;

use candle_core::{backprop::GradStore, DType, Tensor, Var, D};
use tutti_collectives::Comm;

use crate::block::{layer_norm, sum_replicated_grads, Block, BlockConfig, BlockMode, Held, Param};
use crate::error::{Error, Result};
use crate::ops;
use crate::tp::linear;
use crate::vocab::{token_ids, vocab_parallel_cross_entropy, VocabParallelEmbedding};

/// How a [`TinyLm`] is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LmMode {
    /// Everything on one rank (the oracle): plain embedding, block, softmax cross-entropy.
    Reference,
    /// Megatron TP blocks, vocab-parallel embedding, LM head and loss.
    Tp,
    /// As `Tp`, with the LayerNorm/residual regions sharded on the sequence.
    TpSp,
}

/// Settings of a [`TinyLm`].
#[derive(Clone, Copy, Debug)]
pub struct LmConfig {
    /// The blocks' settings (the LM uses a causal mask).
    pub block: BlockConfig,
    /// Number of blocks; their weights are named `block.` (one block) or `block.{i}.`.
    pub n_blocks: usize,
    /// Targets with this id (padding) are left out of the loss.
    pub ignore_index: Option<i64>,
}

/// The tiny LM. Parameter names: `embed.weight` `[vocab, d]`, the block's under `block.`,
/// `lnf.weight`, `lnf.bias`, `lm_head.weight` `[vocab, d]` (untied).
///
/// # Collective contract
/// Every rank of the group builds it from the same weights and calls `loss` with the same
/// tokens.
#[derive(Debug)]
pub struct TinyLm {
    mode: LmMode,
    cfg: LmConfig,
    comm: Comm,
    embed: Option<VocabParallelEmbedding>,
    embed_ref: Option<Var>,
    blocks: Vec<Block>,
    lnf: [Var; 2],
    head: Var,
    params: Vec<Param>,
}

fn tensor(map: &HashMap<String, Tensor>, name: &str) -> Result<Tensor> {
    map.get(name).cloned().ok_or_else(|| Error::Golden {
        case: "tiny LM weights".into(),
        detail: format!("no tensor {name:?}"),
    })
}

impl TinyLm {
    /// Build from full weights; each rank keeps its vocabulary rows and its block shards.
    ///
    /// # Errors
    /// [`Error::Shape`] when heads or the FFN width do not divide by the world; a missing
    /// tensor.
    pub fn from_weights(
        map: &HashMap<String, Tensor>,
        cfg: LmConfig,
        mode: LmMode,
        comm: &Comm,
    ) -> Result<TinyLm> {
        let bmode = match mode {
            LmMode::Reference => BlockMode::Reference,
            LmMode::Tp => BlockMode::Tp,
            LmMode::TpSp => BlockMode::TpSp,
        };
        let sp = mode == LmMode::TpSp;
        let mut params = Vec::new();
        let embed_full = tensor(map, "embed.weight")?;
        let (embed, embed_ref) = if mode == LmMode::Reference {
            let v = Var::from_tensor(&embed_full.copy()?)?;
            params.push(Param {
                name: "embed.weight".into(),
                var: v.clone(),
                held: Held::Whole,
                needs_grad_sum: false,
            });
            (None, Some(v))
        } else {
            let e = VocabParallelEmbedding::from_full(&embed_full, comm)?;
            params.push(Param {
                name: "embed.weight".into(),
                var: e.weight().clone(),
                held: Held::Split(0),
                needs_grad_sum: false,
            });
            (Some(e), None)
        };
        let mut blocks = Vec::with_capacity(cfg.n_blocks);
        for i in 0..cfg.n_blocks {
            let prefix =
                if cfg.n_blocks == 1 { "block.".to_string() } else { format!("block.{i}.") };
            let b = Block::from_weights(map, &prefix, cfg.block, bmode, comm)?;
            params.extend(b.params().iter().cloned());
            blocks.push(b);
        }
        let lnf = [
            Var::from_tensor(&tensor(map, "lnf.weight")?.copy()?)?,
            Var::from_tensor(&tensor(map, "lnf.bias")?.copy()?)?,
        ];
        for (name, v) in ["lnf.weight", "lnf.bias"].iter().zip(&lnf) {
            params.push(Param {
                name: (*name).into(),
                var: v.clone(),
                held: Held::Whole,
                needs_grad_sum: sp,
            });
        }
        let head_full = tensor(map, "lm_head.weight")?;
        let (head, held) = if mode == LmMode::Reference {
            (Var::from_tensor(&head_full.copy()?)?, Held::Whole)
        } else {
            (Var::from_tensor(&crate::shard::shard(&head_full, 0, comm)?)?, Held::Split(0))
        };
        params.push(Param {
            name: "lm_head.weight".into(),
            var: head.clone(),
            held,
            needs_grad_sum: false,
        });
        Ok(TinyLm { mode, cfg, comm: comm.clone(), embed, embed_ref, blocks, lnf, head, params })
    }

    /// Every parameter (this rank's part), with how it is held.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The trainable variables.
    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    /// Bytes of parameters this rank holds.
    pub fn param_bytes(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes()).sum()
    }

    /// Logits of every position: `[B, S, V]` (Reference) or this rank's vocabulary columns
    /// `[B, S, V_r]` (TP modes), replicated over the sequence.
    ///
    /// # Errors
    /// [`Error::Shape`] when tokens are not `[B, S]` or, with sequence parallelism, `S` does
    /// not divide by the world; candle and collective errors.
    pub fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let (_, s) = tokens.dims2().map_err(|_| Error::Shape {
            rank: self.comm.rank(),
            layer: "TinyLm",
            detail: format!("tokens {:?} are not [batch, seq]", tokens.dims()),
        })?;
        let c = &self.comm;
        let mut x = match (&self.embed, &self.embed_ref) {
            (Some(e), _) if self.mode == LmMode::TpSp => {
                if s % c.size() != 0 {
                    return Err(Error::Shape {
                        rank: c.rank(),
                        layer: "TinyLm (sequence parallel)",
                        detail: format!(
                            "sequence length {s} does not divide by the world size {}",
                            c.size()
                        ),
                    });
                }
                ops::reduce_scatter_to_sequence_parallel_region(&e.forward_partial(tokens)?, c, 1)?
            }
            (Some(e), _) => e.forward(tokens)?,
            (None, Some(w)) => {
                let ids = tokens.flatten_all()?.to_dtype(DType::U32)?;
                let d = w.dim(1)?;
                w.as_tensor().index_select(&ids, 0)?.reshape((tokens.dim(0)?, s, d))?
            }
            (None, None) => unreachable!("built with one of the two embeddings"),
        };
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        let z =
            layer_norm(&x, self.lnf[0].as_tensor(), self.lnf[1].as_tensor(), self.cfg.block.eps)?;
        let z = match self.mode {
            LmMode::Reference => z,
            LmMode::Tp => ops::copy_to_parallel_region(&z, c)?,
            LmMode::TpSp => ops::gather_from_sequence_parallel_region(&z, c, 1)?,
        };
        Ok(linear(&z, self.head.as_tensor(), None)?)
    }

    /// Next-token cross-entropy: predictions `logits[:, :-1]`, targets `tokens[:, 1:]`, mean
    /// over the targets that are not `ignore_index`. Returns the (replicated) loss and the
    /// logits.
    ///
    /// # Errors
    /// As [`TinyLm::logits`].
    pub fn loss(&self, tokens: &Tensor) -> Result<(Tensor, Tensor)> {
        let logits = self.logits(tokens)?;
        let (b, s, v) = logits.dims3()?;
        let pred = logits.narrow(1, 0, s - 1)?.contiguous()?;
        let targets = tokens.narrow(1, 1, s - 1)?.contiguous()?;
        let loss = match &self.embed {
            Some(e) => vocab_parallel_cross_entropy(
                &pred,
                &targets,
                e.range(),
                self.cfg.ignore_index,
                &self.comm,
            )?,
            None => {
                let ids = token_ids(&targets)?;
                let ls = candle_nn::ops::log_softmax(&pred.reshape((b * (s - 1), v))?, D::Minus1)?;
                let mut pick = vec![0f32; ids.len() * v];
                let mut count = 0f32;
                for (i, &t) in ids.iter().enumerate() {
                    if Some(t) != self.cfg.ignore_index {
                        pick[i * v + t as usize] = 1.0;
                        count += 1.0;
                    }
                }
                let pick =
                    Tensor::from_vec(pick, (ids.len(), v), ls.device())?.to_dtype(ls.dtype())?;
                ((ls * pick)?.sum_all()? / -f64::from(count))?
            }
        };
        Ok((loss, logits))
    }

    /// Gradients of `loss` with the sequence-parallel replicated parameters summed over the
    /// group, ready for an optimizer.
    ///
    /// # Errors
    /// Candle and collective errors.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut g = loss.backward()?;
        sum_replicated_grads(&self.params, &mut g, &self.comm)?;
        Ok(g)
    }
}
