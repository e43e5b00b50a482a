//! rsccl for Rust programs that train with tch (libtorch): a process group over
//! `tch::Tensor`s, launched by torchrun.
//!
//! ```no_run
//! use rsccl_tch::{ProcessGroup, ReduceOp};
//! let pg = ProcessGroup::from_env()?; // torchrun --nproc_per_node=4 --no-python ./trainer
//! let grad = tch::Tensor::ones([1024], (tch::Kind::Float, tch::Device::Cpu));
//! pg.all_reduce(&grad, ReduceOp::Avg)?;
//! # Ok::<(), rsccl_tch::Error>(())
//! ```
//!
//! The group joins through the c10d TCPStore that torchrun serves (`store`: a Rust client
//! of torch's protocol; without torchrun rank 0 hosts one). CPU tensors go through
//! rsccl-core's shared-memory engine, CUDA tensors through its CUDA engine on the
//! tensor's GPU, after libtorch's current stream. Errors are rsccl-core's, as the Python
//! side maps them: `InvalidArgument`/`InvalidType`/`Mismatch`/`Config` (ValueError /
//! TypeError there), `Timeout`, `PeerFailure` (a rank died), `Aborted`. This crate is not
//! part of the Python wheel, which must not link libtorch. See docs/rust.md.

pub mod cuda;
mod group;
pub mod options;
pub mod store;
mod tensor;
mod work;

pub use group::{MemoryStats, ProcessGroup};
pub use options::{settings, CudaDevice, LaunchEnv, Options, SettingInfo};
pub use rsccl_core::cuda::{CudaStats, NcclStats};
pub use rsccl_core::dtype::ReduceOp;
pub use rsccl_core::{Error, Result};
pub use store::{StoreServer, TcpStore};
pub use work::Work;
