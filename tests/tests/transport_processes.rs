//! TCP across real OS processes on 127.0.0.1: the store's port comes from the OS and every
//! rank's listening port travels through it, so these tests run in parallel without collisions.

use std::path::Path;
use std::time::Duration;

use tutti_tests::spawn_job;

fn ok_all(outs: &[std::process::Output]) {
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && text.contains(&format!("OK {r}")),
            "rank {r}: {text}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

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
        ok_all(&outs);
    }
}
