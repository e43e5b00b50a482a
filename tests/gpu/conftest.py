"""The GPU suite's clusters: one long-lived cluster per world size (RSCCL_GPU_WORLDS, else 2,
4 and 8, on whatever GPUs there are: ranks round-robin, sharing GPUs where they outnumber
them), shared by every test of that size. A module that needs the world
group created with other settings asks for `gpus.with_options({...})` (rsccl.Options
fields): a cluster of its own, started on first use. Only one cluster is alive at a time,
so that no other cluster's ranks share its GPUs (the memory tests read device-wide counters).
Every test module is skipped where no GPU is visible; `seed` comes from tests/conftest.py."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gpu_harness import alive, gpu_cluster, gpu_count, selected_worlds

WORLDS = selected_worlds()
_live: dict = {}  # (world, options) -> the live cluster; one entry at most


def _cluster_for(world: int, options: dict | None = None):
    key = (world, tuple(sorted((options or {}).items())))
    c = _live.get(key)
    if c is not None and alive(c):
        return c
    # A cluster killed by a deadline is replaced; another world's (or other options')
    # cluster is closed first.
    for k in list(_live):
        _live.pop(k).close(timeout=60)
    _live[key] = gpu_cluster(world, options=options)
    return _live[key]


class SharedCluster:
    """A handle on the shared cluster of one world size (and world-group options). pytest
    caches fixture values, so the handle looks the live cluster up on every call."""

    def __init__(self, world: int, options: dict | None = None):
        self.world = world
        self.options = options

    def with_options(self, options: dict) -> "SharedCluster":
        """The cluster of this world size whose default (world) group is created with
        `options`, a dict of rsccl.Options fields (values as strings or ints)."""
        return SharedCluster(self.world, options)

    def run(self, fn, *args, **kwargs):
        return _cluster_for(self.world, self.options).run(fn, *args, **kwargs)


@pytest.fixture(scope="session", params=WORLDS, ids=[f"{w}gpu" for w in WORLDS])
def gpus(request):
    """The shared cluster of this world size."""
    if gpu_count() < 1:
        pytest.skip("no CUDA GPU visible")
    return SharedCluster(request.param)


@pytest.fixture(scope="session")
def gpus3():
    """A cluster of 3 ranks (on whatever GPUs there are), for tables written for 3 ranks."""
    if gpu_count() < 1:
        pytest.skip("no CUDA GPU visible")
    return SharedCluster(3)


def pytest_sessionfinish(session, exitstatus):
    for w in list(_live):
        _live.pop(w).close(timeout=60)
