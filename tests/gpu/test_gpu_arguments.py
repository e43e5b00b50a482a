"""The argument table of tests/test_arguments.py on CUDA tensors (torch's default device
set to the rank's GPU while a case runs): the rank that passed the bad argument raises
the table's class naming it; the others raise a ValueError or TypeError naming that rank
(the kernels find the disagreement on the GPU, so a peer raises at the call or at the
group's next call, a barrier here); and the group works afterwards.

Not run in CI (no GPU there); on any number of GPUs (ranks share them where they
outnumber them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_harness import needs_gpus
from gpu_refs import gather_inputs, rand
from refs import check_reduction
from test_arguments import CASES

pytestmark = needs_gpus

# Cases that do not carry over to CUDA tensors, and why.
SKIP = {
    # A sparse tensor is a CPU-only construct here (broadcast takes it through host memory).
    "sparse_broadcast",
    # The good form is a bitwise all_reduce (BAND on int64), which rsccl's CUDA kernels do not
    # have (as NCCL has none): on CUDA every rank raises at once, naming itself, so the case
    # tests nothing of a disagreement. The refusal is checked in test_gpu_errors.
    "all_reduce_bitwise_op_on_floats",
}


def body_cuda_argument(ctx, case: str, bad_rank: int, seed: int) -> tuple[str, str]:
    good, bad, _, _ = CASES[case]
    result = ("no error", "")
    torch.set_default_device(ctx.device)
    try:
        # The table's calls use the default group (this module's own cluster, see below).
        for call in (lambda: (bad if ctx.rank == bad_rank else good)(ctx.rank), lambda: dist.barrier()):
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the parent inspects it
                if result[0] == "no error":
                    result = (type(e).__name__, str(e))
    finally:
        torch.set_default_device("cpu")
    x = rand(seed, ctx.rank, 4099, torch.float32, salt="after the bad argument")
    xs = gather_inputs(ctx, x)
    dist.all_reduce(x)
    check_reduction(x, xs, "SUM", f"all_reduce after {case}")
    return result


@pytest.mark.parametrize("case", sorted(set(CASES) - SKIP))
def test_bad_cuda_argument_is_named_on_every_rank(gpus3, case, seed):
    # The table (tests/test_arguments.py) is written for 3 ranks.
    gpus = gpus3
    bad_rank = seed % gpus.world
    kind = CASES[case][2]
    # A cluster of its own (options equal to the defaults, but a distinct key): a case that
    # broke the default group would not take the shared cluster down with it.
    results = gpus.with_options({"cuda_blocks": 64}).run(body_cuda_argument, case, bad_rank, seed, timeout=120)
    for r, (got, msg) in enumerate(results):
        if r == bad_rank:
            assert got == kind, f"{case}: the bad rank {r} raised {got}: {msg}"
        else:
            assert got in ("ValueError", "TypeError"), f"{case}: rank {r} raised {got}: {msg}"
        assert f"rank {bad_rank}" in msg, f"{case}: rank {r}'s message does not name rank {bad_rank}: {msg}"
