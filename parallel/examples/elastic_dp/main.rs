//! Data-parallel training that survives a killed rank ([`ElasticDp`]): a small MLP
//! (8 → 32 → ReLU → 1, MSE, SGD with momentum) on a fixed global batch of 48 samples per step, each rank
//! taking `shard_range(48, rank, world)` of it. Kill a rank while it runs and the others agree
//! on who is left, settle the step, and finish every step on the smaller world.
//!
//! Under a launcher whose store outlives the ranks:
//!
//! ```text
//! tutti-run --elastic --nproc 4 -- target/release/examples/elastic_dp --steps 200 --step-ms 20
//! kill -9 <one rank's pid>
//! ```
//!
//! Every rank prints `STEP s world w rank r t_us T` per step (T: when it ended, µs since the
//! epoch), `RECOVERED …` when it went on after a loss,
//! and at the end `DONE loss … checksum … schedule …`: the final mean loss, an FNV-1a hash of
//! every weight's bits, and the world each step's gradient came from (`4x17,3x183`).
//!
//! With `tutti-run --elastic --max-restarts 1`, the launcher starts a replacement for the
//! killed rank: it joins (`JOINED rank r at step s`), receives the parameters and the step
//! count, and the world is whole again (`GREW after step s`); its schedule starts there.
//!
//! Alone, `elastic_dp --schedule 4x17,3x183` replays a schedule with ranks as threads over
//! memory and prints the same `DONE` line: the reference a test compares the survivors with,
//! bit for bit (with the job's algorithms: `TUTTI_DIRECT=0` replays a job that cannot read
//! peers' memory directly, such as one with `TUTTI_SHM=0`).

use candle_core::{DType, Device, Tensor, Var};
use tutti_parallel::{
    shard_range, Comm, DataParallel, DpConfig, ElasticDp, Member, Result, Synced,
};

const BATCH: usize = 48;
const IN: usize = 8;
const HIDDEN: usize = 32;
const LR: f64 = 0.05;

/// A value in [-1, 1) from an index (a fixed LCG step), exact in f32.
fn unit(i: u64) -> f32 {
    let x = i.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) >> 40;
    (x % 2048) as f32 / 1024.0 - 1.0
}

/// Samples `range` of step `step`: inputs and targets.
fn samples(step: u64, range: std::ops::Range<usize>) -> Result<(Tensor, Tensor)> {
    let n = range.len();
    let mut x = Vec::with_capacity(n * IN);
    let mut y = Vec::with_capacity(n);
    for s in range {
        let id = step * BATCH as u64 + s as u64;
        let row: Vec<f32> = (0..IN as u64).map(|j| unit(id * 16 + j)).collect();
        y.push(
            row.iter().enumerate().map(|(j, v)| v * (j as f32 - 3.5) / 4.0).sum::<f32>()
                + 0.5 * row[0] * row[1],
        );
        x.extend(row);
    }
    Ok((Tensor::from_vec(x, (n, IN), &Device::Cpu)?, Tensor::from_vec(y, (n, 1), &Device::Cpu)?))
}

fn init() -> Result<Vec<Var>> {
    let w = |shape: &[usize], salt: u64, scale: f32| -> Result<Var> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n as u64).map(|i| unit(salt * 100_000 + i) * scale).collect();
        Ok(Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?)?)
    };
    Ok(vec![w(&[IN, HIDDEN], 1, 0.35)?, w(&[HIDDEN], 2, 0.1)?, w(&[HIDDEN, 1], 3, 0.18)?])
}

/// SGD with momentum 0.9; the velocities live in `Var`s, so that `ElasticDp::with_state`
/// hands them to a newcomer with the parameters.
struct Momentum {
    vars: Vec<Var>,
    vel: Vec<Var>,
}

const MU: f64 = 0.9;

impl Momentum {
    fn new(vars: &[Var], vel: Option<&[Tensor]>) -> Result<Momentum> {
        let vel = match vel {
            Some(v) => v.iter().map(Var::from_tensor).collect::<std::result::Result<_, _>>()?,
            None => vars
                .iter()
                .map(|v| Var::from_tensor(&v.as_tensor().zeros_like()?))
                .collect::<std::result::Result<_, _>>()?,
        };
        Ok(Momentum { vars: vars.to_vec(), vel })
    }

    fn step(&self, s: &Synced) -> Result<()> {
        for (w, v) in self.vars.iter().zip(&self.vel) {
            if let Some(g) = s.grads.get(w.as_tensor()) {
                let nv = (v.as_tensor().affine(MU, 0.0)? + g)?;
                w.set(&(w.as_tensor() - nv.affine(LR, 0.0)?)?)?;
                v.set(&nv)?;
            }
        }
        Ok(())
    }
}

fn forward(vars: &[Var], x: &Tensor) -> Result<Tensor> {
    let h = x.matmul(vars[0].as_tensor())?.broadcast_add(vars[1].as_tensor())?.relu()?;
    Ok(h.matmul(vars[2].as_tensor())?)
}

/// This rank's part of step `step`, for its place in the current world.
fn compute(dp: &mut DataParallel, step: u64, m: Member) -> Result<()> {
    let r = shard_range(BATCH, m.rank, m.world);
    if r.is_empty() {
        return Ok(());
    }
    let n = r.len();
    let (x, y) = samples(step, r)?;
    let vars = dp.vars().to_vec();
    let loss = (forward(&vars, &x)? - y)?.sqr()?.mean_all()?;
    dp.backward(&loss, n)
}

fn checksum(vars: &[Var]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in vars {
        for x in v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()? {
            for b in x.to_bits().to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    Ok(h)
}

/// `[4, 4, 3]` → `4x2,3x1`.
fn compress(worlds: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < worlds.len() {
        let j = (i..worlds.len()).find(|&j| worlds[j] != worlds[i]).unwrap_or(worlds.len());
        out.push(format!("{}x{}", worlds[i], j - i));
        i = j;
    }
    out.join(",")
}

fn expand(s: &str) -> Option<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.split(',') {
        let (w, k) = part.split_once('x')?;
        v.extend(std::iter::repeat_n(w.parse::<usize>().ok()?, k.parse().ok()?));
    }
    Some(v)
}

/// Microseconds since the Unix epoch (to time a recovery from outside).
fn now_us() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros())
}

fn arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

/// One process of a launched job.
fn launched(steps: u64, step_ms: u64) -> Result<()> {
    if std::env::var("TUTTI_JOIN").is_ok_and(|v| v == "1") {
        // Before the wait to be taken in (a test kills a newcomer at this point).
        println!("ASKING to join");
    }
    let comm = Comm::from_env()?;
    let vars = init()?;
    let opt = Momentum::new(&vars, None)?;
    let dp = DataParallel::new(comm, vars.clone(), DpConfig::default())?;
    let mut el = ElasticDp::with_state(dp, 0, opt.vel.clone())?;
    let first = el.done();
    if el.dp().comm().group().joined() {
        println!("JOINED rank {} at step {first}", el.dp().comm().rank());
    }
    println!("READY rank {}", el.dp().comm().rank());
    let mut worlds = Vec::new();
    let mut loss = f64::NAN;
    for step in first..steps {
        let out = el.step(step, |dp, m| compute(dp, step, m), |s: &Synced| opt.step(s))?;
        for r in &out.recoveries {
            println!(
                "RECOVERED step {} lost {:?} world {} kept {} took_ms {:.1} after: {}",
                r.step,
                r.lost,
                r.world,
                r.kept,
                r.took.as_secs_f64() * 1e3,
                r.cause
            );
        }
        if out.joined > 0 {
            println!(
                "GREW after step {step}: {} newcomers, world {}",
                out.joined,
                el.dp().comm().size()
            );
        }
        worlds.push(out.world);
        loss = out.loss;
        println!(
            "STEP {step} world {} rank {} t_us {}",
            out.world,
            el.dp().comm().rank(),
            now_us()
        );
        if step_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(step_ms));
        }
    }
    println!(
        "DONE loss {loss:.9} checksum {:016x} schedule {}",
        checksum(&vars)?,
        compress(&worlds)
    );
    Ok(())
}

/// The same training with the given world per step, ranks as threads over memory.
fn replay(schedule: &[usize]) -> Result<()> {
    // The replay takes the settings a job takes from its environment (`TUTTI_DIRECT=0` to
    // replay a job whose links cannot read peers' memory, with `TUTTI_SHM=0`): the bits of a
    // float sum depend on the algorithm that adds.
    let cfg = tutti_collectives::Config::from_env()?;
    let vars = init()?;
    let mut vel: Vec<Tensor> =
        vars.iter().map(|v| v.as_tensor().zeros_like()).collect::<std::result::Result<_, _>>()?;
    let mut loss = f64::NAN;
    let mut step = 0usize;
    while step < schedule.len() {
        let w = schedule[step];
        let end = (step..schedule.len()).find(|&j| schedule[j] != w).unwrap_or(schedule.len());
        let start_vals: Vec<Tensor> =
            vars.iter().map(|v| v.as_tensor().copy()).collect::<std::result::Result<_, _>>()?;
        let start_vel: Vec<Tensor> =
            vel.iter().map(|v| v.copy()).collect::<std::result::Result<_, _>>()?;
        let results = std::thread::scope(|s| {
            let hs: Vec<_> = tutti_runtime::Group::mem_world(w)
                .into_iter()
                .map(|g| Comm::with_config(g, cfg.clone()))
                .map(|c| {
                    let (start_vals, start_vel) = (&start_vals, &start_vel);
                    s.spawn(move || -> Result<(f64, Vec<Tensor>, Vec<Tensor>)> {
                        let mine: Vec<Var> = start_vals
                            .iter()
                            .map(Var::from_tensor)
                            .collect::<std::result::Result<_, _>>()?;
                        let opt = Momentum::new(&mine, Some(start_vel))?;
                        let mut dp = DataParallel::new(c, mine.clone(), DpConfig::default())?;
                        let mut loss = f64::NAN;
                        for k in step..end {
                            let m = Member { rank: dp.comm().rank(), world: w };
                            compute(&mut dp, k as u64, m)?;
                            let s = dp.sync()?;
                            opt.step(&s)?;
                            loss = s.loss;
                        }
                        let vel = opt.vel.iter().map(|v| v.as_tensor().clone()).collect();
                        Ok((loss, mine.iter().map(|v| v.as_tensor().clone()).collect(), vel))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("a replay rank panicked")).collect::<Vec<_>>()
        });
        let (l, vals, vels) = results.into_iter().next().expect("one rank at least")?;
        for (v, t) in vars.iter().zip(vals) {
            v.set(&t)?;
        }
        vel = vels;
        loss = l;
        step = end;
    }
    println!(
        "DONE loss {loss:.9} checksum {:016x} schedule {}",
        checksum(&vars)?,
        compress(schedule)
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let r = if let Some(s) = arg("--schedule") {
        match expand(&s) {
            Some(v) => replay(&v),
            None => {
                eprintln!("elastic_dp: --schedule wants WORLDxSTEPS[,…], e.g. 4x10,3x30");
                return std::process::ExitCode::from(2);
            }
        }
    } else if tutti_parallel::launched() {
        let steps = arg("--steps").and_then(|v| v.parse().ok()).unwrap_or(100);
        let step_ms = arg("--step-ms").and_then(|v| v.parse().ok()).unwrap_or(0);
        launched(steps, step_ms)
    } else {
        eprintln!(
            "elastic_dp: run it under a launcher (tutti-run --elastic --nproc 4 -- …), or replay \
             a schedule alone (--schedule 4x10,3x30)"
        );
        return std::process::ExitCode::from(2);
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("ERROR {e}");
            eprintln!("elastic_dp: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
