//! `ProcessGroup`: a group of ranks and its collectives on `tch::Tensor`s. Every collective
//! checks its tensors, builds one engine operation (CPU tensors: rsccl-core's host engine;
//! CUDA tensors: its CUDA engine, after libtorch's current stream), and returns a `Work`
//! (`*_async`) or waits for it. A rank whose arguments are wrong still takes part (as
//! rsccl's Python backend does), so every rank returns the error instead of waiting.
//!
//! Ranks are group ranks: in a group from `new_group`, `root`, `src` and `dst` count
//! within that group.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rsccl_core::collective::{Collective, Kind};
use rsccl_core::cuda::{AllToAll, CudaCall, CudaEvent, CudaKind, CudaStats, NcclStats};
use rsccl_core::dtype::{DType, ReduceOp};
use rsccl_core::engine::P2p;
use rsccl_core::group::{EngineKind, Group};
use rsccl_core::{Error, Result};
use tch::Tensor;

use crate::options::{CudaDevice, LaunchEnv, Options};
use crate::store::{PrefixStore, StoreServer, TcpStore};
use crate::tensor::{self, check, CopyBack, Place};
use crate::work::Work;

/// dtypes rsccl's CUDA kernels reduce (gathers, broadcasts and all_to_all move bytes of any).
const CUDA_REDUCE_DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];

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

/// A CUDA operation, its stream filled in at launch.
enum Launch {
    Coll(CudaCall),
    AllToAll(AllToAll),
    P2p { send: bool, ptr: u64, bytes: u64, peer: usize },
}

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
        MemoryStats { engine: g.kind.name(), host: g.stats(), cuda: g.cuda_stats(), nccl: g.nccl_stats() }
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
                let r = g.run_now(Collective::Invalid { kind, error: error.clone() }, None);
                return Err(r.err().unwrap_or(error));
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
        let ev = match plan.op {
            Launch::Coll(mut c) => {
                c.stream = stream;
                c.asynchronous = asynchronous;
                g.cuda_launch(&c)?
            }
            Launch::AllToAll(x) => g.cuda_all_to_all(&x, stream, asynchronous)?,
            Launch::P2p { send, ptr, bytes, peer } => g.cuda_p2p(send, ptr, bytes, peer, stream, asynchronous)?,
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
    fn cuda_arg(&self, t: &Tensor, what: &str, op: Option<ReduceOp>) -> Result<tensor::Arg> {
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
        if let Some(op) = op {
            if !CUDA_REDUCE_DTYPES.contains(&a.dtype) {
                return Err(Error::InvalidType(format!(
                    "rank {me}: {what} is {}; rsccl's CUDA reductions take {}",
                    a.dtype.name(),
                    CUDA_REDUCE_DTYPES.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
                )));
            }
            if !matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max)
                || (op == ReduceOp::Avg && !a.dtype.is_float())
            {
                return Err(Error::InvalidType(format!(
                    "rank {me}: {what}: ReduceOp.{} on {} is not supported on CUDA",
                    op.name(),
                    a.dtype.name()
                )));
            }
        }
        Ok(a)
    }

    /// A CUDA collective whose preparation failed: take part as "invalid" (see `cuda`).
    fn cuda_failed(&self, device: i32, e: Error) -> Error {
        if self.inner.cuda_device.is_some() {
            if let Ok(stream) = crate::cuda::current_stream(device) {
                let _ = self.inner.group.cuda_invalid(stream);
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
        Launch::Coll(CudaCall { kind, dtype, op, root, inp, out, count, stream: 0, asynchronous: false })
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
        op: Option<ReduceOp>,
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
        if root >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "{what}: rank {} passed root {root}, not a rank of this group of {}",
                self.rank(),
                self.size()
            )));
        }
        Ok(())
    }

    // -- collectives -----------------------------------------------------------------------

    /// Reduce `t` across ranks in place with `op`.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_impl(t, op, true)?.wait()
    }

    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.all_reduce_impl(t, op, false)
    }

    fn all_reduce_impl(&self, t: &Tensor, op: ReduceOp, blocking: bool) -> Result<Work> {
        let me = self.rank();
        match tensor::place_of(&[t]) {
            Place::Cpu => self.host(Kind::AllReduce, blocking, || {
                let a = check(t, "all_reduce tensor", me)?;
                let c = tensor::contiguous(t, "all_reduce")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                Ok(op_plan(Collective::AllReduce { buf: tensor::buf(&c, a.dtype), dtype: a.dtype, op }, vec![t.shallow_clone(), c], post))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let a = self.cuda_arg(t, "all_reduce tensor", Some(op))?;
                let c = tensor::contiguous(t, "all_reduce")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                let p = tensor::ptr(&c);
                Ok(op_plan(Self::cuda_call(CudaKind::AllReduce, a.dtype, op, 0, p, p, c.numel() as u64), vec![t.shallow_clone(), c], post))
            }),
        }
    }

    /// Copy `root`'s `t` into every rank's `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        self.broadcast_impl(t, root, true)?.wait()
    }

    pub fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work> {
        self.broadcast_impl(t, root, false)
    }

    fn broadcast_impl(&self, t: &Tensor, root: usize, blocking: bool) -> Result<Work> {
        let me = self.rank();
        match tensor::place_of(&[t]) {
            Place::Cpu => self.host(Kind::Broadcast, blocking, || {
                let a = check(t, "broadcast tensor", me)?;
                let c = tensor::contiguous(t, "broadcast")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                Ok(op_plan(Collective::Broadcast { buf: tensor::buf(&c, a.dtype), dtype: a.dtype, root }, vec![t.shallow_clone(), c], post))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let a = self.cuda_arg(t, "broadcast tensor", None)?;
                self.check_root(root, "broadcast")?;
                let c = tensor::contiguous(t, "broadcast")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                let p = tensor::ptr(&c);
                let bytes = tensor::nbytes(&c, a.dtype) as u64;
                Ok(op_plan(
                    Self::cuda_call(CudaKind::Broadcast, DType::U8, ReduceOp::Sum, root, p, p, bytes),
                    vec![t.shallow_clone(), c],
                    post,
                ))
            }),
        }
    }

    /// Every rank's `input`, in rank order, into `output` (group size x input's elements).
    pub fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_impl(output, input, None, true)?.wait()
    }

    pub fn all_gather_into_tensor_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        self.all_gather_impl(output, input, None, false)
    }

    /// Every rank's `input` into `outputs[rank]` (one tensor per rank, each like `input`).
    pub fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_list(outputs, input, true)?.wait()
    }

    pub fn all_gather_async(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        self.all_gather_list(outputs, input, false)
    }

    fn all_gather_list(&self, outputs: &[Tensor], input: &Tensor, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let checked = (|| {
            let a = check(input, "all_gather input", me)?;
            if outputs.len() != n {
                return Err(Error::InvalidArgument(format!("all_gather: rank {me} passed {} outputs for a group of {n}", outputs.len())));
            }
            for (i, o) in outputs.iter().enumerate() {
                let b = check(o, "all_gather output", me)?;
                if b.dtype != a.dtype || o.numel() != input.numel() || b.place != a.place {
                    return Err(Error::InvalidArgument(format!(
                        "all_gather: rank {me} passed outputs[{i}] {}[{}] on {:?} for input {}[{}] on {:?}",
                        b.dtype.name(),
                        o.numel(),
                        o.device(),
                        a.dtype.name(),
                        input.numel(),
                        input.device()
                    )));
                }
            }
            let flat =
                Tensor::f_empty([(n * input.numel()) as i64], (a.kind, input.device())).map_err(|e| tensor::torch_err("all_gather", e))?;
            let post = CopyBack::split(&flat, outputs)?;
            Ok((flat, post))
        })();
        match checked {
            Ok((flat, post)) => self.all_gather_impl(&flat, input, Some(post), blocking),
            Err(e) => match tensor::place_of(&[input]) {
                Place::Cpu => self.host(Kind::AllGather, blocking, || Err(e)),
                Place::Cuda(d) => Err(self.cuda_failed(d, e)),
            },
        }
    }

    fn all_gather_impl(&self, output: &Tensor, input: &Tensor, extra: Option<CopyBack>, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let pair = |cuda: bool| {
            self.in_out("all_gather", input, output, cuda, None, || {
                if output.numel() != n * input.numel() {
                    return Err(Error::InvalidArgument(format!(
                        "all_gather: rank {me} passed output of {} elements for input of {} (the output holds group size {n} inputs)",
                        output.numel(),
                        input.numel()
                    )));
                }
                Ok(())
            })
        };
        match tensor::place_of(&[input]) {
            Place::Cpu => self.host(Kind::AllGather, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(false)?;
                let c = Collective::AllGather { input: tensor::buf(&i, a.dtype), output: tensor::buf(&o, a.dtype), dtype: a.dtype };
                Ok(op_plan(c, vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(true)?;
                let bytes = tensor::nbytes(&i, a.dtype) as u64;
                let l = Self::cuda_call(CudaKind::AllGather, DType::U8, ReduceOp::Sum, 0, tensor::ptr(&i), tensor::ptr(&o), bytes);
                Ok(op_plan(l, vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
        }
    }

    /// Reduce `input` (group size x output's elements) across ranks with `op`; rank r
    /// gets block r in `output`.
    pub fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_impl(output, input, op, true)?.wait()
    }

    pub fn reduce_scatter_tensor_async(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        self.reduce_scatter_impl(output, input, op, false)
    }

    /// Reduce `inputs[r]` across ranks with `op` into rank r's `output`.
    pub fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_list(output, inputs, op, true)?.wait()
    }

    pub fn reduce_scatter_async(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        self.reduce_scatter_list(output, inputs, op, false)
    }

    fn reduce_scatter_list(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let checked = (|| {
            let a = check(output, "reduce_scatter output", me)?;
            if inputs.len() != n {
                return Err(Error::InvalidArgument(format!("reduce_scatter: rank {me} passed {} inputs for a group of {n}", inputs.len())));
            }
            for (i, t) in inputs.iter().enumerate() {
                let b = check(t, "reduce_scatter input", me)?;
                if b.dtype != a.dtype || t.numel() != output.numel() || b.place != a.place {
                    return Err(Error::InvalidArgument(format!(
                        "reduce_scatter: rank {me} passed inputs[{i}] {}[{}] on {:?} for output {}[{}] on {:?}",
                        b.dtype.name(),
                        t.numel(),
                        t.device(),
                        a.dtype.name(),
                        output.numel(),
                        output.device()
                    )));
                }
            }
            tensor::flat_cat(inputs, "reduce_scatter")
        })();
        match checked {
            Ok(flat) => self.reduce_scatter_impl(output, &flat, op, blocking),
            Err(e) => match tensor::place_of(&[output]) {
                Place::Cpu => self.host(Kind::ReduceScatter, blocking, || Err(e)),
                Place::Cuda(d) => Err(self.cuda_failed(d, e)),
            },
        }
    }

    fn reduce_scatter_impl(&self, output: &Tensor, input: &Tensor, op: ReduceOp, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let pair = |cuda: bool| {
            self.in_out("reduce_scatter", input, output, cuda, Some(op), || {
                if input.numel() != n * output.numel() {
                    return Err(Error::InvalidArgument(format!(
                        "reduce_scatter: rank {me} passed input of {} elements for output of {} (the input holds group size {n} outputs)",
                        input.numel(),
                        output.numel()
                    )));
                }
                Ok(())
            })
        };
        match tensor::place_of(&[input]) {
            Place::Cpu => self.host(Kind::ReduceScatter, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(false)?;
                let c = Collective::ReduceScatter { input: tensor::buf(&i, a.dtype), output: tensor::buf(&o, a.dtype), dtype: a.dtype, op };
                Ok(op_plan(c, vec![input.shallow_clone(), output.shallow_clone(), i, o], post))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(true)?;
                let l = Self::cuda_call(CudaKind::ReduceScatter, a.dtype, op, 0, tensor::ptr(&i), tensor::ptr(&o), o.numel() as u64);
                Ok(op_plan(l, vec![input.shallow_clone(), output.shallow_clone(), i, o], post))
            }),
        }
    }

    /// Rows (dim 0) of `input` to every rank: `input_splits[r]` rows to rank r, and
    /// `output_splits[r]` rows from rank r into `output` (empty splits: equal parts).
    pub fn all_to_all_single(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<()> {
        self.all_to_all_single_impl(output, input, output_splits, input_splits, None, true)?.wait()
    }

    pub fn all_to_all_single_async(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<Work> {
        self.all_to_all_single_impl(output, input, output_splits, input_splits, None, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn all_to_all_single_impl(
        &self,
        output: &Tensor,
        input: &Tensor,
        out_splits: &[i64],
        in_splits: &[i64],
        extra: Option<CopyBack>,
        blocking: bool,
    ) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let prep = |cuda: bool| -> Result<(InOut, Vec<u64>, Vec<u64>)> {
            let mut splits = None;
            let st = self.in_out("all_to_all", input, output, cuda, None, || {
                let dtype = tensor::dtype_of_kind(input.f_kind().map_err(|e| tensor::torch_err("all_to_all", e))?).unwrap_or(DType::U8);
                let send = tensor::split_bytes(input, dtype, in_splits, n, &format!("all_to_all: rank {me}'s input"))?;
                let recv = tensor::split_bytes(output, dtype, out_splits, n, &format!("all_to_all: rank {me}'s output"))?;
                splits = Some((send, recv));
                Ok(())
            })?;
            let (send, recv) = splits.expect("set by the size check");
            Ok((st, send, recv))
        };
        match tensor::place_of(&[input]) {
            Place::Cpu => self.host(Kind::AllToAll, blocking, || {
                let (InOut { arg: a, inp: i, out: o, post }, send, recv) = prep(false)?;
                let c = Collective::AllToAll {
                    input: tensor::buf(&i, a.dtype),
                    output: tensor::buf(&o, a.dtype),
                    dtype: a.dtype,
                    send_bytes: send,
                    recv_bytes: recv,
                };
                Ok(op_plan(c, vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let (InOut { inp: i, out: o, post, .. }, send, recv) = prep(true)?;
                if send[me] != recv[me] {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_all: rank {me} sends itself {} bytes but expects {} bytes from itself",
                        send[me], recv[me]
                    )));
                }
                let (ip, op) = (tensor::ptr(&i), tensor::ptr(&o));
                let x = AllToAll {
                    send: tensor::offsets(&send).iter().map(|x| ip + x).collect(),
                    send_bytes: send,
                    recv: tensor::offsets(&recv).iter().map(|x| op + x).collect(),
                    recv_bytes: recv,
                };
                Ok(op_plan(Launch::AllToAll(x), vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
        }
    }

    /// `inputs[r]` to rank r; rank r's tensor for this rank into `outputs[r]` (one dtype).
    pub fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<()> {
        self.all_to_all_impl(outputs, inputs, true)?.wait()
    }

    pub fn all_to_all_async(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<Work> {
        self.all_to_all_impl(outputs, inputs, false)
    }

    fn all_to_all_impl(&self, outputs: &[Tensor], inputs: &[Tensor], blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let first: Vec<&Tensor> = inputs.iter().chain(outputs).collect();
        let place = tensor::place_of(&first);
        let cuda = matches!(place, Place::Cuda(_));
        // One flat input and output; splits of one row per element (1-D views).
        let prep = || -> Result<(Tensor, Tensor, Splits, CopyBack)> {
            if outputs.len() != n || inputs.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all: rank {me} passed {} inputs and {} outputs; expected group size {n} of each",
                    inputs.len(),
                    outputs.len()
                )));
            }
            let mut dtype = None;
            for t in inputs.iter().chain(outputs) {
                let a = if cuda { self.cuda_arg(t, "all_to_all tensor", None)? } else { check(t, "all_to_all tensor", me)? };
                if a.place != Place::Cpu && !cuda || dtype.is_some_and(|d| d != a.kind) {
                    return Err(Error::InvalidType(format!(
                        "all_to_all: rank {me} passed tensors of several dtypes or devices; give one of each"
                    )));
                }
                dtype = Some(a.kind);
            }
            let kind = dtype.unwrap_or(tch::Kind::Float);
            let device = inputs.first().map(|t| t.device()).unwrap_or(tch::Device::Cpu);
            let flat_in = tensor::flat_cat(inputs, "all_to_all")?;
            let total: usize = outputs.iter().map(|t| t.numel()).sum();
            let flat_out = Tensor::f_empty([total as i64], (kind, device)).map_err(|e| tensor::torch_err("all_to_all", e))?;
            let post = CopyBack::split(&flat_out, outputs)?;
            let splits = Splits {
                output: outputs.iter().map(|t| t.numel() as i64).collect(),
                input: inputs.iter().map(|t| t.numel() as i64).collect(),
            };
            Ok((flat_in, flat_out, splits, post))
        };
        match prep() {
            Ok((fi, fo, sp, post)) => self.all_to_all_single_impl(&fo, &fi, &sp.output, &sp.input, Some(post), blocking),
            Err(e) => match place {
                Place::Cpu => self.host(Kind::AllToAll, blocking, || Err(e)),
                Place::Cuda(d) => Err(self.cuda_failed(d, e)),
            },
        }
    }

    /// Block until every rank got here (with a CUDA engine: and every rank's GPU work
    /// queued on its current stream before it finished, as NCCL's barrier).
    pub fn barrier(&self) -> Result<()> {
        if let Some(d) = self.inner.cuda_device {
            // The barrier kernel runs after the current stream's earlier work; its end event
            // completing means both are done. synchronize() is bounded by the group timeout.
            let stream = crate::cuda::current_stream(d)?;
            if let Some(ev) = self.inner.group.cuda_launch(&CudaCall::bare(CudaKind::Barrier, 0, stream, true))? {
                ev.wait_on(stream)?;
                ev.synchronize()?;
            }
            return self.inner.group.cuda_health();
        }
        self.host(Kind::Barrier, true, || Ok(op_plan(Collective::Barrier, vec![], None)))?.wait()
    }

    /// With a CUDA engine this is `barrier()` (it waits on the CPU, as NCCL's does).
    pub fn barrier_async(&self) -> Result<Work> {
        if self.inner.cuda_device.is_some() {
            self.barrier()?;
            return Ok(Work::done());
        }
        self.host(Kind::Barrier, false, || Ok(op_plan(Collective::Barrier, vec![], None)))
    }

    /// Send `t` to group rank `dst` (matched with its `recv` of the same size; on CPU also
    /// by `tag`; CUDA ignores the tag, as NCCL does: messages between two ranks match in order).
    pub fn send(&self, t: &Tensor, dst: usize, tag: i64) -> Result<()> {
        self.p2p(t, dst, tag, true)?.wait()
    }

    pub fn send_async(&self, t: &Tensor, dst: usize, tag: i64) -> Result<Work> {
        self.p2p(t, dst, tag, true)
    }

    /// Receive into `t` from group rank `src`.
    pub fn recv(&self, t: &Tensor, src: usize, tag: i64) -> Result<()> {
        self.p2p(t, src, tag, false)?.wait()
    }

    pub fn recv_async(&self, t: &Tensor, src: usize, tag: i64) -> Result<Work> {
        self.p2p(t, src, tag, false)
    }

    /// Always asynchronous underneath: the blocking forms wait on the Work.
    fn p2p(&self, t: &Tensor, peer: usize, tag: i64, send: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let what = if send { "send" } else { "recv" };
        let a = check(t, &format!("{what} tensor"), me)?;
        if peer >= n || peer == me {
            return Err(Error::InvalidArgument(format!(
                "{what}: rank {me} passed peer {peer}; give another rank of this group of {n} (rsccl does not send to itself)"
            )));
        }
        let (c, post) = if send { (tensor::contiguous(t, what)?, None) } else { tensor::output(t, what)? };
        match a.place {
            Place::Cpu => {
                if self.inner.group.kind == EngineKind::Gloo {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: rank {me}: CPU send/recv in a group that spans hosts is not supported by rsccl-tch; use CUDA tensors"
                    )));
                }
                let buf = tensor::buf(&c, a.dtype);
                let op = if send { P2p::Send { buf, dtype: a.dtype, peer, tag } } else { P2p::Recv { buf, dtype: a.dtype, peer, tag } };
                let state = self.inner.group.submit_p2p(op, None)?;
                Ok(Work::host(state, vec![t.shallow_clone(), c], post))
            }
            Place::Cuda(d) => {
                self.cuda_arg(t, &format!("{what} tensor"), None)?;
                let (ptr, bytes) = (tensor::ptr(&c), tensor::nbytes(&c, a.dtype) as u64);
                self.cuda(d, false, op_plan(Launch::P2p { send, ptr, bytes, peer }, vec![t.shallow_clone(), c], post))
            }
        }
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
