//! A communicator: its ranks, where they are (topology), and the engine that runs its
//! operations. Everything is created here, at group creation, so the first collective
//! allocates nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::mesh::socket_name;
use crate::bootstrap::rendezvous::exchange;
use crate::bootstrap::setup;
use crate::bootstrap::unix::Listener;
use crate::bootstrap::{check_same_settings, host_identity, LocalMesh, Phase, RankInfo, SetupWatch, Store, Topology};
use crate::collective::op::{Op, Place};
use crate::collective::{Collective, Kind};
use crate::config::Config;
use crate::cuda::nccl::Nccl;
use crate::cuda::{AllToAll, CudaCall, CudaEngine, CudaEvent, CudaStats, NcclEngine, NcclStats};
use crate::engine::host::HostEngine;
use crate::engine::{Engine, MemoryStats, P2p};
use crate::error::{Error, Result};
use crate::memory::Layout;
use crate::work::WorkState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// rsccl's shared-memory engine: all ranks on one host.
    Host,
    /// Ranks span hosts: CPU tensors go through gloo, created by the Python layer from
    /// the same store; CUDA tensors through the NCCL engine (when the group was created
    /// with a device).
    Gloo,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Host => "host",
            EngineKind::Gloo => "gloo",
        }
    }
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
    pub kind: EngineKind,
    /// Taken out at shutdown, so the region and sockets are released then, not whenever
    /// Python drops the last reference to the group.
    engine: parking_lot::Mutex<Option<Arc<dyn Engine>>>,
    /// The CUDA engine, when the group was created with a device.
    cuda: parking_lot::Mutex<Option<CudaSide>>,
}

/// What `Group::run` returns: the Work of a host op, the end event of an asynchronous CUDA
/// op, or nothing (a blocking op that completed).
pub enum Ran {
    Work(Arc<WorkState>),
    Event(CudaEvent),
    Done,
}

/// Which engine runs a group's CUDA collectives.
#[derive(Clone)]
enum CudaSide {
    /// All ranks on one host: rsccl's kernels.
    Local(Arc<CudaEngine>),
    /// Ranks span hosts: NCCL (and rsccl's kernels inside each host, hierarchically).
    Nccl(Arc<NcclEngine>),
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
        let info = RankInfo::current(host_identity(), settings, global_rank);
        let mut listener = None;
        let (nonce, infos) = SetupWatch::none(rank, creation).during(Phase::Rendezvous, || {
            exchange(store, rank, size, &info, timeout, |nonce| {
                listener = Some(Listener::bind(&socket_name(nonce, rank), size as i32)?);
                Ok(())
            })
        })?;
        check_same_settings(&infos, &names)?;
        let topo = Topology::from_infos(rank, &infos);
        // From here every wait also watches the other local ranks' processes.
        let watch = SetupWatch::new(&topo, &infos, creation);
        // Every rank has published its record by now, so the local set-up gets the whole
        // timeout again rather than what the slowest rank left of it.
        let deadline = Instant::now() + timeout;
        let listener = listener.ok_or_else(|| Error::Internal("listener not bound".into()))?;
        let (kind, why) = choose_engine(&topo);
        let mut cuda = None;
        let engine: Option<Arc<dyn Engine>> = match kind {
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
                    cuda = Some(CudaSide::Nccl(e));
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
                    cuda = Some(CudaSide::Local(c));
                }
                let pids = ranks.iter().map(|&r| topo.pids[r]).collect();
                Some(Arc::new(watch.during(Phase::Engine, || HostEngine::start(region, layout, cfg.clone(), me, mesh, pids))?))
            }
        };
        let g = Group { topo, cfg, timeout, kind, engine: parking_lot::Mutex::new(engine), cuda: parking_lot::Mutex::new(cuda) };
        tracing::info!(
            rank,
            size,
            engine = kind.name(),
            why,
            hosts = g.topo.hosts.len(),
            host_region_bytes = g.stats().host_region_bytes,
            "rsccl group created"
        );
        Ok(g)
    }

    /// The seam: run one op on the engine of its place. Every torch method reaches the
    /// engines through here (Python: `Communicator.run`).
    ///
    /// The rule "a rank with bad arguments still joins the call as invalid, so its peers
    /// raise instead of waiting" lives here and nowhere else: an op that carries an error
    /// (found by the Python layer) or whose arguments fail to translate joins its call as
    /// invalid (host: `Collective::Invalid`, whose Work fails with the error every rank
    /// agrees on; CUDA: the first barrier only, see `cuda_invalid`) and returns the error.
    /// Point-to-point calls involve one peer only: they raise without joining.
    pub fn run(&self, op: Op) -> Result<Ran> {
        match op.place {
            Place::Host => self.run_host(op),
            Place::Cuda { stream } => self.run_cuda(op, stream),
        }
    }

    fn run_host(&self, op: Op) -> Result<Ran> {
        match op.kind {
            Kind::Send | Kind::Recv => {
                if let Some(e) = op.invalid {
                    return Err(e);
                }
                Ok(Ran::Work(self.submit_p2p(op.to_p2p()?, None)?))
            }
            Kind::AllReduce
            | Kind::ReduceScatter
            | Kind::AllGather
            | Kind::Broadcast
            | Kind::Barrier
            | Kind::Invalid
            | Kind::Gather
            | Kind::Scatter
            | Kind::Reduce
            | Kind::AllToAll => {
                let built = match op.invalid {
                    Some(e) => Err(e),
                    None => op.to_collective(self.topo.rank, self.topo.size),
                };
                let c = built.unwrap_or_else(|error| Collective::Invalid { kind: op.kind, error });
                if op.blocking {
                    self.run_now(c, None)?;
                    return Ok(Ran::Done);
                }
                Ok(Ran::Work(self.submit(c, None)?))
            }
        }
    }

    fn run_cuda(&self, op: Op, stream: u64) -> Result<Ran> {
        let ran = |ev: Option<CudaEvent>| ev.map_or(Ran::Done, Ran::Event);
        let asynchronous = !op.blocking;
        match op.kind {
            Kind::Send | Kind::Recv => {
                if let Some(e) = op.invalid {
                    return Err(e);
                }
                let peer = usize::try_from(op.root).map_err(|_| Error::InvalidArgument(format!("peer {} is not a rank", op.root)))?;
                let (send, span) = if op.kind == Kind::Send { (true, op.inp) } else { (false, op.out) };
                Ok(ran(self.cuda_p2p(send, span.ptr, span.bytes, peer, stream, asynchronous)?))
            }
            Kind::AllToAll if op.invalid.is_none() && op.splits.is_some() => {
                let x = op.splits.as_ref().expect("checked");
                Ok(ran(self.cuda_all_to_all(x, stream, asynchronous)?))
            }
            Kind::AllReduce
            | Kind::ReduceScatter
            | Kind::AllGather
            | Kind::Broadcast
            | Kind::Barrier
            | Kind::Invalid
            | Kind::Gather
            | Kind::Scatter
            | Kind::Reduce
            | Kind::AllToAll => {
                let call = match op.invalid {
                    Some(e) => Err(e),
                    None if op.kind == Kind::AllToAll => Err(Error::Internal("all_to_all without splits".into())),
                    None if op.kind == Kind::Invalid => Err(Error::Internal("an invalid call without its error".into())),
                    None => op.to_cuda(self.topo.size, stream),
                };
                match call {
                    Ok(c) => Ok(ran(self.cuda_launch(&c)?)),
                    Err(e) => {
                        // The peers' error is the mismatch they see; this rank's own is `e`
                        // (a failure to tell them is logged: `e` is the one to raise).
                        if !self.has_cuda() {
                            return Err(e);
                        }
                        if let Err(told) = self.cuda_invalid(stream) {
                            tracing::warn!(error = %told, "could not report an invalid CUDA call to the peers");
                        }
                        Err(e)
                    }
                }
            }
        }
    }

    fn engine(&self) -> Result<Arc<dyn Engine>> {
        match (&*self.engine.lock(), self.kind) {
            (Some(e), _) => Ok(e.clone()),
            (None, EngineKind::Host) => Err(Error::Aborted("the group was destroyed".into())),
            (None, EngineKind::Gloo) => {
                Err(Error::Internal("this group spans hosts; its CPU collectives run on gloo, not the host engine".into()))
            }
        }
    }

    pub fn submit(&self, c: Collective, timeout: Option<Duration>) -> Result<Arc<WorkState>> {
        Ok(self.engine()?.submit(c, timeout.unwrap_or(self.timeout)))
    }

    /// Run a collective on the calling thread (or after the queued ones) and return when done.
    pub fn run_now(&self, c: Collective, timeout: Option<Duration>) -> Result<()> {
        self.engine()?.run_now(c, timeout.unwrap_or(self.timeout))
    }

    /// Name the global rank of each group rank in this group's messages (a subgroup's).
    pub fn name_global_ranks(&self, global: Vec<usize>) -> Result<()> {
        if global.len() != self.topo.size {
            return Err(Error::InvalidArgument(format!("{} global ranks given for a group of {} ranks", global.len(), self.topo.size)));
        }
        if let Some(e) = &*self.engine.lock() {
            e.name_global_ranks(global);
        }
        Ok(())
    }

    pub fn submit_p2p(&self, op: P2p, timeout: Option<Duration>) -> Result<Arc<WorkState>> {
        Ok(self.engine()?.submit_p2p(op, timeout.unwrap_or(self.timeout)))
    }

    pub fn stats(&self) -> MemoryStats {
        self.engine.lock().as_ref().map(|e| e.stats()).unwrap_or_default()
    }

    fn cuda_side(&self) -> Result<CudaSide> {
        if let Some(c) = &*self.cuda.lock() {
            return Ok(c.clone());
        }
        Err(match self.kind {
            EngineKind::Host if self.engine.lock().is_none() => Error::Aborted("the group was destroyed".into()),
            EngineKind::Gloo => Error::InvalidArgument(
                "this group spans hosts and has no CUDA engine: CUDA was not initialized when it was created. Call \
                 torch.cuda.set_device(local_rank) before init_process_group/new_group"
                    .into(),
            ),
            EngineKind::Host => Error::InvalidArgument(
                "this group has no CUDA engine: CUDA was not initialized when it was created. Call \
                 torch.cuda.set_device(local_rank) before init_process_group/new_group"
                    .into(),
            ),
        })
    }

    /// rsccl's CUDA engine of this host (the pool lives there), or why there is none. A
    /// group that spans hosts has one only where every host has the same number >= 2 of
    /// its GPUs (it runs the host-local phases of hierarchical collectives).
    pub fn cuda(&self) -> Result<Arc<CudaEngine>> {
        match self.cuda_side()? {
            CudaSide::Local(c) => Ok(c),
            CudaSide::Nccl(n) => n.local().cloned().ok_or_else(|| {
                Error::InvalidArgument(
                    "this group spans hosts with unequal or single GPUs per host: its CUDA collectives run on NCCL \
                     alone, and it has no rsccl CUDA engine (nor pool) on this host"
                        .into(),
                )
            }),
        }
    }

    /// Launch a CUDA collective on whichever engine the group has.
    pub fn cuda_launch(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        match self.cuda_side()? {
            CudaSide::Local(e) => e.launch(c),
            CudaSide::Nccl(n) => n.launch(c),
        }
    }

    /// Launch a CUDA all_to_all (chunks in group-rank order) on whichever engine the group
    /// has: rsccl's kernel on one host (a group rank is then its local index), one NCCL
    /// group of sends and receives across hosts.
    pub fn cuda_all_to_all(&self, x: &AllToAll, stream: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        match self.cuda_side()? {
            CudaSide::Local(e) => e.launch_all_to_all(x, stream, asynchronous),
            CudaSide::Nccl(n) => n.launch_all_to_all(x, stream, asynchronous),
        }
    }

    /// Launch one CUDA send (`send`) or recv of `bytes` at `ptr` with group rank `peer`,
    /// after the caller's `stream`: on one host, rsccl's kernel on that (peer, direction)'s
    /// stream; across hosts, the NCCL engine (rsccl's kernel for a rank of this host where
    /// the group has a local engine, else the pair's NCCL communicator).
    pub fn cuda_p2p(&self, send: bool, ptr: u64, bytes: u64, peer: usize, stream: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        match self.cuda_side()? {
            CudaSide::Local(e) => {
                let local = self.topo.local_ranks().iter().position(|&r| r == peer).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "rank {}: CUDA {} rank {peer}: not a rank of this host in this group",
                        self.topo.rank,
                        if send { "send to" } else { "recv from" }
                    ))
                })?;
                e.launch_p2p(send, ptr, bytes, local, stream, asynchronous)
            }
            CudaSide::Nccl(n) => n.launch_p2p(send, ptr, bytes, peer, stream, asynchronous),
        }
    }

    /// This rank's arguments to a CUDA collective were invalid (see CudaKind::Invalid and
    /// NcclEngine::invalid): let the peers know instead of leaving them waiting.
    pub fn cuda_invalid(&self, stream: u64) -> Result<()> {
        match self.cuda_side()? {
            CudaSide::Local(e) => e.launch(&CudaCall::bare(crate::cuda::CudaKind::Invalid, 0, stream, false)).map(|_| ()),
            CudaSide::Nccl(n) => n.invalid(),
        }
    }

    /// Raise the error that made the group's CUDA side unusable, or a reported mismatch.
    /// Ok for a group without CUDA.
    pub fn cuda_health(&self) -> Result<()> {
        match self.cuda.lock().clone() {
            Some(CudaSide::Local(e)) => e.health(),
            Some(CudaSide::Nccl(n)) => n.health(),
            None => Ok(()),
        }
    }

    pub fn has_cuda(&self) -> bool {
        self.cuda.lock().is_some()
    }

    /// "rsccl" (rsccl's kernels), "nccl" (the group spans hosts), or None (no CUDA).
    pub fn cuda_engine_name(&self) -> Option<&'static str> {
        self.cuda.lock().as_ref().map(|c| match c {
            CudaSide::Local(_) => "rsccl",
            CudaSide::Nccl(_) => "nccl",
        })
    }

    /// Waits for the group's queued kernels (see CudaEngine::stats). A group that spans
    /// hosts reports its host-local rsccl engine, if it has one.
    pub fn cuda_stats(&self) -> Option<CudaStats> {
        // Not under the lock: reading the counters waits for the group's kernels, and
        // shutdown needs this lock to stop them.
        let side = self.cuda.lock().clone();
        match side? {
            CudaSide::Local(c) => Some(c.stats()),
            CudaSide::Nccl(n) => n.local().map(|c| c.stats()),
        }
    }

    /// The NCCL engine's counters (groups that span hosts, with CUDA).
    pub fn nccl_stats(&self) -> Option<NcclStats> {
        match self.cuda.lock().clone()? {
            CudaSide::Nccl(n) => Some(n.stats()),
            CudaSide::Local(_) => None,
        }
    }

    /// Stop the engine and release its region and sockets. Idempotent.
    pub fn shutdown(&self) {
        let cuda = self.cuda.lock().take();
        match cuda {
            Some(CudaSide::Local(c)) => c.shutdown(),
            Some(CudaSide::Nccl(n)) => n.shutdown(),
            None => {}
        }
        let engine = self.engine.lock().take();
        if let Some(e) = engine {
            e.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::RankInfo;

    #[test]
    fn engine_choice_follows_topology() {
        let i = |h: &str| RankInfo { pid: 1, host_id: h.into(), ..Default::default() };
        let one = Topology::from_infos(0, &[i("a"), i("a")]);
        assert_eq!(choose_engine(&one).0, EngineKind::Host);
        let two = Topology::from_infos(0, &[i("a"), i("b")]);
        assert_eq!(choose_engine(&two).0, EngineKind::Gloo);
    }
}
