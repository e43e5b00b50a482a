"""rsccl under real torch users: DDP (its C++ reducer calls the group and chains on Work
futures, with and without a comm hook), and a job launched by torchrun (env://)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from refs import assert_close


def body_ddp(ctx, seed: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    g = torch.Generator().manual_seed(seed + ctx.rank)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(3)]
    ours = DDP(model(), bucket_cap_mb=0.001)  # several buckets, so several all_reduces
    hooked = DDP(model(), bucket_cap_mb=0.001)
    hooked.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    ref = DDP(model(), process_group=ctx.gloo, bucket_cap_mb=0.001)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, hooked, ref)]
    for step, (x, y) in enumerate(batches):
        for m, o in zip((ours, hooked, ref), opts):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        for (name, a), b, c in zip(ours.named_parameters(), hooked.parameters(), ref.parameters()):
            assert_close(a.detach(), c.detach(), f"DDP step {step} {name}", ctx.world)
            assert_close(b.detach(), c.detach(), f"DDP+allreduce_hook step {step} {name}", ctx.world)


def test_ddp_matches_gloo(cluster4, seed):
    cluster4.run(body_ddp, seed)


JOB = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    import rsccl
    dist.init_process_group("rsccl")  # env:// from torchrun
    r, w = dist.get_rank(), dist.get_world_size()
    x = torch.full((1000,), float(r + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((1000,), w * (w + 1) / 2)), x
    assert dist.get_backend() == "rsccl"
    print(f"rank {r} of {w} ok", flush=True)
    dist.destroy_process_group()
    """
)


def test_torchrun_env_init(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(3):
        assert f"rank {r} of 3 ok" in out.stdout, out.stdout + out.stderr


EXIT_JOB = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import rsccl
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        # Many pending recvs whose futures have callbacks; then the script just ends.
        keep = []
        for i in range(200):
            t = torch.zeros(4)
            w = dist.irecv(t, 1, tag=1000 + i)
            keep.append((t, w, w.get_future().then(lambda f: sum(range(20000)))))
        store.set("r0", "1")
    else:
        store.wait(["r0"])
    """
)


def test_exit_with_pending_works_and_callbacks(tmp_path):
    """Interpreter exit fails the pending Works; their callbacks run before Python
    finalizes, never during (a thread entering Python then aborts the process)."""
    from harness import free_port

    script = tmp_path / "exit_job.py"
    script.write_text(EXIT_JOB)
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out


def body_many_blocked_callbacks(ctx, n: int) -> int:
    """More future callbacks blocked at once than any fixed thread pool would hold: each
    waits for a message that only arrives after all of them started."""
    if ctx.rank == 0:
        got = []

        def then(i):
            def cb(f):
                t = torch.empty(3)
                dist.recv(t, src=1, tag=2000 + i)
                return t

            return cb

        futs = []
        for i in range(n):
            t = torch.empty(3)
            futs.append(dist.irecv(t, 1, tag=1000 + i).get_future().then(then(i)))
        for f in futs:
            got.append(f.wait())
        for i, t in enumerate(got):
            assert torch.equal(t, torch.full((3,), float(i))), (i, t)
        return len(got)
    if ctx.rank == 1:
        for i in range(n):
            dist.send(torch.zeros(3), dst=0, tag=1000 + i)
        for i in range(n):
            dist.send(torch.full((3,), float(i)), dst=0, tag=2000 + i)
    return 0


def test_many_blocked_future_callbacks(cluster4):
    assert cluster4.run(body_many_blocked_callbacks, 40, timeout=120)[0] == 40
