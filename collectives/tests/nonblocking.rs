//! Non-blocking collectives: several outstanding, mixed with blocking calls, same results.

mod common;

use common::*;
use tutti_collectives::{Comm, ReduceOp};

#[test]
fn outstanding_collectives_complete_in_program_order() {
    for n in [1, 2, 3, 5, 8] {
        world(n, 4096, |c: Comm| {
            let (r, n) = (c.rank(), c.size());
            // Three buckets in flight, then a blocking call, then one more.
            let hs: Vec<_> = (0..3u64)
                .map(|k| {
                    c.iallreduce(
                        input::<f32>(k, r, 10_000 + k as usize, ReduceOp::Sum),
                        ReduceOp::Sum,
                    )
                })
                .collect();
            let g = c.iallgather(input::<i32>(7, r, 33, ReduceOp::Sum));
            let mut x = input::<f64>(9, r, 100, ReduceOp::Max);
            c.allreduce(&mut x, ReduceOp::Max).unwrap();
            assert!(x
                .iter()
                .enumerate()
                .all(|(i, v)| *v == reduced::<f64>(9, n, i, ReduceOp::Max)));
            let b = c.ibarrier();
            for (k, h) in hs.into_iter().enumerate() {
                let (buf, st) = h.wait().unwrap();
                assert_eq!(buf.len(), 10_000 + k);
                assert!(same_bits(
                    &buf,
                    &(0..buf.len())
                        .map(|i| reduced::<f32>(k as u64, n, i, ReduceOp::Sum))
                        .collect::<Vec<_>>()
                ));
                assert_eq!(st.seq, k as u64, "submission order is sequence order");
            }
            let (all, _) = g.wait().unwrap();
            assert_eq!(
                all,
                (0..n).flat_map(|q| input::<i32>(7, q, 33, ReduceOp::Sum)).collect::<Vec<_>>()
            );
            b.wait().unwrap();
            let mut rs = c.ireduce_scatter(input::<i64>(3, r, 4 * n, ReduceOp::Sum), ReduceOp::Sum);
            // test() eventually reports completion.
            let res = loop {
                if let Some(res) = rs.test() {
                    break res;
                }
                std::thread::yield_now();
            };
            let (mine, _) = res.unwrap();
            assert_eq!(
                mine,
                (r * 4..r * 4 + 4)
                    .map(|i| reduced::<i64>(3, n, i, ReduceOp::Sum))
                    .collect::<Vec<_>>()
            );
        });
    }
}

#[test]
fn errors_reach_the_handle() {
    world(2, 4096, |c: Comm| {
        let len = if c.rank() == 0 { 10 } else { 11 };
        let h = c.iallreduce(vec![1.0f32; len], ReduceOp::Sum);
        let e = h.wait().unwrap_err().to_string();
        assert!(e.contains("count 10") && e.contains("count 11"), "{e}");
    });
}
