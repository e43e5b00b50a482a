"""torch's collective and point-to-point methods of rsccl's ProcessGroup (a mixin of
ProcessGroupRsccl, _backend.py): one method per collective for both devices. Each builds
the call's plan (`prepare(cuda)`: checks, buffers and ops, _plan.py) and hands it to the
group's one seam, `_call`, which runs it on the side its tensors are on. Only the layouts
that differ by device branch on `cuda`. The blocking all_reduce and all_to_all_single on
CUDA have fast paths that build their one op directly.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ._cuda import REDUCE_DTYPES, REDUCE_OPS, raw_stream
from ._monitored import monitored_barrier
from ._ops import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BARRIER,
    BROADCAST,
    DTYPE_CODES,
    GATHER,
    OP_CODES,
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
    op_code,
    op_name,
)
from ._plan import (
    _as_bytes,
    _buf,
    _chain,
    _check_same_dtype,
    _CopyBack,
    _flat_cat,
    _gather_layout,
    _gathered,
    _offsets,
    _one,
    _op,
    _pack_bytes,
    _Plan,
    _rank_list,
    _reduce_scatter_pack,
    _scatter_back,
    _shares_storage,
    _split_bytes,
    _Staged,
)
from ._work import DoneWork, RecvAnyWork

# (dtype, op code) -> dtype code, for every combination rsccl's CUDA kernels reduce.
_FAST_ALLREDUCE = {
    (dt, OP_CODES[name]): DTYPE_CODES[dt] for dt in REDUCE_DTYPES for name in REDUCE_OPS if name != "AVG" or dt.is_floating_point
}


def _reduce_op(opts: Any) -> int | str:
    return op_code(opts.reduceOp) if opts is not None else SUM


def _root(opts: Any) -> int:
    return opts.rootRank if opts is not None else 0


def _first(ts: Any) -> Any:
    """The tensor a call routes by: the first of torch's list (None if there is none)."""
    return ts[0] if isinstance(ts, (list, tuple)) and ts else None


class Collectives:
    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = op_code(opts.reduceOp) if opts is not None else SUM  # inline: the fast path's cost
        if len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return self._sparse_allreduce(tensors, op, opts)
        if len(tensors) == 1 and self._on_cuda(tensors[0]):
            t = tensors[0]
            # The blocking call's fast path: nothing to check beyond this, nothing to keep.
            dt = _FAST_ALLREDUCE.get((t.dtype, op))
            if dt is not None and opts is not None and opts.asyncOp is False and t.get_device() == self._cuda_device and t.is_contiguous():
                p, nbytes = t.data_ptr(), t.nbytes
                self._comm.run(ALL_REDUCE, p, nbytes, p, nbytes, dt, op, 0, raw_stream(self._cuda_device), True)
                return self._done

        def prepare(cuda: bool) -> _Plan:
            s = _Staged(_one(tensors, "all_reduce", self._checker(cuda)))
            return _Plan([_op(s.buf, s.buf, op)], tensors, s, s.post)

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
        op = _reduce_op(opts)
        # One op per dtype (in order of first appearance): a count every rank of a valid
        # program agrees on, taken before any check so a rank with a bad tensor counts the same.
        dtypes = list(dict.fromkeys(t.dtype for t in tensors if isinstance(t, torch.Tensor)))

        def prepare(cuda: bool) -> _Plan:
            check = self._checker(cuda)
            ts = [check(t, "all_reduce_coalesced") for t in tensors]
            ops, keep, back = [], [], _CopyBack()
            for dt in dtypes:
                group = [t for t in ts if t.dtype == dt]
                if len(group) == 1 and group[0].is_contiguous():
                    flat = group[0]  # reduced in place
                else:
                    flat = _flat_cat(group)
                    back.add(flat, group)
                ops.append(_op(flat, flat, op))
                keep.append(flat)
            return _Plan(ops, list(tensors), (ts, keep), back.post())

        return self._noted(
            self._call(
                ALL_REDUCE,
                _first(tensors),
                prepare,
                opts,
                gloo=lambda g: g.allreduce_coalesced(tensors, opts),
                n_ops=len(dtypes),
                args=(tensors,),
            )
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = _root(opts)

        def prepare(cuda: bool) -> _Plan:
            s = _Staged(_one(tensors, "broadcast", self._checker(cuda)))
            return _Plan([_op(s.buf, s.buf, root=root)], tensors, s, s.post)

        return self._call(BROADCAST, _first(tensors), prepare, opts, gloo=lambda g: g.broadcast(tensors, opts), args=(tensors,))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root, op = _root(opts), _reduce_op(opts)

        def prepare(cuda: bool) -> _Plan:
            s = _Staged(_one(tensors, "reduce", self._checker(cuda)))
            return _Plan([_op(s.buf, s.buf, op, root)], tensors, s, s.post if self.rank() == root else None)

        return self._call(REDUCE, _first(tensors), prepare, opts, gloo=lambda g: g.reduce(tensors, opts), args=(tensors,))

    def _all_gather_plan(self, out: torch.Tensor, inp: torch.Tensor, cuda: bool, result: Any) -> _Plan:
        """One all_gather of `inp` into `out` (group size inputs, rank-major); the core
        checks the sizes (the host engine, and Op::to_cuda for the CUDA engines)."""
        check = self._checker(cuda)
        check(out, "all_gather output")
        check(inp, "all_gather input")
        _check_same_dtype("all_gather", out, inp)
        i, s = inp.contiguous(), _Staged(out, copy_in=False)
        return _Plan([_op(i, s.buf)], result, (inp, i, s), s.post)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._call(
            ALL_GATHER,
            input,
            lambda cuda: self._all_gather_plan(output, input, cuda, [output]),
            opts,
            gloo=lambda g: g._allgather_base(output, input, opts),
            args=(output, input),
        )

    all_gather_single = _allgather_base

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        def prepare(cuda: bool) -> _Plan:
            check = self._checker(cuda)
            inp = _one(input_tensors, "all_gather input", check)
            outs = _rank_list(output_tensors, inp, self.size(), "all_gather", "tensor_list", "input", check=check)
            flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
            plan = self._all_gather_plan(flat, inp, cuda, output_tensors)
            plan.post = _scatter_back(flat, outs)
            return plan

        return self._call(
            ALL_GATHER,
            _first(input_tensors),
            prepare,
            opts,
            gloo=lambda g: g.allgather(output_tensors, input_tensors, opts),
            args=(output_tensors, input_tensors),
        )

    def _gather_bytes(self, what: str, inputs: list[torch.Tensor], outputs: list[Any], cuda: bool, result: Any) -> _Plan:
        """All-gather many inputs of any dtypes in ONE op, moving bytes (see _gather_layout).
        `outputs[k]` receives input k of every rank: a tensor of world x numel_k elements,
        rank-major (all_gather_into_tensor), or a list of one tensor per rank
        (all_gather_coalesced)."""
        n, check = self.size(), self._checker(cuda)
        if len(outputs) != len(inputs):
            raise ArgumentError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        ins = [check(t, f"{what} input") for t in inputs]
        for k, (o, i) in enumerate(zip(outputs, ins)):
            per_rank = list(o) if isinstance(o, (list, tuple)) else None
            for x in per_rank if per_rank is not None else [o]:
                check(x, f"{what} output")
                _check_same_dtype(f"{what} #{k}", x, i)
            if per_rank is not None and (len(per_rank) != n or any(x.numel() != i.numel() for x in per_rank)):
                raise ArgumentError(f"{what} #{k}: give {n} outputs of {i.numel()} elements (one per rank)")
            if per_rank is None and o.numel() != n * i.numel():
                raise ArgumentError(f"{what} #{k}: output has {o.numel()} elements, expected {n} x {i.numel()}")
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

        return _Plan([_op(flat_in, flat_out)], result, (ins, outputs, flat_in, flat_out), post)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        def prepare(cuda: bool) -> _Plan:
            if len(inputs) == 1 and len(outputs) == 1 and isinstance(outputs[0], torch.Tensor):
                return self._all_gather_plan(outputs[0], inputs[0], cuda, list(outputs))
            return self._gather_bytes("all_gather_into_tensor_coalesced", list(inputs), list(outputs), cuda, list(outputs))

        return self._noted(
            self._call(
                ALL_GATHER,
                _first(inputs),
                prepare,
                opts,
                gloo=lambda g: g.allgather_into_tensor_coalesced(outputs, inputs, opts),
                args=(outputs, inputs),
            )
        )

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None) -> Any:
        def prepare(cuda: bool) -> _Plan:
            n = self.size()
            if len(output_lists) != n or any(len(lst) != len(input_list) for lst in output_lists):
                raise ArgumentError(f"all_gather_coalesced: output_tensor_lists must hold {n} lists of {len(input_list)} tensors")
            per_input = [[output_lists[r][k] for r in range(n)] for k in range(len(input_list))]
            return self._gather_bytes("all_gather_coalesced", list(input_list), per_input, cuda, output_lists)

        return self._call(
            ALL_GATHER,
            _first(input_list),
            prepare,
            opts,
            gloo=lambda g: g.allgather_coalesced(output_lists, input_list, opts),
            args=(output_lists, input_list),
        )

    def _reduce_scatter_plan(self, out: torch.Tensor, inp: torch.Tensor, op: int | str, cuda: bool, result: Any) -> _Plan:
        """One reduce_scatter of `inp` (group size blocks) into `out`; the core checks the
        sizes (the host engine, and Op::to_cuda for the CUDA engines)."""
        check = self._checker(cuda)
        check(out, "reduce_scatter output")
        check(inp, "reduce_scatter input")
        _check_same_dtype("reduce_scatter", out, inp)
        i, s = inp.contiguous(), _Staged(out, copy_in=False)
        return _Plan([_op(i, s.buf, op)], result, (inp, i, s), s.post)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _reduce_op(opts)
        return self._call(
            REDUCE_SCATTER,
            input,
            lambda cuda: self._reduce_scatter_plan(output, input, op, cuda, [output]),
            opts,
            gloo=lambda g: g._reduce_scatter_base(output, input, opts),
            args=(output, input),
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = _reduce_op(opts)

        def prepare(cuda: bool) -> _Plan:
            check = self._checker(cuda)
            out = _one(output_tensors, "reduce_scatter output", check)
            ins = _rank_list(input_tensors, out, self.size(), "reduce_scatter", "input_list", "output", check=check)
            return self._reduce_scatter_plan(out, _flat_cat(ins), op, cuda, output_tensors)

        return self._call(
            REDUCE_SCATTER,
            _first(output_tensors),
            prepare,
            opts,
            gloo=lambda g: g.reduce_scatter(output_tensors, input_tensors, opts),
            args=(output_tensors, input_tensors),
        )

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts)
        # One op per dtype, counted from the inputs (see allreduce_coalesced).
        dtypes = list(dict.fromkeys(t.dtype for t in inputs if isinstance(t, torch.Tensor)))

        def prepare(cuda: bool) -> _Plan:
            n, check = self.size(), self._checker(cuda)
            what = "reduce_scatter_tensor_coalesced"
            if len(outputs) != len(inputs):
                raise ArgumentError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
            for k, (o, i) in enumerate(zip(outputs, inputs)):
                check(o, "reduce_scatter output")
                check(i, "reduce_scatter input")
                _check_same_dtype(f"{what} #{k}", o, i)
                if i.numel() != n * o.numel():
                    raise ArgumentError(f"{what} #{k}: input has {i.numel()} elements, expected {n} x {o.numel()}")
            ops, keep, back = [], [], _CopyBack()
            for dt in dtypes:
                pairs = [(o, i) for o, i in zip(outputs, inputs) if i.dtype == dt]
                if len(pairs) == 1 and pairs[0][0].is_contiguous():
                    o, i = pairs[0]
                    flat_in, flat_out = i.contiguous(), o
                else:
                    # Rank block r of the combined input is every input's block r, back to
                    # back; the combined output splits into the outputs.
                    flat_in = _reduce_scatter_pack([i for _, i in pairs], [o.numel() for o, _ in pairs], n)
                    flat_out = torch.empty(sum(o.numel() for o, _ in pairs), dtype=dt, device=flat_in.device)
                    back.add(flat_out, [o for o, _ in pairs])
                ops.append(_op(flat_in, flat_out, op))
                keep.append((flat_in, flat_out))
            return _Plan(ops, list(outputs), (inputs, outputs, keep), back.post())

        return self._noted(
            self._call(
                REDUCE_SCATTER,
                _first(inputs),
                prepare,
                opts,
                gloo=lambda g: g.reduce_scatter_tensor_coalesced(outputs, inputs, opts),
                n_ops=len(dtypes),
                args=(outputs, inputs),
            )
        )

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None
    ) -> Any:
        if self._on_cuda(input, "all_to_all_single") and opts is not None and opts.asyncOp is False:
            if self._a2a_fast(output, input, output_split_sizes, input_split_sizes):
                return self._done

        def prepare(cuda: bool) -> _Plan:
            check, n = self._checker(cuda), self.size()
            check(output, "all_to_all output")
            check(input, "all_to_all input")
            _check_same_dtype("all_to_all", output, input)
            send = _split_bytes(input, list(input_split_sizes), n, "all_to_all: input")
            recv = _split_bytes(output, list(output_split_sizes), n, "all_to_all: output")
            i = input.contiguous()
            if i is input and _shares_storage(input, output):
                i = input.clone()  # in place: the kernels must not read what they write
            s = _Staged(output, copy_in=False)
            splits = ([i.data_ptr() + o for o in _offsets(send)], send, [s.buf.data_ptr() + o for o in _offsets(recv)], recv)
            return _Plan([_op(i, s.buf, splits=splits)], [output], (input, i, s), s.post)

        return self._call(
            ALL_TO_ALL,
            input,
            prepare,
            opts,
            gloo=lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            args=(output, input, output_split_sizes, input_split_sizes),
            what="all_to_all_single",
        )

    all_to_all_single = alltoall_base

    def _a2a_fast(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> bool:
        """The blocking all_to_all_single's fast path on CUDA, for the common case only: both
        buffers contiguous on the group's device, one dtype, disjoint, valid splits. Makes
        the op and returns True; returns False (nothing made) for anything else, which the
        full path then checks and reports."""
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
        send = _split_bytes(input, in_splits, n, None)
        recv = _split_bytes(output, out_splits, n, None)
        if send is None or recv is None:
            return False
        me = self.rank()
        ip, op = input.data_ptr(), output.data_ptr()
        ib, ob = sum(send), sum(recv)
        if send[me] != recv[me] or (ip < op + ob and op < ip + ib):
            return False
        splits = ([ip + o for o in _offsets(send)], send, [op + o for o in _offsets(recv)], recv)
        self._comm.run(ALL_TO_ALL, ip, ib, op, ob, dtype_code(input), SUM, 0, raw_stream(dev), True, splits)
        return True

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        def prepare(cuda: bool) -> _Plan:
            n, check = self.size(), self._checker(cuda)
            if len(output_tensors) != n or len(input_tensors) != n:
                raise ArgumentError(
                    f"all_to_all: expected {n} input and output tensors, got {len(input_tensors)} and {len(output_tensors)}"
                )
            ins = [check(t, "all_to_all input") for t in input_tensors]
            outs = [check(t, "all_to_all output") for t in output_tensors]
            dts = {t.dtype for t in ins + outs}
            if len(dts) != 1:
                raise ArgumentError(f"all_to_all: tensors must share one dtype, got {sorted(map(str, dts))}", ErrorClass.TYPE)
            send = [t.numel() * t.element_size() for t in ins]
            recv = [t.numel() * t.element_size() for t in outs]
            if not cuda:
                # The host engine takes one buffer per side, its chunks back to back.
                flat_in = _flat_cat(ins).to(ins[0].dtype)
                flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
                splits = ([], send, [], recv)
                return _Plan([_op(flat_in, flat_out, splits=splits)], output_tensors, (flat_in, flat_out), _scatter_back(flat_out, outs))
            # The CUDA engines take a chunk per peer where it is: no flattening. An input
            # that shares storage with an output (in place) or is not contiguous is copied;
            # a non-contiguous output gets a contiguous stand-in, copied back after.
            written = {o.untyped_storage().data_ptr() for o in outs if o.numel()}
            bufs_in = []
            for t in ins:
                c = t.contiguous()
                if c is t and t.numel() and t.untyped_storage().data_ptr() in written:
                    c = t.clone()
                bufs_in.append(c)
            staged = [_Staged(t, copy_in=False) for t in outs]
            splits = ([c.data_ptr() for c in bufs_in], send, [s.buf.data_ptr() for s in staged], recv)
            posts = [s.post for s in staged if s.buf is not s.user]
            post = _chain(*posts) if posts else None
            return _Plan([_op(None, None, splits=splits)], output_tensors, (ins, bufs_in, staged), post)

        return self._call(
            ALL_TO_ALL,
            _first(input_tensors),
            prepare,
            opts,
            gloo=lambda g: g.alltoall(output_tensors, input_tensors, opts),
            args=(output_tensors, input_tensors),
            what="all_to_all",
        )

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = _root(opts)

        def prepare(cuda: bool) -> _Plan:
            check = self._checker(cuda)
            inp = _one(input_tensors, "gather input", check).contiguous()
            # A rank other than the root passes its own input for the root-only side.
            flat, post = inp, None
            if self.rank() == root:
                outs = _rank_list(output_tensors, inp, self.size(), "gather", "gather_list", "input", "the root's ", check=check)
                flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
                post = _scatter_back(flat, outs)
            return _Plan([_op(inp, flat, root=root)], output_tensors, (inp, flat), post)

        return self._call(
            GATHER,
            _first(input_tensors),
            prepare,
            opts,
            gloo=lambda g: g.gather(output_tensors, input_tensors, opts),
            args=(output_tensors, input_tensors),
        )

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = _root(opts)

        def prepare(cuda: bool) -> _Plan:
            check = self._checker(cuda)
            s = _Staged(_one(output_tensors, "scatter output", check), copy_in=False)
            # A rank other than the root passes its own output for the root-only side.
            flat = s.buf
            if self.rank() == root:
                ins = _rank_list(input_tensors, s.user, self.size(), "scatter", "scatter_list", "output", "the root's ", check=check)
                flat = _flat_cat(ins).to(s.user.dtype)
            return _Plan([_op(flat, s.buf, root=root)], output_tensors, (flat, s), s.post)

        return self._call(
            SCATTER,
            _first(output_tensors),
            prepare,
            opts,
            gloo=lambda g: g.scatter(output_tensors, input_tensors, opts),
            args=(output_tensors, input_tensors),
        )

    def barrier(self, opts: Any = None) -> Any:
        if self._cuda_device is not None:
            # Like NCCL's barrier: every GPU reaches a device barrier, and this CPU waits
            # for its own, so all ranks' earlier work is done and every rank got here.
            stream = raw_stream(self._cuda_device)
            self._comm.run(BARRIER, 0, 0, 0, 0, UINT8, SUM, 0, stream, True)
            torch.cuda.current_stream(self._cuda_device).synchronize()
            self._comm.cuda_health()
            return DoneWork([])
        return self._call(BARRIER, None, lambda cuda: _Plan([_op(None, None)], []), opts, gloo=lambda g: g.barrier(opts))

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

        def prepare(cuda: bool) -> _Plan:
            t = _one(tensors, what, self._checker(cuda))
            if not isinstance(peer, int) or not 0 <= peer < self.size() or peer == self.rank():
                raise ArgumentError(f"{what} peer {peer} is invalid for rank {self.rank()} of a group of size {self.size()}")
            if send:
                c = t.contiguous()
                return _Plan([_op(c, None, root=peer, tag=tag)], tensors, (t, c))
            s = _Staged(t, copy_in=False)
            return _Plan([_op(None, s.buf, root=peer, tag=tag)], tensors, s, s.post)

        return self._call(
            SEND if send else RECV,
            _first(tensors),
            prepare,
            gloo=lambda g: getattr(g, what)(tensors, peer, tag),
            args=(tensors,),
            what=what,
        )

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
