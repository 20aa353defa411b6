//! tutti-tools: `collbench`, the nccl-tests-style benchmark, `tutti-run`, the launcher, and
//! (feature `cuda`) `gpucheck`, the GPU checks.

use std::io::{IsTerminal, Write};

pub mod collbench;
#[cfg(feature = "cuda")]
pub mod gpucheck;
pub mod launch;
pub mod run;

/// Install a tracing subscriber filtered by `RUST_LOG` (default: warnings), writing to stderr,
/// in colour only when stderr is a terminal and `NO_COLOR` is unset or empty
/// ([`colour_wanted`]); nothing is written once stdout's reader has gone ([`stdout_closed`]).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let ansi = colour_wanted(std::io::stderr().is_terminal());
    // Once standard output's reader has gone (`collbench | head`) the job is ending for that
    // reason, and what the ranks log about their peers ending is not news: it is dropped.
    let writer = || -> Box<dyn Write> {
        if stdout_closed() {
            Box::new(std::io::sink())
        } else {
            Box::new(std::io::stderr())
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer)
        .try_init();
}

/// Whether to write terminal colour codes to a stream: only to a terminal (`is_terminal`), and
/// never when `NO_COLOR` is set to a non-empty value (the no-color.org convention) or `TERM` is
/// `dumb`. Output that goes to a file or a pipe (srun, a log collector) stays plain text.
pub fn colour_wanted(is_terminal: bool) -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
    is_terminal && !no_color && !dumb
}

/// Write to stdout, unbuffered by lines. When stdout has been closed by its reader (`collbench |
/// head`), the process ends as Unix tools do: quietly, killed by SIGPIPE (exit status 141 in a
/// shell), never with a panic. Other write errors (a full disk) are reported once on stderr and
/// end the process with status 1: a benchmark whose results were lost has not succeeded.
pub fn print_out(args: std::fmt::Arguments<'_>) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_fmt(args).and_then(|()| o.flush()) {
        drop(o);
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            die_of_sigpipe();
        }
        eprintln!("cannot write to standard output: {e}");
        std::process::exit(1);
    }
}

/// End this process by SIGPIPE, the way a Unix tool whose output's reader went away ends (Rust
/// ignores SIGPIPE, so the default action is restored first).
pub fn die_of_sigpipe() -> ! {
    // SAFETY: restoring a signal's default action and raising it; no handler runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    // Not reached: SIGPIPE's default action ends the process.
    std::process::exit(128 + libc::SIGPIPE)
}

/// True when standard output is a pipe whose reader has gone (`collbench | head` after `head`
/// ended): what this process would write there is lost, and it should end quietly (a rank whose
/// peer ended that way says nothing either).
pub fn stdout_closed() -> bool {
    let mut p = libc::pollfd { fd: libc::STDOUT_FILENO, events: 0, revents: 0 };
    // SAFETY: one pollfd, zero timeout; POLLERR is reported on a pipe's write end once its
    // read end is closed.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & libc::POLLERR != 0
}

/// `println!` through [`print_out`].
#[macro_export]
macro_rules! outln {
    () => { $crate::print_out(format_args!("\n")) };
    ($($t:tt)*) => { $crate::print_out(format_args!("{}\n", format_args!($($t)*))) };
}

/// `print!` through [`print_out`].
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::print_out(format_args!($($t)*)) };
}
