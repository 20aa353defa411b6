//! collmodel: fit tutti's α-β cost model (`tutti_collectives::model`) to collbench results and
//! predict other scales with it.
//!
//! ```text
//! collmodel fit --hosts 4 --per-host 2 --gamma-ns 0.4 results/*.json
//! collmodel predict --ranks 64,256,1024 --gbit 100 --latency-us 10 --gamma-ns 0.4
//! ```
//!
//! `fit` reads collbench JSON files (`collbench -J`), all from one cluster shape, and fits per
//! collective and algorithm the α (seconds per step) and β (seconds per byte on a host link)
//! that best explain the measured times (least squares on relative error, the
//! model's step and byte counts for that shape, γ and the loopback per-byte cost fixed). It
//! prints the fit, then measured next to predicted for every size. `predict` prints each
//! algorithm's predicted time and the cheapest one for allreduce, broadcast, all-gather and
//! reduce-scatter at the given scales.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tutti_collectives::model::Model;
use tutti_collectives::{Algo, Coll, Topology};

#[derive(Parser)]
#[command(about = "Fit and apply tutti's α-β cost model")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fit α and β per algorithm to collbench JSON results.
    Fit {
        /// Hosts in the runs.
        #[arg(long)]
        hosts: usize,
        /// Ranks per host.
        #[arg(long, default_value_t = 1)]
        per_host: usize,
        /// Reduction cost, ns per byte.
        #[arg(long, default_value_t = 0.4)]
        gamma_ns: f64,
        /// Per-byte cost between ranks of one host, ns per byte.
        #[arg(long, default_value_t = 0.4)]
        local_ns: f64,
        /// Take α as given (µs per message, e.g. the link measurement's) and fit β alone.
        #[arg(long)]
        alpha_us: Option<f64>,
        /// Fit on sizes from this many bytes (smaller ones are still listed).
        #[arg(long, default_value_t = 0)]
        min_bytes: usize,
        /// collbench JSON files.
        files: Vec<PathBuf>,
    },
    /// Predict times and the choice at other scales.
    Predict {
        /// World sizes (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
        ranks: Vec<usize>,
        /// Ranks per host.
        #[arg(long, default_value_t = 1)]
        per_host: usize,
        /// Link rate in Gbit/s.
        #[arg(long, default_value_t = 100.0)]
        gbit: f64,
        /// Per-message latency in µs.
        #[arg(long, default_value_t = 10.0)]
        latency_us: f64,
        /// Reduction cost, ns per byte.
        #[arg(long, default_value_t = 0.4)]
        gamma_ns: f64,
        /// Per-byte cost between ranks of one host, ns per byte.
        #[arg(long, default_value_t = 0.1)]
        local_ns: f64,
    },
}

/// Measured times per (collective, algorithm, bytes), one per file.
type Points = BTreeMap<(String, String, usize), Vec<f64>>;

fn load(files: &[PathBuf]) -> Result<Points, String> {
    let mut pts = Points::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", f.display()))?;
        for run in v["runs"].as_array().into_iter().flatten() {
            let coll = run["collective"].as_str().unwrap_or("").to_string();
            for row in run["rows"].as_array().into_iter().flatten() {
                let bytes = row["bytes"].as_u64().unwrap_or(0) as usize;
                let algo = row["algo"].as_str().unwrap_or("").to_string();
                // The per-iteration median of the slowest rank (what the model predicts: the
                // last rank's finish), else the mean over ranks of out-of-place and in-place.
                let t = row["p50_us"].as_f64().or_else(|| {
                    let v: Vec<f64> = [&row["oop"]["time_us"], &row["ip"]["time_us"]]
                        .iter()
                        .filter_map(|x| x.as_f64())
                        .collect();
                    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
                });
                let Some(t) = t.filter(|_| bytes > 0) else { continue };
                pts.entry((coll.clone(), algo, bytes)).or_default().push(t * 1e-6);
            }
        }
    }
    Ok(pts)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn topology(ranks: usize, per_host: usize) -> Topology {
    let hosts: Vec<usize> = (0..ranks).map(|r| r / per_host.max(1)).collect();
    Topology::from_hosts(&hosts)
}

/// The model's cost split into its α part, its β part and the rest (γ, loopback).
fn parts(
    coll: Coll,
    algo: Algo,
    s: f64,
    topo: &Topology,
    fixed: &Model,
) -> Option<(f64, f64, f64)> {
    let only = |alpha, beta| Model { alpha, beta, ..*fixed };
    let rest = only(0.0, 0.0).cost(coll, algo, s, topo)?;
    let a = only(1.0, 0.0).cost(coll, algo, s, topo)? - rest;
    let b = only(0.0, 1.0).cost(coll, algo, s, topo)? - rest;
    Some((a, b, rest))
}

/// What `fit` takes as given.
struct Fixed {
    gamma_ns: f64,
    local_ns: f64,
    alpha_us: Option<f64>,
    min_bytes: usize,
}

fn fit(hosts: usize, per_host: usize, how: &Fixed, files: &[PathBuf]) -> Result<(), String> {
    let (gamma_ns, local_ns) = (how.gamma_ns, how.local_ns);
    let mut pts = load(files)?;
    let topo = topology(hosts * per_host, per_host);
    let fixed =
        Model { alpha: 0.0, beta: 0.0, beta_local: local_ns * 1e-9, gamma: gamma_ns * 1e-9 };
    let mut groups: BTreeMap<(String, String), Vec<(usize, f64)>> = BTreeMap::new();
    for ((c, a, b), v) in pts.iter_mut() {
        groups.entry((c.clone(), a.clone())).or_default().push((*b, median(v)));
    }
    println!(
        "# {hosts} hosts x {per_host} ranks, gamma {gamma_ns} ns/B, loopback {local_ns} ns/B, {} files",
        files.len()
    );
    println!("# {:<15} {:<13} {:>10} {:>12}", "collective", "algorithm", "alpha_us", "beta_GB/s");
    let mut rows = Vec::new();
    for ((c, a), v) in &groups {
        let (Some(coll), Some(algo)) = (Coll::parse(c), Algo::parse(a)) else { continue };
        // Least squares on relative error: minimise Σ ((α·a + β·b + r − t)/t)².
        let mut eq = Vec::new();
        for &(bytes, t) in v.iter().filter(|(b, _)| *b >= how.min_bytes) {
            if let Some((pa, pb, r)) = parts(coll, algo, bytes as f64, &topo, &fixed) {
                eq.push((pa / t, pb / t, (t - r) / t));
            }
        }
        if eq.len() < 2 {
            continue;
        }
        let (mut saa, mut sab, mut sbb, mut say, mut sby) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (x1, x2, y) in &eq {
            saa += x1 * x1;
            sab += x1 * x2;
            sbb += x2 * x2;
            say += x1 * y;
            sby += x2 * y;
        }
        let det = saa * sbb - sab * sab;
        let (mut alpha, mut beta) = if det.abs() > 1e-30 {
            ((say * sbb - sby * sab) / det, (sby * saa - say * sab) / det)
        } else {
            (0.0, 0.0)
        };
        if let Some(a) = how.alpha_us {
            // α given: β alone, Σ ((β·b − (y − α·a))/t)² minimal.
            alpha = a * 1e-6;
            beta = ((sby - alpha * sab) / sbb).max(0.0);
        }
        // Keep both non-negative: refit the other alone when one goes below zero.
        if alpha < 0.0 {
            alpha = 0.0;
            beta = (sby / sbb).max(0.0);
        }
        if beta < 0.0 {
            beta = 0.0;
            alpha = (say / saa).max(0.0);
        }
        println!(
            "  {:<15} {:<13} {:>10.1} {:>12.3}",
            c,
            a,
            alpha * 1e6,
            if beta > 0.0 { 1e-9 / beta } else { f64::INFINITY }
        );
        let m = Model { alpha, beta, ..fixed };
        for &(bytes, t) in v {
            if let Some(p) = m.cost(coll, algo, bytes as f64, &topo) {
                rows.push((c.clone(), a.clone(), bytes, t, p));
            }
        }
    }
    println!(
        "\n# {:<15} {:<13} {:>10} {:>12} {:>12} {:>7}",
        "collective", "algorithm", "bytes", "measured_us", "model_us", "ratio"
    );
    for (c, a, b, t, p) in rows {
        println!("  {c:<15} {a:<13} {b:>10} {:>12.0} {:>12.0} {:>7.2}", t * 1e6, p * 1e6, p / t);
    }
    Ok(())
}

fn predict(
    ranks: &[usize],
    per_host: usize,
    gbit: f64,
    latency_us: f64,
    gamma_ns: f64,
    local_ns: f64,
) {
    let m = Model {
        alpha: latency_us * 1e-6,
        beta: 8.0 / (gbit * 1e9),
        beta_local: local_ns * 1e-9,
        gamma: gamma_ns * 1e-9,
    };
    println!(
        "# {gbit} Gbit/s links, {latency_us} us per message, {per_host} rank(s) per host, gamma {gamma_ns} ns/B, loopback {local_ns} ns/B"
    );
    for coll in [Coll::Allreduce, Coll::Broadcast, Coll::Allgather, Coll::ReduceScatter] {
        for &n in ranks {
            let topo = topology(n, per_host);
            let algos: Vec<Algo> = coll
                .algos()
                .iter()
                .copied()
                .filter(|a| coll.supports(*a, n, true).is_ok())
                .collect();
            print!("\n# {coll}, {n} ranks: predicted time (us)\n  {:>10}", "bytes");
            let shown: Vec<Algo> =
                algos.iter().copied().filter(|a| m.cost(coll, *a, 1.0, &topo).is_some()).collect();
            for a in &shown {
                print!(" {:>13}", a.name());
            }
            println!(" {:>13}", "choice");
            let mut s = 1024usize;
            while s <= 1 << 30 {
                print!("  {s:>10}");
                for a in &shown {
                    let c = m.cost(coll, *a, s as f64, &topo).unwrap_or(f64::NAN);
                    print!(" {:>13.0}", c * 1e6);
                }
                let best = m.best(coll, shown.iter().copied(), s as f64, &topo);
                println!(" {:>13}", best.map_or("-", Algo::name));
                s *= 16;
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Fit { hosts, per_host, gamma_ns, local_ns, alpha_us, min_bytes, files } => {
            let how = Fixed { gamma_ns, local_ns, alpha_us, min_bytes };
            if let Err(e) = fit(hosts, per_host, &how, &files) {
                eprintln!("collmodel: {e}");
                return ExitCode::FAILURE;
            }
        }
        Cmd::Predict { ranks, per_host, gbit, latency_us, gamma_ns, local_ns } => {
            predict(&ranks, per_host, gbit, latency_us, gamma_ns, local_ns)
        }
    }
    ExitCode::SUCCESS
}
