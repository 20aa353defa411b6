//! The autograd communication ops, forward and backward, against what a single process computes,
//! at worlds 1 to 4 over memory and 2 and 3 over TCP. Test data are small integers, so every
//! result is exact.

mod common;

use candle_core::{Tensor, Var};
use common::{assert_exact, ints, on_world};
use tutti_parallel::{ops, Comm};
use tutti_runtime::testing::Kind;

/// Rank r's part of dim `dim` (even split).
fn part(t: &Tensor, dim: usize, r: usize, n: usize) -> Tensor {
    let len = t.dim(dim).unwrap() / n;
    t.narrow(dim, r * len, len).unwrap()
}

/// loss = sum(y * g) with a fixed cotangent g, so d loss / d y = g.
fn loss(y: &Tensor, seed: usize) -> Tensor {
    (y * ints(y.dims(), seed)).unwrap().sum_all().unwrap()
}

fn grad(loss: &Tensor, x: &Var) -> Tensor {
    loss.backward().unwrap().get(x.as_tensor()).unwrap().clone()
}

fn check_all(kind: Kind, n: usize) {
    let shape = [2, 3 * n * 2, 4 * n];
    on_world(kind, n, |c: Comm| {
        let r = c.rank();
        // Rank-dependent input: x_r = ints(seed r).
        let x = Var::from_tensor(&ints(&shape, r)).unwrap();
        let all: Vec<Tensor> = (0..n).map(|q| ints(&shape, q)).collect();
        let sum = all.iter().skip(1).fold(all[0].clone(), |a, b| (a + b).unwrap());

        // f: identity forward, gradient summed backward.
        let y = ops::copy_to_parallel_region(x.as_tensor(), &c).unwrap();
        assert_exact(&y, x.as_tensor(), "f forward");
        // Cotangent differs per rank: the backward sums them.
        let g = grad(&loss(&y, 10 + r), &x);
        let want = (0..n).map(|q| ints(&shape, 10 + q)).reduce(|a, b| (a + b).unwrap()).unwrap();
        assert_exact(&g, &want, "f backward");

        // g: sum forward, identity backward.
        let y = ops::reduce_from_parallel_region(x.as_tensor(), &c).unwrap();
        assert_exact(&y, &sum, "g forward");
        assert_exact(&grad(&loss(&y, 20 + r), &x), &ints(&shape, 20 + r), "g backward");

        // Gather along each dim forward, own part of the gradient backward.
        for dim in 0..3 {
            let y = ops::gather_from_parallel_region(x.as_tensor(), &c, dim).unwrap();
            assert_exact(&y, &Tensor::cat(&all, dim).unwrap(), "gather forward");
            let gy = ints(y.dims(), 30);
            let g = grad(&(&y * &gy).unwrap().sum_all().unwrap(), &x);
            assert_exact(&g, &part(&gy, dim, r, n), "gather backward");
        }

        // Scatter: own part forward, gradients gathered backward.
        for dim in 1..3 {
            let y = ops::scatter_to_parallel_region(x.as_tensor(), &c, dim).unwrap();
            assert_exact(&y, &part(x.as_tensor(), dim, r, n), "scatter forward");
            let g = grad(&loss(&y, 40 + r), &x);
            let parts: Vec<Tensor> = (0..n).map(|q| ints(y.dims(), 40 + q)).collect();
            assert_exact(&g, &Tensor::cat(&parts, dim).unwrap(), "scatter backward");
        }

        // Sequence-parallel pair: allgather / reduce-scatter along dim 1.
        let y = ops::gather_from_sequence_parallel_region(x.as_tensor(), &c, 1).unwrap();
        assert_exact(&y, &Tensor::cat(&all, 1).unwrap(), "sp gather forward");
        let g = grad(&loss(&y, 50 + r), &x);
        let gs = (0..n).map(|q| ints(y.dims(), 50 + q)).reduce(|a, b| (a + b).unwrap()).unwrap();
        assert_exact(&g, &part(&gs, 1, r, n), "sp gather backward (reduce-scatter)");

        let y = ops::reduce_scatter_to_sequence_parallel_region(x.as_tensor(), &c, 1).unwrap();
        assert_exact(&y, &part(&sum, 1, r, n), "sp reduce-scatter forward");
        let g = grad(&loss(&y, 60 + r), &x);
        let parts: Vec<Tensor> = (0..n).map(|q| ints(y.dims(), 60 + q)).collect();
        assert_exact(&g, &Tensor::cat(&parts, 1).unwrap(), "sp reduce-scatter backward");

        // Ulysses: split dim 2 (heads), gather dim 1 (sequence); backward is the inverse.
        let y = ops::all_to_all(x.as_tensor(), &c, 2, 1).unwrap();
        let want: Vec<Tensor> = all.iter().map(|t| part(t, 2, r, n)).collect();
        assert_exact(&y, &Tensor::cat(&want, 1).unwrap(), "all_to_all forward");
        // The gradient of rank q's output block from rank r is rank q's cotangent's block r.
        let g = grad(&loss(&y, 70 + r), &x);
        let blocks: Vec<Tensor> = (0..n).map(|q| part(&ints(y.dims(), 70 + q), 1, r, n)).collect();
        assert_exact(&g, &Tensor::cat(&blocks, 2).unwrap(), "all_to_all backward");

        // The eager moves (no graph), on a non-contiguous view too.
        let xt = x.as_tensor().transpose(1, 2).unwrap();
        let allt: Vec<Tensor> = all.iter().map(|t| t.transpose(1, 2).unwrap()).collect();
        assert_exact(
            &ops::all_reduce(&xt, &c, tutti_parallel::ReduceOp::Sum).unwrap(),
            &sum.transpose(1, 2).unwrap(),
            "eager all_reduce",
        );
        assert_exact(
            &ops::all_gather(&xt, &c, 2).unwrap(),
            &Tensor::cat(&allt, 2).unwrap(),
            "eager all_gather",
        );
        assert_exact(
            &ops::reduce_scatter(&xt, &c, 2).unwrap(),
            &part(&sum.transpose(1, 2).unwrap(), 2, r, n),
            "eager reduce_scatter",
        );
        let root = n - 1;
        assert_exact(&ops::broadcast(&xt, &c, root).unwrap(), &allt[root], "eager broadcast");
    });
}

#[test]
fn ops_mem_worlds_1_to_4() {
    for n in 1..=4 {
        check_all(Kind::Mem, n);
    }
}

#[test]
fn ops_tcp() {
    check_all(Kind::Tcp, 2);
    check_all(Kind::Tcp, 3);
}

#[test]
fn scatter_refuses_an_indivisible_dim() {
    let errs = on_world(Kind::Mem, 3, |c: Comm| {
        let x = ints(&[2, 4], 0);
        ops::scatter_to_parallel_region(&x, &c, 1).unwrap_err().to_string()
    });
    for e in errs {
        assert!(e.contains("does not divide by the world size 3"), "{e}");
    }
}
