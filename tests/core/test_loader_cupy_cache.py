"""The facts about CuPy's kernel cache that adaln_lab/core/loader.py leans on, and real compiles through it.

CPU: CuPy's disk backend's hash check and atomic writes, across two processes; `-ftz=true` added on both
paths; CUPY_CACHE_IN_MEMORY read at every compile; with real NVRTC for sm_90 and no driver (the binary
caught where CuPy hands it to the driver): the in-memory compile gives the cached compile's cubin byte for
byte, a garbage cache file is recompiled and rewritten, and two processes released at once into one empty
cache both get that cubin and leave one hash-valid file.

GPU (marked `gpu`): real compiles in fresh processes, each printing the SHA-256 of the output and the five
gradients of one forward+backward (H 264, D 64, T 3, 300 rows), which must equal a clean compile's: a
read-only cache (chmod 0555 where not root; writes failing with PermissionError everywhere), a cache path
that is a file, garbage in every cache file, hash-valid files the driver refuses, hash-valid files of
another module, and two processes compiling at once into one empty cache. Every cache directory is the
test's own tmp_path (one per pytest-xdist worker too).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adaln_lab.core import loader
from adaln_lab.core.plan import plan

from ..paths import ROOT

from .loader_state import fresh_loader  # noqa: F401,E402  (autouse: a loader that compiled nothing)

pytestmark = pytest.mark.integration  # CuPy's cache, across processes of their own

PLAN = plan(264, 64, 3)




# ------------------------------------------------------------------------------- what CuPy does for us

def test_cupy_adds_ftz_on_both_paths_and_reads_in_memory_at_every_compile():
    """Pins the reading of cupy/cuda/compiler.py the fallback relies on."""
    from cupy.cuda import compiler

    lines = inspect.getsource(compiler._compile_with_cache_cuda).splitlines()
    ftz = next(i for i, line in enumerate(lines) if "'-ftz=true'" in line)
    assert lines[ftz].startswith("    options += ") and not lines[ftz].startswith("     ")  # unconditional
    assert ftz < next(i for i, line in enumerate(lines) if "if not cache_in_memory" in line)
    assert "_get_bool_env_variable('CUPY_CACHE_IN_MEMORY'" in inspect.getsource(compiler._compile_module_with_cache)


def _disk_backend(path):
    cache = pytest.importorskip("cupy.cuda._compiler_cache")
    return cache.DiskKernelCacheBackend(str(path))


def test_cupys_disk_cache_ignores_a_corrupted_file(tmp_path):
    backend = _disk_backend(tmp_path)
    backend.save("k.cubin", b"\x7fELF binary" * 100, "source")
    assert backend.load("k.cubin") == b"\x7fELF binary" * 100
    (tmp_path / "k.cubin").write_bytes(os.urandom(1200))
    assert backend.load("k.cubin") is None
    (tmp_path / "k.cubin").write_bytes(b"")
    assert backend.load("k.cubin") is None
    backend.save("k.cubin", b"fresh", "source")  # recompiled: rewritten whole
    assert backend.load("k.cubin") == b"fresh"


_WRITER = """
import os, sys, time
from cupy.cuda._compiler_cache import DiskKernelCacheBackend
backend = DiskKernelCacheBackend(sys.argv[1])
payload = bytes(range(256)) * 4096  # 1 MiB: a torn write would show
open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()  # ready: at the gate
while not os.path.exists(os.path.join(sys.argv[1], "go")):
    time.sleep(0.001)
bad = 0
for _ in range(100):
    backend.save("k.cubin", payload, "")
    got = backend.load("k.cubin")
    bad += got is not None and got != payload
print(bad)
"""


def test_cupys_disk_cache_survives_two_processes_writing_one_file(tmp_path, tmp_path_factory):
    _disk_backend(tmp_path)
    ready = tmp_path_factory.mktemp("ready")  # outside the cache directory, whose files are checked below
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(ready)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    deadline = time.monotonic() + 300
    while len(os.listdir(ready)) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)  # both writers at the gate
    (tmp_path / "go").write_text("")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [o.strip() for o in outs] == ["0", "0"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["go", "k.cubin"]  # no temporary file left
    assert _disk_backend(tmp_path).load("k.cubin") == bytes(range(256)) * 4096


# NVRTC without a GPU: cupy._core.core.compile_with_cache (what RawModule's first get_function calls, with
# RawModule's arguments) for sm_90, the binary caught where CuPy hands it to the driver (Module.load)
_NVRTC_SETUP = """
import types
from cupy.cuda import compiler
import cupy._core.core as core
got = []
class _Module:
    def load(self, cubin):
        got.append(bytes(cubin))
    def _set_mapping(self, mapping):
        pass
compiler.function = types.SimpleNamespace(Module=_Module)
compiler._get_arch_for_options_for_nvrtc = lambda arch=None: ("-arch=sm_90", "cubin")
def compile_unit(source, options):
    try:
        core.compile_with_cache(source, options, arch="90", prepend_cupy_headers=False)
    except TypeError:  # returning the fake module, after load
        pass
    return got.pop()
"""


def _nvrtc(monkeypatch, cache):
    """compile_unit(in_memory) -> the sm_90 binary of PLAN's unit, in this process, CuPy's disk cache in `cache`
    (what `monkeypatch` changes is undone with it)."""
    from cupy.cuda import compiler
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    for name in ("function", "_get_arch_for_options_for_nvrtc"):  # replaced by the setup, restored after
        monkeypatch.setattr(compiler, name, getattr(compiler, name))
    namespace = {}
    exec(_NVRTC_SETUP, namespace)
    monkeypatch.setattr(compiler, "_kernel_cache_backend", DiskKernelCacheBackend(str(cache)))

    def compile_unit(in_memory: bool) -> bytes:
        if in_memory:
            monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
        else:
            monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
        try:
            return namespace["compile_unit"](loader.source(PLAN), loader.COMPILE_OPTIONS)
        except Exception as error:  # noqa: BLE001
            if "nvrtc" in str(error).lower() and "CompileException" not in type(error).__name__:
                pytest.skip(f"NVRTC not loadable here: {error}")
            raise

    return compile_unit


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """(compile_unit(in_memory) -> the sm_90 binary of PLAN's unit, cache directory) in this process."""
    cache = tmp_path / "cache"
    return _nvrtc(monkeypatch, cache), cache


# the tests of the module fixture `compiled`: on one pytest-xdist worker, so PLAN's unit is compiled once for them
nvrtc_worker = pytest.mark.xdist_group("cupy_nvrtc")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """PLAN's unit compiled once through CuPy's disk-cache path into an empty cache directory: (the sm_90 binary,
    that directory). Each test copies the directory before touching it; the compile takes seconds."""
    cache = tmp_path_factory.mktemp("nvrtc") / "cache"
    with pytest.MonkeyPatch.context() as monkeypatch:
        binary = _nvrtc(monkeypatch, cache)(in_memory=False)
    return binary, cache


@nvrtc_worker
def test_the_in_memory_compile_is_the_cached_compiles_binary(compiled, nvrtc):
    """Bitwise the same cubin from CuPy's disk-cache path, its in-memory path and the cache file."""
    cached, clean = compiled
    (file,) = _cache_files(clean)  # the disk-cache path wrote one file into the empty cache: the binary, hashed
    assert len(cached) > 10_000 and _hash_valid(file) and file.read_bytes()[40:] == cached
    compile_unit, cache = nvrtc
    shutil.copytree(clean, cache, dirs_exist_ok=True)  # (the backend made the directory)
    (file,) = _cache_files(cache)
    assert compile_unit(in_memory=True) == cached
    assert _cache_files(cache) == [file]  # nothing written in memory
    assert compile_unit(in_memory=False) == cached  # loaded from the file


@nvrtc_worker
def test_a_garbage_cache_file_is_recompiled_and_rewritten(compiled, nvrtc):
    cached, clean = compiled
    compile_unit, cache = nvrtc
    shutil.copytree(clean, cache, dirs_exist_ok=True)  # the file the disk-cache path wrote for this unit
    (file,) = _cache_files(cache)
    file.write_bytes(os.urandom(file.stat().st_size))
    assert compile_unit(in_memory=False) == cached
    assert _hash_valid(file) and file.read_bytes()[40:] == cached


_NVRTC_RACE = _NVRTC_SETUP + """
import hashlib, os, sys, time
from adaln_lab.core import loader
from adaln_lab.core.plan import plan
gate = sys.argv[1]
open(os.path.join(gate, str(os.getpid())), "w").close()
while len(os.listdir(gate)) < 2:
    time.sleep(0.01)
print(hashlib.sha256(compile_unit(loader.source(plan(264, 64, 3)), loader.COMPILE_OPTIONS)).hexdigest())
"""


@nvrtc_worker
def test_two_processes_compile_at_once_into_one_empty_cache_with_nvrtc(compiled, tmp_path):
    """CuPy's real compile-and-save in two processes released at once into one empty cache directory: both get
    this process's binary (the disk-cache path's; test_the_in_memory_compile_is_the_cached_compiles_binary: the
    in-memory path's is the same)."""
    expected = hashlib.sha256(compiled[0]).hexdigest()
    cache, gate = tmp_path / "shared", tmp_path / "gate"
    gate.mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_IN_MEMORY"}
    environ["CUPY_CACHE_DIR"] = str(cache)
    procs = [subprocess.Popen([sys.executable, "-c", _NVRTC_RACE, str(gate)], cwd=ROOT, env=environ,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == [expected, expected]
    files = _cache_files(cache)
    assert len(files) == 1 and files[0].suffix == ".cubin" and _hash_valid(files[0])


# ------------------------------------------------------------------------------- GPU: real compiles

_SCRIPT_HEAD = """
import hashlib, json, os, sys, time, warnings
def before_compile():
    pass
"""
_SCRIPT_BODY = """
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    from adaln_lab import final_adaln_out
    from adaln_lab.core import loader
    from adaln_lab.harness.inputs import make, upstream
    i = make(1, 300, "cuda", H=264, D=64, T=3)
    leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
    before_compile()
    out = final_adaln_out(*leaves, i.timestep_indices, backend="cupy")
    out.backward(upstream(1, out))
    torch.cuda.synchronize()
digest = hashlib.sha256()
for t in (out, *(leaf.grad for leaf in leaves)):
    digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
print(json.dumps({"digest": digest.hexdigest(), "cache_dir": loader.cache_dir(),
                  "warnings": [str(w.message) for w in caught if issubclass(w.category, loader.KernelCacheWarning)]}))
"""
# a read-only directory for root too: CuPy's write into the cache (a temporary file there) is refused
_WRITES_FAIL = """
import tempfile

_real = tempfile.NamedTemporaryFile
def _refuse(*args, **kwargs):
    if os.path.abspath(str(kwargs.get("dir"))) == os.path.abspath(os.environ["CUPY_CACHE_DIR"]):
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))
    return _real(*args, **kwargs)
tempfile.NamedTemporaryFile = _refuse
"""
# two processes compile at the same moment: each waits until both reached the compile
_BARRIER = """
def before_compile():
    gate = os.environ["ADALN_TEST_BARRIER"]
    open(os.path.join(gate, str(os.getpid())), "w").close()
    deadline = time.time() + 300
    while len(os.listdir(gate)) < 2 and time.time() < deadline:
        time.sleep(0.01)
"""


def _start(cache: Path, setup: str = "", **env) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("CUPY_CACHE_IN_MEMORY", "CUPY_CACHE_SAVE_CUDA_SOURCE")}
    environ.update(CUPY_CACHE_DIR=str(cache), **env)
    return subprocess.Popen([sys.executable, "-c", _SCRIPT_HEAD + setup + _SCRIPT_BODY], cwd=ROOT, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.splitlines()[-1])


def _run(cache: Path, setup: str = "", **env) -> dict:
    return _finish(_start(cache, setup, **env))


def _hash_valid(path: Path) -> bool:
    data = path.read_bytes()
    return data[:40] == hashlib.sha1(data[40:]).hexdigest().encode()


def _cache_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean compile in its own process: (its result, its filled cache directory)."""
    cache = tmp_path_factory.mktemp("clean") / "cache"
    result = _run(cache)
    assert result["warnings"] == [] and result["cache_dir"] == str(cache)
    files = _cache_files(cache)
    assert files and all(_hash_valid(f) for f in files)
    return result, cache


def _copy_of(clean_cache: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(clean_cache, cache)
    return cache


@pytest.mark.gpu
def test_a_clean_cache_is_used_again(clean, tmp_path):
    result, cache = clean
    again = _run(_copy_of(cache, tmp_path))
    assert again["digest"] == result["digest"] and again["warnings"] == []


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["chmod_0555", "writes_fail"])
def test_a_read_only_cache_compiles_in_memory_with_a_warning(clean, tmp_path, how):
    cache = tmp_path / "cache"
    cache.mkdir()
    if how == "chmod_0555":
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits: see writes_fail")
        cache.chmod(0o555)
    try:
        result = _run(cache, _WRITES_FAIL if how == "writes_fail" else "")
    finally:
        cache.chmod(0o755)
    assert result["digest"] == clean[0]["digest"]
    assert result["warnings"] and ("read-only" in result["warnings"][0] or "PermissionError" in result["warnings"][0])
    assert _cache_files(cache) == []


@pytest.mark.gpu
def test_a_cache_path_that_is_a_file(clean, tmp_path):
    a_file = tmp_path / "not_a_dir"
    a_file.write_bytes(b"keep me")
    result = _run(a_file)
    assert result["digest"] == clean[0]["digest"]
    assert result["warnings"] and "not a directory" in result["warnings"][0]
    assert a_file.read_bytes() == b"keep me"


@pytest.mark.gpu
def test_garbage_in_every_cache_file_is_recompiled(clean, tmp_path):
    cache = _copy_of(clean[1], tmp_path)
    for f in _cache_files(cache):
        f.write_bytes(os.urandom(f.stat().st_size))
    result = _run(cache)
    assert result["digest"] == clean[0]["digest"]
    assert all(_hash_valid(f) for f in _cache_files(cache))  # CuPy rewrote them


@pytest.mark.gpu
def test_hash_valid_files_the_driver_refuses(clean, tmp_path):
    cache = _copy_of(clean[1], tmp_path)
    text = b"// adaln_lab test: not a cubin\n" * 64
    for f in _cache_files(cache):
        f.write_bytes(hashlib.sha1(text).hexdigest().encode() + text)
    result = _run(cache)
    assert result["digest"] == clean[0]["digest"]
    assert result["warnings"] and "CUDADriverError" in result["warnings"][0]


@pytest.mark.gpu
def test_hash_valid_files_of_another_module_are_never_used(clean, tmp_path):
    other = tmp_path / "other"
    code = ("import cupy; cupy.RawModule(code='extern \"C\" __global__ void other_kernel(float* x) { x[0] = 1.0f; }')"
            ".get_function('other_kernel')")
    environ = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_IN_MEMORY"}
    subprocess.run([sys.executable, "-c", code], env={**environ, "CUPY_CACHE_DIR": str(other)}, check=True,
                   timeout=600)
    (payload,) = [f.read_bytes() for f in _cache_files(other)]
    cache = _copy_of(clean[1], tmp_path)
    for f in _cache_files(cache):
        f.write_bytes(payload)
    result = _run(cache)
    assert result["digest"] == clean[0]["digest"]
    assert result["warnings"] and "CUDA_ERROR_NOT_FOUND" in result["warnings"][0]


@pytest.mark.gpu
def test_two_processes_compile_at_once_into_one_empty_cache(clean, tmp_path):
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    gate.mkdir()
    procs = [_start(cache, _BARRIER, ADALN_TEST_BARRIER=str(gate)) for _ in range(2)]
    results = [_finish(p) for p in procs]
    assert [r["digest"] for r in results] == [clean[0]["digest"]] * 2
    assert [r["warnings"] for r in results] == [[], []]
    files = _cache_files(cache)
    assert [f.name for f in files] == [f.name for f in _cache_files(clean[1])]  # no temporary file left
    assert all(_hash_valid(f) for f in files)
