//! Property tests: random lengths, world sizes and segment sizes, every algorithm, exact results.

use crate::common::*;
use proptest::prelude::*;
use tutti_collectives::{Algo, Coll, Comm, ReduceOp};

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn allreduce_any_shape(n in 1usize..10, count in 0usize..3000, seg in 4usize..5000, algo in 0usize..5, in_place in any::<bool>()) {
        // Every allreduce but two-level, which needs hosts.
        let pool: Vec<Algo> =
            Coll::Allreduce.algos().iter().copied().filter(|a| *a != Algo::TwoLevel).collect();
        let algo = pool[algo % pool.len()];
        world(n, seg, |c: Comm| {
            let c = c.with_algo(algo);
            let inp = input::<f32>(21, c.rank(), count, ReduceOp::Sum);
            let mut out = if in_place { inp.clone() } else { vec![0.0; count] };
            if in_place {
                c.allreduce(&mut out, ReduceOp::Sum).unwrap();
            } else {
                c.allreduce_from(&inp, &mut out, ReduceOp::Sum).unwrap();
            }
            let want: Vec<f32> = (0..count).map(|i| reduced(21, c.size(), i, ReduceOp::Sum)).collect();
            assert!(same_bits(&out, &want), "{algo} n={} count={count} seg={seg}", c.size());
        });
    }

    #[test]
    fn reduce_scatter_and_allgather_v_any_shape(n in 1usize..9, counts in proptest::collection::vec(0usize..400, 8), seg in 4usize..3000) {
        world(n, seg, |c: Comm| {
            let (r, n) = (c.rank(), c.size());
            let cnts = &counts[..n];
            let total: usize = cnts.iter().sum();
            let off: usize = cnts[..r].iter().sum();
            let full = input::<i32>(22, r, total, ReduceOp::Sum);
            let mut mine = vec![0i32; cnts[r]];
            c.reduce_scatter_v(&full, &mut mine, cnts, ReduceOp::Sum).unwrap();
            assert_eq!(mine, (off..off + cnts[r]).map(|i| reduced::<i32>(22, n, i, ReduceOp::Sum)).collect::<Vec<_>>());
            let mut all = vec![0i32; total];
            c.allgatherv(&mine, &mut all, cnts).unwrap();
            assert_eq!(all, (0..total).map(|i| reduced::<i32>(22, n, i, ReduceOp::Sum)).collect::<Vec<_>>());
        });
    }

    #[test]
    fn broadcast_any_shape(n in 1usize..10, len in 0usize..5000, seg in 1usize..3000, root_pick in 0usize..100, chain in any::<bool>()) {
        world(n, seg, |c: Comm| {
            let root = root_pick % c.size();
            let c = c.with_algo(if chain { Algo::Chain } else { Algo::Tree });
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + root) as u8).collect();
            let mut b = if c.rank() == root { src.clone() } else { vec![0u8; len] };
            c.broadcast(&mut b, root).unwrap();
            assert_eq!(b, src);
        });
    }
}
