"""rsccl's torch.distributed ProcessGroup.

Each torch method (one per collective for both devices, a few lines over its plan builder
in _plans.py) turns torch's arguments into contiguous buffers and ops, which `_call` makes through the Rust
Communicator on the side the tensors are on, and returns a Work that copies results back
where torch expects them. Argument errors found on one rank are submitted too
(``Communicator.invalid``), so every rank of the group raises instead of waiting for the
rank that failed. Groups whose ranks span hosts delegate CPU tensors to gloo; their CUDA
tensors take the same CUDA paths as on one host, which the Rust core runs on NCCL
(docs/multihost.md).
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import _plans as plans
from . import _rsccl
from ._cuda import NO_CUDA_AT_CREATION, REDUCE_DTYPES, REDUCE_OPS, device_for_new_group, nccl_library_path, raw_stream
from ._monitored import monitored_barrier
from ._ops import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BARRIER,
    BROADCAST,
    DTYPE_CODES,
    GATHER,
    KIND_NAMES,
    KINDS,
    RECV,
    REDUCE,
    REDUCE_SCATTER,
    ROUTE_OF,
    SCATTER,
    SEND,
    SUM,
    UINT8,
    ArgumentError,
    ErrorClass,
    Route,
    dtype_code,
    fast_op_key,
    fast_op_keys,
    op_code,
    op_name,
)
from ._plan import _as_bytes, _buf, _check_cuda_tensor, _check_tensor, _first_tensor, _one, _Plan, _Staged
from ._plans import Side
from ._profile import instrument as instrument_profiler
from ._work import CudaWork, DoneWork, Pending, RecvAnyWork, RsWork
from .options import as_items

_LIVE: weakref.WeakSet[ProcessGroupRsccl] = weakref.WeakSet()

# The fast paths of all_reduce and reduce_scatter look the call's op up by
# `fast_op_key(opts.reduceOp)` (_ops.py): key -> (op code, {dtype: dtype code}) for every
# combination rsccl's CUDA kernels reduce (others take the plan).
_FAST_REDUCE = {
    key: (code, {dt: DTYPE_CODES[dt] for dt in REDUCE_DTYPES if name != "AVG" or dt.is_floating_point})
    for name in REDUCE_OPS
    for key, code in fast_op_keys([name]).items()
}
_STRIDED = torch.strided
_Tensor = torch.Tensor
_profiling = torch._C._autograd._profiler_enabled


def _reduce_op(opts: Any) -> int | str:
    return op_code(opts.reduceOp) if opts is not None else SUM


def _root(opts: Any) -> int:
    return opts.rootRank if opts is not None else 0


def _first(ts: Any) -> Any:
    """The tensor a call routes by: the first of torch's list (None if there is none)."""
    return ts[0] if isinstance(ts, (list, tuple)) and ts else None


class ProcessGroupRsccl(dist.ProcessGroup):
    """torch.distributed backend "rsccl" (see README.md)."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, pg_options: object = None, global_ranks: list[int] | None = None
    ):
        super().__init__(rank, size)
        # size() and rank() go through torch's binding (0.7 us each on the build machine):
        # the hot paths read these.
        self._group_size, self._group_rank = size, rank
        self._timeout = timeout
        self._options = pg_options
        device = device_for_new_group()
        # A group whose ranks span hosts runs its CUDA collectives on NCCL (torch's library).
        nccl_path = nccl_library_path() if device is not None else None
        global_rank = global_ranks[rank] if global_ranks and len(global_ranks) == size else None
        self._comm = _rsccl.Communicator(
            store, rank, size, max(timeout.total_seconds(), 0.001), as_items(pg_options), device, nccl_path, global_rank
        )
        self._cuda_device = device if self._comm.has_cuda else None
        # Where CPU tensors go (Route.HOST, or Route.GLOO across hosts), and CUDA tensors
        # (Route.RSCCL on one host, Route.NCCL across hosts, None without CUDA).
        self._route = ROUTE_OF[self._comm.route]
        cuda_route = self._comm.cuda_route
        self._cuda_engine = ROUTE_OF[cuda_route] if cuda_route is not None else None
        self._pool_bytes = int(self._comm.cuda_pool_bytes)
        self._pending = Pending()
        # Returned by every blocking CUDA collective (torch discards it after wait()).
        self._done = DoneWork([])
        self._gloo = None
        if self._route == Route.GLOO:
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("rsccl-gloo/", store), rank, size, timeout)
        # The GPU whose tensors this group's CUDA engine takes (`_on_cuda`), or None: what the
        # fast paths compare `t.get_device()` with.
        self._fast_device = self._cuda_device if self._gloo is None or self._cuda_engine == Route.NCCL else None
        self._group_name = ""
        self._group_desc = ""
        self._pool: torch.cuda.MemPool | None = None
        self._pool_full_warned = False
        self._allocator: Any = None
        # Works of the coalesced calls made between _start_coalescing and _end_coalescing.
        self._coalesced: list[Any] | None = None
        _LIVE.add(self)

    # -- identity -------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "rsccl"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def options(self) -> object:
        return self._options

    @property
    def engine(self) -> str:
        """ "host" (rsccl's shared-memory engine) or "gloo" (the group spans hosts: CPU
        tensors go through gloo, CUDA tensors through NCCL)."""
        return self._route.value

    def memory_stats(self) -> dict:
        return dict(self._comm.memory_stats())

    def _on_cuda(self, t: Any, what: str | None = None) -> bool:
        """Whether a call whose (first) tensor is `t` runs on the group's CUDA engine: a CUDA
        tensor in a group on one host, or across hosts with the NCCL engine (all_to_all: one
        NCCL group of sends and receives on the flat communicator; send/recv: the 2-rank
        communicator of that ordered pair, or rsccl's kernels for a rank of this host;
        docs/multihost.md). Across hosts without the NCCL engine (CUDA not initialized at
        creation) gloo takes CUDA tensors, except in the calls named by `what` (all_to_all,
        send/recv), where it is a clear TypeError."""
        if not getattr(t, "is_cuda", False):
            return False
        if self._gloo is None or self._cuda_engine == Route.NCCL:
            return True
        if what is None:
            return False
        raise TypeError(
            f"rsccl: {what} on CUDA tensors in a group that spans hosts needs its NCCL engine, which this group "
            f"does not have ({NO_CUDA_AT_CREATION}); or use CPU tensors"
        )

    # -- the pool (rsccl.mem_pool) ---------------------------------------------------------
    def _mem_pool(self) -> torch.cuda.MemPool:
        """The group's pool as a torch MemPool (one per group): torch's caching allocator
        takes segments from rsccl's symmetric memory through the two C functions the Rust
        core exports."""
        if self._pool is None:
            if self._cuda_device is None:
                raise RuntimeError(f"rsccl: this group has no CUDA engine, so no pool ({NO_CUDA_AT_CREATION})")
            alloc_fn, free_fn = self._comm.pool_allocator()
            self._allocator = torch._C._cuda_customAllocator(alloc_fn, free_fn)
            self._pool = torch.cuda.MemPool(self._allocator)
        return self._pool

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        """Whether allocate_tensor gives pool memory on `device` (FSDP2 asks this)."""
        device = torch.device(device)
        return (
            device.type == "cuda"
            and self._cuda_device is not None
            and (device.index if device.index is not None else torch.cuda.current_device()) == self._cuda_device
            and self._pool_bytes > 0
        )

    def allocate_tensor(self, size: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of `size` elements from the group's pool: collectives use it in place
        when every rank allocated its counterpart at the same offset. When the pool is full
        the tensor comes from torch's allocator instead (the collectives using it are then
        staged, still correct), with one warning per group: FSDP2 keeps gradient shards in
        these buffers, and training must not stop because the pool was sized tight."""
        try:
            with torch.cuda.use_mem_pool(self._mem_pool(), device):
                return torch.empty(size, dtype=dtype, device=device)
        except torch.OutOfMemoryError:
            if not self._pool_full_warned:
                self._pool_full_warned = True
                warnings.warn(
                    f"rsccl: rank {self.rank()}: the group's pool ({self._pool_bytes} bytes, cuda_pool_bytes) is full; "
                    "allocate_tensor falls back to torch's allocator (those collectives are staged)",
                    stacklevel=2,
                )
            return torch.empty(size, dtype=dtype, device=device)

    @property
    def mem_allocator(self) -> Any:
        """The pool's torch CUDAAllocator (what torch.cuda.MemPool takes)."""
        self._mem_pool()
        return self._allocator

    # torch asks the device's backend whether it can split (init_process_group(device_id=),
    # split_group): rsccl groups are made with new_group.
    supports_splitting = False

    def _get_backend(self, device: torch.device) -> ProcessGroupRsccl:
        # rsccl is one ProcessGroup for every device type; torch code that asks for the
        # device's backend (FSDP2's ProcessGroupAllocMixin) gets the group itself.
        return self

    # torch >= 2.15's public name of the same (dist.get_backend_impl).
    get_backend = _get_backend

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices the group serves, as registered (devices=["cpu", "cuda"]). torch's
        own property lists the devices that have a C++ backend registered on the group,
        which a ProcessGroup returned by a backend's creator never has, so it would list
        none: torch 2.15's dist.monitored_barrier (which takes any group that lists cpu),
        DCP's async_save and torch's choice of a device for object collectives read this."""
        return [torch.device("cpu"), torch.device("cuda")]

    def shutdown(self) -> None:
        self._comm.shutdown()

    def abort(self) -> None:
        self._comm.shutdown()

    # -- collectives: each builds its plan (_plans.py) and hands it to the seam, `_call` ---
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # The fast path: one dense, contiguous tensor on the group's GPU, of a dtype and op
        # the kernels reduce, with the profiler off. Nothing to check beyond this (the core
        # checks the rest); an asynchronous call keeps the tensor in its Work (`_fast_work`).
        # Every attribute read here costs 0.05-0.3 us (issue 27), so each is read once,
        # cheapest first.
        if opts is not None and len(tensors) == 1 and not _profiling():
            t = tensors[0]
            if isinstance(t, _Tensor) and t.is_cuda and t.get_device() == self._fast_device and t.layout is _STRIDED:
                fast = _FAST_REDUCE.get(fast_op_key(opts.reduceOp))
                dt = fast[1].get(t.dtype) if fast is not None else None
                if dt is not None and t.is_contiguous():
                    p, nbytes, stream, blocking = t.data_ptr(), t.nbytes, raw_stream(self._fast_device), opts.asyncOp is False
                    ev = self._comm.run(ALL_REDUCE, p, nbytes, p, nbytes, dt, fast[0], 0, stream, blocking)
                    return self._done if blocking else self._fast_work(ev, stream, tensors, t)
        return self._allreduce(tensors, opts)

    def _fast_work(self, ev: Any, stream: int, result: Any, keep: Any) -> Any:
        """The Work of an asynchronous call made by a fast path on the group's GPU (`ev`: the
        launch's end event): what the plan's path (`_call`, `_cuda_finish`) returns for the
        same call, whose plan would have had nothing to copy back."""
        return self._cuda_finish(ev, self._fast_device, stream, result, keep, None)

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """all_reduce off the fast path (profiled under torch's name, _profile.EVENTS)."""
        op = _reduce_op(opts)
        if len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return self._sparse_allreduce(tensors, op, opts)
        prepare = lambda s: plans.all_reduce(s, tensors, op)  # noqa: E731
        return self._call(ALL_REDUCE, _first(tensors), prepare, opts, gloo=lambda g: g.allreduce(tensors, opts), args=(tensors,))

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: int | str, opts: Any) -> Any:
        """Sum of sparse COO tensors (DDP's path for nn.Embedding(sparse=True)), as gloo
        computes it: every rank's coalesced indices and values are gathered through host
        memory and summed in rank order, so every rank gets the same coalesced result, in
        place. A CUDA sparse tensor takes the same path through host memory, as on gloo.
        Runs before returning (the Work is complete)."""
        if self._gloo is not None:
            return self._gloo.allreduce(tensors, opts)
        t = tensors[0]
        if op != SUM:
            raise TypeError(
                f"rsccl: rank {self.rank()}: all_reduce of a sparse tensor takes ReduceOp.SUM only (as gloo), got ReduceOp.{op_name(op)}"
            )
        local = t.detach().to("cpu").coalesce()
        idx, vals = local.indices().contiguous(), local.values().contiguous()
        n = self.size()

        def gather(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(n * x.numel(), dtype=x.dtype)
            self._comm.run(ALL_GATHER, *_buf(x), *_buf(out), dtype_code(x), SUM, 0, None, True)
            return out.view(n, -1)

        counts = gather(torch.tensor([idx.shape[1]], dtype=torch.int64)).view(-1)
        # Pad every rank's entries to the largest count: all_gather moves equal blocks.
        m = int(counts.max())
        pad_idx = torch.zeros((idx.shape[0], m), dtype=idx.dtype)
        pad_idx[:, : idx.shape[1]] = idx
        pad_vals = torch.zeros((m, *vals.shape[1:]), dtype=vals.dtype)
        pad_vals[: vals.shape[0]] = vals
        parts_i, parts_v = [idx], [vals]
        if m > 0:
            gi, gv = gather(_as_bytes(pad_idx)), gather(_as_bytes(pad_vals))
            parts_i = [gi[r].view(idx.dtype).view(idx.shape[0], m)[:, : int(counts[r])] for r in range(n)]
            parts_v = [gv[r].view(vals.dtype).view(m, *vals.shape[1:])[: int(counts[r])] for r in range(n)]
        total = torch.sparse_coo_tensor(torch.cat(parts_i, dim=1), torch.cat(parts_v), local.shape, check_invariants=True).coalesce()
        with torch.no_grad():
            t.copy_(total.to(t.device))
        return DoneWork(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op, dtypes = _reduce_op(opts), plans.dtypes_of(tensors)
        prepare = lambda s: plans.all_reduce_coalesced(s, tensors, dtypes, op)  # noqa: E731
        gloo = lambda g: g.allreduce_coalesced(tensors, opts)  # noqa: E731
        return self._noted(self._call(ALL_REDUCE, _first(tensors), prepare, opts, gloo=gloo, n_ops=len(dtypes), args=(tensors,)))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = _root(opts)
        prepare = lambda s: plans.broadcast(s, tensors, root)  # noqa: E731
        return self._call(BROADCAST, _first(tensors), prepare, opts, gloo=lambda g: g.broadcast(tensors, opts), args=(tensors,))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root, op = _root(opts), _reduce_op(opts)
        prepare = lambda s: plans.reduce(s, tensors, op, root)  # noqa: E731
        return self._call(REDUCE, _first(tensors), prepare, opts, gloo=lambda g: g.reduce(tensors, opts), args=(tensors,))

    def _fast_stream(self, out: Any, inp: Any, opts: Any) -> tuple[int | None, bool] | None:
        """The fast path of the calls on one input and one output tensor (all_gather and
        reduce_scatter into a tensor), as all_reduce has one: `(stream, blocking)` when the
        call needs no plan (both tensors dense, contiguous, of one dtype, on the group's GPU,
        blocking or not; or blocking on the CPU of a group within one host), else None. The
        core checks the sizes, on this path as on the plan's (and joins a bad call as
        invalid), so messages agree."""
        if opts is None or not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
            return None
        if out.dtype != inp.dtype or out.layout != torch.strided or inp.layout != torch.strided:
            return None
        if not (out.is_contiguous() and inp.is_contiguous()):
            return None
        blocking = opts.asyncOp is False
        if inp.is_cuda:
            dev = self._fast_device
            ok = out.is_cuda and inp.get_device() == dev == out.get_device()
            return (raw_stream(dev), blocking) if ok else None
        host = blocking and self._gloo is None and inp.device.type == "cpu" and out.device.type == "cpu"
        return (None, True) if host else None

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        fast = None if _profiling() else self._fast_stream(output, input, opts)
        dt = DTYPE_CODES.get(input.dtype) if fast is not None else None
        if dt is not None:
            stream, blocking = fast
            ev = self._comm.run(ALL_GATHER, input.data_ptr(), input.nbytes, output.data_ptr(), output.nbytes, dt, SUM, 0, stream, blocking)
            return self._done if blocking else self._fast_work(ev, stream, [output], (output, input))
        return self._allgather_into(output, input, opts)

    all_gather_single = _allgather_base

    def _allgather_into(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """all_gather_into_tensor off the fast path (profiled under torch's name, _profile.EVENTS)."""
        prepare = lambda s: plans.all_gather_into(s, output, input, [output])  # noqa: E731
        gloo = lambda g: g._allgather_base(output, input, opts)  # noqa: E731
        return self._call(ALL_GATHER, input, prepare, opts, gloo=gloo, args=(output, input))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        prepare = lambda s: plans.all_gather(s, output_tensors, input_tensors)  # noqa: E731
        gloo = lambda g: g.allgather(output_tensors, input_tensors, opts)  # noqa: E731
        return self._call(ALL_GATHER, _first(input_tensors), prepare, opts, gloo=gloo, args=(output_tensors, input_tensors))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        prepare = lambda s: plans.all_gather_into_tensor_coalesced(s, outputs, inputs)  # noqa: E731
        gloo = lambda g: g.allgather_into_tensor_coalesced(outputs, inputs, opts)  # noqa: E731
        return self._noted(self._call(ALL_GATHER, _first(inputs), prepare, opts, gloo=gloo, args=(outputs, inputs)))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None) -> Any:
        prepare = lambda s: plans.all_gather_coalesced(s, output_lists, input_list)  # noqa: E731
        gloo = lambda g: g.allgather_coalesced(output_lists, input_list, opts)  # noqa: E731
        return self._call(ALL_GATHER, _first(input_list), prepare, opts, gloo=gloo, args=(output_lists, input_list))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        fast = None if _profiling() else self._fast_stream(output, input, opts)
        ops = _FAST_REDUCE.get(fast_op_key(opts.reduceOp)) if fast is not None else None
        dt = ops[1].get(input.dtype) if ops is not None else None
        if dt is not None:
            stream, blocking = fast
            ev = self._comm.run(
                REDUCE_SCATTER, input.data_ptr(), input.nbytes, output.data_ptr(), output.nbytes, dt, ops[0], 0, stream, blocking
            )
            return self._done if blocking else self._fast_work(ev, stream, [output], (output, input))
        return self._reduce_scatter_into(output, input, opts)

    reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """reduce_scatter_tensor off the fast path (profiled under torch's name, _profile.EVENTS)."""
        op = _reduce_op(opts)
        prepare = lambda s: plans.reduce_scatter_into(s, output, input, op, [output])  # noqa: E731
        gloo = lambda g: g._reduce_scatter_base(output, input, opts)  # noqa: E731
        return self._call(REDUCE_SCATTER, input, prepare, opts, gloo=gloo, args=(output, input))

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = _reduce_op(opts)
        prepare = lambda s: plans.reduce_scatter(s, output_tensors, input_tensors, op)  # noqa: E731
        gloo = lambda g: g.reduce_scatter(output_tensors, input_tensors, opts)  # noqa: E731
        return self._call(REDUCE_SCATTER, _first(output_tensors), prepare, opts, gloo=gloo, args=(output_tensors, input_tensors))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        op, dtypes = _reduce_op(opts), plans.dtypes_of(inputs)  # one op per dtype of the inputs
        prepare = lambda s: plans.reduce_scatter_tensor_coalesced(s, outputs, inputs, dtypes, op)  # noqa: E731
        gloo = lambda g: g.reduce_scatter_tensor_coalesced(outputs, inputs, opts)  # noqa: E731
        return self._noted(self._call(REDUCE_SCATTER, _first(inputs), prepare, opts, gloo=gloo, n_ops=len(dtypes), args=(outputs, inputs)))

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None
    ) -> Any:
        # The fast path on the group's GPU (the common case, the profiler off; anything else
        # takes the plan); an asynchronous call keeps both tensors in its Work.
        if opts is not None and not _profiling() and isinstance(input, _Tensor) and isinstance(output, _Tensor):
            dev = self._fast_device
            if input.is_cuda and output.is_cuda and input.get_device() == dev == output.get_device():
                fast = plans.all_to_all_single_fast(
                    self._group_size, self._group_rank, output, input, output_split_sizes, input_split_sizes
                )
                if fast is not None:
                    ip, ib, op, ob, splits = fast
                    stream, blocking = raw_stream(dev), opts.asyncOp is False
                    ev = self._comm.run(ALL_TO_ALL, ip, ib, op, ob, dtype_code(input), SUM, 0, stream, blocking, splits)
                    return self._done if blocking else self._fast_work(ev, stream, [output], (output, input))
        return self._alltoall_full(output, input, output_split_sizes, input_split_sizes, opts)

    all_to_all_single = alltoall_base

    def _alltoall_full(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None
    ) -> Any:
        """all_to_all_single off the fast path (profiled under torch's name, _profile.EVENTS)."""
        prepare = lambda s: plans.all_to_all_single(s, output, input, output_split_sizes, input_split_sizes)  # noqa: E731
        gloo = lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)  # noqa: E731
        args = (output, input, output_split_sizes, input_split_sizes)
        return self._call(ALL_TO_ALL, input, prepare, opts, gloo=gloo, args=args, what="all_to_all_single")

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        prepare = lambda s: plans.all_to_all(s, output_tensors, input_tensors)  # noqa: E731
        gloo = lambda g: g.alltoall(output_tensors, input_tensors, opts)  # noqa: E731
        return self._call(
            ALL_TO_ALL, _first(input_tensors), prepare, opts, gloo=gloo, args=(output_tensors, input_tensors), what="all_to_all"
        )

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = _root(opts)
        prepare = lambda s: plans.gather(s, output_tensors, input_tensors, root)  # noqa: E731
        gloo = lambda g: g.gather(output_tensors, input_tensors, opts)  # noqa: E731
        return self._call(GATHER, _first(input_tensors), prepare, opts, gloo=gloo, args=(output_tensors, input_tensors))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = _root(opts)
        prepare = lambda s: plans.scatter(s, output_tensors, input_tensors, root)  # noqa: E731
        gloo = lambda g: g.scatter(output_tensors, input_tensors, opts)  # noqa: E731
        return self._call(SCATTER, _first(output_tensors), prepare, opts, gloo=gloo, args=(output_tensors, input_tensors))

    def barrier(self, opts: Any = None) -> Any:
        if self._cuda_device is not None:
            # Like NCCL's barrier: every GPU reaches a device barrier, and this CPU waits
            # for its own, so all ranks' earlier work is done and every rank got here.
            stream = raw_stream(self._cuda_device)
            self._comm.run(BARRIER, 0, 0, 0, 0, UINT8, SUM, 0, stream, True)
            torch.cuda.current_stream(self._cuda_device).synchronize()
            self._comm.cuda_health()
            return DoneWork([])
        return self._call(BARRIER, None, plans.barrier, opts, gloo=lambda g: g.barrier(opts))

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """dist.monitored_barrier on torch >= 2.15 (which takes any group that serves CPU
        tensors; 2.11 takes gloo's only, so call it on the group there): rank 0 names the
        ranks that did not arrive within `timeout` (default: the group's). _monitored.py."""
        monitored_barrier(self, timeout, wait_all_ranks)

    # -- point to point ----------------------------------------------------------------
    # torch calls these for dist.send/recv/isend/irecv, and batch_isend_irecv calls
    # isend/irecv one by one for a ProcessGroup subclass.
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        return self._p2p(tensors, dstRank, tag, True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        return self._p2p(tensors, srcRank, tag, False)

    def _p2p(self, tensors: list[torch.Tensor], peer: int, tag: int, send: bool) -> Any:
        """One send or recv, always asynchronous (torch passes no asyncOp here: a blocking
        dist.send/recv waits on the Work). Bad arguments raise on this rank alone: only it
        and its peer are involved, and a peer left waiting times out after the group's
        timeout. On CUDA each (peer, direction) has its own internal stream (across hosts:
        its own NCCL communicator too), so a send to j and a recv from j progress together;
        sends to one peer match that peer's recvs in order, and the tag is ignored, as NCCL
        ignores it."""
        what = "send" if send else "recv"
        if self._gloo is not None and isinstance(tensors, (list, tuple)) and len(tensors) > 1:
            if any(getattr(t, "is_cuda", False) for t in tensors):
                raise TypeError(
                    f"rsccl: rank {self.rank()}: {what} of a list that mixes CPU and CUDA tensors in a group that spans hosts: "
                    "give one CUDA tensor (NCCL) or CPU tensors (gloo)"
                )
        # Tags past 64 bits are clamped so that the host engine refuses them (with this
        # clamped value in its message) and tells the peer, as it does any tag out of 0..2^31-1.
        tag = max(min(int(tag), 2**63 - 1), -(2**63))
        prepare = lambda s: plans.send_recv(s, tensors, peer, tag, send)  # noqa: E731
        gloo = lambda g: getattr(g, what)(tensors, peer, tag)  # noqa: E731
        return self._call(SEND if send else RECV, _first(tensors), prepare, gloo=gloo, args=(tensors,), what=what)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """dist.recv/irecv without a source, on CPU tensors: the first message with `tag`
        from any rank (a recv posted for that sender takes it first); the Work's
        _source_rank() names the sender. Gloo's for a group across hosts. CUDA tensors
        have no such call (NCCL has none): a clear TypeError."""
        if isinstance(tensors, (list, tuple)) and any(getattr(t, "is_cuda", False) for t in tensors):
            raise TypeError(
                f"rsccl: rank {self.rank()}: recv from any source (dist.recv/irecv without src) takes CPU tensors; "
                "on CUDA tensors pass the sender's rank as src (NCCL has no receive from any source)"
            )
        if self._gloo is not None:
            return self._gloo.recv_anysource(tensors, tag)
        try:
            t = _one(tensors, "recv")
        except ArgumentError as e:
            raise e.to_raise() from None
        s = _Staged(t, copy_in=False)
        part, source = self._comm.recv_any(_buf(s.buf), dtype_code(s.buf), tag)
        return RecvAnyWork(source, [part], tensors, s, s.post)

    # -- the single seam ---------------------------------------------------------------
    def _call(
        self,
        kind: int,
        on: Any,
        prepare: Callable[[Side], _Plan],
        opts: Any = None,
        *,
        gloo: Callable[[Any], Any],
        n_ops: int = 1,
        args: tuple = (),
        what: str | None = None,
    ) -> Any:
        """Run one torch call of `kind` on the side its (first) tensor `on` picks
        (`_on_cuda`; `what` names calls gloo cannot take on CUDA): CPU tensors of a group
        across hosts go to `gloo`; everything else is prepared, then made as ops through
        Communicator.run, on host memory or on the caller's current CUDA stream.

        `prepare(side)` (a plan builder of _plans.py) checks every argument and builds every buffer before any op is
        made, so a bad argument never leaves earlier ops of the same call in flight. If it
        fails, this rank joins the `n_ops` ops a healthy rank makes for this call as invalid
        (`_join_invalid`), so every rank stays in step and raises. `args` are the call's
        tensor arguments as torch passed them: where a call that did not route joins
        (`_invalid_stream`). Every op is made even when one fails (the ranks stay in step);
        the first error is raised once the ops made are done with the plan's buffers."""
        cuda = self._on_cuda(on, what)
        if not cuda and self._gloo is not None:
            return gloo(self._gloo)
        device = stream = None
        if cuda:
            device = self._cuda_device if self._cuda_device is not None else torch.cuda.current_device()
            stream = raw_stream(device)
        try:
            plan = prepare(self._side(cuda))
        except Exception as e:  # noqa: BLE001 - raised by _join_invalid once the peers are told
            self._join_invalid(kind, e, n_ops, stream if cuda else self._invalid_stream(args))
        # torch sets opts.asyncOp = False for a blocking call (it waits right after): it runs
        # now (host: on this thread, when it is one op) and needs none of an asynchronous
        # Work's bookkeeping.
        blocking = opts is not None and opts.asyncOp is False and (cuda or len(plan.ops) == 1)
        run = self._comm.run
        parts, first = [], None
        for o in plan.ops:
            try:
                parts.append(run(kind, o.inp, o.inp_bytes, o.out, o.out_bytes, o.dtype, o.op, o.root, stream, blocking, o.splits, o.tag))
            except Exception as err:  # noqa: BLE001 - raised below, after the other ops
                first = first or err
        if first is not None:
            for p in parts:  # the ops made still use the plan's buffers
                try:
                    if p is not None:
                        p.synchronize() if cuda else p.wait()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise first
        if cuda:
            # Ops on one stream finish in order: the last one's event covers them all.
            return self._cuda_finish(parts[-1] if parts else None, device, stream, plan.result, plan.keep, plan.post)
        if blocking:
            if plan.post is not None:
                plan.post()
            return DoneWork(plan.result)
        return RsWork(parts, plan.result, plan.keep, plan.post)

    def _cuda_finish(self, ev: Any, device: int, stream: int, result: Any, keep: Any, post: Callable[[], None] | None) -> Any:
        """The Work of CUDA ops: done (copies back made) when blocking (no event), else a
        CudaWork holding `keep` until a stream is ordered after it."""
        if ev is None:
            if post is not None:
                post()
            return DoneWork(result)
        w = CudaWork(self, device, ev, result, keep, post, stream)
        self._pending.add(w)
        return w

    def _side(self, cuda: bool) -> Side:
        """The group as a plan sees it, on the call's side: its size, this rank, and how
        each tensor is checked (a dense CPU tensor, or a dense CUDA tensor on the group's GPU)."""
        return Side(self._group_size, self._group_rank, cuda, self._check_cuda if cuda else _check_tensor)

    def _check_cuda(self, t: Any, what: str) -> torch.Tensor:
        _check_cuda_tensor(t, what)
        self._cuda_check(t, what)
        return t

    def _cuda_check(self, t: torch.Tensor, what: str) -> None:
        """The group has a CUDA engine and `t` is on its GPU. What the op asks of the engine
        is checked once, by the core: a dtype and op the engine reduces by the engine itself
        (`Engine::can_run`; refused by every rank alone, the group stays usable), a root in
        the group and sizes that fit by the device engines' translation
        (`CudaCall::from_op`; the call is joined as invalid)."""
        if self._cuda_device is None:
            self._comm.cuda_health()  # raises why there is no CUDA engine (below if not)
            raise ArgumentError(f"{what}: this group has no CUDA engine ({NO_CUDA_AT_CREATION})")
        if t.device.index != self._cuda_device:
            raise ArgumentError(f"{what}: rank {self.rank()} passed a tensor on {t.device}, but its group uses cuda:{self._cuda_device}")

    def _invalid_stream(self, args: tuple) -> int | None:
        """Where a call whose arguments did not even route (two tensors for all_reduce, a list
        of floats, a non-tensor in a tensor list) joins as invalid: the CUDA side (its stream)
        when its first tensor is a CUDA tensor of this group, or when it holds no tensor at
        all and the group has a CUDA engine (a group made with a GPU mostly runs CUDA calls);
        else host memory (None). The peers of a rank that guessed wrong time out naming it
        (docs/errors.md)."""
        if self._cuda_device is None:
            return None
        t = _first_tensor(args)
        if t is None or self._on_cuda(t):
            return raw_stream(self._cuda_device)
        return None

    def _join_invalid(self, kind: int | str, err: BaseException, n_ops: int, stream: int | None = None) -> NoReturn:
        """Preparing a call of `kind` failed on this rank: its arguments (an ArgumentError)
        or something unforeseen (a torch op refusing an argument, memory for a staging
        copy). It joins the `n_ops` operations a healthy rank makes for this call as
        invalid (the rule's one owner is Group::run in the Rust core), so the peers raise
        instead of waiting; then it raises: on host memory the error the ranks agree on,
        on CUDA (`stream` given) its own; an unforeseen error is re-raised as it came."""
        code = KINDS[kind] if isinstance(kind, str) else kind
        if isinstance(err, ArgumentError):
            cls, message, original = err.cls, str(err), None
        else:
            cls = ErrorClass.TYPE if isinstance(err, (TypeError, AttributeError)) else ErrorClass.VALUE
            message, original = f"{KIND_NAMES[code]}: preparing the call failed: {type(err).__name__}: {err}", err
        works, errors = [], []
        for _ in range(max(n_ops, 1)):
            try:
                w = self._comm.invalid(code, cls, message, stream)
            except Exception as e:  # noqa: BLE001 - CUDA: this rank's error, once the peers are told
                errors.append(e)
                continue
            if w is not None:
                works.append(w)
        for w in works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - the first agreed error is raised
                errors.append(e)
        if original is not None:
            raise original
        raise errors[0] if errors else RuntimeError(f"rsccl: {message}")

    # -- torch's _coalescing_manager(group, device) ---------------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        """The manager records the collectives of its block, then makes one coalesced call
        (allreduce_coalesced and friends) and asks _end_coalescing for its Work."""
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> Any:
        works, self._coalesced = self._coalesced or [], None
        return works[-1] if works else DoneWork([])

    def _noted(self, work: Any) -> Any:
        """`work`, kept for _end_coalescing when inside _start_coalescing."""
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work


# torch.profiler events per call ("rsccl:all_reduce", ...), as gloo records them.
instrument_profiler(ProcessGroupRsccl)


def create(dist_backend_opts: Any, pg_options: object) -> ProcessGroupRsccl:
    """The creator torch calls (extended API) for init_process_group/new_group."""
    pg = ProcessGroupRsccl(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        pg_options,
        list(getattr(dist_backend_opts, "global_ranks_in_group", None) or []),
    )
    # A subgroup's messages name group ranks and global ranks (the default group: []).
    global_ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", []) or [])
    if len(global_ranks) == pg.size():
        pg._comm.name_global_ranks(global_ranks)
    return pg


@atexit.register
def _shutdown_all() -> None:
    # Stop the engines (pending Works fail), let the completion threads run the callbacks
    # that follows, then keep them out of Python: a thread entering Python while the
    # interpreter finalizes aborts the process.
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    _rsccl.finish_completions(10.0)


def rsccl_group(group: object | None) -> ProcessGroupRsccl:
    """`group` (default: the world group) if it is an rsccl group; TypeError otherwise."""
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupRsccl):
        raise TypeError(f"rsccl: {pg!r} is not an rsccl process group")
    return pg
