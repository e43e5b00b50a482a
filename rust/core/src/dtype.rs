//! Element types and reduce operations: which combinations are valid, and their names
//! as torch prints them, so error messages speak the user's language.

use crate::error::{Error, Result};

/// The dtype table: one row per element type rsccl moves and reduces, everything rsccl
/// knows of it in one place. Columns: the variant and its code (stable: codes travel in
/// headers and from Python), torch's name (`torch.float32` prints as `float32`), bytes,
/// whether it is a floating type, the tag of rsccl's CUDA reduction entry points
/// (`rs_<family>_<tag>`; `-`: the kernels do not reduce it), NCCL's `ncclDataType_t` (`-`:
/// NCCL has none; in parentheses: NCCL moves it as that type but does not reduce it, as a
/// sum of bools is not a bool) and tch's `Kind` (rsccl-tch). `DType` and its facts are made from it
/// here; `cuda::nccl::nccl_dtype`, `cuda::kernels::REDUCE_DTYPES` and rsccl-tch's
/// `dtype_of_kind` read the columns they need (`dtype_rows!(their_macro)`), so a new dtype
/// is one row here, its host reduction (collective/reduce.rs) and, to reduce it on CUDA,
/// its kernels' entry points (csrc_kernels/common.cuh).
#[macro_export]
#[doc(hidden)]
macro_rules! dtype_rows {
    ($then:ident) => {
        $then! {
            // variant = code, torch name,  bytes, float, kernel tag, NCCL type,    tch Kind
            F32  = 0, "float32",  4, true,  f32,  ncclFloat32,  Float;
            F64  = 1, "float64",  8, true,  -,    ncclFloat64,  Double;
            F16  = 2, "float16",  2, true,  f16,  ncclFloat16,  Half;
            BF16 = 3, "bfloat16", 2, true,  bf16, ncclBfloat16, BFloat16;
            I8   = 4, "int8",     1, false, -,    ncclInt8,     Int8;
            U8   = 5, "uint8",    1, false, -,    ncclUint8,    Uint8;
            I32  = 6, "int32",    4, false, i32,  ncclInt32,    Int;
            I64  = 7, "int64",    8, false, i64,  ncclInt64,    Int64;
            Bool = 8, "bool",     1, false, -,  (ncclUint8),  Bool;
        }
    };
}

/// `Some(stringify!(x))` for a table cell `x`, None for `-`.
macro_rules! cell_str {
    (-) => {
        None
    };
    ($x:ident) => {
        Some(stringify!($x))
    };
}

/// Whether a table cell is set (not `-`, nor in parentheses: a type NCCL moves but does
/// not reduce).
macro_rules! cell_set {
    (-) => {
        false
    };
    (($x:ident)) => {
        false
    };
    ($x:ident) => {
        true
    };
}

macro_rules! define_dtypes {
    ($($v:ident = $code:literal, $name:literal, $size:literal, $float:literal, $tag:tt, $nccl:tt, $tch:tt;)*) => {
        /// Element types rsccl moves and reduces (the table: `dtype_rows!`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum DType {
            $($v = $code,)*
        }

        impl DType {
            pub const ALL: [DType; [$($code),*].len()] = [$(DType::$v),*];

            pub const fn size(self) -> usize {
                match self {
                    $(DType::$v => $size,)*
                }
            }

            /// torch's spelling (`torch.float32` prints as `float32`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(DType::$v => $name,)*
                }
            }

            pub const fn is_float(self) -> bool {
                match self {
                    $(DType::$v => $float,)*
                }
            }

            /// The tag of rsccl's CUDA reduction entry points for this dtype
            /// (`rs_ar_twoshot_bf16`), or None if its kernels do not reduce it.
            pub const fn kernel_tag(self) -> Option<&'static str> {
                match self {
                    $(DType::$v => cell_str!($tag),)*
                }
            }

            /// Whether NCCL reduces this dtype (the NCCL column is a type, not `-` nor
            /// parenthesized).
            pub const fn nccl_reduces(self) -> bool {
                match self {
                    $(DType::$v => cell_set!($nccl),)*
                }
            }
        }
    };
}

dtype_rows!(define_dtypes);

impl DType {
    pub fn from_name(name: &str) -> Result<DType> {
        let short = name.strip_prefix("torch.").unwrap_or(name);
        DType::ALL.iter().copied().find(|d| d.name() == short).ok_or_else(|| {
            Error::InvalidType(format!(
                "rsccl does not support dtype {short}; supported: {}",
                DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
            ))
        })
    }

    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as u8 == code)
    }

    /// How many dtypes have a kernel tag.
    pub const fn kernel_tagged() -> usize {
        let (mut i, mut n) = (0, 0);
        while i < DType::ALL.len() {
            n += DType::ALL[i].kernel_tag().is_some() as usize;
            i += 1;
        }
        n
    }

    /// The dtypes that have a kernel tag, in table order: what rsccl's CUDA kernels
    /// reduce (`cuda::kernels::REDUCE_DTYPES`). `N` is their count (`kernel_tagged`).
    pub const fn with_kernel_tag<const N: usize>() -> [DType; N] {
        let mut out = [DType::U8; N];
        let (mut i, mut n) = (0, 0);
        while i < DType::ALL.len() {
            if DType::ALL[i].kernel_tag().is_some() {
                out[n] = DType::ALL[i];
                n += 1;
            }
            i += 1;
        }
        assert!(n == N, "N is not the number of dtypes with a kernel tag");
        out
    }
}

/// The reduce-op table. Columns: the variant and its code (rsccl's own: it travels in
/// headers and in the kernels' descriptors, abi.cuh's `OP_*`; torch's numbering is not
/// part of its API, so torch's ops are matched by name), torch's `RedOpType` name, the
/// dtypes it is defined on (`any`; `ints`: integers and bool, the bitwise ops; `floats`:
/// AVG, as an integer mean would silently truncate), whether rsccl's CUDA kernels reduce
/// with it (`kernel`, else `-`) and NCCL's `ncclRedOp_t` (`-`: none). `ReduceOp` is made
/// from it here, `cuda::kernels::REDUCE_OPS` and `cuda::nccl::nccl_op` read it.
#[macro_export]
#[doc(hidden)]
macro_rules! reduce_op_rows {
    ($then:ident) => {
        $then! {
            // variant = code, torch name, defined on, CUDA kernels, NCCL op
            Sum     = 0, "SUM",     any,    kernel, ncclSum;
            Product = 1, "PRODUCT", any,    kernel, ncclProd;
            Min     = 2, "MIN",     any,    kernel, ncclMin;
            Max     = 3, "MAX",     any,    kernel, ncclMax;
            BAnd    = 4, "BAND",    ints,   -,      -;
            BOr     = 5, "BOR",     ints,   -,      -;
            BXor    = 6, "BXOR",    ints,   -,      -;
            Avg     = 7, "AVG",     floats, kernel, ncclAvg;
        }
    };
}

macro_rules! defined_on {
    (any, $d:expr) => {
        true
    };
    (ints, $d:expr) => {
        !$d.is_float()
    };
    (floats, $d:expr) => {
        $d.is_float()
    };
}

macro_rules! define_reduce_ops {
    ($($v:ident = $code:literal, $name:literal, $on:ident, $kernel:tt, $nccl:tt;)*) => {
        /// Reduce operations (the table: `reduce_op_rows!`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum ReduceOp {
            $($v = $code,)*
        }

        impl ReduceOp {
            pub const ALL: [ReduceOp; [$($code),*].len()] = [$(ReduceOp::$v),*];

            pub const fn name(self) -> &'static str {
                match self {
                    $(ReduceOp::$v => $name,)*
                }
            }

            /// Whether `self` is defined on `dtype` (the table's "defined on").
            pub const fn defined_on(self, dtype: DType) -> bool {
                match self {
                    $(ReduceOp::$v => defined_on!($on, dtype),)*
                }
            }

            /// Whether rsccl's CUDA kernels reduce with it (on the dtypes both are defined on).
            pub const fn in_kernels(self) -> bool {
                match self {
                    $(ReduceOp::$v => cell_set!($kernel),)*
                }
            }

            /// Whether NCCL reduces with it (the table's NCCL op is set).
            pub const fn in_nccl(self) -> bool {
                match self {
                    $(ReduceOp::$v => cell_set!($nccl),)*
                }
            }
        }
    };
}

reduce_op_rows!(define_reduce_ops);

impl ReduceOp {
    /// How many ops rsccl's CUDA kernels reduce with.
    pub const fn in_kernels_count() -> usize {
        let (mut i, mut n) = (0, 0);
        while i < ReduceOp::ALL.len() {
            n += ReduceOp::ALL[i].in_kernels() as usize;
            i += 1;
        }
        n
    }

    /// The ops rsccl's CUDA kernels reduce with, in table order
    /// (`cuda::kernels::REDUCE_OPS`). `N` is their count (`in_kernels_count`).
    pub const fn in_kernels_all<const N: usize>() -> [ReduceOp; N] {
        let mut out = [ReduceOp::Sum; N];
        let (mut i, mut n) = (0, 0);
        while i < ReduceOp::ALL.len() {
            if ReduceOp::ALL[i].in_kernels() {
                out[n] = ReduceOp::ALL[i];
                n += 1;
            }
            i += 1;
        }
        assert!(n == N, "N is not the number of ops the kernels reduce with");
        out
    }

    /// From torch's `ReduceOp.RedOpType` member name ("SUM", "AVG", ...).
    pub fn from_name(name: &str) -> Result<ReduceOp> {
        let short = name.rsplit('.').next().unwrap_or(name);
        ReduceOp::ALL.iter().copied().find(|o| o.name() == short).ok_or_else(|| {
            Error::InvalidType(format!(
                "rsccl does not support ReduceOp.{short}; supported: {}",
                ReduceOp::ALL.iter().map(|o| o.name()).collect::<Vec<_>>().join(", ")
            ))
        })
    }

    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.iter().copied().find(|o| *o as u8 == code)
    }

    /// Whether `self` is defined on `dtype`: bitwise ops need integers or bool, AVG needs
    /// a floating type (an integer mean would silently truncate).
    pub fn check(self, dtype: DType) -> Result<()> {
        if self.defined_on(dtype) {
            Ok(())
        } else {
            Err(Error::InvalidType(format!("ReduceOp.{} is not defined on dtype {}", self.name(), dtype.name())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()).unwrap(), d);
            assert_eq!(DType::from_name(&format!("torch.{}", d.name())).unwrap(), d);
            assert_eq!(DType::from_code(d as u8), Some(d));
        }
        let err = DType::from_name("complex64").unwrap_err().to_string();
        assert!(err.contains("complex64") && err.contains("bfloat16"), "{err}");
    }

    /// The columns other modules read, as the tables give them.
    #[test]
    fn the_tables_columns() {
        let tagged: Vec<_> = DType::ALL.iter().filter_map(|d| d.kernel_tag()).collect();
        assert_eq!(tagged, ["f32", "f16", "bf16", "i32", "i64"]);
        assert_eq!(DType::with_kernel_tag::<5>(), [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64]);
        assert_eq!(ReduceOp::in_kernels_all::<5>(), [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg]);
        let sizes: Vec<_> = DType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [4, 8, 2, 2, 1, 1, 4, 8, 1]);
        let floats: Vec<_> = DType::ALL.iter().filter(|d| d.is_float()).map(|d| d.name()).collect();
        assert_eq!(floats, ["float32", "float64", "float16", "bfloat16"]);
    }

    #[test]
    fn op_dtype_rules() {
        assert!(ReduceOp::BXor.check(DType::I32).is_ok());
        assert!(ReduceOp::BXor.check(DType::Bool).is_ok());
        assert!(ReduceOp::BAnd.check(DType::F32).is_err());
        assert!(ReduceOp::Avg.check(DType::BF16).is_ok());
        let msg = ReduceOp::Avg.check(DType::I64).unwrap_err().to_string();
        assert!(msg.contains("AVG") && msg.contains("int64"), "{msg}");
        assert!(ReduceOp::from_name("PREMUL_SUM").is_err());
        assert_eq!(ReduceOp::from_name("RedOpType.AVG").unwrap(), ReduceOp::Avg);
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(o as u8), Some(o));
        }
    }
}
