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

/// True when every address is a multiple of `align`.
fn all_aligned(align: usize, addrs: [usize; 3]) -> bool {
    addrs.iter().all(|p| p % align == 0)
}

fn typed<T: Element>(op: ReduceOp, dst: *mut u8, a: *const u8, b: *const u8, bytes: usize) {
    let n = bytes / size_of::<T>();
    let aligned = all_aligned(align_of::<T>(), [dst as usize, a as usize, b as usize]);
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

    #[cfg(target_arch = "x86_64")]
    fn has_avx512() -> bool {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    }

    /// # Safety
    /// As `bf16_aligned`.
    pub(super) unsafe fn bf16(op: ReduceOp, d: *mut u16, a: *const u16, b: *const u16, n: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            // Sum and product in explicit vector code (exact: the same f32 operation and the same
            // rounding as the scalar loop, which the compiler vectorised poorly: 26 % of memcpy);
            // min and max keep `f32::min`/`max`'s NaN rule in the loop below.
            let done = match op {
                ReduceOp::Min | ReduceOp::Max => 0,
                // SAFETY: the CPU supports the features (checked); forwarded contract.
                _ if has_avx512() => unsafe { super::simd::bf16_avx512(op, d, a, b, n) },
                // SAFETY: as above.
                _ if has_avx2() => unsafe { super::simd::bf16_avx2(op, d, a, b, n) },
                _ => 0,
            };
            // SAFETY: `done <= n`; the rest of the same ranges.
            let (d, a, b, n) = unsafe { (d.add(done), a.add(done), b.add(done), n - done) };
            if has_avx2() {
                // SAFETY: the CPU supports the features (checked); forwarded contract.
                return unsafe { bf16_avx2(op, d, a, b, n) };
            }
            // SAFETY: forwarded contract.
            unsafe { bf16_aligned(op, d, a, b, n) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        // SAFETY: forwarded contract.
        unsafe {
            bf16_aligned(op, d, a, b, n)
        }
    }

    /// # Safety
    /// As `f16_aligned`.
    pub(super) unsafe fn f16(op: ReduceOp, d: *mut F16, a: *const F16, b: *const F16, n: usize) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // Sum and product with F16C conversions in registers (exact: an f16 sum or product
            // computed in f32 and rounded once is the correctly rounded f16 result, as in the
            // scalar path).
            let done = match op {
                // SAFETY: the CPU supports the features (checked); forwarded contract.
                ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Prod => unsafe {
                    super::simd::f16_f16c(op, d.cast(), a.cast(), b.cast(), n)
                },
                ReduceOp::Min | ReduceOp::Max => 0,
            };
            // SAFETY: the CPU supports the features (checked); `done <= n`; the rest of the
            // same ranges.
            return unsafe { f16_avx2(op, d.add(done), a.add(done), b.add(done), n - done) };
        }
        // SAFETY: forwarded contract.
        unsafe { f16_aligned(op, d, a, b, n) }
    }
}

/// Explicit vector kernels for 16-bit floats on x86-64 (sum and product). Each returns how many
/// leading elements it did (whole vectors); the caller finishes the tail.
///
/// # Safety (all)
/// The CPU has the enabled features; `n` elements at each address, valid for the access;
/// `dst` equal to `a` or disjoint from both. Every vector is loaded before its store, so the
/// in-place case is safe.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use crate::dtype::ReduceOp;

    /// bf16 rounding of eight f32 lanes, as `bf16_round` (to nearest even; NaN kept quiet),
    /// leaving the bf16 bits in the low half of each lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn round8(s: __m256) -> __m256i {
        let bits = _mm256_castps_si256(s);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        let quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(s, s));
        _mm256_srli_epi32::<16>(_mm256_blendv_epi8(rounded, quiet, nan))
    }

    /// As [`round8`], sixteen lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn round16(s: __m512) -> __m512i {
        let bits = _mm512_castps_si512(s);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(s, s);
        _mm512_srli_epi32::<16>(_mm512_mask_blend_epi32(nan, rounded, quiet))
    }

    /// bf16 sum or product, 16 elements per step. Widening interleaves each 128-bit lane's
    /// 16-bit elements above zero halves (a bf16 is the top half of its f32) and `packus`
    /// undoes it lane by lane, so no cross-lane shuffle is needed.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_avx2(
        op: ReduceOp,
        d: *mut u16,
        a: *const u16,
        b: *const u16,
        n: usize,
    ) -> usize {
        let mul = op == ReduceOp::Prod;
        let z = _mm256_setzero_si256();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` elements at each address (caller contract).
            let (va, vb) = unsafe {
                (_mm256_loadu_si256(a.add(i).cast()), _mm256_loadu_si256(b.add(i).cast()))
            };
            let al = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, va));
            let ah = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, va));
            let bl = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, vb));
            let bh = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, vb));
            let (sl, sh) = if mul {
                (_mm256_mul_ps(al, bl), _mm256_mul_ps(ah, bh))
            } else {
                (_mm256_add_ps(al, bl), _mm256_add_ps(ah, bh))
            };
            let r = _mm256_packus_epi32(round8(sl), round8(sh));
            // SAFETY: as above.
            unsafe { _mm256_storeu_si256(d.add(i).cast(), r) };
            i += 16;
        }
        i
    }

    /// As [`bf16_avx2`], 32 elements per step.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn bf16_avx512(
        op: ReduceOp,
        d: *mut u16,
        a: *const u16,
        b: *const u16,
        n: usize,
    ) -> usize {
        let mul = op == ReduceOp::Prod;
        let z = _mm512_setzero_si512();
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: `i + 32 <= n` elements at each address (caller contract).
            let (va, vb) = unsafe {
                (_mm512_loadu_si512(a.add(i).cast()), _mm512_loadu_si512(b.add(i).cast()))
            };
            let al = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, va));
            let ah = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, va));
            let bl = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, vb));
            let bh = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, vb));
            let (sl, sh) = if mul {
                (_mm512_mul_ps(al, bl), _mm512_mul_ps(ah, bh))
            } else {
                (_mm512_add_ps(al, bl), _mm512_add_ps(ah, bh))
            };
            let r = _mm512_packus_epi32(round16(sl), round16(sh));
            // SAFETY: as above.
            unsafe { _mm512_storeu_si512(d.add(i).cast(), r) };
            i += 32;
        }
        i
    }

    /// f16 sum or product, 8 elements per step: F16C widening, one f32 operation, F16C
    /// narrowing with round to nearest even.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_f16c(
        op: ReduceOp,
        d: *mut u16,
        a: *const u16,
        b: *const u16,
        n: usize,
    ) -> usize {
        let mul = op == ReduceOp::Prod;
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` elements at each address (caller contract).
            let (va, vb) =
                unsafe { (_mm_loadu_si128(a.add(i).cast()), _mm_loadu_si128(b.add(i).cast())) };
            let (x, y) = (_mm256_cvtph_ps(va), _mm256_cvtph_ps(vb));
            let s = if mul { _mm256_mul_ps(x, y) } else { _mm256_add_ps(x, y) };
            let r = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(s);
            // SAFETY: as above.
            unsafe { _mm_storeu_si128(d.add(i).cast(), r) };
            i += 8;
        }
        i
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
        DType::F16 | DType::BF16 if !all_aligned(2, [dst as usize, a as usize, b as usize]) => {
            // SAFETY: forwarded contract; `via_f32` copies through aligned locals.
            unsafe {
                if dtype == DType::F16 {
                    via_f32::<f16>(op, dst, a, b, bytes / 2)
                } else {
                    via_f32::<bf16>(op, dst, a, b, bytes / 2)
                }
            }
        }
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
    fn streaming_copy_is_exact_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..9000u32).map(|i| (i * 131 % 251) as u8).collect();
        for dst_off in 0..17 {
            for src_off in [0, 1, 7, 16] {
                for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 1000, 8191] {
                    let mut dst = vec![0xEEu8; 8300];
                    // SAFETY: both ranges are inside their vectors, which do not overlap.
                    unsafe {
                        copy_stream(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len)
                    };
                    assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xEE), "{dst_off} {len}");
                    assert!(dst[dst_off + len..].iter().all(|&b| b == 0xEE), "{dst_off} {len}");
                }
            }
        }
    }

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
    fn half_vector_kernels_match_elementwise_on_random_bits() {
        // Every bit pattern class (subnormals, ties, NaN payloads, infinities) at lengths that
        // leave vector tails, in place and out of place; NaN results may differ in payload.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u16
        };
        for n in [1usize, 7, 8, 15, 16, 17, 31, 32, 33, 63, 100, 1000, 10_007] {
            let a: Vec<u16> = (0..n).map(|_| next()).collect();
            let b: Vec<u16> = (0..n).map(|_| next()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                let ab: Vec<bf16> = a.iter().map(|v| bf16::from_bits(*v)).collect();
                let bb: Vec<bf16> = b.iter().map(|v| bf16::from_bits(*v)).collect();
                let mut inplace = ab.clone();
                reduce_into(DType::BF16, op, as_bytes_mut(&mut inplace), as_bytes(&bb));
                let mut out = vec![bf16::ZERO; n];
                // SAFETY: three distinct vectors of `n` elements.
                unsafe {
                    reduce_raw(
                        DType::BF16,
                        op,
                        out.as_mut_ptr().cast(),
                        ab.as_ptr().cast(),
                        bb.as_ptr().cast(),
                        2 * n,
                    )
                };
                for i in 0..n {
                    let want = <bf16 as Element>::combine(op, ab[i], bb[i]);
                    for got in [inplace[i], out[i]] {
                        assert!(
                            want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                            "bf16 {op} {:04x} {:04x}: {:04x} vs {:04x}",
                            a[i],
                            b[i],
                            want.to_bits(),
                            got.to_bits()
                        );
                    }
                }
                // The AVX2 kernel too, which the dispatcher skips on AVX-512 machines.
                #[cfg(target_arch = "x86_64")]
                if matches!(op, ReduceOp::Sum | ReduceOp::Prod)
                    && std::is_x86_feature_detected!("avx2")
                {
                    let mut v = a.clone();
                    let p = v.as_mut_ptr();
                    // SAFETY: AVX2 is present; `n` elements each; in place.
                    let done = unsafe { simd::bf16_avx2(op, p, p, b.as_ptr(), n) };
                    for i in 0..done {
                        let want = <bf16 as Element>::combine(op, ab[i], bb[i]);
                        let got = bf16::from_bits(v[i]);
                        assert!(
                            want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                            "bf16 avx2 {op} {:04x} {:04x}",
                            a[i],
                            b[i]
                        );
                    }
                }
                let af: Vec<f16> = a.iter().map(|v| f16::from_bits(*v)).collect();
                let bf: Vec<f16> = b.iter().map(|v| f16::from_bits(*v)).collect();
                let mut inplace = af.clone();
                reduce_into(DType::F16, op, as_bytes_mut(&mut inplace), as_bytes(&bf));
                for i in 0..n {
                    let want = <f16 as Element>::combine(op, af[i], bf[i]);
                    let got = inplace[i];
                    assert!(
                        want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                        "f16 {op} {:04x} {:04x}: {:04x} vs {:04x}",
                        a[i],
                        b[i],
                        want.to_bits(),
                        got.to_bits()
                    );
                }
            }
        }
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
    fn unaligned_half_precision_matches_aligned() {
        // Odd addresses take the widen-to-f32 path for f16 and bf16; it must give the aligned
        // kernels' bits (which the oracle tests check), in place and out of place.
        let n = 37;
        // Infinities, NaNs, zeros of both signs and subnormals first (of either format), then
        // finite values of mixed signs.
        let special = [0x7c00u16, 0x7f80, 0xff80, 0x7fc1, 0x7e01, 0x8000, 0x0000, 0x0001, 0x8003];
        let bits = move |k: usize| {
            (0..n).map(move |i| {
                if i < special.len() {
                    special[(i + k) % special.len()]
                } else {
                    ((i * 2654435761 + k * 97) % 0xfb00) as u16
                }
            })
        };
        for dtype in [DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                let a: Vec<u8> = bits(1).flat_map(u16::to_le_bytes).collect();
                let b: Vec<u8> = bits(2).flat_map(u16::to_le_bytes).collect();
                let mut want = a.clone();
                let mut wa: Vec<u16> =
                    want.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                let wb: Vec<u16> = b.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                // SAFETY: two aligned vectors of `n` u16 each; in place.
                unsafe {
                    let p = wa.as_mut_ptr().cast::<u8>();
                    reduce_raw(dtype, op, p, p, wb.as_ptr().cast(), 2 * n);
                }
                want.clear();
                want.extend(wa.iter().flat_map(|v| v.to_le_bytes()));
                let (mut ua, mut ub, mut out) =
                    (vec![0u8; 2 * n + 1], vec![0u8; 2 * n + 1], vec![0u8; 2 * n + 1]);
                ua[1..].copy_from_slice(&a);
                ub[1..].copy_from_slice(&b);
                // SAFETY: ranges of 2n bytes at offset 1 of buffers of 2n + 1 bytes.
                unsafe {
                    reduce_raw(
                        dtype,
                        op,
                        out.as_mut_ptr().add(1),
                        ua.as_ptr().add(1),
                        ub.as_ptr().add(1),
                        2 * n,
                    );
                    let p = ua.as_mut_ptr().add(1);
                    reduce_raw(dtype, op, p, p, ub.as_ptr().add(1), 2 * n);
                }
                // Bit for bit, except that any NaN matches any NaN (payloads may differ).
                let nan = |lo: u8, hi: u8| {
                    let v = u16::from_le_bytes([lo, hi]);
                    match dtype {
                        DType::F16 => f16::from_bits(v).is_nan(),
                        _ => bf16::from_bits(v).is_nan(),
                    }
                };
                for (what, got) in [("out of place", &out[1..]), ("in place", &ua[1..])] {
                    for (i, (g, w)) in got.chunks(2).zip(want.chunks(2)).enumerate() {
                        assert!(
                            g == w || (nan(g[0], g[1]) && nan(w[0], w[1])),
                            "{dtype:?} {op} {what} element {i}: {g:?} vs {w:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn alignment_check() {
        assert!(all_aligned(4, [0, 4, 4096]));
        assert!(!all_aligned(4, [0, 5, 8]));
        assert!(!all_aligned(8, [12, 16, 24]));
        assert!(all_aligned(1, [1, 3, 7]));
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

/// A transform of a reduction's result, applied once per element after the reduction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Finish {
    /// `Avg`: divide by the group size.
    DivN(usize),
    /// A scaled allreduce: multiply by the factor.
    Mul(f64),
}

/// Apply `f` to `bytes` bytes of `dtype` elements at `dst`.
///
/// # Safety
/// `dst` is valid for reads and writes of `bytes` bytes, aligned for `dtype`, and `bytes` is a
/// multiple of its size; nothing else accesses the range meanwhile.
pub(crate) unsafe fn finish_raw(dtype: DType, f: Finish, dst: *mut u8, bytes: usize) {
    unsafe fn go<T: Element>(f: Finish, dst: *mut u8, bytes: usize) {
        // SAFETY: forwarded contract.
        let s = unsafe { std::slice::from_raw_parts_mut(dst.cast::<T>(), bytes / size_of::<T>()) };
        match f {
            Finish::DivN(n) => s.iter_mut().for_each(|x| *x = x.div_n(n)),
            Finish::Mul(k) => s.iter_mut().for_each(|x| *x = x.mul_f64(k)),
        }
    }
    // SAFETY: forwarded contract, with the element type of `dtype`.
    unsafe {
        match dtype {
            DType::F32 => go::<f32>(f, dst, bytes),
            DType::F64 => go::<f64>(f, dst, bytes),
            DType::F16 => go::<f16>(f, dst, bytes),
            DType::BF16 => go::<bf16>(f, dst, bytes),
            DType::I8 => go::<i8>(f, dst, bytes),
            DType::U8 => go::<u8>(f, dst, bytes),
            DType::I32 => go::<i32>(f, dst, bytes),
            DType::I64 => go::<i64>(f, dst, bytes),
            _ => {}
        }
    }
}

/// `dst = src` with non-temporal stores: the destination's lines go to memory without being read
/// into the caches first (no read for ownership) and without evicting what is there. For large
/// copies whose destination is not read again soon; elsewhere a plain copy.
///
/// # Safety
/// `src..src+len` readable, `dst..dst+len` writable, the two disjoint.
pub(crate) unsafe fn copy_stream(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86_64; every access is inside the two ranges (the head and the
    // tail by `copy_nonoverlapping`, the body 64 bytes at a time), stores 16-byte aligned.
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        // Order the streaming stores before whatever follows (a send of these bytes, the
        // caller's reads after the collective returns).
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}
