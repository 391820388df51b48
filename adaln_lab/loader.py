"""kernels_cu/ -> one compiled CuPy RawModule per (device, plan): the only place that compiles.

The .cu files are joined into one translation unit, each preceded by `#line 1 "kernels_cu/<file>"`
so compile errors name the real file and line; the unit opens with the SHA-256 of the files'
text (CuPy's disk cache keys on the text, so an edited header never reuses a stale binary) and
then the plan's macros (`Plan.defines`). Nothing here runs at import.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .plan import Plan

KERNEL_FILES = ("adaln_common.cuh", "table.cu", "norm_modulate.cu", "norm_modulate_bwd.cu",
                "reduce_partials.cu", "table_bwd.cu", "gated_residual.cu")
INCLUDE_LINE = '#include "adaln_common.cuh"'
COMPILE_OPTIONS = ("--std=c++17",)
KERNELS = ("table_bf16", "norm_modulate_bf16", "norm_modulate_rowwise_bf16", "norm_modulate_bwd_bf16",
           "reduce_partials_bf16", "table_bwd_bf16", "table_bwd_reduce",
           "gated_residual_fwd_bf16", "gated_residual_bwd_bf16", "gated_residual_reduce")


def kernel_dir() -> Path:
    """kernels_cu/: inside the installed package, or beside it in a source checkout."""
    packaged = Path(str(resources.files("adaln_lab") / "kernels_cu"))
    if (packaged / KERNEL_FILES[0]).is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "kernels_cu"


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


@lru_cache(maxsize=None)
def module(device_index: int, plan: Plan) -> dict:
    """{kernel name: cupy RawKernel} of one plan on one device, compiled on first use."""
    import cupy

    with cupy.cuda.Device(device_index):
        raw = cupy.RawModule(code=source(plan), options=COMPILE_OPTIONS)
        kernels = {name: raw.get_function(name) for name in KERNELS}
        # opt in: static plus dynamic shared memory may pass 48 KiB
        if plan.fwd_staged:
            kernels["norm_modulate_bf16"].max_dynamic_shared_size_bytes = plan.fwd_smem
        kernels["norm_modulate_bwd_bf16"].max_dynamic_shared_size_bytes = plan.bwd_smem
        kernels["gated_residual_bwd_bf16"].max_dynamic_shared_size_bytes = plan.gr_smem
        return kernels


def kernel_resources(device_index: int, plan: Plan) -> dict:
    """Registers per thread and local (spill) bytes of every kernel of one plan."""
    return {name: {"registers": k.num_regs, "local_bytes": k.local_size_bytes}
            for name, k in module(device_index, plan).items()}


def clear_caches() -> None:
    """Forget compiled modules and the kernel text (tests that edit kernels_cu/, the sweep)."""
    _body.cache_clear()
    module.cache_clear()
