//! Errors of the parallel layers.

/// An error of a parallel layer, a collective under it, or candle.
///
/// Inside candle's `Result` (a layer's `forward`, a backward pass) a tutti error travels as
/// `candle_core::Error::WrappedContext` (context: this error's message); [`Error::from_candle`]
/// (or `?` into [`Result`]) takes the typed error back out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective failed (dead peer, timeout, mismatch between ranks, abort). The error names
    /// the rank, peer, operation and sequence number.
    #[error(transparent)]
    Collective(#[from] tutti_collectives::Error),

    /// A tensor operation failed.
    #[error("candle: {0}")]
    Candle(candle_core::Error),

    /// A shape cannot be split the way the layer needs (a dimension that does not divide by the
    /// world, a rank of the wrong size). Nothing was sent; change the shape or the world size.
    #[error("rank {rank}: {layer}: {detail}")]
    Shape {
        /// Rank in the layer's group.
        rank: usize,
        /// Layer or operation.
        layer: &'static str,
        /// What does not fit.
        detail: String,
    },

    /// Replicated parameters differ across ranks (checked before training starts: different
    /// seeds or checkpoints would silently train different models).
    #[error("rank {rank}: parameter {name:?} differs across ranks: {detail}; load the same weights everywhere or broadcast them from rank 0")]
    ReplicaMismatch {
        /// Rank in the group.
        rank: usize,
        /// Parameter (its index or name).
        name: String,
        /// What differs.
        detail: String,
    },

    /// A golden case file could not be read or does not have the expected tensors.
    #[error("golden case {case}: {detail}")]
    Golden {
        /// Case file.
        case: String,
        /// What is wrong.
        detail: String,
    },
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Unwrap a tutti error that travelled through candle; any other candle error becomes
    /// [`Error::Candle`].
    pub fn from_candle(e: candle_core::Error) -> Error {
        match e {
            candle_core::Error::WrappedContext { wrapped, context } => {
                match wrapped.downcast::<Error>() {
                    Ok(e) => *e,
                    Err(wrapped) => {
                        Error::Candle(candle_core::Error::WrappedContext { wrapped, context })
                    }
                }
            }
            candle_core::Error::WithBacktrace { inner, .. } => Error::from_candle(*inner),
            candle_core::Error::Context { inner, .. } => Error::from_candle(*inner),
            e => Error::Candle(e),
        }
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Error {
        Error::from_candle(e)
    }
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> candle_core::Error {
        match e {
            Error::Candle(c) => c,
            e => {
                let context = e.to_string();
                candle_core::Error::WrappedContext { wrapped: Box::new(e), context }
            }
        }
    }
}
