"""The kernels on any array that speaks DLPack (CuPy, torch, ...): zero-copy in, zero-copy out.

    import cupy, adaln_lab.dlpack as adaln
    out, table_f32, rstd = adaln.forward(x, norm_weight, temb, weight, bias, timestep_indices)
    dx, d_norm_weight, d_temb, d_weight, d_bias = adaln.backward(dy, x, norm_weight, temb, weight,
                                                                 timestep_indices, table_f32, rstd)

Inputs are read in place through DLPack (`torch.from_dlpack`, no copy), so they must be contiguous
and 16-byte aligned (a clear error otherwise). Outputs are allocated by the library of `x` (CuPy
arrays for CuPy input, torch tensors otherwise) and the kernels run on that library's current stream
(`with cupy.cuda.Stream(...)` or `with torch.cuda.stream(...)` picks it), where the library's own
allocator orders the reuse of every temporary. Results are bitwise those of
`adaln_lab.final_adaln_out` (same kernels, same plan). On the CPU (torch tensors) the same two
functions run the launch ops' reference bodies: the diffusers replay forward and the analytic backward.

Shapes: x (..., S, H) bf16, norm_weight (H,) bf16, temb (T, D) fp32, weight (2H, D) bf16, bias (2H,)
bf16, timestep_indices (S,) int64; table_f32 (T, 2H) fp32 and rstd (rows,) fp32 are the forward's
saved values the backward takes; gradients have their inputs' shapes (d_bias (2H,)).

Arguments are checked before anything runs, each error naming the argument: TypeError for what is no
DLPack array (a list, None), then `adaln_lab.validate`'s checks. A timestep index outside [0, T) is an
IndexError on the CPU; on CUDA it is not checked (that check would wait for the GPU), as in
`final_adaln_out`: the kernels never read outside the table, and that row's output is NaN.
"""

from __future__ import annotations

import torch

from .core import support
from .core.checks import validate
from .core.plan import plan as make_plan
from .core.tensors import current_stream
from .ops.final_adaln_out import launch
from .reference.backward import final_adaln_out_backward

_TORCH_TO_CUPY = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _tensors(names: tuple[str, ...], arrays: tuple) -> list[torch.Tensor]:
    """Each array as a torch tensor (zero-copy); TypeError naming the argument for anything that is no DLPack
    array (a list, None, ...) or that torch cannot read."""
    tensors = []
    for name, a in zip(names, arrays):
        if not isinstance(a, torch.Tensor):
            if not hasattr(a, "__dlpack__"):
                raise TypeError(f"adaln_lab.dlpack: {name} must be an array that supports DLPack (a CuPy array or a "
                                f"torch tensor), got {type(a).__name__}")
            try:
                a = torch.from_dlpack(a)
            except (BufferError, RuntimeError, TypeError, ValueError) as error:
                raise TypeError(f"adaln_lab.dlpack: torch.from_dlpack cannot read {name} ({type(a).__name__}): "
                                f"{error}") from None
        tensors.append(a)
    return tensors


def _is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


class _Allocator:
    """Outputs from the library of the reference array; each output also viewed as a torch tensor."""

    def __init__(self, like):
        self.cupy = _is_cupy(like)

    def empty(self, shape, dtype: torch.dtype, device: torch.device):
        if self.cupy:
            import cupy

            if dtype == torch.bfloat16:
                import ml_dtypes

                array = cupy.empty(shape, dtype=ml_dtypes.bfloat16)
            else:
                array = cupy.empty(shape, dtype=_TORCH_TO_CUPY[dtype])
            return array, torch.from_dlpack(array)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        return tensor, tensor

    def stream(self, device: torch.device) -> int:
        if self.cupy:
            import cupy

            return cupy.cuda.get_current_stream().ptr
        return current_stream(device.index)


def _check(x, norm_weight, temb, weight, bias, timestep_indices, eps):
    validate(x, norm_weight, temb, weight, bias, timestep_indices, eps, check_indices=not x.is_cuda)
    if x.is_cuda:
        support.refuse(support.final_adaln_out(x, norm_weight, temb, weight, bias))
    elif x.dtype != torch.bfloat16 or temb.dtype != torch.float32:
        raise TypeError(f"adaln_lab.dlpack needs x in bfloat16 and temb in float32, got {x.dtype} and {temb.dtype}")
    _in_place(x=x, norm_weight=norm_weight, temb=temb, weight=weight, bias=bias, timestep_indices=timestep_indices)


def _in_place(**arrays):
    """Arrays read in place by the kernels: contiguous and 16-byte aligned, or a clear error."""
    for name, t in arrays.items():
        if not t.is_contiguous() or (t.is_cuda and t.data_ptr() % 16):
            raise ValueError(f"adaln_lab.dlpack needs {name} contiguous (C order) and 16-byte aligned: it is read "
                             "in place (zero-copy)")


def _setup(x, temb, like):
    """The plan, its rows and the output allocator of one call."""
    plan = make_plan(x.shape[-1], temb.shape[1], temb.shape[0])
    return plan, plan.rows(x.numel() // plan.H), _Allocator(like)


def forward(x, norm_weight, temb, weight, bias, timestep_indices, eps: float = 1e-5):
    """(out (..., S, H) bf16, table_f32 (T, 2H) fp32, rstd (rows,) fp32) as arrays of x's library."""
    like = x
    x, norm_weight, temb, weight, bias, timestep_indices = _tensors(
        ("x", "norm_weight", "temb", "weight", "bias", "timestep_indices"),
        (x, norm_weight, temb, weight, bias, timestep_indices))
    _check(x, norm_weight, temb, weight, bias, timestep_indices, eps)
    if not x.is_cuda:
        return launch.reference_forward(x, norm_weight, temb, weight, bias, timestep_indices, float(eps))
    plan, rows, alloc = _setup(x, temb, like)
    H, T = plan.H, plan.T
    out, out_t = alloc.empty(tuple(x.shape), torch.bfloat16, x.device)
    table_f32, table_f32_t = alloc.empty((T, 2 * H), torch.float32, x.device)
    rstd, rstd_t = alloc.empty((rows.rows,), torch.float32, x.device)
    table, table_t = alloc.empty((T, 2 * H), torch.bfloat16, x.device)
    with torch.cuda.device(x.device):
        launch.kernels_forward(x, norm_weight, temb, weight, bias, timestep_indices, float(eps), out_t.data_ptr(),
                               table_t.data_ptr(), table_f32_t.data_ptr(), rstd_t.data_ptr(), alloc.stream(x.device))
    return out, table_f32, rstd


def backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    """(dx, d_norm_weight, d_temb, d_weight, d_bias) as arrays of x's library; fixed-order reductions."""
    like = x
    dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd = _tensors(
        ("dy", "x", "norm_weight", "temb", "weight", "timestep_indices", "table_f32", "rstd"),
        (dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd))
    _check(x, norm_weight, temb, weight, weight[:, 0].contiguous(), timestep_indices, 1e-5)  # a bias of the right shape
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy must be a {x.dtype} array of x's shape {tuple(x.shape)}")
    _in_place(dy=dy, table_f32=table_f32, rstd=rstd)
    T, H = temb.shape[0], x.shape[-1]
    if table_f32.shape != (T, 2 * H) or table_f32.dtype != torch.float32:
        raise ValueError(f"table_f32 must be the forward's (T, 2H) = ({T}, {2 * H}) float32 array")
    if rstd.shape != (x.numel() // H,) or rstd.dtype != torch.float32:
        raise ValueError(f"rstd must be the forward's ({x.numel() // H},) float32 array")
    if not x.is_cuda:
        return final_adaln_out_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)
    plan, rows, alloc = _setup(x, temb, like)
    H, T, D = plan.H, plan.T, plan.D
    arrays = [alloc.empty(shape, dtype, x.device) for shape, dtype in (
        (tuple(x.shape), torch.bfloat16), ((H,), torch.bfloat16), ((T, D), torch.float32),
        ((2 * H, D), torch.bfloat16), ((2 * H,), torch.bfloat16), ((rows.bwd_bytes // 4,), torch.float32))]
    with torch.cuda.device(x.device):
        launch.kernels_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32.data_ptr(),
                                rstd.data_ptr(), [t for _, t in arrays[:5]], alloc.stream(x.device),
                                workspace=arrays[5][1])
    return tuple(a for a, _ in arrays[:5])
