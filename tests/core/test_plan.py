"""`adaln_lab.core.plan`: every kernel's geometry is a function of the shapes only, the shapes the kernels cannot
take are refused with a message naming the limit, the gated residual's block size follows H, and forward_bytes is
the forward workspace's total."""

import itertools
from pathlib import Path

import pytest

from adaln_lab.core import plan as plan_module
from adaln_lab.core.plan import plan


def test_geometry_is_a_function_of_the_shapes_only():
    row_geometry = plan_module.row_geometry
    assert row_geometry(5376, 256) == (224, 3)
    assert row_geometry(5376, 1024) == (672, 1)
    assert row_geometry(264, 256) == (64, 1)
    assert row_geometry(16384, 1024) == (1024, 2)
    p = plan(5376, 2688, 3)
    assert (p.fwd_threads, p.fwd_vpt) == row_geometry(5376, plan_module.TUNING["FWD_THREADS_MAX"])
    assert (p.bwd_threads, p.bwd_vpt) == row_geometry(5376, plan_module.TUNING["BWD_THREADS_MAX"])
    # the row ranges depend on the number of rows alone
    assert p.rows(1).bwd_rows_per_range == 1 and p.rows(1).fwd_ranges == 1
    assert p.rows(4097).bwd_rows_per_range == 32
    assert p.rows(32768).bwd_rows_per_range == 249
    assert p.rows(10 ** 8).bwd_rows_per_range == plan_module.TUNING["ROW_LIST_MAX"]
    assert p.rows(10 ** 8).fwd_rows_per_range == plan_module.TUNING["FWD_ROW_LIST_MAX"]
    assert p.rows(0).fwd_ranges == p.rows(0).bwd_ranges == 0
    for rows in (1, 7, 4097, 32768, 400000):
        r = p.rows(rows)
        assert r.fwd_ranges * r.fwd_rows_per_range >= rows > (r.fwd_ranges - 1) * r.fwd_rows_per_range
        assert r.bwd_ranges * r.bwd_rows_per_range >= rows > (r.bwd_ranges - 1) * r.bwd_rows_per_range
    # shared memory follows the shapes: the staged forward holds every timestep's modulation
    assert p.fwd_staged and p.fwd_smem == (2 * 3 + p.fwd_stages) * 224 * 3 * 16
    assert p.bwd_smem == p.bwd_stages * 2 * 672 * 16
    wide = plan(8 * 4096, 64, 1)  # a wide row falls back or keeps fewer stages rather than failing
    assert not wide.fwd_staged  # two stages and the modulation would need 256 KiB: the row-per-block kernel
    assert wide.bwd_stages == 1 and wide.bwd_smem <= plan_module.BWD_STAGE_BUDGET
    mid = plan(8 * 1024, 64, 1)
    assert mid.fwd_stages == 3 and mid.fwd_smem <= plan_module.SMEM_BLOCK_MAX - 8 * 1024
    assert not plan(5376, 8, 32).fwd_staged  # too many timesteps to stage: the row-per-block kernel
    # table_bwd.cu's lane width keeps T x tb_vec accumulators in registers: 8 columns up to T 9, 4 to 18, then 2
    assert [plan(5376, 2688, T).tb_vec for T in (1, 9, 10, 18, 19, 32)] == [8, 8, 4, 4, 2, 2]
    assert plan(5376, 2688, 32).tb_grid == (42, 42) and plan(5376, 2688, 3).tb_grid == (11, 21)
    # table_bwd_mma.cu from 10 table rows, where N is a multiple of 16 (its dact steps take 16 weight rows)
    assert plan(5376, 2688, 10).tb_mma and not plan(5376, 2688, 9).tb_mma
    assert not plan(8, 264, 12, table_n=24).tb_mma and plan(8, 264, 12, table_n=32).tb_mma
    # nothing in the launch path asks the device for its SM count: adaln_lab/core/ (plan, loader, launchers, the
    # torch glue) and the ops that launch through it
    package = Path(plan_module.__file__).resolve().parents[1]
    files = sorted((package / "core").rglob("*.py")) + sorted((package / "ops").rglob("*.py"))
    assert {"plan.py", "loader.py", "launchers.py", "tensors.py", "launch.py"} <= {f.name for f in files}
    for path in files:
        text = path.read_text()
        assert "multi_processor_count" not in text and "MultiProcessorCount" not in text, path.name


def test_shapes_the_kernels_cannot_take_are_refused_clearly():
    check_shapes = plan_module.check_shapes
    with pytest.raises(ValueError, match=r"H \(x.shape\[-1\]\) <= "):
        check_shapes(8 * 13000, 64, 1)
    with pytest.raises(ValueError, match="H .* divisible by 8"):
        check_shapes(260, 64, 3)
    with pytest.raises(ValueError, match="D .* divisible by 8"):
        check_shapes(256, 60, 3)
    check_shapes(256, 8192, 4)  # no limit on T * D: table.cu streams temb (its v25 kept T * D in 48 KiB)
    check_shapes(8, 8, 1)
    check_shapes(plan_module.H_MAX, 8, 1)
    assert plan(plan_module.H_MAX, 8, 1).bwd_stages >= 1  # what check_shapes accepts, the plan can lay out
    assert all(plan_module.supported(H, 8, 1) and plan(H, 8, 1).bwd_stages >= 1
               for H in range(plan_module.H_MAX - 8 * 64, plan_module.H_MAX + 1, 8))
    check_shapes(8, 2688, plan_module.T_MAX)  # H3's D at the largest T
    with pytest.raises(ValueError, match="H "):
        check_shapes(plan_module.H_MAX + 8, 8, 1)
    with pytest.raises(ValueError, match=r"T \(temb.shape\[0\]\) <= 3072"):
        check_shapes(8, 2688, plan_module.T_MAX + 1)


def test_gated_residual_block_size_follows_h():
    """plan.gr_geometry: even column tiles of at most GR_THREADS_MAX threads (8 columns each) covering H, from H
    alone (the sorted backward keeps its sums in registers: no shared memory per table row)."""
    assert plan(5376, 8, 9).gr_threads == 224 == plan(5376, 8, plan_module.T_MAX).gr_threads
    for H in (8, 256, 1032, 5376, 8 * 1000, plan_module.H_MAX):
        threads = plan_module.gr_geometry(H, plan_module.TUNING["GR_THREADS_MAX"])
        tiles = -(-(H // 8) // threads)
        assert threads % 32 == 0 and threads <= plan_module.TUNING["GR_THREADS_MAX"]
        assert (tiles - 1) * threads < H // 8 <= tiles * threads  # no empty tile


def test_many_table_rows_sort_in_chunks_with_a_scratch_that_fits_every_smaller_batch(monkeypatch):
    """Past 32 table rows row_order.cu takes its three wide kernels (plan.row_order_wide): chunks of at least 1024
    positions, multiples of 32, at most 1024 of them, covering S; the scratch laid out for `rows` positions holds
    the T x chunks ints of any S <= rows (the backward sorts S <= rows positions), and the workspace has it."""
    monkeypatch.setattr(plan_module, "T_MAX", 4096)
    try:
        p = plan(64, 8, 40)
        assert p.row_order_wide and not plan(64, 8, 32).row_order_wide
        for S in (0, 1, 1024, 1025, 1 << 20, (1 << 20) + 1, 123456789, 2 ** 31 - 2 ** 15):
            chunk, chunks = p.row_order_chunking(S)
            assert chunk >= 1024 and chunk % 32 == 0 and 1 <= chunks <= 1024 and chunk * chunks >= S
            assert S == 0 or chunk * (chunks - 1) < S
            assert all(4 * p.T * p.row_order_chunking(s)[1] <= p.row_order_scratch(S)
                       for s in (S, S // 2, max(S - 1, 0), min(S, 1 << 20), min(S, (1 << 20) + 1)))
        r = p.rows(5000)
        assert r.bwd_offsets["row_order_scratch"] >= r.bwd_offsets["row_order"] + 4 * (40 + 1 + 5000)
        assert "row_order_scratch" not in plan(64, 8, 12).rows(5000).bwd_offsets
    finally:
        plan_module.clear_caches()


def test_forward_bytes_is_the_forward_workspace_total():
    for T, H, rows, D in itertools.product((1, 2, 3, 7, 64), (8, 24, 64, 3072), (0, 1, 5, 63, 64, 65, 4097),
                                           (8, 24, 32, 1024)):
        assert plan_module.forward_bytes(T, H, rows, D) == plan_module.forward_workspace(T, H, rows, D)[1]
