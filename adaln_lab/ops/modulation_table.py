"""`modulation_table`: an H3 block's AdaLN table `linear(silu(temb).to(weight.dtype), weight, bias)` as a custom op.

    table = modulation_table(temb (T, D), weight (N, D), bias (N,)) -> (T, N) float32

N = 18H for a block's `adaln_proj.linear` (six chunks for each of the three modalities). The values are
diffusers' table in the projection's dtype, upcast exactly: a float32 tensor holding bf16 values for bf16
parameters (float64 for float64 parameters). The consumers (`modulated_rms_norm`, `gated_residual`) cast
their slices back to the projection's dtype (exact) and replay diffusers' ops, so the forward is
diffusers', while their gradients reach the table in float32 and autograd adds them in float32 (the six
chunks are disjoint column ranges, so the adds are exact); diffusers instead sums them in bf16.

Layers (as `adaln_lab.ops.final_adaln_out`):
- `torch.ops.adaln_lab.modulation_table_fwd(temb, weight, bias, table_backend) -> table` and
  `torch.ops.adaln_lab.modulation_table_bwd(d_table, temb, weight, bias) -> (d_temb, d_weight, d_bias)`:
  torch.library custom ops with fake kernels and `register_autograd`, so torch.compile(fullgraph=True),
  CUDA graphs and `torch.library.opcheck` take them.
- Their default (CPU, any device) kernels are torch code: the forward replays diffusers; the backward is
  the exact derivative (`reference.backward`), in float64 and rounded once per output: d_weight = d_table^T @ silu(temb),
  d_bias = column sums of d_table (t in order), d_temb = (d_table @ weight) * silu'(temb). As the CUDA
  kernels, the SiLU output is used unrounded (straight-through the declared cast to weight's dtype).
- Their CUDA kernels (`adaln_lab.core.tensors`: table.cu, a fixed-order GEMV whose rows do not depend on T,
  and table_bwd.cu) run for bf16 weight and bias, fp32 temb (or bf16 temb, widened exactly: `kernel_temb`)
  and supported shapes (`support.table`); anything else runs the torch code, since diffusers models run in
  any dtype.
- `ModulationTable`: the lean eager path, one autograd.Function straight onto the same implementations.
  `table_backend="torch"` keeps F.linear (cuBLAS: diffusers' own bits on the same GPU) for the forward.

Gradients: d_temb (T, D) in temb's dtype, d_weight (N, D) and d_bias (N,) in the parameters' dtypes. (In a block's
eager path the row ops write their chunks' gradients into one float32 table gradient instead:
`adaln_lab.ops.table_gradient`.)
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..core import tensors
from ..reference.backward import modulation_table_backward
from ..reference.block import replay_table, table_dtype_of
from ..core import support
from ..core.checks import TABLE_BACKENDS, check_option, check_table_inputs
from .eager import apply


def kernels_take(temb, weight, bias) -> bool:
    """Whether the table kernels run for these inputs (`support.table` on `support.kernel_temb`)."""
    return temb.is_cuda and support.table(support.kernel_temb(temb, weight), weight, bias) is None


def forward(temb, weight, bias, table_backend: str, kernels: bool, row_tables: bool = False):
    """table (T, N) (module docstring): table.cu where `kernels`, else diffusers' table upcast. row_tables (an H3
    block's table on the kernels): (table, its two bf16 row tables (2, 3T, 2H), `core.tensors.modulation_table_fwd`),
    which the block's norms read in place of casting their chunks."""
    if kernels and table_backend != "torch":
        return tensors.modulation_table_fwd(support.kernel_temb(temb, weight), weight, bias, row_tables)
    return replay_table(temb, weight, bias).to(table_dtype_of(weight)).contiguous()


def backward(d_table, temb, weight, bias, kernels: bool):
    """(d_temb, d_weight, d_bias): table_bwd.cu where `kernels`, else the float64 derivative."""
    if kernels:
        support.check_saved("modulation_table", temb, weight=weight)
        d_temb, d_weight, d_bias = tensors.modulation_table_bwd(d_table, support.kernel_temb(temb, weight), weight)
        return tensors.as_dtype(d_temb, temb.dtype), d_weight, tensors.as_dtype(d_bias, bias.dtype)
    return modulation_table_backward(d_table, temb, weight, bias.dtype)


@torch.library.custom_op("adaln_lab::modulation_table_fwd", mutates_args=())
def modulation_table_fwd(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         table_backend: str) -> torch.Tensor:
    """table (T, N): diffusers' table upcast to float32 (module docstring)."""
    return forward(temb, weight, bias, table_backend, False)


@modulation_table_fwd.register_fake
def _(temb, weight, bias, table_backend):
    return temb.new_empty((temb.shape[0], weight.shape[0]), dtype=table_dtype_of(weight))


@modulation_table_fwd.register_kernel("cuda")
def _(temb, weight, bias, table_backend):
    return forward(temb, weight, bias, table_backend, kernels_take(temb, weight, bias))


@torch.library.custom_op("adaln_lab::modulation_table_bwd", mutates_args=())
def modulation_table_bwd(d_table: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_temb (T, D), d_weight (N, D), d_bias (N,)): the exact derivative in float64, one rounding each."""
    return backward(d_table, temb, weight, bias, False)


@modulation_table_bwd.register_fake
def _(d_table, temb, weight, bias):
    return temb.new_empty(temb.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


@modulation_table_bwd.register_kernel("cuda")
def _(d_table, temb, weight, bias):
    return backward(d_table, temb, weight, bias, kernels_take(temb, weight, bias))


def _setup_context(ctx, inputs, output):
    temb, weight, bias, _ = inputs
    ctx.save_for_backward(temb, weight, bias)


def _backward(ctx, d_table):
    temb, weight, bias = ctx.saved_tensors
    d_temb, d_weight, d_bias = modulation_table_bwd(d_table.contiguous(), temb, weight, bias)
    return d_temb, d_weight, d_bias, None


modulation_table_fwd.register_autograd(_backward, setup_context=_setup_context)


class ModulationTable(torch.autograd.Function):
    """The lean eager path: forward(temb, weight, bias, table_backend, kernels, row_tables=False) -> table (T, N)
    (with row_tables: (table, the block's bf16 row tables), the latter not differentiable); backward(d_table) ->
    d_temb, d_weight, d_bias, the same implementations as the custom ops, without the dispatcher."""

    @staticmethod
    def forward(ctx, temb, weight, bias, table_backend, kernels, row_tables=False):
        ctx.kernels = kernels
        ctx.save_for_backward(temb, weight, bias)
        result = forward(temb, weight, bias, table_backend, kernels, row_tables)
        if row_tables:
            ctx.mark_non_differentiable(result[1])
            ctx.set_materialize_grads(False)  # no zeros made for the row tables' gradient on every backward
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, d_table, d_row_tables=None):
        if d_table is None:  # (row tables only) the table got no gradient: nothing reaches the parameters
            return None, None, None, None, None, None
        temb, weight, bias = ctx.saved_tensors
        return (*backward(d_table.contiguous(), temb, weight, bias, ctx.kernels), None, None, None)


def table_op(temb, weight, bias, table_backend: str, kernels: bool, row_tables: bool = False):
    """The table, checked inputs: the custom op under torch.compile, else the eager node (kernels decided); with
    row_tables (eager, kernels, an H3 block's table): (table, its row tables)."""
    if torch.compiler.is_compiling():
        return modulation_table_fwd(temb, weight, bias, table_backend)
    return apply(ModulationTable, temb, weight, bias, table_backend, kernels, row_tables)


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
    check_option("table_backend", table_backend, TABLE_BACKENDS)
    check_table_inputs(temb, weight, bias)
    compiling = torch.compiler.is_compiling()  # the custom op then decides inside
    return table_op(temb, weight, bias, table_backend, not compiling and kernels_take(temb, weight, bias))
