//! Element types and reduction operations.

use half::{bf16, f16};
pub use tutti_runtime::DType;

/// Reduction operations.
///
/// Integer sums and products wrap on overflow. `Avg` is the sum divided by the group size after
/// the reduction: rounded for floating point, truncated toward zero for integers (as NCCL's
/// `ncclAvg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over the ranks.
    Avg,
}

impl ReduceOp {
    /// All ops.
    pub const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// Code in the wire header's fingerprint.
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
        }
    }

    /// nccl-tests name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parse a name as printed by [`ReduceOp::name`].
    pub fn parse(s: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.name() == s)
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type the collectives can move and reduce. Implemented for `f32`, `f64`, `f16`, `bf16`,
/// `i8`, `u8`, `i32`, `i64`.
pub trait Element: Copy + Send + Sync + PartialOrd + Default + 'static + sealed::Sealed {
    /// Its dtype code.
    const DTYPE: DType;
    /// Combine two values.
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// Divide by the group size (for `Avg`).
    fn div_n(self, n: usize) -> Self;
    /// Multiply by `k` (a scaled allreduce; floats only: integers truncate toward zero).
    fn mul_f64(self, k: f64) -> Self;
    /// Convert a small integer exactly (test data).
    fn from_i64(v: i64) -> Self;
}

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn div_n(self, n: usize) -> Self {
                (self as i64 / n as i64) as $t
            }
            fn mul_f64(self, k: f64) -> Self {
                (self as f64 * k) as $t
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
int_element!(i8, DType::I8);
int_element!(u8, DType::U8);
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn div_n(self, n: usize) -> Self {
                self / n as $t
            }
            fn mul_f64(self, k: f64) -> Self {
                (f64::from(self) * k) as $t
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
float_element!(f32, DType::F32);
float_element!(f64, DType::F64);

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                // Computed in f32 and rounded once.
                let (x, y) = (a.to_f32(), b.to_f32());
                <$t>::from_f32(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                })
            }
            fn div_n(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
            fn mul_f64(self, k: f64) -> Self {
                <$t>::from_f64(self.to_f64() * k)
            }
            fn from_i64(v: i64) -> Self {
                <$t>::from_f32(v as f32)
            }
        }
    };
}
half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

/// View a typed slice as bytes.
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: every `Element` is plain old data without padding; the byte view covers exactly
    // the slice's memory and borrows it immutably.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), size_of_val(s)) }
}

/// View a typed slice as mutable bytes.
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as `as_bytes`, and every bit pattern is a valid value of every `Element`, so
    // writes through the byte view cannot create invalid values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), size_of_val(s)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_names_and_parsing_are_fixed() {
        // The codes travel in the wire header's fingerprint: they never change.
        for (op, code, name) in [
            (ReduceOp::Sum, 1, "sum"),
            (ReduceOp::Prod, 2, "prod"),
            (ReduceOp::Min, 3, "min"),
            (ReduceOp::Max, 4, "max"),
            (ReduceOp::Avg, 5, "avg"),
        ] {
            assert_eq!(op.code(), code, "{name}");
            assert_eq!(op.name(), name);
            assert_eq!(op.to_string(), name);
            assert_eq!(ReduceOp::parse(name), Some(op));
        }
        assert_eq!(ReduceOp::parse("mean"), None);
        assert_eq!(ReduceOp::parse(""), None);
    }
}
