//! Reduction kernel against memcpy on the same buffers, in the same run: `a += b` over 64 MiB
//! of f32 (and the other dtypes), medians of several repetitions.
//!
//! `cargo bench -p tutti-collectives --bench kernel`

use std::time::Instant;

use tutti_collectives::kernel::reduce_into;
use tutti_collectives::{DType, ReduceOp};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let bytes = 64 << 20;
    let reps = 9;
    let mut a = vec![1u8; bytes];
    let b = vec![0u8; bytes];
    // b stays zero: `a += 0` keeps a's values, so every repetition sees the same numbers.
    // Touch everything once.
    a.copy_from_slice(&b);
    let mut copy = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        a.copy_from_slice(std::hint::black_box(&b));
        copy.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let copy = median(copy);
    println!("64 MiB, medians of {reps}; bandwidth counts the bytes of the destination");
    println!("{:<10} {:>10} {:>12}", "kernel", "GB/s", "vs memcpy");
    println!("{:<10} {:>10.2} {:>11.0}%", "memcpy", copy, 100.0);
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I8] {
        // Ordinary values (1.0 in the dtype's encoding, little-endian), not bit patterns that
        // happen to be tiny or special numbers.
        let one: &[u8] = match dt {
            DType::F32 => &[0, 0, 0x80, 0x3f],
            DType::F64 => &[0, 0, 0, 0, 0, 0, 0xf0, 0x3f],
            DType::BF16 => &[0x80, 0x3f],
            DType::F16 => &[0x00, 0x3c],
            _ => &[1],
        };
        for (i, x) in a.iter_mut().enumerate() {
            *x = one[i % one.len()];
        }
        let mut v = Vec::new();
        for _ in 0..reps {
            let t = Instant::now();
            reduce_into(dt, ReduceOp::Sum, &mut a, std::hint::black_box(&b));
            v.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        let g = median(v);
        println!("{:<10} {:>10.2} {:>11.0}%", format!("{}+=", dt.name()), g, 100.0 * g / copy);
    }
}
