//! Non-blocking handles as futures: under a minimal executor (one thread, parked until a waker
//! fires: the test fails by timeout if the worker never wakes it) and under tokio, several
//! collectives on different sub-groups awaited by tasks of one runtime while a timer task keeps
//! its schedule.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::common::*;
use tutti_collectives::{Comm, ReduceOp};

/// Wakes by unparking the thread that runs [`block_on`], counting the wakes.
struct Unpark(std::thread::Thread, AtomicUsize);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.unpark();
    }
}

/// Poll `f` to completion on this thread, parking between polls: progress comes only from
/// wakes. A park is bounded so that a lost wake shows as a failure, not a hang.
fn block_on<F: Future>(f: F) -> (F::Output, usize, usize) {
    let unpark = Arc::new(Unpark(std::thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(unpark.clone());
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    let start = Instant::now();
    let mut polls = 0;
    loop {
        polls += 1;
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return (v, polls, unpark.1.load(Ordering::SeqCst));
        }
        std::thread::park_timeout(Duration::from_secs(5));
        assert!(start.elapsed() < Duration::from_secs(60), "no wake within a minute");
    }
}

/// Await every handle in turn.
async fn all<F: Future>(hs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::with_capacity(hs.len());
    for h in hs {
        out.push(h.await);
    }
    out
}

#[test]
fn futures_complete_under_a_minimal_executor_woken_not_polled() {
    for n in [1, 2, 3, 4] {
        world(n, 4096, |c: Comm| {
            let (r, n) = (c.rank(), c.size());
            // A first direct call sets up windows, which takes sequence numbers of its own: done
            // here, so that the calls below count one each.
            c.allreduce(&mut [0f32; 1], ReduceOp::Sum).unwrap();
            let hs: Vec<_> = (0..4u64)
                .map(|k| c.iallreduce(input::<f64>(k, r, 20_000, ReduceOp::Sum), ReduceOp::Sum))
                .collect();
            let (outs, polls, wakes) = block_on(all(hs));
            let mut last = 0;
            for (k, o) in outs.into_iter().enumerate() {
                let (buf, st) = o.unwrap();
                last = last.max(st.seq);
                let want: Vec<f64> =
                    (0..buf.len()).map(|i| reduced(k as u64, n, i, ReduceOp::Sum)).collect();
                assert!(same_bits(&buf, &want));
            }
            // Every poll after the first was caused by a wake: nothing spins.
            assert!(polls <= wakes + 1, "{polls} polls for {wakes} wakes");
            // Lent buffers await the same way.
            let mut v = input::<f32>(9, r, 1000, ReduceOp::Max);
            let st = c.scope(|s| block_on(s.iallreduce(&mut v, ReduceOp::Max)).0).unwrap();
            // The next call in program order.
            assert_eq!(st.seq, last + 1);
            assert!(v
                .iter()
                .enumerate()
                .all(|(i, x)| *x == reduced::<f32>(9, n, i, ReduceOp::Max)));
        });
    }
}

#[test]
fn an_error_is_the_futures_output() {
    world(2, 4096, |c: Comm| {
        let len = if c.rank() == 0 { 10 } else { 11 };
        let e = block_on(c.iallreduce(vec![1.0f32; len], ReduceOp::Sum)).0.unwrap_err();
        assert!(e.to_string().contains("count 10"), "{e}");
    });
}

/// Four ranks, two sub-groups of two, one tokio runtime per rank with two worker threads:
/// on each rank, two tasks await a stream of allreduces on the rank's sub-group and on the whole
/// group, while a third task ticks every millisecond and records how late each tick was.
#[test]
fn tokio_tasks_await_collectives_on_sub_groups_while_a_timer_keeps_time() {
    let lateness = std::sync::Mutex::new(Vec::new());
    world(4, 64 << 10, |c: Comm| {
        let r = c.rank();
        let mine: Vec<usize> = if r < 2 { vec![0, 1] } else { vec![2, 3] };
        // Both halves split in the same order on every rank (a collective on the parent).
        let low = c.split(&[0, 1]).unwrap();
        let high = c.split(&[2, 3]).unwrap();
        let sub = low.or(high).unwrap();
        assert_eq!(sub.size(), 2);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        let late = rt.block_on(async {
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let timer = {
                let done = done.clone();
                tokio::spawn(async move {
                    let mut worst = Duration::ZERO;
                    let mut tick = tokio::time::interval(Duration::from_millis(1));
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    while !done.load(Ordering::SeqCst) {
                        let due = tick.tick().await;
                        worst = worst.max(Instant::now() - due.into_std());
                    }
                    worst
                })
            };
            let on_sub = {
                let sub = sub.clone();
                let mine = mine.clone();
                tokio::spawn(async move {
                    for k in 0..30u64 {
                        let v = vec![(sub.rank() + 1) as i64 * (k as i64 + 1); 50_000];
                        let (v, _) = sub.iallreduce(v, ReduceOp::Sum).await.unwrap();
                        let want: i64 =
                            mine.iter().map(|q| (q % 2 + 1) as i64).sum::<i64>() * (k as i64 + 1);
                        assert!(v.iter().all(|x| *x == want));
                    }
                })
            };
            let on_all = {
                let c = c.clone();
                tokio::spawn(async move {
                    for k in 0..30u64 {
                        let (v, _) = c
                            .iallreduce(input::<f32>(k, r, 30_000, ReduceOp::Sum), ReduceOp::Sum)
                            .await
                            .unwrap();
                        assert!(v
                            .iter()
                            .enumerate()
                            .all(|(i, x)| *x == reduced::<f32>(k, 4, i, ReduceOp::Sum)));
                    }
                })
            };
            on_sub.await.unwrap();
            on_all.await.unwrap();
            done.store(true, Ordering::SeqCst);
            timer.await.unwrap()
        });
        lateness.lock().unwrap().push(late);
    });
    // A loose bound, not a benchmark (examples/async_tokio.rs measures it): a blocking wait
    // inside the tasks holds a runtime thread for a whole collective instead.
    let worst = lateness.lock().unwrap().iter().copied().max().unwrap();
    assert!(worst < Duration::from_secs(1), "a timer tick was {worst:?} late");
}
