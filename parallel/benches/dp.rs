//! Data-parallel gradient exchange: `DataParallel::sync` with DDP's bucket sizes against one
//! bucket for everything and one bucket per parameter, and against a plain allreduce of the same
//! bytes, in the same run. 4 ranks over TCP on 127.0.0.1 (threads of this process), a model of
//! 24 parameters totalling ~48 MiB of f32 gradients; medians of several steps.
//!
//! `cargo bench -p tutti-parallel --bench dp`

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
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

fn run(c: &Comm, cfg: DpConfig, steps: usize) -> Vec<f64> {
    let vars: Vec<Var> =
        sizes().iter().map(|n| Var::zeros(*n, DType::F32, &Device::Cpu).unwrap()).collect();
    let mut dp = DataParallel::new(c.clone(), vars.clone(), cfg).unwrap();
    let mut times = Vec::new();
    for _ in 0..steps {
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
        times.push(t.elapsed().as_secs_f64() * 1e3);
        let g = s.grads.get(vars[0].as_tensor()).unwrap();
        assert_eq!(g.max(0).unwrap().to_scalar::<f32>().unwrap(), 1.0);
    }
    times
}

fn plain(c: &Comm, steps: usize) -> Vec<f64> {
    let total: usize = sizes().iter().sum();
    let mut buf = vec![1f32; total];
    (0..steps)
        .map(|_| {
            c.barrier().unwrap();
            let t = Instant::now();
            c.allreduce(&mut buf, ReduceOp::Sum).unwrap();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn main() {
    let n: usize = std::env::var("DP_RANKS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let steps = 7;
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
    let results: Vec<Vec<(String, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let cfgs = &cfgs;
                s.spawn(move || {
                    let mut out = vec![(
                        "plain allreduce of the same bytes".to_string(),
                        median(plain(&c, steps)),
                    )];
                    for (name, cfg) in cfgs {
                        out.push((name.to_string(), median(run(&c, *cfg, steps))));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!("# DataParallel::sync, {n} ranks over TCP (threads), {} parameters, {:.1} MiB of f32 gradients; median of {steps} steps, max over ranks", sizes().len(), total as f64 * 4.0 / (1 << 20) as f64);
    println!("# {:<40} {:>10}", "variant", "ms");
    for i in 0..results[0].len() {
        let worst = results.iter().map(|r| r[i].1).fold(0f64, f64::max);
        println!("  {:<40} {:>10.2}", results[0][i].0, worst);
    }
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}
