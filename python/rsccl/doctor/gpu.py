"""The doctor's GPU checks: the driver (through libcuda, without a CUDA context), NVRTC, each
GPU's VMM and POSIX-fd support and compute capability, peer access, the topology.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from typing import Any

import torch

from .. import _cuda
from .._report import human_bytes
from .checks import ERROR, INFO, MISSING, OK, SKIPPED, Check

# CUdevice_attribute values (cuda.h; the same in cudarc 0.19's driver bindings, every CUDA
# version they cover).
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103


CUDA_ERROR_NO_DEVICE = 100


# The kernels synchronize with ld.acquire.sys / st.release.sys, which need sm_70; NVRTC 13
# no longer targets anything below sm_75.
MIN_CC_NVRTC12 = (7, 0)


MIN_CC_NVRTC13 = (7, 5)


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
