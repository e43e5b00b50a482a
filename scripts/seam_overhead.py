"""CPU cost of the Python part of a blocking CUDA all_reduce (ProcessGroupRsccl.allreduce),
with the Rust launch stubbed out: runs on a machine without a GPU, so a change to the seam
can be compared before and after (issue 14). The tensor is a CPU tensor dressed as a CUDA
one of the group's device; the launch and the stream query are no-ops.

    python scripts/seam_overhead.py [calls]
"""

import sys
import time

import rsccl._backend as backend
import torch
import torch.distributed as dist
from rsccl._ops import Route


class _Cuda(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = True


class _Launch:
    """Accepts the launch under either name (before and after the seam's change)."""

    def cuda_collective(self, *a):
        return None

    def run(self, *a):
        return None


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    backend.raw_stream = lambda device: 0
    pg = backend.ProcessGroupRsccl.__new__(backend.ProcessGroupRsccl)
    dist.ProcessGroup.__init__(pg, 0, 2)
    pg._comm = _Launch()
    pg._gloo = None
    pg._cuda_engine = Route.RSCCL
    pg._cuda_device = -1  # a CPU tensor's get_device()
    pg._done = backend.DoneWork([])
    pg._coalesced = None
    x = torch.randn(512).bfloat16().as_subclass(_Cuda)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    assert pg.allreduce([x], opts) is pg._done, "the fast path was not taken"
    best = []
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
        t0 = time.perf_counter()
        for _ in range(calls):
            pg.allreduce([x], opts)
        best.append((time.perf_counter() - t0) / calls * 1e6)
    print(
        f"pg.allreduce (blocking, CUDA fast path, launch stubbed): best {min(best):.3f} us, median {sorted(best)[len(best) // 2]:.3f} us per call"
    )


if __name__ == "__main__":
    main()
