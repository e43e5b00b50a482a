"""Plan building: what buffers, splits and packing a torch call uses, as pure functions of
its tensors (either device; no group, no Rust). The plan builders (_plans.py) check
torch's arguments with these, lay out the buffers each op reads and writes (`_op`), and
copy results back where torch expects them (`_Plan.post`); tests/test_cuda_layout.py and
tests/test_plan.py run them on CPU tensors without processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, overload

import torch

from ._ops import SUM, UINT8, ArgumentError, ErrorClass, dtype_code


def _buf(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def _check_same_dtype(what: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    """An output of another dtype than its input: a TypeError on either device (the core
    names the rank: the host engine's agreed error, Error::naming_rank on CUDA)."""
    if out.dtype != inp.dtype:
        raise ArgumentError(f"{what}: output dtype {out.dtype} differs from input dtype {inp.dtype}", ErrorClass.TYPE)


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}", ErrorClass.TYPE)
    if t.device.type != "cpu":
        raise ArgumentError(
            f"{what} is on {t.device}; rsccl takes CPU tensors, or CUDA tensors on the group's GPU "
            "(every tensor of one call on the same device)",
            ErrorClass.TYPE,
        )
    if t.is_sparse or t.layout != torch.strided:
        raise ArgumentError(f"{what} has layout {t.layout}; rsccl needs dense tensors", ErrorClass.TYPE)
    return t


Check = Callable[[Any, str], torch.Tensor]


def _one(tensors: Any, what: str, check: Check = _check_tensor) -> torch.Tensor:
    """torch's one-tensor list, its tensor checked by `check` (the call's side)."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        n = len(tensors) if isinstance(tensors, (list, tuple)) else "a non-list"
        raise ArgumentError(f"{what} takes exactly one tensor per rank, got {n}")
    return check(tensors[0], what)


class _Staged:
    """A contiguous view of `t` for the engine; copies back after completion if needed."""

    def __init__(self, t: torch.Tensor, copy_in: bool = True):
        self.user = t
        if t.is_contiguous():
            self.buf = t
        else:
            self.buf = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)

    def post(self) -> None:
        if self.buf is not self.user:
            self.user.copy_(self.buf)


def _check_cuda_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_cuda or t.layout != torch.strided:
        raise ArgumentError(
            f"{what} must be a dense CUDA tensor like the others, got {getattr(t, 'device', type(t).__name__)}", ErrorClass.TYPE
        )
    return t


def _rank_list(
    lists: Any,
    ref: torch.Tensor,
    size: int,
    what: str,
    list_name: str,
    ref_name: str,
    owner: str = "",
    check: Callable[[Any, str], torch.Tensor] = _check_tensor,
) -> list[torch.Tensor]:
    """Check torch's `[[t_0, ..., t_{size-1}]]` argument: one tensor per rank, each like
    `ref` (same dtype and element count). Returns the tensors."""
    if len(lists) != 1 or len(lists[0]) != size:
        raise ArgumentError(f"{what}: {owner}{list_name} must hold group size {size} tensors")
    ts = [check(t, f"{what} {list_name}") for t in lists[0]]
    for i, t in enumerate(ts):
        if t.numel() != ref.numel() or t.dtype != ref.dtype:
            raise ArgumentError(f"{what}: {list_name}[{i}] is {t.dtype}[{t.numel()}], {ref_name} is {ref.dtype}[{ref.numel()}]")
    return ts


@overload
def _split_bytes(t: torch.Tensor, splits: list[int], n: int, what: str) -> list[int]: ...
@overload
def _split_bytes(t: torch.Tensor, splits: list[int], n: int, what: None) -> list[int] | None: ...
def _split_bytes(t: torch.Tensor, splits: list[int], n: int, what: str | None) -> list[int] | None:
    """Bytes per peer of an all_to_all_single buffer: `splits` counts rows (dim 0) per peer,
    and an empty list splits the rows evenly. `what` starts the error message. With `what`
    None (the blocking fast path) anything but a valid split of a non-empty buffer is None:
    the full path checks it again and reports it."""
    rows = t.shape[0] if t.dim() > 0 else t.numel()
    row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
    problem: tuple[str, ErrorClass] | None = None
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in splits):
        problem = (f"split sizes {list(splits)} must be integers (rows per rank)", ErrorClass.TYPE)
    elif not splits and rows % n:
        problem = (f"has {rows} rows, not divisible by group size {n}", ErrorClass.VALUE)
    else:
        splits = list(splits) or [rows // n] * n
        if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
            problem = (f"split sizes {list(splits)} do not divide its {rows} rows among {n} ranks", ErrorClass.VALUE)
    if what is None:
        return None if problem is not None or rows == 0 else [s * row_bytes for s in splits]
    if problem is not None:
        raise ArgumentError(f"{what} {problem[0]}", problem[1])
    return [s * row_bytes for s in splits]


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may overlap (same storage): an all_to_all must not read what it
    writes, so such an input is copied first."""
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# Coalesced all_gather moves the bytes of inputs of any dtypes in one launch. One rank's
# block holds every input back to back, each starting 16-byte aligned, so that each input's
# slice of the gathered result can be viewed as its dtype again.
_ALIGN = 16


def _gather_layout(inputs: list[torch.Tensor]) -> tuple[list[int], int]:
    """(byte offset of each input in a rank's block, the block's bytes)."""
    offsets, total = [], 0
    for i in inputs:
        offsets.append(total)
        total += (i.numel() * i.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, total


def _pack_bytes(inputs: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor:
    """This rank's block: every input's bytes at its offset (padding left uninitialized)."""
    device = inputs[0].device if inputs else None
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    dsts = [flat[o : o + i.numel() * i.element_size()].view(i.dtype).view(i.shape) for o, i in zip(offsets, inputs)]
    if dsts:
        torch._foreach_copy_(dsts, list(inputs))
    return flat


def _gathered(flat_out: torch.Tensor, world: int, offsets: list[int], total: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per input k, a (world, numel_k) view of the gathered blocks: row r is rank r's input k."""
    rows = flat_out.view(world, total)
    return [rows[:, o : o + i.numel() * i.element_size()].view(i.dtype) for o, i in zip(offsets, inputs)]


def _reduce_scatter_pack(inputs: list[torch.Tensor], out_numels: list[int], world: int) -> torch.Tensor:
    """One reduce_scatter input for many: rank block r is every input's block r, back to
    back, so the reduced block of rank r splits into its outputs in order."""
    return torch.cat([i.reshape(world, m) for i, m in zip(inputs, out_numels)], dim=1).view(-1)


def _flat_cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)


class _CopyBack:
    """Outputs whose results land back to back in flat buffers, copied where torch expects
    them after completion in one `_foreach_copy_` (the coalesced calls, and the list forms
    of all_gather, gather and all_to_all on host memory)."""

    def __init__(self) -> None:
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []

    def add(self, flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
        off = 0
        for o in outs:
            self.dsts.append(o)
            self.srcs.append(flat[off : off + o.numel()].view(o.shape))
            off += o.numel()

    def post(self) -> Callable[[], None] | None:
        return (lambda: torch._foreach_copy_(self.dsts, self.srcs)) if self.dsts else None


def _scatter_back(flat: torch.Tensor, outs: list[torch.Tensor]) -> Callable[[], None] | None:
    back = _CopyBack()
    back.add(flat, outs)
    return back.post()


class _Plan:
    """What one torch call becomes: its ops (`_op`, in the order every rank makes them), the
    tensors to keep alive until they complete, the result torch's future reports, and the
    copy-back step."""

    def __init__(self, ops: list[Op], result: Any, keep: Any = None, post: Callable[[], None] | None = None):
        self.ops = ops
        self.result = result
        self.keep = keep
        self.post = post


class Op(NamedTuple):
    """One op's fields for Communicator.run, in its order: each side's address and bytes,
    the dtype code, the reduce op, the root (a send/recv's peer), an all_to_all's splits and
    a host send/recv's tag. The Rust core reads them on either device (collective/op.rs)."""

    inp: int
    inp_bytes: int
    out: int
    out_bytes: int
    dtype: int | str
    op: int | str
    root: int
    splits: tuple | None
    tag: int


def _op(
    inp: torch.Tensor | None,
    out: torch.Tensor | None,
    op: int | str = SUM,
    root: int = 0,
    splits: tuple | None = None,
    tag: int = 0,
) -> Op:
    """One op from contiguous tensors (None where a rank has no such side); its dtype is
    `inp`'s, else `out`'s."""
    i = _buf(inp) if inp is not None else (0, 0)
    o = _buf(out) if out is not None else (0, 0)
    t = inp if inp is not None else out
    return Op(i[0], i[1], o[0], o[1], dtype_code(t) if t is not None else UINT8, op, root, splits, tag)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view (or copy) of `t`: data movement needs no dtype."""
    c = t.contiguous().reshape(-1)
    return c.view(torch.uint8) if c.numel() else torch.empty(0, dtype=torch.uint8)


def _offsets(sizes: list[int]) -> list[int]:
    """Start of each piece of buffers laid out back to back."""
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def _chain(*posts: Callable[[], None] | None) -> Callable[[], None]:
    def post() -> None:
        for p in posts:
            if p is not None:
                p()

    return post


def _first_tensor(x: Any, depth: int = 0) -> torch.Tensor | None:
    """The first tensor in torch's argument nesting (a tensor, a list of them, a list of
    lists), depth first; None if there is none."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)) and depth < 3:
        for y in x:
            t = _first_tensor(y, depth + 1)
            if t is not None:
                return t
    return None
