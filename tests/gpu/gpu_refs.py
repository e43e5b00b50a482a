"""The GPU suite's side of the references: the reference group and the suite's matrix.

The arithmetic (inputs, exact results, tolerances, comparisons) is tests/refs.py's, the same
for every suite. What is the GPU suite's own: its matrix of dtypes and ops, `rand` (refs'
`make` on this rank's GPU), and the reference group (NCCL, or gloo on CPU copies where ranks
share GPUs: `ref_call`) through which every rank's input is gathered (`gather_inputs`) and
rsccl's result is compared with NCCL's (`check_vs_nccl`).

NCCL rounds to the element type at every step of its ring or tree and in another order than
rsccl, so rsccl-vs-NCCL checks allow `world` ulps of the partial sums (`nccl_tolerance`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from refs import OPS as RED  # noqa: F401 - the ReduceOp of each op name, for the GPU tests
from refs import ULP, assert_close, make, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]


def ops_for(dtype: torch.dtype) -> list[str]:
    """The ops of the main matrix. AVG on integers is tested on its own (test_integer_avg):
    the CPU engine rejects it, NCCL truncates toward zero, and a disagreement on it should
    fail one test, not every matrix."""
    return OPS if dtype.is_floating_point else [op for op in OPS if op != "AVG"]


# dtypes that data movement (all_to_all, send/recv, gathers) must carry bit for bit.
MOVE_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def rand(seed: int, rank: int, n: int, dtype: torch.dtype, op: str = "SUM", salt: str = "", device=None) -> torch.Tensor:
    """refs.make on this rank's GPU (or `device`): any rank makes any rank's input."""
    return make(seed, rank, n, dtype, op, salt, device if device is not None else torch.device("cuda", torch.cuda.current_device()))


def refill(inputs: dict[str, torch.Tensor], seed: int, rank: int, what: str, i: int) -> dict[str, torch.Tensor]:
    """Fresh random data (`rand`, salted "{what} {name} {i}") into each static input of a
    captured graph, for its i-th replay; returns what was written, by name."""
    fresh = {}
    for name, t in inputs.items():
        fresh[name] = rand(seed, rank, t.numel(), t.dtype, salt=f"{what} {name} {i}")
        t.copy_(fresh[name])
    return fresh


def ref_call(fn, *args, group, **kwargs):
    """The reference's `fn(*args, group=group, **kwargs)` (a torch.distributed call): as it is
    on an NCCL group; on a gloo group (ranks that share GPUs, where NCCL cannot run) on CPU
    copies of every CUDA tensor argument, whose results are then copied back into them, so
    the caller sees the same in-place effect."""
    if dist.get_backend(group) != "gloo":
        return fn(*args, group=group, **kwargs)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def to_cpu(a):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            c = a.detach().cpu()
            staged.append((a, c))
            return c
        if isinstance(a, (list, tuple)):
            return type(a)(to_cpu(v) for v in a)
        return a

    out = fn(*[to_cpu(a) for a in args], group=group, **{k: to_cpu(v) for k, v in kwargs.items()})
    for a, c in staged:
        a.copy_(c)
    return out


def gather_inputs(ctx, x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape on every rank), through the reference group: shape
    (world, x.numel())."""
    flat = x.contiguous().view(-1)
    out = torch.empty(ctx.world * flat.numel(), dtype=x.dtype, device=x.device)
    ref_call(dist.all_gather_into_tensor, out, flat, group=ctx.nccl)
    return out.view(ctx.world, -1)


def nccl_tolerance(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(rtol, atol) of rsccl's result against NCCL's: up to `world` roundings to the element
    type of partial sums a few units in magnitude, on NCCL's side."""
    return tolerance(dtype, world, True, world)


def check_vs_nccl(ours: torch.Tensor, theirs: torch.Tensor, op: str, what: str, world: int) -> None:
    """`ours` matches NCCL's result `theirs` for the same inputs (op "COPY": data movement)."""
    got, want = ours.reshape(-1), theirs.reshape(-1)
    assert got.dtype == want.dtype and got.numel() == want.numel(), (
        f"{what}: {got.dtype}[{got.numel()}] vs NCCL's {want.dtype}[{want.numel()}]"
    )
    tol = nccl_tolerance(ours.dtype, world) if ours.dtype in ULP else None
    assert_close(got, want, f"{what} vs NCCL", 1 if op == "COPY" else world, op, tol)


def nccl_result(fn, *args, **kwargs) -> bool:
    """Run a call of the reference group (`ref_call`); False where it refuses it (so the check
    falls back to the float64/exact reference)."""
    try:
        ref_call(fn, *args, **kwargs)
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


class Failures:
    """Checks that record instead of raising, for bodies that mix rsccl and NCCL calls: a rank
    that raised before an NCCL call would leave its peers waiting there forever, so every
    rank makes every call, and `done()` raises once, at the end, with everything that failed."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def run(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None (recorded) if it raised."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - recorded, raised by done()
            self.items.append(f"{what}: {type(e).__name__}: {e}")
            return None

    def done(self) -> None:
        if self.items:
            more = f"\n... and {len(self.items) - 20} more" if len(self.items) > 20 else ""
            raise AssertionError(f"{len(self.items)} checks failed:\n" + "\n".join(self.items[:20]) + more)
