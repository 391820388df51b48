"""Where the host time of one eager forward+backward goes: norm_out and one H3 block's AdaLN path, on a GPU.

For each op: the host time of forward+backward (perf_counter from the call to `.backward()` returning, the
device synchronised before each sample, median of 200 after 30 warm-ups) of adaln_lab, of diffusers' ops
(the replay) and of the identity autograd floor over the same leaves, in one run; then cProfile over 500
calls of adaln_lab's, the functions by their own time per call. cProfile adds its own cost per Python call:
read its shares, not its absolute figures.

    python3 bench/scripts/host_breakdown.py [--rows 4097] > host_breakdown.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.harness.block_report import EPS, make_block
from adaln_lab.harness.inputs import make
from adaln_lab.reference import replay
from adaln_lab.reference.block import replay_block_adaln


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *leaves):
        return leaves[0].clone()

    @staticmethod
    def backward(ctx, dy):
        return (dy,) + (None,) * (len(ctx.needs_input_grad) - 1)


def passthrough(h):
    return h


def host_us(step, leaves, samples=200, warmup=30) -> float:
    times = []
    for i in range(warmup + samples):
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e6)
    return statistics.median(times)


def profile(step, leaves, calls=500) -> str:
    prof = cProfile.Profile()
    for i in range(calls):
        for leaf in leaves:
            leaf.grad = None
        if i % 50 == 0:
            torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats(25)
    total = sum(row[2] for row in stats.stats.values())
    return f"profiled own time per call: {total / calls * 1e6:.1f} us\n" + out.getvalue()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4097)
    args = parser.parse_args()
    n = args.rows

    inputs = make(3, n, "cuda")
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)
    steps = {
        "final_adaln_out adaln_lab": lambda: final_adaln_out(*leaves, idx).backward(ones),
        "final_adaln_out diffusers replay": lambda: replay(*leaves, idx).backward(ones),
        "final_adaln_out identity floor": lambda: Identity.apply(*leaves).backward(ones),
    }
    for name, step in steps.items():
        print(f"{name}: host fwd+bwd {host_us(step, leaves):.0f} us at {n} rows")

    block = make_block(3, n, "cuda")
    b_leaves = [t.detach().clone().requires_grad_(True) for t in block.leaves]
    x, n1, n2, temb, w, b = b_leaves
    bidx = block.timestep_indices
    b_ones = torch.ones_like(block.x)

    def ours():
        block_adaln_path(x, temb, w, b, n1, n2, bidx, passthrough, passthrough, EPS, EPS).backward(b_ones)

    def theirs():
        replay_block_adaln(x, temb, w, b, n1, n2, bidx, passthrough, passthrough, EPS, EPS).backward(b_ones)

    block_steps = {"block adaln_lab": ours, "block diffusers replay": theirs,
                   "block identity floor": lambda: Identity.apply(*b_leaves).backward(b_ones)}
    for name, step in block_steps.items():
        print(f"{name}: host fwd+bwd {host_us(step, b_leaves):.0f} us at {n} rows")
    print("\n== cProfile: final_adaln_out adaln_lab ==")
    print(profile(steps["final_adaln_out adaln_lab"], leaves))
    print("\n== cProfile: block adaln_lab ==")
    print(profile(ours, b_leaves))


if __name__ == "__main__":
    main()
