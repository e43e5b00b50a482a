"""Reference arithmetic for the tests: inputs are made from a seed every rank can
recompute, so each rank knows every rank's input and computes the expected result in
float64 (floats) or int64 (integers, cast back with two's-complement wrap-around)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
}


def valid_ops(dtype: torch.dtype) -> list[str]:
    if dtype in FLOATS:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def make(seed: int, rank: int, n: int, dtype: torch.dtype, op: str = "SUM", salt: int | str = 0, device=None) -> torch.Tensor:
    """Rank `rank`'s random input for one case (`salt`, a number or a name, tells the cases
    apart), made on `device` (default the CPU): any rank can make any other rank's input.
    Floats are randn (|x| below ~5.5 over millions of samples, which the CUDA tolerance
    below relies on); PRODUCT inputs stay in [0.5, 1.5) (floats) or in ±{1, 2, 3} (integers)
    so products stay finite and every rank's factor counts. Integers are in [-100, 100)
    (uint8: any byte), bool 0/1, complex randn: every dtype data movement carries."""
    device = torch.device("cpu") if device is None else torch.device(device)
    s = salt if isinstance(salt, int) else zlib.crc32(salt.encode())
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + rank * 7919 + s) % (1 << 63))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, device=device).bool()
    if dtype.is_complex:
        return torch.randn(n, generator=g, device=device, dtype=dtype)
    if dtype.is_floating_point:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        if op == "PRODUCT":
            return torch.rand(n, generator=g, device=device, dtype=wide).add_(0.5).to(dtype)
        return torch.randn(n, generator=g, device=device, dtype=wide).to(dtype)
    if op == "PRODUCT":
        mag = torch.randint(1, 4, (n,), generator=g, device=device)
        return (mag * (torch.randint(0, 2, (n,), generator=g, device=device) * 2 - 1)).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (n,), generator=g, device=device).to(dtype)


def reduce_ref(xs: list[torch.Tensor] | torch.Tensor, op: str) -> torch.Tensor:
    """The exact result of reducing every rank's `xs[rank]` (a list, or a tensor of one row
    per rank) by `op`: float64 for floats, not rounded (`assert_close` allows for the
    rounding); integers in int64, wrapped (two's complement) to the inputs' dtype; bool by
    its truth table. MIN and MAX pick an input, so their float result is exact too."""
    dtype = xs[0].dtype
    s = xs if isinstance(xs, torch.Tensor) else torch.stack(list(xs))
    if dtype == torch.bool:
        b = s.to(torch.int64)
        if op in ("SUM", "MAX", "BOR"):
            return b.amax(0).bool()
        if op in ("PRODUCT", "MIN", "BAND"):
            return b.amin(0).bool()
        return (b.sum(0) % 2).bool()
    if dtype.is_floating_point:
        r = reduce_rows(s.to(torch.float64), op)
        return r.to(dtype) if op in ("MIN", "MAX") else r
    return reduce_rows(s.to(torch.int64), op).to(dtype)


BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def reduce_rows(s: torch.Tensor, op: str) -> torch.Tensor:
    """The rows of `s` (one per rank, float64 or int64) reduced by `op`, not rounded: AVG is
    the sum over the number of rows (integers truncate toward zero, as NCCL's does), the
    bitwise ops fold in rank order."""
    if op in ("SUM", "AVG"):
        r = s.sum(0)
        if op == "AVG":
            r = r / s.shape[0] if r.is_floating_point() else torch.div(r, s.shape[0], rounding_mode="trunc")
    elif op == "PRODUCT":
        r = s.prod(0)
    elif op == "MIN":
        r = s.amin(0)
    elif op == "MAX":
        r = s.amax(0)
    elif op in BITWISE:
        r = s[0].clone()
        for x in s[1:]:
            r = BITWISE[op](r, x)
    else:
        raise AssertionError(op)
    return r


# Float tolerances. The CPU engine accumulates float16/bfloat16 in float32 and rounds once;
# its bound is `eps` per rounded input, relative, and as much absolute (inputs are a few
# units). The CUDA engine accumulates in float32 in rank order and rounds once, so its result
# is within one ulp of the exact one plus the float32 rounding of partial sums: below
# n x 5.5 (randn inputs, `make`), at most that times 2**-24 per step, n steps.
_EPS = {torch.float32: 1e-6, torch.float64: 1e-14, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
F32_STEP = 5.5 * 2.0**-24
CHUNK = 1 << 25  # elements compared at a time: 1 GiB messages need no float64 copy of everything


def tolerance(dtype: torch.dtype, n_inputs: int, cuda: bool, roundings: int = 1) -> tuple[float, float]:
    """(rtol, atol) of an engine's reduction of `n_inputs` rounded inputs against the exact
    (float64) result: the CUDA engine's bound on CUDA tensors, the CPU engine's otherwise.
    `roundings` > 1: partial sums a few units in magnitude rounded to the element type up to
    that many times (a ring's hops: NCCL's, and the CUDA engine's ring schedule, NOTE [Ring]
    in csrc_kernels/ring.cuh)."""
    if cuda and dtype in ULP:
        if roundings > 1:
            return roundings * ULP[dtype], 4 * roundings * ULP[dtype] + 2 * n_inputs * n_inputs * F32_STEP
        return ULP[dtype], n_inputs * n_inputs * F32_STEP
    tol = _EPS[dtype] * max(n_inputs, 1) * 2
    return tol, tol


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit (same dtype and shape), naming the first element that differs."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: got {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}"
    )
    if torch.equal(got, want):
        return
    g, w = got.reshape(-1), want.reshape(-1)
    bad = (g != w).nonzero().view(-1)
    i = bad[0].item()
    raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} elements differ; first at {i}: got {g[i].item()}, expected {w[i].item()}")


def assert_close(
    ours: torch.Tensor, ref: torch.Tensor, what: str, n_inputs: int = 1, op: str = "SUM", tol: tuple[float, float] | None = None
) -> None:
    """`ours` against `ref`: bit for bit for data movement (`n_inputs` 1), integers, bool and
    MIN/MAX; a float reduction of `n_inputs` ranks' inputs against its exact reference
    (`reduce_ref`'s float64) within `tolerance`, or against another engine's result within
    `tol` (rtol, atol)."""
    exact = not ref.dtype.is_floating_point or n_inputs == 1 or op in ("MIN", "MAX")
    if exact:
        assert_equal(ours, ref.to(ours.dtype) if ref.dtype == torch.float64 and ours.dtype != ref.dtype else ref, what)
        return
    assert ours.shape == ref.shape and (ours.dtype == ref.dtype or ref.dtype == torch.float64), (
        f"{what}: {ours.dtype}{tuple(ours.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    )
    rtol, atol = tol if tol is not None else tolerance(ours.dtype, n_inputs, ours.is_cuda)
    got, want = ours.reshape(-1), ref.reshape(-1)
    for lo in range(0, got.numel(), CHUNK):
        hi = min(lo + CHUNK, got.numel())
        where = what + (f" (elements {lo}..{hi})" if lo or hi < got.numel() else "")
        torch.testing.assert_close(got[lo:hi].double(), want[lo:hi].double(), rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")


def check_reduction(ours: torch.Tensor, xs: list[torch.Tensor] | torch.Tensor, op: str, what: str, roundings: int = 1) -> None:
    """`ours` is the reduction `op` of every rank's input `xs[rank]` (`reduce_ref`), computed
    and compared chunk by chunk; `roundings`: see `tolerance`."""
    w = len(xs)
    rows = [x.reshape(-1) for x in xs]
    got = ours.reshape(-1)
    assert got.numel() == rows[0].numel(), f"{what}: {got.numel()} elements, expected {rows[0].numel()}"
    for lo in range(0, max(got.numel(), 1), CHUNK):
        hi = min(lo + CHUNK, got.numel())
        where = what + (f" (elements {lo}..{hi})" if lo or hi < got.numel() else "")
        tol = tolerance(got.dtype, w, got.is_cuda, roundings) if roundings > 1 and got.dtype.is_floating_point else None
        assert_close(got[lo:hi], reduce_ref([r[lo:hi] for r in rows], op), where, w, op, tol)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def assert_identical_across_ranks(ctx, t: torch.Tensor, what: str) -> None:
    """`t` is bitwise identical on every rank: its bytes gathered through the test harness's
    reference group (`ctx.gather_rows`: gloo on CPU, NCCL or gloo for CUDA tensors)."""
    rows = ctx.gather_rows(bytes_of(t))
    for r in range(1, ctx.world):
        if not torch.equal(rows[r], rows[0]):
            n = (rows[r] != rows[0]).sum().item()
            raise AssertionError(f"{what}: rank {r}'s result differs from rank 0's in {n} bytes (must be bitwise identical)")
