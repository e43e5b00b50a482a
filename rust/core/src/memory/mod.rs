//! Memory rsccl owns: host symmetric regions (memfd) and their layout; on the GPU, the
//! symmetric pool every local rank maps (device_pool) and the allocator torch's
//! rsccl.mem_pool draws from it (device_heap).

pub mod device_heap;
pub mod device_pool;
pub mod layout;
pub mod region;

pub use layout::Layout;
pub use region::HostRegion;
