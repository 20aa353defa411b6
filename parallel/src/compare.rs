//! Comparing tensors where a NaN or an infinity can never pass.
//!
//! candle's `max` reduction starts from the first element and compares with `<`, so a NaN
//! anywhere but element 0 is skipped and `(a - b).abs().max(0)` can report a small difference
//! for a tensor full of NaNs. [`max_abs_diff`] walks the values itself and returns infinity as
//! soon as either side holds a value that is not finite; the golden runner, the tests and the
//! examples all compare through it.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// The largest `|a[i] - b[i]|` over the elements of two tensors with the same number of
/// elements (shapes may differ), computed in f64; `f64::INFINITY` if any element of either is
/// NaN or infinite, so such a tensor fails every tolerance. Zero for empty tensors.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) if the element counts differ; a candle error if a
/// tensor cannot be read back as f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.elem_count() != b.elem_count() {
        return Err(crate::Error::Shape {
            rank: 0,
            layer: "max_abs_diff",
            detail: format!("{:?} vs {:?} hold different numbers of elements", a.dims(), b.dims()),
        });
    }
    let a = a.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let b = b.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok(max_abs_diff_values(&a, &b))
}

/// [`max_abs_diff`] on slices of f32 or f64 values (losses, say). Slices of different lengths
/// differ infinitely.
pub fn max_abs_diff_values<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    for (x, y) in a.iter().zip(b) {
        let (x, y): (f64, f64) = ((*x).into(), (*y).into());
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        let d = (x - y).abs();
        if d > worst {
            worst = d;
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    #[test]
    fn nan_or_inf_anywhere_fails() {
        let good = t(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(max_abs_diff(&good, &good).unwrap(), 0.0);
        assert_eq!(max_abs_diff(&good, &t(&[1.0, 2.0, 3.5, 4.0, 5.0])).unwrap(), 0.5);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in 0..5 {
                let mut v = vec![1.0, 2.0, 3.0, 4.0, 5.0];
                v[at] = bad;
                let d1 = max_abs_diff(&t(&v), &good).unwrap();
                let d2 = max_abs_diff(&good, &t(&v)).unwrap();
                assert!(d1.is_infinite() && d2.is_infinite(), "{bad} at {at}: {d1} {d2}");
                // Even against itself: a NaN gradient is wrong whatever it is compared with.
                assert!(max_abs_diff(&t(&v), &t(&v)).unwrap().is_infinite());
            }
        }
        // What the helper replaces: candle's max skips a NaN in a middle element.
        assert!(max_abs_diff_values(&[0.5f32, f32::NAN], &[0.5, 0.0]).is_infinite());
        assert!(max_abs_diff_values(&[0.5f64], &[0.5, 0.0]).is_infinite());
        assert_eq!(max_abs_diff_values(&[0.5f64, 2.0], &[0.5, 1.0]), 1.0);
        let mid = t(&[1.0, f32::NAN, 1.0]);
        let candle = (&mid - &t(&[1.0, 1.0, 1.0])).unwrap().abs().unwrap().max(0).unwrap();
        assert_eq!(candle.to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn counts_must_agree() {
        assert!(max_abs_diff(&t(&[1.0, 2.0]), &t(&[1.0])).is_err());
        let m = Tensor::from_slice(&[1f32, 2., 3., 4.], (2, 2), &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&m, &t(&[1.0, 2.0, 3.0, 4.0])).unwrap(), 0.0);
    }
}
