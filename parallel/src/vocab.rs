//! Vocab-parallel embedding and cross-entropy (Megatron): the vocabulary is sharded, no rank
//! ever holds the full embedding table or the full logits.

use std::ops::Range;

use candle_core::{DType, Device, Tensor, Var};
use tutti_collectives::{Comm, ReduceOp};

use crate::error::{Error, Result};
use crate::ops;
use crate::shard::{shard, shard_range};

/// Token ids of an integer tensor, on the host.
pub(crate) fn token_ids(tokens: &Tensor) -> Result<Vec<i64>> {
    let flat = tokens.flatten_all()?;
    Ok(match tokens.dtype() {
        DType::I64 => flat.to_vec1::<i64>()?,
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        DType::U8 => flat.to_vec1::<u8>()?.into_iter().map(i64::from).collect(),
        d => {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "token ids must be i64, u32 or u8, not {d:?}"
            ))))
        }
    })
}

/// For each id: (local row, 1.0) when `range` owns it, else (0, 0.0).
fn localise(ids: &[i64], range: &Range<usize>, device: &Device) -> Result<(Tensor, Tensor)> {
    let mut rows = Vec::with_capacity(ids.len());
    let mut mask = Vec::with_capacity(ids.len());
    for &t in ids {
        let owned = t >= range.start as i64 && t < range.end as i64;
        rows.push(if owned { (t - range.start as i64) as u32 } else { 0 });
        mask.push(if owned { 1f32 } else { 0f32 });
    }
    let n = ids.len();
    Ok((Tensor::from_vec(rows, n, device)?, Tensor::from_vec(mask, (n, 1), device)?))
}

/// An embedding table sharded by rows (token ids): rank `r` owns ids
/// [`shard_range`]`(vocab, r, N)` (uneven vocabularies allowed). Each rank looks up the ids it
/// owns (zeros for the others) and an allreduce (`g`: identity backward) sums the rows.
///
/// # Collective contract
/// Every rank builds it from the same full table and calls `forward` with the same tokens.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    weight: Var,
    range: Range<usize>,
    vocab: usize,
    comm: Comm,
}

impl VocabParallelEmbedding {
    /// Take this rank's rows of a full `[vocab, d]` table.
    ///
    /// # Errors
    /// [`Error::Shape`] for a table that is not 2-D.
    pub fn from_full(weight: &Tensor, comm: &Comm) -> Result<Self> {
        let (vocab, _) = weight.dims2().map_err(|_| Error::Shape {
            rank: comm.rank(),
            layer: "VocabParallelEmbedding",
            detail: format!("the table must be [vocab, d], not {:?}", weight.dims()),
        })?;
        Ok(VocabParallelEmbedding {
            weight: Var::from_tensor(&shard(weight, 0, comm)?)?,
            range: shard_range(vocab, comm.rank(), comm.size()),
            vocab,
            comm: comm.clone(),
        })
    }

    /// Rows of `tokens` (an integer tensor of any shape): `[..., d]`, replicated.
    ///
    /// # Errors
    /// Candle and collective errors; ids outside the vocabulary give zero rows on every rank
    /// (as no rank owns them) — check them upstream.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        ops::reduce_from_parallel_region(&self.forward_partial(tokens)?, &self.comm)
    }

    /// This rank's contribution before the sum over the group: rows of the ids it owns, zeros
    /// for the others (`[..., d]`). Megatron-SP reduce-scatters it along the sequence instead of
    /// allreducing it.
    ///
    /// # Errors
    /// Candle errors.
    pub fn forward_partial(&self, tokens: &Tensor) -> Result<Tensor> {
        let ids = token_ids(tokens)?;
        let (rows, mask) = localise(&ids, &self.range, self.weight.device())?;
        let e = self
            .weight
            .as_tensor()
            .index_select(&rows, 0)?
            .broadcast_mul(&mask.to_dtype(self.weight.dtype())?)?;
        let mut shape = tokens.dims().to_vec();
        shape.push(self.weight.dim(1)?);
        Ok(e.reshape(shape)?)
    }

    /// The ids this rank owns.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The full vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The local rows `[range.len(), d]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }
}

/// Cross-entropy over a vocabulary sharded across the ranks (Megatron's vocab-parallel loss):
/// `logits` are this rank's `[..., V_r]` logits for the ids in `range` (the rows of its
/// vocab-parallel LM head), `targets` the full target ids (same on every rank, shape of the
/// leading dims). Returns the mean of `logsumexp(logits) - logits[target]` over the targets
/// that are not `ignore_index` (PyTorch's `cross_entropy(reduction='mean', ignore_index=…)`),
/// replicated on every rank.
///
/// Three allreduces forward (the row maximum, the sum of exponentials, the target logit), none
/// backward: the gradient of each rank's logits, `softmax - onehot`, is computed locally.
/// With no valid target the result is NaN, as in PyTorch.
///
/// The LM head that produced `logits` is vocab-parallel too: its (replicated) input must pass
/// through [`crate::copy_to_parallel_region`] (a [`crate::ColumnParallelLinear`] does), so the
/// ranks' gradients of that input are summed.
///
/// # Collective contract
/// Every rank calls it with logits of the same leading shape, the same targets and its own
/// `range` (the ranges partition the vocabulary).
///
/// # Errors
/// Collective and candle errors; [`Error::Shape`] when the targets do not match the logits'
/// leading dims or `range` does not match the logits' last dim.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    range: Range<usize>,
    ignore_index: Option<i64>,
    comm: &Comm,
) -> Result<Tensor> {
    let dims = logits.dims();
    let Some((&v, lead)) = dims.split_last() else {
        return Err(Error::Shape {
            rank: comm.rank(),
            layer: "vocab_parallel_cross_entropy",
            detail: "logits must have a vocabulary dim".into(),
        });
    };
    let n: usize = lead.iter().product();
    let ids = token_ids(targets)?;
    if ids.len() != n || v != range.len() {
        return Err(Error::Shape {
            rank: comm.rank(),
            layer: "vocab_parallel_cross_entropy",
            detail: format!(
                "logits {dims:?} need {n} targets (got {}) and a shard of {v} ids (got {range:?})",
                ids.len()
            ),
        });
    }
    let logits = logits.reshape((n, v))?;
    let device = logits.device();
    // 1: the global row maximum, a constant for autograd (it cancels in the gradient).
    let local_max = logits.detach().max_keepdim(1)?;
    let m = ops::all_reduce(&local_max, comm, ReduceOp::Max)?;
    let shifted = logits.broadcast_sub(&m)?;
    // 2: sum of exponentials over the whole vocabulary.
    let sumexp = ops::reduce_from_parallel_region(&shifted.exp()?.sum_keepdim(1)?, comm)?;
    // 3: the target's (shifted) logit, from the rank that owns it.
    let (rows, owned) = localise(&ids, &range, device)?;
    let picked = shifted
        .gather(&rows.reshape((n, 1))?, 1)?
        .broadcast_mul(&owned.to_dtype(shifted.dtype())?)?;
    let target = ops::reduce_from_parallel_region(&picked, comm)?;
    let per_token = (sumexp.log()? - target)?;
    let valid: Vec<f32> =
        ids.iter().map(|&t| if Some(t) == ignore_index { 0.0 } else { 1.0 }).collect();
    let count: f32 = valid.iter().sum();
    let valid = Tensor::from_vec(valid, (n, 1), device)?.to_dtype(per_token.dtype())?;
    Ok(((per_token * valid)?.sum_all()? / f64::from(count))?)
}
