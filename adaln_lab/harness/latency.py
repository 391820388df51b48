"""Latency of any candidate, the copy-bandwidth ceiling and the memory floor.

Samples: CUDA events around each call on torch's current stream (wall clock on CPU); the median
of `iters` samples after `warmup` calls. Three timings per size:
- `fwd_us`: the forward alone, leaves requiring grad (the graph is dropped unused);
- `fwd_bwd_us` (seed protocol): cloning the five leaves, the forward and a backward with an
  all-ones gradient, all inside the timed region;
- `fwd_bwd_us_pure`: the forward and the backward only, on prepared leaves whose grads are reset.
"""

from __future__ import annotations

import statistics
import time

import torch

from .inputs import Inputs


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, step, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            step()
        samples = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                step()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                step()
                samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)


def latency(fn, inputs: Inputs, warmup: int, iters: int) -> dict:
    timer = _Timer(inputs.x.device)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)

    def forward():
        fn(*leaves, idx)

    def fwd_bwd_seed():
        fresh = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
        fn(*fresh, idx).backward(ones)

    def fwd_bwd_pure():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, idx).backward(ones)

    return {"fwd_us": timer(forward, warmup, iters), "fwd_bwd_us": timer(fwd_bwd_seed, warmup, iters),
            "fwd_bwd_us_pure": timer(fwd_bwd_pure, warmup, iters)}


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Device-to-device (or host memory) copy bandwidth in TB/s: (read + write) / median time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _Timer(device)(lambda: dst.copy_(src), warmup=3, iters=iters) * 1e-6
    return 2 * nbytes / seconds / 1e12


def floor_bytes(S: int, H: int, D: int, T: int, x_bytes: int = 2, w_bytes: int = 2) -> dict:
    """Bytes of each input read once and each output written once, forward and forward+backward.

    Forward: x, norm_weight, temb, weight, bias, timestep_indices in; out. Backward: dy, x,
    norm_weight, temb, weight, bias, timestep_indices (and the saved rstd) in; dx and the four
    parameter gradients out.
    """
    rows = S * H * x_bytes
    params = H * x_bytes + T * D * 4 + 2 * H * D * w_bytes + 2 * H * w_bytes
    fwd = rows + params + S * 8 + rows
    bwd = 2 * rows + params + S * 8 + S * 4 + rows + params
    return {"fwd_bytes": fwd, "fwd_bwd_bytes": fwd + bwd}


def memory_floor(S: int, H: int, D: int, T: int, copy_TBps: float) -> dict:
    nbytes = floor_bytes(S, H, D, T)
    return {**nbytes, "fwd_us": nbytes["fwd_bytes"] / copy_TBps / 1e6,
            "fwd_bwd_us": nbytes["fwd_bwd_bytes"] / copy_TBps / 1e6}
