"""`modulation_table`: an H3 block's AdaLN table `linear(silu(temb).to(weight.dtype), weight, bias)`, differentiable.

    table = modulation_table(temb (T, D), weight (N, D), bias (N,)) -> (T, N) float32

N = 18H for a block's `adaln_proj.linear` (six chunks for each of the three modalities). The values are
diffusers' table in the projection's dtype, upcast exactly: a float32 tensor holding bf16 values for bf16
parameters (float64 for float64 parameters). The consumers (`modulated_rms_norm`, `gated_residual`) cast
their slices back to the projection's dtype (exact) and replay diffusers' ops, so the forward is
diffusers', while their gradients reach the table in float32 and autograd adds them in float32 (the six
chunks are disjoint column ranges, so the adds are exact); diffusers instead sums them in bf16.

One way through: `modulation_table` checks the inputs and decides the route once (`core.support.route`: the kernels
for bf16 weight and bias, fp32 (or bf16, widened exactly) temb and shapes the plan takes; otherwise the torch code,
with a warning on CUDA); the one autograd node `ModulationTable` allocates the table and calls the launch ops
(`launch`), in eager and compiled code alike. The torch code replays diffusers forward and takes the exact
derivative in float64 backward (d_weight = d_table^T @ silu(temb), d_bias = column sums of d_table, d_temb =
(d_table @ weight) * silu'(temb), the SiLU output unrounded); the kernels are table.cu (tensor cores in an order
fixed by D, whose rows do not depend on T) and table_bwd.cu. `table_backend="torch"` keeps F.linear (cuBLAS:
diffusers' own bits on the same GPU) for the forward.

Gradients: d_temb (T, D) in temb's dtype, d_weight (N, D) and d_bias (N,) in the parameters' dtypes. (In a block the
row ops write their chunks' gradients into one float32 table gradient, which reaches the table as its gradient:
`adaln_lab.core.table_gradient`.)
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...core import support
from ...core.checks import BLOCK_BACKENDS, TABLE_BACKENDS, check_option, check_table_inputs
from ...core.library import apply
from ...reference.block import table_dtype_of
from . import launch


class ModulationTable(torch.autograd.Function):
    """forward(temb, weight, bias, route, table_backend, row_tables) -> (table (T, N), where row_tables (an H3 block's
    table on the kernels) the table kernel's bf16 buffer holding its two (3T, 2H) row tables (`launch.bf16_elements`),
    else None); backward(d_table) -> d_temb, d_weight, d_bias (module docstring). The row tables are not
    differentiable."""

    @staticmethod
    def forward(ctx, temb, weight, bias, route, table_backend, row_tables):
        T, N = temb.shape[0], weight.shape[0]
        table = torch.empty(T, N, dtype=table_dtype_of(weight), device=temb.device)
        table_bf16 = None
        if route == "cupy" and table_backend != "torch":  # one allocation: the bf16 output, then the kernel's act
            table_bf16 = temb.new_empty(launch.bf16_elements(T, N, temb.shape[1]), dtype=torch.bfloat16)
        launch.forward(temb, weight, bias, route, table_backend, table, table_bf16)
        ctx.route, ctx.bias_dtype = route, bias.dtype
        ctx.set_materialize_grads(False)  # no zeros made for the row tables' gradient on every backward
        ctx.save_for_backward(temb, weight)
        if not row_tables:
            return table, None
        ctx.mark_non_differentiable(table_bf16)
        return table, table_bf16

    @staticmethod
    @once_differentiable
    def backward(ctx, d_table, d_row_tables):
        if d_table is None:  # only the row tables were used: nothing reaches the parameters
            return None, None, None, None, None, None
        temb, weight = ctx.saved_tensors
        if ctx.route == "cupy":
            support.check_saved("modulation_table", temb, weight=weight)
        grads = (torch.empty_like(temb), torch.empty_like(weight),
                 weight.new_empty(weight.shape[0], dtype=ctx.bias_dtype))
        launch.backward(d_table.contiguous(), temb, weight, ctx.route, *grads)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None)


def table_route(temb, weight, bias, backend: str, op: str = "modulation_table") -> str:
    """The route of a table of these inputs: "cupy" where the table kernels take them, else "torch" (warned on
    CUDA; backend "cupy" raises instead)."""
    return support.route(op, backend, temb, support.table(support.kernel_temb(temb, weight), weight, bias))


def modulation_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
                     table_backend: str = "cuda", backend: str = "auto") -> torch.Tensor:
    """The AdaLN table of one H3 block, differentiable (module docstring).

    Args:
        temb: (T, D) timestep embeddings, any float dtype (float32 in the MiniMax-H3 checkpoint).
        weight: (N, D) projection weight (N = 18H for a block's `adaln_proj.linear`).
        bias: (N,) projection bias.
        table_backend: "cuda" (kernels_cu's fixed-order table on tensor cores where it runs) or "torch" (F.linear).
        backend: "auto" (the kernels where they run, the torch code elsewhere), "cupy" (refuse inputs the kernels
            cannot take, naming the reason) or "torch".

    Returns:
        (T, N) tensor of dtype promote_types(weight.dtype, float32) holding diffusers' table
        `linear(silu(temb).to(weight.dtype), weight, bias)` exactly on the CPU (and with
        table_backend="torch" on CUDA); table.cu's entries equal cuBLAS's on >= 99.9 % of entries and are
        within the fp32 dot-product bound plus one bf16 rounding of the exact table (GPU tests).
    """
    check_option("table_backend", table_backend, TABLE_BACKENDS)
    check_option("backend", backend, BLOCK_BACKENDS)
    check_table_inputs(temb, weight, bias)
    route = "torch" if backend == "torch" else table_route(temb, weight, bias, backend)
    return apply(ModulationTable, temb, weight, bias, route, table_backend, False)[0]
