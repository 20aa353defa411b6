//! Communicators that read their peers' memory directly, each with a sub-group of its own, made
//! and dropped a thousand times: no descriptor and no mapping stays behind. (Alone in its test
//! binary: it counts the whole process's descriptors and mappings.)

use tutti_collectives::{Algo, Comm, ReduceOp};
use tutti_runtime::testing::{groups, Kind};

fn entries(path: &str) -> usize {
    match std::fs::read_dir(path) {
        Ok(d) => d.count(),
        Err(_) => std::fs::read_to_string(path).map_or(0, |s| s.lines().count()),
    }
}

fn rounds(gs: &[tutti_runtime::Group], k: usize) {
    std::thread::scope(|s| {
        for g in gs {
            s.spawn(move || {
                for i in 0..k {
                    let c = Comm::new(g.clone()).with_algo(Algo::Direct);
                    let mut x = vec![i as f32; 1000];
                    c.allreduce(&mut x, ReduceOp::Sum).unwrap();
                    assert!(x.iter().all(|v| *v == 2.0 * i as f32));
                    // A sub-group of its own (a new group id, windows of its own), forced onto
                    // direct reads too (a split keeps the settings, not a forced algorithm),
                    // dropped with it.
                    let sub = c
                        .split(&[0, 1])
                        .unwrap()
                        .expect("both ranks are in it")
                        .with_algo(Algo::Direct);
                    let mut y = vec![i as f32; 1000];
                    let st = sub.allreduce(&mut y, ReduceOp::Max).unwrap();
                    assert_eq!(st.algo, Algo::Direct);
                    assert!(y.iter().all(|v| *v == i as f32));
                }
            });
        }
    });
}

#[test]
fn a_thousand_groups_made_and_dropped_leave_no_descriptor_or_mapping() {
    // Over TCP with shared memory: each communicator maps real memfd windows.
    let gs = groups(Kind::Shm, 2).unwrap();
    rounds(&gs, 20);
    let (fds, maps) = (entries("/proc/self/fd"), entries("/proc/self/maps"));
    rounds(&gs, 1000);
    let (fds2, maps2) = (entries("/proc/self/fd"), entries("/proc/self/maps"));
    assert!(fds2 <= fds, "descriptors {fds} -> {fds2}");
    // Thread stacks and allocator arenas come and go; windows would add thousands.
    assert!(maps2 <= maps + 8, "mappings {maps} -> {maps2}");
}
