"""GPU memory of `final_adaln_out` (backend "cupy"): the peak of one eager forward+backward against the
bytes it cannot do without, and the memory allocated after 1, 10 and N calls (issue 9).

`measure()` returns the figures (tests/core/test_memory.py asserts on them): the peak is
torch.cuda.max_memory_allocated() during the call, less what was allocated before the inputs were made;
the budget is the bytes of x, dy, dx, out, timestep_indices, the four parameters and their four
gradients (the leaves are the inputs themselves, no copies). Run on a GPU:
    python3 -m adaln_lab.bench.memory_figures [ROWS] [CALLS]      (default 32768 rows, 1000 calls; prints JSON)
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from adaln_lab import final_adaln_out
from adaln_lab.harness.inputs import LEAVES, make, upstream


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure(rows: int = 32768, calls: int = 1000, **shape) -> dict:
    """Figures of one forward+backward at `rows` rows (H, D, T: make's defaults, the real sizes, unless given)."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    inputs = make(1, rows, "cuda", **shape)
    leaves = [t.requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    dy = upstream(1, inputs.x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = final_adaln_out(*leaves, idx, backend="cupy")
    out.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    tensors = {"x": inputs.x, "dy": dy, "dx": inputs.x.grad, "out": out, "timestep_indices": idx}
    for name, leaf in zip(LEAVES[1:], leaves[1:]):
        tensors[name] = leaf
        tensors[f"d_{name}"] = leaf.grad
    tensor_bytes = {name: _bytes(t) for name, t in tensors.items()}
    budget = sum(tensor_bytes.values())
    del out

    allocated = {}
    for n in range(1, calls + 1):
        for leaf in leaves:
            leaf.grad = None
        final_adaln_out(*leaves, idx, backend="cupy").backward(dy)
        if n in (1, 10, calls):
            torch.cuda.synchronize()
            allocated[n] = torch.cuda.memory_allocated() - base
    return {
        "rows": rows, "shape": {name: tuple(t.shape) for name, t in tensors.items()},
        "tensor_bytes": tensor_bytes, "budget_bytes": budget, "limit_bytes": int(1.05 * budget),
        "peak_bytes": peak, "peak_over_budget": peak / budget, "extra_bytes": peak - budget,
        "calls": calls, "allocated_after_call": allocated,
        "growth_bytes": allocated[calls] - allocated[min(10, calls)],
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(measure(*args), indent=1))
