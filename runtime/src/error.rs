//! The runtime's error type.
//!
//! Every variant names the local rank and, where one is involved, the peer rank, the operation and
//! its sequence number, and how long the operation had been running. The doc of each variant says
//! what the caller should do; `docs/errors.md` collects the same advice.

use std::fmt;
use std::time::Duration;

use crate::wire::OpKind;

/// Result alias used throughout the runtime.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What an operation was doing when it failed: enough to find it in every rank's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpContext {
    /// Operation kind from the wire header (allreduce, send, …).
    pub op: OpKind,
    /// Group the operation ran in (0 is the world group).
    pub group: u32,
    /// Collective sequence number within the group.
    pub seq: u64,
    /// Step (tag) within the operation.
    pub step: u32,
    /// Payload bytes moved so far by the failed transfer.
    pub bytes_done: u64,
    /// Payload bytes the failed transfer was to move.
    pub bytes: u64,
    /// Time since the transfer was posted.
    pub elapsed: Duration,
}

impl fmt::Display for OpContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (group {}, seq {}, step {}) after {:.3?}, {} of {} bytes done",
            self.op, self.group, self.seq, self.step, self.elapsed, self.bytes_done, self.bytes
        )
    }
}

/// Errors of the runtime layer: transports, rendezvous, stores and groups.
///
/// Errors are `Clone` because one failure completes many pending operations and poisons the group:
/// later calls return the same error.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection to `peer` was closed or reset: the peer process most likely died.
    ///
    /// What to do: look at the peer's log for the cause; the group is poisoned, so rebuild it (new
    /// rendezvous) with the surviving ranks or restart the job.
    #[error(
        "rank {rank}: connection to peer rank {peer} lost{}: {detail}; the peer process \
         probably died or was killed: check rank {peer}'s log, then rebuild the group",
        during(ctx)
    )]
    PeerLost {
        /// Local rank.
        rank: usize,
        /// The rank whose connection failed.
        peer: usize,
        /// The operation that observed it, when one was waiting on that peer.
        ctx: Option<Box<OpContext>>,
        /// The OS error or "closed by peer".
        detail: String,
    },

    /// A peer aborted the job (its `abort()`, or a failure it detected and propagated). The
    /// reason is the peer's own message and usually names the culprit.
    ///
    /// What to do: read the reason; rebuild the group without the culprit or fix the call.
    #[error("rank {rank}: peer rank {peer} aborted: {reason}")]
    PeerAborted {
        /// Local rank.
        rank: usize,
        /// The rank that sent the abort.
        peer: usize,
        /// Its reason.
        reason: String,
    },

    /// An operation did not complete before its deadline.
    ///
    /// What to do: the named peer never sent (or never received) what this rank waited for. It may
    /// be stuck, much slower, or calling a different collective; check its log and stack. Raise
    /// the timeout only if the peer is legitimately slower.
    #[error(
        "rank {rank}: timed out waiting for peer rank {peer} in {ctx} (timeout {timeout:?}); \
         rank {peer} did not send/receive in time: it may be stuck, slow or calling a different \
         collective"
    )]
    Timeout {
        /// Local rank.
        rank: usize,
        /// The rank not heard from.
        peer: usize,
        /// The operation that timed out.
        ctx: Box<OpContext>,
        /// The configured timeout.
        timeout: Duration,
    },

    /// A receive from any source saw no message with its tag from any rank before its deadline.
    ///
    /// What to do: every rank that could send it is stuck, slow, or sends with another tag;
    /// check their logs and stacks. Raise the timeout only if they are legitimately slower.
    #[error(
        "rank {rank}: no message with tag {tag} arrived from any rank within {timeout:?} \
         (receive from any source): the ranks that should send it are stuck, slow, or use \
         another tag"
    )]
    AnySourceTimeout {
        /// Local rank.
        rank: usize,
        /// The user tag waited for.
        tag: u32,
        /// The configured timeout.
        timeout: Duration,
    },

    /// The peer sent a message whose descriptor differs from what this rank posted: the ranks are
    /// not calling the same collective with the same arguments.
    ///
    /// What to do: this is a bug in the calling program (different op, dtype, count or root on
    /// different ranks, or one rank skipped a call) or in its launch (the settings digest in the
    /// descriptors differs: a forced algorithm, segment or piece size set on some ranks only).
    /// Both descriptors are printed; fix the call sites so every rank of the group makes the same
    /// sequence of calls, or give every rank the same settings.
    #[error(
        "rank {rank}: collective mismatch with peer rank {peer}: this rank expected {expected}, \
         rank {peer} sent {got}; every rank of a group must make the same calls with the same \
         op, dtype, count and root, under the same settings (TUTTI_ALGO, TUTTI_SEGMENT_BYTES, \
         TUTTI_CHUNK_BYTES, TUTTI_DIRECT)"
    )]
    Mismatch {
        /// Local rank.
        rank: usize,
        /// The rank whose message did not match.
        peer: usize,
        /// What this rank posted.
        expected: String,
        /// What arrived.
        got: String,
    },

    /// A message was longer than the buffer posted for it.
    ///
    /// What to do: the ranks disagree on a length; make every rank pass the same counts.
    #[error(
        "rank {rank}: peer rank {peer} sent {got} bytes for {ctx} but only {posted} were posted; \
         ranks disagree on the message length"
    )]
    TooLong {
        /// Local rank.
        rank: usize,
        /// Sender.
        peer: usize,
        /// The receive that was too short.
        ctx: Box<OpContext>,
        /// Bytes posted.
        posted: u64,
        /// Bytes announced by the sender.
        got: u64,
    },

    /// The peer sent more unmatched data than the unexpected-message budget allows.
    ///
    /// What to do: the peer is far ahead or sends messages nobody receives; check for mismatched
    /// calls, or raise `unexpected_limit` if this is legitimate.
    #[error(
        "rank {rank}: peer rank {peer} sent {bytes} bytes for which no receive was posted, over \
         the unexpected-message budget of {limit} bytes"
    )]
    UnexpectedOverflow {
        /// Local rank.
        rank: usize,
        /// Sender.
        peer: usize,
        /// Bytes that would be buffered.
        bytes: u64,
        /// Budget.
        limit: u64,
    },

    /// A peer violated the wire protocol (bad magic, impossible header).
    ///
    /// What to do: something other than a tutti rank of this job wrote on the connection, or a
    /// version mismatch; check both binaries are the same build.
    #[error("rank {rank}: protocol error from peer rank {peer}: {detail}")]
    Protocol {
        /// Local rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What was wrong.
        detail: String,
    },

    /// The group or transport was aborted by `abort()`.
    ///
    /// What to do: nothing more can run on this group; rebuild it.
    #[error("rank {rank}: group aborted: {reason}")]
    Aborted {
        /// Local rank.
        rank: usize,
        /// The reason given to `abort`.
        reason: String,
    },

    /// An earlier error poisoned this group; every later call returns it.
    ///
    /// What to do: rebuild the group (a new rendezvous), possibly with fewer ranks.
    #[error("group poisoned by an earlier error (rebuild the group): {0}")]
    Poisoned(Box<Error>),

    /// The caller passed arguments that can never work (bad rank, wrong buffer length, …).
    ///
    /// What to do: fix the call; nothing was sent.
    #[error("rank {rank}: invalid argument to {op}: {detail}")]
    InvalidArgument {
        /// Local rank.
        rank: usize,
        /// The operation called.
        op: String,
        /// What is wrong.
        detail: String,
    },

    /// Configuration (environment variables, options) could not be used.
    ///
    /// What to do: fix the named variable or option.
    #[error("configuration error: {0}")]
    Config(String),

    /// Rendezvous failed: ranks could not find each other, or disagree about the job.
    ///
    /// What to do: read the message; it names the ranks and the disagreement.
    #[error("rank {rank}: rendezvous failed: {detail}")]
    Rendezvous {
        /// Local rank.
        rank: usize,
        /// What went wrong, naming ranks.
        detail: String,
    },

    /// The key-value store failed or refused a request.
    ///
    /// What to do: check that rank 0 (the store host) is alive and `MASTER_ADDR`/`MASTER_PORT`
    /// point to it.
    #[error("store error ({addr}): {detail}")]
    Store {
        /// Store address or path.
        addr: String,
        /// What went wrong.
        detail: String,
    },

    /// A store key was not set within the wait's timeout: whoever should write it (usually a
    /// rank during rendezvous) has not. The store itself answered.
    ///
    /// What to do: callers turn this into an error naming the rank that owes the key; on its
    /// own, check that every rank of the job started and uses the same store.
    #[error("store ({addr}): timed out after {after:?} waiting for key {key:?}")]
    StoreTimeout {
        /// Store address or path.
        addr: String,
        /// The key waited for.
        key: String,
        /// How long it waited.
        after: Duration,
    },

    /// A local I/O error outside any operation (binding a socket, reading a file).
    ///
    /// What to do: the message names the resource; fix permissions, ports or addresses.
    #[error("{}{what}: {detail}", rank_prefix(*rank))]
    Io {
        /// Local rank (`usize::MAX` before the rank is known).
        rank: usize,
        /// What was being done.
        what: String,
        /// The OS error.
        detail: String,
    },

    /// This rank may not go on after a failure: the survivors that agreed on the next
    /// membership left it out (it was cut off from the others, or too slow to answer), or too
    /// few ranks were left for any side to go on, or the store the agreement runs through
    /// could not be reached.
    ///
    /// What to do: stop this process (its state is no longer the job's). The message names
    /// the ranks this one lost; if the job went on without it, a replacement can join with
    /// `grow`.
    #[error("rank {rank}: cut off at membership epoch {epoch}: {detail}; lost ranks {lost:?}")]
    CutOff {
        /// Local rank (in the membership that failed).
        rank: usize,
        /// The membership epoch that failed.
        epoch: u64,
        /// Ranks of that membership this rank could not count among the survivors.
        lost: Vec<usize>,
        /// Why this rank stops.
        detail: String,
    },

    /// A feature this build was compiled without was requested.
    ///
    /// What to do: rebuild with the named cargo feature.
    #[error("{0} support was not compiled in; rebuild tutti with the matching cargo feature")]
    NotCompiledWith(&'static str),
}

fn during(ctx: &Option<Box<OpContext>>) -> String {
    ctx.as_ref().map_or_else(String::new, |c| format!(" during {c}"))
}

impl Error {
    /// Wrap `self` as the poisoning cause of a group, without nesting poison in poison.
    pub fn poisoned(&self) -> Error {
        match self {
            Error::Poisoned(_) => self.clone(),
            other => Error::Poisoned(Box::new(other.clone())),
        }
    }

    /// True when the error leaves the group unusable (it must be rebuilt).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Error::InvalidArgument { .. } | Error::Config(_))
    }

    /// Whether this error means a rank is gone or cut off — what
    /// [`Group::shrink`](crate::Group::shrink) recovers from: a lost or silent peer, a peer's
    /// abort (it may be shrinking), an abort, or a group poisoned by one of these. Not: a
    /// mismatched call, a protocol violation or a bad argument, which a smaller world would
    /// repeat.
    pub fn is_lost_rank(&self) -> bool {
        match self {
            Error::Poisoned(inner) => inner.is_lost_rank(),
            Error::PeerLost { .. }
            | Error::PeerAborted { .. }
            | Error::Timeout { .. }
            | Error::Aborted { .. } => true,
            _ => false,
        }
    }

    /// The peer rank this error blames, when it names one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Error::PeerLost { peer, .. }
            | Error::PeerAborted { peer, .. }
            | Error::Timeout { peer, .. }
            | Error::Mismatch { peer, .. }
            | Error::TooLong { peer, .. }
            | Error::UnexpectedOverflow { peer, .. }
            | Error::Protocol { peer, .. } => Some(*peer),
            Error::Poisoned(inner) => inner.peer(),
            _ => None,
        }
    }

    pub(crate) fn io(rank: usize, what: impl Into<String>, err: &std::io::Error) -> Error {
        Error::Io { rank, what: what.into(), detail: err.to_string() }
    }
}

/// `"rank R: "` for a message about rank `R`, or nothing when the rank is not known yet
/// (`usize::MAX`: a configuration read before rendezvous), so no message ever names rank
/// 18446744073709551615.
pub fn rank_prefix(rank: usize) -> String {
    if rank == usize::MAX {
        String::new()
    } else {
        format!("rank {rank}: ")
    }
}
