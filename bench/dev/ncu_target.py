"""Two forward+backward calls of the CUDA op at 32768 rows, for Nsight Compute to profile
(development aid). Run: ncu -k regex:"table_bf16|norm_modulate|table_bwd_bf16" --launch-skip 4
--launch-count 4 --section SpeedOfLight --section Occupancy --section WarpStateStats
python bench/dev/ncu_target.py"""

import torch

from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make

i = make(1, 32768, "cuda")
fn = adaln_lab_candidate().fn
leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
ones = torch.ones_like(i.x)
for _ in range(2):
    fn(*leaves, i.timestep_indices).backward(ones)
torch.cuda.synchronize()
