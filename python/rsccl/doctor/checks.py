"""The doctor's findings (Check, Report) and the checks that need no GPU driver: rsccl,
torch, shared memory, settings, NCCL, the kernels and their cache, the address space.
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

import rsccl

from .. import _cuda, _rsccl
from .._report import human_bytes

OK, MISSING, ERROR, WARN, INFO, SKIPPED = "ok", "missing", "error", "warn", "info", "skipped"


FAILED = (MISSING, ERROR)


T = TypeVar("T")


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
