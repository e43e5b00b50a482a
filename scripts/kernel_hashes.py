"""Show that the kernels split by family (csrc_kernels/*.cu) compile to the same machine code
as the single file they came from: compile both with NVRTC (on the CPU, no GPU needed),
without line info, for one arch, and compare every kernel's code (`.text.<kernel>`) and its
parameter and shared-memory sizes.

    python scripts/kernel_hashes.py --old-rev c23fa42 [--arch sm_90] [--jobs 2]

--old-rev names the commit whose csrc_kernels/rsccl_kernels.cu is the single file. Prints
one line per kernel and a summary; exits 1 on any difference (kernels removed on purpose,
the integer AVG entry points, are listed, not counted as differences).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import kernel_image as ki

KDIR = os.path.join(ROOT, "csrc_kernels")


def options(arch: str) -> list[str]:
    # nvrtc.rs's default NVRTC options (no -lineinfo: line numbers differ between the files).
    return [f"--gpu-architecture={arch}", "-default-device", "--std=c++17"]


def compile_one(args: tuple[str, str, dict[str, str], str]) -> tuple[str, bytes, float]:
    name, source, headers, arch = args
    t = time.monotonic()
    cubin = ki.nvrtc_cubin(ki.load_nvrtc(), source, name, headers, options(arch))
    return name, cubin, time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", required=True)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    old = subprocess.run(
        ["git", "-C", ROOT, "show", f"{a.old_rev}:csrc_kernels/rsccl_kernels.cu"], check=True, capture_output=True, text=True
    ).stdout

    def read(name: str) -> str:
        with open(os.path.join(KDIR, name)) as f:
            return f.read()

    headers = {h: read(h) for h in sorted(os.listdir(KDIR)) if h.endswith(".cuh")}
    families = sorted(f for f in os.listdir(KDIR) if f.endswith(".cu") and f != "rsccl_kernels.cu")
    jobs = [("rsccl_kernels.cu", old, {}, a.arch)] + [(f, read(f), headers, a.arch) for f in families]
    # The single file first: it is the longest job.
    with ProcessPoolExecutor(a.jobs) as pool:
        results = list(pool.map(compile_one, jobs))
    before: dict[str, str] = {}
    after: dict[str, tuple[str, str]] = {}
    for name, cubin, secs in results:
        print(f"# {name}: {len(cubin)} bytes, {secs:.1f} s")
        hashes = ki.code_hashes(cubin)
        for k in ki.kernel_names(cubin):
            sig = " ".join(f"{p}={hashes.get(p + k, '-')}" for p in (".text.", ".nv.constant0.", ".nv.shared."))
            if name == "rsccl_kernels.cu":
                before[k] = sig
            else:
                if k in after:
                    print(f"{k}: defined in {after[k][0]} and {name}")
                    return 1
                after[k] = (name, sig)
    same = [k for k in sorted(before) if k in after and after[k][1] == before[k]]
    differ = [k for k in sorted(before) if k in after and after[k][1] != before[k]]
    removed = sorted(set(before) - set(after))
    added = sorted(set(after) - set(before))
    for k in sorted(set(before) | set(after)):
        state = "same" if k in same else "DIFFERS" if k in differ else "removed" if k in removed else "ADDED"
        code = (after[k][1] if k in after else before[k]).split()[0].removeprefix(".text.=")[:16]
        print(f"{k:40s} {after[k][0] if k in after else '-':20s} {code} {state}")
    print(
        f"{a.arch}: {len(same)} kernels with identical code, {len(differ)} differ, {len(removed)} removed ({', '.join(removed) or 'none'}), {len(added)} added"
    )
    return 1 if differ or added else 0


if __name__ == "__main__":
    sys.exit(main())
