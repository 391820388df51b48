"""adaln_lab/loader.py's kernel cache: a cache CuPy cannot use means a compile in memory with a
KernelCacheWarning, never a crash or a wrong kernel; the module cache compiles a plan once per process,
whichever threads ask.

CPU: the decisions (is the cache directory usable, was a failure the cache's fault, the fallback's
environment and arguments) with fake compilers; the facts about CuPy the design leans on (its disk
backend's hash check and atomic writes, across two processes; `-ftz=true` added on both paths;
CUPY_CACHE_IN_MEMORY read at every compile; its import failing on a cache path it cannot make, which
importing adaln_lab's launchers first avoids); with real NVRTC for sm_90 and no driver (the binary caught
where CuPy hands it to the driver): the in-memory compile gives the cached compile's cubin byte for byte,
a garbage cache file is recompiled and rewritten, and two processes released at once into one empty cache
both get that cubin and leave one hash-valid file; threads asking for one plan at once.

GPU (marked `gpu`): real compiles in fresh processes, each printing the SHA-256 of the output and the five
gradients of one forward+backward (H 264, D 64, T 3, 300 rows), which must equal a clean compile's: a
read-only cache (chmod 0555 where not root; writes failing with PermissionError everywhere), a cache path
that is a file, garbage in every cache file, hash-valid files the driver refuses, hash-valid files of
another module, and two processes compiling at once into one empty cache.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from adaln_lab import loader
from adaln_lab.plan import plan

ROOT = Path(__file__).resolve().parent.parent
PLAN = plan(264, 64, 3)


@pytest.fixture(autouse=True)
def _fresh_loader(monkeypatch):
    monkeypatch.setattr(loader, "IMPORT_PROBLEM", None)
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    loader.clear_caches()
    yield
    loader.clear_caches()


def _driver_error(status: int):
    """A cupy CUDADriverError without a driver (its constructor asks libcuda for the message)."""
    from cupy_backends.cuda.api.driver import CUDADriverError

    error = CUDADriverError.__new__(CUDADriverError)
    error.status = status
    return error


class FakeCompile:
    """Stands in for loader._compile: records CUPY_CACHE_IN_MEMORY at each call, raises `errors` in turn."""

    def __init__(self, *errors):
        self.errors = list(errors)
        self.in_memory = []

    def __call__(self, device_index, plan_):
        self.in_memory.append(os.environ.get("CUPY_CACHE_IN_MEMORY"))
        if self.errors:
            raise self.errors.pop(0)
        return {"plan": plan_}


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """(install(FakeCompile) -> it, forgotten: how often CuPy's memos were dropped); the cache dir is usable."""
    import cupy._util

    forgotten = []
    monkeypatch.setattr(cupy._util, "clear_memo", lambda: forgotten.append(1))
    monkeypatch.setattr(loader, "cache_dir", lambda: str(tmp_path))

    def install(compile_):
        monkeypatch.setattr(loader, "_compile", compile_)
        return compile_

    return install, forgotten


# ---------------------------------------------------------------------------------------- the decisions

def test_cache_problem(tmp_path, monkeypatch):
    assert loader.cache_problem(str(tmp_path)) is None
    assert loader.cache_problem(str(tmp_path / "new" / "deeper")) is None  # CuPy makes it
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not a directory" in loader.cache_problem(str(a_file))
    assert "cannot be created" in loader.cache_problem(str(a_file / "sub"))
    assert "not a directory" in loader.cache_problem("")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert "not a directory" in loader.cache_problem(str(tmp_path / "link"))
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(read_only) else real_access(p, mode))
    assert "read-only" in loader.cache_problem(str(read_only))
    assert "cannot be created" in loader.cache_problem(str(read_only / "sub"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_cache_problem_of_a_chmod_read_only_directory(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        assert "read-only" in loader.cache_problem(str(read_only))
    finally:
        read_only.chmod(0o755)


def test_redirect_unusable_cache_dir(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    env = {"CUPY_CACHE_DIR": str(a_file)}
    problem = loader.redirect_unusable_cache_dir(env, cupy_imported=False)
    assert "not a directory" in problem
    assert env["CUPY_CACHE_DIR"] != str(a_file) and os.path.isdir(env["CUPY_CACHE_DIR"])
    assert loader.cache_problem(env["CUPY_CACHE_DIR"]) is None
    shutil.rmtree(env["CUPY_CACHE_DIR"])
    for env in ({"CUPY_CACHE_DIR": str(tmp_path)}, {"CUPY_CACHE_DIR": str(tmp_path / "made_by_cupy")}):
        before = dict(env)
        assert loader.redirect_unusable_cache_dir(env, cupy_imported=False) is None and env == before
    env = {"CUPY_CACHE_DIR": str(a_file)}
    assert loader.redirect_unusable_cache_dir(env, cupy_imported=True) is None  # too late: leave it
    assert env == {"CUPY_CACHE_DIR": str(a_file)}


def test_cupys_import_fails_on_a_cache_path_it_cannot_make_unless_launchers_comes_first(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    env = {**os.environ, "CUPY_CACHE_DIR": str(a_file)}
    bare = subprocess.run([sys.executable, "-c", "import cupy"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    if bare.returncode != 0:  # CuPy 14 makes its cache directory at import: why loader redirects at import
        assert "FileExistsError" in bare.stderr, bare.stderr[-3000:]
    code = ("import json, os; import adaln_lab.launchers; import cupy; from adaln_lab import loader;"
            "print(json.dumps([loader.IMPORT_PROBLEM, os.environ['CUPY_CACHE_DIR'], loader.cache_dir()]))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    problem, redirected, used = json.loads(run.stdout.splitlines()[-1])
    assert "not a directory" in problem and redirected == used != str(a_file)
    assert not os.path.exists(redirected)  # removed at exit
    assert a_file.read_text() == "x"


def test_is_cache_error():
    from cupy.cuda.compiler import CompileException

    for error in (PermissionError(13, "denied"), FileExistsError(17, "exists"), IsADirectoryError(21, "dir"),
                  OSError(28, "no space"), _driver_error(200), _driver_error(218), _driver_error(500)):
        assert loader.is_cache_error(error), error
    for error in (CompileException("kernels_cu/table.cu(3): error", "src", "name", ()), ValueError("x"),
                  RuntimeError("nvrtc"), _driver_error(2), _driver_error(700)):
        assert not loader.is_cache_error(error), error


def test_a_usable_cache_compiles_once_through_it(fake, recwarn):
    install, forgotten = fake
    compile_ = install(FakeCompile())
    assert loader.compile_kernels(0, PLAN) == {"plan": PLAN}
    assert compile_.in_memory == [None] and not forgotten
    assert not [w for w in recwarn if issubclass(w.category, loader.KernelCacheWarning)]


def test_an_unusable_cache_compiles_in_memory_with_a_warning(fake, monkeypatch):
    install, forgotten = fake
    compile_ = install(FakeCompile())
    monkeypatch.setattr(loader, "cache_problem", lambda path: f"the kernel cache {path} is read-only")
    with pytest.warns(loader.KernelCacheWarning, match="read-only"):
        assert loader.compile_kernels(0, PLAN) == {"plan": PLAN}
    assert compile_.in_memory == ["1"] and "CUPY_CACHE_IN_MEMORY" not in os.environ


def test_a_cache_moved_at_import_compiles_in_memory(fake, monkeypatch):
    install, _ = fake
    compile_ = install(FakeCompile())
    monkeypatch.setattr(loader, "IMPORT_PROBLEM", "the kernel cache '/x' is not a directory; ...")
    with pytest.warns(loader.KernelCacheWarning, match="not a directory"):
        loader.compile_kernels(0, PLAN)
    assert compile_.in_memory == ["1"]


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), IsADirectoryError(21, "a dir"),
                                   "driver 218", "driver 500"], ids=str)
def test_a_cache_failure_falls_back_to_memory(fake, error):
    install, forgotten = fake
    error = _driver_error(int(error.split()[1])) if isinstance(error, str) else error
    compile_ = install(FakeCompile(error))
    with pytest.warns(loader.KernelCacheWarning, match=type(error).__name__):
        assert loader.compile_kernels(0, PLAN) == {"plan": PLAN}
    assert compile_.in_memory == [None, "1"] and forgotten == [1]
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ


@pytest.mark.parametrize("error", ["compile", ValueError("bad"), "driver 700"], ids=str)
def test_other_failures_are_raised_as_they_are(fake, error, recwarn):
    from cupy.cuda.compiler import CompileException

    install, forgotten = fake
    if error == "compile":
        error = CompileException("kernels_cu/table.cu(3): error: x", "src", "name", ())
    elif isinstance(error, str):
        error = _driver_error(700)
    compile_ = install(FakeCompile(error))
    with pytest.raises(type(error)):
        loader.compile_kernels(0, PLAN)
    assert compile_.in_memory == [None] and not forgotten
    assert not [w for w in recwarn if issubclass(w.category, loader.KernelCacheWarning)]


def test_a_failing_fallback_raises_and_restores_the_environment(fake, monkeypatch):
    install, _ = fake
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "0")
    install(FakeCompile(PermissionError(13, "denied"), RuntimeError("nvrtc is gone")))
    with pytest.warns(loader.KernelCacheWarning), pytest.raises(RuntimeError, match="nvrtc is gone"):
        loader.compile_kernels(0, PLAN)
    assert os.environ["CUPY_CACHE_IN_MEMORY"] == "0"


def test_cupy_already_in_memory_skips_the_checks(fake, monkeypatch, recwarn):
    install, _ = fake
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    monkeypatch.setattr(loader, "cache_problem", lambda path: "read-only")
    compile_ = install(FakeCompile())
    loader.compile_kernels(0, PLAN)
    assert compile_.in_memory == ["1"] and os.environ["CUPY_CACHE_IN_MEMORY"] == "1"
    assert not [w for w in recwarn if issubclass(w.category, loader.KernelCacheWarning)]


def test_the_fallback_compiles_the_same_source_with_the_same_options(monkeypatch, tmp_path):
    """The real _compile on a fake cupy: the in-memory compile gets exactly the cached one's code and options."""
    import contextlib

    import cupy
    import cupy._util

    made = []

    class FakeRawModule:
        def __init__(self, *, code, options):
            self.code, self.options, self.calls = code, options, 0
            made.append(self)

        def get_function(self, name):
            self.calls += 1
            self.in_memory = os.environ.get("CUPY_CACHE_IN_MEMORY")
            if len(made) == 1:
                raise PermissionError(13, "Permission denied", str(tmp_path))  # CuPy's save into a read-only dir
            return types.SimpleNamespace(name=name)

    monkeypatch.setattr(cupy, "RawModule", FakeRawModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(cupy._util, "clear_memo", lambda: None)
    monkeypatch.setattr(loader, "cache_dir", lambda: str(tmp_path))
    with pytest.warns(loader.KernelCacheWarning, match="PermissionError"):
        kernels = loader.compile_kernels(0, PLAN)
    cached, in_memory = made
    assert (cached.code, cached.options) == (in_memory.code, in_memory.options) == (loader.source(PLAN),
                                                                                    loader.COMPILE_OPTIONS)
    assert (cached.in_memory, in_memory.in_memory) == (None, "1")
    assert set(kernels) == set(loader.KERNELS)
    assert kernels["norm_modulate_bwd_bf16"].max_dynamic_shared_size_bytes == PLAN.bwd_smem


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
while not os.path.exists(os.path.join(sys.argv[1], "go")):
    time.sleep(0.001)
bad = 0
for _ in range(100):
    backend.save("k.cubin", payload, "")
    got = backend.load("k.cubin")
    bad += got is not None and got != payload
print(bad)
"""


def test_cupys_disk_cache_survives_two_processes_writing_one_file(tmp_path):
    _disk_backend(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    time.sleep(2)
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


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """(compile_unit(in_memory) -> the sm_90 binary of PLAN's unit, cache directory) in this process."""
    from cupy.cuda import compiler
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    for name in ("function", "_get_arch_for_options_for_nvrtc"):  # replaced by the setup, restored after
        monkeypatch.setattr(compiler, name, getattr(compiler, name))
    namespace = {}
    exec(_NVRTC_SETUP, namespace)
    cache = tmp_path / "cache"
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

    return compile_unit, cache


def test_the_in_memory_compile_is_the_cached_compiles_binary(nvrtc):
    """Bitwise the same cubin from CuPy's disk-cache path, its in-memory path and the cache file."""
    compile_unit, cache = nvrtc
    cached = compile_unit(in_memory=False)
    (file,) = _cache_files(cache)
    assert len(cached) > 10_000 and _hash_valid(file) and file.read_bytes()[40:] == cached
    assert compile_unit(in_memory=True) == cached
    assert _cache_files(cache) == [file]  # nothing written in memory
    assert compile_unit(in_memory=False) == cached  # loaded from the file


def test_a_garbage_cache_file_is_recompiled_and_rewritten(nvrtc):
    compile_unit, cache = nvrtc
    cached = compile_unit(in_memory=False)
    (file,) = _cache_files(cache)
    file.write_bytes(os.urandom(file.stat().st_size))
    assert compile_unit(in_memory=False) == cached
    assert _hash_valid(file) and file.read_bytes()[40:] == cached


_NVRTC_RACE = _NVRTC_SETUP + """
import hashlib, os, sys, time
from adaln_lab import loader
from adaln_lab.plan import plan
gate = sys.argv[1]
open(os.path.join(gate, str(os.getpid())), "w").close()
while len(os.listdir(gate)) < 2:
    time.sleep(0.01)
print(hashlib.sha256(compile_unit(loader.source(plan(264, 64, 3)), loader.COMPILE_OPTIONS)).hexdigest())
"""


def test_two_processes_compile_at_once_into_one_empty_cache_with_nvrtc(nvrtc, tmp_path):
    """CuPy's real compile-and-save in two processes released at once into one empty cache directory."""
    compile_unit, _ = nvrtc
    expected = hashlib.sha256(compile_unit(in_memory=True)).hexdigest()
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


# ----------------------------------------------------------------------------------- the module cache

def test_threads_asking_at_once_get_one_compile_and_one_object(monkeypatch):
    calls = []

    def slow_compile(device_index, plan_):
        calls.append(plan_)
        time.sleep(0.3)
        return {"plan": plan_}

    monkeypatch.setattr(loader, "compile_kernels", slow_compile)
    plans = [plan(264, 64, 3), plan(1024, 256, 1)]
    barrier = threading.Barrier(8)
    got = [None] * 8

    def ask(i):
        barrier.wait()
        got[i] = loader.module(0, plans[i % 2])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, calls)) == sorted(map(str, plans))  # one compile per plan
    for i in range(8):
        assert got[i] is got[i % 2] and got[i]["plan"] == plans[i % 2]
    assert loader.module(0, plans[0]) is got[0]
    assert loader.module(1, plans[0]) is not got[0] and len(calls) == 3  # per device


def test_a_compiled_plan_is_not_held_up_by_another_compiling(monkeypatch):
    started = threading.Event()

    def compile_(device_index, plan_):
        if plan_ != PLAN:
            started.set()
            time.sleep(1.0)
        return {"plan": plan_}

    monkeypatch.setattr(loader, "compile_kernels", compile_)
    first = loader.module(0, PLAN)
    other = threading.Thread(target=loader.module, args=(0, plan(1024, 256, 1)))
    other.start()
    started.wait(5)
    t0 = time.perf_counter()
    assert loader.module(0, PLAN) is first
    assert time.perf_counter() - t0 < 0.5
    other.join()


def test_a_compile_that_raised_is_tried_again(monkeypatch):
    compile_ = FakeCompile(RuntimeError("first time"))
    monkeypatch.setattr(loader, "compile_kernels", compile_)
    with pytest.raises(RuntimeError):
        loader.module(0, PLAN)
    assert loader.module(0, PLAN) == {"plan": PLAN} and len(compile_.in_memory) == 2
    loader.clear_caches()
    loader.module(0, PLAN)
    assert len(compile_.in_memory) == 3


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
    from adaln_lab import final_adaln_out, loader
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
