"""torch's collective and point-to-point methods of rsccl's ProcessGroup (a mixin of
ProcessGroupRsccl, _backend.py). Each method routes: CUDA tensors to the CUDA calls
(_cuda_calls.py), everything else to a host plan (_plan.py) run through the group's one
seam (`_run`/`_host` in _backend.py, then Communicator.run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._cuda import (
    REDUCE_DTYPES,
    REDUCE_OPS,
    raw_stream,
)
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
    _check_cuda_tensor,
    _check_same_dtype,
    _check_tensor,
    _flat_cat,
    _gather_layout,
    _gathered,
    _one,
    _pack_bytes,
    _Plan,
    _raiser,
    _rank_list,
    _scatter_back,
    _split_bytes,
    _Staged,
)
from ._work import DoneWork, RecvAnyWork, RsWork

# (dtype, op code) -> dtype code, for every combination rsccl's CUDA kernels reduce.
_FAST_ALLREDUCE = {
    (dt, OP_CODES[name]): DTYPE_CODES[dt] for dt in REDUCE_DTYPES for name in REDUCE_OPS if name != "AVG" or dt.is_floating_point
}


class Collectives:
    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        op = op_code(opts.reduceOp) if opts is not None else SUM
        if len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return self._sparse_allreduce(tensors, op, opts)
        if len(tensors) == 1 and self._cuda_ok(tensors[0]):
            t = tensors[0]
            # The blocking call's fast path: nothing to check beyond this, nothing to keep.
            dt = _FAST_ALLREDUCE.get((t.dtype, op))
            if dt is not None and opts is not None and opts.asyncOp is False and t.get_device() == self._cuda_device and t.is_contiguous():
                p, nbytes = t.data_ptr(), t.nbytes
                self._comm.run(ALL_REDUCE, p, nbytes, p, nbytes, dt, op, 0, raw_stream(self._cuda_device), True)
                return self._done
            return self._cuda_allreduce(t, op, opts)

        def prepare() -> _Plan:
            s = _Staged(_one(tensors, "all_reduce"))
            return _Plan([lambda b: self._host(ALL_REDUCE, s.buf, s.buf, b, op)], tensors, s, s.post)

        return self._run("all_reduce", lambda g: g.allreduce(tensors, opts), prepare, opts=opts, args=(tensors,))

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str, opts: Any) -> Any:
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
        counts = torch.empty(n, dtype=torch.int64)
        mine = torch.tensor([idx.shape[1]], dtype=torch.int64)
        self._host(ALL_GATHER, mine, counts, True)
        # Pad every rank's entries to the largest count: all_gather moves equal blocks.
        m = int(counts.max())
        pad_idx = torch.zeros((idx.shape[0], m), dtype=idx.dtype)
        pad_idx[:, : idx.shape[1]] = idx
        pad_vals = torch.zeros((m, *vals.shape[1:]), dtype=vals.dtype)
        pad_vals[: vals.shape[0]] = vals
        parts_i, parts_v = [], []
        if m > 0:
            gathered = []
            for x in (pad_idx, pad_vals):
                b = _as_bytes(x)
                out = torch.empty(n * b.numel(), dtype=torch.uint8)
                self._host(ALL_GATHER, b, out, True)
                gathered.append(out.view(n, -1))
            for r in range(n):
                k = int(counts[r])
                parts_i.append(gathered[0][r].view(idx.dtype).view(idx.shape[0], m)[:, :k])
                parts_v.append(gathered[1][r].view(vals.dtype).view(m, *vals.shape[1:])[:k])
        else:
            parts_i, parts_v = [idx], [vals]
        total = torch.sparse_coo_tensor(torch.cat(parts_i, dim=1), torch.cat(parts_v), local.shape, check_invariants=True).coalesce()
        with torch.no_grad():
            t.copy_(total.to(t.device))
        return DoneWork(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        op = op_code(opts.reduceOp) if opts is not None else SUM
        if tensors and self._cuda_ok(tensors[0]):
            return self._noted(self._cuda_allreduce_coalesced(list(tensors), op, opts))
        # Ops per dtype present: a count every rank of a valid program agrees on.
        dtypes = list(dict.fromkeys(t.dtype for t in tensors if isinstance(t, torch.Tensor)))

        def prepare() -> _Plan:
            ts = [_check_tensor(t, "all_reduce_coalesced") for t in tensors]
            submits, keep, posts = [], [], []
            # One engine operation per dtype, over that dtype's tensors flattened together.
            for dt in dtypes:
                group = [t for t in ts if t.dtype == dt]
                flat = _flat_cat(group).to(dt)
                submits.append(lambda b, flat=flat: self._host(ALL_REDUCE, flat, flat, b, op))
                keep.append(flat)
                posts.append(_scatter_back(flat, group))
            return _Plan(submits, tensors, keep, _chain(*posts))

        return self._noted(
            self._run("all_reduce", lambda g: g.allreduce_coalesced(tensors, opts), prepare, len(dtypes), opts=opts, args=(tensors,))
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0
        if len(tensors) == 1 and self._cuda_ok(tensors[0]):
            return self._cuda_broadcast(tensors[0], root, opts)

        def prepare() -> _Plan:
            s = _Staged(_one(tensors, "broadcast"))
            return _Plan([lambda b: self._host(BROADCAST, s.buf, s.buf, b, root=root)], tensors, s, s.post)

        return self._run("broadcast", lambda g: g.broadcast(tensors, opts), prepare, opts=opts, args=(tensors,))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0
        op = op_code(opts.reduceOp) if opts is not None else SUM
        if len(tensors) == 1 and self._cuda_ok(tensors[0]):
            return self._cuda_reduce(tensors[0], root, op, opts)

        def prepare() -> _Plan:
            s = _Staged(_one(tensors, "reduce"))
            post = s.post if self.rank() == root else None
            return _Plan([lambda b: self._host(REDUCE, s.buf, s.buf, b, op, root)], tensors, s, post)

        return self._run("reduce", lambda g: g.reduce(tensors, opts), prepare, opts=opts, args=(tensors,))

    def _all_gather_one(self, out: torch.Tensor, inp: torch.Tensor) -> tuple[Callable[[bool], Any], Any, Callable[[], None] | None]:
        _check_tensor(out, "all_gather output")
        inp = _check_tensor(inp, "all_gather input").contiguous()
        _check_same_dtype("all_gather", out, inp)
        s = _Staged(out, copy_in=False)
        return (lambda b: self._host(ALL_GATHER, inp, s.buf, b)), (inp, s), s.post

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RsWork:
        if self._cuda_ok(input):
            return self._cuda_all_gather(output, input, opts, [output])

        def prepare() -> _Plan:
            submit, keep, post = self._all_gather_one(output, input)
            return _Plan([submit], [output], keep, post)

        return self._run(
            "all_gather",
            lambda g: g._allgather_base(output, input, opts),
            prepare,
            opts=opts,
            args=(
                output,
                input,
            ),
        )

    all_gather_single = _allgather_base

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        if len(input_tensors) == 1 and self._cuda_ok(input_tensors[0]):
            inp = input_tensors[0]
            try:
                outs = _rank_list(output_tensors, inp, self.size(), "all_gather", "tensor_list", "input", check=_check_cuda_tensor)
                if any(t.device != inp.device for t in outs):
                    raise ArgumentError(
                        f"all_gather: rank {self.rank()} passed tensor_list tensors on devices other than the input's {inp.device}"
                    )
            except ArgumentError as e:
                return self._cuda(ALL_GATHER, _raiser(e), opts, None)
            flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
            return self._cuda_all_gather(flat, inp, opts, output_tensors, _scatter_back(flat, outs))

        def prepare() -> _Plan:
            inp = _one(input_tensors, "all_gather input")
            outs = _rank_list(output_tensors, inp, self.size(), "all_gather", "tensor_list", "input")
            flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
            submit, keep, _ = self._all_gather_one(flat, inp)
            return _Plan([submit], output_tensors, keep, _scatter_back(flat, outs))

        return self._run(
            "all_gather",
            lambda g: g.allgather(output_tensors, input_tensors, opts),
            prepare,
            opts=opts,
            args=(
                output_tensors,
                input_tensors,
            ),
        )

    def _gather_bytes(self, pairs: list[tuple[list[torch.Tensor], torch.Tensor]]) -> _Plan:
        """All-gather many inputs of any dtypes in ONE engine operation, moving bytes:
        rank r's block of the result holds its inputs' bytes at aligned offsets; `pairs`
        gives, per input, the tensors (one per rank, in rank order) to fill."""
        n = self.size()
        ins = [_check_tensor(i, "all_gather input") for _, i in pairs]
        for k, (outs, i) in enumerate(pairs):
            for o in outs:
                _check_tensor(o, "all_gather output")
                if o.dtype != i.dtype or o.numel() != i.numel():
                    raise ArgumentError(f"all_gather (coalesced) #{k}: output is {o.dtype}[{o.numel()}], input {i.dtype}[{i.numel()}]")
        # The layout and packing of the CUDA path (_gather_layout): one way to pack.
        offsets, total = _gather_layout(ins)
        flat_in = _pack_bytes(ins, offsets, total)
        flat_out = torch.empty(n * total, dtype=torch.uint8)

        def post() -> None:
            for (outs, _), rows in zip(pairs, _gathered(flat_out, n, offsets, total, ins)):
                for r, o in enumerate(outs):
                    o.copy_(rows[r].view(o.shape))

        submit = lambda b: self._host(ALL_GATHER, flat_in, flat_out, b)
        return _Plan([submit], None, (flat_in, flat_out), post)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> RsWork:
        if inputs and self._cuda_ok(inputs[0]):
            if len(inputs) == 1 and len(outputs) == 1 and isinstance(outputs[0], torch.Tensor):
                return self._noted(self._cuda_all_gather(outputs[0], inputs[0], opts, list(outputs)))
            return self._noted(
                self._cuda_gather_bytes("all_gather_into_tensor_coalesced", list(inputs), list(outputs), opts, list(outputs))
            )

        def prepare() -> _Plan:
            if len(outputs) != len(inputs):
                raise ArgumentError(f"all_gather_into_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
            pairs = []
            for k, (o, i) in enumerate(zip(outputs, inputs)):
                _check_tensor(o, "all_gather output")
                if o.numel() != self.size() * i.numel():
                    raise ArgumentError(
                        f"all_gather_into_tensor_coalesced #{k}: output has {o.numel()} elements, expected {self.size()} x {i.numel()}"
                    )
                pairs.append((list(o.reshape(-1).chunk(self.size())) if i.numel() else [o.reshape(-1)[:0]] * self.size(), i))
            plan = self._gather_bytes(pairs)
            # Chunks of a non-contiguous output are copies: write them back.
            views = [(o, p[0]) for o, p in zip(outputs, pairs)]
            inner = plan.post

            def post() -> None:
                inner()
                for o, chunks in views:
                    if o.data_ptr() != chunks[0].data_ptr() or not o.is_contiguous():
                        o.copy_(torch.cat(chunks).view(o.shape))

            plan.post, plan.result = post, outputs
            return plan

        return self._noted(
            self._run(
                "all_gather",
                lambda g: g.allgather_into_tensor_coalesced(outputs, inputs, opts),
                prepare,
                opts=opts,
                args=(
                    outputs,
                    inputs,
                ),
            )
        )

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None) -> RsWork:
        if input_list and self._cuda_ok(input_list[0]):
            n = self.size()
            if len(output_lists) != n or any(len(lst) != len(input_list) for lst in output_lists):
                e = ArgumentError(f"all_gather_coalesced: rank {self.rank()} must pass {n} output lists of {len(input_list)} tensors")
                return self._cuda_launches(ALL_GATHER, _raiser(e), 1, opts, None)
            per_input = [[output_lists[r][k] for r in range(n)] for k in range(len(input_list))]
            return self._cuda_gather_bytes("all_gather_coalesced", list(input_list), per_input, opts, output_lists)

        def prepare() -> _Plan:
            n = self.size()
            if len(output_lists) != n or any(len(lst) != len(input_list) for lst in output_lists):
                raise ArgumentError(f"all_gather_coalesced: output_tensor_lists must hold {n} lists of {len(input_list)} tensors")
            plan = self._gather_bytes([([output_lists[r][k] for r in range(n)], i) for k, i in enumerate(input_list)])
            plan.result = output_lists
            return plan

        return self._run(
            "all_gather",
            lambda g: g.allgather_coalesced(output_lists, input_list, opts),
            prepare,
            opts=opts,
            args=(
                output_lists,
                input_list,
            ),
        )

    def _reduce_scatter_one(
        self, out: torch.Tensor, inp: torch.Tensor, op: str
    ) -> tuple[Callable[[bool], Any], Any, Callable[[], None] | None]:
        _check_tensor(out, "reduce_scatter output")
        inp = _check_tensor(inp, "reduce_scatter input").contiguous()
        _check_same_dtype("reduce_scatter", out, inp)
        s = _Staged(out, copy_in=False)
        return (lambda b: self._host(REDUCE_SCATTER, inp, s.buf, b, op)), (inp, s), s.post

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RsWork:
        op = op_code(opts.reduceOp) if opts is not None else SUM
        if self._cuda_ok(input):
            return self._cuda_reduce_scatter(output, input, op, opts, [output])

        def prepare() -> _Plan:
            submit, keep, post = self._reduce_scatter_one(output, input, op)
            return _Plan([submit], [output], keep, post)

        return self._run(
            "reduce_scatter",
            lambda g: g._reduce_scatter_base(output, input, opts),
            prepare,
            opts=opts,
            args=(
                output,
                input,
            ),
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> RsWork:
        op = op_code(opts.reduceOp) if opts is not None else SUM
        if len(output_tensors) == 1 and self._cuda_ok(output_tensors[0]):
            out = output_tensors[0]
            try:
                ins = _rank_list(input_tensors, out, self.size(), "reduce_scatter", "input_list", "output", check=_check_cuda_tensor)
                if any(t.device != out.device for t in ins):
                    raise ArgumentError(
                        f"reduce_scatter: rank {self.rank()} passed input_list tensors on devices other than the output's {out.device}"
                    )
            except ArgumentError as e:
                return self._cuda(REDUCE_SCATTER, _raiser(e), opts, None)
            flat = torch.cat([t.reshape(-1) for t in ins])
            return self._cuda_reduce_scatter(out, flat, op, opts, output_tensors)

        def prepare() -> _Plan:
            out = _one(output_tensors, "reduce_scatter output")
            ins = _rank_list(input_tensors, out, self.size(), "reduce_scatter", "input_list", "output")
            submit, keep, post = self._reduce_scatter_one(out, _flat_cat(ins), op)
            return _Plan([submit], output_tensors, keep, post)

        return self._run(
            "reduce_scatter",
            lambda g: g.reduce_scatter(output_tensors, input_tensors, opts),
            prepare,
            opts=opts,
            args=(
                output_tensors,
                input_tensors,
            ),
        )

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> RsWork:
        op = op_code(opts.reduceOp) if opts is not None else SUM
        if inputs and self._cuda_ok(inputs[0]):
            return self._noted(self._cuda_reduce_scatter_coalesced(list(outputs), list(inputs), op, opts))
        # From the inputs only, so a rank whose output is wrong still counts the same ops.
        one_dtype = len({getattr(t, "dtype", None) for t in inputs}) <= 1

        def prepare() -> _Plan:
            n = self.size()
            if len(outputs) != len(inputs):
                raise ArgumentError(f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
            for k, (o, i) in enumerate(zip(outputs, inputs)):
                _check_tensor(o, "reduce_scatter output")
                _check_tensor(i, "reduce_scatter input")
                _check_same_dtype(f"reduce_scatter_tensor_coalesced #{k}", o, i)
                if i.numel() != n * o.numel():
                    raise ArgumentError(f"reduce_scatter_tensor_coalesced #{k}: input has {i.numel()} elements, expected {n} x {o.numel()}")
            if not one_dtype:
                done = [self._reduce_scatter_one(o, i, op) for o, i in zip(outputs, inputs)]
                return _Plan([d[0] for d in done], outputs, [d[1] for d in done], _chain(*[d[2] for d in done]))
            # One engine operation: rank block r of the combined input is every input's
            # block r, back to back; the combined output splits into the outputs.
            blocks = [i.reshape(n, -1) for i in inputs]
            flat_in = torch.cat(blocks, dim=1).reshape(-1) if blocks else torch.empty(0)
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=flat_in.dtype)
            submit = lambda b: self._host(REDUCE_SCATTER, flat_in, flat_out, b, op)
            return _Plan([submit], outputs, (flat_in, flat_out), _scatter_back(flat_out, list(outputs)))

        n_ops = 1 if one_dtype else len(inputs)
        return self._noted(
            self._run(
                "reduce_scatter",
                lambda g: g.reduce_scatter_tensor_coalesced(outputs, inputs, opts),
                prepare,
                n_ops,
                opts=opts,
                args=(
                    outputs,
                    inputs,
                ),
            )
        )

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None
    ) -> RsWork:
        if self._on_cuda(input, "all_to_all_single"):
            if opts is not None and opts.asyncOp is False and self._a2a_fast(output, input, output_split_sizes, input_split_sizes):
                return self._done
            return self._cuda_alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

        def prepare() -> _Plan:
            out = _check_tensor(output, "all_to_all output")
            inp = _check_tensor(input, "all_to_all input").contiguous()
            _check_same_dtype("all_to_all", out, inp)
            n = self.size()
            send = _split_bytes(inp, list(input_split_sizes), n, "all_to_all: input")
            recv = _split_bytes(out, list(output_split_sizes), n, "all_to_all: output")
            s = _Staged(out, copy_in=False)
            submit = lambda b: self._host(ALL_TO_ALL, inp, s.buf, b, splits=([], send, [], recv))
            return _Plan([submit], [output], (inp, s), s.post)

        return self._run(
            "all_to_all",
            lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            prepare,
            opts=opts,
            args=(
                output,
                input,
                output_split_sizes,
                input_split_sizes,
            ),
        )

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        if input_tensors and self._on_cuda(input_tensors[0], "all_to_all"):
            return self._cuda_alltoall(list(output_tensors), list(input_tensors), opts)

        def prepare() -> _Plan:
            n = self.size()
            if len(output_tensors) != n or len(input_tensors) != n:
                raise ArgumentError(
                    f"all_to_all: expected {n} input and output tensors, got {len(input_tensors)} and {len(output_tensors)}"
                )
            ins = [_check_tensor(t, "all_to_all input") for t in input_tensors]
            outs = [_check_tensor(t, "all_to_all output") for t in output_tensors]
            dts = {t.dtype for t in ins + outs}
            if len(dts) != 1:
                raise ArgumentError(f"all_to_all: tensors must share one dtype, got {sorted(map(str, dts))}", ErrorClass.TYPE)
            flat_in = _flat_cat(ins).to(ins[0].dtype)
            flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
            send = [t.numel() * t.element_size() for t in ins]
            recv = [t.numel() * t.element_size() for t in outs]
            submit = lambda b: self._host(ALL_TO_ALL, flat_in, flat_out, b, splits=([], send, [], recv))
            return _Plan([submit], output_tensors, (flat_in, flat_out), _scatter_back(flat_out, outs))

        return self._run(
            "all_to_all",
            lambda g: g.alltoall(output_tensors, input_tensors, opts),
            prepare,
            opts=opts,
            args=(
                output_tensors,
                input_tensors,
            ),
        )

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0
        if len(input_tensors) == 1 and self._cuda_ok(input_tensors[0]):
            return self._cuda_gather(output_tensors, input_tensors[0], root, opts)

        def prepare() -> _Plan:
            inp = _one(input_tensors, "gather input").contiguous()
            flat, post = None, None
            if self.rank() == root:
                outs = _rank_list(output_tensors, inp, self.size(), "gather", "gather_list", "input", "the root's ")
                flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
                post = _scatter_back(flat, outs)
            submit = lambda b: self._host(GATHER, inp, flat, b, root=root)
            return _Plan([submit], output_tensors, (inp, flat), post)

        return self._run(
            "gather",
            lambda g: g.gather(output_tensors, input_tensors, opts),
            prepare,
            opts=opts,
            args=(
                output_tensors,
                input_tensors,
            ),
        )

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> RsWork:
        root = opts.rootRank if opts is not None else 0
        if len(output_tensors) == 1 and self._cuda_ok(output_tensors[0]):
            return self._cuda_scatter(output_tensors[0], input_tensors, root, opts)

        def prepare() -> _Plan:
            s = _Staged(_one(output_tensors, "scatter output"), copy_in=False)
            flat = None
            if self.rank() == root:
                ins = _rank_list(input_tensors, s.user, self.size(), "scatter", "scatter_list", "output", "the root's ")
                flat = _flat_cat(ins).to(s.user.dtype)
            submit = lambda b: self._host(SCATTER, flat, s.buf, b, root=root)
            return _Plan([submit], output_tensors, (flat, s), s.post)

        return self._run(
            "scatter",
            lambda g: g.scatter(output_tensors, input_tensors, opts),
            prepare,
            opts=opts,
            args=(
                output_tensors,
                input_tensors,
            ),
        )

    def barrier(self, opts: Any = None) -> RsWork:
        if self._cuda_device is not None:
            # Like NCCL's barrier: every GPU reaches a device barrier, and this CPU waits
            # for its own, so all ranks' earlier work is done and every rank got here.
            stream = raw_stream(self._cuda_device)
            self._comm.run(BARRIER, 0, 0, 0, 0, UINT8, SUM, 0, stream, True)
            torch.cuda.current_stream(self._cuda_device).synchronize()
            self._comm.cuda_health()
            return DoneWork([])
        return self._run("barrier", lambda g: g.barrier(opts), lambda: _Plan([lambda b: self._host(BARRIER, None, None, b)], []), opts=opts)

    # -- point to point ----------------------------------------------------------------
    def _p2p(self, tensors: list[torch.Tensor], peer: int, tag: int, send: bool) -> RsWork:
        what = "send" if send else "recv"
        if self._gloo is not None:
            if any(getattr(t, "is_cuda", False) for t in tensors):
                raise TypeError(
                    f"rsccl: rank {self.rank()}: {what} of a list that mixes CPU and CUDA tensors in a group that spans hosts: "
                    "give one CUDA tensor (NCCL) or CPU tensors (gloo)"
                )
            return getattr(self._gloo, what)(tensors, peer, tag)
        try:
            t = _one(tensors, what)
        except ArgumentError as e:
            raise e.to_raise() from None
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"rsccl: {what} peer {peer} is invalid for rank {self.rank()} of a group of size {self.size()}")
        # Tags past 64 bits are clamped so that the engine refuses them (with this clamped
        # value in its message) and tells the peer, as it does any tag out of 0..2^31-1.
        tag = max(min(int(tag), 2**63 - 1), -(2**63))
        if send:
            c = t.contiguous()
            return RsWork([self._comm.run(SEND, *_buf(c), 0, 0, dtype_code(c), SUM, peer, None, False, None, tag)], tensors, c)
        s = _Staged(t, copy_in=False)
        return RsWork([self._comm.run(RECV, 0, 0, *_buf(s.buf), dtype_code(s.buf), SUM, peer, None, False, None, tag)], tensors, s, s.post)

    # torch calls these for dist.send/recv/isend/irecv, and batch_isend_irecv calls
    # isend/irecv one by one for a ProcessGroup subclass. On CUDA tensors the tag is ignored,
    # as NCCL ignores it: messages between two ranks match in order.
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> RsWork:
        if isinstance(tensors, (list, tuple)) and tensors and self._on_cuda(tensors[0], "send"):
            return self._cuda_p2p(tensors, dstRank, True)
        return self._p2p(tensors, dstRank, tag, True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> RsWork:
        if isinstance(tensors, (list, tuple)) and tensors and self._on_cuda(tensors[0], "recv"):
            return self._cuda_p2p(tensors, srcRank, False)
        return self._p2p(tensors, srcRank, tag, False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> RsWork:
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
