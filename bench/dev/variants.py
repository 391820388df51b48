"""Development A/B of launch geometries (forward and backward given the same cap) in one run (same inputs, same process), plus a CPU profile
of one forward+backward at 4097 rows. Not evidence: it picks what the kernels should use."""

import json
import sys

import torch

from adaln_lab import cupy_backend as cb
from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make, upstream

sys.path.insert(0, "bench")
from profile_kernels import gpu_us  # noqa: E402

D = 2688
out = {}
for S in (4097, 32768):
    i = make(1, S, "cuda")
    dy = upstream(1, i.x)
    tab, tab32 = cb.table(i.temb, i.weight, i.bias)
    for threads_max in (1024, 512, 256):
        for ranges in (132, 264, 528):
            cb.FWD_THREADS_MAX = cb.BWD_THREADS_MAX = threads_max
            cb.ROW_RANGES = ranges
            cb._module.cache_clear()
            cb.source.cache_clear()
            y, rstd = cb.norm_modulate(i.x, i.norm_weight, tab, i.timestep_indices, 1e-5, D)
            key = f"{S} thr{cb.row_geometry(5376, threads_max)} ranges{ranges}"
            out[key] = {
                "fwd": gpu_us(lambda: cb.norm_modulate(i.x, i.norm_weight, tab, i.timestep_indices, 1e-5, D)),
                "bwd": gpu_us(lambda: cb.norm_modulate_bwd(dy, i.x, rstd, i.norm_weight, tab32, i.timestep_indices, D)),
                "regs": {k: v["registers"] for k, v in cb.kernel_resources(0, 5376, D, 3).items()
                         if k.startswith("norm")},
            }
            print(key, json.dumps(out[key]), flush=True)
cb.FWD_THREADS_MAX, cb.BWD_THREADS_MAX, cb.ROW_RANGES = 256, 1024, 132
cb._module.cache_clear()
cb.source.cache_clear()

i = make(1, 4097, "cuda")
fn = adaln_lab_candidate().fn
leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
ones = torch.ones_like(i.x)
for _ in range(5):
    fn(*leaves, i.timestep_indices).backward(ones)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, i.timestep_indices).backward(ones)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
