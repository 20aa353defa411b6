//! Exact, verifiable test data (nccl-tests' `verifiable` idea) with an independent oracle.
//!
//! Inputs are small integers that every dtype stores exactly, kept inside the exact range after
//! reduction over up to 32 ranks (|sum| ≤ 128, products are powers of two up to 2^4), so any
//! summation order gives the same bits and each rank computes the expected output locally from
//! (seed, rank, world, op).
//!
//! The expected values never use the product's arithmetic (`Element::combine`, `div_n`, the
//! kernels, the `half` crate's conversions): this module reduces in wide integers (`i128`) and
//! writes the result's bit pattern itself, by these rules:
//!
//! - integer dtypes: every value is taken modulo 2^bits (two's complement for signed types);
//!   sums and products wrap; `Min`/`Max` compare the stored values (unsigned for `u8`); `Avg` is
//!   the wrapped sum divided by the group size, truncated toward zero;
//! - floating dtypes: the exact rational result (for `Avg`, sum / group size) rounded once to the
//!   nearest value of the format, ties to the even significand, with subnormals and overflow to
//!   infinity.
//!
//! A kernel or an `Avg` that gets a rule wrong therefore disagrees with the oracle bit for bit.

use crate::dtype::{DType, Element, ReduceOp};

/// The exact integer that rank `r` contributes at element `i` for `op`.
fn raw(seed: u64, r: usize, i: usize, op: ReduceOp) -> i64 {
    let h = (seed as usize)
        .wrapping_mul(31)
        .wrapping_add(r.wrapping_mul(7))
        .wrapping_add(i.wrapping_mul(3));
    match op {
        ReduceOp::Prod => {
            let s = if (h / 9).is_multiple_of(2) { 1 } else { -1 };
            if (r + i).is_multiple_of(8) {
                2 * s
            } else {
                s
            }
        }
        _ => (h % 9) as i64 - 4,
    }
}

/// Value of element `i` on rank `r` for `op`.
pub fn value<T: Element>(seed: u64, r: usize, i: usize, op: ReduceOp) -> T {
    exact::<T>(i128::from(raw(seed, r, i, op)), 1)
}

/// Rank `r`'s input of `count` elements.
pub fn input<T: Element>(seed: u64, r: usize, count: usize, op: ReduceOp) -> Vec<T> {
    (0..count).map(|i| value(seed, r, i, op)).collect()
}

/// Fill `buf` with rank `r`'s input, element `i` of `buf` being global element `first + i`.
pub fn fill<T: Element>(buf: &mut [T], seed: u64, r: usize, first: usize, op: ReduceOp) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = value(seed, r, first + i, op);
    }
}

/// Expected reduction over ranks `0..n` of element `i` (including `Avg`'s division), computed
/// by the oracle's own arithmetic (see the module docs).
///
/// # Panics
/// If `n` is 0.
pub fn reduced<T: Element>(seed: u64, n: usize, i: usize, op: ReduceOp) -> T {
    // No allocation per element: collbench checks every element of every buffer with this.
    reduce_exact::<T>((0..n).map(|r| i128::from(raw(seed, r, i, op))), op)
}

/// The expected reduction of `vals` (one exact integer per rank, in rank order) under `op`, as
/// `T`, by the rules in the module docs. Public so that tests can state hand-picked cases.
///
/// # Panics
/// If `vals` is empty, or a float result lies outside the range the oracle handles (magnitudes
/// from 2^-60 to 2^60).
pub fn oracle<T: Element>(vals: &[i128], op: ReduceOp) -> T {
    reduce_exact::<T>(vals.iter().copied(), op)
}

/// [`oracle`] over any (re-iterable) sequence of per-rank values.
fn reduce_exact<T: Element>(vals: impl Iterator<Item = i128> + Clone, op: ReduceOp) -> T {
    let n = vals.clone().count() as i128;
    assert!(n > 0, "a reduction over no ranks has no value");
    match format(T::DTYPE) {
        Format::Int { bits, signed } => {
            let w = |x: i128| wrap(x, bits, signed);
            let typed = vals.map(w);
            let r = match op {
                ReduceOp::Sum => w(typed.sum()),
                ReduceOp::Prod => typed.fold(1, |acc, v| w(acc * v)),
                ReduceOp::Min => typed.min().unwrap_or(0),
                ReduceOp::Max => typed.max().unwrap_or(0),
                // `/` on integers truncates toward zero.
                ReduceOp::Avg => w(w(typed.sum()) / n),
            };
            from_bits::<T>((r as u128 & mask(bits)) as u64)
        }
        Format::Float { .. } => match op {
            ReduceOp::Sum => exact::<T>(vals.sum(), 1),
            ReduceOp::Prod => exact::<T>(vals.product(), 1),
            ReduceOp::Min => exact::<T>(vals.min().unwrap_or(0), 1),
            ReduceOp::Max => exact::<T>(vals.max().unwrap_or(0), 1),
            ReduceOp::Avg => exact::<T>(vals.sum(), n),
        },
    }
}

/// `num / den` (`den > 0`) stored in `T`: wrapped (and truncated toward zero) for integers,
/// rounded to nearest even for floats.
///
/// # Panics
/// If `den` is not positive, or as [`oracle`].
pub fn exact<T: Element>(num: i128, den: i128) -> T {
    assert!(den > 0, "the oracle divides by a positive group size");
    match format(T::DTYPE) {
        Format::Int { bits, signed } => {
            from_bits::<T>((wrap(num / den, bits, signed) as u128 & mask(bits)) as u64)
        }
        Format::Float { exp_bits, man_bits } => {
            from_bits::<T>(round_to_float(num, den as u128, exp_bits, man_bits))
        }
    }
}

/// Bitwise equality of two elements.
pub fn same<T: Element>(a: T, b: T) -> bool {
    crate::dtype::as_bytes(std::slice::from_ref(&a))
        == crate::dtype::as_bytes(std::slice::from_ref(&b))
}

/// Elements of `got` that differ bitwise from `want(i)`.
pub fn count_wrong<T: Element>(got: &[T], want: impl Fn(usize) -> T) -> u64 {
    got.iter().enumerate().filter(|(i, g)| !same(**g, want(*i))).count() as u64
}

/// How a dtype stores a number.
enum Format {
    Int { bits: u32, signed: bool },
    Float { exp_bits: u32, man_bits: u32 },
}

fn format(d: DType) -> Format {
    match d {
        DType::I8 => Format::Int { bits: 8, signed: true },
        DType::U8 => Format::Int { bits: 8, signed: false },
        DType::I32 => Format::Int { bits: 32, signed: true },
        DType::I64 => Format::Int { bits: 64, signed: true },
        DType::F16 => Format::Float { exp_bits: 5, man_bits: 10 },
        DType::BF16 => Format::Float { exp_bits: 8, man_bits: 7 },
        DType::F32 => Format::Float { exp_bits: 8, man_bits: 23 },
        DType::F64 => Format::Float { exp_bits: 11, man_bits: 52 },
        other => unreachable!("no Element has dtype {other:?}"),
    }
}

fn mask(bits: u32) -> u128 {
    (1u128 << bits) - 1
}

/// `x` modulo 2^bits, as the value a `bits`-wide integer of that signedness holds.
fn wrap(x: i128, bits: u32, signed: bool) -> i128 {
    let m = 1i128 << bits;
    let r = x.rem_euclid(m);
    if signed && r >= m / 2 {
        r - m
    } else {
        r
    }
}

/// `num / den` rounded to the binary float format with `exp_bits` exponent bits and `man_bits`
/// stored significand bits: round to nearest, ties to an even significand; subnormals below
/// the smallest normal; infinity past the largest finite value. Returns the bit pattern.
fn round_to_float(num: i128, den: u128, exp_bits: u32, man_bits: u32) -> u64 {
    let sign = u64::from(num < 0) << (exp_bits + man_bits);
    let a = num.unsigned_abs();
    if a == 0 {
        return sign;
    }
    let log2 = |x: u128| 127 - x.leading_zeros() as i32;
    // e with 2^e <= a/den < 2^(e+1).
    let mut e = log2(a) - log2(den);
    let below = if e >= 0 { a < den << e } else { a << -e < den };
    if below {
        e -= 1;
    }
    assert!((-60..=60).contains(&e), "oracle range is 2^-60..2^60, got 2^{e}");
    let bias = (1i32 << (exp_bits - 1)) - 1;
    let emin = 1 - bias;
    let e = e.max(emin);
    // The significand scaled to an integer of man_bits + 1 bits: q = a/den * 2^(man_bits - e).
    let shift = man_bits as i32 - e;
    let (n, d) = if shift >= 0 { (a << shift, den) } else { (a, den << -shift) };
    let (mut q, rem) = (n / d, n % d);
    if 2 * rem > d || (2 * rem == d && q % 2 == 1) {
        q += 1;
    }
    let mut e = e;
    if q == 1u128 << (man_bits + 1) {
        q >>= 1;
        e += 1;
    }
    let (biased, frac) = if e > bias {
        ((1u64 << exp_bits) - 1, 0)
    } else if q < 1u128 << man_bits {
        (0, q as u64)
    } else {
        ((e + bias) as u64, (q - (1u128 << man_bits)) as u64)
    };
    sign | biased << man_bits | frac
}

/// The element of `T` whose little-endian bit pattern is the low bytes of `bits`.
fn from_bits<T: Element>(bits: u64) -> T {
    let mut t = T::default();
    let dst = crate::dtype::as_bytes_mut(std::slice::from_mut(&mut t));
    let le = bits.to_le_bytes();
    let size = dst.len();
    dst.copy_from_slice(&le[..size]);
    if cfg!(target_endian = "big") {
        dst.reverse();
    }
    t
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    fn bits<T: Element>(x: T) -> u64 {
        let b = crate::dtype::as_bytes(std::slice::from_ref(&x));
        let mut le = [0u8; 8];
        le[..b.len()].copy_from_slice(b);
        if cfg!(target_endian = "big") {
            le[..b.len()].reverse();
        }
        u64::from_le_bytes(le)
    }

    #[test]
    fn float_rounding_against_written_out_patterns() {
        // Patterns from the IEEE 754 layouts, written by hand.
        assert_eq!(bits(exact::<f32>(2, 3)), 0x3f2a_aaab);
        assert_eq!(bits(exact::<f64>(2, 3)), 0x3fe5_5555_5555_5555);
        assert_eq!(bits(exact::<f16>(2, 3)), 0x3955);
        assert_eq!(bits(exact::<bf16>(2, 3)), 0x3f2b);
        assert_eq!(bits(exact::<f32>(-1, 1)), 0xbf80_0000);
        assert_eq!(bits(exact::<f16>(0, 5)), 0x0000);
        // Ties to even: f16 spacing is 2 above 2048, bf16 spacing is 2 above 256.
        assert_eq!(bits(exact::<f16>(2049, 1)), 0x6800);
        assert_eq!(bits(exact::<f16>(2051, 1)), 0x6802);
        assert_eq!(bits(exact::<bf16>(257, 1)), 0x4380);
        assert_eq!(bits(exact::<bf16>(259, 1)), 0x4382);
        // Overflow and subnormals.
        assert_eq!(bits(exact::<f16>(65520, 1)), 0x7c00);
        assert_eq!(bits(exact::<f16>(65519, 1)), 0x7bff);
        assert_eq!(bits(exact::<f16>(1, 1 << 24)), 0x0001);
        assert_eq!(bits(exact::<f16>(1, 1 << 25)), 0x0000, "a tie to even gives zero");
        assert_eq!(bits(exact::<f16>(3, 1 << 25)), 0x0002);
    }

    #[test]
    fn integer_rules() {
        assert_eq!(oracle::<u8>(&[200, 100], ReduceOp::Sum), 44);
        assert_eq!(oracle::<i8>(&[100, 100], ReduceOp::Sum), -56);
        assert_eq!(oracle::<i8>(&[-7, 0], ReduceOp::Avg), -3, "toward zero, not -4");
        assert_eq!(oracle::<u8>(&[-1, 1], ReduceOp::Min), 1, "u8 compares unsigned: 255 > 1");
        assert_eq!(oracle::<i32>(&[65536, 65536], ReduceOp::Prod), 0);
        assert_eq!(oracle::<i64>(&[-4, 3, 2], ReduceOp::Max), 3);
        assert_eq!(oracle::<u8>(&[-4, -4], ReduceOp::Avg), 124, "(252 + 252) mod 256 = 248, / 2");
    }
}
