"""The CUDA bench's overlap section and its CTAs report, the parts that run without a GPU: the
command line and its validation, the ABBA order, the host's issue order, the medians and
spreads, the verdict, and the Markdown and summary built from fabricated results (the
section itself runs on a machine with 2+ GPUs: `python -m rsccl.bench --device cuda --quick`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rsccl.bench.cli import parse_args
from rsccl.bench.cuda import ctas, overlap, overlap_config, overlap_report
from rsccl.bench.cuda.config import Config

MiB = 1 << 20


def one_mib_config(collectives: tuple[str, ...], **fields) -> Config:
    """A bench Config of one 1 MiB size, one repeat, no graphs (the CUDA fields the tests set)."""
    return Config(
        collectives=collectives,
        sizes=(MiB,),
        dtype="bfloat16",
        iters=None,
        warmup=1,
        repeats=1,
        seed=1,
        graph=False,
        graph_max_bytes=MiB,
        check_max_bytes=MiB,
        symm_max_bytes=MiB,
        sweep_one_shot=False,
        **fields,
    )


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSCCL_")}
    return subprocess.run([sys.executable, "-m", "rsccl.bench", *args], check=False, capture_output=True, text=True, env=env, timeout=120)


# -- command line ---------------------------------------------------------------------------------


def test_overlap_is_on_for_cuda_reduced_with_quick_and_flags_override_either():
    full = parse_args(["--device", "cuda"])
    assert full.overlap is True and full.overlap_config == overlap_config.OverlapConfig()
    assert full.overlap_config.sizes == (64 * MiB, 128 * MiB, 256 * MiB) and full.overlap_config.matmul == 8192
    quick = parse_args(["--device", "cuda", "--quick"])
    assert quick.overlap is True and quick.overlap_config == overlap_config.QUICK
    given = parse_args(
        ["--device", "cuda", "--quick", "--overlap-matmul", "4096", "--overlap-bytes", "64MiB,256MiB", "--overlap-repeats", "5"]
    )
    c = given.overlap_config
    assert (c.matmul, c.sizes, c.repeats) == (4096, (64 * MiB, 256 * MiB), 5)
    assert (c.matmuls, c.rounds) == (overlap_config.QUICK.matmuls, overlap_config.QUICK.rounds)  # the rest stays --quick's
    assert parse_args(["--device", "cuda", "--no-overlap"]).overlap is False
    assert parse_args([]).overlap is False  # --device cpu has no such section


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--overlap-matmul", "1000"], "--overlap-matmul 1000: give a multiple of 64 from 64 to 32768"),
        (["--overlap-matmul", "65536"], "--overlap-matmul 65536: give a multiple of 64"),
        (["--overlap-matmuls", "0"], "--overlap-matmuls 0: give at least 1"),
        (["--overlap-rounds", "-1"], "--overlap-rounds -1: give at least 1"),
        (["--overlap-repeats", "2"], "--overlap-repeats 2: give at least 3"),
        (["--overlap-bytes", "512B,64MiB"], "--overlap-bytes 512 B: each size must be from 1 KiB to 4 GiB"),
        (["--overlap-bytes", "64MiB,8GiB"], "--overlap-bytes 8 GiB: each size must be from 1 KiB to 4 GiB"),
        (["--overlap-bytes", "64MiB,64MiB"], "a size is given twice"),
        (["--overlap-bytes", "64XB"], "'64XB' is not a size"),
    ],
)
def test_bad_overlap_settings_are_refused_naming_the_flag(flags, message):
    r = run_bench("--device", "cuda", *flags)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr


def test_bad_overlap_settings_pass_with_no_overlap_and_overlap_flags_are_refused_on_cpu():
    assert parse_args(["--device", "cuda", "--no-overlap", "--overlap-repeats", "1"]).overlap is False
    r = run_bench("--overlap-matmul", "4096", "--overlap-bytes", "64MiB")
    assert r.returncode == 2
    assert "--overlap-matmul, --overlap-bytes: only with --device cuda" in r.stderr, r.stderr


def test_every_problem_of_a_configuration_is_named():
    assert overlap_config.config_problems(overlap_config.OverlapConfig()) == []
    assert overlap_config.config_problems(overlap_config.QUICK) == []
    bad = overlap_config.OverlapConfig(matmul=100, matmuls=0, sizes=(), rounds=0, repeats=1)
    got = overlap_config.config_problems(bad)
    assert len(got) == 5, got
    for flag in ("--overlap-matmul 100", "--overlap-matmuls 0", "--overlap-rounds 0", "--overlap-repeats 1", "--overlap-bytes"):
        assert any(p.startswith(flag) for p in got), (flag, got)


# -- pure parts of the section --------------------------------------------------------------------


def test_abba_order_runs_each_backend_repeats_times_alternating():
    assert overlap.abba_order(("nccl", "rsccl"), 3) == ["nccl", "rsccl", "rsccl", "nccl", "nccl", "rsccl"]
    assert overlap.abba_order(["nccl", "rsccl", "rsccl-pool"], 4) == [
        *("nccl", "rsccl", "rsccl-pool"),
        *("rsccl-pool", "rsccl", "nccl"),
        *("nccl", "rsccl", "rsccl-pool"),
        *("rsccl-pool", "rsccl", "nccl"),
    ]


@pytest.mark.parametrize(("matmuls", "calls"), [(20, 96), (8, 16), (5, 3), (1, 1), (7, 1)])
def test_interleave_keeps_both_queues_fed_in_proportion(matmuls, calls):
    seq = overlap.interleave(matmuls, calls)
    assert seq.count("m") == matmuls and seq.count("c") == calls and len(seq) == matmuls + calls
    assert seq[0] == "c"  # the side stream starts at once
    # Before the k-th matmul is issued, about k x calls / matmuls collectives are (within one).
    done = 0
    k = 0
    for what in seq:
        if what == "c":
            done += 1
            continue
        assert abs(done - k * calls / matmuls) <= 1, (seq, k, done)
        k += 1


def test_spread_gives_median_min_max_and_relative_spread():
    s = overlap.spread([3.0, 1.0, 2.0, 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "spread": pytest.approx(9.0 / 2.5), "n": 4}
    assert overlap.spread([4.0])["spread"] == 0.0
    with pytest.raises(ValueError):
        overlap.spread([])


def run(mm: float, co: float, tot: float, mm_part: float | None = None) -> dict:
    return {"matmul_ms": mm, "collectives_ms": co, "total_ms": tot, "matmul_in_overlap_ms": mm_part or mm, "wall_ms": tot + 0.5}


def fabricated(rs_totals: list[float], nc_totals: list[float]) -> dict:
    """An overlap result as rank 0 saves it: NCCL runs 1-3 and rsccl runs 1-3 (ABBA)."""
    return {
        "config": {"matmul": 8192, "matmuls": 20, "sizes": [64 * MiB, 256 * MiB], "rounds": 16, "repeats": 3},
        "describe": "fabricated",
        "order": overlap.abba_order(("nccl", "rsccl"), 3),
        "calls": [["all_gather_into_tensor", 64 * MiB], ["reduce_scatter_tensor", 64 * MiB]],
        "sms": 132,
        "runs": {
            "nccl": [run(20.0, 12.0, t) for t in nc_totals],
            "rsccl": [run(19.0 + k, 10.0, t) for k, t in enumerate(rs_totals)],
        },
        "checks": {"nccl": "ok", "rsccl": "ok"},
        "errors": {},
        "skipped": {},
    }


def test_summary_medians_ratios_and_paired_ratios():
    ov = fabricated([27.0, 25.0, 30.0], [28.0, 26.0, 32.0])
    stats = overlap.summarize(ov["runs"])
    rs = stats["rsccl"]
    assert rs["total_ms"]["median"] == 27.0 and (rs["total_ms"]["min"], rs["total_ms"]["max"]) == (25.0, 30.0)
    assert rs["matmul_ms"]["median"] == 20.0  # 19, 20, 21
    # Ratios per run, then the median: 27/19, 25/20, 30/21 = 1.4211, 1.25, 1.4286.
    assert rs["total_over_matmul"]["median"] == pytest.approx(27.0 / 19.0)
    assert rs["total_over_serial"]["median"] == pytest.approx(27.0 / 29.0)  # 27/29, 25/30, 30/31
    assert overlap.paired_ratios(ov["runs"], "rsccl", "nccl") == pytest.approx([27 / 28, 25 / 26, 30 / 32])
    ratio, pairs = overlap_report.vs_reference(ov, "rsccl")
    assert ratio == pytest.approx(27.0 / 28.0) and len(pairs) == 3


def test_verdict_reads_the_target_on_medians():
    met = overlap_report.verdict(fabricated([24.0, 26.0, 25.0], [28.0, 27.0, 30.0]))  # 25 / 28 = 0.893
    assert met.startswith("rsccl total / nccl total 0.893x") and met.endswith("target <= 0.95x: met"), met
    close = overlap_report.verdict(fabricated([27.0, 26.0, 27.5], [28.0, 27.0, 30.0]))  # 27 / 28 = 0.964
    assert "0.964x" in close and close.endswith("NOT MET"), close
    missing = fabricated([25.0], [28.0])
    missing["runs"].pop("nccl")
    assert "n/a" in overlap_report.verdict(missing)


def meta_with(stats: list[dict], env: dict[str, str] | None = None) -> dict:
    return {"rsccl_memory_stats": stats, "nccl_cta_env": env or {}, "sms": 132}


def test_overlap_markdown_rows_checks_and_problems():
    ov = fabricated([24.0, 26.0, 25.0], [28.0, 27.0, 30.0])
    ov["checks"]["rsccl"] = "WRONG: differs from nccl alone (rank 1: reduce_scatter_tensor 64 MiB max |diff| 3)"
    md = "\n".join(overlap_report.overlap_markdown(ov, meta_with([{"cuda_blocks": 24, "cuda_p2p_blocks": 8}] * 2)))
    rows = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| rsccl") or line.startswith("| nccl")}
    assert set(rows) == {"| rsccl", "| nccl"}
    rs = rows["| rsccl"]
    assert "| 25.00 (24.00-26.00) |" in rs  # total: median (min-max)
    assert "| 20.00 (19.00-21.00) |" in rs  # matmul alone
    assert "| 0.893x |" in rs and "| 24 |" in rs and "WRONG" in rs
    assert "| 28.00 (27.00-30.00) |" in rows["| nccl"] and ctas.NOT_REPORTED in rows["| nccl"]
    assert "Verdict: rsccl total / nccl total 0.893x" in md
    assert "nccl rsccl rsccl nccl nccl rsccl (ABBA)" in md
    problems = overlap_report.overlap_problems(2, ov)
    assert problems == [f"w2 overlap rsccl: {ov['checks']['rsccl']}"]
    lines = overlap_report.overlap_summary_lines(2, ov)
    assert lines[0].startswith("w2 overlap (matmul 8192^3 x 20, 16 rounds): nccl total 28.00 ms (spread 10.7%), 1.40x matmul alone")
    assert any("WRONG" in line for line in lines[1:])


def test_a_failed_backend_fails_the_run_and_a_left_out_pool_does_not():
    ov = fabricated([25.0, 25.0, 25.0], [28.0, 28.0, 28.0])
    assert overlap_report.overlap_problems(4, ov) == []
    ov["skipped"]["rsccl-pool"] = "overlap rsccl-pool: buffers: rank 0: OutOfMemoryError: pool full"
    assert overlap_report.overlap_problems(4, ov) == []
    assert "overlap rsccl-pool left out: " in "\n".join(overlap_report.overlap_markdown(ov, meta_with([])))
    ov["errors"]["rsccl"] = "overlap rsccl: both: rank 1: RuntimeError: boom"
    assert overlap_report.overlap_problems(4, ov) == ["w4 overlap rsccl: overlap rsccl: both: rank 1: RuntimeError: boom"]
    assert overlap_report.overlap_problems(4, None) == [] and overlap_report.overlap_markdown(None, {}) == []


# -- CTAs -------------------------------------------------------------------------------------------


def test_rsccl_ctas_come_from_the_engines_stats():
    st = {"cuda_blocks": 24, "cuda_p2p_blocks": 8}
    assert ctas.rsccl_ctas(st, "all_reduce") == 24 and ctas.rsccl_ctas(st, "all_to_all_single") == 24
    assert ctas.rsccl_ctas(st, "send_recv") == 8
    assert ctas.rsccl_ctas({"engine": "host"}, "all_reduce") is None
    assert ctas.rsccl_cell([st, st], "reduce_scatter_tensor") == "24"
    assert ctas.rsccl_cell([st, {"cuda_blocks": 16}], "all_reduce") == "24 / 16 (per rank)"
    assert ctas.rsccl_cell([], "all_reduce").startswith("n/a")
    ce = {**st, "cuda_copy_engine_min_bytes": 4 << 20}
    assert ctas.rsccl_cell([ce, ce], "all_gather_into_tensor") == "24; from 4 MiB: 0 (copy engines; 1-CTA barrier kernels)"
    assert ctas.rsccl_cell([ce, ce], "reduce_scatter_tensor") == (
        "24; from 4 MiB: 16 (a reduce kernel per round; copy engines move the data; 1-CTA barrier kernels)"
    )
    few = {**ce, "cuda_blocks": 8}
    assert ctas.rsccl_cell([few, few], "reduce_scatter_tensor").startswith("8; from 4 MiB: 8 (a reduce kernel")
    assert ctas.rsccl_cell([ce, ce], "all_reduce") == "24"
    off = {**st, "cuda_copy_engine_min_bytes": 0}
    assert ctas.rsccl_cell([off, off], "all_gather_into_tensor") == "24"
    # The small grid (decide::grid), where the engine reports one below its grid; never for
    # all_to_all and send/recv.
    sm = {**st, "cuda_small_blocks": 16, "cuda_small_max_bytes": 64 << 10}
    assert ctas.rsccl_cell([sm, sm], "all_reduce") == "16 up to 64 KiB, 24 above"
    assert ctas.rsccl_cell([sm, sm], "all_to_all_single") == "24"
    assert ctas.rsccl_cell([sm, sm], "send_recv") == "8"
    assert ctas.rsccl_cell([{**sm, "cuda_small_blocks": 24}] * 2, "all_reduce") == "24"
    assert ctas.rsccl_cell([sm, st], "all_reduce") == "24"
    # The low-latency kernels take the small grid up to 16 KiB per rank: in the bench's sizes
    # 128 KiB of all_gather output or reduce_scatter input at 8 ranks, 16 KiB of all_reduce.
    ll = {**sm, "cuda_low_latency_max_bytes": 16 << 10}
    assert ctas.rsccl_cell([ll] * 8, "all_gather_into_tensor") == "16 up to 128 KiB, 24 above"
    assert ctas.rsccl_cell([ll] * 8, "reduce_scatter_tensor") == "16 up to 128 KiB, 24 above"
    assert ctas.rsccl_cell([ll] * 8, "all_reduce") == "16 up to 64 KiB, 24 above"
    assert ctas.rsccl_cell([ll] * 2, "all_gather_into_tensor") == "16 up to 64 KiB, 24 above"
    sm_ce = {**sm, "cuda_copy_engine_min_bytes": 4 << 20}
    assert ctas.rsccl_cell([sm_ce], "all_gather_into_tensor") == (
        "16 up to 64 KiB, 24 above; from 4 MiB: 0 (copy engines; 1-CTA barrier kernels)"
    )


def test_nccls_ctas_are_only_what_the_environment_bounds():
    assert ctas.nccl_ctas({}) == "NCCL's choice, not reported"
    env = ctas.nccl_cta_env({"NCCL_MIN_CTAS": "8", "NCCL_MAX_CTAS": "8", "NCCL_DEBUG": "INFO", "NCCL_MAX_NCHANNELS": ""})
    assert env == {"NCCL_MIN_CTAS": "8", "NCCL_MAX_CTAS": "8"}
    assert ctas.nccl_ctas(env).startswith("8 (NCCL_MIN_CTAS=8, NCCL_MAX_CTAS=8;")
    assert ctas.nccl_ctas({"NCCL_MAX_CTAS": "16", "NCCL_MAX_NCHANNELS": "4"}).startswith("at most 4 (")
    assert ctas.nccl_ctas({"NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "32"}).startswith("at least 2 and at most 32 (")
    assert "not reported" in ctas.nccl_ctas({"NCCL_MAX_CTAS": "16"})


def test_cta_table_and_summary_per_collective():
    meta = meta_with([{"cuda_blocks": 32, "cuda_p2p_blocks": 4}] * 2, {"NCCL_MAX_CTAS": "16"})
    collectives = ["all_reduce", "all_gather_into_tensor", "send_recv"]
    md = ctas.cta_markdown(meta, collectives)
    assert "| all_reduce | 32 | at most 16 (NCCL_MAX_CTAS=16; the grid NCCL launched is not reported) |" in md
    assert "| send_recv | 4 | at most 16 (NCCL_MAX_CTAS=16; the grid NCCL launched is not reported) |" in md
    (line,) = ctas.cta_summary_lines(2, meta, collectives)
    assert line.startswith("w2 CTAs per kernel (of 132 SMs): rsccl all_reduce,all_gather_into_tensor 32; send_recv 4; nccl at most 16"), (
        line
    )
    assert ctas.cta_markdown({}, collectives) == [] and ctas.cta_summary_lines(2, {}, collectives) == []


def test_world_report_has_the_ctas_and_overlap_sections():
    from rsccl.bench.cuda.report import world_markdown

    cfg = one_mib_config(("all_gather_into_tensor", "reduce_scatter_tensor"), overlap=overlap_config.QUICK)
    meta = meta_with([{"cuda_blocks": 64, "cuda_p2p_blocks": 16}] * 2)
    meta["overlap"] = fabricated([24.0, 26.0, 25.0], [28.0, 27.0, 30.0])
    md = world_markdown(2, {"meta": meta, "rows": [], "done": True}, [], "", cfg, "python -m rsccl.bench --device cuda --quick")
    assert "## SMs per collective kernel (CTAs)" in md and "| reduce_scatter_tensor | 64 | NCCL's choice, not reported |" in md
    assert "## Overlap: bf16 matmuls" in md and "Verdict: rsccl total / nccl total 0.893x" in md
    assert "could not be rendered" not in md, md


def test_kernel_grids_read_from_a_profiler_trace():
    """The shape kineto writes: kernels under cat "kernel" (older: "Kernel") with args "grid"."""
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "args": {"grid": [24, 1, 1], "block": [544, 1, 1]}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "args": {"grid": [16, 1, 1]}},
            {"ph": "X", "cat": "Kernel", "name": "rsccl_all_gather", "args": {"grid": [8, 2, 1], "block": [512, 1, 1]}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "args": {"grid": [99, 1, 1]}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {}},
            {"ph": "X", "cat": "kernel", "name": "no_grid", "args": {"block": [1, 1, 1]}},
            {"ph": "i", "name": "marker"},
        ]
    }
    assert ctas.kernel_grids(trace) == {"ncclDevKernel_AllGather_RING_LL": 24, "rsccl_all_gather": 16}
    assert ctas.kernel_grids({}) == {}


def test_profiled_cells_and_table():
    meta = meta_with([{"cuda_blocks": 64, "cuda_p2p_blocks": 16}] * 2)
    meta["ctas_measured"] = {
        "all_reduce": {
            "rsccl": {str(1 << 30): {"rsccl_allreduce_bf16": 64}, "1024": {"rsccl_allreduce_bf16": 64}},
            "nccl": {"1024": {"ncclDevKernel_AllReduce": 2}, str(1 << 30): {"ncclDevKernel_AllReduce": 32, "other": 1}},
        },
        "send_recv": {"rsccl": {str(1 << 20): "rank 1: RuntimeError: boom"}, "nccl": {str(1 << 20): {}}},
    }
    assert ctas.measured_cell(meta["ctas_measured"]["all_reduce"]["nccl"]) == "1 KiB: 2; 1 GiB: 32+1"
    assert ctas.measured_cell(None) == "n/a"
    md = ctas.cta_markdown(meta, ["all_reduce", "send_recv", "broadcast"])
    assert "| all_reduce | 64 | NCCL's choice, not reported | 1 KiB: 64; 1 GiB: 64 | 1 KiB: 2; 1 GiB: 32+1 |" in md
    assert (
        "| send_recv | 16 | NCCL's choice, not reported | 1 MiB: n/a (rank 1: RuntimeError: boom) | 1 MiB: n/a (no kernel grid in the trace) |"
        in md
    )
    assert "| broadcast | 64 | NCCL's choice, not reported | n/a | n/a |" in md
    lines = ctas.cta_summary_lines(4, meta, ["all_reduce", "send_recv"])
    assert lines[1] == "w4 CTAs profiled all_reduce: rsccl 1 KiB: 64; 1 GiB: 64 | nccl 1 KiB: 2; 1 GiB: 32+1"
    meta["ctas_measured_error"] = "RuntimeError: no CUPTI"
    assert "Profiled grids: FAILED: RuntimeError: no CUPTI" in ctas.cta_markdown(meta, ["all_reduce"])


def test_ctas_profile_is_on_for_cuda_and_refused_on_cpu():
    assert parse_args(["--device", "cuda", "--quick"]).ctas_profile is True
    assert parse_args(["--device", "cuda", "--no-ctas-profile"]).ctas_profile is False
    assert parse_args([]).ctas_profile is False
    r = run_bench("--ctas-profile")
    assert r.returncode == 2 and "--ctas-profile: only with --device cuda" in r.stderr, r.stderr


def test_the_default_groups_pool_holds_the_overlap_sections_pool_buffers():
    """The overlap section's rsccl-pool run holds an all_gather output and a reduce_scatter
    input of every size at once: the default group's pool covers them, however small the
    sweep's sizes (with --max-bytes 1MiB it was sized for the sweep alone, and the overlap's
    rsccl-pool run ran out of pool: 4 H200s, 2026-11-26)."""
    from dataclasses import replace

    from rsccl.bench.cuda.config import pool_options

    cfg = one_mib_config(("all_gather_into_tensor",))
    alone = pool_options(cfg, 4)["cuda_pool_bytes"]
    assert 2 * MiB + 64 * MiB <= alone < 2 * MiB + 64 * MiB + 64 * MiB
    ov = overlap_config.OverlapConfig(sizes=(64 * MiB, 256 * MiB))
    assert ov.pool_bytes() == 2 * (64 + 256) * MiB
    with_overlap = pool_options(replace(cfg, overlap=ov), 4)
    assert with_overlap["cuda_pool_bytes"] >= alone + ov.pool_bytes()
    assert with_overlap["max_cuda_va_bytes"] >= 4 * with_overlap["cuda_pool_bytes"]
    assert pool_options(replace(cfg, overlap=ov, rsccl_options={"cuda_pool_bytes": 96 * MiB}), 4).get("cuda_pool_bytes") is None


def test_overlap_collectives_choose_the_rounds_calls_and_pool():
    """--overlap-collectives runs one of the two alone (to tell its cost apart, e.g. on the
    copy engines), and the calls per window and the pool it needs follow; anything else is
    refused naming the flag."""
    one = parse_args(["--device", "cuda", "--overlap-collectives", "all_gather_into_tensor"]).overlap_config
    both = parse_args(["--device", "cuda"]).overlap_config
    assert one.collectives == ("all_gather_into_tensor",) and both.collectives == overlap_config.OVERLAP_COLLECTIVES
    assert one.calls() * 2 == both.calls() == 16 * 2 * 3
    assert one.pool_bytes() * 2 == both.pool_bytes() == 2 * (64 + 128 + 256) * MiB
    assert "16 x (all_gather_into_tensor) at" in one.describe()
    for given in ("all_reduce", "all_gather_into_tensor,all_gather_into_tensor", ","):
        problems = overlap_config.config_problems(overlap_config.OverlapConfig(collectives=tuple(x for x in given.split(",") if x)))
        assert any(p.startswith("--overlap-collectives") for p in problems), (given, problems)
    r = run_bench("--device", "cuda", "--overlap-collectives", "broadcast")
    assert r.returncode != 0 and "--overlap-collectives broadcast: give one or both of" in r.stderr, r.stderr
