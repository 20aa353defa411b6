//! Tuning (`Config::tune`): while each size class tries its candidates and after it has chosen,
//! every call is exact, and every rank ends with the same choices (they are agreed, and the
//! fingerprint would name any disagreement).

use tutti_collectives::{verify, Comm, Config, ReduceOp};
use tutti_runtime::Group;

fn world(n: usize) -> Vec<Comm> {
    let cfg = Config { tune: true, ..Config::default() };
    Group::mem_world(n).into_iter().map(|g| Comm::with_config(g, cfg.clone())).collect()
}

#[test]
fn tuned_calls_are_exact_and_every_rank_agrees() {
    for n in [2, 3, 4] {
        let comms = world(n);
        let choices: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank();
                        // Enough rounds for a class of 5 candidates (the table's choice and
                        // 4 more, direct reads among them, 5 calls each, two passes) to decide.
                        for round in 0..50u64 {
                            for count in [7usize, 1000, 70_000] {
                                let op = ReduceOp::Sum;
                                let mut x = verify::input::<f32>(round, r, count, op);
                                c.allreduce(&mut x, op).unwrap();
                                let wrong =
                                    verify::count_wrong(&x, |i| verify::reduced(round, n, i, op));
                                assert_eq!(wrong, 0, "n={n} round {round} count {count}");
                                let per = count / n + 1;
                                let mine = verify::input::<f32>(round + 1, r, per, op);
                                let mut all = vec![0f32; per * n];
                                c.allgather(&mine, &mut all).unwrap();
                                let wrong = verify::count_wrong(&all, |i| {
                                    verify::value(round + 1, i / per, i % per, op)
                                });
                                assert_eq!(wrong, 0, "allgather n={n} round {round}");
                                let root = round as usize % n;
                                let mut b = if r == root { mine.clone() } else { vec![0f32; per] };
                                c.broadcast(&mut b, root).unwrap();
                                assert_eq!(b, verify::input::<f32>(round + 1, root, per, op));
                            }
                        }
                        c.tuned()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(!choices[0].is_empty(), "n={n}: nothing was tuned");
        for c in &choices[1..] {
            assert_eq!(c, &choices[0], "n={n}: ranks disagree");
        }
    }
}
