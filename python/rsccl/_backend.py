"""rsccl's torch.distributed ProcessGroup.

Each torch method (_collectives.py, one per collective for both devices) turns torch's
arguments into contiguous buffers and ops, which `_call` makes through the Rust
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

from . import _rsccl
from ._collectives import Collectives
from ._cuda import (
    device_for_new_group,
    nccl_library_path,
    raw_stream,
)
from ._ops import (
    KIND_NAMES,
    KINDS,
    ArgumentError,
    ErrorClass,
)
from ._plan import (
    Check,
    _check_cuda_tensor,
    _check_tensor,
    _first_tensor,
    _Plan,
)
from ._profile import instrument as instrument_profiler
from ._work import CudaWork, DoneWork, Pending, RsWork
from .options import as_items

_LIVE: weakref.WeakSet[ProcessGroupRsccl] = weakref.WeakSet()


class ProcessGroupRsccl(Collectives, dist.ProcessGroup):
    """torch.distributed backend "rsccl" (see README.md)."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, pg_options: object = None, global_ranks: list[int] | None = None
    ):
        super().__init__(rank, size)
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
        # "rsccl" (one host), "nccl" (across hosts) or None: where CUDA tensors go.
        self._cuda_engine = self._comm.cuda_engine
        self._pool_bytes = int(self._comm.cuda_pool_bytes)
        self._pending = Pending()
        # Returned by every blocking CUDA collective (torch discards it after wait()).
        self._done = DoneWork([])
        self._gloo = None
        if self._comm.engine == "gloo":
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("rsccl-gloo/", store), rank, size, timeout)
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
        return self._comm.engine

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
        if self._gloo is None or self._cuda_engine == "nccl":
            return True
        if what is None:
            return False
        raise TypeError(
            f"rsccl: {what} on CUDA tensors in a group that spans hosts needs its NCCL engine, which this group "
            "does not have (CUDA was not initialized when it was created: call torch.cuda.set_device(local_rank) "
            "before init_process_group/new_group); or use CPU tensors"
        )

    # -- the pool (rsccl.mem_pool) ---------------------------------------------------------
    def _mem_pool(self) -> torch.cuda.MemPool:
        """The group's pool as a torch MemPool (one per group): torch's caching allocator
        takes segments from rsccl's symmetric memory through the two C functions the Rust
        core exports."""
        if self._pool is None:
            if self._cuda_device is None:
                raise RuntimeError(
                    "rsccl: this group has no CUDA engine, so no pool: call torch.cuda.set_device(local_rank) "
                    "before init_process_group/new_group"
                )
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

    # -- the single seam ---------------------------------------------------------------
    def _call(
        self,
        kind: int,
        on: Any,
        prepare: Callable[[bool], _Plan],
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

        `prepare(cuda)` checks every argument and builds every buffer before any op is
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
            plan = prepare(cuda)
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

    def _checker(self, cuda: bool) -> Check:
        """How a call on this side checks each of its tensors: a dense CPU tensor, or a dense
        CUDA tensor on the group's GPU."""
        return self._check_cuda if cuda else _check_tensor

    def _check_cuda(self, t: Any, what: str) -> torch.Tensor:
        _check_cuda_tensor(t, what)
        self._cuda_check(t, what)
        return t

    def _cuda_check(self, t: torch.Tensor, what: str) -> None:
        """The group has a CUDA engine and `t` is on its GPU. What the op asks of the engine
        is checked once, by the core: a dtype and op the engine reduces by the engine itself
        (`Engine::can_run`; refused by every rank alone, the group stays usable), a root in
        the group and sizes that fit by `Op::to_cuda` (which joins the call as invalid)."""
        if self._cuda_device is None:
            self._comm.cuda_health()  # raises why there is no CUDA engine (below if not)
            raise ArgumentError(
                f"{what}: this group has no CUDA engine (CUDA was not initialized when it was created); "
                "call torch.cuda.set_device(local_rank) before init_process_group/new_group"
            )
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
