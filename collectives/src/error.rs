//! The collectives' error type.

use std::time::Duration;

/// Errors of the collectives layer. Transport and group failures arrive as
/// [`Error::Runtime`]; see `docs/errors.md` for what to do about each.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A transport, rendezvous or group error (dead peer, timeout, mismatch, abort, poison).
    #[error(transparent)]
    Runtime(#[from] tutti_runtime::Error),

    /// The call's arguments can never work: wrong buffer lengths, a root outside the group, a
    /// dimension that does not divide. Nothing was sent; fix the call.
    #[error("{}invalid {op} call: {detail}", tutti_runtime::error::rank_prefix(*rank))]
    InvalidArgument {
        /// Local (group) rank.
        rank: usize,
        /// Operation called.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },

    /// An algorithm was forced that cannot run this call (e.g. a power-of-two-only algorithm on
    /// 6 ranks). Nothing was sent; choose another algorithm or let tutti choose.
    #[error("rank {rank}: algorithm {algo} cannot run {op} here: {detail}")]
    Unsupported {
        /// Local (group) rank.
        rank: usize,
        /// Operation called.
        op: &'static str,
        /// The algorithm asked for.
        algo: &'static str,
        /// Why not.
        detail: String,
    },

    /// A schedule broke an executor invariant (a bug in tutti; please report it with the
    /// message). The group is poisoned.
    #[error("rank {rank}: internal error in {op} (seq {seq}) after {elapsed:?}: {detail}")]
    Internal {
        /// Local (group) rank.
        rank: usize,
        /// Operation.
        op: &'static str,
        /// Sequence number.
        seq: u64,
        /// Elapsed.
        elapsed: Duration,
        /// What broke.
        detail: String,
    },

    /// A GPU was asked for and cannot be used: tutti was built without the `cuda` (or `nccl`)
    /// feature, or the CUDA driver / NCCL library is not installed, or the device does not exist.
    /// Nothing was sent; use host buffers or install the driver.
    #[error("rank {rank}: CUDA unavailable: {detail}")]
    CudaUnavailable {
        /// Local (group) rank (0 before a group exists).
        rank: usize,
        /// What is missing.
        detail: String,
    },

    /// A device operation (allocation, copy, synchronisation, NCCL call) failed. The copies
    /// this call had queued were waited for before returning.
    #[error("rank {rank}: device error in {op}: {detail}")]
    Device {
        /// Local (group) rank.
        rank: usize,
        /// Operation.
        op: &'static str,
        /// The device's message.
        detail: String,
    },
}

impl Error {
    /// The peer rank this error blames, when it names one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Error::Runtime(e) => e.peer(),
            _ => None,
        }
    }
}

/// Result alias for the collectives.
pub type Result<T, E = Error> = std::result::Result<T, E>;
