"""rsccl: a torch.distributed backend with a Rust core.

``import rsccl`` registers the backend "rsccl" (torch >= 2.15 also finds it through the
``torch.distributed.backends`` entry point, without the import); then
``torch.distributed.init_process_group("rsccl")`` runs collectives on CPU tensors through
shared memory among ranks of one host (gloo across hosts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _rsccl
from ._backend import ProcessGroupRsccl, create, rsccl_group
from ._report import memory_report
from ._rsccl import GroupAbortedError, PeerFailureError
from .options import Options

__version__ = _rsccl.__version__
__all__ = [
    "Options",
    "ProcessGroupRsccl",
    "PeerFailureError",
    "GroupAbortedError",
    "mem_pool",
    "memory_stats",
    "memory_report",
    "settings_table",
    "register",
]


def register() -> None:
    """Register the backend "rsccl" with torch.distributed (done at import; idempotent).
    torch >= 2.15 calls it through the `torch.distributed.backends` entry point when a
    program names "rsccl" without importing rsccl."""
    if "RSCCL" not in dist.Backend._plugins:
        dist.Backend.register_backend("rsccl", create, extended_api=True, devices=["cpu", "cuda"])
    # torch >= 2.15 attaches its FlightRecorderHook to every new group that lists device
    # types, and the hook looks up the group's C++ default backend, which a Python
    # ProcessGroup has none of: creation would fail ("Could not find the default backend
    # type 0"). It skips groups whose backends record themselves, and, before rsccl's
    # groups declared their devices (ProcessGroupRsccl._device_types), it skipped them for
    # listing none. rsccl records nothing itself; listing it here keeps torch's behaviour:
    # no hook on rsccl's groups.
    skip = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(skip, set):
        skip.add("rsccl")


register()


def memory_stats(group: object | None = None) -> dict:
    """Bytes rsccl reserved and mapped for `group` (default: the world group), and its
    operation counters."""
    return rsccl_group(group).memory_stats()


def mem_pool(group: object | None = None) -> torch.cuda.MemPool:
    """The group's symmetric-memory pool (default: the world group) as a
    torch.cuda.MemPool. Tensors made under ``with torch.cuda.use_mem_pool(rsccl.mem_pool()):``
    are used in place by the group's collectives when every rank allocated its counterpart
    at the same offset (same allocations in the same order); otherwise the collective is
    staged, still correct, and counted in memory_stats. The pool's size is the group's
    ``cuda_pool_bytes`` (Options or RSCCL_CUDA_POOL_BYTES), mapped at group creation."""
    return rsccl_group(group)._mem_pool()


def settings_table() -> str:
    """Every tunable as a Markdown table (Options field, variable, default, meaning)."""
    rows = ["| Options field | environment variable | default | meaning |", "|---|---|---|---|"]
    for field, env, default, is_size, help_ in _rsccl.settings():
        shown = _human(default) if is_size else str(default)
        rows.append(f"| `{field}` | `{env}` | {shown} | {help_} |")
    return "\n".join(rows)


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return str(n)
