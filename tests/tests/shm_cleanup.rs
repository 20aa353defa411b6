//! No shared memory outlives a job: every segment the ranks of one host share (the rings of
//! their links and the windows of direct reads) is an anonymous memfd, whose pages the kernel
//! frees once the last rank that maps it is gone — SIGKILLed ranks included, which clean up
//! nothing. Checked twice: no process maps any of the segments the ranks mapped (by inode,
//! from `/proc/*/maps`), and the machine's own count of shared pages (`Shmem` in
//! `/proc/meminfo`, which counts memfd pages), which grows while a 4-rank job runs, comes back
//! when every rank has been killed. In a test binary of its own, so that no other job of this
//! suite runs meanwhile under `cargo test`; under cargo-nextest it takes every test slot
//! (.config/nextest.toml), so that it runs alone.

use std::path::Path;
use std::time::{Duration, Instant};

use tutti_tests::LiveJob;

const EXE: &str = env!("CARGO_BIN_EXE_tt-rank");

/// The machine's shared pages, in KiB (`Shmem` in `/proc/meminfo`).
fn shmem_kib() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    m.lines()
        .find_map(|l| l.strip_prefix("Shmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("Shmem in /proc/meminfo")
}

/// The inodes of the `memfd:` segments a process maps (from its `/proc/PID/maps`).
fn memfd_inodes(maps: &str) -> Vec<u64> {
    maps.lines()
        .filter(|l| l.contains("/memfd:"))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

#[test]
fn no_shared_memory_outlives_a_job_whose_every_rank_is_killed() {
    let n = 4;
    let before = shmem_kib();
    let mut job = LiveJob::start(Path::new(EXE), &["loop"], n, &[("TUTTI_CONNECT_TIMEOUT", "30")]);
    assert!(job.wait_all("READY", Duration::from_secs(60)), "the job did not start");
    for r in 0..n {
        let kinds = job.line(r, "KINDS ").expect("each rank prints its links");
        assert!(!kinds.contains("tcp"), "rank {r}'s links are not all shared memory: {kinds}");
    }
    // The loop runs every size (small ones by direct reads, large ones through the rings).
    std::thread::sleep(Duration::from_millis(300));
    let mut segments: Vec<u64> = Vec::new();
    for c in &job.children {
        segments.extend(memfd_inodes(
            &std::fs::read_to_string(format!("/proc/{}/maps", c.id())).expect("a rank's maps"),
        ));
    }
    segments.sort_unstable();
    segments.dedup();
    // A ring per link (6) and a window per rank (4), each mapped by both or all sides.
    assert!(segments.len() >= 4, "the ranks map only {} shared segments", segments.len());
    let during = shmem_kib();
    let held = during.saturating_sub(before);
    eprintln!("Shmem: {before} KiB before, {during} KiB while the job runs");
    // Rings of 6 links and 4 windows: several MiB (a check that could not fail otherwise).
    assert!(held >= 4 << 10, "the job holds only {held} KiB of shared memory");
    for r in 0..n {
        job.signal(r, libc::SIGKILL);
    }
    assert!(job.wait_exit(&(0..n).collect::<Vec<_>>(), Duration::from_secs(20)));
    // No process maps any of the job's segments any more (a memfd lives as long as a mapping
    // or a descriptor of it does; the ranks' descriptors went with them).
    let left: Vec<String> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let maps = std::fs::read_to_string(e.path().join("maps")).ok()?;
            let held: Vec<u64> =
                memfd_inodes(&maps).into_iter().filter(|i| segments.contains(i)).collect();
            (!held.is_empty()).then(|| format!("{:?} maps {held:?}", e.file_name()))
        })
        .collect();
    assert!(left.is_empty(), "the job's segments outlive it: {left:?}");
    // And the machine's count of shared pages comes back: the kernel freed them. Other
    // processes of the machine may change it meanwhile: half of what the job held is allowed.
    let limit = before + held / 2;
    let t = Instant::now();
    let mut after = shmem_kib();
    while after > limit && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
        after = shmem_kib();
    }
    eprintln!("Shmem: {after} KiB after every rank was killed");
    assert!(after <= limit, "{after} KiB shared after the job, {before} KiB before it");
}
