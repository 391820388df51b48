"""Figures of the notebooks that need more than a few lines of matplotlib (the test and notebooks extras bring it).

- `ulp_figure(pairs)`: per pair of outputs (`errors.ulp_analysis`), the histogram of ulp distances and the
  distance of each drawn element against its cancellation, on log axes that cover every point: the largest
  distances always show, and elements whose output is 0 (no ratio) sit in a column of their own at the right.
- `planted_figure(planted, checks)`: the planted counter-examples against each check; caught reads green,
  missed grey, and a planted example that no check caught red.
- `roofline_figure(inside, alone, copy_TBps)`: adaln_lab's kernels, time against the bytes each moves, one
  panel per number of rows; each kernel its own marker (named in a legend beside the panels, so no label
  lies on another), filled inside a forward+backward call, hollow alone.
- `caption(fig, where)`: the machine (and commit) the figure's data come from, under its title: every
  figure of the notebooks names its GPU, or says it was computed on this CPU.
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


MARKERS = "osD^vPX*<>"


def roofline_figure(inside: dict, alone: dict, copy_TBps: float):
    """Kernel time (us) against bytes moved (MB), log-log, one panel per number of rows.

    `inside` / `alone`: {rows: [`latency_sweep.roofline` rows]} profiled inside forward+backward calls
    (filled markers) and timed alone back to back (hollow, larger: a ring where the two agree); kernels
    without a byte model are left out.
    The dashed line is the copy bandwidth. Returns the figure (constrained layout, legend at the right)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    sizes = sorted({S for S in (*inside, *alone) if any(k["bytes"] for k in (*inside.get(S, []), *alone.get(S, [])))},
                   key=int)
    names = sorted({k["name"] for rows in (*inside.values(), *alone.values()) for k in rows if k["bytes"]})
    style = {name: (MARKERS[i % len(MARKERS)], f"C{i % 10}") for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, max(1, len(sizes)), figsize=(5.2 * max(1, len(sizes)) + 2.6, 4.4), squeeze=False,
                             sharey=True, layout="constrained")
    for ax, S in zip(axes[0], sizes):
        known = []
        for rows, filled in ((inside.get(S, []), True), (alone.get(S, []), False)):
            for k in rows:
                if not k["bytes"]:
                    continue
                marker, color = style[k["name"]]
                ax.scatter([k["bytes"] / 1e6], [k["us"]], s=55 if filled else 130, marker=marker, color=color,
                           facecolors=color if filled else "none", linewidths=1.4)
                known.append(k["bytes"])
        ends = [min(known) / 2, max(known) * 2]
        ax.plot([b / 1e6 for b in ends], [b / copy_TBps / 1e6 for b in ends], "k--", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes the kernel must move (MB, log)")
        ax.set_title(f"{S} rows")
    axes[0][0].set_ylabel("kernel time (us, log)")
    fig.suptitle("adaln_lab kernels: time against bytes\n(on the dashed line: at copy bandwidth)", fontsize=11)
    if not sizes:
        axes[0][0].text(0.5, 0.5, "no kernel with a byte model in these data", ha="center", va="center",
                        transform=axes[0][0].transAxes)
        return fig
    handles = [Line2D([], [], ls="", marker=style[n][0], color=style[n][1], label=n.replace("_bf16", ""))
               for n in names]
    handles += [Line2D([], [], ls="", marker="o", color="gray", label="filled: inside a fwd+bwd call (profile)"),
                Line2D([], [], ls="", marker="o", color="gray", markerfacecolor="none",
                       label="hollow: alone, back to back (sweep)"),
                Line2D([], [], ls="--", color="black", label=f"copy bandwidth {copy_TBps:.2f} TB/s")]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    return fig


def caption(fig, where: str):
    """Write `where` (the data's machine and commit, `evidence.describe`, or `evidence.live`) under the
    figure's suptitle, or as its suptitle, and lay the figure out again so that nothing overlaps it.
    Returns the suptitle's Text."""
    title = fig.get_suptitle()
    text = fig.suptitle(f"{title}\n{where}" if title else where, fontsize=10)
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    if not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):  # constrained layout makes room itself
        fig.tight_layout()
    return text


__all__ = ["CAUGHT", "MISSED", "UNNOTICED", "scatter_limits", "ulp_figure", "planted_colors", "planted_figure",
           "roofline_figure", "caption"]
