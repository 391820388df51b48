"""Forward+backward of the CUDA op at small shapes, S = 0 and S = 1 included: the workload that
bench/sanitize/run.sh runs under each compute-sanitizer tool (memcheck, racecheck, initcheck, synccheck)."""

import torch

from adaln_lab import final_adaln_out
from adaln_lab.harness.inputs import make, upstream

for shape in (dict(H=264, D=64, T=3), dict(H=1024, D=256, T=1), dict(H=5376, D=2688, T=3)):
    for rows in (0, 1, 7, 300):
        if shape["H"] == 5376 and rows == 300:
            continue
        i = make(1, rows, "cuda", **shape)
        leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
        out = final_adaln_out(*leaves, i.timestep_indices)
        out.backward(upstream(1, i.x))
        torch.cuda.synchronize()
        assert all(torch.isfinite(leaf.grad.float()).all() for leaf in leaves)
print("small calls done")
