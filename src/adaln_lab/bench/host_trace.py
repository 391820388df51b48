"""Why the host time of one eager forward+backward grows with the rows: a diagnosis, on a GPU.

The host time of a call should not depend on how much work its kernels do (the launches are asynchronous),
yet the report's figures grow from 4097 to 32768 rows (norm_out 257 -> 574 us, diffusers 703 -> 1153).
For norm_out (adaln_lab and the diffusers replay) and the identity autograd floor, at each size:
- `fwd`: the forward call alone (device synchronised before, perf_counter around the call);
- `bwd after fwd`: `.backward()` issued right after the forward, as the report times it (the GPU still busy
  with the forward's kernels);
- `bwd idle`: `.backward()` after a synchronize (the GPU idle when it starts).
If `bwd after fwd` grows with rows while `bwd idle` does not, something in the backward waits for the
forward's GPU work. Then torch.profiler over 20 forward+backward calls at the largest size: the CPU-side
events (runtime and driver API calls included) by their own CPU time, which names the call that waits.

    python3 -m adaln_lab.bench.host_trace [--rows 4097 32768] > host_trace.txt
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaln_lab import final_adaln_out
from adaln_lab.bench.host_breakdown import Identity
from adaln_lab.harness.inputs import make
from adaln_lab.reference import replay


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


DEVICE = "cuda"


def phases(fn, leaves, idx, ones, samples=100, warmup=20) -> dict:
    """Median us of the forward call, the backward right after it, and the backward after a synchronize."""
    fwd, bwd_busy, bwd_idle = [], [], []
    for i in range(warmup + samples):
        for leaf in leaves:
            leaf.grad = None
        sync()
        t0 = time.perf_counter()
        out = fn(*leaves, idx)
        t1 = time.perf_counter()
        out.backward(ones)
        t2 = time.perf_counter()
        for leaf in leaves:
            leaf.grad = None
        sync()
        out = fn(*leaves, idx)
        sync()
        t3 = time.perf_counter()
        out.backward(ones)
        t4 = time.perf_counter()
        del out
        if i >= warmup:
            fwd.append((t1 - t0) * 1e6)
            bwd_busy.append((t2 - t1) * 1e6)
            bwd_idle.append((t4 - t3) * 1e6)
    return {"fwd": statistics.median(fwd), "bwd after fwd": statistics.median(bwd_busy),
            "bwd idle": statistics.median(bwd_idle)}


def backward_profile(fn, leaves, idx, ones, calls=200) -> str:
    """cProfile of `.backward()` alone, each started on an idle GPU: the functions by own time per call."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(calls):
        for leaf in leaves:
            leaf.grad = None
        out = fn(*leaves, idx)
        sync()
        prof.enable()
        out.backward(ones)
        prof.disable()
        del out
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


def trace(fn, leaves, idx, ones, calls=20) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn(*leaves, idx).backward(ones)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])) as prof:
        for _ in range(calls):
            for leaf in leaves:
                leaf.grad = None
            sync()
            fn(*leaves, idx).backward(ones)
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[4097, 32768])
    parser.add_argument("--device", default="cuda", help="cpu: try the script without a GPU")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    candidates = {"adaln_lab": final_adaln_out, "diffusers replay": replay,
                  "identity floor": lambda *a: Identity.apply(*a[:-1])}
    print("us per call, medians of 100 (device synchronised before each forward)")
    print(f"{'rows':>6} {'candidate':<18} {'fwd':>8} {'bwd after fwd':>14} {'bwd idle':>9}")
    for n in args.rows:
        inputs = make(3, n, DEVICE)
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
        idx, ones = inputs.timestep_indices, torch.ones_like(inputs.x)
        for name, fn in candidates.items():
            p = phases(fn, leaves, idx, ones)
            print(f"{n:>6} {name:<18} {p['fwd']:8.0f} {p['bwd after fwd']:14.0f} {p['bwd idle']:9.0f}", flush=True)
    for n in args.rows:
        inputs = make(3, n, DEVICE)
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
        print(f"\n== cProfile of adaln_lab's backward alone, {n} rows, 200 calls ==")
        print(backward_profile(final_adaln_out, leaves, inputs.timestep_indices, torch.ones_like(inputs.x)))
    n = max(args.rows)
    inputs = make(3, n, DEVICE)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx, ones = inputs.timestep_indices, torch.ones_like(inputs.x)
    for name in ("adaln_lab", "diffusers replay"):
        print(f"\n== torch.profiler, {name}, {n} rows, 20 forward+backward calls: events by own CPU time ==")
        print(trace(candidates[name], leaves, idx, ones))


if __name__ == "__main__":
    main()
