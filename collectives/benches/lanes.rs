//! Non-blocking calls on lanes (`Comm::with_lanes`): `LANES_JOBS` allreduces of `LANES_BYTES`
//! each started at once, then waited for, with one lane (every job after the one before) and
//! with 2 and 4 lanes (that many in flight). Ranks as threads over TCP on 127.0.0.1
//! (`LANES_RANKS`, default 2), or one per process under a launcher (`tutti-run` on the
//! namespace cluster); the variants take turns, one batch each per round, 15 rounds;
//! median per rank, max over ranks, and the ratio to one lane.
//!
//! `cargo bench -p tutti-collectives --bench lanes`

use std::time::Instant;

use tutti_collectives::{Comm, Config, ReduceOp};
use tutti_runtime::testing::{ranks_here, Kind};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One rank's median µs per batch, per lane count.
fn one_rank(c: &Comm, lanes: &[usize], jobs: usize, bytes: usize, rounds: usize) -> Vec<f64> {
    let ls: Vec<Comm> = lanes.iter().map(|k| c.with_lanes(*k).unwrap()).collect();
    let len = (bytes / 4).max(1);
    let mut times = vec![Vec::new(); ls.len()];
    for round in 0..=rounds {
        for (l, t) in ls.iter().zip(&mut times) {
            c.barrier().unwrap();
            let t0 = Instant::now();
            let hs: Vec<_> =
                (0..jobs).map(|_| l.iallreduce(vec![1f32; len], ReduceOp::Sum)).collect();
            for h in hs {
                let (v, _) = h.wait().unwrap();
                assert_eq!(v[0], c.size() as f32);
            }
            if round > 0 {
                t.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    times.into_iter().map(median).collect::<Vec<f64>>()
}

fn main() {
    let n = env("LANES_RANKS", 2);
    let jobs = env("LANES_JOBS", 16);
    let bytes = env("LANES_BYTES", 8);
    let lanes = [1usize, 2, 4];
    let rounds = 15;
    // Every rank's medians, the worst of each taken over the group; rank 0 reports.
    let (results, how) = ranks_here(Kind::Tcp, n, |g| {
        let c = Comm::with_config(g, Config::from_env().unwrap());
        let mut m = one_rank(&c, &lanes, jobs, bytes, rounds);
        c.allreduce(&mut m, ReduceOp::Max).unwrap();
        (c.rank() == 0).then_some(m)
    })
    .unwrap();
    let Some(worst) = results.into_iter().flatten().next() else { return };
    println!(
        "# {jobs} non-blocking allreduces of {bytes} B started at once, then waited for; {how}; \
         {rounds} rounds, variants interleaved; median µs per batch, \
         max over ranks"
    );
    println!("# {:>6} {:>12} {:>10}", "lanes", "µs", "/ 1 lane");
    for (k, w) in lanes.iter().zip(&worst) {
        println!("  {k:>6} {w:>12.1} {:>10.2}", w / worst[0]);
    }
}
