//! Non-blocking collectives: several outstanding, mixed with blocking calls, same results.

use crate::common::*;
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
            let mut prev = None;
            for (k, h) in hs.into_iter().enumerate() {
                let (buf, st) = h.wait().unwrap();
                assert_eq!(buf.len(), 10_000 + k);
                assert!(same_bits(
                    &buf,
                    &(0..buf.len())
                        .map(|i| reduced::<f32>(k as u64, n, i, ReduceOp::Sum))
                        .collect::<Vec<_>>()
                ));
                // A first direct call sets up windows, which takes sequence numbers of its own.
                assert!(prev < Some(st.seq), "submission order is sequence order");
                prev = Some(st.seq);
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

#[test]
fn lent_buffers_are_reduced_in_place_and_the_scope_waits() {
    for n in [1, 2, 3, 4, 7] {
        world(n, 4096, |c: Comm| {
            let (r, n) = (c.rank(), c.size());
            let mut a = input::<f32>(1, r, 50_000, ReduceOp::Sum);
            let mut b = input::<i64>(2, r, 777, ReduceOp::Max);
            let mut root =
                if r == n - 1 { input::<f64>(3, r, 301, ReduceOp::Sum) } else { vec![0.0; 301] };
            let mine = input::<i32>(4, r, 5, ReduceOp::Sum);
            let mut all = vec![0i32; 5 * n];
            let mut leaked = input::<u8>(5, r, 9_999, ReduceOp::Max);
            let seqs = c.scope(|s| {
                let ha = s.iallreduce(&mut a, ReduceOp::Sum);
                let hb = s.iallreduce(&mut b, ReduceOp::Max);
                let hc = s.ibroadcast(&mut root, n - 1);
                let hd = s.iallgather(&mine, &mut all);
                // Never waited for: the scope must still wait before `leaked` is readable.
                std::mem::forget(s.iallreduce(&mut leaked, ReduceOp::Max));
                [
                    hd.wait().unwrap().seq,
                    hc.wait().unwrap().seq,
                    hb.wait().unwrap().seq,
                    ha.wait().unwrap().seq,
                ]
            });
            assert!(seqs.windows(2).all(|w| w[0] > w[1]), "submission order is sequence order");
            let want = |k: u64, len: usize, op| (0..len).map(move |i| (k, i, op));
            assert!(same_bits(
                &a,
                &want(1, a.len(), ReduceOp::Sum)
                    .map(|(k, i, op)| reduced::<f32>(k, n, i, op))
                    .collect::<Vec<_>>()
            ));
            assert_eq!(
                b,
                want(2, b.len(), ReduceOp::Max)
                    .map(|(k, i, op)| reduced::<i64>(k, n, i, op))
                    .collect::<Vec<_>>()
            );
            assert!(same_bits(&root, &input::<f64>(3, n - 1, 301, ReduceOp::Sum)));
            assert_eq!(
                all,
                (0..n).flat_map(|q| input::<i32>(4, q, 5, ReduceOp::Sum)).collect::<Vec<_>>()
            );
            assert_eq!(
                leaked,
                want(5, leaked.len(), ReduceOp::Max)
                    .map(|(k, i, op)| reduced::<u8>(k, n, i, op))
                    .collect::<Vec<_>>()
            );
            // The communicator goes on with blocking calls after the scope.
            let mut x = [r as i32];
            c.allreduce(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x[0] as usize, n * (n - 1) / 2);
        });
    }
}

#[test]
fn a_lent_error_reaches_its_handle_and_the_scope_still_returns() {
    world(2, 4096, |c: Comm| {
        let mut v = vec![1.0f32; if c.rank() == 0 { 10 } else { 11 }];
        let e = c.scope(|s| s.iallreduce(&mut v, ReduceOp::Sum).wait()).unwrap_err().to_string();
        assert!(e.contains("count 10") && e.contains("count 11"), "{e}");
    });
}

#[test]
fn a_timed_wait_returns_while_the_collective_runs_and_a_later_wait_gets_it() {
    world(2, 4096, |c: Comm| {
        let r = c.rank();
        if r == 1 {
            // Rank 0's call cannot end before this one starts.
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let mut h = c.iallreduce(vec![r as i64 + 1; 1000], ReduceOp::Sum);
        if r == 0 {
            let t = std::time::Instant::now();
            assert!(h.wait_timeout(std::time::Duration::from_millis(50)).is_none());
            assert!(t.elapsed() >= std::time::Duration::from_millis(50));
        }
        let (buf, _) =
            h.wait_timeout(std::time::Duration::from_secs(20)).expect("ended within 20 s").unwrap();
        assert!(buf.iter().all(|v| *v == 3), "{:?}", &buf[..4]);
        // Spent: asking again is an error at once, never a wait that cannot end.
        assert!(h.wait_timeout(std::time::Duration::from_secs(20)).is_some_and(|r| r.is_err()));
        let mut b = c.ibarrier();
        let first = loop {
            if let Some(r) = b.test() {
                break r;
            }
            std::thread::yield_now();
        };
        first.unwrap();
        let t = std::time::Instant::now();
        let again = b.wait().unwrap_err().to_string();
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "{again}");
        assert!(again.contains("already taken"), "{again}");
        // The same through a scope's lent buffer.
        let mut y = vec![r as i32 + 1; 100];
        c.scope(|s| {
            if r == 1 {
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            let mut h = s.iallreduce(&mut y, ReduceOp::Sum);
            if r == 0 {
                assert!(h.wait_timeout(std::time::Duration::from_millis(50)).is_none());
            }
            h.wait_timeout(std::time::Duration::from_secs(20)).expect("ended").unwrap();
        });
        assert!(y.iter().all(|v| *v == 3), "{:?}", &y[..4]);
    });
}
