"""Two forward+backward calls (norm_out, one H3 block, or the table kernel alone) for Nsight Compute to profile."""

# Two forward+backward calls at 32768 rows for Nsight Compute to profile (development aid): norm_out's CUDA
# op (default) or, with `block`, one H3 block's AdaLN path (H 5376, D 2688, T 3: the block report's inputs); with
# `table`, norm_out's table kernel alone, three times (H 5376, D 2688, T 3).
# (-k filters first: --launch-skip and --launch-count count only the kernels it matches.)
#
# Run (on the GPU machine; ncu is on the PATH there):
#     ncu -k regex:"table_bf16|norm_modulate|table_bwd_bf16" --launch-skip 4 --launch-count 4 \
#         --section SpeedOfLight --section Occupancy --section WarpStateStats python3 bench/tools/ncu_target.py
#     ncu -k regex:"norm_modulate_bwd_residual|gated_residual_bwd" --launch-skip 4 --launch-count 4 \
#         --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
#         python3 bench/tools/ncu_target.py block
#     ncu -k regex:table_bf16 --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
#         --section WarpStateStats --section SchedulerStats python3 bench/tools/ncu_target.py table
# (the second: where the block's row backward passes stall, bench/NOTES.md v13 says why that is the question; the
# third: the table kernel, bench/NOTES.md v21)
# With `exact`, norm_out's two calls run inside adaln_lab.nn.ExactGradients (the exact route: the row pass with its
# sums exact, exact_row_pass.cu; bench/NOTES.md v58 asks whether issue or latency binds it):
#     ncu -k regex:"norm_modulate_bwd" --launch-skip 1 --launch-count 1 --section SpeedOfLight \
#         --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
#         python3 bench/tools/ncu_target.py exact
# (`exact ROWS`, `plain ROWS`: at another row count; every kernel of the second call, each one's time:
# --launch-skip the first call's kernels, or drop -k and read the second half)

import sys

import torch

from adaln_lab.harness import block_report as br
from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make

MODE = sys.argv[1] if len(sys.argv) > 1 else ""
ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 32768  # `exact 4097`: another row count
if MODE == "table":
    from adaln_lab.core import tensors

    inputs = make(1, 8, "cuda")
    for _ in range(3):
        tensors.table(inputs.temb, inputs.weight, inputs.bias)
    torch.cuda.synchronize()
    sys.exit(0)
if MODE == "block":
    inputs = br.make_block(1, ROWS, "cuda", H=br.H_REAL, D=br.D_REAL, T=br.T_REAL)
    fn = br.CANDIDATES["adaln_lab"][1](br.H_REAL, br.D_REAL)
else:
    inputs = make(1, ROWS, "cuda")
    fn = adaln_lab_candidate().fn
leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
ones = torch.ones_like(inputs.x)
for _ in range(2):
    if MODE == "exact":
        from adaln_lab import final_adaln_out
        from adaln_lab.nn import ExactGradients

        with ExactGradients():  # the states are dropped unwritten: only the passes are profiled
            final_adaln_out(*leaves, inputs.timestep_indices, backend="cupy").backward(ones)
    else:
        fn(*leaves, inputs.timestep_indices).backward(ones)
torch.cuda.synchronize()
