//! Sub-groups share the world's connections: a 2-D (data × tensor) layout of 6 ranks runs
//! collectives in row and column groups concurrently, over memory and TCP.

use tutti_collectives::{Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

fn two_d(kind: Kind) {
    let gs = groups(kind, 6).unwrap();
    std::thread::scope(|s| {
        for g in gs {
            s.spawn(move || {
                let world = Comm::new(g);
                let r = world.rank();
                // Rows {0,1,2} {3,4,5} (tensor parallel), columns {0,3} {1,4} {2,5} (data parallel).
                // Every rank calls every split, in the same order.
                let row0 = world.split(&[0, 1, 2]).unwrap();
                let row1 = world.split(&[3, 4, 5]).unwrap();
                let cols: Vec<Option<Comm>> =
                    (0..3).map(|c| world.split(&[c, c + 3]).unwrap()).collect();
                let row = row0.or(row1).expect("every rank is in one row");
                let col = cols.into_iter().flatten().next().expect("every rank is in one column");
                assert_eq!((row.size(), col.size()), (3, 2));
                assert_eq!(row.rank(), r % 3);
                assert_eq!(col.rank(), r / 3);
                for round in 0..5 {
                    let mut x = vec![(r + round) as i64; 1000 + round];
                    row.allreduce(&mut x, ReduceOp::Sum).unwrap();
                    let base = (r / 3) * 3;
                    let want: i64 = (base..base + 3).map(|q| (q + round) as i64).sum();
                    assert!(x.iter().all(|v| *v == want), "row sum");
                    let mut y = vec![r as f32; 77];
                    col.allreduce(&mut y, ReduceOp::Max).unwrap();
                    assert!(y.iter().all(|v| *v == (r % 3 + 3) as f32), "column max");
                    let mut z = vec![0u8; 6];
                    world.allgather(&[r as u8], &mut z).unwrap();
                    assert_eq!(z, [0, 1, 2, 3, 4, 5]);
                }
            });
        }
    });
}

#[test]
fn two_d_layout_mem() {
    two_d(Kind::Mem);
}

#[test]
fn two_d_layout_tcp() {
    two_d(Kind::Tcp);
}
