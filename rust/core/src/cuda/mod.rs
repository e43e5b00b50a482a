//! CUDA: the driver layer (driver.rs: checked calls and RAII owners of its handles),
//! rsccl's kernels (kernels/: csrc_kernels/, prebuilt or compiled by NVRTC and cached),
//! the engine for ranks on one host (engine/: the launch path with its error rules, on the
//! symmetric pool of memory/device_pool.rs), its pure choices (decide.rs), the launch
//! order both engines share (order.rs: target streams, joins, the Work's events), the
//! SMs every group of the process draws from on each device (budget.rs, NOTE [SM budget]),
//! and the NCCL engine for groups that span hosts (nccl.rs, nccl_engine/), which uses the
//! former inside each host.

pub mod budget;
pub mod call;
pub mod decide;
pub mod driver;
pub mod engine;
pub mod kernels;
pub mod nccl;
pub mod nccl_engine;
pub mod order;

// The device pool and heap live in memory/; their old paths stay.
pub use crate::memory::device_heap as heap;
pub use crate::memory::device_pool as pool;
pub use engine::{CudaCall, CudaEngine, CudaStats};
pub use nccl_engine::{NcclEngine, NcclStats};
pub use order::{CudaEvent, EventHome};
