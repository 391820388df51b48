"""GPU timers of the evidence tools: back-to-back calls between two CUDA events, and CUDA-graph replays.

`step` is any callable that launches work on torch's current CUDA stream; the figures are microseconds per call.
"""

from __future__ import annotations

import statistics

import torch

REPS = 20


def gpu_us(step, reps: int = REPS) -> float:
    """Median over 5 samples of `reps` back-to-back calls between two CUDA events, per call."""
    for _ in range(3):
        step()
    samples = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            step()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(samples)


def graph_us(step, reps: int = REPS) -> float:
    """`step` captured once in a CUDA graph (after a warm-up on a side stream), replays timed like gpu_us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return gpu_us(graph.replay, reps)
