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
    #: Device memory per rank for CUDA collectives (signal pads + staging); RSCCL_CUDA_BUFFER_BYTES.
    cuda_buffer_bytes: int | str | None = None
    #: CUDA blocks of every rsccl kernel; RSCCL_CUDA_BLOCKS.
    cuda_blocks: int | None = None
    #: CUDA all_reduce size up to which the one-shot kernel is used; RSCCL_CUDA_ALLREDUCE_ONE_SHOT_MAX_BYTES.
    cuda_allreduce_one_shot_max_bytes: int | str | None = None
    #: CUDA all_reduce (message), reduce_scatter (output) and all_gather (input) size per rank up to which the low-latency kernels run (0: never); RSCCL_CUDA_LOW_LATENCY_MAX_BYTES.
    cuda_low_latency_max_bytes: int | str | None = None
    #: CUDA all_gather (gathered output), reduce_scatter (input; reduced by a small local kernel), broadcast and send/recv size from which data moves on the copy engines, no SM (0: never, 1: always); RSCCL_CUDA_COPY_ENGINE_MIN_BYTES.
    cuda_copy_engine_min_bytes: int | str | None = None
    #: CUDA reduce_scatter (input) and all_reduce size from which the call runs as a ring, each rank sending only to the next; float16/bfloat16 sums then round once per hop, as NCCL's (0: never); RSCCL_CUDA_RING_MIN_BYTES.
    cuda_ring_min_bytes: int | str | None = None
    #: Cap on the GPU virtual address space one group reserves; RSCCL_MAX_CUDA_VA_BYTES.
    max_cuda_va_bytes: int | str | None = None
    #: 1 (default): warm-up collective at group creation; 0: skip it; RSCCL_CUDA_WARMUP.
    cuda_warmup: int | None = None
    #: 1/True: ranks of a group may share a GPU (tests, debugging; timings mean nothing); 0 (default): refused; RSCCL_ALLOW_SHARED_GPU.
    allow_shared_gpu: int | bool | None = None
    #: 1 (default): blocking CUDA collectives run on the caller's stream; 0: internal stream; RSCCL_CUDA_SYNC_STREAM.
    cuda_sync_stream: int | None = None
    #: Device memory per rank for rsccl.mem_pool(group), used in place by collectives (0: none); RSCCL_CUDA_POOL_BYTES.
    cuda_pool_bytes: int | str | None = None
    #: Message size from which pool tensors are used in place (smaller ones are staged); RSCCL_CUDA_INPLACE_MIN_BYTES.
    cuda_inplace_min_bytes: int | str | None = None
    #: Device memory per rank for the send/recv inbox; RSCCL_CUDA_P2P_BYTES.
    cuda_p2p_bytes: int | str | None = None
    #: CUDA blocks of each send/recv kernel; RSCCL_CUDA_P2P_BLOCKS.
    cuda_p2p_blocks: int | None = None
    #: 1/True (default): a CUDA collective that fails on the GPU ends the process (as NCCL's async error handling); 0/False: raised at the next call or wait; RSCCL_CUDA_ERROR_TEARDOWN.
    cuda_error_teardown: int | bool | None = None
    #: Most CTAs (channels) of each NCCL communicator of a group that spans hosts (0: NCCL's default); RSCCL_NCCL_MAX_CTAS.
    nccl_max_ctas: int | None = None
    #: Most CTAs (channels) of each pair communicator of cross-host CUDA send/recv (0: NCCL's default); RSCCL_NCCL_P2P_MAX_CTAS.
    nccl_p2p_max_ctas: int | None = None
    #: CUDA all_reduce/all_gather/reduce_scatter size from which a multi-host group runs hierarchically; RSCCL_NCCL_HIERARCHICAL_MIN_BYTES.
    nccl_hierarchical_min_bytes: int | str | None = None
    #: Device buffer of a multi-host group for hierarchical reduce_scatter (0: always flat); RSCCL_NCCL_HIERARCHICAL_SCRATCH_BYTES.
    nccl_hierarchical_scratch_bytes: int | str | None = None
    #: 1/True (default): a multi-host group creates a NCCL communicator per ordered cross-host pair for CUDA send/recv; 0/False: none; RSCCL_NCCL_P2P.
    nccl_p2p: int | bool | None = None

    def items(self) -> list[tuple[str, str]]:
        """The fields that are set, as (name, text) pairs for the Rust core."""
        return [(f.name, _text(getattr(self, f.name))) for f in fields(self) if getattr(self, f.name) is not None]


def _text(v: object) -> str:
    """A field's value as the Rust core parses it (True/False as 1/0)."""
    return str(int(v)) if isinstance(v, bool) else str(v)


def as_items(pg_options: object) -> list[tuple[str, str]]:
    """Accept rsccl.Options, a dict of the same fields, or None."""
    if pg_options is None:
        return []
    if isinstance(pg_options, Options):
        return pg_options.items()
    if isinstance(pg_options, dict):
        return [(str(k), _text(v)) for k, v in pg_options.items() if v is not None]
    raise TypeError(f"rsccl: pg_options must be rsccl.Options or a dict, not {type(pg_options).__name__}")
