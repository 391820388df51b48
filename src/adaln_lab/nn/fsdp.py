"""`fsdp2_shard`: FSDP2 (`fully_shard`) over a patched MiniMax-H3 model with fp32 master weights.

One FSDP group holds parameters of one dtype, and the checkpoint's `_keep_in_fp32_modules` compute in fp32, so:
each of those children gets its own group with an fp32 policy; each transformer block its own group with
`MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`; then the root with the bf16
policy and `cast_forward_inputs=False`, so that the root's inputs reach the fp32 input projections as given.
Patch first (`adaln_lab.patch` refuses to swap modules that carry hooks, FSDP's among them). What holds then
(tests/nn/test_fsdp.py): the forward equals the unsharded model in the checkpoint's layout bit for bit, and every
AdaLN gradient equals the reduce-scatter's fp32 mean of the ranks' micro-batch gradients bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def fsdp2_shard(model: nn.Module, mesh=None, *, divide_factor: float | None = None) -> nn.Module:
    """`model` (a MiniMaxH3Transformer3DModel, patched or not, fp32 parameters) sharded in place over `mesh` (a 1-D
    DeviceMesh; None: FSDP2's default, the world), the recipe of the module docstring. Returns `model`.
    divide_factor: every group's gradient divide factor (FSDP2's default, None, is the mean over the ranks); 1.0
    sums the ranks' gradients, as `adaln_lab.nn.ExactGradients` sums the AdaLN ones (with a loss normalised by the
    global count, every gradient is then the whole batch's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for name, child in model.named_children():
        if name in getattr(model, "_keep_in_fp32_modules", ()) and any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=fp32)
    for block in model.transformer_blocks:
        fully_shard(block, mesh=mesh, mp_policy=bf16)
    fully_shard(model, mesh=mesh, mp_policy=bf16)
    if divide_factor is not None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(divide_factor)
                module.set_force_sum_reduction_for_comms(True)  # a sum then the division: gloo has no PREMUL_SUM
    return model
