"""FSDP2 with its communication buffers in rsccl's pool, where rsccl's collectives run in place.

    import rsccl.fsdp
    dist.init_process_group("rsccl", pg_options=rsccl.Options(cuda_pool_bytes="1GiB"))
    ...  # fully_shard every layer and the root
    rsccl.fsdp.use_pool(model)

`use_pool(model, group, comms)` sets it on every FSDP module of `model` (the setting is per
module, and covers that module's own parameters):

- comms="all_gather" (the default): only FSDP2's all-gather outputs come from the group's
  pool (`set_custom_all_gather` with `PoolAllGather`). Its reduce-scatter buffers and the
  float32 gradient shards, which FSDP2 keeps as views of the reduce-scatter outputs, come
  from torch's caching allocator, where that memory is shared with the activations, as
  under NCCL. Measured (4 H100s, 2026-11-28, docs/performance.md): 12 layers at d_model
  4096 reserved 19138 MiB at its peak, as NCCL's run did, where "both" reserved 19968.
- comms="both": the all-gather outputs and the reduce-scatter inputs and outputs
  (`set_allocate_memory_from_process_group_for_comm(True)`), and with them the gradient
  shards, which then stay in the pool until `zero_grad`: budget `parameters x 4 bytes /
  world size` more pool. A reduce_scatter from 64 MiB of input runs as a ring, which reads
  each rank's input only where it lives, so the large ones gain nothing in place.

docs/memory.md ("FSDP2") has the sizing. A pool that runs out is not an error: the
allocations that do not fit come from torch's allocator, with a warning, and those
collectives are staged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# The values of `use_pool`'s `comms`.
POOL_COMMS = ("all_gather", "both")


def _all_gather_base() -> type:
    # FSDP2's comm interface lives in a private module (torch 2.11 to 2.15 at least); FSDP
    # only calls its methods, so where the module moved a plain class does as well, and this
    # module still imports.
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    except ImportError:  # pragma: no cover - a torch that moved it
        return object
    return AllGather


class PoolAllGather(_all_gather_base()):  # type: ignore[misc]
    """FSDP2's all-gather with its output from the group backend's allocator when it offers
    one (supports_tensor_alloc: rsccl's pool), else torch.empty; the call itself is
    dist.all_gather_into_tensor, as FSDP's default."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.pool_allocations = 0  # outputs taken from the group's allocator

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self._group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            self.pool_allocations += 1
            numel = 1
            for s in size:
                numel *= int(s)
            return backend.allocate_tensor(numel, dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def use_pool(model: torch.nn.Module, group: Any = None, comms: str = "all_gather") -> None:
    """Give FSDP2's communication buffers of every FSDP module of `model` from `group`'s
    allocator: `comms` "all_gather" or "both", as the module's docstring says. `group` is
    the group FSDP2 shards over (the mesh's shard dimension; default: the world group); a
    buffer from another group's pool is still correct, but its collectives are staged, not
    in place. With "both", FSDP2 allocates from its own shard group and `group` is not used.
    Call it after fully_shard, before the first step."""
    from torch.distributed.fsdp import FSDPModule

    if comms not in POOL_COMMS:
        raise ValueError(f"rsccl.fsdp.use_pool: comms {comms!r}, expected one of {', '.join(POOL_COMMS)}")
    if group is None:
        group = dist.group.WORLD
    all_gather = PoolAllGather(group) if comms == "all_gather" else None
    found = False
    for m in model.modules():
        if isinstance(m, FSDPModule):
            found = True
            if all_gather is None:
                m.set_allocate_memory_from_process_group_for_comm(True)
            else:
                m.set_custom_all_gather(all_gather)
    if not found:
        raise ValueError("rsccl.fsdp.use_pool: the model has no FSDP module (call fully_shard on it first)")
