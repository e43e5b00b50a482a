"""What torch's own distributed suite and torch's tools expect of a backend, beyond the
collectives themselves (scripts/torch_suite.py runs that suite; these are the same
behaviours on random data, fast): recv from any source, sparse all_reduce, torch's
timeout wording with group and global ranks, torch.profiler events, and the backend
entry point of torch >= 2.15 (init_process_group("rsccl") without `import rsccl`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import subprocess
import sys
import tomllib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_TIMEOUT_RE = " (Timed out|closed|timeout) "  # what torch's tests match (distributed_test.py)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def body_recv_any_source(ctx, seed: int) -> list[tuple[int, int]]:
    """Every rank but 0 sends rank 0 one message per tag (tags 1 and 2; random data, one
    random size per tag); rank 0 receives them from any source, tag 2 first, half with
    dist.recv and half with irecv: each message arrives once, whole, with its sender named.
    Then a recv with a named sender still works beside them."""
    g = torch.Generator().manual_seed(seed)
    size = {tag: int(torch.randint(1, 70_000, (1,), generator=g)) for tag in (1, 2)}
    data = {
        (r, t): torch.randn(size[t], generator=torch.Generator().manual_seed(seed + 7 * r + t)) for r in range(1, ctx.world) for t in (1, 2)
    }
    got = []
    if ctx.rank == 0:
        for tag in (2, 1):  # the other order than sent: matching is by tag
            for i in range(1, ctx.world):
                buf = torch.full((size[tag],), float("nan"))
                if i % 2:
                    src = dist.recv(buf, tag=tag)
                else:
                    w = dist.irecv(buf, tag=tag)
                    w.wait()
                    src = w._source_rank()
                assert torch.equal(buf, data[(src, tag)]), f"message from rank {src} with tag {tag} differs (seed {seed})"
                got.append((src, tag))
        x = torch.empty(3)
        dist.recv(x, src=ctx.world - 1, tag=9)
        assert torch.equal(x, torch.arange(3.0) + ctx.world - 1)
    else:
        for tag in (1, 2):
            dist.send(data[(ctx.rank, tag)], 0, tag=tag)
        if ctx.rank == ctx.world - 1:
            dist.send(torch.arange(3.0) + ctx.rank, 0, tag=9)
    dist.barrier()
    return got


def test_recv_from_any_source(cluster, seed):
    res = cluster.run(body_recv_any_source, seed)
    assert sorted(res[0]) == sorted((r, t) for r in range(1, cluster.world) for t in (1, 2)), res


def body_sparse_all_reduce(ctx, seed: int) -> int:
    """Sum of random sparse COO tensors (overlapping indices, 1-D and 2-D values, one rank
    with none) against gloo's and a dense float64 reference; identical on every rank."""
    checks = 0
    for shape, dense_dims in (((50,), 0), ((40, 30), 1), ((20, 6, 3), 1)):
        g = torch.Generator().manual_seed(seed * 31 + ctx.rank)
        sparse_dims = len(shape) - dense_dims
        nnz = 0 if ctx.rank == 1 else int(torch.randint(1, 25, (1,), generator=g))
        idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dims)])
        vals = torch.randn((nnz, *shape[sparse_dims:]), generator=g)
        mine = torch.sparse_coo_tensor(idx, vals, shape, check_invariants=True)
        ours, theirs = mine.clone(), mine.clone()
        dist.all_reduce(ours)
        dist.all_reduce(theirs, group=ctx.gloo)
        dense = mine.to_dense().double()
        dist.all_reduce(dense, group=ctx.gloo)
        assert ours.is_sparse, "the result must stay sparse"
        torch.testing.assert_close(ours.to_dense(), theirs.to_dense(), msg=f"sparse {shape} vs gloo (seed {seed})")
        # float32 sums against the float64 reference: float32 tolerances.
        torch.testing.assert_close(ours.to_dense(), dense.float(), rtol=1e-5, atol=1e-5, msg=f"sparse {shape} vs float64 (seed {seed})")
        every = [torch.empty(0)] * ctx.world
        dist.all_gather_object(every, ours.to_dense(), group=ctx.gloo)
        assert all(torch.equal(every[0], e) for e in every), "ranks differ"
        checks += 1
    with pytest.raises(TypeError, match="sparse tensor takes ReduceOp.SUM"):
        dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True), op=dist.ReduceOp.MAX)
    return checks


def test_sparse_all_reduce_like_gloo(cluster, seed):
    assert cluster.run(body_sparse_all_reduce, seed) == [3] * cluster.world


def body_subgroup_timeout(ctx) -> str:
    """In a subgroup of the last two ranks, the last one never joins a barrier: the other's
    TimeoutError follows torch's wording and names group and global ranks."""
    ranks = [ctx.world - 2, ctx.world - 1]
    sub = dist.new_group(ranks, timeout=timedelta(seconds=1.5))
    msg = ""
    if ctx.rank == ranks[0]:
        try:
            dist.barrier(group=sub)
        except TimeoutError as e:
            msg = str(e)
    elif ctx.rank == ranks[1]:
        import time

        time.sleep(3)
    dist.barrier(group=ctx.gloo)
    dist.destroy_process_group(sub)
    return msg


def test_timeout_wording_names_group_and_global_ranks():
    from harness import Cluster

    c = Cluster(3, init_timeout=30.0)
    try:
        msg = c.run(body_subgroup_timeout, timeout=60)[1]
        assert re.search(TORCH_TIMEOUT_RE, msg), f"torch's tests would not see a timeout in: {msg}"
        assert "group rank 0 (global rank 1): Timed out after 1.5 s in barrier" in msg, msg
        assert "waiting for group rank 1 (global rank 2) (pid" in msg, msg
    finally:
        c.close()


def body_profiler_events(ctx, seed: int) -> list[str]:
    """One async "rsccl:<collective>" event per call, with the input shapes, under both
    torch profilers, for blocking and asynchronous calls and for send/recv."""
    g = torch.Generator().manual_seed(seed + ctx.rank)
    shape = (3, int(torch.randint(2, 9, (1,), generator=torch.Generator().manual_seed(seed))), 4)
    x = torch.randn(shape, generator=g)
    seen = []
    for prof in (
        torch.autograd.profiler.profile(record_shapes=True),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True),
    ):
        with prof:
            dist.all_reduce(x)
            dist.all_reduce(x, async_op=True).wait()
            out = torch.empty(ctx.world * x.numel())
            dist.all_gather_into_tensor(out, x)
            if ctx.rank == 0:
                dist.send(x, 1)
            elif ctx.rank == 1:
                dist.recv(x, 0)
        events = prof.function_events if isinstance(prof, torch.autograd.profiler.profile) else prof.events()
        ours = [e for e in events if e.name.startswith("rsccl:")]
        names = sorted(e.name for e in ours)
        want = ["rsccl:all_gather_into_tensor", "rsccl:all_reduce", "rsccl:all_reduce"]
        want += ["rsccl:send"] if ctx.rank == 0 else ["rsccl:recv"] if ctx.rank == 1 else []
        assert names == sorted(want), names
        for e in ours:
            assert e.is_async, f"{e.name} is not async"
            assert e.input_shapes == [list(shape)], (e.name, e.input_shapes)
        seen += names
    return seen


def test_profiler_events_like_gloo(cluster, seed):
    cluster.run(body_profiler_events, seed)


def _init_without_import(rank: int, world: int, port: int, seed: int, q) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        assert "rsccl" not in sys.modules
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world)
        gloo = dist.new_group(backend="gloo")
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed + rank))
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        torch.testing.assert_close(a, b)
        q.put((rank, dist.get_backend(), type(dist.group.WORLD).__name__))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


@pytest.mark.skipif(_torch_version() < (2, 15), reason="torch < 2.15 has no entry-point discovery of backends: `import rsccl` registers it")
def test_init_process_group_without_import(seed):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_init_without_import, args=(r, 2, port, seed, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert res == [(0, "rsccl", "ProcessGroupRsccl"), (1, "rsccl", "ProcessGroupRsccl")], res


def test_installed_torch_is_in_the_declared_range():
    """pyproject.toml declares the torch versions rsccl is tested with; CI runs both ends."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("torch"))
    lo = re.search(r">=\s*(\d+)\.(\d+)", spec)
    hi = re.search(r"<\s*(\d+)\.(\d+)", spec)
    assert lo and hi, spec
    v = _torch_version()
    assert (int(lo[1]), int(lo[2])) <= v < (int(hi[1]), int(hi[2])), f"torch {torch.__version__} is outside {spec}"
    # The README states the same range.
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"torch {lo[1]}.{lo[2]}" in f.read(), "README.md must name the supported torch range"


def test_quickstart_runs_clean():
    """The first thing a newcomer runs: no warning (torch warns without numpy), every check ok."""
    r = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", os.path.join(ROOT, "examples", "quickstart.py"), "--world-size", "2", "--cpu-only"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Warning" not in r.stderr and "NumPy" not in r.stderr, r.stderr
    assert "all collectives matched gloo" in r.stdout, r.stdout
