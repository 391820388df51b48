"""Where the host time of one eager forward+backward goes (issue 7's host bar): cProfile over many calls.

Runs 2,000 eager forward+backward calls of `final_adaln_out` at 4097 rows (H 5376, D 2688, T 3) under
cProfile, with a synchronize every 50 calls so the GPU queue never fills, and prints the functions by
their own time (tottime) per call, in us. Not a timing protocol: cProfile adds its own overhead per
Python call, so read the shares, not the absolute figures. Run (on a GPU):
    python3 bench/scripts/host_profile.py > host_profile.txt
"""

import cProfile
import io
import pstats

import torch

from adaln_lab import final_adaln_out
from adaln_lab.harness.inputs import make

CALLS = 2000


def main():
    inputs = make(1, 4097, "cuda")
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)

    def call():
        for leaf in leaves:
            leaf.grad = None
        final_adaln_out(*leaves, idx).backward(ones)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for i in range(CALLS):
        call()
        if i % 50 == 49:
            torch.cuda.synchronize()
    profile.disable()
    torch.cuda.synchronize()
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream).sort_stats("tottime")
    stats.print_stats(30)
    total = sum(row[2] for row in stats.stats.values())
    print(f"{CALLS} calls; profiled own time per call: {total / CALLS * 1e6:.1f} us")
    print(stream.getvalue())


if __name__ == "__main__":
    main()
