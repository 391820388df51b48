"""adaln_lab/core/loader.py's decisions: a kernel cache CuPy cannot use means a compile in memory with a
KernelCacheWarning, never a crash or a wrong kernel; the module cache compiles a plan once per process,
whichever threads ask.

CPU, with fake compilers: is the cache directory usable, was a failure the cache's fault, the fallback's
environment and arguments, CuPy's import failing on a cache path it cannot make (which importing
adaln_lab's launchers first avoids); threads asking for one plan at once. The facts about CuPy the design
leans on, and real compiles: test_loader_cupy_cache.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types

import pytest

from adaln_lab.core import loader
from adaln_lab.core.plan import plan

from ..paths import ROOT

from .loader_state import fresh_loader  # noqa: F401,E402  (autouse: a loader that compiled nothing)

PLAN = plan(264, 64, 3)




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


@pytest.mark.integration  # a process of its own
def test_cupys_import_fails_on_a_cache_path_it_cannot_make_unless_launchers_comes_first(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    env = {**os.environ, "CUPY_CACHE_DIR": str(a_file)}
    bare = subprocess.run([sys.executable, "-c", "import cupy"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    if bare.returncode != 0:  # CuPy 14 makes its cache directory at import: why loader redirects at import
        assert "FileExistsError" in bare.stderr, bare.stderr[-3000:]
    code = ("import json, os; import adaln_lab.core.launchers; import cupy; from adaln_lab.core import loader;"
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
    assert set(kernels) == set(loader.entry_points(PLAN))
    assert kernels["norm_modulate_bwd_bf16"].max_dynamic_shared_size_bytes == PLAN.bwd_smem
    assert kernels["norm_modulate_bwd_exact_bf16"].max_dynamic_shared_size_bytes == PLAN.bwd_smem  # the same stages


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
