"""The one rule for what the CUDA kernels of `kernels_cu/` (and their Numba twin) take, one message per reason.

Every function returns the error to raise (TypeError for a dtype, ValueError for a device or a shape, ImportError
on CUDA tensors without CuPy, the cuda extra), naming the argument, or None when the kernels take the inputs. Inputs
are already validated (shapes agree): these rules only say what the kernels cannot do. `route` turns an answer into
the route of one public call ("cupy", or "torch" with a `KernelFallbackWarning` on CUDA; backend "cupy" raises). Who
asks: the ops' public functions (once per call, the route saved for the backward), `adaln_lab.dlpack`, the modules.

    final_adaln_out(x, norm_weight, temb, weight, bias)   norm_out's kernels (bf16, fp32 temb, plan shapes)
    table(temb, weight, bias)                               table.cu / table_bwd.cu for an (N, D) projection
    rows(x, table_rows, **bf16)                             the row kernels with R table rows
    block(x, temb, weight, bias, norm1_weight, norm2_weight) one H3 block's AdaLN (the table and the rows)
    numba_final_adaln_out(...)                              the twin: norm_out's rule plus its table's limit
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from .library import eager
from .warnings import KernelFallbackWarning
from .plan import ROWS_MAX, T_MAX, TWIN_TABLE_THREADS, check_shapes, check_table

_BF16 = torch.bfloat16
_F32 = torch.float32
_NAMES = {_BF16: "bfloat16", _F32: "float32"}
STATIC_SHARED_MAX = 48 * 1024  # bytes of static shared memory one CUDA block may declare (the twin's limit)


# Whether CuPy is installed: one look at the import path when this module loads (no import, well under a
# millisecond), kept as a constant that torch.compile reads (dynamo cannot trace importlib's lookup).
def _cupy_found() -> bool:
    try:
        return importlib.util.find_spec("cupy") is not None
    except ImportError:  # an import hook that refuses the name, as a missing package
        return False


CUPY_FOUND = _cupy_found()


def _not_cuda(name: str, t: torch.Tensor) -> Exception | None:
    if t.device.type != "cuda":
        return ValueError(f"the CUDA kernels need CUDA tensors, but {name} is on {t.device}")
    if not CUPY_FOUND:
        return ImportError("the CUDA kernels need CuPy (and numba-cuda for the twin), which the cuda extra "
                           "brings: pip install 'adaln_lab[cuda]'")
    return None


def _dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> Exception | None:
    if t.dtype != dtype:
        return TypeError(f"the CUDA kernels need {name} in {_NAMES[dtype]}, got {t.dtype}")
    return None


def _other_device(x_name: str, x: torch.Tensor, **tensors: torch.Tensor) -> Exception | None:
    for name, t in tensors.items():
        if t.device != x.device:
            return ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}: all inputs must share "
                              "one device")
    return None


def _shapes(H: int, D: int, T: int) -> Exception | None:
    try:
        check_shapes(H, D, T)
    except ValueError as error:
        return error
    return None


def final_adaln_out(x, norm_weight, temb, weight, bias=None) -> Exception | None:
    """norm_out's kernels: bf16 x / norm_weight / weight / bias, fp32 temb, CUDA, shapes the plan takes."""
    if not (x.dtype == norm_weight.dtype == weight.dtype == _BF16 and (bias is None or bias.dtype == _BF16)):
        for name, t in (("x", x), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
            if t is not None and t.dtype != _BF16:
                return _dtype(name, t, _BF16)
    return (_dtype("temb", temb, _F32) or _not_cuda("x", x)
            or _shapes(x.shape[-1], temb.shape[1], temb.shape[0]))


def table(temb, weight, bias) -> Exception | None:
    """table.cu / table_bwd.cu for temb (T, D), weight (N, D), bias (N,): fp32 temb, bf16 weight and bias,
    one CUDA device, a plan of N columns."""
    device = temb.device
    if (temb.dtype != _F32 or weight.dtype != _BF16 or bias.dtype != _BF16 or weight.device != device
            or bias.device != device):  # the reason, in this order
        error = (_not_cuda("temb", temb) or _other_device("temb", temb, weight=weight, bias=bias)
                 or _dtype("temb", temb, _F32) or _dtype("weight", weight, _BF16) or _dtype("bias", bias, _BF16))
    else:
        error = _not_cuda("temb", temb)
    if error is not None:
        return error
    try:
        check_table(temb.shape[1], temb.shape[0], weight.shape[0])
    except ValueError as err:
        return err
    return None


def rows(x, table_rows: int, **bf16_tensors) -> Exception | None:
    """The row kernels on x (..., S, H) with `table_rows` table rows: x and every named tensor bf16 on x's CUDA
    device, at most T_MAX table rows, a width the plan takes."""
    error = _not_cuda("x", x) or _dtype("x", x, _BF16)
    if error is not None:
        return error
    device = x.device
    for name, t in bf16_tensors.items():
        if t.device != device or t.dtype != _BF16:
            return _other_device("x", x, **{name: t}) or _dtype(name, t, _BF16)
    if table_rows > T_MAX:
        return ValueError(f"the CUDA kernels take at most {T_MAX} table rows, got {table_rows} (an H3 block has "
                          f"3 per timestep: T = temb.shape[0] <= {T_MAX // 3})")
    return _shapes(x.shape[-1], 8, max(table_rows, 1))


def table_dtype(dtype: torch.dtype) -> Exception | None:
    """The row kernels read a table of bf16 values: the projection's dtype (`table_dtype`) must be bfloat16."""
    if dtype != _BF16:
        return TypeError(f"the CUDA kernels need the table's dtype (the projection's, table_dtype) bfloat16, got "
                         f"{dtype}")
    return None


def on_device(x, **tensors) -> Exception | None:
    """Every named tensor (the fp32 table chunks, indices, saved statistics) on x's device."""
    return _other_device("x", x, **tensors)


def block(x, temb, weight, bias, norm1_weight, norm2_weight, modalities: int = 3) -> Exception | None:
    """One H3 block's AdaLN ops: the table's rule on `kernel_temb(temb, weight)`, then the rows' with
    3T table rows, bf16 norm weights."""
    return (table(kernel_temb(temb, weight), weight, bias)
            or rows(x, modalities * temb.shape[0], norm1_weight=norm1_weight, norm2_weight=norm2_weight))


def kernel_temb(temb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """temb as the table kernels take it: widened to float32 when it has weight's dtype. Exact: torch computes
    a bf16 / fp16 SiLU in float32 and rounds once, as the kernels do before their cast to weight's dtype
    (tests/nn/test_adaln_out.py checks every finite bf16 and fp16 input)."""
    return temb.float() if temb.dtype == weight.dtype and temb.dtype in (torch.bfloat16, torch.float16) else temb


def twin_td_max(H: int, D: int, T: int) -> int:
    """The largest T * D the twin's table kernel takes: it keeps bf16(silu(temb)) as T * D fp32 values in
    static shared memory beside its (warps, 32) fp32 butterfly slots, within 48 KiB (11776 at its 512 threads,
    plan.TWIN_TABLE_THREADS)."""
    return (STATIC_SHARED_MAX - TWIN_TABLE_THREADS * 4) // 4


def numba_final_adaln_out(x, norm_weight, temb, weight, bias=None, *, simulating: bool = False
                          ) -> Exception | None:
    """The Numba twin of norm_out's kernels: the same rule, on CUDA tensors or, under numba's simulator
    (`simulating`, NUMBA_ENABLE_CUDASIM=1), CPU tensors, with T * D <= twin_td_max (its table's static shared
    memory) and at most ROWS_MAX rows."""
    if simulating and x.device.type != "cpu":
        return ValueError(f"backend='numba' under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) needs CPU "
                          f"tensors, but x is on {x.device}; unset NUMBA_ENABLE_CUDASIM to run on the GPU")
    if not simulating and x.device.type != "cuda":
        return ValueError(f"backend='numba' needs CUDA tensors (or CPU tensors under numba's CUDA simulator, "
                          f"NUMBA_ENABLE_CUDASIM=1), but x is on {x.device}")
    for name, t in (("x", x), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != _BF16:
            return _dtype(name, t, _BF16)
    H, (T, D) = x.shape[-1], temb.shape
    error = _dtype("temb", temb, _F32) or _shapes(H, D, T)
    if error is not None:
        return error
    if T * D > twin_td_max(H, D, T):
        return ValueError(f"the Numba twin's table kernel takes T * D <= {twin_td_max(H, D, T)} (temb in static "
                          f"shared memory), got temb of shape {tuple(temb.shape)}")
    if x.numel() // H > ROWS_MAX:
        return ValueError(f"the Numba twin takes at most {ROWS_MAX} rows, got {x.numel() // H}")
    return None


def route(op: str, backend: str, x: torch.Tensor, error: Exception | None) -> str:
    """The one decision of a public call, made once and saved for its backward: "cupy" (the kernels) when `error`
    (this module's answer for the inputs) is None; else backend "cupy" raises `error`, and "auto" warns
    (`warn_fallback`) and takes "torch" (the op's torch code)."""
    if error is None:
        return "cupy"
    if backend == "cupy":
        raise error
    warn_fallback(op, x, error)
    return "torch"


def warn_fallback(op: str, x: torch.Tensor, error: Exception) -> None:
    """Warn (once per op and reason: Python's default filter) that `op` on CUDA x runs its torch code because
    of `error`. Silent on other devices, where the torch code is what backend "auto" means, and while
    torch.compile traces (a warning there is a graph break; the eager call warns)."""
    if x.is_cuda and eager():
        warnings.warn(f"{op}: the CUDA kernels cannot take these inputs ({error}); this call runs the torch code "
                      "(diffusers' numerics; parameter gradients summed by atomics, not repeatable run to run). "
                      "backend='cupy' raises instead", KernelFallbackWarning, stacklevel=3)


def check_saved(op: str, x: torch.Tensor, **params: torch.Tensor) -> None:
    """Raise RuntimeError unless each saved bf16 parameter is still a bf16 tensor on x's device when the kernels'
    backward is about to read it: offloading (diffusers' group offloading, accelerate) and layerwise casting swap a
    parameter's data after the forward, which the kernels would otherwise read as a raw pointer."""
    device = x.device
    for name, t in params.items():
        if t.device != device or t.dtype != _BF16:
            raise RuntimeError(f"{op} backward: {name} is now {t.dtype} on {t.device}, but the forward ran the CUDA "
                               f"kernels on it in bfloat16 on {x.device} (moved or cast after the forward, as "
                               "offloading and layerwise casting do); keep the parameters in place until the "
                               "backward")


def refuse(error: Exception | None) -> None:
    """Raise `error` unless it is None."""
    if error is not None:
        raise error
