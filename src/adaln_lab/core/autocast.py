"""fp32 parameters under autocast: the ops hand the CUDA kernels what autocast hands a linear.

Under `torch.autocast("cuda", torch.bfloat16)` with fp32 (master) parameters, diffusers' forward gets bf16
activations (every linear's output) and autocast casts each linear's fp32 weight and bias to bf16 on the way in.
The ops do the same to the AdaLN parameters they read: where autocast is on for x's device with bf16 and x is a
bf16 CUDA tensor, every fp32 parameter is cast to bf16 once per call (`Tensor.to`, differentiable: its gradient
reaches the fp32 parameter as fp32), and the bf16 kernels run on the cast values.

The rounding contract that holds then: the op's output and gradients are, bit for bit, those of the same op on
bf16 parameters equal to bf16(master weights) (tests/ops/test_autocast.py), the kernels' diffusers rounding
points included. diffusers under autocast rounds differently in one place: `rms_norm` is on autocast's float32
list, so its norms run in fp32 with the fp32 norm weight and the modulation stays fp32 until the next linear
rounds it to bf16; the norm weight's gradient is then fp32-accurate where the kernels' is rounded to bf16
before the cast back. bench/NOTES.md gives the measured distances to diffusers under autocast and to float64.
"""

from __future__ import annotations

import torch


def autocast_params(x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """params as the kernels take them under autocast: each fp32 one cast to bf16 where autocast is on for x's
    device with dtype bf16 and x is a bf16 CUDA tensor; otherwise (and for params of any other dtype) as given."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.bfloat16):
        return params
    return tuple(p.to(torch.bfloat16) if p is not None and p.dtype == torch.float32 else p for p in params)
