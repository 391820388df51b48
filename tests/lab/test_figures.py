"""`adaln_lab.lab.figures`: the ulp scatter reaches the largest distance and draws outputs of 0 apart, with finite
log axes and no overflow; the planted counter-examples' figure reads caught as green and an unnoticed one as red."""

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
