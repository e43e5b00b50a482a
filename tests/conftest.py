import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Cluster, fresh_seed  # noqa: E402

# Small staging buffers make modest messages take the pipelined (multi-chunk) paths.
SMALL_BUFFERS = {"RSCCL_HOST_BUFFER_BYTES": "128KiB", "RSCCL_P2P_BUFFER_BYTES": "32KiB", "RSCCL_ALLREDUCE_ONE_SHOT_MAX_BYTES": "16KiB"}

_clusters: dict = {}


def cluster_for(world: int, small: bool) -> Cluster:
    key = (world, small)
    if key not in _clusters:
        _clusters[key] = Cluster(world, env=SMALL_BUFFERS if small else {})
    return _clusters[key]


@pytest.fixture(scope="session", params=[(2, True), (3, False), (4, True)], ids=["2ranks-smallbuf", "3ranks", "4ranks-smallbuf"])
def cluster(request):
    return cluster_for(*request.param)


@pytest.fixture(scope="session")
def cluster4():
    return cluster_for(4, False)


@pytest.fixture
def seed(request):
    s = fresh_seed()
    print(f"\n{request.node.nodeid}: seed={s} (rerun with RSCCL_TEST_SEED={s})")
    return s


def pytest_sessionfinish(session, exitstatus):
    for c in _clusters.values():
        c.close()
