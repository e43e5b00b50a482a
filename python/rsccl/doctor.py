"""Whether rsccl can work on this machine, and what to do where it cannot.

    python -m rsccl.doctor [--json] [--cpu-ok] [--fill-cache [ARCH ...]]

Prints one line per check (ok / missing / error / warn / info / skipped), the GPUs, the
peer-access matrix and `nvidia-smi topo -m`, the RSCCL_* variables and the settings
table, then every problem with a "what to do" line. --json prints the same as one dict.

Exit status, the rule a job's preflight step can rely on:

  0  rsccl's CUDA engine can work here: at least one GPU is visible and every check the
     CUDA engine needs passes (the driver, VMM allocations and POSIX-fd handles on every
     GPU, a compute capability NVRTC targets, peer access between every pair of GPUs,
     NVRTC), and so does what every engine needs (shared memory, valid RSCCL_* settings).
     With --cpu-ok, a machine with no visible GPU also gets 0 when what the CPU engine
     needs passes.
  1  something needed is missing or broken. Without --cpu-ok this includes "no GPU":
     a GPU job whose GPUs are not visible (CUDA_VISIBLE_DEVICES, a container started
     without GPUs) should fail its preflight, not fall back to the CPU.
  2  bad command line.

Warnings (a GPU the prebuilt kernels do not cover and no NVRTC cache for it, a finite RLIMIT_AS) and information (NCCL,
topology, address width) never change the status. No check raises: a library that is
missing or fails is reported as such.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import json
import mmap
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

import rsccl

from . import _cuda, _rsccl
from ._report import human_bytes

OK, MISSING, ERROR, WARN, INFO, SKIPPED = "ok", "missing", "error", "warn", "info", "skipped"
FAILED = (MISSING, ERROR)
T = TypeVar("T")

# CUdevice_attribute values (cuda.h; the same in cudarc 0.19's driver bindings, every CUDA
# version they cover).
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CUDA_ERROR_NO_DEVICE = 100

# The kernels synchronize with ld.acquire.sys / st.release.sys, which need sm_70; NVRTC 13
# no longer targets anything below sm_75.
MIN_CC_NVRTC12 = (7, 0)
MIN_CC_NVRTC13 = (7, 5)


@dataclass
class Check:
    """One finding. `needed_by` says whether a failure stops the CUDA engine ("cuda"),
    every engine ("all"), or nothing ("info": reported, never a problem)."""

    name: str
    status: str
    summary: str
    fix: str | None = None
    needed_by: str = "info"
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    checks: list[Check]
    gpus: list[dict[str, Any]]
    peer_access: list[list[bool]] | None
    topology: str | None
    env: dict[str, str]
    settings: list[dict[str, Any]]
    filled_cache: list[dict[str, Any]]
    cpu_ok: bool
    problems: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    verdict: str = ""
    exit_code: int = 1


def _safe(fn: Callable[[], T], on_error: Callable[[str], T]) -> T:
    """fn(), or on_error(its exception as text): a check never crashes the doctor."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the doctor reports, it does not raise
        return on_error(f"{type(e).__name__}: {e}")


def _guard(name: str, needed_by: str, fn: Callable[[], Check]) -> Check:
    return _safe(fn, lambda msg: Check(name, ERROR, f"the check itself failed: {msg}", "report this as an rsccl bug", needed_by))


# -- the package, torch, the host engine, the settings ------------------------------------


def check_rsccl() -> Check:
    pkg = os.path.dirname(os.path.abspath(rsccl.__file__))
    ext = os.path.abspath(getattr(_rsccl, "__file__", "") or "")
    return Check(
        "rsccl", OK, f"{rsccl.__version__} at {pkg}", needed_by="all", data={"version": rsccl.__version__, "path": pkg, "extension": ext}
    )


def check_torch() -> Check:
    data = {"version": torch.__version__, "cuda": torch.version.cuda}
    if torch.version.cuda is None:
        return Check(
            "torch",
            MISSING,
            f"{torch.__version__}, a CPU-only build (torch.version.cuda is None)",
            "install a CUDA build of torch (pip install torch==2.11.0, whose default wheels are CUDA 13.0)",
            "cuda",
            data,
        )
    return Check("torch", OK, f"{torch.__version__}, CUDA {torch.version.cuda}", needed_by="cuda", data=data)


def check_host_shared_memory() -> Check:
    """The host engine's region is a sealed memfd mapped by every local rank."""
    import fcntl

    fd = os.memfd_create("rsccl-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with mmap.mmap(fd, mmap.PAGESIZE) as m:
            m[0] = 1
    finally:
        os.close(fd)
    return Check("shared memory", OK, "memfd_create, sealing and mmap work (the host engine's region)", needed_by="all")


def settings_rows() -> tuple[list[dict[str, Any]], str | None]:
    """Every setting with its default and the value this environment resolves to; the
    second item is resolve_options' error (a bad RSCCL_* value) or None."""
    resolved: dict[str, int] = {}
    err = None
    try:
        resolved = dict(_rsccl.resolve_options())
    except ValueError as e:
        err = str(e)
    rows = []
    for fld, env, default, is_size, help_ in _rsccl.settings():
        rows.append(
            {
                "field": fld,
                "env": env,
                "default": default,
                "value": resolved.get(fld),
                "source": "env" if env in os.environ else "default",
                "is_size": is_size,
                "help": help_,
            }
        )
    return rows, err


def check_settings(rows: list[dict[str, Any]], err: str | None) -> Check:
    if err is not None:
        return Check(
            "settings",
            ERROR,
            err,
            "fix or unset that variable (ranges: docs/configuration.md); every group creation fails until then",
            "all",
        )
    from_env = [f"{r['field']}={human_bytes(r['value']) if r['is_size'] else r['value']}" for r in rows if r["source"] == "env"]
    summary = "valid; from the environment: " + ", ".join(from_env) if from_env else "valid; all defaults"
    return Check("settings", OK, summary, needed_by="all")


# -- the CUDA driver and the GPUs ----------------------------------------------------------


class Driver:
    """libcuda through ctypes: what the driver itself says, independent of torch."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def error(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        return f"{name.value.decode() if name.value else 'CUDA error'} ({code})"

    def version(self) -> tuple[int, int]:
        v = ctypes.c_int()
        rc = self.lib.cuDriverGetVersion(ctypes.byref(v))
        if rc:
            raise RuntimeError(f"cuDriverGetVersion: {self.error(rc)}")
        return v.value // 1000, (v.value % 1000) // 10

    def init(self) -> int:
        """cuInit(0); returns the CUresult (CUDA_ERROR_NO_DEVICE on a driver without GPUs)."""
        return int(self.lib.cuInit(0))

    def device_count(self) -> int:
        n = ctypes.c_int()
        rc = self.lib.cuDeviceGetCount(ctypes.byref(n))
        if rc:
            raise RuntimeError(f"cuDeviceGetCount: {self.error(rc)}")
        return n.value

    def attribute(self, ordinal: int, attr: int) -> int:
        dev, value = ctypes.c_int(), ctypes.c_int()
        rc = self.lib.cuDeviceGet(ctypes.byref(dev), ordinal)
        if not rc:
            rc = self.lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev)
        if rc:
            raise RuntimeError(f"cuDeviceGetAttribute({attr}) on device {ordinal}: {self.error(rc)}")
        return value.value


def load_driver() -> tuple[Driver | None, Check]:
    try:
        drv = Driver()
    except OSError as e:
        return None, Check(
            "driver",
            MISSING,
            f"libcuda.so.1 is not loadable ({e})",
            "install the NVIDIA driver, or start the container with the GPUs and driver mounted (docker run --gpus all)",
            "cuda",
        )
    major, minor = drv.version()
    rc = drv.init()
    data = {"version": f"{major}.{minor}", "cuInit": rc}
    if rc == CUDA_ERROR_NO_DEVICE:
        return drv, Check("driver", OK, f"CUDA {major}.{minor} (the driver sees no GPU)", needed_by="cuda", data=data)
    if rc:
        return drv, Check(
            "driver",
            ERROR,
            f"CUDA {major}.{minor}, but cuInit fails: {drv.error(rc)}",
            "check `nvidia-smi`; a driver/kernel-module mismatch after an upgrade needs a reboot",
            "cuda",
            data,
        )
    return drv, Check("driver", OK, f"CUDA {major}.{minor}", needed_by="cuda", data=data)


def check_nvrtc() -> Check:
    """NVRTC as rsccl loads it (torch's nvidia-cuda-nvrtc package), and its version."""
    _cuda.load_nvrtc()
    with open("/proc/self/maps") as f:
        loaded = sorted({line.split()[-1] for line in f if "/libnvrtc.so" in line})
    candidates = loaded or ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        rc = lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        if rc:
            return Check("nvrtc", ERROR, f"{name}: nvrtcVersion returned {rc}", "reinstall nvidia-cuda-nvrtc", "cuda", {"path": name})
        return Check(
            "nvrtc",
            OK,
            f"{major.value}.{minor.value} at {name}",
            needed_by="cuda",
            data={"path": name, "version": [major.value, minor.value]},
        )
    return Check(
        "nvrtc",
        MISSING,
        "libnvrtc is not loadable (rsccl compiles its kernels with it at group creation)",
        "pip install 'nvidia-cuda-nvrtc>=13.0,<13.1' (torch 2.11's CUDA 13.0 wheels bring it), or put libnvrtc.so on LD_LIBRARY_PATH",
        "cuda",
    )


def check_nvrtc_vs_driver(nvrtc: Check, driver: Check) -> Check:
    nv, drv = nvrtc.data.get("version"), driver.data.get("version")
    if nv is None or drv is None:
        return Check("nvrtc/driver", SKIPPED, "needs both NVRTC and the driver", needed_by="cuda")
    drv_major = int(drv.split(".")[0])
    if nv[0] > drv_major:
        return Check(
            "nvrtc/driver",
            ERROR,
            f"NVRTC {nv[0]}.{nv[1]} is newer than the driver's CUDA {drv}: its cubins will not load",
            f"update the driver to one for CUDA {nv[0]}, or install the NVRTC of CUDA {drv_major} (nvidia-cuda-nvrtc=={drv_major}.*)",
            "cuda",
        )
    return Check("nvrtc/driver", OK, f"NVRTC {nv[0]}.{nv[1]} cubins load on the CUDA {drv} driver", needed_by="cuda")


def pci_bus_id(p: Any) -> str:
    """nvidia-smi's form (00000000:18:00.0), from the fields torch's device properties have
    (its type stubs do not list them)."""
    return f"{getattr(p, 'pci_domain_id', 0):08x}:{getattr(p, 'pci_bus_id', 0):02x}:{getattr(p, 'pci_device_id', 0):02x}.0"


def describe_gpus(drv: Driver | None, nvrtc: Check) -> list[dict[str, Any]]:
    """Every GPU torch sees, with what the driver says about VMM and POSIX-fd handles."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        g: dict[str, Any] = {
            "index": i,
            "name": p.name,
            "memory_bytes": int(p.total_memory),
            "compute_capability": [p.major, p.minor],
            "arch": f"sm_{p.major}{p.minor}",
            "pci_bus_id": pci_bus_id(p),
            "vmm": None,
            "posix_fd": None,
            "errors": [],
        }
        if drv is not None:
            for key, attr in (
                ("vmm", CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
                ("posix_fd", CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
            ):
                try:
                    g[key] = bool(drv.attribute(i, attr))
                except RuntimeError as e:
                    g["errors"].append(str(e))
        nv = nvrtc.data.get("version")
        g["min_compute_capability"] = list(MIN_CC_NVRTC13 if nv is None or nv[0] >= 13 else MIN_CC_NVRTC12)
        gpus.append(g)
    return gpus


def check_gpu_count(gpus: list[dict[str, Any]], drv: Driver | None, driver: Check) -> Check:
    if gpus:
        return Check("GPUs", OK, f"{len(gpus)} visible to torch", needed_by="cuda", data={"count": len(gpus)})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    driver_count = None
    if drv is not None and driver.status == OK and driver.data.get("cuInit") == 0:
        driver_count = drv.device_count()
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        fix = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: unset it or list the GPUs"
    elif torch.version.cuda is None:
        fix = "torch is a CPU-only build: install a CUDA build of torch"
    elif driver_count:
        fix = f"the driver sees {driver_count} GPU(s) but torch none: its CUDA {torch.version.cuda} needs a newer driver than CUDA {driver.data['version']}"
    elif drv is None:
        fix = "no NVIDIA driver here: run on a GPU machine (or pass --cpu-ok to accept the CPU engine)"
    else:
        fix = "the driver sees no GPU: check `nvidia-smi` and the container's GPU access (or pass --cpu-ok to accept the CPU engine)"
    return Check("GPUs", MISSING, "none visible (torch.cuda.device_count() = 0)", fix, "cuda", {"count": 0, "driver_count": driver_count})


def check_gpu(g: dict[str, Any]) -> Check:
    cc = tuple(g["compute_capability"])
    summary = (
        f"{g['name']}, {human_bytes(g['memory_bytes'])}, {g['arch']}, {g['pci_bus_id']}, "
        f"VMM {_yes(g['vmm'])}, POSIX-fd handles {_yes(g['posix_fd'])}"
    )
    name = f"GPU {g['index']}"
    if g["errors"]:
        return Check(name, ERROR, summary + "; " + "; ".join(g["errors"]), "check the driver with `nvidia-smi -q`", "cuda")
    missing = []
    if g["vmm"] is False:
        missing.append("VMM (cuMemCreate/cuMemMap), which rsccl allocates and maps its buffers with")
    if g["posix_fd"] is False:
        missing.append("POSIX-fd handles, which rsccl shares buffers between local ranks with")
    if cc < tuple(g["min_compute_capability"]):
        lo = g["min_compute_capability"]
        missing.append(f"compute capability {lo[0]}.{lo[1]} (the kernels' system-scope acquire/release, NVRTC's oldest target)")
    if g["vmm"] is None:
        return Check(name, MISSING, summary, "the driver library is needed to query VMM support", "cuda")
    if missing:
        return Check(
            name,
            MISSING,
            summary + "; lacks " + "; ".join(missing),
            "use a GPU and driver that support it (a vGPU or MIG profile may not); CPU tensors still work",
            "cuda",
        )
    return Check(name, OK, summary, needed_by="cuda")


def _yes(v: bool | None) -> str:
    return "?" if v is None else ("yes" if v else "NO")


def check_peer_access(n: int) -> tuple[Check, list[list[bool]] | None]:
    if n < 2:
        return Check("peer access", SKIPPED, f"{n} GPU(s): nothing to pair", needed_by="cuda"), None
    matrix = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    lacking = [(i, j) for i in range(n) for j in range(n) if not matrix[i][j]]
    if lacking:
        pairs = ", ".join(f"{i}->{j}" for i, j in lacking)
        return Check(
            "peer access",
            MISSING,
            f"these GPU pairs cannot access each other: {pairs}",
            "a group whose ranks use such a pair cannot map its peers' buffers: put those ranks in separate groups, "
            "or check the topology below (PCIe across sockets, IOMMU/ACS settings)",
            "cuda",
        ), matrix
    return Check("peer access", OK, f"every pair of the {n} GPUs", needed_by="cuda"), matrix


def check_topology() -> tuple[Check, str | None]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Check("topology", SKIPPED, "nvidia-smi not found"), None
    r = subprocess.run([exe, "topo", "-m"], check=False, capture_output=True, text=True, timeout=30)
    if r.returncode:
        return Check("topology", INFO, f"`nvidia-smi topo -m` exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"), None
    # nvidia-smi underlines the header with terminal escapes even into a pipe.
    return Check("topology", INFO, "`nvidia-smi topo -m` below"), re.sub(r"\x1b\[[0-9;]*m", "", r.stdout).rstrip()


# -- NCCL, the kernel cache, the address space, the environment ------------------------------


def check_nccl() -> Check:
    """torch's NCCL (the nvidia-nccl package): not used by rsccl, the bench's baseline."""
    paths = []
    try:
        import nvidia

        for base in nvidia.__path__:
            paths += sorted(glob.glob(os.path.join(base, "*", "lib", "libnccl.so.2")))
    except ImportError:
        pass
    for path in paths + ["libnccl.so.2"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        v = ctypes.c_int()
        rc = lib.ncclGetVersion(ctypes.byref(v))
        if rc:
            return Check("nccl", ERROR, f"{path}: ncclGetVersion returned {rc}", data={"path": path})
        code = v.value
        version = (
            f"{code // 10000}.{code % 10000 // 100}.{code % 100}" if code >= 20900 else f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
        )
        return Check("nccl", OK, f"{version} at {path} (not used by rsccl; the bench's baseline)", data={"path": path, "version": version})
    return Check("nccl", MISSING, "libnccl.so.2 not found (not used by rsccl; only `rsccl.bench --device cuda` compares with it)")


def kernel_cache_dir() -> str | None:
    """Where NVRTC-compiled kernels are cached: the rule of config.rs's kernel_cache_dir()."""
    if os.environ.get("RSCCL_CACHE_DIR"):
        return os.environ["RSCCL_CACHE_DIR"]
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.join(os.environ["XDG_CACHE_HOME"], "rsccl")
    if "HOME" in os.environ:
        return os.path.join(os.environ["HOME"], ".cache", "rsccl")
    return None


def check_kernels(gpus: list[dict[str, Any]]) -> tuple[Check, list[str]]:
    """Where each GPU's kernels come from: the fat binary built into the wheel (which archs
    it holds, whether it covers the GPU) or NVRTC (RSCCL_KERNELS, or a GPU it does not
    cover). Also returns the archs that will use NVRTC (their cache matters)."""
    info = _rsccl.prebuilt_kernels()
    modules = info["modules"]
    sass = sorted({int(n[3:]) for imgs in modules.values() for n, _ in imgs if n.startswith("sm_")})
    ptx = sorted({int(n[8:]) for imgs in modules.values() for n, _ in imgs if n.startswith("compute_")})
    total = sum(b for imgs in modules.values() for _, b in imgs)
    built = (
        f"prebuilt by nvcc {info['nvcc']}: SASS {', '.join(f'sm_{a}' for a in sass)} + PTX {', '.join(f'compute_{a}' for a in ptx)} "
        f"({human_bytes(total)} in {len(modules)} modules)"
        if modules
        else "this build has no prebuilt kernels (built without nvcc)"
    )
    data: dict[str, Any] = {"nvcc": info["nvcc"], "sass": [f"sm_{a}" for a in sass], "ptx": [f"compute_{a}" for a in ptx], "gpus": {}}
    data["source_setting"] = os.environ.get("RSCCL_KERNELS", "auto") or "auto"
    nvrtc_archs: list[str] = []
    per_gpu = []
    for arch, cc in sorted({(g["arch"], tuple(g["compute_capability"])) for g in gpus}):
        try:
            src, what, nbytes = _rsccl.kernel_choice(cc[0], cc[1])
        except Exception as e:  # noqa: BLE001 - RSCCL_KERNELS=prebuilt on an uncovered GPU, or a bad value
            data["gpus"][arch] = {"source": None, "detail": str(e)}
            return Check(
                "kernels", ERROR, f"{built}; {arch}: {e}", "unset RSCCL_KERNELS (auto falls back to NVRTC)", "cuda", data
            ), nvrtc_archs
        data["gpus"][arch] = {"source": src, "detail": what, "device_code_bytes": nbytes}
        if src == "prebuilt":
            per_gpu.append(f"{arch} covered ({what}, {human_bytes(nbytes)} of device code)")
        else:
            per_gpu.append(f"{arch} uses NVRTC ({what})")
            nvrtc_archs.append(arch)
    summary = built + ("; " + "; ".join(per_gpu) if per_gpu else "")
    if not modules:
        fix = "install rsccl's wheel, or build it with `pip install .` (nvcc comes from PyPI as a build requirement)"
        return Check("kernels", WARN, summary + ": the first group on each GPU compiles them with NVRTC", fix, data=data), nvrtc_archs
    if nvrtc_archs and data["source_setting"] != "nvrtc":
        fix = f"python -m rsccl.doctor --fill-cache {' '.join(nvrtc_archs)} compiles them ahead"
        return Check("kernels", WARN, summary + ": their first group compiles with NVRTC", fix, data=data), nvrtc_archs
    return Check("kernels", OK if gpus else INFO, summary, data=data), nvrtc_archs


def _writable(d: str) -> bool:
    """Whether rsccl could write d's cache files (d, or its nearest existing parent)."""
    p = d
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return False
        p = parent
    return os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)


def check_kernel_cache(archs: list[str]) -> Check:
    """Which architectures have NVRTC-compiled kernels on disk; `archs` are the GPUs' archs
    that use NVRTC (the others run the prebuilt kernels and need no cache). A build's files
    are kernels-<hash>-<module>-<arch>.cubin, one per module, the hash covering the kernel
    sources, NVRTC's version and the options; only rsccl knows this build's hash, so a file
    for an arch may be another build's (then the first group creation compiles again)."""
    d = kernel_cache_dir()
    if d is None:
        status = WARN if archs else INFO
        return Check("kernel cache", status, "no cache directory (no RSCCL_CACHE_DIR, XDG_CACHE_HOME or HOME)", "set RSCCL_CACHE_DIR")
    builds: dict[str, set[str]] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(d), "kernels-*-sm_*.cubin"))):
        parts = os.path.basename(path).removesuffix(".cubin").split("-")
        builds.setdefault(parts[-1], set()).add(parts[1])
    writable = _writable(d)
    data = {"dir": d, "writable": writable, "builds": {a: sorted(k) for a, k in builds.items()}}
    cached = ", ".join(f"{a} ({len(v)} build{'s' if len(v) > 1 else ''})" for a, v in builds.items()) or "nothing cached"
    summary = f"{d}: {cached}"
    if not archs:
        return Check("kernel cache", INFO, summary + " (no GPU here needs NVRTC)", data=data)
    if not writable:
        return Check("kernel cache", WARN, summary + "; not writable", "set RSCCL_CACHE_DIR to a writable directory", data=data)
    uncached = [a for a in archs if a not in builds]
    if uncached:
        return Check(
            "kernel cache",
            WARN,
            summary + f"; {', '.join(uncached)} not cached: the first group creation compiles with NVRTC (about 1 min on 16 cores)",
            f"python -m rsccl.doctor --fill-cache {' '.join(uncached)}",
            data=data,
        )
    return Check("kernel cache", OK, summary, data=data)


def check_address_space() -> Check:
    bits = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("address sizes"):
                    bits = int(line.split(",")[1].split()[0])  # "46 bits physical, 57 bits virtual"
                    break
    except (OSError, ValueError, IndexError):
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    now = _cuda.mapped_va_bytes()
    data = {
        "cpu_virtual_bits": bits,
        "rlimit_as": [None if soft == resource.RLIM_INFINITY else soft, None if hard == resource.RLIM_INFINITY else hard],
        "process_va_bytes": now,
    }
    # Linux keeps mmaps below 128 TiB unless a process asks for higher addresses, even
    # with 57-bit (5-level) paging: that is the space CUDA's reservations come from.
    if bits is None:
        width = "virtual address width unknown"
    elif bits > 48:
        width = f"{bits}-bit virtual addresses (mmaps below 128 TiB unless asked higher)"
    else:
        width = f"{bits}-bit virtual addresses ({human_bytes(1 << (bits - 1))} for a process)"
    limit = "unlimited" if soft == resource.RLIM_INFINITY else human_bytes(soft)
    summary = f"{width}; RLIMIT_AS {limit}; this process maps {human_bytes(now)} now"
    if soft != resource.RLIM_INFINITY:
        return Check(
            "address space",
            WARN,
            summary,
            "CUDA reserves large virtual ranges at its initialization and rsccl up to max_cuda_va_bytes per group: "
            "a finite `ulimit -v` can make either fail; raise it (`ulimit -v unlimited`)",
            data=data,
        )
    return Check("address space", INFO, summary, data=data)


def relevant_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("RSCCL_") or k == "CUDA_VISIBLE_DEVICES"}


# -- putting it together ---------------------------------------------------------------------


def fill_cache(archs: list[str]) -> list[dict[str, Any]]:
    """Compile (or find) the kernels of every arch into the disk cache."""
    out = []
    for arch in archs:
        t = time.monotonic()
        try:
            _cuda.load_nvrtc()
            files = _rsccl.cache_kernels(arch)
            path = os.path.dirname(files[0]) if files else None
            out.append({"arch": arch, "path": path, "seconds": round(time.monotonic() - t, 1), "error": None})
        except Exception as e:  # noqa: BLE001 - reported with the other findings
            out.append({"arch": arch, "path": None, "seconds": round(time.monotonic() - t, 1), "error": f"{type(e).__name__}: {e}"})
    return out


def diagnose(cpu_ok: bool = False, fill: list[str] | None = None) -> Report:
    """Run every check; never raises for a missing or failing library."""
    checks = [_guard("rsccl", "all", check_rsccl), _guard("torch", "cuda", check_torch)]
    checks.append(_guard("shared memory", "all", check_host_shared_memory))
    rows, err = _safe(settings_rows, lambda msg: ([], msg))
    checks.append(check_settings(rows, err))

    drv, driver = _safe(load_driver, lambda msg: (None, Check("driver", ERROR, msg, "check the NVIDIA driver installation", "cuda")))
    nvrtc = _guard("nvrtc", "cuda", check_nvrtc)
    checks += [driver, nvrtc, _guard("nvrtc/driver", "cuda", lambda: check_nvrtc_vs_driver(nvrtc, driver))]

    def listing_failed(msg: str) -> list[dict[str, Any]]:
        checks.append(Check("GPU listing", ERROR, f"torch.cuda failed: {msg}", "check `nvidia-smi`", "cuda"))
        return []

    gpus = _safe(lambda: describe_gpus(drv, nvrtc), listing_failed)
    checks.append(_guard("GPUs", "cuda", lambda: check_gpu_count(gpus, drv, driver)))
    checks += [_guard(f"GPU {g['index']}", "cuda", functools.partial(check_gpu, g)) for g in gpus]
    peer, matrix = _safe(
        lambda: check_peer_access(len(gpus)), lambda msg: (Check("peer access", ERROR, msg, "check `nvidia-smi topo -m`", "cuda"), None)
    )
    topo, topology = _safe(check_topology, lambda msg: (Check("topology", ERROR, f"`nvidia-smi topo -m`: {msg}"), None))
    checks += [peer, topo, _guard("nccl", "info", check_nccl)]

    archs = sorted({g["arch"] for g in gpus})
    filled = []
    if fill is not None:
        filled = fill_cache(fill or archs)
        if not (fill or archs):
            filled = [{"arch": "-", "path": None, "seconds": 0.0, "error": "no GPU visible: name the archs, e.g. --fill-cache sm_90"}]
    kernels, nvrtc_archs = _safe(lambda: check_kernels(gpus), lambda msg: (Check("kernels", ERROR, msg, "reinstall rsccl", "cuda"), archs))
    checks.append(kernels)
    checks.append(_guard("kernel cache", "info", lambda: check_kernel_cache(nvrtc_archs)))
    checks.append(_guard("address space", "info", check_address_space))

    report = Report(checks, gpus, matrix, topology, relevant_env(), rows, filled, cpu_ok)
    decide(report)
    return report


def decide(report: Report) -> None:
    """Apply the exit-status rule of the module docstring."""
    no_gpu = not report.gpus
    cuda_needed = not (no_gpu and report.cpu_ok)
    for c in report.checks:
        needed = c.needed_by == "all" or (c.needed_by == "cuda" and cuda_needed)
        if needed and c.status in FAILED:
            report.problems.append({"check": c.name, "problem": c.summary, "fix": c.fix or ""})
        elif c.status == WARN:
            report.warnings.append({"check": c.name, "problem": c.summary, "fix": c.fix or ""})
    for f in report.filled_cache:
        if f["error"]:
            report.problems.append({"check": "fill cache", "problem": f"{f['arch']}: {f['error']}", "fix": "see the nvrtc check"})
    report.exit_code = 1 if report.problems else 0
    if report.problems:
        report.verdict = "rsccl's CUDA engine cannot work here" if cuda_needed else "rsccl's CPU engine cannot work here"
    elif no_gpu:
        report.verdict = "no GPU: rsccl's CPU engine works here (accepted by --cpu-ok)"
    else:
        report.verdict = f"rsccl's CUDA engine can work here ({len(report.gpus)} GPU(s))"


RULE = "exit 0: the CUDA engine can work (or, with --cpu-ok, no GPU and the CPU engine works); 1: a problem below; 2: bad arguments"


def as_dict(report: Report) -> dict[str, Any]:
    d = asdict(report)
    d["rule"] = RULE
    d["checks"] = {
        c.name: {"status": c.status, "summary": c.summary, "fix": c.fix, "needed_by": c.needed_by, **c.data} for c in report.checks
    }
    return d


def render(report: Report) -> str:
    lines = [f"rsccl doctor on {socket.gethostname()}"]
    width = max(len(c.name) for c in report.checks)
    for c in report.checks:
        lines.append(f"  {c.status:<8} {c.name:<{width}}  {c.summary}")
    for f in report.filled_cache:
        lines.append(f"  filled cache: {f['arch']}: {f['path'] or f['error']} ({f['seconds']} s)")
    if report.peer_access is not None:
        n = len(report.peer_access)
        lines += ["", "peer access (row GPU can access column GPU):", "      " + " ".join(f"{j:>3}" for j in range(n))]
        for i, row in enumerate(report.peer_access):
            lines.append(f"  {i:>3} " + " ".join(f"{'-' if i == j else ('yes' if v else 'NO'):>3}" for j, v in enumerate(row)))
    if report.topology:
        lines += ["", "nvidia-smi topo -m:"] + ["  " + line for line in report.topology.splitlines()]
    env = ", ".join(f"{k}={v}" for k, v in report.env.items()) or "none set"
    lines += ["", f"environment (RSCCL_*, CUDA_VISIBLE_DEVICES): {env}", "", "settings:"]
    try:
        lines.append(rsccl.settings_table())
    except Exception as e:  # noqa: BLE001
        lines.append(f"  (unavailable: {type(e).__name__}: {e})")
    for title, items in (("problems", report.problems), ("warnings", report.warnings)):
        if items:
            lines += ["", f"{title} ({len(items)}):"]
            for p in items:
                lines.append(f"  - {p['check']}: {p['problem']}")
                if p["fix"]:
                    lines.append(f"    what to do: {p['fix']}")
    lines += ["", f"result: {report.verdict} -> exit {report.exit_code}", f"rule: {RULE}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rsccl.doctor",
        description="Check whether rsccl's engines can work on this machine.",
        epilog=RULE,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument("--cpu-ok", action="store_true", help="a machine without GPUs passes when the CPU engine works")
    p.add_argument(
        "--fill-cache",
        nargs="*",
        metavar="ARCH",
        help="compile the kernels into the disk cache first, for these archs (sm_90 ...) or, with none named, the visible GPUs'",
    )
    args = p.parse_args(argv)
    report = diagnose(cpu_ok=args.cpu_ok, fill=args.fill_cache)
    print(json.dumps(as_dict(report), indent=1) if args.json else render(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
