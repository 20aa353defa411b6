//! `gpucheck`: the GPU checks that `tools/gpu-check.sh` runs (feature `cuda`). See
//! `gpucheck --help` and docs/gpu.md.

fn main() -> std::process::ExitCode {
    tutti_tools::gpucheck::main()
}
