"""`python -m rsccl.doctor` on this (CPU-only) machine, and rsccl.memory_report on real
multi-process groups: each rank's line shows that rank's own memory_stats."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import resource
import socket
import subprocess
import sys

import pytest
import rsccl
import torch
import torch.distributed as dist
from rsccl import doctor
from rsccl._report import format_report, human_bytes, memory_report

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the doctor's answers on a machine without GPUs")

# --- the doctor --------------------------------------------------------------------------------


def run_doctor(*args: str, env: dict | None = None, rlimit_as: int | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RSCCL_")}
    full_env.update(env or {})

    def limit() -> None:
        if rlimit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (rlimit_as, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-m", "rsccl.doctor", *args],
        check=False,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
        preexec_fn=limit,
    )


def cpu_virtual_bits() -> int | None:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("address sizes"):
                return int(re.search(r"(\d+) bits virtual", line).group(1))
    return None


@no_gpu
def test_doctor_json_reports_no_gpu_and_this_machines_facts(tmp_path):
    fake = tmp_path / "kernels-0123456789abcdef-all_reduce-sm_90.cubin"
    fake.write_bytes(b"\x7fELF")
    r = run_doctor("--json", env={"RSCCL_CACHE_DIR": str(tmp_path), "RSCCL_SPIN_COUNT": "1234"})
    assert r.returncode == 1, r.stderr  # no GPU, no --cpu-ok: the CUDA engine cannot work here
    rep = json.loads(r.stdout)
    checks = rep["checks"]

    assert rep["gpus"] == [] and rep["peer_access"] is None
    assert checks["GPUs"]["status"] == "missing" and checks["GPUs"]["count"] == 0
    assert checks["driver"]["status"] == "missing"  # no libcuda.so.1 on this machine
    assert {p["check"] for p in rep["problems"]} == {"GPUs", "driver"}
    assert all(p["fix"] for p in rep["problems"]), rep["problems"]
    assert rep["exit_code"] == 1 and "cannot work" in rep["verdict"]

    assert checks["rsccl"]["version"] == rsccl.__version__
    assert checks["rsccl"]["path"] == os.path.dirname(os.path.abspath(rsccl.__file__))
    assert (checks["torch"]["version"], checks["torch"]["cuda"]) == (torch.__version__, torch.version.cuda)
    assert checks["shared memory"]["status"] == "ok"

    # The environment's setting is resolved and attributed to it; the rest are defaults.
    settings = {s["field"]: s for s in rep["settings"]}
    assert settings["spin_count"]["value"] == 1234 and settings["spin_count"]["source"] == "env"
    assert settings["host_buffer_bytes"]["value"] == settings["host_buffer_bytes"]["default"] == 4 << 20
    assert rep["env"] == {"RSCCL_CACHE_DIR": str(tmp_path), "RSCCL_SPIN_COUNT": "1234"}
    assert "spin_count=1234" in checks["settings"]["summary"]

    assert checks["kernel cache"]["dir"] == str(tmp_path)
    assert checks["kernel cache"]["builds"] == {"sm_90": ["0123456789abcdef"]}
    assert checks["kernel cache"]["writable"] is True
    # The wheel's kernels: every arch it was built for, and no GPU here to cover.
    assert checks["kernels"]["sass"] == ["sm_80", "sm_90", "sm_100", "sm_120"] and checks["kernels"]["ptx"] == ["compute_120"]
    assert checks["kernels"]["nvcc"].startswith("13.0.") and checks["kernels"]["gpus"] == {}
    assert "prebuilt by nvcc" in checks["kernels"]["summary"]

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    assert checks["address space"]["cpu_virtual_bits"] == cpu_virtual_bits()
    assert checks["address space"]["rlimit_as"] == [
        None if soft == resource.RLIM_INFINITY else soft,
        None if hard == resource.RLIM_INFINITY else hard,
    ]
    # The doctor imported torch: its own mappings are at least a few hundred MiB.
    assert checks["address space"]["process_va_bytes"] > 256 << 20

    try:
        nvrtc_pkg = importlib.metadata.version("nvidia-cuda-nvrtc")
    except importlib.metadata.PackageNotFoundError:
        nvrtc_pkg = None
    if nvrtc_pkg is not None:
        assert checks["nvrtc"]["status"] == "ok"
        assert checks["nvrtc"]["version"] == [int(x) for x in nvrtc_pkg.split(".")[:2]]
        assert os.path.basename(checks["nvrtc"]["path"]).startswith("libnvrtc.so")
    nccl_pkgs = [d.version for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").startswith("nvidia-nccl")]
    if nccl_pkgs:
        assert checks["nccl"]["status"] == "ok" and checks["nccl"]["version"] == nccl_pkgs[0]


@no_gpu
def test_doctor_cpu_ok_passes_without_gpu_and_text_names_the_rule():
    r = run_doctor("--cpu-ok")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert re.match(r"\s+missing\s+GPUs\s+none visible", next(line for line in lines if " GPUs " in line))
    assert "problems (" not in r.stdout  # the missing driver and GPU are not needed with --cpu-ok
    assert lines[-2] == "result: no GPU: rsccl's CPU engine works here (accepted by --cpu-ok) -> exit 0"
    assert lines[-1].startswith("rule: exit 0: the CUDA engine can work")
    assert "| `host_buffer_bytes` | `RSCCL_HOST_BUFFER_BYTES` | 4 MiB |" in r.stdout  # the settings table


@no_gpu
def test_doctor_fails_on_a_bad_setting_and_says_what_to_do():
    r = run_doctor("--cpu-ok", env={"RSCCL_P2P_BUFFER_BYTES": "lots"})
    assert r.returncode == 1, r.stdout
    problems = r.stdout.split("problems (1):", 1)[1].splitlines()
    assert problems[1].startswith("  - settings: ") and "RSCCL_P2P_BUFFER_BYTES" in problems[1]
    assert problems[2].startswith("    what to do: fix or unset that variable")


@no_gpu
def test_doctor_warns_about_a_finite_address_space_limit():
    limit = 64 << 30
    r = run_doctor("--json", "--cpu-ok", rlimit_as=limit)
    rep = json.loads(r.stdout)
    assert r.returncode == 0  # a warning, not a problem
    assert rep["checks"]["address space"]["status"] == "warn"
    assert rep["checks"]["address space"]["rlimit_as"][0] == limit
    assert [w["check"] for w in rep["warnings"]] == ["address space"] and "ulimit -v" in rep["warnings"][0]["fix"]


@no_gpu
def test_doctor_fill_cache_without_gpu_needs_an_arch():
    r = run_doctor("--json", "--cpu-ok", "--fill-cache")
    rep = json.loads(r.stdout)
    assert r.returncode == 1
    assert rep["problems"][0]["check"] == "fill cache" and "--fill-cache sm_90" in rep["problems"][0]["problem"]


def fake_gpu(**over) -> dict:
    g = {
        "index": 0,
        "name": "NVIDIA H200",
        "memory_bytes": 150109880320,
        "compute_capability": [9, 0],
        "arch": "sm_90",
        "pci_bus_id": "00000000:18:00.0",
        "vmm": True,
        "posix_fd": True,
        "errors": [],
        "min_compute_capability": [7, 5],
    }
    return {**g, **over}


def test_gpu_check_names_what_the_cuda_engine_lacks():
    ok = doctor.check_gpu(fake_gpu())
    assert (ok.status, ok.summary) == ("ok", "NVIDIA H200, 140 GiB, sm_90, 00000000:18:00.0, VMM yes, POSIX-fd handles yes")
    vgpu = doctor.check_gpu(fake_gpu(vmm=False, posix_fd=False))
    assert vgpu.status == "missing" and "VMM (cuMemCreate" in vgpu.summary and "POSIX-fd handles, which" in vgpu.summary and vgpu.fix
    old = doctor.check_gpu(fake_gpu(compute_capability=[7, 0], arch="sm_70"))
    assert old.status == "missing" and "compute capability 7.5" in old.summary


def test_exit_rule():
    """No GPU fails unless --cpu-ok; a CUDA-only failure then does not count, an
    every-engine failure always does; warnings never do."""

    def report(cpu_ok: bool, gpus: list, *checks: doctor.Check) -> doctor.Report:
        r = doctor.Report(list(checks), gpus, None, None, {}, [], [], cpu_ok)
        doctor.decide(r)
        return r

    no_driver = doctor.Check("driver", "missing", "no libcuda", "install it", "cuda")
    bad_env = doctor.Check("settings", "error", "RSCCL_X bad", "fix it", "all")
    cache = doctor.Check("kernel cache", "warn", "sm_90 not cached", "fill it")
    assert report(False, [], no_driver).exit_code == 1
    r = report(True, [], no_driver, cache)
    assert (r.exit_code, r.problems, [w["check"] for w in r.warnings]) == (0, [], ["kernel cache"])
    assert [p["check"] for p in report(True, [], no_driver, bad_env).problems] == ["settings"]
    assert report(True, [fake_gpu()], no_driver).exit_code == 1  # --cpu-ok does not excuse a broken GPU machine
    assert report(False, [fake_gpu()], cache).exit_code == 0


# --- memory_report: the table, from given figures ------------------------------------------------


def test_human_bytes():
    cases = {
        0: "0 B",
        1023: "1023 B",
        1024: "1 KiB",
        4218880: "4.02 MiB",
        64 << 20: "64 MiB",
        3 << 29: "1.5 GiB",
        200 * (1 << 30) + 1: "200 GiB",
    }
    assert {n: human_bytes(n) for n in cases} == cases


def split_table(text: str) -> tuple[str, list[dict[str, str]], str]:
    """(title, one dict per rank line keyed by header, legend); cells are separated by 2+ spaces."""
    lines = text.splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    rows = [dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=True)) for line in lines[2:-1]]
    return lines[0], rows, lines[-1]


def test_format_report_shows_the_pool_figures_of_cuda_ranks():
    """CUDA figures as the pool contract names them: each rank's own in its line."""

    def row(rank: int, inplace: int) -> dict:
        stats = {
            "engine": "host",
            "host_region_bytes": 23216128,
            "host_mapped_bytes": 23216128,
            "collectives": 2 + rank,
            "p2p_messages": 0,
            "staged_bytes": 4096,
            "cuda_device": rank,
            "cuda_va_reserved_bytes": 2 * (1 << 30),
            "cuda_mapped_own_bytes": 576 << 20,
            "cuda_mapped_peer_bytes": 576 << 20,
            "cuda_in_use_bytes": 64 << 20,
            "cuda_pool_bytes": 512 << 20,
            "cuda_pool_allocated_bytes": (100 + rank) << 20,
            "cuda_pool_peak_bytes": 300 << 20,
            "cuda_inplace_collectives": inplace,
            "cuda_inplace_bytes": inplace * (3 << 29),
            "cuda_staged_collectives": 7,
            "cuda_staged_bytes": 7 << 10,
        }
        return {"rank": rank, "global_rank": rank, "host": "node-a", "pid": 1, "process_va_bytes": 300 << 30, "stats": stats}

    title, rows, legend = split_table(format_report([row(1, 2), row(0, 3)], "T"))
    assert title == "T"
    assert [r["rank"] for r in rows] == ["0", "1"]
    assert rows[0] == {
        "rank": "0",
        "host": "node-a",
        "engine": "host",
        "gpu": "0",
        "rsccl VA": human_bytes(2 * (1 << 30) + 23216128),
        "process VA": "300 GiB",
        "mapped own": "576 MiB",
        "mapped peers": "576 MiB",
        "in use": "64 MiB",
        "pool": "512 MiB",
        "pool alloc": "100 MiB",
        "pool peak": "300 MiB",
        "in place": "3 / 4.5 GiB",
        "staged": "7 / 7 KiB",
        "CPU ops": "2 / 4 KiB",
        "p2p": "0",
    }
    assert (rows[1]["pool alloc"], rows[1]["in place"], rows[1]["CPU ops"]) == ("101 MiB", "2 / 3 GiB", "3 / 4 KiB")
    assert "in place: CUDA collectives on pool buffers" in legend
    shared = row(0, 3)
    shared["stats"]["cuda_gpu_sharers"] = 4
    _, rows, legend = split_table(format_report([shared], "T"))
    assert rows[0]["gpu"] == "0 (x4)" and "share it (allow_shared_gpu)" in legend


# --- memory_report on real groups -------------------------------------------------------------------


def body_memory_report(ctx, seed: int) -> dict:
    """Rank r sends r+1 messages to the next rank (p2p counts the sender's messages), so
    every rank's counters differ; then the report, between two readings of its own figures."""
    start = rsccl.memory_stats()
    n = int(torch.randint(1, 100_000, (1,), generator=torch.Generator().manual_seed(seed)))
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed + ctx.rank))
    dist.all_reduce(x)
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    sends = [dist.P2POp(dist.isend, torch.full((100,), float(k)), nxt, tag=k) for k in range(ctx.rank + 1)]
    bufs = [torch.empty(100) for _ in range(prv + 1)]
    recvs = [dist.P2POp(dist.irecv, b, prv, tag=k) for k, b in enumerate(bufs)]
    for w in dist.batch_isend_irecv(sends + recvs):
        w.wait()
    assert all(torch.equal(b, torch.full((100,), float(k))) for k, b in enumerate(bufs))
    before = rsccl.memory_stats()
    text = memory_report()
    after = rsccl.memory_stats()
    return {"start": start, "before": before, "after": after, "text": text, "va": rsccl._cuda.mapped_va_bytes()}


def parse_bytes(s: str) -> float:
    value, unit = s.split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]


def test_memory_report_line_per_rank_matches_its_memory_stats(cluster, seed):
    res = cluster.run(body_memory_report, seed)
    w = cluster.world
    texts = {r["text"] for r in res}
    assert len(texts) == 1, texts  # the same table on every rank
    title, rows, legend = split_table(res[0]["text"])
    assert title == f"rsccl memory report: group '0', {w} ranks"
    assert list(rows[0]) == ["rank", "host", "engine", "rsccl VA", "process VA", "CPU ops", "p2p"]  # no CUDA figures on CPU
    for r, (row, got) in enumerate(zip(rows, res)):
        s = got["before"]
        assert got["before"]["p2p_messages"] - got["start"]["p2p_messages"] == r + 1
        assert row["rank"] == str(r) and row["host"] == socket.gethostname() and row["engine"] == "host"
        assert row["rsccl VA"] == human_bytes(s["host_mapped_bytes"])
        assert row["CPU ops"] == f"{s['collectives']} / {human_bytes(s['staged_bytes'])}"
        assert row["p2p"] == str(s["p2p_messages"])
        # The process's mappings, read inside the report; measured again just after.
        assert abs(parse_bytes(row["process VA"]) - got["va"]) <= 0.02 * got["va"]
        # The figures were read before the report's own gathers: two CPU all_gathers later.
        assert got["after"]["collectives"] == s["collectives"] + 2
    assert "process VA: every mapping of the process" in legend


def body_memory_report_subgroup(ctx) -> dict | None:
    members = [1, 3]
    sub = dist.new_group(members)
    if ctx.rank not in members:
        with pytest.raises(ValueError, match="not a member"):
            memory_report(sub)
        return None
    x = torch.ones(10)
    dist.all_reduce(x, group=sub)
    before = rsccl.memory_stats(sub)
    out = {"text": memory_report(sub), "stats": before, "world": rsccl.memory_stats()}
    dist.destroy_process_group(sub)
    return out


def test_memory_report_of_a_subgroup(cluster4):
    res = cluster4.run(body_memory_report_subgroup)
    assert res[0] is None and res[2] is None
    title, rows, _ = split_table(res[1]["text"])
    assert res[3]["text"] == res[1]["text"]
    assert title.endswith(", 2 ranks")
    assert [(row["rank"], row["global"]) for row in rows] == [("0", "1"), ("1", "3")]
    for row, got in zip(rows, (res[1], res[3])):
        assert row["rsccl VA"] == human_bytes(got["stats"]["host_mapped_bytes"])
        assert row["CPU ops"] == f"{got['stats']['collectives']} / {human_bytes(got['stats']['staged_bytes'])}"
        # Two ranks share a smaller region than the world's four.
        assert got["stats"]["host_mapped_bytes"] < got["world"]["host_mapped_bytes"]


def test_kernels_check_says_where_each_gpus_kernels_come_from(monkeypatch):
    monkeypatch.delenv("RSCCL_KERNELS", raising=False)
    check, nvrtc_archs = doctor.check_kernels([fake_gpu(), fake_gpu(index=1)])
    assert check.status == "ok" and nvrtc_archs == [], check
    assert "sm_90 covered (sm_90 SASS" in check.summary and check.data["gpus"]["sm_90"]["source"] == "prebuilt"
    turing = fake_gpu(name="Tesla T4", compute_capability=[7, 5], arch="sm_75")
    check, nvrtc_archs = doctor.check_kernels([turing])
    assert check.status == "warn" and nvrtc_archs == ["sm_75"] and "sm_75 uses NVRTC" in check.summary, check
    assert "--fill-cache sm_75" in check.fix
    monkeypatch.setenv("RSCCL_KERNELS", "prebuilt")
    check, _ = doctor.check_kernels([turing])
    assert check.status == "error" and check.needed_by == "cuda" and "sm_75" in check.summary, check
    monkeypatch.setenv("RSCCL_KERNELS", "nvrtc")
    check, nvrtc_archs = doctor.check_kernels([fake_gpu()])
    assert check.status == "ok" and nvrtc_archs == ["sm_90"] and "RSCCL_KERNELS=nvrtc" in check.summary, check
