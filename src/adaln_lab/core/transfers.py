"""Copies between the host and a GPU that wait for the device once, or not at all (`NO_WAIT` 1).

    hosts = host_copies([a, b, c])      # CPU copies of device tensors: one transfer (one wait) a device
    t = to_device(cpu_tensor, device)   # a host tensor on `device` without waiting for the device's queue

Why: a copy to the host waits for every kernel queued before it, and a copy from pageable host memory to a GPU
synchronizes the stream before it starts (the CUDA runtime's rule), so each one leaves the GPU idle while the host
catches up. `ExactGradients.write` reads many small tensors (temb rows, scale rows, factors, the kernels' flags) and
sends a few host tensors (SiLU of the rows, factors): through these, one wait in all. Data movement only: every bit
is the same as a plain `.cpu()` / `.to(device)`, which is what they do while `NO_WAIT` is 0 (shipped
until its GPU tests have run), and then `ExactGradients.write` forms d_temb on the host as before (`no_wait`).
"""

from __future__ import annotations

import torch

_ALIGN = 8  # bytes: each tensor's offset in the transfer (the widest element, float64 / int64)


NO_WAIT = 0  # 1: these copies packed and pinned, d_temb kept on the device (shipped 0 until its GPU tests have run)


def no_wait() -> bool:
    """Whether NO_WAIT is on (read at each call: a test or a user may set it)."""
    return bool(NO_WAIT)


def host_copies(tensors) -> list[torch.Tensor]:
    """CPU copies (detached) of `tensors`, in order: CPU ones as they are, those on each other device packed into one
    byte buffer there and copied to the host once, then cut apart (each its own storage). Real, non-complex dtypes
    (at most 8 bytes an element)."""
    if not no_wait():
        return [t.detach().cpu() for t in tensors]
    out: list = [None] * len(tensors)
    by_device: dict = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.device.type == "cpu":
            out[i] = t
        else:
            by_device.setdefault(t.device, []).append((i, t))
    for device, items in by_device.items():
        sizes = [t.numel() * t.element_size() for _, t in items]
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        for (_, t), start, n in zip(items, starts, sizes):
            if n:
                flat[start:start + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        host = flat.cpu()
        for (i, t), start, n in zip(items, starts, sizes):
            out[i] = host[start:start + n].clone().view(t.dtype).reshape(t.shape)  # its own storage (pickling)
    return out


def to_device(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t (cast to `dtype` where it is, if given) on `device`: a CPU tensor goes to a GPU from pinned memory without
    waiting for the device's queue (torch keeps the pinned block until the copy is done); anything else as `.to`."""
    device = torch.device(device)
    if dtype is not None:
        t = t.to(dtype)
    if t.device.type != "cpu" or device.type != "cuda" or not no_wait():
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)
