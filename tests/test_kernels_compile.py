"""kernels_cu/ compiles without a GPU (NVRTC through cuda.core), errors name the real file and line,
the source carries its content hash, and the launch geometry is a function of the shapes only."""

import re
import shutil

import pytest

from adaln_lab import cupy_backend

core = pytest.importorskip("cuda.core", reason="the test extra brings cuda-core and the NVRTC wheel")

SHAPES = [(5376, 2688, 3), (264, 64, 1), (1024, 256, 8)]


def compile_unit(text: str, arch: str):
    program = core.Program(text, "c++", core.ProgramOptions(arch=arch, std="c++17"))
    return program.compile("cubin")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_kernel_compiles(arch, shape):
    cupy_backend.source.cache_clear()
    code = compile_unit(cupy_backend.source(*shape), arch).code
    assert len(code) > 1000
    for name in cupy_backend.KERNELS:  # every entry point is in the unit, extern "C" (unmangled)
        assert f" {name}(" in cupy_backend.source(*shape).replace("\n", " ")


def test_compile_error_names_the_real_file_and_line(tmp_path, monkeypatch):
    broken = tmp_path / "kernels_cu"
    shutil.copytree(cupy_backend.kernel_dir(), broken)
    lines = (broken / "table_bwd.cu").read_text().splitlines()
    target = next(i for i, line in enumerate(lines) if "store8(d_weight" in line)
    lines[target] = lines[target].replace("store8(", "store_eight(")
    (broken / "table_bwd.cu").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(cupy_backend, "kernel_dir", lambda: broken)
    cupy_backend.source.cache_clear()
    try:
        with pytest.raises(Exception) as error:
            compile_unit(cupy_backend.source(264, 64, 1), "sm_90")
        message = str(error.value)
        match = re.search(r"kernels_cu/table_bwd\.cu\((\d+)\)", message)
        assert match, message
        assert int(match.group(1)) == target + 1
    finally:
        cupy_backend.source.cache_clear()


def test_source_carries_a_hash_of_every_file(tmp_path, monkeypatch):
    cupy_backend.source.cache_clear()
    before = cupy_backend.source(264, 64, 1).splitlines()[0]
    copy = tmp_path / "kernels_cu"
    shutil.copytree(cupy_backend.kernel_dir(), copy)
    (copy / "adaln_common.cuh").write_text((copy / "adaln_common.cuh").read_text() + "\n// edited\n")
    monkeypatch.setattr(cupy_backend, "kernel_dir", lambda: copy)
    cupy_backend.source.cache_clear()
    after = cupy_backend.source(264, 64, 1).splitlines()[0]
    cupy_backend.source.cache_clear()
    assert before.startswith("// adaln_lab kernels_cu sha256 ") and before != after


def test_geometry_is_a_function_of_the_shapes_only():
    assert cupy_backend.row_geometry(5376, cupy_backend.FWD_THREADS_MAX) == (224, 3)
    assert cupy_backend.row_geometry(5376, cupy_backend.BWD_THREADS_MAX) == (672, 1)
    assert cupy_backend.row_geometry(264, 256) == (64, 1)
    assert cupy_backend.row_geometry(16384, 1024) == (1024, 2)
    # the backward's row ranges depend on the number of rows alone
    assert cupy_backend.rows_per_block(1) == 1
    assert cupy_backend.rows_per_block(4097) == 32
    assert cupy_backend.rows_per_block(32768) == 249
    assert cupy_backend.rows_per_block(10 ** 8) == cupy_backend.TUNING["ROW_LIST_MAX"]
    # the backward's pipeline stages and their shared memory follow H alone
    assert cupy_backend.stages(5376) == cupy_backend.TUNING["BWD_STAGES"]
    assert cupy_backend.dynamic_smem(5376) == 4 * 2 * 672 * 16
    assert cupy_backend.stages(49152) == 1  # a wide row keeps one stage rather than failing
    # nothing in the launch path asks the device for its SM count
    text = (cupy_backend.kernel_dir().parent / "adaln_lab" / "cupy_backend.py").read_text()
    assert "multi_processor_count" not in text and "MultiProcessorCount" not in text


def test_shapes_the_kernels_cannot_take_are_refused_clearly():
    with pytest.raises(ValueError, match=r"H \(x.shape\[-1\]\) <= "):
        cupy_backend.check_shapes(8 * 13000, 64, 1)
    with pytest.raises(ValueError, match="H .* divisible by 8"):
        cupy_backend.check_shapes(260, 64, 3)
    with pytest.raises(ValueError, match="D .* divisible by 8"):
        cupy_backend.check_shapes(256, 60, 3)
    with pytest.raises(ValueError, match="T \\* D"):
        cupy_backend.check_shapes(256, 8192, 4)


def test_the_wheel_ships_the_kernels(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(cupy_backend.kernel_dir()).parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("adaln_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in cupy_backend.KERNEL_FILES:
        assert f"adaln_lab/kernels_cu/{name}" in names


def test_a_tuning_the_kernels_cannot_run_does_not_compile(monkeypatch):
    """table_bwd's combine step covers 256 columns: 512 threads (run on the H200 in 4e05566, where it
    left d_temb unwritten) must now stop at compile time, naming the constraint."""
    monkeypatch.setitem(cupy_backend.TUNING, "TB_THREADS", 512)
    cupy_backend.clear_caches()
    try:
        with pytest.raises(Exception, match="ADALN_TB_THREADS to divide 256"):
            compile_unit(cupy_backend.source(5376, 2688, 3), "sm_90")
    finally:
        cupy_backend.clear_caches()
