"""The one input check shared by every backend of `final_adaln_out`.

Every failure names the argument: TypeError for a wrong type or dtype, ValueError for a wrong
shape, device or eps, IndexError for a timestep index outside [0, T).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def validate(x, norm_weight, temb, weight, bias, timestep_indices, eps, *, check_indices: bool = True):
    """Check the arguments of `final_adaln_out`; return (S, H, T, D).

    Shapes: x (..., S, H); norm_weight (H,); temb (T, D) float32; weight (2H, D); bias (2H,);
    timestep_indices (S,) int64 with values in [0, T). All tensors on one device; x, norm_weight,
    weight and bias floating point; weight and bias of one dtype.

    `check_indices=False` skips the value range check of `timestep_indices` (on CUDA that check
    costs one host synchronisation); shapes, dtypes and devices are always checked.
    """
    named = {
        "x": x,
        "norm_weight": norm_weight,
        "temb": temb,
        "weight": weight,
        "bias": bias,
        "timestep_indices": timestep_indices,
    }
    for name, value in named.items():
        _tensor(name, value)
    for name in ("x", "norm_weight", "weight", "bias"):
        if named[name].dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be floating point, got {named[name].dtype}")
    if temb.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"temb must be float32 (or float64), got {temb.dtype}")
    if timestep_indices.dtype != torch.int64:
        raise TypeError(f"timestep_indices must be int64, got {timestep_indices.dtype}")
    if bias.dtype != weight.dtype:
        raise TypeError(f"bias dtype {bias.dtype} must equal weight dtype {weight.dtype}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")

    device = x.device
    for name, value in named.items():
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but x is on {device}: all inputs must share one device")

    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., S, H), got {tuple(x.shape)}")
    S, H = x.shape[-2], x.shape[-1]
    if H == 0:
        raise ValueError("x must have a non-empty last dimension H")
    if norm_weight.shape != (H,):
        raise ValueError(f"norm_weight must have shape ({H},) to match x's last dim, got {tuple(norm_weight.shape)}")
    if temb.dim() != 2 or temb.shape[0] == 0 or temb.shape[1] == 0:
        raise ValueError(f"temb must have shape (T, D) with T, D >= 1, got {tuple(temb.shape)}")
    T, D = temb.shape
    if weight.shape != (2 * H, D):
        raise ValueError(f"weight must have shape (2H, D) = ({2 * H}, {D}), got {tuple(weight.shape)}")
    if bias.shape != (2 * H,):
        raise ValueError(f"bias must have shape (2H,) = ({2 * H},), got {tuple(bias.shape)}")
    if timestep_indices.shape != (S,):
        raise ValueError(f"timestep_indices must have shape (S,) = ({S},) to match x, got {tuple(timestep_indices.shape)}")
    if check_indices and S > 0:
        lo, hi = torch.aminmax(timestep_indices)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= T:
            bad = lo if lo < 0 else hi
            raise IndexError(f"timestep_indices holds {bad}, outside [0, T) = [0, {T})")
    return S, H, T, D
