//! Hand-written reductions, one table per dtype: inputs per rank and the expected result worked
//! out by hand (wrapping for integers, one rounding to nearest even for floats, `Avg` truncated
//! toward zero for integers). The inputs are chosen so that any reduction order gives the same
//! bits: two ranks where a rounding happens, exact partial results where three ranks take part.

use crate::common::*;
use half::{bf16, f16};
use tutti_collectives::{Comm, Element, ReduceOp};

/// Every rank contributes `inputs[rank]` (one element); every algorithm must produce `want`.
fn case<T: Element + std::fmt::Debug>(inputs: &[T], op: ReduceOp, want: T, what: &str) {
    world(inputs.len(), 256, |c: Comm| {
        for algo in allreduce_algos(&c) {
            let mut b = vec![inputs[c.rank()]; 3];
            c.with_algo(algo).allreduce(&mut b, op).unwrap();
            assert!(same_bits(&b, &[want; 3]), "{what} {op} {algo}: {:?}, want {want:?}", b[0]);
        }
        let mut b = vec![inputs[c.rank()]];
        c.reduce(&mut b, op, inputs.len() - 1).unwrap();
        if c.rank() == inputs.len() - 1 {
            assert!(same_bits(&b, &[want]), "{what} {op} reduce: {:?}, want {want:?}", b[0]);
        }
    });
}

#[test]
fn integers_wrap_and_truncate() {
    use ReduceOp::*;
    for (op, want) in [(Sum, -63), (Prod, -112), (Min, -7), (Max, 100), (Avg, -21)] {
        case::<i8>(&[100, 100, -7], op, want, "i8");
    }
    // u8 compares unsigned and wraps modulo 256.
    for (op, want) in [(Sum, 45), (Prod, 32), (Min, 1), (Max, 200), (Avg, 15)] {
        case::<u8>(&[200, 100, 1], op, want, "u8");
    }
    let g = 1 << 30;
    for (op, want) in [(Sum, -1_073_741_824), (Prod, 0), (Min, g), (Max, g), (Avg, -357_913_941)] {
        case::<i32>(&[g, g, g], op, want, "i32");
    }
    let m = i64::MAX;
    for (op, want) in
        [(Sum, m - 2), (Prod, -m + 2), (Min, -3), (Max, m), (Avg, 3_074_457_345_618_258_601)]
    {
        case::<i64>(&[m, 1, -3], op, want, "i64");
    }
}

#[test]
fn floats_round_once_to_nearest_even() {
    use ReduceOp::*;
    // 2^24 + 3 lies halfway between 2^24 + 2 (odd significand) and 2^24 + 4 (even).
    case::<f32>(&[16_777_216.0, 3.0], Sum, 16_777_220.0, "f32");
    case::<f64>(&[9_007_199_254_740_992.0, 3.0], Sum, 9_007_199_254_740_996.0, "f64");
    // f16 spacing is 2 above 2048; bf16 spacing is 2 above 256.
    case(&[f16::from_bits(0x6800), f16::from_bits(0x4200)], Sum, f16::from_bits(0x6802), "f16");
    case(&[bf16::from_bits(0x4380), bf16::from_bits(0x4040)], Sum, bf16::from_bits(0x4382), "bf16");
    // 3 × 683 = 2049, halfway between 2048 (even) and 2050 in f16.
    case(&[f16::from_bits(0x4200), f16::from_bits(0x6156)], Prod, f16::from_bits(0x6800), "f16");
    // Avg of (1, 1, 0): 2/3 rounded once.
    case(&[1.0f32, 1.0, 0.0], Avg, f32::from_bits(0x3f2a_aaab), "f32");
    case(&[1.0f64, 1.0, 0.0], Avg, f64::from_bits(0x3fe5_5555_5555_5555), "f64");
    let h = f16::from_bits;
    case(&[h(0x3c00), h(0x3c00), h(0)], Avg, h(0x3955), "f16");
    let bh = bf16::from_bits;
    case(&[bh(0x3f80), bh(0x3f80), bh(0)], Avg, bh(0x3f2b), "bf16");
    // Min and max of mixed signs.
    case(&[h(0xc500), h(0x4000), h(0x3c00)], Min, h(0xc500), "f16");
    case(&[bh(0xc0a0), bh(0x4000), bh(0x3f80)], Max, bh(0x4000), "bf16");
    case(&[-5.0f32, 2.0, 1.0], Max, 2.0, "f32");
    case(&[-5.0f64, 2.0, 1.0], Min, -5.0, "f64");
}
