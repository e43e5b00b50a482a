"""Reference arithmetic for the tests: inputs are made from a seed every rank can
recompute, so each rank knows every rank's input and computes the expected result in
float64 (floats) or int64 (integers, cast back with two's-complement wrap-around)."""

from __future__ import annotations

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


def make(seed: int, rank: int, n: int, dtype: torch.dtype, op: str = "SUM", salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s random input; PRODUCT inputs stay near 1 so products stay finite."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank * 7919 + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype in FLOATS:
        if op == "PRODUCT":
            x = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(n, generator=g, dtype=torch.float64) * 4
        return x.to(dtype)
    lo, hi = (-3, 4) if op == "PRODUCT" else ((0, 256) if dtype == torch.uint8 else (-100, 100))
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The expected result of reducing every rank's `xs[rank]` by `op`: in float64 or int64,
    then rounded (or wrapped) once to the inputs' dtype; bool by its truth table."""
    dtype = xs[0].dtype
    if dtype == torch.bool:
        b = torch.stack(xs).to(torch.int64)
        if op in ("SUM", "MAX", "BOR"):
            return b.amax(0).bool()
        if op in ("PRODUCT", "MIN", "BAND"):
            return b.amin(0).bool()
        return (b.sum(0) % 2).bool()
    wide = torch.float64 if dtype in FLOATS else torch.int64
    return reduce_rows(torch.stack([x.to(wide) for x in xs]), op).to(dtype)


BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def reduce_rows(s: torch.Tensor, op: str) -> torch.Tensor:
    """The rows of `s` (one per rank, float64 or int64) reduced by `op`, not rounded: AVG is
    the sum over the number of rows (integers truncate toward zero, as NCCL's does), the
    bitwise ops fold in rank order. The CPU and the GPU references both reduce here."""
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


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, n_inputs: int = 1) -> None:
    """Exact for integers and bool; for floats a bound that grows with the number of
    rounded additions (float16/bfloat16 accumulate in float32 and round once)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, f"{what}: {ours.dtype}{tuple(ours.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    if ref.dtype not in FLOATS:
        bad = (ours != ref).nonzero()
        assert bad.numel() == 0, (
            f"{what}: {bad.numel()} elements differ, first at {bad[0].tolist()}: {ours[bad[0]].tolist()} vs {ref[bad[0]].tolist()}"
        )
        return
    eps = {torch.float32: 1e-6, torch.float64: 1e-14, torch.float16: 1e-3, torch.bfloat16: 8e-3}[ref.dtype]
    tol = eps * max(n_inputs, 1) * 2
    torch.testing.assert_close(ours.to(torch.float64), ref.to(torch.float64), rtol=tol, atol=tol * 4, msg=lambda m: f"{what}: {m}")


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def gather_bytes(ctx, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of `t`, moved by gloo as raw bytes (exact for every dtype)."""
    b = bytes_of(t).reshape(-1)
    outs = [torch.empty_like(b) for _ in range(ctx.world)]
    dist.all_gather(outs, b, group=ctx.gloo)
    return outs


def assert_identical_across_ranks(ctx, t: torch.Tensor, what: str) -> None:
    allb = gather_bytes(ctx, t)
    for r, b in enumerate(allb):
        assert torch.equal(b, allb[0]), f"{what}: rank {r}'s result is not bitwise identical to rank 0's"
