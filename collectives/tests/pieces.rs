//! Large allreduces run as back-to-back pieces (`Config::chunk`): every element exact across
//! piece boundaries, in place and out of place, plain, averaged and scaled, for uneven counts
//! and world sizes 2–5; the pieces really ran (the sequence numbers they took are counted);
//! a forced algorithm runs whole.

use tutti_collectives::{Algo, Comm, Config, ReduceOp};

const CHUNK: usize = 8 << 10;
const SEG: usize = 1 << 10;

fn world(n: usize, f: impl Fn(Comm) + Sync) {
    let groups = tutti_runtime::Group::mem_world(n);
    std::thread::scope(|s| {
        let f = &f;
        for g in groups {
            let c =
                Comm::with_config(g, Config { segment: SEG, chunk: CHUNK, ..Config::default() });
            s.spawn(move || f(c));
        }
    });
}

/// Rank `r`'s element `i`: a small integer, so sums are exact in any order.
fn value(r: usize, i: usize) -> f64 {
    ((i * 7 + r * 13) % 101) as f64 - 50.0
}

#[test]
fn pieces_are_exact() {
    for n in 2..=5 {
        world(n, |c| {
            let r = c.rank();
            // The piece: max(chunk, 2 segments per rank) bytes of f64.
            let piece = CHUNK.max(2 * SEG * n) / 8;
            for count in [piece + 1, 3 * piece - 5, 4 * piece, 5 * piece + 333] {
                let pieces = count.div_ceil(piece).max(1);
                let sum: Vec<f64> = (0..count).map(|i| (0..n).map(|q| value(q, i)).sum()).collect();
                let mine: Vec<f64> = (0..count).map(|i| value(r, i)).collect();
                let cases: [(&str, Vec<f64>); 4] = [
                    ("sum", sum.clone()),
                    ("avg", sum.iter().map(|s| s / n as f64).collect()),
                    ("scaled", sum.iter().map(|s| s * 0.25).collect()),
                    ("sum out of place", sum.clone()),
                ];
                for (what, want) in cases {
                    let mut buf = mine.clone();
                    let st = match what {
                        "sum" => c.allreduce(&mut buf, ReduceOp::Sum),
                        "avg" => c.allreduce(&mut buf, ReduceOp::Avg),
                        "scaled" => c.allreduce_scaled(&mut buf, 0.25),
                        _ => {
                            buf.fill(0.0);
                            c.allreduce_from(&mine, &mut buf, ReduceOp::Sum)
                        }
                    }
                    .unwrap();
                    let bad = buf.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                    assert!(bad.is_none(), "n={n} count={count} {what}: element {bad:?}");
                    // Each piece took a sequence number: the next call's is `pieces` later.
                    let next = c.barrier().unwrap();
                    assert_eq!(next.seq - st.seq, pieces as u64, "n={n} count={count} {what}");
                }
            }
        });
    }
}

#[test]
fn a_forced_algorithm_runs_whole() {
    world(3, |c| {
        let count = 4 * CHUNK / 8;
        let mut buf: Vec<f64> = (0..count).map(|i| value(c.rank(), i)).collect();
        let st = c.with_algo(Algo::Ring).allreduce(&mut buf, ReduceOp::Sum).unwrap();
        assert_eq!(c.barrier().unwrap().seq - st.seq, 1);
        let want: Vec<f64> = (0..count).map(|i| (0..3).map(|q| value(q, i)).sum()).collect();
        assert!(buf == want);
    });
}
