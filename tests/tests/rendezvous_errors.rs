//! Rendezvous mistakes are reported clearly and promptly: duplicate ranks, a world-size
//! disagreement, a rank that never arrives, bad environment values.

use std::path::Path;
use std::time::{Duration, Instant};

use tutti_tests::spawn_job;

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn duplicate_rank_is_named() {
    // Ranks 0 and 1 and a second "rank 1": two processes claim rank 1.
    let outs = spawn_job(
        Path::new(env!("CARGO_BIN_EXE_tt-rank")),
        &["connect"],
        3,
        |r| {
            if r == 2 {
                vec![("RANK".into(), "1".into()), ("TUTTI_CONNECT_TIMEOUT".into(), "5".into())]
            } else {
                vec![("TUTTI_CONNECT_TIMEOUT".into(), "5".into())]
            }
        },
        Duration::from_secs(60),
    );
    let all: String = outs.iter().map(text).collect();
    assert!(all.contains("2 processes claim rank 1"), "{all}");
}

#[test]
fn world_size_disagreement_is_named() {
    let outs = spawn_job(
        Path::new(env!("CARGO_BIN_EXE_tt-rank")),
        &["connect"],
        2,
        |r| {
            let mut v = vec![("TUTTI_CONNECT_TIMEOUT".into(), "5".into())];
            if r == 1 {
                v.push(("WORLD_SIZE".into(), "3".into()));
            }
            v
        },
        Duration::from_secs(60),
    );
    let t = text(&outs[1]);
    assert!(!outs[1].status.success());
    assert!(t.contains("WORLD_SIZE=3") && t.contains("WORLD_SIZE=2"), "{t}");
}

#[test]
fn missing_rank_is_named_within_the_connect_timeout() {
    // World of 3 but only ranks 0 and 1 start (rank 2's RANK is out of range, so it exits).
    let start = Instant::now();
    let outs = spawn_job(
        Path::new(env!("CARGO_BIN_EXE_tt-rank")),
        &["connect"],
        3,
        |r| {
            let mut v = vec![("TUTTI_CONNECT_TIMEOUT".into(), "3".into())];
            if r == 2 {
                v.push(("RANK".into(), "7".into()));
            }
            v
        },
        Duration::from_secs(60),
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(text(&outs[2]).contains("RANK=7 is not below WORLD_SIZE=3"), "{}", text(&outs[2]));
    for o in &outs[..2] {
        let t = text(o);
        assert!(!o.status.success());
        assert!(t.contains("rank 2") || t.contains("[2]"), "{t}");
    }
}
