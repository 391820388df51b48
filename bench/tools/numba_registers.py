"""Registers, local memory and the largest block of each numba-cuda backward kernel at H = 5376 (on a GPU)."""

# Registers, local memory and the largest block of each numba-cuda backward kernel at H = 5376 (issue 10).
#
# The twin's row pass launches plan.bwd_threads = 672 threads; numba leaves the register count to ptxas
# unless jit options bound it (numba_kernels._register_limit), and a kernel using more than
# 65536 / 672 registers per thread fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES. This runs the twin's
# backward once on a few rows and prints, per kernel, what the driver reports. Run on a GPU:
#     python3 bench/tools/numba_registers.py         (prints JSON)

import argparse
import json

import torch

from adaln_lab.ops.final_adaln_out.twin import backward as numba_backward, backward_kernels as numba_kernels
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.core.plan import plan


def main():
    inputs = make(1, 64, "cuda")
    dy = upstream(1, inputs.x)
    p = plan(inputs.x.shape[-1], inputs.temb.shape[1], inputs.temb.shape[0])
    report = {"bwd_threads": p.bwd_threads, "options": numba_kernels._register_limit(p.bwd_threads)}
    try:  # rstd and the table are stand-ins: what matters here is whether the kernels launch
        numba_backward.backward(dy, inputs.x, torch.ones(inputs.x.shape[0], device="cuda"), inputs.norm_weight,
                                torch.zeros(p.T, 2 * p.H, device="cuda"), inputs.timestep_indices, inputs.temb,
                                inputs.weight)
        torch.cuda.synchronize()
        report["launch"] = "ok"
    except Exception as error:  # the report says what failed; the kernels' figures follow
        report["launch"] = f"{type(error).__name__}: {str(error)[:200]}"
    for name in ("norm_modulate_bwd_kernel", "reduce_partials_kernel", "table_bwd_kernel", "table_bwd_reduce_kernel"):
        kernel = getattr(numba_backward, name)(p)
        figures = {}
        for what in ("get_regs_per_thread", "get_max_threads_per_block", "get_local_mem_per_thread",
                     "get_shared_mem_per_block"):
            try:
                figures[what] = {str(k): v for k, v in getattr(kernel, what)().items()}
            except Exception as error:
                figures[what] = f"{type(error).__name__}: {error}"
        report[name] = figures
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    if not torch.cuda.is_available():
        raise SystemExit("numba_registers.py needs a CUDA GPU (the driver reports the kernels' registers): none here")
    main()
