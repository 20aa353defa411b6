//! collbench: a small sweep of every collective, verified, parseable, with valid JSON.

use std::process::Command;
use std::time::Duration;

use tutti_tests::run_with_deadline;

/// Data rows: lines that do not start with '#'.
fn rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

fn smoke(transport: &str, np: usize) {
    let dir =
        std::env::temp_dir().join(format!("collbench-smoke-{transport}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let svg = dir.join("out.svg");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args([
        "all",
        "-b",
        "8",
        "-e",
        "256K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "-c",
        "1",
        "--np",
        &np.to_string(),
        "--transport",
        transport,
    ]);
    cmd.arg("-J").arg(&json).arg("--plot").arg(&svg);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!killed, "collbench hung:\n{text}");
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    // Every data row has nccl-tests' 13 columns; #wrong (4th from the end and last) is 0;
    // busbw is the 6th field from the end (how superbench reads it).
    let rs = rows(&text);
    assert!(rs.len() >= 9 * 3, "too few rows:\n{text}");
    for r in &rs {
        assert_eq!(r.len(), 13, "row {r:?}");
        assert_eq!(r[r.len() - 1], "0", "in-place #wrong in {r:?}");
        assert_eq!(r[r.len() - 5], "0", "out-of-place #wrong in {r:?}");
        let busbw: f64 = r[r.len() - 6].parse().unwrap();
        assert!(busbw >= 0.0);
    }
    for name in tutti_tools::collbench::COLLECTIVES {
        assert!(text.contains(&format!("# Collective test concluded: {name}")), "{name} missing");
    }
    assert_eq!(text.matches("# Out of bounds values : 0 OK").count(), 10);
    // The last field of "# Avg bus bandwidth" parses.
    for l in text.lines().filter(|l| l.starts_with("# Avg bus bandwidth")) {
        l.split_whitespace().last().unwrap().parse::<f64>().unwrap();
    }
    // JSON shape.
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 10);
    for run in runs {
        for k in ["collective", "transport", "dtype", "op"] {
            assert!(run[k].is_string(), "{k} in {run}");
        }
        assert_eq!(run["nranks"].as_u64(), Some(np as u64));
        for row in run["rows"].as_array().unwrap() {
            for k in ["bytes", "count", "root"] {
                assert!(row[k].is_number(), "{k} in {row}");
            }
            assert!(row["algo"].is_string());
            for m in ["oop", "ip"] {
                for k in ["time_us", "algbw", "busbw", "wrong"] {
                    assert!(row[m][k].is_number(), "{m}.{k} in {row}");
                }
                assert_eq!(row[m]["wrong"].as_u64(), Some(0));
            }
            assert!(row["p50_us"].is_number() && row["p99_us"].is_number());
            for m in ["oop", "ip"] {
                assert!(row[m]["p50_us"].is_number() && row[m]["p99_us"].is_number(), "{row}");
            }
        }
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("allreduce"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn collbench_all_tcp_three_ranks() {
    smoke("tcp", 3);
}

#[test]
fn collbench_all_mem_four_ranks() {
    smoke("mem", 4);
}

#[test]
fn every_nccl_tests_flag_is_accepted() {
    // What cluster scripts pass to nccl-tests: accepted, the inert ones named in the header,
    // and -N repeats the sweep.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args(["allreduce", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "-c", "1"]);
    cmd.args(["-t", "1", "-g", "1", "-p", "1", "-z", "1", "-G", "1", "-C", "1", "-R", "1"]);
    cmd.args(["-K", "1", "-M", "1", "-u", "1", "-S", "1", "-N", "2", "-a", "3", "-I", "1"]);
    cmd.args(["-T", "30", "--np", "2", "--transport", "mem"]);
    let (out, _) = run_with_deadline(cmd, Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let inert = text.lines().find(|l| l.contains("accepted without effect")).unwrap_or("");
    for f in ["-p", "-z 1", "-G", "-C", "-R", "-K", "-M", "-u", "-S"] {
        assert!(inert.contains(&format!("{f} (")), "{f} not explained: {inert}");
    }
    assert!(text.contains("# cycle 2 of 2"), "{text}");
    assert_eq!(text.matches("# Out of bounds values : 0 OK").count(), 2, "{text}");
}

#[test]
fn min_bw_fails_the_run() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args([
        "allreduce",
        "-b",
        "1K",
        "-e",
        "1K",
        "-n",
        "2",
        "--np",
        "2",
        "--transport",
        "mem",
        "--min-bw",
        "100000",
    ]);
    let (out, _) = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("below --min-bw"));
}

#[test]
fn device_sim_is_staged_verified_and_reports_overlap() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args([
        "all", "-b", "1K", "-e", "4M", "-f", "64", "-n", "2", "-w", "1", "--np", "2", "--device",
        "sim",
    ]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!killed, "collbench hung:\n{text}");
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let rs = rows(&text);
    // allreduce, allgather, reduce_scatter, alltoall, broadcast, reduce x 3 sizes; nothing else
    // on a device.
    assert_eq!(rs.len(), 6 * 3, "{text}");
    for r in &rs {
        assert_eq!(r[r.len() - 1], "0", "in-place #wrong in {r:?}");
        assert_eq!(r[r.len() - 5], "0", "out-of-place #wrong in {r:?}");
    }
    assert!(text.contains("staged:"), "algorithm column names the staged path:\n{text}");
    assert!(
        text.contains("allreduce on sim: ")
            && text.contains("% of the copy time ran while a segment was on the network"),
        "{text}"
    );
}

/// Run collbench with `args` and the variable `key` = `value`: one row, verified in both modes;
/// its stdout.
fn one_verified_row(args: &[&str], key: &str, value: &str) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args(args).env(key, value);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(120));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!killed, "collbench hung:\n{text}");
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let rs = rows(&text);
    assert_eq!(rs.len(), 1, "{text}");
    assert!(rs[0][rs[0].len() - 1] == "0" && rs[0][rs[0].len() - 5] == "0", "{text}");
    text
}

/// Run collbench with `args` and the variable `key` = `value`: it fails, saying `why`.
fn refused(args: &[&str], key: &str, value: &str, why: &str) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args(args).env(key, value);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!killed && !out.status.success(), "{err}");
    assert!(err.contains(why), "{err}");
}

#[test]
fn staged_piece_settings_are_taken_from_the_environment_and_a_bad_one_is_named() {
    // 0 (the choice by the group) and an explicit count both run and verify; a word is refused
    // with the variable's name.
    let args = ["allreduce", "-b", "1M", "-e", "1M", "-n", "2", "--np", "2", "--device", "sim"];
    for pieces in ["0", "3"] {
        one_verified_row(&args, "TUTTI_STAGE_PIECES", pieces);
    }
    let why = "TUTTI_STAGE_PIECES=\"many\" is not a non-negative integer";
    refused(&args, "TUTTI_STAGE_PIECES", "many", why);
}

#[test]
fn large_all_to_alls_and_all_gathers_of_processes_verify_with_single_copies_on_and_off() {
    // 4 processes on one host: 4 MiB runs by direct reads, its out-of-place blocks by single
    // copy, where the kernel allows it; with 0 the first call's set-up tells every rank that
    // the group makes none, and the later calls take messages. collbench checks every element
    // of both. A word is refused with the variable's name.
    // (Yama's ptrace_scope of 1 or more refuses them between sibling processes: then neither
    // run makes single copies.)
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .is_ok_and(|s| s.trim() != "0");
    // The same for an all-gather of 2 processes at 16 MiB, whose blocks go by single copy in
    // place and out of place (else recursive doubling's messages).
    let a2a = ["alltoall", "-b", "4M", "-e", "4M", "-n", "3", "-w", "1", "--np", "4"];
    let ag = ["allgather", "-b", "16M", "-e", "16M", "-n", "3", "-w", "1", "--np", "2"];
    for (args, messages) in [(a2a, "pairwise"), (ag, "rd")] {
        let with = if yama { messages } else { "direct" };
        for (single, algo) in [("1", with), ("0", messages)] {
            let text = one_verified_row(&args, "TUTTI_SINGLE_COPY", single);
            let extras = text.split("collbench extras").nth(1).unwrap_or_default();
            assert!(extras.contains(algo), "{text}");
        }
    }
    let args = a2a;
    let why = "TUTTI_SINGLE_COPY=\"yes\": expected 1 or 0";
    refused(&args, "TUTTI_SINGLE_COPY", "yes", why);
}

#[test]
fn device_cuda_without_a_gpu_fails_with_the_reason() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args(["allreduce", "-b", "1K", "-e", "1K", "-n", "1", "--np", "2", "--device", "cuda"]);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!killed);
    if out.status.success() {
        // A machine with a GPU and a `cuda` build: nothing to check here.
        return;
    }
    assert!(err.contains("CUDA unavailable"), "{err}");
}

#[test]
fn isolated_mode_times_single_calls_and_still_verifies() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args(["broadcast", "-b", "8", "-e", "64K", "-f", "64", "-n", "5", "-w", "1", "-c", "1"]);
    cmd.args(["--isolated", "--np", "3", "--transport", "mem"]);
    let (out, _) = run_with_deadline(cmd, Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("# isolated: a barrier before every timed iteration"), "{text}");
    let r = rows(&text);
    assert_eq!(r.len(), 3, "one row per size: {text}");
    for row in &r {
        // Both modes verified, nothing wrong.
        assert_eq!((row[8].as_str(), row[12].as_str()), ("0", "0"), "{row:?}");
    }
}

/// The header names every rank's CPUs and, per kind of link, the peers behind it: 3 ranks over
/// TCP alone have 2 TCP links each, to the two others, and bound with `--bind core` each runs
/// on one CPU.
#[test]
fn the_header_names_each_ranks_cpus_and_the_peers_of_each_link() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-collbench"));
    cmd.args(["allreduce", "-b", "8", "-e", "8", "-n", "3", "-w", "1", "--np", "3"]);
    cmd.args(["--bind", "core"]).env("TUTTI_SHM", "0");
    let (out, _) = run_with_deadline(cmd, Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let others = ["1-2", "0,2", "0-1"];
    for (r, peers) in others.iter().enumerate() {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("#  Rank {r:>2} Group")))
            .unwrap_or_else(|| panic!("no device line for rank {r}:\n{text}"));
        assert!(line.contains(&format!("links: 2 tcp ({peers})")), "{line}");
        assert!(line.contains(" cpu "), "rank {r} is not on one CPU: {line}");
    }
}
