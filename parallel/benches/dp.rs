//! Data-parallel gradient exchange: `DataParallel::sync` with DDP's bucket sizes against one
//! bucket for everything and one bucket per parameter, and against a plain allreduce of the same
//! bytes, in the same run. 4 ranks over TCP on 127.0.0.1 (threads of this process), a model of
//! 24 parameters totalling ~48 MiB of f32 gradients; the variants take turns, one step each per
//! round, and each prints its median and its ratio to the plain allreduce.
//!
//! `cargo bench -p tutti-parallel --bench dp`

use std::time::Instant;

use candle_core::{DType, Device, Var};
use tutti_parallel::{Comm, DataParallel, DpConfig, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Parameter sizes (elements): a mix of large matrices and small vectors, like a transformer.
fn sizes() -> Vec<usize> {
    (0..12).flat_map(|_| [1_000_000, 2_000]).collect()
}

/// One step of a variant: the milliseconds of `sync` (or of the plain allreduce).
enum Variant {
    Plain(Vec<f32>),
    Dp(Box<DataParallel>, Vec<Var>),
}

fn step(c: &Comm, v: &mut Variant) -> f64 {
    match v {
        Variant::Plain(buf) => {
            c.barrier().unwrap();
            let t = Instant::now();
            c.allreduce(buf, ReduceOp::Sum).unwrap();
            t.elapsed().as_secs_f64() * 1e3
        }
        Variant::Dp(dp, vars) => {
            // loss = sum of every parameter: every gradient is ones.
            let loss = vars
                .iter()
                .map(|v| v.as_tensor().sum_all().unwrap())
                .reduce(|a, b| (a + b).unwrap())
                .unwrap();
            dp.backward(&loss, 1).unwrap();
            c.barrier().unwrap();
            let t = Instant::now();
            let s = dp.sync().unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let g = s.grads.get(vars[0].as_tensor()).unwrap();
            assert_eq!(g.max(0).unwrap().to_scalar::<f32>().unwrap(), 1.0);
            ms
        }
    }
}

fn main() {
    let n: usize = std::env::var("DP_RANKS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let rounds = 9;
    let total: usize = sizes().iter().sum();
    let cfgs = [
        ("DDP buckets (1 MiB, then 25 MiB)", DpConfig::default()),
        (
            "one bucket",
            DpConfig { first_bucket_bytes: usize::MAX / 2, bucket_bytes: usize::MAX / 2 },
        ),
        ("one bucket per parameter", DpConfig { first_bucket_bytes: 1, bucket_bytes: 1 }),
    ];
    let comms: Vec<Comm> = groups(Kind::Tcp, n).unwrap().into_iter().map(Comm::new).collect();
    // Every variant takes one step per round, in turn, so drifts of the machine hit all alike.
    let results: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let cfgs = &cfgs;
                s.spawn(move || {
                    let mut vs = vec![Variant::Plain(vec![1f32; total])];
                    for (_, cfg) in cfgs {
                        let vars: Vec<Var> = sizes()
                            .iter()
                            .map(|n| Var::zeros(*n, DType::F32, &Device::Cpu).unwrap())
                            .collect();
                        let dp = DataParallel::new(c.clone(), vars.clone(), *cfg).unwrap();
                        vs.push(Variant::Dp(Box::new(dp), vars));
                    }
                    let mut times = vec![Vec::new(); vs.len()];
                    for _ in 0..rounds {
                        for (v, t) in vs.iter_mut().zip(&mut times) {
                            t.push(step(&c, v));
                        }
                    }
                    times.into_iter().map(median).collect::<Vec<f64>>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!("# DataParallel::sync, {n} ranks over TCP (threads), {} parameters, {:.1} MiB of f32 gradients; {rounds} rounds, the variants interleaved; median per rank, max over ranks", sizes().len(), total as f64 * 4.0 / (1 << 20) as f64);
    println!("# {:<40} {:>10} {:>12}", "variant", "ms", "/ plain");
    let names: Vec<&str> = std::iter::once("plain allreduce of the same bytes")
        .chain(cfgs.iter().map(|(n, _)| *n))
        .collect();
    let worst: Vec<f64> =
        (0..names.len()).map(|i| results.iter().map(|r| r[i]).fold(0f64, f64::max)).collect();
    for (name, w) in names.iter().zip(&worst) {
        println!("  {:<40} {:>10.2} {:>12.2}", name, w, w / worst[0]);
    }
}
