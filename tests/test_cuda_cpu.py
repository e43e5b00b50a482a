"""The CUDA engine's parts that need no GPU: the kernels compile (NVRTC, sm_90), the
settings parse, and a group made without CUDA says why it cannot run CUDA tensors."""

import os
import subprocess
import sys

import pytest
import rsccl
import torch
from rsccl import _cuda
from rsccl.options import as_items


def test_kernels_compile_for_hopper():
    _cuda.load_nvrtc()
    sizes = dict(rsccl._rsccl.compile_kernels("sm_90"))
    # Every module of csrc_kernels/ (NVRTC, the fallback and developer path), each a real
    # image: the smallest (rs_barrier alone) is several KB; all_reduce's 10 kernels are
    # tens of KB each (about 850 KB with NVRTC 13.0 since the failure paths went out of
    # line, issue 30).
    assert set(sizes) == {"all_reduce", "reduce_scatter", "rooted", "all_gather", "all_to_all", "send_recv", "barrier"}
    assert min(sizes.values()) > 4_000 and sizes["all_reduce"] > 400_000, sizes


def test_kernel_lineinfo_setting_rejects_bad_values(monkeypatch):
    """RSCCL_KERNEL_LINEINFO (NVRTC's -lineinfo, opt-in) takes 0 or 1; anything else is a
    ValueError naming it, before anything is compiled."""
    for bad in ("yes", "2"):
        monkeypatch.setenv("RSCCL_KERNEL_LINEINFO", bad)
        with pytest.raises(ValueError, match=f"RSCCL_KERNEL_LINEINFO=.{bad}. is not 0 or 1"):
            rsccl._rsccl.compile_kernels("sm_90")
        with pytest.raises(ValueError, match="RSCCL_KERNEL_LINEINFO"):
            rsccl._rsccl.cache_kernels("sm_90")


def test_kernel_compile_errors_are_exceptions():
    _cuda.load_nvrtc()
    with pytest.raises(RuntimeError, match="sm_1"):
        rsccl._rsccl.compile_kernels("sm_1")


def resolve(items=()) -> dict:
    """Every setting as rsccl resolves it from these Options items, the environment and the defaults."""
    return dict(rsccl._rsccl.resolve_options(list(items)))


def assert_bad_values_named(monkeypatch, field: str, bad: str, env: str, junk: str) -> None:
    """An Options value out of range names its field; an environment value that does not
    parse names its variable; the variable is in the settings table."""
    with pytest.raises(ValueError, match=field):
        resolve([(field, bad)])
    monkeypatch.setenv(env, junk)
    with pytest.raises(ValueError, match=env):
        resolve()
    assert env in rsccl.settings_table()


def test_cuda_settings_resolve_and_reject_bad_values(monkeypatch):
    got = dict(rsccl._rsccl.resolve_options([("cuda_buffer_bytes", "64MiB"), ("cuda_blocks", "16")]))
    assert got["cuda_buffer_bytes"] == 64 << 20 and got["cuda_blocks"] == 16
    assert got["max_cuda_va_bytes"] == 16 << 30 and got["cuda_warmup"] == 1 and got["cuda_pool_bytes"] == 0
    assert "RSCCL_CUDA_BUFFER_BYTES" in rsccl.settings_table()
    assert_bad_values_named(monkeypatch, "cuda_blocks", "65", "RSCCL_MAX_CUDA_VA_BYTES", "lots")


def test_low_latency_bound_resolves_within_the_slots(monkeypatch):
    """cuda_low_latency_max_bytes: 64 KiB by default (what the kernels' slots hold in groups
    of up to 4 GPUs, and its largest value), 0 turns the low-latency kernels off, more is
    refused naming it."""
    assert resolve()["cuda_low_latency_max_bytes"] == 64 << 10
    assert resolve(rsccl.Options(cuda_low_latency_max_bytes=0).items())["cuda_low_latency_max_bytes"] == 0
    assert resolve([("cuda_low_latency_max_bytes", "4KiB")])["cuda_low_latency_max_bytes"] == 4096
    assert_bad_values_named(monkeypatch, "cuda_low_latency_max_bytes", "128KiB", "RSCCL_CUDA_LOW_LATENCY_MAX_BYTES", "tiny")


def test_nccl_settings_resolve_and_reject_bad_values(monkeypatch):
    """The NCCL engine's bounds (groups that span hosts): channels per communicator and
    the size from which all_reduce runs hierarchically."""
    got = dict(rsccl._rsccl.resolve_options([]))
    assert got["nccl_max_ctas"] == 16 and got["nccl_hierarchical_min_bytes"] == 16 << 20
    assert got["nccl_p2p_max_ctas"] == 4 and "RSCCL_NCCL_P2P_MAX_CTAS" in rsccl.settings_table()
    got = dict(rsccl._rsccl.resolve_options(rsccl.Options(nccl_max_ctas=0, nccl_hierarchical_min_bytes="1MiB").items()))
    assert got["nccl_max_ctas"] == 0 and got["nccl_hierarchical_min_bytes"] == 1 << 20
    assert "RSCCL_NCCL_MAX_CTAS" in rsccl.settings_table()
    assert_bad_values_named(monkeypatch, "nccl_max_ctas", "65", "RSCCL_NCCL_HIERARCHICAL_MIN_BYTES", "big")


def test_nccl_hierarchical_scratch_setting(monkeypatch):
    """The hierarchical reduce_scatter's buffer: 32 MiB by default, 0 allowed (always
    flat), from Options or the environment, a bad value named."""
    assert dict(rsccl._rsccl.resolve_options([]))["nccl_hierarchical_scratch_bytes"] == 32 << 20
    got = dict(rsccl._rsccl.resolve_options(rsccl.Options(nccl_hierarchical_scratch_bytes=0).items()))
    assert got["nccl_hierarchical_scratch_bytes"] == 0
    monkeypatch.setenv("RSCCL_NCCL_HIERARCHICAL_SCRATCH_BYTES", "128MiB")
    assert dict(rsccl._rsccl.resolve_options([]))["nccl_hierarchical_scratch_bytes"] == 128 << 20
    assert_bad_values_named(monkeypatch, "nccl_hierarchical_scratch_bytes", "lots", "RSCCL_NCCL_HIERARCHICAL_SCRATCH_BYTES", "lots")


def test_no_cuda_engine_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU suite covers it")
    assert _cuda.device_for_new_group() is None


def test_nccl_loads_from_torchs_package():
    """The NCCL engine's first step, without a GPU: rsccl opens torch's libnccl.so.2 (a name
    cudarc's loader does not try), reads its version and makes a unique id."""
    path = _cuda.nccl_library_path()
    assert path is not None and os.path.basename(path).startswith("libnccl.so."), path
    version, uid = rsccl._rsccl.nccl_probe(path)
    major, minor, patch = torch.cuda.nccl.version()
    assert version == major * 10000 + minor * 100 + patch, (version, torch.cuda.nccl.version())
    assert len(uid) == 128 and any(uid), uid
    assert rsccl._rsccl.nccl_probe(path)[1] != uid, "two unique ids must differ"


def test_an_nccl_unique_id_holds_a_socket_until_its_members_join():
    """Why the NCCL engine makes a communicator's id only once every member has arrived
    (nccl_engine/create.rs, share_id): ncclGetUniqueId starts NCCL's bootstrap root, a
    thread listening on a socket until every member connects, with no call to stop it. An
    id made for a communicator a dead rank never joins kept that socket in rank 0 (issue
    25, place 7). A fresh interpreter, so that no other socket comes or goes meanwhile."""
    code = (
        "import os, time, rsccl\n"
        "from rsccl import _cuda\n"
        "def kind(f):\n"
        "    try:\n"
        "        return os.readlink(f'/proc/self/fd/{f}')\n"
        "    except OSError:\n"
        "        return ''  # the listing's own descriptor, closed by now\n"
        "def socks():\n"
        "    return sum(kind(f).startswith('socket:') for f in os.listdir('/proc/self/fd'))\n"
        "path = _cuda.nccl_library_path()\n"
        "rsccl._rsccl.nccl_probe(path)\n"
        "before = socks()\n"
        "rsccl._rsccl.nccl_probe(path)\n"
        "time.sleep(0.5)\n"
        "print('sockets', before, socks())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    before, after = (int(v) for v in r.stdout.split("sockets")[1].split())
    assert after == before + 1, f"a unique id nobody joined holds {after - before} sockets, not 1: {r.stdout}"


def test_nccl_bad_path_is_an_exception():
    # NCCL is loaded once per process: a fresh interpreter tries the bad path first.
    code = (
        "import rsccl\ntry:\n    rsccl._rsccl.nccl_probe('/nonexistent/libnccl.so.2')\nexcept RuntimeError as e:\n    print('raised:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "raised: " in r.stdout and "cannot load NCCL from /nonexistent/libnccl.so.2" in r.stdout, (
        r.stdout,
        r.stderr,
    )


def test_nccl_p2p_setting(monkeypatch):
    """The pair communicators for CUDA send/recv across hosts: on by default; Options takes
    0/1 or False/True, the environment 0/1; anything else is rejected, naming the setting."""
    assert dict(rsccl._rsccl.resolve_options([]))["nccl_p2p"] == 1
    for value, want in [(False, 0), (True, 1), (0, 0), (1, 1)]:
        got = dict(rsccl._rsccl.resolve_options(rsccl.Options(nccl_p2p=value).items()))
        assert got["nccl_p2p"] == want, value
    assert dict(rsccl._rsccl.resolve_options(as_items({"nccl_p2p": False})))["nccl_p2p"] == 0
    with pytest.raises(ValueError, match="nccl_p2p"):
        rsccl._rsccl.resolve_options(rsccl.Options(nccl_p2p=2).items())
    monkeypatch.setenv("RSCCL_NCCL_P2P", "0")
    assert dict(rsccl._rsccl.resolve_options([]))["nccl_p2p"] == 0
    assert_bad_values_named(monkeypatch, "nccl_p2p", "2", "RSCCL_NCCL_P2P", "yes")
