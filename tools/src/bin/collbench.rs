//! `collbench`: nccl-tests-style benchmark of tutti's collectives. See `collbench --help` and
//! docs/benchmarking.md.

fn main() -> std::process::ExitCode {
    tutti_tools::collbench::main()
}
