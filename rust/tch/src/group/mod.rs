//! `ProcessGroup`: a group of ranks and its collectives on `tch::Tensor`s. Every collective
//! checks its tensors, builds one engine operation (CPU tensors: rsccl-core's host engine;
//! CUDA tensors: its CUDA engine, after libtorch's current stream), and returns a `Work`
//! (`*_async`) or waits for it. A rank whose arguments are wrong still takes part (as
//! rsccl's Python backend does), so every rank returns the error instead of waiting.
//!
//! Ranks are group ranks: in a group from `new_group`, `root`, `src` and `dst` count
//! within that group.
//!
//! The group itself (creation, sub-groups, the engine seams every collective goes through)
//! is here; the collectives and send/recv, each a few checks and one plan, in collectives.rs.

mod collectives;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rsccl_core::collective::op::{Op, Place as OpPlace};
use rsccl_core::collective::{validate, Collective, Kind};
use rsccl_core::cuda::{CudaCall, CudaEvent, CudaKind, CudaStats, DeviceCall, NcclStats};
use rsccl_core::dtype::{DType, ReduceOp};
use rsccl_core::group::Ran;
use rsccl_core::group::{EngineKind, Group};
use rsccl_core::{Error, Result};
use tch::Tensor;

use crate::options::{CudaDevice, LaunchEnv, Options};
use crate::store::{PrefixStore, StoreServer, TcpStore};
use crate::tensor::{self, check, CopyBack, Place};
use crate::work::Work;

/// A group of ranks (see the module docs). Cheap to clone; the group is destroyed when the
/// last clone and the last Work of it are dropped, or at `shutdown`.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) group: Group,
    store: Arc<TcpStore>,
    /// This group's keys in the store.
    prefix: String,
    /// Global rank of each group rank.
    ranks: Vec<usize>,
    opts: Options,
    cuda_device: Option<i32>,
    /// Groups made from this one so far (every rank makes them in the same order).
    children: AtomicU64,
    /// CUDA Works dropped unwaited: their tensors, until their collective finished.
    pending: Mutex<VecDeque<Parked>>,
    /// The store rank 0 hosts when no torchrun agent does (kept for the job's life).
    _server: Option<Arc<StoreServer>>,
}

struct Parked {
    event: CudaEvent,
    _keep: (Vec<Tensor>, Option<CopyBack>),
}

impl Inner {
    /// Keep `keep` until `event` completed.
    pub(crate) fn park(&self, event: CudaEvent, keep: Vec<Tensor>, post: Option<CopyBack>) {
        self.pending.lock().push_back(Parked { event, _keep: (keep, post) });
    }

    /// Drop the parked tensors whose collectives finished (they finish in launch order
    /// on one stream: stop at the first still running).
    fn release_finished(&self) {
        let mut p = self.pending.lock();
        while p.front().is_some_and(|x| x.event.query().unwrap_or(true)) {
            p.pop_front();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for p in self.pending.get_mut().drain(..) {
            let _ = p.event.synchronize();
        }
        self.group.shutdown();
    }
}

/// A CUDA operation: a `DeviceCall` whose stream is filled in at launch.
type Launch = DeviceCall;

/// What one call becomes on an engine: the operation, the tensors to keep alive until it
/// completed, and the copies into the caller's tensors after.
struct Plan<Op> {
    op: Op,
    keep: Vec<Tensor>,
    post: Option<CopyBack>,
}

fn op_plan<Op>(op: Op, keep: Vec<Tensor>, post: Option<CopyBack>) -> Plan<Op> {
    Plan { op, keep, post }
}

/// The staged buffers of an (input, output) collective (see `ProcessGroup::in_out`).
struct InOut {
    arg: tensor::Arg,
    inp: Tensor,
    out: Tensor,
    post: Option<CopyBack>,
}

/// all_to_all split sizes (elements of 1-D buffers) per rank.
struct Splits {
    output: Vec<i64>,
    input: Vec<i64>,
}

/// Memory and traffic counters of a group (rsccl.ProcessGroup.memory_stats() in Python).
#[derive(Debug, Clone)]
pub struct MemoryStats {
    /// "host" (rsccl's shared-memory engine) or "gloo" (the group spans hosts).
    pub engine: &'static str,
    pub host: rsccl_core::engine::MemoryStats,
    pub cuda: Option<CudaStats>,
    pub nccl: Option<NcclStats>,
}

fn resolve_device(choice: CudaDevice, local_rank: usize) -> Result<Option<i32>> {
    let count = || {
        if crate::cuda::load_torch_cuda() && tch::Cuda::is_available() {
            tch::Cuda::device_count() as i32
        } else {
            0
        }
    };
    match choice {
        CudaDevice::None => Ok(None),
        CudaDevice::Auto => {
            let n = count();
            Ok((n > 0).then(|| (local_rank % n as usize) as i32))
        }
        CudaDevice::Index(d) => {
            let n = count();
            if d < 0 || d >= n {
                return Err(Error::Config(format!("CUDA device {d} was asked for, but libtorch sees {n} CUDA devices")));
            }
            Ok(Some(d))
        }
    }
}

impl ProcessGroup {
    /// Join the group torchrun launched this process into (see `LaunchEnv`), with default
    /// options (RSCCL_* variables apply).
    pub fn from_env() -> Result<ProcessGroup> {
        ProcessGroup::from_env_with(Options::default())
    }

    /// `from_env` with options. Under torchrun the agent's store is used; without it,
    /// rank 0 hosts a store on MASTER_PORT and every rank connects to MASTER_ADDR.
    pub fn from_env_with(opts: Options) -> Result<ProcessGroup> {
        let env = LaunchEnv::from_env()?;
        let server = if !env.agent_store && env.rank == 0 { Some(Arc::new(StoreServer::start("0.0.0.0", env.master_port)?)) } else { None };
        let store = Arc::new(TcpStore::connect(&env.master_addr, env.master_port, opts.timeout)?);
        if env.world_size > env.local_world_size {
            // A group across hosts runs its CUDA collectives on NCCL: torch's libnccl.so.2
            // (the nvidia-nccl package) on the library path. Absent, group creation says so.
            let _ = rsccl_core::cuda::nccl::load("libnccl.so.2");
        }
        let device = resolve_device(opts.cuda_device, env.local_rank)?;
        ProcessGroup::create(store, env.key_prefix(), (0..env.world_size).collect(), env.rank, opts, device, server)
    }

    /// Join a group of `size` ranks through `store`, under `prefix` (every rank passes the
    /// same): for launchers other than torchrun.
    pub fn new(store: Arc<TcpStore>, prefix: &str, rank: usize, size: usize, opts: Options) -> Result<ProcessGroup> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} is invalid for a group of size {size}")));
        }
        let device = resolve_device(opts.cuda_device, rank)?;
        ProcessGroup::create(store, prefix.to_string(), (0..size).collect(), rank, opts, device, None)
    }

    fn create(
        store: Arc<TcpStore>,
        prefix: String,
        ranks: Vec<usize>,
        rank: usize,
        opts: Options,
        device: Option<i32>,
        server: Option<Arc<StoreServer>>,
    ) -> Result<ProcessGroup> {
        let cfg = opts.config()?;
        if let Some(d) = device {
            crate::cuda::set_device(d)?;
        }
        let keys = PrefixStore::new(store.clone(), prefix.clone());
        let group = Group::create(&keys, rank, ranks.len(), opts.timeout, cfg, device)?;
        let cuda_device = if group.has_cuda() { device } else { None };
        Ok(ProcessGroup {
            inner: Arc::new(Inner {
                group,
                store,
                prefix,
                ranks,
                opts,
                cuda_device,
                children: AtomicU64::new(0),
                pending: Mutex::new(VecDeque::new()),
                _server: server,
            }),
        })
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.group.topo.rank
    }

    pub fn size(&self) -> usize {
        self.inner.group.topo.size
    }

    /// The global (world) rank of each rank of this group.
    pub fn global_ranks(&self) -> &[usize] {
        &self.inner.ranks
    }

    /// The GPU of this group's CUDA engine (None: CPU tensors only).
    pub fn cuda_device(&self) -> Option<i32> {
        self.inner.cuda_device
    }

    /// "host" (one host: rsccl's shared-memory engine) or "gloo" (the group spans hosts;
    /// only CUDA tensors are supported then, through NCCL).
    pub fn engine(&self) -> &'static str {
        self.inner.group.kind.name()
    }

    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    pub fn memory_stats(&self) -> MemoryStats {
        let g = &self.inner.group;
        let s = g.stats();
        MemoryStats { engine: g.kind.name(), host: s.host, cuda: s.cuda, nccl: s.nccl }
    }

    /// A group of some of this group's ranks (`ranks`: group ranks of this group, any
    /// order, no repeats). Every rank of this group calls it, in the same order as its
    /// other new_group calls (as torch.distributed.new_group); members get the group,
    /// the others None.
    pub fn new_group(&self, ranks: &[usize], opts: Option<Options>) -> Result<Option<ProcessGroup>> {
        let k = self.inner.children.fetch_add(1, Ordering::SeqCst);
        let n = self.size();
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() || sorted.iter().any(|&r| r >= n) || sorted.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "new_group: rank {} passed ranks {ranks:?}; give distinct ranks of this group of {n}",
                self.rank()
            )));
        }
        let Some(me) = sorted.iter().position(|&r| r == self.rank()) else { return Ok(None) };
        let opts = opts.unwrap_or_else(|| self.inner.opts.clone());
        let global = sorted.iter().map(|&r| self.inner.ranks[r]).collect();
        let prefix = format!("{}/group{k}", self.inner.prefix);
        let device = match opts.cuda_device {
            CudaDevice::Auto => self.inner.cuda_device,
            other => resolve_device(other, 0)?,
        };
        ProcessGroup::create(self.inner.store.clone(), prefix, global, me, opts, device, self.inner._server.clone()).map(Some)
    }

    /// Stop the engines and release the group's memory; pending operations fail. Later
    /// calls return an error.
    pub fn shutdown(&self) {
        self.inner.group.shutdown();
    }

    // -- the two seams -------------------------------------------------------------------

    /// Run a CPU collective on the host engine: `prepare` checks the arguments and builds
    /// the operation. If it fails, this rank takes part as `Invalid`, so every rank
    /// returns the error (with every failed rank's message).
    fn host(&self, kind: Kind, blocking: bool, prepare: impl FnOnce() -> Result<Plan<Collective>>) -> Result<Work> {
        let g = &self.inner.group;
        if g.kind == EngineKind::Gloo {
            return Err(Error::InvalidArgument(format!(
                "rank {}: {} on CPU tensors in a group that spans hosts: rsccl runs those on gloo, which only its Python \
                 side has; use CUDA tensors",
                self.rank(),
                kind.name()
            )));
        }
        let plan = match prepare() {
            Ok(p) => p,
            Err(error) => {
                // Joins the call as invalid (Group::run): every rank's Work fails with the
                // error they agree on.
                let mut op = Op::invalid(kind, OpPlace::Host, error.clone());
                op.blocking = true;
                return Err(g.run(op).err().unwrap_or(error));
            }
        };
        if blocking {
            g.run_now(plan.op, None)?;
            if let Some(p) = plan.post {
                p.run()?;
            }
            return Ok(Work::done());
        }
        Ok(Work::host(g.submit(plan.op, None)?, plan.keep, plan.post))
    }

    /// Launch a CUDA operation after libtorch's current stream of `device` (its
    /// arguments were checked: see `cuda_coll`).
    fn cuda(&self, device: i32, blocking: bool, plan: Plan<Launch>) -> Result<Work> {
        let g = &self.inner.group;
        let stream = crate::cuda::current_stream(device)?;
        self.inner.release_finished();
        let asynchronous = !blocking;
        let ev = match g.run_device(plan.op.after(stream, asynchronous))? {
            Ran::Event(ev) => Some(ev),
            Ran::Done => None,
            Ran::Work(_) => return Err(Error::Internal("a device engine returned a host Work".into())),
        };
        match ev {
            None => {
                if let Some(p) = plan.post {
                    p.run()?;
                }
                Ok(Work::done())
            }
            Some(ev) => Ok(Work::cuda(self.inner.clone(), ev, device, stream, plan.keep, plan.post)),
        }
    }

    /// Check a CUDA collective's tensor against the group; on error, tell the peers (see
    /// `cuda`) before returning it.
    fn cuda_arg(&self, t: &Tensor, what: &str, op: Option<(Kind, ReduceOp)>) -> Result<tensor::Arg> {
        let me = self.rank();
        let a = check(t, what, me)?;
        let Some(dev) = self.inner.cuda_device else {
            return Err(Error::InvalidArgument(format!(
                "rank {me}: {what} is a CUDA tensor, but this group has no CUDA engine (it was created with \
                 CudaDevice::None, or libtorch saw no GPU)"
            )));
        };
        if a.place != Place::Cuda(dev) {
            return Err(Error::InvalidArgument(format!("rank {me}: {what} is on {:?}, but its group uses cuda:{dev}", t.device())));
        }
        if let Some((kind, op)) = op {
            // What the group's engine reduces has one home: the engine's answer, as for
            // Python's calls (rsccl's kernels on one host, NCCL across hosts).
            self.inner.group.device_can_run(kind, a.dtype, op)?;
        }
        Ok(a)
    }

    /// A CUDA reduction the group's engine cannot run at all is refused here, before its
    /// call is prepared, the way the engine refuses (`Group::refuse_on_device`, as
    /// `Group::run` does): every rank that passed the same dtype and op gets the same
    /// answer, and the group stays usable (an error while preparing joins the call as
    /// invalid, which aborts a group on the NCCL engine). A tensor without a dtype rsccl
    /// knows is left to the preparation's checks.
    fn refuse_unrunnable(&self, t: &Tensor, kind: Kind, op: ReduceOp, device: i32) -> Result<()> {
        match check(t, "the tensor", self.rank()) {
            Ok(a) if self.inner.cuda_device.is_some() => {
                let stream = crate::cuda::current_stream(device)?;
                self.inner.group.refuse_on_device(kind, a.dtype, op, stream)
            }
            _ => Ok(()),
        }
    }

    /// A CUDA collective whose preparation failed: take part as "invalid" (Group::run), so
    /// the peers raise too; returns this rank's error.
    fn cuda_failed(&self, device: i32, e: Error) -> Error {
        if self.inner.cuda_device.is_some() {
            if let Ok(stream) = crate::cuda::current_stream(device) {
                let op = Op::invalid(Kind::Invalid, OpPlace::Cuda { stream }, e.clone());
                return self.inner.group.run(op).err().unwrap_or(e);
            }
        }
        e
    }

    /// A CUDA collective: if `prepare` (the checks and buffers) fails, this rank takes part
    /// in the collective's first barrier as "invalid", so the peers report a mismatch
    /// instead of waiting, and returns its own error (send/recv do not: only the peer is
    /// involved, and it times out).
    fn cuda_coll(&self, device: i32, blocking: bool, prepare: impl FnOnce() -> Result<Plan<Launch>>) -> Result<Work> {
        match prepare() {
            Ok(plan) => self.cuda(device, blocking, plan),
            Err(e) => Err(self.cuda_failed(device, e)),
        }
    }

    fn cuda_call(kind: CudaKind, dtype: DType, op: ReduceOp, root: usize, inp: u64, out: u64, count: u64) -> Launch {
        DeviceCall::Collective(CudaCall { kind, dtype, op, root, inp, out, count, stream: 0, asynchronous: false })
    }

    /// Check the (input, output) pair of collective `what`: same dtype and device (CUDA:
    /// the group's GPU and, with `op`, a dtype its kernels reduce), then `sizes`; and stage
    /// it: the input contiguous (a copy if it overlaps the output: a collective must not
    /// read what it writes), the output itself or a contiguous stand-in copied back after.
    fn in_out(
        &self,
        what: &str,
        input: &Tensor,
        output: &Tensor,
        cuda: bool,
        op: Option<(Kind, ReduceOp)>,
        sizes: impl FnOnce() -> Result<()>,
    ) -> Result<InOut> {
        let me = self.rank();
        let (win, wout) = (format!("{what} input"), format!("{what} output"));
        let (a, b) = if cuda {
            (self.cuda_arg(input, &win, op)?, self.cuda_arg(output, &wout, op)?)
        } else {
            (check(input, &win, me)?, check(output, &wout, me)?)
        };
        if a.dtype != b.dtype || a.place != b.place {
            return Err(Error::InvalidType(format!(
                "{what}: rank {me} passed output {} on {:?} for input {} on {:?}",
                b.dtype.name(),
                output.device(),
                a.dtype.name(),
                input.device()
            )));
        }
        sizes()?;
        let mut inp = tensor::contiguous(input, what)?;
        if tensor::may_overlap(&inp, output, a.dtype) {
            inp = tensor::copy(&inp, what)?;
        }
        let (out, post) = tensor::output(output, what)?;
        Ok(InOut { arg: a, inp, out, post })
    }

    fn check_root(&self, root: usize, what: &str) -> Result<()> {
        let r = i64::try_from(root).unwrap_or(i64::MAX);
        validate::root(what, r, self.size()).map(|_| ()).map_err(|e| e.naming_rank(self.rank()))
    }
}

// The store is also usable directly (e.g. to share a value between ranks).
impl ProcessGroup {
    /// The store this group joined through (keys of this group live under its prefix).
    pub fn store(&self) -> &Arc<TcpStore> {
        &self.inner.store
    }

    /// This group's key prefix in the store.
    pub fn store_prefix(&self) -> &str {
        &self.inner.prefix
    }
}

#[allow(dead_code)]
fn assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<ProcessGroup>();
}
