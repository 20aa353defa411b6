//! No shared memory outlives a job: every segment the ranks of one host share (the rings of
//! their links and the windows of direct reads) is an anonymous memfd, whose pages the kernel
//! frees once the last rank that maps it is gone — SIGKILLed ranks included, which clean up
//! nothing. Checked on the machine's own count of shared pages (`Shmem` in `/proc/meminfo`,
//! which counts memfd pages): it grows while a 4-rank job runs and comes back when every rank
//! has been killed. In a test binary of its own, so no other job of this suite runs meanwhile.

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
    let during = shmem_kib();
    let held = during.saturating_sub(before);
    eprintln!("Shmem: {before} KiB before, {during} KiB while the job runs");
    // Rings of 6 links and 4 windows: several MiB (a check that could not fail otherwise).
    assert!(held >= 4 << 10, "the job holds only {held} KiB of shared memory");
    for r in 0..n {
        job.signal(r, libc::SIGKILL);
    }
    assert!(job.wait_exit(&(0..n).collect::<Vec<_>>(), Duration::from_secs(20)));
    // The kernel frees the pages as the last mapping goes; allow it a moment, and other
    // processes of the machine a tenth of what the job held.
    let limit = before + held / 10;
    let t = Instant::now();
    let mut after = shmem_kib();
    while after > limit && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
        after = shmem_kib();
    }
    eprintln!("Shmem: {after} KiB after every rank was killed");
    assert!(after <= limit, "{after} KiB shared after the job, {before} KiB before it");
}
