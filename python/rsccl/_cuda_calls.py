"""The CUDA calls of rsccl's ProcessGroup: checks on CUDA tensors, the op each call
launches (through Communicator.run, like every call), and the Work it returns. A mixin of
ProcessGroupRsccl (_backend.py), which routes CUDA tensors here; the blocking all_reduce's
fast path stays in ProcessGroupRsccl.allreduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._cuda import raw_stream
from ._ops import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    GATHER,
    RECV,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
    SEND,
    SUM,
    UINT8,
    ArgumentError,
    ErrorClass,
    dtype_code,
)
from ._plan import (
    _buf,
    _chain,
    _check_cuda_tensor,
    _check_same_dtype,
    _cuda_buffers,
    _even_or_split_bytes,
    _flat_cat,
    _gather_layout,
    _gathered,
    _offsets,
    _pack_bytes,
    _rank_list,
    _reduce_scatter_pack,
    _scatter_back,
    _shares_storage,
    _split_bytes,
)
from ._work import CudaWork, DoneWork


class CudaCalls:
    def _cuda_check(self, t: torch.Tensor, what: str) -> None:
        """The tensor's side of a CUDA call: the group has a CUDA engine and `t` is on its GPU.
        What the op asks of the kernels (a dtype and op they reduce, a root in the group)
        is checked once, by the core (`Op::to_cuda`), which joins the call as invalid."""
        if self._cuda_device is None:
            self._comm.cuda_health()  # raises why there is no CUDA engine (below if not)
            raise ArgumentError(
                f"{what}: this group has no CUDA engine (CUDA was not initialized when it was created); "
                "call torch.cuda.set_device(local_rank) before init_process_group/new_group"
            )
        if t.device.index != self._cuda_device:
            raise ArgumentError(f"{what}: rank {self.rank()} passed a tensor on {t.device}, but its group uses cuda:{self._cuda_device}")

    def _cuda(self, kind: int, prepare: Callable[[], tuple], opts: Any, result: Any) -> Any:
        """Check and launch one CUDA collective. `prepare` returns (inp, inp_bytes, out,
        out_bytes, dtype, op, root, keep, post), the op's fields for Communicator.run. An
        invalid argument makes this rank take part in the collective's first barrier as
        "invalid" (`_join_invalid`), so its peers report the mismatch instead of waiting,
        and raises here."""
        device = self._cuda_device if self._cuda_device is not None else torch.cuda.current_device()
        stream = raw_stream(device)
        try:
            inp, inp_bytes, out, out_bytes, dtype, op, root, keep, post = prepare()
        except Exception as e:  # noqa: BLE001 - raised by _join_invalid once the peers are told
            self._join_invalid(kind, e, 1, stream)
        blocking = opts is not None and opts.asyncOp is False
        ev = self._comm.run(kind, inp, inp_bytes, out, out_bytes, dtype, op, root, stream, blocking)
        return self._cuda_finish(ev, device, stream, result, keep, post)

    def _cuda_allreduce(self, t: torch.Tensor, op: str, opts: Any) -> Any:
        def prepare() -> tuple:
            self._cuda_check(t, "all_reduce")
            c = t if t.is_contiguous() else t.contiguous()
            post = None if c is t else (lambda: t.copy_(c))
            p, nbytes = _buf(c)
            return p, nbytes, p, nbytes, dtype_code(c), op, 0, (t, c), post

        return self._cuda(ALL_REDUCE, prepare, opts, [t])

    def _cuda_all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, opts: Any, result: Any, post_extra: Callable[[], None] | None = None
    ) -> Any:
        def prepare() -> tuple:
            self._cuda_check(inp, "all_gather input")
            self._cuda_check(out, "all_gather output")
            _check_same_dtype("all_gather", out, inp)
            if out.numel() != inp.numel() * self.size():
                raise ArgumentError(
                    f"all_gather: rank {self.rank()} passed output {out.dtype}[{out.numel()}] for input "
                    f"{inp.dtype}[{inp.numel()}] (the output must hold group size {self.size()} inputs)"
                )
            i, o, copy_back = _cuda_buffers(inp, out)
            post = _chain(copy_back, post_extra) if (copy_back or post_extra) else None
            return *_buf(i), *_buf(o), UINT8, SUM, 0, (inp, out, i, o), post

        return self._cuda(ALL_GATHER, prepare, opts, result)

    def _cuda_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, opts: Any, result: Any) -> Any:
        def prepare() -> tuple:
            self._cuda_check(inp, "reduce_scatter input")
            self._cuda_check(out, "reduce_scatter output")
            _check_same_dtype("reduce_scatter", out, inp)
            if inp.numel() != out.numel() * self.size():
                raise ArgumentError(
                    f"reduce_scatter: rank {self.rank()} passed input {inp.dtype}[{inp.numel()}] for output "
                    f"{out.dtype}[{out.numel()}] (the input must hold group size {self.size()} outputs)"
                )
            i, o, post = _cuda_buffers(inp, out)
            return *_buf(i), *_buf(o), dtype_code(o), op, 0, (inp, out, i, o), post

        return self._cuda(REDUCE_SCATTER, prepare, opts, result)

    def _cuda_broadcast(self, t: torch.Tensor, root: int, opts: Any) -> Any:
        def prepare() -> tuple:
            self._cuda_check(t, "broadcast")
            c = t if t.is_contiguous() else t.contiguous()
            post = None if c is t else (lambda: t.copy_(c))
            return *_buf(c), *_buf(c), UINT8, SUM, root, (t, c), post

        return self._cuda(BROADCAST, prepare, opts, [t])

    def _cuda_reduce(self, t: torch.Tensor, root: int, op: str, opts: Any) -> Any:
        def prepare() -> tuple:
            self._cuda_check(t, "reduce")
            c = t if t.is_contiguous() else t.contiguous()
            post = None if c is t or self.rank() != root else (lambda: t.copy_(c))
            return *_buf(c), *_buf(c), dtype_code(c), op, root, (t, c), post

        return self._cuda(REDUCE, prepare, opts, [t])

    def _cuda_gather(self, output_tensors: Any, inp: torch.Tensor, root: int, opts: Any) -> Any:
        def prepare() -> tuple:
            self._cuda_check(inp, "gather input")
            i = inp.contiguous()
            flat, post = i, None
            if self.rank() == root:
                outs = _rank_list(
                    output_tensors, inp, self.size(), "gather", "gather_list", "input", "the root's ", check=_check_cuda_tensor
                )
                for o in outs:
                    self._cuda_check(o, "gather output")
                flat = torch.empty(self.size() * i.numel(), dtype=i.dtype, device=i.device)
                post = _scatter_back(flat, outs)
            return *_buf(i), *_buf(flat), UINT8, SUM, root, (inp, i, flat), post

        return self._cuda(GATHER, prepare, opts, output_tensors)

    def _cuda_scatter(self, out: torch.Tensor, input_tensors: Any, root: int, opts: Any) -> Any:
        def prepare() -> tuple:
            self._cuda_check(out, "scatter output")
            o = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
            copy_back = None if o is out else (lambda: out.copy_(o))
            flat = o
            if self.rank() == root:
                ins = _rank_list(
                    input_tensors, out, self.size(), "scatter", "scatter_list", "output", "the root's ", check=_check_cuda_tensor
                )
                for x in ins:
                    self._cuda_check(x, "scatter input")
                flat = _flat_cat(ins)
            return *_buf(flat), *_buf(o), UINT8, SUM, root, (out, o, flat), copy_back

        return self._cuda(SCATTER, prepare, opts, [out])

    def _on_cuda(self, t: Any, what: str) -> bool:
        """Whether all_to_all or send/recv whose (first) tensor is `t` takes the CUDA
        engine's path: rsccl's kernels in a group on one host; across hosts, the NCCL
        engine (all_to_all: one NCCL group of sends and receives on the flat communicator;
        send/recv: the 2-rank communicator of that ordered pair, on its own stream, or
        rsccl's kernels for a rank of this host; docs/multihost.md). Across hosts without
        the NCCL engine (CUDA not initialized at creation) it is a clear TypeError: gloo
        does not take CUDA tensors."""
        if not getattr(t, "is_cuda", False):
            return False
        if self._gloo is None or self._cuda_engine == "nccl":
            return True
        raise TypeError(
            f"rsccl: {what} on CUDA tensors in a group that spans hosts needs its NCCL engine, which this group "
            "does not have (CUDA was not initialized when it was created: call torch.cuda.set_device(local_rank) "
            "before init_process_group/new_group); or use CPU tensors"
        )

    def _cuda_finish(self, ev: Any, device: int, stream: int, result: Any, keep: Any, post: Callable[[], None] | None) -> Any:
        """The Work of a launched CUDA operation: done (copies back made) when blocking (no
        event), else a CudaWork holding `keep` until a stream is ordered after it."""
        if ev is None:
            if post is not None:
                post()
            return DoneWork(result)
        w = CudaWork(self, device, ev, result, keep, post, stream)
        self._pending.add(w)
        return w

    def _cuda_launches(self, kind: int, prepare: Callable[[], tuple], launches: int, opts: Any, result: Any) -> Any:
        """Check and launch a call that runs as `launches` CUDA collectives of one kind (one
        per dtype of a coalesced list). `prepare` returns ([(inp, inp_bytes, out, out_bytes,
        dtype, op, root), ...], keep, post). Every rank makes every launch even when one
        fails (the ranks stay in step), and the first error is raised after the last launch."""
        device = self._cuda_device if self._cuda_device is not None else torch.cuda.current_device()
        stream = raw_stream(device)
        try:
            calls, keep, post = prepare()
        except Exception as e:  # noqa: BLE001 - raised by _join_invalid once the peers are told
            self._join_invalid(kind, e, launches, stream)
        blocking = opts is not None and opts.asyncOp is False
        ev, first = None, None
        for c in calls:
            try:
                # Launches on one stream finish in order: the last event covers them all.
                ev = self._comm.run(kind, *c, stream, blocking)
            except Exception as err:  # noqa: BLE001 - raised below, after the other launches
                first = first or err
        if first is not None:
            if ev is not None:
                ev.synchronize()  # the buffers in `keep` go when this raises
            raise first
        return self._cuda_finish(ev, device, stream, result, keep, post)

    def _cuda_all_to_all(self, prepare: Callable[[], tuple], opts: Any, result: Any) -> Any:
        """Check and launch one CUDA all_to_all. `prepare` returns (send_ptrs, send_bytes,
        recv_ptrs, recv_bytes, keep, post), lists indexed by peer."""
        device = self._cuda_device if self._cuda_device is not None else torch.cuda.current_device()
        stream = raw_stream(device)
        try:
            send_ptrs, send_bytes, recv_ptrs, recv_bytes, keep, post = prepare()
            me = self.rank()
            if send_bytes[me] != recv_bytes[me]:
                raise ArgumentError(
                    f"all_to_all: rank {me} sends itself {send_bytes[me]} bytes but expects {recv_bytes[me]} bytes "
                    "from itself (its input and output splits disagree at its own rank)"
                )
        except Exception as e:  # noqa: BLE001 - raised by _join_invalid once the peers are told
            self._join_invalid(ALL_TO_ALL, e, 1, stream)
        blocking = opts is not None and opts.asyncOp is False
        ev = self._comm.run(ALL_TO_ALL, 0, 0, 0, 0, UINT8, SUM, 0, stream, blocking, (send_ptrs, send_bytes, recv_ptrs, recv_bytes))
        return self._cuda_finish(ev, device, stream, result, keep, post)

    def _cuda_alltoall_base(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any) -> Any:
        def prepare() -> tuple:
            me, n = self.rank(), self.size()
            _check_cuda_tensor(output, "all_to_all_single output")
            self._cuda_check(input, "all_to_all_single input")
            self._cuda_check(output, "all_to_all_single output")
            _check_same_dtype("all_to_all_single", output, input)
            send = _split_bytes(input, list(in_splits), n, f"all_to_all_single: rank {me}'s input")
            recv = _split_bytes(output, list(out_splits), n, f"all_to_all_single: rank {me}'s output")
            i = input.contiguous()
            if i is input and _shares_storage(input, output):
                i = input.clone()  # in place: the kernels must not read what they write
            o = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype, device=output.device)
            post = None if o is output else (lambda: output.copy_(o))
            send_ptrs = [i.data_ptr() + off for off in _offsets(send)]
            recv_ptrs = [o.data_ptr() + off for off in _offsets(recv)]
            return send_ptrs, send, recv_ptrs, recv, (input, output, i, o), post

        return self._cuda_all_to_all(prepare, opts, [output])

    def _a2a_fast(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> bool:
        """The blocking all_to_all_single's fast path, for the common case only: both
        buffers contiguous on the group's device, one dtype, disjoint, valid splits. Launches
        and returns True; returns False (nothing launched) for anything else, which the full
        path then checks and reports."""
        dev = self._cuda_device
        if (
            dev is None
            or not isinstance(output, torch.Tensor)
            or output.dtype != input.dtype
            or input.get_device() != dev
            or output.get_device() != dev
            or input.dim() == 0
            or output.dim() == 0
            or not input.is_contiguous()
            or not output.is_contiguous()
        ):
            return False
        n = self.size()
        send = _even_or_split_bytes(input, in_splits, n)
        recv = _even_or_split_bytes(output, out_splits, n)
        if send is None or recv is None:
            return False
        me = self.rank()
        ip, op = input.data_ptr(), output.data_ptr()
        ib, ob = sum(send), sum(recv)
        if send[me] != recv[me] or (ip < op + ob and op < ip + ib):
            return False
        send_ptrs = [ip + o for o in _offsets(send)]
        recv_ptrs = [op + o for o in _offsets(recv)]
        self._comm.run(ALL_TO_ALL, 0, 0, 0, 0, UINT8, SUM, 0, raw_stream(dev), True, (send_ptrs, send, recv_ptrs, recv))
        return True

    def _cuda_alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any) -> Any:
        def prepare() -> tuple:
            me, n = self.rank(), self.size()
            if len(output_tensors) != n or len(input_tensors) != n:
                raise ArgumentError(
                    f"all_to_all: rank {me} passed {len(input_tensors)} input and {len(output_tensors)} output tensors; "
                    f"expected group size {n} of each"
                )
            ins = [_check_cuda_tensor(t, "all_to_all input") for t in input_tensors]
            outs = [_check_cuda_tensor(t, "all_to_all output") for t in output_tensors]
            for t in ins + outs:
                self._cuda_check(t, "all_to_all")
            dts = {t.dtype for t in ins + outs}
            if len(dts) != 1:
                raise ArgumentError(
                    f"all_to_all: rank {me} passed tensors of several dtypes {sorted(map(str, dts))}; give one dtype", ErrorClass.TYPE
                )
            # Each tensor is used where it is: no flattening. An input that shares storage with
            # an output (in place) or is not contiguous is copied; a non-contiguous output gets a
            # contiguous stand-in, copied back after.
            written = {o.untyped_storage().data_ptr() for o in outs if o.numel()}
            bufs_in = []
            for t in ins:
                c = t.contiguous()
                if c is t and t.numel() and t.untyped_storage().data_ptr() in written:
                    c = t.clone()
                bufs_in.append(c)
            bufs_out, posts = [], []
            for t in outs:
                if t.is_contiguous():
                    bufs_out.append(t)
                else:
                    o = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                    bufs_out.append(o)
                    posts.append(lambda t=t, o=o: t.copy_(o))
            send = [c.numel() * c.element_size() for c in bufs_in]
            recv = [c.numel() * c.element_size() for c in bufs_out]
            post = _chain(*posts) if posts else None
            return [c.data_ptr() for c in bufs_in], send, [c.data_ptr() for c in bufs_out], recv, (ins, outs, bufs_in, bufs_out), post

        return self._cuda_all_to_all(prepare, opts, output_tensors)

    def _cuda_allreduce_coalesced(self, tensors: list[torch.Tensor], op: str, opts: Any) -> Any:
        # One launch per dtype (in order of first appearance): a count every rank of a valid
        # program agrees on, taken before any check so a rank with a bad tensor counts the same.
        dtypes = list(dict.fromkeys(t.dtype for t in tensors if isinstance(t, torch.Tensor)))

        def prepare() -> tuple:
            ts = [_check_cuda_tensor(t, "all_reduce_coalesced") for t in tensors]
            for t in ts:
                self._cuda_check(t, "all_reduce_coalesced")
            calls, keep, dsts, srcs = [], [], [], []
            for dt in dtypes:
                group = [t for t in ts if t.dtype == dt]
                if len(group) == 1 and group[0].is_contiguous():
                    flat = group[0]  # reduced in place
                else:
                    flat = torch.cat([t.reshape(-1) for t in group])
                    off = 0
                    for t in group:
                        dsts.append(t)
                        srcs.append(flat[off : off + t.numel()].view(t.shape))
                        off += t.numel()
                calls.append((*_buf(flat), *_buf(flat), dtype_code(flat), op, 0))
                keep.append(flat)
            post = (lambda: torch._foreach_copy_(dsts, srcs)) if dsts else None
            return calls, (ts, keep), post

        return self._cuda_launches(ALL_REDUCE, prepare, len(dtypes), opts, list(tensors))

    def _cuda_gather_bytes(self, what: str, inputs: list[torch.Tensor], outputs: list[Any], opts: Any, result: Any) -> Any:
        """All-gather many inputs of any dtypes in ONE launch, moving bytes (see
        _gather_layout). `outputs[k]` receives input k of every rank: a tensor of world x
        numel_k elements, rank-major (all_gather_into_tensor), or a list of one tensor per
        rank (all_gather_coalesced)."""

        def prepare() -> tuple:
            me, n = self.rank(), self.size()
            if len(outputs) != len(inputs):
                raise ArgumentError(f"{what}: rank {me} passed {len(outputs)} outputs for {len(inputs)} inputs")
            ins = [_check_cuda_tensor(t, f"{what} input") for t in inputs]
            for i in ins:
                self._cuda_check(i, f"{what} input")
            for k, (o, i) in enumerate(zip(outputs, ins)):
                per_rank = list(o) if isinstance(o, (list, tuple)) else None
                for x in per_rank if per_rank is not None else [o]:
                    _check_cuda_tensor(x, f"{what} output")
                    self._cuda_check(x, f"{what} output")
                    _check_same_dtype(f"{what} #{k}", x, i)
                if per_rank is not None and (len(per_rank) != n or any(x.numel() != i.numel() for x in per_rank)):
                    raise ArgumentError(f"{what} #{k}: rank {me} must pass {n} outputs of {i.numel()} elements (one per rank)")
                if per_rank is None and o.numel() != n * i.numel():
                    raise ArgumentError(
                        f"{what} #{k}: rank {me} passed an output of {o.numel()} elements for an input of {i.numel()} "
                        f"(the output holds group size {n} inputs)"
                    )
            offsets, total = _gather_layout(ins)
            flat_in = _pack_bytes(ins, offsets, total)
            flat_out = torch.empty(n * total, dtype=torch.uint8, device=flat_in.device)

            def post() -> None:
                dsts, srcs = [], []
                for o, rows in zip(outputs, _gathered(flat_out, n, offsets, total, ins)):
                    if isinstance(o, (list, tuple)):
                        dsts += list(o)
                        srcs += [rows[r].view(x.shape) for r, x in enumerate(o)]
                    elif o.is_contiguous():
                        dsts.append(o.view(n, rows.shape[1]))
                        srcs.append(rows)
                    else:
                        dsts.append(o)
                        srcs.append(rows.reshape(o.shape))  # rank-major, as o's element order
                if dsts:
                    torch._foreach_copy_(dsts, srcs)

            return [(*_buf(flat_in), *_buf(flat_out), UINT8, SUM, 0)], (ins, outputs, flat_in, flat_out), post

        return self._cuda_launches(ALL_GATHER, prepare, 1, opts, result)

    def _cuda_reduce_scatter_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: str, opts: Any) -> Any:
        # One launch per dtype, counted from the inputs (see _cuda_allreduce_coalesced).
        dtypes = list(dict.fromkeys(t.dtype for t in inputs if isinstance(t, torch.Tensor)))

        def prepare() -> tuple:
            me, n = self.rank(), self.size()
            if len(outputs) != len(inputs):
                raise ArgumentError(f"reduce_scatter_tensor_coalesced: rank {me} passed {len(outputs)} outputs for {len(inputs)} inputs")
            for k, (o, i) in enumerate(zip(outputs, inputs)):
                _check_cuda_tensor(o, "reduce_scatter_tensor_coalesced output")
                _check_cuda_tensor(i, "reduce_scatter_tensor_coalesced input")
                self._cuda_check(i, "reduce_scatter_tensor_coalesced input")
                self._cuda_check(o, "reduce_scatter_tensor_coalesced output")
                _check_same_dtype(f"reduce_scatter_tensor_coalesced #{k}", o, i)
                if i.numel() != n * o.numel():
                    raise ArgumentError(
                        f"reduce_scatter_tensor_coalesced #{k}: rank {me} passed input {i.dtype}[{i.numel()}] for output "
                        f"{o.dtype}[{o.numel()}] (the input must hold group size {n} outputs)"
                    )
            calls, keep, dsts, srcs = [], [], [], []
            for dt in dtypes:
                pairs = [(o, i) for o, i in zip(outputs, inputs) if i.dtype == dt]
                if len(pairs) == 1 and pairs[0][0].is_contiguous():
                    o, i = pairs[0]
                    flat_in, flat_out = i.contiguous(), o
                else:
                    flat_in = _reduce_scatter_pack([i for _, i in pairs], [o.numel() for o, _ in pairs], n)
                    flat_out = torch.empty(sum(o.numel() for o, _ in pairs), dtype=dt, device=flat_in.device)
                    off = 0
                    for o, _ in pairs:
                        dsts.append(o)
                        srcs.append(flat_out[off : off + o.numel()].view(o.shape))
                        off += o.numel()
                calls.append((*_buf(flat_in), *_buf(flat_out), dtype_code(flat_out), op, 0))
                keep.append((flat_in, flat_out))
            post = (lambda: torch._foreach_copy_(dsts, srcs)) if dsts else None
            return calls, (inputs, outputs, keep), post

        return self._cuda_launches(REDUCE_SCATTER, prepare, len(dtypes), opts, list(outputs))

    def _cuda_p2p(self, tensors: list[torch.Tensor], peer: int, send: bool) -> Any:
        """One send or recv on the CUDA engine. Each (peer, direction) has its own internal
        stream (across hosts: its own NCCL communicator too), so a send to j and a recv
        from j progress together, issued one at a time as torch issues them for
        batch_isend_irecv; sends to one peer match that peer's recvs in order. Always
        asynchronous (torch passes no asyncOp here: a blocking dist.send/recv waits on the
        Work, which orders the caller's stream)."""
        what = "send" if send else "recv"
        device = self._cuda_device if self._cuda_device is not None else torch.cuda.current_device()
        stream = raw_stream(device)
        try:
            if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
                raise ArgumentError(
                    f"{what}: rank {self.rank()} passed {len(tensors) if isinstance(tensors, (list, tuple)) else 'a non-list'}; give one tensor"
                )
            t = _check_cuda_tensor(tensors[0], what)
            self._cuda_check(t, what)
            if not isinstance(peer, int) or not 0 <= peer < self.size() or peer == self.rank():
                raise ArgumentError(
                    f"{what}: rank {self.rank()} passed peer {peer}; give another rank of this group of {self.size()} "
                    "(rsccl does not send to itself)"
                )
        except ArgumentError as e:
            # Only this rank and its peer are involved: raise here; a peer left waiting for
            # the message times out after the group's timeout.
            raise e.to_raise() from None
        if send:
            c, post = t.contiguous(), None
        else:
            c = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            post = None if c is t else (lambda: t.copy_(c))
        p, nbytes = _buf(c)
        ev = self._comm.run(SEND if send else RECV, p, nbytes, p, nbytes, UINT8, SUM, peer, stream, False)
        return self._cuda_finish(ev, device, stream, [t], (t, c), post)
