//! Every strategy against a single-process run of the same model: data parallel (uneven global
//! batch, accumulation over micro-batches), Megatron column/row tensor parallel, vocab-parallel
//! embedding and cross-entropy; at worlds 1 to 4 over memory and over TCP. Plus the errors for
//! shapes that do not divide and for replicas that differ.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use common::{on_world, rand, rel_diff};
use tutti_parallel::{
    shard_range, vocab_parallel_cross_entropy, ColumnParallelLinear, Comm, DataParallel, DpConfig,
    Error, RowParallelLinear, VocabParallelEmbedding,
};
use tutti_runtime::testing::Kind;

const TOL: f32 = 2e-5;

struct Mlp {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

fn mlp(d_in: usize, hidden: usize, d_out: usize) -> Mlp {
    Mlp {
        w1: rand(&[hidden, d_in], 1),
        b1: rand(&[hidden], 2),
        w2: rand(&[d_out, hidden], 3),
        b2: rand(&[d_out], 4),
    }
}

fn forward(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Tensor {
    let h = x.matmul(&w1.t().unwrap()).unwrap().broadcast_add(b1).unwrap().gelu_erf().unwrap();
    h.matmul(&w2.t().unwrap()).unwrap().broadcast_add(b2).unwrap()
}

fn mse(a: &Tensor, b: &Tensor) -> Tensor {
    (a - b).unwrap().sqr().unwrap().mean_all().unwrap()
}

/// Single-process loss and gradients of the MLP on the full batch.
fn reference(m: &Mlp, x: &Tensor, y: &Tensor) -> (f32, Vec<Tensor>) {
    let vars: Vec<Var> =
        [&m.w1, &m.b1, &m.w2, &m.b2].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let out = forward(x, &vars[0], &vars[1], &vars[2], &vars[3]);
    let loss = mse(&out, y);
    let g = loss.backward().unwrap();
    let grads = vars.iter().map(|v| g.get(v.as_tensor()).unwrap().clone()).collect();
    (loss.to_scalar::<f32>().unwrap(), grads)
}

fn dp_case(kind: Kind, n: usize, micro: usize) {
    let (batch, d_in, hidden, d_out) = (10, 3, 6, 2);
    let m = mlp(d_in, hidden, d_out);
    let (x, y) = (rand(&[batch, d_in], 5), rand(&[batch, d_out], 6));
    let (ref_loss, ref_grads) = reference(&m, &x, &y);
    on_world(kind, n, |c: Comm| {
        // Rank 0's values win: the others start from garbage.
        let init = |t: &Tensor| {
            let t = if c.rank() == 0 { t.clone() } else { (t * 0.0).unwrap() };
            Var::from_tensor(&t).unwrap()
        };
        let vars = vec![init(&m.w1), init(&m.b1), init(&m.w2), init(&m.b2)];
        // Tiny buckets: every parameter its own bucket, several in flight.
        let cfg = DpConfig { first_bucket_bytes: 8, bucket_bytes: 16 };
        let mut dp = DataParallel::new(c.clone(), vars.clone(), cfg).unwrap();
        dp.check_replicas().unwrap();
        let mine = shard_range(batch, c.rank(), c.size());
        for k in 0..micro {
            let r = shard_range(mine.len(), k, micro);
            if r.is_empty() {
                continue;
            }
            let rows = mine.start + r.start..mine.start + r.end;
            let xb = x.narrow(0, rows.start, rows.len()).unwrap();
            let yb = y.narrow(0, rows.start, rows.len()).unwrap();
            let out = forward(&xb, &vars[0], &vars[1], &vars[2], &vars[3]);
            dp.backward(&mse(&out, &yb), rows.len()).unwrap();
        }
        let s = dp.sync().unwrap();
        assert_eq!(s.samples, batch as u64);
        assert!((s.loss as f32 - ref_loss).abs() <= 1e-6, "loss {} vs {ref_loss}", s.loss);
        for (v, want) in vars.iter().zip(&ref_grads) {
            let got = s.grads.get(v.as_tensor()).unwrap();
            assert!(
                rel_diff(got, want) <= TOL,
                "n={n} micro={micro}: grad {}",
                rel_diff(got, want)
            );
        }
        // One SGD step keeps the replicas identical.
        SGD::new(vars.clone(), 0.1).unwrap().step(&s.grads).unwrap();
        dp.check_replicas().unwrap();
    });
}

#[test]
fn data_parallel_uneven_and_accumulated_mem() {
    for n in 1..=4 {
        for micro in [1, 2, 3] {
            dp_case(Kind::Mem, n, micro);
        }
    }
    // More ranks than samples: some ranks have none and still take part.
    dp_case(Kind::Mem, 12, 1);
}

#[test]
fn data_parallel_tcp() {
    dp_case(Kind::Tcp, 3, 2);
}

fn tp_case(kind: Kind, n: usize, gather_between: bool) {
    let (batch, d_in, hidden, d_out) = (5, 4, 12, 3);
    let m = mlp(d_in, hidden, d_out);
    let (x, y) = (rand(&[batch, d_in], 7), rand(&[batch, d_out], 8));
    let (ref_loss, ref_grads) = reference(&m, &x, &y);
    on_world(kind, n, |c: Comm| {
        let fc1 = ColumnParallelLinear::from_full(&m.w1, Some(&m.b1), gather_between, &c).unwrap();
        let fc2 = RowParallelLinear::from_full(&m.w2, Some(&m.b2), !gather_between, &c).unwrap();
        // 1/N of each split weight lives here.
        assert_eq!(fc1.weight().elem_count() * n, m.w1.elem_count());
        assert_eq!(fc2.weight().elem_count() * n, m.w2.elem_count());
        let x = Var::from_tensor(&x).unwrap();
        let out = fc2.forward(&fc1.forward(x.as_tensor()).unwrap().gelu_erf().unwrap()).unwrap();
        let loss = mse(&out, &y);
        assert!((loss.to_scalar::<f32>().unwrap() - ref_loss).abs() <= 1e-6);
        let g = loss.backward().unwrap();
        let h = shard_range(hidden, c.rank(), n);
        let cut = |t: &Tensor, dim| t.narrow(dim, h.start, h.len()).unwrap();
        let pairs = [
            (fc1.weight().as_tensor(), cut(&ref_grads[0], 0)),
            (fc1.bias().unwrap().as_tensor(), cut(&ref_grads[1], 0)),
            (fc2.weight().as_tensor(), cut(&ref_grads[2], 1)),
            (fc2.bias().unwrap().as_tensor(), ref_grads[3].clone()),
        ];
        for (i, (p, want)) in pairs.iter().enumerate() {
            let got = g.get(p).unwrap();
            assert!(rel_diff(got, want) <= TOL, "n={n} param {i}: {}", rel_diff(got, want));
        }
        // The input's gradient (through f's allreduce) is the full one on every rank.
        let xr = Var::from_tensor(x.as_tensor()).unwrap();
        let want_gx = {
            let out = forward(xr.as_tensor(), &m.w1, &m.b1, &m.w2, &m.b2);
            mse(&out, &y).backward().unwrap().get(xr.as_tensor()).unwrap().clone()
        };
        let gx = g.get(x.as_tensor()).unwrap();
        assert!(rel_diff(gx, &want_gx) <= TOL, "grad x {}", rel_diff(gx, &want_gx));
    });
}

#[test]
fn tensor_parallel_mlp_mem() {
    for n in [1, 2, 3, 4] {
        tp_case(Kind::Mem, n, false);
        tp_case(Kind::Mem, n, true);
    }
}

#[test]
fn tensor_parallel_mlp_tcp() {
    tp_case(Kind::Tcp, 2, false);
    tp_case(Kind::Tcp, 4, true);
}

/// Single-process cross-entropy with ignore_index, from log-softmax.
fn ref_ce(logits: &Tensor, targets: &[i64], ignore: i64) -> Tensor {
    let ls = candle_nn::ops::log_softmax(logits, 1).unwrap();
    let v = logits.dim(1).unwrap();
    let mut onehot = vec![0f32; targets.len() * v];
    let mut count = 0.0;
    for (i, &t) in targets.iter().enumerate() {
        if t != ignore {
            onehot[i * v + t as usize] = 1.0;
            count += 1.0;
        }
    }
    let oh = Tensor::from_vec(onehot, (targets.len(), v), &Device::Cpu).unwrap();
    ((ls * oh).unwrap().sum_all().unwrap() / -count).unwrap()
}

fn vocab_case(kind: Kind, n: usize) {
    let (vocab, d, tokens) = (11, 4, 7);
    let (emb, head) = (rand(&[vocab, d], 9), rand(&[vocab, d], 10));
    let ids: Vec<i64> = vec![3, 0, 10, 5, 5, 1, 7];
    let targets: Vec<i64> = vec![0, 10, 5, 5, 1, 7, 2];
    let ids_t = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let tg_t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    // Reference.
    let (ev, hv) = (Var::from_tensor(&emb).unwrap(), Var::from_tensor(&head).unwrap());
    let e = ev.as_tensor().index_select(&ids_t, 0).unwrap();
    let logits = e.matmul(&hv.as_tensor().t().unwrap()).unwrap();
    let ref_loss = ref_ce(&logits, &targets, 0);
    let rg = ref_loss.backward().unwrap();
    let (ref_ge, ref_gh) = (rg.get(ev.as_tensor()).unwrap(), rg.get(hv.as_tensor()).unwrap());
    let ref_loss = ref_loss.to_scalar::<f32>().unwrap();
    on_world(kind, n, |c: Comm| {
        let layer = VocabParallelEmbedding::from_full(&emb, &c).unwrap();
        let r = layer.range();
        assert_eq!(r, shard_range(vocab, c.rank(), n));
        let head_r = Var::from_tensor(&head.narrow(0, r.start, r.len()).unwrap()).unwrap();
        let e = layer.forward(&ids_t).unwrap();
        assert_eq!(e.dims(), &[tokens, d]);
        // The head is vocab-parallel too: `f` before it sums the ranks' gradients of `e`.
        let e = tutti_parallel::copy_to_parallel_region(&e, &c).unwrap();
        let local = e.matmul(&head_r.as_tensor().t().unwrap()).unwrap();
        let loss = vocab_parallel_cross_entropy(&local, &tg_t, r.clone(), Some(0), &c).unwrap();
        let got = loss.to_scalar::<f32>().unwrap();
        assert!((got - ref_loss).abs() <= 1e-6, "n={n}: loss {got} vs {ref_loss}");
        let g = loss.backward().unwrap();
        let ge = g.get(layer.weight().as_tensor()).unwrap();
        let gh = g.get(head_r.as_tensor()).unwrap();
        let want_ge = ref_ge.narrow(0, r.start, r.len()).unwrap();
        let want_gh = ref_gh.narrow(0, r.start, r.len()).unwrap();
        // Relative to the whole reference gradient's scale.
        let scale = |t: &Tensor| {
            t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
        };
        let d = |a: &Tensor, b: &Tensor| common::max_diff(a, b);
        assert!(d(ge, &want_ge) <= TOL * scale(ref_ge), "n={n} grad embed");
        assert!(d(gh, &want_gh) <= TOL * scale(ref_gh), "n={n} grad head");
    });
}

#[test]
fn vocab_parallel_embedding_and_loss_mem() {
    for n in 1..=4 {
        vocab_case(Kind::Mem, n);
    }
}

#[test]
fn vocab_parallel_embedding_and_loss_tcp() {
    vocab_case(Kind::Tcp, 3);
}

#[test]
fn shapes_that_do_not_divide_are_refused() {
    let errs = on_world(Kind::Mem, 3, |c: Comm| {
        let w = rand(&[8, 4], 1);
        let a = ColumnParallelLinear::from_full(&w, None, false, &c).unwrap_err();
        let b = RowParallelLinear::from_full(&w, None, true, &c).unwrap_err();
        (a.to_string(), b.to_string(), matches!(a, Error::Shape { .. }))
    });
    for (r, (a, b, typed)) in errs.into_iter().enumerate() {
        assert!(typed);
        assert!(a.starts_with(&format!("rank {r}: ColumnParallelLinear")), "{a}");
        assert!(a.contains("dim 0 of a [8, 4] tensor over 3 ranks"), "{a}");
        assert!(b.contains("RowParallelLinear") && b.contains("dim 1"), "{b}");
    }
}

#[test]
fn replicas_that_differ_are_named() {
    // Different values: caught by check_replicas (after new() broadcast them, so perturb after).
    let out = on_world(Kind::Mem, 3, |c: Comm| {
        let v = Var::from_tensor(&rand(&[4, 4], 1)).unwrap();
        let w = Var::from_tensor(&rand(&[3], 2)).unwrap();
        let dp = DataParallel::new(c.clone(), vec![v, w.clone()], DpConfig::default()).unwrap();
        dp.check_replicas().unwrap();
        if c.rank() == 2 {
            w.set(&(w.as_tensor() + 1.0).unwrap()).unwrap();
        }
        dp.check_replicas().unwrap_err().to_string()
    });
    for e in &out {
        assert!(
            e.contains("parameter \"#1 [3] F32\" differs across ranks: the values differ"),
            "{e}"
        );
    }
    // Different shapes: caught when wrapping.
    let out = on_world(Kind::Mem, 2, |c: Comm| {
        let n = 3 + c.rank();
        let v = Var::from_tensor(&rand(&[n], 1)).unwrap();
        DataParallel::new(c, vec![v], DpConfig::default()).unwrap_err().to_string()
    });
    for e in &out {
        assert!(e.contains("the shape or dtype differs"), "{e}");
    }
    let _ = DType::F32;
}

/// Large gradients (reduced straight from candle's tensors when every rank has one factor),
/// small ones (packed), a parameter without a gradient on some steps (zeros, over the previous
/// step's values in the reused bucket), uneven weights (everything packed): every step's
/// average against the same sums in f64, over several steps of the reused buckets.
/// Which steps a parameter appears in the loss; the samples of a rank on a step.
type OnStep = fn(usize) -> bool;
type Samples = fn(usize) -> usize;

fn dp_reuse_case(kind: Kind, n: usize) {
    // (elements, appears in the loss on step s)
    let params: [(usize, OnStep); 5] = [
        (70_000, |_| true),
        (300, |_| true),
        (90_001, |s| s != 2),
        (5, |_| true),
        (66_000, |_| true),
    ];
    on_world(kind, n, |c: Comm| {
        let r = c.rank();
        let vars: Vec<Var> = params
            .iter()
            .map(|(len, _)| Var::zeros(*len, DType::F32, &Device::Cpu).unwrap())
            .collect();
        // Buckets of ~600 KB: the large gradients share buckets with small ones.
        let cfg = DpConfig { first_bucket_bytes: 300_000, bucket_bytes: 600_000 };
        let mut dp = DataParallel::new(c.clone(), vars.clone(), cfg).unwrap();
        // Gradient of parameter j at step s on rank r: the constant (r + 1)·(j + 1) + s.
        let grad = |r: usize, j: usize, s: usize| ((r + 1) * (j + 1) + s) as f64;
        let steps: [(Samples, bool); 4] =
            [(|_| 2, true), (|r| r + 1, n == 1), (|_| 2, false), (|_| 3, true)];
        for (s, (samples, want_direct)) in steps.into_iter().enumerate() {
            let mut loss: Option<Tensor> = None;
            for (j, (v, (_, on))) in vars.iter().zip(&params).enumerate() {
                if on(s) {
                    let t = (v.as_tensor().sum_all().unwrap() * grad(r, j, s)).unwrap();
                    loss = Some(match loss {
                        Some(l) => (l + t).unwrap(),
                        None => t,
                    });
                }
            }
            dp.backward(&loss.unwrap(), samples(r)).unwrap();
            let out = dp.sync().unwrap();
            assert_eq!(out.direct, want_direct, "step {s} n={n}");
            // Candle's gradients own their storage: direct means in place.
            assert_eq!(out.in_place, want_direct, "step {s} n={n}");
            let total: usize = (0..n).map(samples).sum();
            assert_eq!(out.samples, total as u64);
            for (j, (v, (len, on))) in vars.iter().zip(&params).enumerate() {
                let g = out.grads.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(g.len(), *len);
                let want = if on(s) {
                    (0..n).map(|q| samples(q) as f64 * grad(q, j, s)).sum::<f64>() / total as f64
                } else {
                    0.0
                };
                assert!(
                    g.iter().all(|x| (f64::from(*x) - want).abs() <= 1e-6 * want.abs()),
                    "step {s} n={n} param {j}: {} vs {want}",
                    g[0]
                );
            }
            SGD::new(vars.clone(), 0.01).unwrap().step(&out.grads).unwrap();
            dp.check_replicas().unwrap();
        }
    });
}

#[test]
fn data_parallel_reused_buckets_direct_and_packed() {
    for n in [1, 2, 3, 4] {
        dp_reuse_case(Kind::Mem, n);
    }
    dp_reuse_case(Kind::Tcp, 3);
}
