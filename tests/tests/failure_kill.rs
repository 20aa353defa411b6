//! Faults across real processes: a rank SIGKILLed at a random moment of an allreduce loop is
//! named by every survivor, fast; a SIGSTOPped rank is named within 6 s (the dead-peer limit,
//! 5 s, and a second); a rank that merely computes for longer than the dead-peer limit is
//! never declared dead; killing during
//! rendezvous and killing rank 0 are reported too; over QUIC every rank, rank 0 included, is
//! killed once with a time bound. The ranks share one host, so their links are shared memory
//! by default; the same kills and stops run over TCP alone (`TUTTI_SHM=0`), over QUIC, and
//! over shared memory with 2 ranks.
//!
//! `TUTTI_KILL_RUNS` sets the number of kill runs (default 20).

use std::path::Path;
use std::time::Duration;

use tutti_tests::{now_us, LiveJob, Rendezvous};

const EXE: &str = env!("CARGO_BIN_EXE_tt-rank");

/// The promise for a stopped rank (µs from the SIGSTOP to a survivor's error): the dead-peer
/// limit (`TUTTI_DEAD_AFTER`, 5 s by default) and a second.
const STOPPED_US: u128 = 6_000_000;

/// A small deterministic generator, so a failing run can be repeated from its seed.
fn lcg(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 33
}

/// One kill run: returns the detection delays (µs) of the survivors.
fn kill_run(seed: u64, victim: usize, env: &[(&str, &str)]) -> Vec<u128> {
    kill_run_with(seed, victim, env, &Rendezvous::Store)
}

/// One kill run of a job that rendezvouses as `rdv` says.
fn kill_run_with(seed: u64, victim: usize, env: &[(&str, &str)], rdv: &Rendezvous) -> Vec<u128> {
    kill_run_of(4, seed, victim, env, rdv)
}

/// One kill run of `n` ranks.
fn kill_run_of(
    n: usize,
    seed: u64,
    victim: usize,
    env: &[(&str, &str)],
    rdv: &Rendezvous,
) -> Vec<u128> {
    let mut env = env.to_vec();
    env.push(("TUTTI_CONNECT_TIMEOUT", "30"));
    let mut job = LiveJob::start_with(Path::new(EXE), &["loop"], n, &env, rdv);
    assert!(job.wait_all("READY", Duration::from_secs(60)), "seed {seed}: job did not start");
    check_kinds(&job, n, &env);
    let mut s = seed;
    std::thread::sleep(Duration::from_millis(20 + lcg(&mut s) % 400));
    let t_kill = now_us();
    job.signal(victim, libc::SIGKILL);
    let survivors: Vec<usize> = (0..n).filter(|r| *r != victim).collect();
    assert!(
        job.wait_exit(&survivors, Duration::from_secs(20)),
        "seed {seed}: a survivor hung after rank {victim} was killed"
    );
    survivors
        .iter()
        .map(|&r| {
            let line = job
                .line(r, "ERR ")
                .unwrap_or_else(|| panic!("seed {seed}: rank {r} printed no error"));
            let mut it = line.splitn(3, ' ');
            it.next();
            let t: u128 = it.next().and_then(|t| t.parse().ok()).expect("timestamp");
            let text = it.next().unwrap_or("");
            assert!(
                text.contains(&format!("rank {victim}")),
                "seed {seed}: rank {r}'s error does not name rank {victim}: {text}"
            );
            t.saturating_sub(t_kill)
        })
        .collect()
}

#[test]
fn sigkill_of_a_random_rank_is_named_by_every_survivor() {
    let runs: u64 =
        std::env::var("TUTTI_KILL_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let mut all = Vec::new();
    let mut seed = 0x7475_7474u64;
    for run in 0..runs {
        let victim = (lcg(&mut seed) % 4) as usize;
        all.extend(kill_run(run, victim, &[]));
    }
    all.sort_unstable();
    let median = all[all.len() / 2];
    let worst = *all.last().unwrap();
    eprintln!(
        "kill runs: {runs}, survivors: {}, median detection {median} us, worst {worst} us",
        all.len()
    );
    assert!(median < 100_000, "median detection {median} us");
    assert!(worst < 1_000_000, "worst detection {worst} us");
}

#[test]
fn sigkill_of_rank_zero_is_named() {
    let d = kill_run(1000, 0, &[]);
    assert!(d.iter().all(|us| *us < 1_000_000), "{d:?}");
}

/// The README's path: rank 0 serves the store itself (`MASTER_ADDR`/`MASTER_PORT`, its secret
/// kept privately on this host). Killing it mid-job takes the store with it; the survivors
/// still name rank 0 at once, over TCP and QUIC.
#[test]
fn sigkill_of_the_rank_serving_the_store_is_named() {
    // QUIC alone, and a QUIC job whose ranks (all of this host) link through shared memory.
    let quic = vec![("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")];
    for (seed, env) in [(1100, vec![]), (1200, quic), (1300, vec![("TUTTI_TRANSPORT", "quic")])] {
        let d = kill_run_with(seed, 0, &env, &Rendezvous::Master);
        assert!(d.iter().all(|us| *us < 1_000_000), "{env:?}: {d:?}");
    }
}

#[test]
fn sigkill_during_rendezvous_is_reported() {
    // Killed at once, rank 2 cannot have finished rendezvous (the mesh needs it), so every
    // survivor must fail naming it; killed later, a survivor may have finished (OK) or name it.
    // Either way nobody hangs past the 5 s connect timeout (plus a margin for a loaded host).
    for delay_ms in [0u64, 30, 120] {
        let mut job =
            LiveJob::start(Path::new(EXE), &["connect"], 4, &[("TUTTI_CONNECT_TIMEOUT", "5")]);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let t = std::time::Instant::now();
        job.signal(2, libc::SIGKILL);
        assert!(
            job.wait_exit(&[0, 1, 3], Duration::from_secs(30)),
            "a rank hung after rank 2 died during rendezvous"
        );
        assert!(t.elapsed() < Duration::from_secs(15), "took {:?}", t.elapsed());
        let mut named = 0;
        for r in [0, 1, 3] {
            let ok = job.line(r, "OK").is_some();
            let err = job.line(r, "ERR").unwrap_or_default();
            let names_2 = err.contains("rank 2") || err.contains("[2]") || err.contains("[2,");
            assert!(ok || names_2, "delay {delay_ms}: rank {r}: {err}");
            assert!(delay_ms > 0 || !ok, "rank {r} finished rendezvous without rank 2");
            named += usize::from(names_2);
        }
        if delay_ms == 0 {
            assert_eq!(named, 3, "killed at once, rank 2 must be named by all three");
        }
    }
}

#[test]
fn a_stopped_rank_is_named_within_six_seconds() {
    stopped_rank(&[]);
}

#[test]
fn a_stopped_rank_is_named_within_six_seconds_over_quic() {
    // QUIC's idle timeout, driven by the waiting thread's timers, names the silent peer.
    stopped_rank(&[("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")]);
}

#[test]
fn a_stopped_rank_of_a_quic_job_on_one_host_is_named_within_six_seconds() {
    // Its links are shared memory's under QUIC's transport: the core's keep-alives stop.
    stopped_rank(&[("TUTTI_TRANSPORT", "quic")]);
}

#[test]
fn a_stopped_rank_is_named_within_six_seconds_over_tcp_alone() {
    stopped_rank(&[("TUTTI_SHM", "0")]);
}

#[test]
fn a_stopped_rank_of_two_is_named_within_six_seconds() {
    stopped_rank_of(2, 1, &[]);
}

#[test]
fn a_stopped_rank_0_is_named_within_six_seconds_over_tcp_alone() {
    // Rank 0 holds the store (MASTER_ADDR). A failed call over TCP leaves its reason in the store only for
    // peers not connected yet; with every link up it does not ask the stopped store (which
    // would hold it for the store's timeout, 10 s more).
    let mut job = LiveJob::start_with(
        Path::new(EXE),
        &["loop"],
        4,
        &[("TUTTI_SHM", "0")],
        &Rendezvous::Master,
    );
    stopped_in(&mut job, 4, 0);
}

#[test]
fn a_stopped_store_does_not_hold_a_failed_call_whose_rank_has_links_to_connect() {
    // Rank 0 holds the store (MASTER_ADDR) and talks only with rank 1, as ranks 2 and 3 talk
    // only with each other (lazy connections: most pairs never connect). When rank 0 stops,
    // rank 1's failed call leaves its reason in the store for the peers it never connected
    // with; that write waits for the stopped store, off the call's thread. The call still
    // returns at the dead-peer limit (5 s), not 10 s later at the store's timeout.
    let mut job = LiveJob::start_with(
        Path::new(EXE),
        &["pairloop"],
        4,
        &[("TUTTI_SHM", "0"), ("TUTTI_CONNECT", "lazy")],
        &Rendezvous::Master,
    );
    assert!(job.wait_all("READY", Duration::from_secs(60)));
    std::thread::sleep(Duration::from_millis(200));
    let t = now_us();
    job.signal(0, libc::SIGSTOP);
    let exited = job.wait_exit(&[1], Duration::from_secs(30));
    for r in 0..4 {
        job.signal(r, libc::SIGKILL);
    }
    assert!(exited, "rank 1 hung on a stopped rank 0");
    let line = job.line(1, "ERR ").expect("error line");
    let ts: u128 = line.split(' ').nth(1).and_then(|v| v.parse().ok()).unwrap();
    eprintln!("stopped rank 0 named by rank 1 after {} ms", (ts - t) / 1000);
    assert!(ts - t < STOPPED_US, "rank 1 took {} ms: {line}", (ts - t) / 1000);
    assert!(line.contains("rank 0"), "{line}");
}

/// Direct reads connect only the links their set-up uses: with 4 ranks on one host some
/// survivor has no link to the victim, and learns of its end from the kernel (or from the
/// survivors that have one). Killed: every survivor names it within 1 s; stopped: within 6 s.
#[test]
fn a_rank_that_a_survivor_has_no_link_to_is_named_when_killed_or_stopped() {
    let n = 4;
    let start = || {
        // Direct reads forced: whatever the machine's cores, the job's links are the set-up's.
        let job =
            LiveJob::start(Path::new(EXE), &["loop"], n, &[("TUTTI_ALGO", "allreduce:direct")]);
        assert!(job.wait_all("READY", Duration::from_secs(60)), "the job did not start");
        // (survivor, victim): a pair never connected.
        let pair = (0..n).find_map(|s| {
            let line = job.line(s, "UNLINKED ").expect("UNLINKED line");
            let list = line.split(' ').nth(2).unwrap_or("-").to_string();
            list.split(',').find_map(|v| v.parse::<usize>().ok()).map(|v| (s, v))
        });
        let (s, v) = pair.unwrap_or_else(|| panic!("every pair connected: {:?}", job.lines));
        (job, s, v)
    };
    let (mut job, s, v) = start();
    let t_kill = now_us();
    job.signal(v, libc::SIGKILL);
    let survivors: Vec<usize> = (0..n).filter(|r| *r != v).collect();
    assert!(job.wait_exit(&survivors, Duration::from_secs(20)), "a survivor hung on {v}");
    for r in survivors {
        let line = job.line(r, "ERR ").unwrap_or_else(|| panic!("rank {r} printed no error"));
        let ts: u128 = line.split(' ').nth(1).and_then(|t| t.parse().ok()).expect("timestamp");
        assert!(line.contains(&format!("rank {v}")), "rank {r} (unlinked: {s}): {line}");
        assert!(ts.saturating_sub(t_kill) < 1_000_000, "rank {r} (unlinked: {s}): {line}");
    }
    let (mut job, _, v) = start();
    stopped_in_ready(&mut job, n, v);
}

fn stopped_rank(env: &[(&str, &str)]) {
    stopped_rank_of(4, 1, env);
}

fn stopped_rank_of(n: usize, victim: usize, env: &[(&str, &str)]) {
    let mut job = LiveJob::start(Path::new(EXE), &["loop"], n, env);
    stopped_in(&mut job, n, victim);
    check_kinds(&job, n, env);
}

/// Every connected link of the job's ranks (tt-rank's `KINDS` lines) is shared memory's unless
/// `env` turns it off (`TUTTI_SHM=0`), and then none is: this host's ranks link through shared
/// memory in TCP and QUIC jobs alike.
fn check_kinds(job: &LiveJob, n: usize, env: &[(&str, &str)]) {
    let shm = !env.contains(&("TUTTI_SHM", "0"));
    for r in 0..n {
        let line = job.line(r, "KINDS ").unwrap_or_else(|| panic!("rank {r} printed no KINDS"));
        for k in line.split_whitespace().nth(2).unwrap_or("").split(',') {
            let ok = match k {
                "-" | "unconnected" => true,
                "shm" => shm,
                _ => !shm,
            };
            assert!(ok, "rank {r}'s links with shared memory {shm}: {line} ({env:?})");
        }
    }
}

/// Stop `victim` of the `n` ranks of `job` once all are ready: every survivor names it within
/// [`STOPPED_US`].
fn stopped_in(job: &mut LiveJob, n: usize, victim: usize) {
    assert!(job.wait_all("READY", Duration::from_secs(60)));
    stopped_in_ready(job, n, victim);
}

/// [`stopped_in`], for a job whose ranks are ready.
fn stopped_in_ready(job: &mut LiveJob, n: usize, victim: usize) {
    std::thread::sleep(Duration::from_millis(200));
    let t = now_us();
    job.signal(victim, libc::SIGSTOP);
    let survivors: Vec<usize> = (0..n).filter(|r| *r != victim).collect();
    let exited = job.wait_exit(&survivors, Duration::from_secs(20));
    job.signal(victim, libc::SIGKILL);
    assert!(exited, "survivors hung on a stopped rank");
    for r in survivors {
        let line = job.line(r, "ERR ").expect("error line");
        let ts: u128 = line.split(' ').nth(1).and_then(|v| v.parse().ok()).unwrap();
        eprintln!("stopped rank {victim} named by rank {r} after {} ms", (ts - t) / 1000);
        assert!(ts - t < STOPPED_US, "rank {r} took {} ms", (ts - t) / 1000);
        assert!(line.contains(&format!("rank {victim}")), "rank {r}: {line}");
    }
}

#[test]
fn computing_longer_than_the_dead_peer_limit_is_not_death() {
    long_compute(&[]);
}

#[test]
fn computing_longer_than_the_dead_peer_limit_is_not_death_over_quic() {
    // Over QUIC the keep-alives of the computing rank come from its background driver thread.
    long_compute(&[("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")]);
}

fn long_compute(env: &[(&str, &str)]) {
    // Rank 0 sleeps 7 s (more than the 5 s dead-peer limit) before joining; the others wait in
    // the allreduce, hearing rank 0's keep-alives, and everyone succeeds.
    let mut job = LiveJob::start(Path::new(EXE), &["compute", "7"], 3, env);
    assert!(job.wait_exit(&[0, 1, 2], Duration::from_secs(60)));
    for r in 0..3 {
        assert!(job.line(r, "OK").is_some(), "rank {r}: {:?}", job.lines[r].lock().unwrap());
    }
}

#[test]
fn sigkill_over_quic_is_named_by_every_survivor() {
    // Every rank is the victim once, rank 0 included. Over QUIC a killed peer sends nothing (no
    // reset as over TCP); its host answers the next datagram sent to it (a keep-alive at most
    // 200 ms later) with "port unreachable", which the driver reads from the socket's error
    // queue. The bound is TCP's worst case, far below the 5 s dead-peer limit.
    let mut all = Vec::new();
    for victim in 0..4 {
        let env = [("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")];
        all.extend(kill_run(2000 + victim as u64, victim, &env));
    }
    all.sort_unstable();
    let worst = *all.last().unwrap();
    eprintln!("quic kill runs: 4, median detection {} us, worst {worst} us", all[all.len() / 2]);
    assert!(worst < 1_000_000, "worst detection over quic {worst} us");
}

#[test]
fn sigkill_over_tcp_alone_is_named_by_every_survivor() {
    // The same job with shared memory turned off: every rank is the victim once.
    let mut all = Vec::new();
    for victim in 0..4 {
        all.extend(kill_run(3000 + victim as u64, victim, &[("TUTTI_SHM", "0")]));
    }
    all.sort_unstable();
    let worst = *all.last().unwrap();
    eprintln!(
        "tcp-alone kill runs: 4, median detection {} us, worst {worst} us",
        all[all.len() / 2]
    );
    assert!(worst < 1_000_000, "worst detection over tcp alone {worst} us");
}

#[test]
fn sigkill_of_one_of_two_ranks_is_named() {
    // Over shared memory with 2 ranks: each is the victim in turn.
    let mut all = Vec::new();
    for run in 0..6u64 {
        all.extend(kill_run_of(2, 4000 + run, (run % 2) as usize, &[], &Rendezvous::Store));
    }
    all.sort_unstable();
    let worst = *all.last().unwrap();
    eprintln!("2-rank kill runs: 6, median detection {} us, worst {worst} us", all[all.len() / 2]);
    assert!(worst < 1_000_000, "worst detection with 2 ranks {worst} us");
}
