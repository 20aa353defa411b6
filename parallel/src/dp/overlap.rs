//! The last micro-batch's backward pass, stage by stage, with each bucket's allreduce started as
//! soon as the stages that hold its parameters are done: the gradient exchange overlaps the rest
//! of the backward pass, as PyTorch DDP's hooks make it. Candle has no per-parameter hooks; a
//! model cut into stages gives the same points to start from.
//!
//! Stage `k` runs forward on a detached copy of stage `k − 1`'s output, held as a [`Var`], so
//! its backward pass stops there and yields that input's gradient. The last stage's backward
//! starts from the loss; stage `k`'s from `sum(out_k · seed)`, `seed` the gradient of stage
//! `k + 1`'s input, whose gradient with respect to `out_k` is `seed` itself: the chain rule,
//! cut at the stage boundaries.

use std::ops::Range;

use candle_core::{DType, Tensor, TensorId, Var};
use tutti_collectives::{Comm, ReduceOp};

use super::{
    cpu_span, pack, wait_all, with_all_mut, with_storage_mut, Bucket, BucketElem, DataParallel,
    Part, Synced,
};
use crate::error::{Error, Result};

/// A stage's forward function: its input (the model's input, or the previous stage's output)
/// to its output.
pub type StageFn<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// One stage of a model for [`DataParallel::backward_overlapped`]: its forward function and
/// the parameters it uses, as a range of indices into [`DataParallel::vars`]. Stages declare
/// disjoint ranges; a parameter no stage declares gets no gradient (zeros).
pub struct Stage<'a> {
    /// Indices (into [`DataParallel::vars`]) of the parameters this stage uses, and no other
    /// stage does.
    pub vars: Range<usize>,
    /// The stage's forward function.
    pub forward: &'a StageFn<'a>,
}

impl std::fmt::Debug for Stage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage").field("vars", &self.vars).finish_non_exhaustive()
    }
}

const OP: &str = "DataParallel::backward_overlapped";

/// The backward pass in progress: stages `0..next` are still to run, from the last down.
/// `sync` uses one with nothing left to run ([`Backward::settled`]).
pub(super) struct Backward<'s> {
    stages: &'s [Stage<'s>],
    vars: &'s [Var],
    rank: usize,
    /// Each stage's input as a variable (`None` for the first stage: the model's input).
    ins: Vec<Option<Var>>,
    outs: Vec<Tensor>,
    loss: Option<Tensor>,
    next: usize,
    /// The gradient of stage `next`'s input; `None` once no gradient flows further back.
    seed: Option<Tensor>,
    /// This micro-batch's weight (its samples) and the gradients accumulated before it.
    w: f64,
    acc: Vec<Option<(Tensor, f64)>>,
    /// Final gradients with their factors, filled as stages finish.
    grads: Vec<Option<(Tensor, f64)>>,
    /// The gradient store of the last stage's backward (the one [`Synced`] returns).
    store: Option<candle_core::backprop::GradStore>,
    /// Every rank weighs every gradient alike (one micro-batch each, the same samples): large
    /// gradients are then reduced in place, scaled by the ring, not packed.
    direct: bool,
    /// With `direct`: the factor every rank gives every gradient.
    factor: f64,
    /// Per parameter: its result is candle's own gradient tensor, reduced in place.
    in_tensor: Vec<bool>,
    /// Where each final gradient's storage lies (contiguous CPU gradients only), and the kept
    /// store's entries: taken when they are made, since a gradient lent to an in-place
    /// allreduce stays locked for writing while the backward pass goes on.
    spans: Vec<Option<(usize, usize)>>,
    store_spans: Vec<(TensorId, (usize, usize))>,
}

/// Where the CPU storage of each entry of `store` lies, by the entry's tensor.
fn entries(store: &candle_core::backprop::GradStore) -> Vec<(TensorId, (usize, usize))> {
    store
        .get_ids()
        .filter_map(|o| store.get_id(*o))
        .filter_map(|t| cpu_span(t).map(|s| (t.id(), s)))
        .collect()
}

impl<'s> Backward<'s> {
    /// A backward pass with nothing left to run, over gradients already accumulated (with
    /// their factors) and the store they came in: what [`DataParallel::sync`] exchanges.
    pub(super) fn settled(
        vars: &'s [Var],
        rank: usize,
        acc: Vec<Option<(Tensor, f64)>>,
        store: candle_core::backprop::GradStore,
        direct: bool,
        factor: f64,
    ) -> Backward<'s> {
        let spans = acc
            .iter()
            .map(|g| g.as_ref().and_then(|(g, _)| cpu_span(g).filter(|_| g.is_contiguous())))
            .collect();
        Backward {
            stages: &[],
            vars,
            rank,
            ins: Vec::new(),
            outs: Vec::new(),
            loss: None,
            next: 0,
            seed: None,
            w: 0.0,
            grads: vec![None; acc.len()],
            in_tensor: vec![false; acc.len()],
            acc,
            direct,
            factor,
            spans,
            store_spans: entries(&store),
            store: Some(store),
        }
    }

    /// Run the backward pass of every stage from `next - 1` down to `upto`.
    fn run_to(&mut self, upto: usize) -> Result<()> {
        while self.next > upto {
            let k = self.next - 1;
            self.next = k;
            let store = if k + 1 == self.stages.len() {
                match &self.loss {
                    Some(l) => l.backward()?,
                    None => return self.stop(),
                }
            } else {
                match &self.seed {
                    Some(seed) => (&self.outs[k] * seed)?.sum_all()?.backward()?,
                    None => return self.stop(),
                }
            };
            let range = self.stages[k].vars.clone();
            for (i, v) in self.vars.iter().enumerate() {
                let Some(g) = store.get(v.as_tensor()) else { continue };
                if !range.contains(&i) {
                    return Err(Error::Shape {
                        rank: self.rank,
                        layer: OP,
                        detail: format!(
                            "stage {k} (parameters {range:?}) gave a gradient to parameter {i}: \
                             declare every parameter in the one stage that uses it (a \
                             parameter shared between stages needs `backward` and `sync`)"
                        ),
                    });
                }
                let prev = self.acc[i].take();
                let (g, f) = match prev {
                    Some((a, fa)) => ((a.affine(fa, 0.0)? + g.affine(self.w, 0.0)?)?, 1.0),
                    None => (g.clone(), self.w),
                };
                self.spans[i] = cpu_span(&g).filter(|_| g.is_contiguous());
                self.grads[i] = Some((g, f));
            }
            // Detached: the gradient carries the graph it was computed by (the next stage's
            // weights among it), which the earlier stage's backward pass must not enter.
            self.seed = match &self.ins[k] {
                Some(x) => store.get(x.as_tensor()).map(Tensor::detach),
                None => None,
            };
            if self.store.is_none() {
                self.store_spans = entries(&store);
                self.store = Some(store);
            }
        }
        Ok(())
    }

    /// No gradient reaches the remaining stages: their parameters keep what was accumulated.
    fn stop(&mut self) -> Result<()> {
        self.next = 0;
        self.seed = None;
        Ok(())
    }

    /// Whether parameter `i`'s gradient `g` is contiguous in CPU memory and alone in its
    /// storage: no other gradient of this step and no other entry of the kept gradient store
    /// lies in it, so it can be reduced where it is. (Gradients of the stages still to run
    /// will be new allocations.)
    fn alone(&self, i: usize, g: &Tensor) -> bool {
        let Some(span) = self.spans[i] else { return false };
        let apart = |(c, d): (usize, usize)| d <= span.0 || span.1 <= c;
        self.spans.iter().enumerate().all(|(j, s)| j == i || s.is_none_or(apart))
            && self.store_spans.iter().all(|&(id, s)| id == g.id() || apart(s))
    }

    /// The gradient of parameter `i` and its factor: this micro-batch's (with what was
    /// accumulated) once its stage ran, else what was accumulated before it.
    fn grad(&self, i: usize) -> Option<&(Tensor, f64)> {
        self.grads[i].as_ref().or(self.acc[i].as_ref())
    }
}

impl DataParallel {
    /// The last micro-batch of a step, forward and backward stage by stage, and the
    /// [`DataParallel::sync`] of the step, overlapped: each bucket's allreduce starts as soon
    /// as the stages holding its parameters have run their backward pass, and runs on the
    /// communicator's worker thread while the earlier stages run theirs. The result is that of
    /// `backward(&loss(model(input)), samples)` followed by `sync()`: micro-batches accumulated
    /// before with [`DataParallel::backward`] are included, and the gradients come back as
    /// views of the buckets, with the global mean loss.
    ///
    /// `stages` run in order (stage 0 gets `input`); `loss` maps the last stage's output to the
    /// micro-batch's mean loss over its `samples` samples. A rank with no samples passes
    /// `samples == 0`: nothing runs forward or backward there, and it contributes zeros.
    ///
    /// # Collective contract
    /// Every rank calls it in the same step (in place of that step's `sync`), with stages that
    /// declare the same parameter ranges.
    ///
    /// # Errors
    /// [`Error::Shape`] when the stages' ranges overlap or leave the parameter list, or a stage
    /// gives a gradient to a parameter it did not declare, or when no rank had any sample;
    /// collective errors (a dead or diverging rank is named); candle errors of the passes.
    pub fn backward_overlapped(
        &mut self,
        stages: &[Stage<'_>],
        input: &Tensor,
        loss: &dyn Fn(&Tensor) -> Result<Tensor>,
        samples: usize,
    ) -> Result<Synced> {
        let rank = self.comm.rank();
        let bad = |detail: String| Error::Shape { rank, layer: OP, detail };
        let nv = self.vars.len();
        // Where each parameter's gradient becomes final: after the backward of its stage
        // (stages.len() for a parameter no stage uses: at once).
        let mut stage_of = vec![stages.len(); nv];
        for (k, s) in stages.iter().enumerate() {
            if s.vars.end > nv {
                return Err(bad(format!("stage {k} declares {:?} of {nv} parameters", s.vars)));
            }
            for i in s.vars.clone() {
                if stage_of[i] != stages.len() {
                    return Err(bad(format!(
                        "parameter {i} is declared by stages {} and {k}",
                        stage_of[i]
                    )));
                }
                stage_of[i] = k;
            }
        }
        // Forward, stage by stage, each on a detached copy of the previous output.
        let (mut ins, mut outs, mut loss_t) = (Vec::new(), Vec::new(), None);
        let mut value = 0.0;
        if samples > 0 {
            let mut x = input.clone();
            for (k, s) in stages.iter().enumerate() {
                let xin = if k == 0 { None } else { Some(Var::from_tensor(&x.detach())?) };
                let y = (s.forward)(xin.as_ref().map_or(&x, |v| v.as_tensor()))?;
                ins.push(xin);
                outs.push(y.clone());
                x = y;
            }
            let l = loss(&x)?;
            value = l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            loss_t = Some(l);
        }
        // Taken only now: a forward pass that failed leaves the accumulated gradients in place.
        let (acc_grads, acc_samples, acc_loss, acc_store) = match self.acc.take() {
            Some(a) => (a.grads, a.samples, a.loss_sum, Some(a.store)),
            None => (vec![None; nv], 0, 0.0, None),
        };
        let w = samples as f64;
        // Direct (large gradients reduced where they are, scaled by the ring) when every rank
        // gives every gradient the same factor, as `sync` decides: one micro-batch of the same
        // samples each (factor: the samples), or several with every gradient accumulated
        // (factor 1 once this micro-batch's is added). A gradient that ends with another
        // factor (none this time) is scaled to the agreed one in its place in the bucket.
        let f = match (&acc_store, samples) {
            (_, 0) => f64::NAN,
            (None, _) => w,
            (Some(_), _) if acc_grads.iter().all(Option::is_some) => 1.0,
            _ => f64::NAN,
        };
        let mut sv = [(acc_samples + samples as u64) as f64, acc_loss + value * w, f, f * f];
        self.comm.allreduce(&mut sv, ReduceOp::Sum)?;
        let n = sv[0];
        if n == 0.0 {
            return Err(bad("no rank had any sample this step".into()));
        }
        let direct = sv[2].is_finite() && sv[2] * sv[2] == self.comm.size() as f64 * sv[3];
        let mut bw = Backward {
            stages,
            vars: &self.vars,
            rank,
            next: if loss_t.is_some() { stages.len() } else { 0 },
            ins,
            outs,
            loss: loss_t,
            seed: None,
            w,
            acc: acc_grads,
            grads: vec![None; nv],
            direct,
            factor: sv[2] / self.comm.size() as f64,
            in_tensor: vec![false; nv],
            spans: vec![None; nv],
            store_spans: acc_store.as_ref().map(entries).unwrap_or_default(),
            store: acc_store,
        };
        let ready: Vec<usize> = self
            .buckets
            .iter()
            .map(|b| b.clone().map(|i| stage_of[i]).min().unwrap_or(stages.len()))
            .collect();
        overlap(&self.comm, &self.bufs, &self.buckets, &ready, &mut bw, n)?;
        self.results(bw, &sv)
    }

    /// What an exchange returns once `bw`'s buckets are reduced: every parameter's gradient, a
    /// view of its bucket or, for a large one reduced in place, candle's own tensor; `sv` the
    /// sums of the step's first allreduce (samples, weighted loss).
    pub(super) fn results(&self, mut bw: Backward<'_>, sv: &[f64]) -> Result<Synced> {
        let mut store = match bw.store.take() {
            Some(s) => s,
            None => Tensor::zeros((), DType::F32, &candle_core::Device::Cpu)?.backward()?,
        };
        self.insert_views(&mut store)?;
        let mut in_place = bw.direct;
        for (b, buf) in self.buckets.iter().zip(&self.bufs) {
            for (i, large) in b.clone().zip(&buf.large) {
                match bw.grad(i) {
                    Some((g, _)) if bw.in_tensor[i] => {
                        store.insert(self.vars[i].as_tensor(), g.clone());
                    }
                    _ => in_place &= !large,
                }
            }
        }
        Ok(self.synced(store, sv, bw.direct, in_place))
    }
}

/// Bucket by bucket: run the backward pass until the bucket's parameters are final, pack it,
/// lend it to a non-blocking allreduce, and go on (recursively) with the backward pass and the
/// later buckets while it is on the wire; each level waits for its bucket last. (`sync` runs it
/// with nothing left to run: packing each bucket while the previous one is on the wire.)
pub(super) fn overlap(
    comm: &Comm,
    bufs: &[Bucket],
    ranges: &[Range<usize>],
    ready: &[usize],
    bw: &mut Backward<'_>,
    n: f64,
) -> Result<()> {
    let (Some(b), Some(range), Some(&at)) = (bufs.first(), ranges.first(), ready.first()) else {
        return Ok(());
    };
    bw.run_to(at)?;
    let rest = (&bufs[1..], &ranges[1..], &ready[1..]);
    match b.flat.dtype() {
        DType::F32 => level::<f32>(comm, b, range, rest, bw, n),
        DType::F64 => level::<f64>(comm, b, range, rest, bw, n),
        DType::BF16 => level::<half::bf16>(comm, b, range, rest, bw, n),
        DType::F16 => level::<half::f16>(comm, b, range, rest, bw, n),
        d => Err(Error::Shape {
            rank: comm.rank(),
            layer: OP,
            detail: format!("parameters of dtype {d:?} cannot be averaged (use a float dtype)"),
        }),
    }
}

/// The later buckets: buffers, parameter ranges and the stage each is ready after.
type Rest<'r> = (&'r [Bucket], &'r [Range<usize>], &'r [usize]);

fn level<T: BucketElem>(
    comm: &Comm,
    b: &Bucket,
    range: &Range<usize>,
    rest: Rest<'_>,
    bw: &mut Backward<'_>,
    n: f64,
) -> Result<()> {
    with_storage_mut(&b.flat, |s, _| {
        let dst = T::slice_mut(s).ok_or_else(|| Error::Shape {
            rank: comm.rank(),
            layer: OP,
            detail: "a bucket changed dtype".into(),
        })?;
        if bw.direct {
            return direct::<T>(comm, b, range, dst, rest, bw, n);
        }
        {
            let parts: Vec<(Part<'_>, usize, usize)> = range
                .clone()
                .zip(&b.offs)
                .zip(&b.lens)
                .map(|((i, o), l)| (bw.grad(i).map(|(g, f)| (g, f / n)), *o, *l))
                .collect();
            pack::<T>(dst, &parts)?;
        }
        comm.scope(|sc| {
            let h = sc.iallreduce(dst, ReduceOp::Sum);
            let later = overlap(comm, rest.0, rest.1, rest.2, bw, n);
            h.wait()?;
            later
        })
    })
}

/// A bucket when every rank weighs every gradient alike: the small gradients packed (scaled)
/// and reduced together; each large one reduced on its own, in place, scaled by the ring —
/// in candle's own tensor when it is alone in its storage, else in its place in the bucket
/// (copied there unscaled, or zeros without a gradient), so every rank runs the same in-place
/// allreduces whichever buffer it lends.
fn direct<T: BucketElem>(
    comm: &Comm,
    b: &Bucket,
    range: &Range<usize>,
    dst: &mut [T],
    rest: Rest<'_>,
    bw: &mut Backward<'_>,
    n: f64,
) -> Result<()> {
    let (large, small) = dst.split_at_mut(b.small);
    let params: Vec<(usize, usize, usize, bool)> = range
        .clone()
        .zip(&b.offs)
        .zip(&b.lens)
        .zip(&b.large)
        .map(|(((i, o), l), big)| (i, *o, *l, *big))
        .collect();
    {
        let packed: Vec<(Part<'_>, usize, usize)> = params
            .iter()
            .filter(|p| !p.3)
            .map(|&(i, o, l, _)| (bw.grad(i).map(|(g, f)| (g, f / n)), o - b.small, l))
            .collect();
        pack::<T>(small, &packed)?;
    }
    // Each large parameter's buffer: candle's tensor (lent below) or its place in the bucket.
    let mut own: Vec<Tensor> = Vec::new();
    let mut regions: Vec<Option<&mut [T]>> = Vec::new();
    let mut left = large;
    for &(i, _, l, _) in params.iter().filter(|p| p.3) {
        let (region, r) = left.split_at_mut(l);
        left = r;
        match bw.grad(i).map(|(g, a)| (g.clone(), *a)) {
            Some((g, a)) if a == bw.factor && bw.alone(i, &g) => {
                bw.in_tensor[i] = true;
                own.push(g);
                regions.push(None);
            }
            g => {
                let part = g.as_ref().map(|(g, a)| (g, a / bw.factor));
                pack::<T>(region, &[(part, 0, l)])?;
                regions.push(Some(region));
            }
        }
    }
    let k = bw.factor / n;
    let lend: Vec<&Tensor> = own.iter().collect();
    with_all_mut::<T, _>(comm.rank(), &lend, Vec::new(), |grads| {
        comm.scope(|sc| {
            let mut grads = grads.into_iter();
            let mut hs = Vec::with_capacity(regions.len() + 1);
            for region in regions {
                let Some(buf) = region.or_else(|| grads.next()) else { continue };
                hs.push(sc.submit(move |c| c.allreduce_scaled(buf, k)));
            }
            if !small.is_empty() {
                hs.push(sc.iallreduce(small, ReduceOp::Sum));
            }
            let later = overlap(comm, rest.0, rest.1, rest.2, bw, n);
            wait_all(hs, later)
        })
    })
}
