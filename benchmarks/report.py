"""Aggregate benchmark rows into the results table (markdown) and the plot (PNG)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["summarize", "table", "plot"]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repetitions (rank 0's timings; peak is the max over ranks) per (model, backend, method)."""
    timed = [r for r in rows if "seconds" in r]
    accounted = {(r["model"], r["backend"], r["method"]): r["accounted_peak_bytes"] for r in rows
                 if "accounted_peak_bytes" in r and r["rank"] == 0}
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in timed:
        groups[(r["model"], r["backend"], r["method"])].append(r)
    out = []
    for (model, backend, method), items in sorted(groups.items()):
        rank0 = [r for r in items if r["rank"] == 0] or items
        seconds = statistics.median(r["seconds"] for r in rank0)
        out.append(
            {
                "model": model,
                "backend": backend,
                "method": method,
                "seconds": seconds,
                "reps": len(rank0),
                "tensors": rank0[0]["tensors"],
                "bytes": rank0[0]["bytes"],
                "gbps": rank0[0]["bytes"] / seconds / 1e9,
                "peak_extra_bytes": max(r["peak_extra_bytes"] for r in items),
                "peak_source": rank0[0]["peak_source"],
                "accounted_peak_bytes": accounted.get((model, backend, method)),
                "world_size": rank0[0]["world_size"],
            }
        )
    by_key = {(s["model"], s["backend"], s["method"]): s for s in out}
    for s in out:
        trl = by_key.get((s["model"], s["backend"], "trl"))
        # Several ranks: the all-gather of the same bytes is the floor; one rank: the flat device copy.
        floor = by_key.get((s["model"], s["backend"], "floor-allgather")) or by_key.get(
            (s["model"], s["backend"], "floor")
        )
        default = by_key.get((s["model"], s["backend"], "ours-flat"))
        s["x_trl"] = trl["seconds"] / s["seconds"] if trl else None  # speed-up over TRL (>1: faster)
        s["x_floor"] = s["seconds"] / floor["seconds"] if floor else None  # time over the floor (1: at the floor)
        s["x_default"] = s["seconds"] / default["seconds"] if default else None  # time over our default sync
    return out


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else ""


def table(summary: list[dict[str, Any]]) -> str:
    """The markdown table of a summary; a column empty in every row (a run without a TRL or floor row, or without
    accounted peaks) is left out, so that no quoted table carries columns with nothing in them."""
    head = [
        "model", "backend", "method", "median ms", "speed-up vs TRL", "x floor", "x default", "tensors", "MB pushed",
        "GB/s", "peak extra MB", "accounted MB",
    ]
    rows = []
    for s in summary:
        accounted = f"{s['accounted_peak_bytes'] / 1e6:.1f}" if s.get("accounted_peak_bytes") is not None else ""
        rows.append(
            [
                s["model"], s["backend"], s["method"], f"{s['seconds'] * 1e3:.1f}", _ratio(s["x_trl"]),
                _ratio(s["x_floor"]), _ratio(s.get("x_default")), str(s["tensors"]), f"{s['bytes'] / 1e6:.1f}",
                f"{s['gbps']:.2f}", f"{s['peak_extra_bytes'] / 1e6:.1f}", accounted,
            ]
        )
    keep = [i for i in range(len(head)) if i < 3 or any(row[i] for row in rows)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cells[i] for i in keep) + " |"

    align = "|" + "|".join("---" if i < 3 else "---:" for i in keep) + "|"
    return "\n".join([line(head), align, *(line(row) for row in rows)])


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    """The figure of a table (time and peak memory per method), where matplotlib (the `bench` extra) is installed;
    without it the tables are still written, and this says which figure was not drawn."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install '.[bench]'): {path} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(s["model"], s["backend"]) for s in summary})
    methods = sorted({s["method"] for s in summary}, key=lambda m: (m != "trl", m != "floor", m))
    by_key = {(s["model"], s["backend"], s["method"]): s for s in summary}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [j + i * width for j in range(len(configs))]
        secs = [by_key.get((m, b, method), {}).get("seconds", 0) * 1e3 for m, b in configs]
        peaks = [by_key.get((m, b, method), {}).get("peak_extra_bytes", 0) / 1e6 for m, b in configs]
        axes[0].bar(xs, secs, width, label=method)
        axes[1].bar(xs, peaks, width, label=method)
    for ax, ylabel in zip(axes, ["median sync time (ms, log)", "peak extra memory (MB, log)"], strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels([f"{m}\n{b}" for m, b in configs])
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
