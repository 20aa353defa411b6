//! tutti-parallel: data, tensor and vocab parallel training layers on candle, over tutti's
//! collectives (CPU today; any transport: in-memory, TCP, QUIC).
//!
//! - [`ops`]: communication as autograd operations (Megatron's `f` = [`copy_to_parallel_region`],
//!   `g` = [`reduce_from_parallel_region`], [`gather_from_parallel_region`],
//!   [`scatter_to_parallel_region`], the sequence-parallel pair and Ulysses' all-to-all) and
//!   eager tensor collectives. All take a [`Comm`], so sub-groups (2-D data × tensor layouts)
//!   work.
//! - [`DataParallel`]: parameters broadcast from rank 0, gradients averaged in buckets
//!   (non-blocking), weighted by samples so uneven global batches are exact, accumulation over
//!   micro-batches with one exchange per optimizer step.
//! - [`ColumnParallelLinear`], [`RowParallelLinear`]: Megatron tensor parallel.
//! - [`VocabParallelEmbedding`], [`vocab_parallel_cross_entropy`]: the vocabulary sharded.
//! - [`Block`]: a pre-LN transformer block as the single-process reference, Megatron TP,
//!   TP + sequence parallel, or Ulysses sequence parallel ([`BlockMode`]).
//! - [`TinyLm`]: embedding → blocks → LayerNorm → LM head with the vocab-parallel loss.
//! - [`Pipeline`]: pipeline stages over send/recv with GPipe and 1F1B schedules.
//! - [`compare`]: tensor comparisons where NaN and infinity never pass.
//! - [`golden`]: runs the PyTorch golden cases G1–G5 (`tutti-golden`).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use tutti_parallel::{ColumnParallelLinear, Comm, RowParallelLinear};
//!
//! // A 2-layer MLP split over 2 ranks (threads over the in-memory transport here).
//! let w1 = Tensor::arange(0f32, 32., &Device::Cpu).unwrap().reshape((8, 4)).unwrap();
//! let w2 = Tensor::ones((4, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
//! let x = Tensor::ones((3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
//! let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
//!     let hs: Vec<_> = Comm::mem_world(2)
//!         .into_iter()
//!         .map(|c| {
//!             let (w1, w2, x) = (&w1, &w2, &x);
//!             s.spawn(move || {
//!                 let fc1 = ColumnParallelLinear::from_full(w1, None, false, &c).unwrap();
//!                 let fc2 = RowParallelLinear::from_full(w2, None, true, &c).unwrap();
//!                 fc2.forward(&fc1.forward(x).unwrap()).unwrap().to_vec2().unwrap()
//!             })
//!         })
//!         .collect();
//!     hs.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! let full = x.matmul(&w1.t().unwrap()).unwrap().matmul(&w2.t().unwrap()).unwrap();
//! assert_eq!(outs[0], full.to_vec2::<f32>().unwrap());
//! assert_eq!(outs[1], outs[0]);
//! ```

pub mod block;
pub mod compare;
pub mod data;
mod dp;
pub mod elastic;
mod error;
pub mod golden;
pub mod lm;
pub mod movebench;
pub mod ops;
pub mod pipeline;
mod ranks;
mod shard;
mod tp;
mod vocab;

pub use block::{
    attention, layer_norm, sequence_shard, sum_replicated_grads, Block, BlockConfig, BlockMode,
    Held, Param, BLOCK_PARAMS,
};
pub use dp::{DataParallel, DpConfig, Stage, StageFn, Synced};
pub use elastic::{ElasticDp, Member, Outcome, Recovery};
pub use error::{Error, Result};
pub use lm::{LmConfig, LmMode, TinyLm};
pub use ops::{
    all_to_all, copy_to_parallel_region, gather_from_parallel_region,
    gather_from_sequence_parallel_region, reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_parallel_region,
};
pub use pipeline::{Pipeline, Schedule, StepResult};
pub use ranks::{launched, run_example, run_ranks};
pub use shard::{shard, shard_even, shard_range};
pub use tp::{ColumnParallelLinear, RowParallelLinear};
pub use tutti_collectives::{Comm, ReduceOp};
pub use vocab::{vocab_parallel_cross_entropy, VocabParallelEmbedding};
