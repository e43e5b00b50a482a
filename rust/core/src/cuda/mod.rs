//! CUDA: the engine for ranks on one host (the symmetric pool, VMM memory mapped by every
//! local rank; rsccl's kernels, csrc_kernels/, compiled by NVRTC and cached; the launch
//! path with its stream and error rules: engine.rs), and the NCCL engine for groups that
//! span hosts (nccl.rs, nccl_engine.rs), which uses the former inside each host.

pub mod call;
pub mod decide;
pub mod driver;
pub mod engine;
pub mod heap;
pub mod kernels;
pub mod nccl;
pub mod nccl_engine;
pub mod pool;

pub use engine::{AllToAll, CudaCall, CudaEngine, CudaEvent, CudaKind, CudaStats, EventHome};
pub use nccl_engine::{NcclEngine, NcclStats};
