//! Pipeline parallel: consecutive layers per stage (one stage per rank), activations sent
//! forward and their gradients backward over point-to-point messages, micro-batches scheduled
//! GPipe-style (all forwards, then all backwards) or 1F1B (warm-up forwards, then one forward and
//! one backward alternately, then the remaining backwards).

use std::time::{Duration, Instant};

use candle_core::{backprop::GradStore, DType, Tensor, Var};
use tutti_collectives::Comm;

use crate::error::{Error, Result};

/// A micro-batch schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards: simple, holds every micro-batch's activations.
    GPipe,
    /// One forward, one backward (PipeDream-flush / Megatron's default): the same bubble,
    /// at most `stages - stage` micro-batches' activations held at once.
    OneFOneB,
}

impl Schedule {
    /// Parse `gpipe` or `1f1b`.
    pub fn parse(s: &str) -> Option<Schedule> {
        match s {
            "gpipe" => Some(Schedule::GPipe),
            "1f1b" => Some(Schedule::OneFOneB),
            _ => None,
        }
    }

    /// The order of forward (`true`) and backward (`false`) actions on `stage` of `stages` for
    /// `m` micro-batches, with the micro-batch index.
    pub fn actions(self, stage: usize, stages: usize, m: usize) -> Vec<(bool, usize)> {
        match self {
            Schedule::GPipe => {
                (0..m).map(|i| (true, i)).chain((0..m).map(|i| (false, i))).collect()
            }
            Schedule::OneFOneB => {
                let warm = (stages - stage - 1).min(m);
                let mut out: Vec<(bool, usize)> = (0..warm).map(|i| (true, i)).collect();
                for k in 0..m - warm {
                    out.push((true, warm + k));
                    out.push((false, k));
                }
                out.extend((m - warm..m).map(|i| (false, i)));
                out
            }
        }
    }

    /// The idle fraction of an ideal pipeline: `(P-1)/(M+P-1)` for both schedules.
    pub fn ideal_bubble(stages: usize, m: usize) -> f64 {
        (stages - 1) as f64 / (m + stages - 1) as f64
    }
}

/// What one [`Pipeline::step`] produced on this stage.
#[derive(Debug)]
pub struct StepResult {
    /// This stage's parameters' gradients, summed over the micro-batches.
    pub grads: GradStore,
    /// The sum of the (scaled) micro-batch losses, known on every stage.
    pub loss: f64,
    /// Time spent waiting for messages (the bubble, as this stage saw it).
    pub waiting: Duration,
    /// Wall time of the step.
    pub total: Duration,
}

/// One rank's stage of a pipeline over `comm` (stage = rank, `comm.size()` stages).
#[derive(Debug, Clone)]
pub struct Pipeline {
    comm: Comm,
    schedule: Schedule,
}

struct Slot {
    input: Option<Var>,
    output: Option<Tensor>,
}

const TAG_ACT: u32 = 0;
const TAG_GRAD: u32 = 1;

fn tag(kind: u32, mb: usize) -> u32 {
    // Messages of one (peer, tag) arrive in order, so reusing tags across steps is safe.
    ((mb as u32) << 1) | kind
}

impl Pipeline {
    /// This rank's stage.
    pub fn new(comm: Comm, schedule: Schedule) -> Pipeline {
        Pipeline { comm, schedule }
    }

    /// This rank's stage index.
    pub fn stage(&self) -> usize {
        self.comm.rank()
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.comm.size()
    }

    /// Run `micro_batches` micro-batches forward and backward through the pipeline.
    ///
    /// - `input(i)`: micro-batch `i`'s input (called on the first stage only);
    /// - `in_shape(i)`: the shape of the activation this stage receives for micro-batch `i`
    ///   (called on every stage but the first; it is the previous stage's output shape);
    /// - `forward(x)`: this stage's layers;
    /// - `loss(i, y)`: micro-batch `i`'s loss from the last stage's output, scaled so that the
    ///   sum over micro-batches is the full-batch loss (e.g. by `n_i / batch` for a mean);
    /// - `vars`: this stage's parameters, whose gradients are accumulated.
    ///
    /// Sends are deferred and posted together with the next receive ([`Comm::batch_p2p`]), so
    /// neighbours exchanging activations and gradients at the same moment never deadlock.
    ///
    /// # Collective contract
    /// Every stage calls it with the same `micro_batches` and schedule.
    ///
    /// # Errors
    /// Collective errors (a dead stage is named), candle errors, [`Error::Shape`] when a
    /// received activation does not have `in_shape`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &self,
        micro_batches: usize,
        input: impl Fn(usize) -> Result<Tensor>,
        in_shape: impl Fn(usize) -> Vec<usize>,
        forward: impl Fn(&Tensor) -> Result<Tensor>,
        loss: impl Fn(usize, &Tensor) -> Result<Tensor>,
        vars: &[Var],
    ) -> Result<StepResult> {
        let start = Instant::now();
        let (s, p) = (self.stage(), self.stages());
        let (first, last) = (s == 0, s + 1 == p);
        let mut slots: Vec<Slot> =
            (0..micro_batches).map(|_| Slot { input: None, output: None }).collect();
        let mut outbox: Vec<(usize, u32, Vec<f32>)> = Vec::new();
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut store: Option<GradStore> = None;
        let mut loss_sum = 0f64;
        let mut waiting = Duration::ZERO;
        // Receive one tensor (flushing deferred sends with it).
        let mut exchange = |outbox: &mut Vec<(usize, u32, Vec<f32>)>,
                            recv: Option<(usize, u32, Vec<usize>)>|
         -> Result<Option<Tensor>> {
            let t0 = Instant::now();
            let sends: Vec<(usize, u32, &[f32])> =
                outbox.iter().map(|(d, t, v)| (*d, *t, v.as_slice())).collect();
            let got = match recv {
                Some((src, tg, shape)) => {
                    let mut buf = vec![0f32; shape.iter().product()];
                    let n = {
                        let mut r = [(src, tg, buf.as_mut_slice())];
                        self.comm.batch_p2p(&sends, &mut r).map_err(Error::from)?[0]
                    };
                    if n != buf.len() {
                        return Err(Error::Shape {
                            rank: s,
                            layer: "pipeline",
                            detail: format!(
                                "stage {src} sent {n} elements, expected {shape:?} ({})",
                                buf.len()
                            ),
                        });
                    }
                    Some(Tensor::from_vec(buf, shape, &candle_core::Device::Cpu)?)
                }
                None => {
                    if !sends.is_empty() {
                        self.comm.batch_p2p::<f32>(&sends, &mut [])?;
                    }
                    None
                }
            };
            outbox.clear();
            waiting += t0.elapsed();
            Ok(got)
        };
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        for (is_fwd, i) in self.schedule.actions(s, p, micro_batches) {
            if is_fwd {
                let x = if first {
                    input(i)?
                } else {
                    let t = exchange(&mut outbox, Some((s - 1, tag(TAG_ACT, i), in_shape(i))))?;
                    let v = Var::from_tensor(&t.ok_or_else(|| Error::Shape {
                        rank: s,
                        layer: "pipeline",
                        detail: "no activation".into(),
                    })?)?;
                    slots[i].input = Some(v.clone());
                    v.as_tensor().clone()
                };
                let y = forward(&x)?;
                if !last {
                    outbox.push((s + 1, tag(TAG_ACT, i), flat(&y)?));
                }
                slots[i].output = Some(y);
            } else {
                let y = slots[i].output.take().ok_or_else(|| Error::Shape {
                    rank: s,
                    layer: "pipeline",
                    detail: format!("backward of micro-batch {i} before its forward"),
                })?;
                let target = if last {
                    let l = loss(i, &y)?;
                    loss_sum += l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    l
                } else {
                    let g =
                        exchange(&mut outbox, Some((s + 1, tag(TAG_GRAD, i), y.dims().to_vec())))?;
                    let g = g.ok_or_else(|| Error::Shape {
                        rank: s,
                        layer: "pipeline",
                        detail: "no gradient".into(),
                    })?;
                    (&y * g.to_dtype(y.dtype())?)?.sum_all()?
                };
                let grads = target.backward()?;
                for (a, v) in acc.iter_mut().zip(vars) {
                    if let Some(g) = grads.get(v.as_tensor()) {
                        *a = Some(match a.take() {
                            Some(x) => (x + g)?,
                            None => g.clone(),
                        });
                    }
                }
                if let Some(inp) = slots[i].input.take() {
                    let gx = grads
                        .get(inp.as_tensor())
                        .cloned()
                        .map_or_else(|| inp.as_tensor().zeros_like(), Ok)?;
                    outbox.push((s - 1, tag(TAG_GRAD, i), flat(&gx)?));
                }
                store.get_or_insert(grads);
            }
        }
        exchange(&mut outbox, None)?;
        let mut store = match store {
            Some(st) => st,
            None => Tensor::zeros((), DType::F32, &candle_core::Device::Cpu)?.backward()?,
        };
        for (a, v) in acc.into_iter().zip(vars) {
            if let Some(g) = a {
                store.insert(v.as_tensor(), g);
            }
        }
        let mut l = [loss_sum];
        self.comm.broadcast(&mut l, p - 1)?;
        Ok(StepResult { grads: store, loss: l[0], waiting, total: start.elapsed() })
    }
}
