//! Element types and reduce operations: which combinations are valid, and their names
//! as torch prints them, so error messages speak the user's language.

use crate::error::{Error, Result};

/// Element types rsccl moves and reduces. Codes are stable: they travel in headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
    I8 = 4,
    U8 = 5,
    I32 = 6,
    I64 = 7,
    Bool = 8,
}

impl DType {
    pub const ALL: [DType; 9] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I8, DType::U8, DType::I32, DType::I64, DType::Bool];

    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// torch's spelling (`torch.float32` prints as `float32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

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

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

/// Reduce operations. Codes are rsccl's own (they travel in headers); torch's are matched
/// by name, since its numbering is not part of its API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Product = 1,
    Min = 2,
    Max = 3,
    BAnd = 4,
    BOr = 5,
    BXor = 6,
    Avg = 7,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 8] =
        [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor, ReduceOp::Avg];

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

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::BAnd => "BAND",
            ReduceOp::BOr => "BOR",
            ReduceOp::BXor => "BXOR",
            ReduceOp::Avg => "AVG",
        }
    }

    /// Whether `self` is defined on `dtype`: bitwise ops need integers or bool, AVG needs
    /// a floating type (an integer mean would silently truncate).
    pub fn check(self, dtype: DType) -> Result<()> {
        let ok = match self {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !dtype.is_float(),
            ReduceOp::Avg => dtype.is_float(),
            _ => true,
        };
        if ok {
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
