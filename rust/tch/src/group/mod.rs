//! `ProcessGroup`: a group of ranks and its collectives on `tch::Tensor`s. Every collective
//! checks its tensors, builds one `Op` and runs it through `Group::run`, the core's one
//! front door, as rsccl's Python backend does (CPU tensors: the host engine; CUDA tensors:
//! the group's device engine, after libtorch's current stream), and returns a `Work`
//! (`*_async`) or waits for it. A rank whose arguments are wrong still takes part (as
//! rsccl's Python backend does), so every rank returns the error instead of waiting.
//!
//! Ranks are group ranks: in a group from `new_group`, `root`, `src` and `dst` count
//! within that group.
//!
//! The group itself (creation, sub-groups, the seam every collective goes through) is
//! here; the collectives and send/recv, each a few checks and one op, in collectives.rs.

mod collectives;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rsccl_core::collective::op::{Op, Place as OpPlace};
use rsccl_core::collective::Kind;
use rsccl_core::cuda::{CudaEvent, CudaStats, NcclStats};
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

/// What one call becomes: its `Op` (its place and blocking set by the seam,
/// `ProcessGroup::run`), the tensors to keep alive until it completed, and the copies into
/// the caller's tensors after.
struct Plan {
    op: Op,
    keep: Vec<Tensor>,
    post: Option<CopyBack>,
}

impl Plan {
    fn new(op: Op, keep: Vec<Tensor>, post: Option<CopyBack>) -> Plan {
        Plan { op, keep, post }
    }
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

    // -- the seam ------------------------------------------------------------------------

    /// The one seam, as Python's: run the op `prepare` builds (its checks, buffers and
    /// `Op`) for a `kind` call on the engine of `place`, through `Group::run`; the seam
    /// sets the op's place (the CPU, or libtorch's current stream of the device) and
    /// whether it blocks. If `prepare` fails, this rank joins the call as invalid
    /// (`join_invalid`), so every rank returns the error instead of waiting.
    fn run(&self, kind: Kind, place: Place, blocking: bool, prepare: impl FnOnce() -> Result<Plan>) -> Result<Work> {
        let g = &self.inner.group;
        if place == Place::Cpu && g.kind == EngineKind::Gloo {
            return Err(Error::InvalidArgument(format!(
                "rank {}: {} on CPU tensors in a group that spans hosts: rsccl runs those on gloo, which only its Python \
                 side has; use CUDA tensors",
                self.rank(),
                kind.name()
            )));
        }
        let Plan { mut op, keep, post } = match prepare() {
            Ok(p) => p,
            Err(e) => return Err(self.join_invalid(kind, place, e)),
        };
        op.blocking = blocking;
        let ran = match place {
            Place::Cpu => g.run(Op { place: OpPlace::Host, ..op })?,
            Place::Cuda(d) => {
                let stream = crate::cuda::current_stream(d)?;
                self.inner.release_finished();
                match g.run(Op { place: OpPlace::Cuda { stream }, ..op })? {
                    Ran::Event(ev) => return Ok(Work::cuda(self.inner.clone(), ev, d, stream, keep, post)),
                    other => other,
                }
            }
        };
        match ran {
            Ran::Work(w) => Ok(Work::host(w, keep, post)),
            Ran::Done => {
                if let Some(p) = post {
                    p.run()?;
                }
                Ok(Work::done())
            }
            Ran::Event(_) => Err(Error::Internal("the host engine returned a CUDA event".into())),
        }
    }

    /// This rank's `kind` call on `place` failed its checks (`e`): it joins the call as
    /// invalid (`Op::invalid` through `Group::run`, the rule's one owner), so its peers
    /// raise instead of waiting; returns the error this rank gets (on host memory the one
    /// the ranks agree on). A send or recv raises alone (`Group::run`).
    fn join_invalid(&self, kind: Kind, place: Place, e: Error) -> Error {
        let op = match place {
            Place::Cpu => Op { blocking: true, ..Op::invalid(kind, OpPlace::Host, e.clone()) },
            Place::Cuda(d) => match (self.inner.cuda_device, crate::cuda::current_stream(d)) {
                (Some(_), Ok(stream)) => Op::invalid(kind, OpPlace::Cuda { stream }, e.clone()),
                _ => return e,
            },
        };
        self.inner.group.run(op).err().unwrap_or(e)
    }

    /// Check a tensor of a call on `place` (`what` in messages): on CUDA also that it is on
    /// the group's GPU.
    fn arg(&self, t: &Tensor, what: &str, place: Place) -> Result<tensor::Arg> {
        let me = self.rank();
        let a = check(t, what, me)?;
        if place == Place::Cpu {
            return Ok(a);
        }
        let Some(dev) = self.inner.cuda_device else {
            return Err(Error::InvalidArgument(format!(
                "rank {me}: {what} is a CUDA tensor, but this group has no CUDA engine (it was created with \
                 CudaDevice::None, or libtorch saw no GPU)"
            )));
        };
        if a.place != Place::Cuda(dev) {
            return Err(Error::InvalidArgument(format!("rank {me}: {what} is on {:?}, but its group uses cuda:{dev}", t.device())));
        }
        Ok(a)
    }

    /// Check the (input, output) pair of collective `what` on `place`: same dtype and
    /// device (CUDA: the group's GPU); and stage it: the input contiguous (a copy if it
    /// overlaps the output: a collective must not read what it writes), the output itself
    /// or a contiguous stand-in copied back after. Sizes and what the engine reduces are
    /// the core's to check (`Group::run`), as for Python's calls.
    fn in_out(&self, what: &str, input: &Tensor, output: &Tensor, place: Place) -> Result<InOut> {
        let me = self.rank();
        let (a, b) = (self.arg(input, &format!("{what} input"), place)?, self.arg(output, &format!("{what} output"), place)?);
        if a.dtype != b.dtype || a.place != b.place {
            return Err(Error::InvalidType(format!(
                "{what}: rank {me} passed output {} on {:?} for input {} on {:?}",
                b.dtype.name(),
                output.device(),
                a.dtype.name(),
                input.device()
            )));
        }
        let mut inp = tensor::contiguous(input, what)?;
        if tensor::may_overlap(&inp, output, a.dtype) {
            inp = tensor::copy(&inp, what)?;
        }
        let (out, post) = tensor::output(output, what)?;
        Ok(InOut { arg: a, inp, out, post })
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
