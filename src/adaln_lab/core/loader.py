"""kernels_cu/ -> one compiled CuPy RawModule per (device, plan): the only place that compiles.
The .cu files make one translation unit, each behind `#line 1 "kernels_cu/<file>"` (errors name the real
file and line), opened by the SHA-256 of their text (CuPy's disk cache keys on the text: an edited header
never reuses a stale binary) and the plan's macros.

Kernel cache: `RawModule` compiles (NVRTC) at its first `get_function` into CuPy's disk cache
(CUPY_CACHE_DIR, default ~/.cupy/kernel_cache): per key a file of SHA-1(binary) + binary, written to a
temporary file and renamed, so processes compiling at once write whole files, and a torn or garbage file
fails the hash (CuPy recompiles, rewrites). Anything else compiles in memory with a `KernelCacheWarning`
(CUPY_CACHE_IN_MEMORY=1 for that compile: CuPy's own path and options, `-ftz=true` included, so the same
kernels): a read-only, missing-and-unmakeable or non-directory cache; an OSError from the cached compile,
or the driver refusing the cached binary or missing a kernel in it (CuPy's memos dropped first; a
CompileException is raised as is). CuPy's import raises if it cannot make its directory: imported before
CuPy (launchers imports it first), this module then points CUPY_CACHE_DIR at a private temporary
directory (all it does at import). One lock: a plan compiles once, threads asking at once get one dict.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .plan import ROW_ORDER_KEYS_MAX, Plan
from .warnings import KernelCacheWarning

KERNEL_FILES = ("adaln_common.cuh", "table.cu", "norm_modulate.cu", "row_order.cu", "norm_modulate_bwd.cu",
                "reduce_partials.cu", "table_bwd.cu", "table_bwd_mma.cu", "gated_residual.cu", "gated_residual_norm.cu",
                "exact_sums.cu", "exact_row_windows.cu", "exact_row_pass.cu", "exact_products.cu", "exact_state.cu")
INCLUDE_LINE = '#include "adaln_common.cuh"'
COMPILE_OPTIONS = ("--std=c++17",)
KERNELS = ("table_act", "table_bf16", "norm_modulate_bf16", "norm_modulate_rowwise_bf16", "norm_modulate_warp_bf16",
           "norm_modulate_bwd_bf16", "row_order", "row_order_count", "row_order_scan", "row_order_scatter",
           "norm_modulate_bwd_sorted_bf16", "norm_modulate_bwd_residual_sorted_bf16", "reduce_partials_bf16",
           "reduce_partials_sorted_bf16", "table_bwd_bf16", "table_bwd_d_weight_bf16", "table_bwd_dact_bf16",
           "table_bwd_mma_terms", "table_bwd_mma_d_weight", "table_bwd_mma_dact",
           "table_bwd_reduce", "gated_residual_fwd_bf16", "gated_residual_bwd_sorted_bf16",
           "gated_residual_reduce_sorted", "gated_residual_norm_bf16", "exact_sums_bf16",
           "exact_carry", "norm_modulate_bwd_exact_bf16", "norm_modulate_bwd_sorted_exact_bf16",
           "norm_modulate_bwd_residual_sorted_exact_bf16", "gated_residual_bwd_sorted_exact_bf16",
           "exact_weight_products_f32", "exact_weight_products_bf16", "exact_products", "exact_round",
           "exact_input_products_f32", "exact_input_products_bf16", "exact_input_fold", "exact_fixup_rows_bf16",
           "exact_fixup_sorted_bf16", "exact_fixup_gates_bf16")
TB_FUSED, TB_HALVES = ("table_bwd_bf16",), ("table_bwd_d_weight_bf16", "table_bwd_dact_bf16")
TB_MMA = ("table_bwd_mma_terms", "table_bwd_mma_d_weight", "table_bwd_mma_dact")  # table_bwd_mma.cu (plan.tb_mma)
ROW_ORDER_ONE, ROW_ORDER_WIDE = ("row_order",), ("row_order_count", "row_order_scan", "row_order_scatter")


def entry_points(plan: Plan) -> tuple:
    """The entry points the unit of `plan` defines: KERNELS less the table_bwd kernels the plan does not launch (the
    unit compiles only those it runs): table_bwd.cu's one kernel or its two halves (plan.tb_split), or on tensor
    cores table_bwd_mma.cu's three in their place (plan.tb_mma); row_order.cu's one-block kernel or its three wide
    ones (plan.row_order_wide)."""
    left_out = TB_FUSED + TB_HALVES if plan.tb_mma else (TB_FUSED if plan.tb_split else TB_HALVES) + TB_MMA
    left_out += ROW_ORDER_ONE if plan.row_order_wide else ROW_ORDER_WIDE
    return tuple(name for name in KERNELS if name not in left_out)


DEFAULT_CACHE_DIR = os.path.expanduser("~/.cupy/kernel_cache")  # CuPy's default
# driver statuses of an unusable image: INVALID_IMAGE, NO_BINARY_FOR_GPU, INVALID_PTX, UNSUPPORTED_PTX_VERSION,
BAD_BINARY_STATUSES = frozenset({200, 209, 218, 222, 300, 302, 303, 500})  # INVALID_SOURCE, SHARED_OBJECT_*, NOT_FOUND


def kernel_dir() -> Path:
    """kernels_cu/, the package's data folder: src/adaln_lab/kernels_cu/ of the checkout (an editable install, or
    src/ on the path), or the installed package's copy."""
    return Path(str(resources.files("adaln_lab") / "kernels_cu"))


@lru_cache(maxsize=None)
def _body(directory: str) -> tuple[str, str]:
    parts = []
    for name in KERNEL_FILES:
        text = (Path(directory) / name).read_text().replace(INCLUDE_LINE, "")  # the header is part of the unit
        parts.append(f'#line 1 "kernels_cu/{name}"\n{text}')
    body = "\n".join(parts)
    return body, hashlib.sha256(body.encode()).hexdigest()


def source(plan: Plan) -> str:
    """The translation unit of one plan: hash line, the plan's macros, then every file behind its #line marker."""
    body, digest = _body(str(kernel_dir()))
    defines = "".join(f"#define ADALN_{name} {value}\n" for name, value in plan.defines().items())
    return f"// adaln_lab kernels_cu sha256 {digest}\n{defines}{body}"


def cache_dir() -> str:
    """The directory CuPy's disk cache uses: its backend's once CuPy is imported, else what it will take."""
    path = getattr(getattr(sys.modules.get("cupy.cuda.compiler"), "_kernel_cache_backend", None), "_cache_dir", None)
    return path if isinstance(path, str) else os.environ.get("CUPY_CACHE_DIR", DEFAULT_CACHE_DIR)


def _flag(name: str) -> bool:
    """CuPy's rule for its boolean environment variables: an integer equal to 1."""
    try:
        return int(os.environ.get(name, "")) == 1
    except ValueError:
        return False


def cache_problem(path: str) -> str | None:
    """Why CuPy cannot keep kernels in the directory `path` (None if it can, or can create it)."""
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            return f"the kernel cache {path} is read-only"
        return None
    if not path or os.path.lexists(path):
        return f"the kernel cache {path!r} is not a directory"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
        return f"the kernel cache {path} cannot be created"
    return None


def redirect_unusable_cache_dir(environ=os.environ, cupy_imported: bool | None = None) -> str | None:
    """Before CuPy's import: if CuPy could not make its cache directory (its import would raise), point
    CUPY_CACHE_DIR at a private temporary directory (removed at exit). Returns the problem, or None."""
    imported = "cupy.cuda.compiler" in sys.modules if cupy_imported is None else cupy_imported
    path = environ.get("CUPY_CACHE_DIR", DEFAULT_CACHE_DIR)
    problem = None if imported or os.path.isdir(path) else cache_problem(path)  # a read-only dir imports fine
    if problem is None:
        return None
    try:
        private = tempfile.mkdtemp(prefix="adaln_lab_kernel_cache_")
    except OSError:
        return None  # nowhere to point it: CuPy's import raises its own error
    atexit.register(shutil.rmtree, private, True)
    environ["CUPY_CACHE_DIR"] = private
    return f"{problem}; CuPy's cache of this process is {private}"


IMPORT_PROBLEM = redirect_unusable_cache_dir()


def is_cache_error(error: BaseException) -> bool:
    """Whether a failed cached compile is the cache's fault: an OSError, or the driver refusing the binary."""
    from cupy_backends.cuda.api.driver import CUDADriverError

    return isinstance(error, OSError) or (isinstance(error, CUDADriverError)
                                          and getattr(error, "status", None) in BAD_BINARY_STATUSES)


def _compile(device_index: int, plan: Plan) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        raw = cupy.RawModule(code=source(plan), options=COMPILE_OPTIONS)
        kernels = {name: raw.get_function(name) for name in entry_points(plan)}  # the first one compiles (or loads)
        # opt in: static plus dynamic shared memory may pass 48 KiB
        if plan.fwd_staged:
            kernels["norm_modulate_bf16"].max_dynamic_shared_size_bytes = plan.fwd_smem
        kernels["norm_modulate_bwd_bf16"].max_dynamic_shared_size_bytes = plan.bwd_smem
        kernels["norm_modulate_bwd_sorted_bf16"].max_dynamic_shared_size_bytes = plan.bwd_smem
        kernels["norm_modulate_bwd_exact_bf16"].max_dynamic_shared_size_bytes = plan.bwd_smem
        kernels["norm_modulate_bwd_sorted_exact_bf16"].max_dynamic_shared_size_bytes = plan.bwd_smem
        if not plan.row_order_wide:
            kernels["row_order"].max_dynamic_shared_size_bytes = plan.row_order_smem(ROW_ORDER_KEYS_MAX)
        if plan.bwd_res_stages:
            kernels["norm_modulate_bwd_residual_sorted_bf16"].max_dynamic_shared_size_bytes = plan.bwd_res_smem
            kernels["norm_modulate_bwd_residual_sorted_exact_bf16"].max_dynamic_shared_size_bytes = plan.bwd_res_smem
        kernels["reduce_partials_bf16"].max_dynamic_shared_size_bytes = plan.rp_smem
        return kernels


def compile_kernels(device_index: int, plan: Plan) -> dict:
    """{kernel name: cupy RawKernel} of one plan: through CuPy's disk cache, else in memory with a warning."""
    problem = None if _flag("CUPY_CACHE_IN_MEMORY") else (IMPORT_PROBLEM or cache_problem(cache_dir()))
    if problem is None:
        try:
            return _compile(device_index, plan)
        except Exception as error:
            if not is_cache_error(error):
                raise
            problem = f"{type(error).__name__}: {error}"
        import cupy._util
        cupy._util.clear_memo()  # else CuPy hands out a module it loaded from a bad file again
    warnings.warn(f"CuPy's kernel cache cannot be used ({problem}): adaln_lab compiles its kernels in memory "
                  "(the same source and options, so the same kernels); fix CUPY_CACHE_DIR to keep them",
                  KernelCacheWarning, stacklevel=3)
    old = os.environ.get("CUPY_CACHE_IN_MEMORY")
    os.environ["CUPY_CACHE_IN_MEMORY"] = "1"  # CuPy reads it at every compile
    try:
        return _compile(device_index, plan)
    finally:
        if old is None:
            os.environ.pop("CUPY_CACHE_IN_MEMORY", None)
        else:
            os.environ["CUPY_CACHE_IN_MEMORY"] = old


_modules: dict = {}
_lock = threading.Lock()


def module(device_index: int, plan: Plan) -> dict:
    """{kernel name: cupy RawKernel} of one plan on one device, compiled once on first use (a raise: next time)."""
    key = (device_index, plan)
    kernels = _modules.get(key)
    if kernels is None:
        with _lock:
            kernels = _modules.get(key)
            if kernels is None:
                kernels = _modules[key] = compile_kernels(device_index, plan)
    return kernels


def kernel_resources(device_index: int, plan: Plan) -> dict:
    """Registers per thread and local (spill) bytes of every kernel of one plan."""
    return {name: {"registers": k.num_regs, "local_bytes": k.local_size_bytes}
            for name, k in module(device_index, plan).items()}


def clear_caches() -> None:
    """Forget compiled modules and the kernel text (tests that edit kernels_cu/, the sweep)."""
    _body.cache_clear()
    with _lock:
        _modules.clear()
