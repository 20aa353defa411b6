//! A whole data-parallel step — forward, backward, gradient exchange — with the exchange after
//! the backward pass (`backward` then `sync`) against the exchange overlapped with it
//! (`backward_overlapped`: each bucket reduced while the earlier stages run their backward
//! pass), and the step without any exchange. A stack of `OV_STAGES` linear layers of
//! `OV_DIM`² (GELU between them), batch `OV_BATCH` per rank, `DP_RANKS` ranks as threads over
//! TCP on 127.0.0.1 — or, under a launcher (`tutti-run` on the namespace cluster), one rank per
//! process from its environment. The variants take turns, one step each per round, 9 rounds
//! after one not counted; each prints the median step per rank (max over ranks) and its ratio
//! to the step without exchange.
//!
//! `cargo bench -p tutti-parallel --bench dp_overlap`

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use tutti_collectives::Config;
use tutti_parallel::{Comm, DataParallel, DpConfig, ReduceOp, Result, Stage, StageFn};
use tutti_runtime::testing::{ranks_here, Kind};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn layer(v: &[Var], k: usize, last: bool, x: &Tensor) -> Result<Tensor> {
    let y = x.matmul(&v[2 * k].as_tensor().t()?)?.broadcast_add(v[2 * k + 1].as_tensor())?;
    Ok(if last { y } else { y.gelu_erf()? })
}

fn loss(out: &Tensor) -> Result<Tensor> {
    Ok(out.sqr()?.mean_all()?)
}

#[derive(Clone, Copy)]
enum Mode {
    Local,
    After,
    Overlapped,
}

type Variant = (&'static str, Mode, DpConfig);

/// One rank's median step time per variant (ms).
fn one_rank(
    c: &Comm,
    variants: &[Variant],
    stages: usize,
    dim: usize,
    batch: usize,
    rounds: usize,
) -> Vec<f64> {
    let vars: Vec<Var> = (0..stages)
        .flat_map(|k| {
            let w = (Tensor::randn(0f32, 1.0, (dim, dim), &Device::Cpu).unwrap()
                / (dim as f64).sqrt())
            .unwrap();
            [w, Tensor::full(0.01f32 * k as f32, dim, &Device::Cpu).unwrap()]
        })
        .map(|t| Var::from_tensor(&t).unwrap())
        .collect();
    let mut dps: Vec<DataParallel> = variants
        .iter()
        .map(|(_, _, cfg)| DataParallel::new(c.clone(), vars.clone(), *cfg).unwrap())
        .collect();
    let x =
        Tensor::randn(0f32, 1.0, (batch, dim), &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let fs: Vec<Box<StageFn<'_>>> = (0..stages)
        .map(|k| {
            let vars = &vars;
            Box::new(move |x: &Tensor| layer(vars, k, k + 1 == stages, x)) as Box<StageFn<'_>>
        })
        .collect();
    let staged: Vec<Stage<'_>> = fs
        .iter()
        .enumerate()
        .map(|(k, f)| Stage { vars: 2 * k..2 * k + 2, forward: f.as_ref() })
        .collect();
    let whole = |x: &Tensor| -> Result<Tensor> {
        let mut h = x.clone();
        for f in &fs {
            h = f(&h)?;
        }
        loss(&h)
    };
    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..=rounds {
        for (((_, mode, _), dp), t) in variants.iter().zip(&mut dps).zip(&mut times) {
            c.barrier().unwrap();
            let t0 = Instant::now();
            match mode {
                Mode::Local => {
                    whole(&x).unwrap().backward().unwrap();
                }
                Mode::After => {
                    dp.backward(&whole(&x).unwrap(), batch).unwrap();
                    dp.sync().unwrap();
                }
                Mode::Overlapped => {
                    dp.backward_overlapped(&staged, &x, &loss, batch).unwrap();
                }
            }
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    // The first round warms the buckets and the allocator: not counted.
    times.into_iter().map(|t| median(t[1..].to_vec())).collect::<Vec<f64>>()
}

fn main() {
    let n = env("DP_RANKS", 2);
    let (stages, dim, batch) = (env("OV_STAGES", 8), env("OV_DIM", 1024), env("OV_BATCH", 32));
    let rounds = 9;
    let variants: [Variant; 5] = [
        ("no exchange (forward + backward)", Mode::Local, DpConfig::default()),
        ("backward, then sync; DDP buckets", Mode::After, DpConfig::default()),
        ("overlapped; DDP buckets", Mode::Overlapped, DpConfig::default()),
        (
            "backward, then sync; one layer per bucket",
            Mode::After,
            DpConfig { first_bucket_bytes: 1, bucket_bytes: dim * dim * 4 },
        ),
        (
            "overlapped; one layer per bucket",
            Mode::Overlapped,
            DpConfig { first_bucket_bytes: 1, bucket_bytes: dim * dim * 4 },
        ),
    ];
    // Every rank's medians, the worst of each taken over the group; rank 0 reports.
    let (results, launched) = ranks_here(Kind::Tcp, n, |g| {
        let c = Comm::with_config(g, Config::from_env().unwrap());
        let mut m = one_rank(&c, &variants, stages, dim, batch, rounds);
        c.allreduce(&mut m, ReduceOp::Max).unwrap();
        (c.rank() == 0).then_some(m)
    })
    .unwrap();
    let Some(worst) = results.into_iter().flatten().next() else { return };
    println!(
        "# data-parallel step, {launched}, {stages} layers of {dim}x{dim} f32 \
         ({:.1} MiB of gradients), batch {batch} per rank; {rounds} rounds, variants \
         interleaved; median per rank, max over ranks",
        (stages * (dim * dim + dim) * 4) as f64 / (1 << 20) as f64
    );
    println!("# {:<44} {:>10} {:>16}", "variant", "ms", "/ no exchange");
    for ((name, _, _), w) in variants.iter().zip(&worst) {
        println!("  {:<44} {:>10.2} {:>16.2}", name, w, w / worst[0]);
    }
}
