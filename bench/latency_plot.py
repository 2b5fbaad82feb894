"""Latency CDFs (log x axis) written to bench/out/, shared by the benchmarks that plot them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def write_cdfs(curves: Sequence[tuple[str, Sequence[float], str]], xlabel: str, title: str,
               filename: str) -> Path:
    """One CDF per (label, values in ms, line style); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values, style in curves:
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], style,
                label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    OUT.mkdir(exist_ok=True)
    fig.tight_layout()
    path = OUT / filename
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path
