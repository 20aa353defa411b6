//! `tutti-run --bind`: each local rank runs on a CPU of its own (wrapping around when there are
//! more ranks than CPUs), and where none shares its CPU it learns how many CPUs the node's ranks
//! share (`TUTTI_HOST_CPUS`), so its waits still spin; without binding the ranks run on every
//! CPU the launcher may use.

use std::process::Command;
use std::time::Duration;

use tutti_tests::run_with_deadline;

/// The CPUs this test may use (from the kernel's view of this process).
fn my_cpus() -> String {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string()
}

/// Each rank's `Cpus_allowed_list` and `TUTTI_HOST_CPUS`, by rank, from a job of `n` ranks.
fn placements(n: usize, bind: Option<&str>) -> Vec<String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nproc", &n.to_string()]);
    if let Some(b) = bind {
        cmd.args(["--bind", b]);
    }
    cmd.args([
        "--",
        "sh",
        "-c",
        r#"echo "AT $RANK $(grep Cpus_allowed_list /proc/self/status | cut -f2) ${TUTTI_HOST_CPUS:--}""#,
    ]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!killed && out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    (0..n)
        .map(|r| {
            text.lines()
                .find_map(|l| l.split_once(&format!("AT {r} ")).map(|x| x.1.trim().to_string()))
                .unwrap_or_else(|| panic!("rank {r} printed nothing:\n{text}"))
        })
        .collect()
}

/// A kernel CPU list (`0-3,5`) as numbers.
fn parse_list(l: &str) -> Vec<usize> {
    l.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().unwrap()..=b.parse().unwrap()).collect::<Vec<_>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

#[test]
fn bound_ranks_run_on_a_cpu_each_and_know_how_many_the_node_shares() {
    let mine = my_cpus();
    let mut cpus = parse_list(&mine);
    let k = cpus.len();
    // One more rank than CPUs: `core` wraps around (every CPU once, then rank k on rank 0's),
    // and since ranks then share a CPU, it does not tell them they may spin.
    let got = placements(k + 1, Some("core"));
    let mut used: Vec<usize> = got[..k]
        .iter()
        .map(|at| {
            let (cpu, host) = at.split_once(' ').unwrap();
            assert_eq!(host, "-", "{got:?}");
            cpu.parse().unwrap_or_else(|_| panic!("not bound to one CPU: {got:?}"))
        })
        .collect();
    assert_eq!(got[k], got[0], "rank {k} wraps around to rank 0's CPU");
    used.sort_unstable();
    cpus.sort_unstable();
    assert_eq!(used, cpus, "each CPU once: {got:?}");
    for bind in [Some("auto"), Some("none"), None] {
        for (r, at) in placements(k + 1, bind).iter().enumerate() {
            assert_eq!(*at, format!("{mine} -"), "rank {r} with --bind {bind:?}");
        }
    }
    // As many ranks as CPUs: `auto` binds one to each, and tells them how many.
    let got = placements(k, Some("auto"));
    let mut used: Vec<usize> = got
        .iter()
        .map(|at| {
            assert!(at.ends_with(&format!(" {k}")), "{got:?}");
            at.split(' ').next().unwrap().parse().unwrap()
        })
        .collect();
    used.sort_unstable();
    assert_eq!(used, cpus, "each CPU once: {got:?}");
}
