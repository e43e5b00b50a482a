"""rsccl.Options: per-group settings, passed as ``pg_options`` to init_process_group/new_group.

Every field left as None falls back to its RSCCL_* environment variable, then to the
default (see ``rsccl.settings_table()``). Values are checked when the group is created;
a bad value raises ValueError naming the field or variable.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Options:
    #: Shared-memory staging per rank for collectives (bytes or "4MiB"); RSCCL_HOST_BUFFER_BYTES.
    host_buffer_bytes: int | str | None = None
    #: Channel per ordered pair of local ranks for send/recv; RSCCL_P2P_BUFFER_BYTES.
    p2p_buffer_bytes: int | str | None = None
    #: Cap on one group's shared region on a host; RSCCL_MAX_REGION_BYTES.
    max_region_bytes: int | str | None = None
    #: all_reduce size up to which the one-shot algorithm is used; RSCCL_ALLREDUCE_ONE_SHOT_MAX_BYTES.
    allreduce_one_shot_max_bytes: int | str | None = None
    #: Polls of a shared flag before a waiting rank sleeps; RSCCL_SPIN_COUNT.
    spin_count: int | None = None

    def items(self) -> list[tuple[str, str]]:
        """The fields that are set, as (name, text) pairs for the Rust core."""
        return [(f.name, str(getattr(self, f.name))) for f in fields(self) if getattr(self, f.name) is not None]


def as_items(pg_options: object) -> list[tuple[str, str]]:
    """Accept rsccl.Options, a dict of the same fields, or None."""
    if pg_options is None:
        return []
    if isinstance(pg_options, Options):
        return pg_options.items()
    if isinstance(pg_options, dict):
        return [(str(k), str(v)) for k, v in pg_options.items() if v is not None]
    raise TypeError(f"rsccl: pg_options must be rsccl.Options or a dict, not {type(pg_options).__name__}")
