//! `tutti-golden` built inside the test package, so integration tests can find it.

fn main() -> std::process::ExitCode {
    tutti_parallel::golden::main()
}
