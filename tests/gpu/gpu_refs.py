"""Inputs and references for the GPU tests.

Every rank makes its own random input on its GPU from the test's seed. The reference for
a result is computed from every rank's exact input, gathered through the reference group
(NCCL, or gloo on CPU copies where ranks share GPUs: `ref_call`), in
float64 (floats) or int64 (integers, cast back with two's-complement wrap-around); it is
compared chunk by chunk so that 1 GiB messages need no float64 copy of everything.

Tolerances. rsccl accumulates in float32 (float16/bfloat16 rounded once at the end) and
reduces in rank order, so its float result is within one ulp of the exact one, plus the
float32 rounding of partial sums. NCCL rounds to the element type at every step of its
ring or tree and in another order, so rsccl-vs-NCCL checks allow `world` ulps of the
partial sums. Integers, MIN, MAX and every data movement are compared bit for bit.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from refs import reduce_rows  # tests/refs.py: the CPU and GPU references reduce alike

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
RED = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "PRODUCT": dist.ReduceOp.PRODUCT,
}


def ops_for(dtype: torch.dtype) -> list[str]:
    """The ops of the main matrix. AVG on integers is tested on its own (test_integer_avg):
    the CPU engine rejects it, NCCL truncates toward zero, and a disagreement on it should
    fail one test, not every matrix."""
    return OPS if dtype.is_floating_point else [op for op in OPS if op != "AVG"]


# Relative spacing of neighbouring values (one ulp, at worst) per float type.
_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# Inputs are randn (|x| < ~5.5 over millions of samples): partial sums over `world` ranks
# stay below world * 5.5, whose float32 rounding is at most that times 2**-24 per step.
_F32_STEP = 5.5 * 2.0**-24
CHUNK = 1 << 25  # elements compared at a time


def rand(seed: int, rank: int, n: int, dtype: torch.dtype, op: str = "SUM", salt: str = "", device=None) -> torch.Tensor:
    """Rank `rank`'s input for one case (`salt` names the case), made on the current GPU.
    PRODUCT inputs stay near 1 (floats) or in ±{1, 2, 3} (integers) so products stay finite."""
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + rank * 7919 + zlib.crc32(salt.encode())) % (1 << 63))
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, device=device)
        return (1 + 0.01 * x if op == "PRODUCT" else x).to(dtype)
    if op == "PRODUCT":
        mag = torch.randint(1, 4, (n,), generator=g, device=device)
        sign = torch.randint(0, 2, (n,), generator=g, device=device) * 2 - 1
        return (mag * sign).to(dtype)
    return torch.randint(-100, 100, (n,), generator=g, device=device).to(dtype)


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


def reduce_ref(xs: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce rows of `xs` (one per rank): float64 for floats (not rounded), the input's
    integer type otherwise. Integer AVG truncates toward zero, as NCCL's does."""
    r = reduce_rows(xs.double() if xs.dtype.is_floating_point else xs.long(), op)
    return r if r.is_floating_point() else r.to(xs.dtype)


def _exact(dtype: torch.dtype, op: str) -> bool:
    return not dtype.is_floating_point or op in ("MIN", "MAX", "COPY")


def ref_tolerance(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(rtol, atol) of rsccl's result against the exact (float64) one."""
    return _ULP[dtype], world * world * _F32_STEP


def nccl_tolerance(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(rtol, atol) of rsccl's result against NCCL's: up to `world` roundings to the element
    type of partial sums a few units in magnitude, on NCCL's side."""
    return world * _ULP[dtype], 4 * world * _ULP[dtype] + 2 * world * world * _F32_STEP


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: got {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}"
    )
    if torch.equal(got, want):
        return
    g, w = got.reshape(-1), want.reshape(-1)
    bad = (g != w).nonzero().view(-1)
    i = bad[0].item()
    raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} elements differ; first at {i}: got {g[i].item()}, expected {w[i].item()}")


def _assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def check_reduction(ours: torch.Tensor, xs: torch.Tensor, op: str, what: str) -> None:
    """`ours` is the reduction `op` of the rows of `xs` (see module docstring)."""
    w = xs.shape[0]
    got = ours.reshape(-1)
    assert got.numel() == xs.shape[1], f"{what}: {got.numel()} elements, expected {xs.shape[1]}"
    for lo in range(0, got.numel(), CHUNK):
        hi = min(lo + CHUNK, got.numel())
        ref = reduce_ref(xs[:, lo:hi], op)
        where = f"{what} vs reference" + (f" (elements {lo}..{hi})" if lo or hi < got.numel() else "")
        if _exact(ours.dtype, op):
            assert_equal(got[lo:hi], ref.to(ours.dtype), where)
        else:
            _assert_close(got[lo:hi], ref, *ref_tolerance(ours.dtype, w), where)


def check_vs_nccl(ours: torch.Tensor, theirs: torch.Tensor, op: str, what: str, world: int) -> None:
    """`ours` matches NCCL's result `theirs` for the same inputs (op "COPY": data movement)."""
    got, want = ours.reshape(-1), theirs.reshape(-1)
    assert got.dtype == want.dtype and got.numel() == want.numel(), (
        f"{what}: {got.dtype}[{got.numel()}] vs NCCL's {want.dtype}[{want.numel()}]"
    )
    for lo in range(0, got.numel(), CHUNK):
        hi = min(lo + CHUNK, got.numel())
        where = f"{what} vs NCCL" + (f" (elements {lo}..{hi})" if lo or hi < got.numel() else "")
        if _exact(ours.dtype, op):
            assert_equal(got[lo:hi], want[lo:hi], where)
        else:
            _assert_close(got[lo:hi], want[lo:hi], *nccl_tolerance(ours.dtype, world), where)


def nccl_result(fn, *args, **kwargs) -> bool:
    """Run a call of the reference group (`ref_call`); False where it refuses it (so the check
    falls back to the float64/exact reference)."""
    try:
        ref_call(fn, *args, **kwargs)
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def assert_same_on_all_ranks(ctx, t: torch.Tensor, what: str) -> None:
    """`t` is bitwise identical on every rank (its bytes gathered through the reference group)."""
    b = t.contiguous().view(-1).view(torch.uint8)
    rows = torch.empty(ctx.world * b.numel(), dtype=torch.uint8, device=t.device)
    ref_call(dist.all_gather_into_tensor, rows, b, group=ctx.nccl)
    rows = rows.view(ctx.world, -1)
    for r in range(1, ctx.world):
        if not torch.equal(rows[r], rows[0]):
            n = (rows[r] != rows[0]).sum().item()
            raise AssertionError(f"{what}: rank {r}'s result differs from rank 0's in {n} bytes (must be bitwise identical)")


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


def rand_any(seed: int, rank: int, n: int, dtype: torch.dtype, salt: str = "", device=None) -> torch.Tensor:
    """`rand` for every dtype of MOVE_DTYPES: bool, uint8 and complex included. Any rank can
    make any other rank's input (same seed, rank and salt), which is how the data-movement
    tests build their exact reference without a collective."""
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + rank * 7919 + zlib.crc32(salt.encode())) % (1 << 63))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, device=device).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g, device=device).to(torch.uint8)
    if dtype.is_complex:
        return torch.randn(n, generator=g, device=device, dtype=dtype)
    return rand(seed, rank, n, dtype, salt=salt, device=device)


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
