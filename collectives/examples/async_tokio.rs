//! Collectives as futures on a tokio runtime.
//!
//! Four ranks (threads of this process, over TCP on 127.0.0.1), each with its own
//! two-thread tokio runtime. On each rank, one task awaits a stream of 1 MiB allreduces on the
//! rank's half of the group (ranks 0–1 or 2–3) and another awaits allreduces on the whole group,
//! while a third task ticks every millisecond and records how late each tick was. Then the same
//! with `wait()` — a blocking call — inside the tasks, for contrast: it takes runtime threads
//! away from the timer.
//!
//! `cargo run --release -p tutti-collectives --example async_tokio`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tutti_collectives::{Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

const ROUNDS: usize = 40;

/// Lateness of every timer tick while two tasks run their collectives, in µs.
fn run(c: &Comm, sub: &Comm, blocking: bool) -> Vec<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let done = Arc::new(AtomicBool::new(false));
        let timer = {
            let done = done.clone();
            tokio::spawn(async move {
                let mut late = Vec::new();
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while !done.load(Ordering::SeqCst) {
                    let due = tick.tick().await;
                    late.push((Instant::now() - due.into_std()).as_secs_f64() * 1e6);
                }
                late
            })
        };
        let stream = |comm: Comm| {
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let h = comm.iallreduce(vec![1f32; 1 << 18], ReduceOp::Sum);
                    let (v, _) = if blocking { h.wait() } else { h.await }.expect("allreduce");
                    assert_eq!(v[0] as usize, comm.size());
                }
            })
        };
        let (a, b) = (stream(sub.clone()), stream(c.clone()));
        a.await.expect("sub-group task");
        b.await.expect("whole-group task");
        done.store(true, Ordering::SeqCst);
        timer.await.expect("timer task")
    })
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p) as usize]
}

fn main() -> tutti_collectives::Result<()> {
    let comms: Vec<Comm> = groups(Kind::Tcp, 4)?.into_iter().map(Comm::new).collect();
    let out: Vec<(usize, Vec<f64>, Vec<f64>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || -> tutti_collectives::Result<_> {
                    let low = c.split(&[0, 1])?;
                    let high = c.split(&[2, 3])?;
                    let sub = low.or(high).expect("every rank is in one half");
                    let awaited = run(&c, &sub, false);
                    let blocked = run(&c, &sub, true);
                    Ok((c.rank(), awaited, blocked))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Result<_, _>>()
    })?;
    println!("# timer lateness (µs) on each rank's runtime while {ROUNDS} 1 MiB allreduces ran on its half and on the whole group");
    println!(
        "# {:>4} {:>10} {:>10} {:>10} {:>10}   {:>10} {:>10} {:>10}",
        "rank", "ticks", "p50", "p99", "max", "blocking p50", "p99", "max"
    );
    for (r, a, b) in out {
        println!(
            "  {:>4} {:>10} {:>10.0} {:>10.0} {:>10.0}   {:>12.0} {:>10.0} {:>10.0}",
            r,
            a.len(),
            pct(a.clone(), 0.5),
            pct(a.clone(), 0.99),
            pct(a, 1.0),
            pct(b.clone(), 0.5),
            pct(b.clone(), 0.99),
            pct(b, 1.0)
        );
    }
    Ok(())
}
