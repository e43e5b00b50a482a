"""How many SMs each collective's kernel occupies, per backend (issue 17, target 3), as far as
it can be known: a kernel's grid is its number of CTAs (thread blocks); a CTA runs on one SM,
so the SMs a kernel takes are at most its CTAs (fewer where the GPU places several on one SM).

- rsccl: the grid its engine decided and reports (rsccl.memory_stats() of the default group,
  read in the ranks after their first collectives: `cuda_blocks` for every collective kernel,
  `cuda_p2p_blocks` for each send and each recv kernel; rust/core/src/cuda/decide.rs
  `grids_that_fit`). Nothing is recomputed here.
- NCCL: it does not report the grid it launches. What the environment bounds it to
  (NCCL_MIN_CTAS / NCCL_MAX_CTAS, NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS: one CTA per channel)
  is given when set; otherwise "NCCL's choice, not reported".
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import P2P

NCCL_CTA_VARIABLES = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_CTA_POLICY")
NOT_REPORTED = "NCCL's choice, not reported"


def nccl_cta_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of NCCL_CTA_VARIABLES set in `env` (what the ranks inherit)."""
    return {k: env[k] for k in NCCL_CTA_VARIABLES if env.get(k, "").strip()}


def nccl_ctas(env: Mapping[str, str]) -> str:
    """What can honestly be said about NCCL's grid from the variables set (nccl_cta_env)."""
    lo = [env[k] for k in ("NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS") if k in env]
    hi = [env[k] for k in ("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS") if k in env]
    if not env:
        return NOT_REPORTED
    given = ", ".join(f"{k}={v}" for k, v in env.items())
    if lo and hi and len(set(lo + hi)) == 1:
        return f"{lo[0]} ({given}; the grid NCCL launched is not reported)"
    bound = []
    if lo:
        bound.append(f"at least {max(lo, key=_num)}")
    if hi:
        bound.append(f"at most {min(hi, key=_num)}")
    return f"{' and '.join(bound) or 'set'} ({given}; the grid NCCL launched is not reported)"


def _num(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return float("inf")


def rsccl_ctas(stats: Mapping[str, object], collective: str) -> int | None:
    """The grid of rsccl's kernel for `collective` as its engine reports it, or None if the
    stats lack it (a group without the CUDA engine, or an rsccl that does not report it)."""
    key = "cuda_p2p_blocks" if collective == P2P else "cuda_blocks"
    v = stats.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def rsccl_cell(per_rank: list[Mapping[str, object]], collective: str) -> str:
    """rsccl's grid for `collective` on every rank ("n/a" if not reported); the ranks agree on
    it at group creation, so one figure, else each rank's."""
    got = [rsccl_ctas(s, collective) for s in per_rank]
    if not got or all(g is None for g in got):
        return "n/a (not in memory_stats)"
    if len(set(got)) == 1:
        return str(got[0])
    return " / ".join("n/a" if g is None else str(g) for g in got) + " (per rank)"


def cta_rows(meta: dict, collectives: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(collective, rsccl CTAs, nccl CTAs) per collective benchmarked."""
    stats = meta.get("rsccl_memory_stats") or []
    nccl = nccl_ctas(meta.get("nccl_cta_env") or {})
    return [(c, rsccl_cell(stats, c), nccl) for c in collectives]


def cta_markdown(meta: dict, collectives: list[str] | tuple[str, ...]) -> list[str]:
    """The "SMs per collective" section of bench_cuda_w<world>.md (empty without the stats)."""
    if not meta.get("rsccl_memory_stats"):
        return []
    sms = meta.get("sms")
    out = [
        "",
        "## SMs per collective kernel (CTAs)",
        "",
        (
            f"The grid (CTAs, thread blocks) of each collective's kernel; a CTA runs on one SM, so the SMs a kernel "
            f"takes are at most its CTAs, of the GPU's {sms if sms else '?'} SMs. rsccl: as its engine reports it "
            "(rsccl.memory_stats() of the default group: cuda_blocks for every collective kernel, cuda_p2p_blocks for "
            "each send and each recv kernel; rsccl-pool is the same group, the --sweep-one-shot groups have the same "
            "options). NCCL: bounded only by NCCL_MIN/MAX_CTAS or NCCL_MIN/MAX_NCHANNELS when set; it does not report "
            "the grid it launched."
        ),
        "",
        "| collective | rsccl CTAs | nccl CTAs |",
        "|---|---:|---|",
    ]
    out += [f"| {c} | {rs} | {nc} |" for c, rs, nc in cta_rows(meta, collectives)]
    return out


def cta_summary_lines(world: int, meta: dict, collectives: list[str] | tuple[str, ...]) -> list[str]:
    """One line: rsccl's grid per collective (grouped where equal) and what is known of NCCL's."""
    rows = cta_rows(meta, collectives)
    if not rows or not meta.get("rsccl_memory_stats"):
        return []
    groups: dict[str, list[str]] = {}
    for c, rs, _ in rows:
        groups.setdefault(rs, []).append(c)
    sms = meta.get("sms")
    rs_text = "; ".join(f"{','.join(cs)} {rs}" for rs, cs in groups.items())
    return [f"w{world} CTAs per kernel (of {sms if sms else '?'} SMs): rsccl {rs_text}; nccl {rows[0][2]}"]
