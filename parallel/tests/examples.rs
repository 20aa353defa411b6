//! The seed examples run, not only build: each alone (ranks as threads) and as real processes
//! (one rank each, rendezvous through `MASTER_ADDR`/`MASTER_PORT`), and must exit 0 with every
//! rank's checks matching the single-process run.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EXAMPLES: [&str; 5] = [
    "seed000_strategies",
    "seed001_block",
    "seed002_two_moons",
    "seed003_pipeline",
    "seed004_tiny_lm",
];

/// `cargo test` builds this package's examples next to the test binaries' `deps` folder.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>");
    let path = dir.join("examples").join(name);
    assert!(path.exists(), "{} is missing: cargo test builds the examples", path.display());
    path
}

/// Wait for `child` up to `limit`; kill it past that. Returns its output.
fn finish(mut child: std::process::Child, limit: Duration, what: &str) -> std::process::Output {
    let start = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().expect("output")
}

fn check(out: &std::process::Output, what: &str) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.contains("match: true") && !text.contains("match: false"),
        "{what}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn examples_run_as_threads() {
    for name in EXAMPLES {
        let child =
            Command::new(example(name)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
        let out = finish(child.expect("spawn"), Duration::from_secs(120), name);
        check(&out, name);
    }
}

#[test]
fn examples_run_as_processes() {
    let n = 2;
    for name in EXAMPLES {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let children: Vec<_> = (0..n)
            .map(|r| {
                Command::new(example(name))
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("TUTTI_CONNECT_TIMEOUT", "60")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn")
            })
            .collect();
        for (r, c) in children.into_iter().enumerate() {
            let what = format!("{name} rank {r} of {n}");
            let out = finish(c, Duration::from_secs(120), &what);
            check(&out, &what);
        }
    }
}
