//! `DataParallel::backward_overlapped` (the last micro-batch's backward stage by stage, each
//! bucket reduced while the earlier stages run theirs) against `backward` + `sync` of the same
//! micro-batches, bit for bit, and against a single-process run of the whole batch; and its
//! errors for stages that do not declare their parameters.

mod common;

use candle_core::{Tensor, Var};
use common::{assert_exact, on_world, rand, rel_diff};
use tutti_parallel::{shard_range, Comm, DataParallel, DpConfig, Error, Result, Stage};
use tutti_runtime::testing::Kind;

fn mse(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok((a - b)?.sqr()?.mean_all()?)
}

/// Layer 1 with GELU (parameters 0, 1), a stage without parameters (tanh), layer 2 (2, 3).
fn stage0(v: &[Var]) -> impl Fn(&Tensor) -> Result<Tensor> + '_ {
    move |x| Ok(x.matmul(&v[0].as_tensor().t()?)?.broadcast_add(v[1].as_tensor())?.gelu_erf()?)
}
fn stage1(x: &Tensor) -> Result<Tensor> {
    Ok(x.tanh()?)
}
fn stage2(v: &[Var]) -> impl Fn(&Tensor) -> Result<Tensor> + '_ {
    move |x| Ok(x.matmul(&v[2].as_tensor().t()?)?.broadcast_add(v[3].as_tensor())?)
}

fn model(v: &[Var], x: &Tensor) -> Result<Tensor> {
    stage2(v)(&stage1(&stage0(v)(x)?)?)
}

/// (batch, inputs, hidden, outputs): 11 samples split unevenly, or even shards with both
/// weights of 300 × 256 (300 KB of gradient each: reduced on their own, in place, the first
/// while the other is still lent to its allreduce).
type Dims = (usize, usize, usize, usize);
const DIMS: Dims = (11, 3, 7, 2);
const LARGE: Dims = (12, 256, 300, 256);

fn weights(dims: Dims) -> Vec<Tensor> {
    let (_, d_in, hidden, d_out) = dims;
    vec![rand(&[hidden, d_in], 1), rand(&[hidden], 2), rand(&[d_out, hidden], 3), rand(&[d_out], 4)]
}

/// The whole batch in one process: loss and gradients.
fn reference(dims: Dims, x: &Tensor, y: &Tensor) -> (f64, Vec<Tensor>) {
    let vars: Vec<Var> = weights(dims).iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let loss = mse(&model(&vars, x).unwrap(), y).unwrap();
    let g = loss.backward().unwrap();
    let grads = vars.iter().map(|v| g.get(v.as_tensor()).unwrap().clone()).collect();
    (f64::from(loss.to_scalar::<f32>().unwrap()), grads)
}

fn case(kind: Kind, n: usize, micro: usize, dims: Dims) {
    let (batch, d_in, _, d_out) = dims;
    let (x, y) = (rand(&[batch, d_in], 5), rand(&[batch, d_out], 6));
    let (ref_loss, ref_grads) = reference(dims, &x, &y);
    on_world(kind, n, |c: Comm| {
        let vars: Vec<Var> = weights(dims).iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        // Tiny buckets: several in flight during the backward pass.
        let cfg = DpConfig { first_bucket_bytes: 8, bucket_bytes: 40 };
        let mut plain = DataParallel::new(c.clone(), vars.clone(), cfg).unwrap();
        // The overlapped path on two lanes when the weights are large: buckets in flight at once.
        let oc = if dims == LARGE { c.with_lanes(2).unwrap() } else { c.clone() };
        let mut over = DataParallel::new(oc, vars.clone(), cfg).unwrap();
        let mine = shard_range(batch, c.rank(), c.size());
        let parts: Vec<_> = (0..micro)
            .map(|k| shard_range(mine.len(), k, micro))
            .filter(|r| !r.is_empty())
            .map(|r| mine.start + r.start..mine.start + r.end)
            .collect();
        let rows = |r: &std::ops::Range<usize>| {
            (x.narrow(0, r.start, r.len()).unwrap(), y.narrow(0, r.start, r.len()).unwrap())
        };
        for r in &parts {
            let (xb, yb) = rows(r);
            plain.backward(&mse(&model(&vars, &xb).unwrap(), &yb).unwrap(), r.len()).unwrap();
        }
        let want = plain.sync().unwrap();
        let (s0, s2) = (stage0(&vars), stage2(&vars));
        let stages = [
            Stage { vars: 0..2, forward: &s0 },
            Stage { vars: 2..2, forward: &stage1 },
            Stage { vars: 2..4, forward: &s2 },
        ];
        let got = match parts.split_last() {
            Some((last, first)) => {
                for r in first {
                    let (xb, yb) = rows(r);
                    over.backward(&mse(&model(&vars, &xb).unwrap(), &yb).unwrap(), r.len())
                        .unwrap();
                }
                let (xb, yb) = rows(last);
                let loss = |out: &Tensor| mse(out, &yb);
                over.backward_overlapped(&stages, &xb, &loss, last.len()).unwrap()
            }
            // No samples on this rank: it contributes zeros.
            None => over.backward_overlapped(&stages, &x, &|o: &Tensor| mse(o, &y), 0).unwrap(),
        };
        assert_eq!((got.samples, got.loss), (want.samples, want.loss), "n={n} micro={micro}");
        // Every rank weighing every gradient alike — even shards of one micro-batch, or every
        // micro-batch of every rank non-empty — both reduce the large gradients in place.
        let even = batch % n == 0 && (micro == 1 || parts.len() == micro);
        let what = format!("n={n} micro={micro}");
        assert_eq!((got.direct, got.in_place), (want.direct, want.in_place), "{what}");
        if dims == LARGE {
            assert_eq!((got.direct, got.in_place), (even, even), "{what}");
        }
        assert!(
            (got.loss - ref_loss).abs() <= 1e-6 * ref_loss.abs(),
            "loss {} vs {ref_loss}",
            got.loss
        );
        for (i, (v, r)) in vars.iter().zip(&ref_grads).enumerate() {
            let g = got.grads.get(v.as_tensor()).unwrap();
            let what = format!("n={n} micro={micro} parameter {i}");
            assert_exact(g, want.grads.get(v.as_tensor()).unwrap(), &what);
            assert!(rel_diff(g, r) <= 2e-5, "{what}: {}", rel_diff(g, r));
        }
    });
}

#[test]
fn overlapped_backward_matches_backward_and_sync_mem() {
    for n in 1..=4 {
        for micro in [1, 2, 3] {
            case(Kind::Mem, n, micro, DIMS);
        }
        for micro in [1, 2] {
            case(Kind::Mem, n, micro, LARGE);
        }
    }
    // More ranks than samples: ranks without any call it with none.
    case(Kind::Mem, 13, 1, DIMS);
}

#[test]
fn overlapped_backward_matches_backward_and_sync_tcp() {
    case(Kind::Tcp, 3, 2, DIMS);
    case(Kind::Tcp, 3, 1, LARGE);
}

#[test]
fn stages_must_declare_their_parameters() {
    let errs = on_world(Kind::Mem, 2, |c: Comm| {
        let vars: Vec<Var> = weights(DIMS).iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let mut dp = DataParallel::new(c, vars.clone(), DpConfig::default()).unwrap();
        let (x, y) = (rand(&[4, DIMS.1], 7), rand(&[4, DIMS.3], 8));
        let loss = |o: &Tensor| mse(o, &y);
        let (s0, s2) = (stage0(&vars), stage2(&vars));
        let overlapping = [Stage { vars: 0..3, forward: &s0 }, Stage { vars: 2..4, forward: &s2 }];
        let a = dp.backward_overlapped(&overlapping, &x, &loss, 4).unwrap_err();
        let outside = [Stage { vars: 0..2, forward: &s0 }, Stage { vars: 2..5, forward: &s2 }];
        let b = dp.backward_overlapped(&outside, &x, &loss, 4).unwrap_err();
        // Stage 2's parameters declared by nobody: its gradient lands outside every stage.
        let undeclared = [Stage { vars: 0..2, forward: &s0 }, Stage { vars: 2..2, forward: &s2 }];
        let c = dp.backward_overlapped(&undeclared, &x, &loss, 4).unwrap_err();
        // The group is still in step: a correct call goes through.
        let ok = [Stage { vars: 0..2, forward: &s0 }, Stage { vars: 2..4, forward: &s2 }];
        dp.backward_overlapped(&ok, &x, &loss, 4).unwrap();
        [a, b, c].map(|e| match e {
            Error::Shape { detail, .. } => detail,
            e => panic!("not a shape error: {e}"),
        })
    });
    for [a, b, c] in errs {
        assert!(a.contains("parameter 2 is declared by stages 0 and 1"), "{a}");
        assert!(b.contains("declares 2..5 of 4 parameters"), "{b}");
        assert!(c.contains("stage 1 (parameters 2..2) gave a gradient to parameter 2"), "{c}");
    }
}
