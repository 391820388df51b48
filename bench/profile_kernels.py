"""Per-kernel cost of the cupy backend at the seed sizes: development aid for bench/NOTES.md.

For each launcher: `gpu_us` (20 back-to-back calls between two CUDA events, divided by 20: the
GPU time when the CPU keeps ahead), `cpu_us` (Python time of one call, no sync), the bytes it
must move and the bandwidth that makes; plus registers and spill bytes of every kernel. Then the
whole op as the report times it (sync before each sample) and back to back.
"""

import json
import statistics
import sys
import time

import torch

from adaln_lab import cupy_backend as cb
from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make, upstream

REPS = 20


def gpu_us(step):
    for _ in range(3):
        step()
    samples = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(REPS):
            step()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / REPS)
    return statistics.median(samples)


def cpu_us(step):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / REPS


def main():
    H, D, T = 5376, 2688, 3
    out = {"resources": cb.kernel_resources(0, H, D, T)}
    for S in (4097, 32768):
        i = make(1, S, "cuda")
        dy = upstream(1, i.x)
        tab, tab32 = cb.table(i.temb, i.weight, i.bias)
        y, rstd = cb.norm_modulate(i.x, i.norm_weight, tab, i.timestep_indices, 1e-5, D)
        dx, parts = cb.norm_modulate_bwd(dy, i.x, rstd, i.norm_weight, tab32, i.timestep_indices, D)
        dtab, dnw, db = cb.reduce_partials(parts, i.norm_weight, tab32, D)
        row = S * H * 2
        steps = {
            "table": (lambda: cb.table(i.temb, i.weight, i.bias), 2 * H * D * 2),
            "norm_modulate": (lambda: cb.norm_modulate(i.x, i.norm_weight, tab, i.timestep_indices, 1e-5, D), 2 * row),
            "norm_modulate_bwd": (lambda: cb.norm_modulate_bwd(dy, i.x, rstd, i.norm_weight, tab32,
                                                               i.timestep_indices, D), 3 * row + parts.numel() * 4),
            "reduce_partials": (lambda: cb.reduce_partials(parts, i.norm_weight, tab32, D), parts.numel() * 4),
            "table_bwd": (lambda: cb.table_bwd(dtab, i.temb, i.weight), 2 * 2 * H * D * 2),
        }
        entry = {}
        for name, (step, nbytes) in steps.items():
            g = gpu_us(step)
            entry[name] = {"gpu_us": g, "cpu_us": cpu_us(step), "TBps": nbytes / g / 1e6}
        fn = adaln_lab_candidate().fn
        leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
        ones = torch.ones_like(i.x)

        def fwd():
            fn(*leaves, i.timestep_indices)

        def fwd_bwd():
            for leaf in leaves:
                leaf.grad = None
            fn(*leaves, i.timestep_indices).backward(ones)

        entry["op_fwd"] = {"gpu_us": gpu_us(fwd), "cpu_us": cpu_us(fwd)}
        entry["op_fwd_bwd"] = {"gpu_us": gpu_us(fwd_bwd), "cpu_us": cpu_us(fwd_bwd)}
        entry["row_ranges"] = parts.shape[0]
        out[S] = entry
        if S == 4097 and "--cprofile" in sys.argv:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(lambda: [fwd_bwd() for _ in range(REPS)])
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(12)
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
