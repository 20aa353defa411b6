//! Reduction kernels: `dst = a op b` elementwise over byte ranges of one dtype.
//!
//! Each kernel is a plain loop over typed slices that the compiler vectorises (the op is chosen
//! outside the loop). Byte ranges that are not aligned for their type (possible only with
//! user-provided unaligned buffers) take a slower unaligned path.

use half::{bf16, f16};

use crate::dtype::{DType, Element, ReduceOp};

#[inline(always)]
fn apply<T: Element>(op: ReduceOp, dst: &mut [T], a: &[T], b: &[T]) {
    macro_rules! each {
        ($f:expr) => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = $f(*x, *y);
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(|x, y| T::combine(ReduceOp::Sum, x, y)),
        ReduceOp::Prod => each!(|x, y| T::combine(ReduceOp::Prod, x, y)),
        ReduceOp::Min => each!(|x, y| T::combine(ReduceOp::Min, x, y)),
        ReduceOp::Max => each!(|x, y| T::combine(ReduceOp::Max, x, y)),
    }
}

#[inline(always)]
fn apply_inplace<T: Element>(op: ReduceOp, dst: &mut [T], b: &[T]) {
    macro_rules! each {
        ($f:expr) => {
            for (d, y) in dst.iter_mut().zip(b) {
                *d = $f(*d, *y);
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(|x, y| T::combine(ReduceOp::Sum, x, y)),
        ReduceOp::Prod => each!(|x, y| T::combine(ReduceOp::Prod, x, y)),
        ReduceOp::Min => each!(|x, y| T::combine(ReduceOp::Min, x, y)),
        ReduceOp::Max => each!(|x, y| T::combine(ReduceOp::Max, x, y)),
    }
}

fn typed<T: Element>(op: ReduceOp, dst: *mut u8, a: *const u8, b: *const u8, bytes: usize) {
    let n = bytes / std::mem::size_of::<T>();
    let align = std::mem::align_of::<T>();
    let aligned = [dst as usize, a as usize, b as usize].iter().all(|p| p % align == 0);
    if aligned {
        // SAFETY: the caller passes ranges of `bytes` bytes, valid for the access; they are
        // aligned (checked) and every bit pattern is a valid `T`. `dst` may equal `a`, which
        // the in-place kernel handles without creating aliasing references.
        unsafe {
            let b = std::slice::from_raw_parts(b.cast::<T>(), n);
            if std::ptr::eq(dst, a) {
                apply_inplace(op, std::slice::from_raw_parts_mut(dst.cast::<T>(), n), b);
            } else {
                let a = std::slice::from_raw_parts(a.cast::<T>(), n);
                apply(op, std::slice::from_raw_parts_mut(dst.cast::<T>(), n), a, b);
            }
        }
    } else {
        for i in 0..n {
            // SAFETY: in bounds of the ranges; unaligned reads and writes are used.
            unsafe {
                let x = a.cast::<T>().add(i).read_unaligned();
                let y = b.cast::<T>().add(i).read_unaligned();
                dst.cast::<T>().add(i).write_unaligned(T::combine(op, x, y));
            }
        }
    }
}

/// Elements converted to f32 per pass of the half-precision kernels.
const CHUNK: usize = 2048;

/// Conversions between a 16-bit float type and f32, a chunk at a time.
trait Half16: Element {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half16 for f16 {
    #[inline]
    fn widen(src: &[f16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [f16]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

impl Half16 for bf16 {
    #[inline]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        // Round to nearest even; NaN stays a (quiet) NaN. Branch-free so it vectorises; the same
        // bits as `bf16::from_f32`.
        for (d, s) in dst.iter_mut().zip(src) {
            let b = s.to_bits();
            let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
            let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
            let quiet = ((b >> 16) as u16) | 0x40;
            *d = bf16::from_bits(if nan { quiet } else { rounded });
        }
    }
}

/// `dst = a op b` for 16-bit floats: widen a chunk to f32, combine, round once.
///
/// # Safety
/// As [`reduce_raw`], with `n` elements of `H` at each (possibly unaligned) address.
unsafe fn via_f32<H: Half16>(op: ReduceOp, dst: *mut u8, a: *const u8, b: *const u8, n: usize) {
    let (mut fa, mut fb) = ([0f32; CHUNK], [0f32; CHUNK]);
    let (mut ha, mut hb) = ([H::default(); CHUNK], [H::default(); CHUNK]);
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        // SAFETY: `i + m <= n` elements lie inside each range; unaligned copies into locals.
        unsafe {
            std::ptr::copy_nonoverlapping(
                a.cast::<H>().add(i).cast::<u8>(),
                ha.as_mut_ptr().cast::<u8>(),
                m * 2,
            );
            std::ptr::copy_nonoverlapping(
                b.cast::<H>().add(i).cast::<u8>(),
                hb.as_mut_ptr().cast::<u8>(),
                m * 2,
            );
        }
        H::widen(&ha[..m], &mut fa[..m]);
        H::widen(&hb[..m], &mut fb[..m]);
        apply_inplace(op, &mut fa[..m], &fb[..m]);
        H::narrow(&fa[..m], &mut ha[..m]);
        // SAFETY: as above, for the destination.
        unsafe {
            std::ptr::copy_nonoverlapping(
                ha.as_ptr().cast::<u8>(),
                dst.cast::<H>().add(i).cast::<u8>(),
                m * 2,
            )
        };
        i += m;
    }
}

#[inline(always)]
fn bf16_round(x: f32) -> u16 {
    let b = x.to_bits();
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if nan {
        ((b >> 16) as u16) | 0x40
    } else {
        rounded
    }
}

/// bf16 on aligned ranges: one fused loop of shifts, an f32 op and a rounding, which the
/// compiler vectorises. `dst` may equal `a`.
///
/// # Safety
/// `n` aligned u16 elements at each address; `dst` equal to `a` or disjoint from both.
#[inline(always)]
unsafe fn bf16_aligned(op: ReduceOp, dst: *mut u16, a: *const u16, b: *const u16, n: usize) {
    #[inline(always)]
    fn inplace(d: &mut [u16], b: &[u16], f: impl Fn(f32, f32) -> f32) {
        for (d, y) in d.iter_mut().zip(b) {
            let x = f32::from_bits(u32::from(*d) << 16);
            let y = f32::from_bits(u32::from(*y) << 16);
            *d = bf16_round(f(x, y));
        }
    }
    #[inline(always)]
    fn out(d: &mut [u16], a: &[u16], b: &[u16], f: impl Fn(f32, f32) -> f32) {
        for ((d, x), y) in d.iter_mut().zip(a).zip(b) {
            let x = f32::from_bits(u32::from(*x) << 16);
            let y = f32::from_bits(u32::from(*y) << 16);
            *d = bf16_round(f(x, y));
        }
    }
    // SAFETY: `n` aligned elements at each address; `dst` is `a` or disjoint from both.
    let (d, bs) =
        unsafe { (std::slice::from_raw_parts_mut(dst, n), std::slice::from_raw_parts(b, n)) };
    macro_rules! go {
        ($f:expr) => {
            if dst as *const u16 == a {
                inplace(d, bs, $f)
            } else {
                // SAFETY: disjoint from `dst` (caller contract).
                out(d, unsafe { std::slice::from_raw_parts(a, n) }, bs, $f)
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => go!(|x, y| x + y),
        ReduceOp::Prod => go!(|x, y| x * y),
        ReduceOp::Min => go!(f32::min),
        ReduceOp::Max => go!(f32::max),
    }
}

/// f16 on aligned ranges: widen chunks with half's (runtime-detected F16C) slice conversions.
///
/// # Safety
/// As [`bf16_aligned`].
#[inline(always)]
unsafe fn f16_aligned(op: ReduceOp, dst: *mut f16, a: *const f16, b: *const f16, n: usize) {
    use half::slice::HalfFloatSliceExt;
    let (mut fa, mut fb) = ([0f32; CHUNK], [0f32; CHUNK]);
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        // SAFETY: `i + m <= n`; the source slices are dropped before `dst` is written, which
        // keeps the case `dst == a` free of aliasing references.
        unsafe {
            std::slice::from_raw_parts(a.add(i), m).convert_to_f32_slice(&mut fa[..m]);
            std::slice::from_raw_parts(b.add(i), m).convert_to_f32_slice(&mut fb[..m]);
        }
        apply_inplace(op, &mut fa[..m], &fb[..m]);
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(dst.add(i), m).convert_from_f32_slice(&fa[..m]) };
        i += m;
    }
}

/// Half-precision kernels compiled twice: for the baseline x86-64 target and with AVX2/FMA/F16C,
/// chosen at run time. The baseline has no vector widening or narrowing of 16-bit lanes, so the
/// conversions run scalar there.
mod half16 {
    use half::f16 as F16;

    use super::{bf16_aligned, f16_aligned};
    use crate::dtype::ReduceOp;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bf16_avx2(op: ReduceOp, d: *mut u16, a: *const u16, b: *const u16, n: usize) {
        // SAFETY: forwarded contract.
        unsafe { bf16_aligned(op, d, a, b, n) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_avx2(op: ReduceOp, d: *mut F16, a: *const F16, b: *const F16, n: usize) {
        // SAFETY: forwarded contract.
        unsafe { f16_aligned(op, d, a, b, n) }
    }

    #[cfg(target_arch = "x86_64")]
    fn has_avx2() -> bool {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }

    /// # Safety
    /// As `bf16_aligned`.
    pub(super) unsafe fn bf16(op: ReduceOp, d: *mut u16, a: *const u16, b: *const u16, n: usize) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the features (checked); forwarded contract.
            return unsafe { bf16_avx2(op, d, a, b, n) };
        }
        // SAFETY: forwarded contract.
        unsafe { bf16_aligned(op, d, a, b, n) }
    }

    /// # Safety
    /// As `f16_aligned`.
    pub(super) unsafe fn f16(op: ReduceOp, d: *mut F16, a: *const F16, b: *const F16, n: usize) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the features (checked); forwarded contract.
            return unsafe { f16_avx2(op, d, a, b, n) };
        }
        // SAFETY: forwarded contract.
        unsafe { f16_aligned(op, d, a, b, n) }
    }
}

/// `dst[i] = a[i] op b[i]` for the elements of `bytes` bytes at the given addresses.
///
/// # Safety
/// `dst`, `a` and `b` must each be valid for `bytes` bytes (reads for `a`, `b`; writes for
/// `dst`); `dst` may be equal to `a` but must not otherwise overlap `a` or `b`.
pub unsafe fn reduce_raw(
    dtype: DType,
    op: ReduceOp,
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    bytes: usize,
) {
    match dtype {
        DType::F32 => typed::<f32>(op, dst, a, b, bytes),
        DType::F64 => typed::<f64>(op, dst, a, b, bytes),
        // SAFETY: forwarded contract.
        DType::F16 | DType::BF16
            if [dst as usize, a as usize, b as usize].iter().any(|p| p % 2 != 0) =>
        unsafe {
            if dtype == DType::F16 {
                via_f32::<f16>(op, dst, a, b, bytes / 2)
            } else {
                via_f32::<bf16>(op, dst, a, b, bytes / 2)
            }
        },
        // SAFETY: forwarded contract; the ranges are 2-byte aligned (checked above).
        DType::BF16 => unsafe { half16::bf16(op, dst.cast(), a.cast(), b.cast(), bytes / 2) },
        // SAFETY: as above.
        DType::F16 => unsafe { half16::f16(op, dst.cast(), a.cast(), b.cast(), bytes / 2) },
        DType::I8 => typed::<i8>(op, dst, a, b, bytes),
        DType::U8 => typed::<u8>(op, dst, a, b, bytes),
        DType::I32 => typed::<i32>(op, dst, a, b, bytes),
        DType::I64 => typed::<i64>(op, dst, a, b, bytes),
        _ => {}
    }
}

/// `dst op= src` over two byte slices of one dtype (safe wrapper, used by benches and tests).
///
/// # Panics
/// If the slices differ in length.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_into needs equal lengths");
    let p = dst.as_mut_ptr();
    // SAFETY: both slices are valid for their length; `dst` is exclusively borrowed, so it cannot
    // overlap `src`; dst == a is the in-place case.
    unsafe { reduce_raw(dtype, op, p, p, src.as_ptr(), dst.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{as_bytes, as_bytes_mut};

    #[test]
    fn all_ops_f32_and_i8() {
        let a = [1.0f32, -2.0, 3.0, 4.0];
        let b = [5.0f32, 6.0, -7.0, 0.5];
        for (op, want) in [
            (ReduceOp::Sum, [6.0f32, 4.0, -4.0, 4.5]),
            (ReduceOp::Prod, [5.0, -12.0, -21.0, 2.0]),
            (ReduceOp::Min, [1.0, -2.0, -7.0, 0.5]),
            (ReduceOp::Max, [5.0, 6.0, 3.0, 4.0]),
        ] {
            let mut d = a;
            reduce_into(DType::F32, op, as_bytes_mut(&mut d), as_bytes(&b));
            assert_eq!(d, want, "{op}");
        }
        let mut d = [100i8, -100];
        reduce_into(DType::I8, ReduceOp::Sum, as_bytes_mut(&mut d), as_bytes(&[100i8, -100]));
        assert_eq!(d, [-56, 56], "wrapping");
    }

    #[test]
    fn half_kernels_match_elementwise_rounding() {
        // Every pair of a spread of values, including NaN, infinities, subnormals and ties.
        let vals: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            0.5,
            3.0,
            1e-8,
            -7.5e-39,
            65504.0,
            1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            2.0f32.powi(-20),
        ];
        let mut xs = Vec::new();
        let mut ys = Vec::new();
        for &x in &vals {
            for &y in &vals {
                xs.push(x);
                ys.push(y);
            }
        }
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let a: Vec<bf16> = xs.iter().map(|v| bf16::from_f32(*v)).collect();
            let b: Vec<bf16> = ys.iter().map(|v| bf16::from_f32(*v)).collect();
            let mut d = a.clone();
            reduce_into(DType::BF16, op, as_bytes_mut(&mut d), as_bytes(&b));
            for i in 0..a.len() {
                let want = <bf16 as Element>::combine(op, a[i], b[i]);
                assert!(
                    want.to_bits() == d[i].to_bits() || (want.is_nan() && d[i].is_nan()),
                    "bf16 {op} {} {}",
                    a[i],
                    b[i]
                );
            }
            let a: Vec<f16> = xs.iter().map(|v| f16::from_f32(*v)).collect();
            let b: Vec<f16> = ys.iter().map(|v| f16::from_f32(*v)).collect();
            let mut d = a.clone();
            reduce_into(DType::F16, op, as_bytes_mut(&mut d), as_bytes(&b));
            for i in 0..a.len() {
                let want = <f16 as Element>::combine(op, a[i], b[i]);
                assert!(
                    want.to_bits() == d[i].to_bits() || (want.is_nan() && d[i].is_nan()),
                    "f16 {op} {} {}",
                    a[i],
                    b[i]
                );
            }
        }
    }

    #[test]
    fn unaligned_path() {
        let mut buf = [0u8; 1 + 16];
        let src = as_bytes(&[1.5f32, 2.5, 3.5, 4.5]).to_vec();
        let dst = &mut buf[1..17];
        dst.copy_from_slice(as_bytes(&[1.0f32; 4]));
        reduce_into(DType::F32, ReduceOp::Sum, dst, &src);
        let got: Vec<f32> =
            dst.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, [2.5, 3.5, 4.5, 5.5]);
    }
}
