//! Group creation of the NCCL engine: the unique ids through the store, the flat
//! communicator, and (hierarchical groups) the local rsccl engine and the cross
//! communicator, each warmed up before `create` returns.

use std::collections::VecDeque;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use parking_lot::{Mutex, RwLock};

use super::bound::{free_bytes, Bound};
use super::choice::{hierarchical_layout, host_major};
use super::hier::HierLayout;
use super::pairs::make_pairs;
use super::warm::warm_up;
use super::watchdog::watchdog;
use super::{NcclEngine, Shared, SCRATCH_BYTES, WARM_BYTES};
use crate::bootstrap::unix::Listener;
use crate::bootstrap::{LocalMesh, SetupWatch, Store, Topology};
use crate::config::Config;
use crate::cuda::driver::{check, Device, DeviceBuffer, Event, Stream};
use crate::cuda::nccl::{Nccl, NcclComm};
use crate::cuda::order::{EventHome, Order};
use crate::cuda::CudaEngine;
use crate::error::{Error, Result};

/// Which communicator a store key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommRole {
    /// Every rank of the group.
    Flat,
    /// The ranks of local index `i`, one per host.
    Cross(usize),
}

impl CommRole {
    fn label(self) -> String {
        match self {
            CommRole::Flat => "flat".into(),
            CommRole::Cross(i) => format!("cross{i}"),
        }
    }
}

/// The store key under which `role`'s unique id is published (`what` = "id") or its
/// ranks count their arrival (`what` = "joined"). The nonce is fresh per group creation
/// (see rendezvous::exchange), so a re-created group never reads a stale id.
pub fn id_key(nonce: &[u8; 16], role: CommRole, what: &str) -> String {
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("rsccl/nccl/{hex}/{}/{what}", role.label())
}

/// The store keys of a group creation's failure notice: a counter and the text (see
/// `report_local_death`).
fn failure_keys(nonce: &[u8; 16]) -> (String, String) {
    (id_key(nonce, CommRole::Flat, "failed"), id_key(nonce, CommRole::Flat, "failure"))
}

/// A rank that saw a rank of its host exit during the NCCL engine's creation tells the
/// group through the store: ranks on other hosts cannot watch that process, and would
/// otherwise wait for it until the deadline and then not know whom to blame. Best effort
/// (the store may be failing too); read by `reported_death` in every id wait.
fn report_local_death(store: &dyn Store, nonce: &[u8; 16], watch: &SetupWatch, me: usize) {
    let gone = watch.exited(Duration::ZERO);
    if gone.is_empty() {
        return;
    }
    let who: Vec<String> = gone.iter().map(|&r| watch.label(r)).collect();
    let text = format!("{} exited; {}, on its host, saw it", who.join(", "), watch.label(me));
    let (count, text_key) = failure_keys(nonce);
    if store.set(&text_key, text.as_bytes()).is_ok() {
        let _ = store.add(&count, 1);
    }
}

/// The failure a rank of another host reported (`report_local_death`), if any.
fn reported_death(store: &dyn Store, nonce: &[u8; 16]) -> Result<()> {
    let (count, text_key) = failure_keys(nonce);
    if store.add(&count, 0)? < 1 {
        return Ok(());
    }
    // Set before the counter was raised: there already.
    let text = store.get(&text_key, Duration::from_secs(1))?;
    Err(Error::PeerFailure(String::from_utf8_lossy(&text).into_owned()))
}

/// Makes a fresh NCCL unique id (`Nccl::unique_id`; a stand-in in tests).
type MakeId<'a> = &'a dyn Fn() -> Result<[u8; 128]>;

/// Wait until all `members` ranks of `role`'s communicator have arrived, then publish
/// (`maker`: the communicator's first rank, with what makes the id) or read its unique id.
/// A rank that died after the rendezvous is reported here (at once if it was on this host
/// or a rank of its host reported it, else by the deadline), instead of leaving the others
/// in ncclCommInitRank for good. The id is published under one key and announced under
/// another (a counter the readers poll, checking the local ranks between polls) so that no
/// wait blocks inside the store.
///
/// The id is made only once every member has arrived: ncclGetUniqueId starts NCCL's
/// bootstrap root, a detached thread whose listening socket stays open until every member
/// has connected to it from ncclCommInitRank, and nothing in NCCL's API stops it. An id made
/// for a communicator that a dead rank never joins would keep that socket open in the
/// maker's process for good (seen: rank 0 kept a socket after a rank died as the group
/// made its NCCL communicators, tests/gpu/test_gpu_setup_faults.py). What remains is a rank
/// that dies between the last arrival and its own ncclCommInitRank (docs/multihost.md).
fn share_id(store: &dyn Store, maker: Option<MakeId>, nonce: &[u8; 16], role: CommRole, members: usize, bound: Bound) -> Result<[u8; 128]> {
    let during = format!("the creation of the {} NCCL communicator", role.label());
    let joined = id_key(nonce, role, "joined");
    store.add(&joined, 1)?;
    poll_count(store, &joined, members as i64, &bound, &during, nonce, |n| {
        format!("only {n} of the {members} ranks of the {} NCCL communicator reached its creation within the group timeout", role.label())
    })?;
    let key = id_key(nonce, role, "id");
    let published = id_key(nonce, role, "published");
    if let Some(make) = maker {
        store.set(&key, &make()?)?;
        store.add(&published, 1)?;
    }
    poll_count(store, &published, 1, &bound, &during, nonce, |_| {
        format!(
            "the NCCL id of the {} communicator was not published within the group timeout: its first rank did not get this far",
            role.label()
        )
    })?;
    let left = bound.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let raw = store.get(&key, left)?;
    raw.as_slice().try_into().map_err(|_| Error::Internal(format!("NCCL id of {} bytes in the store", raw.len())))
}

/// Poll the store counter `key` until it reaches `target`, checking between polls that the
/// local ranks live (`bound`) and that no rank of another host reported a death; past the
/// deadline, a timeout whose text `timed_out` gives from the last count. Never blocks in
/// the store.
fn poll_count(
    store: &dyn Store,
    key: &str,
    target: i64,
    bound: &Bound,
    during: &str,
    nonce: &[u8; 16],
    timed_out: impl Fn(i64) -> String,
) -> Result<()> {
    let mut pause = Duration::from_millis(1);
    loop {
        let n = store.add(key, 0)?;
        if n >= target {
            return Ok(());
        }
        bound.peers_alive(during)?;
        reported_death(store, nonce)?;
        if Instant::now() > bound.deadline {
            return Err(Error::Timeout(timed_out(n)));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// What `NcclEngine::build` made.
struct Built {
    sh: Arc<Shared>,
    /// Device memory of every communicator's creation and warm-up; of the pair ones alone.
    nccl_bytes: u64,
    p2p_bytes: u64,
    /// The pair communicators' names (kept alive with the engine, as the others').
    pair_names: Vec<CString>,
}

impl NcclEngine {
    /// Build the engine of this rank on `device`: the flat communicator, and (hosts with
    /// the same number >= 2 of ranks) the local rsccl engine and the cross communicator;
    /// warm each up. Blocks until every rank has done the same, or fails: every wait is
    /// bounded by `deadline` and ends as soon as one of the local ranks `watch` follows
    /// exits (ncclCommInitRank and ncclCommSplit, blocking NCCL calls, excepted: see
    /// docs/multihost.md).
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        nccl: &'static Nccl,
        device: i32,
        topo: &Topology,
        store: &dyn Store,
        nonce: &[u8; 16],
        listener: Listener,
        cfg: &Config,
        timeout: Duration,
        deadline: Instant,
        watch: &SetupWatch,
    ) -> Result<Arc<NcclEngine>> {
        let bound = Bound { deadline, watch };
        let dev = Arc::new(Device::open(device)?);
        let ranks_per_host: Vec<usize> = topo.hosts.iter().map(|h| h.len()).collect();
        let hierarchical = hierarchical_layout(&ranks_per_host);
        let names = vec![
            CString::new(format!("rsccl-flat-r{}", topo.rank)).map_err(|_| Error::Internal("NUL in a name".into()))?,
            CString::new(format!("rsccl-cross{}-r{}", topo.local_index(), topo.rank))
                .map_err(|_| Error::Internal("NUL in a name".into()))?,
        ];
        let ctx = dev.bind()?;
        let internal = Stream::non_blocking(&dev, "cuStreamCreate")?;
        let major = hierarchical && host_major(&topo.hosts);
        // Only a group that can take the hierarchical reduce_scatter holds its buffer.
        let hier_scratch_bytes = if major { cfg.nccl_hierarchical_scratch_bytes as usize } else { 0 };
        // Each owns its allocation: a failure on the way frees what was made.
        let scratch = DeviceBuffer::new(&dev, SCRATCH_BYTES, "cuMemAlloc (NCCL engine)")?;
        let warm = DeviceBuffer::new(&dev, WARM_BYTES, "cuMemAlloc (NCCL engine)")?;
        let hier_scratch =
            (hier_scratch_bytes > 0).then(|| DeviceBuffer::new(&dev, hier_scratch_bytes, "cuMemAlloc (NCCL engine)")).transpose()?;
        // SAFETY: both buffers are ours; zeroing makes the warm-up's reductions finite.
        unsafe {
            check(cu::cuMemsetD8_v2(scratch.ptr(), 0, SCRATCH_BYTES), "cuMemsetD8")?;
            check(cu::cuMemsetD8_v2(warm.ptr(), 0, WARM_BYTES), "cuMemsetD8")?;
            check(cu::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        drop(ctx);
        let result = Self::build(
            nccl,
            dev.clone(),
            topo,
            store,
            nonce,
            listener,
            cfg,
            timeout,
            bound,
            hierarchical,
            &internal,
            scratch.ptr(),
            warm.ptr(),
            &names,
        );
        if let Err(Error::PeerFailure(_)) = &result {
            report_local_death(store, nonce, watch, topo.rank);
        }
        let _ctx = dev.bind()?;
        // The warm-up finished (build waited for it), or failed before launching, or
        // aborted its communicators, which ends their kernels: the stream drains, then the
        // buffer is free of users.
        internal.synchronize();
        drop(warm);
        // On failure the buffers and the stream go with their owners: nothing runs on them
        // any more (above).
        let Built { sh, nccl_bytes, p2p_bytes, pair_names } = result?;
        let mut names = names;
        names.extend(pair_names);
        let engine = Arc::new(NcclEngine {
            sh: sh.clone(),
            internal,
            scratch,
            hier: HierLayout {
                local_index: topo.local_index(),
                host_index: topo.host_of[topo.rank],
                host_major: major,
                ranks_per_host,
                min_bytes: cfg.nccl_hierarchical_min_bytes,
                scratch: hier_scratch,
                scratch_bytes: hier_scratch_bytes as u64,
            },
            host_of: topo.host_of.clone(),
            sync_on_caller: cfg.cuda_sync_stream,
            nccl_bytes,
            collectives: AtomicU64::new(0),
            hierarchical: AtomicU64::new(0),
            p2p_bytes,
            p2p_messages: AtomicU64::new(0),
            watchdog: Mutex::new(None),
            _names: names,
        });
        let wd = std::thread::Builder::new()
            .name("rsccl-nccl-watchdog".into())
            .spawn(move || watchdog(sh))
            .map_err(|e| Error::os("starting the NCCL watchdog thread", e))?;
        *engine.watchdog.lock() = Some(wd);
        tracing::info!(
            rank = topo.rank,
            device,
            hosts = topo.hosts.len(),
            hierarchical,
            host_major = major,
            hier_scratch_bytes,
            nccl_bytes,
            p2p_bytes,
            "rsccl: NCCL engine ready: {} communicator(s) ({} for send/recv), {} MiB of device memory taken by NCCL",
            engine.stats().communicators,
            engine.sh.pairs.len(),
            nccl_bytes >> 20
        );
        Ok(engine)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        nccl: &'static Nccl,
        dev: Arc<Device>,
        topo: &Topology,
        store: &dyn Store,
        nonce: &[u8; 16],
        listener: Listener,
        cfg: &Config,
        timeout: Duration,
        bound: Bound,
        hierarchical: bool,
        internal: &Stream,
        scratch: u64,
        warm: u64,
        names: &[CString],
    ) -> Result<Built> {
        let host = topo.host_of[topo.rank];
        let li = topo.local_index();
        let make_id = || nccl.unique_id();
        let (flat, flat_bytes) = {
            let id = share_id(store, (topo.rank == 0).then_some(&make_id), nonce, CommRole::Flat, topo.size, bound)?;
            let _ctx = dev.bind()?;
            let before = free_bytes()?;
            let comm = NcclComm::init(nccl, &id, topo.rank, topo.size, cfg.nccl_max_ctas, &names[0])?;
            warm_up(&comm, &dev, internal, warm, scratch, true, bound)?;
            (comm, before.saturating_sub(free_bytes()?))
        };
        let hier = || -> Result<(Arc<CudaEngine>, NcclComm, u64)> {
            let ranks = topo.local_ranks().to_vec();
            let mesh = Arc::new(LocalMesh::connect(listener, nonce, &ranks, li, bound.deadline, &bound.watch.fds())?);
            let local = CudaEngine::create(dev.ordinal, mesh, ranks, cfg, timeout, bound.deadline)?;
            let hosts = topo.hosts.len();
            let id = share_id(store, (host == 0).then_some(&make_id), nonce, CommRole::Cross(li), hosts, bound)?;
            let _ctx = dev.bind()?;
            let before = free_bytes()?;
            let comm = NcclComm::init(nccl, &id, host, hosts, cfg.nccl_max_ctas, &names[1])?;
            // The cross communicators run collectives only (no send/recv).
            warm_up(&comm, &dev, internal, warm, scratch, false, bound)?;
            let bytes = before.saturating_sub(free_bytes()?);
            Ok((local, comm, bytes))
        };
        let (mut local, mut cross, mut cross_bytes) = (None, None, 0);
        if hierarchical {
            match hier() {
                Ok((l, c, b)) => (local, cross, cross_bytes) = (Some(l), Some(c), b),
                Err(e) => {
                    // Abort rather than finalize: finalizing waits for peers that may be gone.
                    flat.abort();
                    return Err(e);
                }
            }
        }
        let (mut pairs, mut p2p_bytes, mut pair_names) = (Vec::new(), 0, Vec::new());
        if cfg.nccl_p2p {
            // Pairs on one host need NCCL only where no rsccl engine runs inside the host.
            match make_pairs(&flat, &dev, topo, cfg, local.is_none(), warm, bound) {
                Ok((p, b, n)) => (pairs, p2p_bytes, pair_names) = (p, b, n),
                Err(e) => {
                    flat.abort();
                    if let Some(c) = &cross {
                        c.abort();
                    }
                    return Err(e);
                }
            }
        }
        // Events for the launches' tracking, made now rather than at the first collective.
        let events = (0..16).map(|_| Event::new(&dev)).collect::<Result<Vec<Event>>>()?;
        let order_dev = dev.clone();
        // Cyclic: the order hands out events that come back to `Shared` (`EventHome`).
        let sh = Arc::new_cyclic(|me: &std::sync::Weak<Shared>| Shared {
            dev,
            flat,
            cross,
            pairs,
            local,
            rank: topo.rank,
            timeout,
            gate: RwLock::new(()),
            order: Mutex::new(Order::new(order_dev, events, timeout, me.clone() as std::sync::Weak<dyn EventHome>)),
            pending: Mutex::new(VecDeque::new()),
            poisoned: Mutex::new(None),
            abort_requested: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        Ok(Built { sh, nccl_bytes: flat_bytes + cross_bytes + p2p_bytes, p2p_bytes, pair_names })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_keys_are_unique_per_creation_and_communicator() {
        let a = [0xabu8; 16];
        let mut b = a;
        b[15] = 0;
        assert_eq!(id_key(&a, CommRole::Flat, "id"), format!("rsccl/nccl/{}/flat/id", "ab".repeat(16)));
        assert_ne!(id_key(&a, CommRole::Flat, "id"), id_key(&b, CommRole::Flat, "id"), "another creation");
        assert_ne!(id_key(&a, CommRole::Cross(0), "id"), id_key(&a, CommRole::Cross(1), "id"), "one id per local index");
        assert_ne!(id_key(&a, CommRole::Cross(0), "id"), id_key(&a, CommRole::Cross(0), "joined"));
    }

    use crate::bootstrap::rendezvous::MemStore;

    fn random_id() -> [u8; 128] {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        println!("seed {seed}");
        let mut x = seed | 1;
        std::array::from_fn(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
    }

    /// Publish `id` as the communicator's first rank does.
    fn publish(store: &MemStore, nonce: &[u8; 16], role: CommRole, id: &[u8; 128]) {
        store.set(&id_key(nonce, role, "id"), id).unwrap();
        store.add(&id_key(nonce, role, "published"), 1).unwrap();
    }

    #[test]
    fn the_id_reaches_every_member() {
        let (store, nonce, id) = (MemStore::default(), [7u8; 16], random_id());
        publish(&store, &nonce, CommRole::Cross(1), &id);
        let watch = SetupWatch::none(0, 1);
        let bound = Bound { deadline: Instant::now() + Duration::from_secs(60), watch: &watch };
        assert_eq!(share_id(&store, None, &nonce, CommRole::Cross(1), 1, bound).unwrap(), id);
        assert_eq!(store.add(&id_key(&nonce, CommRole::Cross(1), "joined"), 0).unwrap(), 1);
        // Past the deadline with nothing published: the timeout names the communicator.
        let late = Bound { deadline: Instant::now() - Duration::from_millis(1), watch: &watch };
        let e = share_id(&store, None, &nonce, CommRole::Flat, 1, late).unwrap_err();
        assert!(matches!(&e, Error::Timeout(m) if m.contains("NCCL id of the flat communicator was not published")), "{e}");
        // And with a member missing, the timeout says how many arrived.
        let e = share_id(&store, None, &[8u8; 16], CommRole::Flat, 2, late).unwrap_err();
        assert!(matches!(&e, Error::Timeout(m) if m.contains("only 1 of the 2 ranks of the flat NCCL communicator")), "{e}");
    }

    /// The first rank makes the id (ncclGetUniqueId, which starts NCCL's bootstrap root: a
    /// thread and a listening socket that live until every member connects) only once every
    /// member has arrived: a member that died before leaves no root behind in the maker.
    #[test]
    fn the_id_is_made_only_once_every_member_has_arrived() {
        use crate::bootstrap::rendezvous::pid_namespace;
        use crate::bootstrap::RankInfo;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let made = AtomicUsize::new(0);
        let id = random_id();
        let make = || {
            made.fetch_add(1, Ordering::SeqCst);
            Ok(id)
        };
        // A local member that died before arriving: the maker fails naming the death and
        // never made an id.
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        let info = |pid: u32, g: u32| RankInfo { pid, global_rank: g, pid_ns: pid_namespace(), host_id: "h".into(), ..Default::default() };
        let infos = vec![info(std::process::id(), 0), info(pid, 1)];
        let topo = Topology::from_infos(0, &infos);
        let watch = SetupWatch::new(&topo, &infos, 1);
        child.kill().unwrap();
        child.wait().unwrap();
        let (store, nonce) = (MemStore::default(), [5u8; 16]);
        let bound = Bound { deadline: Instant::now() + Duration::from_secs(120), watch: &watch };
        let e = share_id(&store, Some(&make), &nonce, CommRole::Flat, 2, bound).unwrap_err();
        assert!(matches!(&e, Error::PeerFailure(m) if m.contains("exited during the creation of the flat NCCL communicator")), "{e}");
        assert_eq!(made.load(Ordering::SeqCst), 0, "an id was made for a communicator a member never joined");
        assert_eq!(store.add(&id_key(&nonce, CommRole::Flat, "published"), 0).unwrap(), 0);
        // Every member there (the other one arrived first): the id is made once, published
        // and returned.
        let (store, nonce) = (MemStore::default(), [6u8; 16]);
        store.add(&id_key(&nonce, CommRole::Flat, "joined"), 1).unwrap();
        let alone = SetupWatch::none(0, 1);
        let bound = Bound { deadline: Instant::now() + Duration::from_secs(120), watch: &alone };
        assert_eq!(share_id(&store, Some(&make), &nonce, CommRole::Flat, 2, bound).unwrap(), id);
        assert_eq!(made.load(Ordering::SeqCst), 1);
        // The other member reads the same id without making one.
        assert_eq!(share_id(&store, None, &nonce, CommRole::Flat, 2, bound).unwrap(), id);
        assert_eq!(made.load(Ordering::SeqCst), 1);
    }

    /// A local rank that dies while the others wait for a communicator's id, or for its
    /// members, ends the wait at once (not at the deadline), and the phase's error names it.
    #[test]
    fn a_local_rank_that_dies_ends_the_id_waits_and_is_named() {
        use crate::bootstrap::rendezvous::pid_namespace;
        use crate::bootstrap::{Phase, RankInfo};
        for published in [false, true] {
            let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
            let pid = child.id();
            let info =
                |pid: u32, g: u32| RankInfo { pid, global_rank: g, pid_ns: pid_namespace(), host_id: "h".into(), ..Default::default() };
            let infos = vec![info(std::process::id(), 0), info(pid, 3)];
            let topo = Topology::from_infos(0, &infos);
            let watch = SetupWatch::new(&topo, &infos, 1);
            let (store, nonce) = (MemStore::default(), [9u8; 16]);
            if published {
                publish(&store, &nonce, CommRole::Cross(0), &random_id());
            }
            child.kill().unwrap();
            child.wait().unwrap();
            // Long enough that a wait that missed the death fails as a timeout, not as this.
            let bound = Bound { deadline: Instant::now() + Duration::from_secs(120), watch: &watch };
            let e = share_id(&store, None, &nonce, CommRole::Cross(0), 2, bound).unwrap_err();
            assert!(
                matches!(&e, Error::PeerFailure(m) if m.contains("exited during the creation of the cross0 NCCL communicator")),
                "published={published}: {e}"
            );
            let named = watch.explain(Phase::Nccl, e).to_string();
            assert!(
                named.starts_with(&format!("rank 1 (global rank 3, pid {pid}) exited while the group was creating its NCCL communicators")),
                "published={published}: {named}"
            );
            // The rank that saw it tells the ranks of other hosts, which watch nothing of
            // this host: their wait ends with the dead rank's name too.
            report_local_death(&store, &nonce, &watch, 0);
            let remote = SetupWatch::none(2, 1);
            let far = Bound { deadline: Instant::now() + Duration::from_secs(120), watch: &remote };
            let e = share_id(&store, None, &nonce, CommRole::Flat, 4, far).unwrap_err();
            let me = std::process::id();
            let told = format!("rank 1 (global rank 3, pid {pid}) exited; rank 0 (pid {me}), on its host, saw it");
            assert!(matches!(&e, Error::PeerFailure(m) if *m == told), "published={published}: {e}");
        }
    }
}
