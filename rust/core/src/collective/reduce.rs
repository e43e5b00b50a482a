//! Element-wise reduction of N equally long inputs into one output, on the CPU.
//!
//! Invariant: inputs are combined in the order given (rank 0, 1, ..., N-1) on every rank,
//! so every rank computes bitwise identical results. float16 and bfloat16 accumulate in
//! float32 and round once at the end. Integer SUM and PRODUCT wrap, as in torch. bool is
//! 0/1: SUM and MAX are OR, PRODUCT and MIN are AND (torch's convention for bool).

use half::{bf16, f16};

use crate::dtype::{DType, ReduceOp};

const BLOCK: usize = 512;

trait Acc: Copy + Default {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn and(self, o: Self) -> Self;
    fn or(self, o: Self) -> Self;
    fn xor(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! float_acc {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                if o < self {
                    o
                } else {
                    self
                }
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                if o > self {
                    o
                } else {
                    self
                }
            }
            // Bitwise ops are rejected on floats before any data moves (ReduceOp::check).
            fn and(self, _: Self) -> Self {
                self
            }
            fn or(self, _: Self) -> Self {
                self
            }
            fn xor(self, _: Self) -> Self {
                self
            }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_acc!(f32);
float_acc!(f64);

macro_rules! int_acc {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                Ord::min(self, o)
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                Ord::max(self, o)
            }
            #[inline(always)]
            fn and(self, o: Self) -> Self {
                self & o
            }
            #[inline(always)]
            fn or(self, o: Self) -> Self {
                self | o
            }
            #[inline(always)]
            fn xor(self, o: Self) -> Self {
                self ^ o
            }
            // AVG is rejected on integers (ReduceOp::check).
            fn div_n(self, _: usize) -> Self {
                self
            }
        }
    };
}
int_acc!(i8);
int_acc!(u8);
int_acc!(i32);
int_acc!(i64);

/// bool as 0/1 in a u8.
#[derive(Clone, Copy, Default)]
struct Bool01(u8);
impl Acc for Bool01 {
    fn add(self, o: Self) -> Self {
        Bool01(self.0 | o.0)
    }
    fn mul(self, o: Self) -> Self {
        Bool01(self.0 & o.0)
    }
    fn min(self, o: Self) -> Self {
        Bool01(self.0 & o.0)
    }
    fn max(self, o: Self) -> Self {
        Bool01(self.0 | o.0)
    }
    fn and(self, o: Self) -> Self {
        Bool01(self.0 & o.0)
    }
    fn or(self, o: Self) -> Self {
        Bool01(self.0 | o.0)
    }
    fn xor(self, o: Self) -> Self {
        Bool01(self.0 ^ o.0)
    }
    fn div_n(self, _: usize) -> Self {
        self
    }
}

/// An element type in memory and how it widens to its accumulator.
trait Elem: Copy {
    type A: Acc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
}

macro_rules! same_elem {
    ($t:ty) => {
        impl Elem for $t {
            type A = $t;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(a: $t) -> $t {
                a
            }
        }
    };
}
same_elem!(f32);
same_elem!(f64);
same_elem!(i8);
same_elem!(u8);
same_elem!(i32);
same_elem!(i64);

impl Elem for f16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> f16 {
        f16::from_f32(a)
    }
}
impl Elem for bf16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}

#[derive(Clone, Copy)]
#[repr(transparent)]
struct BoolByte(u8);
impl Elem for BoolByte {
    type A = Bool01;
    #[inline(always)]
    fn load(self) -> Bool01 {
        Bool01((self.0 != 0) as u8)
    }
    #[inline(always)]
    fn store(a: Bool01) -> BoolByte {
        BoolByte(a.0)
    }
}

#[inline(always)]
fn combine<T: Elem>(acc: &mut [T::A], src: &[T], op: ReduceOp) {
    macro_rules! each {
        ($f:ident) => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.$f(s.load());
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(add),
        ReduceOp::Product => each!(mul),
        ReduceOp::Min => each!(min),
        ReduceOp::Max => each!(max),
        ReduceOp::BAnd => each!(and),
        ReduceOp::BOr => each!(or),
        ReduceOp::BXor => each!(xor),
    }
}

/// # Safety
/// `out` is valid for `n` writes and every `ins[r]` for `n` reads of `T`; `out` may equal
/// one of the inputs exactly (each block is read fully before it is written) but must not
/// otherwise overlap them.
unsafe fn reduce_typed<T: Elem>(out: *mut T, ins: &[*const T], n: usize, op: ReduceOp, avg_over: usize) {
    let mut acc = [T::A::default(); BLOCK];
    let mut i = 0;
    while i < n {
        let m = BLOCK.min(n - i);
        let acc = &mut acc[..m];
        // SAFETY: caller guarantees ins[r] valid for n reads; [i, i+m) is within n.
        let first = std::slice::from_raw_parts(ins[0].add(i), m);
        for (a, s) in acc.iter_mut().zip(first) {
            *a = s.load();
        }
        for &src in &ins[1..] {
            // SAFETY: as above.
            combine::<T>(acc, std::slice::from_raw_parts(src.add(i), m), op);
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = a.div_n(avg_over);
            }
        }
        // SAFETY: out valid for n writes; the block of every input was fully read above.
        let dst = std::slice::from_raw_parts_mut(out.add(i), m);
        for (d, a) in dst.iter_mut().zip(acc.iter()) {
            *d = T::store(*a);
        }
        i += m;
    }
}

/// Reduce `count` elements of `dtype` from each of `ins` into `out`. AVG divides by
/// `avg_over` (the group size).
///
/// # Safety
/// As `reduce_typed`: `out` valid for `count` element writes, each input for `count`
/// element reads, all suitably aligned for `dtype` (rsccl slots and torch storage are).
pub unsafe fn reduce(out: *mut u8, ins: &[*const u8], count: usize, dtype: DType, op: ReduceOp, avg_over: usize) {
    if count == 0 || ins.is_empty() {
        return;
    }
    macro_rules! go {
        ($t:ty) => {{
            let ins_t: smallvec_like::Ptrs<$t> = smallvec_like::Ptrs::new(ins);
            reduce_typed::<$t>(out as *mut $t, ins_t.as_slice(), count, op, avg_over)
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::F16 => go!(f16),
        DType::BF16 => go!(bf16),
        DType::I8 => go!(i8),
        DType::U8 => go!(u8),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::Bool => go!(BoolByte),
    }
}

/// Typed pointer lists without a heap allocation on the collective path.
mod smallvec_like {
    use crate::memory::layout::MAX_LOCAL_RANKS;

    pub struct Ptrs<T> {
        p: [*const T; MAX_LOCAL_RANKS],
        n: usize,
    }

    impl<T> Ptrs<T> {
        pub fn new(src: &[*const u8]) -> Self {
            assert!(src.len() <= MAX_LOCAL_RANKS);
            let mut p = [std::ptr::null::<T>(); MAX_LOCAL_RANKS];
            for (d, s) in p.iter_mut().zip(src) {
                *d = *s as *const T;
            }
            Ptrs { p, n: src.len() }
        }

        pub fn as_slice(&self) -> &[*const T] {
            &self.p[..self.n]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Copy + Default>(ins: &[Vec<T>], dtype: DType, op: ReduceOp) -> Vec<T> {
        let n = ins[0].len();
        let mut out = vec![T::default(); n];
        let ptrs: Vec<*const u8> = ins.iter().map(|v| v.as_ptr() as *const u8).collect();
        // SAFETY: all vectors have n elements of the right type.
        unsafe { reduce(out.as_mut_ptr() as *mut u8, &ptrs, n, dtype, op, ins.len()) };
        out
    }

    #[test]
    fn float_ops_against_reference() {
        let a: Vec<f32> = (0..1500).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..1500).map(|i| (i as f32 * 0.11).cos()).collect();
        let s = run(&[a.clone(), b.clone()], DType::F32, ReduceOp::Sum);
        let m = run(&[a.clone(), b.clone()], DType::F32, ReduceOp::Min);
        let avg = run(&[a.clone(), b.clone()], DType::F32, ReduceOp::Avg);
        for i in 0..1500 {
            assert_eq!(s[i], a[i] + b[i]);
            assert_eq!(m[i], a[i].min(b[i]));
            assert_eq!(avg[i], (a[i] + b[i]) / 2.0);
        }
    }

    #[test]
    fn bf16_accumulates_in_f32() {
        // 256 + 1 + 1 in bf16 pairwise gives 256 (1 is below half an ulp at 256);
        // accumulated in f32 it gives 258, which bf16 represents exactly.
        let v = |x: f32| vec![bf16::from_f32(x); 3];
        let out = run(&[v(256.0), v(1.0), v(1.0)], DType::BF16, ReduceOp::Sum);
        assert_eq!(out[0].to_f32(), 258.0);
    }

    #[test]
    fn ints_wrap_and_bools_are_logical() {
        let out = run(&[vec![100i8, -3], vec![100i8, 5]], DType::I8, ReduceOp::Sum);
        assert_eq!(out, vec![-56i8, 2]);
        let out = run(&[vec![6i64, 12], vec![3i64, 10]], DType::I64, ReduceOp::BXor);
        assert_eq!(out, vec![5, 6]);
        let out = run(&[vec![1u8, 0, 1], vec![1u8, 0, 0]], DType::Bool, ReduceOp::Sum);
        assert_eq!(out, vec![1, 0, 1]);
        let out = run(&[vec![1u8, 0, 1], vec![1u8, 0, 0]], DType::Bool, ReduceOp::Product);
        assert_eq!(out, vec![1, 0, 0]);
    }

    #[test]
    fn in_place_output() {
        let mut a: Vec<i32> = (0..2000).collect();
        let b: Vec<i32> = (0..2000).map(|x| x * 2).collect();
        let ptrs = [a.as_ptr() as *const u8, b.as_ptr() as *const u8];
        // SAFETY: out aliases input 0 exactly, which reduce allows.
        unsafe { reduce(a.as_mut_ptr() as *mut u8, &ptrs, 2000, DType::I32, ReduceOp::Sum, 2) };
        assert!(a.iter().enumerate().all(|(i, v)| *v == 3 * i as i32));
    }
}
