//! rsccl's engine-independent core. Data flows down: `group` owns a topology from
//! `bootstrap`, a region from `memory`, and an `engine` that runs `collective`s and
//! completes `work`. Nothing here knows about Python; `rsccl-bindings` wraps it.

// First: its tables (`dtype_rows!`, `reduce_op_rows!`) are macros the modules below read.
#[macro_use]
pub mod dtype;

pub mod bootstrap;
pub mod collective;
pub mod config;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod group;
pub mod memory;
pub mod sync;
pub mod work;

pub use error::{Error, Result};
