"""Where the CPU time of forward+backward goes at 4097 rows (development aid for bench/NOTES.md).

Prints JSON: per-iteration wall time of the forward call and of `.backward()`; whether the GPU
had already finished when `.backward()` returned (a hidden host sync if so); the CPU time of each
launcher called inside the backward (wrapped with perf_counter); the same backward chain called
directly from the main thread; and torch's sync-debug verdict on the backward.
Run: python bench/dev/backward_cpu.py
"""

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_costs import spent, timed  # noqa: E402  (one timing wrapper for both scripts)

from adaln_lab import cupy_backend as cb  # noqa: E402
from adaln_lab.harness.candidates import adaln_lab_candidate  # noqa: E402
from adaln_lab.harness.inputs import make  # noqa: E402

REPS = 30


def main():
    S, D = 4097, 2688
    i = make(1, S, "cuda")
    fn = adaln_lab_candidate().fn
    leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
    ones = torch.ones_like(i.x)
    for _ in range(5):
        fn(*leaves, i.timestep_indices).backward(ones)
    torch.cuda.synchronize()

    for name in ("norm_modulate_bwd", "reduce_partials", "table_bwd", "_launch"):
        setattr(cb, name, timed(name, getattr(cb, name)))
    original_backward = cb.FinalAdaLNOut.backward
    cb.FinalAdaLNOut.backward = staticmethod(timed("backward_body", original_backward))

    fwd, bwd, done_at_return, total = [], [], [], []
    for _ in range(REPS):
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*leaves, i.timestep_indices)
        t1 = time.perf_counter()
        out.backward(ones)
        t2 = time.perf_counter()
        done_at_return.append(torch.cuda.current_stream().query())
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        fwd.append((t1 - t0) * 1e6)
        bwd.append((t2 - t1) * 1e6)
        total.append((t3 - t0) * 1e6)

    # the same backward chain from the main thread, no autograd
    x, nw, temb, w, b = leaves
    tab, tab32 = cb.table(temb.detach(), w.detach(), b.detach())
    y, rstd = cb.norm_modulate(x.detach(), nw.detach(), tab, i.timestep_indices, 1e-5, D)
    direct = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dx, parts = cb.norm_modulate_bwd(ones, x.detach(), rstd, nw.detach(), tab32, i.timestep_indices, D)
        dtab, dnw, db = cb.reduce_partials(parts, nw.detach(), tab32, D)
        cb.table_bwd(dtab, temb.detach(), w.detach())
        direct.append((time.perf_counter() - t0) * 1e6)

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, i.timestep_indices).backward(ones)
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("default")

    med = statistics.median
    report = {
        "forward_call_us": med(fwd), "backward_call_us": med(bwd), "iteration_wall_us": med(total),
        "gpu_done_when_backward_returned": sum(done_at_return), "of": REPS,
        "inside_backward_us": {k: med(v) for k, v in spent.items()},
        "calls_per_iteration": {k: len(v) / REPS for k, v in spent.items()},
        "direct_chain_cpu_us": med(direct),
        "sync_warnings": [str(w.message)[:200] for w in caught],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
