"""The doctor put together: every check, the exit-status rule (rsccl/doctor/__init__.py), the
text and JSON reports, and the command line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import time
from dataclasses import asdict
from typing import Any

import rsccl

from .. import _cuda, _rsccl
from .checks import (
    ERROR,
    FAILED,
    WARN,
    Check,
    Report,
    _guard,
    _safe,
    check_address_space,
    check_host_shared_memory,
    check_kernel_cache,
    check_kernels,
    check_nccl,
    check_rsccl,
    check_settings,
    check_torch,
    relevant_env,
    settings_rows,
)
from .gpu import (
    check_gpu,
    check_gpu_count,
    check_nvrtc,
    check_nvrtc_vs_driver,
    check_peer_access,
    check_topology,
    describe_gpus,
    load_driver,
)


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
