"""`modulation_table`: an H3 block's AdaLN table `linear(silu(temb).to(weight.dtype), weight, bias)` as a custom op.

    table = modulation_table(temb (T, D), weight (N, D), bias (N,)) -> (T, N) float32

N = 18H for a block's `adaln_proj.linear` (six chunks for each of the three modalities). The values are
diffusers' table in the projection's dtype, upcast exactly: a float32 tensor holding bf16 values for bf16
parameters (float64 for float64 parameters). The consumers (`modulated_rms_norm`, `gated_residual`) cast
their slices back to the projection's dtype (exact) and replay diffusers' ops, so the forward is
diffusers', while their gradients reach the table in float32 and autograd adds them in float32 (the six
chunks are disjoint column ranges, so the adds are exact); diffusers instead sums them in bf16.

Layers (as `adaln_lab.cuda_op`):
- `torch.ops.adaln_lab.modulation_table_fwd(temb, weight, bias, table_backend) -> table` and
  `torch.ops.adaln_lab.modulation_table_bwd(d_table, temb, weight, bias) -> (d_temb, d_weight, d_bias)`:
  torch.library custom ops with fake kernels and `register_autograd`, so torch.compile(fullgraph=True),
  CUDA graphs and `torch.library.opcheck` take them.
- Their default (CPU, any device) kernels are torch code: the forward replays diffusers; the backward is
  the exact derivative, in float64 and rounded once per output: d_weight = d_table^T @ silu(temb),
  d_bias = column sums of d_table (t in order), d_temb = (d_table @ weight) * silu'(temb). As the CUDA
  kernels, the SiLU output is used unrounded (straight-through the declared cast to weight's dtype).
- Their CUDA kernels (`adaln_lab.block_cuda`: table.cu, a fixed-order GEMV whose rows do not depend on T,
  and table_bwd.cu) run for bf16 weight and bias, fp32 temb (or bf16 temb, widened exactly: `kernel_temb`)
  and supported shapes; anything else runs the torch code, since diffusers models run in any dtype.
  `table_backend="torch"` keeps F.linear (cuBLAS: diffusers' own bits on the same GPU) for the forward.

Gradients: d_temb (T, D) in temb's dtype, d_weight (N, D) and d_bias (N,) in the parameters' dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .block_reference import replay_table, table_dtype_of

TABLE_BACKENDS = ("cuda", "torch")


def _table_torch(temb, weight, bias):
    return replay_table(temb, weight, bias).to(table_dtype_of(weight)).contiguous()


@torch.library.custom_op("adaln_lab::modulation_table_fwd", mutates_args=())
def modulation_table_fwd(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         table_backend: str) -> torch.Tensor:
    """table (T, N): diffusers' table upcast to float32 (module docstring)."""
    return _table_torch(temb, weight, bias)


@modulation_table_fwd.register_fake
def _(temb, weight, bias, table_backend):
    return temb.new_empty((temb.shape[0], weight.shape[0]), dtype=table_dtype_of(weight))


def kernel_temb(temb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """temb as the CUDA kernels take it: widened to float32 when it has weight's dtype. Exact: torch computes
    a bf16 / fp16 SiLU in float32 and rounds once, as the kernels do before their cast to weight's dtype
    (`adaln_lab.module`; tests/test_module.py checks every finite bf16 and fp16 input)."""
    return temb.float() if temb.dtype == weight.dtype and temb.dtype in (torch.bfloat16, torch.float16) else temb


def unsupported(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Exception | None:
    """Why the CUDA kernels cannot take these inputs (None if they can): `block_cuda.unsupported_table` on
    `kernel_temb(temb, weight)`."""
    from . import block_cuda

    if weight.device != temb.device or bias.device != temb.device:
        return ValueError(f"temb, weight and bias must share a device, got {temb.device}, {weight.device}, "
                          f"{bias.device}")
    return block_cuda.unsupported_table(kernel_temb(temb, weight), weight, bias)


@modulation_table_fwd.register_kernel("cuda")
def _(temb, weight, bias, table_backend):
    if table_backend == "torch" or unsupported(temb, weight, bias) is not None:
        return _table_torch(temb, weight, bias)
    from . import block_cuda

    with torch.cuda.device(temb.device):
        return block_cuda.modulation_table_fwd(kernel_temb(temb, weight), weight, bias)


def _table_bwd_torch(d_table, temb, weight, bias):
    d_table64, temb64 = d_table.double(), temb.double()
    d_weight = d_table64.T @ F.silu(temb64)
    sig = torch.sigmoid(temb64)
    d_temb = (d_table64 @ weight.double()) * sig * (1.0 + temb64 * (1.0 - sig))
    d_bias = d_table64.sum(0)
    return d_temb.to(temb.dtype), d_weight.to(weight.dtype), d_bias.to(bias.dtype)


@torch.library.custom_op("adaln_lab::modulation_table_bwd", mutates_args=())
def modulation_table_bwd(d_table: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_temb (T, D), d_weight (N, D), d_bias (N,)): the exact derivative in float64, one rounding each."""
    return _table_bwd_torch(d_table, temb, weight, bias)


@modulation_table_bwd.register_fake
def _(d_table, temb, weight, bias):
    return temb.new_empty(temb.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


@modulation_table_bwd.register_kernel("cuda")
def _(d_table, temb, weight, bias):
    if unsupported(temb, weight, bias) is not None:
        return _table_bwd_torch(d_table, temb, weight, bias)
    from . import block_cuda

    with torch.cuda.device(temb.device):
        d_temb, d_weight, d_bias = block_cuda.modulation_table_bwd(d_table, kernel_temb(temb, weight), weight)
    return d_temb.to(temb.dtype), d_weight, d_bias.to(bias.dtype)


def _setup_context(ctx, inputs, output):
    temb, weight, bias, _ = inputs
    ctx.save_for_backward(temb, weight, bias)


def _backward(ctx, d_table):
    temb, weight, bias = ctx.saved_tensors
    d_temb, d_weight, d_bias = modulation_table_bwd(d_table.contiguous(), temb, weight, bias)
    return d_temb, d_weight, d_bias, None


modulation_table_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_table_inputs(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Raise ValueError / TypeError naming the argument unless temb (T, D), weight (N, D), bias (N,) fit."""
    if temb.dim() != 2 or weight.dim() != 2 or bias.dim() != 1:
        raise ValueError(f"modulation_table needs temb (T, D), weight (N, D) and bias (N,), got shapes "
                         f"{tuple(temb.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    if temb.shape[1] != weight.shape[1] or bias.shape[0] != weight.shape[0]:
        raise ValueError(f"modulation_table: temb {tuple(temb.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} disagree (temb's D must be weight's columns, bias weight's rows)")
    for name, t in (("temb", temb), ("weight", weight), ("bias", bias)):
        if not t.dtype.is_floating_point:
            raise TypeError(f"modulation_table needs a floating-point {name}, got {t.dtype}")


def modulation_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
                     table_backend: str = "cuda") -> torch.Tensor:
    """The AdaLN table of one H3 block, differentiable (module docstring).

    Args:
        temb: (T, D) timestep embeddings, any float dtype (float32 in the MiniMax-H3 checkpoint).
        weight: (N, D) projection weight (N = 18H for a block's `adaln_proj.linear`).
        bias: (N,) projection bias.
        table_backend: "cuda" (kernels_cu's fixed-order GEMV on CUDA where it runs) or "torch" (F.linear).

    Returns:
        (T, N) tensor of dtype promote_types(weight.dtype, float32) holding diffusers' table
        `linear(silu(temb).to(weight.dtype), weight, bias)` exactly on the CPU (and with
        table_backend="torch" on CUDA); table.cu's entries equal cuBLAS's on >= 99.9 % of entries and are
        within the fp32 dot-product bound plus one bf16 rounding of the exact table (GPU tests).
    """
    if table_backend not in TABLE_BACKENDS:
        raise ValueError(f"table_backend must be one of {TABLE_BACKENDS}, got {table_backend!r}")
    check_table_inputs(temb, weight, bias)
    return modulation_table_fwd(temb, weight, bias, table_backend)
