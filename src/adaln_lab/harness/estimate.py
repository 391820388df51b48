"""How long a protocol will take on this device, measured before it starts.

`invariance_batches(protocol)` lists the rows of every differentiated call `report.batch_invariance`
makes; `report_batches` adds the accuracy and timing calls of the report. `call_cost` times one
forward+backward of a candidate at 1 row and at `min(4097, full_batch)` rows (a warm-up call first, best
of two), which gives a cost per call and per row; `seconds` extrapolates linearly in rows.
"""

from __future__ import annotations

import time

import torch

from .calls import forward_backward
from .inputs import make, upstream
from .invariance import sub_batch_starts, sweep_positions
from .protocol import Protocol

PROBE_ROWS = 4097


def invariance_batches(protocol: Protocol, repeats: int = 3) -> list[int]:
    """Rows of each call of `report.batch_invariance`, in no particular order (len: `invariance_calls`)."""
    p = protocol
    rows = []
    for n in p.all_rows_sizes:
        rows += [n, *[1] * n] * len(p.seeds)
    rows += [p.accuracy_sizes[0]] * repeats
    for _ in p.sub_batch_seeds:
        rows.append(p.full_batch)
        for size in p.sub_batch_sizes:
            rows += [min(size, p.full_batch - start)
                     for start in sub_batch_starts(p.full_batch, size, p.small_limit, p.small_step)]
    for _ in p.seeds:
        rows += [p.pool_size, p.pool_size]
        for b in p.sweep_sizes:
            rows += [b] * (len(sweep_positions(b)) * len(p.probe_rows))
    return rows


def report_batches(protocol: Protocol) -> list[int]:
    """`invariance_batches` plus the report's accuracy and timing calls of one candidate: per accuracy
    size one accuracy call and six timers of warmup + iters calls (CUDA-graph replays left out)."""
    p = protocol
    timing = [S for S in p.accuracy_sizes for _ in range(1 + 6 * (p.warmup + p.iters))]
    return invariance_batches(p) + timing


def call_cost(fn, protocol: Protocol, device: torch.device) -> tuple[float, float]:
    """(seconds per call, seconds per row) of `fn`'s forward+backward at the protocol's H, D, T."""
    device = torch.device(device)
    sizes = (1, max(2, min(PROBE_ROWS, protocol.full_batch)))
    times = []
    for n in sizes:
        inputs = make(protocol.seeds[0], n, device, **protocol.shape)
        dy = upstream(protocol.seeds[0], inputs.x)
        forward_backward(fn, inputs, dy)  # warm-up: lazy init, compilation, caches
        best = float("inf")
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            forward_backward(fn, inputs, dy)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    per_row = max(0.0, (times[1] - times[0]) / (sizes[1] - sizes[0]))
    return max(0.0, times[0] - per_row), per_row


def seconds(cost: tuple[float, float], batches: list[int]) -> float:
    """Extrapolated seconds of calls with these row counts at `cost` = (per call, per row)."""
    return cost[0] * len(batches) + cost[1] * sum(batches)


def minutes(total_seconds: float) -> str:
    """'about N s' under a minute, 'about N min', or 'about N h' from 120 minutes on."""
    if total_seconds < 60:
        return f"about {max(1, round(total_seconds))} s"
    m = total_seconds / 60
    if m >= 120:
        return f"about {m / 60:.1f} h ({m:.0f} min)"
    return f"about {max(1, round(m))} min"
