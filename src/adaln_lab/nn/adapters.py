"""PEFT LoRA adapters on the AdaLN projections (`adaln_proj.linear`, `norm_out.linear`), on adaln_lab's path.

A PEFT LoRA layer in place of the projection (`peft.tuners.lora.Linear`, wrapping `base_layer`, a plain
nn.Linear) computes, for its input act = silu(temb).to(weight's dtype), (T, D):

    result = base_layer(act)                                          (T, N) in the weight's dtype
    for each active adapter a (in order): act = act.to(lora_A[a]'s dtype)
        result = result + lora_B[a](lora_A[a](lora_dropout[a](act))) * scaling[a]   (torch's type promotion)
    result = result.to(the weight's dtype)

Merged adapters live inside base_layer.weight (the base alone then, as PEFT); with adapters disabled the base
alone. `adapted_table` computes the same on adaln_lab's table: the base by the ops (on the CUDA kernels: the
fixed-order table on tensor cores, T-invariant rows), then each adapter's term one table row at a time (every
lora_A / lora_B call sees a single row, so a row's bits never depend on T or on the other timesteps), added with PEFT's
rounding points: each sum is rounded to PEFT's dtype at that point (the promoted dtype; bf16 when base and
adapter are bf16, nothing when the adapter is float32 as PEFT's `autocast_adapter_dtype` makes it), then to
the weight's dtype. The roundings are straight-through for autograd, so the table's gradient reaches the base
projection in float32 as without adapters, and lora_A / lora_B / temb get theirs through torch autograd (a
fixed graph: repeatable bit for bit where its kernels are).

What this does not model runs diffusers' own forward for that call (`fallback`): DoRA and other LoRA variants,
disabled adapters that are still merged (PEFT unmerges inside its forward), any other wrapper class, and hooks
on the layer, its base or its adapters' modules.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.exact import refuse_unrecorded
from .fallback import foreign

_LORA_ATTRS = ("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling", "merged", "disable_adapters",
               "active_adapters")


def layout(linear: nn.Module) -> tuple[nn.Linear, tuple[str, ...]] | str:
    """(the base nn.Linear whose weight and bias the ops read, the adapters whose terms `adapted_table` adds), or
    why this projection must run its own forward. A plain nn.Linear is its own base with no adapters."""
    if type(linear) is nn.Linear:
        return linear, ()
    if not all(hasattr(linear, attr) for attr in _LORA_ATTRS):
        return (f"is a {type(linear).__name__}, neither a plain nn.Linear nor a PEFT LoRA layer (an adapter or "
                "wrapper: its own forward must run)")
    if linear.disable_adapters and linear.merged:
        return "has its PEFT adapters disabled while merged (PEFT unmerges them inside its forward)"
    names = () if linear.disable_adapters or linear.merged else tuple(
        a for a in linear.active_adapters if a in linear.lora_A)
    reads = {"base_layer": nn.Linear}
    for a in names:
        if getattr(linear, "use_dora", {}).get(a, False) or a in getattr(linear, "lora_variant", {}):
            return f"has PEFT adapter {a!r} as DoRA or another LoRA variant"
        reads.update({f"lora_A.{a}": nn.Linear, f"lora_B.{a}": nn.Linear, f"lora_dropout.{a}": None})
    reason = foreign(linear, reads)
    if reason is not None:
        return reason
    return linear.base_layer, names


def _round(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """value rounded to dtype where dtype is narrower, kept in value's dtype; the identity for autograd."""
    if torch.finfo(dtype).bits >= torch.finfo(value.dtype).bits:
        return value
    return value + (value.to(dtype).to(value.dtype) - value).detach()


def adapted_table(table: torch.Tensor, temb: torch.Tensor, linear: nn.Module, names: tuple[str, ...],
                  weight_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The table (T, N) (float32 holding the weight dtype's values, as `modulation_table` returns it) with the
    adapters' terms added as PEFT adds them (module docstring); `table` itself when `names` is empty.
    weight_dtype: the dtype the base projection computes in (default its weight's; under autocast with an fp32
    base, bf16: what autocast makes of PEFT's base_layer call, `adaln_lab.core.autocast`)."""
    if not names:
        return table
    weight_dtype = weight_dtype or linear.base_layer.weight.dtype
    act = F.silu(temb).to(weight_dtype)  # the projection's input, as diffusers computes it
    dtype = weight_dtype  # PEFT's result dtype so far
    for a in names:
        lora_A, lora_B = linear.lora_A[a], linear.lora_B[a]
        act = linear._cast_input_dtype(act, lora_A.weight.dtype) if hasattr(linear, "_cast_input_dtype") \
            else act.to(lora_A.weight.dtype)
        dropped = linear.lora_dropout[a](act)
        term = torch.cat([lora_B(lora_A(dropped[t:t + 1])) for t in range(dropped.shape[0])]) * linear.scaling[a]
        dtype = torch.promote_types(dtype, term.dtype)
        table = _round(table + term.to(table.dtype), dtype)
    return _round(table, weight_dtype)


def exact_terms(linear: nn.Module, names: tuple[str, ...]) -> list[tuple] | str:
    """[(lora_A weight (r, D), lora_B weight (N, r), scaling)] of the active adapters `names`, what
    `adaln_lab.nn.ExactGradients` forms their gradients from (the exact table gradient, over the distinct temb rows),
    or why it cannot: a LoRA layer with a bias, or an active dropout (another mask in every micro-batch)."""
    terms = []
    for a in names:
        lora_A, lora_B, dropout = linear.lora_A[a], linear.lora_B[a], linear.lora_dropout[a]
        if lora_A.bias is not None or lora_B.bias is not None:
            return f"adapter {a!r} has a bias"
        if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
            return f"adapter {a!r} has an active dropout (p={dropout.p}): each part would draw its own mask"
        terms.append((lora_A.weight, lora_B.weight, float(linear.scaling[a])))
    return terms


def note_exact(exact, module: nn.Module, prefix: str, names: tuple[str, ...], params, who: str) -> list[tuple]:
    """Inside `adaln_lab.nn.ExactGradients` (`exact`): the adapters `names` of the LoRA layer at `prefix` in
    `module` noted for write (`exact_terms`, refused by name if they cannot be recorded), where their weights live
    (`own`: FSDP2 reshards them) and on which AdaLN's table (`params`: weight, bias, *norm weights). Returns the
    terms."""
    terms = exact_terms(module.get_submodule(prefix), names)
    if isinstance(terms, str):
        refuse_unrecorded(who, f"{prefix}: {terms}")
    exact.own(module, tuple(f"{prefix}.lora_{m}.{a}.weight" for a in names for m in "AB"))
    exact.adapt(params, terms)
    return terms
