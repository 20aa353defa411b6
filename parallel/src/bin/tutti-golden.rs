//! `tutti-golden`: run a PyTorch golden case under a parallel strategy (see
//! `tutti_parallel::golden`).

fn main() -> std::process::ExitCode {
    tutti_parallel::golden::main()
}
