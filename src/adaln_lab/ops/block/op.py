"""`block_adaln_path`: one H3 block's AdaLN ops composed around its attention and feed-forward.

    table = modulation_table(temb, weight, bias)          (T, 18H) -> six (3T, H) chunks
    h, x = modulated_rms_norm_and_residual(x, norm1_weight, shift_msa, scale_msa, row_index, eps1)
    x, h = gated_residual_norm(x, gate_msa, attn(h), norm2_weight, shift_mlp, scale_mlp, row_index, eps2)
    x = gated_residual(x, gate_mlp, ff(h), row_index)

diffusers' first residual and norm2 run as one op (`gated_residual_norm`); norm1 hands x on so that x's two
gradients are summed inside its backward. The inputs are checked once for the whole block and the kernel rule
(`core.support.table`, `core.support.rows`) asked once for the table and once for the rows (a refusal warns once,
or raises with backend "cupy"); the branches' outputs are checked as they come (an attention output the kernels
cannot take sends the ops after it to the torch code). The CUDA backward's row order is sorted once (`row_order`)
for the three row ops. The ops' autograd nodes take the table's chunks detached and the table itself, handed from op
to op, so that their backwards write one table gradient (`core.table_gradient`: no split node, no cat), and the norms
read the table kernel's bf16 row tables: the same path in eager and compiled code. Numerics: the ops' (CPU:
diffusers bit for bit; CUDA kernels: parameter gradients in a fixed order); backend "torch" runs diffusers' own ops
and autograd (`reference.block.replay_block_adaln`).
"""

from __future__ import annotations

import torch

from ...core import exact, support, tensors
from ...core.autocast import autocast_params
from ...core.checks import (BLOCK_BACKENDS, TABLE_BACKENDS, check_devices, check_option, check_rows,
                            check_table_inputs)
from ...core.library import apply
from ...core.table_gradient import GATE_MLP, GATE_MSA, SHIFT_MSA
from ...reference.block import MODALITIES, replay_block_adaln, table_chunks
from ..gated_residual.op import GatedResidual, residual_route
from ..gated_residual_norm.op import GatedResidualNorm, pair_route
from ..modulated_rms_norm.op import ModulatedRMSNorm, norm_route
from ..modulation_table.op import ModulationTable
from ..row_order import row_order
from .exact import BlockSums, exact_table

OP = "block_adaln_path"


def _bf16_beside(y: torch.Tensor, x: torch.Tensor) -> bool:
    return y.dtype == torch.bfloat16 and y.device == x.device


def _check_branch(name: str, y: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"block_adaln_path needs {name}(h) of x's shape {tuple(x.shape)}, got {got}")


def _routes(x, temb, weight, bias, norm1_weight, norm2_weight, backend: str):
    """(table route, whether the rows run on the kernels, weight, bias, norm1_weight, norm2_weight as the ops take
    them): the kernel rule asked once for the table and once for the rows; under autocast fp32 parameters are cast to
    bf16 for the kernels (`core.autocast`), and kept as given where the kernels cannot run."""
    cast = autocast_params(x, weight, bias, norm1_weight, norm2_weight)
    table_error = support.table(support.kernel_temb(temb, cast[0]), cast[0], cast[1])
    rows_error = support.rows(x, MODALITIES * temb.shape[0], norm1_weight=cast[2], norm2_weight=cast[3])
    if table_error is None and rows_error is None:
        return ("cupy", True, *cast)
    support.route(OP, backend, x, table_error or rows_error)  # raises for backend "cupy", else warns
    if cast[0] is not weight:  # the casts bought no kernel run: the parameters as given, to the torch code
        table_error = support.table(support.kernel_temb(temb, weight), weight, bias)
    rows_ok = weight.dtype == torch.bfloat16 and rows_error is None
    return ("cupy" if table_error is None else "torch", rows_ok, weight, bias, norm1_weight, norm2_weight)


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
            dtype): where the nn layer adds LoRA adapters' terms (`adaln_lab.nn.adapters`). Not with "torch",
            except inside `adaln_lab.nn.ExactGradients` (the caller notes the adapters: `ExactGradients.adapt`).

    Returns:
        (..., S, H), diffusers' block output for these attn and ff.
    """
    check_option("backend", backend, BLOCK_BACKENDS)
    check_option("table_backend", table_backend, TABLE_BACKENDS)
    H = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != 6 * MODALITIES * H:
        raise ValueError(f"block_adaln_path needs weight of shape (18H, D) = ({18 * H}, D), got {tuple(weight.shape)}")
    recorder = exact.recorder() if torch.is_grad_enabled() else None
    if recorder is not None:  # inside adaln_lab.nn.ExactGradients: the ops record the exact sums (`exact`)
        params = (weight, bias, norm1_weight, norm2_weight)
        for name, p in zip(("weight", "bias", "norm1_weight", "norm2_weight"), params):
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"block_adaln_path: exact gradients take float32 or bfloat16 parameters, got {name} "
                                 f"{p.dtype}")
        kept_temb = temb
        temb, weight, bias, norm1_weight, norm2_weight = (t.detach() for t in (temb, *params))
    elif backend == "torch":
        if adapt_table is not None:
            raise ValueError("block_adaln_path: adapt_table needs backend 'auto' or 'cupy' (backend 'torch' runs "
                             "diffusers' ops on weight and bias as given)")
        return replay_block_adaln(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff, eps1, eps2)
    check_table_inputs(temb, weight, bias)
    check_rows(OP, x, row_index, norms={"norm1_weight": norm1_weight, "norm2_weight": norm2_weight})
    check_devices(OP, "x", x.device, (("temb", temb),))
    table_rows = MODALITIES * temb.shape[0]
    if backend == "torch":  # only inside ExactGradients: the ops' torch code
        table_route, rows_ok = "torch", False
    else:
        table_route, rows_ok, weight, bias, norm1_weight, norm2_weight = _routes(
            x, temb, weight, bias, norm1_weight, norm2_weight, backend)
    table_dtype = weight.dtype
    sums = None
    if recorder is not None:  # the table without a graph, each row's bits whatever T; the ops add to `sums`
        table, row_tables = exact_table(temb, weight, bias, table_route == "cupy" and table_backend == "cuda",
                                        rows_ok and adapt_table is None, adapt_table)
        kernels = tensors.row_setup(x, table_rows)[2] if rows_ok else None  # the row ops' unit (a cache hit)
        sums = BlockSums(temb.shape[0], H, (norm1_weight, norm2_weight), table, kernels)
        recorder.add_block(params, kept_temb, sums)
    else:
        # on the kernels the table kernel also writes the norms' bf16 row tables, read in place of casting the chunks
        with_row_tables = table_route == "cupy" and rows_ok and table_backend == "cuda" and adapt_table is None
        table, row_tables = apply(ModulationTable, temb, weight, bias, table_route, table_backend, with_row_tables)
        if adapt_table is not None:
            table = adapt_table(table)
    # the row ops take the chunks detached and the table itself, handed on from op to op (`core.table_gradient`)
    link = table if table.requires_grad and torch.is_grad_enabled() else None
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(
        table if link is None else table.detach(), H)
    # the CUDA backward passes walk the rows in table-row order: sorted once here for the block's three ops
    # (whenever grad mode is on: attn's or ff's parameters alone may want a backward through them)
    order = row_order(row_index, table_rows, H) if rows_ok and torch.is_grad_enabled() else None
    eps1, eps2 = float(eps1), float(eps2)
    rule = "torch" if backend == "torch" else "auto"  # the ops' own rule where the rows are not on the kernels
    route = "cupy" if rows_ok else norm_route(x, norm1_weight, shift_msa, scale_msa, row_index, table_dtype, rule, OP)
    h, x, link = apply(ModulatedRMSNorm, x, norm1_weight, shift_msa, scale_msa, row_index, eps1, table_dtype, route,
                       order, True, link, SHIFT_MSA, row_tables if route == "cupy" else None, sums)
    y = attn(h)
    _check_branch("attn", y, x)
    route = "cupy" if rows_ok and _bf16_beside(y, x) else pair_route(x, gate_msa, y, row_index, norm2_weight,
                                                                      shift_mlp, scale_mlp, table_dtype, rule, OP)
    x, h, link = apply(GatedResidualNorm, x, gate_msa, y, row_index, norm2_weight, shift_mlp, scale_mlp, eps2,
                       table_dtype, route, order, link, GATE_MSA, row_tables if route == "cupy" else None, sums)
    del y  # attn's output is not held while ff runs (diffusers' forward frees it there too)
    y = ff(h)
    _check_branch("ff", y, x)
    route = ("cupy" if rows_ok and _bf16_beside(y, x) and x.dtype == torch.bfloat16
             else residual_route(x, gate_mlp, y, row_index, table_dtype, rule, OP))
    return apply(GatedResidual, x, gate_mlp, y, row_index, table_dtype, route, order, link, GATE_MLP, sums)
