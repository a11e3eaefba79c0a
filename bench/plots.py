"""The benchmarks' pictures: small PNGs (matplotlib, Agg) written beside their tables.

Each benchmark takes `--png PATH` (default docs/bench-<name>.png; `--png ''` writes none) and draws with
`figure()` and `save_figure()`: small sizes and dpi 80 keep every PNG well under 100 KB for the docs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"
COLOURS = {"contiguous": "#8d99ae", "paged": "#2a9d8f", "seed": "#8d99ae", "pagegate": "#2a9d8f"}


def add_png_argument(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--png", type=Path, default=DOCS / f"bench-{name}.png",
                        help=f"the picture to write (default docs/bench-{name}.png; '' for none)")


def wanted(path: Path | None) -> bool:
    return path is not None and str(path) not in ("", ".")


def figure(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 3.2, **kwargs: Any):
    """(fig, axes) from a headless matplotlib; axes is one Axes, or an array when ncols * nrows > 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7})
    return plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)


def save_figure(fig: Any, path: Path, dpi: int = 80) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")


def cdf(ax: Any, values: Sequence[float], label: str, **kwargs: Any) -> None:
    """An empirical CDF: the fraction of values at or below x."""
    ordered = sorted(values)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label, **kwargs)
    ax.set_ylim(0, 1.02)


def labelled_bars(ax: Any, names: Sequence[str], values: Sequence[float], fmt: str = "{:.0f}", **kwargs: Any) -> Any:
    """A bar chart with each value written on its bar and room above the tallest for the label."""
    bars = ax.bar(names, values, **kwargs)
    ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_ylim(0, max(max(values, default=0), 1e-9) * 1.15)
    return bars
