"""kernels_cu/ compiles without a GPU (NVRTC through cuda.core) for every plan's macros, errors name the real
file and line, the source carries its content hash, a TUNING the kernels cannot run stops at compile time, and
the wheel ships the kernels (the plan itself: test_plan.py)."""

import re
import shutil

import pytest

from adaln_lab.core import loader, plan as plan_module
from adaln_lab.core.launchers import tuned
from adaln_lab.core.plan import plan

from ..paths import PACKAGE, ROOT

pytestmark = pytest.mark.integration  # NVRTC compiles of the whole unit

core = pytest.importorskip("cuda.core", reason="the test extra brings cuda-core and the NVRTC wheel")

SHAPES = [(5376, 2688, 3), (264, 64, 1), (1024, 256, plan_module.T_MAX), (5376, 2688, 8),
          (8, 256, 3, 18 * 1024, True, True)]  # the third: the largest T; the last: a block's table writing row tables


def compile_unit(text: str, arch: str, log=None):
    program = core.Program(text, "c++", core.ProgramOptions(arch=arch, std="c++17", ptxas_options=["-v"]))
    return program.compile("cubin", logs=log)


def spills(log: str) -> dict:
    """{kernel: spill store bytes} from ptxas -v's log."""
    out, name = {}, None
    for line in log.splitlines():
        found = re.search(r"Compiling entry function '(\w+)'", line)
        name = found.group(1) if found else name
        found = re.search(r"(\d+) bytes spill stores", line)
        if found and name:
            out[name] = int(found.group(1))
    return out


def _arch_cases():
    """Every shape for sm_90; sm_100 compiles the same source (no branch tells the two apart), so one shape there
    covers it and the others are `slow` repeats."""
    for shape in SHAPES:
        yield pytest.param(shape, "sm_90", id=f"{shape}-sm_90")
        marks = () if shape == SHAPES[0] else (pytest.mark.slow,)
        yield pytest.param(shape, "sm_100", id=f"{shape}-sm_100", marks=marks)


@pytest.mark.parametrize("shape, arch", list(_arch_cases()))
def test_every_kernel_compiles(shape, arch):
    """Each plan's unit compiles, within two minutes here (a user's first call waits for it), and table_bwd's
    kernels keep their T x tb_vec accumulators in registers (no spill; 8 columns a lane at T = 16 spilled)."""
    import io
    import time

    text = loader.source(plan(*shape))
    t0 = time.perf_counter()
    log = io.StringIO()
    code = compile_unit(text, arch, log).code
    assert len(code) > 1000 and time.perf_counter() - t0 < 120
    table_bwd = {k: v for k, v in spills(log.getvalue()).items() if k.startswith("table_bwd")}
    assert table_bwd and not any(table_bwd.values()), table_bwd
    for name in loader.KERNELS:  # every entry point is in the unit, extern "C" (unmangled)
        assert f" {name}(" in text.replace("\n", " ")


def test_compile_error_names_the_real_file_and_line(tmp_path, monkeypatch):
    broken = tmp_path / "kernels_cu"
    shutil.copytree(loader.kernel_dir(), broken)
    lines = (broken / "table_bwd.cu").read_text().splitlines()
    target = next(i for i, line in enumerate(lines) if "tb_store(d_weight" in line)
    lines[target] = lines[target].replace("tb_store(", "tb_store_eight(")
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


def test_the_wheel_ships_the_kernels(tmp_path):
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("adaln_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in loader.KERNEL_FILES:
        assert f"adaln_lab/kernels_cu/{name}" in names
    for module in sorted(PACKAGE.rglob("*.py")):  # and every module of the package's tree
        name = module.relative_to(PACKAGE.parent).as_posix()
        assert "__pycache__" in name or name in names, name


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


def test_the_largest_T_accepted_is_compiled_above_and_the_next_is_refused():
    """check_shapes caps T (table_bwd unrolls over it in registers): SHAPES holds the largest accepted T, so
    test_every_kernel_compiles compiles it within its two minutes, and T_MAX + 1 is refused by name."""
    assert any(len(shape) == 3 and shape[2] == plan_module.T_MAX for shape in SHAPES)
    with pytest.raises(ValueError, match=r"T \(temb.shape\[0\]\) <= "):
        plan_module.check_shapes(64, 64, plan_module.T_MAX + 1)


@pytest.mark.parametrize("shape", [(5376, 2688, 3), (264, 64, 32)])
@pytest.mark.parametrize("staged", [0, 1])
def test_the_float64_windows_compile(shape, staged, monkeypatch):
    """TUNING's EXACT_ROW_DOUBLE 1 (exact_row_windows.cu: the exact row passes' float64 windows) compiles at H3's
    width and at a wide T, its fixup kernels without spills, and norm_out's pass without spills with its closes
    through its stages or not (EXACT_CLOSE_STAGED)."""
    import io

    monkeypatch.setitem(plan_module.TUNING, "EXACT_ROW_DOUBLE", 1)
    monkeypatch.setitem(plan_module.TUNING, "EXACT_CLOSE_STAGED", staged)
    plan_module.clear_caches()
    log = io.StringIO()
    try:
        compile_unit(loader.source(plan(*shape)), "sm_90", log)
    finally:
        plan_module.clear_caches()
    spilled = spills(log.getvalue())
    fixups = ("exact_fixup_rows_bf16", "exact_fixup_sorted_bf16", "exact_fixup_gates_bf16",
              "norm_modulate_bwd_exact_bf16")
    assert all(spilled[name] == 0 for name in fixups), spilled


def test_the_staged_closes_reach_norm_outs_pass():
    """EXACT_CLOSE_STAGED changes the compiled unit (close_staged is reached: its knob is not dropped on the way to
    norm_modulate_bwd_exact_bf16, whose float64 windows it closes), so the GPU tests of each form test two kernels."""
    cubins = []
    for staged in (0, 1):
        with tuned(EXACT_ROW_DOUBLE=1, EXACT_CLOSE_STAGED=staged):
            cubins.append(bytes(compile_unit(loader.source(plan(264, 64, 3)), "sm_90").code))
    assert cubins[0] != cubins[1]
