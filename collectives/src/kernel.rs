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
            if dst as *const u8 == a {
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
        DType::F16 => typed::<f16>(op, dst, a, b, bytes),
        DType::BF16 => typed::<bf16>(op, dst, a, b, bytes),
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
    fn unaligned_path() {
        let mut buf = vec![0u8; 1 + 16];
        let src = as_bytes(&[1.5f32, 2.5, 3.5, 4.5]).to_vec();
        let dst = &mut buf[1..17];
        dst.copy_from_slice(as_bytes(&[1.0f32; 4]));
        reduce_into(DType::F32, ReduceOp::Sum, dst, &src);
        let got: Vec<f32> =
            dst.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, [2.5, 3.5, 4.5, 5.5]);
    }
}
