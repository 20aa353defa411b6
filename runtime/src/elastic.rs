//! Going on after a lost rank: the survivors agree, through the job's store, on who is still
//! alive, and connect a new world over them ([`Group::shrink`](crate::Group::shrink)).
//!
//! # The agreement
//!
//! Every group made by rendezvous remembers its *membership*: an epoch number (0 at start-up)
//! and the stable ids of its members in rank order (at start-up, id = launch rank). After a
//! failure, each survivor aborts its old transport (local, bounded) and runs this protocol on
//! the store, under keys `tutti/elastic/<epoch>/`:
//!
//! 1. **Check in**: write `in/<id>` with the ranks it saw fail (its suspects: peers whose
//!    connection was lost or that timed out) and a caller's note (the data-parallel layer puts
//!    its step there).
//! 2. **Rounds** `k = 0, 1, …`, each with one proposer: whoever first increments `claim/<k>`
//!    (the store's atomic add makes exactly one). The proposer waits until every member that
//!    nobody suspects has checked in (up to the group's timeout), then a short grace for the
//!    suspected ones. A tutti store counts each rank's open connections
//!    (`tutti/present/<rank>`): a member with none has no process left, and counts as
//!    suspected too. Then it writes its view to `prop/<k>`: the checked-in members in their old
//!    order, or "stop" when they are not a strict majority of the old membership. It then
//!    adds 1 to `state/<k>`; the round is decided if that add returned 1.
//! 3. **Void**: the others wait for `prop/<k>` while the proposer's heartbeat (`beat/<k>`, bumped
//!    every 100 ms) moves. If it stops for a second, or the proposal does not appear within the
//!    timeout, they add 2 to `state/<k>`: an even result means no commit came first, so the
//!    round is void for everyone (the proposer's later add returns an odd number above 1, and
//!    it moves on too); an odd result means the proposal was committed first. Then round
//!    `k + 1`.
//!
//! Everyone walks the rounds in order and each round's outcome is fixed by the first add on its
//! `state` key, so every survivor ends with the same decision: the same members, in the same
//! order. A slow but alive rank is in or out for everyone: if it checks in after the decision
//! it reads it and stops with [`Error::CutOff`]. A proposer that dies mid-round is voided and
//! the next round proposes again; a member that dies after the decision makes the new world's
//! connect fail, and the survivors shrink again.
//!
//! **Split brain**: one decision exists per epoch, made in the one store, so two sides of a
//! partition can never both go on; and a decision needs a strict majority of the old
//! membership, so a minority that still reaches the store stops as well, and a side that
//! cannot reach the store stops with [`Error::CutOff`] naming the ranks it lost. The store
//! must therefore outlive every rank: under `tutti-run` the launcher serves it; when rank 0
//! serves it (`MASTER_ADDR`/`MASTER_PORT` without a launcher), losing rank 0 loses the store,
//! and the survivors stop with [`Error::CutOff`] saying so.
//!
//! **Renumbering**: the survivors keep their relative order; new rank = position among them.
//! Stable ids never change, so a sub-group is rebuilt from the new ranks.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::connect::{connect, Purpose};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::membership::Membership;
use crate::options::Options;
use crate::store::Store;

/// How long the proposer waits, once every unsuspected member is in, for suspected members
/// that are alive after all (a broken link rather than a dead process).
const SUSPECT_GRACE: Duration = Duration::from_millis(100);
/// How often the proposer shows it is alive, and how long its silence voids a round.
const BEAT: Duration = Duration::from_millis(100);
const BEAT_LOST: Duration = Duration::from_secs(1);
/// Store polling interval while waiting for check-ins.
const POLL: Duration = Duration::from_millis(2);
/// How often a waiting rank looks for newly lost peers, and the proposer rereads check-ins.
const REFRESH: Duration = Duration::from_millis(20);

/// One survivor's check-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    pub(crate) suspects: Vec<u64>,
    pub(crate) note: Vec<u8>,
}

/// The agreed outcome of one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// These members (stable ids, new rank order) go on as membership `epoch` (a number the
    /// store hands out once, so no two memberships share one), with their notes.
    Go(u64, Vec<(u64, Vec<u8>)>),
    /// Too few were left: everyone stops. The members that checked in.
    Stop(Vec<u64>),
}

fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u64(&mut self) -> Option<u64> {
        let (h, t) = self.0.split_first_chunk::<8>()?;
        self.0 = t;
        Some(u64::from_le_bytes(*h))
    }
    fn bytes(&mut self) -> Option<Vec<u8>> {
        let n = usize::try_from(self.u64()?).ok()?;
        if n > self.0.len() {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Some(h.to_vec())
    }
    fn ids(&mut self) -> Option<Vec<u64>> {
        let n = usize::try_from(self.u64()?).ok()?;
        if n > self.0.len() / 8 {
            return None;
        }
        (0..n).map(|_| self.u64()).collect()
    }
}

impl Report {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        put_u64(&mut v, self.suspects.len() as u64);
        for s in &self.suspects {
            put_u64(&mut v, *s);
        }
        put_u64(&mut v, self.note.len() as u64);
        v.extend_from_slice(&self.note);
        v
    }
    pub(crate) fn decode(raw: &[u8]) -> Option<Report> {
        let mut r = Reader(raw);
        let suspects = r.ids()?;
        let note = r.bytes()?;
        r.0.is_empty().then_some(Report { suspects, note })
    }
}

impl Decision {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        match self {
            Decision::Go(epoch, members) => {
                v.push(0);
                put_u64(&mut v, *epoch);
                put_u64(&mut v, members.len() as u64);
                for (id, note) in members {
                    put_u64(&mut v, *id);
                    put_u64(&mut v, note.len() as u64);
                    v.extend_from_slice(note);
                }
            }
            Decision::Stop(seen) => {
                v.push(1);
                put_u64(&mut v, seen.len() as u64);
                for id in seen {
                    put_u64(&mut v, *id);
                }
            }
        }
        v
    }
    pub(crate) fn decode(raw: &[u8]) -> Option<Decision> {
        let (&kind, rest) = raw.split_first()?;
        let mut r = Reader(rest);
        let d = match kind {
            0 => {
                let epoch = r.u64()?;
                let n = usize::try_from(r.u64()?).ok()?;
                if n > rest.len() / 16 {
                    return None;
                }
                let mut m = Vec::with_capacity(n);
                for _ in 0..n {
                    let id = r.u64()?;
                    m.push((id, r.bytes()?));
                }
                Decision::Go(epoch, m)
            }
            1 => Decision::Stop(r.ids()?),
            _ => return None,
        };
        r.0.is_empty().then_some(d)
    }
}

/// One round of the agreement as its proposer sees it, without any I/O: the membership that
/// failed, when the round started, how long the proposer waits for a member nobody suspects,
/// and when the agreement gives up. [`Round::verdict`] is the whole decision, a function of what
/// the proposer has read (check-ins, members the store says have no process) and the time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Round<'a> {
    /// The membership that failed (stable ids in rank order).
    pub(crate) ids: &'a [u64],
    pub(crate) started: Instant,
    pub(crate) wait: Duration,
    pub(crate) deadline: Instant,
}

/// What the proposer does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Read again later. `all_in_at`: since when every member nobody suspects has checked in
    /// (pass it back to the next step), if they have.
    Wait { all_in_at: Option<Instant> },
    /// Close the round with this outcome.
    Close(Outcome),
}

/// How a round closes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A strict majority of the membership checked in: these members (stable id and note, in
    /// the old order) go on.
    Go(Vec<(u64, Vec<u8>)>),
    /// Only these checked in, not a strict majority: nobody goes on.
    Stop(Vec<u64>),
}

impl Round<'_> {
    /// The decision at `now`, given each member's check-in (`reports`, in `ids` order),
    /// the members the store says have no process (`absent`), and the `all_in_at` the last
    /// step returned. The round closes when everyone checked in; or [`SUSPECT_GRACE`] after
    /// every member nobody suspects did (a suspected member alive after all may still come);
    /// or when the proposer's `wait` or the agreement's deadline is over.
    pub(crate) fn verdict(
        &self,
        reports: &[Option<Report>],
        absent: &[u64],
        all_in_at: Option<Instant>,
        now: Instant,
    ) -> Verdict {
        let suspected = |id: &u64| {
            absent.contains(id) || reports.iter().flatten().any(|r| r.suspects.contains(id))
        };
        let waiting = self.ids.iter().zip(reports).any(|(id, r)| r.is_none() && !suspected(id));
        let everyone = reports.iter().all(Option::is_some);
        let all_in_at = if waiting { None } else { all_in_at.or(Some(now)) };
        let grace_over = all_in_at.is_some_and(|t| now >= t + SUSPECT_GRACE);
        if everyone || grace_over || now >= self.started + self.wait || now >= self.deadline {
            Verdict::Close(self.outcome(reports))
        } else {
            Verdict::Wait { all_in_at }
        }
    }

    /// The members that checked in, and whether they are a strict majority.
    fn outcome(&self, reports: &[Option<Report>]) -> Outcome {
        let members: Vec<(u64, Vec<u8>)> = self
            .ids
            .iter()
            .zip(reports)
            .filter_map(|(id, r)| r.as_ref().map(|r| (*id, r.note.clone())))
            .collect();
        if members.len() * 2 > self.ids.len() {
            Outcome::Go(members)
        } else {
            Outcome::Stop(members.into_iter().map(|(id, _)| id).collect())
        }
    }
}

/// Who takes part in one agreement, and how long it may take.
pub(crate) struct Agreement<'a> {
    pub(crate) store: &'a dyn Store,
    pub(crate) epoch: u64,
    /// The membership that failed (stable ids in rank order).
    pub(crate) ids: &'a [u64],
    pub(crate) me: u64,
    /// This rank's suspects (stable ids) as they are now: asked again while the agreement
    /// runs, since a transport keeps learning of closed connections after it failed.
    pub(crate) suspects: &'a (dyn Fn() -> Vec<u64> + Sync),
    /// How long the proposer waits for a member nobody suspects.
    pub(crate) wait: Duration,
    /// Give up (cut off) after this.
    pub(crate) deadline: Instant,
}

impl Agreement<'_> {
    fn key(&self, what: &str) -> String {
        format!("tutti/elastic/{}/{what}", self.epoch)
    }

    /// Check in with `note` and this rank's suspects, then take part in rounds until one is
    /// decided.
    pub(crate) fn run(&self, note: &[u8]) -> Result<Decision> {
        let mut report = Report { suspects: (self.suspects)(), note: note.to_vec() };
        self.store.set(&self.key(&format!("in/{}", self.me)), &report.encode())?;
        let mut refreshed = Instant::now();
        // Check in again when this rank has learnt of more lost peers.
        let mut refresh = |report: &mut Report| -> Result<()> {
            if refreshed.elapsed() < REFRESH {
                return Ok(());
            }
            refreshed = Instant::now();
            let mut now = (self.suspects)();
            now.retain(|s| !report.suspects.contains(s));
            if !now.is_empty() {
                report.suspects.extend(now);
                self.store.set(&self.key(&format!("in/{}", self.me)), &report.encode())?;
            }
            Ok(())
        };
        let mut k = 0u64;
        loop {
            if Instant::now() >= self.deadline {
                return Err(Error::Store {
                    addr: self.store.describe(),
                    detail: format!("no membership decided for epoch {} in time", self.epoch),
                });
            }
            if self.store.add(&self.key(&format!("claim/{k}")), 1)? == 1 {
                let proposal = self.propose(k, &mut || refresh(&mut report))?;
                self.store.set(&self.key(&format!("prop/{k}")), &proposal.encode())?;
                if self.store.add(&self.key(&format!("state/{k}")), 1)? == 1 {
                    info!(
                        epoch = self.epoch,
                        round = k,
                        ?proposal,
                        "membership decided (proposer)"
                    );
                    return Ok(proposal);
                }
                warn!(epoch = self.epoch, round = k, "my proposal came after the round was voided");
                k += 1;
                continue;
            }
            if let Some(d) = self.follow(k, &mut || refresh(&mut report))? {
                return Ok(d);
            }
            k += 1;
        }
    }

    /// Collect check-ins and make this round's proposal, beating the heartbeat meanwhile.
    fn propose(&self, k: u64, refresh: &mut dyn FnMut() -> Result<()>) -> Result<Decision> {
        let beat = self.key(&format!("beat/{k}"));
        let start = Instant::now();
        let round =
            Round { ids: self.ids, started: start, wait: self.wait, deadline: self.deadline };
        let mut last_beat = start;
        let mut all_in_at: Option<Instant> = None;
        let mut reports: Vec<Option<Report>> = vec![None; self.ids.len()];
        let mut reread = Instant::now();
        // A tutti store counts each rank's open connections: one with none has no process.
        let presence = self.store.check(&[crate::store::PRESENCE])?;
        let mut absent: Vec<u64> = Vec::new();
        loop {
            refresh()?;
            if last_beat.elapsed() >= BEAT {
                self.store.add(&beat, 1)?;
                last_beat = Instant::now();
            }
            // Check-ins change when their ranks learn of more losses: read them all again now
            // and then.
            let again = reread.elapsed() >= REFRESH;
            if again {
                reread = Instant::now();
            }
            for (i, id) in self.ids.iter().enumerate() {
                if reports[i].is_none() || again {
                    let key = self.key(&format!("in/{id}"));
                    if self.store.check(&[key.as_str()])? {
                        let raw = self.store.get(&key, Duration::from_secs(5))?;
                        // An unreadable check-in counts as none (it cannot come from a member).
                        reports[i] = Report::decode(&raw);
                    }
                }
            }
            let suspected_by_reports: Vec<u64> =
                reports.iter().flatten().flat_map(|r| r.suspects.iter().copied()).collect();
            if presence && again {
                for (id, r) in self.ids.iter().zip(&reports) {
                    if r.is_none() && !suspected_by_reports.contains(id) && !absent.contains(id) {
                        let key = format!("{}{id}", crate::store::PRESENT);
                        if self.store.add(&key, 0)? <= 0 {
                            absent.push(*id);
                        }
                    }
                }
            }
            match round.verdict(&reports, &absent, all_in_at, Instant::now()) {
                Verdict::Wait { all_in_at: a } => all_in_at = a,
                Verdict::Close(outcome) => {
                    return Ok(match outcome {
                        Outcome::Go(members) => Decision::Go(new_epoch(self.store)?, members),
                        Outcome::Stop(seen) => Decision::Stop(seen),
                    })
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// Wait for round `k`'s proposer; `None` when the round is void.
    fn follow(&self, k: u64, refresh: &mut dyn FnMut() -> Result<()>) -> Result<Option<Decision>> {
        let (prop, state, beat) = (
            self.key(&format!("prop/{k}")),
            self.key(&format!("state/{k}")),
            self.key(&format!("beat/{k}")),
        );
        let give_up = (Instant::now() + self.wait + 2 * BEAT_LOST).min(self.deadline);
        let mut seen_beat = -1;
        let mut beat_moved = Instant::now();
        loop {
            refresh()?;
            let v = self.store.add(&state, 0)?;
            if v % 2 == 1 {
                let raw = self.store.get(&prop, Duration::from_secs(5))?;
                return Decision::decode(&raw).map(Some).ok_or_else(|| Error::Store {
                    addr: self.store.describe(),
                    detail: format!("an unreadable membership proposal at {prop}"),
                });
            }
            if v > 0 {
                return Ok(None);
            }
            let b = self.store.add(&beat, 0)?;
            if b != seen_beat {
                seen_beat = b;
                beat_moved = Instant::now();
            }
            if beat_moved.elapsed() >= BEAT_LOST || Instant::now() >= give_up {
                // The proposer is gone or too slow: void the round, unless it committed first.
                let v = self.store.add(&state, 2)?;
                if v % 2 == 1 {
                    continue;
                }
                warn!(epoch = self.epoch, round = k, "voided a round whose proposer went silent");
                return Ok(None);
            }
            std::thread::sleep(POLL);
        }
    }
}

/// What [`Group::shrink_with`] returns.
#[derive(Debug)]
pub struct Shrunk {
    /// The new world group over the survivors.
    pub group: Group,
    /// Each new member's note (what it passed to `shrink_with`), in new rank order.
    pub notes: Vec<Vec<u8>>,
    /// The old ranks left out, in the numbering of the group `shrink_with` was called on.
    pub lost: Vec<usize>,
    /// Each new rank's rank in that group.
    pub old_ranks: Vec<usize>,
    /// The new membership epoch (the world at start-up is epoch 0).
    pub epoch: u64,
}

impl Group {
    /// After a failure, agree with the other survivors on who is left and connect a new world
    /// group over them. See [`shrink_with`](Group::shrink_with).
    ///
    /// # Errors
    /// As [`shrink_with`](Group::shrink_with).
    pub fn shrink(&self) -> Result<Group> {
        self.shrink_with(&[]).map(|s| s.group)
    }

    /// After a failure, agree with the other survivors on who is left and connect a new world
    /// group over them; `note` (at most a few KiB) reaches every survivor in
    /// [`Shrunk::notes`], so they can settle application state (the data-parallel layer sends
    /// its step).
    ///
    /// # Collective contract
    /// Every surviving rank of the world group calls this once after an error (this group
    /// is aborted first, locally; calling it twice on one group runs a second agreement).
    /// The survivors keep their relative order: new rank = position among them. Only a
    /// world group made by rendezvous can shrink (it remembers the store); the store must
    /// outlive the lost ranks. The protocol, and why no two sides of a partition can both go
    /// on, is in the module docs ([`crate::elastic`]).
    ///
    /// Teardown: this group's transport is aborted (fails every pending operation, tells the
    /// peers, never waits on a lost one); its threads and sockets close when the last handle
    /// to it is dropped.
    ///
    /// # Errors
    /// [`Error::CutOff`] when this rank may not go on: the survivors decided without it, too
    /// few ranks were left for a strict majority, or the store could not be reached.
    /// [`Error::Config`] for a group that cannot shrink (in-memory, or a sub-group).
    pub fn shrink_with(&self, note: &[u8]) -> Result<Shrunk> {
        let (rejoin, keep) = self.parts();
        let Some(rejoin) = rejoin.map(|r| Membership::clone(r)) else {
            return Err(Error::Config(
                "only a world group made by rendezvous can shrink (it needs the job's store); \
                 rebuild sub-groups from the shrunken world"
                    .into(),
            ));
        };
        let keep = keep.to_vec();
        let start = Instant::now();
        let rank = self.rank();
        let cause = self.failure();
        let mut suspects: Vec<u64> = match &cause {
            Some(e) if blames(e) => e.peer().map(|p| vec![rejoin.ids[p]]).unwrap_or_default(),
            _ => Vec::new(),
        };
        self.abort(&format!(
            "rank {rank} is shrinking the group at epoch {} after: {}",
            rejoin.epoch,
            cause.as_ref().map_or_else(|| "a request".to_string(), ToString::to_string)
        ));
        let wait = self.timeout();
        let deadline = start + wait + Duration::from_secs(10);
        // The ranks of the group this was called on, for the caller.
        let first_ids = rejoin.ids.clone();
        let rejoin_epoch = rejoin.epoch;
        let mut cur = rejoin;
        loop {
            let me = first_ids[rank];
            let lost_of = |kept: &[u64]| -> Vec<usize> {
                (0..first_ids.len()).filter(|r| !kept.contains(&first_ids[*r])).collect()
            };
            // The first round suspects whom this group's transport lost (it keeps learning
            // while the agreement runs); a retry, whoever did not come.
            let transport = (cur.epoch == rejoin_epoch).then(|| self.transport().clone());
            let ids = cur.ids.clone();
            let fixed = suspects.clone();
            let suspects_now = move || {
                let mut s = fixed.clone();
                for p in transport.as_ref().map(|t| t.lost_peers()).unwrap_or_default() {
                    if let Some(id) = ids.get(p).filter(|id| !s.contains(id)) {
                        s.push(*id);
                    }
                }
                s
            };
            let agreement = Agreement {
                store: cur.store.as_ref(),
                epoch: cur.epoch,
                ids: &cur.ids,
                me,
                suspects: &suspects_now,
                wait,
                deadline,
            };
            let decision = agreement.run(note);
            suspects = suspects_now();
            let (epoch, members) = match decision {
                Err(e) => {
                    let lost = suspects
                        .iter()
                        .filter_map(|s| first_ids.iter().position(|id| id == s))
                        .collect();
                    return Err(Error::CutOff {
                        rank,
                        epoch: cur.epoch,
                        lost,
                        detail: format!(
                            "the store the survivors agree through could not be reached ({e}); \
                             a side that cannot reach it stops"
                        ),
                    });
                }
                Ok(Decision::Stop(seen)) => {
                    return Err(Error::CutOff {
                        rank,
                        epoch: cur.epoch,
                        lost: lost_of(&seen),
                        detail: format!(
                            "only {} of {} ranks of the membership were left, not a strict \
                             majority, so no side goes on",
                            seen.len(),
                            cur.ids.len()
                        ),
                    });
                }
                Ok(Decision::Go(epoch, members)) => (epoch, members),
            };
            let kept: Vec<u64> = members.iter().map(|(id, _)| *id).collect();
            let Some(new_rank) = kept.iter().position(|id| *id == me) else {
                return Err(Error::CutOff {
                    rank,
                    epoch: cur.epoch,
                    lost: lost_of(&kept),
                    detail: format!(
                        "the survivors went on without this rank (ranks {:?} of the old world): \
                         it was cut off from them or too slow to check in",
                        kept.iter()
                            .filter_map(|k| first_ids.iter().position(|id| id == k))
                            .collect::<Vec<_>>()
                    ),
                });
            };
            // Every member is inside its shrink by now: a member that does not connect soon
            // died after the decision (agree again without it).
            let rebuild = Purpose::Rebuild { wait };
            match connect(&cur, new_rank, epoch, kept.clone(), keep.clone(), false, rebuild) {
                Ok(group) => {
                    info!(
                        rank,
                        new_rank,
                        world = kept.len(),
                        epoch,
                        elapsed = ?start.elapsed(),
                        "shrunk: the survivors go on"
                    );
                    let old_ranks = kept
                        .iter()
                        .map(|k| first_ids.iter().position(|id| id == k).unwrap_or(usize::MAX))
                        .collect();
                    return Ok(Shrunk {
                        group,
                        notes: members.into_iter().map(|(_, n)| n).collect(),
                        lost: lost_of(&kept),
                        old_ranks,
                        epoch,
                    });
                }
                Err(e) => {
                    // Someone agreed and then did not come (a second failure): agree again
                    // on this membership. Suspect whom the launcher reports gone and the
                    // member the connect found gone (its address refused connections: a
                    // closed listener, which needs no launcher); only when neither names
                    // anyone (the connect waited out its deadline), whoever never published
                    // an address over the transport in use. A connect that failed at once on
                    // a known loss must not suspect members merely slower to publish: they
                    // are alive, and would be cut off.
                    warn!(rank, epoch, "connecting the survivors failed, agreeing again: {e}");
                    let store = cur.epoch_store(epoch);
                    let mut gone = crate::connect::gone_members(&cur, &kept);
                    if let Error::PeerLost { peer, .. } = &e {
                        if *peer < kept.len() && !gone.contains(peer) {
                            gone.push(*peer);
                        }
                    }
                    suspects = if gone.is_empty() {
                        (0..kept.len())
                            .filter(|r| {
                                !crate::connect::published(cur.opts.transport, store.as_ref(), *r)
                            })
                            .map(|r| kept[r])
                            .collect()
                    } else {
                        gone.iter().map(|r| kept[*r]).collect()
                    };
                    cur = Membership { epoch, ids: kept, ..cur };
                }
            }
        }
    }
}

/// The membership epoch a reconfigured world connects as: the top bit set (the store counts
/// shrink and grow epochs up from 1, far below it), the rest a mix of the caller's uuid and
/// the members' ids, so two worlds made with one uuid from one group (a split) connect apart,
/// and two uuids share an epoch with odds of 2^-63.
fn reconfigure_epoch(uuid: u64, ids: &[u64]) -> u64 {
    let mut x = crate::wire::fnv1a(uuid, ids.iter().copied());
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    1 << 63 | (x & !(1 << 63))
}

impl Group {
    /// Connect a new world over members the caller chose, in the caller's order: the new rank
    /// of `members[i]` (a rank of this group) is `i`. For frameworks that decide membership
    /// themselves (torch's `ProcessGroup.reconfigure`, which torchft drives from its
    /// lighthouse); [`Group::shrink_with`] decides it by agreement instead.
    ///
    /// This group is aborted first (every pending operation fails with [`Error::Aborted`],
    /// naming the reconfigure), so no call of the old membership can complete afterwards. The
    /// new world connects its full mesh through this group's store, under keys of its own
    /// (an epoch derived from `uuid`), and is watched like a shrink: a member the launcher
    /// reports gone, or whose address refuses connections, fails the connect at once, naming
    /// it. Operations on it get this group's timeout.
    ///
    /// # Collective contract
    /// Every rank named in `members` calls it once with the same `uuid` and `members`; ranks
    /// not named do not call it. `uuid` is fresh for every reconfigure of the job (a uuid used
    /// before by this rank is refused).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list, a repeated or out-of-range rank, or a list
    /// without this rank; [`Error::Config`] for a reused `uuid` or a group that was not made by
    /// rendezvous (in-memory groups and sub-groups cannot reconfigure); what the connect
    /// returns ([`Error::Rendezvous`] naming members that did not come within `connect`,
    /// [`Error::PeerLost`] for one found gone).
    pub fn reconfigure(
        &self,
        uuid: u64,
        members: &[usize],
        connect_within: Duration,
    ) -> Result<Group> {
        let rank = self.rank();
        let bad = |d: String| Error::InvalidArgument { rank, op: "reconfigure".into(), detail: d };
        if members.is_empty() {
            return Err(bad("the member list is empty".into()));
        }
        if let Some(r) = members.iter().find(|r| **r >= self.size()) {
            return Err(bad(format!("rank {r} is outside the group of {}", self.size())));
        }
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(bad(format!("ranks {members:?} name a rank twice")));
        }
        let Some(new_rank) = members.iter().position(|r| *r == rank) else {
            return Err(bad(format!(
                "this rank ({rank}) is not among the members {members:?}: only the members call it"
            )));
        };
        let (cur, keep) = self.parts();
        let Some(cur) = cur.map(|r| Membership::clone(r)) else {
            return Err(Error::Config(
                "only a world group made by rendezvous (or by an earlier reconfigure) can \
                 reconfigure (it needs the job's store); rebuild sub-groups from the new world"
                    .into(),
            ));
        };
        let keep = keep.to_vec();
        let me = cur.ids[rank];
        let claims = cur.store.add(&format!("tutti/reconfigure/{uuid}/{me}"), 1)?;
        if claims > 1 {
            return Err(Error::Config(format!(
                "rank {rank}: reconfigure uuid {uuid} was used before by this member; pass a fresh \
                 uuid for every reconfigure"
            )));
        }
        let start = Instant::now();
        self.abort(&format!(
            "rank {rank} is reconfiguring the group (uuid {uuid}, {} members)",
            members.len()
        ));
        let ids: Vec<u64> = members.iter().map(|r| cur.ids[*r]).collect();
        let epoch = reconfigure_epoch(uuid, &ids);
        let purpose = Purpose::Reconfigure { wait: self.timeout(), connect: connect_within };
        let g = connect(&cur, new_rank, epoch, ids, keep, false, purpose)?;
        info!(
            rank,
            new_rank,
            world = members.len(),
            uuid,
            elapsed = ?start.elapsed(),
            "reconfigured: the chosen members go on"
        );
        Ok(g)
    }
}

/// What [`Group::grow`] returns when newcomers were taken in.
#[derive(Debug)]
pub struct Grown {
    /// The new world group: the members in their order, then the newcomers.
    pub group: Group,
    /// The newcomers' ranks in it.
    pub newcomers: Vec<usize>,
    /// The new membership epoch.
    pub epoch: u64,
}

/// The decision of one `grow`: the new epoch and its members' stable ids, in rank order.
fn encode_grow(epoch: u64, ids: &[u64]) -> Vec<u8> {
    let mut v = Vec::new();
    put_u64(&mut v, epoch);
    put_u64(&mut v, ids.len() as u64);
    for id in ids {
        put_u64(&mut v, *id);
    }
    v
}

fn decode_grow(raw: &[u8]) -> Option<(u64, Vec<u64>)> {
    let mut r = Reader(raw);
    let epoch = r.u64()?;
    let ids = r.ids()?;
    r.0.is_empty().then_some((epoch, ids))
}

fn unreadable(store: &dyn Store, key: &str) -> Error {
    Error::Store { addr: store.describe(), detail: format!("an unreadable value at {key}") }
}

impl Group {
    /// Whether this process joined a running job as a replacement (`TUTTI_JOIN=1`) and this
    /// group is the world it joined: it should receive the job's state (parameters, step) from
    /// the others rather than start fresh.
    pub fn joined(&self) -> bool {
        self.parts().0.is_some_and(|r| r.joined)
    }

    /// Newcomers (replacement processes started with `TUTTI_JOIN=1`) waiting to be taken in
    /// by [`grow`](Group::grow), as the store says now; 0 for a group that cannot grow.
    ///
    /// # Errors
    /// [`Error::Store`] when the store cannot be reached.
    pub fn joiners_waiting(&self) -> Result<u64> {
        let Some(r) = self.parts().0 else { return Ok(0) };
        let asked = r.store.add(JOINERS, 0)?;
        let taken = r.store.add(JOINERS_TAKEN, 0)?;
        Ok(u64::try_from(asked - taken).unwrap_or(0))
    }

    /// Take in the newcomers waiting now (see [`joiners_waiting`](Group::joiners_waiting)):
    /// rank 0 decides who, through the store, and every member and newcomer connects a new
    /// world — the members keep their ranks, the newcomers come after them. `Ok(None)` when
    /// there was nobody to take in.
    ///
    /// # Collective contract
    /// Every member of this world group calls it at the same point of the program (for
    /// example when an allreduce of `joiners_waiting` on rank 0 says there are some). Then
    /// the members send the newcomers what they need (parameters, step) over the new group;
    /// the newcomers' side is [`joined`](Group::joined). This group stays usable until
    /// dropped.
    ///
    /// # Errors
    /// [`Error::Store`] when the store fails; [`Error::Rendezvous`] when a newcomer or member
    /// does not connect (shrink, on this group, to go on without them);
    /// [`Error::Config`] for a group that cannot grow.
    pub fn grow(&self) -> Result<Option<Grown>> {
        let Some(cur) = self.parts().0.map(|r| Membership::clone(r)) else {
            return Err(Error::Config(
                "only a world group made by rendezvous can grow (it needs the job's store)".into(),
            ));
        };
        let call = cur.grows.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = format!("tutti/grow/{}/{call}", cur.epoch);
        let wait = self.timeout();
        let store = cur.store.as_ref();
        let raw = if self.rank() == 0 {
            let asked = store.add(JOINERS, 0)?;
            let taken = store.add(JOINERS_TAKEN, 0)?;
            let mut ids = cur.ids.clone();
            for t in taken + 1..=asked {
                let k = format!("tutti/joiner/{t}");
                let raw = store.get(&k, Duration::from_secs(5))?;
                let id = <[u8; 8]>::try_from(raw.as_slice())
                    .map(u64::from_le_bytes)
                    .map_err(|_| unreadable(store, &k))?;
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            let epoch = if ids.len() > cur.ids.len() { new_epoch(store)? } else { cur.epoch };
            let d = encode_grow(epoch, &ids);
            store.set(&key, &d)?;
            store.add(JOINERS_TAKEN, asked - taken)?;
            for t in taken + 1..=asked {
                store.set(&format!("tutti/welcome/{t}"), &d)?;
            }
            d
        } else {
            store.get(&key, wait)?
        };
        let (epoch, ids) = decode_grow(&raw).ok_or_else(|| unreadable(store, &key))?;
        if ids.len() <= cur.ids.len() {
            return Ok(None);
        }
        let me = cur.ids[self.rank()];
        let rank = ids.iter().position(|id| *id == me).unwrap_or(usize::MAX);
        let keep = self.parts().1.to_vec();
        let group =
            connect(&cur, rank, epoch, ids.clone(), keep, false, Purpose::Rebuild { wait })?;
        info!(rank, world = ids.len(), epoch, "grew: newcomers taken in");
        Ok(Some(Grown { group, newcomers: (cur.ids.len()..ids.len()).collect(), epoch }))
    }
}

/// Store counters of newcomers: asked to join, and taken in.
const JOINERS: &str = "tutti/joiners";
const JOINERS_TAKEN: &str = "tutti/joiners/taken";

/// A replacement process joins a running job (`TUTTI_JOIN=1`): it asks through the store,
/// waits until the members' next [`Group::grow`] takes it in, and connects that world.
#[allow(clippy::too_many_arguments)]
pub(crate) fn join(
    id: usize,
    store: Arc<dyn Store>,
    token: String,
    master_ip: Option<IpAddr>,
    opts: &Options,
    launcher_fd: Option<i32>,
    keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
) -> Result<Group> {
    let wait = opts.link.connect_timeout;
    let job = crate::connect::job_id(store.as_ref(), id, wait)?;
    let ticket = store.add(JOINERS, 1)?;
    store.set(&format!("tutti/joiner/{ticket}"), &(id as u64).to_le_bytes())?;
    info!(id, ticket, "asked to join the running job; waiting to be taken in");
    let key = format!("tutti/welcome/{ticket}");
    let raw = crate::store::get_or(store.as_ref(), &key, wait, || Error::Rendezvous {
        rank: id,
        detail: format!(
            "the job's ranks did not take this process in within {wait:?} (they take newcomers \
             in when they call grow, e.g. between ElasticDp steps)"
        ),
    })?;
    let (epoch, ids) = decode_grow(&raw).ok_or_else(|| unreadable(store.as_ref(), &key))?;
    let rank = ids.iter().position(|x| *x == id as u64).ok_or_else(|| Error::Rendezvous {
        rank: id,
        detail: format!("the welcome at {key} does not name this process (id {id})"),
    })?;
    let cur = Membership {
        store,
        token,
        job,
        epoch,
        ids: ids.clone(),
        opts: opts.clone(),
        master_ip,
        launcher_fd,
        joined: true,
        grows: Default::default(),
        // A newcomer counts every notice from its own start on.
        formed: Instant::now(),
    };
    let g = connect(&cur, rank, epoch, ids, keep, true, Purpose::Rebuild { wait: opts.timeout })?;
    info!(id, rank, world = g.size(), epoch, "joined the running job");
    Ok(g)
}

/// A membership epoch number no other membership of this job has (the store counts them).
pub(crate) fn new_epoch(store: &dyn Store) -> Result<u64> {
    let e = store.add("tutti/epochs", 1)?;
    u64::try_from(e).map_err(|_| Error::Store {
        addr: store.describe(),
        detail: format!("the epoch counter tutti/epochs holds {e}"),
    })
}

/// Errors that say a peer is gone (as opposed to one that told us it stopped).
fn blames(e: &Error) -> bool {
    match e {
        Error::Poisoned(inner) => blames(inner),
        Error::PeerLost { .. } | Error::Timeout { .. } => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::FileStore;

    #[test]
    fn reports_and_decisions_round_trip_and_junk_is_refused() {
        let r = Report { suspects: vec![3, 9], note: b"step 12".to_vec() };
        assert_eq!(Report::decode(&r.encode()), Some(r.clone()));
        for d in [Decision::Go(3, vec![(0, vec![1, 2]), (2, vec![])]), Decision::Stop(vec![1])] {
            assert_eq!(Decision::decode(&d.encode()), Some(d.clone()));
        }
        let raw = r.encode();
        for cut in 0..raw.len() {
            assert_eq!(Report::decode(&raw[..cut]), None, "cut at {cut}");
        }
        assert_eq!(Decision::decode(&[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]), None);
        assert_eq!(Decision::decode(&[7]), None);
    }

    /// The decision alone, on a made-up clock: no store, no threads, no sleeps.
    mod decision {
        use super::*;

        fn report(suspects: &[u64]) -> Option<Report> {
            Some(Report { suspects: suspects.to_vec(), note: vec![] })
        }

        fn go(ids: &[u64]) -> Verdict {
            Verdict::Close(Outcome::Go(ids.iter().map(|id| (*id, vec![])).collect()))
        }

        const IDS: [u64; 5] = [10, 11, 12, 13, 14];

        fn round(t0: Instant) -> Round<'static> {
            Round {
                ids: &IDS,
                started: t0,
                wait: Duration::from_secs(30),
                deadline: t0 + Duration::from_secs(40),
            }
        }

        #[test]
        fn everyone_in_closes_at_once_in_the_old_order() {
            let t0 = Instant::now();
            let all: Vec<_> = IDS.iter().map(|_| report(&[])).collect();
            assert_eq!(round(t0).verdict(&all, &[], None, t0), go(&IDS));
        }

        #[test]
        fn a_member_nobody_suspects_is_waited_for_until_the_proposers_wait() {
            let t0 = Instant::now();
            let r = round(t0);
            let mut in_ = vec![report(&[]); 5];
            in_[2] = None;
            assert_eq!(
                r.verdict(&in_, &[], None, t0 + Duration::from_secs(29)),
                Verdict::Wait { all_in_at: None }
            );
            assert_eq!(
                r.verdict(&in_, &[], None, t0 + Duration::from_secs(30)),
                go(&[10, 11, 13, 14])
            );
        }

        #[test]
        fn a_suspected_member_gets_the_grace_and_is_taken_if_it_comes() {
            let t0 = Instant::now();
            let r = round(t0);
            // 13 is suspected by 10; the rest are in.
            let mut in_ = vec![report(&[13]), report(&[]), report(&[]), None, report(&[])];
            let at = t0 + Duration::from_millis(5);
            let Verdict::Wait { all_in_at: Some(all_in) } = r.verdict(&in_, &[], None, at) else {
                panic!("should wait out the grace")
            };
            assert_eq!(all_in, at);
            let just_before = all_in + SUSPECT_GRACE - Duration::from_millis(1);
            assert!(matches!(
                r.verdict(&in_, &[], Some(all_in), just_before),
                Verdict::Wait { .. }
            ));
            assert_eq!(
                r.verdict(&in_, &[], Some(all_in), all_in + SUSPECT_GRACE),
                go(&[10, 11, 12, 14])
            );
            // Alive after all (a broken link, not a dead process): it checks in in time.
            in_[3] = report(&[]);
            assert_eq!(r.verdict(&in_, &[], Some(all_in), just_before), go(&IDS));
        }

        #[test]
        fn a_member_the_store_says_has_no_process_counts_as_suspected() {
            let t0 = Instant::now();
            let r = round(t0);
            let in_ = vec![report(&[]), report(&[]), None, report(&[]), report(&[])];
            assert_eq!(r.verdict(&in_, &[], None, t0), Verdict::Wait { all_in_at: None });
            let Verdict::Wait { all_in_at } = r.verdict(&in_, &[12], None, t0) else { panic!() };
            assert_eq!(all_in_at, Some(t0));
            assert_eq!(
                r.verdict(&in_, &[12], all_in_at, t0 + SUSPECT_GRACE),
                go(&[10, 11, 13, 14])
            );
        }

        #[test]
        fn without_a_strict_majority_nobody_goes_on() {
            let t0 = Instant::now();
            let r = Round { ids: &IDS[..4], ..round(t0) };
            let in_ = vec![report(&[12, 13]), report(&[12, 13]), None, None];
            let Verdict::Wait { all_in_at } = r.verdict(&in_, &[], None, t0) else { panic!() };
            assert_eq!(
                r.verdict(&in_, &[], all_in_at, t0 + SUSPECT_GRACE),
                Verdict::Close(Outcome::Stop(vec![10, 11]))
            );
        }

        #[test]
        fn the_deadline_closes_the_round_whatever_is_missing() {
            let t0 = Instant::now();
            let r = Round { wait: Duration::from_secs(60), ..round(t0) };
            let in_ = vec![report(&[]), report(&[]), report(&[]), None, None];
            assert_eq!(r.verdict(&in_, &[], None, t0 + Duration::from_secs(40)), go(&[10, 11, 12]));
        }

        /// Notes travel with their members.
        #[test]
        fn notes_are_the_members_own() {
            let t0 = Instant::now();
            let ids = [1u64, 2, 3];
            let r = Round { ids: &ids, ..round(t0) };
            let in_: Vec<_> = ids
                .iter()
                .map(|id| Some(Report { suspects: vec![], note: vec![*id as u8; 2] }))
                .collect();
            assert_eq!(
                r.verdict(&in_, &[], None, t0),
                Verdict::Close(Outcome::Go(vec![
                    (1, vec![1, 1]),
                    (2, vec![2, 2]),
                    (3, vec![3, 3])
                ]))
            );
        }
    }

    fn agree_all(
        store: &Arc<dyn Store>,
        epoch: u64,
        ids: &[u64],
        who: &[(u64, Vec<u64>, Duration)],
        wait: Duration,
    ) -> Vec<Result<Decision>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = who
                .iter()
                .map(|(me, suspects, delay)| {
                    let store = store.clone();
                    s.spawn(move || {
                        std::thread::sleep(*delay);
                        let suspects = || suspects.clone();
                        let a = Agreement {
                            store: store.as_ref(),
                            epoch,
                            ids,
                            me: *me,
                            suspects: &suspects,
                            wait,
                            deadline: Instant::now() + Duration::from_secs(20),
                        };
                        a.run(&[*me as u8])
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn dir(name: &str) -> Arc<dyn Store> {
        let d = std::env::temp_dir().join(format!("tutti-elastic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Arc::new(FileStore::new(&d).unwrap())
    }

    #[test]
    fn survivors_agree_on_the_same_members_in_the_old_order() {
        let store = dir("agree");
        // Rank 2 of 5 died; everyone saw it. One survivor is slow to check in but nobody
        // suspects it, so it is waited for.
        let ms = Duration::from_millis;
        let who = vec![
            (4, vec![2], ms(0)),
            (0, vec![2], ms(5)),
            (3, vec![], ms(300)),
            (1, vec![2], ms(10)),
        ];
        let got = agree_all(&store, 0, &[0, 1, 2, 3, 4], &who, Duration::from_secs(10));
        let want = Decision::Go(1, vec![(0, vec![0]), (1, vec![1]), (3, vec![3]), (4, vec![4])]);
        for g in got {
            assert_eq!(g.unwrap(), want);
        }
    }

    #[test]
    fn a_rank_that_comes_after_the_decision_reads_it_and_a_minority_stops() {
        let store = dir("late");
        let ms = Duration::from_millis;
        // 1 and 2 are suspected; 2 is alive but late: everyone (2 included) sees it left out.
        let who = vec![
            (0, vec![1, 2], ms(0)),
            (3, vec![1], ms(0)),
            (4, vec![1, 2], ms(0)),
            (2, vec![1], ms(800)),
        ];
        let got = agree_all(&store, 0, &[0, 1, 2, 3, 4], &who, Duration::from_secs(10));
        let want = Decision::Go(1, vec![(0, vec![0]), (3, vec![3]), (4, vec![4])]);
        for g in got {
            assert_eq!(g.unwrap(), want);
        }
        // Of 4, two are left: not a strict majority, so the decision is to stop.
        let who = vec![(0, vec![1, 3], ms(0)), (2, vec![1, 3], ms(0))];
        let got = agree_all(&store, 1, &[0, 1, 2, 3], &who, Duration::from_secs(10));
        for g in got {
            assert_eq!(g.unwrap(), Decision::Stop(vec![0, 2]));
        }
    }

    #[test]
    fn a_proposer_that_dies_mid_round_is_voided_and_the_next_round_decides() {
        let store = dir("void");
        let two = || vec![2];
        let a = |me| Agreement {
            store: store.as_ref(),
            epoch: 0,
            ids: &[0, 1, 2],
            me,
            suspects: &two,
            wait: Duration::from_secs(30),
            deadline: Instant::now() + Duration::from_secs(20),
        };
        // A proposer claims round 0 and dies before proposing (no heartbeat).
        store.set(&a(2).key("in/2"), &Report { suspects: vec![], note: vec![] }.encode()).unwrap();
        assert_eq!(store.add(&a(2).key("claim/0"), 1).unwrap(), 1);
        let t = Instant::now();
        let got = std::thread::scope(|s| {
            let h: Vec<_> = [0u64, 1]
                .into_iter()
                .map(|me| {
                    let a = a(me);
                    s.spawn(move || a.run(&[]))
                })
                .collect();
            h.into_iter().map(|h| h.join().unwrap().unwrap()).collect::<Vec<_>>()
        });
        // Voided after the heartbeat's silence, then decided in round 1 (2 had checked in).
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert_eq!(got[0], got[1]);
        assert!(store.add(&a(0).key("state/0"), 0).unwrap() % 2 == 0, "round 0 is void");
        // Its late commit finds the round void.
        assert_ne!(store.add(&a(2).key("state/0"), 1).unwrap(), 1);
    }
}
