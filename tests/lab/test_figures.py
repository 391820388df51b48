"""`adaln_lab.lab.figures`: the ulp scatter reaches the largest distance and draws outputs of 0 apart, with finite
log axes and no overflow; the planted counter-examples' figure reads caught as green and an unnoticed one as red;
the kernels' roofline names each kernel once, in a legend clear of the panels; a caption names the data's machine."""

import math
import warnings

import pytest
import torch

from adaln_lab.harness.inputs import make
from adaln_lab.lab import errors, evidence, figures
from adaln_lab.reference import replay

from ..paths import EVIDENCE, needs_evidence
from .common import SHAPE, bump

matplotlib = pytest.importorskip("matplotlib", reason="the test extra brings matplotlib")
matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")


def _scatter_axes(fig):
    return fig.axes[1::2]  # each row: histogram, then the scatter


def _drawn(ax):
    return [tuple(p) for c in ax.collections for p in c.get_offsets()]


def _check_covers(pairs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an axis limit past float64's range warns "overflow encountered in exp"
        fig = figures.ulp_figure(pairs)
        fig.canvas.draw()
    try:
        for (label, u), ax in zip(pairs.items(), _scatter_axes(fig)):
            (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
            assert ax.get_xscale() == ax.get_yscale() == "log", label
            assert 0 < x0 < x1 < 1e12 and 0 < y0 < 1 < u["max_ulp"] < y1, (label, ax.get_xlim(), ax.get_ylim())
            points = _drawn(ax)
            assert max(y for _, y in points) == u["max_ulp"], label  # the largest distance is drawn
            assert all(x0 < x < x1 and y0 < y < y1 for x, y in points), label  # every drawn point inside the axes
    finally:
        plt.close(fig)


def test_ulp_figure_draws_the_largest_distances_and_outputs_of_zero():
    i = make(1, 9, **SHAPE)
    flat = replay(*i.args).flatten().clone()
    flat[350] = 0
    b = flat.view(9, SHAPE["H"])
    a = bump(bump(b, torch.arange(0, 300), 1), torch.tensor([350]), 15000)  # 15000 ulps where diffusers gives 0
    u = errors.ulp_analysis(a, b, i, top=3, sample=10)
    assert u["zero_output"]["max_ulp"] == 15000 == u["max_ulp"]
    _check_covers({"planted vs replay": u})
    fig = figures.ulp_figure({"planted vs replay": u})
    try:
        limits = figures.scatter_limits(errors.cancellation_points(u))
        assert (limits["zero_x"], 15000) in _drawn(_scatter_axes(fig)[0])  # out == 0: its own column at the right
        assert limits["zero_x"] > max(errors.cancellation_points(u)["cancellation"])
    finally:
        plt.close(fig)


@needs_evidence("lab_errors.json")
def test_ulp_figure_of_the_committed_evidence_reaches_its_largest_distances():
    """The H200 file (whichever layout): 15488-ulp points, whose output is 0, and torch.compile's 30670."""
    data = evidence.load_json(evidence.lab_path("errors", EVIDENCE))
    _check_covers(data["ulp"])


def test_planted_counter_examples_read_caught_as_good():
    planted = {"leaky": {"all_rows": 4, "params_repeatable": 0}, "unnoticed": {"all_rows": 0, "params_repeatable": 0}}
    checks = ("all_rows", "params_repeatable")
    grid = figures.planted_colors(planted, checks)
    caught, missed = grid[0]
    assert caught == figures.CAUGHT and caught[1] > max(caught[0], caught[2])  # green
    assert missed == figures.MISSED and max(missed) - min(missed) < 0.05  # grey: a miss is no failure of the check
    assert grid[1] == [figures.UNNOTICED] * 2 and figures.UNNOTICED[0] > max(figures.UNNOTICED[1:])  # red
    fig = figures.planted_figure(planted, checks)
    try:
        image = fig.axes[0].get_images()[0].get_array()
        assert tuple(float(v) for v in image[0][0][:3]) == pytest.approx(figures.CAUGHT)
        assert not math.isnan(float(image[1][1][0]))
    finally:
        plt.close(fig)


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_roofline_figure_names_kernels_in_a_legend_that_overlaps_nothing():
    """Kernels of nearly the same bytes and time (the 4097- and 32768-row points, in the call and alone) drew
    their names on top of each other; now each kernel is a marker named once in a legend beside the panels."""
    kernels = {"table_bf16": 60e6, "norm_modulate_warp_bf16": 61e6, "table_bwd_bf16": 62e6, "Memset (Device)": None}
    rows = [{"name": n, "calls": 1.0, "us": 35.0, "bytes": b} for n, b in kernels.items()]
    fig = figures.roofline_figure({"4097": rows, "32768": rows}, {"4097": rows[:2], "32768": rows[:2]}, 3.0)
    suptitle = figures.caption(fig, "data: NVIDIA H100 80GB HBM3, commit 1be521e, full sizes")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = fig.legends[0]
        labels = [t.get_text() for t in legend.get_texts()]
        assert sorted(labels[:3]) == ["norm_modulate_warp", "table", "table_bwd"]  # each kernel once, Memset left out
        assert len({h.get_marker() for h in legend.legend_handles[:3]}) == 3  # told apart by marker
        assert [ax.get_title() for ax in fig.axes] == ["4097 rows", "32768 rows"]
        title = suptitle.get_window_extent(renderer)
        assert "NVIDIA H100 80GB HBM3" in fig.get_suptitle()
        for ax in fig.axes:
            assert not ax.texts  # no label drawn among the points
            box = ax.get_tightbbox(renderer)
            assert not _boxes_overlap(box, legend.get_window_extent(renderer))
            assert not _boxes_overlap(box, title)
        assert not _boxes_overlap(fig.axes[0].get_tightbbox(renderer), fig.axes[1].get_tightbbox(renderer))
    finally:
        plt.close(fig)


def test_caption_puts_the_machine_under_the_title_without_covering_the_axes():
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax in axes:
        ax.set_title("a panel")
    fig.suptitle("error against the float64 golden")
    data = {"meta": {"environment": {"gpu": "NVIDIA H100 80GB HBM3"}, "adaln_lab_commit": "1be521e0", "quick": False}}
    suptitle = figures.caption(fig, "data: " + evidence.describe(data))
    try:
        assert fig.get_suptitle() == ("error against the float64 golden\n"
                                      "data: NVIDIA H100 80GB HBM3, commit 1be521e, full sizes")
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        title = suptitle.get_window_extent(renderer)
        assert all(not _boxes_overlap(ax.get_tightbbox(renderer), title) for ax in axes)
    finally:
        plt.close(fig)
