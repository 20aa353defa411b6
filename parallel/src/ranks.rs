//! Where the ranks come from: a launcher's environment, or threads in this process.

use tutti_collectives::Comm;

use crate::error::{Error, Result};

pub use tutti_runtime::launched;

/// Run `f` on every rank this process hosts and return their results in rank order: under a
/// launcher, one rank (this process's) from the environment; otherwise `threads` ranks as
/// threads over the in-memory transport. Examples and tools use it so the same binary runs
/// alone or under `tutti-run`.
///
/// # Errors
/// Rendezvous errors; the first error of a rank; a rank that panicked.
pub fn run_ranks<T: Send>(threads: usize, f: impl Fn(Comm) -> Result<T> + Sync) -> Result<Vec<T>> {
    if launched() {
        let c = Comm::from_env()?;
        return Ok(vec![f(c)?]);
    }
    run_threads(threads, f)
}

/// `threads` ranks as threads over the in-memory transport; results in rank order.
pub(crate) fn run_threads<T: Send>(
    threads: usize,
    f: impl Fn(Comm) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> =
            Comm::mem_world(threads.max(1)).into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Shape {
                        rank: r,
                        layer: "run_ranks",
                        detail: "the rank's thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    results.into_iter().collect()
}

/// `main` of the examples: ranks from a launcher or `--threads N` threads (default
/// `default_threads`); each rank returns whether its checks matched. Exit status 0 when every
/// rank matched, 1 otherwise or on an error (printed with `name`).
pub fn run_example(
    name: &str,
    default_threads: usize,
    f: impl Fn(Comm) -> Result<bool> + Sync,
) -> std::process::ExitCode {
    let threads = std::env::args()
        .skip_while(|a| a != "--threads")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_threads);
    match run_ranks(threads, f) {
        Ok(v) if v.iter().all(|ok| *ok) => std::process::ExitCode::SUCCESS,
        Ok(_) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("{name}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
