//! Megatron tensor-parallel linear layers.

use candle_core::{Module, Tensor, Var};
use tutti_collectives::Comm;

use crate::error::Result;
use crate::ops;
use crate::shard::shard_even;

/// `x @ w^T (+ b)` for `x` of any rank (the last dim is the features).
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    let (rows, inf) = match dims.split_last() {
        Some((inf, lead)) => (lead.iter().product::<usize>(), *inf),
        None => (1, 1),
    };
    let y = x.reshape((rows, inf))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims.to_vec();
    if let Some(last) = out.last_mut() {
        *last = w.dim(0)?;
    }
    y.reshape(out)
}

/// A linear layer whose output features are split across the ranks (Megatron's column
/// parallel): rank `r` owns rows `[r*out/N, (r+1)*out/N)` of the `[out, in]` weight and the
/// same part of the bias. Forward: `f` (identity, gradient allreduced), local matmul, and, with
/// `gather_output`, an allgather of the output features.
///
/// # Collective contract
/// Every rank of the group builds it from the same full weight and calls `forward` with an
/// input of the same shape.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    weight: Var,
    bias: Option<Var>,
    gather_output: bool,
    comm: Comm,
}

impl ColumnParallelLinear {
    /// Take this rank's shard of a full `[out, in]` weight (nn.Linear convention) and `[out]`
    /// bias. Only the shard is kept (1/N of the weight per rank).
    ///
    /// # Errors
    /// [`crate::Error::Shape`] when `out` does not divide by the world size.
    pub fn from_full(
        weight: &Tensor,
        bias: Option<&Tensor>,
        gather_output: bool,
        comm: &Comm,
    ) -> Result<Self> {
        let w = shard_even(weight, 0, comm, "ColumnParallelLinear")?;
        let b = bias.map(|b| shard_even(b, 0, comm, "ColumnParallelLinear bias")).transpose()?;
        Ok(ColumnParallelLinear {
            weight: Var::from_tensor(&w)?,
            bias: b.map(|b| Var::from_tensor(&b)).transpose()?,
            gather_output,
            comm: comm.clone(),
        })
    }

    /// Apply it to `x` (`[..., in]`, replicated): `[..., out/N]`, or `[..., out]` with
    /// `gather_output`.
    ///
    /// # Errors
    /// Candle and collective errors.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = ops::copy_to_parallel_region(x, &self.comm)?;
        let y = linear(&x, self.weight.as_tensor(), self.bias.as_ref().map(|b| b.as_tensor()))?;
        if self.gather_output {
            let last = y.rank() - 1;
            ops::gather_from_parallel_region(&y, &self.comm, last)
        } else {
            Ok(y)
        }
    }

    /// The weight shard `[out/N, in]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The bias shard `[out/N]`.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The trainable shards (weight, then bias).
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone()).chain(self.bias.clone()).collect()
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(ColumnParallelLinear::forward(self, xs)?)
    }
}

/// A linear layer whose input features are split across the ranks (Megatron's row parallel):
/// rank `r` owns columns `[r*in/N, (r+1)*in/N)` of the `[out, in]` weight. Forward: (unless the
/// input is already parallel) keep this rank's part of the input features, local matmul, `g`
/// (allreduce of the partial outputs), then the full bias, added once after the reduction.
///
/// # Collective contract
/// As [`ColumnParallelLinear`].
#[derive(Debug)]
pub struct RowParallelLinear {
    weight: Var,
    bias: Option<Var>,
    input_is_parallel: bool,
    comm: Comm,
}

impl RowParallelLinear {
    /// Take this rank's shard of a full `[out, in]` weight; the `[out]` bias is replicated.
    /// With `input_is_parallel` the input is already split (the output of a
    /// [`ColumnParallelLinear`] without gather); otherwise `forward` splits it.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] when `in` does not divide by the world size.
    pub fn from_full(
        weight: &Tensor,
        bias: Option<&Tensor>,
        input_is_parallel: bool,
        comm: &Comm,
    ) -> Result<Self> {
        let w = shard_even(weight, 1, comm, "RowParallelLinear")?;
        Ok(RowParallelLinear {
            weight: Var::from_tensor(&w)?,
            bias: bias.map(|b| Var::from_tensor(&b.copy()?)).transpose()?,
            input_is_parallel,
            comm: comm.clone(),
        })
    }

    /// Apply it to `x` (`[..., in/N]` when the input is parallel, else `[..., in]`):
    /// `[..., out]`, replicated.
    ///
    /// # Errors
    /// Candle and collective errors; [`crate::Error::Shape`] when a replicated input's features
    /// do not divide.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.input_is_parallel {
            x.clone()
        } else {
            let last = x.rank().saturating_sub(1);
            ops::scatter_to_parallel_region(x, &self.comm, last)?
        };
        let y = linear(&x, self.weight.as_tensor(), None)?;
        let y = ops::reduce_from_parallel_region(&y, &self.comm)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b.as_tensor())?,
            None => y,
        })
    }

    /// The weight shard `[out, in/N]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The (replicated) bias.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The trainable parameters (weight shard, then bias). The bias is replicated: its gradient
    /// is the same on every rank.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone()).chain(self.bias.clone()).collect()
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(RowParallelLinear::forward(self, xs)?)
    }
}
