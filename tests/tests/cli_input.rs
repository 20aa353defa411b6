//! The first ten minutes of collbench and tutti-run, as processes: bad input is refused with a
//! message naming the flag or variable and what is allowed (exit 2, never 0 without having
//! measured); a flag that wins over a variable says so; a closed stdout (`| head`) ends them
//! quietly with the broken-pipe status; `--help` has the tool's own description, examples and
//! variables; logs carry colour codes only on a terminal, and never with `NO_COLOR`; the
//! README's example prints an error's message, not its debug form.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use tutti_tests::run_with_deadline;

const BENCH: &str = env!("CARGO_BIN_EXE_tt-collbench");
const RUN: &str = env!("CARGO_BIN_EXE_tt-run");
const LIMIT: Duration = Duration::from_secs(120);

/// A command with none of the launcher variables this test process might have inherited.
fn cmd(prog: &str, args: &[&str]) -> Command {
    let mut c = Command::new(prog);
    c.args(args);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TUTTI_STORE",
        "TUTTI_TOKEN",
        "TUTTI_TRANSPORT",
        "TUTTI_ALGO",
        "TUTTI_TIMEOUT",
        "NO_COLOR",
        "RUST_LOG",
    ] {
        c.env_remove(k);
    }
    c
}

fn run(c: Command) -> Output {
    let (out, killed) = run_with_deadline(c, LIMIT);
    assert!(!killed, "did not end within {LIMIT:?}:\n{}", text(&out));
    out
}

fn text(o: &Output) -> String {
    tutti_tests::describe(o)
}

/// `prog args` is refused: exit 2, nothing measured, and stderr contains every one of `words`.
fn refused(c: Command, words: &[&str]) {
    let out = run(c);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("Avg bus bandwidth"), "{}", text(&out));
    for w in words {
        assert!(err.contains(w), "the message should name {w:?}:\n{}", text(&out));
    }
}

#[test]
fn collbench_refuses_bad_flags_naming_them() {
    refused(cmd(BENCH, &["--np", "0"]), &["--np 0", "1 to 1024"]);
    refused(cmd(BENCH, &["-b", "8", "-e", "4"]), &["-b", "-e", "8", "4"]);
    refused(cmd(BENCH, &["-b", "8", "-e", "64", "-f", "1"]), &["-f 1", "at least 2"]);
    refused(cmd(BENCH, &["-b", "8", "-e", "64", "-f", "0"]), &["-f 0", "at least 2"]);
    refused(cmd(BENCH, &["-b", "8", "-e", "64", "-i", "0"]), &["-i 0"]);
    refused(cmd(BENCH, &["--transport", "carrier-pigeon"]), &["--transport", "tcp, quic or mem"]);
    refused(cmd(BENCH, &["barrier", "--min-bw", "1"]), &["--min-bw", "barrier"]);
    refused(cmd(BENCH, &["--device", "sim", "sendrecv"]), &["--device sim", "sendrecv"]);
    refused(cmd(BENCH, &["allreduce", "-d", "float128"]), &["float128", "choose from"]);
    refused(cmd(BENCH, &["--np", "100000"]), &["--np 100000", "1 to 1024", "tutti-run"]);
    refused(cmd(BENCH, &["-m", "0"]), &["--agg_iters"]);
    refused(cmd(BENCH, &["-a", "7"]), &["--average"]);
    refused(cmd(BENCH, &["allreduce", "--algo", "teleport"]), &["teleport", "ring", "bruck"]);
    refused(cmd(BENCH, &["broadcast", "--algo", "ring"]), &["--algo ring", "broadcast", "chain"]);
    refused(cmd(BENCH, &["broadcast", "--np", "4", "-r", "4"]), &["-r 4", "0 to 3"]);
    refused(cmd(BENCH, &["allgather", "--np", "3", "--algo", "rd"]), &["--algo", "power-of-two"]);
    refused(
        cmd(BENCH, &["allreduce", "-J", "/nonexistent/dir/out.json"]),
        &["-J /nonexistent/dir/out.json", "cannot write"],
    );
    refused(cmd(BENCH, &["allreduce", "--plot", "/nonexistent/x.svg"]), &["--plot"]);
}

#[test]
fn an_algorithm_forced_on_all_runs_the_collectives_it_implements() {
    let out = run(cmd(
        BENCH,
        &["all", "--algo", "ring", "-b", "8", "-e", "64", "-f", "8", "-n", "1", "--np", "3"],
    ));
    assert!(out.status.success(), "{}", text(&out));
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(so.contains("ring") && !so.contains("broadcast"), "{}", text(&out));
}

#[test]
fn variables_a_launcher_owns_do_not_leak_into_its_ranks() {
    // A leftover TUTTI_JOIN=1 would make every rank wait to be taken into a running job.
    for prog in [&[RUN, "--nproc", "2", "--", BENCH][..], &[BENCH][..]] {
        let mut c = cmd(prog[0], &prog[1..]);
        c.args(["allreduce", "-b", "8", "-e", "8", "-n", "1", "--np", "2"]).env("TUTTI_JOIN", "1");
        let out = run(c);
        assert!(out.status.success(), "{prog:?} with TUTTI_JOIN=1:\n{}", text(&out));
    }
    // TUTTI_TOKEN_FILE is read as --token-file is, and not handed on beside the launcher's
    // own TUTTI_TOKEN.
    let dir = std::env::temp_dir().join(format!("tutti-cli-tf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("token");
    std::fs::write(&f, "0123456789abcdef0123\n").unwrap();
    std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    for prog in [&[RUN, "--nproc", "2", "--", BENCH][..], &[BENCH][..]] {
        let mut c = cmd(prog[0], &prog[1..]);
        c.args(["allreduce", "-b", "8", "-e", "8", "-n", "1", "--np", "2"])
            .env("TUTTI_TOKEN_FILE", &f);
        let out = run(c);
        assert!(out.status.success(), "{prog:?} with TUTTI_TOKEN_FILE:\n{}", text(&out));
    }
    let mut c = cmd(RUN, &["--nproc", "1", "--", "true"]);
    c.env("TUTTI_TOKEN_FILE", &f).env("TUTTI_TOKEN", "0123456789abcdef0123");
    refused(c, &["more than once"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_launcher_collbench_starts_is_named_collbench() {
    // The ranks fail once started (this build has no CUDA): whoever reports the failed rank is
    // collbench, never a tutti-run the user did not run.
    let out =
        run(cmd(BENCH, &["allreduce", "--np", "2", "-b", "8", "-e", "8", "--device", "cuda"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(err.contains("collbench: rank") && err.contains("cuda"), "{}", text(&out));
    assert!(!err.contains("tutti-run"), "{}", text(&out));
    // A malformed variable under a launcher is bad input too.
    let mut c = cmd(RUN, &["--nproc", "2", "--", BENCH, "allreduce", "-b", "8", "-e", "8"]);
    c.env("TUTTI_TRANSPORT", "pigeon");
    let out = run(c);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("TUTTI_TRANSPORT"), "{}", text(&out));
}

#[test]
fn collbench_refuses_bad_variables_in_np_mode() {
    for transport in ["tcp", "mem"] {
        let mut c = cmd(BENCH, &["allreduce", "--np", "2", "--transport", transport]);
        c.env("TUTTI_ALGO", "allreduce:teleport");
        refused(c, &["TUTTI_ALGO"]);
        let mut c = cmd(BENCH, &["allreduce", "--np", "2", "--transport", transport]);
        c.env("TUTTI_TIMEOUT", "soon");
        refused(c, &["TUTTI_TIMEOUT"]);
    }
    // With no --transport the variable chooses, so a bad one is refused rather than ignored.
    let mut c = cmd(BENCH, &["allreduce", "--np", "2"]);
    c.env("TUTTI_TRANSPORT", "carrier-pigeon");
    refused(c, &["TUTTI_TRANSPORT", "carrier-pigeon", "tcp or quic"]);
}

#[test]
fn a_flag_that_wins_over_a_variable_says_so_and_the_run_measures() {
    let mut c = cmd(
        BENCH,
        &[
            "allreduce",
            "-b",
            "8",
            "-e",
            "64",
            "-f",
            "8",
            "-n",
            "2",
            "--np",
            "2",
            "--transport",
            "mem",
        ],
    );
    c.env("TUTTI_TRANSPORT", "tcp").env("TUTTI_TIMEOUT", "20");
    c.args(["-T", "30"]);
    let out = run(c);
    assert!(out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--transport mem wins over TUTTI_TRANSPORT=tcp"), "{}", text(&out));
    assert!(err.contains("-T 30 wins over TUTTI_TIMEOUT=20"), "{}", text(&out));
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(so.contains("transport mem") && so.contains("Out of bounds values : 0 OK"), "{so}");
}

#[test]
fn under_a_launcher_a_disagreeing_np_or_transport_is_refused() {
    let out = run(cmd(RUN, &["--nproc", "2", "--", BENCH, "allreduce", "--np", "3"]));
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--np 3") && err.contains("2 ranks"), "{}", text(&out));
    let out = run(cmd(RUN, &["--nproc", "2", "--", BENCH, "allreduce", "--transport", "quic"]));
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--transport quic") && err.contains("TUTTI_TRANSPORT"), "{}", text(&out));
    // Agreeing flags are fine.
    let out = run(cmd(
        RUN,
        &["--nproc", "2", "--", BENCH, "allreduce", "-b", "8", "-e", "8", "-n", "1", "--np", "2"],
    ));
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn tutti_run_refuses_bad_flags_naming_them() {
    refused(cmd(RUN, &["--nproc", "0", "--", "true"]), &["--nproc", "1..="]);
    refused(cmd(RUN, &["--nnodes", "0", "--", "true"]), &["--nnodes"]);
    refused(cmd(RUN, &["--nnodes", "2", "--node-rank", "2", "--", "true"]), &["--node-rank 2"]);
    refused(cmd(RUN, &["--nnodes", "2", "--", "true"]), &["--master-port"]);
    refused(cmd(RUN, &["--max-restarts", "1", "--", "true"]), &["--max-restarts", "--elastic"]);
    refused(cmd(RUN, &["--grace", "-1", "--", "true"]), &["--grace", "0 to 3600"]);
    let dir = std::env::temp_dir().join(format!("tutti-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("token");
    std::fs::write(&f, "0123456789abcdef0123").unwrap();
    let mut c = cmd(RUN, &["--token-file", f.to_str().unwrap(), "--", "true"]);
    c.env("TUTTI_TOKEN", "0123456789abcdef0123");
    refused(c, &["--token-file", "TUTTI_TOKEN"]);
    let _ = std::fs::remove_dir_all(&dir);
    // A program that does not exist is named.
    let out = run(cmd(RUN, &["--", "/nonexistent/tutti-program"]));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/tutti-program"));
}

/// Start `c`, read its first line of output, close the pipe, and return how it ended and what
/// it wrote on stderr.
fn head_one(mut c: Command) -> (std::process::ExitStatus, String) {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn");
    let mut first = String::new();
    {
        let mut r = BufReader::new(child.stdout.take().expect("stdout"));
        r.read_line(&mut first).expect("first line");
        // `r` drops here: the pipe's only reader is gone, as when `head -1` exits.
    }
    assert!(!first.is_empty(), "no output at all");
    let mut err = child.stderr.take().expect("stderr");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(start.elapsed() < LIMIT, "still running {LIMIT:?} after its output was closed");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut e = String::new();
    std::io::Read::read_to_string(&mut err, &mut e).expect("stderr");
    (status, e)
}

#[test]
fn a_closed_stdout_ends_them_quietly_with_the_broken_pipe_status() {
    let sweep = ["allreduce", "-b", "8", "-e", "64M", "-f", "2", "-n", "5"];
    // The benchmark as its own launcher (processes over TCP, and threads over memory).
    for t in ["tcp", "mem"] {
        let mut c = cmd(BENCH, &sweep);
        c.args(["--np", "4", "--transport", t]);
        let (st, err) = head_one(c);
        assert!(
            st.signal() == Some(libc::SIGPIPE) || st.code() == Some(141),
            "{t}: ended {st:?}, stderr:\n{err}"
        );
        assert!(err.trim().is_empty(), "{t}: a closed stdout is not an error, but said:\n{err}");
    }
    // Under tutti-run, whose output the ranks' lines go through.
    let mut c = cmd(RUN, &["--nproc", "3", "--", BENCH]);
    c.args(sweep);
    let (st, err) = head_one(c);
    assert_eq!(st.code(), Some(141), "tutti-run ended {st:?}, stderr:\n{err}");
    assert!(err.trim().is_empty(), "tutti-run: a closed stdout is not an error, but said:\n{err}");
}

#[test]
fn help_has_the_tools_own_description_examples_and_variables() {
    for (prog, first, words) in [
        (
            BENCH,
            "collbench: nccl-tests-style benchmark",
            &["Examples:", "tutti-run --nproc", "RANK", "TUTTI_TRANSPORT", "--np", "README"][..],
        ),
        (
            RUN,
            "tutti-run: start the ranks of a tutti job",
            &[
                "Examples:",
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "TUTTI_STORE",
                "MASTER_PORT (the store's port + 1",
                "TUTTI_LAUNCHER_FD",
                "TUTTI_TOKEN",
                "NO_COLOR",
                "README",
            ][..],
        ),
    ] {
        let out = run(cmd(prog, &["--help"]));
        assert!(out.status.success(), "{}", text(&out));
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.starts_with(first), "{prog} --help starts:\n{help}");
        for w in words {
            assert!(help.contains(w), "{prog} --help lacks {w:?}:\n{help}");
        }
        let examples =
            help.matches("\n  tutti-run ").count() + help.matches("\n  collbench").count();
        assert!(examples >= 2, "{prog} --help has {examples} examples:\n{help}");
    }
    let out = run(cmd(BENCH, &["--help"]));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--json <FILE>") && help.contains("--plot <FILE>"), "{help}");
}

fn has_colour(s: &[u8]) -> bool {
    s.windows(2).any(|w| w == b"\x1b[")
}

#[test]
fn logs_are_coloured_only_on_a_terminal_and_never_with_no_color() {
    let args = ["allreduce", "-b", "8", "-e", "8", "-n", "1", "--np", "2", "--transport", "mem"];
    // To a pipe (a file under srun, a log collector): plain.
    let mut c = cmd(BENCH, &args);
    c.env("RUST_LOG", "debug");
    let out = run(c);
    assert!(out.status.success(), "{}", text(&out));
    assert!(out.stderr.len() > 100, "RUST_LOG=debug should log:\n{}", text(&out));
    assert!(!has_colour(&out.stderr), "colour codes in a pipe:\n{}", text(&out));
    // On a terminal (`script` gives the program a pseudo-terminal): coloured, unless NO_COLOR.
    let line = format!("{BENCH} {}", args.join(" "));
    let on_tty = |no_color: Option<&str>| {
        let mut c = cmd("script", &["-qec", &line, "/dev/null"]);
        c.env("RUST_LOG", "debug");
        if let Some(v) = no_color {
            c.env("NO_COLOR", v);
        }
        let out = run(c);
        assert!(out.status.success(), "{}", text(&out));
        assert!(String::from_utf8_lossy(&out.stdout).contains("DEBUG"), "{}", text(&out));
        has_colour(&out.stdout)
    };
    assert!(on_tty(None), "no colour on a terminal");
    assert!(!on_tty(Some("1")), "colour on a terminal with NO_COLOR=1");
    assert!(on_tty(Some("")), "an empty NO_COLOR means unset (no-color.org)");
}

#[test]
fn the_readme_example_prints_an_errors_message_not_its_debug_form() {
    let ex = tutti_tests::example("ten_lines");
    let out = run(cmd(ex.to_str().unwrap(), &[]));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no rank information") && err.contains("tutti-run"), "{err}");
    assert!(!err.contains("Config(") && !err.contains("Runtime("), "the debug form:\n{err}");
    // And under the launcher it runs as the README shows.
    let out = run(cmd(RUN, &["--nproc", "4", "--", ex.to_str().unwrap()]));
    assert!(out.status.success(), "{}", text(&out));
    let so = String::from_utf8_lossy(&out.stdout);
    for r in 0..4 {
        assert!(so.contains(&format!("rank {r} of 4: 1.5 via")), "{so}");
    }
}
