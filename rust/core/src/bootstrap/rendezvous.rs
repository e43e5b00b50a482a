//! Who is where: each rank publishes a typed `RankInfo` in the store; every rank reads all
//! of them and derives the same `Topology`.

use std::time::Duration;

use super::Store;
use crate::error::{Error, Result};

/// What a rank tells the others at group creation. Encoded as a versioned binary record,
/// not a string protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub pid: u32,
    pub uid: u32,
    pub host_id: String,
}

const INFO_MAGIC: &[u8; 4] = b"RSI1";

impl RankInfo {
    pub fn current(host_id: String) -> RankInfo {
        // SAFETY: getuid cannot fail.
        RankInfo { pid: std::process::id(), uid: unsafe { libc::getuid() }, host_id }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(16 + self.host_id.len());
        v.extend_from_slice(INFO_MAGIC);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.uid.to_le_bytes());
        v.extend_from_slice(&(self.host_id.len() as u32).to_le_bytes());
        v.extend_from_slice(self.host_id.as_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Result<RankInfo> {
        let bad = || Error::Internal(format!("malformed rank record of {} bytes in the store", b.len()));
        if b.len() < 16 || &b[..4] != INFO_MAGIC {
            return Err(Error::PeerFailure(
                "a rank published an incompatible record: are all ranks running the same rsccl version?".into(),
            ));
        }
        let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let n = u(12) as usize;
        let host = b.get(16..16 + n).ok_or_else(bad)?;
        Ok(RankInfo { pid: u(4), uid: u(8), host_id: String::from_utf8(host.to_vec()).map_err(|_| bad())? })
    }
}

/// This host's identity: `RSCCL_HOST_ID` if set (tests use it to make one machine act as
/// several hosts), else hostname + kernel boot id (distinct across machines and reboots).
pub fn host_identity() -> String {
    if let Ok(v) = std::env::var("RSCCL_HOST_ID") {
        if !v.is_empty() {
            return v;
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}:{}", host.trim(), boot.trim())
}

/// Which ranks of a group share a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub rank: usize,
    pub size: usize,
    /// Host index of every rank; hosts are numbered in order of their lowest rank.
    pub host_of: Vec<usize>,
    /// Ranks of every host, ascending.
    pub hosts: Vec<Vec<usize>>,
    pub pids: Vec<u32>,
}

impl Topology {
    pub fn from_infos(rank: usize, infos: &[RankInfo]) -> Topology {
        let mut ids: Vec<&str> = Vec::new();
        let mut host_of = Vec::with_capacity(infos.len());
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (r, info) in infos.iter().enumerate() {
            let h = match ids.iter().position(|id| *id == info.host_id) {
                Some(h) => h,
                None => {
                    ids.push(&info.host_id);
                    hosts.push(Vec::new());
                    ids.len() - 1
                }
            };
            host_of.push(h);
            hosts[h].push(r);
        }
        Topology { rank, size: infos.len(), host_of, hosts, pids: infos.iter().map(|i| i.pid).collect() }
    }

    pub fn single_host(&self) -> bool {
        self.hosts.len() == 1
    }

    pub fn local_ranks(&self) -> &[usize] {
        &self.hosts[self.host_of[self.rank]]
    }

    pub fn local_index(&self) -> usize {
        self.local_ranks().iter().position(|&r| r == self.rank).expect("rank is on its own host")
    }
}

/// Publish this rank's record and read everyone's. `rank 0` also publishes a random nonce
/// that names this group's sockets, returned to all.
pub fn exchange(
    store: &dyn Store,
    rank: usize,
    size: usize,
    info: &RankInfo,
    timeout: Duration,
    before_publish: impl FnOnce(&[u8; 16]) -> Result<()>,
) -> Result<([u8; 16], Topology)> {
    if rank == 0 {
        store.set("rsccl/nonce", &random_nonce()?)?;
    }
    let nonce_v = store.get("rsccl/nonce", timeout)?;
    let nonce: [u8; 16] =
        nonce_v.as_slice().try_into().map_err(|_| Error::Internal("bad nonce record in the store".into()))?;
    before_publish(&nonce)?;
    store.set(&format!("rsccl/info/{rank}"), &info.encode())?;
    let mut infos = Vec::with_capacity(size);
    for r in 0..size {
        let raw = store.get(&format!("rsccl/info/{r}"), timeout).map_err(|e| match e {
            Error::Timeout(_) => Error::Timeout(format!(
                "rank {r} did not join the group within {:.1} s (rank {rank} waited for it at group creation)",
                timeout.as_secs_f64()
            )),
            other => other,
        })?;
        infos.push(RankInfo::decode(&raw)?);
    }
    Ok((nonce, Topology::from_infos(rank, &infos)))
}

fn random_nonce() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    // SAFETY: `b` is writable for 16 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    if n != 16 {
        return Err(Error::last_os("getrandom for the group nonce"));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(h: &str) -> RankInfo {
        RankInfo { pid: 7, uid: 0, host_id: h.into() }
    }

    #[test]
    fn record_round_trip() {
        let i = RankInfo { pid: 123, uid: 1000, host_id: "node-1:abc".into() };
        assert_eq!(RankInfo::decode(&i.encode()).unwrap(), i);
        assert!(RankInfo::decode(b"garbage").is_err());
    }

    #[test]
    fn topology_groups_by_host() {
        let t = Topology::from_infos(3, &[info("a"), info("b"), info("a"), info("b")]);
        assert_eq!(t.hosts, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(t.local_ranks(), &[1, 3]);
        assert_eq!(t.local_index(), 1);
        assert!(!t.single_host());
        let t = Topology::from_infos(0, &[info("a"), info("a")]);
        assert!(t.single_host());
    }
}
