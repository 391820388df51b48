"""`block_adaln_path`: one H3 block's AdaLN ops composed around its attention and feed-forward.

    table = modulation_table(temb, weight, bias)          (T, 18H) -> six (3T, H) chunks
    h, x = modulated_rms_norm_and_residual(x, norm1_weight, shift_msa, scale_msa, row_index, eps1)
    x, h = gated_residual_norm(x, gate_msa, attn(h), norm2_weight, shift_mlp, scale_mlp, row_index, eps2)
    x = gated_residual(x, gate_mlp, ff(h), row_index)

diffusers' first residual and norm2 run as one op (`gated_residual_norm`); norm1 hands x on so that x's two
gradients are summed inside its backward. The inputs are checked once for the whole block and the kernel
rule (`support.table`, `support.rows`) asked once; the CUDA backward's row order is sorted once (`row_order`)
for the three row ops. Eager calls go to the ops' autograd nodes straight onto the kernels, the table's chunks
handed over detached and their gradients written by the ops into one table gradient (`ops.table_gradient`: no
split node, no cat), the norms reading the table kernel's bf16 row tables; under torch.compile to their custom
ops, through autograd's chunk views. Numerics: the ops' (CPU: diffusers bit for bit; CUDA kernels: parameter
gradients in a fixed order); backend "torch" runs diffusers' own ops and autograd
(`reference.block.replay_block_adaln`).
"""

from __future__ import annotations

import torch

from ..core import tensors
from ..core.plan import ROWS_MAX
from ..core.plan import plan as make_plan
from ..reference.block import MODALITIES, replay_block_adaln, table_chunks
from . import gated_residual as gr
from . import gated_residual_norm as grn
from . import modulated_rms_norm as mrn
from . import modulation_table as mt
from ..core import support
from ..core.autocast import autocast_params
from ..core.checks import BLOCK_BACKENDS, TABLE_BACKENDS, check_option, check_rows, check_table_inputs
from .eager import apply
from .row_order import row_order
from .table_gradient import TableGradient


def _bf16_beside(y: torch.Tensor, x: torch.Tensor) -> bool:
    return y.dtype == torch.bfloat16 and y.device == x.device


def _check_branch(name: str, y: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"block_adaln_path needs {name}(h) of x's shape {tuple(x.shape)}, got {got}")


def block_adaln_path(x: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     norm1_weight: torch.Tensor, norm2_weight: torch.Tensor, row_index: torch.Tensor, attn, ff,
                     eps1: float = 1e-5, eps2: float = 1e-5, *, backend: str = "auto",
                     table_backend: str = "cuda", adapt_table=None) -> torch.Tensor:
    """One H3 block with `attn` and `ff` as given (module docstring; `adaln_lab.reference.block`).

    Args:
        x: (..., S, H) hidden states; temb (T, D); weight (18H, D), bias (18H,): `adaln_proj.linear`;
        norm1_weight, norm2_weight: (H,); row_index: (S,) int64 in [0, 3T) (diffusers' `adaln_indices`),
        row s of every leading index of x uses table row row_index[s].
        attn, ff: maps of (..., S, H) tensors (row-wise ones keep the path batch-invariant).
        backend: "auto" (the CUDA kernels where they run, torch code elsewhere), "cupy" (refuse inputs the
            kernels cannot take, with the reason) or "torch" (diffusers' ops); table_backend: "cuda" or "torch".
        Under torch.autocast("cuda", torch.bfloat16) with bf16 CUDA x, fp32 weight, bias and norm weights are
        cast to bf16 for the kernels as autocast casts a linear's (`adaln_lab.core.autocast`).
        adapt_table: None, or a map of the (T, 18H) float32 table to the table the rows read (same shape and
            dtype): where the nn layer adds LoRA adapters' terms (`adaln_lab.nn.adapters`). Not with "torch".

    Returns:
        (..., S, H), diffusers' block output for these attn and ff.
    """
    check_option("backend", backend, BLOCK_BACKENDS)
    check_option("table_backend", table_backend, TABLE_BACKENDS)
    H = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != 6 * MODALITIES * H:
        raise ValueError(f"block_adaln_path needs weight of shape (18H, D) = ({18 * H}, D), got {tuple(weight.shape)}")
    if backend == "torch":
        if adapt_table is not None:
            raise ValueError("block_adaln_path: adapt_table needs backend 'auto' or 'cupy' (backend 'torch' runs "
                             "diffusers' ops on weight and bias as given)")
        return replay_block_adaln(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff, eps1, eps2)
    check_table_inputs(temb, weight, bias)
    check_rows("block_adaln_path", x, row_index, norm_weight=norm1_weight)
    check_rows("block_adaln_path", x, row_index, norm_weight=norm2_weight)
    table_rows = MODALITIES * temb.shape[0]
    compiling = torch.compiler.is_compiling()  # the custom ops then decide inside, per op
    cast = autocast_params(x, weight, bias, norm1_weight, norm2_weight)  # fp32 parameters under autocast
    if compiling and backend != "cupy":
        weight, bias, norm1_weight, norm2_weight = cast
        table_kernels, rows_ok = False, False
    else:  # the kernel rule asked once for the table and once for the rows
        table_error = support.table(support.kernel_temb(temb, cast[0]), cast[0], cast[1])
        rows_error = support.on_device(x, row_index=row_index, temb=temb) or support.rows(
            x, table_rows, norm1_weight=cast[2], norm2_weight=cast[3])
        if (table_error or rows_error) is not None:
            if backend == "cupy":
                raise table_error or rows_error
            support.warn_fallback("block_adaln_path", x, table_error or rows_error)
            if cast[0] is not weight:  # the casts bought no kernel run: the parameters as given, to the torch code
                table_error = support.table(support.kernel_temb(temb, weight), weight, bias)
        else:
            weight, bias, norm1_weight, norm2_weight = cast
        table_kernels = not compiling and table_error is None
        rows_ok = weight.dtype == torch.bfloat16 and rows_error is None
    table_dtype = weight.dtype
    # on the kernels the table kernel also writes the norms' bf16 row tables, read in place of casting the chunks
    row_tables = table_kernels and rows_ok and table_backend == "cuda" and adapt_table is None
    table = mt.table_op(temb, weight, bias, table_backend, table_kernels, row_tables)
    norm1_rows = norm2_rows = None
    if row_tables:
        table, bf16_rows = table
        norm1_rows, norm2_rows = (bf16_rows, 0), (bf16_rows, 1)
    if adapt_table is not None:
        table = adapt_table(table)
    # eager: the row ops write their chunks' gradients into one table gradient (`ops.table_gradient`)
    # (with the row kernels' workspaces in the same buffer where the rows run on the kernels)
    table_grad = None
    if not compiling and table.requires_grad and torch.is_grad_enabled():
        table_grad = TableGradient(table, H, tensors.row_workspaces(x, table_rows) if rows_ok else None)
    table_args = (None if table_grad is None else table, table_grad)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(
        table if table_grad is None else table.detach(), H)
    # the CUDA backward passes walk the rows in table-row order: sorted once here for the block's three ops
    # (whenever grad mode is on: attn's or ff's parameters alone may want a backward through them)
    order = None
    if torch.is_grad_enabled() and (rows_ok or (compiling and x.is_cuda and x.dtype == torch.bfloat16
                                                and table_dtype == torch.bfloat16)):
        if compiling or row_index.shape[0] > ROWS_MAX:
            order = row_order(row_index, table_rows, H)
        else:
            order = tensors.row_order(row_index.contiguous(), make_plan(H, 8, table_rows))
    eps1, eps2 = float(eps1), float(eps2)
    norm1_kernels = rows_ok or (not compiling and mrn.kernels_take(x, norm1_weight, shift_msa, scale_msa, row_index,
                                                                   table_dtype))
    h, x = apply(mrn.ModulatedRMSNormAndResidual, x, norm1_weight, shift_msa, scale_msa, row_index, eps1, table_dtype,
                 order, norm1_kernels, *table_args, norm1_rows)
    y = attn(h)
    _check_branch("attn", y, x)
    kernels = (rows_ok and _bf16_beside(y, x)) or (not rows_ok and not compiling and grn.kernels_take(
        x, gate_msa, y, row_index, norm2_weight, shift_mlp, scale_mlp, table_dtype))
    x, h = grn.gated_residual_norm_op(x, gate_msa, y, row_index, norm2_weight, shift_mlp, scale_mlp, eps2,
                                      table_dtype, order, kernels, *table_args, norm2_rows)
    del y  # attn's output is not held while ff runs (diffusers' forward frees it there too)
    y = ff(h)
    _check_branch("ff", y, x)
    kernels = (rows_ok and _bf16_beside(y, x) and x.dtype == torch.bfloat16) or (
        not rows_ok and not compiling and gr.kernels_take(x, gate_mlp, y, row_index, table_dtype))
    return gr.gated_residual_op(x, gate_mlp, y, row_index, table_dtype, order, kernels, *table_args)
