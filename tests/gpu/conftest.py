"""The GPU suite's clusters: one long-lived cluster per world size (RSCCL_GPU_WORLDS, else 2
and, with 4 GPUs, 4), shared by every test of that size. Only one is alive at a time, so
that each rank is alone on its GPU (the memory tests read device-wide counters). Every
test module is skipped where fewer than 2 GPUs are visible; `seed` comes from
tests/conftest.py."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_harness import alive, gpu_cluster, gpu_count, selected_worlds

WORLDS = selected_worlds()
_live: dict = {}


def _cluster_for(world: int):
    c = _live.get(world)
    if c is not None and alive(c):
        return c
    # A cluster killed by a deadline is replaced; another world's cluster is closed first.
    for w in list(_live):
        _live.pop(w).close(timeout=60)
    _live[world] = gpu_cluster(world)
    return _live[world]


class SharedCluster:
    """A handle on the shared cluster of one world size. pytest caches fixture values, so
    the handle looks the live cluster up on every call."""

    def __init__(self, world: int):
        self.world = world

    def run(self, fn, *args, **kwargs):
        return _cluster_for(self.world).run(fn, *args, **kwargs)


@pytest.fixture(scope="session", params=WORLDS, ids=[f"{w}gpu" for w in WORLDS])
def gpus(request):
    """The shared cluster of this world size."""
    if gpu_count() < request.param:
        pytest.skip(f"a world of {request.param} needs {request.param} GPUs, {gpu_count()} visible")
    return SharedCluster(request.param)


def pytest_sessionfinish(session, exitstatus):
    for w in list(_live):
        _live.pop(w).close(timeout=60)
