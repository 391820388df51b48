"""Figures of the notebooks that need more than a few lines of matplotlib (the test and notebooks extras bring it).

- `ulp_figure(pairs)`: per pair of outputs (`errors.ulp_analysis`), the histogram of ulp distances and the
  distance of each drawn element against its cancellation, on log axes that cover every point: the largest
  distances always show, and elements whose output is 0 (no ratio) sit in a column of their own at the right.
- `planted_figure(planted, checks)`: the planted counter-examples against each check; caught reads green,
  missed grey, and a planted example that no check caught red.
"""

from __future__ import annotations

import math

from . import errors

CAUGHT, MISSED, UNNOTICED = (0.30, 0.69, 0.31), (0.88, 0.88, 0.88), (0.84, 0.15, 0.16)


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("adaln_lab.lab.figures needs matplotlib: pip install -e '.[notebooks]'") from error
    return plt


def scatter_limits(points: dict) -> dict:
    """Log-axis limits for `errors.cancellation_points`: x covers every finite ratio, with room at the right
    for the out == 0 column (`zero_x`, set whether or not there are such points), y covers every distance."""
    ratios = points["cancellation"] or [1.0]
    lo, hi = min(min(ratios), 1.0), max(max(ratios), 2.0)
    zero_x = 10 ** (math.floor(math.log10(hi)) + 1.5)
    ulps = points["ulps"] + points["zero_output_ulps"] or [1]
    return {"xlim": (lo / 1.5, zero_x * 2.5), "zero_x": zero_x, "ylim": (0.7, max(ulps) * 1.6)}


def ulp_figure(pairs: dict):
    """One row per {label: ulp_analysis}: histogram of distances, distance against cancellation. Returns the figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(pairs), 2, figsize=(12, 3.3 * max(1, len(pairs))), squeeze=False)
    for (label, u), (ax1, ax2) in zip(pairs.items(), axes):
        ax1.bar(range(len(u["bins"])), [max(c, 0.5) for c in u["histogram"]], color="C0")
        ax1.set_yscale("log")
        ax1.set_ylim(bottom=0.5)
        ax1.set_xticks(range(len(u["bins"])))
        ax1.set_xticklabels(u["bins"], rotation=60, fontsize=7)
        ax1.set_xlabel("distance (bf16 ulps of the output)")
        ax1.set_ylabel("elements (log)")
        ax1.set_title(f"{label}, {u['rows']} rows: {100 * u['bitwise_equal_fraction']:.4f} % bitwise equal",
                      fontsize=9)
        points = errors.cancellation_points(u)
        ax2.set_xlabel("cancellation max(|p|, |shift|) / |out|")
        ax2.set_ylabel("distance (ulps, log)")
        ax2.set_title(f"differing elements (a sample and the {len(u['largest'])} largest): max {u['max_ulp']} ulps",
                      fontsize=9)
        if not (points["ulps"] or points["zero_output_ulps"]):
            ax2.text(0.5, 0.5, "no element differs", ha="center", va="center", transform=ax2.transAxes)
            continue
        limits = scatter_limits(points)
        ax2.scatter(points["cancellation"], points["ulps"], s=6, alpha=0.5, color="C0", label="out != 0")
        if points["zero_output_ulps"]:
            zero = points["zero_output_ulps"]
            ax2.scatter([limits["zero_x"]] * len(zero), zero, s=14, marker="x", color="C3",
                        label=f"out = 0, no ratio ({len(zero)} drawn)")
            ax2.legend(fontsize=7, loc="upper left")
            ax2.text(limits["zero_x"], limits["ylim"][0] * 1.1, "out = 0", ha="center", va="bottom", fontsize=7,
                     color="C3")
        ax2.axvline(limits["zero_x"] / 2.2, color="gray", lw=0.6, ls=":")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.set_xlim(*limits["xlim"])
        ax2.set_ylim(*limits["ylim"])
    fig.tight_layout()
    return fig


def planted_colors(planted: dict, checks) -> list[list[tuple]]:
    """RGB per planted example (row) and check (column): CAUGHT where the check found something, MISSED where
    it did not (each check is there for some kinds of failure only), UNNOTICED across a row no check caught."""
    grid = []
    for row in planted.values():
        noticed = any(row[c] for c in checks)
        grid.append([CAUGHT if row[c] else (MISSED if noticed else UNNOTICED) for c in checks])
    return grid


def planted_figure(planted: dict, checks):
    """The planted counter-examples ({name: {check: count}}) against each check, counts written in. Returns the figure."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 2.8))
    ax.imshow(planted_colors(planted, checks), aspect="auto")
    for i, row in enumerate(planted.values()):
        for j, check in enumerate(checks):
            n = row[check]
            ax.text(j, i, f"{n}\n{'caught' if n else 'missed'}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(checks)))
    ax.set_xticklabels(checks, fontsize=8)
    ax.set_yticks(range(len(planted)))
    ax.set_yticklabels(list(planted), fontsize=8)
    ax.set_xlabel("check (rows or parameters found differing): green caught, grey missed, red: caught by none")
    ax.set_title("planted counter-examples against each check")
    fig.tight_layout()
    return fig


__all__ = ["CAUGHT", "MISSED", "UNNOTICED", "scatter_limits", "ulp_figure", "planted_colors", "planted_figure"]
