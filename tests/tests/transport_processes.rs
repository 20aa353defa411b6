//! TCP across real OS processes on 127.0.0.1: the store's port comes from the OS and every
//! rank's listening port travels through it, so these tests run in parallel without collisions.

use std::path::Path;
use std::time::Duration;

use tutti_tests::{assert_all_ok, spawn_job};

#[test]
fn p2p_ring_and_tags_across_processes() {
    for n in [2, 3, 4] {
        let outs = spawn_job(
            Path::new(env!("CARGO_BIN_EXE_tt-rank")),
            &["p2p"],
            n,
            |_| vec![],
            Duration::from_secs(120),
        );
        assert_all_ok(&outs, &format!("p2p n={n}"));
    }
}
