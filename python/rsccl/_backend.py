"""rsccl's torch.distributed ProcessGroup.

Each collective method turns torch's arguments into contiguous buffers, submits one or
more engine operations through the Rust Communicator, and returns an RsWork that copies
results back where torch expects them. Argument errors found on one rank are submitted
too (``Communicator.invalid``), so every rank of the group raises the same error instead
of waiting for the rank that failed. Groups whose ranks span hosts delegate to gloo.
"""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _rsccl
from ._work import FailedWork, RsWork
from .options import as_items

_LIVE: "weakref.WeakSet[ProcessGroupRsccl]" = weakref.WeakSet()


class ArgumentError(Exception):
    """Raised while preparing a collective; carries the Python class to report."""

    def __init__(self, message: str, cls: str = "value"):
        super().__init__(message)
        self.cls = cls


def _buf(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _op_name(op: Any) -> str:
    """torch passes a ReduceOp (with .op) or a RedOpType; rsccl matches by name."""
    inner = getattr(op, "op", op)
    return getattr(inner, "name", str(inner))


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}", "type")
    if t.device.type != "cpu":
        raise ArgumentError(
            f"{what} is on {t.device}; this rsccl release runs CPU tensors only (the CUDA engine comes next)",
            "type",
        )
    if t.is_sparse or t.layout != torch.strided:
        raise ArgumentError(f"{what} has layout {t.layout}; rsccl needs dense tensors", "type")
    return t


def _one(tensors: Any, what: str) -> torch.Tensor:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        n = len(tensors) if isinstance(tensors, (list, tuple)) else "a non-list"
        raise ArgumentError(f"{what} takes exactly one tensor per rank, got {n}")
    return _check_tensor(tensors[0], what)


class _Staged:
    """A contiguous view of `t` for the engine; copies back after completion if needed."""

    def __init__(self, t: torch.Tensor, copy_in: bool = True):
        self.user = t
        if t.is_contiguous():
            self.buf = t
        else:
            self.buf = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype)

    def post(self) -> None:
        if self.buf is not self.user:
            self.user.copy_(self.buf)


def _flat_cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)


def _scatter_back(flat: torch.Tensor, outs: list[torch.Tensor]) -> Callable[[], None]:
    def post() -> None:
        off = 0
        for o in outs:
            n = o.numel()
            o.copy_(flat[off : off + n].view(o.shape))
            off += n

    return post


def _chain(*posts: Callable[[], None] | None) -> Callable[[], None]:
    def post() -> None:
        for p in posts:
            if p is not None:
                p()

    return post


class ProcessGroupRsccl(dist.ProcessGroup):
    """torch.distributed backend "rsccl" (see README.md)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, pg_options: object = None):
        super().__init__(rank, size)
        self._timeout = timeout
        self._options = pg_options
        self._comm = _rsccl.Communicator(store, rank, size, max(timeout.total_seconds(), 0.001), as_items(pg_options))
        self._gloo = None
        if self._comm.engine == "gloo":
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("rsccl-gloo/", store), rank, size, timeout)
        self._group_name = ""
        self._group_desc = ""
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
        """"host" (rsccl's shared-memory engine) or "gloo" (the group spans hosts)."""
        return self._comm.engine

    def memory_stats(self) -> dict:
        return dict(self._comm.memory_stats())

    def shutdown(self) -> None:
        self._comm.shutdown()

    def abort(self) -> None:
        self._comm.shutdown()

    # -- the single seam ---------------------------------------------------------------
    def _run(self, kind: str, gloo_call: Callable[[Any], Any], prepare: Callable[[], RsWork]) -> Any:
        """Delegate to gloo for multi-host groups; else prepare and submit. An
        ArgumentError becomes an `invalid` submission, waited on here, so this rank and
        every other rank raise the same error."""
        if self._gloo is not None:
            return gloo_call(self._gloo)
        try:
            return prepare()
        except ArgumentError as e:
            w = self._comm.invalid(kind, e.cls, str(e))
            w.wait()  # raises the error every rank agreed on
            return FailedWork(RuntimeError(str(e)))  # unreachable: wait() raised

    def _work(self, parts: list, result: Any, keep: Any = None, post: Callable[[], None] | None = None) -> RsWork:
        return RsWork(parts, result, keep, post)

    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"

        def prepare() -> RsWork:
            s = _Staged(_one(tensors, "all_reduce"))
            w = self._comm.all_reduce(_buf(s.buf), _dtype(s.buf), op)
            return self._work([w], tensors, s, s.post)

        return self._run("all_reduce", lambda g: g.allreduce(tensors, opts), prepare)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"

        def prepare() -> RsWork:
            ts = [_check_tensor(t, "all_reduce_coalesced") for t in tensors]
            parts, keep, posts = [], [], []
            # One engine operation per dtype, over the tensors flattened together.
            for dt in dict.fromkeys(t.dtype for t in ts):
                group = [t for t in ts if t.dtype == dt]
                flat = _flat_cat(group).to(dt)
                parts.append(self._comm.all_reduce(_buf(flat), _dtype(flat), op))
                keep.append(flat)
                posts.append(_scatter_back(flat, group))
            return self._work(parts, tensors, keep, _chain(*posts))

        return self._run("all_reduce", lambda g: g.allreduce_coalesced(tensors, opts), prepare)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0

        def prepare() -> RsWork:
            s = _Staged(_one(tensors, "broadcast"))
            w = self._comm.broadcast(_buf(s.buf), _dtype(s.buf), root)
            return self._work([w], tensors, s, s.post)

        return self._run("broadcast", lambda g: g.broadcast(tensors, opts), prepare)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"

        def prepare() -> RsWork:
            s = _Staged(_one(tensors, "reduce"))
            w = self._comm.reduce(_buf(s.buf), _dtype(s.buf), op, root)
            return self._work([w], tensors, s, s.post if self.rank() == root else None)

        return self._run("reduce", lambda g: g.reduce(tensors, opts), prepare)

    def _all_gather_one(self, out: torch.Tensor, inp: torch.Tensor) -> tuple[Any, Any, Callable[[], None] | None]:
        _check_tensor(out, "all_gather output")
        inp = _check_tensor(inp, "all_gather input").contiguous()
        if out.dtype != inp.dtype:
            raise ArgumentError(f"all_gather: output dtype {out.dtype} differs from input dtype {inp.dtype}", "type")
        s = _Staged(out, copy_in=False)
        w = self._comm.all_gather(_buf(inp), _buf(s.buf), _dtype(inp))
        return w, (inp, s), s.post

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RsWork:
        def prepare() -> RsWork:
            w, keep, post = self._all_gather_one(output, input)
            return self._work([w], output, keep, post)

        return self._run("all_gather", lambda g: g._allgather_base(output, input, opts), prepare)

    all_gather_single = _allgather_base

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        def prepare() -> RsWork:
            inp = _one(input_tensors, "all_gather input")
            if len(output_tensors) != 1 or len(output_tensors[0]) != self.size():
                raise ArgumentError(f"all_gather: tensor_list must hold group size {self.size()} tensors")
            outs = [_check_tensor(t, "all_gather output") for t in output_tensors[0]]
            for i, o in enumerate(outs):
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise ArgumentError(
                        f"all_gather: tensor_list[{i}] is {o.dtype}[{o.numel()}], input is {inp.dtype}[{inp.numel()}]"
                    )
            flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
            w, keep, _ = self._all_gather_one(flat, inp)
            return self._work([w], output_tensors, keep, _scatter_back(flat, outs))

        return self._run("all_gather", lambda g: g.allgather(output_tensors, input_tensors, opts), prepare)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> RsWork:
        def prepare() -> RsWork:
            if len(outputs) != len(inputs):
                raise ArgumentError(f"all_gather_into_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
            done = [self._all_gather_one(o, i) for o, i in zip(outputs, inputs)]
            return self._work([d[0] for d in done], outputs, [d[1] for d in done], _chain(*[d[2] for d in done]))

        return self._run("all_gather", lambda g: g.allgather_into_tensor_coalesced(outputs, inputs, opts), prepare)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None) -> RsWork:
        def prepare() -> RsWork:
            parts, keep, posts = [], [], []
            for i, inp in enumerate(input_list):
                inp = _check_tensor(inp, "all_gather_coalesced input")
                flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
                w, k, _ = self._all_gather_one(flat, inp)
                outs = [output_lists[r][i] for r in range(self.size())]
                parts.append(w)
                keep.append((flat, k))
                posts.append(_scatter_back(flat, outs))
            return self._work(parts, output_lists, keep, _chain(*posts))

        return self._run("all_gather", lambda g: g.allgather_coalesced(output_lists, input_list, opts), prepare)

    def _reduce_scatter_one(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> tuple[Any, Any, Callable[[], None] | None]:
        _check_tensor(out, "reduce_scatter output")
        inp = _check_tensor(inp, "reduce_scatter input").contiguous()
        if out.dtype != inp.dtype:
            raise ArgumentError(f"reduce_scatter: output dtype {out.dtype} differs from input dtype {inp.dtype}", "type")
        s = _Staged(out, copy_in=False)
        w = self._comm.reduce_scatter(_buf(inp), _buf(s.buf), _dtype(inp), op)
        return w, (inp, s), s.post

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RsWork:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"

        def prepare() -> RsWork:
            w, keep, post = self._reduce_scatter_one(output, input, op)
            return self._work([w], output, keep, post)

        return self._run("reduce_scatter", lambda g: g._reduce_scatter_base(output, input, opts), prepare)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> RsWork:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"

        def prepare() -> RsWork:
            out = _one(output_tensors, "reduce_scatter output")
            if len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
                raise ArgumentError(f"reduce_scatter: input_list must hold group size {self.size()} tensors")
            ins = [_check_tensor(t, "reduce_scatter input") for t in input_tensors[0]]
            for i, t in enumerate(ins):
                if t.numel() != out.numel() or t.dtype != out.dtype:
                    raise ArgumentError(
                        f"reduce_scatter: input_list[{i}] is {t.dtype}[{t.numel()}], output is {out.dtype}[{out.numel()}]"
                    )
            w, keep, post = self._reduce_scatter_one(out, _flat_cat(ins), op)
            return self._work([w], output_tensors, keep, post)

        return self._run("reduce_scatter", lambda g: g.reduce_scatter(output_tensors, input_tensors, opts), prepare)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> RsWork:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"

        def prepare() -> RsWork:
            if len(outputs) != len(inputs):
                raise ArgumentError(f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
            done = [self._reduce_scatter_one(o, i, op) for o, i in zip(outputs, inputs)]
            return self._work([d[0] for d in done], outputs, [d[1] for d in done], _chain(*[d[2] for d in done]))

        return self._run("reduce_scatter", lambda g: g.reduce_scatter_tensor_coalesced(outputs, inputs, opts), prepare)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> RsWork:
        def prepare() -> RsWork:
            out = _check_tensor(output, "all_to_all output")
            inp = _check_tensor(input, "all_to_all input").contiguous()
            if out.dtype != inp.dtype:
                raise ArgumentError(f"all_to_all: output dtype {out.dtype} differs from input dtype {inp.dtype}", "type")
            n = self.size()

            def split_bytes(t: torch.Tensor, splits: list[int], what: str) -> list[int]:
                rows = t.shape[0] if t.dim() > 0 else t.numel()
                row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
                if not splits:
                    if rows % n:
                        raise ArgumentError(f"all_to_all: {what} has {rows} rows, not divisible by group size {n}")
                    splits = [rows // n] * n
                if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
                    raise ArgumentError(
                        f"all_to_all: {what} split sizes {list(splits)} do not divide its {rows} rows among {n} ranks"
                    )
                return [s * row_bytes for s in splits]

            send = split_bytes(inp, list(input_split_sizes), "input")
            recv = split_bytes(out, list(output_split_sizes), "output")
            s = _Staged(out, copy_in=False)
            w = self._comm.all_to_all(_buf(inp), _buf(s.buf), _dtype(inp), send, recv)
            return self._work([w], output, (inp, s), s.post)

        return self._run(
            "all_to_all", lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts), prepare
        )

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        def prepare() -> RsWork:
            n = self.size()
            if len(output_tensors) != n or len(input_tensors) != n:
                raise ArgumentError(f"all_to_all: expected {n} input and output tensors, got {len(input_tensors)} and {len(output_tensors)}")
            ins = [_check_tensor(t, "all_to_all input") for t in input_tensors]
            outs = [_check_tensor(t, "all_to_all output") for t in output_tensors]
            dts = {t.dtype for t in ins + outs}
            if len(dts) != 1:
                raise ArgumentError(f"all_to_all: tensors must share one dtype, got {sorted(map(str, dts))}", "type")
            flat_in = _flat_cat(ins).to(ins[0].dtype)
            flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
            send = [t.numel() * t.element_size() for t in ins]
            recv = [t.numel() * t.element_size() for t in outs]
            w = self._comm.all_to_all(_buf(flat_in), _buf(flat_out), _dtype(flat_in), send, recv)
            return self._work([w], output_tensors, (flat_in, flat_out), _scatter_back(flat_out, outs))

        return self._run("all_to_all", lambda g: g.alltoall(output_tensors, input_tensors, opts), prepare)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0

        def prepare() -> RsWork:
            inp = _one(input_tensors, "gather input").contiguous()
            flat, post = None, None
            if self.rank() == root:
                if len(output_tensors) != 1 or len(output_tensors[0]) != self.size():
                    raise ArgumentError(f"gather: the root's gather_list must hold group size {self.size()} tensors")
                outs = [_check_tensor(t, "gather output") for t in output_tensors[0]]
                for i, o in enumerate(outs):
                    if o.numel() != inp.numel() or o.dtype != inp.dtype:
                        raise ArgumentError(f"gather: gather_list[{i}] is {o.dtype}[{o.numel()}], input is {inp.dtype}[{inp.numel()}]")
                flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
                post = _scatter_back(flat, outs)
            w = self._comm.gather(_buf(inp), None if flat is None else _buf(flat), _dtype(inp), root)
            return self._work([w], output_tensors, (inp, flat), post)

        return self._run("gather", lambda g: g.gather(output_tensors, input_tensors, opts), prepare)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0

        def prepare() -> RsWork:
            s = _Staged(_one(output_tensors, "scatter output"), copy_in=False)
            flat = None
            if self.rank() == root:
                if len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
                    raise ArgumentError(f"scatter: the root's scatter_list must hold group size {self.size()} tensors")
                ins = [_check_tensor(t, "scatter input") for t in input_tensors[0]]
                for i, t in enumerate(ins):
                    if t.numel() != s.user.numel() or t.dtype != s.user.dtype:
                        raise ArgumentError(f"scatter: scatter_list[{i}] is {t.dtype}[{t.numel()}], output is {s.user.dtype}[{s.user.numel()}]")
                flat = _flat_cat(ins).to(s.user.dtype)
            w = self._comm.scatter(None if flat is None else _buf(flat), _buf(s.buf), _dtype(s.buf), root)
            return self._work([w], output_tensors, (flat, s), s.post)

        return self._run("scatter", lambda g: g.scatter(output_tensors, input_tensors, opts), prepare)

    def barrier(self, opts: Any = None) -> RsWork:
        return self._run("barrier", lambda g: g.barrier(opts), lambda: self._work([self._comm.barrier()], None))

    # -- point to point ----------------------------------------------------------------
    def _p2p(self, tensors: list[torch.Tensor], peer: int, tag: int, send: bool) -> RsWork:
        what = "send" if send else "recv"
        if self._gloo is not None:
            return getattr(self._gloo, what)(tensors, peer, tag)
        try:
            t = _one(tensors, what)
        except ArgumentError as e:
            raise (TypeError if e.cls == "type" else ValueError)(f"rsccl: {e}") from None
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"rsccl: {what} peer {peer} is invalid for rank {self.rank()} of a group of size {self.size()}")
        if send:
            c = t.contiguous()
            return self._work([self._comm.send(_buf(c), _dtype(c), peer, tag)], tensors, c)
        s = _Staged(t, copy_in=False)
        return self._work([self._comm.recv(_buf(s.buf), _dtype(s.buf), peer, tag)], tensors, s, s.post)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> RsWork:
        return self._p2p(tensors, dstRank, tag, True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> RsWork:
        return self._p2p(tensors, srcRank, tag, False)


def create(dist_backend_opts: Any, pg_options: object) -> ProcessGroupRsccl:
    """The creator torch calls (extended API) for init_process_group/new_group."""
    return ProcessGroupRsccl(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        pg_options,
    )


@atexit.register
def _shutdown_all() -> None:
    # Engine threads complete Works through Python callbacks; stop them before the
    # interpreter finalizes.
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
