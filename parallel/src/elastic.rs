//! Data-parallel training that goes on after a lost rank, with every survivor's weights equal.
//!
//! [`ElasticDp::step`] runs one optimizer step — this rank's share of the global batch, the
//! gradient exchange ([`DataParallel::sync`]), then a barrier, then the optimizer — and, when
//! a rank is lost on the way, shrinks the world ([`Comm::shrink_with`](tutti_collectives::Comm::shrink_with)) and settles the step
//! the same way on every survivor:
//!
//! - A rank applies a step only after the barrier that follows the gradient exchange. A rank
//!   that passed the barrier knows every rank finished the exchange, so every survivor holds
//!   that step's reduced gradient.
//! - At the shrink, each survivor says how many steps it has applied. If any survivor applied
//!   this step, the ones that had not apply it now, from the gradient they hold (it averages
//!   the old world's samples: the step is kept as it was). Otherwise no one applied it, and the
//!   step is redone on the new world. So a step is applied by all survivors or by none.
//! - Then the survivors check, bit for bit, that their parameters agree
//!   ([`DataParallel::rejoin`]): nothing is broadcast to paper over a divergence.
//!
//! **Shards.** The caller's `compute` gets this rank's place in the current world
//! ([`Member`]) and picks its part of the step's global batch from it alone, for example
//! [`shard_range`](crate::shard_range)`(batch, world, rank)`. A redone step splits the same
//! global batch over fewer ranks; the gradient is weighted by samples (as
//! [`DataParallel::sync`] always does), so it is the gradient of the same global batch, and the
//! result is deterministic: equal, bit for bit, to a run that used the smaller world from that
//! step on.

use std::time::{Duration, Instant};

use crate::dp::{DataParallel, Synced};
use crate::error::{Error, Result};

/// This rank's place in the world a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Rank in the current world.
    pub rank: usize,
    /// Ranks in the current world.
    pub world: usize,
}

/// One recovery from a lost rank, as [`ElasticDp::step`] saw it.
#[derive(Debug, Clone)]
pub struct Recovery {
    /// The step that was running.
    pub step: u64,
    /// The error that started it.
    pub cause: String,
    /// Ranks lost (numbered as in the world before).
    pub lost: Vec<usize>,
    /// Ranks in the new world.
    pub world: usize,
    /// Whether the step was kept (some survivor had applied it) rather than redone.
    pub kept: bool,
    /// From the error to the new world agreed, connected and checked.
    pub took: Duration,
}

/// What [`ElasticDp::step`] did.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The global mean loss of the step, as [`Synced::loss`].
    pub loss: f64,
    /// The samples of the step over all ranks.
    pub samples: u64,
    /// Ranks in the world whose gradient was applied.
    pub world: usize,
    /// Recoveries during this step (usually none).
    pub recoveries: Vec<Recovery>,
    /// Newcomers taken in after this step (replacements; see [`ElasticDp::new`]).
    pub joined: usize,
}

/// [`DataParallel`] that survives lost ranks: see the module docs.
///
/// # Collective contract
/// Every rank calls [`ElasticDp::step`] with the same step numbers, in order, starting from
/// the number of steps already applied (0 for a fresh model).
pub struct ElasticDp {
    dp: DataParallel,
    /// State beyond the parameters that a newcomer receives (an optimizer's moments).
    state: Vec<candle_core::Var>,
    /// Steps applied so far.
    done: u64,
    /// When rank 0 last asked the store for newcomers, and what it found.
    asked: Option<(Instant, u64)>,
}

/// Rank 0 asks the store for newcomers at most this often.
const ASK_EVERY: Duration = Duration::from_millis(200);

impl std::fmt::Debug for ElasticDp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticDp").field("dp", &self.dp).field("done", &self.done).finish()
    }
}

impl ElasticDp {
    /// Wrap `dp`, whose parameters have had `done` steps applied (the same on every rank).
    /// Its communicator must be able to shrink (made by rendezvous, over TCP or QUIC).
    ///
    /// In a replacement process (its group's `joined()` says it joined the
    /// job), `dp` was just made with [`DataParallel::new`], which received the parameters,
    /// and this receives the number of steps applied from rank 0 (`done` is ignored); then it
    /// calls [`ElasticDp::step`] with the others from [`ElasticDp::done`] on.
    ///
    /// # Errors
    /// Collective errors of a newcomer's transfer.
    pub fn new(dp: DataParallel, done: u64) -> Result<ElasticDp> {
        ElasticDp::with_state(dp, done, Vec::new())
    }

    /// As [`ElasticDp::new`], with state beyond the parameters that newcomers receive from
    /// rank 0 as well (an optimizer's moments, kept in `Var`s the optimizer updates in
    /// place). Every rank passes the same shapes, in the same order.
    ///
    /// # Errors
    /// As [`ElasticDp::new`].
    pub fn with_state(
        dp: DataParallel,
        done: u64,
        state: Vec<candle_core::Var>,
    ) -> Result<ElasticDp> {
        let mut el = ElasticDp { dp, state, done, asked: None };
        if el.dp.comm().group().joined() {
            el.share()?;
        }
        Ok(el)
    }

    /// Rank 0's step count and state, to everyone (the newcomers receive them).
    fn share(&mut self) -> Result<()> {
        let mut d = [self.done as i64];
        self.dp.comm().broadcast(&mut d, 0)?;
        self.done = d[0] as u64;
        for v in &self.state {
            let t = crate::ops::broadcast(v.as_tensor(), self.dp.comm(), 0)?;
            v.set(&t)?;
        }
        Ok(())
    }

    /// Newcomers waiting, as rank 0 sees them (0 elsewhere; asked now and then).
    fn waiting(&mut self) -> u64 {
        if self.dp.comm().rank() != 0 {
            return 0;
        }
        if let Some((_, n)) = self.asked.filter(|(t, _)| t.elapsed() < ASK_EVERY) {
            return n;
        }
        // A store that cannot be asked takes nobody in; the step goes on.
        let n = self.dp.comm().group().joiners_waiting().unwrap_or(0);
        self.asked = Some((Instant::now(), n));
        n
    }

    /// The data-parallel state (its communicator is the current world's).
    pub fn dp(&self) -> &DataParallel {
        &self.dp
    }

    /// Steps applied so far.
    pub fn done(&self) -> u64 {
        self.done
    }

    /// Run step `step` to the end, on whatever world is left: `compute` runs this rank's
    /// micro-batches (calling [`DataParallel::backward`]) for the given [`Member`]; then the
    /// gradients are exchanged, a barrier passed, and `apply` runs the optimizer with them.
    /// After a lost rank the world shrinks and the step is kept or redone as the module docs
    /// say; `compute` may then run again, on the new world.
    ///
    /// # Errors
    /// [`Error::Collective`] with `CutOff` when this rank may not go on; errors of `compute`
    /// and `apply`; collective errors that are not a lost rank (a mismatched call);
    /// [`Error::ReplicaMismatch`] if the survivors' parameters differ after a recovery;
    /// [`Error::Shape`] when `step` is not the next step.
    pub fn step<F, A>(&mut self, step: u64, mut compute: F, mut apply: A) -> Result<Outcome>
    where
        F: FnMut(&mut DataParallel, Member) -> Result<()>,
        A: FnMut(&Synced) -> Result<()>,
    {
        if step != self.done {
            return Err(Error::Shape {
                rank: self.dp.comm().rank(),
                layer: "ElasticDp::step",
                detail: format!("step {step} called after {} steps were applied", self.done),
            });
        }
        let mut recoveries = Vec::new();
        loop {
            let world = self.dp.comm().size();
            let member = Member { rank: self.dp.comm().rank(), world };
            self.dp.clear();
            let mut synced = None;
            // The barrier after the exchange also tells everyone whether rank 0 saw newcomers.
            let mut waiting = [self.waiting() as i64];
            let attempt = compute(&mut self.dp, member).and_then(|()| {
                synced = Some(self.dp.sync()?);
                self.dp.comm().allreduce(&mut waiting, tutti_collectives::ReduceOp::Sum)?;
                Ok(())
            });
            let failure = match attempt {
                Ok(()) => {
                    let s = synced.as_ref().ok_or_else(|| internal(&self.dp, "no gradients"))?;
                    apply(s)?;
                    self.done += 1;
                    let (loss, samples) = (s.loss, s.samples);
                    let mut joined = 0;
                    if waiting[0] > 0 {
                        match self.take_in() {
                            Ok(n) => joined = n,
                            // Someone did not come (a newcomer that died, a member lost while
                            // connecting): go on over whoever is left.
                            Err(e) if lost_rank(&e) || rendezvous_failed(&e) => {
                                recoveries.push(self.recover(step, e, None, &mut apply)?)
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    return Ok(Outcome { loss, samples, world, recoveries, joined });
                }
                Err(e) if lost_rank(&e) => e,
                Err(e) => return Err(e),
            };
            let r = self.recover(step, failure, synced.as_ref(), &mut apply)?;
            let kept = r.kept;
            recoveries.push(r);
            if kept {
                let s = synced.as_ref().ok_or_else(|| internal(&self.dp, "no gradients"))?;
                return Ok(Outcome {
                    loss: s.loss,
                    samples: s.samples,
                    world,
                    recoveries,
                    joined: 0,
                });
            }
        }
    }

    /// Take the waiting newcomers in: grow the world, and send them the parameters and the
    /// step count. Returns how many came.
    fn take_in(&mut self) -> Result<usize> {
        let Some((comm, grown)) = self.dp.comm().grow()? else { return Ok(0) };
        self.dp.adopt(comm)?;
        self.share()?;
        self.asked = None;
        tracing::info!(
            world = self.dp.comm().size(),
            newcomers = ?grown.newcomers,
            "data parallel: took newcomers in"
        );
        Ok(grown.newcomers.len())
    }

    /// Settle step `step` with the survivors after `failure`, then go on in the new world.
    fn recover<A>(
        &mut self,
        step: u64,
        failure: Error,
        synced: Option<&Synced>,
        apply: &mut A,
    ) -> Result<Recovery>
    where
        A: FnMut(&Synced) -> Result<()>,
    {
        let started = Instant::now();
        let mut cause = failure.to_string();
        let mut lost = Vec::new();
        let mut kept = false;
        // The current rank → rank in the world this recovery started from.
        let mut orig: Vec<usize> = (0..self.dp.comm().size()).collect();
        loop {
            let mut note = self.done.to_le_bytes().to_vec();
            note.push(u8::from(synced.is_some()));
            let (comm, shrunk) = self.dp.comm().shrink_with(&note)?;
            lost.extend(shrunk.lost.iter().map(|r| orig[*r]));
            orig = shrunk.old_ranks.iter().map(|r| orig[*r]).collect();
            let applied = shrunk
                .notes
                .iter()
                .filter_map(|n| n.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()))
                .map(u64::from_le_bytes)
                .max()
                .unwrap_or(self.done);
            if applied > self.done {
                // Another survivor passed the barrier: every rank holds this step's gradient,
                // this one too.
                let s = synced.ok_or_else(|| {
                    internal(&self.dp, "a survivor applied the step but this rank has no gradient")
                })?;
                apply(s)?;
                self.done += 1;
                kept = true;
            }
            match self.dp.rejoin(comm) {
                Ok(()) => break,
                Err(e) if lost_rank(&e) => cause = e.to_string(),
                Err(e) => return Err(e),
            }
        }
        self.asked = None;
        let r = Recovery {
            step,
            cause,
            lost,
            world: self.dp.comm().size(),
            kept,
            took: started.elapsed(),
        };
        tracing::warn!(
            step,
            world = r.world,
            lost = ?r.lost,
            kept,
            took = ?r.took,
            "data parallel: went on after a lost rank"
        );
        Ok(r)
    }
}

fn internal(dp: &DataParallel, what: &str) -> Error {
    Error::Shape { rank: dp.comm().rank(), layer: "ElasticDp::step", detail: what.into() }
}

/// Whether `e` is a new world's connections failing (a newcomer or member that did not come).
fn rendezvous_failed(e: &Error) -> bool {
    matches!(
        e,
        Error::Collective(tutti_collectives::Error::Runtime(
            tutti_collectives::RuntimeError::Rendezvous { .. }
        ))
    )
}

/// Whether `e` is a lost or unreachable rank (recovered by shrinking), rather than a bug.
pub fn lost_rank(e: &Error) -> bool {
    match e {
        Error::Collective(tutti_collectives::Error::Runtime(r)) => r.is_lost_rank(),
        _ => false,
    }
}
