//! The README's "Ten lines": run it with `tutti-run --nproc 4 -- target/release/examples/ten_lines`.
use std::process::ExitCode;

use tutti_collectives::{Comm, Error, ReduceOp};

fn run() -> Result<(), Error> {
    // Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (tutti-run, torchrun, srun, mpirun).
    let comm = Comm::from_env()?;
    let mut grads = vec![comm.rank() as f32; 1 << 20];
    let stats = comm.allreduce(&mut grads, ReduceOp::Avg)?;
    println!("rank {} of {}: {} via {}", comm.rank(), comm.size(), grads[0], stats.algo);
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The message: which rank, what failed, what to do.
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
