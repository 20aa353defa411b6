//! Non-blocking collectives: submit now, overlap with compute, wait later.
//!
//! Two forms. Each `Comm::i…` call moves its buffers into a job for the communicator's worker
//! thread and returns a [`Pending`] handle; `wait` gives the buffers back with the result.
//! Inside [`Comm::scope`], the [`Scope`]'s `i…` calls *lend* the caller's slices instead (no
//! copy, no move): the [`Lent`] handle borrows them, and the scope does not return before every
//! job it started has finished, so a borrowed buffer is never touched after its borrow ends —
//! the guarantee `std::thread::scope` gives, and for the same reason it holds even when a
//! handle is leaked.
//!
//! Both handles are futures too: the worker wakes the task when the job ends (no polling, any
//! executor).
//!
//! Jobs run one at a time in submission order, and a blocking call on the same communicator
//! first waits for every job submitted before it, so every rank issues its collectives in the
//! same program order however blocking and non-blocking calls are mixed. A communicator made by
//! [`Comm::with_lanes`] runs its jobs on several lanes instead — job `k` on lane `k mod
//! lanes`, each lane a thread and a sub-group of its own — so several progress at once.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::comm::{Comm, Stats};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};

type Job = Box<dyn FnOnce(&Comm) + Send>;

/// The worker threads of one communicator: one per lane (one unless [`Comm::with_lanes`]).
pub(crate) struct Worker {
    lanes: Vec<Lane>,
    /// Jobs submitted so far: job `k` runs on lane `k mod lanes`.
    next: std::sync::atomic::AtomicUsize,
    /// Jobs submitted and not yet finished.
    pending: Arc<(Mutex<u64>, Condvar)>,
}

/// One lane: a queue and the thread that runs its jobs in order.
struct Lane {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Worker {
    /// The last handle of the communicator is gone: close the queues and join the threads, so
    /// their copies of the group (and with them the transport, which says goodbye to its peers)
    /// are dropped before the program goes on — or exits.
    fn drop(&mut self) {
        for l in &self.lanes {
            drop(l.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        }
        for l in &mut self.lanes {
            if let Some(t) = l.thread.take() {
                if t.thread().id() != std::thread::current().id() {
                    let _ = t.join();
                }
            }
        }
    }
}

/// Where a job leaves its result: the waiting side blocks on the condition variable, or, as a
/// future, leaves a waker that the worker wakes — no polling either way.
struct Slot<R> {
    state: Mutex<SlotState<R>>,
    cv: Condvar,
}

struct SlotState<R> {
    result: Option<Result<R>>,
    /// The job ended without a result (dropped unrun, or its thread panicked).
    gone: bool,
    /// The result was handed out already: asking again is an error, not a wait.
    spent: bool,
    waker: Option<Waker>,
}

impl<R> SlotState<R> {
    /// The outcome, once: `None` while the job runs; after the result was taken, an error
    /// saying so (never a wait that cannot end).
    fn take(&mut self, rank: usize) -> Option<Result<R>> {
        if let Some(r) = self.result.take() {
            self.spent = true;
            return Some(r);
        }
        if self.spent {
            return Some(Err(Error::InvalidArgument {
                rank,
                op: "wait",
                detail: "this non-blocking call's result was already taken (by `test`, \
                         `wait_timeout` or a completed poll); each result is given once"
                    .into(),
            }));
        }
        self.gone.then(|| Err(worker_gone(rank)))
    }
}

impl<R> Slot<R> {
    fn new() -> Arc<Slot<R>> {
        Arc::new(Slot {
            state: Mutex::new(SlotState { result: None, gone: false, spent: false, waker: None }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState<R>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record the outcome and wake whoever waits.
    fn settle(&self, f: impl FnOnce(&mut SlotState<R>)) {
        let waker = {
            let mut st = self.lock();
            f(&mut st);
            st.waker.take()
        };
        self.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn deliver(&self, r: Result<R>) {
        self.settle(|st| st.result = Some(r));
    }
}

/// The job's end of a [`Slot`]: delivers the result once; dropped without delivering, it tells
/// the waiter that the job is gone.
struct Answer<R>(Option<Arc<Slot<R>>>);

impl<R> Answer<R> {
    fn send(mut self, r: Result<R>) {
        if let Some(slot) = self.0.take() {
            slot.deliver(r);
        }
    }
}

impl<R> Drop for Answer<R> {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.settle(|st| st.gone = true);
        }
    }
}

/// A collective in flight. [`wait`](Pending::wait) returns its result (and buffers); it is
/// also a [`Future`] with the same output, woken by the worker thread when the collective
/// ends (no polling, any executor).
#[must_use = "a non-blocking collective must be waited for to get its buffers back"]
pub struct Pending<R> {
    slot: Arc<Slot<R>>,
    rank: usize,
}

impl<R> std::fmt::Debug for Pending<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("rank", &self.rank).finish_non_exhaustive()
    }
}

fn worker_gone(rank: usize) -> Error {
    Error::Runtime(tutti_runtime::Error::Aborted {
        rank,
        reason: "the communicator's worker thread is gone (it panicked)".into(),
    })
}

impl<R> Pending<R> {
    /// Block until the collective finished; returns its result. Bounded: the collective itself
    /// runs under the group's timeout.
    ///
    /// # Errors
    /// The collective's error.
    pub fn wait(mut self) -> Result<R> {
        loop {
            // With no limit, `wait_timeout` returns only once there is an outcome.
            if let Some(r) = self.wait_timeout(Duration::MAX) {
                return r;
            }
        }
    }

    /// Block until the collective finished or `limit` passed: `Some(result)` when it finished
    /// (the handle is then spent, as after [`test`](Pending::test)), `None` when it is still
    /// running at `limit` — the collective goes on and the handle can be waited for again.
    /// What torch's `Work.wait(timeout)` does.
    ///
    /// # Errors
    /// Inside `Some`, the collective's error.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<Result<R>> {
        let until = Instant::now().checked_add(limit);
        let mut st = self.slot.lock();
        loop {
            if let Some(r) = st.take(self.rank) {
                return Some(r);
            }
            let left = match until {
                Some(u) => u.saturating_duration_since(Instant::now()),
                None => Duration::from_millis(500),
            };
            if left.is_zero() {
                return None;
            }
            st = self.slot.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// `Some(result)` when finished, `None` while still running. After `Some`, the handle is
    /// spent: every later `test`, `wait_timeout`, `wait` or poll returns an error at once.
    pub fn test(&mut self) -> Option<Result<R>> {
        self.slot.lock().take(self.rank)
    }
}

impl<R> Future for Pending<R> {
    type Output = Result<R>;

    /// Ready once the collective ended; until then the task's waker is kept, and the worker
    /// wakes it when it finishes the job. Polling again after `Ready` is ready at once with an
    /// error saying the result was taken.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<R>> {
        let mut st = self.slot.lock();
        if let Some(r) = st.take(self.rank) {
            return Poll::Ready(r);
        }
        match &mut st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl Comm {
    fn worker(&self) -> Result<&Worker> {
        if let Some(w) = self.worker.get() {
            return Ok(w);
        }
        let pending = Arc::new((Mutex::new(0u64), Condvar::new()));
        let n = self.lanes.len().max(1);
        let mut lanes = Vec::with_capacity(n);
        for j in 0..n {
            let mut me = match self.lanes.get(j) {
                None => self.clone(),
                Some(g) => self.lane(g.clone()),
            };
            me.in_worker = true;
            // The thread's handle must not keep the worker (and so itself) alive.
            me.worker = Arc::new(std::sync::OnceLock::new());
            let (tx, rx) = mpsc::channel::<Job>();
            let p2 = pending.clone();
            let name = if self.lanes.is_empty() {
                format!("tutti-coll-{}", self.rank())
            } else {
                format!("tutti-coll-{}-{j}", self.rank())
            };
            let spawned = std::thread::Builder::new().name(name).spawn(move || {
                for job in rx {
                    job(&me);
                    let (m, cv) = &*p2;
                    let mut n = m.lock().unwrap_or_else(|e| e.into_inner());
                    *n = n.saturating_sub(1);
                    cv.notify_all();
                }
            });
            let thread = match spawned {
                Ok(t) => t,
                Err(e) => {
                    // The lanes made so far close when `lanes` is dropped.
                    drop(Worker { lanes, next: 0.into(), pending });
                    return Err(Error::Runtime(tutti_runtime::Error::Io {
                        rank: self.rank(),
                        what: "spawning the collectives worker".into(),
                        detail: e.to_string(),
                    }));
                }
            };
            lanes.push(Lane { tx: Mutex::new(Some(tx)), thread: Some(thread) });
        }
        // A lost race (another clone set it first) drops this one, which joins its threads.
        let _ = self.worker.set(Worker { lanes, next: 0.into(), pending });
        self.worker.get().ok_or_else(|| worker_gone(self.rank()))
    }

    /// A lane's communicator over its group `g`, with its own scratch, tuner and worker, and
    /// this one's settings, forced algorithm and known topology and links.
    fn lane(&self, g: tutti_runtime::Group) -> Comm {
        let mut c = Comm::with_config(g, self.config().clone());
        c.sel.force = self.sel.force;
        if let Some(t) = self.sel.topo.get() {
            let _ = c.sel.topo.set(t.clone());
        }
        if let Some(l) = self.sel.link.get() {
            let _ = c.sel.link.set(*l);
        }
        c
    }

    /// The same communicator with `lanes` lanes for its non-blocking calls (and those of its
    /// clones): job `k` (the `k`-th `i…` call, `submit` or scoped call) runs on lane
    /// `k mod lanes`, each lane on its own thread and its own sub-group of every rank, so up to
    /// `lanes` collectives progress at once — several small ones in flight instead of one
    /// after another. Jobs on one lane run in order; a blocking call on the returned
    /// communicator still waits for every job submitted through it before. (`lanes` 0 counts
    /// as 1: one lane, its jobs in order, on a group of its own.) The lanes' groups are made
    /// here, with no communication; their threads start with the first job.
    ///
    /// The returned communicator has its own worker: submit through it (or its clones) the
    /// calls that should spread. Its lanes are groups of their own, so calls on `self` and on
    /// the lanes never share sequence numbers, and a blocking call on `self` does not wait for
    /// the lanes' jobs.
    ///
    /// # Collective contract
    /// Every rank calls it with the same `lanes`, in the same order relative to the other
    /// sub-groups of this communicator (as [`Comm::split`]: each lane is one), and submits the
    /// same jobs in the same order. Lane counts that differ between ranks pair jobs on
    /// different lanes: they fail by the group's timeout, naming the operation.
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub fn with_lanes(&self, lanes: usize) -> Result<Comm> {
        let all: Vec<usize> = (0..self.size()).collect();
        let mut gs = Vec::with_capacity(lanes.max(1));
        for _ in 0..lanes.max(1) {
            gs.push(self.group.new_group(&all)?.ok_or_else(|| worker_gone(self.rank()))?);
        }
        let mut c = self.clone();
        c.lanes = Arc::new(gs);
        c.worker = Arc::new(std::sync::OnceLock::new());
        c.in_worker = false;
        Ok(c)
    }

    /// Run `f` on the worker after every job submitted before it; the general form of the `i…`
    /// calls, for custom sequences of collectives.
    ///
    /// # Collective contract
    /// Every rank submits the same sequence of jobs.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Comm) -> Result<R> + Send + 'static,
    ) -> Pending<R> {
        let slot = Slot::new();
        let answer = Answer(Some(slot.clone()));
        if let Err(e) = self.enqueue(Box::new(move |c: &Comm| answer.send(f(c)))) {
            slot.deliver(Err(e));
        }
        Pending { slot, rank: self.rank() }
    }

    /// Put `job` on the worker's queue. On error (no worker could be started) the job has been
    /// dropped without running; a job the queue refuses (the worker is gone) is dropped too.
    fn enqueue(&self, job: Job) -> Result<()> {
        let w = self.worker()?;
        {
            let (m, _) = &*w.pending;
            *m.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        }
        let k = w.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let lane = &w.lanes[k % w.lanes.len()];
        let sent = match &*lane.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if !sent {
            let (m, cv) = &*w.pending;
            *m.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
            cv.notify_all();
        }
        Ok(())
    }

    /// Run `f` with a [`Scope`] whose non-blocking calls borrow the caller's buffers instead of
    /// taking them: no copy in, no copy out. Returns `f`'s result after every job started in the
    /// scope has finished (each is bounded by the group's timeout), whether or not its handle
    /// was waited for — so the borrows end with the scope, as with `std::thread::scope`.
    ///
    /// ```no_run
    /// # fn demo(comm: &tutti_collectives::Comm) -> tutti_collectives::Result<()> {
    /// use tutti_collectives::ReduceOp;
    /// let (mut a, mut b) = (vec![1f32; 1 << 20], vec![2f32; 1 << 20]);
    /// comm.scope(|s| {
    ///     let ha = s.iallreduce(&mut a, ReduceOp::Sum);
    ///     // … compute while `a` is on the wire …
    ///     let hb = s.iallreduce(&mut b, ReduceOp::Sum);
    ///     ha.wait()?;
    ///     hb.wait()?;
    ///     Ok::<_, tutti_collectives::Error>(())
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// A lent buffer cannot be touched until its job is over:
    ///
    /// ```compile_fail
    /// # fn demo(comm: &tutti_collectives::Comm) {
    /// let mut a = vec![1f32; 8];
    /// comm.scope(|s| {
    ///     let h = s.iallreduce(&mut a, tutti_collectives::ReduceOp::Sum);
    ///     a[0] = 2.0; // error: `a` is lent to the collective
    ///     h.wait()
    /// });
    /// # }
    /// ```
    ///
    /// # Collective contract
    /// Every rank starts the same jobs in the same order (as with the owned `i…` calls).
    pub fn scope<'env, R>(
        &self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R,
    ) -> R {
        let scope = Scope {
            comm: self,
            live: Arc::new((Mutex::new(0), Condvar::new())),
            _scope: PhantomData,
            _env: PhantomData,
        };
        // Wait for the jobs even when `f` panics: they hold borrows that end here.
        struct WaitAll<'a>(&'a (Mutex<usize>, Condvar));
        impl Drop for WaitAll<'_> {
            fn drop(&mut self) {
                let (m, cv) = self.0;
                let mut n = m.lock().unwrap_or_else(|e| e.into_inner());
                while *n > 0 {
                    n = cv
                        .wait_timeout(n, Duration::from_millis(500))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        let live = scope.live.clone();
        let _wait = WaitAll(&live);
        f(&scope)
    }

    /// Wait until every submitted non-blocking call has finished (each is bounded by the
    /// group's timeout).
    #[inline]
    pub(crate) fn drain(&self) -> Result<()> {
        if self.in_worker {
            return Ok(());
        }
        let Some(w) = self.worker.get() else { return Ok(()) };
        let (m, cv) = &*w.pending;
        let mut n = m.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = cv.wait_timeout(n, Duration::from_millis(500)).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(())
    }

    /// Non-blocking [`Comm::allreduce`]: returns the reduced buffer with the stats.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`], in the same order relative to the other collectives on every rank.
    pub fn iallreduce<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Pending<(Vec<T>, Stats)> {
        self.submit(move |c| c.allreduce(&mut buf, op).map(|s| (buf, s)))
    }

    /// Non-blocking [`Comm::broadcast`].
    ///
    /// # Collective contract
    /// As [`Comm::broadcast`].
    pub fn ibroadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Pending<(Vec<T>, Stats)> {
        self.submit(move |c| c.broadcast(&mut buf, root).map(|s| (buf, s)))
    }

    /// Non-blocking [`Comm::allgather`]: returns the gathered buffer.
    ///
    /// # Collective contract
    /// As [`Comm::allgather`].
    pub fn iallgather<T: Element>(&self, input: Vec<T>) -> Pending<(Vec<T>, Stats)> {
        self.submit(move |c| {
            let mut out = vec![T::default(); input.len() * c.size()];
            c.allgather(&input, &mut out).map(|s| (out, s))
        })
    }

    /// Non-blocking [`Comm::reduce_scatter`]: returns this rank's block.
    ///
    /// # Collective contract
    /// As [`Comm::reduce_scatter`].
    pub fn ireduce_scatter<T: Element>(
        &self,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Pending<(Vec<T>, Stats)> {
        self.submit(move |c| {
            let mut out = vec![T::default(); input.len() / c.size().max(1)];
            c.reduce_scatter(&input, &mut out, op).map(|s| (out, s))
        })
    }

    /// Non-blocking [`Comm::all_to_all`].
    ///
    /// # Collective contract
    /// As [`Comm::all_to_all`].
    pub fn iall_to_all<T: Element>(&self, input: Vec<T>) -> Pending<(Vec<T>, Stats)> {
        self.submit(move |c| {
            let mut out = vec![T::default(); input.len()];
            c.all_to_all(&input, &mut out).map(|s| (out, s))
        })
    }

    /// Non-blocking [`Comm::barrier`].
    ///
    /// # Collective contract
    /// As [`Comm::barrier`].
    pub fn ibarrier(&self) -> Pending<Stats> {
        self.submit(|c| c.barrier())
    }
}

/// Where non-blocking calls may borrow buffers: see [`Comm::scope`].
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'scope Comm,
    /// Jobs of this scope not yet finished or dropped.
    live: Arc<(Mutex<usize>, Condvar)>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("rank", &self.comm.rank()).finish_non_exhaustive()
    }
}

/// A collective in flight that borrows its buffers until the end of its [`Scope`].
#[must_use = "wait for it to see its result (the scope waits for it either way)"]
#[derive(Debug)]
pub struct Lent<'scope, R> {
    inner: Pending<R>,
    _scope: PhantomData<&'scope ()>,
}

impl<R> Future for Lent<'_, R> {
    type Output = Result<R>;

    /// As [`Pending`]'s `poll`.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<R>> {
        Pin::new(&mut self.inner).poll(cx)
    }
}

impl<R> Lent<'_, R> {
    /// As [`Pending::wait`].
    ///
    /// # Errors
    /// The collective's error.
    pub fn wait(self) -> Result<R> {
        self.inner.wait()
    }

    /// As [`Pending::test`].
    pub fn test(&mut self) -> Option<Result<R>> {
        self.inner.test()
    }

    /// As [`Pending::wait_timeout`]: `None` while the job still runs at `limit` (the scope
    /// still waits for it before it returns).
    ///
    /// # Errors
    /// Inside `Some`, the collective's error.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<Result<R>> {
        self.inner.wait_timeout(limit)
    }
}

/// A scoped job: runs `f` once; counts itself out of its scope only after `f` and everything
/// it borrowed are gone (fields drop in declaration order, run or not).
struct ScopedJob<F> {
    f: Option<F>,
    _live: LiveGuard,
}

struct LiveGuard(Arc<(Mutex<usize>, Condvar)>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        let (m, cv) = &*self.0;
        let mut n = m.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        cv.notify_all();
    }
}

impl<'scope> Scope<'scope, '_> {
    /// The general form: run `f`, which may borrow anything that outlives the scope, on the
    /// worker after every job submitted before it.
    ///
    /// # Collective contract
    /// As [`Comm::submit`].
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Comm) -> Result<R> + Send + 'scope,
    ) -> Lent<'scope, R> {
        let slot = Slot::new();
        let answer = Answer(Some(slot.clone()));
        {
            let (m, _) = &*self.live;
            *m.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        }
        let mut job = ScopedJob {
            f: Some(move |c: &Comm| {
                answer.send(f(c));
            }),
            _live: LiveGuard(self.live.clone()),
        };
        let run: Box<dyn FnOnce(&Comm) + Send + 'scope> = Box::new(move |c: &Comm| {
            if let Some(f) = job.f.take() {
                f(c);
            }
            drop(job);
        });
        // SAFETY: the job borrows only what outlives 'scope, and `Comm::scope` does not return
        // (nor unwind past its frame) before the job's `LiveGuard` is dropped — which happens
        // after the job ran or was dropped unrun, with every borrow it held released first.
        let run: Job =
            unsafe { std::mem::transmute::<Box<dyn FnOnce(&Comm) + Send + 'scope>, Job>(run) };
        if let Err(e) = self.comm.enqueue(run) {
            slot.deliver(Err(e));
        }
        Lent { inner: Pending { slot, rank: self.comm.rank() }, _scope: PhantomData }
    }

    /// Non-blocking [`Comm::allreduce`] on a borrowed buffer.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`], in the same order relative to the other collectives on every rank.
    pub fn iallreduce<T: Element>(
        &self,
        buf: &'scope mut [T],
        op: ReduceOp,
    ) -> Lent<'scope, Stats> {
        self.submit(move |c| c.allreduce(buf, op))
    }

    /// Non-blocking [`Comm::broadcast`] on a borrowed buffer.
    ///
    /// # Collective contract
    /// As [`Comm::broadcast`].
    pub fn ibroadcast<T: Element>(&self, buf: &'scope mut [T], root: usize) -> Lent<'scope, Stats> {
        self.submit(move |c| c.broadcast(buf, root))
    }

    /// Non-blocking [`Comm::allgather`] between borrowed buffers.
    ///
    /// # Collective contract
    /// As [`Comm::allgather`].
    pub fn iallgather<T: Element>(
        &self,
        input: &'scope [T],
        output: &'scope mut [T],
    ) -> Lent<'scope, Stats> {
        self.submit(move |c| c.allgather(input, output))
    }

    /// Non-blocking [`Comm::reduce_scatter`] between borrowed buffers.
    ///
    /// # Collective contract
    /// As [`Comm::reduce_scatter`].
    pub fn ireduce_scatter<T: Element>(
        &self,
        input: &'scope [T],
        output: &'scope mut [T],
        op: ReduceOp,
    ) -> Lent<'scope, Stats> {
        self.submit(move |c| c.reduce_scatter(input, output, op))
    }

    /// Non-blocking [`Comm::all_to_all`] between borrowed buffers.
    ///
    /// # Collective contract
    /// As [`Comm::all_to_all`].
    pub fn iall_to_all<T: Element>(
        &self,
        input: &'scope [T],
        output: &'scope mut [T],
    ) -> Lent<'scope, Stats> {
        self.submit(move |c| c.all_to_all(input, output))
    }
}
