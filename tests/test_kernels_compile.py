"""kernels_cu/ compiles without a GPU (NVRTC through cuda.core), errors name the real file and line,
the source carries its content hash, and the launch plan is a function of the shapes only."""

import re
import shutil

import pytest

from adaln_lab import loader, plan as plan_module
from adaln_lab.plan import plan

core = pytest.importorskip("cuda.core", reason="the test extra brings cuda-core and the NVRTC wheel")

SHAPES = [(5376, 2688, 3), (264, 64, 1), (1024, 256, 8), (5376, 2688, 8)]


def compile_unit(text: str, arch: str):
    program = core.Program(text, "c++", core.ProgramOptions(arch=arch, std="c++17"))
    return program.compile("cubin")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_kernel_compiles(arch, shape):
    text = loader.source(plan(*shape))
    code = compile_unit(text, arch).code
    assert len(code) > 1000
    for name in loader.KERNELS:  # every entry point is in the unit, extern "C" (unmangled)
        assert f" {name}(" in text.replace("\n", " ")


def test_compile_error_names_the_real_file_and_line(tmp_path, monkeypatch):
    broken = tmp_path / "kernels_cu"
    shutil.copytree(loader.kernel_dir(), broken)
    lines = (broken / "table_bwd.cu").read_text().splitlines()
    target = next(i for i, line in enumerate(lines) if "store8(d_weight" in line)
    lines[target] = lines[target].replace("store8(", "store_eight(")
    (broken / "table_bwd.cu").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(loader, "kernel_dir", lambda: broken)
    loader.clear_caches()
    try:
        with pytest.raises(Exception) as error:
            compile_unit(loader.source(plan(264, 64, 1)), "sm_90")
        message = str(error.value)
        match = re.search(r"kernels_cu/table_bwd\.cu\((\d+)\)", message)
        assert match, message
        assert int(match.group(1)) == target + 1
    finally:
        loader.clear_caches()


def test_source_carries_a_hash_of_every_file(tmp_path, monkeypatch):
    loader.clear_caches()
    before = loader.source(plan(264, 64, 1)).splitlines()[0]
    copy = tmp_path / "kernels_cu"
    shutil.copytree(loader.kernel_dir(), copy)
    (copy / "adaln_common.cuh").write_text((copy / "adaln_common.cuh").read_text() + "\n// edited\n")
    monkeypatch.setattr(loader, "kernel_dir", lambda: copy)
    loader.clear_caches()
    after = loader.source(plan(264, 64, 1)).splitlines()[0]
    loader.clear_caches()
    assert before.startswith("// adaln_lab kernels_cu sha256 ") and before != after


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
    # nothing in the launch path asks the device for its SM count
    root = loader.kernel_dir().parent / "adaln_lab"
    for name in ("plan.py", "loader.py", "launchers.py", "cuda_op.py"):
        text = (root / name).read_text()
        assert "multi_processor_count" not in text and "MultiProcessorCount" not in text, name


def test_shapes_the_kernels_cannot_take_are_refused_clearly():
    check_shapes = plan_module.check_shapes
    with pytest.raises(ValueError, match=r"H \(x.shape\[-1\]\) <= "):
        check_shapes(8 * 13000, 64, 1)
    with pytest.raises(ValueError, match="H .* divisible by 8"):
        check_shapes(260, 64, 3)
    with pytest.raises(ValueError, match="D .* divisible by 8"):
        check_shapes(256, 60, 3)
    with pytest.raises(ValueError, match="T \\* D"):
        check_shapes(256, 8192, 4)
    check_shapes(8, 8, 1)
    check_shapes(plan_module.H_MAX, 8, 1)
    assert plan(plan_module.H_MAX, 8, 1).bwd_stages >= 1  # what check_shapes accepts, the plan can lay out
    assert all(plan_module.supported(H, 8, 1) and plan(H, 8, 1).bwd_stages >= 1
               for H in range(plan_module.H_MAX - 8 * 64, plan_module.H_MAX + 1, 8))
    check_shapes(8, plan_module.TD_MAX // plan_module.T_MAX, plan_module.T_MAX)
    with pytest.raises(ValueError, match="H "):
        check_shapes(plan_module.H_MAX + 8, 8, 1)
    with pytest.raises(ValueError, match="T \\* D"):
        check_shapes(8, plan_module.TD_MAX // plan_module.T_MAX + 8, plan_module.T_MAX)


def test_the_wheel_ships_the_kernels(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(loader.kernel_dir()).parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("adaln_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in loader.KERNEL_FILES:
        assert f"adaln_lab/kernels_cu/{name}" in names


def test_a_tuning_the_kernels_cannot_run_does_not_compile(monkeypatch):
    """table_bwd splits a block's rows evenly over its warps: a TUNING that cannot must stop at compile
    time, naming the constraint (4e05566 ran a TUNING whose combine step wrote nothing, NOTES v7)."""
    monkeypatch.setitem(plan_module.TUNING, "TB_ROWS", 100)
    plan_module.clear_caches()
    try:
        with pytest.raises(Exception, match="ADALN_TB_ROWS must split evenly"):
            compile_unit(loader.source(plan(5376, 2688, 3)), "sm_90")
    finally:
        plan_module.clear_caches()


def test_the_largest_T_accepted_compiles_in_seconds():
    """check_shapes caps T (the table kernels unroll over it in registers): the largest accepted T compiles."""
    import time

    t0 = time.perf_counter()
    code = compile_unit(loader.source(plan(64, 64, plan_module.T_MAX)), "sm_90").code
    assert len(code) > 1000 and time.perf_counter() - t0 < 120
    with pytest.raises(ValueError, match=r"T \(temb.shape\[0\]\) <= "):
        plan_module.check_shapes(64, 64, plan_module.T_MAX + 1)


def test_gated_residual_block_size_follows_h():
    """plan.gr_geometry: even column tiles of at most GR_THREADS_MAX threads (8 columns each) covering H, from H
    alone (the sorted backward keeps its sums in registers: no shared memory per table row)."""
    assert plan(5376, 8, 9).gr_threads == 224 == plan(5376, 8, plan_module.T_MAX).gr_threads
    for H in (8, 256, 1032, 5376, 8 * 1000, plan_module.H_MAX):
        threads = plan_module.gr_geometry(H, plan_module.TUNING["GR_THREADS_MAX"])
        tiles = -(-(H // 8) // threads)
        assert threads % 32 == 0 and threads <= plan_module.TUNING["GR_THREADS_MAX"]
        assert (tiles - 1) * threads < H // 8 <= tiles * threads  # no empty tile