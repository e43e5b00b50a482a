"""rsccl: a torch.distributed backend with a Rust core.

``import rsccl`` registers the backend "rsccl"; then
``torch.distributed.init_process_group("rsccl")`` runs collectives on CPU tensors through
shared memory among ranks of one host (gloo across hosts).
"""

from __future__ import annotations

import torch.distributed as dist

from . import _rsccl
from ._backend import ProcessGroupRsccl, create
from ._rsccl import GroupAbortedError, PeerFailureError
from .options import Options

__version__ = _rsccl.__version__
__all__ = [
    "Options",
    "ProcessGroupRsccl",
    "PeerFailureError",
    "GroupAbortedError",
    "memory_stats",
    "settings_table",
]

if "RSCCL" not in dist.Backend._plugins:
    dist.Backend.register_backend("rsccl", create, extended_api=True, devices=["cpu", "cuda"])


def _rsccl_pg(group: object | None) -> ProcessGroupRsccl:
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupRsccl):
        raise TypeError(f"rsccl: {pg!r} is not an rsccl process group")
    return pg


def memory_stats(group: object | None = None) -> dict:
    """Bytes rsccl reserved and mapped for `group` (default: the world group), and its
    operation counters."""
    return _rsccl_pg(group).memory_stats()


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
