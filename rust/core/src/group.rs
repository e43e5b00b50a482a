//! A communicator: its ranks, where they are (topology), and the engine that runs its
//! operations. Everything is created here, at group creation, so the first collective
//! allocates nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::rendezvous::exchange;
use crate::bootstrap::setup;
use crate::bootstrap::unix::Listener;
use crate::bootstrap::{check_same_settings, host_identity, LocalMesh, Phase, RankInfo, SetupWatch, Store, Topology};
use crate::collective::op::{Op, Place};
use crate::config::Config;
use crate::cuda::nccl::Nccl;
use crate::cuda::{CudaEngine, NcclEngine};
use crate::engine::host::HostEngine;
pub use crate::engine::Ran;
use crate::engine::{Engine, GroupStats, MemoryStats, NotRun};
use crate::error::{Error, Result};
use crate::memory::Layout;

/// Where a group's CPU tensors go. With `CudaRoute`, the routes the front ends route by:
/// Python gets both as one table, `_rsccl.ROUTES` (names and codes, distinct across the
/// two), and a group's routes as codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EngineKind {
    /// rsccl's shared-memory engine: all ranks on one host.
    Host = 0,
    /// Ranks span hosts: CPU tensors go through gloo, created by the Python layer from
    /// the same store; CUDA tensors through the NCCL engine (when the group was created
    /// with a device).
    Gloo = 1,
}

impl EngineKind {
    pub const ALL: [EngineKind; 2] = [EngineKind::Host, EngineKind::Gloo];

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Host => "host",
            EngineKind::Gloo => "gloo",
        }
    }
}

/// Where a group's CUDA tensors go (see `EngineKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CudaRoute {
    /// rsccl's CUDA engine: its kernels, all ranks on one host.
    Rsccl = 2,
    /// The NCCL engine: the group spans hosts.
    Nccl = 3,
}

impl CudaRoute {
    pub const ALL: [CudaRoute; 2] = [CudaRoute::Rsccl, CudaRoute::Nccl];

    pub fn name(self) -> &'static str {
        match self {
            CudaRoute::Rsccl => "rsccl",
            CudaRoute::Nccl => "nccl",
        }
    }
}

/// The routes of both kinds, as (name, code): the table front ends map codes with.
pub fn routes() -> Vec<(&'static str, u8)> {
    let host = EngineKind::ALL.iter().map(|r| (r.name(), *r as u8));
    host.chain(CudaRoute::ALL.iter().map(|r| (r.name(), *r as u8))).collect()
}

/// Which engine serves CPU tensors of a group with this topology, and why.
pub fn choose_engine(topo: &Topology) -> (EngineKind, &'static str) {
    if topo.single_host() {
        (EngineKind::Host, "all ranks share one host")
    } else {
        (EngineKind::Gloo, "ranks span hosts")
    }
}

pub struct Group {
    pub topo: Topology,
    pub cfg: Config,
    pub timeout: Duration,
    /// Where CPU tensors go.
    pub kind: EngineKind,
    /// The engine of host memory (None where CPU tensors run on gloo). Taken out at
    /// shutdown, so the region and sockets are released then, not whenever Python drops
    /// the last reference to the group.
    host: parking_lot::Mutex<Option<Arc<dyn Engine>>>,
    /// The engine of device memory, when the group was created with a device; taken out
    /// at shutdown too.
    device: parking_lot::Mutex<Option<Device>>,
}

/// A group's device engine: rsccl's kernels (all ranks on one host) or NCCL (ranks span
/// hosts, with rsccl's kernels inside each host where it runs hierarchically).
#[derive(Clone)]
struct Device {
    engine: Arc<dyn Engine>,
    route: CudaRoute,
    /// rsccl's CUDA engine of this host, which holds the pool: the device engine itself on
    /// one host; across hosts, the NCCL engine's host-local engine, if it has one.
    local: Option<Arc<CudaEngine>>,
}

impl Group {
    /// Rendezvous with the other ranks and build the engine (and, with `cuda_device`, the
    /// CUDA engine on that GPU). Blocks until every rank has joined, or fails after
    /// `timeout` naming the ranks that did not.
    pub fn create(store: &dyn Store, rank: usize, size: usize, timeout: Duration, cfg: Config, cuda_device: Option<i32>) -> Result<Group> {
        Self::create_as(store, rank, rank, size, timeout, cfg, cuda_device)
    }

    /// `create` for a rank whose rank in the default group is `global_rank` (named in
    /// errors beside its group rank).
    ///
    /// Set-up's contract with failures (bootstrap/setup.rs): each phase is bounded by the
    /// timeout, a local rank that dies ends every wait at once, and the error names it,
    /// its pid and the phase. What was built so far is dropped on failure, which releases
    /// it (abstract socket names, the memfd region, CUDA mappings): nothing is left behind.
    #[allow(clippy::too_many_arguments)]
    pub fn create_as(
        store: &dyn Store,
        rank: usize,
        global_rank: usize,
        size: usize,
        timeout: Duration,
        cfg: Config,
        cuda_device: Option<i32>,
    ) -> Result<Group> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} is invalid for a group of size {size}")));
        }
        let creation = setup::count_creation();
        let (mut settings, mut names) = cfg.layout_settings();
        // Whether this rank builds a CUDA engine: its set-up is collective, so every rank
        // must agree (a rank that never initialized CUDA would leave the others waiting).
        settings.push(cuda_device.is_some() as u64);
        names.push((
            "whether CUDA was initialized at group creation (1 = yes)",
            "call torch.cuda.set_device(local_rank) on every rank, or on none, before creating the group",
        ));
        // Bound before the record that names it is published (bootstrap/unix.rs).
        let mut listener = Listener::bind_random(size as i32)?;
        let info = RankInfo::current(host_identity()?, settings, global_rank, listener.name());
        let (nonce, infos) = SetupWatch::none(rank, creation).during(Phase::Rendezvous, || exchange(store, rank, size, &info, timeout))?;
        listener.set_peer_names(infos.iter().map(|i| i.socket.clone()).collect());
        check_same_settings(&infos, &names)?;
        let topo = Topology::from_infos(rank, &infos);
        // From here every wait also watches the other local ranks' processes.
        let watch = SetupWatch::new(&topo, &infos, creation);
        // Every rank has published its record by now, so the local set-up gets the whole
        // timeout again rather than what the slowest rank left of it.
        let deadline = Instant::now() + timeout;
        let (kind, why) = choose_engine(&topo);
        let mut cuda = None;
        let host: Option<Arc<dyn Engine>> = match kind {
            EngineKind::Gloo => {
                if let Some(d) = cuda_device {
                    let nccl = Nccl::get().ok_or_else(|| {
                        Error::Cuda(
                            "this group spans hosts and has CUDA, so it needs NCCL, which was not loaded: torch's \
                             libnccl.so.2 (the nvidia-nccl package) was not found"
                                .into(),
                        )
                    })?;
                    let e = watch.during(Phase::Nccl, || {
                        NcclEngine::create(nccl, d, &topo, store, &nonce, listener, &cfg, timeout, deadline, &watch)
                    })?;
                    cuda = Some(Device { local: e.local().cloned(), engine: e, route: CudaRoute::Nccl });
                }
                None
            }
            EngineKind::Host => {
                let ranks = topo.local_ranks().to_vec();
                let me = topo.local_index();
                let layout = Layout::new(ranks.len(), &cfg)?;
                let mesh =
                    Arc::new(watch.during(Phase::Mesh, || LocalMesh::connect(listener, &nonce, &ranks, me, deadline, &watch.fds()))?);
                let region = watch.during(Phase::Region, || mesh.share_region(layout.total, deadline))?;
                // The CUDA set-up talks over the mesh, so it runs before the host engine
                // starts watching the mesh for peers that leave.
                if let Some(d) = cuda_device {
                    let c = watch.during(Phase::Cuda, || CudaEngine::create(d, mesh.clone(), ranks.clone(), &cfg, timeout, deadline))?;
                    cuda = Some(Device { local: Some(c.clone()), engine: c, route: CudaRoute::Rsccl });
                }
                let pids = ranks.iter().map(|&r| topo.pids[r]).collect();
                Some(Arc::new(watch.during(Phase::Engine, || HostEngine::start(region, layout, cfg.clone(), me, mesh, pids, timeout))?))
            }
        };
        let g = Group { topo, cfg, timeout, kind, host: parking_lot::Mutex::new(host), device: parking_lot::Mutex::new(cuda) };
        tracing::info!(
            rank,
            size,
            engine = kind.name(),
            why,
            hosts = g.topo.hosts.len(),
            host_region_bytes = g.host_stats().host_region_bytes,
            "rsccl group created"
        );
        Ok(g)
    }

    /// The seam: run one op on the engine of its place. Every operation reaches the
    /// engines through here, and only through here: Python's (`Communicator.run`) and the
    /// Rust front end's (rsccl-tch builds the same `Op`s).
    ///
    /// The rule "a rank with bad arguments still joins the call as invalid, so its peers
    /// raise instead of waiting" lives here and nowhere else: an op that carries an error
    /// (found by the front end) or whose arguments fail to translate for its engine joins
    /// its call as invalid (`Engine::join_invalid`) and returns the error. Point-to-point
    /// calls involve one peer only: they raise without joining.
    ///
    /// So does the rule "a call the group's engine cannot run is refused by every rank":
    /// before translating, the engine says whether it runs the op's kind, dtype and reduce
    /// op at all (`Engine::can_run`, the same answer on every rank); if not, the rank
    /// raises through `Engine::refuse` and the group stays usable. NCCL refuses alone,
    /// with nothing exchanged (joining would abort the group: NCCL cannot tell its peers);
    /// rsccl's kernels join as invalid, which their agreement step makes harmless when
    /// every rank refuses and safe when one rank's dtype differs.
    pub fn run(&self, mut op: Op) -> Result<Ran> {
        let (rank, n) = (self.topo.rank, self.topo.size);
        match op.place {
            Place::Host => run_on(self.host_engine(), op, rank, n),
            Place::Cuda { .. } => {
                // On CUDA a bad rank raises its own error (its peers raise the disagreement,
                // which names it): it names the rank too, as the host engine's agreed errors
                // do (the device engines' translation names it likewise).
                op.invalid = op.invalid.map(|e| e.naming_rank(rank));
                run_on(self.device().map(|d| d.engine), op, rank, n)
            }
        }
    }

    fn host_engine(&self) -> Result<Arc<dyn Engine>> {
        match (&*self.host.lock(), self.kind) {
            (Some(e), _) => Ok(e.clone()),
            (None, EngineKind::Host) => Err(Error::destroyed()),
            (None, EngineKind::Gloo) => {
                Err(Error::Internal("this group spans hosts; its CPU collectives run on gloo, not the host engine".into()))
            }
        }
    }

    /// Name the global rank of each group rank in this group's messages (a subgroup's).
    pub fn name_global_ranks(&self, global: Vec<usize>) -> Result<()> {
        if global.len() != self.topo.size {
            return Err(Error::InvalidArgument(format!("{} global ranks given for a group of {} ranks", global.len(), self.topo.size)));
        }
        if let Some(e) = &*self.host.lock() {
            e.name_global_ranks(global);
        }
        Ok(())
    }

    /// What the host engine reserved, mapped and moved (zeros without one).
    pub fn host_stats(&self) -> MemoryStats {
        let mut s = GroupStats::default();
        if let Some(e) = &*self.host.lock() {
            e.add_stats(&mut s);
        }
        s.host
    }

    /// Every engine's part. Reading the CUDA counters waits for the group's queued kernels.
    pub fn stats(&self) -> GroupStats {
        let mut s = GroupStats::default();
        let host = self.host.lock().clone();
        if let Some(h) = host {
            h.add_stats(&mut s);
        }
        // Not under the lock: shutdown needs it to stop the kernels this may wait for.
        if let Ok(d) = self.device() {
            d.engine.add_stats(&mut s);
        }
        s
    }

    fn device(&self) -> Result<Device> {
        if let Some(d) = &*self.device.lock() {
            return Ok(d.clone());
        }
        let spans = match self.kind {
            EngineKind::Host if self.host.lock().is_none() => return Err(Error::destroyed()),
            EngineKind::Host => "",
            EngineKind::Gloo => " spans hosts and",
        };
        Err(Error::InvalidArgument(format!(
            "this group{spans} has no CUDA engine: CUDA was not initialized when it was created. Call \
             torch.cuda.set_device(local_rank) before init_process_group/new_group"
        )))
    }

    /// rsccl's CUDA engine of this host (the pool lives there), or why there is none. A
    /// group that spans hosts has one only where every host has the same number >= 2 of
    /// its GPUs (it runs the host-local phases of hierarchical collectives).
    pub fn cuda(&self) -> Result<Arc<CudaEngine>> {
        self.device()?.local.ok_or_else(|| {
            Error::InvalidArgument(
                "this group spans hosts with unequal or single GPUs per host: its CUDA collectives run on NCCL \
                 alone, and it has no rsccl CUDA engine (nor pool) on this host"
                    .into(),
            )
        })
    }

    /// Raise the error that made the group's device engine unusable, or a reported
    /// mismatch. Ok for a group without CUDA.
    pub fn cuda_health(&self) -> Result<()> {
        match self.device.lock().clone() {
            Some(d) => d.engine.health(),
            None => Ok(()),
        }
    }

    pub fn has_cuda(&self) -> bool {
        self.device.lock().is_some()
    }

    /// Where CUDA tensors go: rsccl's kernels, NCCL (the group spans hosts), or None (no
    /// CUDA).
    pub fn cuda_route(&self) -> Option<CudaRoute> {
        self.device.lock().as_ref().map(|d| d.route)
    }

    /// Stop the engines and release their memory, region and sockets. Idempotent.
    pub fn shutdown(&self) {
        let device = self.device.lock().take();
        if let Some(d) = device {
            d.engine.shutdown();
        }
        let host = self.host.lock().take();
        if let Some(e) = host {
            e.shutdown();
        }
    }
}

/// `Group::run` on one engine (of this `rank` of `n`): refuse `op` if the engine cannot
/// run it, else run it (the engine translates it), or join its call as invalid when this
/// rank's arguments were bad.
fn run_on(engine: Result<Arc<dyn Engine>>, mut op: Op, rank: usize, n: usize) -> Result<Ran> {
    let invalid = op.invalid.take();
    let engine = match engine {
        Ok(e) => e,
        // No engine to join: this rank's own error, where it has one, says more.
        Err(none) => return Err(invalid.unwrap_or(none)),
    };
    let error = match invalid {
        Some(e) => e,
        None => {
            // A fact of the engine, alike on every rank: each refuses (see `run`).
            if let Err(e) = engine.can_run(&op, rank) {
                return engine.refuse(&op, e);
            }
            match engine.clone().run(&mut op, rank, n) {
                Ok(ran) => return Ok(ran),
                Err(NotRun::Failed(e)) => return Err(e),
                Err(NotRun::Arguments(e)) => e,
            }
        }
    };
    if op.kind.is_p2p() {
        Err(error)
    } else {
        engine.join_invalid(&op, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::RankInfo;
    use crate::collective::Kind;

    /// An engine that records what reached it; `.1`: it refuses what it cannot run by
    /// joining as invalid (as rsccl's kernels), else alone (as NCCL). Its translation
    /// refuses root 9 (this rank's bad argument) and fails a launch at root 8.
    #[derive(Default)]
    struct Recorder(parking_lot::Mutex<Vec<String>>, bool);

    impl Engine for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn run(self: Arc<Self>, op: &mut Op, rank: usize, size: usize) -> std::result::Result<Ran, NotRun> {
            match op.root {
                9 => Err(NotRun::Arguments(Error::InvalidArgument("root 9 out of range".into()))),
                8 => Err(NotRun::Failed(Error::Cuda("launch failed".into()))),
                _ => {
                    self.0.lock().push(format!("run {} on rank {rank} of {size}", op.kind.name()));
                    Ok(Ran::Done)
                }
            }
        }
        fn join_invalid(self: Arc<Self>, op: &Op, error: Error) -> Result<Ran> {
            self.0.lock().push(format!("invalid {}: {error}", op.kind.name()));
            Err(error)
        }
        fn can_run(&self, op: &Op, rank: usize) -> Result<()> {
            if op.dtype == crate::dtype::DType::F64 {
                self.0.lock().push(format!("refused {}", op.dtype.name()));
                return Err(Error::InvalidType(format!("all_reduce: rank {rank} passed float64; this engine reduces float32")));
            }
            Ok(())
        }
        fn refuse(self: Arc<Self>, op: &Op, error: Error) -> Result<Ran> {
            if self.1 {
                return self.join_invalid(op, error);
            }
            Err(error)
        }
        fn add_stats(&self, _: &mut GroupStats) {}
        fn shutdown(&self) {}
    }

    fn op(kind: Kind, invalid: Option<&str>) -> Op {
        Op { invalid: invalid.map(|m| Error::InvalidArgument(m.into())), ..Op::new(kind, Place::Host) }
    }

    fn rooted(kind: Kind, root: i64) -> Op {
        Op { root, ..op(kind, None) }
    }

    /// The one owner of "join as invalid": a collective whose arguments were found bad
    /// (by the front end or in the engine's translation) joins; a send/recv raises alone;
    /// a good op runs; a call that fails once translated raises without joining.
    #[test]
    fn bad_collectives_join_and_bad_p2p_raise_alone() {
        let e = Arc::new(Recorder::default());
        let dynamic = || -> Result<Arc<dyn Engine>> { Ok(e.clone()) };
        assert!(run_on(dynamic(), op(Kind::AllReduce, None), 0, 4).is_ok());
        let r = run_on(dynamic(), rooted(Kind::Broadcast, 9), 0, 4);
        assert!(r.err().unwrap().to_string().contains("root 9 out of range"));
        let r = run_on(dynamic(), op(Kind::AllGather, Some("rank 1 passed 3 outputs")), 0, 4);
        assert!(r.err().unwrap().to_string().contains("rank 1 passed 3 outputs"));
        let r = run_on(dynamic(), op(Kind::Send, Some("tag -1")), 0, 4);
        assert!(r.err().unwrap().to_string().contains("tag -1"));
        let r = run_on(dynamic(), rooted(Kind::Recv, 9), 0, 4);
        assert!(r.is_err());
        let r = run_on(dynamic(), rooted(Kind::AllReduce, 8), 0, 4);
        assert!(r.err().unwrap().to_string().contains("launch failed"));
        assert_eq!(
            *e.0.lock(),
            vec![
                "run all_reduce on rank 0 of 4".to_string(),
                "invalid broadcast: root 9 out of range".into(),
                "invalid all_gather: rank 1 passed 3 outputs".into(),
            ]
        );
        // No engine of that place: the rank's own error says more than "no CUDA engine".
        let none: Result<Arc<dyn Engine>> = Err(Error::InvalidArgument("this group has no CUDA engine".into()));
        let r = run_on(none, op(Kind::AllReduce, Some("float64 is not reduced on CUDA")), 0, 4);
        assert!(r.err().unwrap().to_string().contains("float64 is not reduced on CUDA"));
    }

    /// A call the engine cannot run is refused before it is translated or run, the way the
    /// engine refuses (`Engine::refuse`): alone, with nothing reaching the engine (NCCL: its
    /// peers, which got the same answer, do the same, and the group stays usable), or by
    /// joining as invalid (rsccl's kernels); the error names the rank. A rank whose
    /// arguments were bad still joins (its dtype is not known then), and a call the engine
    /// runs runs.
    #[test]
    fn a_call_the_engine_cannot_run_is_refused_before_anything_is_exchanged() {
        use crate::dtype::DType;
        let e = Arc::new(Recorder::default());
        let dynamic = || -> Result<Arc<dyn Engine>> { Ok(e.clone()) };
        let mut f64_op = op(Kind::AllReduce, None);
        f64_op.dtype = DType::F64;
        let r = run_on(dynamic(), f64_op, 3, 4);
        let err = r.err().unwrap();
        assert!(matches!(&err, Error::InvalidType(m) if m == "all_reduce: rank 3 passed float64; this engine reduces float32"), "{err}");
        let mut f32_op = op(Kind::AllReduce, None);
        f32_op.dtype = DType::F32;
        assert!(run_on(dynamic(), f32_op, 3, 4).is_ok());
        let mut bad = op(Kind::AllReduce, Some("rank 3: input and output differ"));
        bad.dtype = DType::F64;
        assert!(run_on(dynamic(), bad, 3, 4).is_err());
        assert_eq!(
            *e.0.lock(),
            vec![
                "refused float64".to_string(),
                "run all_reduce on rank 3 of 4".into(),
                "invalid all_reduce: rank 3: input and output differ".into()
            ]
        );
        // An engine that tells its peers by joining: the refusal joins, with the same error.
        let joins = Arc::new(Recorder(Default::default(), true));
        let mut f64_op = op(Kind::ReduceScatter, None);
        f64_op.dtype = DType::F64;
        let r = run_on(Ok(joins.clone()), f64_op, 3, 4);
        assert!(r.err().unwrap().to_string().starts_with("all_reduce: rank 3 passed float64"));
        assert_eq!(
            *joins.0.lock(),
            vec![
                "refused float64".to_string(),
                "invalid reduce_scatter: all_reduce: rank 3 passed float64; this engine reduces float32".into()
            ]
        );
    }

    #[test]
    fn engine_choice_follows_topology() {
        let i = |h: &str| RankInfo { pid: 1, host_id: h.into(), ..Default::default() };
        let one = Topology::from_infos(0, &[i("a"), i("a")]);
        assert_eq!(choose_engine(&one).0, EngineKind::Host);
        let two = Topology::from_infos(0, &[i("a"), i("b")]);
        assert_eq!(choose_engine(&two).0, EngineKind::Gloo);
    }

    #[test]
    fn routes_are_named_and_coded_once() {
        let all = routes();
        for (i, (name, code)) in all.iter().enumerate() {
            assert_eq!(*code as usize, i, "{name}: its code is its place in the table");
            assert_eq!(all.iter().filter(|o| o.0 == *name).count(), 1, "{name}");
        }
    }
}
