//! rsccl._rsccl: pyo3 bindings only. Methods convert Python values, release the GIL,
//! call the core, and map errors (errors.rs); no logic lives here.

mod completion;
mod errors;
mod store;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rsccl_core::collective::op::Chunks;
use rsccl_core::collective::op::{Op, Place, Span};
use rsccl_core::collective::Kind;
use rsccl_core::config::{Config, SETTINGS};
use rsccl_core::dtype::{DType, ReduceOp};
use rsccl_core::group::{Group, Ran};
use rsccl_core::work::WorkState;
use rsccl_core::Error;

use errors::{to_py, IntoPyResult};

/// (data_ptr, nbytes) of a contiguous tensor the caller keeps alive until the Work completes.
type PyBuf = (usize, usize);

fn timeout_of(t: Option<f64>) -> Option<Duration> {
    t.filter(|s| *s > 0.0).map(Duration::from_secs_f64)
}

/// The result of one submitted operation.
#[pyclass(module = "rsccl._rsccl", frozen)]
struct Work(Arc<WorkState>);

#[pymethods]
impl Work {
    /// Block (GIL released) until done; raise the operation's error if it failed.
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<()> {
        let w = self.0.clone();
        py.detach(move || w.wait(timeout_of(timeout_s))).py()
    }

    fn is_completed(&self) -> bool {
        self.0.is_completed()
    }

    /// None while running or on success; the exception it failed with otherwise.
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.0.result() {
            Some(Err(e)) => Some(to_py(e).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Call `fn(exc_or_None)` once done, on one of rsccl's completion threads (never on
    /// an engine thread, see completion.rs).
    fn add_done_callback(&self, cb: Py<PyAny>) {
        self.0.on_complete(Box::new(move |r| {
            let r = r.clone();
            completion::dispatch(Box::new(move || {
                Python::attach(|py| {
                    let arg: Option<Py<PyAny>> = r.err().map(|e| to_py(e).into_value(py).into_any());
                    if let Err(err) = cb.call1(py, (arg,)) {
                        err.write_unraisable(py, None);
                    }
                })
            }));
        }));
    }
}

/// One rsccl communicator (the Rust half of rsccl's ProcessGroup).
#[pyclass(module = "rsccl._rsccl", frozen)]
struct Communicator(Group);

#[pymethods]
impl Communicator {
    /// Rendezvous through `store` and build everything the group needs (blocks, GIL released).
    /// `nccl_path`: torch's libnccl.so.2, loaded if given (a group that spans hosts runs
    /// its CUDA collectives on it).
    /// `global_rank`: this rank's rank in the default group (named in errors); its group
    /// rank if not given.
    #[new]
    #[pyo3(signature = (store, rank, size, timeout_s, options=None, cuda_device=None, nccl_path=None, global_rank=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        size: usize,
        timeout_s: f64,
        options: Option<Vec<(String, String)>>,
        cuda_device: Option<i32>,
        nccl_path: Option<String>,
        global_rank: Option<usize>,
    ) -> PyResult<Self> {
        let cfg = Config::from_env(&options.unwrap_or_default()).py()?;
        if let Some(p) = &nccl_path {
            rsccl_core::cuda::nccl::load(p).py()?;
        }
        let timeout = Duration::from_secs_f64(timeout_s.max(0.001));
        let store = store::PyStore(store);
        let g = py.detach(move || Group::create_as(&store, rank, global_rank.unwrap_or(rank), size, timeout, cfg, cuda_device)).py()?;
        Ok(Communicator(g))
    }

    #[getter]
    fn rank(&self) -> usize {
        self.0.topo.rank
    }

    #[getter]
    fn size(&self) -> usize {
        self.0.topo.size
    }

    /// Where CPU tensors go: the ROUTES code of "host" (rsccl's shared-memory engine) or
    /// "gloo" (the group spans hosts).
    #[getter]
    fn route(&self) -> u8 {
        self.0.kind as u8
    }

    #[getter]
    fn hosts(&self) -> Vec<Vec<usize>> {
        self.0.topo.hosts.clone()
    }

    #[getter]
    fn timeout_s(&self) -> f64 {
        self.0.timeout.as_secs_f64()
    }

    /// The one entry point of every operation (collective/op.rs, Group::run): `kind`,
    /// `dtype`, `op` are the codes of KINDS, DTYPES, OPS (a dtype or op rsccl lacks comes
    /// as its torch name, and the call joins as invalid with the message naming it);
    /// buffers are (address, bytes); `root` is the root of rooted kinds or the peer of
    /// send/recv; `stream` is the caller's current CUDA stream for device buffers, None for
    /// host memory; `splits` (all_to_all) are per peer (send addresses, send bytes, recv
    /// addresses, recv bytes). Plain positional ints keep the blocking CUDA all_reduce's
    /// CPU cost down (no options object per call). Returns a Work (host), the end event of
    /// an asynchronous CUDA op, or None (a blocking op, done). Runs with the GIL released.
    #[pyo3(signature = (kind, inp, inp_bytes, out, out_bytes, dtype, op, root, stream, blocking, splits=None, tag=0))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        kind: u8,
        inp: u64,
        inp_bytes: u64,
        out: u64,
        out_bytes: u64,
        dtype: Code,
        op: Code,
        root: i64,
        stream: Option<u64>,
        blocking: bool,
        splits: Option<Splits>,
        tag: i64,
    ) -> PyResult<Option<Py<PyAny>>> {
        let kind = Kind::from_code(kind).ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("unknown kind code {kind}")))?;
        let place = stream.map_or(Place::Host, |stream| Place::Cuda { stream });
        let (dtype, op, invalid) = match (dtype.dtype(), op.op()) {
            (Ok(d), Ok(o)) => (d, o, None),
            // The CUDA engines move bytes of any dtype, rsccl's or not (CudaCall::from_op).
            (Err(_), Ok(o)) if place != Place::Host && kind.moves_bytes() => (DType::U8, o, None),
            (Err(e), _) | (_, Err(e)) => (DType::U8, ReduceOp::Sum, Some(e)),
        };
        let splits = splits.map(|(send, send_bytes, recv, recv_bytes)| Chunks { send, send_bytes, recv, recv_bytes });
        let op = Op {
            inp: Span { ptr: inp, bytes: inp_bytes },
            out: Span { ptr: out, bytes: out_bytes },
            dtype,
            op,
            root,
            tag,
            splits,
            blocking,
            invalid,
            ..Op::new(kind, place)
        };
        let ran = py.detach(|| self.0.run(op)).py()?;
        ran_to_py(py, ran)
    }

    /// This rank's arguments to `kind` (a KINDS code) were invalid: join the call as
    /// invalid (Group::run), so every rank raises instead of waiting. `error_class` is an
    /// ERROR_CLASSES code. Host memory (`stream` None): returns the Work that fails with the
    /// error the ranks agree on. CUDA: raises this rank's error once the peers are told.
    #[pyo3(signature = (kind, error_class, message, stream=None))]
    fn invalid(&self, py: Python<'_>, kind: u8, error_class: u8, message: String, stream: Option<u64>) -> PyResult<Option<Py<PyAny>>> {
        let kind = Kind::from_code(kind).ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("unknown kind code {kind}")))?;
        let place = stream.map_or(Place::Host, |stream| Place::Cuda { stream });
        let op = Op::invalid(kind, place, Error::from_class_code(error_class, message));
        let ran = py.detach(|| self.0.run(op)).py()?;
        ran_to_py(py, ran)
    }

    /// The global rank of each group rank, named in this subgroup's error messages.
    fn name_global_ranks(&self, global_ranks: Vec<usize>) -> PyResult<()> {
        self.0.name_global_ranks(global_ranks).py()
    }

    /// A recv from whichever rank sends a message with `tag` first (CPU buffers); the
    /// RecvSource names that rank once the Work completed.
    fn recv_any(&self, b: PyBuf, dtype: Code, tag: i64) -> PyResult<(Work, RecvSource)> {
        let source = Arc::new(AtomicUsize::new(usize::MAX));
        let out = Span { ptr: b.0 as u64, bytes: b.1 as u64 };
        let op = Op { out, dtype: dtype.dtype().py()?, tag, any_source: Some(source.clone()), ..Op::new(Kind::Recv, Place::Host) };
        match self.0.run(op).py()? {
            Ran::Work(w) => Ok((Work(w), RecvSource(source))),
            _ => Err(pyo3::exceptions::PyRuntimeError::new_err("rsccl: a recv from any source returned no Work")),
        }
    }

    /// Whether the group has a CUDA engine (rsccl's or, across hosts, NCCL).
    #[getter]
    fn has_cuda(&self) -> bool {
        self.0.has_cuda()
    }

    /// Where CUDA tensors go: the ROUTES code of "rsccl" (one host: rsccl's kernels) or
    /// "nccl" (across hosts), or None (no CUDA).
    #[getter]
    fn cuda_route(&self) -> Option<u8> {
        self.0.cuda_route().map(|r| r as u8)
    }

    /// Bytes of this group's pool per rank (0: none); reads nothing from the device.
    #[getter]
    fn cuda_pool_bytes(&self) -> u64 {
        self.0.cuda().map(|c| c.pool_bytes() as u64).unwrap_or(0)
    }

    /// For the GPU tests only: every CUDA block's barrier epoch and this rank's barrier flags
    /// set to `epoch` (CudaEngine::set_epochs_for_test: every rank, between the same two
    /// collectives, then a host barrier before any launches again).
    fn _set_cuda_epochs_for_test(&self, py: Python<'_>, epoch: u32) -> PyResult<()> {
        let engine = self.0.cuda().py()?;
        py.detach(|| engine.set_epochs_for_test(epoch)).py()
    }

    /// The (alloc, free) C function addresses of this group's pool, for
    /// torch._C._cuda_customAllocator; raises if the group has no pool.
    fn pool_allocator(&self) -> PyResult<(usize, usize)> {
        let engine = self.0.cuda().py()?;
        let heap = engine.heap().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err(
                "rsccl: this group has no pool: create it with rsccl.Options(cuda_pool_bytes=...) or \
                 RSCCL_CUDA_POOL_BYTES (bytes per rank, mapped at creation)",
            )
        })?;
        rsccl_core::cuda::heap::allocator_fns(heap).py()
    }

    /// Raise the error a CUDA kernel reported (timeout, dead peer, mismatched calls) or
    /// that made the NCCL engine abort the group.
    fn cuda_health(&self) -> PyResult<()> {
        self.0.cuda_health().py()
    }

    /// Bytes reserved and mapped for this group, and traffic counters.
    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Reading the kernels' counters waits for the group's kernels: without the GIL.
        let all = py.detach(|| self.0.stats());
        let s = &all.host;
        let d = PyDict::new(py);
        d.set_item("engine", self.0.kind.name())?;
        d.set_item("host_region_bytes", s.host_region_bytes)?;
        d.set_item("host_mapped_bytes", s.host_mapped_bytes)?;
        d.set_item("collectives", s.collectives)?;
        d.set_item("p2p_messages", s.p2p_messages)?;
        d.set_item("staged_bytes", s.staged_bytes)?;
        if let Some(c) = &all.cuda {
            d.set_item("cuda_device", c.device)?;
            d.set_item("cuda_va_reserved_bytes", c.va_reserved_bytes)?;
            d.set_item("cuda_mapped_own_bytes", c.mapped_own_bytes)?;
            d.set_item("cuda_mapped_peer_bytes", c.mapped_peer_bytes)?;
            d.set_item("cuda_in_use_bytes", c.in_use_bytes)?;
            d.set_item("cuda_kernel_image_bytes", c.kernel_image_bytes)?;
            d.set_item("cuda_collectives", c.collectives)?;
            d.set_item("cuda_pool_bytes", c.pool_bytes)?;
            d.set_item("cuda_pool_allocated_bytes", c.pool_allocated_bytes)?;
            d.set_item("cuda_pool_peak_bytes", c.pool_peak_bytes)?;
            d.set_item("cuda_inplace_collectives", c.inplace_collectives)?;
            d.set_item("cuda_inplace_bytes", c.inplace_bytes)?;
            d.set_item("cuda_staged_collectives", c.staged_collectives)?;
            d.set_item("cuda_staged_bytes", c.staged_bytes)?;
            d.set_item("cuda_p2p_blocks", c.p2p_blocks)?;
            d.set_item("cuda_blocks", c.blocks)?;
            d.set_item("cuda_small_blocks", c.small_blocks)?;
            d.set_item("cuda_small_max_bytes", c.small_max_bytes)?;
            d.set_item("cuda_low_latency_max_bytes", c.low_latency_max_bytes)?;
            d.set_item("cuda_copy_engine_min_bytes", c.copy_engine_min_bytes)?;
            d.set_item("cuda_ring_min_bytes", c.ring_min_bytes)?;
            d.set_item("cuda_gpu_sharers", c.gpu_sharers)?;
            d.set_item("cuda_sms", c.sms)?;
            d.set_item("cuda_sm_budget", c.sm_budget)?;
            d.set_item("cuda_collective_sms", c.collective_sms)?;
            d.set_item("cuda_p2p_sms", c.p2p_sms)?;
            d.set_item("cuda_sm_budget_waits", c.sm_budget_waits)?;
        }
        if let Some(n) = &all.nccl {
            d.set_item("cuda_device", n.device)?;
            d.set_item("nccl_bytes", n.nccl_bytes)?;
            d.set_item("nccl_scratch_bytes", n.scratch_bytes)?;
            d.set_item("nccl_communicators", n.communicators)?;
            d.set_item("nccl_collectives", n.collectives)?;
            d.set_item("nccl_hierarchical_collectives", n.hierarchical_collectives)?;
            d.set_item("nccl_p2p_communicators", n.p2p_communicators)?;
            d.set_item("nccl_p2p_bytes", n.p2p_bytes)?;
            d.set_item("nccl_p2p_messages", n.p2p_messages)?;
        }
        Ok(d)
    }

    /// Stop the engine threads (GIL released); pending operations fail.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.0.shutdown());
    }
}

/// (send addresses, send bytes, recv addresses, recv bytes) per peer of an all_to_all.
type Splits = (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>);

/// A dtype or reduce op: its rsccl code (DTYPES, OPS), or torch's name of one rsccl lacks
/// (the error message names it).
#[derive(FromPyObject)]
enum Code {
    Int(u8),
    Name(String),
}

impl Code {
    fn dtype(&self) -> rsccl_core::Result<DType> {
        match self {
            Code::Int(c) => DType::from_code(*c).ok_or_else(|| Error::Internal(format!("unknown dtype code {c}"))),
            Code::Name(n) => DType::from_name(n),
        }
    }

    fn op(&self) -> rsccl_core::Result<ReduceOp> {
        match self {
            Code::Int(c) => ReduceOp::from_code(*c).ok_or_else(|| Error::Internal(format!("unknown reduce op code {c}"))),
            Code::Name(n) => ReduceOp::from_name(n),
        }
    }
}

fn ran_to_py(py: Python<'_>, ran: Ran) -> PyResult<Option<Py<PyAny>>> {
    Ok(match ran {
        Ran::Work(w) => Some(Py::new(py, Work(w))?.into_any()),
        Ran::Event(e) => Some(Py::new(py, CudaEvent(e))?.into_any()),
        Ran::Done => None,
    })
}

/// The sender of a recv from any source.
#[pyclass(module = "rsccl._rsccl", frozen)]
struct RecvSource(Arc<AtomicUsize>);

#[pymethods]
impl RecvSource {
    /// The sender's group rank, or None while no message matched the recv.
    fn rank(&self) -> Option<usize> {
        Some(self.0.load(Ordering::Acquire)).filter(|&r| r != usize::MAX)
    }
}

/// The end of an asynchronous CUDA collective.
#[pyclass(module = "rsccl._rsccl", frozen)]
struct CudaEvent(rsccl_core::cuda::CudaEvent);

#[pymethods]
impl CudaEvent {
    /// Whether the collective finished on the GPU.
    fn query(&self) -> PyResult<bool> {
        self.0.query().py()
    }

    /// Make `stream` (a raw CUDA stream handle) wait for the collective.
    fn wait_on(&self, stream: u64) -> PyResult<()> {
        self.0.wait_on(stream).py()
    }

    /// Block (GIL released) until the collective finished, at most the group timeout.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.0.synchronize()).py()
    }
}

/// Compile rsccl's CUDA kernels for `arch` (e.g. "sm_90") with NVRTC and return each
/// module's image size, in module order: a check that needs NVRTC, not a GPU.
#[pyfunction]
fn compile_kernels(py: Python<'_>, arch: &str) -> PyResult<Vec<(&'static str, usize)>> {
    py.detach(|| rsccl_core::cuda::kernels::compile(arch)).py().map(|v| v.into_iter().map(|(m, c)| (m, c.len())).collect())
}

/// Compile `arch`'s kernels with NVRTC into the disk cache now (a no-op if cached) and
/// return the files: lets an image or job step pay the compilation once, before any group
/// exists (needed only where the prebuilt kernels do not cover the GPU, or with
/// RSCCL_KERNELS=nvrtc).
#[pyfunction]
fn cache_kernels(py: Python<'_>, arch: &str) -> PyResult<Vec<String>> {
    py.detach(|| {
        rsccl_core::cuda::kernels::cubin_for(arch)?;
        rsccl_core::cuda::kernels::cache_paths(arch)
    })
    .py()
    .map(|p| p.unwrap_or_default().iter().map(|p| p.display().to_string()).collect())
}

/// The kernels built into this wheel: {"nvcc": version ("" if none), "targets": the
/// build's target list, "modules": {module: [(image, bytes)]}} (empty modules: built
/// without nvcc, every GPU uses NVRTC).
#[pyfunction]
fn prebuilt_kernels<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    use rsccl_core::cuda::kernels as k;
    let d = PyDict::new(py);
    d.set_item("nvcc", k::prebuilt_nvcc())?;
    d.set_item("targets", k::prebuilt_targets())?;
    let modules = PyDict::new(py);
    for (name, img) in k::prebuilt_images() {
        let entries = k::fatbin_entries(img).py()?;
        modules.set_item(*name, entries.iter().map(|e| (e.name(), e.bytes)).collect::<Vec<_>>())?;
    }
    d.set_item("modules", modules)?;
    Ok(d)
}

/// The fat binary of `module` built into this wheel (None if there is none): for tests
/// that read it with their own parser.
#[pyfunction]
fn prebuilt_image<'py>(py: Python<'py>, module: &str) -> Option<Bound<'py, pyo3::types::PyBytes>> {
    rsccl_core::cuda::kernels::prebuilt_images().iter().find(|m| m.0 == module).map(|m| pyo3::types::PyBytes::new(py, m.1))
}

/// Every kernel the loader looks up: (module, entry point).
#[pyfunction]
fn required_kernels() -> Vec<(&'static str, String)> {
    rsccl_core::cuda::kernels::required_kernels()
}

/// Where a GPU of compute capability `major`.`minor` gets its kernels, under the current
/// RSCCL_KERNELS: ("prebuilt", what runs, device code bytes) or ("nvrtc", why, 0). Raises
/// where nothing can (RSCCL_KERNELS=prebuilt on an uncovered GPU) or on a bad value.
#[pyfunction]
fn kernel_choice(major: u32, minor: u32) -> PyResult<(&'static str, String, usize)> {
    rsccl_core::cuda::kernels::choice(major * 10 + minor).py()
}

/// Load NCCL from `path` (torch's libnccl.so.2) and return (version code, a fresh unique id):
/// the first step of the NCCL engine, checkable without a GPU.
#[pyfunction]
fn nccl_probe<'py>(py: Python<'py>, path: &str) -> PyResult<(i32, Bound<'py, pyo3::types::PyBytes>)> {
    let n = rsccl_core::cuda::nccl::load(path).py()?;
    let id = py.detach(|| n.unique_id()).py()?;
    Ok((n.version, pyo3::types::PyBytes::new(py, &id)))
}

/// At interpreter exit: wait (GIL released, at most `timeout_s`) for completion callbacks
/// in flight, then stop calling into Python. Returns whether the pool went quiet.
#[pyfunction]
fn finish_completions(py: Python<'_>, timeout_s: f64) -> bool {
    py.detach(|| completion::finish(Duration::from_secs_f64(timeout_s.max(0.0))))
}

/// The tunables: (Options field, environment variable, default, is_size, help).
#[pyfunction]
fn settings() -> Vec<(&'static str, &'static str, u64, bool, String)> {
    SETTINGS.iter().map(|s| (s.field, s.env, s.default, s.is_size, s.help.split_whitespace().collect::<Vec<_>>().join(" "))).collect()
}

/// Validate options (and the environment) now; returns the resolved values.
#[pyfunction]
#[pyo3(signature = (options=None))]
fn resolve_options(options: Option<Vec<(String, String)>>) -> PyResult<Vec<(String, u64)>> {
    let values = Config::resolve_values(&options.unwrap_or_default(), &|k| std::env::var_os(k)).py()?;
    Ok(values.into_iter().map(|(f, v)| (f.to_string(), v)).collect())
}

/// The CUDA all_reduce one-shot limit rsccl picks for `local_ranks` when
/// cuda_allreduce_one_shot_max_bytes is 0 (what the bench needs to label its rows).
#[pyfunction]
fn cuda_auto_one_shot_max(local_ranks: usize) -> usize {
    rsccl_core::cuda::engine::auto_one_shot_max(local_ranks)
}

/// Diagnostics go to stderr through tracing; RSCCL_LOG sets the level (error, warn, info,
/// debug, trace, or a tracing filter such as "rsccl_core=debug").
fn init_logging() -> PyResult<()> {
    let spec = rsccl_core::config::env_var("RSCCL_LOG").py()?.unwrap_or_else(|| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&spec)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("RSCCL_LOG = {spec:?} is not a valid level or filter: {e}")))?;
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    Ok(())
}

#[pymodule]
fn _rsccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging()?;
    m.add_class::<Communicator>()?;
    m.add_class::<Work>()?;
    m.add_class::<CudaEvent>()?;
    m.add_class::<RecvSource>()?;
    m.add_function(wrap_pyfunction!(compile_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(cache_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(prebuilt_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_choice, m)?)?;
    m.add_function(wrap_pyfunction!(prebuilt_image, m)?)?;
    m.add_function(wrap_pyfunction!(required_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_probe, m)?)?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_options, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_auto_one_shot_max, m)?)?;
    m.add_function(wrap_pyfunction!(finish_completions, m)?)?;
    m.add("PeerFailureError", m.py().get_type::<errors::PeerFailureError>())?;
    m.add("GroupAbortedError", m.py().get_type::<errors::GroupAbortedError>())?;
    // The code tables, once: Python maps torch's dtypes and ReduceOps onto these at import.
    m.add("KINDS", Kind::ALL.iter().map(|k| (k.name(), *k as u8)).collect::<Vec<_>>())?;
    m.add("DTYPES", DType::ALL.iter().map(|d| (d.name(), *d as u8)).collect::<Vec<_>>())?;
    m.add("ROUTES", rsccl_core::group::routes())?;
    m.add("OPS", ReduceOp::ALL.iter().map(|o| (o.name(), *o as u8)).collect::<Vec<_>>())?;
    // What rsccl's CUDA kernels reduce: the Python layer checks a call against these.
    m.add("CUDA_REDUCE_DTYPES", rsccl_core::cuda::kernels::REDUCE_DTYPES.iter().map(|d| d.name()).collect::<Vec<_>>())?;
    m.add("CUDA_REDUCE_OPS", rsccl_core::cuda::kernels::REDUCE_OPS.iter().map(|o| o.name()).collect::<Vec<_>>())?;
    m.add(
        "ERROR_CLASSES",
        vec![("value", Error::InvalidArgument(String::new()).class_code()), ("type", Error::InvalidType(String::new()).class_code())],
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
