"""GPU memory of `final_adaln_out` (backend "cupy") at the real sizes (GPU only; figures from
adaln_lab.bench.memory_figures, which prints them as JSON):

- the peak of one eager forward+backward at 32768 rows (H 5376, D 2688, T 3) stays within 1.05x of the
  bytes of x, dy, dx, out, timestep_indices, the parameters and their gradients (~1.52 GB; the kernels'
  workspaces, ~20 MB at this size, live in the 5 %);
- nothing grows: memory allocated after call 10 equals that after call 1000, to the byte.
"""

from __future__ import annotations

import pytest

from adaln_lab.bench import memory_figures

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("cuda_memory")]  # one worker measures `figures` once


@pytest.fixture(scope="module")
def figures():
    return memory_figures.measure(rows=32768, calls=1000)


def test_peak_of_forward_and_backward_is_within_5_percent_of_the_tensors(figures):
    f = figures
    assert f["shape"]["x"] == (32768, 5376) and f["shape"]["weight"] == (10752, 2688)
    assert f["peak_bytes"] <= f["limit_bytes"], (
        f"peak {f['peak_bytes']:,} B = {f['peak_over_budget']:.4f}x the budget {f['budget_bytes']:,} B "
        f"(limit 1.05x = {f['limit_bytes']:,} B; extra {f['extra_bytes']:,} B); tensors: {f['tensor_bytes']}")
    assert f["peak_bytes"] >= f["budget_bytes"]  # the measurement sees every tensor of the budget


def test_nothing_grows_over_1000_calls(figures):
    after = figures["allocated_after_call"]
    assert figures["growth_bytes"] == 0, f"memory allocated after calls 1 / 10 / 1000: {after}"
