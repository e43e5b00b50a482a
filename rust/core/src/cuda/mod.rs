//! The CUDA engine for ranks on one host: the symmetric pool (VMM memory mapped by every
//! local rank), rsccl's kernels (csrc_kernels/, compiled by NVRTC and cached), and the
//! launch path with its stream and error rules. See engine.rs.

pub mod driver;
pub mod engine;
pub mod heap;
pub mod kernels;
pub mod nccl;
pub mod pool;

pub use engine::{AllToAll, CudaCall, CudaEngine, CudaEvent, CudaKind, CudaStats};
