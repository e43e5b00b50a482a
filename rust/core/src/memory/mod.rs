//! Memory rsccl owns: host symmetric regions (memfd) and their layout.

pub mod layout;
pub mod region;

pub use layout::Layout;
pub use region::HostRegion;
