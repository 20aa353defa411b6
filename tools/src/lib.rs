//! tutti-tools: `collbench`, the nccl-tests-style benchmark, `tutti-run`, the launcher, and
//! (feature `cuda`) `gpucheck`, the GPU checks.

pub mod collbench;
#[cfg(feature = "cuda")]
pub mod gpucheck;
pub mod launch;
pub mod run;

/// Install a tracing subscriber filtered by `RUST_LOG` (default: warnings), writing to stderr.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
