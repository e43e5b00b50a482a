"""One plan builder per collective: what a torch call becomes (its ops, in the order every
rank makes them, the tensors to keep, the result torch's future reports and the copy-back
step), as a pure function of torch's arguments and the group as a plan sees it (`Side`:
its size, this rank, the call's device and how that device checks a tensor). No group, no
Rust: the ProcessGroup's torch methods (_backend.py) pass one of these to their seam,
`_call`, and tests/test_plan.py runs them on CPU tensors without processes. Only the
layouts that differ by device branch on `side.cuda`; sizes, roots, peers and what an
engine reduces are the core's to check (collective/validate.rs, Group::run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ._ops import ArgumentError, ErrorClass
from ._plan import (
    Check,
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


class Side(NamedTuple):
    """The group as a plan sees it: its size, this rank, whether the call runs on CUDA, and
    how that side checks each tensor (`check(t, what)`: dense, on the call's device)."""

    size: int
    rank: int
    cuda: bool
    check: Check


def dtypes_of(tensors: Any) -> list[torch.dtype]:
    """The dtypes of a coalesced call, in order of first appearance: one op per dtype, a
    count every rank of a valid program agrees on, taken before any check so that a rank
    with a bad tensor counts the same."""
    return list(dict.fromkeys(t.dtype for t in tensors if isinstance(t, torch.Tensor)))


def _coalesced(
    groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    op: int | str,
    pack: Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor],
    in_place: bool,
) -> tuple[list[Any], list[Any], Callable[[], None] | None]:
    """The coalesced calls' one packing: per group of (inputs, outputs) of one dtype, one op.
    A group of one whose output is contiguous runs on its own tensors; any other reads its
    inputs packed into one buffer (`pack(inputs, outputs)`) and writes one flat buffer (the
    packed one itself when `in_place`), whose pieces are copied into the outputs after.
    Returns (ops, buffers to keep, copy-back step)."""
    ops, keep, back = [], [], _CopyBack()
    for ins, outs in groups:
        if len(outs) == 1 and outs[0].is_contiguous():
            flat_in, flat_out = ins[0].contiguous(), outs[0]
        else:
            flat_in = pack(ins, outs)
            flat_out = flat_in if in_place else torch.empty(sum(o.numel() for o in outs), dtype=flat_in.dtype, device=flat_in.device)
            back.add(flat_out, outs)
        ops.append(_op(flat_in, flat_out, op))
        keep.append((flat_in, flat_out))
    return ops, keep, back.post()


def _check_pairs(what: str, outputs: Any, inputs: Any) -> None:
    """A coalesced call's outputs and inputs pair up."""
    if len(outputs) != len(inputs):
        raise ArgumentError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")


def _check_blocks(what: str, side_name: str, whole: torch.Tensor, n: int, block: torch.Tensor) -> None:
    """The block-per-rank rule of one pair of a coalesced call, checked before it is packed:
    `whole` (its `side_name`) holds `n` blocks of `block`'s size. The core checks the same
    rule of a single call (collective/validate.rs `blocks_per_rank`)."""
    if whole.numel() != n * block.numel():
        raise ArgumentError(f"{what}: {side_name} has {whole.numel()} elements, expected {n} x {block.numel()}")


# -- reductions and broadcast, in place ------------------------------------------------------
def all_reduce(side: Side, tensors: Any, op: int | str) -> _Plan:
    s = _Staged(_one(tensors, "all_reduce", side.check))
    return _Plan([_op(s.buf, s.buf, op)], tensors, s, s.post)


def all_reduce_coalesced(side: Side, tensors: Any, dtypes: list[torch.dtype], op: int | str) -> _Plan:
    ts = [side.check(t, "all_reduce_coalesced") for t in tensors]
    groups = [([t for t in ts if t.dtype == dt],) * 2 for dt in dtypes]
    ops, keep, post = _coalesced(groups, op, lambda ins, _: _flat_cat(ins), in_place=True)
    return _Plan(ops, list(tensors), (ts, keep), post)


def broadcast(side: Side, tensors: Any, root: int) -> _Plan:
    s = _Staged(_one(tensors, "broadcast", side.check))
    return _Plan([_op(s.buf, s.buf, root=root)], tensors, s, s.post)


def reduce(side: Side, tensors: Any, op: int | str, root: int) -> _Plan:
    s = _Staged(_one(tensors, "reduce", side.check))
    return _Plan([_op(s.buf, s.buf, op, root)], tensors, s, s.post if side.rank == root else None)


# -- all_gather ------------------------------------------------------------------------------
def all_gather_into(side: Side, out: torch.Tensor, inp: torch.Tensor, result: Any) -> _Plan:
    """One all_gather of `inp` into `out` (group size inputs, rank-major); the core checks
    the sizes (the host engine, and `CudaCall::from_op` for the CUDA engines)."""
    side.check(out, "all_gather output")
    side.check(inp, "all_gather input")
    _check_same_dtype("all_gather", out, inp)
    i, s = inp.contiguous(), _Staged(out, copy_in=False)
    return _Plan([_op(i, s.buf)], result, (inp, i, s), s.post)


def all_gather(side: Side, output_tensors: Any, input_tensors: Any) -> _Plan:
    inp = _one(input_tensors, "all_gather input", side.check)
    outs = _rank_list(output_tensors, inp, side.size, "all_gather", "tensor_list", "input", check=side.check)
    flat = torch.empty(side.size * inp.numel(), dtype=inp.dtype, device=inp.device)
    plan = all_gather_into(side, flat, inp, output_tensors)
    plan.post = _scatter_back(flat, outs)
    return plan


def _all_gather_bytes(side: Side, what: str, inputs: list[torch.Tensor], outputs: list[Any], result: Any) -> _Plan:
    """All-gather many inputs of any dtypes in ONE op, moving bytes (see _gather_layout).
    `outputs[k]` receives input k of every rank: a tensor of world x numel_k elements,
    rank-major (all_gather_into_tensor), or a list of one tensor per rank
    (all_gather_coalesced)."""
    n, check = side.size, side.check
    _check_pairs(what, outputs, inputs)
    ins = [check(t, f"{what} input") for t in inputs]
    for k, (o, i) in enumerate(zip(outputs, ins)):
        per_rank = list(o) if isinstance(o, (list, tuple)) else None
        for x in per_rank if per_rank is not None else [o]:
            check(x, f"{what} output")
            _check_same_dtype(f"{what} #{k}", x, i)
        if per_rank is not None and (len(per_rank) != n or any(x.numel() != i.numel() for x in per_rank)):
            raise ArgumentError(f"{what} #{k}: give {n} outputs of {i.numel()} elements (one per rank)")
        if per_rank is None:
            _check_blocks(f"{what} #{k}", "output", o, n, i)
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


def all_gather_into_tensor_coalesced(side: Side, outputs: Any, inputs: Any) -> _Plan:
    if len(inputs) == 1 and len(outputs) == 1 and isinstance(outputs[0], torch.Tensor):
        return all_gather_into(side, outputs[0], inputs[0], list(outputs))
    return _all_gather_bytes(side, "all_gather_into_tensor_coalesced", list(inputs), list(outputs), list(outputs))


def all_gather_coalesced(side: Side, output_lists: Any, input_list: Any) -> _Plan:
    n = side.size
    if len(output_lists) != n or any(len(lst) != len(input_list) for lst in output_lists):
        raise ArgumentError(f"all_gather_coalesced: output_tensor_lists must hold {n} lists of {len(input_list)} tensors")
    per_input = [[output_lists[r][k] for r in range(n)] for k in range(len(input_list))]
    return _all_gather_bytes(side, "all_gather_coalesced", list(input_list), per_input, output_lists)


# -- reduce_scatter --------------------------------------------------------------------------
def reduce_scatter_into(side: Side, out: torch.Tensor, inp: torch.Tensor, op: int | str, result: Any) -> _Plan:
    """One reduce_scatter of `inp` (group size blocks) into `out`; the core checks the
    sizes (the host engine, and `CudaCall::from_op` for the CUDA engines)."""
    side.check(out, "reduce_scatter output")
    side.check(inp, "reduce_scatter input")
    _check_same_dtype("reduce_scatter", out, inp)
    i, s = inp.contiguous(), _Staged(out, copy_in=False)
    return _Plan([_op(i, s.buf, op)], result, (inp, i, s), s.post)


def reduce_scatter(side: Side, output_tensors: Any, input_tensors: Any, op: int | str) -> _Plan:
    out = _one(output_tensors, "reduce_scatter output", side.check)
    ins = _rank_list(input_tensors, out, side.size, "reduce_scatter", "input_list", "output", check=side.check)
    return reduce_scatter_into(side, out, _flat_cat(ins), op, output_tensors)


def reduce_scatter_tensor_coalesced(side: Side, outputs: Any, inputs: Any, dtypes: list[torch.dtype], op: int | str) -> _Plan:
    n, check, what = side.size, side.check, "reduce_scatter_tensor_coalesced"
    _check_pairs(what, outputs, inputs)
    for k, (o, i) in enumerate(zip(outputs, inputs)):
        check(o, "reduce_scatter output")
        check(i, "reduce_scatter input")
        _check_same_dtype(f"{what} #{k}", o, i)
        _check_blocks(f"{what} #{k}", "input", i, n, o)
    groups = []
    for dt in dtypes:
        pairs = [(i, o) for o, i in zip(outputs, inputs) if i.dtype == dt]
        groups.append(([i for i, _ in pairs], [o for _, o in pairs]))
    # Rank block r of the packed input is every input's block r, back to back; the
    # reduced block splits into the outputs in order.
    ops, keep, post = _coalesced(groups, op, lambda ins, outs: _reduce_scatter_pack(ins, [o.numel() for o in outs], n), in_place=False)
    return _Plan(ops, list(outputs), (inputs, outputs, keep), post)


# -- all_to_all ------------------------------------------------------------------------------
def all_to_all_single(side: Side, output: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any) -> _Plan:
    check, n = side.check, side.size
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


def all_to_all_single_fast(n: int, me: int, output: Any, input: Any, out_splits: Any, in_splits: Any) -> tuple | None:
    """all_to_all_single's fast path on CUDA, blocking or not, for the common case only: both
    buffers contiguous (on the group's GPU: the caller checked), one dtype, disjoint, valid
    splits, in a group of `n` ranks where this one is `me`. Returns the op's (inp,
    inp_bytes, out, out_bytes, splits), or None for anything else, which the full plan then
    checks and reports. Even splits (no split lists, the common case) take a few integer
    operations: this path costs an eager call microseconds otherwise (issue 27)."""
    if output.dtype != input.dtype or input.dim() == 0 or output.dim() == 0 or not input.is_contiguous() or not output.is_contiguous():
        return None
    ib, ob = input.nbytes, output.nbytes
    if not in_splits and not out_splits:
        # Rows divide evenly, so each peer's chunk is a 1/n of the bytes (rows_i / n rows of
        # ib / rows_i bytes each); a rank's own chunks are then equal on both sides when
        # the two buffers are of one size.
        if ib == 0 or ib != ob or input.shape[0] % n or output.shape[0] % n:
            return None
        chunk = ib // n
        send = recv = [chunk] * n
    else:
        send = _split_bytes(input, in_splits, n, None)
        recv = _split_bytes(output, out_splits, n, None)
        if send is None or recv is None or send[me] != recv[me]:
            return None
    ip, op = input.data_ptr(), output.data_ptr()
    if ip < op + ob and op < ip + ib:
        return None
    return ip, ib, op, ob, ([ip + o for o in _offsets(send)], send, [op + o for o in _offsets(recv)], recv)


def all_to_all(side: Side, output_tensors: Any, input_tensors: Any) -> _Plan:
    n, check = side.size, side.check
    if len(output_tensors) != n or len(input_tensors) != n:
        raise ArgumentError(f"all_to_all: expected {n} input and output tensors, got {len(input_tensors)} and {len(output_tensors)}")
    ins = [check(t, "all_to_all input") for t in input_tensors]
    outs = [check(t, "all_to_all output") for t in output_tensors]
    dts = {t.dtype for t in ins + outs}
    if len(dts) != 1:
        raise ArgumentError(f"all_to_all: tensors must share one dtype, got {sorted(map(str, dts))}", ErrorClass.TYPE)
    send = [t.numel() * t.element_size() for t in ins]
    recv = [t.numel() * t.element_size() for t in outs]
    if not side.cuda:
        # The host engine takes one buffer per side, its chunks back to back.
        flat_in = _flat_cat(ins).to(ins[0].dtype)
        flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
        splits = ([], send, [], recv)
        return _Plan([_op(flat_in, flat_out, splits=splits)], output_tensors, (flat_in, flat_out), _scatter_back(flat_out, outs))
    # The CUDA engines take a chunk per peer where it is: no flattening. An input that
    # shares storage with an output (in place) or is not contiguous is copied; a
    # non-contiguous output gets a contiguous stand-in, copied back after.
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


# -- rooted ----------------------------------------------------------------------------------
def gather(side: Side, output_tensors: Any, input_tensors: Any, root: int) -> _Plan:
    inp = _one(input_tensors, "gather input", side.check).contiguous()
    # A rank other than the root passes its own input for the root-only side.
    flat, post = inp, None
    if side.rank == root:
        outs = _rank_list(output_tensors, inp, side.size, "gather", "gather_list", "input", "the root's ", check=side.check)
        flat = torch.empty(side.size * inp.numel(), dtype=inp.dtype, device=inp.device)
        post = _scatter_back(flat, outs)
    return _Plan([_op(inp, flat, root=root)], output_tensors, (inp, flat), post)


def scatter(side: Side, output_tensors: Any, input_tensors: Any, root: int) -> _Plan:
    s = _Staged(_one(output_tensors, "scatter output", side.check), copy_in=False)
    # A rank other than the root passes its own output for the root-only side.
    flat = s.buf
    if side.rank == root:
        ins = _rank_list(input_tensors, s.user, side.size, "scatter", "scatter_list", "output", "the root's ", check=side.check)
        flat = _flat_cat(ins).to(s.user.dtype)
    return _Plan([_op(flat, s.buf, root=root)], output_tensors, (flat, s), s.post)


def barrier(side: Side) -> _Plan:
    return _Plan([_op(None, None)], [])


# -- point to point --------------------------------------------------------------------------
def send_recv(side: Side, tensors: Any, peer: Any, tag: int, send: bool) -> _Plan:
    """One send (`send`) or recv of torch's one-tensor list with `peer` (its root)."""
    t = _one(tensors, "send" if send else "recv", side.check)
    # The peer is the core's to check (collective/validate.rs `peer`, one message).
    if send:
        c = t.contiguous()
        return _Plan([_op(c, None, root=peer, tag=tag)], tensors, (t, c))
    s = _Staged(t, copy_in=False)
    return _Plan([_op(None, s.buf, root=peer, tag=tag)], tensors, s, s.post)
