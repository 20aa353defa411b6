//! tutti-parallel: training layers on candle (data, tensor, sequence, pipeline parallel).
//!
//! Not built yet: this crate is the workspace's place for the parallel layers (issues "Parallel
//! layers on candle, part 1/2"). It exports nothing so far.
