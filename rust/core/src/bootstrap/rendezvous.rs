//! Who is where: each rank publishes a typed `RankInfo` in the store; every rank reads all
//! of them and derives the same `Topology`.

use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// What a rank tells the others at group creation. Encoded as a versioned binary record,
/// not a string protocol.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankInfo {
    pub pid: u32,
    pub uid: u32,
    /// Its rank in the default group (what torch users call "the rank"), for messages.
    pub global_rank: u32,
    /// Its pid namespace (`pid_namespace`): `pid` is meaningful to a peer only if
    /// theirs is the same.
    pub pid_ns: u64,
    pub host_id: String,
    /// The abstract name of its local socket, bound before this record was published
    /// (bootstrap/unix.rs: random, so no one can take it first).
    pub socket: String,
    /// The settings that shape the shared region and the algorithms
    /// (`Config::layout_settings`): every rank must have the same.
    pub settings: Vec<u64>,
}

const INFO_MAGIC: &[u8; 4] = b"RSI4";
const INFO_FIXED: usize = 36;

impl RankInfo {
    pub fn current(host_id: String, settings: Vec<u64>, global_rank: usize, socket: &str) -> RankInfo {
        RankInfo {
            pid: std::process::id(),
            // SAFETY: getuid cannot fail.
            uid: unsafe { libc::getuid() },
            global_rank: global_rank as u32,
            pid_ns: pid_namespace(),
            host_id,
            socket: socket.to_string(),
            settings,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(INFO_FIXED + self.host_id.len() + self.socket.len() + 8 * self.settings.len());
        v.extend_from_slice(INFO_MAGIC);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.uid.to_le_bytes());
        v.extend_from_slice(&self.global_rank.to_le_bytes());
        v.extend_from_slice(&self.pid_ns.to_le_bytes());
        v.extend_from_slice(&(self.host_id.len() as u32).to_le_bytes());
        v.extend_from_slice(&(self.settings.len() as u32).to_le_bytes());
        v.extend_from_slice(&(self.socket.len() as u32).to_le_bytes());
        v.extend_from_slice(self.host_id.as_bytes());
        v.extend_from_slice(self.socket.as_bytes());
        for s in &self.settings {
            v.extend_from_slice(&s.to_le_bytes());
        }
        v
    }

    pub fn decode(b: &[u8]) -> Result<RankInfo> {
        let bad = || Error::Internal(format!("malformed rank record of {} bytes in the store", b.len()));
        if b.len() < INFO_FIXED || &b[..4] != INFO_MAGIC {
            return Err(Error::PeerFailure(
                "a rank published an incompatible record: are all ranks running the same rsccl version?".into(),
            ));
        }
        let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let (n, k, m) = (u(24) as usize, u(28) as usize, u(32) as usize);
        let host = b.get(INFO_FIXED..INFO_FIXED + n).ok_or_else(bad)?;
        let socket = b.get(INFO_FIXED + n..INFO_FIXED + n + m).ok_or_else(bad)?;
        let raw = b.get(INFO_FIXED + n + m..INFO_FIXED + n + m + 8 * k).ok_or_else(bad)?;
        let settings = raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        Ok(RankInfo {
            pid: u(4),
            uid: u(8),
            global_rank: u(12),
            pid_ns: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            host_id: String::from_utf8(host.to_vec()).map_err(|_| bad())?,
            socket: String::from_utf8(socket.to_vec()).map_err(|_| bad())?,
            settings,
        })
    }
}

/// Every rank must run with the same layout settings: they decide the region's layout and
/// the algorithm each rank runs, and ranks that differ would read each other's data at
/// the wrong places. Names the first rank that differs from rank 0, and the setting.
pub fn check_same_settings(infos: &[RankInfo], names: &[(&str, &str)]) -> Result<()> {
    for (r, info) in infos.iter().enumerate().skip(1) {
        for (i, (a, b)) in infos[0].settings.iter().zip(&info.settings).enumerate() {
            if a != b {
                let (field, env) = names.get(i).copied().unwrap_or(("?", "?"));
                return Err(Error::Config(format!(
                    "ranks disagree on {field} ({env}): rank 0 has {a}, rank {r} has {b}; \
                     every rank of a group must use the same rsccl settings"
                )));
            }
        }
    }
    Ok(())
}

/// This host's identity: `RSCCL_HOST_ID` if set (tests use it to make one machine act as
/// several hosts), else hostname + kernel boot id (distinct across machines and reboots).
/// A value of `RSCCL_HOST_ID` that is not UTF-8 is an error naming it.
pub fn host_identity() -> Result<String> {
    if let Some(v) = crate::config::env_var("RSCCL_HOST_ID")?.filter(|v| !v.is_empty()) {
        return Ok(v);
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    Ok(format!("{}:{}", host.trim(), boot.trim()))
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
/// that this group's handshakes carry, returned to all.
///
/// Keys carry a generation: torch reuses a group's store prefix when a job destroys and
/// re-creates its groups, and stale records of the previous generation must not be read.
/// Each rank adds 1 to a counter once per creation, so creation g sees values in
/// [g*size + 1, (g+1)*size] and all its ranks compute the same g.
///
/// Two processes started as the same rank: each rank claims its number in its generation
/// (`claim/<rank>`); the second claimer publishes why (`duplicate`) and fails at once. The
/// other ranks of that generation wait for the rank that the duplicate displaced, and at
/// their timeout raise the duplicate's text instead of a bare timeout. (Their waits are
/// plain blocking store waits: polling for the marker would make torch's TCPStore log a
/// warning at every poll.) A duplicate that arrives after its generation was complete
/// lands alone in the next one; at its timeout, the record of its rank in the generation
/// before, published by another process, names the cause (`duplicate_behind`).
pub fn exchange(store: &dyn Store, rank: usize, size: usize, info: &RankInfo, timeout: Duration) -> Result<([u8; 16], Vec<RankInfo>)> {
    let deadline = Instant::now() + timeout;
    let ticket = store.add("rsccl/creations", 1).map_err(store_failed)?;
    let gen = (ticket - 1).max(0) as u64 / size as u64;
    let key = |k: &str| format!("rsccl/{gen}/{k}");
    if store.add(&key(&format!("claim/{rank}")), 1).map_err(store_failed)? > 1 {
        let host = info.host_id.split(':').next().unwrap_or_default();
        let text = format!(
            "rank {rank} was claimed by two processes: pid {} on host {host} is the second to join this group as rank {rank}; \
             every process of a group needs its own rank (check RANK, or the rank passed to init_process_group)",
            info.pid
        );
        store.set(&key("duplicate"), text.as_bytes()).map_err(store_failed)?;
        store.add(&key("duplicates"), 1).map_err(store_failed)?;
        return Err(Error::InvalidArgument(text));
    }
    if rank == 0 {
        store.set(&key("nonce"), &random_nonce()?).map_err(store_failed)?;
    }
    let wait = |k: &str, what: &dyn Fn() -> String| -> Result<Vec<u8>> {
        store.get(&key(k), deadline.saturating_duration_since(Instant::now())).map_err(|e| match e {
            Error::Timeout(_) => match duplicate_behind(store, gen, rank, info) {
                Some(why) => Error::InvalidArgument(format!("{why} ({})", what())),
                None => Error::Timeout(what()),
            },
            other => store_failed(other),
        })
    };
    let nonce_v = wait("nonce", &|| {
        format!("rank 0 did not start the group within {:.1} s (rank {rank} waited for its nonce at group creation)", timeout.as_secs_f64())
    })?;
    let nonce: [u8; 16] = nonce_v.as_slice().try_into().map_err(|_| Error::Internal("bad nonce record in the store".into()))?;
    store.set(&key(&format!("info/{rank}")), &info.encode()).map_err(store_failed)?;
    let mut infos = Vec::with_capacity(size);
    for r in 0..size {
        let raw = wait(&format!("info/{r}"), &|| {
            format!("rank {r} did not join the group within {:.1} s (rank {rank} waited for it at group creation)", timeout.as_secs_f64())
        })?;
        infos.push(RankInfo::decode(&raw)?);
    }
    Ok((nonce, infos))
}

/// Why generation `gen` did not complete for this rank (`info`), if a duplicated rank is
/// the cause: a rank of this generation was claimed twice; or one of the generation
/// before was (which pushed a process into this one); or this rank's record there came
/// from another process (this process is the second of its rank).
fn duplicate_behind(store: &dyn Store, gen: u64, rank: usize, info: &RankInfo) -> Option<String> {
    let marker = |g: u64| -> Option<String> {
        let key = |k: &str| format!("rsccl/{g}/{k}");
        if store.add(&key("duplicates"), 0).ok()? == 0 {
            return None;
        }
        store.get(&key("duplicate"), Duration::from_secs(5)).ok().map(|t| String::from_utf8_lossy(&t).into_owned())
    };
    if let Some(text) = marker(gen) {
        return Some(text);
    }
    let before = gen.checked_sub(1)?;
    if let Some(text) = marker(before) {
        return Some(format!("{text}; this process (rank {rank}) was left out of that creation"));
    }
    let prev = |k: &str| format!("rsccl/{before}/{k}");
    let raw = store.get(&prev(&format!("info/{rank}")), Duration::from_millis(1)).ok()?;
    let first = RankInfo::decode(&raw).ok()?;
    if (first.pid, first.pid_ns, &first.host_id) == (info.pid, info.pid_ns, &info.host_id) {
        return None; // this process's own record: a re-creation, not a duplicate
    }
    let host = |i: &RankInfo| i.host_id.split(':').next().unwrap_or_default().to_string();
    Some(format!(
        "rank {rank} was claimed by two processes: pid {} on host {} joined this group as rank {rank} before this process \
         (pid {} on host {}) did; every process of a group needs its own rank (check RANK, or the rank passed to init_process_group)",
        first.pid,
        host(&first),
        info.pid,
        host(info)
    ))
}

/// A store call failed (not a timeout): with a TCPStore the usual cause is that the
/// process hosting its server exited, and that process is often one of the ranks.
fn store_failed(e: Error) -> Error {
    match e {
        Error::PeerFailure(m) => Error::PeerFailure(format!(
            "the c10d store failed ({m}): the process that hosts it (the TCPStore server; rank 0's with \
             init_method env:// or tcp://) has probably exited"
        )),
        other => other,
    }
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

/// An in-memory store, as torch's HashStore (for the tests of the modules that use a store).
/// This process's pid namespace (the inode of /proc/self/ns/pid; 0 if unknown). A pid in
/// another rank's record means the same process here only if the namespaces match.
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).unwrap_or(0)
}

#[cfg(test)]
#[derive(Default)]
pub(crate) struct MemStore(parking_lot::Mutex<std::collections::HashMap<String, Vec<u8>>>);

#[cfg(test)]
impl Store for MemStore {
    fn set(&self, k: &str, v: &[u8]) -> Result<()> {
        self.0.lock().insert(k.into(), v.into());
        Ok(())
    }
    fn get(&self, k: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.0.lock().get(k).cloned() {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(k.into()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    fn add(&self, k: &str, d: i64) -> Result<i64> {
        let mut m = self.0.lock();
        let v = m.get(k).map_or(0, |b| i64::from_le_bytes(b[..8].try_into().unwrap())) + d;
        m.insert(k.into(), v.to_le_bytes().to_vec());
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(h: &str) -> RankInfo {
        RankInfo { pid: 7, host_id: h.into(), settings: vec![1, 2], ..Default::default() }
    }

    #[test]
    fn record_round_trip() {
        let i = RankInfo {
            pid: 123,
            uid: 1000,
            global_rank: 9,
            pid_ns: 4026531836,
            host_id: "node-1:abc".into(),
            socket: "rsccl-00ff".into(),
            settings: vec![4 << 20, 0, 7],
        };
        assert_eq!(RankInfo::decode(&i.encode()).unwrap(), i);
        assert!(RankInfo::decode(b"garbage").is_err());
    }

    #[test]
    fn settings_must_agree() {
        let names = [("host_buffer_bytes", "RSCCL_HOST_BUFFER_BYTES"), ("p2p_buffer_bytes", "RSCCL_P2P_BUFFER_BYTES")];
        let mut b = info("a");
        assert!(check_same_settings(&[info("a"), b.clone()], &names).is_ok());
        b.settings[1] = 9;
        let e = check_same_settings(&[info("a"), info("a"), b], &names).unwrap_err().to_string();
        assert!(e.contains("p2p_buffer_bytes (RSCCL_P2P_BUFFER_BYTES): rank 0 has 2, rank 2 has 9"), "{e}");
    }

    #[test]
    fn re_creation_does_not_read_stale_records() {
        let store = MemStore::default();
        let t = Duration::from_secs(1);
        let (n1, _) = exchange(&store, 0, 1, &info("a"), t).unwrap();
        let (n2, infos) = exchange(&store, 0, 1, &info("b"), t).unwrap();
        assert_ne!(n1, n2, "a new generation gets a new nonce");
        assert_eq!(infos[0].host_id, "b");
    }

    fn process(pid: u32) -> RankInfo {
        RankInfo { pid, host_id: "h:boot".into(), ..Default::default() }
    }

    #[test]
    fn a_rank_claimed_twice_in_one_creation_fails_every_rank_naming_it() {
        let store = MemStore::default();
        let t = Duration::from_secs(20);
        std::thread::scope(|s| {
            // The first claimer waits for rank 0, whom the duplicate displaced: at its
            // timeout it is told why.
            let first = s.spawn(|| exchange(&store, 1, 2, &process(100), Duration::from_millis(500)));
            while store.get("rsccl/0/claim/1", Duration::ZERO).is_err() {
                std::thread::yield_now();
            }
            let second = exchange(&store, 1, 2, &process(200), t).unwrap_err();
            let first = first.join().unwrap().unwrap_err();
            for e in [&first, &second] {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
                assert!(e.to_string().contains("rank 1 was claimed by two processes: pid 200 on host h is the second"), "{e}");
            }
            // Rank 0 came third: pushed into the next creation, it is told why at its timeout.
            let e = exchange(&store, 0, 2, &process(300), Duration::from_millis(300)).unwrap_err().to_string();
            assert!(e.contains("rank 1 was claimed by two processes") && e.contains("(rank 0) was left out"), "{e}");
        });
    }

    #[test]
    fn a_rank_claimed_again_after_its_creation_names_the_first_process() {
        let store = MemStore::default();
        let t = Duration::from_secs(20);
        std::thread::scope(|s| {
            let zero = s.spawn(|| exchange(&store, 0, 2, &process(100), t));
            exchange(&store, 1, 2, &process(101), t).unwrap();
            zero.join().unwrap().unwrap();
        });
        let e = exchange(&store, 1, 2, &process(200), Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("rank 1 was claimed by two processes: pid 101 on host h joined this group as rank 1 before this process (pid 200"),
            "{e}"
        );
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
