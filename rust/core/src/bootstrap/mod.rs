//! Rendezvous over the c10d Store, topology (which ranks share a host), and the local
//! mesh of Unix sockets that hands the host region's descriptor to every local rank.

pub mod mesh;
pub mod rendezvous;
pub mod setup;
pub mod unix;

use std::time::Duration;

use crate::error::Result;

/// The subset of torch's c10d Store rsccl needs. Keys are already prefixed per group by
/// torch (`PrefixStore`), so they are unique per group.
pub trait Store: Send + Sync {
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Block until `key` exists (at most `timeout`), then return its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically add `delta` to the integer at `key` (0 if absent); return the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
}

pub use mesh::LocalMesh;
pub use rendezvous::{check_same_settings, host_identity, RankInfo, Topology};
pub use setup::{Phase, SetupWatch};
