//! `tutti-run`: start a job's local ranks, torchrun style. See `tutti-run --help`.

fn main() -> std::process::ExitCode {
    tutti_tools::run::main()
}
