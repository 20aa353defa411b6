//! The golden runner: loads a PyTorch reference case (`<case>.json` + `<case>.safetensors`, the
//! format described in `parallel/golden/README.md`), runs it under a parallel strategy on this
//! rank's group and compares every reference tensor it reproduces.
//!
//! Shapes and hyper-parameters come from the files (the tensors' shapes, the json's `config`),
//! so a case of the same kind with other sizes runs unchanged. The kind is the json's `case`
//! field: `linear_step` (G1: data parallel, accumulation, tensor parallel), `mlp_train` (G2: the
//! same over several steps), `transformer_block` (G3: TP, TP + SP, Ulysses), `tiny_lm` (G4: TP,
//! TP + SP, vocab parallel) and `pipeline_mlp` (G5: pipeline parallel).
//!
//! Tolerances are the json's: forward values of a single pass within `forward_max_abs` (1e-5);
//! gradients, multi-step losses and updated weights within
//! `grad_and_multistep_rel * max|ref| + 1e-6`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use tutti_collectives::{Comm, ReduceOp};

use crate::block::{Block, BlockConfig, BlockMode, Param};
use crate::error::{Error, Result};
use crate::ops;
use crate::shard::shard_range;
use crate::{ColumnParallelLinear, DataParallel, DpConfig, RowParallelLinear};
use candle_core::backprop::GradStore;

/// A loaded case.
#[derive(Debug)]
pub struct Case {
    /// The json file.
    pub path: PathBuf,
    /// The json.
    pub meta: serde_json::Value,
    /// The tensors, by name.
    pub tensors: HashMap<String, Tensor>,
}

impl Case {
    /// Load `json` and the safetensors file it names (relative to the json's folder).
    ///
    /// # Errors
    /// [`Error::Golden`] for unreadable or malformed files.
    pub fn load(json: &Path) -> Result<Case> {
        Case::load_on(json, &Device::Cpu)
    }

    /// [`Case::load`], with the tensors on `device` (a CUDA device runs the case's parameters,
    /// inputs and communication on the GPU).
    ///
    /// # Errors
    /// As [`Case::load`]; candle errors moving the tensors.
    pub fn load_on(json: &Path, device: &Device) -> Result<Case> {
        let bad = |detail: String| Error::Golden { case: json.display().to_string(), detail };
        let text = std::fs::read_to_string(json).map_err(|e| bad(format!("cannot read: {e}")))?;
        let meta: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not json: {e}")))?;
        let file = meta
            .get("file")
            .and_then(|f| f.as_str())
            .ok_or_else(|| bad("no \"file\" field naming the safetensors file".into()))?;
        let st = json.parent().unwrap_or(Path::new(".")).join(file);
        let tensors = candle_core::safetensors::load(&st, &Device::Cpu)
            .map_err(|e| bad(format!("cannot load {}: {e}", st.display())))?;
        let tensors = tensors
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_device(device)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Case { path: json.to_path_buf(), meta, tensors })
    }

    fn err(&self, detail: String) -> Error {
        Error::Golden { case: self.path.display().to_string(), detail }
    }

    /// The case kind (`linear_step`, `mlp_train`, …).
    pub fn kind(&self) -> &str {
        self.meta.get("case").and_then(|c| c.as_str()).unwrap_or("")
    }

    /// A tensor by name.
    ///
    /// # Errors
    /// [`Error::Golden`] when it is missing.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.tensors.get(name).cloned().ok_or_else(|| self.err(format!("no tensor {name:?}")))
    }

    /// A number from `config`.
    ///
    /// # Errors
    /// [`Error::Golden`] when it is missing.
    pub fn config(&self, key: &str) -> Result<f64> {
        self.meta
            .get("config")
            .and_then(|c| c.get(key))
            .and_then(|v| v.as_f64())
            .ok_or_else(|| self.err(format!("no number config.{key}")))
    }

    fn tolerance(&self, key: &str, default: f64) -> f64 {
        self.meta
            .get("tolerances")
            .and_then(|t| t.get(key))
            .and_then(|v| v.as_f64())
            .unwrap_or(default)
    }
}

/// A parallel strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Data parallel (batch split with `shard_range`, uneven allowed).
    Dp,
    /// Data parallel with gradient accumulation over micro-batches on every rank.
    Accum,
    /// Megatron tensor parallel.
    Tp,
    /// Megatron tensor + sequence parallel.
    TpSp,
    /// Ulysses sequence parallel.
    Ulysses,
    /// Tensor parallel with the vocabulary sharded (tiny LM).
    Vocab,
    /// Pipeline parallel.
    Pp,
}

impl Strategy {
    /// Parse a command-line name.
    pub fn parse(s: &str) -> Option<Strategy> {
        Some(match s {
            "dp" => Strategy::Dp,
            "accum" => Strategy::Accum,
            "tp" => Strategy::Tp,
            "tp-sp" => Strategy::TpSp,
            "ulysses" => Strategy::Ulysses,
            "vocab" => Strategy::Vocab,
            "pp" => Strategy::Pp,
            _ => return None,
        })
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Dp => "dp",
            Strategy::Accum => "accum",
            Strategy::Tp => "tp",
            Strategy::TpSp => "tp-sp",
            Strategy::Ulysses => "ulysses",
            Strategy::Vocab => "vocab",
            Strategy::Pp => "pp",
        }
    }
}

/// Options of a run.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Micro-batches per rank for [`Strategy::Accum`]; for [`Strategy::Pp`], overrides the
    /// case's `micro_batches` when set explicitly.
    pub micro_batches: usize,
    /// Micro-batches for [`Strategy::Pp`] (`None`: the case's `config.micro_batches`).
    pub pp_micro_batches: Option<usize>,
    /// Pipeline schedule for [`Strategy::Pp`].
    pub schedule: crate::Schedule,
}

impl Default for Options {
    fn default() -> Self {
        Options { micro_batches: 4, pp_micro_batches: None, schedule: crate::Schedule::OneFOneB }
    }
}

/// One compared tensor.
#[derive(Clone, Debug)]
pub struct Check {
    /// Reference tensor name.
    pub name: String,
    /// Largest |ours - reference| over all ranks.
    pub max_abs: f64,
    /// The allowed difference.
    pub tolerance: f64,
}

impl Check {
    /// Within the tolerance.
    pub fn ok(&self) -> bool {
        self.max_abs <= self.tolerance
    }
}

/// The outcome of a run (the same on every rank).
#[derive(Clone, Debug)]
pub struct Report {
    /// Case kind.
    pub case: String,
    /// Strategy run.
    pub strategy: Strategy,
    /// Ranks.
    pub world: usize,
    /// Compared tensors.
    pub checks: Vec<Check>,
}

impl Report {
    /// Every check passed (and there was at least one).
    pub fn ok(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(Check::ok)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "# case {}  strategy {}  world {}",
            self.case,
            self.strategy.name(),
            self.world
        )?;
        writeln!(f, "# {:<28} {:>12} {:>12}  result", "tensor", "max|diff|", "tolerance")?;
        for c in &self.checks {
            let res = if c.ok() { "ok" } else { "FAIL" };
            writeln!(f, "  {:<28} {:>12.3e} {:>12.3e}  {res}", c.name, c.max_abs, c.tolerance)?;
        }
        let bad = self.checks.iter().filter(|c| !c.ok()).count();
        if self.ok() {
            write!(f, "PASS: {} tensors within tolerance", self.checks.len())
        } else {
            write!(f, "FAIL: {bad} of {} tensors outside tolerance", self.checks.len())
        }
    }
}

/// How a reference is compared.
#[derive(Clone, Copy)]
enum Tol {
    /// Single forward pass: absolute.
    Forward,
    /// Gradients, multi-step values: relative to the reference's largest magnitude.
    Relative,
}

/// Collects checks; the max difference is reduced over the ranks at the end.
struct Checker<'a> {
    case: &'a Case,
    comm: &'a Comm,
    checks: Vec<Check>,
}

impl Checker<'_> {
    /// The loss curve: the first loss at the forward tolerance, every loss at the relative one.
    fn losses(&mut self, losses: &[f32]) -> Result<()> {
        let losses = Tensor::new(losses, &Device::Cpu)?;
        let first = self.case.tensor("losses")?.narrow(0, 0, 1)?;
        self.part("losses[0]", &losses.narrow(0, 0, 1)?, &first, Tol::Forward)?;
        self.whole("losses", &losses, Tol::Relative)
    }

    /// The allowed difference for reference `name` (the whole tensor sets the scale).
    fn tolerance(&self, name: &str, tol: Tol) -> Result<f64> {
        let full = self.case.tensor(name.trim_end_matches("[0]"))?;
        let max_ref =
            full.abs()?.flatten_all()?.max(0)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(match tol {
            Tol::Forward => self.case.tolerance("forward_max_abs", 1e-5),
            Tol::Relative => self.case.tolerance("grad_and_multistep_rel", 1e-4) * max_ref + 1e-6,
        })
    }

    /// Reference `name` is compared on another rank (the pipeline stage that holds it): record
    /// it with no difference here, so every rank lists the same checks and `finish` takes the
    /// holder's.
    fn elsewhere(&mut self, name: &str, tol: Tol) -> Result<()> {
        let tolerance = self.tolerance(name, tol)?;
        self.checks.push(Check { name: name.to_string(), max_abs: 0.0, tolerance });
        Ok(())
    }

    fn part(&mut self, name: &str, ours: &Tensor, part: &Tensor, tol: Tol) -> Result<()> {
        let tolerance = self.tolerance(name, tol)?;
        if ours.dims() != part.dims() && ours.elem_count() != part.elem_count() {
            return Err(self.case.err(format!(
                "{name}: computed shape {:?} vs reference {:?}",
                ours.dims(),
                part.dims()
            )));
        }
        // NaN or infinity anywhere never passes.
        let max_abs = crate::compare::max_abs_diff(ours, part)?;
        self.checks.push(Check { name: name.to_string(), max_abs, tolerance });
        Ok(())
    }

    /// Compare with the whole reference tensor.
    fn whole(&mut self, name: &str, ours: &Tensor, tol: Tol) -> Result<()> {
        let r = self.case.tensor(name)?;
        self.part(name, ours, &r, tol)
    }

    fn finish(mut self, strategy: Strategy) -> Result<Report> {
        let mut d: Vec<f64> = self.checks.iter().map(|c| c.max_abs).collect();
        self.comm.allreduce(&mut d, ReduceOp::Max)?;
        for (c, v) in self.checks.iter_mut().zip(d) {
            c.max_abs = v;
        }
        Ok(Report {
            case: self.case.kind().to_string(),
            strategy,
            world: self.comm.size(),
            checks: self.checks,
        })
    }
}

fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

fn rows(t: &Tensor, r: std::ops::Range<usize>) -> Result<Tensor> {
    Ok(t.narrow(0, r.start, r.len())?)
}

fn mse_mean(out: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok((out - y)?.sqr()?.mean_all()?)
}

/// Run `case` under `strategy` on this rank; every rank of `comm` calls it.
///
/// # Errors
/// [`Error::Golden`] for a case or strategy this runner does not know or tensors it lacks;
/// [`Error::Shape`] when the world does not divide a dimension the strategy splits evenly;
/// collective and candle errors.
pub fn run(case: &Case, strategy: Strategy, comm: &Comm, opts: &Options) -> Result<Report> {
    match (case.kind(), strategy) {
        ("linear_step", Strategy::Dp | Strategy::Accum) => {
            linear_step_dp(case, strategy, comm, opts)
        }
        ("linear_step", Strategy::Tp) => linear_step_tp(case, comm),
        ("mlp_train", Strategy::Dp | Strategy::Accum) => mlp_train_dp(case, strategy, comm, opts),
        ("mlp_train", Strategy::Tp) => mlp_train_tp(case, comm),
        ("transformer_block", s @ (Strategy::Tp | Strategy::TpSp | Strategy::Ulysses)) => {
            transformer_block(case, s, comm)
        }
        ("pipeline_mlp", Strategy::Pp) => pipeline_mlp(case, comm, opts),
        ("tiny_lm", s @ (Strategy::Tp | Strategy::TpSp | Strategy::Vocab)) => {
            tiny_lm(case, s, comm)
        }
        (kind, s) => Err(case.err(format!(
            "no strategy {:?} for case kind {kind:?} (linear_step: dp, accum, tp; mlp_train: dp, \
             accum, tp; transformer_block: tp, tp-sp, ulysses; tiny_lm: tp, tp-sp, vocab; \
             pipeline_mlp: pp)",
            s.name()
        ))),
    }
}

/// The micro-batches of this rank's rows: `(range, samples)`.
fn micro_ranges(
    batch: usize,
    comm: &Comm,
    strategy: Strategy,
    opts: &Options,
) -> Vec<std::ops::Range<usize>> {
    let mine = shard_range(batch, comm.rank(), comm.size());
    let m = if strategy == Strategy::Accum { opts.micro_batches.max(1) } else { 1 };
    (0..m)
        .map(|k| {
            let r = shard_range(mine.len(), k, m);
            mine.start + r.start..mine.start + r.end
        })
        .filter(|r| !r.is_empty())
        .collect()
}

/// G1 under data parallel (optionally with accumulation).
fn linear_step_dp(case: &Case, strategy: Strategy, comm: &Comm, opts: &Options) -> Result<Report> {
    let (x, y) = (case.tensor("x")?, case.tensor("y")?);
    let w = Var::from_tensor(&case.tensor("w0")?)?;
    let lr = case.config("lr")?;
    let mut dp = DataParallel::new(comm.clone(), vec![w.clone()], DpConfig::default())?;
    for r in micro_ranges(x.dim(0)?, comm, strategy, opts) {
        let out = rows(&x, r.clone())?.matmul(w.as_tensor())?;
        let loss = mse_mean(&out, &rows(&y, r.clone())?)?;
        dp.backward(&loss, r.len())?;
    }
    let s = dp.sync()?;
    let grad = s.grads.get(w.as_tensor()).cloned().ok_or_else(|| case.err("no gradient".into()))?;
    let mut opt = SGD::new(vec![w.clone()], lr)?;
    opt.step(&s.grads)?;
    let mut ck = Checker { case, comm, checks: Vec::new() };
    ck.whole("loss", &Tensor::new(s.loss as f32, &Device::Cpu)?, Tol::Forward)?;
    ck.whole("grad_w", &grad, Tol::Relative)?;
    ck.whole("w1", w.as_tensor(), Tol::Relative)?;
    ck.finish(strategy)
}

/// G1 under tensor parallel over the output features.
fn linear_step_tp(case: &Case, comm: &Comm) -> Result<Report> {
    let (x, y, w0) = (case.tensor("x")?, case.tensor("y")?, case.tensor("w0")?);
    let lr = case.config("lr")?;
    let (batch, out_dim) = y.dims2()?;
    // w0 is [in, out] (x @ W); the nn.Linear weight is its transpose.
    let layer = ColumnParallelLinear::from_full(&w0.t()?, None, false, comm)?;
    let cols = shard_range(out_dim, comm.rank(), comm.size());
    let y_local = y.narrow(1, cols.start, cols.len())?;
    let out = layer.forward(&x)?;
    let sse = ((out - y_local)?.sqr()?.sum_all()? / (batch * out_dim) as f64)?;
    let loss = ops::reduce_from_parallel_region(&sse, comm)?;
    let grads = loss.backward()?;
    let w = layer.weight();
    let grad = grads.get(w.as_tensor()).cloned().ok_or_else(|| case.err("no gradient".into()))?;
    SGD::new(layer.vars(), lr)?.step(&grads)?;
    let part = |name: &str| -> Result<Tensor> {
        Ok(case.tensor(name)?.narrow(1, cols.start, cols.len())?.t()?)
    };
    let mut ck = Checker { case, comm, checks: Vec::new() };
    ck.whole("loss", &loss, Tol::Forward)?;
    ck.part("grad_w", &grad, &part("grad_w")?, Tol::Relative)?;
    ck.part("w1", w.as_tensor(), &part("w1")?, Tol::Relative)?;
    ck.finish(Strategy::Tp)
}

fn steps(case: &Case) -> Result<usize> {
    Ok(case.config("steps")? as usize)
}

/// G2 under data parallel: uneven shards, weighted combination, `steps` SGD steps.
fn mlp_train_dp(case: &Case, strategy: Strategy, comm: &Comm, opts: &Options) -> Result<Report> {
    let (x, y) = (case.tensor("x")?, case.tensor("y")?);
    let w1 = Var::from_tensor(&case.tensor("lin1.weight")?)?;
    let w2 = Var::from_tensor(&case.tensor("lin2.weight")?)?;
    let mut dp =
        DataParallel::new(comm.clone(), vec![w1.clone(), w2.clone()], DpConfig::default())?;
    let mut opt = SGD::new(vec![w1.clone(), w2.clone()], case.config("lr")?)?;
    let mut losses = Vec::new();
    for _ in 0..steps(case)? {
        for r in micro_ranges(x.dim(0)?, comm, strategy, opts) {
            let xb = rows(&x, r.clone())?;
            let out = xb.matmul(&w1.t()?)?.gelu_erf()?.matmul(&w2.t()?)?;
            dp.backward(&mse_mean(&out, &rows(&y, r.clone())?)?, r.len())?;
        }
        let s = dp.sync()?;
        losses.push(s.loss as f32);
        opt.step(&s.grads)?;
    }
    mlp_report(case, comm, strategy, &losses, w1.as_tensor(), w2.as_tensor(), None)
}

/// G2 under tensor parallel: lin1 column-parallel, lin2 row-parallel.
fn mlp_train_tp(case: &Case, comm: &Comm) -> Result<Report> {
    let (x, y) = (case.tensor("x")?, case.tensor("y")?);
    let lin1 = ColumnParallelLinear::from_full(&case.tensor("lin1.weight")?, None, false, comm)?;
    let lin2 = RowParallelLinear::from_full(&case.tensor("lin2.weight")?, None, true, comm)?;
    let vars: Vec<Var> = lin1.vars().into_iter().chain(lin2.vars()).collect();
    let mut opt = SGD::new(vars, case.config("lr")?)?;
    let mut losses = Vec::new();
    for _ in 0..steps(case)? {
        let out = lin2.forward(&lin1.forward(&x)?.gelu_erf()?)?;
        let loss = mse_mean(&out, &y)?;
        losses.push(scalar(&loss)? as f32);
        opt.step(&loss.backward()?)?;
    }
    let hidden = shard_range(case.tensor("lin1.weight")?.dim(0)?, comm.rank(), comm.size());
    let w1 = lin1.weight().as_tensor();
    let w2 = lin2.weight().as_tensor();
    mlp_report(case, comm, Strategy::Tp, &losses, w1, w2, Some(hidden))
}

fn mlp_report(
    case: &Case,
    comm: &Comm,
    strategy: Strategy,
    losses: &[f32],
    w1: &Tensor,
    w2: &Tensor,
    hidden: Option<std::ops::Range<usize>>,
) -> Result<Report> {
    let mut ck = Checker { case, comm, checks: Vec::new() };
    ck.losses(losses)?;
    let (p1, p2) = match hidden {
        None => (case.tensor("lin1.weight_final")?, case.tensor("lin2.weight_final")?),
        Some(h) => (
            case.tensor("lin1.weight_final")?.narrow(0, h.start, h.len())?,
            case.tensor("lin2.weight_final")?.narrow(1, h.start, h.len())?,
        ),
    };
    ck.part("lin1.weight_final", w1, &p1, Tol::Relative)?;
    ck.part("lin2.weight_final", w2, &p2, Tol::Relative)?;
    ck.finish(strategy)
}

fn block_config(case: &Case) -> Result<BlockConfig> {
    let causal = case
        .meta
        .get("config")
        .and_then(|c| c.get("causal"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let eps = case.config("layernorm_eps").unwrap_or(1e-5);
    Ok(BlockConfig { n_heads: case.config("n_heads")? as usize, causal, eps })
}

/// G3: one block forward and backward of `loss = sum(y * g)`.
fn transformer_block(case: &Case, strategy: Strategy, comm: &Comm) -> Result<Report> {
    let mode = match strategy {
        Strategy::Tp => BlockMode::Tp,
        Strategy::TpSp => BlockMode::TpSp,
        _ => BlockMode::Ulysses,
    };
    let block = Block::from_weights(&case.tensors, "", block_config(case)?, mode, comm)?;
    let sharded = mode != BlockMode::Tp;
    let local = |t: Tensor| -> Result<Tensor> {
        if sharded {
            crate::block::sequence_shard(&t, comm)
        } else {
            Ok(t)
        }
    };
    let x = Var::from_tensor(&local(case.tensor("x")?)?)?;
    let g = local(case.tensor("g")?)?;
    let y = block.forward(x.as_tensor())?;
    let local_loss = (&y * &g)?.sum_all()?;
    let mut grads = local_loss.backward()?;
    crate::block::sum_replicated_grads(block.params(), &mut grads, comm)?;
    let loss =
        if sharded { ops::all_reduce(&local_loss, comm, ReduceOp::Sum)? } else { local_loss };
    let mut ck = Checker { case, comm, checks: Vec::new() };
    ck.part("y", &y, &local(case.tensor("y")?)?, Tol::Forward)?;
    ck.whole("loss", &loss, Tol::Relative)?;
    let gx = grads.get(x.as_tensor()).cloned().ok_or_else(|| case.err("no grad of x".into()))?;
    ck.part("grad.x", &gx, &local(case.tensor("grad.x")?)?, Tol::Relative)?;
    check_params(&mut ck, block.params(), &grads)?;
    ck.finish(strategy)
}

/// G4: the tiny LM trained `steps` SGD steps with TP + vocab-parallel loss (`tp`/`vocab`), or
/// with sequence parallelism too (`tp-sp`).
fn tiny_lm(case: &Case, strategy: Strategy, comm: &Comm) -> Result<Report> {
    let mut block = block_config(case)?;
    block.causal = true;
    let ignore = case.config("ignore_index").ok().map(|v| v as i64);
    let cfg = crate::LmConfig { block, n_blocks: 1, ignore_index: ignore };
    let mode = if strategy == Strategy::TpSp { crate::LmMode::TpSp } else { crate::LmMode::Tp };
    let lm = crate::TinyLm::from_weights(&case.tensors, cfg, mode, comm)?;
    let tokens = case.tensor("tokens")?;
    let mut opt = SGD::new(lm.vars(), case.config("lr")?)?;
    let mut ck = Checker { case, comm, checks: Vec::new() };
    let mut losses = Vec::new();
    for step in 0..steps(case)? {
        let (loss, logits) = lm.loss(&tokens)?;
        losses.push(scalar(&loss)? as f32);
        let grads = lm.backward(&loss)?;
        if step == 0 {
            let range = shard_range(case.tensor("act.logits")?.dim(2)?, comm.rank(), comm.size());
            let want = case.tensor("act.logits")?.narrow(2, range.start, range.len())?;
            ck.part("act.logits", &logits, &want, Tol::Forward)?;
            check_params(&mut ck, lm.params(), &grads)?;
        }
        opt.step(&grads)?;
    }
    ck.losses(&losses)?;
    ck.finish(strategy)
}

/// G5: the deep GELU MLP (`x = gelu(x @ w.i)`) over pipeline stages, AdamW, `steps` steps.
fn pipeline_mlp(case: &Case, comm: &Comm, opts: &Options) -> Result<Report> {
    let layers = case.config("num_layers")? as usize;
    let x = case.tensor("x")?;
    let batch = x.dim(0)?;
    let m = match opts.pp_micro_batches {
        Some(m) => m,
        None => case.config("micro_batches")? as usize,
    };
    let mine = shard_range(layers, comm.rank(), comm.size());
    let ws: Vec<Var> = mine
        .clone()
        .map(|i| Ok(Var::from_tensor(&case.tensor(&format!("w.{i}"))?.copy()?)?))
        .collect::<Result<_>>()?;
    let adam = case.meta.get("config").and_then(|c| c.get("optimizer"));
    let num = |k: &str, d: f64| adam.and_then(|a| a.get(k)).and_then(|v| v.as_f64()).unwrap_or(d);
    let betas = adam.and_then(|a| a.get("betas")).and_then(|b| b.as_array());
    let beta =
        |i: usize, d: f64| betas.and_then(|b| b.get(i)).and_then(|v| v.as_f64()).unwrap_or(d);
    let params = candle_nn::ParamsAdamW {
        lr: num("lr", 1e-3),
        beta1: beta(0, 0.9),
        beta2: beta(1, 0.999),
        eps: num("eps", 1e-8),
        weight_decay: num("weight_decay", 1e-2),
    };
    let mut opt = candle_nn::AdamW::new(ws.clone(), params)?;
    let pipe = crate::Pipeline::new(comm.clone(), opts.schedule);
    let mb = |i: usize| shard_range(batch, i, m);
    let dim = x.dim(1)?;
    let mut ck = Checker { case, comm, checks: Vec::new() };
    let mut losses = Vec::new();
    for step in 0..steps(case)? {
        let r = pipe.step(
            m,
            |i| rows(&x, mb(i)),
            |i| vec![mb(i).len(), dim],
            |t| {
                let mut t = t.clone();
                for w in &ws {
                    t = t.matmul(w.as_tensor())?.gelu_erf()?;
                }
                Ok(t)
            },
            |i, y| Ok((y.sqr()?.mean_all()? * (mb(i).len() as f64 / batch as f64))?),
            &ws,
        )?;
        losses.push(r.loss as f32);
        if step == 0 {
            // Every rank lists every layer; the stage that holds it compares it.
            for i in 0..layers {
                let name = format!("grad.w.{i}");
                if mine.contains(&i) {
                    let w = &ws[i - mine.start];
                    let g = r
                        .grads
                        .get(w.as_tensor())
                        .cloned()
                        .ok_or_else(|| case.err("no gradient".into()))?;
                    ck.whole(&name, &g, Tol::Relative)?;
                } else {
                    ck.elsewhere(&name, Tol::Relative)?;
                }
            }
        }
        opt.step(&r.grads)?;
    }
    ck.losses(&losses)?;
    for i in 0..layers {
        let name = format!("w.{i}_final");
        if mine.contains(&i) {
            ck.whole(&name, ws[i - mine.start].as_tensor(), Tol::Relative)?;
        } else {
            ck.elsewhere(&name, Tol::Relative)?;
        }
    }
    ck.finish(Strategy::Pp)
}

/// Compare every parameter's gradient with the part of `grad.<name>` this rank holds.
fn check_params(ck: &mut Checker<'_>, params: &[Param], grads: &GradStore) -> Result<()> {
    for p in params {
        let name = format!("grad.{}", p.name);
        let full = ck.case.tensor(&name)?;
        let got = grads
            .get(p.var.as_tensor())
            .cloned()
            .ok_or_else(|| ck.case.err(format!("no gradient for {}", p.name)))?;
        ck.part(&name, &got, &p.part_of(&full, ck.comm)?, Tol::Relative)?;
    }
    Ok(())
}

/// Run several ranks of a case as threads over the in-memory transport (tests, quick runs).
///
/// # Errors
/// The first rank's error.
pub fn run_threads(
    case: &Case,
    strategy: Strategy,
    world: usize,
    opts: &Options,
) -> Result<Report> {
    let mut reports = crate::ranks::run_threads(world, |c| run(case, strategy, &c, opts))?;
    Ok(reports.swap_remove(0))
}

/// The candle device `--device` names.
fn golden_device(name: &str) -> std::result::Result<Device, String> {
    match name {
        "cpu" => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let gpu =
                tutti_collectives::device::cuda::local_ordinal().map_err(|e| e.to_string())?;
            Device::new_cuda(gpu).map_err(|e| format!("cannot open GPU: {e}"))
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err("tutti-golden was built without the `cuda` feature \
                       (cargo build -p tutti-parallel --features cuda, with nvcc: docs/gpu.md)"
            .into()),
        other => Err(format!("unknown device {other:?} (cpu, cuda)")),
    }
}

/// `tutti-golden`'s main: `--case FILE --strategy S [--micro-batches M] [--threads N]`. Under
/// a launcher (tutti-run, torchrun, srun) the group comes from the environment; with
/// `--threads N`, N ranks run as threads over the in-memory transport; with neither, one rank.
/// Rank 0 prints the table; every rank exits 1 when a tensor is outside its tolerance, 2 on an
/// error.
pub fn main() -> std::process::ExitCode {
    use clap::Parser;
    #[derive(Parser)]
    #[command(
        name = "tutti-golden",
        about = "Check a parallel strategy against a PyTorch golden case"
    )]
    struct Args {
        /// The case's json file (it names its safetensors file).
        #[arg(long, required_unless_present = "bench_moves")]
        case: Option<PathBuf>,
        /// dp, accum, tp, tp-sp, ulysses, vocab or pp (which apply depends on the case).
        #[arg(long, required_unless_present = "bench_moves")]
        strategy: Option<String>,
        /// Run the case this many times (each run checked); rank 0 prints each run's time and,
        /// with CUDA tensors, the pinned buffers it allocated.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        repeat: u64,
        /// Instead of a case: time the communication ops' forward and backward on f32 tensors
        /// of these sizes per rank (bytes, with K/M/G suffixes, comma-separated).
        #[arg(long, value_delimiter = ',', value_parser = tutti_collectives::parse_size)]
        bench_moves: Option<Vec<u64>>,
        /// Timed steps per op and size for `--bench-moves` (after 3 untimed ones).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
        steps: u64,
        /// Micro-batches per rank for `accum`.
        #[arg(long, default_value_t = 4)]
        micro_batches: usize,
        /// Pipeline micro-batches for `pp` (default: the case's).
        #[arg(long)]
        pp_micro_batches: Option<usize>,
        /// Pipeline schedule for `pp`: gpipe or 1f1b.
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Run N ranks as threads in this process (in-memory transport).
        #[arg(long)]
        threads: Option<usize>,
        /// Where the tensors live: cpu, or cuda (GPU LOCAL_RANK modulo the GPUs present;
        /// needs the `cuda` feature).
        #[arg(long, default_value = "cpu")]
        device: String,
    }
    let a = Args::parse();
    let fail = |msg: String| {
        eprintln!("tutti-golden: {msg}");
        std::process::ExitCode::from(2)
    };
    let device = match golden_device(&a.device) {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    if let Some(sizes) = &a.bench_moves {
        let sizes: Vec<usize> = sizes.iter().map(|&b| b as usize).collect();
        let table = lowest_rank(a.threads, |c: &Comm| {
            let rows = crate::movebench::bench(c, &device, &sizes, 3, a.steps as usize)?;
            let mut t = format!(
                "# moves  world {}  device {:?}  {} steps (median ms, forward + backward)\n",
                c.size(),
                device.location(),
                a.steps
            );
            for r in rows {
                let pinned = r.pinned_after_warmup.map_or("-".into(), |p| p.to_string());
                t += &format!(
                    "moves bytes={} median_ms={:.3} pinned_after_warmup={} op={}\n",
                    r.bytes, r.median_ms, pinned, r.op
                );
            }
            Ok(t)
        });
        return match table {
            Ok((t, rank)) => {
                // Only rank 0 prints (the lowest rank here may be another, under a launcher).
                if rank == 0 {
                    print!("{t}");
                }
                std::process::ExitCode::SUCCESS
            }
            Err(e) => fail(e.to_string()),
        };
    }
    let (Some(case_path), Some(strategy_name)) = (&a.case, &a.strategy) else {
        return fail("--case and --strategy are required".into());
    };
    let Some(strategy) = Strategy::parse(strategy_name) else {
        return fail(format!(
            "unknown strategy {strategy_name:?} (dp, accum, tp, tp-sp, ulysses, vocab, pp)"
        ));
    };
    let case = match Case::load_on(case_path, &device) {
        Ok(c) => c,
        Err(e) => return fail(e.to_string()),
    };
    let Some(schedule) = crate::Schedule::parse(&a.schedule) else {
        return fail(format!("unknown schedule {:?} (gpipe, 1f1b)", a.schedule));
    };
    let opts =
        Options { micro_batches: a.micro_batches, pp_micro_batches: a.pp_micro_batches, schedule };
    let repeat = a.repeat;
    // Each run is checked; the last run's report is printed, with every run's time and (CUDA)
    // the pinned buffers it allocated.
    let run_all = |c: &Comm| -> Result<(Report, String)> {
        let mut lines = String::new();
        let mut once = |i: u64| -> Result<Report> {
            let (p0, t) = (crate::movebench::pinned(), std::time::Instant::now());
            let r = run(&case, strategy, c, &opts)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let pinned =
                crate::movebench::pinned().zip(p0).map_or("-".into(), |(b, a)| (b - a).to_string());
            // The count is this process's: all ranks' together under --threads.
            lines += &format!(
                "run {i} of {repeat}: {ms:.2} ms, pinned allocations {pinned}, {}\n",
                if r.ok() { "PASS" } else { "FAIL" }
            );
            Ok(r)
        };
        let mut r = once(1)?;
        for i in 2..=repeat {
            if !r.ok() {
                break;
            }
            r = once(i)?;
        }
        Ok((r, lines))
    };
    let (report, rank) = match lowest_rank(a.threads, run_all) {
        Ok((r, rank)) => (Ok(r), rank),
        Err(e) => (Err(e), 0),
    };
    match report {
        Ok((r, lines)) => {
            if rank == 0 {
                println!("tensors on {:?}", device.location());
                if repeat > 1 {
                    print!("{lines}");
                }
                println!("{r}");
            }
            if r.ok() {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::from(1)
            }
        }
        Err(e) => fail(e.to_string()),
    }
}

/// Run `f` on this process's ranks (under a launcher its one rank, unless `--threads` asks
/// for that many in-memory ranks) and return the lowest one's result, with its rank.
fn lowest_rank<T: Send>(
    threads: Option<usize>,
    f: impl Fn(&Comm) -> Result<T> + Sync,
) -> Result<(T, usize)> {
    let mut v = match threads {
        None if crate::ranks::launched() => crate::run_ranks(1, |c| Ok((f(&c)?, c.rank())))?,
        t => crate::ranks::run_threads(t.unwrap_or(1), |c| Ok((f(&c)?, c.rank())))?,
    };
    v.sort_by_key(|(_, r)| *r);
    Ok(v.swap_remove(0))
}
