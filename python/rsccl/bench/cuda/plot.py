"""The CUDA bench's plot (matplotlib, when it imports)."""

from __future__ import annotations

from pathlib import Path

from ..common import human, pyplot, size_axis
from .config import BACKEND_ORDER, COLORS, SMALL_PLOT_BYTES, Config


def write_png(path: Path, rows: list[dict], cfg: Config, title: str) -> bool:
    """Top: busbw against size per collective; bottom: eager (solid) and graph (dotted)
    latency for sizes up to 1 MiB. False if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    worlds = sorted({r["world_size"] for r in rows})
    markers = ("o", "s", "^", "v")
    styles = ("-", "--", "-.", ":")
    fig, axes = plt.subplots(2, len(collectives), figsize=(6.5 * len(collectives), 9), squeeze=False)
    small = max(SMALL_PLOT_BYTES, cfg.graph_max_bytes)
    for col, collective in enumerate(collectives):
        top, bottom = axes[0][col], axes[1][col]
        for backend in BACKEND_ORDER:
            for world, marker, style in zip(worlds, markers, styles):
                mine = sorted(
                    (
                        r
                        for r in rows
                        if (r["collective"], r["backend"], r["world_size"]) == (collective, backend, world) and r["eager_s"] is not None
                    ),
                    key=lambda r: r["bytes"],
                )
                if not mine:
                    continue
                label = f"{backend}, {world} GPUs"
                top.plot(
                    [r["bytes"] for r in mine],
                    [r["busbw_GBps"] for r in mine],
                    style,
                    marker=marker,
                    color=COLORS[backend],
                    markersize=4,
                    label=label,
                )
                lat = [r for r in mine if r["bytes"] <= small]
                if lat:
                    bottom.plot(
                        [r["bytes"] for r in lat],
                        [r["eager_s"] * 1e6 for r in lat],
                        style,
                        marker=marker,
                        color=COLORS[backend],
                        markersize=4,
                        label=label,
                    )
                    g = [r for r in lat if r["graph_s"] is not None]
                    if g:
                        bottom.plot(
                            [r["bytes"] for r in g],
                            [r["graph_s"] * 1e6 for r in g],
                            ":",
                            marker="x",
                            color=COLORS[backend],
                            markersize=4,
                            alpha=0.7,
                            label="_nolegend_",
                        )
        for ax in (top, bottom):
            size_axis(ax)
            ax.legend(fontsize=6)
        top.set_yscale("log")
        top.set_title(f"{collective}: bus bandwidth")
        top.set_ylabel("busbw (GB/s)")
        bottom.set_title(f"{collective}: latency, sizes <= {human(small)} (dotted, x: CUDA graph)")
        bottom.set_ylabel("us per call")
        bottom.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
