//! Non-blocking collectives: submit now, overlap with compute, wait later.
//!
//! Each `i…` call moves its buffers into a job for the communicator's worker thread and returns a
//! [`Pending`] handle; `wait` gives the buffers back with the result. Jobs run one at a time in
//! submission order, and a blocking call on the same communicator first waits for every job
//! submitted before it, so every rank issues its collectives in the same program order however
//! blocking and non-blocking calls are mixed.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::comm::{Comm, Stats};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};

type Job = Box<dyn FnOnce(&Comm) + Send>;

/// The worker thread of one communicator.
pub(crate) struct Worker {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    /// Jobs submitted and not yet finished.
    pending: Arc<(Mutex<u64>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Worker {
    /// The last handle of the communicator is gone: close the queue and join the thread, so its
    /// copy of the group (and with it the transport, which says goodbye to its peers) is dropped
    /// before the program goes on — or exits.
    fn drop(&mut self) {
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// A collective in flight. [`wait`](Pending::wait) returns its result (and buffers).
#[must_use = "a non-blocking collective must be waited for to get its buffers back"]
pub struct Pending<R> {
    rx: mpsc::Receiver<Result<R>>,
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
    pub fn wait(self) -> Result<R> {
        loop {
            match self.rx.recv_timeout(Duration::from_millis(500)) {
                Ok(r) => return r,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(worker_gone(self.rank)),
            }
        }
    }

    /// `Some(result)` when finished, `None` while still running. After `Some`, the handle is
    /// spent.
    pub fn test(&mut self) -> Option<Result<R>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(worker_gone(self.rank))),
        }
    }
}

impl Comm {
    fn worker(&self) -> Result<&Worker> {
        if let Some(w) = self.worker.get() {
            return Ok(w);
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let pending = Arc::new((Mutex::new(0u64), Condvar::new()));
        let mut me = self.clone();
        me.in_worker = true;
        // The thread's handle must not keep the worker (and so itself) alive.
        me.worker = Arc::new(std::sync::OnceLock::new());
        let p2 = pending.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("tutti-coll-{}", self.rank()))
            .spawn(move || {
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
                return Err(Error::Runtime(tutti_runtime::Error::Io {
                    rank: self.rank(),
                    what: "spawning the collectives worker".into(),
                    detail: e.to_string(),
                }))
            }
        };
        // A lost race (another clone set it first) drops this one, which joins its thread.
        let _ = self.worker.set(Worker { tx: Mutex::new(Some(tx)), pending, thread: Some(thread) });
        self.worker.get().ok_or_else(|| worker_gone(self.rank()))
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
        let (tx, rx) = mpsc::sync_channel(1);
        let rank = self.rank();
        match self.worker() {
            Ok(w) => {
                let job: Job = Box::new(move |c: &Comm| {
                    let _ = tx.send(f(c));
                });
                {
                    let (m, _) = &*w.pending;
                    *m.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                }
                let sent = match &*w.tx.lock().unwrap_or_else(|e| e.into_inner()) {
                    Some(tx) => tx.send(job).is_ok(),
                    None => false,
                };
                if !sent {
                    let (m, cv) = &*w.pending;
                    *m.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
                    cv.notify_all();
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
        Pending { rx, rank }
    }

    /// Wait until every submitted non-blocking call has finished (each is bounded by the
    /// group's timeout).
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
