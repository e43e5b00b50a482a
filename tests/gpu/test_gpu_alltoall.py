"""all_to_all_single and all_to_all on CUDA tensors, 2 and 4 GPUs: every dtype (bool, uint8,
float64 and complex included), even and uneven splits (random, with zeros; MoE-like: a few
large chunks among small ones), from 0 elements and 1 element per chunk to 64 MiB per rank,
on the default group and on the small-buffer group. Results are compared bit for bit with an
exact reference: every rank makes every other rank's input itself (same seed), so it knows
what it must receive; NCCL runs the same calls for a few cases. Also non-contiguous and
in-place buffers, the list form, an async Work waited on another stream, a CUDA graph
replayed on fresh data, splits that disagree across ranks and a rank whose splits do not add
up (every rank raises, the group works after)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from cases import CASES, a2a_expected, a2a_inputs, split_matrix
from gpu_harness import capture, case_call, needs_gpus, warm_up_aside
from gpu_refs import MOVE_DTYPES, Failures, rand, ref_call
from refs import assert_equal

pytestmark = needs_gpus

CONFIGS = ["default", "small-buffer"]
COLS = 3  # elements per row: split sizes count rows, and 3 x 2 bytes is not a multiple of 16
MiB = 1 << 20


def inputs_of(seed: int, salt: str, s: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input (rows x COLS), made here: rank i's row block j goes to rank j."""
    return [rand(seed, i, sum(s[i]) * COLS, dtype, salt=salt).view(-1, COLS) for i in range(len(s))]


def body_all_to_all_single(ctx, seed: int, config: str, cases: list[tuple[str, int]], dtypes: list[torch.dtype]) -> int:
    f = Failures()
    checks = 0
    for dtype in dtypes:
        for kind, rows in cases:
            what = f"all_to_all_single {kind} rows={rows} {dtype} world={ctx.world} group={config}"
            # The case's call and its check against the exact result, recorded, not raised.
            if (
                f.run(what, CASES["all_to_all_single"], ctx, seed, case_call(ctx, config, what, dtype, COLS, rows=rows, splits=kind))
                is not None
            ):
                checks += 1
    torch.cuda.synchronize()
    f.done()
    return checks


# (split kind, rows per chunk): 0 rows everywhere; 1 row; odd; ~1 MiB of float32 per chunk.
SPLITS = [("even", 0), ("even", 1), ("even", 1023), ("uneven", 37), ("uneven", 30_001), ("moe", 90_001)]


@pytest.mark.parametrize("config", CONFIGS)
def test_all_to_all_single(gpus, seed, config):
    checks = gpus.run(body_all_to_all_single, seed, config, SPLITS, MOVE_DTYPES, timeout=300)
    assert min(checks) == len(SPLITS) * len(MOVE_DTYPES)


def body_large_and_nccl(ctx, seed: int) -> None:
    """64 MiB per rank (float32, even and MoE-like) against the reference, and the same calls
    on NCCL: every rank makes every NCCL call, whatever rsccl did."""
    w, me = ctx.world, ctx.rank
    f = Failures()
    rows = (64 * MiB // 4 // COLS) // w
    for kind, dtype in (("even", torch.float32), ("moe", torch.bfloat16), ("uneven", torch.int64)):
        what = f"large all_to_all_single {kind} {dtype} world={w}"
        c = case_call(ctx, "default", what, dtype, COLS, rows=rows if kind != "uneven" else 100_000, splits=kind)
        ours = f.run(what, CASES["all_to_all_single"], ctx, seed, c)  # against the exact result
        s, xs = a2a_inputs(ctx, seed, c)
        x = xs[me]
        del xs
        splits = (None, None) if kind == "even" else ([s[i][me] for i in range(w)], s[me])
        theirs = torch.zeros(sum(s[i][me] for i in range(w)), COLS, dtype=dtype, device=ctx.device)
        ref_call(dist.all_to_all_single, theirs, x, *splits, group=ctx.nccl)
        if ours is not None:
            f.run(f"{what} vs NCCL", assert_equal, ours, theirs, f"{what} vs NCCL")
        del x, ours, theirs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    f.done()


def test_large_against_nccl(gpus, seed):
    gpus.run(body_large_and_nccl, seed, timeout=240)


def body_views_list_async(ctx, seed: int) -> None:
    """Non-contiguous input and output, in place (output is input), the list form (one
    tensor per peer, of its own size, one of them non-contiguous), and an async Work issued
    on a side stream whose input is written there behind a GPU sleep, waited on the current
    stream."""
    w, me = ctx.world, ctx.rank
    f = Failures()
    what = "all_to_all_single on strided views"
    s = split_matrix(seed, what, w, "uneven", 500)
    xs = inputs_of(seed, what, s, torch.bfloat16)
    wide_in = torch.zeros(sum(s[me]), 2 * COLS, dtype=torch.bfloat16, device=ctx.device)
    wide_in[:, ::2] = xs[me]
    n_out = sum(s[i][me] for i in range(w))
    wide_out = torch.full((n_out, 2 * COLS), 5, dtype=torch.bfloat16, device=ctx.device)
    view_in, view_out = wide_in[:, ::2], wide_out[:, ::2]
    # (An empty view counts as contiguous: an uneven split may give a rank no rows.)
    assert all(v.numel() == 0 or not v.is_contiguous() for v in (view_in, view_out))
    f.run(what, dist.all_to_all_single, view_out, view_in, [s[i][me] for i in range(w)], s[me])
    f.run(what, assert_equal, view_out, a2a_expected(xs, s, me), what)
    f.run(
        what,
        assert_equal,
        wide_out[:, 1::2],
        torch.full((n_out, COLS), 5, dtype=torch.bfloat16, device=ctx.device),
        f"{what}: elements between the view's changed",
    )

    what = "all_to_all_single in place"
    s = split_matrix(seed, what, w, "even", 4097)
    xs = inputs_of(seed, what, s, torch.float32)
    x = xs[me].clone()
    f.run(what, dist.all_to_all_single, x, x)
    f.run(what, assert_equal, x, a2a_expected(xs, s, me), what)

    what = "all_to_all (list)"
    s = split_matrix(seed, what, w, "uneven", 3000)
    xs = inputs_of(seed, what, s, torch.int32)
    ins = list(xs[me].split(s[me]))
    outs = [torch.empty(s[i][me], COLS, dtype=torch.int32, device=ctx.device) for i in range(w)]
    strided_home = torch.zeros(COLS, s[w - 1][me], dtype=torch.int32, device=ctx.device)
    outs[w - 1] = strided_home.t()  # the last peer's block lands in a transposed view
    f.run(what, dist.all_to_all, outs, ins)
    want = a2a_expected(xs, s, me).split([s[i][me] for i in range(w)])
    for i in range(w):
        f.run(what, assert_equal, outs[i], want[i], f"{what}: block from rank {i}")

    what = "async all_to_all_single on a side stream"
    s = split_matrix(seed, what, w, "moe", 200_000)
    xs = inputs_of(seed, what, s, torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.zeros_like(xs[me])
        torch.cuda._sleep(50_000_000)  # ~25 ms: a collective that does not wait for this stream reads zeros
        x.copy_(xs[me])
        out = torch.zeros(sum(s[i][me] for i in range(w)), COLS, dtype=torch.float16, device=ctx.device)
        work = f.run(what, dist.all_to_all_single, out, x, [s[i][me] for i in range(w)], s[me], async_op=True)
    if work is not None:
        f.run(what, work.wait)
        got = out.clone()  # on the current stream: ordered after the collective by wait() alone
        torch.cuda.synchronize()
        f.run(what, assert_equal, got, a2a_expected(xs, s, me), what)
    torch.cuda.synchronize()
    f.done()


def test_views_in_place_list_and_async(gpus, seed):
    gpus.run(body_views_list_async, seed, timeout=120)


def body_graph(ctx, seed: int) -> None:
    """all_to_all_single (uneven) and all_to_all captured in one CUDA graph, replayed on fresh data."""
    w, me = ctx.world, ctx.rank
    f = Failures()
    s = split_matrix(seed, "graph", w, "uneven", 20_000)
    x = torch.zeros(sum(s[me]), COLS, dtype=torch.float32, device=ctx.device)
    out = torch.zeros(sum(s[i][me] for i in range(w)), COLS, dtype=torch.float32, device=ctx.device)
    lst_in = [torch.zeros(100 + i, dtype=torch.int64, device=ctx.device) for i in range(w)]
    lst_out = [torch.zeros(100 + me, dtype=torch.int64, device=ctx.device) for _ in range(w)]
    out_splits, in_splits = [s[i][me] for i in range(w)], s[me]

    def calls() -> None:
        dist.all_to_all_single(out, x, out_splits, in_splits)
        dist.all_to_all(lst_out, lst_in)

    warm_up_aside(lambda: f.run("warm-up", calls))
    if not f.items:
        graph = capture(calls)
        for rep in range(3):
            what = f"graph replay {rep}"
            xs = inputs_of(seed, what, s, torch.float32)
            x.copy_(xs[me])
            for i in range(w):
                lst_in[i].copy_(rand(seed, me, 100 + i, torch.int64, salt=f"{what} to {i}"))
            graph.replay()
            torch.cuda.synchronize()
            f.run(what, assert_equal, out, a2a_expected(xs, s, me), f"{what}: all_to_all_single")
            for i in range(w):
                f.run(
                    what,
                    assert_equal,
                    lst_out[i],
                    rand(seed, i, 100 + me, torch.int64, salt=f"{what} to {me}"),
                    f"{what}: all_to_all from rank {i}",
                )
    torch.cuda.synchronize()
    f.done()


def test_cuda_graph(gpus, seed):
    gpus.run(body_graph, seed, timeout=120)


def _own_group():
    return dist.new_group(backend="rsccl", timeout=timedelta(seconds=15))


def _still_works(ctx, g, seed: int) -> str:
    """'' if an uneven all_to_all_single on `g` gives the right result, else why not."""
    s = split_matrix(seed, "after the error", ctx.world, "uneven", 1000)
    xs = inputs_of(seed, "after the error", s, torch.float32)
    out = torch.empty(sum(s[i][ctx.rank] for i in range(ctx.world)), COLS, device=ctx.device)
    try:
        dist.all_to_all_single(out, xs[ctx.rank], [s[i][ctx.rank] for i in range(ctx.world)], s[ctx.rank], group=g)
        assert_equal(out, a2a_expected(xs, s, ctx.rank), "all_to_all_single on the group after the error")
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        return f"{type(e).__name__}: {e}"
    return ""


def body_errors(ctx, seed: int, case: str) -> tuple[str, str, str]:
    """case "disagree": rank 1 expects 3 rows (12 bytes of float32) from rank 0, which sends
    it 2 (8 bytes); every rank's own splits add up. case "bad-splits": rank 1's input split
    sizes do not add up to its rows. Every rank must raise; the group works after."""
    g = _own_group()
    w, me = ctx.world, ctx.rank
    x = rand(seed, me, 2 * w, torch.float32, salt=case)
    in_splits, out_splits = [2] * w, [2] * w
    if me == 1 and case == "disagree":
        out_splits[0] = 3
    if me == 1 and case == "bad-splits":
        in_splits[0] = 3
    out = torch.empty(sum(out_splits), device=ctx.device)
    # Every rank makes the same calls whatever raised: a rank with bad arguments raises at
    # once, the others when the GPU reports it (here, or at the group's next call).
    errors = []
    for call in (lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=g), lambda: dist.barrier(group=g)):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the parent inspects it
            errors.append(e)
    result = (type(errors[0]).__name__, str(errors[0])) if errors else ("no error", "")
    after = _still_works(ctx, g, seed)
    dist.destroy_process_group(g)
    return (*result, after)


@pytest.mark.parametrize("case", ["disagree", "bad-splits"])
def test_errors_raise_on_every_rank(gpus, seed, case):
    results = gpus.run(body_errors, seed, case, timeout=120)
    for rank, (kind, msg, after) in enumerate(results):
        assert kind in ("ValueError", "TypeError", "RuntimeError"), f"rank {rank} raised {kind}: {msg}"
        assert "rank 1" in msg, f"rank {rank}'s message does not name rank 1: {msg}"
        if case == "disagree":
            # The ranks that disagree, and what each passed (in bytes: 2 rows vs 3 rows of float32).
            assert "rank 0" in msg and "8" in msg and "12" in msg, f"rank {rank}: {msg}"
        assert after == "", f"rank {rank}: the group does not work after the error: {after}"
