"""kernels_cu/exact_state.cu on one device: an ExactSum's carries, products and roundings, one launch each.

    kernels = ExactKernels(unit, device_index)     # unit: a compiled unit of that device (launchers.kernels)
    state = ExactSum.from_limbs(limbs, kernels=kernels)   # then its carries, `products` and `value` launch these

The kernels compute the integers and roundings of core/exact.py's torch code (a carried state has one form per
integer), so a state gives the same limbs and values with or without them; the torch code takes a dozen small ops a
limb where these take one launch a state. Each method takes CUDA tensors on `index`'s device and runs on torch's
current stream there.
"""

from __future__ import annotations

import torch

from . import launchers, tensors
from .exact import LIMBS

_THREADS = 256


class ExactKernels:
    """exact_state.cu's three kernels on the compiled `unit` of device `index` (module docstring)."""

    def __init__(self, unit: dict, index: int):
        self.unit, self.index = unit, index

    def takes(self, limbs: torch.Tensor) -> bool:
        """Whether limbs are on this device (else the caller runs the torch code; `tensors.gpu`: a CPU stand-in of
        the GPU takes CPU tensors)."""
        return tensors.gpu(limbs) and limbs.device.index == self.index and limbs.shape[0] <= 2 * LIMBS

    def _launch(self, name: str, n: int, *args) -> None:
        launchers.bind(self.index)
        self.unit[name]((-(-n // _THREADS), 1, 1), (_THREADS, 1, 1), 0, tensors.current_stream(self.index), *args)

    def carry(self, limbs: torch.Tensor) -> None:
        """limbs (L, ...) int64 carried in place (ExactSum._carry's integers)."""
        flat = limbs if limbs.is_contiguous() else limbs.contiguous()
        n = flat[0].numel()
        if n:
            self._launch("exact_carry", n, flat.data_ptr(), flat.shape[0], n)
        if flat is not limbs:
            limbs.copy_(flat)

    def products(self, limbs: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """(2L, ...) int64 carried: the integers of carried limbs (L, ...) times finite float32 factors (the state's
        shape, contiguous) exactly (core.exact.products')."""
        limbs = limbs.contiguous()
        out = torch.empty((2 * limbs.shape[0], *limbs.shape[1:]), dtype=torch.int64, device=limbs.device)
        n = limbs[0].numel()
        if n:
            self._launch("exact_products", n, limbs.data_ptr(), factors.data_ptr(), out.data_ptr(), limbs.shape[0], n)
        return out

    def rounded(self, limbs: torch.Tensor, precision: int, e_min: int) -> torch.Tensor:
        """(n,) float64: each column's integer of carried limbs (L, n), worth 2^e_min a unit, rounded once to
        `precision` bits (core.exact.rounded's values)."""
        limbs = limbs.contiguous()
        n = limbs.shape[1]
        out = torch.empty(n, dtype=torch.float64, device=limbs.device)
        if n:
            self._launch("exact_round", n, limbs.data_ptr(), out.data_ptr(), limbs.shape[0], n, e_min, precision)
        return out
