//! Part 2 against single-process oracles at shapes other than the golden cases: the transformer
//! block in Megatron TP, TP+SP and Ulysses; the tiny LM (vocab-parallel, with and without SP)
//! over several SGD steps; pipeline parallel with both schedules. Worlds 1, 2, 3, 4 (and 6
//! where the shapes divide) in memory, one non-power-of-two world over TCP.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use common::{on_world, rand};
use tutti_parallel::{
    sequence_shard, sum_replicated_grads, Block, BlockConfig, BlockMode, Comm, LmConfig, LmMode,
    Pipeline, Schedule, TinyLm,
};
use tutti_runtime::testing::Kind;

const D: usize = 24;
const HEADS: usize = 12;
const FF: usize = 48;
const B: usize = 2;
const S: usize = 12;

fn block_weights(prefix: &str, seed: u64) -> HashMap<String, Tensor> {
    tutti_parallel::data::block_weights(prefix, D, FF, 0.3, seed).unwrap()
}

/// Max |a - b| relative to max |b| (+ a small absolute floor).
fn close(a: &Tensor, b: &Tensor, what: &str) {
    let a = a.to_dtype(DType::F32).unwrap();
    let m = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let d = common::max_diff(&a, b);
    assert!(d <= 1e-4 * m + 1e-6, "{what}: max diff {d} (scale {m})");
}

struct Oracle {
    y: Tensor,
    gx: Tensor,
    grads: HashMap<String, Tensor>,
}

fn oracle(w: &HashMap<String, Tensor>, cfg: BlockConfig, x: &Tensor, g: &Tensor) -> Oracle {
    let solo = Comm::mem_world(1).remove(0);
    let blk = Block::from_weights(w, "", cfg, BlockMode::Reference, &solo).unwrap();
    let xv = Var::from_tensor(x).unwrap();
    let y = blk.forward(xv.as_tensor()).unwrap();
    let gs = (&y * g).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = blk
        .params()
        .iter()
        .map(|p| (p.name.clone(), gs.get(p.var.as_tensor()).unwrap().clone()))
        .collect();
    Oracle { gx: gs.get(xv.as_tensor()).unwrap().clone(), y, grads }
}

fn block_case(kind: Kind, n: usize, mode: BlockMode, causal: bool) {
    let w = block_weights("", 100);
    let cfg = BlockConfig { n_heads: HEADS, causal, eps: 1e-5 };
    let (x, g) = (rand(&[B, S, D], 1), rand(&[B, S, D], 2));
    let want = oracle(&w, cfg, &x, &g);
    on_world(kind, n, |c: Comm| {
        let blk = Block::from_weights(&w, "", cfg, mode, &c).unwrap();
        let seq = mode != BlockMode::Tp;
        let local = |t: &Tensor| if seq { sequence_shard(t, &c).unwrap() } else { t.clone() };
        let xv = Var::from_tensor(&local(&x)).unwrap();
        let y = blk.forward(xv.as_tensor()).unwrap();
        close(&y, &local(&want.y), "y");
        let mut gs = (&y * local(&g)).unwrap().sum_all().unwrap().backward().unwrap();
        sum_replicated_grads(blk.params(), &mut gs, &c).unwrap();
        close(gs.get(xv.as_tensor()).unwrap(), &local(&want.gx), "grad x");
        for p in blk.params() {
            let full = &want.grads[&p.name];
            let got = gs.get(p.var.as_tensor()).unwrap();
            close(got, &p.part_of(full, &c).unwrap(), &format!("{mode:?} n={n} grad {}", p.name));
        }
    });
}

#[test]
fn block_modes_match_the_reference_mem() {
    for mode in [BlockMode::Tp, BlockMode::TpSp, BlockMode::Ulysses] {
        for n in [1, 2, 3, 4, 6] {
            block_case(Kind::Mem, n, mode, false);
        }
        block_case(Kind::Mem, 3, mode, true);
        block_case(Kind::Mem, 4, mode, true);
    }
}

#[test]
fn block_modes_match_the_reference_tcp() {
    for mode in [BlockMode::Tp, BlockMode::TpSp, BlockMode::Ulysses] {
        block_case(Kind::Tcp, 3, mode, true);
    }
}

#[test]
fn ulysses_refuses_indivisible_heads_and_sequences() {
    let w = block_weights("", 100);
    let errs = on_world(Kind::Mem, 5, |c: Comm| {
        let cfg = BlockConfig { n_heads: HEADS, causal: false, eps: 1e-5 };
        let e = Block::from_weights(&w, "", cfg, BlockMode::Ulysses, &c).unwrap_err().to_string();
        let s = sequence_shard(&rand(&[B, S, D], 1), &c).unwrap_err().to_string();
        (e, s)
    });
    for (e, s) in errs {
        assert!(
            e.contains("Ulysses block: 12 attention heads do not divide by the world size 5"),
            "{e}"
        );
        assert!(
            s.contains("sequence parallel: the sequence length") && s.contains("over 5 ranks"),
            "{s}"
        );
    }
}

fn lm_weights(vocab: usize) -> HashMap<String, Tensor> {
    let mut m = block_weights("block.", 200);
    m.insert("embed.weight".into(), rand(&[vocab, D], 300));
    m.insert("lnf.weight".into(), (rand(&[D], 301) * 0.1).unwrap().affine(1.0, 1.0).unwrap());
    m.insert("lnf.bias".into(), (rand(&[D], 302) * 0.1).unwrap());
    m.insert("lm_head.weight".into(), (rand(&[vocab, D], 303) * 0.3).unwrap());
    m
}

fn lm_case(kind: Kind, n: usize, mode: LmMode) {
    let vocab = 13;
    let w = lm_weights(vocab);
    let cfg = LmConfig {
        block: BlockConfig { n_heads: HEADS, causal: true, eps: 1e-5 },
        n_blocks: 1,
        ignore_index: Some(0),
    };
    let ids: Vec<i64> =
        (0..B * S).map(|i| if i % S >= S - 2 { 0 } else { (i * 5 % 12 + 1) as i64 }).collect();
    let tokens = Tensor::from_vec(ids, (B, S), &Device::Cpu).unwrap();
    let train = |lm: &TinyLm| -> (Vec<f32>, candle_core::backprop::GradStore) {
        let mut opt = SGD::new(lm.vars(), 0.1).unwrap();
        let mut losses = Vec::new();
        let mut first = None;
        for _ in 0..3 {
            let (loss, _) = lm.loss(&tokens).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            let g = lm.backward(&loss).unwrap();
            opt.step(&g).unwrap();
            first.get_or_insert(g);
        }
        (losses, first.unwrap())
    };
    let solo = Comm::mem_world(1).remove(0);
    let reference = TinyLm::from_weights(&w, cfg, LmMode::Reference, &solo).unwrap();
    // Gradients at the initial weights, before training moves them.
    let (l0, _) = reference.loss(&tokens).unwrap();
    let rg = l0.backward().unwrap();
    let ref_grads: HashMap<String, Tensor> = reference
        .params()
        .iter()
        .map(|p| (p.name.clone(), rg.get(p.var.as_tensor()).unwrap().clone()))
        .collect();
    let (ref_losses, _) = train(&reference);
    let full_bytes = reference.param_bytes();
    on_world(kind, n, |c: Comm| {
        let lm = TinyLm::from_weights(&w, cfg, mode, &c).unwrap();
        if n > 1 {
            assert!(lm.param_bytes() < full_bytes, "parameters are split");
        }
        let (l0, _) = lm.loss(&tokens).unwrap();
        let g0 = lm.backward(&l0).unwrap();
        for p in lm.params() {
            let got = g0.get(p.var.as_tensor()).unwrap();
            close(
                got,
                &p.part_of(&ref_grads[&p.name], &c).unwrap(),
                &format!("{mode:?} n={n} {}", p.name),
            );
        }
        let (losses, _) = train(&lm);
        for (a, b) in losses.iter().zip(&ref_losses) {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs() + 1e-6,
                "{mode:?} n={n}: losses {losses:?} vs {ref_losses:?}"
            );
        }
    });
}

#[test]
fn tiny_lm_tp_and_sp_match_one_process_mem() {
    for n in [1, 2, 3, 4] {
        lm_case(Kind::Mem, n, LmMode::Tp);
        lm_case(Kind::Mem, n, LmMode::TpSp);
    }
}

#[test]
fn tiny_lm_tcp() {
    lm_case(Kind::Tcp, 3, LmMode::TpSp);
}

fn pipeline_case(kind: Kind, n: usize, schedule: Schedule, m: usize) {
    let (layers, dim, batch) = (6, 8, 10);
    let ws_full: Vec<Tensor> =
        (0..layers).map(|i| (rand(&[dim, dim], 400 + i as u64) * 0.6).unwrap()).collect();
    let x = rand(&[batch, dim], 5);
    // Oracle: the whole MLP, mean(x_L^2).
    let vars: Vec<Var> = ws_full.iter().map(|w| Var::from_tensor(w).unwrap()).collect();
    let mut t = x.clone();
    for v in &vars {
        t = t.matmul(v.as_tensor()).unwrap().gelu_erf().unwrap();
    }
    let loss = t.sqr().unwrap().mean_all().unwrap();
    let rg = loss.backward().unwrap();
    let ref_loss = loss.to_scalar::<f32>().unwrap() as f64;
    on_world(kind, n, |c: Comm| {
        let mine = tutti_parallel::shard_range(layers, c.rank(), n);
        let ws: Vec<Var> = mine.clone().map(|i| Var::from_tensor(&ws_full[i]).unwrap()).collect();
        let pipe = Pipeline::new(c.clone(), schedule);
        let mb = |i: usize| tutti_parallel::shard_range(batch, i, m);
        let r = pipe
            .step(
                m,
                |i| Ok(x.narrow(0, mb(i).start, mb(i).len())?),
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
            )
            .unwrap();
        assert!((r.loss - ref_loss).abs() <= 1e-6, "loss {} vs {ref_loss}", r.loss);
        for (w, i) in ws.iter().zip(mine) {
            close(
                r.grads.get(w.as_tensor()).unwrap(),
                rg.get(vars[i].as_tensor()).unwrap(),
                "grad",
            );
        }
        assert!(r.waiting <= r.total);
    });
}

#[test]
fn pipeline_matches_one_process_mem() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for n in [1, 2, 3, 4, 6] {
            for m in [1, 2, 5] {
                pipeline_case(Kind::Mem, n, schedule, m);
            }
        }
    }
}

#[test]
fn pipeline_tcp() {
    pipeline_case(Kind::Tcp, 3, Schedule::OneFOneB, 4);
    pipeline_case(Kind::Tcp, 3, Schedule::GPipe, 4);
}

#[test]
fn one_f_one_b_holds_fewer_activations() {
    // Every micro-batch forward once and backward once, each backward after its forward; the
    // number in flight never exceeds the stages left (1F1B) vs all of them (GPipe).
    for (p, m) in [(4, 8), (3, 2), (1, 3)] {
        for s in 0..p {
            for sch in [Schedule::GPipe, Schedule::OneFOneB] {
                let acts = sch.actions(s, p, m);
                assert_eq!(acts.len(), 2 * m);
                let (mut live, mut peak) = (0usize, 0usize);
                let mut done = vec![false; m];
                for (fwd, i) in acts {
                    if fwd {
                        live += 1;
                        peak = peak.max(live);
                    } else {
                        assert!(!done[i]);
                        done[i] = true;
                        live -= 1;
                    }
                }
                let bound = if sch == Schedule::GPipe { m } else { (p - s).min(m) };
                assert_eq!(peak, bound, "{sch:?} stage {s} of {p}, m={m}");
            }
        }
    }
}
