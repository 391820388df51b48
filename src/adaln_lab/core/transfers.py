"""Copies between the host and a GPU that do not wait for the device (`NO_WAIT` 1).

    t = to_device(cpu_tensor, device)   # a host tensor on `device` without waiting for the device's queue
    early = HostCopies([a, b])          # host copies started now (where the values are formed) ...
    a_host, b_host = early.get()        # ... read later, by then done: no wait (NO_WAIT 1)

Why: a copy to the host waits for every kernel queued before it, and a copy from pageable host memory to a GPU
synchronizes the stream before it starts (the CUDA runtime's rule), so each one leaves the GPU idle while the host
catches up. `ExactGradients.write` reads many small tensors (temb rows, scale rows, factors, the kernels' flags) and
sends a few host tensors (SiLU of the rows, factors): through these, no wait before write's last step (its kernels'
flags, read once its work is queued), so that its host code runs while the device finishes the backward. Data
movement only: every bit is the same as a plain `.cpu()` / `.to(device)`, which is what they do while `NO_WAIT` is 0
(shipped until its GPU tests have run), and then `ExactGradients.write` forms d_temb on the host as before
(`no_wait`).
"""

from __future__ import annotations

import torch

NO_WAIT = 0  # 1: host copies started early (pinned), d_temb kept on the device (shipped 0 until its GPU tests ran)


def no_wait() -> bool:
    """Whether NO_WAIT is on (read at each call: a test or a user may set it)."""
    return bool(NO_WAIT)


def to_device(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t (cast to `dtype` where it is, if given) on `device`: a CPU tensor goes to a GPU from pinned memory without
    waiting for the device's queue (torch keeps the pinned block until the copy is done); anything else as `.to`."""
    device = torch.device(device)
    if dtype is not None:
        t = t.to(dtype)
    if t.device.type != "cpu" or device.type != "cuda" or not no_wait():
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


class HostCopies:
    """Host copies of `tensors`, started now and read later (`get`, in order, detached): with NO_WAIT 1 each device
    tensor is copied into pinned host memory without waiting (queued on its device's current stream, an event after
    them), so that a copy started where the values are formed (a part's temb rows, scales and norm weights in the
    forward) is long done when it is read and `get` waits for nothing; with NO_WAIT 0 the tensors are kept and `get`
    copies them then (`.cpu()`, a wait each). `get` returns the same copies each time."""

    def __init__(self, tensors):
        self.tensors = [t.detach() for t in tensors]
        self.events = []
        if no_wait():
            devices = {t.device for t in self.tensors if t.device.type == "cuda"}
            self.tensors = [_pinned_copy(t) if t.device.type == "cuda" else t for t in self.tensors]
            for device in devices:
                self.events.append(torch.cuda.Event())
                self.events[-1].record(torch.cuda.current_stream(device))

    def get(self) -> list[torch.Tensor]:
        for event in self.events:
            event.synchronize()
        self.events = []
        self.tensors = [t.cpu() for t in self.tensors]  # a host tensor's .cpu() is itself: the same copies each time
        return self.tensors


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory that t's values land in once its stream reaches this point (no wait now)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
